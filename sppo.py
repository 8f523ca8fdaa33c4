"""SPPO: Sequence-Level PPO (arXiv 2604.08865; code sustech-nlp/SPPO, a verl fork).
A file of the ppo.py family (ppo, sp3o, tppo, sppo): `diff ppo.py <file>` shows what a method changes.

The whole response is one bandit action: one sample per prompt, no GAE, no temporal credit. A critic (a
separate model, possibly smaller) reads the prompt only; its scalar output at the last prompt token is a
logit f(x) and V(x) = sigmoid(f(x)) estimates how likely the prompt is solved. Every response token gets
A = R - V(x), not whitened; the critic takes BCEWithLogits(f(x), R) steps before the actor's step, on
values computed before the update; the policy takes token-level PPO-clip steps.

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
    """SPPO's knobs: SPPO's released 7B script. (NAME: value) names a source (docs/methods.md has the table)."""
    dataset: str = "zhuzilin/dapo-math-17k"  # training set (SP3O: zhuzilin/dapo-math-17k; slime's DAPO-Math-17k)
    answer_format: Literal["auto", "boxed", "answer-line"] = "boxed"  # reward (SP3O/SPPO: boxed; the last \boxed{})
    # held-out sets (SPPO: "HuggingFaceH4/aime_2024", "MathArena/aime_2025", "math-ai/amc23", "HuggingFaceH4/MATH-500",
    # "math-ai/minervamath"; its README's five benchmarks, by hub ids)
    eval_datasets: tuple[str, ...] = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025",
                                      "math-ai/amc23", "HuggingFaceH4/MATH-500", "math-ai/minervamath")
    prompts_per_step: int = 512  # prompts per rollout (SPPO: 512)
    samples_per_prompt: int = 1  # samples per prompt (SPPO: 1; the critic is the baseline)
    critic_model: str = ""  # critic backbone (default: the policy's base model; a smaller one works too)
    max_response_tokens: int = 8192  # response length limit; truncated responses score 0 (SP3O/TPPO/SPPO: 8192)
    temperature: float = 0.6  # rollout sampling temperature (SPPO: 0.6)
    top_p: float = 1.0  # rollout nucleus sampling, off at 1.0 (SP3O/SPPO: 1.0)
    lr: float = 1e-6  # policy learning rate (SP3O/TPPO/SPPO: 1e-6)
    critic_lr: float = 1e-5  # critic learning rate (SPPO: 1e-5; 5e-6 in its 1.5B script)
    weight_decay: float = 0.1  # AdamW weight decay (SP3O/SPPO: 0.1; verl: 0.01)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas (SPPO/verl: 0.9, 0.999)
    mini_batches: int = 16  # actor and critic optimizer steps per rollout per epoch (SPPO: 16; 32 prompts each)
    epochs: int = 1  # passes over each rollout (SP3O/SPPO/verl: 1)
    critic_epochs: int = 0  # critic passes over each rollout (0: --epochs, as SP3O, SPPO and verl's critic.ppo_epochs)
    grad_clip: float = 1.0  # max global gradient norm (SP3O/SPPO/verl: 1.0)
    truncated_is: Literal["auto", "on", "off"] = "auto"  # correct the engine/trainer mismatch (auto: on with vLLM)
    tis_cap: float = 2.0  # cap of the truncated importance weights (SP3O: 2.0)
    clip_low: float = 0.2  # PPO clip epsilon below 1 (SP3O/SPPO/verl: 0.2)
    clip_high: float = 0.2  # PPO clip epsilon above 1 (SP3O/SPPO/verl: 0.2; DAPO's clip-higher: 0.28)
    dual_clip: float = 3.0  # for A < 0 cap the token loss at -A * dual_clip, 0: off (SPPO/verl: 3.0)
    critic_warmup: int = 0  # first N rollouts train only the critic, the actor frozen (SPPO: 0)
    probe_every: int = 0  # critic diagnostics every N steps: critic vs Monte Carlo values on held-out prompts (0: off)
    probe_prompts: int = 16  # held-out prompts per probe, one sampled response each
    probe_continuations: int = 8  # K, Monte Carlo continuations per probed state (see infra.probes.probe_critic)
    aggregation: Literal["token-mean", "seq-mean", "sum-max-len"] = "token-mean"  # actor loss (SPPO/verl: token-mean)
    kl_coef: float = 0.0  # beta of the k3 KL to a frozen reference, 0: none loaded (SP3O/SPPO/verl: 0.0)


# The CPU demo: the settings shared by the six files (infra.cli.CONTROLLED_TINY_PRESET: rollouts of 512 samples,
# lr 3e-5, 2 optimizer steps per rollout, ...), then the method's own, below.
TINY_PRESET = dict(prompts_per_step=512, samples_per_prompt=1)  # the demo: infra.cli.CONTROLLED_TINY_PRESET; 512 x 1
# --preset smollm2: infra.cli.CONTROLLED_SMOLLM2_PRESET, then the method's own (docs/real_model.md).
SMOLLM2_PRESET = dict(prompts_per_step=64, samples_per_prompt=1)  # 64 x 1 (the others: 8 x 8)
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp, in the policy loss and the KL (verl: 20)


def sequence_advantages(rewards, value_logits):
    """A = R - sigmoid(f(x)) per sequence (SPPO: one bandit action), not whitened; given to every response token.
    f(x): the critic's output before this rollout's update (its steps come first in each mini-batch)."""
    return rewards - torch.sigmoid(value_logits)


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
                dual_clip=0.0, **counts):
    """PPO-clip (Schulman et al. 2017) per token: max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
    r = exp(logprobs - old_logprobs), the log-ratio clamped to +-MAX_LOG_RATIO; reduced by `aggregate`. Returns
    (loss, clip_fraction)."""
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    token_losses = torch.maximum(unclipped, clipped)
    if dual_clip > 0:  # dual-clip PPO (Ye et al. 2020, as verl): for A < 0 the loss is capped at -A * dual_clip
        token_losses = torch.where(advantages < 0, torch.minimum(token_losses, -advantages * dual_clip), token_losses)
    loss = aggregate(token_losses, mask, aggregation, **counts)
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


def value_loss(value_logits, rewards, num_sequences=None):
    """BCEWithLogits(f(x), R) summed, divided by `num_sequences` (the mini-batch's count); no value clipping (SPPO)."""
    losses = torch.nn.functional.binary_cross_entropy_with_logits(value_logits, rewards, reduction="none")
    return losses.sum() / (num_sequences or len(losses))


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
                lambda micro: torch.sigmoid(common.critic_outputs(critic, micro)), args,
                critic, run.device, prompt_only=True))  # V(x) = sigmoid(f(x))
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
        prompt_batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [[] for _ in completions],
                                             tokenizer.pad_token_id).to(run.device)  # the critic reads the prompt only
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
        old_value_logits = common.batched(lambda micro: common.critic_outputs(critic, micro), prompt_batch,
                                          args.micro_batch_size, args.micro_batch_tokens)[:, 0]  # f(x) at prompt end
        token_advantages = sequence_advantages(rewards, old_value_logits)[:, None].expand_as(old_logprobs)
        metrics["explained_variance"] = infra.probes.explained_variance(old_value_logits.sigmoid(), rewards, mask[:, 0])
        actor_frozen = step < args.critic_warmup  # critic warm-up: the actor waits
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
                mini_batch_loss = mini_batch_value_loss = 0.0
                for micro in common.micro_batches(mini_batch, batch.lengths(), args.micro_batch_size,
                                                  args.micro_batch_tokens):
                    micro_batch = batch.select(micro)
                    micro_mask, width = micro_batch.response_mask, micro_batch.response_width
                    if train_critic:
                        value_logits = common.critic_outputs(critic, prompt_batch.select(micro))[:, 0]
                        critic_loss = value_loss(value_logits, rewards[micro], len(mini_batch))
                        critic_loss.backward()  # the critic's loss and step come first (SPPO)
                        mini_batch_value_loss += critic_loss.item()
                    if train_actor:
                        logprobs = common.response_logprobs(policy, micro_batch, args.temperature)
                        loss, clip_fraction = policy_loss(
                            logprobs, old_logprobs[micro, :width], token_advantages[micro, :width], micro_mask,
                            args.clip_low, args.clip_high, args.aggregation, args.dual_clip, **counts)
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
