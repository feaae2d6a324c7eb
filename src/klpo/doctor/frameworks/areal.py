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

from dataclasses import dataclass
from typing import Any

from klpo.doctor import tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.keys import check_keys
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    Settings,
    Term,
    check_known,
    flatten,
    interpolate,
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
    ("critic.path", "model.critic"),
    ("critic.optimizer.lr", "optim.critic_lr"),
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
    """Read an AReaL PPO/GRPO experiment config: its keys checked against GRPOConfig's table
    (:func:`_given`), the algorithm it builds (:func:`_algorithm`), its KL penalty
    (:func:`_kl_term`) and klpo's config that does the same (:func:`_equivalent`)."""
    r = Reading(framework="areal", defaults_version=VERSION, version=version, source=source)
    table = tables.load("areal", VERSION).defaults
    r.defaults_from = (
        f"the doctor's table of AReaL {VERSION}'s GRPOConfig dataclasses (klpo/assets/doctor)"
    )
    data = interpolate(data)
    s = Settings(_given(r, flatten(data), table), {**DEFAULTS, **table}, source)
    coef = s.float("actor.kl_ctl") or 0.0
    kind = check_known(
        s.str("actor.kl_estimator") or "", ("k1", "k2", "k3"), "actor.kl_estimator", source
    )
    n = s.int("gconfig.n_samples") or 1
    mb = s.int("actor.ppo_n_minibatches") or 1
    stale = s.int("rollout.max_head_offpolicyness") or 0
    decoupled, recompute = s.bool("actor.use_decoupled_loss"), s.bool("actor.recompute_logprob")
    critic = isinstance(data.get("critic"), dict)
    algo_name = _algorithm(r, s, data, critic, n)
    r.algorithm, r.group_size, r.updates_per_batch = algo_name, n, mb
    r.asynchronous = stale > 0
    _unread(r, s, data)
    penalty = _Penalty(coef, kind, stale, decoupled, recompute, critic)
    _kl_term(r, penalty, has_ref=isinstance(data.get("ref"), dict))
    _equivalent(r, s, data, algo_name, n, mb, critic)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


@dataclass(frozen=True)
class _Penalty:
    """AReaL's KL penalty as the config sets it: ``actor.kl_ctl`` (coef), ``actor.kl_estimator``
    (kind), ``rollout.max_head_offpolicyness`` (stale), ``actor.use_decoupled_loss``,
    ``actor.recompute_logprob``, and whether a critic is trained."""

    coef: float
    kind: str
    stale: int
    decoupled: bool
    recompute: bool
    critic: bool


def _given(r: Reading, flat: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    """The keys of ``flat`` under GRPOConfig's sections, checked against ``table`` by the row's
    key policy; a warning names the top-level sections GRPOConfig does not have."""
    from klpo.doctor.frameworks import ROWS

    sections = {k.split(".")[0] for k in table}
    own = {k: v for k, v in flat.items() if k.split(".")[0] not in sections}
    given = check_keys(r, {k: v for k, v in flat.items() if k not in own}, table, "AReaL",
                       VERSION, ROWS["areal"].policy)  # fmt: skip
    if own:
        tops = sorted({k.split(".")[0] for k in own})
        r.warn(
            "warning",
            tops,
            f"{', '.join(tops)}: not in AReaL {VERSION}'s GRPOConfig. Built into GRPOConfig "
            "itself AReaL refuses them and does not start (ConfigKeyError, cli_args.py:3534-"
            "3541); an example's own train script may extend the config class with them, which "
            "the doctor does not read",
            kind="unknown-key",
        )
    return given


def _kl_term(r: Reading, p: _Penalty, has_ref: bool) -> None:
    """The KL penalty ``actor.kl_ctl`` adds to the reward, as a term of ``r``: an error without
    a ``ref:`` section (the penalty is then no KL), a warning where it is taken at the behaviour
    policy's log-probs, a note when it is off."""
    if p.coef > 0 and not has_ref:
        r.warn(
            "error",
            ["actor.kl_ctl", "ref"],
            f"kl_ctl {p.coef:g} without a ref: section: no reference is loaded and ref_logp is "
            "zeros (actor.py), so the 'KL' penalty is kl_ctl · k(log pi_behaviour, 0), a "
            "function of the sampled token's log-prob, not a KL; add a ref: section (or set "
            "kl_ctl: 0)",
        )
    elif p.coef > 0:
        r.terms.append(
            Term(
                option=f"kl_ctl={p.coef:g}, kl_estimator={p.kind}",
                framework_name=p.kind,
                estimator=p.kind,
                placement="reward",
                beta=p.coef,
                beta_option="actor.kl_ctl",
                reduction="per token into the reward, then GAE"
                + (
                    " with the critic's values" if p.critic else " over zero values (returns-to-go)"
                ),
                logged_as="kl_rewards",
            )
        )
        if p.decoupled or not p.recompute:
            r.warn(
                "warning",
                ["actor.kl_ctl", "actor.use_decoupled_loss"],
                "the KL penalty is computed at the behaviour policy's log-probs (the inference "
                "engine's, up to "
                f"{p.stale} version(s) old), not the current policy's: a penalty on the stale "
                "policy" + ("" if p.decoupled else " (recompute_logprob=false)"),
            )
    else:
        r.warn("note", ["actor.kl_ctl"], "kl_ctl is 0: no reference model, no KL term")


def _equivalent(
    r: Reading, s: Settings, data: dict[str, Any], algo_name: str, n: int, mb: int, critic: bool
) -> None:
    """klpo's config that does what the AReaL config does: the algorithm with its minibatches,
    the group's std where a norm has ``std_level: group``, GAE's settings where a critic is
    trained, and the carried settings."""
    algo: dict[str, Any] = {"name": algo_name, "epochs": 1, "minibatches": mb,
                            "loss_reduction": "token-mean"}  # fmt: skip
    if algo_name == "grpo":  # divided by the group's std only where a norm says std_level group
        norms = [s.get(f"actor.{k}.std_level") for k in ("reward_norm", "adv_norm")
                 if isinstance((data.get("actor") or {}).get(k), dict)]  # fmt: skip
        algo["std"] = "sample" if "group" in norms else "none"
    if critic:
        algo["gamma"], algo["lam"] = s.float("actor.discount"), s.float("actor.gae_lambda")
    carried, _ = carry(s, [(k, v) for k, v in CARRIED if critic or not k.startswith("critic.")])
    group = algo_name in ("grpo", "rloo")
    build_equivalent(r, algo, {"group_size": max(n, 2) if group else n}, {}, carried, s)
    build_intended(r)


def _algorithm(r: Reading, s: Settings, data: dict[str, Any], critic: bool, n: int) -> str:
    """What the config builds: PPO with GAE on a critic's values when it has a ``critic:``
    section (rl_trainer.py:198-203, actor.py:276-279), else GAE over zero values (returns-to-go)
    normalised by group (``grpo``) or by batch (``reinforce``); a group baseline over groups of
    one is named."""
    actor = data.get("actor") if isinstance(data.get("actor"), dict) else {}
    norms = {k: actor[k] for k in ("reward_norm", "adv_norm") if isinstance(actor.get(k), dict)}
    grouped = [k for k, v in norms.items() if v.get("mean_level") == "group"]
    for k in grouped:
        size = s.int(f"actor.{k}.group_size") or 1
        if size == 1 or n == 1:
            r.warn(
                "error",
                [f"actor.{k}.group_size", "gconfig.n_samples"],
                f"actor.{k} subtracts the mean of groups of one (group_size {size}, n_samples "
                f"{n}): every {'reward' if k == 'reward_norm' else 'advantage'} is zero"
                + (" and the task reward is erased (AReaL warns: cli_args.py:1900-1907)"
                   if k == "reward_norm" else "")
                + "; set group_size to gconfig.n_samples and n_samples above 1",
                kind="zero-advantage",
            )  # fmt: skip
        elif size != n:
            r.warn("warning", [f"actor.{k}.group_size", "gconfig.n_samples"],
                   f"actor.{k}.group_size {size} is not gconfig.n_samples {n}: the groups "
                   "normalised are not the prompt's samples", kind="structure")  # fmt: skip
    if critic:
        r.warn("note", ["critic"],
               "a critic: section: PPO with GAE on the critic's values (AReaL builds the critic "
               "and trains it beside the actor: rl_trainer.py:198-203)", kind="structure")  # fmt: skip
        return "ppo"
    if not grouped:
        return "reinforce"
    # A group baseline: leave-one-out (mean_leave1out) is RLOO's, else the group mean (GRPO's).
    return "rloo" if any(norms[k].get("mean_leave1out") for k in grouped) else "grpo"


def _unread(r: Reading, s: Settings, data: dict[str, Any]) -> None:
    """Keys AReaL accepts but nothing reads: the reference's own KL settings (``ref`` is a
    PPOActorConfig, cli_args.py:3411; only the actor's kl_ctl and kl_estimator are read,
    actor.py:76-77)."""
    ref = data.get("ref") if isinstance(data.get("ref"), dict) else {}
    for key in ("kl_ctl", "kl_estimator"):
        if key in ref:
            r.warn(
                "warning",
                [f"ref.{key}", f"actor.{key}"],
                f"ref.{key} = {ref[key]!r} is a valid key (ref is a PPOActorConfig) that nothing "
                f"reads: the reward KL uses actor.{key} ({s.get(f'actor.{key}')!r}); move it to "
                "the actor: section",
                kind="unread-key",
            )
