"""The benchmark scripts the README sends a reader to, each run at a small size: benchmarks/trl_compare.py's
project side (TRL's side needs trl, an optional install, and is not run here) and benchmarks/critic_ceiling.py. Their
full runs and figures are in the README and docs/scaling.md."""
import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = r"(-?\d+\.\d+)"


def run_script(*argv):
    done = subprocess.run([sys.executable, *argv], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_trl_compare_times_whole_steps_and_their_phases():
    """One timing per rollout after the first: the step's wall and CPU time, and the rollout and update phases that
    grpo.py logged for that step, which lie inside it."""
    printed = run_script("benchmarks/trl_compare.py", "--side", "project", "--rollouts", "3")
    timings = json.loads([line for line in printed.splitlines() if line.startswith("{")][-1])
    assert {key: len(values) for key, values in timings.items()} == dict(
        seconds=3, cpu_seconds=3, rollout=3, update=3, rollout_tokens_per_s=3, update_tokens_per_s=3)
    steps = zip(timings["seconds"], timings["cpu_seconds"], timings["rollout"], timings["update"],
                timings["rollout_tokens_per_s"], timings["update_tokens_per_s"])
    for seconds, cpu_seconds, rollout, update, rollout_speed, update_speed in steps:
        assert rollout > 0 and update > 0 and rollout + update < seconds + 0.01  # two clocks: 10 ms of slack
        assert rollout_speed > 0 and update_speed > 0
        assert 0 < cpu_seconds < 2 * seconds  # one torch thread: CPU time stays near the wall time, never twice it


def test_trl_compare_divides_each_pair_by_its_own_project_run():
    """The ratio is taken pair by pair (the i-th TRL run over the i-th project run of the same dtype, run side by side
    in time), not as a ratio of medians; a project run without the key's time (0) gives no ratio."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from trl_compare import pair_ratios
    trl = [dict(seconds=66.0), dict(seconds=80.0), dict(seconds=50.0)]
    project = [dict(seconds=42.0), dict(seconds=40.0), dict(seconds=0.0)]
    assert pair_ratios(trl, project, "seconds") == [66.0 / 42.0, 2.0]
    assert pair_ratios(trl[:1], project, "seconds") == [66.0 / 42.0]  # a side that ran fewer times: its pairs only


@pytest.mark.parametrize("dataset, policy", [("builtin:3", "tiny"), ("builtin:horizon-k1-h64", "horizon")])
def test_critic_ceiling_reports_the_monte_carlo_and_fitted_critics(dataset, policy):
    """Shrunk by its size flags: success at temperature 1 over train and test together, then the Monte Carlo values' and
    the fitted critic's explained variance, pooled and by position, each at most 1; the horizon task with its model."""
    printed = run_script("benchmarks/critic_ceiling.py", "--dataset", dataset, "--train", "16", "--test", "16",
                         "--mc-responses", "2", "--continuations", "2", "--epochs", "2", "--batch", "8",
                         "--lrs", "1e-3")
    assert f"policy {policy}: success" in printed
    success, train, test = map(float, re.search(
        rf"success at temperature 1 {NUMBER} \(train {NUMBER}, test {NUMBER}\)", printed).groups())
    assert abs(success - (train + test) / 2) < 2e-3  # equal halves, each printed to 3 decimals
    lines = [line for line in printed.splitlines() if " EV " in line]
    assert len(lines) == 3 and lines[0].startswith("perfect (Monte Carlo, K=2, 2 responses, every 2nd state)")
    assert lines[1].startswith("fit lr 0.001 epoch 1 (2 steps,")  # 16 training responses in batches of 8
    assert lines[2].startswith("fit lr 0.001 epoch 2 (4 steps,")
    for line in lines:
        pooled = float(re.search(rf"EV {NUMBER}", line).group(1))
        by_position = [float(v) for v in re.findall(rf"\) {NUMBER}", line.split("by position:")[1])]
        assert pooled <= 1 and len(by_position) == 6 and max(by_position) <= 1, line


def test_demo_table_summarizes_a_run_from_its_records(monkeypatch):
    """benchmarks/demo_table.summarize on hand-written records: 80% of a 0.1 -> 0.6 gain is 0.5, first met at step 10;
    the middle third of 6 records is records 2-4; explained variance first reaches 0.2 at step 11 (0.19: no)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import demo_table
    steps, evs = [0, 1, 10, 11, 20, 21], [-1.0, 0.1, 0.19, 0.2, 0.4, 0.0]
    records = [dict(step=step, explained_variance=ev) for step, ev in zip(steps, evs)]
    for record, accuracy in zip(records[::2], (0.1, 0.5, 0.6)):  # evaluations at steps 0, 10 and 20
        record["eval/accuracy"] = accuracy
    summary = demo_table.summarize(records)
    assert summary["steps_to_80"] == 10 and abs(summary["gain"] - 0.5) < 1e-12
    assert abs(summary["ev_middle"] - (0.19 + 0.2 + 0.4) / 3) < 1e-12 and summary["ev_reaches"] == 11
    assert demo_table.summarize([dict(step=0, **{"eval/accuracy": 0.1})])["ev_reaches"] is None
    for record, anchors in zip(records, (9.0, 9.0, 0.5, 0.25, 0.0, 9.0)):  # SP3O's EV where its critic is trained
        record["explained_variance_anchors"] = anchors
    assert demo_table.summarize(records)["middle"]["explained_variance_anchors"] == (0.5 + 0.25 + 0.0) / 3
    # the own settings column: each file's TINY_PRESET as written, the shared ones nowhere
    assert demo_table.own_settings("ppo") == "critic_warmup=5" and demo_table.own_settings("grpo") == "-"
    assert demo_table.own_settings("sppo") == "prompts_per_step=512, samples_per_prompt=1"


def test_demo_table_runs_a_file_with_its_own_flags_under_its_own_name(monkeypatch):
    """`--methods "gspo=grpo --importance-level sequence"`: grpo.py runs with the flags, its run and records named
    gspo; its own settings are grpo.py's plus the flags; its parent is grpo (the same file)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import demo_table
    monkeypatch.setitem(demo_table.VARIANTS, "gspo", ("grpo", ["--importance-level", "sequence"]))
    command = demo_table.run_command("gspo", 3, "runs/x", ["--steps", "2"])
    assert command[1:] == ["grpo.py", "--seed", "3", "--run-name", "demo_gspo_s3", "--output-dir", "runs/x", "--steps",
                           "2", "--importance-level", "sequence"]
    assert demo_table.own_settings("gspo") == "--importance-level sequence" and demo_table.file_of("gspo") == "grpo"
    assert demo_table.parent("gspo", ["ppo", "grpo", "gspo"]) == "grpo"
    assert demo_table.run_command("ppo", 0, "runs/x", [])[1] == "ppo.py"  # a plain method: its own file


def test_variants_table_marks_a_difference_beyond_seed_noise():
    """benchmarks/variants.table: a variant whose gains (0.30, 0.31, 0.32) are far from the preset's (0.60, 0.61,
    0.62) gets a `*`; one within noise does not; the mean of 30.0, 31.0, 32.0 points is 31.0, +- t(2) * 1 / sqrt(3)."""
    import benchmarks.variants as variants
    row = lambda gain, auc: dict(gain=gain, auc=auc, middle=dict(critic_z0=-0.5))  # noqa: E731
    results = {"preset": [row(0.60, 0.4), row(0.61, 0.41), row(0.62, 0.42)],
               "worse": [row(0.30, 0.4), row(0.31, 0.41), row(0.32, 0.42)]}
    lines = variants.table("tppo", results).splitlines()
    assert lines[0].startswith("| `tppo.py` | seeds | gain | area under curve | z0 |")
    worse = [cell.strip() for cell in lines[3].strip("|").split("|")]
    assert worse[:4] == ["worse", "3", f"31.0 ± {4.30 / 3 ** 0.5:.1f} *", "41.0 ± 2.5"]  # AUC: the same, no mark
    assert worse[4] == "-0.50 ± 0.00"


def test_variants_reads_finished_runs_only(tmp_path):
    """A run folder counts once its metrics.jsonl holds all of config.json's steps: a run still going (or cut) is
    left out of the table, not summarized from its first steps."""
    import benchmarks.variants as variants
    (tmp_path / "config.json").write_text(json.dumps({"steps": 3}))
    with open(tmp_path / "metrics.jsonl", "w") as handle:
        handle.write("\n".join(json.dumps({"step": step}) for step in range(2)) + "\n")
    assert variants.finished(str(tmp_path)) is None and variants.finished(str(tmp_path / "absent")) is None
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"step": 2}) + "\n")
    assert [r["step"] for r in variants.finished(str(tmp_path))] == [0, 1, 2]


def test_demo_table_welch_test_against_the_t_table(monkeypatch):
    """Two-sided p of Student's t at the t table's critical values, and Welch's t and df by hand: [1, 2, 3] against
    [4, 5, 6] has t = -3 / sqrt(2/3) = -3.674 on 4 degrees of freedom (p 0.0213)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import demo_table
    for t, df, p in ((12.706, 1, 0.05), (4.303, 2, 0.05), (2.776, 4, 0.05), (3.169, 10, 0.01), (1.96, 1e6, 0.05),
                     (0.0, 5, 1.0), (1.0, 3, 0.391)):
        assert abs(demo_table.student_t_two_sided_p(t, df) - p) < 5e-4, (t, df)
    t, df, p = demo_table.welch([1, 2, 3], [4, 5, 6])
    assert abs(t + 3 / (2 / 3) ** 0.5) < 1e-9 and abs(df - 4) < 1e-9 and abs(p - 0.0213) < 1e-4
    assert demo_table.welch_differs([1, 2, 3], [4, 5, 6]) and not demo_table.welch_differs([1, 2, 3], [2, 3, 4])
    # evaluations at the start of steps 0, 4 and 8 and after the last (step 11's) update: 0, 4, 8 and 12 updates
    records = [dict(step=step) for step in range(12)]
    for step, accuracy in ((0, 0.1), (4, 0.3), (8, 0.5), (11, 0.6)):
        records[step]["eval/accuracy"] = accuracy
    assert demo_table.summarize(records)["at_updates"] == {0: 0.1, 4: 0.3, 8: 0.5, 12: 0.6}


def test_demo_table_keeps_each_runs_records_and_tabulates_from_them_alone(tmp_path):
    """A run's records (metrics, config, the command, its CPU time) are kept as it finishes, a run stopped midway is
    started over, and --from-results prints the same table from them after the run folders are gone."""
    tiny = ["--methods", "grpo", "--seeds", "0", "--steps", "1", "--prompts-per-step", "4", "--samples-per-prompt", "2",
            "--eval-problems", "4", "--dataset", "builtin:3", "--records", str(tmp_path / "records")]
    stopped = tmp_path / "runs" / "demo_grpo_s0"  # a run stopped midway (preempted): the trainer would refuse it
    os.makedirs(stopped / "checkpoints" / "step_000001")
    stopped.joinpath("metrics.jsonl").write_text('{"step": 1}\n')
    ran = run_script("benchmarks/demo_table.py", *tiny, "--output-dir", str(tmp_path / "runs"))
    assert "holds an earlier run; starting it over" in ran
    kept = tmp_path / "records" / "grpo_s0"
    assert sorted(os.listdir(kept)) == ["command.txt", "config.json", "metrics.jsonl", "resources.json"]
    assert kept.joinpath("command.txt").read_text().startswith("OMP_NUM_THREADS=1 python grpo.py --seed 0 ")
    resources = json.loads(kept.joinpath("resources.json").read_text())
    assert 0 < resources["cpu_s"] and 0 < resources["wall_s"]
    # the run's last checkpoint (grpo.py saves one at the end) goes once the records are kept: SmolLM2's are GBs
    assert (tmp_path / "runs" / "demo_grpo_s0" / "metrics.jsonl").exists()
    assert not (tmp_path / "runs" / "demo_grpo_s0" / "checkpoints").exists()
    import shutil
    shutil.rmtree(tmp_path / "runs")
    again = run_script("benchmarks/demo_table.py", *tiny, "--from-results", "--output-dir", str(tmp_path / "none"))
    row = lambda text: next(line for line in text.splitlines() if line.startswith("| grpo |"))  # noqa: E731
    assert row(ran) == row(again) and (tmp_path / "records" / "curves.png").exists()
    # the same command again runs nothing (the run is kept); with other flags it refuses to mix the two
    resumed = run_script("benchmarks/demo_table.py", *tiny, "--output-dir", str(tmp_path / "runs"))
    assert "grpo seed 0: kept in" in resumed and row(resumed) == row(ran)
    assert not (tmp_path / "runs" / "demo_grpo_s0").exists()
    other = subprocess.run([sys.executable, "benchmarks/demo_table.py", *tiny, "--lr", "1e-4"], cwd=REPO,
                           capture_output=True, text=True)
    assert other.returncode == 1 and "was kept from a run with other flags" in other.stderr


def test_demo_table_commit_marks_code_changes_not_the_records_it_writes(tmp_path, monkeypatch):
    """A run's record names the commit its code came from, `+` when a file outside docs/ differs from it: the
    table's own records and figure (docs/real_model_runs/) change the tree while later runs start."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import demo_table
    git = lambda *argv: subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True)  # noqa
    git("init", "-q")
    (tmp_path / "docs").mkdir()
    (tmp_path / "grpo.py").write_text("x = 1\n")
    (tmp_path / "docs" / "curves.png").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    monkeypatch.setattr(demo_table, "ROOT", str(tmp_path))
    (tmp_path / "docs" / "curves.png").write_text("redrawn\n")
    assert demo_table.commit() == head
    (tmp_path / "grpo.py").write_text("x = 2\n")
    assert demo_table.commit() == head + "+"


def test_help_says_what_the_script_does_in_whole_sentences():
    """Issue 60: `benchmarks/demo_table.py --help` stopped mid-sentence (`... draw the figure: on the tiny`)."""
    for script in ("benchmarks/demo_table.py", "benchmarks/threads.py", "benchmarks/horizon_sweep.py",
                   "benchmarks/horizon_speed.py"):
        printed = run_script(script, "--help")
        description = printed.split("\n\n")[1]  # after the usage lines
        assert description.endswith("."), (script, description)


def test_prime_credit_reads_carries_and_ranks_as_released():
    """benchmarks/prime_credit.py: the carry digit after a column of 10 or more is kept (1) or dropped (0), after a
    smaller one spurious (1) or none (0); the ranking accuracy is the released compute_dpo_accuracy's: per group the
    share of (correct, wrong) pairs in order, 0.5 for a group of equal outcomes, then the mean over groups."""
    import torch

    import common
    from benchmarks import prime_credit
    tokenizer = common.load_model("tiny", "float32", "cpu")[1]
    text = "8+5+0=13 7+6+1=14 4+3+0=7 1+2+1=4 \\boxed{4743}"  # kept, dropped, spurious
    ids = tokenizer.encode(text, add_special_tokens=False)
    rewards = torch.arange(len(ids), dtype=torch.float)[None]  # each token's reward: its position
    found = prime_credit.carry_rewards(tokenizer, [ids], rewards)
    assert found == {"kept": [text.index("7+6+1") + 4], "dropped": [text.index("4+3+0") + 4],
                     "spurious": [text.index("1+2+1") + 4], "none": []}
    sums, outcomes = torch.tensor([3.0, 1.0, 2.0, 5.0, 0.0, 0.0]), torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    # group 1: (0 > 1) in order, (0 > 2) in order: 1.0; group 2: equal outcomes: 0.5
    assert prime_credit.rank_accuracy(sums, outcomes, 3) == 0.75


def test_horizon_sweep_keeps_records_and_tabulates_them_with_the_figure(tmp_path):
    """benchmarks/horizon_sweep.py: two methods (one a NAME=FILE FLAGS variant) at one setting, one step each; records
    kept per setting, then --from-results prints the same table rows and draws the figure from them alone."""
    tiny = ["--settings", "k1-h0", "--methods", "grpo", "gspo=grpo --importance-level sequence", "--seeds", "0",
            "--jobs", "1", "--records", str(tmp_path / "records"), "--steps", "1", "--prompts-per-step", "2",
            "--eval-problems", "4", "--figure", str(tmp_path / "records" / "horizon.png")]
    ran = run_script("benchmarks/horizon_sweep.py", *tiny, "--output-dir", str(tmp_path / "runs"))
    kept = tmp_path / "records" / "k1-h0"
    assert sorted(os.listdir(kept)) == ["grpo_s0", "gspo_s0"]
    assert "--preset horizon --dataset builtin:horizon-k1-h0" in (kept / "gspo_s0" / "command.txt").read_text()
    assert "--importance-level sequence" in (kept / "gspo_s0" / "command.txt").read_text()
    again = run_script("benchmarks/horizon_sweep.py", *tiny, "--from-results")
    rows = lambda text: [line for line in text.splitlines() if line.startswith(("| grpo |", "| gspo |"))]  # noqa: E731
    assert len(rows(ran)) == 4 and rows(ran) == rows(again) and "0 runs to go" in again  # the summary's and table's
    assert (tmp_path / "records" / "horizon.png").exists()


def test_horizon_summary_gives_each_method_its_area_minus_grpos_with_welchs_p():
    """The summary's cells by hand: GRPO's own area, a difference with Welch's p (bold below 0.05), the seeds under 3,
    '-' where a method has no run; a flipped difference or GRPO's row compared with itself would fail."""
    from benchmarks.horizon_sweep import summary
    runs = lambda *areas: [{"auc": a} for a in areas]  # noqa: E731
    by_setting = {"k1-h0": {"grpo": runs(0.50, 0.52, 0.48), "ppo": runs(0.40, 0.41, 0.39), "spo": runs(0.51, 0.49)},
                  "k1-h1024": {"grpo": runs(0.30), "spo": runs(0.35)}}
    lines = summary(by_setting).splitlines()
    assert lines[2] == "| method | `k1-h0` | `k1-h1024` |"
    # ppo: 40 - 50 = -10 points; Welch t = -10 / sqrt(4/3 + 1/3) = -7.75, df 2.94: p = 0.005
    assert lines[4:] == ["| grpo | 50.0 | 30.0 (1 seed) |", "| ppo | **-10.0 (0.00)** | - |",
                         "| spo | +0.0 (1.00, 2 seeds) | +5.0 (1 seed) |"]
