r"""Per-token KL estimators, and an honest account of which gradient each one follows.

Every estimator here maps per-token log-probabilities of sampled tokens to a per-token estimate of a
KL divergence between the policy ``pi_theta`` and the reference ``pi_ref``:

    d = logp - logp_ref = log pi_theta(y_t | y_<t) - log pi_ref(y_t | y_<t),    y_t ~ pi_theta.

| name          | value                               | E[value] over y ~ pi_theta       | gradient of the value |
| ------------- | ----------------------------------- | -------------------------------- | --------------------- |
| ``k1``        | d                                   | KL(pi_theta ‖ pi_ref), unbiased  | grad logp             |
| ``k2``        | d² / 2                              | biased (≈ KL near d = 0)         | d · grad logp         |
| ``k3``        | exp(-d) + d - 1                     | KL(pi_theta ‖ pi_ref), unbiased  | (1 - exp(-d)) grad logp |
| ``abs``       | abs(d)                              | biased                           | sign(d) grad logp     |
| ``k1+`` ...   | value of the base estimator         | as the base estimator            | d · grad logp (k2's)  |
| ``k3_is``     | w · k3, w = exp(logp - logp_old)     | KL(pi_theta ‖ pi_ref) for y ~ pi_old | w · d · grad logp |
| ``low_var_kl``| verl's clamped k3                   | biased where the clamps bite     | zero where clamped    |
| ``kl_ref_theta`` | r log r - (r - 1), r = exp(-d)    | KL(pi_ref ‖ pi_theta), unbiased  | d · exp(-d) · grad logp |
| ``full``      | sum_v pi_theta(v) log(pi_theta(v) / pi_ref(v)) | exact, per position   | grad KL(pi_theta ‖ pi_ref) at the position |

References: J. Schulman, "Approximating KL Divergence" (2020) for k1, k2, k3 and the general
recipe f(r) - f'(1)(r - 1); DeepSeekMath (arXiv:2402.03300, eq. 4) for k3 in GRPO's loss; verl's
``kl_penalty`` for ``abs``, the ``+`` suffix and ``low_var_kl``; DeepSeek-V3.2 (arXiv:2512.02556,
eq. 7) and TRL's ``use_bias_correction_kl`` for ``k3_is``; Liu et al. (arXiv:2510.01555) and
Tang & Munos (arXiv:2506.09477) for the gradient analysis behind :func:`explain`.

The registry: each estimator's traits (what it needs — ``logp_old``, the logits, the reference's
own samples —, how :func:`klpo.losses.kl_loss` corrects it off-policy, what ``klpo doctor``
proposes in its place) are one row of :data:`SPECS`, a :class:`Spec`, which every layer of klpo
reads; :data:`ESTIMATORS`, :data:`REF_SAMPLED` and :data:`LOGPROB_ESTIMATORS` are views of it.
An estimator is added by its function and one :func:`register` call.

Shapes: ``logp``, ``logp_ref`` and ``logp_old`` are ``[B, T]`` (any shape works, as long as all
three agree); ``full`` takes logits ``[B, T, V]``. Inputs may be any float dtype; the arithmetic
is done in float64 (float32 on devices without float64) and the result is float32 (float64 when
an input is float64, so float64 oracles stay exact). ``full`` is the exception to the arithmetic:
it runs in float32 chunks over the vocabulary (:func:`klpo.logprobs.exact_kl`; float64 for
float64 logits), since a float64 copy of ``[B, T, V]`` logits would dwarf everything else. Masking is the
caller's job and must use ``torch.where`` (as :mod:`klpo.reduce` does), not multiplication: an
estimate may be ``+inf`` where the true value exceeds the float32 range, and ``inf * 0`` is NaN.
:func:`estimate` refuses non-finite log-probs (NaN, or a ``-inf`` from a reference that forbids a
sampled token), naming the argument and the count; give it the ``mask`` and padding positions may
hold anything. The per-estimator functions do not check.

Range: for float32 inputs, values and gradients are finite for ``|d| <= 80`` (``exp(80)`` ≈ 5.5e34).
Beyond about ``d < -88.7`` the values of ``k3``, ``k3+``, ``k3_is`` and ``kl_ref_theta`` exceed the
float32 range and are returned as ``+inf``, with gradients of ``±inf``; never NaN for finite
inputs, and exactly zero gradient where the upstream gradient is zero (a masked token). The
arguments of ``exp`` are capped at ±700 in the value only (exp(700) ≈ 1e304, finite in float64), so
that no product inside an estimator can become ``0 · inf``; with float64 inputs this caps values
at about 1e304 instead of overflowing. ``k1``, ``k2``, ``abs`` and their ``+`` variants stay finite
for every finite input, and so does ``low_var_kl`` (it clamps).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from klpo._names import LiveNames
from klpo._tensor import (
    capped,
    check_float,
    check_mask,
    check_same_shape,
    to_out,
    wide_dtype,
)
from klpo._tensor import check_finite as _check_finite
from klpo.logprobs import exact_kl

__all__ = [
    "ESTIMATORS",
    "GRADIENTS",
    "LOGPROB_ESTIMATORS",
    "PLACEMENTS",
    "REF_SAMPLED",
    "REF_THETA",
    "SPECS",
    "THETA_REF",
    "Explanation",
    "OffPolicy",
    "Placement",
    "Spec",
    "abs_",
    "abs_plus",
    "estimate",
    "explain",
    "explain_all",
    "full",
    "function",
    "in_loss",
    "in_reward",
    "k1",
    "k1_plus",
    "k2",
    "k2_plus",
    "k3",
    "k3_is",
    "k3_plus",
    "kl_ref_theta",
    "low_var_kl",
    "refusal",
    "register",
]

THETA_REF = "KL(pi_theta ‖ pi_ref)"
REF_THETA = "KL(pi_ref ‖ pi_theta)"

# The four answers `explain` can give for "which expected gradient does the term follow".
GRAD_THETA_REF = "grad KL(pi_theta ‖ pi_ref)"
GRAD_REF_THETA = "grad KL(pi_ref ‖ pi_theta)"
GRAD_ZERO = "zero"
GRAD_OTHER = "other (biased)"
GRADIENTS: tuple[str, ...] = (GRAD_THETA_REF, GRAD_REF_THETA, GRAD_ZERO, GRAD_OTHER)

Placement = Literal["loss", "reward", "reward+loss", "none"]
"""Where a KL term goes: nowhere (``"none"``: the KL is only measured), the reward, the loss, or
both. One type for the library, the trainer's config and :func:`explain`."""
PLACEMENTS: tuple[Placement, ...] = ("reward", "loss", "reward+loss")
"""The placements that put a KL somewhere: what :func:`explain` answers for."""


def in_reward(placement: Placement) -> bool:
    """Whether ``placement`` puts a detached KL penalty in the reward (``reward``, ``reward+loss``).

    Example:
        >>> in_reward("reward+loss"), in_reward("loss")
        (True, False)
    """
    return _placement(placement) in ("reward", "reward+loss")


def in_loss(placement: Placement) -> bool:
    """Whether ``placement`` differentiates a KL term in the loss (``loss``, ``reward+loss``).

    Example:
        >>> in_loss("reward+loss"), in_loss("reward")
        (True, False)
    """
    return _placement(placement) in ("loss", "reward+loss")


def _placement(placement: str) -> str:
    if placement not in ("none", *PLACEMENTS):
        raise ValueError(
            f"unknown placement {placement!r}; choose one of: none, {', '.join(PLACEMENTS)}"
        )
    return placement


# --------------------------------------------------------------------------------------------
# Precision helpers (the shared ones live in klpo._tensor).


def _log_ratio(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """d = logp - logp_ref, upcast before the subtraction."""
    _check_pair(logp, logp_ref, "logp_ref")
    wide = wide_dtype(logp)
    return logp.to(wide) - logp_ref.to(wide)


def _check_pair(logp: Tensor, other: Tensor, other_name: str) -> None:
    for name, t in (("logp", logp), (other_name, other)):
        check_float(name, t, "a float tensor of log-probabilities")
    check_same_shape(
        other_name, other, hint="the per-token [B, T] log-probs of the same tokens", logp=logp
    )


def _k2_straight_through(d: Tensor, value: Tensor) -> Tensor:
    """`value` in the forward pass, the gradient of k2 = d²/2 in the backward pass."""
    k2_ = 0.5 * d * d
    return value.detach() + (k2_ - k2_.detach())


def _k3_wide(d: Tensor) -> Tensor:
    """exp(-d) + d - 1 = expm1(-d) + d, accurate near d = 0, never negative, NaN-free."""
    return _nonneg(torch.expm1(-capped(d)) + d)


def _with_gradient(value: Tensor, pairs: tuple[tuple[Tensor, Tensor], ...]) -> Tensor:
    """`value`, whose gradient with respect to each wide input ``x`` is the analytic ``coef``.

    Used where autograd's product rule would cancel catastrophically (w · k3 at large |d|
    subtracts two numbers of size exp(|d|) to get one of size |d|). Coefficients are kept finite
    so that ``coef * 0`` is never NaN; they overflow to ±inf only when cast to float32.
    """
    out = value.detach()
    big = torch.finfo(value.dtype).max
    for coef, x in pairs:
        if x.requires_grad:
            out = out + torch.nan_to_num(coef.detach(), posinf=big, neginf=-big) * (x - x.detach())
    return out


def _nonneg(x: Tensor) -> Tensor:
    """Clamp rounding noise below zero away in the value only; the gradient passes untouched."""
    return x + (x.clamp_min(0.0) - x).detach()


# --------------------------------------------------------------------------------------------
# The estimators.


def k1(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""Schulman's k1: the plain log-ratio.

    ``k1 = d = logp - logp_ref``. Unbiased for KL(pi_theta ‖ pi_ref) over y ~ pi_theta, but
    negative for about half the samples and of high variance (sd = 2/mu relative to KL for
    N(0,1) vs N(mu,1)).

    Gradient: ``grad k1 = grad logp``, whose expectation over y ~ pi_theta is exactly **zero**
    (E[grad log pi] = 0). So k1 *in the loss* regularises nothing in expectation, while k1 *in the
    reward* (detached, as REINFORCE/PPO's per-token penalty) follows grad KL(pi_theta ‖ pi_ref).

    Args:
        logp: ``[B, T]`` log pi_theta of the sampled tokens.
        logp_ref: ``[B, T]`` log pi_ref of the same tokens (treated as a constant by callers).

    Returns:
        ``[B, T]`` float32.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> kl.k1(logp, logp_ref)  # d = -1 + 1.5, -2 + 1
        tensor([[ 0.5000, -1.0000]])
    """
    return to_out(_log_ratio(logp, logp_ref), logp, logp_ref)


def k2(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""Schulman's k2: half the squared log-ratio.

    ``k2 = d² / 2``. Non-negative and biased: E[k2] is the f-divergence with f(x) = ½ (log x)²,
    which agrees with KL(pi_theta ‖ pi_ref) to second order as pi_theta → pi_ref (for
    N(0,1) vs N(mu,1), E[k2] = mu²/2 + mu⁴/8).

    Gradient: ``grad k2 = d · grad logp``, whose expectation over y ~ pi_theta is
    ``E[d grad logp] = grad KL(pi_theta ‖ pi_ref)``: on-policy, k2 in the loss is
    gradient-equivalent to k1 in the reward, per token (Liu et al. 2025).

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> kl.k2(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))  # 0.5²/2, (-1)²/2
        tensor([[0.1250, 0.5000]])
    """
    d = _log_ratio(logp, logp_ref)
    return to_out(0.5 * d * d, logp, logp_ref)


def k3(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""Schulman's k3, GRPO's per-token KL term.

    ``k3 = r - 1 - log r = exp(-d) + d - 1`` with ``r = pi_ref / pi_theta = exp(-d)``. Unbiased
    for KL(pi_theta ‖ pi_ref) over y ~ pi_theta (E[r] = 1) and non-negative (log x ≤ x - 1).
    Computed as ``expm1(-d) + d``, accurate near d = 0.

    Gradient: ``grad k3 = (1 - exp(-d)) grad logp``, whose expectation over y ~ pi_theta is
    ``sum_y (pi_theta(y) - pi_ref(y)) grad log pi_theta(y) = grad KL(pi_ref ‖ pi_theta)``:
    **the other direction** from the KL its value estimates. In the reward (detached) it follows
    neither direction. Its coefficient diverges like -exp(|d|) as pi_theta ≪ pi_ref
    (DeepSeek-V3.2's complaint) and saturates at 1 as pi_theta ≫ pi_ref.

    Args / Returns: as :func:`k1`. Beyond d < -88.7 the value is +inf (see the module notes).

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> # d = 0.5: exp(-0.5) + 0.5 - 1 = 0.1065;  d = -1: e - 1 - 1 = 0.7183
        >>> kl.k3(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))
        tensor([[0.1065, 0.7183]])
    """
    d = _log_ratio(logp, logp_ref)
    return to_out(_k3_wide(d), logp, logp_ref)


def abs_(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""verl's ``abs``: the absolute log-ratio, ``|d|``.

    Non-negative, biased for KL(pi_theta ‖ pi_ref) (first order in d where KL is second order).
    Gradient: ``sign(d) grad logp`` (zero at d = 0); its expectation follows no KL.
    Registered as ``"abs"``.

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> kl.abs_(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))  # |0.5|, |-1|
        tensor([[0.5000, 1.0000]])
    """
    return to_out(torch.abs(_log_ratio(logp, logp_ref)), logp, logp_ref)


def k1_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""``k1+``: the value of k1 with the gradient of k2 (straight-through, verl's ``+`` suffix).

    Value ``d`` (unbiased for KL(pi_theta ‖ pi_ref)); gradient ``d · grad logp``, expected
    gradient grad KL(pi_theta ‖ pi_ref) on-policy. Logging the value and descending the right
    gradient at once.

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> value = kl.k1_plus(logp, torch.tensor([[-1.5, -1.0]]))
        >>> value.detach()  # k1's value, d
        tensor([[ 0.5000, -1.0000]])
        >>> value.sum().backward(); logp.grad  # k2's gradient, d
        tensor([[ 0.5000, -1.0000]])
    """
    d = _log_ratio(logp, logp_ref)
    return to_out(_k2_straight_through(d, d), logp, logp_ref)


def k2_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""``k2+``: identical to :func:`k2` (value d²/2, gradient d · grad logp); listed for verl parity.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> kl.k2_plus(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]]))  # = k2
        tensor([[0.1250, 0.5000]])
    """
    return k2(logp, logp_ref)


def k3_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""``k3+``: the value of k3 with the gradient of k2 (straight-through, verl's ``k3+``).

    Value ``exp(-d) + d - 1`` (unbiased, non-negative estimate of KL(pi_theta ‖ pi_ref));
    gradient ``d · grad logp``, expected gradient grad KL(pi_theta ‖ pi_ref) on-policy.

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> value = kl.k3_plus(logp, torch.tensor([[-1.5, -1.0]]))
        >>> value.detach()  # k3's value: exp(-0.5) - 0.5, e - 2
        tensor([[0.1065, 0.7183]])
        >>> value.sum().backward(); logp.grad  # k2's gradient, d (k3's would be 1 - exp(-d))
        tensor([[ 0.5000, -1.0000]])
    """
    d = _log_ratio(logp, logp_ref)
    return to_out(_k2_straight_through(d, _k3_wide(d)), logp, logp_ref)


def abs_plus(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""``abs+``: the value of ``abs`` with the gradient of k2 (straight-through).

    Value ``|d|`` (biased); gradient ``d · grad logp``, expected gradient
    grad KL(pi_theta ‖ pi_ref) on-policy.

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> value = kl.abs_plus(logp, torch.tensor([[-1.5, -1.0]]))
        >>> value.detach(), logp.grad is None
        (tensor([[0.5000, 1.0000]]), True)
        >>> value.sum().backward(); logp.grad  # d, not sign(d)
        tensor([[ 0.5000, -1.0000]])
    """
    d = _log_ratio(logp, logp_ref)
    return to_out(_k2_straight_through(d, torch.abs(d)), logp, logp_ref)


def k3_is(logp: Tensor, logp_ref: Tensor, logp_old: Tensor) -> Tensor:
    r"""Importance-weighted k3: ``w · k3`` with ``w = exp(logp - logp_old)``, gradient through both.

    For tokens sampled from ``pi_old`` (the policy that generated the batch), E_old[w · k3] =
    E_theta[k3] = KL(pi_theta ‖ pi_ref): unbiased. Its gradient is

        grad(w k3) = w k3 grad logp + w (1 - exp(-d)) grad logp = w · d · grad logp,

    whose expectation over y ~ pi_old is E_theta[d grad logp] = grad KL(pi_theta ‖ pi_ref), on-
    and off-policy. On-policy pass ``logp_old = logp.detach()`` (w = 1 in value, w = pi/sg(pi) in
    the gradient, i.e. k3 in the reward plus k3 in the loss). DeepSeek-V3.2 (arXiv:2512.02556,
    eq. 7); TRL's ``use_bias_correction_kl``.

    Args:
        logp, logp_ref: as :func:`k1`.
        logp_old: ``[B, T]`` log pi_old of the same tokens, the sampling policy; detached.

    Returns:
        ``[B, T]`` float32.

    Example:
        >>> import math, torch
        >>> from klpo import kl
        >>> # pi_theta = 1/2, pi_ref = pi_old = 1/4: w = 2, d = log 2, k3 = 1/2 - 1 + log 2 = 0.1931
        >>> logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        >>> quarter = torch.tensor([[math.log(0.25)]])
        >>> value = kl.k3_is(logp, quarter, quarter)
        >>> value.detach()  # w · k3 = 2 · 0.1931
        tensor([[0.3863]])
        >>> value.sum().backward(); logp.grad  # w · d = 2 log 2
        tensor([[1.3863]])
    """
    _check_pair(logp, logp_ref, "logp_ref")
    _check_pair(logp, logp_old, "logp_old")
    wide = wide_dtype(logp)
    lp, lp_ref = logp.to(wide), logp_ref.to(wide)
    with torch.no_grad():
        d = lp - lp_ref
        w = torch.exp(capped(lp - logp_old.to(wide)))
        value = w * _k3_wide(d)
        # d/dlogp (w k3) = w k3 + w (1 - exp(-d)) = w d;  d/dlogp_ref (w k3) = -w (1 - exp(-d))
        coef, coef_ref = w * d, w * torch.expm1(-capped(d))
    return to_out(_with_gradient(value, ((coef, lp), (coef_ref, lp_ref))), logp, logp_ref)


def low_var_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""verl's ``low_var_kl``: k3 with its log-ratio clamped to [-20, 20] and value to [-10, 10].

    A **compatibility option**, matching verl's ``kl_penalty(..., "low_var_kl")`` exactly:
    ``kl = clamp(logp_ref - logp, -20, 20); value = clamp(exp(kl) - kl - 1, -10, 10)``.
    Where the value clamp bites (k3 > 10, i.e. d < -2.611, pi_theta below 7.3% of pi_ref on the
    sampled token: exp(2.611) - 2.611 - 1 = 10) the gradient is **exactly zero**: the brake fails precisely where the policy
    has moved furthest below the reference. Elsewhere it equals k3, value and gradient. Prefer
    ``k3`` (or ``k3+``), which need no clamp.

    Args / Returns: as :func:`k1`.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp = torch.tensor([[-3.0, 0.5]], requires_grad=True)
        >>> value = kl.low_var_kl(logp, torch.zeros(1, 2))
        >>> value.detach()  # d = -3: k3 = e³ - 3 - 1 = 16.09, clamped to 10; d = 0.5: k3
        tensor([[10.0000,  0.1065]])
        >>> value.sum().backward(); logp.grad  # zero where the clamp bites; 1 - exp(-0.5) elsewhere
        tensor([[-0.0000, 0.3935]])
    """
    d = _log_ratio(logp, logp_ref)
    kl = torch.clamp(-d, min=-20.0, max=20.0)
    return to_out(torch.clamp(torch.exp(kl) - kl - 1.0, min=-10.0, max=10.0), logp, logp_ref)


def kl_ref_theta(logp: Tensor, logp_ref: Tensor) -> Tensor:
    r"""Unbiased estimate of the *other* direction, KL(pi_ref ‖ pi_theta), from pi_theta samples.

    ``r log r - (r - 1)`` with ``r = pi_ref / pi_theta = exp(-d)``: Schulman's general recipe
    f(r) - f'(1)(r - 1) for f(x) = x log x. Unbiased because E_theta[r log r] =
    sum_y pi_ref log(pi_ref / pi_theta) and E_theta[r] = 1; non-negative because x log x is convex.
    Use it only where the other direction is wanted explicitly.

    Gradient: with grad r = -r grad logp, ``grad value = -r (log r) grad logp``, i.e.
    ``d · exp(-d) · grad logp``; its expectation over y ~ pi_theta is
    sum_y pi_ref(y) d(y) grad log pi_theta(y), which is **not** grad KL(pi_ref ‖ pi_theta)
    (that is sum_y (pi_theta - pi_ref) grad log pi_theta): "other (biased)" in the loss.

    Args / Returns: as :func:`k1`. Beyond d < -88.7 the value is +inf.

    Example:
        >>> import math, torch
        >>> from klpo import kl
        >>> # pi_theta = 1/2, pi_ref = 1/4: r = 1/2, r log r - (r - 1) = -0.3466 + 0.5
        >>> kl.kl_ref_theta(torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]]))
        tensor([[0.1534]])
    """
    _check_pair(logp, logp_ref, "logp_ref")
    wide = wide_dtype(logp)
    lp, lp_ref = logp.to(wide), logp_ref.to(wide)
    with torch.no_grad():
        d = lp - lp_ref
        r = torch.exp(-capped(d))
        # r log r - (r - 1) = r * (-d) - expm1(-d); written with expm1 for accuracy near d = 0.
        value = (-r * d - torch.expm1(-capped(d))).clamp_min(0.0)
        coef = r * d  # d/dd [r log r - r + 1] = (log r) dr/dd = (-d)(-r)
    return to_out(_with_gradient(value, ((coef, lp), (-coef, lp_ref))), logp, logp_ref)


def full(logits: Tensor, logits_ref: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""The exact per-position KL(pi_theta ‖ pi_ref) over the whole vocabulary (Rao-Blackwellised).

    ``full_t = sum_v pi_theta(v) (log pi_theta(v) - log pi_ref(v))`` with
    ``pi = softmax(logits / temperature)``. No sampling noise at the position (Amini, Vieira &
    Cotterell, arXiv:2504.10637). Its gradient in the loss is exactly grad KL(pi_theta ‖ pi_ref) at
    each position, ``pi ⊙ (log pi - log pi_ref - KL)`` with respect to the logits / temperature.

    Computed by :func:`klpo.logprobs.exact_kl`: rows in chunks, float32 arithmetic (float64 for
    float64 logits), nothing of size ``[B, T, V]`` saved for the backward pass besides the logits.
    From hidden states and the output head, :func:`klpo.logprobs.fused` computes the same quantity
    without the logits.

    Args:
        logits: ``[B, T, V]`` policy logits at the positions that produced the sampled tokens.
        logits_ref: ``[B, T, V]`` reference logits (detached: it gets no gradient).
        temperature: the sampling temperature the logits are divided by.

    Masked vocabulary: ``-inf`` logits are allowed (padding entries of the vocabulary, a
    constrained decoder). By the convention of Cover & Thomas (Elements of Information Theory,
    2.3), an entry with pi_theta(v) = 0 adds 0 to the KL and 0 to its gradient, so masking the
    same entries in both models gives the KL over the remaining support. An entry with
    pi_theta(v) > 0 and pi_ref(v) = 0 (``-inf`` only in ``logits_ref``) makes the KL ``+inf``; its
    gradient at that position is NaN (KL is ``+inf`` on a whole neighbourhood of the logits), or
    exactly 0 where the upstream gradient is 0 (a position masked out with ``torch.where``).

    Returns:
        ``[B, T]`` float32 (float64 when an input is float64).

    Example:
        >>> import math, torch
        >>> from klpo import kl
        >>> # pi_theta = (1/2, 1/2), pi_ref = (3/4, 1/4): 1/2 log(2/3) + 1/2 log 2 = 1/2 log(4/3)
        >>> kl.full(torch.zeros(1, 1, 2), torch.tensor([[[math.log(3.0), 0.0]]]))
        tensor([[0.1438]])
    """
    _check_pair(logits, logits_ref, "logits_ref")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return exact_kl(logits, logits_ref, temperature=temperature)


# --------------------------------------------------------------------------------------------
# The registry and the one entry point.


OffPolicy = Literal["weighted", "carried", "none"]
"""How :func:`klpo.losses.kl_loss` keeps an estimator's on-policy expected gradient for tokens
sampled from pi_old (:attr:`Spec.off_policy`)."""


@dataclass(frozen=True)
class Spec:
    """One KL estimator's traits: the one record of what it computes and what it needs.

    :data:`SPECS` maps each name to its ``Spec``; the losses, the trainer's step, the lab, the run
    report, the bridges to TRL and verl, ``klpo explain`` and ``klpo doctor`` all read it, so an
    estimator is added by adding its function and one row (:func:`register`).

    Attributes:
        fn: the per-token function (``fn(logp, logp_ref)``, ``fn(logp, logp_ref, logp_old)`` with
            ``needs_old``, ``fn(logits, logits_ref)`` with ``needs_logits``); its docstring is the
            estimator's reference. None for a reference-sampled estimator, which is no per-token
            function of the policy's tokens (:mod:`klpo.ref_kl` computes it).
        target: the KL the value is meant to estimate, :data:`THETA_REF` or :data:`REF_THETA`.
        equation: the value in one line, with d = logp - logp_ref (what :func:`explain` shows).
        off_policy: how :func:`klpo.losses.kl_loss` corrects it for tokens sampled from pi_old:
            ``"weighted"``, a detached weight pi_theta/pi_old on each token; ``"carried"``, it
            carries its own weight with the gradient through it and is returned as is (``k3_is``;
            it has no uncorrected form); ``"none"``, nothing to reweight: the value does not
            depend on the token the policy sampled (``full``) or the samples are the
            reference's (the reference-sampled estimators).
        loss_variant: the estimator that logs this one's value (or the nearest one) and whose
            expected gradient in the loss is grad KL(pi_theta ‖ pi_ref): itself where its own is
            (``k2``, ``k3_is``, ``full``), its straight-through ``+`` twin where not (``k1`` ->
            ``k1+``), ``k3+`` where it has no twin (``low_var_kl``, ``kl_ref_theta``). What
            ``klpo doctor`` proposes for a loss term that uses this estimator.
        needs_old: it needs ``logp_old``, the sampling policy's log-probs (``k3_is``).
        needs_logits: it is the exact KL over the vocabulary, computed from both models' logits
            ``[B, T, V]`` (or hidden states and the head, :func:`klpo.logprobs.fused`) rather
            than the sampled tokens' log-probs: the trainer logs it as ``kl/ref/exact``, it is
            not defined for a continuous distribution (the lab's Gaussians), and frameworks
            that pass only token log-probs (the TRL and verl bridges) cannot compute it.
        ref_sampled: it needs completions sampled from pi_ref (:mod:`klpo.ref_kl`), so ``"loss"``
            is its only placement (:func:`refusal`); listed in :data:`REF_SAMPLED`, not in
            :data:`ESTIMATORS`.
        mixed: (reference-sampled only) the term is ``a · k1`` on the policy's tokens plus
            ``(1 - a) · ref_is`` on the reference's, with ``a`` from a window of past KLs
            (:class:`klpo.ref_kl.MixWindow`); otherwise ``a = 0``.

    Example:
        >>> from klpo import kl
        >>> s = kl.SPECS["k3_is"]
        >>> s.needs_old, s.needs_logits, s.off_policy, s.loss_variant
        (True, False, 'carried', 'k3_is')
        >>> [n for n, s in kl.SPECS.items() if s.needs_logits]
        ['full']
    """

    fn: Callable[..., Tensor] | None
    target: str
    equation: str
    off_policy: OffPolicy
    loss_variant: str
    needs_old: bool = False
    needs_logits: bool = False
    ref_sampled: bool = False
    mixed: bool = False


_W, _C, _N = "weighted", "carried", "none"

SPECS: dict[str, Spec] = {
    "k1": Spec(k1, THETA_REF, "d", _W, "k1+"),
    "k2": Spec(k2, THETA_REF, "d²/2", _W, "k2"),
    "k3": Spec(k3, THETA_REF, "exp(-d) + d - 1", _W, "k3+"),
    "abs": Spec(abs_, THETA_REF, "|d|", _W, "abs+"),
    "k1+": Spec(k1_plus, THETA_REF, "d, with the gradient of d²/2", _W, "k1+"),
    "k2+": Spec(k2_plus, THETA_REF, "d²/2 (= k2)", _W, "k2"),
    "k3+": Spec(k3_plus, THETA_REF, "exp(-d) + d - 1, with the gradient of d²/2", _W, "k3+"),
    "abs+": Spec(abs_plus, THETA_REF, "|d|, with the gradient of d²/2", _W, "abs+"),
    "k3_is": Spec(
        k3_is,
        THETA_REF,
        "w·(exp(-d) + d - 1), w = exp(logp - logp_old)",
        _C,
        "k3_is",
        needs_old=True,
    ),
    "low_var_kl": Spec(low_var_kl, THETA_REF, "clamp(k3 with |d| ≤ 20, -10, 10) (verl)", _W, "k3+"),
    "kl_ref_theta": Spec(kl_ref_theta, REF_THETA, "r log r - (r - 1), r = exp(-d)", _W, "k3+"),
    "full": Spec(
        full, THETA_REF, "sum_v pi(v) log(pi(v)/pi_ref(v))", _N, "full", needs_logits=True
    ),
    "ref_is": Spec(
        None,
        THETA_REF,
        "w·log w over x ~ pi_ref, w = pi_theta(x)/pi_ref(x)",
        _N,
        "ref_is",
        ref_sampled=True,
    ),
    "adaptive_mix": Spec(
        None,
        THETA_REF,
        "a·k1 + (1 - a)·ref_is, a = sigmoid(±gamma (KL_window - threshold)); "
        "its expected gradient is scaled by 1 - a",
        _N,
        "adaptive_mix",
        ref_sampled=True,
        mixed=True,
    ),
}
"""Every KL estimator by name, in the order of the docs' tables: the one registry of their traits
(:class:`Spec`). Read it, and :data:`ESTIMATORS` / :data:`REF_SAMPLED` (views of it), at the time
of use rather than copying it at import, so that an estimator added by :func:`register` (or, in a
test, ``monkeypatch.setitem(kl.SPECS, name, spec)``) is known everywhere."""


def _names(keep: Callable[[Spec], bool]) -> Callable[[], Iterator[str]]:
    return lambda: (n for n, s in SPECS.items() if keep(s))


ESTIMATORS: Sequence[str] = LiveNames(
    _names(lambda s: not s.ref_sampled),
    "The per-token estimators (functions of the policy's own samples), by name, in registry "
    "order; a view of :data:`SPECS`, read when used.",
)
REF_SAMPLED: Sequence[str] = LiveNames(
    _names(lambda s: s.ref_sampled),
    "Estimators that also need completions sampled from pi_ref (:mod:`klpo.ref_kl`): "
    "``ref_is`` and ``adaptive_mix``; not in :data:`ESTIMATORS`.",
)
LOGPROB_ESTIMATORS: Sequence[str] = LiveNames(
    _names(lambda s: not s.ref_sampled and not s.needs_logits),
    "The per-token estimators computed from the sampled tokens' log-probs alone (and logp_old): "
    ":data:`ESTIMATORS` but those that need the logits. What a framework that passes only token "
    "log-probs can use, and what is defined for a continuous distribution.",
)


def register(name: str, spec: Spec, *, replace: bool = False) -> Spec:
    """Add estimator ``name`` to :data:`SPECS` and return its spec.

    Every layer then knows it: :func:`estimate`, :func:`explain`, :func:`klpo.losses.kl_loss`,
    the trainer's ``kl.estimator``, the lab, the bridges and the doctor.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> def twice_k2(logp, logp_ref):
        ...     return kl.k2(logp, logp_ref) * 2.0
        >>> spec = kl.Spec(twice_k2, kl.THETA_REF, "d²", "weighted", "k2")
        >>> kl.register("d2", spec) is spec
        True
        >>> kl.estimate("d2", torch.tensor([[0.5]]), torch.tensor([[0.0]]))  # 0.5² = 0.25
        tensor([[0.2500]])
        >>> del kl.SPECS["d2"]

    Raises:
        ValueError: an empty name or one taken (unless ``replace``), a ``fn`` that is missing or
            not callable where the spec is per-token (or given to a reference-sampled one),
            ``mixed`` without ``ref_sampled``, an unknown ``target`` or ``off_policy``, or a
            ``loss_variant`` that is neither ``name`` nor a registered estimator.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an estimator needs a name, got {name!r}")
    if name in SPECS and not replace and SPECS[name] != spec:
        raise ValueError(
            f"estimator {name!r} is already registered; pass replace=True to replace it"
        )
    if not isinstance(spec, Spec):
        raise ValueError(f"estimator {name!r}: {spec!r} is not a klpo.kl.Spec")
    if spec.ref_sampled != (spec.fn is None):
        raise ValueError(
            f"estimator {name!r}: a per-token estimator needs fn (its function); a reference-"
            "sampled one (ref_sampled=True) has none (klpo.ref_kl computes it)"
        )
    if spec.fn is not None and not callable(spec.fn):
        raise ValueError(f"estimator {name!r}: fn={spec.fn!r} is not a function")
    if spec.mixed and not spec.ref_sampled:
        raise ValueError(f"estimator {name!r}: mixed=True needs ref_sampled=True")
    if spec.target not in (THETA_REF, REF_THETA):
        raise ValueError(
            f"estimator {name!r}: target must be klpo.kl.THETA_REF or REF_THETA, got {spec.target!r}"
        )
    if spec.off_policy not in get_args(OffPolicy):
        raise ValueError(
            f"estimator {name!r}: off_policy must be one of {', '.join(get_args(OffPolicy))}, "
            f"got {spec.off_policy!r}"
        )
    if spec.loss_variant != name and spec.loss_variant not in SPECS:
        raise ValueError(
            f"estimator {name!r}: loss_variant={spec.loss_variant!r} is not a registered "
            f"estimator; choose {name!r} itself or one of: {', '.join(SPECS)}"
        )
    SPECS[name] = spec
    return spec


def _spec(name: str) -> Spec:
    """The spec of a per-token estimator (ValueError listing :data:`ESTIMATORS` otherwise)."""
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None or spec.ref_sampled:
        raise ValueError(f"unknown KL estimator {name!r}; choose one of: {', '.join(ESTIMATORS)}")
    return spec


def function(name: str) -> Callable[..., Tensor]:
    """The function that implements estimator ``name``; its docstring is the estimator's reference.

    Raises:
        ValueError: ``name`` is not in :data:`ESTIMATORS`.

    Example:
        >>> from klpo import kl
        >>> kl.function("k3") is kl.k3, kl.function("abs") is kl.abs_
        (True, True)
    """
    return _spec(name).fn


def _check_full(value: Tensor, mask: Tensor | None) -> None:
    """ValueError if ``full``'s result is non-finite where ``mask`` (one pass over [B, T])."""
    if mask is not None:
        check_mask(mask, value.shape)
    bad = ~torch.isfinite(value.detach())
    if mask is not None:
        bad &= mask
    if not bool(bad.any()):
        return
    inf = int((torch.isposinf(value.detach()) & bad).sum())
    where = " at unmasked positions" if mask is not None else ""
    raise ValueError(
        f"estimator 'full' is non-finite at {int(bad.sum())} position(s){where} out of "
        f"{value.numel()} ({inf} +inf, {int(bad.sum()) - inf} NaN): +inf where logits_ref is -inf "
        f"at a vocabulary entry where logits is not (the reference gives probability 0 to a token "
        f"the policy can sample: an infinite KL with no gradient), NaN from NaN or +inf logits; "
        f"mask the vocabulary of both models alike (-inf in logits wherever it is in logits_ref), "
        f"or mask those positions out"
    )


def estimate(
    name: str,
    logp: Tensor | None,
    logp_ref: Tensor | None,
    *,
    logp_old: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    mask: Tensor | None = None,
    check_finite: bool = True,
) -> Tensor:
    """Per-token KL estimate by name: ``estimate("k3", logp, logp_ref)`` → ``[B, T]`` float32.

    Args:
        name: one of :data:`ESTIMATORS`.
        logp: ``[B, T]`` log pi_theta of the sampled tokens.
        logp_ref: ``[B, T]`` log pi_ref of the same tokens.
        logp_old: ``[B, T]`` log pi_old, the sampling policy; required by ``k3_is``
            (on-policy, pass ``logp.detach()``), ignored by the others.
        logits, logits_ref: ``[B, T, V]``; required by ``full`` (which ignores ``logp``).
        mask: optional ``[B, T]`` bool, True where a token takes part. Only the finiteness check
            uses it (positions where it is False may hold padding of any value, NaN included);
            the estimate is still returned at every position, and reducing it with the mask
            (:func:`klpo.reduce.reduce`) is the caller's job.
        check_finite: raise on non-finite ``logp``, ``logp_ref`` or ``logp_old`` (where
            ``mask``). A token sampled from pi_theta has a finite log-probability under pi_theta
            and pi_old, and a ``-inf`` under pi_ref means the reference forbids it (an infinite
            KL, whose gradient is NaN): either way the estimate would be NaN or inf with no word.
            The check is one ``isfinite`` pass per input and one host sync; pass
            False where infinite inputs are meant (a study of what each estimator does with an
            infinite log-ratio). For ``full`` its result is checked instead (one pass over
            ``[B, T]``, where ``mask``): ``-inf`` logits are a masked vocabulary and supported
            (an entry with pi_theta = 0 adds 0), but a ``-inf`` in ``logits_ref`` where
            ``logits`` is finite makes the KL ``+inf`` (and its gradient NaN), and NaN or ``+inf``
            logits make it NaN; the logits themselves are not scanned (that would be a second pass
            over ``[B, T, V]``).

    Raises:
        ValueError: for an unknown name (listing the valid ones), a missing input, a
            non-finite log-prob (naming the argument and the count of non-finite entries), or a
            non-finite ``full`` (the count of +inf and NaN positions).

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> kl.estimate("k3", logp, logp_ref)  # kl.k3(logp, logp_ref)
        tensor([[0.1065, 0.7183]])
        >>> kl.estimate("k3_is", logp, logp_ref, logp_old=logp)  # on-policy: w = 1, k3's value
        tensor([[0.1065, 0.7183]])
    """
    spec = _spec(name)
    if spec.needs_logits:
        if logits is None or logits_ref is None:
            raise ValueError(
                f"estimator {name!r} is the exact KL over the vocabulary and needs logits= and "
                f"logits_ref= ([B, T, V]); estimators that work from logp and logp_ref alone: "
                f"{', '.join(n for n in ESTIMATORS if not (SPECS[n].needs_logits or SPECS[n].needs_old))} (and with "
                f"logp_old, the sampling policy's log-probs: "
                f"{', '.join(n for n in ESTIMATORS if SPECS[n].needs_old)})"
            )
        value = spec.fn(logits, logits_ref)
        if check_finite:
            _check_full(value, mask)
        return value
    if logp is None or logp_ref is None:
        raise ValueError(f"estimator {name!r} needs logp and logp_ref ([B, T] token log-probs)")
    if check_finite:
        _check_pair(logp, logp_ref, "logp_ref")
        if mask is not None:
            check_mask(mask, logp.shape)
        old = {}
        if spec.needs_old and logp_old is not None:
            _check_pair(logp, logp_old, "logp_old")
            old = {"logp_old": logp_old}
        _check_finite("logp", logp, mask, logp_ref=logp_ref, **old)
    if spec.needs_old:
        if logp_old is None:
            raise ValueError(
                f"estimator {name!r} needs logp_old (the log-probs of the policy that sampled the "
                f"tokens; on-policy pass logp.detach()); estimators that need no logp_old: "
                f"{', '.join(n for n in ESTIMATORS if not SPECS[n].needs_old)}"
            )
        return spec.fn(logp, logp_ref, logp_old)
    return spec.fn(logp, logp_ref)


# --------------------------------------------------------------------------------------------
# explain: the table of claims, derived by exact enumeration rather than typed in.


@dataclass(frozen=True)
class Explanation:
    """What a KL estimator in a placement really does.

    Attributes:
        estimator: the estimator's name.
        placement: ``"reward"`` (the detached estimate is a per-token penalty in the reward,
            optimised by the policy gradient), ``"loss"`` (the estimate is added to the loss and
            differentiated) or ``"reward+loss"`` (both).
        on_policy: whether the tokens were sampled from pi_theta itself (else from pi_old).
        equation: the value, with d = logp - logp_ref.
        estimates: the KL the value is meant to estimate.
        unbiased: whether E[value] equals that KL exactly.
        nonnegative: whether every value is ≥ 0.
        gradient: the expected gradient the term follows, one of :data:`GRADIENTS`.
        mismatch: True when the gradient is not the gradient of the KL the value estimates.
    """

    estimator: str
    placement: str
    on_policy: bool
    equation: str
    estimates: str
    unbiased: bool
    nonnegative: bool
    gradient: str
    mismatch: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def text(self) -> str:
        """The explanation for people, a few lines."""
        sampling = "samples from pi_theta" if self.on_policy else "samples from pi_old ≠ pi_theta"
        spec = SPECS.get(self.estimator)
        if spec is not None and spec.ref_sampled:
            sampling = "samples from pi_ref and pi_theta" if spec.mixed else "samples from pi_ref"
        value = (
            f"{'unbiased' if self.unbiased else 'biased'} estimate of {self.estimates}, "
            f"{'never negative' if self.nonnegative else 'can be negative'}"
        )
        if self.gradient == GRAD_ZERO:
            grad = "zero in expectation: this term regularises nothing"
        elif self.gradient == GRAD_OTHER:
            grad = "no KL's gradient (biased)"
        else:
            grad = self.gradient
        lines = [
            f"{self.estimator} in the {self.placement} ({sampling})",
            f"  value:    {self.equation}, d = logp - logp_ref",
            f"  estimate: {value}",
            f"  gradient: follows {grad}",
        ]
        if self.mismatch:
            lines.append(
                f"  note:     the gradient is not that of {self.estimates}, the KL it logs"
            )
        return "\n".join(lines)


def explain(name: str, placement: Placement, *, on_policy: bool = True) -> Explanation:
    """Say what estimator ``name`` does in ``placement``: its value, bias, sign and gradient.

    The answer is *derived*, not looked up: the estimator itself is evaluated, in float64, on
    every outcome of a few seeded random categoricals (softmax logits, vocabulary 6), each outcome
    weighted by its probability under the sampling policy, and the exact expected value and
    expected gradient with respect to the logits are compared with KL(pi_theta ‖ pi_ref),
    KL(pi_ref ‖ pi_theta) and their gradients. Change an estimator and its explanation changes.

    The placements, with samples y ~ pi_s (pi_s = pi_theta on-policy, pi_old off-policy) and
    ratio = pi_theta(y) / sg(pi_s(y)):

    - ``"loss"``: E_s[grad est(y)], the term differentiated with the samples held fixed (as GRPO);
    - ``"reward"``: E_s[ratio(y) · sg(est_s(y)) · grad log pi_theta(y)], the detached estimate of
      the sampling time used as a penalty in the (PPO-ratio) policy gradient, as PPO-RLHF;
    - ``"reward+loss"``: the sum of the two.

    Args:
        name: one of :data:`ESTIMATORS`.
        placement: one of :data:`PLACEMENTS` (``"none"`` is an error: it places no KL). The
            estimators of :data:`REF_SAMPLED` have only ``"loss"``; other placements raise a
            ValueError with the reason (:func:`refusal`).
        on_policy: False to ask about tokens sampled from an older policy pi_old, with no
            correction beyond what the estimator itself carries (``k3_is`` carries one).

    Returns:
        an :class:`Explanation`.

    Raises:
        ValueError: an unknown estimator or placement, or a placement that makes no sense for it.

    Example:
        >>> from klpo import kl
        >>> kl.explain("k3", "loss").gradient  # GRPO's k3 in the loss: the other direction
        'grad KL(pi_ref ‖ pi_theta)'
        >>> kl.explain("k1", "reward").gradient, kl.explain("k1", "loss").gradient
        ('grad KL(pi_theta ‖ pi_ref)', 'zero')
    """
    spec = SPECS[name] if name in REF_SAMPLED else _spec(name)
    if _placement(placement) == "none":
        raise ValueError(
            "placement 'none' puts no KL in the reward or the loss, so there is no gradient to "
            f"explain; choose one of: {', '.join(PLACEMENTS)}"
        )
    if spec.ref_sampled:
        reason = refusal(name, placement)
        if reason is not None:
            raise ValueError(reason)
        return _derive_ref_sampled(name, spec)
    return _derive(name, spec, placement, bool(on_policy))


def explain_all(*, on_policy: bool = True) -> list[Explanation]:
    """:func:`explain` for every estimator in every placement, in registry order.

    Example:
        >>> from klpo import kl
        >>> [e.gradient for e in kl.explain_all() if e.estimator == "k2"]  # reward, loss, both
        ['other (biased)', 'grad KL(pi_theta ‖ pi_ref)', 'other (biased)']
    """
    return [explain(n, p, on_policy=on_policy) for n in ESTIMATORS for p in PLACEMENTS]


_VOCAB = 6
_CASES = 4
_TOL = 1e-9


@functools.cache
def _cases() -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
    """Seeded (logits, logits_ref, logits_old) triples; the last has logits far apart."""
    gen = torch.Generator().manual_seed(20200307)  # the date of Schulman's post
    out = []
    for i in range(_CASES):
        scale = 3.0 if i == _CASES - 1 else 1.0
        theta = scale * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        ref = scale * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        old = theta + 0.5 * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        out.append((theta, ref, old))
    return tuple(out)


def _terms(name: str, logits: Tensor, ref: Tensor, logp_old: Tensor) -> Tensor:
    """The estimator at every outcome y of the categorical, as a [1, V] batch of tokens."""
    logp = torch.log_softmax(logits, -1)
    logp_ref = torch.log_softmax(ref, -1)
    v = logits.numel()
    return estimate(
        name,
        logp[None],
        logp_ref[None],
        logp_old=logp_old[None],
        logits=logits.expand(1, v, v),
        logits_ref=ref.expand(1, v, v),
    )[0].to(torch.float64)


def expected_value_and_gradient(
    name: str,
    placement: str,
    logits: Tensor,
    logits_ref: Tensor,
    logits_old: Tensor | None = None,
) -> tuple[float, Tensor]:
    """Exact E_s[est] and the exact expected gradient of ``placement`` w.r.t. ``logits``.

    Enumerates every outcome of the categorical softmax(``logits``) (``[V]``, float64), the
    samples drawn from pi_s = softmax(``logits_old``) if given, else from pi_theta itself.
    Used by :func:`explain` and by the lab.
    """
    theta = logits.detach().to(torch.float64).clone().requires_grad_(True)
    ref = logits_ref.detach().to(torch.float64)
    logp = torch.log_softmax(theta, -1)
    logp_s = (
        logp.detach()
        if logits_old is None
        else torch.log_softmax(logits_old.detach().to(torch.float64), -1)
    )
    p_s = logp_s.exp()
    est = _terms(name, theta, ref, logp_s)
    value = float((p_s * est).sum().detach())
    objective = torch.zeros((), dtype=torch.float64)
    if placement in ("loss", "reward+loss"):
        objective = objective + (p_s * est).sum()
    if placement in ("reward", "reward+loss"):
        # The penalty as sampled: est at the sampling policy (logp = logp_s), then detached.
        est_s = _terms(name, logp_s.detach(), ref, logp_s).detach()
        ratio = torch.exp(logp - logp_s)
        objective = objective + (p_s * ratio * est_s).sum()
    (grad,) = torch.autograd.grad(objective, theta, allow_unused=True)
    if grad is None:
        grad = torch.zeros_like(theta)
    return value, grad.detach()


def _exact_kls(logits: Tensor, ref: Tensor) -> tuple[float, float, Tensor, Tensor]:
    theta = logits.detach().clone().requires_grad_(True)
    logp, logp_ref = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    kl_tr = (logp.exp() * (logp - logp_ref)).sum()
    kl_rt = (logp_ref.exp() * (logp_ref - logp)).sum()
    (g_tr,) = torch.autograd.grad(kl_tr, theta, retain_graph=True)
    (g_rt,) = torch.autograd.grad(kl_rt, theta)
    return float(kl_tr.detach()), float(kl_rt.detach()), g_tr, g_rt


def _close(a: Tensor, b: Tensor) -> bool:
    return float((a - b).norm()) <= _TOL * max(1.0, float(b.norm()))


@functools.cache
def _derive(name: str, spec: Spec, placement: str, on_policy: bool) -> Explanation:
    # Cached by the spec too, so a spec registered again under the same name is derived afresh.
    unbiased, labels = True, set()
    for theta, ref, old in _cases():
        kl_tr, kl_rt, g_tr, g_rt = _exact_kls(theta, ref)
        value, grad = expected_value_and_gradient(
            name, placement, theta, ref, None if on_policy else old
        )
        target = kl_tr if spec.target == THETA_REF else kl_rt
        unbiased &= math.isclose(value, target, rel_tol=_TOL, abs_tol=_TOL)
        if _close(grad, torch.zeros_like(grad)):
            labels.add(GRAD_ZERO)
        elif _close(grad, g_tr):
            labels.add(GRAD_THETA_REF)
        elif _close(grad, g_rt):
            labels.add(GRAD_REF_THETA)
        else:
            labels.add(GRAD_OTHER)
    gradient = labels.pop() if len(labels) == 1 else GRAD_OTHER
    wanted = GRAD_THETA_REF if spec.target == THETA_REF else GRAD_REF_THETA
    return Explanation(
        estimator=name,
        placement=placement,
        on_policy=on_policy,
        equation=spec.equation,
        estimates=spec.target,
        unbiased=unbiased,
        nonnegative=_never_negative(name, spec),
        gradient=gradient,
        mismatch=gradient != wanted,
    )


@functools.cache
def _never_negative(name: str, spec: Spec) -> bool:
    """Whether the value is ≥ 0 on a grid of log-ratios d ∈ [-30, 30] (and importance weights)."""
    # Steps of 0.1 from exact integers, so d = 0 is exactly 0: linspace puts ~1e-15 there, where
    # exp(-d) + d - 1 rounds to either sign depending on the CPU's exp (a property of the
    # arithmetic, not of the estimator).
    d = torch.arange(-300, 301, dtype=torch.float64) / 10.0
    zeros = torch.zeros_like(d)
    if spec.needs_logits:
        # The exact KL of two categoricals is ≥ 0 (Gibbs' inequality); check it on the cases.
        return all(
            float(_terms(name, theta, ref, torch.log_softmax(theta, -1)).min()) >= 0.0
            for theta, ref, _ in _cases()
        )
    logp_old = torch.stack([zeros, zeros + 5.0, zeros - 5.0])
    values = estimate(name, d.expand(3, -1), zeros.expand(3, -1), logp_old=logp_old.expand(3, -1))
    return bool((values >= 0).all())


# --------------------------------------------------------------------------------------------
# Estimators from samples of the reference (klpo.ref_kl): only in the loss.


def refusal(name: str, placement: str) -> str | None:
    """Why ``name`` cannot go in ``placement``, or None if it can.

    Only the estimators of :data:`REF_SAMPLED` refuse a placement: ``ref_is`` is computed on
    completions the *reference* sampled, so as a detached per-token reward it would attach to
    no token the policy sampled and carry no policy-gradient term for them; ``adaptive_mix``
    inherits this through its ``ref_is`` part.

    Example:
        >>> from klpo import kl
        >>> kl.refusal("k3", "reward") is None, kl.refusal("ref_is", "loss") is None
        (True, True)
        >>> kl.refusal("ref_is", "reward")[:49]
        'ref_is cannot go in the reward: it is computed on'
    """
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None or not spec.ref_sampled or placement == "loss":
        return None
    why = (
        f"{name} cannot go in the {placement}: it is computed on completions sampled from pi_ref, "
        "not from the policy, so as a detached reward it sits on no token the policy sampled and "
        "carries no policy-gradient term for the policy's own tokens. "
    )
    if spec.mixed:
        why += "(Its k1 part could, but its ref_is part cannot, and the mix is one number.) "
    return why + (
        "Use kl.placement=loss: there, differentiating w·log w with the reference's samples held "
        "fixed follows grad KL(pi_theta ‖ pi_ref) exactly (klpo explain -e ref_is -p loss)."
    )


@functools.cache
def _derive_ref_sampled(name: str, spec: Spec) -> Explanation:
    """:func:`explain` for a :data:`REF_SAMPLED` estimator in the loss, by exact enumeration.

    ``ref_is``: E_ref[w log w] and E_ref[grad (w log w)] summed over every outcome x with weight
    pi_ref(x). ``adaptive_mix`` at a fixed weight a = 1/2: a·E_theta[k1] + (1 - a)·E_ref[w log w];
    its expected gradient must then be (1 - a)·grad KL(pi_theta ‖ pi_ref) (k1's is zero).
    """
    a = 0.5 if spec.mixed else 0.0
    unbiased, labels = True, set()
    for theta, ref, _ in _cases():
        kl_tr, _, g_tr, _ = _exact_kls(theta, ref)
        t = theta.detach().clone().requires_grad_(True)
        logp, logp_ref = torch.log_softmax(t, -1), torch.log_softmax(ref, -1)
        p, p_ref = logp.exp(), logp_ref.exp()
        log_w = logp - logp_ref
        ris = (p_ref * log_w.exp() * log_w).sum()
        k1_loss = (p.detach() * k1(logp, logp_ref)).sum()  # samples of pi_theta held fixed
        objective = a * k1_loss + (1 - a) * ris
        value = a * float((p * log_w).sum().detach()) + (1 - a) * float(ris.detach())
        (grad,) = torch.autograd.grad(objective, t)
        unbiased &= math.isclose(value, kl_tr, rel_tol=_TOL, abs_tol=_TOL)
        if _close(grad / (1 - a), g_tr):
            labels.add(GRAD_THETA_REF)
        else:
            labels.add(GRAD_OTHER)
    gradient = labels.pop() if len(labels) == 1 else GRAD_OTHER
    return Explanation(
        estimator=name,
        placement="loss",
        on_policy=True,
        equation=spec.equation,
        estimates=THETA_REF,
        unbiased=unbiased,
        nonnegative=False,  # w log w < 0 wherever w < 1, and k1 can be negative
        gradient=gradient,
        mismatch=gradient != GRAD_THETA_REF,
    )
