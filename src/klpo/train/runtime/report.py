"""The end-of-run report: PNG plots and a short ``report.md`` beside the metrics and config."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from klpo import _io
from klpo._io import write_text_atomic
from klpo.train.runtime.metrics import read_metrics

PLOTS = {
    "reward.png": ("reward", [("reward/mean", "mean reward")]),
    "accuracy.png": (
        "accuracy",
        [("accuracy/train", "train (sampled)"), ("accuracy/heldout", "held-out (greedy)")],
    ),
    "kl.png": ("KL(pi_theta ‖ pi_ref) per token", None),  # exact vs the logged estimate
    "entropy.png": ("entropy per token (nats)", [("entropy", "entropy")]),
    "beta.png": ("KL coefficient beta", [("beta", "beta")]),
}


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def save_figure(fig, path: Path) -> None:
    """Save a matplotlib figure as PNG, atomically and durably (:func:`klpo._io.save_figure`)."""
    _io.save_figure(fig, path, dpi=110, bbox_inches="tight")


def write_report(run_dir: str | Path, *, estimator: str, title: str = "klpo train") -> Path:
    """Plot the run's metrics and write ``report.md``; returns the report's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    est_key = f"kl/ref/{estimator}"
    for name, (label, keys) in PLOTS.items():
        if keys is None:  # the exact KL beside the configured estimate and k1, k3 (always logged)
            shown = dict.fromkeys(n for n in (estimator, "k1", "k3") if n != "full")
            keys = [("kl/ref/exact", "exact (full vocabulary)")] + [
                (f"kl/ref/{n}", f"estimate: {n}" + (" (configured)" if n == estimator else ""))
                for n in shown
            ]
        fig, ax = plt.subplots(figsize=(6, 3.4))
        drawn = False
        for key, legend in keys:
            xs, ys = _series(rows, key)
            if len(xs) > 100:  # per-step values are noisy: draw a running mean
                ys = [
                    sum(ys[max(0, i - 19) : i + 1]) / (i + 1 - max(0, i - 19))
                    for i in range(len(ys))
                ]
                legend += " (20-step mean)"
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=legend)
                drawn = True
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(frameon=False)
        save_figure(fig, run_dir / name)
        plt.close(fig)

    last = rows[-1] if rows else {}
    evals = _series(rows, "accuracy/heldout")
    lines = [f"# {title}", "", f"Run directory: `{run_dir}`; resolved config: `config.yaml`.", ""]
    if evals[0]:
        first, final = evals[1][0], evals[1][-1]
        best = max(evals[1])
        lines += [
            "| held-out accuracy (greedy) | value |",
            "| --- | --- |",
            f"| at step {evals[0][0]} | {first:.3f} |",
            f"| at step {evals[0][-1]} (final) | {final:.3f} |",
            f"| best | {best:.3f} |",
            f"| change | {final - first:+.3f} |",
            "",
        ]
    summary_keys = [
        "reward/mean",
        "kl/ref/exact",
        est_key,
        "entropy",
        "beta",
        "time/generate",
        "time/score",
        "time/update",
        "time/step",
        "tokens_per_s",
    ]
    lines += ["| last step's metric | value |", "| --- | --- |"]
    for k in summary_keys:
        if k in last:
            v = last[k]
            lines.append(
                f"| `{k}` | {v:.4g} |" if isinstance(v, int | float) else f"| `{k}` | {v} |"
            )
    lines += [""] + [f"![{n}]({n})" for n in PLOTS] + [""]
    path = run_dir / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path
