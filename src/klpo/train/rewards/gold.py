"""The gold reward: logged beside the trained-on (proxy) reward every step, never trained on.

``gold_reward`` (default ``exact_match`` on ``data.source: builtin-overopt``) is scored on the
step's sampled completions (:func:`gold_metrics`) and is the reward held-out accuracy is measured
with (:func:`eval_reward`); see :mod:`klpo.train.rewards.overopt` and docs/overopt.md.
"""

from __future__ import annotations

from typing import Any

import torch

from klpo.train.config.data import SOURCE_REWARDS
from klpo.train.rewards import functions as rewards_mod
from klpo.train.runtime.metrics import Tally

__all__ = ["eval_reward", "gold_metrics"]


def gold_metrics(
    gold: str,
    batch: rewards_mod.RewardBatch,
    scores: torch.Tensor,
    scored: torch.Tensor | None = None,
) -> Tally:
    """``reward/gold`` (the gold reward's mean over the completions it scores) and
    ``reward/proxy`` (the mean of ``scores``, the trained-on total, over the completions some
    trained-on function scored: ``scored``, None for all), as sums."""
    fn = rewards_mod.get_reward(gold)
    values = [v for v in rewards_mod.score(fn, gold, batch) if v is not None]
    ok = torch.ones_like(scores, dtype=torch.bool) if scored is None else scored
    t = Tally()
    t.add("reward/gold", sum(values), len(values))
    t.add("reward/proxy", float(torch.where(ok, scores.double(), 0.0).sum()), float(ok.sum()))
    return t


def eval_reward(cfg: Any) -> str:
    """The reward that held-out accuracy is scored with: the gold reward if there is one, else
    the first reward that is not a reward model, else the built-in task's own reward (a
    distillation run on the chat task, ``rewards: []``, is scored by ``numeric`` as the task's
    other runs are), else ``exact_match``."""
    if cfg.gold_reward:
        return cfg.gold_reward
    trained = next((t.name for t in cfg.rewards if t.name != "model"), None)
    return trained or SOURCE_REWARDS.get(cfg.data.source, "exact_match")
