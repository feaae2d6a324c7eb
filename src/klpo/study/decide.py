"""A page's verdicts decided from the archived studies, with the seed as the unit.

A page that draws conclusions from several studies (docs/literature.md, the study pages) lists
the comparisons it rests on in a YAML file beside it; this module reads each comparison's values
per seed from the archives, tests them (:mod:`klpo.study.seeds`), applies Holm's correction over
the page's whole list (its family) and writes the table of decisions into the page between two
markers, so that the verdict words are generated, never written by hand::

    python -m klpo.study.decide docs/literature/decisions.yaml          # rewrites the block
    python -m klpo.study.decide docs/literature/decisions.yaml --check  # exit 1 if stale

The file::

    page: ../literature.md        # the page whose block is written (relative to the file)
    alpha: 0.05
    comparisons:
      - id: TM2                   # the page's row (several comparisons may share one)
        a: k3 loss @ 0.1          # cells as a study spec writes them
        b: full loss @ 0.1
        metric: gold_final        # the value per seed (a source's column or quantity)
        source: results           # where it is read from: a row of SOURCES
        archives: [study-overopt, literature/gao]   # under docs/; pairs within each
        claim: "<"                # the claim's direction, A against B: > < = (optional)
        what: k3 in the loss against full, proxy task   # the row's words on the page

Pairs are formed within each archive (seed ``s`` of A with seed ``s`` of B, the same prompts
from the same start) and pooled over the archives: the runs of two archives are distinct seeds.
``b_archives`` names where B's runs are when they are in other archives (zipped with
``archives``, paired by seed: studies run by the same trainer); ``paired: false`` uses Welch's
test instead (cells of studies run under different trainers). ``b: null`` tests A's values
against 0 (a one-sample test: e.g. an offset).

Sources (:data:`SOURCES`, a row per kind of value):

- ``results``: a column of the archive's ``results.csv`` (``b_metric``: another column for B,
  e.g. the no-KL runs' ``gold_peak``);
- ``heldout``: ``accuracy/heldout`` at evaluation ``step`` from the archived runs' metrics;
- ``offset``: Gao et al.'s matched comparison, per run the mean over its steps after
  ``after_step`` of its gold reward minus the mean gold reward of the ``baseline`` cell's steps
  (every seed's) within ``width`` of its d = sqrt(KL_seq), where at least ``min_points`` lie
  (``klpo.study.gao.matched_baseline``); per-step points from ``trajectories`` (a CSV of
  ``klpo.study.gao``) or the archived runs' metrics (``reward/gold``, ``kl/ref/seq``).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from klpo._io import write_text_atomic
from klpo.study.seeds import Decision, Difference, decide, paired_test, welch_test
from klpo.study.spec import parse_cell
from klpo.study.summary import num

__all__ = [
    "BEGIN",
    "END",
    "SOURCES",
    "Claimed",
    "DecisionFile",
    "decide_file",
    "decisions_markdown",
    "load_decisions",
    "main",
    "render_block",
    "seed_values",
    "short_verdict",
    "verdicts_by_row",
]

BEGIN = "<!-- decisions: begin -->"
END = "<!-- decisions: end -->"
DOCS = Path(__file__).resolve().parents[3] / "docs"


class Claimed(BaseModel):
    """One comparison of a page: cell A against cell B on one value per seed."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(description="The page's row this comparison backs (e.g. TM2).")
    model: Literal["built-in", "SmolLM2", "Gemma 3"] = Field(
        "built-in",
        description="The model: klpo's built-in one, SmolLM2-135M-Instruct or Gemma 3 270M.",
    )
    a: str = Field(description="Cell A as a study spec writes it: 'full loss @ 0.1', 'no KL'.")
    b: str | None = Field(description="Cell B, or null: A's values against 0 (one sample).")
    algo: str = Field("grpo", description="The algorithm of both cells.")
    metric: str = Field("acc_final", description="The value per seed (a column or quantity).")
    b_metric: str | None = Field(None, description="B's value, when another than A's.")
    source: Literal["results", "heldout", "offset"] = "results"
    archives: list[str] = Field(description="Archives under docs/ holding A's runs.")
    b_archives: list[str] | None = Field(None, description="Where B's runs are, if elsewhere.")
    paired: bool = Field(True, description="Pair by seed (false: Welch's test).")
    claim: Literal[">", "<", "="] | None = None
    what: str = Field(description="The comparison in the page's words.")
    step: int | None = Field(None, description="source heldout: the evaluation step.")
    baseline: str = Field("no KL", description="source offset: the cell matched against.")
    after_step: int = Field(0, description="source offset: steps after this one count.")
    width: float = Field(0.05, description="source offset: half-width of the d window.")
    min_points: int = Field(20, description="source offset: baseline points a window needs.")
    trajectories: str | None = Field(None, description="source offset: a gao points CSV.")
    family: str = Field(
        "exploratory",
        description="The Holm family: 'exploratory' (the page's own comparisons), or "
        "'primary: NAME' for a study's comparisons named in its spec before its runs, "
        "corrected over that study's primary family only.",
    )

    @field_validator("family")
    @classmethod
    def _family(cls, v: str) -> str:
        if v != "exploratory" and not v.startswith("primary: "):
            raise ValueError(f"family must be 'exploratory' or 'primary: NAME', got {v!r}")
        return v

    @field_validator("a", "b", "baseline")
    @classmethod
    def _cell(cls, v: str | None) -> str | None:
        if v is not None:
            parse_cell(v)
        return v


class DecisionFile(BaseModel):
    """A page's comparisons (its family) and where their table goes."""

    model_config = ConfigDict(extra="forbid")

    page: str = Field(description="The page, relative to this file.")
    alpha: float = Field(0.05, gt=0, lt=1)
    comparisons: list[Claimed] = Field(min_length=1)


def load_decisions(path: str | Path) -> DecisionFile:
    """A decisions file, validated (a ValueError naming the file, the entry and the field)."""
    path = Path(path)
    try:
        return DecisionFile.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
    except ValidationError as err:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ValueError(f"bad decisions file {str(path)!r}:\n  " + "\n  ".join(lines)) from None


# ---------------------------------------------------------------------------------------------
# Values per seed.


def _results_rows(archive: Path) -> list[dict[str, Any]]:
    path = archive / "results.csv"
    if not path.is_file():
        raise ValueError(f"{archive} has no results.csv")
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def _matches(row: dict[str, Any], cell: str, algo: str) -> bool:
    label, beta = parse_cell(cell)
    return (
        row["algo"] == algo
        and row["choice"] == label
        and (float(row["beta"]) == 0 if beta is None else float(row["beta"]) == beta)
    )


def _cell_runs(archive: Path, cell: str, algo: str) -> list[dict[str, Any]]:
    rows = [r for r in _results_rows(archive) if _matches(r, cell, algo)]
    if not rows:
        shown = sorted(
            {f"{r['algo']}: {r['choice']} @ {float(r['beta']):g}" for r in _results_rows(archive)}
        )
        raise ValueError(
            f"{archive}: no runs of cell {algo}: {cell!r}; its cells: {', '.join(shown)}"
        )
    return rows


def _metrics(archive: Path, name: str) -> list[dict[str, Any]]:
    run = archive / "runs" / name
    for path, opener in ((run / "metrics.jsonl", open), (run / "metrics.jsonl.gz", gzip.open)):
        if path.is_file():
            with opener(path, "rt", encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"{archive}: the run {name} has no archived metrics")


def _from_results(
    c: Claimed, root: Path, archive: Path, cell: str, metric: str
) -> dict[int, float]:
    return {int(r["seed"]): num(r.get(metric)) for r in _cell_runs(archive, cell, c.algo)}


def _from_heldout(
    c: Claimed, root: Path, archive: Path, cell: str, metric: str
) -> dict[int, float]:
    if c.step is None:
        raise ValueError(f"{c.id}: source heldout needs step")
    out = {}
    for r in _cell_runs(archive, cell, c.algo):
        evals = {m["step"]: num(m["accuracy/heldout"]) for m in _metrics(archive, r["name"])
                 if "accuracy/heldout" in m}  # fmt: skip
        out[int(r["seed"])] = evals.get(c.step, math.nan)
    return out


def _points(c: Claimed, archive: Path, root: Path) -> list[dict[str, Any]]:
    """Per-step ``(run, choice, beta, seed, step, gold, kl_seq)`` rows of an archive."""
    if c.trajectories:
        from klpo.study.gao import read_trajectories

        return read_trajectories(root / c.trajectories)
    rows = []
    for r in _results_rows(archive):
        for m in _metrics(archive, r["name"]):
            if "reward/gold" in m and "kl/ref/seq" in m:
                rows.append(
                    {"run": r["name"], "algo": r["algo"], "choice": r["choice"],
                     "beta": float(r["beta"]), "seed": int(r["seed"]), "step": int(m["step"]),
                     "gold": num(m["reward/gold"]), "kl_seq": num(m["kl/ref/seq"])}
                )  # fmt: skip
    return rows


def _from_offset(c: Claimed, root: Path, archive: Path, cell: str, metric: str) -> dict[int, float]:
    from klpo.study.gao import matched_baseline

    points = _points(c, archive, root)
    base_label, _ = parse_cell(c.baseline)
    base = matched_baseline(
        points, 0.0, f"{c.algo} {base_label}", width=c.width, min_points=c.min_points
    )
    label, beta = parse_cell(cell)
    out: dict[int, list[float]] = {}
    for p in points:
        if p["algo"] != c.algo or p["choice"] != label or (beta is not None and p["beta"] != beta):
            continue
        if p["step"] <= c.after_step or not math.isfinite(p["kl_seq"]):
            continue
        expected = base(math.sqrt(max(p["kl_seq"], 0.0)))
        if math.isfinite(expected):
            out.setdefault(int(p["seed"]), []).append(p["gold"] - expected)
    return {s: sum(v) / len(v) for s, v in out.items()}


Source = Callable[[Claimed, Path, Path, str, str], dict[int, float]]
SOURCES: dict[str, Source] = {
    "results": _from_results,
    "heldout": _from_heldout,
    "offset": _from_offset,
}
"""Where a comparison's values per seed come from: ``(comparison, docs root, archive, cell,
metric) -> {seed: value}`` of one cell in one archive."""


def seed_values(c: Claimed, root: Path = DOCS) -> tuple[list[float], list[float]]:
    """A's and B's values, paired (seed by seed within each archive, the archives one after
    the other) or, with ``paired: false``, all of A's and all of B's."""
    source = SOURCES[c.source]
    b_archives = c.b_archives or c.archives
    if len(b_archives) != len(c.archives):
        raise ValueError(f"{c.id}: b_archives must name one archive per archive of a")
    xs: list[float] = []
    ys: list[float] = []
    for arch_a, arch_b in zip(c.archives, b_archives, strict=True):
        va = source(c, root, root / arch_a, c.a, c.metric)
        if c.b is None:
            xs += [va[s] for s in sorted(va)]
            ys += [0.0] * len(va)
            continue
        vb = source(c, root, root / arch_b, c.b, c.b_metric or c.metric)
        if c.paired:
            seeds = sorted(set(va) & set(vb))
            xs += [va[s] for s in seeds]
            ys += [vb[s] for s in seeds]
        else:
            xs += [va[s] for s in sorted(va)]
            ys += [vb[s] for s in sorted(vb)]
    return xs, ys


def _test(c: Claimed, root: Path) -> Difference:
    xs, ys = seed_values(c, root)
    return paired_test(xs, ys) if c.paired or c.b is None else welch_test(xs, ys)


# ---------------------------------------------------------------------------------------------
# The table.


@dataclass(frozen=True)
class Row:
    """One decided comparison of a page."""

    claimed: Claimed
    decision: Decision


def decide_file(spec: DecisionFile, root: Path = DOCS) -> list[Row]:
    """Every comparison of the file tested and decided, Holm over each family: the page's
    exploratory comparisons together, and a study's primary ones (named in its spec before its
    runs, ``family: primary: NAME``) over their own family, as that study's report decides
    them; archives are read under ``root`` (the repository's docs/)."""
    tests = [_test(c, root) for c in spec.comparisons]
    rows: list[Row | None] = [None] * len(tests)
    for family in dict.fromkeys(c.family for c in spec.comparisons):
        idx = [i for i, c in enumerate(spec.comparisons) if c.family == family]
        members = [spec.comparisons[i] for i in idx]
        decisions = decide(
            [(c.id, tests[i]) for i, c in zip(idx, members, strict=True)],
            spec.alpha,
            claims=[c.claim for c in members],
            names=[(c.a, c.b or "0") for c in members],
        )
        for i, c, d in zip(idx, members, decisions, strict=True):
            rows[i] = Row(c, d)
    return [r for r in rows if r is not None]


def _f(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.3f}"


def _p(p: float) -> str:
    if not math.isfinite(p):
        return "–"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def decisions_markdown(rows: list[Row], alpha: float) -> str:
    """The page's table of decisions: one row per comparison."""
    primary = sorted({r.claimed.family for r in rows} - {"exploratory"})
    n_exploratory = sum(r.claimed.family == "exploratory" for r in rows)
    families = (
        f"over all {n_exploratory} of them"
        if not primary
        else f"over the page's {n_exploratory} exploratory ones, and over each study's primary "
        f"comparisons, named before its runs, as that study decides them ({', '.join(primary)})"
    )
    lines = [
        f"Every comparison below is tested with the seed as the unit and decided after Holm's "
        f"correction {families} (alpha {alpha:g}): A and B are the means over "
        "seeds; A − B with its 95% t-interval; p of the paired t-test on the seed-by-seed "
        "differences (Welch's test where the runs cannot be paired, marked W; a test against 0 "
        "where B is 0); the exact permutation check (sign flips, or label swaps for Welch); "
        '"seeds needed": the seeds (per cell, for Welch) at which the test at its Holm level '
        "would reach power 0.8 if the observed difference and spread were the true ones. "
        "Generated by `python -m klpo.study.decide` from the archives; the verdicts are its "
        "words.",
        "",
        "| row | model | comparison | A | B | metric | archives | seeds | A mean | B mean "
        "| A − B (95% t-interval) | p | Holm p | check p | seeds needed | verdict |",
        "| --- | --- | --- | --- | --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: "
        "| ---: | ---: | --- |",
    ]
    for row in rows:
        c, d = row.claimed, row.decision
        t = d.test
        metric = c.metric if c.source == "results" else f"{c.source}: {c.metric}"
        if c.source == "heldout":
            metric = f"held-out at step {c.step}"
        if c.b_metric:
            metric += f" (B: {c.b_metric})"
        seeds = f"{t.n}" if t.paired else f"{t.n}, {t.n_b} W"
        claim = {None: "", ">": " (claim: A > B)", "<": " (claim: A < B)", "=": " (claim: A = B)"}
        lines.append(
            f"| {c.id} | {c.model} | {c.what}{claim[c.claim]}{_family_words(c.family)} | {c.a} | {c.b or '0'} | {metric} | "
            f"{', '.join(c.archives) + (' / ' + ', '.join(c.b_archives) if c.b_archives else '')}"
            f" | {seeds} | {_f(t.mean_a)} | {_f(t.mean_b)} | {_f(t.diff)} ({_f(t.lo)} to "
            f"{_f(t.hi)}) | {_p(t.p)} | {_p(d.p_holm)} | {_p(t.p_perm)} | "
            f"{'–' if d.seeds is None else d.seeds} | **{d.verdict}** |"
        )
    return "\n".join(lines) + "\n"


def _family_words(family: str) -> str:
    return "" if family == "exploratory" else f" ({family}, named before the runs)"


def render_block(page_text: str, table: str) -> str:
    """``page_text`` with the text between :data:`BEGIN` and :data:`END` replaced by
    ``table`` (a ValueError when the page lacks either marker)."""
    if BEGIN not in page_text or END not in page_text:
        raise ValueError(f"the page has no {BEGIN} ... {END} block for the decisions")
    head, rest = page_text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}{END}{tail}"


def verdicts_by_row(rows: list[Row]) -> dict[str, list[str]]:
    """``{row id: [verdict words of each of its comparisons]}``."""
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r.claimed.id, []).append(r.decision.verdict)
    return out


def short_verdict(words: str) -> str:
    """The verdict without its parenthesis: ``'not decided'``, ``'holds'``, ``'differs'``."""
    return re.sub(r"\s*\(.*$", "", words).split(":")[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m klpo.study.decide", description=__doc__)
    p.add_argument("file", type=Path, help="A page's decisions YAML.")
    p.add_argument("--check", action="store_true", help="Exit 1 if the page's block is stale.")
    p.add_argument("--root", type=Path, default=DOCS, help="Where the archives are (docs/).")
    a = p.parse_args(argv)
    spec = load_decisions(a.file)
    page = (a.file.parent / spec.page).resolve()
    rows = decide_file(spec, a.root)
    text = page.read_text(encoding="utf-8")
    new = render_block(text, decisions_markdown(rows, spec.alpha))
    if a.check:
        if new != text:
            print(f"{page}: the decisions block is stale; run python -m klpo.study.decide {a.file}")
            return 1
        return 0
    if new != text:
        write_text_atomic(page, new)
    for r in rows:
        print(f"{r.claimed.id}: {r.claimed.what}: {r.decision.verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
