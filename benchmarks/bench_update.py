"""Update throughput: forward + backward of the response log-probs (common.response_logprobs), in tokens/s.

    python benchmarks/bench_update.py                        # CPU: tiny model and a Qwen3-0.6B-shaped model
    python benchmarks/bench_update.py --device cuda          # GPU, bfloat16: also MFU and generate tokens/s

Models: the built-in tiny model, and a randomly initialized model of Qwen3-0.6B's shape (28 layers, hidden 1024,
16 query / 8 key-value heads of 128, MLP 3072, vocabulary 151,936, tied embeddings; no download). One update
step is a forward pass over a batch of prompt + response tokens, the response log-probs, a policy-gradient-like
loss (mean log-prob over response tokens) and its backward pass; no optimizer step. tokens/s counts every token
of the batch (prompt and response). MFU = update_flops / time / peak FLOP/s: the decoder layers' matrices and
attention over every token, the LM head over the response columns only, no embedding lookup (a plain 6 x parameters
x tokens counts the embedding and a head over every token: 20-25% more at these shapes), gradient checkpointing's
recomputation not counted. `generate` tokens/s: Hugging Face generate, sampling, every sequence forced to the full
length.
On the shared CPU machine wall times are inflated by other processes: the table prints the load average.
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

QWEN3_0_6B_SHAPE = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6)


SMOLLM2_135M_SHAPE = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                          head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                          max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5)  # its config.json
QWEN3_4B_SHAPE = dict(QWEN3_0_6B_SHAPE, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                      intermediate_size=9728)  # its config.json; the rest as Qwen3-0.6B's (vocabulary, tied, heads)
SHAPES = {"qwen3-0.6b-shape": ("qwen3", QWEN3_0_6B_SHAPE), "qwen3-4b-shape": ("qwen3", QWEN3_4B_SHAPE),
          "smollm2-135m-shape": ("llama", SMOLLM2_135M_SHAPE)}


def build_model(name, device, dtype, layers=0, value_head=0, **overrides):
    """The tiny model, or a randomly initialized one of a real model's shape (SHAPES: Qwen3-0.6B's, or
    SmolLM2-135M-Instruct's, a Llama), config fields in `overrides` replacing its shape's; value_head=k: the
    backbone with k scalar outputs per position, as common.load_model builds a critic."""
    if name == "tiny":
        model, _ = common.load_model("tiny", dtype, device)
        return model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
    kind, shape = SHAPES[name]
    torch.manual_seed(0)
    with torch.device(device):
        config = AutoConfig.for_model(kind, **{**shape, **({"num_hidden_layers": layers} if layers else {}),
                                               **overrides}, **({"num_labels": value_head} if value_head else {}))
        model = AutoModelForTokenClassification.from_config(config) if value_head else \
            AutoModelForCausalLM.from_config(config)
    for module in model.modules():  # as common.load_model: no dropout (the value head's classifier_dropout)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    model.compute_dtype = getattr(torch, dtype)  # as common.load_model: float32 weights, forward in `dtype` (autocast)
    return model


def random_batch(vocab, batch_size, prompt_length, response_length, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (batch_size, prompt_length), generator=generator).tolist()
    responses = torch.randint(3, vocab, (batch_size, response_length), generator=generator).tolist()
    return common.sequence_batch(prompts, responses, pad_id=0).to(device)


def synchronize(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def update_step(model, batch):
    logprobs = common.response_logprobs(model, batch)
    loss = -(logprobs * batch.response_mask).sum() / batch.response_mask.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def timed(function, device, warmup, min_seconds, max_iterations=50):
    """Seconds per call: `warmup` untimed calls, then calls until min_seconds have passed (at least one)."""
    for _ in range(warmup):
        function()
    synchronize(device)
    start, calls = time.perf_counter(), 0
    while calls == 0 or (time.perf_counter() - start < min_seconds and calls < max_iterations):
        function()
        synchronize(device)
        calls += 1
    return (time.perf_counter() - start) / calls, calls


def generate_tokens_per_second(model, args, vocab):
    from transformers import GenerationConfig
    model.eval()
    prompts = random_batch(vocab, args.generate_batch, args.prompt_length, 1, args.device, seed=1)
    inputs = dict(input_ids=prompts.input_ids[:, :-1], attention_mask=prompts.attention_mask[:, :-1])
    config = GenerationConfig(max_new_tokens=args.generate_tokens, min_new_tokens=args.generate_tokens, do_sample=True,
                              top_k=0, top_p=1.0, temperature=1.0, pad_token_id=0, eos_token_id=None)
    dtype = model.compute_dtype  # as infra.engine.HFGenerator: float32 weights, autocast to the compute dtype
    with torch.no_grad(), torch.autocast(model.device.type, dtype=dtype, enabled=dtype != torch.float32):
        seconds, _ = timed(lambda: model.generate(**inputs, generation_config=config), args.device, 1, 0)
    model.train()
    return args.generate_batch * args.generate_tokens / seconds


def update_flops(config, batch):
    """FLOPs of one update step (forward + backward = 3 x forward): 2 per weight per token in the forward pass for
    the decoder layers' matrices (every token) and the lm_head (the response columns + 1 only, as response_logprobs
    keeps them), plus attention's two [context x head_dim] products per head and token (causal: half the context on
    average)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    query, key_value = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (2 * query + 2 * key_value) + 3 * hidden * config.intermediate_size
    rows, width = batch.input_ids.shape
    tokens, logit_columns = rows * width, rows * (batch.response_width + 1)
    forward = 2 * layers * per_layer * tokens + 2 * hidden * config.vocab_size * logit_columns \
        + layers * 2 * 2 * query * (width / 2) * tokens
    return 3 * forward


def matmul_flops_per_second(dtype, device, size=(2048, 1024, 3072), min_seconds=2.0):
    """Measured FLOP/s of a [m, k] x [k, n] matmul in `dtype` (the decoder's MLP shape), this process's threads."""
    a = torch.randn(size[0], size[1], device=device, dtype=dtype)
    b = torch.randn(size[1], size[2], device=device, dtype=dtype)
    seconds, _ = timed(lambda: a @ b, device, 2, min_seconds, max_iterations=1000)
    return 2 * size[0] * size[1] * size[2] / seconds


def peak_memory_gib(device):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2 ** 30
    with open("/proc/self/status") as handle:  # the process's peak resident set (reset before each model)
        return int(next(line for line in handle if line.startswith("VmHWM:")).split()[1]) / 2 ** 20


def reset_peak_memory(device):
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")


def main():
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu", help="cpu or cuda")
    parser.add_argument("--models", nargs="+", default=["tiny", "qwen3-0.6b-shape"],
                        help="tiny, qwen3-0.6b-shape, qwen3-4b-shape, smollm2-135m-shape")
    parser.add_argument("--dtype", default="", help="compute dtype; weights stay float32, as in the trainers "
                        "(default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--batch-size", type=int, default=0, help="sequences per update step (default: 2 CPU, 16 GPU)")
    parser.add_argument("--prompt-length", type=int, default=0, help="prompt tokens (default: 64 CPU, 256 GPU)")
    parser.add_argument("--response-length", type=int, default=0, help="response tokens (default: 192 CPU, 768 GPU)")
    parser.add_argument("--generate-batch", type=int, default=0, help="sequences for generate (default: 2 CPU, 64 GPU)")
    parser.add_argument("--generate-tokens", type=int, default=0, help="new tokens each (default: 16 CPU, 256 GPU)")
    parser.add_argument("--warmup", type=int, default=-1, help="untimed update steps first (default: 1 GPU, 0 CPU)")
    parser.add_argument("--min-seconds", type=float, default=10.0, help="time update steps for at least this long")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute layer activations in backward")
    parser.add_argument("--peak-flops", type=float, default=989e12, help="peak FLOP/s for MFU (H100/H200 bf16 dense)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers of a real model's shape "
                        "(default: its own; fewer run quicker, the FLOPs per token are counted for the layers built)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (on a shared CPU, 2 threads ran 2-30x slower than 1: OpenMP waits)")
    args = parser.parse_args()
    on_gpu = args.device.startswith("cuda")
    args.warmup = (1 if on_gpu else 0) if args.warmup < 0 else args.warmup
    defaults = dict(dtype="bfloat16" if on_gpu else "float32", batch_size=16 if on_gpu else 2,
                    prompt_length=256 if on_gpu else 64, response_length=768 if on_gpu else 192,
                    generate_batch=64 if on_gpu else 2, generate_tokens=256 if on_gpu else 16)
    for name, value in defaults.items():
        if not getattr(args, name):
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    if not on_gpu:  # as the trainers on CPU: freed memory is reused, not page-faulted in again each step
        keep_freed_host_memory()
    machine = (f"{torch.cuda.get_device_name()}, " if on_gpu else "") + \
        f"{platform.processor() or platform.machine()} with {os.cpu_count()} cores, {args.threads} torch threads"
    print(f"machine: {machine}; torch {torch.__version__}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"update batch: {args.batch_size} x ({args.prompt_length} prompt + {args.response_length} response) tokens, "
          f"{args.dtype}{', gradient checkpointing' if args.gradient_checkpointing else ''}; generate: "
          f"{args.generate_batch} x {args.generate_tokens} new tokens\n")
    rows = []
    for name in args.models:
        reset_peak_memory(args.device)
        model = build_model(name, args.device, args.dtype, args.layers)
        model.train()
        if args.gradient_checkpointing:
            common.enable_gradient_checkpointing(model)  # as common.load_model does
        vocab = model.config.vocab_size
        parameters = sum(p.numel() for p in model.parameters())
        batch = random_batch(vocab, args.batch_size, args.prompt_length, args.response_length, args.device)
        tokens = batch.input_ids.numel()
        seconds, steps = timed(lambda model=model: update_step(model, batch), args.device, args.warmup,
                               args.min_seconds)
        memory = peak_memory_gib(args.device)
        flops = update_flops(model.config, batch)
        mfu = flops / seconds / args.peak_flops if on_gpu else None
        generate = generate_tokens_per_second(model, args, vocab)
        rows.append((name, parameters, tokens, steps, seconds, tokens / seconds, mfu, generate, memory, flops))
        del model
    print("| model | parameters | tokens / step | timed steps | s / step | update tokens/s | MFU | "
          "generate tokens/s | peak memory (GiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, parameters, tokens, steps, seconds, rate, mfu, generate, memory, _ in rows:
        print(f"| {name} | {parameters / 1e6:.1f}M | {tokens} | {steps} | {seconds:.2f} | {rate:,.0f} | "
              f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {generate:,.1f} | {memory:.2f} |")
    if not on_gpu:  # the arithmetic limit: FLOPs per update step over the measured matmul FLOP/s
        for dtype in dict.fromkeys([torch.float32, getattr(torch, args.dtype)]):
            rate = matmul_flops_per_second(dtype, args.device)
            print(f"\n{str(dtype)[6:]} matmul [2048 x 1024] x [1024 x 3072]: {rate / 1e9:.1f} GFLOP/s")
            for name, _, tokens, _, seconds, _, _, _, _, flops in rows:
                print(f"  {name}: {flops / tokens / 1e9:.3f} GFLOP per token; update at {flops / seconds / 1e9:.1f} "
                      f"GFLOP/s = {flops / seconds / rate:.0%} of it (limit {tokens * rate / flops:,.1f} tokens/s)")
    measure = "torch.cuda.max_memory_allocated" if on_gpu else \
        "the process's peak resident set (VmHWM), reset per model"
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; peak memory: {measure}")


if __name__ == "__main__":
    main()
