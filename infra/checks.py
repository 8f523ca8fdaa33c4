"""Checks of the parsed flags before anything runs, each refusing in one line that names the flag and what to do:
values no run can use (check_ranges: sizes, rates, fractions, seeds, names), and the machine's side (check_integrations:
--device, --output-dir, the optional packages of --tensorboard and --wandb-project).
"""
import importlib
import math
import os
import sys

from infra import UserError

POSITIVE_SIZES = ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs", "micro_batch_size", "eval_n",
                  "keep_checkpoints", "max_skipped_updates", "max_response_tokens", "eval_max_tokens",
                  "hf_batch_size", "oversample", "prm_mini_batches")
POSITIVE_NUMBERS = ("lr", "critic_lr", "vllm_kv_cache_gib", "temperature", "grad_clip", "tis_cap", "prm_lr",
                    "prm_grad_clip", "beta")
FRACTIONS = {"top_p": "(0, 1]", "eval_top_p": "(0, 1]", "gpu_memory_utilization": "[0, 1]", "prob_threshold": "(0, 1]",
             "gamma": "[0, 1]", "lam_actor": "[0, 1]", "lam_critic": "[0, 1]", "lr_warmup": "[0, 1)",
             "tail_ratio": "[0, 1]", "adam_betas": "[0, 1)", "accuracy_bounds": "[0, 1]"}
MAX_SEED = 2 ** 31 - 1  # NumPy takes seeds below 2**32; each rank adds its rank


def flag_name(name):
    """A field's flag: adam_betas -> --adam-betas."""
    return f"--{name.replace('_', '-')}"


def check_ranges(args):
    """Refuse sizes and rates no run can use, in one line, before any model loads: every number (tuples' too) is
    finite and not negative, sizes are at least 1, rates positive, fractions within their interval."""
    for name, values in vars(args).items():  # a dataclass instance, or a namespace of a few flags
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                    math.isfinite(value) and value >= 0):
                raise UserError(f"{flag_name(name)} must be a number >= 0, got {value}")
            interval = FRACTIONS.get(name)
            if interval and not ((0 <= value if interval[0] == "[" else 0 < value) and
                                 (value <= 1 if interval[-1] == "]" else value < 1)):
                raise UserError(f"{flag_name(name)} must be in {interval}, got {value}")
    for name in POSITIVE_SIZES:
        if getattr(args, name, 1) < 1:
            raise UserError(f"{flag_name(name)} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "steps", 1) < 1 and not getattr(args, "eval_only", False):
        raise UserError(f"--steps must be at least 1, got {args.steps} (--eval-only evaluates without training)")
    for name in POSITIVE_NUMBERS:
        if getattr(args, name, 1) <= 0:
            raise UserError(f"{flag_name(name)} must be a positive number, got {getattr(args, name)}")
    if getattr(args, "seed", 0) > MAX_SEED:
        raise UserError(f"--seed must be at most {MAX_SEED}, got {args.seed}")
    if getattr(args, "run_name", "") and (os.path.basename(args.run_name) != args.run_name or args.run_name in
                                          (".", "..")):
        raise UserError(f"--run-name must be a folder name without '/', got {args.run_name!r} (--output-dir sets "
                        "where it goes)")
    evaluates = any(part.strip() for spec in getattr(args, "eval_datasets", ("builtin",)) for part in spec.split(","))
    for flag, needs in (("--eval-only", getattr(args, "eval_only", False)), ("--probe-every",
                                                                           getattr(args, "probe_every", 0))):
        if needs and not evaluates:  # the probes' prompts are held-out ones: training rows are the critic's own
            raise UserError(f"{flag} needs held-out problems: give --eval-datasets (files, hub ids or builtin)")
    if getattr(args, "eval_n", 1) > 1 and getattr(args, "eval_temperature", 1.0) == 0:
        print(f"warning: --eval-n {args.eval_n} with greedy evaluation (--eval-temperature 0) draws {args.eval_n} "
              "identical samples, so pass@k = avg@n; add --eval-temperature 1.0 to sample", file=sys.stderr)


def check_device(device):
    """--device: cpu, cuda or cuda:N that this torch build and machine have; refused in one line otherwise."""
    import torch
    if not device:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device: give cpu, cuda or cuda:N")
    if parsed.type not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}: the trainers run on cpu, cuda or cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}, no GPU visible" if torch.version.cuda else "a CPU build, without CUDA"
        raise UserError(f"--device {device}: this torch ({torch.__version__}) is {build}; use --device cpu")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise UserError(f"--device {device}: there are {torch.cuda.device_count()} GPUs (cuda:0 to "
                        f"cuda:{torch.cuda.device_count() - 1})")


def check_output_dir(output_dir):
    """--output-dir: a folder, or one that can be made (its nearest existing parent is a writable folder)."""
    path = os.path.abspath(output_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        what = "not a folder" if not os.path.isdir(path) else "a folder this user cannot write"
        raise UserError(f"--output-dir {output_dir}: {path} is {what}")


def check_integrations(args):
    """The machine's side of the flags, before the run folder exists: --device, --output-dir, and --tensorboard and
    --wandb-project, which need packages that are optional (refused in one line, with the pip command; they are
    imported here, so a broken install fails here too)."""
    check_device(args.device)
    check_output_dir(args.output_dir)
    if args.tensorboard:
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as error:
            raise UserError(f"--tensorboard needs TensorBoard: pip install tensorboard ({error})")
    if args.wandb_project:
        try:
            importlib.import_module("wandb")
        except ImportError as error:
            raise UserError(f"--wandb-project needs Weights & Biases: pip install wandb, then wandb login ({error})")
