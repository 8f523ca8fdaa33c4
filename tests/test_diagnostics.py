"""Tests for the critic diagnostics in common.py: explained variance, effective rank, sign accuracy with the SNR
filter, the within-response variation ratio, Monte Carlo values, and probe_critic end to end."""
import math
import types
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import infra.engine
import infra.probes
import infra.tiny


@pytest.fixture(scope="module")
def tokenizer():
    return common.load_tokenizer("tiny")


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class BernoulliGenerator:
    """A fake rollout engine on the built-in task. From prompt + prefix it answers right with probability
    success(prefix_text) (`\\boxed{a+b}`, else `\\boxed{a+b+1}`), then EOS. With n == 1 it returns `response`
    (the probe's sampled response). Records every call and the tokens it generated."""

    def __init__(self, tokenizer, success, response="", finish=lambda prefix: "stop", seed=0):
        self.tokenizer, self.success, self.response, self.finish = tokenizer, success, response, finish
        self.rng, self.calls, self.generated = np.random.default_rng(seed), [], 0

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        self.calls.append((len(prompts), n, max_tokens))
        out, eos = [], self.tokenizer.eos_token_id
        for i, prompt in enumerate(prompts):
            question, prefix = self.tokenizer.decode(prompt).split("\n", 1)
            prefix = prefix.split(common.INSTRUCTION + "\n", 1)[1]
            total = sum(int(x) for x in question.split("+"))
            for _ in range(n):
                if n == 1:
                    text = self.response
                else:
                    text = f"\\boxed{{{total if self.rng.random() < self.success(prefix) else total + 1}}}"
                tokens = ids(self.tokenizer, text) + ([eos] if self.finish(prefix) == "stop" else [])
                self.generated += len(tokens)
                out.append(common.Completion(i, tokens, text, [0.0] * len(tokens), self.finish(prefix)))
        return out


# ---------------------------------------------------------------- explained variance
def test_explained_variance_by_hand():
    returns = torch.tensor([[1.0, 0.0, 1.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])  # the last column is padding, its 5.0 and 9.0 ignored
    # Var(returns) over (1, 0, 1) = 2/9; a constant critic leaves the residual variance at 2/9 -> 0
    assert infra.probes.explained_variance(torch.tensor([[0.5, 0.5, 0.5, 9.0]]), returns, mask) == pytest.approx(0.0)
    # residual (0.1, -0.1, 0.4): mean 2/15, E[r^2] = 0.06, variance 0.06 - 4/225 = 0.04222; 1 - 0.04222 / (2/9) = 0.81
    assert infra.probes.explained_variance(torch.tensor([[0.9, 0.1, 0.6, 9.0]]), returns, mask) == pytest.approx(0.81)
    assert infra.probes.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)
    # worse than a constant: residual (-1, 1, -1), variance 8/9 -> 1 - 4 = -3
    assert infra.probes.explained_variance(torch.tensor([[2.0, -1.0, 2.0, 0.0]]), returns, mask) == pytest.approx(-3.0)


def test_explained_variance_constant_returns():
    returns, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    assert infra.probes.explained_variance(torch.full((2, 3), 0.4), returns, mask) == 1.0  # residual constant
    assert infra.probes.explained_variance(torch.tensor([[0.4, 0.5, 0.6]] * 2), returns, mask) == 0.0
    assert infra.probes.explained_variance(returns, returns, torch.zeros(2, 3, dtype=torch.bool)) == 0.0


def test_explained_variance_of_all_equal_rewards_is_finite():
    # gamma = lambda = 1, every reward R: every return is R, in float32 up to the rounding that A + V leaves, which
    # made 1 - Var(residual) / Var(returns) about -1e13. The critic's values vary, so the residual R - V does: 0.0;
    # a constant critic leaves a constant residual: 1.0 (scikit-learn's convention)
    import ppo
    mask = torch.arange(64)[None] < torch.tensor([[64], [40], [17], [64]])
    values = 0.3 + 0.1 * torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    for reward in (0.0, 1.0):
        _, returns = ppo.gae(ppo.terminal_rewards(torch.full((4,), reward), mask), values, mask)
        valid, residual = returns[mask].double(), (returns - values)[mask].double()
        assert (valid != reward).any() and 1 - residual.var() / valid.var() < -1e9  # the rounding, unguarded
        assert infra.probes.explained_variance(values, returns, mask) == 0.0
        assert infra.probes.explained_variance(torch.full_like(values, 0.3), returns, mask) == 1.0


def test_explained_variance_keeps_a_small_real_variance():
    # returns 1 +- d alternating (Var d^2), values halfway to them: residual (returns - 1) / 2, Var d^2 / 4 -> 0.75.
    # The tolerance is rounding-sized: d = 1e-4 is real in float32 (4 sqrt(64) eps = 3.8e-6), 1e-9 in float64
    for d, dtype in ((1e-4, torch.float32), (1e-9, torch.float64)):
        returns = 1 + d * torch.tensor([[1.0, -1.0] * 32], dtype=dtype)
        values, mask = 1 + (returns - 1) / 2, torch.ones(1, 64, dtype=torch.bool)
        assert infra.probes.explained_variance(values, returns, mask) == pytest.approx(0.75, abs=1e-3)


def scripted_records(trainer, argv, finish, monkeypatch, tmp_path):
    """{step: metrics} of `trainer` run in-process with every rollout from ScriptedEngine(finish): every reward 0
    ("length": the response is cut) or every reward 1 ("stop")."""
    import importlib
    import infra.run
    from helpers import records
    from scripted_engine import ScriptedEngine
    make_generator = lambda kind, model, tokenizer, *args, **kwargs: ScriptedEngine(tokenizer, finish)  # noqa: E731
    monkeypatch.setattr(infra.run, "make_generator", make_generator)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *map(str, argv), "--run-name", finish, "--output-dir",
                                      str(tmp_path)])
    importlib.import_module(trainer).main()
    return records(os.path.join(tmp_path, finish))


TWO_STEPS = ["--steps", 2, "--eval-problems", 2, "--eval-n", 1, "--eval-max-tokens", 16, "--max-response-tokens", 16,
             "--prompts-per-step", 2, "--samples-per-prompt", 4, "--mini-batches", 1, "--micro-batch-size", 8,
             "--critic-warmup", 0]


@pytest.mark.parametrize("trainer", ["ppo", "sp3o", "tppo", "sppo", "vapo"])
def test_every_critic_trainer_logs_a_finite_explained_variance_when_all_rewards_are_equal(trainer, monkeypatch,
                                                                                       tmp_path):
    # every reward 0, then every reward 1, through the trainer's own loop: returns R everywhere (SPPO: the rewards
    # themselves). A critic whose values vary -> 0.0 (it was about -1e13: the returns' float32 rounding); TPPO's
    # critic starts at z = 0, V = 1/2 everywhere, a constant residual -> 1.0 at step 0; after an update all vary
    argv = TWO_STEPS + (["--samples-per-prompt", 1, "--prompts-per-step", 8] if trainer == "sppo" else [])
    keys = ["explained_variance"] + (["explained_variance_anchors"] if trainer == "sp3o" else [])
    for finish, reward in (("length", 0.0), ("stop", 1.0)):
        logged = scripted_records(trainer, argv, finish, monkeypatch, tmp_path)
        assert [logged[step]["reward"] for step in (0, 1)] == [reward, reward]
        first = 1.0 if trainer == "tppo" else 0.0
        assert [[logged[step][key] for key in keys] for step in (0, 1)] == [[first] * len(keys), [0.0] * len(keys)]


def test_ppo_on_a_task_the_tiny_model_never_solves_logs_a_readable_explained_variance(run_cli, tmp_path):
    # builtin:12 (12-digit sums): the tiny model scores 0, every rollout's rewards are all 0
    result = run_cli("ppo.py", "--dataset", "builtin:12", "--steps", 2, "--prompts-per-step", 4, "--eval-problems", 8,
                     "--critic-warmup", 0, "--output-dir", tmp_path, "--run-name", "zero")
    assert result.returncode == 0, result.stderr[-3000:]
    from helpers import records
    logged = records(os.path.join(tmp_path, "zero"))
    assert [logged[step]["reward"] for step in (0, 1)] == [0.0, 0.0]
    assert all(-10 <= logged[step]["explained_variance"] <= 1 for step in (0, 1)), logged
    assert " ev 0 " in result.stdout


# ---------------------------------------------------------------- effective rank
def test_effective_rank_of_known_matrices():
    assert infra.probes.effective_rank(torch.eye(5)) == pytest.approx(5.0)
    assert infra.probes.effective_rank(torch.zeros(4, 3)) == 0.0
    rank_one = torch.outer(torch.arange(1.0, 5.0), torch.tensor([1.0, -2.0, 0.5]))
    assert infra.probes.effective_rank(rank_one) == pytest.approx(1.0)
    # rank 2 with equal singular values: two orthogonal unit directions scaled by 3, in a 6 x 4 matrix
    q_left, _ = torch.linalg.qr(torch.randn(6, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    q_right, _ = torch.linalg.qr(torch.randn(4, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    assert infra.probes.effective_rank(3 * q_left @ q_right.T) == pytest.approx(2.0, abs=1e-6)
    # singular values (3, 1): p = (3/4, 1/4), H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623, exp(H) = 1.7548
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert infra.probes.effective_rank(q_left @ torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)) @ q_right.T) \
        == pytest.approx(math.exp(entropy), abs=1e-6)
    assert math.exp(entropy) == pytest.approx(1.7548, abs=1e-4)


def test_effective_rank_of_random_low_rank_matrices():
    generator = torch.Generator().manual_seed(0)
    for rank in (1, 3, 7):
        matrix = torch.randn(40, rank, generator=generator) @ torch.randn(rank, 16, generator=generator)
        assert 1.0 <= infra.probes.effective_rank(matrix) <= rank + 1e-6


# ---------------------------------------------------------------- sign accuracy and SNR filter
def test_sign_accuracy_with_snr_filter_by_hand():
    K = 8  # Agresti-Caffo: p~ = (c + 1) / 10, se^2 = (p~_a (1 - p~_a) + p~_b (1 - p~_b)) / 10, SNR = |p~_b - p~_a| / se
    # row 0, MC (2/8, 5/8, 3/8, 5/8), i.e. p~ (0.3, 0.6, 0.4, 0.6):
    #   0.3 -> 0.6: se = sqrt((0.21 + 0.24) / 10) = 0.2121, SNR 1.414; critic 0.5 -> 0.4 (down): wrong
    #   0.6 -> 0.4: se = sqrt(0.48 / 10) = 0.2191, SNR 0.913; critic 0.4 -> 0.35 (down): right
    #   0.4 -> 0.6: SNR 0.913; critic 0.35 -> 0.7 (up): right
    # row 1, MC (0, 0, 1, 1): p~ (0.1, 0.1, 0.9, 0.9): 0 -> 0 (SNR 0, never kept); 0 -> 1: se = sqrt(0.018) = 0.1342,
    #   SNR 5.96, with a flat critic (counted wrong); 1 -> 1 not kept
    critic = [[0.5, 0.4, 0.35, 0.7], [0.2, 0.3, 0.3, 0.1]]
    mc = [[2 / 8, 5 / 8, 3 / 8, 5 / 8], [0.0, 0.0, 1.0, 1.0]]
    accuracy, kept = infra.probes.sign_accuracy(critic, mc, K, tau=0)
    assert (accuracy, kept) == (pytest.approx(2 / 4), pytest.approx(4 / 6))
    accuracy, kept = infra.probes.sign_accuracy(critic, mc, K, tau=1)  # keeps row 0's first interval and row 1's jump
    assert (accuracy, kept) == (0.0, pytest.approx(2 / 6))
    accuracy, kept = infra.probes.sign_accuracy(critic, mc, K, tau=2.5)  # only the jump
    assert (accuracy, kept) == (0.0, pytest.approx(1 / 6))
    assert infra.probes.sign_accuracy([[0.1, 0.2]], [[0.5, 0.5]], K, tau=0) == (None, 0.0)


def test_sign_accuracy_one_sample_differences_are_never_significant():
    # 0 vs 1 success of K: the plug-in se sqrt(p^ (1 - p^) / K) gave SNR sqrt(K / (K - 1)) > 1, so tau = 1 kept it.
    # Agresti-Caffo: SNR^2 = (K + 2) / (3K + 1) at the extremes, less in between: below 1 for every K.
    for K in (1, 2, 4, 8, 9, 16, 64):
        for c in range(K):  # c vs c + 1 successes, both directions
            up, down = [[c / K, (c + 1) / K]], [[(c + 1) / K, c / K]]
            assert infra.probes.sign_accuracy([[0.0, 1.0]], up, K, tau=1) == (None, 0.0), (K, c)
            assert infra.probes.sign_accuracy([[1.0, 0.0]], down, K, tau=1) == (None, 0.0), (K, c)
            assert infra.probes.sign_accuracy([[0.0, 1.0]], up, K, tau=0) == (1.0, 1.0)  # any change is kept at tau = 0
    # the extreme case by hand, K = 4: p~ = 1/6, 2/6; SNR^2 = (1/36) / ((5/36 + 8/36) / 6) = 6 / 13 = (4 + 2) / (12 + 1)
    adjusted = (np.array([0, 1]) + 1) / 6
    snr = abs(adjusted[1] - adjusted[0]) / math.sqrt((adjusted * (1 - adjusted)).sum() / 6)
    assert snr ** 2 == pytest.approx(6 / 13)


def test_sign_accuracy_more_continuations_keep_more_intervals():
    critic = [[0.0, 1.0]]  # the same MC change 0.5 -> 0.75; SNR = (K / 4) / (K + 2) / se
    # K = 4: c 2 -> 3, p~ 0.5, 0.667, se = sqrt((0.25 + 0.2222) / 6) = 0.2805, SNR 0.594
    assert infra.probes.sign_accuracy(critic, [[0.5, 0.75]], 4, tau=1) == (None, 0.0)
    # K = 16: c 8 -> 12, p~ 0.5, 0.7222, se = sqrt((0.25 + 0.2006) / 18) = 0.1582, SNR 1.405
    assert infra.probes.sign_accuracy(critic, [[0.5, 0.75]], 16, tau=1) == (1.0, 1.0)


def test_variation_ratio_by_hand():
    # critic row (0, 0.3, 0.6, 0.9): deviations (-.45, -.15, .15, .45), squares sum 0.45
    # MC row (0, 0, 1, 1): deviations +-0.5, squares sum 1.0; ratio sqrt(0.45 / 1.0)
    critic, mc = [[0.0, 0.3, 0.6, 0.9]] * 2, [[0, 0, 1, 1]] * 2
    assert infra.probes.variation_ratio(critic, mc) == pytest.approx(math.sqrt(0.45))
    assert infra.probes.variation_ratio([[0.5] * 4], [[0, 0, 1, 1]]) == 0.0  # a flat critic
    assert infra.probes.variation_ratio([[0.0, 1.0]], [[0.5, 0.5]]) is None  # nothing to compare with


def test_probe_cuts():
    assert infra.probes.probe_cuts(38) == [0, 11, 23, 34]  # round(11.4), round(22.8), round(34.2)
    assert infra.probes.probe_cuts(10) == [0, 3, 6, 9]
    assert infra.probes.probe_cuts(5) == [0, 2, 3, 4]  # round(1.5) = 2, round(3.0) = 3, round(4.5) = 4 (half to even)
    assert infra.probes.probe_cuts(2) == [0, 1, 1, 1]  # capped at the state before the last token
    assert infra.probes.probe_cuts(1) == [0, 0, 0, 0]


# ---------------------------------------------------------------- Monte Carlo values
def test_monte_carlo_values_recover_known_success_probabilities(tokenizer):
    rows = infra.tiny.builtin_rows("test", 3, seed=0)
    probability = {"": 0.25, "good ": 0.75}
    generator = BernoulliGenerator(tokenizer, lambda prefix: probability[prefix])
    K = 400
    states, state_rows, expected = [], [], []
    for row in rows:
        prompt = common.prompt_ids(tokenizer, row["question"])
        for prefix in ("", "good ", ""):  # a repeated state is sampled once
            states.append((prompt, ids(tokenizer, prefix)))
            state_rows.append(row)
            expected.append(probability[prefix])
    values, generated = common.monte_carlo_values(generator, tokenizer, states, state_rows, K, max_tokens=48)
    assert generator.calls == [(6, K, 48)]  # one call, 3 prompts x 2 distinct prefixes
    assert generated == generator.generated
    standard_errors = np.sqrt(np.array(expected) * (1 - np.array(expected)) / K)  # 0.0217 for p = 0.25 or 0.75
    assert np.all(np.abs(values - expected) < 4 * standard_errors), (values, expected)
    assert values[0] == values[2] and values[3] == values[5]


def test_monte_carlo_values_score_truncated_continuations_zero(tokenizer):
    row = {"question": "100+200", "answer": "300"}
    prompt = common.prompt_ids(tokenizer, row["question"])
    finish = lambda prefix: "length" if "cut" in prefix else "stop"
    always = BernoulliGenerator(tokenizer, lambda prefix: 1.0, finish=finish)
    states = [(prompt, []), (prompt, ids(tokenizer, "cut ")), (prompt, ids(tokenizer, "x" * 9))]
    # continuation `\boxed{300}` + EOS = 12 tokens: 0 + 12 <= 20 counts; `cut ` stops at the length limit;
    # 9 + 12 = 21 > 20 tokens in all: past the length limit, so 0 although it stopped
    values, _ = common.monte_carlo_values(always, tokenizer, states, [row] * 3, 5, max_tokens=20)
    assert values.tolist() == [1.0, 0.0, 0.0]
    values, _ = common.monte_carlo_values(always, tokenizer, states[2:], [row], 5, max_tokens=21)
    assert values.tolist() == [1.0]


def test_monte_carlo_values_with_the_tiny_model(tokenizer):
    """The real tiny model from states whose outcome is all but decided: the full right solution (it only has to
    stop) and a full wrong one."""
    policy = common.load_model("tiny", device="cpu")[0]
    generator = infra.engine.make_generator("hf", policy, tokenizer)
    a, b = 478, 365
    prompt = common.prompt_ids(tokenizer, f"{a}+{b}")
    right = infra.tiny.addition_solution(a, b)  # ... \boxed{843}
    wrong = infra.tiny.addition_solution(a, b, drops_carry=lambda total: True)  # ... \boxed{733}
    assert right.endswith("{843}") and wrong.endswith("{733}")
    torch.manual_seed(0)
    values, generated = common.monte_carlo_values(generator, tokenizer, [(prompt, ids(tokenizer, right)),
                                                  (prompt, ids(tokenizer, wrong))], [{"answer": "843"}] * 2, 16,
                                                  max_tokens=48)
    assert values[0] >= 0.8 and values[1] <= 0.2, values
    assert generated >= 32  # at least the EOS of each of the 2 x 16 continuations


# ---------------------------------------------------------------- probe_critic
def probe_args(**flags):
    """The flags probe_critic reads, as a trainer's args would hold them."""
    defaults = dict(probe_prompts=16, probe_continuations=8, max_response_tokens=48, temperature=1.0, top_p=1.0,
                    micro_batch_size=8, seed=0)
    return types.SimpleNamespace(**{**defaults, **flags})


def test_probe_critic_on_a_scripted_policy(tokenizer):
    rows = infra.tiny.builtin_rows("test", 3, seed=1)
    # sampled response `abcdefghi` + EOS: 10 tokens, cuts (0, 3, 6, 9); right iff the prefix has >= 5 characters,
    # so MC = (0, 0, 1, 1) exactly. The critic says V(s_t) = t / 10: (0, 0.3, 0.6, 0.9).
    generator = BernoulliGenerator(tokenizer, lambda prefix: float(len(prefix) >= 5), response="abcdefghi")
    value_fn = lambda batch: (torch.arange(batch.response_width) / 10).expand(batch.input_ids.shape[0], -1)
    metrics = infra.probes.probe_critic(generator, tokenizer, rows + rows, value_fn,
                                        probe_args(probe_prompts=3, probe_continuations=4, micro_batch_size=2))
    assert generator.calls == [(3, 1, 48), (12, 4, 48)]  # the responses, then 3 prompts x 4 distinct states
    assert metrics["probe/mse_prompt"] == pytest.approx(0.0)
    assert metrics["probe/mse_30"] == pytest.approx(0.09)
    assert metrics["probe/mse_60"] == pytest.approx(0.16)
    assert metrics["probe/mse_90"] == pytest.approx(0.01)
    assert metrics["probe/mc_mean"] == pytest.approx(0.5)
    assert metrics["probe/value_mean"] == pytest.approx(0.45)
    assert metrics["probe/variation_ratio"] == pytest.approx(math.sqrt(0.45))
    assert metrics["probe/sign_acc_tau0"] == 1.0 and metrics["probe/sign_kept_tau0"] == pytest.approx(1 / 3)
    assert metrics["probe/sign_acc_tau1"] == 1.0
    assert metrics["probe_tokens"] == generator.generated
    assert metrics["probe_s"] >= 0 and "probe/effective_rank" not in metrics


def test_probe_critic_prompt_only(tokenizer):
    rows = infra.tiny.builtin_rows("test", 4, seed=2)
    generator = BernoulliGenerator(tokenizer, lambda prefix: 1.0)
    value_fn = lambda batch: torch.full((batch.input_ids.shape[0], 1), 0.75)
    metrics = infra.probes.probe_critic(generator, tokenizer, rows, value_fn,
                                        probe_args(probe_prompts=4, probe_continuations=3), prompt_only=True)
    assert generator.calls == [(4, 3, 48)]  # no sampled response: the prompt states only
    assert metrics["probe/mse_prompt"] == pytest.approx(0.0625)  # (0.75 - 1)^2
    assert not any(key.startswith(("probe/mse_3", "probe/sign", "probe/variation")) for key in metrics)


def test_probe_critic_with_the_tiny_model_and_a_fresh_critic(tokenizer):
    policy = common.load_model("tiny", device="cpu")[0]
    critic = common.load_model("tiny", device="cpu", value_head=True)[0]
    generator = infra.engine.make_generator("hf", policy, tokenizer)
    rows = infra.tiny.builtin_rows("test", 4, seed=0)
    rng_before = torch.get_rng_state()
    metrics = infra.probes.probe_critic(generator, tokenizer, rows, lambda b: common.critic_outputs(critic, b),
                                        probe_args(probe_prompts=4, probe_continuations=4), critic)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert 0.0 <= metrics["probe/mc_mean"] <= 1.0
    assert 1.0 <= metrics["probe/effective_rank"] <= 48  # at most min(response tokens, hidden size 128)
    assert metrics["probe_tokens"] > 4 * 30  # at least the 4 sampled responses (~38 tokens each)
    again = infra.probes.probe_critic(generator, tokenizer, rows, lambda b: common.critic_outputs(critic, b),
                                      probe_args(probe_prompts=4, probe_continuations=4), critic)
    assert {k: v for k, v in again.items() if k != "probe_s"} == {k: v for k, v in metrics.items() if k != "probe_s"}


def test_response_hidden_states_rows_match_response_lengths(tokenizer):
    critic = common.load_model("tiny", device="cpu", value_head=True)[0]
    prompts = [ids(tokenizer, "12+34\n"), ids(tokenizer, "5+6\n")]
    batch = common.sequence_batch(prompts, [ids(tokenizer, "abc"), ids(tokenizer, "abcdefg")], tokenizer.pad_token_id)
    hidden = infra.probes.response_hidden_states(critic, batch, micro_batch_size=1)
    assert [h.shape for h in hidden] == [(3, 128), (7, 128)]
    # the state before response token t is the same however the batch is cut: compare with the full batch
    together = infra.probes.response_hidden_states(critic, batch, micro_batch_size=2)
    assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(hidden, together))
    # and it is the hidden state the value head reads: score(hidden) equals critic_outputs
    values = common.critic_outputs(critic, batch)
    assert torch.allclose(critic.score(together[1]).squeeze(-1), values[1, :7], atol=1e-5)
