"""Shared fixtures: the repository on sys.path, the benchmark data folder (skip when absent), the tiny model, the
Qwen-like checkpoint and its Llama-layout variant, and a runner for the trainers' command lines."""
import os
import subprocess
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2 shared cores: torch threads spin when oversubscribed

import pytest  # noqa: E402
import infra.tiny

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
QWEN_LIKE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "qwen_like")
sys.path.insert(0, REPO)


@pytest.fixture(scope="session")
def shared_data():
    """Path of ../shared/data (GSM8K, MATH500, AIME24, AMC23 jsonl); skips the test when it is absent."""
    if not os.path.isdir(DATA_DIR):
        pytest.skip(f"benchmark data folder {os.path.abspath(DATA_DIR)} is absent")
    return os.path.abspath(DATA_DIR)


@pytest.fixture(scope="session")
def shared_file(shared_data):
    """shared_file("gsm8k/test.jsonl") -> its path under ../shared/data; skips the test when it is absent."""
    def path(relative):
        full = os.path.join(shared_data, relative)
        if not os.path.exists(full):
            pytest.skip(f"{full} is absent")
        return full
    return path


@pytest.fixture(scope="session")
def tiny_path():
    """The built-in tiny checkpoint directory (models/tiny/)."""
    return infra.tiny.tiny_model_path()


@pytest.fixture(scope="session")
def tiny(tiny_path):
    """(model, tokenizer) of the built-in tiny model on CPU, float32. Shared by the session: tests may compute
    gradients (they must zero them) but never change the weights."""
    import common
    model, tokenizer = common.load_model("tiny", device="cpu")
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def qwen_like_path():
    """The Qwen-like checkpoint (tests/fixtures/qwen_like/, built by tests/fixtures/qwen_like.py): ChatML, EOS =
    pad = <|endoftext|>, the Base checkpoints' generation_config; its model writes past its turn end."""
    return QWEN_LIKE


@pytest.fixture(scope="session")
def llama_like_path(tmp_path_factory):
    """The same checkpoint in Llama's layout: no pad token, embedding rows = the tokenizer's length."""
    sys.path.insert(0, os.path.dirname(QWEN_LIKE))
    import qwen_like
    return qwen_like.llama_layout(QWEN_LIKE, str(tmp_path_factory.mktemp("llama_like")))


@pytest.fixture
def run_cli():
    """run_cli("grpo.py", "--flag", "value", timeout=...) -> CompletedProcess, run from the repository root."""
    def run(script, *args, timeout=120):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        return subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=timeout)
    return run
