"""After-step control: what the step's metrics change before the next step.

The KL coefficient's controller (``kl.controller``, :mod:`klpo.control`) and PPO's penalty
coefficient ``beta_old`` (policy losses that use it) see the whole step's metrics, the same on
every rank; ``adaptive_mix``'s window takes the mix's output; and ``kl.reference_reset`` moves the
reference when due, with the reset chosen once when the run is set up (a weight copy, or LoRA's
merge-and-restart, :mod:`klpo.train.models.reference`). The step's own metrics are those before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klpo import control, ref_kl
from klpo.train.algorithms import POLICY_LOSSES
from klpo.train.config import TrainConfig
from klpo.train.models.reference import ResetFn, reset_due
from klpo.train.runtime.metrics import CONTROLLED_KL
from klpo.train.step.kl_term import KLTerm

__all__ = ["Control", "make_kl_controller", "make_penalty_controller"]


def make_kl_controller(cfg: TrainConfig) -> control.KLController:
    k = cfg.kl
    extra: dict[str, Any] = {
        "fixed": {},
        "adaptive": {"target": k.target, "horizon": k.horizon},
        "ppo-adaptive": {"target": k.target},
        "spread-scaled": {"scale": k.scale},
    }[k.controller]
    return control.make_controller(k.controller, beta=k.beta, **extra)


def make_penalty_controller(cfg: TrainConfig) -> control.KLController:
    """beta_old of PPO's KL-penalty surrogate: PPO's adaptive rule if a target is set."""
    a = cfg.algo
    if a.penalty_target is None:
        return control.FixedKL(a.penalty_beta)
    return control.PPOAdaptiveKL(a.penalty_beta, target=a.penalty_target)


@dataclass
class Control:
    """What changes between steps from the step's metrics (see the module)."""

    kl: control.KLController  # beta
    penalty: control.KLController  # beta_old of PPO's KL-penalty surrogate
    window: ref_kl.MixWindow | None = None  # adaptive_mix's past outputs
    reset: ResetFn | None = None  # kl.reference_reset: moves the reference
    ref_updates: int = 0  # reference updates so far

    def after_step(
        self, cfg: TrainConfig, step: int, metrics: dict[str, float], term: KLTerm
    ) -> None:
        """Update the controllers, the mix's window and the reference from the step's
        ``metrics`` (``term``: the step's KL term with its coefficients), adding what they log
        to ``metrics``."""
        if self.window is not None:  # the mix's output of this step joins its window
            a = term.weight
            mix = a * metrics["kl/ref/k1"] + (1 - a) * metrics["kl/ref/ref_is"]
            metrics["kl/ref/adaptive_mix"] = mix
            metrics["ref/mix_weight"] = a
            metrics["ref/kl_window"] = self.window.kl_window
            self.window.push(mix)
        n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        self.kl.update(
            kl=metrics[CONTROLLED_KL[cfg.kl.target_unit]],
            n_steps=n_seq,
            reward_std=metrics["reward/group_std"],
        )
        if POLICY_LOSSES[cfg.algo.policy_loss].uses_beta_old:
            metrics["beta_old"] = term.beta_old
            self.penalty.update(kl=metrics["kl/old/k3"])
        resets = cfg.kl.reference_reset
        if resets is not None and self.reset is not None:
            # move the reference (docs/overopt.md); the step's KL is before it
            if reset_due(resets, step, metrics["kl/ref/exact"]):
                self.reset(self.ref_updates)
                self.ref_updates += 1
            metrics["reference/updates"] = self.ref_updates
