r"""``klpo doctor``: what a training framework's KL settings really do, and the klpo config for it.

Reads one configuration of a framework in the table :mod:`klpo.doctor.frameworks` (verl, TRL,
OpenRLHF, NeMo-RL, slime, SkyRL, prime-rl, AReaL, ROLL, Unsloth, klpo itself): its YAML/JSON
settings, a launch script running its training command (read as bash reads it,
:mod:`klpo.doctor.shell`), a TOML config or a Python script's config call. Which framework a file
belongs to needs positive evidence (:func:`detect`): an entry point, a section only that
framework has, mostly its own keys; without any the answer is a named "unknown", never another
framework's reading. The reader fills in the framework's own defaults for the version, names
every key the version does not have as the framework treats it (refused, or accepted and read by
nobody), the combinations it refuses or that cancel a KL term, and says, per KL term in effect:
the klpo estimator and placement it is, what value it logs and which gradient it follows on-
and off-policy, where clamps zero that gradient, which settings are ignored or applied twice,
and two klpo configs: the one that does the same thing and the one that does what the settings
most likely meant.

    from klpo.doctor import diagnose, render
    print(render(diagnose("verl_grpo.yaml")))

``klpo doctor --model`` measures on the user's own model pair with :mod:`klpo.measure`, imported
only then.

The doctor sits above the library (it reads files and prints); nothing in ``klpo/*.py`` imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from klpo.doctor import frameworks
from klpo.doctor.document import Document, open_document
from klpo.doctor.reading import DoctorError, Reading, UnknownFramework

__all__ = [
    "FRAMEWORKS",
    "DoctorError",
    "UnknownFramework",
    "detect",
    "diagnose",
    "read",
    "render",
]


def render(diag: dict[str, Any]) -> str:
    """The diagnosis for people (:func:`klpo.doctor.report.render`)."""
    from klpo.doctor.report import render as _render

    return _render(diag)


def __getattr__(name: str) -> Any:
    if name == "FRAMEWORKS":  # the table's names, now (a registered row is one of them)
        return frameworks.names()
    raise AttributeError(name)


def _detect_script(doc: Document) -> str:
    """A launch script's framework: its training command's entry point (comments and
    here-documents never count), else the flags its commands carry."""
    ep = doc.entry()
    if ep is not None:
        return ep.framework
    import re

    words = [w for c in doc.script().commands for w in c.words]
    for row in frameworks.ROWS.values():
        if any(re.fullmatch(f, w) for f in row.flags for w in words):
            return row.name
    entries = ", ".join(
        dict.fromkeys(
            e.word.split("|")[0].replace("\\", "")
            for row in frameworks.ROWS.values()
            for e in row.entries
            if e.refuse is None
        )
    )
    raise UnknownFramework(
        f"{doc.source}: not a config of any framework this doctor reads: {doc.describe()}, "
        f"and no training command the doctor knows ({entries}, behind a launcher) nor any "
        f"framework's flags in its commands; if it is one, name it with --framework "
        f"({', '.join(frameworks.names())})",
        what=doc.describe(),
    )


def _detect_settings(doc: Document) -> str:
    """A mapping, TOML or Python file's framework: the row with the strongest positive
    evidence (a section only it has beats most keys being its own)."""
    found: list[tuple[int, str, str]] = []
    for row in frameworks.ROWS.values():
        if doc.kind not in row.kinds or row.detect is None:
            continue
        seen = row.detect(doc)
        if seen:
            strength, why = seen
            found.append((strength, row.name, why))
    if not found:
        raise UnknownFramework(
            f"{doc.source}: not a config of any framework this doctor reads: {doc.describe()}; "
            "no framework's sections or keys were recognised, and the doctor does not read it "
            f"as any of them; if it is one, name it with --framework "
            f"({', '.join(frameworks.names())})",
            what=doc.describe(),
        )
    found.sort(key=lambda x: -x[0])
    best = [f for f in found if f[0] == found[0][0]]
    if len(best) > 1:
        raise DoctorError(
            f"{doc.source}: it could be "
            + " or ".join(f"{name} ({why})" for _, name, why in best)
            + "; name it with --framework"
        )
    return found[0][1]


def _detect(doc: Document) -> str:
    return _detect_script(doc) if doc.kind == "script" else _detect_settings(doc)


def detect(path: str | Path, variables: dict[str, str] | None = None) -> str:
    """The framework a config file belongs to, from its contents."""
    return _detect(open_document(path, variables))


def _duplicates(doc: Document, row: frameworks.Framework) -> list[tuple[str, int, int]]:
    """Duplicate keys: refused where the framework's loader refuses them (OmegaConf), returned
    (for a warning) where it keeps the last (PyYAML, json)."""
    dups = doc.duplicate_keys()
    if dups and row.duplicates == "refused":
        key, first, again = dups[0]
        where = f" (lines {first} and {again})" if first else ""
        raise DoctorError(
            f"{doc.path}: the key {key} is given twice{where}; {row.name}'s loader refuses a "
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
    doc = open_document(path, variables)
    row = frameworks.get(framework or _detect(doc))
    if doc.kind not in row.kinds:
        kinds = " or ".join(sorted(row.kinds))
        raise DoctorError(
            f"{doc.source}: a {doc.kind} file; {row.name} is read from its {kinds} "
            f"(its training command's flags or overrides for a script), not from a "
            f"{doc.kind}; give the {kinds}"
        )
    dups = _duplicates(doc, row)
    r = row.read(doc, version)
    for key, first, again in dups:
        r.warn(
            "warning",
            [key],
            f"{key} is given twice"
            + (f" (lines {first} and {again})" if first else "")
            + f": {row.name}'s parser (PyYAML / json) keeps the last value without a word; the "
            "doctor read the last one; keep one of them",
        )
    return r


def diagnose(
    path: str | Path,
    framework: str | None = None,
    version: str | None = None,
    variables: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The whole diagnosis of a config file as JSON-ready data (``klpo doctor --json``)."""
    from klpo.doctor.report import diagnosis

    return diagnosis(read(path, framework, version, variables))
