"""Peak memory of per-token log-probs: the naive `log_softmax(-1).gather(...)` against common.token_logprobs.

    python benchmarks/bench_logprobs.py                      # CPU: 2048 tokens x 151,936 vocabulary, float32
    python benchmarks/bench_logprobs.py --device cuda --dtype bfloat16

The logits are materialized first in both variants; the table gives the extra peak above them, for the forward
pass alone (no gradients, as for old and reference log-probs) and for forward + backward (as in the update,
where both variants also hold the logits' gradient, one logits-sized tensor).

How the peak is measured. CPU: each variant runs in a fresh Python process. With the logits written, the
kernel's high-water mark of the resident set (VmHWM) is reset to the current resident size (writing 5 to
/proc/self/clear_refs); after the computation, VmHWM minus that size is the extra peak. Resident pages are
pages actually touched, and glibc serves blocks this large with mmap and unmaps them on free, so the mark sees
every temporary. (torch's CPU allocations are invisible to tracemalloc, hence the process-level measure.) CUDA:
torch.cuda.max_memory_allocated() minus the allocation before the computation, in the same kind of fresh
process. Correctness: both variants on the same logits agree (torch.allclose on the log-probs and gradients).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def status_bytes(field):
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, from /proc/self/status."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:  # Linux >= 4.0: VmHWM := VmRSS
        handle.write("5")


def make_inputs(args, torch, requires_grad):
    """Random logits written 64 rows at a time, so that making them leaves no large temporary behind."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.empty(args.tokens, args.vocab, dtype=args.dtype_torch, device=args.device)
    for start in range(0, args.tokens, 64):
        block = torch.randn(min(64, args.tokens - start), args.vocab, generator=generator) * 3
        logits[start:start + 64] = block.to(args.dtype_torch)
    tokens = torch.randint(0, args.vocab, (args.tokens,), generator=generator).to(args.device)
    return logits.requires_grad_(requires_grad), tokens


def naive(logits, tokens):
    return logits.float().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)


def chunked(logits, tokens):
    import common
    return common.token_logprobs(logits, tokens)


def measure(args):
    """One variant in this (fresh) process; prints {"extra_bytes", "seconds"} as JSON."""
    import torch
    torch.set_num_threads(args.threads)
    args.dtype_torch = getattr(torch, args.dtype)
    import common  # noqa: F401  (imported before the baseline, like torch)
    backward = args.mode == "forward+backward"
    logits, tokens = make_inputs(args, torch, backward)
    function = naive if args.variant == "naive" else chunked
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        reset_peak()
        before = status_bytes("VmRSS")
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = function(logits, tokens)
        if backward:
            out.sum().backward()
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    else:
        extra = status_bytes("VmHWM") - before
    print(json.dumps({"extra_bytes": extra, "seconds": time.perf_counter() - start}))


def check_correctness(args):
    """Both variants on the same logits (a slice of the benchmark's shape): log-probs and gradients agree."""
    import torch
    import common  # noqa: F401
    args.dtype_torch = getattr(torch, args.dtype)
    small = argparse.Namespace(**{**vars(args), "tokens": min(args.tokens, 256)})
    logits, tokens = make_inputs(small, torch, True)
    upstream = torch.linspace(-1, 1, len(tokens), device=logits.device)
    out_naive = naive(logits, tokens)
    (grad_naive,) = torch.autograd.grad((out_naive * upstream).sum(), logits)
    out_chunked = chunked(logits, tokens)
    (grad_chunked,) = torch.autograd.grad((out_chunked * upstream).sum(), logits)
    tolerance = 1e-5 if args.dtype == "float32" else 1e-2
    return (torch.allclose(out_naive, out_chunked, atol=tolerance, rtol=tolerance)
            and torch.allclose(grad_naive.float(), grad_chunked.float(), atol=tolerance, rtol=tolerance))


def run_variant(args, variant, mode):
    command = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--mode", mode,
               "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--dtype", args.dtype,
               "--device", args.device, "--threads", str(args.threads)]
    result = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="rows of logits (sequence positions)")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151,936)")
    parser.add_argument("--dtype", default="float32", help="logits dtype (float32 on CPU; bfloat16 as on GPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the CPU here is shared)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="naive", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="forward", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure(args)
    import torch
    logits_mb = args.tokens * args.vocab * torch.tensor([], dtype=getattr(torch, args.dtype)).element_size() / 2 ** 20
    correct = check_correctness(args)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}; device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    print(f"logits: {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype}, {logits_mb:.0f} MB; "
          f"naive and chunked agree (allclose, log-probs and gradients): {correct}\n")
    print("| pass | naive extra peak (MB) | chunked extra peak (MB) | chunked / naive | naive s | chunked s |")
    print("|---|---:|---:|---:|---:|---:|")
    ratios = {}
    for mode in ("forward", "forward+backward"):
        results = {variant: run_variant(args, variant, mode) for variant in ("naive", "chunked")}
        naive_mb, chunked_mb = (results[v]["extra_bytes"] / 2 ** 20 for v in ("naive", "chunked"))
        ratios[mode] = chunked_mb / naive_mb
        print(f"| {mode} | {naive_mb:.0f} | {chunked_mb:.0f} | {ratios[mode]:.2f} | "
              f"{results['naive']['seconds']:.2f} | {results['chunked']['seconds']:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if not correct:
        sys.exit("the chunked log-probs differ from the naive ones")


if __name__ == "__main__":
    main()
