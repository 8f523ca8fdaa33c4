"""Tests for tppo.py: the tracking-value logits (z_0 plus the cumulative increments), the critic's column
alignment for both heads, the BCE critic loss and its gradient, and 2-step end-to-end runs of both heads."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import infra.probes  # noqa: E402
import tppo  # noqa: E402
import infra.cli
import infra.run


def test_tracking_logits_are_z0_plus_cumulative_increments():
    init_logit = torch.tensor([0.5, -1.0])
    increments = torch.tensor([[9.0, 1.0, 2.0, 3.0], [9.0, 0.5, 7.0, 7.0]])  # column 0 (s_0): z_0, not an increment
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    # Row 0: 0.5, 0.5 + 1, 1.5 + 2, 3.5 + 3. Row 1: -1, -1 + 0.5, then padding reads 0 (the 7s are ignored).
    expected = torch.tensor([[0.5, 1.5, 3.5, 6.5], [-1.0, -0.5, 0.0, 0.0]])
    assert torch.equal(tppo.tracking_value_logits(init_logit, increments, mask), expected)


def test_tracking_logits_ignore_padding_values():
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 0])[:, None]
    increments, init_logit = torch.randn(4, 6), torch.randn(4)
    junk = torch.where(mask, increments, torch.full_like(increments, 1e6))
    assert torch.equal(tppo.tracking_value_logits(init_logit, increments, mask),
                       tppo.tracking_value_logits(init_logit, junk, mask))
    logits = tppo.tracking_value_logits(init_logit, increments, mask)
    assert not logits[~mask].any() and torch.equal(logits[:3, 0], init_logit[:3])
    # A masked token inside a response adds no increment: the logit carries over it.
    holed = torch.tensor([[True, False, True]])
    logits = tppo.tracking_value_logits(torch.tensor([1.0]), torch.tensor([[5.0, 2.0, 3.0]]), holed)
    assert logits.tolist() == [[1.0, 0.0, 4.0]]


class FakeCritic(torch.nn.Module):
    """A stand-in for the value-head model: returns fixed per-column outputs [b, columns, labels]."""
    def __init__(self, outputs):
        super().__init__()
        self.outputs = outputs

    def forward(self, **inputs):
        return SimpleNamespace(logits=self.outputs)


def test_critic_logits_read_z0_at_the_last_prompt_token():
    batch = common.sequence_batch([[5, 6], [7]], [[8, 9, 10], [11]], pad_id=0)  # 2 + 3 columns
    outputs = torch.arange(10, dtype=torch.float32).view(2, 5, 1)  # row 0: 0..4, row 1: 5..9
    # Response columns start at 2; s_0 is column 1 (the last prompt token), s_1 column 2, s_2 column 3.
    # Row 0: z = 1, 1 + 2, 3 + 3 = [1, 3, 6]; row 1 has 1 response token: z = [6], padding 0.
    assert tppo.critic_logits(FakeCritic(outputs), batch).tolist() == [[1.0, 3.0, 6.0], [6.0, 0.0, 0.0]]
    # Separate head: z_0 is the second output at s_0 (here 100 + column); increments stay the first output.
    two = torch.cat([outputs, outputs + 100], dim=2)
    separate = tppo.critic_logits(FakeCritic(two), batch, "separate")
    assert separate.tolist() == [[101.0, 103.0, 106.0], [106.0, 0.0, 0.0]]


def test_bce_at_zero_logits_and_its_gradient_by_hand():
    init_logit = torch.zeros(1, requires_grad=True)
    increments = torch.zeros(1, 3, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logits = tppo.tracking_value_logits(init_logit, increments, mask)
    loss = tppo.value_loss(logits, torch.ones(1, 3), mask)
    assert loss.item() == pytest.approx(math.log(2))  # V_t = 1/2 everywhere, R = 1: -log(1/2) per token
    loss.backward()
    # dL/dz_t = (V_t - R) / 3 = -1/6 for each t; z_0 feeds all 3 logits, delta_1 two, delta_2 one; delta at s_0 none.
    assert init_logit.grad.item() == pytest.approx(-0.5)
    assert torch.allclose(increments.grad, torch.tensor([[0.0, -1 / 3, -1 / 6]]))


def test_bce_pushes_values_toward_the_outcome():
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3])[:, None]
    returns = torch.tensor([[1.0] * 5, [0.0] * 5])  # R = 1 for row 0, R = 0 for row 1 (every target is R)
    init_logit = torch.zeros(2, requires_grad=True)
    increments = torch.zeros(2, 5, requires_grad=True)
    optimizer = torch.optim.SGD([init_logit, increments], lr=1.0)
    for _ in range(50):
        optimizer.zero_grad()
        tppo.value_loss(tppo.tracking_value_logits(init_logit, increments, mask), returns, mask).backward()
        optimizer.step()
    values = torch.sigmoid(tppo.tracking_value_logits(init_logit, increments, mask))
    assert (values[0] > 0.9).all() and (values[1, :3] < 0.1).all()
    # Padding takes no part: its loss has no gradient.
    assert increments.grad[1, 3:].abs().max() == 0


def test_critic_targets_are_the_outcome_with_lambda_critic_one():
    mask = torch.arange(4)[None, :] < torch.tensor([4, 2])[:, None]
    values = torch.sigmoid(torch.randn(2, 4))
    rewards = torch.tensor([1.0, 0.0])
    returns = tppo.gae(tppo.terminal_rewards(rewards, mask), values, mask, 1.0, 1.0)[1]
    assert torch.allclose(returns, rewards[:, None] * mask, atol=1e-6)


def test_table_5_settings_and_verl_defaults():
    args = infra.cli.parse_args(tppo.Args, tppo.TINY_PRESET, ["--model", "Qwen3-8B-Base"])
    # TPPO's Table 5 (math): rollout top-p 0.95, 64 prompts, mini-batches of 32 prompts (2 steps), actor lr 1e-6
    assert (args.top_p, args.prompts_per_step, args.mini_batches, args.lr, args.temperature) == (0.95, 64, 2, 1e-6, 1.0)
    # not published: verl's defaults (whitened advantages, token-mean, no critic warm-up, AdamW 0.01 / 0.999)
    assert (args.whiten_advantages, args.aggregation, args.critic_warmup) == (True, "token-mean", 0)
    assert (args.weight_decay, args.adam_betas, args.critic_lr) == (0.01, (0.9, 0.999), 1e-5)


def test_lambda_defaults():
    args = infra.cli.parse_args(tppo.Args, tppo.TINY_PRESET, ["--model", "Qwen3-8B-Base"])
    assert (args.lam_actor, args.lam_critic, args.critic_head, args.lr) == (0.95, 1.0, "shared", 1e-6)
    assert infra.cli.parse_args(tppo.Args, tppo.TINY_PRESET, ["--lam-actor", "1"]).lam_actor == 1.0
    assert (args.critic_epochs, infra.cli.parse_args(tppo.Args, tppo.TINY_PRESET, []).critic_epochs) == (0, 4)


@pytest.mark.parametrize("head", ["shared", "separate"])
def test_tppo_two_steps_end_to_end(tmp_path, head):
    name = f"e2e_tppo_{head}"
    command = [sys.executable, os.path.join(ROOT, "tppo.py"), "--steps", "2", "--prompts-per-step", "4",
               "--eval-problems", "16", "--micro-batch-size", "16", "--critic-head", head, "--run-name", name,
               "--output-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert 0.0 <= record["eval/accuracy"] <= 1.0
        for key in ("policy_loss", "value_loss", "grad_norm", "critic_grad_norm", "approx_kl"):
            assert math.isfinite(record[key]), key
    # The head starts at zero (V = 1/2, BCE = ln 2 for any target: test_wiring.py checks the targets); 2 steps of
    # critic updates move every output it has, z_0's separate one included.
    from safetensors.torch import load_file
    critic = load_file(os.path.join(tmp_path, name, "checkpoints", "step_000002", "critic", "model.safetensors"))
    assert critic["score.weight"].shape[0] == (2 if head == "separate" else 1)
    assert (critic["score.weight"].abs().sum(1) > 1e-4).all() and (critic["score.bias"].abs() > 1e-6).all()


def test_tracking_diagnostics_by_hand():
    # rows: z = 1, 1.5, 2.5 (3 tokens); z = -1, -3 (2 tokens); an empty response (left out of every mean)
    logits = torch.tensor([[1.0, 1.5, 2.5, 0.0], [-1.0, -3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]).bool()
    found = infra.probes.tracking_diagnostics(logits, mask)
    assert found["critic_z0"] == pytest.approx((1 - 1) / 2)
    assert found["critic_increment"] == pytest.approx((0.5 + 1.0 - 2.0) / 3)  # padding's jumps left out
    assert found["critic_last_logit"] == pytest.approx((2.5 - 3.0) / 2)
    assert infra.probes.tracking_diagnostics(logits[2:], mask[2:]) == dict(critic_z0=0.0, critic_increment=0.0,
                                                                   critic_last_logit=0.0)
