"""The study's plots: accuracy and exact-KL curves with seed bands, final accuracy against KL."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from klpo.study.grid import fmt
from klpo.study.summary import WINDOW, num
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.report import save_figure

__all__ = ["metric_curve", "plot_results", "seed_band"]


def metric_curve(run_dir: Path, key: str) -> tuple[list[int], list[float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    pts = [(r["step"], num(r[key])) for r in read_metrics(path) if key in r]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_results(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], out: Path
) -> list[str]:
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
            for choice, rs in sorted({**by_choice, **baseline}.items()):
                xs, mean, lo, hi = seed_band(
                    [metric_curve(out / "runs" / r["name"], key) for r in rs], smooth
                )
                if not xs:
                    continue
                (line,) = ax.plot(xs, mean, label=choice, lw=1.5)
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{algo}, beta = {fmt(beta)} (mean ± sd over seeds)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(frameon=False, fontsize=8, ncol=2)
            name = f"{fname}_{algo}_b{fmt(beta)}.png"
            save_figure(fig, out / name)
            plt.close(fig)
            names.append(name)
    # One panel per beta (the "no KL" cells in each); cells that land on the same point (k2, k3+
    # and k3_is train identically on-policy) share one label.
    betas = sorted({c["beta"] for c in cells if c["beta"] > 0}) or [0.0]
    fig, axes = plt.subplots(1, len(betas), figsize=(5.5 * len(betas), 4.5), squeeze=False)
    for ax, beta in zip(axes[0], betas, strict=True):
        points: dict[tuple[str, float, float], list[dict[str, Any]]] = {}
        for c in cells:
            if c["beta"] not in (beta, 0.0):
                continue
            if math.isfinite(c["kl_final"]) and math.isfinite(c["acc_mean"]):
                key = (c["algo"], round(c["kl_final"], 6), round(c["acc_mean"], 6))
                points.setdefault(key, []).append(c)
        for (algo, x, y), cs in sorted(points.items()):
            marker = "o" if algo == "grpo" else "s"
            ax.errorbar(x, y, yerr=_nan0(cs[0]["acc_sd"]), fmt=marker, ms=5, capsize=2)
            label = " = ".join(c["choice"] for c in cs)
            ax.annotate(
                label if algo == "grpo" else f"{algo}: {label}",
                (x, y),
                fontsize=7,
                xytext=(4, 2),
                textcoords="offset points",
            )
        ax.set_xlabel(f"final exact KL per token (mean of the last {WINDOW} steps)")
        ax.set_ylabel("final held-out accuracy (mean ± sd over seeds)")
        ax.set_title(f"beta = {fmt(beta)} (o: grpo, s: ppo)")
        ax.grid(alpha=0.3)
    save_figure(fig, out / "accuracy_vs_kl.png")
    plt.close(fig)
    names.append("accuracy_vs_kl.png")
    return names


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
