"""The trainer's rooms import downward only, with no circle (docs/architecture.md).

Every ``klpo`` import of every module of ``klpo.train`` and ``klpo.study`` (at the top or inside
a function) is read from its source; each must name a room at or below its own in
:data:`LAYERS`, and the modules of one room must not import each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS = (
    "klpo",  # the library (kl, logprobs, advantages, losses, reduce, control, ...)
    "klpo.train.runtime",
    "klpo.train.algorithms",
    "klpo.train.spellings",
    "klpo.train.rollout.choices",  # the rollout's tables, whose names the config takes
    "klpo.train.config",
    "klpo.train.config_files",
    "klpo.train.lr_schedule",
    "klpo.train.outdir",
    "klpo.train.resume",
    "klpo.train.models",
    "klpo.train.data",
    "klpo.train.rewards",
    "klpo.train.rollout",
    "klpo.train.evaluate",
    "klpo.train.step",
    "klpo.train.optimizers",
    "klpo.train.preflight",
    "klpo.train.setup",
    "klpo.train.loop",
    "klpo.train.tools",
    "klpo.study",
)
"""The rooms, lowest first (docs/architecture.md draws them)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    paths = [*(SRC / "klpo" / "train").rglob("*.py"), *(SRC / "klpo" / "study").rglob("*.py")]
    return {_module_name(p): p for p in sorted(paths)}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``klpo`` modules ``path`` imports (``from klpo.train import loop`` names the module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("klpo")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("klpo"):
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return out


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of the room holding ``module`` (the longest prefix)."""
    best = max((r for r in LAYERS if module == r or module.startswith(r + ".")), key=len)
    return LAYERS.index(best)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def test_every_import_goes_down_or_across():
    upward = [
        f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
        for m, targets in _graph().items()
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
    assert not upward, "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return [*path[path.index(t) :], t]
            if t in graph and state.get(t) is None:
                found = visit(t, [*path, t])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if state.get(m) is None:
            cycle = visit(m, [m])
            if cycle:
                return cycle
    return None


def test_no_import_circles():
    cycle = find_cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    ("module", "room"),
    [
        ("klpo.kl", "klpo"),
        ("klpo.train.step.update", "klpo.train.step"),
        ("klpo.train.loop", "klpo.train.loop"),
        ("klpo.study.runner", "klpo.study"),
    ],
)
def test_rooms_by_longest_prefix(module, room):
    assert LAYERS[layer(module)] == room


def test_the_checks_see_an_upward_import_and_a_circle(tmp_path):
    """The checks have teeth: a made-up upward import and a made-up circle are found."""
    fake = tmp_path / "m.py"
    fake.write_text("from klpo.train.loop import train\nimport klpo.study.grid\n")
    targets = _imports(fake, {"klpo.train.loop"})
    assert targets == {"klpo.train.loop", "klpo.study.grid"}
    assert layer("klpo.train.loop") > layer("klpo.train.models.load")
    assert layer("klpo.study.grid") > layer("klpo.train.loop")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
