"""What the loops feed to the critic and the policy (ppo.py family, and SPO's whitening), seen through metrics.jsonl
of one-step runs.

With one step and one mini-batch, step 0's losses and gradient norms are those of the rollout's models before any
update, so two seeded runs that differ in a flag see the same rollout and the same initial models, and their
critic metrics are equal exactly when the critic's targets and weights are. (The skeleton of main() cannot grow a
function for this without breaking the `diff ppo.py sppo.py` budget, so the loop is tested from outside.)"""
import functools
import json
import math
import os
import subprocess
import sys

import pytest

import infra.cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_STEP = ["--steps", "1", "--mini-batches", "1", "--prompts-per-step", "2", "--micro-batch-size", "32",
            "--eval-problems", "1", "--seed", "0"]
CRITIC = ("value_loss", "critic_grad_norm", "explained_variance")


@pytest.fixture(scope="module")
def step_zero(tmp_path_factory):
    """step_zero(trainer, *flags) -> the step-0 record of `trainer` run for one step with ONE_STEP and `flags`
    (cached: the tests of this module share runs)."""
    @functools.lru_cache(maxsize=None)
    def run(trainer, *flags):
        output = tmp_path_factory.mktemp("wiring")
        result = subprocess.run([sys.executable, f"{trainer}.py", *ONE_STEP, *flags, "--run-name", "run",
                                 "--output-dir", str(output)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr[-3000:]
        with open(os.path.join(output, "run", "metrics.jsonl")) as handle:
            [record] = [json.loads(line) for line in handle]
        return record
    return run


def same(first, second, keys):
    return all(first[key] == pytest.approx(second[key], rel=1e-6, abs=1e-9) for key in keys)


VERL = ("--whiten-advantages", "--aggregation", "token-mean")  # verl's recipe (with --critic-warmup 0)


def test_whitened_advantages_average_zero_over_the_batch(step_zero):
    # One mini-batch, ratio 1 before the update: the token-mean PPO loss is -mean(A) over the loss's tokens, which
    # whitening makes 0; without whitening it is -mean(R - V_t), not 0. (Under seq-mean, ppo.py's and sp3o.py's
    # published reduction, a whitened batch's loss is not 0 either: token-mean lets the flag alone decide.) SPO (one
    # epoch here): the same over the low-probability tokens, its k3 KL to the reference is 0 before the update. The
    # actor's loss is logged only once the critic warm-up is over: ppo.py and sp3o.py run with --critic-warmup 0.
    # (The demo preset: token-mean, lambda 1, one epoch, no whitening, for every file.)
    actor = ("--critic-warmup", "0")
    whiten = ("--whiten-advantages",)  # off in the controlled demo preset; on in TPPO's and SPO's published ones
    whitened = (("ppo", VERL + actor), ("sp3o", VERL + actor), ("tppo", whiten), ("spo", whiten))
    for trainer, flags in whitened:
        assert abs(step_zero(trainer, *flags)["policy_loss"]) < 1e-5, trainer
    token_mean = ("--aggregation", "token-mean", *actor)  # whitening off: the published setting of ppo.py and sp3o.py
    unwhitened = (("ppo", token_mean), ("sp3o", token_mean), ("tppo", ()), ("spo", ()))
    for trainer, flags in unwhitened:
        assert abs(step_zero(trainer, *flags)["policy_loss"]) > 1e-3, trainer


def test_sp3o_critic_is_dense_in_the_warmup_then_anchored(step_zero):
    # Same seed, same rollout, same initial critic: during the warm-up (the first 5 steps of the tiny preset) SP3O's
    # critic loss is PPO's dense one (every valid token), after it the anchors' loss, a different number.
    ppo = step_zero("ppo")
    warmup = step_zero("sp3o")
    anchored = step_zero("sp3o", "--critic-warmup", "0")
    assert warmup["reward"] == ppo["reward"] == anchored["reward"]  # the same rollout
    assert same(warmup, ppo, CRITIC)
    assert not same(anchored, ppo, ["value_loss"]) and not same(anchored, ppo, ["critic_grad_norm"])
    assert math.isfinite(anchored["value_loss"]) and anchored["value_loss"] > 0
    # seq-mean (SP3O's launcher; the demo preset takes token-mean) changes the dense loss's weights: the warm-up
    # still follows PPO's
    seq_mean = ("--aggregation", "seq-mean")
    assert same(step_zero("sp3o", *seq_mean), step_zero("ppo", *seq_mean), CRITIC)
    assert not same(step_zero("ppo", *seq_mean), ppo, ["critic_grad_norm"])


def test_tppo_critic_targets_use_lambda_critic_not_lambda_actor(step_zero):
    # The critic's targets are GAE returns with lam_critic: changing lam_actor (and whitening, which only touches
    # the advantages) leaves every critic metric unchanged; changing lam_critic changes the critic's gradient.
    # (Its loss alone cannot tell: the zero-initialised head reads V = 1/2, and BCE(1/2, G) = ln 2 for any G.)
    default = step_zero("tppo")
    other_actor = step_zero("tppo", "--lam-actor", "0.95", "--whiten-advantages")  # TPPO's published pair
    other_critic = step_zero("tppo", "--lam-critic", "0")
    assert default["reward"] == other_actor["reward"] == other_critic["reward"]  # the same rollout
    assert same(default, other_actor, CRITIC)
    assert not same(default, other_critic, ["critic_grad_norm"])


@pytest.mark.parametrize("trainer", infra.cli.trainers())
def test_old_logprobs_are_the_engines_where_exact_else_recomputed(step_zero, trainer):
    # The logged gap |engine log-prob - old log-prob| is exactly 0 when the old log-probs are the HF engine's
    # (--old-logprobs auto at top-p 1, the demo preset), and float noise (> 0, < 1e-4) when the trainer recomputes
    # them (--old-logprobs recompute; at TPPO's published top-p 0.95 auto recomputes, the gap is then the
    # truncation's, > 1e-4). Step 0's loss is the same either way, up to that noise.
    auto, recomputed = step_zero(trainer), step_zero(trainer, "--old-logprobs", "recompute")
    if trainer == "tppo":
        nucleus = step_zero(trainer, "--top-p", "0.95")
        assert nucleus["logprob_gap_max"] > 1e-4 and nucleus["logprob_gap_max"] == step_zero(
            trainer, "--top-p", "0.95", "--old-logprobs", "recompute")["logprob_gap_max"]
    assert auto["logprob_gap_max"] == 0.0
    assert 0.0 < recomputed["logprob_gap_max"] < 1e-4
    if "policy_loss" in auto:  # the actor's loss is logged once a critic warm-up is over
        assert auto["policy_loss"] == pytest.approx(recomputed["policy_loss"], abs=1e-5)


CRITIC_TRAINERS = [name for name in infra.cli.trainers() if "critic_epochs" in infra.cli.trainer_defaults(name)]


@pytest.mark.parametrize("trainer", CRITIC_TRAINERS)
def test_critic_epochs_add_passes_of_the_critic_alone(step_zero, trainer):
    # --critic-epochs 3 (one mini-batch): the actor's one pass is the default run's (same loss, clip fraction and
    # gradient norm), the logged value loss is the mean over 3 critic passes, of which only the first is the default's.
    # --epochs 2 --critic-epochs 1: the mirror image. explained_variance is computed before any update: always equal.
    # The default is the published one pass each (the tiny preset gives ppo, sp3o and tppo 4 critic passes).
    actor, critic = ("policy_loss", "clip_fraction", "grad_norm"), ("value_loss", "critic_grad_norm")
    default = step_zero(trainer, "--critic-warmup", "0", "--critic-epochs", "1")
    more_critic = step_zero(trainer, "--critic-warmup", "0", "--critic-epochs", "3")
    more_actor = step_zero(trainer, "--critic-warmup", "0", "--epochs", "2", "--critic-epochs", "1")
    assert default["reward"] == more_critic["reward"] == more_actor["reward"]  # the same rollout
    assert same(default, more_critic, actor + ("explained_variance",))
    assert all(default[key] != pytest.approx(more_critic[key], rel=1e-3) for key in critic), [
        (default[key], more_critic[key]) for key in critic]
    assert same(default, more_actor, critic + ("explained_variance",))
    # the second actor pass: its gradient differs; its loss too, by little (unwhitened, it is about -mean(A) times
    # ratios that one update moved by about 1e-3)
    assert default["grad_norm"] != pytest.approx(more_actor["grad_norm"], rel=1e-3)
    assert default["policy_loss"] != more_actor["policy_loss"]
