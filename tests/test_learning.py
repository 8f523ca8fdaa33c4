"""Every trainer learns: a seeded run of 8 actor updates on the built-in tiny model, through the command line and
metrics.jsonl only. ppo.py and sp3o.py first train only the critic for the tiny preset's 5 warm-up steps (their
actor frozen, as released), so they run 5 + 8 steps. The tiny model solves about 1/3 of the additions at first
(greedy: 5 of the 16 held-out problems); a flipped advantage sign drives the reward down, a dropped advantage leaves
the policy, and so the greedy evaluation, where it was.
Measured with these flags on seeds 0-4 (30 runs, issue 20): the held-out accuracy rose by 0.375 or more (spo seed 4;
grpo, tppo 0.5; ppo, sp3o 0.438; sppo 0.562), the last 4 rollouts' mean reward exceeded that of the rollouts before
the first actor update by 0.16 or more (spo seed 3; grpo 0.184, ppo 0.242, sp3o 0.25, tppo 0.273, sppo 0.445).
With 5 + 5 steps ppo's and sp3o's reward margin fell to 0.11. Planted in a copy (seed 0): the advantage's sign
flipped in each trainer's loss call gave accuracy gains of -0.06 (spo) to -0.31 (sppo), the advantage zeroed in grpo
and ppo a gain of 0; each failed here."""
import importlib
import json
import os

import pytest

ACTOR_STEPS = 8
# 8 prompts x 8 samples (SPPO: 64 x 1), one micro-batch per mini-batch, 16 held-out problems (greedy, the preset).
SMALL = ["--seed", 0, "--prompts-per-step", 8, "--micro-batch-size", 64, "--eval-problems", 16]
TRAINERS = {"grpo": [], "ppo": [], "sp3o": [], "tppo": [], "sppo": ["--prompts-per-step", 64], "spo": []}
EVAL_GAIN = 0.25  # held-out greedy accuracy, last step (after its update) minus step 0 (multiples of 1/16)
REWARD_GAIN = 0.1  # mean training reward of the last 4 rollouts minus that of the rollouts before any actor update


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_a_short_run_learns(trainer, run_cli, tmp_path, tiny_path):
    warmup = importlib.import_module(trainer).TINY_PRESET.get("critic_warmup", 0)  # steps with the actor frozen
    steps = warmup + ACTOR_STEPS
    result = run_cli(f"{trainer}.py", "--steps", steps, *SMALL, *TRAINERS[trainer], "--run-name", "learn",
                     "--output-dir", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
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
