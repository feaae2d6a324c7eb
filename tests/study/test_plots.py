"""The study's plots with many series: one colour and marker per series, the legend outside the
axes, no labels written on the points (they overlapped where choices agree)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from klpo.study.frontier import ChoiceFrontier, Curve, frontier_figure
from klpo.study.plots import accuracy_vs_kl_figure

CHOICES = [f"{e} {p}" for e in ("k1", "k2", "k3", "full") for p in ("reward", "loss")]


def _cell(algo: str, choice: str, beta: float, kl: float, acc: float) -> dict:
    return {"algo": algo, "choice": choice, "beta": beta, "kl_final": kl, "acc_mean": acc,
            "acc_sd": 0.01}  # fmt: skip


def _legend(fig) -> tuple[list[str], list[tuple]]:
    """The figure's one legend: its labels and each series' (colour, marker), read from the
    lines drawn (an error bar's data line) under that label."""
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    drawn = {}
    for ax in fig.axes:
        for c in ax.containers:
            drawn.setdefault(c.get_label(), c.lines[0])
        for line in ax.lines:
            drawn.setdefault(line.get_label(), line)
    lines = [drawn[label] for label in labels]
    return labels, [(matplotlib.colors.to_hex(x.get_color()), x.get_marker()) for x in lines]


def _outside(fig) -> bool:
    """Whether the legend lies right of every axes (it covers no point)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.legends[0].get_window_extent(renderer)
    return all(box.x0 >= ax.get_window_extent(renderer).x1 for ax in fig.axes)


def test_accuracy_vs_kl_has_a_style_per_choice_and_merges_coinciding_ones():
    cells = []
    for i, choice in enumerate(CHOICES):
        for beta in (0.01, 0.1):
            cells.append(_cell("grpo", choice, beta, 0.001 * (i + 1) / beta, 0.3 + 0.02 * i))
    # three choices that train identically on-policy land on one point in every panel
    for choice in ("k2 loss", "k3+ loss", "k3_is loss"):
        cells = [c for c in cells if c["choice"] != choice]
        cells += [_cell("grpo", choice, b, 0.5, 0.4) for b in (0.01, 0.1)]
    cells += [_cell("grpo", "no KL", 0.0, 30.0, 0.2), _cell("ppo", "k1 reward", 0.1, 0.2, 0.5)]
    fig = accuracy_vs_kl_figure(cells)
    labels, styles = _legend(fig)
    assert "k2 loss = k3+ loss = k3_is loss" in labels and "ppo: k1 reward" in labels
    assert "no KL" in labels and len(labels) == len(set(labels)) == len(CHOICES) + 2 + 1 - 1
    assert len(set(styles)) == len(styles)  # no two series look alike
    assert not any(ax.texts for ax in fig.axes)  # nothing written on the points
    assert _outside(fig)
    assert [ax.get_xscale() for ax in fig.axes] == ["log", "log"]  # 0.01 to 30: spread out
    assert fig.legends[0].get_title().get_text() == "KL choice (no KL: in every panel)"
    # the no-KL point is drawn in both beta panels
    assert [sum(1 for c in ax.containers if c.get_label() == "no KL") for ax in fig.axes] == [1, 1]
    plt.close(fig)


@pytest.mark.parametrize("n", [3, 24])
def test_frontier_has_a_style_per_choice_and_the_legend_outside(n):
    frontiers = []
    for i in range(n):
        cells = [
            {"beta": b, "kl_seq_final": k, "gold_final": 0.3 - 0.01 * i, "gold_sd": 0.01}
            for b, k in ((0.1, 1.0 + i), (0.01, 5.0 + i))
        ]
        curve = Curve(beta=0.1, steps=[1, 2, 3], gold=[0.2, 0.3, 0.25], proxy=[0.5] * 3,
                      kl_seq=[0.5, 1.0, 2.0 + i])  # fmt: skip
        frontiers.append(ChoiceFrontier("grpo" if i else "ppo", f"choice {i}", cells, [curve]))
    fig = frontier_figure(frontiers, window=1)
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["ppo: choice 0", *(f"choice {i}" for i in range(1, n))]

    def style(line) -> tuple:
        return matplotlib.colors.to_hex(line.get_color()), line.get_marker()

    styles = [style(h) for h in legend.legend_handles]
    assert len(set(styles)) == n
    ax_end, ax_ck = fig.axes  # each choice's staircase is drawn in its legend's style
    assert sorted(style(line) for line in ax_ck.lines) == sorted(styles)
    assert {style(c.lines[0]) for c in ax_end.containers} == set(styles)
    assert _outside(fig)
    plt.close(fig)
