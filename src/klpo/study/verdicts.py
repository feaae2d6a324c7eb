"""A study's comparisons decided with the seed as the unit: the report's families and sections.

Every comparison a report makes pairs the runs of the same seed (the same prompts in the same
order from the same start) and is decided by the paired t-test on the seed-by-seed differences,
with Holm's correction over its family (:mod:`klpo.study.seeds`). Two families, each corrected on
its own:

- **primary**: the comparisons the study's spec names before its runs
  (:attr:`~klpo.study.spec.StudyConfig.comparisons`), at the spec's ``alpha``;
- **exploratory**: every other comparison the report shows: each cell against the no-KL cell of
  its algorithm on held-out accuracy, and on the chat tasks each cell against its own start.
  Their verdicts are worded as the primary ones' but are labelled exploratory: a finding there
  is a reason for a primary comparison in the next study, not a result.

Cells the spec lists in ``added_after`` (added once earlier results had been seen) are marked
with :data:`ADDED_MARK` wherever they appear. Per cell, the mean over seeds with its t-interval,
the percentile bootstrap over seeds and, where every seed's per-problem held-out scores exist
(``samples.jsonl``), the bootstrap over seeds and problems.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from klpo.study.seeds import (
    Decision,
    Difference,
    bootstrap_interval,
    crossed_bootstrap_interval,
    decide,
    paired_test,
    t_interval,
)
from klpo.study.spec import StudyConfig, parse_cell
from klpo.study.summary import num

__all__ = [
    "ADDED_MARK",
    "SEED_HEADING",
    "Compared",
    "cell_name",
    "exploratory_comparisons",
    "primary_comparisons",
    "seed_sections",
]

ADDED_MARK = "†"
"""The mark of a cell added after earlier results of its study were seen."""

SEED_HEADING = "## Cells and comparisons, the seed as the unit"
"""The heading of the report's seed-level section."""

Cell = tuple[str, str, float]  # (algo, choice, beta); beta 0 for no KL
Scores = Callable[[str, str], dict[int, float]]  # (run name, "start" | "end") -> {problem: score}


def cell_name(choice: str, beta: float, placement_none: bool | None = None) -> str:
    """A cell as the spec writes it: ``"full loss @ 0.1"``, ``"no KL"`` (a choice without a KL
    term has no beta; ``placement_none`` None: judged by its beta being 0).

    >>> cell_name("full loss", 0.05), cell_name("no KL", 0.0)
    ('full loss @ 0.05', 'no KL')
    """
    none = beta == 0 if placement_none is None else placement_none
    return choice if none else f"{choice} @ {beta:g}"


@dataclass(frozen=True)
class Compared:
    """One comparison of a report: its name, cells, metric, the test and the per-problem
    interval of the difference (NaN where there are no per-problem scores)."""

    name: str
    a: str
    b: str
    metric: str
    algo: str
    test: Difference
    problems_lo: float = math.nan
    problems_hi: float = math.nan


def _cells(results: list[dict[str, Any]]) -> dict[Cell, dict[int, dict[str, Any]]]:
    out: dict[Cell, dict[int, dict[str, Any]]] = {}
    for r in results:
        out.setdefault((r["algo"], r["choice"], float(r["beta"])), {})[int(r["seed"])] = r
    return out


def _find(cells: dict[Cell, dict], algo: str, cell: str) -> Cell | None:
    label, beta = parse_cell(cell)
    for key in cells:
        if key[0] == algo and key[1] == label and (beta is None or key[2] == beta):
            if beta is None and key[2] != 0:
                continue
            return key
    return None


def _pair(
    a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], metric: str, b_metric: str
) -> tuple[list[int], list[float], list[float]]:
    seeds = sorted(set(a) & set(b))
    return seeds, [num(a[s].get(metric)) for s in seeds], [num(b[s].get(b_metric)) for s in seeds]


def _problem_interval(
    scores: Scores | None,
    a_runs: list[str],
    b_runs: list[str],
    problems: int,
    a_when: str = "end",
    b_when: str = "end",
) -> tuple[float, float]:
    """The seeds × problems bootstrap interval of the mean per-problem difference of paired
    runs, over the problems every one of them scored; NaN unless those are all ``problems``
    of the evaluation (a run that logged a few held-out completions, ``run.log_samples``, has
    no per-problem table)."""
    if scores is None or len(a_runs) < 2:
        return math.nan, math.nan
    tables = [(scores(x, a_when), scores(y, b_when)) for x, y in zip(a_runs, b_runs, strict=True)]
    shared = set.intersection(*(set(x) & set(y) for x, y in tables))
    if len(shared) < problems:
        return math.nan, math.nan
    probs = sorted(shared)
    diff = np.array([[x[p] - y[p] for p in probs] for x, y in tables], dtype=np.float64)
    return crossed_bootstrap_interval(diff)


def primary_comparisons(
    results: list[dict[str, Any]], study: StudyConfig, scores: Scores | None = None
) -> list[Compared]:
    """The spec's comparisons, in its order: each pairs the two cells' runs of the same seed."""
    cells = _cells(results)
    out = []
    for c in study.comparisons:
        ka, kb = _find(cells, c.algo, c.a), _find(cells, c.algo, c.b)
        a, b = cells.get(ka, {}) if ka else {}, cells.get(kb, {}) if kb else {}
        seeds, xs, ys = _pair(a, b, c.metric, c.metric)
        lo, hi = (math.nan, math.nan)
        if c.metric == "acc_final":
            lo, hi = _problem_interval(
                scores,
                [a[s]["name"] for s in seeds],
                [b[s]["name"] for s in seeds],
                study.eval_size,
            )
        out.append(Compared(c.name, c.a, c.b, c.metric, c.algo, paired_test(xs, ys), lo, hi))
    return out


def exploratory_comparisons(
    results: list[dict[str, Any]], study: StudyConfig, scores: Scores | None = None
) -> list[Compared]:
    """Every comparison the report shows that the spec did not name: each cell against the
    no-KL cell of its algorithm (held-out accuracy at the end), and on the chat tasks each cell
    against its own start (held-out accuracy at the start of the same runs)."""
    cells = _cells(results)
    named = {(c.algo, c.a, c.b, c.metric) for c in study.comparisons}
    named |= {(c.algo, c.b, c.a, c.metric) for c in study.comparisons}
    out = []
    for key in sorted(cells, key=lambda k: (k[0], k[1] == "no KL", k[1], k[2])):
        algo, choice, beta = key
        runs = cells[key]
        name = cell_name(choice, beta)
        base = next((k for k in cells if k[0] == algo and k[1] == "no KL"), None)
        if base is not None and base != key and (algo, name, "no KL", "acc_final") not in named:
            seeds, xs, ys = _pair(runs, cells[base], "acc_final", "acc_final")
            lo, hi = _problem_interval(
                scores,
                [runs[s]["name"] for s in seeds],
                [cells[base][s]["name"] for s in seeds],
                study.eval_size,
            )
            test = paired_test(xs, ys)
            out.append(Compared(f"{name} vs no KL", name, "no KL", "acc_final", algo, test, lo, hi))
        if study.chat:
            seeds, xs, ys = _pair(runs, runs, "acc_final", "acc_start")
            names = [runs[s]["name"] for s in seeds]
            lo, hi = _problem_interval(scores, names, names, study.eval_size, "end", "start")
            test = paired_test(xs, ys)
            out.append(
                Compared(f"{name} vs its start", name, "start", "acc_final", algo, test, lo, hi)
            )
    return out


def _f(x: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def _p(p: float) -> str:
    if not math.isfinite(p):
        return "–"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _mark(cell: str, added: set[tuple[str, float | None]]) -> str:
    return f"{cell} {ADDED_MARK}" if cell != "start" and parse_cell(cell) in added else cell


def _decision_rows(
    compared: Sequence[Compared], decisions: Sequence[Decision], added: set
) -> list[str]:
    lines = [
        "| comparison | metric | seeds | A | B | A − B (95% t-interval) | seeds × problems "
        "| p (paired t) | Holm p | sign-flip p | seeds needed | verdict |",
        "| --- | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for c, d in zip(compared, decisions, strict=True):
        t = d.test
        name = f"{_mark(c.a, added)} vs {_mark(c.b, added)}"
        interval = f"{_f(t.diff)} ({_f(t.lo)} to {_f(t.hi)})"
        problems = (
            f"{_f(c.problems_lo)} to {_f(c.problems_hi)}" if math.isfinite(c.problems_lo) else "–"
        )
        algo = "" if c.algo == "grpo" else f"{c.algo}: "
        lines.append(
            f"| {algo}{name} | {c.metric} | {t.n} | {_f(t.mean_a)} | {_f(t.mean_b)} | "
            f"{interval} | {problems} | {_p(t.p)} | {_p(d.p_holm)} | {_p(t.p_perm)} | "
            f"{'–' if d.seeds is None else d.seeds} | {d.verdict} |"
        )
    return lines


def _decided(compared: Sequence[Compared], alpha: float) -> list[Decision]:
    return decide([(c.name, c.test) for c in compared], alpha, names=[(c.a, c.b) for c in compared])


def seed_sections(
    results: list[dict[str, Any]], study: StudyConfig, scores: Scores | None = None
) -> list[str]:
    """The report's sections with the seed as the unit: each cell's estimate over its seeds,
    the primary comparisons (if the spec names any) and the exploratory ones, each family with
    its own Holm correction. ``scores(run, "start" | "end")``: a run's per-problem held-out
    scores, for the seeds × problems intervals (None: none)."""
    added = {parse_cell(c) for c in study.added_after}
    lines = [
        "",
        SEED_HEADING,
        "",
        "The seeds are the independent runs, so each cell is one number per seed and two cells "
        "are compared on the seed-by-seed differences of their runs of the same seed (the same "
        "prompts in the same order from the same start): the paired t-test, two-sided; Holm's "
        "correction over each family of comparisons; the exact sign-flip permutation test as a "
        "check (its smallest p is 2/2^n on n seeds: 0.25 on 3). "
        '"Seeds needed": the seeds at which a paired t-test at the comparison\'s Holm level '
        "would reach power 0.8 if the observed difference and spread were the true ones. The "
        "verdicts are generated from the Holm-corrected t-test: **differs** only where it "
        "passes, else **not decided** (klpo.study.seeds). Held-out accuracy "
        + ("is the gold reward on this task." if study.over_optimisation else "at the end.")
        + (
            f" {ADDED_MARK}: a cell added after earlier results of the study were seen "
            "(`added_after`)."
            if added
            else ""
        ),
        "",
        "| algo | KL choice | beta | seeds | per seed | held-out mean (95% t-interval) "
        "| bootstrap over seeds | seeds × problems |",
        "| --- | --- | --- | ---: | --- | --- | --- | --- |",
    ]
    cells = _cells(results)
    for key in sorted(cells, key=lambda k: (k[0], k[1], k[2])):
        algo, choice, beta = key
        runs = cells[key]
        values = [num(runs[s].get("acc_final")) for s in sorted(runs)]
        est = t_interval(values)
        lo, hi = bootstrap_interval(values)
        per_seed = " / ".join(_f(v, 2) for v in values)
        crossed = "–"
        if scores is not None and len(runs) >= 2:
            ends = [scores(runs[s]["name"], "end") for s in sorted(runs)]
            shared = sorted(set.intersection(*(set(e) for e in ends)))
            if len(shared) >= study.eval_size:
                table = np.array([[e[p] for p in shared] for e in ends], dtype=np.float64)
                clo, chi = crossed_bootstrap_interval(table)
                crossed = f"{_f(clo)} to {_f(chi)}"
        name = cell_name(choice, beta)
        mark = f" {ADDED_MARK}" if parse_cell(name) in added else ""
        lines.append(
            f"| {algo} | {choice}{mark} | {'–' if beta == 0 else f'{beta:g}'} | {est.n} | "
            f"{per_seed} | {_f(est.mean)} ({_f(est.lo)} to {_f(est.hi)}) | "
            f"{_f(lo)} to {_f(hi)} | {crossed} |"
        )
    primary = primary_comparisons(results, study, scores)
    if primary:
        lines += [
            "",
            f"**Primary comparisons**, named in the study's spec before its runs "
            f"(`comparisons`): Holm over these {len(primary)} at alpha {study.alpha:g}.",
            "",
            *_decision_rows(primary, _decided(primary, study.alpha), added),
        ]
    exploratory = exploratory_comparisons(results, study, scores)
    if exploratory:
        lines += [
            "",
            f"**Exploratory comparisons**, not named before the runs: Holm over these "
            f"{len(exploratory)} at alpha {study.alpha:g}. A difference here is a question for "
            "the next study's primary comparisons, not a result.",
            "",
            *_decision_rows(exploratory, _decided(exploratory, study.alpha), added),
        ]
    return lines
