r"""The KL estimators' registry and the library's named choices, importable without torch.

One row per estimator (:class:`Spec` in :data:`SPECS`): what it estimates, its equation, how it is
corrected off-policy, what it needs (``logp_old``, both models' logits, the reference's own
samples) and what ``klpo doctor`` proposes in its place. The functions that compute the rows live
in :mod:`klpo.estimators` (torch); a row names its function by module and name
(:class:`klpo._lazy.Ref`) and imports it on the first call, so that the config, the doctor and
the docs read the traits without importing torch. :mod:`klpo.kl` is the face: it re-exports this
module with the functions, :func:`klpo.kl.estimate` and :func:`klpo.kl.explain`.

Also here: the placements of a KL term (:data:`Placement`), the loss reductions' names
(:data:`MODES`; :mod:`klpo.reduce` computes them), the directions and gradients
:func:`klpo.kl.explain` answers with, its answers as records (:class:`Explanation`), and those
answers for the built-in rows as shipped (:func:`explanation`, from ``klpo/assets/explain.json``,
which ``python -m klpo.lab.tables`` writes and a test regenerates unchanged), and ``klpo explain
--teacher``'s answers for the distillation terms (:func:`teacher_positions`,
:func:`teacher_sequence`, from ``klpo/assets/explain_teacher.json``, written by ``python -m
klpo.lab.tables``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any, Literal, get_args

from klpo._lazy import Ref
from klpo._names import LiveNames

__all__ = [
    "ESTIMATORS",
    "GRADIENTS",
    "GRAD_OTHER",
    "GRAD_REF_THETA",
    "GRAD_THETA_REF",
    "GRAD_ZERO",
    "LOGPROB_ESTIMATORS",
    "MODES",
    "PLACEMENTS",
    "REF_SAMPLED",
    "REF_THETA",
    "SPECS",
    "TEACHER_TABLE",
    "THETA_REF",
    "Explanation",
    "Mode",
    "OffPolicy",
    "Placement",
    "Spec",
    "explanation",
    "in_loss",
    "in_reward",
    "refusal",
    "register",
    "teacher_positions",
    "teacher_sequence",
    "teacher_table",
]

THETA_REF = "KL(pi_theta ‖ pi_ref)"
REF_THETA = "KL(pi_ref ‖ pi_theta)"

# The four answers `explain` can give for "which expected gradient does the term follow".
GRAD_THETA_REF = "grad KL(pi_theta ‖ pi_ref)"
GRAD_REF_THETA = "grad KL(pi_ref ‖ pi_theta)"
GRAD_ZERO = "zero"
GRAD_OTHER = "other (biased)"
GRADIENTS: tuple[str, ...] = (GRAD_THETA_REF, GRAD_REF_THETA, GRAD_ZERO, GRAD_OTHER)

Placement = Literal["loss", "reward", "reward+loss", "none"]
"""Where a KL term goes: nowhere (``"none"``: the KL is only measured), the reward, the loss, or
both. One type for the library, the trainer's config and :func:`explain`."""
PLACEMENTS: tuple[Placement, ...] = ("reward", "loss", "reward+loss")
"""The placements that put a KL somewhere: what :func:`explain` answers for."""


def in_reward(placement: Placement) -> bool:
    """Whether ``placement`` puts a detached KL penalty in the reward (``reward``, ``reward+loss``).

    Example:
        >>> in_reward("reward+loss"), in_reward("loss")
        (True, False)
    """
    return _placement(placement) in ("reward", "reward+loss")


def in_loss(placement: Placement) -> bool:
    """Whether ``placement`` differentiates a KL term in the loss (``loss``, ``reward+loss``).

    Example:
        >>> in_loss("reward+loss"), in_loss("reward")
        (True, False)
    """
    return _placement(placement) in ("loss", "reward+loss")


def _placement(placement: str) -> str:
    if placement not in ("none", *PLACEMENTS):
        raise ValueError(
            f"unknown placement {placement!r}; choose one of: none, {', '.join(PLACEMENTS)}"
        )
    return placement


OffPolicy = Literal["weighted", "carried", "none"]
"""How :func:`klpo.losses.kl_loss` keeps an estimator's on-policy expected gradient for tokens
sampled from pi_old (:attr:`Spec.off_policy`)."""


Mode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
"""A loss reduction's name (:func:`klpo.reduce.reduce` computes it)."""
MODES: tuple[str, ...] = get_args(Mode)
"""The loss reductions, by name: what ``algo.loss_reduction`` may be."""


def _fn(name: str) -> Ref:
    """Estimator function ``name`` of :mod:`klpo.estimators`, imported when first called."""
    return Ref("klpo.estimators", name)


@dataclass(frozen=True)
class Spec:
    """One KL estimator's traits: the one record of what it computes and what it needs.

    :data:`SPECS` maps each name to its ``Spec``; the losses, the trainer's step, the lab, the run
    report, the bridges to TRL and verl, ``klpo explain`` and ``klpo doctor`` all read it, so an
    estimator is added by adding its function and one row (:func:`register`).

    Attributes:
        fn: the per-token function (``fn(logp, logp_ref)``, ``fn(logp, logp_ref, logp_old)`` with
            ``needs_old``, ``fn(logits, logits_ref)`` with ``needs_logits``); its docstring is the
            estimator's reference. None for a reference-sampled estimator, which is no per-token
            function of the policy's tokens (:mod:`klpo.ref_kl` computes it).
        target: the KL the value is meant to estimate, :data:`THETA_REF` or :data:`REF_THETA`.
        equation: the value in one line, with d = logp - logp_ref (what :func:`explain` shows).
        off_policy: how :func:`klpo.losses.kl_loss` corrects it for tokens sampled from pi_old:
            ``"weighted"``, a detached weight pi_theta/pi_old on each token; ``"carried"``, it
            carries its own weight with the gradient through it and is returned as is (``k3_is``;
            it has no uncorrected form); ``"none"``, nothing to reweight: the value does not
            depend on the token the policy sampled (``full``) or the samples are the
            reference's (the reference-sampled estimators).
        loss_variant: the estimator that logs this one's value (or the nearest one) and whose
            expected gradient in the loss is grad KL(pi_theta ‖ pi_ref): itself where its own is
            (``k2``, ``k3_is``, ``full``), its straight-through ``+`` twin where not (``k1`` ->
            ``k1+``), ``k3+`` where it has no twin (``low_var_kl``, ``kl_ref_theta``). What
            ``klpo doctor`` proposes for a loss term that uses this estimator.
        needs_old: it needs ``logp_old``, the sampling policy's log-probs (``k3_is``).
        needs_logits: it is the exact KL over the vocabulary, computed from both models' logits
            ``[B, T, V]`` (or hidden states and the head, :func:`klpo.logprobs.fused`) rather
            than the sampled tokens' log-probs: the trainer logs it as ``kl/ref/exact``, it is
            not defined for a continuous distribution (the lab's Gaussians), and frameworks
            that pass only token log-probs (the TRL and verl bridges) cannot compute it.
        ref_sampled: it needs completions sampled from pi_ref (:mod:`klpo.ref_kl`), so ``"loss"``
            is its only placement (:func:`refusal`); listed in :data:`REF_SAMPLED`, not in
            :data:`ESTIMATORS`.
        mixed: (reference-sampled only) the term is ``a · k1`` on the policy's tokens plus
            ``(1 - a) · ref_is`` on the reference's, with ``a`` from a window of past KLs
            (:class:`klpo.ref_kl.MixWindow`); otherwise ``a = 0``.

    Example:
        >>> from klpo import kl
        >>> s = kl.SPECS["k3_is"]
        >>> s.needs_old, s.needs_logits, s.off_policy, s.loss_variant
        (True, False, 'carried', 'k3_is')
        >>> [n for n, s in kl.SPECS.items() if s.needs_logits]
        ['full']
    """

    fn: Callable[..., Any] | None
    target: str
    equation: str
    off_policy: OffPolicy
    loss_variant: str
    needs_old: bool = False
    needs_logits: bool = False
    ref_sampled: bool = False
    mixed: bool = False


_W, _C, _N = "weighted", "carried", "none"

SPECS: dict[str, Spec] = {
    "k1": Spec(_fn("k1"), THETA_REF, "d", _W, "k1+"),
    "k2": Spec(_fn("k2"), THETA_REF, "d²/2", _W, "k2"),
    "k3": Spec(_fn("k3"), THETA_REF, "exp(-d) + d - 1", _W, "k3+"),
    "abs": Spec(_fn("abs_"), THETA_REF, "|d|", _W, "abs+"),
    "k1+": Spec(_fn("k1_plus"), THETA_REF, "d, with the gradient of d²/2", _W, "k1+"),
    "k2+": Spec(_fn("k2_plus"), THETA_REF, "d²/2 (= k2)", _W, "k2"),
    "k3+": Spec(_fn("k3_plus"), THETA_REF, "exp(-d) + d - 1, with the gradient of d²/2", _W, "k3+"),
    "abs+": Spec(_fn("abs_plus"), THETA_REF, "|d|, with the gradient of d²/2", _W, "abs+"),
    "k3_is": Spec(
        _fn("k3_is"),
        THETA_REF,
        "w·(exp(-d) + d - 1), w = exp(logp - logp_old)",
        _C,
        "k3_is",
        needs_old=True,
    ),
    "low_var_kl": Spec(
        _fn("low_var_kl"), THETA_REF, "clamp(k3 with |d| ≤ 20, -10, 10) (verl)", _W, "k3+"
    ),
    "kl_ref_theta": Spec(
        _fn("kl_ref_theta"), REF_THETA, "r log r - (r - 1), r = exp(-d)", _W, "k3+"
    ),
    "full": Spec(
        _fn("full"), THETA_REF, "sum_v pi(v) log(pi(v)/pi_ref(v))", _N, "full", needs_logits=True
    ),
    "ref_is": Spec(
        None,
        THETA_REF,
        "w·log w over x ~ pi_ref, w = pi_theta(x)/pi_ref(x)",
        _N,
        "ref_is",
        ref_sampled=True,
    ),
    "adaptive_mix": Spec(
        None,
        THETA_REF,
        "a·k1 + (1 - a)·ref_is, a = sigmoid(±gamma (KL_window - threshold)); "
        "its expected gradient is scaled by 1 - a",
        _N,
        "adaptive_mix",
        ref_sampled=True,
        mixed=True,
    ),
}
"""Every KL estimator by name, in the order of the docs' tables: the one registry of their traits
(:class:`Spec`). Read it, and :data:`ESTIMATORS` / :data:`REF_SAMPLED` (views of it), at the time
of use rather than copying it at import, so that an estimator added by :func:`register` (or, in a
test, ``monkeypatch.setitem(kl.SPECS, name, spec)``) is known everywhere."""


def _names(keep: Callable[[Spec], bool]) -> Callable[[], Iterator[str]]:
    return lambda: (n for n, s in SPECS.items() if keep(s))


ESTIMATORS: Sequence[str] = LiveNames(
    _names(lambda s: not s.ref_sampled),
    "The per-token estimators (functions of the policy's own samples), by name, in registry "
    "order; a view of :data:`SPECS`, read when used.",
)
REF_SAMPLED: Sequence[str] = LiveNames(
    _names(lambda s: s.ref_sampled),
    "Estimators that also need completions sampled from pi_ref (:mod:`klpo.ref_kl`): "
    "``ref_is`` and ``adaptive_mix``; not in :data:`ESTIMATORS`.",
)
LOGPROB_ESTIMATORS: Sequence[str] = LiveNames(
    _names(lambda s: not s.ref_sampled and not s.needs_logits),
    "The per-token estimators computed from the sampled tokens' log-probs alone (and logp_old): "
    ":data:`ESTIMATORS` but those that need the logits. What a framework that passes only token "
    "log-probs can use, and what is defined for a continuous distribution.",
)


def register(name: str, spec: Spec, *, replace: bool = False) -> Spec:
    """Add estimator ``name`` to :data:`SPECS` and return its spec.

    Every layer then knows it: :func:`estimate`, :func:`explain`, :func:`klpo.losses.kl_loss`,
    the trainer's ``kl.estimator``, the lab, the bridges and the doctor.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> def twice_k2(logp, logp_ref):
        ...     return kl.k2(logp, logp_ref) * 2.0
        >>> spec = kl.Spec(twice_k2, kl.THETA_REF, "d²", "weighted", "k2")
        >>> kl.register("d2", spec) is spec
        True
        >>> kl.estimate("d2", torch.tensor([[0.5]]), torch.tensor([[0.0]]))  # 0.5² = 0.25
        tensor([[0.2500]])
        >>> del kl.SPECS["d2"]

    Raises:
        ValueError: an empty name or one taken (unless ``replace``), a ``fn`` that is missing or
            not callable where the spec is per-token (or given to a reference-sampled one),
            ``mixed`` without ``ref_sampled``, an unknown ``target`` or ``off_policy``, or a
            ``loss_variant`` that is neither ``name`` nor a registered estimator.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an estimator needs a name, got {name!r}")
    if name in SPECS and not replace and SPECS[name] != spec:
        raise ValueError(
            f"estimator {name!r} is already registered; pass replace=True to replace it"
        )
    if not isinstance(spec, Spec):
        raise ValueError(f"estimator {name!r}: {spec!r} is not a klpo.kl.Spec")
    if spec.ref_sampled != (spec.fn is None):
        raise ValueError(
            f"estimator {name!r}: a per-token estimator needs fn (its function); a reference-"
            "sampled one (ref_sampled=True) has none (klpo.ref_kl computes it)"
        )
    if spec.fn is not None and not callable(spec.fn):
        raise ValueError(f"estimator {name!r}: fn={spec.fn!r} is not a function")
    if spec.fn is not None and not isinstance(spec.fn, Ref):
        _check_function(name, spec)
    if spec.mixed and not spec.ref_sampled:
        raise ValueError(f"estimator {name!r}: mixed=True needs ref_sampled=True")
    if spec.target not in (THETA_REF, REF_THETA):
        raise ValueError(
            f"estimator {name!r}: target must be klpo.kl.THETA_REF or REF_THETA, got {spec.target!r}"
        )
    if spec.off_policy not in get_args(OffPolicy):
        raise ValueError(
            f"estimator {name!r}: off_policy must be one of {', '.join(get_args(OffPolicy))}, "
            f"got {spec.off_policy!r}"
        )
    if spec.loss_variant != name and spec.loss_variant not in SPECS:
        raise ValueError(
            f"estimator {name!r}: loss_variant={spec.loss_variant!r} is not a registered "
            f"estimator; choose {name!r} itself or one of: {', '.join(SPECS)}"
        )
    SPECS[name] = spec
    return spec


def _check_function(name: str, spec: Spec) -> None:
    """A registered function takes the arguments its traits say and returns a per-position
    tensor of their shape (tried once on a small input; a function of tensors implies torch)."""
    import inspect

    args = ("logits", "logits_ref") if spec.needs_logits else ("logp", "logp_ref")
    args += ("logp_old",) if spec.needs_old else ()
    try:
        inspect.signature(spec.fn).bind(*args)
    except TypeError:
        raise ValueError(
            f"estimator {name!r}: fn={getattr(spec.fn, '__name__', spec.fn)!r} must take "
            f"({', '.join(args)}) positionally, as its traits say (needs_logits="
            f"{spec.needs_logits}, needs_old={spec.needs_old})"
        ) from None
    except ValueError:  # a builtin without an inspectable signature: the call below tells
        pass
    import torch

    if spec.needs_logits:
        inputs = (torch.zeros(1, 2, 4), torch.ones(1, 2, 4)), (1, 2)
    else:
        logp = torch.tensor([[-1.0, -2.0, -0.5]])
        inputs = (logp, logp - 0.25, logp)[: len(args)], (1, 3)
    (x, want) = inputs
    try:
        out = spec.fn(*x)
    except Exception as err:
        raise ValueError(
            f"estimator {name!r}: fn failed on a small input of the shapes it will be given "
            f"({', '.join(f'{a} {tuple(t.shape)}' for a, t in zip(args, x, strict=False))}): "
            f"{type(err).__name__}: {err}"
        ) from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"estimator {name!r}: fn must return one value per position, a tensor of shape "
            f"{want} for inputs of shape {tuple(x[0].shape)}; it returned {got}"
        )


def _spec(name: str) -> Spec:
    """The spec of a per-token estimator (ValueError listing :data:`ESTIMATORS` otherwise)."""
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None or spec.ref_sampled:
        raise ValueError(f"unknown KL estimator {name!r}; choose one of: {', '.join(ESTIMATORS)}")
    return spec


# --------------------------------------------------------------------------------------------
# Estimators from samples of the reference (klpo.ref_kl): only in the loss.


def refusal(name: str, placement: str) -> str | None:
    """Why ``name`` cannot go in ``placement``, or None if it can.

    Only the estimators of :data:`REF_SAMPLED` refuse a placement: ``ref_is`` is computed on
    completions the *reference* sampled, so as a detached per-token reward it would attach to
    no token the policy sampled and carry no policy-gradient term for them; ``adaptive_mix``
    inherits this through its ``ref_is`` part.

    Example:
        >>> from klpo import kl
        >>> kl.refusal("k3", "reward") is None, kl.refusal("ref_is", "loss") is None
        (True, True)
        >>> kl.refusal("ref_is", "reward")[:49]
        'ref_is cannot go in the reward: it is computed on'
    """
    spec = SPECS.get(name) if isinstance(name, str) else None
    if spec is None or not spec.ref_sampled or placement == "loss":
        return None
    why = (
        f"{name} cannot go in the {placement}: it is computed on completions sampled from pi_ref, "
        "not from the policy, so as a detached reward it sits on no token the policy sampled and "
        "carries no policy-gradient term for the policy's own tokens. "
    )
    if spec.mixed:
        why += "(Its k1 part could, but its ref_is part cannot, and the mix is one number.) "
    return why + (
        "Use kl.placement=loss: there, differentiating w·log w with the reference's samples held "
        "fixed follows grad KL(pi_theta ‖ pi_ref) exactly (klpo explain -e ref_is -p loss)."
    )


# --------------------------------------------------------------------------------------------
# explain: the table of claims, derived by exact enumeration rather than typed in.


@dataclass(frozen=True)
class Explanation:
    """What a KL estimator in a placement really does.

    Attributes:
        estimator: the estimator's name.
        placement: ``"reward"`` (the detached estimate is a per-token penalty in the reward,
            optimised by the policy gradient), ``"loss"`` (the estimate is added to the loss and
            differentiated) or ``"reward+loss"`` (both).
        on_policy: whether the tokens were sampled from pi_theta itself (else from pi_old).
        equation: the value, with d = logp - logp_ref.
        estimates: the KL the value is meant to estimate.
        unbiased: whether E[value] equals that KL exactly.
        nonnegative: whether every value is ≥ 0.
        gradient: the expected gradient the term follows, one of :data:`GRADIENTS`.
        mismatch: True when the gradient is not the gradient of the KL the value estimates.
    """

    estimator: str
    placement: str
    on_policy: bool
    equation: str
    estimates: str
    unbiased: bool
    nonnegative: bool
    gradient: str
    mismatch: bool

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    def text(self) -> str:
        """The explanation for people, a few lines."""
        sampling = "samples from pi_theta" if self.on_policy else "samples from pi_old ≠ pi_theta"
        spec = SPECS.get(self.estimator)
        if spec is not None and spec.ref_sampled:
            sampling = "samples from pi_ref and pi_theta" if spec.mixed else "samples from pi_ref"
        value = (
            f"{'unbiased' if self.unbiased else 'biased'} estimate of {self.estimates}, "
            f"{'never negative' if self.nonnegative else 'can be negative'}"
        )
        if self.gradient == GRAD_ZERO:
            grad = "zero in expectation: this term regularises nothing"
        elif self.gradient == GRAD_OTHER:
            grad = "no KL's gradient (biased)"
        else:
            grad = self.gradient
        lines = [
            f"{self.estimator} in the {self.placement} ({sampling})",
            f"  value:    {self.equation}, d = logp - logp_ref",
            f"  estimate: {value}",
            f"  gradient: follows {grad}",
        ]
        if self.mismatch:
            lines.append(
                f"  note:     the gradient is not that of {self.estimates}, the KL it logs"
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# klpo explain's answers for the built-in rows, as shipped.

EXPLAIN_TABLE = "explain.json"
"""The file under ``klpo/assets`` that holds :func:`klpo.kl.explain`'s answers for every built-in
estimator and placement, on- and off-policy (written by ``python -m klpo.lab.tables``)."""


@functools.cache
def _shipped() -> dict[tuple[str, str, bool], dict[str, Any]]:
    text = resources.files("klpo").joinpath("assets", EXPLAIN_TABLE).read_text(encoding="utf-8")
    rows = json.loads(text)["explanations"]
    return {(r["estimator"], r["placement"], r["on_policy"]): r for r in rows}


def explanation(name: str, placement: str, *, on_policy: bool = True) -> Explanation | None:
    """:func:`klpo.kl.explain`'s answer for a built-in row, read from the shipped table without
    torch; None where the table has no such row, or where the row registered now is not the one
    the table was derived from (its equation or target differ: derive it with
    :func:`klpo.kl.explain`, which needs torch).

    Example:
        >>> explanation("k3", "loss").gradient  # GRPO's k3 in the loss: the other direction
        'grad KL(pi_ref ‖ pi_theta)'
        >>> explanation("k3", "loss", on_policy=False) is not None, explanation("nope", "loss")
        (True, None)
    """
    row = _shipped().get((name, placement, bool(on_policy)))
    spec = SPECS.get(name)
    if row is None or spec is None:
        return None
    if (row["equation"], row["estimates"]) != (spec.equation, spec.target):
        return None
    return Explanation(**row)


# --------------------------------------------------------------------------------------------
# klpo explain --teacher's answers, as shipped.

TEACHER_TABLE = "explain_teacher.json"
"""The file under ``klpo/assets`` that holds ``klpo explain --teacher``'s answers: per position,
each distillation term's value and the gradient it follows on two families of cases; over a
sequence, each credit's gradient against the sequence KL's (written by ``python -m
klpo.lab.tables``; :mod:`klpo.lab.teacher` derives them)."""


@functools.cache
def teacher_table() -> dict[str, Any]:
    """The shipped table of ``klpo explain --teacher`` (:data:`TEACHER_TABLE`), as JSON data:
    ``{"about", "k", "vocab", "cases", "positions": [...], "sequences": [...]}``.

    Example:
        >>> t = teacher_table()
        >>> t["k"], t["vocab"]  # the top-k forms are derived at k = 4 of a vocabulary of 16
        (4, 16)
    """
    text = resources.files("klpo").joinpath("assets", TEACHER_TABLE).read_text(encoding="utf-8")
    return json.loads(text)


def teacher_positions(key: str, placement: str = "loss") -> dict[str, dict[str, Any]]:
    """A distillation term's per-position answers, by family of cases (``{"near": row,
    "sharp": row}``), or ``{}`` where the table has no such term.

    ``key`` is the form's name independent of the top-k size (``k1``, ``k3``, ``full``,
    ``forward``, ``jsd``, ``topk_forward_clamp``, ``teacher_topk_renorm_mixed``, ...). A row
    holds ``value`` (the divergence the expected value equals, or "none"), ``gradient`` (the
    divergence whose gradient it follows: ``KL(pi_theta ‖ pi_T)``, ``KL(pi_T ‖ pi_theta)``,
    "zero", "other", or a JSD's own), the mean cosines ``cos_reverse`` / ``cos_forward`` of its
    expected gradient to each KL's, and ``clamp_binds`` (the share of positions where a clamp
    zeroes the position's gradient).

    Example:
        >>> teacher_positions("k3")["near"]["gradient"]  # verl's k3 logs reverse, follows forward
        'KL(pi_T ‖ pi_theta)'
        >>> teacher_positions("k1", "reward")["near"]["gradient"]
        'KL(pi_theta ‖ pi_T)'
    """
    rows = teacher_table()["positions"]
    return {r["family"]: r for r in rows if r["key"] == key and r["placement"] == placement}


def teacher_sequence(term: str, placement: str, credit: str = "") -> dict[str, Any] | None:
    """A term's answer over whole sequences (``cos_sequence``, ``rel_error``, ``follows``: whether
    its expected gradient is that of the sequence KL(pi_theta ‖ pi_T)), or None.

    ``placement`` ``"reward"`` with ``credit`` ``"returns"`` (returns-to-go) or ``"token"``
    (discount 0), ``"loss"``, or ``"reward+loss"``.

    Example:
        >>> teacher_sequence("k1", "reward", "token")["follows"]  # Tinker's discount 0
        False
        >>> teacher_sequence("k1", "reward", "returns")["follows"]
        True
    """
    for r in teacher_table()["sequences"]:
        if (r["term"], r["placement"], r["credit_key"]) == (term, placement, credit):
            return r
    return None
