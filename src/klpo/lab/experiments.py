"""The experiments of ``klpo lab report``; each returns plain JSON-able data (dicts, lists, floats).

- :func:`schulman_table`: Schulman's 2020 table (mu = 0.1 and 1), exact and Monte Carlo;
- :func:`mu_sweep`: value statistics of every estimator across a sweep of mu (true KL mu²/2);
- :func:`oracle`: exact values and gradients on a given pair, checked against Monte Carlo;
- :func:`gradient_cosines`: the cosine of each estimator × placement's expected gradient to both
  true gradients, across random LM-like categoricals of growing KL;
- :func:`ref_is_variants`: bias and spread of ``ref_is`` with and without clipping or
  self-normalisation against the KL;
- :func:`drift`: ``adaptive_mix`` and its components while pi_theta drifts away from pi_ref.

Non-finite floats are kept as ``nan``/``inf`` here; :func:`klpo.lab.report.to_json` turns them
into ``null``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from klpo import kl
from klpo.lab.distributions import SequencePair, drift_path, lm_pair
from klpo.lab.exact import (
    LAB_ESTIMATORS,
    ExactResult,
    analyse,
    gaussian_moments,
    gaussian_quadrature,
    placements_of,
)
from klpo.lab.montecarlo import (
    GAUSSIAN_ESTIMATORS,
    gaussian_monte_carlo,
    monte_carlo,
    sample_indices,
)
from klpo.lab.ref_is import SEED_CLIP, AdaptiveMix, adaptive_mix, ref_is
from klpo.lab.stats import cosine, relative_error

__all__ = [
    "SCHULMAN_PUBLISHED",
    "drift",
    "gradient_cosines",
    "gradient_table",
    "mu_sweep",
    "oracle",
    "ref_is_variants",
    "schulman_table",
]

Tick = Callable[[], None]

SCHULMAN_PUBLISHED: dict[float, dict[str, tuple[float, float]]] = {
    # (bias / true KL, sd / true KL) as printed in J. Schulman, "Approximating KL Divergence"
    # (2020). The 0.002 for k2 at mu = 0.1 is Monte Carlo noise around the exact 0.0025.
    0.1: {"k1": (0.0, 20.0), "k2": (0.002, 1.42), "k3": (0.0, 1.42)},
    1.0: {"k1": (0.0, 2.0), "k2": (0.25, 1.73), "k3": (0.0, 1.7)},
}


def _noop() -> None:
    return None


# --------------------------------------------------------------------------------------------
# Gaussians.


def schulman_table(samples: int, seed: int, tick: Tick = _noop) -> list[dict]:
    """Schulman's table for mu = 0.1 and 1: published, exact closed form and Monte Carlo.

    Each row: ``mu, estimator, published_bias_rel, published_sd_rel, exact_bias_rel,
    exact_sd_rel, exact_frac_negative, mc_bias_rel, mc_bias_rel_se, mc_sd_rel, mc_sd_rel_se,
    mc_frac_negative, z_mean, z_sd, within_4se``, where z is (Monte Carlo - exact) / standard
    error. ``ref_is`` (not in the post) is added for comparison.
    """
    rows = []
    names = ("k1", "k2", "k3", "ref_is")
    for i, (mu, published) in enumerate(SCHULMAN_PUBLISHED.items()):
        mc = gaussian_monte_carlo(mu, samples, seed=seed + i, names=names)
        true = 0.5 * mu * mu
        for name in names:
            mean, var, frac = gaussian_moments(name, mu)
            s = mc[name]
            z_mean = (s.mean - mean) / s.stderr if s.stderr else math.nan
            z_sd = (s.sd - math.sqrt(var)) / s.sd_stderr if s.sd_stderr else math.nan
            pub = published.get(name, (math.nan, math.nan))
            rows.append(
                {
                    "mu": mu,
                    "true_kl": true,
                    "estimator": name,
                    "published_bias_rel": pub[0],
                    "published_sd_rel": pub[1],
                    "exact_bias_rel": (mean - true) / true,
                    "exact_sd_rel": math.sqrt(var) / true,
                    "exact_frac_negative": frac,
                    "mc_bias_rel": s.bias / true,
                    "mc_bias_rel_se": s.stderr / true,
                    "mc_sd_rel": s.sd / true,
                    "mc_sd_rel_se": s.sd_stderr / true,
                    "mc_frac_negative": s.frac_negative,
                    "z_mean": z_mean,
                    "z_sd": z_sd,
                    "within_4se": abs(z_mean) <= 4 and abs(z_sd) <= 4,
                }
            )
        tick()
    return rows


def mu_sweep(mus: list[float], samples: int, seed: int, tick: Tick = _noop) -> dict:
    """Value statistics of every Gaussian estimator at each mu: exact (quadrature) and Monte Carlo.

    Returns ``{"mu": [...], "true_kl": [...], "samples": n, "estimators": {name: {"bias_rel",
    "bias_rel_se", "sd_rel", "sd_rel_se", "frac_negative", "rmse_rel", "exact_bias_rel",
    "exact_sd_rel", "exact_frac_negative", "z_mean", "z_sd": [one per mu]}}}`` (Monte Carlo
    unless prefixed ``exact_``; z = (Monte Carlo - exact) / se). ``adaptive_mix``'s exact values
    are at its steady-state weight, its Monte Carlo values from the stream.
    """
    out: dict = {"mu": list(mus), "true_kl": [0.5 * m * m for m in mus], "samples": samples}
    keys = (
        "bias_rel", "bias_rel_se", "sd_rel", "sd_rel_se", "frac_negative", "rmse_rel",
        "exact_bias_rel", "exact_sd_rel", "exact_frac_negative", "z_mean", "z_sd",
    )  # fmt: skip
    est: dict[str, dict[str, list]] = {n: {k: [] for k in keys} for n in GAUSSIAN_ESTIMATORS}
    for i, mu in enumerate(mus):
        mc = gaussian_monte_carlo(mu, samples, seed=seed + i)
        true = 0.5 * mu * mu
        for name, s in mc.items():
            mean, var, frac = gaussian_quadrature(name, mu)
            d = est[name]
            for k, v in s.to_dict(("bias_rel", "sd_rel", "frac_negative", "rmse_rel")).items():
                d[k].append(v)
            d["bias_rel_se"].append(s.stderr / true)
            d["sd_rel_se"].append(s.sd_stderr / true)
            d["exact_bias_rel"].append((mean - true) / true)
            d["exact_sd_rel"].append(math.sqrt(var) / true)
            d["exact_frac_negative"].append(frac)
            d["z_mean"].append((s.mean - mean) / s.stderr if s.stderr else math.nan)
            d["z_sd"].append((s.sd - math.sqrt(var)) / s.sd_stderr if s.sd_stderr else math.nan)
        tick()
    out["estimators"] = est
    return out


# --------------------------------------------------------------------------------------------
# Exact gradients and their Monte Carlo check.


def _follows(g: torch.Tensor, g_tr: torch.Tensor, g_rt: torch.Tensor) -> str:
    """Which true gradient ``g`` is: exactly, as a positive multiple, zero, or neither."""
    scale = max(float(g_tr.norm()), float(g_rt.norm()))
    if float(g.norm()) <= 1e-9 * scale:
        return "zero"
    for target, label in (
        (g_tr, "grad KL(pi_theta ‖ pi_ref)"),
        (g_rt, "grad KL(pi_ref ‖ pi_theta)"),
    ):
        if relative_error(g, target) <= 1e-9:
            return label
        if cosine(g, target) >= 1 - 1e-12:
            return f"{float(g.norm()) / float(target.norm()):.4g} × {label}"
    return "neither"


def gradient_table(result: ExactResult) -> list[dict]:
    """One row per estimator × placement: cosine and relative error to each true gradient."""
    rows = []
    for name, by_placement in result.gradients.items():
        for placement, g in by_placement.items():
            rows.append(
                {
                    "estimator": name,
                    "placement": placement,
                    "cos_theta_ref": cosine(g, result.grad_theta_ref),
                    "cos_ref_theta": cosine(g, result.grad_ref_theta),
                    "rel_err_theta_ref": relative_error(g, result.grad_theta_ref),
                    "rel_err_ref_theta": relative_error(g, result.grad_ref_theta),
                    "follows": _follows(g, result.grad_theta_ref, result.grad_ref_theta),
                }
            )
    return rows


def oracle(pair: SequencePair, samples: int, seed: int) -> dict:
    """Exact values and gradients on ``pair`` and their Monte Carlo check (4 standard errors).

    Returns ``{"kl": {...}, "mix_weight": a*, "values": {name: {...}}, "gradients": [rows of
    gradient_table], "exact_gradients": {name: {placement: [[V] per prefix]}},
    "true_gradients": {...}, "monte_carlo": {"samples", "seed", "value_checks",
    "gradient_checks", "value_failures", "gradient_failures", "max_abs_z_value", "max_abs_z_gradient"}}``.
    """
    ex = analyse(pair)
    mc = monte_carlo(pair, samples, seed=seed)
    values = {}
    value_z = []
    for name, s in ex.values.items():
        m = mc.values[name]
        diff = m.mean - s.mean
        if abs(diff) <= 1e-12 * max(1.0, abs(s.mean)):  # equal up to rounding (sd 0: full, T = 1)
            z = 0.0
        else:
            z = diff / m.stderr if m.stderr > 0 else math.inf
        value_z.append(z)
        values[name] = {
            **s.to_dict(("mean", "bias", "sd", "frac_negative")),
            "mc_mean": m.mean,
            "mc_stderr": m.stderr,
            "z": z,
        }
    grad_z = []
    for name, by_p in mc.gradients.items():
        for p, (mean, var) in by_p.items():
            se = (var / samples).sqrt()
            diff = (mean - ex.gradients[name][p]).abs()
            zero = se <= 1e-12
            if bool(zero.any()):
                grad_z.append(0.0 if float(diff[zero].max()) <= 1e-10 else math.inf)
            if bool((~zero).any()):
                grad_z.append(float((diff[~zero] / se[~zero]).max()))
    return {
        "kl": {"theta_ref": ex.kl_theta_ref, "ref_theta": ex.kl_ref_theta},
        "mix_weight": ex.mix_weight,
        "values": values,
        "gradients": gradient_table(ex),
        "true_gradients": {
            "theta_ref": ex.grad_theta_ref.tolist(),
            "ref_theta": ex.grad_ref_theta.tolist(),
        },
        "exact_gradients": {
            n: {p: g.tolist() for p, g in gp.items()} for n, gp in ex.gradients.items()
        },
        "monte_carlo": {
            "samples": samples,
            "seed": seed,
            "value_checks": len(value_z),
            "value_failures": sum(abs(z) > 4 for z in value_z),
            "max_abs_z_value": max(abs(z) for z in value_z),
            "gradient_checks": len(grad_z),
            "gradient_failures": sum(z > 4 for z in grad_z),
            "max_abs_z_gradient": max(grad_z),
        },
    }


def gradient_cosines(
    vocab: int, kls: list[float], draws: int, seed: int, tick: Tick = _noop
) -> dict:
    """Cosines of every estimator × placement's exact expected gradient to both true gradients.

    For each target KL(pi_theta ‖ pi_ref) in ``kls``, ``draws`` random LM-like categoricals
    (:func:`klpo.lab.distributions.lm_pair`, Zipf policy over ``vocab`` tokens, reference perturbed)
    are enumerated exactly. Returns ``{"vocab", "kl", "draws", "rows": {"name|placement":
    {"cos_theta_ref": [mean over draws per KL], "cos_ref_theta": [...], "rel_err_theta_ref": [...]}}}``;
    a NaN cosine means the expected gradient is zero.
    """
    gen = torch.Generator().manual_seed(seed)
    keys = [(n, p) for n in LAB_ESTIMATORS for p in placements_of(n)]
    acc = {
        k: {
            "cos_theta_ref": [],
            "cos_ref_theta": [],
            "rel_err_theta_ref": [],
            "rel_err_ref_theta": [],
        }
        for k in keys
    }
    for target in kls:
        per = {k: {m: [] for m in acc[k]} for k in keys}
        for _ in range(draws):
            ex = analyse(lm_pair(vocab, target, generator=gen))
            for row in gradient_table(ex):
                k = (row["estimator"], row["placement"])
                for m in per[k]:
                    per[k][m].append(row[m])
            tick()
        for k in keys:
            for m in acc[k]:
                acc[k][m].append(float(np.mean(per[k][m])))
    return {
        "vocab": vocab,
        "kl": list(kls),
        "draws": draws,
        "rows": {f"{n}|{p}": v for (n, p), v in acc.items()},
    }


# --------------------------------------------------------------------------------------------
# ref_is variants.

VARIANTS: dict[str, dict] = {
    "ref_is": {},
    "clip [0.1, 10]": {"clip": SEED_CLIP},
    "clip [0.5, 2]": {"clip": (0.5, 2.0)},
    "clip [0.01, 100]": {"clip": (0.01, 100.0)},
    "dynamic clip (mean ± 3 sd)": {"dynamic_clip": True},
    "self-normalised": {"self_normalised": True},
}
"""The ``ref_is`` variants measured; the first four per-sample, the last two per batch."""


def ref_is_variants(
    vocab: int, kls: list[float], batch: int, batches: int, seed: int, tick: Tick = _noop
) -> dict:
    """Bias and spread of batch estimates of ``ref_is`` variants, k1 and k3 against the KL.

    For each target KL, one random LM-like categorical pair (vocab ``vocab``); ``batches`` batches
    of ``batch`` samples of pi_ref (ref_is variants) and of pi_theta (k1, k3). Per estimator:
    ``bias_rel`` = (mean - KL)/KL with its standard error, ``sd_rel`` = sd of one batch estimate /
    KL; plus the largest weight seen and the mean effective sample size (sum w)² / sum w² / n.
    Estimators that are means of per-sample terms (k1, k3, ref_is and the fixed clips) also get
    exact values by enumeration: ``exact_bias_rel`` and ``exact_sd_rel`` (per-sample sd / sqrt(n)).
    The dynamic clip and self-normalisation act on the whole batch: Monte Carlo only.
    """
    gen = torch.Generator().manual_seed(seed)
    names = [*VARIANTS, "k1", "k3"]
    out: dict = {"vocab": vocab, "kl": [], "batch": batch, "batches": batches}
    series = {
        n: {k: [] for k in ("bias_rel", "bias_rel_se", "sd_rel", "exact_bias_rel", "exact_sd_rel")}
        for n in names
    }
    per_sample = {"ref_is": None, "k1": None, "k3": None} | {
        n: o["clip"] for n, o in VARIANTS.items() if set(o) == {"clip"}
    }
    extra: dict[str, list] = {
        "max_weight": [],
        "ess_fraction": [],
        "exact_sd_rel_k1": [],
        "exact_sd_rel_ref_is": [],
    }
    for target in kls:
        pair = lm_pair(vocab, target, generator=gen)
        true = pair.kl_theta_ref
        out["kl"].append(true)
        logp_all = torch.log_softmax(pair.logits[0], -1)
        logp_ref_all = torch.log_softmax(pair.logits_ref[0], -1)
        idx_r = sample_indices(pair.probs_ref, batch * batches, gen).view(batches, batch)
        idx_t = sample_indices(pair.probs, batch * batches, gen).view(batches, batch)
        lp, lr = logp_all[idx_r], logp_ref_all[idx_r]
        estimates = {n: ref_is(lp, lr, **opts) for n, opts in VARIANTS.items()}
        lt, ltr = logp_all[idx_t], logp_ref_all[idx_t]
        estimates["k1"] = kl.estimate("k1", lt, ltr).mean(-1)
        estimates["k3"] = kl.estimate("k3", lt, ltr).mean(-1)
        for n in names:
            e = estimates[n]
            series[n]["bias_rel"].append(float(e.mean() - true) / true)
            series[n]["bias_rel_se"].append(float(e.std()) / math.sqrt(batches) / true)
            series[n]["sd_rel"].append(float(e.std()) / true)
        w = (lp - lr).exp()
        extra["max_weight"].append(float(w.max()))
        extra["ess_fraction"].append(float((w.sum(-1) ** 2 / (w * w).sum(-1) / batch).mean()))
        ex = analyse(pair, ("k1", "k3", "ref_is"), gradients=False)
        extra["exact_sd_rel_k1"].append(ex.values["k1"].sd / true)
        extra["exact_sd_rel_ref_is"].append(ex.values["ref_is"].sd / true)
        w_all = (logp_all - logp_ref_all).exp()
        for n in names:
            if n not in per_sample:
                series[n]["exact_bias_rel"].append(math.nan)
                series[n]["exact_sd_rel"].append(math.nan)
                continue
            if n in ex.values:
                mean, sd = ex.values[n].mean, ex.values[n].sd
            else:  # a fixed clip: enumerate clamp(w, lo, hi) log w over pi_ref
                lo, hi = per_sample[n]
                terms = w_all.clamp(lo, hi) * (logp_all - logp_ref_all)
                probs_ref = logp_ref_all.exp()
                mean = float((probs_ref * terms).sum())
                sd = math.sqrt(float((probs_ref * (terms - mean).square()).sum()))
            series[n]["exact_bias_rel"].append((mean - true) / true)
            series[n]["exact_sd_rel"].append(sd / math.sqrt(batch) / true)
        tick()
    out["estimators"] = series
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------
# Drift.

MIX_AS_WRITTEN = AdaptiveMix(gamma=10.0, threshold=0.5, window=10)
MIX_AS_DESCRIBED = AdaptiveMix(gamma=-10.0, threshold=0.5, window=10)


def drift(
    vocab: int,
    steps: int,
    max_kl: float,
    runs: int,
    batch: int,
    seed: int,
    tick: Tick = _noop,
) -> dict:
    """pi_theta drifts away from a fixed Zipfian pi_ref; every estimator tracks the KL.

    At each step s = 0..steps, each of ``runs`` independent runs draws ``batch`` samples of pi_ref
    (ref_is) and ``2 · batch`` of pi_theta (k1 and k3 use the first ``batch``; "k1 (2n)" all of
    them, the sample budget of the mix). ``adaptive_mix`` mixes k1 and ref_is (both on ``batch``
    samples) with gamma = +10 (the formula as written in the seed) and gamma = -10 (its prose),
    threshold 0.5 nats, window 10 steps. Returns per-step true KL, and per estimator the mean,
    sd and RMSE over runs; and the mean weight a on k1 of each mix.
    """
    gen = torch.Generator().manual_seed(seed)
    logits_ref, path = drift_path(vocab, steps, max_kl, generator=gen)
    logp_ref_all = torch.log_softmax(logits_ref, -1)
    probs_ref = logp_ref_all.exp()
    n = batch
    series: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("k1", "k1 (2n samples)", "k3", "ref_is", "ref_is clip [0.1, 10]")
    }
    true_kl = []
    for s in range(steps + 1):
        logp_all = torch.log_softmax(path[s], -1)
        true_kl.append(float((logp_all.exp() * (logp_all - logp_ref_all)).sum()))
        idx_t = sample_indices(logp_all.exp(), runs * 2 * n, gen).view(runs, 2 * n)
        idx_r = sample_indices(probs_ref, runs * n, gen).view(runs, n)
        k1 = kl.estimate("k1", logp_all[idx_t], logp_ref_all[idx_t])
        series["k1"].append(k1[:, :n].mean(-1))
        series["k1 (2n samples)"].append(k1.mean(-1))
        series["k3"].append(
            kl.estimate("k3", logp_all[idx_t[:, :n]], logp_ref_all[idx_t[:, :n]]).mean(-1)
        )
        lp, lr = logp_all[idx_r], logp_ref_all[idx_r]
        series["ref_is"].append(ref_is(lp, lr))
        series["ref_is clip [0.1, 10]"].append(ref_is(lp, lr, clip=SEED_CLIP))
        tick()
    stacked = {k: torch.stack(v, dim=-1) for k, v in series.items()}  # [runs, steps + 1]
    weights = {}
    for label, settings in (
        ("adaptive_mix (gamma = +10, as written)", MIX_AS_WRITTEN),
        ("adaptive_mix (gamma = -10, as described)", MIX_AS_DESCRIBED),
    ):
        a, mix = adaptive_mix(stacked["k1"], stacked["ref_is"], settings)
        stacked[label] = mix
        weights[label] = a.mean(0).tolist()
    kl_t = torch.tensor(true_kl, dtype=torch.float64)
    estimators = {}
    for k, v in stacked.items():
        err = v - kl_t
        estimators[k] = {
            "mean": v.mean(0).tolist(),
            "sd": v.std(0).tolist(),
            "rmse": err.square().mean(0).sqrt().tolist(),
        }
    return {
        "vocab": vocab,
        "steps": steps,
        "runs": runs,
        "batch": batch,
        "max_kl": max_kl,
        "mix_settings": {
            "threshold": MIX_AS_WRITTEN.threshold,
            "window": MIX_AS_WRITTEN.window,
            "gamma_as_written": MIX_AS_WRITTEN.gamma,
            "gamma_as_described": MIX_AS_DESCRIBED.gamma,
        },
        "true_kl": true_kl,
        "estimators": estimators,
        "mix_weight_on_k1": weights,
    }
