"""PRIME: process rewards from an implicit PRM trained online (Cui et al. 2025, arXiv 2502.01456; code PRIME-RL/PRIME
and verl's recipe/prime). Derived from grpo.py: `diff grpo.py prime.py` shows what PRIME changes.

Per rollout: G samples per prompt, R = 1 for a correct final answer (common.score), else 0 (and for a cut response);
an online filter keeps prompts whose group accuracy is in [0.2, 0.8] first. The implicit PRM pi_phi, a copy of the
starting policy, gives each token r_t = beta log(pi_phi(y_t) / pi_ref(y_t)) against the frozen start pi_ref; it takes
cross-entropy steps of sigmoid(sum_t r_t) against R, then scores the rollout. Outcome and token rewards are each made
leave-one-out in the prompt's group, weighted, summed from each token to the end, whitened: PPO-clip's advantages.

Usage: `python <this file>` runs the built-in CPU demo; `--model Qwen3-4B-Base` a real run on the data in Args.
"""
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

import common
import infra.cli
import infra.dist
import infra.engine
import infra.evaluate
import infra.probes
import infra.run


@dataclass
class Args(infra.cli.RunArgs):
    """PRIME's knobs: verl's recipe/prime, else grpo.py's. (NAME: value) names a source (docs/methods.md)."""
    dataset: str = "zhuzilin/dapo-math-17k"  # training set (SP3O: zhuzilin/dapo-math-17k; slime's DAPO-Math-17k)
    answer_format: Literal["auto", "boxed", "answer-line"] = "boxed"  # reward (SP3O/SPPO: boxed; the last \boxed{})
    # held-out sets (SP3O: "HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026", "math-ai/amc23",
    # "HuggingFaceH4/MATH-500", "math-ai/minervamath"; the six of its eval.example.yaml, by hub ids)
    eval_datasets: tuple[str, ...] = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026",
                                      "math-ai/amc23", "HuggingFaceH4/MATH-500", "math-ai/minervamath")
    prompts_per_step: int = 64  # prompts per rollout, after the filter (PRIME: 64)
    samples_per_prompt: int = 4  # G, samples per prompt (PRIME: 4)
    oversample: int = 4  # prompts sampled per rollout, x prompts_per_step, of which the filter keeps those (PRIME: 4)
    # the filter passes a prompt whose group accuracy is in [low, high], none of its responses cut (PRIME: 0.2, 0.8)
    accuracy_bounds: tuple[float, float] = (0.2, 0.8)
    max_response_tokens: int = 3072  # response length limit; truncated responses score 0 (PRIME: 3072)
    temperature: float = 1.0  # rollout sampling temperature (SP3O: 1.0)
    top_p: float = 1.0  # rollout nucleus sampling, off at 1.0 (SP3O/SPO: 1.0)
    lr: float = 5e-7  # policy learning rate (PRIME: 5e-7)
    prm_lr: float = 1e-6  # implicit PRM learning rate (PRIME: 1e-6)
    weight_decay: float = 0.01  # AdamW weight decay of the policy (verl: 0.01)
    prm_weight_decay: float = 0.0  # AdamW weight decay of the implicit PRM (PRIME: 0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas, both models (verl: 0.9, 0.999)
    mini_batches: int = 1  # optimizer steps per rollout per epoch (PRIME: 1; mini-batches of 64 prompts)
    prm_mini_batches: int = 4  # implicit PRM optimizer steps per rollout (PRIME: 4; mini-batches of 64 samples)
    epochs: int = 1  # passes over each rollout (SP3O: 1)
    grad_clip: float = 1.0  # max global gradient norm (SP3O/SPO: 1.0)
    prm_grad_clip: float = 10.0  # max global gradient norm of the implicit PRM (PRIME: 10.0)
    truncated_is: Literal["auto", "on", "off"] = "auto"  # correct the engine/trainer mismatch (auto: on with vLLM)
    tis_cap: float = 2.0  # cap of the truncated importance weights (SP3O: 2.0)
    clip_low: float = 0.2  # PPO clip epsilon below 1 (SP3O/SPO: 0.2)
    clip_high: float = 0.2  # PPO clip epsilon above 1 (SP3O/SPO: 0.2; DAPO's clip-higher: 0.28)
    aggregation: Literal["token-mean", "seq-mean", "sum-max-len"] = "token-mean"  # loss reduction (verl: token-mean)
    beta: float = 0.05  # beta of the implicit reward beta log(pi_phi / pi_ref), in the PRM's loss (PRIME: 0.05)
    # score the rollout with the PRM updated on it, or in the update's forward passes (PRIME: before; PRIME-RL's: after)
    prm_update: Literal["before", "after"] = "before"
    outcome_coef: float = 5.0  # weight of the outcome's leave-one-out rewards (PRIME: 5.0)
    process_coef: float = 5.0  # weight of the implicit process rewards, 0: RLOO on the outcome alone (PRIME: 5.0)
    whiten_advantages: bool = True  # normalize the returns over the batch's valid tokens (PRIME: on)
    kl_coef: float = 0.0  # beta of the k3 KL to the frozen reference (PRIME: 0.0)
    # the PPO ratio per token, per response (GSPO's s_i: the geometric mean of its tokens' ratios) or GSPO-token (s_i's
    # value, each token's own gradient) (SP3O: token)
    importance_level: Literal["token", "sequence", "sequence-token"] = "token"
    gspo_clip_low: float = 3e-4  # clip epsilon below 1 of the sequence ratio, for those two levels (GSPO: 3e-4)
    gspo_clip_high: float = 4e-4  # clip epsilon above 1 of the sequence ratio (GSPO: 4e-4)


# The CPU demo: the settings shared by the six files (infra.cli.CONTROLLED_TINY_PRESET: rollouts of 512 samples,
# lr 3e-5, 2 optimizer steps per rollout, ...), then the method's own, below.
# PRIME's own: whitened returns, the PRM's lr twice the policy's (1e-6 to 5e-7); no filter (a data choice, held equal)
TINY_PRESET = dict(whiten_advantages=True, prm_lr=6e-5, oversample=1)  # the demo: infra.cli.CONTROLLED_TINY_PRESET
# --preset smollm2: infra.cli.CONTROLLED_SMOLLM2_PRESET, then the method's own (docs/real_model.md).
SMOLLM2_PRESET = dict(whiten_advantages=True, prm_lr=4e-5, oversample=1)
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp, in the policy loss and the KL (verl: 20)


def implicit_rewards(prm_logprobs, reference_logprobs, mask, beta=0.05, normalize=True):
    """PRIME eq. 3: r_t = beta log(pi_phi(y_t | y_<t) / pi_ref(y_t | y_<t)), 0 on padding; normalize: over the batch's
    largest |sum from a token to the end| (the released prime_norm "batch_norm", which cancels beta)."""
    rewards = beta * (prm_logprobs - reference_logprobs) * mask
    if normalize:  # over every rank's rollout
        rewards = rewards / (infra.dist.gather_all(rewards.flip(1).cumsum(1).abs().amax().view(1)).max() + 1e-6)
    return rewards


def prm_loss(log_ratio, mask, labels, beta=0.05, num_sequences=None):
    """PRIME eq. 4 as released (compute_ce_dpo_loss_rm): the cross-entropy of sigmoid(beta sum_t log pi_phi/pi_ref)
    against R, summed over the sequences / num_sequences (a micro-batch passes its mini-batch's count)."""
    logits = beta * (log_ratio * mask).sum(1)
    return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum") / (num_sequences or len(labels))


def leave_one_out(token_rewards, reward_mask, group_size):
    """The released masked_rloo over groups of n consecutive samples: r_t n/(n-1) - sum_j m_j / (n-1) where reward_mask
    is set, m_j sample j's mean reward there. That is r_t - the others' mean m_j (eq. 5's baseline; for one reward a
    response, R_i - the others' mean R) + (r_t - m_i)/(n-1), which sums to 0 over a response (not in eq. 5)."""
    if group_size < 2:
        raise ValueError(f"a leave-one-out group needs at least 2 samples, got group_size={group_size}")
    reward_mask = reward_mask.float()
    means = (token_rewards * reward_mask).sum(1) / reward_mask.sum(1).clamp(min=1)
    baseline = means.view(-1, group_size).sum(1).repeat_interleave(group_size) / (group_size - 1)
    return (token_rewards * group_size / (group_size - 1) - baseline[:, None]) * reward_mask


def prime_returns(rewards, process_rewards, mask, group_size, outcome_coef=5.0, process_coef=5.0):
    """PRIME eq. 5 as released (compute_rloo_advantage_return, gamma 1): the return at t is outcome_coef x R's
    leave-one-out (on the last token: the same from every t) + process_coef x the leave-one-out r_t summed from t on."""
    outcome = leave_one_out(rewards[:, None].float(), torch.ones_like(rewards[:, None]), group_size)
    process = leave_one_out(process_rewards, mask, group_size).flip(1).cumsum(1).flip(1)
    return (outcome_coef * outcome + process_coef * process) * mask


def accuracy_filter(rewards, truncated, group_size, keep, bounds=(0.2, 0.8)):
    """PRIME's online filter (verl recipe's filter_and_downsample): the indices of the samples of `keep` prompts, first
    those whose group's accuracy is within `bounds` and none of whose responses was cut, then the others, in order."""
    accuracy = rewards.view(-1, group_size).mean(1)
    passed = (accuracy >= bounds[0]) & (accuracy <= bounds[1]) & ~truncated.view(-1, group_size).any(1)
    groups = torch.argsort((~passed).int(), stable=True)[:keep]
    return (groups[:, None] * group_size + torch.arange(group_size, device=groups.device)).reshape(-1)


def whiten(values, mask, eps=1e-8):
    """(x - mean) / std over the valid tokens (verl's masked_whiten); padding stays 0."""
    mean, std = infra.dist.mean_std(values[mask])  # over the valid tokens of every rank; one token: std 0
    return (values - mean) / (std + eps) * mask


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


def sequence_log_ratio(logprobs, old_logprobs, mask, level="sequence"):
    """GSPO (arXiv 2507.18071) eq. 7: log s_i = (1/|y_i|) sum_t log(pi(y_t) / pi_old(y_t)), one value for every token of
    response i (its gradient spread over them: d log s_i / d log pi(y_t) = 1/|y_i|); "sequence-token" (eq. 13):
    sg[log s_i] + log pi(y_t) - sg[log pi(y_t)], the same value with each token's own gradient. [B, T], 0 on padding:
    policy_loss(this, 0, ...) clips s_i per response, as verl's compute_policy_loss_gspo does."""
    mask = mask.float()
    log_ratio = ((logprobs - old_logprobs) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    if level == "sequence-token":
        return (log_ratio.detach() + logprobs - logprobs.detach()) * mask
    return log_ratio.expand_as(logprobs) * mask


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


def check_args(args):
    if args.samples_per_prompt < 2:
        raise infra.UserError("--samples-per-prompt must be at least 2: PRIME's baselines leave one sample out")
    rollout_size = args.prompts_per_step * args.samples_per_prompt
    mini_batch_size = rollout_size // args.mini_batches
    if rollout_size % args.mini_batches or not mini_batch_size \
            or mini_batch_size % min(args.micro_batch_size, mini_batch_size):
        raise infra.UserError(f"a rollout of {rollout_size} samples does not split into {args.mini_batches} "
                               f"mini-batches of whole micro-batches of {args.micro_batch_size}")
    if rollout_size % args.prm_mini_batches:
        raise infra.UserError(f"a rollout of {rollout_size} samples does not split into {args.prm_mini_batches} "
                              "--prm-mini-batches")


def main():
    args = infra.cli.parse_args(Args, TINY_PRESET, smollm2_preset=SMOLLM2_PRESET)
    check_args(args)
    run = infra.run.Run(args, __file__)  # device, run folder, data: bad input fails here, before any model loads
    policy, tokenizer = common.load_model(args.model, args.dtype, run.device, args.trust_remote_code,
                                          gradient_checkpointing=args.gradient_checkpointing)
    prm = common.load_model(args.model, args.dtype, run.device, args.trust_remote_code,  # the implicit PRM pi_phi:
                            gradient_checkpointing=args.gradient_checkpointing)[0]  # the policy's start, trained
    reference = common.load_model(args.model, args.dtype, run.device, args.trust_remote_code)[0]  # pi_ref: the
    reference.requires_grad_(False)  # policy's start, frozen (the PRM's reference, and the KL's)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=args.adam_betas,
                                  weight_decay=args.weight_decay)
    prm_optimizer = torch.optim.AdamW(prm.parameters(), lr=args.prm_lr, betas=args.adam_betas,
                                      weight_decay=args.prm_weight_decay)
    models, optimizers = {"policy": policy, "prm": prm}, {"policy": optimizer, "prm": prm_optimizer}
    generator = run.start(models, optimizers, tokenizer)  # logs, --resume's checkpoint, the rollout engine
    if args.eval_only:  # evaluate and exit, through the same code as the evaluations during training
        return run.evaluate_only()
    truncated_is = args.truncated_is == "on" or (args.truncated_is == "auto" and generator.engine == "vllm")
    engine_old_logprobs = infra.engine.reuse_engine_logprobs(args.old_logprobs, generator, policy, args.top_p)
    for step, metrics in run.steps():  # metrics starts with the held-out evaluation when one is due
        history = defaultdict(list)
        # 1. Rollout: G samples for each prompt.
        step_start = time.time()
        rows = run.training_rows(step)  # this rank's prompts: --oversample x its share of --prompts-per-step
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
        completions = generator.generate(prompts, args.samples_per_prompt, args.max_response_tokens,
                                         args.temperature, args.top_p)
        # 2. Reward: 1 for a correct final answer, 0 otherwise and for a truncated response.
        rewards = torch.tensor([common.score(c.text, rows[c.prompt_index])
                                if c.finish_reason == "stop" else 0.0 for c in completions], device=run.device)
        # The online filter: prompts_per_step prompts kept, first those whose group accuracy is within --accuracy-bounds
        # and with no response cut (with --oversample 1 all of them).
        metrics["accuracy_before_filter"] = rewards.mean().item()
        cut = torch.tensor([c.finish_reason != "stop" for c in completions], device=run.device)
        kept = accuracy_filter(rewards, cut, args.samples_per_prompt, len(rows) // args.oversample,
                               args.accuracy_bounds)
        completions, rewards = [completions[i] for i in kept.tolist()], rewards[kept]
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
        if args.kl_coef > 0:
            reference_logprobs = common.batched(
                lambda micro: common.response_logprobs(reference, micro, args.temperature),
                batch, args.micro_batch_size, args.micro_batch_tokens)
        # The implicit PRM (temperature 1, as released): `prm_mini_batches` steps on the outcome labels (eq. 4), then
        # its token rewards (eq. 3) from the updated PRM (--prm-update before) or from those steps' forward passes.
        prm_start = time.time()
        prm_reference = common.batched(lambda micro: common.response_logprobs(reference, micro), batch,
                                       args.micro_batch_size, args.micro_batch_tokens)
        prm_logprobs = torch.zeros_like(prm_reference)
        for mini_batch in common.chunks(list(range(len(completions))), len(completions) // args.prm_mini_batches):
            for micro in common.micro_batches(mini_batch, batch.lengths(), args.micro_batch_size,
                                              args.micro_batch_tokens):
                micro_batch = batch.select(micro)
                logprobs = common.response_logprobs(prm, micro_batch)
                prm_logprobs[micro, :micro_batch.response_width] = logprobs.detach()
                loss = prm_loss(logprobs - prm_reference[micro, :micro_batch.response_width], micro_batch.response_mask,
                                rewards[micro], args.beta, len(mini_batch))
                loss.backward()
                history["prm_loss"].append(loss.item() * len(mini_batch) / len(micro))
            prm_grad_norm = torch.nn.utils.clip_grad_norm_(prm.parameters(), args.prm_grad_clip)
            if run.update_ok(step, prm_grad_norm):  # a non-finite gradient skips the step
                prm_optimizer.step()
            prm_optimizer.zero_grad(set_to_none=True)
            history["prm_grad_norm"].append(prm_grad_norm.item())
        if args.prm_update == "before":  # the rollout scored by the PRM just updated: a second forward pass
            prm_logprobs = common.batched(lambda micro: common.response_logprobs(prm, micro), batch,
                                          args.micro_batch_size, args.micro_batch_tokens)
        process_rewards = implicit_rewards(prm_logprobs, prm_reference, mask, args.beta)
        prm_seconds = time.time() - prm_start
        returns = prime_returns(rewards, process_rewards, mask, args.samples_per_prompt, args.outcome_coef,
                                args.process_coef)
        token_advantages = whiten(returns, mask) if args.whiten_advantages else returns
        if truncated_is:  # A_t times min(pi_trainer / pi_engine, cap): the engine sampled the rollout
            token_advantages = token_advantages * truncated_importance_weights(
                old_logprobs, common.engine_logprobs(completions, mask.shape[1]).to(run.device), mask, args.tis_cap)
        # 4. Update: `mini_batches` optimizer steps per epoch, gradients accumulated over micro-batches.
        update_start = time.time()
        for _ in range(args.epochs):
            order = torch.randperm(len(completions)).tolist()
            for mini_batch in common.chunks(order, len(order) // args.mini_batches):
                counts = dict(num_sequences=len(mini_batch), num_tokens=infra.dist.rank_mean(mask[mini_batch].sum()),
                              max_length=args.max_response_tokens)
                mini_batch_loss = 0.0
                for micro in common.micro_batches(mini_batch, batch.lengths(), args.micro_batch_size,
                                                  args.micro_batch_tokens):
                    micro_batch = batch.select(micro)
                    micro_mask, width = micro_batch.response_mask, micro_batch.response_width
                    logprobs = common.response_logprobs(policy, micro_batch, args.temperature)
                    new, old, clip = logprobs, old_logprobs[micro, :width], (args.clip_low, args.clip_high)
                    if args.importance_level != "token":  # GSPO: log s_i on every token of response i, against 0,
                        new = sequence_log_ratio(new, old, micro_mask, args.importance_level)
                        old, clip = torch.zeros_like(old), (args.gspo_clip_low, args.gspo_clip_high)  # its own ranges
                    loss, clip_fraction = policy_loss(new, old, token_advantages[micro, :width], micro_mask, *clip,
                                                      args.aggregation, **counts)
                    if args.kl_coef > 0:
                        kl = k3_kl(logprobs, reference_logprobs[micro, :width])
                        loss = loss + args.kl_coef * aggregate(kl, micro_mask, args.aggregation, **counts)
                    loss.backward()
                    mini_batch_loss += loss.item()
                    history["clip_fraction"].append(clip_fraction.item())
                    kl = k3_kl(old_logprobs[micro, :width], logprobs.detach())
                    history["approx_kl"].append(kl[micro_mask].mean().item())
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
                finite = run.update_ok(step, grad_norm)  # too many skips in a row: save, stop
                if finite:  # a non-finite gradient skips the step, weights untouched
                    optimizer.step()
                history["skipped_updates"].append(float(not finite))
                optimizer.zero_grad(set_to_none=True)
                history["policy_loss"].append(mini_batch_loss)
                history["grad_norm"].append(grad_norm.item())
        generator.sync_weights(policy)
        update_seconds = time.time() - update_start
        # 5. Log; evaluate after the last update; checkpoint.
        response_tokens = int(mask.sum())
        metrics.update({key: sum(values) / len(values) for key, values in history.items()})
        metrics.update(infra.evaluate.rollout_metrics(completions, rewards, old_logprobs, mask),
                       rollout_s=rollout_seconds, prm_s=prm_seconds, update_s=update_seconds,
                       tokens_per_s=response_tokens / (rollout_seconds + prm_seconds + update_seconds))
        run.end_step(step, metrics)  # evaluation after the last update, log line, checkpoint; Ctrl-C stops here


if __name__ == "__main__":
    infra.run.run_main(main)
