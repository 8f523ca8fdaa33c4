"""SPO: Segment Policy Optimization (arXiv 2505.23564; code AIFrameResearch/SPO). Derived from grpo.py:
`diff grpo.py spo.py` shows what SPO changes.

Critic-free, like GRPO, but the credit is per segment of a response instead of per response: a segment's
advantage is the difference of Monte Carlo value estimates V = mean reward of K continuations at its two
borders. SPO-chain (short CoT, the default; `chain_rollout`, `chain_mc_advantages`): cutpoints just before the 1st,
(1 + interval)-th, ... low-probability token (p < 0.9 at the sampling temperature); segment (c_{k-1}, c_k] gets
V(c_k) - V(c_{k-1}), the last one R - V(c_last), the tokens up to c_1 (all sure) 0. A cut at -1 (a low-probability
first token) is the prompt state, valued like any cut by K continuations, as released: not the group's mean reward,
whose leave-one-out form would cost no generation but is not SPO's estimator. SPO-tree (--mode tree, long CoT;
`tree_rollout`): each prompt grows a tree of fixed-length segments (depth 3, 6 children per node); a node's value is
the mean of its children's, each edge a training sample with advantage V(child) - V(parent); at most 32 non-zero
edges of a tree are trained per rollout. Both put advantages and loss only on the low-probability tokens (the
probability mask), whiten over those tokens, take PPO-clip steps plus beta x the k3 KL summed over each sequence's
loss tokens, under the released warm-up then linear-decay learning rate.
Deliberate differences from the released code: no replay buffer in SPO-tree (the released one keeps a tree's
edges beyond 32 for up to 8 rollouts, with the log-probs taken when they were inserted; here they are dropped);
the token-mean is over a mini-batch, not over each micro-batch; rollouts at top-p 1 (the RhoMath configs: 0.9).

Usage: `python <this file>` runs the built-in CPU demo; `--model Qwen3-4B-Base` a real run on the data in Args.
"""
import math
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
    """SPO's knobs: SPO's released configs (chain: Rho-1.1B, GSM8K). (NAME: value) names a source (docs/methods.md)."""
    dataset: str = "openai/gsm8k:main"  # training set (SPO: openai/gsm8k:main; the chain's GSM8K, by hub id)
    answer_format: Literal["auto", "boxed", "answer-line"] = "boxed"  # reward (ours; our \boxed{} instruction)
    eval_datasets: tuple[str, ...] = ("openai/gsm8k:main",)  # held-out sets (SPO: "openai/gsm8k:main",; its test)
    mode: Literal["chain", "tree"] = "chain"  # SPO-chain (short CoT: cutpoints + MC) or SPO-tree (long CoT)
    prompts_per_step: int = 64  # chain: prompts per rollout (SPO: 64; 512 episodes of 8 samples)
    samples_per_prompt: int = 8  # chain: samples per prompt (SPO: 8)
    max_response_tokens: int = 8192  # length limit, cut responses score 0 (ours; SPO: chain 1024, tree 2K-4K context)
    temperature: float = 0.6  # rollout and Monte Carlo sampling temperature (SPO: 0.6)
    top_p: float = 1.0  # rollout nucleus sampling, off at 1.0 (SP3O/SPO: 1.0)
    mc_samples: int = 9  # chain: K continuations per cutpoint (SPO: 9; Rho-1.1B on GSM8K, 4 for long CoT)
    cut_interval: int = 5  # chain: a cutpoint before every N-th low-probability token (SPO: 5; "int5")
    prob_threshold: float = 0.9  # low-probability tokens have p < this at the sampling temperature (SPO: 0.9)
    probability_mask: bool = True  # advantages and loss only on low-probability tokens (SPO: on)
    whiten_advantages: bool = True  # normalize advantages with the statistics of the loss tokens (SPO: on)
    tree_depth: int = 3  # tree: levels of segments; the last level runs to completion (SPO: 3)
    tree_branching: int = 6  # tree: children per node (SPO: 6)
    tree_segment_tokens: int = 600  # tree: tokens per segment (SPO: 600; long CoT, 30 for GSM8K)
    tree_prompts: int = 16  # tree: prompts (trees) per rollout (SPO: 16; GSM8K config, 32 in the long-CoT one)
    tree_edges_per_prompt: int = 32  # tree: non-zero edges of one prompt trained per rollout at most (SPO: 32)
    lr: float = 1e-6  # policy learning rate (SP3O/SPO: 1e-6)
    lr_schedule: Literal["warmup-decay", "constant"] = "warmup-decay"  # warm-up, decay to 0 (SPO: warmup-decay)
    lr_warmup: float = 0.03  # share of all optimizer steps spent warming up (SPO: 0.03)
    weight_decay: float = 0.0  # AdamW weight decay (SPO: 0.0)
    adam_betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas (SPO: 0.9, 0.999; Hugging Face's default)
    mini_batches: int = 8  # optimizer steps per rollout per epoch (SPO: 8; Rho-1.1B, 4 in the Qwen configs)
    epochs: int = 2  # passes over each rollout (SPO: 2; Rho-1.1B, 1 in the Qwen and SPO-tree configs)
    grad_clip: float = 1.0  # max global gradient norm (SP3O/SPO: 1.0)
    truncated_is: Literal["auto", "on", "off"] = "auto"  # correct the engine/trainer mismatch (auto: on with vLLM)
    tis_cap: float = 2.0  # cap of the truncated importance weights (SP3O: 2.0)
    clip_low: float = 0.2  # PPO clip epsilon below 1 (SP3O/SPO: 0.2)
    clip_high: float = 0.2  # PPO clip epsilon above 1 (SP3O/SPO: 0.2; DAPO's clip-higher: 0.28)
    # loss reduction (SPO: token-mean; Dr. GRPO: sum-max-len)
    aggregation: Literal["token-mean", "seq-mean", "sum-max-len"] = "token-mean"
    kl_coef: float = 1e-4  # beta of the k3 KL to a frozen reference, 0: none loaded (SPO: 1e-4)


# The CPU demo: the settings shared by the six files (infra.cli.CONTROLLED_TINY_PRESET: rollouts of 512 samples,
# lr 3e-5, 2 optimizer steps per rollout, ...), then the method's own, below. The tiny model is sure of most tokens
# (about 2.9 with p < 0.9 per response at temperature 1, step 0), so the published interval 5 cuts before the first
# of them, as interval 1 would mostly do; K = 4; tree: 3 x 3 x 3 of 12 tokens.
TINY_PRESET = dict(mc_samples=4, tree_branching=3, tree_segment_tokens=12)  # the demo: infra.cli.CONTROLLED_TINY_PRESET
# --preset smollm2: infra.cli.CONTROLLED_SMOLLM2_PRESET, then the method's own (docs/real_model.md).
SMOLLM2_PRESET = dict(mc_samples=4, tree_branching=3, tree_segment_tokens=12)  # the demo's
MAX_LOG_RATIO = 10.0  # log-ratios are clamped to +-this before exp, in the policy loss and the KL (SPO's code: 10)


def cutpoints(token_probs, threshold=0.9, interval=5):
    """SPO-chain cutpoints of one response from its token probabilities p_j (valid tokens only), as the released
    code computes them (math_episode_generator_with_mc_advantages.py: `(np.where(p < 0.9)[0] - 1)[::interval]`):
    just before the 1st, (1 + interval)-th, (1 + 2 interval)-th ... token with p < threshold. A cut c is the state
    after token c: its Monte Carlo continuations start after y_0..y_c. A cut at -1 is the prompt state."""
    low = (token_probs < threshold).nonzero().flatten().tolist()
    return [j - 1 for j in low[::interval]]


def chain_advantages(rewards, cuts, cut_values, mask):
    """[B, T] SPO-chain advantages, the released rule (_compute_token_advantages): a response's borders are its
    cutpoints c_1 < .. < c_m (values cut_values, Monte Carlo means; c_1 = -1 is the prompt state) and its last
    token (value R); the tokens in (c_{k-1}, c_k] get V(c_k) - V(c_{k-1}), the tokens after c_m get R - V(c_m),
    the tokens up to c_1 get 0 (they come before the first low-probability token, outside the probability mask).
    A response without cutpoints gets 0 on every token. Zero on padding."""
    advantages = torch.zeros(mask.shape)
    for row, (row_cuts, row_values) in enumerate(zip(cuts, cut_values)):
        borders = list(row_cuts) + [mask.shape[1] - 1]
        values = [float(v) for v in row_values] + [float(rewards[row])]
        for k in range(len(borders) - 1):
            advantages[row, borders[k] + 1:borders[k + 1] + 1] = values[k + 1] - values[k]
    return advantages * mask.cpu()


def cap_edges(edges, prompts, cap=32):
    """SPO-tree: at most `cap` edges of each prompt's tree, drawn uniformly without replacement (the released
    OnPolicyReplayBuffer.get_edges: random.sample(edges of one question, 32)); the kept edges keep their order."""
    by_prompt = defaultdict(list)
    for edge, prompt in zip(edges, prompts):
        by_prompt[prompt].append(edge)
    kept = set()
    for group in by_prompt.values():
        kept.update(group if len(group) <= cap else [group[i] for i in torch.randperm(len(group))[:cap].tolist()])
    return [edge for edge in edges if edge in kept]


def tree_values(parents, leaf_rewards):
    """SPO-tree node values: a leaf's value is its reward, an inner node's the mean of its children's values.
    Nodes are listed parents first (parents[i] < i; -1 for a root)."""
    children = defaultdict(list)
    for node, parent in enumerate(parents):
        if parent >= 0:
            assert parent < node, "list the tree parents first"
            children[parent].append(node)
    values = [0.0] * len(parents)
    for node in reversed(range(len(parents))):
        values[node] = sum(values[c] for c in children[node]) / len(children[node]) if children[node] \
            else float(leaf_rewards[node])
    return values


def edge_advantages(parents, values):
    """SPO-tree: the edge into node i has advantage V(i) - V(parent(i)); 0 for a root (no edge)."""
    return [values[node] - values[parent] if parent >= 0 else 0.0 for node, parent in enumerate(parents)]


def probability_mask(logprobs, mask, threshold=0.9):
    """SPO's probability mask: True on valid tokens whose probability p = exp(logprob) at the sampling
    temperature is below `threshold`; only these carry advantages and loss."""
    return mask & (logprobs.exp() < threshold)


def masked_whiten(values, mask, eps=1e-6):
    """(x - mean) / std with the statistics of the tokens in `mask` (SPO: the low-probability tokens); 0
    outside the mask. Fewer than 2 tokens: unchanged; equal values: 0 (std floored at eps, never NaN)."""
    count = infra.dist.all_sum(mask.sum().double())  # over every rank
    if count < 2:
        return values * mask
    mean, std = infra.dist.mean_std(values[mask])
    return (values - mean) / std.clamp(min=eps) * mask


@dataclass
class Tree:
    """SPO-tree nodes, parents before children; the roots are the prompts (no segment)."""
    parents: list  # parent node, -1 for a root
    prompt_index: list  # which prompt the node grows from
    prefixes: list  # response tokens before the node's segment
    segments: list  # the node's segment as a common.Completion (None for a root)
    rewards: list  # a leaf's reward (a truncated leaf scores 0); 0.0 for inner nodes and roots


def grow_tree(generator, tokenizer, prompts, rows, depth, branching, segment_tokens, max_tokens, temperature, top_p):
    """Sample SPO-trees level by level: every open node gets `branching` children, each a segment of
    `segment_tokens` tokens; the last level (`depth`) runs to completion within max_tokens. A segment that
    stops is a leaf scored like a response; one that reaches max_tokens is a truncated leaf (reward 0).
    One engine request per open node with n = branching."""
    tree = Tree([-1] * len(prompts), list(range(len(prompts))), [[] for _ in prompts], [None] * len(prompts),
                [0.0] * len(prompts))
    frontier = list(range(len(prompts)))
    for level in range(depth):
        if not frontier:
            break
        paths = [tree.prefixes[node] + (tree.segments[node].token_ids if tree.segments[node] else [])
                 for node in frontier]
        used = len(paths[0])  # every open node has exactly level * segment_tokens response tokens
        limit = max_tokens - used if level == depth - 1 else min(segment_tokens, max_tokens - used)
        children = generator.generate([prompts[tree.prompt_index[node]] + path for node, path in zip(frontier, paths)],
                                      branching, limit, temperature, top_p)
        next_frontier = []
        for child in children:
            parent, path = frontier[child.prompt_index], paths[child.prompt_index]
            stopped, length = child.finish_reason == "stop", len(path) + len(child.token_ids)
            reward = 0.0
            if stopped:
                text = tokenizer.decode(path + child.token_ids, skip_special_tokens=True)
                reward = common.score(text, rows[tree.prompt_index[parent]])
            elif level < depth - 1 and length < max_tokens:
                next_frontier.append(len(tree.parents))
            tree.parents.append(parent)
            tree.prompt_index.append(tree.prompt_index[parent])
            tree.prefixes.append(path)
            tree.segments.append(child)
            tree.rewards.append(reward)
        frontier = next_frontier
    return tree


def chain_rollout(generator, prompts, rows, args):
    """SPO-chain's samples: G responses for each prompt, scored like GRPO's (their advantages: `chain_mc_advantages`,
    from the trainer's p_j). Returns (each sample's prompt, the completions, the rewards)."""
    completions = generator.generate(prompts, args.samples_per_prompt, args.max_response_tokens, args.temperature,
                                     args.top_p)
    rewards = torch.tensor([common.score(c.text, rows[c.prompt_index])
                            if c.finish_reason == "stop" else 0.0 for c in completions])
    return [prompts[c.prompt_index] for c in completions], completions, rewards


def chain_mc_advantages(generator, tokenizer, sample_prompts, completions, rows, rewards, logprobs, mask, args):
    """SPO-chain's [B, T] advantages (`chain_advantages`) from each response's cutpoints in p_j = exp(logprobs), each
    cut valued by K continuations from the sample's own prompt and prefix, scored against its own prompt's answer
    (`common.monte_carlo_values`: one engine request, n = K, per distinct prefix). Returns (advantages, metrics)."""
    mc_start, lengths = time.time(), mask.sum(1).tolist()
    cuts = [cutpoints(logprobs[row, :n].exp(), args.prob_threshold, args.cut_interval) for row, n in enumerate(lengths)]
    cut_rows = [(row, cut) for row in range(len(completions)) for cut in cuts[row]]
    estimates, mc_tokens = common.monte_carlo_values(
        generator, tokenizer, [(sample_prompts[row], completions[row].token_ids[:cut + 1]) for row, cut in cut_rows],
        [rows[completions[row].prompt_index] for row, _ in cut_rows], args.mc_samples, args.max_response_tokens,
        args.temperature, args.top_p)
    estimates = iter(estimates.tolist())
    cut_values = [[next(estimates) for _ in row_cuts] for row_cuts in cuts]  # a cut at -1: the prompt state
    return chain_advantages(rewards, cuts, cut_values, mask).to(mask.device), dict(
        mc_tokens=mc_tokens, cutpoints_per_response=sum(map(len, cuts)) / len(cuts), mc_s=time.time() - mc_start)


def tree_rollout(generator, tokenizer, prompts, rows, args):
    """SPO-tree's samples: a tree of segments for each prompt (`grow_tree` scores its leaves); each edge with a nonzero
    advantage V(child) - V(parent) (all if none has one; at most --tree-edges-per-prompt of a tree) is its segment
    after the prompt and the segments above it. Returns (those prompts, the segments, the leaves' rewards, the
    edges' advantages, metrics)."""
    tree = grow_tree(generator, tokenizer, prompts, rows, args.tree_depth, args.tree_branching,
                     args.tree_segment_tokens, args.max_response_tokens, args.temperature, args.top_p)
    node_advantages = edge_advantages(tree.parents, tree_values(tree.parents, tree.rewards))
    edges, inner = [n for n in range(len(tree.parents)) if tree.parents[n] >= 0], set(tree.parents)
    leaves = [n for n in edges if n not in inner]
    kept = [n for n in edges if abs(node_advantages[n]) > 1e-9] or edges  # zero-advantage edges dropped
    kept = cap_edges(kept, [tree.prompt_index[n] for n in kept], args.tree_edges_per_prompt)  # released: 32
    leaf_lengths = [len(tree.prefixes[n]) + len(tree.segments[n].token_ids) for n in leaves]
    metrics = dict(tree_leaves=len(leaves) / len(prompts), edges_kept=len(kept) / len(edges),
                   response_length=sum(leaf_lengths) / len(leaves),
                   truncated=sum(tree.segments[n].finish_reason == "length" for n in leaves) / len(leaves),
                   mc_tokens=sum(len(tree.segments[n].token_ids) for n in set(edges) - set(kept)))
    return ([prompts[tree.prompt_index[n]] + tree.prefixes[n] for n in kept], [tree.segments[n] for n in kept],
            torch.tensor([tree.rewards[n] for n in leaves]), [node_advantages[n] for n in kept], metrics)


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


def kl_loss(logprobs, reference_logprobs, mask, num_sequences=None):
    """SPO's released KL term (ppo_trainer.py, configs klLoss and refKl0.0001): k3 summed over each sequence's
    loss tokens (the probability mask), then averaged over the sequences; the caller multiplies it by beta.
    A micro-batch passes the mini-batch's sequence count, so the micro-batch terms add up to the mini-batch's."""
    return (k3_kl(logprobs, reference_logprobs) * mask).sum() / (num_sequences or mask.shape[0])


def lr_factor(update, total_updates, warmup_ratio=0.03, schedule="warmup-decay"):
    """Learning-rate multiplier at optimizer step `update` (0-based) of `total_updates`: SPO's released schedule,
    DeepSpeed's WarmupDecayLR as its configs fill it (warmup_num_steps = ceil(warmup_ratio * total) but at least 2,
    warmup_type left at DeepSpeed's default, log): log(update + 1) / log(W) during the W warm-up steps, then
    (total - update) / (total - W), a linear decay to 0 at the end. `constant`: 1."""
    if schedule == "constant":
        return 1.0
    warmup = max(2, math.ceil(total_updates * warmup_ratio))
    if update < warmup:
        return math.log(update + 1) / math.log(warmup)
    return max(0.0, (total_updates - update) / max(1, total_updates - warmup))


def check_args(args):
    if args.mode == "tree":  # SPO-tree's rollout: --tree-prompts trees
        args.prompts_per_step = args.tree_prompts
    if min(args.mc_samples, args.cut_interval, args.tree_depth, args.tree_segment_tokens, args.tree_branching - 1) < 1:
        raise infra.UserError("--mc-samples, --cut-interval, --tree-depth and --tree-segment-tokens must be at least "
                               "1, --tree-branching at least 2")
    if not 0 < args.prob_threshold <= 1:
        raise infra.UserError(f"--prob-threshold must be in (0, 1], got {args.prob_threshold}")
    rollout_size = args.prompts_per_step * args.samples_per_prompt
    if args.mode == "tree" and infra.dist.distributed():
        raise infra.UserError("SPO-tree runs in one process: its number of training samples varies per rank")
    if args.mode == "tree":  # the number of training samples (edges) varies: any split works
        return
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
        # 1. Rollout. chain: G samples for each prompt; tree: a tree of segments for each prompt.
        step_start = time.time()
        rows = run.training_rows(step)  # this rank's prompts
        prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
        if args.mode == "chain":  # 2. Reward: 1 for a correct final answer, 0 otherwise and for a truncated response.
            sample_prompts, completions, rewards = chain_rollout(generator, prompts, rows, args)
        else:  # 2. the leaves are scored inside grow_tree; each edge with a nonzero advantage is a sample
            sample_prompts, completions, rewards, advantages, extra = tree_rollout(generator, tokenizer, prompts,
                                                                                   rows, args)
        batch = common.sequence_batch(sample_prompts, [c.token_ids for c in completions],
                                      tokenizer.pad_token_id).to(run.device)
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
        low_probability = probability_mask(old_logprobs, mask, args.prob_threshold)  # p_j at the sampling temperature
        if args.mode == "chain":  # Monte Carlo values at the cutpoints, with the policy before this update
            generator.sync_weights(policy)  # the engine awake again (it slept after the rollout), the same weights
            token_advantages, extra = chain_mc_advantages(generator, tokenizer, sample_prompts, completions, rows,
                                                          rewards, old_logprobs, mask, args)
            generator.sleep()  # the continuations done: the GPU back to the trainer for the update
        else:  # every token of an edge's segment carries the edge's advantage
            token_advantages = torch.tensor(advantages, device=run.device)[:, None] * mask
        loss_mask = low_probability if args.probability_mask else mask  # the probability mask
        if args.whiten_advantages:
            token_advantages = masked_whiten(token_advantages, loss_mask)
        if truncated_is:  # A_t times min(pi_trainer / pi_engine, cap): the engine sampled the rollout
            token_advantages = token_advantages * truncated_importance_weights(
                old_logprobs, common.engine_logprobs(completions, mask.shape[1]).to(run.device), mask, args.tis_cap)
        # 4. Update: `mini_batches` optimizer steps per epoch, gradients accumulated over micro-batches.
        update_start = time.time()
        for epoch in range(args.epochs):
            order = torch.randperm(len(completions)).tolist()
            for index, mini_batch in enumerate(common.chunks(order, -(-len(order) // args.mini_batches))):
                update = (step * args.epochs + epoch) * args.mini_batches + index  # SPO's released lr schedule
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * lr_factor(update, args.steps * args.epochs * args.mini_batches,
                                                      args.lr_warmup, args.lr_schedule)
                counts = dict(num_sequences=len(mini_batch),
                              num_tokens=infra.dist.rank_mean(loss_mask[mini_batch].sum()),
                              max_length=args.max_response_tokens)
                mini_batch_loss = 0.0
                for micro in common.micro_batches(mini_batch, batch.lengths(), args.micro_batch_size,
                                                  args.micro_batch_tokens):
                    micro_batch = batch.select(micro)
                    micro_mask, width = micro_batch.response_mask, micro_batch.response_width
                    micro_loss_mask = loss_mask[micro, :width]
                    logprobs = common.response_logprobs(policy, micro_batch, args.temperature)
                    loss, clip_fraction = policy_loss(
                        logprobs, old_logprobs[micro, :width], token_advantages[micro, :width], micro_loss_mask,
                        args.clip_low, args.clip_high, args.aggregation, **counts)
                    if reference is not None:
                        kl = kl_loss(logprobs, reference_logprobs[micro, :width], micro_loss_mask, len(mini_batch))
                        loss = loss + args.kl_coef * kl
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
        metrics.update(extra, policy_tokens=response_tokens,
                       low_probability_tokens=int(low_probability.sum()) / len(completions))
        run.end_step(step, metrics)  # evaluation after the last update, log line, checkpoint; Ctrl-C stops here


if __name__ == "__main__":
    infra.run.run_main(main)
