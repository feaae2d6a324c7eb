"""TRL's ``GRPOConfig`` and ``RLOOConfig`` (YAML or JSON of their fields), read for the doctor.

Defaults are TRL 1.16's (``trl/trainer/grpo_config.py``, ``trl/trainer/rloo_config.py``); what
they mean is read from ``grpo_trainer.py`` (``_compute_loss``: k3, times the differentiable ratio
under ``use_bias_correction_kl``, added to the per-token loss after every policy-side weight) and
``rloo_trainer.py`` (k1 summed over the completion and subtracted from the reward before the
leave-one-out baseline). The GRPO facts are tested against TRL 1.16 itself by
``tests/integrations/test_trl.py``.

Where TRL imports (never in klpo's own install), the fields and defaults are the installed TRL's
own dataclass's, and the file's fields are built into it by ``transformers.HfArgumentParser`` as
``trl grpo --config`` builds them, so ``__post_init__``'s refusals are TRL's words
(:mod:`klpo.doctor.trl_config`); otherwise the table of TRL 1.16.0's fields is read. TRL's
distillation configs are :mod:`klpo.doctor.frameworks.trl_distill`'s.
"""

from __future__ import annotations

import functools
from typing import Any

from klpo.doctor import tables
from klpo.doctor.reading import Reading, Settings, Term, check_known
from klpo.doctor.trl_config import (
    CARRIED,
    CLASSES,
    LAUNCH_KEYS,
    LOSS_TYPES,
    SCALE_REWARDS,
    SCRIPT_KEYS,
    VERSION,
    common,
    finish,
    grpo_algo,
    installed_table,
    read_doc,
    script_fields,
    setup,
    updates,
)

__all__ = [
    "CARRIED",
    "LOSS_TYPES",
    "VERSION",
    "installed_table",
    "read_cli",
    "read_grpo",
    "read_grpo_doc",
    "read_rloo",
    "read_rloo_doc",
    "read_unsloth_doc",
    "updates",
]

# Unsloth (unslothai/unsloth 2026.8.19 at 015bdef, unsloth-zoo 2026.8.13 at ce232d6) rewrites
# GRPOConfig's defaults (unsloth/models/rl.py:3314-3326: loss_type bnpo, beta 0.001,
# vllm_importance_sampling_correction off) and replaces the loss
# (unsloth_zoo/rl_replacements.py:549-613): plain k3, beta · k3 added per token, never
# use_bias_correction_kl.
UNSLOTH_VERSION = "2026.8.19"
UNSLOTH_DEFAULTS = {"loss_type": "bnpo", "beta": 0.001}
# The fields UnslothGRPOConfig adds to GRPOConfig (unsloth/models/rl.py:487-507).
UNSLOTH_FIELDS: dict[str, Any] = {
    "vllm_sampling_params": None,
    "unsloth_num_chunks": None,
    "unsloth_logit_chunk_multiplier": None,
    "unsloth_grpo_mini_batch": None,
}


def read_grpo(
    data: dict[str, Any], source: str, version: str | None = None, unsloth: bool = False
) -> Reading:
    """Read a ``GRPOConfig``'s fields into a :class:`Reading` (``unsloth``: as Unsloth's
    patched trainer runs them)."""
    r, s = setup("grpo", data, source, version, UNSLOTH_FIELDS if unsloth else None)
    if unsloth:
        _unsloth_defaults(r, s)
    beta = s.float("beta") or 0.0
    bias = _bias_correction(r, s, beta, unsloth)
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
    iters, reuse, assumption = updates(s)
    r.algorithm, r.group_size = "grpo", g
    common(r, s, iters, reuse, assumption)
    if beta > 0:
        _grpo_term(r, beta, bias, level, loss_type)
    else:
        ignored = [k for k in ("use_bias_correction_kl",) if s.differs(k)]
        r.warn(
            "warning" if ignored else "note",
            ["beta", *ignored],
            "beta is 0 (TRL's default): no reference model is loaded and no KL term is applied or "
            "logged" + (f"; {', '.join(ignored)} is ignored" if ignored else ""),
        )
    _grpo_findings(r, beta, bias, level, loss_type)
    _dr_grpo_length(r, s, beta, loss_type)
    algo = grpo_algo(r, iters, reuse, loss_type, scale)
    rollout: dict[str, Any] = {"group_size": g}
    if unsloth:
        _unsloth_batch(r, s, g)
    finish(r, s, algo, rollout)
    return r


def _unsloth_defaults(r: Reading, s: Settings) -> None:
    """Unsloth's GRPOConfig defaults over TRL's, and the note that says so."""
    r.framework = "unsloth"
    r.defaults_version = f"{UNSLOTH_VERSION} (TRL {r.defaults_version})"
    s.defaults.update(UNSLOTH_DEFAULTS)
    r.warn(
        "note",
        ["unsloth"],
        f"the script imports Unsloth ({UNSLOTH_VERSION} read), which patches TRL "
        f"{VERSION}'s GRPO: loss_type defaults to bnpo and beta to 0.001, and the "
        "KL is plain k3 in the loss",
    )


def _bias_correction(r: Reading, s: Settings, beta: float, unsloth: bool) -> bool:
    """Whether the KL term is weighted by the token ratio: TRL's ``use_bias_correction_kl``,
    which Unsloth's patched loss never reads."""
    bias = s.bool("use_bias_correction_kl")
    if unsloth and bias and beta > 0:
        r.warn(
            "warning",
            ["use_bias_correction_kl"],
            "Unsloth's patched loss never reads use_bias_correction_kl (TRL 1.16's default "
            "True): under TRL this config's k3 is weighted by the token ratio and follows grad "
            "KL(pi_theta ‖ pi_ref); under Unsloth it is plain k3, whose gradient is grad "
            "KL(pi_ref ‖ pi_theta). Fix: run it under TRL, or set beta 0 (klpo: k3+ or k3_is)",
        )
    return bias and not unsloth


def _grpo_term(r: Reading, beta: float, bias: bool, level: str, loss_type: str) -> None:
    """GRPO's KL term in the loss (k3, or k3 times the ratio), and what it does not weigh."""
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


def _dr_grpo_length(r: Reading, s: Settings, beta: float, loss_type: str) -> None:
    """dr_grpo's normaliser: the default max_completion_length rescales the KL's weight."""
    if loss_type == "dr_grpo" and beta > 0 and not s.given("max_completion_length"):
        length = s.int("max_completion_length")
        r.warn(
            "warning",
            ["loss_type", "beta", "max_completion_length"],
            f"dr_grpo divides each completion's summed loss, KL included, by "
            f"max_completion_length, here TRL's default {length} (the file does not set it): a "
            f"completion of L tokens gets beta·L/{length} of the KL weight a token mean would "
            "give it; set max_completion_length to the length you generate",
        )


def _unsloth_batch(r: Reading, s: Settings, g: int) -> None:
    """Unsloth makes the batch a multiple of the group (unsloth/models/rl.py:3466-3498)."""
    per_device = s.int("per_device_train_batch_size") or 1
    accum = s.int("gradient_accumulation_steps") or 1
    procs = s.int("num_processes") or 1
    if (accum * procs * per_device) % g and not s.given("steps_per_generation"):
        s.values["per_device_train_batch_size"] = g
        r.warn(
            "note",
            ["per_device_train_batch_size", "num_generations"],
            f"per_device_train_batch_size {per_device} × accumulation {accum} is not a "
            f"multiple of num_generations={g}: Unsloth sets per_device_train_batch_size to "
            f"{g} (and prints so)",
        )


def _grpo_findings(r: Reading, beta: float, bias: bool, level: str, loss_type: str) -> None:
    """Off-policy steps and per-sequence reduction, as they touch the KL term."""
    if r.off_policy and beta > 0 and not (bias and level == "token"):  # fmt: skip
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


def read_rloo(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read an ``RLOOConfig``'s fields into a :class:`Reading`."""
    r, s = setup("rloo", data, source, version)
    beta = s.float("beta") or 0.0
    g = s.int("num_generations") or 1
    norm = s.bool("normalize_advantages")
    iters, reuse, assumption = updates(s)
    r.algorithm, r.group_size = "rloo", g
    common(r, s, iters, reuse, assumption)
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
    finish(r, s, algo, rollout)
    return r


def read_cli(doc: Any, version: str | None = None) -> Reading:
    """A launch script running ``trl grpo|rloo --config FILE [--field value ...]``.

    The config file is found as written, else beside the script; the command line's
    ``--field value`` overrides the file's (TRL's ``TrlParser``). The file's keys that belong to
    the script (``reward_funcs``) or to ``accelerate launch`` (``num_processes``) are TRL's own.
    """
    row, fields = script_fields(doc, "trl-", "`trl grpo` or `trl rloo`")
    return (read_rloo if row == "trl-rloo" else read_grpo)(fields, doc.source, version)


# -- the rows' entry points (klpo.doctor.frameworks: trl-grpo, trl-rloo, unsloth) -------------


@functools.lru_cache(maxsize=1)
def _fields() -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """(GRPOConfig's fields, RLOOConfig's fields, the other keys a `trl` config file may hold),
    from the shipped tables of TRL VERSION."""
    grpo, rloo = tables.load("trl-grpo", VERSION), tables.load("trl-rloo", VERSION)
    other = {*SCRIPT_KEYS, *LAUNCH_KEYS, *(grpo.cli or {}), *(rloo.cli or {})}
    return frozenset(grpo.defaults), frozenset(rloo.defaults), frozenset(other)


_PPO_ONLY = {"kl_coef", "vf_coef", "cliprange_value", "num_ppo_epochs", "whiten_rewards"}


def _mapping_kind(data: dict[str, Any], source: str) -> tuple[str, str] | None:
    """``(kind, why)`` for a mapping whose keys are mostly TRL's config fields, else None.

    Most keys (three in four) must be fields of GRPOConfig or RLOOConfig (or the `trl` CLI's
    other keys): a file of another framework that shares ``output_dir`` or ``beta`` is no TRL
    config. RLOO when it holds fields only RLOOConfig has and none only GRPOConfig has."""
    from klpo.doctor.reading import DoctorError

    keys = set(data)
    if keys & _PPO_ONLY and not keys & {"num_generations", "loss_type"}:
        raise DoctorError(
            f"{source}: a TRL PPOConfig ({', '.join(sorted(keys & _PPO_ONLY))}): the doctor "
            "reads TRL's GRPOConfig and RLOOConfig only, and does not read a PPO config as either"
        )
    grpo, rloo, other = _fields()
    if not keys or any(isinstance(v, dict) for v in data.values()):
        return None
    known = keys & (grpo | rloo | other)
    if len(known) < 0.75 * len(keys):
        return None
    why = f"{len(known)} of its {len(keys)} keys are TRL config fields"
    if keys & (rloo - grpo) and not keys & (grpo - rloo):
        return "rloo", why + " (RLOOConfig's own among them)"
    return "grpo", why


def _detect(doc: Any, kind: str, article: str) -> tuple[int, str] | None:
    """Evidence that ``doc`` is a ``kind`` (``grpo`` or ``rloo``) config: its Python call
    (``article`` goes before the class's name), or a mapping :func:`_mapping_kind` takes for one."""
    cls = CLASSES[kind]
    if doc.kind == "python":
        name, _, _, line = doc.call()
        return (2, f"{article} {cls}(...) call (line {line})") if name == cls else None
    found = _mapping_kind(doc.data, doc.source) if doc.kind == "mapping" else None
    return (2, found[1]) if found and found[0] == kind else None


def detect_grpo(doc: Any) -> tuple[int, str] | None:
    return _detect(doc, "grpo", "a")


def detect_rloo(doc: Any) -> tuple[int, str] | None:
    return _detect(doc, "rloo", "an")


def detect_unsloth(doc: Any) -> tuple[int, str] | None:
    if doc.kind != "python":
        return None
    _, _, unsloth, line = doc.call()
    return (3, f"imports Unsloth, and its config call at line {line}") if unsloth else None


def read_grpo_doc(doc: Any, version: str | None = None) -> Reading:
    """The ``trl-grpo`` row's reader: a GRPOConfig's fields (YAML/JSON, a script's
    ``trl grpo --config``, a Python script's ``GRPOConfig(...)``)."""
    if doc.kind == "script":
        return read_cli(doc, version)
    if doc.kind == "python":
        cls, kwargs, _, _ = doc.call()
        return (read_rloo if cls == "RLOOConfig" else read_grpo)(kwargs, doc.source, version)
    return read_grpo(doc.data, doc.source, version)


def read_rloo_doc(doc: Any, version: str | None = None) -> Reading:
    """The ``trl-rloo`` row's reader."""
    return read_doc(doc, version, read_rloo, read_cli)


def read_unsloth_doc(doc: Any, version: str | None = None) -> Reading:
    """The ``unsloth`` row's reader: a Python script's GRPOConfig(...) as Unsloth runs it."""
    from klpo.doctor.reading import DoctorError

    cls, kwargs, _, _ = doc.call()
    if cls != "GRPOConfig":
        raise DoctorError(
            f"{doc.source}: Unsloth patches TRL's GRPO; the doctor reads its GRPOConfig"
        )
    return read_grpo(kwargs, doc.source, version, unsloth=True)
