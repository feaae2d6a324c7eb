r"""ROLL's RLVR pipeline configs (``examples/*/rlvr*.yaml``, run by ``start_rlvr_pipeline.py``),
read for the doctor.

Pinned: alibaba/ROLL main at ``8eb27cc`` (2026-08-18; ``setup.py`` says 0.3.0). The YAML is
composed by Hydra and built into ``RLVRConfig`` with ``dacite.from_dict`` and dacite's default
``Config``: a key the dataclasses do not have is dropped without a word (lenient), while a value
outside a ``Literal`` is refused (``kl_penalty: k3``, ``adv_estimator``). Every key and default is
the dataclasses' (the table ``klpo/assets/doctor/roll-<version>.json``, read from
``roll/pipeline/rlvr/rlvr_config.py`` and ``roll/configs/*.py`` by :mod:`klpo.doctor.tables`):
``adv_estimator`` gae, ``init_kl_coef`` 0.2, ``kl_penalty`` kl, ``add_token_level_kl`` false,
``use_kl_loss`` false, ``kl_loss_coef`` 0, ``loss_agg_mode`` seq-mean-token-mean,
``num_return_sequences_in_group`` 1, ``ppo_epochs`` 1 (``roll/configs/base_config.py:510-572``).

What the settings do (``roll/utils/functionals.py``, ``roll/pipeline/rlvr/actor_worker.py``):

- the **reward KL** (``compute_token_reward``, functionals.py:614-649): with
  ``add_token_level_kl`` each token's reward is lowered by beta · k(old_logp, ref_logp), k from
  ``kl_penalty`` (``kl`` = d, ``abs`` = |d|, ``mse`` = d²/2; ``full`` sums ``F.kl_div`` over the
  gathered log-probs, not a KL over the vocabulary), beta ``init_kl_coef``, adapted toward
  ``target_kl`` when it is set (``roll/utils/kl_controller.py``); the reference is loaded only when
  ``init_kl_coef > 0`` or ``use_kl_loss`` (base_config.py:654-656), otherwise its log-probs are the
  old ones and every KL is zero (rlvr_pipeline.py:668-670). Credit: per token through GAE for
  ``gae``, returns-to-go (``gamma``) for ``reinforce`` and ``grpo`` (functionals.py:1168-1171), where
  ``grpo`` first normalises the response reward by its group's mean and std (functionals.py:656-657);
- the **KL loss** (actor_worker.py:55-60, 106-107): with ``use_kl_loss``, k3 of the current and
  reference log-probs with its value clamped to ±10 (functionals.py:198-202), reduced by
  ``loss_agg_mode`` and added times ``kl_loss_coef``, with no weight for tokens of an older policy;
- the **critic**: built only for ``adv_estimator: gae`` (rlvr_pipeline.py:223);
- **optimiser steps** per batch: ``ppo_epochs`` × (rollout_batch_size × group / data-parallel
  ranks) / (per_device_train_batch_size × gradient_accumulation_steps) (base_worker.py:83-111);
  ``async_generation_ratio > 0`` runs the asynchronous pipeline.

On-policy distillation (``docs_roll/docs/User Guides/Pipeline/on_policy_distill_pipeline_start.md``)
runs in the same pipeline, with the teacher in the reference's place (``_handle_opd_mapping``,
base_config.py:666-746): **pure** (``is_pure_opd``, set by ``examples/
start_onpolicy_distill_pipeline.py``, which maps ``student_train``/``student_infer`` to
``actor_train``/``actor_infer`` and builds the config with dacite's ``check_types=False``) or
**mixed** (``use_opd: true`` under ``start_rlvr_pipeline.py``). ``teacher`` is one worker or a
dict of them (multi-teacher, each routed to the samples whose tag is in its ``tag_included``,
empty for all). ``compute_advantage`` (functionals.py:1108-1187) forms, per token, the sum over
teachers of ``opd_kl_coef`` (default 1.0) × ``compute_approx_kl(student, teacher, kl_penalty)``
(``kl`` = d = log pi_theta − log pi_T, ``abs``, ``mse`` = d²/2, and under the pure launcher,
which checks no ``Literal``, ``k3`` with its value clamped to ±10), with the student's log-probs
``old_log_probs`` when the recompute is on (``init_kl_coef > 0`` turns it on, :817-819) and the
inference engine's otherwise. Pure: the advantage is minus that sum, the task reward unused
(``_apply_opd_config``, :866-907, also forces ``gamma`` 0, ``adv_estimator`` reinforce, no KL
loss, no reward KL). Mixed: it is subtracted from the estimator's advantages after the returns
are formed (discount 0), though the docs and ``use_opd``'s help say it is added to the
token-level rewards. Both then whiten (``whiten_advantages``) and clip (``advantage_clip``).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from klpo.doctor import distill, tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.keys import check_keys, settle
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    Settings,
    Term,
    check_known,
    flatten,
    load_mapping,
)

__all__ = ["ADVANTAGES", "ESTIMATORS", "VERSION", "detect", "read", "read_settings"]

VERSION = "0.3.0+8eb27cc"
SRC = "ROLL 8eb27cc"
# kl_penalty -> klpo estimator (None: klpo has none); the config's Literal (base_config.py:527).
ESTIMATORS: dict[str, str | None] = {"kl": "k1", "abs": "abs", "mse": "k2", "full": None}
# adv_estimator -> (klpo algorithm, how a per-token reward KL reaches the advantage)
ADVANTAGES: dict[str, tuple[str | None, str]] = {
    "gae": ("ppo", "per token, through GAE (gamma, lambd) with the critic's values"),
    "reinforce": ("reinforce++", "per token, returns-to-go (gamma)"),
    "grpo": (
        "grpo",
        "per token, returns-to-go (gamma), after the group normalisation of the score",
    ),
    "gigpo": (None, "per token, returns-to-go (gamma)"),
    "step_reinforce": (None, "per token, returns-to-go (gamma)"),
    "agentic_reinforce": (None, "the agentic pipeline's"),
}
REDUCTIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CARRIED = [
    ("pretrain", "model.policy"),
    ("rollout_batch_size", "rollout.prompts_per_step"),
    ("response_length", "rollout.max_new_tokens"),
    ("prompt_length", "data.max_prompt_tokens"),
    ("actor_infer.generating_args.temperature", "rollout.temperature"),
    ("actor_infer.generating_args.top_p", "rollout.top_p"),
    ("entropy_loss_coef", "algo.entropy_coef"),
    ("actor_train.training_args.learning_rate", "optim.lr"),
    ("actor_train.training_args.weight_decay", "optim.weight_decay"),
    ("max_grad_norm", "optim.grad_clip"),
    ("max_steps", "run.steps"),
    ("seed", "run.seed"),
]
TRAIN = "actor_train"


AGENTIC = ("train_env_manager", "val_env_manager", "custom_envs")


# the worker sections of the pure OPD launcher's config (mapped to actor_train / actor_infer)
STUDENT = ("student_train", "student_infer")
# what _apply_opd_config sets in pure OPD mode, whatever the file says (base_config.py:888-905)
PURE_FORCED: dict[str, Any] = {
    "gamma": 0,
    "adv_estimator": "reinforce",
    "use_kl_loss": False,
    "add_token_level_kl": False,
}
# kl_penalty -> the OPD term's klpo estimator (compute_approx_kl, functionals.py:181-209)
OPD_ESTIMATORS: dict[str, str] = {"kl": "k1", "abs": "abs", "mse": "k2", "k3": "low_var_kl"}


def _students(data: dict[str, Any]) -> bool:
    return all(isinstance(data.get(k), dict) for k in STUDENT)


def detect(doc: Any) -> tuple[int, str] | None:
    """ROLL's evidence: its ``actor_train`` and ``actor_infer`` worker sections, or the on-policy
    distillation launcher's ``student_train`` and ``student_infer``. An agentic pipeline's config
    (environment managers) is refused by name: another pipeline."""
    data = doc.data or {}
    if _students(data) and not isinstance(data.get(TRAIN), dict):
        return 3, "ROLL's on-policy distillation sections student_train and student_infer"
    if not (isinstance(data.get(TRAIN), dict) and isinstance(data.get("actor_infer"), dict)):
        return None
    agentic = [k for k in AGENTIC if k in data]
    if agentic:
        raise DoctorError(
            f"{doc.source}: a ROLL agentic pipeline config ({', '.join(agentic)}: "
            "AgenticConfig, run by start_agentic_pipeline.py), not the RLVR pipeline the doctor "
            "reads; its rewards, advantages and KL are that pipeline's code"
        )
    return 3, "ROLL's actor_train and actor_infer worker sections"


OPD_LAUNCHER = "start_onpolicy_distill_pipeline.py"


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``roll`` row's reader: an RLVR YAML, or a launch script's
    ``start_rlvr_pipeline.py`` / ``start_onpolicy_distill_pipeline.py --config_path DIR
    --config_name NAME``."""
    if doc.kind == "script":
        path, launcher = _script_config(doc)
        return read_settings(load_mapping(path), doc.source, version, launcher)
    return read_settings(doc.data, doc.source, version)


def _script_config(doc: Any) -> tuple[Path, str]:
    """The YAML a ``start_rlvr_pipeline.py`` command composes: ``--config_name`` in
    ``--config_path`` (from the examples folder), else beside the script (the examples set
    ``CONFIG_PATH=$(basename $(dirname $0))``); and the launcher (``"rlvr"``, or ``"opd"`` for
    ``start_onpolicy_distill_pipeline.py``, whose default config is
    ``onpolicy_distill_config``)."""
    ep = doc.entry()
    if ep is None or ep.framework != "roll":
        raise DoctorError(
            f"{doc.source}: no ROLL start_rlvr_pipeline.py / {OPD_LAUNCHER} command found"
        )
    words, given = ep.arguments, {}
    for j, w in enumerate(words):
        name, eq, value = w.partition("=")
        if name in ("--config_path", "--config_name"):
            given[name] = value if eq else (words[j + 1] if j + 1 < len(words) else "")
    launcher = "opd" if ep.name.rsplit("/", 1)[-1] == OPD_LAUNCHER else "rlvr"
    default = "onpolicy_distill_config" if launcher == "opd" else "sppo_config"
    name = given.get("--config_name", default).removesuffix(".yaml") + ".yaml"
    folder = given.get("--config_path", "config")
    script_dir = Path(ep.name).parent if "/" in ep.name else Path("examples")
    cands = [doc.path.parent / name]
    if "${" not in folder:
        cands += [d / script_dir / folder / name for d in [doc.path.parent, *doc.path.parents]]
        cands += [doc.path.parent / folder / name]
    for c in cands:
        if c.is_file():
            return c, launcher
    raise DoctorError(
        f"{doc.source}: line {ep.command.line}: --config_name {name} is neither beside the script "
        f"nor in {folder}; give the YAML itself"
    )


def _device_count(value: Any) -> int | None:
    """How many devices ``device_mapping`` names (ROLL evaluates the string:
    ``list(range(0,16))``); None where the doctor cannot tell."""
    if isinstance(value, list):
        return len(value)
    text = str(value or "").replace(" ", "")
    m = re.fullmatch(r"(?:list\()?range\((\d+)(?:,(\d+))?(?:,(\d+))?\)\)?", text)
    if m:
        a, b, c = m.groups()
        lo, hi = (0, int(a)) if b is None else (int(a), int(b))
        return len(range(lo, hi, int(c or 1)))
    m = re.fullmatch(r"\[([\d,]*)\]", text)
    return len([x for x in m.group(1).split(",") if x]) if m else None


def _steps(r: Reading, s: Settings, n: int) -> int:
    """Optimiser steps per rank per batch, one epoch (base_worker.py:83-111): the batch's share
    of the data-parallel ranks over per_device_train_batch_size × gradient_accumulation_steps."""
    devices = _device_count(s.get(f"{TRAIN}.device_mapping"))
    strategy = s.str(f"{TRAIN}.strategy_args.strategy_name") or ""
    cfg = f"{TRAIN}.strategy_args.strategy_config"
    if devices is None:
        r.warn(
            "note",
            [f"{TRAIN}.device_mapping"],
            "actor_train.device_mapping is not a list the doctor reads: one data-parallel rank "
            "assumed for the optimiser steps per batch",
        )
        dp = 1
    elif strategy.startswith("megatron"):
        mp = 1
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "context_parallel_size"):  # fmt: skip
            mp *= int(s.values.get(f"{cfg}.{k}") or 1)
        dp = max(1, devices // mp)
    elif strategy.startswith("fsdp2"):
        dp = max(1, devices // int(s.values.get(f"{TRAIN}.model_args.ulysses_size") or 1))
    else:
        dp = devices
    rb = s.int("rollout_batch_size") or 1
    per = s.int(f"{TRAIN}.training_args.per_device_train_batch_size") or 1
    ga = s.int(f"{TRAIN}.training_args.gradient_accumulation_steps") or 1
    return max(1, (rb * n // dp) // (per * ga))


def read_settings(
    data: dict[str, Any], source: str, version: str | None = None, launcher: str | None = None
) -> Reading:
    """Read a ROLL RLVR config into a :class:`Reading`; ``launcher`` ``"rlvr"`` or ``"opd"``
    where a launch script names it, None for a YAML alone (one with ``student_train`` and
    ``student_infer`` is read as the OPD launcher runs it)."""
    from klpo.doctor.frameworks import ROWS

    r = Reading(framework="roll", defaults_version=VERSION, version=version, source=source)
    table = tables.load("roll", VERSION)
    r.defaults_from = f"the doctor's table of {SRC}'s RLVRConfig dataclasses (klpo/assets/doctor)"
    if version is not None and not version.startswith("0.3"):
        r.warn("warning", ["--framework-version"],
               f"the doctor knows ROLL {VERSION}; {version} is read with its defaults")  # fmt: skip
    if "defaults" in data:
        r.warn("note", ["defaults"],
               "a Hydra defaults list: the doctor reads this file's own settings and does not "
               "compose the files it names")  # fmt: skip
    skip = ("hydra", "defaults")
    teachers = _teacher_sections(data)
    multi = teachers is not None and "default" not in teachers
    flat = {
        k: v
        for k, v in flatten(data).items()
        if k.split(".")[0] not in skip and not (multi and k.startswith("teacher."))
    }
    given = check_keys(r, flat, table.defaults, "ROLL", VERSION, ROWS["roll"].policy)
    if multi and teachers:
        for name, section in teachers.items():
            own = {f"teacher.{k}": v for k, v in flatten(section).items()}
            labels = {k: f"teacher.{name}.{k.removeprefix('teacher.')}" for k in own}
            # each worker's keys are a WorkerConfig's (the single teacher's table keys)
            check_keys(r, own, table.defaults, "ROLL", VERSION, ROWS["roll"].policy,
                       labels=labels)  # fmt: skip
    mode = _opd_mode(r, data, launcher)
    defaults = dict(table.defaults)
    if mode == "pure":
        given = _as_pure(r, given, defaults)
    s = Settings(given, defaults, source)
    adv = check_known(s.str("adv_estimator") or "", ADVANTAGES, "adv_estimator", source)
    n = s.int("num_return_sequences_in_group") or 1
    epochs = s.int("ppo_epochs") or 1
    steps = _steps(r, s, n)
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    r.asynchronous = (s.float("async_generation_ratio") or 0.0) > 0
    _loss_term(r, s)
    _reward_term(r, s, adv, mode, launcher)
    _structure(r, s, adv, n, data)
    if mode:
        _opd(r, s, mode, teachers or {}, launcher, data)
    elif teachers:
        r.warn("warning", ["teacher", "use_opd"],
               "a teacher section without use_opd (or the on-policy distillation launcher): "
               "the RLVR pipeline never loads it, and no distillation term is applied; set "
               "use_opd: true (mixed) or launch start_onpolicy_distill_pipeline.py (pure)",
               kind="unread-key")  # fmt: skip
    if r.off_policy and any(t.placement == "loss" for t in r.terms):
        r.warn(
            "warning",
            ["ppo_epochs", "async_generation_ratio", f"{TRAIN}.training_args"],
            ("asynchronous rollouts" if r.asynchronous else
             f"{r.updates_per_batch} optimiser steps per batch")
            + ": the KL loss sees tokens of an older policy, and ROLL does not weight it for that",
        )  # fmt: skip
    _equivalent(r, s, adv, n, epochs, steps)
    settle(r, s.read)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _loss_term(r: Reading, s: Settings) -> None:
    """The KL loss: k3 clamped to ±10, reduced by loss_agg_mode, times kl_loss_coef."""
    use, coef = s.bool("use_kl_loss"), s.float("kl_loss_coef") or 0.0
    agg = check_known(s.str("loss_agg_mode") or "", REDUCTIONS, "loss_agg_mode", s.source)
    if use and coef > 0:
        r.terms.append(
            Term(
                option="use_kl_loss=true (k3, value clamped to ±10)",
                framework_name="k3",
                estimator="low_var_kl",
                placement="loss",
                beta=coef,
                beta_option="kl_loss_coef",
                reduction=agg,
                value_clamp=(-10.0, 10.0),
                logged_as="actor/kl_loss",
            )
        )
    elif use:
        r.warn("warning", ["use_kl_loss", "kl_loss_coef"],
               "use_kl_loss with kl_loss_coef 0 (ROLL's default): the reference model is loaded "
               "and its log-probs computed, but the KL loss has no effect")  # fmt: skip
    elif coef > 0:
        r.warn("warning", ["kl_loss_coef", "use_kl_loss"],
               f"set but ignored: kl_loss_coef {coef:g} takes effect only with use_kl_loss: true "
               "(actor_worker.py)")  # fmt: skip


def _reward_term(
    r: Reading, s: Settings, adv: str, mode: str | None = None, launcher: str | None = None
) -> None:
    """The per-token reward KL (add_token_level_kl), its coefficient and controller; in an OPD
    mode the reference is the teacher, loaded whatever init_kl_coef says."""
    on, beta = s.bool("add_token_level_kl"), s.float("init_kl_coef") or 0.0
    name = s.str("kl_penalty") or "kl"
    if mode == "pure":
        return  # no reward KL (PURE_FORCED); kl_penalty is the teacher term's (_opd)
    if name not in ESTIMATORS and launcher == "opd":
        return  # the OPD launcher checks no Literal: _opd reads kl_penalty
    if name not in ESTIMATORS:
        r.warn(
            "error",
            ["kl_penalty"],
            f"kl_penalty {name!r}: RLVRConfig types it Literal['kl', 'abs', 'mse', 'full'] "
            f"(roll/configs/base_config.py:527) and dacite refuses any other value, so the run "
            "does not start (compute_approx_kl's k3 branch is reachable only from the KL loss)",
            kind="refused",
        )
        return
    target = s.get("target_kl")
    if on and beta > 0:
        r.terms.append(
            Term(
                option=f"add_token_level_kl=true, kl_penalty={name}",
                framework_name=name,
                estimator=ESTIMATORS[name],
                placement="reward",
                beta=beta,
                beta_option="init_kl_coef",
                reduction=ADVANTAGES[adv][1],
                logged_as="critic/kl",
                adaptive=target is not None,
            )
        )
        if name == "full":
            r.warn("error", ["kl_penalty"],
                   "kl_penalty full sums F.kl_div over the gathered per-token log-probs along the "
                   "sequence (functionals.py:203): no KL over the vocabulary, and a per-sequence "
                   "value broadcast against the token mask; use kl (k1) in the reward")  # fmt: skip
    elif on:
        r.warn("note", ["add_token_level_kl", "init_kl_coef"],
               "add_token_level_kl with init_kl_coef 0: no reference is loaded (unless "
               "use_kl_loss), the reference log-probs are the old ones and the reward KL is "
               "exactly zero (rlvr_pipeline.py:668-670)")  # fmt: skip
    elif beta > 0 and not mode:
        given = s.given("init_kl_coef")
        r.warn(
            "warning" if given else "note",
            ["init_kl_coef", "add_token_level_kl"],
            (f"init_kl_coef {beta:g}" if given else f"init_kl_coef is ROLL's default {beta:g}")
            + " without add_token_level_kl: the reference model is loaded (base_config.py:654-"
            "656) and the KL to it computed and logged as critic/kl, but no KL term is applied"
            + ("" if s.bool("use_kl_loss") else "; set init_kl_coef: 0 to skip the reference"),
        )


def _structure(r: Reading, s: Settings, adv: str, n: int, data: dict[str, Any]) -> None:
    """The critic the estimator builds, and a group baseline over groups of one."""
    if adv == "gae" and not s.given("adv_estimator"):
        r.warn("note", ["adv_estimator"],
               "adv_estimator is ROLL's default gae: PPO with a critic (its model is "
               "reward_pretrain unless critic.model_args names one; base_config.py:643-644)",
               kind="structure")  # fmt: skip
    if isinstance(data.get("critic"), dict) and adv != "gae":
        r.warn("warning", ["critic", "adv_estimator"],
               f"a critic section with adv_estimator {adv}: the RLVR pipeline builds a critic "
               "only for gae (rlvr_pipeline.py:223); nothing reads it", kind="unread-key")  # fmt: skip
    group_mean = adv == "grpo" or s.get("norm_mean_type") == "group"
    if group_mean and n == 1:
        r.warn(
            "error",
            ["num_return_sequences_in_group", "adv_estimator", "norm_mean_type"],
            "a group-mean baseline over groups of one (num_return_sequences_in_group 1, ROLL's "
            "default): every advantage is zero"
            + (", and grpo's group std of one reward is NaN (torch.std), so the advantages are "
               "NaN" if adv == "grpo" or s.get("norm_std_type") == "group" else "")
            + "; set num_return_sequences_in_group to the group size (e.g. 8)",
            kind="zero-advantage",
        )  # fmt: skip


def _equivalent(r: Reading, s: Settings, adv: str, n: int, epochs: int, steps: int) -> None:
    name = ADVANTAGES[adv][0]
    algo: dict[str, Any] = {
        "name": name or "grpo",
        "epochs": epochs,
        "minibatches": steps,
        "loss_reduction": s.str("loss_agg_mode") or "seq-mean-token-mean",
    }
    if name is None:
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if name == "ppo":
        algo["gamma"], algo["lam"] = s.float("gamma"), s.float("lambd")
    if name == "reinforce++" and not s.bool("whiten_advantages"):
        r.equivalent_differences.append(
            "ROLL's reinforce without whiten_advantages keeps the raw returns; klpo's reinforce++ "
            "whitens them over the batch"
        )
    side = ("pg_clip_low", "pg_clip_high") if s.bool("use_pg_clip_range") else ("pg_clip",) * 2
    mapping = [*CARRIED, (side[0], "algo.clip_low"), (side[1], "algo.clip_high")]
    carried, missing = carry(s, mapping)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    group = name in ("grpo", "rloo")
    build_equivalent(r, algo, {"group_size": max(n, 2) if group else n}, _controller(s),
                     carried, s)  # fmt: skip
    build_intended(r)


def _controller(s: Settings) -> dict[str, Any]:
    target = s.get("target_kl")
    if target is None:
        return {}
    return {"controller": "adaptive", "target": float(target), "horizon": s.float("kl_horizon")}


# ---------------------------------------------------------------------------------------------
# On-policy distillation.


def _teacher_sections(data: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The ``teacher`` workers by name (``{"default": section}`` for one worker, as
    ``_handle_opd_mapping`` names it), or None where the file has no teacher section. A dict of
    workers is told from one worker by its values: mappings none of whose keys is a worker's."""
    section = data.get("teacher")
    if not isinstance(section, dict) or not section:
        return None
    worker = ("model_args", "strategy_args", "device_mapping", "opd_kl_coef", "tag_included",
              "infer_batch_size", "training_args", "generating_args", "worker_cls")  # fmt: skip
    if all(isinstance(v, dict) for v in section.values()) and not set(section) & set(worker):
        return {str(k): dict(v) for k, v in section.items()}
    return {"default": dict(section)}


def _opd_mode(r: Reading, data: dict[str, Any], launcher: str | None) -> str | None:
    """``"pure"``, ``"mixed"`` or None: is_pure_opd (the OPD launcher sets it), use_opd, or a
    YAML alone with the student sections (read as the OPD launcher runs it)."""
    pure_flag, mixed = bool(data.get("is_pure_opd")), bool(data.get("use_opd"))
    if launcher == "opd" or pure_flag:
        pure = True
    elif launcher is None and _students(data) and not mixed:
        pure = True
        r.warn("note", list(STUDENT),
               "student_train and student_infer: read as examples/"
               f"{OPD_LAUNCHER} runs this file (pure on-policy distillation, is_pure_opd set "
               "by the launcher)")  # fmt: skip
    else:
        pure = False
    if launcher == "rlvr" and _students(data) and not pure_flag:
        r.warn("warning", list(STUDENT),
               "student_train / student_infer under start_rlvr_pipeline.py: only pure OPD "
               f"(is_pure_opd, set by {OPD_LAUNCHER}) maps them to actor_train / actor_infer; "
               "here nothing reads them", kind="unread-key")  # fmt: skip
    if pure and mixed:
        r.warn("error", ["is_pure_opd", "use_opd"],
               "is_pure_opd and use_opd together: ROLL raises (base_config.py:680-685, "
               "mutually exclusive) and does not start; "
               + (f"{OPD_LAUNCHER} sets is_pure_opd itself: drop use_opd"
                  if launcher == "opd" else "keep one"),
               kind="refused")  # fmt: skip
        return None
    return "pure" if pure else ("mixed" if mixed else None)


def _as_pure(r: Reading, given: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """Pure OPD's settings: student_train / student_infer in actor_train / actor_infer's place,
    and :data:`PURE_FORCED` over whatever the file says (each change named)."""
    out: dict[str, Any] = {}
    replaced = sorted({k.split(".")[0] for k in given if k.split(".")[0] in (TRAIN, "actor_infer")})
    for key, value in given.items():
        head, _, rest = key.partition(".")
        if head in (TRAIN, "actor_infer"):
            continue  # replaced by the student sections (base_config.py:721-722)
        if head in STUDENT:
            key = ("actor_train." if head == "student_train" else "actor_infer.") + rest
        out[key] = value
    if replaced:
        r.warn("warning", replaced,
               f"{', '.join(replaced)} in a pure OPD config: replaced by student_train / "
               "student_infer (base_config.py:721-722), nothing reads them",
               kind="unread-key")  # fmt: skip
    for key, forced in PURE_FORCED.items():
        if key in out and str(out[key]).lower() != str(forced).lower():
            r.warn("warning", [key],
                   f"{key} {out[key]!r}: pure OPD sets {key} to {forced!r} whatever the file "
                   "says (_apply_opd_config, base_config.py:888-905)", kind="unread-key")  # fmt: skip
        out.pop(key, None)
        defaults[key] = forced
    return out


def _configured(section: dict[str, Any]) -> bool:
    """WorkerConfig.is_configured: a device mapping or a model path (worker_config.py:323-326)."""
    model = section.get("model_args") if isinstance(section.get("model_args"), dict) else {}
    return bool(section.get("device_mapping")) or model.get("model_name_or_path") is not None


def _opd(r: Reading, s: Settings, mode: str, teachers: dict[str, dict[str, Any]],
         launcher: str | None, data: dict[str, Any]) -> None:  # fmt: skip
    """The teacher terms of pure or mixed OPD, their refusals and findings."""
    configured = {k: v for k, v in teachers.items() if _configured(v)}
    if _opd_refused(r, mode, configured, data):
        return
    penalty = s.str("kl_penalty") or "kl"
    est = _opd_estimator(r, mode, launcher, penalty)
    if est is None:
        return
    _opd_terms(r, mode, penalty, est, teachers, configured)
    first = r.teacher_terms[0]
    _opd_notes(r, s, mode, penalty, est)
    _opd_advantage(r, s, mode)
    if len(configured) > 1:
        _routing(r, configured, data, mode)
    r.teacher_intended_why.append(
        "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
        "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
    )
    distill.build_sections(r, first.teacher, {"credit": "returns"})


def _opd_refused(r: Reading, mode: str, configured: dict[str, dict[str, Any]],
                 data: dict[str, Any]) -> bool:  # fmt: skip
    """True (and the refusal said) where ROLL does not start: no teacher, no students, a reference."""
    if not configured:
        r.warn("error", ["teacher"],
               f"{'pure' if mode == 'pure' else 'mixed'} OPD without a configured teacher "
               "(model_args.model_name_or_path or device_mapping): ROLL raises 'requires "
               "teacher config' (base_config.py:713-714, 734-735) and does not start",
               kind="refused")  # fmt: skip
        return True
    if mode == "pure" and not (_students(data) and all(_configured(data[k]) for k in STUDENT)):
        r.warn("error", list(STUDENT),
               "pure OPD without configured student_train and student_infer sections: ROLL "
               "raises (base_config.py:715-719) and does not start", kind="refused")  # fmt: skip
        return True
    if (
        mode == "mixed"
        and isinstance(data.get("reference"), dict)
        and _configured(data["reference"])
    ):
        r.warn("error", ["reference", "use_opd"],
               "use_opd with a configured reference section: ROLL raises ('reference should "
               "NOT be configured', base_config.py:736-739) and does not start; the teacher "
               "takes the reference's place", kind="refused")  # fmt: skip
        return True
    return False


def _opd_estimator(r: Reading, mode: str, launcher: str | None, penalty: str) -> str | None:
    """The OPD term's estimator for ``kl_penalty``, or None (and why) where there is no term."""
    est = OPD_ESTIMATORS.get(penalty)
    # the OPD launcher builds the config with check_types=False: no Literal is checked there
    unchecked = launcher == "opd" or (launcher is None and mode == "pure")
    if penalty == "k3" and not unchecked:
        if mode == "pure":  # mixed: _reward_term refused it already
            r.warn("error", ["kl_penalty"],
                   "kl_penalty 'k3': RLVRConfig types it Literal['kl', 'abs', 'mse', 'full'] and "
                   "start_rlvr_pipeline.py's dacite refuses any other value: the run does not "
                   f"start (only {OPD_LAUNCHER}, which checks no types, takes k3)",
                   kind="refused")  # fmt: skip
        return None
    if est is None:
        r.warn("error", ["kl_penalty"],
               f"kl_penalty {penalty!r} for the OPD term: "
               + ("F.kl_div over the gathered per-token log-probs summed along the sequence "
                  "(functionals.py:203): no divergence of the two next-token distributions, and "
                  "a per-sequence value against the token mask; use kl (d = log pi_theta - "
                  "log pi_T)" if penalty == "full" else
                  "compute_approx_kl raises NotImplementedError at the first step"),
               kind="" if penalty == "full" else "refused")  # fmt: skip
    return est


def _opd_terms(r: Reading, mode: str, penalty: str, est: str,
               teachers: dict[str, dict[str, Any]],
               configured: dict[str, dict[str, Any]]) -> None:  # fmt: skip
    """One teacher term per configured teacher, and their per-token credit."""
    keys = ["use_opd" if mode == "mixed" else "is_pure_opd", "kl_penalty"]
    prefix = "teacher" if "default" in teachers else None
    for name, section in configured.items():
        coef_key = "teacher.opd_kl_coef" if prefix else f"teacher.{name}.opd_kl_coef"
        coef = section.get("opd_kl_coef")
        coef = 1.0 if coef is None else float(coef)
        model = (section.get("model_args") or {}).get("model_name_or_path") or ""
        tags = section.get("tag_included") or []
        t = distill.sampled(
            f"{mode} OPD, kl_penalty={penalty}"
            + ("" if prefix else f", teacher {name}")
            + (f" (tags {', '.join(map(str, tags))})" if tags else ""),
            f"OPD ({mode}): -opd_kl_coef · compute_approx_kl({penalty})", est, "reward", coef,
            coef_key, credit="token", teacher=str(model),
            value_clamp=(-10.0, 10.0) if penalty == "k3" else None,
            clamps=("value clamped to ±10 (compute_approx_kl's k3)",) if penalty == "k3" else (),
        )  # fmt: skip
        r.teacher_terms.append(t)
    distill.per_token_credit(
        r, r.teacher_terms[0], keys,
        "roll/utils/functionals.py: compute_advantage, "
        + ("advantages = -sum over teachers of opd_kl_coef · KL" if mode == "pure" else
           "advantages = the estimator's advantages - sum over teachers of opd_kl_coef · KL"),
    )  # fmt: skip


def _opd_notes(r: Reading, s: Settings, mode: str, penalty: str, est: str) -> None:
    """What pure or mixed OPD trains on, the estimator's reward, and whose log-probs d uses."""
    if mode == "pure":
        r.warn("note", ["is_pure_opd"],
               "pure OPD: the advantage is the teacher term alone; the reward workers' scores "
               "are computed for validation and metrics, not trained on (the task reward is "
               "not in the advantage)")  # fmt: skip
    else:
        r.warn("note", ["use_opd"],
               "use_opd's help and ROLL's OPD guide say the KL is added to the token-level "
               "rewards (reward - opd_kl_coef · reverse_kl), which the returns would carry to "
               "the tokens before it; compute_advantage subtracts it from the advantages after "
               "the returns are formed (functionals.py:1177-1179): each token gets its own only")  # fmt: skip
        if r.terms:
            r.warn("warning", ["use_opd", *(t.beta_option for t in r.terms)],
                   "use_opd puts the teacher in the reference's place (base_config.py:740-742): "
                   "the KL terms above are to the teacher, not to the initial policy")  # fmt: skip
    if penalty != "kl":
        r.warn("note", ["kl_penalty"],
               f"kl_penalty {penalty}: the teacher term is {est} of d = log pi_theta - log pi_T "
               "as a per-token reward, not the sampled reverse KL's -d; klpo explain --teacher "
               "derives the k1 reward only", kind="")  # fmt: skip
    _opd_logprobs(r, s)


def _opd_advantage(r: Reading, s: Settings, mode: str) -> None:
    """What whiten_advantages and advantage_clip do to the advantage the teacher term is in."""
    if s.bool("whiten_advantages"):
        r.warn("warning", ["whiten_advantages"],
               "whiten_advantages whitens the advantages after the teacher term is in them "
               "(functionals.py:1181-1183), per domain: each token's term is divided by the "
               "batch's standard deviation, so opd_kl_coef's scale changes from batch to batch")  # fmt: skip
    clip = s.float("advantage_clip")
    if clip is not None:
        r.warn("warning", ["advantage_clip"],
               f"advantage_clip {clip:g} clamps each token's advantage, teacher term included, "
               f"to ±{clip:g} (functionals.py:1186-1190): "
               + (f"a token whose opd_kl_coef · d exceeds {clip:g} in size gets the same "
                  "advantage as one at the bound" if mode == "pure" else
                  "the sum of the task's advantage and the teacher term is cut"))  # fmt: skip
        r.teacher_terms[:] = [
            replace(t, clamps=(*t.clamps, f"the advantage clipped to ±{clip:g} (advantage_clip)"))
            for t in r.teacher_terms
        ]


def _opd_logprobs(r: Reading, s: Settings) -> None:
    """Whose student log-probs d uses: the training engine's recompute (old_log_probs) when it
    is on (set_old_logprobs_status, base_config.py:785-819), the inference engine's otherwise."""
    recompute = (
        s.bool("enable_old_logprobs_recompute")
        or (s.float("init_kl_coef") or 0.0) > 0
        or (r.updates_per_batch or 1) > 1
    ) and not s.bool("force_disable_old_logprobs_recompute")
    if not recompute:
        r.warn("note", ["init_kl_coef", "enable_old_logprobs_recompute"],
               "the old log-probs are not recomputed (one optimiser step per batch, "
               "init_kl_coef 0): d = log pi_theta - log pi_T takes the student's log-probs from "
               "the inference engine (infer_logprobs) and the teacher's from the training "
               "engine, so their numerical mismatch enters every token's reward")  # fmt: skip


def _routing(r: Reading, teachers: dict[str, dict[str, Any]], data: dict[str, Any],
             mode: str) -> None:  # fmt: skip
    """Multi-teacher routing: a tag of the reward workers no teacher handles."""
    if any(not (v.get("tag_included") or []) for v in teachers.values()):
        return  # a teacher with no tags handles every sample
    covered = {str(t) for v in teachers.values() for t in v.get("tag_included") or []}
    rewards = data.get("rewards") if isinstance(data.get("rewards"), dict) else {}
    tags = {str(t) for w in rewards.values() if isinstance(w, dict)
            for t in w.get("tag_included") or []}  # fmt: skip
    missing = sorted(tags - covered)
    if missing:
        r.warn("warning", ["teacher", "rewards"],
               f"samples tagged {', '.join(missing)} (the reward workers' tag_included) are "
               "routed to no teacher: their teacher term is 0, so "
               + ("their advantage is 0 and they train nothing (pure OPD)" if mode == "pure"
                  else "they get the task's advantage only")
               + "; add the tags to a teacher's tag_included, or leave one teacher's empty")  # fmt: skip
