"""Where a trainer's run spends its time: CPU and wall seconds of each phase (evaluation, rollout sampling, old
log-probs, update, checkpoint, the rest), summed over the run, beside the load average.

    OMP_NUM_THREADS=1 python benchmarks/phase_times.py grpo.py --model smollm2-135m-instruct --dataset builtin:words \
        --prompts-per-step 8 --samples-per-prompt 8 --max-response-tokens 64 --lr 2e-5 --steps 12 \
        --eval-datasets builtin --eval-problems 64 --eval-n 2 --eval-temperature 1.0 --eval-top-p 1.0 \
        --eval-max-tokens 64 --eval-every 4 --no-gradient-checkpointing --micro-batch-tokens 2048 --save-every 0

Runs the trainer file's main() in this process with the flags given, unchanged, and times the calls it makes:
infra.run.Run.evaluate (held-out evaluation), HFGenerator.generate outside it (rollouts; SPO's Monte Carlo values
too), common.batched (old log-probs and reference or critic passes without gradients), Run.save (checkpoints), and the
rest of each step (the update: forward and backward passes, optimizer steps; rewards, logging). CPU time is the
process's user + system time (time.process_time): on a shared machine it moves less with the load than wall time.
Also printed: the update's FLOPs as benchmarks/bench_update.py's update_flops counts them (every row's prompt and
response through every layer, padding included, the LM head over the response; forward + backward = 3 forwards),
summed over the policy's micro-batches computed with gradients, over the CPU time of the update and the rest of each
step: the rate to hold against benchmarks/ceiling.py's. (A group's rows share their prompt's pass and the prompts
their common head, so fewer FLOPs are executed than counted.)
The run's own records (metrics.jsonl) are written as usual; the last line printed is one JSON object of the totals.

PROFILE_UPDATE=N in the environment: torch.profiler's table (self CPU time by operation) of step N's update, from
its first forward with gradients to the end of the step.
"""
import json
import os
import runpy
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import common  # noqa: E402
from benchmarks.bench_update import update_flops  # noqa: E402
import infra.engine  # noqa: E402
import infra.run  # noqa: E402

TOTALS = defaultdict(lambda: [0.0, 0.0])  # phase: [cpu seconds, wall seconds]
ACTIVE = []  # the phases being timed now: a call inside a timed phase counts in that phase (sampling inside an
# evaluation is the evaluation's)


def clocks():
    return time.process_time(), time.perf_counter()


def timed(phase, function):
    def wrapper(*args, **kwargs):
        if ACTIVE:
            return function(*args, **kwargs)
        start = clocks()
        ACTIVE.append(phase)
        try:
            return function(*args, **kwargs)
        finally:
            ACTIVE.pop()
            for clock, now in enumerate(clocks()):
                TOTALS[phase][clock] += now - start[clock]
    return wrapper


PROFILED_STEP = int(os.environ.get("PROFILE_UPDATE", -1))
PROFILER = {"step": 0, "profiler": None}


def decoder_parameters(config):
    """The decoder layers' matmul parameters (benchmarks/mfu.py's N)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    query, key_value = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return config.num_hidden_layers * (config.hidden_size * (query + 2 * key_value) + query * config.hidden_size
                                       + 3 * config.hidden_size * config.intermediate_size)


def count_update_flops(function, flops, executed):
    """Each policy micro-batch with gradients: update_flops (every row in full) into `flops`; into `executed`, what
    the passes ran: 6 x decoder parameters x the tokens of each model call (a group's prompt and the prompts' common
    head once) + the LM head over the response columns (attention not counted)."""
    def wrapper(model, batch, *args, **kwargs):
        if not torch.is_grad_enabled():
            return function(model, batch, *args, **kwargs)
        flops.append(update_flops(model.config, batch))
        if PROFILER["step"] == PROFILED_STEP and PROFILER["profiler"] is None:
            PROFILER["profiler"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            PROFILER["profiler"].__enter__()
        config, tokens = model.config, []
        hook = model.register_forward_pre_hook(lambda module, args, kwargs: tokens.append(kwargs["input_ids"].numel()),
                                               with_kwargs=True)
        try:
            return function(model, batch, *args, **kwargs)
        finally:
            hook.remove()
            executed.append(6 * decoder_parameters(config) * sum(tokens) + 6 * config.hidden_size
                            * config.vocab_size * batch.response_ids.shape[0] * (batch.response_width + 1))
    return wrapper


def end_profile(end_step):
    def wrapper(self, step, metrics):
        profiler, PROFILER["step"] = PROFILER["profiler"], step + 1
        if profiler is not None and step == PROFILED_STEP:
            profiler.__exit__(None, None, None)
            print(f"torch.profiler, step {step}'s update (forward passes with gradients to the step's end):")
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                max_name_column_width=50))
        return end_step(self, step, metrics)
    return wrapper


def main():
    if len(sys.argv) < 2 or not sys.argv[1].endswith(".py"):
        sys.exit("usage: python benchmarks/phase_times.py TRAINER.py [its flags]")
    trainer = os.path.join(ROOT, sys.argv[1]) if not os.path.isabs(sys.argv[1]) else sys.argv[1]
    infra.run.Run.evaluate = timed("evaluation", infra.run.Run.evaluate)
    infra.run.Run.save = timed("checkpoint", infra.run.Run.save)
    infra.engine.HFGenerator.generate = timed("rollout sampling", infra.engine.HFGenerator.generate)
    common.batched = timed("passes without gradients", common.batched)
    flops, executed = [], []
    common.response_logprobs = count_update_flops(common.response_logprobs, flops, executed)
    infra.run.Run.end_step = end_profile(infra.run.Run.end_step)
    first_step, steps = [], infra.run.Run.steps

    def timed_steps(self):  # the start (model loading, the run folder, the engine) ends at the loop's first step
        first_step.append(clocks())
        yield from steps(self)

    infra.run.Run.steps = timed_steps
    load, start = os.getloadavg()[0], clocks()
    sys.argv = [trainer] + sys.argv[2:]
    runpy.run_path(trainer, run_name="__main__")
    end = clocks()
    TOTALS["start (loading)"] = [first_step[0][clock] - start[clock] for clock in (0, 1)]
    TOTALS["update and the rest of each step"] = [end[clock] - first_step[0][clock] - sum(
        TOTALS[phase][clock] for phase in TOTALS if phase != "start (loading)") for clock in (0, 1)]
    TOTALS["total"] = [end[clock] - start[clock] for clock in (0, 1)]
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    for phase, (cpu, wall) in TOTALS.items():
        print(f"{phase:<34} cpu {cpu:8.1f} s   wall {wall:8.1f} s")
    update_cpu = TOTALS["update and the rest of each step"][0]
    for name, counted in (("update FLOPs (update_flops over the policy's micro-batches)", flops),
                          ("executed (decoder matmuls of each pass, LM head; no attention)", executed)):
        print(f"{name}: {sum(counted) / 1e12:.2f} TFLOP in {update_cpu:.1f} CPU s = "
              f"{sum(counted) / max(update_cpu, 1e-9) / 1e9:.1f} GFLOP/s")
    print(json.dumps({"load_before": load, "load_after": os.getloadavg()[0], "update_flops": sum(flops),
                      "executed_flops": sum(executed),
                      **{phase: {"cpu_s": cpu, "wall_s": wall} for phase, (cpu, wall) in TOTALS.items()}}))


if __name__ == "__main__":
    main()
