"""Checks of the flags before anything runs, each refusing in one line that names the flag and what to do: the
parser's own refusals (parse_error: an unknown flag with the one meant, a wrong choice), values no run can use
(check_ranges: sizes, rates, fractions, seeds, names), and the machine's side (check_integrations: --device,
--output-dir, the optional packages of --tensorboard and --wandb-project).
"""
import difflib
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
# Other trainers' names for our flags (TRL's GRPOConfig, verl, common habit): an unknown one is answered with ours
OTHER_NAMES = {"--learning-rate": "--lr", "--critic-learning-rate": "--critic-lr", "--num-generations":
               "--samples-per-prompt", "--group-size": "--samples-per-prompt", "--rollout-n": "--samples-per-prompt",
               "--max-completion-length": "--max-response-tokens", "--max-new-tokens": "--max-response-tokens",
               "--max-response-length": "--max-response-tokens", "--num-iterations": "--epochs", "--ppo-epochs":
               "--epochs", "--beta": "--kl-coef", "--kl-loss-coef": "--kl-coef", "--epsilon": "--clip-low",
               "--epsilon-high": "--clip-high", "--max-steps": "--steps", "--total-steps": "--steps",
               "--output": "--output-dir", "--loss-type": "--aggregation"}


def flag_name(name):
    """A field's flag: adam_betas -> --adam-betas."""
    return f"--{name.replace('_', '-')}"


def parse_error(text, argv=(), fields=(), trainer="method", knobs=dict):
    """tyro's error box as one line: its message, the choices of a wrong choice included. Unrecognized options are
    the unknown flags of `argv` alone (tyro cannot know that `--critc-lr` takes a value, so it would list
    `--critc-lr, 1e-5`), each with the flag meant: our name for another trainer's (OTHER_NAMES), else the other
    trainers that have it (`knobs()`: {trainer: its knobs' defaults}; `trainer`: this one's name), else the nearest
    known flag (from `fields`)."""
    lines = [line.strip("│╭╮╰╯─ \t") for line in text.splitlines()]  # with or without a box
    body = []
    for line in lines[1:]:  # after the title: the message, up to the next rule (a rule may come first)
        if not line.strip("-─") or line.startswith(("For full helptext", "Argument helptext")):
            if body:
                break
            continue
        body.append(line)
    message = " ".join(body) or "; ".join(line for line in lines if line)
    known = {"--help"} | {flag_name(no + f.name) for f in fields
                          for no in ("", "no_")[:1 + (f.type in (bool, "bool"))]}
    flags = [token.split("=")[0] for token in argv if token.startswith("--")]  # tyro reads --x_y as --x-y
    unknown = [flag for flag in flags if flag_name(flag[2:]) not in known]
    if message.startswith("Unrecognized options") and unknown:
        message = "Unrecognized options: " + ", ".join(flag + _meant(flag, known, trainer, knobs) for flag in unknown)
    elif "Perhaps you meant:" in lines:
        flags = [line.split()[0] for line in lines[lines.index("Perhaps you meant:"):] if line.startswith("--")]
        message = message.split(" Perhaps you meant:")[0] + f"; did you mean {' or '.join(flags)}?"
    return message


def _meant(flag, known, trainer, knobs):
    """` (did you mean --lr?)`, ` (grpo.py has no critic: --critic-warmup is a flag of ppo.py, ...)` or ``."""
    name = flag_name(flag[2:])
    if OTHER_NAMES.get(name) in known:
        return f" (did you mean {OTHER_NAMES[name]}?)"
    field = name[2:].replace("-", "_")
    field = field[3:] if field.startswith("no_") else field
    owners = {other: own for other, own in knobs().items() if other != trainer and field in own}
    if owners:
        critic = "--critic-model" not in known and all("critic_model" in own for own in owners.values())
        return f" ({trainer}.py has {'no critic' if critic else 'no such knob'}: {flag} is a flag of " \
               f"{', '.join(other + '.py' for other in owners)})"
    nearest = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean {nearest[0]}?)" if nearest else ""


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
