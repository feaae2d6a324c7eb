r"""Exact statistics by closed form (Gaussians) and by enumeration (categoricals, sequences).

**Gaussians** (:func:`gaussian_moments`). pi_theta = N(0, 1), pi_ref = N(mu, 1), x ~ pi_theta:
``d = log pi_theta(x) - log pi_ref(x) = mu²/2 - mu x ~ N(m, s²)`` with m = mu²/2, s² = mu².
For a normal d, E[e^{-d}] = e^{-m + s²/2} = 1 and E[d e^{-d}] = e^{-m+s²/2} (m - s²) = -mu²/2
(exponential tilting), and Var(d²) = 2 s⁴ + 4 m² s². Hence

| estimator | mean | variance | P(value < 0) |
| --- | --- | --- | --- |
| k1 = d | mu²/2 | mu² | Phi(-|mu|/2) |
| k2 = d²/2 | mu²/2 + mu⁴/8 | mu⁴/2 + mu⁶/4 | 0 |
| k3 = e^{-d} + d - 1 | mu²/2 | (e^{mu²} - 1) + mu² - 2 mu² = e^{mu²} - 1 - mu² | 0 |
| ref_is = w log w, x ~ pi_ref | mu²/2 | e^{mu²}(mu² + 9 mu⁴/4) - mu⁴/4 | Phi(|mu|/2) |

(k3: Var e^{-d} = e^{-2m+2s²} - 1 = e^{mu²} - 1 and Cov(e^{-d}, d) = -mu²/2 - mu²/2 = -mu².
ref_is: E_ref[w² L²] = E_theta[e^d d²] = e^{m+s²/2} ((m+s²)² + s²) = e^{mu²}(9mu⁴/4 + mu²).)
These reproduce Schulman's table (J. Schulman, "Approximating KL Divergence", 2020).

**Enumeration** (:class:`Tables`, :func:`analyse`). Every sequence y of a :class:`SequencePair`
is enumerated with its probability. For each estimator the lab builds, per sequence, the value
``sum_t est_t(y)`` and the per-token coefficient ``c_t = d est_t / d logp_t``. Because
``d log pi_theta(y_t | y_<t) / d logits[row] = e_{y_t} - pi(. | y_<t)``, the per-sample gradient of
a placement with respect to the ``[P, V]`` logits is, at row(y_<t),

    g_t(y) = alpha · h[row] + coef_t(y) · (e_{y_t} - pi[row])

with, for samples y ~ pi_theta (the placements of :mod:`klpo.kl` and docs/estimators.md):

- ``"loss"``: coef = c_t (the per-token term summed over the sequence and differentiated with
  the samples held fixed); for ``full`` alpha = 1 and h[row] is the gradient of the exact KL at the
  prefix (its value does not depend on y_t);
- ``"reward"``: coef = G_t = sum_{s >= t} sg(est_s) (the detached estimate as a per-token reward
  with returns-to-go, gamma = 1, REINFORCE);
- ``"reward+loss"``: the sum.

``ref_is`` samples y ~ pi_ref; its only placement is ``"loss"``, with the sequence-level
coefficient ``d (w log w) / d log pi_theta(y)`` on every token. The expected gradient is
``sum_y weight(y) g(y)``, accumulated per row in O(N T) without materialising per-sample
gradients (:func:`gradient_moments`, which also gives the second moment for Monte Carlo).
The true gradients of both KLs come from autograd of the exact sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from klpo import kl
from klpo._names import LiveNames
from klpo.lab.distributions import GaussianPair, SequencePair
from klpo.lab.ref_is import SEED_CLIP, AdaptiveMix, ref_is_terms
from klpo.lab.stats import ValueStats

__all__ = [
    "GAUSSIAN_EXACT",
    "LAB_ESTIMATORS",
    "REF_ESTIMATORS",
    "ExactResult",
    "SampleTable",
    "Tables",
    "analyse",
    "gaussian_moments",
    "gaussian_quadrature",
    "gradient_moments",
    "placements_of",
    "samples_ref",
    "target_of",
    "true_gradients",
]

REF_ESTIMATORS: dict[str, tuple[float, float] | None] = {"ref_is": None, "ref_is_clip": SEED_CLIP}
"""The forms of ``ref_is`` the lab measures (:func:`klpo.lab.ref_is.ref_is_terms`) with their
weight clip: klpo's ``ref_is`` and the lab's clipped variant. With the mix of klpo's
``adaptive_mix`` (``kl.SPECS[name].mixed``), they are the lab's samples of pi_ref."""


def _lab_names() -> tuple[str, ...]:
    mixed = tuple(n for n in kl.REF_SAMPLED if kl.SPECS[n].mixed)
    return (*kl.ESTIMATORS, *REF_ESTIMATORS, *mixed)


LAB_ESTIMATORS: Sequence[str] = LiveNames(
    _lab_names,
    "Every estimator the lab measures, in report order: :data:`klpo.kl.ESTIMATORS` (read when "
    "used, so a registered one is measured too), the forms of ``ref_is`` and ``adaptive_mix``.",
)


def samples_ref(name: str) -> bool:
    """Whether the lab measures ``name`` on samples of pi_ref: a form of ``ref_is``, or a
    reference-sampled estimator of :data:`klpo.kl.SPECS` (``adaptive_mix``, in the loss only)."""
    return name in REF_ESTIMATORS or name in kl.REF_SAMPLED


GAUSSIAN_EXACT: tuple[str, ...] = ("k1", "k2", "k3", "ref_is")
"""The estimators with closed-form Gaussian moments."""


def target_of(name: str) -> str:
    """The KL an estimator's value is meant to estimate (:data:`klpo.kl.THETA_REF` or REF_THETA)."""
    if name in REF_ESTIMATORS:
        return kl.THETA_REF
    if name in kl.REF_SAMPLED:
        return kl.SPECS[name].target
    return kl.explain(name, "loss").estimates


def placements_of(name: str) -> tuple[str, ...]:
    """The placements measured for ``name``: all three for samples of pi_theta, else "loss"."""
    return ("loss",) if samples_ref(name) else kl.PLACEMENTS


def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_moments(name: str, mu: float) -> tuple[float, float, float]:
    """Exact (mean, variance, P(value < 0)) of one sample of ``name`` for N(0, 1) vs N(mu, 1).

    See the module docstring for the derivation. ``name`` is one of :data:`GAUSSIAN_EXACT`.
    """
    m2 = mu * mu
    if name == "k1":
        return m2 / 2, m2, _phi(-abs(mu) / 2) if mu != 0 else 0.0
    if name == "k2":
        return m2 / 2 + m2 * m2 / 8, m2 * m2 / 2 + m2**3 / 4, 0.0
    if name == "k3":
        return m2 / 2, math.expm1(m2) - m2, 0.0
    if name == "ref_is":
        var = math.exp(m2) * (m2 + 9 * m2 * m2 / 4) - m2 * m2 / 4
        return m2 / 2, var, _phi(abs(mu) / 2) if mu != 0 else 0.0
    raise ValueError(f"no closed form for {name!r}; choose one of {', '.join(GAUSSIAN_EXACT)}")


def _gaussian_grid(mu: float, points: int) -> tuple[Tensor, Tensor]:
    """A trapezoid grid wide enough for every integrand below, and its spacing-times-ones weights.

    The heaviest integrands are Gaussians centred at -mu (ref_is's second moment) and 2 mu (k3's),
    of unit sd, so [-2|mu| - 14, 2|mu| + 14] loses less than e^-98 of their mass.
    """
    half = 2 * abs(mu) + 14.0
    x = torch.linspace(-half, half, points, dtype=torch.float64)
    h = torch.full_like(x, 2 * half / (points - 1))
    h[0] = h[-1] = h[0] / 2
    return x, h


def gaussian_quadrature(
    name: str, mu: float, *, mix: AdaptiveMix = AdaptiveMix(), points: int = 1 << 17
) -> tuple[float, float, float]:
    """Exact (mean, variance, P(value < 0)) of any Gaussian estimator by 1-D quadrature.

    The estimator is evaluated by :func:`klpo.kl.estimate` (or :func:`ref_is_terms`) on a grid of x
    and integrated against the sampler's density with the trapezoid rule, which converges
    exponentially fast for these smooth, Gaussian-tailed integrands (relative error ~1e-12 against
    :func:`gaussian_moments`; ~1e-7 where ``abs`` or a clamp has a kink; ~1e-4 absolute for
    P(value < 0)). ``adaptive_mix`` is evaluated at its steady state a* = sigmoid(gamma (mu²/2 -
    threshold)), one independent sample of k1 and one of ref_is.
    """
    pair = GaussianPair(mu)
    x, h = _gaussian_grid(mu, points)
    if name == "adaptive_mix":
        a = mix.weight(pair.true_kl)
        m1, v1, _ = gaussian_quadrature("k1", mu, points=points)
        m2, v2, _ = gaussian_quadrature("ref_is", mu, points=points)
        # k1 = d ~ N(mu²/2, mu²): P(a k1 + (1 - a) Y < 0) = E_Y[Phi((-(1 - a) Y / a - mu²/2) / |mu|)]
        logp, logp_ref = pair.log_probs(x)
        dens = (logp_ref.exp() * h)[None]
        y = ref_is_terms(logp, logp_ref)
        if mu == 0:
            frac = 0.0
        elif a <= 0.0:
            frac = float((dens[0] * (y < 0)).sum())
        else:
            z = (-(1 - a) * y / a - pair.true_kl) / abs(mu)
            frac = float((dens[0] * 0.5 * torch.erfc(-z / math.sqrt(2.0))).sum())
        return a * m1 + (1 - a) * m2, a * a * v1 + (1 - a) ** 2 * v2, frac
    logp, logp_ref = pair.log_probs(x)
    if name in REF_ESTIMATORS:
        values = ref_is_terms(logp, logp_ref, clip=REF_ESTIMATORS[name])
        dens = logp_ref.exp() * h
    elif name in kl.LOGPROB_ESTIMATORS:
        values = kl.estimate(name, logp, logp_ref, logp_old=logp)
        dens = logp.exp() * h
    else:
        raise ValueError(f"{name!r} is not defined for a Gaussian (it needs a vocabulary)")
    mean = float((dens * values).sum())
    var = float((dens * (values - mean).square()).sum())
    return mean, var, float(dens[values < 0].sum())


# --------------------------------------------------------------------------------------------
# Per-sequence tables.


@dataclass(frozen=True)
class SampleTable:
    """One estimator evaluated on every enumerated sequence.

    Attributes:
        sampler: ``"theta"`` (samples of pi_theta) or ``"ref"`` (samples of pi_ref).
        value: ``[N]`` the sequence-level value ``sum_t est_t(y)`` (``w log w`` for ref_is).
        token_value: ``[N, T]`` the detached per-token values at sampling time (for returns).
        coef: ``[N, T]`` ``d value / d logp_t`` (the loss placement's coefficient).
        table: ``[P, V]`` the per-prefix gradient of ``full`` (its loss part), else None.
    """

    sampler: str
    value: Tensor
    token_value: Tensor
    coef: Tensor
    table: Tensor | None = None


class Tables:
    """Per-sequence tables of every estimator on one :class:`SequencePair`, computed on demand."""

    def __init__(self, pair: SequencePair) -> None:
        self.pair = pair
        self._cache: dict[str, SampleTable] = {}

    def __getitem__(self, name: str) -> SampleTable:
        if name not in self._cache:
            self._cache[name] = self._build(name)
        return self._cache[name]

    def _build(self, name: str) -> SampleTable:
        pair = self.pair
        if name in REF_ESTIMATORS:
            seq_logp = pair.seq_logp.clone().requires_grad_(True)
            value = ref_is_terms(seq_logp, pair.seq_logp_ref, clip=REF_ESTIMATORS[name])
            (c,) = torch.autograd.grad(value.sum(), seq_logp)
            coef = c[:, None].expand(-1, pair.length)
            return SampleTable("ref", value.detach(), torch.zeros_like(coef), coef)
        rows = pair.enumeration.rows
        if kl.SPECS[name].needs_logits:  # full: the exact KL at each prefix
            theta = pair.logits.clone().requires_grad_(True)
            per_prefix = kl.estimate(
                name, None, None, logits=theta[None], logits_ref=pair.logits_ref[None]
            )[0]
            (table,) = torch.autograd.grad(per_prefix.sum(), theta)
            token_value = per_prefix.detach()[rows]
            coef = torch.zeros_like(token_value)
            return SampleTable("theta", token_value.sum(-1), token_value, coef, table)
        logp = pair.token_logps(pair.logits).clone().requires_grad_(True)
        logp_ref = pair.token_logps(pair.logits_ref)
        est = kl.estimate(name, logp, logp_ref, logp_old=logp.detach())
        (coef,) = torch.autograd.grad(est.sum(), logp)
        token_value = est.detach()
        return SampleTable("theta", token_value.sum(-1), token_value, coef)

    def weights(self, sampler: str) -> Tensor:
        """``[N]`` the exact probability of each sequence under the sampler."""
        return self.pair.probs if sampler == "theta" else self.pair.probs_ref


def placement_terms(tab: SampleTable, placement: str) -> tuple[Tensor, Tensor | None]:
    """(coef ``[N, T]``, h ``[P, V]`` or None) of the per-sample gradient of a placement."""
    if placement not in kl.PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; choose one of {kl.PLACEMENTS}")
    if tab.sampler == "ref" and placement != "loss":
        raise ValueError("estimators on samples of pi_ref have only the 'loss' placement")
    if placement == "loss":
        return tab.coef, tab.table
    returns = tab.token_value.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{s >= t} est_s
    if placement == "reward":
        return returns, None
    return tab.coef + returns, tab.table


def gradient_moments(
    pair: SequencePair, weights: Tensor, coef: Tensor, table: Tensor | None
) -> tuple[Tensor, Tensor]:
    r"""First and second moments of the per-sample gradient, ``[P, V]`` each.

    The per-sample gradient at row r = row(y_<t) is ``alpha h[r] + coef_t(y) (e_{y_t} - pi[r])``
    (alpha = 1 when ``table`` is given), and rows of one sequence are distinct (prefix lengths
    differ), so per component j, with delta = [y_t = j] and delta² = delta,

        E[g_j]  = alpha W_r h_j + M_rj - M_r pi_j
        E[g_j²] = alpha W_r h_j² + 2 alpha h_j (M_rj - M_r pi_j) + S_rj (1 - 2 pi_j) + S_r pi_j²

    where, summing over the sequences that visit row r with their ``weights``: W_r = sum w,
    M_r = sum w coef, M_rj = sum w coef delta, S_r = sum w coef², S_rj = sum w coef² delta.

    Args:
        weights: ``[N]`` probabilities of the enumerated sequences (exact: the sampler's
            probabilities; Monte Carlo: sample counts / n), summing to 1.
        coef: ``[N, T]``; table: ``[P, V]`` or None (see :func:`placement_terms`).
    """
    e = pair.enumeration
    num_rows, vocab = pair.logits.shape
    pi = torch.softmax(pair.logits, -1)
    rows = e.rows.flatten()
    cells = rows * vocab + e.tokens.flatten()
    w = weights.to(torch.float64)[:, None].expand_as(coef).flatten()
    c = coef.to(torch.float64).flatten()
    keep = w > 0  # skip unsampled sequences (their coefficients may be huge or inf)
    rows, cells, w, c = rows[keep], cells[keep], w[keep], c[keep]
    wc, wc2 = w * c, w * c * c

    def per_row(x: Tensor) -> Tensor:
        return torch.zeros(num_rows, dtype=torch.float64).index_add_(0, rows, x)[:, None]

    def per_cell(x: Tensor) -> Tensor:
        out = torch.zeros(num_rows * vocab, dtype=torch.float64).index_add_(0, cells, x)
        return out.view(num_rows, vocab)

    m_r, m_rj = per_row(wc), per_cell(wc)
    s_r, s_rj = per_row(wc2), per_cell(wc2)
    centred = m_rj - m_r * pi
    mean = centred.clone()
    second = s_rj * (1 - 2 * pi) + s_r * pi * pi
    if table is not None:
        w_r = per_row(w)
        mean += w_r * table
        second += w_r * table * table + 2 * table * centred
    return mean, second


def true_gradients(pair: SequencePair) -> tuple[float, float, Tensor, Tensor]:
    """(KL(pi_theta ‖ pi_ref), KL(pi_ref ‖ pi_theta), and their gradients ``[P, V]``).

    Sums over every sequence, differentiated by autograd with respect to the policy logits.
    """
    theta = pair.logits.clone().requires_grad_(True)
    seq_logp = pair.token_logps(theta).sum(-1)
    seq_logp_ref = pair.seq_logp_ref
    kl_tr = (seq_logp.exp() * (seq_logp - seq_logp_ref)).sum()
    kl_rt = (seq_logp_ref.exp() * (seq_logp_ref - seq_logp)).sum()
    g_tr, g_rt = (torch.autograd.grad(x, theta, retain_graph=True)[0] for x in (kl_tr, kl_rt))
    return float(kl_tr.detach()), float(kl_rt.detach()), g_tr, g_rt


# --------------------------------------------------------------------------------------------
# The exact analysis of one pair.


@dataclass
class ExactResult:
    """Exact values and expected gradients of every estimator on one pair.

    ``gradients[name][placement]`` is ``[P, V]``; ``mix_weight`` is the steady-state weight a* on
    k1 at which ``adaptive_mix`` is evaluated (see :func:`analyse`).
    """

    pair: SequencePair
    kl_theta_ref: float
    kl_ref_theta: float
    grad_theta_ref: Tensor
    grad_ref_theta: Tensor
    values: dict[str, ValueStats] = field(default_factory=dict)
    gradients: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    mix_weight: float = math.nan

    def target(self, name: str) -> float:
        return self.kl_theta_ref if target_of(name) == kl.THETA_REF else self.kl_ref_theta


def _mix_frac_negative(a: float, x: Tensor, px: Tensor, y: Tensor, py: Tensor) -> float:
    """P(a X + (1 - a) Y < 0) for independent discrete X (values x, probs px) and Y."""
    if a <= 0.0:
        return float(py[y < 0].sum())
    order = torch.argsort(x)
    xs, cum = x[order], torch.cumsum(px[order], 0)
    cum = torch.cat([torch.zeros(1, dtype=cum.dtype), cum])
    below = torch.searchsorted(xs, -(1 - a) * y / a, side="left")  # count of x < threshold
    return float((py * cum[below]).sum())


def analyse(
    pair: SequencePair,
    names: Sequence[str] = LAB_ESTIMATORS,
    *,
    mix: AdaptiveMix = AdaptiveMix(),
    gradients: bool = True,
    tables: Tables | None = None,
) -> ExactResult:
    """Exact value statistics and expected gradients of ``names`` on ``pair``, by enumeration.

    ``adaptive_mix`` is evaluated at its steady state: a fixed weight
    ``a* = sigmoid(gamma (KL - threshold))``, the weight once the window holds estimates of a
    constant KL (its noise ignored), mixing one independent sample of k1 (y ~ pi_theta) and one of
    ref_is (y ~ pi_ref); its expected loss gradient is ``a* · (k1's) + (1 - a*) · (ref_is's)``.
    """
    tables = tables or Tables(pair)
    kl_tr, kl_rt, g_tr, g_rt = true_gradients(pair)
    result = ExactResult(pair, kl_tr, kl_rt, g_tr, g_rt)
    for name in names:
        if name == "adaptive_mix":
            continue
        tab = tables[name]
        result.values[name] = ValueStats.weighted(
            tab.value, tables.weights(tab.sampler), result.target(name)
        )
        if gradients:
            result.gradients[name] = {
                p: gradient_moments(pair, tables.weights(tab.sampler), *placement_terms(tab, p))[0]
                for p in placements_of(name)
            }
    if "adaptive_mix" in names:
        a = mix.weight(kl_tr)
        result.mix_weight = a
        k1s = result.values.get("k1") or ValueStats.weighted(tables["k1"].value, pair.probs, kl_tr)
        ris = result.values.get("ref_is") or ValueStats.weighted(
            tables["ref_is"].value, pair.probs_ref, kl_tr
        )
        frac = _mix_frac_negative(
            a, tables["k1"].value, pair.probs, tables["ref_is"].value, pair.probs_ref
        )
        result.values["adaptive_mix"] = ValueStats(
            mean=a * k1s.mean + (1 - a) * ris.mean,
            sd=math.sqrt(a * a * k1s.sd**2 + (1 - a) ** 2 * ris.sd**2),
            frac_negative=frac,
            target=kl_tr,
        )
        if gradients:
            parts = [
                gradient_moments(
                    pair, tables.weights(tables[n].sampler), *placement_terms(tables[n], "loss")
                )[0]
                for n in ("k1", "ref_is")
            ]
            result.gradients["adaptive_mix"] = {"loss": a * parts[0] + (1 - a) * parts[1]}
    return result
