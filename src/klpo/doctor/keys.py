r"""A framework's key policy applied to a file's keys: refused, or accepted and read by nobody.

Each framework does one of three things with a key its version does not have
(:class:`klpo.doctor.frameworks.KeyPolicy`): refuses it and does not start (``strict``, and
Hydra's ``struct`` mode), or keeps it without a word while nothing reads it (``lenient``), so
the default of the key the user meant stays in force. Either way only the doctor can name the
typo: :func:`check_keys` does, with the nearest key of that version (:func:`nearest`), against
the version's key table (:mod:`klpo.doctor.tables`, written from the framework's own source).
"""

from __future__ import annotations

from typing import Any

from klpo.doctor.reading import Reading, known_key, nearest

__all__ = ["check_keys", "settle", "unknown_key_text"]


def unknown_key_text(
    key: str, near: str | None, framework: str, version: str, policy: Any, default: Any = None
) -> tuple[str, str]:
    """``(level, text)`` of the finding for an unknown ``key`` under ``policy``."""
    did = f" (did you mean {near}?)" if near else ""
    where = f" ({policy.how}; {policy.where})" if policy.where else f" ({policy.how})"
    if policy.refuses:
        text = (
            f"{key}: no such key in {framework} {version}{did}; {framework} refuses it and does "
            f"not start{where}"
        )
        if near:
            text += f"; the doctor read {near} as the file leaves it"
        return "error", text
    text = (
        f"{key}: no such key in {framework} {version}{did}; {framework} accepts it without a "
        f"word and nothing reads it{where}"
    )
    if near:
        text += f", so {near} keeps the value {default!r} the file leaves it"
    return "warning", text


def check_keys(
    r: Reading,
    values: dict[str, Any],
    table: dict[str, Any],
    framework: str,
    version: str,
    policy: Any,
    *,
    checked: tuple[str, ...] | None = None,
    labels: dict[str, str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings of ``values`` whose keys ``table`` has; a finding for each other key.

    Args:
        values: the file's settings, flattened to dotted keys.
        table: every key of the framework version (dotted, a value ``{}`` or None marks an
            open mapping that takes any key under it).
        framework, version: named in the findings.
        policy: the row's :class:`~klpo.doctor.frameworks.KeyPolicy`.
        checked: only keys under these prefixes are checked (the sections the table covers);
            the others are kept as they are.
        labels: how the file spells a key (a flag's ``--name``), for the findings.
        defaults: the values in force where the file leaves a key out (for the lenient text).
    """
    labels = labels or {}
    kept: dict[str, Any] = {}
    for key, value in values.items():
        covered = checked is None or any(key == c or key.startswith(c + ".") for c in checked)
        if not covered or known_key(key, table):
            kept[key] = value
            continue
        pool = [k for k in table if checked is None or any(k.startswith(c) for c in checked)]
        near = nearest(key, pool)
        default = (defaults or table).get(near) if near else None
        level, text = unknown_key_text(
            labels.get(key, key),
            labels.get(near, near) if near else None,
            framework,
            version,
            policy,
            default,
        )
        keys = [labels.get(key, key)] + ([labels.get(near, near)] if near else [])
        r.warn(level, keys, text, kind="unknown-key")
    return kept


def settle(
    r: Reading, read: dict[str, Any] | set[str], labels: dict[str, str] | None = None
) -> None:
    """Grade the lenient unknown-key findings once the reader is done: a warning where the key
    meant (the nearest real one) is a setting the reading used (``read``: the
    :attr:`~klpo.doctor.reading.Settings.read` keys), a note otherwise (a silently dropped key
    that changes nothing the doctor reports)."""
    from dataclasses import replace

    spelled = {labels.get(k, k) for k in read} if labels else set(read)
    for i, f in enumerate(r.findings):
        if f.kind == "unknown-key" and f.level == "warning":
            near = f.keys[1] if len(f.keys) > 1 else None
            if near not in spelled:
                r.findings[i] = replace(f, level="note")
