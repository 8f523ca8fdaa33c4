"""Every trainer learns: a seeded 8-step run on the built-in tiny model, through the command line and
metrics.jsonl only. The tiny model solves about 1/3 of the additions at first (greedy: 5 of the 16 held-out
problems); a flipped advantage sign drives the reward down (grpo, seed 0: 0.39 to 0.02 in 3 steps), a dropped
advantage leaves the policy, and so the greedy evaluation, where it was. Margins measured with these flags on
seeds 0-4 (30 runs): the held-out accuracy rose by 0.44 or more, the last 4 steps' mean reward exceeded the first
step's by 0.15 or more. Planted in a copy (seed 0): the sign flipped in each trainer gave accuracy gains of -0.06
to -0.31, the advantage zeroed in grpo and ppo a gain of 0."""
import json
import os

import pytest

STEPS = 8
# 8 prompts x 8 samples (SPPO: 64 x 1), one micro-batch per mini-batch, 16 held-out problems (greedy, the preset).
SMALL = ["--steps", STEPS, "--seed", 0, "--prompts-per-step", 8, "--micro-batch-size", 64, "--eval-problems", 16]
TRAINERS = {"grpo": [], "ppo": [], "sp3o": ["--critic-warmup", 0], "tppo": [], "sppo": ["--prompts-per-step", 64],
            "spo": []}
EVAL_GAIN = 0.25  # held-out greedy accuracy, last step minus step 0 (multiples of 1/16)
REWARD_GAIN = 0.1  # mean training reward of the last 4 steps minus step 0's (before any update)


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_a_short_run_learns(trainer, run_cli, tmp_path, tiny_path):
    result = run_cli(f"{trainer}.py", *SMALL, *TRAINERS[trainer], "--run-name", "learn", "--output-dir", tmp_path,
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, "learn", "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert [record["step"] for record in records] == list(range(STEPS))
    rewards = [record["reward"] for record in records]
    first_eval, last_eval = records[0]["eval/accuracy"], records[-1]["eval/accuracy"]
    assert last_eval - first_eval >= EVAL_GAIN, (first_eval, last_eval, rewards)
    assert sum(rewards[-4:]) / 4 - rewards[0] >= REWARD_GAIN, rewards
