"""Rollout engines: generate(prompts, n, max_tokens, temperature, top_p) -> list of common.Completion, each with
the sampled tokens and their log-probs under the processed (temperature / top-p) distribution. HFGenerator runs
Hugging Face `generate` on the trainer's own model; the vLLM engine lives in infra/vllm_engine.py.
"""
import torch

from common import Completion
from infra import UserError, dist


class HFGenerator:
    """Hugging Face `generate` backend (CPU or GPU). One process: it reads the live policy weights, nothing to sync.
    Under torchrun (or --offload-optimizer) the policy is sharded, so each rank generates with its own whole copy,
    refreshed by sync_weights."""
    engine = "hf"

    def __init__(self, model, tokenizer, batch_size=256):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
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
        with torch.no_grad():
            for name, tensor in dist.full_weights(model):
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


def make_generator(kind, model, tokenizer, gpu_memory_utilization=0.3, seed=0):
    """The rollout engine for --generator, holding `model`'s current weights: `hf`; `vllm` (refused in one line
    when it cannot run); `auto`: vLLM when it imports and the policy is on a CUDA device, else HF."""
    problem = None
    if kind != "hf":
        if dist.compute_device(model).type != "cuda":
            problem = "needs the policy on a CUDA GPU"
        else:
            try:
                import vllm  # noqa: F401
            except Exception as error:  # not installed, or built for another torch/CUDA
                problem = f"needs vllm (pip install -r requirements-vllm.txt; importing it failed: {type(error).__name__})"
    if kind == "vllm" and problem:
        raise UserError(f"--generator vllm {problem}; or use --generator hf")
    if kind != "hf" and not problem:
        from infra.vllm_engine import VLLMGenerator
        generator = VLLMGenerator(model, tokenizer, gpu_memory_utilization, seed)
    else:
        generator = HFGenerator(model, tokenizer)
    generator.sync_weights(model)  # vLLM loaded the checkpoint from disk: a resumed policy differs from it
    return generator
