"""Stopping a run on a signal: the first Ctrl-C or SIGTERM asks the loop to stop after the current step (and save it),
a second stops at once, or once the checkpoint being written is whole (StopSignals, used by infra.run.Run).
"""
import contextlib
import signal
import sys

from infra import dist


class StopSignals:
    """The first Ctrl-C (SIGINT) or SIGTERM (what Slurm and Kubernetes send before they kill a job) asks the loop to
    stop after the current step (`requested`), so the checkpoint then saved holds whole steps (a stop in the middle
    of an update would save half of one); a second one raises KeyboardInterrupt at once, without saving (during a
    checkpoint's writing: once it is written, see writing()). restore() puts the previous handlers back."""
    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self):
        self.signalled = None  # the name of the first signal
        self.writing_checkpoint = self.stop_after_writing = False
        self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS}

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
        print(f"\n{name}: stopping after this step, with a checkpoint (Ctrl-C again: stop now, without one)",
              file=sys.stderr)

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
        for number, handler in self.previous.items():
            signal.signal(number, handler)
