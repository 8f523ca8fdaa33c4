"""Tests for frozenlake_demo.py: exact values checked independently, the metrics on known cases."""
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
    trajs, outcomes = fl.sample_trajectories(tables, policy, 32, np.random.default_rng(0))
    for reduction in fl.REDUCTIONS:
        args = fl.Args(steps=2, batch_trajectories=8, reduction=reduction)
        for kind in fl.CRITICS:
            seen.clear()
            fl.train_critic(kind, trajs, outcomes, fl.cell_features(4, 1.0), args, seed=0)
            assert seen == [reduction] * 2, (kind, reduction)


def test_same_seed_same_numbers():
    args = fl.Args(steps=20, train_trajectories=128, eval_trajectories=64)
    first, _, _ = fl.run_one(4, 0, args)
    second, _, _ = fl.run_one(4, 0, args)
    assert first == second
