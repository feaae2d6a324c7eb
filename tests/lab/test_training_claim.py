"""The training claim judged on a study's rows (hand-made, the arithmetic in the comments)."""

from __future__ import annotations

import csv

import pytest

from klpo.lab.training import judge_training_claim, read_results


def _row(choice, seed, noise, k1_noise, steps, done=100, **kw):
    return {
        "algo": "grpo",
        "choice": choice,
        "beta": "0.1",
        "seed": str(seed),
        "status": "ok",
        "kl_noise_var": str(noise),
        "kl_k1_noise_var": str(k1_noise),
        "steps_to_target": str(steps),
        "steps_done": str(done),
        **kw,
    }


def test_claim_does_not_hold_when_ref_is_is_noisier_and_the_mix_is_not_faster():
    rows = [
        # ref_is: noise (2 + 4) / 2 = 3 against k1's (1 + 1) / 2 = 1: ratio 3.00
        _row("ref_is loss", 0, 2.0, 1.0, 40),
        _row("ref_is loss", 1, 4.0, 1.0, 60),  # steps (40 + 60) / 2 = 50
        # the mix never reaches the target in one seed: counts as 100; (100 + 50) / 2 = 75 → 1.50×
        _row("adaptive_mix (as written) loss", 0, 1.0, 1.0, "nan"),
        _row("adaptive_mix (as written) loss", 1, 1.0, 1.0, 50),
        _row("k1 reward", 0, 1.0, 1.0, 10),
    ]
    out = judge_training_claim(rows, scale="tiny")
    assert out["verdict"] == "does not hold"
    assert "= 3.00" in out["evidence"] and "1.50×" in out["evidence"]
    assert "At this scale (tiny), not a 7B model." in out["evidence"]


def test_claim_partly_and_holds():
    quieter = [_row("ref_is loss", 0, 0.5, 1.0, 100)]  # ratio 0.5 ≤ 0.7
    faster = [_row("adaptive_mix (as described) loss", 0, 1.0, 1.0, 80)]  # 0.80× ≤ 0.85
    slower = [_row("adaptive_mix (as described) loss", 0, 1.0, 1.0, 90)]  # 0.90×
    assert judge_training_claim(quieter + faster)["verdict"] == "holds"
    assert judge_training_claim(quieter + slower)["verdict"] == "partly"


def test_claim_needs_the_runs(tmp_path):
    assert judge_training_claim([_row("k1 reward", 0, 1.0, 1.0, 10)]) is None
    crashed = _row("ref_is loss", 0, 0.5, 1.0, 10, status="crashed")
    assert judge_training_claim([crashed, _row("adaptive_mix (x) loss", 0, 1, 1, 5)]) is None
    path = tmp_path / "results.csv"
    rows = [_row("ref_is loss", 0, 0.5, 1.0, 100)]
    with path.open("w") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert read_results(path) == rows
    with pytest.raises(FileNotFoundError, match=r"results\.csv"):
        read_results(tmp_path / "missing.csv")


def test_study_scale_in_words():
    from klpo.lab.training import study_scale

    rows = [_row("ref_is loss", s, 1, 1, 5, done=80) for s in (0, 1, 2)]
    assert study_scale(rows) == (
        "3 GRPO runs of the built-in task's model (about 1M parameters) for 80 steps, "
        "3 seeds per choice"
    )
