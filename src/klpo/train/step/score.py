"""Scoring a rollout: rewards, the reference's (and the sampling policy's) log-probs, advantages.

:func:`score` turns this rank's share of the step's rollout into a :class:`Scored`: the rewards
of the configured functions (:mod:`klpo.train.rewards`), the reference's log-probs and hidden
states (for the exact KL, :func:`klpo.logprobs.fused`), pi_old's log-probs, entropy and exact KL
unless the update fills them (:mod:`klpo.train.step.types`), the KL in the reward if asked
(:func:`klpo.losses.kl_reward`), the critic's values, and the algorithm's advantages
(:data:`klpo.train.algorithms.ALGORITHMS`). Everything here runs without gradients.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from klpo import kl, losses
from klpo.train.algorithm_fns import AdvantageInputs
from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example
from klpo.train.models.backbone import shares_prompt, token_outputs
from klpo.train.models.build import Models, unwrap
from klpo.train.rewards import functions as rewards
from klpo.train.rewards.gold import gold_metrics
from klpo.train.rollout.reward_batch import reward_batch
from klpo.train.rollout.samplers import (
    Rollout,
    completion_hidden,
    pack_rows,
    packed_columns,
    position_ids,
)
from klpo.train.runtime.dist import Dist
from klpo.train.step.kl_term import needs_exact_kl
from klpo.train.step.step_metrics import reward_metrics
from klpo.train.step.teacher_term import teacher_penalty, teacher_scores
from klpo.train.step.types import SamplingPass, Scored, update_gives_logp_old

__all__ = ["reference_and_old", "reward_totals", "score", "values"]


def values(critic: torch.nn.Module, rollout: Rollout) -> Tensor:
    """``[B, C]`` V(s_t): the critic at the column that predicts completion token t (over packed
    rows where the rollout has a packed layout, :func:`packed_columns`)."""
    if rollout.packs is not None:
        device = next(critic.parameters()).device
        return packed_columns(partial(critic, packed=True), rollout, device)
    att = rollout.attention_mask
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    v = critic(rollout.input_ids, att, position_ids(att))
    return v[:, p - 1 : p - 1 + c]


def reference_and_old(
    cfg: TrainConfig, m: Models, rollout: Rollout, *, fill_old: bool | None = None
) -> tuple[Tensor, Tensor, SamplingPass, Tensor | None]:
    """(the reference's log-probs, its hidden states, pi_old's SamplingPass, the policy's hidden
    states of that pass), with pi_old filled here unless the update's forward fills it
    (``fill_old``: always, or never; then the last is None)."""
    tokens, temperature = rollout.completion_ids, cfg.rollout.temperature
    head_ref = m.reference.head()
    hidden_ref = completion_hidden(m.reference, rollout, share_prompt=shares_prompt(cfg))
    ref = token_outputs(hidden_ref, head_ref, tokens, temperature=temperature, with_entropy=False)
    old = SamplingPass.empty(ref.logp)
    hidden = None
    if fill_old if fill_old is not None else not update_gives_logp_old(cfg):
        hidden = completion_hidden(unwrap(m.backbone), rollout, share_prompt=shares_prompt(cfg))
        out = token_outputs(
            hidden,
            unwrap(m.backbone).head(),
            tokens,
            temperature=temperature,
            features_ref=hidden_ref,
            head_ref=head_ref,
        )
        old.record(torch.arange(tokens.shape[0]), out)
    return ref.logp, hidden_ref, old, hidden


def _shaped_rewards(
    cfg: TrainConfig, scores: Tensor, old: SamplingPass, logp_ref: Tensor, mask: Tensor, beta: float
) -> tuple[Tensor, Tensor]:
    """(task reward on each completion's last valid token, the KL penalty on every token when
    the KL is in the reward, else zeros), ``[B, C]`` each."""
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    token_rewards = torch.where(last, scores[:, None], 0.0)
    kl_penalty = torch.zeros_like(token_rewards)
    if kl.in_reward(cfg.kl.placement) and beta > 0:
        est = cfg.kl.estimator
        shaped = losses.kl_reward(
            token_rewards,
            old.logp,
            logp_ref,
            mask,
            beta=beta,
            estimator=est,
            estimate=old.kl if needs_exact_kl(est) else None,
        )
        kl_penalty = shaped - token_rewards
    return token_rewards, kl_penalty


def reward_totals(
    cfg: TrainConfig, reward_fns: list, batch: rewards.RewardBatch, device: torch.device
) -> tuple[Tensor, Tensor | None, dict[str, list[float | None]]]:
    """(the total reward of each sample ``[B]``, 0 where unscored; which samples some function
    scored ``[B]`` bool, None when all; each function's values). With no reward function (a
    teacher alone distils the policy) every total is 0 and counts as scored."""
    if not reward_fns:
        return torch.zeros(len(batch.completions), device=device), None, {}
    totals, per_fn = rewards.combined_rewards(reward_fns, batch)
    unscored = [i for i, t in enumerate(totals) if t is None]
    if unscored and ALGORITHMS[cfg.algo.name].critic:
        raise rewards.RewardError(
            f"no reward function scored sample {unscored[0]} (every one returned None for "
            f"completion {batch.completions[unscored[0]]!r}), and {cfg.algo.name} trains a "
            "critic on every completion's reward; return a number for every sample, or use a "
            "critic-free algorithm (grpo, rloo, reinforce++), which leave unscored samples out"
        )
    scores = torch.tensor([t or 0.0 for t in totals], dtype=torch.float32, device=device)
    scored = None
    if unscored:
        scored = torch.tensor([t is not None for t in totals], dtype=torch.bool, device=device)
    return scores, scored, per_fn


@torch.no_grad()
def score(
    cfg: TrainConfig,
    m: Models,
    rollout: Rollout,
    reward_fns: list,
    beta: float,
    dist: Dist | None = None,
    *,
    examples: list[Example] | None = None,
    state: rewards.TrainerState | None = None,
    totals: tuple[Tensor, Tensor | None, dict[str, list[float | None]]] | None = None,
    fill_old: bool | None = None,
) -> Scored:
    """Rewards, log-probs, values and advantages of this rank's share of the step's rollouts;
    ``dist`` (default: a world of one) holds the other shares, for batch-wide whitening;
    ``examples`` (the share's prompts) give the reward functions every column of the data,
    ``state`` the run's progress (:func:`reward_batch`); ``totals``, the rewards where they
    were computed already (dynamic sampling, :mod:`klpo.train.step.dynamic`), so that no reward
    function is called twice on a completion. ``fill_old``: pi_old's pass here (True), left to
    the update's forward (False), or as :func:`~klpo.train.step.types.update_gives_logp_old`
    says (None, the trainer's rule; :func:`reference_and_old`)."""
    # The sampler returns the rollout on the CPU; from here on it lives with the models.
    rollout = rollout.to(next(m.reference.parameters()).device)
    # algo.packing: on plans the packed layout once, here; every later pass over these rows
    # (the update's micro-batches included) computes each sequence where this one does
    rollout = pack_rows(rollout, cfg.algo.packing == "on")
    mask = rollout.mask
    batch = reward_batch(rollout, examples, state)
    if totals is None:
        scores, scored, per_fn = reward_totals(cfg, reward_fns, batch, mask.device)
    else:
        scores, scored, per_fn = totals
        scores, scored = scores.to(mask.device), None if scored is None else scored.to(mask.device)
    fill = fill_old if cfg.teacher is None else True  # the teacher reads pi_old's pass
    logp_ref, hidden_ref, old, hidden = reference_and_old(cfg, m, rollout, fill_old=fill)
    token_rewards, kl_penalty = _shaped_rewards(cfg, scores, old, logp_ref, mask, beta)
    ts, own_token = None, None
    if cfg.teacher is not None:  # on-policy distillation: the teacher's scores (and penalty)
        ts = teacher_scores(cfg, m, rollout, hidden, old.logp)
        if cfg.teacher.placement == "reward":
            penalty = teacher_penalty(cfg, ts, old.logp, mask)
            if cfg.teacher.credit == "returns":
                kl_penalty = kl_penalty + penalty
            else:
                own_token = penalty
    spec, g = ALGORITHMS[cfg.algo.name], rollout.group_size
    values_old = torch.where(mask, values(m.critic_core, rollout), 0.0) if spec.critic else None
    inputs = AdvantageInputs(
        scores, token_rewards, kl_penalty, mask, g, values_old, dist or Dist(), scored=scored
    )
    adv, returns = spec.advantages(cfg.algo, inputs)
    if own_token is not None:  # discount 0: each token's own penalty, no returns
        adv = adv + own_token
    metrics = reward_metrics(scores, per_fn, rollout, g, scored)
    if cfg.gold_reward:
        metrics.merge(gold_metrics(cfg.gold_reward, batch, scores, scored))
    return Scored(
        rollout, scores, old, logp_ref, hidden_ref, adv, returns, values_old, metrics,
        per_reward=per_fn, scored=scored, teacher=ts,
    )  # fmt: skip
