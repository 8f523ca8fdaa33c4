"""The command line every trainer shares: RunArgs (the run flags; each method file's Args extends it with the
method's knobs), the CPU demo's preset, parsing by tyro (flags and --help from the dataclass fields and their
comments) with errors in one line, and the checks on values that no run can use.
"""
import contextlib
import dataclasses
import io
import math
import os
import sys
from dataclasses import dataclass
from typing import Literal

from infra import UserError
from infra.resume import check_resume, resume_point, saved_settings
from infra.tiny import is_tiny_model


@dataclass
class RunArgs:
    """Flags of every trainer: what to train and evaluate on, where the run goes, how it runs."""
    model: str = "tiny"  # policy: `tiny` (built-in CPU demo), a hub name (Qwen3-4B-Base) or a local path
    # training problems: `builtin` (6-digit additions; `builtin:N`, N digits; `builtin:A-B`, A to B digits),
    # a .jsonl/.json/.parquet file or a hub id
    dataset: str = "builtin"
    # dotted path of --dataset's prompt, e.g. extra_info.question (empty: question, problem or prompt)
    question_field: str = ""
    # dotted path of --dataset's gold answer (empty: answer, solution, ground_truth, label or reward_model.ground_truth)
    answer_field: str = ""
    # --dataset's reward: the last \boxed{} (math-verify) or the last `Answer:` line (DAPO's rule); auto: what each
    # prompt asks for. Evaluation sets always take auto.
    answer_format: Literal["auto", "boxed", "answer-line"] = "auto"
    # held-out sets: .jsonl/.json/.parquet files, hub ids or `builtin` (--dataset's digits when it is builtin:N or A-B)
    eval_datasets: tuple[str, ...] = ("builtin",)
    eval_only: bool = False  # evaluate --model (a hub model or a checkpoint's policy/ directory) and exit
    steps: int = 500  # rollout iterations
    seed: int = 0  # seed of data order, sampling and initialization
    run_name: str = ""  # run folder <output-dir>/<run-name>/ (default: <method>_<model>_s<seed>_<time>)
    output_dir: str = "runs"  # parent directory of runs
    resume: str = ""  # continue from a checkpoint directory (runs/<run>/checkpoints/step_N) or a run directory
    generator: Literal["auto", "hf", "vllm"] = "auto"  # rollout engine (auto: vLLM when it imports and CUDA is there)
    # old log-probs of the PPO ratio: the rollout engine's, or recomputed by the trainer (auto: the engine's where they
    # are the trainer's own: Hugging Face generate on the policy itself, float32, top-p 1; vLLM: recomputed)
    old_logprobs: Literal["auto", "engine", "recompute"] = "auto"
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
    max_skipped_updates: int = 5  # stop after this many non-finite updates in a row (at the step's start)
    save_every: int = 50  # checkpoint every N steps, and at the end (0: only at the end)
    keep_checkpoints: int = 2  # how many recent checkpoints to keep
    tensorboard: bool = False  # also log to TensorBoard in the run directory
    wandb_project: str = ""  # also log to this Weights & Biases project


# The CPU demo's run flags (each trainer's TINY_PRESET adds its learning rates; rollouts keep the published size):
# 30 steps, responses of up to 96 tokens (a 6-digit addition takes about 67), greedy evaluation on 256 held-out
# problems every 10 steps, no intermediate checkpoints; micro-batches of 16 (the update ran about 20% faster than
# with 64 on one CPU thread).
RUN_TINY_PRESET = dict(steps=30, micro_batch_size=16, gradient_checkpointing=False, eval_every=10, eval_problems=256,
                       eval_n=1, eval_temperature=0.0, eval_top_p=1.0, max_response_tokens=96, eval_max_tokens=96,
                       save_every=0)


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
