"""A response cut off at the length limit scores 0, where the rule bites: each response holds the correct
\\boxed{} and is then cut at max_tokens (tests/scripted_engine.py). Every trainer's loop (one step, in-process, its
rollout engine replaced), held-out evaluation and Monte Carlo values must give it 0; the same text ending with the
EOS ("stop") must score 1, so each test can fail."""
import importlib
import os
import sys

import pytest

import common
import infra.evaluate
import infra.run
from helpers import records, with_forks
from scripted_engine import ScriptedEngine

SMALL = ["--steps", 1, "--eval-problems", 2, "--eval-n", 1, "--max-response-tokens", 24, "--eval-max-tokens", 24,
         "--prompts-per-step", 2, "--samples-per-prompt", 4, "--mini-batches", 2, "--micro-batch-size", 4]
PROBED = ["--critic-warmup", 0, "--probe-every", 1, "--probe-prompts", 2, "--probe-continuations", 2]
LOOPS = {"grpo": ("grpo", SMALL), "ppo": ("ppo", SMALL + PROBED), "sp3o": ("sp3o", SMALL + PROBED),
         "tppo": ("tppo", SMALL + PROBED), "spo-chain": ("spo", SMALL + ["--mc-samples", 2]),
         "spo-tree": ("spo", SMALL + ["--mode", "tree", "--tree-prompts", 2, "--tree-branching", 2, "--tree-depth", 2,
                                      "--tree-segment-tokens", 20]),
         "sppo": ("sppo", SMALL + PROBED + ["--samples-per-prompt", 1, "--prompts-per-step", 4,
                                            "--micro-batch-size", 2])}
LOOPS.update({name: (name, flags) for name, flags in with_forks({t: f for t, f in LOOPS.values()}).items()
              if name not in {t for t, _ in LOOPS.values()}})  # a fork runs with its nearest trainer's flags


def run_loop(monkeypatch, tmp_path, trainer, argv, finish):
    """One step of `trainer` with every rollout from ScriptedEngine(finish); returns (its logged record, engine)."""
    engines = []

    def make_generator(kind, model, tokenizer, *args, **kwargs):
        engines.append(ScriptedEngine(tokenizer, finish))
        return engines[-1]
    monkeypatch.setattr(infra.run, "make_generator", make_generator)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *map(str, argv), "--run-name", finish, "--output-dir",
                                      str(tmp_path)])
    importlib.import_module(trainer).main()
    return records(os.path.join(tmp_path, finish))[0], engines[0]


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_response_cut_after_a_correct_answer_scores_0_in_every_trainer(loop, monkeypatch, tmp_path):
    trainer, argv = LOOPS[loop]
    if not os.path.exists(os.path.join(os.path.dirname(common.__file__), f"{trainer}.py")):
        pytest.skip(f"{trainer}.py is not there")
    cut, engine = run_loop(monkeypatch, tmp_path, trainer, argv, "length")
    finished, _ = run_loop(monkeypatch, tmp_path, trainer, argv, "stop")
    assert "\\boxed{" in engine.tokenizer.decode(engine.generate([engine.calls[0][0][0]], 1, 24)[0].token_ids)
    assert (cut["reward"], cut["eval/accuracy"]) == (0.0, 0.0), cut
    assert (finished["reward"], finished["eval/accuracy"]) == (1.0, 1.0), finished
    assert cut["truncated"] == 1.0 and finished["truncated"] == 0.0
    if "probe/mc_mean" in cut or "probe/mc_mean" in finished:  # the critic probes' Monte Carlo values
        assert cut["probe/mc_mean"] == 0.0 and finished["probe/mc_mean"] > 0.0


def test_evaluation_scores_a_cut_response_0(tiny):
    _, tokenizer = tiny
    rows = [{"question": "12+30", "answer": "42"}, {"question": "5+6", "answer": "11"}]
    for finish, accuracy in (("length", 0.0), ("stop", 1.0)):
        metrics = infra.evaluate.evaluate(ScriptedEngine(tokenizer, finish), tokenizer, {"set": rows}, n=2,
                                          max_tokens=20)
        assert metrics["eval/set/avg@2"] == metrics["eval/set/pass@1"] == metrics["eval/accuracy"] == accuracy
        assert metrics["eval/set/truncated"] == 1.0 - accuracy


def test_monte_carlo_values_of_cut_continuations_are_0(tiny):
    """V(s) of states whose continuations hold the correct answer: 0 when they are cut at the budget, 1 when they
    stop within it (the prefix counts toward max_tokens: a 4-token prefix leaves 16 of 20)."""
    _, tokenizer = tiny
    prompt = common.prompt_ids(tokenizer, "12+30")
    states = [(prompt, tokenizer.encode(prefix, add_special_tokens=False)) for prefix in ("1 2 ", "3 4 ", "1 2 ")]
    for finish, value in (("length", 0.0), ("stop", 1.0)):
        engine = ScriptedEngine(tokenizer, finish)
        values, tokens = common.monte_carlo_values(engine, tokenizer, states, [{"answer": "42"}] * 3, 3, 20)
        assert values.tolist() == [value] * 3 and engine.calls[0][1:] == (3, 16) and tokens == 2 * 3 * 16
