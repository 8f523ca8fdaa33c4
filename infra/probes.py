"""Critic diagnostics: the critic's values against Monte Carlo values on held-out prompts (SP3O's MSE per anchor
and effective rank, TPPO's sign accuracy of value changes, the within-response variation ratio), and the
explained variance of the value targets that every critic trainer logs each step.
"""
import time

import numpy as np
import torch

from common import batched, chunks, forward, monte_carlo_values, prompt_ids, sequence_batch


def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) over the valid tokens: 1 for a perfect critic, 0 for one no better
    than a constant, negative for a worse one; 0.0 for an empty mask.
    Undefined when the returns do not vary: every reward of a rollout equal with gamma = lambda = 1 makes every
    return R, up to the rounding that A + V leaves (|R| up to 4.5e-8 in float32 for R = 0: 1 - 0.01 / 1e-16 = -1e14).
    A variance counts as 0 when its standard deviation is within 4 sqrt(T) eps max|x| (T = the last dimension, the
    GAE recursion's length; eps of the inputs' dtype): that rounding measured at most 0.34 sqrt(T) eps max|x|.
    Then, as scikit-learn's explained_variance_score (force_finite=True): 1.0 if the residual does not vary either
    (the critic is off by a constant at most), else 0.0. Finite rather than CleanRL's NaN, so that the step line,
    the plot's means over seeds and metrics.jsonl (JSON has no NaN) stay readable; verl's denominator Var(returns) +
    1e-5 gives 1 - 1e5 Var(residual) at such a step (-999 for a residual variance of 0.01)."""
    eps = max(torch.finfo(x.dtype).eps if x.is_floating_point() else 0.0 for x in (values, returns))
    returns, values = returns[mask].double(), values[mask].double()
    if returns.numel() == 0:
        return 0.0
    scale = max(returns.abs().max(), values.abs().max())
    tolerance = (4 * mask.shape[-1] ** 0.5 * eps * scale) ** 2  # on the variance
    target_variance, residual_variance = returns.var(unbiased=False), (returns - values).var(unbiased=False)
    if target_variance <= tolerance:
        return 1.0 if residual_variance <= tolerance else 0.0
    return float(1 - residual_variance / target_variance)


def tracking_diagnostics(value_logits, mask):
    """TPPO's tracking critic on a rollout: means of z_0, of the increments z_t - z_{t-1} (t >= 1) and of z at
    the last valid token."""
    rows, last = mask.any(1), (mask.sum(1, keepdim=True) - 1).clamp(min=0)
    means = [value_logits[rows, 0], value_logits.diff(dim=1)[mask[:, 1:]], value_logits.gather(1, last)[rows]]
    z0, increment, last_logit = (values.mean().nan_to_num().item() for values in means)  # nothing valid: 0
    return dict(critic_z0=z0, critic_increment=increment, critic_last_logit=last_logit)


def effective_rank(matrix):
    """exp(entropy of the singular values normalized to sum 1) of a [n, d] matrix (Roy & Vetterli, 2007): r for
    r equal nonzero singular values, between 1 and the rank otherwise, 0 for a zero matrix. Rows are not centered.
    Singular values under torch.linalg.matrix_rank's tolerance (rounding noise of the input dtype) count as 0."""
    singular_values = torch.linalg.svdvals(matrix.double())
    if matrix.numel() == 0 or singular_values.max() == 0:
        return 0.0
    tolerance = singular_values.max() * max(matrix.shape) * torch.finfo(matrix.dtype).eps
    p = singular_values[singular_values > tolerance] / singular_values[singular_values > tolerance].sum()
    return float(torch.exp(-(p * p.log()).sum()))


def sign_accuracy(critic_values, mc_values, continuations, tau=0.0):
    """TPPO's diagnostic as defined here (its Appendix D.3, with the paper's exact definition, is not available
    to us). critic_values, mc_values: [N, A] values at A anchors of N responses, each MC value the mean of
    `continuations` = K Bernoulli rewards (c successes). For consecutive anchors a < b the MC change is tested
    with the Agresti-Caffo adjustment (one success and one failure added at each anchor): p~ = (c + 1) / (K + 2),
    d~ = p~_b - p~_a, se = sqrt(p~_a (1 - p~_a) / (K + 2) + p~_b (1 - p~_b) / (K + 2)) (independent samples),
    SNR = |d~| / se, never 0 / 0. A change of one success (c_b - c_a = +-1) has SNR^2 <= (K + 2) / (3K + 1) < 1
    for every K, so tau = 1 never keeps it (the plug-in p^(1 - p^) / K would: SNR sqrt(K / (K - 1)) for 0 vs 1).
    Among the intervals with SNR > tau, the fraction with sign(d critic) == sign(d MC) (a critic change of exactly
    0 counts as wrong). Returns (accuracy, or None when no interval is kept; kept fraction)."""
    critic_values, mc_values = np.asarray(critic_values, dtype=float), np.asarray(mc_values, dtype=float)
    mc_change, critic_change = np.diff(mc_values, axis=1), np.diff(critic_values, axis=1)
    adjusted = (mc_values * continuations + 1) / (continuations + 2)
    variance = adjusted * (1 - adjusted) / (continuations + 2)
    snr = np.abs(np.diff(adjusted, axis=1)) / np.sqrt(variance[:, 1:] + variance[:, :-1])
    kept = snr > tau
    if not kept.any():
        return None, 0.0
    return float((np.sign(critic_change[kept]) == np.sign(mc_change[kept])).mean()), float(kept.mean())


def variation_ratio(critic_values, mc_values):
    """How much the critic's value moves within a response compared with the MC value: the root of the summed
    squared deviations of each [N, A] row from its own mean, critic over MC. Value flattening (SP3O) shows as a
    ratio near 0. The MC noise (variance p (1 - p) / K per anchor) inflates the denominator. None if MC is flat."""
    critic_values, mc_values = np.asarray(critic_values, dtype=float), np.asarray(mc_values, dtype=float)
    spread = lambda x: np.sqrt(((x - x.mean(1, keepdims=True)) ** 2).sum())
    return float(spread(critic_values) / spread(mc_values)) if spread(mc_values) > 0 else None


def probe_cuts(length, ratios=(0.3, 0.6, 0.9)):
    """Response prefix lengths probed in a response of `length` tokens: 0 (the prompt state) and round(rho * length)
    for each ratio, at most length - 1 (the state before the last token). Equal cuts stay (one MC request)."""
    return [0] + [min(round(ratio * length), max(length - 1, 0)) for ratio in ratios]


def response_hidden_states(model, batch, micro_batch_size=8):
    """Per row, the [n, H] last hidden states at the states before its n response tokens (where a critic reads V)."""
    states = []
    for rows in chunks(list(range(batch.input_ids.shape[0])), micro_batch_size):
        micro = batch.select(rows)
        hidden = forward(model, micro, output_hidden_states=True).hidden_states[-1]
        hidden = hidden[:, -micro.response_width - 1:-1]
        states += [hidden[i, :int(micro.response_mask[i].sum())].float().cpu() for i in range(len(rows))]
    return states


@torch.no_grad()
def probe_critic(generator, tokenizer, rows, value_fn, args, critic=None, device="cpu", prompt_only=False,
                 ratios=(0.3, 0.6, 0.9), taus=(0, 1)):
    """Critic quality on the first args.probe_prompts rows (held-out problems). Per prompt: sample one response; at
    the prompt and at each ratio of the response (probe_cuts) compare the critic's value, value_fn(SequenceBatch)
    -> [B, T] with column t = V(s_t) (column 0: the prompt state), with a Monte Carlo value (K =
    args.probe_continuations, sampled like the rollouts: args.temperature, args.top_p, args.max_response_tokens).
    prompt_only: a critic that sees only the prompt (SPPO): the prompt anchor alone, no response sampled.
    `critic`, a value-head model, adds the median effective rank of its last hidden states over each response.
    Logged: probe/mse_<anchor>, probe/mc_mean, probe/value_mean, probe/variation_ratio,
    probe/sign_acc_tau<tau> and probe/sign_kept_tau<tau> (sign_accuracy), probe/effective_rank, and the cost:
    probe_tokens (generated) and probe_s (seconds). Samples under its own seed: training randomness is untouched."""
    start, rows, continuations = time.time(), rows[:args.probe_prompts], args.probe_continuations
    max_tokens, temperature, top_p = args.max_response_tokens, args.temperature, args.top_p
    prompts = [prompt_ids(tokenizer, row["question"]) for row in rows]
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(args.seed)
        responses, generated = [[] for _ in rows], 0
        if not prompt_only:
            for completion in generator.generate(prompts, 1, max_tokens, temperature, top_p):
                responses[completion.prompt_index] = list(completion.token_ids)
            generated = sum(len(response) for response in responses)
        cuts = [[0] if prompt_only else probe_cuts(len(response), ratios) for response in responses]
        states = [(prompts[i], responses[i][:cut]) for i, row_cuts in enumerate(cuts) for cut in row_cuts]
        state_rows = [rows[i] for i, row_cuts in enumerate(cuts) for _ in row_cuts]
        mc_values, mc_tokens = monte_carlo_values(generator, tokenizer, states, state_rows, continuations, max_tokens,
                                                  temperature, top_p)
    batch = sequence_batch(prompts, responses, tokenizer.pad_token_id).to(device)
    values = batched(value_fn, batch, args.micro_batch_size).cpu().numpy()
    critic_values = np.array([[values[i, cut] for cut in row_cuts] for i, row_cuts in enumerate(cuts)])
    mc_values = mc_values.reshape(critic_values.shape)
    names = ["prompt"] + [f"{round(100 * ratio)}" for ratio in ratios]
    metrics = {f"probe/mse_{name}": float(((critic_values[:, a] - mc_values[:, a]) ** 2).mean())
               for a, name in enumerate(names[:critic_values.shape[1]])}
    metrics.update({"probe/mc_mean": float(mc_values.mean()), "probe/value_mean": float(critic_values.mean())})
    if not prompt_only:
        ratio = variation_ratio(critic_values, mc_values)
        if ratio is not None:
            metrics["probe/variation_ratio"] = ratio
        for tau in taus:
            accuracy, kept = sign_accuracy(critic_values, mc_values, continuations, tau)
            metrics[f"probe/sign_kept_tau{tau:g}"] = kept
            if accuracy is not None:
                metrics[f"probe/sign_acc_tau{tau:g}"] = accuracy
        if critic is not None:
            ranks = [effective_rank(hidden) for hidden in response_hidden_states(critic, batch, args.micro_batch_size)]
            metrics["probe/effective_rank"] = float(np.median(ranks))
    metrics.update(probe_tokens=generated + mc_tokens, probe_s=time.time() - start)
    return metrics


