"""The memory plan: what one GPU holds during a run, computed before any model loads from the model's config.json,
the method (policy; critic on its --critic-model backbone; a frozen reference when --kl-coef > 0), the number of
ranks (FSDP2 shards weights, gradients and AdamW states over them), the dtype policy (float32 weights and AdamW
states, bf16 compute), gradient checkpointing, the micro-batch token budget and the vLLM engine's share.
Run.__init__ prints it when a real-model run starts (the tiny demo: with --gpu-memory-gib) and refuses, in one line
naming flags that fit, a plan larger than the device or than this machine's available memory (a CPU run's whole
plan; the host column). `python -m infra.memory --table`: the README's scaling table.
Estimates from shapes, not measurements: not yet compared with a measured GPU peak; compared with measured CPU peaks
at Qwen3-0.6B's shapes by benchmarks/rehearsal.py (docs/scaling.md)."""
import ctypes
import dataclasses
import importlib.util
import itertools
import os
import sys

from infra import UserError, dist
from infra.cli import trainer_defaults, trainers

GIB = 2 ** 30
PROMPT_TOKENS = 1024  # planning allowance for a prompt (no flag caps prompts; GSM8K/MATH prompts are shorter)
OVERHEAD = GIB  # CUDA context, cuBLAS/NCCL workspaces, allocator slack: an assumption, not measured
CPU_BASELINE = GIB // 3  # a CPU run's process before its models: Python, torch, transformers (measured: 0.32 GiB)
CPU_HEAP_SLACK = 0.15  # a CPU run's freed blocks that glibc keeps, over its live bytes (benchmarks/rehearsal.py:
# measured 10-35% with keep_freed_host_memory, more at small shapes; not derived, fitted)
HF_ENGINE_BATCH = 256  # sequences per Hugging Face generate call (infra.engine.HFGenerator's batch_size)
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


def read_shape(name):
    """(Shape, None) from the config.json of a local directory, the built-in model or a hub id already in the
    Hugging Face cache (nothing is downloaded, no weights are read); (None, why not) otherwise."""
    from transformers import AutoConfig

    import common
    try:
        config = AutoConfig.from_pretrained(common.resolve_model_name(name), local_files_only=True)
    except (OSError, ValueError):
        return None, f"no config.json of {name!r} on disk (a hub model not downloaded yet)"
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


def training_pass(shape, value_head, setup):
    """(compute copies, activations, logits, gradient buffers) in bytes of one micro-batch's forward and backward
    through a trained model. Per token, one decoder layer saves for backward: its two RMSNorms' float32 input and
    normalized copy (2 x 8h), the normed inputs of the projections in the compute dtype (2bh), q/k norms in float32
    (8(q + kv)), SDPA's q and k, v repeated to all heads, its output and o_proj's input (5bq; a padding mask rules out
    SDPA's own GQA), the MLP's gate, up, SiLU(gate) and product (4bI). Logits: the response's columns only
    (common.response_forward keeps T + 1 of them), or every token when packed by tokens (prompts may be short).
    Gradient buffers (one process, from the second micro-batch of a mini-batch on): autograd makes each gradient
    before adding it to the accumulated one; the largest waiting at once are the embedding matrix's, a tied LM
    head's float32 gradient held until the embedding's own arrives at the end of the backward pass, and that one
    (2 x 4Vh; untied or a value head: 4Vh). Measured on CPU (benchmarks/rehearsal.py); FSDP2: its own accounting."""
    h, b, tokens, sharded = shape.hidden, setup.compute_bytes, setup.tokens, setup.ranks > 1 or setup.offload
    q, kv, layer = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.layer_parameters()
    if sharded:  # FSDP2: the root unit (embeddings, norm, head) stays gathered from forward to backward; two layers
        # gathered (one prefetched); one layer's gradient before its float32 reduce-scatter
        compute = b * (shape.parameters(value_head) - shape.layers * layer) + 2 * b * layer + (b + 4) * layer
    else:  # autocast keeps a compute-dtype cast of every matmul weight until the forward ends (the embedding's: tied)
        compute = (b < 4) * b * (shape.layers * layer + shape.vocab * h * (not value_head))
    residual = b if sharded else 4  # autocast over float32 weights keeps the residual stream in float32
    saved = 16 * h + 2 * b * h + 8 * (q + kv) + 5 * b * q + 4 * b * shape.intermediate
    per_token = shape.layers * residual * h + saved if setup.checkpointing else shape.layers * saved
    activations = tokens * per_token + tokens * min(setup.sequence, tokens)  # + SDPA's boolean B x S x S mask
    columns = setup.rows * (setup.sequence - PROMPT_TOKENS + 1) if setup.rows else tokens
    logits = 0 if value_head else 2 * b * columns * shape.vocab  # bf16 logits and their gradient, no float32 copy
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
    else:  # a whole policy copy when the policy is sharded; the KV cache of a batch of full-length sequences
        b, copy = setup.compute_bytes, setup.compute_bytes * policy.parameters() * (ranks > 1 or setup.offload)
        cache = HF_ENGINE_BATCH * setup.sequence * 2 * policy.layers * policy.kv_heads * policy.head_dim * b
        engine, engine_what = (copy, copy + cache, 0), f"HF generate: KV cache of {HF_ENGINE_BATCH} sequences"
    roles = " + ".join(f"{role} {count / 1e9:.2f}B" if count > 1e7 else f"{role} {count / 1e6:.2f}M"
                       for role, count in ((role, shape.parameters(head)) for role, shape, head, _ in setup.models))
    where = f"over {ranks} rank{'s' * (ranks > 1)}" + ", in host memory" * setup.offload
    layers = "checkpointed layers" if setup.checkpointing else "every layer (no checkpointing)"
    rows = [("weights", f"float32, {roles}, {where}", weights * on_gpu, weights * on_gpu, weights * setup.offload),
            ("gradients", "float32, trained models", gradients * on_gpu, 0, gradients * setup.offload),
            ("AdamW states", "float32, 2 per trained parameter", adam * on_gpu, adam * on_gpu, adam * setup.offload),
            ("compute copies", "bf16 weights in use (autocast casts or FSDP units)", compute, 0, 0),
            ("activations", f"{setup.tokens:,} tokens per micro-batch, {layers}", activations, 0, 0),
            ("logits", "vocab x response tokens in bf16, and their gradient", logits, 0, 0),
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


def host_memory():
    """(available, total) bytes of this machine's memory: /proc/meminfo's MemAvailable (what the kernel can give
    without swapping: free pages and reclaimable caches) and MemTotal; without /proc, os.sysconf's free and total
    pages (free understates what is available: caches count as used)."""
    try:
        with open("/proc/meminfo") as handle:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in handle if line.endswith("kB\n")}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def host_need(setup, cpu, ranks_here):
    """Bytes of this machine's memory the plan takes: the host column (offloaded states, vLLM asleep) of each of
    the `ranks_here` processes on it, and in a CPU run (no GPU: every column is host memory) their peak too."""
    rows = plan(setup)
    return ranks_here * (sum(row[4] for row in rows) + cpu * peak(rows))


def fitting_flags(setup, limit, host=None):
    """Up to 4 flag sets under which the plan's peak is at most `limit` bytes, the least change of each kind: those
    that fit alone, then pairs (or triples) of changes that do not. A micro-batch holds one sequence at least.
    host=(cpu, ranks_here): `limit` is this machine's memory, measured by host_need; more ranks and offloading do
    not shrink it (they share the machine), a smaller Qwen3 (policy and the models of its shape) may."""
    host_ranks = [] if host else [(f"torchrun --nproc-per-node {n}" if n <= 8 else
                                   f"torchrun --nnodes {n // 8} --nproc-per-node 8", dict(ranks=n))
                                  for n in (2, 4, 8, 16, 32, 64) if n > setup.ranks]
    offload = [] if setup.offload or host else [("--offload-optimizer", dict(offload=True))]
    budgets = sorted({t for t in (2 ** 16, 2 ** 15, 2 ** 14, 2 ** 13, 2 ** 12, setup.sequence)
                      if setup.sequence <= t < setup.tokens}, reverse=True)
    tokens = [(f"--micro-batch-tokens {t}", dict(tokens=t, rows=0)) for t in budgets]
    policy = setup.models[0][1]  # smaller Qwen3 critics, largest first, for a Qwen3 policy (they share its tokenizer)
    own_critic = any(role == "critic" and shape == policy for role, shape, *_ in setup.models)
    critics = [(f"--critic-model {name}-Base", dict(models=tuple(
        (role, Shape(*dims) if role == "critic" else shape, head, train) for role, shape, head, train in setup.models)))
        for name, dims in reversed(QWEN3.items()) if own_critic and dims[6] == policy.vocab and dims[0] < policy.hidden]
    checkpointing = [] if setup.checkpointing else [("--gradient-checkpointing", dict(checkpointing=True))]
    sizes = [(f"--model {name}-Base", dict(models=tuple((role, Shape(*dims) if shape == policy else shape, head, train)
                                                         for role, shape, head, train in setup.models)))
             for name, dims in reversed(QWEN3.items()) if host and Shape(*dims).parameters() < policy.parameters()]
    groups = [group for group in (host_ranks, offload, sizes, tokens, critics, checkpointing) if group]
    need = (lambda changed: host_need(changed, *host)) if host else (lambda changed: peak(plan(changed)))
    found, fitting = [], set()
    for size in (1, 2, 3):
        for combination in itertools.combinations(groups, size):
            for index, choice in enumerate(itertools.product(*combination)):
                texts = [text for text, _ in choice]
                changes = {key: value for _, change in choice for key, value in change.items()}
                if not fitting & set(texts) and need(dataclasses.replace(setup, **changes)) <= limit:
                    found.append(" ".join(texts))  # alone: it and the larger changes of its kind leave the mixes
                    fitting |= {text for text, _ in combination[0][index:]} if size == 1 else set()
                    break
        if len(found) >= 4 or found and size > 1:
            break
    return found[:4]


def setup_for(args, device, gpu_bytes):
    """(Setup, None) for a trainer's parsed args, or (None, why not). gpu_bytes: the GPU's memory (0: a CPU run)."""
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
        args.generator == "vllm" or not device.startswith("cuda") or importlib.util.find_spec("vllm") is not None)
    share = args.gpu_memory_utilization * gpu_bytes if vllm else 0.0
    if not gpu_bytes and args.generator == "vllm":  # vLLM's CPU build: a KV cache of --vllm-kv-cache-gib
        vllm, share = True, args.vllm_kv_cache_gib * GIB
    rows = 0 if args.micro_batch_tokens else args.micro_batch_size
    float32 = args.dtype == "float32" or args.dtype == "auto" and not gpu_bytes  # auto: float32 on CPU
    return Setup(tuple(models), dist.world_size(), args.offload_optimizer, tokens, sequence,
                 args.gradient_checkpointing, 4 if float32 else 2, "vllm" if vllm else "hf", share, not gpu_bytes,
                 rows), None


def check(args, trainer_file, device):
    """Print the plan at the start of a real-model run (the tiny model: only with --gpu-memory-gib) and refuse one
    that does not fit: a peak above the GPU (--gpu-memory-gib, else the free memory of the CUDA device), or above
    this machine's available memory (host_refusal: a CPU run, or the host column on a GPU)."""
    from infra.tiny import is_tiny_model
    if is_tiny_model(args.model) and not args.gpu_memory_gib:
        return
    import torch
    free, total = torch.cuda.mem_get_info(device) if device.startswith("cuda") else (0, 0)
    limit, total = (args.gpu_memory_gib * GIB,) * 2 if args.gpu_memory_gib else (free, total)
    setup, why = setup_for(args, device, total)
    if setup is None:
        return print(f"memory plan: skipped, {why}")
    available = host_memory()[0]
    target = f"{limit / GIB:.1f} GiB GPU" if limit else f"CPU, {available / GIB:.1f} GiB available"
    rows = plan(setup)
    print(table(rows, f"memory plan per {'GPU' if limit else 'process'}, {os.path.basename(trainer_file)}, "
                      f"{setup.ranks} process{'es' * (setup.ranks > 1)}, {target}"))
    if limit and peak(rows) > limit:
        found = fitting_flags(setup, limit)
        source = "--gpu-memory-gib" if args.gpu_memory_gib else f"free on {device}"
        advice = ("it fits with " + ", or with ".join(found)) if found else (
            "no mix of more ranks, --offload-optimizer, a smaller --micro-batch-tokens or --critic-model fits")
        raise UserError(f"the memory plan needs {peak(rows) / GIB:.1f} GiB per GPU, more than the {limit / GIB:.1f} "
                        f"GiB {source}: {advice}")
    if limit and not device.startswith("cuda"):  # --gpu-memory-gib off a GPU: a plan for another machine
        return
    refusal = host_refusal(setup, available, not limit, int(os.environ.get("LOCAL_WORLD_SIZE", setup.ranks)))
    if refusal:
        raise UserError(refusal)


def host_refusal(setup, available, cpu, ranks_here=1):
    """The one-line refusal of a plan whose host_need exceeds this machine's `available` bytes, or None. Available,
    not total, memory: as on a GPU (its free memory), what the other processes leave is what this run can have; a
    plan above it swaps or is killed by the kernel after the model has loaded."""
    need = host_need(setup, cpu, ranks_here)
    if need <= available:
        return None
    found = fitting_flags(setup, available, (cpu, ranks_here))
    advice = ("it fits with " + ", or with ".join(found)) if found else \
        "no smaller Qwen3 --model, --micro-batch-tokens or --critic-model fits"
    what = "a CPU run: every column" if cpu else f"the host column of {ranks_here} process{'es' * (ranks_here > 1)}"
    return f"the memory plan needs {need / GIB:.1f} GiB of this machine's memory ({what}), more than the " \
           f"{available / GIB:.1f} GiB available: {advice}"


def gpus_needed(method, shape, offload, tokens, gpu_gib=80, utilization=0.3, sequence=PROMPT_TOKENS + 8192, rows=0):
    """(fewest ranks of 1, 2, 4 ... 64 that fit GPUs of gpu_gib, host bytes per rank) or (None, 0); else defaults.
    rows: sequences per micro-batch (0: packed by tokens)."""
    knobs = trainer_defaults(method)  # a critic: --critic-model; a reference: a published --kl-coef > 0 (spo)
    models = [("policy", shape, 0, True)] + [("critic", shape, 1, True)] * ("critic_model" in knobs) + \
        [("reference", shape, 0, False)] * (knobs.get("kl_coef", 0) > 0)
    for ranks in (1, 2, 4, 8, 16, 32, 64):
        lines = plan(Setup(tuple(models), ranks, offload, tokens, sequence, engine_bytes=utilization * gpu_gib * GIB,
                           rows=rows))
        if peak(lines) <= gpu_gib * GIB:
            return ranks, sum(line[4] for line in lines)
    return None, 0


def scaling_table(gpu_gib=80, budgets=(16384, 8 * (PROMPT_TOKENS + 8192))):
    """Markdown: per method and Qwen3 size, GPUs needed at each micro-batch token budget, without and with offload;
    the last budget is the default micro-batch of 8 sequences."""
    lines = ["| method | model | " + " | ".join(f"{t:,} tokens: {gpu_gib:g} GiB GPUs | offloaded: GPUs (host per GPU)"
                                              for t in budgets) + " |", "|---|---|" + "---:|---:|" * len(budgets)]
    for method, name in itertools.product(trainers(), ("0.6B", "4B", "8B")):  # every trainer file, forks too
        cells = []
        for tokens in budgets:
            rows = 8 if tokens == budgets[-1] else 0
            plain, (offloaded, host) = (gpus_needed(method, Shape(*QWEN3["Qwen3-" + name]), offload, tokens, gpu_gib,
                                                    rows=rows) for offload in (False, True))
            cells += [f"{plain[0] or '> 64'}", f"{offloaded} ({host / GIB:.0f} GiB)" if offloaded else "> 64"]
        lines.append(f"| `{method}.py` | Qwen3-{name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m infra.memory --table [--gpu-memory-gib 80]
    if sys.argv[1:2] != ["--table"]:
        sys.exit("usage: python -m infra.memory --table [--gpu-memory-gib G]")
    print(scaling_table(float(sys.argv[3]) if sys.argv[2:3] == ["--gpu-memory-gib"] else 80))


def keep_freed_host_memory():
    """Let glibc keep freed blocks for reuse instead of handing each large one back to the OS: by default a block
    over its mmap threshold (at most 32 MiB) is mapped for each tensor and unmapped when freed, so every update
    page-faults its large tensors in again (a Qwen3-0.6B-shaped model's [vocabulary x hidden] gradients, 0.6 GB each).
    On one CPU thread a 4-layer Qwen3-0.6B-shaped update step took 15-18 s without this, 8.6-9.7 s with it
    (benchmarks/bench_update.py). Returns whether it was set (False off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's mallopt parameters (malloc.h)
    return bool(libc.mallopt(m_mmap_threshold, GIB)) and bool(libc.mallopt(m_trim_threshold, 2 ** 31 - 1))
