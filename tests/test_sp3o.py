"""Tests for sp3o.py: the released anchor rule (METHODS.md vectors and edge cases), the anchor weights, the
anchors-only critic loss, and a 3-step end-to-end run through the critic warm-up."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import sp3o  # noqa: E402
import infra.cli
import infra.run
import infra.tiny


def test_released_anchor_vectors():
    assert sp3o.anchor_positions(11) == [3, 6, 9]  # L = 10: 3, 6, 9
    assert sp3o.anchor_positions(2) == [0]  # L = 1: 0.3 -> 0, 0.6 -> 1 and 0.9 -> 1 capped at L - 1 = 0; merged


def test_released_test_vectors():
    # Dodojordi/SP3O tests/test_sp3o.py, through anchor_weights (per-anchor weights 1: the released code's mask)
    def released_mask(loss_mask, **kwargs):
        mask = torch.tensor([loss_mask], dtype=torch.bool)
        return sp3o.anchor_weights(mask, reduction="token-mean", **kwargs)[0].tolist()
    assert released_mask([1] * 11) == [0, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0]  # main ratios select three positions
    assert released_mask([1, 0, 1, 1, 0, 1, 1]) == [0, 0, 1, 1, 0, 1, 0]  # only positions the mask enables count
    assert released_mask([1, 1]) == [1, 0]  # colliding anchors merge
    assert released_mask([0] * 5) == [0] * 5  # empty response
    short = released_mask([1] * 9, tail_ratio=0.95, tail_min_len=10)  # the tail anchor obeys the length threshold
    long = released_mask([1] * 10, tail_ratio=0.95, tail_min_len=10)
    assert (sum(short), sum(long), long[9]) == (3, 4, 1)
    # test_ratio_one_can_select_terminal_position: build_ratio_anchor_mask(torch.ones(5), [1.0])
    assert released_mask([1] * 5, ratios=(1.0,), tail_ratio=0) == [0, 0, 0, 0, 1]


def test_only_ratios_below_one_are_capped():
    assert sp3o.anchor_positions(5, (1.0,), tail_ratio=0) == [4]  # 1.0 may pick the last token
    assert sp3o.anchor_positions(5, (0.99,), tail_ratio=0) == [3]  # round(3.96) = 4, capped at L - 1 = 3
    assert sp3o.anchor_positions(5, (0.3, 1.0), tail_ratio=0) == [1, 4]
    assert sp3o.anchor_positions(1, (1.0,), tail_ratio=0) == [0]  # L = 0: no cap, the only token


def test_anchor_edge_cases():
    assert sp3o.anchor_positions(0) == []  # empty response: no anchor
    assert sp3o.anchor_positions(-3) == []
    assert sp3o.anchor_positions(1) == [0]  # L = 0: the cap is 0, the only token
    assert sp3o.anchor_positions(3) == [1]  # L = 2: 0.6 -> 1, 1.2 -> 1, 1.8 -> 2 capped to 1
    assert sp3o.anchor_positions(4) == [1, 2]  # L = 3: 0.9 -> 1, 1.8 -> 2, 2.7 -> 3 capped to 2


def test_round_half_to_even():
    # n = 6, L = 5, placement 0.2/0.5/0.8: 1.0 -> 1, 2.5 -> 2 (half to even; half up would give 3), 4.0 -> 4.
    assert sp3o.anchor_positions(6, (0.2, 0.5, 0.8)) == [1, 2, 4]
    assert sp3o.anchor_positions(4, (0.5,)) == [2]  # L = 3: 1.5 -> 2 (even)


def test_tail_anchor_threshold():
    # n = 6143 < 6144: L = 6142: 1842.6 -> 1843, 3685.2 -> 3685, 5527.8 -> 5528, no tail anchor.
    assert sp3o.anchor_positions(6143) == [1843, 3685, 5528]
    # n = 6144: L = 6143: 1842.9 -> 1843, 3685.8 -> 3686, 5528.7 -> 5529, tail 5835.85 -> 5836.
    assert sp3o.anchor_positions(6144) == [1843, 3686, 5529, 5836]
    assert sp3o.anchor_positions(6144, tail_ratio=0) == [1843, 3686, 5529]  # --tail-ratio 0: the ablation
    assert sp3o.anchor_positions(6144, tail_ratio=None) == [1843, 3686, 5529]
    # The tail anchor is not capped: with the threshold at 2, n = 2 gets round(0.95) = 1, the last token.
    assert sp3o.anchor_positions(2, tail_min_len=2) == [0, 1]


def test_many_anchors_merge():
    ratios = tuple(i / 16 for i in range(1, 16))  # K = 15 on a 11-token response: offsets 1..10, 10 capped to 9
    assert sp3o.anchor_positions(11, ratios) == list(range(1, 10))
    # with 16 / 16 = 1.0 added: a ratio of exactly 1.0 is not capped (released), so it adds the last token
    assert sp3o.anchor_positions(11, ratios + (1.0,)) == list(range(1, 11))


def test_anchor_weights_skip_masked_tokens_and_weigh_each_sample_once():
    mask = torch.tensor([[True] * 11 + [False],
                         [False] * 12,
                         [True, False, True, True, False, True, True, True, True, True, True, True]])
    weights = sp3o.anchor_weights(mask)
    # Row 0: anchors 3, 6, 9 weigh 1/3 each. Row 1 (empty): none. Row 2: valid columns 0,2,3,5,...,11 (n = 10,
    # L = 9): offsets 2.7 -> 3, 5.4 -> 5, 8.1 -> 8, i.e. columns 5, 7, 10.
    expected = torch.zeros(3, 12)
    expected[0, [3, 6, 9]] = 1 / 3
    expected[2, [5, 7, 10]] = 1 / 3
    assert torch.allclose(weights, expected)
    assert sp3o.anchor_weights(mask, reduction="token-mean").tolist() == (expected > 0).float().tolist()
    short = torch.tensor([[True, True, False]])  # n = 2: one anchor, which weighs the whole sample
    assert sp3o.anchor_weights(short).tolist() == [[1.0, 0.0, 0.0]]


def test_random_placement_stays_on_valid_tokens():
    torch.manual_seed(0)
    mask = torch.arange(40)[None, :] < torch.tensor([40, 25, 7, 1])[:, None]
    first, second = sp3o.anchor_weights(mask, placement="random"), sp3o.anchor_weights(mask, placement="random")
    for weights in (first, second):
        assert torch.allclose(weights.sum(1), torch.ones(4))  # seq-mean: each sample weighs 1
        assert not weights[~mask].any()
        lengths = mask.sum(1)
        last_valid = weights[torch.arange(4), lengths - 1]
        assert not last_valid[lengths > 1].any()  # the cap holds for random ratios too
    assert not torch.equal(first, second)  # fresh ratios per call


def test_critic_loss_has_no_gradient_off_the_anchors():
    mask = torch.tensor([[True] * 11, [True, True, False, False, False, False, False, False, False, False, False]])
    weights = sp3o.anchor_weights(mask)  # row 0: 3, 6, 9 at 1/3; row 1: column 0 at 1
    values = torch.full((2, 11), 0.5, requires_grad=True)
    returns = torch.tensor([[1.0] * 11, [0.0] * 11])
    loss = sp3o.value_loss(values, values.detach(), returns, weights, clip=0.2, num_tokens=weights.sum().item())
    # Each anchor's loss is (0.5 - R)^2 = 0.25; mean per sample 0.25, then over the 2 samples: 0.25.
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    anchors = weights > 0
    assert not values.grad[~anchors].any()
    # d/dv of w (v - R)^2 / 2 samples: row 0: (1/3) * 2 * (0.5 - 1) / 2 = -1/6; row 1: 1 * 2 * 0.5 / 2 = 0.5.
    assert torch.allclose(values.grad[0, [3, 6, 9]], torch.full((3,), -1 / 6))
    assert values.grad[1, 0].item() == pytest.approx(0.5)


def test_critic_loss_is_independent_of_the_micro_batch_split():
    torch.manual_seed(1)
    mask = torch.arange(30)[None, :] < torch.tensor([30, 12, 5, 2])[:, None]
    values, old_values, returns = torch.rand(4, 30), torch.rand(4, 30), torch.rand(4, 30)
    for reduction in ("seq-mean", "token-mean"):
        weights = sp3o.anchor_weights(mask, reduction=reduction)
        total = weights.sum().item()  # seq-mean: the 4 samples; token-mean: 3 + 3 + 3 + 1 = 10 anchors
        assert total == (4 if reduction == "seq-mean" else 10)  # (n = 5: L = 4, 1.2, 2.4, 3.6 -> 1, 2, 3)
        whole = sp3o.value_loss(values, old_values, returns, weights, 0.2, num_tokens=total)
        parts = sum(sp3o.value_loss(values[rows], old_values[rows], returns[rows], weights[rows], 0.2, num_tokens=total)
                    for rows in ([0, 3], [1], [2]))
        assert whole.item() == pytest.approx(parts.item())


def test_dense_seq_mean_weights_give_the_released_sum_of_sample_mean():
    # slime's sum_of_sample_mean: each sample's masked mean, summed, then / the batch's samples. Per-token weights
    # 1 / n_i summed over a mini-batch give its non-empty samples: value_loss(..., num_tokens=that) is the same.
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    values, returns = torch.tensor([[0.0, 0.5, 1.0, 9.0], [0.25, 9.0, 9.0, 9.0]]), torch.ones(2, 4)
    # row 0: (1 + 0.25 + 0) / 3 = 5 / 12; row 1: 0.5625; mean (5 / 12 + 0.5625) / 2 = 0.4896
    weights = mask / mask.sum(1, keepdim=True)
    loss = sp3o.value_loss(values, values, returns, weights, clip=0.2, num_tokens=weights.sum().item())
    assert loss.item() == pytest.approx((5 / 12 + 0.5625) / 2)
    assert sp3o.value_loss(values, values, returns, mask.float(), 0.2).item() == pytest.approx((1.25 + 0.5625) / 4)


def test_published_defaults_and_tiny_warmup():
    args = infra.cli.parse_args(sp3o.Args, sp3o.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    assert (args.lr, args.critic_lr, args.weight_decay, args.adam_betas) == (1e-6, 4e-6, 0.1, (0.9, 0.98))
    assert (args.whiten_advantages, args.critic_warmup, args.anchor_ratios) == (False, 20, (0.3, 0.6, 0.9))
    assert (args.aggregation, args.truncated_is, args.tis_cap) == ("seq-mean", "auto", 2.0)  # per sample, then samples
    assert (args.prompts_per_step, args.samples_per_prompt, args.mini_batches,
            args.max_response_tokens) == (64, 8, 2, 8192)
    tiny = infra.cli.parse_args(sp3o.Args, sp3o.TINY_PRESET, [])
    assert (tiny.critic_warmup, tiny.critic_epochs, args.critic_epochs) == (5, 4, 0)
    ablation = infra.cli.parse_args(sp3o.Args, sp3o.TINY_PRESET,
                                    ["--anchor-ratios", "0.2", "0.5", "0.8", "--tail-ratio", "0"])
    assert (ablation.anchor_ratios, ablation.tail_ratio) == ((0.2, 0.5, 0.8), 0.0)


def test_bad_anchor_ratios_are_a_user_error():
    for bad in (["--anchor-ratios"], ["--anchor-ratios", "0.3", "1.5"]):
        result = subprocess.run([sys.executable, os.path.join(ROOT, "sp3o.py"), *bad], cwd=ROOT, capture_output=True,
                                text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 2 and "--anchor-ratios" in result.stderr and "Traceback" not in result.stderr


def test_sp3o_end_to_end_warmup_freezes_the_actor(tmp_path):
    from safetensors.torch import load_file
    name = "e2e_sp3o"
    command = [sys.executable, os.path.join(ROOT, "sp3o.py"), "--steps", "3", "--critic-warmup", "2",
               "--prompts-per-step", "4", "--eval-problems", "16", "--micro-batch-size", "16", "--save-every", "1",
               "--keep-checkpoints", "5", "--run-name", name, "--output-dir", str(tmp_path)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, name, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        for key in ("value_loss", "critic_grad_norm"):
            assert math.isfinite(record[key]), key
        assert record["value_loss"] > 0
    assert "eval/accuracy" in records[0] and "eval/accuracy" in records[-1]
    for record in records[:2]:  # warm-up: the actor is frozen, and no loss of it that was not applied is logged
        assert record["actor_frozen"] == 1.0
        assert not {"policy_loss", "grad_norm", "clip_fraction", "approx_kl"} & set(record)
    assert records[2]["actor_frozen"] == 0.0  # then it trains
    assert math.isfinite(records[2]["policy_loss"]) and records[2]["grad_norm"] > 0 and records[2]["approx_kl"] > 1e-5
    start = load_file(os.path.join(infra.tiny.tiny_model_path(), "model.safetensors"))
    checkpoints = os.path.join(tmp_path, name, "checkpoints")
    after_warmup = load_file(os.path.join(checkpoints, "step_000002", "policy", "model.safetensors"))
    after_update = load_file(os.path.join(checkpoints, "step_000003", "policy", "model.safetensors"))
    assert after_warmup.keys() == start.keys()
    assert all(torch.equal(after_warmup[k], start[k]) for k in start)
    assert not all(torch.equal(after_update[k], start[k]) for k in start)
