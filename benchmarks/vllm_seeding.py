"""vLLM sampling seeded per request (each request's own generator, what infra/vllm_engine.py does) against one seed per
call (the global generator seeded once, requests unseeded): the engine call's tokens per second, wall and CPU.

    OMP_NUM_THREADS=1 /work/venv-vllm/bin/python benchmarks/vllm_seeding.py --model tiny
    OMP_NUM_THREADS=1 /work/venv-vllm/bin/python benchmarks/vllm_seeding.py --model qwen3-0.6b-shape --layers 2 \
        --prompts 16 --max-tokens 64

A per-request seed makes vLLM's sampler draw request by request (v1/sample/ops/topk_topp_sampler.py: forward_cpu draws
one seed per seeded request per step from its generator, random_sample, CUDA's path with processed log-probs, one
exponential_ per seeded row); unseeded, one draw covers the batch. Both modes run the same requests (--prompts prompts
of the built-in task x --samples samples, temperature 1, at most --max-tokens tokens) through the engine that
infra.engine.make_generator builds, alternating, --repeats times each after one untimed call of each; the figures are
the medians. Also printed: whether a call seeded once per call gives the same samples twice (it must, for exact
resume) and whether a prompt's samples stay the same when it comes with fewer others (per request: yes).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402

import common  # noqa: E402


def sample(generator, prompts, samples, max_tokens, mode, seed):
    """(tokens of every sample, wall seconds, CPU seconds) of one engine call."""
    from vllm import SamplingParams, TokensPrompt
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    if mode == "per-request":
        params = [SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0, seed=seed + i * samples)
                  for i in range(len(requests))]
    else:
        torch.manual_seed(seed)
        params = [SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0) for _ in requests]
    generator.llm.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = generator.llm.generate(requests, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return [tuple(s.token_ids) for output in outputs for s in output.outputs], wall, cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny or qwen3-0.6b-shape (random weights)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-0.6B-shaped model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    args = parser.parse_args()
    from infra.engine import make_generator
    from infra.tiny import builtin_rows, tiny_model_path
    with tempfile.TemporaryDirectory() as folder:
        path = "tiny"
        if args.model != "tiny":
            from transformers import AutoTokenizer
            from bench_update import build_model
            model = build_model(args.model, "cpu", "float32", args.layers)
            model.config.max_position_embeddings = 1024
            model.save_pretrained(folder)
            AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
            path = folder
        model, tokenizer = common.load_model(path, "float32" if args.model == "tiny" else "bfloat16", "cpu")
        rows = builtin_rows("train", args.prompts, 0)
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
        generator = make_generator("vllm", model, tokenizer, 0.3, 0, args.kv_cache_gib, [rows], args.max_tokens)
        modes = ("per-request", "per-call")
        for mode in modes:
            sample(generator, prompts, args.samples, args.max_tokens, mode, 1)
        figures = {mode: [] for mode in modes}
        for repeat in range(args.repeats):
            for mode in modes:
                tokens, wall, cpu = sample(generator, prompts, args.samples, args.max_tokens, mode, 100 + repeat)
                count = sum(map(len, tokens))
                figures[mode].append((count / wall, count / cpu))
        same = [sample(generator, prompts, args.samples, args.max_tokens, "per-call", 7)[0] for _ in range(2)]
        half = len(prompts) // 2
        kept = {mode: sample(generator, prompts[:half], args.samples, args.max_tokens, mode, 7)[0] ==
                sample(generator, prompts, args.samples, args.max_tokens, mode, 7)[0][:half * args.samples]
                for mode in modes}
        generator.close()
    print(f"{args.model} ({model.config.num_hidden_layers} layers, {model.compute_dtype}), {args.prompts} prompts x "
          f"{args.samples} samples x up to {args.max_tokens} tokens, {args.repeats} calls each; load average "
          f"{os.getloadavg()[0]:.2f}")
    for mode in modes:
        walls, cpus = zip(*figures[mode])
        print(f"  {mode:<12} {statistics.median(walls):8.0f} tokens/s wall ({', '.join(f'{x:.0f}' for x in walls)}); "
              f"{statistics.median(cpus):8.0f} tokens per CPU second")
    print(f"  per-call: the same samples twice: {same[0] == same[1]}; a prompt's samples without the other "
          f"{len(prompts) - half} prompts: per-request {'same' if kept['per-request'] else 'different'}, per-call "
          f"{'same' if kept['per-call'] else 'different'}")


if __name__ == "__main__":
    main()
