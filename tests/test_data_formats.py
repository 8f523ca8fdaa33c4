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
from infra import UserError
from infra.answer_line import ANSWER_LINE_PREFIX, ANSWER_LINE_SUFFIX
from helpers import with_forks

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


def test_a_hub_id_loads_through_datasets_and_names_a_hub_failure(monkeypatch):
    import types
    with open(os.path.join(FIXTURES, "verl_format_rows.json")) as handle:
        verl_rows = json.load(handle)
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        if name != HUB_ID:
            raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)\nmore lines")
        return verl_rows
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = infra.data.load_rows(HUB_ID, "train")
    assert calls == [(HUB_ID, "train")] and len(rows) == len(verl_rows)
    assert rows[0]["question"] == [{"role": "user", "content": DAPO_PROMPT}] and rows[0]["answer"] == "5"
    with pytest.raises(UserError, match=r"^--dataset 'org/missing': not a local file and the hub dataset could not "
                                        r"be loaded \(ConnectionError: Couldn't reach 'org/missing' on the Hub"):
        infra.data.load_rows("org/missing")


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
