"""OpenRLHF's ``train_ppo_ray`` launch scripts, read for the doctor, by version.

OpenRLHF's flags changed spelling at 0.10: up to 0.9 they are flat (``--init_kl_coef``,
``--kl_estimator``, ``--use_kl_loss``, ``--advantage_estimator``), from 0.10 grouped
(``--algo.kl.init_coef``, ``--algo.kl.estimator``, ``--algo.kl.use_loss``,
``--algo.advantage.estimator``), and each version's parser accepts only its own. Every flag and
default is the version's own: ``klpo/assets/doctor/openrlhf-<version>.json`` is its argument
parser read statically (:mod:`klpo.doctor.tables`; OpenRLHF does not import without a GPU). A
flag the named (or, unnamed, the detected) version does not have is an error finding: argparse
refuses it and the run does not start. Findings and labels use the spelling the script used.

What the settings mean is read from the source of the pinned versions (cited file:line in
``tests/doctor/test_peers.py``): ``openrlhf/models/utils.py`` (``compute_approx_kl``: every
estimator's value clamped to [-10, 10]; from 0.11.2 the k3 log-ratio bounded at -10 before the
exp, and ``--algo.kl.unbiased_gradient``: the value kept, the gradient k2's weighted by a
detached, clamped pi_theta/pi_old), ``openrlhf/trainer/ppo_utils/experience_maker.py`` (the
reward-side KL added per token after the scalar reward shaping; ``group_norm`` divides by the
group's std whatever ``no_std_norm`` says, which only turns off the batch whitening) and
``openrlhf/trainer/ray/ppo_actor.py`` (the KL loss, a token mean; the reward-side KL zeroed).
"""

from __future__ import annotations

from typing import Any

from klpo.doctor import tables
from klpo.doctor.advice import RunShape, build_equivalent, build_intended, carry
from klpo.doctor.launch import script_notes
from klpo.doctor.reading import DoctorError, Reading, Settings, Term, check_known, nearest, scalar
from klpo.doctor.shell import Script
from klpo.train.algorithms import ALGORITHMS

__all__ = [
    "FLAT",
    "FLAT_VERSION",
    "GROUPED_VERSION",
    "VERSION",
    "parse_args",
    "read",
    "read_args",
]

VERSION = GROUPED_VERSION = "0.11.2"
FLAT_VERSION = "0.9.10"

# grouped (0.10+) name -> flat (<= 0.9) name, for every flag the doctor reads or carries.
FLAT: dict[str, str] = {
    "algo.kl.init_coef": "init_kl_coef",
    "algo.kl.estimator": "kl_estimator",
    "algo.kl.use_loss": "use_kl_loss",
    "algo.kl.target": "kl_target",
    "algo.kl.horizon": "kl_horizon",
    "algo.advantage.estimator": "advantage_estimator",
    "algo.advantage.no_std_norm": "no_advantage_std_norm",
    "algo.advantage.gamma": "gamma",
    "algo.advantage.lambd": "lambd",
    "train.max_epochs": "max_epochs",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt",
    "rollout.batch_size": "rollout_batch_size",
    "train.batch_size": "train_batch_size",
    "actor.model_name_or_path": "pretrain",
    "actor.adam.lr": "actor_learning_rate",
    "critic.adam.lr": "critic_learning_rate",
    "actor.adam.weight_decay": "l2",
    "actor.max_norm": "max_norm",
    "actor.eps_clip": "eps_clip",
    "actor.dual_clip": "dual_clip",
    "actor.entropy_coef": "entropy_loss_coef",
    "critic.value_clip": "value_clip",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.max_new_tokens": "max_new_tokens",
    "ds.lora.rank": "lora_rank",
    "ds.lora.alpha": "lora_alpha",
    "train.seed": "seed",
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "data.input_key": "input_key",
    "data.apply_chat_template": "apply_chat_template",
    "actor.policy_loss_type": "policy_loss_type",
    "train.async_enable": "async_train",
    "data.max_len": "max_len",
}

# OpenRLHF flag (grouped name) -> klpo key: what the "same thing" config carries.
CARRIED: list[tuple[str, str]] = [
    ("actor.model_name_or_path", "model.policy"),
    ("actor.gradient_checkpointing_enable", "model.gradient_checkpointing"),
    ("ds.lora.rank", "model.lora.r"),
    ("ds.lora.alpha", "model.lora.alpha"),
    ("data.input_key", "data.prompt_field"),
    ("data.apply_chat_template", "data.chat"),
    ("rollout.batch_size", "rollout.prompts_per_step"),
    ("rollout.max_new_tokens", "rollout.max_new_tokens"),
    ("rollout.temperature", "rollout.temperature"),
    ("rollout.top_p", "rollout.top_p"),
    ("actor.eps_clip", "algo.clip_low"),
    ("actor.eps_clip", "algo.clip_high"),
    ("actor.dual_clip", "algo.dual_clip"),
    ("actor.entropy_coef", "algo.entropy_coef"),
    ("critic.value_clip", "algo.value_clip"),
    ("actor.adam.lr", "optim.lr"),
    ("actor.adam.weight_decay", "optim.weight_decay"),
    ("actor.max_norm", "optim.grad_clip"),
    ("critic.adam.lr", "optim.critic_lr"),
    ("train.seed", "run.seed"),
]

ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
# With --algo.kl.unbiased_gradient: value kept, gradient k2's (straight-through), weighted.
UNBIASED = {"k1": "k1+", "k2": "k2", "k3": "k3+"}

# advantage estimator -> (klpo algo, how the per-token reward-side KL reaches the advantage)
ADVANTAGES: dict[str, tuple[str | None, str]] = {
    "gae": ("ppo", "per token, through GAE, then batch-whitened"),
    "reinforce": ("reinforce++", "per token, returns-to-go, then batch-whitened"),
    "reinforce_baseline": (None, "per token, returns-to-go, then batch-whitened"),
    "rloo": ("rloo", "per token, returns-to-go, after the leave-one-out shaping of the score"),
    "group_norm": ("grpo", "per token, returns-to-go, after the group normalisation of the score"),
    "dr_grpo": ("grpo", "per token, returns-to-go, after the group mean is subtracted"),
    "flash_reinforce": (None, "per token, returns-to-go, after the batch mean is subtracted"),
}


def parse_args(words: list[str], table: tables.Table) -> tuple[dict[str, Any], list[str]]:
    """The flags of a ``train_ppo_ray`` command line as ``{flag: value}``, argparse's way.

    Switches take no value; other flags take the next word (or ``--flag=value``; ``nargs``
    flags keep their words up to the next flag). A flag argparse would accept as an unambiguous
    abbreviation is read as the flag. Returns (flags, unknown flags as written).
    """
    out: dict[str, Any] = {}
    unknown: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        name = _resolve(flag[2:], table)
        if name is None:
            unknown.append(flag)
            while i < len(words) and not words[i].startswith("--"):
                i += 1
            continue
        if name in table.switches:
            out[name] = True if not eq else scalar(value)
            continue
        values = [value] if eq else []
        while not eq and i < len(words) and not words[i].startswith("--"):
            values.append(words[i])
            i += 1
        if not values:
            raise DoctorError(f"{flag} needs a value, e.g. {flag} {table.defaults.get(name)}")
        out[name] = scalar(values[0]) if len(values) == 1 else [scalar(v) for v in values]
    return out, unknown


def _resolve(name: str, table: tables.Table) -> str | None:
    if name in table.defaults:
        return name
    starts = [k for k in table.defaults if k.startswith(name)]
    return starts[0] if len(starts) == 1 else None  # argparse's allow_abbrev


def _style(words: list[str]) -> str | None:
    """``"grouped"``, ``"flat"`` or None: the spelling of the KL and algorithm flags used."""
    flags = {w.partition("=")[0][2:] for w in words if w.startswith("--")}
    grouped = any(f in FLAT for f in flags)
    flat = any(f in FLAT.values() for f in flags)
    if grouped and not flat:
        return "grouped"
    if flat and not grouped:
        return "flat"
    return None


def _arguments(doc: Any) -> list[str]:
    """The words after ``train_ppo_ray`` in its command (all words where there is none)."""
    ep = doc.entry()
    if ep is None or ep.framework != "openrlhf":
        return [w for c in doc.script().commands for w in c.words]
    return ep.arguments


def _best_fit(words: list[str]) -> tables.Table:
    """With no version named: the table of the script's flag style that knows the most of its
    flags (the newest among equals)."""
    style = _style(words)
    flags = [w.partition("=")[0][2:] for w in words if w.startswith("--")]
    best: tuple[int, tuple[int, ...]] | None = None
    chosen = None
    for v in tables.known_versions("openrlhf"):
        t = tables.load("openrlhf", v)
        flat = "init_kl_coef" in t.defaults
        if style is not None and flat != (style == "flat"):
            continue
        known = sum(_resolve(f, t) is not None for f in flags)
        key = (known, tables.version_key(v))
        if best is None or key > best:
            best, chosen = key, t
    return chosen or tables.load("openrlhf", GROUPED_VERSION)


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``openrlhf`` row's reader: a launch script's ``train_ppo_ray`` command."""
    source, script = doc.source, doc.script()
    words = _arguments(doc)
    if version is None:
        table, note = _best_fit(words), None
    else:
        table, note = tables.pick("openrlhf", version, GROUPED_VERSION)
    try:
        args, unknown = parse_args(words, table)
    except DoctorError as err:
        raise DoctorError(f"{source}: {err}") from None
    return read_args(args, source, version, table, unknown=unknown, note=note, script=script)


def read_args(
    args: dict[str, Any],
    source: str,
    version: str | None,
    table: tables.Table,
    *,
    unknown: list[str] = (),
    note: str | None = None,
    script: Script | None = None,
) -> Reading:
    """Read OpenRLHF's arguments (from :func:`parse_args`) into a :class:`Reading`."""
    flat = "init_kl_coef" in table.defaults
    to_table = {g: (f if flat else g) for g, f in FLAT.items()}
    if "generate_max_len" in table.defaults:
        # Up to 0.9.0 the completion length is --generate_max_len and the prompt's
        # --prompt_max_len; 0.9.10 renamed the first --max_new_tokens (None: max_len − prompt).
        to_table["rollout.max_new_tokens"] = "generate_max_len"
        to_table["data.prompt_max_len"] = "prompt_max_len"
    values = {g: args[t] for g, t in to_table.items() if t in args}
    values.update({k: v for k, v in args.items() if k not in to_table.values()})
    defaults = {g: table.defaults.get(t) for g, t in to_table.items()}
    defaults.update(table.defaults)
    labels = {g: "--" + t for g, t in to_table.items()}
    labels.update({k: "--" + k for k in args if k not in to_table.values()})
    s = Settings(values, defaults, source, labels)
    r = Reading(
        framework="openrlhf", defaults_version=table.version, version=version, source=source
    )
    if note:
        r.warn("warning", ["--framework-version"], note)
    elif version is None:
        r.warn(
            "note",
            ["--framework-version"],
            f"version not named: the script's {'flat' if flat else 'grouped'} flags fit OpenRLHF "
            f"{table.version}'s parser best (of {', '.join(tables.known_versions('openrlhf'))}); "
            "name yours with --framework-version",
        )
    _unknown_flags(r, unknown, table, flat)
    if script is not None:
        script_notes(r, script)
    _terms(r, s, table)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _unknown_flags(r: Reading, unknown: list[str], table: tables.Table, flat: bool) -> None:
    by_flat = {f: g for g, f in FLAT.items()}
    for flag in unknown:
        name = flag[2:]
        other = by_flat.get(name) if not flat else FLAT.get(name)
        if other and other in table.defaults:
            hint = (
                f"OpenRLHF {table.version} spells it --{other} (flat flags until 0.9, grouped "
                "from 0.10)"
            )
        else:
            near = nearest(name, table.defaults)
            hint = f"did you mean --{near}" if near else "no close match"
        r.warn(
            "error",
            [flag],
            f"{flag}: no such flag in OpenRLHF {table.version} ({hint}); argparse refuses it "
            "(unrecognized arguments) and the run does not start; the doctor reads the rest",
            kind="unknown-key",
        )


def _terms(r: Reading, s: Settings, table: tables.Table) -> None:
    """The KL term, the findings about it, and the klpo configs."""
    coef = s.float("algo.kl.init_coef") or 0.0
    est_key = "algo.kl.estimator"
    name = check_known(s.str(est_key) or "", ESTIMATORS, s.label(est_key), s.source)
    use_loss = s.bool("algo.kl.use_loss")
    unbiased = "algo.kl.unbiased_gradient" in table.defaults and s.bool("algo.kl.unbiased_gradient")
    if unbiased and not use_loss:
        # Only the KL loss (ppo_actor.py) reads it; the reward-side KL never does.
        r.warn(
            "warning",
            [s.label("algo.kl.unbiased_gradient")],
            f"set but does nothing: {s.label('algo.kl.unbiased_gradient')} changes only the KL "
            f"loss, and without {s.label('algo.kl.use_loss')} the KL is in the reward; add "
            f"{s.label('algo.kl.use_loss')} or drop the flag",
        )
        unbiased = False
    target, horizon = s.float("algo.kl.target"), s.float("algo.kl.horizon")
    adv_key = "algo.advantage.estimator"
    adv = check_known(s.str(adv_key) or "", ADVANTAGES, s.label(adv_key), s.source)
    no_std = s.bool("algo.advantage.no_std_norm")
    epochs = s.int("train.max_epochs") or 1
    n = s.int("rollout.n_samples_per_prompt") or 1
    rollout_batch, train_batch = s.int("rollout.batch_size") or 1, s.int("train.batch_size") or 1
    steps = max(1, (rollout_batch * n) // train_batch)
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    r.asynchronous = s.get("train.async_enable") is True
    L = s.label

    if coef > 0:
        est = UNBIASED[name] if (use_loss and unbiased) else ESTIMATORS[name]
        r.terms.append(
            Term(
                option=(f"{L('algo.kl.use_loss')}, " if use_loss else "")
                + (f"{L('algo.kl.unbiased_gradient')}, " if use_loss and unbiased else "")
                + f"{L(est_key)} {name}",
                framework_name=name,
                estimator=est,
                placement="loss" if use_loss else "reward",
                beta=coef,
                beta_option=L("algo.kl.init_coef"),
                reduction="token-mean" if use_loss else ADVANTAGES[adv][1],
                value_clamp=(-10.0, 10.0),
                corrected=use_loss and unbiased,
                logged_as="kl",
                adaptive=target is not None,
            )
        )
        _term_findings(r, s, name, use_loss, unbiased, target, horizon)
    else:
        keys = ("algo.kl.estimator", "algo.kl.use_loss", "algo.kl.target")
        ignored = [k for k in keys if s.differs(k)]
        r.warn(
            "warning" if ignored else "note",
            [L("algo.kl.init_coef"), *(L(k) for k in ignored)],
            f"{L('algo.kl.init_coef')} is 0: no reference model, no KL term"
            + (f"; {', '.join(L(k) for k in ignored)} ignored" if ignored else ""),
        )
    _run_findings(r, s, coef, use_loss, unbiased, adv, no_std)
    _equivalent(r, s, RunShape(adv, n, epochs, steps), no_std, target, horizon, coef)


def _term_findings(
    r: Reading,
    s: Settings,
    name: str,
    use_loss: bool,
    unbiased: bool,
    target: float | None,
    horizon: float | None,
) -> None:
    """What OpenRLHF itself says of the estimator, the placement and the controller."""
    L = s.label
    est_key = "algo.kl.estimator"
    recommended = ("k2", "k3") if use_loss else ("k1",)
    if name not in recommended and not unbiased:
        r.warn(
            "warning",
            [L(est_key)],
            f"{name} in the {'loss' if use_loss else 'reward'}: OpenRLHF itself only prints a "
            f"recommendation ({' or '.join(recommended)}); see the gradient below",
        )
    if use_loss:
        r.warn(
            "note",
            [L("algo.kl.use_loss")],
            "with the KL in the loss the reward-side KL is zeroed (not applied twice); the KL "
            "loss is always a token mean, whatever the policy loss's aggregation",
        )
    if target is not None:
        r.warn(
            "warning" if use_loss else "note",
            [L("algo.kl.target"), L("algo.kl.horizon")],
            "the adaptive controller's coefficient"
            + (" is also the KL-loss coefficient" if use_loss else " scales the reward KL")
            + f" (target {target:g} per token, horizon {horizon:g}); OpenRLHF's own code marks "
            "the adaptive controller as not meant for this trainer",
        )


def _run_findings(
    r: Reading,
    s: Settings,
    coef: float,
    use_loss: bool,
    unbiased: bool,
    adv: str,
    no_std: bool,
) -> None:
    """The advantage shaping, the policy loss and the off-policy steps, as they touch the KL."""
    L = s.label
    adv_key = "algo.advantage.estimator"
    if coef > 0 and not use_loss and adv in ("group_norm", "dr_grpo", "rloo"):
        r.warn(
            "note",
            [L(adv_key)],
            "the KL is added per token after the score's group shaping, so the group's std does "
            "not rescale beta; each token is charged the KL of itself and every later token "
            "(returns-to-go)",
        )
    if adv == "group_norm" and no_std:
        r.warn(
            "note",
            [L("algo.advantage.no_std_norm")],
            f"{L('algo.advantage.no_std_norm')} turns off only the batch whitening that follows: "
            "group_norm still divides each group's scores by their std "
            "(experience_maker.py); for a mean-only baseline use dr_grpo",
        )
    loss_type = s.str("actor.policy_loss_type")
    if loss_type not in (None, "ppo"):
        r.warn(
            "note",
            [L("actor.policy_loss_type")],
            f"policy loss {loss_type!r} is not klpo's per-token PPO clip; the KL diagnosis holds, "
            "the equivalent config's policy loss differs",
        )
        r.equivalent_differences.append(
            f"{L('actor.policy_loss_type')} {loss_type}: klpo's policy loss is PPO clip"
        )
    if r.asynchronous and coef > 0:
        r.warn(
            "warning",
            [L("train.async_enable")],
            "asynchronous training: the rollouts come from an older policy than the one "
            "updated, so the KL term sees off-policy tokens from the first optimiser step on",
        )
    if r.off_policy and coef > 0 and use_loss and not unbiased:
        r.warn(
            "warning",
            [L("train.max_epochs"), L("rollout.batch_size"), L("train.batch_size")],
            f"{r.updates_per_batch} optimiser steps per rollout batch: from the second on the KL "
            "loss sees tokens sampled by an older policy, and OpenRLHF does not weight it for that",
        )


def _equivalent(
    r: Reading,
    s: Settings,
    run: RunShape,
    no_std: bool,
    target: float | None,
    horizon: float | None,
    coef: float,
) -> None:
    """The klpo configs: the same thing, and what was most likely meant; ``target`` and
    ``horizon`` the adaptive controller's, where ``coef`` is above 0."""
    adv, n = run.adv, run.n
    algo_name, _ = ADVANTAGES[adv]
    algo: dict[str, Any] = {
        "name": algo_name or "reinforce++",
        "epochs": run.epochs,
        "minibatches": run.minibatches,
        "loss_reduction": "token-mean",
    }
    if algo_name == "grpo":
        # group_norm divides by the group's std whatever no_std_norm says; dr_grpo never does.
        # No batch whitening follows either: experience_maker.py whitens only for gae,
        # reinforce and reinforce_baseline (0.8.11 to 0.11.2).
        algo["std"] = "none" if adv == "dr_grpo" else "sample"
    if adv in ("reinforce", "reinforce_baseline") and not no_std:
        r.equivalent_differences.append(
            f"OpenRLHF whitens {adv}'s advantages over the batch (experience_maker.py)"
            + ("; klpo's reinforce++ does too" if adv == "reinforce" else "")
        )
    agg = s.str("actor.loss_agg_mode") if "actor.loss_agg_mode" in s.defaults else None
    if agg is not None:
        algo["loss_reduction"] = agg
        if agg != "token-mean" and any(t.placement == "loss" for t in r.terms):
            r.equivalent_differences.append(
                f"OpenRLHF reduces the policy loss by {agg} but the KL loss by token-mean; klpo "
                f"reduces both by {agg}"
            )
    critic = algo_name is not None and ALGORITHMS[algo_name].critic
    if critic:  # GAE's discount and lambda
        algo["gamma"] = s.float("algo.advantage.gamma")
        algo["lam"] = s.float("algo.advantage.lambd")
    if algo_name is None:
        r.equivalent_differences.append(
            f"klpo has no advantage estimator {adv!r}; reinforce++ shown"
        )
    if coef > 0 and r.terms and r.terms[0].placement == "reward" and algo_name in ("grpo", "rloo"):
        r.equivalent_differences.append(
            "klpo's rloo sums a reward-side KL into the leave-one-out score; OpenRLHF adds it per "
            "token after the shaping"
            if algo_name == "rloo"
            else "same credit as klpo's grpo: the KL's returns-to-go added after the group "
            "normalisation"
        )
    rollout = {"group_size": max(n, 2) if ALGORITHMS[algo["name"]].group else n}
    controller: dict[str, Any] = {}
    if target is not None and coef > 0:
        controller = {"controller": "adaptive", "target": target, "horizon": horizon}
    mapping = [(k, v) for k, v in CARRIED if critic or not k.startswith("critic.")]
    if "generate_max_len" in s.defaults:
        mapping.append(("data.prompt_max_len", "data.max_prompt_tokens"))
    elif s.get("rollout.max_new_tokens") is None:
        # max_new_tokens None: OpenRLHF generates up to max_len minus the prompt's length.
        mapping = [(k, v) for k, v in mapping if v != "rollout.max_new_tokens"]
        mapping.append(("data.max_len", "rollout.max_new_tokens"))
        L = s.label
        r.equivalent_differences.append(
            f"{L('rollout.max_new_tokens')} not set: OpenRLHF generates up to "
            f"{L('data.max_len')} ({s.get('data.max_len')}) minus each prompt's length; klpo "
            "up to rollout.max_new_tokens whatever the prompt (shown as the whole max_len)"
        )
    if not (s.int("ds.lora.rank") or 0) > 0:
        mapping = [(k, v) for k, v in mapping if not v.startswith("model.lora.")]
    carried, missing = carry(s, mapping)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    build_equivalent(r, algo, rollout, controller, carried, s)
    build_intended(r)
