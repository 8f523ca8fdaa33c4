"""A fork is first-class: a copy of ppo.py under a new name (myppo.py, made here for the module's tests and removed
after them) runs, is listed wherever the trainers are listed (the memory plan, the demo table, the GPU check), and
`python -m pytest tests/test_skeleton.py` checks it against its parent ppo.py and prints its changed lines."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORK = os.path.join(ROOT, "myppo.py")


def python(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def fork():
    if os.path.exists(FORK):
        pytest.skip("myppo.py exists already (a fork of yours): not overwritten")
    shutil.copy(os.path.join(ROOT, "ppo.py"), FORK)
    try:
        yield "myppo"
    finally:
        os.remove(FORK)
        shutil.rmtree(os.path.join(ROOT, "__pycache__", "myppo.cpython-311.pyc"), ignore_errors=True)


def test_a_fork_runs(fork, tmp_path):
    result = python(FORK, "--steps", 1, "--mini-batches", 1, "--prompts-per-step", 2, "--micro-batch-size", 32,
                    "--eval-problems", 1, "--output-dir", tmp_path, "--run-name", "fork")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "myppo.py: 1 steps in" in result.stdout and (tmp_path / "fork" / "metrics.jsonl").exists()


def test_a_fork_is_listed_by_the_memory_plan_the_demo_table_and_the_gpu_check(fork):
    table = python("-m", "infra.memory", "--table").stdout.splitlines()
    rows = {line.split("|")[1].strip() + line.split("|")[2]: line.split("|")[3:] for line in table[2:]}
    assert rows["`myppo.py` Qwen3-4B "] == rows["`ppo.py` Qwen3-4B "]  # a critic, like its parent
    listed = python("-c", "import sys; sys.path.insert(0, 'benchmarks'); import demo_table; "
                          "print(demo_table.METHODS, demo_table.PROBED)").stdout
    assert listed.count("'myppo'") == 2  # run by default, and probed (a per-token critic)
    assert "myppo" in python("benchmarks/gpu_check.py", "trainers").stdout.split()


def test_the_skeleton_test_checks_a_fork_against_its_parent(fork):
    result = python("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_skeleton.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "fork myppo.py changes 0 lines of its parent ppo.py (diff ppo.py myppo.py)" in result.stdout
