"""Several processes (torchrun, gloo on CPU): one update on a fixed batch agrees for 1 and 2 ranks and any
micro-batch split; the trainers run under `torchrun --nproc-per-node 2`, save sharded checkpoints and resume."""
import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import common
import infra.dist
from helpers import with_forks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def torchrun(*args, timeout=300, relaunch_on_abort=False):
    """`torchrun --standalone --nproc-per-node 2 <args>` from the repository root (standalone: a free port).
    relaunch_on_abort: launch once more if a rank aborted in C++ ("terminate called without an active exception"),
    seen in CI once, in distributed_update.py, on 1 of 5 clean-clone runs, and not reproduced in 33 launches here."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if relaunch_on_abort and result.returncode and "terminate called without an active exception" in result.stderr:
        result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    return result


def single(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def check_ok(result):
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]


@pytest.fixture(scope="module")
def updates(tmp_path_factory, tiny_path):
    """The same update (tests/distributed_update.py) in 1 process and in 2, with different micro-batch splits."""
    folder, results = tmp_path_factory.mktemp("updates"), {}
    two_ranks = functools.partial(torchrun, relaunch_on_abort=True)
    for name, launch, split in [("1 rank, micro 8", single, (8,)), ("1 rank, micro 3", single, (3,)),
                                ("1 rank, 20 tokens", single, (8, 20)), ("2 ranks, micro 2", two_ranks, (2,)),
                                ("2 ranks, 26 tokens", two_ranks, (8, 26))]:
        out = folder / f"{len(results)}.pt"
        check_ok(launch("tests/distributed_update.py", out, *split))
        results[name] = torch.load(out, weights_only=False)
    return results


def test_one_update_agrees_for_any_world_size_and_micro_batch_split(updates, tiny_path):
    reference = updates["1 rank, micro 8"]
    assert reference["world_size"] == 1 and updates["2 ranks, micro 2"]["world_size"] == 2
    assert reference["grad_norm"] > 0.5  # clipped to 0.5: the step is not a no-op
    moved = common.load_model(tiny_path, "float32", "cpu")[0].state_dict()
    assert max((reference["weights"][k] - moved[k]).abs().max().item() for k in moved) > 1e-3
    for name, result in updates.items():
        # the token-mean loss over the whole batch, whatever the split (each rank divides by the global count)
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5, abs=1e-7), name
        for key, tensor in reference["weights"].items():
            assert torch.allclose(result["weights"][key], tensor, atol=1e-6, rtol=1e-5), (name, key)


def test_token_budget_micro_batches_are_equalized_across_ranks(updates):
    # with a 26-token budget rank 0 packs its 4 sequences into 3 micro-batches and rank 1 into 2; FSDP's forwards
    # are collective, so rank 1 halves its largest micro-batch and both run 3
    assert updates["2 ranks, 26 tokens"]["micro_batch_counts"] == [(3, 3), (2, 3)]


def test_helpers_are_the_identity_in_one_process():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert infra.dist.gather_all(values) is values
    assert infra.dist.rank_share([1, 2, 3]) == [1, 2, 3]
    assert infra.dist.rank_mean(torch.tensor(7)) == 7.0
    assert infra.dist.gather_objects("x") == ["x"]
    assert common.micro_batches([0, 1, 2, 3, 4], None, 2) == [[0, 1], [2, 3], [4]]
    assert not infra.dist.distributed() and infra.dist.rank() == 0 and infra.dist.world_size() == 1


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


SMALL = ["--steps", "2", "--prompts-per-step", "4", "--micro-batch-size", "16", "--eval-problems", "16"]
EXTRA = with_forks({
    "grpo.py": [], "ppo.py": ["--micro-batch-tokens", "400", "--gradient-checkpointing", "--critic-warmup", "1"],
    "sp3o.py": ["--critic-warmup", "1"], "tppo.py": ["--critic-head", "separate"],
    "sppo.py": ["--prompts-per-step", "8"], "spo.py": ["--mc-samples", "2"]})


def run_two_ranks(script, tmp_path):
    result = torchrun(script, *SMALL, *EXTRA[script], "--output-dir", tmp_path, "--run-name", "r", timeout=600)
    check_ok(result)
    run_dir = os.path.join(tmp_path, "r")
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1]  # rank 0 alone writes, once per step
    for record in records:
        assert math.isfinite(record["reward"])  # a critic warm-up step logs no policy loss (none applied)
        assert record.get("actor_frozen") or math.isfinite(record["policy_loss"])
        assert 0 <= record["eval/accuracy"] <= 1
    checkpoint = os.path.join(run_dir, "checkpoints", "step_000002")
    assert {"sharded", "rng_rank0.pt", "rng_rank1.pt", "trainer_state.pt", "policy"} <= set(os.listdir(checkpoint))
    with open(os.path.join(checkpoint, "policy", "config.json")) as handle:
        assert json.load(handle)["architectures"] == ["Qwen3ForCausalLM"]  # not the FSDP wrapper's class
    return run_dir, records


@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_grpo_and_ppo_run_under_torchrun(script, tmp_path, tiny_path):
    run_dir, records = run_two_ranks(script, tmp_path)
    if script == "ppo.py":
        assert all(math.isfinite(r["value_loss"]) for r in records)
        return
    # a sharded checkpoint resumes in one process (DCP reshards), and in two
    check_ok(single("grpo.py", *SMALL[2:], "--steps", "3", "--resume", run_dir, timeout=300))
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    check_ok(torchrun("grpo.py", *SMALL[2:], "--steps", "4", "--resume", run_dir))
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3]


def test_single_process_checkpoint_resumes_under_torchrun(tmp_path, tiny_path):
    check_ok(single("grpo.py", *SMALL, "--output-dir", tmp_path, "--run-name", "one"))
    check_ok(torchrun("grpo.py", *SMALL[2:], "--steps", "3", "--resume", tmp_path / "one"))
    assert [r["step"] for r in read_metrics(tmp_path / "one")] == [0, 1, 2]


def test_uneven_prompts_are_refused(tmp_path, tiny_path):
    result = torchrun("grpo.py", *SMALL, "--prompts-per-step", "3", "--output-dir", tmp_path)
    assert result.returncode != 0 and "multiple of --nproc-per-node" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(set(EXTRA) - {"grpo.py", "ppo.py"}))  # those two: the tests above
def test_other_trainers_run_under_torchrun(script, tmp_path, tiny_path):
    run_two_ranks(script, tmp_path)
