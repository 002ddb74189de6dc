"""The run's figure: one panel per series, the validation points on the loss panel."""
from __future__ import annotations

from onegpu.training.record import figure


def test_the_loss_panel_draws_the_validation_points_beside_the_steps():
    rows = [(s, {"loss": 2.0 - s / 10, "grad_norm": 1.0, "mem_peak_bytes": 2**20, "samples_per_second": 5.0})
            for s in range(1, 5)] + [(2, {"eval_loss": 1.9}), (4, {"eval_loss": 1.7})]
    fig = figure.plot_steps(rows, "run")
    loss = fig.axes[0]
    assert [list(line.get_xdata()) for line in loss.get_lines()] == [[1, 2, 3, 4], [2, 4]]
    assert list(loss.get_lines()[1].get_ydata()) == [1.9, 1.7]
    assert loss.get_title() == "loss: 1.9 -> 1.6; eval 1.7"
    without = figure.plot_steps(rows[:4], "run")
    assert len(without.axes[0].get_lines()) == 1 and without.axes[0].get_title() == "loss: 1.9 -> 1.6"


def test_a_run_that_logs_a_reward_gets_its_panel_first_with_the_validation_reward():
    """GRPO's steps log ``reward`` (its loss is about 0 at every step): the reward panel leads, then the four."""
    rows = [(s, {"loss": 0.0, "grad_norm": 1.0, "mem_peak_bytes": 2**20, "samples_per_second": 5.0,
                 "reward": 0.1 * s}) for s in range(1, 5)] + [(4, {"eval_reward": 0.5, "eval_pass_rate": 0.25})]
    fig = figure.plot_steps(rows, "run")
    assert [ax.get_title().split(":")[0] for ax in fig.axes] == ["reward", "loss", "grad_norm", "memory", "speed"]
    assert fig.axes[0].get_title() == "reward: 0.1 -> 0.4; eval 0.5"
    assert len(figure.plot_steps(rows, "run", thumbnail=True).axes) == 5
