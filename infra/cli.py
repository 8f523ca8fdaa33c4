"""The command line every trainer shares: RunArgs (the run flags; each method file's Args extends it with the
method's knobs), the CPU demo's preset, parsing by tyro (flags and --help from the dataclass fields and their
comments, the method's knobs first, then the run flags) with errors in one line, the checks on values that no run can
use, and the trainers found at the repository root (trainers(): forks too).
"""
import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import math
import os
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Annotated, Literal

from infra import UserError
from infra.resume import check_resume, resume_point, saved_settings
from infra.tiny import is_tiny_model


@dataclass
class RunArgs:
    """Flags of every trainer: what to train and evaluate on, where the run goes, how it runs."""
    model: str = "tiny"  # policy: `tiny` (built-in CPU demo), a hub name (Qwen3-4B-Base) or a local path
    # training problems: `builtin` (6-digit additions; `builtin:N`, N digits; `builtin:A-B`, A to B digits;
    # `builtin:early`, one carry, after the units column), a .jsonl/.json/.parquet file or a hub id
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
    device: str = ""  # torch device: cpu, cuda or cuda:N (default: cuda when available, else cpu)
    # compute dtype (auto: bfloat16 on GPU, float32 on CPU); weights stay float32
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def trainers(root=ROOT):
    """The trainers at the repository root, by name (ppo, grpo, ..., and any fork such as myppo): the .py files that
    define `class Args(infra.cli.RunArgs)` and run through `infra.run.run_main`. Found by reading, not importing."""
    found = []
    for entry in sorted(os.listdir(root)):
        if entry.endswith(".py"):
            with open(os.path.join(root, entry)) as handle:
                tree = ast.parse(handle.read())
            if any(isinstance(node, ast.ClassDef) and node.name == "Args" and "infra.cli.RunArgs" in map(
                    ast.unparse, node.bases) for node in tree.body) and any(
                    isinstance(node, ast.Call) and ast.unparse(node.func) == "infra.run.run_main"
                    for node in ast.walk(tree)):
                found.append(entry[:-3])
    return found


def trainer_defaults(name, root=ROOT):
    """{field: default} of the method's own knobs in <root>/<name>.py's Args (literal defaults; read, not imported)."""
    with open(os.path.join(root, f"{name}.py")) as handle:
        tree = ast.parse(handle.read())
    args = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Args")
    return {node.target.id: ast.literal_eval(node.value) for node in args.body
            if isinstance(node, ast.AnnAssign) and node.value is not None}


# The CPU demo's run flags: 30 steps, responses of up to 96 tokens (a 6-digit addition takes about 67), greedy
# evaluation on 256 held-out problems every 10 steps, no intermediate checkpoints; micro-batches of 16 (the update
# ran about 20% faster than with 64 on one CPU thread).
RUN_TINY_PRESET = dict(steps=30, micro_batch_size=16, gradient_checkpointing=False, eval_every=10, eval_problems=256,
                       eval_n=1, eval_temperature=0.0, eval_top_p=1.0, max_response_tokens=96, eval_max_tokens=96,
                       save_every=0)
# The controlled comparison (docs/testbed.md): on the tiny model every trainer that has one of these knobs takes
# this value, so the six files differ only in their own mechanism (each file's TINY_PRESET and the knobs only it
# has; tests/test_skeleton.py fails on any other difference). Rollouts of 512 samples (SPPO: 512 prompts x 1),
# sampled at temperature 1 without a nucleus; 2 optimizer steps per rollout at a constant lr 3e-5 with AdamW
# (0.9, 0.999), weight decay 0.01 (verl's defaults); token-mean losses, no advantage whitening, no KL; every
# critic at lr 5e-4 with 4 passes per rollout (published: 1; one pass explained at most 0.07 here) and GAE
# lambda 1 for both actor and critic.
CONTROLLED_TINY_PRESET = dict(prompts_per_step=64, samples_per_prompt=8, temperature=1.0, top_p=1.0, lr=3e-5,
                              lr_schedule="constant", weight_decay=0.01, adam_betas=(0.9, 0.999), mini_batches=2,
                              epochs=1, grad_clip=1.0, clip_low=0.2, clip_high=0.2, aggregation="token-mean",
                              whiten_advantages=False, kl_coef=0.0, critic_lr=5e-4, critic_epochs=4, gamma=1.0,
                              lam_actor=1.0, lam_critic=1.0)


def _flag_value(argv, flag):
    """The value of `flag` in argv (`--flag value` or `--flag=value`), None when absent."""
    value = next((argv[i + 1] for i in range(len(argv) - 1) if argv[i] == flag), None)
    return next((a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")), value)


@functools.lru_cache(maxsize=None)
def field_comments(args_class):
    """{field: (comment lines right above it, comment at the end of its line)} over the class and its bases."""
    found = {}
    for klass in reversed(args_class.__mro__):
        if not dataclasses.is_dataclass(klass) or klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source file (a class made at run time): no help from comments
            continue
        lines = source.splitlines()
        comments = {token.start[0]: token.string[1:].strip() for token in
                    tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
        for node in ast.parse(source).body[0].body:
            if isinstance(node, ast.AnnAssign):
                above, line = [], node.lineno - 1
                while line in comments and lines[line - 1].lstrip().startswith("#"):
                    above, line = [comments[line]] + above, line - 1
                found[node.target.id] = (" ".join(above), comments.get(node.end_lineno, ""))
    return found


def field_help(args_class, name):
    """A flag's help: the comment at the end of its field's line, else the comment lines right above the field."""
    above, inline = field_comments(args_class).get(name, ("", ""))
    return inline or above


def _group(name, doc, args_class, fields, defaults):
    """A dataclass of `fields` for tyro, its flags without a prefix, each with its help and one default: the value
    in effect (a help that names its own default keeps it while the value in effect is the field's default)."""
    import tyro
    members = []
    for field in fields:
        help_, value = field_help(args_class, field.name), getattr(defaults, field.name)
        own_default = re.search(r" ?\(default: [^)]*\)", help_)
        if own_default and value != field.default:
            help_ = help_.replace(own_default.group(0), "")
        hint = "" if own_default and value == field.default else None
        members.append((field.name, Annotated[field.type, tyro.conf.arg(help=help_, help_behavior_hint=hint)],
                        dataclasses.field(default_factory=functools.partial(copy.copy, value))
                        if isinstance(value, (list, dict, set)) else dataclasses.field(default=value)))
    group = dataclasses.make_dataclass(name, members)
    group.__doc__ = (doc or "").strip()
    return Annotated[group, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=name)], group()  # its defaults: `defaults`


def _one_line_error(text):
    """tyro's error box as one line: its message, the choices of a wrong choice included."""
    lines = [line.strip("│╭╮╰╯─ \t") for line in text.splitlines()]  # with or without a box
    body = []
    for line in lines[1:]:  # after the title: the message, up to the next rule (a rule may come first)
        if not line.strip("-─") or line.startswith(("For full helptext", "Argument helptext")):
            if body:
                break
            continue
        body.append(line)
    message = " ".join(body) or "; ".join(line for line in lines if line)
    if "Perhaps you meant:" in lines:
        flags = [line.split()[0] for line in lines[lines.index("Perhaps you meant:"):] if line.startswith("--")]
        message = message.split(" Perhaps you meant:")[0] + f"; did you mean {' or '.join(flags)}?"
    return message


def _method_name(args_class):
    """The trainer's file name without .py (ppo), from the module that defines its Args."""
    module = sys.modules.get(args_class.__module__)
    return os.path.splitext(os.path.basename(getattr(module, "__file__", None) or "method"))[0]


def parse_args(args_class, tiny_preset=None, argv=None):
    """The command line of a trainer: flags from the dataclass's fields, help from their comments (tyro), in two
    groups: the method's knobs, then the run flags (RunArgs). Fields the user did not set take the tiny preset when
    --model is the built-in model (or a checkpoint of it), else the dataclass defaults (the published settings);
    --help shows the values in effect for the model given. With --resume they take the run's saved settings, and
    only RESUME_MAY_CHANGE may differ (each change printed)."""
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
        description = f"Defaults shown: the saved settings of {point[0]}."
    else:
        model = _flag_value(argv, "--model") or getattr(args_class, "model", "")
        preset = {**RUN_TINY_PRESET, **CONTROLLED_TINY_PRESET, **(tiny_preset or {})} if is_tiny_model(model) else {}
        defaults = args_class(**{name: value for name, value in preset.items() if name in names})
        description = None if not hasattr(args_class, "model") else (
            f"Defaults shown: the built-in CPU demo's preset (--model {model}); a real model gets the published ones."
            if preset else f"Defaults shown: the published settings (--model {model}).")
    run_names = {field.name for field in dataclasses.fields(RunArgs)}
    fields = dataclasses.fields(args_class)
    groups = {name: fields_ for name, fields_ in ((_method_name(args_class), [f for f in fields if f.name not in
                                                  run_names]), ("run", [f for f in fields if f.name in run_names]))
              if fields_}  # the method's knobs, then the run flags: tyro shows each group in its own box
    built = {name: _group(name, (args_class if name != "run" else RunArgs).__doc__, args_class, fields_, defaults)
             for name, fields_ in groups.items()}
    flags = dataclasses.make_dataclass("Flags", [(name, annotated) for name, (annotated, _) in built.items()])
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = tyro.cli(flags, args=argv, default=flags(*(value for _, value in built.values())),
                              description=description)
    except SystemExit as exit_:
        if exit_.code:  # tyro's error box, in one line
            print(f"{os.path.basename(sys.argv[0])}: error: {_one_line_error(errors.getvalue())} (see --help)",
                  file=sys.stderr)
            raise SystemExit(2)
        raise
    args = args_class(**{field.name: getattr(getattr(parsed, name), field.name)
                         for name, fields_ in groups.items() for field in fields_})
    check_ranges(args)
    if resume:
        check_resume(args, defaults, *point)
    return args


POSITIVE_SIZES = ("prompts_per_step", "samples_per_prompt", "mini_batches", "epochs", "micro_batch_size", "eval_n",
                  "keep_checkpoints", "max_skipped_updates", "max_response_tokens", "eval_max_tokens")
POSITIVE_NUMBERS = ("lr", "critic_lr", "vllm_kv_cache_gib", "temperature", "grad_clip", "tis_cap")
FRACTIONS = {"top_p": "(0, 1]", "eval_top_p": "(0, 1]", "gpu_memory_utilization": "(0, 1]", "prob_threshold": "(0, 1]",
             "gamma": "[0, 1]", "lam_actor": "[0, 1]", "lam_critic": "[0, 1]", "lr_warmup": "[0, 1)",
             "tail_ratio": "[0, 1]", "adam_betas": "[0, 1)"}
MAX_SEED = 2 ** 31 - 1  # NumPy takes seeds below 2**32; each rank adds its rank


def _flag(name):
    return f"--{name.replace('_', '-')}"


def check_ranges(args):
    """Refuse sizes and rates no run can use, in one line, before any model loads: every number (tuples' too) is
    finite and not negative, sizes are at least 1, rates positive, fractions within their interval."""
    for name, values in vars(args).items():  # a dataclass instance, or a namespace of a few flags
        for value in values if isinstance(values, (tuple, list)) else (values,):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not (
                    math.isfinite(value) and value >= 0):
                raise UserError(f"{_flag(name)} must be a number >= 0, got {value}")
            interval = FRACTIONS.get(name)
            if interval and not ((0 <= value if interval[0] == "[" else 0 < value) and
                                 (value <= 1 if interval[-1] == "]" else value < 1)):
                raise UserError(f"{_flag(name)} must be in {interval}, got {value}")
    for name in POSITIVE_SIZES:
        if getattr(args, name, 1) < 1:
            raise UserError(f"{_flag(name)} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "steps", 1) < 1 and not getattr(args, "eval_only", False):
        raise UserError(f"--steps must be at least 1, got {args.steps} (--eval-only evaluates without training)")
    for name in POSITIVE_NUMBERS:
        if getattr(args, name, 1) <= 0:
            raise UserError(f"{_flag(name)} must be a positive number, got {getattr(args, name)}")
    if getattr(args, "seed", 0) > MAX_SEED:
        raise UserError(f"--seed must be at most {MAX_SEED}, got {args.seed}")
    if getattr(args, "run_name", "") and (os.path.basename(args.run_name) != args.run_name or args.run_name in
                                          (".", "..")):
        raise UserError(f"--run-name must be a folder name without '/', got {args.run_name!r} (--output-dir sets "
                        "where it goes)")
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
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError as error:
            raise UserError(f"--tensorboard needs TensorBoard: pip install tensorboard ({error})")
    if args.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError as error:
            raise UserError(f"--wandb-project needs Weights & Biases: pip install wandb, then wandb login ({error})")
