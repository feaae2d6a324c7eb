r"""``klpo doctor``: what a training framework's KL settings really do, and the klpo config for it.

Reads one configuration of verl (its Hydra YAML, or a launch script running ``main_ppo`` with
``key=value`` overrides), TRL (``GRPOConfig`` / ``RLOOConfig`` fields as YAML or JSON), OpenRLHF (a
launch script running ``train_ppo_ray``) or klpo itself; scripts are read as bash reads them
(:mod:`klpo.doctor.shell`). It fills in the framework's own defaults for the version, from tables
read from the frameworks themselves (:mod:`klpo.doctor.tables`: verl 0.9.1, TRL 1.16.0, OpenRLHF
0.8.11 to 0.11.2), names every key the version does not have, and says, per KL term in effect: the
klpo estimator and placement it is, what value it logs and which gradient it follows on- and
off-policy (:func:`klpo.kl.explain`), where clamps zero that gradient, which settings are ignored or
applied twice, how a group normalisation rescales a KL in the reward, and two klpo configs: the one
that does the same thing and the one that does what the settings most likely meant.

    from klpo.doctor import diagnose, render
    print(render(diagnose("verl_grpo.yaml")))

:mod:`klpo.doctor.measure` adds measurements on the user's own model pair (``--model``).

The doctor sits above the library (it reads files and prints); nothing in ``klpo/*.py`` imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from klpo.doctor import areal, klpo_config, nemo_rl, openrlhf, prime_rl, skyrl, slime, trl, verl
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    duplicate_keys,
    load_mapping,
    read_text,
)
from klpo.doctor.report import diagnosis, render

__all__ = ["FRAMEWORKS", "DoctorError", "detect", "diagnose", "read", "render"]

FRAMEWORKS: tuple[str, ...] = (
    "verl",
    "trl-grpo",
    "trl-rloo",
    "openrlhf",
    "klpo",
    "nemo-rl",
    "slime",
    "skyrl",
    "prime-rl",
    "areal",
    "unsloth",
)

_TEXT_SUFFIXES = (".sh", ".txt", ".args", ".cmd", ".bash", "")


def _script(text: str, path: Path, variables: dict[str, str] | None = None):
    from klpo.doctor.shell import read_script

    try:
        return read_script(text, variables)
    except ValueError as err:
        raise DoctorError(f"{path}: {err}") from None


def _detect_script(text: str, path: Path) -> str:
    """A launch script's framework: its training command's entry point (comments and
    here-documents never count), else the flags its commands carry."""
    from klpo.doctor.launch import entry_point

    script = _script(text, path)
    try:
        ep = entry_point(script)
    except DoctorError as err:
        raise DoctorError(f"{path}: {err}") from None
    if ep is not None:
        return ep.framework
    words = [w for c in script.commands for w in c.words]
    if any(w.startswith(("--init_kl_coef", "--algo.kl.", "--kl_estimator")) for w in words):
        return "openrlhf"
    if any(w.startswith(("actor_rollout_ref.", "algorithm.")) and "=" in w for w in words):
        return "verl"
    raise DoctorError(
        f"{path}: no training command the doctor knows (verl.trainer.main_ppo, "
        "openrlhf.cli.train_ppo_ray, `trl grpo|rloo`, a launcher around one of them) and no "
        f"framework flags in its commands; name it with --framework ({', '.join(FRAMEWORKS)})"
    )


def detect_mapping(data: dict[str, Any], path: Path) -> str:
    """The framework a YAML/JSON mapping of settings belongs to, from its keys."""
    keys = set(data)
    flat = " ".join(keys)
    if "loss_fn" in keys and keys & {"grpo", "policy", "defaults", "ppo"}:
        return "nemo-rl"
    if "loss_fn" not in keys and "defaults" in keys and isinstance(data["defaults"], str):
        return "nemo-rl"  # a NeMo-RL child config: its parent holds loss_fn
    actor = data.get("actor")
    if isinstance(actor, dict) and ("gconfig" in keys or "kl_ctl" in actor):
        return "areal"
    if "actor_rollout_ref" in keys or "algorithm" in keys or "actor_rollout_ref." in flat:
        return "verl"
    if isinstance(data.get("kl"), dict) or isinstance(data.get("algo"), dict):
        return "klpo"
    ppo_only = {"kl_coef", "vf_coef", "cliprange_value", "num_ppo_epochs", "whiten_rewards"}
    if len(keys & ppo_only) >= 1 and not keys & {"num_generations", "loss_type"}:
        raise DoctorError(
            f"{path}: a TRL PPOConfig ({', '.join(sorted(keys & ppo_only))}): the doctor reads "
            "TRL's GRPOConfig and RLOOConfig only, and does not read a PPO config as either"
        )
    grpo_only = {
        "loss_type",
        "use_bias_correction_kl",
        "scale_rewards",
        "importance_sampling_level",
    }
    if keys & grpo_only:
        return "trl-grpo"
    if "normalize_advantages" in keys:
        return "trl-rloo"
    if keys & {"beta", "num_generations", "num_iterations", "output_dir"}:
        return "trl-grpo"
    raise DoctorError(
        f"{path}: cannot tell which framework this config is for (no verl section such as "
        "`algorithm` or `actor_rollout_ref`, no TRL field such as `beta` or `loss_type`, no klpo "
        f"`kl` section, no OpenRLHF flag); name it with --framework ({', '.join(FRAMEWORKS)})"
    )


def detect(path: Path) -> str:
    """The framework a config file belongs to, from its contents."""
    path = Path(path)
    text = read_text(path)
    if path.suffix in _TEXT_SUFFIXES:
        return _detect_script(text, path)
    if path.suffix == ".toml":
        return "prime-rl"
    if path.suffix == ".py":
        from klpo.doctor.pyscript import config_call

        cls, _, unsloth, _ = config_call(text, str(path))
        return "unsloth" if unsloth else "trl-grpo" if cls == "GRPOConfig" else "trl-rloo"
    data = load_mapping(path)
    if isinstance(data.get("run"), str):
        return _detect_script(data["run"], path)
    return detect_mapping(data, path)


def _refuse_duplicates(path: Path, text: str, framework: str) -> list[tuple[str, int, int]]:
    """Duplicate keys: refused where the framework's loader refuses them (OmegaConf: verl, and
    klpo's own), returned (for a warning) where it keeps the last (TRL's PyYAML / json)."""
    dups = duplicate_keys(text, is_json=path.suffix == ".json")
    if dups and not framework.startswith("trl"):
        key, first, again = dups[0]
        where = f" (lines {first} and {again})" if first else ""
        raise DoctorError(
            f"{path}: the key {key} is given twice{where}; {framework}'s loader refuses a "
            "duplicated key (OmegaConf: 'duplicate key'), and the doctor does not pick one; "
            "keep one of them"
        )
    return dups


def read(
    path: str | Path,
    framework: str | None = None,
    version: str | None = None,
    variables: dict[str, str] | None = None,
) -> Reading:
    """Read a config file into a :class:`~klpo.doctor.reading.Reading`.

    ``variables`` gives values to names a launch script uses but does not define (its
    environment, ``$1``): ``klpo doctor --var NAME=VALUE``. A SkyPilot task file is read as its
    ``run:`` script, with its ``envs:`` as the variables.
    """
    p = Path(path)
    if not p.exists():
        raise DoctorError(f"config file {str(p)!r} does not exist")
    src = str(path)
    text = read_text(p)
    data = None
    if p.suffix in (".toml", ".py"):
        return _read_other(p, text, src, framework, version)
    if p.suffix not in _TEXT_SUFFIXES:
        data = load_mapping(p)
        if isinstance(data.get("run"), str):
            # A SkyPilot task: the command sits under `run:`, its variables under `envs:`.
            envs = {k: "" if v is None else str(v) for k, v in (data.get("envs") or {}).items()}
            text, data = data["run"], None
            variables = {**envs, **(variables or {})}
            src = f"{path} (its run: script)"
    fw = framework or (detect_mapping(data, p) if data is not None else _detect_script(text, p))
    if fw not in FRAMEWORKS:
        raise DoctorError(f"unknown framework {fw!r}; choose one of: {', '.join(FRAMEWORKS)}")
    if data is None:
        return _read_script(fw, text, src, p, version, variables)
    dups = _refuse_duplicates(p, text, fw)
    if fw == "nemo-rl":
        return nemo_rl.read(nemo_rl.load(p), src, version)
    if fw == "areal":
        return areal.read(data, src, version)
    if fw == "prime-rl":
        return prime_rl.read(data, src, version)
    if fw in ("slime", "skyrl"):
        raise DoctorError(
            f"{src}: {fw} is read from its launch script (the training command's flags or "
            "overrides), not from a YAML/JSON mapping; give the script"
        )
    if fw == "verl":
        r = verl.read(data, src, version, near=p)
    elif fw in ("trl-grpo", "unsloth"):
        r = trl.read_grpo(data, src, version, unsloth=fw == "unsloth")
    elif fw == "trl-rloo":
        r = trl.read_rloo(data, src, version)
    else:
        r = klpo_config.read(data, src, version)
    for key, first, again in dups:
        r.warn(
            "warning",
            [key],
            f"{key} is given twice"
            + (f" (lines {first} and {again})" if first else "")
            + ": TRL's parser (PyYAML / json) keeps the last value without a word; the doctor "
            "read the last one; keep one of them",
        )
    return r


def _read_other(
    p: Path, text: str, src: str, framework: str | None, version: str | None
) -> Reading:
    """prime-rl's TOML, and a Python script's GRPOConfig(...) call (TRL, or Unsloth's TRL)."""
    if p.suffix == ".toml":
        if framework not in (None, "prime-rl"):
            raise DoctorError(f"{src}: a TOML config; the doctor reads TOML as prime-rl's only")
        return prime_rl.read(prime_rl.load(p), src, version)
    from klpo.doctor.pyscript import config_call

    cls, kwargs, unsloth, _ = config_call(text, src)
    if framework == "unsloth" or (framework is None and unsloth):
        if cls != "GRPOConfig":
            raise DoctorError(f"{src}: Unsloth patches TRL's GRPO; the doctor reads its GRPOConfig")
        return trl.read_grpo(kwargs, src, version, unsloth=True)
    if cls == "RLOOConfig":
        return trl.read_rloo(kwargs, src, version)
    return trl.read_grpo(kwargs, src, version)


def _read_script(
    fw: str,
    text: str,
    src: str,
    path: Path,
    version: str | None,
    variables: dict[str, str] | None,
) -> Reading:
    """A launch script (or a SkyPilot task's ``run:``), read by its training command's reader."""
    if fw == "openrlhf":
        return openrlhf.read_script(text, src, version, variables)
    if fw == "verl":
        data, script = verl.overrides(text, src, variables)
        return verl.read(data, src, version, script, near=path)
    if fw in ("trl-grpo", "trl-rloo"):
        return trl.read_cli(text, src, path, version, variables)
    if fw in ("nemo-rl", "areal"):
        from klpo.doctor.launch import config_and_overrides, entry_point

        ep = entry_point(_script(text, path, variables))
        if ep is None or ep.framework != fw:
            raise DoctorError(f"{src}: no {fw} training command with --config found")
        cfg, over = config_and_overrides(ep, path, src)
        if fw == "nemo-rl":
            return nemo_rl.read(nemo_rl._merge(nemo_rl.load(cfg), over), src, version)
        return areal.read(nemo_rl._merge(load_mapping(cfg), over), src, version)
    if fw == "slime":
        return slime.read_script_text(text, src, version, variables)
    if fw == "skyrl":
        return skyrl.read_script_text(text, src, version, variables)
    raise DoctorError(
        f"{src}: a {fw} config, not a launch script; give the {fw} config file itself"
    )


def diagnose(
    path: str | Path,
    framework: str | None = None,
    version: str | None = None,
    variables: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole diagnosis of a config file as JSON-ready data (``klpo doctor --json``)."""
    return diagnosis(read(path, framework, version, variables))
