"""The over-optimisation task: its proxy by hand, its config defaults, gold/proxy metrics in a
run, the study's gold columns by hand, and `klpo compare --task overopt --quick` end to end."""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys

import pytest

from klpo.train import loop
from klpo.train.compare import (
    _gold_summary,
    load_study,
    quick_overopt_study,
    study_grid,
)
from klpo.train.config import build_config
from klpo.train.metrics import read_metrics
from klpo.train.overopt import eval_reward, overopt_proxy


def test_proxy_hand():
    # answer 85: "85" -> 1 + 0.5·2/8 = 1.125; "8517" -> 1 + 0.5·4/8 = 1.25; "84" -> 0.125;
    # "" -> 0; " 85 " stripped -> 1.125; "123456789" -> 0 + 0.5 (length capped at 8)
    got = overopt_proxy([""] * 6, ["85", "8517", "84", "", " 85 ", "123456789"], ["85"] * 6)
    assert got == [1.125, 1.25, 0.125, 0.0, 1.125, 0.5]


def test_builtin_overopt_defaults_and_overrides():
    cfg = build_config(overrides=["data.source=builtin-overopt"])
    assert [t.name for t in cfg.rewards] == ["overopt_proxy"]
    assert cfg.gold_reward == "exact_match" and cfg.rollout.max_new_tokens == 8
    assert eval_reward(cfg) == "exact_match"
    given = build_config(
        overrides=[
            "data.source=builtin-overopt",
            "rewards=[{name: format}]",
            "rollout.max_new_tokens=6",
            "gold_reward=numeric",
        ]
    )
    assert [t.name for t in given.rewards] == ["format"] and given.gold_reward == "numeric"
    assert given.rollout.max_new_tokens == 6
    assert build_config().gold_reward is None


def test_a_run_logs_gold_and_proxy(tiny_model, quick, tmp_path):
    cfg = build_config(
        overrides=quick(
            tiny_model,
            tmp_path / "run",
            **{"data.source": "builtin-overopt", "rewards": "[{name: overopt_proxy}]"},
            **{"run.steps": 2, "run.eval_every": 0},
        )
    )
    loop.train(cfg, log=lambda *_: None)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for r in rows[1:]:
        assert r["reward/proxy"] == pytest.approx(r["reward/mean"])
        assert 0.0 <= r["reward/gold"] <= 1.0
        # the proxy pays a right answer at least 1, so it is never below the gold rate
        assert r["reward/proxy"] >= r["reward/gold"]


def test_gold_summary_by_hand():
    # 12 steps: gold rises to 0.6 then falls; WINDOW = 10 running means over 3 windows:
    # gold windows: mean(0.1..) ... computed below by hand with fsum over the slices.
    gold = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.5, 0.4, 0.3, 0.0, 0.0]
    seq = [float(i) for i in range(12)]
    rows = [
        {"step": i + 1, "reward/gold": g, "reward/proxy": 1.0 + i, "kl/ref/seq": k}
        for i, (g, k) in enumerate(zip(gold, seq, strict=True))
    ]
    got = _gold_summary(rows)
    # windows [0:10] mean 3.9/10 = 0.39, [1:11] 3.8/10 = 0.38, [2:12] 3.6/10 = 0.36: peak 0.39,
    # whose seq-KL mean is mean(0..9) = 4.5; the final values are the last 10 steps' means.
    assert got["gold_peak"] == pytest.approx(0.39)
    assert got["gold_peak_kl_seq"] == pytest.approx(4.5)
    assert got["gold_final"] == pytest.approx(0.36)
    assert got["proxy_final"] == pytest.approx(sum(range(3, 13)) / 10)
    assert got["kl_seq_final"] == pytest.approx(sum(range(2, 12)) / 10)
    assert all(math.isnan(v) for k, v in _gold_summary(rows[:0]).items())


def test_overopt_grid_uses_the_task():
    grid = study_grid(load_study(quick=True, task="overopt"))
    assert all('data.source="builtin-overopt"' in r.overrides for r in grid)
    full = study_grid(load_study(task="overopt"))
    labels = {r.choice for r in full}
    assert {"no KL", "full reward+loss", "k3 reward+loss"} <= labels
    with pytest.raises(ValueError, match="unknown task"):
        load_study(task="nope")


@pytest.mark.slow
def test_compare_task_overopt_quick_end_to_end(tmp_path):
    """`klpo compare --task overopt --quick`: every run finishes and reports gold and proxy."""
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "klpo", "compare", "--task", "overopt", "--quick", "--out",
           str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(study_grid(quick_overopt_study()))
    for r in rows:
        assert r["status"] in ("ok", "collapsed"), (r["name"], r["error"])
        assert int(r["steps_done"]) == quick_overopt_study().steps
        assert 0 <= float(r["gold_final"]) <= 1 <= 1 + float(r["proxy_final"])
        assert float(r["proxy_final"]) >= float(r["gold_final"])
    report = (out / "report.md").read_text()
    assert "## Over-optimisation: gold against proxy reward" in report
