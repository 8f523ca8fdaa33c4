"""Learning curves of several runs side by side, read back from their metrics.jsonl, into one PNG:

    python -m infra.plot runs/demo_table/demo_* --out runs/demo.png

Runs whose folder names differ only in the seed (`..._s<seed>` and what follows) form one group, drawn as the mean
over seeds with a band from the lowest to the highest seed (the title says so when a group has several seeds). Each
group has its own colour, line style and marker, the first drawn widest, so curves that coincide (a fork that
changes only the loss has its parent's reward curve) still show each run. Panels: held-out accuracy, training
reward, response length, policy loss, policy gradient norm, critic value loss, critic gradient norm, explained
variance, approximate KL (a panel is left out when no run logs its metric). Steps are integers: the x ticks are too.
"""
import argparse
import json
import os
import re
from collections import defaultdict

import numpy as np

PANELS = [("eval/accuracy", "held-out accuracy"), ("reward", "training reward"), ("response_length", "response length"),
          ("policy_loss", "policy loss"), ("grad_norm", "policy gradient norm"), ("value_loss", "critic value loss"),
          ("critic_grad_norm", "critic gradient norm"), ("explained_variance", "explained variance"),
          ("approx_kl", "approx. KL to the old policy")]
LINE_STYLES, MARKERS = ["-", "--", ":", "-."], ["o", "s", "^", "D", "v", "x", "P", "*"]
SEEDS_NOTE = "mean over seeds; band: lowest to highest seed"


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


def figure(run_dirs, title=""):
    """The matplotlib Figure of the runs' curves: one axis per panel that some run logs, titled with its label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    groups = defaultdict(list)
    for run_dir in run_dirs:
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            groups[group_name(run_dir)].append(read_run(run_dir))
    if not groups:
        raise SystemExit(f"no metrics.jsonl in {' '.join(run_dirs)}")
    panels = [(key, label) for key, label in PANELS if any(key in run for runs in groups.values() for run in runs)]
    columns = min(3, len(panels))
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (key, label) in zip(axes.flat, panels):
        for index, (name, runs) in enumerate(sorted(groups.items())):
            result = curves(runs, key)
            if result is None:
                continue
            steps, mean, low, high = result
            colour, below = colours[index % len(colours)], (len(groups) - 1 - index) / max(1, len(groups) - 1)
            axis.plot(steps, mean, color=colour, linestyle=LINE_STYLES[index % len(LINE_STYLES)],  # drawn later:
                      marker=MARKERS[index % len(MARKERS)], markevery=max(1, len(steps) // 12),  # thinner, on top
                      linewidth=1.2 + 2 * below, ms=4 + 4 * below, markerfacecolor="none",
                      label=f"{name} ({len(runs)} seed{'s' * (len(runs) > 1)})")
            if len(runs) > 1:
                axis.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # a 2-step run: ticks 0 and 1, never 0.25
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels):]:
        axis.set_axis_off()
    axes.flat[0].legend(fontsize=8)
    several_seeds = any(len(runs) > 1 for runs in groups.values())
    heading = "; ".join(part for part in (title, SEEDS_NOTE if several_seeds else "") if part)
    if heading:
        fig.suptitle(heading)
    fig.tight_layout()
    return fig


def plot(run_dirs, out, title=""):
    """Write the runs' figure to the PNG `out`; returns `out`."""
    fig = figure(run_dirs, title)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
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
