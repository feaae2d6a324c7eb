"""Summaries: one ``results.csv`` row per run from its ``metrics.jsonl``, one row per cell.

"Final" values are means over the last :data:`WINDOW` steps and peaks are the largest
WINDOW-step running means; a run is ``ok``, ``crashed``, ``diverged`` or ``collapsed``
(:func:`summarise_run`); a cell, one (algorithm, choice, beta), is the mean ± sd over its seeds
(:func:`summarise_cells`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from klpo.study.grid import Run
from klpo.train.runtime.metrics import CONTROLLED_KL, read_metrics
from klpo.train.runtime.samples import read_samples

__all__ = [
    "BUDGET_TOLERANCE",
    "COLLAPSE_Z",
    "MIN_REFERENCE_STEPS",
    "OUTLIER_MADS",
    "RESULT_FIELDS",
    "SPIKE_COLUMNS",
    "WINDOW",
    "Criteria",
    "collapse_threshold",
    "gold_summary",
    "heldout_scores",
    "kl_budget_summary",
    "mcnemar_exact",
    "metric_columns",
    "nan_low",
    "num",
    "outliers",
    "paired_change",
    "spike_summary",
    "steps_to_reach",
    "summarise_cells",
    "summarise_run",
]


RESULT_FIELDS = [
    "name",
    "algo",
    "choice",
    "estimator",
    "placement",
    "beta",
    "seed",
    "status",
    "steps_done",
    "acc_start",
    "acc_final",
    "acc_best",
    "kl_exact_final",
    "kl_exact_peak",
    "kl_logged_final",
    "kl_gap_mean",
    "kl_est_var",
    "kl_noise_var",
    "kl_k1_noise_var",
    "steps_to_target",
    "ref_time_s",
    "kl_target",
    "kl_unit",
    "kl_budget_ratio",
    "kl_budget_frac",
    "kl_budget_held",
    "reward_final",
    "gold_final",
    "gold_peak",
    "gold_peak_kl_seq",
    "proxy_final",
    "kl_seq_final",
    "entropy_final",
    "length_final",
    "grad_norm_peak",
    "grad_norm_outliers",
    "loss_outliers",
    "kl_teacher_final",
    "heldout_steps_to_target",
    "cpu_s_to_target",
    "cpu_s",
    "wall_s",
    "error",
]


def num(v: Any) -> float:
    """A metric value as float; the strings 'nan'/'inf' written for non-finite values too."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


WINDOW = 10  # steps: "final" values are means over the last WINDOW steps, peaks running means


def _tail_mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [num(r[key]) for r in rows if key in r]
    if not vals:
        return math.nan
    tail = vals[-WINDOW:]
    return sum(tail) / len(tail)


@dataclass(frozen=True)
class Criteria:
    """What a study judges each of its runs by (:func:`summarise_run`): the steps a finished
    run has done, the collapse rule, and the convergence target.

    Args:
        steps: the study's steps per run (a run that did fewer crashed).
        collapse_drop: the least fall of held-out accuracy that is a collapse
            (:func:`collapse_threshold`).
        eval_size: the held-out problems, whose standard error can widen the collapse rule.
        target_accuracy: the threshold of ``target_metric``'s running mean ("steps to target").
        target_metric: ``accuracy/train``, or ``reward/gold`` on the over-optimisation task.
    """

    steps: int
    collapse_drop: float
    eval_size: int | None = None
    target_accuracy: float = 0.4
    target_metric: str = "accuracy/train"


def summarise_run(
    run: Run,
    run_dir: Path,
    criteria: Criteria,
    *,
    returncode: int,
    wall_s: float,
    error: str = "",
) -> dict[str, Any]:
    """One ``results.csv`` row from a finished (or failed) run's ``metrics.jsonl``.

    ``steps_to_target`` is the first step at which the WINDOW-step running mean of
    ``criteria.target_metric`` reaches ``criteria.target_accuracy`` (NaN if never); the
    ``kl_budget_*`` columns judge the run's exact KL against ``run.kl_target``
    (:func:`kl_budget_summary`). A finished run is ``collapsed`` when its held-out accuracy fell
    below its start by more than :func:`collapse_threshold` (``criteria.collapse_drop``, and two
    standard errors on ``criteria.eval_size`` problems); its error cell says by how much."""
    steps = criteria.steps
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "kl/ref/exact" in r]
    evals = [(r["step"], num(r["accuracy/heldout"])) for r in rows if "accuracy/heldout" in r]
    kl_exact = [num(r["kl/ref/exact"]) for r in steps_rows]
    acc_start = evals[0][1] if evals and evals[0][0] == 0 else math.nan
    acc_final = evals[-1][1] if evals else math.nan
    done = steps_rows[-1]["step"] if steps_rows else 0
    if returncode == 3:
        status = "diverged"
    elif returncode != 0 or done < steps:
        status = "crashed"
    elif not all(map(math.isfinite, kl_exact)) or not math.isfinite(acc_final):
        status = "diverged"
    elif fell := _collapse(acc_start, acc_final, criteria.eval_size, criteria.collapse_drop):
        status, error = "collapsed", error or fell
    else:
        status = "ok"
    reached = steps_to_reach(steps_rows, criteria.target_metric, criteria.target_accuracy)
    ref_time = math.fsum(
        num(r.get("time/ref_sample", 0.0)) + num(r.get("time/ref_update", 0.0)) for r in steps_rows
    )
    return {
        "name": run.name,
        "algo": run.algo,
        "choice": run.choice,
        "estimator": run.estimator,
        "placement": run.placement,
        "beta": run.beta,
        "seed": run.seed,
        "status": status,
        "steps_done": done,
        "acc_start": acc_start,
        "acc_final": acc_final,
        "acc_best": max((a for _, a in evals), default=math.nan),
        **_kl_columns(steps_rows, f"kl/ref/{run.estimator}"),
        "steps_to_target": reached,
        "ref_time_s": round(ref_time, 2),
        "kl_unit": run.kl_unit,
        **kl_budget_summary(steps_rows, run.kl_target, steps, key=CONTROLLED_KL[run.kl_unit]),
        "reward_final": _tail_mean(steps_rows, "reward/mean"),
        **gold_summary(steps_rows),
        "entropy_final": _tail_mean(steps_rows, "entropy"),
        "length_final": _tail_mean(steps_rows, "completion/length"),
        **spike_summary(rows, steps),
        **distillation_summary(steps_rows, evals, criteria.target_accuracy),
        "wall_s": round(wall_s, 1),
        "error": error,
    }


def distillation_summary(
    steps_rows: list[dict[str, Any]], evals: list[tuple[int, float]], target: float
) -> dict[str, float]:
    """``kl_teacher_final``: the exact KL(pi_theta ‖ pi_T) per token over the last WINDOW steps
    (NaN without a teacher); ``heldout_steps_to_target``: the first held-out evaluation's step
    at which the accuracy reaches ``target`` (NaN if none did), and ``cpu_s_to_target`` the
    trainer process's CPU seconds then; ``cpu_s``: its CPU seconds at its last step
    (``time/cpu``; NaN in runs that predate it)."""
    reached = next((step for step, acc in evals if step > 0 and acc >= target), math.nan)
    cpu = {r["step"]: num(r["time/cpu"]) for r in steps_rows if "time/cpu" in r}
    last = cpu[max(cpu)] if cpu else math.nan
    return {
        "kl_teacher_final": _tail_mean(steps_rows, "kl/teacher/exact"),
        "heldout_steps_to_target": reached,
        "cpu_s_to_target": round(cpu.get(reached, math.nan), 1),
        "cpu_s": round(last, 1),
    }


def _collapse(
    acc_start: float, acc_final: float, eval_size: int | None, collapse_drop: float
) -> str:
    """Why a run collapsed, its error cell: held-out accuracy fell from ``acc_start`` to
    ``acc_final`` by more than :func:`collapse_threshold`; "" when it did not."""
    limit = collapse_threshold(acc_start, acc_final, eval_size, collapse_drop)
    if not acc_final < acc_start - limit:
        return ""
    why = (
        f"the larger of collapse_drop {collapse_drop:g} and {COLLAPSE_Z:g} standard errors on "
        f"{eval_size} problems"
        if eval_size
        else f"collapse_drop {collapse_drop:g}"
    )
    return (
        f"held-out accuracy fell from {acc_start:.3f} to {acc_final:.3f}, more than "
        f"{limit:.3f} ({why})"
    )


OUTLIER_MADS = 5.0
"""How many median absolute deviations above a run's own median make a step an outlier."""

SPIKE_COLUMNS = ("grad_norm_peak", "grad_norm_outliers", "loss_outliers")
"""The columns of :func:`spike_summary`, computed from ``metrics.jsonl`` (:func:`metric_columns`
fills them in for runs summarised before they existed)."""


def outliers(values: list[float], *, two_sided: bool = False) -> int:
    """The number of outlier values of one run: above median + :data:`OUTLIER_MADS` · MAD, MAD
    the median absolute deviation from the median (unscaled), the run's own values being the
    reference (a robust rule: a few spikes move neither the median nor the MAD); with
    ``two_sided``, also below median − OUTLIER_MADS · MAD. Non-finite values are outliers (a
    step that overflowed is a spike). With MAD 0 (most values equal) any value off the median
    on the judged side counts.

    >>> outliers([1.0, 1.1, 0.9, 1.0, 1.2, 9.0])  # median 1.05, MAD 0.1: above 1.55
    1
    >>> outliers([0.0, 0.1, -0.1, 0.05, -3.0], two_sided=True)  # median 0, MAD 0.1
    1
    """
    finite = [v for v in values if math.isfinite(v)]
    bad = len(values) - len(finite)
    if not finite:
        return bad
    med = statistics.median(finite)
    mad = statistics.median(abs(v - med) for v in finite)
    hi, lo = med + OUTLIER_MADS * mad, med - OUTLIER_MADS * mad
    return bad + sum(v > hi or (two_sided and v < lo) for v in finite)


MIN_REFERENCE_STEPS = 5
"""The fewest steps of one kind that make a reference for :func:`outliers`."""


def spike_summary(rows: list[dict[str, Any]], steps: int) -> dict[str, float]:
    """Early spikes (natolambert/rlhf-book#489 reports k3 in the loss with large early loss and
    gradient-norm spikes): ``grad_norm_peak``, the largest per-step ``grad_norm`` over the
    first half of the run's ``steps`` (steps 1 .. steps // 2, at least step 1), and the counts
    of outlier steps over the whole run (:func:`outliers`): ``grad_norm_outliers`` above the
    median + 5 MAD of ``grad_norm``, ``loss_outliers`` beyond median ± 5 MAD of ``loss/total``
    (two-sided: the total loss has either sign).

    Only the steps whose update was applied count (``step/skipped`` not 1: a skipped step's
    gradient never reached the policy). A step is judged against the run's steps of its own
    kind: those with an advantage signal (``reward/group_std`` > 0) and those without, whose
    gradient is the KL term's alone and typically 10-30× smaller on a real model, so that
    pooling them would count every step with a signal as a spike; a kind with fewer than
    :data:`MIN_REFERENCE_STEPS` steps is not judged. NaN where a run logged no such step.

    >>> rows = [{"step": s, "grad_norm": g, "loss/total": 0.0} for s, g in enumerate([1, 9, 1, 1, 1, 1.1], 1)]
    >>> spike_summary(rows, 4)  # peak over steps 1-2; median 1, MAD 0: 9 and 1.1 lie above
    {'grad_norm_peak': 9.0, 'grad_norm_outliers': 2, 'loss_outliers': 0}
    """
    applied = [r for r in rows if r.get("step", 0) >= 1 and num(r.get("step/skipped", 0.0)) != 1]
    kinds: dict[bool, list[dict[str, Any]]] = {}
    for r in applied:
        kinds.setdefault(num(r.get("reward/group_std", 1.0)) > 0, []).append(r)

    def count(key: str, two_sided: bool) -> float:
        judged = [
            [num(r[key]) for r in rs if key in r]
            for rs in kinds.values()
            if sum(key in r for r in rs) >= MIN_REFERENCE_STEPS
        ]
        return sum(outliers(v, two_sided=two_sided) for v in judged) if judged else math.nan

    early = [
        num(r["grad_norm"]) for r in applied if "grad_norm" in r and r["step"] <= max(1, steps // 2)
    ]
    return {
        "grad_norm_peak": max(early, key=nan_low) if early else math.nan,
        "grad_norm_outliers": count("grad_norm", False),
        "loss_outliers": count("loss/total", True),
    }


def metric_columns(row: dict[str, Any], run_dir: Path, steps: int) -> dict[str, Any]:
    """``row`` (a run's ``result.yaml`` row) with the columns computed from its
    ``metrics.jsonl`` that it lacks (:data:`SPIKE_COLUMNS`): a run summarised before a column
    existed gets it from its archived metrics, without running again. Returned unchanged when
    it has them all or its metrics are not there."""
    if all(k in row for k in SPIKE_COLUMNS):
        return row
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return row
    return {**spike_summary(read_metrics(path), steps), **row}


COLLAPSE_Z = 2.0
"""Standard errors a drop in held-out accuracy must exceed to count as a collapse."""


def collapse_threshold(
    acc_start: float, acc_final: float, eval_size: int | None, collapse_drop: float
) -> float:
    """How far held-out accuracy must fall to be a collapse rather than noise: the larger of
    ``collapse_drop`` and :data:`COLLAPSE_Z` standard errors of the difference of two accuracies
    on ``eval_size`` problems each, sqrt((p0 (1 - p0) + p1 (1 - p1)) / n) (binomial; the two
    evaluations treated as independent). Only ``collapse_drop`` without ``eval_size``."""
    if not eval_size:
        return collapse_drop
    var = (acc_start * (1 - acc_start) + acc_final * (1 - acc_final)) / eval_size
    return max(collapse_drop, COLLAPSE_Z * math.sqrt(max(var, 0.0)))


def _kl_columns(steps_rows: list[dict[str, Any]], logged_key: str) -> dict[str, float]:
    """The exact KL at the end and at its peak, the logged estimate ``logged_key`` at the end,
    its mean gap to the exact KL, and the estimator's noise against k1's."""
    kl_exact = [num(r["kl/ref/exact"]) for r in steps_rows]
    gaps = [num(r[logged_key]) - num(r["kl/ref/exact"]) for r in steps_rows if logged_key in r]
    # The KL curve is noisy step to step: its peak is the largest running mean over WINDOW steps.
    smooth = [
        sum(kl_exact[i : i + WINDOW]) / len(kl_exact[i : i + WINDOW])
        for i in range(max(1, len(kl_exact) - WINDOW + 1))
        if kl_exact
    ]
    # The estimator's noise: the per-step logged estimate minus the exact KL of the same step,
    # and the same for k1 (logged by every run, on the policy's own tokens) for comparison.
    est = [num(r[logged_key]) for r in steps_rows if logged_key in r]
    noise = [num(r[logged_key]) - num(r["kl/ref/exact"]) for r in steps_rows if logged_key in r]
    k1_noise = [
        num(r["kl/ref/k1"]) - num(r["kl/ref/exact"]) for r in steps_rows if "kl/ref/k1" in r
    ]
    return {
        "kl_exact_final": _tail_mean(steps_rows, "kl/ref/exact"),
        "kl_exact_peak": max(smooth) if kl_exact else math.nan,
        "kl_logged_final": _tail_mean(steps_rows, logged_key),
        "kl_gap_mean": sum(gaps) / len(gaps) if gaps else math.nan,
        "kl_est_var": _var(est),
        "kl_noise_var": _var(noise),
        "kl_k1_noise_var": _var(k1_noise),
    }


def steps_to_reach(rows: list[dict[str, Any]], key: str, threshold: float) -> float:
    """The first step at which the WINDOW-step running mean of ``key`` (over the rows that log
    it, the first full window onwards) is >= ``threshold``; NaN if it never is."""
    pts = [(r["step"], num(r[key])) for r in rows if key in r]
    for i in range(WINDOW - 1, len(pts)):
        if statistics.fmean(v for _, v in pts[i - WINDOW + 1 : i + 1]) >= threshold:
            return pts[i][0]
    return math.nan


BUDGET_TOLERANCE = 0.2  # a KL budget is held if the KL stays within ±20% of it


def kl_budget_summary(
    rows: list[dict[str, Any]], target: float | None, steps: int, *, key: str = "kl/ref/exact"
) -> dict[str, float]:
    """Did the exact KL stay within ±20% of ``target`` over the second half of training?

    ``key`` is the logged KL judged: ``kl/ref/exact`` (per token) or ``kl/ref/seq`` (per
    sequence, :data:`klpo.train.runtime.metrics.CONTROLLED_KL`). For each logged step ``s > steps / 2``
    (``steps``: the run's configured length), the trailing WINDOW-step running mean ``m_s`` of
    ``key`` (the steps ``s - WINDOW + 1 .. s`` that
    were logged; the window may reach back into the first half). Returns ``kl_target``;
    ``kl_budget_ratio``, the plain mean of ``key`` over those steps divided by the target
    (> 1: overshoot, < 1: undershoot); ``kl_budget_frac``, the fraction of those steps with
    ``0.8 · target <= m_s <= 1.2 · target``; ``kl_budget_held``, 1 if that fraction is 1, else 0.
    All NaN without a target or without a logged step in the second half (a run that stopped
    early); a non-finite KL counts as outside.
    """
    out = {
        "kl_target": math.nan if target is None else float(target),
        "kl_budget_ratio": math.nan,
        "kl_budget_frac": math.nan,
        "kl_budget_held": math.nan,
    }
    pts = [(r["step"], num(r[key])) for r in rows if key in r]
    late = [i for i, (s, _) in enumerate(pts) if s > steps / 2]
    if target is None or not late:
        return out
    kls = [k for _, k in pts]
    lo, hi = (1 - BUDGET_TOLERANCE) * target, (1 + BUDGET_TOLERANCE) * target
    inside = [lo <= statistics.fmean(kls[max(0, i - WINDOW + 1) : i + 1]) <= hi for i in late]
    frac = sum(inside) / len(inside)
    out.update(
        kl_budget_ratio=statistics.fmean(kls[i] for i in late) / target,
        kl_budget_frac=frac,
        kl_budget_held=1.0 if frac == 1.0 else 0.0,
    )
    return out


def gold_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Over-optimisation columns: the gold and proxy rewards at the end (means of the last WINDOW
    steps), the peak of the gold reward's WINDOW-step running mean and the exact sequence KL
    (``kl/ref/seq``, same running mean) at that peak; NaN where no gold reward was logged."""
    nan = {k: math.nan for k in ("gold_final", "gold_peak", "gold_peak_kl_seq", "proxy_final")}
    out = {**nan, "kl_seq_final": _tail_mean(rows, "kl/ref/seq")}
    rows = [r for r in rows if "reward/gold" in r]
    if not rows:
        return out
    gold = [num(r["reward/gold"]) for r in rows]
    seq = [num(r.get("kl/ref/seq")) for r in rows]
    n = max(1, len(gold) - WINDOW + 1)
    runs = [
        (statistics.fmean(gold[i : i + WINDOW]), statistics.fmean(seq[i : i + WINDOW]))
        for i in range(n)
    ]
    peak = max(runs, key=lambda gk: nan_low(gk[0]))
    out.update(
        gold_final=_tail_mean(rows, "reward/gold"),
        gold_peak=peak[0],
        gold_peak_kl_seq=peak[1],
        proxy_final=_tail_mean(rows, "reward/proxy"),
    )
    return out


def _var(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.variance(xs) if len(xs) > 1 else math.nan


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else math.nan)


def _mean(rows: list[dict[str, Any]], column: str) -> float:
    """The mean of ``column`` over ``rows`` (one cell's runs), nan where none has a finite one;
    a run without the column counts as having none."""
    return _stats([num(r.get(column)) for r in rows])[0]


def summarise_cells(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (algo, choice, beta): means ± sd over seeds and the failure count."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        cells.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    table = []
    for (algo, choice, beta), rs in cells.items():
        acc_m, acc_s = _stats([num(r["acc_final"]) for r in rs])
        reward_m, reward_s = _stats([num(r["reward_final"]) for r in rs])
        table.append(
            {
                "algo": algo,
                "choice": choice,
                "beta": beta,
                "runs": len(rs),
                "failed": sum(r["status"] != "ok" for r in rs),
                "statuses": ", ".join(sorted({r["status"] for r in rs if r["status"] != "ok"})),
                "acc_start": _stats([num(r["acc_start"]) for r in rs])[0],
                "acc_mean": acc_m,
                "acc_sd": acc_s,
                "kl_final": _stats([num(r["kl_exact_final"]) for r in rs])[0],
                "kl_peak": _stats([num(r["kl_exact_peak"]) for r in rs])[0],
                "kl_gap": _stats([num(r["kl_gap_mean"]) for r in rs])[0],
                "gold_final": _mean(rs, "gold_final"),
                "gold_sd": _stats([num(r.get("gold_final")) for r in rs])[1],
                "gold_peak": _mean(rs, "gold_peak"),
                "gold_peak_kl_seq": _mean(rs, "gold_peak_kl_seq"),
                "proxy_final": _mean(rs, "proxy_final"),
                "kl_seq_final": _mean(rs, "kl_seq_final"),
                "entropy_final": _mean(rs, "entropy_final"),
                "length_final": _mean(rs, "length_final"),
                "reward_mean": reward_m,
                "reward_var": reward_s**2 if math.isfinite(reward_s) else math.nan,
                "wall_s": _stats([num(r["wall_s"]) for r in rs])[0],
                "ref_time_s": _mean(rs, "ref_time_s"),
                "kl_est_var": _mean(rs, "kl_est_var"),
                "kl_noise_var": _mean(rs, "kl_noise_var"),
                "kl_k1_noise_var": _mean(rs, "kl_k1_noise_var"),
                "steps_to_target": _mean(rs, "steps_to_target"),
                "reached": sum(math.isfinite(num(r.get("steps_to_target"))) for r in rs),
                "kl_target": _mean(rs, "kl_target"),
                "kl_unit": rs[0].get("kl_unit") or "token",
                "kl_budget_ratio": _mean(rs, "kl_budget_ratio"),
                "kl_budget_frac": _mean(rs, "kl_budget_frac"),
                "kl_budget_held": sum(num(r.get("kl_budget_held")) == 1.0 for r in rs),
            }
        )
    return table


def nan_low(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def heldout_scores(run_dir: Path) -> dict[int, dict[int, float]]:
    """Each evaluation's per-problem scores, ``{step: {problem index: score}}``, from the run's
    ``samples.jsonl`` (the held-out records: as many problems as ``run.log_samples``; a resumed
    run's later record of the same step and problem wins)."""
    out: dict[int, dict[int, float]] = {}
    for r in read_samples(run_dir / "samples.jsonl"):
        if r.get("split") == "eval" and r.get("reward") is not None:
            out.setdefault(int(r["step"]), {})[int(r["index"])] = num(r["reward"])
    return out


def mcnemar_exact(gained: int, lost: int) -> float:
    """The exact two-sided McNemar p-value (McNemar 1947): under no change, each of the
    ``gained + lost`` problems that changed is equally likely to have gone either way, a
    Binomial(m, 1/2); the probability of a split at least as uneven as the one seen."""
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2**m
    return min(1.0, 2 * tail)


def paired_change(
    pairs: list[tuple[float, float]],
) -> dict[str, float]:
    """Problems turned right (``gained``) and turned wrong (``lost``) between two evaluations of
    the same problems (``pairs`` of 0/1 scores, before and after), and the McNemar p-value."""
    gained = sum(1 for b, a in pairs if a >= 0.5 > b)
    lost = sum(1 for b, a in pairs if b >= 0.5 > a)
    return {"pairs": len(pairs), "gained": gained, "lost": lost, "p": mcnemar_exact(gained, lost)}
