"""benchmarks/gpu_check.sh (the GPU check; it has not run on a GPU): its assertions on planted figures, the flags it
gives each trainer, the ratio it observes, its memory comparison, the wheels it carries to an offline machine, and
(slow) the whole check scaled down on CPU."""
import glob
import json
import math
import os
import re
import subprocess
import sys
import zipfile

import pytest

import infra.cli
import infra.memory as memory
from benchmarks import gpu_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# requirements.txt's packages that the lent GPU machines already hold (the device tool's package list), and the
# preinstalled packages the carried wheels need
ON_THE_GPU_MACHINE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "pyarrow", "matplotlib",
                      "tensorboard", "pytest", "sympy", "typing-extensions", "cloudpickle"}


def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins():
    """The name==version list of benchmarks/gpu_wheels.sh."""
    text = open(os.path.join(REPO, "benchmarks", "gpu_wheels.sh")).read()
    block = text.split("WHEELS=(", 1)[1].split("\n)", 1)[0]
    return re.findall(r"([A-Za-z0-9_.-]+)==([\w.]+)", block)


def test_the_wheels_cover_what_the_gpu_machine_lacks():
    """Every package of requirements.txt is on the GPU machine or among the wheels, each pinned once, and inside
    requirements.txt's range where it names one (tyro>=1.0,<2)."""
    requirements = [re.match(r"[A-Za-z0-9_.-]+", line).group() for line in open(os.path.join(REPO, "requirements.txt"))
                    if line.strip() and not line.startswith("#")]
    pins = dict((normalized(name), version) for name, version in wheel_pins())
    assert len(pins) == len(wheel_pins()) >= 3
    missing = [r for r in requirements if normalized(r) not in ON_THE_GPU_MACHINE | set(pins)]
    assert not missing, f"neither on the GPU machine nor among benchmarks/gpu_wheels.sh's wheels: {missing}"
    assert pins["tyro"].startswith("1.") and {"math-verify", "gymnasium"} <= set(pins)


def test_the_wheel_folder_is_pure_python_and_complete():
    """The folder gpu_wheels.sh made (skipped where it was not made): one py3-none-any wheel per pin, at its version,
    each of their requirements (for Python 3.12, extras aside) on the GPU machine or among the wheels, under 64 MiB."""
    folder = os.path.join(REPO, ".gpu-wheels")
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        pytest.skip("no .gpu-wheels folder: bash benchmarks/gpu_wheels.sh makes it (PyPI)")
    found = {(normalized(os.path.basename(w).split("-")[0]), os.path.basename(w).split("-")[1]) for w in wheels}
    assert found == {(normalized(name), version) for name, version in wheel_pins()} and len(wheels) == len(found)
    names = {name for name, _ in found}
    assert all(w.endswith("-py3-none-any.whl") for w in wheels)
    assert sum(os.path.getsize(w) for w in wheels) < 64 * 2 ** 20
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for line in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M):
            requirement, _, marker = line.partition(";")
            if "extra" in marker or re.search(r"python_version\s*<\s*['\"]3\.(\d|1[01])['\"]", marker):
                continue
            name = normalized(re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group())
            assert name in ON_THE_GPU_MACHINE | names, f"{os.path.basename(wheel)} needs {name}, not carried"


@pytest.mark.parametrize("trainer", gpu_check.TRAINERS)
def test_the_check_flags_parse_for_every_trainer(trainer, tmp_path):
    """bf16 on the tiny model with the HF engine, 3 steps, the actor trained from step 0, checkpoints only at the
    end; 512 samples a step (the tiny preset's), on CPU 128 (at ~7% correct, a step of 64 once scored 0)."""
    module = __import__(trainer)
    for device in ("cuda", "cpu"):
        args = infra.cli.parse_args(module.Args, module.TINY_PRESET,
                                    argv=gpu_check.trainer_flags(trainer, device, str(tmp_path)))
        module.check_args(args)
        assert (args.device, args.dtype, args.generator, args.steps, args.model) == (device, "bfloat16", "hf", 3,
                                                                                     "tiny")
        assert getattr(args, "critic_warmup", 0) == 0 and args.save_every == 0
        assert args.prompts_per_step * args.samples_per_prompt == (512 if device == "cuda" else 128)
    args = infra.cli.parse_args(module.Args, module.TINY_PRESET, argv=gpu_check.COMPARE_FLAGS) if trainer == "ppo" \
        else None
    assert args is None or (args.dtype, args.samples_per_prompt, args.old_logprobs) == ("float32", 1, "recompute")


def record(step, **changes):
    figures = dict(step=step, reward=0.06, grad_norm=0.1, policy_loss=0.01, approx_kl=1e-5, skipped_updates=0.0,
                   logprob_gap_mean=2e-4, logprob_gap_max=0.09)
    return {**figures, **changes}


def test_trainer_problems_catch_each_planted_defect():
    ratios = {str(step): dict(max_dev=0.0, mean_dev=0.0, tokens=500, calls=2) for step in range(3)}
    good = [record(step) for step in range(3)]
    assert gpu_check.trainer_problems(good, ratios) == []
    planted = {
        "every reward 0": dict(reward=0.0), "grad_norm 0.0": dict(grad_norm=0.0),
        "not finite: policy_loss": dict(policy_loss=math.nan), "not finite: value_loss": dict(value_loss=math.inf),
        "skipped updates": dict(skipped_updates=0.5), "a frozen actor": dict(actor_frozen=True),
        "logprob_gap_mean 0.005 > 0.0039": dict(logprob_gap_mean=0.005),
        "logprob_gap_max 0.6 > 0.5": dict(logprob_gap_max=0.6)}
    for message, change in planted.items():
        problems = gpu_check.trainer_problems([good[0], record(1, **change), good[2]], ratios)
        assert len(problems) == 1 and problems[0].startswith("step 1: ") and message in problems[0], problems
    over = {**ratios, "2": dict(max_dev=0.011, mean_dev=1e-3, tokens=500, calls=2)}
    assert gpu_check.trainer_problems(good, over) == ["step 2: first mini-batch max |ratio - 1| 1.10e-02 > 0.01"]
    assert gpu_check.trainer_problems(good, {"0": ratios["0"]}) == ["step 1: no first mini-batch observed",
                                                                    "step 2: no first mini-batch observed"]
    assert gpu_check.trainer_problems(good[:2], ratios) == ["2 of 3 steps logged"]


def test_relative_difference_ignores_timing_and_evaluations_only():
    a = [record(0, rollout_s=1.0, **{"eval/accuracy": 0.1}), record(1)]
    b = [record(0, rollout_s=9.0), record(1, **{"eval/accuracy": 0.2})]  # a resumed run evaluates at its start
    assert gpu_check.relative_difference(a, b) == 0.0
    larger = record(1, grad_norm=0.1 * (1 + 1e-3))  # relative to the larger of the two: 1e-3 / 1.001
    assert gpu_check.relative_difference(a, [b[0], larger]) == pytest.approx(1e-3 / 1.001, rel=1e-9)
    assert gpu_check.relative_difference(a, b[:1]) == math.inf  # a step missing
    assert gpu_check.relative_difference(a, [b[0], record(1, value_loss=0.2)]) == math.inf  # a figure missing


def test_the_gpu_memory_comparison_is_the_plan_less_the_cuda_context():
    """On a GPU the measured peak is torch.cuda.max_memory_allocated, which does not see the CUDA context: the plan
    compared is infra.memory.plan's update column less its overhead row (1 GiB), nothing else removed; on CPU the
    whole column (the process's resident peak includes everything)."""
    config = gpu_check.update_config(28, {})
    for method in ("grpo", "ppo"):
        for response in (4096, 8192):
            gpu, cpu = (gpu_check.planned_update(method, config, response, device) for device in ("cuda", "cpu"))
            assert "overhead" not in gpu and "overhead" in cpu and set(cpu) - set(gpu) == {"overhead"}
            shape = memory.Shape(1024, 28, 16, 8, 128, 3072, 151936, True)
            models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
            sequence = memory.PROMPT_TOKENS + response
            whole = {name: update for name, _, update, _, _ in memory.plan(memory.Setup(
                models, tokens=sequence, sequence=sequence, engine="hf", rows=1))}
            assert gpu == {name: update for name, update in whole.items() if name != "overhead"}
            assert whole["overhead"] == memory.GIB  # the CUDA context and workspaces (assumed)
            assert gpu["weights"] == 4 * sum(s.parameters(h) for _, s, h, _ in models)  # float32, no shard


def test_observe_records_the_ratio_of_the_first_mini_batch_only(tmp_path):
    """A 1-step GRPO run through `observe` whose old log-probs are the engine's (--old-logprobs engine: HF generate's
    own numbers, one token at a time on its KV cache, in float32): the ratio it records over the first of 2
    mini-batches is off 1 by the float noise between the engine's and the trainer's forward (the run's own
    logprob_gap is then 0: it compares the engine with itself), over fewer tokens than the rollout holds."""
    report = tmp_path / "ratios.json"
    flags = ["--device", "cpu", "--steps", "1", "--prompts-per-step", "4", "--eval-problems", "2", "--old-logprobs",
             "engine", "--output-dir", str(tmp_path), "--run-name", "observed"]
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "observe", "grpo", str(report), "--", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    ratios = json.loads(report.read_text())
    (first,) = gpu_check.metrics(str(tmp_path / "observed"))
    assert list(ratios) == ["0"] and ratios["0"]["calls"] == 1  # 16 samples per mini-batch: one micro-batch of 16
    assert 0 < ratios["0"]["tokens"] < first["response_length"] * 32  # of 4 prompts x 8 samples
    assert first["logprob_gap_max"] == 0 and 0 < ratios["0"]["mean_dev"] <= ratios["0"]["max_dev"] < 1e-4


def test_the_trainers_command_lists_every_trainer():
    printed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "trainers"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert printed == gpu_check.TRAINERS and {"ppo", "grpo", "sppo", "sp3o", "tppo", "spo"} <= set(printed)
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=REPO).returncode == 0  # its syntax
    assert subprocess.run(["bash", "benchmarks/gpu_check.sh", "--no-such-flag"], cwd=REPO,
                          capture_output=True).returncode == 2


@pytest.mark.slow
def test_the_check_scaled_down_on_cpu_passes(tmp_path):
    """`bash benchmarks/gpu_check.sh --device cpu` exits 0 and prints its table, every row ok; with the wheel folder
    present (gpu_wheels.sh), from wheels installed the way the GPU machine installs them (--force-wheels)."""
    out = tmp_path / "out"
    force = ["--force-wheels"] * bool(glob.glob(os.path.join(REPO, ".gpu-wheels", "*.whl")))
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--out", str(out), *force],
                          cwd=REPO, capture_output=True, text=True, timeout=1900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    table = (out / "gpu_check.md").read_text()
    assert table.strip() in done.stdout and "every check passed" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| trainer")
            and not line.startswith("| check")]
    assert len(rows) == len(gpu_check.TRAINERS) + 2 + 4 + 1 and all(row.rstrip().endswith("| ok |") for row in rows)
    if force:
        assert "installed 8 wheels" in done.stdout and "/tmp" in done.stdout.split("tyro 1.0.17 from", 1)[1][:40]
    results = json.loads((out / "gpu_check.json").read_text())
    assert all(results[t]["records"][-1]["step"] == 2 for t in gpu_check.TRAINERS)
