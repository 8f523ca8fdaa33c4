"""infra.plot: runs grouped by name without the seed, mean and band over seeds, a PNG written."""
import json
import os

import numpy as np

import infra.plot


def write_run(folder, records):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    return str(folder)


def test_group_name_drops_the_seed_and_what_follows():
    assert infra.plot.group_name("runs/demo_ppo_s2") == "demo_ppo"
    assert infra.plot.group_name("runs/grpo_tiny_s0_20261203-010203/") == "grpo_tiny"
    assert infra.plot.group_name("runs/baseline") == "baseline"


def test_curves_mean_and_band_over_seeds_on_common_steps(tmp_path):
    first = infra.plot.read_run(write_run(tmp_path / "a_s0", [{"step": 0, "reward": 0.2}, {"step": 1, "reward": 0.4},
                                                              {"step": 1, "reward": 0.6}]))  # resumed: last wins
    second = infra.plot.read_run(write_run(tmp_path / "a_s1", [{"step": 0, "reward": 0.4}, {"step": 1, "reward": 0.8},
                                                               {"step": 2, "reward": 1.0}]))
    steps, mean, low, high = infra.plot.curves([first, second], "reward")
    assert steps.tolist() == [0, 1]  # step 2 is logged by one run only
    assert np.allclose(mean, [0.3, 0.7]) and np.allclose(low, [0.2, 0.6]) and np.allclose(high, [0.4, 0.8])
    assert infra.plot.curves([first, second], "value_loss") is None


def test_plot_writes_a_png(tmp_path):
    runs = [write_run(tmp_path / f"m_s{seed}", [{"step": s, "reward": 0.1 * s + seed, "eval/accuracy": 0.5}
                                               for s in range(3)]) for seed in range(2)]
    out = infra.plot.plot(runs, str(tmp_path / "figure.png"))
    with open(out, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
