"""Rollout engines: generate(prompts, n, max_tokens, temperature, top_p) -> list of common.Completion, each with
the sampled tokens and their log-probs under the processed (temperature / top-p) distribution. HFGenerator samples
with the trainer's own model (generate's sampling, in a leaner loop); the vLLM engine lives in infra/vllm_engine.py.
"""
import functools

import torch

from common import Completion, prompt_ids
from infra import UserError, dist, progress
from infra.prompt_sharing import cache_argument, read_common_prefix
from infra.stop import safe_point


class HFGenerator:
    """Hugging Face backend (CPU or GPU): sampling with a KV cache (`sample`). One process: it reads the live policy
    weights, nothing to sync.
    Under torchrun (or --offload-optimizer) the policy is sharded, so each rank generates with its own whole copy,
    refreshed by sync_weights."""
    engine = "hf"

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop_ids = stop_token_ids(model, tokenizer)
        if dist.sharded():
            from transformers import AutoModelForCausalLM
            with torch.random.fork_rng(devices=[]):  # its random init (overwritten) must not move the run's RNG:
                copy = AutoModelForCausalLM.from_config(model.config, dtype=model.compute_dtype)  # exact resume
            self.model = copy.to(dist.compute_device(model))
            self.model.compute_dtype = model.compute_dtype

    def sync_weights(self, model):
        if not dist.sharded():
            self.model = model
            return
        own = self.model.state_dict()
        with torch.no_grad():  # gathered in the copy's dtype (bf16: half the bytes), the values copy_ would cast to
            for name, tensor in dist.full_weights(model, self.model.compute_dtype):
                own[name].copy_(tensor)

    def sleep(self):
        """Nothing to free: generation runs on the trainer's own model."""

    def wake_up(self):
        """Nothing to restore."""

    def close(self):
        """Nothing to shut down."""

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        # inference_mode: no autograd bookkeeping, about 5% less time per call than no_grad on CPU in float32. Under
        # autocast it also turns off autocast's weight-cast cache: every decode step would cast every weight again
        # (Qwen3-0.6B's [V x h] embedding: 0.6 GB per token); in bf16 at its shapes, 8 layers, this CPU, no_grad sampled
        # 2.1x faster (benchmarks/engines.py, docs/scaling.md#speed)
        autocast = getattr(self.model, "compute_dtype", torch.float32) != torch.float32
        with torch.no_grad() if autocast else torch.inference_mode():
            return self._generate(prompts, n, max_tokens, temperature, top_p)

    def _generate(self, prompts, n, max_tokens, temperature, top_p):
        stops, pad = self.stop_ids, self.tokenizer.pad_token_id
        requests = [(i, p) for i, p in enumerate(prompts) for _ in range(n)]
        completions, was_training = [], self.model.training
        self.model.eval()
        progress.requested(len(requests))  # samples and tokens done, shown once a phase runs long (infra.progress)
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            width = max(len(p) for _, p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for _, p in chunk])
            attention_mask = (torch.arange(width) >= torch.tensor([width - len(p) for _, p in chunk])[:, None]).long()
            device = self.model.device
            dtype = getattr(self.model, "compute_dtype", torch.float32)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                sampled, logprobs = self.sample(input_ids.to(device), attention_mask.to(device), max_tokens,
                                                temperature, top_p)
            logprobs, sampled = logprobs.cpu(), sampled.cpu()
            for row, (index, _) in enumerate(chunk):
                tokens = sampled[row].tolist()
                stop = next((t + 1 for t, token in enumerate(tokens) if token in stops), None)  # the first stop id
                text = self.tokenizer.decode(tokens[:stop], skip_special_tokens=True)
                completions.append(Completion(index, tokens[:stop], text, logprobs[row, :stop].tolist(),
                                              "length" if stop is None else "stop"))
        self.model.train(was_training)
        return completions

    def sample(self, input_ids, attention_mask, max_tokens, temperature=1.0, top_p=1.0):
        """Sample up to max_tokens tokens after each left-padded prompt, one step at a time with a KV cache, the way
        Hugging Face generate samples (its temperature and top-p warpers, softmax, multinomial; greedy at temperature
        0), none of the model's own generation_config (repetition penalty, top-k...) applied. Unlike generate, a row
        leaves the batch once it samples a stop id (its steps would be wasted work), and each sampled token's log-prob
        under the processed (temperature / top-p) distribution is kept, in float32 (the trainer's
        common.response_logprobs computes the same from the full forward pass). Returns [B, T] tokens (pad after a
        stop) and [B, T] log-probs (0 after a stop), T <= max_tokens the steps taken."""
        from transformers import DynamicCache, TemperatureLogitsWarper, TopPLogitsWarper
        warpers = [TemperatureLogitsWarper(temperature)] if temperature > 0 and temperature != 1 else []
        warpers += [TopPLogitsWarper(top_p)] if temperature > 0 and top_p < 1 else []
        rows, device = input_ids.shape[0], input_ids.device
        tokens = torch.full((rows, max_tokens), self.tokenizer.pad_token_id, device=device)
        logprobs = torch.zeros(rows, max_tokens, device=device)
        stops = torch.tensor(self.stop_ids, device=device)
        cache, active = DynamicCache(config=self.model.config), torch.arange(rows, device=device)  # rows still going
        cache_name = cache_argument(self.model)
        # The prompt is read once for its n samples (rows repeat it): the cache rows are then copied to each sample.
        prompts, copies = torch.cat([input_ids, attention_mask], 1).unique(dim=0, return_inverse=True)
        step_ids, step_mask = prompts[:, :input_ids.shape[1]], prompts[:, input_ids.shape[1]:]
        step_ids, step_mask = read_common_prefix(self.model, step_ids, step_mask, cache)  # their common head, once
        step_positions = (step_mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        attention_mask, positions = step_mask[copies], step_positions[copies]
        for step in range(max_tokens):
            safe_point()  # after a Ctrl-C the run stops here, between decode steps (infra.stop)
            logits = self.model(input_ids=step_ids, attention_mask=step_mask, position_ids=step_positions,
                                **{cache_name: cache}, use_cache=True,
                                logits_to_keep=1).logits[:, -1].float()
            if step == 0:
                logits = logits[copies]
                cache.batch_select_indices(copies)
                grow_in_place(cache)
            for warper in warpers:
                logits = warper(None, logits)
            token = torch.multinomial(logits.softmax(-1), 1)[:, 0] if temperature > 0 else logits.argmax(-1)
            tokens[active, step] = token
            logprobs[active, step] = logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
            going = ~torch.isin(token, stops)
            if step == max_tokens - 1 or not going.any():
                progress.generated(len(active), finished=len(active))  # this step's tokens; the rows left are done
                break
            if not going.all():  # the stopped rows leave the batch and the cache
                keep = going.nonzero()[:, 0]
                progress.generated(len(active), finished=len(active) - len(keep))
                active, token, attention_mask, positions = active[keep], token[keep], attention_mask[keep], \
                    positions[keep]
                cache.batch_select_indices(keep)
            else:
                progress.generated(len(active))
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], 1)
            positions, step_ids = positions[:, -1:] + 1, token[:, None]
            step_mask, step_positions = attention_mask, positions
        return tokens[:, :step + 1], logprobs[:, :step + 1]


def grow_in_place(cache):
    """Turn the cache's full-attention layers into GrowingLayers (growing_layer_class), keeping what they hold."""
    from transformers.cache_utils import DynamicLayer
    cache.layers = [growing_layer_class()(layer) if type(layer) is DynamicLayer and layer.is_initialized else layer
                    for layer in cache.layers]


@functools.cache
def growing_layer_class():
    """GrowingLayer, made on first use: transformers is imported only once a model runs."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views of buffers grown by doubling, so a sampled token is written
        in place: DynamicLayer's torch.cat copies the whole cache at every step (74% of the sampling time at 700
        tokens, 128 rows, on the horizon model: 1,000 tokens sampled in 57 s, 15 s in place; docs/horizon.md)."""

        def __init__(self, layer):
            super().__init__()
            self.is_initialized, self.device, self.length = True, layer.keys.device, layer.keys.shape[-2]
            self.key_buffer, self.value_buffer = layer.keys, layer.values
            self.keys, self.values = layer.keys, layer.values

        def update(self, key_states, value_states, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if end > self.key_buffer.shape[-2]:
                capacity = max(end, 2 * self.key_buffer.shape[-2])
                self.key_buffer, self.value_buffer = (torch.cat([buffer[..., :self.length, :], buffer.new_empty(
                    *buffer.shape[:-2], capacity - self.length, buffer.shape[-1])], -2)
                    for buffer in (self.key_buffer, self.value_buffer))
            self.key_buffer[..., self.length:end, :] = key_states
            self.value_buffer[..., self.length:end, :] = value_states
            self.length = end
            self.keys, self.values = self.key_buffer[..., :end, :], self.value_buffer[..., :end, :]
            return self.keys, self.values

        def batch_select_indices(self, indices):
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self.keys, self.values = self.key_buffer[..., :self.length, :], self.value_buffer[..., :self.length, :]

    return GrowingLayer


def stop_token_ids(model, tokenizer):
    """Every id a rollout stops on: the tokenizer's EOS, each id of the model's generation_config.eos_token_id
    (chat checkpoints such as Qwen3's list two: <|im_end|> and <|endoftext|>) and the chat template's turn end
    (turn_end_id): a Base checkpoint's config lists <|endoftext|> alone, and its prompts end in the template's
    `<|im_start|>assistant\n`, so without it a rollout runs on into an invented next turn."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return [i for i in dict.fromkeys([tokenizer.eos_token_id, *ids, turn_end_id(tokenizer)]) if i is not None]


def turn_end_id(tokenizer):
    """The special token that closes an assistant turn in the tokenizer's chat template (ChatML's <|im_end|>,
    Llama 3's <|eot_id|>), read off the template itself: the first special token after an assistant message's
    content in a rendered conversation. None without a template, or when no special token follows the content."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "Zq7"  # content any template copies as it is
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}, {"role": "assistant",
                                                                                 "content": marker}], tokenize=False)
    except Exception:  # a template that refuses the conversation (its raise_exception, a missing variable ...)
        return None
    if marker not in text:
        return None
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    tail = tokenizer(text[text.rindex(marker) + len(marker):], add_special_tokens=False)["input_ids"]
    return next((i for i in tail if i in special), None)


def reuse_engine_logprobs(choice, generator, policy, top_p):
    """--old-logprobs: True when the old log-probs of the PPO ratio are the rollout engine's (Completion.logprobs),
    False when the trainer recomputes them. `auto` reuses them where they are the trainer's own numbers up to float
    noise (tests/test_logprobs.py): Hugging Face generate on the policy object itself (not a sharded run's copy), in
    float32, at top-p 1 (below 1 the engine records the truncated distribution). With vLLM they are recomputed:
    truncated importance sampling needs both. slime's --use-rollout-logprobs is the same option."""
    if choice != "auto":
        return choice == "engine"
    return generator.engine == "hf" and getattr(generator, "model", None) is policy and top_p == 1 \
        and getattr(policy, "compute_dtype", torch.float32) == torch.float32


def resolve_generator(kind, device):
    """`hf` or `vllm` for --generator beside a policy on `device`: `vllm` where it can run (refused in one line where
    not); `auto`: vLLM on a CUDA device where it runs, else Hugging Face generate (on CPU too: vLLM's CPU build runs
    when asked for)."""
    if kind == "hf" or kind == "auto" and torch.device(device).type != "cuda":
        return "hf"
    from infra.vllm_engine import vllm_problem  # it imports vllm itself, only now
    problem = vllm_problem(device)
    if problem and kind == "vllm":
        raise UserError(f"--generator vllm {problem}; or use --generator hf")
    return "hf" if problem else "vllm"


def check_generator(kind, device):
    """Refuse --generator vllm where it cannot run, in one line, before any model loads or any run folder exists."""
    if kind == "vllm":
        resolve_generator(kind, device)


def longest_prompt(tokenizer, row_sets):
    """The most tokens of any prompt (common.prompt_ids) of the rows in `row_sets`, each distinct question tokenized
    once (0 without rows)."""
    questions = {repr(row["question"]): row["question"] for rows in row_sets for row in rows}  # messages: lists
    return max((len(prompt_ids(tokenizer, question)) for question in questions.values()), default=0)


def make_generator(kind, model, tokenizer, gpu_memory_utilization=0.3, seed=0, kv_cache_gib=1.0, rows=(),
                   max_tokens=0, hf_batch_size=256):
    """The rollout engine for --generator (see resolve_generator), holding `model`'s current weights. Its close()
    shuts it down (Run.close, on the way out). A vLLM engine is sized to the run: `rows`, the row lists it prompts
    with (training and held-out), and `max_tokens`, the longest response it asks for, give its max_model_len (the
    longest prompt + max_tokens; without rows the model's own positions); gpu_memory_utilization is its share of
    the GPU (on CPU kv_cache_gib sizes its KV cache). The HF engine generates hf_batch_size sequences a call."""
    if resolve_generator(kind, dist.compute_device(model)) == "vllm":
        from infra.vllm_engine import VLLMGenerator
        length = None
        if rows:
            prompt = longest_prompt(tokenizer, rows)
            length = prompt + max_tokens
            if dist.rank() == 0:
                print(f"vLLM: max_model_len {length} = the longest prompt ({prompt} tokens) + the longest response "
                      f"({max_tokens})")
        generator = VLLMGenerator(model, tokenizer, stop_token_ids(model, tokenizer), length, gpu_memory_utilization,
                                  seed, kv_cache_gib)
    else:
        generator = HFGenerator(model, tokenizer, hf_batch_size)
    try:
        generator.sync_weights(model)  # vLLM loaded the checkpoint from disk: a resumed policy differs from it
    except BaseException:
        generator.close()  # no one else holds it yet
        raise
    return generator
