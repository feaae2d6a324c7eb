"""klpo.study.seeds against oracles: closed forms, tables, hand arithmetic, exact enumeration by a
naive second implementation, and seeded simulations whose tolerances are standard errors."""

from __future__ import annotations

import doctest
import itertools
import math

import numpy as np
import pytest

from klpo.study import seeds
from klpo.study.seeds import (
    Difference,
    betainc,
    bootstrap_interval,
    crossed_bootstrap_interval,
    decide,
    holm,
    holm_levels,
    nct_cdf,
    normal_cdf,
    normal_quantile,
    paired_test,
    power,
    seeds_needed,
    sign_flip_p,
    t_cdf,
    t_interval,
    t_quantile,
    two_sample_permutation_p,
    verdict,
    welch_test,
)


def _within(rate: float, expected: float, reps: int, z: float = 4.0) -> bool:
    """A simulated rate within ``z`` binomial standard errors of ``expected``."""
    return abs(rate - expected) <= z * math.sqrt(expected * (1 - expected) / reps)


def test_docstring_examples() -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(exclude_empty=True).find(seeds, "klpo.study.seeds"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 20 and result.failed == 0


# --- distributions -------------------------------------------------------------------------


@pytest.mark.parametrize("x", [0.01, 0.2, 0.5, 0.77, 0.999])
def test_betainc_closed_forms(x: float) -> None:
    assert betainc(1.0, 1.0, x) == pytest.approx(x, abs=1e-14)
    assert betainc(3.5, 1.0, x) == pytest.approx(x**3.5, rel=1e-12)  # I_x(a, 1) = x^a
    assert betainc(1.0, 2.5, x) == pytest.approx(1 - (1 - x) ** 2.5, rel=1e-12)
    # the arcsine law: I_x(1/2, 1/2) = (2 / pi) asin(sqrt(x))
    assert betainc(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), rel=1e-12)
    # I_x(2, 3) = 6x² - 8x³ + 3x⁴ (the Beta(2, 3) CDF integrated by hand)
    assert betainc(2.0, 3.0, x) == pytest.approx(6 * x**2 - 8 * x**3 + 3 * x**4, rel=1e-12)
    assert betainc(7.0, 2.0, x) == pytest.approx(1 - betainc(2.0, 7.0, 1 - x), abs=1e-14)


def test_betainc_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="a and b must be positive"):
        betainc(0.0, 1.0, 0.5)
    with pytest.raises(ValueError, match=r"x must lie in \[0, 1\]"):
        betainc(1.0, 1.0, 1.5)


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 4.0, 250.0])
def test_t_cdf_closed_forms(t: float) -> None:
    assert t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
    assert t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)
    u = t / math.sqrt(3)
    three = 0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi
    assert t_cdf(t, 3) == pytest.approx(three, abs=1e-13)
    assert t_cdf(t, math.inf) == normal_cdf(t)
    assert t_cdf(t, 1e7) == pytest.approx(normal_cdf(t), abs=1e-6)


# Student's table: two-sided 95% and 99% critical values (upper 0.975 and 0.995 quantiles).
T_TABLE = [
    (1, 12.706, 63.657),
    (2, 4.303, 9.925),
    (3, 3.182, 5.841),
    (4, 2.776, 4.604),
    (5, 2.571, 4.032),
    (7, 2.365, 3.499),
    (10, 2.228, 3.169),
    (20, 2.086, 2.845),
    (30, 2.042, 2.750),
]


@pytest.mark.parametrize(("df", "q975", "q995"), T_TABLE)
def test_t_quantile_matches_the_table(df: int, q975: float, q995: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(q975, abs=6e-4)
    assert t_quantile(0.995, df) == pytest.approx(q995, abs=6e-4)
    assert t_quantile(0.025, df) == pytest.approx(-t_quantile(0.975, df), rel=1e-12)
    assert t_cdf(t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-12)


def test_normal_quantile_matches_the_table() -> None:
    for p, z in ((0.975, 1.959964), (0.995, 2.575829), (0.8, 0.841621), (0.5, 0.0)):
        assert normal_quantile(p) == pytest.approx(z, abs=1e-6)
    with pytest.raises(ValueError, match=r"p must lie in \(0, 1\)"):
        normal_quantile(1.0)


@pytest.mark.parametrize("df", [1, 2, 5, 30])
def test_nct_reduces_to_its_special_cases(df: int) -> None:
    for t in (-3.0, -0.5, 0.4, 2.0, 6.0):
        assert nct_cdf(t, df, 0.0) == pytest.approx(t_cdf(t, df), abs=2e-7)  # central
    for nc in (-1.5, 0.5, 3.0):
        assert nct_cdf(0.0, df, nc) == pytest.approx(normal_cdf(-nc), abs=2e-7)  # T <= 0
    # df -> infinity: S -> 1, T -> N(nc, 1)
    assert nct_cdf(1.3, 1e6, 0.8) == pytest.approx(normal_cdf(0.5), abs=1e-4)


def test_nct_against_simulation() -> None:
    rng = np.random.default_rng(0)
    reps = 200_000
    for df, nc, t in ((2, 1.0, 2.5), (4, 2.0, 3.0), (9, -1.0, -0.2)):
        draws = (rng.standard_normal(reps) + nc) / np.sqrt(rng.chisquare(df, reps) / df)
        p = nct_cdf(t, df, nc)
        assert _within(float(np.mean(draws <= t)), p, reps), (df, nc, t)


def test_power_matches_the_classic_sample_sizes() -> None:
    # d = 0.5 at alpha 0.05 two-sided, power 0.8: 34 pairs (paired), 64 a group (two samples)
    assert power(0.5, 33, 0.05) < 0.8 <= power(0.5, 34, 0.05)
    assert power(0.5, 63, 0.05, paired=False) < 0.8 <= power(0.5, 64, 0.05, paired=False)
    assert power(0.0, 10, 0.05) == pytest.approx(0.05, abs=1e-6)  # no effect: the level


def test_power_against_simulated_t_tests() -> None:
    rng = np.random.default_rng(1)
    reps = 4000
    for n, effect, level in ((5, 1.2, 0.05), (8, 0.9, 0.0125)):
        d = rng.standard_normal((reps, n)) + effect
        t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
        rate = float(np.mean(np.abs(t) > t_quantile(1 - level / 2, n - 1)))
        assert _within(rate, power(effect, n, level), reps), (n, effect, rate)


# --- one cell ---------------------------------------------------------------------------------


def test_t_interval_by_hand() -> None:
    # mean 0.3, sd 0.1, t_{0.975, 2} = 4.3027: 0.3 ± 4.3027 · 0.1 / sqrt(3) = 0.3 ± 0.2484
    e = t_interval([0.2, 0.3, 0.4, math.nan])
    assert (e.n, e.mean, e.sd) == (3, pytest.approx(0.3), pytest.approx(0.1))
    assert (e.lo, e.hi) == (pytest.approx(0.05158, abs=1e-5), pytest.approx(0.54842, abs=1e-5))
    one = t_interval([0.4])
    assert one.mean == 0.4 and math.isnan(one.lo)
    assert t_interval([]).n == 0


def test_t_interval_covers_at_its_level() -> None:
    rng = np.random.default_rng(2)
    reps, hits = 4000, 0
    for _ in range(reps):
        e = t_interval(list(rng.normal(1.0, 2.0, 4)))
        hits += e.lo <= 1.0 <= e.hi
    assert _within(hits / reps, 0.95, reps)


def test_bootstrap_covers_as_its_large_sample_form_says() -> None:
    # The percentile bootstrap of a mean is about mean ± z · s sqrt((n-1)/n) / sqrt(n), whose
    # coverage is P(|T_{n-1}| <= z sqrt((n-1)/n)): 0.936 at n = 30 (under the t-interval's 0.95).
    n, reps = 30, 600
    expected = 2 * t_cdf(1.959964 * math.sqrt((n - 1) / n), n - 1) - 1
    rng = np.random.default_rng(3)
    hits = 0
    for i in range(reps):
        lo, hi = bootstrap_interval(list(rng.normal(0.0, 1.0, n)), n_boot=1000, seed=i)
        hits += lo <= 0.0 <= hi
    assert _within(hits / reps, expected, reps)
    assert bootstrap_interval([0.1, 0.3], seed=5) == bootstrap_interval([0.1, 0.3], seed=5)
    assert all(math.isnan(x) for x in bootstrap_interval([0.1]))


def test_crossed_bootstrap_covers_where_a_seed_bootstrap_does_not() -> None:
    """Seeds × problems with both factors random (y = mu + a_seed + b_problem + e): the
    pigeonhole bootstrap covers mu at least at its level; resampling only the seeds (each
    seed's mean over the problems) misses the problems' variance and falls far short."""
    s, p, reps = 4, 30, 300
    sd_seed, sd_problem, sd_noise = 0.2, 2.0, 0.3
    rng = np.random.default_rng(4)
    crossed = seed_only = 0
    for i in range(reps):
        y = (
            rng.normal(0, sd_seed, (s, 1))
            + rng.normal(0, sd_problem, (1, p))
            + rng.normal(0, sd_noise, (s, p))
        )
        lo, hi = crossed_bootstrap_interval(y, n_boot=400, seed=i)
        crossed += lo <= 0.0 <= hi
        lo, hi = bootstrap_interval(list(y.mean(axis=1)), n_boot=400, seed=i)
        seed_only += lo <= 0.0 <= hi
    assert crossed / reps >= 0.95 - 4 * math.sqrt(0.95 * 0.05 / reps)
    # the seed bootstrap's spread is at most that of the seed part of the grand mean's
    # variance, so it covers at most P(|Z| <= 1.96 sqrt(V_seed / (V_seed + V_problem)))
    v_seed = sd_seed**2 / s + sd_noise**2 / (s * p)
    bound = 2 * normal_cdf(1.959964 * math.sqrt(v_seed / (v_seed + sd_problem**2 / p))) - 1
    assert seed_only / reps <= bound + 4 * math.sqrt(bound * (1 - bound) / reps)


def test_crossed_bootstrap_by_hand_and_refusals() -> None:
    assert crossed_bootstrap_interval([[0.5, 0.5], [0.5, 0.5]]) == (0.5, 0.5)
    with pytest.raises(ValueError, match=r"\[seeds, problems\] with 2\+ seeds"):
        crossed_bootstrap_interval([[1.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        crossed_bootstrap_interval([[1.0, math.nan], [0.0, 1.0]])


# --- two cells --------------------------------------------------------------------------------


def _naive_sign_flip(d: list[float]) -> float:
    obs = abs(sum(d))
    hits = sum(
        abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= obs - 1e-12
        for signs in itertools.product((1, -1), repeat=len(d))
    )
    return hits / 2 ** len(d)


def test_sign_flip_by_enumeration() -> None:
    assert sign_flip_p([1.0, 2.0, 3.0]) == 0.25  # ±1±2±3: only +6 and -6 reach 6
    assert sign_flip_p([1.0, -1.0]) == 1.0
    assert sign_flip_p([0.5] * 8) == pytest.approx(2 / 256)  # the floor on 8 seeds
    rng = np.random.default_rng(5)
    for n in (5, 11):
        d = list(rng.normal(0.3, 1.0, n))
        assert sign_flip_p(d) == pytest.approx(_naive_sign_flip(d), abs=1e-15)
    d = list(rng.normal(0.2, 1.0, 18))  # past 16 seeds: the split enumeration
    full = np.array(list(itertools.product((1.0, -1.0), repeat=18))) @ np.array(d)
    naive = float(np.mean(np.abs(full) >= abs(sum(d)) - 1e-12))
    assert sign_flip_p(d) == pytest.approx(naive, abs=1e-15)
    with pytest.raises(ValueError, match="exact up to 24"):
        sign_flip_p([1.0] * 25)


def test_sign_flip_is_valid_under_the_null() -> None:
    rng = np.random.default_rng(6)
    reps = 2000
    rate = np.mean([sign_flip_p(list(rng.standard_normal(8))) <= 0.05 for _ in range(reps)])
    assert rate <= 0.05 + 4 * math.sqrt(0.05 * 0.95 / reps)


def test_two_sample_permutation_by_enumeration() -> None:
    # splits of {1,2,3,4} into pairs: |mean diff| = 2 for {3,4}|{1,2} and {1,2}|{3,4}, of 6
    assert two_sample_permutation_p([3.0, 4.0], [1.0, 2.0]) == pytest.approx(1 / 3)
    a, b = [0.1, 0.5, 0.4], [0.2, 0.0, -0.3, 0.05]
    pooled = a + b
    obs = abs(np.mean(a) - np.mean(b))
    hits = [
        abs(
            np.mean([pooled[i] for i in idx])
            - np.mean([pooled[i] for i in range(7) if i not in idx])
        )
        >= obs - 1e-12
        for idx in itertools.combinations(range(7), 3)
    ]
    assert two_sample_permutation_p(a, b) == pytest.approx(np.mean(hits))


def test_paired_test_by_hand() -> None:
    # d = 0.10, 0.05, 0.10: mean 0.08333, sd 0.02887, t = 0.08333 / (0.02887 / sqrt 3) = 5.0;
    # df 2: P(|T| > 5) = 1 - 5 / sqrt(2 + 25) = 0.03775
    r = paired_test([0.30, 0.25, 0.40], [0.20, 0.20, 0.30])
    assert (r.n, r.df, r.paired) == (3, 2, True)
    assert r.t == pytest.approx(5.0)
    assert r.p == pytest.approx(1 - 5 / math.sqrt(27), rel=1e-10)
    assert r.p_perm == 0.25
    assert (r.mean_a, r.mean_b) == (
        pytest.approx(0.31667, abs=1e-5),
        pytest.approx(0.23333, abs=1e-5),
    )
    assert r.lo < r.diff < r.hi


def test_paired_test_edges() -> None:
    same = paired_test([0.2, 0.3], [0.1, 0.2])  # every seed +0.1: no spread
    assert same.p == 0.0 and math.isinf(same.t)
    none = paired_test([0.2, 0.3], [0.2, 0.3])
    assert none.p == 1.0
    # 0.17 - 0.18 + 0.26 - 0.25 ... sums to 1e-17 in floats: no difference, not a tiny one
    rounded = paired_test([0.17, 0.11, 0.26], [0.18, 0.11, 0.25])
    assert rounded.diff == 0.0 and seeds_needed(rounded, 0.05) is None
    one = paired_test([0.2, math.nan], [0.1, 0.3])  # the NaN pair dropped: one left
    assert one.n == 1 and math.isnan(one.p)
    with pytest.raises(ValueError, match="pair seed by seed"):
        paired_test([0.1, 0.2], [0.1])


def test_paired_test_is_valid_under_the_null_and_sees_a_shift() -> None:
    rng = np.random.default_rng(7)
    reps = 3000
    seed_effect = rng.normal(0, 1, (reps, 3))  # shared by both cells of a seed: pairing removes it
    a = seed_effect + rng.normal(0, 0.2, (reps, 3))
    b = seed_effect + rng.normal(0, 0.2, (reps, 3))
    rate = np.mean([paired_test(list(x), list(y)).p < 0.05 for x, y in zip(a, b, strict=True)])
    assert _within(float(rate), 0.05, reps)
    shifted = np.mean(
        [
            paired_test(list(x + 0.5), list(y)).p < 0.05
            for x, y in zip(a[:500], b[:500], strict=True)
        ]
    )
    # the paired test has the power of the differences' spread, 0.2 sqrt 2; Welch, blind to the
    # pairing, sees the shift through the seeds' spread of 1 and barely finds it
    assert _within(float(shifted), power(0.5 / (0.2 * math.sqrt(2)), 3, 0.05), 500)
    unpaired = np.mean(
        [welch_test(list(x + 0.5), list(y)).p < 0.05 for x, y in zip(a[:500], b[:500], strict=True)]
    )
    assert unpaired < 0.2


def test_welch_by_hand() -> None:
    # a = 1,2,3 (var 1), b = 4,5,6 (var 1): se = sqrt(1/3 + 1/3), t = -3 / 0.8165 = -3.674;
    # df = (2/3)² / ((1/3)²/2 · 2) = 4
    r = welch_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert r.t == pytest.approx(-3 / math.sqrt(2 / 3)) and r.df == pytest.approx(4.0)
    assert r.p == pytest.approx(2 * t_cdf(-3 / math.sqrt(2 / 3), 4))
    assert r.p_perm == pytest.approx(2 / 20) and not r.paired
    # unequal variances: a var 1 (n 3), b var 16 (n 5): df = (1/3 + 16/5)² / ((1/3)²/2 + (16/5)²/4)
    b = [0.0, 4.0, 8.0, -4.0, 2.0]
    vb = float(np.var(b, ddof=1))
    r = welch_test([1.0, 2.0, 3.0], b)
    want = (1 / 3 + vb / 5) ** 2 / ((1 / 3) ** 2 / 2 + (vb / 5) ** 2 / 4)
    assert r.df == pytest.approx(want)


def test_welch_is_valid_with_unequal_spreads() -> None:
    rng = np.random.default_rng(8)
    reps = 2500
    rate = np.mean(
        [
            welch_test(list(rng.normal(0, 1, 4)), list(rng.normal(0, 3, 7))).p < 0.05
            for _ in range(reps)
        ]
    )
    assert _within(float(rate), 0.05, reps)


# --- a family ---------------------------------------------------------------------------------


def _holm_rejects(ps: list[float], alpha: float) -> list[bool]:
    """Holm's procedure as written: reject in order of p while p_(i) <= alpha / (m - i)."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out = [False] * len(ps)
    for rank, i in enumerate(order):
        if ps[i] >= alpha / (len(ps) - rank):
            break
        out[i] = True
    return out


def test_holm_by_hand_and_against_the_procedure() -> None:
    # sorted 0.005 (x4 = 0.02), 0.01 (x3 = 0.03), 0.03 (x2 = 0.06), 0.04 (x1, max 0.06)
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    adjusted = holm([0.01, math.nan])  # an untested comparison counts in m as a 1
    assert adjusted[0] == pytest.approx(0.02) and math.isnan(adjusted[1])
    rng = np.random.default_rng(9)
    for _ in range(300):
        ps = list(rng.uniform(0, 0.1, rng.integers(1, 9)))
        for alpha in (0.01, 0.05):
            assert [p < alpha for p in holm(ps)] == _holm_rejects(ps, alpha)
    assert holm_levels([0.2, 0.01, 0.5, 0.03]) == pytest.approx([0.025, 0.0125, 0.05, 0.05 / 3])


def test_seeds_needed_is_the_smallest_with_the_power() -> None:
    def test_of(diff: float, sd: float, paired: bool = True) -> Difference:
        return Difference(3, diff, 0, 0, 0, 2, 0.5, 0.5, sd, paired)

    assert seeds_needed(test_of(0.5, 1.0), 0.05) == 34  # the classic table again
    assert seeds_needed(test_of(-0.5, 1.0, paired=False), 0.05) == 64
    for diff, sd, level in ((0.03, 0.05, 0.0125), (0.2, 0.1, 0.001), (0.01, 0.04, 0.05)):
        n = seeds_needed(test_of(diff, sd), level)
        assert n is not None and power(diff / sd, n, level) >= 0.8
        assert n == 2 or power(diff / sd, n - 1, level) < 0.8
    assert seeds_needed(test_of(0.0, 0.1), 0.05) is None  # no difference: no number of seeds
    assert seeds_needed(test_of(0.1, 0.0), 0.05) == 2  # no spread: the smallest t-test
    assert seeds_needed(test_of(0.001, 1.0), 0.05) is None  # beyond MAX_SEEDS


def test_seeds_needed_reaches_its_power_in_simulation() -> None:
    level, effect = 0.05, 1.0
    n = seeds_needed(Difference(3, effect, 0, 0, 0, 2, 0.5, 0.5, 1.0, True), level)
    assert n == 10  # the tables: d = 1.0 needs 10 pairs
    rng = np.random.default_rng(10)
    reps = 3000
    d = rng.standard_normal((reps, n)) + effect
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(n))
    rate = float(np.mean(np.abs(t) > t_quantile(1 - level / 2, n - 1)))
    assert _within(rate, power(effect, n, level), reps) and rate >= 0.8 - 4 * math.sqrt(0.16 / reps)


def test_verdict_words_come_from_the_corrected_test() -> None:
    up = paired_test([0.30, 0.25, 0.40, 0.5], [0.20, 0.20, 0.30, 0.4])  # every seed up
    assert verdict(up, 0.01, None, a="full", b="k3").startswith("differs: full above k3")
    assert verdict(up, 0.01, None, claim=">").startswith("holds")
    assert verdict(up, 0.01, None, claim="<").startswith("differs")
    assert verdict(up, 0.01, None, claim="=").startswith("differs")
    assert verdict(up, 0.2, 7, claim=">") == (
        "not decided (about 7 seeds would decide it at the observed spread)"
    )
    flat = paired_test([0.2, 0.3, 0.1], [0.1, 0.3, 0.2])
    assert verdict(flat, 1.0, None) == (
        "not decided (no number of seeds would decide it: the observed difference is 0)"
    )
    # "=" is never "holds", however large p is
    assert not verdict(flat, 1.0, None, claim="=").startswith("holds")
    # 4 seeds all up: the sign-flip check's floor 2/16 = 0.125 is above alpha, and it says so
    assert "floor on 4 seeds" in verdict(up, 0.01, None)


def test_decide_applies_holm_over_the_family() -> None:
    strong = paired_test([0.5, 0.6, 0.55, 0.52, 0.58, 0.61], [0.1, 0.15, 0.12, 0.1, 0.14, 0.2])
    weak = paired_test([0.30, 0.25, 0.40], [0.20, 0.20, 0.30])  # p = 0.038 alone
    alone = decide([("weak", weak)])
    assert alone[0].verdict.startswith("differs") and alone[0].seeds is None
    family = decide([("strong", strong), ("weak", weak)], names=[("a", "b"), ("c", "d")])
    assert family[0].p_holm == pytest.approx(2 * strong.p)
    assert family[0].verdict.startswith("differs: a above b")
    assert family[1].p_holm == pytest.approx(weak.p) and weak.p < 0.05
    assert family[1].level == 0.05  # second of two: its level is alpha / 1 ...
    assert family[1].verdict.startswith("differs")  # ... so Holm lets it through after strong
    three = decide([("strong", strong), ("weak", weak), ("weak again", weak)])
    assert [d.verdict.split(" ")[0] for d in three] == ["differs:", "not", "not"]
    assert three[1].seeds == seeds_needed(weak, three[1].level) and three[1].seeds > 3


def test_crossed_bootstrap_equals_the_naive_subtable_means() -> None:
    """The counts form (w_rowᵀ T w_col / (S P)) against averaging each drawn S × P sub-table,
    with the same draws."""
    rng = np.random.default_rng(11)
    table = rng.normal(size=(4, 7))
    n_boot = 300
    draws = np.random.default_rng(3)
    rows = draws.integers(0, 4, size=(n_boot, 4))
    cols = draws.integers(0, 7, size=(n_boot, 7))
    naive = [table[np.ix_(r, c)].mean() for r, c in zip(rows, cols, strict=True)]
    want = tuple(np.quantile(naive, [0.025, 0.975]))
    assert crossed_bootstrap_interval(table, n_boot=n_boot, seed=3) == pytest.approx(want)
