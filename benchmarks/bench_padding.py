"""Padding of the update's micro-batches: --micro-batch-size 8 in rollout order (the default before issue 39) against
--micro-batch-tokens 16384 (the default for real models now: longest response first, cut where infra.packing.
token_budget_chunks' dynamic program computes the fewest padded tokens), on long-tailed response lengths.

    OMP_NUM_THREADS=1 python benchmarks/bench_padding.py     # Qwen3-0.6B's shape, 2 layers; 4 prompts x 8 samples

The rollout: --prompts prompts of 64-256 random tokens, --samples responses each, of lengths drawn from a log-normal
distribution (median --median tokens, sigma --sigma) cut at --max-response (those score 0 in a run: a real rollout's
truncated tail), seeded. The update pass, as the trainers' inner loop runs it over one mini-batch holding the whole
rollout: common.micro_batches splits it, then per micro-batch common.response_logprobs and the backward pass of a
policy-gradient-like loss (gradients accumulate; no optimizer step). The model: bench_update.build_model, random
weights of Qwen3-0.6B's shape with --layers decoder layers, float32 weights, bf16 compute (autocast), gradient
checkpointing (on by default for real models). Padded share: the positions the micro-batches compute (rows x the
selected width, SequenceBatch.select) that are padding, over all of them. Both orders run in this process, one after
the other, --repeats times (the load average is printed: the machine is shared).
"""
import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
from infra.memory import keep_freed_host_memory  # noqa: E402


def long_tailed_batch(args, vocab):
    """A rollout of --prompts x --samples sequences, a group's samples consecutive (rollout order)."""
    generator = torch.Generator().manual_seed(args.seed)
    prompts, responses = [], []
    for _ in range(args.prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(64, 257, (), generator=generator)),),
                               generator=generator).tolist()
        for _ in range(args.samples):
            length = float(torch.randn((), generator=generator)) * args.sigma
            length = int(min(args.max_response, max(1, round(args.median * torch.tensor(length).exp().item()))))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (length,), generator=generator).tolist())
    return common.sequence_batch(prompts, responses, pad_id=0)


def update_pass(model, batch, micro_batch_size, micro_batch_tokens):
    """(seconds, micro-batches, positions computed, real tokens) of one pass over the rollout."""
    rows = list(range(batch.input_ids.shape[0]))
    groups = common.micro_batches(rows, batch.lengths(), micro_batch_size, micro_batch_tokens)
    tokens = batch.response_mask.sum()
    positions = real = 0
    start = time.perf_counter()
    for micro in groups:
        micro_batch = batch.select(micro)
        positions += micro_batch.input_ids.numel()
        real += int(micro_batch.attention_mask.sum())
        logprobs = common.response_logprobs(model, micro_batch)
        (-(logprobs * micro_batch.response_mask).sum() / tokens).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds, len(groups), positions, real


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-0.6B-shaped model (28)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts in the rollout")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--median", type=int, default=400, help="median response tokens")
    parser.add_argument("--sigma", type=float, default=1.0, help="sigma of the log-normal response lengths")
    parser.add_argument("--max-response", type=int, default=4096, help="response length limit (lengths are cut)")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="the token budget compared")
    parser.add_argument("--repeats", type=int, default=1, help="passes of each order, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_host_memory()  # as infra.run.Run does on CPU
    from bench_update import build_model
    model = build_model("qwen3-0.6b-shape", "cpu", "bfloat16", args.layers)
    common.enable_gradient_checkpointing(model)  # as common.load_model does; training mode too
    batch = long_tailed_batch(args, model.config.vocab_size)
    lengths = sorted(batch.response_mask.sum(1).tolist())
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch "
          f"thread(s), torch {torch.__version__}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"model: Qwen3-0.6B's shape, {args.layers} layers, bf16 compute, gradient checkpointing; rollout: "
          f"{args.prompts} x {args.samples} sequences, prompts 64-256 tokens, responses log-normal (median "
          f"{args.median}, sigma {args.sigma}) cut at {args.max_response}: min {lengths[0]}, median "
          f"{lengths[len(lengths) // 2]}, max {lengths[-1]}, {sum(lengths):,} response tokens, "
          f"{sum(l == args.max_response for l in lengths)} cut\n")
    settings = {"8 sequences, rollout order (before)": (8, 0),
                f"{args.micro_batch_tokens:,} tokens, longest first (now)": (8, args.micro_batch_tokens)}
    update_pass(model, long_tailed_batch(argparse.Namespace(**{**vars(args), "prompts": 1, "samples": 2,
                                                               "median": 8, "max_response": 16}),
                                         model.config.vocab_size), 8, 0)  # lazy initializations
    results = {name: [] for name in settings}
    for _ in range(args.repeats):
        for name, (size, budget) in settings.items():
            results[name].append((*update_pass(model, batch, size, budget), os.getloadavg()[0]))
    print("| micro-batches | count | positions computed | padded share | seconds per pass | load |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        _, count, positions, real, _ = runs[0]
        seconds = ", ".join(f"{run[0]:.1f}" for run in runs)
        print(f"| {name} | {count} | {positions:,} | {1 - real / positions:.1%} | {seconds} | "
              f"{', '.join(f'{run[4]:.1f}' for run in runs)} |")
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
