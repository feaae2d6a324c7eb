"""Gao et al.'s forms (klpo.study.gao): recovered from points they generate, with the standard
errors that the spread of repeated fits implies; the bootstrap over runs against the true spread
when runs share noise; the peak against a grid search; the run readers on hand-made runs."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from klpo.study import gao


def _analytic_se(d: np.ndarray, form: str, sigma: float) -> np.ndarray:
    x = gao.design(d, form)
    return np.sqrt(np.diag(sigma**2 * np.linalg.inv(x.T @ x)))


def test_design_by_hand() -> None:
    d = np.array([0.0, 1.0, math.e, 2.0])
    # RL: [d, -d log d]: log 1 = 0, e log e = e, 2 log 2 = 1.386294; at d = 0 the limit 0.
    np.testing.assert_allclose(
        gao.design(d, "rl"), [[0, 0], [1, 0], [math.e, -math.e], [2, -2 * math.log(2)]]
    )
    # best-of-n: [d, -d²].
    np.testing.assert_allclose(
        gao.design(d, "bon"), [[0, 0], [1, -1], [math.e, -(math.e**2)], [2, -4]]
    )
    # R = d (alpha - beta log d) at d = e, alpha 0.3, beta 0.1: e (0.3 - 0.1) = 0.543656.
    assert gao.predict(np.array([math.e]), 0.3, 0.1, "rl")[0] == pytest.approx(0.2 * math.e)
    with pytest.raises(ValueError, match="form must be one of"):
        gao.design(d, "linear")  # type: ignore[arg-type]


@pytest.mark.parametrize("form", gao.FORMS)
def test_noise_free_points_give_the_coefficients(form: str) -> None:
    d = np.linspace(0.05, 4, 50)
    f = gao.fit(d, gao.predict(d, 0.31, 0.07, form), form)
    assert (f.alpha, f.beta) == (pytest.approx(0.31, abs=1e-12), pytest.approx(0.07, abs=1e-12))
    assert f.rmse < 1e-12 and f.n == 50


@pytest.mark.parametrize("form", gao.FORMS)
def test_noisy_points_recovered_within_their_standard_error(form: str) -> None:
    rng = np.random.default_rng(1)
    sigma, n = 0.04, 400
    d = rng.uniform(0.05, 3.0, n)
    r = gao.predict(d, 0.3, 0.1, form) + rng.normal(0, sigma, n)
    f = gao.fit(d, r, form)
    se = _analytic_se(d, form, sigma)
    assert abs(f.alpha - 0.3) < 4 * se[0] and abs(f.beta - 0.1) < 4 * se[1]
    # The reported se estimates sigma from the residuals: relative sd of s about 1/sqrt(2n).
    tol = 4 / math.sqrt(2 * n)
    assert f.se_alpha / se[0] == pytest.approx(1, abs=tol)
    assert f.se_beta / se[1] == pytest.approx(1, abs=tol)
    assert f.rmse == pytest.approx(sigma, rel=tol)


def test_standard_error_is_the_spread_of_repeated_fits() -> None:
    rng = np.random.default_rng(2)
    sigma, reps = 0.05, 300
    d = np.linspace(0.1, 3.0, 60)
    fits = np.array(
        [
            (f.alpha, f.beta)
            for f in (
                gao.fit(d, gao.predict(d, 0.3, 0.1, "rl") + rng.normal(0, sigma, d.size), "rl")
                for _ in range(reps)
            )
        ]
    )
    se = _analytic_se(d, "rl", sigma)
    np.testing.assert_allclose(fits.std(axis=0, ddof=1) / se, 1, atol=4 / math.sqrt(2 * reps))
    # Unbiased: the mean of the fits within 4 standard errors of the mean.
    assert np.all(np.abs(fits.mean(axis=0) - [0.3, 0.1]) < 4 * se / math.sqrt(reps))


def test_bootstrap_over_runs_sees_the_noise_runs_share() -> None:
    """Each run's points share a random slope u_g d (u_g ~ N(0, tau²)). With the same d in every
    run, alpha_hat - alpha = mean(u) + point noise, so its true sd is sqrt(tau²/G + se²). The
    covariance se takes the shared part for independent noise and shrinks with the points per run;
    the true sd does not, and the bootstrap over runs follows it."""
    rng = np.random.default_rng(3)
    tau, sigma, runs = 0.05, 0.04, 50
    d = np.linspace(0.1, 3.0, 100)
    groups = [
        (d, gao.predict(d, 0.3, 0.1, "rl") + rng.normal(0, tau) * d + rng.normal(0, sigma, d.size))
        for _ in range(runs)
    ]
    pooled_d = np.concatenate([g[0] for g in groups])
    se_points = _analytic_se(pooled_d, "rl", sigma)[0]
    true_sd = math.sqrt(tau**2 / runs + se_points**2)
    boot = gao.bootstrap(groups, "rl", n_boot=600, seed=0)
    # Relative error of a bootstrap sd over G groups about 1/sqrt(2G), plus 1/sqrt(2B) from B draws.
    tol = 4 * math.sqrt(1 / (2 * runs) + 1 / (2 * 600))
    assert boot[:, 0].std(ddof=1) / true_sd == pytest.approx(1, abs=tol)
    f = gao.fit(*map(np.concatenate, zip(*groups, strict=True)), "rl")
    assert f.se_alpha < 0.5 * true_sd  # why the fits quote the bootstrap, not the covariance


def test_bootstrap_of_independent_points_matches_the_covariance() -> None:
    rng = np.random.default_rng(4)
    n, sigma = 400, 0.04
    d = rng.uniform(0.05, 3.0, n)
    r = gao.predict(d, 0.3, 0.1, "bon") + rng.normal(0, sigma, n)
    boot = gao.bootstrap([(d[i : i + 1], r[i : i + 1]) for i in range(n)], "bon", n_boot=400)
    f = gao.fit(d, r, "bon")
    tol = 4 * math.sqrt(1 / (2 * n) + 1 / (2 * 400))
    assert boot[:, 0].std(ddof=1) / f.se_alpha == pytest.approx(1, abs=tol)
    assert boot[:, 1].std(ddof=1) / f.se_beta == pytest.approx(1, abs=tol)
    with pytest.raises(ValueError, match="two or more groups"):
        gao.bootstrap([(d, r)], "bon")


@pytest.mark.parametrize(
    ("form", "peak"), [("rl", (math.exp(2), 0.1 * math.exp(2))), ("bon", (1.5, 0.225))]
)
def test_peak_closed_form_and_grid(form: str, peak: tuple[float, float]) -> None:
    # RL: d* = exp(0.3 / 0.1 - 1) = e², R* = 0.1 e²; best-of-n: d* = 0.3 / 0.2, R* = 0.09 / 0.4.
    f = gao.Fit(form, 0.3, 0.1, 0.0, 0.0, 0.0, 0.0, 0)  # type: ignore[arg-type]
    assert f.peak() == pytest.approx(peak)
    grid = np.linspace(0, 12, 1_200_001)
    r = gao.predict(grid, 0.3, 0.1, form)  # type: ignore[arg-type]
    assert grid[r.argmax()] == pytest.approx(peak[0], abs=2e-5) and r.max() == pytest.approx(
        peak[1]
    )
    assert all(math.isnan(x) for x in gao.Fit(form, 0.3, -0.1, 0, 0, 0, 0, 0).peak())  # type: ignore[arg-type]


def test_lack_of_fit_separates_the_forms() -> None:
    rng = np.random.default_rng(5)
    d = rng.uniform(0.05, 6.0, 2000)
    r = gao.predict(d, 0.3, 0.1, "rl") + rng.normal(0, 0.04, d.size)
    chi2_rl, bins = gao.lack_of_fit(d, r, gao.fit(d, r, "rl"))
    # The mean of 20 chi²(1) values: mean 1, sd sqrt(2 / 20); the right form stays near 1.
    assert bins == 20 and chi2_rl < 1 + 4 * math.sqrt(2 / 20)
    chi2_bon, _ = gao.lack_of_fit(d, r, gao.fit(d, r, "bon"))
    assert chi2_bon > 10 * chi2_rl


@pytest.mark.parametrize(
    ("d", "r", "message"),
    [
        ([0.1, 0.2, -0.3], [0, 0, 0], "must be >= 0"),
        ([0.1, 0.2], [0, 0, 0], "1-D of one length"),
        ([0.1, math.nan, 0.3], [0, 0, 0], "must be finite"),
        ([0.0, 0.5, 0.5], [0, 0, 0], "two or more distinct"),
    ],
)
def test_bad_points_are_refused(d: list[float], r: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gao.fit(d, r, "rl")


# ---------------------------------------------------------------------------------------------
# Reading runs.


def _fake_run(
    root: Path, name: str, choice: str, beta: float, seed: int, points: list[tuple[float, float]]
) -> None:
    """A klpo compare run directory: result.yaml and metrics.jsonl, an eval-only row at step 0
    and one row per (gold, kl_seq) from step 1."""
    run = root / "runs" / name
    run.mkdir(parents=True)
    result = {"name": name, "algo": "grpo", "choice": choice, "beta": beta, "seed": seed}
    (run / "result.yaml").write_text(yaml.safe_dump(result))
    lines = [json.dumps({"step": 0, "accuracy/heldout": 0.3})]
    for step, (gold, kl) in enumerate(points, start=1):
        lines.append(json.dumps({"step": step, "reward/gold": gold, "kl/ref/seq": kl, "x": 1}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_runs_to_points_round_trip(tmp_path: Path) -> None:
    study = tmp_path / "study"
    _fake_run(study, "a", "no KL", 0.0, 0, [(0.2, 0.0), (0.3, 0.25), (0.1, 4.0)])
    _fake_run(study, "b", "full loss", 0.1, 1, [(0.18, 0.0), (0.32, 0.36)])
    (study / "runs" / "unfinished").mkdir()  # no result.yaml: skipped
    rows = gao.collect_trajectories([study])
    assert [(r["run"], r["step"], r["gold"], r["kl_seq"]) for r in rows] == [
        ("a", 1, 0.2, 0.0),
        ("a", 2, 0.3, 0.25),
        ("a", 3, 0.1, 4.0),
        ("b", 1, 0.18, 0.0),
        ("b", 2, 0.32, 0.36),
    ]
    path = tmp_path / "t.csv"
    gao.write_csv(rows, path, gao.TRAJECTORY_FIELDS)
    assert gao.read_trajectories(path) == rows
    # Step 1 of each seed: (0.2 + 0.18) / 2 = 0.19; sd of {0.2, 0.18} = 0.0141421, / sqrt 2 = 0.01.
    g0, se, n = gao.initial_gold(rows)
    assert (g0, se, n) == (pytest.approx(0.19), pytest.approx(0.01), 2)
    # A third run with seed=0 samples step 1 as run "a" did: it adds no seed.
    _fake_run(study, "c", "k1 reward", 0.1, 0, [(0.2, 0.0), (0.25, 0.3)])
    assert gao.initial_gold(gao.collect_trajectories([study]))[2] == 2
    groups = gao.trajectory_groups(rows, g0)
    d, r = groups["grpo no KL"][0]
    np.testing.assert_allclose(d, [0.0, 0.5, 2.0])  # sqrt of 0, 0.25, 4
    np.testing.assert_allclose(r, [0.01, 0.11, -0.09])
    np.testing.assert_allclose(groups["grpo full loss"][0][0], [0.0, 0.6])
    with pytest.raises(ValueError, match="holds no runs"):
        gao.collect_trajectories([tmp_path / "empty"])
    # The first-step rows are those of run "a" (0.2) and run "b" (0.18); the rest are later.
    assert {r["gold"] for r in rows if r["step"] == 1} == {0.2, 0.18}


def test_reference_gold_from_a_run_that_never_moved(tmp_path: Path) -> None:
    _fake_run(tmp_path, "ref", "no KL", 0.0, 7, [(0.2, 0.0), (0.25, 1e-9), (0.15, 0.0)])
    run = tmp_path / "runs" / "ref"
    # mean 0.2; sd of {0.2, 0.25, 0.15} = 0.05, / sqrt 3 = 0.0288675.
    assert gao.reference_gold(run) == (pytest.approx(0.2), pytest.approx(0.05 / math.sqrt(3)), 3)
    _fake_run(tmp_path, "moved", "no KL", 0.0, 7, [(0.2, 0.0), (0.3, 0.5)])
    with pytest.raises(ValueError, match="the policy moved"):
        gao.reference_gold(tmp_path / "runs" / "moved")
    with pytest.raises(ValueError, match="does not exist"):
        gao.reference_gold(tmp_path / "nowhere")


def test_endpoint_groups_leave_out_resets_and_single_betas(tmp_path: Path) -> None:
    path = tmp_path / "results.csv"
    fields = ["algo", "choice", "beta", "seed", "kl_seq_final", "gold_final"]
    rows = [
        ("grpo", "full loss", 0.1, 0, 0.64, 0.35),
        ("grpo", "full loss", 0.01, 0, 36.0, 0.0),
        ("grpo", "full loss", 0.1, 1, 0.81, 0.33),
        ("grpo", "full loss", 0.01, 1, "nan", 0.0),  # diverged: dropped
        ("grpo", "full (reset every 50) loss", 0.1, 0, 0.2, 0.3),
        ("grpo", "full (reset every 50) loss", 0.3, 0, 0.1, 0.3),
        ("grpo", "ref_is loss", 0.1, 0, 40.0, 0.0),
    ]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        w.writerows(rows)
    groups = gao.endpoint_groups(path, 0.2)
    assert list(groups) == ["grpo full loss"]
    (d0, r0), (d1, r1) = groups["grpo full loss"]
    np.testing.assert_allclose(d0, [0.8, 6.0])
    np.testing.assert_allclose(r0, [0.15, -0.2])
    np.testing.assert_allclose((d1, r1), ([0.9], [0.13]))
    assert gao.endpoint_groups(path, 0.2, min_betas=3) == {}


def _synthetic_rows(alpha: float, label: str, runs: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for s in range(runs):
        kl = np.linspace(0, 9, 40)
        gold = 0.2 + gao.predict(np.sqrt(kl), alpha, 0.1, "rl") + rng.normal(0, 0.01, kl.size)
        rows += [
            {
                "run": f"{label}{s}",
                "algo": "grpo",
                "choice": label,
                "beta": 0.1,
                "seed": s,
                "step": i + 1,
                "gold": float(g),
                "kl_seq": float(k),
            }
            for i, (g, k) in enumerate(zip(gold, kl, strict=True))
        ]
    return rows


def test_fit_table_z_scores_and_offsets() -> None:
    rng = np.random.default_rng(6)
    rows = [
        *_synthetic_rows(0.3, "same", 5, rng),
        *_synthetic_rows(0.3, "ref", 5, rng),
        *_synthetic_rows(0.4, "other", 5, rng),
    ]
    groups = gao.trajectory_groups(rows, 0.2)
    table = gao.fit_table(groups, 0.2, reference="grpo ref", n_boot=300)
    rl = {r["choice"]: r for r in table if r["form"] == "rl"}
    assert rl["grpo ref"]["is_reference"] and math.isnan(rl["grpo ref"]["z_alpha"])
    assert abs(rl["grpo same"]["z_alpha"]) < 4  # same law: within noise
    assert rl["grpo other"]["z_alpha"] > 10  # alpha 0.4 against 0.3, sd about 0.003
    assert rl["grpo other"]["alpha"] == pytest.approx(0.4, abs=0.01)
    ref = gao.Fit("rl", rl["grpo ref"]["alpha"], rl["grpo ref"]["beta"], 0, 0, 0, 0, 0)
    runs = gao.matched_baseline(rows, 0.2, "grpo ref", min_points=5)  # 5 runs, one grid of KLs
    bases = {"fit": gao.fit_baseline(ref), "runs": runs}
    off = {o["choice"]: o for o in gao.offsets(rows, 0.2, bases, after_step=20)}
    # alpha 0.1 higher: the gold is 0.1 d higher; mean d over steps 21-40 of the linspace.
    mean_d = float(np.sqrt(np.linspace(0, 9, 40)[20:]).mean())
    for k in bases:
        assert off["grpo same"][f"offset_{k}"] == pytest.approx(0, abs=0.01)
        assert off["grpo other"][f"offset_{k}"] == pytest.approx(0.1 * mean_d, abs=0.01)
        assert off["grpo other"][f"covered_{k}"] == 1.0
    md = gao.offsets_markdown(list(off.values()), {"fit": "vs fit", "runs": "vs runs"})
    assert "| grpo other | 0.1 | 5 |" in md and "vs runs" in md
    assert "| grpo other | d(α − β log d) |" in gao.fit_markdown(table)


def test_matched_baseline_averages_the_points_near_d() -> None:
    rows = [
        {"run": "a", "algo": "grpo", "choice": "no KL", "kl_seq": d * d, "gold": 0.2 + g}
        for d, g in ((0.50, 0.10), (0.52, 0.14), (0.56, 0.30), (1.0, 0.0))
    ]
    at = gao.matched_baseline(rows, 0.2, "grpo no KL", width=0.03, min_points=2)
    # Within 0.03 of 0.51: d = 0.50 and 0.52, R = 0.10 and 0.14 -> 0.12; near 0.8 nothing.
    assert at(0.51) == pytest.approx(0.12) and math.isnan(at(0.8))
    assert math.isnan(gao.matched_baseline(rows, 0.2, "grpo no KL", width=0.03, min_points=3)(0.51))
    with pytest.raises(ValueError, match="no points of 'grpo other'"):
        gao.matched_baseline(rows, 0.2, "grpo other")


def test_command_writes_table_and_plot(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    study = tmp_path / "study"
    for label, alpha in (("no KL", 0.3), ("full loss", 0.35)):
        for s in range(3):
            pts = [(r["gold"], r["kl_seq"]) for r in _synthetic_rows(alpha, label, 1, rng)]
            _fake_run(study, f"{label}-{s}", label, 0.1, s, pts)
    out = tmp_path / "out"
    traj = tmp_path / "traj.csv"
    assert gao.main([str(traj), "--runs", str(study), "--out", str(out), "--boot", "50"]) == 0
    text = (out / "fits.md").read_text()
    assert "| grpo full loss | d(α − β log d) |" in text and "grpo no KL runs at d ± 0.05" in text
    with (out / "fits.csv").open() as f:
        fits = {(r["choice"], r["form"]): r for r in csv.DictReader(f)}
    assert float(fits["grpo full loss", "rl"]["alpha"]) == pytest.approx(0.35, abs=0.02)
    assert (out / "gao.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(gao.read_trajectories(traj)) == 6 * 40
