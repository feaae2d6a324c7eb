"""TRL's ``GRPOConfig`` and ``RLOOConfig`` (YAML or JSON of their fields), read for the doctor.

Defaults are TRL 1.16's (``trl/trainer/grpo_config.py``, ``trl/trainer/rloo_config.py``); what
they mean is read from ``grpo_trainer.py`` (``_compute_loss``: k3, times the differentiable ratio
under ``use_bias_correction_kl``, added to the per-token loss after every policy-side weight) and
``rloo_trainer.py`` (k1 summed over the completion and subtracted from the reward before the
leave-one-out baseline). The GRPO facts are tested against TRL 1.16 itself by
``tests/integrations/test_trl.py``.
"""

from __future__ import annotations

from typing import Any

from klpo.doctor.advice import build_equivalent, build_intended
from klpo.doctor.reading import Reading, Settings, Term, check_known, flatten

__all__ = ["GRPO_DEFAULTS", "LOSS_TYPES", "RLOO_DEFAULTS", "VERSION", "read_grpo", "read_rloo"]

VERSION = "1.16"

GRPO_DEFAULTS: dict[str, Any] = {
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "importance_sampling_level": "token",
    "loss_type": "dapo",
    "num_iterations": 1,
    "steps_per_generation": None,
    "gradient_accumulation_steps": 1,
    "scale_rewards": "group",
    "num_generations": 8,
    "temperature": 1.0,
    "max_completion_length": 256,
}

RLOO_DEFAULTS: dict[str, Any] = {
    "beta": 0.05,
    "num_iterations": 1,
    "steps_per_generation": None,
    "gradient_accumulation_steps": 1,
    "num_generations": 2,
    "normalize_advantages": False,
    "temperature": 1.0,
    "max_completion_length": 256,
}

# loss_type -> klpo.reduce mode of the combined per-token loss (docs/frameworks.md §3).
LOSS_TYPES: dict[str, str] = {
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "luspo": "seq-mean-token-sum",
    "dr_grpo": "seq-mean-token-sum-norm",
}

SCALE_REWARDS = {
    "group": "sample",
    "true": "sample",
    "none": "none",
    "false": "none",
    "batch": None,
}


def _updates(s: Settings) -> tuple[int, int]:
    """(num_iterations, generation steps per optimiser step) from TRL's buffering fields."""
    iters = s.int("num_iterations") or 1
    accum = s.int("gradient_accumulation_steps") or 1
    spg = s.int("steps_per_generation") or accum
    return iters, max(1, spg // accum)


def _common(r: Reading, s: Settings, iters: int, reuse: int) -> None:
    r.updates_per_batch = iters * reuse
    temp = s.float("temperature")
    if temp is not None and temp != 1.0:
        r.warn(
            "note",
            ["temperature"],
            f"the log-probs of both models are taken at temperature {temp:g}: the KL regularised "
            "is between the temperature-scaled distributions",
        )


def read_grpo(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a ``GRPOConfig``'s fields into a :class:`Reading`."""
    s = Settings(flatten(data), GRPO_DEFAULTS, source)
    r = Reading(framework="trl-grpo", defaults_version=VERSION, version=version, source=source)
    beta = s.float("beta") or 0.0
    bias = s.bool("use_bias_correction_kl")
    level = check_known(
        s.str("importance_sampling_level") or "",
        ("token", "sequence"),
        "importance_sampling_level",
        source,
    )
    loss_type = check_known(s.str("loss_type") or "", LOSS_TYPES, "loss_type", source)
    scale = str(s.get("scale_rewards")).lower()
    check_known(scale, SCALE_REWARDS, "scale_rewards", source)
    g = s.int("num_generations") or 1
    max_len = s.int("max_completion_length")
    iters, reuse = _updates(s)
    r.algorithm, r.group_size = "grpo", g
    _common(r, s, iters, reuse)

    if beta > 0:
        if bias and level == "sequence":
            name, est = "k3 × sequence-level ratio", None
        elif bias:
            name, est = "k3 × token ratio (use_bias_correction_kl)", "k3_is"
        else:
            name, est = "k3", "k3"
        r.terms.append(
            Term(
                option=f"beta={beta:g}, use_bias_correction_kl={str(bias).lower()}",
                framework_name=name,
                estimator=est,
                placement="loss",
                beta=beta,
                beta_option="beta",
                reduction=LOSS_TYPES[loss_type],
                corrected=bool(bias and level == "token"),
                logged_as="kl",
            )
        )
        if est is None:
            r.warn(
                "warning",
                ["use_bias_correction_kl", "importance_sampling_level"],
                "with importance_sampling_level='sequence' TRL multiplies the per-token k3 by the "
                "sequence-level ratio, which adds a spurious gradient term (TRL issue #6586); klpo "
                "has no such estimator (k3_is uses the per-token ratio)",
            )
        if not bias:
            r.warn(
                "note",
                ["use_bias_correction_kl"],
                "TRL computes k3 without a clamp: for log pi_theta - log pi_ref < -88 on a token "
                "(float32) the value overflows to inf",
            )
    else:
        ignored = [k for k in ("use_bias_correction_kl",) if s.given(k)]
        r.warn(
            "warning" if ignored else "note",
            ["beta", *ignored],
            "beta is 0 (TRL's default): no reference model is loaded and no KL term is applied or "
            "logged" + (f"; {', '.join(ignored)} is ignored" if ignored else ""),
        )
    if r.off_policy and beta > 0 and not (bias and level == "token"):
        r.warn(
            "warning",
            ["num_iterations", "steps_per_generation"],
            f"{r.updates_per_batch} optimiser steps per generation: from the second on the KL "
            "term sees tokens sampled by an older policy, and TRL's k3 is not weighted for that",
        )
    if loss_type in ("grpo", "sapo") and beta > 0:
        r.warn(
            "note",
            ["loss_type"],
            f"loss_type={loss_type!r} reduces the KL term per sequence first: a token of a short "
            "completion weighs more than one of a long completion",
        )

    std = SCALE_REWARDS[scale]
    algo: dict[str, Any] = {
        "name": "grpo",
        "epochs": iters,
        "minibatches": reuse,
        "loss_reduction": LOSS_TYPES[loss_type],
        "std": std or "sample",
    }
    if std is None:
        r.equivalent_differences.append(
            "scale_rewards='batch' (group mean, batch std) has no klpo config key; shown with "
            "the group std"
        )
    if loss_type == "bnpo":
        r.equivalent_differences.append(
            "bnpo divides by the micro-batch's token count; klpo by the whole batch's"
        )
    if loss_type not in ("dapo", "bnpo", "grpo", "dr_grpo", "luspo"):
        r.equivalent_differences.append(
            f"loss_type={loss_type!r}: TRL's policy surrogate differs from klpo's PPO clip"
        )
    rollout: dict[str, Any] = {"group_size": g}
    if max_len is not None:
        rollout["max_new_tokens"] = max_len
    build_equivalent(r, algo, rollout, {})
    build_intended(r)
    r.settings = s.read
    return r


def read_rloo(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read an ``RLOOConfig``'s fields into a :class:`Reading`."""
    s = Settings(flatten(data), RLOO_DEFAULTS, source)
    r = Reading(framework="trl-rloo", defaults_version=VERSION, version=version, source=source)
    beta = s.float("beta") or 0.0
    g = s.int("num_generations") or 1
    norm = s.bool("normalize_advantages")
    max_len = s.int("max_completion_length")
    iters, reuse = _updates(s)
    r.algorithm, r.group_size = "rloo", g
    _common(r, s, iters, reuse)
    if beta > 0:
        r.terms.append(
            Term(
                option=f"beta={beta:g}",
                framework_name="k1",
                estimator="k1",
                placement="reward",
                beta=beta,
                beta_option="beta",
                reduction="summed over the completion, subtracted from the reward before the "
                "leave-one-out baseline",
                logged_as="kl",
            )
        )
        r.group_scaling = (
            "the completion's summed k1 is subtracted from its reward before the leave-one-out "
            "baseline: only differences of sequence-summed KL within a group remain, and every "
            "token of a completion gets its whole KL"
            + (
                "; normalize_advantages=true then divides by the batch std, rescaling beta by "
                "a batch-dependent factor"
                if norm
                else ""
            )
        )
        r.warn("note", ["beta"], r.group_scaling)
    else:
        r.warn("note", ["beta"], "beta is 0: no reference model, no KL term")
    algo = {"name": "rloo", "epochs": iters, "minibatches": reuse, "loss_reduction": "token-mean"}
    r.equivalent_differences.append(
        "TRL's RLOO clips a sequence-level ratio; klpo's PPO clip is per token"
    )
    if norm:
        r.equivalent_differences.append("normalize_advantages has no klpo config key")
    rollout: dict[str, Any] = {"group_size": g}
    if max_len is not None:
        rollout["max_new_tokens"] = max_len
    build_equivalent(r, algo, rollout, {})
    build_intended(r)
    r.settings = s.read
    return r
