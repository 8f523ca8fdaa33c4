"""Tests for spo.py: cutpoints, chain advantages, the probability mask and its whitening, tree values and edge
advantages, the Monte Carlo estimator, the tree sampler and the chain and tree rollouts on scripted rollout engines,
and 2-step runs."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import infra.cli
import infra.run  # noqa: E402
import spo  # noqa: E402

# 14 tokens; p < 0.9 at positions 1, 3, 4, 6, 7, 9, 10, 11, 12, 13 (0.9 itself is not low).
PROBS = torch.tensor([0.95, 0.5, 0.99, 0.3, 0.8, 0.9, 0.2, 0.6, 0.99, 0.1, 0.5, 0.4, 0.7, 0.85])


def released_cutpoints(probs, interval):
    """The released line, verbatim in numpy (math_episode_generator_with_mc_advantages.py)."""
    cutpoints = np.where(np.asarray(probs) < 0.9)[0]
    cutpoints = cutpoints - 1
    return cutpoints[::interval].tolist()


def test_cutpoints_methods_md_example():
    # METHODS.md: low-probability tokens [0, 2, 4, 5, 7, 8] -> interval 1: [-1, 1, 3, 4, 6, 7]; 2: [-1, 3, 6];
    # 5: [-1, 7]
    probs = torch.tensor([0.3, 0.95, 0.5, 0.99, 0.2, 0.1, 0.97, 0.4, 0.6])
    assert spo.cutpoints(probs, 0.9, 1) == [-1, 1, 3, 4, 6, 7]
    assert spo.cutpoints(probs, 0.9, 2) == [-1, 3, 6]
    assert spo.cutpoints(probs, 0.9, 5) == [-1, 7]


def test_cutpoints_interval_1_2_and_5():
    # before the 1st, (1 + interval)-th, ... low-probability token: positions 1, 3, 4, 6, 7, 9, 10, 11, 12, 13
    assert spo.cutpoints(PROBS, 0.9, 1) == [0, 2, 3, 5, 6, 8, 9, 10, 11, 12]
    assert spo.cutpoints(PROBS, 0.9, 2) == [0, 3, 6, 9, 11]  # the 1st, 3rd, 5th, 7th, 9th
    assert spo.cutpoints(PROBS, 0.9, 5) == [0, 8]  # the 1st and 6th
    rng = np.random.default_rng(0)
    for _ in range(200):  # the released line on random responses
        probs = rng.choice([0.05, 0.5, 0.89, 0.9, 0.95, 1.0], size=rng.integers(0, 30))
        for interval in (1, 2, 3, 5, 7):
            assert spo.cutpoints(torch.tensor(probs), 0.9, interval) == released_cutpoints(probs, interval)


def test_cutpoints_edge_cases():
    assert spo.cutpoints(torch.tensor([0.5, 0.95, 0.5]), 0.9, 1) == [-1, 1]  # a low first token: the prompt state
    assert spo.cutpoints(torch.tensor([0.95, 0.99]), 0.9, 1) == []  # a sure response has no cutpoint
    assert spo.cutpoints(torch.tensor([0.95, 0.5, 0.5, 0.5]), 0.9, 5) == [0]  # fewer low tokens than the interval: one
    assert spo.cutpoints(torch.tensor([]), 0.9, 1) == []  # empty response


def test_chain_advantages_hand_computed():
    # Row 0: R = 1, cuts [-1, 2, 5] with V = [0.5, 0.25, 0.75], 8 valid tokens of 9 columns:
    #   tokens 0..2: 0.25 - 0.5 = -0.25; tokens 3..5: 0.75 - 0.25 = 0.5; tokens 6..7: 1 - 0.75 = 0.25; pad 0.
    # Row 1: no cutpoint -> all 0. Row 2: R = 0, one cut at 0 with V = 1 (the first token was sure, p >= 0.9):
    #   token 0 (up to the first cut): 0; tokens 1..3: 0 - 1 = -1.
    # Row 3: R = 1, the only cut is the prompt state, V(-1) = 0.25: every token gets 1 - 0.25.
    mask = torch.tensor([[True] * 8 + [False], [True] * 9, [True] * 4 + [False] * 5, [True] * 3 + [False] * 6])
    advantages = spo.chain_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), [[-1, 2, 5], [], [0], [-1]],
                                      [[0.5, 0.25, 0.75], [], [1.0], [0.25]], mask)
    expected = torch.tensor([[-0.25] * 3 + [0.5] * 3 + [0.25] * 2 + [0.0],
                             [0.0] * 9,
                             [0.0] + [-1.0] * 3 + [0.0] * 5,
                             [0.75] * 3 + [0.0] * 6])
    assert torch.allclose(advantages, expected)
    # the segment advantages telescope: one token from each segment adds up to R - V(-1)
    assert advantages[0, [0, 3, 6]].sum().item() == pytest.approx(1.0 - 0.5)


def test_every_low_probability_token_gets_a_segment_advantage():
    # The released rule leaves no low-probability token without a border on each side: every one lies after the
    # first cut (so its advantage is a value difference, never a structural 0 that whitening would shift to -mu/sigma).
    rng = np.random.default_rng(1)
    for _ in range(200):
        probs = torch.tensor(rng.choice([0.3, 0.7, 0.95, 0.99], size=rng.integers(1, 25)))
        for interval in (1, 5):
            cuts = spo.cutpoints(probs, 0.9, interval)
            low = (probs < 0.9).nonzero().flatten().tolist()
            assert bool(low) == bool(cuts)
            assert all(j > cuts[0] for j in low)
            values = [[float(k + 1) for k in range(len(cuts))]]  # distinct values: every difference is non-zero
            mask = torch.ones(1, len(probs), dtype=torch.bool)
            advantages = spo.chain_advantages(torch.tensor([100.0]), [cuts], values, mask)
            assert all(advantages[0, j] != 0 for j in low)


def test_probability_mask_and_whitening_over_masked_tokens():
    probs = torch.tensor([[0.95, 0.5, 0.89, 0.9, 0.2], [0.1, 0.99, 0.3, 0.3, 0.3]])
    mask = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
    low = spo.probability_mask(probs.log(), mask, 0.9)
    # p < 0.9 and valid: 0.5, 0.89 in row 0 (0.9 is not low; 0.2 is padding); 0.1, 0.3 in row 1.
    assert low.tolist() == [[False, True, True, False, False], [True, False, True, False, False]]
    advantages = torch.tensor([[100.0, 1.0, 3.0, 100.0, 100.0], [1.0, -50.0, 3.0, 7.0, 7.0]])
    whitened = spo.masked_whiten(advantages, low)
    # statistics of the masked values [1, 3, 1, 3] only: mean 2, unbiased std sqrt(4/3); 0 outside the mask.
    scale = math.sqrt(4 / 3)
    expected = torch.tensor([[0.0, -1 / scale, 1 / scale, 0.0, 0.0], [-1 / scale, 0.0, 1 / scale, 0.0, 0.0]])
    assert torch.allclose(whitened, expected, atol=1e-6)


def test_tree_values_and_edge_advantages_two_levels():
    # Two prompts. Tree of root 0: children 1, 2, 3 (3 stopped at level 1, reward 1);
    # 1 -> leaves 5 (1), 6 (0); 2 -> leaves 7 (0), 8 (0). Tree of root 4: one leaf 9 (reward 1).
    # V(1) = 0.5, V(2) = 0, V(3) = 1, V(0) = (0.5 + 0 + 1) / 3 = 0.5; V(4) = V(9) = 1.
    parents = [-1, 0, 0, 0, -1, 1, 1, 2, 2, 4]
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    values = spo.tree_values(parents, rewards)
    assert values == pytest.approx([0.5, 0.5, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    # edges: 1: 0.5 - 0.5 = 0 (dropped), 2: -0.5, 3: +0.5, 5: +0.5, 6: -0.5, 7 and 8: 0, 9: 0; roots 0.
    assert spo.edge_advantages(parents, values) == pytest.approx([0, 0, -0.5, 0.5, 0, 0.5, -0.5, 0, 0, 0])


def test_all_rewards_equal_give_no_nan():
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    for reward in (0.0, 1.0):
        rewards = torch.full((2,), reward)
        advantages = spo.chain_advantages(rewards, [[1, 3], []], [[reward, reward], []], mask)
        assert torch.equal(advantages, torch.zeros(2, 6))
        for loss_mask in (mask, torch.zeros_like(mask), torch.eye(2, 6, dtype=torch.bool)):  # many, none, one each
            whitened = spo.masked_whiten(advantages, loss_mask)
            logprobs = torch.full((2, 6), -0.3)
            loss, clip_fraction = spo.policy_loss(logprobs, logprobs, whitened, loss_mask)
            assert torch.equal(whitened, torch.zeros(2, 6)) and torch.isfinite(loss) and torch.isfinite(clip_fraction)
        values = spo.tree_values([-1, 0, 0, 1, 1], [0.0, 0.0, reward, reward, reward])
        assert spo.edge_advantages([-1, 0, 0, 1, 1], values) == [0.0] * 5
    # one masked token only: no std to divide by, the value is kept (never NaN)
    single = spo.masked_whiten(torch.tensor([[0.7, 5.0]]), torch.tensor([[True, False]]))
    assert torch.equal(single, torch.tensor([[0.7, 0.0]]))


def test_kl_loss_is_a_per_sequence_sum_over_the_loss_tokens():
    # Released (ppo_trainer.py, klLoss + refKl0.0001): beta * mean over sequences of sum_t k3_t * mask_t.
    # Row 0: ref - logp = [0, ln 2, 30 (clamped to 10), 1] with mask [1, 1, 1, 0]; row 1: [ln 0.5] with mask [1].
    # k3(d) = e^d - d - 1: k3(0) = 0, k3(ln 2) = 1 - ln 2, k3(10) = e^10 - 11; row 1: k3(-ln 2) = ln 2 - 0.5.
    logprobs = torch.zeros(2, 4)
    reference = torch.tensor([[0.0, math.log(2), 30.0, 1.0], [-math.log(2), 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    expected = ((1 - math.log(2)) + (math.exp(10) - 11) + (math.log(2) - 0.5)) / 2
    assert spo.kl_loss(logprobs, reference, mask).item() == pytest.approx(expected, rel=1e-6)
    # micro-batches given the mini-batch's sequence count add up to the whole
    parts = sum(spo.kl_loss(logprobs[[r]], reference[[r]], mask[[r]], num_sequences=2).item() for r in (0, 1))
    assert parts == pytest.approx(expected, rel=1e-6)
    # a token-mean would be 4 (loss tokens of the batch) / 2 (sequences) = 2 times smaller here
    assert spo.kl_loss(logprobs, reference, mask).item() == pytest.approx(2 * spo.aggregate(
        spo.k3_kl(logprobs, reference), mask, "token-mean").item(), rel=1e-6)


def test_lr_factor_is_deepspeeds_warmup_decay():
    # DeepSpeed WarmupDecayLR as the released configs fill it: W = ceil(0.03 * total) (at least 2), log warm-up
    # log(u + 1) / log(W), then (total - u) / (total - W). total 1000 -> W = 30.
    assert spo.lr_factor(0, 1000) == 0.0
    assert spo.lr_factor(1, 1000) == pytest.approx(math.log(2) / math.log(30))
    assert spo.lr_factor(29, 1000) == pytest.approx(1.0)
    assert spo.lr_factor(30, 1000) == pytest.approx(1.0)
    assert spo.lr_factor(515, 1000) == pytest.approx(485 / 970)
    assert spo.lr_factor(999, 1000) == pytest.approx(1 / 970)
    assert spo.lr_factor(10, 100) == pytest.approx(90 / 97)  # W = ceil(3.0) = 3
    assert spo.lr_factor(1, 10) == pytest.approx(1.0)  # W = max(2, ceil(0.3)) = 2: log 2 / log 2
    assert spo.lr_factor(0, 1000, schedule="constant") == spo.lr_factor(999, 1000, schedule="constant") == 1.0


def test_cap_edges_keeps_at_most_cap_per_prompt():
    torch.manual_seed(0)
    edges = list(range(100))
    prompts = [0] * 40 + [1] * 10 + [2] * 50
    kept = spo.cap_edges(edges, prompts, cap=32)
    counts = [sum(prompts[e] == p for e in kept) for p in (0, 1, 2)]
    assert counts == [32, 10, 32] and kept == sorted(kept) and set(kept) >= set(range(40, 50))
    assert spo.cap_edges(edges, prompts, cap=32) != kept  # a fresh uniform draw each call
    assert spo.cap_edges(edges, prompts, cap=100) == edges


def test_published_defaults():
    args = infra.cli.parse_args(spo.Args, spo.TINY_PRESET, ["--model", "Qwen3-4B-Base"])
    assert (args.cut_interval, args.mc_samples, args.prob_threshold, args.kl_coef) == (5, 9, 0.9, 1e-4)
    assert (args.mini_batches, args.epochs, args.weight_decay, args.lr_warmup) == (8, 2, 0.0, 0.03)
    assert (args.lr_schedule, args.adam_betas, args.temperature) == ("warmup-decay", (0.9, 0.999), 0.6)
    assert (args.tree_prompts, args.tree_edges_per_prompt, args.tree_branching, args.tree_depth) == (16, 32, 6, 3)
    assert spo.MAX_LOG_RATIO == 10.0


class CharTokenizer:
    """Token id = character code; 0 is the EOS and is dropped when decoding."""
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def encode(text):
    return [ord(c) for c in text]


class ScriptedGenerator:
    """Sample i of every request continues with script[i] (+ EOS), cut at max_tokens like a real engine."""
    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        self.calls.append((prompts, n, max_tokens))
        out = []
        for index, _ in enumerate(prompts):
            for i in range(n):
                tokens = encode(self.script[i]) + ([0] if not self.script[i].endswith("*") else [])
                finished = len(tokens) <= max_tokens and tokens[-1] == 0
                tokens = tokens[:max_tokens]
                out.append(common.Completion(index, tokens, CharTokenizer().decode(tokens), [0.0] * len(tokens),
                                             "stop" if finished else "length"))
        return out


def test_monte_carlo_values_dedupes_and_scores():
    # SPO's cutpoint values come from common.monte_carlo_values. K = 3 continuations: "\boxed{7}" + EOS (10 tokens),
    # "\boxed{8}" + EOS, and an endless "z..." ("*": no EOS).
    generator = ScriptedGenerator(["\\boxed{7}", "\\boxed{8}", "z" * 40 + "*"])
    prompt = encode("Q")
    states = [(prompt, encode("ab")), (prompt, encode("ab")), (prompt, encode("abcdefgh"))]
    values, tokens = common.monte_carlo_values(generator, CharTokenizer(), states, [{"answer": "7"}] * 3, 3, 16, 0.6,
                                               1.0)
    # one engine call, one request per unique prefix (2), n = K, the largest budget 16 - 2 = 14
    assert len(generator.calls) == 1
    assert generator.calls[0][0] == [prompt + encode("ab"), prompt + encode("abcdefgh")]
    assert generator.calls[0][1:] == (3, 14)
    # prefix "ab" (budget 14): 7 correct, 8 wrong, z truncated -> 1/3.
    # prefix "abcdefgh" (budget 8): the 10-token answers do not fit -> 0.
    assert values.tolist() == pytest.approx([1 / 3, 1 / 3, 0.0])
    # every generated token counts: per prefix 10 + 10 + 14 (the endless one stops at the call's budget 14)
    assert tokens == 2 * 34


def test_grow_tree_on_a_scripted_engine():
    # branching 2: child 0 answers "\boxed{7}" + EOS (10 tokens), child 1 writes "z"s without stopping.
    # depth 2, segments of 12, max 40: level 1 = [leaf 1 (reward 1), open node 2 ("z" * 12)];
    # level 2 (runs to completion, budget 28) under node 2: leaf 3 = "zzz...\boxed{7}" (reward 1), leaf 4 truncated (0).
    generator = ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"])
    tree = spo.grow_tree(generator, CharTokenizer(), [encode("Q")], [{"answer": "7"}], depth=2, branching=2,
                         segment_tokens=12, max_tokens=40, temperature=0.6, top_p=1.0)
    assert tree.parents == [-1, 0, 0, 2, 2]
    assert tree.rewards == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert tree.prefixes[3] == encode("z" * 12) and tree.prefixes[1] == []
    assert [call[1:] for call in generator.calls] == [(2, 12), (2, 28)]
    assert generator.calls[1][0] == [encode("Q") + encode("z" * 12)]
    values = spo.tree_values(tree.parents, tree.rewards)  # V(2) = 0.5, V(0) = (1 + 0.5) / 2 = 0.75
    assert spo.edge_advantages(tree.parents, values) == pytest.approx([0, 0.25, -0.25, 0.5, -0.5])
    # with max_tokens 12 the open node has no budget left: it is a truncated leaf, the tree stops at level 1
    generator = ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"])
    tree = spo.grow_tree(generator, CharTokenizer(), [encode("Q")], [{"answer": "7"}], 2, 2, 12, 12, 0.6, 1.0)
    assert tree.parents == [-1, 0, 0] and tree.rewards == [0.0, 1.0, 0.0] and len(generator.calls) == 1


TREE_ARGS = SimpleNamespace(tree_depth=2, tree_branching=2, tree_segment_tokens=12, max_response_tokens=40,
                            temperature=0.6, top_p=1.0, tree_edges_per_prompt=32)


def test_tree_rollout_on_a_scripted_engine():
    # Two prompts, branching 2, depth 2 (the engine of test_grow_tree_on_a_scripted_engine). Q (gold 7): roots 0, 1;
    # level 1: 2 = "\boxed{7}" (1), 3 = "z" * 12 (open); R (gold 8): 4 = "\boxed{7}" (0), 5 (open); level 2 under
    # 3: 6 (1), 7 (truncated, 0); under 5: 8 (0), 9 (truncated, 0). V(3) = 1/2, V(0) = 3/4; R's tree is all 0: its
    # edges have advantage 0 and are dropped.
    prompts, rows = [encode("Q"), encode("R")], [{"answer": "7"}, {"answer": "8"}]
    generator = ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"])
    sample_prompts, segments, rewards, advantages, metrics = spo.tree_rollout(generator, CharTokenizer(), prompts,
                                                                              rows, TREE_ARGS)
    assert [encode("Q") + encode("z" * 12)] == generator.calls[1][0][:1]  # Q's open node 3 grows first
    assert sample_prompts == [encode("Q"), encode("Q"), encode("Q" + "z" * 12), encode("Q" + "z" * 12)]
    assert [s.text for s in segments] == ["\\boxed{7}", "z" * 12, "\\boxed{7}", "z" * 28]  # edges 2, 3, 6, 7
    assert advantages == pytest.approx([0.25, -0.25, 0.5, -0.5])
    assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # the leaves 2, 4, 6, 7, 8, 9
    # 6 leaves of 2 trees; 4 of 8 edges kept; leaf lengths 10, 10, 22, 40, 22, 40; leaves 7 and 9 truncated; the
    # dropped edges 4, 5, 8, 9 hold 10 + 12 + 10 + 28 generated tokens
    assert metrics == pytest.approx(dict(tree_leaves=3.0, edges_kept=0.5, response_length=24.0, truncated=2 / 6,
                                         mc_tokens=60))
    # at most tree_edges_per_prompt kept edges of a tree
    capped = spo.tree_rollout(ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"]), CharTokenizer(), prompts, rows,
                              SimpleNamespace(**{**vars(TREE_ARGS), "tree_edges_per_prompt": 1}))
    assert len(capped[3]) == 1 and capped[3][0] in (0.25, -0.25, 0.5, -0.5)
    # no edge with a nonzero advantage: every edge is kept, with advantage 0
    sample_prompts, _, rewards, advantages, metrics = spo.tree_rollout(
        ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"]), CharTokenizer(), [encode("R")], rows[1:], TREE_ARGS)
    assert advantages == [0.0] * 4 and metrics["edges_kept"] == 1.0 and rewards.tolist() == [0.0] * 3
    assert sample_prompts == [encode("R"), encode("R"), encode("R" + "z" * 12), encode("R" + "z" * 12)]


def test_chain_rollout_scores_each_sample_against_its_own_prompt():
    # 2 prompts x G = 2: sample 0 of each request answers "\boxed{7}", sample 1 never stops (truncated: 0)
    generator = ScriptedGenerator(["\\boxed{7}", "z" * 100 + "*"])
    args = SimpleNamespace(samples_per_prompt=2, max_response_tokens=40, temperature=0.6, top_p=1.0)
    sample_prompts, completions, rewards = spo.chain_rollout(generator, [encode("P"), encode("Q")],
                                                             [{"answer": "7"}, {"answer": "8"}], args)
    assert sample_prompts == [encode("P"), encode("P"), encode("Q"), encode("Q")]
    assert [c.finish_reason for c in completions] == ["stop", "length", "stop", "length"]
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert generator.calls == [([encode("P"), encode("Q")], 2, 40)]


class EchoGenerator:
    """Every continuation of a state answers "\\boxed{c}", c the state's first character (its one-character
    prompt), or "\\boxed{0}" when the state holds an "x"; + EOS."""
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        self.calls.append(prompts)
        out = []
        for index, state in enumerate(prompts):
            answer = "0" if ord("x") in state else chr(state[0])
            tokens = encode("\\boxed{" + answer + "}") + [0]
            out.extend(common.Completion(index, tokens, CharTokenizer().decode(tokens), [0.0] * len(tokens), "stop")
                       for _ in range(n))
        return out


def test_chain_mc_advantages_value_each_cut_from_its_own_prompt_and_prefix():
    # Prompts "7" (gold 7) and "8" (gold 8); samples 0 and 1 answer "7", sample 2 answers "8". A continuation is right
    # (V = 1) from its own prompt unless its prefix holds an "x" (V = 0). Interval 1, p < 0.9 is low:
    # sample 0 "axbc", p [.5, .95, .5, .95], R = 1: cuts -1, 1 with V 1, 0: tokens 0-1 get 0 - 1, tokens 2-3 1 - 0;
    # sample 1 "ab", p [.95, .5], R = 0: cut 0 with V 1: token 0 gets 0 (before the first cut), token 1 0 - 1;
    # sample 2 "xb", p [.5, .5], R = 1: cuts -1, 0 with V 1, 0: token 0 gets 0 - 1, token 1 1 - 0.
    prompts, rows = [encode("7"), encode("8")], [{"answer": "7"}, {"answer": "8"}]
    responses = [(0, "axbc"), (0, "ab"), (1, "xb")]
    completions = [common.Completion(p, encode(text), text, [0.0] * len(text), "stop") for p, text in responses]
    probs = torch.tensor([[0.5, 0.95, 0.5, 0.95], [0.95, 0.5, 1.0, 1.0], [0.5, 0.5, 1.0, 1.0]])
    mask = torch.arange(4)[None, :] < torch.tensor([4, 2, 2])[:, None]
    args = SimpleNamespace(prob_threshold=0.9, cut_interval=1, mc_samples=2, max_response_tokens=40,
                           temperature=0.6, top_p=1.0)
    generator = EchoGenerator()
    advantages, metrics = spo.chain_mc_advantages(generator, CharTokenizer(), [prompts[p] for p, _ in responses],
                                                  completions, rows, torch.tensor([1.0, 0.0, 1.0]), probs.log(), mask,
                                                  args)
    assert advantages.tolist() == [[-1.0, -1.0, 1.0, 1.0], [0.0, -1.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0]]
    # one engine call, one request per distinct state: ("7", ""), ("7", "ax"), ("7", "a"), ("8", ""), ("8", "x")
    assert [len(call) for call in generator.calls] == [5]
    assert metrics["mc_tokens"] == 5 * 2 * 10 and metrics["cutpoints_per_response"] == pytest.approx(5 / 3)


def run_two_steps(tmp_path, name, *flags):
    command = [sys.executable, os.path.join(ROOT, "spo.py"), "--steps", "2", "--prompts-per-step", "4",
               "--eval-problems", "16", "--run-name", name, "--output-dir", str(tmp_path), *flags]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1] and "eval/accuracy" in records[0] and "eval/accuracy" in records[1]
    for record in records:
        assert all(math.isfinite(v) for v in record.values()), record
    return records


def test_chain_two_steps_end_to_end(tmp_path):
    for record in run_two_steps(tmp_path, "e2e_spo_chain", "--micro-batch-size", "16"):
        # low-probability tokens are some of the policy's tokens (4 prompts x 8 samples, at most 96 tokens each)
        assert 32 <= record["policy_tokens"] <= 32 * 96
        assert record["low_probability_tokens"] <= record["policy_tokens"] / 32
        # Monte Carlo tokens: K = 4 continuations of at most 96 tokens per cutpoint, none without cutpoints
        assert record["mc_tokens"] <= record["cutpoints_per_response"] * 32 * 4 * 96
        assert (record["mc_tokens"] > 0) == (record["cutpoints_per_response"] > 0)
        # interval 5 (published, and the tiny preset's): one cut per 5 low-probability tokens, rounded up
        low = record["low_probability_tokens"]
        assert low / 5 <= record["cutpoints_per_response"] <= low
        assert record["cutpoints_per_response"] > 0 or low == 0


def test_tree_two_steps_end_to_end(tmp_path):
    for record in run_two_steps(tmp_path, "e2e_spo_tree", "--mode", "tree", "--tree-branching", "2",
                                "--tree-prompts", "4"):
        assert 2 <= record["tree_leaves"] <= 8  # branching 2, depth 3
        assert 0 < record["edges_kept"] <= 1
        # the leaves' mean reward over 4 prompts x tree_leaves leaves
        correct_leaves = record["reward"] * 4 * record["tree_leaves"]
        assert correct_leaves == pytest.approx(round(correct_leaves))
