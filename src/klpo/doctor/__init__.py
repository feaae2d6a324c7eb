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

from klpo.doctor import klpo_config, openrlhf, trl, verl
from klpo.doctor.reading import DoctorError, Reading, load_mapping, read_text
from klpo.doctor.report import diagnosis, render

__all__ = ["FRAMEWORKS", "DoctorError", "detect", "diagnose", "read", "render"]

FRAMEWORKS: tuple[str, ...] = ("verl", "trl-grpo", "trl-rloo", "openrlhf", "klpo")

_TEXT_SUFFIXES = (".sh", ".txt", ".args", ".cmd", "")


def detect(path: Path) -> str:
    """The framework a config file belongs to, from its contents."""
    text = read_text(path)
    if path.suffix in _TEXT_SUFFIXES:
        if "openrlhf.cli" in text or "--init_kl_coef" in text or "--algo.kl." in text:
            return "openrlhf"
        if "verl.trainer" in text or "actor_rollout_ref." in text or "algorithm." in text:
            return "verl"
    data = load_mapping(path)
    keys = set(data)
    flat = " ".join(keys)
    if "actor_rollout_ref" in keys or "algorithm" in keys or "actor_rollout_ref." in flat:
        return "verl"
    if isinstance(data.get("kl"), dict) or isinstance(data.get("algo"), dict):
        return "klpo"
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


def read(
    path: str | Path,
    framework: str | None = None,
    version: str | None = None,
    variables: dict[str, str] | None = None,
) -> Reading:
    """Read a config file into a :class:`~klpo.doctor.reading.Reading`.

    ``variables`` gives values to names a launch script uses but does not define (its
    environment, ``$1``): ``klpo doctor --var NAME=VALUE``.
    """
    p = Path(path)
    if not p.exists():
        raise DoctorError(f"config file {str(p)!r} does not exist")
    fw = framework or detect(p)
    if fw not in FRAMEWORKS:
        raise DoctorError(f"unknown framework {fw!r}; choose one of: {', '.join(FRAMEWORKS)}")
    src = str(path)
    if fw == "openrlhf":
        return openrlhf.read_script(read_text(p), src, version, variables)
    if fw == "verl":
        if p.suffix in _TEXT_SUFFIXES:
            data, script = verl.overrides(read_text(p), src, variables)
            return verl.read(data, src, version, script)
        return verl.read(load_mapping(p), src, version)
    data = load_mapping(p)
    if fw == "trl-grpo":
        return trl.read_grpo(data, src, version)
    if fw == "trl-rloo":
        return trl.read_rloo(data, src, version)
    return klpo_config.read(data, src, version)


def diagnose(
    path: str | Path,
    framework: str | None = None,
    version: str | None = None,
    variables: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole diagnosis of a config file as JSON-ready data (``klpo doctor --json``)."""
    return diagnosis(read(path, framework, version, variables))
