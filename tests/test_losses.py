"""Tests for klpo.losses: hand values, analytic gradients, exact enumeration, metrics, peers.

Oracles: hand arithmetic; the analytic gradients written in numpy; exact expectations over every
outcome of small categoricals (samples from pi_old weighted by their probabilities); verl.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo import kl
from klpo import losses as L
from klpo.reduce import masked_mean, reduce

F64 = torch.float64


def tokens(seed: int, b: int = 5, t: int = 6, spread: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    logp_old = -3 * torch.rand(b, t, generator=gen, dtype=F64)
    logp = logp_old + spread * torch.randn(b, t, generator=gen, dtype=F64)
    adv = torch.randn(b, t, generator=gen, dtype=F64)
    return logp, logp_old, adv


# ---------------------------------------------------------------------------------------------
# PPO clip.


def test_ppo_clip_hand():
    # ratios (1.5, 0.5, 0.5, 5.0, 1.1, 5.0) with advantages (1, -1, 1, -1, -2, -1); clip 0.2:
    ratio = torch.tensor([[1.5, 0.5, 0.5, 5.0, 1.1, 5.0]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, -2.0, -1.0]], dtype=F64)
    logp = ratio.log().requires_grad_(True)
    loss = L.ppo_clip(logp, torch.zeros_like(logp), adv, dual_clip=3.0)
    # 0: max(-1.5, -1.2) = -1.2 (clipped above, gradient 0)
    # 1: max(0.5, 0.8) = 0.8 (clipped below, gradient 0)
    # 2: max(-0.5, -0.8) = -0.5 (A > 0, ratio < 0.8: unclipped, gradient -A·ratio = -0.5)
    # 3: max(5, 1.2) = 5, dual clip min(5, 3·1) = 3 (gradient 0)
    # 4: max(2.2, 2.2) = 2.2 (inside the range, gradient -A·ratio = 2.2)
    # 5: as 3 without the dual clip: 5 (gradient -A·ratio = 5)
    np.testing.assert_allclose(
        loss[0, :5].detach().numpy(), [-1.2, 0.8, -0.5, 3.0, 2.2], rtol=1e-14
    )
    (grad,) = torch.autograd.grad(loss[0, :5].sum(), logp)
    np.testing.assert_allclose(grad[0, :5].numpy(), [0.0, 0.0, -0.5, 0.0, 2.2], rtol=1e-14, atol=0)
    plain = L.ppo_clip(logp, torch.zeros_like(logp), adv)
    assert plain[0, 5].item() == pytest.approx(5.0, rel=1e-14)


def test_ppo_clip_higher_is_asymmetric():
    # DAPO: clip_low 0.2, clip_high 0.28. A = 1, ratio 1.25: inside [0.8, 1.28], loss -1.25;
    # A = -1, ratio 0.75: below 0.8, clipped to 0.8, loss max(0.75, 0.8) = 0.8.
    logp = torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=F64)
    loss = L.ppo_clip(
        logp, torch.zeros_like(logp), torch.tensor([[1.0, -1.0]], dtype=F64), clip_high=0.28
    )
    np.testing.assert_allclose(loss[0].numpy(), [-1.25, 0.8], rtol=1e-14)


@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_ppo_clip_gradient_matches_analytic(dual_clip):
    logp, logp_old, adv = tokens(1, spread=0.5)
    lp = logp.clone().requires_grad_(True)
    loss = L.ppo_clip(lp, logp_old, adv, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    r = np.exp((logp - logp_old).numpy())
    a = adv.numpy()
    value = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.28))
    active = ~(((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8)))
    if dual_clip is not None:
        value = np.where(a < 0, np.minimum(value, -a * dual_clip), value)
        active &= ~((a < 0) & (r > dual_clip))
    assert 0 < active.sum() < active.size  # the case exercises both branches
    np.testing.assert_allclose(loss.detach().numpy(), value, rtol=1e-13)
    np.testing.assert_allclose(grad.numpy(), np.where(active, -a * r, 0.0), rtol=1e-13)


def test_losses_detach_old_quantities_and_gradcheck():
    logp, logp_old, adv = tokens(2, spread=0.05)  # stay inside the clip range (no kinks)
    lp = logp.clone().requires_grad_(True)
    old = logp_old.clone().requires_grad_(True)
    a = adv.clone().requires_grad_(True)
    for fn in (
        lambda: L.ppo_clip(lp, old, a),
        lambda: L.ppo_kl_penalty(lp, old, a, beta=0.3),
        lambda: L.kl_loss("k2", lp, logp_old - 0.3, logp_old=old),
    ):
        grads = torch.autograd.grad(fn().sum(), (lp, old, a), allow_unused=True)
        assert grads[0] is not None and grads[1] is None and grads[2] is None
    assert torch.autograd.gradcheck(lambda x: L.ppo_clip(x, logp_old, adv), (lp,))
    assert torch.autograd.gradcheck(lambda x: L.ppo_kl_penalty(x, logp_old, adv, beta=0.3), (lp,))


def test_ppo_clip_huge_ratio_is_finite():
    # u = 1000: exp overflows even float64; the cap keeps every gradient finite (0 where clipped).
    logp = torch.tensor([[1000.0, 1000.0, -1000.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    loss = L.ppo_clip(logp, torch.zeros_like(logp), adv, dual_clip=3.0)
    # clip above; dual clip; clip below
    np.testing.assert_allclose(loss.detach().numpy(), [[-1.2, 3.0, 0.8]], rtol=1e-7)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad.tolist() == [[0.0, 0.0, 0.0]]


def test_ppo_clip_errors():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_low"):
        L.ppo_clip(logp, logp, logp, clip_low=1.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        L.ppo_clip(logp, logp, logp, dual_clip=0.9)
    with pytest.raises(ValueError, match="adv has shape"):
        L.ppo_clip(logp, logp, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="float tensor"):
        L.ppo_clip(logp, logp.long(), logp)


# ---------------------------------------------------------------------------------------------
# PPO's KL penalty to pi_old.


def test_ppo_kl_penalty_hand_and_gradient():
    # ratio 2 (u = log 2 = 0.6931472), A = 0.5, beta = 0.1:
    # k3: (2 - 1) - log 2 = 0.3068528; loss = -2·0.5 + 0.1·0.3068528 = -0.9693147
    # k1: -log 2;                      loss = -1 - 0.0693147 = -1.0693147
    logp = torch.tensor([[math.log(2.0)]], dtype=F64, requires_grad=True)
    zero, adv = torch.zeros(1, 1, dtype=F64), torch.tensor([[0.5]], dtype=F64)
    k3 = L.ppo_kl_penalty(logp, zero, adv, beta=0.1)
    k1 = L.ppo_kl_penalty(logp, zero, adv, beta=0.1, estimator="k1")
    assert k3.item() == pytest.approx(-1 + 0.1 * (1 - math.log(2)), rel=1e-14)
    assert k1.item() == pytest.approx(-1 - 0.1 * math.log(2), rel=1e-14)
    # gradients: -A·r + beta·(r - 1) = -1 + 0.1 = -0.9;  -A·r - beta = -1.1
    assert torch.autograd.grad(k3.sum(), logp)[0].item() == pytest.approx(-0.9, rel=1e-14)
    assert torch.autograd.grad(k1.sum(), logp)[0].item() == pytest.approx(-1.1, rel=1e-14)


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def categoricals(seed: int, n: int = 4, v: int = 6):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scale = [0.5, 1.0, 2.0, 3.0][i % 4]
        theta = scale * rng.standard_normal(v)
        out.append((theta, scale * rng.standard_normal(v), theta + 0.7 * rng.standard_normal(v)))
    return out


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_ppo_kl_penalty_estimates_kl_old_theta_with_the_right_gradient(estimator):
    """Exact enumeration over y ~ pi_old: E[kl] = KL(pi_old ‖ pi_theta), E[grad] = its gradient."""
    for theta, _, old in categoricals(3):
        th = torch.tensor(theta, requires_grad=True)
        logp = torch.log_softmax(th, -1)[None]
        logp_old = torch.log_softmax(torch.tensor(old), -1)[None]
        p_old = logp_old.exp()
        per_token = L.ppo_kl_penalty(
            logp, logp_old, torch.zeros_like(logp), beta=1.0, estimator=estimator
        )
        expected = (p_old * per_token).sum()
        (grad,) = torch.autograd.grad(expected, th)
        pi, po = softmax(theta), softmax(old)
        assert expected.item() == pytest.approx(float(np.sum(po * np.log(po / pi))), rel=1e-12)
        # grad_theta KL(pi_old ‖ pi_theta) = -sum_y pi_old(y) (e_y - pi) = pi - pi_old
        np.testing.assert_allclose(grad.numpy(), pi - po, rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# Value loss and entropy.


def test_value_loss_hand():
    # V = (1, 2, 3), R = (1, 3, 5), V_old = (1, 1, 1), clip 0.5:
    # unclipped ½(V - R)² = (0, 0.5, 2); clamp(V, 0.5, 1.5) = (1, 1.5, 1.5), ½(·-R)² = (0, 1.125, 6.125)
    v = torch.tensor([[1.0, 2.0, 3.0]], dtype=F64, requires_grad=True)
    v_old = torch.ones(1, 3, dtype=F64)
    ret = torch.tensor([[1.0, 3.0, 5.0]], dtype=F64)
    np.testing.assert_allclose(L.value_loss(v, v_old, ret).detach().numpy(), [[0, 0.5, 2]])
    clipped = L.value_loss(v, v_old, ret, clip=0.5)
    np.testing.assert_allclose(clipped.detach().numpy(), [[0, 1.125, 6.125]])
    (grad,) = torch.autograd.grad(clipped.sum(), v)
    assert grad.tolist() == [[0.0, 0.0, 0.0]]  # the clipped term is constant in V outside the range


def test_value_loss_gradient_matches_analytic():
    gen = torch.Generator().manual_seed(4)
    v_old = torch.randn(4, 5, generator=gen, dtype=F64)
    v = (v_old + 0.4 * torch.randn(4, 5, generator=gen, dtype=F64)).requires_grad_(True)
    ret = torch.randn(4, 5, generator=gen, dtype=F64)
    loss = L.value_loss(v, v_old, ret, clip=0.2)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    vv, vo, rr = v.detach().numpy(), v_old.numpy(), ret.numpy()
    l1, l2 = (vv - rr) ** 2, (np.clip(vv, vo - 0.2, vo + 0.2) - rr) ** 2
    assert (l2 > l1).any() and (l2 < l1).any()
    np.testing.assert_allclose(loss.detach().numpy(), 0.5 * np.maximum(l1, l2), rtol=1e-13)
    np.testing.assert_allclose(grad.numpy(), np.where(l1 >= l2, vv - rr, 0.0), rtol=1e-13)
    grads = torch.autograd.grad(
        L.value_loss(v, v_old.requires_grad_(True), ret.requires_grad_(True), clip=0.2).sum(),
        (v_old, ret),
        allow_unused=True,
    )
    assert grads == (None, None)


def test_entropy_bonus_gradient_is_analytic():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=F64, requires_grad=True)
    logq = torch.log_softmax(logits, -1)
    entropy = -(logq.exp() * logq).sum(-1)  # the naive per-token entropy
    loss = L.entropy_bonus(entropy)
    assert torch.equal(loss, -entropy)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    p = logq.detach().exp().numpy()
    h = entropy.detach().numpy()[..., None]
    # d(-H)/dz = p ⊙ (log p + H)
    np.testing.assert_allclose(grad.numpy(), p * (np.log(p) + h), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# KL in the loss: the off-policy correction, by exact enumeration, for every estimator.


def enumerate_kl_loss(name, theta, ref, old, *, corrected: bool = True):
    """(E_old[term], d E_old[term] / d theta) with every outcome y of pi_old weighted exactly."""
    th = torch.tensor(theta, requires_grad=True)
    v = len(theta)
    logp = torch.log_softmax(th, -1)[None]
    logp_ref = torch.log_softmax(torch.tensor(ref), -1)[None]
    logp_old = torch.log_softmax(torch.tensor(old), -1)[None]
    logits, logits_ref = th.expand(1, v, v), torch.tensor(ref).expand(1, v, v)
    if corrected:
        term = L.kl_loss(
            name, logp, logp_ref, logp_old=logp_old, logits=logits, logits_ref=logits_ref
        )
    else:  # the plain estimate, as verl and OpenRLHF put it in the loss
        term = kl.estimate(
            name, logp, logp_ref, logp_old=logp_old, logits=logits, logits_ref=logits_ref
        )
    expected = (logp_old.exp() * term).sum()
    (grad,) = torch.autograd.grad(expected, th)
    return expected.item(), grad.numpy()


def on_policy(name, theta, ref):
    """E_theta[est] and E_theta[grad est]: samples from pi_theta itself, no correction at all."""
    th = torch.tensor(theta, requires_grad=True)
    v = len(theta)
    logp = torch.log_softmax(th, -1)[None]
    logp_ref = torch.log_softmax(torch.tensor(ref), -1)[None]
    est = kl.estimate(
        name,
        logp,
        logp_ref,
        logp_old=logp.detach(),
        logits=th.expand(1, v, v),
        logits_ref=torch.tensor(ref).expand(1, v, v),
    )
    expected = (logp.detach().exp() * est).sum()
    (grad,) = torch.autograd.grad(expected, th)
    return expected.item(), grad.numpy()


def closed_form(label: str, theta, ref) -> np.ndarray | None:
    pi, pr = softmax(theta), softmax(ref)
    kl_tr = float(np.sum(pi * np.log(pi / pr)))
    return {
        kl.GRAD_THETA_REF: pi * (np.log(pi / pr) - kl_tr),
        kl.GRAD_REF_THETA: pi - pr,
        kl.GRAD_ZERO: np.zeros_like(pi),
    }.get(label)


@pytest.mark.parametrize("name", kl.ESTIMATORS)
def test_kl_loss_off_policy_keeps_the_on_policy_expected_gradient(name):
    promise = kl.explain(name, "loss").gradient
    for theta, ref, old in categoricals(8):
        value_off, grad_off = enumerate_kl_loss(name, theta, ref, old)
        value_on, grad_on = on_policy(name, theta, ref)
        assert value_off == pytest.approx(value_on, rel=1e-10, abs=1e-12)
        np.testing.assert_allclose(grad_off, grad_on, rtol=1e-9, atol=1e-12)
        target = closed_form(promise, theta, ref)
        if target is not None:  # what klpo.kl.explain promises, written out in numpy
            np.testing.assert_allclose(grad_off, target, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k3+"])
def test_without_the_correction_the_off_policy_gradient_is_wrong(name):
    """The enumeration has power: the plain estimate over pi_old samples misses the promise."""
    theta, ref, old = categoricals(8)[1]
    _, grad_plain = enumerate_kl_loss(name, theta, ref, old, corrected=False)
    _, grad_on = on_policy(name, theta, ref)
    assert np.linalg.norm(grad_plain - grad_on) > 1e-3 * max(1.0, np.linalg.norm(grad_on))


def test_kl_loss_on_policy_is_the_estimate():
    logp, _, _ = tokens(6)
    logp_ref = logp.detach() - 0.4
    for name in ("k1", "k2", "k3", "k3+", "k3_is"):
        lp1 = logp.clone().requires_grad_(True)
        lp2 = logp.clone().requires_grad_(True)
        ours = L.kl_loss(name, lp1, logp_ref)
        plain = kl.estimate(name, lp2, logp_ref, logp_old=lp2.detach())
        torch.testing.assert_close(ours, plain, rtol=1e-15, atol=0)
        g1 = torch.autograd.grad(ours.sum(), lp1)[0]
        g2 = torch.autograd.grad(plain.sum(), lp2)[0]
        torch.testing.assert_close(g1, g2, rtol=1e-14, atol=1e-15)


def test_kl_loss_with_a_cap_weights_each_token_by_the_capped_ratio_by_hand():
    # w = pi_theta / pi_old = (2, 0.5, 4) per token; C = 3 caps the last to 3. k3 with
    # d = logp - logp_ref: value min(w, C) · k3 and gradient min(w, C) · (1 - exp(-d)); k3_is
    # (w · k3 itself): gradient min(w, C) · d, as OpenRLHF's capped weight gives it.
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    logp_old = logp - torch.log(torch.tensor([2.0, 0.5, 4.0], dtype=torch.float64))
    logp_ref = torch.tensor([[-1.5, -1.0, -1.2]], dtype=torch.float64)
    capped = torch.tensor([[2.0, 0.5, 3.0]], dtype=torch.float64)
    d = logp - logp_ref
    k3 = torch.exp(-d) - 1 + d
    for name, value, grad in (
        ("k3", capped * k3, capped * (1 - torch.exp(-d))),
        ("k3_is", capped * k3, capped * d),
    ):
        lp = logp.clone().requires_grad_(True)
        got = L.kl_loss(name, lp, logp_ref, logp_old=logp_old, cap=3.0)
        torch.testing.assert_close(got, value, rtol=1e-13, atol=0)
        (g,) = torch.autograd.grad(got.sum(), lp)
        torch.testing.assert_close(g, grad, rtol=1e-12, atol=1e-15)
        # a cap above every weight is no cap
        free = L.kl_loss(name, logp, logp_ref, logp_old=logp_old)
        torch.testing.assert_close(
            L.kl_loss(name, logp, logp_ref, logp_old=logp_old, cap=10.0), free, rtol=1e-14, atol=0
        )


def test_kl_loss_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="the weight's cap must be > 0"):
        L.kl_loss("k3", x, x, logp_old=x, cap=0.0)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        L.kl_loss("k4", x, x)
    with pytest.raises(ValueError, match="needs logits"):
        L.kl_loss("full", x, x)


# ---------------------------------------------------------------------------------------------
# KL in the reward.


def test_kl_reward_hand():
    # pi(y) = 0.5, pi_ref(y) = 0.25 on every token: k1 = log 2 = 0.6931472, beta = 0.1
    # rewards (0, 0, 1, [masked]) → (-0.0693147, -0.0693147, 0.9306853, 0)
    logp = torch.full((1, 4), math.log(0.5), requires_grad=True)
    logp_ref = torch.full((1, 4), math.log(0.25))
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    mask = torch.tensor([[True, True, True, False]])
    got = L.kl_reward(rewards, logp, logp_ref, mask, beta=0.1)
    ln2 = math.log(2)
    np.testing.assert_allclose(
        got.numpy(), [[-0.1 * ln2, -0.1 * ln2, 1 - 0.1 * ln2, 0.0]], rtol=1e-6
    )
    assert not got.requires_grad  # the penalty is detached: it is a reward
    # k3: exp(-log 2) + log 2 - 1 = 0.1931472 → 1 - 0.0193147 at the last valid token
    k3 = L.kl_reward(rewards, logp, logp_ref, mask, beta=0.1, estimator="k3")
    assert k3[0, 2].item() == pytest.approx(1 - 0.1 * (0.5 + ln2 - 1), rel=1e-6)
    # inf estimates at masked tokens never leak
    far = logp_ref.clone()
    far[0, 3] = 200.0
    assert torch.isfinite(L.kl_reward(rewards, logp, -far, mask, beta=0.1, estimator="k3")).all()
    with pytest.raises(ValueError, match="beta"):
        L.kl_reward(rewards, logp, logp_ref, mask, beta=-1.0)
    # a precomputed estimate (the fused exact KL) is used as given, detached:
    # 1 - 0.1 * 0.3 = 0.97 at the last valid token
    est = torch.full((1, 4), 0.3, requires_grad=True)
    pre = L.kl_reward(rewards, None, None, mask, beta=0.1, estimate=est)
    np.testing.assert_allclose(pre.numpy(), [[-0.03, -0.03, 0.97, 0.0]], rtol=1e-6)
    assert not pre.requires_grad


# ---------------------------------------------------------------------------------------------
# Metrics.


def test_policy_metrics_hand():
    # ratios (1.5, 0.5, 1.0, 5.0, [masked: inf]), A = (1, -1, 1, -1, 1), clip 0.2, dual 3:
    ratio = torch.tensor([[1.5, 0.5, 1.0, 5.0, 1.0]])
    logp = ratio.log()
    logp[0, 4] = math.inf
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    m = L.policy_metrics(logp, torch.zeros_like(logp), adv, mask, dual_clip=3.0)
    log375 = math.log(1.5 * 0.5 * 5.0)  # log 3.75 = 1.3217558
    expected = {
        "clip_frac": 0.5,  # tokens 0 (A > 0, r > 1.2) and 1 (A < 0, r < 0.8)
        "clip_frac/high": 0.25,
        "clip_frac/low": 0.25,
        "clip_frac/dual": 0.25,  # token 3 (A < 0, r > 3)
        "kl/old/k1": -log375 / 4,  # mean of -log r = -0.3304390
        "kl/old/k3": (4.0 - log375) / 4,  # mean of (r - 1) - log r: sum(r - 1) = 4
        "ratio/mean": 2.0,  # (1.5 + 0.5 + 1 + 5) / 4
        "ratio/max": 5.0,
        "ratio/min": 0.5,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        assert isinstance(m[key], float)
        assert m[key] == pytest.approx(value, rel=1e-6), key
    empty = L.policy_metrics(logp, torch.zeros_like(logp), adv, torch.zeros_like(mask))
    assert all(v == 0.0 for v in empty.values())


def test_value_metrics_hand():
    # V = (1, 2, 3), R = (1, 3, 5): R - V = (0, 1, 2), Var(R) = 8/3, Var(R - V) = 2/3
    # explained variance = 1 - (2/3)/(8/3) = 0.75; mse = (0 + 1 + 4)/3
    # clip 0.5 around V_old = 1: clamp(V) = (1, 1.5, 1.5), squared errors (0, 2.25, 12.25) > (0, 1, 4)
    # on tokens 1 and 2 → clip fraction 2/3
    v = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    ret = torch.tensor([[1.0, 3.0, 5.0, math.nan]])
    mask = torch.tensor([[True, True, True, False]])
    m = L.value_metrics(v, torch.ones_like(v), ret, mask, clip=0.5)
    assert m == pytest.approx(
        {
            "value/clip_frac": 2 / 3,
            "value/explained_var": 0.75,
            "value/mean": 2.0,
            "value/mse": 5 / 3,
        }
    )
    flat = L.value_metrics(v, v, torch.ones_like(v), mask)  # Var(R) = 0: 0.0, not NaN
    assert flat["value/explained_var"] == 0.0 and flat["value/clip_frac"] == 0.0


def test_kl_metrics():
    logp, _, _ = tokens(7)
    logp_ref = logp - 0.3 * torch.randn(
        logp.shape, generator=torch.Generator().manual_seed(1), dtype=F64
    )
    mask = torch.rand(logp.shape, generator=torch.Generator().manual_seed(2)) < 0.7
    m = L.kl_metrics(logp.requires_grad_(True), logp_ref, mask, estimators=("k1", "k3", "k2"))
    assert set(m) == {"kl/ref/k1", "kl/ref/k3", "kl/ref/k2"}
    d = (logp - logp_ref).detach()[mask].numpy()
    assert m["kl/ref/k1"] == pytest.approx(d.mean(), rel=1e-12)
    assert m["kl/ref/k3"] == pytest.approx(np.mean(np.exp(-d) + d - 1), rel=1e-12)
    assert m["kl/ref/k2"] == pytest.approx(
        masked_mean(0.5 * (logp - logp_ref) ** 2, mask).item(), rel=1e-12
    )


def test_reduced_losses_compose():
    """A full PPO step's loss is a sum of reduced per-token terms; nothing NaN at masked tokens."""
    logp, logp_old, adv = tokens(9)
    mask = torch.ones_like(logp, dtype=torch.bool)
    mask[1, 3:] = False
    logp_ref = logp_old.clone()
    logp_ref[1, 4] = 500.0  # an absurd reference log-prob at a masked token: k3 = inf there
    lp = logp.clone().requires_grad_(True)
    per_token = L.ppo_clip(lp, logp_old, adv) + 0.1 * L.kl_loss(
        "k3", lp, logp_ref, logp_old=logp_old
    )
    loss = reduce(per_token, mask, "token-mean")
    (grad,) = torch.autograd.grad(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------
# Peer: verl.


@pytest.mark.peer
def test_matches_verl_policy_and_value_losses():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, logp_old, adv = tokens(10, spread=0.8)
    mask = torch.rand(logp.shape, generator=torch.Generator().manual_seed(3)) < 0.8
    with pytest.warns(Warning):  # verl marks compute_policy_loss deprecated; its math is current
        pg, clipfrac, ppo_kl, clipfrac_lower = core_algos.compute_policy_loss(
            logp_old,
            logp,
            adv,
            mask.to(F64),
            cliprange_low=0.2,
            cliprange_high=0.28,
            clip_ratio_c=3.0,
        )
    ours = reduce(
        L.ppo_clip(logp, logp_old, adv, clip_high=0.28, dual_clip=3.0), mask, "token-mean"
    )
    assert ours.item() == pytest.approx(pg.item(), rel=1e-7)
    m = L.policy_metrics(logp, logp_old, adv, mask, clip_high=0.28, dual_clip=3.0)
    assert m["clip_frac"] == pytest.approx(clipfrac.item(), rel=1e-7)
    assert m["clip_frac/dual"] == pytest.approx(clipfrac_lower.item(), rel=1e-7, abs=1e-12)
    assert m["kl/old/k1"] == pytest.approx(ppo_kl.item(), rel=1e-7)

    values_old = torch.randn(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    values = values_old + 0.5 * torch.randn(
        logp.shape, dtype=F64, generator=torch.Generator().manual_seed(5)
    )
    returns = torch.randn(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(6))
    vf, vf_clipfrac = core_algos.compute_value_loss(values, returns, values_old, mask.to(F64), 0.2)
    ours = reduce(L.value_loss(values, values_old, returns, clip=0.2), mask, "token-mean")
    assert ours.item() == pytest.approx(vf.item(), rel=1e-7)
    assert L.value_metrics(values, values_old, returns, mask, clip=0.2)[
        "value/clip_frac"
    ] == pytest.approx(vf_clipfrac.item(), rel=1e-7)


@pytest.mark.peer
@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        ("k1", "k1"),
        ("k2", "k2"),
        ("abs", "abs"),
        ("low_var_kl", "low_var_kl"),
        ("k3+", "k3+"),
        ("k1+", "k1+"),
    ],
)
def test_matches_verl_kl_penalty_on_policy(ours, theirs):
    """On-policy (logp_old = logp) kl_loss is verl's kl_penalty, value and gradient; the reward
    shaping is verl's compute_rewards / apply_kl_penalty."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    logp, logp_ref, _ = tokens(11, spread=1.5)
    lp1, lp2 = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    a = L.kl_loss(ours, lp1, logp_ref)
    b = core_algos.kl_penalty(lp2, logp_ref, theirs)
    if ours == "k3+":
        # Deliberate difference: verl's k3+ *value* is its clamped k3 (at most 10); klpo's is the
        # unclamped k3 (klpo.kl keeps clamps to the explicitly named low_var_kl). Gradients agree.
        clamped = b.detach() >= 10.0
        assert clamped.any() and (a[clamped] > 10.0).all()
        a, b = torch.where(clamped, 0.0, a), torch.where(clamped, 0.0, b)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    ga = torch.autograd.grad(a.sum(), lp1)[0]
    gb = torch.autograd.grad(b.sum(), lp2)[0]
    torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-14)
    mask = torch.ones_like(logp, dtype=torch.bool)
    scores = torch.randn(logp.shape, dtype=F64, generator=torch.Generator().manual_seed(12))
    shaped = L.kl_reward(scores, logp, logp_ref, mask, beta=0.05, estimator=ours)
    expected = scores - 0.05 * kl.estimate(ours, logp, logp_ref)
    torch.testing.assert_close(shaped, expected, rtol=1e-12, atol=1e-14)
    if ours == "k1":
        torch.testing.assert_close(shaped, core_algos.compute_rewards(scores, logp, logp_ref, 0.05))
