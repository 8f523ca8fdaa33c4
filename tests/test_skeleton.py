"""The shared skeleton's helpers are copies: every top-level function that two or more method files define is
the same source text in each (docstring and comments included), except the differences listed in ALLOWED,
which the tests also check to be real (so the list cannot go stale)."""
import ast
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import grpo  # noqa: E402
import sppo  # noqa: E402

METHOD_FILES = ("ppo", "grpo", "sp3o", "tppo", "sppo", "spo")  # a helper's reference copy: the first file defining it

# (file, function) -> why it differs from the reference copy. "extends": the reference's body lines all appear, in
# order, in this copy (it adds checks); otherwise the copy is a different function under the same name.
ALLOWED = {
    ("sppo", "policy_loss"): "dual-clip PPO for A < 0 (SPPO's released code)",
    ("sppo", "value_loss"): "BCE of the prompt-only critic's logit f(x) against R, per sequence",
    ("tppo", "value_loss"): "BCE of the tracking critic's sigmoid(z_t) against G_t, no value clipping",
    ("grpo", "check_args"): "extends: a group needs 2 samples",
    ("sp3o", "check_args"): "extends: anchor ratios in (0, 1]",
    ("spo", "check_args"): "extends: chain and tree flags; a tree's edges split into any mini-batches",
}
NOT_HELPERS = {"main"}  # the loop itself: kept aligned by `diff`, not identical


def functions(name):
    with open(os.path.join(ROOT, f"{name}.py")) as handle:
        text = handle.read()
    return {node.name: ast.get_source_segment(text, node) for node in ast.parse(text).body
            if isinstance(node, ast.FunctionDef)}


SOURCES = {name: functions(name) for name in METHOD_FILES}
SHARED = sorted({function for name in METHOD_FILES for function in SOURCES[name]
                 if function not in NOT_HELPERS and sum(function in SOURCES[other] for other in METHOD_FILES) > 1})


def copies(function):
    """(reference file, [other files defining `function`])."""
    holders = [name for name in METHOD_FILES if function in SOURCES[name]]
    return holders[0], holders[1:]


def body_lines(source):
    return [line.strip() for line in source.splitlines()[1:] if line.strip()]


def test_the_shared_helpers_are_found():
    # the helpers the six files copy today; a new copied helper joins the checks below by itself
    assert set(SHARED) >= {"aggregate", "policy_loss", "truncated_importance_weights", "k3_kl", "gae", "whiten",
                           "terminal_rewards", "value_loss", "check_args"}


@pytest.mark.parametrize("function", SHARED)
def test_copies_are_identical_except_the_allowed_differences(function):
    reference, others = copies(function)
    for name in others:
        if (name, function) in ALLOWED:
            continue
        assert SOURCES[name][function] == SOURCES[reference][function], f"{name}.{function} differs from {reference}.py"


@pytest.mark.parametrize("name, function", sorted(ALLOWED))
def test_allowed_differences_are_real(name, function):
    reference, _ = copies(function)
    assert reference != name and function in SOURCES[name], f"{name}.{function} is the reference or gone"
    assert SOURCES[name][function] != SOURCES[reference][function], f"{name}.{function} is identical now: unlist it"
    if ALLOWED[(name, function)].startswith("extends"):  # every line of the reference, in order
        remaining = iter(body_lines(SOURCES[name][function]))
        missing = [line for line in body_lines(SOURCES[reference][function]) if line not in remaining]
        assert not missing, f"{name}.{function} drops {missing}"


def test_sppo_policy_loss_without_dual_clip_is_the_shared_one():
    # The allowed difference is the dual clip only: with it off, or on positive advantages, SPPO's loss is the
    # shared PPO-clip loss, for asymmetric clip ranges and mini-batch counts too.
    generator = torch.Generator().manual_seed(0)
    logprobs, old_logprobs = torch.randn(4, 6, generator=generator) * 0.3, torch.randn(4, 6, generator=generator) * 0.3
    advantages = torch.randn(4, 6, generator=generator)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 4, 2, 5])[:, None]
    for aggregation in ("token-mean", "seq-mean", "sum-max-len"):
        counts = dict(num_sequences=8, num_tokens=40, max_length=10)
        for dual_clip, adv in ((0.0, advantages), (3.0, advantages.abs())):
            shared = grpo.policy_loss(logprobs, old_logprobs, adv, mask, 0.1, 0.3, aggregation, **counts)
            own = sppo.policy_loss(logprobs, old_logprobs, adv, mask, 0.1, 0.3, aggregation, dual_clip, **counts)
            assert torch.allclose(own[0], shared[0]) and torch.allclose(own[1], shared[1])
    # and the dual clip does act: A = -1, ratio e^2 = 7.39: PPO-clip gives 7.39, capped at -A * 3 = 3
    one = torch.ones(1, 1, dtype=torch.bool)
    assert sppo.policy_loss(torch.full((1, 1), 2.0), torch.zeros(1, 1), -torch.ones(1, 1), one, dual_clip=3.0)[0] == 3.0
