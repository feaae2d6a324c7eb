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
VERDICTS = ("reproduced", "not reproduced", "mostly not reproduced", "out of reach")
REAL_VERDICTS = ("holds", "differs", "not decided")  # the real-model column's


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


def test_every_claim_has_a_section_a_verdict_and_what_would_change_it() -> None:
    text = PAGE.read_text(encoding="utf-8")
    rows = _table_rows(_section(text, "## The verdicts"))
    ids = [_row_ids(r[0])[0] for r in rows]
    assert len(ids) == len(set(ids)) >= 25
    for row, rid in zip(rows, ids, strict=True):
        assert len(row) == 7 and all(row), row  # id, paper, claim, setting, measured, verdict,
        assert row[5].startswith(VERDICTS), (rid, row[5])  # and the real model's verdict
        real = re.fullmatch(r".*\*\*([^*]+)\*\*", row[6])
        assert real and real[1].startswith(REAL_VERDICTS), (rid, row[6])
        section = text[text.index(f'<a id="{rid}"></a>') :]
        section = section[: section.find("<a id=", 1) if "<a id=" in section[1:] else None]
        assert re.search(r"\*\*(Reproduced|Not reproduced|Out of reach|Mostly not)", section), rid
    changes = _table_rows(_section(text, "## What would change each verdict"))
    covered = {i for r in changes for i in _row_ids(r[0])}
    assert covered == set(ids)
    assert not re.search(r"\b(TODO|TBD|FIXME|XXX)\b", text)


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
