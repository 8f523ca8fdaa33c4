"""End to end: grpo.py for 2 steps on the tiny model (CPU), its metrics and checkpoint, and --resume."""
import json
import math
import os

import pytest
import torch

# 4 prompts x 8 samples = 32 per rollout, 2 mini-batches of 16: one micro-batch of 16 each (the tiny preset's 64
# is refused by check_args here, see test_grpo.test_check_args_accepts_a_micro_batch_larger_than_the_mini_batch)
SMALL = ["--prompts-per-step", "4", "--micro-batch-size", "16", "--eval-problems", "16"]


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def check_ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A 2-step run and its resumption to 3 steps, shared by the tests of this module."""
    import subprocess
    import sys
    output = tmp_path_factory.mktemp("runs")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(*args):
        return subprocess.run([sys.executable, "grpo.py", *args, *SMALL, "--output-dir", str(output)], cwd=repo,
                              env=env, capture_output=True, text=True, timeout=300)

    first = run("--steps", "2", "--run-name", "e2e")
    check_ok(first)
    run_dir = os.path.join(output, "e2e")
    metrics = read_metrics(run_dir)
    checkpoint = os.path.join(run_dir, "checkpoints", "step_000002")
    resumed = run("--steps", "3", "--resume", checkpoint)
    return dict(output=output, run_dir=run_dir, metrics=metrics, checkpoint=checkpoint, resumed=resumed, run=run)


def test_two_steps_log_one_record_per_step(two_step_run):
    metrics = two_step_run["metrics"]
    assert [record["step"] for record in metrics] == [0, 1]
    for record in metrics:
        assert math.isfinite(record["reward"]) and 0.0 <= record["reward"] <= 1.0
        # rewards are 0/1 over 32 samples
        assert record["reward"] * 32 == pytest.approx(round(record["reward"] * 32))
        for key in ("policy_loss", "grad_norm", "clip_fraction", "approx_kl", "response_length"):
            assert math.isfinite(record[key]), key
        assert 0 < record["response_length"] <= 96  # the tiny preset's max_response_tokens
        assert record["logprob_gap_max"] < 1e-3  # engine and trainer log-probs agree at temperature 1
        assert record["skipped_updates"] == 0.0
    # evaluated before the first update and after the last one, on 16 problems (greedy: multiples of 1/16)
    for record in (metrics[0], metrics[-1]):
        assert 0.0 <= record["eval/accuracy"] <= 1.0
        assert (record["eval/accuracy"] * 16) == pytest.approx(round(record["eval/accuracy"] * 16))
    config = json.load(open(os.path.join(two_step_run["run_dir"], "config.json")))
    assert config["samples_per_prompt"] == 8 and config["prompts_per_step"] == 4 and config["lr"] == 3e-5


def test_checkpoint_loads_with_transformers(two_step_run, tiny_path):
    from transformers import AutoModelForCausalLM
    path = os.path.join(two_step_run["checkpoint"], "policy")
    trained = AutoModelForCausalLM.from_pretrained(path)
    start = AutoModelForCausalLM.from_pretrained(tiny_path)
    assert trained.config.model_type == "qwen3"
    assert os.path.exists(os.path.join(two_step_run["checkpoint"], "trainer_state.pt"))
    changed = [not torch.equal(a, b) for a, b in zip(trained.state_dict().values(), start.state_dict().values())]
    assert any(changed)  # 4 optimizer steps moved the weights


def test_resume_continues_at_step_two(two_step_run):
    check_ok(two_step_run["resumed"])
    assert "with its saved settings; --steps 3 (saved: 2)" in two_step_run["resumed"].stdout
    run_dir = two_step_run["run_dir"]
    assert json.load(open(os.path.join(run_dir, "config.json")))["steps"] == 2  # the first start's settings, kept
    record = json.load(open(os.path.join(run_dir, "config.resume_000002.json")))
    assert record["changed"] == {"steps": [2, 3]} and record["config"]["steps"] == 3
    metrics = read_metrics(two_step_run["run_dir"])  # the resumed run writes to the same run directory
    assert [record["step"] for record in metrics] == [0, 1, 2]
    assert metrics[:2] == two_step_run["metrics"]
    assert 0.0 <= metrics[2]["reward"] <= 1.0 and "eval/accuracy" in metrics[2]  # step 2 is the last step
    assert os.path.isdir(os.path.join(two_step_run["run_dir"], "checkpoints", "step_000003"))


@pytest.mark.slow
def test_resume_is_exact(two_step_run):
    """3 steps straight give the same step-2 record as 2 steps + --resume (data order, RNG, optimizer state)."""
    check_ok(two_step_run["resumed"])
    straight = two_step_run["run"]("--steps", "3", "--run-name", "straight")
    check_ok(straight)
    resumed = read_metrics(two_step_run["run_dir"])
    uninterrupted = read_metrics(os.path.join(two_step_run["output"], "straight"))
    for key in ("reward", "policy_loss", "clip_fraction", "grad_norm", "response_length", "eval/accuracy"):
        assert resumed[2][key] == pytest.approx(uninterrupted[2][key], rel=1e-5, abs=1e-7), key
    assert resumed[0]["reward"] == uninterrupted[0]["reward"]


@pytest.mark.slow
def test_truncated_responses_score_zero_and_kl_runs(two_step_run):
    """With an 8-token limit no response can finish (they are ~38 tokens): every reward is 0. --kl-coef loads the
    frozen reference and still trains."""
    result = two_step_run["run"]("--steps", "1", "--max-response-tokens", "8", "--kl-coef", "0.1",
                                 "--run-name", "truncated")
    check_ok(result)
    [record] = read_metrics(os.path.join(two_step_run["output"], "truncated"))
    assert record["truncated"] == 1.0 and record["reward"] == 0.0 and record["response_length"] == 8
    assert math.isfinite(record["policy_loss"]) and math.isfinite(record["grad_norm"])
