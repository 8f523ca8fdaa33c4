"""The GPU check (benchmarks/gpu_check.sh runs it): short runs on one GPU that assert figures, not exit codes.

    python benchmarks/gpu_check.py --device cuda --out DIR   # the check, aimed at ~6 min on one H100 (never run on one)
    python benchmarks/gpu_check.py --device cpu --out DIR    # the same, scaled down (tests/test_gpu_check.py, slow)
    python benchmarks/gpu_check.py trainers                  # the trainer files (infra.cli.trainers), forks too

Nothing is downloaded and vLLM is not used (it cannot travel to an offline GPU machine: its wheel is 311 MiB). Each
run is a process of its own with a timeout, its folder under --work (default runs/gpu_check); --out gets three files:
the table (gpu_check.md, also printed), every figure (gpu_check.json) and every process's output (gpu_check.log).
1. trainers: each trainer file (forks too) 3 steps on the built-in tiny model with the Hugging Face engine in bf16
   (--dtype bfloat16: autocast over float32 weights), the actor updating from step 0 (--critic-warmup 0), the tiny
   model's own settings otherwise (infra.cli.CONTROLLED_TINY_PRESET: 64 prompts x 8 samples; CPU: 16 x 8). The tiny
   model solves ~7% of the built-in task, so rewards are not all zero and GRPO's groups differ. Each runs through
   `observe`, which records the PPO ratio of every policy_loss call before the step's first optimizer step: the
   first mini-batch, whose policy is the one the old log-probs came from. Asserted at every step: reward > 0; max
   |ratio - 1| over the first mini-batch's tokens <= RATIO_TOL; grad_norm > 0; every logged figure finite, no
   skipped update, the actor not frozen; the engine/trainer log-prob gap (logprob_gap_mean and _max: HF generate,
   one token at a time on its KV cache, against the trainer's forward over the whole sequence) within GAP_BOUNDS.
2. compare: ppo.py in float32 with 1 sample per prompt and recomputed old log-probs (as tests/test_memory.py
   compares them bit for bit on CPU), with deterministic algorithms and SDPA's math kernel (observe): 3 steps
   straight; 3 steps with --offload-optimizer (FSDP2's CPUOffloadPolicy: weights, gradients and AdamW states in host
   memory, the optimizer stepping on the CPU); 2 steps, then --resume to 3. Asserted: the resumed run's records
   equal the straight run's (RESUME_TOL, relative; timings and evaluations aside); the offloaded run's step 0 (the
   same rollout and first update) within OFFLOAD_TOL, every step finite.
3. updates: one GRPO and one PPO update of a Qwen3-0.6B-shaped model (random weights; 28 layers on GPU, 1 layer of
   hidden 128 over the full vocabulary on CPU), 2 sequences of 1,024 prompt + 4,096 and 8,192 response tokens (CPU:
   256, 512), as benchmarks/rehearsal.py runs one on CPU, each in a fresh process. Asserted: the peak (GPU:
   torch.cuda.max_memory_allocated; CPU: the resident high-water mark) within +-PLAN_TOL of infra.memory.plan's
   update column for the same setup (GPU: less its "overhead" row, the CUDA context and workspaces, which PyTorch's
   allocator does not see).
4. speed (when the budget allows; reported, not asserted): benchmarks/bench_update.py on the same shape (GPU: update
   tokens/s, MFU, generate tokens/s) or on the tiny model (CPU).
Exit status 0 when every check passed, 1 otherwise.
"""
import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import infra.cli  # noqa: E402

TRAINERS = infra.cli.trainers()  # every trainer file at the root, forks included
PARTS = ("trainers", "compare", "updates", "speed")
RATIO_TOL = 1e-2  # max |pi / pi_old - 1| over the first mini-batch's tokens (the same weights: 1 up to float noise)
# bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3). The engine and the trainer compute the same function
# in different orders (one token at a time on a KV cache; the whole sequence at once), so their bf16 roundings
# differ, and a log-prob, a difference of logits (up to 15 in size here), inherits a few roundoffs of them. Measured
# on CPU in bf16 (`bash benchmarks/gpu_check.sh --device cpu`, transformers 5.25 and 5.17): mean 2e-4 to 5e-4, max
# 0.06 to 0.31 per step. Bounds: the mean below one roundoff (a shifted position or a wrong temperature moves every
# token by far more); the max below 0.5, a ratio of 1.65, past any clip range (a token the two handle differently,
# such as the stop token, shows there).
GAP_BOUNDS = dict(logprob_gap_mean=2 ** -8, logprob_gap_max=0.5)
RESUME_TOL = 1e-6  # relative: a resumed run repeats the straight run (deterministic algorithms, float32)
OFFLOAD_TOL = 1e-4  # relative, step 0: the same rollout and gradients; the optimizer steps on the CPU (other kernels)
PLAN_TOL = 0.2  # the plan within +-20% of the measured peak
TIMING = ("rollout_s", "update_s", "tokens_per_s", "gpu_peak_gib")  # figures of the machine, never compared
SCALES = {  # per device: the trainers' flags beyond the tiny preset, the update's shape and lengths, timeouts (s)
    "cuda": dict(flags=["--eval-problems", "64"], sppo=[], compare=["--prompts-per-step", "64"], layers=28, shape={},
                 lengths=(4096, 8192), speed=["--models", "qwen3-0.6b-shape", "--min-seconds", "5"],
                 train_timeout=100, update_timeout=150, budget=520),
    "cpu": dict(flags=["--prompts-per-step", "16", "--eval-problems", "8"], sppo=["--prompts-per-step", "128"],
                compare=["--prompts-per-step", "16"], layers=1, lengths=(256, 512),
                shape=dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                           intermediate_size=384), speed=["--models", "tiny", "--min-seconds", "1"],
                train_timeout=300, update_timeout=300, budget=1500)}
EXTRA_FLAGS = {name: ["--critic-warmup", "0"] for name in ("ppo", "sp3o", "vapo")}  # the tiny preset's: 5
COMPARE_FLAGS = ["--dtype", "float32", "--samples-per-prompt", "1", "--old-logprobs", "recompute", "--critic-warmup",
                 "0", "--eval-problems", "8"]


def trainer_flags(trainer, device, work, name=None):
    scale = SCALES[device]
    return ["--device", device, "--dtype", "bfloat16", "--generator", "hf", "--steps", "3", "--save-every", "0",
            *scale["flags"], *(scale["sppo"] if trainer == "sppo" else []), *EXTRA_FLAGS.get(trainer, []),
            "--output-dir", os.path.join(work, "runs"), "--run-name", name or trainer]


# ---------------------------------------------------------------------------------------------- child processes
def observe(trainer, report_path, argv, deterministic=False):
    """Run `trainer`.main() with argv in this process, recording at each step the PPO ratio of the policy_loss calls
    made before the step's first optimizer step (any optimizer: the six files step all of theirs together at a
    mini-batch's end); write {step: dict(max_dev, mean_dev, tokens, calls)} to report_path (dev: |ratio - 1|).
    deterministic: torch's deterministic algorithms (an operation without one warns, in the log) and SDPA's math
    kernel (the memory-efficient kernel's backward stays nondeterministic under warn_only), so that a resumed run can
    repeat a straight one exactly."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import infra.run
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode (before CUDA starts)
        torch.use_deterministic_algorithms(True, warn_only=True)
        for kernel in ("flash", "mem_efficient", "cudnn"):
            getattr(torch.backends.cuda, f"enable_{kernel}_sdp", lambda on: None)(False)
    module = __import__(trainer)
    fresh = lambda: dict(max_dev=0.0, sum_dev=0.0, tokens=0, calls=0)  # noqa: E731
    state = dict(first=True, current=fresh(), steps={})
    policy_loss, end_step = module.policy_loss, infra.run.Run.end_step

    def observed_policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs):
        if state["first"]:
            deviation = (torch.exp(logprobs.detach().float() - old_logprobs.float()) - 1).abs()[mask.bool()]
            current = state["current"]
            if deviation.numel():
                current["max_dev"] = max(current["max_dev"], deviation.max().item())
                current["sum_dev"] += deviation.sum().item()
            current["tokens"] += deviation.numel()
            current["calls"] += 1
        return policy_loss(logprobs, old_logprobs, advantages, mask, *rest, **kwargs)

    def observed_end_step(run, step, metrics):
        current = state["current"]
        state["steps"][step] = dict(max_dev=current["max_dev"], mean_dev=current["sum_dev"] / max(1, current["tokens"]),
                                    tokens=current["tokens"], calls=current["calls"])
        state.update(first=True, current=fresh())
        return end_step(run, step, metrics)

    def optimizer_stepped(optimizer, args, kwargs):
        state["first"] = False

    module.policy_loss, infra.run.Run.end_step = observed_policy_loss, observed_end_step
    register_optimizer_step_pre_hook(optimizer_stepped)
    sys.argv = [module.__file__, *argv]
    try:
        infra.run.run_main(module.main)
    finally:
        with open(report_path, "w") as handle:
            json.dump(state["steps"], handle)


def update_config(layers, shape):
    from benchmarks.bench_update import QWEN3_0_6B_SHAPE
    return {**QWEN3_0_6B_SHAPE, "num_hidden_layers": layers, **shape}


def planned_update(method, config, response, device):
    """{row: bytes} of infra.memory.plan's update column for one_update's update: the policy (PPO: and a critic with
    one output) in float32, bf16 compute, checkpointing, one sequence of the prompt allowance + `response` tokens per
    micro-batch, the HF engine (none runs). GPU: without the "overhead" row (the CUDA context and workspaces are
    outside PyTorch's allocator: max_memory_allocated never counts them)."""
    from infra.memory import PROMPT_TOKENS, Setup, Shape, plan
    shape = Shape(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                  config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
                  config["tie_word_embeddings"])
    models = (("policy", shape, 0, True),) + (("critic", shape, 1, True),) * (method == "ppo")
    sequence, cpu = PROMPT_TOKENS + response, device == "cpu"
    rows = plan(Setup(models, tokens=sequence, sequence=sequence, checkpointing=True, compute_bytes=2, engine="hf",
                      cpu=cpu, rows=1))
    return {name: update for name, _, update, _, _ in rows if cpu or name != "overhead"}


def one_update(method, response, device, layers, shape, samples=2):
    """In this process, one update of `method` (grpo or ppo) on a random Qwen3-0.6B-shaped model, as
    benchmarks/rehearsal.py runs one on CPU, on `device`: float32 weights and AdamW states (made before, as from a
    trainer's second step on), bf16 autocast, gradient checkpointing, `samples` sequences of 1,024 random prompt +
    `response` random tokens, one per micro-batch. Its figures: peak bytes, seconds, whether the loss was finite."""
    import torch

    import common
    import grpo
    import ppo
    from benchmarks.bench_update import build_model, random_batch, synchronize
    from benchmarks.rehearsal import peak_resident_bytes, warm_optimizer
    from infra.memory import PROMPT_TOKENS, keep_freed_host_memory
    if device == "cpu":
        keep_freed_host_memory()  # as infra.run.Run does on CPU, and as the CPU plan assumes

    def build(value_head=0):  # as common.load_model(..., gradient_checkpointing=True): bf16 compute, training mode
        model = build_model("qwen3-0.6b-shape", device, "bfloat16", layers, value_head, **shape)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model.train()

    policy = build()
    critic = build(value_head=1) if method == "ppo" else None
    models, trainer = [policy] + [critic] * (critic is not None), ppo if method == "ppo" else grpo
    hyper = trainer.Args()  # the published lr, betas, weight decay, clips, aggregation
    optimizers = [torch.optim.AdamW(model.parameters(), lr=lr, betas=hyper.adam_betas, weight_decay=hyper.weight_decay)
                  for model, lr in zip(models, (hyper.lr, getattr(hyper, "critic_lr", 0)))]
    for optimizer in optimizers:
        warm_optimizer(optimizer)
    batch = random_batch(update_config(layers, shape)["vocab_size"], samples, PROMPT_TOKENS, response, device)
    mask, rewards = batch.response_mask, torch.arange(samples, device=device).remainder(2).float()  # A != 0
    synchronize(device)
    start = time.perf_counter()
    old_logprobs = common.batched(lambda micro: common.response_logprobs(policy, micro), batch, 1)
    if critic is not None:
        old_values = common.batched(lambda micro: common.critic_outputs(critic, micro), batch, 1)
        advantages, returns = ppo.gae(ppo.terminal_rewards(rewards, mask), old_values, mask)
        critic_weights = mask / mask.sum(1, True).clamp(min=1)  # seq-mean, ppo.py's default
    else:
        advantages = grpo.group_advantages(rewards, samples)[:, None].expand_as(old_logprobs)
    counts = dict(num_sequences=samples, num_tokens=mask.sum().item(), max_length=response)
    finite = True
    for micro in common.micro_batches(list(range(samples)), batch.lengths(), 1):
        micro_batch = batch.select(micro)
        width = micro_batch.response_width
        if critic is not None:
            values = common.critic_outputs(critic, micro_batch)
            ppo.value_loss(values, old_values[micro, :width], returns[micro, :width], critic_weights[micro, :width],
                           hyper.value_clip, num_tokens=critic_weights.sum().item()).backward()
        logprobs = common.response_logprobs(policy, micro_batch)
        loss, _ = trainer.policy_loss(logprobs, old_logprobs[micro, :width], advantages[micro, :width],
                                      micro_batch.response_mask, hyper.clip_low, hyper.clip_high, hyper.aggregation,
                                      **counts)
        loss.backward()
        finite = finite and math.isfinite(loss.item())
    for model, optimizer in zip(models, optimizers):
        finite = finite and math.isfinite(torch.nn.utils.clip_grad_norm_(model.parameters(), hyper.grad_clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    cuda = device.startswith("cuda")
    return dict(peak=torch.cuda.max_memory_allocated() if cuda else peak_resident_bytes(), finite=finite,
                reserved=torch.cuda.max_memory_reserved() if cuda else 0, seconds=time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------- the checks
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


def trainer_problems(records, ratios, steps=3):
    """The failed assertions of one trainer run, one line each (none: it passed). ratios: observe's report."""
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
        for key, bound in GAP_BOUNDS.items():
            if not record.get(key, math.inf) <= bound:
                say(f"{key} {record.get(key)} > {bound:.2g}")
        ratio = ratios.get(str(step))
        if not ratio or not ratio["tokens"]:
            say("no first mini-batch observed")
        elif not ratio["max_dev"] <= RATIO_TOL:
            say(f"first mini-batch max |ratio - 1| {ratio['max_dev']:.2e} > {RATIO_TOL}")
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


class Check:
    """The runs of one check, their results (self.results, by name) and the log of every process."""

    def __init__(self, device, out, work, parts=PARTS):
        self.device, self.out, self.work, self.scale, self.parts = device, out, work, SCALES[device], parts
        self.started, self.results, self.log = time.time(), {}, []
        os.makedirs(os.path.join(work, "runs"), exist_ok=True)

    def left(self):
        return self.scale["budget"] - (time.time() - self.started)

    def run(self, name, argv, timeout):
        """A child process `python argv`, cut at `timeout` seconds or at the budget's end: (exit status, seconds)."""
        if self.left() < 10:
            self.log.append(f"===== {name}: not run, the {self.scale['budget']} s budget is spent\n")
            return "not run (budget spent)", 0.0
        env = dict(os.environ, PYTHONUNBUFFERED="1", **({"OMP_NUM_THREADS": "1"} if self.device == "cpu" else {}))
        began = time.time()
        try:
            done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=min(timeout, self.left()))
            status, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            status, output = "timed out", "".join(part.decode(errors="replace") if isinstance(part, bytes) else
                                                  part or "" for part in (expired.stdout, expired.stderr))
        seconds = time.time() - began
        self.log.append(f"===== {name}: exit {status} after {seconds:.0f} s: python {' '.join(argv)}\n{output}\n")
        print(f"  {name}: exit {status} after {seconds:.0f} s", flush=True)
        return status, seconds

    def observed(self, trainer, name, flags, timeout, fresh=True, deterministic=False):
        """Run `trainer` through observe: (exit status, seconds, records, ratios). fresh: the run folder
        --work/runs/<name> and its report of an earlier check are removed first."""
        report = os.path.join(self.work, f"{name}.ratios.json")
        if os.path.exists(report):
            os.remove(report)
        if fresh:
            shutil.rmtree(os.path.join(self.work, "runs", name), ignore_errors=True)
        status, seconds = self.run(name, [__file__, "observe", trainer, report, *["--deterministic"] * deterministic,
                                          "--", *flags], timeout)
        ratios = json.load(open(report)) if os.path.exists(report) else {}
        return status, seconds, metrics(os.path.join(self.work, "runs", name)), ratios

    def trainers(self):
        for trainer in TRAINERS:
            status, seconds, records, ratios = self.observed(
                trainer, trainer, trainer_flags(trainer, self.device, self.work), self.scale["train_timeout"])
            self.results[trainer] = dict(status=status, seconds=seconds, records=records, ratios=ratios, problems=(
                [] if status == 0 else [f"exit {status}"]) + trainer_problems(records, ratios))

    def compare(self):
        """ppo.py in float32: straight, offloaded, and 2 steps + --resume to 3."""
        runs, timeout = os.path.join(self.work, "runs"), self.scale["train_timeout"]
        base = ["--device", self.device, *COMPARE_FLAGS, *self.scale["compare"], "--output-dir", runs]
        logged = len(self.log)
        done = {name: self.observed("ppo", f"ppo_fp32_{name}", [*base, *extra, "--run-name", f"ppo_fp32_{name}"],
                                    timeout, deterministic=True)
                for name, extra in (("straight", ["--steps", "3"]), ("resume", ["--steps", "2"]),
                                    ("offload", ["--steps", "3", "--offload-optimizer"]))}
        status, seconds = self.observed("ppo", "ppo_fp32_resume", ["--device", self.device, "--resume", os.path.join(
            runs, "ppo_fp32_resume"), "--steps", "3"], timeout, fresh=False, deterministic=True)[:2]
        warned = sorted({line.strip()[:160] for entry in self.log[logged:] for line in entry.splitlines()
                         if "deterministic" in line and "Warning" in line})  # operations with no deterministic kernel
        exits = {name: f"{name}: exit {result[0]}" for name, result in done.items() if result[0] != 0}
        if status != 0:
            exits["resumed"] = f"--resume: exit {status}"
        straight, offload = done["straight"][2], done["offload"][2]
        resumed = metrics(os.path.join(runs, "ppo_fp32_resume"))  # steps 0-1, then 2 after the resume
        difference = relative_difference(straight, resumed)
        problems = [exits[n] for n in ("straight", "resume", "resumed") if n in exits]
        if not difference <= RESUME_TOL:
            problems.append(f"records differ by {difference:.2e} (relative) > {RESUME_TOL}")
        self.results["resume"] = dict(max_relative_difference=difference, seconds=done["resume"][1] + seconds,
                                      nondeterministic_warnings=warned, problems=problems)
        first, every = relative_difference(straight[:1], offload[:1]), relative_difference(straight, offload)
        problems = [exits[n] for n in ("straight", "offload") if n in exits]
        if not first <= OFFLOAD_TOL:
            problems.append(f"step 0 differs by {first:.2e} (relative) > {OFFLOAD_TOL}")
        problems += [f"step {r.get('step')}: not finite or no gradient" for r in offload
                     if not (math.isfinite(r.get("policy_loss", math.nan)) and r.get("grad_norm", 0) > 0)]
        weights = final_weight_difference(*(os.path.join(runs, f"ppo_fp32_{n}") for n in ("straight", "offload")))
        self.results["offload"] = dict(step0_relative_difference=first, relative_difference=every,
                                       weights_max_abs_difference=weights, seconds=done["offload"][1],
                                       problems=problems)

    def updates(self):
        from infra.memory import GIB
        config = update_config(self.scale["layers"], self.scale["shape"])
        for method in ("grpo", "ppo"):
            for response in self.scale["lengths"]:
                report = os.path.join(self.work, f"update_{method}_{response}.json")
                if os.path.exists(report):
                    os.remove(report)
                status, seconds = self.run(f"update {method} {response}", [
                    __file__, "update", method, str(response), self.device, str(self.scale["layers"]),
                    json.dumps(self.scale["shape"]), report], self.scale["update_timeout"])
                planned = planned_update(method, config, response, self.device)
                measured = json.load(open(report)) if status == 0 and os.path.exists(report) else {}
                ratio = sum(planned.values()) / measured["peak"] if measured.get("peak") else math.nan
                problems = [] if status == 0 else [f"exit {status}"]
                if not abs(ratio - 1) <= PLAN_TOL:
                    problems.append(f"plan / peak {ratio:.2f}, outside 1 +- {PLAN_TOL}")
                if not measured.get("finite", False):
                    problems.append("loss or gradient not finite")
                self.results[f"update {method} {response}"] = dict(
                    method=method, response=response, planned_gib=sum(planned.values()) / GIB,
                    plan_rows={k: v / GIB for k, v in planned.items()}, peak_gib=measured.get("peak", math.nan) / GIB,
                    reserved_gib=measured.get("reserved", 0) / GIB, ratio=ratio, seconds=seconds,
                    update_seconds=measured.get("seconds", math.nan), problems=problems)

    def speed(self):
        """bench_update.py's row (reported, not asserted): only when the budget leaves room for it."""
        timeout = min(self.scale["update_timeout"], self.left() - 15)
        if timeout < 60:
            self.results["speed"] = dict(row="not run: the budget is spent", problems=[])
            return
        status, seconds = self.run("bench_update.py", ["benchmarks/bench_update.py", "--device", self.device,
                                                       *self.scale["speed"]], timeout)
        row = next((line for line in self.log[-1].splitlines() if line.startswith(("| tiny ", "| qwen3"))), None)
        if row:  # model | parameters | tokens / step | timed steps | s / step | update tokens/s | MFU | generate | GiB
            cells = [cell.strip() for cell in row.strip("| \n").split("|")]
            row = f"{cells[2]} tokens a step: {cells[4]} s, {cells[5]} tokens/s, MFU {cells[6]}; generate {cells[7]} " \
                  f"tokens/s; peak {cells[8]} GiB"
        self.results["speed"] = dict(row=row or f"exit {status}", seconds=seconds, problems=[] if row else [
            f"bench_update.py: exit {status}, no table"])

    def table(self):
        """(Markdown text, whether every check passed)."""
        lines = [f"GPU check, {self.results.get('machine', '?')}", ""]
        if "trainers" in self.parts:
            lines += ["| trainer | exit, s | reward by step | max abs(ratio - 1), 1st mini-batch | grad norm min | "
                      "log-prob gap mean / max | result |", "|---|---|---|---:|---:|---|---|"]
            for trainer in TRAINERS:
                r = self.results[trainer]
                records, most = r["records"], lambda key, pick=max: pick([x.get(key, math.nan) for x in r["records"]]
                                                                         or [math.nan])
                rewards = " ".join(f"{x.get('reward', math.nan):.3f}" for x in records)
                ratio = max([s["max_dev"] for s in r["ratios"].values()] or [math.nan])
                lines.append(f"| {trainer}.py | {r['status']}, {r['seconds']:.0f} | {rewards} | {ratio:.1e} | "
                             f"{most('grad_norm', min):.3g} | {most('logprob_gap_mean'):.1e} / "
                             f"{most('logprob_gap_max'):.2f} | {verdict(r)} |")
            gap_mean, gap_max = GAP_BOUNDS["logprob_gap_mean"], GAP_BOUNDS["logprob_gap_max"]
            lines += ["", f"Bounds at every step: max abs(ratio - 1) <= {RATIO_TOL}; grad norm > 0; log-prob gap "
                          f"(bf16) mean <= {gap_mean:.1e}, max <= {gap_max}; reward > 0; every figure finite.", ""]
        lines += ["| check | measured | bound | s | result |", "|---|---|---|---:|---|"]
        resume, offload = self.results.get("resume"), self.results.get("offload")
        if resume:
            warned = len(resume["nondeterministic_warnings"])
            lines.append(f"| ppo.py float32: 2 steps + --resume vs 3 straight | max relative difference "
                         f"{resume['max_relative_difference']:.1e}" + f" ({warned} warnings of nondeterministic "
                         f"operations: gpu_check.json)" * bool(warned) + f" | <= {RESUME_TOL} | "
                         f"{resume['seconds']:.0f} | {verdict(resume)} |")
        if offload:
            lines.append(f"| ppo.py float32: --offload-optimizer vs straight | step 0: "
                         f"{offload['step0_relative_difference']:.1e}; steps 0-2: {offload['relative_difference']:.1e}"
                         f"; final weights: {offload['weights_max_abs_difference']:.1e} | step 0 <= {OFFLOAD_TOL} | "
                         f"{offload['seconds']:.0f} | {verdict(offload)} |")
        peak = "max_memory_allocated" if self.device == "cuda" else "resident high-water mark"
        for name, r in self.results.items():
            if name.startswith("update "):
                lines.append(f"| Qwen3-0.6B shape, {self.scale['layers']} layer(s): {r['method']} update, "
                             f"{r['response']:,} response tokens | peak {r['peak_gib']:.2f} GiB ({peak}), plan "
                             f"{r['planned_gib']:.2f}, plan / peak {r['ratio']:.2f}; update {r['update_seconds']:.1f} "
                             f"s | plan / peak in 1 +- {PLAN_TOL} | {r['seconds']:.0f} | {verdict(r)} |")
        if "speed" in self.results:
            speed = self.results["speed"]
            lines.append(f"| bench_update.py {' '.join(self.scale['speed'][:2])} (speed) | {speed['row']} | reported | "
                         f"{speed.get('seconds', 0):.0f} | {verdict(speed)} |")
        failed = [name for name, r in self.results.items() if isinstance(r, dict) and r.get("problems")]
        lines += ["", f"total {time.time() - self.started:.0f} s; " + (
            f"FAILED: {', '.join(failed)}" if failed else "every check passed")]
        return "\n".join(lines), not failed

    def write(self, text):
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "gpu_check.md"), "w") as handle:
            handle.write(text + "\n")
        with open(os.path.join(self.out, "gpu_check.json"), "w") as handle:
            json.dump(self.results, handle, indent=1, default=str)
        with open(os.path.join(self.out, "gpu_check.log"), "w") as handle:
            handle.write("".join(self.log)[-15 * 2 ** 20:])  # the device tool brings back files of up to 16 MiB


def verdict(result):
    return "ok" if not result["problems"] else "FAIL: " + "; ".join(result["problems"])[:200].replace("|", "/")


def machine(device):
    import torch
    import transformers
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        where = f"{properties.name} ({properties.total_memory / 2 ** 30:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        where = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, load " \
                f"{os.getloadavg()[0]:.2f})"
    return f"{where}, Python {platform.python_version()}, torch {torch.__version__}, transformers " \
           f"{transformers.__version__}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=sorted(SCALES), help="cuda: the check; cpu: scaled down")
    parser.add_argument("--out", default="runs/gpu_check/out", help="where the table, figures and log go")
    parser.add_argument("--work", default="runs/gpu_check", help="the runs' folders (the tiny model's checkpoints)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="run only these parts")
    args = parser.parse_args()
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device here; --device cpu runs the check scaled down")
    check = Check(args.device, os.path.abspath(args.out), os.path.abspath(args.work), args.parts)
    check.results["machine"] = machine(args.device)
    print(f"GPU check, {check.results['machine']}; budget {check.scale['budget']} s", flush=True)
    for part in PARTS:
        if part in args.parts:
            getattr(check, part)()
    text, passed = check.table()
    print(text)
    check.write(text)
    return 0 if passed else 1


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "trainers":
        print(*TRAINERS)
    elif command == "observe":  # observe TRAINER REPORT [--deterministic] -- FLAGS...
        split = sys.argv.index("--")
        observe(sys.argv[2], sys.argv[3], sys.argv[split + 1:], "--deterministic" in sys.argv[4:split])
    elif command == "update":  # update METHOD RESPONSE DEVICE LAYERS SHAPE_JSON REPORT
        method, response, device, layers, shape, report = sys.argv[2:8]
        figures = one_update(method, int(response), device, int(layers), json.loads(shape))
        with open(report, "w") as handle:
            json.dump(figures, handle)
    else:
        sys.exit(main())
