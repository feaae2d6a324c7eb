"""``kl``: the KL term's estimator, placement, coefficient and controller."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from klpo import control, registry
from klpo.registry import Placement
from klpo.train.config.common import EXPERIMENTAL, Section, one_of
from klpo.train.spellings import FOREIGN_ESTIMATORS


class ReferenceReset(Section):
    every: int = Field(0, ge=0, description="Update the reference every N steps (0: not by count).")
    kl_above: float | None = Field(
        None, gt=0, description="Update it when the exact per-token KL exceeds this (null: off)."
    )
    alpha: float = Field(
        1.0,
        gt=0,
        le=1,
        description="ref <- alpha·policy + (1 - alpha)·ref: 1 is a hard reset (ProRL; with "
        "model.lora a merge of the adapters into the base and fresh adapters), < 1 a soft "
        "update (TR-DPO; not with model.lora).",
    )
    reset_optimizer: bool = Field(
        False,
        description="Also clear the policy optimizer's state at each update (ProRL); with "
        "model.lora it is always cleared (the adapters restart).",
    )

    @model_validator(mode="after")
    def _some_trigger(self) -> ReferenceReset:
        if not self.every and self.kl_above is None:
            raise ValueError(
                "kl.reference_reset needs a trigger: every (steps) and/or kl_above (exact KL)"
            )
        return self


class KLConfig(Section):
    estimator: str = Field(
        "full",
        description=f"KL estimator: a per-token one ({', '.join(registry.ESTIMATORS)}) or one that also "
        f"samples completions from the reference ({', '.join(registry.REF_SAMPLED)}; loss only).",
    )
    placement: Placement = Field(
        "loss",
        description="Where the KL term goes: loss, reward, reward+loss, or none (only measured).",
    )
    beta: float = Field(0.1, ge=0, description="Initial KL coefficient.")
    controller: str = Field(
        "fixed", description=f"KL coefficient controller: one of {', '.join(control.CONTROLLERS)}."
    )
    target: float | None = Field(
        None, gt=0, description="Target KL for adaptive controllers, in kl.target_unit."
    )
    target_unit: Literal["token", "sequence"] = Field(
        "token",
        description="What kl.target measures: the exact KL(pi_theta ‖ pi_ref) per token "
        "(kl/ref/exact) or summed over a completion, mean over completions (kl/ref/seq).",
    )
    horizon: float = Field(10000, gt=0, description="Ziegler controller horizon (in samples).")
    scale: float = Field(
        0.5, gt=0, description="spread-scaled controller: the group reward std that halves beta."
    )
    off_policy_correction: bool = Field(
        True,
        description="KL in the loss after the first minibatch (epochs or minibatches > 1): "
        "weight each token's estimator term by sg(pi_theta/pi_old), which keeps its on-policy "
        "expected gradient (klpo.losses.kl_loss). false: the uncorrected term, as most trainers "
        "compute it (for comparison; k3_is carries its own weight and refuses it).",
    )
    behaviour_correction: Literal["none", "is", "is-cap"] = Field(
        "is",
        description="rollout.staleness > 0: how the KL in the loss corrects for tokens sampled "
        "by the stale behaviour policy pi_behav. 'is': weight each token's estimator term by "
        "sg(pi_theta/pi_behav) (k3_is takes pi_behav as its logp_old), which keeps its on-policy "
        "expected gradient per token; 'is-cap': the weight capped at kl.behaviour_cap "
        "(OpenRLHF's); 'none': the trainer's pi_old as without staleness (weight 1 at the first "
        "update: biased by the lag). `klpo explain --staleness K` gives each one's exact bias."
        + EXPERIMENTAL,
    )
    behaviour_cap: float = Field(
        10.0,
        gt=0,
        description="kl.behaviour_correction=is-cap: the cap C of the weight min(pi_theta / "
        "pi_behav, C) (OpenRLHF's 10)." + EXPERIMENTAL,
    )
    reference_reset: ReferenceReset | None = Field(
        None,
        description="Move the reference to the policy during training: {every, kl_above, alpha, "
        "reset_optimizer} (null: a frozen reference).",
    )

    ref_samples: int | None = Field(
        None,
        gt=0,
        description="ref_is, adaptive_mix: completions sampled from the reference per prompt "
        "each step, the extra cost (null: rollout.group_size, as many as the policy samples).",
    )
    ref_is_clip: tuple[float, float] | None = Field(
        None,
        description="ref_is (and adaptive_mix's ref_is part): clamp the importance weight to [lo, hi], e.g. [0.1, 10] (biased; "
        "null: off).",
    )
    ref_is_dynamic_clip: bool = Field(
        False,
        description="ref_is, adaptive_mix: clamp the weights to the batch's mean ± 3 sd (biased).",
    )
    ref_is_self_normalised: bool = Field(
        False,
        description="ref_is, adaptive_mix: divide by the sum of the weights instead of n (biased).",
    )
    mix_gamma: float = Field(
        30.0,
        gt=0,
        description="adaptive_mix: slope of a = sigmoid(±gamma (KL_window - threshold)).",
    )
    mix_threshold: float = Field(
        0.1,
        description="adaptive_mix: the KL per token (nats) at which a = 1/2. The source gives no "
        "values; 0.1 and gamma 30 make a swing across the built-in task's range (0 to ~0.3).",
    )
    mix_window: int = Field(
        10, gt=0, description="adaptive_mix: steps of its own past output that KL_window averages."
    )
    mix_sign: Literal["as-written", "as-described"] = Field(
        "as-written",
        description="adaptive_mix: 'as-written' (+gamma: the weight a on k1 grows with the KL, as "
        "the formula reads) or 'as-described' (-gamma: more k1 while the KL is small, as its "
        "prose says).",
    )

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        if v in FOREIGN_ESTIMATORS and v not in registry.ESTIMATORS:
            mine, note = FOREIGN_ESTIMATORS[v]
            raise ValueError(f"unknown estimator {v!r}: did you mean {mine!r}? ({note})")
        return one_of("estimator", v, tuple(registry.SPECS))

    @field_validator("ref_is_clip")
    @classmethod
    def _clip_range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not (0.0 <= v[0] < v[1]):
            raise ValueError("must be [lo, hi] with 0 <= lo < hi, e.g. [0.1, 10]")
        return v

    @field_validator("controller")
    @classmethod
    def _known_controller(cls, v: str) -> str:
        return one_of("controller", v, control.CONTROLLERS)

    @model_validator(mode="after")
    def _consistent(self) -> KLConfig:
        """The section's own combinations: a controller's target, an estimator's placement and
        its off-policy form."""
        if self.controller in ("adaptive", "ppo-adaptive") and self.target is None:
            raise ValueError(
                f"kl.target is required by the {self.controller!r} controller "
                "(the KL it steers towards, per kl.target_unit), e.g. kl.target=0.05"
            )
        if (
            not self.off_policy_correction
            and registry.SPECS[self.estimator].off_policy == "carried"
        ):
            raise ValueError(
                f"kl.off_policy_correction=false with kl.estimator={self.estimator}: it "
                "carries its own weight pi_theta/pi_old with the gradient through the weight "
                "(k3_is is k3 so weighted), so it has no uncorrected form; use kl.estimator=k3 "
                "for the uncorrected term"
            )
        reason = registry.refusal(self.estimator, self.placement)
        if self.placement != "none" and reason is not None:
            raise ValueError(
                f"kl.estimator={self.estimator} with kl.placement={self.placement}: {reason}"
            )
        return self
