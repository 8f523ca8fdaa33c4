"""Every trainer learns: a seeded run of 8 actor updates on the built-in tiny model, through the command line and
metrics.jsonl only. ppo.py and sp3o.py first train only the critic for the tiny preset's 5 warm-up steps (their
actor frozen, as released), so they run 5 + 8 steps. On the 3-digit task the tiny model solves half of the first 16
held-out problems greedily (8 of 16); a flipped advantage sign drives the reward down, a dropped advantage leaves the
policy, and so the greedy evaluation, where it was.
Measured with these flags on the shipped model (models/tiny, v4), seeds 0 and 1 (12 runs): the held-out accuracy
rose by 0.25 or more with seed 0 (spo; the others 0.312-0.438) and by 0.125 or more with seed 1 (spo; the others
0.25-0.375); the last 4 rollouts' mean reward exceeded that of the rollouts before the first actor update by 0.174
or more with seed 0 (sp3o; the others 0.206-0.426) and 0.109 or more with seed 1 (grpo). On the previous model, CI's
clean environment gave spo seed 0 a gain 2 of 16 below this machine's, hence the margin; SPO is the least sure
learner. A flipped advantage sign planted in the loss call (seed 0): grpo's accuracy fell by 0.438 (reward -0.238),
spo's by 0.188 (reward -0.109), each failing here; on the previous model the same held for all six trainers
(-0.06 to -0.31) and a zeroed advantage gave a gain of 0."""
import importlib
import json
import os

import pytest

from helpers import with_forks

ACTOR_STEPS = 8
# 8 prompts x 8 samples (SPPO: 64 x 1), one micro-batch per mini-batch, 16 held-out problems (greedy, the preset),
# the 3-digit task (half the tokens of the default 6) at the learning rate of 1e-4 (the preset's 3e-5 is slower).
SMALL = ["--seed", 0, "--prompts-per-step", 8, "--micro-batch-size", 64, "--eval-problems", 16, "--eval-every", 0,
         "--dataset", "builtin:3", "--lr", 1e-4]
# One critic pass, as published and as measured below (the preset's 4, seeds 0 and 1: ppo and sp3o gained 0.25-0.375,
# tppo 0.375 and 0.0625).
ONE_PASS = ["--critic-epochs", 1]
# PRIME: its implicit PRM 10x slower than the demo's (6e-5, twice the policy's lr as released): at 6e-5 the process
# rewards drive this run down (seed 0: 0.5 -> 0.0625 in 8 steps; --process-coef 0, RLOO alone: 0.5 -> 0.8125), as they
# do the demo (docs/testbed.md); at 6e-6 it gains 0.5 -> 0.75.
TRAINERS = with_forks({"grpo": [], "ppo": ONE_PASS, "sp3o": ONE_PASS, "tppo": ONE_PASS,
                       "sppo": ["--prompts-per-step", 64], "spo": [], "prime": ["--prm-lr", 6e-6]})
EVAL_GAIN = 0.125  # held-out greedy accuracy, last step (after its update) minus step 0 (multiples of 1/16)
REWARD_GAIN = 0.1  # mean training reward of the last 4 rollouts minus that of the rollouts before any actor update


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_a_short_run_learns(trainer, run_cli, tmp_path, tiny_path):
    warmup = importlib.import_module(trainer).TINY_PRESET.get("critic_warmup", 0)  # steps with the actor frozen
    steps = warmup + ACTOR_STEPS
    result = run_cli(f"{trainer}.py", "--steps", steps, *SMALL, *TRAINERS[trainer], "--run-name", "learn",
                     "--output-dir", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--dataset builtin:3 --eval-datasets builtin" in result.stdout  # the summary's evaluate: command
    with open(os.path.join(tmp_path, "learn", "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    with open(os.path.join(tmp_path, "learn", "config.json")) as handle:
        assert json.load(handle).get("critic_warmup", 0) == warmup
    assert [record["step"] for record in records] == list(range(steps))
    rewards = [record["reward"] for record in records]
    first_eval, last_eval = records[0]["eval/accuracy"], records[-1]["eval/accuracy"]
    assert last_eval - first_eval >= EVAL_GAIN, (first_eval, last_eval, rewards)
    before_updates = rewards[:warmup + 1]  # the rollouts of the initial policy
    assert sum(rewards[-4:]) / 4 - sum(before_updates) / len(before_updates) >= REWARD_GAIN, rewards
