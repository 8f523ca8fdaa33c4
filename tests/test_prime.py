"""Tests for prime.py from PRIME's equations (Cui et al. 2025, arXiv 2502.01456) and its released code (verl's
recipe/prime: prime_core_algos.py, prime_dp_rm.py, prime_ray_trainer.py), not from the file's output: the token
reward r_t = beta log(pi_phi / pi_ref) (eq. 3) by hand and its batch normalization; the PRM's cross-entropy (eq. 4) by
hand and its gradient's sign; the leave-one-out baselines (eq. 5, masked_rloo) on hand-made groups, a group of one,
all-equal outcomes; the returns summed from each token on; the online filter; and, through the loop (one step, a
scripted rollout), that the PRM's update raises a correct response's implicit reward and lowers a cut one's (which
scores 0), that the PRM is updated, then scores the rollout, whose rewards reach the advantages (--prm-update
before, verl's recipe) or scores it in the update's forward pass (after), and that the filter keeps the right
groups."""
import copy
import importlib
import math
import os
import sys

import pytest
import torch

import common
import infra.cli
import infra.run
import prime
from helpers import records
from scripted_engine import ScriptedEngine
from test_loss_terms import ONE_UPDATE, RESPONSE_TOKENS, plain_logprobs

BETA = 0.05


# ----------------------------------------------------------------------------------------------
# The implicit process reward (eq. 3): r_t = beta log(pi_phi(y_t | y_<t) / pi_ref(y_t | y_<t)).
# ----------------------------------------------------------------------------------------------
PRM = torch.tensor([[-1.0, -0.5, -2.0], [-0.2, -3.0, 7.0]])  # row 1 has 2 tokens: its third column is padding
REFERENCE = torch.tensor([[-1.5, -0.5, -1.0], [-0.4, -2.0, 1.0]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_token_reward_is_beta_times_the_log_ratio_by_hand():
    # log ratios: row 0: 0.5, 0, -1; row 1: 0.2, -1 (padding 0)
    rewards = prime.implicit_rewards(PRM, REFERENCE, MASK, BETA, normalize=False)
    assert torch.allclose(rewards, BETA * torch.tensor([[0.5, 0.0, -1.0], [0.2, -1.0, 0.0]]))
    # normalized as released (prime_norm batch_norm): the sums from each token on are 0.05 x [-0.5, -1, -1] and
    # 0.05 x [-0.8, -1]; the largest size is 0.05 x 1: the rewards become the log ratios themselves (beta cancels)
    normalized = prime.implicit_rewards(PRM, REFERENCE, MASK, BETA)
    assert torch.allclose(normalized, torch.tensor([[0.5, 0.0, -1.0], [0.2, -1.0, 0.0]]), atol=1e-4)
    assert torch.allclose(prime.implicit_rewards(PRM, REFERENCE, MASK, 1.0), normalized, atol=1e-4)


def test_a_policy_equal_to_the_reference_gives_no_process_reward():
    rewards = prime.implicit_rewards(REFERENCE, REFERENCE, MASK, BETA)
    assert torch.equal(rewards, torch.zeros_like(rewards))  # 0 / (0 + 1e-6): no NaN


# ----------------------------------------------------------------------------------------------
# The PRM's loss (eq. 4, compute_ce_dpo_loss_rm): BCE(sigmoid(beta sum_t log pi_phi / pi_ref), R), mean over responses.
# ----------------------------------------------------------------------------------------------
def test_prm_loss_by_hand():
    log_ratio = PRM - REFERENCE  # sums: row 0 -0.5, row 1 -0.8 (the padding's 6 left out)
    labels = torch.tensor([1.0, 0.0])
    z0, z1 = BETA * -0.5, BETA * -0.8
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    expected = (-math.log(sigmoid(z0)) - math.log(1 - sigmoid(z1))) / 2
    assert prime.prm_loss(log_ratio, MASK, labels, BETA).item() == pytest.approx(expected, rel=1e-6)
    # a micro-batch passes the mini-batch's count: its losses add up to the mini-batch's
    parts = sum(prime.prm_loss(log_ratio[i:i + 1], MASK[i:i + 1], labels[i:i + 1], BETA, 2) for i in range(2))
    assert parts.item() == pytest.approx(expected, rel=1e-6)
    # at the start (pi_phi = pi_ref: every sum 0) it is ln 2, whatever the label
    assert prime.prm_loss(torch.zeros(2, 3), MASK, labels, BETA).item() == pytest.approx(math.log(2))


def test_prm_loss_gradient_raises_a_correct_responses_implicit_reward():
    # d loss / d log pi_phi(y_t) = beta (sigmoid(z) - R) / N on each valid token: negative for R = 1 (descent raises
    # the log-probabilities, so the implicit reward sum_t r_t goes up), positive for R = 0; 0 on padding
    log_ratio = (PRM - REFERENCE).requires_grad_(True)
    prime.prm_loss(log_ratio, MASK, torch.tensor([1.0, 0.0]), BETA).backward()
    sigmoid = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    expected = torch.tensor([[BETA * (sigmoid(BETA * -0.5) - 1) / 2] * 3, [BETA * sigmoid(BETA * -0.8) / 2] * 2 + [0]])
    assert torch.allclose(log_ratio.grad, expected, atol=1e-8)
    assert (log_ratio.grad[0] < 0).all() and (log_ratio.grad[1, :2] > 0).all()


# ----------------------------------------------------------------------------------------------
# Leave-one-out baselines (eq. 5; the released masked_rloo).
# ----------------------------------------------------------------------------------------------
def test_outcome_leave_one_out_is_r_minus_the_others_mean():
    # one group of 4: [1, 0, 0, 1]: R_i - mean of the other three = 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    assert torch.allclose(prime.leave_one_out(rewards, torch.ones(4, 1), 4).flatten(),
                          torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # two groups of 2: [1, 0] and [1, 1]: the other sample's R subtracted: 1, -1, 0, 0
    rewards = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    assert torch.allclose(prime.leave_one_out(rewards, torch.ones(4, 1), 2).flatten(), torch.tensor([1., -1, 0, 0]))


def test_process_leave_one_out_on_a_hand_made_group():
    # One group of 3 with 3, 2 and 1 tokens; token rewards [1, 2, 3], [4, 0], [-2]: mean rewards m = 2, 2, -2,
    # sum 2. Released: r_t x 3/2 - 2/2 = 1.5 r_t - 1.
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 9.0], [-2.0, 9.0, 9.0]])  # 9: padding
    mask = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    loo = prime.leave_one_out(rewards, mask, 3)
    assert torch.allclose(loo, torch.tensor([[0.5, 2.0, 3.5], [5.0, -1.0, 0.0], [-4.0, 0.0, 0.0]]))
    # Each response's sum is eq. 5's: its own rewards minus its length x the others' mean of their mean rewards:
    # 6 - 3 x (2 - 2)/2 = 6; 4 - 2 x (2 - 2)/2 = 4; -2 - 1 x (2 + 2)/2 = -4
    assert torch.allclose(loo.sum(1), torch.tensor([6.0, 4.0, -4.0]))
    # the token of a one-token response: eq. 5's r_t - the others' mean m_j exactly
    assert loo[2, 0].item() == pytest.approx(-2 - (2 + 2) / 2)


def test_a_group_of_one_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        prime.leave_one_out(torch.ones(2, 3), torch.ones(2, 3), 1)
    args = infra.cli.parse_args(prime.Args, prime.TINY_PRESET, ["--samples-per-prompt", "1"])
    with pytest.raises(infra.UserError, match="--samples-per-prompt must be at least 2"):
        prime.check_args(args)


def test_all_equal_outcomes_leave_the_process_rewards_alone():
    # all four correct (or all wrong): each R_i - the others' mean is 0, so the returns are the process part alone
    mask = torch.ones(4, 2, dtype=torch.bool)
    process = torch.tensor([[0.1, -0.2], [0.3, 0.0], [0.0, 0.0], [-0.4, 0.2]])
    expected = 5.0 * prime.leave_one_out(process, mask, 4).flip(1).cumsum(1).flip(1)
    for outcome in (torch.ones(4), torch.zeros(4)):
        assert torch.allclose(prime.prime_returns(outcome, process, mask, 4), expected)
        assert torch.equal(prime.prime_returns(outcome, torch.zeros(4, 2), mask, 4), torch.zeros(4, 2))


def test_returns_sum_the_rewards_from_each_token_on_by_hand():
    # One group of 2, 3 and 2 tokens, outcomes 1 and 0 (leave-one-out: +1 and -1), token rewards [0.2, 0, -0.2] and
    # [0.4, 0.4] (means 0 and 0.4, sum 0.4: r_t x 2 - 0.4): [0, -0.4, -0.8] and [0.4, 0.4].
    # Returns, outcome 5 x (+-1) on every token + 5 x the process part summed from t on:
    #   row 0: 5 + 5 x [-1.2, -1.2, -0.8] = [-1, -1, 1]; row 1: -5 + 5 x [0.8, 0.4] = [-1, -3]
    mask = torch.tensor([[True, True, True], [True, True, False]])
    process = torch.tensor([[0.2, 0.0, -0.2], [0.4, 0.4, 0.0]])
    returns = prime.prime_returns(torch.tensor([1.0, 0.0]), process, mask, 2, 5.0, 5.0)
    assert torch.allclose(returns, torch.tensor([[-1.0, -1.0, 1.0], [-1.0, -3.0, 0.0]]), atol=1e-6)
    # --process-coef 0: RLOO on the outcome alone, +-5 on every valid token
    outcome_only = prime.prime_returns(torch.tensor([1.0, 0.0]), process, mask, 2, 5.0, 0.0)
    assert torch.equal(outcome_only, torch.tensor([[5.0, 5.0, 5.0], [-5.0, -5.0, 0.0]]))


# ----------------------------------------------------------------------------------------------
# The online filter (PRIME §3.3; verl recipe's filter_and_downsample).
# ----------------------------------------------------------------------------------------------
def test_the_filter_keeps_groups_within_the_bounds_first():
    # 4 groups of 4: accuracies 0, 0.25, 1, 0.5; [0.2, 0.8] passes groups 1 and 3
    rewards = torch.tensor([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0], dtype=torch.float)
    cut = torch.zeros(16, dtype=torch.bool)
    groups = lambda kept: [int(i) // 4 for i in kept[::4]]  # noqa: E731  the kept groups, in their order
    assert groups(prime.accuracy_filter(rewards, cut, 4, 2)) == [1, 3]
    assert prime.accuracy_filter(rewards, cut, 4, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert groups(prime.accuracy_filter(rewards, cut, 4, 3)) == [1, 3, 0]  # too few pass: the others fill, in order
    assert groups(prime.accuracy_filter(rewards, cut, 4, 4, (0.0, 1.0))) == [0, 1, 2, 3]  # no bounds: all, in order
    # a response cut at the length limit fails its group (verl's filter_truncate), whatever its accuracy
    cut[13] = True
    assert groups(prime.accuracy_filter(rewards, cut, 4, 2)) == [1, 0]


# ----------------------------------------------------------------------------------------------
# Through the loop: one step of prime.py on the tiny model, every rollout scripted (scripted_engine.py).
# ----------------------------------------------------------------------------------------------
def run_prime(monkeypatch, output_dir, argv, finish="stop", engine=ScriptedEngine):
    """One step of prime.py. Returns (step 0's record, loads, batch): loads are (model after the run, a copy as it
    started) in the order loaded (policy, implicit PRM, reference), batch the rollout the loop trained on."""
    loads, rollouts = [], []

    def load_model(*args, **kwargs):
        model, tokenizer = real_load_model(*args, **kwargs)
        loads.append((model, copy.deepcopy(model)))
        return model, tokenizer

    class Engine(engine):
        def generate(self, prompts, n=1, max_tokens=256, *args, **kwargs):
            completions = super().generate(prompts, n, max_tokens, *args, **kwargs)
            if max_tokens == RESPONSE_TOKENS and not rollouts:  # the rollout (evaluation: 8 tokens)
                rollouts.append((prompts, completions))
            return completions

    real_load_model = common.load_model
    monkeypatch.setattr(common, "load_model", load_model)
    monkeypatch.setattr(infra.run, "make_generator", lambda kind, model, tokenizer, *a, **k: Engine(tokenizer, finish))
    monkeypatch.setattr(sys, "argv", ["prime.py", *map(str, argv), "--run-name", "run", "--output-dir",
                                      str(output_dir)])
    importlib.import_module("prime").main()
    (prompts, completions), = rollouts
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  loads[0][0].config.pad_token_id)
    return records(os.path.join(output_dir, "run"))[0], loads, batch


def implicit_reward_sums(prm, reference, batch):
    """sum_t log pi_phi(y_t) / pi_ref(y_t) of each response (every scripted response fills RESPONSE_TOKENS)."""
    assert batch.response_mask.all()
    with torch.no_grad():
        return (plain_logprobs(prm, batch) - plain_logprobs(reference, batch)).sum(1)


ONE_PRM_STEP = ONE_UPDATE + ["--prm-mini-batches", 1]


@pytest.mark.parametrize("finish, label", [("stop", 1.0), ("length", 0.0)])
def test_the_prm_update_moves_the_implicit_reward_toward_the_outcome(finish, label, monkeypatch, tmp_path):
    # Every response the correct answer: "stop" ends it (R = 1), "length" cuts it at the limit (R = 0, as everywhere).
    # The PRM starts as the reference (ln 2 by the rule); one step raises every correct response's implicit reward
    # and lowers every cut one's.
    record, loads, batch = run_prime(monkeypatch, tmp_path, ONE_PRM_STEP, finish)
    (prm, prm_start), (reference, _) = loads[1], loads[2]
    assert record["reward"] == label and record["prm_loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert torch.equal(implicit_reward_sums(prm_start, reference, batch), torch.zeros(8))
    sums = implicit_reward_sums(prm, reference, batch)
    print(f"{finish}: implicit reward sums after one PRM step {sums.tolist()}")
    assert (sums > 0).all() if label == 1 else (sums < 0).all(), sums


@pytest.fixture
def recorded(monkeypatch):
    """Records the loop's calls of implicit_rewards, prime_returns and policy_loss (arguments and results) and of
    the PRM's optimizer steps, in order."""
    calls = []

    def recording(name):
        real = getattr(prime, name)

        def call(*args, **kwargs):
            result = real(*args, **kwargs)
            calls.append((name, args, result))
            return result
        monkeypatch.setattr(prime, name, call)
    for name in ("implicit_rewards", "prime_returns", "policy_loss", "prm_loss"):
        recording(name)
    return calls


@pytest.mark.parametrize("update", ["before", "after"])
def test_the_prm_is_updated_then_scores_the_rollout_whose_rewards_make_the_advantages(update, recorded, monkeypatch,
                                                                                       tmp_path):
    record, loads, batch = run_prime(monkeypatch, tmp_path, ONE_PRM_STEP + ["--prm-update", update])
    (prm, prm_start), (reference, _) = loads[1], loads[2]
    names = [name for name, _, _ in recorded]
    assert names == ["prm_loss", "prm_loss", "implicit_rewards", "prime_returns", "policy_loss", "policy_loss"]
    (_, (prm_logprobs, reference_logprobs, mask, beta), process), = [c for c in recorded if c[0] == "implicit_rewards"]
    with torch.no_grad():
        after_update, at_start = plain_logprobs(prm, batch), plain_logprobs(prm_start, batch)
    assert torch.allclose(reference_logprobs, plain_logprobs(reference, batch), atol=1e-5) and beta == 0.05
    if update == "before":  # released (verl's recipe): the PRM updated on this rollout scores it (a second forward)
        assert torch.allclose(prm_logprobs, after_update, atol=1e-5)
        assert not torch.allclose(prm_logprobs, at_start, atol=1e-5) and process.abs().max() > 0
    else:  # PRIME-RL/PRIME's script: scored by the update's own forward pass, the PRM as it was (here: the reference)
        assert torch.allclose(prm_logprobs, at_start, atol=1e-5)
        assert torch.equal(process, torch.zeros_like(process))
    # those rewards, and no others, reach the returns; their whitening is the policy loss's advantages
    (_, (rewards, process_rewards, *_), returns), = [c for c in recorded if c[0] == "prime_returns"]
    assert process_rewards is process and rewards.tolist() == [1.0] * 8
    advantages = prime.whiten(returns, batch.response_mask)
    used = torch.cat([args[2][args[3]] for name, args, _ in recorded if name == "policy_loss"])
    assert torch.allclose(used.sort().values, advantages[batch.response_mask].sort().values, atol=1e-6)


class MixedEngine(ScriptedEngine):
    """Prompt p's samples: the first CORRECT[p] the correct answer, the others a wrong one (\\boxed{0}), all stopping
    at RESPONSE_TOKENS tokens."""
    CORRECT = (4, 2, 0, 1)

    def generate(self, prompts, n=1, max_tokens=256, *args, **kwargs):
        completions = super().generate(prompts, n, max_tokens, *args, **kwargs)
        if max_tokens != RESPONSE_TOKENS:
            return completions
        wrong = self.tokenizer.encode("\\boxed{0}", add_special_tokens=False)
        wrong = wrong + self.tokenizer.encode(" ", add_special_tokens=False) * (max_tokens - len(wrong) - 1)
        wrong = wrong + [self.tokenizer.eos_token_id]
        return [c if i % n < self.CORRECT[c.prompt_index] else common.Completion(
            c.prompt_index, wrong, self.tokenizer.decode(wrong, skip_special_tokens=True), [-1.0] * len(wrong), "stop")
            for i, c in enumerate(completions)]


def test_the_loops_filter_keeps_the_groups_within_the_bounds(recorded, monkeypatch, tmp_path):
    # --oversample 2: 4 prompts sampled, 2 kept; accuracies 1, 0.5, 0, 0.25: prompts 1 and 3 pass [0.2, 0.8]
    record, _, _ = run_prime(monkeypatch, tmp_path, ONE_UPDATE + ["--oversample", 2], engine=MixedEngine)
    assert record["accuracy_before_filter"] == pytest.approx(7 / 16) and record["reward"] == pytest.approx(3 / 8)
    (_, (rewards, *_), _), = [c for c in recorded if c[0] == "prime_returns"]
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]


# ----------------------------------------------------------------------------------------------
# Defaults: the released ones for a real model; the demo: the controlled preset, PRIME's own mechanism on top.
# ----------------------------------------------------------------------------------------------
def test_released_defaults_and_the_demo_preset():
    args = infra.cli.parse_args(prime.Args, prime.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    assert (args.prompts_per_step, args.samples_per_prompt, args.oversample, args.accuracy_bounds) == (
        64, 4, 4, (0.2, 0.8))
    assert (args.lr, args.prm_lr, args.beta, args.prm_update, args.prm_grad_clip) == (5e-7, 1e-6, 0.05, "before", 10.0)
    assert (args.outcome_coef, args.process_coef, args.whiten_advantages, args.kl_coef) == (5.0, 5.0, True, 0.0)
    assert (args.mini_batches, args.prm_mini_batches, args.max_response_tokens) == (1, 4, 3072)
    tiny = infra.cli.parse_args(prime.Args, prime.TINY_PRESET, [])
    assert (tiny.prompts_per_step, tiny.samples_per_prompt, tiny.oversample, tiny.lr, tiny.prm_lr) == (
        64, 8, 1, 3e-5, 6e-5)
    assert (tiny.whiten_advantages, tiny.mini_batches, tiny.aggregation) == (True, 2, "token-mean")
