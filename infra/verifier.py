"""The math-verify checker behind common.verify: one warm checker process, forked from a zygote that imported and
warmed math-verify once. A check that misses its deadline kills the checker (stuck in sympy, where no signal or
thread can stop it) and forks a fresh, already warm one at once. Model text is parsed as LaTeX, never evaluated.
"""
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import signal
import socket
import time

START_TIMEOUT_S = 120  # the one-time start of the checker (imports math-verify and warms sympy up)
TIMEOUTS = {"count": 0}  # checks that ran out of time (scored 0); rollout_metrics reports and resets it


def pop_timeouts():
    """How many answer checks ran out of time since the last call."""
    count, TIMEOUTS["count"] = TIMEOUTS["count"], 0
    return count


def _math_verify_zygote(connection):
    """Checker zygote: imports math-verify and warms it up once, then forks a warm checker per request (a fork takes
    milliseconds; a fresh process would take seconds to import and warm up), sending back its pid and socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the checkers
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed checkers are reaped by the kernel
    from math_verify import LatexExtractionConfig, parse, verify

    def score(gold, answer):  # LaTeX extraction only: math-verify's plain-expression one runs sympy's parse_expr (eval)
        config = [LatexExtractionConfig()]
        return float(verify(parse(f"\\boxed{{{gold}}}", config), parse(f"\\boxed{{{answer}}}", config)))

    for gold, answer in [("\\frac{1}{2}", "0.5"), ("2x+1", "1+x*2"), ("\\sqrt{2}", "2^{1/2}"), ("(1,2]", "(1,2]")]:
        score(gold, answer)  # warm sympy's lazy set-up (up to ~0.5 s per new kind of expression)
    connection.send("ready")
    while True:
        try:
            connection.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the checker: answers (gold, answer) -> 0.0/1.0 until the trainer closes its end
            try:
                connection.close()
                ours.close()
                checker = multiprocessing.connection.Connection(theirs.detach())
                while True:
                    gold, answer = checker.recv()  # EOFError when the trainer is gone
                    try:
                        result = score(gold, answer)
                    except Exception:
                        result = 0.0
                    checker.send(result)
            finally:
                os._exit(0)  # never run the zygote's code in a checker
        theirs.close()
        connection.send(pid)
        multiprocessing.reduction.send_handle(connection, ours.fileno(), 0)
        ours.close()


class _Verifier:
    """One warm checker process forked from a zygote. A check that misses its deadline kills the checker (it is
    stuck in sympy, where no signal or thread can stop it) and forks a fresh, already warm one at once."""

    def __init__(self):
        self.zygote = self.checker = None  # (process, connection), (pid, connection)

    def _start(self):
        """(Re)start the zygote and fork a checker: once per process (about 5-15 s), or after the zygote died."""
        if self.zygote is not None:
            self.zygote[0].kill()
            self.zygote[1].close()
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        process = context.Process(target=_math_verify_zygote, args=(child,), daemon=True)
        process.start()
        child.close()
        self.zygote = (process, parent)
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise RuntimeError(f"the math-verify checker did not start in {START_TIMEOUT_S} s")
            parent.recv()
        except (EOFError, OSError):
            raise RuntimeError("the math-verify checker died at start; is math-verify installed "
                               "(pip install math-verify)?")
        self._fork()

    def _fork(self):
        process, connection = self.zygote
        connection.send("fork")
        pid = connection.recv()
        self.checker = (pid, multiprocessing.connection.Connection(multiprocessing.reduction.recv_handle(connection)))

    def check(self, gold, answer, deadline):
        """1.0 / 0.0, or 0.0 and a counted timeout past `deadline` (time.monotonic()). A (re)start of the zygote
        is not charged to the answer's deadline."""
        if self.zygote is None or not self.zygote[0].is_alive() or self.checker is None:
            start = time.monotonic()
            self._start()
            deadline += time.monotonic() - start
        pid, connection = self.checker
        with contextlib.suppress(EOFError, OSError):  # a checker that died on this input is not signalled again
            connection.send((gold, answer))
            if connection.poll(max(0.0, deadline - time.monotonic())):
                return float(connection.recv())
            os.kill(pid, signal.SIGKILL)  # stuck on hostile input
        connection.close()
        self.checker = None
        with contextlib.suppress(EOFError, OSError):  # the zygote is gone: the next check restarts it
            self._fork()
        TIMEOUTS["count"] += 1
        return 0.0


CHECKER = _Verifier()
