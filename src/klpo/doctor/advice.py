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

from dataclasses import dataclass
from typing import Any

from klpo import registry
from klpo.doctor.reading import Reading, Settings, Term

__all__ = [
    "RunShape",
    "build_equivalent",
    "build_intended",
    "carry",
    "intended_in_loss",
    "klpo_keys",
    "validate",
]


@dataclass(frozen=True)
class RunShape:
    """A framework's run as a reader's findings and equivalent configs need it: its advantage
    estimator (the framework's name), the group size ``n``, and the optimiser steps per batch of
    rollouts, ``epochs`` × ``minibatches``."""

    adv: str
    n: int
    epochs: int
    minibatches: int


def intended_in_loss(estimator: str) -> str:
    """The estimator that logs the same value as ``estimator`` (or the nearest one) but follows
    grad KL(pi_theta ‖ pi_ref) in the loss: ``registry.SPECS[estimator].loss_variant``.

    >>> intended_in_loss("k3"), intended_in_loss("k2"), intended_in_loss("low_var_kl")
    ('k3+', 'k2', 'k3+')

    Raises:
        ValueError: ``estimator`` is not registered in :data:`klpo.kl.SPECS`.
    """
    spec = registry.SPECS.get(estimator)
    if spec is None:
        raise ValueError(
            f"unknown KL estimator {estimator!r}; choose one of: {', '.join(registry.SPECS)}"
        )
    return spec.loss_variant


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


def klpo_keys() -> set[str]:
    """Every dotted key of klpo's train config (``klpo.train.config.TrainConfig``)."""
    from pydantic import BaseModel

    from klpo.train.config import TrainConfig

    out: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, f in model.model_fields.items():
            out.add(prefix + name)
            for c in (f.annotation, *getattr(f.annotation, "__args__", ())):
                if isinstance(c, type) and issubclass(c, BaseModel):
                    walk(c, f"{prefix}{name}.")

    walk(TrainConfig, "")
    return out


def carry(s: Settings, mapping: list[tuple[str, str]]) -> tuple[dict[str, Any], list[str]]:
    """The framework settings klpo has a key for, as ``{klpo key: value}``, and what was not.

    A setting is carried when the file gives it or the framework's default is a value (not
    null, and for the model, data and run sections only when the file gives it: a framework's
    placeholder model path or "until the epochs end" step count is no klpo setting); a value the
    doctor could not read (an undefined shell variable) is not carried.
    Returns (carried, framework keys given in the file whose klpo key does not exist).
    """
    known = klpo_keys()
    carried: dict[str, Any] = {}
    missing: list[str] = []
    for fw_key, klpo_key in mapping:
        if not s.given(fw_key) and (
            s.defaults.get(fw_key) is None or klpo_key.startswith(("model.", "data.", "run."))
        ):
            continue
        value = s.get(fw_key)
        if s.read[fw_key]["from"].startswith("default ("):
            # The file's value depends on a name the script does not define: the framework's
            # default stands in for it, and a difference says so.
            if value is not None and klpo_key in known:
                carried[klpo_key] = value
                s.stand_ins.append(
                    f"{klpo_key} is {fw_key}'s default {value!r}: the script's value "
                    f"{s.values[fw_key]!r} could not be read (give it with --var)"
                )
            continue
        if value is None:
            continue
        if klpo_key == "run.steps" and (not isinstance(value, int) or value <= 0):
            continue  # -1 / null: the framework counts epochs instead
        if klpo_key not in known:
            missing.append(fw_key)
            continue
        carried[klpo_key] = value
    return carried, missing


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into.setdefault(key, value)


def build_equivalent(
    reading: Reading,
    algo: dict[str, Any],
    rollout: dict[str, Any],
    controller: dict[str, Any],
    carried: dict[str, Any] | None = None,
    settings: Settings | None = None,
) -> None:
    """Fill ``reading.equivalent`` (and its differences) from the reader's algo/rollout sections.

    ``carried`` (``{klpo key: value}``, from :func:`carry`) adds the settings klpo has a key for:
    the model, learning rate, batch sizes, lengths. Where a KL term in the loss is not weighted
    for tokens sampled by pi_old, ``kl.off_policy_correction: false`` reproduces that. With
    ``settings``, the file's settings that neither the diagnosis nor klpo reads are listed in
    ``reading.equivalent_unmapped``.
    """
    kl_section, diffs = _kl_section(reading.terms)
    for t in reading.terms:
        if t.estimator is None:
            diffs.append(f"klpo has no estimator for {t.framework_name!r} ({t.option})")
        if t.value_clamp is not None and t.estimator not in ("low_var_kl",):
            diffs.append(
                f"{t.framework_name}: the framework clamps the value to {list(t.value_clamp)}; "
                f"klpo's {t.estimator} does not (klpo's only clamped estimator is verl's low_var_kl)"
            )
    uncorrected = [
        t for t in reading.terms if t.placement == "loss" and not t.corrected and t.estimator
    ]
    if uncorrected and registry.SPECS[uncorrected[0].estimator].off_policy != "carried":
        kl_section["off_policy_correction"] = False
    if reading.terms and controller:
        kl_section.update(controller)
    equivalent: dict[str, Any] = {"algo": algo, "rollout": rollout, "kl": kl_section}
    _merge(equivalent, _nest(carried or {}))
    reading.equivalent = equivalent
    reading.equivalent_differences.extend(diffs)
    if settings is not None:
        reading.equivalent_differences.extend(settings.stand_ins)
    if settings is not None:
        reading.equivalent_unmapped = sorted(
            settings.label(k) for k in settings.values if k not in settings.read
        )


def build_intended(reading: Reading) -> None:
    """Fill ``reading.intended`` from the equivalent: same run, the estimator the user meant."""
    eq = reading.equivalent
    intended = {k: dict(v) for k, v in eq.items()}
    kl_section = intended["kl"]
    kl_section.pop("off_policy_correction", None)
    why = list(reading.intended_why)
    loss_terms = [t for t in reading.terms if t.placement == "loss"]
    reward_terms = [t for t in reading.terms if t.placement == "reward"]
    if not reading.terms and reading.teacher_terms:
        why.append(
            "no KL to a reference: the distillation term holds the student near the teacher "
            "(klpo's teacher section below); a reference KL beside it is klpo's kl section"
        )
    elif not reading.terms:
        why.append(
            "no KL term is in effect: nothing holds the policy near the reference; if that is "
            "meant, keep it; otherwise klpo's default is the exact KL in the loss "
            "(estimator full, placement loss)"
        )
    elif loss_terms:
        t = loss_terms[0]
        est = intended_in_loss(t.estimator or "k3")  # None: klpo has none; propose k3's
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
