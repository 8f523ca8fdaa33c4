"""Run the built-in CPU demo of each trainer for several seeds, print the README's tables and draw the figure.

    python benchmarks/demo_table.py --seeds 0 1 2 3 4 --jobs 2 --eval-every 5 --probe-every 10

Each run is `python <method>.py --seed S --run-name demo_<method>_s<S>` with the file's tiny preset (flags this
script does not know go to every run, e.g. `--dataset builtin:3`). Per method, mean and 95% confidence interval
over seeds (Student t) of: held-out greedy accuracy before any update and after the last step; the gain; the area
under the accuracy curve (mean over the evaluations); the steps to reach 80% of the run's own final gain (the first
evaluation at or above first + 0.8 * gain); the critic's explained variance over the middle third of the run and the
first step at which it reaches 0.2 (per seed); the probe's sign accuracy (ppo, sp3o, tppo with --probe-every); the
wall time. Then, for each pair of methods, whether their accuracy gain and area under the curve differ beyond seed
noise (Welch's t, |t| above the 95% critical value). The learning curves go to <output-dir>/curves.png (infra.plot).
A failed run prints the end of its output. --from-results prints the tables again without running, each run's
numbers recomputed from its metrics.jsonl where the run folder is there.
"""
import argparse
import ast
import concurrent.futures
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import infra.cli  # noqa: E402

METHODS = infra.cli.trainers()  # every trainer file at the root, forks included (e.g. a copy of ppo.py)
PROBED = [m for m in METHODS if {"probe_every", "lam_critic"} <= set(infra.cli.trainer_defaults(m))]  # token critics
EV_TARGET = 0.2  # the critic's explained variance that counts as learning something
# means over the middle third: the critic's explained variance over all tokens and where it is trained (SP3O's
# anchors), the tracking critic's state (tppo.tracking_diagnostics) and the critic's gradient norm before clipping
MIDDLE_KEYS = ("explained_variance", "explained_variance_anchors", "critic_z0", "critic_increment",
               "critic_last_logit", "critic_grad_norm")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}  # two-sided, by df


def run(method, seed, output_dir, extra, probe_every=0):
    name = f"demo_{method}_s{seed}"
    start = time.time()
    command = [sys.executable, f"{method}.py", "--seed", str(seed), "--run-name", name, "--output-dir", output_dir,
               *extra]
    if probe_every and method in PROBED:
        command += ["--probe-every", str(probe_every)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    with open(os.path.join(ROOT, output_dir, name, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    return dict(summarize(records), method=method, seed=seed, seconds=time.time() - start)


def summarize(records):
    """A run's numbers from its metrics.jsonl records (see the module docstring)."""
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    first, last = evals[0][1], evals[-1][1]
    threshold = first + 0.8 * (last - first)
    steps_to_80 = next(step for step, accuracy in evals if accuracy >= threshold) if last > first else None
    third = records[len(records) // 3: 2 * len(records) // 3 + 1]  # the middle third of the run's steps
    means = {key: statistics.mean(r[key] for r in third if key in r) for key in MIDDLE_KEYS
             if any(key in r for r in third)}
    middle = [r["explained_variance"] for r in third if "explained_variance" in r]
    signs = [r["probe/sign_acc_tau0"] for r in records if "probe/sign_acc_tau0" in r]
    ev_reaches = next((r["step"] for r in records if r.get("explained_variance", -1) >= EV_TARGET), None)
    return {"first": first, "last": last, "gain": last - first, "auc": sum(a for _, a in evals) / len(evals),
            "steps_to_80": steps_to_80, "ev_middle": sum(middle) / len(middle) if middle else None,
            "ev_reaches": ev_reaches,
            "sign_accuracy": sum(signs) / len(signs) if signs else None, "curve": evals, "steps": len(records),
            "mc_tokens": sum(r.get("mc_tokens", 0) for r in records), "middle": means}


def own_settings(method):
    """The method's own demo settings (its file's TINY_PRESET, read, not imported), e.g. `critic_warmup=5`; the
    others are infra.cli.CONTROLLED_TINY_PRESET's, the same for every file."""
    with open(os.path.join(ROOT, f"{method}.py")) as handle:
        tree = ast.parse(handle.read())
    preset = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(getattr(target, "id", "") == "TINY_PRESET" for target in node.targets)), None)
    keywords = getattr(preset, "keywords", [])
    return ", ".join(f"{k.arg}={ast.literal_eval(k.value)}" for k in keywords) or "-"


def interval(values, scale=1.0, digits=1):
    """`mean ± half-width of the 95% interval` over seeds; `-` when no run has the value."""
    values = [v * scale for v in values if v is not None]
    if not values:
        return "-"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0
    return f"{statistics.mean(values):.{digits}f} ± {half:.{digits}f}"


def welch_differs(a, b):
    """Whether two samples' means differ at the 95% level (Welch's t with the Welch-Satterthwaite df)."""
    if len(a) < 2 or len(b) < 2:
        return False
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return statistics.mean(a) != statistics.mean(b)
    t = abs(statistics.mean(a) - statistics.mean(b)) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t > T95.get(max(1, min(10, math.floor(df))), 1.96)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output-dir", default="runs/demo_table")
    parser.add_argument("--results", default="runs/demo_table/results.jsonl", help="append each run's numbers here")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (each with OMP_NUM_THREADS threads)")
    parser.add_argument("--probe-every", type=int, default=0, help=f"critic probe every N steps ({', '.join(PROBED)})")
    parser.add_argument("--from-results", action="store_true", help="no runs: the tables from --results (the last "
                        "record of each method and seed) and the figure from the run folders")
    args, extra = parser.parse_known_args()
    os.makedirs(os.path.join(ROOT, os.path.dirname(args.results)), exist_ok=True)
    results = []
    if args.from_results:
        with open(os.path.join(ROOT, args.results)) as handle:
            latest = {(r["method"], r["seed"]): r for r in map(json.loads, handle)}
        results = [r for r in latest.values() if r["method"] in args.methods]
        for result in results:  # the numbers again from each run's records, as summarize() computes them now
            metrics = os.path.join(ROOT, args.output_dir, f"demo_{result['method']}_s{result['seed']}", "metrics.jsonl")
            if os.path.exists(metrics):
                with open(metrics) as handle:
                    result.update(summarize([json.loads(line) for line in handle]))
        args.seeds = sorted({r["seed"] for r in results})
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run, method, seed, args.output_dir, extra, args.probe_every)
                for seed in args.seeds for method in args.methods if not args.from_results]
        for job in concurrent.futures.as_completed(jobs):
            result = job.result()
            print(json.dumps(result), flush=True)
            with open(os.path.join(ROOT, args.results), "a") as handle:
                handle.write(json.dumps(result) + "\n")
            results.append(result)
    import infra.plot
    runs = [os.path.join(ROOT, args.output_dir, f"demo_{r['method']}_s{r['seed']}") for r in results]
    print("figure:", infra.plot.plot(runs, os.path.join(ROOT, args.output_dir, "curves.png"),
                                     f"built-in task, {len(args.seeds)} seeds per method"))
    by_method = {m: sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"]) for m in args.methods}
    print("mean ± 95% interval over the seeds; accuracy and gain in points")
    print("| method | own settings | seeds | first | last | gain | area under curve | steps to 80% of gain | "
          f"explained variance (middle) | EV at the anchors | EV >= {EV_TARGET} from step | sign accuracy | wall time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for method, rows in by_method.items():
        column = lambda key, scale=1.0, digits=1: interval([r[key] for r in rows], scale, digits)  # noqa: E731
        reaches = ", ".join("-" if r.get("ev_reaches") is None else str(r["ev_reaches"]) for r in rows)  # -: never
        anchors = interval([r.get("middle", {}).get("explained_variance_anchors") for r in rows], 1, 2)
        print(f"| {method} | {own_settings(method)} | {len(rows)} | {column('first', 100)} | {column('last', 100)} | "
              f"{column('gain', 100)} | {column('auc', 100)} | {column('steps_to_80', 1, 0)} | "
              f"{column('ev_middle', 1, 2)} | {anchors} | {reaches if rows[0]['ev_middle'] is not None else '-'} | "
              f"{column('sign_accuracy', 1, 2)} | {column('seconds', 1, 0)} s |")
    for key in ("gain", "auc"):
        pairs = [(a, b) for a, b in itertools.combinations(args.methods, 2)
                 if welch_differs([r[key] for r in by_method[a]], [r[key] for r in by_method[b]])]
        print(f"{key}: pairs that differ beyond seed noise (Welch, 95%): "
              f"{', '.join(f'{a}/{b}' for a, b in pairs) or 'none'}")


if __name__ == "__main__":
    main()
