"""Every default names its source, in its file and in docs/methods.md, and the two agree with the value.

A field of a trainer's `Args` (and of infra/cli.py's `RunArgs`) labels its default's source in its comment as
`(NAME: value)`, NAME one of SOURCES (`SP3O/SPPO: 0.1` for several; what follows a `;` is another source's value,
for contrast), or `(ours...)`; a field without a label is ours. docs/methods.md has a table per file under
"### Defaults of `<file>`", a row `| `knob` | value | source |` per knob, the source starting with a NAME or
"ours". Checked: every knob of the trainers has a row, and every labelled RunArgs field; a row's value is the
file's default (read with ast, not imported, as infra.cli.trainer_defaults reads it) and so is a label's; a labelled
knob's row names one of the label's sources, any other knob's row says ours; no comment says "published" without
naming whose; no row is left for a knob the file lacks."""
import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("grpo", "ppo", "sp3o", "tppo", "sppo", "spo", "vapo", "prime")
SOURCES = ("SP3O", "SPPO", "SPO", "TPPO", "verl", "DeepSeekMath", "DAPO", "VAPO", "VC-PPO", "PRIME", "GSPO")
_NAME = "|".join(sorted(map(re.escape, SOURCES), key=len, reverse=True))
NAMES = rf"(?:{_NAME})(?:/(?:{_NAME}))*"
LABEL = re.compile(rf"\((?P<names>{NAMES}): (?P<value>[^;)]+)[^)]*\)|\((?P<ours>ours)\b")
ROW_SOURCE = re.compile(rf"(?P<names>{NAMES}|ours)(?=[:;,. ]|$)")
PUBLISHED = re.compile(r"\bpublished\b", re.IGNORECASE)
HEADING = re.compile(r"### Defaults of `([\w/]+\.py)`$")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        return handle.read()


def fields(source, class_name):
    """{field: (default, comment)} of the class's own annotated fields; the comment is the one at the end of the
    field's line, else the comment lines right above it (the rule of infra.cli.field_comments)."""
    lines = source.splitlines()
    comments = {token.start[0]: token.string[1:].strip() for token in
                tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    klass = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == class_name)
    found = {}
    for node in klass.body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            above, line = [], node.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above, line = [comments[line]] + above, line - 1
            found[node.target.id] = (ast.literal_eval(node.value), comments.get(node.end_lineno) or " ".join(above))
    return found


def value_of(text):
    """A value as the labels and tables write it: a Python literal (`0.9, 0.98` is a tuple), on/off, or a word."""
    text = text.strip().strip("`")
    if text in ("on", "off"):
        return text == "on"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def same(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) or {type(a), type(b)} <= {int, float} if a == b else False


def tables(text):
    """{file: {knob: (value, source)}} from the "### Defaults of `<file>`" sections of docs/methods.md."""
    found, current = {}, None
    for line in text.splitlines():
        if line.startswith("#"):
            match = HEADING.match(line)
            current = match.group(1) if match else None
            if current:
                found[current] = {}
        elif current and line.startswith("| `"):
            knob, value, source = (cell.strip() for cell in line.strip()[1:-1].split(" | ", 2))
            assert knob.strip("`") not in found[current], f"{current}: two rows for {knob}"
            found[current][knob.strip("`")] = (value_of(value), source)
    return found


def problems(file_fields, table, every_knob=True):
    """What is wrong between a file's {knob: (default, comment)} and its table {knob: (value, source)}, one
    message each. every_knob: each knob needs a row (RunArgs: only the labelled ones)."""
    found = []
    for knob, (default, comment) in file_fields.items():
        label = LABEL.search(comment)
        if PUBLISHED.search(comment):
            found.append(f"{knob}: its comment says published without naming whose: {comment!r}")
        if knob not in table:
            if every_knob or label:
                found.append(f"{knob}: no row in the table")
            continue
        value, source = table[knob]
        if not same(value, default):
            found.append(f"{knob}: the table says {value!r}, the default is {default!r}")
        row = ROW_SOURCE.match(source)
        row_names = set(row.group("names").split("/")) if row else set()
        if label and label.group("names"):
            names = set(label.group("names").split("/"))
            if not same(value_of(label.group("value")), default):
                found.append(f"{knob}: the comment says {label.group(0)!r}, the default is {default!r}")
            if not row_names or not row_names <= names:
                found.append(f"{knob}: the comment names {'/'.join(sorted(names))}, the table's row {source!r}")
        elif row_names != {"ours"}:
            found.append(f"{knob}: the comment names no source, so the row must say ours: {source!r}")
    found += [f"{knob}: a row for a knob the file does not have" for knob in table if knob not in file_fields]
    return found


DOCS = tables(read(os.path.join("docs", "methods.md")))


def test_the_tables_are_the_trainers_and_the_run_flags():
    assert set(DOCS) == {f"{name}.py" for name in TRAINERS} | {"infra/cli.py"}


@pytest.mark.parametrize("name", TRAINERS)
def test_every_knob_of_a_trainer_is_in_its_table_with_its_default_and_source(name):
    found = problems(fields(read(f"{name}.py"), "Args"), DOCS[f"{name}.py"])
    assert not found, f"{name}.py against docs/methods.md:\n" + "\n".join(found)


def test_the_run_flags_that_name_a_source_are_in_their_table():
    run = fields(read(os.path.join("infra", "cli.py")), "RunArgs")
    assert {"eval_n", "eval_temperature", "eval_top_p"} <= {k for k, (_, c) in run.items() if LABEL.search(c)}
    found = problems(run, DOCS["infra/cli.py"], every_knob=False)
    assert not found, "infra/cli.py RunArgs against docs/methods.md:\n" + "\n".join(found)


def test_every_source_name_is_explained():
    text = read(os.path.join("docs", "methods.md"))
    assert all(f"**{name}**" in text for name in SOURCES)


def test_fields_read_a_label_inline_or_above():
    source = ('class Args:\n    a: int = 64  # prompts (SP3O/TPPO: 64; DAPO: 512)\n    # sum (SP3O: seq-mean)\n'
              '    b: str = "seq-mean"\n    c: tuple[float, float] = (0.9, 0.98)  # betas, 1.0: off\n')
    assert fields(source, "Args") == {"a": (64, "prompts (SP3O/TPPO: 64; DAPO: 512)"),
                                      "b": ("seq-mean", "sum (SP3O: seq-mean)"), "c": ((0.9, 0.98), "betas, 1.0: off")}
    label = LABEL.search(fields(source, "Args")["a"][1])
    assert (label.group("names"), label.group("value")) == ("SP3O/TPPO", "64")
    assert LABEL.search("(auto: on with vLLM)") is None and LABEL.search("(SPPO: 1)").group("names") == "SPPO"
    assert [value_of(v) for v in ("0.9, 0.98", "1e-6", "off", "token-mean", '""', "`8192`")] == [
        (0.9, 0.98), 1e-6, False, "token-mean", "", 8192]


def test_the_check_catches_each_kind_of_mismatch():
    # grpo.py's own fields and table, each planted with one defect: every defect gives its one message
    own, table = fields(read("grpo.py"), "Args"), DOCS["grpo.py"]
    assert problems(own, table) == []

    def planted(knob, comment=None, row=None, drop=False, extra=None):
        new_fields, new_table = dict(own), dict(table)
        if comment is not None:
            new_fields[knob] = (own[knob][0], comment)
        if row is not None:
            new_table[knob] = row
        if drop:
            del new_table[knob]
        if extra:
            new_table[extra] = (1, "ours")
        return problems(new_fields, new_table)

    assert planted("lr", row=(1e-5, table["lr"][1])) == ["lr: the table says 1e-05, the default is 1e-06"]
    assert planted("lr", comment="policy learning rate (SP3O: 2e-6)") == [
        "lr: the comment says '(SP3O: 2e-6)', the default is 1e-06"]
    assert planted("lr", row=(1e-6, "verl: 1e-6")) == [
        "lr: the comment names SP3O/SPO, the table's row 'verl: 1e-6'"]
    assert planted("epochs", comment="passes over each rollout") == [
        "epochs: the comment names no source, so the row must say ours: "
        "'SP3O: each rollout is trained on once, in its 2 steps'"]
    assert planted("kl_coef", comment="beta (published: 0.04)") == [
        "kl_coef: its comment says published without naming whose: 'beta (published: 0.04)'",
        "kl_coef: the comment names no source, so the row must say ours: "
        "'SP3O: `--kl-loss-coef 0.0 --kl-coef 0.0`; DeepSeekMath: 0.04'"]
    assert planted("adam_betas", row=((0.9, 0.999), table["adam_betas"][1])) == [
        "adam_betas: the table says (0.9, 0.999), the default is (0.9, 0.98)"]
    assert planted("clip_high", drop=True) == ["clip_high: no row in the table"]
    assert planted("lr", extra="critic_lr") == ["critic_lr: a row for a knob the file does not have"]
    assert planted("truncated_is", row=("auto", "SP3O: `--use-tis`")) == [
        "truncated_is: the comment names no source, so the row must say ours: 'SP3O: `--use-tis`'"]
