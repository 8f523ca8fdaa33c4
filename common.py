"""What a reader of a method file needs to open: how a model loads and runs on a batch, the batch layout and the
per-token log-probs, the prompt, answer checking, and the rollout engine's contract (Completion). Plumbing that a
reader may skip (command line, torchrun, data files, evaluation, checkpoints, the engines) lives in infra/.
"""
import dataclasses
import decimal
import inspect
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from infra import UserError, answer_line, dist, verifier
from infra.hub import check_model_source, resolve_model_name

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


# ----------------------------------------------------------------------------------------------
# Models. Every model, the built-in tiny one included, loads through from_pretrained.
# ----------------------------------------------------------------------------------------------
def load_tokenizer(name_or_path, trust_remote_code=False):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(name_or_path), trust_remote_code=trust_remote_code)
    # No pad token (Llama 3, Mistral): pad with the EOS, an id the model has. Safe: masks come from lengths
    # (sequence_batch, HFGenerator), never from pad ids, so a generated EOS stays a trained token. A new <|pad|>
    # would need a new embedding row, which vLLM's engine, built from the checkpoint, lacks (weight sync fails).
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def load_model(name_or_path, dtype="auto", device=None, trust_remote_code=False, value_head=0,
               gradient_checkpointing=False):
    """Return (model, tokenizer). value_head=k > 0: the backbone plus k scalar outputs per position
    (AutoModelForTokenClassification, as verl builds its critic). Weights load in float32 and the forward runs in
    `dtype` (auto: bfloat16 on GPU, float32 on CPU): mixed precision, so a 1e-6 step is not rounded away in bf16.
    Under torchrun or --offload-optimizer the model comes back sharded over the ranks (shard_model)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as transformers_logging
    transformers_logging.set_verbosity_error()  # e.g. the value head's expected "newly initialized" load report
    transformers_logging.disable_progress_bar()  # "Loading weights" and "Writing model shards" bars
    path, device = resolve_model_name(name_or_path), device or dist.default_device()
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    check_model_source(name_or_path)  # a missing model fails in one line, in seconds (offline too)
    kwargs = dict(dtype=torch.float32, trust_remote_code=trust_remote_code)
    try:
        tokenizer = load_tokenizer(path, trust_remote_code)
        if value_head:
            model = AutoModelForTokenClassification.from_pretrained(path, num_labels=int(value_head), **kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:  # missing files, unknown architecture, a bad config
        reason = " ".join(str(error).split())  # transformers' messages run over several lines
        raise UserError(f"cannot load model {name_or_path!r} from {path!r}: "
                        f"{reason if len(reason) <= 300 else reason[:300] + '...'}") from None
    model.config.pad_token_id = tokenizer.pad_token_id
    model.compute_dtype, model.architecture = getattr(torch, dtype), type(model).__name__
    for module in model.modules():  # no dropout in RL (as verl): the value head's classifier_dropout defaults to 0.1
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    model = model if dist.offloaded() else model.to(device)  # offloaded: FSDP moves a unit at a time, then to host
    return (dist.shard_model(model, model.compute_dtype) if dist.sharded() else model), tokenizer


def enable_gradient_checkpointing(model):
    """Recompute each layer's activations in backward (Hugging Face checkpoints in train mode only: it is set)."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # its new name (5.25 has it); the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:  # transformers before the rename (5.19)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.train()


def forward(model, batch, **kwargs):
    """model(batch) in the model's compute dtype (autocast: the float32 weights are cast layer by layer)."""
    dtype = getattr(model, "compute_dtype", torch.float32)
    with torch.autocast(batch.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        return model(**batch.model_inputs(), use_cache=False, **kwargs)


def response_forward(model, batch, hidden=False):
    """The model's outputs (.logits) at the states before each response token and after the last: columns P-1 ..
    P+T-1, [B, T+1, ...]. hidden=True: the final hidden states there instead, [B, T+1, d] (the LM head is left out
    of the call: response_logprobs applies it a slice of the vocabulary at a time). Rows that share a prompt (a
    group's samples) share one pass over it: the prompt's keys and values are computed once and indexed out to each
    row, so its activations and gradients are computed once per group; and the prompts' common head (a chat
    template's system turn, a few-shot example) is read once for all of them (read_common_prefix). The same numbers
    as one full forward up to float noise (tests/test_logprobs.py). One full forward under gradient checkpointing
    (Hugging Face then keeps no cache) and FSDP (its backward hooks sit on a call's outputs; the prompt pass has none
    in the loss)."""
    from transformers import DynamicCache
    head = model.get_output_embeddings() if hidden else None
    if hidden:  # outputs.logits = head(final hidden states): with an identity head, the hidden states themselves
        model.set_output_embeddings(torch.nn.Identity())
    try:
        prompt_width = batch.input_ids.shape[1] - batch.response_width
        prefix = slice(0, prompt_width - 1)  # the last prompt column goes with the response: each row gets its output
        prompts, rows = torch.cat([batch.input_ids[:, prefix], batch.attention_mask[:, prefix]], 1).unique(
            dim=0, return_inverse=True) if prompt_width > 1 else (batch.input_ids, None)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        cache_name = cache_argument(model)  # (a value head has no logits_to_keep: it keeps every column)
        shared = not (dist.sharded() or cache_name is None or prompt_width < 2 or any(
            getattr(module, "gradient_checkpointing", False) for module in model.modules()))
        if not shared or len(prompts) == len(batch.input_ids) and not common_prefix_length(
                prompts[:, :prompt_width - 1], prompts[:, prompt_width - 1:]):
            outputs = forward(model, batch, **({"logits_to_keep": batch.response_width + 1} if keep else {}))
            if outputs.logits.shape[1] > batch.response_width + 1:  # a value head's; a no-op slice's backward fills 0
                outputs.logits = outputs.logits[:, -batch.response_width - 1:]
            return outputs
        inputs, cache = batch.model_inputs(), DynamicCache(config=model.config)
        dtype = getattr(model, "compute_dtype", torch.float32)
        # One autocast region, so each weight is cast once (autocast's cache): the distinct prompts' common head (a
        # system turn, an example) read once, then each prompt's rest once, indexed out to its rows.
        with torch.autocast(batch.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
            ids, mask = read_common_prefix(model, prompts[:, :prompt_width - 1], prompts[:, prompt_width - 1:], cache)
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -ids.shape[1]:]
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_name: cache},
                  **keep)
            cache.batch_select_indices(rows)  # indexed: the copies' gradients add up in the prompt's pass
            return model(input_ids=inputs["input_ids"][:, prompt_width - 1:], use_cache=True, **{cache_name: cache},
                         attention_mask=torch.cat([mask[rows], inputs["attention_mask"][:, prompt_width - 1:]], 1),
                         position_ids=inputs["position_ids"][:, prompt_width - 1:])
    finally:
        if hidden:
            model.set_output_embeddings(head)


def common_prefix_length(input_ids, attention_mask, min_tokens=16):
    """How many tokens every left-padded row of [B, W] `input_ids` starts with, each row keeping at least its last
    token; 0 for one row or a prefix under min_tokens."""
    lengths = attention_mask.sum(1)
    shortest, width = int(lengths.min()) - 1, input_ids.shape[1]
    if len(input_ids) < 2 or shortest < min_tokens:
        return 0
    heads = input_ids.gather(1, (width - lengths)[:, None] + torch.arange(shortest, device=input_ids.device))
    prefix = int((heads == heads[:1]).all(0).cumprod(0).sum())  # the first columns where every row agrees
    return prefix if prefix >= min_tokens else 0


def read_common_prefix(model, input_ids, attention_mask, cache):
    """Read the tokens that every left-padded row of [B, W] `input_ids` starts with (a chat template's system turn, a
    few-shot example; common_prefix_length) once, into `cache`, copied to each row. Returns the rest of each row,
    left-padded, and the mask of the whole row, [the prefix][padding][the rest] (positions count real tokens, so each
    token keeps its position and context: one pass's numbers up to float noise). Rows and mask come back as given
    (nothing read) without a common prefix or with a cache that is not plain full attention (sliding windows)."""
    full_attention = all(type(layer).__name__ == "DynamicLayer" for layer in getattr(cache, "layers", [None]))
    prefix = common_prefix_length(input_ids, attention_mask) if full_attention else 0
    if not prefix:
        return input_ids, attention_mask
    lengths, width, device = attention_mask.sum(1), input_ids.shape[1], input_ids.device
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    first = input_ids[:1, width - int(lengths[0]):][:, :prefix]
    model(input_ids=first, attention_mask=torch.ones_like(first), use_cache=True, **{cache_argument(model): cache},
          position_ids=torch.arange(prefix, device=device)[None], **keep)
    cache.batch_select_indices(torch.zeros(len(input_ids), dtype=torch.long, device=device))
    rest = int(lengths.max()) - prefix  # the longest remainder
    rest_mask = (torch.arange(rest, device=device) >= (rest - (lengths - prefix))[:, None]).long()
    return input_ids[:, width - rest:], torch.cat([attention_mask.new_ones(len(input_ids), prefix), rest_mask], 1)


def cache_argument(model):
    """The name model.forward takes a KV cache by (`cache` since transformers 5.2x, `past_key_values` before), or
    None."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


# ----------------------------------------------------------------------------------------------
# The prompt: a question string asks for the answer in \\boxed{}; a dataset's chat messages are used as given.
# ----------------------------------------------------------------------------------------------
def plain_prompt(question):
    return f"{question}\n{INSTRUCTION}\n"


def prompt_ids(tokenizer, question):
    """Token ids of the prompt. `question` is a string, or a row's list of chat messages ({"role", "content"}).
    A string gets our instruction (answer in \\boxed{}): in the tokenizer's chat template as one user message when
    it has one, else plain_prompt. Chat messages are used as given, no instruction added: through the chat
    template, or, for a tokenizer without one, their contents joined by newlines with a final newline (the
    layout of plain_prompt; roles are dropped)."""
    messages = question if isinstance(question, list) else [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    else:
        text = plain_prompt(question) if isinstance(question, str) else "".join(m["content"] + "\n" for m in messages)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------------------
# Answer checking. Model output is never evaluated as code: math-verify parses its LaTeX, in a separate process
# killed at a deadline (infra/verifier.py; not signal.alarm, which breaks outside the main thread).
# ----------------------------------------------------------------------------------------------
MAX_ANSWER_CHARS = 1000
VERIFY_TIMEOUT_S = 1.5  # wall-clock budget per response (past it: a kill and a swap to a spare checker); scores 0


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


def verify(response, gold, timeout=VERIFY_TIMEOUT_S):
    """1.0 if the last \\boxed{} of `response` equals `gold` (math-verify, gold first), else 0.0, within `timeout`
    seconds of wall time (past it: 0.0, counted by infra.verifier). Exact and plain-number matches are decided here;
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
    return verifier.CHECKER.check(gold, answer, deadline)


def verify_answer_line(response, gold):
    """1.0 if the last `Answer:` line of `response` equals `gold` the way DAPO's released reward decides it (verl
    utils/reward_score/math_dapo.py, ported in infra/answer_line.py: the response's last 300 characters, Minerva's
    normalization of both sides (units, \\text{}, `$`, thousands commas ...), then string equality), else 0.0.
    DAPO scores a wrong answer -1.0; here 0.0, the R in {0, 1} of every method."""
    return float(answer_line.answer_line_correct(response, gold))


def score(response, row):
    """The reward of `response` to a dataset row: verify (last \\boxed{}, math-verify) or verify_answer_line (last
    `Answer:` line, DAPO's rule), as the row's "answer_format" says (infra.data sets it; boxed when absent)."""
    if row.get("answer_format", "boxed") == "answer-line":
        return verify_answer_line(response, row["answer"])
    return verify(response, row["answer"])


# ----------------------------------------------------------------------------------------------
# The rollout engine's contract: generate(prompts, n, max_tokens, temperature, top_p) -> list of Completion
# (infra/engine.py: Hugging Face generate; infra/vllm_engine.py: vLLM).
# ----------------------------------------------------------------------------------------------
@dataclass
class Completion:
    prompt_index: int  # which prompt of the call this sample answers
    token_ids: list  # sampled response tokens, the stop token (infra.engine.stop_token_ids) included if it stopped
    text: str  # decoded response, special tokens removed
    logprobs: list  # log-prob of each sampled token under the sampling (temperature/top-p) distribution
    finish_reason: str  # "stop" (a stop token) or "length" (hit max_tokens)


def engine_logprobs(completions, width):
    """[B, width] the rollout engine's log-prob of each sampled token, 0 past each response's end."""
    out = torch.zeros(len(completions), width)
    for row, completion in enumerate(completions):
        out[row, :len(completion.logprobs[:width])] = torch.tensor(completion.logprobs[:width], dtype=torch.float32)
    return out


def monte_carlo_values(generator, tokenizer, states, rows, continuations, max_tokens, temperature=1.0, top_p=1.0):
    """V(s) for each state s = (prompt ids, response prefix ids) by Monte Carlo: the mean score() reward of
    `continuations` sampled completions of s against its dataset row, a response scoring 0 if it has not stopped
    within `max_tokens` tokens in all (prefix included), as in training. Identical states are sampled once; one
    generate call. Returns (values: np.ndarray [len(states)], generated tokens)."""
    index = {}
    for (prompt, prefix), row in zip(states, rows):
        index.setdefault((tuple(prompt), tuple(prefix)), (len(index), row))
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
            totals[completion.prompt_index] += score(text, index[prompt, prefix][1])
    values = totals / continuations
    return values[[index[tuple(prompt), tuple(prefix)][0] for prompt, prefix in states]], \
        sum(len(c.token_ids) for c in completions)


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
                             self.position_ids[rows, left:right], self.response_ids[rows, :width],
                             response_mask[:, :width])


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


def response_logprobs(model, batch, temperature=1.0):
    """[B, T] log-probs of the response tokens under `model` at the sampling temperature: the final hidden states at
    the response columns, then the LM head and log-softmax a slice of the vocabulary at a time (head_logprobs), so
    no [B, T, V] logits tensor exists in the forward or the backward pass. A head that is not a plain bias-free
    Linear, or whose logits the model rescales or caps afterwards (Gemma 2, Cohere, Granite), takes whole logits."""
    head = model.get_output_embeddings()
    rescaled = any(getattr(model.config, name, None) for name in ("final_logit_softcapping", "logit_scale",
                                                                   "logits_scaling"))
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or rescaled:
        logits = response_forward(model, batch).logits[:, :-1].float() / temperature
        return logits.log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    hidden = response_forward(model, batch, hidden=True).logits[:, :-1]
    # head.weight read after the forward: under FSDP2 the gathered weight (the root unit stays gathered until backward)
    return head_logprobs(hidden, head.weight, batch.response_ids, temperature,
                         getattr(model, "compute_dtype", torch.float32))


def head_logprobs(hidden, weight, tokens, temperature=1.0, dtype=torch.float32, chunk_elements=2 ** 24):
    """log softmax(hidden @ weight^T / temperature)[tokens] in float32 for [..., d] hidden states, the [V, d] LM head
    and [...] tokens; matmuls in `dtype` (the model's compute dtype, as autocast runs the head). The logits exist a
    slice of the vocabulary at a time, about `chunk_elements` (64 MB in float32; at least 256 columns)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    columns = max(256, chunk_elements // max(1, flat.shape[0]))
    out = _HeadLogprobs.apply(flat, weight, tokens.reshape(-1), float(temperature), dtype, columns)
    return out.view(tokens.shape)


def _head_slices(hidden, weight, dtype, columns, temperature):
    """(first column, the slice's [V_s, d] weight in `dtype`, its [N, V_s] logits / temperature in float32) for
    each slice of `columns` vocabulary rows."""
    for start in range(0, weight.shape[0], columns):
        part = weight[start:start + columns].to(dtype)
        logits = (hidden @ part.T).float()
        yield start, part, logits if temperature == 1 else logits.div_(temperature)


class _HeadLogprobs(torch.autograd.Function):
    """log p_y = z_y / tau - logsumexp(z / tau) with z = h W^T, one vocabulary slice at a time (the idea of Liger's
    fused linear cross-entropy): the logsumexp accumulates over slices. Saved for backward: h, W (not copies) and
    one logsumexp per position. Backward recomputes each slice's z: dz_j = (1[j = y] - p_j) g / tau, then
    dh += dz W_slice and dW_slice = dz^T h (each row of W written once). A tied W gets this gradient beside the
    embedding's (autograd adds them)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, temperature, dtype, columns):
        compute = hidden.to(dtype)
        logsumexp = torch.full(tokens.shape, -torch.inf, device=hidden.device)
        target, rows = torch.zeros_like(logsumexp), torch.arange(len(tokens), device=tokens.device)
        for start, _, logits in _head_slices(compute, weight, dtype, columns, temperature):
            logsumexp = torch.logaddexp(logsumexp, logits.logsumexp(-1))
            inside = (tokens >= start) & (tokens < start + logits.shape[1])
            target[inside] = logits[rows[inside], tokens[inside] - start]
        ctx.save_for_backward(hidden, weight, tokens, logsumexp)
        ctx.temperature, ctx.dtype, ctx.columns = temperature, dtype, columns
        return target - logsumexp

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, tokens, logsumexp = ctx.saved_tensors
        compute, scale = hidden.to(ctx.dtype), grad_out.float() / ctx.temperature
        grad_hidden = torch.zeros(hidden.shape, device=hidden.device)  # float32: the slices' sum
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        rows = torch.arange(len(tokens), device=tokens.device)
        for start, part, logits in _head_slices(compute, weight, ctx.dtype, ctx.columns, ctx.temperature):
            grad = logits.sub_(logsumexp[:, None]).exp_().mul_(-scale[:, None])  # -p g / tau, in place
            inside = (tokens >= start) & (tokens < start + logits.shape[1])
            grad[rows[inside], tokens[inside] - start] += scale[inside]
            grad = grad.to(ctx.dtype)
            grad_hidden += grad @ part
            if grad_weight is not None:
                grad_weight[start:start + len(part)] = grad.T @ compute
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None, None


def critic_outputs(critic, batch):
    """[B, T] the scalar head's raw outputs at the states before each response token: a value V(s_t) for the ppo.py
    family's critics, a logit f(x) for SPPO's (whose V(x) = sigmoid(f(x)))."""
    return response_forward(critic, batch).logits[:, :-1, 0].float()


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


MICRO_BATCH_COST = 512  # a micro-batch's fixed cost counted in padded tokens (launches, FSDP's gathers): assumed


def token_budget_chunks(indices, lengths, max_tokens, overhead=MICRO_BATCH_COST):
    """Split `indices` into micro-batches of at most `max_tokens` padded tokens (rows x width; a row wider than the
    budget goes alone) that compute the fewest padded tokens, each micro-batch counted `overhead` tokens more: rows
    are taken longest response first, and a dynamic program over that order places the cuts. `lengths[i]` is row
    i's length, or a (prompt, response) pair: in a SequenceBatch the width is the longest prompt plus the longest
    response of the micro-batch (SequenceBatch.lengths())."""
    def parts(index):
        value = lengths[index]
        value = value.tolist() if torch.is_tensor(value) else value
        return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),)

    order = sorted(indices, key=lambda i: tuple(reversed(parts(i))), reverse=True)  # stable for equal lengths
    cost, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)  # the best split of order[:end]
    for end in range(1, len(order) + 1):
        widest = parts(order[end - 1])
        for start in range(end - 1, -1, -1):  # order[start:end] as the last micro-batch
            widest = tuple(map(max, widest, parts(order[start])))
            if (end - start) * sum(widest) > max_tokens and start < end - 1:
                break
            if cost[start] + (end - start) * sum(widest) + overhead < cost[end]:
                cost[end], cut[end] = cost[start] + (end - start) * sum(widest) + overhead, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def micro_batches(rows, lengths, micro_batch_size, max_tokens=0):
    """Micro-batches of `rows`: packed by padded token count when max_tokens > 0 (token_budget_chunks), else
    micro_batch_size rows each in rollout order, so a group's samples meet in a micro-batch, where response_forward
    reads their prompt once. Under torchrun every rank gets as many as the rank with the most (FSDP forwards are
    collective): the largest micro-batches are halved until the counts agree."""
    groups = token_budget_chunks(rows, lengths, max_tokens) if max_tokens else chunks(sorted(rows), micro_batch_size)
    wanted = max(dist.gather_objects(len(groups)))
    while len(groups) < wanted:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            raise UserError(f"the ranks need {wanted} micro-batches but this one holds {len(rows)} sequences: "
                            "use the same number of sequences on every rank")
        half = len(groups[largest]) // 2
        groups[largest:largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups
