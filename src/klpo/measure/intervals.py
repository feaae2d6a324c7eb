"""Cosines and projections of expected gradients with jackknife intervals, and the verdict
against :func:`klpo.kl.explain`'s answer."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.measure.objectives import TARGETS, objective_names


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (Simpson's rule on the
    density and bisection; no scipy)."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # P(T <= x) for x >= 0, after the substitution x = tan(s)
        n = 400
        a, b = 0.0, math.atan(x)
        h = (b - a) / n
        total = 0.0
        for i in range(n + 1):
            s = a + i * h
            w = 1 if i in (0, n) else (4 if i % 2 else 2)
            c = math.cos(s)
            total += w * math.exp(log_c - (df + 1) / 2 * math.log1p(math.tan(s) ** 2 / df)) / c**2
        return 0.5 + total * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def _u_stats(gram: Tensor) -> tuple[Tensor, Tensor]:
    """From ``gram [P, G, G]`` (``<a_k, b_l>`` for P pairs and G groups): the U-statistic
    ``sum_{k != l} <a_k, b_l> / (G (G - 1))``, unbiased for ``<E a, E b>``, on all G groups
    ``[P]`` and leaving out each group in turn ``[P, G]``."""
    g = gram.shape[-1]
    total = gram.sum((-1, -2))
    diag = gram.diagonal(dim1=-2, dim2=-1)
    full = (total - diag.sum(-1)) / (g * (g - 1))
    out_k = total[:, None] - gram.sum(-1) - gram.sum(-2) + diag  # the sum without group k
    loo = (out_k - (diag.sum(-1, keepdim=True) - diag)) / ((g - 1) * (g - 2))
    return full, loo


def interval_stats(
    vectors: Tensor, pairs: list[tuple[int, int]], level: float = 0.95
) -> list[dict]:
    r"""Cosines and projections with confidence intervals, for each pair ``(a, b)`` of vectors.

    ``vectors [O, G, D]`` holds, for each objective, G independent and identically distributed
    replicates (each group of completions: one completion of every prompt). The estimands are
    properties of the expected vectors mu_a = E[a_k]:

    - the cosine rho = <mu_a, mu_b> / (|mu_a| |mu_b|), estimated by rho_hat = U_ab /
      sqrt(U_aa U_bb) with U the unbiased U-statistics of :func:`_u_stats`. The plain cosine of
      the sums (also returned, ``cos_plain``) has |sum|² = G² |mu|² + G tr(Cov) in expectation:
      noise inflates the norms and pulls it towards 0 (or, where the noises correlate, anywhere),
      so it is no estimate of rho; U_aa removes the noise term. rho_hat is undefined (None) where
      U_aa <= 0: the expected vector is not told from zero.
    - the projection beta = <mu_a, mu_b> / |mu_b|², estimated by U_ab / U_bb: 1 where the
      expected gradients are equal, 0 where mu_a = 0. Unlike the cosine it is smooth at both
      exact answers, so its interval is the one the verdicts use.

    Intervals: delete-one-group jackknife standard errors (Efron & Stein 1981; the jackknife of
    a smooth function of U-statistics, Arvesen 1969), ``estimate ± t_{G-1, (1+level)/2} · se``.
    Needs G >= 3.
    """
    g = vectors.shape[1]
    if g < 3:
        raise ValueError(f"intervals need at least 3 groups of completions, got {g}")
    need = sorted({x for a, b in pairs for x in ((a, b), (a, a), (b, b))})
    index = {p: i for i, p in enumerate(need)}
    gram = torch.stack([vectors[a] @ vectors[b].T for a, b in need])
    full, loo = _u_stats(gram)
    sums = vectors.sum(1)
    tq = t_quantile((1 + level) / 2, g - 1)

    def jack(est: Tensor, reps: Tensor) -> float:
        ok = torch.isfinite(reps)
        if not bool(ok.all()):
            return math.inf
        return float(((g - 1) / g * ((reps - reps.mean()) ** 2).sum()).sqrt())

    out = []
    for a, b in pairs:
        ab, aa, bb = full[index[a, b]], full[index[a, a]], full[index[b, b]]
        lab, laa, lbb = loo[index[a, b]], loo[index[a, a]], loo[index[b, b]]
        na, nb = float(sums[a].norm()), float(sums[b].norm())
        row: dict[str, Any] = {
            "cos_plain": float(sums[a] @ sums[b]) / (na * nb) if na > 0 and nb > 0 else None,
            "cos": None,
            "cos_se": None,
            "beta": None,
            "beta_se": None,
            "norm_ratio": float(aa / bb).__pow__(0.5) if bb > 0 and aa > 0 else None,
        }
        if aa > 0 and bb > 0:
            rho = ab / (aa * bb).sqrt()
            reps = torch.where(
                (laa > 0) & (lbb > 0), lab / (laa * lbb).clamp(min=1e-300).sqrt(), math.nan
            )
            row["cos"], row["cos_se"] = float(rho), jack(rho, reps)
        if bb > 0:
            beta = ab / bb
            reps = torch.where(lbb > 0, lab / lbb.clamp(min=1e-300), math.nan)
            row["beta"], row["beta_se"] = float(beta), jack(beta, reps)
        row["half_width"] = {
            k: (tq * row[f"{k}_se"] if row[f"{k}_se"] is not None else None)
            for k in ("cos", "beta")
        }
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# What each objective should follow: klpo.kl.explain's answers, as a projection's exact value.


def claim(estimator: str, placement: str) -> tuple[str, int, float] | None:
    """``(what, target index, exact projection)`` for a row whose expected gradient is known.

    From :func:`klpo.kl.explain` (on-policy): ``loss`` and ``reward`` as it answers them (its
    ``reward`` is the doctor's per-token penalty), a zero gradient as a projection of 0 on the
    per-position KL(pi_theta ‖ pi_ref) gradient. ``reward-to-go``: E[sum_t grad logp_t
    sum_{t' >= t} est_t'] is the sequence KL's gradient exactly when the t' = t term gives grad
    K_t (the reward's answer is grad KL(pi_theta ‖ pi_ref)) and the later terms' expectations are
    K_t' (the value is unbiased for it), as for k1 (the policy-gradient theorem with the
    log-ratio as the return). None for the rest ("other (biased)").
    """
    place = "reward" if placement == "reward-to-go" else placement
    ex = kl.explain(estimator, place)  # type: ignore[arg-type]
    if placement == "reward-to-go":
        if ex.gradient == kl.GRAD_THETA_REF and ex.unbiased and ex.estimates == kl.THETA_REF:
            return ("grad seq KL(θ‖ref)", 2, 1.0)
        return None
    if ex.gradient == kl.GRAD_THETA_REF:
        return ("grad KL(θ‖ref)", 0, 1.0)
    if ex.gradient == kl.GRAD_REF_THETA:
        return ("grad KL(ref‖θ)", 1, 1.0)
    if ex.gradient == kl.GRAD_ZERO:
        return ("zero", 0, 0.0)
    return None


def verdict(beta: float | None, half: float | None, exact: float, n: int) -> dict[str, Any]:
    """Whether a projection's interval excludes its exact value, and the completions that would
    tell its distance from noise: the half-width falls as 1/sqrt(n), so ``n (half / |beta -
    exact|)²`` completions give an interval as wide as the distance seen now."""
    if beta is None or half is None or not math.isfinite(half):
        return {"status": "undefined", "decide_at": None}
    dist = abs(beta - exact)
    tol = half + 1e-9 * max(1.0, abs(exact))  # float64 rounding of an exact equality
    if dist > tol:
        return {"status": "inconsistent", "decide_at": None}
    decide = None if dist == 0 else math.ceil(n * (half / dist) ** 2 - 1e-9)
    return {"status": "consistent", "decide_at": decide}


# --------------------------------------------------------------------------------------------
# The memory the measurement will take, said before it starts.


def gradient_rows(vectors: Tensor, rows: int) -> list[dict[str, Any]]:
    """One row per estimator × placement: its intervals against every target gradient, and the
    verdict on the gradient :func:`claim` says it follows."""
    names_o = objective_names()
    pairs = [(o, t) for o in range(len(TARGETS), len(names_o)) for t in range(len(TARGETS))]
    stats = interval_stats(vectors, pairs)
    table: list[dict[str, Any]] = []
    for (o, t), s in zip(pairs, stats, strict=True):
        if t == 0:
            est_name, place = names_o[o]
            table.append({"estimator": est_name, "placement": place, "targets": {}})
        table[-1]["targets"][TARGETS[t]] = s
    for row in table:
        c = claim(row["estimator"], row["placement"])
        row["claim"] = None
        if c is not None:
            what, t, exact = c
            s = row["targets"][TARGETS[t]]
            row["claim"] = {
                "gradient": what,
                "target": TARGETS[t],
                "projection": exact,
                **verdict(s["beta"], s["half_width"]["beta"], exact, rows),
            }
    return table


# --------------------------------------------------------------------------------------------
# For people.
