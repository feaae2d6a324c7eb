"""``teacher``: on-policy distillation's teacher and the divergence the student descends to it.

The student (the policy) samples; the teacher, a model of the same tokenizer, scores every
position of the student's completions; the teacher term is a divergence between the two, on the
sampled tokens or over the vocabulary, in the loss or as a detached per-token reward
(docs/distillation.md). It sits beside the task reward and the reference's KL term, each logged
under its own name (``kl/teacher/*`` beside ``kl/ref/*``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from klpo import registry
from klpo.train.config.common import Section

__all__ = ["VOCABULARY_TERMS", "TeacherConfig", "teacher_estimators"]

VOCABULARY_TERMS: dict[str, str] = {
    "full": "the exact KL(pi_theta ‖ pi_T) over the vocabulary (reverse; TRL's beta = 1)",
    "forward": "the exact KL(pi_T ‖ pi_theta) over the vocabulary (TRL's beta = 0)",
    "jsd": "TRL's generalised JSD at teacher.jsd_beta (0 forward, 1 reverse)",
    "topk_forward": "verl's forward_kl_topk: the forward KL's terms on the teacher's top-k only",
    "topk_tail": "the forward KL of the teacher's top-k tokens and one tail bucket (verl#7855)",
    "student_topk": "the reverse KL's terms on the student's own top-k tokens",
}
"""The teacher terms that read both models' whole next-token distributions (klpo.teacher); the
rest are klpo.kl's per-token estimators on the sampled tokens, the teacher in the reference's
place."""


def teacher_estimators() -> tuple[str, ...]:
    """Every ``teacher.estimator``: the per-token estimators of the sampled tokens (without the
    reference-sampled ones and ``full``, which is here the vocabulary's exact reverse KL), then
    :data:`VOCABULARY_TERMS`."""
    sampled = tuple(n for n in registry.LOGPROB_ESTIMATORS)
    return (*sampled, *VOCABULARY_TERMS)


class TeacherConfig(Section):
    """The teacher and its term (``teacher:``; absent: no distillation)."""

    model: str = Field(
        description="The teacher: a local directory or Hub id of a transformers causal LM, or a "
        ".gguf file (any source model.policy takes). It must share the policy's tokenizer and "
        "vocabulary."
    )
    estimator: str = Field(
        "full",
        description="The teacher term: a per-token estimator of klpo.kl on the student's sampled "
        "tokens with the teacher in the reference's place (k1, k2, k3, ...), or one over the "
        "vocabulary: " + "; ".join(f"{k}: {v}" for k, v in VOCABULARY_TERMS.items()) + ".",
    )
    placement: Literal["loss", "reward"] = Field(
        "loss",
        description="loss: the term differentiated in the loss; reward: its detached per-token "
        "value as a penalty in the reward (the sampled estimators only; k1 there is the Tinker "
        "cookbook's OPD advantage -(logp - logp_T)).",
    )
    credit: Literal["returns", "token"] = Field(
        "returns",
        description="With placement reward: returns, the penalty's returns-to-go (the gradient "
        "of the sequence's KL); token, each token credited with its own penalty only "
        "(discount 0, the Tinker cookbook's; it follows the per-position gradient).",
    )
    beta: float = Field(1.0, gt=0, description="The teacher term's coefficient.")
    jsd_beta: float = Field(
        0.5, gt=0, lt=1, description="estimator jsd: TRL's beta of the mixture (1 - b) q + b p."
    )
    top_k: int = Field(20, ge=1, description="The top-k terms' k.")
    clamp_zero: bool = Field(
        False,
        description="topk_forward and student_topk: verl's clamp_min(0) of each position's "
        "truncated sum (where it binds, that position's gradient is zero; verl#7856).",
    )
    log_prob_floor: float | None = Field(
        None,
        description="topk_forward: verl's log_prob_min_clamp (both sides' log-probs raised to "
        "it; a raised student log-prob carries no gradient); null: none.",
    )

    @field_validator("estimator")
    @classmethod
    def _known(cls, v: str) -> str:
        allowed = teacher_estimators()
        if v not in allowed:
            raise ValueError(f"unknown teacher estimator {v!r}; allowed: {', '.join(allowed)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> TeacherConfig:
        vocab = self.estimator in VOCABULARY_TERMS
        if self.placement == "reward" and vocab:
            raise ValueError(
                f"teacher.estimator={self.estimator} reads both models' whole distributions and "
                "is differentiated in the loss; as a detached reward it would not depend on the "
                "sampled token, so it carries no policy gradient: use teacher.placement=loss, or "
                "a sampled estimator (k1) in the reward"
            )
        if self.placement == "loss" and self.credit != "returns":
            raise ValueError(
                "teacher.credit says how a reward reaches the tokens; with "
                "teacher.placement=loss there is no reward: leave teacher.credit unset"
            )
        if self.clamp_zero and self.estimator not in ("topk_forward", "student_topk"):
            raise ValueError(
                f"teacher.clamp_zero is verl's clamp of a truncated top-k sum; "
                f"teacher.estimator={self.estimator} has none: set it to topk_forward or "
                "student_topk, or leave teacher.clamp_zero false"
            )
        if self.log_prob_floor is not None and self.estimator != "topk_forward":
            raise ValueError(
                "teacher.log_prob_floor is verl's log_prob_min_clamp of forward_kl_topk; use it "
                "with teacher.estimator=topk_forward"
            )
        return self

    @property
    def vocabulary(self) -> bool:
        """Whether the term reads both models' whole next-token distributions."""
        return self.estimator in VOCABULARY_TERMS
