"""How far bf16 (autocast over float32 weights, `--dtype bfloat16`) moves the per-token log-probs of a rollout, against
float32: the engine's (HFGenerator, KV cache) and the trainer's (common.response_logprobs), on the same sampled tokens.

    OMP_NUM_THREADS=1 python benchmarks/dtype_gap.py                      # SmolLM2-135M-Instruct, builtin:words
    OMP_NUM_THREADS=1 python benchmarks/dtype_gap.py --model tiny --dataset builtin:3

One rollout as grpo.py samples it (--prompts x --samples, temperature 1, up to --max-tokens tokens) with the HF engine
in bf16; then, on those tokens: the trainer's log-probs in bf16 without gradients (the recomputed old log-probs of
`--old-logprobs auto` in bf16), in bf16 with gradients micro-batch by micro-batch over a random half (the first
mini-batch's forward of the update, before any optimizer step: in exact arithmetic the same numbers), and in float32
(the reference). Printed: mean and largest |difference| over the response tokens for each pair, and the PPO ratio's
spread exp(|difference|) they make. What --old-logprobs auto decides from these: the engine's log-probs are reused
only where they are the trainer's own numbers (float32, top-p 1); in bf16 they are recomputed.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
import infra.data  # noqa: E402
import infra.engine  # noqa: E402


def gap(a, b, mask):
    difference = (a - b)[mask].abs()
    return f"mean {difference.mean():.4f}, largest {difference.max():.4f} (ratio up to {difference.max().exp():.3f})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dataset", default="builtin:words")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model, tokenizer = common.load_model(args.model, "bfloat16", "cpu")
    rows = infra.data.load_rows(args.dataset, "train", n_builtin=args.prompts, seed=args.seed)[:args.prompts]
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    completions = infra.engine.HFGenerator(model, tokenizer).generate(prompts, args.samples, args.max_tokens)
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id)
    mask = batch.response_mask
    engine = common.engine_logprobs(completions, mask.shape[1])
    recomputed = common.batched(lambda micro: common.response_logprobs(model, micro), batch, 8,
                                args.micro_batch_tokens)
    half = torch.randperm(len(completions))[:len(completions) // 2].tolist()
    first_pass = recomputed.clone()
    for micro in common.micro_batches(half, batch.lengths(), 8, args.micro_batch_tokens):
        micro_batch = batch.select(micro)
        first_pass[micro, :micro_batch.response_width] = common.response_logprobs(model, micro_batch).detach()
    model.compute_dtype = torch.float32
    reference = common.batched(lambda micro: common.response_logprobs(model, micro), batch, 8, args.micro_batch_tokens)
    only_half = torch.zeros_like(mask)
    only_half[half] = mask[half]
    print(f"{args.model}, {args.dataset}: {args.prompts} prompts x {args.samples} samples, {int(mask.sum())} response "
          f"tokens; load average {os.getloadavg()[0]:.2f}")
    print(f"engine bf16 vs trainer bf16 (old log-probs recomputed):   {gap(engine, recomputed, mask)}")
    print(f"trainer bf16, with gradients vs without (first mini-batch): {gap(first_pass, recomputed, only_half)}")
    print(f"trainer bf16 vs trainer float32:                            {gap(recomputed, reference, mask)}")
    print(f"engine bf16 vs trainer float32:                             {gap(engine, reference, mask)}")


if __name__ == "__main__":
    main()
