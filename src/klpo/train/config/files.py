"""Reading a config: YAML files and ``--set`` overrides into a :class:`TrainConfig`, the errors
that name each key, and the resolved config written back."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from klpo.train.config.common import ConfigError
from klpo.train.config.train import TrainConfig
from klpo.train.spellings import FOREIGN_KEYS


def _allowed_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _section_model(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = TrainConfig
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *get_args(ann)]
        for c in candidates:
            inner = get_args(c) or (c,)
            for i in inner:
                if isinstance(i, type) and issubclass(i, BaseModel):
                    model = i
                    break
            else:
                continue
            break
        else:
            return None
    return model


def key_paths(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every key of the config as ``section.key`` (sub-sections' keys too: ``model.lora.r``;
    a list of sections as ``rewards[].name``)."""
    out = []
    for name, f in model.model_fields.items():
        out.append(f"{prefix}{name}")
        for sub, listed in _sub_models(f.annotation):
            out += key_paths(sub, f"{prefix}{name}[]." if listed else f"{prefix}{name}.")
    return list(dict.fromkeys(out))


def _sub_models(annotation: Any, listed: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The sections inside a key's type (through ``| None`` and ``list[...]``), each with
    whether it sits in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, listed)]
    inner = listed or get_origin(annotation) is list
    return [m for arg in get_args(annotation) for m in _sub_models(arg, inner)]


def _guess_key(loc: tuple[str | int, ...], allowed: list[str]) -> str | None:
    """What an unknown key was meant to be: TRL's or verl's name for a klpo key
    (:data:`FOREIGN_KEYS`: ``num_generations``: ``rollout.group_size``), the same name in
    another section (``lr`` or ``kl.lr``: ``optim.lr``), else a close name in its own section
    (``kl.betta``: ``beta``), else a close full path (``optim.lerning_rate``...)."""
    name = str(loc[-1])
    if name in FOREIGN_KEYS:
        return FOREIGN_KEYS[name][0]
    paths = [p for p in key_paths() if "[]" not in p]
    elsewhere = [p for p in paths if p.rsplit(".", 1)[-1] == name and "." in p]
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(name, allowed, n=1)
    if close:
        return close[0]
    dotted = ".".join(str(p) for p in loc if not isinstance(p, int))
    tails = {p.rsplit(".", 1)[-1]: p for p in paths if "." in p}
    near = difflib.get_close_matches(name, list(tails), n=1, cutoff=0.8)
    return tails[near[0]] if near and tails[near[0]] != dotted else None


def format_errors(err: ValidationError, source_of: Callable[..., str | None] | None = None) -> str:
    """One line per error, naming the key; ``source_of(loc, msg)``, if given, says which file or
    ``--set`` gave the key (:mod:`klpo.train.config_files`)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        src = source_of(loc, e["msg"]) if source_of is not None else None
        if src and loc and e["type"] != "extra_forbidden":
            key = f"{key} (from {src})"
        if e["type"] == "extra_forbidden":
            parent = _section_model(loc[:-1])
            allowed = _allowed_keys(parent) if parent else []
            guess = _guess_key(loc, allowed)
            whose = FOREIGN_KEYS.get(str(loc[-1]), (None, None))[1]
            hint = f" (did you mean {guess!r}?)" if guess else ""
            hint = f" (did you mean {guess!r}? {loc[-1]} is {whose}'s name)" if whose else hint
            where = ".".join(str(p) for p in loc[:-1]) or "the top level"
            given = f" in {src}" if src else ""
            lines.append(
                f"unknown key {key!r}{given}{hint}; allowed keys in {where}: {', '.join(allowed)}"
            )
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            lines.append(f"{key}: got {e.get('input')!r}; allowed: {expected}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            given = e.get("input")
            shown = "" if isinstance(given, dict | list) else f" (got {given!r})"
            lines.append(f"{key}: {msg}{shown}" if loc else msg + (f" ({src})" if src else ""))
    return "bad config:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=c"`` → (["a", "b"], value); the value is parsed as YAML (numbers, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. kl.beta=0.02")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b=c`` into the nested dict ``data`` (creating sections as needed)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {p!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def build_config(
    data: dict[str, Any] | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """Validate a nested dict (plus overrides) into a :class:`TrainConfig`, or raise ConfigError."""
    merged = apply_overrides(dict(data or {}), list(overrides or []))
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(format_errors(err)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a mapping naming one key twice.

    The YAML spec requires the keys of a mapping to be unique (YAML 1.2, section 3.2.1.1); PyYAML
    keeps the last value silently, so a config with two ``kl:`` sections would lose the first.
    """


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" merges, and may override
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, Hashable):
            continue  # construct_mapping says why such a key cannot be
        if key in first:
            raise DuplicateKeyError(key, first[key], line)
        first[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names the same key twice (lines ``first`` and ``again``)."""

    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"{key!r} appears twice, at lines {first} and {again}")
        self.key, self.first, self.again = key, first, again


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML, refusing a key given twice in one mapping (ConfigError naming
    ``source``, the key and both lines); other YAML errors propagate."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except RecursionError:
        raise ConfigError(
            f"{source}: nested too deeply for a config (PyYAML's parser recurses once per "
            "level and ran out of stack); a config is a few levels of sections and keys, so "
            "check the file is the one meant"
        ) from None
    except DuplicateKeyError as err:
        raise ConfigError(
            f"{source}: {err.key!r} appears twice in one mapping, at lines {err.first} and "
            f"{err.again}; YAML keeps only the last, so the first would be silently dropped. "
            f"Merge them into one {err.key!r}"
        ) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds (``{}`` for an empty file), or a
    ConfigError naming the file: missing, not UTF-8, not YAML, a key twice, not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = load_yaml(p.read_text(encoding="utf-8"), f"config file {str(p)!r}")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
            f"at offset {exc.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides.
    Several files, merged in order: :func:`klpo.train.config_files.load_configs`."""
    return build_config(read_config_file(path) if path is not None else {}, overrides)


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML, sections in their natural order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flat(cfg: TrainConfig) -> dict[str, Any]:
    """The config as ``{"section.key": value}`` (lists and mappings kept whole)."""
    out: dict[str, Any] = {}
    for section, values in cfg.model_dump(mode="json").items():
        if isinstance(values, dict):
            for k, v in values.items():
                out[f"{section}.{k}"] = v
        else:
            out[section] = values
    return out
