r"""The frameworks' own settings and defaults, one table per version, read from the frameworks.

A table lists **every** key a framework version accepts with its default: verl's composed Hydra
config (``verl/trainer/config/ppo_trainer.yaml`` and the files its ``defaults`` list pulls in,
composed by Hydra as ``main_ppo`` does), TRL's ``GRPOConfig`` / ``RLOOConfig`` dataclass fields
(the ``TrainingArguments`` they extend included), OpenRLHF's ``train_ppo_ray`` argument parser
(read statically from the wheel's source with :mod:`ast`, since OpenRLHF does not import without
a GPU). The doctor fills what a config leaves out from these tables and names any key that is in
none of them.

The tables are data (``klpo/assets/doctor/*.json``), written by this module from the installed
framework in a side environment and never by hand::

    /path/to/verl-venv/bin/python -m klpo.doctor.tables verl
    /path/to/trl-venv/bin/python -m klpo.doctor.tables trl
    python -m klpo.doctor.tables openrlhf /path/to/unpacked/openrlhf   # any Python

``tests/doctor/test_peers.py`` (marked ``peer``) regenerates each table from the installed
framework and compares it with the shipped one, so a version bump shows every changed default.
"""

from __future__ import annotations

import ast
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TABLES",
    "TRL_KINDS",
    "Table",
    "known_versions",
    "load",
    "openrlhf_table",
    "pick",
    "trl_class",
    "trl_table",
    "verl_table",
    "version_key",
]

TABLES = Path(__file__).resolve().parents[1] / "assets" / "doctor"


@dataclass(frozen=True)
class Table:
    """One framework version's keys and defaults.

    Attributes:
        framework: ``"verl"``, ``"trl-grpo"``, ``"trl-rloo"`` or ``"openrlhf"``.
        version: the exact version read (``"0.9.1"``).
        source: how it was read.
        defaults: every key the version accepts (dotted for verl and OpenRLHF's grouped flags,
            the flag without ``--`` for OpenRLHF) with its default.
        switches: OpenRLHF's flags that take no value (``store_true`` / ``store_false``).
        choices: the values a key accepts where the framework lists them.
        cli: TRL's other keys a ``trl grpo --config`` file may hold (``ScriptArguments``,
            ``ModelConfig``), which the config dataclass does not read.
    """

    framework: str
    version: str
    source: str
    defaults: dict[str, Any]
    switches: frozenset[str] = frozenset()
    choices: dict[str, list[Any]] | None = None
    cli: dict[str, Any] | None = None

    @property
    def minor(self) -> str:
        return ".".join(self.version.split(".")[:2])


def _path(framework: str, version: str) -> Path:
    return TABLES / f"{framework}-{version}.json"


def known_versions(framework: str) -> list[str]:
    """The versions with a table, oldest first."""
    found = [p.stem.removeprefix(framework + "-") for p in TABLES.glob(f"{framework}-*.json")]
    found = [v for v in found if v[:1].isdigit()]
    return sorted(found, key=version_key)


def version_key(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def load(framework: str, version: str) -> Table:
    """The table of ``framework`` at exactly ``version``."""
    data = json.loads(_path(framework, version).read_text())
    return Table(
        framework=data["framework"],
        version=data["version"],
        source=data["source"],
        defaults=data["defaults"],
        switches=frozenset(data.get("switches", [])),
        choices=data.get("choices"),
        cli=data.get("cli"),
    )


def pick(framework: str, named: str | None, default: str) -> tuple[Table, str | None]:
    """The table for a version the user named (or ``default``), and a note when it is not exact.

    A named version with a table is used as is. Otherwise the newest table of the same minor
    version, else the newest older one, else the oldest: the note says which, so the reading
    says the defaults and semantics are another version's.
    """
    versions = known_versions(framework)
    if named is None:
        return load(framework, default), None
    if named in versions:
        return load(framework, named), None
    key = version_key(named)
    same_minor = [v for v in versions if version_key(v)[:2] == key[:2]]
    older = [v for v in versions if version_key(v) <= key]
    chosen = (same_minor or older or versions[:1])[-1]
    note = (
        f"the doctor has no table for {framework} {named}; it reads your config with "
        f"{framework} {chosen}'s settings, defaults and semantics (tables: {', '.join(versions)})"
    )
    return load(framework, chosen), note


# ---------------------------------------------------------------------------------------------
# Writing the tables from the frameworks themselves.


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(getattr(value, "value", value))


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def verl_table(config_dir: str | Path | None = None) -> dict[str, Any]:
    """Every key of verl's ``ppo_trainer`` config, composed by Hydra
    (:func:`klpo.doctor.verl_hydra.compose`), flattened: the installed verl's, or the config
    folder ``config_dir`` (``verl/trainer/config`` of a checkout or an unpacked wheel)."""
    from klpo.doctor import verl_hydra

    if config_dir is None:
        files = verl_hydra.find_verl(None)
        if files is None:
            raise RuntimeError("verl is not installed; give its config folder")
    else:
        folder = Path(config_dir).resolve()
        files = verl_hydra.VerlFiles(folder, verl_hydra._version_of(folder), str(folder))
    composed = verl_hydra.ppo_base(files)
    return {
        "framework": "verl",
        "version": files.version,
        "source": "verl/trainer/config/ppo_trainer.yaml composed by Hydra (klpo.doctor.tables)",
        "defaults": dict(sorted((k, _jsonable(v)) for k, v in composed.items())),
    }


def _fields(cls: type) -> dict[str, Any]:
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = None
        out[f.name] = _jsonable(value)
    return dict(sorted(out.items()))


TRL_KINDS = ("grpo", "rloo", "distillation", "sdpo")
"""The TRL config classes with a table: ``GRPOConfig``, ``RLOOConfig``, ``DistillationConfig``
(``trl distillation``), and the experimental ``SDPOConfig``."""


def trl_class(kind: str) -> type:
    """The installed TRL's config class of ``kind`` (:data:`TRL_KINDS`); imports TRL."""
    import trl

    if kind == "sdpo":
        from trl.experimental.sdpo import SDPOConfig

        return SDPOConfig
    return {"grpo": trl.GRPOConfig, "rloo": trl.RLOOConfig, "distillation": trl.DistillationConfig}[
        kind
    ]


def trl_table(kind: str) -> dict[str, Any]:
    """Every field of the installed TRL's config class of ``kind`` (:data:`TRL_KINDS`) with its
    default, and the ``ScriptArguments`` / ``ModelConfig`` fields a ``trl grpo --config`` file
    may hold."""
    import trl

    cls = trl_class(kind)
    cli = {**_fields(trl.ScriptArguments), **_fields(trl.ModelConfig)}
    if kind == "distillation":  # trl/scripts/distillation.py parses DatasetMixtureConfig too
        cli.update(_fields(trl.DatasetMixtureConfig))
    return {
        "framework": f"trl-{kind}",
        "version": trl.__version__,
        "source": f"trl.{cls.__name__} dataclass fields (klpo.doctor.tables)",
        "defaults": _fields(cls),
        "cli": {k: v for k, v in sorted(cli.items()) if k not in _fields(cls)},
    }


def _static(node: ast.AST, env: dict[str, Any]) -> Any:
    """Evaluate a parser argument's AST: literals, f-strings, loop names, ``a if x == y else b``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.JoinedStr):
        return "".join(str(_static(v, env)) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        return _static(node.value, env)
    if isinstance(node, ast.List | ast.Tuple):
        return [_static(e, env) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_static(node.operand, env)
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare):
        left = _static(node.test.left, env)
        right = _static(node.test.comparators[0], env)
        if isinstance(node.test.ops[0], ast.Eq | ast.NotEq):
            hit = (left == right) == isinstance(node.test.ops[0], ast.Eq)
            return _static(node.body if hit else node.orelse, env)
    if isinstance(node, ast.Name) and node.id in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[node.id]
    if isinstance(node, ast.Name | ast.Attribute):
        return ast.unparse(node)  # a type such as float / str
    raise ValueError(ast.unparse(node))


def _parser_calls(tree: ast.AST) -> list[tuple[ast.Call, dict[str, Any]]]:
    """Every ``*.add_argument(...)`` call, with the loop variables bound around it."""
    out: list[tuple[ast.Call, dict[str, Any]]] = []

    def visit(node: ast.AST, env: dict[str, Any]) -> None:
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            for item in _static(node.iter, env):
                for child in node.body:
                    visit(child, {**env, node.target.id: item})
            return
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            out.append((node, env))
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    visit(tree, {})
    return out


def openrlhf_table(root: str | Path, version: str) -> dict[str, Any]:
    """Every flag of OpenRLHF's ``train_ppo_ray`` parser, read statically from ``root``'s source.

    ``root`` is the unpacked ``openrlhf`` package (``pip download --no-deps openrlhf==X``, then
    unzip). A ``store_true`` flag's default is False unless the parser says otherwise.
    """
    path = Path(root) / "cli" / "train_ppo_ray.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    defaults: dict[str, Any] = {}
    switches: list[str] = []
    choices: dict[str, list[Any]] = {}
    for call, env in _parser_calls(tree):
        flags = [_static(a, env) for a in call.args]
        kw = {k.arg: k.value for k in call.keywords if k.arg}
        action = _static(kw["action"], env) if "action" in kw else None
        if "default" in kw:
            try:
                default = _static(kw["default"], env)
            except ValueError:  # e.g. float("inf"): kept as its source text
                default = ast.unparse(kw["default"])
        else:
            default = {"store_true": False, "store_false": True}.get(action)
        for flag in flags:
            if not isinstance(flag, str) or not flag.startswith("--"):
                continue
            name = flag[2:]
            defaults[name] = _jsonable(default)
            if action in ("store_true", "store_false"):
                switches.append(name)
            if "choices" in kw:
                choices[name] = _jsonable(_static(kw["choices"], env))
    return {
        "framework": "openrlhf",
        "version": version,
        "source": "openrlhf/cli/train_ppo_ray.py's argument parser, read with ast (klpo.doctor.tables)",
        "defaults": dict(sorted(defaults.items())),
        "switches": sorted(set(switches)),
        "choices": dict(sorted(choices.items())),
    }


# ---------------------------------------------------------------------------------------------
# Key tables read statically from a framework's source: its config classes, walked with ast.

_WRAPPERS = {"Optional", "Union", "Annotated", "NotRequired", "Required", "Final", "SerializeAsAny"}
_OPEN = {"dict", "Dict", "Mapping", "MutableMapping", "DictConfig", "Any", "object"}
_SCALARS = {"Path", "PosixPath", "Decimal", "None", "Literal", "MISSING", "ClassVar"}


def _source_classes(files: list[Path]) -> dict[str, ast.ClassDef | ast.AST]:
    """Every class defined in ``files`` by name, and every module-level type alias (``X:
    TypeAlias = A | B``, ``X = Annotated[...]``) as its annotation; a name defined twice is the
    earlier file's. Each class remembers the names of its own file (``_klpo_scope``), which
    win when its fields are resolved (two files may each define a ``ModelConfig``)."""
    out: dict[str, ast.ClassDef | ast.AST] = {}
    for f in reversed(files):
        tree = ast.parse(Path(f).read_text(), filename=str(f))
        scope: dict[str, ast.ClassDef | ast.AST] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                scope[node.name] = node
        for node in tree.body:
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.value is not None
                and "TypeAlias" in ast.unparse(node.annotation)
            ):
                scope[node.target.id] = node.value
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, ast.Subscript | ast.BinOp)
            ):
                scope[node.targets[0].id] = node.value
        for node in scope.values():
            if isinstance(node, ast.ClassDef):
                node._klpo_scope = scope  # type: ignore[attr-defined]
        out.update(scope)
    return out


def _annotation(node: ast.AST | None, classes: dict[str, Any]) -> tuple[str, list[str]]:
    """``("class", names)`` where the annotation is (an optional or a union of) known classes,
    ``("open", [])`` for a mapping that takes any key, else ``("leaf", [])``."""
    if node is None:
        return "leaf", []
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return "leaf", []
    parts: list[ast.AST] = []
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts = [node.left, node.right]
    elif isinstance(node, ast.Subscript):
        outer = (
            node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
        )
        if outer in _OPEN:
            return "open", []
        if outer not in _WRAPPERS:
            return "leaf", []
        parts = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer == "Annotated":
            parts = parts[:1]
    if parts:
        found = [_annotation(p, classes) for p in parts]
        names = [n for kind, ns in found if kind == "class" for n in ns]
        if names:
            return "class", list(dict.fromkeys(names))
        return ("open", []) if any(k == "open" for k, _ in found) else ("leaf", [])
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
    if name in _OPEN:
        return "open", []
    target = classes.get(name) if name else None
    if isinstance(target, ast.ClassDef):
        return "class", [name]
    if target is not None:  # a type alias
        return _annotation(target, {k: v for k, v in classes.items() if k != name})
    if name and name[:1].isupper() and name not in _SCALARS:
        return "open", []  # a class of another package: its keys are not checked
    return "leaf", []


def _field_default(
    value: ast.AST | None, classes: dict[str, ast.ClassDef]
) -> tuple[Any, str | None]:
    """``(default, class built by a default_factory)`` of a field's right-hand side."""
    if value is None:
        return None, None
    if isinstance(value, ast.Call):
        fname = getattr(value.func, "id", getattr(value.func, "attr", ""))
        if fname in ("field", "Field"):
            kw = {k.arg: k.value for k in value.keywords if k.arg}
            if "default_factory" in kw:
                fac = kw["default_factory"]
                if isinstance(fac, ast.Lambda):
                    fac = fac.body.func if isinstance(fac.body, ast.Call) else fac.body
                while isinstance(fac, ast.Call):
                    fac = fac.func
                name = getattr(fac, "id", getattr(fac, "attr", ""))
                if isinstance(classes.get(name), ast.ClassDef):
                    return None, name
                return ({"dict": {}, "list": [], "set": []}.get(name), None)
            given = kw.get("default", value.args[0] if value.args else None)
            return (_literal(given), None) if given is not None else (None, None)
        if isinstance(classes.get(fname), ast.ClassDef):
            return None, fname
    return _literal(value), None


def _literal(node: ast.AST) -> Any:
    try:
        return _jsonable(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return ast.unparse(node)


def class_keys(files: list[Path], root: str, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of config class ``root`` (defined in ``files``) with its default, read
    statically: ``@dataclass`` classes, pydantic models and TypedDicts, their base classes'
    fields first; a field typed as another class of ``files`` (or built by its
    ``default_factory``), or a union of such classes (every variant's keys), is walked into; a
    mapping-typed field is an open section (``{}``: any key under it)."""
    classes = _source_classes([Path(f) for f in files])
    out: dict[str, Any] = {}

    def walk(name: str | ast.ClassDef, pre: str, stack: tuple[str, ...]) -> None:
        cls = classes[name] if isinstance(name, str) else name
        scope = {**classes, **getattr(cls, "_klpo_scope", {})}
        for base in cls.bases:
            bname = getattr(base, "id", getattr(base, "attr", ""))
            if isinstance(scope.get(bname), ast.ClassDef) and bname not in stack:
                walk(scope[bname], pre, (*stack, bname))
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            fname = node.target.id
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            kind, nested = _annotation(node.annotation, scope)
            default, built = _field_default(node.value, scope)
            names = dict.fromkeys([*([built] if built else []), *nested])
            nested = [n for n in names if n not in stack]
            key = pre + fname
            if nested:
                for n in reversed(nested):  # the default's class (first) wins shared keys
                    walk(scope[n], key + ".", (*stack, n))
                if not any(k.startswith(key + ".") for k in out):
                    out[key] = default
            elif kind == "open":
                out[key] = {}
            else:
                out[key] = default

    walk(root, prefix, (root,))
    return dict(sorted(out.items()))


def argparse_flags(files: list[Path]) -> dict[str, Any]:
    """Every ``--flag`` an ``add_argument`` call in ``files`` adds, with its static default."""
    out: dict[str, Any] = {}
    for f in files:
        tree = ast.parse(Path(f).read_text(), filename=str(f))
        for call, env in _parser_calls(tree):
            kw = {k.arg: k.value for k in call.keywords if k.arg}
            try:
                action = _static(kw["action"], env) if "action" in kw else None
            except ValueError:
                action = None
            try:
                default = (
                    _static(kw["default"], env)
                    if "default" in kw
                    else {"store_true": False, "store_false": True}.get(action)
                )
            except ValueError:
                default = ast.unparse(kw["default"])
            for a in call.args:
                try:
                    flag = _static(a, env)
                except ValueError:
                    continue
                if isinstance(flag, str) and flag.startswith("--"):
                    out[flag[2:]] = _jsonable(default)
    return dict(sorted(out.items()))


# framework -> (version, where its source is described, [(section prefix, [files], root class)])
# The files are relative to a checkout of the framework at the pinned commit.
SOURCE_TABLES: dict[str, tuple[str, str, list[tuple[str, list[str], str]]]] = {
    "roll": (
        "0.3.0+8eb27cc",
        "alibaba/ROLL 8eb27cc: RLVRConfig (roll/pipeline/rlvr/rlvr_config.py, roll/configs/*.py)",
        [
            (
                "",
                [
                    "roll/pipeline/rlvr/rlvr_config.py",
                    "roll/configs/base_config.py",
                    "roll/configs/worker_config.py",
                    "roll/configs/model_args.py",
                    "roll/configs/training_args.py",
                    "roll/configs/data_args.py",
                    "roll/configs/generating_args.py",
                ],
                "RLVRConfig",
            ),
        ],
    ),
    "areal": (
        "2.0.0",
        "areal-project/AReaL cbff54d: GRPOConfig (areal/api/cli_args.py)",
        [
            ("", ["areal/api/cli_args.py"], "GRPOConfig"),
        ],
    ),
    "skyrl": (
        "0.3.0",
        "NovaSky-AI/SkyRL a956457: SkyRLTrainConfig (skyrl/train/config/config.py)",
        [
            ("", ["skyrl/train/config/config.py"], "SkyRLTrainConfig"),
        ],
    ),
    "nemo-rl": (
        "0.6.0+7ea279a",
        "NVIDIA-NeMo/RL 7ea279a: the loss_fn, grpo and ppo sections' pydantic models (nemo_rl/algorithms/loss/loss_functions.py, grpo.py, ppo.py, advantage_estimator.py, reward_score_utils.py)",
        [
            ("loss_fn.", ["nemo_rl/algorithms/loss/loss_functions.py"], "ClippedPGLossConfig"),
            (
                "grpo.",
                [
                    "nemo_rl/algorithms/grpo.py",
                    "nemo_rl/algorithms/advantage_estimator.py",
                    "nemo_rl/algorithms/reward_functions.py",
                ],
                "GRPOConfig",
            ),
            (
                "ppo.",
                ["nemo_rl/algorithms/ppo.py", "nemo_rl/algorithms/reward_functions.py"],
                "PPOConfig",
            ),
        ],
    ),
}
SOURCE_TABLES["nemo-rl-distillation"] = (
    "0.6.0+7ea279a",
    "NVIDIA-NeMo/RL 7ea279a: the distillation algorithm's loss_fn and distillation sections "
    "(nemo_rl/algorithms/loss/loss_functions.py: DistillationLossConfig, "
    "nemo_rl/algorithms/distillation.py: DistillationConfig)",
    [
        ("loss_fn.", ["nemo_rl/algorithms/loss/loss_functions.py"], "DistillationLossConfig"),
        ("distillation.", ["nemo_rl/algorithms/distillation.py"], "DistillationConfig"),
    ],
)
_PRIME = "packages/prime-rl-configs/src/prime_rl/configs/"
SOURCE_TABLES["prime-rl"] = (
    "0.8.0",
    "PrimeIntellect-ai/prime-rl 559b447: RLConfig (packages/prime-rl-configs/src/prime_rl/configs/*.py), every variant of a union",
    [
        (
            "",
            [
                _PRIME + f
                for f in (
                    "rl.py",
                    "trainer.py",
                    "orchestrator.py",
                    "algorithm.py",
                    "inference.py",
                    "shared.py",
                    "monitors.py",
                    "evals.py",
                    "env_server.py",
                )
            ],
            "RLConfig",
        ),
    ],
)
# Sections whose model takes any key (pydantic extra="allow": vLLM's own arguments).
OPEN_SECTIONS: dict[str, tuple[str, ...]] = {"prime-rl": ("inference.vllm",)}
ARGPARSE_TABLES: dict[str, tuple[str, str, list[str]]] = {
    "slime": (
        "0.3.1+624b824",
        "THUDM/slime 624b824: slime's own flags (slime/utils/arguments.py); Megatron's and SGLang's are not listed",
        [
            "slime/utils/arguments.py",
        ],
    ),
}


def source_table(framework: str, root: str | Path) -> dict[str, Any]:
    """The key table of ``framework`` (:data:`SOURCE_TABLES`, :data:`ARGPARSE_TABLES`) read from
    a checkout of it at ``root``."""
    root = Path(root)
    if framework in ARGPARSE_TABLES:
        version, source, files = ARGPARSE_TABLES[framework]
        defaults = argparse_flags([root / f for f in files])
    else:
        version, source, sections = SOURCE_TABLES[framework]
        defaults = {}
        for prefix, files, cls in sections:
            defaults.update(
                class_keys([root / f for f in files if (root / f).is_file()], cls, prefix)
            )
        for section in OPEN_SECTIONS.get(framework, ()):
            defaults = {k: v for k, v in defaults.items() if not k.startswith(section + ".")}
            defaults[section] = {}
    return {
        "framework": framework,
        "version": version,
        "source": source + " read with ast (klpo.doctor.tables)",
        "defaults": dict(sorted(defaults.items())),
    }


def _write(table: dict[str, Any]) -> Path:
    out = _path(table["framework"], table["version"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m klpo.doctor.tables verl|trl|openrlhf ROOT VERSION`` or
    ``python -m klpo.doctor.tables roll|areal|skyrl|nemo-rl|slime CHECKOUT``: write the tables."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(main.__doc__)
        return 2
    if args[0] == "verl":
        written = [_write(verl_table())]
    elif args[0] == "trl":
        written = [_write(trl_table(kind)) for kind in TRL_KINDS]
    elif args[0] == "openrlhf" and len(args) == 3:
        written = [_write(openrlhf_table(args[1], args[2]))]
    elif args[0] in (*SOURCE_TABLES, *ARGPARSE_TABLES) and len(args) == 2:
        written = [_write(source_table(args[0], args[1]))]
    else:
        print(main.__doc__)
        return 2
    for p in written:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
