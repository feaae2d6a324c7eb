r"""The KL estimators' functions: each maps per-token log-probs to a per-token estimate.

The math of every row of :data:`klpo.registry.SPECS` (what each estimates and which gradient it
follows: :mod:`klpo.kl`, whose docstring has the table), and :func:`estimate`, the one entry point
by name. Shapes: ``logp``, ``logp_ref`` and ``logp_old`` are ``[B, T]`` (any shape works, as long
as all three agree); ``full`` takes logits ``[B, T, V]``. The arithmetic is done in float64
(float32 on devices without float64) and the result is float32 (float64 for float64 inputs); the
range and masking rules are :mod:`klpo.kl`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from klpo._lazy import resolve
from klpo._tensor import capped, check_float, check_mask, check_same_shape, to_out, wide_dtype
from klpo._tensor import check_finite as _check_finite
from klpo.logprobs import exact_kl
from klpo.registry import ESTIMATORS, SPECS, Spec, _spec

__all__ = [
    "abs_",
    "abs_plus",
    "estimate",
    "full",
    "function",
    "k1",
    "k1_plus",
    "k2",
    "k2_plus",
    "k3",
    "k3_is",
    "k3_plus",
    "kl_ref_theta",
    "low_var_kl",
]


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


def function(name: str) -> Callable[..., Tensor]:
    """The function that implements estimator ``name``; its docstring is the estimator's reference.

    Raises:
        ValueError: ``name`` is not in :data:`ESTIMATORS`.

    Example:
        >>> from klpo import kl
        >>> kl.function("k3") is kl.k3, kl.function("abs") is kl.abs_
        (True, True)
    """
    return resolve(_spec(name).fn)


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
        return _exact(name, spec, logits, logits_ref, mask, check_finite)
    if logp is None or logp_ref is None:
        raise ValueError(f"estimator {name!r} needs logp and logp_ref ([B, T] token log-probs)")
    if check_finite:
        _check_logps(spec, logp, logp_ref, logp_old, mask)
    if spec.needs_old:
        if logp_old is None:
            raise ValueError(
                f"estimator {name!r} needs logp_old (the log-probs of the policy that sampled the "
                f"tokens; on-policy pass logp.detach()); estimators that need no logp_old: "
                f"{', '.join(n for n in ESTIMATORS if not SPECS[n].needs_old)}"
            )
        return spec.fn(logp, logp_ref, logp_old)
    return spec.fn(logp, logp_ref)


def _exact(
    name: str,
    spec: Spec,
    logits: Tensor | None,
    logits_ref: Tensor | None,
    mask: Tensor | None,
    check_finite: bool,
) -> Tensor:
    """:func:`estimate` of an estimator over the vocabulary (``full``), its result checked."""
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


def _check_logps(
    spec: Spec, logp: Tensor, logp_ref: Tensor, logp_old: Tensor | None, mask: Tensor | None
) -> None:
    """:func:`estimate`'s checks of the token log-probs: shapes, the mask, finiteness."""
    _check_pair(logp, logp_ref, "logp_ref")
    if mask is not None:
        check_mask(mask, logp.shape)
    old = {}
    if spec.needs_old and logp_old is not None:
        _check_pair(logp, logp_old, "logp_old")
        old = {"logp_old": logp_old}
    _check_finite("logp", logp, mask, logp_ref=logp_ref, **old)
