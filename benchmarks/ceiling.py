"""The arithmetic limit the update is judged against: achieved FLOP/s of torch.matmul at the update's shapes.

    OMP_NUM_THREADS=1 python benchmarks/ceiling.py                          # 1,088 tokens, bf16 and float32
    OMP_NUM_THREADS=2 python benchmarks/ceiling.py --threads 2 --tokens 4160 --logit-tokens 4096 --dtypes bfloat16
    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --shape smollm2-135m-shape --tokens 1024 --logit-tokens 512

Shapes (--shape, default qwen3-0.6b-shape; smollm2-135m-shape: SmolLM2-135M's, hidden 576, 30 layers, vocabulary
49,152): Qwen3-0.6B's linear layers (bench_update.QWEN3_0_6B_SHAPE) over `--tokens` rows: q [1024 -> 2048], k and v
[1024 -> 1024], o [2048 -> 1024], gate and up [1024 -> 3072], down [3072 -> 1024]; and the tied LM head [1024 ->
151,936] over `--logit-tokens` rows (the update computes logits over the response only). Each as nn.Linear runs it
in training, W stored [out x in]: forward Y = X W^T ([tokens x in] x [in x out], W read transposed), backward
dX = dY W ([tokens x out] x [out x in]) and dW = dY^T X ([out x tokens] x [tokens x in], dY read transposed): the
same multiply-adds in three layouts. A matmul of [m x k] x [k x n]
is 2 m k n FLOPs. Each is timed alone on tensors of the dtype (the update's autocast runs its matmuls in bf16), the
median of its calls after one warm-up call.

The ceiling: the FLOPs of one update's matmuls over their summed times, every shape in the proportion an update runs
it (each decoder shape once per layer, `--layers` layers, the LM head's three once): the rate the update would reach
if it were nothing but its own matmuls, run back to back. Attention's products (benchmarks/mfu.py counts them) are
judged at this same rate. Also printed: the fastest single shape.
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

from bench_update import SHAPES  # noqa: E402


def linear_layers(config):
    """(name, in, out) of a decoder layer's matmuls and of the LM head, from a config (dict or object)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
    hidden, inter = get("hidden_size"), get("intermediate_size")
    head_dim = get("head_dim") or hidden // get("num_attention_heads")
    query, key_value = get("num_attention_heads") * head_dim, get("num_key_value_heads") * head_dim
    layer = [("q", hidden, query), ("k", hidden, key_value), ("v", hidden, key_value), ("o", query, hidden),
             ("gate", hidden, inter), ("up", hidden, inter), ("down", inter, hidden)]
    return layer, ("lm_head", hidden, get("vocab_size"))


def training_matmuls(rows, fan_in, fan_out):
    """The three [m, k] x [k, n] products of a linear layer (weight W stored [out, in]) in training, with nn.Linear's
    layouts (whether each operand is a transposed view): forward X W^T, input gradient dY W, weight gradient dY^T X."""
    return [("X W^T", rows, fan_in, fan_out, False, True), ("dY W", rows, fan_out, fan_in, False, False),
            ("dY^T X", fan_out, rows, fan_in, True, False)]


CLOCK = time.perf_counter  # --clock cpu: time.process_time, the process's CPU time (on a shared machine it moves
# less with the load than wall time; with one thread it is that thread's time)


def time_matmul(m, k, n, dtype, min_seconds, a_transposed=False, b_transposed=False, min_calls=3):
    """Median seconds of torch.matmul([m, k], [k, n]) in `dtype` (an operand stored transposed when asked), after
    one untimed call, over at least min_calls calls and min_seconds (CLOCK's seconds)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn((k, m) if a_transposed else (m, k), generator=generator).to(dtype)
    b = torch.randn((n, k) if b_transposed else (k, n), generator=generator).to(dtype)
    a, b = a.t() if a_transposed else a, b.t() if b_transposed else b
    out = torch.empty(m, n, dtype=dtype)
    torch.matmul(a, b, out=out)
    times, start = [], CLOCK()
    while len(times) < min_calls or CLOCK() - start < min_seconds:
        tick = CLOCK()
        torch.matmul(a, b, out=out)
        times.append(CLOCK() - tick)
    return statistics.median(times)


def measure(config, tokens, logit_tokens, dtype, min_seconds=1.0):
    """[(layer name, product, m, k, n, seconds, is_lm_head)] for every distinct training matmul of the update."""
    layer, head = linear_layers(config)
    seconds = {}
    results = []
    for name, fan_in, fan_out in layer + [head]:
        rows = logit_tokens if name == "lm_head" else tokens
        for product, m, k, n, *layout in training_matmuls(rows, fan_in, fan_out):
            if (m, k, n, *layout) not in seconds:  # k and v share their shapes: timed once
                seconds[m, k, n, *layout] = time_matmul(m, k, n, dtype, min_seconds, *layout)
            results.append((name, product, m, k, n, seconds[m, k, n, *layout], name == "lm_head"))
    return results


def ceiling_flops_per_second(results, layers):
    """FLOPs of one update's matmuls / their summed measured times: each decoder matmul `layers` times, the LM head's
    once."""
    flops = seconds = 0.0
    for _, _, m, k, n, time_s, head in results:
        count = 1 if head else layers
        flops += count * 2 * m * k * n
        seconds += count * time_s
    return flops / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1088, help="rows of the decoder matmuls: tokens per micro-batch "
                        "(default: 64 prompt + 1,024 response)")
    parser.add_argument("--logit-tokens", type=int, default=1024, help="rows of the LM head's matmuls (the response)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b-shape", help="the model's linear layers")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers, for the ceiling's mix (default: the "
                        "shape's own, Qwen3-0.6B: 28, SmolLM2-135M: 30)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (as the update being judged)")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time each shape for at least this long")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="cpu: the process's CPU time "
                        "(benchmarks/phase_times.py's clock; one thread)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    shape = SHAPES[args.shape][1]
    args.layers = args.layers or shape["num_hidden_layers"]
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, {args.clock} clock; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"{args.shape}: {args.tokens} tokens, LM head over {args.logit_tokens}, {args.layers} layers\n")
    print("| dtype | layer | product | [m x k] x [k x n] | ms | GFLOP/s |")
    print("|---|---|---|---|---:|---:|")
    summary = []
    for dtype_name in args.dtypes:
        results = measure(shape, args.tokens, args.logit_tokens, getattr(torch, dtype_name),
                          args.min_seconds)
        for name, product, m, k, n, seconds, _ in results:
            print(f"| {dtype_name} | {name} | {product} | [{m} x {k}] x [{k} x {n}] | {1e3 * seconds:.1f} | "
                  f"{2 * m * k * n / seconds / 1e9:.1f} |")
        best = max(2 * m * k * n / seconds for _, _, m, k, n, seconds, _ in results)
        summary.append((dtype_name, ceiling_flops_per_second(results, args.layers), best, os.getloadavg()[0]))
    print()
    for dtype_name, ceiling, best, load in summary:
        print(f"{dtype_name} ceiling (the update's matmul mix, {args.layers} layers): {ceiling / 1e9:.1f} GFLOP/s; "
              f"fastest shape {best / 1e9:.1f} GFLOP/s; load average {load:.2f}")


if __name__ == "__main__":
    main()
