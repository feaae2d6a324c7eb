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

This module is the face of three: :mod:`klpo.registry` (each estimator's traits — what it
needs: ``logp_old``, the logits, the reference's own samples; how :func:`klpo.losses.kl_loss`
corrects it off-policy; what ``klpo doctor`` proposes in its place — one row of :data:`SPECS`, a
:class:`Spec`, which every layer of klpo reads, importable without torch; :data:`ESTIMATORS`,
:data:`REF_SAMPLED` and :data:`LOGPROB_ESTIMATORS` are views of it), :mod:`klpo.estimators` (the
functions and :func:`estimate`) and :mod:`klpo.explain` (:func:`explain`, derived by
enumeration). An estimator is added by its function and one :func:`register` call.

Example:
    >>> import torch
    >>> from klpo import kl
    >>> logp, logp_ref = torch.tensor([[-1.0]]), torch.tensor([[-1.5]])  # d = 0.5
    >>> kl.estimate("k3", logp, logp_ref)  # exp(-0.5) + 0.5 - 1 = 0.1065
    tensor([[0.1065]])
    >>> kl.SPECS["k3"].target, kl.explain("k3", "loss").gradient
    ('KL(pi_theta ‖ pi_ref)', 'grad KL(pi_ref ‖ pi_theta)')

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

from klpo.estimators import (
    abs_,
    abs_plus,
    estimate,
    full,
    function,
    k1,
    k1_plus,
    k2,
    k2_plus,
    k3,
    k3_is,
    k3_plus,
    kl_ref_theta,
    low_var_kl,
)
from klpo.explain import expected_value_and_gradient, explain, explain_all
from klpo.registry import (
    ESTIMATORS,
    GRAD_OTHER,
    GRAD_REF_THETA,
    GRAD_THETA_REF,
    GRAD_ZERO,
    GRADIENTS,
    LOGPROB_ESTIMATORS,
    PLACEMENTS,
    REF_SAMPLED,
    REF_THETA,
    SPECS,
    THETA_REF,
    Explanation,
    OffPolicy,
    Placement,
    Spec,
    in_loss,
    in_reward,
    refusal,
    register,
)

__all__ = [
    "ESTIMATORS",
    "GRADIENTS",
    "GRAD_OTHER",
    "GRAD_REF_THETA",
    "GRAD_THETA_REF",
    "GRAD_ZERO",
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
    "expected_value_and_gradient",
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
