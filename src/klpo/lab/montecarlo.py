r"""Monte Carlo statistics of every estimator: Gaussians streamed, categoricals and sequences sampled.

**Gaussians** (:func:`gaussian_monte_carlo`): samples are drawn in chunks of 2^20, the log-probs
computed once per chunk and every estimator evaluated by :func:`klpo.kl.estimate` on the same
samples (common random numbers: differences between estimators are measured more precisely than
each alone). ``ref_is`` gets its own samples of pi_ref. Statistics are merged chunk by chunk in
float64 (:class:`klpo.lab.stats.RunningStats`).

**Categoricals and sequences** (:func:`monte_carlo`): n sequences are drawn from the exact
sequence probabilities (``torch.multinomial`` over the enumeration, seeded). Every per-sample
quantity is a function of the sequence alone, so the sample mean of any statistic equals the same
statistic under the empirical distribution ``counts / n``: the lab reuses the per-sequence tables
of :mod:`klpo.lab.exact` with those weights. This is the Monte Carlo estimate itself (not an
approximation of it), costs O(N) whatever n is, and gives the mean and per-component variance of
the per-sample gradient (:func:`klpo.lab.exact.gradient_moments`). ``adaptive_mix`` depends on the
order of the samples and is run as a stream: the samples are cut into batches of ``batch``, each
batch's a computed from the window of past batch outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from klpo import kl
from klpo._names import LiveNames
from klpo.lab.distributions import GaussianPair, SequencePair
from klpo.lab.exact import (
    LAB_ESTIMATORS,
    REF_ESTIMATORS,
    Tables,
    gradient_moments,
    placement_terms,
    placements_of,
    samples_ref,
    target_of,
)
from klpo.lab.ref_is import AdaptiveMix, AdaptiveMixStream, ref_is_terms
from klpo.lab.stats import RunningStats, ValueStats

__all__ = [
    "GAUSSIAN_ESTIMATORS",
    "MonteCarloResult",
    "gaussian_monte_carlo",
    "monte_carlo",
    "sample_indices",
]

GAUSSIAN_ESTIMATORS: Sequence[str] = LiveNames(
    lambda: (n for n in LAB_ESTIMATORS if n not in kl.ESTIMATORS or n in kl.LOGPROB_ESTIMATORS),
    "Every estimator defined for a Gaussian: :data:`LAB_ESTIMATORS` but those that need a "
    "vocabulary's logits (``kl.SPECS[name].needs_logits``: ``full``); read when used.",
)

CHUNK = 1 << 20


def gaussian_monte_carlo(
    mu: float,
    samples: int,
    *,
    seed: int = 0,
    names: Sequence[str] = GAUSSIAN_ESTIMATORS,
    mix: AdaptiveMix = AdaptiveMix(),
    batch: int = 64,
    chunk: int = CHUNK,
) -> dict[str, ValueStats]:
    """Per-sample value statistics of ``names`` for pi_theta = N(0, 1), pi_ref = N(mu, 1).

    Args:
        mu: the reference's mean; true KL = mu² / 2.
        samples: n, samples of pi_theta (and, for ref_is and adaptive_mix, n more of pi_ref).
        seed: seeds one ``torch.Generator``; the same seed gives the same numbers.
        names: estimators from :data:`GAUSSIAN_ESTIMATORS`.
        mix: the settings of ``adaptive_mix``, whose window runs over batches of ``batch``.
        chunk: samples per chunk (rounded down to a multiple of ``batch``).

    Returns:
        ``{name: ValueStats}`` with ``samples = n`` (the mix uses only whole batches).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    unknown = [n for n in names if n not in GAUSSIAN_ESTIMATORS]
    if unknown:
        raise ValueError(
            f"estimator(s) {', '.join(unknown)} not defined for a Gaussian; choose from "
            f"{', '.join(GAUSSIAN_ESTIMATORS)}"
        )
    pair = GaussianPair(mu)
    gen = torch.Generator().manual_seed(seed)
    stats = {n: RunningStats() for n in names}
    need_ref = any(samples_ref(n) for n in names)
    theta_names = [n for n in names if n in kl.ESTIMATORS]
    stream = AdaptiveMixStream(mix) if "adaptive_mix" in names else None
    chunk = max(batch, chunk // batch * batch)
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        done += n
        logp, logp_ref = pair.log_probs(pair.sample_theta(n, gen))
        values: dict[str, Tensor] = {}
        for name in theta_names:
            values[name] = kl.estimate(name, logp, logp_ref, logp_old=logp)
        if need_ref or stream is not None:
            logp_r, logp_ref_r = pair.log_probs(pair.sample_ref(n, gen))
            for name, clip in REF_ESTIMATORS.items():
                if name in names or (name == "ref_is" and stream is not None):
                    values[name] = ref_is_terms(logp_r, logp_ref_r, clip=clip)
        if stream is not None:
            k1 = values.get("k1")
            if k1 is None:
                k1 = kl.estimate("k1", logp, logp_ref)
            whole = n // batch * batch
            if whole:
                k1_b = k1[:whole].view(-1, batch)
                ris_b = values["ref_is"][:whole].view(-1, batch)
                a, _ = stream.step(k1_b.mean(-1), ris_b.mean(-1))
                a = a.to(k1_b.dtype)[:, None]
                stats["adaptive_mix"].add((a * k1_b + (1 - a) * ris_b).flatten())
        for name in names:
            if name != "adaptive_mix":
                stats[name].add(values[name])
    return {n: s.result(pair.true_kl) for n, s in stats.items()}


def sample_indices(probs: Tensor, n: int, generator: torch.Generator) -> Tensor:
    """``[n]`` indices drawn with replacement from the distribution ``probs`` ``[N]``."""
    parts, left = [], n
    while left > 0:
        m = min(left, 1 << 22)
        parts.append(torch.multinomial(probs, m, replacement=True, generator=generator))
        left -= m
    return torch.cat(parts)


@dataclass
class MonteCarloResult:
    """Monte Carlo statistics on one pair.

    ``gradients[name][placement] = (mean [P, V], var [P, V])``: the sample mean of the per-sample
    gradient and the (population) variance of one sample's gradient, per component.
    """

    samples: int
    seed: int
    values: dict[str, ValueStats] = field(default_factory=dict)
    gradients: dict[str, dict[str, tuple[Tensor, Tensor]]] = field(default_factory=dict)


def monte_carlo(
    pair: SequencePair,
    samples: int,
    *,
    seed: int = 0,
    names: Sequence[str] = LAB_ESTIMATORS,
    mix: AdaptiveMix = AdaptiveMix(),
    batch: int = 64,
    gradients: bool = True,
    tables: Tables | None = None,
) -> MonteCarloResult:
    """Monte Carlo value and gradient statistics from ``samples`` sequences of each sampler.

    Estimators on pi_theta share one set of n samples; ``ref_is`` and ``ref_is_clip`` share one
    of pi_ref (drawn after pi_theta's, and only when needed). ``adaptive_mix`` (values only) pairs the i-th sample of each in batches of
    ``batch``. Exact and Monte Carlo use the same targets (KL over whole sequences).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    tables = tables or Tables(pair)
    gen = torch.Generator().manual_seed(seed)
    needs = {"theta" if n in kl.ESTIMATORS else "ref" for n in names}
    if "adaptive_mix" in names:
        needs |= {"theta", "ref"}
    idx = {
        k: sample_indices(probs, samples, gen)
        for k, probs in (("theta", pair.probs), ("ref", pair.probs_ref))
        if k in needs
    }
    n_all = pair.num_sequences
    weights = {
        k: torch.bincount(v, minlength=n_all).to(torch.float64) / samples for k, v in idx.items()
    }
    targets = {kl.THETA_REF: pair.kl_theta_ref, kl.REF_THETA: pair.kl_ref_theta}
    result = MonteCarloResult(samples=samples, seed=seed)
    for name in names:
        if name == "adaptive_mix":
            continue
        tab = tables[name]
        w = weights[tab.sampler]
        result.values[name] = ValueStats.weighted(tab.value, w, targets[target_of(name)], samples)
        if gradients:
            result.gradients[name] = {}
            for p in placements_of(name):
                mean, second = gradient_moments(pair, w, *placement_terms(tab, p))
                result.gradients[name][p] = (mean, (second - mean * mean).clamp_min(0.0))
    if "adaptive_mix" in names:
        size = min(batch, samples)
        whole = samples // size * size
        k1 = tables["k1"].value[idx["theta"][:whole]].view(-1, size)
        ris = tables["ref_is"].value[idx["ref"][:whole]].view(-1, size)
        a, _ = AdaptiveMixStream(mix).step(k1.mean(-1), ris.mean(-1))
        a = a[:, None]
        stats = RunningStats()
        stats.add((a * k1 + (1 - a) * ris).flatten())
        result.values["adaptive_mix"] = stats.result(pair.kl_theta_ref)
    return result
