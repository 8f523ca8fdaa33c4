"""The CPU-checkable parts of benchmarks/gpu_check.sh (the GPU check itself needs a CUDA GPU and has not run): the
random Qwen3-0.6B-shaped model built from its config, the trainers' flags for the check, and the table."""
import json
import os
import subprocess
import sys

import pytest
import torch

import common
import infra.cli
import infra.engine
import infra.tiny
from benchmarks import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_SHAPE = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16)  # Qwen3-0.6B's vocabulary, a small body


def test_the_shape_has_qwen3_0_6b_parameter_counts():
    """The model card's 0.6B parameters, 0.44B without the embedding (tied with the output layer)."""
    from transformers import Qwen3ForCausalLM
    with torch.device("meta"):
        model = Qwen3ForCausalLM(gpu_check.qwen3_config())
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert embedding == 151936 * 1024 and model.lm_head.weight is model.get_input_embeddings().weight
    assert total == 596_049_920 and total - embedding == 440_467_456


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return gpu_check.write_model(str(tmp_path_factory.mktemp("random") / "model"), **SMALL_SHAPE)


def test_random_model_loads_encodes_the_task_and_decodes_every_id(random_model):
    model, tokenizer = common.load_model(random_model, "float32", "cpu")
    assert len(tokenizer) == model.config.vocab_size == 151936  # no resize: the checkpoint's shape is the shape
    question = infra.tiny.builtin_rows("test", 1, 0)[0]["question"]
    ids = common.prompt_ids(tokenizer, question)
    assert tokenizer.decode(ids) == common.plain_prompt(question) and tokenizer.convert_ids_to_tokens(
        ids[-2]) == common.INSTRUCTION  # the instruction is one token, as in the tiny model
    assert all(isinstance(tokenizer.decode([i]), str) for i in (99, 5000, 151934, 151935))
    completions = infra.engine.HFGenerator(model, tokenizer).generate([ids], n=2, max_tokens=6, temperature=1.0)
    assert [len(c.token_ids) for c in completions] == [6, 6] and all(c.finish_reason == "length" for c in completions)


@pytest.mark.parametrize("trainer", gpu_check.TRAINERS)
def test_the_check_flags_parse_for_every_trainer(trainer, random_model, tmp_path):
    module = __import__(trainer)
    flags = gpu_check.run_flags(trainer, str(tmp_path))
    args = infra.cli.parse_args(module.Args, module.TINY_PRESET, argv=flags)
    module.check_args(args)
    assert (args.generator, args.steps, args.prompts_per_step, args.max_response_tokens) == ("vllm", 3, 16, 256)
    assert args.eval_max_tokens == 128 and args.model == os.path.join(str(tmp_path), "model")
    assert not infra.tiny.is_tiny_model(random_model)  # the published defaults, not the tiny preset, fill the rest


def test_the_flags_as_gpu_check_sh_reads_them(tmp_path):
    printed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "flags", "spo", str(tmp_path)], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert printed == gpu_check.run_flags("spo", str(tmp_path))  # one per line (gpu_check.sh: mapfile -t)
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=REPO).returncode == 0  # its syntax


def test_the_table(tmp_path):
    (tmp_path / "runs" / "grpo").mkdir(parents=True)
    with open(tmp_path / "runs" / "grpo" / "metrics.jsonl", "w") as handle:
        for step in range(3):
            handle.write(json.dumps(dict(step=step, rollout_s=10.0 if step == 0 else 2.0, update_s=1.0 + step,
                                         tokens_per_s=500.0, logprob_gap_mean=1e-3, logprob_gap_max=0.1 * step)) + "\n")
    (tmp_path / "grpo.exit").write_text("0 95\n")
    (tmp_path / "grpo.log").write_text("step 0 ...\n")
    (tmp_path / "runs" / "spo").mkdir(parents=True)  # an HF-engine run (gpu_check.sh with GENERATOR=hf)
    with open(tmp_path / "runs" / "spo" / "metrics.jsonl", "w") as handle:
        for step in range(3):
            handle.write(json.dumps(dict(step=step, rollout_s=3.0, update_s=1.0, tokens_per_s=100.0,
                                         gpu_peak_gib=7.5 + step)) + "\n")
    (tmp_path / "runs" / "spo" / "config.json").write_text(json.dumps(dict(generator="hf")))
    (tmp_path / "spo.exit").write_text("0 60\n")
    (tmp_path / "spo.log").write_text(  # the memory plan as infra.memory.table prints it
        "memory plan per GPU, spo.py, 1 process, 139.7 GiB GPU                 update  rollout     host\n"
        "  total GiB                                                                                   "
        "12.3     10.1     30.2\n")
    (tmp_path / "ppo.exit").write_text("124 150\n")
    (tmp_path / "ppo.log").write_text("loading\nRuntimeError: CUDA out of memory\n")
    (tmp_path / "bench_update.txt").write_text(
        "| model | parameters | tokens / step | timed steps | s / step | update tokens/s | MFU | generate tokens/s | "
        "peak memory (GiB) |\n|---|\n"
        "| qwen3-0.6b-shape | 596.0M | 16384 | 12 | 0.41 | 39,960 | 14.4% | 1,234.5 | 30.12 |\n")
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.strip("|").split("|")]
            for line in gpu_check.table(str(tmp_path)).splitlines()[2:]}
    assert rows["grpo.py"][1:7] == ["ok", "3", "95", "2.00", "2.50", "500"]  # steps 1 and 2 (step 0 warms up)
    assert rows["grpo.py"][8:] == ["1.00e-03 / 2.00e-01", "on", "nan / nan"]
    assert rows["spo.py"][8:] == ["nan / nan", "- (HF engine)", "9.5 / 12.3"]  # the last step's peak; the plan's
    assert rows["ppo.py"][1] == "exit 124 (timed out): RuntimeError: CUDA out of memory"
    assert rows["sppo.py"][1] == "not run"
    assert rows["bench_update.py (update only, 16384 tokens/step)"][5:8] == ["0.41", "39,960", "14.4%"]
