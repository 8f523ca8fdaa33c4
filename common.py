"""What a reader of a method file needs to open: how a model loads and runs on a batch, the batch layout and the
per-token log-probs, the prompt, answer checking, and the rollout engine's contract (Completion). Plumbing that a
reader may skip (command line, torchrun, data files, evaluation, checkpoints, the engines; the KV-cache sharing, the
sliced LM head and the micro-batch packing behind the functions here) lives in infra/.
"""
import dataclasses
import decimal
import re
import time
from dataclasses import dataclass

import numpy as np
import torch

from infra import UserError, answer_line, dist, lm_head, packing, prompt_sharing, verifier
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
    group's samples) read it once, its keys and values indexed out to each row, and the prompts' common head (a chat
    template's system turn, a few-shot example) is read once for all of them (infra.prompt_sharing: a KV cache). The
    same numbers as one full forward up to float noise (tests/test_logprobs.py)."""
    head = model.get_output_embeddings() if hidden else None
    if hidden:  # outputs.logits = head(final hidden states): with an identity head, the hidden states themselves
        model.set_output_embeddings(torch.nn.Identity())
    try:
        outputs = prompt_sharing.shared_prompt_forward(model, batch)  # None: nothing to share, or sharing is off
        if outputs is None:  # one full forward
            outputs = forward(model, batch, **prompt_sharing.logits_to_keep(model, batch.response_width + 1))
            if outputs.logits.shape[1] > batch.response_width + 1:  # a value head's; a no-op slice's backward fills 0
                outputs.logits = outputs.logits[:, -batch.response_width - 1:]
        return outputs
    finally:
        if hidden:
            model.set_output_embeddings(head)


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
        """(prompt length, response length) of each row, for micro_batches."""
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
    slice of the vocabulary at a time, about `chunk_elements` (64 MB in float32; at least 256 columns), in the forward
    and the backward pass (infra.lm_head)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    columns = max(256, chunk_elements // max(1, flat.shape[0]))
    out = lm_head.SlicedHeadLogprobs.apply(flat, weight, tokens.reshape(-1), float(temperature), dtype, columns)
    return out.view(tokens.shape)


def critic_outputs(critic, batch):
    """[B, T] the scalar head's raw outputs at the states before each response token: a value V(s_t) for the ppo.py
    family's critics, a logit f(x) for SPPO's (whose V(x) = sigmoid(f(x)))."""
    return response_forward(critic, batch).logits[:, :-1, 0].float()


@torch.no_grad()
def batched(function, batch, micro_batch_size, max_tokens=0):
    """Apply `function(micro_batch) -> [b, t]` over micro-batches without gradients; returns [B, T].
    max_tokens > 0 packs the micro-batches by padded token count instead (micro_batches)."""
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    rows = list(range(batch.input_ids.shape[0]))
    for micro_rows in micro_batches(rows, batch.lengths() if max_tokens else None, micro_batch_size, max_tokens):
        micro = batch.select(micro_rows)
        out[micro_rows, :micro.response_width] = function(micro).float()
    return out


def chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def micro_batches(rows, lengths, micro_batch_size, max_tokens=0):
    """Micro-batches of `rows`: micro_batch_size rows each in rollout order, so a group's samples meet in a
    micro-batch, where response_forward reads their prompt once; or, when max_tokens > 0, packed by padded token
    count (`lengths`: SequenceBatch.lengths()), at most max_tokens each, the fewest padded tokens in all
    (infra.packing.token_budget_chunks). Under torchrun every rank gets as many as the rank with the most."""
    groups = packing.token_budget_chunks(rows, lengths, max_tokens) if max_tokens else \
        chunks(sorted(rows), micro_batch_size)
    return packing.same_count_on_every_rank(groups)
