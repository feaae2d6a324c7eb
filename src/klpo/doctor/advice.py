"""From the terms in effect to klpo configs: the one that does the same thing, and the one meant.

"Meant" is read as: the user wants the policy pulled towards the reference along
grad KL(pi_theta ‖ pi_ref), the KL every framework logs. For a term in the loss that is the
straight-through variant of the same estimator (same logged value, gradient of k2, which follows
grad KL(pi_theta ‖ pi_ref) on-policy and, with :func:`klpo.losses.kl_loss`'s weight, off-policy);
for a term in the reward it is ``k1``, the only estimator whose detached value as a per-token
penalty follows that gradient (``klpo explain --all``), with its per-token credit kept out of any
group normalisation (klpo's GRPO adds the penalty's returns-to-go to the advantage).
"""

from __future__ import annotations

from typing import Any

from klpo.doctor.reading import Reading, Term

__all__ = ["INTENDED_IN_LOSS", "build_equivalent", "build_intended", "validate"]

# The estimator that logs the same value but follows grad KL(pi_theta ‖ pi_ref) in the loss.
INTENDED_IN_LOSS: dict[str, str] = {
    "k1": "k1+",
    "k1+": "k1+",
    "k2": "k2",
    "k2+": "k2",
    "k3": "k3+",
    "k3+": "k3+",
    "low_var_kl": "k3+",
    "abs": "abs+",
    "abs+": "abs+",
    "k3_is": "k3_is",
    "full": "full",
    "kl_ref_theta": "k3+",
}


def _kl_section(terms: list[Term]) -> tuple[dict[str, Any], list[str]]:
    """One klpo ``kl`` section for the terms, and what it cannot express."""
    if not terms:
        return {"placement": "none", "beta": 0.0}, []
    diffs: list[str] = []
    first = terms[0]
    if len(terms) == 1:
        placement = first.placement
    else:
        placement = "reward+loss"
        if len({t.estimator for t in terms}) > 1 or len({t.beta for t in terms}) > 1:
            diffs.append(
                "klpo has one estimator and one beta for reward+loss; the framework uses "
                + " and ".join(
                    f"{t.framework_name} (beta {t.beta:g}) in the {t.placement}" for t in terms
                )
                + f"; shown with the first, {first.framework_name}"
            )
    out: dict[str, Any] = {"estimator": first.estimator, "placement": placement, "beta": first.beta}
    return out, diffs


def build_equivalent(
    reading: Reading, algo: dict[str, Any], rollout: dict[str, Any], controller: dict[str, Any]
) -> None:
    """Fill ``reading.equivalent`` (and its differences) from the reader's algo/rollout sections."""
    kl_section, diffs = _kl_section(reading.terms)
    for t in reading.terms:
        if t.estimator is None:
            diffs.append(f"klpo has no estimator for {t.framework_name!r} ({t.option})")
        if t.value_clamp is not None and t.estimator not in ("low_var_kl",):
            diffs.append(
                f"{t.framework_name}: the framework clamps the value to {list(t.value_clamp)}; "
                f"klpo's {t.estimator} does not (klpo's only clamped estimator is verl's low_var_kl)"
            )
        if t.placement == "loss" and reading.off_policy and not t.corrected:
            diffs.append(
                f"{t.framework_name} in the loss: the framework does not weight the term for tokens "
                "sampled by pi_old; klpo's kl_loss does (the on-policy gradient is kept)"
            )
    if reading.terms and controller:
        kl_section.update(controller)
    reading.equivalent = {"algo": algo, "rollout": rollout, "kl": kl_section}
    reading.equivalent_differences.extend(diffs)


def build_intended(reading: Reading) -> None:
    """Fill ``reading.intended`` from the equivalent: same run, the estimator the user meant."""
    eq = reading.equivalent
    intended = {k: dict(v) for k, v in eq.items()}
    kl_section = intended["kl"]
    why = list(reading.intended_why)
    loss_terms = [t for t in reading.terms if t.placement == "loss"]
    reward_terms = [t for t in reading.terms if t.placement == "reward"]
    if not reading.terms:
        why.append(
            "no KL term is in effect: nothing holds the policy near the reference; if that is "
            "meant, keep it; otherwise klpo's default is the exact KL in the loss "
            "(estimator full, placement loss)"
        )
    elif loss_terms:
        t = loss_terms[0]
        est = INTENDED_IN_LOSS.get(t.estimator or "k3", "k3+")
        kl_section.update({"estimator": est, "placement": "loss", "beta": t.beta})
        if est != t.estimator:
            why.append(
                f"{est} logs the value {t.framework_name} logs and follows grad KL(pi_theta ‖ pi_ref) "
                f"in the loss (klpo explain -e {est} -p loss); `full` (the exact KL over the "
                "vocabulary) does too, without sampling noise, where the trainer has the logits"
            )
        if reward_terms:
            why.append(
                "one KL term, not two: the reward-side term is dropped (the framework applies both)"
            )
    else:
        t = reward_terms[0]
        kl_section.update({"estimator": "k1", "placement": "reward", "beta": t.beta})
        if t.estimator != "k1":
            why.append(
                f"in the reward only k1 follows grad KL(pi_theta ‖ pi_ref) (klpo explain -p reward "
                f"--all); {t.framework_name} does not"
            )
    if (
        reading.group_scaling
        and any(t.placement == "reward" for t in reading.terms)
        and intended["algo"].get("name") == "grpo"
    ):
        why.append(
            "klpo keeps a reward-side KL out of the group normalisation (its GRPO adds the "
            "penalty's returns-to-go to the advantage), so beta means the same in every group"
        )
    if reading.off_policy and loss_terms and not loss_terms[0].corrected:
        why.append(
            f"{reading.updates_per_batch} optimiser steps per batch: klpo's kl_loss weights the "
            "term by the detached pi_theta / pi_old, keeping the on-policy gradient"
        )
    if not why:
        why.append(
            "the KL term already follows grad KL(pi_theta ‖ pi_ref), the KL it logs: the same "
            "config"
        )
    reading.intended = intended
    reading.intended_why = why


def validate(config: dict[str, Any]) -> str | None:
    """None if ``config`` is a valid klpo train config, else the validation message."""
    from klpo.train.config import ConfigError, build_config

    try:
        build_config(config)
    except ConfigError as err:
        return str(err)
    return None
