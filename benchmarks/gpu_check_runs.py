"""What the GPU check (benchmarks/gpu_check.py) runs in its child processes, each a fresh process with a timeout:

    python benchmarks/gpu_check_runs.py observe TRAINER REPORT [--deterministic] -- TRAINER_FLAGS...
    python benchmarks/gpu_check_runs.py update REPORT JSON      # one real-size update (JSON: one_update's arguments)
    python benchmarks/gpu_check_runs.py generate REPORT JSON    # Hugging Face generate (JSON: generate_speed's)

observe runs a trainer file's main() in this process and records, at each step, what no metric holds: the PPO ratio
of every token of the first mini-batch (the policy the old log-probs came from) and the direction of the step's
update (do samples of higher reward gain log-probability?). The figures go to REPORT as JSON.
"""
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CLIP = 0.2  # |ratio - 1| beyond which the six files' default clip range (0.2) clips a token


def deviation_statistics(deviations):
    """{mean, q99, max, clipped, tokens} of a 1-d tensor of deviations (|ratio - 1| over the first mini-batch's
    tokens, or |engine log-prob - trainer log-prob| over the rollout's): clipped is the fraction beyond CLIP."""
    import numpy as np
    if not deviations.numel():
        return dict(mean=0.0, q99=0.0, max=0.0, clipped=0.0, tokens=0)
    deviations = deviations.double()
    return dict(mean=deviations.mean().item(), q99=float(np.quantile(deviations.numpy(), 0.99)),  # any size
                max=deviations.max().item(), clipped=(deviations > CLIP).double().mean().item(),
                tokens=deviations.numel())


def correlation(x, y):
    """Pearson's correlation of two 1-d tensors; None when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    norm = (x.square().sum() * y.square().sum()).sqrt().item()
    return (x * y).sum().item() / norm if norm > 0 else None


def observe(trainer, report_path, argv, deterministic=False):
    """Run `trainer`.main() with argv in this process; write {step: figures} to report_path, where figures are
    `ratio`: deviation_statistics of |ratio - 1| over the first mini-batch (the policy_loss calls made before the
    step's first optimizer step: the six files step all their optimizers together at a mini-batch's end) with
    `calls`, the policy_loss calls it took; `direction`: the
    correlation, over the rollout's samples, of the reward with the change of the sample's mean log-prob from before
    the step's update to after it (the trainer's own log-prob call repeated on the rollout's batch once the step has
    updated: a correct update raises the samples that scored higher, so it is > 0; a sign error makes it < 0), with
    `change`, the mean |change| (measured on CPU: 2e-3, ten times the bf16 gap's mean per token), and `gap`: the
    deviation_statistics of |engine log-prob - trainer's old log-prob| over the rollout's tokens.
    deterministic: torch's deterministic algorithms (an operation without one warns, in the log) and SDPA's math
    kernel (the memory-efficient kernel's backward stays nondeterministic under warn_only), so that a resumed run can
    repeat a straight one exactly."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import common
    import infra.evaluate
    import infra.run
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode (before CUDA starts)
        torch.use_deterministic_algorithms(True, warn_only=True)
        for kernel in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{kernel}_sdp", lambda on: None)(False)
    module = __import__(trainer)
    state = dict(first=True, deviations=[], calls=0, steps={}, policy=None, batches=[], temperature=1.0, rollout={})
    policy_loss, end_step, rollout_metrics = module.policy_loss, infra.run.Run.end_step, infra.evaluate.rollout_metrics
    load_model, sequence_batch, response_logprobs = common.load_model, common.sequence_batch, common.response_logprobs

    def observed_policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs):
        if state["first"]:
            deviation = (torch.exp(logprobs.detach().float() - old_logprobs.float()) - 1).abs()[mask.bool()]
            state["deviations"].append(deviation.cpu())
            state["calls"] += 1
        return policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs)

    def observed_load_model(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        if state["policy"] is None:  # the six files load the policy first
            state["policy"] = loaded[0]
        return loaded

    def observed_sequence_batch(*args, **kwargs):
        batch = sequence_batch(*args, **kwargs)
        state["batches"].append(batch)
        return batch

    def observed_response_logprobs(model, batch, *rest, **kwargs):
        if model is state["policy"]:
            state["temperature"] = kwargs.get("temperature", rest[0] if rest else 1.0)
        return response_logprobs(model, batch, *rest, **kwargs)

    def observed_rollout_metrics(completions, rewards, trainer_logprobs, mask):
        """Called once a step, after the update, with the rewards and the old log-probs in the rollout's row order."""
        batch = next((b for b in reversed(state["batches"]) if b.response_mask.shape == mask.shape
                      and bool((b.response_mask.to(mask.device) == mask).all())), None)
        if batch is not None and state["policy"] is not None:
            temperature = state["temperature"]
            after = common.batched(lambda micro: common.response_logprobs(state["policy"], micro, temperature),
                                   batch.to(mask.device), 16)
            change = ((after - trainer_logprobs.float()) * mask).sum(1) / mask.sum(1).clamp(min=1)
            state["rollout"].update(direction=correlation(rewards.float().cpu(), change.cpu()),
                                    change=change.abs().mean().item())  # its size, against bf16 noise
        engine = common.engine_logprobs(completions, mask.shape[1]).to(mask.device)
        state["rollout"]["gap"] = deviation_statistics((engine - trainer_logprobs.float()).abs()[mask].cpu())
        state["batches"] = []
        return rollout_metrics(completions, rewards, trainer_logprobs, mask)

    def observed_end_step(run, step, metrics):
        figures = deviation_statistics(torch.cat(state["deviations"]) if state["deviations"] else torch.zeros(0))
        state["steps"][step] = dict(ratio=figures, calls=state["calls"], **state["rollout"])
        state.update(first=True, deviations=[], calls=0, rollout={})
        return end_step(run, step, metrics)

    def optimizer_stepped(optimizer, args, kwargs):
        state["first"] = False

    common.response_logprobs = observed_response_logprobs
    module.policy_loss, infra.run.Run.end_step, infra.evaluate.rollout_metrics = (
        observed_policy_loss, observed_end_step, observed_rollout_metrics)
    common.load_model, common.sequence_batch = observed_load_model, observed_sequence_batch
    register_optimizer_step_pre_hook(optimizer_stepped)
    sys.argv = [module.__file__, *argv]
    try:
        infra.run.run_main(module.main)
    finally:
        with open(report_path, "w") as handle:
            json.dump(state["steps"], handle)


def peak_resident_bytes():
    with open("/proc/self/status") as handle:  # the process's resident high-water mark, in kB
        return 1024 * int(next(line for line in handle if line.startswith("VmHWM:")).split()[1])


def peak_flops(device):
    """The GPU's dense bf16 peak FLOP/s for MFU (H100 SXM and H200: 989e12), None elsewhere."""
    import torch
    if device.startswith("cuda") and any(name in torch.cuda.get_device_name() for name in ("H100", "H200")):
        return 989e12
    return None


def memory_figures(device):
    """{allocated, reserved, host}: the GPU peaks (torch.cuda.max_memory_allocated / max_memory_reserved; 0 on CPU)
    and the process's resident high-water mark (VmHWM)."""
    import torch
    cuda = device.startswith("cuda")
    return dict(allocated=torch.cuda.max_memory_allocated() if cuda else 0,
                reserved=torch.cuda.max_memory_reserved() if cuda else 0, host=peak_resident_bytes())


def update_lengths(spec):
    """The mini-batch of one_update: one sequence of the prompt + long response (the plan's longest sequence), then
    short_count of prompt + short response (micro-batches of several rows)."""
    return [spec["long_response"]] + [spec["short_response"]] * spec["short_count"]


def one_update(spec):
    """In this process, `repeats` updates of spec["method"] (grpo: the policy; ppo: and a critic with one output) as
    grpo.py / ppo.py run one at their defaults: a random model of bench_update's spec["shape"] with spec["layers"]
    layers (config fields in spec["overrides"] replacing its own), float32 weights and AdamW states (made before, as
    from a trainer's second step on), bf16 autocast, gradient checkpointing (common.enable_gradient_checkpointing),
    micro-batches packed to spec["micro_batch_tokens"] padded tokens (common.micro_batches), the LM head a vocabulary
    slice at a time; spec["offload"]: --offload-optimizer (infra.dist's FSDP2 CPU offload on a world of one, the
    optimizer stepping on the CPU). Each update: the old log-probs (PPO: old values) without gradients, advantages,
    one mini-batch of forward + backward per micro-batch, gradient clipping and an AdamW step per model. Returns the
    peaks (memory_figures), the micro-batches' shapes, the update's FLOPs (bench_update.update_flops, summed over
    the micro-batches and the models), and the seconds of each update phase (old log-probs excluded)."""
    import types

    import torch

    import common
    import grpo
    import infra.dist
    import ppo
    from benchmarks.bench_update import build_model, synchronize, update_flops
    from benchmarks.rehearsal import warm_optimizer
    from infra.memory import keep_freed_host_memory
    device, offload = spec["device"], spec["offload"]
    if device == "cpu":
        keep_freed_host_memory()  # as infra.run.Run does on CPU, and as the CPU plan assumes
    if offload:
        device = infra.dist.init_device(device, cpu_offload=True)

    def build(value_head=0):  # as common.load_model: float32 weights, bf16 compute, checkpointing, sharded if offloaded
        model = build_model(spec["shape"], "cpu" if offload else device, "bfloat16", spec["layers"], value_head,
                            **spec["overrides"])
        common.enable_gradient_checkpointing(model)
        return infra.dist.shard_model(model, model.compute_dtype) if offload else model

    policy = build()
    critic = build(value_head=1) if spec["method"] == "ppo" else None
    models, trainer = [policy] + [critic] * (critic is not None), ppo if spec["method"] == "ppo" else grpo
    hyper = trainer.Args()  # the published lr, betas, weight decay, clips, aggregation
    optimizers = [torch.optim.AdamW(model.parameters(), lr=lr, betas=hyper.adam_betas, weight_decay=hyper.weight_decay)
                  for model, lr in zip(models, (hyper.lr, getattr(hyper, "critic_lr", 0)))]
    for optimizer in optimizers:
        warm_optimizer(optimizer)
    config, lengths, generator = policy.config, update_lengths(spec), torch.Generator().manual_seed(0)
    batch = common.sequence_batch(*([torch.randint(3, config.vocab_size, (length,), generator=generator).tolist()
                                     for length in row_lengths] for row_lengths in ([spec["prompt"]] * len(lengths),
                                                                                    lengths)), pad_id=0).to(device)
    mask, samples, tokens = batch.response_mask, len(lengths), spec["micro_batch_tokens"]
    rewards = torch.arange(samples, device=device).remainder(2).float()  # half of them right: A != 0
    micro = common.micro_batches(list(range(samples)), batch.lengths(), 1, tokens)
    counted = [config] + [types.SimpleNamespace(**{**config.to_dict(), "vocab_size": 1})] * (critic is not None)
    flops = sum(update_flops(model, batch.select(rows)) for rows in micro for model in counted)  # a critic: one output
    seconds, finite = [], True
    for _ in range(spec["repeats"]):
        old_logprobs = common.batched(lambda part: common.response_logprobs(policy, part), batch, 1, tokens)
        if critic is not None:
            old_values = common.batched(lambda part: common.critic_outputs(critic, part), batch, 1, tokens)
            advantages, returns = ppo.gae(ppo.terminal_rewards(rewards, mask), old_values, mask)
            critic_weights = mask / mask.sum(1, True).clamp(min=1)  # seq-mean, ppo.py's default
        else:
            advantages = grpo.group_advantages(rewards, samples)[:, None].expand_as(old_logprobs)
        counts = dict(num_sequences=samples, num_tokens=mask.sum().item(), max_length=max(lengths))
        synchronize(device)
        start = time.perf_counter()
        for rows in micro:
            micro_batch = batch.select(rows)
            width = micro_batch.response_width
            if critic is not None:
                values = common.critic_outputs(critic, micro_batch)
                ppo.value_loss(values, old_values[rows, :width], returns[rows, :width], critic_weights[rows, :width],
                               hyper.value_clip, num_tokens=critic_weights.sum().item()).backward()
            logprobs = common.response_logprobs(policy, micro_batch)
            loss, _ = trainer.policy_loss(logprobs, old_logprobs[rows, :width], advantages[rows, :width],
                                          micro_batch.response_mask, hyper.clip_low, hyper.clip_high,
                                          hyper.aggregation, **counts)
            loss.backward()
            finite = finite and math.isfinite(loss.item())
        for model, optimizer in zip(models, optimizers):
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.grad_clip)
            finite = finite and math.isfinite(norm.full_tensor().item() if hasattr(norm, "full_tensor") else
                                              norm.item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    shapes = [list(batch.select(rows).input_ids.shape) for rows in micro]
    return dict(memory_figures(device), finite=finite, seconds=seconds, flops=flops, micro_batches=shapes,
                tokens=int(batch.attention_mask.sum()), peak_flops=peak_flops(device),
                parameters=sum(p.numel() for p in policy.parameters()))


def generate_speed(spec):
    """In this process, the Hugging Face engine (infra.engine.HFGenerator.sample, as a trainer's generate calls it:
    float32 weights under bf16 autocast, no_grad) samples spec["new_tokens"] tokens after each of spec["sequences"]
    random prompts of spec["prompt"] tokens, every row forced to the full length (no stop id), on a random model of
    bench_update's spec["shape"] with spec["layers"] layers. Returns the seconds, tokens/s and the peaks."""
    import types

    import torch

    from benchmarks.bench_update import build_model, random_batch, synchronize
    from infra.engine import HFGenerator
    from infra.memory import keep_freed_host_memory
    device = spec["device"]
    if device == "cpu":
        keep_freed_host_memory()
    model = build_model(spec["shape"], device, "bfloat16", spec["layers"], 0, **spec["overrides"]).eval()
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=None, chat_template=None)
    generator = HFGenerator(model, tokenizer)
    generator.stop_ids = [-1]  # no token has this id: every row runs to the full length
    prompts = random_batch(model.config.vocab_size, spec["sequences"], spec["prompt"], 1, device)
    inputs = prompts.input_ids[:, :-1], prompts.attention_mask[:, :-1]
    synchronize(device)
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):  # as HFGenerator.generate
        tokens, _ = generator.sample(*inputs, spec["new_tokens"])
    synchronize(device)
    seconds = time.perf_counter() - start
    generated = tokens.shape[0] * tokens.shape[1]
    return dict(memory_figures(device), seconds=seconds, tokens_per_s=generated / seconds, generated=generated)


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "observe":  # observe TRAINER REPORT [--deterministic] -- FLAGS...
        split = sys.argv.index("--")
        observe(sys.argv[2], sys.argv[3], sys.argv[split + 1:], "--deterministic" in sys.argv[4:split])
    elif command in ("update", "generate"):  # update|generate REPORT SPEC_JSON
        figures = (one_update if command == "update" else generate_speed)(json.loads(sys.argv[3]))
        with open(sys.argv[2], "w") as handle:
            json.dump(figures, handle)
    else:
        sys.exit(__doc__)
