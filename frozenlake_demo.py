"""Value flattening in a slippery FrozenLake, measured against exact values.

SP3O (arXiv 2609.18708): with a terminal-only reward and gamma = lambda = 1 every dense critic target is
the outcome R, so the dense MSE is (mean_t v_t - R)^2 + (1/T) sum_t (v_t - mean_t v_t)^2, a penalty on
value variation within a trajectory ("value flattening"), reproduced there in a slippery FrozenLake.
In a gridworld the true values are exact, so here the effect is measured with no Monte Carlo noise.

Per map size and seed (each seed draws its own map, data and critic initialisations):
- Map: gymnasium's `generate_random_map` (redrawn until S reaches G), `is_slippery=True`, reward 1 at G,
  gamma = 1, no time limit; also redrawn if the policy wins with probability outside (0.05, 0.95).
- Behaviour policy (fixed, like a frozen actor): epsilon-uniform mixed with greedy on Q*. Q* is discounted
  by 0.99 only to pick this policy (the gamma = 1 optimum bumps into walls for hundreds of steps); every
  value reported is for gamma = 1. Exact V^pi: the linear Bellman system from `env.unwrapped.P`.
- Encoding: a Gaussian bump per cell, phi(s)_j = exp(-|c_s - c_j|^2 / 2) (width 1 cell): neighbouring
  cells look alike, as neighbouring LLM prefixes do, yet any map is representable.
- Critics: one tanh MLP each; same data, same batches, same number of Adam steps, the same loss reduction
  (--reduction: seq-mean, each trajectory's mean over its supervised positions, then the mean over
  trajectories, as SP3O's released launcher; or token-mean over all supervised positions of the batch);
  positions are the T states s_0..s_{T-1} a trajectory acts from. (a) dense: MSE against R at every position
  (PPO with gamma = lambda = 1, no value clipping); (b) anchors: the same MSE only at SP3O's anchors
  (`sp3o.anchor_positions`); (c) tracking (TPPO, shared head g): z_0 = g(0, phi(s_0)) and a free increment
  per transition, delta_t = g(phi(s_{t-1}), phi(s_t)), the analogue of the token that moved the prefix
  (g(phi(s_t)) - g(phi(s_{t-1})) would collapse to a state critic); z_t = z_0 + sum_{k<=t} delta_k,
  V_t = sigmoid(z_t), BCE against R at every position. V_t depends on the path: its map is a mean over visits.
- Two critic networks (--network): the MLP above reads the current cell only, so its dense-MSE optimum is
  V^pi itself. An LLM critic reads the whole prefix instead, where each prefix is unique and neighbouring
  prefixes look alike; its analogue here is `SequenceCritic`, one causal transformer block over the tokens
  (cell s_t, previous action a_{t-1}) of the trajectory so far. Its output at t is the critic's output for the
  prefix s_0..s_t: the value (dense, anchors) or the increment delta_t (tracking). Same data and losses, and the
  first --sequence-steps of the same batches (a step costs ~10x the MLP's). E[R | prefix] is still V^pi(s_t)
  (the chain is Markov), but no prefix repeats, so reaching it takes generalising across prefixes.
- Metrics on held-out trajectories: MSE and Pearson correlation against V^pi over all visited positions;
  variation ratio = sum over trajectories of std_t(prediction) / the same sum for V^pi (1 faithful, 0 flat),
  beside its noise floor (`noise_floor`: the ratio of V^pi plus i.i.d. noise of the critic's MSE, which a critic's
  errors alone would score) and the ratio / floor (well below 1: flatter than noise explains);
  sign accuracy of value changes between the start and the anchors (TPPO's diagnostic; intervals where
  V^pi moves by more than `sign_min_change`; a predicted change of 0 counts as wrong).
- Network-free check: each cell's mean outcome over all visits, or over anchor visits only, against V^pi.
  Anchors sit at fractions of the finished length T, so choosing them looks into the future.
"""
import csv
import os
import time
from dataclasses import dataclass, field
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
from gymnasium.envs.toy_text.frozen_lake import generate_random_map
from tqdm import tqdm

import infra.cli
from sp3o import anchor_positions

CRITICS = ("dense", "anchors", "tracking")
NETWORKS = ("mlp", "sequence")
REDUCTIONS = ("seq-mean", "token-mean")


@dataclass
class Args:
    """Value flattening in a slippery FrozenLake, against exact values."""
    sizes: list[int] = field(default_factory=lambda: [4, 8, 16])  # map side lengths
    seeds: int = 3  # seeds 0..seeds-1; each draws its own map, data and initialisation
    steps: int = 1500  # Adam steps per critic (the same for all three)
    batch_trajectories: int = 64  # trajectories per step
    train_trajectories: int = 4096  # fixed training set per map, shared by the three critics
    eval_trajectories: int = 1000  # held-out trajectories for the metrics
    hole_fraction: float = 0.1  # probability that a cell is a hole
    epsilon: float = 0.1  # behaviour policy: probability of a uniform random action
    behaviour_discount: float = 0.99  # discount of the Q* the behaviour policy is greedy on
    rbf_width: float = 1.0  # width of the per-cell Gaussian features, in cells
    network: Literal["mlp", "sequence", "both"] = "both"  # critic network: MLP of the cell, transformer of the prefix
    hidden: int = 64  # width of the MLP critics' two hidden layers
    sequence_width: int = 32  # width of the sequence critics' transformer block (2 heads)
    sequence_steps: int = 300  # Adam steps per sequence critic (the first of the same batches as the MLP's)
    lr: float = 1e-3  # Adam learning rate
    sign_min_change: float = 0.01  # smallest exact value change kept by the sign accuracy
    reduction: Literal["seq-mean", "token-mean"] = "seq-mean"  # loss reduction of all three critics (SP3O's: seq-mean)
    threads: int = 1  # torch CPU threads
    out_dir: str = "runs/frozenlake"  # where the table, CSV and figure go


def make_map(size, seed, hole_fraction=0.1):
    """A solvable square map (gymnasium redraws until S reaches G) as a list of row strings."""
    return generate_random_map(size=size, p=1.0 - hole_fraction, seed=seed)


def transition_tables(P):
    """env.unwrapped.P as arrays [state, action, outcome]: next state, probability, reward, done."""
    n_states, n_actions = len(P), len(P[0])
    n_out = max(len(P[s][a]) for s in P for a in P[s])
    nxt = np.zeros((n_states, n_actions, n_out), dtype=np.int64)
    prob, reward = np.zeros((2, n_states, n_actions, n_out))
    done = np.ones((n_states, n_actions, n_out), dtype=bool)
    for s in P:
        for a in P[s]:
            for k, (p, s2, r, d) in enumerate(P[s][a]):
                nxt[s, a, k], prob[s, a, k], reward[s, a, k], done[s, a, k] = s2, p, r, d
    return nxt, prob, reward, done


def value_iteration(tables, policy=None, discount=1.0, tol=1e-12, max_iters=1_000_000):
    """Iterates the Bellman operator from V = 0: optimality if policy is None, else evaluation. -> (V, Q)."""
    nxt, prob, reward, done = tables
    values = np.zeros(nxt.shape[0])
    for _ in range(max_iters):
        q = (prob * (reward + discount * ~done * values[nxt])).sum(-1)
        new = q.max(1) if policy is None else (policy * q).sum(1)
        if np.abs(new - values).max() < tol:
            return new, q
        values = new
    return values, q


def exact_values(tables, policy):
    """V^pi with gamma = 1 from the linear system V = r_pi + P_pi V (states that cannot reach reward: 0)."""
    nxt, prob, reward, done = tables
    n = nxt.shape[0]
    weight = policy[:, :, None] * prob  # probability of each (action, outcome) from each state
    r_pi = (weight * reward).sum((1, 2))
    p_pi = np.zeros((n, n))
    np.add.at(p_pi, (np.repeat(np.arange(n), nxt[0].size), nxt.ravel()), (weight * ~done).ravel())
    can_win, edges = r_pi > 0, (p_pi > 0).astype(float)  # grow to the states that can reach a reward,
    for _ in range(n):  # the others have value 0 (and would make I - P_pi singular)
        can_win = can_win | (edges @ can_win > 0)
    values = np.zeros(n)
    values[can_win] = np.linalg.solve(np.eye(can_win.sum()) - p_pi[np.ix_(can_win, can_win)], r_pi[can_win])
    return values


def behaviour_policy(tables, epsilon, discount):
    """epsilon-uniform mixed with greedy (ties split evenly) on Q* at the given discount."""
    _, q = value_iteration(tables, discount=discount, tol=1e-10)
    greedy = (q >= q.max(1, keepdims=True) - 1e-9).astype(float)
    return (1 - epsilon) * greedy / greedy.sum(1, keepdims=True) + epsilon / q.shape[1]


def inverse_cdf(probs, rng):
    """One index per row of probs (rows sum to 1; zero-probability entries are never drawn)."""
    cdf = probs.cumsum(1)
    return (rng.random(len(probs))[:, None] >= cdf / cdf[:, -1:]).sum(1)


def sample_trajectories(tables, policy, n, rng, start=0, with_actions=False):
    """n episodes run to the end, all at once. -> list of state arrays (s_0..s_{T-1}), outcomes R and, with
    with_actions, the action arrays (a_t taken at s_t; recording them draws nothing more)."""
    nxt, prob, reward, done = tables
    state, alive, outcome, visits, taken = np.full(n, start), np.ones(n, dtype=bool), np.zeros(n), [], []
    while alive.any():
        visits.append(np.where(alive, state, -1))
        idx = np.flatnonzero(alive)
        s = state[idx]
        a = inverse_cdf(policy[s], rng)  # action, then which of the slippery outcomes happens
        k = inverse_cdf(prob[s, a], rng)
        taken.append(np.full(n, -1))
        taken[-1][idx] = a
        outcome[idx] += reward[s, a, k]
        state[idx] = nxt[s, a, k]
        alive[idx] = ~done[s, a, k]
    trajs = [row[row >= 0] for row in np.array(visits).T]
    return (trajs, outcome, [row[row >= 0] for row in np.array(taken).T]) if with_actions else (trajs, outcome)


def cell_features(size, width):
    """Per-cell Gaussian bumps: phi(s)_j = exp(-|c_s - c_j|^2 / (2 width^2)); neighbours look alike."""
    rows, cols = np.divmod(np.arange(size * size), size)
    sq_dist = (rows[:, None] - rows[None, :]) ** 2 + (cols[:, None] - cols[None, :]) ** 2
    return torch.tensor(np.exp(-sq_dist / (2 * width**2)), dtype=torch.float32)


def std_ratio(pred_trajs, exact_trajs):
    """Sum over trajectories of std_t(prediction) / the same sum for the exact values (1 faithful, 0 flat); the
    table's `variation ratio` (the trainers' probe of that name compares with Monte Carlo values instead)."""
    pairs = [(np.std(p), np.std(e)) for p, e in zip(pred_trajs, exact_trajs) if len(e) > 1]
    exact_total = sum(e for _, e in pairs)
    return sum(p for p, _ in pairs) / exact_total if exact_total > 1e-9 else float("nan")


NOISE_DRAWS = 8  # Gaussian draws averaged by the variation ratio's noise floor


def noise_floor(exact_trajs, mse, unit_noise):
    """The variation ratio (`std_ratio`) of a critic equal to V^pi plus noise of variance `mse`: i.i.d. per visited
    position, unit_noise[d] (standard normal, one per position in `flatten`'s order) scaled by sqrt(mse), averaged
    over the draws d. A critic's ratio well below its floor is flatter than its errors explain; near it, the ratio
    cannot tell flattening from noise. Zero noise: exactly 1. V^pi constant in every trajectory: inf for mse > 0
    (noise is all the variation), NaN for mse = 0 (as `std_ratio`)."""
    if mse < 0:
        raise ValueError(f"noise_floor: mse must be >= 0, got {mse}; pass the critic's MSE against V^pi")
    lengths = [len(e) for e in exact_trajs]
    if any(len(draw) != sum(lengths) for draw in unit_noise):
        raise ValueError(f"noise_floor: each unit_noise draw needs one value per position ({sum(lengths)})")
    if sum(np.std(e) for e in exact_trajs if len(e) > 1) <= 1e-9:  # V^pi flat in every trajectory
        return float("inf") if mse > 0 else float("nan")
    splits = np.cumsum(lengths)[:-1]
    noisy_draws = ([e + n for e, n in zip(exact_trajs, np.split(np.sqrt(mse) * np.asarray(draw), splits))]
                   for draw in unit_noise)
    return float(np.mean([std_ratio(noisy, exact_trajs) for noisy in noisy_draws]))


def interval_sign_accuracy(pred_trajs, exact_trajs, min_change=0.01):
    """Share of intervals between the start and SP3O's anchors where the predicted change has the sign
    of the exact change; only intervals where the exact value moves by more than min_change count."""
    hits = []
    for pred, exact in zip(pred_trajs, exact_trajs):
        points = sorted({0, *anchor_positions(len(exact))})
        d_pred, d_exact = np.diff(np.asarray(pred)[points]), np.diff(np.asarray(exact)[points])
        keep = np.abs(d_exact) > min_change
        hits.extend(np.sign(d_pred[keep]) == np.sign(d_exact[keep]))
    return float(np.mean(hits)) if hits else float("nan")


def critic_outputs(kind, net, features, states, prev_states):
    """Raw outputs at each position; the net runs once per distinct cell (or transition) and is gathered."""
    n = features.shape[0]
    if kind == "tracking":  # key = (previous cell or n at the start, cell)
        keys = prev_states * n + states
        with_start = torch.cat([features, torch.zeros(1, n)])
        make_input = lambda k: torch.cat([with_start[k // n], features[k % n]], dim=1)
    else:
        keys, make_input = states, lambda k: features[k]
    unique, inverse = torch.unique(keys, return_inverse=True)
    return net(make_input(unique)).squeeze(-1)[inverse]


N_ACTIONS = 4  # FrozenLake: left, down, right, up
START_ACTION = N_ACTIONS  # the "previous action" of a trajectory's first token


def previous_actions(actions, idx):
    """Flat a_{t-1} at every position of trajectories idx (in `flatten`'s order); START_ACTION at each start."""
    return torch.from_numpy(np.concatenate([np.concatenate([[START_ACTION], actions[i][:-1]]) for i in idx]))


def sinusoid_positions(length, width):
    """Fixed sin/cos position codes [length, width] (Vaswani et al. 2017), so any trajectory length fits."""
    angle = torch.arange(length)[:, None] / 10000 ** (torch.arange(0, width, 2) / width)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


class SequenceCritic(torch.nn.Module):
    """The LLM critic's analogue: one causal transformer block over the trajectory so far. Token t = cell s_t
    (a linear map of phi(s_t)) + previous action a_{t-1} (START at t = 0) + position t; the output at t attends
    to tokens 0..t only, so each prefix is its own input, as each LLM prefix is."""

    def __init__(self, n_cells, width, heads=2, group=8):
        super().__init__()
        self.cell, self.action = torch.nn.Linear(n_cells, width), torch.nn.Embedding(N_ACTIONS + 1, width)
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(),
                                       torch.nn.Linear(2 * width, width))
        self.head = torch.nn.Linear(width, 1)
        self.heads, self.group = heads, group

    def block(self, h):
        """Pre-norm causal self-attention and MLP on padded trajectories [batch, time, width]."""
        batch, time_, width = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(batch, time_, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attended.transpose(1, 2).reshape(batch, time_, width))
        return h + self.mlp(self.norm2(h))

    def forward(self, features, states, prev_actions, lengths):
        """Flat positions of trajectories of `lengths` (`flatten`'s order) -> one raw output per position. Padding
        sits after each trajectory's end, where the causal mask hides it; trajectories of similar length are
        padded together (groups of `group`) so a long one does not pad the whole batch."""
        tokens = list((self.cell(features)[states] + self.action(prev_actions)).split(lengths.tolist()))
        order = np.argsort(lengths, kind="stable")
        for members in np.array_split(order, max(1, len(order) // self.group)):
            padded = torch.nn.utils.rnn.pad_sequence([tokens[i] for i in members], batch_first=True)
            hidden = self.block(padded + sinusoid_positions(padded.shape[1], padded.shape[2]))
            for row, i in enumerate(members):
                tokens[i] = hidden[row, :lengths[i]]
        return self.head(torch.cat(tokens)).squeeze(-1)


def make_critic(network, kind, n_cells, args):
    """mlp: a 2-hidden-layer tanh MLP of phi(s_t) (tracking: of phi(s_{t-1}), phi(s_t)); sequence: SequenceCritic."""
    if network == "sequence":
        return SequenceCritic(n_cells, args.sequence_width)
    n_inputs = n_cells * (2 if kind == "tracking" else 1)
    return torch.nn.Sequential(torch.nn.Linear(n_inputs, args.hidden), torch.nn.Tanh(),
                               torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                               torch.nn.Linear(args.hidden, 1))


def network_outputs(kind, net, features, states, prev_states, prev_actions, lengths):
    """Raw outputs at each position of a flat batch. The sequence critic's output at t is a value (dense,
    anchors) or, for tracking, the increment delta_t of the token that moved the prefix (z_0 at t = 0)."""
    if isinstance(net, SequenceCritic):
        return net(features, states, prev_actions, lengths)
    return critic_outputs(kind, net, features, states, prev_states)


def tracking_logits(increments, starts):
    """z_t = z_0 + sum_{k<=t} delta_k within each trajectory of a flat batch (cumsum in float64)."""
    total = increments.double().cumsum(0)
    starts = torch.from_numpy(starts)
    before_start = (total - increments.double())[starts]  # cumsum up to the previous trajectory's end
    traj_id = torch.zeros(len(increments), dtype=torch.long)
    traj_id[starts[1:]] = 1
    return (total - before_start[traj_id.cumsum(0)]).float()


def flatten(trajs, outcomes, idx, n_cells):
    """Flat batch of trajectories idx: states, previous states (n_cells at a start), outcomes (tensors);
    start offsets and lengths (numpy)."""
    lengths = np.array([len(trajs[i]) for i in idx])
    states = np.concatenate([trajs[i] for i in idx])
    starts = np.concatenate([[0], lengths.cumsum()[:-1]])
    prev = np.concatenate([[n_cells], states[:-1]])
    prev[starts] = n_cells
    targets = torch.tensor(np.repeat(outcomes[idx], lengths), dtype=torch.float32)
    return torch.from_numpy(states), torch.from_numpy(prev), targets, starts, lengths


def reduce_loss(losses, weights, starts, reduction="seq-mean"):
    """One loss from per-position `losses` of a flat batch of trajectories (`starts`: each one's first index) and
    per-position `weights` (1 where supervised, 0 elsewhere). seq-mean: sum(w * loss) / sum(w) within each
    trajectory, then the mean over trajectories (SP3O's released launcher: slime's sum_of_sample_mean); token-mean:
    sum(w * loss) / sum(w) over the whole batch. A trajectory with no supervised position counts 0 (as slime)."""
    if reduction == "token-mean":
        return (weights * losses).sum() / weights.sum().clamp(min=1)
    traj_id = torch.zeros(len(losses), dtype=torch.long)
    traj_id[torch.as_tensor(starts[1:], dtype=torch.long)] = 1
    traj_id = traj_id.cumsum(0)
    sums = torch.zeros(len(starts)).index_add(0, traj_id, weights * losses)
    counts = torch.zeros(len(starts)).index_add(0, traj_id, weights)
    return (sums / counts.clamp(min=1)).mean()


def anchor_mask(length):
    """1 at SP3O's anchors of a trajectory of `length` positions (`sp3o.anchor_positions`), 0 elsewhere."""
    return np.bincount(anchor_positions(length), minlength=length).astype(np.float32)


def critic_loss(kind, out, targets, starts, anchors, reduction="seq-mean"):
    """Loss of one flat batch (`flatten`; out: the critic's raw outputs; anchors: the trajectories' `anchor_mask`s,
    concatenated), reduced by `reduce_loss`. dense (PPO): squared error against R at every position; anchors
    (SP3O): the same at the anchors only; tracking (TPPO): BCE of sigmoid(z_t) against R at every position."""
    weights = anchors if kind == "anchors" else torch.ones(len(out))  # dense, tracking: every visited state
    if kind == "tracking":  # TPPO: z_t summed per trajectory
        losses = torch.nn.functional.binary_cross_entropy_with_logits(tracking_logits(out, starts), targets,
                                                                      reduction="none")
    else:  # PPO, SP3O: squared error against R
        losses = (out - targets) ** 2
    return reduce_loss(losses, weights, starts, reduction)


def predict(kind, net, features, trajs, actions=None):
    """Predicted values at every position of every trajectory, as a list of arrays (actions: the sequence critic's)."""
    states, prev, _, starts, lengths = flatten(trajs, np.zeros(len(trajs)), range(len(trajs)), len(features))
    prev_actions = previous_actions(actions, range(len(trajs))) if actions is not None else None
    with torch.no_grad():
        out = network_outputs(kind, net, features, states, prev, prev_actions, lengths)
        values = torch.sigmoid(tracking_logits(out, starts)) if kind == "tracking" else out
    return np.split(values.numpy(), lengths.cumsum()[:-1])


def train_critic(kind, trajs, outcomes, features, args, seed, network="mlp", actions=None):
    """One critic (network: mlp or sequence, which also reads the actions) trained by critic_loss."""
    torch.manual_seed(seed)
    net = make_critic(network, kind, features.shape[1], args)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    anchor_masks = [anchor_mask(len(t)) for t in trajs]
    batch_rng = np.random.default_rng(seed)  # the same batches for every critic
    for _ in range(args.sequence_steps if network == "sequence" else args.steps):
        idx = batch_rng.choice(len(trajs), args.batch_trajectories, replace=False)
        states, prev, targets, starts, lengths = flatten(trajs, outcomes, idx, len(features))
        prev_actions = previous_actions(actions, idx) if network == "sequence" else None
        out = network_outputs(kind, net, features, states, prev, prev_actions, lengths)
        anchors = torch.from_numpy(np.concatenate([anchor_masks[i] for i in idx]))
        loss = critic_loss(kind, out, targets, starts, anchors, args.reduction)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net


def make_task(size, map_seed, args):
    """Map, transition tables, behaviour policy and exact V^pi. A map on which the policy almost always
    or almost never wins has (nearly) no value to track, so it is redrawn with the next seed."""
    for attempt in range(100):
        desc = make_map(size, map_seed + 100_000 * attempt, args.hole_fraction)
        tables = transition_tables(gym.make("FrozenLake-v1", desc=desc, is_slippery=True).unwrapped.P)
        policy = behaviour_policy(tables, args.epsilon, args.behaviour_discount)
        v_exact = exact_values(tables, policy)
        if 0.05 < v_exact[0] < 0.95:
            break
    return desc, tables, policy, v_exact


def tabular_target_mse(train, outcomes, test, exact_trajs, positions, n):
    """No network: each cell's mean outcome over the training positions chosen by positions(T), scored
    against V^pi on the test positions of cells it saw. Shows whether those targets are unbiased."""
    cells = np.concatenate([t[positions(len(t))] for t in train])
    wins = np.concatenate([np.full(len(positions(len(t))), r) for t, r in zip(train, outcomes)])
    with np.errstate(invalid="ignore"):
        cell_mean = np.bincount(cells, wins, n) / np.bincount(cells, minlength=n)
    errors = cell_mean[np.concatenate(test)] - np.concatenate(exact_trajs)
    return float(np.nanmean(errors**2))


def run_one(size, seed, args):
    """One map: data, exact values, the three critics per network. -> metrics per (network, critic), value maps
    (the same keys and "exact"), map info."""
    map_seed = 1000 * seed + size
    desc, tables, policy, v_exact = make_task(size, map_seed, args)
    rng = np.random.default_rng(map_seed)
    train, train_r, train_actions = sample_trajectories(tables, policy, args.train_trajectories, rng, with_actions=True)
    test, _, test_actions = sample_trajectories(tables, policy, args.eval_trajectories, rng, with_actions=True)
    exact_trajs = [v_exact[t] for t in test]
    features = cell_features(size, args.rbf_width)
    flat_states, flat_exact = np.concatenate(test), np.concatenate(exact_trajs)

    def cell_map(flat_values):  # mean over visits of each cell; NaN where never visited
        with np.errstate(invalid="ignore"):
            sums = np.bincount(flat_states, flat_values, size * size)
            return (sums / np.bincount(flat_states, minlength=size * size)).reshape(size, size)

    info = {"p_success": v_exact[0], "mean_len": np.mean([len(t) for t in train]), "desc": desc,
            "tabular_all": tabular_target_mse(train, train_r, test, exact_trajs, np.arange, size**2),
            "tabular_anchors": tabular_target_mse(train, train_r, test, exact_trajs, anchor_positions, size**2)}
    unit_noise = np.random.default_rng(map_seed).standard_normal((NOISE_DRAWS, len(flat_exact)))  # for noise_floor
    maps, results = {"exact": cell_map(flat_exact)}, {}
    networks = NETWORKS if args.network == "both" else (args.network,)
    for network, kind in [(network, kind) for network in networks for kind in CRITICS]:
        net = train_critic(kind, train, train_r, features, args, map_seed, network, train_actions)
        pred = predict(kind, net, features, test, test_actions)
        flat_pred = np.concatenate(pred)
        corr = np.corrcoef(flat_pred, flat_exact)[0, 1] if flat_pred.std() > 0 else 0.0
        mse, ratio = np.mean((flat_pred - flat_exact) ** 2), std_ratio(pred, exact_trajs)
        floor = noise_floor(exact_trajs, mse, unit_noise)
        results[network, kind] = {"mse": mse, "corr": corr, "variation_ratio": ratio, "noise_floor": floor,
                                  "ratio_over_floor": ratio / floor,
                                  "sign_acc": interval_sign_accuracy(pred, exact_trajs, args.sign_min_change)}
        maps[network, kind] = cell_map(flat_pred)
    return results, maps, info


def plot_maps(maps_by_size, desc_by_size, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    labels = {"dense": "dense MSE (PPO)", "anchors": "anchors (SP3O)", "tracking": "tracking (TPPO)"}
    critics = [key for key in next(iter(maps_by_size.values())) if key != "exact"]  # (network, critic) pairs
    titles = ["exact $V^\\pi$"] + [f"{network} {labels[kind]}" for network, kind in critics]
    fig, axes = plt.subplots(len(maps_by_size), len(titles), figsize=(3 * len(titles), 2.9 * len(maps_by_size)),
                             squeeze=False, layout="constrained")
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("white")
    for row, (size, maps) in zip(axes, maps_by_size.items()):
        top = max(np.nanmax(maps["exact"]), 1e-6)  # one colour scale per size, set by the exact map
        cells = np.array([list(r) for r in desc_by_size[size]])
        holes = np.where(cells == "H", 0.0, np.nan)
        (start_row,), (start_column,) = np.nonzero(cells == "S")
        for ax, title, grid in zip(row, titles, maps.values()):
            image = ax.imshow(grid, cmap=cmap, vmin=0, vmax=top)
            ax.imshow(holes, cmap="gray", vmin=0, vmax=1)  # NaN is transparent: only holes are drawn
            ax.text(size - 1, size - 1, "G", ha="center", va="center", color="red", fontweight="bold")
            ax.text(start_column, start_row, "S", ha="center", va="center", color="red", fontweight="bold")
            ax.set_title(f"{size}x{size}: {title}", fontsize=9)
            ax.set_axis_off()
        fig.colorbar(image, ax=list(row), shrink=0.85, label="value (P(reach G) from the cell)")
    fig.suptitle("Seed 0: mean value per visited cell (S: start, G: goal, black: holes, white: never visited)")
    fig.savefig(path, dpi=110)


def main():
    args = infra.cli.parse_args(Args)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.time()
    metrics, info, maps_seed0 = {}, {}, {}  # (size, network, critic) -> per-seed metrics; size -> per-seed info
    for size, seed in tqdm([(z, s) for z in args.sizes for s in range(args.seeds)], desc="maps x critics"):
        results, maps, map_info = run_one(size, seed, args)
        for (network, kind), values in results.items():
            metrics.setdefault((size, network, kind), []).append(values)
        info.setdefault(size, []).append(map_info)
        maps_seed0.setdefault(size, maps)

    summary = []  # one row per (size, network, critic): mean and std over seeds of every number
    for (size, network, kind), per_seed in metrics.items():
        row = {"size": size, "network": network, "critic": kind}
        for name in (*per_seed[0], "p_success", "mean_len", "tabular_all", "tabular_anchors"):
            values = [m[name] for m in per_seed] if name in per_seed[0] else [i[name] for i in info[size]]
            row[name + "_mean"], row[name + "_std"] = np.nanmean(values), np.nanstd(values)
        summary.append(row)
    spread = lambda row, name, digits: f" ± {row[name + '_std']:.{digits}f}" if args.seeds > 1 else ""
    show = lambda row, name, digits=3: f"{row[name + '_mean']:.{digits}f}" + spread(row, name, digits)
    lines = ["| size | network | critic | MSE vs exact | corr vs exact | variation ratio | noise floor | ratio / floor "
             "| sign acc |", "|---" * 9 + "|"]
    lines += [f"| {r['size']}x{r['size']} | {r['network']} | {r['critic']} | {show(r, 'mse', 4)} | "
              f"{show(r, 'corr')} | {show(r, 'variation_ratio')} | {show(r, 'noise_floor')} | "
              f"{show(r, 'ratio_over_floor')} | {show(r, 'sign_acc')} |" for r in summary]
    lines += ["", "| size | P(success) | mean T | tabular target MSE, all states | tabular target MSE, anchors |",
              "|---" * 5 + "|"]
    one_per_size = {r["size"]: r for r in summary}.values()  # these columns describe the map: the same per size
    lines += [f"| {r['size']}x{r['size']} | {show(r, 'p_success', 2)} | {show(r, 'mean_len', 0)} | "
              f"{show(r, 'tabular_all', 4)} | {show(r, 'tabular_anchors', 4)} |" for r in one_per_size]
    seeds = f"Mean ± std over {args.seeds} seeds (each its own map)" if args.seeds > 1 else "One seed (one map)"
    budgets = {"mlp": f"{args.steps} Adam steps per MLP critic",
               "sequence": f"{args.sequence_steps} Adam steps per sequence critic"}
    budget = ", ".join(budgets[network] for network in dict.fromkeys(r["network"] for r in summary))  # those run
    lines.append(f"\n{seeds}; {budget}, "
                 f"{args.reduction} losses, "
                 f"{args.batch_trajectories} of {args.train_trajectories} training trajectories per step, "
                 f"{args.eval_trajectories} held-out trajectories. Noise floor: the variation ratio of V^pi plus "
                 f"i.i.d. Gaussian noise of the critic's MSE per position ({NOISE_DRAWS} draws); ratio / floor per "
                 f"seed, then averaged.")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out_dir, "metrics.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(args.out_dir, "metrics.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    plot_maps(maps_seed0, {size: per_seed[0]["desc"] for size, per_seed in info.items()},
              os.path.join(args.out_dir, "value_maps.png"))
    print(f"wrote {args.out_dir}/metrics.md, metrics.csv, value_maps.png in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
