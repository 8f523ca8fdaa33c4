"""The memory plan at a run's start and in the README's table: Run.__init__ prints the plan (infra/memory_plan.py:
the arithmetic) when a real-model run starts (the tiny demo: with --gpu-memory-gib), refuses in one line naming
flags that fit a plan larger than the device or than this machine's available memory (a CPU run's whole plan; the
host column), and hands the vLLM engine its share of the GPU (auto: what the trainer leaves). `python -m
infra.memory --table`: GPUs each method needs, at the defaults and at other settings (docs/scaling.md).
"""
import ctypes
import dataclasses
import itertools
import os
import sys

from infra import UserError
from infra.cli import RunArgs, trainer_defaults, trainers
from infra.memory_plan import (CPU_BASELINE, GIB, PROMPT_TOKENS, QWEN3, Setup, Shape, peak, plan, read_shape,  # noqa
                               setup_for, table, vllm_share)

FALLBACK_SHARE = 0.3  # vLLM's share where no plan sizes it (a CPU run, an architecture the plan does not know)


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


def check(args, trainer_file, device):
    """Print the plan at the start of a real-model run (the tiny model: only with --gpu-memory-gib) and refuse one
    that does not fit: a peak above the GPU (--gpu-memory-gib, else the free memory of the CUDA device), an auto vLLM
    share whose KV cache holds less than one full-length sequence, or a plan above this machine's available memory
    (host_refusal: a CPU run, or the host column on a GPU). Returns vLLM's share of the GPU for the engine:
    --gpu-memory-utilization, or with 0 (auto) memory_plan.vllm_share's."""
    import torch

    from infra.tiny import is_tiny_model
    free, total = torch.cuda.mem_get_info(device) if device.startswith("cuda") else (0, 0)
    limit, total = (args.gpu_memory_gib * GIB,) * 2 if args.gpu_memory_gib else (free, total)
    shown = not is_tiny_model(args.model) or bool(args.gpu_memory_gib)
    if not shown and (args.gpu_memory_utilization or not total):
        return args.gpu_memory_utilization or FALLBACK_SHARE
    setup, why = setup_for(args, device, total)
    if setup is None:
        if shown:
            print(f"memory plan: skipped, {why}")
        return args.gpu_memory_utilization or FALLBACK_SHARE
    rows, available = plan(setup), host_memory()[0]
    if shown:
        target = f"{limit / GIB:.1f} GiB GPU" if limit else f"CPU, {available / GIB:.1f} GiB available"
        print(table(rows, f"memory plan per {'GPU' if limit else 'process'}, {os.path.basename(trainer_file)}, "
                          f"{setup.ranks} process{'es' * (setup.ranks > 1)}, {target}"))
    if limit and peak(rows) > limit:
        found = fitting_flags(setup, limit)
        source = "--gpu-memory-gib" if args.gpu_memory_gib else f"free on {device}"
        advice = ("it fits with " + ", or with ".join(found)) if found else (
            "no mix of more ranks, --offload-optimizer, a smaller --micro-batch-tokens or --critic-model fits")
        raise UserError(f"the memory plan needs {peak(rows) / GIB:.1f} GiB per GPU, more than the {limit / GIB:.1f} "
                        f"GiB {source}: {advice}")
    auto = bool(total) and setup.engine == "vllm" and not args.gpu_memory_utilization
    if auto:
        check_share(setup, total, shown)
    share = args.gpu_memory_utilization or (setup.engine_bytes / total if auto else FALLBACK_SHARE)
    if not shown or limit and not device.startswith("cuda"):  # --gpu-memory-gib off a GPU: a plan for another GPU
        return share
    refusal = host_refusal(setup, available, not limit, int(os.environ.get("LOCAL_WORLD_SIZE", setup.ranks)))
    if refusal:
        raise UserError(refusal)
    return share


def check_share(setup, gpu_bytes, shown=True):
    """Refuse (one line, naming the numbers) an auto vLLM share whose KV cache holds less than one full-length
    sequence; else print (when `shown`) the share and the sequences its KV cache holds."""
    share, kv = vllm_share(setup, gpu_bytes)
    need = setup.models[0][1].kv_bytes(setup.sequence)
    if kv < need:
        raise UserError(f"the memory plan leaves vLLM {max(share, 0):.2f} of the {gpu_bytes / GIB:.1f} GiB GPU, a KV "
                        f"cache of {max(kv, 0) / GIB:.1f} GiB, less than one {setup.sequence:,}-token sequence needs "
                        f"({need / GIB:.2f} GiB): use more ranks (torchrun), --offload-optimizer or a smaller "
                        "--max-response-tokens, or give --gpu-memory-utilization")
    if shown:
        print(f"vLLM share: {share:.2f} of the GPU (--gpu-memory-utilization 0: auto), a KV cache of {kv / GIB:.1f} "
              f"GiB, {int(kv // need)} sequences of {setup.sequence:,} tokens")


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


def gpus_needed(method, shape, offload=False, gpu_gib=80, tokens=0, utilization=None, rows=0):
    """(fewest ranks of 1, 2, 4 ... 64 whose plan fits GPUs of gpu_gib, host bytes per rank) or (None, 0) for the
    method's defaults (its models and --max-response-tokens; RunArgs' micro-batch and vLLM share) with the changes
    given: tokens per micro-batch, or `rows` sequences of the longest length; a vLLM share (0: auto)."""
    knobs, run = trainer_defaults(method), RunArgs()  # a critic: --critic-model; a reference: --kl-coef > 0 (spo)
    models = ((("policy", shape, 0, True),) + (("critic", shape, 1, True),) * ("critic_model" in knobs) +
              (("reference", shape, 0, False),) * (knobs.get("kl_coef", 0) > 0))
    sequence = PROMPT_TOKENS + knobs.get("max_response_tokens", 8192)
    tokens = rows * sequence if rows else tokens or max(run.micro_batch_tokens, sequence)
    utilization, gpu = run.gpu_memory_utilization if utilization is None else utilization, gpu_gib * GIB
    for ranks in (1, 2, 4, 8, 16, 32, 64):
        setup = Setup(models, ranks, offload, tokens, sequence, rows=rows)
        share, kv = (utilization, gpu) if utilization else vllm_share(setup, gpu)
        lines = plan(dataclasses.replace(setup, engine_bytes=share * gpu))
        if kv >= shape.kv_bytes(sequence) and peak(lines) <= gpu:
            return ranks, sum(line[4] for line in lines)
    return None, 0


def scaling_table(gpu_gib=80):
    """Markdown: per method and Qwen3 size, the GPUs of gpu_gib needed at the defaults (what a run gets without
    flags) and with micro-batches of 8 full-length sequences and vLLM at 0.3 (the defaults before issue 39), each
    without and with --offload-optimizer (then the host memory per GPU)."""
    settings = (("at the defaults", {}), ("8 sequences per micro-batch, vLLM 0.3", dict(rows=8, utilization=0.3)))
    lines = ["| method | model | " + " | ".join(f"{name}: {gpu_gib:g} GiB GPUs | offloaded: GPUs (host per GPU)"
                                              for name, _ in settings) + " |", "|---|---|" + "---:|---:|" * 2]
    for method, name in itertools.product(trainers(), ("0.6B", "4B", "8B")):  # every trainer file, forks too
        cells = []
        for _, changes in settings:
            plain, (offloaded, host) = (gpus_needed(method, Shape(*QWEN3["Qwen3-" + name]), offload, gpu_gib,
                                                    **changes) for offload in (False, True))
            cells += [f"{plain[0] or '> 64'}", f"{offloaded} ({host / GIB:.0f} GiB)" if offloaded else "> 64"]
        lines.append(f"| `{method}.py` | Qwen3-{name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


if __name__ == "__main__":  # python -m infra.memory --table [--gpu-memory-gib 80]
    if sys.argv[1:2] != ["--table"]:
        sys.exit("usage: python -m infra.memory --table [--gpu-memory-gib G]")
    print(scaling_table(float(sys.argv[3]) if sys.argv[2:3] == ["--gpu-memory-gib"] else 80))
