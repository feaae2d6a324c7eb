r"""The gap between an inference engine's sampling policy and the trainer's, and its correction.

An inference engine (vLLM, SGLang) samples the rollout with kernels, precision and batching of its
own, so even at the same weights its token probabilities mu(y_t) differ from those the trainer
computes, pi_old(y_t). The tokens are then drawn from mu, not from pi_old, and every "on-policy"
update is slightly off-policy (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"). Inputs, per sampled token ``y_t ~ mu``:

- ``logp_old``: ``[B, T]`` log pi_old(y_t), the trainer's own log-probs at the weights that
  sampled the batch (detached here);
- ``logp_engine``: ``[B, T]`` log mu(y_t), as the engine reported them (detached here).

With ``d_t = logp_engine - logp_old = log mu(y_t) - log pi_old(y_t)`` and ``rho_t = pi_old(y_t) /
mu(y_t) = exp(-d_t)``:

- the **gap** is measured as KL(mu ‖ pi_old) per token, by Schulman's k1 = d and k3 = rho - 1 -
  log rho (both unbiased over y ~ mu; k3 ≥ 0), see :func:`mismatch_metrics`;
- the **correction** is truncated importance sampling (TIS; Yao et al. 2025, after Ionides 2008):
  the policy loss of each token is weighted by ``sg(min(rho_t, C))`` (:func:`tis_policy_loss`).
  With ``C = inf`` this is plain importance sampling and the expected gradient over y ~ mu is
  exactly that over y ~ pi_old; the cap bounds the weight's variance at the price of a bias on the
  tokens the engine over-samples by more than ``C``.

Only the policy-gradient term is corrected. A KL term's own off-policy correction (see
:func:`klpo.losses.kl_loss`) is computed from the trainer's ``logp_old``, never from
``logp_engine``: the engine's log-probs enter nothing but this weight and these metrics.

All arithmetic is in float64 (float32 on Apple's MPS); weights are returned detached.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klpo.reduce import masked_mean

__all__ = ["mismatch_metrics", "tis_policy_loss", "tis_weight"]


def _wide(x: Tensor) -> torch.dtype:
    return torch.float32 if x.device.type == "mps" else torch.float64


def _gap(logp_old: Tensor, logp_engine: Tensor) -> Tensor:
    """d = log mu - log pi_old in the wide dtype, detached, after checking the inputs."""
    for name, t in (("logp_old", logp_old), ("logp_engine", logp_engine)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            raise TypeError(f"{name} must be a float tensor [B, T], got {getattr(t, 'dtype', t)}")
    if logp_old.shape != logp_engine.shape:
        raise ValueError(
            f"logp_engine has shape {tuple(logp_engine.shape)} but logp_old has "
            f"{tuple(logp_old.shape)}; both must be [B, T] over the same sampled tokens"
        )
    wide = _wide(logp_old)
    return logp_engine.detach().to(wide) - logp_old.detach().to(wide)


def _check_cap(cap: float | None) -> float:
    if cap is None:
        return math.inf
    if not cap > 0:
        raise ValueError(f"the TIS cap C must be > 0 (or None for no truncation), got {cap!r}")
    return float(cap)


def tis_weight(logp_old: Tensor, logp_engine: Tensor, *, cap: float | None) -> Tensor:
    r"""Truncated importance weight of each token sampled by the engine (Yao et al. 2025).

        w_t = min(pi_old(y_t) / mu(y_t), C) = min(exp(logp_old - logp_engine), C)

    with the exponent capped at 700 (85 in float32) so that no ratio overflows; ``cap = None``
    means ``C = inf`` (untruncated importance sampling).

    Gradient: none; both inputs are detached and so is the result.

    Args:
        logp_old: ``[B, T]`` log pi_old of the sampled tokens (the trainer's).
        logp_engine: ``[B, T]`` log mu of the same tokens (the engine's).
        cap: ``C > 0``, or None.

    Returns:
        ``[B, T]`` weights in ``(0, C]``, float64 (float32 on MPS).
    """
    c = _check_cap(cap)
    log_rho = -_gap(logp_old, logp_engine)
    finite = 700.0 if log_rho.dtype == torch.float64 else 85.0
    return torch.exp(log_rho.clamp(max=finite)).clamp(max=c)


def tis_policy_loss(
    loss: Tensor, logp_old: Tensor, logp_engine: Tensor, *, cap: float | None
) -> Tensor:
    r"""A per-token policy loss corrected for tokens sampled by an engine: ``sg(w_t) · loss_t``.

    ``loss`` is any per-token policy surrogate computed against the trainer's ``logp_old`` (e.g.
    :func:`klpo.losses.ppo_clip`, whose ratio is ``pi_theta / pi_old``), and ``w_t`` is
    :func:`tis_weight`. This is the TIS-corrected gradient of Yao et al. 2025:

        grad = E_{y ~ mu}[ min(pi_old(y) / mu(y), C) · grad loss(y) ]

    which, for ``C = inf``, equals ``E_{y ~ pi_old}[grad loss(y)]`` because
    ``sum_y mu(y) (pi_old(y) / mu(y)) g(y) = sum_y pi_old(y) g(y)`` (proved by enumeration in
    the tests). Masked tokens stay whatever ``loss`` holds there (the reduction drops them).

    Gradient with respect to ``loss``: ``w_t``; none flows into ``logp_old`` or ``logp_engine``.

    Args:
        loss: ``[B, T]`` per-token policy loss (carries the gradient).
        logp_old, logp_engine: ``[B, T]``, as :func:`tis_weight`.
        cap: ``C > 0``, or None for untruncated importance sampling.

    Returns:
        ``[B, T]``, in ``loss``'s dtype.
    """
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        raise TypeError(f"loss must be a float tensor [B, T], got {getattr(loss, 'dtype', loss)}")
    if loss.shape != logp_old.shape:
        raise ValueError(
            f"loss has shape {tuple(loss.shape)} but logp_old has {tuple(logp_old.shape)}; the "
            "weight is per token, so both must be [B, T] over the same tokens"
        )
    w = tis_weight(logp_old, logp_engine, cap=cap)
    return (loss.to(w.dtype) * w).to(loss.dtype)


def mismatch_metrics(
    logp_old: Tensor, logp_engine: Tensor, mask: Tensor, *, cap: float | None = None
) -> dict[str, float]:
    r"""The engine/trainer gap over the rollout's tokens, under ``no_grad``; keys ``engine/...``.

    With ``d = log mu - log pi_old`` and ``rho = exp(-d)`` on the tokens where ``mask`` is True:

    - ``engine/k1``: mean of ``d``, k1 of KL(mu ‖ pi_old) (unbiased over y ~ mu, can be < 0);
    - ``engine/k3``: mean of ``rho - 1 - log rho = expm1(-d) + d``, k3 of the same KL (≥ 0);
    - ``engine/k3_max``: the largest per-token k3;
    - ``engine/abs_max``: the largest ``|d|``, the worst token's log-prob gap;
    - ``engine/tis_weight``: mean of :func:`tis_weight` (1 when the two agree);
    - ``engine/tis_clip_frac``: fraction of tokens whose ratio ``rho`` exceeds the cap (0 without
      one).

    Means over no valid token are 0, and so are maxima.

    Args:
        logp_old, logp_engine: ``[B, T]``.
        mask: ``[B, T]`` bool, True where the token takes part.
        cap: the TIS cap ``C``, or None.

    Returns:
        a dict of floats.
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError("mask must be a bool tensor (True = the token takes part)")
    with torch.no_grad():
        d = _gap(logp_old, logp_engine)
        if mask.shape != d.shape:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(d.shape)}")
        c = _check_cap(cap)
        k3 = torch.expm1(-d.clamp(min=-700.0)) + d
        w = tis_weight(logp_old, logp_engine, cap=cap)
        any_tok = mask.any()

        def biggest(x: Tensor) -> Tensor:
            return torch.where(any_tok, torch.where(mask, x, -torch.inf).max(), 0.0)

        values = {
            "engine/k1": masked_mean(d, mask),
            "engine/k3": masked_mean(k3, mask),
            "engine/k3_max": biggest(k3),
            "engine/abs_max": biggest(d.abs()),
            "engine/tis_weight": masked_mean(w, mask),
            "engine/tis_clip_frac": masked_mean((-d > math.log(c)).to(d.dtype), mask)
            if math.isfinite(c)
            else torch.zeros((), dtype=d.dtype),
        }
        stacked = torch.stack([v.to(torch.float64).reshape(()) for v in values.values()])
    return dict(zip(values, stacked.cpu().tolist(), strict=True))
