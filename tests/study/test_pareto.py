"""The head-to-head Pareto count (klpo.study.pareto) on hand-made runs."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from klpo.study import pareto


def test_dominates_by_hand() -> None:
    assert pareto.dominates((0.5, 0.3), (0.6, 0.3))  # less KL, same gold
    assert pareto.dominates((0.6, 0.35), (0.6, 0.3))  # same KL, more gold
    assert not pareto.dominates((0.6, 0.3), (0.6, 0.3))  # equal: neither
    assert not pareto.dominates((0.5, 0.2), (0.6, 0.3))  # a trade-off: neither
    assert not pareto.dominates((0.6, 0.3), (0.5, 0.2))


def _row(choice: str, beta: float, seed: int, kl: float, gold: float, algo: str = "grpo") -> dict:
    return {
        "algo": algo,
        "choice": choice,
        "beta": str(beta),
        "seed": str(seed),
        "kl_seq_final": str(kl),
        "gold_final": str(gold),
    }


ROWS = [
    # beta 0.1, seed=0: A dominates B (less KL, more gold) -> A on, B off.
    _row("A", 0.1, 0, 0.6, 0.35),
    _row("B", 0.1, 0, 0.7, 0.33),
    # beta 0.1 seed 1: a trade-off -> both on.
    _row("A", 0.1, 1, 0.9, 0.36),
    _row("B", 0.1, 1, 0.5, 0.30),
    # beta 0.01, seed=0: B dominates -> B on, A off.
    _row("A", 0.01, 0, 30.0, 0.0),
    _row("B", 0.01, 0, 20.0, 0.01),
    # unpaired, crashed and other-algorithm runs do not count.
    _row("A", 0.3, 0, 0.3, 0.3),
    _row("A", 0.01, 1, float("nan"), 0.0),
    _row("B", 0.01, 1, 1.0, 0.2),
    _row("A", 0.1, 0, 0.1, 0.9, algo="ppo"),
]


def test_head_to_head_counts() -> None:
    assert pareto.head_to_head(ROWS, "A", "B") == (3, 2, 2)
    assert pareto.head_to_head(ROWS, "B", "A") == (3, 2, 2)
    with pytest.raises(ValueError, match="no \\(beta, seed\\) holds runs of both"):
        pareto.head_to_head(ROWS, "A", "C")


def test_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    assert pareto.main([str(path), "A", "B"]) == 0
    assert "grpo, 3 pairs (beta, seed), on the front: A 2/3, B 2/3" in capsys.readouterr().out
