"""A rehearsal at real shapes: GRPO and PPO updates (and rollouts) of a model of a real model's shape on CPU, the
measured peak memory beside infra.memory's plan for the same shape and settings, and the time.

    OMP_NUM_THREADS=1 python benchmarks/rehearsal.py        # Qwen3-0.6B's shape, 2 layers: updates at 4,096, 8,192
    OMP_NUM_THREADS=1 python benchmarks/rehearsal.py --model smollm2-135m-shape --layers 0 --phases rollout update \
        --lengths 256 1024                                  # SmolLM2-135M's shape, all 30 layers

The models (benchmarks/bench_update.SHAPES), randomly initialized with --layers decoder layers (0: the model's own):
Qwen3-0.6B's shape (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, vocabulary 151,936, tied embeddings) or
SmolLM2-135M-Instruct's (a Llama: hidden 576, 30 layers, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49,152,
tied). PPO's critic is the same backbone with a scalar head (AutoModelForTokenClassification, as ppo.py loads it). As a
trainer runs a real model: float32 weights and AdamW states, bf16 compute (autocast), gradient checkpointing, the
LM head a vocabulary slice at a time (common.head_logprobs). The AdamW states exist before each phase (a warm-up step
on zero gradients), as from a trainer's second step on.
- update: --samples full-length responses to prompts of 1,024 random tokens (the plan's prompt allowance,
  infra.memory.PROMPT_TOKENS), micro-batches of one sequence (--micro-batch-size 1), one mini-batch, as grpo.py /
  ppo.py run it: the old log-probs (PPO: and the old values) without gradients, the advantages (grpo.group_advantages;
  ppo.gae on ppo.terminal_rewards), then per micro-batch common.response_logprobs and grpo.policy_loss (PPO:
  common.critic_outputs and ppo.value_loss too) and backward, then gradient clipping and an AdamW step per model.
- rollout: the Hugging Face engine (infra.engine.HFGenerator) samples --rollout-samples responses to each of
  --rollout-prompts distinct prompts of --rollout-prompt random tokens, every one forced to the full length (no stop
  token), as a step's rollout: the plan for that batch (its engine column: the KV cache of those sequences).
Each method, phase and length runs in a fresh process; its peak memory is that process's resident high-water mark
(VmHWM), everything included (imports, model build, the phase). The plan: infra.memory.plan for the same models and
settings (a CPU process, bf16 compute, the HF engine), its update or rollout column. One torch thread
(OMP_NUM_THREADS=1): on the shared 2-core machine at load 2.6 the GRPO update at 1,024 tokens took 11.4 s with 1
thread, 15.1 s with 2. On the shared CPU machine wall times are inflated by other processes: the table prints the load.

    OMP_NUM_THREADS=1 python benchmarks/rehearsal.py --terms   # the plan's transient terms, term by term (a minute)

--terms measures the plan's transient terms against the live tensor bytes torch allocates, on CPU at scaled shapes
(torch.profiler's memory events: every allocation and free of the phase, so the figure is exact and does not depend
on the allocator or the load):
- layer backward: a 2-layer Qwen3-shaped model (random weights, vocabulary 64 so the head is negligible), the
  backward pass of its first decoder layer: its peak above the bytes live when that layer's backward starts, per
  token, against infra.memory_plan.training_pass's 2bI (b: bytes of the compute dtype, I: the MLP width); with
  gradient checkpointing, against the recomputed layer's saved tensors + 2bI. Shapes vary I, h and the query width.
- optimizer step: torch.optim.AdamW's step (and gradient clipping) with foreach=True (torch's default on CUDA) and
  foreach=False (its default on CPU), its peak above the states, against 4 bytes a parameter and 8 bytes x the
  largest tensor (infra.memory_plan.optimizer_temporaries).
- FSDP2's root unit: a tied model whose embedding dominates (vocabulary 262,144 x hidden 256), sharded with FSDP2
  as infra.dist.shard_model does (bf16 compute, float32 reduce) on a gloo world of one; the peak of a forward and
  backward pass above its start, per vocabulary x hidden, against the plan's (b + 4) gradient buffers + b for the
  gathered root unit (compute copies).
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

from infra.memory import GIB, PROMPT_TOKENS, Setup, Shape, plan  # noqa: E402
from infra.memory_plan import training_pass  # noqa: E402

TOLERANCE = 0.2  # the plan must be within +-20% of the measured peak
SHAPE_FLAGS = dict(hidden="hidden_size", heads="num_attention_heads", kv_heads="num_key_value_heads",
                   head_dim="head_dim", intermediate="intermediate_size", vocab="vocab_size")


def model_config(args):
    """The model's config fields: its shape, --layers layers (0: its own), any shape flag given replacing its field."""
    from benchmarks.bench_update import SHAPES
    overrides = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag)}
    return {**SHAPES[args.model][1], **({"num_hidden_layers": args.layers} if args.layers else {}), **overrides}


def planned_rows(args, method, phase, response):
    """infra.memory's plan for one phase of `method` on this CPU: policy (PPO: and a critic with one output), one
    sequence of 1,024 + `response` tokens per micro-batch, checkpointing, bf16 compute, the HF engine generating
    --rollout-prompts x --rollout-samples sequences of --rollout-prompt + `response` tokens."""
    from benchmarks.bench_update import SHAPES
    config = model_config(args)
    shape = Shape(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                  config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
                  config["tie_word_embeddings"], qk_norm=SHAPES[args.model][0] == "qwen3")
    models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
    sequence = PROMPT_TOKENS + response
    rollout = (args.rollout_prompts * args.rollout_samples, args.rollout_prompt + response)
    return plan(Setup(models, tokens=sequence, sequence=sequence, checkpointing=True, compute_bytes=2, engine="hf",
                      cpu=True, rows=1, generated=rollout))


def peak_resident_bytes():
    with open("/proc/self/status") as handle:  # the process's resident high-water mark, in kB
        return 1024 * int(next(line for line in handle if line.startswith("VmHWM:")).split()[1])


def warm_optimizer(optimizer):
    """Create the AdamW states as a trainer's first step leaves them: one step on zero gradients, gradients freed."""
    import torch
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build_models(args):
    """(policy, critic or None, optimizers, the method's module and Args) as a trainer holds them after a step."""
    import torch

    import common
    import grpo
    import ppo
    from benchmarks.bench_update import build_model
    from infra.memory import keep_freed_host_memory
    torch.set_num_threads(args.threads)
    if not args.glibc_default:
        keep_freed_host_memory()  # as infra.run.Run does on CPU
    overrides = {key: value for key, value in model_config(args).items() if key != "num_hidden_layers"}

    def build(value_head=0):  # as common.load_model(..., gradient_checkpointing=True): bf16 compute, training mode
        model = build_model(args.model, "cpu", "bfloat16", args.layers, value_head, **overrides)
        common.enable_gradient_checkpointing(model)  # training mode too
        return model

    policy = build()
    critic = build(value_head=1) if args.method == "ppo" else None
    models = [policy] + [critic] * (critic is not None)
    method = ppo if critic is not None else grpo
    hyper = method.Args()  # the published lr, betas, weight decay, clips, aggregation
    optimizers = [torch.optim.AdamW(model.parameters(), lr=lr, betas=hyper.adam_betas, weight_decay=hyper.weight_decay)
                  for model, lr in zip(models, (hyper.lr, getattr(hyper, "critic_lr", 0)))]
    for optimizer in optimizers:
        warm_optimizer(optimizer)
    return policy, critic, optimizers, method, hyper


def one_rollout(args):
    """In this process: the models and AdamW states, then one rollout of the HF engine, every sequence full-length."""
    import types

    import torch

    from infra.engine import HFGenerator
    policy, *_ = build_models(args)
    policy.generation_config.eos_token_id = None  # no stop: every response runs to --response tokens
    tokenizer = types.SimpleNamespace(eos_token_id=None, pad_token_id=0, chat_template=None)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, policy.config.vocab_size, (args.rollout_prompts, args.rollout_prompt),
                            generator=generator).tolist()
    engine = HFGenerator(policy, tokenizer)
    engine.tokenizer.decode = lambda tokens, skip_special_tokens=True: ""
    start = time.perf_counter()
    completions = engine.generate(prompts, args.rollout_samples, args.response, 1.0, 1.0)
    seconds = time.perf_counter() - start
    assert all(len(c.token_ids) == args.response for c in completions)
    return dict(peak=peak_resident_bytes(), seconds=seconds, old_seconds=0.0, load=os.getloadavg()[0])


def one_update(args):
    """In this process: build the model(s), run one update of args.method at args.response tokens, return figures."""
    import torch

    import common
    import ppo
    from benchmarks.bench_update import random_batch
    policy, critic, optimizers, method, hyper = build_models(args)
    models = [policy] + [critic] * (critic is not None)
    batch = random_batch(model_config(args)["vocab_size"], args.samples, PROMPT_TOKENS, args.response, "cpu")
    mask, rewards = batch.response_mask, torch.arange(args.samples).remainder(2).float()  # 0, 1, 0, 1 ...: A != 0
    rows, micro_size = list(range(args.samples)), 1

    start = time.perf_counter()
    old_logprobs = common.batched(lambda micro: common.response_logprobs(policy, micro), batch, micro_size)
    if critic is not None:
        old_values = common.batched(lambda micro: common.critic_outputs(critic, micro), batch, micro_size)
        advantages, returns = ppo.gae(ppo.terminal_rewards(rewards, mask), old_values, mask)
        critic_weights = mask / mask.sum(1, True).clamp(min=1)  # seq-mean, ppo.py's default
    else:
        advantages = method.group_advantages(rewards, args.samples)[:, None].expand_as(old_logprobs)
    update_start = time.perf_counter()
    counts = dict(num_sequences=len(rows), num_tokens=mask.sum().item(), max_length=args.response)
    for micro in common.micro_batches(rows, batch.lengths(), micro_size):
        micro_batch = batch.select(micro)
        width = micro_batch.response_width
        if critic is not None:
            values = common.critic_outputs(critic, micro_batch)
            ppo.value_loss(values, old_values[micro, :width], returns[micro, :width], critic_weights[micro, :width],
                           hyper.value_clip, num_tokens=critic_weights.sum().item()).backward()
        logprobs = common.response_logprobs(policy, micro_batch)
        loss, _ = method.policy_loss(logprobs, old_logprobs[micro, :width], advantages[micro, :width],
                                     micro_batch.response_mask, hyper.clip_low, hyper.clip_high, hyper.aggregation,
                                     **counts)
        loss.backward()
    for model, optimizer in zip(models, optimizers):
        torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    end = time.perf_counter()
    return dict(peak=peak_resident_bytes(), old_seconds=update_start - start, seconds=end - update_start,
                load=os.getloadavg()[0])


CHILD_FLAGS = ("model", "layers", "samples", "threads", "rollout_prompts", "rollout_samples", "rollout_prompt")


def measure(args, method, phase, response):
    """Run one phase in a fresh process (its own resident high-water mark); its figures."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", f"{method}:{phase}", "--response", str(response)]
    for name, value in vars(args).items():
        if name in (*CHILD_FLAGS, *SHAPE_FLAGS):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--glibc-default"] * args.glibc_default
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if done.returncode:
        sys.exit(f"the {method} {phase} at {response} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rehearse(args):
    """[dict(method, phase, response, planned, plan_rows, peak, seconds, old_seconds, load)] for every method,
    phase and length: each measured in its own process, planned here."""
    results = []
    for method in args.methods:
        for phase in args.phases:
            for response in args.lengths:
                figures = measure(args, method, phase, response)
                column = 2 if phase == "update" else 3
                rows = planned_rows(args, method, phase, response)
                results.append(dict(method=method, phase=phase, response=response,
                                    planned=sum(row[column] for row in rows),
                                    plan_rows={row[0]: row[column] for row in rows}, **figures))
                print(report(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # as it goes
    return results


def report(results):
    lines = ["| method | phase | response tokens | measured peak GiB | plan GiB | plan / measured | seconds | "
             "old log-probs s | load |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['phase']} | {r['response']:,} | {r['peak'] / GIB:.2f} | "
                     f"{r['planned'] / GIB:.2f} | {r['planned'] / r['peak']:.2f} | {r['seconds']:.1f} | "
                     f"{r['old_seconds']:.1f} | {r['load']:.2f} |")
    return "\n".join(lines)


def checks(results, tolerance=TOLERANCE):
    """The failed checks' lines: the plan within +-tolerance of the measured peak; the peak at the longest length at
    most 2.5 x the peak at half of it (about linear growth)."""
    failed = [f"{r['method']} {r.get('phase', 'update')} {r['response']}: plan {r['planned'] / GIB:.2f} GiB vs "
              f"measured {r['peak'] / GIB:.2f}" for r in results if abs(r["planned"] / r["peak"] - 1) > tolerance]
    for key in dict.fromkeys((r["method"], r.get("phase", "update")) for r in results):
        peaks = {r["response"]: r["peak"] for r in results if (r["method"], r.get("phase", "update")) == key}
        longest = max(peaks)
        if longest // 2 in peaks and peaks[longest] > 2.5 * peaks[longest // 2]:
            failed.append(f"{' '.join(key)}: {peaks[longest] / GIB:.2f} GiB at {longest} > 2.5 x "
                          f"{peaks[longest // 2] / GIB:.2f} GiB at {longest // 2}")
    return failed


MARK = 777_777  # bytes of a marker allocation: where a layer's backward starts (MARK) and ends (MARK + 1)


def live_bytes(fn):
    """fn()'s memory events as [(time, bytes)] (frees negative), in order, and its result."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    return events, result


def peak_above_start(events, start=None, end=None):
    """The highest live total in [start, end] less the total at start (markers left out), from the events."""
    live, base, peak = 0, None if start else 0, 0
    for time, size in events:
        if abs(size) in (MARK, MARK + 1):
            continue
        if base is None and time >= start:
            base = live
        live += size
        if base is not None and (end is None or time <= end):
            peak = max(peak, live - base)
    return peak


def layer_backward(hidden, intermediate, heads, dtype, checkpointing, tokens=2048):
    """(measured, planned) bytes per token of the first decoder layer's backward above its start."""
    import torch

    import common
    from benchmarks.bench_update import build_model, random_batch
    torch.manual_seed(0)
    model = build_model("qwen3-0.6b-shape", "cpu", dtype, 2, hidden_size=hidden, intermediate_size=intermediate,
                        num_attention_heads=heads, num_key_value_heads=2, head_dim=64, vocab_size=64).train()
    if checkpointing:  # as common.load_model (its new name in transformers 5.25; the old one warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    for parameter in model.parameters():  # a second micro-batch: the gradients exist
        parameter.grad = torch.zeros_like(parameter)
    layer, marks = model.model.layers[0], []
    layer.register_full_backward_pre_hook(lambda module, grad: marks.append(torch.empty(MARK, dtype=torch.uint8)))
    layer.register_full_backward_hook(lambda module, gin, gout: marks.append(torch.empty(MARK + 1, dtype=torch.uint8)))
    batch = random_batch(64, 1, 8, tokens - 8, "cpu")
    events, _ = live_bytes(lambda: common.response_logprobs(model, batch).sum().backward())
    start, end = (next(time for time, size in events if size == mark) for mark in (MARK, MARK + 1))
    shape = Shape(hidden, 2, heads, 2, 64, intermediate, 64, True)
    setup = Setup((("policy", shape, 0, True),), tokens=tokens, sequence=tokens, rows=1,
                  compute_bytes=2 if dtype == "bfloat16" else 4)
    _, activations, _, _, backward = training_pass(shape, 0, setup)
    saved = activations / tokens - 2 * 4 * hidden - tokens  # one layer's: less the 2 checkpointed inputs, the mask
    return peak_above_start(events, start, end) / tokens, backward / tokens + saved * checkpointing


def optimizer_step(foreach):
    """(measured bytes, parameters, largest tensor) of clip_grad_norm_ and an AdamW step above the states."""
    import torch

    from benchmarks.bench_update import build_model
    torch.manual_seed(0)
    model = build_model("qwen3-0.6b-shape", "cpu", "bfloat16", 2, hidden_size=256, intermediate_size=768,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=4096)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.1, foreach=foreach)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()  # the states exist

    def step():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    events, _ = live_bytes(step)
    sizes = [parameter.numel() for parameter in model.parameters()]
    return peak_above_start(events), sum(sizes), max(sizes)


def fsdp_root(vocab=262144, hidden=256, tokens=512):
    """(measured, planned) bytes per vocabulary x hidden of an FSDP2 model's forward + backward above its start."""
    import torch

    import common
    from benchmarks.bench_update import build_model, random_batch
    from infra import dist
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = build_model("qwen3-0.6b-shape", "cpu", "bfloat16", 2, hidden_size=hidden, intermediate_size=768,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=vocab).train()
    model = dist.shard_model(model, model.compute_dtype)
    batch = random_batch(vocab, 1, 8, tokens - 8, "cpu")
    for _ in range(2):  # the sharded gradients exist: a second micro-batch
        common.response_logprobs(model, batch).sum().backward()
    events, _ = live_bytes(lambda: common.response_logprobs(model, batch).sum().backward())
    shape = Shape(hidden, 2, 4, 2, 64, 768, vocab, True)
    setup = Setup((("policy", shape, 0, True),), ranks=2, tokens=tokens, sequence=tokens, rows=1)  # sharded
    root = shape.parameters() - 2 * shape.layer_parameters()  # embeddings and final norm: gathered in bf16
    torch.distributed.destroy_process_group()
    planned = training_pass(shape, 0, setup)[3] + 2 * root  # grad buffers + the gathered root (compute copies)
    return peak_above_start(events) / (vocab * hidden), planned / (vocab * hidden)


def terms_report():
    """--terms: the table of the plan's transient terms against their measured live bytes."""
    import torch
    torch.set_num_threads(1)
    print("| term | shape | measured | plan | plan / measured |\n|---|---|---:|---:|---:|")
    for hidden, intermediate, heads, dtype, checkpointing in (
            (256, 768, 4, "bfloat16", False), (256, 2048, 4, "bfloat16", False), (256, 3072, 4, "bfloat16", False),
            (512, 3072, 4, "bfloat16", False), (256, 768, 8, "bfloat16", False), (256, 3072, 4, "float32", False),
            (256, 768, 4, "bfloat16", True), (256, 3072, 4, "bfloat16", True), (256, 768, 8, "bfloat16", True)):
        measured, planned = layer_backward(hidden, intermediate, heads, dtype, checkpointing)
        what = "layer backward" + (" + its recomputed saved tensors (checkpointing)" if checkpointing else "")
        print(f"| {what}, bytes a token | h {hidden}, I {intermediate}, q {heads * 64}, {dtype} | {measured:,.0f} | "
              f"{planned:,.0f} | {planned / measured:.2f} |")
    for foreach in (True, False):
        measured, parameters, largest = optimizer_step(foreach)
        planned = 4 * parameters if foreach else 8 * largest
        print(f"| AdamW step, foreach={foreach}, bytes | {parameters:,} parameters, largest {largest:,} | "
              f"{measured:,} | {planned:,} | {planned / measured:.3f} |")
    measured, planned = fsdp_root()
    print(f"| FSDP2 forward + backward above its start, bytes per V x h | V 262,144, h 256, bf16, world of one | "
          f"{measured:.2f} | {planned:.2f} | {planned / measured:.2f} |")


def main():
    from benchmarks.bench_update import SHAPES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b-shape", choices=sorted(SHAPES), help="the model's shape")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (0: the model's own; Qwen3-0.6B: 28)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="response tokens")
    parser.add_argument("--methods", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--phases", nargs="+", default=["update"], choices=["update", "rollout"])
    parser.add_argument("--samples", type=int, default=2, help="update: sequences (one micro-batch each)")
    parser.add_argument("--rollout-prompts", type=int, default=8, help="rollout: distinct prompts")
    parser.add_argument("--rollout-samples", type=int, default=8, help="rollout: samples per prompt")
    parser.add_argument("--rollout-prompt", type=int, default=96, help="rollout: prompt tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (OMP_NUM_THREADS of each process)")
    for flag, field in SHAPE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=0,
                            help=f"{field} (default: the model's)")
    parser.add_argument("--glibc-default", action="store_true", help="glibc's allocator at its defaults (freed large "
                        "blocks go back to the system), not keep_freed_host_memory as the trainers set it on CPU")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--response", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--terms", action="store_true", help="the plan's transient terms against their live bytes")
    args = parser.parse_args()
    if args.terms:
        return terms_report()
    if args.child:
        args.method, phase = args.child.split(":")
        return print(json.dumps(one_update(args) if phase == "update" else one_rollout(args)))
    import torch
    config = model_config(args)
    print(f"machine: {platform.processor() or platform.machine()} with {os.cpu_count()} cores, {args.threads} torch "
          f"thread(s); torch {torch.__version__}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"model: {args.model} with {config['num_hidden_layers']} layers (hidden {config['hidden_size']}, vocabulary "
          f"{config['vocab_size']:,}), bf16 compute, float32 weights, gradient checkpointing; update: {args.samples} "
          f"sequences of {PROMPT_TOKENS} prompt + the response tokens, one per micro-batch; rollout: "
          f"{args.rollout_prompts} x {args.rollout_samples} sequences of {args.rollout_prompt} prompt + the response "
          "tokens (HF engine)\n")
    results = rehearse(args)
    print(report(results))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; measured: each phase's process, resident high-water mark "
          f"(VmHWM); plan: infra.memory.plan's update or rollout column")
    if args.json:
        print(json.dumps(results))
    failed = checks(results)
    print("plan within +-20% of the measured peak at every length, growth about linear: " +
          ("no: " + "; ".join(failed) if failed else "yes"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
