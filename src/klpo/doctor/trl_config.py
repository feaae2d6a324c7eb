"""TRL's config classes as the doctor's TRL readers share them: fields, defaults, parsing.

The TRL rows (:mod:`klpo.doctor.frameworks.trl`: GRPOConfig, RLOOConfig, Unsloth;
:mod:`klpo.doctor.frameworks.trl_distill`: DistillationConfig, SDPOConfig) read a config the same
way: the file's fields checked against the config class (:func:`check_fields`: TRL refuses a
field it does not have), over its defaults (:func:`setup`), built into TRL's own dataclass by
``transformers.HfArgumentParser`` where TRL imports (:func:`installed_table`, :func:`parse`, so
``__post_init__``'s refusals are TRL's words; otherwise the table of TRL 1.16.0's fields), the
optimiser steps one generation feeds (:func:`updates`), a launch script's ``trl CMD --config FILE
--field value`` (:func:`cli_fields`, :func:`launcher_processes`), and the klpo configs
(:func:`finish`).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from collections.abc import Callable
from typing import Any

from klpo.doctor import tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.reading import Reading, Settings, flatten, nearest, version_matches

__all__ = [
    "CARRIED",
    "CLASSES",
    "LAUNCH_KEYS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "SCRIPT_KEYS",
    "VERSION",
    "check_fields",
    "cli_fields",
    "common",
    "finish",
    "grpo_algo",
    "installed_table",
    "launcher_processes",
    "parse",
    "read_doc",
    "script_fields",
    "setup",
    "updates",
]

VERSION = "1.16.0"

# loss_type -> klpo.reduce mode of the combined per-token loss (docs/frameworks.md §3).
LOSS_TYPES: dict[str, str] = {
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "bnpo": "token-mean",
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "luspo": "seq-mean-token-sum",
    "dr_grpo": "seq-mean-token-sum-norm",
}

SCALE_REWARDS = {
    "group": "sample",
    "true": "sample",
    "none": "none",
    "false": "none",
    "batch": None,
}

# Keys a `trl grpo|rloo --config` file may hold besides the config dataclass's: the script's
# own arguments (trl/scripts/grpo.py: GRPOScriptArguments) and `accelerate launch`'s, which the
# TRL CLI passes on (trl/cli.py). num_processes enters the generation batch.
SCRIPT_KEYS: dict[str, object] = {"reward_funcs": None, "reward_model_name_or_path": None}
LAUNCH_KEYS: dict[str, object] = {
    "num_processes": 1,
    "num_machines": 1,
    "machine_rank": 0,
    "main_process_ip": None,
    "main_process_port": None,
    "mixed_precision": None,
    "multi_gpu": False,
    "config_file": None,
    "accelerate_config": None,
    "deepspeed_config_file": None,
    "zero_stage": None,
}

# TRL field -> klpo key: what the "same thing" config carries.
CARRIED: list[tuple[str, str]] = [
    ("model_name_or_path", "model.policy"),
    ("gradient_checkpointing", "model.gradient_checkpointing"),
    ("lora_r", "model.lora.r"),
    ("lora_alpha", "model.lora.alpha"),
    ("lora_dropout", "model.lora.dropout"),
    ("max_completion_length", "rollout.max_new_tokens"),
    ("temperature", "rollout.temperature"),
    ("top_p", "rollout.top_p"),
    ("epsilon", "algo.clip_low"),
    ("learning_rate", "optim.lr"),
    ("weight_decay", "optim.weight_decay"),
    ("max_grad_norm", "optim.grad_clip"),
    ("warmup_steps", "optim.warmup_steps"),
    ("max_steps", "run.steps"),
    ("seed", "run.seed"),
    ("output_dir", "run.out_dir"),
]


def updates(s: Settings) -> tuple[int, int, str | None]:
    """(num_iterations, optimiser steps one generation feeds per iteration, assumption).

    TRL generates once every ``steps_per_generation × num_iterations`` micro-steps
    (``GRPOTrainer._prepare_inputs``) and steps the optimiser every
    ``gradient_accumulation_steps``; ``GRPOConfig.__post_init__`` derives
    ``steps_per_generation`` from ``generation_batch_size / (per_device_train_batch_size ×
    processes)`` when only the batch size is given (and defaults it to the accumulation steps).
    The number of processes is not in the config: 1 is assumed and said.
    """
    iters = s.int("num_iterations") or 1
    accum = s.int("gradient_accumulation_steps") or 1
    spg, gbs = s.int("steps_per_generation"), s.int("generation_batch_size")
    procs = s.int("num_processes") or 1
    assumption = None
    if spg is None and gbs is not None:
        per_device = s.int("per_device_train_batch_size") or 1
        spg = max(1, gbs // (per_device * procs))
        if not s.given("num_processes"):
            assumption = (
                f"generation_batch_size={gbs} with per_device_train_batch_size={per_device}: "
                f"{spg} steps per generation on 1 process (on P processes, {spg}/P): the "
                "config does not hold the process count (num_processes)"
            )
    spg = spg or accum
    return iters, max(1, spg // accum), assumption


def check_fields(
    r: Reading, data: dict[str, Any], table: tables.Table, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """TRL refuses a field its config does not have; name it and the nearest real one."""
    flat = flatten(data)
    cli = table.cli or {}
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if (
            key in table.defaults
            or key in cli
            or key in SCRIPT_KEYS
            or key in LAUNCH_KEYS
            or (extra and key.split(".")[0] in extra)
        ):
            out[key] = value
            continue
        near = nearest(key, [*table.defaults, *cli])
        if extra:
            # Unsloth's config drops what TRL's rejects, with a printed notice
            # (unsloth/models/rl_config_compat.py: filter_config_init_kwargs).
            r.warn(
                "warning",
                [key],
                f"{key}: not a field of TRL {table.version}'s GRPOConfig; Unsloth drops it with "
                "a printed notice and the run starts without it: it does nothing"
                + (f" (did you mean {near}?)" if near else ""),
                kind="unknown-key",
            )
            continue
        r.warn(
            "error",
            [key],
            f"{key}: no such field in TRL {table.version}'s {CLASSES[table.framework[4:]]}"
            + (f" (did you mean {near}?)" if near else "")
            + "; TRL refuses it (HfArgumentParser / the dataclass: unexpected argument) and "
            "does not start" + (f"; the doctor read {near} as the file leaves it" if near else ""),
            kind="unknown-key",
        )
    return out


def setup(
    kind: str,
    data: dict[str, Any],
    source: str,
    version: str | None,
    extra: dict[str, Any] | None = None,
) -> tuple[Reading, Settings]:
    installed = installed_table(kind)
    if installed is not None and (version is None or version_matches(version, installed.version)):
        table, note = installed, None
    else:
        table, note = tables.pick(f"trl-{kind}", version, VERSION)
    r = Reading(
        framework=f"trl-{kind}", defaults_version=table.version, version=version, source=source
    )
    r.defaults_from = (
        table.source
        if table is installed
        else f"the doctor's table of TRL {table.version}'s {CLASSES[kind]} fields "
        "(klpo/assets/doctor)"
    )
    if note:
        r.warn("warning", ["--framework-version"], note)
    defaults = {
        **SCRIPT_KEYS,
        **LAUNCH_KEYS,
        **(extra or {}),
        **(table.cli or {}),
        **table.defaults,
    }
    checked = check_fields(r, data, table, extra or {})
    if table is installed:
        parse(r, kind, checked)
    return r, Settings(checked, defaults, source)


CLASSES = {
    "grpo": "GRPOConfig",
    "rloo": "RLOOConfig",
    "distillation": "DistillationConfig",
    "sdpo": "SDPOConfig",
}
"""kind -> the TRL config class (:data:`klpo.doctor.tables.TRL_KINDS`)."""


@functools.lru_cache(maxsize=4)
def installed_table(kind: str) -> tables.Table | None:
    """The installed TRL's ``GRPOConfig`` / ``RLOOConfig`` fields with their defaults (TRL is
    never in klpo's own install), or None where TRL does not import."""
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        data = tables.trl_table(kind)
    except Exception:  # a TRL that does not import here: the table is read
        return None
    return tables.Table(
        framework=data["framework"],
        version=data["version"],
        source=f"the installed TRL {data['version']}'s {CLASSES[kind]} dataclass, the "
        "file's fields built by transformers' HfArgumentParser",
        defaults=data["defaults"],
        cli=data["cli"],
    )


def parse(r: Reading, kind: str, checked: dict[str, Any]) -> None:
    """The file's fields built into TRL's own config by ``HfArgumentParser.parse_dict``, as
    ``trl grpo --config`` builds them: TRL's ``__post_init__`` checks run, and a refusal is an
    error in TRL's words. The config is built on this machine (``use_cpu``, one process), so
    the checks that depend on the process count (the generation batch divisible by the group)
    are left to the doctor's own finding, which knows the launcher's count."""
    import dataclasses

    import trl
    from transformers import HfArgumentParser

    cls = tables.trl_class(kind)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    fields = {k: v for k, v in checked.items() if k in names}
    try:
        HfArgumentParser(cls).parse_dict({**fields, "use_cpu": True}, allow_extra_keys=True)
    except (ValueError, TypeError) as err:
        message = " ".join(str(err).split())
        if "divisible" in message:
            return
        keys = [k for k in fields if k in message] or ["config"]
        r.warn(
            "error",
            keys,
            f"TRL {trl.__version__}'s {cls.__name__} refuses these fields and does not start "
            f"(HfArgumentParser, {cls.__name__}.__post_init__): {message}",
            kind="refused",
        )


def common(r: Reading, s: Settings, iters: int, reuse: int, assumption: str | None) -> None:
    r.updates_per_batch = iters * reuse
    if assumption:
        r.warn("note", ["generation_batch_size"], assumption)
    temp = s.float("temperature")
    if temp is not None and temp != 1.0:
        r.warn(
            "note",
            ["temperature"],
            f"the log-probs of both models are taken at temperature {temp:g}: the KL regularised "
            "is between the temperature-scaled distributions",
        )


def finish(r: Reading, s: Settings, algo: dict[str, Any], rollout: dict[str, Any]) -> None:
    mapping = list(CARRIED)
    # One generation holds per_device_train_batch_size × steps_per_generation completions per
    # process (1 process assumed, as in updates()): that many / num_generations prompts.
    per_device = s.int("per_device_train_batch_size") or 1
    spg = s.int("steps_per_generation") or s.int("gradient_accumulation_steps") or 1
    g = max(1, rollout["group_size"])
    if s.given("num_processes"):
        # The `trl` CLI's accelerate settings: the whole generation batch is
        # per_device_train_batch_size × num_processes × steps_per_generation.
        procs = s.int("num_processes") or 1
        total = s.int("generation_batch_size") or per_device * spg * procs
        if total % g:
            r.warn(
                "error",
                ["per_device_train_batch_size", "num_generations", "num_processes"],
                f"one generation holds {total} completions on {procs} processes, not a "
                f"multiple of num_generations={g}: TRL refuses this config "
                "(GRPOConfig.__post_init__) and does not start",
                kind="refused",
            )
        gbs, processes = total, 1
    else:
        gbs = s.int("generation_batch_size") or per_device * spg
        processes = g // math.gcd(gbs, g)
    if processes > 1:
        # GRPOConfig.__post_init__: the generation batch must hold whole groups.
        r.warn(
            "warning",
            ["per_device_train_batch_size", "num_generations"],
            f"one generation holds {gbs} completions per process, not a multiple of "
            f"num_generations={g}: TRL refuses this config on one process; it runs on a multiple "
            f"of {processes} processes, and the klpo config is shown for {processes}",
        )
    rollout["prompts_per_step"] = max(1, gbs * processes // g)
    if not s.bool("use_peft"):
        mapping = [(k, v) for k, v in mapping if not v.startswith("model.lora.")]
    eps_high = s.float("epsilon_high")
    if eps_high is not None:
        algo["clip_high"] = eps_high
    carried, missing = carry(s, mapping)
    if "algo.clip_low" in carried and eps_high is None:
        carried["algo.clip_high"] = carried["algo.clip_low"]
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    build_equivalent(r, algo, rollout, {}, carried, s)
    build_intended(r)
    r.findings[:0] = s.findings
    r.settings = s.read


def grpo_algo(r: Reading, iters: int, reuse: int, loss_type: str, scale: str) -> dict[str, Any]:
    """klpo's ``algo`` section for a GRPO config, and what it cannot reproduce."""
    std = SCALE_REWARDS[scale]
    algo: dict[str, Any] = {
        "name": "grpo",
        "epochs": iters,
        "minibatches": reuse,
        "loss_reduction": LOSS_TYPES[loss_type],
        "std": std or "sample",
    }
    if std is None:
        r.equivalent_differences.append(
            "scale_rewards='batch' (group mean, batch std) has no klpo config key; shown with "
            "the group std"
        )
    if loss_type == "bnpo":
        r.equivalent_differences.append(
            "bnpo divides by the micro-batch's token count; klpo by the whole batch's"
        )
    if loss_type not in ("dapo", "bnpo", "grpo", "dr_grpo", "luspo"):
        r.equivalent_differences.append(
            f"loss_type={loss_type!r}: TRL's policy surrogate differs from klpo's PPO clip"
        )
    return algo


def cli_fields(ep: Any, path: Any, source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the --config file's fields, the command line's --field value pairs)``."""
    from pathlib import Path

    from klpo.doctor.reading import DoctorError, command_flags, load_mapping, scalar

    data: dict[str, Any] = {}
    flags: dict[str, Any] = {}
    for name, given in command_flags(ep.command.words[ep.at + 1 :]):
        value = "true" if given is None else given
        if name == "config":
            given = Path(value)
            beside = Path(path).parent / value
            found = given if given.exists() else beside if beside.exists() else None
            if found is None:
                raise DoctorError(
                    f"{source}: line {ep.command.line}: --config {value} is neither a file as "
                    f"written nor beside the script ({beside}); give the config's path"
                )
            data = load_mapping(found)
            continue
        flags[name] = scalar(value)
    return data, flags


def launcher_processes(ep: Any) -> int | None:
    """The launcher's process count (``accelerate launch --num_processes N``, ``torchrun
    --nproc_per_node N``): the generation batch's multiplier, as num_processes in the file."""
    launcher = ep.command.words[: ep.at]
    found = None
    for j, w in enumerate(launcher):
        name, eq, value = w.partition("=")
        if name in ("--num_processes", "--nproc_per_node", "--nproc-per-node"):
            given = value if eq else (launcher[j + 1] if j + 1 < len(launcher) else "")
            if given.isdigit() and found is None:
                found = int(given)
    return found


def script_fields(doc: Any, row: str, command: str) -> tuple[str, dict[str, Any]]:
    """A launch script's TRL command, as ``TrlParser`` and the launcher take it: ``(its row,
    e.g. "trl-rloo", the --config file's fields under the command line's)``, with the launcher's
    process count as ``num_processes`` where the fields do not set it. Refused, naming
    ``command``, where the script's command is of no row whose name starts with ``row``."""
    from klpo.doctor.reading import DoctorError

    ep = doc.entry()
    if ep is None or not ep.framework.startswith(row):
        raise DoctorError(f"{doc.source}: no {command} command found")
    data, flags = cli_fields(ep, doc.path, doc.source)
    procs = launcher_processes(ep)
    if procs is not None:
        flags.setdefault("num_processes", procs)
    return ep.framework, {**data, **flags}


def read_doc(
    doc: Any,
    version: str | None,
    read: Callable[[dict[str, Any], str, str | None], Reading],
    read_cli: Callable[[Any, str | None], Reading] | None = None,
) -> Reading:
    """A TRL row's reader, by what the document is: a launch script through ``read_cli`` (where
    the row reads scripts), a Python script's ``XConfig(...)`` keywords or a YAML/JSON mapping's
    fields through ``read(fields, source, version)``."""
    if doc.kind == "script" and read_cli is not None:
        return read_cli(doc, version)
    fields = doc.call()[1] if doc.kind == "python" else doc.data
    return read(fields, doc.source, version)
