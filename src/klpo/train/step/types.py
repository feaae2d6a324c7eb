"""The step's data: what scoring hands the update, and who fills the sampling policy's log-probs.

One step moves these, in order::

    Rollout (rollout/)  ->  Scored (score)  ->  the update's Tally  ->  the step's metrics

The rule for :class:`SamplingPass`, pi_old on the rollout's tokens: it is filled by exactly one
forward pass at the parameters that sampled the rollout. When :func:`update_gives_logp_old` that is
the update's own first forward of each row (its one optimizer step comes after every micro-batch),
and :func:`klpo.train.step.score.score` skips a pass of its own; otherwise scoring fills it before
the update. Either way the update reads log pi_old from it and the step logs the sampling policy's
entropy and KL from it, and nothing else writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from klpo import kl, logprobs
from klpo.train.algorithms import POLICY_LOSSES
from klpo.train.config import TrainConfig
from klpo.train.rollout.samplers import Rollout
from klpo.train.runtime.metrics import Tally

__all__ = ["Optimizers", "SamplingPass", "Scored", "update_gives_logp_old"]


def update_gives_logp_old(cfg: TrainConfig) -> bool:
    """Whether the update's forward pass can stand in for the sampling policy's log-probs.

    With one epoch and one minibatch, every micro-batch's forward runs at the parameters that
    sampled the rollout (the one optimizer step comes after all of them), so its detached
    log-probs are log pi_old (the ratio is exactly 1, as in TRL with ``num_iterations=1``) and its
    entropy and exact KL are those the score pass would have logged. Scoring then skips its
    policy pass, one forward of the policy per step. A KL in the reward needs log pi_old before
    the advantages, and M2PO's mask before the update's first micro-batch, so they keep the pass.
    """
    return (
        cfg.algo.epochs == 1
        and cfg.algo.minibatches == 1
        and not kl.in_reward(cfg.kl.placement)
        and not POLICY_LOSSES[cfg.algo.policy_loss].batch_mask  # (its mask reads pi_old first)
        and cfg.teacher is None  # (its metrics and reward read pi_old's pass before the update)
    )


@dataclass
class SamplingPass:
    """The sampling policy pi_old on the rollout's tokens, ``[B, C]`` each (see the module)."""

    logp: Tensor  # log pi_old of the sampled tokens
    entropy: Tensor  # exact entropy of pi_old at each position
    kl: Tensor  # exact KL(pi_old ‖ pi_ref) at each position
    filled: Tensor  # [B] bool: rows recorded so far

    @classmethod
    def empty(cls, like: Tensor) -> SamplingPass:
        zeros = torch.zeros_like(like)
        return cls(
            zeros,
            zeros.clone(),
            zeros.clone(),
            torch.zeros(like.shape[0], dtype=torch.bool, device=like.device),
        )

    def record(self, rows: Tensor, out: logprobs.FusedOutput) -> None:
        """Keep ``out`` (a forward at the sampling parameters, with the exact KL) for ``rows``."""
        self.logp[rows] = out.logp.detach().to(self.logp.dtype)
        self.entropy[rows] = out.entropy.detach().to(self.entropy.dtype)
        self.kl[rows] = out.kl.detach().to(self.kl.dtype)
        self.filled[rows] = True


@dataclass
class Scored:
    """A rollout scored for the update: rewards, log-probs, advantages (B completions of C tokens)."""

    rollout: Rollout
    scores: Tensor  # [B] total task reward per completion
    old: SamplingPass  # the sampling policy's log-probs, entropy and KL (see SamplingPass)
    logp_ref: Tensor  # [B, C]
    hidden_ref: Tensor  # [B, C, H] the reference's last hidden states ([B, C, V] its logits with
    # model.logits_path: model), for the exact KL
    adv: Tensor  # [B, C]
    returns: Tensor | None  # [B, C] value targets (algorithms with a critic)
    values_old: Tensor | None  # [B, C] (algorithms with a critic)
    metrics: Tally  # rewards, accuracy, lengths
    # each reward function's value of each completion (None: it did not score it)
    per_reward: dict[str, list[float | None]] = field(default_factory=dict)
    scored: Tensor | None = None  # [B] bool: some reward function scored it (None: all did)
    # [B, C] bool: the valid tokens the policy loss's masks keep (M2PO's, TRM's) at the update's
    # first epoch, filled by the update (None: no such mask); the step logs it as
    # sampler/masked_frac
    keep: Tensor | None = None
    teacher: Any = None  # TeacherScores (klpo.train.step.teacher_term) with a teacher, else None


@dataclass
class Optimizers:
    """The update's optimizers: the policy's, and the critic's (algorithms with a critic); the
    policy's learning-rate schedule (``optim.lr_scheduler``), advanced before each step."""

    policy: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
