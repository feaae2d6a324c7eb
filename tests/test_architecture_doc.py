"""docs/architecture.md names every module of ``src/klpo``, and each of its tables keeps the order
of the imports.

The page's module tables (rows ``| `klpo.x.y` | what it holds |``, one table per folder, highest
first) are read from the page; every module of ``src/klpo/**/*.py`` must be a row and every row a
module. In each table a module imports only the modules of the table below it (the imports read
by ``tests/train/test_layers.py``, inside functions too), the library's and the command line's
tables are that test's ``LIBRARY`` and ``CLI`` drawn highest first, and every ``klpo.…`` name the
page mentions anywhere is a module or a name a module defines.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
SRC = ROOT / "src"

_ROW = re.compile(r"^\| `(klpo(?:\.\w+)*)` \|")
_HEADING = re.compile(r"^#{2,3} ")
_NAME = re.compile(r"(?<![\w./-])klpo(?:\.\w+)+")


def _layers():
    """tests/train/test_layers.py, imported by path (the test folders are not packages)."""
    spec = importlib.util.spec_from_file_location(
        "_klpo_test_layers", ROOT / "tests" / "train" / "test_layers.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAYERS = _layers()


def tables(text: str) -> dict[str, list[str]]:
    """The page's module tables: the heading above each, and its rows' modules in order."""
    out: dict[str, list[str]] = {}
    heading = ""
    for line in text.splitlines():
        if _HEADING.match(line):
            heading = line.lstrip("#").strip()
        elif m := _ROW.match(line):
            out.setdefault(heading, []).append(m.group(1))
    return out


def unnamed_and_unknown(text: str, modules: set[str]) -> tuple[list[str], list[str]]:
    """The modules no table of ``text`` names, and the rows that name no module."""
    named = [m for rows in tables(text).values() for m in rows]
    return sorted(modules - set(named)), sorted(set(named) - modules)


def out_of_order(rows: list[str], graph: dict[str, set[str]]) -> list[str]:
    """Each import, inside one table, of a module drawn at or above the importer."""
    return [
        f"{m} imports {t}, drawn above it"
        for i, m in enumerate(rows)
        for t in sorted(graph.get(m, ()))
        if t in rows and rows.index(t) <= i
    ]


@functools.cache
def _defined(module: str) -> frozenset[str]:
    """The top-level names ``module``'s source binds (definitions, assignments, imports)."""
    path = LAYERS._modules()[module]
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return frozenset(names)


def unresolved(text: str, modules: set[str]) -> list[str]:
    """The ``klpo.…`` names of ``text`` that are neither a module nor a name one defines."""
    bad = []
    for name in sorted(set(_NAME.findall(text))):
        if name in modules:
            continue
        module, _, attr = name.rpartition(".")
        if module not in modules or attr not in _defined(module):
            bad.append(name)
    return bad


def _modules() -> set[str]:
    return set(LAYERS._modules())


def test_the_page_names_every_module_and_only_modules():
    unnamed, unknown = unnamed_and_unknown(PAGE.read_text(encoding="utf-8"), _modules())
    assert not unnamed, (
        f"modules docs/architecture.md does not name (add a row to their folder's table): {unnamed}"
    )
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"


def test_each_module_is_named_once():
    named = [m for rows in tables(PAGE.read_text(encoding="utf-8")).values() for m in rows]
    assert len(named) == len(set(named)), sorted({m for m in named if named.count(m) > 1})


def test_each_table_is_drawn_in_the_order_of_its_imports():
    graph = LAYERS._package_graph()
    wrong = [
        f"{heading}: {line}"
        for heading, rows in tables(PAGE.read_text(encoding="utf-8")).items()
        for line in out_of_order(rows, graph)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_library_and_the_command_line_are_drawn_as_the_layer_test_orders_them():
    found = tables(PAGE.read_text(encoding="utf-8"))
    assert found["The library's order"] == list(reversed(LAYERS.LIBRARY))
    cli = [m for m in found["The command line's order"] if m != "klpo.__main__"]
    assert cli == list(reversed(LAYERS.CLI))


def test_every_klpo_name_on_the_page_exists():
    bad = unresolved(PAGE.read_text(encoding="utf-8"), _modules())
    assert not bad, f"docs/architecture.md names what no module of src/klpo defines: {bad}"


def test_the_checks_see_a_missing_row_an_unknown_row_a_wrong_order_and_a_bad_name():
    """The checks have teeth, on a made-up page and a made-up graph."""
    page = (
        "## The rooms\n\n| module | what |\n| --- | --- |\n"
        "| `klpo.b` | imports a |\n| `klpo.a` | |\n| `klpo.gone` | |\n\n"
        "Text naming `klpo.a.real` and `klpo.a.missing`.\n"
    )
    assert tables(page) == {"The rooms": ["klpo.b", "klpo.a", "klpo.gone"]}
    assert unnamed_and_unknown(page, {"klpo.a", "klpo.b", "klpo.c"}) == (["klpo.c"], ["klpo.gone"])
    assert out_of_order(["klpo.b", "klpo.a"], {"klpo.b": {"klpo.a"}}) == []
    assert out_of_order(["klpo.a", "klpo.b"], {"klpo.b": {"klpo.a"}}) == [
        "klpo.b imports klpo.a, drawn above it"
    ]
    # A real module and one of its names pass; a made-up name of a real module does not.
    text = "`klpo.train.loop.train_step`, `klpo.kl.SPECS`, `klpo.kl.no_such_name`, klpo.nope"
    assert unresolved(text, _modules()) == ["klpo.kl.no_such_name", "klpo.nope"]
