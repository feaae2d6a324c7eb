"""klpo._ratios: the log-ratio to pi_old and the per-token KL(pi_old ‖ pi_theta) the losses share.

Oracles: k1 = -u and k3 = e^u - 1 - u (u = log pi_theta - log pi_old) and the gradient
d k3/du = e^u - 1 in 50-digit decimal arithmetic (:mod:`decimal`), d k1/du = -1 by hand, and the
naive float32 k3 that ``expm1`` replaces, which loses the value near u = 0.
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import pytest
import torch

from klpo._ratios import check_per_token, kl_to_old, log_ratio, widened


def test_log_ratio_is_the_difference_with_the_gradient_into_logp_only():
    logp = torch.tensor([[-0.5, -1.25]], requires_grad=True)
    logp_old = torch.tensor([[-0.75, -1.0]], requires_grad=True)
    u = log_ratio(logp, logp_old)
    assert u.dtype == torch.float64  # the wide dtype of a float32 input
    assert u.tolist() == [[0.25, -0.25]]  # -0.5 + 0.75, -1.25 + 1.0: exact in binary
    u.sum().backward()
    assert logp.grad.tolist() == [[1.0, 1.0]]
    assert logp_old.grad is None  # logp_old is detached


@pytest.mark.parametrize("u", [-2.0, -0.3, 0.0, 1e-3, 0.7, 3.0])
def test_k1_and_k3_to_old_by_hand(u):
    t = torch.tensor([u], dtype=torch.float64, requires_grad=True)
    k1, k3 = kl_to_old(t, "k1"), kl_to_old(t, "k3")
    assert k1.item() == -u
    with localcontext() as ctx:
        ctx.prec = 50
        e_u = Decimal(u).exp()
        want_k3, want_g3 = float(e_u - 1 - Decimal(u)), float(e_u - 1)
    assert k3.item() == pytest.approx(want_k3, rel=1e-12, abs=1e-300)
    assert k3.item() >= 0  # (r - 1) - log r >= 0 for every r > 0
    (g3,) = torch.autograd.grad(k3.sum(), t)
    assert g3.item() == pytest.approx(want_g3, rel=1e-12, abs=1e-300)
    (g1,) = torch.autograd.grad(kl_to_old(t, "k1").sum(), t)
    assert g1.item() == -1.0


def test_k3_near_zero_keeps_what_the_naive_form_loses():
    """At u = 1e-5, k3 = u²/2 + u³/6 + ... ≈ 5.0000167e-11. In float32, exp(u) - 1 - u rounds to
    a value off by orders of magnitude; expm1 in the same dtype keeps it to float32's precision."""
    u = 1e-5
    want = u**2 / 2 + u**3 / 6 + u**4 / 24
    t = torch.tensor([u], dtype=torch.float32)
    got = kl_to_old(t, "k3").item()
    naive = (torch.exp(t) - 1 - t).item()
    assert got == pytest.approx(want, rel=1e-3)
    assert abs(naive - want) > 10 * want  # the naive float32 form is wrong near 0


def test_widened_detaches_the_others_and_checks_shapes():
    logp = torch.zeros(2, 3, requires_grad=True)
    other = torch.ones(2, 3, requires_grad=True)
    lp, o = widened(logp, other=other)
    assert lp.dtype == o.dtype == torch.float64
    assert lp.requires_grad and not o.requires_grad
    with pytest.raises(ValueError, match="same"):
        widened(logp, other=torch.ones(2, 4))
    with pytest.raises(ValueError):
        check_per_token(logp, values=torch.ones(3, 2))


def test_an_unknown_estimator_is_refused_by_name():
    with pytest.raises(ValueError, match="estimator must be 'k1' or 'k3', got 'k2'"):
        kl_to_old(torch.zeros(1), "k2")
