"""verl's KL settings (its Hydra YAML, or a ``main_ppo`` launch script), read for the doctor.

Every key and default is verl's own: where verl's config files are on the machine (a checkout
beside the script, or an installed verl) and hydra-core is installed, Hydra composes them with the
script's overrides (:mod:`klpo.doctor.verl_hydra`); otherwise the table
``klpo/assets/doctor/verl-<version>.json`` is read, verl's ``ppo_trainer`` config composed by
Hydra (:mod:`klpo.doctor.tables`; checked against the installed verl by
``tests/doctor/test_peers.py``). What the settings mean is read from
``verl/trainer/ppo/core_algos.py`` (``kl_penalty``: the value, the ``+`` straight-through
gradient, the k3 clamps; ``agg_loss``; the advantage estimators), ``verl/trainer/ppo/ray_trainer.py``
(``apply_kl_penalty``) and ``verl/workers/utils/losses.py`` (``ppo_loss``: the KL loss, with no
importance weight); the peer tests run those functions. ``algorithm.rollout_correction`` (its
importance weights and rejection against the rollout engine's log-probs) is
:mod:`klpo.doctor.verl_rollout_corr`'s; ``distillation.*`` (on-policy distillation from a
teacher) :mod:`klpo.doctor.verl_distill`'s. A ``klpo:NAME`` estimator is
:mod:`klpo.integrations.verl`'s. docs/frameworks.md has the table of names.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from klpo import registry
from klpo.doctor import tables, verl_distill, verl_hydra, verl_rollout_corr
from klpo.doctor.advice import RunShape, build_equivalent, build_intended, carry
from klpo.doctor.launch import script_notes
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    Settings,
    Term,
    check_known,
    flatten,
    known_key,
    nearest,
    scalar,
    version_matches,
)
from klpo.doctor.shell import Script
from klpo.train.algorithms import ALGORITHMS

__all__ = ["ESTIMATOR_NAMES", "VERSION", "detect", "overrides", "read", "read_settings"]

VERSION = "0.9.1"
ACTOR = "actor_rollout_ref.actor"

# verl's estimator names -> klpo's (None: klpo has none / verl raises): kl_penalty's plain
# names (its distillation modes' too, one table), their straight-through "+" forms, and full.
ESTIMATOR_NAMES: dict[str, str | None] = {
    **verl_distill.ESTIMATORS,
    "kl+": "k1+",
    "k1+": "k1+",
    "abs+": "abs+",
    "mse+": "k2",
    "k2+": "k2",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
    "full": None,
}


def _klpo_names() -> dict[str, str]:
    """klpo.integrations.verl's names, ``klpo:NAME`` -> NAME: every klpo estimator that works
    from token log-probs (:data:`klpo.kl.LOGPROB_ESTIMATORS`: all but ``full``), read now."""
    return {f"klpo:{e}": e for e in registry.LOGPROB_ESTIMATORS}


# loss_agg_mode -> klpo.reduce mode (None: klpo has none).
REDUCTIONS: dict[str, str | None] = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
    "token-sum": None,
}

# adv_estimator -> (klpo algo name or None, how a reward-side per-token KL reaches the advantage)
ADVANTAGES: dict[str, tuple[str | None, str]] = {
    "gae": ("ppo", "per token, through GAE (gamma, lam), then batch-whitened"),
    "grpo": ("grpo", "summed over the completion into the score, then group-normalised"),
    "rloo": ("rloo", "summed over the completion into the score, then leave-one-out"),
    "reinforce_plus_plus": ("reinforce++", "per token, returns-to-go, then batch-whitened"),
    "reinforce_plus_plus_baseline": (
        None,
        "summed over the completion, group mean subtracted, then batch-whitened",
    ),
    "remax": (
        None,
        "per token, returns-to-go of the penalised reward, minus the greedy completion's "
        "score (compute_remax_outcome_advantage; no group statistics)",
    ),
}
GROUP_SUMMED = ("grpo", "rloo", "reinforce_plus_plus_baseline")

# verl key -> klpo key: the settings the "same thing" config carries.
CARRIED: list[tuple[str, str]] = [
    ("actor_rollout_ref.model.path", "model.policy"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing", "model.gradient_checkpointing"),
    ("actor_rollout_ref.model.lora_rank", "model.lora.r"),
    ("actor_rollout_ref.model.lora_alpha", "model.lora.alpha"),
    ("actor_rollout_ref.model.target_modules", "model.lora.target_modules"),
    ("critic.model.path", "model.critic"),
    ("data.max_prompt_length", "data.max_prompt_tokens"),
    ("data.train_batch_size", "rollout.prompts_per_step"),
    ("data.max_response_length", "rollout.max_new_tokens"),
    ("actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    ("actor_rollout_ref.rollout.top_p", "rollout.top_p"),
    (f"{ACTOR}.entropy_coeff", "algo.entropy_coef"),
    ("critic.cliprange_value", "algo.value_clip"),
    (f"{ACTOR}.optim.lr", "optim.lr"),
    (f"{ACTOR}.optim.weight_decay", "optim.weight_decay"),
    (f"{ACTOR}.grad_clip", "optim.grad_clip"),
    ("critic.optim.lr", "optim.critic_lr"),
    ("trainer.total_training_steps", "run.steps"),
]


def _clamps(name: str) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """(value clamp, log-ratio clamp) of verl's kl_penalty for ``name``."""
    base = name.rstrip("+")
    if base in ("low_var_kl", "k3"):
        return (-10.0, 10.0), (-20.0, 20.0)
    return None, None


def detect(doc: Any) -> tuple[int, str] | None:
    """verl's evidence in a mapping: its ``actor_rollout_ref`` or ``algorithm`` section."""
    data = doc.data or {}
    seen = [k for k in ("actor_rollout_ref", "algorithm") if k in data]
    seen += [k for k in data if k.startswith(("actor_rollout_ref.", "algorithm."))][:1]
    return (3, f"verl's {' and '.join(seen)} section(s)") if seen else None


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``verl`` row's reader: a Hydra YAML, or a launch script's ``main_ppo`` overrides."""
    if doc.kind == "script":
        data, script = overrides(doc)
        return read_settings(data, doc.source, version, script, near=doc.path)
    return read_settings(doc.data, doc.source, version, near=doc.path)


def overrides(doc: Any) -> tuple[dict, Script]:
    """The ``key=value`` Hydra overrides of the ``main_ppo`` command in a launch script."""
    script, source = doc.script(), doc.source
    ep = doc.entry()
    if ep is not None and ep.framework == "verl":
        words = ep.arguments
    else:
        words = [w for c in script.commands for w in c.words]
    out: dict[str, Any] = {}
    for j, word in enumerate(words):
        flag, eq, value = word.partition("=")
        if flag in ("--config-name", "-cn", "--config-path", "-cp"):
            # Hydra's own flags: a config other than ppo_trainer's (megatron's, a user's).
            given = value if eq else (words[j + 1] if j + 1 < len(words) else "")
            script.hydra["name" if flag in ("--config-name", "-cn") else "path"] = given
            continue
        if "=" not in word or word.startswith("-"):
            continue
        key, _, value = word.partition("=")
        if re.fullmatch(r"[a-z_]+", key) and key not in ("algorithm", "data"):
            # A config-group choice of the defaults list (model_engine=megatron): Hydra
            # composes another file into the config, so it shapes the keys there are.
            script.hydra[f"group {key}"] = word
            continue
        if "." in key.lstrip("+~") or key.lstrip("+~") in ("algorithm", "data"):
            out[key] = scalar(value)
            script.overrides[key] = word
    if not out:
        raise DoctorError(
            f"{source}: no Hydra overrides (key=value) found; give verl's YAML, or the "
            "`python -m verl.trainer.main_ppo key=value ...` command line"
        )
    return out, script


_known = known_key


def _check_keys(
    r: Reading, values: dict[str, Any], table: tables.Table, config_name: str | None = None
) -> dict[str, Any]:
    """Hydra's rules for each key: ``+`` adds, ``~`` deletes, anything else must exist.

    With ``config_name`` (``--config-name``, not ppo_trainer) a key ppo_trainer lacks may be
    that config's own: a warning that says so, never "verl refuses it"."""
    out: dict[str, Any] = {}
    added: list[str] = []
    for key, value in values.items():
        bare = key.lstrip("+~")
        if key.startswith("~"):
            continue
        if key.startswith("+") and not _known(bare, table.defaults):
            if not bare.startswith("distillation.teacher_models."):  # a named teacher: read
                added.append(bare)
            out[bare] = value
            continue
        if bare in ("defaults", "hydra") or bare.startswith(("hydra.", "defaults.")):
            continue
        if not _known(bare, table.defaults) and config_name:
            r.warn(
                "warning",
                [bare],
                f"{bare}: not in verl {table.version}'s ppo_trainer config; the script composes "
                f"--config-name {config_name}, which the doctor does not read, and which may "
                "define it: the doctor cannot say what it does",
            )
            continue
        if not _known(bare, table.defaults):
            near = nearest(bare, table.defaults)
            r.warn(
                "error",
                [bare],
                f"{bare}: no such key in verl {table.version}"
                + (f" (did you mean {near}?)" if near else "")
                + "; verl refuses it (Hydra: key not in struct) and does not start"
                + ("" if not near else f"; the doctor read {near} as the file leaves it"),
                kind="unknown-key",
            )
            continue
        out[bare] = value
    if added:
        r.warn(
            "note",
            added,
            f"added with '+' (not in verl {table.version}'s config; verl accepts them, and "
            f"only code that looks for them reads them): {', '.join(added)}",
        )
    return out


def read_settings(
    data: dict[str, Any],
    source: str,
    version: str | None = None,
    script: Script | None = None,
    near: Path | None = None,
) -> Reading:
    """Read a verl config (nested YAML or flat ``key=value`` overrides) into a :class:`Reading`.

    ``near`` is the file read: where verl's own config files are beside it (a checkout) or
    installed, and hydra-core is, the config is composed by Hydra (:mod:`klpo.doctor.verl_hydra`);
    otherwise the defaults are the table of verl 0.9.1's."""
    comp, why = _composition(data, script, near)
    r, table = _start(source, version, comp, why)
    other = None if comp is not None else _other_config(r, script, table, why)
    checked = _check_keys(r, flatten(data), table, other)
    s = _settings(r, checked, table, comp, script, source)
    if script is not None:
        script_notes(r, script)

    adv = s.str("algorithm.adv_estimator") or "gae"
    n = s.int("actor_rollout_ref.rollout.n") or 1
    epochs = s.int(f"{ACTOR}.ppo_epochs") or 1
    batch = s.int("data.train_batch_size") or 1
    mini = s.int(f"{ACTOR}.ppo_mini_batch_size") or batch
    minibatches = max(1, -(-batch // mini))
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * minibatches
    agg = check_known(
        s.str(f"{ACTOR}.loss_agg_mode") or "", REDUCTIONS, f"{ACTOR}.loss_agg_mode", source
    )
    norm_std = s.bool("algorithm.norm_adv_by_std_in_grpo")
    loss_mode = s.str(f"{ACTOR}.policy_loss.loss_mode")
    use_loss, use_reward = s.bool(f"{ACTOR}.use_kl_loss"), s.bool("algorithm.use_kl_in_reward")
    ctrl = s.str("algorithm.kl_ctrl.type")
    check_known(ctrl or "", ("fixed", "adaptive"), "algorithm.kl_ctrl.type", source)

    if use_loss:
        r.terms.append(_term(s, "loss", REDUCTIONS[agg] or agg, adv, ctrl))
    if use_reward:
        credit = ADVANTAGES.get(adv, (None, "summed over the completion"))[1]
        r.terms.append(_term(s, "reward", credit, adv, ctrl))
    run = RunShape(adv, n, epochs, minibatches)
    _findings(r, s, run, agg, loss_mode, norm_std)
    verl_distill.read_distillation(r, s, agg)
    corr = verl_rollout_corr.read_correction(r, s, script)
    _equivalent(r, s, run, agg, norm_std, corr)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _composition(
    data: dict[str, Any], script: Script | None, near: Path | None
) -> tuple[verl_hydra.Composition | None, str | None]:
    """verl's named config composed by Hydra without the file's settings, or None and why."""
    files = verl_hydra.find_verl(near)
    if files is None:
        return None, None
    if not verl_hydra.have_hydra():
        return None, (
            f"verl's config files are here ({files.where}) but hydra-core is not installed: "
            "the doctor read the table of verl's composed config instead of composing it "
            "(pip install 'klpo[doctor]')"
        )
    hydra = script.hydra if script is not None else {}
    name, primary = hydra.get("name") or "ppo_trainer", files.config_dir
    if script is None and near is not None and isinstance(data.get("defaults"), list):
        name, primary = Path(near).stem, Path(near).parent  # a Hydra config of the user's own
    elif hydra.get("path"):
        primary = _config_path(hydra["path"], files, near)
        if primary is None:
            return None, (
                f"--config-path {hydra['path']} is not a folder the doctor finds (absolute, "
                f"under verl/trainer, or under {files.root}): the table of verl's ppo_trainer "
                "config is read instead"
            )
    groups = tuple(w for k, w in hydra.items() if k.startswith("group "))
    try:
        return verl_hydra.compose(files, name, (), primary, groups), None
    except ValueError as err:
        return None, f"Hydra cannot compose {name} from {primary}: {err}; the table is read"


def _config_path(given: str, files: verl_hydra.VerlFiles, near: Path | None) -> Path | None:
    """Hydra's ``--config-path``: absolute, else from ``main_ppo.py``'s folder, else from the
    checkout's root (the examples' working directory) or the script's folder."""
    if "${" in given:
        return None
    cands = (
        [Path(given)]
        if Path(given).is_absolute()
        else [
            files.config_dir.parent / given,
            files.root / given,
            *([Path(near).parent / given] if near is not None else []),
        ]
    )
    return next((c.resolve() for c in cands if c.is_dir()), None)


def _start(
    source: str, version: str | None, comp: verl_hydra.Composition | None, why: str | None
) -> tuple[Reading, tables.Table]:
    """The reading and the table of keys and defaults its settings are checked against."""
    if comp is not None:
        table = tables.Table("verl", comp.files.version, comp.described, comp.base)
        note = None
        if version is not None and not version_matches(version, comp.files.version):
            note = (
                f"you named verl {version}; the config files here are verl "
                f"{comp.files.version}'s ({comp.files.where}), and the doctor composed those"
            )
    else:
        table, note = tables.pick("verl", version, VERSION)
    r = Reading(framework="verl", defaults_version=table.version, version=version, source=source)
    r.defaults_from = (
        table.source
        if comp is not None
        else (
            f"the doctor's table of verl {table.version}'s composed ppo_trainer config "
            "(klpo/assets/doctor)"
        )
    )
    if note:
        r.warn("warning", ["--framework-version"], note)
    if why:
        r.warn("note", ["hydra"], why)
    if comp is not None and comp.files.version != VERSION:
        r.warn(
            "note",
            ["--framework-version"],
            f"the settings are verl {comp.files.version}'s, composed from its files; what they "
            f"do (estimators, reductions, advantages) is read as verl {VERSION}'s code does",
        )
    return r, table


def _other_config(
    r: Reading, script: Script | None, table: tables.Table, why: str | None
) -> str | None:
    """A ``--config-name`` other than ppo_trainer, or a config-group choice (``model_engine=
    megatron``), that the doctor could not compose."""
    name = (script.hydra.get("name") if script is not None else None) or "ppo_trainer"
    other = None if name.removesuffix(".yaml") == "ppo_trainer" else name
    groups = [w for k, w in (script.hydra if script is not None else {}).items()
              if k.startswith("group ")]  # fmt: skip
    if groups and not other:
        other = " ".join(groups)
        r.warn(
            "warning",
            [w.partition("=")[0] for w in groups],
            f"the script chooses the config group(s) {other}, which the doctor's table (verl "
            f"{table.version}'s ppo_trainer with its default groups) does not hold: keys of "
            "that group are not checked and its defaults may differ"
            + ("" if why else " (verl's config files and hydra-core would let the doctor "
               "compose it: run it inside a verl checkout or beside an installed verl)"),
        )  # fmt: skip
        return other
    if other:
        r.warn(
            "warning",
            ["--config-name"],
            f"the script composes --config-name {other}, not ppo_trainer: the defaults here are "
            f"ppo_trainer's (verl {table.version}); a setting the script leaves out may have "
            f"another default in {other}"
            + (
                ""
                if why
                else " (verl's config files and hydra-core would let the doctor "
                "compose it: run it inside a verl checkout or beside an installed verl)"
            ),
        )
    return other


def _settings(
    r: Reading,
    checked: dict[str, Any],
    table: tables.Table,
    comp: verl_hydra.Composition | None,
    script: Script | None,
    source: str,
) -> Settings:
    """The file's settings over the defaults; with a composition, as Hydra composes them."""
    if comp is None:
        return Settings(checked, table.defaults, source)
    written = script.overrides if script is not None else {}
    readable = [k for k, v in checked.items() if not _unresolved(v)]
    if comp.primary == comp.files.config_dir or script is not None:
        raw = []
        for key in readable:
            word = next((w for k, w in written.items() if k.lstrip("+") == key), None)
            raw.append(word or verl_hydra.hydra_override(key, checked[key]))
        deleted = [w for k, w in written.items() if k.startswith("~")]
        comp = verl_hydra.compose(
            comp.files, comp.name, [*raw, *deleted], comp.primary, comp.groups
        )
    if comp.refused:
        named = [k for k in readable if f"'{k}" in comp.refused or f" {k}" in comp.refused]
        r.warn(
            "error",
            named or ["hydra"],
            f"verl {comp.files.version} refuses these overrides and does not start (Hydra: "
            f"{comp.refused}); the doctor read the file's values as written",
            kind="refused",
        )
    ppo = verl_hydra.ppo_base(comp.files)
    values, defaults = verl_hydra.settings(comp, readable, ppo)
    if comp.refused:
        values = {k: checked[k] for k in readable}
    values.update({k: v for k, v in checked.items() if k not in readable})
    return Settings(values, defaults, source)


def _unresolved(value: Any) -> bool:
    """A value that still holds shell text the script does not define (``${NAME}``,
    ``$(...)``): never handed to Hydra, whose ``${...}`` is an interpolation."""
    return isinstance(value, str) and ("${" in value or "$(" in value)


def _term(s: Settings, placement: str, reduction: str, adv: str, ctrl: str | None) -> Term:
    """The loss or reward term of a verl config."""
    if placement == "loss":
        key, coef_key, switch = (
            f"{ACTOR}.kl_loss_type",
            f"{ACTOR}.kl_loss_coef",
            f"{ACTOR}.use_kl_loss",
        )
    else:
        key, coef_key, switch = (
            "algorithm.kl_penalty",
            "algorithm.kl_ctrl.kl_coef",
            "algorithm.use_kl_in_reward",
        )
    name = s.str(key) or ""
    ours = _klpo_names()
    check_known(name, {**ESTIMATOR_NAMES, **ours}, key, s.source)
    if name in ours:
        est, (vclamp, lclamp) = ours[name], (None, None)
    else:
        est, (vclamp, lclamp) = ESTIMATOR_NAMES[name], _clamps(name)
    return Term(
        option=f"{switch}=true, {key.rsplit('.', 1)[-1]}={name}",
        framework_name=name,
        estimator=est,
        placement=placement,
        beta=float(s.float(coef_key) or 0.0),
        beta_option=coef_key,
        reduction=reduction,
        value_clamp=vclamp,
        log_ratio_clamp=lclamp,
        # klpo.integrations.verl's loss is klpo.losses.kl_loss: weighted by pi_theta/pi_old.
        corrected=placement == "loss" and name in ours,
        logged_as="actor/kl_loss" if placement == "loss" else "actor/reward_kl_penalty",
        adaptive=placement == "reward" and ctrl == "adaptive",
    )


def _findings(
    r: Reading, s: Settings, run: RunShape, agg: str, loss_mode: str | None, norm_std: bool
) -> None:
    """Ignored, doubled, rejected, rescaled and off-policy settings."""
    adv, epochs, minibatches = run.adv, run.epochs, run.minibatches
    use_loss = any(t.placement == "loss" for t in r.terms)
    use_reward = any(t.placement == "reward" for t in r.terms)
    for t in r.terms:
        if t.estimator is None:
            r.warn(
                "error",
                [t.option],
                f"verl's {t.framework_name!r} raises NotImplementedError in kl_penalty: the run "
                "stops at the first KL computation. klpo's `full` is the exact KL over the "
                "vocabulary (klpo train), which verl's trainer does not pass to kl_penalty",
            )
        if t.framework_name in _klpo_names():
            r.warn(
                "note",
                [t.option],
                f"{t.framework_name} needs klpo.integrations.verl.install() in every verl "
                "process (docs/frameworks.md); without it verl refuses the name",
            )
        if t.beta == 0:
            r.warn(
                "warning",
                [t.option, t.beta_option],
                f"{t.beta_option} is 0: the reference model is loaded and its log-probs computed, "
                "but the KL term has no effect",
            )
    _switch_findings(r, s, use_loss, use_reward)
    _clip_findings(r, s)
    _batch_findings(r, s)
    if use_reward and adv in GROUP_SUMMED:
        r.group_scaling = _group_scaling(adv, norm_std, r.terms[-1].beta)
        r.warn(
            "warning", ["algorithm.use_kl_in_reward", "algorithm.adv_estimator"], r.group_scaling
        )
    if agg == "token-sum":
        r.warn(
            "note",
            [f"{ACTOR}.loss_agg_mode"],
            "token-sum has no klpo reduction (klpo always normalises); the equivalent uses token-mean",
        )
    if loss_mode not in (None, "vanilla"):
        r.warn(
            "note",
            [f"{ACTOR}.policy_loss.loss_mode"],
            f"policy loss {loss_mode!r} is not klpo's PPO clip; the KL diagnosis holds, the "
            "equivalent config's policy loss differs",
        )
    uncorrected = [t for t in r.terms if t.placement == "loss" and not t.corrected]
    if r.off_policy and uncorrected:
        r.warn(
            "warning",
            [f"{ACTOR}.ppo_epochs", "data.train_batch_size", f"{ACTOR}.ppo_mini_batch_size"],
            f"{r.updates_per_batch} optimiser steps per batch of rollouts ({epochs} epoch(s) × "
            f"{minibatches} mini-batch(es)): from the second on, the KL loss sees tokens sampled "
            "by an older policy, and verl does not weight it for that",
        )


def _batch_findings(r: Reading, s: Settings) -> None:
    """A mini-batch larger than the batch: main_ppo's ``validate_config`` refuses it
    (``ActorConfig.validate``, verl/workers/config/actor.py, unless ``use_dynamic_bsz``)."""
    batch, mini = s.int("data.train_batch_size"), s.int(f"{ACTOR}.ppo_mini_batch_size")
    if s.bool(f"{ACTOR}.use_dynamic_bsz") or batch is None or mini is None or batch >= mini:
        return
    r.warn(
        "error",
        ["data.train_batch_size", f"{ACTOR}.ppo_mini_batch_size"],
        f"data.train_batch_size {batch} < {ACTOR}.ppo_mini_batch_size {mini}: verl refuses "
        "this config at start-up (ActorConfig.validate: train_batch_size must be >= "
        "ppo_mini_batch_size) and does not start; the doctor read one mini-batch per batch",
    )


def _clip_sides(s: Settings) -> list[tuple[str, Any]]:
    """``(klpo key, value)`` of PPO's clip range as verl's actor applies it: clip_ratio_low and
    clip_ratio_high where they are not null, else clip_ratio (``dp_actor.py``,
    ``update_policy``: ``clip_ratio_low if clip_ratio_low is not None else clip_ratio``)."""
    eps = s.get(f"{ACTOR}.clip_ratio")
    sides = []
    for side, klpo_key in (("low", "algo.clip_low"), ("high", "algo.clip_high")):
        value = s.get(f"{ACTOR}.clip_ratio_{side}")
        if (value if value is not None else eps) is not None:
            sides.append((klpo_key, eps if value is None else value))
    return sides


def _clip_findings(r: Reading, s: Settings) -> None:
    """A ``clip_ratio`` the two one-sided ratios override: verl's own defaults for
    clip_ratio_low and clip_ratio_high are numbers, so clip_ratio alone changes nothing."""
    key = f"{ACTOR}.clip_ratio"
    if not s.given(key):
        return
    eps = s.get(key)
    over = [
        (f"{ACTOR}.clip_ratio_{side}", v)
        for side in ("low", "high")
        if (v := s.get(f"{ACTOR}.clip_ratio_{side}")) is not None
    ]
    if not over:
        return
    named = " and ".join(f"{k.rsplit('.', 1)[1]}={v:g}" for k, v in over)
    whose = "verl's defaults" if not any(s.given(k) for k, _ in over) else "set"
    r.warn(
        "warning",
        [key, *(k for k, _ in over)],
        f"{key}={eps:g} does nothing where {named} ({whose}, verl {r.defaults_version}): "
        "verl's actor reads clip_ratio_low and clip_ratio_high first and falls back to "
        "clip_ratio only where one is null (dp_actor.py); set clip_ratio_low / clip_ratio_high "
        "(klpo: algo.clip_low / algo.clip_high), or null them to let clip_ratio apply",
    )


def _switch_findings(r: Reading, s: Settings, use_loss: bool, use_reward: bool) -> None:
    """Settings a switch leaves without effect, and the two switches on together."""
    loss_keys = (f"{ACTOR}.kl_loss_type", f"{ACTOR}.kl_loss_coef")
    ignored = [k for k in loss_keys if s.differs(k)] if not use_loss else []
    if ignored:
        r.warn(
            "warning",
            ignored,
            f"set but ignored: {', '.join(ignored)} take effect only with {ACTOR}.use_kl_loss=true",
        )
    reward_keys = ("algorithm.kl_penalty", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type")
    ignored = [k for k in reward_keys if s.differs(k)] if not use_reward else []
    if ignored:
        r.warn(
            "warning",
            ignored,
            f"set but ignored: {', '.join(ignored)} take effect only with "
            "algorithm.use_kl_in_reward=true (kl_ctrl never touches kl_loss_coef)",
        )
    elif use_reward and use_loss and any(t.adaptive for t in r.terms):
        r.warn(
            "note",
            ["algorithm.kl_ctrl.type"],
            "the adaptive controller adapts only the reward-side coefficient; "
            f"{ACTOR}.kl_loss_coef stays fixed",
        )
    if use_loss and use_reward:
        loss, reward = r.terms
        r.warn(
            "warning",
            [f"{ACTOR}.use_kl_loss", "algorithm.use_kl_in_reward"],
            "the KL is applied twice: once as a per-token reward penalty "
            f"({reward.framework_name}, beta {reward.beta:g}) and once in the loss "
            f"({loss.framework_name}, beta {loss.beta:g}); verl only prints a notice",
        )


def _group_scaling(adv: str, norm_std: bool, beta: float) -> str:
    if adv == "grpo" and norm_std:
        return (
            "the per-token penalty is summed over each completion into the score, the group "
            "mean is subtracted and the result divided by the group's std (+1e-6): the "
            f"effective coefficient is {beta:g} / std(score of the group), different in "
            "every group and largest where the task reward barely varies; only differences "
            "of sequence-summed KL within a group remain, and every token of a completion "
            "gets its whole KL (no per-token credit)"
        )
    return (
        "the per-token penalty is summed over each completion into the score and a "
        "baseline from the group is subtracted: only differences of sequence-summed KL "
        "within a group remain, and every token of a completion gets its whole KL"
    )


def _equivalent(
    r: Reading,
    s: Settings,
    run: RunShape,
    agg: str,
    norm_std: bool,
    corr: verl_rollout_corr.Correction,
) -> None:
    """The klpo configs: the same thing, and what was most likely meant; ``corr`` holds
    algorithm.rollout_correction's keys (rollout.tis_cap, algo.trm_*)."""
    adv, n = run.adv, run.n
    algo_name, _ = ADVANTAGES.get(adv, (None, ""))
    algo: dict[str, Any] = {
        "name": algo_name or "grpo",
        "epochs": run.epochs,
        "minibatches": run.minibatches,
        "loss_reduction": REDUCTIONS[agg] or "token-mean",
    }
    if algo_name == "grpo":
        algo["std"] = "sample" if norm_std else "none"
    critic = algo_name is not None and ALGORITHMS[algo_name].critic
    if critic:  # GAE's discount and lambda
        algo["gamma"], algo["lam"] = s.float("algorithm.gamma"), s.float("algorithm.lam")
    if algo_name is None:
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if agg == "seq-mean-token-sum-norm":
        factor, width = s.get(f"{ACTOR}.loss_scale_factor"), s.get("data.max_response_length")
        if factor is None:
            r.equivalent_differences.append(
                "seq-mean-token-sum-norm without loss_scale_factor: verl divides by the batch's "
                "padded response width, which changes from batch to batch; klpo by the constant "
                "rollout.max_new_tokens"
            )
        elif factor != width:
            r.equivalent_differences.append(
                f"verl divides by loss_scale_factor={factor}; klpo by rollout.max_new_tokens "
                f"({width})"
            )
    if any(t.placement == "reward" for t in r.terms) and algo_name in ("grpo",):
        r.equivalent_differences.append(
            "klpo's grpo keeps a reward-side KL out of the group normalisation (per-token "
            "returns-to-go); verl sums it into the group-normalised score"
        )
    group = ALGORITHMS[algo["name"]].group
    rollout = {"group_size": max(n, 2) if group else n}
    if n < 2 and group:
        r.equivalent_differences.append(
            f"actor_rollout_ref.rollout.n={n}: klpo needs a group of at least 2 for {algo['name']}"
        )
    controller: dict[str, Any] = {}
    if any(t.adaptive for t in r.terms):
        controller = {
            "controller": "adaptive",
            "target": s.float("algorithm.kl_ctrl.target_kl"),
            "horizon": s.float("algorithm.kl_ctrl.horizon"),
        }
    mapping = [(k, v) for k, v in CARRIED if critic or not k.startswith("critic.")]
    if not (s.int("actor_rollout_ref.model.lora_rank") or 0) > 0:
        mapping = [(k, v) for k, v in mapping if not v.startswith("model.lora.")]
    carried, missing = carry(s, mapping)
    carried.update(_clip_sides(s))  # clip_ratio where a one-sided ratio is null
    carried.update(corr.keys)
    r.equivalent_differences.extend(corr.differences)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    build_equivalent(r, algo, rollout, controller, carried, s)
    build_intended(r)
