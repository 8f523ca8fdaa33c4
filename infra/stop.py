"""Stopping a run on a signal: the first Ctrl-C or SIGTERM asks the run to stop at its next safe point, a second
stops at once, or once the checkpoint being written is whole (StopSignals, used by infra.run.Run). Safe points
(safe_point) are where nothing of the step under way has changed the run's state: the engines' decode steps and calls
(rollout, evaluation, probes) and the step's first optimizer step (Run.update_ok); there StopNow is raised and the run
saves the state the step began with. A stop that comes during an update waits for the step's end.
"""
import contextlib
import signal
import sys

from infra import dist


class StopNow(Exception):
    """Raised at a safe point once a stop is asked for: the step under way has taken no optimizer step, so the run
    stops with the state that step began with (infra.run.Run.stop_now); a resume repeats the step exactly."""


_LOOP = []  # the StopSignals of the training loop under way, for safe_point


def safe_point(lockstep=False):
    """A point where the run may stop at once: raises StopNow when a stop was asked for and the loop's step is still
    `safe` (no optimizer step taken). Under torchrun only points that all ranks reach together (`lockstep`) count,
    asking the other ranks, so that all stop at the same one."""
    signals = _LOOP[-1] if _LOOP else None
    if signals is None or not signals.safe or (dist.distributed() and not lockstep):
        return
    if signals.requested if dist.distributed() else signals.signalled:
        raise StopNow(signals.signalled)


class StopSignals:
    """The first Ctrl-C (SIGINT) or SIGTERM (what Slurm and Kubernetes send before they kill a job) asks the run to
    stop at its next safe point (safe_point) or else after the current step (`requested`), so the checkpoint then
    saved holds whole steps (a stop in the middle of an update would save half of one); a second one raises
    KeyboardInterrupt at once, without saving (during a checkpoint's writing: once it is written, see writing()).
    `safe`: whether the loop's step may stop now (Run sets it). restore() puts the previous handlers back."""
    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.signalled = None  # the name of the first signal
        self.writing_checkpoint = self.stop_after_writing = self.safe = False
        self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}
        _LOOP.append(self)

    @property
    def requested(self):
        """Under torchrun: whether any rank got a signal, so that all stop after the same step."""
        return dist.rank_mean(bool(self.signalled)) > 0 if dist.distributed() else bool(self.signalled)

    def _handle(self, signum, frame):
        name = self.SIGNALS[signum]
        if self.signalled and self.writing_checkpoint:
            print(f"\n{name} again: stopping once the checkpoint being written is whole", file=sys.stderr)
            self.stop_after_writing = True
            return
        if self.signalled:
            print(f"\n{name} again: stopping now, without saving this step", file=sys.stderr)
            raise KeyboardInterrupt
        self.signalled = name
        print(f"\n{name}: stopping at the next safe point, with a checkpoint of the steps done (Ctrl-C again: stop "
              "now, without one)", file=sys.stderr)

    @contextlib.contextmanager
    def writing(self):
        """A checkpoint is being written: a second signal stops the run once it is whole (an interrupt inside the
        writers' C++ code would abort the process)."""
        self.writing_checkpoint = True
        try:
            yield
        finally:
            self.writing_checkpoint = False
        if self.stop_after_writing:
            raise KeyboardInterrupt

    def restore(self):
        """Put the previous handlers back, once (a second call, after a later loop installed its own, does nothing)."""
        if self in _LOOP:
            _LOOP.remove(self)
            for number, handler in self.previous.items():
                signal.signal(number, handler)
