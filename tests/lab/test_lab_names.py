"""klpo.lab, the package: its names are its modules' own objects, and its docstring's list of
modules names every module of the folder."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import klpo.lab as lab

INIT = Path(lab.__file__)


def _imported() -> dict[str, str]:
    """Each name the package imports, and the module it comes from."""
    return {
        a.asname or a.name: node.module
        for node in ast.parse(INIT.read_text(encoding="utf-8")).body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("klpo.lab.")
        for a in node.names
    }


def test_every_public_name_is_its_modules_own_object():
    imported = _imported()
    assert set(lab.__all__) == set(imported)
    for name, module in imported.items():
        assert getattr(lab, name) is getattr(importlib.import_module(module), name), name


def test_the_docstring_names_every_module_of_the_folder():
    modules = {p.stem for p in INIT.parent.glob("*.py") if p.stem != "__init__"}
    listed = set(re.findall(r":mod:`klpo\.lab\.(\w+)`", lab.__doc__))
    assert listed == modules, {"not listed": modules - listed, "not a module": listed - modules}
