"""A real-model run prints no FutureWarning: gradient checkpointing is switched on by its current name
(transformers 5.25's activation_checkpointing_enable; the old gradient_checkpointing_enable warns that v6 drops it)."""
import json
import os
import warnings

from helpers import QWEN_LIKE_RUN

import common


def test_load_model_checkpoints_the_layers_without_a_warning(qwen_like_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning raised while loading fails the test
        model, _ = common.load_model(qwen_like_path, "float32", "cpu", gradient_checkpointing=True)
    layers = model.model.layers  # each decoder layer recomputes its activations in backward (train mode)
    assert model.training and all(layer.gradient_checkpointing for layer in layers) and len(layers) > 1


def test_a_qwen_like_run_with_gradient_checkpointing_prints_no_future_warning(run_cli, qwen_like_path, tmp_path):
    flags = [flag for flag in QWEN_LIKE_RUN if flag != "--no-gradient-checkpointing"]
    result = run_cli("ppo.py", "--model", qwen_like_path, *flags, "--gradient-checkpointing", "--samples-per-prompt", 2,
                     "--micro-batch-size", 4, "--critic-warmup", 0, "--output-dir", tmp_path, "--run-name", "run",
                     timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(tmp_path, "run", "config.json")) as handle:
        assert json.load(handle)["gradient_checkpointing"] is True
    output = result.stdout + result.stderr
    assert "FutureWarning" not in output and "deprecated" not in output, output[-3000:]
