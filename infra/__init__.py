"""Plumbing the trainers share and a reader of a method file may skip: each module owns one concern.

    cli.py         the command line: RunArgs (the run flags every trainer shares), the CPU demo's preset, parsing,
                   and the trainers found at the repository root (forks included)
    checks.py      checks of the flags (unknown ones, ranges, device, output folder, optional packages), each refused
                   in one line that names the flag and what to do
    run.py         Run: the loop's plumbing (evaluation schedule, checkpoints, stopping), run_main
    stop.py        Ctrl-C / SIGTERM: stop at the next safe point (no update of the step begun) or after the step, with
                   a checkpoint of the steps done; a second signal stops at once
    threads.py     torch's CPU threads, chosen as a run starts from the cores other work leaves free (or --threads,
                   OMP_NUM_THREADS)
    resume.py      the run folder's name, clashes with an existing run, --resume with the saved settings, the summary
    log.py         config.json, metrics.jsonl, the step line, TensorBoard / W&B
    samples.py     samples.jsonl (what the model wrote) and the responses printed after each evaluation
    progress.py    progress inside a long step (generation, update), on a terminal or in a log
    plot.py        learning curves of runs side by side (python -m infra.plot runs/...)
    dist.py        torchrun and FSDP2: ranks, collectives, sharding
    memory.py      the memory plan at a run's start: printed, checked (refused in one line), vLLM's GPU share;
                   the README's table of GPUs per method (python -m infra.memory --table)
    memory_plan.py the memory plan's arithmetic: bytes per component from config.json, the method and the flags
    data.py        datasets (files in plain, verl or slime layout, hub ids, the built-in task), each row's answer
                   format, and the order of training rows
    tiny.py        the built-in task and the built-in tiny model
    engine.py      the Hugging Face rollout engine, and the choice of engine
    hub.py         where a --model or a hub dataset comes from (local folder, Hugging Face cache, hub, the built-in
                   model's folder), checked before it loads; python -m infra.hub writes hub datasets as local files
    gguf_model.py  real models shipped as GGUF files in pip packages (smollm2-135m-instruct), converted once
    vllm_engine.py the vLLM rollout engine (optional: vLLM is imported there only)
    verifier.py    the math-verify checker process behind common.verify
    answer_line.py DAPO's answer-line reward (verl math_dapo) behind common.verify_answer_line
    prompt_sharing.py  rows that share a prompt read it once, through a KV cache (behind common.response_forward;
                   the engine's sampling too), and the prompts' common head (a system turn, an example) once for all
    lm_head.py     the LM head and log-softmax a vocabulary slice at a time, forward and backward, behind
                   common.head_logprobs
    packing.py     micro-batches packed by padded token count, and as many on every rank, behind common.micro_batches
    evaluate.py    held-out evaluation (avg@n, pass@k) and rollout metrics
    probes.py      critic diagnostics against Monte Carlo values
    checkpoint.py  checkpoints (sharded and Hugging Face format) and exact resume

Layers, imports pointing down only (tests/test_layers.py reads every import, those inside functions too):

    method files (ppo.py, ...)   may import anything below
    infra, above common.py       every module not in BELOW_COMMON: may import common.py and any infra module
    common.py                    what a reader of a method file opens: imports only BELOW_COMMON (and this package)
    infra, below common.py       BELOW_COMMON: import neither common.py nor a module above it, nor a method file
"""
BELOW_COMMON = ("dist", "verifier", "answer_line", "hub", "gguf_model",  # with this package itself (UserError)
                "prompt_sharing", "lm_head", "packing")


class UserError(Exception):
    """Bad input from the user (flags, data, paths): printed as one line, no traceback."""
