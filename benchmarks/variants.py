"""One trainer's demo preset against flag changes, on several seeds: docs/methods.md's TPPO experiments.

    OMP_NUM_THREADS=1 python benchmarks/variants.py tppo --seeds 0 1 2 --jobs 15 --eval-every 5 --probe-every 10 \\
        --variant "top-p 0.95=--top-p 0.95" --variant "lam-actor 0.95=--lam-actor 0.95" \\
        --variant "critic-lr 1e-4=--critic-lr 1e-4" --variant "separate head=--critic-head separate" \
        --preset-from runs/demo_table    # the preset's runs: demo_table.py's, with the same seeds and flags
    python benchmarks/variants.py tppo --seeds 0 1 2 --variant ... --from-runs   # the table again, no runs

Each variant `NAME=FLAGS` runs `python <trainer>.py --seed S` with FLAGS added, in <output-dir>/<NAME>/ (the
preset itself runs as `preset`); other unknown flags go to every run. The numbers per run are demo_table.py's
(summarize): gain and area under the curve in points, steps to 80% of the gain, and means over the middle third
of the run of the critic's explained variance, its probe sign accuracy (the run's probes), and the tracking critic's
z_0, mean increment and last-token logit with the critic's gradient norm before clipping. Mean ± 95% interval over
seeds; `*` marks a variant whose gain or area under the curve differs from the preset's beyond seed noise (Welch).
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.demo_table import interval, run, summarize, welch_differs  # noqa: E402

COLUMNS = [("gain", "gain", 100, 1), ("auc", "area under curve", 100, 1), ("steps_to_80", "steps to 80%", 1, 0),
           ("explained_variance", "EV (middle)", 1, 2), ("sign_accuracy", "probe sign accuracy", 1, 2),
           ("critic_z0", "z0", 1, 2), ("critic_increment", "mean increment", 1, 3),
           ("critic_last_logit", "last logit", 1, 2), ("critic_grad_norm", "critic grad norm", 1, 1)]


def value(result, key):
    return result["middle"].get(key) if key in result.get("middle", {}) else result.get(key)


def table(trainer, results):
    """Markdown: a row per variant (results: {variant: [per-seed summaries]})."""
    shown = [c for c in COLUMNS if any(value(r, c[0]) is not None for rows in results.values() for r in rows)]
    lines = [f"| `{trainer}.py` | seeds | " + " | ".join(title for _, title, _, _ in shown) + " |",
             "|---|---|" + "---|" * len(shown)]
    base = results.get("preset", [])
    for name, rows in results.items():
        cells = []
        for key, _, scale, digits in shown:
            cell = interval([value(r, key) for r in rows], scale, digits)
            if name != "preset" and key in ("gain", "auc") and welch_differs([r[key] for r in base],
                                                                              [r[key] for r in rows]):
                cell += " *"
            cells.append(cell)
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trainer")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS, e.g. 'top-p 0.95=--top-p 0.95'")
    parser.add_argument("--output-dir", default="runs/variants")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (each with OMP_NUM_THREADS threads)")
    parser.add_argument("--probe-every", type=int, default=0, help="critic probe every N steps")
    parser.add_argument("--from-runs", action="store_true", help="no runs: the table from the run folders")
    parser.add_argument("--preset-from", default="", help="the preset's runs are there already, not run again: "
                        "e.g. runs/demo_table, where demo_table.py ran the same command (same seeds and flags)")
    args, extra = parser.parse_known_args()
    variants = {"preset": [], **{name.strip(): shlex.split(flags) for name, flags in
                                 (spec.split("=", 1) for spec in args.variant)}}
    folder = lambda name: args.preset_from if name == "preset" and args.preset_from else os.path.join(  # noqa: E731
        args.output_dir, variant_dir(name))
    done = {name for name in variants if args.from_runs or name == "preset" and args.preset_from}
    results = {name: [] for name in variants}
    for name in done:  # the table from the run folders: finished runs only
        for seed in args.seeds:
            records = finished(os.path.join(ROOT, folder(name), f"demo_{args.trainer}_s{seed}"))
            if records:
                results[name].append(summarize(records))
    if not args.from_runs:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            jobs = {pool.submit(run, args.trainer, seed, folder(name), [*extra, *flags], args.probe_every): name
                    for seed in args.seeds for name, flags in variants.items() if name not in done}
            for job in concurrent.futures.as_completed(jobs):
                try:
                    result = job.result()
                except RuntimeError as error:  # a failed run: its output's end, the others go on
                    print(error, flush=True)
                    continue
                print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
                results[jobs[job]].append(result)
    print(table(args.trainer, {name: rows for name, rows in results.items() if rows}))


def finished(run_dir):
    """The run's metrics.jsonl records if it ran all of its --steps (config.json), else None (missing or running)."""
    try:
        with open(os.path.join(run_dir, "config.json")) as handle:
            steps = json.load(handle)["steps"]
        with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle]
    except FileNotFoundError:
        return None
    return records if len(records) >= steps else None


def variant_dir(name):
    """A variant's folder name: its name with anything but letters, digits, '.', '_' and '-' made '_'."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


if __name__ == "__main__":
    main()
