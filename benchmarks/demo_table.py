"""Run the built-in CPU demo of each trainer for several seeds, print the README's table and draw the figure.

    python benchmarks/demo_table.py --methods grpo ppo --seeds 0 1 2 --jobs 2 --eval-every 10

Each run is `python <method>.py --seed S --run-name demo_<method>_s<S>` with the file's tiny preset (flags this
script does not know go to every run); the table gives held-out greedy accuracy at the first step (before any
update) and after the last step, mean ± std over seeds, and the wall time of each run (model loading and
evaluation included). The learning curves go to <output-dir>/curves.png (infra.plot). A failed run prints the
end of its output.
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(method, seed, output_dir, extra):
    name = f"demo_{method}_s{seed}"
    start = time.time()
    command = [sys.executable, f"{method}.py", "--seed", str(seed), "--run-name", name, "--output-dir", output_dir,
               *extra]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    seconds = time.time() - start
    with open(os.path.join(ROOT, output_dir, name, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    extra_tokens = sum(r.get("mc_tokens", 0) for r in records)
    policy_tokens = sum(r.get("policy_tokens", 0) for r in records)
    return {"method": method, "seed": seed, "first": evals[0], "last": evals[-1], "seconds": seconds,
            "steps": len(records), "mc_tokens": extra_tokens, "policy_tokens": policy_tokens}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["grpo", "ppo", "sp3o", "tppo", "sppo", "spo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output-dir", default="runs/demo_table")
    parser.add_argument("--results", default="runs/demo_table/results.jsonl", help="append each run's numbers here")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (each with OMP_NUM_THREADS threads)")
    args, extra = parser.parse_known_args()
    os.makedirs(os.path.join(ROOT, os.path.dirname(args.results)), exist_ok=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run, method, seed, args.output_dir, extra)
                for method in args.methods for seed in args.seeds]
        for job in concurrent.futures.as_completed(jobs):
            result = job.result()
            print(json.dumps(result), flush=True)
            with open(os.path.join(ROOT, args.results), "a") as handle:
                handle.write(json.dumps(result) + "\n")
            results.append(result)
    sys.path.insert(0, ROOT)
    import infra.plot
    runs = [os.path.join(ROOT, args.output_dir, f"demo_{m}_s{s}") for m in args.methods for s in args.seeds]
    print("figure:", infra.plot.plot(runs, os.path.join(ROOT, args.output_dir, "curves.png"),
                                     f"built-in task, {len(args.seeds)} seeds per method"))
    print("| method | first accuracy | last accuracy | gain | wall time per run | Monte Carlo tokens |")
    print("|---|---|---|---|---|---|")
    for method in args.methods:
        rows = [r for r in results if r["method"] == method]
        def stat(key, scale=100.0):
            values = [r[key] * scale for r in rows]
            return f"{statistics.mean(values):.1f} ± {statistics.stdev(values) if len(values) > 1 else 0:.1f}"
        gains = [100 * (r["last"] - r["first"]) for r in rows]
        mc = sum(r["mc_tokens"] for r in rows) / len(rows)
        policy = sum(r["policy_tokens"] for r in rows) / len(rows)
        cost = f"{mc:,.0f} per run ({100 * mc / policy:.0f}% of the policy's {policy:,.0f})" if mc and policy else "-"
        print(f"| {method} | {stat('first')} | {stat('last')} | {statistics.mean(gains):+.1f} | "
              f"{stat('seconds', 1)} s | {cost} |")


if __name__ == "__main__":
    main()
