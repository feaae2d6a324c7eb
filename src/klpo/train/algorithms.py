"""The algorithms and the policy losses, as tables: the one list of each one's names.

A row of :data:`ALGORITHMS` is an algorithm's advantage estimator and its traits: whether its
baseline is group-relative (it needs ``rollout.group_size >= 2``), whether it trains a critic,
whether its advantages are whitened over the batch, and how a KL in the reward reaches each token.
The config's validation and its ``Literal`` of names, model building, the step, the study's presets
and ``klpo doctor`` all read these rows; no other file lists the names. :data:`POLICY_LOSSES` is
the same for the surrogate the update differentiates.

To add an algorithm: write its advantage estimator from the library's functions
(:mod:`klpo.advantages`) and add a row; a policy loss: a function of :mod:`klpo.losses` (or :mod:`klpo.offpolicy`) and a row.

Every advantage estimator reads the ``algo.*`` settings (:class:`AdvantageSettings`, the whole
:class:`klpo.train.config.AlgoConfig`, as a policy loss reads :class:`ClipSettings`) and
:class:`AdvantageInputs` (B completions of C tokens), and returns ``(adv [B, C], value targets
[B, C] or None)``; a new estimator's own settings are new ``algo.*`` keys, read where it reads
them. Batch-whitening uses the statistics of the whole
step's batch over every process (:func:`whiten_over_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

from klpo import advantages, losses, offpolicy
from klpo.train.runtime.dist import Dist

__all__ = [
    "ALGORITHMS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageSettings",
    "Algorithm",
    "AlgorithmSpec",
    "PolicyLoss",
    "PolicyLossSpec",
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


class AdvantageSettings(Protocol):
    """The ``algo.*`` settings an advantage estimator reads (``AlgoConfig``)."""

    std: str  # the group advantage's scale (sample, population, none)
    gamma: float  # the discount
    lam: float  # GAE's lambda


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


def _grpo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Group-relative task advantage on every token, plus the KL penalty's returns-to-go.

    The KL penalty keeps its per-token credit (REINFORCE, no baseline), so that k1 in the reward
    follows the sequence-level grad KL(pi_theta ‖ pi_ref)."""
    adv = advantages.broadcast_to_tokens(
        advantages.group_relative(x.scores, x.group_size, std=a.std, valid=x.scored), x.mask
    )
    return adv + advantages.returns_to_go(x.kl_penalty, x.mask, gamma=a.gamma), None


def _rloo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Leave-one-out baseline of the sequence's total reward, KL penalty summed in."""
    totals = x.scores + torch.where(x.mask, x.kl_penalty, 0.0).sum(-1)
    adv = advantages.rloo(totals, x.group_size, valid=x.scored)
    return advantages.broadcast_to_tokens(adv, x.mask), None


def _reinforce_pp_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Per-token returns-to-go of the shaped reward, whitened over the batch (REINFORCE++,
    :func:`klpo.advantages.reinforce_pp`, with the statistics of every rank's share)."""
    returns = advantages.returns_to_go(x.token_rewards + x.kl_penalty, x.mask, gamma=a.gamma)
    mask = x.mask if x.scored is None else x.mask & x.scored[:, None]  # unscored: left out, 0
    return whiten_over_ranks(returns, mask, x.dist), None


def _ppo_advantages(a: AdvantageSettings, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GAE on the shaped reward with the critic's values, whitened; returns are the targets."""
    assert x.values is not None
    adv, returns = advantages.gae(
        x.token_rewards + x.kl_penalty, x.values, x.mask, gamma=a.gamma, lam=a.lam
    )
    return whiten_over_ranks(adv, x.mask, x.dist), returns


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its advantage estimator and its traits."""

    advantages: AdvantageFn  # (algo settings, inputs) -> (adv [B, C], value targets or None)
    group: bool  # a group-relative baseline: needs several completions per prompt
    critic: bool  # trains a critic (and logs loss/value, value/*)
    whitened: bool  # advantages whitened over the whole step's batch
    reward_kl_credit: str  # how a KL in the reward reaches each token (klpo doctor's words)


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        _grpo_advantages,
        group=True,
        critic=False,
        whitened=False,
        reward_kl_credit="per token, returns-to-go added to the group-relative advantage "
        "(never normalised)",
    ),
    "ppo": AlgorithmSpec(
        _ppo_advantages,
        group=False,
        critic=True,
        whitened=True,
        reward_kl_credit="per token, through GAE, then batch-whitened",
    ),
    "rloo": AlgorithmSpec(
        _rloo_advantages,
        group=True,
        critic=False,
        whitened=False,
        reward_kl_credit="summed over the completion into the score, then leave-one-out",
    ),
    "reinforce++": AlgorithmSpec(
        _reinforce_pp_advantages,
        group=False,
        critic=False,
        whitened=True,
        reward_kl_credit="per token, returns-to-go, then batch-whitened",
    ),
}
"""``algo.name`` -> its advantage estimator and traits, in the order the docs list them."""

Algorithm = Literal[tuple(ALGORITHMS)]  # type: ignore[valid-type]
"""The names of :data:`ALGORITHMS`, as the config's type."""


class ClipSettings(Protocol):
    """The ``algo.*`` settings a policy loss reads (:class:`klpo.train.config.AlgoConfig`)."""

    clip_low: float
    clip_high: float
    dual_clip: float | None
    gspo_clip_low: float
    gspo_clip_high: float
    dppo_delta_low: float
    dppo_delta_high: float
    sampler_k2_coef: float
    dppo_anchor: str | None
    m2po_threshold: float


PolicyLossFn = Callable[[ClipSettings, Tensor, Tensor, Tensor, Tensor, float], Tensor]
"""Per-token policy loss ``[B, C]`` from (algo settings, logp, logp_old, adv, mask, beta_old)."""


def _clip_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_clip(
        logp, logp_old, adv, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )


def _kl_penalty_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_kl_penalty(logp, logp_old, adv, beta=beta_old)


def _gspo_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.gspo(
        logp, logp_old, adv, mask, clip_low=a.gspo_clip_low, clip_high=a.gspo_clip_high
    )


def _cispo_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.cispo(logp, logp_old, adv, clip_high=a.clip_high)


def _dppo_tv_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return offpolicy.dppo(
        logp, logp_old, adv, divergence="tv", delta_low=a.dppo_delta_low,
        delta_high=a.dppo_delta_high,
    )  # fmt: skip


def _dppo_kl_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return offpolicy.dppo(
        logp, logp_old, adv, divergence="kl", delta_low=a.dppo_delta_low,
        delta_high=a.dppo_delta_high,
    )  # fmt: skip


def _dppo_tv_k2_loss(a: ClipSettings, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    """prime-rl's default RL loss: the DPPO-TV policy gradient plus k2 toward ``logp_old``, the
    sampler's log-probs where the update anchors it there (:func:`anchors_to_sampler`)."""
    pg = _dppo_tv_loss(a, logp, logp_old, adv, mask, beta_old)
    return pg + offpolicy.sampler_k2(logp, logp_old, coef=a.sampler_k2_coef).to(pg.dtype)


def anchors_to_sampler(a: ClipSettings, policy_loss: str) -> bool:
    """Whether ``policy_loss`` takes its ratio to the behaviour policy that sampled the tokens
    rather than to pi_old: ``algo.dppo_anchor``, or by default the sampler for ``dppo-tv-k2``
    (prime-rl, which keeps no pi_old apart from the inference engine's log-probs) and pi_old for
    ``dppo-tv`` and ``dppo-kl`` (verl's anchor)."""
    if not policy_loss.startswith("dppo"):
        return False
    anchor = getattr(a, "dppo_anchor", None)
    return anchor == "sampler" if anchor is not None else policy_loss == "dppo-tv-k2"


def _m2po_loss(a: ClipSettings, logp, logp_old, adv, keep, beta_old: float) -> Tensor:
    """M2PO on the tokens of ``keep``, its mask over the optimizer step (``batch_mask``: the
    update computes it, :func:`klpo.offpolicy.m2po_mask`, and passes it as the mask). Within it
    the library's loss keeps every token: its log-ratio to its own detached log-probs is 0."""
    return offpolicy.m2po(logp, logp_old, logp.detach(), adv, keep, threshold=a.m2po_threshold)


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy loss: the surrogate and whether it carries PPO's penalty coefficient."""

    loss: PolicyLossFn
    uses_beta_old: bool = False  # its beta_old has a controller of its own, logged as beta_old
    per_sequence: bool = False  # a sequence-level ratio (logs its sequence metrics)
    # its mask is a statistic of the optimizer step's tokens (M2PO): the update computes it from
    # pi_old and the sampler's log-probs and passes it in place of the valid-token mask
    batch_mask: bool = False


POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "clip": PolicyLossSpec(_clip_loss),
    "kl-penalty": PolicyLossSpec(_kl_penalty_loss, uses_beta_old=True),
    "gspo": PolicyLossSpec(_gspo_loss, per_sequence=True),
    "cispo": PolicyLossSpec(_cispo_loss),
    "dppo-tv": PolicyLossSpec(_dppo_tv_loss),
    "dppo-kl": PolicyLossSpec(_dppo_kl_loss),
    "dppo-tv-k2": PolicyLossSpec(_dppo_tv_k2_loss),
    "m2po": PolicyLossSpec(_m2po_loss, batch_mask=True),
}
"""``algo.policy_loss`` -> its surrogate. The KL to the reference is not part of it: under every
choice it keeps its own per-token off-policy weight (:func:`klpo.losses.kl_loss`), never GSPO's
sequence ratio."""

PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]
"""The names of :data:`POLICY_LOSSES`, as the config's type."""
