"""What the policy surrogates, their metrics and the off-policy losses share: per-token inputs
checked and widened, the log-ratio to pi_old, and the per-token KL(pi_old ‖ pi_theta)."""

from __future__ import annotations

import torch
from torch import Tensor

from klpo._tensor import capped, check_float, check_same_shape, wide_dtype

__all__ = ["check_per_token", "kl_to_old", "log_ratio", "widened"]


def check_per_token(ref: Tensor, **tensors: Tensor) -> None:
    """Every tensor is a float tensor of ``ref``'s shape."""
    check_same_shape(
        "logp/values", ref, hint="per-token [B, T] inputs over the same tokens", **tensors
    )


def log_ratio(logp: Tensor, logp_old: Tensor) -> Tensor:
    """u = logp - sg(logp_old), in the wide dtype; the gradient flows into logp only."""
    check_float("logp", logp)
    check_per_token(logp, logp_old=logp_old)
    wide = wide_dtype(logp)
    return logp.to(wide) - logp_old.detach().to(wide)


def kl_to_old(u: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi_old ‖ pi_theta) from y ~ pi_old, u = logp - logp_old."""
    if estimator == "k1":
        return -u
    if estimator == "k3":
        # (r - 1) - log r with r = pi_theta / pi_old = exp(u); expm1 keeps it accurate near u = 0.
        return torch.expm1(capped(u)) - u
    raise ValueError(f"estimator must be 'k1' or 'k3', got {estimator!r}")


def widened(logp: Tensor, **others: Tensor) -> tuple[Tensor, ...]:
    """``logp`` and ``others`` (detached) in the wide dtype, after checking shapes."""
    check_float("logp", logp)
    for name, t in others.items():
        check_float(name, t)
    check_same_shape("logp", logp, hint="per-token [B, T] inputs over the same tokens", **others)
    wide = wide_dtype(logp)
    return (logp.to(wide), *(t.detach().to(wide) for t in others.values()))
