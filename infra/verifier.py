"""The math-verify checker behind common.verify: warm checker processes forked from a zygote that imported and
warmed math-verify once. The zygote is a plain subprocess (`python -m infra.verifier`), so it never imports the
caller's __main__: common.verify works in unguarded scripts and notebooks. A check that misses its deadline kills
its checker (stuck in sympy, where no signal or thread can stop it) and swaps to a spare checker forked ahead of
time, so nothing after the deadline waits for a fork. A run launches the zygote beside its first rollout (prestart),
so no check waits for its start. Model text is parsed as LaTeX, never evaluated.
"""
import collections
import contextlib
import multiprocessing.connection
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

START_TIMEOUT_S = 120  # the one-time start of the zygote (imports math-verify and warms sympy up)
SPARES = 1  # warm checkers kept forked ahead of the one in use: a timeout swaps to one at once
TIMEOUTS = {"count": 0}  # checks that ran out of time (scored 0); rollout_metrics reports and resets it
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# One answer pair of each kind sympy sets up lazily (up to ~0.5 s the first time): paid once in the zygote, not by
# every checker forked from it
WARM_UP = [("\\frac{1}{2}", "0.5"), ("2x+1", "1+x*2"), ("\\sqrt{2}", "2^{1/2}"), ("(1,2]", "(1,2]"), ("1", "x+2"),
           ("x^2", "x x"), ("\\{1,2\\}", "\\{2,1\\}"), ("[1,2]", "(1,2)"), ("5", "\\sin x"), ("2", "x=2")]


def pop_timeouts():
    """How many answer checks ran out of time since the last call."""
    count, TIMEOUTS["count"] = TIMEOUTS["count"], 0
    return count


# ---------------------------------------------------------------------------------------------- the zygote's side
def _score(gold, answer):
    """math-verify with LaTeX extraction only (its plain-expression extraction runs sympy's parse_expr: eval)."""
    from math_verify import LatexExtractionConfig, parse, verify
    config = [LatexExtractionConfig()]
    return float(verify(parse(f"\\boxed{{{gold}}}", config), parse(f"\\boxed{{{answer}}}", config)))


def _die_with_parent():
    """Linux: SIGKILL this process when its parent exits (PR_SET_PDEATHSIG), so that a checker stuck in sympy never
    outlives the zygote, which exits when the trainer is gone."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        pass


def _checker(channel):
    """A forked checker: answers (gold, answer) -> 0.0/1.0 until the trainer closes its end (EOFError)."""
    for gold, answer in WARM_UP[:1]:
        _score(gold, answer)  # touch the zygote's pages once now (copy-on-write), not in a timed check
    while True:
        gold, answer = channel.recv()
        try:
            result = _score(gold, answer)
        except Exception:
            result = 0.0
        channel.send(result)


def zygote(control_fd, stderr_fd):
    """Imports math-verify and warms it up once, says "ready", then forks a warm checker for each b"f" on the
    control socket (a fork takes milliseconds; a fresh process would take seconds), sending back its pid and the
    trainer's end of a socket to it. Exits when the trainer is gone (end of file on the control socket)."""
    for name in (signal.SIGINT, signal.SIGTERM):  # the trainer's to handle (a terminal's Ctrl-C, a scheduler's TERM)
        signal.signal(name, signal.SIG_IGN)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # killed checkers are reaped by the kernel
    control = socket.socket(fileno=control_fd)
    for gold, answer in WARM_UP:
        _score(gold, answer)
    if stderr_fd >= 0:  # started: from now on, output goes to the caller's stderr, not the start log
        os.dup2(stderr_fd, 1)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
    try:
        control.sendall(b"ready")
    except OSError:  # the trainer is gone already
        return
    zygote_pid = os.getpid()
    while _next_request(control):
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            try:
                _die_with_parent()
                if os.getppid() != zygote_pid:  # the zygote exited before the line above
                    os._exit(0)
                control.close()
                ours.close()
                _checker(multiprocessing.connection.Connection(theirs.detach()))
            finally:
                os._exit(0)  # never run the zygote's loop in a checker
        theirs.close()
        socket.send_fds(control, [pid.to_bytes(8, "little")], [ours.fileno()])
        ours.close()


def _next_request(control):
    """True for a fork request; False when the trainer is gone."""
    try:
        return bool(control.recv(1))
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------- the caller's side
class _Verifier:
    """The zygote process, the checker in use and SPARES warm spares. A check that misses its deadline kills its
    checker and moves on to a spare at once; the zygote forks the replacement in the background."""

    def __init__(self):
        self.process = self.control = self.log = None
        self.checkers = collections.deque()  # (pid, connection): the one in use first, then the spares
        self.pending = 0  # forks asked of the zygote and not yet received
        self.start_s = None  # how long the last start took
        self.owner = None  # the pid of the process that started them
        self.began = None  # when the zygote in start was launched; None once it is ready

    def alive(self):
        return self.process is not None and self.process.poll() is None

    def start(self):
        """(Re)start the zygote and fork the checkers: once per process (about 1-15 s), or after the zygote died.
        Raises RuntimeError saying what happened when it cannot start."""
        self.close()
        self._launch()
        self._finish_start()

    def prestart(self):
        """Launch the zygote and return at once, if this process has none: its start (1-2 s, more on a busy machine:
        importing and warming math-verify) then runs beside the caller's work instead of inside the first check,
        which would wait for it (Run.start calls it once the rollout engine is up). The first check waits only for
        what is left of the start."""
        if self.owner != os.getpid():
            self._forget()
        if not self.alive():
            self.close()
            self._launch()

    def _launch(self):
        """Start the zygote process (`python -m infra.verifier`); _finish_start waits for it to be ready."""
        self.began = time.monotonic()
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            caller_stderr = os.dup(sys.__stderr__.fileno())
        except (AttributeError, OSError, ValueError):  # no usable stderr (some embedded interpreters)
            caller_stderr = -1
        log = tempfile.TemporaryFile()  # the zygote's output until it is ready, for the error message
        command = [sys.executable, "-m", "infra.verifier", str(theirs.fileno()), str(caller_stderr)]
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        try:
            self.process = subprocess.Popen(command, cwd=REPO, env=environment, stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=log, pass_fds=[theirs.fileno()]
                                            + ([caller_stderr] if caller_stderr >= 0 else []),
                                            start_new_session=True)  # a terminal's Ctrl-C goes to the trainer only
        except OSError as error:
            raise RuntimeError(f"cannot start the math-verify checker ({' '.join(command[:3])}): {error}") from None
        finally:
            theirs.close()
            if caller_stderr >= 0:
                os.close(caller_stderr)
        self.control, self.log = ours, log

    def _finish_start(self):
        """Wait for the launched zygote's "ready" and fork the checkers. Raises RuntimeError saying what happened when
        it cannot start."""
        ours, log = self.control, self.log
        wait = max(0.0, START_TIMEOUT_S - (time.monotonic() - self.began))
        ready = select.select([ours], [], [], wait)[0] and ours.recv(16)
        if ready != b"ready":
            try:
                code = self.process.wait(10)  # it is exiting: its exit code says how
            except subprocess.TimeoutExpired:
                self.process.kill()
                code = self.process.wait()
            log.seek(0)
            lines = [line.strip() for line in log.read().decode(errors="replace").splitlines() if line.strip()]
            what = f"exited with code {code}" if ready == b"" else f"did not start in {START_TIMEOUT_S} s"
            hint = " (pip install math-verify)" if any("math_verify" in line for line in lines) else ""
            self.close()
            raise RuntimeError(f"the math-verify checker ({sys.executable} -m infra.verifier) {what}: "
                               f"{lines[-1] if lines else 'no output'}{hint}")
        log.close()
        self.log = None
        for _ in range(1 + SPARES):
            self._ask_fork()
        while self.pending:
            self._receive_fork(block=True)
        self.start_s, self.began = time.monotonic() - self.began, None

    def close(self):
        """Stop the zygote and its checkers (they exit when their socket closes)."""
        if self.owner != os.getpid():  # not ours to stop
            return self._forget()
        for _, connection in self.checkers:
            connection.close()
        self.checkers.clear()
        if self.control is not None:
            self.control.close()
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        if self.log is not None:
            self.log.close()
        self.process = self.control = self.log = self.began = None
        self.pending = 0

    def _forget(self):
        """Drop this process's copies of another process's zygote and checkers, leaving them to it."""
        for _, connection in self.checkers:
            connection.close()
        self.checkers.clear()
        if self.control is not None:
            self.control.close()
        self.process = self.control = self.log = self.began = None
        self.pending = 0

    def _ask_fork(self):
        self.control.sendall(b"f")
        self.pending += 1

    def _receive_fork(self, block):
        """Take one forked checker from the zygote (waiting for it if `block`); False if none was there."""
        if not select.select([self.control], [], [], START_TIMEOUT_S if block else 0)[0]:
            if block:  # a zygote that stopped answering is restarted
                raise EOFError("the math-verify zygote sent no checker")
            return False
        message, descriptors, _, _ = socket.recv_fds(self.control, 8, 1)
        if not message or not descriptors:  # the zygote is gone
            raise EOFError("the math-verify zygote exited")
        self.pending -= 1
        self.checkers.append((int.from_bytes(message, "little"), multiprocessing.connection.Connection(descriptors[0])))
        return True

    def check(self, gold, answer, deadline):
        """1.0 / 0.0, or 0.0 and a counted timeout past `deadline` (time.monotonic()). Getting a checker is not
        charged to the answer's deadline: a spare is there at once after a kill, and the one-time start (or what is
        left of it after prestart, or a restart after the zygote died) is added to the deadline, as is a wait for a
        fork in the rare case there is no spare."""
        begin = time.monotonic()
        if self.owner != os.getpid():  # a fork of the process that started them: it starts its own
            self._forget()
        if self.began is not None and self.alive():  # prestarted: the rest of its start
            self._finish_start()
        try:
            while self.pending and self._receive_fork(block=not self.checkers):
                pass
        except (EOFError, OSError):
            pass
        if not self.alive() or not self.checkers:
            self.start()
        deadline += time.monotonic() - begin
        pid, connection = self.checkers[0]
        try:
            connection.send((gold, answer))
            if connection.poll(max(0.0, deadline - time.monotonic())):
                return float(connection.recv())
            stuck = True  # on hostile input
        except (EOFError, OSError):  # a checker that died on this input (no kill needed)
            stuck = False
        except BaseException:  # interrupted mid-check (Ctrl-C in a notebook): its late answer must not reach the next
            self._replace(kill=True)
            raise
        self._replace(kill=stuck)
        TIMEOUTS["count"] += 1
        return 0.0

    def _replace(self, kill):
        """Drop the checker in use (killed first if `kill`) and move on to a spare at once; the zygote forks the
        next spare in the background."""
        pid, connection = self.checkers.popleft()
        connection.close()
        if kill:
            with contextlib.suppress(OSError):  # it died on its own meanwhile
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):  # the zygote is gone: the next check restarts it
            self._ask_fork()


CHECKER = _Verifier()

if __name__ == "__main__":  # the zygote: python -m infra.verifier <control socket fd> <caller's stderr fd or -1>
    zygote(int(sys.argv[1]), int(sys.argv[2]))
