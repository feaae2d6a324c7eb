r"""KL(pi_theta ‖ pi_ref) estimated from samples of the **reference**: ``ref_is`` and ``adaptive_mix``.

Every estimator of :mod:`klpo.kl` reads tokens the policy sampled. These two also need
completions drawn from pi_ref for the same prompts, so they are not per-token functions of the
rollout and are kept apart (:data:`klpo.kl.REF_SAMPLED`); ``klpo explain`` knows them.

``ref_is`` (importance sampling from the reference). For x ~ pi_ref (a whole completion) and the
weight ``w = pi_theta(x) / pi_ref(x)``,

    ref_is = mean_i w_i log w_i,       E_ref[w log w] = sum_x pi_theta(x) log(pi_theta(x) / pi_ref(x))
                                                      = KL(pi_theta ‖ pi_ref),

unbiased, and, with the samples held fixed (pi_ref does not depend on theta), its expected
gradient is exactly grad KL(pi_theta ‖ pi_ref), even for whole sequences:
``grad(w log w) = w (1 + log w) grad log pi_theta(x)`` and ``sum_x pi_ref w (1 + log w) grad log
pi_theta = sum_x pi_theta (1 + log w) grad log pi_theta = grad KL``. Options, each biased:

- ``clip=(lo, hi)``: ``clamp(w, lo, hi) · log w``; where the clamp bites w is a constant and only
  ``clamp(w) · grad log w`` remains;
- ``dynamic_clip``: clamp w to the batch's mean ± 3 sd of the weights (after ``clip``); the bounds
  are functions of the whole batch and carry its gradient;
- ``self_normalised``: ``sum_i w_i log w_i / sum_i w_i`` (a ratio estimator, bias O(1/n)).

Its variance grows like the second moment of w: for N(0, 1) against N(mu, 1) it is
``e^{mu²}(mu² + 9 mu⁴ / 4) - mu⁴ / 4``, above k1's ``mu²`` for every mu ≠ 0 (see ``docs/estimators.md``).

``adaptive_mix``: ``a · k1 + (1 - a) · ref_is``, ``a = sigmoid(s · gamma · (KL_window - threshold))``
with ``KL_window`` the mean of the mix's last ``window`` outputs (an empty window counts as 0)
and gamma > 0. The source text writes ``s = +1`` (``"as-written"``: the weight on k1 *grows*
with the KL), while its prose asks for the reverse, more k1 while the KL is small (``s = -1``,
``"as-described"``). The weight depends only on past batches, so the mix of two unbiased
estimates is unbiased; in the loss k1's expected gradient is zero (:func:`klpo.kl.explain`), so
the mix follows ``(1 - a) · grad KL(pi_theta ‖ pi_ref)``.

Reference: the importance-sampling identity E_q[(p/q) f] = E_p[f] (e.g. Owen, "Monte Carlo theory,
methods and examples", 2013, ch. 9, which also gives Kish's effective sample size
``(sum w)² / sum w²`` used by :func:`weight_diagnostics`); J. Schulman, "Approximating KL
Divergence" (2020) for k1.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import torch
from torch import Tensor

from klpo import kl

__all__ = [
    "MIX_SIGNS",
    "MixWindow",
    "mix_weight",
    "ref_is",
    "ref_is_terms",
    "weight_diagnostics",
]

MixSign = Literal["as-written", "as-described"]
MIX_SIGNS: tuple[str, ...] = ("as-written", "as-described")


def _check_clip(clip: tuple[float, float] | None) -> None:
    if clip is not None and not (0.0 <= clip[0] < clip[1]):
        raise ValueError(f"clip must be (lo, hi) with 0 <= lo < hi, got {tuple(clip)}")


def ref_is_terms(
    logp: Tensor, logp_ref: Tensor, *, clip: tuple[float, float] | None = None
) -> Tensor:
    r"""Per-sample ``clip(w) · log w`` for samples x ~ pi_ref, ``w = pi_theta(x) / pi_ref(x)``.

    Args:
        logp: ``[...]`` log pi_theta(x) of samples drawn from **pi_ref** (for a completion, the
            sum of its token log-probs); differentiable.
        logp_ref: ``[...]`` log pi_ref(x) of the same samples; a constant (no gradient).
        clip: optional ``(lo, hi)`` clamp of the weight (the gradient through w is zero where it
            bites).

    Returns:
        ``[...]``, float32 (float64 for float64 inputs: ``log w`` is :func:`klpo.kl.k1`'s, in
        its dtype). Unclipped, its mean over x ~ pi_ref is KL(pi_theta ‖ pi_ref) and its
        expected gradient grad KL(pi_theta ‖ pi_ref).

    Example:
        >>> import torch
        >>> from klpo import ref_kl
        >>> # two samples of pi_ref: w = 0.5/0.25 = 2 and 1/2; w log w = 2 log 2, -(log 2)/2
        >>> logp, logp_ref = torch.tensor([0.5, 0.25]).log(), torch.tensor([0.25, 0.5]).log()
        >>> ref_kl.ref_is_terms(logp, logp_ref)
        tensor([ 1.3863, -0.3466])
    """
    _check_clip(clip)
    log_w = kl.estimate("k1", logp, logp_ref)  # log w = logp - logp_ref, upcast
    w = log_w.exp()
    if clip is not None:
        w = w.clamp(clip[0], clip[1])
    return w * log_w


def ref_is(
    logp: Tensor,
    logp_ref: Tensor,
    *,
    clip: tuple[float, float] | None = None,
    dynamic_clip: bool = False,
    self_normalised: bool = False,
    dim: int = -1,
) -> Tensor:
    r"""The batch estimate of KL(pi_theta ‖ pi_ref) from n samples of pi_ref along ``dim``.

    ``mean_i clip(w_i) log w_i``; with ``dynamic_clip`` each weight is also clamped to the batch's
    ``mean ± 3 sd`` of the weights; with ``self_normalised`` the result is
    ``sum_i w_i log w_i / sum_i w_i``. See the module docstring for bias and gradient.

    Args:
        logp, logp_ref: ``[..., n]`` as :func:`ref_is_terms`.

    Returns:
        ``[...]`` one estimate per batch, differentiable with respect to ``logp``.

    Example:
        >>> import torch
        >>> from klpo import ref_kl
        >>> logp, logp_ref = torch.tensor([0.5, 0.25]).log(), torch.tensor([0.25, 0.5]).log()
        >>> ref_kl.ref_is(logp, logp_ref)  # (2 log 2 - (log 2)/2) / 2
        tensor(0.5199)
        >>> ref_kl.ref_is(logp, logp_ref, self_normalised=True)  # the same sum over sum w = 2.5
        tensor(0.4159)
    """
    _check_clip(clip)
    log_w = kl.estimate("k1", logp, logp_ref)
    w = log_w.exp()
    if clip is not None:
        w = w.clamp(clip[0], clip[1])
    if dynamic_clip:
        mean = w.mean(dim, keepdim=True)
        sd = w.std(dim, keepdim=True, correction=0)
        w = torch.minimum(torch.maximum(w, mean - 3 * sd), mean + 3 * sd)
    if self_normalised:
        return (w * log_w).sum(dim) / w.sum(dim)
    return (w * log_w).mean(dim)


def weight_diagnostics(logp: Tensor, logp_ref: Tensor) -> dict[str, float]:
    r"""The importance weights' health: the largest weight and Kish's effective sample size.

    ``max_weight = max_i w_i`` and ``ess = (sum_i w_i)² / (n · sum_i w_i²)`` in (0, 1] (1 when all
    weights are equal, 1/n when one dominates), with ``w = exp(logp - logp_ref)`` of ``[n]``
    samples of pi_ref, computed from log-weights (shifted by their maximum, so no overflow).
    No gradient.

    Example:
        >>> import torch
        >>> from klpo import ref_kl
        >>> logp, logp_ref = torch.tensor([0.5, 0.25]).log(), torch.tensor([0.25, 0.5]).log()
        >>> d = ref_kl.weight_diagnostics(logp, logp_ref)
        >>> round(d["max_weight"], 4), round(d["ess"], 4)  # w = 2, 1/2: 2.5² / (2 · 4.25)
        (2.0, 0.7353)
    """
    with torch.no_grad():
        log_w = kl.estimate("k1", logp, logp_ref).flatten()
        if log_w.numel() == 0:
            return {"max_weight": math.nan, "ess": math.nan}
        top = log_w.max()
        w = (log_w - top).exp()
        ess = w.sum() ** 2 / (log_w.numel() * (w * w).sum())
        return {"max_weight": float(top.exp()), "ess": float(ess)}


def mix_weight(kl_window: float, *, gamma: float, threshold: float, sign: MixSign) -> float:
    r"""``a = sigmoid(s · gamma · (kl_window - threshold))``, the weight ``adaptive_mix`` puts on k1.

    ``s = +1`` for ``"as-written"`` (a grows with the KL), ``-1`` for ``"as-described"``
    (a shrinks as the KL grows, as the source's prose says). ``gamma`` must be > 0.

    Example:
        >>> from klpo import ref_kl
        >>> ref_kl.mix_weight(0.1, gamma=10.0, threshold=0.1, sign="as-written")  # sigmoid(0)
        0.5
        >>> round(ref_kl.mix_weight(0.2, gamma=10.0, threshold=0.1, sign="as-written"), 4)  # σ(1)
        0.7311
        >>> round(ref_kl.mix_weight(0.2, gamma=10.0, threshold=0.1, sign="as-described"), 4)
        0.2689
    """
    if sign not in MIX_SIGNS:
        raise ValueError(f"unknown mix sign {sign!r}; choose one of: {', '.join(MIX_SIGNS)}")
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0 (the sign is set by sign=), got {gamma}")
    x = (1.0 if sign == "as-written" else -1.0) * gamma * (kl_window - threshold)
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


class MixWindow:
    """The state of ``adaptive_mix``: its last ``window`` outputs, whose mean is ``KL_window``.

    ``weight()`` is a for the next batch (from past batches only); ``push(value)`` records the
    mix's output of that batch. An empty window counts as KL = 0 (the policy starts at the
    reference). ``state_dict`` / ``load_state_dict`` let a resumed run continue exactly.
    """

    def __init__(
        self, *, gamma: float, threshold: float, window: int, sign: MixSign = "as-written"
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        mix_weight(0.0, gamma=gamma, threshold=threshold, sign=sign)  # validates gamma, sign
        self.gamma, self.threshold, self.sign = gamma, threshold, sign
        self.values: deque[float] = deque(maxlen=window)

    @property
    def kl_window(self) -> float:
        return sum(self.values) / len(self.values) if self.values else 0.0

    def weight(self) -> float:
        return mix_weight(
            self.kl_window, gamma=self.gamma, threshold=self.threshold, sign=self.sign
        )

    def push(self, value: float) -> None:
        self.values.append(float(value))

    def state_dict(self) -> dict[str, list[float]]:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        self.values.clear()
        self.values.extend(float(v) for v in state["values"])
