"""The horizon sweep (docs/horizon.md): every trainer on `builtin:horizon-k<K>-h<H>[-late]` under `--preset horizon`,
for several seeds, across the task's knobs; its tables and its figure (gain and area under the curve against H, one
line per method, 95% intervals as bands).

    OMP_NUM_THREADS=1 python benchmarks/horizon_sweep.py --jobs 2                 # all settings, methods, seeds 0-2
    OMP_NUM_THREADS=1 python benchmarks/horizon_sweep.py --settings k1-h1024 --methods grpo ppo --seeds 0
    python benchmarks/horizon_sweep.py --from-results                             # the tables and figure, no runs

Each run is demo_table.py's (`python <method>.py --seed S --preset horizon --dataset builtin:horizon-<setting>`), its
records kept in docs/horizon_runs/<setting>/<method>_s<seed>/ as it finishes; the same command again runs only what
is not kept yet (a run stopped midway starts over), settings in the order given (the default puts the extremes of H
first). Per setting and method: mean and 95% interval over seeds of the held-out accuracy at the start and end, the
gain, the area under the curve (mean over the evaluations), the training samples until held-out accuracy first reaches
THRESHOLD (with how many seeds reached it), the critic's explained variance over the middle third and at the last
step, the first step at which it reaches EV_TARGET (per seed), the CPU time of a run and, for SPO, its Monte Carlo
continuation tokens; each method against GRPO by Welch's t on the gain and the area. Before the tables, a summary:
each method's area minus GRPO's at every setting, with Welch's p.
"""
import argparse
import concurrent.futures
import json
import math
import os
import shlex
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.demo_table import (EV_TARGET, METHODS, T95, VARIANTS, interval, read_records, run,  # noqa: E402
                                   run_command, run_flags, welch)
from infra.horizon import SWEEP_SETTINGS, parse_spec, spec_name  # noqa: E402

SETTINGS = [spec_name(*setting).removeprefix("horizon-") for setting in SWEEP_SETTINGS]
RECORDS = "docs/horizon_runs"
THRESHOLD = 0.5  # held-out accuracy that counts as learned (from about 0.2 at step 0)
GSPO = "gspo=grpo --importance-level sequence --aggregation seq-mean"  # GSPO's sequence ratio and loss (testbed.md)


def samples_to_threshold(result):
    """Training samples (rollouts x samples per rollout) before the first evaluation at or above THRESHOLD."""
    with open(os.path.join(result["folder"], "config.json")) as handle:
        config = json.load(handle)
    per_step = config["prompts_per_step"] * config["samples_per_prompt"]
    step = next((step for step, accuracy in result["curve"] if accuracy >= THRESHOLD), None)
    return None if step is None else step * per_step


def table(setting, by_method):
    """Markdown: one row per method for one setting, with Welch's t against GRPO."""
    lines = [f"`builtin:horizon-{setting}`", "",
             "| method | seeds | first | last | gain | area | samples to {:.0%} (reached) | EV (middle) | EV (last) | "
             "EV >= {} from step | CPU min | MC tokens | gain vs GRPO (p) | area vs GRPO (p) |".format(
                 THRESHOLD, EV_TARGET), "|---" * 14 + "|"]
    base = by_method.get("grpo", [])
    for method, rows in by_method.items():
        samples = [samples_to_threshold(r) for r in rows]
        cells = [interval([r[key] for r in rows], 100) for key in ("first", "last", "gain", "auc")]
        reached = [s for s in samples if s is not None]
        cells.append(f"{interval(reached, 1, 0)} ({len(reached)}/{len(rows)})")
        cells += [interval([r["ev_middle"] for r in rows], 1, 2), interval([r["ev_last"] for r in rows], 1, 2)]
        cells.append(", ".join("-" if r["ev_reaches"] is None else str(r["ev_reaches"]) for r in rows)
                     if rows[0]["ev_middle"] is not None else "-")  # per seed; -: never
        cells.append(interval([r["cpu_s"] for r in rows], 1 / 60))
        tokens = [r["mc_tokens"] for r in rows]
        cells.append(f"{statistics.mean(tokens):,.0f}" if any(tokens) else "-")
        for key in ("gain", "auc"):
            tested = welch([r[key] for r in rows], [r[key] for r in base]) if method != "grpo" else None
            difference = 100 * (statistics.mean(r[key] for r in rows) - statistics.mean(r[key] for r in base)) \
                if base and method != "grpo" else None
            cells.append("-" if difference is None else f"{difference:+.1f}" + (
                "" if tested is None else f" ({tested[2]:.2f})"))
        lines.append(f"| {method} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(by_setting):
    """Markdown: each method's area under the curve minus GRPO's per setting, in points, with Welch's p (bold below
    0.05) and, under 3 seeds, the seeds run; GRPO's own area on the first row."""
    settings = list(by_setting)
    lines = ["Area under the curve against GRPO's, points (Welch p; bold: p < 0.05)", "",
             "| method | " + " | ".join(f"`{s}`" for s in settings) + " |", "|---" * (len(settings) + 1) + "|"]
    methods = list(dict.fromkeys(m for rows in by_setting.values() for m in rows))
    for method in ["grpo", *(m for m in methods if m != "grpo")]:
        cells = []
        for setting in settings:
            rows, base = by_setting[setting].get(method, []), by_setting[setting].get("grpo", [])
            if not rows or not base:
                cells.append("-")
                continue
            area, base_area = (100 * statistics.mean(r["auc"] for r in runs) for runs in (rows, base))
            tested = welch([r["auc"] for r in rows], [r["auc"] for r in base]) if method != "grpo" else None
            notes = [f"{tested[2]:.2f}"] if tested else []
            notes += [f"{len(rows)} seed{'s' * (len(rows) > 1)}"] if len(rows) < 3 else []
            cell = (f"{area:.1f}" if method == "grpo" else f"{area - base_area:+.1f}") + (
                f" ({', '.join(notes)})" if notes else "")
            cells.append(f"**{cell}**" if tested and tested[2] < 0.05 else cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(results, out):
    """Gain and area under the curve against H, one line per method (K = 1, decisions first; K = 3 dashed), 95%
    intervals as bands; K = 1 with the decisions last as crosses at its H."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    methods = list(dict.fromkeys(m for m, *_ in results))
    colors = dict(zip(methods, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    for axis, key, title in zip(axes, ("gain", "auc"), ("gain (points)", "area under the curve (points)")):
        for method in methods:
            for k, late, style in ((1, False, "-"), (3, False, "--"), (1, True, "x")):
                points = sorted((h, [100 * r[key] for r in rows]) for (m, kk, h, ll), rows in results.items()
                                if m == method and kk == k and ll == late and rows)
                if not points:
                    continue
                hs, means = [h for h, _ in points], [statistics.mean(v) for _, v in points]
                half = [T95.get(len(v) - 1, 1.96) * statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0
                        for _, v in points]  # Student t, as the tables
                label = method if (k, late) == (1, False) else None
                if style == "x":
                    axis.errorbar(hs, means, half, fmt="x", color=colors[method], capsize=3)
                    continue
                axis.plot(hs, means, style, marker="o", color=colors[method], label=label)
                if k == 1:
                    axis.fill_between(hs, [m - h for m, h in zip(means, half)], [m + h for m, h in zip(means, half)],
                                      color=colors[method], alpha=0.12)
        axis.set_xscale("symlog", linthresh=64)
        ticks = sorted({h for _, _, h, _ in results})
        axis.set_xticks(ticks, [str(h) for h in ticks])
        axis.set_xlabel("H, irrelevant tokens per response")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8, ncol=2)
    fig.suptitle("builtin:horizon: K = 1 (solid, 95% bands), K = 3 (dashed), K = 1 decisions last (x)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main():
    parser = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),  # what it does, how
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", default=SETTINGS, help="k<K>-h<H>[-late] each")
    parser.add_argument("--methods", nargs="+", default=None, help="trainer files, or NAME=FILE FLAGS "
                        "(demo_table.py's): every trainer and GSPO by default")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (each with OMP_NUM_THREADS threads)")
    parser.add_argument("--records", default=RECORDS)
    parser.add_argument("--output-dir", default="runs/horizon")
    parser.add_argument("--from-results", action="store_true", help="no runs: the tables and figure from --records")
    parser.add_argument("--figure", default=None, help="where to draw the figure (default: <records>/horizon.png for "
                        "every method, none when --methods picks some, so a subset does not replace it)")
    args, extra = parser.parse_known_args()
    if args.figure is None:  # the full figure, or none for a subset of the methods
        args.figure = os.path.join(ROOT, args.records, "horizon.png") if args.methods is None else ""
    args.methods = args.methods or [*METHODS, GSPO]
    for spec in [m for m in args.methods if "=" in m]:  # NAME=FILE FLAGS, as demo_table.py takes them
        name, command = spec.split("=", 1)
        VARIANTS[name.strip()] = (shlex.split(command)[0].removesuffix(".py"), shlex.split(command)[1:])
    args.methods = [m.split("=", 1)[0].strip() for m in args.methods]
    for setting in args.settings:
        parse_spec(f"horizon-{setting}", "--settings")
    todo = []
    for setting in args.settings:
        records, flags = os.path.join(args.records, setting), ["--preset", "horizon", "--dataset",
                                                                f"builtin:horizon-{setting}", *extra]
        present = os.path.isdir(os.path.join(ROOT, records))
        kept = {(r["method"], r["seed"]): r for r in read_records(os.path.join(ROOT, records), args.methods)} \
            if present else {}
        for seed in args.seeds:
            for method in args.methods:
                command = run_command(method, seed, f"{args.output_dir}/{setting}", flags)
                if (method, seed) in kept and run_flags(kept[method, seed]["command"]) != run_flags(command):
                    raise SystemExit(f"{records}/{method}_s{seed} was kept from a run with other flags")
                if (method, seed) not in kept and not args.from_results:
                    todo.append((method, seed, f"{args.output_dir}/{setting}", flags, records))
    print(f"{len(todo)} runs to go", flush=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        jobs = {pool.submit(run, method, seed, output, flags, 0, records): (method, seed, records)
                for method, seed, output, flags, records in todo}
        for job in concurrent.futures.as_completed(jobs):
            method, seed, records = jobs[job]
            try:
                result = job.result()
            except RuntimeError as error:  # a failed run: its output's end; the others go on
                print(error, flush=True)
                continue
            print(f"{records}/{method}_s{seed}: {100 * result['first']:.1f}% -> {100 * result['last']:.1f}%, "
                  f"{result['cpu_s'] / 60:.1f} CPU min", flush=True)
    results, by_setting, tables = {}, {}, []
    shown = {s: parse_spec(f"horizon-{s}") for s in args.settings}  # (K, H, late): shown by late, K, H
    for setting in sorted(args.settings, key=lambda s: (shown[s][2], *shown[s][:2])):
        folder = os.path.join(ROOT, args.records, setting)
        if not os.path.isdir(folder):
            continue
        k, h, late = parse_spec(f"horizon-{setting}")
        found = read_records(folder, args.methods)
        by_method = {m: sorted((r for r in found if r["method"] == m), key=lambda r: r["seed"]) for m in args.methods}
        by_method = {m: rows for m, rows in by_method.items() if rows}
        for method, rows in by_method.items():
            results[method, k, h, late] = rows
        if by_method:
            by_setting[setting] = by_method
            tables.append(table(setting, by_method))
    if by_setting:
        print("\n" + "\n\n".join([summary(by_setting), *tables]))
    if results and args.figure:
        print("\nfigure:", figure(results, args.figure))


if __name__ == "__main__":
    main()
