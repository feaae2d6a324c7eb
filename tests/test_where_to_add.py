"""docs/architecture.md's "Where to add", performed for the recipes the trainer's tests do not
perform: a lab experiment, a study preset, a metric; and every test the section names exists.

Each recipe is followed in a scratch way (``monkeypatch`` on a table or a function, a file in a
temporary folder) and the layer that reads it is run: the lab's quick suite, the study's loader
and grid with the trainer's config, the metrics' documentation and its generated page. The
algorithm, policy loss, engine and reward recipes are performed by
``tests/train/test_where_to_add.py``, the estimator's by ``tests/train/test_estimator_registry.py``,
a framework's by ``tests/doctor/test_registry.py``.
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"

P, Q = (0.7, 0.2, 0.1), (0.5, 0.3, 0.2)  # the lab's categorical oracle pair


def _scratch_experiment(p: tuple[float, ...], q: tuple[float, ...]) -> dict:
    """A made-up experiment: KL(p ‖ q) and KL(q ‖ p) of two categoricals, in float64 by torch."""
    import torch

    pt, qt = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    return {
        "kl_pq": float((pt * (pt / qt).log()).sum()),
        "kl_qp": float((qt * (qt / pt).log()).sum()),
    }


def _scratch_section(r: dict) -> list[str]:
    s = r["scratch"]
    return [
        "## Scratch experiment\n",
        f"KL(p ‖ q) = {s['kl_pq']:.6f}, KL(q ‖ p) = {s['kl_qp']:.6f}\n",
    ]


@pytest.mark.slow
def test_a_lab_experiment_joins_the_report(tmp_path, monkeypatch):
    """The recipe: the experiment's function, its name in PARTS, its call in _run_experiments,
    its section in render's list. The quick suite then runs it (timed and reported like the
    others) and writes its numbers to results.json and its section to report.md."""
    from klpo.lab import report

    run_before = report._run_experiments
    render_before = report.render

    def run_experiments(results, preset, seed, step, timed):
        run_before(results, preset, seed, step, timed)
        results["scratch"] = timed("scratch", lambda: _scratch_experiment(P, Q))

    monkeypatch.setitem(report.PARTS, "scratch", "scratch experiment")
    monkeypatch.setattr(report, "_run_experiments", run_experiments)
    monkeypatch.setattr(
        report, "render", lambda r: render_before(r) + "\n".join(_scratch_section(r))
    )
    seen: list[str] = []
    report.run_report(
        tmp_path, report.PRESETS["quick"], seed=0, progress=lambda _, what: seen.append(what)
    )

    # The oracle, by hand: sum p log(p / q) and sum q log(q / p).
    kl_pq = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(0.1 / 0.2)
    kl_qp = 0.5 * math.log(0.5 / 0.7) + 0.3 * math.log(0.3 / 0.2) + 0.2 * math.log(0.2 / 0.1)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["scratch"]["kl_pq"] == pytest.approx(kl_pq, rel=1e-12)
    assert results["scratch"]["kl_qp"] == pytest.approx(kl_qp, rel=1e-12)
    assert "scratch" in results["timings_s"] and "scratch experiment" in seen
    assert results["schulman"] and results["drift"]  # the suite's own experiments still ran
    page = (tmp_path / "report.md").read_text()
    assert f"KL(p ‖ q) = {kl_pq:.6f}" in page.split("## Scratch experiment")[1]


def test_a_study_preset_is_a_yaml_file(tmp_path):
    """A study file (StudyConfig's keys) merged over the built-in task's preset: its grid is the
    product of its choices, betas and seeds, each run's overrides a valid trainer config with
    the choice's estimator, placement and beta; a misspelt key is refused, the file named."""
    from klpo.study.grid import study_grid
    from klpo.study.spec import load_study
    from klpo.train.config import ConfigError, build_config

    preset = tmp_path / "scratch.yaml"
    preset.write_text(
        "choices:\n"
        "  - {estimator: k3, placement: loss}\n"
        "  - {estimator: k1, placement: reward, variant: scratch}\n"
        "  - {estimator: k3, placement: none}\n"
        "betas: [0.05, 0.2]\n"
        "seeds: [3, 4]\n"
        "steps: 7\n"
        "base: {rollout.group_size: 2}\n"
    )
    study = load_study(preset)
    assert study.eval_every == load_study(None).eval_every  # the preset's keys kept
    runs = study_grid(study)
    # 2 choices × 2 betas × 2 seeds, and the no-KL choice at beta 0 × 2 seeds.
    assert len(runs) == 10 and len({r.name for r in runs}) == 10
    assert sorted({r.choice for r in runs}) == ["k1 (scratch) reward", "k3 loss", "no KL"]
    for run in runs:
        cfg = build_config(overrides=[*run.overrides, f"run.out_dir={tmp_path / 'unused'}"])
        assert cfg.run.steps == 7 and cfg.rollout.group_size == 2 and cfg.run.seed == run.seed
        assert cfg.kl.placement == run.placement
        if run.placement != "none":
            assert (cfg.kl.estimator, cfg.kl.beta) == (run.estimator, run.beta)

    preset.write_text("betass: [0.1]\n")
    with pytest.raises(
        ConfigError, match=r"(?s)bad study file '.*scratch\.yaml'.*betass: Extra inputs"
    ):
        load_study(preset)


def test_a_metric_is_documented_once(monkeypatch):
    """A metric's key and its one line in METRICS: the key is described (a ``<...>`` family
    covers its members), the generated page has its row, and a key nobody documented is
    refused with where to document it."""
    from klpo.train.runtime import metrics
    from klpo.train.tools.docs import metrics_page

    monkeypatch.setitem(metrics.METRICS, "scratch/tokens", "tokens of the scratch metric")
    monkeypatch.setitem(metrics.METRICS, "scratch/<part>", "one part of the scratch metric")
    assert metrics.describe("scratch/tokens") == "tokens of the scratch metric"
    assert metrics.describe("scratch/head") == "one part of the scratch metric"
    page = metrics_page()
    assert "| `scratch/tokens` | tokens of the scratch metric |" in page
    assert "| `scratch/<part>` | one part of the scratch metric |" in page
    with pytest.raises(KeyError, match=r"document it in klpo\.train\.runtime\.metrics\.METRICS"):
        metrics.describe("undocumented/scratch")


def _where_to_add() -> str:
    text = PAGE.read_text(encoding="utf-8")
    return text.split("## Where to add", 1)[1].split("\n## ", 1)[0]


def test_every_recipe_names_a_test_that_exists():
    """Each ``tests/...py`` and ``tests/...py::test_name`` the section names is there."""
    named = re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?`", _where_to_add())
    assert len({path for path, _ in named}) >= 6, named
    for path, name in named:
        file = ROOT / path
        assert file.is_file(), f"docs/architecture.md names {path}, which does not exist"
        if name:
            defined = {
                n.name for n in ast.parse(file.read_text(encoding="utf-8")).body
                if isinstance(n, ast.FunctionDef)
            }  # fmt: skip
            assert name in defined, f"docs/architecture.md names {path}::{name}, not defined there"
    recipes = re.findall(r"^- \*\*(.+?)\*\*", _where_to_add(), flags=re.M)
    for recipe in (
        "A KL estimator",
        "A framework to the doctor",
        "A lab experiment",
        "A study preset",
        "A reward function",
        "A metric",
    ):
        assert recipe in recipes, recipe
