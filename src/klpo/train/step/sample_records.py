"""A few completions of a step, or of an evaluation, as records for ``samples.jsonl``.

:func:`train_records` reads a scored and updated step (:class:`klpo.train.step.types.Scored`):
its rewards per function, pi_old's and the reference's log-probs and the exact KL at each position
are all there. :func:`eval_records` takes greedy held-out completions
(:class:`klpo.train.evaluate.Evaluation`) and runs the reference and the policy over the few it
records. The record's fields are documented in :mod:`klpo.train.runtime.samples`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.train.config import TrainConfig
from klpo.train.evaluate import Evaluation
from klpo.train.models.build import Models
from klpo.train.rollout.samplers import Rollout
from klpo.train.step.kl_term import needs_exact_kl
from klpo.train.step.score import reference_and_old
from klpo.train.step.types import Scored

__all__ = ["eval_records", "sequence_kls", "spread_rows", "train_records"]


def _estimators(cfg: TrainConfig) -> tuple[str, ...]:
    """k1, k3 and the configured estimator where it reads the sampled tokens' log-probs."""
    names = dict.fromkeys(("k1", "k3", cfg.kl.estimator))
    return tuple(n for n in names if not needs_exact_kl(n) and n not in kl.REF_SAMPLED)


@torch.no_grad()
def sequence_kls(
    cfg: TrainConfig, logp: Tensor, logp_ref: Tensor, exact: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """``{"exact": [B], <estimator>: [B]}``: each completion's KL(pi_theta ‖ pi_ref) summed over
    its tokens, the exact per-position KL and each token estimator's value on the tokens."""
    out = {"exact": torch.where(mask, exact.double(), 0.0).sum(-1)}
    for name in _estimators(cfg):
        est = kl.estimate(name, logp, logp_ref, logp_old=logp, mask=mask)
        out[name] = torch.where(mask, est.double(), 0.0).sum(-1)
    return out


def _records(
    step: int,
    split: str,
    rollout: Rollout,
    rows: range | list[int],
    totals: list[float | None],
    per_reward: dict[str, list[float | None]],
    kls: dict[str, Tensor],
) -> list[dict[str, Any]]:
    lengths = rollout.mask.sum(-1).tolist()
    truncated = rollout.truncated.tolist() if rollout.truncated is not None else None
    return [
        {
            "step": step,
            "split": split,
            "index": i,
            "prompt": rollout.prompts[i],
            "completion": rollout.completions[i],
            "answer": rollout.answers[i],
            "reward": totals[i],
            "rewards": {name: values[i] for name, values in per_reward.items()},
            "kl": {name: float(v[i]) for name, v in kls.items()},
            "length": int(lengths[i]),
            "truncated": bool(truncated[i]) if truncated is not None else None,
        }
        for i in rows
    ]


def spread_rows(n: int, batch: int, group: int) -> list[int]:
    """``n`` rows of a batch of consecutive groups of ``group`` completions, spread over the
    prompts: the first completion of each group, then the second, ...; in batch order.

    >>> spread_rows(4, 32, 8), spread_rows(5, 8, 4)
    ([0, 8, 16, 24], [0, 1, 2, 4, 5])
    """
    group = max(1, min(group, batch))
    order = [g + j for j in range(group) for g in range(0, batch, group) if g + j < batch]
    return sorted(order[: max(0, n)])


def train_records(cfg: TrainConfig, s: Scored, step: int, n: int) -> list[dict[str, Any]]:
    """``n`` completions of a scored and updated step (its SamplingPass is filled), spread over
    its prompts (:func:`spread_rows`): a few copies of one prompt would show little."""
    rows = spread_rows(n, len(s.rollout.completions), cfg.rollout.group_size)
    if not rows:
        return []
    kls = sequence_kls(cfg, s.old.logp, s.logp_ref, s.old.kl, s.rollout.mask)
    ok = [True] * len(s.scores) if s.scored is None else s.scored.tolist()
    totals = [float(x) if k else None for x, k in zip(s.scores.tolist(), ok, strict=True)]
    return _records(step, "train", s.rollout, rows, totals, s.per_reward, kls)


@torch.no_grad()
def eval_records(
    cfg: TrainConfig, m: Models, ev: Evaluation, step: int, n: int
) -> list[dict[str, Any]]:
    """The first ``n`` greedy held-out completions of an evaluation, with their sequence KL
    (one forward of the reference and of the policy over those ``n``)."""
    k = min(n, len(ev.first.completions))
    if k == 0:
        return []
    rollout = ev.first.select(list(range(k))).to(next(m.reference.parameters()).device)
    logp_ref, _, old, _ = reference_and_old(cfg, m, rollout, fill_old=True)
    kls = sequence_kls(cfg, old.logp, logp_ref, old.kl, rollout.mask)
    scores = ev.scores[:k]
    return _records(step, "eval", rollout, range(k), scores, {ev.reward: scores}, kls)
