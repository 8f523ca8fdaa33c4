"""The GPU check's table (benchmarks/gpu_check.py): one Markdown table per part, in the order the parts ran, and the
verdict line. A run the budget left out shows as "not run (budget spent)"."""
import math
import os
import time

NOT_RUN = "not run (budget spent)"


def gib(value):
    return f"{value:.2f}" if value is not None and math.isfinite(value) else "-"


def layers(count):
    return f"{count} layer" + "s" * (count != 1)


def verdict(result):
    return "ok" if not result["problems"] else "FAIL: " + "; ".join(result["problems"])[:200].replace("|", "/")


def updates(check):
    s, rules, cuda = check.scale["update"], check.rules, check.device == "cuda"
    shape = ", ".join([layers(s["layers"])] + [f"{k}={v}" for k, v in s["overrides"].items()])
    lines = [f"1. Real-size updates: {s['shape']} ({shape}), 1 x ({s['prompt']:,} + {s['long_response']:,}) and "
             f"{s['short_count']} x ({s['prompt']:,} + {s['short_response']:,}) tokens in micro-batches of "
             f"{s['micro_batch_tokens']:,} tokens, checkpointing, bf16 autocast", "",
             "| update | micro-batches | peak GiB: allocated / reserved / host | plan GiB | plan / peak | update s | "
             "tokens/s | MFU | s | result |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in check.part_results("updates"):
        if r.get("skipped"):
            lines.append(f"| {name[7:]} | {NOT_RUN} | | | | | | | | |")
            continue
        shapes = ", ".join(f"{rows}x{width}" for rows, width in r["micro_batches"] or [])
        runs = r.get("peaks_gib") or []
        host = gib(r["host_gib"]) + (f" (least of {', '.join(map(gib, runs))})" if len(runs) > 1 and not cuda else "")
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-"
        reserved = f"; whole plan / reserved {r['reserved_ratio']:.2f}" if math.isfinite(
            r.get("reserved_ratio") or math.nan) else ""
        lines.append(f"| {name[7:]} | {shapes or '-'} | {gib(r['peak_gib']) if cuda else '-'} / "
                     f"{gib(r['reserved_gib']) if cuda else '-'} / {host} | {gib(r['planned_gib'])} | "
                     f"{r['ratio']:.2f}{'' if r['asserted'] else ' (reported)'}{reserved} | {r['update_s']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['seconds']:.0f} | {verdict(r)} |")
    peak = "max_memory_allocated" if cuda else \
        f"the resident high-water mark, the least of {check.scale['update_runs']} runs at once"
    return lines + ["", f"Peak ({peak}) against infra.memory.plan's rows for the same setup (on a GPU all but "
                        f"fragmentation, which the whole plan / reserved reports): plan / peak within 1 +- "
                        f"{rules['PLAN_TOL']}. Reserved and host peaks reported. Update s: one mini-batch's forward, "
                        f"backward and AdamW step (after a first, untimed); MFU: bench_update.update_flops / time / "
                        f"989 TFLOP/s."]


def trainers(check):
    rules = check.rules
    lines = [f"2. Trainers: 3 steps each on the tiny model, bf16, the HF engine, {check.scale['jobs']} at once", "",
             "| trainer | exit, s | reward by step | abs(ratio - 1), 1st mini-batch: mean / q99 / past 0.2 | log-prob "
             "gap: mean / q99 / past 0.2 | direction by step | grad norm min | result |",
             "|---|---|---|---|---|---|---:|---|"]
    for name, r in check.part_results("trainers"):
        label = r.get("label", f"{name}.py")
        if r.get("skipped"):
            lines.append(f"| {label} | {NOT_RUN} | | | | | | |")
            continue
        steps = list(r["report"].values())

        def worst(key):  # the worst step's mean, q99 and fraction past 0.2
            return " / ".join(f"{max([s.get(key, {}).get(stat, math.nan) for s in steps] or [math.nan]):.1e}"
                              for stat in ("mean", "q99", "clipped"))
        directions = " ".join("-" if s.get("direction") is None else f"{s['direction']:+.2f}" for s in steps)
        rewards = " ".join(f"{x.get('reward', math.nan):.3f}" for x in r["records"])
        grad = min([x.get("grad_norm", math.nan) for x in r["records"]] or [math.nan])
        lines.append(f"| {label} | {r['status']}, {r['seconds']:.0f} | {rewards} | {worst('ratio')} | "
                     f"{worst('gap')} | {directions or '-'} | {grad:.3g} | {verdict(r)} |")
    bounds = ", ".join(f"{k} <= {v:.2g}" for k, v in rules["BF16_BOUNDS"].items())
    return lines + ["", f"At every step (the worst shown): reward > 0, grad norm > 0, every figure finite; abs(ratio - "
                        f"1) and the engine/trainer log-prob gap (top-p's term allowed for): {bounds} (clipped: the "
                        f"fraction of tokens past 0.2); that ratio's mean at most {rules['FRESH_FRACTION']:.2f} of "
                        f"the update's mean token change (stale old log-probs); at top-p < 1 the engine's log-probs "
                        f"showing at least {rules['NUCLEUS_EXPLAINED']} of top-p's term; the policy loss blind to "
                        f"padding; no gradient where the clip binds. Over the run: the mean direction (the "
                        f"correlation of reward with the update's change of a sample's log-prob) > "
                        f"{rules['DIRECTION_MIN']}, the mean change of a sample's log-prob >= "
                        f"{rules['CHANGE_MIN']}."]


def compare(check):
    rules, results = check.rules, check.results
    lines = ["3. Compare: ppo.py in float32", "", "| check | measured | bound | s | result |", "|---|---|---|---:|---|"]
    if results.get("float32", {}).get("skipped"):
        return lines + [f"| ppo.py float32 runs | {NOT_RUN} | | | |"]
    r = results.get("float32")
    if r:
        lines.append(f"| 3 steps straight: max abs(ratio - 1), 1st mini-batch; max log-prob gap | {r['ratio_max']:.1e};"
                     f" {r['gap_max']:.1e} | <= {rules['FLOAT32_BOUNDS']['max']} | {r['seconds']:.0f} | "
                     f"{verdict(r)} |")
    r = results.get("resume")
    if r:
        warned = len(r["nondeterministic_warnings"])
        lines.append(f"| 2 steps + --resume vs 3 straight | max relative difference {r['max_relative_difference']:.1e}"
                     + f" ({warned} warnings of nondeterministic operations: gpu_check.json)" * bool(warned) +
                     f" | <= {rules['RESUME_TOL']} | {r['seconds']:.0f} | {verdict(r)} |")
    r = results.get("offload")
    if r:
        lines.append(f"| --offload-optimizer vs straight | step 0: {r['step0_relative_difference']:.1e}; steps 0-2: "
                     f"{r['relative_difference']:.1e}; final weights: {r['weights_max_abs_difference']:.1e} | step 0 "
                     f"<= {rules['OFFLOAD_TOL']} | {r['seconds']:.0f} | {verdict(r)} |")
    return lines


def speed(check):
    s, cuda = check.scale["generate"], check.device == "cuda"
    lines = [f"4. Speed (reported, not asserted): the HF engine on {s['shape']}"
             f"{' (scaled as above)' * bool(s['overrides'])}, {s['sequences']} sequences x {s['new_tokens']:,} new "
             f"tokens after {s['prompt']}-token prompts", "",
             "| generate | tokens/s | s per step | peak GiB: allocated / reserved / host | plan GiB | plan / peak "
             "| s |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for name, r in check.part_results("speed"):
        if r.get("skipped"):
            lines.append(f"| {layers(r['layers'])} | {NOT_RUN} | | | | | |")
        elif "per_layer_s" in r and math.isnan(r["step_s"]):
            lines.append(f"| {r['layers']} layers: not extrapolated, a layer's time below the noise (b = "
                         f"{1e3 * r['per_layer_s']:.2f} ms) | - | - | - | - | - | - |")
        elif "per_layer_s" in r:
            lines.append(f"| {r['layers']} layers: extrapolated, a + b x layers (b = {1e3 * r['per_layer_s']:.2f} ms) "
                         f"| {r['tokens_per_s']:,.0f} | {r['step_s']:.4f} | - | - | - | - |")
        else:
            peak = f"{gib(r['peak_gib'])} / {gib(r['reserved_gib'])} / -" if cuda else f"- / - / {gib(r['peak_gib'])}"
            lines.append(f"| {layers(r['layers'])}{'' if not r['problems'] else ': ' + verdict(r)} | "
                         f"{r['tokens_per_s']:,.0f} | {r['step_s']:.4f} | {peak} | {gib(r['planned_gib'])} | "
                         f"{r['ratio']:.2f} | {r['seconds']:.0f} |")
    return lines


def table(check, shown, cut=None):
    """(Markdown text, exit status) of a gpu_check.Check's results for the parts in `shown`, in its order; cut: the
    part a signal stopped (its rows so far are shown)."""
    lines = [f"GPU check, {check.results['machine']}"]
    for part in shown:
        lines += [""] + globals()[part](check)
    results = [(name, r) for name, r in check.results.items() if isinstance(r, dict)]
    failed = [name for name, r in results if r["problems"]]
    skipped = [name for name, r in results if r.get("skipped")]
    missing = [part for part in check.parts if part not in shown or part == cut]
    lines += ["", f"total {time.time() - check.started:.0f} s; " + (
        f"FAILED: {', '.join(failed)}" if failed else "every check that ran passed" if missing or skipped else
        "every check passed") + (f"; CUT during {cut}" if cut else "") + "".join(
        f"; {what}: {', '.join(names)}" for what, names in (("parts not run", missing), (NOT_RUN, skipped)) if names)
        + (f"; load {os.getloadavg()[0]:.2f} at the end" if check.device == "cpu" else "")]
    status = 124 if cut else 1 if failed else 3 if missing or skipped else 0
    return "\n".join(lines), status
