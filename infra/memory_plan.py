"""The memory plan's arithmetic: what one GPU (or a CPU run's process) and its host hold during a run, from the
model's config.json (infra.hub.config_folder), the method's models (policy; critic on its --critic-model backbone;
PRIME's implicit PRM; a frozen reference with it or --kl-coef > 0), the ranks (FSDP2 shards), the dtype policy,
checkpointing, the micro-batch and the rollout engine (vLLM's share: auto, what the trainer leaves; or the HF engine's
KV cache). The trainer's passes (old log-probs, reference, critic) run with the engine asleep: the update column.
infra/memory.py prints and checks it. Compared with CPU peaks and live tensor bytes (benchmarks/rehearsal.py,
docs/memory.md); not yet with a measured GPU peak."""
import dataclasses
import math

from infra import dist

GIB = 2 ** 30
PROMPT_TOKENS = 1024  # allowance for a prompt where the run's own are not known (a hub dataset offline, no tokenizer)
# Each GPU term names its source; docs/memory.md lists what only a GPU can confirm. Outside PyTorch's allocator:
CUDA_CONTEXT = GIB // 2  # CUDA context, kernels: 300-400 MB (pytorch/pytorch#20532), ~300 MB lazily loaded (#107667)
NCCL_ONE, NCCL_RANKS = GIB, 2 * GIB  # NCCL's buffers where models are sharded: a world of one (--offload-optimizer)
# 996 MiB at set-up (NVIDIA/nccl PR 2366; nccl#2363: a 512 MiB buffer, torch 2.11 + CUDA 13); several ranks ~1.6 GB
# for one communicator with an all-reduce (NVIDIA/nccl#864), and vLLM's groups beside it
HOST_BASELINE = 2 * GIB  # a GPU process's own host memory: 1.9 GB resident for one small CUDA op (pytorch#12873)
CPU_BASELINE = GIB // 3  # a CPU run's process before its models: Python, torch, transformers (measured: 0.32 GiB)
CPU_HEAP_SLACK = 0.15  # a CPU run's freed blocks glibc keeps, over its live bytes (rehearsal.py: 10-35%; fitted)
HF_ENGINE_BATCH = 256  # sequences per Hugging Face generate call: --hf-batch-size's default (HFGenerator batch_size)
HEAD_SLICE = 2 ** 24  # logits of one vocabulary slice in common.head_logprobs (its chunk_elements; >= 256 columns)
# vLLM 0.32 inside its share, besides weights and KV cache (v1/worker/gpu_worker.py determine_available_memory):
VLLM_MAX_SEQS = 1024  # its max_num_seqs on an H100/H200 (engine/arg_utils.py); the start-up profile samples (top-k,
# top-p) from that many rows of float32 logits (gpu_model_runner.py _dummy_sampler_run): logits, a sort's values and
# int64 indices, probabilities, their sum: 24 bytes an entry (read, not measured: vLLM does not reach the GPU check)
VLLM_GRAPHS = 3 * GIB // 4  # its CUDA graphs at the default capture sizes: 0.52 GiB for Qwen3-8B (LMCache/
# LMCache#3430), 0.58 and 0.73 GiB in other start-up logs (wtdcode/vllm-backport#34, vllm-project/vllm#39559)
SHARE_MARGIN, MAX_SHARE = 0.05, 0.9  # auto vLLM share: the GPU the trainer leaves, less 5%; at most vLLM's default
# vLLM asleep (level 2): CuMemBackend.suspend (sleep_mode_backend.py) drops weights and KV cache, copies its "runtime"
# and "cudagraph" pools (~VLLM_GRAPHS) to pinned memory (cumem.py), blocks torch's host allocator rounds up to a power
# of two (CachingHostAllocator.h): 2 GiB; on the GPU what it allocated outside them, 774 MiB at TP 1 (NeMo/RL#223)
VLLM_ASLEEP, VLLM_ASLEEP_HOST = GIB, 2 * GIB
ADAM_FOREACH = 4  # bytes a parameter: foreach AdamW (_multi_tensor_adam: CUDA, DTensors too) sqrt's every second
# moment at once; the for-loop path (CPU) two float32 copies of the largest tensor (rehearsal.py --terms: 4.000, 8.000)
ROLLOUT_AT_ONCE = 8  # "fits": the engine holds 1/8 of the rank's training rollout at full length (docs/memory.md)
FRAGMENTATION = 0.1  # the CUDA caching allocator's reserved-but-unallocated share of a phase's transient bytes: OOM
# messages quote 0.5% (vllm#27508), 6% (ali-vilab/VACE#56), 14% (levihsu/OOTDiffusion#235), 60% (minerva4ai-eu/
# minerva-benchmarks#42) of allocated: the GPU check's reserved / plan measures it. 0 in the rollout: the engine wakes
# after torch.cuda.empty_cache() (vllm_engine.py), no transient block held. A CPU run: CPU_HEAP_SLACK
# an "80 GB" H100 to CUDA (torch's OOM: "total capacity of 79.11 GiB", vllm#27508; nvidia-smi's 81,559 MiB: nccl#1264)
CUDA_80GB_GIB = 79.11
QWEN3 = {  # published config.json: hidden, layers, heads, KV heads, head_dim, intermediate, vocab, tied embeddings
    "Qwen3-0.6B": (1024, 28, 16, 8, 128, 3072, 151936, True), "Qwen3-1.7B": (2048, 28, 16, 8, 128, 6144, 151936, True),
    "Qwen3-4B": (2560, 36, 32, 8, 128, 9728, 151936, True), "Qwen3-8B": (4096, 36, 32, 8, 128, 12288, 151936, False)}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A dense decoder (Qwen3, Qwen2, Llama, Mistral) as its config.json gives it."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qk_norm: bool = True  # Qwen3's RMSNorm over each head of q and k
    qkv_bias: bool = False  # Qwen2's q/k/v biases

    def layer_parameters(self):
        """q, k, v, o projections (+ biases), q/k norms, gate/up/down projections, two RMSNorms."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + (q + 2 * kv) * self.qkv_bias
        return attention + 2 * self.head_dim * self.qk_norm + 3 * self.hidden * self.intermediate + 2 * self.hidden

    def parameters(self, value_head=0):
        """Embeddings, layers, final norm, then the LM head (none when tied) or value_head=k: a Linear(hidden, k)
        score with bias (AutoModelForTokenClassification, the critic)."""
        body = self.vocab * self.hidden + self.layers * self.layer_parameters() + self.hidden
        return body + ((self.hidden + 1) * value_head if value_head else (not self.tied) * self.vocab * self.hidden)

    def kv_bytes(self, tokens, dtype_bytes=2):  # keys and values of `tokens` positions over every layer
        return tokens * 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def read_shape(name):
    """(Shape, None) from the config.json of --model `name` (a folder, the built-in model, a hub model's config.json
    alone); (None, why not) for an architecture the plan does not know. An unreachable hub raises infra.hub's line."""
    from transformers import AutoConfig
    from infra.hub import config_folder
    try:
        config = AutoConfig.from_pretrained(config_folder(name))
    except (OSError, ValueError) as error:
        return None, f"config.json of {name!r} unreadable ({' '.join(str(error).split())[:200]})"
    kind, heads = config.model_type, config.num_attention_heads
    if kind not in ("qwen3", "qwen2", "llama", "mistral"):
        return None, f"{name!r} is a {kind!r} model; the plan knows dense qwen3, qwen2, llama and mistral decoders"
    return Shape(config.hidden_size, config.num_hidden_layers, heads, config.num_key_value_heads or heads,
                 getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size,
                 config.vocab_size, bool(config.tie_word_embeddings), kind == "qwen3",
                 kind == "qwen2" or bool(getattr(config, "attention_bias", False))), None


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the plan depends on. models: ((role, Shape, value_head, trained), ...), the policy first."""
    models: tuple
    ranks: int = 1
    offload: bool = False  # --offload-optimizer: FSDP2's CPUOffloadPolicy keeps the float32 state in host memory
    tokens: int = 16384  # padded tokens of the largest micro-batch
    sequence: int = PROMPT_TOKENS + 8192  # the longest sequence: prompt allowance + --max-response-tokens
    checkpointing: bool = True
    compute_bytes: int = 2  # bf16 compute (4: float32)
    engine: str = "vllm"  # the rollout engine: vllm (its share of the device) or hf (generate on a policy copy)
    engine_bytes: float = 0.0  # vLLM's share: --gpu-memory-utilization x device memory
    cpu: bool = False  # a CPU run: the plan is of the process's resident memory, its baseline for the CUDA context
    rows: int = 0  # sequences per micro-batch (--micro-batch-size); 0: packed by tokens (--micro-batch-tokens)
    prompt_tokens: int = PROMPT_TOKENS  # the prompt part of `sequence`: the run's longest, else the allowance
    generated: tuple = (HF_ENGINE_BATCH, PROMPT_TOKENS + 8192)  # its largest generate call per rank: (rows, tokens)
    engine_batch: int = HF_ENGINE_BATCH  # HF engine: sequences per generate call (--hf-batch-size)
    auto_share: bool = False  # vLLM's share is what the trainer leaves (--gpu-memory-utilization 0): fitted by fit()
    rollout: int = 512  # training sequences per rank and step (prompts x samples / ranks), `sequence` tokens each

    def at_once(self):
        """Training sequences the engine must hold at once at full length for the plan to fit: 1/8 of the rank's."""
        return math.ceil(self.rollout / ROLLOUT_AT_ONCE)

    def hf_rows(self):
        """Sequences of one HF generate call: --hf-batch-size, or fewer when the call asks for fewer."""
        return min(self.engine_batch, self.generated[0])


def training_pass(shape, value_head, setup):
    """(compute copies, activations, logits, gradient buffers, layer backward) in bytes of one micro-batch's forward
    and backward through a trained model. A decoder layer saves per token: two RMSNorms' float32 input and output
    (16h), the projections' inputs (2bh), q/k norms (8(q + kv)), SDPA's q, repeated k and v, output, o_proj's input
    (5bq), the MLP's gate, up, SiLU and product (4bI). Logits (common.head_logprobs over N positions): a vocabulary
    slice's float32 logits and a temporary (8N x max(256, HEAD_SLICE / N) columns), the hidden states' casts and
    gradient (8Nh). Gradient buffers: one process, a tied head's float32 gradient beside the embedding's (8Vh;
    else 4Vh); FSDP2, the root unit's gradient and float32 reduce-scatter input ((b + 4) x its parameters). Layer
    backward: the MLP product's factors' gradients (2bI a token). Against live bytes on CPU (benchmarks/rehearsal.py
    --terms): 1.00-1.14 (layer backward), 0.99-1.12 (with recomputed saved tensors), 1.00 (FSDP2's root unit)."""
    h, b, tokens, sharded = shape.hidden, setup.compute_bytes, setup.tokens, setup.ranks > 1 or setup.offload
    q, kv, layer = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layer_parameters()
    root = shape.parameters(value_head) - shape.layers * layer  # embeddings, final norm, LM or value head
    if sharded:  # FSDP2: the root unit stays gathered from forward to backward; two layers gathered (one
        # prefetched); one layer's gradient before its float32 reduce-scatter
        compute = b * root + 2 * b * layer + (b + 4) * layer
    else:  # autocast keeps a compute-dtype cast of every decoder matmul weight until the forward ends (the LM head
        compute = (b < 4) * b * shape.layers * layer  # is cast a vocabulary slice at a time)
    residual = b if sharded else 4  # autocast over float32 weights keeps the residual stream in float32
    saved = 16 * h + 2 * b * h + 8 * (q + kv) + 5 * b * q + 4 * b * shape.intermediate
    per_token = shape.layers * residual * h + saved if setup.checkpointing else shape.layers * saved
    activations = tokens * per_token + tokens * min(setup.sequence, tokens)  # + SDPA's boolean B x S x S mask
    positions = setup.rows * (setup.sequence - setup.prompt_tokens) if setup.rows else tokens
    columns = min(shape.vocab, max(256, HEAD_SLICE // max(positions, 1)))  # of a slice, as head_logprobs cuts it
    logits = 0 if value_head else 8 * positions * (columns + h)
    buffers = (b + 4) * root if sharded else 4 * shape.vocab * h * (1 + (shape.tied and not value_head))
    return compute, activations, logits, buffers, 2 * b * shape.intermediate * tokens


def optimizer_temporaries(setup):
    """Bytes AdamW's step allocates beyond its states (offloaded or a CPU run: host memory): on CUDA ADAM_FOREACH a
    parameter; on CPU two float32 copies of the largest tensor (shard). Each optimizer steps alone: the largest's."""
    def largest(shape):
        return max(shape.vocab * shape.hidden, shape.hidden * shape.intermediate)
    trained = [(shape, head) for _, shape, head, train in setup.models if train]
    if setup.cpu or setup.offload:
        return max((8 * largest(shape) / setup.ranks for shape, _ in trained), default=0)
    return max((ADAM_FOREACH * shape.parameters(head) / setup.ranks for shape, head in trained), default=0)


def plan(setup):
    """[(component, what, update-phase bytes, rollout-phase bytes, host bytes)] per GPU (host: per rank)."""
    ranks, on_gpu = setup.ranks, not setup.offload
    every = sum(shape.parameters(head) for _, shape, head, _ in setup.models)
    trained = sum(shape.parameters(head) for _, shape, head, train in setup.models if train)
    weights, gradients, adam = 4 * every / ranks, 4 * trained / ranks, 8 * trained / ranks
    passes = [training_pass(shape, head, setup) for _, shape, head, train in setup.models if train] or [(0,) * 5]
    compute, activations, logits, buffers, backward = max(passes, key=sum)
    # AdamW steps after the backward pass, its transient rows freed: what its temporaries need beyond them
    temporaries, host_step = optimizer_temporaries(setup), setup.offload and not setup.cpu
    step = 0 if host_step else max(0.0, temporaries - (compute + activations + logits + buffers + backward))
    policy = setup.models[0][1]
    if setup.engine == "vllm" and setup.cpu:  # vLLM's CPU build has no sleep mode: its KV cache and weights stay
        kept = setup.engine_bytes + setup.compute_bytes * policy.parameters()
        engine, engine_what = (kept, kept, 0), f"vLLM CPU build, KV cache {setup.engine_bytes / GIB:.1f} GiB, awake"
    elif setup.engine == "vllm":  # asleep at level 2 in the update: VLLM_ASLEEP left on the GPU, its pools on the host
        engine = (VLLM_ASLEEP, setup.engine_bytes, VLLM_ASLEEP_HOST)
        engine_what = f"vLLM, {setup.engine_bytes / GIB:.1f} GiB share (asleep in the update: 1 GiB kept)"
    else:  # a whole policy copy when sharded, else autocast's bf16 casts kept for the call; the KV cache of one call,
        # sampling's float32 [rows, V] logits, a copy, softmax and log-softmax
        b, copy = setup.compute_bytes, setup.compute_bytes * policy.parameters() * (ranks > 1 or setup.offload)
        casts = 0 if copy or b == 4 else b * (policy.layers * policy.layer_parameters() + policy.vocab * policy.hidden)
        rows, length = setup.hf_rows(), setup.generated[1]
        cache = policy.kv_bytes(rows * length, b) + 16 * rows * policy.vocab
        engine, engine_what = (copy, copy + casts + cache, 0), f"HF generate: KV cache of {rows} x {length:,} tokens"
    roles = " + ".join(f"{role} {count / 1e9:.2f}B" if count > 1e7 else f"{role} {count / 1e6:.2f}M"
                       for role, count in ((role, shape.parameters(head)) for role, shape, head, _ in setup.models))
    where = f"over {ranks} rank{'s' * (ranks > 1)}" + ", in host memory" * setup.offload
    layers = "checkpointed layers" if setup.checkpointing else "every layer (no checkpointing)"
    rows = [("weights", f"float32, {roles}, {where}", weights * on_gpu, weights * on_gpu, weights * setup.offload),
            ("gradients", "float32, trained models", gradients * on_gpu, 0, gradients * setup.offload),
            ("AdamW states", "float32, 2 per trained parameter", adam * on_gpu, adam * on_gpu, adam * setup.offload),
            ("compute copies", "bf16 weights in use (autocast casts or FSDP units)", compute, 0, 0),
            ("activations", f"{setup.tokens:,} tokens per micro-batch, {layers}", activations, 0, 0),
            ("logits", "LM head a vocabulary slice at a time (common.head_logprobs)", logits, 0, 0),
            ("grad buffers", "the embedding's gradients before accumulation (FSDP: and reduce-scatter)", buffers, 0, 0),
            ("layer backward", "one layer's MLP gradients above its saved tensors (2bI a token)", backward, 0, 0),
            ("optimizer step", f"AdamW's temporaries ({temporaries / GIB:.1f} GiB) beyond the pass's rows", step, 0,
             temporaries * host_step),
            ("engine", engine_what, *engine)]
    if setup.cpu:  # the process's own baseline, and the freed blocks glibc keeps (keep_freed_host_memory)
        return rows + [("overhead", f"Python, torch; {CPU_HEAP_SLACK:.0%} freed blocks kept (CPU)", *(
            CPU_BASELINE + CPU_HEAP_SLACK * sum(row[column] for row in rows) for column in (2, 3)), 0)]
    transient = sum(row[2] for row in rows[3:9]), engine[1] if setup.engine == "hf" else 0
    nccl = NCCL_RANKS if ranks > 1 else NCCL_ONE if setup.offload else 0  # where models are sharded
    return rows + [("fragmentation", f"{FRAGMENTATION:.0%} of the phase's transient bytes (OOM logs: 0.5-60%)",
                    *(FRAGMENTATION * part for part in transient), 0),
                   ("overhead", f"CUDA context, NCCL {nccl / GIB:.0f} GiB; host: the process",
                    *(CUDA_CONTEXT + nccl,) * 2, HOST_BASELINE)]


def peak(rows):
    return max(sum(row[2] for row in rows), sum(row[3] for row in rows))


def table(rows, title):
    """The plan as printed, in 120 columns: one line per component, GiB in the update and rollout phases and in host
    memory (each column 9 wide: up to 99,999.9 GiB)."""
    rows = rows + [("total GiB", "", *(sum(row[column] for row in rows) for column in (2, 3, 4)))]
    return "\n".join([f"{title[:93]:<93}{'update':>9}{'rollout':>9}{'host':>9}"] + [
        f"  {name:<15}{what[:76]:<76}{u / GIB:>9.1f}{r / GIB:>9.1f}{h / GIB:>9.1f}" for name, what, u, r, h in rows])


def vllm_reserve(shape):
    """vLLM's share less weights and KV cache: its profile's sampler (VLLM_MAX_SEQS rows) and CUDA graphs."""
    return 24 * VLLM_MAX_SEQS * shape.vocab + VLLM_GRAPHS


def vllm_share(setup, gpu_bytes):
    """(share, KV cache bytes) of the auto --gpu-memory-utilization on a GPU of `gpu_bytes`: what the trainer leaves
    in the rollout phase (the plan's rollout column without vLLM), less SHARE_MARGIN of the GPU, at most MAX_SHARE,
    in hundredths; the KV cache is that share less vLLM's bf16 policy weights and vllm_reserve."""
    trainer = sum(row[3] for row in plan(dataclasses.replace(setup, engine="vllm", engine_bytes=0)))
    share = min(MAX_SHARE, math.floor(100 * ((gpu_bytes - trainer) / gpu_bytes - SHARE_MARGIN)) / 100)
    policy = setup.models[0][1]
    return share, share * gpu_bytes - 2 * policy.parameters() - vllm_reserve(policy)


def fit(setup, limit, gpu_bytes):
    """(setup, None) when the plan fits GPUs of `limit` bytes free and `gpu_bytes` in all, else (setup, why not): a
    peak above the limit, a vLLM KV cache short of one sequence or, auto share (fitted here), of Setup.at_once()."""
    problem, policy = None, setup.models[0][1]
    if setup.engine == "vllm" and gpu_bytes and not setup.cpu:
        share = vllm_share(setup, gpu_bytes)[0] if setup.auto_share else setup.engine_bytes / gpu_bytes
        setup = dataclasses.replace(setup, engine_bytes=max(share, 0.0) * gpu_bytes)
        kv = max(share * gpu_bytes - 2 * policy.parameters() - vllm_reserve(policy), 0)
        held, need = int(kv // policy.kv_bytes(setup.sequence)), setup.at_once() * setup.auto_share
        longest = max(setup.sequence, setup.generated[1])
        if held < need or kv < policy.kv_bytes(longest):
            part = f"1/{ROLLOUT_AT_ONCE} of this rank's rollout of {setup.rollout} ({need})" if held < need else \
                f"one {longest:,}-token sequence"
            problem = (f"the memory plan leaves vLLM {max(share, 0):.2f} of the {gpu_bytes / GIB:.1f} GiB GPU, a KV "
                       f"cache of {kv / GIB:.1f} GiB: {held} sequences of {setup.sequence:,} tokens at once, fewer "
                       f"than {part}")
    need = peak(plan(setup))
    return setup, f"the memory plan needs {need / GIB:.1f} GiB per GPU" if need > limit else problem


def setup_for(args, device, gpu_bytes, prompt_tokens=PROMPT_TOKENS, eval_rows=0):
    """(Setup, None) for a trainer's parsed args, or (None, why not). gpu_bytes: the GPU's memory (0: a CPU run);
    prompt_tokens: the run's longest prompt; eval_rows: its largest held-out set (0: not known)."""
    policy, why = read_shape(args.model)
    critic, why = (read_shape(args.critic_model) if getattr(args, "critic_model", "") else (policy, why)) \
        if policy else (None, why)
    if critic is None:
        return None, why
    outputs, trained = 2 if getattr(args, "critic_head", "") == "separate" else 1, not args.eval_only  # tppo: 2 heads
    prm = [("implicit PRM", policy, 0, trained)] * hasattr(args, "prm_lr")  # prime.py: a trained copy of the policy
    models = [("policy", policy, 0, trained)] + [("critic", critic, outputs, trained)] * hasattr(args, "critic_model") \
        + prm + [("reference", policy, 0, False)] * (getattr(args, "kl_coef", 0) > 0 or bool(prm))
    sequence = prompt_tokens + args.max_response_tokens
    tokens = max(args.micro_batch_tokens, sequence) if args.micro_batch_tokens else args.micro_batch_size * sequence
    vllm = args.generator == "vllm" or bool(gpu_bytes) and args.generator == "auto" and (  # planning for another
        not device.startswith("cuda") or _vllm_installed())  # GPU: vLLM, as recommended; on CPU only when asked
    ranks, problems = dist.world_size(), min(filter(None, (eval_rows, args.eval_problems)), default=0)
    rollout = args.prompts_per_step * args.samples_per_prompt // ranks  # prime.py samples --oversample x as many
    calls = [(rollout * getattr(args, "oversample", 1), args.max_response_tokens)] * trained + [
        ((problems or args.hf_batch_size) * args.eval_n // ranks, args.eval_max_tokens)] * bool(
        args.eval_datasets)  # training rollouts; evaluation (its problems; not known: at least a full HF batch)
    generated = max(((max(n, 1), prompt_tokens + limit) for n, limit in calls),
                    key=lambda call: min(call[0], args.hf_batch_size) * call[1], default=(1, sequence))
    float32 = args.dtype == "float32" or args.dtype == "auto" and not gpu_bytes  # auto: float32 on CPU
    setup = Setup(tuple(models), ranks, args.offload_optimizer, tokens, sequence, args.gradient_checkpointing,
                  4 if float32 else 2, "vllm" if vllm else "hf", 0.0, not gpu_bytes,
                  0 if args.micro_batch_tokens else args.micro_batch_size, prompt_tokens, generated,
                  args.hf_batch_size, vllm and bool(gpu_bytes) and not args.gpu_memory_utilization, trained * rollout)
    share = (args.gpu_memory_utilization or vllm_share(setup, gpu_bytes)[0]) * gpu_bytes if gpu_bytes else \
        args.vllm_kv_cache_gib * GIB  # vLLM's CPU build: a KV cache of --vllm-kv-cache-gib
    return dataclasses.replace(setup, engine_bytes=max(share, 0.0) * vllm), None


def _vllm_installed():
    import importlib.util
    return importlib.util.find_spec("vllm") is not None
