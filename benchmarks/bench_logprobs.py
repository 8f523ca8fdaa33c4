"""Peak memory of the response log-probs: common.response_logprobs (final hidden states, then the LM head and
log-softmax a slice of the vocabulary at a time: common.head_logprobs) against the path before it (the model's whole
[B, T+1, V] logits, then a chunked log-softmax), on a model, forward alone and forward + backward.

    python benchmarks/bench_logprobs.py            # CPU: 1-layer Qwen3, hidden 256, vocabulary 151,936, 2 x 4,096
    python benchmarks/bench_logprobs.py --device cuda

The model: a randomly initialized Qwen3 with --layers decoder layers of hidden --hidden (4 query / 2 key-value heads
of 64, MLP 3 x hidden), Qwen3's vocabulary (151,936, tied embeddings), float32 weights, bf16 compute (autocast), as
common.load_model runs a model on GPU. The batch: --rows rows of --prompt random prompt tokens and --response
response tokens, distinct prompts. "forward": the log-probs without gradients (old and reference log-probs);
"forward + backward": then the backward pass of their sum (the update), every parameter's gradient made.

How the peak is measured. Each variant and pass runs in a fresh Python process: the model is built, one small call
runs (lazy initializations), gradients are dropped; then the baseline is taken. CPU: the kernel's high-water mark
of the resident set (VmHWM) is reset to the current resident size (writing 5 to /proc/self/clear_refs); after the
computation, VmHWM minus that size is the extra peak. glibc's default allocator settings: blocks this large are
mapped and unmapped, so the resident set follows the live tensors. CUDA: torch.cuda.max_memory_allocated() minus
the allocation before. The target (issue 39): forward + backward below half of one bf16 logits tensor
(rows x response x vocabulary x 2 bytes). Correctness: both paths on a small batch of the same model agree.
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

GIB = 2 ** 30


def status_bytes(field):
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, from /proc/self/status."""
    with open("/proc/self/status") as handle:
        line = next(line for line in handle if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak():
    with open("/proc/self/clear_refs", "w") as handle:  # Linux >= 4.0: VmHWM := VmRSS
        handle.write("5")


def build(args):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            tie_word_embeddings=True, max_position_embeddings=args.prompt + args.response + 1))
    model.compute_dtype = getattr(torch, args.dtype)  # as common.load_model: float32 weights, autocast to this
    return model.train()


def batch_of(args, rows, prompt, response, seed=0):
    import torch
    import common
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, args.vocab, (rows, prompt), generator=generator).tolist()
    responses = torch.randint(3, args.vocab, (rows, response), generator=generator).tolist()
    return common.sequence_batch(prompts, responses, pad_id=0).to(args.device)


def whole_logits(model, batch, temperature=1.0, rows_per_chunk=None):
    """The path before issue 39: the model's [B, T+1, V] logits, then log softmax(z / tau)[y] a chunk of rows at a
    time (the chunked autograd function common.py had, reproduced here): saved for backward, the logits themselves."""
    import torch
    import common

    class ChunkedLogprobs(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, tokens, chunk):
            out, logsumexp = (torch.empty(tokens.shape, device=logits.device) for _ in range(2))
            for start in range(0, len(tokens), chunk):
                part = slice(start, start + chunk)
                scaled = logits[part].float() / temperature
                logsumexp[part] = scaled.logsumexp(-1)
                out[part] = scaled.gather(-1, tokens[part, None]).squeeze(-1) - logsumexp[part]
            ctx.save_for_backward(logits, tokens, logsumexp)
            ctx.chunk = chunk
            return out

        @staticmethod
        def backward(ctx, grad_out):
            logits, tokens, logsumexp = ctx.saved_tensors
            grad = torch.empty_like(logits)
            for start in range(0, len(tokens), ctx.chunk):
                part = slice(start, start + ctx.chunk)
                weight = grad_out[part, None].float() / temperature
                chunk_grad = (logits[part].float() / temperature).sub_(logsumexp[part, None]).exp_().mul_(-weight)
                grad[part] = chunk_grad.scatter_add_(-1, tokens[part, None], weight)
            return grad, None, None

    logits = common.response_forward(model, batch).logits
    vocab = logits.shape[-1]
    targets = torch.cat([batch.response_ids, batch.response_ids[:, -1:]], 1)
    out = ChunkedLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1), rows_per_chunk or 2 ** 24 // vocab)
    return out.view(targets.shape)[:, :-1]


def sliced(model, batch):
    import common
    return common.response_logprobs(model, batch)


def measure(args):
    """One variant and pass in this (fresh) process; prints {"extra_bytes", "seconds"} as JSON."""
    import torch
    torch.set_num_threads(args.threads)
    model = build(args)
    function = whole_logits if args.variant == "whole" else sliced
    backward = args.mode == "forward+backward"
    with torch.set_grad_enabled(backward):  # lazy initializations, then no gradients held
        out = function(model, batch_of(args, args.rows, 8, 8, seed=1))
        if backward:
            out.sum().backward()
    model.zero_grad(set_to_none=True)
    batch = batch_of(args, args.rows, args.prompt, args.response)
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
        out = function(model, batch)
        if backward:
            out.sum().backward()
    if cuda:
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - before
    else:
        extra = status_bytes("VmHWM") - before
    print(json.dumps({"extra_bytes": extra, "seconds": time.perf_counter() - start}))


def agree(args):
    """Both paths on a small batch of the same model: the largest differences of the log-probs and of the
    parameters' gradients (bf16 compute: both round the logits to bf16)."""
    import torch
    model = build(args)
    batch = batch_of(args, 2, 16, 32, seed=2)
    values, grads = [], []
    for function in (whole_logits, sliced):
        model.zero_grad(set_to_none=True)
        out = function(model, batch)
        out.sum().backward()
        values.append(out.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    value_gap = (values[0] - values[1]).abs().max().item()
    grad_gap = max(((a - b).norm() / b.norm().clamp(min=1e-12)).item() for a, b in zip(*grads))
    return value_gap, grad_gap


def run_variant(args, variant, mode):
    command = [sys.executable, os.path.abspath(__file__), "--child", "--variant", variant, "--mode", mode]
    for name in ("layers", "hidden", "vocab", "rows", "prompt", "response", "dtype", "device", "threads"):
        command += [f"--{name}", str(getattr(args, name))]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if result.returncode:
        sys.exit(f"{variant} {mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen3: 151,936)")
    parser.add_argument("--rows", type=int, default=2, help="sequences in the batch")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    parser.add_argument("--response", type=int, default=4096, help="response tokens per row")
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype (autocast over float32 weights)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the CPU here is shared)")
    parser.add_argument("--variants", nargs="+", default=["whole", "sliced"], choices=["whole", "sliced"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="sliced", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="forward", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return measure(args)
    import torch
    logits_gib = args.rows * args.response * args.vocab * 2 / GIB
    value_gap, grad_gap = agree(args)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} threads, load average {os.getloadavg()[0]:.2f}; device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    print(f"model: Qwen3, {args.layers} layer(s), hidden {args.hidden}, vocabulary {args.vocab:,}, {args.dtype} "
          f"compute; batch {args.rows} x ({args.prompt} prompt + {args.response:,} response) tokens; one bf16 logits "
          f"tensor of the responses: {logits_gib:.2f} GiB")
    print(f"whole logits vs sliced head on a small batch: log-probs differ by at most {value_gap:.2e}, gradients by "
          f"at most {grad_gap:.2e} of their norm\n")
    print("| pass | variant | extra peak GiB | / one bf16 logits tensor | seconds |")
    print("|---|---|---:|---:|---:|")
    results = {}
    for mode in ("forward", "forward+backward"):
        for variant in args.variants:
            result = results[mode, variant] = run_variant(args, variant, mode)
            name = {"whole": "whole logits (before)", "sliced": "sliced head (common.response_logprobs)"}[variant]
            extra = result['extra_bytes'] / GIB
            print(f"| {mode} | {name} | {extra:.2f} | {extra / logits_gib:.2f} | {result['seconds']:.2f} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if ("forward+backward", "sliced") in results:
        extra = results["forward+backward", "sliced"]["extra_bytes"] / GIB
        print(f"sliced forward + backward: {extra:.2f} GiB above the baseline, below half a bf16 logits tensor "
              f"({logits_gib / 2:.2f} GiB): {'yes' if extra < logits_gib / 2 else 'no'}")
        return 0 if extra < logits_gib / 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
