r"""verl's settings composed by Hydra itself, from the YAML files verl ships.

verl's ``main_ppo`` is a Hydra program (``@hydra.main(config_path="config",
config_name="ppo_trainer")``): its settings are ``verl/trainer/config/ppo_trainer.yaml`` and the
files its ``defaults`` list pulls in, then the command line's ``key=value`` overrides. Where
verl's config folder is on this machine, the doctor runs that same composition with hydra-core's
compose API (``initialize_config_dir`` / ``compose``), without running or importing verl:

- the folder is the one of the verl checkout the file read sits in (the frameworks' examples run
  from the checkout's root, so ``python3 -m verl.trainer.main_ppo`` imports that checkout), else
  the installed verl's (found with :func:`importlib.util.find_spec`, which does not import it);
- ``--config-name`` is composed as named (``ppo_megatron_trainer``, a user's config);
  ``--config-path`` as Hydra takes it: an absolute folder as is, a relative one from the folder
  of ``main_ppo.py`` (``verl/trainer``), else from the checkout's root; a config of the user's
  own whose ``defaults`` list names ``ppo_trainer`` finds it through Hydra's search path, which
  the doctor points at verl's folder;
- Hydra parses every override and applies its rules (``+key`` adds a key and refuses one that
  exists, ``++key`` adds or sets, ``~key`` deletes, any other key must exist), and interpolations
  are resolved against the overridden config.

Without hydra-core (``pip install 'klpo[doctor]'``) or without verl's files, the doctor reads the
table of verl 0.9.1's composed config (:mod:`klpo.doctor.tables`), and the reading says which.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klpo.doctor.reading import flatten

__all__ = [
    "Composition",
    "VerlFiles",
    "compose",
    "find_verl",
    "have_hydra",
    "hydra_override",
    "ppo_base",
    "settings",
]

_PPO = "ppo_trainer"


def have_hydra() -> bool:
    """Whether hydra-core is importable (``klpo[doctor]``)."""
    return importlib.util.find_spec("hydra") is not None


@dataclass(frozen=True)
class VerlFiles:
    """verl's own config folder on this machine."""

    config_dir: Path  # verl/trainer/config
    version: str
    where: str  # "the verl checkout at ..." / "the installed verl at ..."

    @property
    def root(self) -> Path:
        """The checkout's root (the folder above ``verl/``): the examples' working directory."""
        return self.config_dir.parents[2]


def _version_of(config_dir: Path) -> str:
    version_file = config_dir.parents[1] / "version" / "version"
    if version_file.is_file():
        return version_file.read_text().strip()
    try:
        from importlib.metadata import version

        return version("verl")
    except Exception:  # a checkout without its version file, no distribution installed
        return "unknown"


def find_verl(near: Path | None) -> VerlFiles | None:
    """verl's config folder: the checkout ``near`` sits in, else the installed verl's, else None."""
    if near is not None:
        start = Path(near).resolve()
        for folder in [start.parent, *start.parent.parents]:
            cand = folder / "verl" / "trainer" / "config"
            if (cand / f"{_PPO}.yaml").is_file():
                return VerlFiles(
                    cand.resolve(), _version_of(cand), f"the verl checkout at {folder}"
                )
    try:
        spec = importlib.util.find_spec("verl")
    except (ImportError, ValueError):
        spec = None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        cand = Path(loc) / "trainer" / "config"
        if (cand / f"{_PPO}.yaml").is_file():
            return VerlFiles(
                cand.resolve(), _version_of(cand), f"the installed verl at {Path(loc)}"
            )
    return None


def hydra_override(key: str, value: Any) -> str:
    """``key=value`` in Hydra's override grammar, for a value read from a YAML mapping."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value).replace("\\", "\\\\").replace("'", "\\'")
    return f"'{text}'"


@dataclass
class Composition:
    """One composed verl config, flattened to dotted keys.

    Attributes:
        config: every key with its value, interpolations resolved where Hydra can outside a run.
        base: the named config without the overrides (what "the default" means for a key).
        name: the config composed (``ppo_trainer``, ``ppo_megatron_trainer``, a user's).
        files: where verl's files came from.
        refused: Hydra's own message where it refuses the overrides, else None.
    """

    config: dict[str, Any]
    base: dict[str, Any]
    name: str
    files: VerlFiles
    primary: Path
    refused: str | None = None
    own: dict[str, Any] = field(default_factory=dict)  # a user's config's own settings
    groups: tuple[str, ...] = ()  # config-group choices composed into base and config

    @property
    def described(self) -> str:
        where = (
            "verl's"
            if self.primary == self.files.config_dir.resolve()
            else f"{self.primary / self.name}.yaml over verl's"
        )
        return (
            f"{self.name} composed by Hydra from {where} config files "
            f"(verl {self.files.version}, {self.files.where})"
        )


def _searchpath(primary: Path, name: str, files: VerlFiles) -> list[str]:
    """Hydra's search path for a primary config outside verl's folder: verl's folder first (a
    ``pkg://verl.trainer.config`` or ``file://verl/trainer/config`` entry means it), then the
    config's other ``file://`` entries, relative ones from the checkout's root."""
    import yaml

    out = [f"file://{files.config_dir}"]
    try:
        own = yaml.safe_load((primary / f"{name}.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        own = {}
    entries = (own.get("hydra") or {}).get("searchpath") or [] if isinstance(own, dict) else []
    for entry in entries:
        text = str(entry)
        if text == "pkg://verl.trainer.config" or text.rstrip("/").endswith("verl/trainer/config"):
            continue
        if text.startswith("file://") and not Path(text[7:]).is_absolute():
            text = f"file://{files.root / text[7:]}"
        out.append(text)
    return out


def _flat(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(cfg, resolve=False)
    out: dict[str, Any] = {}
    for key, value in flatten(raw).items():
        try:
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True)
        except Exception:  # an interpolation Hydra cannot resolve outside a run: its text
            pass
        out[key] = value
    # Empty mappings (open sections such as `+data.extra`) stay keys of their own.
    for key, value in _empty_sections(raw).items():
        out.setdefault(key, value)
    return out


def _empty_sections(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            if not value:
                out[f"{prefix}{key}"] = {}
            else:
                out.update(_empty_sections(value, f"{prefix}{key}."))
    return out


@functools.lru_cache(maxsize=32)
def _composed(
    primary: str, name: str, overrides: tuple[str, ...], searchpath: tuple[str, ...]
) -> dict[str, Any]:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    extra = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []
    with initialize_config_dir(config_dir=primary, version_base=None):
        cfg = hydra_compose(config_name=name, overrides=[*extra, *overrides])
    return _flat(cfg)


def _message(err: Exception) -> str:
    return " ".join(str(err).split())


def compose(
    files: VerlFiles,
    name: str = _PPO,
    overrides: list[str] | tuple[str, ...] = (),
    primary: Path | None = None,
    groups: tuple[str, ...] = (),
) -> Composition:
    """verl's config ``name`` (from ``primary``, verl's folder by default) composed by Hydra,
    without and with ``overrides``; ``groups`` (``model_engine=megatron``: choices of the
    defaults list) are part of both, since they decide which keys there are.

    Raises:
        ValueError: Hydra cannot compose the named config itself (a missing file, a ``defaults``
            entry it cannot find), with Hydra's message.
    """
    primary = Path(primary or files.config_dir).resolve()
    name = name.removesuffix(".yaml")
    search = (
        () if primary == files.config_dir.resolve() else tuple(_searchpath(primary, name, files))
    )
    try:
        base = _composed(str(primary), name, tuple(groups), search)
    except Exception as err:
        raise ValueError(_message(err)) from None
    refused = None
    config = base
    if overrides:
        try:
            config = _composed(str(primary), name, (*groups, *overrides), search)
        except Exception as err:
            refused = _message(err)
    return Composition(config, base, name, files, primary, refused, groups=tuple(groups))


def ppo_base(files: VerlFiles) -> dict[str, Any]:
    """verl's own ``ppo_trainer`` config, composed without overrides."""
    return _composed(str(files.config_dir.resolve()), _PPO, (), ())


def settings(comp: Composition, given: list[str], ppo: dict[str, Any]) -> tuple[dict, dict]:
    """``(values, defaults)`` for :class:`~klpo.doctor.reading.Settings` from a composition.

    ``given`` are the keys the file sets (its overrides, or a user's config's own keys): their
    values are the composed config's, as Hydra parsed them. Every other key's default is the
    composed config's too, so an interpolation reads the file's values (``rollout_n`` follows
    ``rollout.n``); a given key's default is the named config's without the overrides, or
    verl's ``ppo_trainer``'s (``ppo``) for a user's own config, so "set to something other than
    the default" keeps its meaning.
    """
    config = comp.config if comp.refused is None else comp.base
    own = comp.primary != comp.files.config_dir.resolve()
    if own:  # the user's config's own settings are the file's too
        given = [*given, *(k for k in own_keys(comp) if k in config and k not in given)]
    values = {k: config[k] for k in given if k in config}
    reference = ppo if own else comp.base
    defaults = {**config, **{k: reference[k] for k in given if k in reference}}
    for k in given:
        if k not in reference:
            defaults.pop(k, None)
    return values, defaults


def own_keys(comp: Composition) -> list[str]:
    """The dotted keys a user's primary config file sets itself (not ``defaults``, ``hydra``)."""
    import yaml

    try:
        data = yaml.safe_load((comp.primary / f"{comp.name}.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    data = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    return list(flatten(data))
