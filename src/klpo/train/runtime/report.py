"""A run's report: PNG plots and a short ``report.md`` beside the metrics and config.

Written at every checkpoint and at the end (so an interrupted run has one). The plots follow
:mod:`klpo.train.runtime.plots`: smoothed curves over faint raw ones, and no plot of what did not
change; ``report.md`` says such values instead ("beta fixed at 0.1"), and draws the train
accuracy only where it differs from the mean reward (under a 0/1 reward such as the default
``exact_match`` the two are the same number, and ``reward.png`` has it).

``report.md`` is a list of sections (:data:`SECTIONS`), each a function of a
:class:`RunReport`; a new section is one more entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klpo import kl
from klpo._io import write_text_atomic
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.plots import constant_value, plot_series, robust_limits, save_figure
from klpo.train.runtime.samples import latest_samples, samples_table

__all__ = [
    "PLOTS",
    "SECTIONS",
    "RunReport",
    "heldout_counts",
    "plot_content",
    "save_figure",
    "write_plots",
    "write_report",
]

PLOTS: dict[str, tuple[str, list[tuple[str, str]] | None]] = {
    "reward.png": (
        "reward",
        [
            ("reward/mean", "mean reward (trained on)"),
            ("reward/gold", "gold reward (never trained on)"),
        ],
    ),
    "accuracy.png": (
        "accuracy",
        [("accuracy/train", "train (sampled)"), ("accuracy/heldout", "held-out (greedy)")],
    ),
    "kl.png": ("KL(pi_theta ‖ pi_ref) per token", None),  # exact vs the logged estimate
    "entropy.png": ("entropy per token (nats)", [("entropy", "entropy")]),
    "beta.png": ("KL coefficient beta", [("beta", "beta")]),
}
"""The plots: file name -> (y label, [(metric key, legend)]); None: the KL keys of the run."""

Series = tuple[str, str, list[int], list[float]]  # key, legend, steps, values
Rows = list[dict[str, Any]]


def _series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, int | float) and math.isfinite(v):
            xs.append(r["step"])
            ys.append(float(v))
    return xs, ys


def _is_exact(estimator: str) -> bool:
    """Whether the estimator is the exact KL, logged as ``kl/ref/exact`` (``needs_logits``)."""
    spec = kl.SPECS.get(estimator)
    return spec is not None and spec.needs_logits


def _kl_keys(estimator: str) -> list[tuple[str, str]]:
    """The exact KL beside the configured estimate and k1, k3 (always logged)."""
    shown = dict.fromkeys(n for n in (estimator, "k1", "k3") if not _is_exact(n))
    return [("kl/ref/exact", "exact (full vocabulary)")] + [
        (f"kl/ref/{n}", f"estimate: {n}" + (" (configured)" if n == estimator else ""))
        for n in shown
    ]


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= 1e-9 for x, y in zip(a[1], b[1], strict=True))


def plot_content(rows: Rows, estimator: str) -> tuple[dict[str, list[Series]], list[str]]:
    """What each plot draws, and a note for each series left out: a constant one (its value
    instead), the train accuracy where it equals the mean reward."""
    content: dict[str, list[Series]] = {}
    notes: list[str] = []
    for name, (_, keys) in PLOTS.items():
        drawn = []
        for key, legend in keys if keys is not None else _kl_keys(estimator):
            xs, ys = _series(rows, key)
            if not xs:
                continue
            if key == "accuracy/train" and _same((xs, ys), _series(rows, "reward/mean")):
                drawn_reward = any(s[0] == "reward/mean" for s in content.get("reward.png", []))
                notes.append(
                    "The train accuracy equals the mean reward at every step (a 0/1 reward)"
                    + (": `reward.png` shows it." if drawn_reward else ".")
                )
                continue
            value = constant_value(ys)
            if value is not None:
                notes.append(_constant_note(key, legend, value, xs))
                continue
            drawn.append((key, legend, xs, ys))
        content[name] = drawn
    return content, notes


def _constant_note(key: str, legend: str, value: float, xs: list[int]) -> str:
    if key == "beta":
        return f"beta fixed at {value:g} (no plot)."
    where = f"at step {xs[0]} only" if len(xs) == 1 else f"at every step from {xs[0]} to {xs[-1]}"
    return f"`{key}` ({legend}) was {value:.4g} {where} (no plot)."


def heldout_counts(acc: float, n: int | None) -> tuple[int, int] | None:
    """``(right, n)`` where the held-out accuracy ``acc`` is a count of ``n`` 0/1-scored
    problems (``acc * n`` a whole number); None otherwise (no ``n``, a graded reward)."""
    if not n:
        return None
    k = round(acc * n)
    return (k, n) if abs(k / n - acc) < 1e-9 else None


def write_plots(
    run_dir: Path, rows: Rows, estimator: str, heldout_n: int | None = None
) -> tuple[list[str], list[str]]:
    """Draw :data:`PLOTS` into ``run_dir`` (removing one left with nothing to draw); returns the
    names written and the notes of :func:`plot_content`. With ``heldout_n`` (the held-out
    problems) the held-out accuracy is drawn with its 95% Wilson interval at each evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    content, notes = plot_content(rows, estimator)
    written = []
    for name, series in content.items():
        if not series:
            (run_dir / name).unlink(missing_ok=True)  # an earlier report's, now stale
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for key, legend, xs, ys in series:  # the exact KL over the estimates it is judged by
            plot_series(ax, xs, ys, legend, zorder=4.0 if key == "kl/ref/exact" else 2.0)
            if key == "accuracy/heldout":
                _interval_bars(ax, xs, ys, heldout_n)
        limits = robust_limits([ys for *_, ys in series]) if name == "kl.png" else None
        if limits is not None:
            ax.set_ylim(*limits)
            outside = sum(not limits[0] <= y <= limits[1] for *_, ys in series for y in ys)
            ax.set_title(
                f"{outside} raw value{'s' if outside != 1 else ''} outside the range shown",
                fontsize=8,
                loc="right",
            )
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 2.5
        ax.set_ylabel(PLOTS[name][0])
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
        save_figure(fig, run_dir / name)
        plt.close(fig)
        written.append(name)
    return written, notes


def _interval_bars(ax: Any, xs: list[int], ys: list[float], n: int | None) -> None:
    """The 95% Wilson interval of each held-out accuracy that is a count of ``n`` problems."""
    from klpo.train.runtime.metrics import wilson_interval

    pts = [(x, y, heldout_counts(y, n)) for x, y in zip(xs, ys, strict=True)]
    pts = [(x, y, wilson_interval(*c)) for x, y, c in pts if c is not None]
    if not pts:
        return
    ax.errorbar(
        [x for x, _, _ in pts],
        [y for _, y, _ in pts],
        yerr=[[y - lo for _, y, (lo, _) in pts], [hi - y for _, y, (_, hi) in pts]],
        fmt="none", ecolor="0.35", elinewidth=1.0, capsize=3, zorder=3.0,
        label=f"95% Wilson interval ({n} problems)",
    )  # fmt: skip


@dataclass
class RunReport:
    """What the sections of ``report.md`` read: the run's directory and metrics rows, its
    estimator, the plots written and the notes on what was not drawn."""

    run_dir: Path
    rows: Rows
    estimator: str
    plots: list[str]
    notes: list[str]
    heldout_n: int | None = None


def heldout_section(r: RunReport) -> list[str]:
    steps, accs = _series(r.rows, "accuracy/heldout")
    if not steps:
        return []

    def cell(acc: float) -> str:
        counts = heldout_counts(acc, r.heldout_n)
        if counts is None:
            return f"{acc:.3f}"
        from klpo.train.runtime.metrics import wilson_interval

        lo, hi = wilson_interval(*counts)
        return f"{acc:.3f} ({counts[0]}/{counts[1]} right; 95% interval {lo:.3f}-{hi:.3f})"

    first, latest, best = accs[0], accs[-1], max(accs)
    head = ["| held-out accuracy (greedy) | value |", "| --- | --- |"]
    if len(steps) == 1:  # one evaluation: one row, not the same step twice
        return [*head, f"| at step {steps[0]} | {cell(first)} |", ""]
    return [
        *head,
        f"| at step {steps[0]} | {cell(first)} |",
        f"| at step {steps[-1]} (latest) | {cell(latest)} |",
        f"| best | {cell(best)} |",
        f"| change | {latest - first:+.3f} |",
        "",
    ]


SUMMARY_KEYS = (
    "reward/mean",
    "reward/gold",
    "kl/ref/exact",
    "<est>",
    "entropy",
    "beta",
    "time/generate",
    "time/score",
    "time/update",
    "time/step",
    "tokens_per_s",
)
"""The last step's metrics in ``report.md`` (``<est>``: the configured estimator's)."""


def last_step_section(r: RunReport) -> list[str]:
    last = r.rows[-1] if r.rows else {}
    est = "kl/ref/exact" if _is_exact(r.estimator) else f"kl/ref/{r.estimator}"  # (the same)
    keys = dict.fromkeys(est if k == "<est>" else k for k in SUMMARY_KEYS)
    lines = ["| last step's metric | value |", "| --- | --- |"]
    for k in keys:
        if k in last:
            v = last[k]
            lines.append(
                f"| `{k}` | {v:.4g} |" if isinstance(v, int | float) else f"| `{k}` | {v} |"
            )
    return [*lines, ""]


def plots_section(r: RunReport) -> list[str]:
    notes = [*r.notes, ""] if r.notes else []
    return ["## Plots", "", *notes, *(f"![{n}]({n})" for n in r.plots), ""]


def samples_section(r: RunReport) -> list[str]:
    """The latest logged completions of each split (``samples.jsonl``), as Markdown tables."""
    out = []
    for split, records in latest_samples(r.run_dir).items():
        what = "training (sampled)" if split == "train" else "held-out (greedy)"
        out += [f"## Latest {what} completions, step {records[0]['step']}", ""]
        out += [samples_table(records), "(all of them: `samples.jsonl`)", ""]
    return out


SECTIONS: list[Callable[[RunReport], list[str]]] = [
    heldout_section,
    last_step_section,
    plots_section,
    samples_section,
]
"""The sections of ``report.md``, in order; a new section is one more function here."""


def write_report(
    run_dir: str | Path,
    *,
    estimator: str,
    title: str = "klpo train",
    heldout_n: int | None = None,
) -> Path:
    """Plot the run's metrics so far and write ``report.md``; returns the report's path.
    ``heldout_n``: the held-out problems, for the counts and intervals of a 0/1 accuracy."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    plots, notes = write_plots(run_dir, rows, estimator, heldout_n)
    steps = [r["step"] for r in rows if r.get("step", 0) > 0]
    upto = f"steps {steps[0]}–{steps[-1]}" if steps else "no steps yet"
    if steps and steps[0] > 1:  # (a resume after metrics.jsonl was lost: the rest is gone)
        upto += f"; those of steps 1–{steps[0] - 1} are not in the file"
    lines = [
        f"# {title}",
        "",
        f"Run directory: `{run_dir}`; resolved config: `config.yaml`; metrics ({upto}): "
        "`metrics.jsonl`.",
        "",
    ]
    report = RunReport(run_dir, rows, estimator, plots, notes, heldout_n)
    for section in SECTIONS:
        lines += section(report)
    path = run_dir / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path
