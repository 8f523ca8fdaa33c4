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


def ppo_like(step, seed=0, loss_scale=1.0):
    """A ppo.py-like record: every metric the step line shows, the critic's included."""
    return {"step": step, "reward": 0.25 * step, "eval/accuracy": 0.5, "response_length": 20.0 + step,
            "policy_loss": loss_scale * (0.1 - 0.01 * step + 0.001 * seed), "grad_norm": 1.0 + step,
            "value_loss": 0.3, "critic_grad_norm": 2.0, "explained_variance": 0.1 * step, "approx_kl": 0.001}


def test_the_figure_has_loss_and_gradient_norm_panels_and_integer_step_ticks(tmp_path):
    # two steps (0, 1): matplotlib's default ticks would be 0, 0.2, ..., 1.0
    ppo = write_run(tmp_path / "ppo_s0", [ppo_like(step) for step in range(2)])
    grpo = write_run(tmp_path / "grpo_s0", [{k: v for k, v in ppo_like(step).items() if "critic" not in k
                                             and k not in ("value_loss", "explained_variance")} for step in range(2)])
    figure = infra.plot.figure([ppo, grpo])
    titles = [axis.get_title() for axis in figure.axes if axis.axison]
    assert titles == ["held-out accuracy", "training reward", "response length", "policy loss", "policy gradient norm",
                      "critic value loss", "critic gradient norm", "explained variance", "approx. KL to the old policy"]
    for axis in figure.axes:
        if axis.axison:
            ticks = [tick for tick in axis.get_xticks() if axis.get_xlim()[0] <= tick <= axis.get_xlim()[1]]
            assert ticks == [0.0, 1.0], (axis.get_title(), ticks)
    critic_panel = figure.axes[titles.index("critic gradient norm")]
    assert [line.get_label() for line in critic_panel.get_lines()] == ["ppo (1 seed)"]  # grpo logs no critic
    assert figure._suptitle is None  # one seed per run: no mean, no band


def test_the_title_speaks_of_seeds_only_when_a_run_has_several(tmp_path):
    one = [write_run(tmp_path / "a_s0", [ppo_like(step) for step in range(3)])]
    several = [write_run(tmp_path / f"b_s{seed}", [ppo_like(step, seed) for step in range(3)]) for seed in range(2)]
    assert infra.plot.figure(one, "built-in task")._suptitle.get_text() == "built-in task"
    assert infra.plot.figure(one + several, "built-in task")._suptitle.get_text() == \
        "built-in task; mean over seeds; band: lowest to highest seed"


def test_runs_that_coincide_stay_apart_and_a_halved_loss_shows(tmp_path):
    # a fork that halves the loss: its reward curve is its parent's exactly, its loss curve is half of it
    parent = write_run(tmp_path / "parent_s0", [ppo_like(step) for step in range(20)])
    fork = write_run(tmp_path / "fork_s0", [ppo_like(step, loss_scale=0.5) for step in range(20)])
    figure = infra.plot.figure([parent, fork])
    panels = {axis.get_title(): axis for axis in figure.axes}
    fork_reward, parent_reward = panels["training reward"].get_lines()  # groups in name order: fork, parent
    assert np.array_equal(fork_reward.get_ydata(), parent_reward.get_ydata())
    assert (fork_reward.get_linestyle(), fork_reward.get_marker()) != (parent_reward.get_linestyle(),
                                                                       parent_reward.get_marker())
    fork_loss, parent_loss = panels["policy loss"].get_lines()
    assert np.allclose(fork_loss.get_ydata(), 0.5 * parent_loss.get_ydata())
