"""A training run's plumbing around a trainer's loop: the command line (RunArgs, the flags every trainer shares;
tyro builds the CLI and its --help from the dataclass), the run folder and its logs, the evaluation schedule,
checkpoints and resume (with the run's saved settings), skipped non-finite updates, and stopping on Ctrl-C or SIGTERM
after a whole step. Every check that can be made runs before the run folder exists; a start that finishes no step
leaves no folder behind.
"""
import contextlib
import dataclasses
import glob
import io
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from infra import UserError, data, dist, memory
from infra.checkpoint import (_checkpoint_steps, find_checkpoint, load_checkpoint, save_checkpoint,
                              seed_everything)
from infra.engine import check_generator, make_generator
from infra.hub import check_model_source
from infra.evaluate import eval_table, evaluate
from infra.tiny import is_tiny_model


@dataclass
class RunArgs:
    """Flags of every trainer: what to train and evaluate on, where the run goes, how it runs."""
    model: str = "tiny"  # policy: `tiny` (built-in CPU demo), a hub name (Qwen3-4B-Base) or a local path
    dataset: str = "builtin"  # training problems: `builtin`, a .jsonl/.json/.parquet file or a hub dataset id
    # dotted path of --dataset's prompt, e.g. extra_info.question (empty: question, problem or prompt)
    question_field: str = ""
    # dotted path of --dataset's gold answer (empty: answer, solution, ground_truth, label or reward_model.ground_truth)
    answer_field: str = ""
    # --dataset's reward: the last \boxed{} (math-verify) or the last `Answer:` line (DAPO's rule); auto: what each
    # prompt asks for. Evaluation sets always take auto.
    answer_format: Literal["auto", "boxed", "answer-line"] = "auto"
    eval_datasets: tuple[str, ...] = ("builtin",)  # held-out sets: .jsonl/.json/.parquet files, hub ids or `builtin`
    eval_only: bool = False  # evaluate --model (a hub model or a checkpoint's policy/ directory) and exit
    steps: int = 500  # rollout iterations
    seed: int = 0  # seed of data order, sampling and initialization
    run_name: str = ""  # run folder <output-dir>/<run-name>/ (default: <method>_<model>_s<seed>_<time>)
    output_dir: str = "runs"  # parent directory of runs
    resume: str = ""  # continue from a checkpoint directory (runs/<run>/checkpoints/step_N) or a run directory
    generator: Literal["auto", "hf", "vllm"] = "auto"  # rollout engine (auto: vLLM when it imports and CUDA is there)
    device: str = ""  # torch device (default: cuda when available, else cpu)
    dtype: str = "auto"  # compute dtype (auto: bfloat16 on GPU, float32 on CPU); weights stay float32
    gpu_memory_utilization: float = 0.3  # share of GPU memory for the colocated vLLM engine (asleep in the update)
    vllm_kv_cache_gib: float = 1.0  # KV cache of a vLLM engine on CPU, GiB (on GPU --gpu-memory-utilization sizes it)
    trust_remote_code: bool = False  # allow custom model code from the hub (off: never run downloaded code)
    micro_batch_size: int = 8  # sequences per forward/backward; gradients accumulate up to a mini-batch
    micro_batch_tokens: int = 0  # pack micro-batches by padded tokens per forward instead, longest first (0: off)
    gradient_checkpointing: bool = True  # recompute activations in the backward pass (less memory, ~30% slower)
    offload_optimizer: bool = False  # float32 weights, gradients and AdamW states in CPU memory (FSDP2 CPU offload)
    gpu_memory_gib: float = 0.0  # plan for GPUs of this size and refuse a run that cannot fit (0: the device's own)
    eval_every: int = 50  # evaluate every N steps (and always at the first and last step; 0: only those)
    eval_problems: int = 0  # held-out problems per evaluation (0: all)
    eval_n: int = 32  # samples per held-out problem for avg@n and pass@k (published: 32)
    eval_temperature: float = 1.0  # evaluation temperature (published: 1.0; 0 is greedy)
    eval_top_p: float = 0.95  # evaluation nucleus sampling (published: 0.95)
    eval_max_tokens: int = 8192  # evaluation response length limit
    skip_bad_rows: bool = False  # skip malformed dataset rows (reported as a count) instead of stopping
    max_skipped_updates: int = 5  # stop after this many non-finite updates in a row (a checkpoint is saved)
    save_every: int = 50  # checkpoint every N steps, and at the end (0: only at the end)
    keep_checkpoints: int = 2  # how many recent checkpoints to keep
    tensorboard: bool = False  # also log to TensorBoard in the run directory
    wandb_project: str = ""  # also log to this Weights & Biases project


# The CPU demo's run flags (each trainer's TINY_PRESET adds its own batch sizes and learning rates): greedy
# evaluation on 256 held-out problems before the first update and after the last, no intermediate checkpoints.
RUN_TINY_PRESET = dict(steps=60, micro_batch_size=64, gradient_checkpointing=False, eval_every=0, eval_problems=256,
                       eval_n=1, eval_temperature=0.0, eval_top_p=1.0, eval_max_tokens=48, save_every=0)


# What a resumed run may change on its command line: how long it trains, when it evaluates and saves, where it logs,
# and how it runs on this machine (losses are exact for any micro-batch split); never what it computes. Everything
# else comes from its saved settings (config.json, updated by the latest config.resume_<step>.json).
RESUME_MAY_CHANGE = ("steps", "eval_every", "save_every", "keep_checkpoints", "max_skipped_updates", "tensorboard",
                     "wandb_project", "eval_only", "device", "gpu_memory_utilization", "vllm_kv_cache_gib",
                     "micro_batch_size", "micro_batch_tokens", "gradient_checkpointing")
WHERE = ("resume", "run_name", "output_dir")  # where a run is, not how it runs


def _flag_value(argv, flag):
    """The value of `flag` in argv (`--flag value` or `--flag=value`), None when absent."""
    value = next((argv[i + 1] for i in range(len(argv) - 1) if argv[i] == flag), None)
    return next((a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")), value)


def parse_args(args_class, tiny_preset=None, argv=None):
    """The command line of a trainer: flags from the dataclass's fields, help from their comments (tyro). Fields
    the user did not set take the tiny preset when --model is the built-in model (or a checkpoint of it), else the
    dataclass defaults (the published settings); --help shows the values in effect for the model given. With
    --resume they take the run's saved settings, and only RESUME_MAY_CHANGE may differ (each change printed)."""
    import tyro
    argv = sys.argv[1:] if argv is None else list(argv)
    names = {field.name for field in dataclasses.fields(args_class)}
    resume, preset = _flag_value(argv, "--resume"), {}
    if resume:
        point = resume_point(resume)
        saved = saved_settings(point[0])
        unknown = sorted(set(saved) - names)
        if unknown:
            raise UserError(f"--resume {resume}: its saved settings have flags this trainer lacks "
                            f"({', '.join(unknown[:4])}); it was made by another trainer")
        defaults = args_class(**saved)
        description = f"{(args_class.__doc__ or '').strip()} Defaults shown: the saved settings of {point[0]}."
    else:
        model = _flag_value(argv, "--model") or getattr(args_class, "model", "")
        preset = {**RUN_TINY_PRESET, **(tiny_preset or {})} if is_tiny_model(model) else {}
        defaults = args_class(**{name: value for name, value in preset.items() if name in names})
        description = (args_class.__doc__ or "").strip()
        if hasattr(args_class, "model"):
            description += (f" Defaults shown: the built-in CPU demo's preset (--model {model}); a real model gets "
                            "the published ones." if preset else f" Defaults shown: the published settings (--model "
                            f"{model}).")
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = tyro.cli(args_class, args=argv, default=defaults, description=description)
    except SystemExit as exit_:
        if exit_.code:  # tyro's error box, in one line
            lines = [line.strip("│╭╮╰╯─ \t") for line in errors.getvalue().splitlines()]  # with or without a box
            lines = [line for line in lines if line.strip("-─")]  # [title, message, ...]
            message = lines[1] if len(lines) > 1 else "; ".join(lines)
            if "Perhaps you meant:" in lines:
                flags = [line.split()[0] for line in lines[lines.index("Perhaps you meant:"):] if line.startswith("--")]
                message += f"; did you mean {' or '.join(flags)}?"
            print(f"{os.path.basename(sys.argv[0])}: error: {message} (see --help)", file=sys.stderr)
            raise SystemExit(2)
        raise
    check_ranges(args)
    if resume:
        check_resume(args, defaults, *point)
    return args


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
    if not args.eval_only and step >= args.steps:
        if dist.rank() == 0:
            print(f"{run_dir} is finished: {step} of {args.steps} steps done. To train it further: "
                  f"{command('--resume', run_dir, '--steps', 2 * step)}", file=sys.stderr)
        raise SystemExit(0)
    where = f"from {os.path.basename(checkpoint)}" if checkpoint else "again from step 0 (no checkpoint yet)"
    if dist.rank() == 0:
        print(f"resuming {run_dir} {where} with its saved settings" + "".join(
            f"; {_flag_text(name, new)} (saved: {_value_text(old)})" for name, (old, new) in changed.items()))


POSITIVE_SIZES = ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs", "micro_batch_size", "eval_n",
                  "keep_checkpoints", "max_skipped_updates", "max_response_tokens", "eval_max_tokens")


def check_ranges(args):
    """Refuse sizes and rates no run can use, in one line, before any model loads."""
    for name in POSITIVE_SIZES:
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "steps", 1) < 1 and not getattr(args, "eval_only", False):
        raise UserError(f"--steps must be at least 1, got {args.steps} (--eval-only evaluates without training)")
    for name in ("save_every", "eval_every", "eval_problems"):
        if getattr(args, name, 0) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    for name in ("lr", "critic_lr", "vllm_kv_cache_gib"):
        if hasattr(args, name) and not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise UserError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if getattr(args, "temperature", 1.0) <= 0:
        raise UserError("--temperature must be > 0 for training rollouts (the log-probs are divided by it)")
    for name in ("top_p", "eval_top_p"):
        if not 0 < getattr(args, name, 1.0) <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(args, name)}")
    if getattr(args, "eval_n", 1) > 1 and getattr(args, "eval_temperature", 1.0) == 0:
        print(f"warning: --eval-n {args.eval_n} with greedy evaluation (--eval-temperature 0) draws {args.eval_n} "
              "identical samples, so pass@k = avg@n; add --eval-temperature 1.0 to sample", file=sys.stderr)


def check_integrations(args):
    """--tensorboard and --wandb-project need packages that are optional: refuse in one line, with the pip command,
    before the run folder exists (they are imported here, so a broken install fails here too)."""
    if args.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as error:
            raise UserError(f"--tensorboard needs TensorBoard: pip install tensorboard ({error})")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError as error:
            raise UserError(f"--wandb-project needs Weights & Biases: pip install wandb, then wandb login ({error})")


def run_main(main):
    """Run a trainer's main(): a UserError becomes a one-line message and exit code 2, a second Ctrl-C code 130.
    On the way out the run is closed (Run.close): a start that finished no step leaves no folder behind."""
    hint = True  # after an interrupt or a crash: say how to continue
    try:
        main()
        hint = False
    except UserError as error:
        hint = False
        if dist.rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        for run in list(_OPEN_RUNS):
            run.close(hint)
        if dist.sharded() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


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
        planned = saved_settings(path).get("steps", 0) if os.path.exists(os.path.join(path, "config.json")) else 0
        if steps and steps[-1] >= planned:
            raise UserError(f"{path} already holds a finished run ({steps[-1]} steps): to train it further: "
                            f"{command('--resume', path, '--steps', 2 * steps[-1])}; or pass another --run-name")
        held = f"checkpoint step_{steps[-1]:06d}" if steps else "logged steps, no checkpoint yet"
        raise UserError(f"{path} already holds a run ({held}): continue it with: {command('--resume', path)}; "
                        "or pass another --run-name")
    return path


class Logger:
    # The step line: what a user acts on, in this order, cut to 120 columns; every metric goes to metrics.jsonl.
    SHOWN = {"reward": "reward", "eval/accuracy": "eval", "response_length": "len", "policy_loss": "loss", "value_loss": "vloss",
             "clip_fraction": "clip", "approx_kl": "kl", "grad_norm": "gnorm", "explained_variance": "ev",
             "probe/sign_acc_tau1": "sign", "mc_tokens": "mc_tok", "tokens_per_s": "tok/s"}

    def __init__(self, run_dir, args, resume_record=None):
        """Writes the run's settings: config.json for a new run; a resumed run never overwrites them, it writes its
        own record (config.resume_<step>.json: the checkpoint, the flags changed, the settings in effect)."""
        self.path, self.tensorboard, self.wandb, self.records = os.path.join(run_dir, "metrics.jsonl"), None, None, 0
        if dist.rank() > 0:  # under torchrun rank 0 writes for all
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "config.json")
        if resume_record is not None:
            path = os.path.join(run_dir, f"config.resume_{resume_record['step']:06d}.json")
            for again in range(2, 1000):  # resumed from the same step before: keep that record too
                if not os.path.exists(path):
                    break
                path = os.path.join(run_dir, f"config.resume_{resume_record['step']:06d}_{again}.json")
        with open(path, "w") as handle:
            json.dump(resume_record or dataclasses.asdict(args), handle, indent=1)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(run_dir)
        if args.wandb_project:
            import wandb
            try:
                self.wandb = wandb.init(project=args.wandb_project, name=os.path.basename(run_dir),
                                        config=dataclasses.asdict(args))
            except Exception as error:  # not logged in, no network, ...
                raise UserError(f"--wandb-project: wandb.init failed ({type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else ''}); run `wandb login`, or set "
                                "WANDB_MODE=offline")

    def log(self, step, metrics, write=print):
        """Under torchrun every rank calls it: a metric is the mean of the ranks' values (each rank's losses are
        already its estimate of the global one)."""
        shares = dist.gather_objects({k: float(v) for k, v in metrics.items()})
        record = {"step": step, **{k: float(np.mean([s[k] for s in shares if k in s]))
                                   for k in dict.fromkeys(k for s in shares for k in s)}}
        if dist.rank() > 0:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.records += 1
        write(self.step_line(record))
        if self.tensorboard:
            for key, value in record.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(record, step=step)


    def step_line(self, record):
        """`step   12 reward 0.461 len 38.4 loss -0.00305 ...`, at most 120 characters; `(critic warm-up)` while
        the actor is frozen."""
        line = f"step {record['step']:4d}" + (" (critic warm-up)" if record.get("actor_frozen") else "")
        for key, label in self.SHOWN.items():
            if key in record:
                value = record[key]
                part = f" {label} {value:.0f}" if abs(value) >= 100 else f" {label} {value:.3g}"
                line += part if len(line) + len(part) <= 120 else ""
        return line


class StopSignals:
    """The first Ctrl-C (SIGINT) or SIGTERM (what Slurm and Kubernetes send before they kill a job) asks the loop to
    stop after the current step (`requested`), so the checkpoint then saved holds whole steps (a stop in the middle
    of an update would save half of one); a second one raises KeyboardInterrupt at once, without saving (during a
    checkpoint's writing: once it is written, see writing()). restore() puts the previous handlers back."""
    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.signalled = None  # the name of the first signal
        self.writing_checkpoint = self.stop_after_writing = False
        self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}

    @property
    def requested(self):
        """Under torchrun: whether any rank got a signal, so that all stop after the same step."""
        return dist.rank_mean(bool(self.signalled)) > 0 if dist.distributed() else bool(self.signalled)

    def _handle(self, signum, frame):
        name = self.SIGNALS[signum]
        if self.signalled and self.writing_checkpoint:
            print(f"\n{name} again: stopping once the checkpoint being written is whole", file=sys.stderr)
            self.stop_after_writing = True
            return
        if self.signalled:
            print(f"\n{name} again: stopping now, without saving this step", file=sys.stderr)
            raise KeyboardInterrupt
        self.signalled = name
        print(f"\n{name}: stopping after this step, with a checkpoint (Ctrl-C again: stop now, without one)",
              file=sys.stderr)

    @contextlib.contextmanager
    def writing(self):
        """A checkpoint is being written: a second signal stops the run once it is whole (an interrupt inside the
        writers' C++ code would abort the process)."""
        self.writing_checkpoint = True
        try:
            yield
        finally:
            self.writing_checkpoint = False
        if self.stop_after_writing:
            raise KeyboardInterrupt

    def restore(self):
        for number, handler in self.previous.items():
            signal.signal(number, handler)


_OPEN_RUNS = []  # runs whose folder this process opened: run_main closes them on the way out


class Run:
    """One training run around a trainer's loop:

        run = Run(args, __file__)                 # devices, run folder, data: bad input fails before any model loads
        generator = run.start(models, optimizers, tokenizer)   # logging, --resume, the rollout engine
        for step, metrics in run.steps():         # metrics holds the evaluation when one is due
            ...                                   # rollout, reward, advantages, update
            run.end_step(step, metrics)           # last evaluation, log line, checkpoint; Ctrl-C stops here
    """

    def __init__(self, args, trainer_file):
        self.args = args
        check_integrations(args)  # --tensorboard, --wandb-project: importable
        self.device = dist.init_device(args.device, args.offload_optimizer)  # torchrun or offload: a process group
        check_generator(args.generator, self.device)  # --generator vllm: runnable here
        check_model_source(args.model)  # a missing --model fails in one line, in seconds (offline too)
        memory.check(args, trainer_file, self.device)  # the memory plan per GPU: refused here if it cannot fit
        self.dir = run_directory(args, trainer_file)  # a clash with an existing run fails before any model loads
        self.resume_path, self.resumed_step = resume_point(args.resume)[1:] if args.resume else (None, 0)
        self.train_rows = data.load_rows(args.dataset, "train", n_builtin=65536, seed=args.seed,
                                         skip_bad_rows=args.skip_bad_rows, question_field=args.question_field,
                                         answer_field=args.answer_field, answer_format=args.answer_format)
        self.eval_sets = data.load_eval_sets(args.eval_datasets, args.eval_problems, args.skip_bad_rows)
        if dist.rank() == 0:  # what auto decided, before any model loads
            print(data.describe(args.dataset, self.train_rows), *(data.describe(name, rows) for name, rows in
                                                                    self.eval_sets.items()), sep="\n")
        self.probe_rows = next(iter(self.eval_sets.values()))  # held-out prompts of the critic probes
        self.skipped_in_a_row, self.stopping, self.saved, self.first_eval, self.last = 0, False, False, {}, (0, {})
        self.trainer, self.started = os.path.basename(trainer_file), time.time()
        seed_everything(args.seed)

    def start(self, models, optimizers, tokenizer):
        """Open the run folder's logs, restore --resume's checkpoint, build the rollout engine (returned)."""
        self.models, self.optimizers, self.tokenizer = models, optimizers, tokenizer
        self.entries_before = os.listdir(self.dir) if os.path.isdir(self.dir) else None  # None: this run makes it
        _OPEN_RUNS.append(self)  # run_main closes it on the way out
        self.logger = Logger(self.dir, self.args, self.resume_record())
        self.start_step = load_checkpoint(self.resume_path, models, optimizers) if self.resume_path else 0
        self.generator = make_generator(self.args.generator, models["policy"], tokenizer,
                                        self.args.gpu_memory_utilization, self.args.seed, self.args.vllm_kv_cache_gib)
        return self.generator

    def resume_record(self):
        """None for a new run; for a resumed one, what config.resume_<step>.json keeps: when, from which
        checkpoint, the flags changed ({flag: [saved, now]}) and the settings now in effect."""
        if not self.args.resume:
            return None
        saved = json.loads(json.dumps(saved_settings(self.dir)))
        now = json.loads(json.dumps(dataclasses.asdict(self.args)))
        changed = {name: [saved[name], value] for name, value in now.items()
                   if name in saved and name not in WHERE and value != saved[name]}
        return {"time": time.time(), "checkpoint": self.resume_path, "step": self.resumed_step, "changed": changed,
                "config": now}

    def close(self, hint=False):
        """On the way out (run_main calls it, before it destroys the process group): the rollout engine shuts down;
        a start that logged no step and saved nothing removes what it wrote in the run folder (the folder too, if it
        made it), so no folder blocks a restart; with `hint` (after an interrupt or a crash) says which command
        continues the run."""
        if self in _OPEN_RUNS:
            _OPEN_RUNS.remove(self)
        generator, self.generator = getattr(self, "generator", None), None
        if generator is not None:  # a vLLM engine shuts down while the process group it joined is still there
            generator.close()
        if dist.rank() > 0:
            return
        logger = getattr(self, "logger", None)
        if logger is not None and logger.tensorboard:
            logger.tensorboard.close()
        if logger is not None and logger.wandb:
            logger.wandb.finish()
        if not (logger and logger.records) and not self.saved and os.path.isdir(self.dir):
            for name in set(os.listdir(self.dir)) - set(self.entries_before or ()):
                path = os.path.join(self.dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
            if self.entries_before is None and not os.listdir(self.dir):
                os.rmdir(self.dir)
        if not hint:
            return
        steps = _checkpoint_steps(os.path.join(self.dir, "checkpoints"))
        if steps:
            message = f"to continue from step_{steps[-1]:06d}: {command('--resume', self.dir)}"
        elif os.path.exists(os.path.join(self.dir, "config.json")):
            message = f"{self.dir} has no checkpoint yet; to start it again with its settings: " \
                      f"{command('--resume', self.dir)}"
        else:
            message = f"nothing was saved; to start again: {command(*sys.argv[1:])}"
        print(message, file=sys.stderr)

    def training_rows(self, step):
        """This rank's share of the prompts of rollout `step` (a function of the step: exact resume)."""
        return dist.rank_share(data.step_rows(self.train_rows, step, self.args.prompts_per_step, self.args.seed))

    def evaluate(self):
        """Held-out evaluation with the --eval-* flags (its own seed: training randomness is untouched); prints
        the table."""
        a = self.args
        metrics = evaluate(self.generator, self.tokenizer, self.eval_sets, a.eval_n, a.eval_max_tokens,
                           a.eval_temperature, a.eval_top_p)
        self.write(eval_table(metrics))
        return metrics

    def evaluate_only(self):
        """--eval-only: evaluate the loaded policy, log it as the current step, and return the metrics."""
        self.write = print
        metrics = self.evaluate()
        self.logger.log(self.start_step, metrics, lambda line: None)
        return metrics

    def steps(self):
        """(step, metrics) for each remaining step, under a progress bar; metrics starts with the held-out
        evaluation at the first step and every --eval-every steps. The first Ctrl-C or SIGTERM stops after a whole
        step."""
        self.signals = StopSignals()
        progress = tqdm(range(self.start_step, self.args.steps), desc=os.path.basename(self.dir),
                        initial=self.start_step, total=self.args.steps, disable=dist.rank() > 0)
        self.write = progress.write
        try:
            for step in progress:
                due = step == self.start_step or (self.args.eval_every and step % self.args.eval_every == 0)
                metrics = self.evaluate() if due else {}
                self.first_eval = self.first_eval or metrics
                yield step, metrics
                if self.stopping:
                    break
            progress.close()
            if dist.rank() == 0:
                print(self.summary(*self.last))
        finally:
            self.signals.restore()

    def update_ok(self, step, *grad_norms):
        """Whether an optimizer step may be taken: all gradient norms finite. After --max-skipped-updates
        non-finite ones in a row the run stops, with a checkpoint of the last good state."""
        finite = all(bool(torch.isfinite(norm)) for norm in grad_norms)
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        if self.skipped_in_a_row >= self.args.max_skipped_updates:
            path = self.save(step)
            raise UserError(f"{self.skipped_in_a_row} non-finite updates in a row at step {step}; "
                            f"the last good state is saved in {path}")
        return finite

    def end_step(self, step, metrics):
        """After a step's update: the evaluation after the last one, the log line and record, the checkpoint
        (every --save-every steps, at the end, and on Ctrl-C or SIGTERM, which then stops the run)."""
        if step == self.args.steps - 1:
            metrics.update(self.evaluate())
        self.logger.log(step, metrics, self.write)
        self.stopping = self.signals.requested
        if self.args.save_every and (step + 1) % self.args.save_every == 0 or step == self.args.steps - 1 \
                or self.stopping:
            self.save(step + 1)
        if self.stopping:
            self.write(f"stopped after step {step} ({self.signals.signalled or 'another rank was signalled'}); "
                       f"continue with: {command('--resume', self.dir)}")
        self.last = (step + 1, metrics)

    def summary(self, steps_done, last_metrics):
        """What a finished (or stopped) run leaves: held-out figures first and last, time, where, what next."""
        lines = [f"{self.trainer}: {steps_done - self.start_step} steps in {time.time() - self.started:.0f} s; "
                 f"run folder {self.dir}"]
        for key, first in self.first_eval.items():
            if re.search(r"/(avg|pass)@\d+$", key) and key in last_metrics:
                lines.append(f"  {key}: {first:.4f} at step {self.start_step} -> {last_metrics[key]:.4f} at step "
                             f"{steps_done}")
        checkpoint = os.path.join(self.dir, "checkpoints", f"step_{steps_done:06d}", "policy")
        more = max(self.args.steps, 2 * steps_done)
        lines.append(f"  continue: {command('--resume', self.dir, '--steps', more)}")
        lines.append(f"  evaluate: {command('--eval-only', '--model', checkpoint, '--eval-datasets', *self.args.eval_datasets)}")
        return "\n".join(lines)

    def save(self, step):
        self.saved = True
        signals = getattr(self, "signals", None)
        with signals.writing() if signals else contextlib.nullcontext():
            return save_checkpoint(self.dir, step, self.models, self.optimizers, self.tokenizer,
                                   self.args.keep_checkpoints)
