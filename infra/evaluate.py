"""Held-out evaluation (avg@n, unbiased pass@k, truncation and repetition per dataset, every sample for
samples.jsonl), the printed table, and the metrics of each training rollout (reward, length, truncation, repetition,
engine-vs-trainer log-prob gap).
"""
import math

import numpy as np
import torch

from common import engine_logprobs, prompt_ids, score
from infra import dist, progress, samples as sample_log, verifier


def rollout_metrics(completions, rewards, trainer_logprobs, mask):
    """Reward, length and truncation of a rollout, and the gap between the rollout engine's log-probs and
    the trainer's (they differ by numerics, and by design when top-p < 1)."""
    engine = engine_logprobs(completions, trainer_logprobs.shape[1]).to(trainer_logprobs.device)
    gap = (engine - trainer_logprobs).abs()[mask]
    sample_log.keep_rollout(completions, rewards)  # a few of its samples go to samples.jsonl (Run.end_step)
    return {"reward": rewards.mean().item(), "accuracy": (rewards > 0).float().mean().item(),
            "response_length": mask.sum().item() / len(completions),
            "truncated": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "repetition": repetition_rate([response_tokens(c) for c in completions]),
            "logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "logprob_gap_max": gap.max().item() if gap.numel() else 0.0,
            "verify_timeouts": verifier.pop_timeouts()}


def response_tokens(completion):
    """The sampled tokens without the final stop token (EOS or turn end)."""
    return completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids


def ends_in_loop(tokens, max_ngram=200, min_repeats=4, min_tokens=32):
    """True when the response ends in a repeated n-gram loop: for some n <= max_ngram, each of its last L tokens
    equals the token n before it (the tail is one n-gram repeated back to back, the last copy possibly cut
    short by the length limit), with L >= min_repeats * n and L >= min_tokens. `tokens`: ids, or a string."""
    tokens = list(tokens)
    for n in range(1, max_ngram + 1):
        needed = max(min_repeats * n, min_tokens)  # length of the periodic tail that makes a loop
        if needed > len(tokens):
            return False
        if all(tokens[-i] == tokens[-i - n] for i in range(1, needed - n + 1)):
            return True
    return False


def repetition_rate(responses, max_ngram=200, min_repeats=4, min_tokens=32):
    """Fraction of responses (token-id lists without the EOS, or strings) that end in a loop (ends_in_loop)."""
    return sum(ends_in_loop(r, max_ngram, min_repeats, min_tokens) for r in responses) / max(len(responses), 1)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(generator, tokenizer, eval_sets, n=1, max_tokens=256, temperature=0.0, top_p=1.0, seed=0, samples=None):
    """{eval/<name>/avg@n, eval/<name>/pass@k for k = 1, 2, 4 .. n (n > 1), eval/<name>/truncated and
    eval/<name>/repetition} for each named list of rows, scored in each row's answer format (common.score); a
    response cut off at max_tokens scores 0, as in training. eval/accuracy is avg@n on the first set. Samples
    under its own seed: training randomness is untouched. A list `samples` (given on every rank) receives every
    sample's samples.jsonl record (infra.samples.record), set by set, problem by problem."""
    metrics = {}
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        for name, all_rows in eval_sets.items():
            progress.phase(f"eval {name}")
            rows = all_rows[dist.rank()::dist.world_size()]  # under torchrun each rank takes every world_size-th one
            prompts = [prompt_ids(tokenizer, r["question"]) for r in rows]
            completions = generator.generate(prompts, n, max_tokens, temperature, top_p)
            correct, drawn, records = np.zeros(len(rows), dtype=int), [0] * len(rows), []
            texts = [tokenizer.decode(p) for p in prompts] if samples is not None else None
            for completion in completions:
                i = completion.prompt_index
                reward = score(completion.text, rows[i]) if completion.finish_reason == "stop" else 0.0
                correct[i] += reward
                if samples is not None:  # the problem's row in the whole set: rank + world_size * i
                    records.append(sample_log.record("eval", name, dist.rank() + dist.world_size() * i, drawn[i],
                                                     rows[i], texts[i], completion, reward))
                    drawn[i] += 1
            shares = dist.gather_objects((correct.tolist(), sum(c.finish_reason == "length" for c in completions),
                                          sum(ends_in_loop(response_tokens(c)) for c in completions), records))
            if samples is not None:
                samples.extend(sorted((r for share in shares for r in share[3]), key=lambda r: (r["index"],
                                                                                               r["sample"])))
            correct = np.array([c for share in shares for c in share[0]])
            total = len(correct) * n
            metrics[f"eval/{name}/avg@{n}"] = float(correct.mean() / n)
            for k in [2 ** i for i in range(int(math.log2(n)) + 1)] if n > 1 else []:
                metrics[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
            metrics[f"eval/{name}/truncated"] = sum(share[1] for share in shares) / total
            metrics[f"eval/{name}/repetition"] = sum(share[2] for share in shares) / total
            metrics.setdefault("eval/accuracy", metrics[f"eval/{name}/avg@{n}"])
    return metrics


def eval_table(metrics):
    """The eval/<name>/<metric> entries of `metrics` as a text table, a row per dataset."""
    table = {}
    for key, value in metrics.items():
        if key.startswith("eval/") and key.count("/") >= 2:
            name, metric = key[len("eval/"):].rsplit("/", 1)
            table.setdefault(name, {})[metric] = value
    columns = list(dict.fromkeys(metric for row in table.values() for metric in row))
    width = max([len("dataset")] + [len(name) for name in table])
    lines = [f"{'dataset':<{width}} " + " ".join(f"{c:>10}" for c in columns)]
    for name, row in table.items():
        lines.append(f"{name:<{width}} " + " ".join(f"{row[c]:>10.4f}" if c in row else f"{'':>10}" for c in columns))
    return "\n".join(lines)


def run_eval_only(args, generator, tokenizer, eval_sets, logger, step=0, write=print):
    """--eval-only: evaluate the loaded policy (a hub model, or a checkpoint's HF directory given as --model,
    e.g. runs/<run>/checkpoints/step_000050/policy) with the trainer's eval flags, through the same code and
    seed as the evaluations during training; log it as `step` and print the table. Returns the metrics."""
    metrics = evaluate(generator, tokenizer, eval_sets, args.eval_n, args.eval_max_tokens, args.eval_temperature,
                       args.eval_top_p)
    logger.log(step, metrics, write)
    write(eval_table(metrics))
    return metrics


