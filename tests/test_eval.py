"""Tests for the evaluation in common.py: pass@k, avg@n, eval-set loading, the table, --eval-only, repetition."""
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import infra.data
import infra.evaluate
import infra.log
import infra.run
import infra.samples
import infra.tiny

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
needs_data = pytest.mark.skipif(not os.path.isdir(DATA), reason=f"benchmark data folder {DATA} is absent")


class ScriptedGenerator:
    """generate() returns, for prompt i and sample j, the scripted (text, finish_reason) script[i][j]."""

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts, self.calls = tokenizer, scripts, []

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        self.calls.append((len(prompts), n, max_tokens, temperature, top_p))
        out = []
        for i in range(len(prompts)):
            for text, finish in self.scripts[i][:n]:
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += [self.tokenizer.eos_token_id] if finish == "stop" else []
                out.append(common.Completion(i, ids, text, [0.0] * len(ids), finish))
        return out

    def close(self):  # the engine contract: Run.close shuts the engine down
        pass


@dataclass
class EvalArgs:
    eval_n: int = 2
    eval_max_tokens: int = 16
    eval_temperature: float = 1.0
    eval_top_p: float = 0.95
    seed: int = 0
    tensorboard: bool = False
    wandb_project: str = ""


@pytest.fixture(scope="module")
def tokenizer():
    return common.load_tokenizer("tiny")


# ---------------------------------------------------------------- pass@k
def test_pass_at_k_hand_values():
    assert infra.evaluate.pass_at_k(2, 1, 1) == pytest.approx(0.5)
    assert infra.evaluate.pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert infra.evaluate.pass_at_k(5, 2, 3) == pytest.approx(0.9)  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert infra.evaluate.pass_at_k(8, 0, 8) == 0.0
    assert infra.evaluate.pass_at_k(8, 1, 8) == 1.0
    assert infra.evaluate.pass_at_k(8, 7, 1) == pytest.approx(7 / 8)


def test_pass_at_k_matches_closed_form():
    for n in range(1, 11):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert infra.evaluate.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 0, 5), (4, 5, 1), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            infra.evaluate.pass_at_k(n, c, k)


# ---------------------------------------------------------------- evaluate
def test_evaluate_avg_and_pass_at_k_by_hand(tokenizer):
    rows = [{"question": "100+200", "answer": "300"}, {"question": "111+111", "answer": "222"}]
    right, wrong = "1+2=3 \\boxed{300}", "\\boxed{301}"
    scripts = [[(right, "stop"), (wrong, "stop"), (right, "stop"), (right, "length")],  # the cut-off one scores 0
               [(wrong, "stop")] * 4]
    generator = ScriptedGenerator(tokenizer, scripts)
    rng_before = torch.get_rng_state()
    metrics = infra.evaluate.evaluate(generator, tokenizer, {"set": rows}, n=4, max_tokens=9, temperature=1.0,
                                      top_p=0.95)
    assert torch.equal(torch.get_rng_state(), rng_before)  # evaluation leaves the training RNG alone
    assert generator.calls == [(2, 4, 9, 1.0, 0.95)]  # one request, the eval flags passed through
    # correct counts: row 0 -> c = 2 of 4, row 1 -> 0 of 4
    assert metrics["eval/set/avg@4"] == pytest.approx(2 / 8)
    assert metrics["eval/set/pass@1"] == pytest.approx((2 / 4 + 0) / 2)
    assert metrics["eval/set/pass@2"] == pytest.approx((1 - 1 / 6 + 0) / 2)  # 1 - C(2,2)/C(4,2)
    assert metrics["eval/set/pass@4"] == pytest.approx((1 + 0) / 2)
    assert metrics["eval/set/truncated"] == pytest.approx(1 / 8)
    assert metrics["eval/set/repetition"] == 0.0
    assert metrics["eval/accuracy"] == metrics["eval/set/avg@4"]
    assert sorted(metrics) == sorted(["eval/set/avg@4", "eval/set/pass@1", "eval/set/pass@2", "eval/set/pass@4",
                                      "eval/set/truncated", "eval/set/repetition", "eval/accuracy"])


def test_evaluate_several_sets_and_n_not_a_power_of_two(tokenizer):
    rows = [{"question": "100+200", "answer": "300"}]
    generator = ScriptedGenerator(tokenizer, [[("\\boxed{300}", "stop"), ("\\boxed{3}", "stop"), ("x", "stop")]])
    metrics = infra.evaluate.evaluate(generator, tokenizer, {"first": rows, "second": rows}, n=3)
    assert metrics["eval/first/avg@3"] == pytest.approx(1 / 3)
    assert metrics["eval/second/pass@2"] == pytest.approx(1 - 1 / 3)  # 1 - C(2,2)/C(3,2)
    assert "eval/first/pass@3" not in metrics and "eval/first/pass@4" not in metrics  # k = 1, 2 only
    assert metrics["eval/accuracy"] == metrics["eval/first/avg@3"]


def test_eval_table_lists_each_dataset():
    metrics = {"eval/math500/avg@2": 0.25, "eval/math500/pass@1": 0.25, "eval/math500/pass@2": 0.375,
               "eval/gsm8k/avg@2": 0.5, "eval/accuracy": 0.25, "reward": 1.0}
    lines = infra.evaluate.eval_table(metrics).splitlines()
    assert lines[0].split() == ["dataset", "avg@2", "pass@1", "pass@2"]
    assert lines[1].split() == ["math500", "0.2500", "0.2500", "0.3750"]
    assert lines[2].split() == ["gsm8k", "0.5000"]  # a missing column is left blank
    assert len(lines) == 3


def test_run_eval_only_logs_and_prints(tokenizer, tmp_path, capsys):
    rows = [{"question": "100+200", "answer": "300"}, {"question": "111+111", "answer": "222"}]
    generator = ScriptedGenerator(tokenizer, [[("\\boxed{300}", "stop")] * 2, [("\\boxed{9}", "stop")] * 2])
    run = object.__new__(infra.run.Run)  # what Run.__init__ and Run.start would have set up
    run.args, run.generator, run.tokenizer, run.eval_sets, run.start_step = EvalArgs(), generator, tokenizer, \
        {"tiny": rows}, 7
    run.logger, run.samples = infra.log.Logger(str(tmp_path), run.args), infra.samples.SampleLog(str(tmp_path))
    run.evaluations = []
    metrics = run.evaluate_only()
    assert run.evaluations == [(7, metrics)]  # the summary reports only evaluations that ran
    assert metrics["eval/tiny/avg@2"] == pytest.approx(0.5)
    record = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[-1])
    assert record["step"] == 7 and record["eval/tiny/pass@2"] == pytest.approx(0.5)
    out = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["tiny", "0.5000"] for line in out)
    assert "tiny #0 reward 1 (stop, 12 tok) | 100+200" in out and "  -> \\boxed{9}" in out  # two responses
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [(s["step"], s["index"], s["sample"], s["reward"]) for s in samples] == [
        (7, 0, 0, 1.0), (7, 0, 1, 1.0), (7, 1, 0, 0.0), (7, 1, 1, 0.0)]


# ---------------------------------------------------------------- eval sets
@needs_data
def test_load_eval_sets_accepts_a_list_or_a_comma_separated_string():
    math500, gsm8k = os.path.join(DATA, "math500", "test.jsonl"), os.path.join(DATA, "gsm8k", "test.jsonl")
    from_list = infra.data.load_eval_sets((math500, gsm8k), limit=5)
    from_string = infra.data.load_eval_sets(f"{math500}, {gsm8k},", limit=5)
    assert list(from_list) == list(from_string) == ["math500", "gsm8k"]
    assert [len(rows) for rows in from_list.values()] == [5, 5]
    assert from_list["gsm8k"][0] == from_string["gsm8k"][0]
    assert "####" not in from_list["gsm8k"][0]["answer"]  # the GSM8K gold is the number after ####
    assert list(infra.data.load_eval_sets([math500, math500], limit=2)) == ["math500", "math500_2"]


def test_load_eval_sets_builtin_and_empty():
    sets = infra.data.load_eval_sets(("builtin",), limit=10)
    assert list(sets) == ["builtin"] and len(sets["builtin"]) == 10
    assert all(infra.tiny.is_heldout(row["a"], row["b"]) for row in sets["builtin"])
    assert infra.data.load_eval_sets(" , ") == {}  # none given: no evaluation (a real model's default)


# ---------------------------------------------------------------- repetition
def test_ends_in_loop_cases():
    assert infra.evaluate.ends_in_loop([1, 2, 3] * 11 + [1, 2])  # period 3 over the last 35 tokens, last copy cut short
    assert not infra.evaluate.ends_in_loop([1, 2, 3] * 4)  # 12 tokens: shorter than min_tokens = 32
    assert infra.evaluate.ends_in_loop([1, 2, 3] * 4, min_tokens=0)  # 4 copies of a 3-gram
    assert not infra.evaluate.ends_in_loop([1, 2, 3] * 3, min_tokens=0)  # only 3 copies
    assert not infra.evaluate.ends_in_loop([1, 2] * 20 + [5, 6, 7, 8, 9])  # a loop that was left: not at the end
    assert infra.evaluate.ends_in_loop([7] * 40)
    assert not infra.evaluate.ends_in_loop([7] * 31)
    assert infra.evaluate.ends_in_loop("The answer is 5. " * 5)  # a string is read character by character
    assert not infra.evaluate.ends_in_loop("8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}")
    assert not infra.evaluate.ends_in_loop(list(range(30)) * 3)  # a 30-gram 3 times: fewer than 4 copies
    assert infra.evaluate.ends_in_loop(list(range(30)) * 4)
    assert not infra.evaluate.ends_in_loop([])


def test_repetition_rate_in_rollout_metrics_drops_the_eos():
    eos = 1
    looped = common.Completion(0, [7] * 40 + [eos], "", [0.0] * 41, "stop")  # loops, then stops
    cut = common.Completion(0, [5, 6] * 30, "", [0.0] * 60, "length")
    normal = common.Completion(0, list(range(2, 42)) + [eos], "", [0.0] * 41, "stop")
    completions = [looped, cut, normal, normal]
    width = max(len(c.token_ids) for c in completions)
    mask = torch.tensor([[t < len(c.token_ids) for t in range(width)] for c in completions])
    metrics = infra.evaluate.rollout_metrics(completions, torch.zeros(4), torch.zeros(4, width), mask)
    assert metrics["repetition"] == pytest.approx(2 / 4)
    assert infra.evaluate.repetition_rate([]) == 0.0


# ---------------------------------------------------------------- --eval-only end to end
@needs_data
@pytest.mark.parametrize("trainer", ["grpo.py"])
def test_eval_only_on_math500_end_to_end(trainer, tmp_path):
    math500 = os.path.join(DATA, "math500", "test.jsonl")
    result = subprocess.run([sys.executable, trainer, "--eval-only", "--model", "tiny", "--eval-datasets", math500,
                             "--eval-n", "2", "--eval-problems", "8", "--eval-max-tokens", "16",
                             "--run-name", "eval_only", "--output-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / "eval_only" / "metrics.jsonl")]
    assert len(records) == 1  # evaluated once, no training step
    record = records[0]
    assert 0.0 <= record["eval/math500/avg@2"] <= record["eval/math500/pass@2"] <= 1.0
    assert record["eval/math500/pass@1"] == pytest.approx(record["eval/math500/avg@2"])
    assert "math500" in result.stdout + result.stderr  # the printed table
    assert not os.path.exists(tmp_path / "eval_only" / "checkpoints")


def test_a_real_model_evaluates_only_what_is_asked(qwen_like_path, tmp_path, capsys):
    """Issue 39: a real model's run evaluates no built-in task unless asked; on a dataset file without
    --eval-datasets its start lines say there is no held-out evaluation, and evaluate() does nothing (issue 46: with
    no --dataset it evaluates its method's published held-out sets). The tiny demo keeps its preset's `builtin`;
    --eval-only and the critic probes (held-out prompts) are refused without sets."""
    import grpo
    import ppo
    import infra.cli
    fixture = os.path.join(ROOT, "tests", "fixtures", "slime_format.jsonl")
    real = ["--model", qwen_like_path, "--output-dir", str(tmp_path)]
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, [*real, "--dataset", fixture])
    assert args.eval_datasets == ()
    run = infra.run.Run(args, "grpo.py")
    said = capsys.readouterr().out.splitlines()
    assert run.eval_sets == {} and run.probe_rows == [] and infra.data.NO_EVAL_SETS in said, said
    assert run.evaluate(0) == {}
    assert infra.data.load_eval_sets(()) == {} and infra.data.load_eval_sets(" , ") == {}
    assert infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, []).eval_datasets == ("builtin",)  # the demo
    asked = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, [*real, "--eval-datasets", "builtin", fixture])
    assert asked.eval_datasets == ("builtin", fixture)
    assert infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--eval-datasets"]).eval_datasets == ()  # none
    for trainer, argv in ((grpo, ["--eval-only"]), (ppo, ["--probe-every", "1"])):
        flag = argv[0]
        with pytest.raises(infra.UserError, match=f"^{flag} needs held-out problems: give --eval-datasets"):
            infra.cli.parse_args(trainer.Args, trainer.TINY_PRESET, [*real, "--dataset", fixture, *argv])
        assert infra.cli.parse_args(trainer.Args, trainer.TINY_PRESET, [*real, *argv]).eval_datasets == \
            trainer.Args.eval_datasets  # the method's published sets
        with pytest.raises(infra.UserError, match=f"^{flag} needs held-out problems"):  # none, explicitly
            infra.cli.parse_args(trainer.Args, trainer.TINY_PRESET, [*argv, "--eval-datasets"])
        assert infra.cli.parse_args(trainer.Args, trainer.TINY_PRESET, argv)  # the demo's builtin: allowed
