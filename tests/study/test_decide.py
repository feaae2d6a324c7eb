"""klpo.study.decide: a page's comparisons read from archives written by hand, tested, corrected
over the page's family and written between the page's markers."""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from pathlib import Path

import pytest

from klpo.study.decide import (
    BEGIN,
    END,
    Claimed,
    DecisionFile,
    decide_file,
    decisions_markdown,
    load_decisions,
    main,
    render_block,
    seed_values,
    short_verdict,
    verdicts_by_row,
)
from klpo.study.seeds import holm, paired_test, welch_test

FIELDS = ["name", "algo", "choice", "beta", "seed", "acc_final", "gold_final", "gold_peak"]


def _archive(root: Path, name: str, cells: dict[tuple[str, float], list[float]], **extra) -> None:
    """results.csv of ``cells`` ({(choice, beta): acc_final per seed}), and with ``extra``
    per-step metrics of each run (gzipped, as archive.py keeps them)."""
    d = root / name
    d.mkdir(parents=True)
    rows = []
    for (choice, beta), values in cells.items():
        for seed, v in enumerate(values):
            run = f"grpo_{choice.replace(' ', '-')}_b{beta:g}_s{seed}"
            rows.append(
                {"name": run, "algo": "grpo", "choice": choice, "beta": beta, "seed": seed,
                 "acc_final": v, "gold_final": v / 2, "gold_peak": v}
            )  # fmt: skip
            if "metrics" in extra:
                (d / "runs" / run).mkdir(parents=True)
                lines = "".join(json.dumps(m) + "\n" for m in extra["metrics"](choice, seed, v))
                (d / "runs" / run / "metrics.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    with (d / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)


def _claim(**kw) -> Claimed:
    base = dict(id="X", what="w", a="full loss @ 0.1", b="no KL", archives=["one"])
    return Claimed(**{**base, **kw})


def test_pairs_within_each_archive_and_pool_them(tmp_path: Path) -> None:
    _archive(tmp_path, "one", {("full loss", 0.1): [0.5, 0.6, 0.7], ("no KL", 0.0): [0.4, 0.4]})
    _archive(tmp_path, "two", {("full loss", 0.1): [0.3], ("no KL", 0.0): [0.1]})
    xs, ys = seed_values(_claim(archives=["one", "two"]), tmp_path)
    # archive "one"'s third run (seed=2) has no no-KL partner: dropped; archive "two"'s run with
    # seed=0 is another run, kept
    assert (xs, ys) == ([0.5, 0.6, 0.3], [0.4, 0.4, 0.1])
    welch = seed_values(_claim(archives=["one", "two"], paired=False), tmp_path)
    assert welch == ([0.5, 0.6, 0.7, 0.3], [0.4, 0.4, 0.1])
    one = seed_values(_claim(b=None), tmp_path)
    assert one == ([0.5, 0.6, 0.7], [0.0, 0.0, 0.0])
    peak = seed_values(_claim(metric="gold_final", b_metric="gold_peak"), tmp_path)
    assert peak == ([0.25, 0.3], [0.4, 0.4])


def test_b_in_another_archive_pairs_by_seed(tmp_path: Path) -> None:
    _archive(tmp_path, "main", {("full loss", 0.05): [0.25, 0.27, 0.29]})
    _archive(tmp_path, "control", {("no KL (no skip)", 0.0): [0.24, 0.15, 0.24]})
    c = _claim(a="full loss @ 0.05", b="no KL (no skip)", archives=["main"], b_archives=["control"])
    assert seed_values(c, tmp_path) == ([0.25, 0.27, 0.29], [0.24, 0.15, 0.24])
    with pytest.raises(ValueError, match="one archive per archive"):
        seed_values(c.model_copy(update={"b_archives": ["control", "main"]}), tmp_path)
    with pytest.raises(
        ValueError, match=r"no runs of cell grpo: 'k3 loss @ 0.05'.*full loss @ 0.05"
    ):
        seed_values(c.model_copy(update={"a": "k3 loss @ 0.05"}), tmp_path)


def test_heldout_at_a_step_from_the_archived_metrics(tmp_path: Path) -> None:
    def metrics(choice, seed, v):
        return [{"step": 0, "accuracy/heldout": 0.1}, {"step": 12, "accuracy/heldout": v - 0.1},
                {"step": 24, "accuracy/heldout": v}]  # fmt: skip

    _archive(tmp_path, "one", {("full loss", 0.1): [0.5, 0.6], ("no KL", 0.0): [0.3, 0.2]},
             metrics=metrics)  # fmt: skip
    c = _claim(source="heldout", step=12)
    xs, ys = seed_values(c, tmp_path)
    assert xs == pytest.approx([0.4, 0.5]) and ys == pytest.approx([0.2, 0.1])
    with pytest.raises(ValueError, match="needs step"):
        seed_values(_claim(source="heldout"), tmp_path)


def test_offset_against_the_baseline_at_the_same_d(tmp_path: Path) -> None:
    # no KL: gold 0.1 at KL 0.25 (d 0.5) and 0.3 at KL 1 (d 1), 3 seeds x 2 steps each;
    # full loss: after step 1, the run with seed=0 at d 0.5 with gold 0.15 (offset +0.05), seed=1 at d 1
    # with gold 0.2 (offset -0.1); its step 1 (gold 0.9) is before after_step and not counted
    def metrics(choice, seed, v):
        if choice == "no KL":
            return [{"step": 1, "reward/gold": 0.1, "kl/ref/seq": 0.25},
                    {"step": 2, "reward/gold": 0.3, "kl/ref/seq": 1.0}]  # fmt: skip
        kl, gold = [(0.25, 0.15), (1.0, 0.2)][seed]
        return [{"step": 1, "reward/gold": 0.9, "kl/ref/seq": kl},
                {"step": 2, "reward/gold": gold, "kl/ref/seq": kl}]  # fmt: skip

    _archive(tmp_path, "one", {("full loss", 0.1): [0.5, 0.5], ("no KL", 0.0): [0.1, 0.1, 0.1]},
             metrics=metrics)  # fmt: skip
    c = _claim(b=None, source="offset", after_step=1, width=0.05, min_points=3)
    xs, ys = seed_values(c, tmp_path)
    assert xs == pytest.approx([0.05, -0.1]) and ys == [0.0, 0.0]
    # a window with fewer baseline points than min_points: no offset for that step
    assert seed_values(c.model_copy(update={"min_points": 4}), tmp_path) == ([], [])


def test_the_family_is_corrected_together(tmp_path: Path) -> None:
    _archive(
        tmp_path,
        "one",
        {("full loss", 0.1): [0.5, 0.61, 0.7], ("k3 loss", 0.1): [0.2, 0.3, 0.35],
         ("no KL", 0.0): [0.1, 0.2, 0.31]},
    )  # fmt: skip
    spec = DecisionFile(
        page="p.md",
        comparisons=[
            _claim(id="A", claim=">"),
            _claim(id="B", a="k3 loss @ 0.1", claim="="),
            _claim(id="C", a="k3 loss @ 0.1", b="full loss @ 0.1", paired=False),
        ],
    )
    rows = decide_file(spec, tmp_path)
    tests = [
        paired_test([0.5, 0.61, 0.7], [0.1, 0.2, 0.31]),
        paired_test([0.2, 0.3, 0.35], [0.1, 0.2, 0.31]),
        welch_test([0.2, 0.3, 0.35], [0.5, 0.61, 0.7]),
    ]
    for row, test, adjusted in zip(rows, tests, holm([t.p for t in tests]), strict=True):
        assert row.decision.test.p == pytest.approx(test.p)
        assert row.decision.p_holm == pytest.approx(adjusted)
    # A: d = 0.40, 0.41, 0.39: t = 69.3, p = 2e-4 x 3 = 6e-4: the claim holds
    assert short_verdict(rows[0].decision.verdict) == "holds"
    assert verdicts_by_row(rows)["B"][0].startswith("not decided")
    table = decisions_markdown(rows, 0.05)
    assert "Holm's correction over all 3 of them" in table
    assert "| C | built-in |" in table and "| 3, 3 W |" in table


def test_the_block_between_the_markers(tmp_path: Path) -> None:
    page = f"# Page\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    assert render_block(page, "new\n") == f"# Page\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"
    with pytest.raises(ValueError, match="no <!-- decisions: begin -->"):
        render_block("# Page\n", "new\n")


def test_main_writes_and_checks(tmp_path: Path, capsys) -> None:
    docs = tmp_path / "docs"
    _archive(docs, "one", {("full loss", 0.1): [0.5, 0.6, 0.7], ("no KL", 0.0): [0.1, 0.2, 0.3]})
    (docs / "page.md").write_text(f"# P\n{BEGIN}\n{END}\n")
    spec = docs / "decisions.yaml"
    spec.write_text(
        "page: page.md\ncomparisons:\n  - {id: A, what: w, a: full loss @ 0.1, b: no KL, "
        "archives: [one], claim: '>'}\n"
    )
    args = [str(spec), "--root", str(docs)]
    assert main([*args, "--check"]) == 1
    assert main(args) == 0
    assert "A: w: holds" in capsys.readouterr().out
    assert main([*args, "--check"]) == 0
    assert "| A | built-in | w (claim: A > B) |" in (docs / "page.md").read_text()
    spec.write_text("page: page.md\ncomparisons:\n  - {id: A, a: full loss @ 0.1}\n")
    with pytest.raises(ValueError, match=r"comparisons\.0\.what: Field required"):
        load_decisions(spec)


def test_the_cells_must_be_written_as_a_spec_writes_them() -> None:
    with pytest.raises(ValueError, match="must be a number"):
        _claim(a="full loss @ high")
    assert math.isnan(paired_test([], []).p)


DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [
    "literature/decisions.yaml",
    "study-real/decisions.yaml",
    "study-real/overopt-decisions.yaml",
    "study-stale/decisions.yaml",
    "study-overopt/decisions.yaml",
]


@pytest.mark.parametrize("name", PAGES)
def test_the_committed_pages_carry_their_decisions(name: str) -> None:
    """Each page's table of decisions is the one its archives give now, and its prose uses no
    verdict the table does not back: no "beats" or "reproduced", and a bold **holds** or
    **differs** only where some comparison of the page is decided so."""
    spec_path = DOCS / name
    assert main([str(spec_path), "--check"]) == 0, f"stale: python -m klpo.study.decide {name}"
    spec = load_decisions(spec_path)
    text = (spec_path.parent / spec.page).read_text(encoding="utf-8")
    prose = text.split(BEGIN)[0] + text.split(END)[1]
    assert not re.search(r"\b[Rr]eproduced\b|\bbeats\b", prose)
    decided = {short_verdict(r.decision.verdict) for r in decide_file(spec)}
    for word in ("holds", "differs"):
        if f"**{word}**" in prose or f"**{word}:" in prose:
            assert word in decided, (name, word)


def test_a_studys_primary_comparisons_are_their_own_family(tmp_path: Path) -> None:
    _archive(
        tmp_path,
        "one",
        {("full loss", 0.1): [0.5, 0.61, 0.7], ("k3 loss", 0.1): [0.2, 0.3, 0.35],
         ("no KL", 0.0): [0.1, 0.2, 0.31]},
    )  # fmt: skip
    primary = "primary: one"
    spec = DecisionFile(
        page="p.md",
        comparisons=[
            _claim(id="A", family=primary),
            _claim(id="B", a="k3 loss @ 0.1"),
            _claim(id="C", a="k3 loss @ 0.1", b="full loss @ 0.1", family=primary),
        ],
    )
    rows = decide_file(spec, tmp_path)
    a = paired_test([0.5, 0.61, 0.7], [0.1, 0.2, 0.31])
    b = paired_test([0.2, 0.3, 0.35], [0.1, 0.2, 0.31])
    c = paired_test([0.2, 0.3, 0.35], [0.5, 0.61, 0.7])
    assert [r.decision.p_holm for r in rows] == pytest.approx(
        [holm([a.p, c.p])[0], b.p, holm([a.p, c.p])[1]]
    )
    table = decisions_markdown(rows, 0.05)
    assert "over the page's 1 exploratory ones" in table and "(primary: one)" in table
    assert "(primary: one, named before the runs)" in table
    with pytest.raises(ValueError, match="family must be"):
        _claim(family="main")
