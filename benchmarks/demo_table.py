"""Run the CPU demo of each trainer for several seeds, print the README's tables and draw the figure: on the tiny
model (its preset), or on SmolLM2-135M-Instruct under `--preset smollm2` (docs/real_model.md).

    python benchmarks/demo_table.py --seeds 0 1 2 3 4 --jobs 2 --eval-every 5 --probe-every 10
    python benchmarks/demo_table.py --model smollm2-135m-instruct --dataset builtin:words --methods grpo ppo \\
        --seeds 0 1 2 --jobs 2

Each run is `python <method>.py --seed S --run-name demo_<method>_s<S>` with the file's preset (flags this script
does not know go to every run, e.g. `--dataset builtin:3`; `--model smollm2-135m-instruct` brings `--preset
smollm2`). A method given as `NAME=FILE FLAGS` is a file run with its own flags under its own name, e.g.
`--methods grpo "gspo=grpo --importance-level sequence"`: its runs are demo_gspo_s<S>, its records gspo_s<S>/.
Per method, mean and 95% confidence interval over seeds (Student t) of: held-out accuracy (avg@n of the --eval-*
flags) at each evaluation, labelled by the updates done (the last one follows the last update); the gain (last -
first); the area under the accuracy curve (mean over the evaluations); the steps to reach 80% of the run's own final
gain (the first evaluation at or above first + 0.8 * gain); the critic's explained variance over the middle third of
the run, at the last step, and the first step at which it reaches 0.2 (per seed); the probe's sign accuracy (ppo,
sp3o, tppo with --probe-every); the wall time and the CPU time (the run's user + sys, os.wait4).
Then each method against GRPO and against its parent (the other method run whose file differs from it by the fewest
lines: a fork's parent) by Welch's t on the gain and the area under the curve (t, df, two-sided p), and every pair
that differs beyond seed noise. The learning curves go to curves.png (infra.plot).

Records: with --records DIR (the default under --preset smollm2: docs/real_model_runs/<task>/) each finished run's
metrics.jsonl, config.json, the exact command (command.txt) and its times (resources.json) are copied to
DIR/<method>_s<seed>/ as the run finishes, so an interruption loses at most the runs in progress: the same command
again runs only the runs not kept yet (--rerun: all). --from-results prints the tables and draws the figure from
those records alone (a clean clone has them). Without records,
--from-results reads --results (the last record of each method and seed), each run's numbers recomputed from its
metrics.jsonl where the run folder is there. A failed run prints the end of its output; the others go on.
"""
import argparse
import ast
import concurrent.futures
import difflib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import infra.cli  # noqa: E402
from infra.cli import _flag_value as flag_value  # noqa: E402

METHODS = infra.cli.trainers()  # every trainer file at the root, forks included (e.g. a copy of ppo.py)
PROBED = [m for m in METHODS if {"probe_every", "lam_critic"} <= set(infra.cli.trainer_defaults(m))]  # token critics
REAL_MODEL = infra.cli.RUN_SMOLLM2_PRESET["model"]
EV_TARGET = 0.2  # the critic's explained variance that counts as learning something
# means over the middle third: the critic's explained variance over all tokens and where it is trained (SP3O's
# anchors), the tracking critic's state (tppo.tracking_diagnostics) and the critic's gradient norm before clipping
MIDDLE_KEYS = ("explained_variance", "explained_variance_anchors", "critic_z0", "critic_increment",
               "critic_last_logit", "critic_grad_norm")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}  # two-sided, by df


def run(method, seed, output_dir, extra, probe_every=0, records_dir="", keep_checkpoints=False):
    """One run in a child process (its output in <output-dir>/<run>.log); its summary, wall and CPU seconds. With
    records_dir, its records are kept there (keep_records) as soon as it finishes, and its checkpoints removed unless
    keep_checkpoints (SmolLM2's last checkpoint, kept for --resume, is 2.2 GB for GRPO, 4.2 GB with a critic)."""
    name, command = f"demo_{method}_s{seed}", run_command(method, seed, output_dir, extra, probe_every)
    run_dir = os.path.join(ROOT, output_dir, name)
    if os.path.isdir(run_dir):  # a run stopped midway, or --rerun: started over, so its CPU time is a whole run's
        print(f"{name}: {run_dir} holds an earlier run; starting it over", flush=True)
        shutil.rmtree(run_dir)
    os.makedirs(os.path.join(ROOT, output_dir), exist_ok=True)
    log_path, start, load = os.path.join(ROOT, output_dir, f"{name}.log"), time.time(), os.getloadavg()[0]
    code = commit()  # at the start: the code the run imports
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS=threads))
        _, status, usage = os.wait4(child.pid, 0)  # this child's own user + sys time (a thread-safe measure)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        with open(log_path) as log:
            raise RuntimeError(f"{' '.join(command[1:])} failed (exit {child.returncode}):\n{log.read()[-3000:]}")
    resources = dict(wall_s=time.time() - start, cpu_s=usage.ru_utime + usage.ru_stime, max_rss_mib=usage.ru_maxrss /
                     1024, load_start=load, load_end=os.getloadavg()[0], omp_num_threads=threads, commit=code)
    if records_dir:
        shown = ["OMP_NUM_THREADS=" + threads, "python", *command[1:]]
        keep_records(run_dir, os.path.join(ROOT, records_dir, f"{method}_s{seed}"), shlex.join(shown), resources)
        if not keep_checkpoints:
            shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    return dict(summarize(records), method=method, seed=seed, seconds=resources["wall_s"], cpu_s=resources["cpu_s"])


VARIANTS = {}  # NAME: (FILE, FLAGS) of the methods given as `NAME=FILE FLAGS`


def file_of(method):
    """The trainer file a method runs (without .py): its own, or a variant's."""
    return VARIANTS.get(method, (method, []))[0]


def run_command(method, seed, output_dir, extra, probe_every=0):
    file, flags = VARIANTS.get(method, (method, []))
    command = [sys.executable, f"{file}.py", "--seed", str(seed), "--run-name", f"demo_{method}_s{seed}",
               "--output-dir", output_dir, *extra, *flags]
    return command + ["--probe-every", str(probe_every)] * bool(probe_every and file in PROBED)


def run_flags(command):
    """The flags of a run's command line (a list, or command.txt's text) after its --output-dir: how it ran."""
    words = shlex.split(command) if isinstance(command, str) else command
    return words[words.index("--output-dir") + 2:]


def commit():
    """The repository's commit, `+` if the tree has changes outside docs/ (where the table writes its records)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs"], cwd=ROOT,
                           capture_output=True, text=True)
    return head.stdout.strip() + "+" * bool(dirty.stdout.strip()) if head.returncode == 0 else ""


RECORD_FILES = ("metrics.jsonl", "config.json")


def keep_records(run_dir, folder, command, resources):
    """Copy a finished run's small records into `folder` (replaced whole: a staging folder renamed into place)."""
    staging = folder + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    for name in RECORD_FILES:
        shutil.copy(os.path.join(run_dir, name), staging)
    with open(os.path.join(staging, "command.txt"), "w") as handle:
        handle.write(command + "\n")
    with open(os.path.join(staging, "resources.json"), "w") as handle:
        json.dump(resources, handle, indent=1)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(staging, folder)


def read_records(records_dir, methods):
    """The summaries of the runs kept in records_dir (<method>_s<seed>/ folders), for `methods`."""
    results = []
    for entry in sorted(os.listdir(records_dir)):
        match = re.fullmatch(r"(.+)_s(\d+)", entry)
        folder = os.path.join(records_dir, entry)
        if not match or match[1] not in methods or not os.path.exists(os.path.join(folder, "resources.json")):
            continue
        with open(os.path.join(folder, "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle]
        with open(os.path.join(folder, "resources.json")) as handle:
            resources = json.load(handle)
        with open(os.path.join(folder, "command.txt")) as handle:
            command = handle.read().strip()
        results.append(dict(summarize(records), method=match[1], seed=int(match[2]), seconds=resources["wall_s"],
                            cpu_s=resources["cpu_s"], folder=folder, command=command))
    return results


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
    # updates done at each evaluation: the one logged with the last step follows its update
    updates = [step + (step == records[-1]["step"] and i == len(evals) - 1) for i, (step, _) in enumerate(evals)]
    return {"first": first, "last": last, "gain": last - first, "auc": sum(a for _, a in evals) / len(evals),
            "steps_to_80": steps_to_80, "ev_middle": sum(middle) / len(middle) if middle else None,
            "ev_last": records[-1].get("explained_variance"), "ev_reaches": ev_reaches,
            "sign_accuracy": sum(signs) / len(signs) if signs else None, "curve": evals,
            "at_updates": dict(zip(updates, (a for _, a in evals))), "steps": len(records),
            "mc_tokens": sum(r.get("mc_tokens", 0) for r in records), "middle": means}


def own_settings(method, preset="TINY_PRESET"):
    """The method's own settings in a preset (its file's TINY_PRESET or SMOLLM2_PRESET, read, not imported), e.g.
    `critic_warmup=5`; the others are infra.cli's CONTROLLED_*_PRESET, the same for every file. A variant adds its
    flags."""
    file, flags = VARIANTS.get(method, (method, []))
    with open(os.path.join(ROOT, f"{file}.py")) as handle:
        tree = ast.parse(handle.read())
    value = next((node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(target, "id", "") == preset for target in node.targets)), None)
    keywords = getattr(value, "keywords", [])
    return ", ".join([f"{k.arg}={ast.literal_eval(k.value)}" for k in keywords] + [shlex.join(flags)] * bool(flags)) \
        or "-"


def interval(values, scale=1.0, digits=1):
    """`mean ± half-width of the 95% interval` over seeds; the value alone for one seed; `-` when no run has it."""
    values = [v * scale for v in values if v is not None]
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return f"{statistics.mean(values):.{digits}f} ± {half:.{digits}f}"


def welch(a, b):
    """Welch's t-test of two samples' means: (t, Welch-Satterthwaite df, two-sided p); None below 2 values each."""
    if len(a) < 2 or len(b) < 2:
        return None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.mean(a) - statistics.mean(b)
    if va + vb == 0:
        return (math.copysign(math.inf, difference), math.inf, 0.0) if difference else (0.0, math.inf, 1.0)
    t = difference / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return t, df, student_t_two_sided_p(t, df)


def student_t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df degrees of freedom: the regularized incomplete beta I_x(df/2, 1/2),
    x = df / (df + t^2), by its continued fraction (Lentz; Numerical Recipes' betacf)."""
    x, a, b = df / (df + t * t), df / 2, 0.5
    if x <= 0 or x >= 1:
        return float(x >= 1)
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast below this point: use I_x(a, b) = 1 - I_1-x(b, a)
        return 1 - _beta_fraction_term(1 - x, b, a)
    return _beta_fraction_term(x, a, b)


def _beta_fraction_term(x, a, b, tiny=1e-300):
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(1 - x)) / a
    c, d = 1.0, 1 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 300):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + numerator * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + numerator / c if abs(1 + numerator / c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1) < 1e-12:
            break
    return front * fraction


def welch_differs(a, b):
    """Whether two samples' means differ at the 95% level (Welch's t with the Welch-Satterthwaite df)."""
    result = welch(a, b)
    return result is not None and result[2] < 0.05


def parent(method, candidates):
    """Of the other methods run, the one whose file differs from `method`'s by the fewest lines (a fork's parent)."""
    def changed(other):
        paths = (os.path.join(ROOT, f"{file_of(name)}.py") for name in (other, method))
        with open(next(paths)) as x, open(next(paths)) as y:
            return sum(line[:1] in "+-" for line in difflib.unified_diff(x.readlines(), y.readlines(), n=0)
                       if not line.startswith(("+++", "---")))
    others = [other for other in candidates if other != method]
    return min(others, key=changed) if others else None


def comparisons(by_method):
    """Markdown: each method against GRPO and against its parent, by gain and area under the curve (Welch)."""
    lines = ["| method | against | Δ gain | t, df, p | Δ area under curve | t, df, p |", "|---|---|---|---|---|---|"]
    for method, rows in by_method.items():
        for other in dict.fromkeys(o for o in ("grpo", parent(method, list(by_method))) if o in by_method):
            if other == method or not rows or not by_method[other]:
                continue
            cells = []
            for key in ("gain", "auc"):
                mine, theirs = [r[key] for r in rows], [r[key] for r in by_method[other]]
                tested = welch(mine, theirs)
                cells += [f"{100 * (statistics.mean(mine) - statistics.mean(theirs)):+.1f}",
                          "-" if tested is None else f"{tested[0]:+.2f}, {tested[1]:.1f}, {tested[2]:.3f}"]
            lines.append(f"| {method} | {other} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tables(by_method, preset):
    """The printed tables (markdown) of the runs' summaries, by method."""
    print("mean ± 95% interval over the seeds; accuracy and gain in points")
    print("| method | own settings | seeds | first | last | gain | area under curve | steps to 80% of gain | "
          f"explained variance (middle) | EV (last step) | EV at the anchors | EV >= {EV_TARGET} from step | "
          "sign accuracy | wall time | CPU time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for method, rows in by_method.items():
        if not rows:
            continue
        column = lambda key, scale=1.0, digits=1: interval([r.get(key) for r in rows], scale, digits)  # noqa: E731
        reaches = ", ".join("-" if r.get("ev_reaches") is None else str(r["ev_reaches"]) for r in rows)  # -: never
        anchors = interval([r.get("middle", {}).get("explained_variance_anchors") for r in rows], 1, 2)
        print(f"| {method} | {own_settings(method, preset)} | {len(rows)} | {column('first', 100)} | "
              f"{column('last', 100)} | {column('gain', 100)} | {column('auc', 100)} | {column('steps_to_80', 1, 0)} | "
              f"{column('ev_middle', 1, 2)} | {column('ev_last', 1, 2)} | {anchors} | "
              f"{reaches if rows[0]['ev_middle'] is not None else '-'} | {column('sign_accuracy', 1, 2)} | "
              f"{column('seconds', 1 / 60)} min | {column('cpu_s', 1 / 60)} min |")
    updates = sorted({u for rows in by_method.values() for r in rows for u in map(int, r.get("at_updates", {}))})
    print("\nheld-out accuracy after N updates, mean ± 95% interval over the seeds (points)")
    print("| method | " + " | ".join(map(str, updates)) + " |\n|---|" + "---:|" * len(updates))
    for method, rows in by_method.items():
        cells = [interval([{int(k): v for k, v in r.get("at_updates", {}).items()}.get(u) for r in rows], 100)
                 for u in updates]
        print(f"| {method} | " + " | ".join(cells) + " |")
    print("\n" + comparisons(by_method))
    for key in ("gain", "auc"):
        pairs = [(a, b) for a, b in itertools.combinations(by_method, 2)
                 if welch_differs([r[key] for r in by_method[a]], [r[key] for r in by_method[b]])]
        print(f"{key}: pairs that differ beyond seed noise (Welch, 95%): "
              f"{', '.join(f'{a}/{b}' for a, b in pairs) or 'none'}")


def main():
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),  # what it does, examples
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=METHODS, help="trainer files, or NAME=FILE FLAGS: FILE run "
                        "with FLAGS under NAME (e.g. 'gspo=grpo --importance-level sequence')")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output-dir", default="", help="the run folders (default: runs/demo_table; with --preset "
                        "smollm2: runs/real_model/<task>)")
    parser.add_argument("--results", default="", help="append each run's numbers here (default: "
                        "<output-dir>/results.jsonl)")
    parser.add_argument("--records", default=None, help="keep each finished run's records in DIR/<method>_s<seed>/ "
                        "(default with --preset smollm2: docs/real_model_runs/<task>; '': none)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (each with OMP_NUM_THREADS threads)")
    parser.add_argument("--probe-every", type=int, default=0, help=f"critic probe every N steps ({', '.join(PROBED)})")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each recorded run's checkpoints "
                        "(removed once its records are kept: the table's 42 SmolLM2 runs would hold about 150 GB)")
    parser.add_argument("--rerun", action="store_true", help="run again the runs already kept in --records")
    parser.add_argument("--from-results", action="store_true", help="no runs: the tables and the figure from "
                        "--records (else from --results, the last record of each method and seed, and the run folders)")
    args, extra = parser.parse_known_args()
    for spec in [m for m in args.methods if "=" in m]:  # NAME=FILE FLAGS
        name, command = spec.split("=", 1)
        VARIANTS[name.strip()] = (shlex.split(command)[0].removesuffix(".py"), shlex.split(command)[1:])
    args.methods = [m.split("=", 1)[0].strip() for m in args.methods]
    if flag_value(extra, "--model") == REAL_MODEL and not flag_value(extra, "--preset"):
        extra += ["--preset", "smollm2"]  # the real model's controlled comparison
    real = flag_value(extra, "--preset") == "smollm2"
    task = (flag_value(extra, "--dataset") or (infra.cli.RUN_SMOLLM2_PRESET["dataset"] if real else "builtin"))
    task = re.sub(r"[^\w.-]", "_", task.removeprefix("builtin:"))
    args.output_dir = args.output_dir or (f"runs/real_model/{task}" if real else "runs/demo_table")
    args.results = args.results or os.path.join(args.output_dir, "results.jsonl")
    records_dir = f"docs/real_model_runs/{task}" if args.records is None and real else args.records or ""
    os.makedirs(os.path.join(ROOT, os.path.dirname(args.results)), exist_ok=True)
    results = []
    if args.from_results and records_dir:
        results = read_records(os.path.join(ROOT, records_dir), args.methods)
    elif args.from_results:
        with open(os.path.join(ROOT, args.results)) as handle:
            latest = {(r["method"], r["seed"]): r for r in map(json.loads, handle)}
        results = [r for r in latest.values() if r["method"] in args.methods]
        for result in results:  # the numbers again from each run's records, as summarize() computes them now
            metrics = os.path.join(ROOT, args.output_dir, f"demo_{result['method']}_s{result['seed']}", "metrics.jsonl")
            if os.path.exists(metrics):
                with open(metrics) as handle:
                    result.update(summarize([json.loads(line) for line in handle]))
    kept = {(r["method"], r["seed"]): r for r in read_records(os.path.join(ROOT, records_dir), args.methods)} \
        if records_dir and os.path.isdir(os.path.join(ROOT, records_dir)) and not args.from_results else {}
    todo = [(method, seed) for seed in args.seeds for method in args.methods if not args.from_results]
    for method, seed in todo:  # a run already kept is not run again (an interrupted table goes on where it stopped)
        if (method, seed) in kept and not args.rerun:
            flags = run_flags(run_command(method, seed, args.output_dir, extra, args.probe_every))
            if run_flags(kept[(method, seed)]["command"]) != flags:
                raise SystemExit(f"{records_dir}/{method}_s{seed} was kept from a run with other flags "
                                 f"({kept[(method, seed)]['command']}): --rerun to run it again, or other --records")
            print(f"{method} seed {seed}: kept in {records_dir}, not run again (--rerun to run it)", flush=True)
            results.append(kept[(method, seed)])
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run, method, seed, args.output_dir, extra, args.probe_every, records_dir,
                            args.keep_checkpoints)
                for method, seed in todo if (method, seed) not in kept or args.rerun]
        for job in concurrent.futures.as_completed(jobs):
            try:
                result = job.result()
            except RuntimeError as error:  # a failed run: its output's end, the others go on
                print(error, flush=True)
                continue
            print(json.dumps({k: v for k, v in result.items() if k not in ("curve", "at_updates")}), flush=True)
            with open(os.path.join(ROOT, args.results), "a") as handle:
                handle.write(json.dumps(result) + "\n")
            results.append(result)
    if not results:
        raise SystemExit("no finished runs to tabulate")
    import infra.plot
    runs = [r.get("folder") or os.path.join(ROOT, args.output_dir, f"demo_{r['method']}_s{r['seed']}")
            for r in results]
    figure = os.path.join(ROOT, records_dir or args.output_dir, "curves.png")
    if records_dir:  # the runs' records folders: the figure from them alone
        runs = [os.path.join(ROOT, records_dir, f"{r['method']}_s{r['seed']}") for r in results]
    by_method = {m: sorted((r for r in results if r["method"] == m), key=lambda r: r["seed"]) for m in args.methods}
    counts = sorted({len(rows) for rows in by_method.values() if rows})
    seeds = f"{counts[0]}-{counts[-1]} seeds" if len(counts) > 1 else f"{counts[0]} seed" + "s" * (counts[0] > 1)
    title = f"{REAL_MODEL} on {task}" if real else "built-in task"
    print("figure:", infra.plot.plot(runs, figure, f"{title}, {seeds} per method"))
    tables({m: rows for m, rows in by_method.items() if rows}, "SMOLLM2_PRESET" if real else "TINY_PRESET")


if __name__ == "__main__":
    main()
