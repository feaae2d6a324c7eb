"""docs/study-stale/summary.py: the staleness study's table over its archived lags, checked
against numbers written by hand into two tiny archives."""

from __future__ import annotations

import csv
import doctest
import gzip
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def summary():
    spec = importlib.util.spec_from_file_location("summary", ROOT / "docs/study-stale/summary.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study(root: Path, lag: int, runs: list[dict], metrics: dict[str, list[dict]]) -> None:
    d = root / f"stale-{lag}"
    (d / "runs").mkdir(parents=True)
    base = f"base:\n  rollout.staleness: {lag}\n" if lag else "base: {}\n"
    (d / "study.yaml").write_text(base)
    with (d / "results.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, ["name", "choice", "status", "acc_start", "acc_final",
                               "kl_exact_final"])  # fmt: skip
        w.writeheader()
        w.writerows(runs)
    for name, rows in metrics.items():
        (d / "runs" / name).mkdir()
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (d / "runs" / name / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))


def _run(name, choice, acc, kl, status="ok"):
    return {"name": name, "choice": choice, "status": status, "acc_start": 0.3,
            "acc_final": acc, "kl_exact_final": kl}  # fmt: skip


def test_cells_pool_seeds_and_average_each_runs_diagnostics(tmp_path, summary):
    _study(tmp_path, 0, [_run("a0", "no KL", 0.5, 0.2), _run("a1", "no KL", 0.4, 0.3)], {})
    stale = [
        _run("b0", "full loss", 0.6, 0.1),
        _run("b1", "full loss", 0.4, 0.3),
        _run("b2", "full loss", 0.0, 9.0, status="diverged"),
    ]
    metrics = {  # run b0: two steps; b1: one; a step 0 row without diagnostics
        "b0": [{"step": 0}, {"sampler/ess": 0.9, "sampler/m2": 0.02},
               {"sampler/ess": 0.7, "sampler/m2": 0.04}],
        "b1": [{"sampler/ess": 0.5, "sampler/m2": 0.1}],
    }  # fmt: skip
    _study(tmp_path, 2, stale, metrics)
    found = summary.cells(tmp_path)
    assert [(c["choice"], c["lag"]) for c in found] == [("no KL", 0), ("full loss", 2)]
    lag0, lag2 = found
    assert lag0["acc"] == [0.5, 0.4] and lag0["failed"] == 0
    assert pytest.approx(lag2["sampler/ess"]) == (0.8 + 0.5) / 2  # each run's mean, then seeds'
    assert pytest.approx(lag2["sampler/m2"]) == (0.03 + 0.1) / 2
    assert lag2["seeds"] == 2 and lag2["failed"] == 1 and lag2["acc"] == [0.6, 0.4]
    text = summary.table(found)
    assert "| no KL | 0 | 2 | 0.450 ± 0.071 | 0.250 | 0/2 | – |" in text
    assert "| full loss | 2 | 2 | 0.500 ± 0.141 | 0.200 | 1/3 | 0.650 | 0.0650 |" in text


def test_a_collapsed_run_counts_in_the_means_and_as_failed(tmp_path, summary):
    """On the over-optimisation task a collapse is the outcome measured: the run ran every step,
    so its accuracy and KL are averaged with the others, and it is counted as failed."""
    runs = [_run("c0", "no KL", 0.5, 0.2), _run("c1", "no KL", 0.1, 4.0, status="collapsed")]
    _study(tmp_path, 4, runs, {})
    (cell,) = summary.cells(tmp_path)
    assert cell["acc"] == [0.5, 0.1] and cell["kl"] == [0.2, 4.0]
    assert cell["seeds"] == 2 and cell["failed"] == 1
    assert "| no KL | 4 | 2 | 0.300 ± 0.283 | 2.100 | 1/2 | – |" in summary.table([cell])


def test_doctests(summary):
    assert doctest.testmod(summary, raise_on_error=False).failed == 0
