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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from klpo._tensor import (
    capped_exp,
    check_float,
    check_mask,
    check_same_shape,
    to_out,
    wide_dtype,
)
from klpo.logprobs import exact_kl

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


def _wide(logp: Tensor, **others: Tensor) -> tuple[Tensor, ...]:
    """``logp`` and ``others`` (detached) in the wide dtype, after checking shapes."""
    check_float("logp", logp)
    for name, t in others.items():
        check_float(name, t)
    check_same_shape("logp", logp, hint="per-token [B, T] inputs over the same tokens", **others)
    wide = wide_dtype(logp)
    return (logp.to(wide), *(t.detach().to(wide) for t in others.values()))


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
    lp, prox, behav, a = _wide(logp, logp_prox=logp_prox, logp_behav=logp_behav, adv=adv)
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
    lp, prox, behav, a = _wide(logp, logp_prox=logp_prox, logp_behav=logp_behav, adv=adv)
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
        lp, old, a = _wide(logp.detach(), logp_old=logp_old, adv=adv)
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
    lp, old, a = _wide(logp, logp_old=logp_old, adv=adv)
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
        lp, behav = _wide(logp.detach(), logp_behav=logp_behav)
        check_mask(mask, lp.shape)
        log_rho = lp - behav
        if token_kl is not None:
            (per_tok,) = _wide(token_kl.detach())[:1]
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
    lp, behav = _wide(logp, logp_behav=logp_behav)
    d = lp - behav
    return to_out(c * d * d, logp, logp_behav)


# --------------------------------------------------------------------------------------------
# Trust-region diagnostics: how far the trainer is from the sampler.


def effective_sample_size(log_w: Tensor, mask: Tensor) -> Tensor:
    r"""Kish's effective sample size of importance weights, as a fraction of the sample size.

        ESS / n = (sum_i w_i)² / (n · sum_i w_i²),    w_i = exp(log_w_i),  over the i where ``mask``

    1 when every weight is equal (on-policy), ``1/n`` when one weight carries everything. Huang
    et al. (VCPO, arXiv:2602.17616) find its drops predict collapse under asynchrony. Computed
    from ``log_w - max(log_w)`` so no weight overflows. Returns 1 for an empty sample.

    Args:
        log_w: ``[...]`` log importance weights (e.g. log pi_theta - log pi_behav per token, or
            their sum per sequence), read detached.
        mask: bool of the same shape.

    Returns:
        a 0-d tensor in (0, 1], float64 (float32 on MPS).

    Example:
        >>> import math, torch
        >>> from klpo import offpolicy
        >>> w = torch.tensor([0.0, 0.0, math.log(4.0)])  # weights 1, 1, 4: 6² / (3 · 18)
        >>> offpolicy.effective_sample_size(w, torch.ones(3, dtype=torch.bool))
        tensor(0.6667, dtype=torch.float64)
    """
    check_float("log_w", log_w)
    check_mask(mask, log_w.shape)
    with torch.no_grad():
        x = log_w.detach().to(wide_dtype(log_w))[mask]
        if x.numel() == 0:
            return torch.ones((), dtype=x.dtype, device=x.device)
        w = torch.exp(x - x.max())
        return w.sum().square() / (x.numel() * w.square().sum())


def trust_region_metrics(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    keep: Tensor | None = None,
    logits: Tensor | None = None,
    logits_behav: Tensor | None = None,
    temperature: float = 1.0,
) -> dict[str, float]:
    r"""How far the trained policy is from the sampler, over the batch's tokens; keys ``sampler/...``.

    With ``log w_t = log pi_theta(y_t) - log pi_behav(y_t)`` on the tokens where ``mask``
    (y_t ~ pi_behav), under ``no_grad``:

    - ``sampler/ess``, ``sampler/ess_seq``: :func:`effective_sample_size` of the token weights
      and of the sequence weights ``prod_t w_t`` (VCPO's collapse predictor);
    - ``sampler/m2``: the mean of ``(log w)²``, M2PO's second moment;
    - ``sampler/kl_k1``, ``sampler/kl_k3``: k1 ``-log w`` and k3 ``w - 1 - log w``, unbiased
      estimates of KL(pi_behav ‖ pi_theta) per token; ``sampler/kl_k3_max``: the largest k3
      (TRM's D_tok,max, sampled);
    - ``sampler/tv``: ``|w - 1| / 2``, an unbiased estimate of the total variation per position
      (``TV = (1/2) E_behav |w - 1|``); ``sampler/tv_binary_max``: the largest binary TV
      ``|pi_theta(y_t) - pi_behav(y_t)|`` (DPPO's statistic);
    - ``sampler/clip_frac``: the share of tokens whose ``w`` is outside ``[1 - clip_low, 1 +
      clip_high]`` (where a ratio clip to the sampler would bind);
    - ``sampler/masked_frac``: with ``keep`` (a mask from :func:`m2po_mask`, :func:`dppo_mask`
      or :func:`trm_mask`), the share of valid tokens it drops;
    - with ``logits`` and ``logits_behav`` (``[B, T, V]``, both models' logits at the positions),
      the exact values: ``sampler/kl_exact`` and ``sampler/kl_exact_max``, KL(pi_behav ‖ pi_theta)
      summed over the vocabulary (:func:`klpo.logprobs.exact_kl`, chunked), and
      ``sampler/tv_exact``, ``sampler/tv_exact_max``, ``(1/2) sum_v |pi_theta(v) - pi_behav(v)|``
      (this one holds one ``[B, T, V]`` float32 copy of each model's probabilities, float64 for
      float64 logits).

    Means over no valid token are 0, and so are maxima; the two ESS are then 1.

    Args:
        logp, logp_behav: ``[B, T]`` log-probs of the sampled tokens.
        mask: ``[B, T]`` bool.
        clip_low, clip_high: the clip range of ``sampler/clip_frac``.
        keep: optional ``[B, T]`` bool mask of the tokens a loss keeps.
        logits, logits_behav: optional ``[B, T, V]``; temperature: their sampling temperature.

    Returns:
        a dict of floats.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp = torch.tensor([[-1.0, -2.0]])  # the trainer and the sampler agree
        >>> m = offpolicy.trust_region_metrics(lp, lp, torch.ones(1, 2, dtype=torch.bool))
        >>> m["sampler/ess"], m["sampler/m2"], m["sampler/kl_k3"], m["sampler/tv"]
        (1.0, 0.0, 0.0, 0.0)
    """
    return finish_trust_region_stats(
        trust_region_stats(
            logp, logp_behav, mask, clip_low=clip_low, clip_high=clip_high, keep=keep,
            logits=logits, logits_behav=logits_behav, temperature=temperature,
        )
    )  # fmt: skip


# The sufficient statistics of trust_region_metrics, by how they pool over shares of a batch.
_SUMS = ("tokens", "seqs", "m2", "kl_k1", "kl_k3", "tv", "clip", "masked", "kl_exact", "tv_exact")
_MAXIMA = ("kl_k3_max", "tv_binary_max", "kl_exact_max", "tv_exact_max")
_ESS = (("ess", "tokens"), ("ess_seq", "seqs"))  # (prefix, its count): shift, w, w2


def trust_region_stats(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    keep: Tensor | None = None,
    logits: Tensor | None = None,
    logits_behav: Tensor | None = None,
    temperature: float = 1.0,
    token_kl: Tensor | None = None,
    token_tv: Tensor | None = None,
) -> dict[str, Tensor]:
    r"""The sufficient statistics of :func:`trust_region_metrics` on one share of a batch.

    ``trust_region_metrics(...)`` is ``finish_trust_region_stats(trust_region_stats(...))``, bit
    for bit. For a batch spread over processes (``torchrun``: each rank holds some rows), each
    share's statistics are merged by :func:`merge_trust_region_stats` (in any order of the
    shares, the same on every process) and then finished: the metrics of one process holding
    the whole batch, up to rounding. The statistics are 0-d float64 tensors (float32 on MPS):

    - sums over the valid tokens: their count ``tokens``, ``m2``, ``kl_k1``, ``kl_k3``, ``tv``,
      ``clip`` (the tokens outside the clip range), ``masked`` (with ``keep``), ``kl_exact`` and
      ``tv_exact`` (with the logits or ``token_kl`` / ``token_tv``); ``seqs``, the rows with a
      valid token;
    - maxima over the valid tokens (``-inf`` over none): ``kl_k3_max``, ``tv_binary_max``,
      ``kl_exact_max``, ``tv_exact_max``;
    - for Kish's ESS of the token and of the sequence weights, ``ess_shift`` (the largest log
      weight, ``-inf`` over none), ``ess_w`` = sum of ``exp(log w - shift)`` and ``ess_w2`` of
      its square (``ess_seq_*`` likewise over the rows' summed log weights): two shares merge by
      rescaling each to the larger shift, so no weight overflows.

    Args:
        as :func:`trust_region_metrics`, and ``token_kl``, ``token_tv``: optional ``[B, T]``
            exact KL(pi_behav ‖ pi_theta) and total variation per position, already computed
            (e.g. from hidden states in chunks), instead of the logits.

    Returns:
        a dict of 0-d tensors, the same keys for every share given the same options.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, behav = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.2, -1.9, -0.5]])
        >>> mask = torch.ones(1, 3, dtype=torch.bool)
        >>> whole = offpolicy.trust_region_metrics(lp, behav, mask)
        >>> parts = [offpolicy.trust_region_stats(lp[:, s], behav[:, s], mask[:, s])
        ...          for s in (slice(0, 1), slice(1, 3))]  # (a split of tokens, not of rows)
        >>> pooled = offpolicy.finish_trust_region_stats(offpolicy.merge_trust_region_stats(parts))
        >>> abs(pooled["sampler/ess"] - whole["sampler/ess"]) < 1e-15
        True
    """
    with torch.no_grad():
        lp, behav = _wide(logp.detach(), logp_behav=logp_behav)
        check_mask(mask, lp.shape)
        out = _sampled_stats(lp, behav, mask, clip_low=clip_low, clip_high=clip_high)
        if keep is not None:
            check_mask(keep, lp.shape)
            out["masked"] = _masked_total((~keep).to(lp.dtype), mask)
        exact = _exact_values(
            lp, logits, logits_behav, temperature, token_kl=token_kl, token_tv=token_tv
        )
        if exact is not None:
            kl, tv = exact
            out |= {
                "kl_exact": _masked_total(kl, mask),
                "kl_exact_max": _masked_max(kl, mask),
                "tv_exact": _masked_total(tv, mask),
                "tv_exact_max": _masked_max(tv, mask),
            }
    return out


def _masked_total(x: Tensor, mask: Tensor) -> Tensor:
    """The sum of ``x`` over ``mask``, a 0-d tensor."""
    return torch.where(mask, x, 0.0).sum()


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """The largest ``x`` over ``mask``, ``-inf`` over none."""
    if x.numel() == 0:
        return torch.full((), -torch.inf, dtype=x.dtype, device=x.device)
    return torch.where(mask, x, -torch.inf).max()


def _sampled_stats(
    lp: Tensor, behav: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> dict[str, Tensor]:
    """:func:`trust_region_stats` from the sampled tokens' log-probs alone (the counts, the ESS
    sums, M2, k1, k3, the TV estimate, the binary TV and the clip count)."""
    log_w = lp - behav
    w = capped_exp(log_w)
    rows = mask.any(-1)
    seq_log_w = torch.where(mask, log_w, 0.0).sum(-1)
    k3 = torch.expm1(log_w.clamp(max=700.0)) - log_w
    clipped = ((w < 1.0 - clip_low) | (w > 1.0 + clip_high)).to(lp.dtype)
    return {
        "tokens": mask.sum().to(lp.dtype),
        "seqs": rows.sum().to(lp.dtype),
        **_ess_stats("ess", log_w, mask),
        **_ess_stats("ess_seq", seq_log_w, rows),
        "m2": _masked_total(log_w.square(), mask),
        "kl_k1": _masked_total(-log_w, mask),
        "kl_k3": _masked_total(k3, mask),
        "kl_k3_max": _masked_max(k3, mask),
        "tv": _masked_total(0.5 * (w - 1).abs(), mask),
        "tv_binary_max": _masked_max((lp.exp() - behav.exp()).abs(), mask),
        "clip": _masked_total(clipped, mask),
    }


def _ess_stats(prefix: str, log_w: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``shift``, ``w``, ``w2`` of :func:`effective_sample_size`'s sums over ``mask``."""
    x = log_w[mask]
    if x.numel() == 0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return {f"{prefix}_shift": zero - torch.inf, f"{prefix}_w": zero, f"{prefix}_w2": zero}
    shift = x.max()
    w = torch.exp(x - shift)
    return {f"{prefix}_shift": shift, f"{prefix}_w": w.sum(), f"{prefix}_w2": w.square().sum()}


def _exact_values(
    lp: Tensor,
    logits: Tensor | None,
    logits_behav: Tensor | None,
    temperature: float,
    *,
    token_kl: Tensor | None,
    token_tv: Tensor | None,
) -> tuple[Tensor, Tensor] | None:
    """``[B, T]`` the exact KL(pi_behav ‖ pi_theta) and total variation in ``lp``'s dtype, from
    the two models' logits or as given, or None."""
    if (logits is None) != (logits_behav is None):
        raise ValueError(
            "give both logits= and logits_behav= ([B, T, V], the trainer's and the sampler's "
            "logits at the same positions) for the exact values, or neither"
        )
    if (token_kl is None) != (token_tv is None):
        raise ValueError(
            "give both token_kl= and token_tv= ([B, T], the exact KL and total variation per "
            "position) for the exact values, or neither"
        )
    if logits is not None and token_kl is not None:
        raise ValueError("give the exact values as logits= and logits_behav=, or as token_kl= "
                         "and token_tv=, not both")  # fmt: skip
    if token_kl is not None and token_tv is not None:
        for name, x in (("token_kl", token_kl), ("token_tv", token_tv)):
            check_float(name, x)
            check_same_shape(name, x, hint="[B, T] per position", logp=lp)
        return token_kl.detach().to(lp.dtype), token_tv.detach().to(lp.dtype)
    if logits is None or logits_behav is None:
        return None
    if logits.shape != logits_behav.shape or logits.shape[:-1] != lp.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and logits_behav {tuple(logits_behav.shape)} "
            f"must both be [B, T, V] with [B, T] = {tuple(lp.shape)}"
        )
    kl = exact_kl(logits_behav.detach(), logits.detach(), temperature=temperature)
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    p = torch.softmax(logits.detach().to(dt) / temperature, -1)
    q = torch.softmax(logits_behav.detach().to(dt) / temperature, -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return kl.to(lp.dtype), tv.to(lp.dtype)


def merge_trust_region_stats(parts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    r"""The statistics of the union of disjoint shares of a batch (:func:`trust_region_stats`).

    Sums add, maxima take the largest, and each ESS's sums are rescaled to the largest shift
    (``w · exp(shift_i - shift)``, its square's by the square), the shares in the order given.
    Every process merging the same list gets the same bits.

    Args:
        parts: one dict per share, all with the same keys.

    Returns:
        a dict of the same keys.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
        >>> one = offpolicy.trust_region_stats(lp, lp - 0.1, mask)
        >>> float(offpolicy.merge_trust_region_stats([one, one])["tokens"])
        4.0
    """
    if not parts:
        raise ValueError("merge_trust_region_stats needs at least one share's statistics")
    keys = list(parts[0])
    for i, part in enumerate(parts):
        if list(part) != keys:
            raise ValueError(
                f"share {i} has the statistics {sorted(part)}, share 0 {sorted(keys)}: every "
                "share must be computed with the same options (keep=, the exact values)"
            )
    with torch.no_grad():
        out: dict[str, Tensor] = {}
        for key in keys:
            column = torch.stack([p[key] for p in parts])
            if key in _SUMS:
                out[key] = column.sum()
            elif key in _MAXIMA:
                out[key] = column.max()
        for prefix, _ in _ESS:
            shifts = torch.stack([p[f"{prefix}_shift"] for p in parts])
            shift = shifts.max()
            # A share with no weight (shift -inf) adds 0; so does every share when none has one.
            scale = torch.where(shifts > -torch.inf, torch.exp(shifts - shift), 0.0)
            w = torch.stack([p[f"{prefix}_w"] for p in parts])
            w2 = torch.stack([p[f"{prefix}_w2"] for p in parts])
            out |= {
                f"{prefix}_shift": shift,
                f"{prefix}_w": (w * scale).sum(),
                f"{prefix}_w2": (w2 * scale.square()).sum(),
            }
    return {key: out[key] for key in keys}


def finish_trust_region_stats(stats: Mapping[str, Tensor]) -> dict[str, float]:
    r"""The metrics of :func:`trust_region_metrics` from its statistics (one share's, or several
    merged by :func:`merge_trust_region_stats`).

    Means are the sums over the token count (0 over no token), maxima 0 over no token, and
    Kish's ESS ``w² / (n · w2)`` (1 over no weight).

    Args:
        stats: the dict of :func:`trust_region_stats` or :func:`merge_trust_region_stats`.

    Returns:
        a dict of floats, the keys ``sampler/...``.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
        >>> stats = offpolicy.trust_region_stats(lp, lp, mask)  # the sampler agrees: ESS 1
        >>> offpolicy.finish_trust_region_stats(stats)["sampler/ess"]
        1.0
    """
    with torch.no_grad():
        n = stats["tokens"]

        def mean(key: str) -> Tensor:
            return torch.where(n > 0, stats[key] / n.clamp_min(1), 0.0)

        def biggest(key: str) -> Tensor:
            return torch.where(n > 0, stats[key], 0.0)

        def ess(prefix: str, count: Tensor) -> Tensor:
            w, w2 = stats[f"{prefix}_w"], stats[f"{prefix}_w2"]
            if not bool(count > 0):
                return torch.ones((), dtype=w.dtype, device=w.device)
            return w.square() / (count * w2)

        values: dict[str, Tensor] = {
            "sampler/ess": ess("ess", n),
            "sampler/ess_seq": ess("ess_seq", stats["seqs"]),
            "sampler/m2": mean("m2"),
            "sampler/kl_k1": mean("kl_k1"),
            "sampler/kl_k3": mean("kl_k3"),
            "sampler/kl_k3_max": biggest("kl_k3_max"),
            "sampler/tv": mean("tv"),
            "sampler/tv_binary_max": biggest("tv_binary_max"),
            "sampler/clip_frac": mean("clip"),
        }
        if "masked" in stats:
            values["sampler/masked_frac"] = mean("masked")
        if "kl_exact" in stats:
            values |= {
                "sampler/kl_exact": mean("kl_exact"),
                "sampler/kl_exact_max": biggest("kl_exact_max"),
                "sampler/tv_exact": mean("tv_exact"),
                "sampler/tv_exact_max": biggest("tv_exact_max"),
            }
        stacked = torch.stack([v.to(torch.float64).reshape(()) for v in values.values()])
    return dict(zip(values, stacked.cpu().tolist(), strict=True))
