"""The horizon task (infra/horizon.py, docs/horizon.md): its knobs, its rule that a response scores by its K decisions
alone, the model's habit, the preset that every trainer takes on it, and the in-place KV cache that makes its long
rollouts fast."""
import random
import re

import pytest
import torch

import common
import infra.cli
import infra.data
import infra.engine
import infra.horizon as horizon
import infra.hub
import infra.tiny
import grpo
import ppo
import sppo
import spo
from infra import UserError


def test_the_spec_names_its_knobs_and_refuses_bad_ones_in_one_line():
    assert horizon.parse_spec("horizon-k1-h256") == (1, 256, False)
    assert horizon.parse_spec("horizon-k3-h1024-late") == (3, 1024, True)
    assert horizon.parse_spec("horizon-k4-h0") == (4, 0, False)
    assert horizon.spec_name(3, 1024, True) == "horizon-k3-h1024-late" and horizon.spec_name(1, 0) == "horizon-k1-h0"
    for bad in ("horizon-k0-h64", "horizon-k5-h64", "horizon-k1-h60", "horizon-k1", "horizon-k1-h64-early",
                "horizon-k1-h8000"):
        with pytest.raises(UserError, match=r"builtin:horizon-k<K>-h<H>.*multiple of 8"):
            horizon.parse_spec(bad)
    with pytest.raises(UserError, match="--dataset builtin:horizon-k9-h8"):
        infra.data.builtin_digits("builtin:horizon-k9-h8")


def test_rows_show_the_knobs_and_hold_out_whole_letter_sets():
    rows = horizon.horizon_rows("train", 300, 0, "horizon-k2-h64-late")
    row = rows[0]
    assert re.fullmatch(r"[A-I][J-R] last <8>", row["question"]), row["question"]
    assert row["blocks"] == 8 and row["late"] and len(row["answer"]) == 2 and "0" not in row["answer"]
    first, second = row["values"]  # each letter's value is its place in its alphabet (A = 1, J = 1)
    assert row["question"][:2] == horizon.CLASSES[0][first - 1] + horizon.CLASSES[1][second - 1]
    assert row["answer"] == f"{first}{second}"
    test = horizon.horizon_rows("test", 300, 0, "horizon-k2-h64-late")
    letters = lambda rows: {r["question"][:2] for r in rows}  # noqa: E731
    assert not letters(rows) & letters(test) and len(letters(test)) >= 5
    assert len(letters(horizon.horizon_rows("test", 300, 0, "horizon-k1-h0"))) == 9  # K = 1: no split, all 9
    assert horizon.horizon_rows("train", 5, 0, "horizon-k2-h64-late") == rows[:5]  # the same seed, the same rows
    loaded = infra.data.load_rows("builtin:horizon-k1-h0", "test", n_builtin=4)
    assert loaded[0]["answer_format"] == "boxed" and loaded[0]["question"].endswith(" first <0>")


@pytest.mark.parametrize("late", [False, True])
def test_a_response_scores_by_its_k_decisions_alone(late):
    """K = 3 decisions and H = 64 irrelevant tokens: any stretch (other letters, a broken counter, none at all) with
    the right decisions scores 1; one wrong decision scores 0 whatever the stretch."""
    rng = random.Random(0)
    row = dict(horizon.horizon_rows("train", 1, 0, f"horizon-k3-h64{'-late' * late}")[0], answer_format="boxed")
    for trial in range(20):
        right = [trial % 4 != i for i in range(3)]  # trials 0-2: decision i wrong; 3: all right
        text = horizon.solution(row, rng, right)
        assert common.score(text, row) == float(all(right)), text
        broken = re.sub(r"<\d+>", "<99>", text)  # a clock gone wrong: the decisions still decide
        assert common.score(broken, row) == float(all(right))
        assert horizon.parse_response(text, row) == (right, True)
        assert horizon.parse_response(broken, row)[1] is False
    assert text.startswith(" <8>") == late and text.endswith("}") == late
    tokens = horizon.horizon_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert len(tokens) == 64 + 12  # H, then `\\boxed{ddd}` and its padding (first) or its spaces (last)


def test_the_stretch_counts_down_one_clock_token_a_block_and_its_random_letters_are_found():
    rng = random.Random(1)
    tokenizer = horizon.horizon_tokenizer()
    row = horizon.horizon_rows("train", 12, 0, "horizon-k1-h96")[0]
    text = horizon.solution(row, rng, [True])
    blocks = " ".join(f"<{n}>[u-z]{{6}}" for n in range(12, 0, -1))
    assert re.fullmatch(r"\\boxed\{\d\}    " + blocks, text), text  # padded to K = 4's width
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert len(ids) == 96 + 12 + 1 and pieces[13] == "<12>" and pieces[-2] in horizon.STRETCH_LETTERS
    positions = horizon.stretch_positions(pieces)
    assert len(positions) == 72 and all(pieces[i] in horizon.STRETCH_LETTERS for i in positions)
    keys = horizon.key_positions(pieces, 1)  # the build's weighted tokens: the decision, every clock, the end
    assert [pieces[i] for i in keys] == [text[7], *(f"<{n}>" for n in range(12, 0, -1)), "<|endoftext|>"]
    for k in (1, 2, 4):  # the first block sits as far from the question at every K
        row = horizon.horizon_rows("train", 1, 0, f"horizon-k{k}-h16")[0]
        assert horizon.solution(row, rng).index("<2>") == len("\\boxed{}") + horizon.MAX_DECISIONS + 1
    late = horizon.horizon_rows("train", 1, 0, "horizon-k2-h16-late")[0]
    ids = tokenizer(horizon.solution(late, rng), add_special_tokens=False)["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    assert [pieces[i] for i in horizon.key_positions(pieces, 2)][-1:] == [" "]  # the space before \\boxed{}


@pytest.mark.parametrize("k", [1, 3])
def test_the_habit_makes_a_response_right_about_one_time_in_five(k):
    rng = random.Random(2)
    rows = horizon.horizon_rows("train", 2000, 0, f"horizon-k{k}-h0")
    texts = [horizon.solution(row, rng) for row in rows]
    accuracy = sum(common.score(text, dict(row, answer_format="boxed")) for text, row in zip(texts, rows)) / len(rows)
    assert abs(accuracy - 0.2) < 0.035, accuracy
    for text, row in zip(texts[:200], rows):  # a wrong decision is the right digit plus one, 9 -> 1
        written = re.search(r"\{(\d+)\}", text)[1]
        assert all(w == g or int(w) == int(g) % 9 + 1 for w, g in zip(written, row["answer"]))


def test_the_preset_is_the_demos_controlled_comparison_with_a_quarter_of_its_rollout():
    argv = ["--preset", "horizon", "--dataset", "builtin:horizon-k1-h1024"]
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, argv=argv)
    shared = {**infra.cli.CONTROLLED_TINY_PRESET, **horizon.RUN_PRESET}
    for name in ("lr", "temperature", "mini_batches", "aggregation", "steps", "eval_temperature"):
        assert getattr(args, name) == shared[name], name
    assert (args.model, args.prompts_per_step, args.samples_per_prompt) == ("horizon", 16, 8)
    assert args.max_response_tokens == args.eval_max_tokens == 1024 + 64
    sppo_args = infra.cli.parse_args(sppo.Args, sppo.TINY_PRESET, argv=argv)
    assert sppo_args.prompts_per_step * sppo_args.samples_per_prompt == 16 * 8  # SPPO: the same samples, 1 a prompt
    ppo_args = infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, argv=["--model", "horizon"])
    assert ppo_args.critic_warmup == ppo.TINY_PRESET["critic_warmup"] and ppo_args.max_response_tokens == 256 + 64
    spo_args = infra.cli.parse_args(spo.Args, spo.TINY_PRESET, argv=argv)
    assert spo_args.cut_interval == 1024 // 8  # about 5 cutpoints a response at every H
    assert infra.cli.parse_args(spo.Args, spo.TINY_PRESET, argv=["--preset", "horizon", "--dataset",
                                                                  "builtin:horizon-k1-h0"]).cut_interval == 5
    assert infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, argv=argv + ["--steps", "3"]).steps == 3  # flags win


def test_the_tiny_model_and_the_horizon_model_are_told_apart():
    from infra.tiny import builtin_model
    assert builtin_model("tiny") == "tiny" and builtin_model("horizon") == "horizon"
    assert builtin_model(infra.hub.TINY_SHIPPED) == "tiny"
    assert builtin_model(horizon.SHIPPED) == "horizon"
    assert builtin_model("Qwen/Qwen3-4B-Base") is None


def test_in_place_kv_cache_samples_exactly_what_concatenation_does(monkeypatch):
    """The engine's GrowingLayer (written in place, buffers doubled, rows leaving as they stop) against transformers'
    DynamicLayer: the same tokens and log-probs, bit for bit, on responses that stop at different lengths."""
    model, tokenizer = common.load_model("tiny", "float32", "cpu")
    rows = infra.data.load_rows("builtin:3", "test", n_builtin=8)
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    generator = infra.engine.HFGenerator(model, tokenizer)
    results = []
    for grow in (True, False):
        if not grow:
            monkeypatch.setattr(infra.engine, "grow_in_place", lambda cache: None)
        torch.manual_seed(0)
        completions = generator.generate(prompts, 4, 200, 1.0, 1.0)
        results.append([(c.token_ids, c.logprobs) for c in completions])
    assert results[0] == results[1]
    assert len({len(tokens) for tokens, _ in results[0]}) > 3  # rows stopped at different steps


def test_the_shipped_model_starts_between_5_and_40_percent_with_a_random_stretch():
    """models/horizon at two cheap settings (64 samples each): the sweep's step-0 condition, and a stretch that is
    written well and at random (the full table at every setting: `python -m infra.horizon --report models/horizon`)."""
    for line in horizon.report(horizon.SHIPPED, [(1, 0, False), (1, 64, True)], problems=16, samples=4):
        assert 0.05 <= line["accuracy"] <= 0.40, line
        assert line["well_formed"] >= 0.9, line
    assert line["stretch_entropy"] > 1.5, line  # ln 6 = 1.79 nats: uniform letters
