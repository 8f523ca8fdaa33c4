"""Plumbing shared by the six trainers. Nothing in here knows about RL.

Sections, top to bottom: command line, model loading (and the built-in tiny model), the built-in task,
data loading and prompts, answer checking, the rollout engine, batching and per-token log-probs,
evaluation, logging, checkpoints.
"""
import argparse
import contextlib
import dataclasses
import decimal
import inspect
import json
import math
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import random
import re
import shutil
import signal
import socket
import sys
import time
import typing
import warnings
from dataclasses import dataclass

import numpy as np
import torch

CACHE_DIR = os.path.expanduser(os.environ.get("RL_REASONING_CACHE", "~/.cache/rl-reasoning"))
TINY_MODEL_VERSION = "tiny-v2"
TINY_SHAPE = (128, 2, 100)  # hidden size, layers, vocabulary of the built-in tiny model  # bump when build_tiny_model changes, so stale caches are not reused
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # checkpoints use DCP in one process too


class UserError(Exception):
    """Bad input from the user (flags, data, paths): printed as one line, no traceback."""


def run_main(main):
    """Run a trainer's main(), turning a UserError into a one-line message and exit code 2."""
    try:
        main()
    except UserError as error:
        if rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        if distributed():
            torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Command line: one @dataclass per trainer; each field's trailing comment is its --help.
# ----------------------------------------------------------------------------------------------
class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(args_class, tiny_preset=None, argv=None):
    """Build an argparse CLI from a dataclass. Fields the user did not set take `tiny_preset` values
    when --model is `tiny` (the CPU demo), else the dataclass defaults (the published settings)."""
    source = inspect.getsource(args_class)
    helps = dict(re.findall(r"^\s+(\w+):[^\n#]*#\s*(.*)$", source, flags=re.M))
    hints = typing.get_type_hints(args_class)
    parser = _OneLineParser(description=(args_class.__doc__ or "").strip())
    for field in dataclasses.fields(args_class):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        options = dict(dest=field.name, help=f"{helps.get(field.name, '')} [default: {default}]".replace("%", "%%"), default=argparse.SUPPRESS)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            options.update(nargs="*", type=typing.get_args(kind)[0])
        else:
            options["type"] = typing.get_args(kind)[0] if typing.get_origin(kind) is typing.Union else kind
        parser.add_argument(flag, **options)
    given = vars(parser.parse_args(argv))
    values = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
              for f in dataclasses.fields(args_class)}
    if is_tiny_model(given.get("model", values["model"])):
        values.update(tiny_preset or {})
    values.update({name: tuple(v) if isinstance(v, list) else v for name, v in given.items()})
    args = args_class(**values)
    check_ranges(args)
    return args


def is_tiny_model(name):
    """`tiny`, or a checkpoint of it (its config has the built-in model's shape): such runs take the tiny preset."""
    config_path = os.path.join(name, "config.json")
    if name == "tiny" or not os.path.exists(config_path):
        return name == "tiny"
    with open(config_path) as handle:
        config = json.load(handle)
    return (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("vocab_size")) == TINY_SHAPE


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


def seed_everything(seed):
    """Seed Python, NumPy and torch; under torchrun each rank adds its rank, so the ranks sample differently."""
    random.seed(seed + rank())
    np.random.seed(seed + rank())
    torch.manual_seed(seed + rank())


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# Several processes: `torchrun --nproc-per-node N <trainer>.py ...` runs one process (rank) per GPU, or per CPU
# slot with gloo. Every model is sharded over the ranks (FSDP2 fully_shard); each rank generates and scores its
# share of the prompts with a whole copy of the policy (HFGenerator, or one vLLM engine per rank). Losses divide
# by the mean token count per rank, so the gradients FSDP averages are those of the global token-mean loss.
# Without torchrun every function here is the identity.
# ----------------------------------------------------------------------------------------------
def rank():
    return int(os.environ.get("RANK", 0))


def world_size():
    return int(os.environ.get("WORLD_SIZE", 1))


def distributed():
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def init_device(device=""):
    """This process's torch device. Under torchrun (WORLD_SIZE > 1) it joins the process group first: NCCL with one
    GPU per rank (LOCAL_RANK), gloo on CPU; ranks other than 0 print nothing to stdout."""
    device = device or default_device()
    if world_size() > 1 and not distributed():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if rank() > 0:
            sys.stdout = open(os.devnull, "w")
    return device


def _communicable(tensor):
    """NCCL moves CUDA tensors only."""
    return tensor.cuda() if torch.distributed.get_backend() == "nccl" else tensor


def gather_objects(value):
    """[value of rank 0, value of rank 1, ...] (picklable values); [value] without torchrun."""
    if not distributed():
        return [value]
    values = [None] * world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def gather_all(tensor):
    """Every rank's `tensor`, concatenated along dim 0 in rank order (the ranks may hold different numbers of rows)."""
    if not distributed():
        return tensor
    sizes = gather_objects(tensor.shape[0])
    padded = _communicable(tensor.new_zeros((max(sizes),) + tuple(tensor.shape[1:])))
    padded[:tensor.shape[0]] = _communicable(tensor)
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)]).to(tensor.device)


def rank_mean(value):
    """The mean over ranks of a number or a one-element tensor, as a float (itself without torchrun)."""
    value = float(value)
    if not distributed():
        return value
    total = _communicable(torch.tensor([value], dtype=torch.float64))
    torch.distributed.all_reduce(total)
    return total.item() / world_size()


def rank_share(items):
    """This rank's contiguous share of `items` (a list or a tensor); the shares in rank order make up `items`."""
    if not distributed():
        return items
    if len(items) % world_size():
        raise UserError(f"{len(items)} prompts do not split evenly over {world_size()} processes: make "
                        f"--prompts-per-step a multiple of --nproc-per-node (times the number of nodes)")
    share = len(items) // world_size()
    return items[rank() * share:(rank() + 1) * share]


def on_rank0(function):
    """function() run on rank 0 only; its result, or its UserError, is handed to every rank."""
    if not distributed():
        return function()
    outcome = [None]
    if rank() == 0:
        try:
            outcome = [(True, function())]
        except UserError as error:
            outcome = [(False, str(error))]
    torch.distributed.broadcast_object_list(outcome, src=0)
    succeeded, value = outcome[0]
    if not succeeded:
        raise UserError(value)
    return value


def shard_model(model, compute_dtype):
    """FSDP2 over all ranks: each decoder layer a unit (the architecture's _no_split_modules), then the rest
    (embeddings, final norm, heads). Parameters stay float32; forward and backward run in `compute_dtype`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mp_policy=precision)
    fully_shard(model, mp_policy=precision)
    return model


def full_weights(model):
    """(name, whole tensor) for each entry of model.state_dict(), an FSDP shard gathered one tensor at a time
    (under torchrun every rank must iterate: each gather is collective)."""
    from torch.distributed.tensor import DTensor
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# ----------------------------------------------------------------------------------------------
# Models. Every model, the built-in tiny one included, loads through from_pretrained.
# ----------------------------------------------------------------------------------------------
def resolve_model_name(name):
    """`tiny` -> the built-in checkpoint (built on first use); a bare `Qwen3-4B-Base` -> `Qwen/Qwen3-4B-Base`;
    local paths and `org/name` hub ids pass through."""
    if name == "tiny":
        return build_tiny_model()
    if os.path.exists(name) or "/" in name:
        return name
    if name.lower().startswith(("qwen", "qwq")):
        return f"Qwen/{name}"
    raise UserError(f"--model {name!r} is neither a local path nor a hub id (org/name); "
                    "use e.g. Qwen3-4B-Base, Qwen/Qwen3-4B-Base, ./my_checkpoint or tiny")


def load_tokenizer(name_or_path, trust_remote_code=False):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(name_or_path), trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # never pad with EOS: the EOS we generate must stay a trained token
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    return tokenizer


def load_model(name_or_path, dtype="auto", device=None, trust_remote_code=False, value_head=0,
               gradient_checkpointing=False):
    """Return (model, tokenizer). value_head=k > 0: the backbone plus k scalar outputs per position
    (AutoModelForTokenClassification, as verl builds its critic). Weights load in float32 and the forward runs in
    `dtype` (auto: bfloat16 on GPU, float32 on CPU): mixed precision, so a 1e-6 step is not rounded away in bf16.
    Under torchrun the model comes back sharded over the ranks (shard_model)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    path, device = resolve_model_name(name_or_path), device or default_device()
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    tokenizer = load_tokenizer(path, trust_remote_code)
    kwargs = dict(dtype=torch.float32, trust_remote_code=trust_remote_code)
    try:
        if value_head:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=int(value_head), **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as error:
        raise UserError(f"cannot load model {name_or_path!r} from {path!r}: {str(error).splitlines()[0]}")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.compute_dtype, model.architecture = getattr(torch, dtype), type(model).__name__
    for module in model.modules():  # no dropout in RL (as verl): the value head's classifier_dropout defaults to 0.1
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:  # recompute each layer's activations in backward (HF checkpoints in train mode only)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # transformers < 6
        model.train()
    model = model.to(device)
    return (shard_model(model, model.compute_dtype) if distributed() else model), tokenizer


def forward(model, batch, **kwargs):
    """model(batch) in the model's compute dtype (autocast: the float32 weights are cast layer by layer)."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    with torch.autocast(batch.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        return model(**batch.model_inputs(), use_cache=False, **kwargs)


def build_tiny_model(cache_dir=CACHE_DIR, sft_steps=400, seed=0):
    """Build (once) the built-in tiny model: a 2-layer Qwen3 with a character tokenizer, supervised on
    the built-in addition task where 60% of the examples ignore carries. It starts at roughly 20-30%
    greedy held-out accuracy, so RL has a habit to fix. Cached as a normal HF checkpoint directory.
    Rebuild by hand with `python common.py build-tiny`."""
    path = os.path.join(cache_dir, TINY_MODEL_VERSION)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(INSTRUCTION, normalized=False)])  # one token for the fixed instruction: short prompts
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                        unk_token="<|unk|>", clean_up_tokenization_spaces=False)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=sft_steps, pct_start=0.1)
    from tqdm import tqdm
    for _ in tqdm(range(sft_steps), desc="building the tiny model (one time)", leave=False):
        rows = [addition_problem(rng, "train") for _ in range(64)]
        prompts = [tokenizer(plain_prompt(r["question"]))["input_ids"] for r in rows]
        answers = [tokenizer(addition_solution(r["a"], r["b"], carries=rng.random() > 0.6))["input_ids"]
                   + [tokenizer.eos_token_id] for r in rows]
        batch = sequence_batch(prompts, answers, tokenizer.pad_token_id)
        logits = model(**batch.model_inputs(), logits_to_keep=batch.response_width + 1).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits[batch.response_mask], batch.response_ids[batch.response_mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    staging = path + f".tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.makedirs(cache_dir, exist_ok=True)
    try:
        os.rename(staging, path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return path


# ----------------------------------------------------------------------------------------------
# The built-in task: 3-digit addition worked digit by digit with carries, answer in \boxed{}.
# ----------------------------------------------------------------------------------------------
def is_heldout(a, b):
    return (a * 1000 + b) % 61 == 0  # about 1.6% of all pairs; never used for SFT or RL


def addition_problem(rng, split):
    while True:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if is_heldout(a, b) == (split == "test"):
            return {"question": f"{a}+{b}", "answer": str(a + b), "a": a, "b": b}


def addition_solution(a, b, carries=True):
    """`8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}` for 478+365; carries=False writes every carry as 0."""
    steps, digits, carry = [], [], 0
    for x, y in zip(reversed(str(a)), reversed(str(b))):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        digits.append(str(total % 10))
        carry = total // 10 if carries else 0
    answer = (str(carry) if carry else "") + "".join(reversed(digits))
    return " ".join(steps) + f" \\boxed{{{int(answer)}}}"


def builtin_rows(split, n, seed):
    rng = random.Random(f"{split}-{seed}")
    return [addition_problem(rng, split) for _ in range(n)]


# ----------------------------------------------------------------------------------------------
# Data: jsonl / json / parquet files, or hub ids; prompts in the chat template or a plain one.
# ----------------------------------------------------------------------------------------------
QUESTION_FIELDS, ANSWER_FIELDS = ("question", "problem", "prompt"), ("answer", "solution", "ground_truth")


def gold_answer(value):
    """Normalize a gold field: GSM8K `... #### 18` -> `18`, a MATH solution -> its last \\boxed{}, numbers -> str.
    None for anything unusable (empty, not a string or a finite number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        if isinstance(value, float):  # 27.0 -> "27", 0.5 -> "0.5", 1234567.0 -> "1234567" (never 1.23e+06)
            return (str(int(value)) if value.is_integer() else repr(value)) if math.isfinite(value) else None
        return str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    if "####" in value:
        return value.rsplit("####", 1)[1].strip().replace(",", "") or None
    return extract_answer(value) or value.strip()


def row_to_example(row, where):
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    fields = f"the row has: {', '.join(map(str, list(row)[:8])) or 'no fields'}{' ...' if len(row) > 8 else ''}"
    question = next((row[k] for k in QUESTION_FIELDS if isinstance(row.get(k), str) and row[k].strip()), None)
    if question is None:
        raise UserError(f"{where}: no question field (one of {', '.join(QUESTION_FIELDS)}; {fields})")
    answer_key = next((k for k in ANSWER_FIELDS if row.get(k) not in (None, "")), None)
    answer = gold_answer(row.get(answer_key)) if answer_key else None
    if answer is None:
        raise UserError(f"{where}: no answer field (one of {', '.join(ANSWER_FIELDS)}), or it is empty or not "
                        f"a string or number ({fields})")
    return {"question": question, "answer": answer}


DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


def _json_array_rows(spec, text):
    """(spec:line, item) for each item of a JSON array, the line being where the item starts."""
    decoder, blank, rows = json.JSONDecoder(), re.compile(r"\s*"), []
    position = blank.match(text).end() + 1  # past the [
    line, counted = 1, 0
    try:
        position = blank.match(text, position).end()
        while text[position:position + 1] != "]":
            line, counted = line + text.count("\n", counted, position), position
            item, position = decoder.raw_decode(text, position)
            rows.append((f"{spec}:{line}", item))
            position = blank.match(text, position).end()
            if text[position:position + 1] == ",":
                position = blank.match(text, position + 1).end()
            elif text[position:position + 1] != "]":
                raise json.JSONDecodeError("expected ',' or ']' after an item", text, position)
        if text[position + 1:].strip():
            raise json.JSONDecodeError("extra data after the array", text, position + 1)
    except json.JSONDecodeError as error:
        raise UserError(f"{spec}:{error.lineno}: invalid JSON ({error.msg})")
    return rows


def _read_file_rows(spec, flag):
    """(where, row or UserError) for each row of a local .jsonl/.json/.parquet file."""
    if os.path.isdir(spec):
        inside = sorted(f for f in os.listdir(spec) if f.endswith(DATA_EXTENSIONS))
        raise UserError(f"{flag} {spec!r} is a directory; give a file in it"
                        + (f" ({', '.join(inside[:5])})" if inside else " (it holds no .jsonl/.json/.parquet file)"))
    if not spec.endswith(DATA_EXTENSIONS):
        raise UserError(f"{flag} {spec!r}: unsupported file type (use .jsonl, .json or .parquet)")
    try:
        if spec.endswith(".parquet"):
            import pyarrow.parquet
            try:
                table = pyarrow.parquet.read_table(spec)
            except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
                raise UserError(f"{flag} {spec!r}: not a readable parquet file ({str(error).splitlines()[0]})")
            return [(f"{spec}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
        with open(spec, "rb") as handle:
            data = handle.read()
    except OSError as error:  # permissions, a broken disk ...
        raise UserError(f"{flag} {spec!r}: cannot read it ({error.strerror or error})")
    if spec.endswith(".json") and data.lstrip().startswith(b"["):
        try:
            return _json_array_rows(spec, data.decode("utf-8-sig"))
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise UserError(f"{spec}:{line}: not UTF-8 text ({error.reason})")
    rows = []
    for number, line in enumerate(data.split(b"\n"), 1):  # JSON Lines (also what datasets' to_json writes)
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as error:
            rows.append((f"{spec}:{number}", UserError(f"{spec}:{number}: not UTF-8 text ({error.reason})")))
            continue
        if not text.strip():
            continue
        try:
            rows.append((f"{spec}:{number}", json.loads(text)))
        except json.JSONDecodeError as error:
            hint = ""
            if number == 1 and spec.endswith(".json"):
                hint = "; a .json file must be an array of objects, or one object per line"
            rows.append((f"{spec}:{number}", UserError(f"{spec}:{number}: invalid JSON ({error.msg}{hint})")))
    return rows


def load_rows(spec, split="train", n_builtin=None, seed=0, skip_bad_rows=False, flag="--dataset"):
    """Rows {"question", "answer"} from `builtin`, a .jsonl/.json/.parquet file, or a hub dataset id.
    Raises UserError naming `file:line` for a bad row (or skips it with skip_bad_rows, reporting the count),
    and for an unreadable or empty file."""
    if spec == "builtin":
        return builtin_rows(split, n_builtin or 4096, seed)
    if os.path.exists(spec):
        raw = _read_file_rows(spec, flag)
    elif spec.endswith(DATA_EXTENSIONS) or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise UserError(f"{flag} {spec!r}: no such file (or a hub id: org/name)")
    else:
        try:
            import datasets
            raw = [(f"{spec}[{i}]", r) for i, r in enumerate(datasets.load_dataset(spec, split=split))]
        except Exception as error:  # hub unreachable, no `datasets` package, no such split ...
            raise UserError(f"{flag} {spec!r}: not a local file and the hub dataset could not be loaded "
                            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    rows, bad = [], []
    for where, row in raw:
        try:
            if isinstance(row, UserError):
                raise row
            rows.append(row_to_example(row, where))
        except UserError as error:
            if not skip_bad_rows:
                raise
            bad.append(str(error))
    if not raw:
        raise UserError(f"{flag} {spec!r}: no rows (the dataset is empty)")
    if not rows:
        raise UserError(f"{flag} {spec!r}: all {len(bad)} rows are bad; the first: {bad[0]}")
    if bad:
        print(f"skipped {len(bad)} bad rows of {len(raw)} in {spec} (the first: {bad[0]})", file=sys.stderr)
    return rows


def load_eval_sets(specs, limit=0, skip_bad_rows=False):
    """{name: rows} for eval datasets given as a comma-separated string or a list/tuple of specs (`builtin` =
    the task's held-out split); a file `math500/test.jsonl` is named `math500`, a repeated name gets `_2`, `_3`.
    `limit` > 0 keeps the first `limit` rows of each."""
    sets = {}
    specs = [specs] if isinstance(specs, str) else specs
    for spec in [s.strip() for item in specs for s in item.split(",") if s.strip()]:
        name = os.path.splitext(os.path.basename(spec))[0]
        name = os.path.basename(os.path.dirname(spec)) or name if name in ("test", "train", "validation") else name
        base, copy = name, 1
        while name in sets:
            copy += 1
            name = f"{base}_{copy}"
        sets[name] = load_rows(spec, "test", n_builtin=limit or 256, skip_bad_rows=skip_bad_rows,
                               flag="--eval-dataset")[:limit or None]
    if not sets:
        raise UserError("--eval-datasets is empty: give at least one file, hub id or `builtin`")
    return sets


def plain_prompt(question):
    return f"{question}\n{INSTRUCTION}\n"


def prompt_ids(tokenizer, question):
    """Token ids of the prompt: the tokenizer's chat template when it has one, else a plain template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}],
                                             tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(plain_prompt(question), add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------
# Answer checking. Model output is never evaluated as code: math-verify parses its LaTeX, in a separate
# process killed at a deadline (not signal.alarm, which breaks outside the main thread and cannot stop C code).
# ----------------------------------------------------------------------------------------------
MAX_ANSWER_CHARS = 1000
VERIFY_TIMEOUT_S = 1.5  # wall-clock budget per response (the kill and re-fork add ~0.05 s); a timeout scores 0
VERIFIER_START_TIMEOUT_S = 120  # the one-time start of the checker (imports torch via this module, and math-verify)


def extract_answer(text):
    """The content of the last \\boxed{...} after any </think>, braces balanced; None if there is none.
    Linear time: one reverse search, then at most MAX_ANSWER_CHARS characters scanned."""
    text = text.rsplit("</think>", 1)[-1]
    last_close = text.rfind("}")
    start = text.rfind("\\boxed{", 0, max(last_close, 0))  # the last \boxed{ that has a } somewhere after it
    if start == -1:
        return None
    depth, opened = 0, start + len("\\boxed{") - 1
    for position in range(opened, min(len(text), opened + MAX_ANSWER_CHARS + 2)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[opened + 1:position].strip()
    return None  # unbalanced, or longer than MAX_ANSWER_CHARS


def _plain_number(text):
    """Decimal of `42`, `-3.5`, `1,000` (commas only as thousands separators), `$5`; None otherwise."""
    text = text.replace("$", "").strip()
    if re.fullmatch(r"-?(\d{1,50}|\d{1,3}(,\d{3}){1,16})(\.\d{1,50})?", text):
        return decimal.Decimal(text.replace(",", ""))
    return None


def _math_verify_zygote(connection):
    """Checker zygote: imports math-verify and warms it up once, then forks a warm checker per request (a fork takes
    milliseconds; a fresh process would take seconds to import and warm up), sending back its pid and socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the checkers
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed checkers are reaped by the kernel
    from math_verify import LatexExtractionConfig, parse, verify

    def score(gold, answer):  # LaTeX extraction only: math-verify's plain-expression one runs sympy's parse_expr (eval)
        config = [LatexExtractionConfig()]
        return float(verify(parse(f"\\boxed{{{gold}}}", config), parse(f"\\boxed{{{answer}}}", config)))

    for gold, answer in [("\\frac{1}{2}", "0.5"), ("2x+1", "1+x*2"), ("\\sqrt{2}", "2^{1/2}"), ("(1,2]", "(1,2]")]:
        score(gold, answer)  # warm sympy's lazy set-up (up to ~0.5 s per new kind of expression)
    connection.send("ready")
    while True:
        try:
            connection.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the checker: answers (gold, answer) -> 0.0/1.0 until the trainer closes its end
            try:
                connection.close()
                ours.close()
                checker = multiprocessing.connection.Connection(theirs.detach())
                while True:
                    gold, answer = checker.recv()  # EOFError when the trainer is gone
                    try:
                        result = score(gold, answer)
                    except Exception:
                        result = 0.0
                    checker.send(result)
            finally:
                os._exit(0)  # never run the zygote's code in a checker
        theirs.close()
        connection.send(pid)
        multiprocessing.reduction.send_handle(connection, ours.fileno(), 0)
        ours.close()


class _Verifier:
    """One warm checker process forked from a zygote. A check that misses its deadline kills the checker (it is
    stuck in sympy, where no signal or thread can stop it) and forks a fresh, already warm one at once."""

    def __init__(self):
        self.zygote = self.checker = None  # (process, connection), (pid, connection)

    def _start(self):
        """(Re)start the zygote and fork a checker: once per process (about 5-15 s), or after the zygote died."""
        if self.zygote is not None:
            self.zygote[0].kill()
            self.zygote[1].close()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_math_verify_zygote, args=(child,), daemon=True)
        process.start()
        child.close()
        self.zygote = (process, parent)
        try:
            if not parent.poll(VERIFIER_START_TIMEOUT_S):
                raise RuntimeError(f"the math-verify checker did not start in {VERIFIER_START_TIMEOUT_S} s")
            parent.recv()
        except (EOFError, OSError):
            raise RuntimeError("the math-verify checker died at start; is math-verify installed "
                               "(pip install math-verify)?")
        self._fork()

    def _fork(self):
        process, connection = self.zygote
        connection.send("fork")
        pid = connection.recv()
        self.checker = (pid, multiprocessing.connection.Connection(multiprocessing.reduction.recv_handle(connection)))

    def check(self, gold, answer, deadline):
        """(score, timed_out). A (re)start of the zygote is not charged to the answer's deadline."""
        if self.zygote is None or not self.zygote[0].is_alive() or self.checker is None:
            start = time.monotonic()
            self._start()
            deadline += time.monotonic() - start
        pid, connection = self.checker
        with contextlib.suppress(EOFError, OSError):  # a checker that died on this input is not signalled again
            connection.send((gold, answer))
            if connection.poll(max(0.0, deadline - time.monotonic())):
                return float(connection.recv()), False
            os.kill(pid, signal.SIGKILL)  # stuck on hostile input
        connection.close()
        self.checker = None
        with contextlib.suppress(EOFError, OSError):  # the zygote is gone: the next check restarts it
            self._fork()
        return 0.0, True


_VERIFIER = _Verifier()
VERIFY_STATS = {"timeouts": 0}  # checks that ran out of time (scored 0); rollout_metrics reports and resets it


def pop_verify_timeouts():
    """How many answer checks ran out of time since the last call."""
    timeouts, VERIFY_STATS["timeouts"] = VERIFY_STATS["timeouts"], 0
    return timeouts


def verify(response, gold, timeout=VERIFY_TIMEOUT_S):
    """1.0 if the last \\boxed{} of `response` equals `gold` (math-verify, gold first), else 0.0, within `timeout`
    seconds of wall time (past it: 0.0, counted in VERIFY_STATS). Exact and plain-number matches are decided here;
    everything else goes to a checker process. Model text is parsed, never evaluated."""
    deadline = time.monotonic() + timeout
    answer = extract_answer(response)
    if answer is None or gold is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if answer == gold:
        return 1.0
    answer_number, gold_number = _plain_number(answer), _plain_number(gold)
    if answer_number is not None and gold_number is not None:
        return float(answer_number == gold_number)
    score, timed_out = _VERIFIER.check(gold, answer, deadline)
    VERIFY_STATS["timeouts"] += timed_out
    return score


# ----------------------------------------------------------------------------------------------
# Rollout engine: generate(prompts, n, max_tokens, temperature, top_p) -> list of Completion.
# ----------------------------------------------------------------------------------------------
@dataclass
class Completion:
    prompt_index: int  # which prompt of the call this sample answers
    token_ids: list  # sampled response tokens, the EOS included when the model stopped
    text: str  # decoded response, special tokens removed
    logprobs: list  # log-prob of each sampled token under the sampling (temperature/top-p) distribution
    finish_reason: str  # "stop" (EOS) or "length" (hit max_tokens)


class HFGenerator:
    """Hugging Face `generate` backend (CPU or GPU). One process: it reads the live policy weights, nothing to sync.
    Under torchrun the policy is sharded, so each rank generates with its own whole copy, refreshed by sync_weights."""
    engine = "hf"

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        if distributed():
            from transformers import AutoModelForCausalLM
            self.model = AutoModelForCausalLM.from_config(model.config, dtype=model.compute_dtype).to(model.device)
            self.model.compute_dtype = model.compute_dtype

    def sync_weights(self, model):
        if not distributed():
            self.model = model
            return
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in full_weights(model):
                own[name].copy_(tensor)

    def sleep(self):
        """Nothing to free: generation runs on the trainer's own model."""

    def wake_up(self):
        """Nothing to restore."""

    @torch.no_grad()
    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        # Our own warpers, then the recorder, so it sees the processed distribution (HF would add its warpers last).
        warpers = [TemperatureLogitsWarper(temperature)] if temperature > 0 and temperature != 1 else []
        warpers += [TopPLogitsWarper(top_p)] if temperature > 0 and top_p < 1 else []
        # Explicit neutral values, or generate() would fill them from the model's own generation_config.
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=1.0, top_p=1.0,
                                  top_k=0 if temperature > 0 else None,
                                  eos_token_id=eos, pad_token_id=pad, return_dict_in_generate=True)
        requests = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        completions, was_training = [], self.model.training
        self.model.eval()
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            width = max(len(p) for _, p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for _, p in chunk])
            attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for _, p in chunk])[:, None]).long()
            device, recorder = self.model.device, _SampledLogprobs()
            dtype = getattr(self.model, "compute_dtype", torch.float32)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                          generation_config=config, logits_processor=LogitsProcessorList(warpers + [recorder]))
            sampled = out.sequences[:, width:]
            logprobs, sampled = recorder.finish(sampled).cpu(), sampled.cpu()
            for row, (index, _) in enumerate(chunk):
                tokens = sampled[row].tolist()
                stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
                completions.append(Completion(index, tokens[:stop], self.tokenizer.decode(tokens[:stop], skip_special_tokens=True),
                                              logprobs[row, :stop].tolist(), "stop" if eos in tokens else "length"))
        self.model.train(was_training)
        return completions


class _SampledLogprobs:
    """A logits processor, last in line, recording log p(sampled token) under the processed distribution one step
    behind (at step t it sees the token drawn at t - 1): one [B, V] log-softmax at a time, never all T steps."""

    def __init__(self):
        self.previous, self.logprobs = None, []

    def __call__(self, input_ids, scores):
        if self.previous is not None:
            self.logprobs.append(self.previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.previous = scores.float().log_softmax(-1)
        return scores

    def finish(self, sampled):
        """[B, T] log-probs of the sampled tokens, the last step's included."""
        last = self.previous.gather(-1, sampled[:, -1:]).squeeze(-1)
        return torch.stack(self.logprobs + [last], 1)


class VLLMGenerator:
    """vLLM engine colocated in this process (vllm==0.22.1, requirements-vllm.txt). It keeps its own copy of
    the weights: sync_weights() copies the trainer's in after each update, sleep() frees its GPU memory during
    the update. Log-probs are of the processed distribution (temperature and top-p applied), as in HFGenerator.
    Every vLLM call is in this class, each checked against the 0.22.1 docs and source named beside it
    (docs under docs.vllm.ai/en/v0.22.1/; source paths inside the vllm package)."""
    engine = "vllm"

    def __init__(self, model, tokenizer, gpu_memory_utilization=0.3, seed=0):
        # Engine core in this process (envs.py VLLM_ENABLE_V1_MULTIPROCESSING; v1/engine/llm_engine.py then uses
        # an InprocClient): apply_model() runs a local function on the engine's nn.Module, nothing serialized.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM
        self.tokenizer, self.asleep = tokenizer, set()
        path = model.name_or_path  # the checkpoint the trainer loaded: architecture, config, tokenizer
        # LLM(...): api/vllm/entrypoints/llm/; engine arguments: configuration/engine_args/ (--enable-sleep-mode;
        # --logprobs-mode: "processed means the values after applying all processors, including temperature and
        # top_k/top_p", returned from the sampling path in v1/sample/sampler.py).
        # Under torchrun: one engine per rank on its own prompts (external_launcher with data_parallel_size = ranks,
        # as vLLM's examples/features/torchrun/torchrun_dp_example_offline.py).
        ranks = dict(distributed_executor_backend="external_launcher", data_parallel_size=world_size()) if distributed() else {}
        self.llm = LLM(model=path, tokenizer=path, dtype=str(model.compute_dtype).removeprefix("torch."), seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs", **ranks)

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        from vllm import SamplingParams, TokensPrompt
        self.wake_up()
        greedy = temperature <= 0  # SamplingParams rejects n > 1 when greedy: send each prompt n times instead
        repeats, n = (n, 1) if greedy else (1, n)
        eos = self.tokenizer.eos_token_id
        # api/vllm/sampling_params/: logprobs=0 returns the sampled token's log-prob alone
        params = SamplingParams(n=n, temperature=max(temperature, 0.0), top_p=1.0 if greedy else top_p,
                                max_tokens=max_tokens, logprobs=0, stop_token_ids=None if eos is None else [eos])
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(repeats)]
        completions = []
        # LLM.generate: one RequestOutput per prompt, in order; .outputs holds its samples (outputs.py), each with
        # token_ids (the stop token included), logprobs (per position, token id -> Logprob) and finish_reason.
        for number, output in enumerate(self.llm.generate(requests, params, use_tqdm=False)):
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [position[token].logprob for position, token in zip(sample.logprobs, tokens)]
                completions.append(Completion(number // repeats, tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                              logprobs, "stop" if sample.finish_reason == "stop" else "length"))
        return completions

    def sleep(self):
        """Free the engine's GPU memory for the update: level 1 backs the weights up in CPU memory and drops the
        KV cache, prefix cache included (features/sleep_mode/; LLM.sleep -> v1/engine/core.py EngineCore.sleep)."""
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=("weights", "kv_cache")):
        tags = [tag for tag in tags if tag in self.asleep]
        if tags:
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver, for vLLM to map
            self.llm.wake_up(tags=tags)  # LLM.wake_up(tags): each tag wakes once (v1/executor/abstract.py)
            self.asleep -= set(tags)

    def sync_weights(self, model):
        """Copy the trainer's weights into the engine, then reset the prefix cache (its KV entries came from the
        old weights). HF parameter names: vLLM's load_weights fuses q/k/v and gate/up itself and skips a tied
        lm_head (model_executor/models/qwen3.py). The weights wake before the copy, the KV cache after it."""
        self.wake_up(tags=["weights"])
        weights = full_weights(model)  # one tensor at a time: under torchrun each is gathered from the shards
        # LLM.apply_model(func): "Run a function directly on the model inside each worker" (entrypoints/llm.py)
        self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()


def resolve_generator(kind, device="cuda"):
    """`hf` or `vllm` for --generator: `auto` is vLLM when it imports and the policy is on a CUDA device, else
    Hugging Face generate. A `vllm` that cannot run raises UserError; trainers may call this before loading."""
    if kind not in ("auto", "hf", "vllm"):
        raise UserError(f"--generator {kind!r}: use auto, hf or vllm")
    if kind == "hf":
        return "hf"
    problem = None
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        problem = "needs the policy on a CUDA GPU"
    else:
        try:
            import vllm  # noqa: F401
        except Exception as error:  # not installed, or built for another torch/CUDA
            problem = f"needs vllm (pip install -r requirements-vllm.txt; importing it failed: {type(error).__name__})"
    if problem is None:
        return "vllm"
    if kind == "vllm":
        raise UserError(f"--generator vllm {problem}; or use --generator hf")
    return "hf"


def make_generator(kind, model, tokenizer, gpu_memory_utilization=0.3, seed=0):
    """The rollout engine for --generator auto|hf|vllm (see resolve_generator), holding `model`'s current weights."""
    if resolve_generator(kind, model.device.type) == "vllm":
        generator = VLLMGenerator(model, tokenizer, gpu_memory_utilization, seed)
    else:
        generator = HFGenerator(model, tokenizer)
    generator.sync_weights(model)  # vLLM loaded the checkpoint from disk: a resumed policy differs from it
    return generator


# ----------------------------------------------------------------------------------------------
# Batching: prompts left-padded so every response starts at the same column; responses right-padded.
# Column P-1+t holds the state before response token t: logits there predict y_t, a critic reads V(s_t).
# ----------------------------------------------------------------------------------------------
@dataclass
class SequenceBatch:
    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    position_ids: torch.Tensor  # [B, P+T], counting from each row's first real token
    response_ids: torch.Tensor  # [B, T], pad after each response's end
    response_mask: torch.Tensor  # [B, T] bool: True on real response tokens (the EOS included)

    @property
    def response_width(self):
        return self.response_ids.shape[1]

    def model_inputs(self):
        return dict(input_ids=self.input_ids, attention_mask=self.attention_mask, position_ids=self.position_ids)

    def to(self, device):
        return SequenceBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))

    def lengths(self):
        """(prompt length, response length) of each row, for token_budget_chunks."""
        response = self.response_mask.sum(1)
        return list(zip((self.attention_mask.sum(1) - response).tolist(), response.tolist()))

    def select(self, rows):
        """The given rows, with columns that are padding in every one of them trimmed on both sides."""
        attention_mask, response_mask = self.attention_mask[rows], self.response_mask[rows]
        left = int(attention_mask.argmax(1).min())  # first column any selected row uses
        width = max(1, int(response_mask.sum(1).max()))
        right = self.input_ids.shape[1] - self.response_width + width
        return SequenceBatch(self.input_ids[rows, left:right], attention_mask[:, left:right],
                             self.position_ids[rows, left:right], self.response_ids[rows, :width], response_mask[:, :width])


def sequence_batch(prompts, responses, pad_id):
    prompt_width = max(len(p) for p in prompts)
    response_width = max(1, max(len(r) for r in responses))
    rows, masks, response_rows = [], [], []
    for prompt, response in zip(prompts, responses):
        left, right = prompt_width - len(prompt), response_width - len(response)
        rows.append([pad_id] * left + list(prompt) + list(response) + [pad_id] * right)
        masks.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        response_rows.append(list(response) + [pad_id] * right)
    attention_mask = torch.tensor(masks)
    lengths = torch.tensor([len(r) for r in responses])
    return SequenceBatch(torch.tensor(rows), attention_mask, (attention_mask.cumsum(1) - 1).clamp(min=0),
                         torch.tensor(response_rows), torch.arange(response_width)[None, :] < lengths[:, None])


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(z / tau)[y] = z_y / tau - logsumexp(z / tau) over [N, V] logits, a chunk of rows at a time.
    Backward recomputes each chunk's softmax p: d/dz_j = (1[j = y] - p_j) / tau times the incoming gradient.
    Saved for backward: the logits (alive anyway) and one logsumexp per row, never a float32 copy of them."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, rows_per_chunk):
        out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, tokens.shape[0], rows_per_chunk):
            part = slice(start, start + rows_per_chunk)
            scaled = logits[part].float() if temperature == 1 else logits[part].float() / temperature
            logsumexp[part] = scaled.logsumexp(-1)
            out[part] = scaled.gather(-1, tokens[part, None]).squeeze(-1) - logsumexp[part]
        ctx.save_for_backward(logits, tokens, logsumexp)
        ctx.temperature, ctx.rows_per_chunk = temperature, rows_per_chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens, logsumexp = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, tokens.shape[0], ctx.rows_per_chunk):
            part = slice(start, start + ctx.rows_per_chunk)
            weight = grad_out[part, None].float()
            chunk_grad = logits[part].to(torch.float32, copy=True).div_(ctx.temperature)  # the one temporary
            chunk_grad.sub_(logsumexp[part, None]).exp_().mul_(-weight)  # -p * g
            grad[part] = chunk_grad.scatter_add_(-1, tokens[part, None], weight).div_(ctx.temperature)
        return grad, None, None, None


def token_logprobs(logits, tokens, temperature=1.0, chunk_elements=2 ** 24):
    """log softmax(logits / temperature)[tokens] for [..., V] logits and [...] tokens, in float32, without a
    full-vocabulary log-softmax copy in the forward or the backward pass: the temporaries are one chunk of about
    `chunk_elements` floats (64 MB). Contiguous logits are read in place (a non-contiguous view is copied once)."""
    vocab = logits.shape[-1]
    out = _TokenLogprobs.apply(logits.reshape(-1, vocab), tokens.reshape(-1), float(temperature),
                               max(1, chunk_elements // vocab))
    return out.view(tokens.shape)


def response_logprobs(model, batch, temperature=1.0):
    """[B, T] log-probs of the response tokens under `model` at the sampling temperature. The T+1 kept logit
    columns go in whole (slicing off the last one would force a copy); the last column's target is a filler."""
    logits = forward(model, batch, logits_to_keep=batch.response_width + 1).logits
    targets = torch.cat([batch.response_ids, batch.response_ids[:, -1:]], 1)
    return token_logprobs(logits, targets, temperature)[:, :-1]


def response_values(critic, batch):
    """[B, T] scalar outputs of a value-head model at the states before each response token."""
    return forward(critic, batch).logits[:, -batch.response_width - 1:-1, 0].float()


def engine_logprobs(completions, width):
    """[B, width] the rollout engine's log-prob of each sampled token, 0 past each response's end."""
    out = torch.zeros(len(completions), width)
    for row, completion in enumerate(completions):
        out[row, :len(completion.logprobs[:width])] = torch.tensor(completion.logprobs[:width], dtype=torch.float32)
    return out


@torch.no_grad()
def batched(function, batch, micro_batch_size, max_tokens=0):
    """Apply `function(micro_batch) -> [b, t]` over micro-batches without gradients; returns [B, T].
    max_tokens > 0 packs the micro-batches by padded token count instead (token_budget_chunks)."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    rows = list(range(batch.input_ids.shape[0]))
    for micro_rows in micro_batches(rows, batch.lengths() if max_tokens else None, micro_batch_size, max_tokens):
        micro = batch.select(micro_rows)
        out[micro_rows, :micro.response_width] = function(micro).float()
    return out


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def token_budget_chunks(indices, lengths, max_tokens):
    """Split `indices` into micro-batches of at most `max_tokens` padded tokens (rows x width); a row wider than
    the budget goes alone. Rows are taken longest first, so rows of similar length share a micro-batch and
    little padding is computed. `lengths[i]` is row i's length, or a (prompt, response) pair: in a SequenceBatch
    the width is the longest prompt plus the longest response of the micro-batch (SequenceBatch.lengths())."""
    def parts(index):
        value = lengths[index]
        value = value.tolist() if torch.is_tensor(value) else value
        return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),)

    groups, group, widest = [], [], ()
    for index in sorted(indices, key=lambda i: -sum(parts(i))):  # stable: equal lengths keep their order
        wider = tuple(map(max, widest, parts(index))) if group else parts(index)
        if group and (len(group) + 1) * sum(wider) > max_tokens:
            groups.append(group)
            group, wider = [], parts(index)
        group.append(index)
        widest = wider
    return groups + [group] if group else groups


def micro_batches(rows, lengths, micro_batch_size, max_tokens=0):
    """Micro-batches of `rows`: packed by padded token count when max_tokens > 0, else micro_batch_size rows each.
    Under torchrun every rank gets as many as the rank with the most (FSDP forwards are collective): the largest
    micro-batches are halved until the counts agree."""
    groups = token_budget_chunks(rows, lengths, max_tokens) if max_tokens else chunks(rows, micro_batch_size)
    wanted = max(gather_objects(len(groups)))
    while len(groups) < wanted:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            raise UserError(f"the ranks need {wanted} micro-batches but this one holds {len(rows)} sequences: "
                            "use the same number of sequences on every rank")
        half = len(groups[largest]) // 2
        groups[largest:largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups


def step_rows(rows, step, count, seed):
    """The `count` training rows of rollout `step`: a fresh seeded shuffle per pass over the data, so the
    data position is a function of the step alone (exact resume)."""
    orders, picked = {}, []
    for position in range(step * count, (step + 1) * count):
        epoch, index = divmod(position, len(rows))
        if epoch not in orders:
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(len(rows))
        picked.append(rows[orders[epoch][index]])
    return picked


# ----------------------------------------------------------------------------------------------
# Evaluation: rollout metrics (repetition included), avg@n and unbiased pass@k per dataset, --eval-only.
# ----------------------------------------------------------------------------------------------
def rollout_metrics(completions, rewards, trainer_logprobs, mask):
    """Reward, length and truncation of a rollout, and the gap between the rollout engine's log-probs and
    the trainer's (they differ by numerics, and by design when top-p < 1)."""
    engine = engine_logprobs(completions, trainer_logprobs.shape[1]).to(trainer_logprobs.device)
    gap = (engine - trainer_logprobs).abs()[mask]
    return {"reward": rewards.mean().item(), "accuracy": (rewards > 0).float().mean().item(),
            "response_length": mask.sum().item() / len(completions),
            "truncated": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "repetition": repetition_rate([response_tokens(c) for c in completions]),
            "logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "logprob_gap_max": gap.max().item() if gap.numel() else 0.0,
            "verify_timeouts": pop_verify_timeouts()}


def response_tokens(completion):
    """The sampled tokens without the final EOS."""
    return completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids


def ends_in_loop(tokens, max_ngram=200, min_repeats=4, min_tokens=32):
    """True when the response ends in a repeated n-gram loop: for some n <= max_ngram, each of its last L tokens
    equals the token n before it (the tail is one n-gram repeated back to back, the last copy possibly cut
    short by the length limit), with L >= min_repeats * n and L >= min_tokens. `tokens`: ids, or a string."""
    tokens = list(tokens)
    for n in range(1, max_ngram + 1):
        needed = max(min_repeats * n, min_tokens)  # length of the periodic tail that makes a loop
        if needed > len(tokens):
            return False
        if all(tokens[-i] == tokens[-i - n] for i in range(1, needed - n + 1)):
            return True
    return False


def repetition_rate(responses, max_ngram=200, min_repeats=4, min_tokens=32):
    """Fraction of responses (token-id lists without the EOS, or strings) that end in a loop (ends_in_loop)."""
    return sum(ends_in_loop(r, max_ngram, min_repeats, min_tokens) for r in responses) / max(len(responses), 1)


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(generator, tokenizer, eval_sets, n=1, max_tokens=256, temperature=0.0, top_p=1.0, seed=0):
    """{eval/<name>/avg@n, eval/<name>/pass@k for k = 1, 2, 4 .. n (n > 1), eval/<name>/truncated and
    eval/<name>/repetition} for each named list of rows; a response cut off at max_tokens scores 0, as in
    training. eval/accuracy is avg@n on the first set. Samples under its own seed: training randomness is untouched."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return _evaluate(generator, tokenizer, eval_sets, n, max_tokens, temperature, top_p)


def _evaluate(generator, tokenizer, eval_sets, n, max_tokens, temperature, top_p):
    metrics = {}
    for name, all_rows in eval_sets.items():
        rows = all_rows[rank()::world_size()]  # under torchrun each rank takes every world_size-th problem
        completions = generator.generate([prompt_ids(tokenizer, r["question"]) for r in rows], n, max_tokens,
                                         temperature, top_p)
        correct = np.zeros(len(rows), dtype=int)
        for completion in completions:
            if completion.finish_reason == "stop":
                correct[completion.prompt_index] += verify(completion.text, rows[completion.prompt_index]["answer"])
        shares = gather_objects((correct.tolist(), sum(c.finish_reason == "length" for c in completions),
                                 sum(ends_in_loop(response_tokens(c)) for c in completions)))
        correct = np.array([c for share in shares for c in share[0]])
        samples = len(correct) * n
        metrics[f"eval/{name}/avg@{n}"] = float(correct.mean() / n)
        for k in [2 ** i for i in range(int(math.log2(n)) + 1)] if n > 1 else []:
            metrics[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
        metrics[f"eval/{name}/truncated"] = sum(share[1] for share in shares) / samples
        metrics[f"eval/{name}/repetition"] = sum(share[2] for share in shares) / samples
        metrics.setdefault("eval/accuracy", metrics[f"eval/{name}/avg@{n}"])
    return metrics


def eval_table(metrics):
    """The eval/<name>/<metric> entries of `metrics` as a text table, a row per dataset."""
    table = {}
    for key, value in metrics.items():
        if key.startswith("eval/") and key.count("/") >= 2:
            name, metric = key[len("eval/"):].rsplit("/", 1)
            table.setdefault(name, {})[metric] = value
    columns = list(dict.fromkeys(metric for row in table.values() for metric in row))
    width = max([len("dataset")] + [len(name) for name in table])
    lines = [f"{'dataset':<{width}} " + " ".join(f"{c:>10}" for c in columns)]
    for name, row in table.items():
        lines.append(f"{name:<{width}} " + " ".join(f"{row[c]:>10.4f}" if c in row else f"{'':>10}" for c in columns))
    return "\n".join(lines)


def run_eval_only(args, generator, tokenizer, eval_sets, logger, step=0, write=print):
    """--eval-only: evaluate the loaded policy (a hub model, or a checkpoint's HF directory given as --model,
    e.g. runs/<run>/checkpoints/step_000050/policy) with the trainer's eval flags, through the same code and
    seed as the evaluations during training; log it as `step` and print the table. Returns the metrics."""
    metrics = evaluate(generator, tokenizer, eval_sets, args.eval_n, args.eval_max_tokens, args.eval_temperature,
                       args.eval_top_p)
    logger.log(step, metrics, write)
    write(eval_table(metrics))
    return metrics


# ----------------------------------------------------------------------------------------------
# Diagnostics: critic quality against Monte Carlo values (SP3O's MSE and effective rank, TPPO's sign
# accuracy), explained variance of value targets.
# ----------------------------------------------------------------------------------------------
def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) over the valid tokens: 1 for a perfect critic, 0 for one no better
    than a constant, negative for a worse one. When Var(returns) = 0: 1.0 if the residual does not vary, else 0.0
    (as scikit-learn's explained_variance_score); 0.0 for an empty mask."""
    returns, values = returns[mask].double(), values[mask].double()
    if returns.numel() == 0:
        return 0.0
    target_variance, residual_variance = returns.var(unbiased=False), (returns - values).var(unbiased=False)
    if target_variance == 0:
        return 1.0 if residual_variance == 0 else 0.0
    return float(1 - residual_variance / target_variance)


def effective_rank(matrix):
    """exp(entropy of the singular values normalized to sum 1) of a [n, d] matrix (Roy & Vetterli, 2007): r for
    r equal nonzero singular values, between 1 and the rank otherwise, 0 for a zero matrix. Rows are not centered.
    Singular values under torch.linalg.matrix_rank's tolerance (rounding noise of the input dtype) count as 0."""
    singular_values = torch.linalg.svdvals(matrix.double())
    if matrix.numel() == 0 or singular_values.max() == 0:
        return 0.0
    tolerance = singular_values.max() * max(matrix.shape) * torch.finfo(matrix.dtype).eps
    p = singular_values[singular_values > tolerance] / singular_values[singular_values > tolerance].sum()
    return float(torch.exp(-(p * p.log()).sum()))


def sign_accuracy(critic_values, mc_values, continuations, tau=0.0):
    """TPPO's diagnostic as defined here (its Appendix D.3, with the paper's exact definition, is not available
    to us). critic_values, mc_values: [N, A] values at A anchors of N responses, each MC value the mean of
    `continuations` = K Bernoulli rewards. For consecutive anchors a < b: dMC = MC_b - MC_a, standard error
    se = sqrt(MC_a (1 - MC_a) / K + MC_b (1 - MC_b) / K) (independent samples), SNR = |dMC| / se (0 / 0 = 0,
    x / 0 = inf). Among the intervals with SNR > tau, the fraction with sign(dcritic) == sign(dMC) (a critic
    change of exactly 0 counts as wrong). Returns (accuracy, or None when no interval is kept; kept fraction)."""
    critic_values, mc_values = np.asarray(critic_values, dtype=float), np.asarray(mc_values, dtype=float)
    mc_change, critic_change = np.diff(mc_values, axis=1), np.diff(critic_values, axis=1)
    variance = mc_values * (1 - mc_values) / continuations
    standard_error = np.sqrt(variance[:, 1:] + variance[:, :-1])
    with np.errstate(divide="ignore", invalid="ignore"):
        snr = np.where(mc_change == 0, 0.0, np.abs(mc_change) / standard_error)
    kept = snr > tau
    if not kept.any():
        return None, 0.0
    return float((np.sign(critic_change[kept]) == np.sign(mc_change[kept])).mean()), float(kept.mean())


def variation_ratio(critic_values, mc_values):
    """How much the critic's value moves within a response compared with the MC value: the root of the summed
    squared deviations of each [N, A] row from its own mean, critic over MC. Value flattening (SP3O) shows as a
    ratio near 0. The MC noise (variance p (1 - p) / K per anchor) inflates the denominator. None if MC is flat."""
    critic_values, mc_values = np.asarray(critic_values, dtype=float), np.asarray(mc_values, dtype=float)
    spread = lambda x: np.sqrt(((x - x.mean(1, keepdims=True)) ** 2).sum())
    return float(spread(critic_values) / spread(mc_values)) if spread(mc_values) > 0 else None


def probe_cuts(length, ratios=(0.3, 0.6, 0.9)):
    """Response prefix lengths probed in a response of `length` tokens: 0 (the prompt state) and round(rho * length)
    for each ratio, at most length - 1 (the state before the last token). Equal cuts stay (one MC request)."""
    return [0] + [min(round(ratio * length), max(length - 1, 0)) for ratio in ratios]


def monte_carlo_values(generator, tokenizer, states, golds, continuations, max_tokens, temperature=1.0, top_p=1.0):
    """V(s) for each state s = (prompt ids, response prefix ids) by Monte Carlo: the mean verify() reward of
    `continuations` sampled completions of s, a response scoring 0 if it has not stopped within `max_tokens`
    tokens in all (prefix included), as in training. Identical states are sampled once; one generate call.
    Returns (values: np.ndarray [len(states)], generated tokens)."""
    index = {}
    for (prompt, prefix), gold in zip(states, golds):
        index.setdefault((tuple(prompt), tuple(prefix)), (len(index), gold))
    unique = list(index)
    if not unique:
        return np.zeros(0), 0
    budget = max(max_tokens - min(len(prefix) for _, prefix in unique), 1)  # each state's own budget: checked below
    completions = generator.generate([list(prompt) + list(prefix) for prompt, prefix in unique], continuations, budget,
                                     temperature, top_p)
    totals = np.zeros(len(unique))
    for completion in completions:
        prompt, prefix = unique[completion.prompt_index]
        if completion.finish_reason == "stop" and len(prefix) + len(completion.token_ids) <= max_tokens:
            text = tokenizer.decode(list(prefix) + list(completion.token_ids), skip_special_tokens=True)
            totals[completion.prompt_index] += verify(text, index[prompt, prefix][1])
    values = totals / continuations
    return values[[index[tuple(prompt), tuple(prefix)][0] for prompt, prefix in states]], \
        sum(len(c.token_ids) for c in completions)


@torch.no_grad()
def response_hidden_states(model, batch, micro_batch_size=8):
    """Per row, the [n, H] last hidden states at the states before its n response tokens (where a critic reads V)."""
    states = []
    for rows in chunks(list(range(batch.input_ids.shape[0])), micro_batch_size):
        micro = batch.select(rows)
        hidden = forward(model, micro, output_hidden_states=True).hidden_states[-1]
        hidden = hidden[:, -micro.response_width - 1:-1]
        states += [hidden[i, :int(micro.response_mask[i].sum())].float().cpu() for i in range(len(rows))]
    return states


@torch.no_grad()
def probe_critic(generator, tokenizer, rows, value_fn, critic=None, num_prompts=16, continuations=8, max_tokens=256,
                 temperature=1.0, top_p=1.0, device="cpu", micro_batch_size=8, seed=0, prompt_only=False,
                 ratios=(0.3, 0.6, 0.9), taus=(0, 1)):
    """Critic quality on the first `num_prompts` rows (held-out problems). Per prompt: sample one response; at
    the prompt and at each ratio of the response (probe_cuts) compare the critic's value, value_fn(SequenceBatch)
    -> [B, T] with column t = V(s_t) (column 0: the prompt state), with a Monte Carlo value (K = `continuations`).
    prompt_only: a critic that sees only the prompt (SPPO): the prompt anchor alone, no response sampled.
    `critic`, a value-head model, adds the median effective rank of its last hidden states over each response.
    Logged: probe/mse_<anchor>, probe/mc_mean, probe/value_mean, probe/variation_ratio,
    probe/sign_acc_tau<tau> and probe/sign_kept_tau<tau> (sign_accuracy), probe/effective_rank, and the cost:
    probe_tokens (generated) and probe_s (seconds). Samples under its own seed: training randomness is untouched."""
    start, rows = time.time(), rows[:num_prompts]
    prompts = [prompt_ids(tokenizer, row["question"]) for row in rows]
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        responses, generated = [[] for _ in rows], 0
        if not prompt_only:
            for completion in generator.generate(prompts, 1, max_tokens, temperature, top_p):
                responses[completion.prompt_index] = list(completion.token_ids)
            generated = sum(len(response) for response in responses)
        cuts = [[0] if prompt_only else probe_cuts(len(response), ratios) for response in responses]
        states = [(prompts[i], responses[i][:cut]) for i, row_cuts in enumerate(cuts) for cut in row_cuts]
        golds = [rows[i]["answer"] for i, row_cuts in enumerate(cuts) for _ in row_cuts]
        mc_values, mc_tokens = monte_carlo_values(generator, tokenizer, states, golds, continuations, max_tokens,
                                                  temperature, top_p)
    batch = sequence_batch(prompts, responses, tokenizer.pad_token_id).to(device)
    values = batched(value_fn, batch, micro_batch_size).cpu().numpy()
    critic_values = np.array([[values[i, cut] for cut in row_cuts] for i, row_cuts in enumerate(cuts)])
    mc_values = mc_values.reshape(critic_values.shape)
    names = ["prompt"] + [f"{round(100 * ratio)}" for ratio in ratios]
    metrics = {f"probe/mse_{name}": float(((critic_values[:, a] - mc_values[:, a]) ** 2).mean())
               for a, name in enumerate(names[:critic_values.shape[1]])}
    metrics.update({"probe/mc_mean": float(mc_values.mean()), "probe/value_mean": float(critic_values.mean())})
    if not prompt_only:
        ratio = variation_ratio(critic_values, mc_values)
        if ratio is not None:
            metrics["probe/variation_ratio"] = ratio
        for tau in taus:
            accuracy, kept = sign_accuracy(critic_values, mc_values, continuations, tau)
            metrics[f"probe/sign_kept_tau{tau:g}"] = kept
            if accuracy is not None:
                metrics[f"probe/sign_acc_tau{tau:g}"] = accuracy
        if critic is not None:
            ranks = [effective_rank(hidden) for hidden in response_hidden_states(critic, batch, micro_batch_size)]
            metrics["probe/effective_rank"] = float(np.median(ranks))
    metrics.update(probe_tokens=generated + mc_tokens, probe_s=time.time() - start)
    return metrics


# ----------------------------------------------------------------------------------------------
# Logging: stdout, runs/<run>/metrics.jsonl, optional TensorBoard and Weights & Biases.
# ----------------------------------------------------------------------------------------------
def run_directory(args, trainer_file):
    """<output_dir>/<run_name>; a resumed run keeps writing where it was; a new run never reuses a directory."""
    if args.resume and not args.run_name:
        return os.path.abspath(args.resume).split(os.sep + "checkpoints")[0]
    method = os.path.splitext(os.path.basename(trainer_file))[0]

    def name_it():  # on rank 0 only: the clock may tick between ranks
        name = args.run_name or f"{method}_{os.path.basename(args.model.rstrip('/'))}_s{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
        path = os.path.join(args.output_dir, name)
        if os.path.exists(os.path.join(path, "metrics.jsonl")) and not args.resume:
            raise UserError(f"{path} already holds a run: pass --resume {path} to continue it, or another --run-name")
        return path
    return on_rank0(name_it)


class Logger:
    SHOWN = ["reward", "accuracy", "response_length", "policy_loss", "value_loss", "clip_fraction", "approx_kl",
             "grad_norm", "tokens_per_s", "rollout_s", "update_s", "mc_tokens", "repetition", "explained_variance",
             "probe/mse_60", "probe/sign_acc_tau1", "probe/effective_rank", "probe_s", "eval/accuracy"]

    def __init__(self, run_dir, config, tensorboard=False, wandb_project=None):
        self.path, self.tensorboard, self.wandb = os.path.join(run_dir, "metrics.jsonl"), None, None
        if rank() > 0:  # under torchrun rank 0 writes for all
            return
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as handle:
            json.dump(dataclasses.asdict(config), handle, indent=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(run_dir)
        if wandb_project:
            import wandb
            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(run_dir), config=dataclasses.asdict(config))

    def log(self, step, metrics, write=print):
        """Under torchrun every rank calls it: a metric is the mean of the ranks' values (each rank's losses are
        already its estimate of the global one)."""
        shares = gather_objects({k: float(v) for k, v in metrics.items()})
        record = {"step": step, **{k: float(np.mean([s[k] for s in shares if k in s]))
                                   for k in dict.fromkeys(k for s in shares for k in s)}}
        if rank() > 0:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        write(f"step {step:4d} " + " ".join(f"{key.replace('/', '_')}={record[key]:.4g}"
                                             for key in self.SHOWN if key in record))
        if self.tensorboard:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(record, step=step)


# ----------------------------------------------------------------------------------------------
# Checkpoints: HF-format weights (safetensors) per model + one trainer_state.pt, written atomically.
# ----------------------------------------------------------------------------------------------
def _checkpoint_steps(root):
    """Step numbers of the finished checkpoints under `root`, ascending (staging directories are not listed)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(name[5:]) for name in names if re.fullmatch(r"step_\d+", name))


def _fsync(path):
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(path):
    """Flush a directory tree to disk, so a power loss after the rename cannot leave truncated files."""
    for directory, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def save_checkpoint(run_dir, step, models, optimizers, tokenizer, keep=2):
    """runs/<run>/checkpoints/step_<n>/{sharded/, <name>/, rng_rank<r>.pt, trainer_state.pt}: sharded/ holds the
    weights and optimizer states (torch.distributed.checkpoint: each rank writes its shards, and a resume may use
    any number of ranks); <name>/ a whole HF-format copy of each model (for --eval-only, vLLM and export).
    Written to a staging directory, flushed, then renamed: a kill at any moment leaves the previous checkpoints
    whole. Keeps the last `keep`; a saved step also removes later steps (left by a run resumed from an earlier
    checkpoint). Every rank calls it; the directory must be one filesystem seen by all (multi-node: a shared one)."""
    root = os.path.join(run_dir, "checkpoints")
    final, staging = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f".staging_{step:06d}")
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith((".staging_", ".replaced_")):  # left by a save that was killed
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    # DCP's state-dict API gives a never-stepped optimizer (the actor during critic warm-up) state by a step at lr 0,
    # Adam's step count included: it is emptied again here and after loading, so a resumed run stays exact
    fresh = [name for name, optimizer in optimizers.items() if not optimizer.state]
    state = {"step": step, "models": sorted(models), "fresh_optimizers": fresh}
    _save_sharded(staging, models, optimizers, tokenizer)
    for name in fresh:
        optimizers[name].state.clear()
    torch.save(_rng_state(), os.path.join(staging, f"rng_rank{rank()}.pt"))
    if distributed():
        torch.distributed.barrier()
    if rank() == 0:
        torch.save(state, os.path.join(staging, "trainer_state.pt"))
        _fsync_tree(staging)
        replaced = os.path.join(root, f".replaced_{step:06d}")
        if os.path.exists(final):  # saving the same step again (an interrupt or a stop right after a save)
            os.rename(final, replaced)
        os.rename(staging, final)
        _fsync(root)
        shutil.rmtree(replaced, ignore_errors=True)
        steps = _checkpoint_steps(root)
        for old in [s for s in steps if s > step] + [s for s in steps if s <= step][:-max(keep, 1)]:
            shutil.rmtree(os.path.join(root, f"step_{old:06d}"), ignore_errors=True)
    if distributed():
        torch.distributed.barrier()
    return final


def _save_sharded(directory, models, optimizers, tokenizer):
    """The shards of every model and optimizer (DCP; one process writes one shard), and a whole HF-format copy of
    each model, gathered to rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    dcp.save(_sharded_state(models, optimizers), checkpoint_id=os.path.join(directory, "sharded"))
    for name, model in models.items():
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
            if distributed() else None  # None: save_pretrained takes the model's own
        if rank() == 0:
            model.save_pretrained(os.path.join(directory, name), state_dict=whole, safe_serialization=True)
            model.config.architectures = [getattr(model, "architecture", type(model).__name__)]  # not FSDP's class
            model.config.save_pretrained(os.path.join(directory, name))
            tokenizer.save_pretrained(os.path.join(directory, name))


def _sharded_state(models, optimizers):
    """{name: {"model": ..., "optimizer": ...}}: this rank's shards (whole tensors in one process), keyed by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    return {name: dict(zip(("model", "optimizer"), get_state_dict(model, optimizers[name]))) for name, model in models.items()}


def _rng_state():
    return {"python": random.getstate(), "numpy": _numpy_rng_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_rng_state():
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian]


def _load_weights(model, directory):
    """Load HF-format safetensors (one file or shards) into `model`, refusing a mismatch (tied weights excepted)."""
    from safetensors.torch import load_file
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    elif os.path.exists(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(f"--resume: {directory} holds no model.safetensors (an incomplete or foreign checkpoint)")
    weights = {}
    for name in files:
        weights.update(load_file(os.path.join(directory, name)))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded_storage = {state[k].data_ptr() for k in weights if k in state}
    missing = [k for k in missing if state[k].data_ptr() not in loaded_storage]  # tied to a loaded tensor: fine
    if missing or unexpected:
        raise UserError(f"--resume: the checkpoint in {directory} does not fit the model (missing "
                        f"{', '.join(missing[:3]) or 'nothing'}; unexpected {', '.join(unexpected[:3]) or 'nothing'}); "
                        "resume with the same --model and method")


def find_checkpoint(path):
    """The checkpoint directory `--resume path` names: a step_<n> directory, or a run directory's latest checkpoint.
    Raises UserError (cheap: call it before loading any model)."""
    if not os.path.isdir(path):
        raise UserError(f"--resume {path!r}: no such directory (give runs/<run> or runs/<run>/checkpoints/step_<n>)")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        steps = _checkpoint_steps(os.path.join(path, "checkpoints"))
        if not steps:
            raise UserError(f"--resume {path!r}: the run has no checkpoint yet")
        path = os.path.join(path, "checkpoints", f"step_{steps[-1]:06d}")
    if not os.path.exists(os.path.join(path, "trainer_state.pt")):
        raise UserError(f"--resume {path!r}: not a checkpoint (no trainer_state.pt)")
    return path


def load_checkpoint(path, models, optimizers):
    """Restore weights, optimizer states and RNG from `path` (see find_checkpoint). Returns the number of finished
    steps, which also fixes the data position (step_rows). Any number of ranks can load it."""
    path = find_checkpoint(path)
    saved = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    saved_models = saved.get("models") or sorted(saved["optimizers"])
    if saved_models != sorted(optimizers):
        raise UserError(f"--resume {path!r}: saved by a trainer with models {saved_models}, this one has {sorted(optimizers)}")
    if os.path.isdir(os.path.join(path, "sharded")):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        sharded = _sharded_state(models, optimizers)
        try:
            dcp.load(sharded, checkpoint_id=os.path.join(path, "sharded"))
        except (Exception, dcp.api.CheckpointException) as error:  # a BaseException: it wraps a missing or misshapen tensor
            problem = re.search(r"(Missing key[^\n]*|Size mismatch[^\n]*)", str(error))
            raise UserError(f"--resume: the checkpoint in {path} does not fit the model "
                            f"({problem.group(1) if problem else type(error).__name__}); resume with the same --model and method")
        for name, model in models.items():
            set_state_dict(model, optimizers[name], model_state_dict=sharded[name]["model"],
                           optim_state_dict=sharded[name]["optimizer"])
            if name in saved.get("fresh_optimizers", []):
                optimizers[name].state.clear()
        rng_path = os.path.join(path, f"rng_rank{rank()}.pt")
        if os.path.exists(rng_path):
            _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True))
        else:  # more ranks than the run that saved it: a fresh seed per step and rank
            seed_everything(saved["step"] * 1000 + 7)
        return saved["step"]
    if distributed():  # a checkpoint of an older version of this code, without sharded/
        raise UserError(f"--resume {path!r}: saved without sharded/; resume it in one process (without torchrun)")
    for name, model in models.items():
        _load_weights(model, os.path.join(path, name))
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(saved["optimizers"][name])
    _set_rng_state(saved["rng"])
    return saved["step"]


class StopOnCtrlC:
    """The first Ctrl-C asks the loop to stop after the current step (`requested`), so the checkpoint then saved
    holds whole steps (a Ctrl-C in the middle of an update would save half of one); a second Ctrl-C raises
    KeyboardInterrupt at once. restore() puts the previous handler back."""

    def __init__(self):
        self.signalled = False
        self.previous = signal.signal(signal.SIGINT, self._handle)

    @property
    def requested(self):
        """Under torchrun: whether any rank saw Ctrl-C, so that all stop after the same step."""
        return rank_mean(self.signalled) > 0 if distributed() else self.signalled

    def _handle(self, signum, frame):
        if self.signalled:
            raise KeyboardInterrupt
        self.signalled = True
        print("\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again: stop now, without one)",
              file=sys.stderr)

    def restore(self):
        signal.signal(signal.SIGINT, self.previous)


if __name__ == "__main__":
    if sys.argv[1:] == ["build-tiny"]:
        shutil.rmtree(os.path.join(CACHE_DIR, TINY_MODEL_VERSION), ignore_errors=True)
        print(build_tiny_model())
    else:
        print("usage: python common.py build-tiny   (rebuilds the built-in tiny model in", CACHE_DIR + ")")
