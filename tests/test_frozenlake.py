"""Tests for frozenlake_demo.py: exact values checked independently, the metrics on known cases."""
import csv
import os
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import frozenlake_demo as fl  # noqa: E402


def env_and_tables(desc, slippery=True):
    env = gym.make("FrozenLake-v1", desc=desc, is_slippery=slippery).unwrapped
    return env, fl.transition_tables(env.P)


@pytest.fixture(scope="module")
def lake4():
    """A 4x4 slippery map whose behaviour policy wins sometimes, not always."""
    desc = fl.make_map(4, seed=4, hole_fraction=0.1)
    env, tables = env_and_tables(desc)
    policy = fl.behaviour_policy(tables, epsilon=0.1, discount=0.99)
    values = fl.exact_values(tables, policy)
    assert 0.1 < values[0] < 0.9, values[0]
    return env, tables, policy, values


def test_hand_computed_corridor():
    # Not slippery, always RIGHT (action 2): S and F reach G for sure; behind a hole nothing does.
    _, tables = env_and_tables(["SFG"], slippery=False)
    right = np.tile([0.0, 0.0, 1.0, 0.0], (3, 1))
    assert np.allclose(fl.exact_values(tables, right), [1, 1, 0])
    _, tables = env_and_tables(["SHG"], slippery=False)
    assert np.allclose(fl.exact_values(tables, right), [0, 0, 0])
    # Slippery, always RIGHT in a 1x3 corridor: up/down slips stay put, so G is reached surely.
    _, tables = env_and_tables(["SFG"])
    assert np.allclose(fl.exact_values(tables, right), [1, 1, 0])


def test_exact_solver_agrees_with_value_iteration(lake4):
    _, tables, policy, values = lake4
    iterated, _ = fl.value_iteration(tables, policy=policy, discount=1.0)
    assert np.max(np.abs(values - iterated)) < 1e-8
    uniform = np.full_like(policy, 0.25)
    iterated, _ = fl.value_iteration(tables, policy=uniform, discount=1.0)
    assert np.max(np.abs(fl.exact_values(tables, uniform) - iterated)) < 1e-8


def test_exact_solver_agrees_with_gym_rollouts(lake4):
    # Independent of the demo's sampler: episodes through the environment's own step().
    env, _, policy, values = lake4
    rng = np.random.default_rng(0)
    env.reset(seed=0)
    starts = [0] + [s for s in range(1, 16) if 0.1 < values[s] < 0.9][:1]
    for start in starts:
        returns = []
        for _ in range(2000):
            env.s, done, ret = start, False, 0.0
            while not done:
                _, reward, done, _, _ = env.step(int(rng.choice(4, p=policy[env.s])))
                ret += reward
            returns.append(ret)
        stderr = np.std(returns) / np.sqrt(len(returns))
        assert abs(np.mean(returns) - values[start]) < 4 * stderr, (start, np.mean(returns), values[start])


def test_sampler_agrees_with_exact_values(lake4):
    _, tables, policy, values = lake4
    trajs, outcomes = fl.sample_trajectories(tables, policy, 4000, np.random.default_rng(1))
    assert all(t[0] == 0 for t in trajs) and set(np.unique(outcomes)) <= {0.0, 1.0}
    stderr = outcomes.std() / np.sqrt(len(outcomes))
    assert abs(outcomes.mean() - values[0]) < 4 * stderr


def test_maps_are_solvable():
    for size in (4, 8, 16):
        for seed in range(3):
            _, tables = env_and_tables(fl.make_map(size, seed))
            optimal, _ = fl.value_iteration(tables, discount=1.0, tol=1e-9)
            assert optimal[0] > 0


def test_std_ratio():
    rng = np.random.default_rng(0)
    exact = [rng.random(n) for n in (5, 9, 2)]
    assert fl.std_ratio([np.full(len(e), 0.3) for e in exact], exact) == 0.0
    assert fl.std_ratio(exact, exact) == pytest.approx(1.0)
    halved = [e.mean() + 0.5 * (e - e.mean()) for e in exact]
    assert fl.std_ratio(halved, exact) == pytest.approx(0.5)
    assert np.isnan(fl.std_ratio(exact, [np.full(len(e), 1.0) for e in exact]))  # nothing to track


def test_noise_floor_zero_noise_is_one():
    exact = [np.array([0.1, 0.4, 0.9]), np.array([0.5, 0.2]), np.array([0.7])]
    unit_noise = np.random.default_rng(0).standard_normal((3, 6))
    assert fl.noise_floor(exact, 0.0, unit_noise) == 1.0


def test_noise_floor_by_hand():
    # V^pi: a = [0, 1] (std 0.5), b = [0.5, 0.5] (std 0), c = [0.3] (one position: left out, as std_ratio does).
    # Noise sd = sqrt(0.01) = 0.1. Draw 1 [1, -1 | 1, -1 | 5]: a -> [0.1, 0.9] std 0.4, b -> [0.6, 0.4] std 0.1,
    # ratio (0.4 + 0.1) / 0.5 = 1.0. Draw 2 [0, 0 | 0, 2 | -3]: a unchanged std 0.5, b -> [0.5, 0.7] std 0.1,
    # ratio 0.6 / 0.5 = 1.2. Floor: the mean, 1.1.
    exact = [np.array([0.0, 1.0]), np.array([0.5, 0.5]), np.array([0.3])]
    unit_noise = [np.array([1.0, -1.0, 1.0, -1.0, 5.0]), np.array([0.0, 0.0, 0.0, 2.0, -3.0])]
    assert fl.noise_floor(exact, 0.01, unit_noise) == pytest.approx(1.1)
    assert fl.noise_floor(exact, 0.01, unit_noise[1:]) == pytest.approx(1.2)


def test_noise_floor_grows_with_noise():
    # Many trajectories: more noise, more within-trajectory variation, a higher floor (always above 1 here).
    rng = np.random.default_rng(0)
    exact = [np.linspace(0.2, 0.8, n) for n in rng.integers(2, 30, 300)]
    unit_noise = rng.standard_normal((4, sum(len(e) for e in exact)))
    floors = [fl.noise_floor(exact, mse, unit_noise) for mse in (1e-4, 1e-3, 1e-2, 1e-1)]
    assert 1.0 < floors[0] < floors[1] < floors[2] < floors[3], floors


def test_noise_floor_when_exact_values_are_flat():
    # V^pi constant in each trajectory: the ratio has no denominator. Any noise is all the variation (inf);
    # no noise and no variation is undefined (NaN, as std_ratio).
    exact = [np.full(3, 0.4), np.full(2, 0.9), np.array([0.1])]
    unit_noise = np.ones((2, 6))
    assert fl.noise_floor(exact, 0.01, unit_noise) == float("inf")
    assert np.isnan(fl.noise_floor(exact, 0.0, unit_noise))


def test_noise_floor_rejects_bad_input():
    exact = [np.array([0.0, 1.0])]
    with pytest.raises(ValueError, match="mse must be >= 0"):
        fl.noise_floor(exact, -0.1, np.zeros((1, 2)))
    with pytest.raises(ValueError, match="one value per position"):
        fl.noise_floor(exact, 0.1, np.zeros((1, 3)))


def test_interval_sign_accuracy():
    exact = [np.linspace(0, 1, 11), np.array([0.5, 0.9, 0.2, 0.8, 0.1, 0.7, 0.3, 0.6, 0.4, 0.5, 0.0])]
    assert fl.interval_sign_accuracy(exact, exact) == 1.0
    assert fl.interval_sign_accuracy([-e for e in exact], exact) == 0.0
    assert fl.interval_sign_accuracy([np.zeros(11)] * 2, exact) == 0.0  # a flat critic gets no sign right
    # Points 0, 3, 6, 9 (anchors of n=11): second trajectory moves 0.5 -> 0.8 -> 0.3 -> 0.5.
    half_right = [exact[0], np.array([0.5, 0, 0, 0.9, 0, 0, 0.95, 0, 0, 1.0, 0])]
    assert fl.interval_sign_accuracy(half_right, exact) == pytest.approx(5 / 6)


def test_anchor_rule_is_imported_from_sp3o():
    import sp3o
    assert fl.anchor_positions is sp3o.anchor_positions
    with open(fl.__file__) as f:
        assert "def anchor_positions" not in f.read()


def test_tracking_logits_sum_increments_per_trajectory():
    increments = torch.tensor([1.0, 2.0, 3.0, 10.0, -1.0, 5.0])
    starts = np.array([0, 3, 5])
    expected = torch.tensor([1.0, 3.0, 6.0, 10.0, 9.0, 5.0])
    assert torch.allclose(fl.tracking_logits(increments, starts), expected)


def test_reduce_loss_by_hand():
    # Two trajectories: positions 0..2 (losses 1, 2, 6) and 3..4 (losses 4, 8); starts [0, 3].
    losses, starts = torch.tensor([1.0, 2.0, 6.0, 4.0, 8.0]), np.array([0, 3])
    dense = torch.ones(5)
    # seq-mean (SP3O's launcher): (1 + 2 + 6) / 3 = 3 and (4 + 8) / 2 = 6, then (3 + 6) / 2 = 4.5
    assert fl.reduce_loss(losses, dense, starts, "seq-mean").item() == pytest.approx(4.5)
    # token-mean: 21 / 5 = 4.2
    assert fl.reduce_loss(losses, dense, starts, "token-mean").item() == pytest.approx(4.2)
    # anchors at positions 1, 2 and 4: seq-mean (2 + 6) / 2 = 4 and 8, mean 6; token-mean (2 + 6 + 8) / 3
    anchors = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0])
    assert fl.reduce_loss(losses, anchors, starts, "seq-mean").item() == pytest.approx(6.0)
    assert fl.reduce_loss(losses, anchors, starts, "token-mean").item() == pytest.approx(16 / 3)


def test_every_critic_uses_the_chosen_reduction(monkeypatch):
    seen = []
    original = fl.reduce_loss
    monkeypatch.setattr(fl, "reduce_loss", lambda *a: seen.append(a[3]) or original(*a))
    _, tables = env_and_tables(fl.make_map(4, 4))
    policy = fl.behaviour_policy(tables, 0.1, 0.99)
    trajs, outcomes, actions = fl.sample_trajectories(tables, policy, 32, np.random.default_rng(0), with_actions=True)
    for reduction in fl.REDUCTIONS:
        args = fl.Args(steps=2, sequence_steps=2, batch_trajectories=8, reduction=reduction)
        for network in fl.NETWORKS:
            for kind in fl.CRITICS:
                seen.clear()
                fl.train_critic(kind, trajs, outcomes, fl.cell_features(4, 1.0), args, 0, network, actions)
                assert seen == [reduction] * 2, (network, kind, reduction)


def test_same_seed_same_numbers():
    args = fl.Args(steps=20, sequence_steps=10, train_trajectories=128, eval_trajectories=64)
    first, _, _ = fl.run_one(4, 0, args)
    second, _, _ = fl.run_one(4, 0, args)
    assert set(first) == {(network, kind) for network in fl.NETWORKS for kind in fl.CRITICS}
    assert first == second
    for values in first.values():  # the floor sits beside the ratio, and the table's quotient is the two's
        assert values["noise_floor"] > 0
        assert values["ratio_over_floor"] == pytest.approx(values["variation_ratio"] / values["noise_floor"])


# ---------------------------------------------------------------- hand-built trajectories: batch, losses, critics
def test_flatten_by_hand():
    trajs = [np.array([0, 1, 2]), np.array([5]), np.array([3, 4])]
    states, prev, targets, starts, lengths = fl.flatten(trajs, np.array([1.0, 0.0, 0.5]), [2, 0, 1], n_cells=9)
    assert states.tolist() == [3, 4, 0, 1, 2, 5]
    assert prev.tolist() == [9, 3, 9, 0, 1, 9]  # n_cells at each trajectory's start, else the cell before
    assert targets.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 0.0]  # each position gets its trajectory's outcome
    assert starts.tolist() == [0, 2, 5] and lengths.tolist() == [2, 3, 1]


def test_anchor_mask_by_hand():
    assert fl.anchor_mask(11).tolist() == [0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0]  # anchors 3, 6, 9
    assert fl.anchor_mask(4).tolist() == [0, 1, 1, 0]  # anchors 1, 2
    assert fl.anchor_mask(2).tolist() == [1, 0] and fl.anchor_mask(1).tolist() == [1]


def test_critic_losses_by_hand():
    # Two trajectories, T = 4 (R = 1, anchors 1 and 2) and T = 2 (R = 0, anchor 0), flat as `flatten` gives them.
    out = torch.tensor([0.0, 0.5, 1.0, 3.0, 0.2, -2.0], requires_grad=True)
    targets = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    starts = np.array([0, 4])
    anchors = torch.from_numpy(np.concatenate([fl.anchor_mask(4), fl.anchor_mask(2)]))
    squared = [1.0, 0.25, 0.0, 4.0, 0.04, 4.0]
    # dense, seq-mean (the default): each trajectory's mean, then the mean of the 2; token-mean: over the 6
    dense = fl.critic_loss("dense", out, targets, starts, anchors)
    assert dense.item() == pytest.approx((sum(squared[:4]) / 4 + sum(squared[4:]) / 2) / 2)
    token_mean = fl.critic_loss("dense", out, targets, starts, anchors, "token-mean")
    assert token_mean.item() == pytest.approx(sum(squared) / 6)
    # anchors: (0.25 + 0) / 2 for the first trajectory, 0.04 for the second, mean over the 2 trajectories
    anchored = fl.critic_loss("anchors", out, targets, starts, anchors)
    assert anchored.item() == pytest.approx(((0.25 + 0.0) / 2 + 0.04) / 2)
    anchored.backward()
    assert out.grad.tolist() == pytest.approx([0, 2 * -0.5 / 4, 0, 0, 2 * 0.2 / 2, 0])  # nothing off the anchors
    # token-mean over the 3 anchors
    assert fl.critic_loss("anchors", out, targets, starts, anchors, "token-mean").item() == pytest.approx(0.29 / 3)
    # tracking: z = cumsum per trajectory = [0, 0.5, 1.5, 4.5 | 0.2, -1.8]; BCE at every position, seq-mean
    z = torch.tensor([0.0, 0.5, 1.5, 4.5, 0.2, -1.8])
    bce = torch.cat([torch.nn.functional.softplus(-z[:4]), torch.nn.functional.softplus(z[4:])])
    by_hand = (bce[:4].mean() + bce[4:].mean()) / 2
    assert fl.critic_loss("tracking", out, targets, starts, anchors).item() == pytest.approx(by_hand.item(), abs=1e-6)


def test_each_critic_learns_its_own_targets():
    # 2x2 map; path 0 -> 3 always wins, path 3 -> 0 always loses. Dense targets: R at every position, so each cell
    # sees 1 and 0 equally: 1/2. Anchors (T = 2: position 0 only): cell 0 -> 1, cell 3 -> 0. Tracking: V follows
    # the path (z_0 from the start cell): ~1 on the winning path, ~0 on the losing one.
    trajs = [np.array([0, 3])] * 4 + [np.array([3, 0])] * 4
    outcomes = np.array([1.0] * 4 + [0.0] * 4)
    features = fl.cell_features(2, 1.0)
    args = fl.Args(steps=200, batch_trajectories=8, hidden=16, lr=1e-2)
    expected = {"dense": [[0.5, 0.5], [0.5, 0.5]], "anchors": [[1, 0], [0, 1]], "tracking": [[1, 1], [0, 0]]}
    for kind in fl.CRITICS:
        net = fl.train_critic(kind, trajs, outcomes, features, args, seed=0)
        predicted = fl.predict(kind, net, features, [np.array([0, 3]), np.array([3, 0])])
        assert np.allclose(predicted, expected[kind], atol=0.05), (kind, predicted)


def test_predict_by_hand():
    # One-hot cells and linear critics: dense reads w[cell]; tracking reads a[previous or start] + b[cell] per
    # transition and accumulates it along the trajectory before the sigmoid.
    features = torch.eye(3)
    dense = torch.nn.Linear(3, 1, bias=False)
    tracking = torch.nn.Linear(6, 1, bias=False)
    with torch.no_grad():
        dense.weight[:] = torch.tensor([[0.1, 0.2, 0.3]])
        tracking.weight[:] = torch.tensor([[0.1, 0.2, 0.3, -1.0, 0.5, 0.25]])  # a, then b; a[start] = 0 (zero input)
    trajs = [np.array([0, 2, 1]), np.array([2])]
    values = fl.predict("dense", dense, features, trajs)
    assert [v.tolist() for v in values] == [pytest.approx([0.1, 0.3, 0.2]), pytest.approx([0.3])]
    values = fl.predict("tracking", tracking, features, trajs)
    # z_0 = b[s_0] = -1; delta_1 = a[0] + b[2] = 0.35; delta_2 = a[2] + b[1] = 0.8. Second trajectory: b[2].
    logits = [[-1.0, -0.65, 0.15], [0.25]]
    assert values[0].tolist() == pytest.approx(torch.sigmoid(torch.tensor(logits[0])).tolist())
    assert values[1].tolist() == pytest.approx(torch.sigmoid(torch.tensor(logits[1])).tolist())


def test_tabular_target_mse_by_hand():
    # Cell 0 visited by both training trajectories (R = 1, R = 0), cell 1 by the first, cell 2 by the second:
    # all positions: means 0.5, 1, 0. Anchors (T = 2: position 0 only): cell 0 -> 0.5; cells 1 and 2 unseen.
    train = [np.array([0, 1]), np.array([0, 2])]
    outcomes = np.array([1.0, 0.0])
    test, exact = [np.array([0, 1]), np.array([2])], [np.array([0.7, 0.9]), np.array([0.4])]
    all_positions = fl.tabular_target_mse(train, outcomes, test, exact, np.arange, 3)
    assert all_positions == pytest.approx((0.2 ** 2 + 0.1 ** 2 + 0.4 ** 2) / 3)
    anchors = fl.tabular_target_mse(train, outcomes, test, exact, fl.anchor_positions, 3)
    assert anchors == pytest.approx(0.2 ** 2)  # only cell 0 was seen at an anchor; the others are NaN, left out


# ------------------------------------------------------------ the sequence critic: a causal transformer of the prefix
def test_actions_are_recorded_without_changing_the_draws(lake4):
    _, tables, policy, _ = lake4
    trajs, outcomes = fl.sample_trajectories(tables, policy, 200, np.random.default_rng(3))
    same, same_outcomes, actions = fl.sample_trajectories(tables, policy, 200, np.random.default_rng(3),
                                                          with_actions=True)
    assert all(np.array_equal(a, b) for a, b in zip(trajs, same)) and np.array_equal(outcomes, same_outcomes)
    nxt, prob, _, _ = tables
    for states, acts in zip(trajs, actions):
        assert len(acts) == len(states) and set(acts.tolist()) <= {0, 1, 2, 3}
        for s, a, s_next in zip(states[:-1], acts[:-1], states[1:]):  # a_t taken at s_t can lead to s_{t+1}
            assert prob[s, a][nxt[s, a] == s_next].sum() > 0


def test_previous_actions_by_hand():
    actions = [np.array([2, 1, 0]), np.array([3])]
    start = fl.START_ACTION
    assert fl.previous_actions(actions, [1, 0]).tolist() == [start, start, 2, 1]  # `flatten`'s order: idx 1, then 0


def sequence_inputs(trajs, actions, n_cells):
    states, _, _, _, lengths = fl.flatten(trajs, np.zeros(len(trajs)), range(len(trajs)), n_cells)
    return states, fl.previous_actions(actions, range(len(trajs))), lengths


def test_sequence_critic_is_causal():
    # Output t may read tokens 0..t only: change the cell at position 3 (token 3) and the action taken there
    # (token 4's previous action) of the first trajectory; its outputs 0..2 and the other trajectories' outputs stay.
    torch.manual_seed(0)
    features = fl.cell_features(3, 1.0)
    net = fl.SequenceCritic(9, width=16, group=2)
    trajs = [np.array([0, 1, 4, 5, 8, 7]), np.array([0, 3]), np.array([0, 1, 2, 5])]
    actions = [np.array([2, 1, 2, 1, 0, 3]), np.array([1, 0]), np.array([2, 2, 1, 1])]
    changed = [np.array([0, 1, 4, 7, 8, 7])] + trajs[1:]
    changed_actions = [np.array([2, 1, 2, 3, 0, 3])] + actions[1:]
    with torch.no_grad():
        before = net(features, *sequence_inputs(trajs, actions, 9))
        after = net(features, *sequence_inputs(changed, changed_actions, 9))
    assert torch.equal(before[:3], after[:3])  # positions 0..2 of the first trajectory
    assert (before[3:6] - after[3:6]).abs().min() > 1e-6  # positions 3..5 read the change
    assert torch.equal(before[6:], after[6:])  # the other trajectories


def test_sequence_critic_does_not_depend_on_the_batch():
    # Padding and grouping by length change nothing: each trajectory alone gives the outputs it gets in a batch.
    torch.manual_seed(0)
    features = fl.cell_features(3, 1.0)
    net = fl.SequenceCritic(9, width=16, group=2)
    rng = np.random.default_rng(0)
    trajs = [rng.integers(0, 9, n) for n in (7, 1, 4, 12, 3)]
    actions = [rng.integers(0, 4, len(t)) for t in trajs]
    with torch.no_grad():
        batched = net(features, *sequence_inputs(trajs, actions, 9)).split([len(t) for t in trajs])
        for i, t in enumerate(trajs):
            alone = net(features, *sequence_inputs([t], [actions[i]], 9))
            assert torch.allclose(alone, batched[i], atol=1e-5), i


def test_sequence_critic_learns_values_of_prefixes():
    # The hand-built 2x2 case of test_each_critic_learns_its_own_targets: path 0 -> 3 always wins, 3 -> 0 always
    # loses. The MLP's dense critic must give 1/2 to each cell; the prefix (0, 3) differs from the prefix (3, 0), so
    # the sequence critic's dense targets are 1 on the winning path and 0 on the losing one. Anchors (position 0
    # only): 1 for the prefix (0), 0 for (3). Tracking: as dense.
    trajs = [np.array([0, 3])] * 4 + [np.array([3, 0])] * 4
    outcomes = np.array([1.0] * 4 + [0.0] * 4)
    actions = [np.array([1, 2])] * 8
    features = fl.cell_features(2, 1.0)
    args = fl.Args(sequence_steps=200, batch_trajectories=8, sequence_width=16, lr=1e-2)
    paths, path_actions = [np.array([0, 3]), np.array([3, 0])], [np.array([1, 2])] * 2
    for kind in fl.CRITICS:
        net = fl.train_critic(kind, trajs, outcomes, features, args, 0, "sequence", actions)
        predicted = fl.predict(kind, net, features, paths, path_actions)
        if kind == "anchors":
            predicted = [p[:1] for p in predicted]  # the second position is never supervised
            assert np.allclose(predicted, [[1], [0]], atol=0.05), (kind, predicted)
        else:
            assert np.allclose(predicted, [[1, 1], [0, 0]], atol=0.05), (kind, predicted)


def test_dense_sequence_critic_fits_exact_values(lake4):
    # Trained on the outcomes alone, the dense sequence critic approaches V^pi on held-out trajectories: its MSE
    # against V^pi is well below that of the best constant (the variance of V^pi over visited positions; measured
    # 0.18 of it here, 0.25 with training seed 1).
    _, tables, policy, values = lake4
    rng = np.random.default_rng(0)
    train, outcomes, actions = fl.sample_trajectories(tables, policy, 1024, rng, with_actions=True)
    test, _, test_actions = fl.sample_trajectories(tables, policy, 200, rng, with_actions=True)
    args = fl.Args(sequence_steps=600, batch_trajectories=32, reduction="token-mean")
    features = fl.cell_features(4, 1.0)
    net = fl.train_critic("dense", train, outcomes, features, args, 0, "sequence", actions)
    predicted = np.concatenate(fl.predict("dense", net, features, test, test_actions))
    exact = np.concatenate([values[t] for t in test])
    assert np.mean((predicted - exact) ** 2) < 0.5 * np.var(exact), (np.mean((predicted - exact) ** 2), np.var(exact))


def test_cli_network_option(tmp_path, monkeypatch):
    tiny = ["--sizes", "4", "--seeds", "1", "--steps", "2", "--sequence-steps", "2", "--train-trajectories", "64",
            "--eval-trajectories", "16"]
    for network, expected in [("sequence", {"sequence"}), ("both", {"mlp", "sequence"}), ("mlp", {"mlp"})]:
        out_dir = tmp_path / network
        monkeypatch.setattr(sys, "argv", ["frozenlake_demo.py", *tiny, "--network", network, "--out-dir", str(out_dir)])
        fl.main()
        with open(out_dir / "metrics.csv") as f:
            rows = list(csv.DictReader(f))
        assert {row["network"] for row in rows} == expected
        assert sorted((row["network"], row["critic"]) for row in rows) == sorted(
            (n, kind) for n in expected for kind in fl.CRITICS)
        assert (out_dir / "value_maps.png").exists()
