"""A rehearsal at real shapes: one GRPO and one PPO update of a Qwen3-0.6B-shaped model on CPU, the measured peak
memory beside infra.memory's plan for the same shape and settings, and the time per update.

    OMP_NUM_THREADS=1 python benchmarks/rehearsal.py        # 2 layers; responses of 1,024, 2,048 and 4,096 tokens

The model: bench_update.QWEN3_0_6B_SHAPE (hidden 1024, 16 query / 8 key-value heads of 128, MLP 3072, vocabulary
151,936, tied embeddings), randomly initialized, with --layers decoder layers; PPO's critic is the same backbone with a
scalar head (AutoModelForTokenClassification, as ppo.py loads it). As a trainer runs a real model: float32 weights and
AdamW states, bf16 compute (autocast), gradient checkpointing, the chunked log-prob (common.token_logprobs).
The rollout: --samples responses of the given length (every one full-length) to prompts of 1,024 random tokens (the
plan's prompt allowance, infra.memory.PROMPT_TOKENS), micro-batches of one sequence (--micro-batch-size 1), one
mini-batch.
The update, as grpo.py / ppo.py run it: the old log-probs (PPO: and the old values) without gradients, the advantages
(grpo.group_advantages; ppo.gae on ppo.terminal_rewards), then per micro-batch common.response_logprobs and
grpo.policy_loss (PPO: common.critic_outputs and ppo.value_loss too) and backward, then gradient clipping and an AdamW
step per model. The AdamW states exist before it (a warm-up step on zero gradients), as from a trainer's second step on.
Each method and length runs in a fresh process; its peak memory is that process's resident high-water mark (VmHWM),
everything included (imports, model build, update). The plan: infra.memory.plan for the same models and settings (one
sequence per micro-batch, checkpointing, bf16 compute, a CPU process), its update column (no rollout is run here).
One torch thread (OMP_NUM_THREADS=1): on the shared 2-core machine at load 2.6 the GRPO update at 1,024 tokens took
11.4 s with 1 thread, 15.1 s with 2.
The default run took 10 min 34 s on this 2-core machine at load 3-6 and peaked at 10.6 GiB (PPO, 4,096 tokens).
On the shared CPU machine wall times are inflated by other processes: the table prints the load average.
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

TOLERANCE = 0.2  # the plan must be within +-20% of the measured peak
SHAPE_FLAGS = dict(hidden="hidden_size", heads="num_attention_heads", kv_heads="num_key_value_heads",
                   head_dim="head_dim", intermediate="intermediate_size", vocab="vocab_size")


def model_config(args):
    """The model's config fields: Qwen3-0.6B's shape, --layers layers, any shape flag given replacing its field."""
    from benchmarks.bench_update import QWEN3_0_6B_SHAPE
    overrides = {field: getattr(args, flag) for flag, field in SHAPE_FLAGS.items() if getattr(args, flag)}
    return {**QWEN3_0_6B_SHAPE, "num_hidden_layers": args.layers, **overrides}


def planned_rows(method, config, sequence):
    """infra.memory's plan for one update of `method` on this CPU: policy (PPO: and a critic with one output), one
    sequence of `sequence` tokens per micro-batch, checkpointing, bf16 compute, the HF engine (none runs here)."""
    shape = Shape(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                  config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
                  config["tie_word_embeddings"])
    models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
    return plan(Setup(models, tokens=sequence, sequence=sequence, checkpointing=True, compute_bytes=2, engine="hf",
                      cpu=True, rows=1))


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


def one_update(args):
    """In this process: build the model(s), run one update of args.method at args.response tokens, return figures."""
    import torch

    import common
    import grpo
    import ppo
    from benchmarks.bench_update import build_model, random_batch
    from infra.memory import keep_freed_host_memory
    torch.set_num_threads(args.threads)
    if not args.glibc_default:
        keep_freed_host_memory()  # as infra.run.Run does on CPU
    config = model_config(args)
    overrides = {key: value for key, value in config.items() if key != "num_hidden_layers"}

    def build(value_head=0):  # as common.load_model(..., gradient_checkpointing=True): bf16 compute, training mode
        model = build_model("qwen3-0.6b-shape", "cpu", "bfloat16", args.layers, value_head, **overrides)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    policy = build()
    critic = build(value_head=1) if args.method == "ppo" else None
    models = [policy] + [critic] * (critic is not None)
    method = ppo if critic is not None else grpo
    hyper = method.Args()  # the published lr, betas, weight decay, clips, aggregation
    optimizers = [torch.optim.AdamW(model.parameters(), lr=lr, betas=hyper.adam_betas, weight_decay=hyper.weight_decay)
                  for model, lr in zip(models, (hyper.lr, getattr(hyper, "critic_lr", 0)))]
    for optimizer in optimizers:
        warm_optimizer(optimizer)
    batch = random_batch(config["vocab_size"], args.samples, PROMPT_TOKENS, args.response, "cpu")
    mask, rewards = batch.response_mask, torch.arange(args.samples).remainder(2).float()  # 0, 1, 0, 1 ...: A != 0
    rows, micro_size = list(range(args.samples)), 1

    start = time.perf_counter()
    old_logprobs = common.batched(lambda micro: common.response_logprobs(policy, micro), batch, micro_size)
    if critic is not None:
        old_values = common.batched(lambda micro: common.critic_outputs(critic, micro), batch, micro_size)
        advantages, returns = ppo.gae(ppo.terminal_rewards(rewards, mask), old_values, mask)
        critic_weights = mask / mask.sum(1, True).clamp(min=1)  # seq-mean, ppo.py's default
    else:
        advantages = grpo.group_advantages(rewards, args.samples)[:, None].expand_as(old_logprobs)
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
    return dict(peak=peak_resident_bytes(), old_seconds=update_start - start, update_seconds=end - update_start,
                load=os.getloadavg()[0])


def measure(args, method, response):
    """Run one update in a fresh process (its own resident high-water mark); its figures."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", method, "--response", str(response)]
    for name, value in vars(args).items():
        if name in ("layers", "samples", "threads", *SHAPE_FLAGS):
            argv += [f"--{name.replace('_', '-')}", str(value)]
    argv += ["--glibc-default"] * args.glibc_default
    done = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if done.returncode:
        sys.exit(f"the {method} update at {response} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def rehearse(args):
    """[dict(method, response, planned, plan_rows, peak, old_seconds, update_seconds, load)] for every method and
    length: each measured in its own process, planned here."""
    config, results = model_config(args), []
    for method in args.methods:
        for response in args.lengths:
            figures = measure(args, method, response)
            rows = planned_rows(method, config, PROMPT_TOKENS + response)
            results.append(dict(method=method, response=response, planned=sum(row[2] for row in rows),
                                plan_rows={name: value for name, _, value, _, _ in rows}, **figures))
    return results


def report(results):
    lines = ["| method | response tokens | measured peak GiB | plan GiB | plan / measured | update s | "
             "old log-probs s | load |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['response']:,} | {r['peak'] / GIB:.2f} | {r['planned'] / GIB:.2f} | "
                     f"{r['planned'] / r['peak']:.2f} | {r['update_seconds']:.1f} | {r['old_seconds']:.1f} | "
                     f"{r['load']:.2f} |")
    return "\n".join(lines)


def checks(results, tolerance=TOLERANCE):
    """The failed checks' lines: the plan within +-tolerance of the measured peak; the peak at the longest length at
    most 2.5 x the peak at half of it (about linear growth)."""
    failed = [f"{r['method']} {r['response']}: plan {r['planned'] / GIB:.2f} GiB vs measured {r['peak'] / GIB:.2f}"
              for r in results if abs(r["planned"] / r["peak"] - 1) > tolerance]
    for method in dict.fromkeys(r["method"] for r in results):
        peaks = {r["response"]: r["peak"] for r in results if r["method"] == method}
        longest = max(peaks)
        if longest // 2 in peaks and peaks[longest] > 2.5 * peaks[longest // 2]:
            failed.append(f"{method}: {peaks[longest] / GIB:.2f} GiB at {longest} > 2.5 x "
                          f"{peaks[longest // 2] / GIB:.2f} GiB at {longest // 2}")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Qwen3-0.6B has 28)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="response tokens")
    parser.add_argument("--methods", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--samples", type=int, default=2, help="sequences in the rollout (one micro-batch each)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (OMP_NUM_THREADS of each update)")
    for flag, field in SHAPE_FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=int, default=0,
                            help=f"{field} (default: Qwen3-0.6B's)")
    parser.add_argument("--glibc-default", action="store_true", help="glibc's allocator at its defaults (freed large "
                        "blocks go back to the system), not keep_freed_host_memory as the trainers set it on CPU")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--response", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.method = args.child
        return print(json.dumps(one_update(args)))
    import torch
    config = model_config(args)
    print(f"machine: {platform.processor() or platform.machine()} with {os.cpu_count()} cores, {args.threads} torch "
          f"thread(s); torch {torch.__version__}; load average before: {os.getloadavg()[0]:.2f}")
    print(f"model: Qwen3-0.6B's shape with {args.layers} layers (hidden {config['hidden_size']}, vocabulary "
          f"{config['vocab_size']:,}), bf16 compute, float32 weights, gradient checkpointing; a rollout of "
          f"{args.samples} sequences of {PROMPT_TOKENS} prompt + the response tokens, one per micro-batch\n")
    results = rehearse(args)
    print(report(results))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}; measured: each update's process, resident high-water mark "
          f"(VmHWM); plan: infra.memory.plan's update column")
    if args.json:
        print(json.dumps(results))
    failed = checks(results)
    print("plan within +-20% of the measured peak at every length, growth about linear: " +
          ("no: " + "; ".join(failed) if failed else "yes"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
