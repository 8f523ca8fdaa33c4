"""Learning curves of several runs side by side, read back from their metrics.jsonl, into one PNG:

    python -m infra.plot runs/demo_table/demo_* --out runs/demo.png

Runs whose folder names differ only in the seed (`..._s<seed>` and what follows) form one group, drawn as the mean
over seeds with a band from the lowest to the highest seed; one colour per group. Panels: held-out accuracy,
training reward, response length, critic value loss, explained variance, approximate KL (a panel is left out when
no run logs its metric).
"""
import argparse
import json
import os
import re
from collections import defaultdict

import numpy as np

PANELS = [("eval/accuracy", "held-out accuracy"), ("reward", "training reward"), ("response_length", "response length"),
          ("value_loss", "critic value loss"), ("explained_variance", "explained variance"),
          ("approx_kl", "approx. KL to the old policy")]


def read_run(run_dir):
    """{metric: {step: value}} from a run folder's metrics.jsonl (a step logged twice, after a resume: the last)."""
    series = defaultdict(dict)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        for line in handle:
            record = json.loads(line)
            for key, value in record.items():
                if key != "step":
                    series[key][record["step"]] = value
    return series


def group_name(run_dir):
    """The run's name without its seed: `demo_ppo_s2` and `demo_ppo_s0` are both `demo_ppo`."""
    return re.sub(r"_s\d+(_.*)?$", "", os.path.basename(os.path.normpath(run_dir)))


def curves(runs, metric):
    """(steps, mean, low, high) over the runs that log `metric`, on the steps they all logged; None if none do."""
    logged = [run[metric] for run in runs if metric in run]
    if not logged:
        return None
    steps = sorted(set.intersection(*(set(values) for values in logged)))
    values = np.array([[values[step] for step in steps] for values in logged])
    return np.array(steps), values.mean(0), values.min(0), values.max(0)


def plot(run_dirs, out, title=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups = defaultdict(list)
    for run_dir in run_dirs:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            groups[group_name(run_dir)].append(read_run(run_dir))
    if not groups:
        raise SystemExit(f"no metrics.jsonl in {' '.join(run_dirs)}")
    panels = [(key, label) for key, label in PANELS if any(key in run for runs in groups.values() for run in runs)]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, label) in zip(axes.flat, panels):
        for index, (name, runs) in enumerate(sorted(groups.items())):
            result = curves(runs, key)
            if result is None:
                continue
            steps, mean, low, high = result
            colour = colours[index % len(colours)]
            axis.plot(steps, mean, color=colour, marker="o" if len(steps) < 8 else None, ms=3,
                      label=f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
            if len(runs) > 1:
                axis.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_axis_off()
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title or "mean over seeds; band: lowest to highest seed")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    figure.savefig(out, dpi=110)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (runs/<run>), each with a metrics.jsonl")
    parser.add_argument("--out", default="runs/curves.png", help="the PNG to write")
    parser.add_argument("--title", default="", help="the figure's title")
    args = parser.parse_args()
    print(plot(args.runs, args.out, args.title))


if __name__ == "__main__":
    main()
