"""Progress inside a long step: what the current phase (an evaluation set, the rollout, the update) has done so far,
once it has run DELAY seconds. On a terminal it is the step bar's postfix (`rollout 96/512 samples, 2,040 tok,
310 tok/s, 7 s`), redrawn at most every REFRESH seconds and cleared when the phase ends; when the bar goes to a file
(a log) it is a plain line every LOG_EVERY seconds instead, so a log gets no carriage-return frames and a short
step no line at all. The engine (HFGenerator) and Run report through the module functions below, which do nothing
while no display is active (tests, benchmarks, ranks > 0)."""
import contextlib
import sys
import time

import torch
from tqdm import tqdm

from infra import dist

DELAY = 3.0  # seconds into a phase before anything shows: the tiny demo's phases (1-4 s) stay quiet on a terminal
REFRESH = 0.5  # a terminal's status is redrawn at most this often
LOG_EVERY = 30.0  # a log file gets a status line at most this often, the first after LOG_EVERY seconds


def duration(seconds):
    return f"{seconds:.0f} s" if seconds < 100 else f"{seconds / 60:.1f} min"


class Display:
    """The status of the phase under way. `bar`: a tqdm bar (its postfix shows the status on a terminal); `write`
    prints a line (a log's status lines); `terminal`: whether the bar draws on a terminal; `clock`: seconds."""

    def __init__(self, bar, write, terminal, updates_per_step=None, clock=None, delay=DELAY, refresh=REFRESH,
                 log_every=LOG_EVERY):
        self.bar, self.write, self.terminal, self.updates_per_step, self.clock = bar, write, terminal, \
            updates_per_step, clock or time.monotonic
        self.delay, self.refresh, self.log_every = delay, refresh, log_every
        self.name, self.step, self.shown = None, None, False
        self.phase(None)

    def phase(self, name, step=None):
        """A phase begins (None: none is under way); its counts start from 0 and a status on screen is cleared."""
        if self.shown and self.terminal:
            self.bar.set_postfix_str("", refresh=True)
        self.name, self.start, self.shown = name, self.clock(), False
        self.step = step if step is not None else self.step  # the step its log lines name
        self.last = self.start  # when the status was last drawn (terminal) or written (log)
        self.requested = self.finished = self.tokens = self.updates = 0

    def status(self):
        """`rollout 96/512 samples, 2,040 tok, 310 tok/s, update 1/2, 7 s`: the parts the phase has."""
        elapsed = self.clock() - self.start
        parts = [f"{self.finished:,}/{self.requested:,} samples"] if self.requested else []
        parts += [f"{self.tokens:,} tok", f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s"] if self.tokens else []
        total = self.updates_per_step if self.name == "update" and self.updates_per_step else None
        parts += [f"{self.updates}/{total} optimizer steps" if total and self.updates <= total else
                  f"{self.updates} optimizer steps"] if self.name == "update" else []
        return f"{self.name} " + ", ".join(parts + [duration(elapsed)])

    def tick(self):
        """Show the status if the phase has run `delay` seconds and the last showing is old enough."""
        now = self.clock()
        if self.name is None or now - self.start < self.delay:
            return
        if self.terminal:
            if not self.shown or now - self.last >= self.refresh:
                self.bar.set_postfix_str(self.status(), refresh=True)
                self.shown, self.last = True, now
        elif now - self.last >= self.log_every:
            self.write((f"  step {self.step} " if self.step is not None else "  ") + self.status())
            self.last = now


_active = []  # the display reports go to (at most one)


def activate(display):
    """Send the reports to `display` (None: to nowhere) until deactivate()."""
    _active[:] = [display] if display is not None else []
    return display


def deactivate():
    if _active:
        _active[0].phase(None)
    _active.clear()


def for_bar(bar, write, args=None):
    """A Display on tqdm `bar` (None where the bar is disabled: a rank > 0), terminal or not as its file is, that
    counts the update's optimizer steps against the trainer's epochs x mini-batches (`args`)."""
    if bar is None or bar.disable:
        return None
    terminal = bool(getattr(getattr(bar, "fp", None) or sys.stderr, "isatty", lambda: False)())
    epochs = getattr(args, "epochs", 0)
    updates = max(epochs, getattr(args, "critic_epochs", 0) or epochs) * getattr(args, "mini_batches", 0)
    return Display(bar, write, terminal, updates or None)


def watch(models):
    """Report each forward pass of the trained models (the update's start and pace: training_forward)."""
    for model in models:
        model.register_forward_pre_hook(training_forward)


@contextlib.contextmanager
def shown_alone(write=print):
    """A display of its own (--eval-only: no step bar): on a terminal a line `evaluating 00:07, <status>` that goes
    once done; in a log, lines as in a run."""
    terminal = sys.stderr.isatty()
    bar = tqdm(total=None, desc="evaluating", bar_format="{desc} {elapsed}{postfix}", leave=False,
               disable=dist.rank() > 0 or not terminal)
    activate(None if dist.rank() > 0 else Display(bar, write, terminal))
    try:
        yield
    finally:
        deactivate()
        bar.close()


def phase(name, step=None):
    if _active:
        _active[0].phase(name, step)


def requested(samples):
    """An engine call for `samples` responses began."""
    if _active:
        _active[0].requested += samples
        _active[0].tick()


def generated(tokens, finished=0):
    """The engine sampled `tokens` more tokens; `finished` more responses are done."""
    if _active:
        _active[0].tokens += tokens
        _active[0].finished += finished
        _active[0].tick()


def training_forward(*_):
    """A forward pass (a forward pre-hook on the trained models): with gradients, the update has begun or goes on."""
    if _active and torch.is_grad_enabled():
        if _active[0].name != "update":
            _active[0].phase("update")
        _active[0].tick()


def optimizer_step():
    """The update took (or skipped) one optimizer step (Run.update_ok)."""
    if _active:
        _active[0].updates += 1
        _active[0].tick()
