"""The memory plan (infra/memory.py) against hand-computed figures for Qwen3-0.6B, 4B and 8B, its parameter counts
against instantiated models, the one-line refusal of `sp3o.py --model <a Qwen3-4B config>` on an 80 GiB GPU, and
--offload-optimizer: a short run with it trains and resumes exactly (bit for bit against a run without it)."""
import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import infra.memory as memory
import infra.cli
import infra.run
from infra.memory import GIB, QWEN3, Setup, Shape
from helpers import records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The published config.json shapes, written out (no download): hidden, layers, heads, KV heads, head_dim,
# intermediate, vocab, tied embeddings.
QWEN3_06B = Shape(1024, 28, 16, 8, 128, 3072, 151936, True)
QWEN3_4B = Shape(2560, 36, 32, 8, 128, 9728, 151936, True)
QWEN3_8B = Shape(4096, 36, 32, 8, 128, 12288, 151936, False)


def test_qwen3_shapes_and_parameter_counts():
    assert [Shape(*QWEN3[name]) for name in ("Qwen3-0.6B", "Qwen3-4B", "Qwen3-8B")] == [QWEN3_06B, QWEN3_4B, QWEN3_8B]
    # A layer: q, k, v projections h x (q + 2 kv), o projection q x h, q/k norms 2 x head_dim, MLP 3 h I, 2 norms 2h.
    # 0.6B: q = 16 x 128 = 2048, kv = 8 x 128 = 1024:
    #   1024 x 4096 + 2048 x 1024 + 256 + 3 x 1024 x 3072 + 2048 = 4,194,304 + 2,097,152 + 256 + 9,437,184 + 2,048
    assert QWEN3_06B.layer_parameters() == 15_730_944
    # model: embeddings 151,936 x 1024 = 155,582,464, + 28 layers 440,466,432, + final norm 1024; tied: no LM head
    assert QWEN3_06B.parameters() == 596_049_920  # "0.6B"
    assert QWEN3_06B.parameters(value_head=1) == 596_049_920 + 1024 + 1  # critic: score Linear(1024, 1) with bias
    # 4B: q = 4096, kv = 1024: 2560 x 6144 + 4096 x 2560 + 256 + 3 x 2560 x 9728 + 5120
    #   = 15,728,640 + 10,485,760 + 256 + 74,711,040 + 5,120
    assert QWEN3_4B.layer_parameters() == 100_930_816
    # 151,936 x 2560 = 388,956,160 + 36 x 100,930,816 = 3,633,509,376 + 2560; tied
    assert QWEN3_4B.parameters() == 4_022_468_096  # "4.0B, 3.6B non-embedding"
    assert QWEN3_4B.parameters(value_head=1) == 4_022_470_657
    # 8B: q = 4096, kv = 1024: 4096 x 6144 + 4096 x 4096 + 256 + 3 x 4096 x 12288 + 8192
    #   = 25,165,824 + 16,777,216 + 256 + 150,994,944 + 8,192
    assert QWEN3_8B.layer_parameters() == 192_946_432
    # body: 151,936 x 4096 = 622,329,856 + 36 x 192,946,432 = 6,946,071,552 + 4096 = 7,568,405,504; untied LM head
    # adds another 622,329,856
    assert QWEN3_8B.parameters() == 8_190_735_360  # "8.2B"
    assert QWEN3_8B.parameters(value_head=1) == 7_568_405_504 + 4097


def rows_of(setup):
    return {name: (update, rollout, host) for name, _, update, rollout, host in memory.plan(setup)}


def test_plan_qwen3_06b_grpo_on_one_gpu():
    """GRPO (policy only), 1 process, 16,384-token micro-batches of sequences up to 1,024 + 8,192 tokens,
    checkpointing, bf16 compute, vLLM with 0.3 of an 80 GiB GPU."""
    setup = Setup((("policy", QWEN3_06B, 0, True),), tokens=16384, sequence=9216, engine_bytes=0.3 * 80 * GIB)
    rows = rows_of(setup)
    p = 596_049_920
    assert rows["weights"] == (4 * p, 4 * p, 0) == (2_384_199_680,) * 2 + (0,)  # float32
    assert rows["gradients"] == (2_384_199_680, 0, 0)  # float32; none between updates (zero_grad(set_to_none))
    assert rows["AdamW states"] == (4_768_399_360, 4_768_399_360, 0)  # 2 float32 moments
    # autocast's bf16 casts: 28 layers 440,466,432 + the tied embedding as LM head 155,582,464, x 2 bytes
    assert rows["compute copies"] == (1_192_097_792, 0, 0)
    # per token and layer saved: 16 x 1024 + 2 x 2 x 1024 + 8 x (2048 + 1024) + 5 x 2 x 2048 + 4 x 2 x 3072
    #   = 16,384 + 4,096 + 24,576 + 20,480 + 24,576 = 90,112 bytes; checkpointed: 28 float32 layer inputs
    #   (28 x 4 x 1024 = 114,688) + one layer recomputed; x 16,384 tokens = 3,355,443,200, + mask 16,384 x 9,216
    assert rows["activations"] == (3_355_443_200 + 150_994_944, 0, 0)
    assert rows["logits"] == (2 * 2 * 16384 * 151936, 0, 0) == (9_957_277_696, 0, 0)  # bf16 logits + gradient
    assert rows["engine"] == (0, 0.3 * 80 * GIB, 2 * p)  # asleep in the update; its bf16 weights on the host
    update = 2 * 2_384_199_680 + 4_768_399_360 + 1_192_097_792 + 3_506_438_144 + 9_957_277_696 + GIB
    rollout = 2_384_199_680 + 4_768_399_360 + 24 * GIB + GIB
    assert (update, rollout) == (25_266_354_176, 33_996_144_640)  # 23.5 and 31.7 GiB: the rollout is the peak
    assert memory.peak(memory.plan(setup)) == rollout


def test_plan_qwen3_4b_sp3o_in_one_process():
    """The issue's command: sp3o.py on Qwen3-4B in one process with the defaults (micro-batches of 8 sequences of
    1,024 + 8,192 tokens = 73,728 tokens): policy and critic, float32 weights and AdamW states."""
    setup = Setup((("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True)), tokens=73728, sequence=9216,
                  engine_bytes=24 * GIB, rows=8)
    rows = rows_of(setup)
    both = 4_022_468_096 + 4_022_470_657  # 8,044,938,753 parameters
    assert rows["weights"][0] == rows["gradients"][0] == 4 * both == 32_179_755_012
    assert rows["AdamW states"][0] == 8 * both == 64_359_510_024  # 128.7 GB of float32 state before activations
    # the policy's pass is the larger: bf16 casts of 36 layers (3,633,509,376) + the tied head (388,956,160), x 2
    assert rows["compute copies"][0] == 8_044_931_072
    # per token: 36 x 4 x 2560 = 368,640 (checkpointed float32 inputs) + one layer: 16 x 2560 + 2 x 2 x 2560
    #   + 8 x (4096 + 1024) + 5 x 2 x 4096 + 4 x 2 x 9728 = 40,960 + 10,240 + 40,960 + 40,960 + 77,824 = 210,944
    #   -> 579,584 x 73,728 = 42,731,569,152, + mask 73,728 x 9,216 = 679,477,248
    assert rows["activations"][0] == 43_411_046_400
    # bf16 logits and gradient over the 8 responses' 8,192 + 1 columns (the prompts' columns are never computed)
    assert rows["logits"][0] == 4 * 8 * 8193 * 151936 == 39_833_972_736
    # the tied embedding's two float32 gradients (its LM head's, then its own) before accumulation: 8 x V x h
    assert rows["grad buffers"][0] == 8 * 151936 * 2560 == 3_111_649_280
    update = 2 * 32_179_755_012 + 64_359_510_024 + 8_044_931_072 + 43_411_046_400 + 39_833_972_736 \
        + 3_111_649_280 + GIB
    assert memory.peak(memory.plan(setup)) == update == 224_194_361_360  # 208.8 GiB
    assert rows["weights"][1] + rows["AdamW states"][1] + 25 * GIB == pytest.approx(114.909 * GIB, rel=1e-5)


def test_plan_qwen3_8b_ppo_on_eight_ranks_with_and_without_offload():
    """PPO on Qwen3-8B over 8 ranks, 16,384-token micro-batches: FSDP2 divides the float32 state by 8; the
    transient unsharded units do not shrink; --offload-optimizer moves the float32 state to the host."""
    models = (("policy", QWEN3_8B, 0, True), ("critic", QWEN3_8B, 1, True))
    rows = rows_of(Setup(models, ranks=8, tokens=16384, sequence=9216, engine_bytes=24 * GIB))
    both = 8_190_735_360 + 7_568_409_601  # 15,759,144,961
    assert rows["weights"][0] == rows["gradients"][0] == 4 * both / 8 == 7_879_572_480.5
    assert rows["AdamW states"][0] == 8 * both / 8
    # policy: root unit (embeddings + untied head + norm: 8,190,735,360 - 36 x 192,946,432 = 1,244,663,808) in bf16,
    # two layers gathered in bf16 (4 x 192,946,432), one layer's bf16 gradient and float32 reduce-scatter (6 x ...)
    assert rows["compute copies"][0] == 2 * 1_244_663_808 + 10 * 192_946_432 == 4_418_791_936
    # under FSDP the residual stream is bf16: 36 x 2 x 4096 = 294,912; one layer: 16 x 4096 + 2 x 2 x 4096
    #   + 8 x 5120 + 5 x 2 x 4096 + 4 x 2 x 12288 = 65,536 + 16,384 + 40,960 + 40,960 + 98,304 = 262,144
    assert rows["activations"][0] == 16384 * (294_912 + 262_144) + 16384 * 9216 == 9_277_800_448
    assert rows["logits"][0] == 4 * 16384 * 151936
    update = 2 * 7_879_572_480.5 + 15_759_144_961 + 4_418_791_936 + 9_277_800_448 + 9_957_277_696 + GIB
    assert memory.peak(memory.plan(Setup(models, ranks=8, tokens=16384, sequence=9216, engine_bytes=24 * GIB))) \
        == update  # 52.4 GiB: fits 80 GiB GPUs; 4 ranks do not (the README's table)
    offloaded = rows_of(Setup(models, ranks=8, offload=True, tokens=16384, sequence=9216, engine_bytes=24 * GIB))
    assert [offloaded[name][0] for name in ("weights", "gradients", "AdamW states")] == [0, 0, 0]
    assert offloaded["weights"][2] + offloaded["gradients"][2] + offloaded["AdamW states"][2] == 16 * both / 8
    assert offloaded["compute copies"] == rows["compute copies"] and offloaded["logits"] == rows["logits"]
    offloaded_plan = memory.plan(Setup(models, 8, True, 16384, 9216, engine_bytes=24 * GIB))
    assert sum(row[2] for row in offloaded_plan) == 4_418_791_936 + 9_277_800_448 + 9_957_277_696 + GIB  # 23.0 GiB
    assert memory.peak(offloaded_plan) == 24 * GIB + GIB  # the rollout (vLLM's share) is now the peak


@pytest.mark.parametrize("kind", ["qwen3", "qwen3-untied", "qwen2", "llama"])
def test_parameter_counts_equal_instantiated_models(kind, tmp_path):
    """read_shape(config.json) then Shape.parameters() == the parameters of the model transformers builds, for the
    policy (AutoModelForCausalLM) and critics with 1 and 2 outputs (AutoModelForTokenClassification)."""
    from transformers import (AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, Qwen2Config,
                              Qwen3Config)
    sizes = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2)
    config = {"qwen3": lambda: Qwen3Config(**sizes, head_dim=16, tie_word_embeddings=True),
              "qwen3-untied": lambda: Qwen3Config(**sizes, head_dim=12, tie_word_embeddings=False),
              "qwen2": lambda: Qwen2Config(**sizes, tie_word_embeddings=False),
              "llama": lambda: LlamaConfig(**sizes, tie_word_embeddings=True)}[kind]()
    config.save_pretrained(tmp_path)
    shape, why = memory.read_shape(str(tmp_path))
    assert why is None

    def count(model):
        return sum(parameter.numel() for parameter in model.parameters())  # a tied weight once
    assert shape.parameters() == count(AutoModelForCausalLM.from_config(config))
    for outputs in (1, 2):
        config.num_labels = outputs
        assert shape.parameters(value_head=outputs) == count(AutoModelForTokenClassification.from_config(config))


def test_refusal_names_flags_that_fit():
    """Each flag set offered for the 4B SP3O plan on 80 GiB fits, and offers the least of its kind."""
    models = (("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True))
    setup = Setup(models, tokens=73728, sequence=9216, engine_bytes=24 * GIB)
    found = memory.fitting_flags(setup, 80 * GIB)
    assert found == ["torchrun --nnodes 2 --nproc-per-node 8", "--offload-optimizer",
                     "torchrun --nproc-per-node 2 --micro-batch-tokens 16384"]
    fits = [dict(ranks=16), dict(offload=True), dict(ranks=2, tokens=16384)]
    too_little = [dict(ranks=8), dict(ranks=1, tokens=16384), dict(ranks=2, tokens=32768)]
    for changes in fits:
        assert memory.peak(memory.plan(dataclasses.replace(setup, **changes))) <= 80 * GIB
    for changes in too_little:
        assert memory.peak(memory.plan(dataclasses.replace(setup, **changes))) > 80 * GIB


def test_sp3o_with_a_4b_config_prints_the_plan_and_refuses_in_one_line(tmp_path):
    """`sp3o.py --model <a directory holding only a Qwen3-4B config.json> --gpu-memory-gib 80` on a CPU machine: the
    plan is printed and the run refused in one line naming flags that fit, before any weights are read."""
    from transformers import Qwen3Config
    Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                ).save_pretrained(tmp_path / "qwen3-4b")
    result = subprocess.run([sys.executable, "sp3o.py", "--model", str(tmp_path / "qwen3-4b"), "--gpu-memory-gib", "80",
                             "--output-dir", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "memory plan per GPU, sp3o.py, 1 process, 80.0 GiB GPU" in result.stdout
    assert "policy 4.02B + critic 4.02B" in result.stdout and "208.8" in result.stdout
    assert result.stderr.strip().splitlines() == [
        "sp3o.py: error: the memory plan needs 208.8 GiB per GPU, more than the 80.0 GiB --gpu-memory-gib: it fits "
        "with torchrun --nnodes 2 --nproc-per-node 8, or with --offload-optimizer, or with torchrun --nproc-per-node 2 "
        "--micro-batch-tokens 16384, or with torchrun --nproc-per-node 8 --critic-model Qwen3-1.7B-Base"]
    assert not os.path.exists(tmp_path / "runs")


def qwen3_4b_config(directory):
    """A directory holding only config.json with Qwen3-4B's published shapes (QWEN3_4B), no weights."""
    from transformers import Qwen3Config
    Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                ).save_pretrained(directory)
    return str(directory)


def test_sp3o_with_a_4b_config_on_this_cpu_machine_is_refused_in_one_line(tmp_path):
    """`sp3o.py --model <Qwen3-4B config>` with no GPU: the plan (float32 on CPU, HF generate) needs far more than
    this machine's memory; refused in one line naming both, before the data, the run folder or any weights."""
    if memory.host_memory()[0] > 900 * GIB:
        pytest.skip("this machine has the memory of the 4B CPU plan (848.9 GiB)")
    result = subprocess.run([sys.executable, "sp3o.py", "--model", qwen3_4b_config(tmp_path / "qwen3-4b"),
                             "--output-dir", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, lines
    found = re.fullmatch(r"sp3o\.py: error: the memory plan needs ([\d.]+) GiB of this machine's memory \(a CPU run: "
                         r"every column\), more than the ([\d.]+) GiB available: .+", lines[0])
    assert found, lines[0]
    need, available = map(float, found.groups())  # the plan's peak over both phases (rollout: HF's 256-row KV cache)
    assert need > 800 and need > available and abs(available - memory.host_memory()[0] / GIB) < 4, lines[0]
    total = next(line.split()[2:] for line in result.stdout.splitlines() if line.strip().startswith("total GiB"))
    assert need == max(float(total[0]), float(total[1])) + float(total[2]), (total, need)  # the printed plan's peak
    assert "memory plan per process, sp3o.py, 1 process, CPU, " in result.stdout  # the plan, printed first
    assert "builtin:" not in result.stdout and "cannot load model" not in result.stderr  # no data, no weights read
    assert not os.path.exists(tmp_path / "runs")


def sp3o_4b(**changes):
    """SP3O on Qwen3-4B with its own 4B critic, as setup_for makes it on CPU (float32 compute, HF generate)."""
    models = (("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True))
    return Setup(models, **{**dict(tokens=73728, sequence=9216, compute_bytes=4, engine="hf"), **changes})


def test_host_refusal_against_a_stated_host_size():
    """The decision, with the host's memory given (not this machine's): a CPU run needs the larger phase of its plan
    plus the host column, per process on the machine; a GPU run with --offload-optimizer its host column: float32
    weights, gradients and AdamW states of policy and critic (16 bytes per trained parameter, sharded over the
    ranks) and vLLM's sleeping bf16 policy (2 bytes per parameter, each rank)."""
    policy, critic = QWEN3_4B.parameters(), QWEN3_4B.parameters(value_head=1)
    cpu = sp3o_4b()
    rows = memory.plan(cpu)
    need = max(sum(row[2] for row in rows), sum(row[3] for row in rows))
    assert memory.host_need(cpu, True, 1) == need and memory.host_need(cpu, True, 2) == 2 * need
    assert memory.host_refusal(cpu, need, True) is None  # exactly enough
    line = memory.host_refusal(cpu, 24 * GIB, True)
    assert line == (f"the memory plan needs {need / GIB:.1f} GiB of this machine's memory (a CPU run: every column), "
                    "more than the 24.0 GiB available: no smaller Qwen3 --model, --micro-batch-tokens or "
                    "--critic-model fits")
    gpu = Setup(cpu.models, ranks=8, offload=True, tokens=16384, sequence=9216, engine_bytes=24 * GIB)
    host = 8 * (16 * (policy + critic) / 8 + 2 * policy)  # eight ranks on one machine
    assert memory.host_need(gpu, False, 8) == pytest.approx(host)
    assert memory.host_refusal(gpu, host, False, 8) is None
    line = memory.host_refusal(gpu, 100 * GIB, False, 8)
    assert line.startswith(f"the memory plan needs {host / GIB:.1f} GiB of this machine's memory (the host column of "
                           "8 processes), more than the 100.0 GiB available: it fits with --model Qwen3-1.7B-Base")
    for flags in line.split("it fits with ")[1].split(", or with "):  # each offered change fits, and shrinks the plan
        size = flags.split()[1]
        smaller = dataclasses.replace(gpu, models=tuple((role, Shape(*QWEN3[size[:-5]]), head, train)
                                                        for role, _, head, train in gpu.models))
        assert memory.host_need(smaller, False, 8) <= 100 * GIB
    # a CPU run whose plan a flag brings under the machine's memory: 0.6B GRPO, micro-batches of one sequence
    grpo = Setup((("policy", Shape(*QWEN3["Qwen3-0.6B"]), 0, True),), tokens=4 * 9216, sequence=9216,
                 compute_bytes=4, engine="hf")
    found = memory.fitting_flags(grpo, memory.host_need(dataclasses.replace(grpo, tokens=9216), True, 1) + 1,
                                 (True, 1))
    assert found and all(text.startswith(("--micro-batch-tokens", "--model")) for text in found)


def test_a_cpu_run_with_vllm_plans_its_kv_cache(tmp_path):
    """vLLM's CPU build holds --vllm-kv-cache-gib of KV cache and its own bf16 weights, not HF generate's cache."""
    import sp3o
    directory = qwen3_4b_config(tmp_path / "qwen3-4b")
    args = infra.cli.parse_args(sp3o.Args, None, ["--model", directory, "--generator", "vllm", "--vllm-kv-cache-gib",
                                                  "3"])
    setup, why = memory.setup_for(args, "cpu", 0)
    assert why is None and (setup.engine, setup.engine_bytes, setup.compute_bytes) == ("vllm", 3 * GIB, 4)
    engine = next(row for row in memory.plan(setup) if row[0] == "engine")
    assert engine[2:] == (0, 3 * GIB, 2 * QWEN3_4B.parameters())
    setup, _ = memory.setup_for(infra.cli.parse_args(sp3o.Args, None, ["--model", directory]), "cpu", 0)
    assert setup.engine == "hf"


def test_the_plan_table_keeps_every_label_in_120_columns():
    printed = memory.table(memory.plan(Setup(sp3o_4b().models, offload=True, engine_bytes=24 * GIB)), "memory plan")
    assert "float32, policy 4.02B + critic 4.02B, over 1 rank, in host memory " in printed  # was cut: "in host me"
    assert printed.splitlines()[0].endswith("   update  rollout     host")
    assert max(map(len, printed.splitlines())) <= 120


def test_no_plan_for_the_tiny_demo_and_one_line_for_a_hub_model_not_on_disk(capsys, monkeypatch):
    import sp3o
    memory.check(infra.cli.parse_args(sp3o.Args, sp3o.TINY_PRESET, []), "sp3o.py", "cpu")
    assert capsys.readouterr().out == ""  # the CPU demo prints no plan unless --gpu-memory-gib asks
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    memory.check(infra.cli.parse_args(sp3o.Args, None, ["--model", "Qwen3-NotOnDisk-Base"]), "sp3o.py", "cpu")
    assert capsys.readouterr().out == "memory plan: skipped, no config.json of 'Qwen3-NotOnDisk-Base' on disk " \
                                      "(a hub model not downloaded yet)\n"


def test_scaling_table_rows():
    table = memory.scaling_table()
    assert "| `sp3o.py` | Qwen3-4B | 2 | 1 (127 GiB) | 16 | 1 (127 GiB) |" in table
    assert "| `grpo.py` | Qwen3-8B | 4 | 1 (137 GiB) | > 64 | > 64 |" in table


# ---------------------------------------------------------------------------------------------- --offload-optimizer
# The actor trains from the first step: its offloaded update is compared too. Old log-probs recomputed in every run:
# an offloaded (sharded) run's engine is a copy and recomputes them; a plain run would reuse its engine's, equal to
# the recomputed ones only up to float noise, and the runs are compared for exactly equal floats.
# One sample per prompt: bit-exact across offload modes needs the same forward in both, and common.response_forward
# shares a group's prompt pass only without FSDP (a different float summation).
SMALL = ["--prompts-per-step", 4, "--samples-per-prompt", 1, "--micro-batch-size", 16, "--eval-problems", 4,
         "--save-every", 0, "--critic-warmup", 0, "--old-logprobs", "recompute"]


def start_ppo(output_dir, run_name, steps, *flags):
    command = [sys.executable, "ppo.py", *SMALL, "--steps", steps, "--output-dir", output_dir, "--run-name", run_name,
               *flags]
    return subprocess.Popen([str(c) for c in command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))


def finish(process):
    output = process.communicate(timeout=900)[0]
    assert process.returncode == 0, output[-3000:]



def test_offload_optimizer_trains_and_resumes_exactly(tmp_path):
    """PPO (policy and critic) for 3 steps without offload == 1 step with --offload-optimizer (FSDP2 on a world of
    one, CPUOffloadPolicy), resumed without it for step 2, then with it again for step 3: the same losses each step
    and bit-identical final weights. The checkpoint format is the same with and without offload."""
    check = ("import infra.dist, common, torch.distributed.fsdp as fsdp; infra.dist.init_device('cpu', True); "
             "model = common.load_model('tiny', device='cpu')[0]; "
             "print(isinstance(model, fsdp.FSDPModule), type(model._get_fsdp_state()._fsdp_param_group.offload_policy)"
             ".__name__, model.model.layers[0].mlp.up_proj.weight.device)")  # a private attribute: the policy set
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True,
                          timeout=300).stdout.split()[-3:] == ["True", "CPUOffloadPolicy", "cpu"]
    output = str(tmp_path)
    straight = start_ppo(output, "straight", 3)
    finish(start_ppo(output, "chain", 1, "--offload-optimizer"))
    finish(start_ppo(output, "chain", 2, "--resume", tmp_path / "chain"))
    finish(start_ppo(output, "chain", 3, "--resume", tmp_path / "chain", "--offload-optimizer"))
    finish(straight)
    a, b = records(tmp_path / "straight"), records(tmp_path / "chain")
    assert sorted(a) == sorted(b) == [0, 1, 2]
    for step in range(3):
        keys = {"reward", "policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "approx_kl"}
        assert {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}, step  # exactly equal floats
    for model in ("policy", "critic"):
        weights = [load_file(tmp_path / run / "checkpoints" / "step_000003" / model / "model.safetensors")
                   for run in ("straight", "chain")]
        assert sorted(weights[0]) == sorted(weights[1])
        assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
