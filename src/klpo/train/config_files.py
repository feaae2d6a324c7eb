"""Several config files merged in order, and where each key of the result came from.

``klpo train -c configs/grpo-lora.yaml -c my-data.yaml --set kl.beta=0.02`` reads the defaults,
then each file in the order given, then each ``--set``; a later one wins. Files merge section
by section and key by key: a mapping merges into the mapping it lands on (``model: {dtype:
float32}`` in the second file changes one key of the first file's ``model`` and keeps its
``lora``), as ``--set model.dtype=float32`` would; any other value (a number, a string, ``null``,
a list such as ``rewards``) replaces what was there, whole. ``--set`` then applies exactly as it
does on one file (:func:`klpo.train.config.apply_overrides`).

Every key that a file or ``--set`` gave is recorded with its source (:class:`Layered`), so that
``klpo train --print-config`` can say where each value came from (:func:`annotated_yaml`: a
YAML comment after each value that a file or ``--set`` gave; the output still loads as a
config), and a bad key is reported with the file that holds it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from klpo.train.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    parse_override,
    read_config_file,
)
from klpo.train.config.files import format_errors

__all__ = ["DEFAULT", "SET", "Layered", "Sources", "annotated_yaml", "load_configs", "merge_layer"]

DEFAULT = "default"
SET = "--set"

KeyPath = tuple[str, ...]


@dataclass
class Sources:
    """Where the keys of a merged config came from.

    ``given``: a value given whole (a leaf, a list, ``null``, a mapping set by ``--set``) at a
    key path, with its source; ``opened``: an optional section (``model.lora``) that a source
    turned on by giving keys of it, with that source.
    """

    given: dict[KeyPath, str] = field(default_factory=dict)
    opened: dict[KeyPath, str] = field(default_factory=dict)

    def forget(self, path: KeyPath) -> None:
        """Drop every record at ``path`` and under it (a source replaced it whole)."""
        for table in (self.given, self.opened):
            for key in [k for k in table if k[: len(path)] == path]:
                del table[key]

    def of_value(self, path: KeyPath) -> str | None:
        """The source of the value at ``path``: its own record, or the nearest enclosing value
        given whole (an item of a list, a key of a mapping set by ``--set``); None: default."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.given:
                return self.given[path[:n]]
        return None

    def of_section(self, path: KeyPath) -> str | None:
        """The source that turned the section at ``path`` on or set it whole; None: neither."""
        return self.opened.get(path) or self.of_value(path)

    def of_error(self, loc: Sequence[str | int]) -> str | None:
        """The source of a key a validation error names: its value, its section, or (for an
        unknown section) the source of any key under it."""
        path = tuple(str(p) for p in loc if not isinstance(p, int))
        found = self.of_section(path)
        if found is None:
            under = [s for k, s in {**self.opened, **self.given}.items() if k[: len(path)] == path]
            found = under[-1] if under and path else None
        return found


@dataclass(frozen=True)
class Layered:
    """A config merged from layers: the result, the sources in order, and each key's source."""

    config: TrainConfig
    layers: tuple[str, ...]  # the files, in order, then "--set" if any was given
    sources: Sources

    def order(self) -> str:
        """The layers in the order they apply: ``the defaults, then a.yaml, then --set``."""
        return ", then ".join(["the defaults", *self.layers])

    def source(self, key: str) -> str:
        """The source of a key ``section.key`` (``model.lora.r``): a file, ``--set``, or
        ``default``."""
        path = tuple(key.split("."))
        return self.sources.of_value(path) or self.sources.opened.get(path) or DEFAULT


def _default_at(defaults: Any, key: str) -> Any:
    return defaults.get(key) if isinstance(defaults, dict) else None


def merge_layer(
    data: dict[str, Any],
    layer: dict[str, Any],
    label: str,
    sources: Sources,
    *,
    defaults: Any = None,
    prefix: KeyPath = (),
) -> None:
    """Merge ``layer`` (one file's mapping) into ``data`` in place, later wins: a mapping into
    the mapping at its key, anything else replacing what was there; record each key's source
    (``label``) in ``sources``. ``defaults``: the default config's values at ``prefix`` (an
    optional section, None there, that ``layer`` gives keys of is recorded as opened)."""
    for key, value in layer.items():
        path = (*prefix, str(key))
        here = data.get(key)
        if isinstance(value, dict):
            if not value and not here:  # an empty mapping given: its own value
                sources.given[path] = label
            elif value:
                sources.given.pop(path, None)
            if not isinstance(here, dict):
                sources.forget(path)
                data[key] = here = {}
                if not isinstance(_default_at(defaults, key), dict):
                    sources.opened[path] = label
            merge_layer(
                here, value, label, sources, defaults=_default_at(defaults, key), prefix=path
            )
            continue
        sources.forget(path)
        data[key] = copy.deepcopy(value)
        sources.given[path] = label


def _apply_set(data: dict[str, Any], text: str, sources: Sources, defaults: dict[str, Any]) -> None:
    """One ``--set`` applied as :func:`klpo.train.config.apply_overrides` applies it, its key
    recorded (and any optional section it opens on the way)."""
    parts, _ = parse_override(text)
    node: Any = data
    here_default: Any = defaults
    opened = []
    for i, p in enumerate(parts[:-1]):
        child = node.get(p) if isinstance(node, dict) else None
        here_default = _default_at(here_default, p)
        if here_default is not None and not isinstance(here_default, dict | list):
            key = ".".join(parts[: i + 1])
            raise ConfigError(
                f"--set {text!r}: {key} is one value (default {here_default!r}), not a section "
                f"with keys, so {'.'.join(parts)} would make it a mapping; set it as "
                f"{key}=VALUE, e.g. {key}={here_default!r}"
            )
        if not isinstance(child, dict):  # a new section is made here
            sources.given.pop(tuple(parts[: i + 1]), None)
            if not isinstance(here_default, dict):
                opened.append(tuple(parts[: i + 1]))
        node = child
    apply_overrides(data, [text])
    path = tuple(parts)
    sources.forget(path)
    sources.given[path] = SET
    for p in opened:
        sources.opened[p] = SET


def _error_source(sources: Sources):
    """``source_of(loc, msg)`` for :func:`klpo.train.config.format_errors`: the file or ``--set``
    of the key an error names; for an error of the whole config, the sources of the keys its
    message names (``rollout.group_size from b.yaml``)."""

    def source_of(loc: Sequence[str | int], msg: str) -> str | None:
        if loc:
            return sources.of_error(loc)
        named = dict.fromkeys(re.findall(r"\b[a-z_]+(?:\.[a-z_]+)+\b", msg))
        found = [f"{k} from {s}" for k in named if (s := sources.of_value(tuple(k.split("."))))]
        return "; ".join(found) or None

    return source_of


def load_configs(paths: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> Layered:
    """The defaults, then each YAML file of ``paths`` in order, then each ``--set`` of
    ``overrides``, merged (later wins; mappings merge key by key) and validated.

    Raises:
        ConfigError: a file that cannot be read (naming it), a bad ``--set``, or a bad config;
            with more than one source (files, ``--set``), each error that names a key says
            which gave it.
    """
    defaults = TrainConfig().model_dump(mode="json")
    data: dict[str, Any] = {}
    sources = Sources()
    for path in paths:
        merge_layer(data, read_config_file(path), str(path), sources, defaults=defaults)
    for text in overrides:
        _apply_set(data, text, sources, defaults)
    layers = tuple(str(p) for p in paths) + ((SET,) if overrides else ())
    try:
        cfg = TrainConfig.model_validate(data)
    except ValidationError as err:  # the source named where there is more than one
        source_of = _error_source(sources) if len(layers) > 1 else None
        raise ConfigError(format_errors(err, source_of)) from None
    return Layered(cfg, layers, sources)


class _OneLineDumper(yaml.SafeDumper):
    """PyYAML's safe dumper with every string on one line (a string that holds a line break
    double-quoted, the break escaped), so that a comment can follow it."""


def _one_line_str(dumper: yaml.SafeDumper, s: str) -> yaml.ScalarNode:
    style = '"' if any(c in s for c in "\n\r\x85\u2028\u2029") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_OneLineDumper.add_representer(str, _one_line_str)


def _value_lines(key: str, value: Any) -> list[str]:
    text = yaml.dump(
        {key: value},
        Dumper=_OneLineDumper,
        sort_keys=False,
        allow_unicode=True,
        width=float("inf"),
    )
    return text.splitlines()


def annotated_yaml(layered: Layered) -> str:
    """The resolved config as YAML, each value that a file or ``--set`` gave followed by a
    comment naming it (``# configs/grpo-lora.yaml``); a value with no comment is the default.
    Two header lines say the order of the layers. The text loads back as the same config."""
    rows: list[tuple[str, str | None]] = []
    src = layered.sources

    def emit(node: dict[str, Any], path: KeyPath, depth: int) -> None:
        pad = "  " * depth
        for key, value in node.items():
            here = (*path, key)
            if isinstance(value, dict) and value:
                rows.append((f"{pad}{key}:", src.of_section(here)))
                emit(value, here, depth + 1)
                continue
            first, *rest = _value_lines(key, value)
            rows.append((pad + first, src.of_value(here) or src.opened.get(here)))
            rows.extend((pad + line, None) for line in rest)

    emit(layered.config.model_dump(mode="json"), (), 0)
    width = min(max(len(text) for text, s in rows if s) if any(s for _, s in rows) else 0, 60)
    lines = [
        f"# klpo train config: {layered.order()} (a later one wins)"
        if layered.layers
        else "# klpo train config: the defaults (no --config, no --set)",
        "# a value a file or --set gave names it after '#'; a value without a comment is the default",
    ]
    for text, source in rows:
        lines.append(f"{text:<{width}}  # {source}" if source else text)
    return "\n".join(lines) + "\n"
