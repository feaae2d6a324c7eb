"""The study's plots: accuracy and exact-KL curves with seed bands, final accuracy against KL."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from klpo.study.grid import fmt
from klpo.study.summary import WINDOW, num
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.plots import save_figure, styles

__all__ = [
    "accuracy_vs_kl",
    "accuracy_vs_kl_figure",
    "curve_plots",
    "metric_curve",
    "plot_results",
    "seed_band",
]


def metric_curve(run_dir: Path, key: str) -> tuple[list[int], list[float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    pts = [(r["step"], num(r[key])) for r in read_metrics(path) if key in r]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_results(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], out: Path
) -> list[str]:
    """The per-(algorithm, beta) curve plots and ``accuracy_vs_kl.png``; returns their names."""
    return [*curve_plots(results, out), accuracy_vs_kl(cells, out)]


def curve_plots(results: list[dict[str, Any]], out: Path) -> list[str]:
    """Held-out accuracy and exact-KL curves (mean ± sd over seeds), one plot per (algorithm,
    beta) and metric, read from each run's ``metrics.jsonl``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    groups: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        groups.setdefault((r["algo"], float(r["beta"])), {}).setdefault(r["choice"], []).append(r)
    # "no KL" runs (beta 0) are drawn in every panel of their algorithm as the baseline.
    for (algo, beta), by_choice in groups.items():
        if beta == 0.0:
            continue
        baseline = groups.get((algo, 0.0), {})
        for key, ylabel, fname, smooth in (
            ("accuracy/heldout", "held-out accuracy (greedy)", "accuracy", 1),
            ("kl/ref/exact", "exact KL(pi_theta ‖ pi_ref) per token", "kl", 10),
        ):
            fig, ax = plt.subplots(figsize=(7, 4))
            series = sorted({**by_choice, **baseline}.items())
            for (choice, rs), style in zip(series, styles(len(series)), strict=True):
                xs, mean, lo, hi = seed_band(
                    [metric_curve(out / "runs" / r["name"], key) for r in rs], smooth
                )
                if not xs:
                    continue
                ax.plot(
                    xs, mean, label=choice, lw=1.5, markevery=max(1, len(xs) // 10), ms=4, **style
                )
                ax.fill_between(xs, lo, hi, color=style["color"], alpha=0.15, lw=0)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            run_mean = f", {smooth}-step running mean" if smooth > 1 else ""
            ax.set_title(f"{algo}, beta = {fmt(beta)} (mean ± sd over seeds{run_mean})")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1, 0.5))
            name = f"{fname}_{algo}_b{fmt(beta)}.png"
            save_figure(fig, out / name)
            plt.close(fig)
            names.append(name)
    return names


def _points(cells: list[dict[str, Any]], betas: list[float]) -> dict[tuple[str, str], list]:
    """Per (algo, choice): its cell in each beta's panel (its beta, or 0 for "no KL", drawn in
    every panel), or None where it has none or a non-finite point."""
    by_key: dict[tuple[str, str], list] = {}
    for c in cells:
        by_key.setdefault((c["algo"], c["choice"]), [None] * len(betas))
        for i, beta in enumerate(betas):
            if c["beta"] in (beta, 0.0) and math.isfinite(c["kl_final"] + c["acc_mean"]):
                by_key[(c["algo"], c["choice"])][i] = c
    return by_key


def _merged_series(cells: list[dict[str, Any]], betas: list[float]) -> list[tuple[str, list]]:
    """``(label, [cell or None per panel])``, one per (algo, choice), except that choices whose
    points coincide in every panel (k2, k3+ and k3_is train identically on-policy) are one
    series labelled ``k2 = k3+ = k3_is``."""
    groups: dict[tuple, list[tuple[str, str]]] = {}
    points = _points(cells, betas)
    for key, per_panel in sorted(points.items()):
        at = tuple(
            None if c is None else (round(c["kl_final"], 6), round(c["acc_mean"], 6))
            for c in per_panel
        )
        groups.setdefault((key[0], at), []).append(key)
    series = []
    for (algo, _), keys in groups.items():
        label = " = ".join(choice for _, choice in keys)
        series.append((label if algo == "grpo" else f"{algo}: {label}", points[keys[0]]))
    return series


def accuracy_vs_kl(cells: list[dict[str, Any]], out: Path) -> str:
    """Write :func:`accuracy_vs_kl_figure` as ``accuracy_vs_kl.png``; returns the name."""
    import matplotlib.pyplot as plt

    fig = accuracy_vs_kl_figure(cells)
    save_figure(fig, out / "accuracy_vs_kl.png")
    plt.close(fig)
    return "accuracy_vs_kl.png"


def accuracy_vs_kl_figure(cells: list[dict[str, Any]]):
    """Final held-out accuracy (mean ± sd over seeds) against the final exact KL, one panel per
    beta, one colour and marker per KL choice with the legend outside (no labels on the
    points: they overlap where the choices agree)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    betas = sorted({c["beta"] for c in cells if c["beta"] > 0}) or [0.0]
    series = _merged_series(cells, betas)
    fig, axes = plt.subplots(
        1, len(betas), figsize=(4.6 * len(betas), 4.8), squeeze=False, sharey=True
    )
    for (label, per_panel), style in zip(series, styles(len(series)), strict=True):
        for ax, c in zip(axes[0], per_panel, strict=True):
            if c is not None:
                ax.errorbar(
                    c["kl_final"],
                    c["acc_mean"],
                    yerr=_nan0(c["acc_sd"]),
                    ms=6,
                    capsize=2,
                    lw=1,
                    mec="white",
                    mew=0.5,
                    label=label,
                    **style,
                )
    kls = [c["kl_final"] for _, per in series for c in per if c is not None]
    wide = bool(kls) and min(kls) > 0 and max(kls) > 10 * min(kls)
    for ax, beta in zip(axes[0], betas, strict=True):
        if wide:  # the choices that hold the KL crowd near zero on a linear axis
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 3.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"final exact KL per token (last {WINDOW} steps)")
        ax.set_title(f"beta = {fmt(beta)}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final held-out accuracy (mean ± sd over seeds)")
    baseline = any(c["beta"] == 0.0 for c in cells) and len(betas) > 1
    title = "KL choice (no KL: in every panel)" if baseline else "KL choice"
    handles = {}
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        frameon=False,
        fontsize=8,
        title=title,
    )
    fig.tight_layout()
    return fig


def _nan0(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def seed_band(curves: list[tuple[list[int], list[float]]], smooth: int):
    """Mean and mean ± sd over seeds at the steps all curves share, after a running mean."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], [], [], []
    common = sorted(set.intersection(*(set(xs) for xs, _ in curves)))
    series = []
    for xs, ys in curves:
        at = dict(zip(xs, ys, strict=True))
        vals = [at[s] for s in common]
        if smooth > 1:
            vals = [
                statistics.fmean(vals[max(0, i - smooth + 1) : i + 1]) for i in range(len(vals))
            ]
        series.append(vals)
    mean, lo, hi = [], [], []
    for i in range(len(common)):
        col = [s[i] for s in series if math.isfinite(s[i])]
        m = statistics.fmean(col) if col else math.nan
        sd = statistics.stdev(col) if len(col) > 1 else 0.0
        mean.append(m)
        lo.append(m - sd)
        hi.append(m + sd)
    return common, mean, lo, hi
