"""GRPO: critic-free PPO with a group baseline (DeepSeekMath, arXiv 2402.03300), with the loss options of
DAPO (clip-higher, token-mean) and Dr. GRPO (no std scaling, sum over max length), and GSPO's sequence-level ratio.

Per rollout: G samples per prompt; reward R = 1 if the final answer (common.score) matches the gold answer, else
0 (a response cut off at the length limit scores 0); every token of sample i gets the advantage
A_i = (R_i - mean of its group) / (std + eps); the policy takes PPO-clip steps on those advantages, with one ratio per
token, or with `--importance-level sequence` one per response (GSPO, arXiv 2507.18071).

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
    """GRPO's knobs: SP3O's released `grpo` preset. (NAME: value) names a source (docs/methods.md has the table)."""
    dataset: str = "zhuzilin/dapo-math-17k"  # training set (SP3O: zhuzilin/dapo-math-17k; slime's DAPO-Math-17k)
    answer_format: Literal["auto", "boxed", "answer-line"] = "boxed"  # reward (SP3O/SPPO: boxed; the last \boxed{})
    # held-out sets (SP3O: "HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026", "math-ai/amc23",
    # "HuggingFaceH4/MATH-500", "math-ai/minervamath"; the six of its eval.example.yaml, by hub ids)
    eval_datasets: tuple[str, ...] = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026",
                                      "math-ai/amc23", "HuggingFaceH4/MATH-500", "math-ai/minervamath")
    prompts_per_step: int = 64  # prompts per rollout (SP3O: 64; DAPO: 512)
    samples_per_prompt: int = 8  # G, samples per prompt (SP3O: 8; DeepSeekMath: 64, DAPO: 16)
    max_response_tokens: int = 8192  # response length limit; truncated responses score 0 (SP3O: 8192; DAPO: 20480)
    temperature: float = 1.0  # rollout sampling temperature (SP3O: 1.0)
    top_p: float = 1.0  # rollout nucleus sampling, off at 1.0 (SP3O/SPO: 1.0)
    lr: float = 1e-6  # policy learning rate (SP3O/SPO: 1e-6)
    weight_decay: float = 0.1  # AdamW weight decay (SP3O: 0.1; verl: 0.01)
    adam_betas: tuple[float, float] = (0.9, 0.98)  # AdamW betas (SP3O: 0.9, 0.98; verl: 0.9, 0.999)
    mini_batches: int = 2  # optimizer steps per rollout per epoch (SP3O: 2; DeepSeekMath: 1)
    epochs: int = 1  # passes over each rollout (SP3O: 1)
    grad_clip: float = 1.0  # max global gradient norm (SP3O/SPO: 1.0)
    truncated_is: Literal["auto", "on", "off"] = "auto"  # correct the engine/trainer mismatch (auto: on with vLLM)
    tis_cap: float = 2.0  # cap of the truncated importance weights (SP3O: 2.0)
    clip_low: float = 0.2  # PPO clip epsilon below 1 (SP3O/SPO: 0.2)
    clip_high: float = 0.2  # PPO clip epsilon above 1 (SP3O/SPO: 0.2; DAPO's clip-higher: 0.28)
    # loss reduction (SP3O/DeepSeekMath: seq-mean; DAPO: token-mean; Dr. GRPO: sum-max-len)
    aggregation: Literal["token-mean", "seq-mean", "sum-max-len"] = "seq-mean"
    # advantages divided by the group's std, the batch's, or not (SP3O/DeepSeekMath: group; Dr. GRPO: none)
    advantage_scale: Literal["group", "batch", "none"] = "group"
    kl_coef: float = 0.0  # beta of the k3 KL to a frozen reference, 0: none loaded (SP3O: 0.0; DeepSeekMath: 0.04)
    # the PPO ratio per token, per response (GSPO's s_i: the geometric mean of its tokens' ratios) or GSPO-token (s_i's
    # value, each token's own gradient) (SP3O: token)
    importance_level: Literal["token", "sequence", "sequence-token"] = "token"
    gspo_clip_low: float = 3e-4  # clip epsilon below 1 of the sequence ratio, for those two levels (GSPO: 3e-4)
    gspo_clip_high: float = 4e-4  # clip epsilon above 1 of the sequence ratio (GSPO: 4e-4)


# The CPU demo: the settings shared by the six files (infra.cli.CONTROLLED_TINY_PRESET: rollouts of 512 samples,
# lr 3e-5, 2 optimizer steps per rollout, ...), then the method's own, below.
TINY_PRESET = dict()  # the demo: infra.cli.CONTROLLED_TINY_PRESET (nothing of GRPO's own)
# --preset smollm2: infra.cli.CONTROLLED_SMOLLM2_PRESET, then the method's own (docs/real_model.md).
SMOLLM2_PRESET = dict()  # nothing of GRPO's own
MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp, in the policy loss and the KL (verl: 20)


def group_advantages(rewards, group_size, scale="group", eps=1e-6):
    """A_i = (R_i - mean of its group) / (std + eps), rewards laid out group after group. scale="batch" divides
    by the std of the whole batch, "none" does not divide (Dr. GRPO). Equal rewards in a group give 0."""
    if group_size < 2:
        raise ValueError(f"a GRPO group needs at least 2 samples, got group_size={group_size}")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.view(-1, group_size)
    centered = groups - groups.mean(1, keepdim=True)
    if scale == "group":
        centered = centered / (groups.std(1, keepdim=True) + eps)
    elif scale == "batch":
        centered = centered / (rewards.std() + eps)
    return centered.reshape(-1)


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
        raise infra.UserError("--samples-per-prompt must be at least 2: GRPO's baseline is the mean of a group")
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
    models, optimizers = {"policy": policy}, {"policy": optimizer}
    generator = run.start(models, optimizers, tokenizer)  # logs, --resume's checkpoint, the rollout engine
    if args.eval_only:  # evaluate and exit, through the same code as the evaluations during training
        return run.evaluate_only()
    truncated_is = args.truncated_is == "on" or (args.truncated_is == "auto" and generator.engine == "vllm")
    engine_old_logprobs = infra.engine.reuse_engine_logprobs(args.old_logprobs, generator, policy, args.top_p)
    for step, metrics in run.steps():  # metrics starts with the held-out evaluation when one is due
        history = defaultdict(list)
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
        advantages = infra.dist.rank_share(group_advantages(  # over the whole rollout: --advantage-scale batch needs it
            infra.dist.gather_all(rewards), args.samples_per_prompt, args.advantage_scale)).to(run.device)
        token_advantages = advantages[:, None].expand_as(old_logprobs)
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
                    if reference is not None:
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
                       rollout_s=rollout_seconds, update_s=update_seconds,
                       tokens_per_s=response_tokens / (rollout_seconds + update_seconds))
        run.end_step(step, metrics)  # evaluation after the last update, log line, checkpoint; Ctrl-C stops here


if __name__ == "__main__":
    infra.run.run_main(main)
