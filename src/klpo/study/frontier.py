r"""Gold reward against KL: the frontiers of the over-optimisation study.

On the over-optimisation task (``data.source: builtin-overopt``, docs/overopt.md) every run logs
the gold reward ``reward/gold`` (never trained on), the proxy reward it is trained on and the exact
sequence KL(pi_theta ‖ pi_ref) ``kl/ref/seq`` (summed over a completion, mean over completions).
A KL choice (estimator, placement, algorithm) trades one for the other through beta; its
**frontier** is the best gold reward it reaches within a KL budget ``B`` (Gao et al. 2023,
"Scaling Laws for Reward Model Overoptimization", arXiv:2210.10760, plot gold reward against
the KL from the initial policy in the same way):

    F(B) = max { gold(p) : p a point of the choice with KL(p) <= B }

over two sets of points, each a mean over seeds of WINDOW-step running means:

- **final**: one point per beta, the run's end (the last WINDOW steps): what a fixed training
  budget gives;
- **checkpoints**: every step of every beta's seed-averaged curve: what stopping at the best
  checkpoint would give, if the gold reward could be watched.

On the real model's chat task the held-out gold reward (greedy, at each evaluation) has its own
frontier, at the end and over the **evaluations**: each evaluation step of each beta (the start
apart), its held-out gold and the sequence KL of that step's samples, means over seeds.

A point with a non-finite KL or gold reward (a diverged run) is never within a budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klpo.train.runtime.plots import save_figure, styles

__all__ = [
    "BUDGETS",
    "CHAT_BUDGETS",
    "ChoiceFrontier",
    "Curve",
    "Evaluation",
    "best_within",
    "frontier_figure",
    "frontier_plots",
    "frontier_table",
    "heldout_frontier_table",
    "pareto",
]

BUDGETS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, math.inf)
"""Sequence-KL budgets (nats per completion) of the frontier table; ``inf``: no budget."""

CHAT_BUDGETS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
"""The budgets on the real model's chat task, whose completions are longer (10–20 tokens, at
0.1–0.4 nats per token after 24 steps without a KL: docs/study-real/pilot.md)."""


def _ok(*xs: float) -> bool:
    return all(math.isfinite(x) for x in xs)


def best_within(points: Iterable[tuple[float, float]], budget: float) -> tuple[float, float]:
    """``(gold, kl)`` of the point with the largest gold among those with ``kl <= budget``.

    ``points`` are ``(kl, gold)`` pairs; ties in gold keep the smaller KL. Returns ``(nan, nan)``
    when no finite point is within the budget.
    """
    best = (math.nan, math.nan)
    for kl, gold in points:
        if not _ok(kl, gold) or kl > budget:
            continue
        if not math.isfinite(best[0]) or gold > best[0] or (gold == best[0] and kl < best[1]):
            best = (gold, kl)
    return best


def pareto(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The frontier as a staircase: the finite ``(kl, gold)`` points, by increasing KL, whose
    gold reward is larger than that of every point with a smaller or equal KL."""
    out: list[tuple[float, float]] = []
    for kl, gold in sorted(p for p in points if _ok(*p)):
        if not out or gold > out[-1][1]:
            if out and out[-1][0] == kl:
                out[-1] = (kl, gold)
            else:
                out.append((kl, gold))
    return out


@dataclass
class Curve:
    """One beta of a choice: seed means of the WINDOW-step running means at shared steps."""

    beta: float
    steps: list[int]
    gold: list[float]
    proxy: list[float]
    kl_seq: list[float]


@dataclass
class Evaluation:
    """One beta's held-out evaluation after the start: the step, its held-out gold reward and
    the sequence KL over the WINDOW steps up to it (as a run's final KL is over its last
    WINDOW steps), means over the seeds."""

    beta: float
    step: int
    gold: float
    kl_seq: float


@dataclass
class ChoiceFrontier:
    """A KL choice across its betas: per-beta cells (``summarise_cells`` rows), curves and
    held-out evaluations."""

    algo: str
    choice: str
    cells: list[dict[str, Any]]
    curves: list[Curve] = field(default_factory=list)
    evaluations: list[Evaluation] = field(default_factory=list)

    def final_points(self) -> list[tuple[float, float]]:
        return [(c["kl_seq_final"], c["gold_final"]) for c in self.cells]

    def checkpoint_points(self, skip: int = 0) -> list[tuple[float, float]]:
        """Every step's ``(kl, gold)`` of every beta's curve, after the first ``skip`` steps."""
        return [
            (k, g)
            for cv in self.curves
            for s, k, g in zip(cv.steps, cv.kl_seq, cv.gold, strict=True)
            if s > skip
        ]

    def cell_at(self, gold: float, kl: float) -> dict[str, Any] | None:
        """The cell whose final point is ``(kl, gold)``."""
        for c in self.cells:
            if c["gold_final"] == gold and c["kl_seq_final"] == kl:
                return c
        return None


def _f(x: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def _b(x: float) -> str:
    return "any" if math.isinf(x) else f"≤ {x:g}"


def frontier_table(
    frontiers: Sequence[ChoiceFrontier], window: int, budgets: Sequence[float] = BUDGETS
) -> list[str]:
    """The report's frontier section: best gold reward within each sequence-KL budget, at the end
    of training (with the beta that reaches it) and at the best checkpoint."""
    head = " | ".join(f"seq KL {_b(b)}" for b in budgets)
    lines = [
        "",
        "## Frontier: gold reward within a KL budget",
        "",
        "Per KL choice, over its beta sweep: the best gold reward reached within each budget of "
        "exact sequence KL(pi_theta ‖ pi_ref) (nats per completion), at the **end** of training "
        f"(the last {window} steps, mean over seeds, one point per beta; the beta that reaches "
        "it in brackets). Then the peak of the gold reward's "
        f"{window}-step running mean (mean over seeds of each run's peak, best beta) and the "
        "sequence KL there; at the beta with the best final gold reward, the proxy − gold gap "
        "and the sd of the final gold reward over seeds; failed runs over all betas "
        "(docs/overopt.md).",
        "",
        f"| algo | KL choice | {head} | peak gold (beta, seq KL) | proxy − gold | gold sd "
        "| failed |",
        "| --- | --- | " + " | ".join("---" for _ in budgets) + " | --- | --- | --- | --- |",
    ]
    order = sorted(frontiers, key=lambda f: (f.algo, -_low(best_within(f.final_points(), 1.0)[0])))
    for f in order:
        cols = []
        for b in budgets:
            gold, kl = best_within(f.final_points(), b)
            cell = f.cell_at(gold, kl)
            cols.append("–" if cell is None else f"{_f(gold)} ({cell['beta']:g})")
        gold_all, kl_all = best_within(f.final_points(), math.inf)
        best = f.cell_at(gold_all, kl_all)
        peaks = [c for c in f.cells if math.isfinite(c["gold_peak"])]
        peak = max(peaks, key=lambda c: c["gold_peak"]) if peaks else None
        peak_s = (
            "–"
            if peak is None
            else f"{_f(peak['gold_peak'])} ({peak['beta']:g}, {_f(peak['gold_peak_kl_seq'], 2)})"
        )
        gap = _f(best["proxy_final"] - best["gold_final"]) if best else "–"
        sd = _f(best["gold_sd"]) if best else "–"
        failed = sum(c["failed"] for c in f.cells)
        runs = sum(c["runs"] for c in f.cells)
        lines.append(
            f"| {f.algo} | {f.choice} | {' | '.join(cols)} | {peak_s} | {gap} | {sd} | "
            f"{failed}/{runs} |"
        )
    lines += _budget_table_head(
        "The same frontier over **checkpoints**: the best gold reward at any step (after the "
        f"first {window}) of any beta's seed-averaged {window}-step running means, within each "
        "budget: what stopping at the best step would give if the gold reward could be watched.",
        budgets,
    )
    for f in order:
        pts = f.checkpoint_points(skip=window)
        cols = [_f(best_within(pts, b)[0]) for b in budgets]
        lines.append(f"| {f.algo} | {f.choice} | {' | '.join(cols)} |")
    return lines


def _budget_table_head(text: str, budgets: Sequence[float]) -> list[str]:
    """A paragraph, then the head of a table of one column per KL budget."""
    head = " | ".join(f"seq KL {_b(b)}" for b in budgets)
    return [
        "",
        text,
        "",
        f"| algo | KL choice | {head} |",
        "| --- | --- | " + " | ".join("---" for _ in budgets) + " |",
    ]


def heldout_frontier_table(
    frontiers: Sequence[ChoiceFrontier], window: int, budgets: Sequence[float] = BUDGETS
) -> list[str]:
    """The frontier on held-out problems: per KL choice, the best held-out gold reward at the
    end of training (greedy, the cells' ``acc_mean``: held-out accuracy is scored with the gold
    reward) within each budget of the final exact sequence KL, the beta that reaches it in
    brackets; and the held-out gold reward at the start."""
    head = " | ".join(f"seq KL {_b(b)}" for b in budgets)
    lines = [
        "",
        "## Frontier on held-out problems",
        "",
        "The same frontier with the gold reward of the held-out problems at the end (greedy "
        "completions, mean over seeds; held-out accuracy is scored with the gold reward) "
        "against the final exact sequence KL, one point per beta; the held-out gold reward at "
        "the start for comparison.",
        "",
        f"| algo | KL choice | start | {head} |",
        "| --- | --- | --- | " + " | ".join("---" for _ in budgets) + " |",
    ]

    def points(f: ChoiceFrontier) -> list[tuple[float, float]]:
        return [(c["kl_seq_final"], c["acc_mean"]) for c in f.cells]

    order = sorted(frontiers, key=lambda f: (f.algo, -_low(best_within(points(f), math.inf)[0])))
    for f in order:
        cols = []
        for b in budgets:
            gold, kl = best_within(points(f), b)
            cell = next(
                (c for c in f.cells if c["acc_mean"] == gold and c["kl_seq_final"] == kl), None
            )
            cols.append("–" if cell is None else f"{_f(gold)} ({cell['beta']:g})")
        starts = [c["acc_start"] for c in f.cells if math.isfinite(c["acc_start"])]
        start = _f(sum(starts) / len(starts)) if starts else "–"
        lines.append(f"| {f.algo} | {f.choice} | {start} | {' | '.join(cols)} |")
    if not any(f.evaluations for f in frontiers):
        return lines
    lines += _budget_table_head(
        "The same over every held-out **evaluation** after the start: each evaluation's "
        "held-out gold reward (mean over seeds) against the exact sequence KL over the "
        f"{window} steps up to it, one point per beta and evaluation, the beta and step that "
        "reach it in brackets: what stopping at the best evaluation would give.",
        budgets,
    )
    for f in order:
        pts = {(e.kl_seq, e.gold): e for e in f.evaluations}
        cols = []
        for b in budgets:
            gold, kl = best_within(pts, b)
            e = pts.get((kl, gold))
            cols.append("–" if e is None else f"{_f(gold)} ({e.beta:g}, step {e.step})")
        lines.append(f"| {f.algo} | {f.choice} | {' | '.join(cols)} |")
    steps = sorted({e.step for f in frontiers for e in f.evaluations})
    lines += [
        "",
        "Each cell's held-out gold reward at every evaluation after the start, with the exact "
        f"sequence KL over the {window} steps up to it in brackets (means over seeds):",
        "",
        "| algo | KL choice | beta | " + " | ".join(f"step {s}" for s in steps) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in steps) + " |",
    ]
    for f in order:
        for beta in sorted({e.beta for e in f.evaluations}):
            at = {e.step: e for e in f.evaluations if e.beta == beta}
            cols = [f"{_f(at[s].gold)} ({_f(at[s].kl_seq, 2)})" if s in at else "–" for s in steps]
            lines.append(f"| {f.algo} | {f.choice} | {beta:g} | {' | '.join(cols)} |")
    return lines


def _low(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def frontier_figure(frontiers: Sequence[ChoiceFrontier], window: int):
    """Every choice's final points (left) and its checkpoint staircase (right) on shared axes,
    each choice in its own colour and marker, the legend outside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, (ax_end, ax_ck) = plt.subplots(1, 2, figsize=(15, 6.5), sharey=True)
    handles = []
    for f, style in zip(frontiers, styles(len(frontiers)), strict=True):
        color, marker = style["color"], style["marker"]
        label = f.choice if f.algo == "grpo" else f"{f.algo}: {f.choice}"
        pts = sorted(
            (c["kl_seq_final"], c["gold_final"], c["gold_sd"])
            for c in f.cells
            if _ok(c["kl_seq_final"], c["gold_final"])
        )
        if pts:
            xs, ys, sds = zip(*pts, strict=True)
            ax_end.errorbar(
                xs,
                ys,
                yerr=[s if math.isfinite(s) else 0.0 for s in sds],
                fmt=f"-{marker}",
                color=color,
                ms=4,
                lw=1,
                capsize=2,
            )
        stair = pareto(f.checkpoint_points(skip=window))
        if stair:
            xs, ys = zip(*stair, strict=True)
            ax_ck.plot(
                xs,
                ys,
                drawstyle="steps-post",
                color=color,
                lw=1.2,
                marker=marker,
                ms=4,
                markevery=max(1, len(xs) // 5),
            )
        if pts or stair:
            handles.append(Line2D([], [], color=color, marker=marker, ms=4, lw=1, label=label))
    for ax, title in (
        (ax_end, "end of training: one point per beta (mean ± sd over seeds)"),
        (ax_ck, "best checkpoint within the KL (staircase over all betas and steps)"),
    ):
        # log KL where there is a positive one (a run of a step or two may have none yet)
        if any(x > 0 for line in ax.lines for x in line.get_xdata()):
            ax.set_xscale("log")
        ax.set_xlabel("exact sequence KL(pi_theta ‖ pi_ref), nats per completion")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    ax_end.set_ylabel(f"gold reward ({window}-step running mean)")
    fig.legend(
        handles=handles,
        frameon=False,
        fontsize=7,
        loc="center left",
        bbox_to_anchor=(1.0, 0.5),
        title="KL choice",
    )
    fig.tight_layout()
    return fig


def frontier_plots(frontiers: Sequence[ChoiceFrontier], out: Path, window: int) -> list[str]:
    """``frontier.png`` (:func:`frontier_figure`) and ``gold_proxy.png`` (gold and proxy curves
    per choice, one colour per beta); returns the names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig = frontier_figure(frontiers, window)
    if any(ax.lines for ax in fig.axes):
        save_figure(fig, out / "frontier.png")
        names.append("frontier.png")
    plt.close(fig)

    with_curves = [f for f in frontiers if f.curves]
    if with_curves:
        cols = 4
        rows = math.ceil(len(with_curves) / cols)
        fig, axes = plt.subplots(
            rows, cols, figsize=(4.2 * cols, 3.0 * rows), sharex=True, sharey=True, squeeze=False
        )
        betas = sorted({cv.beta for f in with_curves for cv in f.curves})
        colors = {
            b: plt.get_cmap("viridis")(i / max(1, len(betas) - 1)) for i, b in enumerate(betas)
        }
        for ax, f in zip(axes.flat, with_curves, strict=False):
            for cv in sorted(f.curves, key=lambda c: c.beta):
                ax.plot(cv.steps, cv.gold, color=colors[cv.beta], lw=1.2, label=f"β {cv.beta:g}")
                ax.plot(cv.steps, cv.proxy, color=colors[cv.beta], lw=1.0, ls="--")
            ax.set_title(f.choice if f.algo == "grpo" else f"{f.algo}: {f.choice}", fontsize=8)
            ax.grid(alpha=0.3)
            ax.legend(frameon=False, fontsize=6)
        for ax in axes.flat[len(with_curves) :]:
            ax.set_visible(False)
        fig.supxlabel("step")
        fig.supylabel(f"gold (solid) and proxy (dashed) reward, {window}-step running means")
        save_figure(fig, out / "gold_proxy.png")
        plt.close(fig)
        names.append("gold_proxy.png")
    return names
