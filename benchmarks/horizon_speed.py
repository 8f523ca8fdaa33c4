"""Where a horizon run's time goes at each H (docs/horizon.md#speed): sampling a rollout of the preset's size (16
prompts x 8) with the engine's in-place KV cache and with transformers' concatenating one, and one forward and
backward pass of the policy over it (what an update pass costs), in tokens per second on this machine.

    OMP_NUM_THREADS=1 python benchmarks/horizon_speed.py                  # H = 0, 64, 256, 1024; K = 1
    OMP_NUM_THREADS=1 python benchmarks/horizon_speed.py --h 1024 --no-concatenating
"""
import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import infra.engine  # noqa: E402
import infra.horizon  # noqa: E402


def sample(generator, prompts, h, in_place):
    grow = infra.engine.grow_in_place
    if not in_place:
        infra.engine.grow_in_place = lambda cache: None  # transformers' DynamicLayer: torch.cat at every step
    try:
        torch.manual_seed(0)
        start = time.perf_counter()
        completions = generator.generate(prompts, 8, h + infra.horizon.LENGTH_SLACK, 1.0, 1.0)
        return completions, time.perf_counter() - start
    finally:
        infra.engine.grow_in_place = grow


def main():
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),  # what it does, how
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--h", nargs="+", type=int, default=[0, 64, 256, 1024])
    parser.add_argument("--model", default="horizon")
    parser.add_argument("--no-concatenating", action="store_true", help="skip the slow torch.cat cache")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tokenizer = common.load_model(args.model, "float32", "cpu")
    generator = infra.engine.HFGenerator(model, tokenizer)
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}; 16 prompts x 8 samples")
    print("| H | response tokens | sampling, in place | sampling, torch.cat | forward + backward |")
    print("|---:|---:|---:|---:|---:|")
    for h in args.h:
        rows = infra.horizon.horizon_rows("train", 16, 0, f"horizon-k1-h{h}")
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
        completions, seconds = sample(generator, prompts, h, True)
        tokens = sum(len(c.token_ids) for c in completions)
        slow = "-" if args.no_concatenating else f"{tokens / sample(generator, prompts, h, False)[1]:,.0f} tok/s"
        batch = common.sequence_batch([prompts[c.prompt_index] for c in completions],
                                      [c.token_ids for c in completions], tokenizer.pad_token_id)
        start = time.perf_counter()
        for rows_ in common.chunks(list(range(len(completions))), 16):
            common.response_logprobs(model, batch.select(rows_)).sum().backward()
        update = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        print(f"| {h} | {tokens / len(completions):.0f} | {tokens / seconds:,.0f} tok/s ({seconds:.1f} s) | {slow} | "
              f"{tokens / update:,.0f} tok/s ({update:.1f} s) |", flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
