"""The step's metrics: token and completion sums over micro-batches and ranks, then ratios.

Every metric is a ratio of sums (:class:`klpo.train.runtime.metrics.Tally`), so it is the whole
batch's at any split over micro-batches and ranks; :func:`finish_metrics` takes the one sum over
ranks and forms the pooled moments (``reward/std``, ``value/explained_var``). The keys are
documented once, in :data:`klpo.train.runtime.metrics.METRICS`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from klpo import advantages, kl, losses, mismatch, offpolicy, reduce
from klpo.train.config import TrainConfig
from klpo.train.rollout.samplers import Rollout
from klpo.train.rollout.versions import SamplerGap
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally
from klpo.train.step.kl_term import KLTerm, needs_exact_kl
from klpo.train.step.types import SamplingPass, Scored

__all__ = [
    "finish_metrics",
    "reward_metrics",
    "sampler_metrics",
    "sampling_metrics",
    "step_metrics",
]


def sampling_metrics(cfg: TrainConfig, old: SamplingPass, logp_ref: Tensor, mask: Tensor) -> Tally:
    """The sampling policy's entropy and KL to the reference, token sums over the rollout."""
    t = Tally()
    means = {
        "entropy": float(reduce.masked_mean(old.entropy, mask)),
        "kl/ref/exact": float(reduce.masked_mean(old.kl, mask)),
    }
    est = cfg.kl.estimator
    names = tuple(
        n
        for n in dict.fromkeys(("k1", "k3", est))
        if not needs_exact_kl(n) and n not in kl.REF_SAMPLED  # those: kl_term.ref_term
    )
    means.update(losses.kl_metrics(old.logp, logp_ref, mask, estimators=names))
    if needs_exact_kl(est):
        means[f"kl/ref/{est}"] = means["kl/ref/exact"]
    t.add_means(means, float(mask.sum()))
    t.add("kl/ref/seq", float(torch.where(mask, old.kl, 0.0).double().sum()), mask.shape[0])
    return t


def reward_metrics(
    scores: Tensor,
    per_fn: dict[str, list[float | None]],
    rollout: Rollout,
    group_size: int,
    scored: Tensor | None = None,
) -> Tally:
    """Rewards, accuracy and completion lengths, as sums over the rollout's completions; the
    rewards over the completions some function scored (``scored``, None: all), each function's
    over those it scored (TRL's ``nanmean``)."""
    t, n = Tally(), len(scores)
    ok = torch.ones_like(scores, dtype=torch.bool) if scored is None else scored
    x, n_ok = torch.where(ok, scores.double(), 0.0), float(ok.sum())
    t.add("reward/mean", float(x.sum()), n_ok)
    t.add("_reward/sq", float((x * x).sum()), n_ok)  # for reward/std, see finish_metrics
    t.add(
        "reward/group_std",
        float(advantages.group_std(x, group_size, valid=scored).sum()) if group_size > 1 else 0.0,
        n / group_size,
    )
    t.add("reward/unscored", n - n_ok, n)
    t.add("accuracy/train", float(((scores >= 1.0) & ok).sum()), n_ok)
    t.add("completion/length", float(rollout.mask.sum()), n)
    t.add("completion/truncated", float(rollout.truncated.sum()), n)
    for k, v in per_fn.items():
        got = [x for x in v if x is not None]
        t.add(f"reward/{k}", sum(got), len(got))
    return t


def finish_metrics(tally: Tally, dist: Dist) -> dict[str, float]:
    """The step's metrics from every rank's tally: one sum over ranks, then the pooled moments."""
    res = tally.result(dist.all_sum)
    out = {k: v for k, (v, _) in res.items() if not k.startswith("_")}
    if "_reward/sq" in res:
        (mean, n), (sq, _) = res["reward/mean"], res["_reward/sq"]
        out["reward/std"] = math.sqrt(max(sq - mean * mean, 0.0) * n / (n - 1)) if n > 1 else 0.0
    if "_value/r" in res:
        r, r2, e, e2 = (res[f"_value/{k}"][0] for k in ("r", "r2", "e", "e2"))
        var_r, var_e = r2 - r * r, e2 - e * e
        out["value/explained_var"] = 1.0 - var_e / var_r if var_r > 0 else 0.0
    return out


def step_metrics(
    cfg: TrainConfig, s: Scored, upd: Tally, dist: Dist, term: KLTerm | None = None
) -> dict[str, float]:
    """Every metric of a scored and updated rollout, reduced over the ranks, and of the step's
    reference samples (``term``)."""
    out = _scored_and_updated(cfg, s, upd, dist)
    if term is not None and term.ref is not None:
        out["ref/samples"] = dist.world * len(term.ref.logp_ref)
        out["time/ref_sample"] = term.ref.seconds
    return out


def _scored_and_updated(cfg: TrainConfig, s: Scored, upd: Tally, dist: Dist) -> dict[str, float]:
    tally = Tally()
    tally.merge(s.metrics)
    tally.merge(sampling_metrics(cfg, s.old, s.logp_ref, s.rollout.mask))
    if s.teacher is not None:  # kl/teacher/*: the teacher's distance at the sampling parameters
        mask = s.rollout.mask
        means = {k: float(reduce.masked_mean(v.double(), mask)) for k, v in s.teacher.means.items()}
        tally.add_means(means, float(mask.sum()))
    tally.merge(upd)
    if s.rollout.engine_logp is None:
        return finish_metrics(tally, dist)
    # The engine's log-probs against the trainer's at the same weights: pi_old, or a stale
    # engine's sampling version (pi_behav); means pool tokens, maxima over ranks.
    r = s.rollout
    mask, own = r.mask, s.old.logp if r.behav_logp is None else r.behav_logp.to(s.old.logp.device)
    gap = mismatch.mismatch_metrics(own, r.engine_logp, mask, cap=cfg.rollout.tis_cap)
    extremes = {k: gap.pop(k) for k in ("engine/k3_max", "engine/abs_max")}
    tally.add_means(gap, float(mask.sum()))
    out = finish_metrics(tally, dist)
    for key, value in extremes.items():
        out[key] = max(float(v) for v in dist.gather_objects(value))
    return out


def sampler_metrics(
    cfg: TrainConfig, s: Scored, gap: SamplerGap, step: int, dist: Dist | None = None
) -> dict[str, float]:
    """A stale sampler's distance to the trainer (``rollout.staleness``): ``rollout/staleness``,
    the batch's lag in versions at ``step``; :func:`klpo.offpolicy.trust_region_metrics` of
    pi_old (the weights that start the step, pi_theta at the first update) against pi_behav on
    the rollout's tokens (the log-probs the policy loss weights with, ``Rollout.sampler_logp``:
    an engine's where one sampled), with ``sampler/masked_frac`` where the policy loss masked tokens
    (``s.keep``: M2PO's, TRM's, at the update's first epoch); and the exact values from ``gap``
    (:func:`klpo.train.rollout.versions.behaviour_pass`, ``[B, C]`` at each position):
    ``sampler/kl_exact`` and ``sampler/kl_exact_max`` of KL(pi_behav ‖ pi_old),
    ``sampler/tv_exact`` and ``sampler/tv_exact_max`` of their total variation.

    Under ``torchrun`` (``dist`` of several ranks) every rank's sufficient statistics
    (:func:`klpo.offpolicy.trust_region_stats`) are gathered in rank order and merged
    (:func:`klpo.offpolicy.merge_trust_region_stats`): every rank logs the metrics of one
    process holding the whole step's batch (up to rounding), the same bits on each;
    ``rollout/staleness`` is the mean of the ranks' lags (the same on each rank)."""
    r, a = s.rollout, cfg.algo
    mask = r.mask
    behav = r.sampler_logp.to(s.old.logp.device)  # the weights' (an engine's, if it sampled)
    keep = None if s.keep is None else s.keep.to(mask.device)
    lag = float(step - 1 - r.behav_version)
    if dist is None or not dist.enabled:
        out = offpolicy.trust_region_metrics(
            s.old.logp, behav, mask, clip_low=a.clip_low, clip_high=a.clip_high, keep=keep
        )
        for name, value in (("kl_exact", gap.kl), ("tv_exact", gap.tv)):
            value = value.to(mask.device).double()
            out[f"sampler/{name}"] = float(reduce.masked_mean(value, mask))
            out[f"sampler/{name}_max"] = (
                float(torch.where(mask, value, 0.0).max()) if mask.any() else 0.0
            )
        out["rollout/staleness"] = lag
        return out
    stats = offpolicy.trust_region_stats(
        s.old.logp, behav, mask, clip_low=a.clip_low, clip_high=a.clip_high, keep=keep,
        token_kl=gap.kl.to(mask.device).double(), token_tv=gap.tv.to(mask.device).double(),
    )  # fmt: skip
    keys = list(stats)
    tokens = stats["tokens"]
    mine = torch.stack(
        [*stats.values(), torch.tensor(lag, dtype=tokens.dtype, device=tokens.device)]
    )
    rows = dist.stack(mine)  # [world, K + 1], every rank's in rank order
    merged = offpolicy.merge_trust_region_stats(
        [dict(zip(keys, row[:-1], strict=True)) for row in rows]
    )
    out = offpolicy.finish_trust_region_stats(merged)
    out["rollout/staleness"] = float(rows[:, -1].sum() / dist.world)
    return out
