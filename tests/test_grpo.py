"""Tests for grpo.py: group advantages, the PPO-clip loss and its aggregation modes (hand-computed), the
micro-batch invariance of the loss on the tiny model, the gradient on the generated EOS, and the refusals."""
import dataclasses
import math

import pytest
import torch

import common
import infra.cli
import infra.run
import grpo


# ----------------------------------------------------------------------------------------------
# Group advantages. torch.std is the unbiased (n - 1) estimator, as in TRL and verl.
# ----------------------------------------------------------------------------------------------
def test_group_advantages_two_groups_of_two():
    # groups [1, 0] and [0, 1]: mean 0.5, centered +-0.5, std = sqrt((0.25 + 0.25) / 1) = 0.70711
    # -> A = +-0.5 / 0.70711 = +-0.70711
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected = torch.tensor([0.70711, -0.70711, -0.70711, 0.70711])
    assert torch.allclose(grpo.group_advantages(rewards, 2, "group"), expected, atol=1e-5)


def test_group_advantages_one_group_of_four():
    # one group [1, 0, 0, 1]: mean 0.5, centered +-0.5, std = sqrt(4 * 0.25 / 3) = 0.57735 -> A = +-0.86603
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    expected = torch.tensor([0.86603, -0.86603, -0.86603, 0.86603])
    assert torch.allclose(grpo.group_advantages(rewards, 4, "group"), expected, atol=1e-5)


def test_group_advantages_batch_and_none_scales():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    # batch: centered per group (+-0.5), divided by the std of all four rewards, sqrt(1/3) = 0.57735 -> +-0.86603
    expected = torch.tensor([0.86603, -0.86603, -0.86603, 0.86603])
    assert torch.allclose(grpo.group_advantages(rewards, 2, "batch"), expected, atol=1e-5)
    # none (Dr. GRPO): centered only
    assert torch.allclose(grpo.group_advantages(rewards, 2, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert torch.allclose(grpo.group_advantages(rewards, 4, "none"), torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_group_and_batch_scales_differ_when_groups_differ():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # group 1: mean 0.75, centered [.25, .25, .25, -.75], std = sqrt((3 * .0625 + .5625) / 3) = 0.5
    #   -> [0.5, 0.5, 0.5, -1.5]; group 2 all equal -> 0
    group = torch.tensor([0.5, 0.5, 0.5, -1.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(grpo.group_advantages(rewards, 4, "group"), group, atol=1e-5)
    # batch std: mean 0.375, squared deviations 3 * 0.625^2 + 5 * 0.375^2 = 1.875, / 7 -> std 0.517549
    batch = torch.tensor([0.25, 0.25, 0.25, -0.75, 0, 0, 0, 0]) / 0.517549
    assert torch.allclose(grpo.group_advantages(rewards, 4, "batch"), batch, atol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_rewards_give_zero_advantage_and_no_nan(scale):
    for rewards in (torch.ones(8), torch.zeros(8), torch.tensor([1.0, 1.0, 0.0, 0.0])):
        advantages = grpo.group_advantages(rewards, 2 if len(rewards) == 4 else 4, scale)
        assert torch.isfinite(advantages).all()
        assert torch.equal(advantages, torch.zeros_like(advantages))


def test_group_of_one_and_uneven_groups_are_refused():
    with pytest.raises(ValueError, match="at least 2"):
        grpo.group_advantages(torch.tensor([1.0, 0.0]), 1)
    with pytest.raises(ValueError, match="groups of 4"):
        grpo.group_advantages(torch.ones(6), 4)


def test_samples_per_prompt_one_is_a_one_line_cli_error(run_cli):
    result = run_cli("grpo.py", "--samples-per-prompt", "1", timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # one line, and nothing printed by a model load before it
    assert "--samples-per-prompt" in lines[0] and "Traceback" not in result.stderr


def test_bad_resume_path_is_refused_before_any_model_loads(tmp_path, run_cli):
    missing = tmp_path / "no_run" / "checkpoints" / "step_000002"
    result = run_cli("grpo.py", "--resume", missing, "--output-dir", tmp_path, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--resume" in lines[0], result.stderr  # no model-loading output before it
    assert not (tmp_path / "no_run").exists()  # and no run directory made for it


# ----------------------------------------------------------------------------------------------
# aggregate: a 2 x 3 example.  losses [[1, 2, 3], [4, 5, 6]], mask [[1, 1, 0], [1, 0, 0]]
# ----------------------------------------------------------------------------------------------
LOSSES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, True, False], [True, False, False]])


def test_aggregate_token_mean():
    # valid tokens 1, 2, 4: (1 + 2 + 4) / 3
    assert grpo.aggregate(LOSSES, MASK, "token-mean").item() == pytest.approx(7 / 3)
    # a micro-batch divides by the mini-batch's token count: 7 / 7
    assert grpo.aggregate(LOSSES, MASK, "token-mean", num_tokens=7).item() == pytest.approx(1.0)


def test_aggregate_seq_mean():
    # row means (1 + 2) / 2 = 1.5 and 4 / 1 = 4; mean over rows 2.75; over 4 sequences (1.5 + 4) / 4
    assert grpo.aggregate(LOSSES, MASK, "seq-mean").item() == pytest.approx(2.75)
    assert grpo.aggregate(LOSSES, MASK, "seq-mean", num_sequences=4).item() == pytest.approx(5.5 / 4)


def test_aggregate_sum_max_len():
    # sum 7 / (2 sequences * 3 columns); with max_length 4: 7 / 8; 4 sequences, max_length 10: 7 / 40
    assert grpo.aggregate(LOSSES, MASK, "sum-max-len").item() == pytest.approx(7 / 6)
    assert grpo.aggregate(LOSSES, MASK, "sum-max-len", max_length=4).item() == pytest.approx(7 / 8)
    assert grpo.aggregate(LOSSES, MASK, "sum-max-len", num_sequences=4, max_length=10).item() == pytest.approx(7 / 40)


def test_aggregate_unknown_mode_and_empty_mask():
    with pytest.raises(ValueError, match="unknown aggregation"):
        grpo.aggregate(LOSSES, MASK, "mean")
    empty = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean", "sum-max-len"):
        assert grpo.aggregate(LOSSES, empty, mode).item() == 0.0


# ----------------------------------------------------------------------------------------------
# policy_loss: PPO-clip, hand-computed per token (clip 0.2 / 0.2, token-mean).
# ----------------------------------------------------------------------------------------------
#   t  ratio  A    -A r    -A clip(r)   max     clipped?  d loss / d logp (token-mean over 5)
#   0  1.5   +1   -1.5    -1.2         -1.2    yes       0
#   1  0.5   -1   +0.5    +0.8         +0.8    yes       0
#   2  1.1   +1   -1.1    -1.1         -1.1    no        -1.1 / 5 = -0.22
#   3  0.5   +1   -0.5    -0.8         -0.5    no        -0.5 / 5 = -0.10   (below the range, but A > 0)
#   4  1.5   -1   +1.5    +1.2         +1.5    no        +1.5 / 5 = +0.30   (above the range, but A < 0)
#   5  3.0   +1   (masked out: must not count)
# loss = (-1.2 + 0.8 - 1.1 - 0.5 + 1.5) / 5 = -0.1; clip_fraction = 2 / 5
RATIOS = [1.5, 0.5, 1.1, 0.5, 1.5, 3.0]
ADVANTAGES = [1.0, -1.0, 1.0, 1.0, -1.0, 1.0]
VALID = [True, True, True, True, True, False]


def clip_case(clip_low=0.2, clip_high=0.2, aggregation="token-mean"):
    old = torch.tensor([[-1.0] * 6])
    logprobs = (old + torch.log(torch.tensor([RATIOS]))).requires_grad_(True)
    loss, clip_fraction = grpo.policy_loss(logprobs, old, torch.tensor([ADVANTAGES]), torch.tensor([VALID]),
                                           clip_low, clip_high, aggregation)
    loss.backward()
    return loss.item(), clip_fraction.item(), logprobs.grad[0]


def test_policy_loss_hand_computed():
    loss, clip_fraction, grad = clip_case()
    assert loss == pytest.approx(-0.1, abs=1e-6)
    assert clip_fraction == pytest.approx(0.4)
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, -0.22, -0.10, 0.30, 0.0]), atol=1e-6)


def test_policy_loss_clips_both_sides():
    _, _, grad = clip_case()
    assert grad[0] == 0  # ratio 1.5 > 1 + 0.2 with A > 0: no push further up
    assert grad[1] == 0  # ratio 0.5 < 1 - 0.2 with A < 0: no push further down
    assert grad[2] != 0  # inside the range
    assert grad[5] == 0  # masked token


def test_policy_loss_clip_higher():
    # clip_high 0.28 (DAPO): token 0's clipped value is -1.28, so the loss drops by 0.08 / 5; still clipped
    loss, clip_fraction, grad = clip_case(clip_high=0.28)
    assert loss == pytest.approx(-0.1 - 0.08 / 5, abs=1e-6)
    assert clip_fraction == pytest.approx(0.4) and grad[0] == 0
    # ratio 1.25 with A > 0 is clipped at 1.2 but not at 1.28
    old = torch.zeros(1, 1)
    for clip_high, clipped in ((0.2, True), (0.28, False)):
        logprobs = torch.full((1, 1), math.log(1.25), requires_grad=True)
        loss, fraction = grpo.policy_loss(logprobs, old, torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
                                          0.2, clip_high)
        loss.backward()
        assert fraction.item() == float(clipped)
        assert (logprobs.grad.item() == 0) == clipped
        assert loss.item() == pytest.approx(-1.2 if clipped else -1.25)


def test_policy_loss_at_ratio_one_is_minus_advantage():
    # first update of a rollout: logprobs == old, ratio 1, loss = mean(-A), gradient -A / tokens
    logprobs = torch.tensor([[-0.5, -2.0], [-1.0, -3.0]], requires_grad=True)
    advantages = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, clip_fraction = grpo.policy_loss(logprobs, logprobs.detach(), advantages, mask)
    loss.backward()
    assert loss.item() == pytest.approx((-2 - 2 + 1) / 3)
    assert clip_fraction.item() == 0.0
    assert torch.allclose(logprobs.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))


def test_k3_kl_hand_computed():
    # logp = log 0.5, ref = log 0.25: log_ratio = ln 0.5 = -0.693147; exp(-0.693147) + 0.693147 - 1 = 0.193147
    kl = grpo.k3_kl(torch.tensor([math.log(0.5), -1.0]), torch.tensor([math.log(0.25), -1.0]))
    assert torch.allclose(kl, torch.tensor([0.193147, 0.0]), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# The loss of a mini-batch must not depend on how it is split into micro-batches (tiny model).
# ----------------------------------------------------------------------------------------------
QUESTIONS = ["478+365", "12+5", "999+999", "1+1", "305+217", "7+80", "640+123", "55+44"]
RESPONSES = ["8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}", "2+5+0=7 \\boxed{17}",
             "9+9+0=18 9+9+1=19 9+9+1=19 \\boxed{1998}", "1+1+0=2", "5+7+0=12 0+1+1=2 3+2+0=5 \\boxed{522}",
             "7+0+0=7 \\boxed{87", "0+3+0=3 4+2+0=6 6+1+0=7 \\boxed{763}", "5+4+0=9 5+4+0=9 \\boxed{99}"]


def training_batch(tokenizer):
    """8 rollouts of different prompt and response lengths; even rows end in EOS, odd rows are cut off."""
    prompts = [common.prompt_ids(tokenizer, q) for q in QUESTIONS]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if i % 2 == 0 else [])
                 for i, r in enumerate(RESPONSES)]
    return common.sequence_batch(prompts, responses, tokenizer.pad_token_id)


def accumulate(model, batch, old_logprobs, advantages, mini_batch, micro_batch_size, aggregation, max_length,
               pass_counts=True):
    """One mini-batch's loss and gradient, accumulated over micro-batches exactly as grpo.main does."""
    model.zero_grad(set_to_none=True)
    mask = batch.response_mask
    counts = dict(num_sequences=len(mini_batch), num_tokens=int(mask[mini_batch].sum()), max_length=max_length)
    total = 0.0
    for micro in common.chunks(mini_batch, micro_batch_size):
        micro_batch = batch.select(micro)
        width = micro_batch.response_width
        logprobs = common.response_logprobs(model, micro_batch)
        loss, _ = grpo.policy_loss(logprobs, old_logprobs[micro, :width], advantages[micro, :width],
                                   micro_batch.response_mask, 0.2, 0.2, aggregation, **(counts if pass_counts else {}))
        loss.backward()
        total += loss.item()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return total, grads


@pytest.fixture(scope="module")
def rollout(tiny):
    model, tokenizer = tiny
    batch = training_batch(tokenizer)
    with torch.no_grad():
        current = common.response_logprobs(model, batch)
    noise = torch.rand(current.shape, generator=torch.Generator().manual_seed(0)) * 0.8 - 0.4
    old_logprobs = current + noise  # ratios exp(-0.4) .. exp(0.4): some tokens clip, some do not
    advantages = grpo.group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]), 4)
    return batch, old_logprobs, advantages[:, None].expand_as(old_logprobs)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "sum-max-len"])
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(tiny, rollout, aggregation):
    model, _ = tiny
    batch, old_logprobs, advantages = rollout
    mini_batch = [5, 2, 7, 0, 3, 6, 1, 4]  # shuffled, as grpo.main's randperm
    results = {size: accumulate(model, batch, old_logprobs, advantages, mini_batch, size, aggregation, 48)
               for size in (8, 4, 2)}  # 1, 2 and 4 micro-batches
    loss, grads = results[8]
    assert abs(loss) > 1e-4 and any(g.abs().max() > 1e-6 for g in grads)
    for size in (4, 2):
        assert results[size][0] == pytest.approx(loss, rel=1e-5, abs=1e-7), size
        for reference, other in zip(grads, results[size][1]):
            assert torch.allclose(other, reference, rtol=1e-4, atol=1e-7), size
    # the test can fail: micro-batches normalizing by their own counts give another loss
    unscaled, _ = accumulate(model, batch, old_logprobs, advantages, mini_batch, 2, aggregation, 48, pass_counts=False)
    assert unscaled != pytest.approx(loss, rel=1e-3)


def test_micro_batch_select_keeps_the_logprobs(tiny, rollout):
    # the log-probs of a trimmed micro-batch equal the full batch's, column for column
    model, _ = tiny
    batch = rollout[0]
    with torch.no_grad():
        full = common.response_logprobs(model, batch)
        for rows in ([1], [3, 5], [0, 2, 4]):
            micro = batch.select(rows)
            part = common.response_logprobs(model, micro)
            assert micro.response_width == int(batch.response_mask[rows].sum(1).max())
            assert torch.allclose(part[micro.response_mask], full[rows, :micro.response_width][micro.response_mask],
                                  atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The generated EOS is a trained token; padding is not.
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("same_pad_and_eos", [False, True])
def test_generated_eos_gets_gradient_and_padding_none(tiny, same_pad_and_eos):
    model, tokenizer = tiny
    eos = tokenizer.eos_token_id
    pad = eos if same_pad_and_eos else tokenizer.pad_token_id
    assert tokenizer.pad_token_id != eos  # the tiny tokenizer has a pad token of its own
    short = tokenizer("1+2+0=3 \\boxed{3}", add_special_tokens=False)["input_ids"] + [eos]
    long = tokenizer("8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}", add_special_tokens=False)["input_ids"] + [eos]
    prompts = [common.prompt_ids(tokenizer, "1+2"), common.prompt_ids(tokenizer, "478+365")]
    batch = common.sequence_batch(prompts, [short, long], pad)
    n = len(short)
    assert batch.response_ids[0, n - 1] == eos and batch.response_mask[0, n - 1]
    assert not batch.response_mask[0, n:].any() and (batch.response_ids[0, n:] == pad).all()
    assert batch.response_mask[1].all()

    captured = []

    def keep_logits(module, inputs, output):
        output.retain_grad()
        captured.append(output)

    hook = model.model.norm.register_forward_hook(keep_logits)  # the LM head runs a vocabulary slice at a time
    try:
        logprobs = common.response_logprobs(model, batch)
    finally:
        hook.remove()
    advantages = torch.tensor([[1.0], [-1.0]]).expand_as(logprobs)
    loss, _ = grpo.policy_loss(logprobs, logprobs.detach(), advantages, batch.response_mask)
    loss.backward()
    model.zero_grad(set_to_none=True)
    hidden_grad = captured[0].grad[:, -batch.response_width - 1:]  # [2, T + 1, d]: column t predicts token t
    row_norms = hidden_grad.abs().sum(-1)
    assert row_norms[0, n - 1] > 0  # the EOS of the short response
    assert row_norms[1, len(long) - 1] > 0  # the EOS of the long one
    assert torch.all(row_norms[0, n:] == 0)  # padding after the short response, and the unused last column
    assert torch.all(row_norms[1, len(long):] == 0)


# ----------------------------------------------------------------------------------------------
# Argument checks before anything loads.
# ----------------------------------------------------------------------------------------------
def test_check_args_refuses_uneven_splits():
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, [])
    grpo.check_args(args)  # the demo settings: 64 x 8 = 512 samples, 2 mini-batches of 16 micro-batches of 16
    with pytest.raises(infra.UserError, match="samples-per-prompt"):
        grpo.check_args(dataclasses.replace(args, samples_per_prompt=1))
    with pytest.raises(infra.UserError, match="mini-batches"):
        grpo.check_args(dataclasses.replace(args, mini_batches=3))  # 512 / 3
    with pytest.raises(infra.UserError, match="micro-batches"):
        grpo.check_args(dataclasses.replace(args, micro_batch_size=48))  # 256 / 48


def test_check_args_accepts_a_micro_batch_larger_than_the_mini_batch():
    # --prompts-per-step 4 with the tiny preset (micro-batch 64): mini-batches of 16 are one micro-batch each.
    # This is the documented end-to-end recipe (`--steps 2 --prompts-per-step 4 ...`).
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--prompts-per-step", "4"])
    grpo.check_args(args)


def test_grpo_args_tiny_preset_and_published_defaults():
    tiny = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, [])
    assert (tiny.model, tiny.steps, tiny.lr, tiny.eval_n, tiny.eval_temperature) == ("tiny", 30, 3e-5, 1, 0.0)
    assert (tiny.prompts_per_step, tiny.samples_per_prompt, tiny.mini_batches) == (64, 8, 2)  # the published rollout
    real = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    # SP3O's released `grpo` preset (docs/methods.md): 64 prompts x 8 samples, lr 1e-6 with weight decay 0.1 and
    # betas 0.9/0.98, clip 0.2/0.2, 2 steps per rollout, 8192 tokens, no KL, slime's per-sample mean
    assert (real.steps, real.prompts_per_step, real.samples_per_prompt, real.lr) == (500, 64, 8, 1e-6)
    assert (real.clip_low, real.clip_high, real.mini_batches, real.max_response_tokens) == (0.2, 0.2, 2, 8192)
    assert (real.temperature, real.grad_clip, real.kl_coef, real.aggregation) == (1.0, 1.0, 0.0, "seq-mean")
    assert (real.weight_decay, real.adam_betas, real.advantage_scale) == (0.1, (0.9, 0.98), "group")
    assert (real.truncated_is, real.tis_cap, real.gradient_checkpointing, real.micro_batch_tokens) == \
        ("auto", 2.0, True, 16384)  # a real model packs micro-batches by tokens (issue 39); the demo by 16 rows
    assert (tiny.micro_batch_tokens, tiny.micro_batch_size) == (0, 16)
    assert tiny.gradient_checkpointing is False  # the tiny demo needs no activation memory savings


# ----------------------------------------------------------------------------------------------
# Truncated importance sampling (engine/trainer mismatch); test_skeleton.py checks the six copies are one.
# ----------------------------------------------------------------------------------------------
def test_truncated_importance_weights_hand_computed():
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    engine = torch.tensor([[-1.5, -1.0, -2.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    weights = grpo.truncated_importance_weights(trainer, engine, mask, cap=2.0)
    # exp(0.5) = 1.648721; exp(-1) = 0.367879; exp(1.5) = 4.48 capped at 2; padding 0
    assert torch.allclose(weights, torch.tensor([[1.648721, 0.367879, 2.0, 0.0]]), atol=1e-6)
    assert torch.equal(grpo.truncated_importance_weights(engine, engine, mask), mask.float())  # no mismatch: 1


def test_weighting_advantages_equals_weighting_the_clipped_token_loss():
    # PPO-clip token loss max(-A r, -A clip(r)) times w > 0 equals the loss with advantage w A: clipping included
    logprobs = torch.tensor([[0.4, -0.4, 0.1, 0.05, -0.3]])
    advantages = torch.tensor([[1.0, -1.0, 2.0, -0.5, 1.5]])
    weights = torch.tensor([[0.5, 2.0, 1.0, 0.25, 1.7]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    ratio = logprobs.exp()
    by_hand = (weights * torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))).mean()
    loss, _ = grpo.policy_loss(logprobs, torch.zeros(1, 5), advantages * weights, mask)
    assert loss.item() == pytest.approx(by_hand.item(), abs=1e-6)


# ----------------------------------------------------------------------------------------------
# Memory of the update: gradient checkpointing and bf16 autocast change neither the values nor the gradients
# beyond their numerics.
# ----------------------------------------------------------------------------------------------
def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients(tiny_path, rollout):
    batch = rollout[0]
    results = []
    for checkpointing in (False, True):
        model = common.load_model(tiny_path, "float32", "cpu", gradient_checkpointing=checkpointing)[0]
        logprobs = common.response_logprobs(model, batch)
        (logprobs * batch.response_mask).sum().backward()
        results.append((logprobs.detach(), model.model.layers[0].mlp.up_proj.weight.grad.clone()))
        assert model.is_gradient_checkpointing == checkpointing
    critic = common.load_model(tiny_path, "float32", "cpu", value_head=1, gradient_checkpointing=True)[0]
    assert critic.training and critic.dropout.p == 0  # train mode for checkpointing, but no classifier dropout
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6) and results[0][1].abs().sum() > 0


def test_bf16_compute_keeps_float32_weights(tiny_path, rollout):
    batch = rollout[0]
    exact = common.load_model(tiny_path, "float32", "cpu")[0]
    mixed = common.load_model(tiny_path, "bfloat16", "cpu")[0]
    assert mixed.model.norm.weight.dtype == torch.float32 and mixed.compute_dtype == torch.bfloat16
    gap = (common.response_logprobs(mixed, batch) - common.response_logprobs(exact, batch))[batch.response_mask]
    assert 0 < gap.abs().median() < 0.01 and gap.abs().max() < 0.5  # bf16 numerics: close, not equal (autocast ran)


# ----------------------------------------------------------------------------------------------
# GSPO (Zheng et al. 2025, arXiv 2507.18071), --importance-level sequence: one ratio per response,
# s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log(pi(y_t) / pi_old(y_t))) (eq. 7), clipped per response at
# (1 - 3e-4, 1 + 4e-4) (§5.1), loss -(1/G) sum_i min(s_i A_i, clip(s_i) A_i) (eq. 5).
# ----------------------------------------------------------------------------------------------
# Response 0: 2 tokens with log-ratios 0.001 and 0.003 (mean 0.002, s = e^0.002 = 1.002002, above 1 + 4e-4);
# response 1: 3 tokens, -0.0001, 0.0002, -0.0004 (mean -0.0001, s = 0.9999, inside the range); padding junk 9.
GSPO_MASK = torch.tensor([[True, True, False], [True, True, True]])
GSPO_OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.7, -1.5]])
GSPO_NEW = GSPO_OLD + torch.tensor([[0.001, 0.003, 9.0], [-0.0001, 0.0002, -0.0004]])


def gspo_loss(new, advantages, level="sequence", aggregation="seq-mean"):
    ratio = grpo.sequence_log_ratio(new, GSPO_OLD, GSPO_MASK, level)
    return grpo.policy_loss(ratio, torch.zeros_like(ratio), advantages, GSPO_MASK, 3e-4, 4e-4, aggregation)


def test_gspo_sequence_ratio_and_loss_by_hand():
    log_ratio = grpo.sequence_log_ratio(GSPO_NEW, GSPO_OLD, GSPO_MASK)
    # every token of a response holds its s_i; padding 0
    assert torch.allclose(log_ratio, torch.tensor([[0.002, 0.002, 0.0], [-0.0001, -0.0001, -0.0001]]), atol=1e-7)
    s0, s1 = math.exp(0.002), math.exp(-0.0001)
    for a0, a1 in ((1.0, -0.5), (-1.0, 2.0)):
        advantages = torch.tensor([[a0] * 3, [a1] * 3])
        loss, clip_fraction = gspo_loss(GSPO_NEW, advantages)
        # eq. 5 per response: -min(s A, clip(s, 1 - 3e-4, 1 + 4e-4) A), then the mean over the 2 responses
        expected = [-min(s * a, min(max(s, 1 - 3e-4), 1 + 4e-4) * a) for s, a in ((s0, a0), (s1, a1))]
        assert loss.item() == pytest.approx(sum(expected) / 2, rel=1e-6)
        # A0 = 1: response 0's s above 1 + 4e-4 is clipped, its 2 tokens of the 5; A0 = -1: the unclipped term wins
        assert clip_fraction.item() == pytest.approx(2 / 5 if a0 > 0 else 0.0)


def test_gspo_gradient_is_shared_by_a_responses_tokens_and_zero_once_clipped():
    # d(-s_i A_i / G) / d log pi(y_t) = -A_i s_i / (|y_i| G) on each of response i's tokens: the same for all of them.
    new = GSPO_NEW.clone().requires_grad_(True)
    gspo_loss(new, torch.tensor([[1.0] * 3, [-0.5] * 3]))[0].backward()
    s1 = math.exp(-0.0001)
    assert new.grad[0].tolist() == [0.0, 0.0, 0.0]  # response 0 is clipped (s above 1 + 4e-4, A > 0): no gradient
    assert torch.allclose(new.grad[1], torch.full((3,), 0.5 * s1 / (3 * 2)), rtol=1e-6)
    # the token ratio instead: each token its own ratio and clip (0.001 and 0.003 both inside +-0.2), gradients differ
    token = GSPO_NEW.clone().requires_grad_(True)
    grpo.policy_loss(token, GSPO_OLD, torch.tensor([[1.0] * 3, [-0.5] * 3]), GSPO_MASK, 0.2, 0.2, "seq-mean")[
        0].backward()
    assert token.grad[0, 0] != token.grad[0, 1]


def test_gspo_token_equals_gspo_with_one_advantage_per_response():
    # eq. 13: s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)]: the value of s_i, and with A_{i,t} = A_i the same gradient
    advantages = torch.tensor([[1.0] * 3, [-0.5] * 3])
    sequence, token = (GSPO_NEW.clone().requires_grad_(True) for _ in range(2))
    loss_sequence, clip_sequence = gspo_loss(sequence, advantages, "sequence")
    loss_token, clip_token = gspo_loss(token, advantages, "sequence-token")
    (loss_sequence + loss_token).backward()
    assert loss_sequence.item() == pytest.approx(loss_token.item()) and clip_sequence == clip_token
    assert torch.allclose(sequence.grad, token.grad, atol=1e-9)
    # per-token advantages: each token is weighted by its own A_{i,t} (GSPO-token's purpose)
    uneven = torch.tensor([[1.0, 1.0, 0.0], [-0.5, 1.0, 0.25]])
    token = GSPO_NEW.clone().requires_grad_(True)
    gspo_loss(token, uneven, "sequence-token")[0].backward()
    s1 = math.exp(-0.0001)
    assert torch.allclose(token.grad[1], torch.tensor([0.5, -1.0, -0.25]) * s1 / (3 * 2), rtol=1e-6)


def test_gspo_defaults_are_the_papers_clip_ranges_and_off_by_default():
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    assert (args.importance_level, args.gspo_clip_low, args.gspo_clip_high) == ("token", 3e-4, 4e-4)
    tiny = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--importance-level", "sequence"])
    assert (tiny.importance_level, tiny.clip_low, tiny.clip_high) == ("sequence", 0.2, 0.2)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence-token"])
def test_the_loop_hands_the_policy_loss_the_ratio_of_its_level(level, monkeypatch, tmp_path):
    # One update of the tiny model on a scripted rollout: the loop's policy_loss gets, per micro-batch, the token
    # log-probs against the old ones at the token clip ranges, or log s_i against 0 at GSPO's (one value per response)
    from test_loss_terms import ONE_UPDATE, run_one_step
    calls = []
    real = grpo.policy_loss

    def recording(new, old, advantages, mask, clip_low, clip_high, *args, **kwargs):
        calls.append((new.detach().clone(), old.clone(), mask.clone(), clip_low, clip_high))
        return real(new, old, advantages, mask, clip_low, clip_high, *args, **kwargs)
    monkeypatch.setattr(grpo, "policy_loss", recording)
    record, models = run_one_step(monkeypatch, tmp_path, "grpo", ONE_UPDATE + ["--importance-level", level], "stop")
    assert len(calls) == 2 and math.isfinite(record["policy_loss"])  # 8 samples in micro-batches of 4
    for new, old, mask, clip_low, clip_high in calls:
        if level == "token":
            assert (clip_low, clip_high) == (0.2, 0.2) and old.abs().sum() > 0  # the rollout's own log-probs
            assert any(len(set(row[row_mask].tolist())) > 1 for row, row_mask in zip(new, mask))
            continue
        assert (clip_low, clip_high) == (3e-4, 4e-4) and torch.equal(old, torch.zeros_like(old))
        for row, row_mask in zip(new, mask):  # one ratio per response, the same on each of its tokens
            assert len(set(row[row_mask].tolist())) == 1
