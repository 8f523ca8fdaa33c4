"""The rollout engine sleeps through every trainer pass (issue 57): a colocated vLLM engine holds its share of the GPU
while awake, and the memory plan's update column counts it asleep, so the old log-probs, the reference's and the
critic's values of a rollout must run after `generator.sleep()`, not only the update. Every trainer's loop (2 steps,
in-process) runs against a recording engine that behaves as vLLM at sleep level 2: asleep, its weights are gone
and generate() refuses until sync_weights(); each forward of a model common.load_model loaded (policy,
reference, critic) records whether the engine was asleep. SPO-chain samples Monte Carlo continuations after
its log-prob pass: it wakes the engine (a sync of the same weights) for them and sleeps it again."""
import importlib
import os
import sys

import pytest

import common
import infra.run
from helpers import with_forks
from scripted_engine import ScriptedEngine

SMALL = ["--steps", 2, "--eval-problems", 2, "--eval-n", 1, "--max-response-tokens", 24, "--eval-max-tokens", 24,
         "--prompts-per-step", 2, "--samples-per-prompt", 4, "--mini-batches", 2, "--micro-batch-size", 4,
         "--old-logprobs", "recompute"]
CRITIC = SMALL + ["--critic-warmup", 0]
LOOPS = {"grpo": ("grpo", SMALL + ["--kl-coef", 0.01]), "ppo": ("ppo", CRITIC), "sp3o": ("sp3o", CRITIC),
         "tppo": ("tppo", CRITIC), "vapo": ("vapo", CRITIC), "spo-chain": ("spo", SMALL + ["--mc-samples", 2]),
         "spo-tree": ("spo", SMALL + ["--mode", "tree", "--tree-prompts", 2, "--tree-branching", 2, "--tree-depth", 2,
                                     "--tree-segment-tokens", 20]),
         "sppo": ("sppo", CRITIC + ["--samples-per-prompt", 1, "--prompts-per-step", 4, "--micro-batch-size", 2])}
LOOPS.update({name: (name, flags) for name, flags in with_forks({t: f for t, f in LOOPS.values()}).items()
              if name not in {t for t, _ in LOOPS.values()}})  # a fork runs with its nearest trainer's flags


class SleepingEngine(ScriptedEngine):
    """ScriptedEngine's samples, with vLLM's level-2 sleep: sleep() drops the weights, generate() before the next
    sync_weights() raises as VLLMGenerator.generate does. `events` records generate, sleep, sync and, through
    record_pass, each trainer pass with the engine's state at that moment."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "stop")
        self.asleep, self.events = False, []

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        if self.asleep:
            raise RuntimeError("generate() while asleep: sync_weights(policy) must come first")
        self.events.append("generate")
        return super().generate(prompts, n, max_tokens, temperature, top_p)

    def sleep(self):
        self.asleep = True
        self.events.append("sleep")

    def sync_weights(self, model):
        self.asleep = False
        self.events.append("sync")

    def record_pass(self, name):
        self.events.append(f"{name} {'asleep' if self.asleep else 'AWAKE'}")


def run_recorded(monkeypatch, tmp_path, trainer, argv):
    """Events of `trainer`'s 2 steps against a SleepingEngine."""
    engines = []

    def make_generator(kind, model, tokenizer, *args, **kwargs):
        engines.append(SleepingEngine(tokenizer))
        return engines[-1]

    def load_model(*args, value_head=0, **kwargs):  # every forward of a loaded model is recorded
        loaded = load(*args, value_head=value_head, **kwargs)
        name = "critic" if value_head else "logprobs"
        def record(module, inputs):  # returns None: the inputs unchanged
            if engines:
                engines[-1].record_pass(name)
        loaded[0].register_forward_pre_hook(record)
        return loaded
    load = common.load_model
    monkeypatch.setattr(infra.run, "make_generator", make_generator)
    monkeypatch.setattr(common, "load_model", load_model)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *map(str, argv), "--output-dir", str(tmp_path)])
    importlib.import_module(trainer).main()
    return engines[0].events


@pytest.mark.parametrize("loop", list(LOOPS))
def test_every_trainer_pass_runs_with_the_engine_asleep(loop, monkeypatch, tmp_path):
    trainer, argv = LOOPS[loop]
    if not os.path.exists(os.path.join(os.path.dirname(common.__file__), f"{trainer}.py")):
        pytest.skip(f"{trainer}.py is not there")
    events = run_recorded(monkeypatch, tmp_path, trainer, argv)
    passes = [event for event in events if event.split()[0] in ("logprobs", "critic")]
    assert passes and all(event.endswith("asleep") for event in passes), events
    assert events.count("sleep") >= 2, events  # one per step at least
    if trainer not in ("grpo", "spo", "prime"):  # PRIME's PRM and reference are causal LMs: logprobs passes
        assert "critic asleep" in passes, events
    # each rollout's first pass follows the sleep that came right after the rollout's last generate call
    for index, event in enumerate(events):
        if event.startswith(("logprobs", "critic")) and events[index - 1] == "generate":
            pytest.fail(f"a trainer pass right after generate, the engine not put to sleep: {events}")
    if loop == "spo-chain":  # woken for the Monte Carlo continuations, after the log-prob pass, then asleep again
        step = events[events.index("sleep"):]
        assert step[:2] == ["sleep", "logprobs asleep"] and "sync" in step, events
        woken = step.index("sync")
        assert step[woken + 1] == "generate" and "sleep" in step[woken + 1:], events


def test_the_recording_catches_a_pass_with_the_engine_awake(monkeypatch, tmp_path):
    """The check can fail: with the sleep line back after the old log-probs (the order before issue 57), GRPO's
    old log-prob and reference passes run with the engine awake."""
    import grpo
    source = open(grpo.__file__).read()
    line = ("        generator.sleep()  # vLLM frees the GPU for the trainer's passes and the update (HF: nothing to "
            "free)\n")
    late = source.replace(line, "").replace("        # 4. Update:", line + "        # 4. Update:", 1)
    assert late != source and late.count("generator.sleep()") == 1
    (tmp_path / "late_grpo.py").write_text(late)
    monkeypatch.syspath_prepend(str(tmp_path))
    events = run_recorded(monkeypatch, tmp_path / "runs", "late_grpo", LOOPS["grpo"][1])
    assert "logprobs AWAKE" in events and events.index("logprobs AWAKE") < events.index("sleep")
