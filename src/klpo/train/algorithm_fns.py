"""The functions of the algorithms' and the policy losses' rows (:mod:`klpo.train.algorithms`).

Each row of :data:`~klpo.train.algorithms.ALGORITHMS` names its advantage estimator here, and
each row of :data:`~klpo.train.algorithms.POLICY_LOSSES` its surrogate; the tables hold the
traits and import this module (and torch) only when a function is first called, so that the
config and ``klpo doctor`` read the rows without torch.

Every advantage estimator reads the ``algo.*`` settings (:class:`AdvantageSettings`, the whole
:class:`klpo.train.config.AlgoConfig`, as a policy loss reads
:class:`~klpo.train.algorithms.ClipSettings`) and :class:`AdvantageInputs` (B completions of C
tokens), and returns ``(adv [B, C], value targets [B, C] or None)``. Batch-whitening uses the
statistics of the whole step's batch over every process (:func:`whiten_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from klpo import advantages, losses, offpolicy
from klpo.train.algorithms import AdvantageSettings, ClipSettings
from klpo.train.runtime.dist import Dist

__all__ = [
    "AdvantageFn",
    "AdvantageInputs",
    "PolicyLossFn",
    "cispo_loss",
    "clip_loss",
    "dppo_kl_loss",
    "dppo_tv_k2_loss",
    "dppo_tv_loss",
    "grpo_advantages",
    "gspo_loss",
    "kl_penalty_loss",
    "m2po_loss",
    "ppo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "whiten_over_ranks",
]


@dataclass(frozen=True)
class AdvantageInputs:
    """What every advantage estimator may read; B completions of C tokens."""

    scores: Tensor  # [B] total task reward per completion
    token_rewards: Tensor  # [B, C] the task reward on each completion's last valid token
    kl_penalty: Tensor  # [B, C] -beta · sg(est) when the KL is in the reward, else 0
    mask: Tensor  # [B, C] bool
    group_size: int
    values: Tensor | None  # [B, C] V(s_t) of the critic (algorithms with a critic)
    dist: Dist  # the ranks holding the rest of the step's batch (batch-whitening sums over them)
    # [B] bool: True where some reward function scored the completion (None: every one was).
    # An unscored completion is left out of every baseline and gets no task advantage.
    scored: Tensor | None = None


AdvantageFn = Callable[[AdvantageSettings, AdvantageInputs], tuple[Tensor, Tensor | None]]
"""``(algo settings, inputs) -> (adv [B, C], value targets [B, C] or None)``."""


def whiten_over_ranks(x: Tensor, mask: Tensor, dist: Dist) -> Tensor:
    """:func:`klpo.advantages.whiten` with the statistics of the whole step's batch.

    Each rank's :func:`~klpo.advantages.whiten_stats` are gathered (a sum of rows that are zero
    but for the rank's own) and merged in rank order, so every rank whitens its share with the
    same mean and variance as one process holding the whole batch would (in a world of one, the
    bits of plain ``whiten``)."""
    local = torch.stack(advantages.whiten_stats(x, mask))
    rows = torch.zeros(dist.world, local.numel(), dtype=local.dtype, device=local.device)
    rows[dist.rank] = local
    rows = dist.all_sum(rows)
    stats = advantages.merge_whiten_stats([advantages.WhitenStats(*r) for r in rows])
    return advantages.whiten(x, mask, stats=stats)


def grpo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Group-relative task advantage on every token, plus the KL penalty's returns-to-go.

    The KL penalty keeps its per-token credit (REINFORCE, no baseline), so that k1 in the reward
    follows the sequence-level grad KL(pi_theta ‖ pi_ref)."""
    adv = advantages.broadcast_to_tokens(
        advantages.group_relative(x.scores, x.group_size, std=a.std, valid=x.scored), x.mask
    )
    return adv + advantages.returns_to_go(x.kl_penalty, x.mask, gamma=a.gamma), None


def rloo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Leave-one-out baseline of the sequence's total reward, KL penalty summed in."""
    totals = x.scores + torch.where(x.mask, x.kl_penalty, 0.0).sum(-1)
    adv = advantages.rloo(totals, x.group_size, valid=x.scored)
    return advantages.broadcast_to_tokens(adv, x.mask), None


def reinforce_pp_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Per-token returns-to-go of the shaped reward, whitened over the batch (REINFORCE++,
    :func:`klpo.advantages.reinforce_pp`, with the statistics of every rank's share)."""
    returns = advantages.returns_to_go(x.token_rewards + x.kl_penalty, x.mask, gamma=a.gamma)
    mask = x.mask if x.scored is None else x.mask & x.scored[:, None]  # unscored: left out, 0
    return whiten_over_ranks(returns, mask, x.dist), None


def ppo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GAE on the shaped reward with the critic's values, whitened; returns are the targets."""
    assert x.values is not None
    adv, returns = advantages.gae(
        x.token_rewards + x.kl_penalty, x.values, x.mask, gamma=a.gamma, lam=a.lam
    )
    return whiten_over_ranks(adv, x.mask, x.dist), returns


PolicyLossFn = Callable[[ClipSettings, Tensor, Tensor, Tensor, Tensor, float], Tensor]
"""Per-token policy loss ``[B, C]`` from (algo settings, logp, logp_old, adv, mask, beta_old)."""


def clip_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_clip(
        logp, logp_old, adv, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )


def kl_penalty_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_kl_penalty(logp, logp_old, adv, beta=beta_old)


def gspo_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.gspo(
        logp, logp_old, adv, mask, clip_low=a.gspo_clip_low, clip_high=a.gspo_clip_high
    )


def cispo_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.cispo(logp, logp_old, adv, clip_high=a.clip_high)


def dppo_tv_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return offpolicy.dppo(
        logp, logp_old, adv, divergence="tv", delta_low=a.dppo_delta_low,
        delta_high=a.dppo_delta_high,
    )  # fmt: skip


def dppo_kl_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return offpolicy.dppo(
        logp, logp_old, adv, divergence="kl", delta_low=a.dppo_delta_low,
        delta_high=a.dppo_delta_high,
    )  # fmt: skip


def dppo_tv_k2_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    """prime-rl's default RL loss: the DPPO-TV policy gradient plus k2 toward ``logp_old``, the
    sampler's log-probs where the update anchors it there (:func:`klpo.train.algorithms.anchors_to_sampler`)."""
    pg = dppo_tv_loss(a, logp, logp_old, adv, mask, beta_old)
    return pg + offpolicy.sampler_k2(logp, logp_old, coef=a.sampler_k2_coef).to(pg.dtype)


def m2po_loss(a: ClipSettings, logp, logp_old, adv, keep, beta_old: float) -> Tensor:
    """M2PO on the tokens of ``keep``, its mask over the optimizer step (``batch_mask``: the
    update computes it, :func:`klpo.offpolicy.m2po_mask`, and passes it as the mask). Within it
    the library's loss keeps every token: its log-ratio to its own detached log-probs is 0."""
    return offpolicy.m2po(logp, logp_old, logp.detach(), adv, keep, threshold=a.m2po_threshold)
