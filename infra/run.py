"""A training run's plumbing around a trainer's loop: the command line (RunArgs, the flags every trainer shares;
tyro builds the CLI and its --help from the dataclass), the run folder and its logs, the evaluation schedule,
checkpoints and resume, skipped non-finite updates, and stopping on Ctrl-C after a whole step.
"""
import contextlib
import dataclasses
import io
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from tqdm import tqdm

from infra import UserError, data, dist, memory
from infra.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint, seed_everything
from infra.engine import make_generator
from infra.evaluate import eval_table, evaluate
from infra.tiny import is_tiny_model


@dataclass
class RunArgs:
    """Flags of every trainer: what to train and evaluate on, where the run goes, how it runs."""
    model: str = "tiny"  # policy: `tiny` (built-in CPU demo), a hub name (Qwen3-4B-Base) or a local path
    dataset: str = "builtin"  # training problems: `builtin`, a .jsonl/.json/.parquet file or a hub dataset id
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


def parse_args(args_class, tiny_preset=None, argv=None):
    """The command line of a trainer: flags from the dataclass's fields, help from their comments (tyro). Fields
    the user did not set take the tiny preset when --model is the built-in model (or a checkpoint of it), else the
    dataclass defaults (the published settings); --help shows the values in effect for the model given."""
    import tyro
    argv = sys.argv[1:] if argv is None else list(argv)
    model = next((argv[i + 1] for i in range(len(argv) - 1) if argv[i] == "--model"), None)
    model = next((a.split("=", 1)[1] for a in argv if a.startswith("--model=")), model) or getattr(args_class, "model", "")
    names = {field.name for field in dataclasses.fields(args_class)}
    preset = {**RUN_TINY_PRESET, **(tiny_preset or {})} if is_tiny_model(model) else {}
    defaults = args_class(**{name: value for name, value in preset.items() if name in names})
    description = (args_class.__doc__ or "").strip()
    if hasattr(args_class, "model"):
        description += (f" Defaults shown: the built-in CPU demo's preset (--model {model}); a real model gets the "
                        "published ones." if preset else f" Defaults shown: the published settings (--model {model}).")
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
    return args


POSITIVE_SIZES = ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs", "micro_batch_size", "eval_n",
                  "keep_checkpoints", "max_skipped_updates", "max_response_tokens", "eval_max_tokens")


def check_ranges(args):
    """Refuse sizes and rates no run can use, in one line, before any model loads."""
    for name in POSITIVE_SIZES:
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("steps", "save_every", "eval_every", "eval_problems"):
        if getattr(args, name, 0) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 or more, got {getattr(args, name)}")
    for name in ("lr", "critic_lr"):
        if hasattr(args, name) and not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise UserError(f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}")
    if getattr(args, "temperature", 1.0) <= 0:
        raise UserError("--temperature must be > 0 for training rollouts (the log-probs are divided by it)")
    for name in ("top_p", "eval_top_p"):
        if not 0 < getattr(args, name, 1.0) <= 1:
            raise UserError(f"--{name.replace('_', '-')} must be in (0, 1], got {getattr(args, name)}")


def run_main(main):
    """Run a trainer's main(): a UserError becomes a one-line message and exit code 2, a second Ctrl-C code 130."""
    try:
        main()
    except UserError as error:
        if dist.rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        if dist.sharded() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_directory(args, trainer_file):
    """<output_dir>/<run_name>; a resumed run keeps writing where it was; a new run never reuses a directory."""
    if args.resume and not args.run_name:
        return os.path.abspath(args.resume).split(os.sep + "checkpoints")[0]
    method = os.path.splitext(os.path.basename(trainer_file))[0]
    model = os.path.basename(args.model.rstrip("/"))
    name = args.run_name or f"{method}_{model}_s{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    path = dist.broadcast_object(os.path.join(args.output_dir, name))  # rank 0's: the clock may tick between ranks
    if os.path.exists(os.path.join(path, "metrics.jsonl")) and not args.resume:
        raise UserError(f"{path} already holds a run: pass --resume {path} to continue it, or another --run-name")
    return path


class Logger:
    SHOWN = ["reward", "accuracy", "response_length", "policy_loss", "value_loss", "clip_fraction", "approx_kl",
             "grad_norm", "tokens_per_s", "rollout_s", "update_s", "mc_tokens", "repetition", "explained_variance",
             "probe/mse_60", "probe/sign_acc_tau1", "probe/effective_rank", "probe_s", "eval/accuracy"]

    def __init__(self, run_dir, args):
        self.path, self.tensorboard, self.wandb = os.path.join(run_dir, "metrics.jsonl"), None, None
        if dist.rank() > 0:  # under torchrun rank 0 writes for all
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as handle:
            json.dump(dataclasses.asdict(args), handle, indent=1)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(run_dir)
        if args.wandb_project:
            import wandb
            self.wandb = wandb.init(project=args.wandb_project, name=os.path.basename(run_dir),
                                    config=dataclasses.asdict(args))

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
        write(f"step {step:4d} " + " ".join(f"{key.replace('/', '_')}={record[key]:.4g}"
                                             for key in self.SHOWN if key in record))
        if self.tensorboard:
            for key, value in record.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(record, step=step)


class StopOnCtrlC:
    """The first Ctrl-C asks the loop to stop after the current step (`requested`), so the checkpoint then saved
    holds whole steps (a Ctrl-C in the middle of an update would save half of one); a second Ctrl-C raises
    KeyboardInterrupt at once. restore() puts the previous handler back."""

    def __init__(self, run_dir=""):
        self.signalled, self.run_dir = False, run_dir
        self.previous = signal.signal(signal.SIGINT, self._handle)

    @property
    def requested(self):
        """Under torchrun: whether any rank saw Ctrl-C, so that all stop after the same step."""
        return dist.rank_mean(self.signalled) > 0 if dist.distributed() else self.signalled

    def _handle(self, signum, frame):
        if self.signalled:
            print(f"\ninterrupted: not saved; continue from the latest checkpoint with --resume {self.run_dir}",
                  file=sys.stderr)
            raise KeyboardInterrupt
        self.signalled = True
        print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again: stop now, without one)",
              file=sys.stderr)

    def restore(self):
        signal.signal(signal.SIGINT, self.previous)


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
        self.device = dist.init_device(args.device, args.offload_optimizer)  # torchrun or offload: a process group
        memory.check(args, trainer_file, self.device)  # the memory plan per GPU: refused here if it cannot fit
        self.dir = run_directory(args, trainer_file)  # a clash with an existing run fails before any model loads
        self.resume_path = find_checkpoint(args.resume) if args.resume else None  # and so does a bad --resume path
        self.train_rows = data.load_rows(args.dataset, "train", n_builtin=65536, seed=args.seed,
                                         skip_bad_rows=args.skip_bad_rows)
        self.eval_sets = data.load_eval_sets(args.eval_datasets, args.eval_problems, args.skip_bad_rows)
        self.probe_rows = next(iter(self.eval_sets.values()))  # held-out prompts of the critic probes
        self.skipped_in_a_row, self.stopping = 0, False
        seed_everything(args.seed)

    def start(self, models, optimizers, tokenizer):
        """Open the run folder's logs, restore --resume's checkpoint, build the rollout engine (returned)."""
        self.models, self.optimizers, self.tokenizer = models, optimizers, tokenizer
        self.logger = Logger(self.dir, self.args)
        self.start_step = load_checkpoint(self.resume_path, models, optimizers) if self.resume_path else 0
        self.generator = make_generator(self.args.generator, models["policy"], tokenizer,
                                        self.args.gpu_memory_utilization, self.args.seed)
        return self.generator

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
        evaluation at the first step and every --eval-every steps. The first Ctrl-C stops after a whole step."""
        self.ctrl_c = StopOnCtrlC(self.dir)
        progress = tqdm(range(self.start_step, self.args.steps), desc=os.path.basename(self.dir),
                        initial=self.start_step, total=self.args.steps, disable=dist.rank() > 0)
        self.write = progress.write
        try:
            for step in progress:
                due = step == self.start_step or (self.args.eval_every and step % self.args.eval_every == 0)
                yield step, self.evaluate() if due else {}
                if self.stopping:
                    break
        finally:
            self.ctrl_c.restore()

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
        (every --save-every steps, at the end, and on Ctrl-C, which then stops the run)."""
        if step == self.args.steps - 1:
            metrics.update(self.evaluate())
        self.logger.log(step, metrics, self.write)
        self.stopping = self.ctrl_c.requested
        if self.args.save_every and (step + 1) % self.args.save_every == 0 or step == self.args.steps - 1 \
                or self.stopping:
            self.save(step + 1)
        if self.stopping:
            self.write(f"stopped after step {step}; continue with --resume {self.dir}")

    def save(self, step):
        return save_checkpoint(self.dir, step, self.models, self.optimizers, self.tokenizer,
                               self.args.keep_checkpoints)
