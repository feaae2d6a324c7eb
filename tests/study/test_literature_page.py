"""docs/literature.md holds together: every claim has its section, a verdict and a line on what
would change it; its links and anchors resolve (and docs/choosing.md's into it); its Gao et al.
table is the committed fit; the study presets beside it hold the runs it says they do."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

try:  # the study package in rooms
    from klpo.study.grid import study_grid
    from klpo.study.spec import load_study
except ImportError:  # the study in one module
    from klpo.train.compare import load_study, study_grid

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "literature.md"
# The bold verdicts a cell of the verdicts table may hold: an identity checked exactly, a
# quantity measured on the real model, or a training comparison's word from the decisions table.
VERDICT_WORDS = (
    "true (exact",
    "false (exact",
    "agrees",
    "disagrees",
    "holds",
    "differs",
    "not decided",
    "out of reach",
)
TRAINING = ("holds", "differs", "not decided")
COLUMN = {"built-in": 5, "SmolLM2": 6}


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end >= 0 else len(text)]


def _table_rows(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[c.strip() for c in r.strip("|").split(" | ")] for r in rows[2:]]  # header, rule


def _anchors(text: str) -> set[str]:
    out = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def _row_ids(cell: str) -> list[str]:
    return re.findall(r"\]\(#([a-z0-9]+)\)", cell)


def _bold(cell: str) -> list[str]:
    return [" ".join(w.split()) for w in re.findall(r"\*\*([^*]+)\*\*", cell)]


def test_every_claim_has_a_section_a_verdict_and_what_would_change_it() -> None:
    text = PAGE.read_text(encoding="utf-8")
    rows = _table_rows(_section(text, "## The verdicts"))
    ids = [_row_ids(r[0])[0] for r in rows]
    assert len(ids) == len(set(ids)) >= 25
    for row, rid in zip(rows, ids, strict=True):
        assert len(row) == 7 and all(row), row  # id, paper, claim, setting, measured, verdicts
        for col in (5, 6):
            words = _bold(row[col])
            assert words and all(w.startswith(VERDICT_WORDS) for w in words), (rid, row[col])
        section = text[text.index(f'<a id="{rid}"></a>') :]
        section = section[: section.find("<a id=", 1) if "<a id=" in section[1:] else None]
        assert any(w.lower().startswith(VERDICT_WORDS) for w in _bold(section)), rid
    changes = _table_rows(_section(text, "## What would change each verdict"))
    covered = {i for r in changes for i in _row_ids(r[0])}
    assert covered == set(ids)
    assert not re.search(r"\b(TODO|TBD|FIXME|XXX)\b", text)
    assert not re.search(r"\b[Rr]eproduced\b|\bbeats\b", text)  # the old, unbacked words


def test_the_training_verdicts_are_the_decisions_tables() -> None:
    """Every training verdict of the verdicts table is the word the seed-level test, corrected
    over the page's comparisons, gives its row (with the seeds it would need), every bold
    "holds" or "differs" in the table is backed by one, and the table of decisions on the page
    is the one the archives give now."""
    from klpo.study.decide import (
        decide_file,
        decisions_markdown,
        load_decisions,
        render_block,
        short_verdict,
    )

    spec = load_decisions(DOCS / "literature" / "decisions.yaml")
    decided = decide_file(spec)
    text = PAGE.read_text(encoding="utf-8")
    assert render_block(text, decisions_markdown(decided, spec.alpha)) == text, (
        "the decisions block is stale: python -m klpo.study.decide docs/literature/decisions.yaml"
    )
    rows = {_row_ids(r[0])[0]: r for r in _table_rows(_section(text, "## The verdicts"))}
    backed: dict[tuple[str, str], set[str]] = {}
    for d in decided:
        c, words = d.claimed, d.decision.verdict
        cell = rows[c.id.lower().replace(".", "")][COLUMN[c.model]]
        short = short_verdict(words)
        assert f"**{short}**" in cell, (c.id, c.model, short, cell)
        backed.setdefault((c.id.lower().replace(".", ""), c.model), set()).add(short)
        if short == "not decided" and d.decision.seeds is not None:  # "about 15 seeds", "15 and 72"
            assert re.search(rf"about (\d+ and )?{d.decision.seeds}\b[^|]*seeds", cell), (
                c.id,
                c.what,
                d.decision.seeds,
            )
    for rid, row in rows.items():
        for model, col in COLUMN.items():
            for word in _bold(row[col]):
                if word in ("holds", "differs"):
                    assert word in backed.get((rid, model), set()), (rid, model, word)


@pytest.mark.parametrize("name", ["literature.md", "choosing.md"])
def test_links_and_anchors_resolve(name: str) -> None:
    page = DOCS / name
    text = page.read_text(encoding="utf-8")
    links = [m for m in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", m)]
    assert links
    for link in links:
        path, _, frag = link.partition("#")
        target = (page.parent / path) if path else page
        assert target.exists(), f"{name}: {link} does not exist"
        if frag and target.suffix == ".md":
            assert frag in _anchors(target.read_text(encoding="utf-8")), f"{name}: {link}"


def test_choosing_ties_its_recommendations_to_rows() -> None:
    text = (DOCS / "choosing.md").read_text(encoding="utf-8")
    cited = set(re.findall(r"\(literature\.md#([a-z0-9]+)\)", text))
    assert {"rb1", "tm1", "tm2", "shah1", "prorl", "gao2"} <= cited


def test_the_gao_table_is_the_committed_fit() -> None:
    text = PAGE.read_text(encoding="utf-8")
    table = _table_rows(_section(text, "## The Gao et al. fit"))
    forms = {"d(α − β log d)": "rl", "d(α − β d)": "bon"}
    page = {(r[0], forms[r[1]]): r for r in table if r[1] in forms}
    with (DOCS / "literature" / "gao" / "fits.csv").open(encoding="utf-8") as f:
        fits = list(csv.DictReader(f))
    assert len(page) == len(fits) == 12
    for fit in fits:
        row = page[(fit["choice"].removeprefix("grpo "), fit["form"])]
        for col, key in ((3, "alpha"), (4, "beta")):
            mean, sd = (float(x) for x in row[col].split(" ± "))
            assert mean == pytest.approx(float(fit[key]), abs=5e-4)
            assert sd == pytest.approx(float(fit[f"sd_{key}"]), abs=5e-4)
        assert float(row[8]) == pytest.approx(float(fit["chi2_bin"]), rel=5e-3, abs=0.05)
    assert (DOCS / "literature" / "gao" / "gao.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("preset", "task", "runs"),
    [("placements", "overopt", 12), ("gao", "overopt", 39), ("prorl", "builtin", 10)],
)
def test_the_presets_beside_the_page_hold_the_runs_it_names(
    preset: str, task: str, runs: int
) -> None:
    study = load_study(DOCS / "literature" / preset / "study.yaml", task=task)
    assert len(study_grid(study)) == runs
    assert f"docs/literature/{preset}/study.yaml" in PAGE.read_text(encoding="utf-8")
