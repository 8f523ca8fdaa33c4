"""benchmarks/gpu_check.sh (the GPU check; it has not run on a GPU): its assertions on planted figures, the flags it
gives each trainer, the ratio it observes, its memory comparison, the wheels it carries to an offline machine, and
(slow) the whole check scaled down on CPU."""
import dataclasses
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
from benchmarks import gpu_check, gpu_check_runs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# requirements.txt's packages that the lent GPU machines already hold (the device tool's package list), and the
# preinstalled packages the carried wheels need
ON_THE_GPU_MACHINE = {"torch", "transformers", "tokenizers", "safetensors", "numpy", "tqdm", "pyarrow", "matplotlib",
                      "tensorboard", "pytest", "sympy", "typing-extensions", "cloudpickle"}
# requirements the check does not use and the offline machine could not use: `datasets` fetches hub dataset ids
# (infra/hub.py imports it only then); the check runs the built-in task, and passed with `import datasets` failing
NOT_CARRIED = {"datasets"}


def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins():
    """The name==version list of benchmarks/gpu_wheels.sh."""
    text = open(os.path.join(REPO, "benchmarks", "gpu_wheels.sh")).read()
    block = text.split("WHEELS=(", 1)[1].split("\n)", 1)[0]
    return re.findall(r"([A-Za-z0-9_.-]+)==([\w.]+)", block)


def test_the_wheels_cover_what_the_gpu_machine_lacks():
    """Every package of requirements.txt is on the GPU machine or among the wheels (NOT_CARRIED aside), each pinned
    once, and inside requirements.txt's range where it names one (tyro>=1.0,<2)."""
    requirements = [re.match(r"[A-Za-z0-9_.-]+", line).group() for line in open(os.path.join(REPO, "requirements.txt"))
                    if line.strip() and not line.startswith("#")]
    pins = dict((normalized(name), version) for name, version in wheel_pins())
    assert len(pins) == len(wheel_pins()) >= 3
    missing = [r for r in requirements if normalized(r) not in ON_THE_GPU_MACHINE | NOT_CARRIED | set(pins)]
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


def test_the_carried_wheels_requirements_are_checked_against_the_machine(tmp_path):
    """gpu_check.sh, once the wheels are installed (`gpu_check_runs.py requirements SITE`, the folder first on
    PYTHONPATH as there): a requirement this Python's packages do not meet (a version too old, a package missing)
    stops the check in one line naming each; extras and other Pythons' markers aside; met: silent, exit 0."""
    import typing_extensions  # noqa: F401  (installed here: its version is what the line reports)
    from importlib import metadata

    def site(*requires):
        folder = tmp_path / f"site{len(list(tmp_path.iterdir()))}"
        info = folder / "carried-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: carried\nVersion: 1.0\n" + "".join(
            f"Requires-Dist: {line}\n" for line in requires))
        return subprocess.run([sys.executable, "benchmarks/gpu_check_runs.py", "requirements", str(folder)], cwd=REPO,
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(folder)))
    met = site("typing_extensions>=4.0", "sphinx>=99; extra == 'docs'", "nosuchpackage; python_version < '3.0'")
    assert met.returncode == 0 and met.stdout == met.stderr == ""
    unmet = site("typing_extensions>=99", "nosuch-package-57>=1", "numpy")
    version = metadata.version("typing_extensions")
    assert unmet.returncode == 1 and unmet.stderr.strip().splitlines() == [
        f"gpu_check: the carried wheels need what this machine lacks: carried needs nosuch-package-57>=1 (not here); "
        f"carried needs typing_extensions>=99 ({version} here); carry those wheels too (benchmarks/gpu_wheels.sh's "
        f"WHEELS)"]
    text = open(os.path.join(REPO, "benchmarks", "gpu_check.sh")).read()
    assert 'gpu_check_runs.py requirements "$SITE" || exit 1' in text  # before the imports are tried


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


def statistics(**changes):
    return {**dict(mean=3e-4, q99=6e-3, max=0.3, clipped=0.0, tokens=4000), **changes}


def report(steps=3, direction=0.2, **changes):
    """observe's report of a correct bf16 run (a max of 0.3: bf16 noise at a rare token), changes to every step."""
    return {str(step): {**dict(ratio=statistics(), gap=statistics(), calls=2, direction=direction, change=2e-3,
                               token_change=3e-3, clip_binds=3, clip_leaks=0, padding_read=False,
                               nucleus=dict(tokens=0, explained=None)), **changes}
            for step in range(steps)}


def test_trainer_problems_catch_each_planted_defect():
    good, figures = [record(step) for step in range(3)], report()
    assert gpu_check.trainer_problems(good, figures) == []  # a max of 0.3 is not judged: a mean, a q99, a fraction
    planted = {
        "every reward 0": dict(reward=0.0), "grad_norm 0.0": dict(grad_norm=0.0),
        "not finite: policy_loss": dict(policy_loss=math.nan), "not finite: value_loss": dict(value_loss=math.inf),
        "skipped updates": dict(skipped_updates=0.5), "a frozen actor": dict(actor_frozen=True)}
    for message, change in planted.items():
        problems = gpu_check.trainer_problems([good[0], record(1, **change), good[2]], figures)
        assert len(problems) == 1 and problems[0].startswith("step 1: ") and message in problems[0], problems
    for key, value, shown in (("mean", 0.004, "mean 4.00e-03 > 0.0039"), ("q99", 0.051, "q99 5.10e-02 > 0.05"),
                              ("clipped", 0.0011, "clipped 1.10e-03 > 0.001")):
        for what in ("ratio", "gap"):
            bad = {**figures, "1": {**figures["1"], what: statistics(**{key: value}), "token_change": 1.0}}
            name = "|ratio - 1|" if what == "ratio" else "gap"
            assert gpu_check.trainer_problems(good, bad) == [f"step 1: {name} {shown}"]
    assert gpu_check.trainer_problems(good, {**figures, "2": {**figures["2"], "ratio": statistics(tokens=0)}}) == [
        "step 2: no first mini-batch observed"]
    assert gpu_check.trainer_problems(good, {k: figures[k] for k in "01"}) == [
        "step 2: no first mini-batch observed", "step 2: no log-prob gap observed"]
    assert gpu_check.trainer_problems(good[:2], figures) == ["2 of 3 steps logged"]


def test_trainer_problems_catch_the_gaps_issue_57_found():
    """A no-op update (its change 0: no direction, whatever the sign of noise), stale old log-probs (the first
    mini-batch's ratio as far off as the update moves a token), a top-p the engine's log-probs ignore (none of
    top-p's term in them), a policy loss that reads padding, a clip that leaves a gradient: each fails the run in a
    line of its own; the bounds' edges pass."""
    good, figures = [record(step) for step in range(3)], report()

    def problems(**changes):
        return gpu_check.trainer_problems(good, {**figures, "1": {**figures["1"], **changes}})
    assert problems() == [] and problems(ratio=statistics(mean=1.5e-3), token_change=3e-3) == []  # half exactly
    (line,) = problems(ratio=statistics(mean=2.9e-3), token_change=3e-3)
    assert line.startswith("step 1: stale old log-probs? the 1st mini-batch's mean |ratio - 1| 2.90e-03 is over 0.50")
    noop = report(direction=None, change=0.0, token_change=0.0)
    assert gpu_check.trainer_problems(good, noop) == [
        "no update direction measured (the update changed nothing)",
        "the update moved a sample's mean log-prob by 0.0e+00 on average, < 0.00025: an update that does nothing?"]
    small = gpu_check.trainer_problems(good, report(change=1e-4, token_change=1e-2))  # a sign by noise, no size
    assert small == ["the update moved a sample's mean log-prob by 1.0e-04 on average, < 0.00025: an update that "
                     "does nothing?"]
    assert problems(nucleus=dict(tokens=176, explained=0.76)) == [] and problems(  # 19 tokens: not judged
        nucleus=dict(tokens=19, explained=0.0)) == []
    (line,) = problems(nucleus=dict(tokens=123, explained=0.0))
    assert line == ("step 1: the engine's log-probs show 0.00 of top-p's term over 123 tokens (< 0.5): top-p ignored "
                    "by the recorded log-probs?")
    assert problems(padding_read=True) == ["step 1: the policy loss reads the padding its mask leaves out"]
    assert problems(clip_leaks=3) == ["step 1: 3 of 3 tokens where the clip binds still get a gradient"]


def test_the_harness_measures_clipping_padding_and_top_p_by_hand():
    """gpu_check_runs' helpers on hand-made numbers: the clip binds where r > 1 + 0.2 with A > 0 or r < 0.8 with
    A < 0 (and there the PPO loss has no gradient); a loss with its mask reads no padding, one without it does;
    top-p's term is -log of the nucleus's mass (0 at top-p 1)."""
    torch = pytest.importorskip("torch")
    import grpo
    from benchmarks.gpu_check_runs import clip_leaks, padding_read, processed_shift
    old = torch.zeros(1, 4)
    logprobs = torch.log(torch.tensor([[1.3, 0.7, 1.1, 1.3]])).requires_grad_()
    advantages, mask = torch.tensor([[1.0, -1.0, 1.0, -1.0]]), torch.ones(1, 4, dtype=torch.bool)
    counts = dict(num_sequences=1, num_tokens=4, max_length=4)
    loss = grpo.policy_loss(logprobs, old, advantages, mask, 0.2, 0.2, "token-mean", **counts)[0]
    assert clip_leaks(loss, logprobs, old, advantages, mask, 0.2, 0.2) == (2, 0)  # tokens 0 and 1 bind
    unclipped = grpo.policy_loss(logprobs, old, advantages, mask, 1e9, 1e9, "token-mean", **counts)[0]
    assert clip_leaks(unclipped, logprobs, old, advantages, mask, 0.2, 0.2) == (2, 2)
    half = torch.tensor([[True, True, False, False]])
    assert padding_read(grpo.policy_loss, logprobs, old, advantages, half, 0.2, 0.2, "token-mean", **counts) is False
    leaky = lambda lp, o, a, m, *rest, **kw: grpo.policy_loss(lp, o, a, torch.ones_like(m), *rest, **kw)  # noqa
    assert padding_read(leaky, logprobs, old, advantages, half, 0.2, 0.2, "token-mean", **counts) is True
    assert padding_read(grpo.policy_loss, logprobs, old, advantages, mask, 0.2, 0.2, "token-mean", **counts) is None

    class Fixed(torch.nn.Module):  # logits [0.6, 0.3, 0.1] after softmax, at every position
        def forward(self, **kwargs):
            logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(*kwargs["input_ids"].shape, 3)
            return dataclasses.make_dataclass("Out", ["logits"])(logits)
    import common
    batch = common.sequence_batch([[1, 2]], [[0, 1]], pad_id=0)
    shift = processed_shift(Fixed(), batch, 1.0, 0.8)  # nucleus {0, 1}: mass 0.9
    assert torch.allclose(shift, torch.full((1, 2), -math.log(0.9)))
    assert processed_shift(Fixed(), batch, 1.0, 1.0).abs().max() == 0


def test_the_update_direction_is_judged_over_the_run():
    """The mean over the steps of the direction must be > 0: one step below 0 passes when the run's mean is above
    (PPO's first step, its critic untrained, measured 0.06 and -0.02 with the sign right and wrong), a run whose
    mean is <= 0 fails, as does one where no step measured it (every reward equal)."""
    good = [record(step) for step in range(3)]
    mixed = {step: {**figures, "direction": value}
             for (step, figures), value in zip(report().items(), (-0.05, 0.1, 0.2))}
    assert gpu_check.trainer_problems(good, mixed) == []
    for direction in (0.0, -0.1):
        (problem,) = gpu_check.trainer_problems(good, report(direction=direction))
        assert problem.startswith(f"update direction {direction:+.3f} <= 0.0") and "sign" in problem
    assert gpu_check.trainer_problems(good, report(direction=None)) == ["no update direction measured"]


def test_deviation_statistics_and_correlation_by_hand():
    torch = pytest.importorskip("torch")
    from benchmarks.gpu_check_runs import correlation, deviation_statistics
    values = torch.tensor([0.0] * 98 + [0.1, 0.5])  # 100 tokens: q99 interpolates between 0.1 and 0.5 at 0.99 * 99
    figures = deviation_statistics(values)
    assert figures["tokens"] == 100 and figures["max"] == 0.5 and figures["clipped"] == 0.01
    assert figures["mean"] == pytest.approx(0.006) and figures["q99"] == pytest.approx(0.1 + 0.01 * 0.4)
    assert deviation_statistics(torch.zeros(0))["tokens"] == 0
    assert correlation(torch.tensor([0., 1, 0, 1]), torch.tensor([1., 3, 1, 3])) == pytest.approx(1.0)
    assert correlation(torch.tensor([0., 1, 0, 1]), torch.tensor([2., 1, 2, 1])) == pytest.approx(-1.0)
    assert correlation(torch.tensor([1., 1, 1]), torch.tensor([0., 1, 2])) is None  # every reward equal


def test_relative_difference_ignores_timing_and_evaluations_only():
    a = [record(0, rollout_s=1.0, **{"eval/accuracy": 0.1}), record(1)]
    b = [record(0, rollout_s=9.0), record(1, **{"eval/accuracy": 0.2})]  # a resumed run evaluates at its start
    assert gpu_check.relative_difference(a, b) == 0.0
    larger = record(1, grad_norm=0.1 * (1 + 1e-3))  # relative to the larger of the two: 1e-3 / 1.001
    assert gpu_check.relative_difference(a, [b[0], larger]) == pytest.approx(1e-3 / 1.001, rel=1e-9)
    assert gpu_check.relative_difference(a, b[:1]) == math.inf  # a step missing
    assert gpu_check.relative_difference(a, [b[0], record(1, value_loss=0.2)]) == math.inf  # a figure missing


def test_the_update_is_the_trainers_default_at_qwen3_4b_width():
    """The GPU's real-size update: Qwen3-4B's shape (hidden 2,560, 32/8 heads of 128, MLP 9,728, the full vocabulary,
    tied) with 4 layers, and a mini-batch that common.micro_batches packs at --micro-batch-tokens' default, 16,384:
    the 9,216-token sequence alone, then 4 x 4,096 twice; on CPU the same at 1/16 the tokens."""
    import common
    for device, layers, tokens in (("cuda", 4, 16384), ("cpu", 1, 1024)):
        spec = gpu_check.SCALES[device]["update"]
        assert spec["micro_batch_tokens"] == tokens and spec["layers"] == layers
        lengths = [(spec["prompt"], length) for length in gpu_check_runs.update_lengths(spec)]
        micro = common.micro_batches(list(range(len(lengths))), lengths, 1, tokens)
        widths = [(len(rows), max(sum(lengths[i]) for i in rows)) for rows in micro]
        assert widths == [(1, spec["prompt"] + spec["long_response"])] + [(4, tokens // 4)] * 2
    assert infra.cli.RunArgs().micro_batch_tokens == 16384 and infra.cli.RunArgs().gradient_checkpointing
    shape = gpu_check.model_shape(gpu_check.SCALES["cuda"]["update"])
    assert shape == memory.Shape(2560, 4, 32, 8, 128, 9728, 151936, True)
    assert dataclasses.replace(shape, layers=36) == memory.Shape(*memory.QWEN3["Qwen3-4B"])


def test_update_flops_by_hand():
    """bench_update.update_flops, the count behind the check's (and bench_update's) MFU, on models/tiny's shape
    (hidden 128, 2 layers, q 128, kv 64, MLP 512, vocabulary 100), 2 rows of 4 prompt + 6 response tokens: per layer
    and token 2 x 245,760 matmul FLOPs forward, the LM head 2 x 128 x 100 over 2 x 7 columns only, attention 4 x 128
    x (10 / 2) per layer and token; backward twice the forward. No embedding, no head over the prompt."""
    import types

    import torch
    from benchmarks.bench_update import update_flops
    config = types.SimpleNamespace(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=32,
                                   num_key_value_heads=2, intermediate_size=512, vocab_size=100)
    batch = types.SimpleNamespace(input_ids=torch.zeros(2, 10), response_width=6)
    forward = 2 * 2 * 245_760 * 20 + 2 * 128 * 100 * 14 + 2 * 4 * 128 * 5 * 20
    assert update_flops(config, batch) == 3 * forward == 60_364_800


def test_the_gpu_memory_comparison_is_the_plan_less_the_cuda_context():
    """On a GPU the measured peak is torch.cuda.max_memory_allocated, which does not see the CUDA context: the plan
    compared is infra.memory.plan's update column less its overhead row (the CUDA context, NCCL's buffers: outside the
    allocator) and its engine row (no engine runs),
    nothing else removed; offloaded, the float32 weights, gradients and AdamW states are host memory, not compared.
    On CPU the update and host columns with the overhead (the resident peak includes everything)."""
    spec = gpu_check.SCALES["cuda"]["update"]
    shape = memory.Shape(2560, 4, 32, 8, 128, 9728, 151936, True)
    for method in ("grpo", "ppo"):
        models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
        for offload in (False, True):
            gpu = gpu_check.planned_update(method, offload, spec, "cuda")
            whole = {name: (update, host) for name, _, update, _, host in memory.plan(memory.Setup(
                models, offload=offload, tokens=16384, sequence=1024 + 8192, engine="hf", rows=0))}
            assert gpu == {name: update for name, (update, _) in whole.items() if name not in ("overhead", "engine")}
            # the CUDA context (0.5 GiB) and, offloaded (FSDP2 on a world of one), NCCL's buffers (1 GiB)
            assert whole["overhead"][0] == memory.GIB / 2 + offload * memory.GIB
            weights = 4 * sum(s.parameters(h) for _, s, h, _ in models)  # float32
            assert (gpu["weights"], whole["weights"][1]) == ((0, weights) if offload else (weights, 0))
    planned = dict(weights=3.0, activations=4.0, fragmentation=1.0)  # a plan with a fragmentation row
    assert gpu_check.allocated_rows(planned, "cuda") == dict(weights=3.0, activations=4.0)  # not allocated
    assert gpu_check.allocated_rows(planned, "cpu") == planned  # the resident peak holds it all
    cpu_spec = gpu_check.SCALES["cpu"]["update"]
    cpu = gpu_check.planned_update("grpo", True, cpu_spec, "cpu")
    shape = gpu_check.model_shape(cpu_spec)
    assert "overhead" in cpu and "engine" not in cpu and cpu["weights"] == 4 * shape.parameters()  # host column


def test_the_speed_part_extrapolates_a_line_through_two_layer_counts(tmp_path, monkeypatch):
    """Steps of 10 ms at 6 layers and 16 ms at 12: 1 ms a layer, 40 ms at Qwen3-4B's 36, 256 / 0.04 tokens/s."""
    check = gpu_check.Check("cuda", str(tmp_path / "out"), str(tmp_path))
    figures = {6: dict(seconds=10.24), 12: dict(seconds=16.384)}  # 1,024 steps
    jobs = []

    def run(job_list, at_once=1):
        (name, argv, _, _), = job_list
        layers = json.loads(argv[-1])["layers"]
        with open(argv[2], "w") as handle:
            json.dump(dict(figures[layers], allocated=2 ** 30, reserved=2 ** 31, host=0, tokens_per_s=1.0), handle)
        jobs.append(layers)
        return {name: (0, 1.0)}
    monkeypatch.setattr(check, "run", run)
    check.speed()
    assert jobs == [6, 12]
    line = check.results["generate extrapolated"]
    assert line["layers"] == 36 and line["per_layer_s"] == pytest.approx(1e-3) and line["step_s"] == pytest.approx(0.04)
    assert line["tokens_per_s"] == pytest.approx(256 / 0.04)


def test_the_table_shows_what_finished_and_what_did_not(tmp_path):
    """A check cut during its trainers, after its updates (one of them failed on the plan, one left out by the
    budget): the table shows the updates' rows and the trainers' so far, the verdict names the failure, the cut and
    the parts not run, and the exit status is the cut's (124); without the cut, the failure's (1); with nothing
    failed but a run left out, 3. A speed part whose per-layer time is below the noise is not extrapolated."""
    from benchmarks.gpu_check_table import table
    check = gpu_check.Check("cpu", str(tmp_path / "out"), str(tmp_path))
    check.results["machine"] = "CPU (test)"
    update = dict(part="updates", method="grpo", offload=False, planned_gib=1.0, plan_rows={}, peak_gib=math.nan,
                  ratio=0.5, asserted=True, reserved_gib=0.0, host_gib=2.0, micro_batches=[[1, 576], [4, 256]],
                  update_s=6.0, tokens_per_s=400.0, flops_per_s=1e9, mfu=None, seconds=30.0,
                  problems=["plan / peak 0.50, outside 1 +- 0.2"])
    check.results["update grpo"] = update
    check.results["update ppo"] = dict(part="updates", skipped=True, problems=[])
    check.results["grpo"] = dict(part="trainers", skipped=True, problems=[])
    text, status = table(check, ["updates", "trainers"], cut="trainers")
    assert status == 124 and "| grpo | 1x576, 4x256 | - / - / 2.00 | 1.00 | 0.50 | 6.00 | 400 | - | 30 | FAIL" in text
    assert "| ppo | not run (budget spent) |" in text and "| grpo.py | not run (budget spent) |" in text
    assert text.endswith("FAILED: update grpo; CUT during trainers; parts not run: trainers, compare, speed; not run "
                         "(budget spent): update ppo, grpo; load " + text.rsplit("load ", 1)[1])
    assert table(check, ["updates", "trainers"])[1] == 1
    update["problems"] = []
    assert table(check, gpu_check.PARTS)[1] == 3
    check.results["generate extrapolated"] = dict(part="speed", layers=36, step_s=math.nan, per_layer_s=-4.8e-3,
                                                  tokens_per_s=math.nan, problems=[])
    assert "| 36 layers: not extrapolated, a layer's time below the noise (b = -4.80 ms) |" in table(check,
                                                                                                 ["speed"])[0]


def test_observe_records_the_ratio_of_the_first_mini_batch_only(tmp_path):
    """A 1-step GRPO run through `observe` whose old log-probs are the engine's (--old-logprobs engine: HF generate's
    own numbers, one token at a time on its KV cache, in float32): the ratio it records over the first of 2
    mini-batches is off 1 by the float noise between the engine's and the trainer's forward (the logged gap, the
    engine against itself, is 0; the harness's gap is the engine against the trainer's old log-probs, the same
    numbers: 0), over fewer tokens than the rollout holds; the update raised the rewarded samples (direction > 0)."""
    report = tmp_path / "report.json"
    flags = ["--device", "cpu", "--steps", "1", "--prompts-per-step", "8", "--eval-problems", "2", "--old-logprobs",
             "engine", "--output-dir", str(tmp_path), "--run-name", "observed"]
    done = subprocess.run([sys.executable, "benchmarks/gpu_check_runs.py", "observe", "grpo", str(report), "--",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(report.read_text())
    (first,) = gpu_check.metrics(str(tmp_path / "observed"))
    assert list(figures) == ["0"] and figures["0"]["calls"] == 2  # 32 samples per mini-batch: micro-batches of 16
    ratio, gap = figures["0"]["ratio"], figures["0"]["gap"]
    assert 0 < ratio["tokens"] < first["response_length"] * 64 <= gap["tokens"] + 1  # of 8 prompts x 8 samples
    assert first["logprob_gap_max"] == 0 and gap["max"] == 0
    assert 0 < ratio["mean"] <= ratio["q99"] <= ratio["max"] < 1e-4 and ratio["clipped"] == 0
    assert figures["0"]["direction"] is None or figures["0"]["direction"] > 0


def test_the_trainers_command_lists_every_trainer():
    printed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "trainers"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.split()
    assert printed == gpu_check.TRAINERS and {"ppo", "grpo", "sppo", "sp3o", "tppo", "spo"} <= set(printed)
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=REPO).returncode == 0  # its syntax
    assert subprocess.run(["bash", "benchmarks/gpu_check.sh", "--no-such-flag"], cwd=REPO,
                          capture_output=True).returncode == 2


def section_rows(table, number):
    """The rows of part `number`'s table in the check's Markdown (its header and rule left out)."""
    part = table.split(f"\n{number}. ", 1)[1].split("\n\n")[1]
    return [line for line in part.splitlines()[2:] if line.startswith("| ")]


@pytest.mark.slow
def test_the_check_scaled_down_on_cpu_passes(tmp_path):
    """`bash benchmarks/gpu_check.sh --device cpu` exits 0 and prints its table: 3 real-size updates, the trainers,
    3 float32 comparisons, every row ok, and 3 speed rows; with the wheel folder present (gpu_wheels.sh), from wheels
    installed the way the GPU machine installs them (--force-wheels)."""
    out, work = tmp_path / "out", tmp_path / "work"
    force = ["--force-wheels"] * bool(glob.glob(os.path.join(REPO, ".gpu-wheels", "*.whl")))
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--out", str(out), *force, "--",
                           "--work", str(work)], cwd=REPO, capture_output=True, text=True, timeout=1900,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    table = (out / "gpu_check.md").read_text()
    assert table.strip() in done.stdout and "every check passed" in table
    counts = {1: len(gpu_check.UPDATES), 2: len(gpu_check.TRAINERS) + 1, 3: 3, 4: 3}  # + the sampled grpo run
    for number, count in counts.items():
        rows = section_rows(table, number)
        assert len(rows) == count and (number == 4 or all(row.rstrip().endswith("| ok |") for row in rows)), rows
    if force:
        assert "installed 8 wheels" in done.stdout and "/tmp" in done.stdout.split("tyro 1.0.17 from", 1)[1][:40]
    results = json.loads((out / "gpu_check.json").read_text())
    assert all(results[t]["records"][-1]["step"] == 2 for t in gpu_check.TRAINERS)
    assert all(results[name]["micro_batches"] == [[1, 576], [4, 256], [4, 256]] for name, _ in [
        (f"update {method}" + " offload" * offload, 0) for method, offload in gpu_check.UPDATES])


@pytest.mark.slow
def test_a_cut_check_leaves_the_table_of_what_finished(tmp_path):
    """`timeout 60 bash benchmarks/gpu_check.sh --device cpu`: the check is cut during its first part; it stops its
    processes (none is left running) and leaves gpu_check.md, .json and .log saying so, with a row for each update
    that finished before the cut."""
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run(["timeout", "60", "bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--out", str(out),
                           "--", "--work", str(work)], cwd=REPO, capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 124, done.stdout[-3000:] + done.stderr[-2000:]
    table = (out / "gpu_check.md").read_text()
    assert "CUT during updates" in table and "parts not run: updates, trainers, compare, speed" in table
    results = json.loads((out / "gpu_check.json").read_text())
    finished = [name for name in results if name.startswith("update ")]
    assert section_rows(table, 1) == [row for row in section_rows(table, 1) if row.split(" | ")[0][2:] in
                                      [name[7:] for name in finished]] and len(section_rows(table, 1)) == len(finished)
    assert "===== update grpo" in (out / "gpu_check.log").read_text()
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the cut check still running: {left}"


PLANTED = [  # (plant, trainer, extra flags, the problem it must cause; None: it must pass)
    ("none", "grpo", [], None),
    ("none", "ppo", ["--old-logprobs", "engine"], None),  # a correct run whose ratio is off by bf16 noise
    ("sign-advantage", "ppo", [], "update direction"), ("sign-loss", "grpo", [], "update direction"),
    ("shift", "grpo", [], "gap"), ("shift-update", "ppo", [], "|ratio - 1|"),
    ("temperature", "ppo", [], "gap"), ("temperature-update", "grpo", [], "|ratio - 1|"),
    ("noop", "grpo", [], "does nothing"), ("stale", "grpo", [], "stale old log-probs"),
    ("stale", "ppo", [], "stale old log-probs"), ("mask-leak", "grpo", [], "reads the padding"),
    ("no-clip", "grpo", [], "where the clip binds"), ("none", "grpo", gpu_check.SAMPLED[2], None),
    ("top-p-ignored", "grpo", gpu_check.SAMPLED[2], "top-p ignored")]


@pytest.mark.slow
def test_the_check_fails_each_planted_bug(tmp_path):
    """Each bug of tests/gpu_check_plants.py planted into a 2-step bf16 run at the CPU check's settings fails the
    trainers' assertions (gpu_check.trainer_problems) by the statistic meant to catch it: a sign error by the update's
    direction, a shift or a wrong temperature in every trainer log-prob by the engine/trainer gap, in the update's
    log-probs alone by the first mini-batch's ratio; (issue 57) an update that does nothing by its size, stale old
    log-probs by the ratio against the update's own size, a loss over padding, a clip that leaves a gradient, and
    at temperature 0.7 and top-p 0.9 an engine whose log-probs ignore top-p, each by its own line. Three correct runs
    pass: one with the engine's old log-probs, whose ratio is off 1 by bf16 noise at a rare token by more than the
    former max bound (0.01), and one at temperature 0.7, top-p 0.9."""
    from concurrent.futures import ThreadPoolExecutor

    def planted_run(case):
        plant, trainer, extra, _ = case
        name = f"{plant}_{trainer}" + "_sampled" * bool(extra and extra[0] == "--temperature")
        flags = gpu_check.trainer_flags(trainer, "cpu", str(tmp_path), name) + ["--steps", "2", *extra]
        done = subprocess.run([sys.executable, "tests/gpu_check_plants.py", plant, trainer,
                               str(tmp_path / f"{name}.json"), "--", *flags], cwd=REPO, capture_output=True,
                              text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((tmp_path / f"{name}.json").read_text())
        return report, gpu_check.trainer_problems(gpu_check.metrics(str(tmp_path / "runs" / name)), report, steps=2)

    with ThreadPoolExecutor(2) as pool:  # two at a time: the CPU check's concurrency
        outcomes = list(pool.map(planted_run, PLANTED))
    for (plant, trainer, extra, expected), (report, problems) in zip(PLANTED, outcomes):
        if expected is None:
            assert problems == [], (plant, trainer, problems)
        else:
            assert any(expected in line for line in problems), (plant, trainer, problems)
    noisy = outcomes[1][0]
    assert max(step["ratio"]["max"] for step in noisy.values()) > 0.01
