"""benchmarks/rehearsal.py at a small shape (the plan against the measured peak of fresh processes, growth with the
response length), its checks on hand-made figures, and the plan's terms that the rehearsal corrected, by hand."""
import json
import os
import subprocess
import sys

import pytest

import infra.cli
import infra.memory as memory
from infra.memory import GIB, Setup, Shape

from benchmarks import rehearsal

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_checks_flag_a_plan_off_by_more_than_the_tolerance_and_faster_than_linear_growth():
    def result(method, response, measured, planned):
        return dict(method=method, response=response, peak=measured * GIB, planned=planned * GIB)
    good = [result("grpo", 1024, 5.0, 4.0), result("grpo", 2048, 5.0, 6.0), result("grpo", 4096, 12.5, 10.1)]
    assert rehearsal.checks(good) == []  # 4.0 / 5.0 = 0.8 and 6.0 / 5.0 = 1.2: at the limits; 12.5 = 2.5 x 5.0
    assert rehearsal.checks([result("ppo", 1024, 5.0, 3.9)]) == ["ppo update 1024: plan 3.90 GiB vs measured 5.00"]
    assert rehearsal.checks([result("ppo", 1024, 5.0, 6.1)]) == ["ppo update 1024: plan 6.10 GiB vs measured 5.00"]
    steep = [result("ppo", 2048, 4.0, 4.0), result("ppo", 4096, 10.1, 10.1)]  # 10.1 > 2.5 x 4.0
    assert rehearsal.checks(steep) == ["ppo update: 10.10 GiB at 4096 > 2.5 x 4.00 GiB at 2048"]
    rollout = [dict(r, phase="rollout") for r in steep]  # each phase's growth on its own
    assert rehearsal.checks(steep[:1] + rollout[1:]) == []


def test_cpu_plan_of_one_sequence_per_micro_batch_by_hand():
    """A tied model of hidden 128 and vocabulary 1,000, one layer, one sequence of 1,024 + 512 tokens per micro-batch,
    bf16 compute, on CPU: the LM head covers the 512 response positions only, its vocabulary in one slice (2**24 / 512
    columns would be more than 1,000); the embedding's two float32 gradients
    (its LM head's and its own) wait before accumulation; the process baseline and the allocator's slack replace the
    CUDA context."""
    shape = Shape(128, 1, 2, 1, 64, 384, 1000, True)
    setup = Setup((("policy", shape, 0, True),), tokens=1536, sequence=1536, engine="hf", cpu=True, rows=1)
    rows = {name: update for name, _, update, _, _ in memory.plan(setup)}
    assert rows["logits"] == 8 * 512 * (1000 + 128)  # the slice's float32 logits, a temporary; h's casts, gradient
    assert rows["grad buffers"] == 2 * 4 * 1000 * 128
    # the process baseline for the CUDA context, and glibc's kept free blocks: 15% of the rest
    assert rows["overhead"] == memory.CPU_BASELINE + 0.15 * sum(rows[name] for name in rows if name != "overhead")
    packed = dict(rows_of_plan(Setup(setup.models, tokens=1536, sequence=1536, engine="hf")))
    assert packed["logits"] == 8 * 1536 * (1000 + 128) and packed["overhead"] == GIB / 2  # packed: every position;
    # on a GPU, one process, nothing sharded: the CUDA context alone
    critic = dict(rows_of_plan(Setup((("critic", shape, 1, True),), tokens=1536, sequence=1536, rows=1)))
    assert critic["logits"] == 0 and critic["grad buffers"] == 4 * 1000 * 128  # no LM head: its embedding's only


def rows_of_plan(setup):
    return [(name, update) for name, _, update, _, _ in memory.plan(setup)]


def test_setup_for_a_cpu_run_plans_its_dtype_and_micro_batch():
    """--dtype bfloat16 on CPU is planned in bf16 (auto: float32 there); --micro-batch-size sequences per
    micro-batch unless --micro-batch-tokens packs them."""
    import grpo

    def setup(*flags):
        args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--max-response-tokens", "64", *flags])
        return memory.setup_for(args, "cpu", 0)[0]
    assert (setup("--dtype", "bfloat16").compute_bytes, setup().compute_bytes) == (2, 4)
    assert setup("--micro-batch-size", "4").rows == 4 and setup("--micro-batch-tokens", "4096").rows == 0
    assert setup().cpu and not memory.setup_for(infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, []), "cpu",
                                                 80 * GIB)[0].cpu


def test_rehearsal_at_a_small_shape_matches_its_plan_and_grows_about_linearly():
    """One layer of hidden 128 over Qwen3's 151,936-token vocabulary, responses of 256 and 512 tokens, GRPO and PPO:
    each update's measured peak within 20% of the plan; the peak at 512 at most 2.5 x the one at 256."""
    small = ["--layers", "1", "--hidden", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64",
             "--intermediate", "384", "--lengths", "256", "512", "--json"]
    done = subprocess.run([sys.executable, "benchmarks/rehearsal.py", *small], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode in (0, 1), done.stderr[-3000:]
    results = json.loads([line for line in done.stdout.splitlines() if line.startswith("[")][-1])
    assert [(r["method"], r["response"]) for r in results] == [("grpo", 256), ("grpo", 512), ("ppo", 256),
                                                               ("ppo", 512)]
    assert rehearsal.checks(results) == [], done.stdout
    for r in results:  # the plan as built: one sequence of 1,024 prompt + the response tokens per micro-batch, the
        # LM head over its T response positions in slices of 2**24 / T columns (PPO: the policy's pass, the larger)
        assert r["plan_rows"]["logits"] == 8 * r["response"] * (2 ** 24 // r["response"] + 128)
        assert r["seconds"] > 0 and r["peak"] > r["plan_rows"]["weights"]
    assert done.returncode == 0 and "growth about linear: yes" in done.stdout


def test_the_plans_transient_terms_against_their_live_bytes():
    """benchmarks/rehearsal.py --terms at small shapes: a layer's backward in float32 holds exactly the plan's 2bI a
    token above its start (8 x 1,024 = 8,192 bytes); AdamW's foreach step 4 bytes a parameter, its for-loop step 8
    bytes x the largest tensor (torch.profiler's live bytes; a few bytes of step counters besides)."""
    measured, planned = rehearsal.layer_backward(128, 1024, 2, "float32", False, tokens=512)
    assert planned == 2 * 4 * 1024 and measured == pytest.approx(planned, rel=0.02)
    measured, planned = rehearsal.layer_backward(128, 1024, 2, "bfloat16", True, tokens=512)
    assert measured == pytest.approx(planned, rel=0.15)  # checkpointed: the recomputed saved tensors + 2bI
    for foreach in (True, False):
        measured, parameters, largest = rehearsal.optimizer_step(foreach)
        assert measured == pytest.approx(4 * parameters if foreach else 8 * largest, rel=1e-4)
