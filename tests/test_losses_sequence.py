"""Tests for GSPO and CISPO in klpo.losses: hand values and gradients, a naive sequence-level
oracle, and the KL term beside them keeping its per-token off-policy weight.

Oracles: hand arithmetic (in the comments); GSPO's objective written directly at the sequence
level (one ratio per sequence, autograd through it) in float64.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo import losses as L
from klpo.reduce import reduce

F64 = torch.float64


def _gspo_batch():
    # Per-token log-ratios u = logp - logp_old; masked tokens hold junk that must not matter.
    u = torch.tensor(
        [
            [0.1, -0.1, 0.3],  # mean 0.1 -> s = e^0.1 = 1.105171, A = +1: inside [0.8, 1.2]
            [0.5, 0.1, 9.0],  # mean 0.3 -> s = e^0.3 = 1.349859, A = +1: clipped above
            [-0.4, 7.0, 7.0],  # mean -0.4 -> s = e^-0.4 = 0.670320, A = -1: clipped below
            [0.2, 0.0, -5.0],  # mean 0.1 -> s = 1.105171, A = -1: inside
        ],
        dtype=F64,
    )
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)[:, None].expand(4, 3).clone()
    logp_old = -torch.linspace(0.5, 2.0, 12, dtype=F64).reshape(4, 3)
    logp = (logp_old + u).requires_grad_(True)
    return logp, logp_old, adv, mask


def test_gspo_hand_values_and_gradients():
    logp, logp_old, adv, mask = _gspo_batch()
    loss = L.gspo(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.2)
    e01, e03 = math.exp(0.1), math.exp(0.3)
    # seq 0: -s·A = -1.105171 at each valid token; seq 1: clipped to -1.2·1 = -1.2;
    # seq 2: max(-s·A, -0.8·A) = max(0.670320, 0.8) = 0.8; seq 3: -s·A = +1.105171.
    expected = np.array([[-e01, -e01, -e01], [-1.2, -1.2, 0.0], [0.8, 0.0, 0.0], [e01, e01, 0.0]])
    np.testing.assert_allclose(loss.detach().numpy(), expected, rtol=1e-12, atol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # Token form: d loss_t / d logp_t = -A·s on unclipped sequences, 0 on clipped ones.
    g = np.array([[-e01, -e01, -e01], [0, 0, 0], [0, 0, 0], [e01, e01, 0]])
    np.testing.assert_allclose(grad.numpy(), g, rtol=1e-12, atol=0)
    assert e03 > 1.2  # seq 1 is really beyond the clip


def _gspo_naive(logp, logp_old, adv_seq, mask, lo, hi):
    """GSPO's objective as written in the paper: one ratio per sequence, a mean over sequences."""
    terms = []
    for i in range(logp.shape[0]):
        m = mask[i]
        s = torch.exp((logp[i][m] - logp_old[i][m]).mean())
        a = adv_seq[i]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - lo, 1 + hi) * a))
    return torch.stack(terms).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_seq_mean_token_mean_is_the_sequence_objective(seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    logp_old = -3 * torch.rand(b, t, generator=gen, dtype=F64)
    logp = (logp_old + 0.15 * torch.randn(b, t, generator=gen, dtype=F64)).requires_grad_(True)
    adv_seq = torch.randn(b, generator=gen, dtype=F64)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = adv_seq[:, None].expand(b, t)
    lo, hi = 0.02, 0.03  # narrow enough that some sequences are clipped and some are not
    ours = reduce(
        L.gspo(logp, logp_old, adv, mask, clip_low=lo, clip_high=hi), mask, "seq-mean-token-mean"
    )
    naive = _gspo_naive(logp, logp_old, adv_seq, mask, lo, hi)
    assert ours.item() == pytest.approx(naive.item(), rel=1e-12)
    (g1,) = torch.autograd.grad(ours, logp)
    (g2,) = torch.autograd.grad(naive, logp)
    np.testing.assert_allclose(g1.numpy(), g2.numpy(), rtol=1e-10, atol=1e-15)
    s = torch.exp(L.sequence_log_ratio(logp, logp_old, mask)).detach()
    clipped = ((adv_seq > 0) & (s > 1 + hi)) | ((adv_seq < 0) & (s < 1 - lo))
    assert 0 < int(clipped.sum()) < b  # both branches exercised


def test_gspo_is_not_ppo_clip_with_per_token_ratios():
    # Power: the per-token PPO clip on the same batch gives another gradient.
    logp, logp_old, adv, mask = _gspo_batch()
    g_gspo = torch.autograd.grad(
        L.gspo(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.2).sum(), logp
    )[0]
    ppo = torch.where(mask, L.ppo_clip(logp, logp_old, adv), 0.0)
    g_ppo = torch.autograd.grad(ppo.sum(), logp)[0]
    assert not torch.allclose(g_gspo, g_ppo)


def test_sequence_log_ratio_hand_and_masking():
    logp, logp_old, adv, mask = _gspo_batch()
    got = L.sequence_log_ratio(logp, logp_old, mask)
    np.testing.assert_allclose(got.detach().numpy(), [0.1, 0.3, -0.4, 0.1], rtol=1e-12)
    empty = torch.zeros_like(mask)
    assert L.sequence_log_ratio(logp, logp_old, empty).abs().max().item() == 0.0
    assert L.gspo(logp, logp_old, adv, empty).abs().max().item() == 0.0


def test_gspo_metrics_hand():
    logp, logp_old, adv, mask = _gspo_batch()
    m = L.gspo_metrics(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert m["clip_frac/seq"] == pytest.approx(0.5)  # sequences 1 and 2 of 4
    mean_s = (2 * math.exp(0.1) + math.exp(0.3) + math.exp(-0.4)) / 4
    assert m["ratio/seq_mean"] == pytest.approx(mean_s, rel=1e-12)


def test_cispo_hand_values_and_gradients():
    # logp = (-0.5, -1.0, -2.0), ratios r = (1.5, 0.5, 1.1), A = (1, -1, -2), clip_high 0.2.
    logp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64, requires_grad=True)
    r = torch.tensor([[1.5, 0.5, 1.1]], dtype=F64)
    logp_old = logp.detach() - r.log()
    adv = torch.tensor([[1.0, -1.0, -2.0]], dtype=F64)
    loss = L.cispo(logp, logp_old, adv, clip_high=0.2)
    # no lower bound: r̂ = (1.2, 0.5, 1.1); loss = -r̂·A·logp = (0.6, -0.5, -4.4)
    np.testing.assert_allclose(loss.detach().numpy(), [[0.6, -0.5, -4.4]], rtol=1e-12)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    # gradient -r̂·A = (-1.2, 0.5, 2.2): token 0 is clipped yet keeps its gradient
    np.testing.assert_allclose(grad.numpy(), [[-1.2, 0.5, 2.2]], rtol=1e-12)
    # with clip_low 0.2, token 1's weight is raised to 0.8: loss -0.8, gradient 0.8
    loss_lo = L.cispo(logp, logp_old, adv, clip_low=0.2, clip_high=0.2)
    assert loss_lo[0, 1].item() == pytest.approx(-0.8, rel=1e-12)
    (g_lo,) = torch.autograd.grad(loss_lo.sum(), logp)
    np.testing.assert_allclose(g_lo.numpy(), [[-1.2, 0.8, 2.2]], rtol=1e-12)
    # PPO's clip drops token 0 (A > 0, r > 1.2): gradient exactly 0 there.
    (g_ppo,) = torch.autograd.grad(L.ppo_clip(logp, logp_old, adv).sum(), logp)
    assert g_ppo[0, 0].item() == 0.0


def test_cispo_on_policy_gradient_is_reinforce():
    # r = 1 everywhere: the gradient is -A (vanilla policy gradient), logp_old gets none.
    logp = torch.tensor([[-0.3, -1.7]], dtype=F64, requires_grad=True)
    logp_old = logp.detach().clone().requires_grad_(True)
    adv = torch.tensor([[0.4, -2.0]], dtype=F64)
    loss = L.cispo(logp, logp_old, adv)
    g, g_old = torch.autograd.grad(loss.sum(), (logp, logp_old), allow_unused=True)
    np.testing.assert_allclose(g.numpy(), [[-0.4, 2.0]], rtol=1e-14)
    assert g_old is None or g_old.abs().max().item() == 0.0


def test_sequence_losses_errors():
    logp, logp_old, adv, mask = _gspo_batch()
    with pytest.raises(ValueError, match="clip_low"):
        L.gspo(logp, logp_old, adv, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="clip_high"):
        L.cispo(logp, logp_old, adv, clip_high=-0.1)
    with pytest.raises(TypeError, match="mask"):
        L.gspo(logp, logp_old, adv, mask.double())


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo"])
def test_kl_beside_sequence_losses_keeps_its_per_token_weight(policy_loss):
    """The KL's off-policy correction is w_t = pi_theta(y_t)/pi_old(y_t) per token under GSPO and
    CISPO: never GSPO's sequence ratio s_i broadcast onto the tokens."""
    logp, logp_old, adv, mask = _gspo_batch()
    logp_ref = logp_old - 0.3
    beta = 0.7
    if policy_loss == "gspo":
        pg = L.gspo(logp, logp_old, adv, mask, clip_low=0.2, clip_high=0.2)
    else:
        pg = L.cispo(logp, logp_old, adv, clip_high=0.2)
    kl_tok = L.kl_loss("k3", logp, logp_ref, logp_old=logp_old)
    total = torch.where(mask, pg + beta * kl_tok, 0.0).sum()
    (g_total,) = torch.autograd.grad(total, logp, retain_graph=True)
    pg_only = torch.where(mask, pg, 0.0).sum()
    (g_pg,) = torch.autograd.grad(pg_only, logp)
    # Hand: k3 = exp(-d) + d - 1, d = logp - logp_ref; d k3 / d logp = 1 - exp(-d); weight w_t.
    d = (logp - logp_ref).detach()
    w = torch.exp(logp - logp_old).detach()
    want = torch.where(mask, beta * w * (1 - torch.exp(-d)), 0.0)
    np.testing.assert_allclose((g_total - g_pg).numpy(), want.numpy(), rtol=1e-12, atol=1e-15)
    # Power: the sequence ratio broadcast would give another gradient here.
    s = torch.exp(L.sequence_log_ratio(logp, logp_old, mask)).detach()[:, None]
    wrong = torch.where(mask, beta * s * (1 - torch.exp(-d)), 0.0)
    assert not torch.allclose(want, wrong)


def test_gradcheck_float64_of_the_reduced_gspo_objective():
    """gradcheck compares autograd with finite differences of the *value*. Per token neither
    surrogate is the derivative of its value by design (GSPO-token puts each token's share of
    d s_i on that token only; CISPO's weight is detached), but GSPO reduced with
    seq-mean-token-mean is exactly the sequence objective, so there the two must agree."""
    logp, logp_old, adv, mask = _gspo_batch()
    x = logp.detach().clone().requires_grad_(True)  # no sequence sits on a clip boundary

    def objective(z):
        loss = L.gspo(z, logp_old, adv, mask, clip_low=0.2, clip_high=0.2)
        return reduce(loss, mask, "seq-mean-token-mean")

    assert torch.autograd.gradcheck(objective, (x,))
