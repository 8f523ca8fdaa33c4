"""The GPU check (benchmarks/gpu_check.sh runs it): short runs on one GPU that assert figures, not exit codes.

    python benchmarks/gpu_check.py --device cuda --out DIR   # on one H100/H200, inside 540 s (never run on one yet)
    python benchmarks/gpu_check.py --device cpu --out DIR    # the same, scaled down (tests/test_gpu_check.py, slow)
    python benchmarks/gpu_check.py trainers                  # the trainer files (infra.cli.trainers), forks too

Nothing is downloaded and vLLM is not used (it cannot travel to an offline GPU machine: its wheel is 311 MiB). Each
run is a process of its own with a timeout (benchmarks/gpu_check_runs.py), its folder under --work (default
runs/gpu_check). The parts run in order of value, within a budget of time (a part that would start after it is left
out, a process still running at its end is stopped); after each part --out gets the table so far (gpu_check.md, also
printed at the end), every figure (gpu_check.json) and every process's output (gpu_check.log), so a cut run leaves
what finished.
1. updates: the trainers' own update at a real width, each in a fresh process (gpu_check_runs.one_update): a random
   model of Qwen3-4B's width (hidden 2,560, 32/8 heads of 128, MLP 9,728, the full 151,936 vocabulary, tied) with 4
   layers (CPU: hidden 128, 1 layer), float32 weights and AdamW states, bf16 autocast, gradient checkpointing, one
   mini-batch of 1 x (1,024 + 8,192) and 8 x (1,024 + 3,072) tokens packed into micro-batches of 16,384 tokens
   (--micro-batch-tokens, the default; CPU: 64 + 512 and 64 + 192 into 1,024): GRPO, GRPO with --offload-optimizer,
   PPO (policy and critic). Asserted: the peak (GPU: torch.cuda.max_memory_allocated; CPU: the resident high-water
   mark) within +-PLAN_TOL of infra.memory.plan's rows for the same setup (GPU: less its "overhead" row, the CUDA
   context, which the allocator does not see; the "engine" row aside: no engine runs; a "fragmentation" row aside:
   what the allocator reserves beyond what it hands out; on CPU not for the offloaded update, see PLAN_TOL), the loss
   and gradients finite. Reported: max_memory_reserved against the whole plan (its fragmentation row included), the
   host peak, update tokens/s and MFU (bench_update.update_flops over the micro-batches and models; peak 989
   TFLOP/s on an H100 or H200).
2. trainers: each trainer file (forks too) 3 steps on the built-in tiny model with the Hugging Face engine in bf16
   (--dtype bfloat16: autocast over float32 weights), the actor updating from step 0 (--critic-warmup 0), the tiny
   model's own settings otherwise (64 prompts x 8 samples; CPU: 16 x 8), SCALES' `jobs` at once (on a GPU a tiny
   trainer is bound by its start-up and kernel launches, not the GPU). Each runs through gpu_check_runs.observe.
   One more run, SAMPLED: grpo.py at temperature 0.7 and top-p 0.9. Asserted at every step: reward > 0; grad_norm >
   0; every figure finite, no skipped update, the actor not frozen; the first mini-batch's |ratio - 1| (the policy
   the old log-probs came from) and the engine/trainer log-prob gap within BF16_BOUNDS (see there: a mean, a 99th
   percentile and the fraction past the clip range, never a max), that mean at most FRESH_FRACTION of the update's
   own token change (stale old log-probs), the engine's log-probs showing top-p's term (NUCLEUS_EXPLAINED), no
   policy loss that reads the padding its mask leaves out, no gradient where the clip binds; over the run, the
   update's direction (the correlation of reward with the change of a sample's log-prob) > 0 and its size at least
   CHANGE_MIN (an update that does nothing).
3. compare: ppo.py in float32 with 1 sample per prompt and recomputed old log-probs, deterministic algorithms and
   SDPA's math kernel: 3 steps straight; 3 with --offload-optimizer (FSDP2's CPU offload); 2, then --resume to 3.
   Asserted: the straight run's first mini-batch max |ratio - 1| and max log-prob gap within FLOAT32_BOUNDS (exact
   arithmetic up to float32 rounding: a max is a fair bound here); the resumed run's records equal the straight
   run's (RESUME_TOL; timings and evaluations aside); the offloaded run's step 0 within OFFLOAD_TOL.
4. speed (reported): the Hugging Face engine (infra.engine.HFGenerator.sample) sampling 256 sequences x 1,024 new
   tokens after 128-token prompts (CPU: 16 x 64 after 16) on Qwen3-4B's shape with 6 and 12 of its 36 layers (CPU:
   the scaled shape, 1 and 2): tokens/s, the time per step fitted as a + b x layers and so extrapolated to 36, the
   peaks against the plan's rollout column (weights and the engine's casts, KV cache and logits).
Exit status 0 when every check passed, 1 when one failed, 3 when the budget left a part out (none failed), 124 when
cut by a signal (SIGTERM: the files hold what finished).
"""
import argparse
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import infra.cli  # noqa: E402
from benchmarks.gpu_check_table import NOT_RUN, table  # noqa: E402

TRAINERS = infra.cli.trainers()  # every trainer file at the root, forks included
PARTS = ("updates", "trainers", "compare", "speed")  # in order of value: what a first GPU call must bring back first
RUNS = os.path.join(ROOT, "benchmarks", "gpu_check_runs.py")
# bf16 keeps 8 significant bits (unit roundoff 2^-8). Two computations of one log-prob in a different order (the
# engine one token at a time on its KV cache, the trainer over the whole sequence; or, on a GPU, the old log-probs
# and the update's in micro-batches of other shapes, hence other kernels) round differently, and a log-prob, a
# difference of logits up to ~15 here, inherits a few of their roundoffs: a few 1e-2 at a rare token. A max over the
# tens of thousands of tokens of a step is not a bound a correct run keeps (issue 46: 2.6e-2 in a correct run), so the
# check bounds what a bug moves: the mean (< one roundoff), the 99th percentile and the fraction of tokens past the
# clip range (0.2). Measured on CPU in bf16, correct runs (the gap; the ratio with --old-logprobs engine, the engine's
# numbers against the trainer's): mean <= 3.7e-4, q99 <= 8e-3, none past 0.2 on the tiny model (hidden 128, 2
# layers, 100 tokens); on the Qwen-like fixture (hidden 64, vocabulary 384: tests/fixtures/qwen_like) mean <= 7.1e-4,
# q99 <= 2.1e-2, none past 0.2 (2 steps of grpo.py and of ppo.py --old-logprobs engine, 16 x 8 samples, issue 57).
# Planted (tests/gpu_check_plants.py): log-probs at 0.7 x the sampling temperature: mean 9.6e-3 - 1.7e-2, q99 0.18 -
# 0.25, 0.9 - 1.3% past 0.2; one position off: mean > 1, q99 ~1 (ratio) or ~16 (gap), 98% past 0.2. The bounds are
# the tiny model's, which part 2 runs: they do not carry to a real width: on SmolLM2-135M (hidden 576, 30 layers) a
# correct run's gap reached mean 2.4e-2, q99 0.16, 0.36% past 0.2, its recomputed ratio mean 7.5e-3, q99 0.12.
BF16_BOUNDS = dict(mean=2 ** -8, q99=0.05, clipped=1e-3)
FLOAT32_BOUNDS = dict(max=1e-3)  # float32 (unit roundoff 6e-8): measured 0 (the ratio) and 2.1e-5 (the gap) on CPU
DIRECTION_MIN = 0.0  # the mean over a run's steps of the update direction (a correlation): > 0 unless a sign is wrong
CHANGE_MIN = 2.5e-4  # the run's mean |change| of a sample's mean log-prob over an update: measured 8.7e-4 - 4.5e-3 a
# step in correct and planted runs that update (CPU, bf16); an update that does nothing (lr 0): exactly 0. A
# direction > 0 alone passes a no-op half the time (the sign of noise)
FRESH_FRACTION = 0.5  # the first mini-batch's mean |ratio - 1| against the step's own mean |change| of a token's
# log-prob: old log-probs one update behind (stale: the previous rollout's weights) make them alike, measured 0.9 and
# 1.6 (grpo, ppo); fresh ones leave bf16 noise: 0 on CPU when recomputed, 0.07-0.13 with the engine's old log-probs
# (ppo, tiny model), 0.17-0.26 on the Qwen-like fixture (hidden 64, lr 1e-6: an update near the noise)
NUCLEUS_EXPLAINED, NUCLEUS_TOKENS = 0.5, 20  # at top-p < 1, the share of top-p's log-mass term the engine's
# log-probs show, over the tokens where the nucleus left out > 1% (gpu_check_runs.NUCLEUS_SHIFT), judged from 20 such
# tokens: 0.76 and 0.92 measured (grpo, temperature 0.7, top-p 0.9: its edge moves with rounding); an engine recording
# the whole distribution's log-probs: 0
RESUME_TOL = 1e-6  # relative: a resumed run repeats the straight run (deterministic algorithms, float32)
OFFLOAD_TOL = 1e-4  # relative, step 0: the same rollout and gradients; the optimizer steps on the CPU (other kernels)
PLAN_TOL = 0.2  # the plan within +-20% of the measured peak. On CPU the peak is the least of 2 runs at once: the
# resident peak of one run varies with the heap glibc keeps (the GRPO update: 1.01-1.27 GiB in 23 runs, plan 0.99),
# and that only adds. Not asserted for --offload-optimizer on CPU, where the offloaded states stay in the same memory
# and FSDP's host-side copies, which the plan leaves out, add to the resident peak (plan 0.83 GiB, peak 1.08-1.46);
# asserted on a GPU (max_memory_allocated: one run), where the states leave the device
TIMING = ("rollout_s", "update_s", "tokens_per_s", "gpu_peak_gib")  # figures of the machine, never compared
CPU_SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=384)
SCALES = {  # per device: budget (s), processes at once, trainer flags beyond the tiny preset, real sizes, timeouts
    "cuda": dict(budget=540, jobs=6, threads="2", update_runs=1, flags=["--eval-problems", "64"], sppo=[],
                 compare=["--prompts-per-step", "64"],
                 update=dict(shape="qwen3-4b-shape", layers=4, overrides={}, prompt=1024, long_response=8192,
                             short_response=3072, short_count=8, micro_batch_tokens=16384, repeats=3),
                 generate=dict(shape="qwen3-4b-shape", layers=(6, 12), overrides={}, sequences=256, prompt=128,
                               new_tokens=1024),
                 train_timeout=200, update_timeout=150, generate_timeout=120),
    "cpu": dict(budget=1500, jobs=2, threads="1", update_runs=2, sppo=["--prompts-per-step", "128"],
                flags=["--prompts-per-step", "16", "--eval-problems", "8"], compare=["--prompts-per-step", "16"],
                update=dict(shape="qwen3-4b-shape", layers=1, overrides=CPU_SHAPE, prompt=64, long_response=512,
                            short_response=192, short_count=8, micro_batch_tokens=1024, repeats=2),
                generate=dict(shape="qwen3-4b-shape", layers=(1, 2), overrides=CPU_SHAPE, sequences=16, prompt=16,
                              new_tokens=64),
                train_timeout=400, update_timeout=300, generate_timeout=200)}
UPDATES = (("grpo", False), ("grpo", True), ("ppo", False))  # (method, --offload-optimizer)
EXTRA_FLAGS = {name: ["--critic-warmup", "0"] for name in ("ppo", "sp3o", "vapo")}  # the tiny preset's: 5
SAMPLED = ("grpo", "grpo_sampled", ["--temperature", "0.7", "--top-p", "0.9"])  # one more run (trainer, name, flags):
# at temperature 1 and top-p 1 a log-prob that ignores either still matches the engine's
COMPARE_FLAGS = ["--dtype", "float32", "--samples-per-prompt", "1", "--old-logprobs", "recompute", "--critic-warmup",
                 "0", "--eval-problems", "8"]


class Cut(Exception):
    """SIGTERM (gpu_check.sh's timeout, or the caller's): stop the running processes, write what finished."""


def trainer_flags(trainer, device, work, name=None):
    scale = SCALES[device]
    return ["--device", device, "--dtype", "bfloat16", "--generator", "hf", "--steps", "3", "--save-every", "0",
            *scale["flags"], *(scale["sppo"] if trainer == "sppo" else []), *EXTRA_FLAGS.get(trainer, []),
            "--output-dir", os.path.join(work, "runs"), "--run-name", name or trainer]


# ---------------------------------------------------------------------------------------------- the judgements
def metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def compared(record):
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in TIMING
            and not k.startswith("eval/")}  # a run evaluates at its first and last step: a resumed one more often


def relative_difference(a, b):
    """The largest relative difference between two runs' records over their figures (timings and evaluations
    aside); inf when their steps or figures differ."""
    if [r.get("step") for r in a] != [r.get("step") for r in b]:
        return math.inf
    worst = 0.0
    for x, y in zip(map(compared, a), map(compared, b)):
        if set(x) != set(y):
            return math.inf
        worst = max([worst] + [abs(x[k] - y[k]) / max(abs(x[k]), abs(y[k])) for k in x if x[k] != y[k]])
    return worst


def deviation_problems(what, figures, bounds):
    """One line per statistic of `figures` (gpu_check_runs.deviation_statistics) past its bound in `bounds`."""
    return [f"{what} {key} {figures.get(key, math.nan):.2e} > {bound:.2g}" for key, bound in bounds.items()
            if not figures.get(key, math.inf) <= bound]


def trainer_problems(records, report, steps=3, bounds=BF16_BOUNDS):
    """The failed assertions of one trainer run, one line each (none: it passed). report: observe's figures."""
    problems = [] if len(records) == steps else [f"{len(records)} of {steps} steps logged"]
    for record in records:
        step = record.get("step")
        say = lambda text: problems.append(f"step {step}: {text}")  # noqa: E731
        bad = sorted(k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:
            say(f"not finite: {', '.join(bad)}")
        if not record.get("reward", 0) > 0:
            say("every reward 0")
        if not record.get("grad_norm", 0) > 0:
            say(f"grad_norm {record.get('grad_norm')}")
        if record.get("skipped_updates", 0) or record.get("actor_frozen"):
            say("skipped updates or a frozen actor")
        figures = report.get(str(step), {})
        if not figures.get("ratio", {}).get("tokens"):
            say("no first mini-batch observed")
        else:
            problems.extend(f"step {step}: {line}" for line in deviation_problems("|ratio - 1|", figures["ratio"],
                                                                                  bounds))
            moved = figures.get("token_change")
            if (moved or 0) >= CHANGE_MIN and not figures["ratio"]["mean"] <= FRESH_FRACTION * moved:  # it moved
                say(f"stale old log-probs? the 1st mini-batch's mean |ratio - 1| {figures['ratio']['mean']:.2e} is "
                    f"over {FRESH_FRACTION:.2f} of the update's mean token change {moved:.2e}")
        if "gap" not in figures:
            say("no log-prob gap observed")
        else:
            problems.extend(f"step {step}: {line}" for line in deviation_problems("gap", figures["gap"], bounds))
        nucleus = figures.get("nucleus") or {}
        if nucleus.get("tokens", 0) >= NUCLEUS_TOKENS and not nucleus["explained"] >= NUCLEUS_EXPLAINED:
            say(f"the engine's log-probs show {nucleus['explained']:.2f} of top-p's term over {nucleus['tokens']} "
                f"tokens (< {NUCLEUS_EXPLAINED}): top-p ignored by the recorded log-probs?")
        if figures.get("padding_read"):
            say("the policy loss reads the padding its mask leaves out")
        if figures.get("clip_leaks"):
            say(f"{figures['clip_leaks']} of {figures['clip_binds']} tokens where the clip binds still get a gradient")
    directions = [figures["direction"] for figures in report.values() if figures.get("direction") is not None]
    changes = [figures["change"] for figures in report.values() if figures.get("change") is not None]
    if not directions:
        problems.append("no update direction measured" + " (the update changed nothing)" * (
            bool(changes) and not any(changes)))
    elif not sum(directions) / len(directions) > DIRECTION_MIN:
        problems.append(f"update direction {sum(directions) / len(directions):+.3f} <= {DIRECTION_MIN}: samples of "
                        f"higher reward lost log-probability (a sign error?)")
    if changes and not sum(changes) / len(changes) >= CHANGE_MIN:
        problems.append(f"the update moved a sample's mean log-prob by {sum(changes) / len(changes):.1e} on average, "
                        f"< {CHANGE_MIN}: an update that does nothing?")
    return problems


def final_weight_difference(a, b):
    """Max |difference| between two runs' final policy weights (their last checkpoints); nan if one is missing."""
    from safetensors.torch import load_file

    from infra.checkpoint import _checkpoint_steps
    def last(run):
        folder = os.path.join(run, "checkpoints")
        return os.path.join(folder, f"step_{_checkpoint_steps(folder)[-1]:06d}", "policy", "model.safetensors")
    try:
        x, y = (load_file(last(run)) for run in (a, b))
    except (OSError, IndexError):
        return math.nan
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x) if sorted(x) == sorted(y) else math.inf


def model_shape(spec):
    """infra.memory_plan.Shape of a real-size run's model (bench_update's shape, its layers and overrides)."""
    from benchmarks.bench_update import SHAPES
    from infra.memory_plan import Shape
    config = {**SHAPES[spec["shape"]][1], **spec["overrides"]}
    return Shape(config["hidden_size"], spec["layers"], config["num_attention_heads"], config["num_key_value_heads"],
                 config["head_dim"], config["intermediate_size"], config["vocab_size"], config["tie_word_embeddings"])


def planned_update(method, offload, spec, device):
    """{row: bytes} of infra.memory.plan for one_update's update: the policy (PPO: and a critic with one output),
    trained, bf16 compute, checkpointing, micro-batches packed to spec's tokens, the longest sequence its prompt +
    long response. GPU: the update column less "overhead" (the CUDA context and workspaces lie outside PyTorch's
    allocator) and "engine" (no engine runs); CPU: the update and host columns (all of it is the process's memory),
    "engine" aside."""
    from infra.memory_plan import Setup, plan
    shape, cpu = model_shape(spec), device == "cpu"
    models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
    rows = plan(Setup(models, offload=offload, tokens=spec["micro_batch_tokens"],
                      sequence=spec["prompt"] + spec["long_response"], checkpointing=True, compute_bytes=2,
                      engine="hf", cpu=cpu, rows=0, prompt_tokens=spec["prompt"]))
    return {name: update + host * cpu for name, _, update, _, host in rows
            if name != "engine" and (cpu or name != "overhead")}


def allocated_rows(planned, device):
    """The rows a GPU's max_memory_allocated is compared with: all but "fragmentation" (what the allocator reserves
    beyond what it hands out, where the plan has such a row), which max_memory_reserved is compared with as well."""
    return {name: value for name, value in planned.items() if device == "cpu" or name != "fragmentation"}


def planned_generate(spec, layers, device):
    """{row: bytes} of the plan's rollout column for generate_speed: the policy's float32 weights and the HF
    engine's row (the bf16 casts, the KV cache of sequences x (prompt + new tokens), sampling's logits); on CPU the
    process's overhead too."""
    import dataclasses

    from infra.memory_plan import Setup, plan
    shape = dataclasses.replace(model_shape(spec), layers=layers)
    rows = plan(Setup((("policy", shape, 0, False),), engine="hf", cpu=device == "cpu",
                      generated=(spec["sequences"], spec["prompt"] + spec["new_tokens"])))
    return {name: rollout for name, _, _, rollout, _ in rows if rollout and (device == "cpu" or name != "overhead")}


# ---------------------------------------------------------------------------------------------- the check
def stop(process):
    """Kill a child process and whatever it started (its own session: start_new_session)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # gone already
        pass
    process.wait()


class Check:
    """The runs of one check, their results (self.results, by name, in the order run) and every process's output."""

    rules = dict(BF16_BOUNDS=BF16_BOUNDS, FLOAT32_BOUNDS=FLOAT32_BOUNDS, DIRECTION_MIN=DIRECTION_MIN,
                 CHANGE_MIN=CHANGE_MIN, FRESH_FRACTION=FRESH_FRACTION, NUCLEUS_EXPLAINED=NUCLEUS_EXPLAINED,
                 RESUME_TOL=RESUME_TOL, OFFLOAD_TOL=OFFLOAD_TOL, PLAN_TOL=PLAN_TOL)  # what the table states

    def __init__(self, device, out, work, parts=PARTS, budget=0):
        self.device, self.out, self.work, self.parts = device, out, work, parts
        self.scale = dict(SCALES[device], budget=budget or SCALES[device]["budget"])
        self.started, self.results, self.log, self.running = time.time(), {}, [], {}
        os.makedirs(os.path.join(work, "runs"), exist_ok=True)

    def part_results(self, part):
        return [(name, r) for name, r in self.results.items() if isinstance(r, dict) and r["part"] == part]

    def left(self):
        return self.scale["budget"] - (time.time() - self.started)

    def run(self, jobs, at_once=1):
        """Child processes `python argv`, at most `at_once` at a time: jobs is [(name, argv, timeout, env)]. A job
        is cut at its timeout or at the budget's end; one that would start with under 10 s left is not run. Returns
        {name: (exit status, seconds)}."""
        pending, done = list(jobs), {}
        try:
            while pending or self.running:
                while pending and len(self.running) < at_once:
                    name, argv, timeout, env = pending.pop(0)
                    if self.left() < 10:
                        done[name] = (NOT_RUN, 0.0)
                        self.log.append(f"===== {name}: not run, the {self.scale['budget']} s budget is spent\n")
                        continue
                    output = open(os.path.join(self.work, f"{name.replace(' ', '_')}.out"), "w+")
                    process = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=output,
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
                    self.running[name] = (process, output, time.time(), min(timeout, self.left()), argv)
                for name, (process, output, began, timeout, argv) in list(self.running.items()):
                    status = process.poll()
                    if status is None and time.time() - began < timeout:
                        continue
                    if status is None:
                        stop(process)
                        status = "timed out"
                    done[name] = self.finished(name, status)
                time.sleep(0.2)
        finally:
            for name in list(self.running):  # a Cut (or any error): nothing keeps running behind the check
                stop(self.running[name][0])
                self.finished(name, "cut")
        return done

    def finished(self, name, status):
        process, output, began, _, argv = self.running.pop(name)
        seconds = time.time() - began
        output.seek(0)
        self.log.append(f"===== {name}: exit {status} after {seconds:.0f} s: python {' '.join(argv)}\n"
                        f"{output.read()}\n")
        output.close()
        print(f"  {name}: exit {status} after {seconds:.0f} s", flush=True)
        return status, seconds

    def child_env(self, light=True):
        """Light children (the tiny trainers) get SCALES' `threads` torch threads; on CPU every child gets 1."""
        return {"OMP_NUM_THREADS": self.scale["threads"]} if light or self.device == "cpu" else {}

    def observed(self, trainer, name, flags, fresh=True, deterministic=False):
        """A job running `trainer` through gpu_check_runs.observe, its report --work/<name>.report.json (removed
        first); fresh: its run folder --work/runs/<name> too."""
        report = os.path.join(self.work, f"{name}.report.json")
        if os.path.exists(report):
            os.remove(report)
        if fresh:
            shutil.rmtree(os.path.join(self.work, "runs", name), ignore_errors=True)
        argv = [RUNS, "observe", trainer, report, *["--deterministic"] * deterministic, "--", *flags]
        return name, argv, self.scale["train_timeout"], self.child_env()

    def report(self, name):
        path = os.path.join(self.work, f"{name}.report.json")
        return json.load(open(path)) if os.path.exists(path) else {}

    def child_figures(self, kind, name, spec):
        """A job of gpu_check_runs.py `kind` (update or generate) on `spec`, its figures in --work/<name>.json."""
        report = os.path.join(self.work, f"{name.replace(' ', '_')}.json")
        if os.path.exists(report):
            os.remove(report)
        return (name, [RUNS, kind, report, json.dumps(spec)], self.scale[f"{kind}_timeout"],
                self.child_env(light=False)), report

    def updates(self):
        """Each update in SCALES' `update_runs` processes at once; the least of their peaks is compared (CPU: glibc's
        retained heap varies by run: PLAN_TOL), the first's times reported."""
        from infra.memory import GIB
        spec, runs = dict(self.scale["update"], device=self.device), self.scale["update_runs"]
        for method, offload in UPDATES:
            name = f"update {method}" + " offload" * offload
            jobs = [self.child_figures("update", name + f" #{run + 1}" * (runs > 1), dict(spec, method=method,
                                                                                          offload=offload))
                    for run in range(runs)]
            done = self.run([job for job, _ in jobs], runs)
            statuses = [done[job[0]][0] for job, _ in jobs]
            if NOT_RUN in statuses:
                self.results[name] = dict(part="updates", skipped=True, problems=[])
                continue
            every = [json.load(open(path)) for (job, path), status in zip(jobs, statuses)
                     if status == 0 and os.path.exists(path)]
            measured = every[0] if len(every) == runs else {}
            planned = planned_update(method, offload, spec, self.device)
            key = "allocated" if self.device == "cuda" else "host"
            peak = min(figures[key] for figures in every) if measured else math.nan
            compared, whole = sum(allocated_rows(planned, self.device).values()), sum(planned.values())
            ratio = compared / peak
            problems = [f"exit {status}" for status in statuses if status != 0]
            asserted = self.device == "cuda" or not offload  # on CPU nothing leaves the device (see PLAN_TOL)
            if asserted and not abs(ratio - 1) <= PLAN_TOL:
                problems.append(f"plan / peak {ratio:.2f}, outside 1 +- {PLAN_TOL}")
            if not all(figures["finite"] for figures in every):
                problems.append("loss or gradient not finite")
            timed = measured.get("seconds", [math.nan])[1:] or measured.get("seconds", [math.nan])  # the first warms
            update_s = sum(timed) / len(timed)
            flops_rate = measured.get("flops", math.nan) / update_s
            self.results[name] = dict(
                part="updates", method=method, offload=offload, planned_gib=compared / GIB,
                reserved_ratio=whole / measured.get("reserved", math.nan) if self.device == "cuda" else None,
                plan_rows={k: v / GIB for k, v in planned.items()}, peak_gib=peak / GIB, ratio=ratio, asserted=asserted,
                peaks_gib=[figures[key] / GIB for figures in every],
                reserved_gib=measured.get("reserved", math.nan) / GIB, host_gib=min(
                    [figures["host"] for figures in every] or [math.nan]) / GIB,
                micro_batches=measured.get("micro_batches"), update_s=update_s,
                tokens_per_s=measured.get("tokens", math.nan) / update_s, flops_per_s=flops_rate,
                mfu=flops_rate / measured["peak_flops"] if measured.get("peak_flops") else None,
                seconds=max(done[job[0]][1] for job, _ in jobs), problems=problems)

    def trainers(self):
        """Each trainer file, and SAMPLED: grpo.py sampling at temperature 0.7, top-p 0.9."""
        runs = [(trainer, trainer, [], f"{trainer}.py") for trainer in TRAINERS] + [
            (SAMPLED[0], SAMPLED[1], SAMPLED[2], f"{SAMPLED[0]}.py {' '.join(SAMPLED[2])}")]
        jobs = [self.observed(trainer, name, trainer_flags(trainer, self.device, self.work, name) + flags)
                for trainer, name, flags, _ in runs]
        done = self.run(jobs, self.scale["jobs"])
        for trainer, name, _, label in runs:
            status, seconds = done.get(name, ("cut", 0.0))
            if status == NOT_RUN:
                self.results[name] = dict(part="trainers", label=label, skipped=True, problems=[])
                continue
            records, report = metrics(os.path.join(self.work, "runs", name)), self.report(name)
            self.results[name] = dict(part="trainers", label=label, status=status, seconds=seconds, records=records,
                                      report=report, problems=([] if status == 0 else [f"exit {status}"])
                                      + trainer_problems(records, report))

    def compare(self):
        """ppo.py in float32: straight, offloaded, and 2 steps + --resume to 3."""
        runs = os.path.join(self.work, "runs")
        base = ["--device", self.device, *COMPARE_FLAGS, *self.scale["compare"], "--output-dir", runs]
        logged = len(self.log)
        names = {name: f"ppo_fp32_{name}" for name in ("straight", "resume", "offload")}
        extras = dict(straight=["--steps", "3"], resume=["--steps", "2"],
                      offload=["--steps", "3", "--offload-optimizer"])
        done = self.run([self.observed("ppo", names[name], [*base, *extras[name], "--run-name", names[name]],
                                       deterministic=True) for name in names], self.scale["jobs"])
        resumed = f"{names['resume']} resumed"
        job = self.observed("ppo", names["resume"], ["--device", self.device, "--resume", os.path.join(
            runs, names["resume"]), "--steps", "3"], fresh=False, deterministic=True)
        if NOT_RUN in [status for status, _ in done.values()]:
            self.results["float32"] = dict(part="compare", skipped=True, problems=[])
            return
        done.update(self.run([(resumed, *job[1:])]) if done.get(names["resume"], [None])[0] == 0 else {})
        warned = sorted({line.strip()[:160] for entry in self.log[logged:] for line in entry.splitlines()
                         if "deterministic" in line and "Warning" in line})  # operations with no deterministic kernel
        status = {name: done.get(run, ("cut", 0.0))[0] for name, run in (*names.items(), ("resumed", resumed))}
        exits = {name: f"{name}: exit {value}" for name, value in status.items() if value != 0}
        straight, offload = (metrics(os.path.join(runs, names[name])) for name in ("straight", "offload"))
        figures = self.report(names["straight"]).values()
        ratio, gap = (max([f.get(key, {}).get("max", math.nan) for f in figures] or [math.nan]) for key in
                      ("ratio", "gap"))
        problems = [exits[n] for n in ("straight",) if n in exits] + deviation_problems(
            "|ratio - 1|", dict(max=ratio), FLOAT32_BOUNDS) + deviation_problems("gap", dict(max=gap), FLOAT32_BOUNDS)
        self.results["float32"] = dict(part="compare", ratio_max=ratio, gap_max=gap,
                                       seconds=done.get(names["straight"], (0, 0.0))[1], problems=problems)
        difference = relative_difference(straight, metrics(os.path.join(runs, names["resume"])))
        problems = [exits[n] for n in ("straight", "resume", "resumed") if n in exits]
        if not difference <= RESUME_TOL:
            problems.append(f"records differ by {difference:.2e} (relative) > {RESUME_TOL}")
        self.results["resume"] = dict(part="compare", max_relative_difference=difference, problems=problems,
                                      seconds=sum(done.get(n, (0, 0.0))[1] for n in (names["resume"], resumed)),
                                      nondeterministic_warnings=warned)
        first, every = relative_difference(straight[:1], offload[:1]), relative_difference(straight, offload)
        problems = [exits[n] for n in ("straight", "offload") if n in exits]
        if not first <= OFFLOAD_TOL:
            problems.append(f"step 0 differs by {first:.2e} (relative) > {OFFLOAD_TOL}")
        problems += [f"step {r.get('step')}: not finite or no gradient" for r in offload
                     if not (math.isfinite(r.get("policy_loss", math.nan)) and r.get("grad_norm", 0) > 0)]
        weights = final_weight_difference(*(os.path.join(runs, names[n]) for n in ("straight", "offload")))
        self.results["offload"] = dict(part="compare", step0_relative_difference=first, relative_difference=every,
                                       weights_max_abs_difference=weights, problems=problems,
                                       seconds=done.get(names["offload"], (0, 0.0))[1])

    def speed(self):
        """The HF engine at two layer counts (reported, not asserted): tokens/s, its per-step time fitted as
        a + b x layers, the peaks against the plan's rollout column."""
        from benchmarks.bench_update import SHAPES
        from infra.memory import GIB
        spec = dict(self.scale["generate"], device=self.device)
        steps = {}
        for layers in spec["layers"]:
            name = f"generate {layers} layers"
            job, path = self.child_figures("generate", name, dict(spec, layers=layers))
            status, seconds = self.run([job])[name]
            if status == NOT_RUN:
                self.results[name] = dict(part="speed", layers=layers, skipped=True, problems=[])
                continue
            measured = json.load(open(path)) if status == 0 and os.path.exists(path) else {}
            planned = sum(planned_generate(spec, layers, self.device).values())
            peak = measured.get("allocated" if self.device == "cuda" else "host") or math.nan
            steps[layers] = measured.get("seconds", math.nan) / spec["new_tokens"]
            self.results[name] = dict(part="speed", layers=layers, tokens_per_s=measured.get("tokens_per_s", math.nan),
                                      step_s=steps[layers], peak_gib=peak / GIB, planned_gib=planned / GIB,
                                      reserved_gib=measured.get("reserved", math.nan) / GIB, ratio=planned / peak,
                                      seconds=seconds, problems=[] if status == 0 else [f"exit {status}"])
        if len(steps) < 2 or not all(map(math.isfinite, steps.values())):
            return
        (few, a), (many, b) = sorted(steps.items())
        whole = SHAPES[spec["shape"]][1]["num_hidden_layers"]
        per_layer = (b - a) / (many - few)  # <= 0 where a layer costs less than the noise (the CPU's tiny layers)
        step = a + per_layer * (whole - few) if per_layer > 0 else math.nan
        self.results["generate extrapolated"] = dict(part="speed", layers=whole, step_s=step, per_layer_s=per_layer,
                                                     tokens_per_s=spec["sequences"] / step, problems=[])

    def write(self, text):
        os.makedirs(self.out, exist_ok=True)
        for name, content in (("gpu_check.md", text + "\n"), ("gpu_check.json", json.dumps(
                self.results, indent=1, default=str)), ("gpu_check.log", "".join(self.log)[-15 * 2 ** 20:])):
            with open(os.path.join(self.out, name + ".tmp"), "w") as handle:  # the device tool brings back <= 16 MiB
                handle.write(content)
            os.replace(os.path.join(self.out, name + ".tmp"), os.path.join(self.out, name))  # never half a file


def machine(device):
    import torch
    import transformers
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        where = f"{properties.name} ({properties.total_memory / 2 ** 30:.1f} GiB), CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load " \
                f"{os.getloadavg()[0]:.2f} at the start)"
    return f"{where}, Python {platform.python_version()}, torch {torch.__version__}, transformers " \
           f"{transformers.__version__}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=sorted(SCALES), help="cuda: the check; cpu: scaled down")
    parser.add_argument("--out", default="runs/gpu_check/out", help="where the table, figures and log go")
    parser.add_argument("--work", default="runs/gpu_check", help="the runs' folders (the tiny model's checkpoints)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="run only these parts")
    parser.add_argument("--budget", type=float, default=0, help="seconds for the whole check (default: SCALES')")
    args = parser.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; --device cpu runs the check scaled down")
    parts = [part for part in PARTS if part in args.parts]
    check = Check(args.device, os.path.abspath(args.out), os.path.abspath(args.work), parts, args.budget)
    check.results["machine"] = machine(args.device)
    print(f"GPU check, {check.results['machine']}; parts {', '.join(parts)}; budget {check.scale['budget']:.0f} s",
          flush=True)

    def cut(signum, frame):
        for name in (signal.SIGTERM, signal.SIGINT):  # once: the files get written
            signal.signal(name, signal.SIG_IGN)
        raise Cut()
    for name in (signal.SIGTERM, signal.SIGINT):
        signal.signal(name, cut)
    finished, interrupted = [], None
    try:
        for part in parts:
            if check.left() < 10:
                break
            interrupted = part
            print(f"{part}: {check.left():.0f} s left", flush=True)
            getattr(check, part)()
            finished.append(part)
            interrupted = None
            check.write(table(check, finished)[0])
    except Cut:
        pass
    text, status = table(check, finished + [interrupted] * bool(interrupted), interrupted)
    check.write(text)
    print(text)
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainers"]:
        print(*TRAINERS)
    else:
        sys.exit(main())
