r"""``klpo explain --teacher``: which divergence each on-policy distillation term follows, derived.

The teacher ``pi_T`` takes the reference's place: the student ``pi_theta`` samples, the teacher
scores. Every answer here comes from exact enumeration in float64, not from a table typed in:

**Per position** (:func:`position_rows`), on seeded LM-like categoricals (Zipf-shaped teacher,
a student a given KL away, :func:`cases`): each term's expected value and expected gradient with
respect to the student's logits, compared with KL(pi_theta ‖ pi_T) (reverse), KL(pi_T ‖ pi_theta)
(forward) and their gradients: which value it equals (or the relative error to the nearest), which
gradient it follows (the cosine to each), on how many cases a clamp binds and zeroes the
position's gradient, and what the top-k truncation costs. The sampled terms use
:func:`klpo.kl.expected_value_and_gradient` (y ~ pi_theta, every outcome weighted by its
probability); the vocabulary-wide ones :mod:`klpo.teacher`.

**Over a sequence** (:func:`sequence_rows`), on seeded tabular sequence models: the expected
gradient of each term with respect to every prefix's logits against the gradient of the sequence
KL(pi_theta ‖ pi_T) = E[sum_t d_t]. A detached per-token reward ``-d_t`` with returns-to-go
(REINFORCE, gamma = 1) follows it exactly; the same reward with discount 0 (each token credited
only with its own ``-d_t``, the Tinker cookbook's OPD advantage) follows ``E[sum_t grad KL_t]``
only at the first position and misses how a token changes the teacher's view of the later ones,
as does every per-position term in the loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from klpo import kl, teacher
from klpo.lab.distributions import SequencePair, zipf_logits
from klpo.lab.exact import Tables, gradient_moments, placement_terms, true_gradients
from klpo.lab.stats import cosine

__all__ = [
    "TERMS",
    "PositionRow",
    "SequenceRow",
    "Term",
    "cases",
    "position_rows",
    "sequence_rows",
]

REVERSE = "KL(pi_theta ‖ pi_T)"
FORWARD = "KL(pi_T ‖ pi_theta)"
TOL = 1e-9
K = 4
"""The top-k forms' k in the enumeration: 4 of a vocabulary of 16 (a quarter, where real runs keep
tens of 150k; what matters is that the tail holds mass)."""


@dataclass(frozen=True)
class Term:
    """One distillation term: a name, where it goes, and how to evaluate it on one position.

    ``value_grad(z, zt)`` returns the expected value and the expected gradient with respect to
    the student's logits ``z [V]`` (float64), the teacher's ``zt [V]`` held fixed; ``raw`` the
    value before a clamp (None: no clamp)."""

    name: str
    placement: str
    support: str  # "sampled" (the sampled token), "full" (the vocabulary), "top-k"
    value_grad: Callable[[Tensor, Tensor], tuple[float, Tensor]]
    raw: Callable[[Tensor, Tensor], float] | None = None
    what: str = ""
    own: str = ""  # the divergence it is by definition when neither KL (the JSD's name)


def _sampled(name: str, placement: str) -> Callable[[Tensor, Tensor], tuple[float, Tensor]]:
    return lambda z, zt: kl.expected_value_and_gradient(name, placement, z, zt)


def _vocab(
    fn: Callable[[Tensor, Tensor], Tensor],
) -> Callable[[Tensor, Tensor], tuple[float, Tensor]]:
    def value_grad(z: Tensor, zt: Tensor) -> tuple[float, Tensor]:
        theta = z.detach().clone().requires_grad_(True)
        value = fn(theta[None], zt[None])[0]
        (grad,) = torch.autograd.grad(value, theta, allow_unused=True)
        return float(value.detach()), torch.zeros_like(theta) if grad is None else grad

    return value_grad


def _topk_forward(clamp: bool) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda z, zt: teacher.topk_forward_kl(z, *teacher.teacher_topk(zt, K), clamp_zero=clamp)


def _student_topk(clamp: bool) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda z, zt: teacher.student_topk_kl(z, zt, K, clamp_zero=clamp)


def _raw(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], float]:
    return lambda z, zt: float(fn(z[None], zt[None])[0])


TERMS: tuple[Term, ...] = (
    Term("k1", "reward", "sampled", _sampled("k1", "reward"), what="Tinker / Thinking Machines"),
    Term("k1", "loss", "sampled", _sampled("k1", "loss")),
    Term("k2", "loss", "sampled", _sampled("k2", "loss")),
    Term("k3", "loss", "sampled", _sampled("k3", "loss"), what="verl's sampled reverse KL"),
    Term("reverse (exact)", "loss", "full", _vocab(teacher.reverse_kl), what="TRL beta=1"),
    Term("forward (exact)", "loss", "full", _vocab(teacher.forward_kl), what="TRL beta=0"),
    Term(
        "jsd 0.5",
        "loss",
        "full",
        _vocab(lambda z, zt: teacher.jsd(z, zt, 0.5)),
        what="TRL beta=0.5",
        own="JSD_0.5",
    ),
    Term(f"teacher top-{K} fwd", "loss", "top-k", _vocab(_topk_forward(False)), what="no clamp"),
    Term(
        f"teacher top-{K} fwd, clamp",
        "loss",
        "top-k",
        _vocab(_topk_forward(True)),
        raw=_raw(_topk_forward(False)),
        what="verl forward_kl_topk",
    ),
    Term(
        f"top-{K} + tail",
        "loss",
        "top-k",
        _vocab(lambda z, zt: teacher.topk_tail_kl(z, *teacher.teacher_topk(zt, K))),
        what="verl#7855",
    ),
    Term(f"student top-{K} rev", "loss", "top-k", _vocab(_student_topk(False))),
    Term(
        f"student top-{K} rev, clamp",
        "loss",
        "top-k",
        _vocab(_student_topk(True)),
        raw=_raw(_student_topk(False)),
        what="verl PR #7806",
    ),
)
"""Every term :func:`position_rows` derives, in the order ``klpo explain --teacher`` prints."""


def cases(
    family: str, n: int = 24, vocab: int = 16, kl_target: float = 0.2, seed: int = 20260701
) -> list[tuple[Tensor, Tensor]]:
    """``n`` seeded ``(student logits, teacher logits)`` pairs of ``[vocab]`` float64.

    ``"near"``: a Zipf-shaped teacher and a student at KL(pi_theta ‖ pi_T) = ``kl_target`` in a
    random direction (the student learning the teacher). ``"sharp"``: the same student made
    sharper than its teacher (its logits times 1.5, as after RL on top of distillation: more mass
    on the teacher's top tokens than the teacher puts there)."""
    if family not in ("near", "sharp"):
        raise ValueError(f"family must be 'near' or 'sharp', got {family!r}")
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        zt = zipf_logits(vocab, generator=gen)
        eps = torch.randn(vocab, generator=gen, dtype=torch.float64)
        lo, hi = 0.0, 8.0
        for _ in range(60):  # bisection on the exact reverse KL
            mid = 0.5 * (lo + hi)
            got = float(teacher.reverse_kl((zt + mid * eps)[None], zt[None])[0])
            lo, hi = (mid, hi) if got < kl_target else (lo, mid)
        z = zt + 0.5 * (lo + hi) * eps
        out.append((1.5 * z if family == "sharp" else z, zt))
    return out


@dataclass(frozen=True)
class PositionRow:
    """One term on one family of cases (means over the cases; the worst case where said)."""

    term: str
    placement: str
    support: str
    family: str
    value: str  # the divergence the expected value equals, or "none"
    value_error: float  # worst relative error of the value against REVERSE or FORWARD, the nearer
    gradient: str  # the gradient it follows: REVERSE's, FORWARD's, "zero" or "other"
    cos_reverse: float  # mean cosine of the expected gradient to grad KL(pi_theta ‖ pi_T)
    cos_forward: float  # ... and to grad KL(pi_T ‖ pi_theta)
    clamp_binds: float  # the share of cases where a clamp zeroes the position's gradient
    what: str

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _divergences(z: Tensor, zt: Tensor) -> tuple[float, float, Tensor, Tensor]:
    r, gr = _vocab(teacher.reverse_kl)(z, zt)
    f, gf = _vocab(teacher.forward_kl)(z, zt)
    return r, f, gr, gf


def _close(a: Tensor, b: Tensor) -> bool:
    return float((a - b).norm()) <= TOL * max(1.0, float(b.norm()))


def position_rows(family: str = "near", **case_args: object) -> list[PositionRow]:
    """Every term of :data:`TERMS` on the ``family`` of :func:`cases`."""
    pairs = cases(family, **case_args)
    rows = []
    for term in TERMS:
        labels, equal, errors, cos_r, cos_f, binds = set(), set(), [], [], [], 0
        for z, zt in pairs:
            r, f, gr, gf = _divergences(z, zt)
            value, grad = term.value_grad(z, zt)
            if term.raw is not None and term.raw(z, zt) < 0:
                binds += 1
            rel_r, rel_f = abs(value - r) / r, abs(value - f) / f
            equal.add(REVERSE if rel_r <= TOL else FORWARD if rel_f <= TOL else "none")
            errors.append(min(rel_r, rel_f))
            if _close(grad, torch.zeros_like(grad)):
                labels.add("zero")
            elif _close(grad, gr):
                labels.add(REVERSE)
            elif _close(grad, gf):
                labels.add(FORWARD)
            else:
                labels.add("other")
            cos_r.append(cosine(grad, gr))
            cos_f.append(cosine(grad, gf))
        rows.append(
            PositionRow(
                term=term.name,
                placement=term.placement,
                support=term.support,
                family=family,
                value=_value_label(equal, term),
                value_error=max(errors),
                gradient=_gradient_label(labels, term),
                cos_reverse=_mean(cos_r),
                cos_forward=_mean(cos_f),
                clamp_binds=binds / len(pairs),
                what=term.what,
            )
        )
    return rows


def _value_label(equal: set[str], term: Term) -> str:
    """REVERSE or FORWARD where every case's value equals it; else the term's own name, if it
    has one, or "none" (a truncated sum, no divergence)."""
    label = equal.pop() if len(equal) == 1 else "none"
    return term.own if label == "none" and term.own else label


def _gradient_label(labels: set[str], term: Term) -> str:
    """One label if every case agrees; a term's own divergence's gradient by definition (the
    JSD is differentiated exactly); "other" otherwise."""
    if len(labels) == 1 and "other" not in labels:
        return labels.pop()
    return f"its own ({term.own})" if term.own else "other"


def _mean(xs: list[float]) -> float:
    """The mean of the numbers that are not NaN (a zero gradient's cosine); NaN if none."""
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else math.nan


# --------------------------------------------------------------------------------------------
# Over a sequence.


@dataclass(frozen=True)
class SequenceRow:
    """One term over whole sequences: its expected gradient against the sequence KL's."""

    term: str
    credit: str  # how a token is credited
    cos_sequence: float  # mean cosine to grad KL(pi_theta ‖ pi_T) over the sequence
    rel_error: float  # worst ‖E[g] - grad KL‖ / ‖grad KL‖ over the models
    follows: bool  # equal to the sequence KL's gradient on every model (to 1e-9)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _models(n: int, vocab: int, length: int, seed: int) -> list[SequencePair]:
    gen = torch.Generator().manual_seed(seed)
    rows = sum(vocab**t for t in range(length))
    return [
        SequencePair(
            torch.randn(rows, vocab, generator=gen, dtype=torch.float64),
            torch.randn(rows, vocab, generator=gen, dtype=torch.float64),
            vocab=vocab,
            length=length,
        )
        for _ in range(n)
    ]


def _sequence_gradient(pair: SequencePair, name: str, credit: str) -> Tensor:
    """The expected gradient ``[P, V]`` of estimator ``name`` (the teacher in the reference's
    place) credited as ``credit``: "returns" (reward, returns-to-go), "token" (reward, discount
    0), "loss" (differentiated per token, samples held fixed)."""
    tab = Tables(pair)[name]
    if credit == "returns":
        coef, table = placement_terms(tab, "reward")
    elif credit == "token":
        coef, table = tab.token_value, None  # each token's own detached value, no future
    else:
        coef, table = placement_terms(tab, "loss")
    mean, _ = gradient_moments(pair, pair.probs, coef, table)
    return mean


SEQUENCE_TERMS: tuple[tuple[str, str, str], ...] = (
    ("k1", "returns", "reward -d_t, returns-to-go"),
    ("k1", "token", "reward -d_t, discount 0 (Tinker)"),
    ("k3", "loss", "loss, per token"),
    ("full", "loss", "loss, exact per position"),
    ("full", "returns", "reward + loss, exact per position"),
)
"""(estimator, credit, label) of :func:`sequence_rows`."""


def sequence_rows(n: int = 4, vocab: int = 3, length: int = 3, seed: int = 7) -> list[SequenceRow]:
    """Each of :data:`SEQUENCE_TERMS` on ``n`` seeded tabular models (``vocab^length`` sequences)."""
    pairs = _models(n, vocab, length, seed)
    rows = []
    for name, credit, label in SEQUENCE_TERMS:
        cos, err = [], []
        for pair in pairs:
            _, _, g_tr, _ = true_gradients(pair)
            got = _sequence_gradient(pair, name, credit)
            if name == "full" and credit == "returns":  # reward+loss: the sequence-exact form
                got = got + _sequence_gradient(pair, name, "loss")
            cos.append(cosine(got, g_tr))
            err.append(float((got - g_tr).norm() / g_tr.norm()))
        rows.append(SequenceRow(name, label, _mean(cos), max(err), max(err) <= TOL))
    return rows


# --------------------------------------------------------------------------------------------
# What klpo explain --teacher prints.

_SHORT = {REVERSE: "reverse", FORWARD: "forward", "none": "none", "zero": "zero", "other": "other"}


def _short(label: str) -> str:
    return _SHORT.get(label, "own" if label.startswith(("its own", "JSD")) else label)


def _num(x: float) -> str:
    return "  -  " if x != x else f"{x:5.2f}"


def render(families: tuple[str, ...] = ("near", "sharp")) -> str:
    """The tables of ``klpo explain --teacher``, within 80 columns."""
    lines = [
        "On-policy distillation: the student pi_theta samples, the teacher pi_T scores.",
        f"reverse = {REVERSE}, forward = {FORWARD};",
        "exact enumeration in float64 on 24 seeded positions per family (V = 16, a",
        "Zipf-shaped teacher, the student at reverse KL 0.2 from it; 'sharp': the",
        f"student's logits x 1.5); the top-k forms with k = {K}.",
    ]
    for family in families:
        rows = position_rows(family)
        lines += ["", f"Per position, family {family!r}:", ""]
        lines.append(f"{'term':<27} {'place':<6} {'value':<8} {'gradient':<8} cos_r cos_f clamp")
        for r in rows:
            name = r.term if r.placement != "reward" else f"{r.term} (reward)"
            lines.append(
                f"{name:<27} {r.placement:<6} {_short(r.value):<8} {_short(r.gradient):<8} "
                f"{_num(r.cos_reverse)} {_num(r.cos_forward)} {r.clamp_binds:5.0%}"
            )
    lines += [
        "",
        "value: the divergence its expected value equals (none: a truncated sum);",
        "gradient: the divergence whose gradient it follows; cos_r, cos_f: mean cosine of",
        "its expected gradient to grad reverse and grad forward; clamp: positions where a",
        "clamp binds and the position's gradient is zero.",
        "",
        "Over a sequence (4 tabular models, V = 3, T = 3), against grad reverse KL of the",
        "whole sequence:",
        "",
        f"{'term':<6} {'credit':<38} {'cosine':>6} {'error':>6} follows",
    ]
    for r in sequence_rows():
        lines.append(
            f"{r.term:<6} {r.credit:<38} {r.cos_sequence:6.3f} {r.rel_error:6.3f} "
            f"{'yes' if r.follows else 'no'}"
        )
    lines += [
        "",
        "A per-token reward -d_t credited only to its own token (discount 0) follows the",
        "sum of the per-position gradients, as the exact KL in the loss alone does; the",
        "sequence KL's gradient needs returns-to-go, or the exact KL in reward and loss.",
    ]
    return "\n".join(lines)


def to_json(families: tuple[str, ...] = ("near", "sharp")) -> dict[str, object]:
    """Everything :func:`render` prints, for machines."""
    return {
        "k": K,
        "positions": [r.to_dict() for f in families for r in position_rows(f)],
        "sequences": [r.to_dict() for r in sequence_rows()],
    }
