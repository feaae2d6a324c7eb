"""Tests for klpo.lab.montecarlo and klpo.lab.stats: seeded, tolerances of 4 standard errors.

The oracles are the exact values of klpo.lab.exact (closed forms, quadrature, enumeration), which
test_exact.py checks against hand arithmetic and independent implementations.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo.lab.distributions import SequencePair, num_prefixes
from klpo.lab.exact import analyse, gaussian_moments, gaussian_quadrature
from klpo.lab.montecarlo import (
    GAUSSIAN_ESTIMATORS,
    gaussian_monte_carlo,
    monte_carlo,
    sample_indices,
)
from klpo.lab.ref_is import AdaptiveMix
from klpo.lab.stats import RunningStats, ValueStats, cosine, relative_error


@pytest.mark.parametrize("mu", [0.1, 1.0])
def test_schulman_table_monte_carlo_within_4_se_of_the_closed_forms(mu):
    """Mean and sd of k1, k2, k3 (and ref_is) for N(0, 1) vs N(mu, 1), 10^6 samples."""
    stats = gaussian_monte_carlo(mu, 1_000_000, seed=7, names=("k1", "k2", "k3", "ref_is"))
    for name, s in stats.items():
        mean, var, frac = gaussian_moments(name, mu)
        assert abs(s.mean - mean) <= 4 * s.stderr, name
        assert abs(s.sd - math.sqrt(var)) <= 4 * s.sd_stderr, name
        se_frac = math.sqrt(frac * (1 - frac) / s.samples)
        assert abs(s.frac_negative - frac) <= 4 * se_frac + 1e-12, name


def test_every_gaussian_estimator_within_4_se_of_quadrature():
    mu = 0.6
    stats = gaussian_monte_carlo(mu, 400_000, seed=3, chunk=100_000)
    assert set(stats) == set(GAUSSIAN_ESTIMATORS)
    for name, s in stats.items():
        mean, var, _ = gaussian_quadrature(name, mu)
        assert abs(s.mean - mean) <= 4 * s.stderr, name
        if name != "adaptive_mix":  # the stream's weight varies around a*; its sd is not a*'s
            assert abs(s.sd - math.sqrt(var)) <= 4 * s.sd_stderr, name
    assert stats["k1+"].mean == stats["k1"].mean  # same samples, same values
    assert stats["adaptive_mix"].samples == 400_000


def test_gaussian_monte_carlo_is_seeded_and_chunking_does_not_matter():
    a = gaussian_monte_carlo(1.0, 10_000, seed=1, names=("k3",), chunk=10_000)["k3"]
    b = gaussian_monte_carlo(1.0, 10_000, seed=1, names=("k3",), chunk=10_000)["k3"]
    assert a == b
    with pytest.raises(ValueError, match="not defined for a Gaussian"):
        gaussian_monte_carlo(1.0, 10, names=("full",))


def test_running_stats_merge_equals_numpy():
    x = np.random.default_rng(0).standard_exponential(10_007) * 3 + 100.0  # skewed, offset
    rs = RunningStats()
    for part in np.array_split(x, 7):
        rs.add(torch.from_numpy(part))
    s = rs.result(target=100.0)
    dev = x - x.mean()
    assert s.mean == pytest.approx(x.mean(), rel=1e-14)
    assert s.sd == pytest.approx(x.std(), rel=1e-12)
    assert s.m4 == pytest.approx(np.mean(dev**4), rel=1e-10)
    assert rs.m3 / rs.n == pytest.approx(np.mean(dev**3), rel=1e-10)
    assert s.frac_negative == 0.0 and s.samples == 10_007


def test_value_stats_fields_by_hand():
    # values (1, 3) with probabilities (3/4, 1/4): mean 1.5, var 3/4·0.25 + 1/4·2.25 = 0.75
    s = ValueStats.weighted(torch.tensor([1.0, 3.0]), torch.tensor([0.75, 0.25]), target=1.0)
    d = s.to_dict(("mean", "bias", "sd", "rmse", "bias_rel", "sd_rel", "frac_negative"))
    assert d == pytest.approx(
        {"mean": 1.5, "bias": 0.5, "sd": math.sqrt(0.75), "rmse": 1.0, "bias_rel": 0.5,
         "sd_rel": math.sqrt(0.75), "frac_negative": 0.0}
    )  # fmt: skip
    # a value nobody samples, even infinite, does no harm
    s = ValueStats.weighted(torch.tensor([1.0, math.inf]), torch.tensor([1.0, 0.0]), target=1.0)
    assert (s.mean, s.sd) == (1.0, 0.0)


def test_cosine_and_relative_error():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0])
    assert cosine(a, b) == pytest.approx(1 / math.sqrt(2))
    assert math.isnan(cosine(torch.tensor([1e-17, 0.0]), b))  # zero up to rounding
    assert relative_error(2 * b, b) == pytest.approx(1.0)


def test_sample_indices_frequencies():
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    n = 200_000
    counts = torch.bincount(sample_indices(probs, n, torch.Generator().manual_seed(0)), minlength=3)
    se = (probs * (1 - probs) / n).sqrt()
    assert ((counts / n - probs).abs() <= 4 * se).all()


def _check_against_exact(pair: SequencePair, samples: int, seed: int) -> None:
    ex = analyse(pair)
    mc = monte_carlo(pair, samples, seed=seed)
    for name, v in mc.values.items():
        assert abs(v.mean - ex.values[name].mean) <= 4 * v.stderr + 1e-12, name
    for name, by_p in mc.gradients.items():
        for p, (mean, var) in by_p.items():
            se = (var / samples).sqrt()
            diff = (mean - ex.gradients[name][p]).abs()
            assert bool((diff <= 4 * se + 1e-12).all()), (name, p, float((diff / se).max()))


def test_categorical_monte_carlo_within_4_se_of_exact():
    _check_against_exact(
        SequencePair.from_probabilities([0.7, 0.2, 0.1], [0.5, 0.3, 0.2]), 200_000, 1
    )


def test_sequence_monte_carlo_within_4_se_of_exact():
    gen = torch.Generator().manual_seed(2)
    shape = (num_prefixes(3, 2), 3)
    pair = SequencePair(
        torch.randn(shape, generator=gen, dtype=torch.float64),
        torch.randn(shape, generator=gen, dtype=torch.float64),
        vocab=3,
        length=2,
    )
    _check_against_exact(pair, 200_000, 3)


def test_monte_carlo_per_sample_gradient_variance_by_hand():
    """k1 in the loss, pi = (1/2, 1/2): per-sample gradient e_y - pi = ±(1/2, -1/2), variance 1/4."""
    pair = SequencePair.from_probabilities([0.5, 0.5], [0.25, 0.75])
    mc = monte_carlo(pair, 10_000, seed=0, names=("k1",))
    mean, var = mc.gradients["k1"]["loss"]
    f0 = float(mean[0, 0]) + 0.5  # mean = f0 (1/2) + (1 - f0)(-1/2) = f0 - 1/2
    np.testing.assert_allclose(var[0].numpy(), [f0 * (1 - f0)] * 2, rtol=1e-12)
    assert abs(f0 - 0.5) <= 4 * math.sqrt(0.25 / 10_000)


def test_adaptive_mix_monte_carlo_is_unbiased():
    pair = SequencePair.from_probabilities([0.6, 0.3, 0.1], [0.2, 0.3, 0.5])
    mc = monte_carlo(pair, 64_000, seed=4, names=("k1", "ref_is", "adaptive_mix"),
                     mix=AdaptiveMix(gamma=5.0, threshold=0.3))  # fmt: skip
    v = mc.values["adaptive_mix"]
    assert abs(v.mean - pair.kl_theta_ref) <= 4 * v.stderr
    assert "adaptive_mix" not in mc.gradients
