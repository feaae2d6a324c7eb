"""The gold reward: logged beside the trained-on (proxy) reward every step, never trained on.

``gold_reward`` (default ``exact_match`` on ``data.source: builtin-overopt``) is scored on the
step's sampled completions (:func:`gold_metrics`) and is the reward held-out accuracy is measured
with (:func:`eval_reward`); see :mod:`klpo.train.rewards.overopt` and docs/overopt.md.
"""

from __future__ import annotations

from typing import Any

import torch

from klpo.train.rewards import functions as rewards_mod

__all__ = ["eval_reward", "gold_metrics"]


def gold_metrics(gold: str, rollout: Any, scores: torch.Tensor) -> dict[str, float]:
    """``reward/gold`` (the gold reward's mean over the rollout's completions) and
    ``reward/proxy`` (the mean of ``scores``, the trained-on total)."""
    fn = rewards_mod.get_reward(gold)
    values = rewards_mod.score(fn, gold, rollout.prompts, rollout.completions, rollout.answers)
    return {
        "reward/gold": sum(values) / len(values),
        "reward/proxy": float(scores.float().mean()),
    }


def eval_reward(cfg: Any) -> str:
    """The reward that held-out accuracy is scored with: the gold reward if there is one, else
    the first reward that is not a reward model, else ``exact_match``."""
    if cfg.gold_reward:
        return cfg.gold_reward
    return next((t.name for t in cfg.rewards if t.name != "model"), "exact_match")
