"""A study's primary comparisons, named in its spec before the runs, and the order runs start in."""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.study.grid import study_grid
from klpo.study.runner import seed_major
from klpo.study.spec import Comparison, load_study, parse_cell
from klpo.train.config import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_cells_are_written_label_at_beta() -> None:
    assert parse_cell("full loss @ 0.1") == ("full loss", 0.1)
    assert parse_cell("  no   KL ") == ("no KL", None)
    assert parse_cell("k3+ loss@0.05") == ("k3+ loss", 0.05)
    with pytest.raises(ValueError, match="must be a number"):
        parse_cell("full loss @ high")
    with pytest.raises(ValueError, match="names no choice"):
        parse_cell("@ 0.1")


def test_a_comparison_must_name_cells_of_the_grid(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("betas: [0.1]\ncomparisons:\n  - {a: full loss @ 0.2, b: no KL}\n")
    with pytest.raises(
        ConfigError, match=r"'full loss @ 0.2' is not in the study's grid.*'full loss @ 0.1'"
    ):
        load_study(spec, task="chat-arith")
    spec.write_text("betas: [0.1]\nadded_after: [k9 loss @ 0.1]\n")
    with pytest.raises(ConfigError, match="not in the study's grid"):
        load_study(spec, task="chat-arith")


@pytest.mark.parametrize("name", ["real-decide", "real-k3-spikes"])
def test_the_shipped_decisive_studies_name_their_comparisons(name: str) -> None:
    study = load_study(REPO / "configs" / "studies" / f"{name}.yaml", task="chat-arith")
    assert len(study.comparisons) == 4
    assert all(isinstance(c, Comparison) for c in study.comparisons)
    assert study.cpu_hours is not None and len(study.seeds) >= 6


def test_runs_start_seed_by_seed() -> None:
    study = load_study(REPO / "configs" / "studies" / "real-decide.yaml", task="chat-arith")
    runs = study_grid(study.model_copy(update={"model": None}))
    order = [runs[i] for i in seed_major(runs, study.seeds)]
    cells = len(study.cells())
    # every cell's first seed before any cell's second: a study stopped early is balanced
    assert [r.seed for r in order] == [s for s in study.seeds for _ in range(cells)]
    assert sorted(r.name for r in order) == sorted(r.name for r in runs)
