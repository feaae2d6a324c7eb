"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, §3.2): keep only groups with signal.

A group whose rewards are all equal gets advantages of exactly 0 under a group baseline (GRPO,
Dr. GRPO, RLOO): it adds tokens to the step's denominator and nothing to its gradient. With
``rollout.dynamic_sampling`` the step drops such groups and samples more prompts, a round of
``rollout.prompts_per_step`` at a time, until it holds ``rollout.prompts_per_step`` groups with
signal or ``rollout.dynamic_sampling_max_rounds`` rounds were sampled. It then trains on the
groups kept, the first ones in the order they were drawn (a round's surplus is dropped, as DAPO's
batch is filled and cut); when no group was kept it trains on the first round's batch, which has
no signal (so ``algo.skip_no_signal`` skips its optimizer steps). Every prompt drawn comes from the
run's prompt stream, whose position the checkpoint saves, so a resumed run draws what the whole
run draws. The rewards of the kept groups are handed to scoring (no reward function is called
twice on a completion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example
from klpo.train.rewards.functions import TrainerState
from klpo.train.rollout.reward_batch import reward_batch
from klpo.train.rollout.samplers import Rollout
from klpo.train.step.score import reward_totals

__all__ = ["Sampled", "constant_groups", "sample_with_signal"]


def constant_groups(scores: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """``[N]`` bool: True for each group of ``group_size`` consecutive rows of ``scores``
    (``[N * group_size]``) whose scored rewards are all equal, or of which fewer than two were
    scored (``scored`` ``[N * group_size]`` bool, None: all); such a group has no group-relative
    signal."""
    s = scores.detach().double().view(-1, group_size)
    ok = torch.ones_like(s, dtype=torch.bool) if scored is None else scored.view(-1, group_size)
    hi = torch.where(ok, s, -torch.inf).amax(-1)
    lo = torch.where(ok, s, torch.inf).amin(-1)
    return (ok.sum(-1) < 2) | (hi == lo)


@dataclass
class Sampled:
    """What the step trains on: its prompts, their rollout and rewards, and the rollout/* metrics."""

    examples: list[Example]
    rollout: Rollout
    totals: tuple[Tensor, Tensor | None, dict[str, list[float | None]]]
    metrics: dict[str, float]


def _rows(totals, groups: list[int], g: int):
    scores, scored, per_fn = totals
    rows = [i * g + j for i in groups for j in range(g)]
    idx = torch.tensor(rows, dtype=torch.long)
    return (
        scores[idx],
        None if scored is None else scored[idx],
        {k: [v[r] for r in rows] for k, v in per_fn.items()},
    )


def _cat(parts):
    scores = torch.cat([p[0] for p in parts])
    if all(p[1] is None for p in parts):
        scored = None
    else:
        scored = torch.cat(
            [torch.ones_like(p[0], dtype=torch.bool) if p[1] is None else p[1] for p in parts]
        )
    per_fn = {k: [x for p in parts for x in p[2][k]] for k in parts[0][2]}
    return scores, scored, per_fn


def sample_with_signal(
    cfg: TrainConfig, stream, engine, reward_fns: list, state: TrainerState
) -> Sampled:
    """Sample rounds of ``rollout.prompts_per_step`` prompts from ``stream`` with ``engine``
    until that many groups with signal are kept or the round cap is reached (module docstring)."""
    n, g = cfg.rollout.prompts_per_step, cfg.rollout.group_size
    kept_ex: list[Example] = []
    kept_ro: list[Rollout] = []
    kept_tot: list = []
    first = None
    rounds = dropped = 0
    while len(kept_ex) < n and rounds < cfg.rollout.dynamic_sampling_max_rounds:
        rounds += 1
        examples = stream.next(n)
        rollout = engine.sample([e.prompt for e in examples], [e.answer for e in examples])
        batch = reward_batch(rollout, examples, state)
        totals = reward_totals(cfg, reward_fns, batch, torch.device("cpu"))
        if first is None:
            first = (examples, rollout, totals)
        flat = constant_groups(totals[0], g, totals[1])
        dropped += int(flat.sum())
        keep = [i for i in range(n) if not flat[i]][: n - len(kept_ex)]
        if keep:
            kept_ex += [examples[i] for i in keep]
            kept_ro.append(rollout.select([i * g + j for i in keep for j in range(g)]))
            kept_tot.append(_rows(totals, keep, g))
    metrics = {
        "rollout/dynamic_rounds": float(rounds),
        "rollout/groups_kept": float(len(kept_ex)),
        "rollout/groups_dropped": float(dropped),
        "rollout/extra_completions": float((rounds - 1) * n * g),
    }
    if not kept_ex:
        examples, rollout, totals = first
        return Sampled(examples, rollout, totals, metrics)
    return Sampled(kept_ex, Rollout.concat(kept_ro), _cat(kept_tot), metrics)
