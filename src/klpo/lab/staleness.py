r"""Exact expected gradients of every KL estimator × placement when the sampler is k versions old.

In asynchronous RL the tokens are drawn by a sampler holding an older policy, pi_behav = pi_{t-k},
while the trainer differentiates pi_theta = pi_t and regularises towards pi_ref. Three policies,
all different; the trainer's own recomputation pi_old equals pi_theta at the first update of a
batch (the proximal policy of Fu et al. 2025, AReaL), so an importance weight pi_theta / pi_old
repairs nothing of the sampler's lag. This module enumerates every outcome (categoricals) and every
sequence (tabular sequence models, :class:`klpo.lab.distributions.SequencePair`) and computes, in
float64, the exact expected gradient with respect to pi_theta's logits of each estimator in each
placement under each **correction** of the behaviour gap, with samples y ~ pi_behav:

| correction | the weight omega_t on token t's term | who does this |
| --- | --- | --- |
| ``none`` | 1 | verl's and SkyRL's KL loss; klpo's ``kl_loss`` given the trainer's pi_old |
| ``is`` | sg(w_t), w_t = pi_theta(y_t) / pi_behav(y_t) | ``kl_loss`` given pi_behav; decoupled PPO's pg |
| ``is-cap`` | sg(min(w_t, C)) | OpenRLHF's ``unbiased_gradient`` (C = 10); truncated IS |
| ``is-seq`` | sg(prod_{s <= t} w_s) (loss), sg(prod_s w_s) (reward) | sequence-level importance sampling |
| ``behav-anchor`` | sg(w_t), the estimate from log pi_behav | AReaL's reward KL on the behaviour log-probs |

Placements, as :func:`klpo.kl.explain` and :mod:`klpo.lab.exact` define them, each token's term
multiplied by omega_t:

- ``loss``: ``sum_t omega_t est_t(y)`` differentiated with the samples held fixed. ``k3_is``
  carries its own weight ``w = exp(logp - logp_old)`` with the gradient through it: under ``none``
  ``logp_old = logp`` (the trainer's pi_old), under ``is`` and ``is-seq`` ``logp_old = log
  pi_behav``, and under ``is-cap`` its gradient is ``min(w, C) d grad logp`` (OpenRLHF's). ``full``
  does not depend on the sampled token, so the token-level corrections leave it as is (as
  :func:`klpo.losses.kl_loss` does) and ``is-seq`` weights it by its prefix's weight only.
- ``reward``: the detached estimate at sampling time ``sg(est_s)`` as a per-token penalty,
  returns-to-go ``G_t = sum_{s >= t} est_s`` (gamma = 1), in the policy gradient
  ``sum_t omega_t G_t grad log pi_theta(y_t)``. The estimate is the trainer's (from log pi_old =
  log pi_theta) except under ``behav-anchor``, where it is computed from log pi_behav.
- ``reward+loss``: the sum.

The expected gradient is ``grad_theta sum_y pi_behav(y) L(y; theta)`` of the per-sample surrogate
``L`` above, by autograd over the enumeration; a categorical is the case of one token. With
``k = 0`` (pi_behav = pi_theta) and ``none`` it is the on-policy gradient of the lab's other
tables. The staleness is a path in logit space: version j's logits are ``logits_theta - (t - j) ·
delta``, with a seeded direction delta per prefix (``step`` logits per version, times a standard
normal), so pi_behav's logits are ``logits_theta - k · delta``.

Facts it checks (tests/lab/test_staleness.py): the uncorrected terms drift from their on-policy
gradients as k grows; ``is`` restores every estimator's on-policy gradient on categoricals exactly;
``k3_is`` under ``is`` follows grad KL(pi_theta ‖ pi_ref) exactly on categoricals, while ``k3``
under ``is`` follows grad KL(pi_ref ‖ pi_theta) (the on-policy k3 direction); the cap C biases
``is-cap`` only where some w > C; on sequences only ``is-seq`` restores the on-policy gradient
(the prefix is the sampler's too).
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from klpo import kl
from klpo.lab.distributions import SequencePair
from klpo.lab.stats import cosine, relative_error

__all__ = [
    "CORRECTIONS",
    "SWEEP_TERMS",
    "ClaimRow",
    "StaleCase",
    "StalenessRow",
    "categorical_cases",
    "cell",
    "claim_markdown",
    "corrections_of",
    "expected",
    "k3_is_claim",
    "markdown_rows",
    "sequence_cases",
    "staleness_rows",
    "sweep_markdown",
]

CORRECTIONS: tuple[str, ...] = ("none", "is", "is-cap", "is-seq", "behav-anchor")
"""How the behaviour gap is corrected (see the module docstring)."""

DEFAULT_CAP = 10.0
"""The importance weight's cap of ``is-cap``: OpenRLHF's (``--algo.kl.unbiased_gradient``)."""

DEFAULT_STEP = 0.2
"""The sd of one policy version's step in logit space."""

_TOL = 1e-9

ON_POLICY = "its on-policy gradient"
"""The label of a term that follows its own on-policy expected gradient, which is no KL's (a
per-token term on sequences, k2 in the reward, ...)."""


@dataclass(frozen=True)
class StaleCase:
    """A policy, its reference and the sampler k versions back, as tabular sequence models.

    Attributes:
        pair: pi_theta (``pair.logits``) and pi_ref (``pair.logits_ref``), ``[P, V]`` each.
        logits_behav: ``[P, V]`` pi_behav's logits, ``pair.logits - k · delta``.
        k: the staleness in policy versions.
    """

    pair: SequencePair
    logits_behav: Tensor
    k: int

    @classmethod
    def along(cls, pair: SequencePair, delta: Tensor, k: int) -> StaleCase:
        """The case with pi_behav ``k`` versions back along ``delta`` (``[P, V]`` per version)."""
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"the staleness k must be an integer >= 0, got {k!r}")
        return cls(pair, pair.logits - k * delta.to(torch.float64), k)

    @functools.cached_property
    def kl_behav_theta(self) -> float:
        """KL(pi_behav ‖ pi_theta) over whole sequences: the sampler gap, exact."""
        q = self.pair.token_logps(self.logits_behav).sum(-1)
        return float((q.exp() * (q - self.pair.seq_logp)).sum())

    @functools.cached_property
    def max_weight(self) -> float:
        """The largest token weight pi_theta(y_t) / pi_behav(y_t) over every prefix and token."""
        lw = torch.log_softmax(self.pair.logits, -1) - torch.log_softmax(self.logits_behav, -1)
        return float(lw.max().exp())


def _directions(pair: SequencePair, step: float, gen: torch.Generator) -> Tensor:
    return step * torch.randn(pair.logits.shape, generator=gen, dtype=torch.float64)


@functools.cache
def _categorical_base(step: float) -> tuple[tuple[SequencePair, Tensor], ...]:
    """Four seeded categoricals (V = 6) and their per-version directions; the last far apart."""
    gen = torch.Generator().manual_seed(20251001)  # M2PO's arXiv month, a fixed seed
    out = []
    for i in range(4):
        scale = 3.0 if i == 3 else 1.0
        theta = scale * torch.randn(6, generator=gen, dtype=torch.float64)
        ref = scale * torch.randn(6, generator=gen, dtype=torch.float64)
        pair = SequencePair.categorical(theta, ref)
        out.append((pair, _directions(pair, step, gen)))
    return tuple(out)


@functools.cache
def _sequence_base(step: float) -> tuple[tuple[SequencePair, Tensor], ...]:
    """The lab's sequence oracle (V = 2, T = 2) and two seeded models with V = 3, T = 3."""
    from klpo.lab.report import sequence_oracle_pair

    gen = torch.Generator().manual_seed(20251002)
    pairs = [sequence_oracle_pair()]
    for _ in range(2):
        rows = 1 + 3 + 9
        pairs.append(
            SequencePair(
                torch.randn(rows, 3, generator=gen, dtype=torch.float64),
                torch.randn(rows, 3, generator=gen, dtype=torch.float64),
                vocab=3,
                length=3,
            )
        )
    return tuple((p, _directions(p, step, gen)) for p in pairs)


def categorical_cases(k: int, *, step: float = DEFAULT_STEP) -> list[StaleCase]:
    """The seeded categoricals with the sampler ``k`` versions back."""
    return [StaleCase.along(p, d, k) for p, d in _categorical_base(float(step))]


def sequence_cases(k: int, *, step: float = DEFAULT_STEP) -> list[StaleCase]:
    """The sequence models with the sampler ``k`` versions back."""
    return [StaleCase.along(p, d, k) for p, d in _sequence_base(float(step))]


def _check(name: str, placement: str, correction: str, cap: float) -> None:
    if name in kl.REF_SAMPLED:
        raise ValueError(
            f"{name!r} is computed on completions sampled from pi_ref, not by the policy's "
            "sampler, so a stale sampler does not touch it; choose one of: "
            + ", ".join(kl.ESTIMATORS)
        )
    if name not in kl.ESTIMATORS:
        raise ValueError(f"unknown estimator {name!r}; choose one of: {', '.join(kl.ESTIMATORS)}")
    if placement not in kl.PLACEMENTS:
        raise ValueError(
            f"unknown placement {placement!r}; choose one of: {', '.join(kl.PLACEMENTS)}"
        )
    if correction not in CORRECTIONS:
        raise ValueError(
            f"unknown correction {correction!r}; choose one of: {', '.join(CORRECTIONS)}"
        )
    if correction == "behav-anchor" and placement != "reward":
        raise ValueError(
            "the behav-anchor correction is about the reward's estimate (computed from the "
            "behaviour log-probs, as AReaL); use placement 'reward'"
        )
    if not cap > 0:
        raise ValueError(f"the weight's cap C must be > 0, got {cap!r}")


def _token_estimate(
    name: str, pair: SequencePair, theta: Tensor, logp: Tensor, logp_ref: Tensor, logp_old: Tensor
) -> Tensor:
    """``[N, T]`` the estimator at every token of every sequence (``full`` from the rows)."""
    if name == "full":
        rows = pair.enumeration.rows
        return kl.estimate("full", None, None, logits=theta[rows], logits_ref=pair.logits_ref[rows])
    return kl.estimate(name, logp, logp_ref, logp_old=logp_old)


def expected(
    case: StaleCase, name: str, placement: str, correction: str, *, cap: float = DEFAULT_CAP
) -> tuple[float, Tensor]:
    """Exact (E[sum_t omega_t est_t], expected gradient ``[P, V]``) with y ~ pi_behav.

    The value is the weighted estimate the term logs (the loss placement's; for ``reward`` the
    detached estimate at sampling, weighted alike); the gradient is with respect to pi_theta's
    logits, of the placement under ``correction`` (module docstring).

    Raises:
        ValueError: an unknown estimator, placement or correction, ``behav-anchor`` outside the
            reward, or a cap that is not > 0.
    """
    _check(name, placement, correction, cap)
    pair = case.pair
    theta = pair.logits.clone().requires_grad_(True)
    logp = pair.token_logps(theta)  # [N, T], carries the gradient
    logp_ref = pair.token_logps(pair.logits_ref)
    q = pair.token_logps(case.logits_behav)  # log pi_behav, [N, T]
    probs_behav = q.sum(-1).exp()  # [N]
    p = logp.detach()
    log_w = p - q
    w = log_w.exp()
    prefix = log_w.cumsum(-1)  # log prod_{s <= t} w_s
    objective = torch.zeros((), dtype=torch.float64)
    value = math.nan

    if placement in ("loss", "reward+loss"):
        if name == "k3_is":
            logp_old = p if correction == "none" else q
            est = kl.estimate("k3_is", logp, logp_ref, logp_old=logp_old)
            omega = {
                "none": torch.ones_like(w),
                "is": torch.ones_like(w),  # the weight is inside k3_is
                "is-cap": w.clamp(max=cap) / w,  # gradient min(w, C) d grad logp
                "is-seq": (prefix - log_w).exp(),  # k3_is weighs token t; the prefix before it
            }[correction]
        else:
            est = _token_estimate(name, pair, theta, logp, logp_ref, p)
            if name == "full":  # independent of y_t: the token-level weights have nothing to do
                omega = (prefix - log_w).exp() if correction == "is-seq" else torch.ones_like(w)
            else:
                omega = {
                    "none": torch.ones_like(w),
                    "is": w,
                    "is-cap": w.clamp(max=cap),
                    "is-seq": prefix.exp(),
                }[correction]
        per_seq = (omega * est).sum(-1)
        objective = objective + (probs_behav * per_seq).sum()
        value = float((probs_behav * per_seq.detach()).sum())

    if placement in ("reward", "reward+loss"):
        with torch.no_grad():
            if correction == "behav-anchor":
                est_s = _token_estimate(name, pair, case.logits_behav, q, logp_ref, q)
            else:
                est_s = _token_estimate(name, pair, pair.logits, p, logp_ref, p)
            returns = est_s.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{s >= t} est_s
            omega = {
                "none": torch.ones_like(w),
                "is": w,
                "is-cap": w.clamp(max=cap),
                "is-seq": prefix[:, -1:].exp().expand_as(w),
                "behav-anchor": w,
            }[correction]
        objective = objective + (probs_behav[:, None] * omega * returns * logp).sum()
        if placement == "reward":
            value = float((probs_behav * (omega * est_s).sum(-1)).sum())

    (grad,) = torch.autograd.grad(objective, theta, allow_unused=True)
    return value, (torch.zeros_like(theta) if grad is None else grad.detach())


_TRUE: weakref.WeakKeyDictionary[SequencePair, tuple[float, Tensor, Tensor]] = (
    weakref.WeakKeyDictionary()
)


def _true(pair: SequencePair) -> tuple[float, Tensor, Tensor]:
    """(KL(pi_theta ‖ pi_ref), its gradient, grad KL(pi_ref ‖ pi_theta)) over whole sequences,
    computed once per pair (a pair's logits are fixed at construction)."""
    from klpo.lab.exact import true_gradients

    if pair not in _TRUE:
        kl_tr, _, g_tr, g_rt = true_gradients(pair)
        _TRUE[pair] = (kl_tr, g_tr, g_rt)
    return _TRUE[pair]


def _label(g: Tensor, g_tr: Tensor, g_rt: Tensor, g_on: Tensor) -> str:
    scale = max(float(g_tr.norm()), float(g_rt.norm()), 1.0)
    if float(g.norm()) <= _TOL * scale:
        return kl.GRAD_ZERO
    for target, label in ((g_tr, kl.GRAD_THETA_REF), (g_rt, kl.GRAD_REF_THETA)):
        if float((g - target).norm()) <= _TOL * max(1.0, float(target.norm())):
            return label
    if float((g - g_on).norm()) <= _TOL * max(1.0, float(g_on.norm())):
        return ON_POLICY
    return kl.GRAD_OTHER


@dataclass(frozen=True)
class StalenessRow:
    """One estimator × placement × correction on one family of cases, at staleness ``k``.

    Attributes:
        setting: ``"categorical"`` or ``"sequence"``.
        cos_theta_ref: mean over the cases of the cosine of the expected gradient to
            grad KL(pi_theta ‖ pi_ref) (NaN where the gradient is zero).
        rel_err_theta_ref: the largest ``|g - grad KL(pi_theta ‖ pi_ref)| / |grad KL|``.
        rel_err_on_policy: the largest relative distance to the same term's on-policy expected
            gradient (k = 0, no correction): the bias the staleness leaves.
        value_rel_err: the largest ``|E[value] - KL(pi_theta ‖ pi_ref)| / KL``.
        follows: the one gradient every case follows exactly (a :data:`klpo.kl.GRADIENTS` label or
            `ON_POLICY`), else ``"other (biased)"``.
        kl_behav_theta: mean KL(pi_behav ‖ pi_theta) of the cases (the sampler gap).
        max_weight: the largest token weight pi_theta / pi_behav over the cases.
    """

    estimator: str
    placement: str
    correction: str
    setting: str
    k: int
    cap: float
    cos_theta_ref: float
    rel_err_theta_ref: float
    rel_err_on_policy: float
    value_rel_err: float
    follows: str
    kl_behav_theta: float
    max_weight: float

    def to_dict(self) -> dict[str, object]:
        """The fields, NaN (a zero gradient's cosine) as None, so the JSON is strict."""
        return {
            k: None if isinstance(v, float) and math.isnan(v) else v
            for k, v in asdict(self).items()
        }


def _row(
    cases: list[StaleCase], on: list[Tensor], name: str, placement: str, correction: str,
    setting: str, cap: float,
) -> StalenessRow:  # fmt: skip
    """``on``: the term's on-policy expected gradient on each case (k = 0, any correction)."""
    coss, errs, on_errs, val_errs, labels = [], [], [], [], set()
    for case, g_on in zip(cases, on, strict=True):
        kl_tr, g_tr, g_rt = _true(case.pair)
        value, g = expected(case, name, placement, correction, cap=cap)
        coss.append(cosine(g, g_tr))
        errs.append(relative_error(g, g_tr))
        # Relative to the on-policy gradient, or to grad KL where that is zero (k1 in the loss).
        on_errs.append(float((g - g_on).norm()) / max(float(g_on.norm()), float(g_tr.norm())))
        val_errs.append(abs(value - kl_tr) / kl_tr if math.isfinite(value) else math.nan)
        labels.add(_label(g, g_tr, g_rt, g_on))
    finite = [c for c in coss if math.isfinite(c)]
    return StalenessRow(
        estimator=name,
        placement=placement,
        correction=correction,
        setting=setting,
        k=cases[0].k,
        cap=cap,
        cos_theta_ref=sum(finite) / len(finite) if finite else math.nan,
        rel_err_theta_ref=max(errs),
        rel_err_on_policy=max(on_errs),
        value_rel_err=max(val_errs),
        follows=labels.pop() if len(labels) == 1 else kl.GRAD_OTHER,
        kl_behav_theta=sum(c.kl_behav_theta for c in cases) / len(cases),
        max_weight=max(c.max_weight for c in cases),
    )


def cell(row: StalenessRow) -> str:
    """A row's cell for people: the cosine to grad KL(pi_theta ‖ pi_ref) (``zero``: no gradient),
    then its distance to the on-policy gradient (``=``: none, up to rounding; else ``Δ`` in %)."""
    cos = "zero" if math.isnan(row.cos_theta_ref) else f"{row.cos_theta_ref:.3f}"
    gap = "=" if row.rel_err_on_policy <= _TOL else f"Δ{row.rel_err_on_policy:.0%}"
    return f"{cos} {gap}"


def markdown_rows(rows: list[StalenessRow]) -> list[str]:
    """One Markdown table row per estimator × placement, a column per correction of
    :data:`CORRECTIONS` (``—`` where it does not apply), as docs/async.md shows them."""
    by_term: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        by_term.setdefault((r.estimator, r.placement), {})[r.correction] = cell(r)
    return [
        f"| `{name}` | {place} | " + " | ".join(c.get(x, "—") for x in CORRECTIONS) + " |"
        for (name, place), c in by_term.items()
    ]


def corrections_of(placement: str) -> tuple[str, ...]:
    """The corrections that apply to ``placement`` (``behav-anchor`` is the reward's alone)."""
    return CORRECTIONS if placement == "reward" else CORRECTIONS[:-1]


MAX_DRIFT = 20.0
"""The largest staleness × version step the lab answers for: beyond a drift of about 20 in logit
space a sampler and pi_theta share no probability mass that float64 can hold."""


def staleness_rows(
    k: int,
    *,
    estimators: tuple[str, ...] | list[str] | None = None,
    placements: tuple[str, ...] | list[str] | None = None,
    corrections: tuple[str, ...] | list[str] | None = None,
    settings: tuple[str, ...] = ("categorical", "sequence"),
    cap: float = DEFAULT_CAP,
    step: float = DEFAULT_STEP,
) -> list[StalenessRow]:
    """Every estimator × placement × correction at staleness ``k``, exact, on both families.

    ``estimators`` defaults to :data:`klpo.kl.ESTIMATORS`, ``placements`` to
    :data:`klpo.kl.PLACEMENTS`, ``corrections`` to those of each placement
    (:func:`corrections_of`).
    """
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"the version step must be a finite number > 0, got {step!r}")
    if not cap > 0:
        raise ValueError(f"the weight's cap C must be > 0, got {cap!r}")
    if k < 0 or k * step > MAX_DRIFT:
        raise ValueError(
            f"staleness {k} at a version step of sd {step:g} moves the sampler's logits by "
            f"about {k * step:g} from pi_theta's: past {MAX_DRIFT:g} the two share no mass in "
            "float64 (the importance weights under- or overflow and every answer would be "
            f"0/0); ask for K <= {int(MAX_DRIFT / step)} at this step, or a smaller --step"
        )
    names = list(estimators or kl.ESTIMATORS)
    places = list(placements or kl.PLACEMENTS)
    fams = {"categorical": categorical_cases, "sequence": sequence_cases}
    for s in settings:
        if s not in fams:
            raise ValueError(f"unknown setting {s!r}; choose categorical or sequence")
    rows = []
    for setting in settings:
        cases, bases = fams[setting](k, step=step), fams[setting](0, step=step)
        for name in names:
            for placement in places:
                on = [expected(b, name, placement, "none")[1] for b in bases]
                for c in corrections or corrections_of(placement):
                    if c == "behav-anchor" and placement != "reward":
                        continue
                    rows.append(_row(cases, on, name, placement, c, setting, cap))
    return rows


@dataclass(frozen=True)
class ClaimRow:
    """``k3_is`` in the loss at staleness ``k`` with its weight capped at ``cap`` (inf: none).

    Attributes:
        rel_err_categorical: the largest relative distance of the expected gradient to
            grad KL(pi_theta ‖ pi_ref) over the categoricals (0 up to rounding: the claim holds).
        rel_err_sequence: the same over the sequence models, with the token-level weight.
        rel_err_sequence_on_policy: on the sequence models, the distance of the on-policy
            expected gradient to the sequence-level grad KL(pi_theta ‖ pi_ref) (the per-token
            term's own shortfall, which no weight repairs).
        max_weight: the largest token weight pi_theta / pi_behav on the categoricals.
    """

    k: int
    cap: float
    rel_err_categorical: float
    rel_err_sequence: float
    rel_err_sequence_on_policy: float
    max_weight: float

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def k3_is_claim(
    ks: tuple[int, ...] = (0, 1, 2, 4, 8),
    caps: tuple[float, ...] = (math.inf, DEFAULT_CAP, 2.0),
    *,
    step: float = DEFAULT_STEP,
) -> list[ClaimRow]:
    """The claim "IS-weighted k3 in the loss is the unbiased gradient of KL(pi_theta ‖ pi_ref)
    off-policy", checked by enumeration at each staleness in ``ks`` and weight cap in ``caps``.

    The IS-weighted k3 is ``k3_is`` with pi_behav as its ``pi_old`` (the gradient flows through the
    weight: ``w d grad logp``, DeepSeek-V3.2 eq. 7, TRL's ``use_bias_correction_kl``); with a cap
    C its gradient is ``sg(min(w, C)) d grad logp`` (OpenRLHF's ``--algo.kl.unbiased_gradient``,
    C = 10). Per token: exact for C = inf, biased by ``sum_y (pi_theta(y) - C pi_behav(y))_+ d(y)
    grad log pi_theta(y)`` once some w > C. Over sequences the per-token weight leaves the prefix
    the sampler's, and even on-policy the per-token term misses the later tokens' KL.
    """
    on_seq = [(c, expected(c, "k3_is", "loss", "none")[1]) for c in sequence_cases(0, step=step)]
    seq_short = max(relative_error(g, _true(c.pair)[1]) for c, g in on_seq)
    rows = []
    for k in ks:
        cats, seqs = categorical_cases(k, step=step), sequence_cases(k, step=step)
        for cap in caps:
            corr = "is" if math.isinf(cap) else "is-cap"
            c = cap if math.isfinite(cap) else DEFAULT_CAP
            err_c = max(
                relative_error(expected(x, "k3_is", "loss", corr, cap=c)[1], _true(x.pair)[1])
                for x in cats
            )
            err_s = max(
                relative_error(expected(x, "k3_is", "loss", corr, cap=c)[1], _true(x.pair)[1])
                for x in seqs
            )
            rows.append(ClaimRow(k, cap, err_c, err_s, seq_short, max(x.max_weight for x in cats)))
    return rows


SWEEP_TERMS: tuple[tuple[str, str, str], ...] = (
    ("k3", "loss", "none"),
    ("k3", "loss", "is"),
    ("k3_is", "loss", "none"),
    ("k3_is", "loss", "is"),
    ("k1", "reward", "none"),
    ("k1", "reward", "is"),
    ("k1", "reward", "behav-anchor"),
    ("full", "loss", "none"),
)
"""The (estimator, placement, correction) columns of docs/async.md's staleness sweep."""


def sweep_markdown(
    ks: tuple[int, ...] = (1, 2, 4, 8),
    terms: tuple[tuple[str, str, str], ...] = SWEEP_TERMS,
    *,
    step: float = DEFAULT_STEP,
) -> list[str]:
    """docs/async.md's sweep: per staleness, the sampler gap and each term's distance to its
    on-policy gradient, categoricals / sequences (``0``: none, up to rounding)."""
    names = tuple(dict.fromkeys(n for n, _, _ in terms))
    places = tuple(dict.fromkeys(p for _, p, _ in terms))

    def pct(x: float) -> str:
        return "0" if x <= _TOL else f"{x:.0%}"

    header = "| K | KL(pi_behav ‖ pi_theta) | " + " | ".join(f"`{n}` {p}, {c}" for n, p, c in terms)
    lines = [header + " |", "| " + " | ".join(["---"] * (len(terms) + 2)) + " |"]
    for k in ks:
        got = {}
        for setting in ("categorical", "sequence"):
            for r in staleness_rows(
                k, estimators=names, placements=places, settings=(setting,), step=step
            ):
                got[(setting, r.estimator, r.placement, r.correction)] = r
        gaps = [
            next(r for (s, *_), r in got.items() if s == setting).kl_behav_theta
            for setting in ("categorical", "sequence")
        ]
        cells = [
            f"{pct(got[('categorical', *t)].rel_err_on_policy)} / "
            f"{pct(got[('sequence', *t)].rel_err_on_policy)}"
            for t in terms
        ]
        lines.append(f"| {k} | {gaps[0]:.2g} / {gaps[1]:.2g} | " + " | ".join(cells) + " |")
    return lines


def claim_markdown(ks: tuple[int, ...] = (0, 2, 4, 8), *, step: float = DEFAULT_STEP) -> list[str]:
    """docs/async.md's table of :func:`k3_is_claim`: per staleness, the largest weight and the
    gradient's relative error with the cap at inf, 10 and 2, and over sequences uncapped."""
    rows = {(r.k, r.cap): r for r in k3_is_claim(ks, (math.inf, DEFAULT_CAP, 2.0), step=step)}

    def err(x: float) -> str:
        return "< 1e-12" if x < 1e-12 else f"{x:.0%}"  # rounding, whatever the CPU

    lines = [
        "| K | largest weight | error, C = inf | error, C = 10 (OpenRLHF) | error, C = 2 | "
        "error over sequences, C = inf |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k in ks:
        inf, ten, two = rows[(k, math.inf)], rows[(k, DEFAULT_CAP)], rows[(k, 2.0)]
        lines.append(
            f"| {k} | {inf.max_weight:.2g} | {err(inf.rel_err_categorical)} | "
            f"{err(ten.rel_err_categorical)} | {err(two.rel_err_categorical)} | "
            f"{err(inf.rel_err_sequence)} |"
        )
    return lines
