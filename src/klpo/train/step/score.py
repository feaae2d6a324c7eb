"""Scoring a rollout: rewards, the reference's (and the sampling policy's) log-probs, advantages.

:func:`score` turns this rank's share of the step's rollout into a :class:`Scored`: the rewards
of the configured functions (:mod:`klpo.train.rewards`), the reference's log-probs and hidden
states (for the exact KL, :func:`klpo.logprobs.fused`), pi_old's log-probs, entropy and exact KL
unless the update fills them (:mod:`klpo.train.step.types`), the KL in the reward if asked
(:func:`klpo.losses.kl_reward`), the critic's values, and the algorithm's advantages
(:data:`klpo.train.algorithms.ALGORITHMS`). Everything here runs without gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klpo import kl, logprobs, losses
from klpo.train.algorithms import ALGORITHMS, AdvantageInputs
from klpo.train.config import TrainConfig
from klpo.train.models.build import Models, unwrap
from klpo.train.rewards import functions as rewards
from klpo.train.rewards.gold import gold_metrics
from klpo.train.rollout.samplers import Rollout, completion_hidden, position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.step.kl_term import needs_exact_kl
from klpo.train.step.metrics import reward_metrics
from klpo.train.step.types import SamplingPass, Scored, update_gives_logp_old

__all__ = ["score", "values"]


def values(critic: torch.nn.Module, rollout: Rollout) -> Tensor:
    """``[B, C]`` V(s_t): the critic at the column that predicts completion token t."""
    att = rollout.attention_mask
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    v = critic(rollout.input_ids, att, position_ids(att))
    return v[:, p - 1 : p - 1 + c]


def _reference_and_old(
    cfg: TrainConfig, m: Models, rollout: Rollout
) -> tuple[Tensor, Tensor, SamplingPass]:
    """(the reference's fused outputs, its hidden states and head, pi_old's SamplingPass), with
    pi_old filled here unless the update's forward fills it."""
    tokens = rollout.completion_ids
    weight_ref, bias_ref = m.reference.head()
    hidden_ref = completion_hidden(m.reference, rollout, share_prompt=cfg.rollout.share_prompt)
    ref = logprobs.fused(
        hidden_ref, weight_ref, tokens, bias=bias_ref, temperature=cfg.rollout.temperature
    )
    old = SamplingPass.empty(ref.logp)
    if not update_gives_logp_old(cfg):
        weight, bias = unwrap(m.backbone).head()
        out = logprobs.fused(
            completion_hidden(unwrap(m.backbone), rollout, share_prompt=cfg.rollout.share_prompt),
            weight,
            tokens,
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=hidden_ref,
            weight_ref=weight_ref,
            bias_ref=bias_ref,
        )
        old.record(torch.arange(tokens.shape[0]), out)
    return ref.logp, hidden_ref, old


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


@torch.no_grad()
def score(
    cfg: TrainConfig,
    m: Models,
    rollout: Rollout,
    reward_fns: list,
    beta: float,
    dist: Dist | None = None,
) -> Scored:
    """Rewards, log-probs, values and advantages of this rank's share of the step's rollouts;
    ``dist`` (default: a world of one) holds the other shares, for batch-wide whitening."""
    # The sampler returns the rollout on the CPU; from here on it lives with the models.
    rollout = rollout.to(next(m.reference.parameters()).device)
    mask = rollout.mask
    totals, per_fn = rewards.combined_rewards(
        reward_fns, rollout.prompts, rollout.completions, rollout.answers
    )
    scores = torch.tensor(totals, dtype=torch.float32, device=mask.device)
    logp_ref, hidden_ref, old = _reference_and_old(cfg, m, rollout)
    token_rewards, kl_penalty = _shaped_rewards(cfg, scores, old, logp_ref, mask, beta)
    spec, a, g = ALGORITHMS[cfg.algo.name], cfg.algo, rollout.group_size
    values_old = torch.where(mask, values(m.critic_core, rollout), 0.0) if spec.critic else None
    inputs = AdvantageInputs(
        scores, token_rewards, kl_penalty, mask, g, values_old, dist or Dist(),
        std=a.std, gamma=a.gamma, lam=a.lam,
    )  # fmt: skip
    adv, returns = spec.advantages(inputs)
    metrics = reward_metrics(scores, per_fn, rollout, g)
    if cfg.gold_reward:
        metrics.add_means(gold_metrics(cfg.gold_reward, rollout, scores), len(scores))
    return Scored(rollout, scores, old, logp_ref, hidden_ref, adv, returns, values_old, metrics)
