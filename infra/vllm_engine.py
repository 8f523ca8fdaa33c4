"""The vLLM rollout engine, colocated in this process (optional: `pip install -r requirements-vllm.txt`). vLLM is
imported here only, so everything else runs without it.
"""
import os

import torch

from common import Completion
from infra import dist


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
        ranks = dict(distributed_executor_backend="external_launcher", data_parallel_size=dist.world_size()) if dist.distributed() else {}
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
        weights = dist.full_weights(model)  # one tensor at a time: under torchrun each is gathered from the shards
        # LLM.apply_model(func): "Run a function directly on the model inside each worker" (entrypoints/llm.py)
        self.llm.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()

