"""The memory plan's arithmetic: what one GPU (or a CPU run's process) holds during a run, from the model's
config.json (a hub model's fetched alone when it is not on disk: infra.hub.config_folder), the method (policy; critic
on its --critic-model backbone; a frozen reference when --kl-coef > 0), the ranks (FSDP2 shards weights, gradients and
AdamW states), the dtype policy (float32 weights and AdamW states, bf16 compute), gradient checkpointing, the
micro-batch, and the rollout engine: vLLM's share of the GPU (auto: what the trainer leaves, vllm_share) or the
Hugging Face engine's KV cache for the run's own generate calls. infra/memory.py prints and checks it.
Estimates from shapes, compared with measured CPU peaks by benchmarks/rehearsal.py (docs/scaling.md), not yet with
a measured GPU peak."""
import dataclasses
import math

from infra import dist

GIB = 2 ** 30
PROMPT_TOKENS = 1024  # planning allowance for a prompt (no flag caps prompts; GSM8K/MATH prompts are shorter)
OVERHEAD = GIB  # CUDA context, cuBLAS/NCCL workspaces, allocator slack: an assumption, not measured
CPU_BASELINE = GIB // 3  # a CPU run's process before its models: Python, torch, transformers (measured: 0.32 GiB)
CPU_HEAP_SLACK = 0.15  # a CPU run's freed blocks that glibc keeps, over its live bytes (benchmarks/rehearsal.py:
# measured 10-35% with keep_freed_host_memory, more at small shapes; not derived, fitted)
HF_ENGINE_BATCH = 256  # sequences per Hugging Face generate call (infra.engine.HFGenerator's batch_size)
HEAD_SLICE = 2 ** 24  # logits of one vocabulary slice in common.head_logprobs (its chunk_elements; >= 256 columns)
VLLM_RESERVE = 2 * GIB  # vLLM's memory besides weights and KV cache (profiled activations, CUDA graphs, sampler):
# an assumption, not measured
SHARE_MARGIN, MAX_SHARE = 0.05, 0.9  # auto vLLM share: the GPU the trainer leaves, less 5%; at most vLLM's default
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

    def kv_bytes(self, tokens, dtype_bytes=2):
        """Keys and values of `tokens` positions over every layer."""
        return tokens * 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def read_shape(name):
    """(Shape, None) from the config.json of --model `name` (a local folder, the built-in model, or a hub model: its
    config.json alone, fetched when not yet in the cache); (None, why not) for an architecture the plan does not
    know. A hub model that cannot be reached raises infra.hub's one-line refusal."""
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
    prompt_tokens: int = PROMPT_TOKENS  # the prompt part of `sequence`
    generated: tuple = (HF_ENGINE_BATCH, PROMPT_TOKENS + 8192)  # HF engine: the largest generate batch (sequences,
    # tokens each) of the run: min(256, the call's sequences per rank) x (prompt + its response limit)


def training_pass(shape, value_head, setup):
    """(compute copies, activations, logits, gradient buffers) in bytes of one micro-batch's forward and backward
    through a trained model. Per token, one decoder layer saves for backward: its two RMSNorms' float32 input and
    normalized copy (2 x 8h), the normed inputs of the projections in the compute dtype (2bh), q/k norms in float32
    (8(q + kv)), SDPA's q and k, v repeated to all heads, its output and o_proj's input (5bq; a padding mask rules out
    SDPA's own GQA), the MLP's gate, up, SiLU(gate) and product (4bI). Logits: common.head_logprobs over the N
    positions whose log-probs are taken (the response columns, or every token when packed by tokens): one vocabulary
    slice's float32 logits and a temporary of their size (8 bytes x N x its columns, HEAD_SLICE / N but at least 256)
    and the hidden states' casts and gradient (8Nh); no [N, V] tensor. Gradient buffers (one process, from the second micro-batch of a mini-batch on):
    autograd makes each gradient before adding it to the accumulated one; the largest waiting at once are the
    embedding matrix's, a tied LM head's float32 gradient held until the embedding's own arrives at the end of the
    backward pass, and that one (2 x 4Vh; untied or a value head: 4Vh). Measured on CPU (benchmarks/rehearsal.py)."""
    h, b, tokens, sharded = shape.hidden, setup.compute_bytes, setup.tokens, setup.ranks > 1 or setup.offload
    q, kv, layer = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layer_parameters()
    if sharded:  # FSDP2: the root unit (embeddings, norm, head) stays gathered from forward to backward; two layers
        # gathered (one prefetched); one layer's gradient before its float32 reduce-scatter
        compute = b * (shape.parameters(value_head) - shape.layers * layer) + 2 * b * layer + (b + 4) * layer
    else:  # autocast keeps a compute-dtype cast of every decoder matmul weight until the forward ends (the LM head
        compute = (b < 4) * b * shape.layers * layer  # is cast a vocabulary slice at a time)
    residual = b if sharded else 4  # autocast over float32 weights keeps the residual stream in float32
    saved = 16 * h + 2 * b * h + 8 * (q + kv) + 5 * b * q + 4 * b * shape.intermediate
    per_token = shape.layers * residual * h + saved if setup.checkpointing else shape.layers * saved
    activations = tokens * per_token + tokens * min(setup.sequence, tokens)  # + SDPA's boolean B x S x S mask
    positions = setup.rows * (setup.sequence - setup.prompt_tokens) if setup.rows else tokens
    columns = min(shape.vocab, max(256, HEAD_SLICE // max(positions, 1)))  # of a slice, as head_logprobs cuts it
    logits = 0 if value_head else 8 * positions * (columns + h)
    buffers = 0 if sharded else 4 * shape.vocab * h * (1 + (shape.tied and not value_head))
    return compute, activations, logits, buffers


def plan(setup):
    """[(component, what, update-phase bytes, rollout-phase bytes, host bytes)] per GPU (host: per rank)."""
    ranks, on_gpu = setup.ranks, not setup.offload
    every = sum(shape.parameters(head) for _, shape, head, _ in setup.models)
    trained = sum(shape.parameters(head) for _, shape, head, train in setup.models if train)
    weights, gradients, adam = 4 * every / ranks, 4 * trained / ranks, 8 * trained / ranks
    passes = [training_pass(shape, head, setup) for _, shape, head, train in setup.models if train] or [(0,) * 4]
    compute, activations, logits, buffers = max(passes, key=sum)
    policy = setup.models[0][1]
    if setup.engine == "vllm":  # asleep during the update (level 1: its bf16 weights wait in host memory)
        engine = (0, setup.engine_bytes, 2 * policy.parameters())
        engine_what = f"vLLM, {setup.engine_bytes / GIB:.1f} GiB share (asleep in the update)"
    else:  # a whole policy copy when the policy is sharded, else autocast's casts of its matmul weights kept for the
        # generate call (bf16); the KV cache of the largest generate batch and sampling's float32 [rows, V] logits,
        # a copy, softmax and log-softmax
        b, copy = setup.compute_bytes, setup.compute_bytes * policy.parameters() * (ranks > 1 or setup.offload)
        casts = 0 if copy or b == 4 else b * (policy.layers * policy.layer_parameters() + policy.vocab * policy.hidden)
        rows, length = setup.generated
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
            ("grad buffers", "the embedding's gradients before they are accumulated", buffers, 0, 0),
            ("engine", engine_what, *engine)]
    if setup.cpu:  # the process's own baseline, and the freed blocks glibc keeps (keep_freed_host_memory)
        return rows + [("overhead", f"Python, torch; {CPU_HEAP_SLACK:.0%} freed blocks kept (CPU)", *(
            CPU_BASELINE + CPU_HEAP_SLACK * sum(row[column] for row in rows) for column in (2, 3)), 0)]
    return rows + [("overhead", "CUDA context, workspaces (assumed)", OVERHEAD, OVERHEAD, 0)]


def peak(rows):
    return max(sum(row[2] for row in rows), sum(row[3] for row in rows))


def table(rows, title):
    """The plan as printed, in 120 columns: one line per component, GiB in the update and rollout phases and in host
    memory (each column 9 wide: up to 99,999.9 GiB)."""
    rows = rows + [("total GiB", "", *(sum(row[column] for row in rows) for column in (2, 3, 4)))]
    return "\n".join([f"{title[:93]:<93}{'update':>9}{'rollout':>9}{'host':>9}"] + [
        f"  {name:<15}{what[:76]:<76}{u / GIB:>9.1f}{r / GIB:>9.1f}{h / GIB:>9.1f}" for name, what, u, r, h in rows])


def vllm_share(setup, gpu_bytes):
    """(share, KV cache bytes) of the auto --gpu-memory-utilization on a GPU of `gpu_bytes`: what the trainer leaves
    in the rollout phase (the plan's rollout column without vLLM: weights and AdamW states unless offloaded, the
    CUDA context), less SHARE_MARGIN of the GPU, at most MAX_SHARE, in hundredths; the KV cache is that share less
    vLLM's bf16 policy weights and VLLM_RESERVE."""
    trainer = sum(row[3] for row in plan(dataclasses.replace(setup, engine="vllm", engine_bytes=0)))
    share = min(MAX_SHARE, math.floor(100 * ((gpu_bytes - trainer) / gpu_bytes - SHARE_MARGIN)) / 100)
    return share, share * gpu_bytes - 2 * setup.models[0][1].parameters() - VLLM_RESERVE


def setup_for(args, device, gpu_bytes):
    """(Setup, None) for a trainer's parsed args, or (None, why not). gpu_bytes: the GPU's memory (0: a CPU run).
    --gpu-memory-utilization 0 (auto) on a GPU: vLLM's share from vllm_share."""
    policy, why = read_shape(args.model)
    critic, why = (read_shape(args.critic_model) if getattr(args, "critic_model", "") else (policy, why)) \
        if policy else (None, why)
    if critic is None:
        return None, why
    outputs, trained = 2 if getattr(args, "critic_head", "") == "separate" else 1, not args.eval_only  # tppo: 2 heads
    models = [("policy", policy, 0, trained)] + [("critic", critic, outputs, trained)] * hasattr(args, "critic_model") \
        + [("reference", policy, 0, False)] * (getattr(args, "kl_coef", 0) > 0)
    sequence = PROMPT_TOKENS + args.max_response_tokens
    tokens = max(args.micro_batch_tokens, sequence) if args.micro_batch_tokens else args.micro_batch_size * sequence
    vllm = bool(gpu_bytes) and args.generator != "hf" and (  # planning for another GPU: vLLM, as recommended
        args.generator == "vllm" or not device.startswith("cuda") or _vllm_installed())
    if not gpu_bytes and args.generator == "vllm":  # vLLM's CPU build: a KV cache of --vllm-kv-cache-gib
        vllm = True
    ranks = dist.world_size()
    calls = [(args.prompts_per_step * args.samples_per_prompt // ranks, args.max_response_tokens)] * trained + [
        ((args.eval_problems or HF_ENGINE_BATCH) * args.eval_n // ranks, args.eval_max_tokens)] * bool(
        args.eval_datasets)  # training rollouts; evaluation (all problems: at least a full batch)
    generated = max(((min(HF_ENGINE_BATCH, max(n, 1)), PROMPT_TOKENS + limit) for n, limit in calls),
                    key=lambda call: call[0] * call[1], default=(1, sequence))
    float32 = args.dtype == "float32" or args.dtype == "auto" and not gpu_bytes  # auto: float32 on CPU
    setup = Setup(tuple(models), ranks, args.offload_optimizer, tokens, sequence, args.gradient_checkpointing,
                  4 if float32 else 2, "vllm" if vllm else "hf", 0.0, not gpu_bytes,
                  0 if args.micro_batch_tokens else args.micro_batch_size, PROMPT_TOKENS, generated)
    if not gpu_bytes:
        share_bytes = args.vllm_kv_cache_gib * GIB * vllm
    else:
        share_bytes = (args.gpu_memory_utilization or vllm_share(setup, gpu_bytes)[0]) * gpu_bytes * vllm
    return dataclasses.replace(setup, engine_bytes=max(share_bytes, 0.0)), None


def _vllm_installed():
    import importlib.util
    return importlib.util.find_spec("vllm") is not None
