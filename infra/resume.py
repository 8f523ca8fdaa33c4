"""The run folder: its name, a clash with a run already there, --resume (a resumed run keeps the settings it was
started with; RESUME_MAY_CHANGE lists what its command line may change), and what a run leaves: its summary and how
to continue it. Messages name the command to run next.
"""
import dataclasses
import glob
import json
import os
import re
import shlex
import sys
import time

import torch

from infra import UserError, dist
from infra.checkpoint import _checkpoint_steps, find_checkpoint


# What a resumed run may change on its command line: how long it trains (unless its learning rate is scheduled over
# its steps: fixed_steps), when it evaluates and saves, where it logs, and how it runs on this machine (losses are
# exact for any micro-batch split); never what it computes. Everything else comes from its saved settings
# (config.json, updated by the latest config.resume_<step>.json).
RESUME_MAY_CHANGE = ("steps", "eval_every", "save_every", "keep_checkpoints", "max_skipped_updates", "tensorboard",
                     "wandb_project", "eval_only", "device", "gpu_memory_utilization", "vllm_kv_cache_gib",
                     "micro_batch_size", "micro_batch_tokens", "gradient_checkpointing", "hf_batch_size", "gpus",
                     "gpu_memory_gib", "plan_only", "threads")
WHERE = ("resume", "run_name", "output_dir")  # where a run is, not how it runs


def command(*flags):
    """The command line that runs this trainer with `flags`, for messages that say what to run next."""
    launcher = f"torchrun --nproc-per-node {dist.world_size()}" if dist.distributed() else "python"
    return " ".join([launcher, sys.argv[0], *(shlex.quote(str(flag)) for flag in flags)])


def _value_text(value):
    return " ".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value) if value != "" else "''"


def _flag_text(name, value):
    if isinstance(value, bool):
        return f"--{'' if value else 'no-'}{name.replace('_', '-')}"
    return f"--{name.replace('_', '-')} {_value_text(value)}"


def _new_run_hint(checkpoint):
    """How to start a new run instead of resuming one."""
    if checkpoint:
        return f"start a new run from its weights: --model {os.path.join(checkpoint, 'policy')} --run-name NAME"
    return "start a new run: --run-name NAME without --resume"


def fixed_steps(settings):
    """Why a run that has trained keeps its --steps on --resume, or None. A learning rate scheduled over the run's
    steps (SPO's --lr-schedule warmup-decay: a linear decay to 0 at the last one) cannot be stretched exactly: a
    schedule recomputed over new steps jumps (a finished run, decayed to ~0, would restart near half its peak with
    --steps 2N), and the old one kept would train past its end at lr 0. So a resume keeps the schedule, and its
    steps; a run trains further as a new run from its weights, with a schedule of its own. `settings`: a dict."""
    schedule = settings.get("lr_schedule", "constant")
    return None if schedule == "constant" else \
        f"its learning rate follows --lr-schedule {schedule} over its {settings['steps']} steps"


def train_further(settings, run_dir, step):
    """The command that trains a run of `step` finished steps further: a resume with twice the steps, or, for a run
    whose steps are fixed (fixed_steps), a new run from its last checkpoint's weights."""
    reason = fixed_steps(settings)
    if reason:
        return f"{_new_run_hint(os.path.join(run_dir, 'checkpoints', f'step_{step:06d}'))} (a resume keeps " \
               f"--steps {settings['steps']}: {reason})"
    return command("--resume", run_dir, "--steps", 2 * step)


def resume_point(resume):
    """What `--resume resume` continues: (run folder, checkpoint or None, finished steps). A run folder with no
    checkpoint yet starts again from step 0 with its saved settings. UserError (one line, cheap: before any model)."""
    if os.path.isdir(resume) and os.path.exists(os.path.join(resume, "config.json")) \
            and not _checkpoint_steps(os.path.join(resume, "checkpoints")):
        return os.path.abspath(resume), None, 0
    checkpoint = find_checkpoint(resume)
    parent = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(parent) != "checkpoints":
        raise UserError(f"--resume {resume}: not in a run folder (<run>/checkpoints/step_<n>), so its settings are "
                        f"unknown; {_new_run_hint(checkpoint)}")
    state = torch.load(os.path.join(checkpoint, "trainer_state.pt"), map_location="cpu", weights_only=True)
    return os.path.dirname(parent), checkpoint, state["step"]


def saved_settings(run_dir):
    """The settings a run was started with (config.json), as updated by its latest resume (config.resume_*.json)."""
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        raise UserError(f"--resume {run_dir}: no config.json in it, so the run's settings are unknown")
    with open(path) as handle:
        settings = json.load(handle)
    records = []
    for record_path in glob.glob(os.path.join(run_dir, "config.resume_*.json")):
        with open(record_path) as handle:
            records.append(json.load(handle))
    if records:
        settings = max(records, key=lambda record: record["time"])["config"]
    return {name: tuple(value) if isinstance(value, list) else value for name, value in settings.items()
            if name not in ("resume", "eval_only")}  # what this command does, not a setting of the run


def check_resume(args, saved, run_dir, checkpoint, step):
    """A resumed run keeps its saved settings: refuse any other change than RESUME_MAY_CHANGE in one line, print the
    ones made; a finished run says so (exit code 0) and how to train it further."""
    if (args.run_name, args.output_dir) != (saved.run_name, saved.output_dir) and os.path.realpath(
            os.path.join(args.output_dir, args.run_name or os.path.basename(run_dir))) != os.path.realpath(run_dir):
        raise UserError(f"--resume continues {run_dir} in place: drop --run-name/--output-dir, or "
                        f"{_new_run_hint(checkpoint)}")
    changed = {field.name: (getattr(saved, field.name), getattr(args, field.name))
               for field in dataclasses.fields(args) if field.name not in WHERE
               and getattr(args, field.name) != getattr(saved, field.name)}
    refused = [name for name in changed if name not in RESUME_MAY_CHANGE]
    if refused:
        asked = ", ".join(f"{_flag_text(name, changed[name][1])} (saved: {_value_text(changed[name][0])})"
                          for name in refused)
        allowed = ", ".join("--" + name.replace("_", "-") for name in RESUME_MAY_CHANGE)
        raise UserError(f"--resume {run_dir}: a resumed run keeps its saved settings, and {asked} would change them "
                        f"(a resume may change only {allowed}); for other settings, {_new_run_hint(checkpoint)}")
    reason = fixed_steps(dataclasses.asdict(saved))
    if "steps" in changed and step and reason:  # no step trained yet: a schedule over the new steps is exact
        raise UserError(f"--resume {run_dir}: --steps {args.steps} (saved: {saved.steps}) would change the learning "
                        f"rate of the steps to come ({reason}; an exact resume keeps it): resume with --steps "
                        f"{saved.steps}, or to train longer, {_new_run_hint(checkpoint)}")
    if not args.eval_only and step >= args.steps:
        if dist.rank() == 0:
            print(f"{run_dir} is finished: {step} of {args.steps} steps done. To train it further: "
                  f"{train_further(dataclasses.asdict(args), run_dir, step)}", file=sys.stderr)
        raise SystemExit(0)
    where = f"from {os.path.basename(checkpoint)}" if checkpoint else "again from step 0 (no checkpoint yet)"
    if dist.rank() == 0:
        print(f"resuming {run_dir} {where} with its saved settings" + "".join(
            f"; {_flag_text(name, new)} (saved: {_value_text(old)})" for name, (old, new) in changed.items()))


def run_directory(args, trainer_file):
    """<output_dir>/<run_name>; a resumed run keeps writing where it was; a new run never reuses a folder that holds
    a checkpoint or a logged step (a folder left by a start that finished no step may be reused)."""
    if args.resume:
        path = os.path.abspath(args.resume)
        return os.path.dirname(os.path.dirname(path)) if os.path.basename(os.path.dirname(path)) == "checkpoints" \
            else path
    method = os.path.splitext(os.path.basename(trainer_file))[0]
    checkpoint = re.search(r"([^/]+)/checkpoints/step_0*(\d+)/policy/?$", os.path.abspath(args.model))
    if args.eval_only:  # one folder per evaluated model: runs/eval_<run>_step<n> for a checkpoint; reused
        model = f"{checkpoint.group(1)}_step{checkpoint.group(2)}" if checkpoint else os.path.basename(
            args.model.rstrip("/"))
        return os.path.join(args.output_dir, args.run_name or f"eval_{model}")
    model = os.path.basename(args.model.rstrip("/"))
    name = args.run_name or f"{method}_{model}_s{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    path = dist.broadcast_object(os.path.join(args.output_dir, name))  # rank 0's: the clock may tick between ranks
    steps = _checkpoint_steps(os.path.join(path, "checkpoints"))
    metrics = os.path.join(path, "metrics.jsonl")
    if steps or os.path.exists(metrics) and os.path.getsize(metrics):
        saved = saved_settings(path) if os.path.exists(os.path.join(path, "config.json")) else {}
        if steps and steps[-1] >= saved.get("steps", 0):
            raise UserError(f"{path} already holds a finished run ({steps[-1]} steps): to train it further: "
                            f"{train_further(saved, path, steps[-1])}; or pass another --run-name")
        held = f"checkpoint step_{steps[-1]:06d}" if steps else "logged steps, no checkpoint yet"
        raise UserError(f"{path} already holds a run ({held}): continue it with: {command('--resume', path)}; "
                        "or pass another --run-name")
    return path


def summary(run, steps_done):
    """What a finished (or stopped) infra.run.Run leaves: held-out figures first and last (of the evaluations that
    ran), time, where, and one command for each next thing: continue (--resume, or train further once finished) and
    evaluate."""
    args = run.args
    lines = [f"{run.trainer}: {steps_done - run.start_step} steps in {time.time() - run.started:.0f} s; run folder "
             f"{run.dir}"]
    (first_step, first), (last_step, last) = (run.evaluations or [(0, {})])[0], (run.evaluations or [(0, {})])[-1]
    for key, value in first.items():
        if re.search(r"/(avg|pass)@\d+$", key):
            lines.append(f"  {key}: {value:.4f} at step {first_step}" + (
                f" -> {last[key]:.4f} at step {last_step}" if last_step != first_step and key in last else ""))
    settings = dataclasses.asdict(args)
    more = args.steps if fixed_steps(settings) else max(args.steps, 2 * steps_done)
    lines.append("  continue: " + (command("--resume", run.dir) if steps_done < args.steps else
                                   train_further(settings, run.dir, steps_done) if more == steps_done else
                                   command("--resume", run.dir, "--steps", more)))
    checkpoint = os.path.join(run.dir, "checkpoints", f"step_{steps_done:06d}", "policy")
    digits = ("--dataset", args.dataset) if args.dataset.startswith("builtin:") and "builtin" in args.eval_datasets \
        else ()  # `builtin` evaluates the digits trained on
    evaluate = command("--eval-only", "--model", checkpoint, *digits, "--eval-datasets", *(args.eval_datasets or
                                                                                          ["FILE"]))
    return "\n".join(lines + [f"  evaluate: {evaluate}"])


def continue_hint(run_dir):
    """After an interrupt or a crash: the command that continues the run in `run_dir` (or starts it again)."""
    steps = _checkpoint_steps(os.path.join(run_dir, "checkpoints"))
    if steps:
        return f"to continue from step_{steps[-1]:06d}: {command('--resume', run_dir)}"
    if os.path.exists(os.path.join(run_dir, "config.json")):
        return f"{run_dir} has no checkpoint yet; to start it again with its settings: {command('--resume', run_dir)}"
    return f"nothing was saved; to start again: {command(*sys.argv[1:])}"


def resume_record(args, run_dir, checkpoint, step):
    """None for a new run; for a resumed one, what config.resume_<step>.json keeps: when, from which
    checkpoint, the flags changed ({flag: [saved, now]}) and the settings now in effect."""
    if not args.resume:
        return None
    saved = json.loads(json.dumps(saved_settings(run_dir)))
    now = json.loads(json.dumps(dataclasses.asdict(args)))
    changed = {name: [saved[name], value] for name, value in now.items()
               if name in saved and name not in WHERE and value != saved[name]}
    return {"time": time.time(), "checkpoint": checkpoint, "step": step, "changed": changed, "config": now}
