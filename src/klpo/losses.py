r"""Per-token losses of policy optimisation: PPO's surrogates, the value loss, entropy, the KL terms.

Every loss here is a per-token ``[B, T]`` tensor to be *minimised*; reduce it with
:func:`klpo.reduce.reduce` and the batch's mask. Inputs, for tokens ``y_t`` sampled from the
policy ``pi_old`` that generated the batch:

- ``logp``: ``[B, T]`` log pi_theta(y_t), the policy being trained (carries the gradient);
- ``logp_old``: ``[B, T]`` log pi_old(y_t) (detached here);
- ``logp_ref``: ``[B, T]`` log pi_ref(y_t), the frozen reference (a constant);
- ``adv``: ``[B, T]`` advantages (detached here), see :mod:`klpo.advantages`.

The ratio is ``ratio = pi_theta / pi_old = exp(logp - logp_old)``. It is computed in float64
(float32 on Apple's MPS) with its exponent capped at ±700 in the value only, so a ratio is finite
and a masked or clipped token's gradient is exactly 0 instead of ``0 · inf = NaN``. Outputs are
float32 (float64 when an input is float64). verl instead clamps the log-ratio to [-20, 20], which
zeroes the gradient beyond; klpo does not clamp.

Metrics (:func:`policy_metrics`, :func:`value_metrics`, :func:`kl_metrics`, in
:mod:`klpo.loss_metrics`, named here too) are computed under
``torch.no_grad`` as token means over the loss's mask and returned as plain floats with namespaced
keys; with no valid token every metric is 0.0.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from klpo import kl
from klpo._ratios import check_per_token, kl_to_old, log_ratio
from klpo._tensor import capped_exp, check_mask, host_floats, to_out, wide_dtype
from klpo.loss_metrics import kl_metrics, policy_metrics, value_metrics
from klpo.registry import _spec

__all__ = [
    "cispo",
    "entropy_bonus",
    "gspo",
    "gspo_metrics",
    "kl_loss",
    "kl_metrics",
    "kl_reward",
    "policy_metrics",
    "ppo_clip",
    "ppo_kl_penalty",
    "sequence_log_ratio",
    "value_loss",
    "value_metrics",
]

OldKL = Literal["k1", "k3"]


# --------------------------------------------------------------------------------------------
# Policy surrogates.


def ppo_clip(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> Tensor:
    r"""PPO's clipped surrogate, per token, as a loss (Schulman et al. 2017, arXiv:1707.06347, eq. 7).

        loss_t = max(-ratio · A, -clip(ratio, 1 - clip_low, 1 + clip_high) · A)

    with separate ranges below and above 1 (DAPO's clip-higher, Yu et al. 2025,
    arXiv:2503.14476, §3.1: ``clip_low = 0.2, clip_high = 0.28``). With ``dual_clip = c > 1``
    (Ye et al. 2020, arXiv:1912.09729, eq. 5), tokens with ``A < 0`` are further bounded,
    ``loss_t = min(loss_t, -c · A)``, so a huge ratio on a bad token cannot blow the loss up
    (verl's ``clip_ratio_c``, default 3).

    Gradient with respect to ``logp``: ``-A · ratio`` where the unclipped branch is active,
    exactly 0 where a clip binds (``A > 0, ratio > 1 + clip_high``; ``A < 0, ratio < 1 -
    clip_low``; with the dual clip, ``A < 0, ratio > c``). ``logp_old`` and ``adv`` are detached.

    Args:
        logp, logp_old, adv: ``[B, T]``.
        clip_low: the lower range, in [0, 1).
        clip_high: the upper range, >= 0.
        dual_clip: ``c > 1``, or None for no dual clip.

    Returns:
        ``[B, T]`` per-token loss.

    Example:
        >>> import math, torch
        >>> from klpo import losses
        >>> logp = torch.tensor([[math.log(1.1), math.log(2.0)]], requires_grad=True)
        >>> loss = losses.ppo_clip(logp, torch.zeros(1, 2), torch.ones(1, 2))  # ratios 1.1, 2; A = 1
        >>> loss.detach()  # -1.1; -min(2, 1.2)
        tensor([[-1.1000, -1.2000]])
        >>> loss.sum().backward(); logp.grad  # -A·ratio; 0 where the clip binds
        tensor([[-1.1000,  0.0000]])
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (the bound is -c·A for A < 0), got {dual_clip!r}")
    u = log_ratio(logp, logp_old)
    check_per_token(logp, adv=adv)
    a = adv.detach().to(u.dtype)
    ratio = capped_exp(u)
    loss = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
    if dual_clip is not None:
        loss = torch.where(a < 0, torch.minimum(loss, -a * dual_clip), loss)
    return to_out(loss, logp, logp_old, adv)


def ppo_kl_penalty(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    *,
    beta: float,
    estimator: OldKL = "k3",
) -> Tensor:
    r"""PPO's adaptive-KL-penalty surrogate, per token, as a loss (Schulman et al. 2017, eq. 8).

        loss_t = -ratio · A + beta · kl_t,    kl_t ≈ KL(pi_old ‖ pi_theta) at the token's position

    The penalty is to the *previous* policy pi_old (not to pi_ref); adapt ``beta`` between
    updates with :class:`klpo.control.PPOAdaptiveKL`. ``kl_t`` is estimated from the sampled
    token y_t ~ pi_old, with ``r = pi_theta(y_t) / pi_old(y_t) = exp(u)``:

    - ``"k3"`` (default): ``(r - 1) - log r`` (Schulman 2020's k3 for KL[q, p] with q = pi_old,
      p = pi_theta): never negative, unbiased for every theta because E_old[r] = 1;
    - ``"k1"``: ``-log r = logp_old - logp``: unbiased, can be negative.

    Because the samples come from pi_old, which does not depend on theta, an estimator that is
    unbiased *for every theta* also has the right expected gradient:
    ``E_old[grad k1] = -E_old[grad logp] = grad KL(pi_old ‖ pi_theta)`` and
    ``E_old[grad k3] = E_old[(r - 1) grad logp] = E_theta[grad logp] - E_old[grad logp]``, the
    same, since ``E_theta[grad logp] = 0``. (k2 = u²/2 would not be: E_old[u²/2] is not the KL.)
    Both are proved by enumeration in the tests.

    Gradient with respect to ``logp``: ``-A · ratio + beta · (ratio - 1)`` (k3) or
    ``-A · ratio - beta`` (k1). ``logp_old`` and ``adv`` are detached.

    Args:
        logp, logp_old, adv: ``[B, T]``.
        beta: the penalty coefficient, >= 0.
        estimator: ``"k3"`` or ``"k1"``.

    Returns:
        ``[B, T]`` per-token loss.

    Example:
        >>> import math, torch
        >>> from klpo import losses
        >>> logp = torch.tensor([[math.log(2.0), 0.0]])  # ratios 2 and 1, A = 1, beta = 1/2
        >>> losses.ppo_kl_penalty(logp, torch.zeros(1, 2), torch.ones(1, 2), beta=0.5)
        tensor([[-1.8466, -1.0000]])
        >>> -2 + 0.5 * ((2 - 1) - math.log(2))  # -ratio·A + beta·k3, k3 = (r - 1) - log r
        -1.8465735902799727
    """
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    u = log_ratio(logp, logp_old)
    check_per_token(logp, adv=adv)
    a = adv.detach().to(u.dtype)
    loss = -a * capped_exp(u) + beta * kl_to_old(u, estimator)
    return to_out(loss, logp, logp_old, adv)


def sequence_log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    r"""GSPO's length-normalised log importance ratio of each sequence, ``[B]``.

        log s_i = (1 / |y_i|) sum_{t valid} (log pi_theta(y_it) - log pi_old(y_it))

    the log of the geometric mean of the per-token ratios (Zheng et al. 2025, arXiv:2507.18071). A sequence with no valid token gets 0 (s_i = 1). ``logp_old`` is detached; the
    gradient flows into ``logp``: ``d log s_i / d logp_it = 1 / |y_i|`` on valid tokens, 0 on
    masked ones. Computed in float64 (float32 on MPS).

    Args:
        logp, logp_old, mask: ``[B, T]``.

    Returns:
        ``[B]``.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> mask = torch.tensor([[True, True, False]])
        >>> losses.sequence_log_ratio(torch.tensor([[0.2, 0.4, 9.0]]), torch.zeros(1, 3), mask)
        tensor([0.3000], dtype=torch.float64)
    """
    u = log_ratio(logp, logp_old)
    check_mask(mask, logp.shape)
    n = mask.sum(-1).clamp(min=1).to(u.dtype)
    return torch.where(mask, u, 0.0).sum(-1) / n


def gspo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> Tensor:
    r"""GSPO's sequence-level clipped surrogate, written per token (Zheng et al. 2025, arXiv:2507.18071).

    GSPO (Group Sequence Policy Optimization) clips one importance ratio per
    sequence, the length-normalised one of :func:`sequence_log_ratio`:

        s_i = (pi_theta(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|)
        J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)

    Here it is written in the paper's "GSPO-token" form, so that the loss is a per-token
    ``[B, T]`` tensor like every other surrogate:

        s_it = sg(s_i) · pi_theta(y_it) / sg(pi_theta(y_it))       (value s_i, gradient s_i ∇log pi)
        loss_t = max(-s_it A_t, -clip(s_it, 1 - clip_low, 1 + clip_high) A_t)

    Every valid token of sequence i carries the value of the sequence's loss, and with the
    sequence's own advantage at every token (GRPO's broadcast) reducing with
    ``seq-mean-token-mean`` gives exactly GSPO's objective and gradient:
    ``∇ loss_i = -A_i s_i (1/|y_i|) sum_t ∇ log pi_theta(y_it)`` where the clip does not bind,
    and 0 for the whole sequence where it binds (``A_i > 0, s_i > 1 + clip_high`` or
    ``A_i < 0, s_i < 1 - clip_low``). With ``token-mean`` each sequence is weighted by its
    length instead. Per token, the gradient is the token form's, not the derivative of the
    token's value (which would spread d s_i over the sequence); only the reduced objective is
    both. The default ranges are the paper's (3e-4 below, 4e-4 above): a per-token
    range of 0.2 is far too wide for a geometric mean of ratios. ``logp_old`` and ``adv`` are
    detached; masked tokens get value and gradient 0.

    Args:
        logp, logp_old, adv, mask: ``[B, T]``.
        clip_low: in [0, 1).
        clip_high: >= 0.

    Returns:
        ``[B, T]`` per-token loss, 0 at masked tokens.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> logp = torch.zeros(1, 2, requires_grad=True)  # s = 1, A = 1 at both tokens
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> loss = losses.gspo(logp, torch.zeros(1, 2), torch.ones(1, 2), mask)
        >>> loss.detach()  # -s·A at every token
        tensor([[-1., -1.]])
        >>> loss.sum().backward(); logp.grad  # -A·s per token (the token form)
        tensor([[-1., -1.]])
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    check_per_token(logp, adv=adv)
    log_s = sequence_log_ratio(logp, logp_old, mask)  # [B]
    u = log_ratio(logp, logp_old)
    # value log s_i, gradient d log pi_theta(y_it): GSPO-token.
    log_s_tok = log_s.detach()[:, None] + (u - u.detach())
    s_tok = capped_exp(log_s_tok)
    a = adv.detach().to(u.dtype)
    loss = torch.maximum(-a * s_tok, -a * s_tok.clamp(1.0 - clip_low, 1.0 + clip_high))
    return to_out(torch.where(mask, loss, 0.0), logp, logp_old, adv)


def gspo_metrics(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> dict[str, float]:
    r"""GSPO's sequence-level diagnostics, under ``no_grad``, means over sequences with a token.

    Keys: ``clip_frac/seq`` (sequences whose clip binds: ``A_i > 0, s_i > 1 + clip_high`` or
    ``A_i < 0, s_i < 1 - clip_low``; ``A_i`` is the mean advantage over the sequence's tokens),
    ``ratio/seq_mean`` (mean of s_i).

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> mask = torch.ones(1, 2, dtype=torch.bool)  # s = exp(0.1) = 1.1052 > 1 + 4e-4 with A > 0
        >>> logp, adv = torch.full((1, 2), 0.1), torch.ones(1, 2)
        >>> m = losses.gspo_metrics(logp, torch.zeros(1, 2), adv, mask)
        >>> {k: round(v, 4) for k, v in m.items()}
        {'clip_frac/seq': 1.0, 'ratio/seq_mean': 1.1052}
    """
    with torch.no_grad():
        s = torch.exp(sequence_log_ratio(logp, logp_old, mask))
        rows = mask.any(-1)
        n = mask.sum(-1).clamp(min=1)
        a = torch.where(mask, adv.detach().double(), 0.0).sum(-1) / n
        clipped = ((a > 0) & (s > 1 + clip_high)) | ((a < 0) & (s < 1 - clip_low))
        k = rows.sum().clamp(min=1)
        out = {
            "clip_frac/seq": torch.where(rows, clipped.double(), 0.0).sum() / k,
            "ratio/seq_mean": torch.where(rows, s.double(), 0.0).sum() / k,
        }
    return host_floats(out)


def cispo(
    logp: Tensor,
    logp_old: Tensor,
    adv: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float = 0.2,
) -> Tensor:
    r"""CISPO: a clipped, stop-gradient importance weight on the log-prob (MiniMax-M1, arXiv:2506.13585).

    CISPO (Clipped IS-weight Policy Optimization, MiniMax 2025) clips the
    importance weight instead of the update, so that no token's gradient is dropped:

        r_t = pi_theta(y_t) / pi_old(y_t),    r̂_t = clip(r_t, 1 - clip_low, 1 + clip_high)
        loss_t = -sg(r̂_t) · A_t · log pi_theta(y_t)

    Gradient with respect to ``logp``: ``-r̂_t A_t`` at every token, including those where the
    clip binds (PPO's clip would give 0 there); the weight itself is detached. The value is
    ``-r̂·A·logp``, which is not a surrogate of the return (its size follows logp); only its
    gradient means something. ``clip_low = None`` is MiniMax's choice (no lower bound; they set
    ε_low large); ``clip_high`` is their tuned ε_high. Reduce with ``token-mean`` for the
    paper's objective (it normalises by the batch's total token count).

    Args:
        logp, logp_old, adv: ``[B, T]``.
        clip_low: in [0, 1), or None for no lower bound.
        clip_high: >= 0.

    Returns:
        ``[B, T]`` per-token loss.

    Example:
        >>> import math, torch
        >>> from klpo import losses
        >>> logp = torch.tensor([[math.log(2.0) - 1.0]], requires_grad=True)  # ratio 2 to -1
        >>> loss = losses.cispo(logp, torch.tensor([[-1.0]]), torch.tensor([[1.0]]))
        >>> loss.detach()  # -clip(2, max 1.2) · A · logp = -1.2 · (log 2 - 1)
        tensor([[0.3682]])
        >>> loss.sum().backward(); logp.grad  # -1.2 · A: the clipped token keeps its gradient
        tensor([[-1.2000]])
    """
    if clip_low is not None and not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) or None, got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    u = log_ratio(logp, logp_old)
    check_per_token(logp, adv=adv)
    a = adv.detach().to(u.dtype)
    w = capped_exp(u.detach())
    w = w.clamp(min=1.0 - clip_low if clip_low is not None else None, max=1.0 + clip_high)
    loss = -w * a * logp.to(u.dtype)
    return to_out(loss, logp, logp_old, adv)


# --------------------------------------------------------------------------------------------
# Value loss and entropy.


def value_loss(
    values: Tensor, values_old: Tensor, returns: Tensor, *, clip: float | None = None
) -> Tensor:
    r"""The critic's squared error, optionally clipped around the old values (PPO2's value clip).

        loss_t = ½ (V_t - R_t)²                                             (clip = None)
        loss_t = ½ max((V_t - R_t)², (clamp(V_t, V_old - c, V_old + c) - R_t)²)   (clip = c)

    The clipped form is OpenAI baselines' ``ppo2`` and verl's ``compute_value_loss`` (with its
    ½). Gradient with respect to ``values``: ``V_t - R_t`` where the unclipped term is the max,
    ``clamp(V) - R`` times the clamp's derivative (1 inside, 0 outside the range) where the
    clipped one is. ``values_old`` and ``returns`` (targets) are detached.

    Args:
        values: ``[B, T]`` the critic's current predictions (carry the gradient).
        values_old: ``[B, T]`` its predictions at rollout time.
        returns: ``[B, T]`` the targets, e.g. from :func:`klpo.advantages.gae`.
        clip: ``c > 0``, or None.

    Returns:
        ``[B, T]`` per-token loss.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> values, returns = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 3.0]])
        >>> old = torch.zeros(1, 2)
        >>> losses.value_loss(values, old, returns)  # ½ (V - R)²
        tensor([[0.5000, 0.5000]])
        >>> losses.value_loss(values, old, returns, clip=0.5)  # ½ max(1, (0.5 - 3)²) at 2nd
        tensor([[0.5000, 3.1250]])
    """
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise TypeError("values must be a float tensor")
    check_per_token(values, values_old=values_old, returns=returns)
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    wide = wide_dtype(values)
    v, ret = values.to(wide), returns.detach().to(wide)
    loss = (v - ret) ** 2
    if clip is not None:
        v_old = values_old.detach().to(wide)
        clipped = torch.clamp(v, v_old - clip, v_old + clip)
        loss = torch.maximum(loss, (clipped - ret) ** 2)
    return to_out(0.5 * loss, values, values_old, returns)


def entropy_bonus(entropy: Tensor) -> Tensor:
    r"""The entropy bonus as a loss: ``-H_t`` per token (add ``coef · entropy_bonus(H)``).

    ``H_t = -sum_v pi(v) log pi(v)`` is the exact per-token entropy of the policy's next-token
    distribution (``klpo.logprobs.entropy(logits)``); minimising ``-H`` raises it (Mnih et al.
    2016, arXiv:1602.01783; PPO eq. 9). Gradient with respect to the logits:
    ``pi ⊙ (log pi + H)``.

    Args:
        entropy: ``[B, T]`` per-token entropies (carry the gradient).

    Returns:
        ``[B, T]``.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> losses.entropy_bonus(torch.tensor([[0.7, 0.1]]))
        tensor([[-0.7000, -0.1000]])
    """
    if not isinstance(entropy, Tensor) or not entropy.is_floating_point():
        raise TypeError("entropy must be a float tensor of per-token entropies [B, T]")
    return to_out(-entropy, entropy)


# --------------------------------------------------------------------------------------------
# The KL to the reference: in the loss, in the reward.


def kl_loss(
    name: str,
    logp: Tensor | None,
    logp_ref: Tensor | None,
    *,
    logp_old: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    mask: Tensor | None = None,
    cap: float | None = None,
) -> Tensor:
    r"""The KL term of the loss, per token, corrected for tokens sampled from pi_old.

    On-policy (y ~ pi_theta) the loss term ``est`` of :func:`klpo.kl.estimate` follows the
    expected gradient ``E_theta[grad est]`` that ``klpo.kl.explain(name, "loss")`` states. After
    the first PPO epoch the tokens come from pi_old ≠ pi_theta; to keep that same expected
    gradient (and expected value), each term is importance-weighted with a *detached* weight:

        kl_loss_t = sg(w_t) · est_t,    w_t = pi_theta(y_t) / pi_old(y_t) = exp(logp - logp_old)

    since ``E_old[sg(w) grad est] = sum_y pi_old(y) (pi_theta(y)/pi_old(y)) grad est(y) =
    E_theta[grad est]`` (Liu et al. 2025, arXiv:2510.01555, "a principled correction").
    The rule is the estimator's own, :attr:`klpo.kl.Spec.off_policy`: ``"weighted"`` as above,
    and two that differ:

    - ``"carried"`` (``k3_is``): it already is ``w · k3`` with the gradient flowing through
      ``w``; its expected gradient over y ~ pi_old is grad KL(pi_theta ‖ pi_ref), what it
      promises on-policy. It is returned as is (no second weight).
    - ``"none"`` (``full``): the exact KL over the vocabulary at the position; its value does not
      depend on the sampled token, so there is nothing to reweight (a weight would have
      expectation 1 and only add variance). Returned as is.

    The correction is per token: the *prefix* was also generated by pi_old, which no per-token
    weight repairs (as for PPO's own per-token ratio). ``w`` is not clipped unless ``cap``
    ``C`` is given: then the weight is ``sg(min(w, C))`` (truncated importance sampling, as
    OpenRLHF's ``unbiased_gradient``), and ``k3_is`` is scaled by ``sg(min(w, C) / w)``, so that
    its gradient is ``min(w, C) · (logp - logp_ref) · grad logp``; ``full`` is untouched. The
    cap biases the expected gradient only where some ``w > C`` (``klpo explain --staleness``).

    Args:
        name: one of :data:`klpo.kl.ESTIMATORS`.
        logp: ``[B, T]`` log pi_theta of the sampled tokens (carries the gradient); ignored by
            ``full``.
        logp_ref: ``[B, T]`` log pi_ref of the same tokens; ignored by ``full``.
        logp_old: ``[B, T]`` log pi_old, the sampling policy (detached); None means on-policy
            (``logp.detach()``: w = 1).
        logits, logits_ref: ``[B, T, V]``, for ``full``.
        mask: optional ``[B, T]`` bool, True where a token takes part: the inputs must be finite
            there (:func:`klpo.kl.estimate` raises otherwise); elsewhere they may hold any
            padding. Without it every position must be finite.
        cap: the weight's cap ``C > 0``, or None (no cap).

    Returns:
        ``[B, T]``; multiply by beta and reduce like the policy loss (with the mask).

    Example:
        >>> import math, torch
        >>> from klpo import losses
        >>> logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> losses.kl_loss("k3", logp, logp_ref)  # on-policy: k3 itself
        tensor([[0.1065, 0.7183]])
        >>> losses.kl_loss("k3", logp, logp_ref, logp_old=logp - math.log(2.0))  # sg(w) = 2
        tensor([[0.2131, 1.4366]])
        >>> losses.kl_loss("k3", logp, logp_ref, logp_old=logp - math.log(2.0), cap=1.5)
        tensor([[0.1598, 1.0774]])
    """
    if cap is not None and not cap > 0:
        raise ValueError(f"the weight's cap must be > 0 (or None for no cap), got {cap!r}")
    rule = _spec(name).off_policy  # (ValueError naming the estimators for an unknown one)
    if rule == "none":
        return kl.estimate(name, logp, logp_ref, logits=logits, logits_ref=logits_ref, mask=mask)
    if logp is None or logp_ref is None:
        raise ValueError(f"estimator {name!r} needs logp and logp_ref ([B, T] token log-probs)")
    logp_old = logp.detach() if logp_old is None else logp_old
    est = kl.estimate(name, logp, logp_ref, logp_old=logp_old.detach(), mask=mask)
    if rule == "carried" and cap is None:
        return est
    u = log_ratio(logp, logp_old).detach()
    weight = _OFF_POLICY_WEIGHTS[rule](u, cap)
    return to_out(weight * est.to(u.dtype), logp, logp_ref, logp_old)


def _importance_weight(u: Tensor, cap: float | None) -> Tensor:
    """``"weighted"``: ``sg(w)``, or ``sg(min(w, C))`` under a cap, from ``u = sg(log w)``."""
    w = capped_exp(u)
    return w if cap is None else w.clamp(max=cap)


def _cap_scale(u: Tensor, cap: float) -> Tensor:
    """``"carried"`` under a cap: ``sg(min(w, C) / w) = sg(min(1, C / w))``."""
    return torch.exp(torch.clamp(math.log(cap) - u, max=0.0))


_OFF_POLICY_WEIGHTS = {"weighted": _importance_weight, "carried": _cap_scale}
""":func:`kl_loss`'s factor on the estimate by the estimator's off-policy rule
(:attr:`klpo.kl.Spec.off_policy`; ``"none"`` takes none, nor does ``"carried"`` without a cap)."""


def kl_reward(
    rewards: Tensor,
    logp: Tensor | None,
    logp_ref: Tensor | None,
    mask: Tensor,
    *,
    beta: float,
    estimator: str = "k1",
    logp_old: Tensor | None = None,
    logits: Tensor | None = None,
    logits_ref: Tensor | None = None,
    estimate: Tensor | None = None,
) -> Tensor:
    r"""KL in the reward: ``rewards_t - beta · sg(est_t)`` on the valid tokens (classic RLHF shaping).

    The per-token penalty of Ziegler et al. 2019 (arXiv:1909.08593) and InstructGPT, k1 by
    default: ``r_t - beta · (log pi(y_t) - log pi_ref(y_t))``, computed at rollout time from the
    sampling policy's log-probs and **detached**. Use it before :func:`klpo.advantages.gae`,
    :func:`~klpo.advantages.returns_to_go` or :func:`~klpo.advantages.reinforce_pp` (per token),
    or sum it over each sequence before the group estimators. With returns-to-go, k1 in the
    reward follows grad KL(pi_theta ‖ pi_ref) of the whole sequence (``klpo.kl.explain(name,
    "reward")`` gives the per-token answer for every estimator).

    Args:
        rewards: ``[B, T]`` per-token rewards (a task reward at the last valid token).
        logp: ``[B, T]`` log-probs of the sampled tokens under the sampling policy.
        logp_ref: ``[B, T]`` log pi_ref of the same tokens.
        mask: ``[B, T]`` bool.
        beta: the coefficient, >= 0 (e.g. a controller's ``.value``).
        estimator: one of :data:`klpo.kl.ESTIMATORS`.
        logp_old: for ``k3_is`` (default ``logp``: at rollout time the policy is pi_old).
        logits, logits_ref: ``[B, T, V]``, for ``full``.
        estimate: ``[B, T]`` the per-token estimate already computed (e.g. ``full`` from
            :func:`klpo.logprobs.fused`, which never builds the logits); then ``estimator``,
            ``logp``, ``logp_ref`` and the logits are not used.

    Returns:
        ``[B, T]`` shaped rewards, 0 at masked tokens; detached.

    Example:
        >>> import torch
        >>> from klpo import losses
        >>> logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
        >>> mask = torch.ones(1, 2, dtype=torch.bool)
        >>> rewards = torch.tensor([[0.0, 1.0]])
        >>> losses.kl_reward(rewards, logp, logp_ref, mask, beta=0.1)  # r - 0.1·d
        tensor([[-0.0500,  1.1000]])
    """
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta!r}")
    if not isinstance(rewards, Tensor) or not rewards.is_floating_point():
        raise TypeError("rewards must be a float tensor [B, T]")
    check_mask(mask, rewards.shape)
    with torch.no_grad():
        if logp_old is None and logp is not None:
            logp_old = logp
        if estimate is not None:
            est = estimate.detach()
        else:
            est = kl.estimate(
                estimator,
                logp,
                logp_ref,
                logp_old=logp_old,
                logits=logits,
                logits_ref=logits_ref,
                mask=mask,
            )
        if est.shape != rewards.shape:
            raise ValueError(
                f"the KL estimate has shape {tuple(est.shape)} but rewards {tuple(rewards.shape)}"
            )
        f64 = torch.float64 in (est.dtype, rewards.dtype)
        r = rewards.detach().to(torch.float64 if f64 else torch.float32)
        out = torch.where(mask, r - beta * est.to(r.dtype), 0.0)
    return out
