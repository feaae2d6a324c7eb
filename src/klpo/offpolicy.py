r"""The field's off-policy policy losses: trust regions anchored to the sampler, not the reference.

When rollouts are stale (asynchronous RL) or come from an inference engine with numerics of its
own, four policies are in play per sampled token ``y_t``:

- ``logp``: ``[B, T]`` log pi_theta(y_t), the policy being trained (carries the gradient);
- ``logp_prox``: log pi_prox(y_t), the *proximal* policy: the trainer's own recomputation at the
  start of the step (klpo's ``logp_old``; AReaL's ``prox_logp``), detached;
- ``logp_behav``: log pi_behav(y_t), the *behaviour* policy that sampled the token (the engine's
  log-probs, k versions back), detached;
- ``adv``: ``[B, T]`` advantages, detached.

Each loss here is a per-token ``[B, T]`` tensor to be *minimised*, reduced by the caller with
:func:`klpo.reduce.reduce` and the batch's mask. Ratios are computed in float64 (float32 on
Apple's MPS) with their exponents capped at ±700 in the value only (:func:`klpo._tensor.capped`);
outputs are float32, float64 when an input is float64. Masks (``keep``) are bool, True where the
token takes part; a dropped token's loss and gradient are exactly 0.

| function | paper | what it anchors to |
| --- | --- | --- |
| :func:`decoupled_ppo` | Fu et al. 2025, AReaL (arXiv:2505.24298), eq. 5 | clip to pi_prox, IS weight pi_prox/pi_behav |
| :func:`m2po_mask`, :func:`m2po` | Zheng, Zhao & Chen 2025, M2PO (arXiv:2510.01161) | second moment of log(pi_theta/pi_behav) |
| :func:`dppo_mask`, :func:`dppo` | Qi et al. 2026, DPPO (arXiv:2602.04879) | binary TV or binary KL to the anchor |
| :func:`trm_mask` | Li et al. 2025, Trust Region Masking (arXiv:2512.23075) | the sequence's token divergences to the sampler |
| :func:`sampler_k2` | prime-rl's default loss (after Kimi K2.5, arXiv:2602.02276) | k2 toward the sampler |

And the diagnostics of the trust region (:func:`trust_region_metrics`, keys ``sampler/...``):
the effective sample size of the importance weights (:func:`effective_sample_size`; VCPO, Huang et
al., arXiv:2602.17616), M2PO's second moment, k1/k3 and exact KL(pi_behav ‖ pi_theta), the total
variation, and the shares of tokens a clip or mask drops.

None of these involves pi_ref: the KL to the reference is a separate term with its own off-policy
weight (:func:`klpo.losses.kl_loss`, and ``klpo explain --staleness`` for what each weight does).

**Experimental** (docs/architecture.md, "Experimental parts"): these losses' API and their
settings (``algo.policy_loss`` dppo-tv, dppo-kl, dppo-tv-k2, m2po; ``algo.trm_delta``) may
change; each is tested for exactness against an oracle, none is measured on real models at
scale.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from klpo._ratios import widened
from klpo._tensor import capped_exp, check_float, check_mask, check_same_shape, to_out, wide_dtype
from klpo.trust_region import (
    effective_sample_size,
    finish_trust_region_stats,
    merge_trust_region_stats,
    trust_region_metrics,
    trust_region_stats,
)

__all__ = [
    "decoupled_ppo",
    "dppo",
    "dppo_mask",
    "effective_sample_size",
    "finish_trust_region_stats",
    "m2po",
    "m2po_keep",
    "m2po_mask",
    "merge_trust_region_stats",
    "sampler_k2",
    "trm_mask",
    "trust_region_metrics",
    "trust_region_stats",
]

Divergence = Literal["tv", "kl"]
TrmStatistic = Literal["k1", "k3"]
TrmAggregate = Literal["max", "mean"]


def _nonneg(name: str, x: float) -> float:
    if not x >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return float(x)


# --------------------------------------------------------------------------------------------
# AReaL: decoupled PPO.


def decoupled_ppo(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    adv: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    weight_cap: float | None = None,
) -> Tensor:
    r"""AReaL's decoupled PPO loss: the trust region on pi_prox, the correction on pi_behav.

    Fu et al. 2025 (AReaL, arXiv:2505.24298, eq. 5) separate PPO's two jobs. The tokens come from
    pi_behav; the clip keeps pi_theta near the proximal policy pi_prox (the trainer's weights at
    the start of the step), and a detached importance weight corrects the sampling:

        u_t = pi_theta(y_t) / pi_prox(y_t),    w_t = sg(pi_prox(y_t) / pi_behav(y_t))
        loss_t = w_t · max(-u_t A_t, -clip(u_t, 1 - clip_low, 1 + clip_high) A_t)

    With ``weight_cap = C`` a token whose ``w_t > C`` is dropped (loss and gradient 0), as AReaL's
    ``behav_imp_weight_cap`` does; it is not truncated to C. With pi_behav = pi_prox this is
    :func:`klpo.losses.ppo_clip`.

    Gradient with respect to ``logp``: ``-w_t u_t A_t`` where the unclipped branch is active,
    0 where the clip binds or the token is dropped; none into ``logp_prox``, ``logp_behav``,
    ``adv``. Its expectation over y ~ pi_behav is that of the clipped surrogate over
    y ~ pi_prox (``sum_y pi_behav w g = sum_y pi_prox g``), uncapped.

    Args:
        logp, logp_prox, logp_behav, adv: ``[B, T]``.
        clip_low: in [0, 1). clip_high: >= 0.
        weight_cap: ``C > 0``, or None for no cap.

    Returns:
        ``[B, T]`` per-token loss.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> logp, prox = torch.tensor([[0.1, -0.7]]), torch.tensor([[0.0, -1.0]])
        >>> behav, adv = torch.tensor([[-0.5, -1.0]]), torch.tensor([[2.0, 1.0]])
        >>> offpolicy.decoupled_ppo(logp, prox, behav, adv)  # -e^0.5 e^0.1 2; -1 · 1.2 (clipped)
        tensor([[-3.6442, -1.2000]])
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    _nonneg("clip_high", clip_high)
    if weight_cap is not None and not weight_cap > 0:
        raise ValueError(f"weight_cap must be > 0 (or None for no cap), got {weight_cap!r}")
    lp, prox, behav, a = widened(logp, logp_prox=logp_prox, logp_behav=logp_behav, adv=adv)
    u = capped_exp(lp - prox)
    w = capped_exp(prox - behav)
    if weight_cap is not None:
        w = torch.where(w <= weight_cap, w, 0.0)
    loss = torch.maximum(-a * u, -a * u.clamp(1.0 - clip_low, 1.0 + clip_high))
    return to_out(w * loss, logp, logp_prox, logp_behav, adv)


# --------------------------------------------------------------------------------------------
# M2PO: the second moment of the log-ratio.


def m2po_mask(log_ratio: Tensor, mask: Tensor, *, threshold: float = 0.04) -> Tensor:
    r"""M2PO's token mask: drop the tokens of largest ``(log r)²`` until the rest's mean is < tau.

    Zheng, Zhao & Chen 2025 (M2PO, "Prosperity before collapse", arXiv:2510.01161) constrain the
    second moment of the log importance ratio over the batch,

        M2 = (1 / N) sum_i (log r_i)²,    r_i = pi_theta(y_i) / pi_behav(y_i),

    rather than clipping each ratio: the tokens are sorted by ``(log r_i)²``, and the k largest
    are masked, k the fewest for which the mean of the remaining ones is below ``threshold``
    (tau_M2; 0.04 in the paper). If even the smallest alone is not below tau, every token is
    masked. This is AReaL's implementation of the rule (``m2_threshold``), computed once per
    batch with pi_prox in place of pi_theta, which is the same at the first update.

    The mask is a property of the whole batch passed in (the tokens where ``mask``): pass the
    optimizer step's tokens, not one micro-batch's, or the masks differ with the split.

    Args:
        log_ratio: ``[B, T]`` log pi_theta - log pi_behav (detached here).
        mask: ``[B, T]`` bool, True where the token takes part.
        threshold: tau_M2 > 0.

    Returns:
        ``[B, T]`` bool, True where the token is kept (always False where ``mask`` is).

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> log_r = torch.tensor([[0.5, 0.1, -0.04, -0.3]])  # (log r)²: 0.25, 0.01, 0.0016, 0.09
        >>> offpolicy.m2po_mask(log_r, torch.ones(1, 4, dtype=torch.bool), threshold=0.04)
        tensor([[False,  True,  True,  True]])

    (all four: mean 0.088 ≥ 0.04; without the largest: 0.034 < 0.04.)
    """
    check_float("log_ratio", log_ratio)
    check_mask(mask, log_ratio.shape)
    _check_tau(threshold)
    with torch.no_grad():
        m2 = log_ratio.detach().to(wide_dtype(log_ratio)).square()
        keep = torch.zeros_like(mask)
        keep[mask] = m2po_keep(m2[mask], threshold=threshold)
    return keep


def _check_tau(threshold: float) -> None:
    if not threshold > 0:
        raise ValueError(f"the M2 threshold tau must be > 0, got {threshold!r}")


def m2po_keep(m2: Tensor, *, threshold: float = 0.04) -> Tensor:
    r"""The rule of :func:`m2po_mask` on a flat sample: which of the values ``m2`` it keeps.

    ``m2``: 1-D, the ``(log r_i)²`` of the batch's valid tokens in the batch's order (row by
    row). The values are ranked from the largest (ties in that order), and the k largest
    dropped, k the fewest for which the mean of the rest is below ``threshold`` (all dropped if
    none is). Only the ranking and the suffix means matter, so a batch spread over processes is
    masked as one process holding it would: concatenate every process's values in rank order
    (as one process would hold their rows), apply this once, and give each process its slice
    (:mod:`klpo.train.step.update` under ``torchrun``).

    Args:
        m2: ``[n]`` float, >= 0 (read detached).
        threshold: tau_M2 > 0.

    Returns:
        ``[n]`` bool, True where the value is kept.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> offpolicy.m2po_keep(torch.tensor([0.25, 0.01, 0.0016, 0.09]), threshold=0.04)
        tensor([False,  True,  True,  True])
    """
    check_float("m2", m2)
    if m2.dim() != 1:
        raise ValueError(f"m2 must be 1-D (one value per valid token), got {tuple(m2.shape)}")
    _check_tau(threshold)
    with torch.no_grad():
        values = m2.detach()
        n = values.numel()
        kept = torch.zeros(n, dtype=torch.bool, device=values.device)
        if n == 0:
            return kept
        order = torch.argsort(values, descending=True, stable=True)
        ranked = values[order]
        # The mean of ranked[i:], for i = 0..n-1: keep ranked[k:] for the first k below tau.
        suffix_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(
            n, 0, -1, dtype=ranked.dtype, device=ranked.device
        )
        below = torch.nonzero(suffix_mean < threshold)
        k = int(below[0]) if below.numel() else n
        kept[order[k:]] = True
    return kept


def m2po(
    logp: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    threshold: float = 0.04,
) -> Tensor:
    r"""M2PO's loss: the unclipped ratio surrogate on the tokens :func:`m2po_mask` keeps.

        loss_t = -M_t · (pi_theta(y_t) / pi_prox(y_t)) · A_t,    M = m2po_mask(sg(logp) - logp_behav)

    (Zheng, Zhao & Chen 2025, arXiv:2510.01161, the M2PO objective; no ratio clip: the second
    moment is the trust region). Reduce with ``token-mean`` over every valid token for the
    paper's normalisation (the masked tokens count in the denominator).

    Gradient with respect to ``logp``: ``-M_t r_t A_t``; the mask is detached.

    Args:
        logp, logp_prox, logp_behav, adv: ``[B, T]``.
        mask: ``[B, T]`` bool, the batch's valid tokens (the M2 statistic is over them).
        threshold: tau_M2 > 0.

    Returns:
        ``[B, T]`` per-token loss, 0 where masked.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> logp, behav = torch.tensor([[0.0, 0.2]]), torch.tensor([[-0.5, 0.15]])  # (log r)²: 0.25, 0.0025
        >>> offpolicy.m2po(logp, torch.zeros(1, 2), behav, torch.tensor([[1.0, 2.0]]),
        ...                torch.ones(1, 2, dtype=torch.bool))  # the first dropped; -e^0.2 · 2
        tensor([[ 0.0000, -2.4428]])
    """
    lp, prox, behav, a = widened(logp, logp_prox=logp_prox, logp_behav=logp_behav, adv=adv)
    keep = m2po_mask(lp.detach() - behav, mask, threshold=threshold)
    loss = torch.where(keep, -a * capped_exp(lp - prox), 0.0)
    return to_out(loss, logp, logp_prox, logp_behav, adv)


# --------------------------------------------------------------------------------------------
# DPPO: divergence masks instead of the ratio clip.


def dppo_mask(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    *,
    divergence: Divergence = "tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
) -> Tensor:
    r"""DPPO's token mask: drop a token whose probability moved too far in the advantage's direction.

    Qi et al. 2026 (DPPO, arXiv:2602.04879) replace PPO's ratio clip, a one-sample estimate of a
    divergence, by a divergence between the two Bernoulli distributions "this token / any other"
    under pi_old and pi_theta, with p = pi_theta(y_t), q = pi_old(y_t):

    - ``"tv"``: the binary total variation ``|p - q|``. Kept: ``p - q <= delta_high`` where
      ``A > 0``, ``p - q >= -delta_low`` where ``A <= 0``.
    - ``"kl"``: the binary KL ``q log(q / p) + (1 - q) log((1 - q) / (1 - p))``. Kept where it is
      ``<= delta_high`` (``A > 0``; ``delta_low`` for ``A <= 0``), or where the probability moved
      against the advantage (``p <= q`` for ``A > 0``, ``p >= q`` for ``A <= 0``): only the
      harmful direction is constrained.

    This is verl's ``dppo_tv`` / ``dppo_kl`` (whose ``clip_ratio_low/high`` are the deltas); the
    binary KL adds 1e-8 inside its second logarithm as verl does, so p = 1 stays finite.

    Args:
        logp, logp_old, adv: ``[B, T]`` (all read detached).
        divergence: ``"tv"`` or ``"kl"``.
        delta_low, delta_high: the thresholds, >= 0.

    Returns:
        ``[B, T]`` bool, True where the token is kept.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> p, q = torch.tensor([[0.7, 0.5]]), torch.tensor([[0.4, 0.4]])  # p - q: 0.3, 0.1; A > 0
        >>> offpolicy.dppo_mask(p.log(), q.log(), torch.ones(1, 2))  # delta 0.2
        tensor([[False,  True]])
    """
    if divergence not in ("tv", "kl"):
        raise ValueError(f"unknown DPPO divergence {divergence!r}; choose 'tv' or 'kl'")
    lo, hi = _nonneg("delta_low", delta_low), _nonneg("delta_high", delta_high)
    with torch.no_grad():
        lp, old, a = widened(logp.detach(), logp_old=logp_old, adv=adv)
        p, q = lp.exp(), old.exp()
        pos = a > 0
        if divergence == "tv":
            return torch.where(pos, p - q <= hi, p - q >= -lo)
        binary_kl = q * (old - lp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        return torch.where(pos, (binary_kl <= hi) | (p <= q), (binary_kl <= lo) | (p >= q))


def dppo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    *,
    divergence: Divergence = "tv",
    delta_low: float = 0.2,
    delta_high: float = 0.2,
    ratio_cap: float = 20.0,
) -> Tensor:
    r"""DPPO's loss: a truncated, detached importance weight on log pi, on the tokens the mask keeps.

        loss_t = -M_t · sg(min(r_t, C)) · A_t · log pi_theta(y_t),    r_t = pi_theta / pi_old

    with ``M = dppo_mask(...)`` (Qi et al. 2026, arXiv:2602.04879; verl's ``dppo_tv`` and
    ``dppo_kl``, ``clip_ratio_c`` = C = 20 by default). As for :func:`klpo.losses.cispo`, only the
    gradient means something: ``-M_t min(r_t, C) A_t`` with respect to ``logp``.

    Args:
        logp, logp_old, adv: ``[B, T]``.
        divergence, delta_low, delta_high: as :func:`dppo_mask`.
        ratio_cap: C > 0, the weight's truncation.

    Returns:
        ``[B, T]`` per-token loss, 0 where masked.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> p, q = torch.tensor([[0.7, 0.5]]), torch.tensor([[0.4, 0.4]])
        >>> offpolicy.dppo(p.log(), q.log(), torch.ones(1, 2))  # masked; -(0.5/0.4) · 1 · log 0.5
        tensor([[0.0000, 0.8664]])
    """
    if not ratio_cap > 0:
        raise ValueError(f"ratio_cap must be > 0, got {ratio_cap!r}")
    keep = dppo_mask(
        logp, logp_old, adv, divergence=divergence, delta_low=delta_low, delta_high=delta_high
    )
    lp, old, a = widened(logp, logp_old=logp_old, adv=adv)
    w = capped_exp(lp.detach() - old).clamp(max=ratio_cap)
    loss = torch.where(keep, -w * a * lp, 0.0)
    return to_out(loss, logp, logp_old, adv)


# --------------------------------------------------------------------------------------------
# Trust Region Masking: whole sequences.


def trm_mask(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    delta: float,
    statistic: TrmStatistic = "k3",
    aggregate: TrmAggregate = "max",
    token_kl: Tensor | None = None,
) -> Tensor:
    r"""Trust Region Masking: drop every token of a sequence whose divergence to the sampler is > delta.

    Li et al. 2025 (TRM, arXiv:2512.23075) show that the surrogate's error over long sequences is
    driven by the *largest* token-level KL(pi_behav ‖ pi_theta) along the sequence, which no
    per-token clip controls, and mask whole sequences that leave the trust region. Per token, with
    ``rho_t = pi_theta(y_t) / pi_behav(y_t)`` and y_t ~ pi_behav:

    - ``"k1"``: ``-log rho_t`` (Schulman's k1 of KL(pi_behav ‖ pi_theta));
    - ``"k3"``: ``rho_t - 1 - log rho_t`` (k3 of the same KL, ≥ 0);
    - ``token_kl`` given: the exact KL(pi_behav ‖ pi_theta) at each position, ``[B, T]`` (from the
      logits, :func:`klpo.logprobs.exact_kl`), in place of the sampled statistic.

    The sequence statistic is the ``"max"`` over its tokens (the paper's D_tok,max; the exact
    criterion when ``token_kl`` is given) or the ``"mean"`` (verl's ``seq_mean_k1`` / ``seq_mean_k3``
    presets; for k1 the absolute value of the mean, the geometric mean ratio's distance from 1).
    A sequence is kept when the statistic is ``<= delta``. A sequence with no valid token is kept
    (it has nothing to drop).

    Args:
        logp: ``[B, T]`` log pi_theta (detached here). logp_behav: ``[B, T]`` log pi_behav.
        mask: ``[B, T]`` bool, valid tokens.
        delta: the trust region's radius, >= 0.
        statistic: ``"k1"`` or ``"k3"`` (ignored when ``token_kl`` is given).
        aggregate: ``"max"`` or ``"mean"``.
        token_kl: optional ``[B, T]`` exact per-position KL(pi_behav ‖ pi_theta).

    Returns:
        ``[B, T]`` bool: ``mask`` where the sequence is kept, False elsewhere.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> logp = torch.tensor([[0.1, 0.0], [-0.5, 0.0]])  # log rho; the sampler's log-probs 0
        >>> offpolicy.trm_mask(logp, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool),
        ...                    delta=0.01)  # largest k3: e^0.1 - 1.1 = 0.005; e^-0.5 - 0.5 = 0.107
        tensor([[ True,  True],
                [False, False]])
    """
    if statistic not in ("k1", "k3"):
        raise ValueError(f"unknown TRM statistic {statistic!r}; choose 'k1' or 'k3'")
    if aggregate not in ("max", "mean"):
        raise ValueError(f"unknown TRM aggregate {aggregate!r}; choose 'max' or 'mean'")
    radius = _nonneg("delta", delta)
    with torch.no_grad():
        lp, behav = widened(logp.detach(), logp_behav=logp_behav)
        check_mask(mask, lp.shape)
        log_rho = lp - behav
        if token_kl is not None:
            (per_tok,) = widened(token_kl.detach())[:1]
            check_same_shape("token_kl", per_tok, hint="[B, T] per position", logp=lp)
        elif statistic == "k1":
            per_tok = -log_rho
        else:
            per_tok = torch.expm1(log_rho.clamp(max=700.0)) - log_rho
        count = mask.sum(-1)
        if aggregate == "max":
            big = torch.finfo(per_tok.dtype).max
            stat = torch.where(mask, per_tok.abs() if statistic == "k1" else per_tok, -big)
            stat = stat.amax(-1)
        else:
            total = torch.where(mask, per_tok, 0.0).sum(-1)
            stat = total / count.clamp(min=1)
            if statistic == "k1" and token_kl is None:
                stat = stat.abs()
        keep_seq = (stat <= radius) | (count == 0)
    return mask & keep_seq[:, None]


# --------------------------------------------------------------------------------------------
# The k2 penalty toward the sampler.


def sampler_k2(logp: Tensor, logp_behav: Tensor, *, coef: float = 1e-3) -> Tensor:
    r"""A k2 penalty toward the sampler: ``coef · (log pi_theta(y_t) - log pi_behav(y_t))²``.

    prime-rl's default RL loss adds ``kl_tau · (log pi_trainer - log pi_inference)²`` per token
    (``kl_tau`` 1e-3) to a DPPO-masked policy gradient, after Kimi K2.5 (arXiv:2602.02276), with no
    reference model at all: in klpo's terms ``2 · coef · k2`` of KL(pi_theta ‖ pi_behav). Its
    gradient, ``2 · coef · d_t · grad logp`` with ``d_t = logp - logp_behav``, has expectation over
    y ~ pi_theta ``2 · coef · grad KL(pi_theta ‖ pi_behav)`` per token; over y ~ pi_behav it is
    ``2 · coef · sum_y pi_behav(y) d(y) grad log pi_theta(y)``, which vanishes at pi_theta =
    pi_behav like the KL's gradient and differs from it elsewhere (a pull toward the sampler, not
    toward pi_ref).

    Args:
        logp: ``[B, T]`` (carries the gradient). logp_behav: ``[B, T]`` (detached).
        coef: the coefficient (prime-rl's kl_tau), >= 0.

    Returns:
        ``[B, T]`` per-token loss, ≥ 0.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> offpolicy.sampler_k2(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -2.0]]))
        tensor([[0.0003, 0.0000]])

    (1e-3 · 0.5² = 2.5e-4; zero where the two agree.)
    """
    c = _nonneg("coef", coef)
    lp, behav = widened(logp, logp_behav=logp_behav)
    d = lp - behav
    return to_out(c * d * d, logp, logp_behav)
