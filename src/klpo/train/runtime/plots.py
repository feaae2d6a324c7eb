"""What every klpo plot shares: smoothed curves over faint raw ones, a distinct colour and marker
per series, no plot of a constant, atomic PNGs.

Per-step metrics are noisy, so a curve of ``n >= SMOOTH_FROM`` points is drawn as its trailing
running mean (:func:`running_mean`, window :func:`smoothing_window`) over the raw values drawn
faintly in the same colour; the legend says the window. A series that never changes (a fixed
beta) is not drawn at all: the report says its value instead (:func:`constant_value`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from klpo import _io

__all__ = [
    "SMOOTH_FROM",
    "constant_value",
    "plot_series",
    "robust_limits",
    "running_mean",
    "save_figure",
    "smoothing_window",
    "styles",
]

SMOOTH_FROM = 20
"""Series of at least this many points are drawn smoothed over their faint raw values."""

_COLOURS = 10  # matplotlib's tab10
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")  # 7 markers: coprime with 10 colours


def running_mean(ys: Sequence[float], window: int) -> list[float]:
    """The trailing running mean: ``out[i] = mean(ys[max(0, i - window + 1) : i + 1])`` (fewer
    values at the start). Non-finite values are skipped (NaN where a window has none)."""
    out = []
    for i in range(len(ys)):
        vals = [y for y in ys[max(0, i - window + 1) : i + 1] if math.isfinite(y)]
        out.append(math.fsum(vals) / len(vals) if vals else math.nan)
    return out


def smoothing_window(n: int) -> int:
    """The running mean's window for a series of ``n`` points: 1 (none) below
    :data:`SMOOTH_FROM`, else ``n // 20`` within [5, 50]."""
    return 1 if n < SMOOTH_FROM else min(50, max(5, n // 20))


def constant_value(ys: Sequence[float]) -> float | None:
    """The value of a series that never changes (one point, or every point equal to the first
    up to 1e-12 relative), else None."""
    if not ys:
        return None
    first = ys[0]
    tol = 1e-12 * max(1.0, abs(first))
    return first if all(abs(y - first) <= tol for y in ys) else None


def styles(n: int) -> list[dict[str, Any]]:
    """``n`` distinct ``{color, marker}`` pairs for series on one plot: tab10's colours with 7
    markers, both cycling, so no two of the first 70 series look alike and neighbours differ in
    both."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [{"color": cmap(i % _COLOURS), "marker": _MARKERS[i % len(_MARKERS)]} for i in range(n)]


def plot_series(
    ax: Any,
    xs: Sequence[float],
    ys: Sequence[float],
    label: str,
    *,
    color: Any = None,
    marker: str | None = None,
    zorder: float = 2.0,
) -> None:
    """One series on ``ax``: below :data:`SMOOTH_FROM` points as points joined by a line; from
    there the running mean (its window in the legend) over the raw values drawn faintly.
    ``zorder`` stacks it (higher: on top)."""
    window = smoothing_window(len(xs))
    if window == 1:
        ax.plot(xs, ys, marker=marker or "o", ms=3, lw=1.5, color=color, label=label, zorder=zorder)
        return
    (raw,) = ax.plot(xs, ys, lw=0.8, alpha=0.25, color=color, zorder=zorder - 0.5)
    smooth = running_mean(ys, window)
    every = max(1, len(xs) // 12)
    ax.plot(
        xs,
        smooth,
        lw=1.8,
        color=raw.get_color(),
        marker=marker,
        markevery=every,
        ms=4,
        label=f"{label} ({window}-step running mean)",
        zorder=zorder,
    )


def _quantile(sorted_ys: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted values, linearly interpolated (numpy's default rule)."""
    pos = q * (len(sorted_ys) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_ys) - 1)
    return sorted_ys[lo] + (sorted_ys[hi] - sorted_ys[lo]) * (pos - lo)


def robust_limits(
    series: Sequence[Sequence[float]], *, q: float = 0.98, margin: float = 0.08
) -> tuple[float, float] | None:
    """The y range that shows every series' trend when a few raw values spike far out (a k3
    estimate after 1,500 steps: spikes at 6, the trend in 0-0.4): from the smallest to the
    largest of the running means over complete windows (as :func:`plot_series` draws them) and
    the ``1 - q`` and ``q`` quantiles of the raw values, with ``margin`` of the span on each side. None when no raw
    value falls outside it (the automatic range already fits)."""
    raw = sorted(y for ys in series for y in ys if math.isfinite(y))
    if len(raw) < SMOOTH_FROM:
        return None
    smooth = []  # over complete windows only: the first few means of a spike are the spike
    for ys in series:
        w = smoothing_window(len(ys))
        smooth += [y for y in running_mean(list(ys), w)[w - 1 :] if math.isfinite(y)]
    lo = min([_quantile(raw, 1 - q), *smooth])
    hi = max([_quantile(raw, q), *smooth])
    pad = margin * ((hi - lo) or abs(hi) or 1.0)
    lo, hi = lo - pad, hi + pad
    if raw[0] >= lo and raw[-1] <= hi:
        return None
    return lo, hi


def save_figure(fig: Any, path: Path) -> None:
    """Save a matplotlib figure as PNG, atomically and durably (:func:`klpo._io.save_figure`)."""
    _io.save_figure(fig, path, dpi=110, bbox_inches="tight")
