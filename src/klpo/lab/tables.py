"""The shipped answer tables, written from their derivations: ``python -m klpo.lab.tables``.

``klpo/assets/explain.json`` holds :func:`klpo.explain.table` (every built-in estimator and
placement, on- and off-policy) and ``klpo/assets/explain_teacher.json`` holds
:func:`klpo.lab.teacher.table` (every teacher term). Readers without torch (``klpo doctor``,
:mod:`klpo.registry`) read them; ``tests/test_registry.py`` and ``tests/lab/test_teacher.py``
regenerate them unchanged. The library derives, this module writes: the library layer writes no
files.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from klpo._io import write_text_atomic
from klpo.registry import EXPLAIN_TABLE, TEACHER_TABLE

ASSETS = Path(__file__).parents[1] / "assets"


def _explain() -> str:
    from klpo.explain import table_text

    return table_text()


def _teacher() -> str:
    from klpo.lab.teacher import table_text

    return table_text()


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "explain": (EXPLAIN_TABLE, _explain),
    "teacher": (TEACHER_TABLE, _teacher),
}


def write(name: str, directory: Path = ASSETS) -> Path:
    """Write the table ``name`` (``explain`` or ``teacher``) into ``directory``, atomically."""
    if name not in TABLES:
        raise ValueError(f"no shipped table {name!r}; the tables are {', '.join(TABLES)}")
    file, text = TABLES[name]
    path = directory / file
    write_text_atomic(path, text())
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m klpo.lab.tables [explain|teacher ...] [--out DIR]``: write the shipped tables
    (default: both, into the package's own ``klpo/assets``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    directory = ASSETS
    if "--out" in args:
        at = args.index("--out")
        if at + 1 >= len(args):
            print("--out needs a directory", file=sys.stderr)
            return 2
        directory = Path(args[at + 1])
        del args[at : at + 2]
    unknown = [a for a in args if a not in TABLES]
    if unknown:
        print(f"unknown table {unknown[0]!r}; the tables are {', '.join(TABLES)}", file=sys.stderr)
        return 2
    for name in args or list(TABLES):
        print(f"wrote {write(name, directory)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
