"""The KL term of ``ref_is`` and ``adaptive_mix``: completions sampled from the reference.

These two estimators (:mod:`klpo.ref_kl`) read, besides the policy's rollout, completions that
pi_ref samples for the same prompts (``kl.ref_samples`` per prompt, by default as many as the
policy's ``rollout.group_size``). Each step:

1. :func:`sample_reference` draws them with ``generate`` from the frozen reference and scores
   them once under pi_ref (sequence log-probs, no gradient);
2. at every optimizer step, :func:`ref_term` scores them under pi_theta (with gradient), forms
   :func:`klpo.ref_kl.ref_is` over the batch, and backpropagates ``beta · (1 - a) · units ·
   ref_is`` (``a = 0`` for ``ref_is``; the mix's weight on k1 otherwise), where ``units``
   turns the per-completion KL into the loss's units: ``reduce(1) / L``, with L the mean length
   of the policy's completions this step. Under ``token-mean`` that is the KL per token, as the
   per-token estimators give, so beta means the same for every estimator;
3. for ``adaptive_mix`` the loop adds ``beta · a · k1`` on the policy's tokens as an ordinary
   per-token loss term (:func:`policy_term`), and after the step pushes the mix's output
   ``a · kl/ref/k1 + (1 - a) · kl/ref/ref_is`` into :class:`klpo.ref_kl.MixWindow`.

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
from torch import Tensor

from klpo import kl, logprobs, reduce, ref_kl
from klpo.train.config import TrainConfig
from klpo.train.rollout.samplers import Rollout, completion_hidden, generate


def uses_reference_samples(cfg: TrainConfig) -> bool:
    """Whether the configured KL term needs completions sampled from the reference."""
    return cfg.kl.estimator in kl.REF_SAMPLED and cfg.kl.placement != "none"


def make_window(cfg: TrainConfig) -> ref_kl.MixWindow | None:
    """The mix's window of its past outputs (``adaptive_mix`` only)."""
    if cfg.kl.estimator != "adaptive_mix":
        return None
    k = cfg.kl
    return ref_kl.MixWindow(
        gamma=k.mix_gamma, threshold=k.mix_threshold, window=k.mix_window, sign=k.mix_sign
    )


def policy_term(cfg: TrainConfig, mix_weight: float) -> tuple[str, float]:
    """(per-token estimator on the policy's tokens, its weight in the KL term) for the loss.

    ``ref_is`` has none (weight 0); ``adaptive_mix`` puts ``a`` on k1; every other estimator is
    itself with weight 1.
    """
    name = cfg.kl.estimator
    if name == "ref_is":
        return "k1", 0.0
    if name == "adaptive_mix":
        return "k1", mix_weight
    return name, 1.0


@dataclass
class RefBatch:
    """The reference's completions of one step, scored under pi_ref."""

    rollout: Rollout  # N = prompts × ref_samples completions of pi_ref
    logp_ref: Tensor  # [N] log pi_ref of each whole completion (float32, no gradient)
    mean_len: float  # L: mean length (tokens) of the *policy's* completions this step
    units: float  # reduce(1) / L: a per-completion KL in the loss's units
    seconds: float  # time spent sampling and scoring under pi_ref


def sequence_logp(
    backbone,
    head: tuple[Tensor, Tensor | None],
    r: Rollout,
    temperature: float,
    *,
    share_prompt: bool = True,
) -> Tensor:
    """``[N]`` the log-probability of each whole completion (sum over its valid tokens)."""
    weight, bias = head
    hidden = completion_hidden(backbone, r, share_prompt=share_prompt)
    out = logprobs.fused(hidden, weight, r.completion_ids, bias=bias, temperature=temperature)
    return torch.where(r.mask.to(out.logp.device), out.logp, 0.0).sum(-1)


@torch.no_grad()
def sample_reference(
    cfg: TrainConfig, reference, tokenizer, prompts: list[str], answers: list[str], policy: Rollout
) -> RefBatch:
    """Sample ``kl.ref_samples`` completions per prompt from ``reference`` (a frozen Backbone)."""
    t0 = time.perf_counter()
    r = generate(
        reference.model,
        tokenizer,
        prompts,
        answers,
        group_size=cfg.kl.ref_samples or cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_prompt_tokens=cfg.data.max_prompt_tokens,
        sampler=cfg.rollout.sampler,
    )
    logp_ref = sequence_logp(
        reference,
        reference.head(),
        r,
        cfg.rollout.temperature,
        share_prompt=cfg.rollout.share_prompt,
    )
    mask = policy.mask
    mean_len = float(mask.sum()) / mask.shape[0]
    ones = reduce.reduce(
        torch.ones(mask.shape, device=mask.device),
        mask,
        cfg.algo.loss_reduction,
        max_len=cfg.rollout.max_new_tokens,
    )
    return RefBatch(r, logp_ref, mean_len, float(ones) / mean_len, time.perf_counter() - t0)


def ref_term(
    cfg: TrainConfig,
    backbone: torch.nn.Module,
    head: tuple[Tensor, Tensor | None],
    batch: RefBatch,
    *,
    beta: float,
    mix_weight: float,
) -> dict[str, float]:
    """Forward (and backward, gradients accumulate) of ``beta (1 - a) units ref_is``.

    Call it once per optimizer step, before the policy's micro-batches: under DDP it runs inside
    ``no_sync`` and the next synchronised backward reduces its gradient too. Returns the
    estimate (per completion and per policy token), the weights' diagnostics and its time.
    """
    t0 = time.perf_counter()
    k = cfg.kl
    coef = beta * (1.0 - mix_weight)
    grad = coef > 0
    sync = backbone.no_sync() if hasattr(backbone, "no_sync") else nullcontext()
    with sync, torch.set_grad_enabled(grad):
        logp = sequence_logp(
            backbone,
            head,
            batch.rollout,
            cfg.rollout.temperature,
            share_prompt=cfg.rollout.share_prompt,
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
