"""Answer checking under hostile model output: every response is scored within 2 s of wall time (a timeout
scores 0 and is counted), the first one after the checker starts included, nothing crashes, nothing is evaluated as
code; the checker starts from any script, guarded by `if __name__ == "__main__":` or not. Prints the worst time."""
import importlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import common
import infra.evaluate
import infra.verifier

BOUND_S = 2.0  # the bound per response, worst case, waiting for a checker included
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def warm_pool():
    """Start the checker once (the one-time start is not charged to a response) and report its cost."""
    start = time.monotonic()
    assert common.verify("\\boxed{\\frac{1}{2}}", "0.5") == 1.0  # 1/2 = 0.5, decided by math-verify in a worker
    infra.verifier.CHECKER.cold_start_s = time.monotonic() - start
    infra.verifier.pop_timeouts()
    return infra.verifier.CHECKER


def live_checkers(verifier):
    """The pids of the checkers in use and spare, once the zygote has sent every fork asked of it."""
    while verifier.pending:
        verifier._receive_fork(block=True)
    return sorted(pid for pid, _ in verifier.checkers)


def timed_verify(response, gold):
    start = time.monotonic()
    score = common.verify(response, gold)
    return score, time.monotonic() - start


# (name, response, gold, expected score or None when only the bound matters)
MILLION = 1_000_000
CORPUS = [  # run in this order in a fresh process: the first timeout after the start comes first
    ("tower 9^9^9^9^9", "\\boxed{9^{9^{9^{9^{9}}}}}", "1", 0.0),
    ("nested braces, 1e5 deep", "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}", "1", 0.0),
    ("nested braces, 450 deep", "\\boxed{" + "{" * 450 + "1" + "}" * 450 + "}", "1", None),
    ("nested fractions, 100 deep", "\\boxed{" + "\\frac{1}{" * 100 + "2" + "}" * 100 + "}", "1", None),
    ("1e6 chars, answer at the end", "a" * (MILLION - 9) + "\\boxed{5}", "5", 1.0),
    ("1e6 chars, no answer", "x" * MILLION, "5", 0.0),
    ("1e6 chars of unclosed \\boxed{", "\\boxed{" * (MILLION // 7), "5", 0.0),
    ("\\boxed{ never closed, then 1e6 chars", "\\boxed{5" + "y" * MILLION, "5", 0.0),
    ("1e6 chars of }", "}" * MILLION, "5", 0.0),
    ("125000 empty \\boxed{}", "\\boxed{}" * (MILLION // 8), "5", 0.0),
    ("111111 \\boxed{5}", "\\boxed{5}" * (MILLION // 9), "5", 1.0),
    ("tower 9^9^9^9^9 without braces", "\\boxed{9^9^9^9^9}", "1", 0.0),
    ("tower ((((9^9)^9)^9)^9)", "\\boxed{{{{{9}^{9}}^{9}}^{9}}^{9}}", "1", 0.0),
    ("tower 10^10^100", "\\boxed{10^{10^{100}}}", "1", 0.0),
    ("tower e^e^e^100", "\\boxed{e^{e^{e^{100}}}}", "1", 0.0),
    ("tower of 2s over 3", "\\boxed{\\frac{2^{2^{2^{2^{2^{2}}}}}}{3}}", "1", 0.0),
    ("difference of equal towers", "\\boxed{2^{10^{10}}-2^{10^{10}}}", "0", None),
    ("equation of towers", "\\boxed{9^{9^{9}} = 9^{9^{9}}}", "1", None),
    ("tiny power 10^-10^10", "\\boxed{10^{-10^{10}}}", "0", None),
    ("float 1e99999999", "\\boxed{1e99999999}", "1", 0.0),
    ("tower 10^10^10^10", "\\boxed{10^{10^{10^{10}}}}", "7", 0.0),
    ("tower of 2s", "\\boxed{" + "2^{" * 12 + "2" + "}" * 12 + "}", "3", 0.0),
    ("factorial of 10^10", "\\boxed{(10^{10})!}", "5", 0.0),
    ("factorial of a tower", "\\boxed{(9^{9^{9}})!}", "1", 0.0),
    ("double factorial of 10^10", "\\boxed{(10^{10})!!}", "5", 0.0),
    ("product to 10^9", "\\boxed{\\prod_{k=1}^{10^{9}} k}", "5", 0.0),
    ("limit with a tower", "\\boxed{\\lim_{n\\to\\infty} (1+1/n)^{n^{n}}}", "e", None),
    ("binomial of 10^9", "\\boxed{\\binom{10^{9}}{10^{8}}}", "5", 0.0),
    ("expansion (x+1)^10000 vs x", "\\boxed{(x+1)^{10000}-(x-1)^{10000}}", "x", 0.0),
    ("symbolic tower x^x^x^x", "\\boxed{x^{x^{x^{x^{x}}}}}", "x^{x^{x}}", 0.0),
    ("sum to 10^9", "\\boxed{\\sum_{n=1}^{10^{9}} n^{n}}", "5", 0.0),
    ("huge integer, 999 digits", "\\boxed{" + "9" * 999 + "}", "1", 0.0),
    ("huge integer, 1001 digits (too long)", "\\boxed{" + "9" * 1001 + "}", "1", 0.0),
    ("huge equal integers, 40 digits", "\\boxed{" + "9" * 40 + "}", "9" * 40, 1.0),
    ("integers equal as floats only", "\\boxed{123456789012345678901}", "123456789012345678902", 0.0),
    ("control characters", "\\boxed{\x00\x01\x07\x1b[31m5\x7f}", "5", None),
    ("unicode: rtl, emoji, lone surrogate", "\\boxed{\u202e5\U0001F600\ud800\u2028}", "5", None),
    ("unicode digits", "\\boxed{\u0665}", "5", 1.0),  # ARABIC-INDIC DIGIT FIVE: Decimal reads it as 5
    ("a lot of LaTeX commands", "\\boxed{" + "\\sqrt{" * 100 + "2" + "}" * 100 + "}", "2", None),
    ("python code", "\\boxed{__import__('os').system('touch /tmp/rl_reasoning_pwned')}", "0", 0.0),
    ("sympy code", "\\boxed{Symbol('x').__class__.__mro__[-1].__subclasses__()}", "0", 0.0),
    ("matrix of 20x20", "\\boxed{\\begin{pmatrix}" + "\\\\".join(["&".join(["x"] * 20)] * 20) + "\\end{pmatrix}}",
     "1", 0.0),
    ("correct symbolic after the hostile ones", "so \\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
]


FRESH_PROCESS = """
import json, sys, time
sys.path.insert(0, {tests!r})
import common, infra.verifier
from test_verify_adversarial import CORPUS
infra.verifier.CHECKER.start()
rows = []
for name, response, gold, expected in CORPUS:
    start = time.monotonic()
    score = common.verify(response, gold)
    rows.append([name, time.monotonic() - start, score, infra.verifier.pop_timeouts()])
print(json.dumps(dict(start_s=infra.verifier.CHECKER.start_s, rows=rows)))
"""


def run_script(tmp_path, text, pythonpath=REPO, timeout=600):
    """Run `text` as a script of its own in a fresh process; the repository (or `pythonpath`) on its path."""
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pythonpath))


def test_adversarial_corpus_is_bounded_from_a_fresh_process(tmp_path, capsys):
    """The whole corpus in a fresh process right after the checker starts: each response within the bound, the
    first timeout (and so the first kill and swap to a spare) included."""
    if os.path.exists("/tmp/rl_reasoning_pwned"):
        os.remove("/tmp/rl_reasoning_pwned")
    result = run_script(tmp_path, FRESH_PROCESS.format(tests=os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.splitlines()[-1])
    assert measured["rows"][0][0] == "tower 9^9^9^9^9" and measured["rows"][0][3] == 1  # the first one timed out
    lines = []
    for (name, _, _, expected), (_, seconds, score, timeouts) in zip(CORPUS, measured["rows"]):
        assert score in (0.0, 1.0), name
        if expected is not None:
            assert score == expected, name
        lines.append(f"  {seconds:6.3f} s  score {score:.0f}" + " timeout" * timeouts + f"  {name}")
    worst = max((seconds, name) for name, seconds, _, _ in measured["rows"])
    with capsys.disabled():
        print("\nadversarial corpus from a fresh process, wall time per response (2 shared CPU cores: inflated):\n"
              + "\n".join(lines))
        print(f"WORST VERIFICATION TIME: {worst[0]:.3f} s ({worst[1]}); bound {BOUND_S} s; "
              f"{sum(row[3] for row in measured['rows'])} timeouts; one-time checker start "
              f"{measured['start_s']:.2f} s (not charged to a response)")
    assert worst[0] < BOUND_S, f"{worst[1]}: {worst[0]:.3f} s"
    assert not os.path.exists("/tmp/rl_reasoning_pwned")  # model text was never run


FIRST_CHECK = """
import json, select, sys, time
import common, infra.verifier
checker, tower = infra.verifier.CHECKER, "\\\\boxed{{9^{{9^{{9^{{9^{{9}}}}}}}}}}"
if {prestart}:  # as Run.start does once the rollout engine is up; the first rollout then runs meanwhile
    checker.prestart()
    select.select([checker.control], [], [], 120)  # the first rollout's time: the zygote is ready when it ends
start = time.monotonic()
score = common.verify(tower, "1")
print(json.dumps([score, time.monotonic() - start, checker.start_s]))
"""


def test_the_first_check_of_a_run_keeps_its_budget(tmp_path):
    """The first check of a process waited for the one-time start of the checker (1-3 s here), then got its whole
    budget: a hostile first answer came back after the start plus 1.5 s. Prestarted beside the first rollout
    (Run.start), the first hostile answer comes back within the budget plus 0.5 s (benchmarks/verify_deadline.py
    measures it on a loaded machine against budget + 0.2 s)."""
    measured = {}
    for prestart in (True, False):
        result = run_script(tmp_path, FIRST_CHECK.format(prestart=prestart))
        assert result.returncode == 0, result.stderr[-3000:]
        measured[prestart] = json.loads(result.stdout.splitlines()[-1])
    (score, seconds, start_s), (cold_score, cold_seconds, cold_start_s) = measured[True], measured[False]
    assert score == cold_score == 0.0
    assert seconds < common.VERIFY_TIMEOUT_S + 0.5, (seconds, start_s)
    assert cold_seconds > common.VERIFY_TIMEOUT_S + cold_start_s - 0.1  # without prestart: the start is waited for


def test_a_run_prestarts_the_checker_with_its_engine(monkeypatch, tmp_path):
    """On a dataset file (not the built-in task, whose numbers are compared in-process)."""
    checker = infra.verifier._Verifier()
    monkeypatch.setattr(infra.verifier, "CHECKER", checker)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "12+30", "answer": "42"}\n{"question": "5+6", "answer": "11"}\n')
    flags = ["--steps", 1, "--prompts-per-step", 2, "--samples-per-prompt", 2, "--max-response-tokens", 8,
             "--dataset", rows, "--eval-datasets", rows, "--eval-max-tokens", 8, "--output-dir", tmp_path]
    monkeypatch.setattr(sys, "argv", ["grpo.py", *map(str, flags)])
    try:
        importlib.import_module("grpo").main()
        assert checker.process is not None and checker.owner == os.getpid()  # launched by Run.start
        assert common.verify("\\boxed{x+1}", "1+x") == 1.0 and checker.start_s is not None
    finally:
        checker.close()


def test_unguarded_script_can_verify(tmp_path):
    """A two-line script without `if __name__ == "__main__":`: the checker never runs the caller's script again
    (multiprocessing's spawn did, and the checker died at start)."""
    result = run_script(tmp_path, 'import common\nprint(common.verify("\\\\boxed{x+1}", "1+x"))\n')
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == "1.0\n"  # printed once: the script ran once


def test_a_checker_that_cannot_start_says_why(tmp_path):
    """A math-verify that fails to import: the error names the checker's exit and its last line of output."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "math_verify.py").write_text('raise ImportError("this math_verify is broken on purpose")\n')
    result = run_script(tmp_path, "import common\ntry:\n    common.verify('\\\\boxed{x}', 'y')\n"
                                  "except RuntimeError as error:\n    print(error)\n", f"{fake}{os.pathsep}{REPO}")
    assert result.returncode == 0, result.stderr[-3000:]
    message = result.stdout.strip()
    assert "\n" not in message and "exited with code 1" in message, message
    assert message.endswith("ImportError: this math_verify is broken on purpose (pip install math-verify)"), message


ORPHAN = """
import os, signal, common, infra.verifier
checker = infra.verifier.CHECKER
checker.start()
for pid, connection in checker.checkers:
    connection.send(("1", "1"))
    connection.recv()  # it is set up and answering
    connection.send(("1", "9^{9^{9^{9^{9}}}}"))
    os.kill(pid, signal.SIGSTOP)  # stuck where no timer of math-verify's and no end of file can reach it
print(checker.process.pid, *[pid for pid, _ in checker.checkers], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the trainer dies without closing anything
"""


def test_no_checker_outlives_a_killed_trainer(tmp_path):
    """The zygote exits when the trainer is gone, and its checkers with it, even stuck ones (PR_SET_PDEATHSIG)."""
    result = run_script(tmp_path, ORPHAN, timeout=120)  # a checker left alive holds its stderr: a timeout here
    pids = [int(pid) for pid in result.stdout.split()]
    assert result.returncode == -signal.SIGKILL and len(pids) == 2 + infra.verifier.SPARES, result.stderr[-3000:]
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]


def test_a_forked_caller_starts_its_own_checker(warm_pool):
    """A process forked from one whose checker runs (a fork-based worker pool) gets its own zygote, and leaves the
    parent's checkers alone."""
    assert common.verify("\\boxed{x+1}", "1+x") == 1.0
    pids = [warm_pool.process.pid, *live_checkers(warm_pool)]
    child, ok = os.fork(), False
    if child == 0:
        try:
            ok = common.verify("\\boxed{2x}", "x+x") == 1.0 and warm_pool.process.pid not in pids
        finally:
            os._exit(0 if ok else 1)
    assert os.waitpid(child, 0)[1] == 0
    assert common.verify("\\boxed{x+2}", "2+x") == 1.0
    assert [warm_pool.process.pid, *live_checkers(warm_pool)] == pids


def test_an_interrupted_check_leaves_no_late_answer(warm_pool):
    """Ctrl-C in the middle of a check (a notebook's interrupt): the next check gets its own answer, not the
    interrupted one's, and within its own budget."""
    import threading
    # Python's own Ctrl-C handling, whatever an earlier test left: in CI's full suite (one process) this check saw no
    # KeyboardInterrupt twice while it passed alone and after each test file we tried beside it (cause not found).
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            common.verify("\\boxed{9^{9^{9^{9^{9}}}}}", "1")
            time.sleep(5)  # the interrupt comes during the check, or at the latest here
    finally:
        signal.signal(signal.SIGINT, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for response, gold, expected in [("\\boxed{2x+1}", "1+2x", 1.0), ("\\boxed{x}", "y", 0.0),
                                     ("\\boxed{\\frac{3}{4}}", "0.75", 1.0)]:
        score, seconds = timed_verify(response, gold)
        assert score == expected and seconds < BOUND_S, (response, score, seconds)


def test_hostile_in_a_row_then_correct(warm_pool):
    """Each hostile response costs one timeout and one killed checker; the answer right after still gets a warm
    checker within its own budget (no false 0 from a checker still starting up)."""
    infra.verifier.pop_timeouts()
    for _ in range(4):
        score, seconds = timed_verify("\\boxed{9^{9^{9^{9^{9}}}}}", "1")
        assert score == 0.0 and seconds < BOUND_S
    assert infra.verifier.pop_timeouts() == 4  # each one counted
    for response, gold in [("\\boxed{2x+1}", "1+2x"), ("\\boxed{\\frac{3}{4}}", "0.75"), ("\\boxed{(1,2]}", "(1,2]")]:
        score, seconds = timed_verify(response, gold)
        assert score == 1.0 and seconds < BOUND_S, (response, seconds)
    assert infra.verifier.pop_timeouts() == 0
    expected = live_checkers(warm_pool)
    assert len(expected) == 1 + infra.verifier.SPARES  # every killed checker was replaced
    deadline = time.monotonic() + 10
    while children(warm_pool.process.pid) != expected and time.monotonic() < deadline:
        time.sleep(0.1)  # a killed checker takes a moment to go
    assert children(warm_pool.process.pid) == expected  # killed ones reaped, none leaked


def test_timeouts_reach_rollout_metrics(warm_pool):
    import torch
    infra.verifier.pop_timeouts()
    assert common.verify("\\boxed{9^{9^{9^{9^{9}}}}}", "1") == 0.0
    completion = common.Completion(0, [5, 6], "ab", [-0.5, -0.25], "stop")
    metrics = infra.evaluate.rollout_metrics([completion], torch.tensor([0.0]), torch.tensor([[-0.5, -0.25]]),
                                     torch.tensor([[True, True]]))
    assert metrics["verify_timeouts"] == 1
    assert infra.verifier.pop_timeouts() == 0  # reported once, then reset


def test_checkers_ignore_ctrl_c_and_sigterm(warm_pool):
    """Ctrl-C reaches every process of the terminal's group, and a scheduler's SIGTERM every process of the job;
    the trainer handles them, the checkers keep working."""
    assert common.verify("\\boxed{x+1}", "1+x") == 1.0
    pids = [warm_pool.process.pid, *live_checkers(warm_pool)]
    for pid in pids:
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    assert common.verify("\\boxed{x+1}", "1+x") == 1.0
    assert [warm_pool.process.pid, *live_checkers(warm_pool)] == pids  # none was replaced


def children(pid):
    """Live child processes of `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{843}", "843"),
    ("a \\boxed{1} b \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one, braces balanced
    ("\\boxed{12} then \\boxed{34", "12"),  # an unclosed last \boxed{: the one before it
    ("\\boxed{12} then \\boxed{\\frac{1}{2", None),  # the last one has a } after it but never closes
    ("<think>\\boxed{1}</think> \\boxed{2}", "2"),
    ("<think>\\boxed{1}</think> no box", None),
    ("\\boxed{ 7 }", "7"),
    ("\\boxed{" + "1" * 1000 + "}", "1" * 1000),
    ("\\boxed{" + "1" * 1001 + "}", None),  # longer than MAX_ANSWER_CHARS
    ("}}}} \\boxed{", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert common.extract_answer(text) == expected


@pytest.mark.parametrize("text", [
    "\\boxed{" * (MILLION // 7),
    "{" * MILLION,
    "}" * MILLION,
    "\\boxed{" + "{" * MILLION,
    ("\\boxed{1}" + "x" * 1000) * (MILLION // 1009),
    "</think>" * (MILLION // 8),
])
def test_extract_answer_is_linear(text):
    start = time.monotonic()
    common.extract_answer(text)
    assert time.monotonic() - start < 0.5  # about 10 ms unloaded; the old scan was quadratic here


def test_plain_numbers_exact():
    # Decided in-process, exactly: decimals, thousands separators; floats would call these equal.
    assert common.verify("\\boxed{1,000}", "1000") == 1.0
    assert common.verify("\\boxed{-3.50}", "-3.5") == 1.0
    assert common.verify("\\boxed{$5}", "5") == 1.0
    assert common._plain_number("1,2") is None  # a pair, not one thousand two hundred
    assert common._plain_number("12,34") is None
    assert common._plain_number("1" * 51) is None  # left to math-verify
    assert common.verify("\\boxed{123456789012345678901}", "123456789012345678902") == 0.0
    assert common.verify("\\boxed{5}", None) == 0.0
    assert common.verify("no box", "5") == 0.0
