"""Helpers of benchmarks/gpu_check.sh (the GPU check of the vLLM path).

    python benchmarks/gpu_check.py model OUT_DIR            # a random Qwen3-0.6B-shaped checkpoint, from its config
    python benchmarks/gpu_check.py flags TRAINER RUN_DIR [GENERATOR]  # the trainer's flags (vllm or hf), one a line
    python benchmarks/gpu_check.py table RUN_DIR            # one table: the trainers' runs and bench_update.py's
    python benchmarks/gpu_check.py trainers                 # the trainer files (infra.cli.trainers), forks too

The model: Qwen3-0.6B's shape (bench_update.QWEN3_0_6B_SHAPE: 28 layers, hidden 1024, 16 query / 8 key-value heads
of 128, MLP 3072, vocabulary 151,936, tied embeddings; 596M parameters, 440M without the embedding, as the model
card's 0.6B / 0.44B), randomly initialized (seed 0), nothing downloaded. Its tokenizer is the built-in tiny model's
(characters and the instruction token, so the built-in task's prompts encode) filled up with placeholder tokens to
the 151,936 ids, so every id the random model samples decodes. Saved in bfloat16 (the trainers load float32).
"""
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import infra.cli  # noqa: E402
from benchmarks.bench_update import QWEN3_0_6B_SHAPE  # noqa: E402

TRAINERS = infra.cli.trainers()  # every trainer file at the root, forks included
# 3 steps of 16 prompts (x 8 samples for GRPO and SPO's chain, x 1 for SPPO: the trainers' defaults), 256-token
# responses, an evaluation of 32 problems x 1 sample at the first and last step; bf16 compute (--dtype auto on GPU)
RUN_FLAGS = ["--steps", "3", "--prompts-per-step", "16", "--max-response-tokens", "256",
             "--eval-problems", "32", "--eval-n", "1", "--eval-max-tokens", "128", "--save-every", "0",
             "--keep-checkpoints", "1"]
EXTRA_FLAGS = {"sp3o": ["--critic-warmup", "1"],  # else all 3 steps are the critic's warm-up
               "spo": ["--mc-samples", "2", "--cut-interval", "32"]}  # a random model: every token is a cutpoint


def run_flags(trainer, run_dir, generator="vllm"):
    return ["--model", os.path.join(run_dir, "model"), "--generator", generator, *RUN_FLAGS,
            *EXTRA_FLAGS.get(trainer, []), "--output-dir", os.path.join(run_dir, "runs"), "--run-name", trainer]


def placeholder_tokenizer(vocab_size):
    """The tiny model's character tokenizer (infra/tiny.py build_tiny_model), its vocabulary filled up to
    `vocab_size` ids with placeholders `<|xN|>` (never produced by encoding: the pre-tokenizer splits text into
    single characters)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    tokens = specials + ["\n"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<|x{i}|>" for i in range(vocab_size - 1 - len(tokens))]  # the last id: the instruction token
    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(common.INSTRUCTION, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   unk_token="<|unk|>", clean_up_tokenization_spaces=False)


def qwen3_config(**overrides):
    from transformers import Qwen3Config
    return Qwen3Config(**{**QWEN3_0_6B_SHAPE, **overrides}, pad_token_id=0, eos_token_id=1, bos_token_id=1)


def write_model(out_dir, **overrides):
    """Save a random model of Qwen3-0.6B's shape (changed by `overrides`, e.g. fewer layers for a test) and its
    tokenizer to out_dir, a Hugging Face checkpoint that the trainers and vLLM load. Returns out_dir."""
    from transformers import Qwen3ForCausalLM
    config = qwen3_config(**overrides)
    tokenizer = placeholder_tokenizer(config.vocab_size)
    assert len(tokenizer) == config.vocab_size
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # the GPU initializes 596M weights faster
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def mean(records, key):
    values = [r[key] for r in records if key in r]
    return sum(values) / len(values) if values else float("nan")


def table(run_dir):
    """Markdown: a row per trainer (RUN_DIR/runs/<trainer>/metrics.jsonl; RUN_DIR/<trainer>.exit: its exit status
    and wall seconds; RUN_DIR/<trainer>.log) and a row from RUN_DIR/bench_update.txt."""
    lines = ["| run | result | steps | wall s (start-up, steps, save) | rollout s/step | update s/step | tokens/s "
             "| MFU | log-prob gap mean / max | sleep mode | GPU peak / plan GiB |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for trainer in TRAINERS:
        exit_path = os.path.join(run_dir, f"{trainer}.exit")
        if not os.path.exists(exit_path):
            lines.append(f"| {trainer}.py | not run | | | | | | | | | |")
            continue
        with open(exit_path) as handle:
            status, seconds = handle.read().split()
        with open(os.path.join(run_dir, f"{trainer}.log"), errors="replace") as handle:
            log = handle.read()
        records = metrics(os.path.join(run_dir, "runs", trainer))
        if status == "0" and len(records) == 3:
            result = "ok"
        else:
            problems = [line for line in log.splitlines() if re.search(r"Error|error:", line)] or ["no error line"]
            result = f"exit {status}" + (" (timed out)" if status == "124" else "") + ": " + problems[-1][-90:]
        config = os.path.join(run_dir, "runs", trainer, "config.json")
        hf = os.path.exists(config) and json.load(open(config)).get("generator") == "hf"
        sleep = "- (HF engine)" if hf else "off (no sleep mode)" if "vLLM: no sleep mode" in log else "on"
        totals = re.findall(r"^  total GiB\s+([\d.,]+)\s+([\d.,]+)", log, re.M)  # the plan's update, rollout
        plan = max(float(value.replace(",", "")) for value in totals[0]) if totals else float("nan")
        steps = records[1:] or records  # the first step also warms the engine up
        gap_max = max([r.get("logprob_gap_max", float("nan")) for r in records] or [float("nan")])
        lines.append(f"| {trainer}.py | {result.replace('|', '/')} | {len(records)} | {seconds} | "
                     f"{mean(steps, 'rollout_s'):.2f} | {mean(steps, 'update_s'):.2f} | "
                     f"{mean(steps, 'tokens_per_s'):,.0f} | - | {mean(records, 'logprob_gap_mean'):.2e} / "
                     f"{gap_max:.2e} | {sleep} | {mean(records[-1:], 'gpu_peak_gib'):.1f} / {plan:.1f} |")
    bench_path = os.path.join(run_dir, "bench_update.txt")
    bench = open(bench_path).read() if os.path.exists(bench_path) else ""
    row = next((line for line in bench.splitlines() if line.startswith("| qwen3-0.6b-shape")), None)
    if row:  # model | parameters | tokens / step | timed steps | s / step | update tokens/s | MFU | generate | memory
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        lines.append(f"| bench_update.py (update only, {cells[2]} tokens/step) | ok | {cells[3]} | | | "
                     f"{cells[4]} | {cells[5]} | {cells[6]} | | | |")
    else:
        lines.append("| bench_update.py | not run or failed | | | | | | | | | |")
    return "\n".join(lines)


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    if command == "model":
        print(write_model(paths[0]))
    elif command == "flags":
        print("\n".join(run_flags(*paths)))  # TRAINER RUN_DIR [GENERATOR]
    elif command == "table":
        print(table(paths[0]))
    elif command == "trainers":
        print(*TRAINERS)
    else:
        sys.exit(f"usage: {sys.argv[0]} model OUT_DIR | flags TRAINER RUN_DIR | table RUN_DIR | trainers")
