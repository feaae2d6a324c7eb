"""Markdown formatting shared by the sections of ``klpo lab report`` (numbers, tables)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["closest", "gradient_table", "num", "sig", "table"]


def closest(xs: list[float], x: float) -> int:
    """Index of the entry of ``xs`` closest to ``x``."""
    return int(np.argmin([abs(v - x) for v in xs]))


def num(x: float | None, digits: int = 3, *, zero: str = "zero") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return zero
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 10 ** (-digits):
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def sig(x: float | None, sig: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{sig}g}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def gradient_table(rows: list[dict]) -> str:
    body = []
    for row in rows:
        body.append(
            [
                f"`{row['estimator']}`",
                row["placement"],
                num(row["cos_theta_ref"]),
                num(row["rel_err_theta_ref"]),
                num(row["cos_ref_theta"]),
                num(row["rel_err_ref_theta"]),
                row["follows"],
            ]
        )
    return table(
        [
            "estimator",
            "placement",
            "cos to ∇KL(θ‖ref)",
            "rel. err.",
            "cos to ∇KL(ref‖θ)",
            "rel. err.",
            "expected gradient is",
        ],
        body,
    )
