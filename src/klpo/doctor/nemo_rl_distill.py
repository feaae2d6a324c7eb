r"""NeMo-RL's two kinds of on-policy distillation, read for the doctor.

Pinned: NVIDIA-NeMo/RL ``7ea279a`` (the reader's commit), and ``0054c4e`` for PR #3978's
``on_policy_distillation.full``, which came after it.

**The distillation algorithm** (``examples/run_distillation.py``, a master config with
``distillation:``, ``teacher:`` and ``loss_fn:`` sections; ``nemo_rl/algorithms/distillation.py``):
the student samples ``distillation.num_generations_per_prompt`` completions per prompt, the teacher
returns its top ``distillation.topk_logits_k`` logits at every position, and
``DistillationLossFn`` (``nemo_rl/algorithms/loss/loss_functions.py``) takes ``loss_fn.kl_type``
forward, reverse or mixed (``mixed_kl_weight`` × forward + (1 − weight) × reverse; it asserts the
type and the weight's range). With ``loss_fn.zero_outside_topk`` false (the default)
``get_distillation_topk_logprobs_from_logits`` (``nemo_rl/distributed/model_utils.py``) gathers
both models' logits at the teacher's top-k and takes ``log_softmax`` over them: a KL of the two
distributions renormalised on the teacher's top-k. With it true the student's log-probs are its
full-vocabulary ones and, for reverse and mixed, a correction charges the student's mass outside
the top-k at log-prob −100. The per-token KL is averaged over the batch's tokens.

**MOPD** (GRPO with ``grpo.adv_estimator.name: opd`` and an ``on_policy_distillation:`` block;
``docs/about/algorithms/mopd.md``, ``OPDAdvantageEstimator`` in
``nemo_rl/algorithms/advantage_estimator.py``): each token's advantage is
sg(log pi_T − log pi_theta) of the sampled token (``prev_logprobs``), nothing else; the task
reward does not enter it. It runs on async GRPO only: the teacher log-probs are collected in
``async_grpo_train``, and without them the estimator raises. At ``0054c4e``
``on_policy_distillation.full.enabled`` replaces the policy-gradient objective with the exact
reverse KL over the vocabulary (``OnPolicyDistillationFullConfig``: ``divergence`` reverse_kl only;
the teacher's hidden states projected by its own head on the student's side, or its logits); the
pinned ``7ea279a`` does not know the block, and its ``extra="allow"`` model drops it.
"""

from __future__ import annotations

import re
from typing import Any

from klpo.doctor import distill, tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.keys import check_keys, settle
from klpo.doctor.reading import Reading, Settings, TeacherTerm, flatten

__all__ = ["KL_TYPES", "read_distillation", "read_opd"]

LOSS = "nemo_rl/algorithms/loss/loss_functions.py (DistillationLossFn)"
FULL_COMMIT = "0054c4e"

# kl_type -> (the KL on the renormalised top-k, its key in klpo explain --teacher's table)
KL_TYPES: dict[str, tuple[str, str]] = {
    "forward": ("KL(p^K ‖ q^K)", "teacher_topk_renorm_forward"),
    "reverse": ("KL(q^K ‖ p^K)", "teacher_topk_renorm_reverse"),
    "mixed": ("w KL(p^K ‖ q^K) + (1 − w) KL(q^K ‖ p^K)", "teacher_topk_renorm_mixed"),
}
CARRIED = [
    ("policy.model_name", "model.policy"),
    ("distillation.num_prompts_per_step", "rollout.prompts_per_step"),
    ("policy.generation.temperature", "rollout.temperature"),
    ("policy.generation.top_p", "rollout.top_p"),
    ("policy.optimizer.kwargs.lr", "optim.lr"),
    ("policy.optimizer.kwargs.weight_decay", "optim.weight_decay"),
    ("policy.max_grad_norm", "optim.grad_clip"),
]


def read_distillation(
    data: dict[str, Any], source: str, version: str | None, version_read: str, policy: Any
) -> Reading:
    """A NeMo-RL distillation master config (its ``defaults:`` chain merged, interpolations
    resolved) into a :class:`~klpo.doctor.reading.Reading`."""
    r = Reading(framework="nemo-rl", defaults_version=version_read, version=version, source=source)
    table = tables.load("nemo-rl-distillation", version_read.split("+")[0] + "+7ea279a").defaults
    r.defaults_from = (
        "the doctor's table of NeMo-RL's distillation config models (klpo/assets/doctor: "
        "DistillationLossConfig, DistillationConfig)"
    )
    given = check_keys(r, flatten(data), table, "NeMo-RL", version_read, policy,
                       checked=("loss_fn", "distillation"))  # fmt: skip
    s = Settings(given, table, source)
    kl_type = s.str("loss_fn.kl_type") or "mixed"
    weight = s.float("loss_fn.mixed_kl_weight")
    weight = 0.5 if weight is None else weight
    zero = s.bool("loss_fn.zero_outside_topk")
    k = s.int("distillation.topk_logits_k") or 64
    n = s.int("distillation.num_generations_per_prompt") or 1
    prompts = s.int("distillation.num_prompts_per_step")
    gbs = s.int("policy.train_global_batch_size")
    steps = max(1, (prompts * n) // gbs) if prompts and gbs else 1
    teacher = s.str("teacher.model_name") or ""
    r.algorithm, r.group_size, r.updates_per_batch = "distillation", n, steps
    keys = ["loss_fn.kl_type", "loss_fn.zero_outside_topk"]
    refused = kl_type not in KL_TYPES or not 0 <= weight <= 1
    if refused:
        r.warn(
            "error",
            ["loss_fn.kl_type", "loss_fn.mixed_kl_weight"],
            f"loss_fn.kl_type = {kl_type!r}, mixed_kl_weight = {weight:g}: NeMo-RL asserts "
            f"kl_type in forward, reverse, mixed and the weight in [0, 1] ({LOSS}.__init__); "
            "the run does not start",
            kind="refused",
        )
    else:
        t = _topk_term(kl_type, weight, zero, k, teacher)
        r.teacher_terms.append(t)
        if kl_type != "forward" and not zero:
            distill.support_bias(
                r, t, keys, f"{LOSS}, nemo_rl/distributed/model_utils.py",
                "loss_fn.zero_outside_topk: true charges the student's mass outside the "
                "teacher's top-k (at log-prob −100)",
            )  # fmt: skip
        r.teacher_intended_why.append(
            "estimator: full, the exact reverse KL over the whole vocabulary, which "
            "renormalises nothing (NeMo-RL's MOPD has it as on_policy_distillation.full, PR "
            "#3978); where the teacher's whole distribution cannot be had, topk_tail"
        )
    if steps > 1:
        r.warn(
            "note",
            ["distillation.num_prompts_per_step", "policy.train_global_batch_size"],
            f"{steps} optimiser steps per batch of completions: from the second on, the "
            "positions the divergence is taken at were sampled by an older student",
        )
    r.teacher_differences.append(
        "klpo's teacher mode has no KL of two distributions renormalised on a top-k"
    )
    distill.build_sections(r, teacher, {"estimator": "full"})
    algo = {"name": "grpo", "epochs": 1, "minibatches": steps, "loss_reduction": "token-mean"}
    carried, missing = carry(s, CARRIED)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    r.equivalent_differences.append(
        "NeMo-RL's distillation trains on no reward; klpo's grpo needs a group of at least 2 "
        "(with the teacher section and no rewards, the group only fans out sampling)"
    )
    build_equivalent(r, algo, {"group_size": max(n, 2)}, {}, carried, s)
    build_intended(r)
    settle(r, s.read)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _topk_term(kl_type: str, weight: float, zero: bool, k: int, teacher: str) -> TeacherTerm:
    what, key = KL_TYPES[kl_type]
    if kl_type == "mixed":
        what = what.replace("w ", f"{weight:g} ").replace("(1 − w)", f"{1 - weight:g}")
        if weight != 0.5:
            key = None  # klpo explain --teacher derives the mix at 0.5
    if zero:
        how = "the teacher renormalised on its top-k, the student's full-vocabulary log-probs" + (
            "" if kl_type == "forward" else ", its mass outside charged at log-prob −100"
        )
        key = None
    else:
        how = "both renormalised on the teacher's top-k"
    return TeacherTerm(
        option=f"loss_fn.kl_type={kl_type}"
        + (f", mixed_kl_weight={weight:g}" if kl_type == "mixed" else "")
        + f", zero_outside_topk={str(zero).lower()}, distillation.topk_logits_k={k}",
        framework_name=f"DistillationLossFn ({kl_type})",
        divergence=f"{what}, q the student's and p the teacher's distribution, {how}",
        direction=kl_type,
        support="top-k",
        placement="loss",
        beta=1.0,
        beta_option="the loss itself",
        top_k=k,
        topk_of="teacher",
        table_key=key,
        teacher=teacher,
        logged_as="loss",
    )


# ---------------------------------------------------------------------------------------------
# MOPD: GRPO with the opd advantage.


def _opd_teacher(s: Settings) -> str:
    names = sorted(
        str(v)
        for k, v in s.values.items()
        if re.fullmatch(r"on_policy_distillation\.teacher_model_by_agent_name\.[^.]+", k)
    )
    for k in s.values:
        if k.startswith("on_policy_distillation.teacher_model_by_agent_name."):
            s.get(k)
    return ", ".join(dict.fromkeys(names))


def read_opd(r: Reading, s: Settings, sec: str, adv: str) -> None:
    """The ``on_policy_distillation`` block and the ``opd`` advantage of a GRPO config."""
    enabled = bool(s.get("on_policy_distillation.enabled"))
    full = bool(s.get("on_policy_distillation.full.enabled"))
    if not enabled and adv != "opd":
        return
    keys = [f"{sec}.adv_estimator.name", "on_policy_distillation.enabled"]
    if enabled and adv != "opd":
        r.warn(
            "error",
            keys,
            f"on_policy_distillation.enabled with adv_estimator {adv}: the teachers are served "
            f"and score every rollout, but {adv}'s advantage never reads their log-probs (only "
            "OPDAdvantageEstimator does): no distillation term. Fix: adv_estimator.name: opd",
            kind="cancelled",
        )
        return
    if not enabled:
        r.warn(
            "error",
            keys,
            "adv_estimator opd without on_policy_distillation.enabled: no teacher log-probs are "
            "collected and OPDAdvantageEstimator raises ('OPD requires teacher_logprobs') at the "
            "first step",
            kind="refused",
        )
        return
    if not r.asynchronous:
        r.warn(
            "error",
            [*keys, f"{sec}.async_grpo.enabled"],
            "adv_estimator opd with synchronous GRPO: the teacher log-probs are collected in "
            "async_grpo_train only (MOPD runs on async GRPO, docs/about/algorithms/mopd.md); "
            "OPDAdvantageEstimator raises ('OPD requires teacher_logprobs') at the first step",
            kind="refused",
        )
    teacher = _opd_teacher(s)
    intended: dict[str, Any] = {}
    if full:
        direction = s.get("on_policy_distillation.full.divergence") or "reverse_kl"
        t = distill.exact(
            "on_policy_distillation.full.enabled=true", "MOPD full (PR #3978)", "reverse", 1.0,
            "the loss itself", teacher=teacher, logged_as="on_policy_distillation",
        )  # fmt: skip
        r.warn(
            "warning",
            ["on_policy_distillation.full.enabled"],
            "on_policy_distillation.full (divergence "
            f"{direction}) is NeMo-RL's PR #3978 (NVIDIA-NeMo/RL#3978), read at {FULL_COMMIT}: "
            "the exact reverse KL over the vocabulary at every position in the loss, the "
            "advantage unused; NeMo-RL before it (the pinned 7ea279a, r0.6.0) accepts the block "
            "and drops it (extra='allow'), and trains on the sampled-token advantage instead",
        )
    else:
        t = distill.sampled(
            f"{sec}.adv_estimator.name=opd", "OPDAdvantageEstimator", "k1", "reward", 1.0,
            "the advantage itself", credit="token", teacher=teacher,
            logged_as="on_policy_distillation/teacher_student_logprob_gap_mean",
        )  # fmt: skip
        distill.per_token_credit(
            r, t, keys, "nemo_rl/algorithms/advantage_estimator.py: OPDAdvantageEstimator, "
            "Â_t = sg(log pi_T - log pi_theta)"
        )  # fmt: skip
        intended["credit"] = "returns"
        r.teacher_intended_why.append(
            "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
            "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher); or "
            "on_policy_distillation.full (PR #3978) for the exact KL per position"
        )
        r.warn(
            "note",
            [f"{sec}.adv_estimator.name"],
            "the opd advantage is the teacher gap alone: the task reward does not enter it "
            "(OPDAdvantageEstimator ignores rewards), so the run is distillation",
        )
    r.teacher_terms.append(t)
    distill.build_sections(r, teacher, intended)
