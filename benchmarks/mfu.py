"""Model FLOP utilisation (MFU) of the update at Qwen3-0.6B's shapes on this CPU: its useful FLOPs over its wall
time, as a share of the matmul ceiling (benchmarks/ceiling.py) measured in the same process, dtype and threads.

    OMP_NUM_THREADS=1 python benchmarks/mfu.py --layers 28 --response-length 1024
    OMP_NUM_THREADS=1 python benchmarks/mfu.py --layers 28 --response-length 1024 --gradient-checkpointing
    OMP_NUM_THREADS=1 python benchmarks/mfu.py --layers 8 --response-length 4096 --profile   # + a torch.profiler table
    OMP_NUM_THREADS=1 python benchmarks/mfu.py --layers 8 --left-pad 1    # the masked attention of a padded batch

The update step: bench_update.update_step on one micro-batch: common.response_logprobs (bf16 autocast over float32
weights, as common.load_model sets up the trainers' models), loss = mean response log-prob, backward; no optimizer
step. The model: bench_update.build_model, random weights of Qwen3-0.6B's shape (--layers of its 28), as
common.load_model leaves it; or --model tiny (the built-in model). The batch: --rows
rows of --prompt-length random prompt tokens (distinct prompts) and --response-length response tokens, no padding;
--left-pad N makes each prompt's first N tokens padding, as a micro-batch of prompts of several lengths has: the
model then takes the attention path with a padding mask (Hugging Face's SDPA: an explicit mask, key-value heads
repeated), where an unpadded batch takes the causal kernel; the N padding tokens are not counted as useful.

Useful FLOPs of one step, the standard dense count (forward + backward = 3 x forward; a multiply-add = 2 FLOPs), with
L layers, hidden h, q = heads x head_dim, kv = key-value heads x head_dim, MLP width i, vocabulary V, B rows of
P + T = s tokens:
    6 x N x B x s       N = L x (h (q + 2 kv) + q h + 3 h i): the decoder layers' matmul parameters (norms are not
                        matmuls; the input embedding is a lookup, not counted)
  + 6 x h x V x B x T   the tied LM head, over the T response positions whose log-probs are used (response_logprobs
                        computes T + 1 logit columns: the extra one is not counted)
  + 6 x L x q x B x s^2 attention's QK^T and PV products, 4 x q FLOPs per (query, key) pair in the forward pass,
                        causal: half the s^2 pairs (s^2 / 2), times 3: 12 x L x heads x head_dim x s^2 / 2 per row
Gradient checkpointing's recomputed forward is not counted (useful FLOPs, not hardware FLOPs), nor the optimizer.
MFU = useful FLOPs / median step time / the ceiling: ceiling.py's matmul mix of this update (each decoder matmul
shape L times, the LM head's once, in nn.Linear's three layouts) at B x s tokens and B x T logit rows.
"""
import argparse
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import common  # noqa: E402
from bench_update import build_model, peak_memory_gib, random_batch, update_step  # noqa: E402
from ceiling import ceiling_flops_per_second, measure  # noqa: E402
from infra.memory import keep_freed_host_memory  # noqa: E402


def useful_flops(config, rows, prompt_length, response_length):
    """(decoder matmuls, LM head, attention) useful FLOPs of one update step, as the module docstring defines them."""
    hidden, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, \
        config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    query, key_value = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    parameters = layers * (hidden * (query + 2 * key_value) + query * hidden + 3 * hidden * inter)
    length = prompt_length + response_length
    return (6 * parameters * rows * length, 6 * hidden * vocab * rows * response_length,
            6 * layers * query * rows * length ** 2)


def step_times(model, batch, warmup, steps):
    for _ in range(warmup):
        update_step(model, batch)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        update_step(model, batch)
        times.append(time.perf_counter() - start)
    return times


def profile_step(model, batch, rows=30):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        update_step(model, batch)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b-shape", help="qwen3-0.6b-shape (random weights) or tiny")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the Qwen3-0.6B-shaped model")
    parser.add_argument("--rows", type=int, default=1, help="sequences in the micro-batch")
    parser.add_argument("--prompt-length", type=int, default=64)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--left-pad", type=int, default=0, help="padding tokens before each prompt (a masked batch)")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (autocast); weights stay float32")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layer activations in backward")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (their median is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the ceiling is measured with them)")
    parser.add_argument("--ceiling-seconds", type=float, default=1.0, help="time each ceiling matmul this long")
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler's table of one more step")
    args = parser.parse_args()
    if not 0 <= args.left_pad < args.prompt_length:
        parser.error(f"--left-pad {args.left_pad}: give 0 to {args.prompt_length - 1} (fewer than --prompt-length)")
    torch.set_num_threads(args.threads)
    keep_freed_host_memory()  # as the trainers on CPU
    model = build_model(args.model, "cpu", args.dtype, 0 if args.model == "tiny" else args.layers)
    model.train()
    if args.gradient_checkpointing:
        common.enable_gradient_checkpointing(model)  # as common.load_model does
    config = model.config
    batch = random_batch(config.vocab_size, args.rows, args.prompt_length, args.response_length, "cpu")
    if args.left_pad:
        mask = batch.attention_mask.clone()
        mask[:, :args.left_pad] = 0
        batch = dataclasses.replace(batch, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    real_prompt = int(batch.attention_mask[0].sum()) - args.response_length  # the tokens the batch attends to
    print(f"{args.model}, {config.num_hidden_layers} layers; {args.rows} x ({real_prompt} prompt + "
          f"{args.response_length} response) tokens{f' after {args.left_pad} padding' if args.left_pad else ''}; "
          f"{args.dtype} autocast"
          f"{', gradient checkpointing' if args.gradient_checkpointing else ''}; {args.threads} thread(s); "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    times = step_times(model, batch, args.warmup, args.steps)
    seconds = statistics.median(times)
    load = os.getloadavg()[0]
    results = measure(config, args.rows * (args.prompt_length + args.response_length),
                      args.rows * args.response_length, getattr(torch, args.dtype), args.ceiling_seconds)
    ceiling = ceiling_flops_per_second(results, config.num_hidden_layers)
    parts = useful_flops(config, args.rows, real_prompt, args.response_length)
    flops = sum(parts)
    print(f"step times: {', '.join(f'{t:.3f}' for t in times)} s (load average {load:.2f}); peak resident memory "
          f"{peak_memory_gib('cpu'):.2f} GiB")
    print(f"useful FLOPs per step: {flops:.6e} = decoder matmuls {parts[0]:.6e} + LM head {parts[1]:.6e} + "
          f"attention {parts[2]:.6e}")
    print(f"ceiling: {ceiling / 1e9:.2f} GFLOP/s ({args.dtype} matmul mix; load average {os.getloadavg()[0]:.2f})")
    print(f"MFU: {flops:.6e} FLOP / {seconds:.4f} s = {flops / seconds / 1e9:.2f} GFLOP/s = "
          f"{100 * flops / seconds / ceiling:.2f}% of the ceiling")
    if args.profile:
        profile_step(model, batch)


if __name__ == "__main__":
    main()
