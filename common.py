"""Plumbing shared by the six trainers. Nothing in here knows about RL.

Sections, top to bottom: command line, model loading (and the built-in tiny model), the built-in task,
data loading and prompts, answer checking, the rollout engine, batching and per-token log-probs,
evaluation, logging, checkpoints.
"""
import argparse
import dataclasses
import inspect
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import sys
import time
import typing
from dataclasses import dataclass

import numpy as np
import torch

CACHE_DIR = os.path.expanduser(os.environ.get("RL_REASONING_CACHE", "~/.cache/rl-reasoning"))
TINY_MODEL_VERSION = "tiny-v2"  # bump when build_tiny_model changes, so stale caches are not reused
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


class UserError(Exception):
    """Bad input from the user (flags, data, paths): printed as one line, no traceback."""


def run_main(main):
    """Run a trainer's main(), turning a UserError into a one-line message and exit code 2."""
    try:
        main()
    except UserError as error:
        print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)


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
    parser = _OneLineParser(description=(args_class.__doc__ or "").strip(),
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for field in dataclasses.fields(args_class):
        flag, kind = "--" + field.name.replace("_", "-"), hints[field.name]
        options = dict(dest=field.name, help=helps.get(field.name, ""), default=argparse.SUPPRESS)
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
    if given.get("model", values["model"]) == "tiny":
        values.update(tiny_preset or {})
    values.update({name: tuple(v) if isinstance(v, list) else v for name, v in given.items()})
    return args_class(**values)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


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


def load_model(name_or_path, dtype="auto", device=None, trust_remote_code=False, value_head=False):
    """Return (model, tokenizer). With value_head=True the model is the backbone plus a scalar head
    per position (AutoModelForTokenClassification with one label, as verl builds its critic)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    path, device = resolve_model_name(name_or_path), device or default_device()
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    tokenizer = load_tokenizer(path, trust_remote_code)
    kwargs = dict(dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
    try:
        if value_head:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as error:
        raise UserError(f"cannot load model {name_or_path!r} from {path!r}: {str(error).splitlines()[0]}")
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


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
    """Normalize a gold field: GSM8K `... #### 18` -> `18`, a MATH solution -> its last \\boxed{}, numbers -> str."""
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if not isinstance(value, str) or not value.strip():
        return None
    if "####" in value:
        return value.rsplit("####", 1)[1].strip().replace(",", "")
    return extract_answer(value) or value.strip()


def row_to_example(row, where):
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = next((row[k] for k in QUESTION_FIELDS if isinstance(row.get(k), str) and row[k].strip()), None)
    if question is None:
        raise UserError(f"{where}: no question field (one of {', '.join(QUESTION_FIELDS)})")
    answer_key = "answer" if row.get("answer") not in (None, "") else next((k for k in ANSWER_FIELDS if k in row), None)
    answer = gold_answer(row.get(answer_key)) if answer_key else None
    if answer is None:
        raise UserError(f"{where}: no answer field (one of {', '.join(ANSWER_FIELDS)}) or it is empty")
    return {"question": question, "answer": answer}


def load_rows(spec, split="train", n_builtin=None, seed=0, skip_bad_rows=False):
    """Rows {"question", "answer"} from `builtin`, a .jsonl/.json/.parquet file, or a hub dataset id.
    Raises UserError naming `file:line` for a bad row (or skips it with skip_bad_rows)."""
    if spec == "builtin":
        return builtin_rows(split, n_builtin or 4096, seed)
    if os.path.exists(spec):
        if spec.endswith(".parquet"):
            import pyarrow.parquet
            raw = [(f"{spec}:row {i + 1}", row) for i, row in enumerate(pyarrow.parquet.read_table(spec).to_pylist())]
        elif spec.endswith((".jsonl", ".json")):
            raw = []
            with open(spec, encoding="utf-8") as handle:
                text = handle.read()
            lines = [text] if spec.endswith(".json") and text.lstrip().startswith("[") else text.splitlines()
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    parsed = json.loads(line)
                except json.JSONDecodeError as error:
                    raw.append((f"{spec}:{number}", UserError(f"{spec}:{number}: invalid JSON ({error.msg})")))
                    continue
                raw.extend((f"{spec}:{i + 1}", r) for i, r in enumerate(parsed)) if isinstance(parsed, list) \
                    else raw.append((f"{spec}:{number}", parsed))
        else:
            raise UserError(f"--dataset {spec!r}: unsupported file type (use .jsonl, .json or .parquet)")
    elif "/" in spec and not spec.startswith((".", "/")) and spec.count("/") == 1:
        try:
            import datasets
            raw = [(f"{spec}[{i}]", r) for i, r in enumerate(datasets.load_dataset(spec, split=split))]
        except Exception as error:  # hub unreachable, no `datasets` package, no such split ...
            raise UserError(f"--dataset {spec!r}: not a local file and the hub dataset could not be loaded "
                            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    else:
        raise UserError(f"--dataset {spec!r}: no such file")
    rows, bad = [], 0
    for where, row in raw:
        try:
            if isinstance(row, Exception):
                raise row
            rows.append(row_to_example(row, where))
        except UserError:
            if not skip_bad_rows:
                raise
            bad += 1
    if bad:
        print(f"skipped {bad} bad rows in {spec}", file=sys.stderr)
    if not rows:
        raise UserError(f"--dataset {spec!r}: no usable rows")
    return rows


def load_eval_sets(specs, limit=0, skip_bad_rows=False):
    """{name: rows} for a comma-separated list of eval datasets (`builtin` = the task's held-out split);
    a file `math500/test.jsonl` is named `math500`. `limit` > 0 keeps the first `limit` rows of each."""
    sets = {}
    for spec in specs.split(","):
        name = os.path.splitext(os.path.basename(spec))[0]
        name = os.path.basename(os.path.dirname(spec)) or name if name in ("test", "train", "validation") else name
        sets[name] = load_rows(spec, "test", n_builtin=limit or 256, skip_bad_rows=skip_bad_rows)[:limit or None]
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
# Answer checking. Model output is never evaluated as code: math-verify parses it, in a separate
# process killed after a time limit (not signal.alarm, which breaks outside the main thread).
# ----------------------------------------------------------------------------------------------
MAX_ANSWER_CHARS = 1000


def extract_answer(text):
    """The content of the last \\boxed{...} after any </think>, braces balanced; None if there is none."""
    text = text.rsplit("</think>", 1)[-1]
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, position = 0, start + len("\\boxed{") - 1
        end = text.find("}", position)
        for position in range(position, min(len(text), position + MAX_ANSWER_CHARS + 2)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                return text[start + len("\\boxed{"):position].strip()
        if end == -1:  # an unclosed last \boxed{: look at the one before it
            start = text.rfind("\\boxed{", 0, start)
        else:
            return None
    return None


def _plain_number(text):
    text = text.replace(",", "").replace("$", "").strip()
    if re.fullmatch(r"-?\d{1,50}(\.\d{1,50})?", text):
        return float(text)
    return None


def _math_verify_worker(connection):
    from math_verify import parse, verify
    while True:
        gold, answer = connection.recv()
        try:
            connection.send(float(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{answer}}}"))))
        except Exception:
            connection.send(0.0)


class _Verifier:
    """A warm math-verify worker process plus a spare, so a killed worker is replaced at once."""

    def __init__(self):
        self.workers = []

    def _start(self):
        parent, child = multiprocessing.get_context("spawn").Pipe()
        process = multiprocessing.get_context("spawn").Process(target=_math_verify_worker, args=(child,), daemon=True)
        process.start()
        return process, parent

    def check(self, gold, answer, timeout):
        while len(self.workers) < 2:
            self.workers.append(self._start())
        process, connection = self.workers[0]
        connection.send((gold, answer))
        if connection.poll(timeout):
            return connection.recv(), False
        process.kill()  # hung on hostile input: drop it, the spare takes over
        self.workers.pop(0)
        self.workers.append(self._start())
        return 0.0, True


_VERIFIER = _Verifier()
VERIFY_STATS = {"timeouts": 0}


def verify(response, gold, timeout=1.5):
    """1.0 if the last \\boxed{} of `response` equals `gold` (math-verify, gold first), else 0.0.
    Exact and plain-number matches are decided here; everything else goes to the worker process."""
    answer = extract_answer(response)
    if answer is None or gold is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    if answer == gold:
        return 1.0
    answer_number, gold_number = _plain_number(answer), _plain_number(gold)
    if answer_number is not None and gold_number is not None:
        return float(answer_number == gold_number)
    score, timed_out = _VERIFIER.check(gold, answer, timeout)
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
    """Hugging Face `generate` backend (CPU or GPU). Reads the live policy weights, so no sync is needed."""

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size

    def sync_weights(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        from transformers import GenerationConfig
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        sample = temperature > 0
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=sample, temperature=temperature if sample else None,
                                  top_p=top_p if sample else None, top_k=0 if sample else None, eos_token_id=eos,
                                  pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
        requests = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        completions, was_training = [], self.model.training
        self.model.eval()
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            width = max(len(p) for _, p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for _, p in chunk])
            attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for _, p in chunk])[:, None]).long()
            device = self.model.device
            out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                      generation_config=config)
            sampled = out.sequences[:, width:].cpu()
            scores = torch.stack(out.scores, 1).float().log_softmax(-1)  # processed: temperature and top-p applied
            logprobs = scores.gather(-1, sampled[:, :, None].to(scores.device)).squeeze(-1).cpu()
            for row, (index, _) in enumerate(chunk):
                tokens = sampled[row].tolist()
                stop = tokens.index(eos) + 1 if eos in tokens else len(tokens)
                completions.append(Completion(index, tokens[:stop], self.tokenizer.decode(tokens[:stop], skip_special_tokens=True),
                                              logprobs[row, :stop].tolist(), "stop" if eos in tokens else "length"))
        self.model.train(was_training)
        return completions


def make_generator(kind, model, tokenizer):
    if kind in ("auto", "hf"):
        return HFGenerator(model, tokenizer)
    raise UserError(f"--generator {kind!r} is not available here (the vLLM backend needs vllm and a CUDA GPU)")


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


def token_logprobs(logits, tokens, chunk_rows=1024):
    """log softmax(logits)[tokens] without a full-vocabulary log-softmax copy: gather minus logsumexp,
    computed over chunks of rows so the temporary is at most chunk_rows x vocab."""
    flat_logits, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
    out = torch.empty(flat_tokens.shape, dtype=torch.float32, device=logits.device)
    for start in range(0, flat_tokens.shape[0], chunk_rows):
        rows = flat_logits[start:start + chunk_rows].float()
        out[start:start + chunk_rows] = rows.gather(-1, flat_tokens[start:start + chunk_rows, None]).squeeze(-1) \
            - rows.logsumexp(-1)
    return out.view(tokens.shape)


def response_logprobs(model, batch, temperature=1.0):
    """[B, T] log-probs of the response tokens under `model` at the sampling temperature."""
    logits = model(**batch.model_inputs(), logits_to_keep=batch.response_width + 1).logits[:, :-1]
    return token_logprobs(logits / temperature, batch.response_ids)


def response_values(critic, batch):
    """[B, T] scalar outputs of a value-head model at the states before each response token."""
    return critic(**batch.model_inputs()).logits[:, -batch.response_width - 1:-1, 0].float()


@torch.no_grad()
def batched(function, batch, micro_batch_size):
    """Apply `function(micro_batch) -> [b, t]` over micro-batches without gradients; returns [B, T]."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    for rows in chunks(list(range(batch.input_ids.shape[0])), micro_batch_size):
        micro = batch.select(rows)
        out[rows, :micro.response_width] = function(micro).float()
    return out


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


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
# Evaluation: avg@n accuracy and unbiased pass@k per dataset.
# ----------------------------------------------------------------------------------------------
def rollout_metrics(completions, rewards, trainer_logprobs, mask):
    """Reward, length and truncation of a rollout, and the gap between the rollout engine's log-probs and
    the trainer's (they differ by numerics, and by design when top-p < 1)."""
    engine_logprobs = torch.zeros_like(trainer_logprobs)
    for row, completion in enumerate(completions):
        engine_logprobs[row, :len(completion.logprobs)] = torch.tensor(completion.logprobs)
    gap = (engine_logprobs - trainer_logprobs).abs()[mask]
    return {"reward": rewards.mean().item(), "accuracy": (rewards > 0).float().mean().item(),
            "response_length": mask.sum().item() / len(completions),
            "truncated": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "logprob_gap_max": gap.max().item() if gap.numel() else 0.0}


def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(generator, tokenizer, eval_sets, n=1, max_tokens=256, temperature=0.0, top_p=1.0, seed=0):
    """{eval/<name>/avg@n, eval/<name>/pass@k for k = 1, 2, 4 .. n} for each named list of rows;
    eval/accuracy is avg@n on the first set. Samples under its own seed: training randomness is untouched."""
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        return _evaluate(generator, tokenizer, eval_sets, n, max_tokens, temperature, top_p)


def _evaluate(generator, tokenizer, eval_sets, n, max_tokens, temperature, top_p):
    metrics = {}
    for name, rows in eval_sets.items():
        completions = generator.generate([prompt_ids(tokenizer, r["question"]) for r in rows], n, max_tokens,
                                         temperature, top_p)
        correct = np.zeros(len(rows))
        for completion in completions:
            correct[completion.prompt_index] += verify(completion.text, rows[completion.prompt_index]["answer"])
        metrics[f"eval/{name}/avg@{n}"] = float(correct.mean() / n)
        for k in [2 ** i for i in range(int(math.log2(n)) + 1)] if n > 1 else []:
            metrics[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
        metrics.setdefault("eval/accuracy", metrics[f"eval/{name}/avg@{n}"])
    return metrics


# ----------------------------------------------------------------------------------------------
# Logging: stdout, runs/<run>/metrics.jsonl, optional TensorBoard and Weights & Biases.
# ----------------------------------------------------------------------------------------------
def run_directory(args, trainer_file):
    """<output_dir>/<run_name>; a resumed run keeps writing where it was; a new run never reuses a directory."""
    if args.resume and not args.run_name:
        return os.path.abspath(args.resume).split(os.sep + "checkpoints")[0]
    method = os.path.splitext(os.path.basename(trainer_file))[0]
    name = args.run_name or f"{method}_{os.path.basename(args.model.rstrip('/'))}_s{args.seed}_{time.strftime('%Y%m%d-%H%M%S')}"
    path = os.path.join(args.output_dir, name)
    if os.path.exists(os.path.join(path, "metrics.jsonl")) and not args.resume:
        raise UserError(f"{path} already holds a run: pass --resume {path} to continue it, or another --run-name")
    return path


class Logger:
    SHOWN = ["reward", "accuracy", "response_length", "policy_loss", "value_loss", "clip_fraction", "approx_kl",
             "grad_norm", "tokens_per_s", "rollout_s", "update_s", "eval/accuracy"]

    def __init__(self, run_dir, config, tensorboard=False, wandb_project=None):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        with open(os.path.join(run_dir, "config.json"), "w") as handle:
            json.dump(dataclasses.asdict(config), handle, indent=1)
        self.tensorboard = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(run_dir)
        if wandb_project:
            import wandb
            self.wandb = wandb.init(project=wandb_project, name=os.path.basename(run_dir), config=dataclasses.asdict(config))

    def log(self, step, metrics, write=print):
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
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
def save_checkpoint(run_dir, step, models, optimizers, tokenizer, keep=2):
    """runs/<run>/checkpoints/step_<n>/{<name>/ (HF format), trainer_state.pt}; keeps the last `keep`."""
    root = os.path.join(run_dir, "checkpoints")
    final, staging = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f".staging_{step:06d}")
    shutil.rmtree(staging, ignore_errors=True)
    for name, model in models.items():
        model.save_pretrained(os.path.join(staging, name), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(staging, name))
    torch.save({"step": step, "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}},
               os.path.join(staging, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    for old in sorted(d for d in os.listdir(root) if d.startswith("step_"))[:-keep]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def load_checkpoint(path, models, optimizers):
    """Restore weights, optimizer states and RNG from `path` (a step_<n> directory or a run directory).
    Returns the number of finished steps."""
    if os.path.isdir(os.path.join(path, "checkpoints")):
        steps = sorted(d for d in os.listdir(os.path.join(path, "checkpoints")) if d.startswith("step_"))
        if not steps:
            raise UserError(f"--resume {path!r}: the run has no checkpoint yet")
        path = os.path.join(path, "checkpoints", steps[-1])
    if not os.path.exists(os.path.join(path, "trainer_state.pt")):
        raise UserError(f"--resume {path!r}: not a checkpoint (no trainer_state.pt)")
    from safetensors.torch import load_file
    for name, model in models.items():
        weights = load_file(os.path.join(path, name, "model.safetensors"))
        model.load_state_dict(weights, strict=False)
    saved = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(saved["optimizers"][name])
    random.setstate(saved["rng"]["python"])
    np.random.set_state(saved["rng"]["numpy"])
    torch.set_rng_state(saved["rng"]["torch"])
    return saved["step"]


if __name__ == "__main__":
    if sys.argv[1:] == ["build-tiny"]:
        shutil.rmtree(os.path.join(CACHE_DIR, TINY_MODEL_VERSION), ignore_errors=True)
        print(build_tiny_model())
    else:
        print("usage: python common.py build-tiny   (rebuilds the built-in tiny model in", CACHE_DIR + ")")
