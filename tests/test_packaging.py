"""klpo's installs: layers of requirements that match the layers of its code (docs/install.md).

- ``pip install klpo`` (typer, rich, pydantic, PyYAML): the doctor and the command line;
- ``pip install 'klpo[torch]'``: the library, with torch (a floor, never a pin) and numpy;
- ``pip install 'klpo[train]'``: the trainer, the lab's plots and the studies.

The first tests read ``pyproject.toml`` and run klpo's own modules in subprocesses (what a
module imports, what a command says without its extra). The ``slow`` ones build the wheel,
install it into a clean virtual environment from the package registry (no editable install, no
torch) and run its entry points, and ask pip's resolver, reading only the registry's metadata,
whether the extras resolve beside the exact torch a vLLM release pins without replacing it; they
are skipped, saying so, where the registry cannot be reached.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from klpo import _extras

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
FIXTURES = ROOT / "tests" / "doctor" / "fixtures"

#: Every module the two extras bring: none may load in the light layers.
EXTRA_MODULES = frozenset(row.module for row in _extras.PROVIDES)
#: What the trainer's stack alone brings (the library's imports must avoid these).
TRAIN_MODULES = frozenset(row.module for row in _extras.PROVIDES if row.extra == "train")

#: Upper bounds in klpo's requirements, each with the break that justifies it (none today). A
#: bound added to pyproject.toml must be added here with its reason, or the floors test fails.
KNOWN_BREAKS: dict[str, str] = {}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]


def _run(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -c code args`` with this tree's klpo first on the path."""
    full_env = {**os.environ, "PYTHONPATH": str(SRC), **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=full_env
    )


# ---------------------------------------------------------------------------------------------
# pyproject.toml: the layers, floors, one version.


def test_extras_table_lists_exactly_pyprojects_extras():
    """klpo._extras.PROVIDES (read by the messages and the checks) and pyproject's extras are one
    fact: each extra's distributions, ``train`` including ``torch``."""
    extras = PROJECT["optional-dependencies"]
    for extra in ("torch", "train"):
        declared = {_name(r) for r in extras[extra] if not r.startswith("klpo[")}
        table = {row.distribution for row in _extras.PROVIDES if row.extra == extra}
        assert declared == table, extra
    assert "klpo[torch]" in extras["train"] and "klpo[train]" in extras["dev"]
    light = {_name(r) for r in PROJECT["dependencies"]}
    assert light == {"typer", "rich", "pydantic", "PyYAML", "tomli"}
    assert not light & {row.distribution for row in _extras.PROVIDES}


def test_requirements_are_floors():
    """Every requirement is a lower bound: exact versions live in constraints.txt only."""
    groups = {"dependencies": PROJECT["dependencies"], **PROJECT["optional-dependencies"]}
    for group, requirements in groups.items():
        for req in requirements:
            spec = req.split(";")[0]
            if spec.startswith("klpo["):
                continue
            ops = re.findall(r"(===|==|~=|!=|<=|>=|<|>)", spec)
            assert ops, f"{group}: {req!r} has no floor"
            others = [op for op in ops if op != ">="]
            assert not others or _name(req) in KNOWN_BREAKS, (
                f"{group}: {req!r} is not a floor; an upper bound needs a known break, named in a "
                "comment beside it and in KNOWN_BREAKS here"
            )
    pins = (ROOT / "constraints.txt").read_text(encoding="utf-8")
    assert re.search(r"^torch==\d", pins, re.M), "constraints.txt keeps the tested torch"


def test_version_lives_in_klpo_init_only():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "klpo.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", importlib.import_module("klpo").__version__)


def test_console_scripts_exist():
    scripts = PROJECT["scripts"]
    assert scripts == {"klpo": "klpo.cli:main", "klpo-doctor": "klpo.cli:doctor_main"}
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr))


# ---------------------------------------------------------------------------------------------
# What each layer imports.


def test_library_loads_none_of_the_trainers_stack():
    code = (
        "import sys, klpo.kl, klpo.losses, klpo.logprobs, klpo.advantages, klpo.reduce, "
        "klpo.control, klpo.offpolicy, klpo.heads\n"
        f"print(sorted({{m.partition('.')[0] for m in sys.modules}} & {set(TRAIN_MODULES)!r}))"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_import_klpo_loads_no_torch():
    out = _run("import sys, klpo; print('torch' in sys.modules, klpo.__version__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "False"


_HIDE = (
    "import sys\n"
    "for name in sys.argv[1].split(','):\n"
    "    sys.modules[name] = None  # `import name` now fails as if it were not installed\n"
)


@pytest.mark.parametrize("module", ["klpo.kl", "klpo.losses", "klpo.logprobs", "klpo.advantages"])
def test_library_without_torch_names_the_install(module):
    code = _HIDE + (
        f"try:\n    import {module}\n"
        "except ImportError as err:\n    print(type(err).__name__, err.name, sep='\\n')\n"
        "    print(err)\n"
    )
    out = _run(code, "torch")
    assert out.returncode == 0, out.stderr
    kind, name, message = out.stdout.split("\n", 2)
    assert (kind, name) == ("MissingExtra", "torch")
    # the klpo module that imports torch is named (klpo.kl's is klpo.estimators, its face's first)
    assert message.startswith("klpo.") and " needs torch, " in message
    assert "pip install 'klpo[torch]'" in message


def test_a_missing_trainer_package_names_the_train_install():
    """torch present, transformers not: a trainer module names klpo[train], not klpo[torch]."""
    code = _HIDE + (
        "try:\n    import klpo.train.rollout.samplers\nexcept ImportError as err:\n    print(err)\n"
    )
    out = _run(code, "transformers")
    assert out.returncode == 0, out.stderr
    assert "needs transformers" in out.stdout and "pip install 'klpo[train]'" in out.stdout


def test_an_unrelated_missing_module_is_left_alone():
    code = _HIDE + (
        "import klpo\ntry:\n    import klpo.integrations.trl\n"
        "except ImportError as err:\n    print(type(err).__name__, '|', err)\n"
    )
    out = _run(code, "trl")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError |") and "klpo[" not in out.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["train"],
        ["train", "--print-config"],
        ["export", "runs/x", "--out", "y"],
        ["compare", "--quick"],
        ["make-reference"],
        ["make-reward-model", "x"],
        ["lab", "report", "--out", "x"],
        ["doctor", "--model", "m", str(FIXTURES / "trl_rloo.yaml")],
    ],
    ids=lambda argv: " ".join(argv[:2]),
)
def test_trainer_commands_without_the_stack_say_what_to_install(argv):
    code = _HIDE + "from klpo.cli import main\nmain(sys.argv[2:])\n"
    out = _run(code, "transformers,peft", *argv)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "transformers" in out.stderr and "pip install 'klpo[train]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_library_command_without_torch_is_one_line_not_a_traceback():
    code = _HIDE + "from klpo.cli import main\nmain(sys.argv[2:])\n"
    out = _run(code, "torch", "lab", "categorical", "--pi", "0.7,0.3", "--ref", "0.5,0.5")
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stderr.startswith("error: ") and "pip install 'klpo[torch]'" in out.stderr
    assert "Traceback" not in out.stderr


def _imported(*argv: str) -> set[str]:
    """Top-level modules ``python -X importtime -m klpo ARGV`` imports (stderr's table)."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "klpo", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"},
    )
    assert "import time:" in out.stderr, out.stderr[-2000:]
    names = set()
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().partition(".")[0])
    return names


def test_help_imports_nothing_an_extra_brings():
    assert not _imported("--help") & EXTRA_MODULES


@pytest.mark.parametrize(
    "config",
    [
        FIXTURES / "verl_grpo.yaml",
        FIXTURES / "trl_grpo.yaml",
        FIXTURES / "field" / "slime" / "run-qwen3-4B.sh",
        ROOT / "configs" / "grpo.yaml",
        FIXTURES / "field" / "verl" / "run_qwen3_8b_megatron.sh",
        FIXTURES / "field" / "trl" / "distillation.sh",
        FIXTURES / "field" / "nemo_rl" / "distillation_math.yaml",
    ],
    ids=["verl", "trl", "slime", "klpo", "verl-opd", "trl-distillation", "nemo-rl-distillation"],
)
def test_doctor_imports_nothing_an_extra_brings(config):
    """``klpo doctor FILE`` runs in the light install: it imports no torch, numpy, transformers
    or any other module of the extras (wall time is not asserted here)."""
    assert config.is_file()
    loaded = _imported("doctor", "--fail-on", "never", str(config)) & EXTRA_MODULES
    assert not loaded, f"klpo doctor imported {sorted(loaded)}"


# ---------------------------------------------------------------------------------------------
# The wheel, installed from the registry into clean environments (slow; needs the registry).


def _outside_env() -> dict[str, str]:
    """This process's environment without PYTHONPATH: pip and the installed commands must see
    the clean environment only, not this tree's klpo (nor its egg-info) on the path."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(python: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_outside_env(),
    )


def _fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def _registry_or_skip(python: Path) -> None:
    """Skip, naming why, when pip cannot read the package registry's metadata."""
    probe = _pip(
        python,
        *("install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet"),
        *("--retries", "1", "--timeout", "20", "PyYAML"),
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"the package registry cannot be reached from here (pip: {last})")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """klpo's wheel, built by pip from this tree (setuptools from the registry, isolated)."""
    root = tmp_path_factory.mktemp("wheel")
    python = _fresh_venv(root / "venv")
    _registry_or_skip(python)
    tree = root / "tree"  # a copy: pip builds in the tree it is given
    shutil.copytree(SRC, tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    out = _pip(python, "wheel", "--no-deps", "--quiet", "-w", str(root / "dist"), str(tree))
    assert out.returncode == 0, out.stderr[-3000:]
    (built,) = (root / "dist").glob("klpo-*.whl")
    return built


@pytest.fixture(scope="module")
def light(wheel, tmp_path_factory) -> Path:
    """A clean virtual environment with ``pip install klpo`` (the wheel; nothing editable)."""
    python = _fresh_venv(tmp_path_factory.mktemp("light") / "venv")
    out = _pip(python, "install", "--quiet", str(wheel))
    assert out.returncode == 0, out.stderr[-3000:]
    return python.parent


def _installed(bin_dir: Path) -> dict[str, str]:
    out = _pip(bin_dir / "python", "list", "--format", "json")
    return {row["name"].lower(): row["version"] for row in json.loads(out.stdout)}


def _clean_run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """A command in the installed environment, away from this tree (no PYTHONPATH)."""
    return subprocess.run(
        cmd, capture_output=True, text=True, env=_outside_env(), cwd=ROOT / "tests", **kwargs
    )


@pytest.mark.slow
def test_wheel_holds_the_package_and_its_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {
        p.relative_to(SRC).as_posix()
        for p in (SRC / "klpo").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert tree <= names, sorted(tree - names)[:10]
    assert {"klpo/assets/reference/model.safetensors", "klpo/py.typed"} <= names
    assert any(n.startswith("klpo/assets/doctor/verl-") for n in names)
    version = importlib.import_module("klpo").__version__
    assert wheel.name.startswith(f"klpo-{version}-")
    meta = zipfile.ZipFile(wheel).read(f"klpo-{version}.dist-info/METADATA").decode()
    unconditional = [
        line
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert not [
        line for line in unconditional if re.search(r"\b(torch|transformers|numpy)\b", line)
    ]
    entry_points = zipfile.ZipFile(wheel).read(f"klpo-{version}.dist-info/entry_points.txt")
    assert b"klpo-doctor = klpo.cli:doctor_main" in entry_points


@pytest.mark.slow
def test_light_install_brings_no_torch_and_runs_the_command_line(light):
    installed = _installed(light)
    assert "klpo" in installed
    assert not set(installed) & {row.distribution.lower() for row in _extras.PROVIDES}
    version = importlib.import_module("klpo").__version__
    out = _clean_run([str(light / "klpo"), "--version"])
    assert out.returncode == 0 and out.stdout.strip() == f"klpo {version}", out.stderr
    out = _clean_run([str(light / "klpo"), "--help"])
    assert out.returncode == 0 and "doctor" in out.stdout, out.stderr
    out = _clean_run([str(light / "klpo-doctor"), "--help"])
    assert out.returncode == 0 and "Usage: klpo doctor" in out.stdout, out.stderr
    out = _clean_run([str(light / "python"), "-c", "import klpo.kl"])
    assert out.returncode == 1 and "pip install 'klpo[torch]'" in out.stderr
    out = _clean_run([str(light / "klpo"), "train"])
    assert out.returncode == 1 and "pip install 'klpo[train]'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script", [["klpo", "doctor"], ["klpo-doctor"]], ids=" ".join)
def test_light_install_runs_the_doctor(light, script):
    """The doctor as a CI gate installs without torch and reads a verl, a TRL, a slime and a
    klpo config."""
    configs = [
        FIXTURES / "verl_grpo.yaml",
        FIXTURES / "trl_rloo.yaml",
        FIXTURES / "field" / "slime" / "run-qwen3-4B.sh",
        ROOT / "configs" / "grpo.yaml",
    ]
    cmd = [str(light / script[0]), *script[1:], "--fail-on", "never", "--format", "json"]
    out = _clean_run([*cmd, *map(str, configs)])
    assert out.returncode == 0, out.stderr[-3000:]
    reports = json.loads(out.stdout)
    assert [r["framework"].split("-")[0] for r in reports] == ["verl", "trl", "slime", "klpo"]


def _stub_torch(python: Path, version: str) -> None:
    """Make the environment hold torch ``version`` as pip sees it: its metadata (a
    ``torch-VERSION.dist-info``), the only thing pip's resolver reads of an installed package.
    The several-GB wheel itself is not needed to ask whether pip would replace it."""
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=_outside_env(),
    ).stdout.strip()
    info = Path(site) / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


# torch 2.6.0 (klpo's floor) is what vLLM 0.8.0 pins, 2.10.0 what vLLM 0.19.1 pins
# (vllm-project/vllm-ascend#9225; vllm#34224 shows a vLLM pulling torch back a version).
@pytest.mark.slow
@pytest.mark.parametrize("torch_version", ["2.6.0", "2.10.0"])
def test_extras_resolve_beside_a_vllm_torch_and_keep_it(wheel, tmp_path, torch_version):
    """``pip install 'klpo[train]'`` (which includes ``klpo[torch]``) into an environment that
    holds the exact torch a vLLM release pins: pip's resolver, reading only the registry's
    metadata (``--dry-run --report``), installs no torch, so the environment's stays."""
    python = _fresh_venv(tmp_path / "venv")
    _stub_torch(python, torch_version)
    report = tmp_path / "report.json"
    out = _pip(
        python,
        *("install", "--dry-run", "--quiet", "--report", str(report)),
        f"{wheel}[train]",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    planned = {
        row["metadata"]["name"].lower(): row["metadata"]["version"]
        for row in json.loads(report.read_text())["install"]
    }
    assert "torch" not in planned, f"pip would replace torch {torch_version}: {planned['torch']}"
    assert {"klpo", "numpy", "transformers", "peft"} <= set(planned)


# ---------------------------------------------------------------------------------------------
# The bridges' tested versions: one fact, in the module and in docs/frameworks.md's matrix.


@pytest.mark.parametrize(
    ("module", "framework"), [("trl", "TRL"), ("verl", "verl")], ids=["trl", "verl"]
)
def test_bridges_tested_versions_are_the_documented_matrix(module, framework):
    """Read without importing the bridge (it imports its framework, absent here)."""
    import ast

    source = (SRC / "klpo" / "integrations" / f"{module}.py").read_text(encoding="utf-8")
    versions = next(
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "TESTED_VERSIONS"
    )
    assert len(versions) >= 2
    docs = (ROOT / "docs" / "frameworks.md").read_text(encoding="utf-8")
    (row,) = [
        line for line in docs.splitlines() if line.startswith(f"| `klpo.integrations.{module}`")
    ]
    tested = row.split("|")[2]
    for version in versions:
        assert f"{version}" in tested, (module, version, tested)
    assert framework in tested
