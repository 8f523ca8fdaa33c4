"""Tests for ppo.py: GAE, whitening, terminal rewards and the clipped value loss against hand-computed values,
and a 2-step end-to-end run on the tiny model."""
import importlib
import inspect
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import infra.cli  # noqa: E402
import ppo  # noqa: E402

# Two responses: row 0 has 3 valid tokens and R = 1; row 1 has 2 valid tokens and R = 0, its padding value 9 is junk.
MASK = torch.tensor([[True, True, True], [True, True, False]])
VALUES = torch.tensor([[0.5, 0.2, 0.8], [0.4, 0.6, 9.0]])
REWARDS = torch.tensor([1.0, 0.0])


def test_terminal_rewards_put_r_on_the_last_valid_token():
    token_rewards = ppo.terminal_rewards(REWARDS, MASK)
    assert token_rewards.tolist() == [[0, 0, 1], [0, 0, 0]]
    token_rewards = ppo.terminal_rewards(torch.tensor([1.0, 1.0]), MASK)
    assert token_rewards.tolist() == [[0, 0, 1], [0, 1, 0]]  # row 1 ends at t = 1, not at the padded column
    empty = torch.tensor([[False, False]])  # an empty response gets no reward anywhere
    assert ppo.terminal_rewards(torch.tensor([1.0]), empty).tolist() == [[0, 0]]


def test_gae_lambda_one_by_hand():
    advantages, returns = ppo.gae(ppo.terminal_rewards(REWARDS, MASK), VALUES, MASK, gamma=1.0, lam=1.0)
    # lambda = 1: A_t = R - V_t. Row 0: 1 - [0.5, 0.2, 0.8]; row 1: 0 - [0.4, 0.6], padding 0.
    assert torch.allclose(advantages, torch.tensor([[0.5, 0.8, 0.2], [-0.4, -0.6, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_gae_lambda_half_by_hand():
    advantages, returns = ppo.gae(ppo.terminal_rewards(REWARDS, MASK), VALUES, MASK, gamma=1.0, lam=0.5)
    # Row 0: delta_2 = 1 - 0.8 = 0.2, delta_1 = 0.8 - 0.2 = 0.6, delta_0 = 0.2 - 0.5 = -0.3;
    #   A_2 = 0.2, A_1 = 0.6 + 0.5 * 0.2 = 0.7, A_0 = -0.3 + 0.5 * 0.7 = 0.05; G = A + V = [0.55, 0.9, 1.0].
    # Row 1: no value after the last valid token (the junk 9 is ignored): delta_1 = 0 - 0.6 = -0.6,
    #   delta_0 = 0.6 - 0.4 = 0.2; A_1 = -0.6, A_0 = 0.2 + 0.5 * -0.6 = -0.1; G = [0.3, 0.0].
    assert torch.allclose(advantages, torch.tensor([[0.05, 0.7, 0.2], [-0.1, -0.6, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.55, 0.9, 1.0], [0.3, 0.0, 0.0]]))


def test_gae_discount_by_hand():
    advantages, returns = ppo.gae(ppo.terminal_rewards(REWARDS, MASK), VALUES, MASK, gamma=0.9, lam=1.0)
    # Row 0: delta_2 = 0.2, delta_1 = 0.9 * 0.8 - 0.2 = 0.52, delta_0 = 0.9 * 0.2 - 0.5 = -0.32;
    #   A_2 = 0.2, A_1 = 0.52 + 0.9 * 0.2 = 0.7, A_0 = -0.32 + 0.9 * 0.7 = 0.31; returns gamma^(T-1-t) R.
    assert torch.allclose(advantages[0], torch.tensor([0.31, 0.7, 0.2]))
    assert torch.allclose(returns[0], torch.tensor([0.81, 0.9, 1.0]))


def test_gae_gamma_lambda_one_gives_r_minus_v_everywhere():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 7, 4, 9, 9, 2])
    mask = torch.arange(9)[None, :] < lengths[:, None]
    values = torch.rand(6, 9, generator=generator)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    advantages, returns = ppo.gae(ppo.terminal_rewards(rewards, mask), values, mask)
    assert torch.allclose(advantages, (rewards[:, None] - values) * mask, atol=1e-6)
    assert torch.allclose(returns, rewards[:, None] * mask, atol=1e-6)


def test_whiten_uses_valid_tokens_only():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # valid: 1..5, mean 3, unbiased std sqrt(10 / 4); the 100 on padding takes no part and reads 0.
    expected = torch.tensor([[-2.0, -1.0, 0.0], [1.0, 2.0, 0.0]]) / math.sqrt(2.5)
    assert torch.allclose(ppo.whiten(values, mask), expected, atol=1e-6)


def test_value_loss_clips_around_old_values_by_hand():
    values = torch.tensor([[0.5, 0.5, 0.0]])
    old_values = torch.tensor([[0.1, 0.4, 0.0]])
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    # t=0: v_clip = 0.1 + 0.2 = 0.3, max((0.5-1)^2, (0.3-1)^2) = 0.49; t=1: v_clip = v, 0.25. Mean: 0.37.
    assert ppo.value_loss(values, old_values, returns, mask, clip=0.2).item() == pytest.approx(0.37)
    # Micro-batches given the mini-batch's token count add up to the mini-batch loss.
    halves = [ppo.value_loss(values[:, s], old_values[:, s], returns[:, s], mask[:, s], 0.2, num_tokens=2)
              for s in (slice(0, 1), slice(1, 3))]
    assert sum(h.item() for h in halves) == pytest.approx(0.37)


TRAINERS = infra.cli.trainers()  # forks too


@pytest.mark.parametrize("name", TRAINERS)
def test_one_extreme_token_keeps_the_policy_loss_and_kl_finite(name):
    module = importlib.import_module(name)
    bound = module.MAX_LOG_RATIO
    assert bound == (10.0 if name == "spo" else 20.0)  # SPO's ppo_trainer.py clamps at 10, verl's core_algos at 20
    # token 0: log-ratio +1000 (exp overflows) with A < 0; token 1: an ordinary token; token 2: padding whose old
    # log-prob is -inf (exp(inf) * A = 0 would be NaN, and NaN * mask 0 stays NaN)
    logprobs = torch.tensor([[0.0, -1.0, 0.0]], requires_grad=True)
    old_logprobs = torch.tensor([[-1000.0, -1.1, float("-inf")]])
    advantages, mask = torch.tensor([[-1.0, 0.5, 0.0]]), torch.tensor([[True, True, False]])
    loss, clip_fraction = module.policy_loss(logprobs, old_logprobs, advantages, mask)
    # token 0: r = e^bound (clamped): max(e^bound, 1.2) = e^bound; token 1: r = e^0.1 inside the clip range,
    # -0.5 e^0.1; token-mean over the 2 valid tokens
    assert loss.item() == pytest.approx((math.exp(bound) - 0.5 * math.exp(0.1)) / 2, rel=1e-5)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all() and torch.isfinite(clip_fraction)
    assert logprobs.grad[0, 0] == 0  # beyond the clamp the token gives no gradient (as verl and SPO)
    kl = module.k3_kl(torch.zeros(2), torch.tensor([1000.0, -1000.0]))  # k3 = e^d - d - 1 with d clamped
    assert torch.allclose(kl, torch.tensor([math.exp(bound) - bound - 1, math.exp(-bound) + bound - 1]))


def test_policy_loss_and_k3_are_the_same_code_in_every_trainer():
    sources = {name: inspect.getsource(importlib.import_module(name).policy_loss) for name in TRAINERS
               if name != "sppo"}
    assert len(set(sources.values())) == 1  # sppo adds dual-clip to the same function
    sppo_source = inspect.getsource(importlib.import_module("sppo").policy_loss)
    assert "torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))" in sppo_source
    assert len({inspect.getsource(importlib.import_module(name).k3_kl) for name in TRAINERS}) == 1


def run_trainer(script, tmp_path, name, *extra):
    """Run `script` for 2 steps on the tiny model; returns the metrics.jsonl records."""
    command = [sys.executable, os.path.join(ROOT, script), "--steps", "2", "--prompts-per-step", "4",
               "--eval-problems", "16", "--micro-batch-size", "16", "--run-name", name, "--output-dir", str(tmp_path),
               *extra]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as handle:
        return [json.loads(line) for line in handle]


def test_published_defaults_are_sp3os_ppo_preset():
    import infra.run
    args = infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    assert (args.whiten_advantages, args.critic_warmup, args.aggregation) == (False, 20, "seq-mean")
    assert (args.lr, args.critic_lr, args.weight_decay, args.adam_betas) == (1e-6, 4e-6, 0.1, (0.9, 0.98))
    tiny = infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, [])
    assert (tiny.critic_warmup, tiny.critic_epochs, tiny.epochs, tiny.steps) == (5, 4, 1, 30)  # the 30-step demo
    assert args.critic_epochs == 0  # published: the critic's passes are the actor's (--epochs 1)
    verl = infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, ["--whiten-advantages", "--aggregation", "token-mean",
                                                            "--critic-warmup", "0"])
    assert (verl.whiten_advantages, verl.aggregation, verl.critic_warmup) == (True, "token-mean", 0)


def test_ppo_two_steps_end_to_end(tmp_path):  # verl's community PPO: the actor trains from the first step
    records = run_trainer("ppo.py", tmp_path, "e2e_ppo", "--whiten-advantages", "--aggregation", "token-mean",
                          "--critic-warmup", "0")
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert 0.0 <= record["eval/accuracy"] <= 1.0  # evaluated at the first and the last step
        assert 0.0 <= record["reward"] <= 1.0
        for key in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "approx_kl"):
            assert math.isfinite(record[key]), key
        assert record["value_loss"] > 0 and record["skipped_updates"] == 0
    assert records[0]["approx_kl"] > 1e-5  # the second mini-batch sees an updated actor


def test_whiten_single_valid_token_gives_zero_not_nan():
    # One valid token: its mean is itself, so (x - mean) = 0; the unbiased std of one value would be NaN.
    values = torch.tensor([[0.7, 0.0, 0.0]])
    mask = torch.tensor([[True, False, False]])
    assert torch.equal(ppo.whiten(values, mask), torch.zeros(1, 3))
