"""PPO with a learned critic (Schulman et al. 2017), as SP3O's released `ppo` preset; verl's PPO: see the flags.
A file of the ppo.py family (ppo, sp3o, tppo, sppo): `diff ppo.py <file>` shows what a method changes.

Per rollout: G samples per prompt; reward R at the last response token (1 for a correct final answer
by common.score, else 0; a truncated response scores 0). A critic (a copy of the base model with a scalar head) reads
V(s_t) at the token before y_t; GAE(gamma, lambda) gives advantages, not whitened, and returns G_t = A_t + V_t.
The first 20 rollouts train the critic alone; then the policy takes PPO-clip steps, the critic clipped-value-loss
steps on every valid token, each loss a mean per sample, then over samples. gamma = lambda = 1: A_t = R - V(s_t).

Usage: `python <this file>` runs the built-in CPU demo; `--model Qwen3-4B-Base` a real run on the data in Args.
"""
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

import common
import infra.cli
import infra.dist
import infra.engine
import infra.evaluate
import infra.probes
import infra.run


@dataclass
class Args(infra.cli.RunArgs):
    """PPO's knobs: SP3O's released `ppo` preset. (NAME: value) names a source (docs/methods.md has the table)."""
    dataset: str = "zhuzilin/dapo-math-17k"  # training set (SP3O: zhuzilin/dapo-math-17k; slime's DAPO-Math-17k)
    answer_format: Literal["auto", "boxed", "answer-line"] = "boxed"  # reward (SP3O/SPPO: boxed; the last \boxed{})
    # held-out sets (SP3O: "HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026", "math-ai/amc23",
    # "HuggingFaceH4/MATH-500", "math-ai/minervamath"; the six of its eval.example.yaml, by hub ids)
    eval_datasets: tuple[str, ...] = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026",
                                      "math-ai/amc23", "HuggingFaceH4/MATH-500", "math-ai/minervamath")
    prompts_per_step: int = 64  # prompts per rollout (SP3O/TPPO: 64)
    samples_per_prompt: int = 8  # G, samples per prompt (SP3O: 8)
    critic_model: str = ""  # critic backbone (default: the policy's base model; a smaller one works too)
    max_response_tokens: int = 8192  # response length limit; truncated responses score 0 (SP3O/TPPO/SPPO: 8192)
    temperature: float = 1.0  # rollout sampling temperature (SP3O/TPPO: 1.0)
    top_p: float = 1.0  # rollout nucleus sampling, off at 1.0 (SP3O/SPPO: 1.0)
    lr: float = 1e-6  # policy learning rate (SP3O/TPPO/SPPO: 1e-6)
    critic_lr: float = 4e-6  # critic learning rate (SP3O: 4e-6; verl: 1e-5)
    weight_decay: float = 0.1  # AdamW weight decay (SP3O/SPPO: 0.1; verl: 0.01)
    adam_betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (SP3O: 0.9, 0.98; verl: 0.9, 0.999)
    mini_batches: int = 2  # optimizer steps per rollout per epoch (SP3O/TPPO: 2)
    epochs: int = 1  # passes over each rollout (SP3O/SPPO/verl: 1)
    critic_epochs: int = 0  # critic passes over each rollout (0: --epochs, as SP3O, SPPO and verl's critic.ppo_epochs)
    grad_clip: float = 1.0  # max global gradient norm (SP3O/SPPO/verl: 1.0)
    truncated_is: Literal["auto", "on", "off"] = "auto"  # correct the engine/trainer mismatch (auto: on with vLLM)
    tis_cap: float = 2.0  # cap of the truncated importance weights (SP3O: 2.0)
    clip_low: float = 0.2  # PPO clip epsilon below 1 (SP3O/SPPO/verl: 0.2)
    clip_high: float = 0.2  # PPO clip epsilon above 1 (SP3O/SPPO/verl: 0.2; DAPO's clip-higher: 0.28)
    value_clip: float = 0.2  # critic loss clip around the rollout's values (SP3O: 0.2; verl: 0.5)
    gamma: float = 1.0  # GAE discount (SP3O/verl: 1.0)
    lam_actor: float = 1.0  # GAE lambda of the policy's advantages (SP3O: 1.0; VC-PPO/VAPO decouple it, e.g. 0.95)
    lam_critic: float = 1.0  # GAE lambda of the critic's returns (SP3O/verl: 1.0)
    whiten_advantages: bool = False  # normalize advantages over the batch's valid tokens (SP3O: off; verl: on)
    critic_warmup: int = 20  # first N rollouts train only the critic, densely; the actor waits (SP3O: 20; verl: 0)
    probe_every: int = 0  # critic diagnostics every N steps: critic vs Monte Carlo values on held-out prompts (0: off)
    probe_prompts: int = 16  # held-out prompts per probe, one sampled response each
    probe_continuations: int = 8  # K, Monte Carlo continuations per probed state (see infra.probes.probe_critic)
    # actor and critic loss (SP3O: seq-mean; slime's default reduction): the mean of each sample's token mean
    aggregation: Literal["token-mean", "seq-mean", "sum-max-len"] = "seq-mean"
    kl_coef: float = 0.0  # beta of the k3 KL to a frozen reference, 0: none loaded (SP3O/SPPO/verl: 0.0)


# The CPU demo: the settings shared by the six files (infra.cli.CONTROLLED_TINY_PRESET: rollouts of 512 samples,
# lr 3e-5, 2 optimizer steps per rollout, ...), then the method's own, below.
TINY_PRESET = dict(critic_warmup=5)  # the demo: infra.cli.CONTROLLED_TINY_PRESET; the released warm-up, 20 of 500
# --preset smollm2: infra.cli.CONTROLLED_SMOLLM2_PRESET, then the method's own (docs/real_model.md).
SMOLLM2_PRESET = dict(critic_warmup=2)  # the critic alone for 2 of 12 rollouts (the demo: 5 of 30)
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp, in the policy loss and the KL (verl: 20)


def gae(rewards, values, mask, gamma=1.0, lam=1.0):
    """Generalized advantage estimation (Schulman et al. 2016) on [B, T] tensors, responses right-padded:
    delta_t = r_t + gamma V_{t+1} - V_t (no value after the last valid token), A_t = sum_k (gamma lam)^k delta_{t+k}.
    Returns (advantages, returns = A + V), zero on padding. With gamma = lam = 1, A_t = R - V_t."""
    mask = mask.float()
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        next_mask = mask[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        next_value = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * next_mask * running
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def whiten(values, mask, eps=1e-8):
    """(x - mean) / std over the valid tokens (verl's masked_whiten); padding stays 0."""
    mean, std = infra.dist.mean_std(values[mask])  # over the valid tokens of every rank; one token: std 0
    return (values - mean) / (std + eps) * mask


def terminal_rewards(rewards, mask):
    """[B, T] token rewards: R on each response's last valid token, 0 elsewhere."""
    token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    last = (mask.sum(1) - 1).clamp(min=0)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last] = rewards.to(mask.device) * mask.any(1)
    return token_rewards


def aggregate(token_losses, mask, aggregation, num_sequences=None, num_tokens=None, max_length=None):
    """Reduce [B, T] per-token losses. token-mean: sum / valid tokens; seq-mean: mean over sequences of each
    sequence's token mean; sum-max-len: sum / (sequences * max_length) (Dr. GRPO). A micro-batch passes the
    mini-batch's counts, so the micro-batch losses add up to the mini-batch loss for any split."""
    mask = mask.float()
    num_sequences = num_sequences or mask.shape[0]
    if aggregation == "token-mean":
        return (token_losses * mask).sum() / (num_tokens or mask.sum().item() or 1)
    if aggregation == "seq-mean":
        return ((token_losses * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    if aggregation == "sum-max-len":
        return (token_losses * mask).sum() / (num_sequences * (max_length or mask.shape[1]))
    raise ValueError(f"unknown aggregation {aggregation!r}")


def policy_loss(logprobs, old_logprobs, advantages, mask, clip_low=0.2, clip_high=0.2, aggregation="token-mean",
                **counts):
    """PPO-clip (Schulman et al. 2017) per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = exp(logprobs - old_logprobs), the log-ratio clamped to +-MAX_LOG_RATIO; reduced by `aggregate`. Returns
    (loss, clip_fraction)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = aggregate(torch.maximum(unclipped, clipped), mask, aggregation, **counts)
    clip_fraction = ((clipped > unclipped) & mask).sum() / mask.sum().clamp(min=1)
    return loss, clip_fraction


def truncated_importance_weights(trainer_logprobs, engine_logprobs, mask, cap=2.0):
    """Truncated importance sampling (Yao et al. 2025, as verl's rollout-IS): w_t = min(pi_trainer(y_t) /
    pi_engine(y_t), cap) per token, 0 on padding. The rollout engine (vLLM) samples from a slightly different
    distribution than the trainer computes; multiplying A_t by w_t > 0 equals multiplying the PPO-clip token loss by
    it, clipping included."""
    return torch.exp(trainer_logprobs - engine_logprobs).clamp(max=cap) * mask


def k3_kl(logprobs, reference_logprobs):
    """Per-token k3 estimator of KL(pi || ref): exp(d) - d - 1, d = ref - logp clamped to +-MAX_LOG_RATIO
    (Schulman, 2020); >= 0."""
    log_ratio = (reference_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1


def value_loss(values, old_values, returns, weights, clip=0.2, **counts):
    """Clipped value loss: max((v - G)^2, (v_clip - G)^2), v_clip = v_old + clip(v - v_old, -clip, clip), reduced as
    sum(weights * loss) / num_tokens. Dense: each valid token of sample i weighs 1 / n_i (seq-mean) or 1."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    losses = torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)
    return aggregate(losses, weights, "token-mean", **counts)


def check_args(args):
    rollout_size = args.prompts_per_step * args.samples_per_prompt
    mini_batch_size = rollout_size // args.mini_batches
    if rollout_size % args.mini_batches or not mini_batch_size \
            or mini_batch_size % min(args.micro_batch_size, mini_batch_size):
        raise infra.UserError(f"a rollout of {rollout_size} samples does not split into {args.mini_batches} "
                               f"mini-batches of whole micro-batches of {args.micro_batch_size}")


def main():
    args = infra.cli.parse_args(Args, TINY_PRESET, smollm2_preset=SMOLLM2_PRESET)
    check_args(args)
    run = infra.run.Run(args, __file__)  # device, run folder, data: bad input fails here, before any model loads
    policy, tokenizer = common.load_model(args.model, args.dtype, run.device, args.trust_remote_code,
                                          gradient_checkpointing=args.gradient_checkpointing)
    reference = None
    if args.kl_coef > 0:
        reference = common.load_model(args.model, args.dtype, run.device, args.trust_remote_code)[0]
        reference.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    critic = common.load_model(args.critic_model or args.model, args.dtype, run.device, args.trust_remote_code,
                               value_head=1, gradient_checkpointing=args.gradient_checkpointing)[0]
    critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, betas=args.adam_betas,
                                         weight_decay=args.weight_decay)
    models, optimizers = {"policy": policy, "critic": critic}, {"policy": optimizer, "critic": critic_optimizer}
    generator = run.start(models, optimizers, tokenizer)  # logs, --resume's checkpoint, the rollout engine
    if args.eval_only:  # evaluate and exit, through the same code as the evaluations during training
        return run.evaluate_only()
    truncated_is = args.truncated_is == "on" or (args.truncated_is == "auto" and generator.engine == "vllm")
    engine_old_logprobs = infra.engine.reuse_engine_logprobs(args.old_logprobs, generator, policy, args.top_p)
    for step, metrics in run.steps():  # metrics starts with the held-out evaluation when one is due
        history = defaultdict(list)
        if args.probe_every and step % args.probe_every == 0:  # critic vs Monte Carlo values (SP3O, TPPO diagnostics)
            metrics.update(infra.probes.probe_critic(generator, tokenizer, run.probe_rows,
                lambda micro: common.critic_outputs(critic, micro), args,
                critic, run.device))
        # 1. Rollout: G samples for each prompt.
        step_start = time.time()
        rows = run.training_rows(step)  # this rank's prompts
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
        completions = generator.generate(prompts, args.samples_per_prompt, args.max_response_tokens,
                                         args.temperature, args.top_p)
        # 2. Reward: 1 for a correct final answer, 0 otherwise and for a truncated response.
        rewards = torch.tensor([common.score(c.text, rows[c.prompt_index])
                                if c.finish_reason == "stop" else 0.0 for c in completions], device=run.device)
        batch = common.sequence_batch([prompts[c.prompt_index] for c in completions],
                                      [c.token_ids for c in completions], tokenizer.pad_token_id).to(run.device)
        mask = batch.response_mask
        rollout_seconds = time.time() - step_start
        generator.sleep()  # vLLM frees the GPU for the trainer's passes and the update (HF: nothing to free)
        # 3. Old log-probs: the engine's where they are the trainer's own (--old-logprobs), else recomputed; the
        # reference's; advantages.
        if engine_old_logprobs:  # the same model and numbers up to float noise: no second forward pass
            old_logprobs = common.engine_logprobs(completions, mask.shape[1]).to(run.device)
        else:
            old_logprobs = common.batched(lambda micro: common.response_logprobs(policy, micro, args.temperature),
                                          batch, args.micro_batch_size, args.micro_batch_tokens)
        if reference is not None:
            reference_logprobs = common.batched(
                lambda micro: common.response_logprobs(reference, micro, args.temperature),
                batch, args.micro_batch_size, args.micro_batch_tokens)
        old_values = common.batched(lambda micro: common.critic_outputs(critic, micro), batch, args.micro_batch_size,
                                    args.micro_batch_tokens)
        token_rewards = terminal_rewards(rewards, mask)
        token_advantages, returns = gae(token_rewards, old_values, mask, args.gamma, args.lam_actor)
        if args.lam_critic != args.lam_actor:  # decoupled lambdas (VC-PPO): the critic's returns need their own pass
            returns = gae(token_rewards, old_values, mask, args.gamma, args.lam_critic)[1]
        metrics["explained_variance"] = infra.probes.explained_variance(old_values, returns, mask)
        if args.whiten_advantages:
            token_advantages = whiten(token_advantages, mask)
        actor_frozen = step < args.critic_warmup  # critic warm-up: the actor waits
        critic_weights = mask / (mask.sum(1, True).clamp(min=1) if args.aggregation == "seq-mean" else 1)  # dense loss
        if truncated_is:  # A_t times min(pi_trainer / pi_engine, cap): the engine sampled the rollout
            token_advantages = token_advantages * truncated_importance_weights(
                old_logprobs, common.engine_logprobs(completions, mask.shape[1]).to(run.device), mask, args.tis_cap)
        # 4. Update: `mini_batches` optimizer steps per epoch, gradients accumulated over micro-batches; the actor
        # takes `epochs` passes (none in the warm-up), the critic `critic_epochs`.
        update_start = time.time()
        critic_epochs = args.critic_epochs or args.epochs
        for epoch in range(max(args.epochs, critic_epochs)):
            train_actor, train_critic = epoch < args.epochs and not actor_frozen, epoch < critic_epochs
            order = torch.randperm(len(completions)).tolist()
            for mini_batch in common.chunks(order, len(order) // args.mini_batches):
                counts = dict(num_sequences=len(mini_batch), num_tokens=infra.dist.rank_mean(mask[mini_batch].sum()),
                              max_length=args.max_response_tokens)
                critic_tokens = infra.dist.rank_mean(critic_weights[mini_batch].sum())
                mini_batch_loss = mini_batch_value_loss = 0.0
                for micro in common.micro_batches(mini_batch, batch.lengths(), args.micro_batch_size,
                                                  args.micro_batch_tokens):
                    micro_batch = batch.select(micro)
                    micro_mask, width = micro_batch.response_mask, micro_batch.response_width
                    if train_critic:
                        values = common.critic_outputs(critic, micro_batch)
                        critic_loss = value_loss(values, old_values[micro, :width], returns[micro, :width],
                                                 critic_weights[micro, :width], args.value_clip,
                                                 num_tokens=critic_tokens)
                        critic_loss.backward()
                        mini_batch_value_loss += critic_loss.item()
                    if train_actor:
                        logprobs = common.response_logprobs(policy, micro_batch, args.temperature)
                        loss, clip_fraction = policy_loss(
                            logprobs, old_logprobs[micro, :width], token_advantages[micro, :width], micro_mask,
                            args.clip_low, args.clip_high, args.aggregation, **counts)
                        if reference is not None:
                            kl = k3_kl(logprobs, reference_logprobs[micro, :width])
                            loss = loss + args.kl_coef * aggregate(kl, micro_mask, args.aggregation, **counts)
                        loss.backward()
                        mini_batch_loss += loss.item()
                        history["clip_fraction"].append(clip_fraction.item())
                        kl = k3_kl(old_logprobs[micro, :width], logprobs.detach())
                        history["approx_kl"].append(kl[micro_mask].mean().item())
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                critic_grad_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.grad_clip)
                finite = run.update_ok(step, grad_norm, critic_grad_norm)  # too many skips in a row: save, stop
                if finite:  # a non-finite gradient skips the step, weights untouched
                    critic_optimizer.step()  # separate models: the order does not matter (verl: critic first)
                    optimizer.step()
                history["skipped_updates"].append(float(not finite))
                optimizer.zero_grad(set_to_none=True)
                critic_optimizer.zero_grad(set_to_none=True)
                if train_actor:
                    history["policy_loss"].append(mini_batch_loss)
                    history["grad_norm"].append(grad_norm.item())
                if train_critic:
                    history["value_loss"].append(mini_batch_value_loss)
                    history["critic_grad_norm"].append(critic_grad_norm.item())
        generator.sync_weights(policy)
        update_seconds = time.time() - update_start
        # 5. Log; evaluate after the last update; checkpoint.
        response_tokens = int(mask.sum())
        metrics.update({key: sum(values) / len(values) for key, values in history.items()}, actor_frozen=actor_frozen)
        metrics.update(infra.evaluate.rollout_metrics(completions, rewards, old_logprobs, mask),
                       rollout_s=rollout_seconds, update_s=update_seconds,
                       tokens_per_s=response_tokens / (rollout_seconds + update_seconds))
        run.end_step(step, metrics)  # evaluation after the last update, log line, checkpoint; Ctrl-C stops here


if __name__ == "__main__":
    infra.run.run_main(main)
