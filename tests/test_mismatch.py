"""Tests for klpo.mismatch: hand values, gradients, exact enumeration over small categoricals.

Oracles: hand arithmetic (in the comments); autograd of the uncorrected loss times the hand
weight; exact expectations over every outcome of a categorical engine policy mu.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo import losses
from klpo import mismatch as M

F64 = torch.float64


def test_tis_weight_hand():
    # rho = pi_old / mu per token: 0.5/0.25 = 2, 0.3/0.6 = 0.5, 0.4/0.1 = 4, 0.2/0.2 = 1.
    # Cap C = 1.5: w = min(rho, 1.5) = (1.5, 0.5, 1.5, 1).
    old = torch.tensor([[0.5, 0.3, 0.4, 0.2]], dtype=F64).log()
    eng = torch.tensor([[0.25, 0.6, 0.1, 0.2]], dtype=F64).log()
    w = M.tis_weight(old, eng, cap=1.5)
    np.testing.assert_allclose(w.numpy(), [[1.5, 0.5, 1.5, 1.0]], rtol=1e-14)
    # No cap: the plain ratio.
    np.testing.assert_allclose(
        M.tis_weight(old, eng, cap=None).numpy(), [[2, 0.5, 4, 1]], rtol=1e-14
    )
    # A ratio of e^1000 stays finite uncapped, and is exactly C capped.
    huge = M.tis_weight(torch.zeros(1, 1), torch.full((1, 1), -1000.0), cap=None)
    assert torch.isfinite(huge).all()
    assert M.tis_weight(torch.zeros(1, 1), torch.full((1, 1), -1000.0), cap=3.0).item() == 3.0


def test_tis_policy_loss_value_and_gradient():
    # PPO clip with adv (1, -1), ratio pi_theta/pi_old = (1.1, 0.9), inside the clip range:
    # loss = -ratio·A = (-1.1, 0.9); grad wrt logp = -A·ratio = (-1.1, 0.9).
    # Engine: rho = (2, 0.5), cap 1.5 -> w = (1.5, 0.5): loss (-1.65, 0.45), grad (-1.65, 0.45).
    logp_old = torch.tensor([[0.5, 0.3]], dtype=F64).log()
    logp_eng = torch.tensor([[0.25, 0.6]], dtype=F64).log()
    logp = (logp_old + torch.tensor([[1.1, 0.9]], dtype=F64).log()).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    pg = losses.ppo_clip(logp, logp_old, adv)
    out = M.tis_policy_loss(pg, logp_old, logp_eng, cap=1.5)
    np.testing.assert_allclose(out.detach().numpy(), [[-1.65, 0.45]], rtol=1e-13)
    (g,) = torch.autograd.grad(out.sum(), logp)
    np.testing.assert_allclose(g.numpy(), [[-1.65, 0.45]], rtol=1e-13)


def test_tis_sends_no_gradient_into_the_log_probs_it_compares():
    logp_old = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    logp_eng = torch.tensor([[-1.5, -1.0]], dtype=F64, requires_grad=True)
    loss = torch.tensor([[0.3, -0.7]], dtype=F64, requires_grad=True)
    out = M.tis_policy_loss(loss, logp_old, logp_eng, cap=2.0)
    assert not M.tis_weight(logp_old, logp_eng, cap=2.0).requires_grad
    g_loss, g_old, g_eng = torch.autograd.grad(
        out.sum(), [loss, logp_old, logp_eng], allow_unused=True
    )
    assert g_old is None and g_eng is None
    # d(w·loss)/d loss = w = (min(e^0.5, 2), min(e^-1, 2)).
    np.testing.assert_allclose(g_loss.numpy(), [[math.exp(0.5), math.exp(-1.0)]], rtol=1e-14)


def test_tis_gradcheck():
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(3, 4, generator=gen, dtype=F64, requires_grad=True)
    old, eng = (
        -torch.rand(3, 4, generator=gen, dtype=F64),
        -torch.rand(3, 4, generator=gen, dtype=F64),
    )
    assert torch.autograd.gradcheck(lambda x: M.tis_policy_loss(x, old, eng, cap=1.2), (loss,))


def test_untruncated_is_recovers_the_expected_gradient_under_pi_old_exactly():
    # Exact enumeration over a 5-token vocabulary: tokens drawn from mu, weighted by rho, give the
    # same expected gradient of the PPO surrogate as tokens drawn from pi_old; the uncorrected
    # one does not (the test has power), and a cap below max(rho) biases it.
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(5, generator=gen, dtype=F64, requires_grad=True)
    old = torch.log_softmax(torch.randn(5, generator=gen, dtype=F64), -1)
    mu = torch.log_softmax(old + 0.7 * torch.randn(5, generator=gen, dtype=F64), -1)
    adv = torch.randn(5, generator=gen, dtype=F64)

    def expected_grad(sample_logp: torch.Tensor, weight: str | float | None) -> np.ndarray:
        logp = torch.log_softmax(theta, -1)
        pg = losses.ppo_clip(logp[None], old[None], adv[None])
        if weight != "none":
            pg = M.tis_policy_loss(pg, old[None], mu[None], cap=weight)
        (g,) = torch.autograd.grad((sample_logp.exp() * pg[0]).sum(), theta)
        return g.numpy()

    truth = expected_grad(old, "none")  # y ~ pi_old, no weight
    np.testing.assert_allclose(expected_grad(mu, None), truth, rtol=1e-12, atol=1e-14)
    assert np.abs(expected_grad(mu, "none") - truth).max() > 1e-2
    rho_max = float((old - mu).exp().max())
    assert np.abs(expected_grad(mu, 0.5 * rho_max) - truth).max() > 1e-4


def test_mismatch_metrics_hand():
    # d = log mu - log pi_old per token: log(0.25/0.5) = -ln 2, log(0.6/0.3) = ln 2, third masked.
    # k1 mean = 0. k3 = rho - 1 - log rho: rho = 2 -> 1 - ln 2 = 0.306853; rho = 0.5 -> -0.5 + ln 2
    # = 0.193147; mean 0.25, max 0.306853. |d| max = ln 2. Cap 1.5: w = (1.5, 0.5), mean 1.0;
    # clipped: rho = 2 > 1.5 only -> 0.5.
    old = torch.tensor([[0.5, 0.3, 0.9]], dtype=F64).log()
    eng = torch.tensor([[0.25, 0.6, 0.01]], dtype=F64).log()
    mask = torch.tensor([[True, True, False]])
    m = M.mismatch_metrics(old, eng, mask, cap=1.5)
    ln2 = math.log(2)
    assert m["engine/k1"] == pytest.approx(0.0, abs=1e-15)
    assert m["engine/k3"] == pytest.approx(0.25, rel=1e-13)
    assert m["engine/k3_max"] == pytest.approx(1 - ln2, rel=1e-13)
    assert m["engine/abs_max"] == pytest.approx(ln2, rel=1e-13)
    assert m["engine/tis_weight"] == pytest.approx(1.0, rel=1e-13)
    assert m["engine/tis_clip_frac"] == pytest.approx(0.5, rel=1e-13)
    # The masked token (rho = 90) changes nothing; no cap clips nothing; no token gives zeros.
    assert M.mismatch_metrics(old, eng, mask)["engine/tis_clip_frac"] == 0.0
    empty = M.mismatch_metrics(old, eng, torch.zeros_like(mask))
    assert all(v == 0.0 for v in empty.values())


def test_mismatch_k1_and_k3_are_unbiased_for_kl_mu_old_by_enumeration():
    gen = torch.Generator().manual_seed(1)
    old = torch.log_softmax(torch.randn(7, generator=gen, dtype=F64), -1)
    mu = torch.log_softmax(old + 0.5 * torch.randn(7, generator=gen, dtype=F64), -1)
    kl_mu_old = float((mu.exp() * (mu - old)).sum())
    # Each outcome as its own token; expectation = sum_y mu(y) · term(y), via k1 and k3 per token.
    per_tok = {}
    for y in range(7):
        one = M.mismatch_metrics(old[y].view(1, 1), mu[y].view(1, 1), torch.ones(1, 1, dtype=bool))
        for k in ("engine/k1", "engine/k3"):
            per_tok.setdefault(k, []).append(one[k])
    for k, vals in per_tok.items():
        assert float(np.dot(mu.exp().numpy(), vals)) == pytest.approx(kl_mu_old, rel=1e-12), k


def test_mismatch_bad_input_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="logp_engine has shape"):
        M.tis_weight(a, torch.zeros(2, 4), cap=2.0)
    with pytest.raises(ValueError, match="cap C must be > 0"):
        M.tis_weight(a, a, cap=0.0)
    with pytest.raises(TypeError, match="mask must be a bool"):
        M.mismatch_metrics(a, a, torch.ones(2, 3))
    with pytest.raises(ValueError, match="loss has shape"):
        M.tis_policy_loss(torch.zeros(2, 2), a, a, cap=2.0)
