"""The command line of every trainer (discovered: infra.cli.trainers): --help in two groups with one default per
flag, and a bad value of any flag refused in one line, exit code 2, before any run folder or model exists.

The bad values come from each field's type (a word for a number, -1 and nan for a number, a value outside a
Literal's choices, a value after a switch, a short pair), from infra.checks' own tables of sizes, rates and fractions,
and, for flags whose bad value depends on their meaning (paths, names, devices), from SPECIAL: a flag added later
with a type the generic rules do not cover fails here until it gets a case. The walk calls each trainer's own
main() in-process under infra.run.run_main, as `python <trainer>.py ...` does, with common.load_model replaced by a
sentinel that fails the case if reached; a few real subprocesses check that the command line behaves the same."""
import dataclasses
import importlib
import importlib.util
import math
import os
import subprocess
import sys
import typing

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import infra.checks  # noqa: E402
import infra.cli  # noqa: E402
import infra.run  # noqa: E402
import infra.threads  # noqa: E402

TRAINERS = infra.cli.trainers()
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "slime_format.jsonl")
NOT_A_FOLDER = os.path.join(ROOT, "LICENSE")  # a file where a folder is expected


def _no_gpu_device():
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


# flag -> argv lists, each a bad use of that flag (other flags may come with it)
SPECIAL = {
    "model": [["--model", "/nonexistent/model"], ["--model", "nonsense"], ["--model", NOT_A_FOLDER]],
    "critic_model": [["--critic-model", "/nonexistent/critic"], ["--critic-model", "nonsense"]],
    "dataset": [["--dataset", "/nonexistent/train.jsonl"], ["--dataset", "builtin:x"]],
    "eval_datasets": [["--eval-datasets", "/nonexistent/test.jsonl"], ["--eval-datasets", "builtin:x"],
                      ["--eval-datasets", "--eval-only"]],  # none given: no evaluation, nothing to --eval-only
    "question_field": [["--dataset", FIXTURE, "--question-field", "no.such.field"]],
    "answer_field": [["--dataset", FIXTURE, "--answer-field", "no.such.field"]],
    "resume": [["--resume", "/nonexistent/run"]],
    "run_name": [["--run-name", "/"], ["--run-name", "a/b"], ["--run-name", ".."]],
    "output_dir": [["--output-dir", os.path.join(NOT_A_FOLDER, "runs")], ["--output-dir", NOT_A_FOLDER]],
    "device": [["--device", "nonsense"], ["--device", "mps"], ["--device", _no_gpu_device()]],
    "seed": [["--seed", str(2 ** 32)]],
    "steps": [["--steps", "0"]],
    "adam_betas": [["--adam-betas", "0.9"], ["--adam-betas", "0.9", "1.0"]],
    "anchor_ratios": [["--anchor-ratios", "1.5"], ["--anchor-ratios"]],
    # optional packages: a bad use only where the package is missing (not installed in this project's venv)
    "tensorboard": [["--tensorboard"]] if importlib.util.find_spec("tensorboard") is None else [],
    "wandb_project": [["--wandb-project", "x"]] if importlib.util.find_spec("wandb") is None else [],
}
NO_SPECIAL_NEEDED = {str}  # a str flag needs its SPECIAL entry (its meaning decides what is bad)


def _out_of(interval):
    """A value outside a FRACTIONS interval such as '(0, 1]' or '[0, 1)'."""
    return ["0"] if interval[0] == "(" else ["1.5"] if interval[-1] == "]" else ["1"]


def bad_values(field):
    """The argv lists that misuse `field`'s flag: by type, by infra.cli's range tables, and SPECIAL."""
    flag, kind = infra.checks.flag_name(field.name), field.type
    origin, members = typing.get_origin(kind), typing.get_args(kind)
    cases = [list(case) for case in SPECIAL.get(field.name, [])]
    if kind is bool:
        cases += [[f"{flag}=maybe"], [flag, "maybe"]]
    elif origin is typing.Literal:
        cases += [[flag, "nonsense"], [flag, members[0].upper()]]
    elif kind in (int, float):
        cases += [[flag, "x"], [flag, "-1"]] + ([[flag, "1.5"]] if kind is int else [[flag, "nan"], [flag, "inf"]])
    elif origin is tuple and members[0] in (int, float):
        width = 1 if members[-1] is Ellipsis else len(members)
        cases += [[flag, *["x"] * width], [flag, *["-1"] * width], [flag, *["nan"] * width]]
    elif kind is str or origin is tuple and members[0] is str:
        if field.name not in SPECIAL:
            raise LookupError(f"{flag} ({kind}) has no bad value: add it to SPECIAL in tests/test_cli.py")
    else:
        raise LookupError(f"{flag}: no bad values for its type {kind}; add a rule to bad_values")
    if field.name in infra.checks.POSITIVE_SIZES or field.name in infra.checks.POSITIVE_NUMBERS:
        cases.append([flag, "0"])
    if field.name in infra.checks.FRACTIONS:
        width = len(members) if origin is tuple else 1
        cases.append([flag, *_out_of(infra.checks.FRACTIONS[field.name]) * width])
    return cases


class ModelLoaded(Exception):
    """common.load_model was reached: the bad value got through every check."""


def refusal(trainer, argv, tmp_path, monkeypatch, capsys):
    """(exit code, stderr, what else happened) of `python <trainer>.py <argv>`, run in-process in tmp_path."""
    module = importlib.import_module(trainer)
    work = tmp_path / "work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *argv])

    def load_model(*args, **kwargs):
        raise ModelLoaded()
    monkeypatch.setattr(common, "load_model", load_model)
    capsys.readouterr()
    try:
        infra.run.run_main(module.main)
        code, problem = 0, "it ran"
    except SystemExit as exit_:
        code, problem = exit_.code, None
    except ModelLoaded:
        code, problem = None, "a model loaded"
    except Exception as error:  # a traceback
        code, problem = None, f"{type(error).__name__}: {error}"
    err = capsys.readouterr().err
    left = os.listdir(work)
    monkeypatch.undo()
    for entry in left:
        problem = problem or f"it left {entry} in the working folder"
    return code, err, problem


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_flag_refuses_a_bad_value_in_one_line(trainer, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(trainer)
    failures, cases = [], 0
    for number, field in enumerate(dataclasses.fields(module.Args)):
        try:
            argvs = bad_values(field)
        except LookupError as error:
            failures.append(str(error))
            continue
        for index, argv in enumerate(argvs):
            cases += 1
            code, err, problem = refusal(trainer, argv, tmp_path / f"{number}_{index}", monkeypatch, capsys)
            lines = err.strip().splitlines()
            if problem or code != 2 or len(lines) != 1 or not lines[0].startswith(f"{trainer}.py: error: "):
                failures.append(f"{' '.join(argv)}: exit {code}, {problem or ''} stderr {err.strip()[-300:]!r}")
    assert not failures, f"{trainer}.py, {len(failures)} of {cases} bad values:\n" + "\n".join(failures)
    assert cases >= 2 * len(dataclasses.fields(module.Args)) - 10


def test_every_field_type_has_bad_values_and_an_unknown_one_fails():
    for trainer in TRAINERS:
        for field in dataclasses.fields(importlib.import_module(trainer).Args):
            assert bad_values(field), f"{trainer}.py --{field.name}"
    new_path = dataclasses.make_dataclass("New", [("template_path", str, dataclasses.field(default=""))])
    with pytest.raises(LookupError, match="--template-path .* has no bad value: add it to SPECIAL"):
        bad_values(dataclasses.fields(new_path)[0])


def test_a_wrong_choice_lists_the_choices(tmp_path, monkeypatch, capsys):
    code, err, problem = refusal("ppo", ["--aggregation", "token_mean"], tmp_path, monkeypatch, capsys)
    assert (code, problem) == (2, None)
    assert err == ("ppo.py: error: invalid choice 'token_mean' for argument '--aggregation'. Expected one of "
                   "('token-mean', 'seq-mean', 'sum-max-len'). (see --help)\n")


@pytest.mark.parametrize("argv, unknown", [
    (["--critc-lr", "1e-5"], "--critc-lr (did you mean --critic-lr?)"),  # tyro alone: `--critc-lr, 1e-5`
    (["--critc-lr=1e-5", "--steps", "2"], "--critc-lr (did you mean --critic-lr?)"),
    (["--mini_batchs", "4", "--lr-x", "3e-6"],
     "--mini_batchs (did you mean --mini-batches?), --lr-x (did you mean --lr?)"),
    (["--whiten-advantage"], "--whiten-advantage (did you mean --whiten-advantages?)"),
    (["--no-such-flag", "1"], "--no-such-flag")])  # nothing near it: no suggestion
def test_an_unknown_flag_is_named_alone_with_the_nearest_known_one(argv, unknown, tmp_path, monkeypatch, capsys):
    code, err, problem = refusal("ppo", argv, tmp_path, monkeypatch, capsys)
    assert (code, problem) == (2, None)
    assert err == f"ppo.py: error: Unrecognized options: {unknown} (see --help)\n"


def test_a_stray_value_is_still_named():
    # no unknown flag in argv: tyro's own message stays (here a value after a switch)
    message = infra.checks.parse_error("Unrecognized options: False", ["--gradient-checkpointing", "False"],
                                       dataclasses.fields(infra.cli.RunArgs))
    assert message == "Unrecognized options: False"


@pytest.mark.parametrize("trainer, argv, unknown", [
    ("grpo", ["--learning-rate", "1e-5"], "--learning-rate (did you mean --lr?)"),  # no letters in common with --lr
    ("ppo", ["--num-generations", "4"], "--num-generations (did you mean --samples-per-prompt?)"),  # TRL's name
    ("grpo", ["--critic-warmup", "0"], "--critic-warmup (grpo.py has no critic: --critic-warmup is a flag of ppo.py, "
                                       "sp3o.py, sppo.py, tppo.py, vapo.py)"),
    ("spo", ["--critic-lr", "1e-5"], "--critic-lr (spo.py has no critic: --critic-lr is a flag of ppo.py, sp3o.py, "
                                     "sppo.py, tppo.py, vapo.py)"),
    ("ppo", ["--advantage-scale", "none"], "--advantage-scale (ppo.py has no such knob: --advantage-scale is a flag "
                                           "of grpo.py)")])
def test_an_unknown_flag_names_the_flag_meant_or_the_trainers_that_have_it(trainer, argv, unknown, tmp_path,
                                                                            monkeypatch, capsys):
    """Issue 60: a flag of another framework gets ours, a knob of another trainer the files that have it (the
    critic's knobs: that this file has no critic), instead of a bare "Unrecognized options"."""
    code, err, problem = refusal(trainer, argv, tmp_path, monkeypatch, capsys)
    assert (code, problem) == (2, None)
    assert err == f"{trainer}.py: error: Unrecognized options: {unknown} (see --help)\n"


@pytest.mark.parametrize("cores, busy, env, flag, threads", [
    (2, 0.0, {}, 0, 2), (2, 0.3, {}, 0, 2), (2, 0.31, {}, 0, 1),  # a core is free while at most 0.3 busy
    (2, 1.0, {}, 0, 1), (2, 4.7, {}, 0, 1), (16, 0.1, {}, 0, 16), (16, 4.2, {}, 0, 12),  # at least 1, at most cores
    (2, 4.7, {"OMP_NUM_THREADS": "2"}, 0, 2), (2, 0.0, {"OMP_NUM_THREADS": "1"}, 0, 1),  # the variable wins
    (2, 0.0, {"OMP_NUM_THREADS": "3,1"}, 0, 3),  # a list: its first level
    (2, 1.5, {"OMP_NUM_THREADS": ""}, 0, 1), (2, 0.0, {"OMP_NUM_THREADS": "0"}, 0, 2),  # none: auto
    (2, 0.0, {"OMP_NUM_THREADS": "x"}, 0, 2),
    (2, 0.0, {"OMP_NUM_THREADS": "1"}, 4, 4), (2, 4.7, {}, 2, 2)])  # --threads wins over both
def test_the_thread_count_is_the_free_cores_unless_the_flag_or_omp_num_threads_says(cores, busy, env, flag, threads):
    """Issue 60: torch's default (a thread per core) took 2,353 s for the demo beside other work, one thread 84 s.
    The rule: --threads, else OMP_NUM_THREADS, else one thread per core that other work leaves free, at least 1."""
    chosen, why = infra.threads.choose(cores, busy, env, flag)
    decided = not why.startswith("auto")  # the flag or the variable (the line below pins which)
    assert infra.threads.choose(cores, busy, env, flag, cap=1)[0] == (threads if decided else 1)  # a quota: auto
    assert chosen == threads
    assert why == (f"--threads {flag}" if flag else f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
                   if infra.threads.omp_threads(env) else f"auto: {cores} cores here, {busy:.1f} busy with other work")


def test_the_usable_cores_follow_the_affinity_the_ranks_the_quota_and_torchs_default(monkeypatch):
    """(cores, cap): the cores to count free ones on, and the most threads a run may take."""
    files = {}

    def read(path):
        if path not in files:
            raise OSError(path)
        return __import__("io").StringIO(files[path])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(infra.threads, "open", read, raising=False)  # no cgroup files: no quota
    assert infra.threads.usable_cores(torch_default=16) == (8, 8)  # taskset / cpuset: 8 of the machine's cores
    assert infra.threads.usable_cores(torch_default=4) == (8, 4)  # never more than torch's own default
    files["/sys/fs/cgroup/cpu.max"] = "250000 100000\n"  # a container's --cpus 2.5
    assert infra.threads.usable_cores(torch_default=16) == (8, 3)
    files["/sys/fs/cgroup/cpu.max"] = "max 100000\n"
    assert infra.threads.usable_cores(torch_default=16) == (8, 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: 4 ranks on this machine share them
    assert infra.threads.usable_cores(torch_default=16) == (2, 2)
    # a quota of 3 cores on 8 of which 5 are busy: the 3 still free; 7 busy: 1
    assert infra.threads.choose(8, 5.0, {}, cap=3)[0] == 3 and infra.threads.choose(8, 7.0, {}, cap=3)[0] == 1


def test_busy_cores_are_other_processes_cpu_time_on_this_processs_cpus(monkeypatch):
    """From two /proc/stat readings: the busy ticks (all but idle and iowait) of the CPUs this process may use, as
    cores, less this process's own CPU time (its threads must not count as other work)."""
    stats = iter([  # user nice system idle iowait irq softirq steal, per CPU; cpu2 is not this process's
        "cpu  0 0 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0\ncpu1 100 0 0 100 0 0 0 0\ncpu2 0 0 0 9 0 0 0 0\n",
        "cpu  0 0 0 0 0 0 0 0\ncpu0 130 0 10 105 5 0 0 0\ncpu1 105 0 0 140 0 0 0 5\ncpu2 0 0 0 999 0 0 0 0\n"])
    times, clock = iter([0.0, 0.2]), iter([10.0, 10.5])  # 0.2 s of this process's CPU time over 0.5 s
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(infra.threads, "open", lambda path: __import__("io").StringIO(next(stats)), raising=False)
    monkeypatch.setattr(os, "times", lambda: type("T", (), {"user": next(times), "system": 0.0})())
    monkeypatch.setattr(infra.threads.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(infra.threads.time, "sleep", lambda seconds: None)
    # busy ticks: cpu0 40 (user 30, system 10) of 50, cpu1 10 (user 5, steal 5) of 50: half of 2 cores, 1.0 core;
    # less this process's 0.2 s / 0.5 s = 0.4 core
    assert infra.threads.busy_cores() == pytest.approx(0.6)


def test_a_run_says_its_thread_choice_in_its_first_line(monkeypatch, capsys, tmp_path):
    import grpo
    threads = torch.get_num_threads()
    monkeypatch.setattr(infra.threads, "busy_cores", lambda seconds=0: 1.4)  # another process on one of 2 cores
    monkeypatch.setattr(infra.threads, "usable_cores", lambda default: (2, 2))
    try:
        for argv, env, first in (
                ([], "1", "torch threads: 1 (OMP_NUM_THREADS=1)"),
                (["--threads", "2"], "1", "torch threads: 2 (--threads 2)"),
                ([], None, "torch threads: 1 (auto: 2 cores here, 1.4 busy with other work; --threads N or "
                           "OMP_NUM_THREADS=N to set)")):
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS")
            args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, [*argv, "--output-dir", str(tmp_path)])
            capsys.readouterr()
            infra.run.Run(args, os.path.join(ROOT, "grpo.py"))
            assert capsys.readouterr().out.splitlines()[0] == first
            assert torch.get_num_threads() == int(first.split()[2])
    finally:
        torch.set_num_threads(threads)


# the in-process walk matches the command line: the same line and exit code from a real process
@pytest.mark.parametrize("trainer, argv", [
    ("ppo", ["--dtype", "fp16"]), ("ppo", ["--adam-betas", "0.9"]), ("grpo", ["--device", _no_gpu_device()]),
    ("sp3o", ["--aggregation", "token_mean"]), ("spo", ["--dataset", "/nonexistent/train.jsonl"]),
    ("tppo", ["--seed", "-1"])])
def test_the_command_line_refuses_as_the_in_process_walk(trainer, argv, tmp_path, monkeypatch, capsys):
    result = subprocess.run([sys.executable, os.path.join(ROOT, f"{trainer}.py"), *argv], cwd=tmp_path,
                            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    code, err, problem = refusal(trainer, argv, tmp_path, monkeypatch, capsys)
    assert (result.returncode, result.stderr) == (code, err) == (2, err) and problem is None
    assert len(err.splitlines()) == 1 and os.listdir(tmp_path) == ["work"]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_help_shows_the_methods_knobs_first_then_the_run_flags_with_one_default_each(trainer, capsys):
    module = importlib.import_module(trainer)
    with pytest.raises(SystemExit):
        infra.cli.parse_args(module.Args, module.TINY_PRESET, ["--help"])
    text = capsys.readouterr().out
    knobs, run = text.index(f"{trainer} options"), text.index("run options")
    own = [f for f in dataclasses.fields(module.Args) if f.name not in {g.name for g in
                                                                         dataclasses.fields(infra.cli.RunArgs)}]
    assert knobs < text.index(infra.checks.flag_name(own[0].name) + " ") < run < text.index("--model STR")
    flat = " ".join(line.strip("│ ") for line in text.splitlines())
    assert flat.count("(default:") == len(dataclasses.fields(module.Args))  # one default per flag
    assert "(default: cuda when available, else cpu) --dtype" in " ".join(flat.split())  # the comment's, alone
    assert max(map(len, text.splitlines())) <= 120  # the method's docstring wrapped too


def test_help_shows_the_values_in_effect_and_each_fields_whole_comment(capsys):
    import ppo
    for argv, lr, warmup in (([], "3e-05", 5), (["--model", "Qwen3-4B-Base"], "1e-06", 20), (["--preset", "smollm2"],
                             "2e-05", 2), (["--preset=smollm2", "--model", "tiny"], "2e-05", 2)):
        with pytest.raises(SystemExit):
            infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, [*argv, "--help"], smollm2_preset=ppo.SMOLLM2_PRESET)
        flat = " ".join(" ".join(line.strip("│ ") for line in capsys.readouterr().out.splitlines()).split())
        assert f"policy learning rate (SP3O/TPPO/SPPO: 1e-6) (default: {lr})" in flat
        assert f"the actor waits (SP3O: 20; verl: 0) (default: {warmup})" in flat
    assert infra.cli.field_help(ppo.Args, "aggregation").startswith("actor and critic loss (SP3O: seq-mean;")


def test_each_field_has_one_help_comment():
    # The help is the comment at the end of the field's line, else the comment lines right above it: a field with
    # both would show only the first, and the reader's explanation above it would be lost (--aggregation once read
    # "actor, critic (verl: token-mean)").
    for trainer in TRAINERS:
        args_class = importlib.import_module(trainer).Args
        for name, (above, inline) in infra.cli.field_comments(args_class).items():
            assert bool(above) != bool(inline), f"{trainer}.py --{name}: above {above!r}, inline {inline!r}"


def test_resumed_settings_are_the_defaults_and_the_pair_stays_a_pair(tmp_path):
    import ppo
    run = tmp_path / "run"
    run.mkdir()
    settings = dataclasses.asdict(infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, ["--adam-betas", "0.8", "0.9"]))
    (run / "config.json").write_text(__import__("json").dumps(settings))
    args = infra.cli.parse_args(ppo.Args, ppo.TINY_PRESET, ["--resume", str(run)])
    assert args.adam_betas == (0.8, 0.9) and args.lr == 3e-5 and args.steps == 30
    assert math.isclose(args.critic_lr, 5e-4)


def test_a_real_models_data_defaults_are_its_methods_and_another_dataset_keeps_none_of_them():
    # Issue 46: a real model trains on its method's published set and evaluates on the paper's held-out sets, each
    # from the file's Args; a --dataset of one's own takes neither the method's reward rule nor its held-out sets
    # (RunArgs' auto and none, unless given); the tiny demo keeps its built-in task
    import sp3o
    import spo

    def parse(module, argv):
        args = infra.cli.parse_args(module.Args, module.TINY_PRESET, argv)
        return args.dataset, args.answer_format, args.eval_datasets
    six = ("HuggingFaceH4/aime_2024", "MathArena/aime_2025", "MathArena/aime_2026", "math-ai/amc23",
           "HuggingFaceH4/MATH-500", "math-ai/minervamath")
    real = ["--model", "Qwen3-4B-Base"]
    assert parse(sp3o, real) == ("zhuzilin/dapo-math-17k", "boxed", six)
    assert parse(spo, real) == ("openai/gsm8k:main", "boxed", ("openai/gsm8k:main",))
    assert parse(sp3o, [*real, "--dataset", "mine.jsonl"]) == ("mine.jsonl", "auto", ())
    assert parse(sp3o, [*real, "--dataset=mine.jsonl", "--answer_format", "boxed", "--eval-datasets", "a.jsonl"]) == (
        "mine.jsonl", "boxed", ("a.jsonl",))
    assert parse(sp3o, [*real, "--dataset", "zhuzilin/dapo-math-17k"]) == ("zhuzilin/dapo-math-17k", "boxed", six)
    assert parse(sp3o, []) == ("builtin", "auto", ("builtin",))  # the demo
    assert parse(sp3o, ["--dataset", "mine.jsonl"]) == ("mine.jsonl", "auto", ("builtin",))
    # --help: the method's choice and its source, then what the flag takes (RunArgs' description)
    assert infra.cli.field_help(sp3o.Args, "dataset").startswith(
        "training set (SP3O: zhuzilin/dapo-math-17k; slime's DAPO-Math-17k). training problems: `builtin` (")
    assert infra.cli.field_help(sp3o.Args, "model") == infra.cli.field_help(infra.cli.RunArgs, "model")
