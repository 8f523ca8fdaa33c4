"""Helpers several test files share: reading a run's metrics, and killing a run to resume it."""
import json
import os
import signal
import time

import infra.checkpoint


def records(run_dir):
    """The last metrics record of each step (a resumed run logs the steps after its checkpoint again)."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        for line in handle:
            record = json.loads(line)
            by_step[record["step"]] = record
    return by_step


def kill_then_resume(start, straight, killed, kill_at):
    """Start `straight` and `killed` side by side (start(run_dir, *argv) -> a Popen in its own process group); SIGKILL
    `killed` once its checkpoint step_<kill_at> appears, --resume it to the end, wait for both. Returns the step the
    killed run resumed from (kill_at, or kill_at + 1 if the next checkpoint made it in time)."""
    straight_run, killed_run = start(straight), start(killed)
    try:
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
        resumed = start(killed, "--resume", killed)
        output = resumed.communicate(timeout=600)[0]
        assert resumed.returncode == 0, output[-3000:]
        assert straight_run.wait(600) == 0, straight_run.communicate()[0][-3000:]
    finally:
        for process in (straight_run, killed_run):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return resumed_from
