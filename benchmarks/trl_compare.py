"""Step time of grpo.py against TRL's GRPOTrainer on the same work, runs alternated, the ratio TRL / project.

    pip install trl==1.16.0          # optional; in its own venv if it conflicts: --trl-python that venv's python
    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py                    # 10 pairs of runs, 12 rollouts each
    OMP_NUM_THREADS=1 python benchmarks/trl_compare.py --trl-python <a venv with trl>/bin/python

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
PROMPTS, SAMPLES, MAX_TOKENS, LR, MINI_BATCHES = 16, 8, 48, 1e-4, 2


def project_side(rollouts, seed, extra):
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
        phases.append((metrics["rollout_s"], metrics["update_s"]))
        return end_step(self, step, metrics)

    infra.run.Run.end_step = timed_end_step
    with tempfile.TemporaryDirectory() as output_dir:
        sys.argv = ["grpo.py", "--model", "tiny", "--steps", str(rollouts + 1), "--seed", str(seed),
                    "--prompts-per-step", str(PROMPTS), "--samples-per-prompt", str(SAMPLES),
                    "--max-response-tokens", str(MAX_TOKENS), "--lr", str(LR), "--mini-batches", str(MINI_BATCHES),
                    "--aggregation", "token-mean", "--kl-coef", "0",
                    "--no-gradient-checkpointing", "--eval-problems", "8", "--eval-every", "0", "--save-every", "0",
                    "--dataset", "builtin:3", "--output-dir", output_dir, *extra]
        grpo.main()
    print(json.dumps(dict(seconds=differences(ends), cpu_seconds=differences(cpu_ends),
                          rollout=[p[0] for p in phases[1:]], update=[p[1] for p in phases[1:]])))


def trl_side(rollouts, seed, micro_batch):
    """Run TRL's GRPOTrainer with the matching settings in this process; print one JSON line of per-rollout
    seconds."""
    sys.path.insert(0, ROOT)
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import common
    from infra.tiny import builtin_rows, tiny_model_path
    path = tiny_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rows = builtin_rows("train", PROMPTS * (rollouts + 2), seed, digits=3)
    dataset = Dataset.from_list([{"prompt": common.plain_prompt(row["question"]), "answer": row["answer"]}
                                 for row in rows])  # the tiny tokenizer has no chat template: grpo.py's prompt

    def reward(completions, completion_ids, answer, **_):  # 0 for a response cut at the length limit, as grpo.py
        return [common.score(text, {"answer": gold}) if tokenizer.eos_token_id in ids else 0.0
                for text, ids, gold in zip(completions, completion_ids, answer)]

    ends, cpu_ends = [], []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())
            cpu_ends.append(time.process_time())

    accumulation = PROMPTS * SAMPLES // MINI_BATCHES // micro_batch  # micro-batches per optimizer step
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, bf16=False, seed=seed, report_to="none", save_strategy="no",
            disable_tqdm=True, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=accumulation,
            steps_per_generation=MINI_BATCHES * accumulation, num_generations=SAMPLES,
            num_iterations=1, max_completion_length=MAX_TOKENS, temperature=1.0, top_p=1.0, top_k=0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.01, adam_beta1=0.9,
            adam_beta2=0.999, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.2, loss_type="dapo",
            scale_rewards="group", gradient_checkpointing=False, max_steps=MINI_BATCHES * (rollouts + 1),
            dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Clock()])
        trainer.train()
    last = slice(MINI_BATCHES - 1, None, MINI_BATCHES)  # the end of each rollout's last optimizer step
    print(json.dumps(dict(seconds=differences(ends[last]), cpu_seconds=differences(cpu_ends[last]))))


def differences(times):
    return [b - a for a, b in zip(times, times[1:])]


def run_side(python, side, args):
    command = [python, os.path.abspath(__file__), "--side", side, "--rollouts", str(args.rollouts),
               "--seed", str(args.seed)] + ([f"--project-args={args.project_args}"] if side == "project" else
                                            ["--trl-micro-batch", str(args.trl_micro_batch)])
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
    parser.add_argument("--project-args", default="--micro-batch-tokens 1600", help="extra grpo.py flags in one "
                        "string (default: micro-batches of up to 1,600 padded tokens, about 30 of these rows, instead "
                        "of the CPU preset's 16 rows; a value replaces it: '' for the preset), e.g. "
                        "--project-args='--micro-batch-tokens 1600 --old-logprobs recompute'")
    parser.add_argument("--trl-micro-batch", type=int, default=64, help="TRL's per_device_train_batch_size (64: "
                        "one forward per optimizer step, as in the comparison; 16: gradient accumulation over 4)")
    parser.add_argument("--side", choices=["project", "trl"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "project":
        return project_side(args.rollouts, args.seed, shlex.split(args.project_args))
    if args.side == "trl":
        return trl_side(args.rollouts, args.seed, args.trl_micro_batch)
    check = subprocess.run([args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                           text=True)
    if check.returncode:
        sys.exit(f"{args.trl_python} cannot import trl: pip install trl==1.16.0 (or pass --trl-python)")
    print(f"TRL {check.stdout.strip()} (micro-batch {args.trl_micro_batch}) vs grpo.py {args.project_args}; "
          f"{args.pairs} pairs x "
          f"{args.rollouts} rollouts (first {args.warmup} dropped), 1 thread each; load average "
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
              f"({trl['cpu_seconds']:.3f}); TRL/project {ratios['wall'][-1]:.2f} ({ratios['cpu'][-1]:.2f})", flush=True)
    for clock, values in ratios.items():
        print(f"TRL/project, {clock} time per rollout: median {statistics.median(values):.2f}, min {min(values):.2f}, "
              f"max {max(values):.2f} over {len(values)} pairs")
    print(f"load average after: {os.getloadavg()[0]:.2f}")

if __name__ == "__main__":
    main()
