"""The command line every trainer shares: RunArgs (the run flags; each method file's Args extends it with the
method's knobs), the CPU demo's preset, parsing by tyro (flags and --help from the dataclass fields and their
comments, the method's knobs first, then the run flags) with errors in one line (the values' checks: checks.py), and
the trainers found at the repository root (trainers(): forks too).
"""
import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Annotated, Literal

import infra.horizon
from infra import UserError
from infra.checks import check_ranges, flag_name, parse_error
from infra.resume import check_resume, resume_point, saved_settings
from infra.tiny import builtin_model


@dataclass
class RunArgs:
    """Flags of every trainer: what to train and evaluate on, where the run goes, how it runs."""
    model: str = "tiny"  # policy: `tiny` (built-in CPU demo), a hub name (Qwen3-4B-Base) or a local path
    # settings preset: auto (the tiny model: the CPU demo's controlled preset; else each file's defaults, as labelled)
    # smollm2 (the controlled comparison on SmolLM2-135M-Instruct on CPU, docs/real_model.md) or horizon (the demo's
    # comparison on the horizon task, docs/horizon.md; auto with --model horizon); flags override it
    preset: Literal["auto", "smollm2", "horizon"] = "auto"
    # training problems: `builtin` (6-digit additions; `builtin:N`, N digits; `builtin:A-B`, A to B digits;
    # `builtin:early`, one carry, after the units column; `builtin:words`, word problems for a real chat model), a
    # .jsonl/.json/.parquet file or a hub id (org/name, org/name:config)
    dataset: str = "builtin"
    # dotted path of --dataset's prompt, e.g. extra_info.question (empty: question, problem or prompt)
    question_field: str = ""
    # dotted path of --dataset's gold answer (empty: answer, final_answer, solution, ground_truth, label or
    # reward_model.ground_truth)
    answer_field: str = ""
    # --dataset's reward: the last \boxed{} (math-verify) or the last `Answer:` line (DAPO's rule); auto: what each
    # prompt asks for. Evaluation sets always take auto.
    answer_format: Literal["auto", "boxed", "answer-line"] = "auto"
    # held-out sets: .jsonl/.json/.parquet files, hub ids or `builtin` (--dataset's digits when it is builtin:N or A-B);
    # a --dataset other than the method's own leaves none (and --answer-format auto) unless given
    eval_datasets: tuple[str, ...] = ()
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
    # share of GPU memory for the colocated vLLM engine, asleep in the update (0: auto, what the memory plan leaves)
    gpu_memory_utilization: float = 0.0
    vllm_kv_cache_gib: float = 1.0  # KV cache of a vLLM engine on CPU, GiB (on GPU --gpu-memory-utilization sizes it)
    trust_remote_code: bool = False  # allow custom model code from the hub (off: never run downloaded code)
    micro_batch_size: int = 8  # sequences per forward/backward; gradients accumulate up to a mini-batch
    # pack micro-batches by padded tokens per forward instead of --micro-batch-size, longest sequences first (0: off;
    # a sequence longer than the budget goes alone)
    micro_batch_tokens: int = 16384
    gradient_checkpointing: bool = True  # recompute activations in the backward pass (less memory, ~30% slower)
    offload_optimizer: bool = False  # float32 weights, gradients and AdamW states in CPU memory (FSDP2 CPU offload)
    gpu_memory_gib: float = 0.0  # plan for GPUs of this size and refuse a run that cannot fit (0: the device's own)
    gpus: int = 0  # GPUs the memory plan may suggest using (0: the CUDA devices here, else 1; torchrun: its world)
    plan_only: bool = False  # print the memory plan and the flags that fit, load nothing; exit 0 if it fits, else 1
    hf_batch_size: int = 256  # sequences per Hugging Face generate call: its KV cache holds them at once
    eval_every: int = 50  # evaluate every N steps (and always at the first and last step; 0: only those)
    eval_problems: int = 0  # held-out problems per evaluation (0: all)
    eval_n: int = 32  # samples per held-out problem for avg@n and pass@k (SP3O: 32)
    eval_temperature: float = 1.0  # evaluation temperature, 0 is greedy (SP3O: 1.0)
    eval_top_p: float = 0.95  # evaluation nucleus sampling (SP3O: 0.95)
    eval_max_tokens: int = 8192  # evaluation response length limit (ours, the training limit; SP3O: 24576)
    skip_bad_rows: bool = False  # skip malformed dataset rows (reported as a count) instead of stopping
    max_skipped_updates: int = 5  # stop after this many non-finite updates in a row (at the step's start)
    threads: int = 0  # torch CPU threads (0: auto, the cores other work leaves free as the run starts; OMP_NUM_THREADS)
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
# evaluation on 256 held-out problems of the built-in task every 10 steps, no intermediate checkpoints; micro-batches
# of 16 sequences, not packed by tokens (the update ran about 20% faster than with 64 on one CPU thread).
RUN_TINY_PRESET = dict(dataset="builtin", answer_format="auto", steps=30, micro_batch_size=16, micro_batch_tokens=0,
                       gradient_checkpointing=False, eval_datasets=("builtin",), eval_every=10, eval_problems=256,
                       eval_n=1, eval_temperature=0.0, eval_top_p=1.0, max_response_tokens=96, eval_max_tokens=96,
                       save_every=0)
# The controlled comparison (docs/testbed.md): on the tiny model every trainer that has one of these knobs takes
# this value, so the seven files differ only in their own mechanism (each file's TINY_PRESET and the knobs only it
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
DATA_FIELDS = ("answer_format", "eval_datasets")  # a method file's published choices that go with its --dataset
# `--preset smollm2` (docs/real_model.md): the tiny preset's shared settings but the sizes (8 prompts x 8 samples of
# at most 64 tokens, lr 2e-5, 12 steps, held-out avg@2 of 64 problems at temperature 1 every 4 steps) and the critics
# (lr 2e-4, chosen by benchmarks/critic_fit.py's rule; 1 pass per rollout, as published); then each SMOLLM2_PRESET.
RUN_SMOLLM2_PRESET = dict(model="smollm2-135m-instruct", dataset="builtin:words", answer_format="auto", steps=12,
                          max_response_tokens=64, micro_batch_tokens=2048, gradient_checkpointing=False,
                          eval_datasets=("builtin",), eval_every=4, eval_problems=64, eval_n=2, eval_temperature=1.0,
                          eval_top_p=1.0, eval_max_tokens=64, save_every=0)
CONTROLLED_SMOLLM2_PRESET = dict(CONTROLLED_TINY_PRESET, prompts_per_step=8, lr=2e-5, critic_lr=2e-4, critic_epochs=1)


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
    """A flag's help: the comment at the end of its field's line, else the comment lines right above the field; a run
    flag that a method file sets anew (its published --dataset) keeps RunArgs' description after its own."""
    above, inline = field_comments(args_class).get(name, ("", ""))
    general = field_comments(RunArgs).get(name, ("", ""))
    own, general = inline or above, general[1] or general[0]
    return own if not general or own in ("", general) else f"{own}. {general}"


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


def _method_name(args_class):
    """The trainer's file name without .py (ppo), from the module that defines its Args."""
    module = sys.modules.get(args_class.__module__)
    return os.path.splitext(os.path.basename(getattr(module, "__file__", None) or "method"))[0]


def parse_args(args_class, tiny_preset=None, argv=None, smollm2_preset=None):
    """The command line of a trainer: flags from the dataclass's fields, help from their comments (tyro), in two
    groups: the method's knobs, then the run flags (RunArgs). Fields the user did not set take the SmolLM2 preset
    with --preset smollm2 (its shared part, then the file's own `smollm2_preset`), the tiny preset when --model is the
    built-in model (or a checkpoint of it), else the dataclass defaults (the real-model settings); --help shows the
    values in effect for the model and preset given. With --resume they take the run's saved settings, and only
    RESUME_MAY_CHANGE may differ (each change printed)."""
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
        smollm2, horizon = (_flag_value(argv, "--preset") == name for name in ("smollm2", "horizon"))
        model = _flag_value(argv, "--model") or (RUN_SMOLLM2_PRESET["model"] if smollm2 else "horizon" if horizon
                                                 else getattr(args_class, "model", ""))
        horizon = horizon or not smollm2 and builtin_model(model) == "horizon"
        controlled = {**CONTROLLED_TINY_PRESET, **(tiny_preset or {})}
        preset = {**RUN_SMOLLM2_PRESET, **CONTROLLED_SMOLLM2_PRESET, **(smollm2_preset or {})} if smollm2 else \
            infra.horizon.preset(_flag_value(argv, "--dataset") or "", controlled) if horizon else \
            {**RUN_TINY_PRESET, **controlled} if builtin_model(model) == "tiny" else {}
        defaults = args_class(**{name: value for name, value in preset.items() if name in names})
        description = None if not hasattr(args_class, "model") else (
            f"Defaults shown: the controlled SmolLM2 comparison's preset (--preset smollm2, --model {model})."
            if smollm2 else f"Defaults shown: the horizon task's preset (--preset horizon, --model {model})."
            if horizon else
            f"Defaults shown: the built-in CPU demo's preset (--model {model}); a real model gets its own."
            if preset else f"Defaults shown: the real-model settings, each labelled with its source (--model {model}).")
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
            message = parse_error(errors.getvalue(), argv, fields, _method_name(args_class),
                                  lambda: {name: trainer_defaults(name) for name in trainers()})
            print(f"{os.path.basename(sys.argv[0])}: error: {message} (see --help)", file=sys.stderr)
            raise SystemExit(2)
        raise
    args = args_class(**{field.name: getattr(getattr(parsed, name), field.name)
                         for name, fields_ in groups.items() for field in fields_})
    given = {flag_name(token[2:].split("=")[0]) for token in argv if token.startswith("--")}
    if not preset and not resume and "--dataset" in given and args.dataset != defaults.dataset:
        # another training set: the method's published reward and held-out sets were its own; RunArgs' unless given
        args = dataclasses.replace(args, **{field.name: field.default for field in dataclasses.fields(RunArgs)
                                            if field.name in DATA_FIELDS and flag_name(field.name) not in given})
    check_ranges(args)
    if resume:
        check_resume(args, defaults, *point)
    return args
