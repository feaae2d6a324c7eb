"""The over-optimisation task: its proxy by hand, its config defaults, gold/proxy metrics in a
run, the study's gold columns, default grid, KL-budget columns and gold-reward convergence by
hand, and `klpo compare --task overopt --quick` end to end."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.spec import (
    KL_BUDGET,
    KL_BUDGET_SEQ,
    StudyConfig,
    load_study,
    quick_overopt_study,
    quick_study,
)
from klpo.study.summary import (
    Criteria,
    gold_summary,
    kl_budget_summary,
    steps_to_reach,
    summarise_cells,
    summarise_run,
)
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.rewards.gold import eval_reward
from klpo.train.rewards.overopt import overopt_proxy
from klpo.train.runtime.metrics import read_metrics


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
    got = gold_summary(rows)
    # windows [0:10] mean 3.9/10 = 0.39, [1:11] 3.8/10 = 0.38, [2:12] 3.6/10 = 0.36: peak 0.39,
    # whose seq-KL mean is mean(0..9) = 4.5; the final values are the last 10 steps' means.
    assert got["gold_peak"] == pytest.approx(0.39)
    assert got["gold_peak_kl_seq"] == pytest.approx(4.5)
    assert got["gold_final"] == pytest.approx(0.36)
    assert got["proxy_final"] == pytest.approx(sum(range(3, 13)) / 10)
    assert got["kl_seq_final"] == pytest.approx(sum(range(2, 12)) / 10)
    assert all(math.isnan(v) for k, v in gold_summary(rows[:0]).items())


def test_overopt_grid_uses_the_task():
    grid = study_grid(load_study(quick=True, task="overopt"))
    assert all('data.source="builtin-overopt"' in r.overrides for r in grid)
    full = study_grid(load_study(task="overopt"))
    labels = {r.choice for r in full}
    assert {"no KL", "full reward+loss", "k3 reward+loss"} <= labels
    with pytest.raises(ValueError, match="unknown task"):
        load_study(task="nope")


def test_overopt_default_grid_rows_and_their_config_keys():
    study = load_study(task="overopt")
    runs = study_grid(study)
    by_choice: dict[tuple[str, str], list] = {}
    for r in runs:
        by_choice.setdefault((r.algo, r.choice), []).append(r)
    betas, seeds = study.betas, study.seeds
    assert len(betas) >= 4 and len(seeds) >= 3
    # label -> (estimator, placement, algos, expected kl.*/algo.* keys, betas)
    off = {"algo.epochs": 2, "algo.minibatches": 2}
    off_betas, one = [0.1, 0.3], [0.1]  # the off-policy rows; the reference-sampled rows
    expect = {
        "no KL": ("k1", "none", ["grpo"], {}, [0.0]),
        "k1 reward": ("k1", "reward", ["grpo", "ppo"], {}, betas),
        "k3 loss": ("k3", "loss", ["grpo"], {}, betas),
        "k3+ loss": ("k3+", "loss", ["grpo"], {}, betas),
        "full loss": ("full", "loss", ["grpo"], {}, betas),
        "full reward+loss": ("full", "reward+loss", ["grpo", "ppo"], {}, betas),
        "k3 reward+loss": ("k3", "reward+loss", ["grpo", "ppo"], {}, betas),
        "ref_is loss": ("ref_is", "loss", ["grpo"], {"kl.ref_is_clip": None}, one),
        "ref_is (clip 0.1-10) loss": (
            "ref_is", "loss", ["grpo"], {"kl.ref_is_clip": (0.1, 10.0)}, one
        ),
        "adaptive_mix (as written) loss": (
            "adaptive_mix", "loss", ["grpo"], {"kl.mix_sign": "as-written"}, one
        ),
        "adaptive_mix (as described) loss": (
            "adaptive_mix", "loss", ["grpo"], {"kl.mix_sign": "as-described"}, one
        ),
        "full (clip, 2 epochs x 2 minibatches) loss": (
            "full", "loss", ["grpo"], {"algo.policy_loss": "clip", **off}, off_betas
        ),
        "full (gspo, 2 epochs x 2 minibatches) loss": (
            "full", "loss", ["grpo"],
            {"algo.policy_loss": "gspo", "algo.loss_reduction": "seq-mean-token-mean", **off},
            off_betas,
        ),
        "full (cispo, 2 epochs x 2 minibatches) loss": (
            "full", "loss", ["grpo"], {"algo.policy_loss": "cispo", **off}, off_betas
        ),
        "k3 (corrected, 2 epochs x 2 minibatches) loss": (
            "k3", "loss", ["grpo"], {"kl.off_policy_correction": True, **off}, off_betas
        ),
        "k3 (uncorrected, 2 epochs x 2 minibatches) loss": (
            "k3", "loss", ["grpo"], {"kl.off_policy_correction": False, **off}, off_betas
        ),
        "k3_is (own weight, 2 epochs x 2 minibatches) loss": (
            "k3_is", "loss", ["grpo"], {"kl.off_policy_correction": True, **off}, off_betas
        ),
        "full (reset every 50) loss": (
            "full", "loss", ["grpo"],
            {"kl.reference_reset.every": 50, "kl.reference_reset.alpha": 1.0}, betas,
        ),
        f"full (adaptive, target {KL_BUDGET:g}) loss": (
            "full", "loss", ["grpo"],
            {"kl.controller": "adaptive", "kl.target": KL_BUDGET, "kl.horizon": 1000}, [0.1],
        ),
        f"full (adaptive, target {KL_BUDGET_SEQ:g} per sequence) loss": (
            "full", "loss", ["grpo"],
            {"kl.controller": "adaptive", "kl.target": KL_BUDGET_SEQ,
             "kl.target_unit": "sequence", "kl.horizon": 1000},
            [0.1],
        ),
        f"full (ppo-adaptive, target {KL_BUDGET:g}) loss": (
            "full", "loss", ["grpo"],
            {"kl.controller": "ppo-adaptive", "kl.target": KL_BUDGET}, [0.1],
        ),
    }  # fmt: skip
    want = {(a, label) for label, (_, _, algos, _, _) in expect.items() for a in algos}
    assert set(by_choice) == want
    for (algo, label), rs in by_choice.items():
        est, placement, _, keys, choice_betas = expect[label]
        assert sorted((r.beta, r.seed) for r in rs) == sorted(
            (b, s) for b in choice_betas for s in seeds
        )
        for r in rs:
            cfg = build_config(overrides=r.overrides)  # the study's own overrides
            dumped = cfg.model_dump()
            assert cfg.data.source == "builtin-overopt" and cfg.algo.name == algo
            assert (cfg.kl.estimator, cfg.kl.placement, cfg.kl.beta) == (est, placement, r.beta)
            if "kl.controller" not in keys:
                assert cfg.kl.controller == "fixed"
            if not any(k.startswith("algo.") for k in keys) and algo == "grpo":
                assert (cfg.algo.policy_loss, cfg.algo.epochs) == ("clip", 1)
            if "reset" not in label:
                assert cfg.kl.reference_reset is None
            for key, value in keys.items():
                node = dumped
                for part in key.split("."):
                    node = node[part]
                assert node == value, (label, key, node)
            # every run is judged against the study's KL budget, a controller row against its own
            unit = keys.get("kl.target_unit", "token")
            assert (r.kl_target, r.kl_unit) == (keys.get("kl.target", KL_BUDGET), unit)
    # the quick preset is unchanged: two runs
    assert [r.choice for r in study_grid(quick_overopt_study())] == ["no KL", "full loss"]


def test_choice_betas_override_the_study_and_must_be_positive():
    from klpo.study.spec import Choice

    study = StudyConfig(
        choices=[
            Choice(estimator="full", placement="loss"),
            Choice(
                estimator="full",
                placement="loss",
                options={"controller": "ppo-adaptive", "target": 0.05},
                betas=[0.2],
                variant="ctl",
            ),
        ],
        betas=[0.01, 0.1],
        seeds=[0],
    )
    runs = study_grid(study)
    assert [(r.choice, r.beta, r.kl_target) for r in runs] == [
        ("full loss", 0.01, None),
        ("full loss", 0.1, None),
        ("full (ctl) loss", 0.2, 0.05),
    ]
    with pytest.raises(ValueError, match="positive"):
        Choice(estimator="full", placement="loss", betas=[0.0])


def test_kl_budget_summary_by_hand():
    # 20 steps, target 0.1 (band [0.08, 0.12]); the second half is steps 11-20.
    # KL 0.1 up to step 15, then 0.25: trailing 10-step means at steps 11-15 are 0.1, at 16
    # (9 · 0.1 + 0.25) / 10 = 0.115 (inside), at 17 (8 · 0.1 + 2 · 0.25) / 10 = 0.13 (outside),
    # then 0.145, 0.16, 0.175: 6 of 10 steps inside. Mean raw KL over steps 11-20:
    # (5 · 0.1 + 5 · 0.25) / 10 = 0.175, ratio 1.75.
    rows = [{"step": s, "kl/ref/exact": 0.1 if s <= 15 else 0.25} for s in range(1, 21)]
    got = kl_budget_summary(rows, 0.1, steps=20)
    assert got["kl_target"] == 0.1
    assert got["kl_budget_frac"] == pytest.approx(0.6)
    assert got["kl_budget_ratio"] == pytest.approx(1.75)
    assert got["kl_budget_held"] == 0.0
    # a per-sequence budget judges kl/ref/seq: the same numbers, 4x, against 4x the target give
    # the same verdict; the per-token key (0.1 throughout) against 0.4 gives ratio 0.25
    seq_rows = [{**r, "kl/ref/seq": 4 * r["kl/ref/exact"], "kl/ref/exact": 0.1} for r in rows]
    got = kl_budget_summary(seq_rows, 0.4, steps=20, key="kl/ref/seq")
    assert (got["kl_budget_frac"], got["kl_budget_ratio"]) == pytest.approx((0.6, 1.75))
    assert kl_budget_summary(seq_rows, 0.4, steps=20)["kl_budget_ratio"] == pytest.approx(0.25)
    # 0.09 in the first half, 0.11 in the second: every trailing mean lies in [0.09, 0.11].
    rows = [{"step": s, "kl/ref/exact": 0.09 if s <= 10 else 0.11} for s in range(1, 21)]
    got = kl_budget_summary(rows, 0.1, steps=20)
    assert (got["kl_budget_frac"], got["kl_budget_held"]) == (1.0, 1.0)
    assert got["kl_budget_ratio"] == pytest.approx(1.1)
    # One non-finite step in the second half is outside, and so is every window holding it.
    rows[14]["kl/ref/exact"] = "nan"  # step 15: windows ending at 15..20 hold it
    got = kl_budget_summary(rows, 0.1, steps=20)
    assert got["kl_budget_frac"] == pytest.approx(4 / 10) and got["kl_budget_held"] == 0.0
    # No target, or a run that stopped in the first half: NaN.
    assert all(math.isnan(v) for v in kl_budget_summary(rows, None, steps=20).values())
    early = kl_budget_summary(rows[:8], 0.1, steps=20)
    assert early["kl_target"] == 0.1 and math.isnan(early["kl_budget_frac"])


def test_steps_to_gold_target_by_hand(tmp_path):
    # Gold 0.2 up to step 11, then 0.5: the 10-step running mean at step s >= 12 is
    # 0.2 + 0.3 · (s - 11) / 10, 0.29 at step 14 and 0.32 at step 15, the first >= 0.3.
    # The proxy pass rate (accuracy/train) is 1 from the start: on the overopt task it must not
    # be what convergence reads.
    rows = [{"step": 0, "accuracy/heldout": 0.3}]
    for s in range(1, 21):
        rows.append(
            {
                "step": s,
                "kl/ref/exact": 0.1,
                "kl/ref/full": 0.1,
                "accuracy/train": 1.0,
                "reward/gold": 0.2 if s <= 11 else 0.5,
            }
        )
    rows[-1]["accuracy/heldout"] = 0.3
    assert steps_to_reach(rows, "reward/gold", 0.3) == 15
    assert steps_to_reach(rows, "accuracy/train", 0.3) == 10
    assert math.isnan(steps_to_reach(rows, "reward/gold", 0.6))
    study = load_study(task="overopt")
    assert study.convergence_target() == ("reward/gold", study.target_gold)
    assert quick_study().convergence_target() == ("accuracy/train", 0.4)
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = Run(
        name="r", algo="grpo", choice="full loss", estimator="full", placement="loss",
        beta=0.1, seed=0, overrides=[], kl_target=0.1,
    )  # fmt: skip
    key, value = StudyConfig(task="overopt", target_gold=0.3).convergence_target()
    row = summarise_run(
        run, run_dir, Criteria(20, 0.1, target_accuracy=value, target_metric=key),
        returncode=0, wall_s=1.0,
    )  # fmt: skip
    assert row["steps_to_target"] == 15
    assert (row["kl_budget_frac"], row["kl_budget_held"], row["kl_budget_ratio"]) == (1, 1, 1)
    cells = summarise_cells([row])
    assert cells[0]["kl_budget_held"] == 1 and cells[0]["steps_to_target"] == 15
    text = write_results([row], tmp_path, StudyConfig(task="overopt", seeds=[0])).read_text()
    assert "running mean of the gold reward (`reward/gold`) reaches 0.3" in text
    assert "## Holding a KL budget" in text
    assert "| grpo | full loss | 0.1 | 0.1 per token | 1.00 | 1.00 | 1/1 |" in text
    with (tmp_path / "results.csv").open() as f:
        assert float(next(csv.DictReader(f))["kl_budget_held"]) == 1.0


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
