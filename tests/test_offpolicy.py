"""The off-policy losses against their papers' equations: hand arithmetic and naive float64 loops."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from klpo import losses, offpolicy

F64 = torch.float64


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=F64)


def grad_of(loss_fn, logp: torch.Tensor) -> torch.Tensor:
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(x).sum(), x)
    return g


# --------------------------------------------------------------------------------------------
# Decoupled PPO (AReaL).


def test_decoupled_ppo_hand_values_and_gradient():
    # Token 0: u = e^0.1 = 1.10517 inside [0.8, 1.2], w = e^(0 - (-0.5)) = e^0.5 = 1.64872,
    #   A = 2: loss = -w u A = -1.64872 * 1.10517 * 2 = -3.64424; gradient -w u A the same.
    # Token 1: u = e^0.3 = 1.34986 > 1.2 with A = 1 > 0: clipped, loss = -w * 1.2 * 1 with
    #   w = e^(-1 - (-1)) = 1: -1.2, gradient 0.
    logp, prox, behav = t([0.1, -0.7]), t([0.0, -1.0]), t([-0.5, -1.0])
    adv = t([2.0, 1.0])
    loss = offpolicy.decoupled_ppo(logp, prox, behav, adv)
    w0, u0 = math.exp(0.5), math.exp(0.1)
    assert loss.flatten().tolist() == pytest.approx([-w0 * u0 * 2.0, -1.2], rel=1e-12)
    g = grad_of(lambda x: offpolicy.decoupled_ppo(x, prox, behav, adv), logp)
    assert g.flatten().tolist() == pytest.approx([-w0 * u0 * 2.0, 0.0], rel=1e-12)


def test_decoupled_ppo_is_ppo_clip_when_the_sampler_is_the_proximal_policy():
    gen = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 5, generator=gen, dtype=F64) for _ in range(3))
    a = offpolicy.decoupled_ppo(logp, old, old, adv, clip_low=0.2, clip_high=0.28)
    b = losses.ppo_clip(logp, old, adv, clip_low=0.2, clip_high=0.28)
    assert torch.equal(a, b)


def test_decoupled_ppo_weight_cap_drops_the_token_as_areal_does():
    logp, prox, behav, adv = t([0.0, 0.0]), t([0.0, 0.0]), t([-3.0, -1.0]), t([1.0, 1.0])
    # w = e^3 = 20.1 > 10: dropped (0, not 10 · loss); w = e^1 = 2.72 stays.
    loss = offpolicy.decoupled_ppo(logp, prox, behav, adv, weight_cap=10.0)
    assert loss.flatten().tolist() == pytest.approx([0.0, -math.e], rel=1e-12)
    g = grad_of(lambda x: offpolicy.decoupled_ppo(x, prox, behav, adv, weight_cap=10.0), logp)
    assert g.flatten().tolist() == pytest.approx([0.0, -math.e], rel=1e-12)


def test_decoupled_ppo_expected_gradient_over_the_sampler_is_that_over_the_proximal_policy():
    # One categorical state, every token enumerated: sum_y q(y) grad loss(y) with q = pi_behav
    # equals sum_y pi_prox(y) grad ppo_clip(y), the weight's promise (exact, uncapped).
    theta = torch.tensor([0.3, -0.2, 0.5, 0.0], dtype=F64)
    prox = torch.log_softmax(torch.tensor([0.2, -0.1, 0.4, 0.1], dtype=F64), -1)
    behav = torch.log_softmax(torch.tensor([-0.4, 0.6, 0.1, 0.2], dtype=F64), -1)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=F64)

    def expected(fn, weights):
        x = theta.clone().requires_grad_(True)
        lp = torch.log_softmax(x, -1)
        (g,) = torch.autograd.grad((weights * fn(lp)).sum(), x)
        return g

    g_dec = expected(lambda lp: offpolicy.decoupled_ppo(lp, prox, behav, adv), behav.exp())
    g_ppo = expected(lambda lp: losses.ppo_clip(lp, prox, adv), prox.exp())
    assert torch.allclose(g_dec, g_ppo, rtol=1e-12, atol=1e-15)


# --------------------------------------------------------------------------------------------
# M2PO.


def naive_m2po_keep(log_ratio: list[float], tau: float) -> list[bool]:
    """Drop the largest squared log-ratio one at a time until the rest's mean is below tau."""
    kept = list(range(len(log_ratio)))
    while kept and sum(log_ratio[i] ** 2 for i in kept) / len(kept) >= tau:
        kept.remove(max(kept, key=lambda i: log_ratio[i] ** 2))
    return [i in kept for i in range(len(log_ratio))]


def test_m2po_mask_hand_case():
    # (log r)² = [0.25, 0.01, 0.0016, 0.09]; mean of all = 0.0879 >= 0.04; drop 0.25: mean of
    # [0.01, 0.0016, 0.09] = 0.0339 < 0.04. So only the first token goes.
    lr = t([0.5, 0.1, -0.04, -0.3])
    keep = offpolicy.m2po_mask(lr, torch.ones(1, 4, dtype=torch.bool), threshold=0.04)
    assert keep.tolist() == [[False, True, True, True]]


def test_m2po_mask_matches_the_naive_loop_and_ignores_padding():
    gen = torch.Generator().manual_seed(1)
    for scale, tau in ((0.1, 0.04), (0.4, 0.04), (1.0, 0.01), (0.05, 1.0)):
        lr = scale * torch.randn(4, 6, generator=gen, dtype=F64)
        mask = torch.rand(4, 6, generator=gen) > 0.3
        keep = offpolicy.m2po_mask(lr.masked_fill(~mask, 1e6), mask, threshold=tau)
        want = naive_m2po_keep(lr[mask].tolist(), tau)
        assert keep[mask].tolist() == want
        assert not keep[~mask].any()
        kept = lr[keep]
        if kept.numel():
            assert float(kept.square().mean()) < tau


def test_m2po_mask_drops_everything_when_no_token_is_below_tau():
    keep = offpolicy.m2po_mask(t([1.0, -1.0]), torch.ones(1, 2, dtype=torch.bool), threshold=0.5)
    assert not keep.any()
    empty = offpolicy.m2po_mask(t([1.0]), torch.zeros(1, 1, dtype=torch.bool), threshold=0.5)
    assert not empty.any()


def test_m2po_loss_is_the_unclipped_surrogate_on_the_kept_tokens():
    logp, prox, behav = t([0.0, 0.2, -0.1]), t([0.0, 0.0, 0.0]), t([-0.5, 0.15, -0.1])
    adv, mask = t([1.0, 2.0, -1.0]), torch.ones(1, 3, dtype=torch.bool)
    # log(pi_theta/pi_behav) = [0.5, 0.05, 0]; (.)² = [0.25, 0.0025, 0]; mean 0.0842 >= 0.04,
    # drop the first: mean 0.00125 < 0.04. Loss = -r A on the rest, r = e^0.2 (no clip at 1.22).
    loss = offpolicy.m2po(logp, prox, behav, adv, mask, threshold=0.04)
    assert loss.flatten().tolist() == pytest.approx(
        [0.0, -2.0 * math.exp(0.2), math.exp(-0.1)], rel=1e-12
    )
    g = grad_of(lambda x: offpolicy.m2po(x, prox, behav, adv, mask, threshold=0.04), logp)
    assert g.flatten().tolist() == pytest.approx(
        [0.0, -2.0 * math.exp(0.2), math.exp(-0.1)], rel=1e-12
    )


# --------------------------------------------------------------------------------------------
# DPPO.


def test_dppo_tv_mask_constrains_only_the_advantages_direction():
    # p - q per token: +0.3 (A > 0: over delta 0.2, dropped), +0.3 (A < 0: moving against,
    # kept), -0.3 (A < 0: over, dropped), -0.3 (A > 0: kept), +0.1 (A > 0: kept).
    q = torch.tensor([[0.4, 0.4, 0.7, 0.7, 0.4]], dtype=F64)
    p = q + torch.tensor([[0.3, 0.3, -0.3, -0.3, 0.1]], dtype=F64)
    adv = t([1.0, -1.0, -1.0, 1.0, 1.0])
    keep = offpolicy.dppo_mask(p.log(), q.log(), adv, divergence="tv")
    assert keep.tolist() == [[False, True, False, True, True]]


def naive_binary_kl(q: float, p: float) -> float:
    return q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_mask_matches_the_binary_kl_by_hand():
    gen = torch.Generator().manual_seed(2)
    q = torch.rand(1, 12, generator=gen, dtype=F64) * 0.9 + 0.05
    p = (q + 0.4 * (torch.rand(1, 12, generator=gen, dtype=F64) - 0.5)).clamp(0.01, 0.99)
    adv = torch.randn(1, 12, generator=gen, dtype=F64)
    keep = offpolicy.dppo_mask(
        p.log(), q.log(), adv, divergence="kl", delta_low=0.02, delta_high=0.05
    )
    for j in range(12):
        pj, qj, aj = float(p[0, j]), float(q[0, j]), float(adv[0, j])
        bkl = naive_binary_kl(qj, pj)
        want = (bkl <= 0.05 or pj <= qj) if aj > 0 else (bkl <= 0.02 or pj >= qj)
        assert bool(keep[0, j]) == want, j
    assert not keep.all() and keep.any()  # the case exercises both outcomes


def test_dppo_loss_gradient_is_the_truncated_weight_times_the_advantage():
    # r = e^{0.5} = 1.65 (under the cap 20) and r = e^{4} = 54.6 (truncated to 20); both kept
    # (delta 1: TV never exceeds 1).
    logp, old, adv = t([-0.5, -1.0]), t([-1.0, -5.0]), t([2.0, 1.0])
    g = grad_of(lambda x: offpolicy.dppo(x, old, adv, delta_low=1.0, delta_high=1.0), logp)
    assert g.flatten().tolist() == pytest.approx([-2.0 * math.exp(0.5), -20.0], rel=1e-12)
    # Masked tokens add exactly zero: p - q = e^-0.5 - e^-1 = 0.239 > 0.2 with A > 0.
    loss = offpolicy.dppo(logp, old, adv)
    assert loss[0, 0] == 0.0
    g = grad_of(lambda x: offpolicy.dppo(x, old, adv), logp)
    assert g[0, 0] == 0.0


# --------------------------------------------------------------------------------------------
# Trust Region Masking.


def test_trm_mask_rejects_whole_sequences_by_their_worst_token():
    # Sequence 0: log rho = [0, 0.1, -0.05]: k3 = e^x - 1 - x = [0, 0.00517, 0.00123]; max 0.00517.
    # Sequence 1: log rho = [0, -0.5, 0]: k3 of -0.5 = e^-0.5 - 0.5 = 0.10653 > 0.01: rejected.
    logp = t([0.1, 0.1, -0.05], [0.0, -0.5, 0.0])
    behav = torch.zeros(2, 3, dtype=F64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    keep = offpolicy.trm_mask(logp, behav, mask, delta=0.01)
    assert keep.tolist() == [[True] * 3, [False] * 3]
    # k1 max: |log rho| max 0.1 and 0.5: both rejected at delta 0.09, sequence 0 kept at 0.2.
    assert offpolicy.trm_mask(logp, behav, mask, delta=0.09, statistic="k1").sum() == 0
    assert offpolicy.trm_mask(logp, behav, mask, delta=0.2, statistic="k1")[0].all()
    # mean k1 (verl's seq_mean_k1): |mean| = |(0.1 + 0.1 - 0.05)/3| = 0.05 and 0.5/3 = 0.1667.
    keep = offpolicy.trm_mask(logp, behav, mask, delta=0.06, statistic="k1", aggregate="mean")
    assert keep[:, 0].tolist() == [True, False]


def test_trm_mask_ignores_padding_and_takes_the_exact_kl():
    logp = t([0.0, 5.0], [0.0, 0.0])
    behav = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[True, False], [False, False]])
    keep = offpolicy.trm_mask(logp, behav, mask, delta=0.01)
    assert keep.tolist() == [[True, False], [False, False]]  # the padded 5.0 is not seen
    exact = t([0.02, 0.0], [0.0, 0.0])
    assert not offpolicy.trm_mask(logp, behav, mask, delta=0.01, token_kl=exact).any()


# --------------------------------------------------------------------------------------------
# The k2 penalty toward the sampler.


def test_sampler_k2_value_and_gradient():
    logp, behav = t([-1.0, -2.0]), t([-1.5, -2.0])
    # coef 1e-3 · (0.5)² = 2.5e-4; gradient 2 · 1e-3 · 0.5 = 1e-3; 0 where they agree.
    assert offpolicy.sampler_k2(logp, behav).flatten().tolist() == pytest.approx(
        [2.5e-4, 0.0], rel=1e-12
    )
    g = grad_of(lambda x: offpolicy.sampler_k2(x, behav), logp)
    assert g.flatten().tolist() == pytest.approx([1e-3, 0.0], rel=1e-12)
    assert not offpolicy.sampler_k2(logp, behav.clone().requires_grad_(True)).requires_grad


def test_sampler_k2_expected_gradient_is_twice_coef_grad_kl_to_the_sampler_on_policy():
    theta = torch.tensor([0.3, -0.2, 0.5], dtype=F64)
    behav = torch.log_softmax(torch.tensor([0.0, 0.1, 0.2], dtype=F64), -1)
    x = theta.clone().requires_grad_(True)
    lp = torch.log_softmax(x, -1)
    p = lp.detach().exp()
    (g,) = torch.autograd.grad((p * offpolicy.sampler_k2(lp, behav, coef=0.5)).sum(), x)
    y = theta.clone().requires_grad_(True)
    lq = torch.log_softmax(y, -1)
    (g_kl,) = torch.autograd.grad((lq.exp() * (lq - behav)).sum(), y)
    assert torch.allclose(g, 2 * 0.5 * g_kl, rtol=1e-12, atol=1e-15)


def test_bad_arguments_name_the_fix():
    x = t([0.0])
    with pytest.raises(ValueError, match="weight_cap must be > 0"):
        offpolicy.decoupled_ppo(x, x, x, x, weight_cap=0.0)
    with pytest.raises(ValueError, match="M2 threshold tau must be > 0"):
        offpolicy.m2po_mask(x, torch.ones(1, 1, dtype=torch.bool), threshold=0.0)
    with pytest.raises(ValueError, match="choose 'tv' or 'kl'"):
        offpolicy.dppo_mask(x, x, x, divergence="js")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="choose 'k1' or 'k3'"):
        offpolicy.trm_mask(x, x, torch.ones(1, 1, dtype=torch.bool), delta=1.0, statistic="k2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mask must be a bool tensor"):
        offpolicy.m2po_mask(x, torch.ones(1, 1), threshold=0.1)
    with pytest.raises(ValueError, match="coef must be >= 0"):
        offpolicy.sampler_k2(x, x, coef=-1.0)


# --------------------------------------------------------------------------------------------
# Trust-region diagnostics.


def test_effective_sample_size_hand_values():
    mask = torch.ones(1, 3, dtype=torch.bool)
    # Equal weights: 1. Weights (1, 1, 4): (6)² / (3 · 18) = 36 / 54 = 2/3.
    assert float(offpolicy.effective_sample_size(t([0.3, 0.3, 0.3]), mask)) == pytest.approx(1.0)
    lw = t([0.0, 0.0, math.log(4.0)])
    assert float(offpolicy.effective_sample_size(lw, mask)) == pytest.approx(2 / 3, rel=1e-12)
    # Shift-invariant (huge log-weights do not overflow) and padding is ignored.
    big = lw + 800.0
    assert float(offpolicy.effective_sample_size(big, mask)) == pytest.approx(2 / 3, rel=1e-12)
    padded = torch.cat([lw, t([50.0])], dim=1)
    pmask = torch.tensor([[True, True, True, False]])
    assert float(offpolicy.effective_sample_size(padded, pmask)) == pytest.approx(2 / 3, rel=1e-12)
    assert float(offpolicy.effective_sample_size(lw, torch.zeros_like(mask))) == 1.0


def test_trust_region_metrics_against_a_naive_loop():
    gen = torch.Generator().manual_seed(3)
    b, n, v = 3, 4, 5
    logits = torch.randn(b, n, v, generator=gen, dtype=F64)
    logits_behav = logits + 0.3 * torch.randn(b, n, v, generator=gen, dtype=F64)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    lq = torch.log_softmax(logits_behav, -1).gather(-1, tokens[..., None])[..., 0]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    keep = mask & (torch.rand(b, n, generator=gen) > 0.4)
    m = offpolicy.trust_region_metrics(
        lp,
        lq,
        mask,
        clip_low=0.1,
        clip_high=0.1,
        keep=keep,
        logits=logits,
        logits_behav=logits_behav,
    )
    cells = [(i, j) for i in range(b) for j in range(n) if mask[i, j]]
    lw = [float(lp[i, j] - lq[i, j]) for i, j in cells]
    w = [math.exp(x) for x in lw]
    nt = len(cells)
    mean = lambda xs: sum(xs) / nt  # noqa: E731
    seq = [sum(float(lp[i, j] - lq[i, j]) for j in range(n) if mask[i, j]) for i in range(b)]
    ws = [math.exp(x) for x in seq]
    p, q = torch.softmax(logits, -1), torch.softmax(logits_behav, -1)
    kl = [float((q[i, j] * (q[i, j].log() - p[i, j].log())).sum()) for i, j in cells]
    tv = [0.5 * float((p[i, j] - q[i, j]).abs().sum()) for i, j in cells]
    want = {
        "sampler/ess": sum(w) ** 2 / (nt * sum(x * x for x in w)),
        "sampler/ess_seq": sum(ws) ** 2 / (b * sum(x * x for x in ws)),
        "sampler/m2": mean([x * x for x in lw]),
        "sampler/kl_k1": mean([-x for x in lw]),
        "sampler/kl_k3": mean([math.exp(x) - 1 - x for x in lw]),
        "sampler/kl_k3_max": max(math.exp(x) - 1 - x for x in lw),
        "sampler/tv": mean([0.5 * abs(x - 1) for x in w]),
        "sampler/tv_binary_max": max(
            abs(math.exp(float(lp[i, j])) - math.exp(float(lq[i, j]))) for i, j in cells
        ),
        "sampler/clip_frac": mean([float(x < 0.9 or x > 1.1) for x in w]),
        "sampler/masked_frac": mean([float(not keep[i, j]) for i, j in cells]),
        "sampler/kl_exact": mean(kl),
        "sampler/kl_exact_max": max(kl),
        "sampler/tv_exact": mean(tv),
        "sampler/tv_exact_max": max(tv),
    }
    assert set(m) == set(want)
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_trust_region_metrics_unbiased_for_the_exact_kl_and_tv_over_the_sampler():
    # One position, every token weighted by pi_behav: the sampled k1, k3 and |w - 1|/2 average
    # to the exact KL(pi_behav ‖ pi_theta) and TV (the estimators' promise).
    logits = torch.tensor([[[0.2, -0.4, 1.0, 0.0]]], dtype=F64)
    logits_behav = torch.tensor([[[0.5, 0.1, 0.3, -0.2]]], dtype=F64)
    lp, lq = torch.log_softmax(logits, -1)[0, 0], torch.log_softmax(logits_behav, -1)[0, 0]
    q = lq.exp()
    per_token = [
        offpolicy.trust_region_metrics(
            lp[y].view(1, 1), lq[y].view(1, 1), torch.ones(1, 1, dtype=torch.bool)
        )
        for y in range(4)
    ]
    exact = offpolicy.trust_region_metrics(
        lp[:1].view(1, 1), lq[:1].view(1, 1), torch.ones(1, 1, dtype=torch.bool),
        logits=logits, logits_behav=logits_behav,
    )  # fmt: skip
    for key, target in (("sampler/kl_k1", "sampler/kl_exact"), ("sampler/kl_k3", "sampler/kl_exact"),
                        ("sampler/tv", "sampler/tv_exact")):  # fmt: skip
        avg = sum(float(q[y]) * per_token[y][key] for y in range(4))
        assert avg == pytest.approx(exact[target], rel=1e-12), key


def test_trust_region_metrics_with_no_token_and_half_given_logits():
    x = torch.zeros(1, 2, dtype=F64)
    m = offpolicy.trust_region_metrics(x, x, torch.zeros(1, 2, dtype=torch.bool))
    assert m["sampler/ess"] == 1.0 and m["sampler/kl_k3_max"] == 0.0 and m["sampler/m2"] == 0.0
    with pytest.raises(ValueError, match="give both logits= and logits_behav="):
        offpolicy.trust_region_metrics(
            x, x, torch.ones(1, 2, dtype=torch.bool), logits=torch.zeros(1, 2, 3)
        )


def _stale_batch(gen, b=7, n=5, v=6, shift=0.0):
    """A float64 batch of the sampler's and the trainer's logits, sampled tokens, ragged rows
    (one row without a token) and a mask of kept tokens; ``shift`` is added to the first three
    rows' log weights (so the shares' largest weights are far apart)."""
    logits = torch.randn(b, n, v, generator=gen, dtype=F64)
    logits_behav = logits + 0.4 * torch.randn(b, n, v, generator=gen, dtype=F64)
    tokens = torch.randint(0, v, (b, n), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    lq = torch.log_softmax(logits_behav, -1).gather(-1, tokens[..., None])[..., 0]
    lp[:3] += shift
    lengths = torch.randint(1, n + 1, (b,), generator=gen)
    lengths[b // 2] = 0
    mask = torch.arange(n)[None, :] < lengths[:, None]
    keep = mask & (torch.rand(b, n, generator=gen) > 0.3)
    return lp, lq, mask, keep, logits, logits_behav


def _share_stats(batch, rows, **kw):
    """One share's statistics, trimmed to its own longest row (as a rank pads its own rows)."""
    lp, lq, mask, keep, logits, logits_behav = (x[rows] for x in batch)
    width = max(1, int(mask.sum(-1).max())) if rows else 1
    cut = (slice(None), slice(0, width))
    return offpolicy.trust_region_stats(
        lp[cut], lq[cut], mask[cut], keep=keep[cut], logits=logits[cut],
        logits_behav=logits_behav[cut], **kw,
    )  # fmt: skip


@pytest.mark.parametrize("shift", [0.0, 30.0])
@pytest.mark.parametrize("cuts", [[4], [2, 5], [0, 3, 4]], ids=["two", "three", "empty"])
def test_pooled_trust_region_stats_are_the_whole_batchs(cuts, shift):
    """Every sampler/* metric of a batch split by rows into shares (each padded to its own
    width, a share without a row and one without a token, weights e^30 apart), each share's statistics merged, is the
    whole batch's trust_region_metrics, to float64 rounding; one share alone, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    batch = _stale_batch(gen, shift=shift)
    lp, lq, mask, keep, logits, logits_behav = batch
    kw = {"clip_low": 0.15, "clip_high": 0.25, "temperature": 0.9}
    whole = offpolicy.trust_region_metrics(
        lp, lq, mask, keep=keep, logits=logits, logits_behav=logits_behav, **kw
    )
    bounds = [0, *cuts, lp.shape[0]]
    shares = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    parts = [_share_stats(batch, rows, **kw) for rows in shares]
    if cuts == [0, 3, 4]:
        assert shares[0] == [] and shares[2] == [3] and float(parts[2]["tokens"]) == 0
    pooled = offpolicy.finish_trust_region_stats(offpolicy.merge_trust_region_stats(parts))
    assert list(pooled) == list(whole) and len(whole) == 14
    for key, value in whole.items():
        assert pooled[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert 0 < whole["sampler/masked_frac"] < 1 and whole["sampler/ess"] < 1
    one = offpolicy.merge_trust_region_stats([_share_stats(batch, list(range(7)), **kw)])
    assert offpolicy.finish_trust_region_stats(one) == whole


def test_trust_region_stats_take_the_exact_values_per_position():
    """token_kl= and token_tv= (the trainer's chunked exact values) give the logits' metrics."""
    gen = torch.Generator().manual_seed(6)
    lp, lq, mask, keep, logits, logits_behav = _stale_batch(gen)
    from_logits = offpolicy.trust_region_metrics(
        lp, lq, mask, logits=logits, logits_behav=logits_behav
    )
    p, q = torch.softmax(logits, -1), torch.softmax(logits_behav, -1)
    kl = (q * (q.log() - p.log())).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    stats = offpolicy.trust_region_stats(lp, lq, mask, token_kl=kl, token_tv=tv)
    given = offpolicy.finish_trust_region_stats(stats)
    assert list(given) == list(from_logits)
    for key, value in from_logits.items():
        assert given[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    with pytest.raises(ValueError, match="give both token_kl= and token_tv="):
        offpolicy.trust_region_stats(lp, lq, mask, token_kl=kl)
    with pytest.raises(ValueError, match="not both"):
        offpolicy.trust_region_stats(
            lp, lq, mask, token_kl=kl, token_tv=tv, logits=logits, logits_behav=logits_behav
        )
    with pytest.raises(ValueError, match="share 1 has the statistics"):
        offpolicy.merge_trust_region_stats(
            [stats, offpolicy.trust_region_stats(lp, lq, mask, keep=keep)]
        )


def test_m2po_keep_over_the_shares_concatenated_is_the_whole_batchs_mask():
    """Each share's (log r)² concatenated in order, m2po_keep once, each share its slice: the
    whole batch's m2po_mask (ties included, ranked in the batch's order)."""
    gen = torch.Generator().manual_seed(7)
    log_r = 0.3 * torch.randn(6, 5, generator=gen, dtype=F64)
    log_r[1, :2] = 0.2  # ties
    log_r[4, 1] = -0.2
    mask = torch.rand(6, 5, generator=gen) > 0.3
    for tau in (0.005, 0.02, 0.04):
        whole = offpolicy.m2po_mask(log_r, mask, threshold=tau)
        assert 0 < int(whole.sum()) < int(mask.sum())
        shares = [slice(0, 2), slice(2, 2), slice(2, 6)]  # (a share with no row)
        values = [log_r[s].square()[mask[s]] for s in shares]
        kept = offpolicy.m2po_keep(torch.cat(values), threshold=tau)
        start = 0
        for s, v in zip(shares, values, strict=True):
            got = torch.zeros_like(mask[s])
            got[mask[s]] = kept[start : start + v.numel()]
            start += v.numel()
            assert torch.equal(got, whole[s])
    with pytest.raises(ValueError, match="m2 must be 1-D"):
        offpolicy.m2po_keep(log_r, threshold=0.1)


def test_the_docstring_examples_pass():
    """Every public function of klpo.offpolicy carries an example with a value checkable by
    hand, and they run (optax's habit)."""
    import doctest
    import inspect

    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(offpolicy, "klpo.offpolicy"):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0 and result.failed == 0
    missing = [
        f
        for f in offpolicy.__all__
        if inspect.isfunction(getattr(offpolicy, f))
        and ">>>" not in (inspect.getdoc(getattr(offpolicy, f)) or "")
    ]
    assert missing == []
