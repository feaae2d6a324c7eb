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

Beside klpo's own forms, the renormalised top-k KLs the frameworks compute are derived here
too, defined in this module (they are no estimator of the library): NeMo-RL's ``distillation``
loss (``loss_fn.kl_type`` forward, reverse or mixed over the teacher's top-k, both
distributions renormalised there: ``nemo_rl/distributed/model_utils.py``, NVIDIA-NeMo/RL
``7ea279a``) and TRL 1.16's SDPO ``topk_logits`` mode (the student's top-k, renormalised or with
a tail bucket: ``trl/experimental/sdpo/loss_utils.py``).

The answers are shipped as a table (``klpo/assets/explain_teacher.json``, written by ``python
-m klpo.lab.tables``; a test regenerates it unchanged), which ``klpo doctor`` reads
without torch (:func:`klpo.registry.teacher_rows`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

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
    "renormalised_topk_kl",
    "sequence_rows",
    "student_topk_bucket_kl",
    "table",
    "table_text",
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
    value before a clamp (None: no clamp). ``key`` names the form independently of ``K`` (the
    shipped table's key, which ``klpo doctor`` looks rows up by)."""

    key: str
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


def _kl(log_a: Tensor, log_b: Tensor) -> Tensor:
    """KL(a ‖ b) over the last axis, ``0 log 0 = 0``."""
    a = log_a.exp()
    return torch.where(a > 0, a * (log_a - log_b), 0.0).sum(-1)


def _renormalise(log_p: Tensor) -> Tensor:
    return log_p - torch.logsumexp(log_p, -1, keepdim=True)


def renormalised_topk_kl(logits: Tensor, logits_teacher: Tensor, k: int, kind: str) -> Tensor:
    r"""NeMo-RL's ``distillation`` loss: a KL of both models renormalised over the teacher's top-k.

    With ``K_T`` the teacher's ``k`` likeliest tokens, ``q^K = q_i / sum_{K_T} q`` and
    ``p^K = p_i / sum_{K_T} p`` (NeMo-RL gathers both models' logits at ``K_T`` and takes
    ``log_softmax`` over them, ``loss_fn.zero_outside_topk`` false):

    - ``"forward"``: KL(p^K ‖ q^K); ``"reverse"``: KL(q^K ‖ p^K);
    - ``"mixed"``: 0.5 KL(p^K ‖ q^K) + 0.5 KL(q^K ‖ p^K) (NeMo-RL's default ``kl_type`` at its
      default ``mixed_kl_weight`` 0.5).

    A true KL of the two conditionals on ``K_T``, which ignores where either model puts its mass
    outside ``K_T``: the student's mass outside the teacher's top-k is never penalised.
    Shapes: ``[..., V]`` logits in, ``[...]`` out. Gradient: autograd's, to the student's logits
    (the teacher is detached).

    Example:
        >>> import torch
        >>> z = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()   # student q
        >>> zt = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).log()  # teacher p
        >>> # K_T = {1, 2}: p^K = (0.625, 0.375), q^K = (0.6, 0.4)
        >>> round(float(renormalised_topk_kl(z, zt, 2, "forward")), 6)
        0.001312
    """
    if kind not in ("forward", "reverse", "mixed"):
        raise ValueError(f"kind must be 'forward', 'reverse' or 'mixed', got {kind!r}")
    ids = logits_teacher.detach().topk(k, -1).indices
    log_q = _renormalise(torch.log_softmax(logits, -1).gather(-1, ids))
    log_p = _renormalise(torch.log_softmax(logits_teacher.detach(), -1).gather(-1, ids))
    forward, reverse = _kl(log_p, log_q), _kl(log_q, log_p)
    return {"forward": forward, "reverse": reverse, "mixed": 0.5 * forward + 0.5 * reverse}[kind]


def student_topk_bucket_kl(logits: Tensor, logits_teacher: Tensor, k: int, *, tail: bool) -> Tensor:
    r"""TRL 1.16 SDPO's ``topk_logits`` reverse KL on the student's top-k.

    With ``K_theta`` the student's ``k`` likeliest tokens and both models' full-vocabulary
    log-probs gathered there: ``tail=False`` renormalises both over ``K_theta`` and returns
    KL(q^K ‖ p^K); ``tail=True`` appends one bucket with each model's mass outside ``K_theta``
    (``distillation_add_tail``) and returns the KL of the ``k + 1`` buckets. SDPO's
    ``distillation_alpha = 1`` (its default) is this reverse direction
    (``trl/experimental/sdpo/loss_utils.py``: ``compute_topk_self_distillation_loss``).
    Shapes: ``[..., V]`` in, ``[...]`` out; the teacher is detached.

    Example:
        >>> import torch
        >>> z = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64).log()   # student q
        >>> zt = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).log()  # teacher p
        >>> # K_theta = {0, 1}: q^K = (0.625, 0.375), p^K = (2/7, 5/7)
        >>> round(float(student_topk_bucket_kl(z, zt, 2, tail=False)), 6)
        0.247591
    """
    ids = logits.detach().topk(k, -1).indices
    log_q = torch.log_softmax(logits, -1).gather(-1, ids)
    log_p = torch.log_softmax(logits_teacher.detach(), -1).gather(-1, ids)
    if tail:
        log_q, log_p = _with_tail(log_q), _with_tail(log_p)
    else:
        log_q, log_p = _renormalise(log_q), _renormalise(log_p)
    return _kl(log_q, log_p)


def _with_tail(log_p: Tensor) -> Tensor:
    """``log_p`` (a top-k subset's log-probs) with one more entry, the log of the rest's mass."""
    kept = torch.logsumexp(log_p, -1, keepdim=True).clamp(max=-1e-12)
    return torch.cat([log_p, torch.log(-torch.expm1(kept))], -1)


TERMS: tuple[Term, ...] = (
    Term(
        "k1", "k1", "reward", "sampled", _sampled("k1", "reward"),
        what="Tinker / Thinking Machines",
    ),
    Term("k1", "k1", "loss", "sampled", _sampled("k1", "loss")),
    Term("k2", "k2", "loss", "sampled", _sampled("k2", "loss")),
    Term("k3", "k3", "loss", "sampled", _sampled("k3", "loss"), what="verl's sampled reverse KL"),
    Term(
        "full", "reverse (exact)", "loss", "full", _vocab(teacher.reverse_kl), what="TRL beta=1"
    ),
    Term(
        "forward", "forward (exact)", "loss", "full", _vocab(teacher.forward_kl),
        what="TRL beta=0",
    ),
    Term(
        "jsd", "jsd 0.5", "loss", "full", _vocab(lambda z, zt: teacher.jsd(z, zt, 0.5)),
        what="TRL beta=0.5", own="JSD_0.5",
    ),
    Term(
        "topk_forward", f"teacher top-{K} fwd", "loss", "top-k", _vocab(_topk_forward(False)),
        what="no clamp",
    ),
    Term(
        "topk_forward_clamp", f"teacher top-{K} fwd, clamp", "loss", "top-k",
        _vocab(_topk_forward(True)), raw=_raw(_topk_forward(False)),
        what="verl forward_kl_topk",
    ),
    Term(
        "topk_tail", f"top-{K} + tail", "loss", "top-k",
        _vocab(lambda z, zt: teacher.topk_tail_kl(z, *teacher.teacher_topk(zt, K))),
        what="verl#7855",
    ),
    Term("student_topk", f"student top-{K} rev", "loss", "top-k", _vocab(_student_topk(False))),
    Term(
        "student_topk_clamp", f"student top-{K} rev, clamp", "loss", "top-k",
        _vocab(_student_topk(True)), raw=_raw(_student_topk(False)), what="verl PR #7806",
    ),
    Term(
        "teacher_topk_renorm_forward", f"teacher top-{K} renorm fwd", "loss", "top-k",
        _vocab(lambda z, zt: renormalised_topk_kl(z, zt, K, "forward")),
        what="NeMo-RL kl_type=forward",
    ),
    Term(
        "teacher_topk_renorm_reverse", f"teacher top-{K} renorm rev", "loss", "top-k",
        _vocab(lambda z, zt: renormalised_topk_kl(z, zt, K, "reverse")),
        what="NeMo-RL kl_type=reverse",
    ),
    Term(
        "teacher_topk_renorm_mixed", f"teacher top-{K} renorm mix", "loss", "top-k",
        _vocab(lambda z, zt: renormalised_topk_kl(z, zt, K, "mixed")),
        what="NeMo-RL kl_type=mixed (0.5)",
    ),
    Term(
        "student_topk_renorm", f"student top-{K} renorm rev", "loss", "top-k",
        _vocab(lambda z, zt: student_topk_bucket_kl(z, zt, K, tail=False)),
        what="TRL SDPO topk_logits",
    ),
    Term(
        "student_topk_tail", f"student top-{K} + tail rev", "loss", "top-k",
        _vocab(lambda z, zt: student_topk_bucket_kl(z, zt, K, tail=True)),
        what="TRL SDPO topk_logits, add_tail",
    ),
)  # fmt: skip
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

    key: str  # the form, independent of K (Term.key)
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
                key=term.key,
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
    credit: str  # how a token is credited, in words
    placement: str  # "reward" (a detached per-token reward) or "loss" (or both: "reward+loss")
    credit_key: str  # "returns" (returns-to-go), "token" (discount 0) or "" (in the loss)
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

_SEQUENCE_KEYS = {
    "returns": ("reward", "returns"),
    "token": ("reward", "token"),
    "loss": ("loss", ""),
}
"""credit of :data:`SEQUENCE_TERMS` -> (placement, credit key) in the rows; ``full`` with
``returns`` is the exact KL in reward and loss (``reward+loss``)."""


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
        placement, credit_key = _SEQUENCE_KEYS[credit]
        if name == "full" and credit == "returns":
            placement = "reward+loss"
        rows.append(
            SequenceRow(name, label, placement, credit_key, _mean(cos), max(err), max(err) <= TOL)
        )
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


# --------------------------------------------------------------------------------------------
# The shipped table (klpo doctor reads it without torch).


def _stable(value: Any) -> Any:
    """A row's value as the table holds it: floats to 6 decimals (NaN as null), so the text
    does not move with the last bits of a platform's arithmetic."""
    if isinstance(value, float):
        return None if value != value else round(value, 6) + 0.0
    return value


def table(families: tuple[str, ...] = ("near", "sharp")) -> dict[str, Any]:
    """Everything :func:`render` prints, as ``klpo/assets/explain_teacher.json`` holds it:
    ``{"about", "k", "vocab", "cases", "positions": [PositionRow], "sequences": [SequenceRow]}``,
    floats to 6 decimals."""
    positions = [
        {k: _stable(v) for k, v in r.to_dict().items()} for f in families for r in position_rows(f)
    ]
    sequences = [{k: _stable(v) for k, v in r.to_dict().items()} for r in sequence_rows()]
    return {
        "about": "klpo explain --teacher's answers, derived by exact enumeration "
        "(klpo.lab.teacher); written by `python -m klpo.lab.tables`, read without "
        "torch by klpo.registry.teacher_rows",
        "k": K,
        "vocab": 16,
        "cases": 24,
        "positions": positions,
        "sequences": sequences,
    }


def table_text() -> str:
    """:func:`table` as the file's text (stable: sorted keys, one row a line)."""
    t = table()

    def rows(items: list[dict[str, Any]]) -> str:
        return ",\n".join("    " + json.dumps(r, sort_keys=True, ensure_ascii=False) for r in items)

    head = {k: t[k] for k in ("about", "k", "vocab", "cases")}
    lines = ["{"] + [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    lines += ['  "positions": [', rows(t["positions"]), "  ],"]
    lines += ['  "sequences": [', rows(t["sequences"]), "  ]", "}"]
    return "\n".join(lines) + "\n"
