"""Helpers several test files share: reading a run's metrics, comparing two runs' records, killing a run to
resume it, and the trainers' tables of flags extended to forks."""
import contextlib
import difflib
import json
import os
import shutil
import signal
import subprocess
import time

import infra.checkpoint
import infra.cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def changed_lines(root, parent, name):
    """Lines `diff parent.py name.py` marks with < or > (GNU diff where there is one, else difflib)."""
    a, b = (os.path.join(root, f"{n}.py") for n in (parent, name))
    if shutil.which("diff"):
        output = subprocess.run(["diff", a, b], capture_output=True, text=True).stdout
        return sum(line[:1] in "<>" for line in output.splitlines() if line)
    with open(a) as x, open(b) as y:
        return sum(line[:1] in "+-" for line in difflib.unified_diff(x.readlines(), y.readlines(), n=0)
                   if not line.startswith(("+++", "---")))


def with_forks(table, root=REPO):
    """A test's {trainer: flags} table (keys `ppo` or `ppo.py`) for every trainer found (infra.cli.trainers): a fork
    the table lacks takes the flags of the trainer in it whose file it differs from least, so no fork is left out."""
    stems = {key[:-3] if key.endswith(".py") else key: key for key in table}
    extended = dict(table)
    for name in infra.cli.trainers(root):
        if name not in stems:
            nearest = min(stems, key=lambda known: changed_lines(root, known, name))
            extended[name + ".py" * stems[nearest].endswith(".py")] = table[stems[nearest]]
    return extended


def records(run_dir):
    """The last metrics record of each step (a resumed run logs the steps after its checkpoint again)."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        for line in handle:
            record = json.loads(line)
            by_step[record["step"]] = record
    return by_step


TIMING_KEYS = {"rollout_s", "update_s", "tokens_per_s"}  # wall-clock figures: never equal between two runs


def assert_same_records(a, b, steps, resumed_from=None, shown=("reward", "policy_loss", "grad_norm")):
    """Records a and b ({step: record}) hold steps 0..steps-1 and, at each step, exactly equal floats under every key
    both have except the timings. Returns a line per step showing the `shown` keys side by side."""
    assert sorted(a) == sorted(b) == list(range(steps))
    lines = []
    for step in range(steps):
        keys = (set(a[step]) & set(b[step])) - TIMING_KEYS
        assert {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}, step
        lines.append(f"  step {step}: " + "  ".join(f"{key} {a[step][key]:.6g} / {b[step][key]:.6g}" for key in shown)
                     + " (resumed)" * (resumed_from is not None and step >= resumed_from))
    return lines


def kill_then_resume(start, straight, killed, kill_at):
    """Start `straight` and `killed` side by side (start(run_dir, *argv) -> a Popen in its own process group); SIGKILL
    `killed` once its checkpoint step_<kill_at> appears, --resume it to the end, wait for both. Returns the step the
    killed run resumed from (kill_at, or kill_at + 1 if the next checkpoint made it in time)."""
    straight_run, killed_run = start(straight), start(killed)
    with killed_on_exit(straight_run, killed_run):
        checkpoint = os.path.join(killed, "checkpoints", f"step_{kill_at:06d}")
        deadline = time.monotonic() + 600
        while not os.path.exists(checkpoint) and killed_run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(checkpoint), killed_run.communicate()[0][-3000:]
        os.killpg(killed_run.pid, signal.SIGKILL)  # no chance to save anything
        killed_run.wait(60)
        assert killed_run.returncode == -signal.SIGKILL
        resumed_from = max(infra.checkpoint._checkpoint_steps(os.path.join(killed, "checkpoints")))
        assert resumed_from in (kill_at, kill_at + 1)  # killed as the step began, or just after it ended
        finish_resumed(start(killed, "--resume", killed), straight_run)
    return resumed_from


def finish_resumed(resumed, straight_run):
    """Wait for the resumed run and the straight one beside it; both must exit 0."""
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert straight_run.wait(600) == 0, straight_run.communicate()[0][-3000:]


@contextlib.contextmanager
def killed_on_exit(*processes):
    """SIGKILL the process group of each run still going when the block ends: a failed check leaves none behind."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
