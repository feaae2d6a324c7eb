"""The interview text's training claim, judged on a ``klpo compare`` study's ``results.csv``.

The claim: "K2" (``ref_is``) had 30% lower variance than "K1" (``k1``) on a 7B model, and "K3"
(``adaptive_mix``) converged 15% faster than "K2". The lab's own numbers cannot test it; a study
that trains with both estimators can, at its own scale. From its rows (one per run):

- **variance**: per ``ref_is`` run, the variance across steps of its logged estimate minus the
  exact KL of the same step (``kl_noise_var``) against the same for k1 on the policy's own tokens
  in the *same* runs (``kl_k1_noise_var``), so both see the same policies; the ratio of the means
  over seeds. The first half holds if the ratio is at most 0.7.
- **convergence**: the mean over seeds of the step at which the train accuracy's running mean
  reaches the study's target (``steps_to_target``; a run that never reaches it counts as the
  study's length, so it cannot look fast), for each ``adaptive_mix`` sign against plain
  ``ref_is``. The second half holds if some sign needs at most 0.85 times the steps.

Only GRPO rows at the same beta are compared; plain ``ref_is`` is the row whose choice is
``"ref_is loss"``. The lab imports nothing of the trainer: it reads the CSV.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

__all__ = ["judge_training_claim", "read_results", "study_scale"]


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a study's ``results.csv`` (values as strings)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"{str(p)!r} is not a file; pass the results.csv that `klpo compare` wrote"
        )
    with p.open() as f:
        return list(csv.DictReader(f))


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def judge_training_claim(rows: list[dict[str, Any]], *, scale: str = "") -> dict[str, str] | None:
    """``{"verdict", "evidence"}`` from a study's rows, or None if it lacks the needed runs.

    Args:
        rows: ``results.csv`` rows; needs GRPO runs of ``ref_is loss`` and at least one
            ``adaptive_mix`` choice, with the columns ``kl_noise_var``, ``kl_k1_noise_var``,
            ``steps_to_target`` and ``steps_done``.
        scale: words for the study's scale, put into the evidence (model, steps, seeds).
    """
    ok = [r for r in rows if r.get("algo") == "grpo" and r.get("status") == "ok"]
    by_beta: dict[float, dict[str, list[dict[str, Any]]]] = {}
    for r in ok:
        by_beta.setdefault(_num(r["beta"]), {}).setdefault(r["choice"], []).append(r)
    parts = []
    var_holds, speed_holds = [], []
    for beta, cells in sorted(by_beta.items()):
        ris = cells.get("ref_is loss")
        mixes = {c: rs for c, rs in cells.items() if c.startswith("adaptive_mix")}
        if not ris or not mixes:
            continue
        v_ris = _mean([_num(r["kl_noise_var"]) for r in ris])
        v_k1 = _mean([_num(r["kl_k1_noise_var"]) for r in ris])
        ratio = v_ris / v_k1 if v_k1 > 0 else math.nan
        var_holds.append(ratio <= 0.7)

        def steps(rs: list[dict[str, Any]]) -> float:
            return _mean(
                [
                    s if math.isfinite(s := _num(r["steps_to_target"])) else _num(r["steps_done"])
                    for r in rs
                ]
            )

        s_ris = steps(ris)
        speeds = {c: steps(rs) / s_ris if s_ris > 0 else math.nan for c, rs in mixes.items()}
        speed_holds.append(any(x <= 0.85 for x in speeds.values()))
        speed_text = ", ".join(f"{c}: {x:.2f}×" for c, x in sorted(speeds.items()))
        parts.append(
            f"beta {beta:g}: Var(ref_is − exact) / Var(k1 − exact) = {v_ris:.3g} / {v_k1:.3g} = "
            f"{ratio:.2f} in the same runs (the claim: ≤ 0.7); steps to the target accuracy "
            f"relative to ref_is ({s_ris:.0f}): {speed_text} (the claim: ≤ 0.85)"
        )
    if not parts:
        return None
    both = [all(var_holds), all(speed_holds)]
    verdict = "holds" if all(both) else ("partly" if any(both) else "does not hold")
    where = f" At this scale ({scale}), not a 7B model." if scale else " At this study's scale."
    return {"verdict": verdict, "evidence": "; ".join(parts) + "." + where}


def study_scale(rows: list[dict[str, Any]]) -> str:
    """Words for a study's scale from its rows: runs, steps, seeds."""
    steps = max(
        (int(_num(r.get("steps_done"))) for r in rows if _num(r.get("steps_done")) > 0), default=0
    )
    seeds = len({r.get("seed") for r in rows})
    return (
        f"{len(rows)} GRPO runs of the built-in task's model (about 1M parameters) for {steps} "
        f"steps, {seeds} seeds per choice"
    )
