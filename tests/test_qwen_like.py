"""A Qwen-like tokenizer and model (tests/fixtures/qwen_like.py, checkpoint in tests/fixtures/qwen_like/): rollouts
stop at the chat template's turn end (a Base checkpoint's generation_config lists <|endoftext|> alone), a tokenizer
without a pad token pads with its EOS and the embeddings keep their rows, and every trainer runs on it."""
import importlib
import sys

import pytest

import common
import infra.engine
import infra.tiny
from helpers import QWEN_LIKE_RUN, QWEN_LIKE_TRAINERS, check_qwen_like_run, check_turn_end_paths

LLAMA3_TEMPLATE = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
                   "'<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}{%- endfor %}{%- if "
                   "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def qwen_like(qwen_like_path):
    return common.load_model(qwen_like_path, "float32", "cpu")


def test_fixture_has_qwen_base_layout(qwen_like, qwen_like_path):
    from transformers import GenerationConfig
    model, tokenizer = qwen_like
    ids = dict(zip(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                   tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                    "</think>"])))
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == ids["<|endoftext|>"]
    assert list(ids.values()) == list(range(len(tokenizer) - 5, len(tokenizer)))  # after the BPE vocabulary
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    assert special == {ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]}  # <think> tags are not
    assert tokenizer.decode(tokenizer("12+34 \\boxed{46}")["input_ids"]) == "12+34 \\boxed{46}"  # byte-level
    assert tokenizer.convert_ids_to_tokens(tokenizer(" step")["input_ids"]) == ["Ġstep"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    assert model.get_input_embeddings().num_embeddings == 384 > len(tokenizer)  # rows padded, as Qwen's 151,936
    assert GenerationConfig.from_pretrained(qwen_like_path).eos_token_id == ids["<|endoftext|>"]  # no turn end


def test_turn_end_is_read_off_the_chat_template(qwen_like, tiny):
    from tokenizers import AddedToken
    model, tokenizer = qwen_like
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert infra.engine.turn_end_id(tokenizer) == im_end
    assert infra.engine.stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, im_end]
    llama = type(tokenizer).from_pretrained(model.name_or_path)
    llama.add_special_tokens({"bos_token": "<|begin_of_text|>", "additional_special_tokens": [
        AddedToken(t, normalized=False) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")]})
    llama.chat_template = LLAMA3_TEMPLATE
    assert infra.engine.turn_end_id(llama) == llama.convert_tokens_to_ids("<|eot_id|>")
    llama.chat_template = "{%- for message in messages %}{{- message['content'] + '\\n' }}{%- endfor %}"
    assert infra.engine.turn_end_id(llama) is None  # no special token after the content
    llama.chat_template = "{{- raise_exception('system messages only') }}"
    assert infra.engine.turn_end_id(llama) is None
    tiny_model, tiny_tokenizer = tiny
    assert infra.engine.turn_end_id(tiny_tokenizer) is None  # no chat template: EOS alone
    assert infra.engine.stop_token_ids(tiny_model, tiny_tokenizer) == [tiny_tokenizer.eos_token_id]


def test_no_pad_token_pads_with_eos_and_keeps_the_embedding_rows(llama_like_path):
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(llama_like_path).pad_token is None  # Llama's layout
    model, tokenizer = common.load_model(llama_like_path, "float32", "cpu")
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == model.config.pad_token_id
    assert len(tokenizer) == model.get_input_embeddings().num_embeddings == model.config.vocab_size == 344


def test_every_engine_path_scores_the_turn_and_stops_at_its_end(qwen_like):
    """Rollout, evaluation, Monte Carlo values and SPO-tree segments through HF generate (helpers)."""
    model, tokenizer = qwen_like
    rows = infra.tiny.builtin_rows("test", 24, 0, 2)
    assert check_turn_end_paths(infra.engine.HFGenerator(model, tokenizer), tokenizer, rows) >= 12  # 23 when built


@pytest.mark.parametrize("trainer", list(QWEN_LIKE_TRAINERS))
def test_every_trainer_runs_two_steps_on_the_qwen_like_model(trainer, qwen_like_path, tmp_path, monkeypatch,
                                                            capsys):
    module = importlib.import_module(trainer)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", "--model", qwen_like_path, *QWEN_LIKE_RUN,
                                      *QWEN_LIKE_TRAINERS[trainer], "--output-dir", str(tmp_path), "--run-name", "run"])
    module.main()
    check_qwen_like_run(tmp_path / "run", capsys.readouterr().out)
