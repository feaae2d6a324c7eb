"""The forward-pass gradient: when the update takes its gradient inside the head's forward pass.

On-policy, with a KL term that is exact or absent and no engine weights, a micro-batch's loss
weights on each token's log-prob, entropy and exact KL are known before the forward pass
(:func:`on_policy_weights`), so :func:`klpo.logprobs.fused_loss` can take the gradient there
instead of :func:`klpo.logprobs.fused` keeping what the backward needs: the same gradients and
metrics. ``algo.fused_loss`` chooses it (:func:`takes_fused_loss`): ``auto`` from
:data:`FUSED_LOSS_MIN_VOCAB` vocabulary entries; ``on`` wherever it applies; ``off`` never. A
teacher's divergence in the loss (``teacher.placement: loss``, the exact forms) is weighted by
the reduction alone (:func:`reduction_weights`), so the same switch takes its gradient in the
forward pass too (:func:`klpo.teacher.from_hidden_loss`, :mod:`klpo.train.step.teacher_term`).

The head alone gains from it where the head is large: at V = 32000 (H = 896) fused_loss took
0.27 s against fused's 0.36 for log-probs and 0.22 against 0.30-0.32 for the exact KL
(docs/performance.md). In the trainer's micro-step (``bench/trainer_parts.py``, exact KL) it
costs at small vocabularies: 65.7 ms against 61.9 at V = 101 (the shipped model); and is even
elsewhere on a CPU: 4.50 s against 4.55 at V = 8195 (the compute-bound benchmark's model, wall
time) and 12.61 CPU-s against 12.60 at V = 151,936 (workload (c), 1024 completion tokens, one
thread). So ``auto`` takes it only at real vocabularies, where it was never slower; whether it
pays there on a GPU is ``bench/gpu_check.sh``'s on / off stage.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from klpo import losses
from klpo.train.algorithms import POLICY_LOSSES
from klpo.train.config import TrainConfig
from klpo.train.step.kl_term import KLTerm

__all__ = ["FUSED_LOSS_MIN_VOCAB", "on_policy_weights", "reduction_weights", "takes_fused_loss"]

FUSED_LOSS_MIN_VOCAB = 32768
"""``algo.fused_loss: auto`` takes the forward-pass gradient from this many vocabulary entries."""


def takes_fused_loss(cfg: TrainConfig, vocab: int, *, applies: bool) -> bool:
    """Whether a micro-step takes its gradient in the forward pass: where it ``applies``
    (on-policy, exact or no KL in the loss, no engine weights) and ``algo.fused_loss`` allows it
    at a vocabulary of ``vocab`` entries."""
    mode = cfg.algo.fused_loss
    if mode == "off" or not applies:
        return False
    return mode == "on" or vocab >= FUSED_LOSS_MIN_VOCAB


def on_policy_weights(
    cfg: TrainConfig,
    adv: Tensor,
    mask: Tensor,
    red: Callable[[Tensor], Tensor],
    term: KLTerm,
    world: int,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The weights of a micro-batch's loss on each token's log-prob, entropy and exact KL, on
    the policy that sampled it: ``[B, C]`` each (None where the loss has no such term).

    The loss is ``red(pg(logp, logp_old)) + c red(kl) + entropy_coef red(-entropy)``, ``c =
    term.loss_coef`` and the policy loss given ``term.beta_old``
    (:func:`klpo.train.step.update.micro_step`), times ``world`` (undoing DDP's mean). Where the
    forward pass is also the sampling policy's (``logp_old`` is its detached ``logp``), every
    policy loss is a function of the ratio ``exp(logp - logp_old) = 1`` (CISPO also of ``logp``,
    linearly), so its gradient with respect to ``logp`` does not depend on ``logp``'s value, and
    the KL and entropy terms are linear: the weights are the gradients of the loss at any point
    with ``logp = logp_old``, here 0, taken by autograd through the same functions the per-token
    path calls.
    """
    a = cfg.algo
    z = [
        torch.zeros(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
        for _ in range(3)
    ]
    adv64 = adv.detach().to(torch.float64)
    pg = POLICY_LOSSES[a.policy_loss].loss
    total = red(pg(a, z[0], z[0].detach(), adv64, mask, term.beta_old))
    kl_coef = term.loss_coef
    if kl_coef:
        total = total + kl_coef * red(z[2])
    if a.entropy_coef:
        total = total + a.entropy_coef * red(losses.entropy_bonus(z[1]))
    grads = torch.autograd.grad(total * world, z, allow_unused=True)
    return tuple(grads)  # type: ignore[return-value]


def reduction_weights(red: Callable[[Tensor], Tensor], shape: torch.Size, device) -> Tensor:
    """``[B, C]`` float64: the weight ``d red(x) / d x_i`` of each token in the reduction ``red``
    (linear in ``x``: the mask over the loss's normaliser, 0 at masked tokens), taken by autograd
    through ``red`` itself, so the weighted sum ``sum_i w_i x_i`` is ``red(x)``."""
    with torch.enable_grad():
        z = torch.zeros(shape, dtype=torch.float64, device=device, requires_grad=True)
        (w,) = torch.autograd.grad(red(z), z, allow_unused=True)
    return torch.zeros_like(z, requires_grad=False) if w is None else w
