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
    # autocast's bf16 casts of the 28 layers' 440,466,432 parameters, x 2 bytes (the LM head: a slice at a time)
    assert rows["compute copies"] == (880_932_864, 0, 0)
    # per token and layer saved: 16 x 1024 + 2 x 2 x 1024 + 8 x (2048 + 1024) + 5 x 2 x 2048 + 4 x 2 x 3072
    #   = 16,384 + 4,096 + 24,576 + 20,480 + 24,576 = 90,112 bytes; checkpointed: 28 float32 layer inputs
    #   (28 x 4 x 1024 = 114,688) + one layer recomputed; x 16,384 tokens = 3,355,443,200, + mask 16,384 x 9,216
    assert rows["activations"] == (3_355_443_200 + 150_994_944, 0, 0)
    # the LM head over 16,384 positions a slice of 2**24 / 16,384 = 1,024 vocabulary columns at a time: the slice's
    # float32 logits and a temporary as large (8 bytes), the hidden states' casts and gradient (8 x 1024 per position)
    assert rows["logits"] == (8 * 16384 * (1024 + 1024), 0, 0) == (268_435_456, 0, 0)  # whole logits: 9.96 GB
    assert rows["grad buffers"] == (2 * 4 * 151936 * 1024, 0, 0)  # the tied head's and the embedding's, float32
    # one layer's backward above its saved tensors: the MLP product's two factors' gradients, 2 x 2 bytes x 3,072
    assert rows["layer backward"] == (2 * 2 * 3072 * 16384, 0, 0) == (201_326_592, 0, 0)
    # AdamW's foreach sqrt (4 x 596,049,920 = 2,384,199,680) is less than the pass's transient rows, freed by then
    transient = 880_932_864 + 3_506_438_144 + 268_435_456 + 1_244_659_712 + 201_326_592
    assert rows["optimizer step"] == (0, 0, 0) and 4 * p < transient == 6_101_792_768
    # vLLM asleep at level 2: 1 GiB left on the GPU; its graph and runtime pools (~0.75 GiB) in pinned host memory,
    # blocks rounded up to a power of two: 2 GiB
    assert rows["engine"] == (GIB, 0.3 * 80 * GIB, 2 * GIB)
    assert rows["fragmentation"] == (0.1 * transient, 0, 0)  # vLLM's own pool: no rollout term of ours
    # the CUDA context (0.5 GiB) and no NCCL (nothing sharded) on the GPU; the process's own 2 GiB on the host
    assert rows["overhead"] == (GIB / 2, GIB / 2, 2 * GIB)
    update = 2 * 2_384_199_680 + 4_768_399_360 + transient + GIB + 0.1 * transient + GIB / 2
    rollout = 2_384_199_680 + 4_768_399_360 + 24 * GIB + GIB / 2
    assert (update, rollout) == (17_859_383_500.8, 33_459_273_728)  # 16.6 and 31.2 GiB: the rollout is the peak
    assert sum(row[2] for row in memory.plan(setup)) == update and memory.peak(memory.plan(setup)) == rollout


def test_the_optimizer_step_counts_what_its_temporaries_need_beyond_the_pass():
    """AdamW steps after the backward pass: its foreach temporary (4 bytes a parameter, on CUDA) counts only beyond
    the pass's transient rows. Qwen3-0.6B GRPO at 256 tokens per micro-batch: compute copies 880,932,864,
    activations 256 x (28 x 4 x 1,024 + 90,112) + the mask 256 x 256 = 52,494,336, logits 8 x 256 x (65,536 + 1,024)
    = 136,314,880 (2**24 / 256 columns a slice), grad buffers 1,244,659,712, layer backward 2 x 2 x 3,072 x 256 =
    3,145,728: 2,317,547,520, below 4 x 596,049,920 = 2,384,199,680 by 66,652,160. On CPU (the for-loop path) or
    offloaded: two float32 copies of the largest tensor, the [151,936 x 1,024] embedding."""
    setup = Setup((("policy", QWEN3_06B, 0, True),), tokens=256, sequence=256, engine_bytes=24 * GIB)
    rows = rows_of(setup)
    transient = 880_932_864 + 52_494_336 + 136_314_880 + 1_244_659_712 + 3_145_728
    assert sum(rows[name][0] for name in ("compute copies", "activations", "logits", "grad buffers",
                                          "layer backward")) == transient == 2_317_547_520
    assert rows["optimizer step"] == (4 * 596_049_920 - transient, 0, 0) == (66_652_160, 0, 0)
    assert memory.optimizer_temporaries(dataclasses.replace(setup, cpu=True)) == 8 * 151936 * 1024
    offloaded = rows_of(dataclasses.replace(setup, offload=True))
    assert offloaded["optimizer step"] == (0, 0, 8 * 151936 * 1024)  # the step runs on the CPU: host memory


def test_plan_qwen3_4b_sp3o_in_one_process():
    """The issue's command: sp3o.py on Qwen3-4B in one process with the defaults (micro-batches of 8 sequences of
    1,024 + 8,192 tokens = 73,728 tokens): policy and critic, float32 weights and AdamW states."""
    setup = Setup((("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True)), tokens=73728, sequence=9216,
                  engine_bytes=24 * GIB, rows=8)
    rows = rows_of(setup)
    both = 4_022_468_096 + 4_022_470_657  # 8,044,938,753 parameters
    assert rows["weights"][0] == rows["gradients"][0] == 4 * both == 32_179_755_012
    assert rows["AdamW states"][0] == 8 * both == 64_359_510_024  # 128.7 GB of float32 state before activations
    # the policy's pass is the larger: bf16 casts of 36 layers (3,633,509,376 parameters), x 2
    assert rows["compute copies"][0] == 7_267_018_752
    # per token: 36 x 4 x 2560 = 368,640 (checkpointed float32 inputs) + one layer: 16 x 2560 + 2 x 2 x 2560
    #   + 8 x (4096 + 1024) + 5 x 2 x 4096 + 4 x 2 x 9728 = 40,960 + 10,240 + 40,960 + 40,960 + 77,824 = 210,944
    #   -> 579,584 x 73,728 = 42,731,569,152, + mask 73,728 x 9,216 = 679,477,248
    assert rows["activations"][0] == 43_411_046_400
    # the LM head over the 8 responses' 8 x 8,192 = 65,536 positions (the prompts' columns are never computed), a
    # slice of max(256, 2**24 / 65,536) = 256 columns at a time: 8 x 65,536 x (256 + 2560); whole bf16 logits and
    # their gradient were 4 x 8 x 8,193 x 151,936 = 39,833,972,736
    assert rows["logits"][0] == 1_476_395_008
    # the tied embedding's two float32 gradients (its LM head's, then its own) before accumulation: 8 x V x h
    assert rows["grad buffers"][0] == 8 * 151936 * 2560 == 3_111_649_280
    assert rows["layer backward"][0] == 2 * 2 * 9728 * 73728 == 2_868_903_936  # 2bI a token
    transient = 7_267_018_752 + 43_411_046_400 + 1_476_395_008 + 3_111_649_280 + 2_868_903_936
    # each optimizer steps alone: the larger model's foreach temporary, 4 x 4,022,470,657, is below `transient`
    assert rows["optimizer step"][0] == 0 and 4 * 4_022_470_657 < transient
    update = 2 * 32_179_755_012 + 64_359_510_024 + transient + GIB + 0.1 * transient + GIB / 2  # vLLM asleep, context
    assert memory.peak(memory.plan(setup)) == update == pytest.approx(194_278_147_497.6)  # 180.9 GiB
    assert rows["weights"][1] + rows["AdamW states"][1] + 24.5 * GIB == pytest.approx(114.409 * GIB, rel=1e-5)


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
    assert rows["logits"][0] == 8 * 16384 * (1024 + 4096)  # slices of 1,024 columns; hidden 4,096
    # FSDP2's root unit (1,244,663,808 parameters): its bf16 gradient and float32 reduce-scatter input, (2 + 4) each
    assert rows["grad buffers"][0] == 6 * 1_244_663_808 == 7_467_982_848
    assert rows["layer backward"][0] == 2 * 2 * 12288 * 16384 == 805_306_368
    transient = 4_418_791_936 + 9_277_800_448 + 671_088_640 + 7_467_982_848 + 805_306_368  # 22,640,970,240
    assert rows["optimizer step"][0] == 0 and 4 * 8_190_735_360 / 8 < transient  # foreach over the local shards
    # overhead: the CUDA context 0.5 GiB and NCCL's buffers over 8 ranks, 2 GiB
    update = 2 * 7_879_572_480.5 + 15_759_144_961 + transient + GIB + 0.1 * transient + 2.5 * GIB
    eight = memory.plan(Setup(models, ranks=8, tokens=16384, sequence=9216, engine_bytes=24 * GIB))
    assert sum(row[2] for row in eight) == update == pytest.approx(60_181_453_570)  # 56.0 GiB: now the peak
    rollout = 7_879_572_480.5 + 15_759_144_961 + 24 * GIB + 2.5 * GIB  # weights, AdamW states, vLLM's share, context
    assert sum(row[3] for row in eight) == rollout == 52_092_875_777.5  # 48.5 GiB
    assert memory.peak(eight) == pytest.approx(update)  # fits 80 GiB GPUs
    offloaded = rows_of(Setup(models, ranks=8, offload=True, tokens=16384, sequence=9216, engine_bytes=24 * GIB))
    assert [offloaded[name][0] for name in ("weights", "gradients", "AdamW states")] == [0, 0, 0]
    # host: the float32 states, AdamW's for-loop temporaries on the CPU (2 x 4 bytes x the largest shard: the
    # [151,936 x 4,096] embedding / 8), vLLM's pools (pinned: 2 GiB), the process's own 2 GiB
    step = 8 * 151936 * 4096 / 8
    assert offloaded["optimizer step"] == (0, 0, step) and offloaded["engine"][2] == offloaded["overhead"][2] == 2 * GIB
    assert offloaded["weights"][2] + offloaded["gradients"][2] + offloaded["AdamW states"][2] == 16 * both / 8
    assert offloaded["compute copies"] == rows["compute copies"] and offloaded["logits"] == rows["logits"]
    offloaded_plan = memory.plan(Setup(models, 8, True, 16384, 9216, engine_bytes=24 * GIB))
    assert sum(row[2] for row in offloaded_plan) == pytest.approx(1.1 * transient + 3.5 * GIB)  # 26.7 GiB, the peak
    assert sum(row[3] for row in offloaded_plan) == 24 * GIB + 2.5 * GIB  # the rollout: vLLM's share, the overhead


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
    """Each flag set offered for the 4B SP3O plan on 80 GiB fits, offers the least of its kind, and never more
    ranks than the GPUs the machine has (--gpus)."""
    models = (("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True))
    setup = Setup(models, tokens=73728, sequence=9216, engine_bytes=24 * GIB)
    found = memory.fitting_flags(setup, 80 * GIB)
    assert found == ["torchrun --nproc-per-node 4", "--offload-optimizer",
                     "torchrun --nproc-per-node 2 --micro-batch-tokens 16384",
                     "torchrun --nproc-per-node 2 --critic-model Qwen3-0.6B-Base"]
    fits = [dict(ranks=4), dict(offload=True), dict(ranks=2, tokens=16384)]
    too_little = [dict(ranks=2), dict(ranks=1, tokens=16384), dict(ranks=2, tokens=32768)]
    for changes in fits:
        assert memory.peak(memory.plan(dataclasses.replace(setup, **changes))) <= 80 * GIB
    for changes in too_little:
        assert memory.peak(memory.plan(dataclasses.replace(setup, **changes))) > 80 * GIB
    assert memory.fitting_flags(setup, 80 * GIB, gpus=2) == found[1:]  # no 4 ranks on a 2-GPU machine
    assert memory.fitting_flags(setup, 80 * GIB, gpus=1) == ["--offload-optimizer"]


def test_an_auto_vllm_share_fits_when_it_holds_an_eighth_of_the_rollout():
    """With vLLM's auto share a plan fits only if its KV cache holds 1/8 of the rank's rollout at full length: SP3O
    on Qwen3-4B, offloaded on one 80 GiB GPU, 512 sequences of 1,024 + 8,192 tokens (147,456 bytes a token: 1.27 GiB
    a sequence) would need 64 of them (81 GiB); at 4,096 response tokens 64 x 0.70 GiB = 45 GiB does."""
    models = (("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True))
    setup = Setup(models, offload=True, sequence=9216, generated=(512, 9216), auto_share=True, rollout=512)
    # offloaded, the trainer holds the CUDA context and NCCL's buffers (1.5 GiB) alone in the rollout: 0.9 (vLLM's
    # maximum) of 80 GiB, less vLLM's bf16 weights (8,044,936,192 bytes) and its 4.2 GiB reserve: 60.3 GiB of KV cache
    kv = 0.9 * 80 * GIB - 2 * QWEN3_4B.parameters() - memory.vllm_reserve(QWEN3_4B)
    assert setup.at_once() == 64 and int(kv // QWEN3_4B.kv_bytes(9216)) == 47
    fitted, problem = memory.fit(setup, 80 * GIB, 80 * GIB)
    assert fitted.engine_bytes == 0.9 * 80 * GIB
    assert problem == ("the memory plan leaves vLLM 0.90 of the 80.0 GiB GPU, a KV cache of 60.3 GiB: 47 sequences "
                       "of 9,216 tokens at once, fewer than 1/8 of this rank's rollout of 512 (64)")
    shorter = memory.with_response(4096)(setup)
    assert (shorter.sequence, shorter.generated) == (5120, (512, 5120)) and int(kv // QWEN3_4B.kv_bytes(5120)) == 85
    assert memory.fit(shorter, 80 * GIB, 80 * GIB)[1] is None
    two = memory.with_ranks(2)(setup)  # each rank generates half: 32 sequences at once suffice
    assert (two.rollout, two.generated[0], two.at_once()) == (256, 256, 32)
    assert memory.fit(two, 80 * GIB, 80 * GIB)[1] is None
    given = dataclasses.replace(setup, auto_share=False, engine_bytes=0.3 * 80 * GIB)  # a share given: one sequence
    assert memory.fit(given, 80 * GIB, 80 * GIB)[1] is None


def test_sp3o_with_a_4b_config_prints_the_plan_and_refuses_in_one_line(tmp_path):
    """`sp3o.py --model <a directory holding only a Qwen3-4B config.json> --gpu-memory-gib 80 --gpus 2` on a CPU
    machine: the plan is printed and the run refused in one line naming flags that fit on at most 2 GPUs, before
    any weights are read. Update column: 16 bytes x 8,044,938,753 parameters = 128,719,020,048; compute copies
    7,267,018,752, activations 16,384 x 579,584 + the mask 16,384 x 9,216 = 9,646,817,280, logits 8 x 16,384 x (1,024
    + 2,560) = 469,762,048, grad buffers 3,111,649,280, layer backward 2 x 2 x 9,728 x 16,384 = 637,534,208 (sum
    21,132,781,568, and 10% of it for fragmentation), vLLM asleep 1 GiB and the CUDA context 0.5 GiB: 143.0 GiB."""
    result = subprocess.run([sys.executable, "sp3o.py", "--dataset", "builtin", "--model",
                             qwen3_4b_config(tmp_path / "qwen3-4b"),
                             "--gpu-memory-gib", "80", "--gpus", "2", "--output-dir", str(tmp_path / "runs")], cwd=REPO,
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "memory plan per GPU, sp3o.py, 1 process (2 GPUs here), 80.0 GiB GPU" in result.stdout
    assert "policy 4.02B + critic 4.02B" in result.stdout
    assert (128_719_020_048 + 1.1 * 21_132_781_568 + 1.5 * GIB) / GIB == pytest.approx(143.03, abs=0.005)
    assert "prompts: 1,024 tokens (assumed: no tokenizer files)" in result.stdout  # a config.json alone
    assert result.stderr.strip().splitlines() == [  # at the defaults: 16,384-token micro-batches, auto vLLM share
        "sp3o.py: error: the memory plan needs 143.0 GiB per GPU, more than the 80.0 GiB --gpu-memory-gib: it fits "
        "with torchrun --nproc-per-node 2 --offload-optimizer, or with torchrun --nproc-per-node 2 "
        "--max-response-tokens 2048, or with --offload-optimizer --max-response-tokens 4096"]
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
    result = subprocess.run([sys.executable, "sp3o.py", "--dataset", "builtin", "--model",
                             qwen3_4b_config(tmp_path / "qwen3-4b"),
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
    return Setup(models, **{**dict(tokens=73728, sequence=9216, compute_bytes=4, engine="hf", cpu=True), **changes})


def test_host_refusal_against_a_stated_host_size():
    """The decision, with the host's memory given (not this machine's): a CPU run needs the larger phase of its plan
    plus the host column, per process on the machine; a GPU run with --offload-optimizer its host column: float32
    weights, gradients and AdamW states of policy and critic (16 bytes per trained parameter, sharded over the
    ranks), AdamW's for-loop temporaries on the CPU (two float32 copies of the largest shard: the embedding's),
    vLLM's graph and runtime pools, copied to pinned host memory while it sleeps (2 GiB, each rank), and the process
    itself (2 GiB each)."""
    policy, critic = QWEN3_4B.parameters(), QWEN3_4B.parameters(value_head=1)
    cpu = sp3o_4b()
    rows = memory.plan(cpu)
    need = max(sum(row[2] for row in rows), sum(row[3] for row in rows))
    assert memory.host_need(cpu, True, 1) == need and memory.host_need(cpu, True, 2) == 2 * need
    assert memory.host_refusal(cpu, need, True) is None  # exactly enough
    line = memory.host_refusal(cpu, 24 * GIB, True)
    assert line == (f"the memory plan needs {need / GIB:.1f} GiB of this machine's memory (a CPU run: every column), "
                    "more than the 24.0 GiB available: no smaller Qwen3 --model, --micro-batch-tokens, "
                    "--critic-model or --max-response-tokens fits")
    gpu = Setup(cpu.models, ranks=8, offload=True, tokens=16384, sequence=9216, engine_bytes=24 * GIB)
    host = 8 * (16 * (policy + critic) / 8 + 8 * 151936 * 2560 / 8 + 2 * GIB + 2 * GIB)  # eight ranks on one machine
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
    assert found and all(text.startswith(("--micro-batch-tokens", "--model", "--max-response-tokens"))
                         for text in found)


def test_a_cpu_run_with_vllm_plans_its_kv_cache(tmp_path):
    """vLLM's CPU build holds --vllm-kv-cache-gib of KV cache and its own weights in the compute dtype (float32 on
    CPU), not HF generate's cache, in both phases: it has no sleep mode."""
    import sp3o
    directory = qwen3_4b_config(tmp_path / "qwen3-4b")
    args = infra.cli.parse_args(sp3o.Args, None, ["--model", directory, "--generator", "vllm", "--vllm-kv-cache-gib",
                                                  "3"])
    setup, why = memory.setup_for(args, "cpu", 0)
    assert why is None and (setup.engine, setup.engine_bytes, setup.compute_bytes) == ("vllm", 3 * GIB, 4)
    engine = next(row for row in memory.plan(setup) if row[0] == "engine")
    assert engine[2:] == (3 * GIB + 4 * QWEN3_4B.parameters(),) * 2 + (0,)
    setup, _ = memory.setup_for(infra.cli.parse_args(sp3o.Args, None, ["--model", directory]), "cpu", 0)
    assert setup.engine == "hf"


def test_the_plan_table_keeps_every_label_in_120_columns():
    printed = memory.table(memory.plan(Setup(sp3o_4b().models, offload=True, engine_bytes=24 * GIB)), "memory plan")
    assert "float32, policy 4.02B + critic 4.02B, over 1 rank, in host memory " in printed  # was cut: "in host me"
    assert printed.splitlines()[0].endswith("   update  rollout     host")
    assert max(map(len, printed.splitlines())) <= 120


def test_no_plan_for_the_tiny_demo(capsys):
    import sp3o
    assert memory.check(infra.cli.parse_args(sp3o.Args, sp3o.TINY_PRESET, []), "sp3o.py", "cpu") == 0.3
    assert capsys.readouterr().out == ""  # the CPU demo prints no plan unless --gpu-memory-gib asks


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The hub replaced: a repository not in the local cache, reachable, whose config.json hf_hub_download fetches
    (a Qwen3-4B config written to a snapshot folder); the files asked for are recorded."""
    import huggingface_hub
    import infra.hub
    asked = []

    def download(repo_id, filename, **kwargs):
        asked.append((repo_id, filename))
        return os.path.join(qwen3_4b_config(tmp_path / "snapshot"), filename)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo_id, filename, **kwargs: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(infra.hub, "_unreachable", lambda endpoint: None)
    return asked


def test_a_hub_model_not_on_disk_fetches_its_config_alone_and_is_planned(hub, capsys):
    import sp3o
    assert memory.read_shape("someorg/Qwen3-Fetched-A") == (QWEN3_4B, None)
    assert hub == [("someorg/Qwen3-Fetched-A", "config.json")]  # config.json alone, no weights
    args = infra.cli.parse_args(sp3o.Args, None, ["--model", "someorg/Qwen3-Fetched-B", "--gpu-memory-gib", "80"])
    with pytest.raises(infra.UserError, match="needs 143.0 GiB per GPU"):  # planned, not skipped
        memory.check(args, "sp3o.py", "cpu")
    assert "memory plan per GPU, sp3o.py" in capsys.readouterr().out and "skipped" not in capsys.readouterr().out


def test_offline_without_a_cache_the_plan_refuses_in_check_model_sources_line(hub, monkeypatch):
    import huggingface_hub
    import sp3o
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = infra.cli.parse_args(sp3o.Args, None, ["--model", "Qwen3-NotOnDisk-Base"])
    with pytest.raises(infra.UserError, match=r"--model 'Qwen3-NotOnDisk-Base': no such local folder, and not in the "
                                              r"local Hugging Face cache .* while HF_HUB_OFFLINE=1"):
        memory.check(args, "sp3o.py", "cpu")
    assert hub == []


def test_auto_vllm_share_by_hand():
    """GRPO on Qwen3-0.6B, one 80 GiB GPU: in the rollout the trainer holds float32 weights 2,384,199,680 and AdamW
    states 4,768,399,360 and the 0.5 GiB CUDA context: 7,689,469,952 of 85,899,345,920 bytes = 0.0895; 1 - 0.0895
    - 0.05 margin = 0.860 -> 0.86. The KV cache: 0.86 x 80 GiB - vLLM's bf16 weights (2 x 596,049,920) - its reserve
    (its start-up sampler over 1,024 rows of the 151,936-token vocabulary at 24 bytes an entry, 3,733,979,136, and
    0.75 GiB of CUDA graphs: 4,539,285,504) = 68,142,052,147.2 bytes; a 9,216-token sequence needs 9,216 x 2 x 28
    layers x 8 KV heads x 128 x 2 bytes = 1,056,964,608: 64 of them."""
    setup = Setup((("policy", QWEN3_06B, 0, True),), tokens=16384, sequence=9216)
    assert memory.vllm_reserve(QWEN3_06B) == 24 * 1024 * 151936 + 3 * GIB // 4 == 4_539_285_504
    share, kv = memory.vllm_share(setup, 80 * GIB)
    assert share == 0.86 and kv == pytest.approx(68_142_052_147.2)
    assert QWEN3_06B.kv_bytes(9216) == 1_056_964_608 and int(kv // 1_056_964_608) == 64
    offloaded, _ = memory.vllm_share(dataclasses.replace(setup, offload=True), 80 * GIB)
    assert offloaded == 0.9  # the trainer holds its 1.5 GiB overhead (context, NCCL) alone: 0.93, capped at 0.9
    big = Setup((("policy", QWEN3_8B, 0, True), ("critic", QWEN3_8B, 1, True)), sequence=9216)
    assert memory.check_share(setup, 80 * GIB) == (share, kv)  # 65 sequences at once: 1/8 of 512 is 64
    assert memory.vllm_share(big, 80 * GIB)[0] < 0  # 16-byte states of 15.8B parameters on one GPU: nothing left
    with pytest.raises(infra.UserError) as refused:
        memory.check_share(big, 80 * GIB)
    assert str(refused.value) == ("the memory plan leaves vLLM 0.00 of the 80.0 GiB GPU, a KV cache of 0.0 GiB: "
                                  "0 sequences of 9,216 tokens at once, fewer than 1/8 of this rank's rollout of "
                                  "512 (64)")


def test_check_returns_the_share_the_engine_gets(tmp_path, capsys):
    """--gpu-memory-utilization 0 (the default): the plan's share; a value given: that value."""
    import grpo
    directory = qwen3_4b_config(tmp_path / "qwen3-4b")
    auto = infra.cli.parse_args(grpo.Args, None, ["--model", directory, "--gpu-memory-gib", "141", "--generator", "hf",
                                                  "--max-response-tokens", "1024", "--eval-datasets"])  # none
    assert memory.check(auto, "grpo.py", "cpu") == 0.3  # the HF engine: no vLLM share to size
    auto.generator = "vllm"
    share = memory.check(auto, "grpo.py", "cpu")
    setup = memory.setup_for(auto, "cpu", 141 * GIB)[0]
    assert share == memory.vllm_share(setup, 141 * GIB)[0] == pytest.approx(setup.engine_bytes / (141 * GIB))
    assert f"vLLM share: {share:.2f} of the GPU (--gpu-memory-utilization 0: auto)" in capsys.readouterr().out
    auto.gpu_memory_utilization = 0.4
    assert memory.check(auto, "grpo.py", "cpu") == 0.4


def test_the_hf_engines_cache_is_the_runs_own_batch(tmp_path, monkeypatch):
    """Issue 40: the HF engine's KV cache is planned for the largest generate call of the run: the step's prompts x
    samples (SPPO: 1 sample) or the evaluation's problems x eval_n (all problems of a set not known: a full batch),
    per rank, at most --hf-batch-size sequences a call (HFGenerator's batch_size), each of the prompt + its response
    limit. The training rollout per rank is what vLLM must hold 1/8 of."""
    import grpo
    import sppo
    directory = qwen3_4b_config(tmp_path / "qwen3-4b")

    def planned(args_class, *flags, **known):  # no held-out sets unless given (a real model's default: its method's)
        args = infra.cli.parse_args(args_class, None, ["--model", directory, "--generator", "hf", "--eval-datasets",
                                                       *flags])
        setup = memory.setup_for(args, "cpu", 0, **known)[0]
        return setup.generated, setup.hf_rows(), setup.rollout
    small = ["--prompts-per-step", "4", "--samples-per-prompt", "8", "--max-response-tokens", "128"]
    assert planned(grpo.Args, *small) == ((32, 1024 + 128), 32, 32)
    evaluation = ["--eval-datasets", "builtin", "--eval-problems", "16", "--eval-n", "2", "--eval-max-tokens", "64"]
    assert planned(grpo.Args, *small, *evaluation) == ((32, 1024 + 128), 32, 32)  # 32 x 1,152 > 32 x 1,088
    assert planned(grpo.Args, *small, *evaluation[:-3], "4", "--eval-max-tokens", "512")[:2] == ((64, 1024 + 512), 64)
    # all problems of a set of unknown size: at least a full batch x 32 samples; a set known: its rows
    assert planned(grpo.Args, *small, "--eval-datasets", "builtin")[:2] == ((256 * 32, 1024 + 8192), 256)
    assert planned(grpo.Args, *small, "--eval-datasets", "builtin", eval_rows=3)[:2] == ((96, 1024 + 8192), 96)
    assert planned(grpo.Args, *small, "--eval-datasets", "builtin", "--hf-batch-size", "16")[1] == 16
    assert planned(sppo.Args, "--prompts-per-step", "40") == ((40, 1024 + 8192), 40, 40)
    assert planned(grpo.Args) == ((512, 1024 + 8192), 256, 512)  # 64 x 8 = 512 sequences: two calls of 256
    assert planned(grpo.Args, prompt_tokens=129)[0] == (512, 129 + 8192)  # the run's longest prompt
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert planned(grpo.Args, *small) == ((16, 1024 + 128), 16, 16)  # each rank generates its share
    engine = next(row for row in memory.plan(Setup((("policy", QWEN3_4B, 0, True),), sequence=1152, engine="hf",
                                                   compute_bytes=4, generated=(32, 1152))) if row[0] == "engine")
    # float32: 32 x 1,152 tokens x 2 x 36 layers x 8 KV heads x 128 x 4 bytes + sampling's 4 float32 [32, V] tensors
    assert engine[2:] == (0, 32 * 1152 * 2 * 36 * 8 * 128 * 4 + 16 * 32 * 151936, 0)


def test_scaling_table_rows():
    """At the defaults (16,384-token micro-batches, vLLM's share auto: its KV cache must hold 1/8 of the rank's 512
    sequences) every method but VAPO fits Qwen3-4B and Qwen3-8B on 8 "80 GB" GPUs (79.11 GiB to CUDA) or fewer; the
    second setting is the defaults before issue 39 (8 sequences, vLLM at 0.3). SP3O on Qwen3-4B over 2 ranks: the
    trainer keeps 12 bytes x 8,044,938,753 / 2 + 2.5 GiB (the CUDA context, NCCL's buffers) in the rollout, which
    leaves vLLM 0.35 of the GPU: 27.7 GiB less its 7.5 GiB of weights and its 4.2 GiB reserve = 16.0 GiB of KV cache,
    12 sequences of 9,216 tokens (1.27 GiB each), fewer than 256 / 8 = 32."""
    table = memory.scaling_table()
    assert "| `sp3o.py` | Qwen3-4B | 4 | 2 (65 GiB) | 4 | 1 (127 GiB) |" in table
    assert "| `grpo.py` | Qwen3-8B | 4 | 2 (67 GiB) | 16 | 1 (131 GiB) |" in table
    models = (("policy", QWEN3_4B, 0, True), ("critic", QWEN3_4B, 1, True))
    two = Setup(models, ranks=2, generated=(256, 9216), auto_share=True, rollout=256)
    gpu = memory.CUDA_80GB_GIB * GIB
    assert memory.fit(two, gpu, gpu)[1].startswith("the memory plan leaves vLLM 0.35 of the 79.1 GiB GPU, a KV cache "
                                                   "of 16.0 GiB: 12 sequences of 9,216 tokens at once, fewer than 1/8")
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    defaults = {(row[0].strip("| `"), row[1]): int(row[2]) for row in rows}
    assert {method for method, _ in defaults} >= {"sp3o.py", "ppo.py", "tppo.py", "sppo.py", "grpo.py", "spo.py"}
    # VAPO's published rollout (512 x 16 samples of up to 20,480 tokens) alone needs more: 1/8 of it in vLLM's cache
    assert {model: defaults["vapo.py", model] for model in ("Qwen3-4B", "Qwen3-8B")} == {"Qwen3-4B": 64, "Qwen3-8B": 64}
    assert all(gpus <= 8 for (method, model), gpus in defaults.items() if model in ("Qwen3-4B", "Qwen3-8B")
               and method != "vapo.py")


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



def test_offloaded_shards_are_page_locked_where_they_lie(monkeypatch, capsys):
    """Issue 57: FSDP2's pin_memory=True copies each offloaded shard into torch's caching host allocator, which rounds
    every block up to a power of two (1.35-1.6x for Qwen3-4B's tensors: 41.9 MB q_proj -> 64 MiB, 99.6 MB MLP
    matrices -> 128 MiB). shard_model asks CPUOffloadPolicy(pin_memory=False) (checked in a process of its own, on
    CPU) and, on a GPU, page-locks the shards in place (pin_in_place: cudaHostRegister, portable, their exact sizes):
    each storage of 1 MiB or more once, in address order, none sharing a page with one registered before it, a
    smaller one left pageable; at a failure the runtime's last error is cleared and the rest stay pageable, in one
    line."""
    import types

    import infra.dist
    calls, cleared, fail = [], [], [False]

    class Cudart:  # torch.cuda.cudart()'s cudaHostRegister: an error code, 0 for cudaSuccess
        def cudaHostRegister(self, pointer, size, flags):
            calls.append((pointer, size, flags))
            return 801 if fail[0] else 0
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(infra.dist, "_clear_cuda_error", lambda: cleared.append(True))

    def shard(pointer, size):  # a parameter (a DTensor's local shard) whose storage lies at `pointer`
        storage = types.SimpleNamespace(data_ptr=lambda: pointer, nbytes=lambda: size)
        return types.SimpleNamespace(to_local=lambda: types.SimpleNamespace(untyped_storage=lambda: storage))
    mib, base = 2 ** 20, 2 ** 30
    model = types.SimpleNamespace(parameters=lambda: [
        shard(base + 8 * mib, 3 * mib), shard(base, mib), shard(base, mib),  # a view: the same storage
        shard(base + mib - 100, 2 * mib),  # its first page is the first shard's last: left pageable
        shard(base + 16 * mib, 100)])  # small
    assert infra.dist.pin_in_place(model) == 4 * mib
    assert calls == [(base, mib, 1), (base + 8 * mib, 3 * mib, 1)] and not cleared and not capsys.readouterr().out
    calls.clear()
    fail[0] = True
    assert infra.dist.pin_in_place(model) == 0 and len(calls) == 1 and cleared == [True]
    assert capsys.readouterr().out == ("--offload-optimizer: page-locking the shards failed (cudaError 801): their "
                                       "copies to the GPU run from pageable memory\n")
    check = ("import infra.dist, common; infra.dist.init_device('cpu', True); "
             "model = common.load_model('tiny', device='cpu')[0]; "
             "print(model._get_fsdp_state()._fsdp_param_group.offload_policy.pin_memory)")  # a private attribute
    assert subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True,
                          timeout=300).stdout.split()[-1:] == ["False"]


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
