"""The memory plan at a run's start and in the README's table: Run.__init__ prints the plan (infra/memory_plan.py:
the arithmetic) when a real-model run starts (the tiny demo: with --gpu-memory-gib or --plan-only), planned from the
run's own prompts (their longest, tokenized), refuses in one line naming flags that fit (never more GPUs than
--gpus) a plan larger than the device or than this machine's available memory (a CPU run's whole plan; the host
column), and hands the vLLM engine its share of the GPU (auto: what the trainer leaves). --plan-only stops there:
exit 0 if it fits, 1 if not. `python -m infra.memory --table`: GPUs each method needs (docs/memory.md).
"""
import ctypes
import dataclasses
import itertools
import os
import sys

from infra import UserError, dist
from infra.cli import RunArgs, trainer_defaults, trainers
from infra.memory_plan import (CPU_BASELINE, CUDA_80GB_GIB, GIB, PROMPT_TOKENS, QWEN3, ROLLOUT_AT_ONCE, Setup,  # noqa
                               Shape, _vllm_installed, fit, optimizer_temporaries, peak, plan, read_shape, setup_for,
                               table, vllm_reserve, vllm_share)

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


def with_response(limit):
    """A change of setup: responses of at most `limit` tokens (--max-response-tokens, and --eval-max-tokens where the
    evaluation's are longer: fitting_flags names both), its sequences, micro-batches and generate calls shortened."""
    def change(setup):
        sequence = setup.prompt_tokens + limit
        tokens = setup.rows * sequence if setup.rows else setup.tokens if setup.tokens > setup.sequence else sequence
        calls, length = setup.generated
        return dataclasses.replace(setup, sequence=sequence, tokens=tokens, generated=(calls, min(length, sequence)))
    return change


def with_ranks(ranks):
    """A change of setup: `ranks` processes, each generating its share of the rollout."""
    def change(setup):
        share = lambda count: -(-count * setup.ranks // ranks)  # noqa: E731 (ceil)
        return dataclasses.replace(setup, ranks=ranks, rollout=share(setup.rollout),
                                   generated=(share(setup.generated[0]), setup.generated[1]))
    return change


def replaced(**changes):
    return lambda setup: dataclasses.replace(setup, **changes)


def fitting_flags(setup, limit, host=None, gpus=64, gpu_bytes=None, eval_tokens=0):
    """Up to 4 flag sets under which the plan fits (memory_plan.fit: its peak at most `limit` bytes, an auto vLLM
    share's KV cache at least 1/8 of the rollout), the least change of each kind: those that fit alone, then pairs (or
    triples) of changes that do not. Never more ranks than `gpus`; a micro-batch holds one sequence at least; an HF
    batch 1/8 of the rollout at least. host=(cpu, ranks_here): `limit` is this machine's memory, measured by
    host_need; more ranks and offloading do not shrink it (they share the machine), a smaller Qwen3 (policy and the
    models of its shape) may. A shorter --max-response-tokens comes with as short an --eval-max-tokens where the
    evaluation's limit (`eval_tokens`) is longer."""
    host_ranks = [] if host else [(f"torchrun --nproc-per-node {n}" if n <= 8 else
                                   f"torchrun --nnodes {n // 8} --nproc-per-node 8", with_ranks(n))
                                  for n in (2, 4, 8, 16, 32, 64) if setup.ranks < n <= gpus]
    offload = [] if setup.offload or host else [("--offload-optimizer", replaced(offload=True))]
    budgets = sorted({t for t in (2 ** 16, 2 ** 15, 2 ** 14, 2 ** 13, 2 ** 12, setup.sequence)
                      if setup.sequence <= t < setup.tokens}, reverse=True)
    tokens = [(f"--micro-batch-tokens {t}", replaced(tokens=t, rows=0)) for t in budgets]
    policy = setup.models[0][1]  # smaller Qwen3 critics, largest first, for a Qwen3 policy (they share its tokenizer)
    own_critic = any(role == "critic" and shape == policy for role, shape, *_ in setup.models)
    critics = [(f"--critic-model {name}-Base", replaced(models=tuple(
        (role, Shape(*dims) if role == "critic" else shape, head, train) for role, shape, head, train in setup.models)))
        for name, dims in reversed(QWEN3.items()) if own_critic and dims[6] == policy.vocab and dims[0] < policy.hidden]
    checkpointing = [] if setup.checkpointing else [("--gradient-checkpointing", replaced(checkpointing=True))]
    sizes = [(f"--model {name}-Base", replaced(models=tuple((role, Shape(*dims) if shape == policy else shape, head,
                                                             train) for role, shape, head, train in setup.models)))
             for name, dims in reversed(QWEN3.items()) if host and Shape(*dims).parameters() < policy.parameters()]
    hf = setup.engine == "hf" and not host and not setup.cpu
    batches = [(f"--hf-batch-size {n}", replaced(engine_batch=n)) for n in (128, 64, 32, 16, 8, 4, 2, 1)
               if hf and setup.at_once() <= n < setup.hf_rows()]  # never below the stated part of the rollout
    vllm = [("--generator vllm" + ("" if _vllm_installed() else " (pip install -r requirements-vllm.txt)"),
             replaced(engine="vllm", auto_share=True))] if hf else []
    responses = [(f"--max-response-tokens {n}" + f" --eval-max-tokens {n}" * (eval_tokens > n), with_response(n))
                 for n in (4096, 2048, 1024) if n < setup.sequence - setup.prompt_tokens]
    groups = [group for group in (host_ranks, offload, sizes, tokens, critics, checkpointing, batches, vllm, responses)
              if group]

    def fits(choice):
        changed = setup
        for _, change in choice:
            changed = change(changed)
        return host_need(changed, *host) <= limit if host else fit(changed, limit, gpu_bytes or limit)[1] is None
    found, fitting = [], set()
    for size in (1, 2, 3):
        for combination in itertools.combinations(groups, size):
            for index, choice in enumerate(itertools.product(*combination)):
                texts = [text for text, _ in choice]
                if not fitting & set(texts) and fits(choice):
                    found.append(" ".join(texts))  # alone: it and the larger changes of its kind leave the mixes
                    fitting |= {text for text, _ in combination[0][index:]} if size == 1 else set()
                    break
        if len(found) >= 4 or found and size > 1:
            break
    return found[:4]


def prompt_tokens(args, rows, local_only):
    """(tokens of the run's longest prompt, where that figure comes from): the prompts of its training steps and
    held-out sets (`rows`: training rows and {set: rows}), tokenized by --model's tokenizer (--plan-only: only one on
    disk), each as the rollout builds it; PROMPT_TOKENS, the allowance, when the data or the tokenizer is not there."""
    from infra import data
    from infra.engine import longest_prompt
    from infra.hub import resolve_model_name
    if not isinstance(rows, tuple):
        if rows:  # --plan-only: why the data is not known
            print(f"memory plan: {rows}")
        return PROMPT_TOKENS, "assumed: the data was not read"
    train, eval_sets = rows
    steps = range(args.steps) if args.steps * args.prompts_per_step < len(train) and not args.eval_only else []
    used = [row for step in steps for row in data.step_rows(train, step, args.prompts_per_step, args.seed)] \
        if steps else train * (not args.eval_only)
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_name(args.model), local_files_only=local_only,
                                                  trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        return PROMPT_TOKENS, f"assumed: no tokenizer ({type(error).__name__})"
    if not tokenizer("1 + 1", add_special_tokens=False)["input_ids"]:  # transformers 5 builds an empty one from
        return PROMPT_TOKENS, "assumed: no tokenizer files"  # a bare config.json
    return longest_prompt(tokenizer, [used, *eval_sets.values()]), "the run's longest, tokenized"


def check(args, trainer_file, device, rows=None):
    """Print the plan at the start of a real-model run (the tiny model: only with --gpu-memory-gib or --plan-only)
    and refuse one that does not fit (memory_plan.fit): a peak above the GPU (--gpu-memory-gib, else the free memory
    of the CUDA device) or an auto vLLM share whose KV cache holds less than 1/8 of the rollout; or a plan above this
    machine's available memory (host_refusal: a CPU run, or the host column on a GPU). `rows`: the run's data
    (prompt_tokens), or why it is not known. --plan-only exits here, 0 if it fits, 1 if not. Returns vLLM's share
    of the GPU for the engine: --gpu-memory-utilization, or with 0 (auto) memory_plan.vllm_share's."""
    import torch

    from infra.tiny import is_tiny_model
    free, total = torch.cuda.mem_get_info(device) if device.startswith("cuda") else (0, 0)
    limit, total = (args.gpu_memory_gib * GIB,) * 2 if args.gpu_memory_gib else (free, total)
    shown = not is_tiny_model(args.model) or bool(args.gpu_memory_gib) or args.plan_only
    if not shown and (args.gpu_memory_utilization or not total):
        return args.gpu_memory_utilization or FALLBACK_SHARE
    prompt, source = prompt_tokens(args, rows, args.plan_only)
    eval_rows = max(map(len, rows[1].values()), default=0) if isinstance(rows, tuple) else 0
    setup, why = setup_for(args, device, total, prompt, eval_rows)
    if setup is None:
        if shown:
            print(f"memory plan: skipped, {why}")
        if args.plan_only:
            sys.exit(1)
        return args.gpu_memory_utilization or FALLBACK_SHARE
    setup, problem = fit(setup, limit, total) if limit else (setup, None)
    eval_tokens = args.eval_max_tokens if args.eval_datasets else 0  # a refusal's shorter responses: evaluation's too
    lines, available = plan(setup), host_memory()[0]
    gpus = dist.world_size() if dist.distributed() else args.gpus or torch.cuda.device_count() or 1
    if shown:
        target = f"{limit / GIB:.1f} GiB GPU" if limit else f"CPU, {available / GIB:.1f} GiB available"
        print(table(lines, f"memory plan per {'GPU' if limit else 'process'}, {os.path.basename(trainer_file)}, "
                           f"{setup.ranks} process{'es' * (setup.ranks > 1)}"
                           + f" ({gpus} GPU{'s' * (gpus > 1)} here)" * bool(limit) + f", {target}"))
        print(f"prompts: {prompt:,} tokens ({source}); per rank: rollout {setup.rollout}, largest generate call "
              f"{setup.generated[0]} x {setup.generated[1]:,}")
    if problem:
        source = "--gpu-memory-gib" if args.gpu_memory_gib else f"free on {device}"
        found = fitting_flags(setup, limit, gpus=gpus, gpu_bytes=total, eval_tokens=eval_tokens)
        tried = "more ranks (--gpus), " * (gpus > setup.ranks) + "--offload-optimizer, a smaller --micro-batch-tokens" \
            + ", --hf-batch-size, --generator vllm" * (setup.engine == "hf") + ", --max-response-tokens"
        problem = f"{problem}, more than the {limit / GIB:.1f} GiB {source}" if "needs" in problem else problem
        problem += ": it fits with " + ", or with ".join(found) if found else f": no mix of {tried} fits"
    elif limit and setup.engine == "vllm" and setup.auto_share and shown:
        share, kv = setup.engine_bytes / total, vllm_share(setup, total)[1]
        print(f"vLLM share: {share:.2f} of the GPU (--gpu-memory-utilization 0: auto), a KV cache of {kv / GIB:.1f} "
              f"GiB, {int(kv // setup.models[0][1].kv_bytes(setup.sequence))} sequences of {setup.sequence:,} tokens "
              f"at once (1/{ROLLOUT_AT_ONCE} of this rank's rollout: {setup.at_once()})")
    other_gpu = limit and not device.startswith("cuda")  # --gpu-memory-gib off a GPU: a plan for another GPU
    if not problem and shown and not other_gpu:
        problem = host_refusal(setup, available, not limit, int(os.environ.get("LOCAL_WORLD_SIZE", setup.ranks)),
                               eval_tokens)
    if args.plan_only:
        where = f"GPU of {limit / GIB:.1f}" if limit else "process"
        print(problem or f"fits: {peak(lines) / GIB:.1f} GiB per {where}, host memory "
                         f"{host_need(setup, not limit, 1) / GIB:.1f} GiB per process")
        sys.exit(1 if problem else 0)
    if problem:
        raise UserError(problem)
    share = setup.engine_bytes / total if setup.auto_share and total else None
    return args.gpu_memory_utilization or share or FALLBACK_SHARE


def check_share(setup, gpu_bytes):
    """Refuse (one line) an auto vLLM share whose KV cache holds less than 1/8 of the rollout (memory_plan.fit);
    else (share, KV cache bytes)."""
    problem = fit(dataclasses.replace(setup, auto_share=True), float("inf"), gpu_bytes)[1]  # the KV cache alone
    if problem:
        raise UserError(problem)
    return vllm_share(setup, gpu_bytes)


def host_refusal(setup, available, cpu, ranks_here=1, eval_tokens=0):
    """The one-line refusal of a plan whose host_need exceeds this machine's `available` bytes, or None. Available,
    not total, memory: as on a GPU (its free memory), what the other processes leave is what this run can have; a
    plan above it swaps or is killed by the kernel after the model has loaded."""
    need = host_need(setup, cpu, ranks_here)
    if need <= available:
        return None
    found = fitting_flags(setup, available, (cpu, ranks_here), eval_tokens=eval_tokens)
    advice = ("it fits with " + ", or with ".join(found)) if found else \
        "no smaller Qwen3 --model, --micro-batch-tokens, --critic-model or --max-response-tokens fits"
    what = "a CPU run: every column" if cpu else f"the host column of {ranks_here} process{'es' * (ranks_here > 1)}"
    return f"the memory plan needs {need / GIB:.1f} GiB of this machine's memory ({what}), more than the " \
           f"{available / GIB:.1f} GiB available: {advice}"


def gpus_needed(method, shape, offload=False, gpu_gib=CUDA_80GB_GIB, tokens=0, utilization=None, rows=0):
    """(fewest ranks of 1, 2, 4 ... 64 whose plan fits GPUs of gpu_gib, host bytes per rank) or (None, 0) for the
    method's defaults (its models, rollout and --max-response-tokens; RunArgs' micro-batch and vLLM share) with the
    changes given: tokens per micro-batch, or `rows` sequences of the longest length; a vLLM share (0: auto)."""
    knobs, run = trainer_defaults(method), RunArgs()  # a critic: --critic-model; a reference: --kl-coef > 0 (spo)
    prm = "prm_lr" in knobs  # prime: an implicit PRM, trained, and its frozen reference
    models = ((("policy", shape, 0, True),) + (("critic", shape, 1, True),) * ("critic_model" in knobs) +
              (("implicit PRM", shape, 0, True),) * prm + (("reference", shape, 0, False),) * (
                  knobs.get("kl_coef", 0) > 0 or prm))
    sequence = PROMPT_TOKENS + knobs.get("max_response_tokens", 8192)
    tokens = rows * sequence if rows else tokens or max(run.micro_batch_tokens, sequence)
    utilization, gpu = run.gpu_memory_utilization if utilization is None else utilization, gpu_gib * GIB
    calls = knobs.get("prompts_per_step", 64) * knobs.get("samples_per_prompt", 8)  # trained on; prime samples more
    for ranks in (1, 2, 4, 8, 16, 32, 64):
        generated = (calls * knobs.get("oversample", 1) // ranks, sequence)
        setup = Setup(models, ranks, offload, tokens, sequence, rows=rows, generated=generated,
                      engine_bytes=utilization * gpu, auto_share=not utilization, rollout=calls // ranks)
        setup, problem = fit(setup, gpu, gpu)
        if problem is None:
            return ranks, sum(line[4] for line in plan(setup))
    return None, 0


def scaling_table(gpu_gib=CUDA_80GB_GIB):
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


if __name__ == "__main__":  # python -m infra.memory --table [--gpu-memory-gib 79.11]
    if sys.argv[1:2] != ["--table"]:
        sys.exit("usage: python -m infra.memory --table [--gpu-memory-gib G]")
    print(scaling_table(float(sys.argv[3]) if sys.argv[2:3] == ["--gpu-memory-gib"] else CUDA_80GB_GIB))
