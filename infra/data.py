"""Datasets: rows {"question", "answer", "answer_format"} from the built-in task, a .jsonl / .json / .parquet file
or a hub dataset id (org/name, org/name:config; infra/hub.py), with `file:line` errors for bad rows; the start lines
naming a method's own data defaults; and the order in which training rows are drawn (a function of the step alone,
so a resumed run sees the same data).

Layouts read without flags: plain rows (`question`/`problem`/`prompt` and `answer`/`solution`/`ground_truth`),
verl's (DAPO-Math-17k: `prompt` a list of chat messages, the gold in `reward_model.ground_truth`) and slime's
(SP3O's launcher: `--input-key prompt --label-key label`: chat messages and `label`); others: --question-field."""
import json
import math
import os
import re
import sys

import numpy as np

from common import extract_answer
from infra import UserError, answer_line, hub
from infra.horizon import horizon_rows, parse_spec
from infra.tiny import DIGITS, builtin_rows

QUESTION_FIELDS = ("question", "problem", "prompt")
ANSWER_FIELDS = ("answer", "final_answer", "solution", "ground_truth", "label", "reward_model.ground_truth")
ANSWER_FORMATS = ("auto", "boxed", "answer-line")


def gold_answer(value):
    """Normalize a gold field: GSM8K `... #### 18` -> `18`, a MATH solution -> its last \\boxed{}, numbers -> str.
    None for anything unusable (empty, not a string or a finite number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, float):  # 27.0 -> "27", 0.5 -> "0.5", 1234567.0 -> "1234567" (never 1.23e+06)
            return (str(int(value)) if value.is_integer() else repr(value)) if math.isfinite(value) else None
        return str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    if "####" in value:
        return value.rsplit("####", 1)[1].strip().replace(",", "") or None
    return extract_answer(value) or value.strip()


_MISSING = object()


def field(row, path):
    """row["a"]["b"] for the dotted path `a.b`; a number indexes a list (`prompt.0.content`); _MISSING if absent."""
    value = row
    for key in path.split("."):
        if isinstance(value, dict) and key in value:
            value = value[key]
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return _MISSING
    return value


def chat_messages(value):
    """`value` if it is a non-empty list of chat messages ({"role": str, "content": str}, not all empty), else None."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                 and isinstance(m.get("content"), str) for m in value):
        return value if any(m["content"].strip() for m in value) else None
    return None


def answer_format_of(question, answer_format="auto"):
    """The row's answer format: `answer_format`, or with auto what the prompt asks for: an `Answer:` line
    (DAPO's instruction, e.g. "... of the form Answer: $Answer") -> answer-line, else boxed."""
    if answer_format != "auto":
        return answer_format
    text = question if isinstance(question, str) else "\n".join(m["content"] for m in question)
    return "answer-line" if answer_line.ASKS_FOR_ANSWER_LINE.search(text) else "boxed"


def row_to_example(row, where, question_field="", answer_field="", answer_format="auto"):
    """{"question": a string or the row's chat messages, "answer": the gold, "answer_format": boxed or answer-line}.
    A string question gets our \\boxed{} template (common.prompt_ids), except for answer-line rows: those are asked
    DAPO's way, as one user message: the question as given when it carries its own instruction, else wrapped in
    DAPO-Math-17k's template. Chat messages are always used as given."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fields = f"the row has: {', '.join(map(str, list(row)[:8])) or 'no fields'}{' ...' if len(row) > 8 else ''}"
    question = None
    for path in [question_field] if question_field else QUESTION_FIELDS:
        value = field(row, path)
        if isinstance(value, str) and value.strip():
            question = value
        elif isinstance(value, list) or question_field and value is not _MISSING:  # there, but no question
            question = chat_messages(value)
            if question is None:
                raise UserError(f"{where}: the question field {path!r} is neither a non-empty string nor a list of "
                                f"chat messages with string role and content; it is {str(value)[:80]!r}")
        if question is not None:
            break
    if question is None:
        searched = f"{question_field!r} (--question-field)" if question_field else \
            f"one of {', '.join(QUESTION_FIELDS)}"
        raise UserError(f"{where}: no question field ({searched}; {fields})")
    answer_paths = [answer_field] if answer_field else ANSWER_FIELDS
    answer_path = next((p for p in answer_paths if field(row, p) not in (_MISSING, None, "", [])), None)
    answer = field(row, answer_path) if answer_path else None
    if isinstance(answer, list):  # slime's label may be a list: one answer per row here
        if len(answer) > 1:
            raise UserError(f"{where}: {answer_path!r} holds {len(answer)} answers; one answer per row is supported")
        answer = answer[0]
    answer = gold_answer(answer)
    if answer is None:
        searched = f"{answer_field!r} (--answer-field)" if answer_field else f"one of {', '.join(ANSWER_FIELDS)}"
        raise UserError(f"{where}: no answer field ({searched}), or it is empty or not a string or number ({fields})")
    answer_format = answer_format_of(question, answer_format)
    if answer_format == "answer-line" and isinstance(question, str):
        asked = answer_line.ASKS_FOR_ANSWER_LINE.search(question)
        text = question if asked else answer_line.ANSWER_LINE_PREFIX + question + answer_line.ANSWER_LINE_SUFFIX
        question = [{"role": "user", "content": text}]
    return {"question": question, "answer": answer, "answer_format": answer_format}


DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


def _json_array_rows(spec, text):
    """(spec:line, item) for each item of a JSON array, the line being where the item starts."""
    decoder, blank, rows = json.JSONDecoder(), re.compile(r"\s*"), []
    position = blank.match(text).end() + 1  # past the [
    line, counted = 1, 0
    try:
        position = blank.match(text, position).end()
        while text[position:position + 1] != "]":
            line, counted = line + text.count("\n", counted, position), position
            item, position = decoder.raw_decode(text, position)
            rows.append((f"{spec}:{line}", item))
            position = blank.match(text, position).end()
            if text[position:position + 1] == ",":
                position = blank.match(text, position + 1).end()
            elif text[position:position + 1] != "]":
                raise json.JSONDecodeError("expected ',' or ']' after an item", text, position)
        if text[position + 1:].strip():
            raise json.JSONDecodeError("extra data after the array", text, position + 1)
    except json.JSONDecodeError as error:
        raise UserError(f"{spec}:{error.lineno}: invalid JSON ({error.msg})")
    return rows


def _read_file_rows(spec, flag):
    """(where, row or UserError) for each row of a local .jsonl/.json/.parquet file."""
    if os.path.isdir(spec):
        inside = sorted(f for f in os.listdir(spec) if f.endswith(DATA_EXTENSIONS))
        raise UserError(f"{flag} {spec!r} is a directory; give a file in it"
                        + (f" ({', '.join(inside[:5])})" if inside else " (it holds no .jsonl/.json/.parquet file)"))
    if not spec.endswith(DATA_EXTENSIONS):
        raise UserError(f"{flag} {spec!r}: unsupported file type (use .jsonl, .json or .parquet)")
    try:
        if spec.endswith(".parquet"):
            import pyarrow.parquet
            try:
                table = pyarrow.parquet.read_table(spec)
            except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
                raise UserError(f"{flag} {spec!r}: not a readable parquet file ({str(error).splitlines()[0]})")
            return [(f"{spec}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
        with open(spec, "rb") as handle:
            data = handle.read()
    except OSError as error:  # permissions, a broken disk ...
        raise UserError(f"{flag} {spec!r}: cannot read it ({error.strerror or error})")
    if spec.endswith(".json") and data.lstrip().startswith(b"["):
        try:
            return _json_array_rows(spec, data.decode("utf-8-sig"))
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise UserError(f"{spec}:{line}: not UTF-8 text ({error.reason})")
    rows = []
    for number, line in enumerate(data.split(b"\n"), 1):  # JSON Lines (also what datasets' to_json writes)
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            rows.append((f"{spec}:{number}", UserError(f"{spec}:{number}: not UTF-8 text ({error.reason})")))
            continue
        if not text.strip():
            continue
        try:
            rows.append((f"{spec}:{number}", json.loads(text)))
        except json.JSONDecodeError as error:
            hint = ""
            if number == 1 and spec.endswith(".json"):
                hint = "; a .json file must be an array of objects, or one object per line"
            rows.append((f"{spec}:{number}", UserError(f"{spec}:{number}: invalid JSON ({error.msg}{hint})")))
    return rows


def builtin_digits(spec, flag="--dataset"):
    """The digits of `builtin` (the default, infra.tiny.DIGITS), `builtin:N` (an int) or `builtin:A-B` ((A, B));
    "early" for `builtin:early` (infra.tiny.early_problem), "words" for `builtin:words` (infra.tiny.word_problem),
    "words2"/"words3" for `builtin:words2`/`builtin:words3` (infra.tiny.chain_word_problem), the spec itself for
    `builtin:horizon-k<K>-h<H>[-late]` (infra.horizon)."""
    text = spec.partition(":")[2] if ":" in spec else str(DIGITS)
    if text in ("early", "words", "words2", "words3"):
        return text
    if text.startswith("horizon"):
        parse_spec(text, flag)  # refused in one line if malformed
        return text
    bounds = text.split("-")
    valid = len(bounds) <= 2 and all(b.isdigit() and 1 <= int(b) <= 12 for b in bounds)
    if not valid or int(bounds[0]) > int(bounds[-1]):
        raise UserError(f"{flag} {spec!r}: the built-in task is `builtin`, `builtin:N` (N digits from 1 to 12), "
                        f"`builtin:A-B` (each problem's digits drawn from A to B, A <= B), `builtin:words`, `builtin:"
                        f"words2`, `builtin:words3`, `builtin:early` (6 digits, one carry: after the units column) or "
                        f"`builtin:horizon-k<K>-h<H>[-late]` (K decisions, H irrelevant tokens)")
    return int(bounds[0]) if len(bounds) == 1 else (int(bounds[0]), int(bounds[1]))


def load_rows(spec, split="train", n_builtin=None, seed=0, skip_bad_rows=False, flag="--dataset", question_field="",
              answer_field="", answer_format="auto"):
    """Rows {"question", "answer", "answer_format"} (row_to_example) from `builtin`, a .jsonl/.json/.parquet file,
    or a hub dataset id. Raises UserError naming `file:line` for a bad row (or skips it with skip_bad_rows,
    reporting the count), and for an unreadable or empty file."""
    if answer_format not in ANSWER_FORMATS:
        raise UserError(f"--answer-format {answer_format!r}: use one of {', '.join(ANSWER_FORMATS)}")
    if spec == "builtin" or spec.startswith("builtin:"):  # questions without an instruction: boxed unless asked
        digits = builtin_digits(spec, flag)
        rows = horizon_rows(split, n_builtin or 4096, seed, digits) if str(digits).startswith("horizon") else \
            builtin_rows(split, n_builtin or 4096, seed, digits)
        if answer_format != "answer-line":
            return [dict(row, answer_format="boxed") for row in rows]
        return [{**row, **row_to_example(row, f"builtin[{i}]", answer_format=answer_format)}
                for i, row in enumerate(rows)]
    if os.path.exists(spec):
        raw = _read_file_rows(spec, flag)
    elif not hub.is_hub_dataset(spec):  # a path (hub.looks_like_path), or neither a path nor a hub id
        raise UserError(f"{flag} {spec!r}: {hub.no_such_file(spec)}")
    else:  # the split asked for, or the dataset's only one
        raw = [(f"{spec}[{i}]", r) for i, r in enumerate(hub.dataset_rows(spec, split, flag))]
    rows, bad = [], []
    for where, row in raw:
        try:
            if isinstance(row, UserError):
                raise row
            rows.append(row_to_example(row, where, question_field, answer_field, answer_format))
        except UserError as error:
            if not skip_bad_rows:
                raise
            bad.append(str(error))
    if not raw:
        raise UserError(f"{flag} {spec!r}: no rows (the dataset is empty)")
    if not rows:
        raise UserError(f"{flag} {spec!r}: all {len(bad)} rows are bad; the first: {bad[0]}")
    if bad:
        print(f"skipped {len(bad)} bad rows of {len(raw)} in {spec} (the first: {bad[0]})", file=sys.stderr)
    return rows


def load_eval_sets(specs, limit=0, skip_bad_rows=False, train_spec="builtin"):
    """{name: rows} for eval datasets given as a comma-separated string or a list/tuple of specs (`builtin` =
    the built-in task's held-out split, with the digits of `train_spec` when that is `builtin:N`, or its problems
    when that is `builtin:early`); a file `math500/test.jsonl` is named `math500`, a repeated name gets `_2`, `_3`.
    `limit` > 0 keeps the first `limit` rows of each. Each set keeps its own answer format (auto: what its
    prompts ask for), whatever the training set's. No specs: {} (no held-out evaluation, NO_EVAL_SETS)."""
    sets = {}
    specs = [specs] if isinstance(specs, str) else specs
    for spec in [s.strip() for item in specs for s in item.split(",") if s.strip()]:
        spec = train_spec if spec == "builtin" and train_spec.startswith("builtin:") else spec
        name = os.path.splitext(os.path.basename(spec.partition(":")[0] if hub.is_hub_dataset(spec) else spec))[0]
        name = os.path.basename(os.path.dirname(spec)) or name if name in ("test", "train", "validation") else name
        base, copy = name, 1
        while name in sets:
            copy += 1
            name = f"{base}_{copy}"
        sets[name] = load_rows(spec, "test", n_builtin=limit or 256, skip_bad_rows=skip_bad_rows,
                               flag="--eval-datasets")[:limit or None]
    return sets


def choices(args, trainer):
    """A start line for each data flag at its method file's own default (a real model's published training set,
    reward and held-out sets): the value, whose choice it is (the label of its field in Args) and how to change it."""
    from infra.cli import field_help
    lines, own = [], vars(type(args)).get("__annotations__", {})
    for name, what, flag in (("dataset", "training set", "--dataset FILE"), ("answer_format", "reward",
                             "--answer-format"), ("eval_datasets", "held-out sets", "--eval-datasets")):
        label, value = re.search(r"\((\w[\w/]*)[^;)]*; ([^)]*)\)", field_help(type(args), name)), getattr(args, name)
        if name in own and label and value == type(args).__dataclass_fields__[name].default:
            lines.append(f"{what}: {', '.join(value) if isinstance(value, tuple) else value}, {trainer}'s default "
                         f"({label[1]}: {label[2]}; {flag} to change)")
    return lines


NO_EVAL_SETS = "held-out evaluation: none (no --eval-datasets given, e.g. --eval-datasets math500.jsonl aime24.jsonl)"


def describe(name, rows):
    """`name: N rows, prompts: ..., reward: ...` (counts of each kind when they are mixed)."""
    def counts(values):
        tally = {value: values.count(value) for value in dict.fromkeys(values)}
        return " + ".join(f"{value} ({n})" if len(tally) > 1 else value for value, n in tally.items())
    prompts = counts(["chat messages" if isinstance(r["question"], list) else "questions" for r in rows])
    return f"{name}: {len(rows)} rows, prompts: {prompts}, reward: {counts([r['answer_format'] for r in rows])}"


def step_rows(rows, step, count, seed):
    """The `count` training rows of rollout `step`: a fresh seeded shuffle per pass over the data, so the
    data position is a function of the step alone (exact resume)."""
    orders, picked = {}, []
    for position in range(step * count, (step + 1) * count):
        epoch, index = divmod(position, len(rows))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(rows))
        picked.append(rows[orders[epoch][index]])
    return picked
