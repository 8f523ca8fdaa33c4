"""Step time of grpo.py against TRL's GRPOTrainer on the same work, runs alternated, the ratio TRL / project.

    pip install trl==1.16.0          # optional; in its own venv if it conflicts: --trl-python that venv's python
    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py                    # 10 pairs of runs, 12 rollouts each
    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py --trl-python <a venv with trl>/bin/python
    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py --shape qwen3-0.6b --layers 2 --max-tokens 64 --pairs 2 \
        --rollouts 1 --warmup 0 --trl-python <a venv with trl>/bin/python       # real widths (docs/scaling.md)

    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py --model smollm2-135m-instruct --trl-python <venv>/bin/python \
        --vllm-python <vLLM venv>/bin/python       # a real model: tokens/s of rollout and update, five sides

--model smollm2-135m-instruct: the real model (infra/gguf_model.py), 8 prompts of 1-digit additions (`builtin:1`,
the project's boxed instruction in the model's chat template, the same user message on both sides) x 4 samples of at
most --max-tokens (64) response tokens, one optimizer step per rollout of 4 micro-batches of 8 rows, no gradient
checkpointing. The model stops at <|im_end|>, so responses differ in length between runs: each side reports tokens
per second (response tokens over the rollout's seconds, and over the update's), run by run: the project with the HF
engine in float32 and in bf16 autocast (`--dtype bfloat16`), the project with vLLM's CPU build (--vllm-python), TRL
in float32 and with bf16 autocast (`bf16=True` over float32 weights). One run per side (--pairs repeats them).

--shape qwen3-0.6b: a random model of Qwen3-0.6B's shape (--layers of its 28), saved once with save_pretrained beside
the built-in tokenizer and loaded by both sides with from_pretrained; 8 prompts x 4 samples, --max-tokens response
tokens (it never stops), one optimizer step per rollout, bf16 on both: the project in autocast over float32 weights
with the engine's old log-probs and micro-batches of 8 rows (REHEARSAL_PROJECT_ARGS), TRL with bf16 weights
(--trl-dtype), micro-batches of 8. TRL's rollout time (its _generate_and_score_completions) is printed too.
The rest of this docstring describes the default, --shape tiny:

The same work on both sides: the built-in tiny model (float32, loaded by from_pretrained), 16 prompts of the 3-digit
built-in task (`builtin:3`, about 37 tokens per response) x 8 samples per rollout, at most 48 response tokens,
sampling at temperature 1 (top-p 1, top-k off), reward = the project's verifier (common.score; 0 for a response cut
at the limit), group-normalized advantages, PPO-clip 0.2, token-mean loss, no reference model (beta 0), AdamW lr
1e-4 (constant), weight decay 0.01, grad clip 1.0, two optimizer steps of 64 samples per rollout, no gradient
checkpointing, no dropout, one torch thread per process.
What is not identical: the prompts each side draws (both from the built-in training set); the micro-batches (the
project: up to 1,600 padded tokens per forward/backward, `--micro-batch-tokens 1600`, about 30 of these rows,
gradients accumulated to 64; with its CPU preset's 16 rows the update took about 10% longer here; TRL: 64 per
forward, its per_device_train_batch_size, or --trl-micro-batch: 16 and 32 were not measurably faster); the old
log-probs (the project reuses its engine's, equal up to float noise; TRL recomputes them); TRL's logging (every 10
steps, its default; the project logs every step); and what each computes beyond the loss (TRL: entropies, clip
ratios; the project: clip fraction, approx KL, rollout metrics).

Each run is its own process; a pair runs one of each, the order alternating between pairs. The step time of a run
is the median over its rollouts after `--warmup` (one rollout and its two optimizer steps; TRL: the time between
every second optimizer step's end; the project: between the ends of its steps), in wall-clock time and in the
process's CPU time (less sensitive to other processes on a shared machine). The ratio is computed per pair;
printed: its median and its min-max over the pairs. The project's own rollout / update split comes from its
logged rollout_s and update_s (the rest: old log-probs when recomputed, advantages, logging).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LR = 1e-4
# The work per rollout of each --shape: prompts x samples, response tokens (a random model never stops: all run to
# the limit), optimizer steps per rollout; --max-tokens replaces the response length.
WORK = {"tiny": dict(prompts=16, samples=8, max_tokens=48, mini_batches=2),
        "qwen3-0.6b": dict(prompts=8, samples=4, max_tokens=1024, mini_batches=1),
        "smollm2-135m-instruct": dict(prompts=8, samples=4, max_tokens=64, mini_batches=1, real=True)}
# 8 rows per forward/backward, as TRL's side. --gpu-memory-gib 80: the memory plan of this session planned 1,024
# prompt tokens per row and refused the run on a busy machine (a CPU run then skips the host check)
REAL_PROJECT_ARGS = "--micro-batch-size 8 --micro-batch-tokens 0 --gpu-memory-gib 80"
REAL_SIDES = [("project", "hf, float32", "--dtype float32"), ("project", "hf, bf16 autocast", "--dtype bfloat16"),
              ("vllm", "vLLM CPU, float32", "--generator vllm --dtype float32"), ("trl", "TRL, float32", "float32"),
              ("trl", "TRL, bf16 autocast", "bfloat16")]


def save_rehearsal_model(layers, directory):
    """A randomly initialized model of Qwen3-0.6B's shape (bench_update.QWEN3_0_6B_SHAPE, `layers` decoder layers),
    float32, saved with save_pretrained beside the built-in tokenizer, so that both sides load it by from_pretrained."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from transformers import AutoTokenizer
    from bench_update import build_model
    from infra.tiny import tiny_model_path
    build_model("qwen3-0.6b-shape", "cpu", "float32", layers).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_path()).save_pretrained(directory)


REHEARSAL_PROJECT_ARGS = "--dtype bfloat16 --old-logprobs engine --micro-batch-size 8"


def project_side(rollouts, seed, extra, work, model="tiny"):
    """Run grpo.py in this process; print one JSON line: per-rollout seconds and the logged phases."""
    sys.path.insert(0, ROOT)
    import torch
    torch.set_num_threads(1)
    import grpo
    import infra.run
    ends, cpu_ends, phases, end_step = [], [], [], infra.run.Run.end_step

    def timed_end_step(self, step, metrics):
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())
        phases.append((metrics["rollout_s"], metrics["update_s"],
                       metrics["response_length"] * work["prompts"] * work["samples"]))
        return end_step(self, step, metrics)

    infra.run.Run.end_step = timed_end_step
    real = work.get("real", False)
    with tempfile.TemporaryDirectory() as output_dir:
        sys.argv = ["grpo.py", "--model", model, "--steps", str(rollouts + 1), "--seed", str(seed),
                    "--prompts-per-step", str(work["prompts"]), "--samples-per-prompt", str(work["samples"]),
                    "--max-response-tokens", str(work["max_tokens"]), "--lr", str(LR),
                    "--mini-batches", str(work["mini_batches"]),
                    "--aggregation", "token-mean", "--kl-coef", "0",
                    "--no-gradient-checkpointing", "--eval-problems", "8", "--eval-every", "0", "--save-every", "0",
                    "--dataset", "builtin:1" if real else "builtin:3", "--output-dir", output_dir,
                    *([] if model == "tiny" else ["--eval-n", "1", "--eval-max-tokens", "8"]),
                    *(["--eval-datasets", "builtin", "--eval-problems", "2"] if real else []), *extra]  # (untimed)
        grpo.main()
    print(json.dumps(dict(seconds=differences(ends), cpu_seconds=differences(cpu_ends),
                          rollout=[p[0] for p in phases[1:]], update=[p[1] for p in phases[1:]],
                          rollout_tokens_per_s=[p[2] / p[0] for p in phases[1:]],
                          update_tokens_per_s=[p[2] / p[1] for p in phases[1:]])))


def trl_side(rollouts, seed, micro_batch, work, model_path="", dtype="float32"):
    """Run TRL's GRPOTrainer with the matching settings in this process; print one JSON line of per-rollout
    seconds. model_path: the rehearsal model (default: the built-in tiny one); dtype: its weights' (bfloat16: pure
    bf16, TRL's fastest on CPU) or float32 (float32 with bf16 autocast in the loss when model_path is given)."""
    prompts, samples, max_tokens, mini_batches = (work[k] for k in ("prompts", "samples", "max_tokens", "mini_batches"))
    sys.path.insert(0, ROOT)
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import common
    from infra.tiny import builtin_rows, tiny_model_path
    real = work.get("real", False)
    path = model_path or tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # a real model: float32 weights, bf16 autocast in TRL's forward passes with dtype bfloat16 (its bf16=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if real else getattr(torch, dtype))
    rows = builtin_rows("train", prompts * (rollouts + 2), seed, digits=1 if real else 3)
    dataset = Dataset.from_list([{  # a chat model: grpo.py's user message, in its chat template (TRL applies it)
        "prompt": [{"role": "user", "content": f"{row['question']}\n{common.INSTRUCTION}"}] if real else
        common.plain_prompt(row["question"]), "answer": row["answer"]} for row in rows])
    tokens = []  # response tokens of each rollout

    def reward(completions, completion_ids, answer, **_):  # 0 for a response cut at the length limit, as grpo.py
        tokens.append(sum(len(ids) for ids in completion_ids))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [common.score(text, {"answer": gold}) if tokenizer.eos_token_id in ids else 0.0
                for text, ids, gold in zip(texts, completion_ids, answer)]

    ends, cpu_ends, generation = [], [], []
    generate_and_score = GRPOTrainer._generate_and_score_completions

    def timed_generate_and_score(self, *arguments, **kwargs):  # the rollout: sampling, rewards, advantages
        start = time.perf_counter()
        out = generate_and_score(self, *arguments, **kwargs)
        generation.append(time.perf_counter() - start)
        return out

    GRPOTrainer._generate_and_score_completions = timed_generate_and_score

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    accumulation = prompts * samples // mini_batches // micro_batch  # micro-batches per optimizer step
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=dtype == "bfloat16" if real else bool(model_path), seed=seed,
            report_to="none", save_strategy="no",
            disable_tqdm=True, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
            steps_per_generation=mini_batches * accumulation, num_generations=samples,
            num_iterations=1, max_completion_length=max_tokens, temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_beta1=0.9,
            adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
            scale_rewards="group", gradient_checkpointing=False, max_steps=mini_batches * (rollouts + 1),
            dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        trainer.train()
    last = slice(mini_batches - 1, None, mini_batches)  # the end of each rollout's last optimizer step
    seconds, rollout = differences(ends[last]), generation[1:len(ends[last])]
    update = [total - sampling for total, sampling in zip(seconds, rollout)]
    print(json.dumps(dict(seconds=seconds, cpu_seconds=differences(cpu_ends[last]), rollout=rollout,
                          update=update, rollout_tokens_per_s=[n / t for n, t in zip(tokens[1:], rollout)],
                          update_tokens_per_s=[n / t for n, t in zip(tokens[1:], update)])))


def differences(times):
    return [b - a for a, b in zip(times, times[1:])]


def run_side(python, side, args):
    command = [python, os.path.abspath(__file__), "--side", side, "--rollouts", str(args.rollouts),
               "--seed", str(args.seed), "--shape", args.shape, "--max-tokens", str(args.max_tokens),
               f"--model={args.model}", f"--model-path={args.model_path}"] + (
        [f"--project-args={args.project_args}"] if side == "project" else
        ["--trl-micro-batch", str(args.trl_micro_batch), "--trl-dtype", args.trl_dtype])
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        sys.exit(f"{side} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {key: statistics.median(values[args.warmup:]) for key, values in json.loads(lines[-1]).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=10, help="alternated pairs of runs (one project, one TRL); "
                        "a shared machine's speed drifts, and the median of fewer pairs moves with it")
    parser.add_argument("--rollouts", type=int, default=12, help="timed rollouts per run (each: 2 optimizer steps)")
    parser.add_argument("--warmup", type=int, default=3, help="rollouts dropped from the start of each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trl-python", default=sys.executable, help="a python that imports trl (its own venv)")
    parser.add_argument("--project-args", default=None, help="extra grpo.py flags in one string (default, tiny: "
                        "micro-batches of up to 1,600 padded tokens, about 30 of these rows, instead of the CPU "
                        "preset's 16 rows; qwen3-0.6b: " + REHEARSAL_PROJECT_ARGS + "; a value replaces it: '' for "
                        "the preset), e.g. --project-args='--micro-batch-tokens 1600 --old-logprobs recompute'")
    parser.add_argument("--trl-micro-batch", type=int, default=0, help="TRL's per_device_train_batch_size (default, "
                        "tiny: 64, one forward per optimizer step, as in the comparison; 16: gradient accumulation "
                        "over 4; qwen3-0.6b: 8)")
    parser.add_argument("--shape", choices=sorted(WORK), default="tiny", help="tiny: the built-in model, float32; "
                        "qwen3-0.6b: a random model of Qwen3-0.6B's shape (--layers of its 28), bf16 on both sides, "
                        "8 prompts x 4 samples, one optimizer step per rollout")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the qwen3-0.6b model")
    parser.add_argument("--max-tokens", type=int, default=0, help="response tokens (tiny: 48, qwen3-0.6b: 1,024)")
    parser.add_argument("--trl-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="qwen3-0.6b: TRL's "
                        "weights (bfloat16: pure bf16, its fastest on CPU; float32: bf16 autocast in its loss only)")
    parser.add_argument("--model", choices=["", "smollm2-135m-instruct"], default="",
                        help="a real model instead of --shape: tokens/s of rollout and update, project (HF float32, HF "
                        "bf16, vLLM) and TRL (float32, bf16), 8 prompts x 4 samples x --max-tokens (64)")
    parser.add_argument("--vllm-python", default="", help="--model: a python with vLLM's CPU build (its own venv); "
                        "empty: the vLLM side is left out")
    parser.add_argument("--side", choices=["project", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model-path", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rehearsal = args.shape != "tiny" and not args.model
    work = dict(WORK[args.model or args.shape], **({"max_tokens": args.max_tokens} if args.max_tokens else {}))
    args.max_tokens = work["max_tokens"]
    if args.project_args is None:
        args.project_args = REAL_PROJECT_ARGS if args.model else REHEARSAL_PROJECT_ARGS if rehearsal else \
            "--micro-batch-tokens 1600"
    args.trl_micro_batch = args.trl_micro_batch or (8 if rehearsal or args.model else 64)
    if args.side == "project":
        return project_side(args.rollouts, args.seed, shlex.split(args.project_args), work,
                            args.model_path or "tiny")
    if args.side == "trl":
        return trl_side(args.rollouts, args.seed, args.trl_micro_batch, work, args.model_path,
                        args.trl_dtype if rehearsal or args.model else "float32")
    check = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True)
    if check.returncode:
        sys.exit(f"{args.trl_python} cannot import trl: pip install trl==1.16.0 (or pass --trl-python)")
    if args.model:
        return compare_real(args)
    if rehearsal:
        model_dir = tempfile.TemporaryDirectory()
        args.model_path = model_dir.name
        save_rehearsal_model(args.layers, args.model_path)
        print(f"Qwen3-0.6B shape, {args.layers} layers, random weights (saved to {args.model_path}); "
              f"{work['prompts']} prompts x {work['samples']} samples x {work['max_tokens']} tokens; TRL weights "
              f"{args.trl_dtype}")
    print(f"TRL {check.stdout.strip()} (micro-batch {args.trl_micro_batch}) vs grpo.py {args.project_args}; "
          f"{args.pairs} pairs x {args.rollouts} rollouts (first {args.warmup} dropped), 1 thread each; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    ratios = {"wall": [], "cpu": []}
    for pair in range(args.pairs):
        order = ["project", "trl"] if pair % 2 == 0 else ["trl", "project"]
        times = {side: run_side(sys.executable if side == "project" else args.trl_python, side, args)
                 for side in order}
        project, trl = times["project"], times["trl"]
        ratios["wall"].append(trl["seconds"] / project["seconds"])
        ratios["cpu"].append(trl["cpu_seconds"] / project["cpu_seconds"])
        print(f"pair {pair}: s/rollout wall (cpu): project {project['seconds']:.3f} ({project['cpu_seconds']:.3f}; "
              f"wall rollout {project['rollout']:.3f}, update {project['update']:.3f}, rest "
              f"{project['seconds'] - project['rollout'] - project['update']:.3f}), TRL {trl['seconds']:.3f} "
              f"({trl['cpu_seconds']:.3f}; wall rollout {trl['rollout']:.3f}); TRL/project {ratios['wall'][-1]:.2f} "
              f"({ratios['cpu'][-1]:.2f}); load average {os.getloadavg()[0]:.2f}", flush=True)
    for clock, values in ratios.items():
        print(f"TRL/project, {clock} time per rollout: median {statistics.median(values):.2f}, min {min(values):.2f}, "
              f"max {max(values):.2f} over {len(values)} pairs")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


def pair_ratios(trl_runs, project_runs, key):
    """TRL / project of `key`, pair by pair: the i-th run of each side against each other, as they were run."""
    return [trl[key] / project[key] for trl, project in zip(trl_runs, project_runs) if project[key]]


def compare_real(args):
    """--model: each of REAL_SIDES once per pair (in reverse order every second pair) on the real model's converted
    folder (converted here if needed; the other environments read the folder), then a table of the medians over the
    pairs."""
    sys.path.insert(0, ROOT)
    from infra.hub import resolve_model_name
    args.model_path = resolve_model_name(args.model)
    base, results = args.project_args, {}
    print(f"{args.model} ({args.model_path}); 8 prompts x 4 samples x up to {args.max_tokens} tokens, one optimizer "
          f"step per rollout; grpo.py {base}; TRL micro-batch {args.trl_micro_batch}; {args.pairs} pair(s) x "
          f"{args.rollouts} rollouts (first {args.warmup} dropped), 1 thread each; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    for pair in range(args.pairs):
        for side, name, flags in REAL_SIDES if pair % 2 == 0 else REAL_SIDES[::-1]:  # the order alternates
            if side == "vllm" and not args.vllm_python:
                continue
            if side == "trl":
                args.trl_dtype = flags
            else:
                args.project_args = f"{base} {flags}" + (" --vllm-kv-cache-gib 1" if side == "vllm" else "")
            python = {"project": sys.executable, "vllm": args.vllm_python, "trl": args.trl_python}[side]
            result = dict(run_side(python, "trl" if side == "trl" else "project", args), load=os.getloadavg()[0])
            results.setdefault(name, []).append(result)
            print(f"{name:<20} rollout {result['rollout_tokens_per_s']:6.1f} tok/s ({result['rollout']:.1f} s), "
                  f"update {result['update_tokens_per_s']:6.1f} tok/s ({result['update']:.1f} s), "
                  f"{result['seconds']:.1f} s per rollout; load average {result['load']:.2f}", flush=True)
    print("| side | rollout tokens/s | update tokens/s | s per rollout | load after |\n| --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(r[key] for r in runs):.1f}" for key in
                                         ("rollout_tokens_per_s", "update_tokens_per_s", "seconds")) +
              f" | {max(r['load'] for r in runs):.2f} |")
    for trl_side, project_side in (("TRL, float32", "hf, float32"), ("TRL, bf16 autocast", "hf, bf16 autocast")):
        for key, label in (("seconds", "s per rollout"), ("rollout_tokens_per_s", "rollout tokens/s"),
                           ("update_tokens_per_s", "update tokens/s")):
            ratios = pair_ratios(results.get(trl_side, []), results.get(project_side, []), key)
            if ratios:
                print(f"{trl_side} / {project_side}, {label}: median {statistics.median(ratios):.2f}, min "
                      f"{min(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} pairs")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
