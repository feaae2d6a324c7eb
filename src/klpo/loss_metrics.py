"""The metrics of the policy, value and KL terms (:mod:`klpo.losses` names them too).

Computed under ``torch.no_grad`` as token means over the loss's mask and returned as plain floats
with namespaced keys (docs/metrics.md); with no valid token every metric is 0.0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klpo import kl
from klpo._ratios import check_per_token, kl_to_old, log_ratio
from klpo._tensor import capped_exp, check_mask, host_floats
from klpo.reduce import masked_mean

__all__ = ["kl_metrics", "policy_metrics", "value_metrics"]


def _masked_extreme(x: Tensor, mask: Tensor, largest: bool) -> Tensor:
    fill = -torch.inf if largest else torch.inf
    v = torch.where(mask, x, fill)
    ext = v.max() if largest else v.min()
    return torch.where(mask.any(), ext, 0.0)


def policy_metrics(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> dict[str, float]:
    r"""Diagnostics of the PPO update, token means over ``mask``, under ``no_grad``.

    Keys:

    - ``clip_frac``: tokens where a clip binds (``clip_frac/low + clip_frac/high``; verl's
      ``pg_clipfrac``);
    - ``clip_frac/high``: ``A > 0`` and ``ratio > 1 + clip_high``;
    - ``clip_frac/low``: ``A < 0`` and ``ratio < 1 - clip_low``;
    - ``clip_frac/dual``: ``A < 0`` and ``ratio > dual_clip`` (0 without a dual clip; verl's
      ``pg_clipfrac_lower``);
    - ``kl/old/k1``: mean of ``logp_old - logp``, k1 of KL(pi_old ‖ pi_theta) (verl's ``ppo_kl``);
    - ``kl/old/k3``: mean of ``(r - 1) - log r``, k3 of the same KL (≥ 0, lower variance);
    - ``ratio/mean``, ``ratio/max``, ``ratio/min``: of ``r = pi_theta / pi_old``.

    Args:
        logp, logp_old, adv, mask: ``[B, T]``.
        clip_low, clip_high, dual_clip: as :func:`ppo_clip`.

    Returns:
        a dict of floats.

    Example:
        >>> import math, torch
        >>> from klpo import losses
        >>> logp = torch.tensor([[math.log(2.0), 0.0]])  # ratios 2 (clipped, A > 0) and 1
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> m = losses.policy_metrics(logp, torch.zeros(1, 2), torch.ones(1, 2), mask)
        >>> keys = ("clip_frac/high", "kl/old/k1", "ratio/mean")
        >>> {k: round(m[k], 4) for k in keys}
        {'clip_frac/high': 0.5, 'kl/old/k1': -0.3466, 'ratio/mean': 1.5}
    """
    check_mask(mask, logp.shape)
    with torch.no_grad():
        u = log_ratio(logp, logp_old)
        check_per_token(logp, adv=adv)
        a = adv.detach().to(u.dtype)
        ratio = capped_exp(u)
        high = (a > 0) & (ratio > 1.0 + clip_high)
        low = (a < 0) & (ratio < 1.0 - clip_low)
        dual = (a < 0) & (ratio > dual_clip) if dual_clip is not None else torch.zeros_like(mask)
        values = {
            "clip_frac": masked_mean((high | low).double(), mask),
            "clip_frac/high": masked_mean(high.double(), mask),
            "clip_frac/low": masked_mean(low.double(), mask),
            "clip_frac/dual": masked_mean(dual.double(), mask),
            "kl/old/k1": masked_mean(kl_to_old(u, "k1"), mask),
            "kl/old/k3": masked_mean(kl_to_old(u, "k3"), mask),
            "ratio/mean": masked_mean(ratio, mask),
            "ratio/max": _masked_extreme(ratio, mask, largest=True),
            "ratio/min": _masked_extreme(ratio, mask, largest=False),
        }
    return host_floats(values)


def value_metrics(
    values: Tensor,
    values_old: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = None,
) -> dict[str, float]:
    r"""Diagnostics of the critic, token means over ``mask``, under ``no_grad``.

    Keys:

    - ``value/clip_frac``: tokens where the clipped term is strictly the larger (verl's
      ``vf_clipfrac``; 0 without a clip);
    - ``value/explained_var``: ``1 - Var(R - V) / Var(R)`` over the valid tokens (1 is a perfect
      critic, 0 no better than a constant; 0.0 when Var(R) = 0);
    - ``value/mean``: mean of V; ``value/mse``: mean of (V - R)².

    Args:
        values, values_old, returns, mask: ``[B, T]``.
        clip: as :func:`value_loss`.

    Returns:
        a dict of floats.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> v, r = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 3.0]])
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> losses.value_metrics(v, v, r, mask)  # explained: 1 - Var(R - V) / Var(R) = 1 - 1/4
        {'value/clip_frac': 0.0, 'value/explained_var': 0.75, 'value/mean': 1.5, 'value/mse': 0.5}
    """
    check_mask(mask, values.shape)
    with torch.no_grad():
        check_per_token(values, values_old=values_old, returns=returns)
        v, v_old, ret = (t.detach().to(torch.float64) for t in (values, values_old, returns))
        err = (v - ret) ** 2
        if clip is not None:
            clipped = (torch.clamp(v, v_old - clip, v_old + clip) - ret) ** 2
            clip_frac = masked_mean((clipped > err).double(), mask)
        else:
            clip_frac = torch.zeros((), dtype=torch.float64)
        var_r = masked_mean((ret - masked_mean(ret, mask)) ** 2, mask)
        resid = ret - v
        var_resid = masked_mean((resid - masked_mean(resid, mask)) ** 2, mask)
        explained = torch.where(
            var_r > 0, 1.0 - var_resid / torch.where(var_r > 0, var_r, 1.0), 0.0
        )
        out = {
            "value/clip_frac": clip_frac,
            "value/explained_var": explained,
            "value/mean": masked_mean(v, mask),
            "value/mse": masked_mean(err, mask),
        }
    return host_floats(out)


def kl_metrics(
    logp: Tensor | None,
    logp_ref: Tensor | None,
    mask: Tensor,
    *,
    estimators: tuple[str, ...] = ("k1", "k3"),
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
) -> dict[str, float]:
    r"""Token-mean estimates of KL(pi_theta ‖ pi_ref), one key ``kl/ref/<name>`` per estimator.

    On-policy tokens (the rollout) make ``kl/ref/k1`` and ``kl/ref/k3`` unbiased estimates of the
    per-token KL; ``kl/ref/full`` (pass ``logits``, ``logits_ref``) is exact at each position.

    Args:
        logp, logp_ref, mask: ``[B, T]``.
        estimators: names from :data:`klpo.kl.ESTIMATORS` (``k3_is`` is evaluated with w = 1).
        logits, logits_ref: ``[B, T, V]``, for ``full``.

    Returns:
        a dict of floats.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> m = losses.kl_metrics(logp, logp_ref, torch.ones(1, 2, dtype=torch.bool))
        >>> {k: round(v, 4) for k, v in m.items()}  # means of d (0.5, -1), of k3 (0.1065, 0.7183)
        {'kl/ref/k1': -0.25, 'kl/ref/k3': 0.4124}
    """
    with torch.no_grad():
        out = {}
        for name in estimators:
            est = kl.estimate(
                name,
                logp,
                logp_ref,
                logp_old=logp,
                logits=logits,
                logits_ref=logits_ref,
                mask=mask,
            )
            check_mask(mask, est.shape)
            out[f"kl/ref/{name}"] = masked_mean(est, mask)
    return host_floats(out)
