"""The algorithms and the policy losses, as tables: the one list of each one's names.

A row of :data:`ALGORITHMS` is an algorithm's advantage estimator and its traits: whether its
baseline is group-relative (it needs ``rollout.group_size >= 2``), whether it trains a critic,
whether its advantages are whitened over the batch, and how a KL in the reward reaches each token.
The config's validation and its ``Literal`` of names, model building, the step, the study's presets
and ``klpo doctor`` all read these rows; no other file lists the names. :data:`POLICY_LOSSES` is
the same for the surrogate the update differentiates.

The tables import no torch: a row names its function in :mod:`klpo.train.algorithm_fns` (a
:class:`klpo._lazy.Ref`, imported on the first call), so reading the traits (the config, the
doctor) never loads the tensors' stack.

To add an algorithm: write its advantage estimator from the library's functions
(:mod:`klpo.advantages`; the contract is :data:`klpo.train.algorithm_fns.AdvantageFn`) and add a
row; a policy loss: a function of :mod:`klpo.losses` (or :mod:`klpo.offpolicy`) and a row. A row
may hold the function itself as well as a ``Ref``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from klpo._lazy import Ref

__all__ = [
    "ALGORITHMS",
    "POLICY_LOSSES",
    "AdvantageSettings",
    "Algorithm",
    "AlgorithmSpec",
    "ClipSettings",
    "PolicyLoss",
    "PolicyLossSpec",
    "anchors_to_sampler",
]


def _fn(name: str) -> Ref:
    """Function ``name`` of :mod:`klpo.train.algorithm_fns`, imported when first called."""
    return Ref("klpo.train.algorithm_fns", name)


class AdvantageSettings(Protocol):
    """The ``algo.*`` settings an advantage estimator reads (``AlgoConfig``)."""

    std: str  # the group advantage's scale (sample, population, none)
    gamma: float  # the discount
    lam: float  # GAE's lambda


@dataclass(frozen=True)
class AlgorithmSpec:
    """One algorithm: its advantage estimator and its traits."""

    advantages: Callable[..., Any]  # (algo settings, inputs) -> (adv [B, C], value targets or None)
    group: bool  # a group-relative baseline: needs several completions per prompt
    critic: bool  # trains a critic (and logs loss/value, value/*)
    whitened: bool  # advantages whitened over the whole step's batch
    reward_kl_credit: str  # how a KL in the reward reaches each token (klpo doctor's words)


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(
        _fn("grpo_advantages"),
        group=True,
        critic=False,
        whitened=False,
        reward_kl_credit="per token, returns-to-go added to the group-relative advantage "
        "(never normalised)",
    ),
    "ppo": AlgorithmSpec(
        _fn("ppo_advantages"),
        group=False,
        critic=True,
        whitened=True,
        reward_kl_credit="per token, through GAE, then batch-whitened",
    ),
    "rloo": AlgorithmSpec(
        _fn("rloo_advantages"),
        group=True,
        critic=False,
        whitened=False,
        reward_kl_credit="summed over the completion into the score, then leave-one-out",
    ),
    "reinforce++": AlgorithmSpec(
        _fn("reinforce_pp_advantages"),
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


def anchors_to_sampler(a: ClipSettings, policy_loss: str) -> bool:
    """Whether ``policy_loss`` takes its ratio to the behaviour policy that sampled the tokens
    rather than to pi_old: ``algo.dppo_anchor``, or by default the sampler for ``dppo-tv-k2``
    (prime-rl, which keeps no pi_old apart from the inference engine's log-probs) and pi_old for
    ``dppo-tv`` and ``dppo-kl`` (verl's anchor)."""
    if not policy_loss.startswith("dppo"):
        return False
    anchor = getattr(a, "dppo_anchor", None)
    return anchor == "sampler" if anchor is not None else policy_loss == "dppo-tv-k2"


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy loss: the surrogate and whether it carries PPO's penalty coefficient."""

    loss: Callable[..., Any]  # PolicyLossFn of klpo.train.algorithm_fns
    uses_beta_old: bool = False  # its beta_old has a controller of its own, logged as beta_old
    per_sequence: bool = False  # a sequence-level ratio (logs its sequence metrics)
    # its mask is a statistic of the optimizer step's tokens (M2PO): the update computes it from
    # pi_old and the sampler's log-probs and passes it in place of the valid-token mask
    batch_mask: bool = False


POLICY_LOSSES: dict[str, PolicyLossSpec] = {
    "clip": PolicyLossSpec(_fn("clip_loss")),
    "kl-penalty": PolicyLossSpec(_fn("kl_penalty_loss"), uses_beta_old=True),
    "gspo": PolicyLossSpec(_fn("gspo_loss"), per_sequence=True),
    "cispo": PolicyLossSpec(_fn("cispo_loss")),
    "dppo-tv": PolicyLossSpec(_fn("dppo_tv_loss")),
    "dppo-kl": PolicyLossSpec(_fn("dppo_kl_loss")),
    "dppo-tv-k2": PolicyLossSpec(_fn("dppo_tv_k2_loss")),
    "m2po": PolicyLossSpec(_fn("m2po_loss"), batch_mask=True),
}
"""``algo.policy_loss`` -> its surrogate. The KL to the reference is not part of it: under every
choice it keeps its own per-token off-policy weight (:func:`klpo.losses.kl_loss`), never GSPO's
sequence ratio."""

PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]
"""The names of :data:`POLICY_LOSSES`, as the config's type."""
