r"""Which KL choice lands on the gold-reward-vs-KL Pareto front, run for run.

Amini, Vieira & Cotterell (arXiv:2504.10637) train with a Monte Carlo and a Rao-Blackwellised KL
gradient across KL coefficients and count how often each estimator's models sit on the Pareto
front of reward against KL. In klpo's studies the same question, asked of two KL choices of one
``klpo compare`` ``results.csv``: pair their runs that share an algorithm, beta and seed, and count
the pairs where each is **not dominated** by the other. A point ``(kl, gold)`` dominates another
when its KL is no larger and its gold reward no smaller, one of them strictly; both members of a
pair are on its front when they trade one for the other.

``python -m klpo.study.pareto RESULTS.csv --algo grpo "full reward+loss" "k1 reward"`` prints the
counts (docs/literature.md quotes them).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["HeadToHead", "dominates", "head_to_head", "main"]

Point = tuple[float, float]  # (kl, gold)


def dominates(a: Point, b: Point) -> bool:
    """Whether ``a = (kl, gold)`` dominates ``b``: no more KL, no less gold, one strictly."""
    return a[0] <= b[0] and a[1] >= b[1] and (a[0] < b[0] or a[1] > b[1])


class HeadToHead(NamedTuple):
    """The pairs of runs compared, and in how many each choice is on the pair's front."""

    pairs: int
    first: int
    second: int


def head_to_head(
    rows: Sequence[dict[str, Any]],
    first: str,
    second: str,
    *,
    algo: str = "grpo",
    kl: str = "kl_seq_final",
    reward: str = "gold_final",
) -> HeadToHead:
    """Pair the runs of choices ``first`` and ``second`` (``results.csv`` rows of ``algo``) by
    ``(beta, seed)`` and count the pairs where each is not dominated by the other in
    ``(kl, reward)``. Pairs with a non-finite value (a crashed run) are skipped."""
    runs: dict[tuple[str, str, str], Point] = {}
    for r in rows:
        if r["algo"] == algo and r["choice"] in (first, second):
            runs[r["choice"], str(float(r["beta"])), str(r["seed"])] = (
                float(r[kl] or "nan"),
                float(r[reward] or "nan"),
            )
    pairs = a_on = b_on = 0
    for (choice, beta, seed), a in sorted(runs.items()):
        b = runs.get((second, beta, seed))
        if choice != first or b is None or not all(map(math.isfinite, (*a, *b))):
            continue
        pairs += 1
        a_on += not dominates(b, a)
        b_on += not dominates(a, b)
    if pairs == 0:
        raise ValueError(
            f"no (beta, seed) holds runs of both {first!r} and {second!r} with algo {algo!r}"
        )
    return HeadToHead(pairs, a_on, b_on)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m klpo.study.pareto``: the head-to-head count of two choices (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m klpo.study.pareto",
        description="Count how often each of two KL choices is on the (KL, reward) Pareto front "
        "of its run paired by beta and seed with the other's.",
    )
    p.add_argument("results", type=Path, help="A klpo compare results.csv.")
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--algo", default="grpo")
    p.add_argument("--kl", default="kl_seq_final", help="KL column (smaller is better).")
    p.add_argument("--reward", default="gold_final", help="Reward column (larger is better).")
    a = p.parse_args(argv)
    with a.results.open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    n, x, y = head_to_head(rows, a.first, a.second, algo=a.algo, kl=a.kl, reward=a.reward)
    print(f"{a.algo}, {n} pairs (beta, seed), on the front: {a.first} {x}/{n}, {a.second} {y}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
