"""AReaL's YAML experiment configs (``actor:``, ``gconfig:``, ``rollout:``, ``ref:``), read for
the doctor.

Pinned: areal-project/AReaL main at ``cbff54d`` (2026-08-22; ``areal`` 2.0.0). Defaults:
``areal/api/cli_args.py``: ``actor.kl_ctl`` 0.1 (:1771), ``actor.kl_estimator`` k1 (:1772-1775;
k1, k2, k3), ``actor.ppo_n_minibatches`` 4 (:1676), ``gconfig.n_samples`` 1 (:167),
``rollout.max_head_offpolicyness`` 0 (:2502).

What the KL does (``areal/trainer/ppo/actor.py:228-256``): only in the reward, per token,
``−kl_ctl · k(old_logp, ref_logp)``, where ``old_logp`` is the inference engine's log-prob of
the rollout (the behaviour policy, up to ``max_head_offpolicyness`` versions old) under the
decoupled loss or without ``recompute_logprob``; the reference is loaded only when ``kl_ctl > 0``
and a ``ref:`` section exists (``areal/trainer/rl_trainer.py:205``), and without one
``ref_logp`` is zeros (``actor.py:244``).
"""

from __future__ import annotations

from typing import Any

from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    Settings,
    Term,
    check_known,
    flatten,
    load_mapping,
    merge,
)

__all__ = ["DEFAULTS", "VERSION", "detect", "read", "read_settings"]

VERSION = "2.0.0"
DEFAULTS: dict[str, Any] = {
    "actor.kl_ctl": 0.1,
    "actor.kl_estimator": "k1",
    "actor.ppo_n_minibatches": 4,
    "actor.use_decoupled_loss": False,
    "actor.recompute_logprob": False,
    "actor.eps_clip": 0.2,
    "actor.path": None,
    "actor.optimizer.lr": None,
    "actor.optimizer.weight_decay": None,
    "actor.optimizer.gradient_clipping": None,
    "actor.gradient_checkpointing": None,
    "gconfig.n_samples": 1,
    "gconfig.max_new_tokens": None,
    "gconfig.temperature": None,
    "rollout.max_head_offpolicyness": 0,
    "train_dataset.batch_size": None,
}
CARRIED = [
    ("actor.path", "model.policy"),
    ("actor.gradient_checkpointing", "model.gradient_checkpointing"),
    ("gconfig.max_new_tokens", "rollout.max_new_tokens"),
    ("gconfig.temperature", "rollout.temperature"),
    ("train_dataset.batch_size", "rollout.prompts_per_step"),
    ("actor.eps_clip", "algo.clip_low"),
    ("actor.eps_clip", "algo.clip_high"),
    ("actor.optimizer.lr", "optim.lr"),
    ("actor.optimizer.weight_decay", "optim.weight_decay"),
    ("actor.optimizer.gradient_clipping", "optim.grad_clip"),
]


def detect(doc: Any) -> tuple[int, str] | None:
    """AReaL's evidence: an ``actor`` section with ``kl_ctl``, or beside ``gconfig``."""
    data = doc.data or {}
    actor = data.get("actor")
    if isinstance(actor, dict) and ("gconfig" in data or "kl_ctl" in actor):
        return 3, "AReaL's actor section" + (" beside gconfig" if "gconfig" in data else "")
    return None


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``areal`` row's reader: an experiment YAML, or a launcher command's
    ``--config FILE key=value ...``."""
    if doc.kind == "script":
        from klpo.doctor.launch import config_and_overrides

        ep = doc.entry()
        if ep is None or ep.framework != "areal":
            raise DoctorError(f"{doc.source}: no areal training command with --config found")
        cfg, over = config_and_overrides(ep, doc.path, doc.source)
        return read_settings(merge(load_mapping(cfg), over), doc.source, version)
    return read_settings(doc.data, doc.source, version)


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read an AReaL PPO/GRPO experiment config."""
    r = Reading(framework="areal", defaults_version=VERSION, version=version, source=source)
    s = Settings(flatten(data), DEFAULTS, source)
    coef = s.float("actor.kl_ctl") or 0.0
    kind = check_known(
        s.str("actor.kl_estimator") or "", ("k1", "k2", "k3"), "actor.kl_estimator", source
    )
    n = s.int("gconfig.n_samples") or 1
    mb = s.int("actor.ppo_n_minibatches") or 1
    stale = s.int("rollout.max_head_offpolicyness") or 0
    decoupled, recompute = s.bool("actor.use_decoupled_loss"), s.bool("actor.recompute_logprob")
    r.algorithm, r.group_size, r.updates_per_batch = "grpo" if n > 1 else "ppo", n, mb
    r.asynchronous = stale > 0
    has_ref = isinstance(data.get("ref"), dict)
    if coef > 0 and not has_ref:
        r.warn(
            "error",
            ["actor.kl_ctl", "ref"],
            f"kl_ctl {coef:g} without a ref: section: no reference is loaded and ref_logp is "
            "zeros (actor.py), so the 'KL' penalty is kl_ctl · k(log pi_behaviour, 0), a "
            "function of the sampled token's log-prob, not a KL; add a ref: section (or set "
            "kl_ctl: 0)",
        )
    elif coef > 0:
        behaviour = decoupled or not recompute
        r.terms.append(
            Term(
                option=f"kl_ctl={coef:g}, kl_estimator={kind}",
                framework_name=kind,
                estimator=kind,
                placement="reward",
                beta=coef,
                beta_option="actor.kl_ctl",
                reduction="per token into the reward, then GAE",
                logged_as="kl_rewards",
            )
        )
        if behaviour:
            r.warn(
                "warning",
                ["actor.kl_ctl", "actor.use_decoupled_loss"],
                "the KL penalty is computed at the behaviour policy's log-probs (the inference "
                "engine's, up to "
                f"{stale} version(s) old), not the current policy's: a penalty on the stale "
                "policy" + ("" if decoupled else " (recompute_logprob=false)"),
            )
    else:
        r.warn("note", ["actor.kl_ctl"], "kl_ctl is 0: no reference model, no KL term")
    algo = {"name": "grpo" if n > 1 else "ppo", "epochs": 1, "minibatches": mb,
            "loss_reduction": "token-mean"}  # fmt: skip
    carried, _ = carry(s, CARRIED)
    build_equivalent(r, algo, {"group_size": max(n, 2)}, {}, carried, s)
    build_intended(r)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r
