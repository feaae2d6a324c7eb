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
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from klpo.doctor import tables
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


def detect(doc: Any) -> tuple[int, str] | None:
    """ROLL's evidence: its ``actor_train`` and ``actor_infer`` worker sections. An agentic
    pipeline's config (environment managers) is refused by name: another pipeline."""
    data = doc.data or {}
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


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``roll`` row's reader: an RLVR YAML, or a launch script's
    ``start_rlvr_pipeline.py --config_path DIR --config_name NAME``."""
    if doc.kind == "script":
        return read_settings(load_mapping(_script_config(doc)), doc.source, version)
    return read_settings(doc.data, doc.source, version)


def _script_config(doc: Any) -> Path:
    """The YAML a ``start_rlvr_pipeline.py`` command composes: ``--config_name`` in
    ``--config_path`` (from the examples folder), else beside the script (the examples set
    ``CONFIG_PATH=$(basename $(dirname $0))``)."""
    ep = doc.entry()
    if ep is None or ep.framework != "roll":
        raise DoctorError(f"{doc.source}: no ROLL start_rlvr_pipeline.py command found")
    words, given = ep.arguments, {}
    for j, w in enumerate(words):
        name, eq, value = w.partition("=")
        if name in ("--config_path", "--config_name"):
            given[name] = value if eq else (words[j + 1] if j + 1 < len(words) else "")
    name = given.get("--config_name", "sppo_config").removesuffix(".yaml") + ".yaml"
    folder = given.get("--config_path", "config")
    script_dir = Path(ep.name).parent if "/" in ep.name else Path("examples")
    cands = [doc.path.parent / name]
    if "${" not in folder:
        cands += [d / script_dir / folder / name for d in [doc.path.parent, *doc.path.parents]]
        cands += [doc.path.parent / folder / name]
    for c in cands:
        if c.is_file():
            return c
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


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a ROLL RLVR config into a :class:`Reading`."""
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
    flat = {k: v for k, v in flatten(data).items() if k.split(".")[0] not in skip}
    given = check_keys(r, flat, table.defaults, "ROLL", VERSION, ROWS["roll"].policy)
    s = Settings(given, table.defaults, source)
    adv = check_known(s.str("adv_estimator") or "", ADVANTAGES, "adv_estimator", source)
    n = s.int("num_return_sequences_in_group") or 1
    epochs = s.int("ppo_epochs") or 1
    steps = _steps(r, s, n)
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    r.asynchronous = (s.float("async_generation_ratio") or 0.0) > 0
    _loss_term(r, s)
    _reward_term(r, s, adv)
    _structure(r, s, adv, n, data)
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


def _reward_term(r: Reading, s: Settings, adv: str) -> None:
    """The per-token reward KL (add_token_level_kl), its coefficient and controller."""
    on, beta = s.bool("add_token_level_kl"), s.float("init_kl_coef") or 0.0
    name = s.str("kl_penalty") or "kl"
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
    elif beta > 0:
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
