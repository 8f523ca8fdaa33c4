"""Rows that share a prompt read it once, through a KV cache: a group's samples in the update's forward pass
(common.response_forward) and in sampling (infra.engine), and the prompts' common head (a chat template's system
turn, a few-shot example) once for all of them. Each token keeps its position and its context, so the numbers are
one full forward's up to float noise (tests/test_logprobs.py).
"""
import inspect

import torch

from infra import dist


def logits_to_keep(model, columns):
    """{"logits_to_keep": columns} when model.forward takes it (a causal LM), else {} (a value head keeps every
    column)."""
    return {"logits_to_keep": columns} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def cache_argument(model):
    """The name model.forward takes a KV cache by (`cache` since transformers 5.2x, `past_key_values` before), or
    None."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def shared_prompt_forward(model, batch):
    """The model's outputs at columns P-1 .. P+T-1 of a SequenceBatch (common.response_forward's contract), each
    distinct prompt read once and its keys and values indexed out to its rows (so its activations and gradients are
    computed once per group), the prompts' common head once for all of them (read_common_prefix). None where nothing
    is shared (distinct prompts without a common head) or sharing is off: under FSDP (its backward hooks sit on a
    call's outputs; the prompt pass has none in the loss), under gradient checkpointing (Hugging Face then keeps no
    cache), for a model.forward without a cache argument, or for prompts of one column."""
    from transformers import DynamicCache
    prompt_width, cache_name = batch.input_ids.shape[1] - batch.response_width, cache_argument(model)
    if dist.sharded() or cache_name is None or prompt_width < 2 or any(
            getattr(module, "gradient_checkpointing", False) for module in model.modules()):
        return None
    prefix = slice(0, prompt_width - 1)  # the last prompt column goes with the response: each row gets its output
    prompts, rows = torch.cat([batch.input_ids[:, prefix], batch.attention_mask[:, prefix]], 1).unique(
        dim=0, return_inverse=True)
    ids, mask = prompts[:, :prompt_width - 1], prompts[:, prompt_width - 1:]
    if len(prompts) == len(batch.input_ids) and not common_prefix_length(ids, mask):
        return None
    inputs, cache = batch.model_inputs(), DynamicCache(config=model.config)
    dtype = getattr(model, "compute_dtype", torch.float32)
    # One autocast region, so each weight is cast once (autocast's cache): the distinct prompts' common head (a
    # system turn, an example) read once, then each prompt's rest once, indexed out to its rows.
    with torch.autocast(batch.input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        ids, mask = read_common_prefix(model, ids, mask, cache)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{cache_name: cache},
              **logits_to_keep(model, 1))
        cache.batch_select_indices(rows)  # indexed: the copies' gradients add up in the prompt's pass
        return model(input_ids=inputs["input_ids"][:, prompt_width - 1:], use_cache=True, **{cache_name: cache},
                     attention_mask=torch.cat([mask[rows], inputs["attention_mask"][:, prompt_width - 1:]], 1),
                     position_ids=inputs["position_ids"][:, prompt_width - 1:])


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
    first = input_ids[:1, width - int(lengths[0]):][:, :prefix]
    model(input_ids=first, attention_mask=torch.ones_like(first), use_cache=True, **{cache_argument(model): cache},
          position_ids=torch.arange(prefix, device=device)[None], **logits_to_keep(model, 1))
    cache.batch_select_indices(torch.zeros(len(input_ids), dtype=torch.long, device=device))
    rest = int(lengths.max()) - prefix  # the longest remainder
    rest_mask = (torch.arange(rest, device=device) >= (rest - (lengths - prefix))[:, None]).long()
    return input_ids[:, width - rest:], torch.cat([attention_mask.new_ones(len(input_ids), prefix), rest_mask], 1)
