"""A Python training script's TRL config call (``GRPOConfig(...)``, ``RLOOConfig(...)``,
``DistillationConfig(...)``, ``SDPOConfig(...)``), read for the doctor.

The script is parsed with :mod:`ast`, never run. A keyword's value is read where it is a literal
or arithmetic on names the module assigns literals to (``max_seq_length - max_prompt_length``);
anything else (a function call, an attribute, a name bound elsewhere) stays visible as
``${expression}``, which the readers report as unreadable. A script that imports ``unsloth`` (or
names ``FastLanguageModel`` / ``PatchFastRL``) runs TRL's trainer patched by Unsloth.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from klpo.doctor.reading import DoctorError

__all__ = ["CLASSES", "config_call"]

CLASSES = ("GRPOConfig", "RLOOConfig", "DistillationConfig", "SDPOConfig")
"""The TRL config classes whose call the doctor reads."""

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv}  # fmt: skip
_UNSLOTH = ("FastLanguageModel", "FastModel", "PatchFastRL", "FastVisionModel")


def _value(node: ast.AST, names: dict[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand, names)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left, names), _value(node.right, names))
    if isinstance(node, ast.List | ast.Tuple):
        return [_value(e, names) for e in node.elts]
    raise ValueError(ast.unparse(node))


def config_call(text: str, source: str) -> tuple[str, dict[str, Any], bool, int]:
    """(config class, its keyword arguments, whether Unsloth patches the trainer, line)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as err:
        raise DoctorError(f"{source}: line {err.lineno}: not valid Python ({err.msg})") from None
    names: dict[str, Any] = {}
    unsloth = False
    found: tuple[str, ast.Call] | None = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(m.split(".")[0] in ("unsloth", "unsloth_zoo") for m in mods):
                unsloth = True
            if any(a.name in _UNSLOTH for a in node.names):
                unsloth = True
    for stmt in tree.body:  # module-level literal assignments, in order
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                try:
                    names[target.id] = _value(stmt.value, names)
                except (ValueError, TypeError, ZeroDivisionError):
                    names.pop(target.id, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            )
            if name in CLASSES:
                found = (name, node)
    if found is None:
        raise DoctorError(
            f"{source}: a Python script without a {'(...), '.join(CLASSES)}(...) call; the "
            "doctor reads TRL's (and Unsloth's) configs from that call"
        )
    cls, call = found
    kwargs: dict[str, Any] = {}
    for kw in call.keywords:
        if kw.arg is None:
            continue  # **kwargs: unknown
        try:
            kwargs[kw.arg] = _value(kw.value, names)
        except (ValueError, TypeError, ZeroDivisionError):
            kwargs[kw.arg] = "${" + ast.unparse(kw.value) + "}"
    return cls, kwargs, unsloth, call.lineno
