"""What the GPU check (benchmarks/gpu_check.py) runs in its child processes, each a fresh process with a timeout:

    python benchmarks/gpu_check_runs.py observe TRAINER REPORT [--deterministic] -- TRAINER_FLAGS...
    python benchmarks/gpu_check_runs.py update REPORT JSON      # one real-size update (JSON: one_update's arguments)
    python benchmarks/gpu_check_runs.py generate REPORT JSON    # Hugging Face generate (JSON: generate_speed's)
    python benchmarks/gpu_check_runs.py requirements SITE       # the carried wheels' needs this machine lacks

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
NUCLEUS_SHIFT = 0.01  # top-p's log-mass term (processed_shift) above which a token counts as one the nucleus bit


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


def processed_shift(model, batch, temperature, top_p):
    """[B, T] log pi_processed - log pi at temperature for the response tokens of `batch`: the nucleus's log-mass
    term that top-p adds to a sampled token's log-prob (the engines record the processed distribution: Hugging Face's
    TopPLogitsWarper, vLLM's processed_logprobs), 0 at top-p 1. From the model's whole logits (the tiny model's). A
    token the engine drew at the nucleus's edge that falls just outside it here gets 0 (its gap is then at most
    -log top_p)."""
    import torch
    from transformers import TopPLogitsWarper

    import common
    if top_p >= 1 or temperature <= 0:
        return torch.zeros(batch.response_ids.shape, device=batch.response_ids.device)
    with torch.no_grad():
        logits = common.response_forward(model, batch).logits[:, :-1].float() / temperature
        flat = logits.reshape(-1, logits.shape[-1])
        full = flat.log_softmax(-1)
        kept = TopPLogitsWarper(top_p)(None, flat).log_softmax(-1)
        token = batch.response_ids.reshape(-1, 1)
        shift = (kept.gather(-1, token) - full.gather(-1, token)).reshape(batch.response_ids.shape)
    return torch.where(shift.isfinite(), shift, 0.0)  # just outside this nucleus (its edge moves with rounding): 0


def clip_leaks(loss, logprobs, old_logprobs, advantages, mask, clip_low, clip_high):
    """(tokens where PPO's clip binds, how many of them still get a gradient): a token whose ratio is past
    1 + clip_high with A > 0, or below 1 - clip_low with A < 0, adds a constant to the clipped loss (min(rA, clip(r)A)
    takes the clipped side), so d loss / d log-prob is 0 there. From the loss's own graph (no model pass)."""
    import torch
    ratio = torch.exp(logprobs.detach().float() - old_logprobs.float())
    binds = mask.bool() & (((advantages > 0) & (ratio > 1 + clip_high)) | ((advantages < 0) & (ratio < 1 - clip_low)))
    if not binds.any() or not logprobs.requires_grad:
        return 0, 0
    gradient, = torch.autograd.grad(loss, logprobs, retain_graph=True)
    return int(binds.sum()), int((gradient[binds] != 0).sum())


def padding_read(policy_loss, logprobs, old_logprobs, advantages, mask, *rest, **kwargs):
    """Whether `policy_loss` reads the positions its mask leaves out (the padding after each response): its loss
    with garbage there (the log-probs, old log-probs and advantages of the padding changed) against the loss as
    given, on detached inputs; masked positions must not count."""
    import torch
    pad = ~mask.bool()
    if not pad.any():
        return None
    detached = logprobs.detach()
    given = policy_loss(detached, old_logprobs, advantages, mask, *rest, **kwargs)[0]
    garbage = policy_loss(torch.where(pad, detached - 1.5, detached),
                          torch.where(pad, old_logprobs + 0.5, old_logprobs),
                          torch.where(pad, -3 * advantages - 1, advantages), mask, *rest, **kwargs)[0]
    return bool((given - garbage).abs() > 1e-6 * max(given.abs().item(), 1e-6))


def observe(trainer, report_path, argv, deterministic=False, measure=None):
    """Run `trainer`.main() with argv in this process; write {step: figures} to report_path, where figures are
    `ratio`: deviation_statistics of |ratio - 1| over the first mini-batch (the policy_loss calls made before the
    step's first optimizer step: the six files step all their optimizers together at a mini-batch's end) with
    `calls`, the policy_loss calls it took; `ratio_after`: the same over the later mini-batches (reported: the update
    moved the policy); `clip_binds` and `clip_leaks`: tokens of every policy_loss call where the clip binds, and how
    many of them the loss still differentiates; `padding_read`: whether a first mini-batch's policy loss changed when
    the padding its mask leaves out was changed; `direction`: the correlation, over the rollout's samples, of the
    reward with the change of the sample's mean log-prob over the step's update (the policy's log-probs of the
    rollout measured when its batch is made, before the update, and again after it: a correct update raises the
    samples that scored higher, so it is > 0; a sign error makes it < 0; an update that does nothing changes
    nothing), with `change`, the mean |change| of a sample's mean log-prob, and `token_change`, the mean |change| of
    a token's; `gap`: deviation_statistics of |engine log-prob - (the trainer's old log-prob + processed_shift)|
    over the rollout's tokens (the engine records the processed distribution, the trainer the policy's at the
    sampling temperature); `nucleus`: over the tokens where top-p's term exceeds NUCLEUS_SHIFT, their count and
    the share of that term the engine's log-probs show (sum of engine - trainer over sum of the term: 1 when the
    engine records the nucleus's log-probs, 0 when it ignores top-p). The harness measures at the rollout's sampling
    temperature with `measure` (a planted run passes the unplanted function; default common.response_logprobs).
    deterministic: torch's deterministic algorithms (an operation without one warns, in the log) and SDPA's math
    kernel (the memory-efficient kernel's backward stays nondeterministic under warn_only), so that a resumed run can
    repeat a straight one exactly."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import common
    import infra.dist
    import infra.engine
    import infra.evaluate
    import infra.run
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode (before CUDA starts)
        torch.use_deterministic_algorithms(True, warn_only=True)
        for kernel in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{kernel}_sdp", lambda on: None)(False)
    module = __import__(trainer)
    measure = measure or common.response_logprobs
    state = dict(first=True, deviations=[], later=[], calls=0, steps={}, policy=None, batches=[], rollout={},
                 binds=0, leaks=0, padding=[], sampling=(1.0, 1.0))
    policy_loss, end_step, rollout_metrics = module.policy_loss, infra.run.Run.end_step, infra.evaluate.rollout_metrics
    load_model, sequence_batch, generate = common.load_model, common.sequence_batch, infra.engine.HFGenerator.generate

    def measured(batch, temperature):
        """The policy's log-probs of a whole rollout batch at the sampling temperature, by `measure`, on its device."""
        batch = batch.to(infra.dist.compute_device(state["policy"]))
        with torch.no_grad():
            return common.batched(lambda micro: measure(state["policy"], micro, temperature), batch, 16)

    def observed_policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs):
        result = policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs)
        deviation = (torch.exp(logprobs.detach().float() - old_logprobs.float()) - 1).abs()[mask.bool()].cpu()
        (state["deviations"] if state["first"] else state["later"]).append(deviation)
        if state["first"]:
            state["calls"] += 1
            state["padding"].append(padding_read(policy_loss, logprobs, old_logprobs, advantages, mask, *rest,
                                                 **kwargs))
        clip_low, clip_high = rest[:2] if len(rest) >= 2 else (kwargs.get("clip_low", 0.2),
                                                               kwargs.get("clip_high", 0.2))
        binds, leaks = clip_leaks(result[0], logprobs, old_logprobs, advantages.expand_as(logprobs), mask, clip_low,
                                  clip_high)
        state["binds"], state["leaks"] = state["binds"] + binds, state["leaks"] + leaks
        return result

    def observed_load_model(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        if state["policy"] is None:  # the six files load the policy first
            state["policy"] = loaded[0]
        return loaded

    def observed_generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        state["sampling"] = (temperature, top_p)
        return generate(self, prompts, n, max_tokens, temperature, top_p)

    def observed_sequence_batch(*args, **kwargs):
        """A rollout's batch, kept with the policy's log-probs of it before the update and the sampling settings."""
        batch = sequence_batch(*args, **kwargs)
        before = measured(batch, state["sampling"][0]) if state["policy"] is not None else None
        state["batches"].append((batch, before, state["sampling"]))
        return batch

    def observed_rollout_metrics(completions, rewards, trainer_logprobs, mask):
        """Called once a step, after the update, with the rewards and the old log-probs in the rollout's row order."""
        batch, before, (temperature, top_p) = next(
            (entry for entry in reversed(state["batches"]) if entry[0].response_mask.shape == mask.shape and bool(
                (entry[0].response_mask.to(mask.device) == mask).all())), (None, None, (1.0, 1.0)))
        shift = torch.zeros_like(trainer_logprobs, dtype=torch.float32)
        if batch is not None and before is not None:
            moved = (measured(batch, temperature) - before).to(mask.device) * mask
            change = moved.sum(1) / mask.sum(1).clamp(min=1)
            state["rollout"].update(direction=correlation(rewards.float().cpu(), change.cpu()),
                                    change=change.abs().mean().item(),  # its size, against bf16 noise
                                    token_change=moved.abs()[mask].mean().item() if mask.any() else 0.0,
                                    temperature=temperature, top_p=top_p)
            shift = processed_shift(state["policy"], batch.to(infra.dist.compute_device(state["policy"])),
                                    temperature, top_p).to(mask.device)
        engine = common.engine_logprobs(completions, mask.shape[1]).to(mask.device)
        state["rollout"]["gap"] = deviation_statistics((engine - trainer_logprobs.float() - shift).abs()[mask].cpu())
        bites = mask & (shift > NUCLEUS_SHIFT)  # tokens whose nucleus left out more than 1% of the mass
        state["rollout"]["nucleus"] = dict(tokens=int(bites.sum()), explained=(
            (engine - trainer_logprobs.float())[bites].sum() / shift[bites].sum()).item() if bites.any() else None)
        state["batches"] = []
        return rollout_metrics(completions, rewards, trainer_logprobs, mask)

    def observed_end_step(run, step, metrics):
        figures = deviation_statistics(torch.cat(state["deviations"]) if state["deviations"] else torch.zeros(0))
        after = deviation_statistics(torch.cat(state["later"]) if state["later"] else torch.zeros(0))
        padding = [read for read in state["padding"] if read is not None]
        state["steps"][step] = dict(ratio=figures, ratio_after=after, calls=state["calls"], clip_binds=state["binds"],
                                    clip_leaks=state["leaks"], padding_read=any(padding) if padding else None,
                                    **state["rollout"])
        state.update(first=True, deviations=[], later=[], calls=0, rollout={}, binds=0, leaks=0, padding=[])
        return end_step(run, step, metrics)

    def optimizer_stepped(optimizer, args, kwargs):
        state["first"] = False

    module.policy_loss, infra.run.Run.end_step, infra.evaluate.rollout_metrics = (
        observed_policy_loss, observed_end_step, observed_rollout_metrics)
    common.load_model, common.sequence_batch = observed_load_model, observed_sequence_batch
    infra.engine.HFGenerator.generate = observed_generate
    register_optimizer_step_pre_hook(optimizer_stepped)
    sys.argv = [module.__file__, *argv]
    try:
        infra.run.run_main(module.main)
    finally:
        with open(report_path, "w") as handle:
            json.dump(state["steps"], handle)


def unmet_requirements(site):
    """The requirements of the distributions installed in `site` (the carried wheels) that this Python's packages
    (the machine's own, and the carried ones: PYTHONPATH puts `site` first) do not meet, extras and other Pythons'
    markers aside, as "typeguard needs typing_extensions>=4.14.0 (4.12.2 here)"."""
    import re
    from importlib import metadata

    from packaging.requirements import Requirement
    def normalized(name):
        return re.sub(r"[-_.]+", "-", name).lower()
    here = {}
    for found in metadata.distributions():  # sys.path's order: the first copy of a name is the one imported
        here.setdefault(normalized(found.metadata["Name"]), found.version)
    unmet = set()
    for carried in metadata.distributions(path=[site]):
        for line in carried.requires or []:
            requirement = Requirement(line)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            version = here.get(normalized(requirement.name))
            if version is None or not requirement.specifier.contains(version, prereleases=True):
                unmet.add(f"{carried.metadata['Name']} needs {requirement} ({version or 'not'} here)")
    return sorted(unmet)


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
    figures = memory_figures(device)
    if offload:  # the world of one that init_device opened (FSDP2's process group) closes with the update
        torch.distributed.destroy_process_group()
    return dict(figures, finite=finite, seconds=seconds, flops=flops, micro_batches=shapes,
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
    elif command == "requirements":  # requirements SITE: gpu_check.sh, once the carried wheels are installed
        missing = unmet_requirements(sys.argv[2])
        if missing:
            sys.exit(f"gpu_check: the carried wheels need what this machine lacks: {'; '.join(missing)}; carry those "
                     f"wheels too (benchmarks/gpu_wheels.sh's WHEELS)")
    elif command in ("update", "generate"):  # update|generate REPORT SPEC_JSON
        figures = (one_update if command == "update" else generate_speed)(json.loads(sys.argv[3]))
        with open(sys.argv[2], "w") as handle:
            json.dump(figures, handle)
    else:
        sys.exit(__doc__)
