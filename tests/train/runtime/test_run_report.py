"""A run's report and plots: smoothed curves over faint raw ones, nothing drawn for a constant,
no accuracy plot that repeats the reward's, and a report at every checkpoint."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.plots import (
    SMOOTH_FROM,
    constant_value,
    plot_series,
    robust_limits,
    running_mean,
    smoothing_window,
    styles,
)
from klpo.train.runtime.report import heldout_counts, plot_content, write_plots, write_report


def test_running_mean_against_a_convolution():
    rng = np.random.default_rng(0)
    ys = rng.normal(size=57).tolist()
    for w in (1, 5, 20):
        # naive: mean of the window ending at i, shorter at the start
        naive = [float(np.mean(ys[max(0, i - w + 1) : i + 1])) for i in range(len(ys))]
        full = np.convolve(ys, np.ones(w) / w, mode="valid")  # the complete windows
        got = running_mean(ys, w)
        assert got == pytest.approx(naive, abs=1e-12)
        assert got[w - 1 :] == pytest.approx(full.tolist(), abs=1e-12)
    assert running_mean([1.0, math.nan, 3.0], 2) == [1.0, 1.0, 3.0]  # NaN skipped


def test_smoothing_window_and_constants():
    assert [smoothing_window(n) for n in (3, 19, 20, 100, 400, 1500)] == [1, 1, 5, 5, 20, 50]
    assert constant_value([0.1] * 5) == 0.1 and constant_value([0.1, 0.1000001]) is None
    assert constant_value([2.5]) == 2.5 and constant_value([]) is None


def test_seventy_series_each_look_different():
    pairs = [(s["color"], s["marker"]) for s in styles(70)]
    assert len(set(pairs)) == 70
    # neighbours differ in both colour and marker (the eye follows one into the next)
    assert all(a[0] != b[0] and a[1] != b[1] for a, b in itertools.pairwise(pairs))


def test_a_long_series_is_its_running_mean_over_faint_raw_values():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(1, 101))
    ys = [math.sin(x / 7) + (x % 3) for x in xs]
    _, ax = plt.subplots()
    plot_series(ax, xs, ys, "reward")
    raw, smooth = ax.lines
    assert raw.get_alpha() == 0.25 and list(raw.get_ydata()) == ys
    assert list(smooth.get_ydata()) == pytest.approx(running_mean(ys, 5))
    assert smooth.get_label() == "reward (5-step running mean)"
    short = plt.subplots()[1]
    plot_series(short, xs[: SMOOTH_FROM - 1], ys[: SMOOTH_FROM - 1], "reward")
    assert len(short.lines) == 1 and short.lines[0].get_label() == "reward"
    plt.close("all")


def rows_of(steps: int, *, beta: float | None = 0.1, acc_is_reward: bool = True) -> list[dict]:
    rows = [{"step": 0, "accuracy/heldout": 0.25}]
    for s in range(1, steps + 1):
        reward = (s % 4) / 4
        rows.append(
            {
                "step": s,
                "reward/mean": reward,
                "accuracy/train": reward if acc_is_reward else reward / 2,
                "kl/ref/exact": 0.001 * s,
                "kl/ref/k1": 0.001 * s + 0.01 * (-1) ** s,
                "kl/ref/k3": 0.001 * s,
                "entropy": 1.0 / s,
                "beta": beta if beta is not None else 0.1 + 0.001 * s,
                **({"accuracy/heldout": 0.25 + 0.01 * s} if s % 10 == 0 else {}),
            }
        )
    return rows


def test_what_each_plot_draws_and_what_the_report_says_instead():
    content, notes = plot_content(rows_of(30), "k1")
    drawn = {name: [key for key, *_ in series] for name, series in content.items()}
    assert drawn == {
        "reward.png": ["reward/mean"],
        "accuracy.png": ["accuracy/heldout"],  # the train accuracy is the mean reward here
        "kl.png": ["kl/ref/exact", "kl/ref/k1", "kl/ref/k3"],
        "entropy.png": ["entropy"],
        "beta.png": [],  # a fixed beta: no flat line on a ±4% axis
    }
    assert "beta fixed at 0.1 (no plot)." in notes
    assert any("train accuracy equals the mean reward" in n for n in notes)
    # Where they differ (a reward that is not 0/1) and beta moves, both are drawn.
    content, notes = plot_content(rows_of(30, beta=None, acc_is_reward=False), "k3")
    assert [k for k, *_ in content["accuracy.png"]] == ["accuracy/train", "accuracy/heldout"]
    assert [k for k, *_ in content["beta.png"]] == ["beta"] and notes == []


def test_the_report_names_the_plots_it_wrote_and_removes_stale_ones(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(40)))
    (tmp_path / "beta.png").write_bytes(b"stale")  # an earlier report's, of a moving beta
    report = write_report(tmp_path, estimator="k1").read_text()
    written = {p.name for p in tmp_path.glob("*.png")}
    assert written == {"reward.png", "accuracy.png", "kl.png", "entropy.png"}
    for name in written:
        assert f"![{name}]({name})" in report
    assert "![beta.png]" not in report and "beta fixed at 0.1 (no plot)." in report
    assert "metrics (steps 1–40)" in report and "| at step 40 (latest) | 0.650 |" in report
    assert "| `kl/ref/k1` | 0.05 |" in report  # the configured estimate at step 40
    rows = [{**r, "kl/ref/full": r["kl/ref/exact"]} for r in rows_of(40) if r["step"]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = write_report(tmp_path, estimator="full").read_text()
    assert "| `kl/ref/exact` | 0.04 |" in full and "kl/ref/full" not in full  # one row, not two


def test_an_interrupted_run_has_its_report_and_plots(tiny_model, quick, tmp_path, monkeypatch):
    """A run killed after its checkpoint of step 2 (of 4) has report.md and plots of steps 1-2."""
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 4, "run.save_every": 2}))
    real = loop.train_step

    def dies_at_three(run, step):
        if step == 3:
            raise KeyboardInterrupt  # a kill the run cannot catch
        return real(run, step)

    monkeypatch.setattr(loop, "train_step", dies_at_three)
    with pytest.raises(KeyboardInterrupt):
        loop.train(cfg, log=lambda *_: None)
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 2
    report = (out / "report.md").read_text()
    assert "metrics (steps 1–2)" in report and (out / "kl.png").is_file()


def _spiky_kl(steps: int = 1500) -> tuple[list[float], list[float]]:
    """A k3 estimate whose trend rises 0 -> 0.4 with rare spikes to 6, and the exact KL under it."""
    rng = np.random.default_rng(0)
    exact = [0.4 * s / steps for s in range(1, steps + 1)]
    k3 = [e + abs(rng.normal(0, 0.02)) for e in exact]
    for i in range(7, steps, 150):  # 10 spikes
        k3[i] = 6.0
    return exact, k3


def test_robust_limits_show_the_trend_not_the_spikes():
    exact, k3 = _spiky_kl()
    lo, hi = robust_limits([exact, k3])
    # The range holds every running mean over a complete window (the trend reaches ~0.4, the
    # spikes lift k3's mean a little) and the 98% quantile, and leaves the ten spikes at 6 out.
    w = smoothing_window(len(k3))  # 50; the first means of a spike are the spike: not counted
    smooth_max = max(max(running_mean(ys, w)[w - 1 :]) for ys in (exact, k3))
    assert smooth_max < hi < 1.0 and lo < 0.0 < hi
    assert sum(y > hi for y in k3) == 10
    # No value outside: the automatic range stands (None).
    assert robust_limits([exact, [e + 0.01 for e in exact]]) is None
    assert robust_limits([[1.0, 2.0]]) is None  # too few points to judge


def test_kl_png_on_a_robust_scale_with_the_exact_kl_on_top(tmp_path, monkeypatch):
    from klpo.train.runtime import report

    exact, k3 = _spiky_kl()
    rows = [{"step": s, "kl/ref/exact": e, "kl/ref/k3": k, "kl/ref/k1": k - 0.01}
            for s, (e, k) in enumerate(zip(exact, k3, strict=True), start=1)]  # fmt: skip
    figures = {}

    def keep(fig, path):
        figures[path.name] = fig

    monkeypatch.setattr(report, "save_figure", keep)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda fig: None)
    written, _ = report.write_plots(tmp_path, rows, "k3")
    assert "kl.png" in written
    ax = figures["kl.png"].axes[0]
    top = max(ax.lines, key=lambda line: line.get_zorder())
    assert top.get_label().startswith("exact (full vocabulary)")
    assert ax.get_ylim()[1] < 1.0  # not stretched to the spikes at 6
    assert ax.get_title(loc="right") == "20 raw values outside the range shown"  # k1 and k3


def test_logged_completions_are_spread_over_the_prompts():
    from klpo.train.step.sample_records import spread_rows

    # 4 of a step of 4 prompts x 8 completions: the first of each prompt, not 4 copies of one.
    assert spread_rows(4, 32, 8) == [0, 8, 16, 24]
    # More than the prompts: then each prompt's second completion, in batch order.
    assert spread_rows(5, 8, 4) == [0, 1, 2, 4, 5]
    assert spread_rows(3, 2, 8) == [0, 1] and spread_rows(0, 8, 4) == []
    assert spread_rows(6, 6, 1) == list(range(6))  # groups of one: the batch's order


def test_one_evaluation_is_one_row_of_the_report(tmp_path):
    from klpo.train.runtime.report import RunReport, heldout_section

    rows = [{"step": 0, "accuracy/heldout": 0.3}, {"step": 1, "reward/mean": 0.1}]
    lines = heldout_section(RunReport(tmp_path, rows, "k3", [], []))
    assert [x for x in lines if x.startswith("| at step")] == ["| at step 0 | 0.300 |"]


def _wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval by its closed form (Wilson 1927), the oracle."""
    centre = (k + z * z / 2) / (n + z * z)
    half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
    return centre - half, centre + half


def test_held_out_lines_carry_their_count_and_interval(tmp_path):
    # accuracies 0.25 at step 0 ... 0.65 at step 40: counts of 20 problems (5/20 ... 13/20)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_of(40)))
    report = write_report(tmp_path, estimator="k1", heldout_n=20).read_text()
    lo, hi = _wilson(13, 20)
    assert (
        f"| at step 40 (latest) | 0.650 (13/20 right; 95% interval {lo:.3f}-{hi:.3f}) |" in report
    )
    lo, hi = _wilson(5, 20)
    assert f"| at step 0 | 0.250 (5/20 right; 95% interval {lo:.3f}-{hi:.3f}) |" in report
    assert "| change | +0.400 |" in report
    # a graded accuracy (not a count of 20) stays bare; no n: bare
    assert heldout_counts(0.333, 20) is None and heldout_counts(0.65, None) is None
    assert heldout_counts(0.65, 20) == (13, 20)


def test_the_held_out_plot_draws_each_evaluations_interval(tmp_path, monkeypatch):
    import matplotlib.axes

    bars = []
    real = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "errorbar",
        lambda ax, *a, **k: bars.append((a, k)) or real(ax, *a, **k),
    )
    write_plots(tmp_path, rows_of(40), "k1", heldout_n=20)
    (xs, ys), kw = bars[0]
    assert list(ys) == pytest.approx([0.25, 0.35, 0.45, 0.55, 0.65])
    assert list(xs) == [0, 10, 20, 30, 40] and len(bars) == 1
    lo, hi = _wilson(9, 20)  # step 20: 0.45, 9 of 20
    assert kw["yerr"][0][2] == pytest.approx(0.45 - lo) and kw["yerr"][1][2] == pytest.approx(
        hi - 0.45
    )
    assert kw["label"] == "95% Wilson interval (20 problems)"


def test_the_note_names_reward_png_only_where_it_is_drawn():
    # a constant 0/1 reward: reward.png has nothing to draw, so the note cannot point at it
    rows = [{"step": s, "reward/mean": 0.0, "accuracy/train": 0.0} for s in range(1, 31)]
    content, notes = plot_content(rows, "k1")
    assert content["reward.png"] == []
    said = [n for n in notes if n.startswith("The train accuracy")]
    assert said == ["The train accuracy equals the mean reward at every step (a 0/1 reward)."]
