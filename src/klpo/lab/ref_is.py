r"""Two estimators that need samples of the reference: ``ref_is`` and ``adaptive_mix``.

They come from a widely shared interview-preparation answer, quoted in docs/claims.md, where they
are called "K2" and "K3". They are **not** Schulman's k2 and k3 (see :mod:`klpo.kl`); the lab implements them under
their own names and measures them.

``ref_is`` (importance sampling from the reference). With x ~ pi_ref and the weight
``w = pi_theta(x) / pi_ref(x)``,

    ref_is = mean_i  w_i · log w_i,      E_ref[w log w] = sum_x pi_theta(x) log(pi_theta(x)/pi_ref(x))
                                                       = KL(pi_theta ‖ pi_ref),

so the plain version is **unbiased** (the seed text says it is biased). Its variance grows with
the weights: for N(0, 1) vs N(mu, 1) it is ``e^{mu²} (mu² + 9 mu⁴ / 4) - mu⁴ / 4 > mu² = Var k1``.
Options, each making it biased:

- ``clip=(lo, hi)``: ``clamp(w, lo, hi) · log w`` (the seed suggests [0.1, 10]);
- ``dynamic_clip``: clamp w to the batch's mean ± 3 sd of the weights;
- ``self_normalised``: ``sum_i w_i log w_i / sum_i w_i`` (ratio estimator, bias O(1/n)).

Gradient: the samples come from pi_ref, which does not depend on theta, so differentiating the
unclipped estimate with the samples held fixed gives ``E_ref[grad(w log w)] = grad KL(pi_theta ‖
pi_ref)`` exactly: in the loss, plain ``ref_is`` follows the right gradient, even for whole
sequences. ``grad(w log w) = w (1 + log w) grad log pi_theta(x)``; where a clip bites, w is a
constant and only ``clamp(w) · grad log w`` remains.

``adaptive_mix`` (the answer's "K3"): ``a · k1 + (1 - a) · ref_is`` with
``a = sigmoid(gamma · (KL_window - threshold))``, ``KL_window`` the mean of the last ``window``
outputs of the mix itself (an empty window counts as KL = 0: the policy starts at the reference).
With gamma > 0, as written, the weight on k1 *grows* with the KL, the opposite of the answer's prose
("favour K1 when the KL is small"); gamma < 0 gives the prose's behaviour. Both components are
unbiased, and a depends only on past batches, so the plain mix is unbiased too.

``ref_is`` is the library's (:mod:`klpo.ref_kl`, which the trainer uses too), re-exported here;
this module adds the lab's settings of the mix and its stream over many runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from klpo.ref_kl import ref_is, ref_is_terms

__all__ = [
    "SEED_CLIP",
    "AdaptiveMix",
    "AdaptiveMixStream",
    "adaptive_mix",
    "ref_is",
    "ref_is_terms",
]

SEED_CLIP: tuple[float, float] = (0.1, 10.0)
"""The weight clip the seed text suggests."""


@dataclass(frozen=True)
class AdaptiveMix:
    """Settings of ``adaptive_mix`` (the seed gives none; these are the lab's defaults).

    Attributes:
        gamma: the sigmoid's slope, per nat. Positive as written in the seed (more k1 at high KL);
            negative gives its prose (more k1 at low KL).
        threshold: the KL (nats) at which a = 1/2.
        window: how many past outputs of the mix ``KL_window`` averages.
    """

    gamma: float = 10.0
    threshold: float = 0.5
    window: int = 10

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def weight(self, kl_window: float) -> float:
        """a = sigmoid(gamma · (kl_window - threshold)), the weight on k1."""
        x = self.gamma * (kl_window - self.threshold)
        if x >= 0:
            return 1.0 / (1.0 + math.exp(-x))
        e = math.exp(x)
        return e / (1.0 + e)


class AdaptiveMixStream:
    r"""The state of ``adaptive_mix`` along a stream of batches: the window of its past outputs.

    At step s: ``KL_window_s`` = mean of the mix's outputs at steps ``max(0, s - window) .. s - 1``
    (0 at s = 0), ``a_s = sigmoid(gamma (KL_window_s - threshold))``, and
    ``mix_s = a_s · k1_s + (1 - a_s) · ref_is_s``. The weight uses past batches only.

    Args:
        settings: gamma, threshold and window.
        runs: the shape of independent runs advanced together (``()`` for one stream).
    """

    def __init__(self, settings: AdaptiveMix = AdaptiveMix(), runs: tuple[int, ...] = ()) -> None:
        self.settings = settings
        self._ring = np.zeros((*runs, settings.window))
        self._total = np.zeros(runs)
        self._steps = 0

    def step(self, k1_means: Tensor, ref_is_means: Tensor) -> tuple[Tensor, Tensor]:
        """Advance by S steps: ``[*runs, S]`` batch means in, ``(a, mix)`` ``[*runs, S]`` out.

        Args:
            k1_means: the batch means of k1 (samples of pi_theta) at each step.
            ref_is_means: the batch estimates of ref_is (samples of pi_ref) at each step.
        """
        if k1_means.shape != ref_is_means.shape:
            raise ValueError(
                f"k1_means {tuple(k1_means.shape)} and ref_is_means "
                f"{tuple(ref_is_means.shape)} must have the same shape"
            )
        if tuple(k1_means.shape[:-1]) != self._total.shape:
            raise ValueError(
                f"expected [*runs, S] with runs = {self._total.shape}, got {tuple(k1_means.shape)}"
            )
        k1_np = k1_means.detach().to(torch.float64).cpu().numpy()
        ris_np = ref_is_means.detach().to(torch.float64).cpu().numpy()
        gamma, threshold, window = (
            self.settings.gamma,
            self.settings.threshold,
            self.settings.window,
        )
        a = np.empty_like(k1_np)
        mix = np.empty_like(k1_np)
        ring, total = self._ring, self._total
        for i in range(k1_np.shape[-1]):
            s = self._steps
            filled = min(s, window)
            kl_window = total / filled if filled else np.zeros_like(total)
            a_s = 0.5 * (1.0 + np.tanh(0.5 * gamma * (kl_window - threshold)))  # sigmoid
            m_s = a_s * k1_np[..., i] + (1.0 - a_s) * ris_np[..., i]
            slot = s % window
            if s >= window:
                total = total - ring[..., slot]
            ring[..., slot] = m_s
            total = total + m_s
            a[..., i], mix[..., i] = a_s, m_s
            self._steps += 1
        self._total = total
        return torch.from_numpy(a), torch.from_numpy(mix)


def adaptive_mix(
    k1_means: Tensor, ref_is_means: Tensor, settings: AdaptiveMix = AdaptiveMix()
) -> tuple[Tensor, Tensor]:
    r"""Run ``adaptive_mix`` from an empty window along a stream of batches.

    Args:
        k1_means: ``[..., S]`` the batch means of k1 (samples of pi_theta) at each step.
        ref_is_means: ``[..., S]`` the batch estimates of ref_is (samples of pi_ref).
        settings: gamma, threshold and window.

    Returns:
        ``(a [..., S], mix [..., S])``: the weight on k1 and the estimate at each step; the
        leading dimensions are independent runs. See :class:`AdaptiveMixStream`.
    """
    return AdaptiveMixStream(settings, tuple(k1_means.shape[:-1])).step(k1_means, ref_is_means)
