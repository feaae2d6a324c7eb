"""The torch-free layer: the estimators' traits, the algorithm tables and the config's schema
import no torch (and no other heavy stack), so that ``klpo doctor`` and the config read them in a
light install (docs/architecture.md).

Two checks: the modules' import statements at module level, followed through klpo's own modules
(what a change would break first, with the path that brings the import in), and a fresh
interpreter's ``sys.modules`` after importing them (what actually happens)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

TORCH_FREE = (
    "klpo",
    "klpo._lazy",
    "klpo._names",
    "klpo.registry",
    "klpo.control",
    "klpo.train.algorithms",
    "klpo.train.config",
    "klpo.doctor",
    "klpo.doctor.command",
    "klpo.doctor.report",
    "klpo.doctor.advice",
    "klpo.doctor.frameworks",
    "klpo.doctor.distill",
    "klpo.doctor.verl_distill",
    "klpo.doctor.nemo_rl_distill",
    "klpo.doctor.trl_config",
    "klpo.doctor.frameworks.trl_distill",
)
"""Modules that must import without torch."""

HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "datasets",
    "peft",
    "safetensors",
    "tensorboard",
    "matplotlib",
)


def _path(module: str) -> Path:
    base = SRC.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _module_level_imports(module: str) -> set[str]:
    """Modules imported at module level by ``module`` (not inside functions or TYPE_CHECKING)."""
    tree = ast.parse(_path(module).read_text(encoding="utf-8"))
    out: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                out.add(node.module)
                out.update(
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if _path(f"{node.module}.{a.name}").exists() and node.module.startswith("klpo")
                )
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    return out


def _reaches(module: str) -> dict[str, list[str]]:
    """Every module ``module`` imports at load, directly or through klpo's modules: its path."""
    paths: dict[str, list[str]] = {module: [module]}
    todo = [module]
    while todo:
        m = todo.pop()
        for t in sorted(_module_level_imports(m)):
            parents = [".".join(t.split(".")[:i]) for i in range(1, t.count(".") + 1)]
            for name in [*parents, t]:
                if name not in paths:
                    paths[name] = [*paths[m], name]
                    if name.startswith("klpo") and _path(name).exists():
                        todo.append(name)
    return paths


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_level_imports_bring_no_heavy_stack(module: str) -> None:
    reached = _reaches(module)
    heavy = {m: p for m, p in reached.items() if m.split(".")[0] in HEAVY}
    assert not heavy, "\n".join(" -> ".join(p) for p in heavy.values())


def test_the_check_follows_klpos_modules_to_torch() -> None:
    """The check has power: the face of the estimators reaches torch through its modules."""
    path = _reaches("klpo.kl")["torch"]
    assert path[0] == "klpo.kl" and path[-1] == "torch" and len(path) >= 3


def test_a_fresh_interpreter_loads_none_of_the_heavy_stack() -> None:
    code = (
        "import sys\n"
        f"import {', '.join(TORCH_FREE)}\n"
        "from klpo.train.config import build_config\n"
        "cfg = build_config(overrides=['kl.estimator=k3', 'kl.placement=loss'])\n"
        "from klpo.registry import SPECS, explanation\n"
        "assert explanation('k3', 'loss').gradient == 'grad KL(pi_ref ‖ pi_theta)'\n"
        "from klpo.registry import teacher_positions\n"
        "assert teacher_positions('k3')['near']['gradient'] == 'KL(pi_T ‖ pi_theta)'\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
