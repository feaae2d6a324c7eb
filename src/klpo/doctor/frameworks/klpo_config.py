"""klpo's own train config (``klpo train -c``), read for the doctor."""

from __future__ import annotations

from typing import Any

from klpo import registry
from klpo.doctor.advice import build_intended
from klpo.doctor.reading import DoctorError, Reading, Term
from klpo.train.algorithms import ALGORITHMS

__all__ = ["detect", "read", "read_settings"]


def detect(doc: Any) -> tuple[int, str] | None:
    """klpo's evidence: a ``kl`` or ``algo`` section (klpo's config is sections only)."""
    data = doc.data or {}
    seen = [k for k in ("kl", "algo") if isinstance(data.get(k), dict)]
    return (3, f"klpo's {' and '.join(seen)} section(s)") if seen else None


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``klpo`` row's reader: a ``klpo train -c`` YAML."""
    return read_settings(doc.data, doc.source, version)


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Validate ``data`` as a klpo train config and read it into a :class:`Reading`."""
    from klpo import __version__
    from klpo.train.config import ConfigError, build_config

    try:
        cfg = build_config(data)
    except ConfigError as err:
        raise DoctorError(f"{source}: {err}") from None
    r = Reading(framework="klpo", defaults_version=__version__, version=version, source=source)
    a, k = cfg.algo, cfg.kl
    r.algorithm, r.group_size = a.name, cfg.rollout.group_size
    r.updates_per_batch = a.epochs * a.minibatches
    placements = {"loss": ["loss"], "reward": ["reward"], "reward+loss": ["reward", "loss"]}
    if k.beta > 0:
        for p in placements.get(k.placement, []):
            r.terms.append(
                Term(
                    option=f"kl.estimator={k.estimator}, kl.placement={k.placement}",
                    framework_name=k.estimator,
                    estimator=k.estimator,
                    placement=p,
                    beta=k.beta,
                    beta_option="kl.beta",
                    reduction=a.loss_reduction
                    if p == "loss"
                    else ALGORITHMS[a.name].reward_kl_credit,
                    value_clamp=(-10.0, 10.0) if k.estimator == "low_var_kl" else None,
                    log_ratio_clamp=(-20.0, 20.0) if k.estimator == "low_var_kl" else None,
                    corrected=True,
                    logged_as=f"kl/ref/{k.estimator}",
                    adaptive=k.controller != "fixed",
                )
            )
    if k.placement == "none" or k.beta == 0:
        r.warn(
            "note", ["kl.placement", "kl.beta"], "no KL term: nothing holds the policy near pi_ref"
        )
    exact = registry.SPECS[k.estimator].needs_logits  # full
    if exact and k.placement in ("reward", "reward+loss") and k.beta > 0:
        r.warn(
            "note",
            ["kl.estimator"],
            f"`{k.estimator}` in the reward is the exact per-position KL as a penalty; its "
            "returns-to-go carry the sequence-level credit",
        )
    r.equivalent = cfg.model_dump(mode="json", include={"algo", "rollout", "kl"})
    build_intended(r)
    r.settings = {key: {"value": value, "from": "file"} for key, value in _flat(data).items()}
    return r


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
