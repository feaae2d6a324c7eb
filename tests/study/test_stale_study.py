"""configs/studies/stale*.yaml: the staleness study's grid, each run a valid trainer config."""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.study.grid import study_grid
from klpo.study.spec import load_study
from klpo.train.config import build_config

STUDIES = Path(__file__).resolve().parents[2] / "configs" / "studies"


@pytest.mark.parametrize("lag", [0, 1, 2, 4])
def test_the_staleness_study_at_each_lag(lag):
    files = [STUDIES / "stale.yaml"] + ([STUDIES / f"stale-{lag}.yaml"] if lag else [])
    runs = study_grid(load_study(files))
    assert len(runs) == 15 and len({r.name for r in runs}) == 15
    labels = sorted({r.choice for r in runs})
    assert labels == ["full loss", "k3 (IS) loss", "k3 (no IS) loss", "no KL", "no KL (sampler k2)"]
    for run in runs:
        cfg = build_config(overrides=[*run.overrides, "run.out_dir=/tmp/unused"])
        assert cfg.rollout.staleness == lag
        if run.choice == "no KL (sampler k2)":
            assert cfg.algo.policy_loss == "dppo-tv-k2" and cfg.kl.placement == "none"
        if run.choice.startswith("k3 ("):
            want = "none" if "no IS" in run.choice else "is"
            assert cfg.kl.behaviour_correction == want
