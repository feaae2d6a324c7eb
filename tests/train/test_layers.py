"""The package's rooms import downward only, with no circle anywhere (docs/architecture.md).

Every ``klpo`` import of every module of ``src/klpo`` (at the top or inside a function, absolute
or relative) is read from its source. Each must name a room at or below its own in
:data:`LAYERS`; inside the library (the room ``klpo``) each module imports only modules before
it in :data:`LIBRARY`; and no modules anywhere import each other in a circle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS = (
    "klpo",  # the library (kl, logprobs, advantages, losses, reduce, control, ...): LIBRARY
    "klpo.lab",
    "klpo.train",  # the trainer's package: its docstring only
    "klpo.train.runtime",
    "klpo.train.algorithms",  # the tables' traits, no torch (their functions: algorithm_fns)
    "klpo.train.algorithm_fns",
    "klpo.train.spellings",
    "klpo.train.choices",  # the rollout's tables, whose names the config takes
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
    "klpo.integrations",
    "klpo.measure",  # the estimator lab on a user's models (klpo doctor --model)
    "klpo.doctor",
    "klpo.cli",
    "klpo.__main__",
)
"""The rooms, lowest first (docs/architecture.md draws them)."""

LIBRARY = (
    "klpo._extras",  # which install brings which package: what a missing one's error names
    "klpo",  # the package: its names, the submodules imported on first use
    "klpo._threads",
    "klpo._names",
    "klpo._lazy",
    "klpo.registry",  # the estimators' traits and the library's names, no torch
    "klpo._io",
    "klpo._tensor",
    "klpo._ratios",
    "klpo.control",
    "klpo.gemm",
    "klpo._logits",
    "klpo.fused_kernel",
    "klpo.fused_loss_kernel",
    "klpo.heads",
    "klpo.logprobs",
    "klpo.vocab_parallel",
    "klpo.teacher_kernel",
    "klpo.estimators",
    "klpo.explain",
    "klpo.kl",
    "klpo.teacher",
    "klpo.ref_kl",
    "klpo.reduce",
    "klpo.mismatch",
    "klpo.loss_metrics",
    "klpo.losses",
    "klpo.trust_region",
    "klpo.offpolicy",
    "klpo.advantages",
)
"""The library's modules, lowest first: each imports only modules before it (docs/architecture.md,
"The library's order")."""

CLI = (
    "klpo.cli.common",  # what the commands share: help's notation, console, errors as exit codes
    "klpo.cli.explain",
    "klpo.cli.lab",
    "klpo.cli.train",
    "klpo.cli.tools",  # export, docs, make-reference, make-reward-model
    "klpo.cli.compare",
    "klpo.cli.doctor",
    "klpo.cli.probe",
    "klpo.cli",  # the app, built from the modules above; the console scripts' entry points
    "klpo.cli.__main__",
)
"""The command line's modules, lowest first: a command group's module imports only
``klpo.cli.common`` of its room, and the package builds the app from the groups
(docs/architecture.md, "The command line's order")."""


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package under ``src``: its name and its file."""
    return {_module_name(p, src): p for p in sorted((src / "klpo").rglob("*.py"))}


def _imports(path: Path, known: set[str], module: str | None = None) -> set[str]:
    """The ``klpo`` modules ``path`` imports anywhere in it (``from klpo.train import loop`` names
    the module; a relative import is resolved from ``module``, the file's own name)."""
    out = set()
    package = None
    if module is not None:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("klpo")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target != "klpo" and not target.startswith("klpo."):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
    return out


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of the room holding ``module`` (the longest prefix)."""
    best = max((r for r in LAYERS if module == r or module.startswith(r + ".")), key=len)
    return LAYERS.index(best)


def _graph(src: Path = SRC) -> dict[str, set[str]]:
    mods = _modules(src)
    return {m: _imports(p, set(mods), m) - {m} for m, p in mods.items()}


@functools.cache
def _package_graph() -> dict[str, set[str]]:
    """:func:`_graph` of ``src/klpo``, read once."""
    return _graph(SRC)


def test_every_module_of_the_package_is_read():
    mods = set(_modules())
    for m in (
        "klpo.logprobs",
        "klpo.heads",
        "klpo.lab.exact",
        "klpo.doctor.frameworks.verl",
        "klpo.cli",
        "klpo.cli.doctor",
    ):
        assert m in mods
    assert {"klpo.train.loop", "klpo.study.runner", "klpo.integrations.trl"} <= mods


def test_every_import_goes_down_or_across():
    upward = [
        f"{m} ({LAYERS[layer(m)]}) imports {t} ({LAYERS[layer(t)]})"
        for m, targets in _package_graph().items()
        for t in sorted(targets)
        if layer(t) > layer(m)
    ]
    assert not upward, "\n".join(upward)


def test_the_library_imports_in_its_order():
    graph = _package_graph()
    library = sorted(m for m in graph if LAYERS[layer(m)] == "klpo")
    unplaced = [m for m in library if m not in LIBRARY]
    assert not unplaced, (
        f"library modules without a place in LIBRARY (tests/train/test_layers.py) and in "
        f"docs/architecture.md's drawing of the library: {unplaced}"
    )
    assert set(LIBRARY) <= set(graph), (
        f"LIBRARY names modules that are gone: {set(LIBRARY) - set(graph)}"
    )
    wrong = [
        f"{m} imports {t}, which LIBRARY places above it"
        for m in library
        for t in sorted(graph[m])
        if LAYERS[layer(t)] == "klpo" and LIBRARY.index(t) >= LIBRARY.index(m)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_command_line_imports_in_its_order():
    graph = _package_graph()
    room = sorted(m for m in graph if LAYERS[layer(m)] == "klpo.cli")
    assert room == sorted(CLI), (
        f"modules of klpo.cli not in CLI (tests/train/test_layers.py) and docs/architecture.md: "
        f"{sorted(set(room) - set(CLI))}; named there but gone: {sorted(set(CLI) - set(room))}"
    )
    wrong = [
        f"{m} imports {t}, which CLI places above it"
        for m in room
        for t in sorted(graph[m])
        if LAYERS[layer(t)] == "klpo.cli" and CLI.index(t) >= CLI.index(m)
    ]
    assert not wrong, "\n".join(wrong)
    # The command groups stand beside each other: none imports another.
    groups = set(CLI[1:-2])
    assert not [(m, t) for m in groups for t in graph[m] if t in groups]


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


def test_no_import_circles_anywhere_in_the_package():
    cycle = find_cycle(_package_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize(
    ("module", "room"),
    [
        ("klpo.kl", "klpo"),
        ("klpo.fused_kernel", "klpo"),
        ("klpo.lab.exact", "klpo.lab"),
        ("klpo.train.step.update", "klpo.train.step"),
        ("klpo.train.loop", "klpo.train.loop"),
        ("klpo.study.runner", "klpo.study"),
        ("klpo.doctor.frameworks.verl", "klpo.doctor"),
        ("klpo.cli", "klpo.cli"),
        ("klpo.cli.compare", "klpo.cli"),
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
    assert layer("klpo.doctor.frameworks.verl") > layer("klpo.train.loop") > layer("klpo.lab.exact")
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    """The circle the library once had: ``heads`` imported ``logprobs`` at the top while
    ``logprobs.model_logprobs`` imported ``heads`` inside the function; and a relative import."""
    pkg = tmp_path / "klpo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heads.py").write_text("from klpo.logprobs import fused\n")
    (pkg / "logprobs.py").write_text(
        "def fused():\n    pass\n\n\ndef model_logprobs():\n    from klpo import heads\n"
    )
    graph = _graph(tmp_path)
    assert graph["klpo.logprobs"] == {"klpo.heads"}
    assert find_cycle(graph) == ["klpo.heads", "klpo.logprobs", "klpo.heads"]
    (pkg / "logprobs.py").write_text("def model_logprobs():\n    from . import heads\n")
    assert find_cycle(_graph(tmp_path)) == ["klpo.heads", "klpo.logprobs", "klpo.heads"]
    (pkg / "logprobs.py").write_text("def model_logprobs():\n    return 0\n")
    assert find_cycle(_graph(tmp_path)) is None
