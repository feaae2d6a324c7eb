"""Tests for klpo.lab.exact: Gaussian closed forms, and values and gradients by enumeration.

Oracles: Schulman's Gaussian table (2020) and two hand-checked examples (a categorical and a
2-step sequence model); a worked 2-step example
done by hand below; numpy Gauss-Hermite quadrature; ``klpo.kl.expected_value_and_gradient`` (the
library's own one-step enumeration); finite differences of a numpy sequence KL; and a naive loop
that differentiates each sequence's loss by autograd.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from klpo import kl
from klpo.lab.distributions import SequencePair, num_prefixes, prefixes
from klpo.lab.exact import (
    LAB_ESTIMATORS,
    Tables,
    _mix_frac_negative,
    analyse,
    gaussian_moments,
    gaussian_quadrature,
    gradient_moments,
    placement_terms,
    true_gradients,
)
from klpo.lab.ref_is import AdaptiveMix

# ---------------------------------------------------------------------------------------------
# Gaussians.


def test_gaussian_closed_forms_reproduce_schulmans_table():
    # sd/true and bias/true at mu = 0.1 (KL 0.005) and mu = 1 (0.5), Schulman (2020) to 3 digits
    for mu, kl_true, k2_bias, sds in (
        (0.1, 0.005, 0.0025, {"k1": 20.0, "k2": 1.417745, "k3": 1.416575}),
        (1.0, 0.5, 0.25, {"k1": 2.0, "k2": 1.732051, "k3": 1.695030}),
    ):
        for name, sd in sds.items():
            mean, var, _ = gaussian_moments(name, mu)
            assert math.sqrt(var) / kl_true == pytest.approx(sd, abs=1e-6)
            assert (mean - kl_true) / kl_true == pytest.approx(k2_bias if name == "k2" else 0.0)


def _hermite(f, n=160):
    """E[f(z)], z ~ N(0, 1), by numpy's Gauss-Hermite (probabilists') rule."""
    z, w = np.polynomial.hermite_e.hermegauss(n)
    return float(np.sum(w * f(z)) / math.sqrt(2 * math.pi))


@pytest.mark.parametrize("mu", [0.1, 0.7, 1.5])
def test_gaussian_closed_forms_match_gauss_hermite(mu):
    d = lambda z: mu * mu / 2 - mu * z  # noqa: E731  x = z ~ N(0, 1): d = log q - log p
    forms = {
        "k1": lambda z: d(z),
        "k2": lambda z: d(z) ** 2 / 2,
        "k3": lambda z: np.exp(-d(z)) + d(z) - 1,
        # x = mu + z ~ N(mu, 1): log w = mu²/2 - mu x = -mu²/2 - mu z
        "ref_is": lambda z: np.exp(-mu * mu / 2 - mu * z) * (-mu * mu / 2 - mu * z),
    }
    for name, f in forms.items():
        mean = _hermite(f)
        var = _hermite(lambda z, f=f, mean=mean: (f(z) - mean) ** 2)
        exact_mean, exact_var, _ = gaussian_moments(name, mu)
        assert exact_mean == pytest.approx(mean, rel=1e-10)
        assert exact_var == pytest.approx(var, rel=1e-8)


@pytest.mark.parametrize("mu", [0.05, 1.0, 3.0])
def test_gaussian_quadrature_matches_closed_forms(mu):
    for name in ("k1", "k2", "k3", "ref_is"):
        q, c = gaussian_quadrature(name, mu), gaussian_moments(name, mu)
        assert q[0] == pytest.approx(c[0], rel=1e-12)
        assert q[1] == pytest.approx(c[1], rel=1e-12)
        assert q[2] == pytest.approx(c[2], abs=2e-4)  # P(< 0): an indicator on the grid
    # P(k1 < 0) = Phi(-mu/2): mu = 1 gives Phi(-0.5) = 0.3085375
    assert gaussian_moments("k1", 1.0)[2] == pytest.approx(0.3085375, abs=1e-7)


def test_gaussian_quadrature_of_other_estimators():
    # k3_is on-policy is k3; k1+ is k1 in value; kl_ref_theta is unbiased for KL(p ‖ q) = mu²/2.
    assert gaussian_quadrature("k3_is", 1.0) == pytest.approx(gaussian_quadrature("k3", 1.0))
    assert gaussian_quadrature("kl_ref_theta", 1.0)[0] == pytest.approx(0.5, rel=1e-12)
    # abs: E|d| for d ~ N(m, s²), m = 1/2, s = 1: s sqrt(2/pi) e^{-m²/2s²} + m (1 - 2 Phi(-m/s))
    m = 0.5
    e_abs = math.sqrt(2 / math.pi) * math.exp(-m * m / 2) + m * (1 - math.erfc(m / math.sqrt(2)))
    assert gaussian_quadrature("abs", 1.0)[0] == pytest.approx(e_abs, rel=1e-7)
    # adaptive_mix at steady state: unbiased, variance a² Var k1 + (1 - a)² Var ref_is
    mix = AdaptiveMix(gamma=3.0, threshold=0.2)
    a = 1 / (1 + math.exp(-3.0 * (0.5 - 0.2)))
    mean, var, _ = gaussian_quadrature("adaptive_mix", 1.0, mix=mix)
    assert mean == pytest.approx(0.5, rel=1e-12)
    v1, v2 = gaussian_moments("k1", 1.0)[1], gaussian_moments("ref_is", 1.0)[1]
    assert var == pytest.approx(a * a * v1 + (1 - a) ** 2 * v2, rel=1e-12)
    with pytest.raises(ValueError, match="vocabulary"):
        gaussian_quadrature("full", 1.0)


# ---------------------------------------------------------------------------------------------
# One categorical step.


def _random_pairs(seed: int, n: int):
    gen = torch.Generator().manual_seed(seed)
    for i in range(n):
        v = 2 + i % 5
        scale = (0.5, 1.0, 2.5)[i % 3]
        yield SequencePair.categorical(
            scale * torch.randn(v, generator=gen, dtype=torch.float64),
            scale * torch.randn(v, generator=gen, dtype=torch.float64),
        )


def test_categorical_agrees_with_the_librarys_own_enumeration():
    """For one step, every estimator and placement equals klpo.kl.expected_value_and_gradient."""
    for pair in _random_pairs(3, 6):
        ex = analyse(pair)
        for name in kl.ESTIMATORS:
            for placement in kl.PLACEMENTS:
                value, grad = kl.expected_value_and_gradient(
                    name, placement, pair.logits[0], pair.logits_ref[0]
                )
                assert ex.values[name].mean == pytest.approx(value, rel=1e-12, abs=1e-14)
                torch.testing.assert_close(
                    ex.gradients[name][placement][0], grad, rtol=1e-10, atol=1e-13
                )


def test_hand_checked_categorical_oracle():
    """pi = (0.7, 0.2, 0.1), pi_ref = (0.5, 0.3, 0.2): values and gradients checked by hand."""
    ex = analyse(SequencePair.from_probabilities([0.7, 0.2, 0.1], [0.5, 0.3, 0.2]))
    assert ex.kl_theta_ref == pytest.approx(0.085123, abs=1e-6)
    assert ex.kl_ref_theta == pytest.approx(0.092033, abs=1e-6)
    assert ex.values["k2"].mean == pytest.approx(0.080088, abs=1e-6)
    true = [0.175945, -0.098118, -0.077827]
    g = {(n, p): ex.gradients[n][p][0].numpy() for n in ex.gradients for p in ex.gradients[n]}
    np.testing.assert_allclose(ex.grad_theta_ref[0].numpy(), true, atol=1e-6)
    np.testing.assert_allclose(ex.grad_ref_theta[0].numpy(), [0.2, -0.1, -0.1], atol=1e-12)
    np.testing.assert_allclose(g["k1", "loss"], [0, 0, 0], atol=1e-15)
    for key in (("k1", "reward"), ("k2", "loss"), ("k3", "reward+loss"), ("ref_is", "loss")):
        np.testing.assert_allclose(g[key], true, atol=1e-6)
    np.testing.assert_allclose(g["k3", "loss"], [0.2, -0.1, -0.1], atol=1e-12)
    np.testing.assert_allclose(g["k3", "reward"], [-0.024055, 0.001882, 0.022173], atol=1e-6)


def test_k3_loss_follows_grad_kl_ref_theta_worked_example():
    # pi = (1/2, 1/2), pi_ref = (1/4, 3/4). E_pi[(1 - ref/pi)(e_y - pi)] = (pi - ref) - pi sum(pi - ref)
    # = (1/4, -1/4); grad KL(pi_ref ‖ pi) = pi - pi_ref = (1/4, -1/4) as well.
    # grad KL(pi ‖ ref) = pi (log(pi/ref) - KL), KL = (ln 2 + ln(2/3))/2 = 0.1438410:
    # (0.5 (0.6931472 - 0.1438410), 0.5 (-0.4054651 - 0.1438410)) = (0.2746531, -0.2746531).
    ex = analyse(SequencePair.from_probabilities([0.5, 0.5], [0.25, 0.75]))
    np.testing.assert_allclose(ex.gradients["k3"]["loss"][0].numpy(), [0.25, -0.25], atol=1e-15)
    np.testing.assert_allclose(ex.grad_theta_ref[0].numpy(), [0.2746531, -0.2746531], atol=1e-7)
    np.testing.assert_allclose(
        ex.gradients["k2"]["loss"][0].numpy(), [0.2746531, -0.2746531], atol=1e-7
    )


def test_exact_value_statistics_by_hand():
    # pi = (1/2, 1/2), pi_ref = (1/4, 3/4): k1 takes ln 2 = 0.6931472 and ln(2/3) = -0.4054651,
    # each with probability 1/2: mean 0.1438410, sd = (0.6931472 + 0.4054651)/2 = 0.5493061.
    ex = analyse(SequencePair.from_probabilities([0.5, 0.5], [0.25, 0.75]), gradients=False)
    v = ex.values["k1"]
    assert (v.mean, v.sd, v.frac_negative) == pytest.approx((0.1438410, 0.5493061, 0.5), abs=1e-7)
    assert v.bias == pytest.approx(0.0, abs=1e-15)
    # ref_is over pi_ref: w = (2, 2/3): values 2 ln 2 = 1.3862944 (prob 1/4) and (2/3) ln(2/3)
    # = -0.2703101 (prob 3/4): mean 0.3465736 - 0.2027326 = 0.1438410 = KL, P(< 0) = 3/4.
    r = ex.values["ref_is"]
    assert (r.mean, r.frac_negative) == pytest.approx((0.1438410, 0.75), abs=1e-7)


def test_mix_frac_negative_matches_brute_force_pairs():
    gen = torch.Generator().manual_seed(4)
    x, y = (
        torch.randn(7, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    )
    px, py = (
        torch.rand(7, generator=gen, dtype=torch.float64),
        torch.rand(5, generator=gen, dtype=torch.float64),
    )
    px, py = px / px.sum(), py / py.sum()
    for a in (0.0, 0.1, 0.5, 0.97):
        brute = sum(
            float(px[i] * py[j])
            for i in range(7)
            for j in range(5)
            if a * x[i] + (1 - a) * y[j] < 0
        )
        assert _mix_frac_negative(a, x, px, y, py) == pytest.approx(brute, abs=1e-14)


# ---------------------------------------------------------------------------------------------
# Sequences.

SPEC_10_3 = {
    "vocab": 2,
    "length": 2,
    "policy": {"": [0.3, -0.2], "0": [0.5, 0.0], "1": [-0.4, 0.6]},
    "reference": {"": [0, 0], "0": [0, 0.3], "1": [0.2, 0]},
}


def test_hand_checked_sequence_oracle():
    """The 2-step model; parameters [root0, root1, after0_0, after0_1, after1_0, after1_1]."""
    ex = analyse(SequencePair.from_spec(SPEC_10_3))
    g = {
        (n, p): ex.gradients[n][p].flatten().numpy() for n in ex.gradients for p in ex.gradients[n]
    }
    true = [0.097785, -0.097785, 0.117024, -0.117024, -0.089075, 0.089075]
    np.testing.assert_allclose(ex.grad_theta_ref.flatten().numpy(), true, atol=1e-6)
    ref_theta = [0.122459, -0.122459, 0.098451, -0.098451, -0.140446, 0.140446]
    np.testing.assert_allclose(ex.grad_ref_theta.flatten().numpy(), ref_theta, atol=1e-6)
    np.testing.assert_allclose(g["k1", "reward"], true, atol=1e-6)
    np.testing.assert_allclose(g["k3", "reward+loss"], true, atol=1e-6)
    k2_loss = [0.117502, -0.117502, 0.117024, -0.117024, -0.089075, 0.089075]
    np.testing.assert_allclose(g["k2", "loss"], k2_loss, atol=1e-6)
    k3_loss = [0.122459, -0.122459, 0.122563, -0.122563, -0.106048, 0.106048]
    np.testing.assert_allclose(g["k3", "loss"], k3_loss, atol=1e-6)


def test_worked_two_step_example_missing_future_term():
    """Own example: root uniform for both; after token 0, pi = (3/4, 1/4) vs pi_ref = (1/2, 1/2).

    KL at prefix "0": KL0 = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.3040988 - 0.1732868 = 0.1308120; at "1": 0.
    Sequence KL = pi(0) KL0 = 0.0654060.
    True gradient at the root: KL0 · grad pi(0) = KL0 · pi(0)(e_0 - pi) = 0.1308120 · 0.5 · (0.5, -0.5)
    = (0.0327030, -0.0327030). At row "0": pi(0) · pi0 ⊙ (log(pi0/ref0) - KL0)
    = 0.5 · (0.75 · 0.2746531, 0.25 · (-0.8239592)) = (0.1029949, -0.1029949); at row "1": 0.
    Per-token k2 in the loss sees d = 0 at the root, so its root gradient is 0: it misses the
    future term. k1 as a reward with returns-to-go carries d at step 2 back to the root.
    """
    spec = {
        "vocab": 2,
        "length": 2,
        "policy": {"": [0, 0], "0": [math.log(3), 0], "1": [0, 0]},
        "reference": {"": [0, 0], "0": [0, 0], "1": [0, 0]},
    }
    ex = analyse(SequencePair.from_spec(spec))
    assert ex.kl_theta_ref == pytest.approx(0.0654060, abs=1e-7)
    true = np.array([[0.0327030, -0.0327030], [0.1029949, -0.1029949], [0.0, 0.0]])
    np.testing.assert_allclose(ex.grad_theta_ref.numpy(), true, atol=1e-7)
    np.testing.assert_allclose(ex.gradients["k1"]["reward"].numpy(), true, atol=1e-7)
    k2 = ex.gradients["k2"]["loss"].numpy()
    np.testing.assert_allclose(k2[0], [0.0, 0.0], atol=1e-15)  # the missing future term
    np.testing.assert_allclose(k2[1:], true[1:], atol=1e-7)  # correct at the last position


def _random_model(seed: int, vocab: int, length: int, scale: float = 1.0) -> SequencePair:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_prefixes(vocab, length), vocab)
    return SequencePair(
        scale * torch.randn(shape, generator=gen, dtype=torch.float64),
        scale * torch.randn(shape, generator=gen, dtype=torch.float64),
        vocab=vocab,
        length=length,
    )


def _numpy_seq_kls(logits: np.ndarray, logits_ref: np.ndarray, vocab: int, length: int):
    """KL both ways over sequences, by a plain loop over all sequences (independent of the lab)."""
    index = {p: i for i, p in enumerate(prefixes(vocab, length))}

    def logprob(table, seq):
        total = 0.0
        for t in range(length):
            row = table[index[seq[:t]]]
            row = row - row.max()
            total += row[seq[t]] - math.log(np.exp(row).sum())
        return total

    tr = rt = 0.0
    for seq in itertools.product(range(vocab), repeat=length):
        lp, lr = logprob(logits, seq), logprob(logits_ref, seq)
        tr += math.exp(lp) * (lp - lr)
        rt += math.exp(lr) * (lr - lp)
    return tr, rt


def test_true_gradients_match_finite_differences():
    pair = _random_model(5, vocab=3, length=3)
    kl_tr, kl_rt, g_tr, g_rt = true_gradients(pair)
    th, ref = pair.logits.numpy(), pair.logits_ref.numpy()
    assert (kl_tr, kl_rt) == pytest.approx(_numpy_seq_kls(th, ref, 3, 3), rel=1e-12)
    h = 1e-6
    for i, j in [(0, 0), (0, 2), (2, 1), (7, 0), (12, 2)]:
        up, down = th.copy(), th.copy()
        up[i, j] += h
        down[i, j] -= h
        fd = [
            (a - b) / (2 * h)
            for a, b in zip(
                _numpy_seq_kls(up, ref, 3, 3), _numpy_seq_kls(down, ref, 3, 3), strict=True
            )
        ]
        assert float(g_tr[i, j]) == pytest.approx(fd[0], abs=1e-8)
        assert float(g_rt[i, j]) == pytest.approx(fd[1], abs=1e-8)


def _naive_per_sample(pair: SequencePair, name: str, placement: str, seq: tuple[int, ...]):
    """One sequence's gradient by autograd: loss = sum_t est_t, reward = sum_t sg(G_t) logp_t."""
    theta = pair.logits.clone().requires_grad_(True)
    index = {p: i for i, p in enumerate(pair.prefixes)}
    rows = [index[seq[:t]] for t in range(pair.length)]
    toks = torch.tensor(seq)
    logp = torch.log_softmax(theta[rows], -1)[torch.arange(len(rows)), toks][None]
    logp_ref = torch.log_softmax(pair.logits_ref[rows], -1)[torch.arange(len(rows)), toks][None]
    if name == "full":
        est = kl.estimate(
            "full", None, None, logits=theta[rows][None], logits_ref=pair.logits_ref[rows][None]
        )
    else:
        est = kl.estimate(name, logp, logp_ref, logp_old=logp.detach())
    objective = torch.zeros((), dtype=torch.float64)
    if placement in ("loss", "reward+loss"):
        objective = objective + est.sum()
    if placement in ("reward", "reward+loss"):
        returns = est.detach().flip(-1).cumsum(-1).flip(-1)
        objective = objective + (returns * logp).sum()
    (g,) = torch.autograd.grad(objective, theta, allow_unused=True)
    return torch.zeros_like(theta) if g is None else g


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k3+", "k3_is", "low_var_kl", "full"])
def test_gradient_moments_match_naive_autograd(name):
    """Exact mean and second moment of the per-sample gradient, against a loop over sequences."""
    pair = _random_model(6, vocab=3, length=2, scale=1.5)
    tables = Tables(pair)
    probs = pair.probs
    seqs = [tuple(s) for s in pair.enumeration.tokens.tolist()]
    for placement in kl.PLACEMENTS:
        per = torch.stack([_naive_per_sample(pair, name, placement, s) for s in seqs])
        mean = (probs[:, None, None] * per).sum(0)
        second = (probs[:, None, None] * per * per).sum(0)
        got_mean, got_second = gradient_moments(
            pair, probs, *placement_terms(tables[name], placement)
        )
        torch.testing.assert_close(got_mean, mean, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(got_second, second, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("seed", [1, 2])
def test_sequence_level_gradient_identities(seed):
    """On random 3-step models: which estimator × placement follows which sequence gradient."""
    pair = _random_model(seed, vocab=3, length=3, scale=1.0)
    ex = analyse(pair)
    g = ex.gradients
    for key in (
        ("k1", "reward"),
        ("k1", "reward+loss"),
        ("k3", "reward+loss"),
        ("full", "reward+loss"),
        ("ref_is", "loss"),
    ):
        torch.testing.assert_close(g[key[0]][key[1]], ex.grad_theta_ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(
        g["k1"]["loss"], torch.zeros_like(ex.grad_theta_ref), rtol=0, atol=1e-15
    )
    # per-token k2 / full in the loss: right at the last position's rows, wrong before
    last = num_prefixes(3, 2)  # rows of prefixes of length 2
    for name in ("k2", "full"):
        torch.testing.assert_close(
            g[name]["loss"][last:], ex.grad_theta_ref[last:], rtol=1e-9, atol=1e-12
        )
        assert float((g[name]["loss"][:last] - ex.grad_theta_ref[:last]).abs().max()) > 1e-3
    # k3 in the loss: grad KL(pi_ref ‖ pi_theta) only at the root, where the prefix laws coincide
    torch.testing.assert_close(g["k3"]["loss"][0], ex.grad_ref_theta[0], rtol=1e-9, atol=1e-12)
    assert float((g["k3"]["loss"] - ex.grad_ref_theta).abs().max()) > 1e-3


def test_every_estimator_has_values_and_gradients():
    ex = analyse(_random_model(9, vocab=2, length=3))
    assert list(ex.values) == list(LAB_ESTIMATORS)
    assert set(ex.gradients["ref_is"]) == {"loss"} and set(ex.gradients["k3"]) == set(kl.PLACEMENTS)
    # adaptive_mix's loss gradient is (1 - a*) times ref_is's (k1's is zero)
    torch.testing.assert_close(
        ex.gradients["adaptive_mix"]["loss"], (1 - ex.mix_weight) * ex.gradients["ref_is"]["loss"]
    )
    for name, v in ex.values.items():
        if name not in ("k2", "k2+", "abs", "abs+", "low_var_kl", "kl_ref_theta"):
            assert v.bias == pytest.approx(0.0, abs=1e-12), name
    # kl_ref_theta is per-token unbiased for KL(pi_ref ‖ pi_theta) only at the root (a sum of
    # per-token terms on pi_theta's prefixes is not the sequence KL(pi_ref ‖ pi_theta)).
    assert ex.values["kl_ref_theta"].target == ex.kl_ref_theta
