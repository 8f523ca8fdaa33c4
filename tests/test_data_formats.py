"""The papers' data formats: verl's parquet (DAPO-Math-17k: chat-message `prompt`, `reward_model.ground_truth`) and
slime's jsonl (SP3O's launcher: chat-message `prompt`, `label`) load, prompt as given, and are scored the way their
instruction asks: the last `Answer:` line by DAPO's released rule (verl utils/reward_score/math_dapo.py) or the
last \\boxed{} by math-verify. Fixtures: tests/fixtures/verl_format_rows.json (written to parquet here) and
tests/fixtures/slime_format.jsonl. Ends with every trainer for 2 steps on each format."""
import copy
import importlib
import json
import math
import os
import sys

import pytest

import common
import infra.data
import infra.evaluate
import infra.hub
from infra import UserError
from infra.answer_line import ANSWER_LINE_PREFIX, ANSWER_LINE_SUFFIX
from helpers import cache_hub_dataset, with_forks

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
SLIME_JSONL = os.path.join(FIXTURES, "slime_format.jsonl")
DAPO_PROMPT = ANSWER_LINE_PREFIX + "What is $2+3$?" + ANSWER_LINE_SUFFIX  # the first verl row's user message
# A chat template for the tiny tokenizer (it has none): [role]content per message, then [assistant].
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def verl_parquet(tmp_path_factory):
    """The verl-format fixture as a parquet file (pyarrow: list<struct> prompt, struct reward_model/extra_info)."""
    import pyarrow
    import pyarrow.parquet
    with open(os.path.join(FIXTURES, "verl_format_rows.json")) as handle:
        rows = json.load(handle)
    path = str(tmp_path_factory.mktemp("verl") / "dapo_like.parquet")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return common.load_tokenizer("tiny")


def char_ids(text):
    """The tiny tokenizer's ids, from its vocabulary (infra.tiny.build_tiny_model): <|pad|> 0, <|endoftext|> 1,
    <|unk|> 2, newline 3, printable ASCII 32..126 -> 4..98, one character per token."""
    return [3 if c == "\n" else 4 + ord(c) - 32 for c in text]


INSTRUCTION_ID = 99  # the tiny tokenizer's one added token: common.INSTRUCTION


# ----------------------------------------------------------------------------------------------
# Loading.
# ----------------------------------------------------------------------------------------------
def test_verl_parquet_loads_chat_prompts_and_nested_ground_truth(verl_parquet):
    rows = infra.data.load_rows(verl_parquet)
    assert [r["answer"] for r in rows] == ["5", "60", "56", "\\frac{1}{2}"]
    assert [r["answer_format"] for r in rows] == ["answer-line", "answer-line", "boxed", "answer-line"]
    assert rows[0]["question"] == [{"content": DAPO_PROMPT, "role": "user"}]  # the messages as given
    assert [m["role"] for m in rows[2]["question"]] == ["system", "user"]
    assert infra.data.describe("dapo_like", rows) == \
        "dapo_like: 4 rows, prompts: chat messages, reward: answer-line (3) + boxed (1)"


def test_slime_jsonl_loads_chat_prompts_and_labels():
    rows = infra.data.load_rows(SLIME_JSONL)
    assert [r["answer"] for r in rows] == ["6", "12", "1234", "6"]  # `label`, a list of one answer included
    assert [r["answer_format"] for r in rows] == ["answer-line", "boxed", "answer-line", "boxed"]
    assert rows[2]["question"][0] == {"role": "system", "content": "Think before you answer."}


def test_answer_format_flag_overrides_auto(verl_parquet):
    assert {r["answer_format"] for r in infra.data.load_rows(verl_parquet, answer_format="boxed")} == {"boxed"}
    assert {r["answer_format"] for r in infra.data.load_rows(SLIME_JSONL, answer_format="answer-line")} == \
        {"answer-line"}
    with pytest.raises(UserError, match="--answer-format 'lines'"):
        infra.data.load_rows(SLIME_JSONL, answer_format="lines")


def test_plain_questions_and_the_answer_line_format(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n"
                    + json.dumps({"prompt": ANSWER_LINE_PREFIX + "What is 2+2?" + ANSWER_LINE_SUFFIX, "answer": 4})
                    + "\n")
    boxed, asked = infra.data.load_rows(str(path))
    assert boxed == {"question": "What is 1+1?", "answer": "2", "answer_format": "boxed"}  # our \boxed{} template
    # a plain string that carries DAPO's instruction is used as given: one user message, no second instruction
    asked_prompt = ANSWER_LINE_PREFIX + "What is 2+2?" + ANSWER_LINE_SUFFIX
    assert asked == {"question": [{"role": "user", "content": asked_prompt}], "answer": "4",
                     "answer_format": "answer-line"}
    # --answer-format answer-line on a bare question asks for the `Answer:` line with DAPO-Math-17k's template
    forced = infra.data.load_rows(str(path), answer_format="answer-line")[0]
    assert forced["question"] == [{"role": "user", "content": ANSWER_LINE_PREFIX + "What is 1+1?" + ANSWER_LINE_SUFFIX}]


def test_dotted_field_paths_and_their_errors(tmp_path, verl_parquet):
    rows = infra.data.load_rows(verl_parquet, question_field="extra_info.question",
                                answer_field="reward_model.ground_truth")
    assert rows[0] == {"question": "What is $2+3$?", "answer": "5", "answer_format": "boxed"}
    rows = infra.data.load_rows(SLIME_JSONL, question_field="prompt.0.content")  # a list index in the path
    # the user message as a plain string: it asks for an `Answer:` line, so it is used as given
    user_message = ANSWER_LINE_PREFIX + "What is 10-4?" + ANSWER_LINE_SUFFIX
    assert rows[0]["question"] == [{"role": "user", "content": user_message}]
    assert rows[0]["answer_format"] == "answer-line" and rows[1]["answer_format"] == "boxed"
    with pytest.raises(UserError) as error:
        infra.data.load_rows(SLIME_JSONL, answer_field="metadata.gold")
    assert str(error.value).startswith(f"{SLIME_JSONL}:1: no answer field ('metadata.gold' (--answer-field))")
    assert "the row has: prompt, label" in str(error.value)
    with pytest.raises(UserError, match=f"{verl_parquet}:row 1: no question field \\('extra_info.problem'"):
        infra.data.load_rows(verl_parquet, question_field="extra_info.problem")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "q"}], "label": "1"}\n'
                   '{"prompt": [{"role": "user"}], "label": "1"}\n'  # 2: a message without content
                   '{"prompt": [{"role": "user", "content": "q"}], "label": ["1", "2"]}\n')  # 3: two answers
    with pytest.raises(UserError, match=f"{bad}:2: the question field 'prompt' is neither a non-empty string nor"):
        infra.data.load_rows(str(bad))
    rows = infra.data.load_rows(str(bad), skip_bad_rows=True)
    assert len(rows) == 1
    bad.write_text('{"prompt": [{"role": "user", "content": "q"}], "label": ["1", "2"]}\n')
    with pytest.raises(UserError, match=f"{bad}:1: 'label' holds 2 answers"):
        infra.data.load_rows(str(bad))


# ----------------------------------------------------------------------------------------------
# Prompts: chat messages go through the chat template as given.
# ----------------------------------------------------------------------------------------------
HUB_ID = "zhuzilin/dapo-math-17k"


def test_a_hub_id_without_the_datasets_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError, installed or not
    for flag in ("--dataset", "--eval-datasets"):
        with pytest.raises(UserError) as error:
            infra.data.load_rows(HUB_ID, flag=flag)
        assert str(error.value) == (f"{flag} '{HUB_ID}': a hub dataset id needs the `datasets` package: pip install "
                                    "datasets (or give a .jsonl/.json/.parquet file)")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty local `datasets` cache and a hub that cannot be reached: a hub id loads from the cache or not at all
    (cache_hub_dataset writes one there as a download leaves it)."""
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "hf-datasets"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(infra.hub, "hub_unreachable", lambda: "ConnectError: no network in this test")
    return str(cache)


def slime_rows():
    """The slime fixture's rows with one label type per column, as a hub copy stores them (an Arrow column)."""
    with open(SLIME_JSONL) as handle:
        rows = [json.loads(line) for line in handle]
    return [dict(row, label=row["label"][0] if isinstance(row["label"], list) else row["label"]) for row in rows]


def test_a_hub_dataset_in_the_local_cache_loads_offline_through_the_same_code(hub_cache, verl_parquet, tmp_path,
                                                                               monkeypatch):
    # slime's layout (SP3O's default, zhuzilin/dapo-math-17k: chat `prompt`, `label`) and verl's (the hub's
    # BytedTsinghua-SIA/DAPO-Math-17k: chat `prompt`, `reward_model.ground_truth`) give the rows their files give
    import datasets
    cache_hub_dataset(hub_cache, HUB_ID, {"train": slime_rows()})
    offline, load_dataset, before = [], datasets.load_dataset, datasets.config.HF_HUB_OFFLINE  # offline mode while
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: offline.append(datasets.config.HF_HUB_OFFLINE)
                        or load_dataset(*a, **k))  # the hub cannot be reached: no retries (5 over 23 s, online mode)
    local = tmp_path / "slime.jsonl"
    local.write_text("".join(json.dumps(row) + "\n" for row in slime_rows()))
    rows = infra.data.load_rows(HUB_ID)
    assert rows == infra.data.load_rows(str(local)) and [r["answer"] for r in rows] == ["6", "12", "1234", "6"]
    assert [r["answer_format"] for r in rows] == ["answer-line", "boxed", "answer-line", "boxed"]
    assert rows[0]["question"][0]["content"].endswith('Remember to put your answer on its own line after "Answer:".')
    assert {r["answer_format"] for r in infra.data.load_rows(HUB_ID, answer_format="boxed")} == {"boxed"}
    assert offline == [True, True] and datasets.config.HF_HUB_OFFLINE is before  # and set back after each load
    with open(os.path.join(FIXTURES, "verl_format_rows.json")) as handle:
        cache_hub_dataset(hub_cache, "BytedTsinghua-SIA/DAPO-Math-17k", {"train": json.load(handle)})
    verl = infra.data.load_rows("BytedTsinghua-SIA/DAPO-Math-17k")
    assert verl == infra.data.load_rows(verl_parquet) and verl[0]["question"] == [{"content": DAPO_PROMPT,
                                                                                    "role": "user"}]


def test_the_benchmarks_hub_copies_give_questions_and_gold_answers(hub_cache, shared_file):
    # the layouts of the default held-out sets' hub copies, filled with the real files of ../shared/data: AIME24
    # (HuggingFaceH4/aime_2024: one split, `train`), MATH500 and AMC23 (their `test`); GSM8K's `main` config
    def read(relative, count=None):
        with open(shared_file(relative)) as handle:
            return [json.loads(line) for line in handle][:count]
    cache_hub_dataset(hub_cache, "HuggingFaceH4/aime_2024", {"train": read("aime24/test.jsonl")})
    cache_hub_dataset(hub_cache, "HuggingFaceH4/MATH-500", {"test": read("math500/test.jsonl")})
    cache_hub_dataset(hub_cache, "math-ai/amc23", {"test": [{k: r[k] for k in ("id", "question", "answer", "url")}
                                                            for r in read("amc23/test.jsonl")]})
    cache_hub_dataset(hub_cache, "openai/gsm8k", {"train": read("gsm8k/train.jsonl", 20),
                                                  "test": read("gsm8k/test.jsonl", 20)}, config="main")
    sets = infra.data.load_eval_sets(["HuggingFaceH4/aime_2024", "HuggingFaceH4/MATH-500", "math-ai/amc23",
                                      "openai/gsm8k:main"])
    assert list(sets) == ["aime_2024", "MATH-500", "amc23", "gsm8k"]  # named as their files would be
    for name, relative in (("aime_2024", "aime24"), ("MATH-500", "math500"), ("amc23", "amc23")):
        assert sets[name] == infra.data.load_rows(shared_file(f"{relative}/test.jsonl")), name
    assert [len(rows) for rows in sets.values()] == [30, 500, 40, 20]
    assert sets["aime_2024"][0]["answer"] == "204" and sets["amc23"][0]["answer"] == "27"  # 27.0 in the file
    assert sets["MATH-500"][0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert all(isinstance(r["question"], str) and r["answer_format"] == "boxed" for rows in sets.values()
               for r in rows)
    train = infra.data.load_rows("openai/gsm8k:main", "train")  # --dataset reads `train`, a held-out set `test`
    assert train[0]["answer"] == "72" and sets["gsm8k"][0]["answer"] == "18"  # after GSM8K's ####
    # OlympiadBench's layout (math-ai/olympiadbench): the gold a one-item list in `final_answer`, before `solution`
    row = {"question": "Find $x$.", "solution": ["Since ... $x=\\frac{1}{2}$."], "final_answer": ["$\\frac{1}{2}$"]}
    assert infra.data.row_to_example(row, "olympiad[0]")["answer"] == "$\\frac{1}{2}$"


def test_a_hub_id_takes_a_config_and_its_split_is_asked_or_its_only_one(hub_cache):
    cache_hub_dataset(hub_cache, "openai/gsm8k", {"train": [{"question": "1+1?", "answer": "#### 2"}],
                                                  "test": [{"question": "2+2?", "answer": "#### 4"}]}, config="main")
    assert infra.data.load_rows("openai/gsm8k:main", "train")[0]["answer"] == "2"
    assert infra.data.load_eval_sets("openai/gsm8k:main") == {"gsm8k": [
        {"question": "2+2?", "answer": "4", "answer_format": "boxed"}]}
    with pytest.raises(UserError, match=r"^--dataset 'openai/gsm8k:main': no 'validation' split \(it has train, "
                                        r"test\)$"):
        infra.data.load_rows("openai/gsm8k:main", "validation")
    with pytest.raises(UserError) as error:  # a config not in the cache: datasets' own reason, in one line
        infra.data.load_rows("openai/gsm8k:socratic", flag="--eval-datasets")
    assert str(error.value).startswith("--eval-datasets 'openai/gsm8k:socratic': not a local file and the hub dataset "
                                       "could not be loaded (ValueError: Couldn't find cache for openai/gsm8k for "
                                       "config 'socratic')") and "\n" not in str(error.value)
    for spec in ("./gsm8k", "openai/gsm8k:main:x", "a/b/c"):  # paths, not hub ids
        with pytest.raises(UserError, match="no such file"):
            infra.data.load_rows(spec)


@pytest.mark.parametrize("spec, why", [
    ("data/train.jsonl", "no folder data/ in {cwd}"),  # hub-id-shaped (org/name), but a file extension: a path
    ("data/train.parquet", "no folder data/ in {cwd}"), ("./gsm8k", "not in {cwd}"), ("/nonexistent/x", "no folder "
                                                                                        "/nonexistent/"),
    ("train.jsonl", "not in {cwd}"), ("x", "not in {cwd}; nor a hub id: org/name, org/name:config")])
def test_a_value_that_looks_like_a_path_is_a_missing_file_not_a_hub_id(spec, why, hub_cache, tmp_path, monkeypatch):
    """Issue 60: `--dataset data/train.jsonl` (its folder missing) was taken for a hub id, and offline the answer was
    `not in the Hugging Face cache ... writes train.jsonl/train.jsonl`. A file extension or a leading ./, ../, / or ~
    makes a path: `no such file`, saying where it was looked for; a hub id stays one (org/name, org/name:config)."""
    monkeypatch.chdir(tmp_path)
    assert not infra.hub.is_hub_dataset(spec) and infra.hub.is_hub_dataset("openai/gsm8k:main")
    infra.hub.check_dataset_sources(spec, (spec,))  # not a hub id: nothing for the hub check to refuse
    for flag in ("--dataset", "--eval-datasets"):
        with pytest.raises(UserError) as error:
            infra.data.load_rows(spec, flag=flag)
        assert str(error.value) == f"{flag} {spec!r}: no such file ({why.format(cwd=tmp_path)})"


def test_python_m_infra_hub_writes_the_files_a_refusal_names(hub_cache, tmp_path, monkeypatch):
    cache_hub_dataset(hub_cache, HUB_ID, {"train": slime_rows()})
    cache_hub_dataset(hub_cache, "math-ai/amc23", {"test": [{"question": "1+1?", "answer": 2.0}]})
    monkeypatch.chdir(tmp_path)
    infra.hub.main(["--dataset", HUB_ID, "--eval-datasets", "math-ai/amc23"])
    assert infra.hub.dataset_file(HUB_ID, "--dataset") == "dapo-math-17k/train.jsonl"
    assert infra.data.load_rows("dapo-math-17k/train.jsonl") == infra.data.load_rows(HUB_ID)
    assert infra.data.load_eval_sets("amc23/test.jsonl") == infra.data.load_eval_sets("math-ai/amc23") == {
        "amc23": [{"question": "1+1?", "answer": "2", "answer_format": "boxed"}]}  # the same name, the same rows


def test_a_trainer_refuses_a_hub_id_without_datasets_before_any_model_loads(monkeypatch, tmp_path, capsys):
    import grpo
    import infra.run
    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setattr(common, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--dataset", HUB_ID, "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_code:
        infra.run.run_main(grpo.main)
    error = capsys.readouterr().err
    assert exit_code.value.code == 2 and error.count("\n") == 1 and "pip install datasets" in error, error
    assert error.startswith(f"grpo.py: error: --dataset '{HUB_ID}': a hub dataset id needs the `datasets` package")
    assert os.listdir(tmp_path) == []  # no run folder left behind


SMALL = ["--max-response-tokens", "64", "--eval-max-tokens", "64"]  # a memory plan that fits any machine
SP3O_EVAL = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026", "math-ai/amc23",
             "HuggingFaceH4/MATH-500", "math-ai/minervamath")  # sp3o.py's default held-out sets


def run_trainer(trainer, argv, monkeypatch, capsys):
    """(exit code, stderr) of `python <trainer>.py argv` in-process, failing the test if a model loads."""
    import infra.run
    module = importlib.import_module(trainer)
    monkeypatch.setattr(common, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *argv])
    with pytest.raises(SystemExit) as exit_code:
        infra.run.run_main(module.main)
    return exit_code.value.code, capsys.readouterr().err


def test_offline_a_real_models_default_data_is_refused_in_one_line_naming_the_files(hub_cache, qwen_like_path,
                                                                                     monkeypatch, capsys, tmp_path):
    # `python sp3o.py --model <a real model>` offline with nothing cached: one line, before any model loads, naming
    # the sets, the command that writes them as files where the hub can be reached, and the flags taking the files
    argv = ["--model", qwen_like_path, "--output-dir", str(tmp_path / "runs"), *SMALL]
    code, error = run_trainer("sp3o", argv, monkeypatch, capsys)
    files = [infra.hub.dataset_file(spec, "--eval-datasets") for spec in SP3O_EVAL]
    assert code == 2 and error.count("\n") == 1, error
    assert error == (
        f"sp3o.py: error: --dataset and --eval-datasets: {HUB_ID}, {', '.join(SP3O_EVAL)} are not in the Hugging "
        f"Face cache ({hub_cache}) and the hub cannot be reached (ConnectError: no network in this test); download "
        f"them where it can (`python -m infra.hub --dataset {HUB_ID} --eval-datasets {' '.join(SP3O_EVAL)}` writes "
        f"dapo-math-17k/train.jsonl, {', '.join(files)}; or copy that cache here) or pass local files: --dataset "
        f"dapo-math-17k/train.jsonl --answer-format boxed --eval-datasets {' '.join(files)}\n")
    assert files[0] == "aime_2024/test.jsonl" and not os.path.exists(tmp_path / "runs")
    # the training set cached: only the held-out sets are named, the cached ones kept by their hub ids
    cache_hub_dataset(hub_cache, HUB_ID, {"train": slime_rows()})
    cache_hub_dataset(hub_cache, "HuggingFaceH4/aime_2024", {"train": [{"problem": "1+1?", "answer": "2"}]})
    code, error = run_trainer("sp3o", argv, monkeypatch, capsys)
    assert code == 2 and error.count("\n") == 1 and error.startswith(
        f"sp3o.py: error: --eval-datasets: {', '.join(SP3O_EVAL[1:])} are not in the Hugging Face cache"), error
    assert error.endswith(f"or pass local files: --eval-datasets HuggingFaceH4/aime_2024 {' '.join(files[1:])}\n")
    # a file of one's own as --dataset: the method's held-out sets are not asked for, nothing is refused
    code, error = run_trainer("sp3o", [*argv, "--dataset", SLIME_JSONL, "--steps", "0"], monkeypatch, capsys)
    assert "not in the Hugging Face cache" not in error and "--steps must be at least 1" in error


@pytest.fixture
def every_default_set(hub_cache):
    """The local cache holding, in a few rows each, every hub dataset the six files default to for a real model."""
    question = [{"problem": "What is 1+1?", "answer": "2"}]
    cache_hub_dataset(hub_cache, HUB_ID, {"train": slime_rows()})
    for spec in SP3O_EVAL:
        cache_hub_dataset(hub_cache, spec, {"train" if spec.startswith(("HuggingFaceH4/aime", "MathArena"))
                                            else "test": question})
    cache_hub_dataset(hub_cache, "openai/gsm8k", {"train": [{"question": "1+1?", "answer": "#### 2"}],
                                                  "test": [{"question": "2+2?", "answer": "#### 4"}]}, config="main")
    return hub_cache


@pytest.mark.parametrize("trainer", ["ppo", "grpo", "sp3o", "tppo", "sppo", "spo"])
def test_the_start_lines_name_each_default_choice_and_how_to_change_it(trainer, every_default_set, qwen_like_path,
                                                                      tmp_path, capsys):
    import infra.cli
    import infra.run
    module = importlib.import_module(trainer)
    args = infra.cli.parse_args(module.Args, module.TINY_PRESET, ["--model", qwen_like_path, "--output-dir",
                                                                  str(tmp_path), *SMALL])
    run = infra.run.Run(args, f"{trainer}.py")
    lines = capsys.readouterr().out.splitlines()
    chosen = [line for line in lines if line.endswith(" to change)")]
    assert [line.split(":")[0] for line in chosen] == ["training set", "reward", "held-out sets"], lines
    assert chosen[0].startswith(f"training set: {args.dataset}, {trainer}.py's default (")
    assert chosen[0].endswith("; --dataset FILE to change)") and chosen[1].startswith("reward: boxed, ")
    assert chosen[2].startswith(f"held-out sets: {', '.join(args.eval_datasets)}, {trainer}.py's default (")
    assert len(run.eval_sets) == len(args.eval_datasets) and len(run.train_rows) in (1, 4)  # loaded, then described
    assert infra.data.describe(args.dataset, run.train_rows) in lines and infra.data.NO_EVAL_SETS not in lines
    if trainer == "sp3o":  # the source and the reason, from the label of the field in sp3o.py's Args
        assert chosen == [
            f"training set: {HUB_ID}, sp3o.py's default (SP3O: slime's DAPO-Math-17k; --dataset FILE to change)",
            "reward: boxed, sp3o.py's default (SP3O/SPPO: the last \\boxed{}; --answer-format to change)",
            f"held-out sets: {', '.join(SP3O_EVAL)}, sp3o.py's default (SP3O: the six of its eval.example.yaml, by "
            "hub ids; --eval-datasets to change)"]
        assert f"{HUB_ID}: 4 rows, prompts: chat messages, reward: boxed" in lines
        assert "aime_2025: 1 rows, prompts: questions, reward: boxed" in lines
    # another training set: no default is named, no held-out set is loaded, and auto decides the reward
    args = infra.cli.parse_args(module.Args, module.TINY_PRESET, ["--model", qwen_like_path, "--dataset",
                                                                  SLIME_JSONL, "--output-dir", str(tmp_path), *SMALL])
    infra.run.Run(args, f"{trainer}.py")
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2:] == [f"{SLIME_JSONL}: 4 rows, prompts: chat messages, reward: answer-line (2) + boxed (2)",
                          infra.data.NO_EVAL_SETS] and not any(line.endswith(" to change)") for line in lines)


def test_chat_prompt_exact_tokens_with_a_chat_template(tokenizer, verl_parquet):
    rows = infra.data.load_rows(verl_parquet)
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = CHAT_TEMPLATE
    dapo = common.prompt_ids(chat_tokenizer, rows[0]["question"])
    assert dapo == char_ids(f"[user]{DAPO_PROMPT}[assistant]")  # no instruction of ours added
    assert chat_tokenizer.decode(dapo) == (
        "[user]Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $2+3$?\n\nRemember "
        'to put your answer on its own line after "Answer:".[assistant]')
    boxed = common.prompt_ids(chat_tokenizer, rows[2]["question"])  # system + user, the user asking for \boxed{}
    assert boxed == char_ids("[system]You are a careful mathematician.[user]What is 7*8?\n") + [INSTRUCTION_ID] \
        + char_ids("[assistant]")
    # a plain question keeps today's template: our instruction, inside the chat template
    assert common.prompt_ids(chat_tokenizer, "What is 7*8?") == char_ids("[user]What is 7*8?\n") + [INSTRUCTION_ID] \
        + char_ids("[assistant]")


def test_chat_prompt_without_a_chat_template_joins_the_contents(tokenizer, verl_parquet):
    rows = infra.data.load_rows(verl_parquet)
    assert not getattr(tokenizer, "chat_template", None)
    assert common.prompt_ids(tokenizer, rows[0]["question"]) == char_ids(DAPO_PROMPT + "\n")
    assert tokenizer.decode(common.prompt_ids(tokenizer, rows[2]["question"])) == \
        f"You are a careful mathematician.\nWhat is 7*8?\n{common.INSTRUCTION}\n"


# ----------------------------------------------------------------------------------------------
# Rewards: DAPO's answer line, normalized as its released reward does; \boxed{} by math-verify.
# ----------------------------------------------------------------------------------------------
def answer_line(gold):
    return {"answer": gold, "answer_format": "answer-line"}


# (response, gold, reward), each worked out by hand from verl math_dapo.normalize_final_answer's rules
DAPO_CASES = [
    ("So the sum is 5.\nAnswer: 5", "5", 1.0),
    ("Answer: 6", "5", 0.0),
    ("answer :  5", "5", 1.0),  # (?i)Answer\s*:\s*
    ("Answer: 4\nchecking again...\nAnswer: 5", "5", 1.0),  # the last Answer: line
    ("Answer: 5\nno wait\nAnswer: 4", "5", 0.0),
    ("The answer is \\boxed{5}", "5", 0.0),  # no `Answer:` line: [INVALID]
    ("Answer: 5." , "5", 0.0),  # only ".$" is substituted: a trailing period stays
    ("Answer: $5$", "5", 1.0),  # $...$ unwrapped, then $ removed
    ("Answer: \\$5", "5", 1.0),  # a dollar sign
    ("Answer: 5 dollars", "5", 1.0),  # spaces removed, then units
    ("Answer: 60 km", "60", 1.0),
    ("Answer: 60 mph", "60", 1.0),
    ("Answer: 10 \\text{ cm}", "10", 1.0),  # 10\text{cm} -> 10\text{} -> 10
    ("Answer: 90^\\circ", "90", 1.0),
    ("Answer: 90^{\\circ}", "90", 1.0),
    ("Answer: 90 degrees", "90", 1.0),
    ("Answer: \\text{5}", "5", 1.0),
    ("Answer: \\textbf{5}", "5", 1.0),
    ("Answer: \\mbox{5}", "5", 1.0),  # mbox -> text
    ("Answer: \\boxed{5}", "5", 1.0),
    ("Answer: x = 5", "5", 1.0),  # the part after the last =
    ("Answer: 5", "x = 5", 1.0),  # the gold is normalized too
    ("Answer: 1,000", "1000", 1.0),  # thousands commas of a plain number
    ("Answer: 1{,}000", "1000", 1.0),
    ("Answer: 1,000", "1,000", 1.0),
    ("Answer: (1, 2)", "(1,2)", 1.0),  # commas stay when it is not a number
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # \fracab -> \frac{a}{b}
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),  # \sqrta -> \sqrt{a}
    ("Answer: 0.5", "\\frac{1}{2}", 0.0),  # a string match: no numeric equivalence
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}", 0.0),
    ("Answer: 5" + " filler" * 50, "5", 0.0),  # the Answer: line is not in the last 300 characters
    ("x" * 1000 + "\nAnswer: 5", "5", 1.0),
]


@pytest.mark.parametrize("response, gold, reward", DAPO_CASES)
def test_answer_line_reward_follows_dapo(response, gold, reward):
    assert common.score(response, answer_line(gold)) == reward
    assert common.verify_answer_line(response, gold) == reward


def test_the_three_responses_of_a_dapo_row(verl_parquet):
    row = infra.data.load_rows(verl_parquet)[0]  # What is $2+3$?, gold 5, DAPO's instruction
    assert common.score("2 + 3 = 5.\nAnswer: 5", row) == 1.0
    assert common.score("2 + 3 = 6.\nAnswer: 6", row) == 0.0
    assert common.score("2 + 3 = \\boxed{5}", row) == 0.0  # right, but not where the prompt asked for it
    boxed_row = dict(row, answer_format="boxed")  # --answer-format boxed: math-verify on the last \boxed{}
    assert common.score("2 + 3 = \\boxed{5}", boxed_row) == 1.0 and common.score("Answer: 5", boxed_row) == 0.0


def test_boxed_rows_keep_math_verify():
    row = {"answer": "\\frac{1}{2}", "answer_format": "boxed"}
    assert common.score("so \\boxed{0.5}", row) == 1.0  # math-verify's equivalence
    assert common.score("Answer: \\frac{1}{2}", row) == 0.0
    assert common.score("\\boxed{5}", {"answer": "5"}) == 1.0  # a row without a format is boxed


def test_answer_line_never_evaluates_model_text(tmp_path):
    marker = tmp_path / "ran"  # an answer that would create it if it were evaluated: it is only compared as text
    assert common.score(f"Answer: __import__('pathlib').Path({str(marker)!r}).touch()", answer_line("0")) == 0.0
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# Evaluation and Monte Carlo values score the same way.
# ----------------------------------------------------------------------------------------------
class FixedGenerator:
    """Every sample of every prompt is `text` + EOS (4 tokens)."""
    def __init__(self, text):
        self.text = text

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        return [common.Completion(index, [5, 6, 7, 1], self.text, [0.0] * 4, "stop")
                for index in range(len(prompts)) for _ in range(n)]


class FixedTokenizer:
    """decode() of any ids gives `text`."""
    def __init__(self, text):
        self.text = text

    def decode(self, ids, skip_special_tokens=True):
        return self.text


def test_evaluation_scores_each_set_in_its_own_format(tokenizer, verl_parquet):
    sets = infra.data.load_eval_sets([verl_parquet, SLIME_JSONL])
    dapo_like = {"dapo": [r for r in sets["dapo_like"] if r["answer"] == "5"],
                 "boxed": [r for r in sets["slime_format"] if r["answer"] == "12"]}
    assert [r["answer_format"] for rows in dapo_like.values() for r in rows] == ["answer-line", "boxed"]
    for text, expected in (("Answer: 5", (1.0, 0.0)), ("\\boxed{12}", (0.0, 1.0)), ("Answer: 12", (0.0, 0.0))):
        metrics = infra.evaluate.evaluate(FixedGenerator(text), tokenizer, dapo_like)
        assert (metrics["eval/dapo/avg@1"], metrics["eval/boxed/avg@1"]) == expected, text


def test_monte_carlo_values_score_by_the_row():
    """SPO's cutpoint values and the critic probes: a state's continuations are scored against its own row."""
    states = [([5, 6], [7]), ([5, 6], [8])]
    rows = [answer_line("7"), {"answer": "7", "answer_format": "boxed"}]
    for text, expected in (("Answer: 7", [1.0, 0.0]), ("\\boxed{7}", [0.0, 1.0])):  # the decoded prefix + continuation
        values, _ = common.monte_carlo_values(FixedGenerator(text), FixedTokenizer(text), states, rows, 2, 16)
        assert values.tolist() == expected, text


# ----------------------------------------------------------------------------------------------
# End to end: every trainer, 2 steps, on each format (in this process: the imports are paid once).
# ----------------------------------------------------------------------------------------------
SMALL = ["--steps", "2", "--prompts-per-step", "2", "--max-response-tokens", "16", "--eval-problems", "2",
         "--eval-max-tokens", "16", "--save-every", "0"]
TRAINER_FLAGS = with_forks({
    "ppo": ["--samples-per-prompt", "2", "--micro-batch-size", "2", "--probe-every", "1", "--probe-prompts", "2",
            "--probe-continuations", "2", "--critic-warmup", "1"],  # the probe's Monte Carlo values on chat rows too
    "grpo": ["--samples-per-prompt", "2", "--micro-batch-size", "2"],
    "sppo": ["--micro-batch-size", "1"],
    "sp3o": ["--samples-per-prompt", "2", "--micro-batch-size", "2", "--critic-warmup", "1"],
    "tppo": ["--samples-per-prompt", "2", "--micro-batch-size", "2"],
    "spo": ["--samples-per-prompt", "2", "--micro-batch-size", "2", "--mc-samples", "2", "--mini-batches", "2"],
})


@pytest.mark.parametrize("data_format", ["verl", "slime"])
@pytest.mark.parametrize("trainer", list(TRAINER_FLAGS))
def test_every_trainer_trains_two_steps_on_each_format(trainer, data_format, verl_parquet, tmp_path, monkeypatch,
                                                       capsys):
    dataset = verl_parquet if data_format == "verl" else SLIME_JSONL
    module = importlib.import_module(trainer)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", "--dataset", dataset, "--eval-datasets", dataset, *SMALL,
                                      *TRAINER_FLAGS[trainer], "--output-dir", str(tmp_path), "--run-name", "run"])
    module.main()
    out = capsys.readouterr().out
    name = os.path.splitext(os.path.basename(dataset))[0]
    assert f"{dataset}: 4 rows, prompts: chat messages, reward: answer-line" in out
    assert f"{name}: 2 rows, prompts: chat messages, reward: answer-line (1) + boxed (1)" in out \
        if data_format == "slime" else f"{name}: 2 rows, prompts: chat messages, reward: answer-line" in out
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        records = [json.loads(line) for line in handle]
    assert [r["step"] for r in records] == [0, 1]
    for record in records:
        assert 0.0 <= record["reward"] <= 1.0, record  # a critic warm-up step logs no policy loss (none applied)
        assert record.get("actor_frozen") or math.isfinite(record["policy_loss"]), record
        assert all(math.isfinite(value) for value in record.values()), record
    assert f"eval/{name}/avg@1" in records[0] and f"eval/{name}/avg@1" in records[-1]
