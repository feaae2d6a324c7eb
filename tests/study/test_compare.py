"""`klpo compare`: the grid, the per-run summary (against hand-made metrics), the report, errors,
and one real `--quick` study end to end."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.spec import Choice, StudyConfig, load_study, quick_study
from klpo.study.summary import Criteria, summarise_cells, summarise_run
from klpo.train.config import ConfigError, apply_overrides, build_config

HERE = Path(__file__).resolve().parent


def test_default_grid_covers_the_issue_and_each_run_is_a_valid_config():
    study = StudyConfig()
    runs = study_grid(study)
    labels = {(r.algo, r.choice) for r in runs}
    for choice in [
        "k1 reward",
        "k2 loss",
        "k3 loss",
        "k3+ loss",
        "k3_is loss",
        "full loss",
        "full reward",
        "no KL",
        "ref_is loss",
        "ref_is (clip 0.1-10) loss",
        "adaptive_mix (as written) loss",
        "adaptive_mix (as described) loss",
    ]:
        assert ("grpo", choice) in labels
    for algo in ("grpo", "ppo"):
        for choice in ("k1 reward", "full reward", "full reward+loss", "k3 reward+loss"):
            assert (algo, choice) in labels
    # 13 KL choices × 2 betas × 3 seeds + no KL × 3 seeds for GRPO; 4 × 2 × 3 for PPO.
    assert len(runs) == 13 * 2 * 3 + 3 + 4 * 2 * 3
    assert len({r.name for r in runs}) == len(runs)
    for r in runs:
        cfg = build_config(apply_overrides({}, list(r.overrides)))
        assert cfg.algo.name == r.algo and cfg.kl.estimator == r.estimator
        assert cfg.kl.placement == r.placement and cfg.kl.beta == r.beta
        assert cfg.run.seed == r.seed and cfg.run.threads == 1 and cfg.run.steps == study.steps
        assert cfg.kl.controller == "fixed"
        if r.choice == "ref_is (clip 0.1-10) loss":
            assert cfg.kl.ref_is_clip == (0.1, 10.0)
        if r.estimator == "adaptive_mix":
            assert cfg.kl.mix_sign == r.choice.split("(")[1].split(")")[0].replace(" ", "-")
        if r.algo == "ppo":
            assert cfg.rollout.group_size == 4 and cfg.algo.epochs == 2


def test_study_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="unknown estimator 'k4'"):
        Choice(estimator="k4", placement="loss")
    with pytest.raises(ValueError, match="positive"):
        StudyConfig(betas=[0.0])
    bad = tmp_path / "study.yaml"
    bad.write_text("seeds: []\n")
    with pytest.raises(ConfigError, match="seeds"):
        load_study(bad)
    bad.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match="stepz"):
        load_study(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_study(tmp_path / "missing.yaml")
    twice = StudyConfig(choices=[Choice(estimator="k3", placement="loss")] * 2)
    with pytest.raises(ConfigError, match="same choice twice"):
        study_grid(twice)
    good = tmp_path / "good.yaml"
    good.write_text("seeds: [5]\nsteps: 7\n")
    s = load_study(good, quick=True)
    assert s.seeds == [5] and s.steps == 7 and s.betas == quick_study().betas


def _run(**kw) -> Run:
    base = dict(
        name="r",
        algo="grpo",
        choice="k3 loss",
        estimator="k3",
        placement="loss",
        beta=0.1,
        seed=0,
        overrides=[],
    )
    return Run(**{**base, **kw})


def _write_metrics(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summarise_run_by_hand(tmp_path):
    # 20 steps; exact KL = step/100, the k3 estimate 0.01 above it; held-out 0.3 → 0.5.
    rows = [{"step": 0, "accuracy/heldout": 0.3}]
    for s in range(1, 21):
        row = {
            "step": s,
            "kl/ref/exact": s / 100,
            "kl/ref/k3": s / 100 + 0.01,
            "reward/mean": 1.0 if s > 10 else 0.0,
            "entropy": 0.5,
        }
        if s in (10, 20):
            row["accuracy/heldout"] = {10: 0.6, 20: 0.5}[s]
        rows.append(row)
    _write_metrics(tmp_path / "r", rows)
    row = summarise_run(_run(), tmp_path / "r", Criteria(20, 0.1), returncode=0, wall_s=12.34)
    assert row["status"] == "ok" and row["steps_done"] == 20
    assert (row["acc_start"], row["acc_final"], row["acc_best"]) == (0.3, 0.5, 0.6)
    # Final = mean of the last 10 steps' KL: (0.11 + ... + 0.20) / 10 = 0.155; the peak
    # 10-step running mean is the same window here, since the KL only grows.
    assert row["kl_exact_final"] == pytest.approx(0.155)
    assert row["kl_exact_peak"] == pytest.approx(0.155)
    assert row["kl_logged_final"] == pytest.approx(0.165)
    assert row["kl_gap_mean"] == pytest.approx(0.01)
    assert row["reward_final"] == 1.0 and row["wall_s"] == 12.3


def test_summarise_run_noise_convergence_and_reference_time(tmp_path):
    # 20 steps; exact KL 0.1; ref_is alternates 0.1 ± 0.02 (noise variance 0.02² · 20/19),
    # k1 alternates 0.1 ± 0.01; the train accuracy is 0.3 until step 12, then 0.6: its 10-step
    # running mean first reaches 0.4 at step 15 ((7 · 0.3 + 3 · 0.6) / 10 = 0.39 at step 14,
    # (6 · 0.3 + 4 · 0.6) / 10 = 0.42 at step 15). Each step spends 0.5 + 0.25 s on the reference.
    rows = [{"step": 0, "accuracy/heldout": 0.3}]
    for s in range(1, 21):
        sign = 1 if s % 2 else -1
        rows.append(
            {
                "step": s,
                "kl/ref/exact": 0.1,
                "kl/ref/ref_is": 0.1 + 0.02 * sign,
                "kl/ref/k1": 0.1 - 0.01 * sign,
                "accuracy/train": 0.3 if s <= 11 else 0.6,
                "reward/mean": 0.0,
                "entropy": 0.5,
                "time/ref_sample": 0.5,
                "time/ref_update": 0.25,
            }
        )
    rows[-1]["accuracy/heldout"] = 0.5
    _write_metrics(tmp_path / "r", rows)
    run = _run(estimator="ref_is", choice="ref_is loss")
    row = summarise_run(
        run, tmp_path / "r", Criteria(20, 0.1, target_accuracy=0.4), returncode=0, wall_s=1
    )
    assert row["kl_noise_var"] == pytest.approx(0.02**2 * 20 / 19)
    assert row["kl_est_var"] == pytest.approx(0.02**2 * 20 / 19)
    assert row["kl_k1_noise_var"] == pytest.approx(0.01**2 * 20 / 19)
    assert row["steps_to_target"] == 15 and row["ref_time_s"] == pytest.approx(15.0)
    never = summarise_run(
        run, tmp_path / "r", Criteria(20, 0.1, target_accuracy=0.9), returncode=0, wall_s=1
    )
    assert math.isnan(never["steps_to_target"])
    cells = summarise_cells([row, never])
    assert cells[0]["reached"] == 1 and cells[0]["steps_to_target"] == 15
    report = write_results([row, never], tmp_path, StudyConfig(seeds=[0]))
    text = report.read_text()
    assert "## Estimator noise and convergence" in text and "| 4.00 |" in text  # ratio 0.02²/0.01²


def test_summarise_run_statuses(tmp_path):
    def rows(n, acc_end, kl_last=0.1):
        out = [{"step": 0, "accuracy/heldout": 0.5}]
        out += [{"step": s, "kl/ref/exact": 0.1, "kl/ref/k3": 0.1} for s in range(1, n)]
        out.append({"step": n, "kl/ref/exact": kl_last, "kl/ref/k3": 0.1})
        out[-1]["accuracy/heldout"] = acc_end
        return out

    def status(metrics, returncode=0, steps=5):
        _write_metrics(tmp_path / "r", metrics)
        return summarise_run(
            _run(), tmp_path / "r", Criteria(steps, 0.1), returncode=returncode, wall_s=1
        )["status"]

    assert status(rows(5, 0.45)) == "ok"  # 0.05 below the start: within collapse_drop
    assert status(rows(5, 0.35)) == "collapsed"
    assert status(rows(5, 0.5), steps=6) == "crashed"  # stopped early
    assert status(rows(3, 0.5), returncode=3) == "diverged"  # the trainer's own verdict
    assert status(rows(5, 0.5, kl_last="nan")) == "diverged"  # written as the string "nan"
    assert status(rows(5, 0.5), returncode=1) == "crashed"
    assert (
        summarise_run(_run(), tmp_path / "none", Criteria(5, 0.1), returncode=1, wall_s=1)["status"]
        == "crashed"
    )


def test_collapsed_needs_a_drop_beyond_the_noise_of_the_evaluation(tmp_path):
    from klpo.study.summary import collapse_threshold

    # Hand arithmetic: 0.5 -> 0.35 on 40 problems: sqrt((0.25 + 0.2275) / 40) = 0.1093, two
    # standard errors 0.2185 > collapse_drop 0.1; on 500 problems 2 * 0.0309 = 0.0618 < 0.1.
    assert collapse_threshold(0.5, 0.35, 40, 0.1) == pytest.approx(0.21852, abs=1e-5)
    assert collapse_threshold(0.5, 0.35, 500, 0.1) == 0.1
    assert collapse_threshold(0.5, 0.35, None, 0.1) == 0.1
    metrics = [{"step": 0, "accuracy/heldout": 0.5}]
    metrics += [{"step": s, "kl/ref/exact": 0.1, "kl/ref/k3": 0.1} for s in range(1, 6)]
    metrics[-1]["accuracy/heldout"] = 0.35
    _write_metrics(tmp_path / "r", metrics)

    def row(n):
        return summarise_run(_run(), tmp_path / "r", Criteria(5, 0.1, eval_size=n), returncode=0,
                             wall_s=1)  # fmt: skip

    assert row(40)["status"] == "ok" and row(40)["error"] == ""  # a 12-step smoke run's noise
    collapsed = row(500)
    assert collapsed["status"] == "collapsed"
    assert collapsed["error"] == (
        "held-out accuracy fell from 0.500 to 0.350, more than 0.100 (the larger of collapse_drop "
        "0.1 and 2 standard errors on 500 problems)"
    )


def test_cells_and_report(tmp_path):
    def row(choice, seed, acc, status="ok", algo="grpo", beta=0.1):
        return {
            "name": f"{algo}-{choice}-{seed}",
            "algo": algo,
            "choice": choice,
            "beta": beta,
            "seed": seed,
            "status": status,
            "steps_done": 5,
            "acc_start": 0.3,
            "acc_final": acc,
            "kl_exact_final": 0.1,
            "kl_exact_peak": 0.2,
            "kl_gap_mean": 0.0,
            "reward_final": acc,
            "wall_s": 10.0,
            "error": "boom" if status == "crashed" else "",
        }

    results = [row("k3 loss", 0, 0.4), row("k3 loss", 1, 0.6), row("k3 loss", 2, 0.5)]
    results += [row("no KL", 0, math.nan, status="crashed", beta=0.0)]
    cells = {c["choice"]: c for c in summarise_cells(results)}
    k3 = cells["k3 loss"]
    assert k3["acc_mean"] == pytest.approx(0.5)
    assert k3["acc_sd"] == pytest.approx(0.1)  # sample sd of 0.4, 0.5, 0.6
    assert k3["reward_var"] == pytest.approx(0.01)
    assert k3["failed"] == 0 and cells["no KL"]["failed"] == 1
    report = write_results(results, tmp_path, quick_study())
    text = report.read_text()
    assert "| grpo | k3 loss | 0.1 | 0.300 | 0.500 ± 0.100 |" in text
    assert "1/1 (crashed)" in text and "boom" in text
    with (tmp_path / "results.csv").open() as f:
        assert [r["name"] for r in csv.DictReader(f)] == [r["name"] for r in results]
    assert (tmp_path / "accuracy_vs_kl.png").stat().st_size > 0


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path):
    """`klpo compare --quick` on the shipped model, every choice of the preset at one of its
    seeds (the seeds' summary has tests of its own): every run finishes; re-running reuses them."""
    out = tmp_path / "study"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    cmd = [sys.executable, "-m", "klpo", "compare", "--quick", "--seeds", "0", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    one_seed = quick_study().model_copy(update={"seeds": [0]})
    assert len(rows) == len(study_grid(one_seed)) == len(study_grid(quick_study())) // 2
    # every run finishes: none crashed or diverged (12 steps can still lose held-out accuracy on
    # 40 greedy problems, which the study reports as "collapsed")
    statuses = {r["name"]: r["status"] for r in rows}
    assert set(statuses.values()) <= {"ok", "collapsed"}, [(r["name"], r["error"]) for r in rows]
    for r in rows:
        assert int(r["steps_done"]) == quick_study().steps
        assert 0 <= float(r["acc_final"]) <= 1 and float(r["kl_exact_final"]) >= 0
        if r["estimator"] == "full":  # the logged estimate IS the exact KL
            assert float(r["kl_gap_mean"]) == pytest.approx(0.0, abs=1e-6)
    report = (out / "report.md").read_text()
    assert "no KL" in report and "ppo" in report
    for png in ("accuracy_grpo_b0.05.png", "kl_grpo_b0.05.png", "accuracy_vs_kl.png"):
        assert (out / png).stat().st_size > 0
    assert yaml.safe_load((out / "study.yaml").read_text())["steps"] == quick_study().steps
    # A second invocation finds every run finished and only rewrites the report.
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    with (out / "results.csv").open() as f:
        assert list(csv.DictReader(f)) == rows


def test_cli_dry_run_and_bad_options():
    from typer.testing import CliRunner

    from klpo.cli import app

    result = CliRunner().invoke(app, ["compare", "--quick", "--dry-run", "--seeds", "3"])
    assert result.exit_code == 0, result.output
    names = [line for line in result.stdout.splitlines() if line]
    assert names and all(n.endswith("_s3") for n in names)
    bad = CliRunner().invoke(app, ["compare", "--dry-run", "--betas", "0,0.1"])
    assert bad.exit_code == 2 and "positive" in bad.output


def test_the_time_left_counts_whole_runs_start_up_included():
    from klpo.study.runner import runs_left_s

    # Two finished runs of 30 s and 50 s (start-up in each), 5 left, 2 at a time: 3 rounds of 40 s.
    assert runs_left_s([30.0, 50.0], 5, 2) == 120.0
    assert runs_left_s([], 5, 2) is None and runs_left_s([30.0], 0, 2) is None
    assert runs_left_s([float("nan"), 10.0], 1, 1) == 10.0  # an untimed row is skipped


def test_distillation_columns_by_hand() -> None:
    from klpo.study.summary import distillation_summary

    # 12 steps with a teacher: the KL falls 1.2, 1.1, ..., 0.1; the last 10 steps' mean is
    # (1.0 + 0.1) / 2 = 0.55. CPU seconds 10 per step. Held-out: 0.3 at 0 (ignored: step 0),
    # 0.6 at 4, 0.71 at 8, 0.65 at 12: the target 0.7 is first reached at step 8, at 80 CPU s.
    rows = [
        {"step": s, "kl/teacher/exact": round(1.3 - 0.1 * s, 10), "time/cpu": 10.0 * s}
        for s in range(1, 13)
    ]
    evals = [(0, 0.9), (4, 0.6), (8, 0.71), (12, 0.65)]
    got = distillation_summary(rows, evals, 0.7)
    assert got["kl_teacher_final"] == pytest.approx(0.55)
    assert got["heldout_steps_to_target"] == 8 and got["cpu_s_to_target"] == 80.0
    assert got["cpu_s"] == 120.0
    # without a teacher, never reaching the target, and runs that predate time/cpu: NaN
    plain = distillation_summary([{"step": 1}], [(0, 0.1), (1, 0.2)], 0.7)
    assert all(math.isnan(v) for v in plain.values()), plain
