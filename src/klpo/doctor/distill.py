r"""On-policy distillation in the frameworks' configs: the terms' vocabulary, the traps, the section.

In on-policy distillation (OPD) the student pi_theta samples, a teacher pi_T scores the student's
tokens, and the student descends a divergence to the teacher. The frameworks compute it in three
ways, each a :class:`~klpo.doctor.reading.TeacherTerm` here:

- **sampled**: an estimator of d = log pi_theta(y) - log pi_T(y) at the sampled token y (k1,
  k2, k3), either differentiated in the loss (verl's supervised estimators) or, detached, as a
  per-token reward in a policy gradient (the Tinker cookbook's -(log pi_theta - log pi_T),
  verl's ``use_policy_gradient``, NeMo-RL's ``opd`` advantage, slime's OPD, prime-rl's ``opd``);
- **full**: a divergence over the whole vocabulary at each position (TRL's generalised JSD,
  NeMo-RL's ``on_policy_distillation.full``);
- **top-k**: a divergence over the teacher's or the student's top-k tokens, truncated (verl's
  ``forward_kl_topk``) or renormalised (NeMo-RL's ``distillation`` loss, TRL SDPO's
  ``topk_logits``).

What each follows is not typed here: :mod:`klpo.doctor.report` reads it from ``klpo explain
--teacher``'s shipped table. This module holds what the readers share: the term builders, the
findings for the traps (each read in a framework's source or thread, named where used), and the
``teacher:`` section of klpo's teacher mode that does the same thing, or that the settings most
likely meant. The section follows the config shape of klpo's teacher mode (estimator, placement,
credit, beta, jsd_beta, top_k, clamp_zero, log_prob_floor); the report validates it with klpo's
train config.
"""

from __future__ import annotations

from typing import Any

from klpo import registry
from klpo.doctor.reading import Reading, TeacherTerm

__all__ = [
    "FORWARD",
    "REVERSE",
    "build_sections",
    "exact",
    "per_token_credit",
    "sampled",
    "support_bias",
    "topk_clamp_zero",
]

REVERSE = "KL(pi_theta ‖ pi_T)"
FORWARD = "KL(pi_T ‖ pi_theta)"

# klpo.kl estimator -> the key of its row in klpo explain --teacher's table (low_var_kl: k3
# where no clamp binds; the clamps are reported beside).
SAMPLED_ROWS: dict[str, str] = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "k3"}

# the exact forms over the vocabulary: direction -> (divergence, table key, klpo estimator)
EXACT: dict[str, tuple[str, str, str]] = {
    "reverse": (REVERSE, "full", "full"),
    "forward": (FORWARD, "forward", "forward"),
}


def sampled(
    option: str,
    framework_name: str,
    estimator: str | None,
    placement: str,
    beta: float,
    beta_option: str,
    *,
    credit: str = "",
    clamps: tuple[str, ...] = (),
    value_clamp: tuple[float, float] | None = None,
    log_ratio_clamp: tuple[float, float] | None = None,
    teacher: str = "",
    logged_as: str = "",
) -> TeacherTerm:
    """A sampled-token term: ``estimator`` (a :data:`klpo.kl.ESTIMATORS` name, the teacher in
    the reference's place) of d = log pi_theta(y) - log pi_T(y) at each sampled token y, in the
    loss or, detached, in the reward with ``credit`` ``"token"`` (discount 0) or ``"returns"``."""
    klpo: dict[str, Any] = {}
    if estimator is not None and estimator in registry.LOGPROB_ESTIMATORS:
        klpo = {"estimator": estimator, "placement": placement, "beta": beta}
        if placement == "reward":
            klpo["credit"] = credit or "token"
    what = f"{estimator} of d" if estimator else "a function of d"
    return TeacherTerm(
        option=option,
        framework_name=framework_name,
        divergence=f"{REVERSE}, estimated at the sampled token ({what} = log pi_theta(y) - "
        "log pi_T(y))",
        direction="reverse",
        support="sampled",
        placement=placement,
        beta=beta,
        beta_option=beta_option,
        credit=credit if placement == "reward" else "",
        clamps=clamps,
        estimator=estimator,
        value_clamp=value_clamp,
        log_ratio_clamp=log_ratio_clamp,
        table_key=SAMPLED_ROWS.get(estimator or ""),
        teacher=teacher,
        logged_as=logged_as,
        klpo=klpo,
    )


def exact(
    option: str,
    framework_name: str,
    direction: str,
    beta: float,
    beta_option: str,
    *,
    jsd_beta: float | None = None,
    clamps: tuple[str, ...] = (),
    teacher: str = "",
    logged_as: str = "",
) -> TeacherTerm:
    """A divergence over the whole vocabulary at every position of the student's completions, in
    the loss: ``direction`` ``"reverse"`` (KL(pi_theta ‖ pi_T)), ``"forward"`` (KL(pi_T ‖
    pi_theta)) or ``"jsd"`` (TRL's generalised JSD at ``jsd_beta``; klpo's table derives it at
    0.5)."""
    if direction == "jsd":
        if jsd_beta is None:
            raise ValueError("a generalised JSD needs its jsd_beta")
        divergence = (
            f"TRL's generalised JSD at beta {jsd_beta:g}: {jsd_beta:g} KL(pi_T ‖ m) + "
            f"{1 - jsd_beta:g} KL(pi_theta ‖ m), m = {1 - jsd_beta:g} pi_theta + {jsd_beta:g} "
            "pi_T (neither KL)"
        )
        key = "jsd" if jsd_beta == 0.5 else None
        klpo = {"estimator": "jsd", "placement": "loss", "beta": beta, "jsd_beta": jsd_beta}
        shown = f"JSD({jsd_beta:g})"
    else:
        divergence, key, est = EXACT[direction]
        klpo = {"estimator": est, "placement": "loss", "beta": beta}
        divergence += ", exact over the vocabulary"
        shown = direction
    return TeacherTerm(
        option=option,
        framework_name=framework_name,
        divergence=divergence,
        direction=shown,
        support="full",
        placement="loss",
        beta=beta,
        beta_option=beta_option,
        clamps=clamps,
        table_key=key,
        teacher=teacher,
        logged_as=logged_as,
        klpo=klpo,
    )


# ---------------------------------------------------------------------------------------------
# The traps, one finding each.


def _sequence_numbers() -> str:
    row = registry.teacher_sequence("k1", "reward", "token")
    if row is None:  # the shipped table always has it; a test says so
        return ""
    return (
        f" (klpo explain --teacher, tabular sequence models: cosine {row['cos_sequence']:.3f} to "
        f"the sequence KL's gradient, relative error {row['rel_error']:.2f})"
    )


def per_token_credit(r: Reading, t: TeacherTerm, keys: list[str], where: str) -> None:
    """The Tinker-style trap: a per-token reward -d_t credited only to its own token (discount 0)
    follows, summed over the completion, the per-position gradients E[sum_t grad KL_t], not the
    gradient of the sequence KL(pi_theta ‖ pi_T) = E[sum_t d_t]: it misses how a token changes
    the teacher's view of the tokens after it. Returns-to-go follow the sequence KL exactly."""
    r.warn(
        "warning",
        keys,
        f"{t.framework_name}: each token's advantage is its own -(log pi_theta - log pi_T) "
        f"with no return from the tokens after it (discount 0, as the Tinker cookbook's "
        f"on-policy distillation; {where}): per position it follows grad {REVERSE}, but over the "
        "completion it follows the sum of the per-position gradients, not the gradient of the "
        "sequence KL it logs: a token is never charged for the teacher's view of what it leads "
        f"to{_sequence_numbers()}; returns-to-go (klpo teacher.credit: returns) follow the "
        "sequence KL exactly",
    )


def topk_clamp_zero(r: Reading, t: TeacherTerm, keys: list[str], where: str) -> None:
    """verl's ``forward_kl_topk`` clamps the truncated sum at 0 (``clamp_min(0.0)``): where the
    student puts more mass on the teacher's top-k than the teacher does, the sum is negative and
    the position's whole gradient is zero (verl#7856: in 415 of 467 steps of a user's run)."""
    rows = registry.teacher_positions("topk_forward_clamp")
    share = ", ".join(f"{rows[f]['clamp_binds']:.0%} of {f!r} positions" for f in sorted(rows))
    r.warn(
        "warning",
        keys,
        f"{t.framework_name}: the teacher-top-k sum sum_K p (log p - log q) is no KL (both "
        "masses are truncated) and goes negative wherever the student puts more mass on the "
        f"teacher's top-{t.top_k} than the teacher does; {where} clamps it at 0 "
        "(clamp_min(0.0)), which zeroes that position's whole gradient (verl#7856: the clamp "
        "was active in 415 of 467 training steps of a run; klpo explain --teacher: "
        + (share or "—")
        + "); the K+1-bucket KL with the tail (verl#7855; klpo topk_tail) is never negative",
    )


def support_bias(r: Reading, t: TeacherTerm, keys: list[str], where: str, fix: str) -> None:
    """A reverse KL renormalised over a top-k support sees only the two conditionals on it: the
    mass outside is never compared (verl#7856 says the same of the teacher-top-k forward sum,
    "tail-mass mismatch is unpenalized"). On the teacher's top-k the student's mass outside it
    costs nothing; on the student's own top-k the student is never pulled towards a token it
    does not already rank there. (verl dropped its truncated top-k reverse KL from PR #5041 as
    unstable: the student shrank it by lowering its own top-k mass.)"""
    what = "a reverse KL" if t.direction == "reverse" else "a mix with a reverse KL"
    if t.topk_of == "teacher":
        outside = (
            "the student's mass outside the teacher's top-k is never compared, so moving mass "
            "there costs nothing"
        )
    else:
        outside = (
            "the teacher's mass outside the student's top-k is never seen, so the student is "
            "never pulled towards a token it does not already rank there"
        )
    r.warn(
        "warning",
        keys,
        f"{t.framework_name}: {what} on the {t.topk_of}'s top-{t.top_k}, both models "
        f"renormalised there ({where}): {outside}; the term is zero wherever the two agree on "
        "that support, however far apart they are off it (support bias; verl#7856 on the "
        f"tail-mass mismatch a top-k form leaves unpenalised); {fix}",
    )


# ---------------------------------------------------------------------------------------------
# klpo's teacher section.


def build_sections(r: Reading, teacher: str | None, intended: dict[str, Any] | None = None) -> None:
    """Fill ``r.teacher_section`` (the same thing, as far as klpo's teacher mode can) and
    ``r.teacher_intended`` from ``r.teacher_terms``.

    ``teacher``: the teacher model the config names ("" where it names none: TEACHER stands for
    it; None where the teacher is the student itself, so the section has no model).
    ``intended``: the keys that change in the meant section (None removes a key), with its
    reasons in ``r.teacher_intended_why`` (filled by the caller)."""
    if not r.teacher_terms:
        return
    first = r.teacher_terms[0]
    model = {} if teacher is None else {"model": teacher or "TEACHER"}
    if first.klpo:
        r.teacher_section = {**model, **first.klpo}
    else:
        r.teacher_differences.append(
            f"klpo's teacher mode has no estimator for {first.framework_name} "
            f"({first.divergence}); no same-thing section"
        )
    if teacher == "":
        r.teacher_differences.append("the config names no teacher model: TEACHER stands for it")
    for t in r.teacher_terms[1:]:
        r.teacher_differences.append(
            f"klpo's teacher mode has one teacher term; {t.framework_name} ({t.option}) is not "
            "in the section"
        )
    base = r.teacher_section or {**model, "placement": "loss", "beta": first.beta}
    merged = {**base, **(intended or {})}
    r.teacher_intended = {k: v for k, v in merged.items() if v is not None}
    if not intended and not r.teacher_intended_why:
        r.teacher_intended_why.append("the term already does what its name says: the same section")
