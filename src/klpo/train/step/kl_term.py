"""The KL term of the loss, estimator by estimator: on the policy's tokens, and on the reference's.

A per-token estimator (:data:`klpo.kl.ESTIMATORS`) is a term on the policy's own tokens with
weight 1. A reference-sampled one (:data:`klpo.kl.REF_SAMPLED`, ``kl.SPECS[name].ref_sampled``)
splits its KL term into ``a`` times k1 on the policy's tokens and ``1 - a`` times ``ref_is`` on
completions sampled from the reference (:mod:`klpo.train.rollout.ref_samples`):

- ``ref_is``: ``a = 0``;
- ``adaptive_mix`` (``kl.SPECS[name].mixed``): ``a`` from the mix's window of its own past outputs
  (:class:`klpo.ref_kl.MixWindow`, :func:`make_window`), which takes ``a · kl/ref/k1 + (1 - a) ·
  kl/ref/ref_is`` after each step.

Each step's split and coefficients are one value, a :class:`KLTerm` (:func:`sample_kl_term`),
that the update, the metrics and the after-step control read whole: at every optimizer step
:func:`ref_term` scores the reference's completions under pi_theta (with gradient), forms
:func:`klpo.ref_kl.ref_is` over the batch, and backpropagates ``beta · (1 - a) · units ·
ref_is``, where ``units`` turns the per-completion KL into the loss's units: ``reduce(1) / L``,
with L the mean length of the policy's completions this step. Under ``token-mean`` that is the
KL per token, as the per-token estimators give, so beta means the same for every estimator; and
every micro-step adds ``beta · a · k1`` on the policy's tokens as an ordinary per-token term.

The reference's completions come from pi_ref, which does not depend on theta, so the gradient
with the samples held fixed is grad KL(pi_theta ‖ pi_ref) at the sequence level for plain
``ref_is`` (``klpo explain -e ref_is -p loss``). Under ``torchrun`` each rank samples for its own
prompts and its estimate's gradient is averaged over ranks by DDP (the batch-statistic options,
dynamic clip and self-normalisation, are then per rank).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from klpo import kl, ref_kl
from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example
from klpo.train.models.backbone import ModelHead, shares_prompt
from klpo.train.models.build import Models
from klpo.train.rollout.ref_samples import RefBatch, sample_reference, sequence_logp
from klpo.train.rollout.samplers import Rollout

__all__ = [
    "KLTerm",
    "kl_term",
    "make_window",
    "needs_exact_kl",
    "ref_term",
    "sample_kl_term",
]


def needs_exact_kl(estimator: str) -> bool:
    """Whether ``estimator``'s per-token value is the exact KL over the vocabulary at the position
    (``kl.SPECS[estimator].needs_logits``): it needs the reference's hidden states in the forward
    pass (:func:`klpo.logprobs.fused`), not token log-probs."""
    spec = kl.SPECS.get(estimator)
    return spec is not None and spec.needs_logits


def _ref_sampled(cfg: TrainConfig) -> kl.Spec | None:
    """The spec of ``kl.estimator`` where it samples the reference, else None."""
    spec = kl.SPECS.get(cfg.kl.estimator)
    return spec if spec is not None and spec.ref_sampled else None


@dataclass(frozen=True)
class KLTerm:
    """One step's KL terms and their coefficients, read once from the controllers.

    The KL to the reference, with coefficient ``beta``: ``estimator`` on the policy's tokens with
    weight ``weight`` (in the loss where ``in_loss``), and, with ``ref``, ``ref_is`` on the
    reference's completions with ``1 - weight`` (see the module). And ``beta_old``, PPO's penalty
    coefficient on the KL to pi_old, for the policy losses that use it
    (:data:`klpo.train.algorithms.POLICY_LOSSES`). Every coefficient the update applies is one
    of this value's fields or properties.
    """

    estimator: str  # a per-token estimator on the policy's tokens
    beta: float  # the KL coefficient this step (kl.controller's value)
    beta_old: float  # PPO's penalty coefficient this step (algo.penalty_beta's controller)
    weight: float = (
        1.0  # the estimator's weight in the KL term: 1; 0 for ref_is; a for adaptive_mix
    )
    in_loss: bool = True  # kl.placement puts the KL in the loss
    ref: RefBatch | None = None  # the reference's completions (ref_is, adaptive_mix)

    @property
    def exact(self) -> bool:
        """Whether the per-token estimator is the exact KL at each position (:func:`needs_exact_kl`):
        the update's forward then takes the reference's hidden states, not token log-probs."""
        return needs_exact_kl(self.estimator)

    @property
    def loss_weight(self) -> float:
        """The per-token estimator's weight in the loss: ``weight``, or 0 where the KL is not in
        the loss or its coefficient ``beta · weight`` is not positive (no KL in the loss)."""
        return self.weight if self.in_loss and self.beta * self.weight > 0 else 0.0

    @property
    def loss_coef(self) -> float:
        """The loss's coefficient on the reduced per-token estimate: ``beta · loss_weight``."""
        return self.beta * self.loss_weight

    @property
    def ref_coef(self) -> float:
        """The loss's coefficient on ``ref_is`` over the reference's completions:
        ``beta · (1 - weight)``."""
        return self.beta * (1.0 - self.weight)


def kl_term(
    cfg: TrainConfig,
    *,
    beta: float,
    beta_old: float,
    mix_weight: float = 0.0,
    ref: RefBatch | None = None,
) -> KLTerm:
    """The KL term of ``kl.estimator`` with this step's coefficients ``beta`` and ``beta_old``,
    the mix's weight ``a`` and the reference's completions where it has them."""
    in_loss = kl.in_loss(cfg.kl.placement)
    spec = _ref_sampled(cfg)
    if spec is None:
        return KLTerm(cfg.kl.estimator, beta, beta_old, in_loss=in_loss)
    weight = mix_weight if spec.mixed else 0.0
    return KLTerm("k1", beta, beta_old, weight, in_loss, ref)


def uses_reference_samples(cfg: TrainConfig) -> bool:
    """Whether the configured KL term needs completions sampled from the reference."""
    return _ref_sampled(cfg) is not None and cfg.kl.placement != "none"


def make_window(cfg: TrainConfig) -> ref_kl.MixWindow | None:
    """The mix's window of its past outputs (``adaptive_mix`` in a loss or reward only)."""
    spec = _ref_sampled(cfg)
    if spec is None or not spec.mixed or not uses_reference_samples(cfg):
        return None
    k = cfg.kl
    return ref_kl.MixWindow(
        gamma=k.mix_gamma, threshold=k.mix_threshold, window=k.mix_window, sign=k.mix_sign
    )


def sample_kl_term(
    cfg: TrainConfig,
    m: Models,
    mine: list[Example],
    rollout: Rollout,
    window: ref_kl.MixWindow | None,
    *,
    beta: float,
    beta_old: float,
) -> KLTerm:
    """This step's KL term with its coefficients ``beta`` and ``beta_old``: for ``ref_is`` and
    ``adaptive_mix``, the reference's own completions of the step's prompts ``mine`` (the policy
    sampled ``rollout``) and the mix's weight now."""
    ref = None
    if uses_reference_samples(cfg):
        ref = sample_reference(
            cfg,
            m.reference,
            m.codec,
            [e.prompt for e in mine],
            [e.answer for e in mine],
            rollout,
        )
    mix_weight = window.weight() if window is not None else 0.0
    return kl_term(cfg, beta=beta, beta_old=beta_old, mix_weight=mix_weight, ref=ref)


def ref_term(
    cfg: TrainConfig, backbone: torch.nn.Module, head: ModelHead, term: KLTerm
) -> dict[str, float]:
    """Forward (and backward, gradients accumulate) of ``beta (1 - a) units ref_is`` on the
    reference's completions ``term.ref`` (``term.ref_coef`` is ``beta (1 - a)``).

    Call it once per optimizer step, before the policy's micro-batches: under DDP it runs inside
    ``no_sync`` and the next synchronised backward reduces its gradient too. Returns the
    estimate (per completion and per policy token), the weights' diagnostics and its time.
    """
    t0 = time.perf_counter()
    k, batch = cfg.kl, term.ref
    if batch is None:
        raise ValueError(
            f"ref_term needs the reference's completions; {term.estimator}'s term has none"
        )
    coef = term.ref_coef
    grad = coef > 0
    sync = backbone.no_sync() if hasattr(backbone, "no_sync") else nullcontext()
    with sync, torch.set_grad_enabled(grad):
        logp = sequence_logp(
            backbone,
            head,
            batch.rollout,
            cfg.rollout.temperature,
            share_prompt=shares_prompt(cfg),
        )
        est = ref_kl.ref_is(
            logp,
            batch.logp_ref.to(logp.device),
            clip=tuple(k.ref_is_clip) if k.ref_is_clip is not None else None,
            dynamic_clip=k.ref_is_dynamic_clip,
            self_normalised=k.ref_is_self_normalised,
        )
        loss = est * batch.units
        if grad:
            (coef * loss).backward()
    diag = ref_kl.weight_diagnostics(logp.detach(), batch.logp_ref.to(logp.device))
    return {
        "kl/ref/ref_is": float(est.detach()) / batch.mean_len,
        "kl/ref/ref_is_seq": float(est.detach()),
        "loss/kl_ref": float(loss.detach()),
        "ref/max_weight": diag["max_weight"],
        "ref/ess": diag["ess"],
        "time/ref_update": time.perf_counter() - t0,
    }
