r"""``klpo doctor`` as a CI gate: the exit status from the findings, and machine formats.

Exit status (documented in docs/frameworks.md, "The doctor in CI"):

- ``0``: every file read, and no finding at or above ``--fail-on`` (``never``: always 0 once
  every file is read);
- ``1``: some file has a finding at or above ``--fail-on`` (``error`` by default; ``warning``
  counts warnings and errors);
- ``2``: some file could not be read (missing, not a config, refused by name): its message on
  stderr, the other files still reported. Under ``--skip-non-configs`` (the pre-commit hook's
  setting) a file that is no training config of any framework is not counted here: it gets the
  note "not a training config: nothing to check" and counts as clean.

Formats: ``text`` (for people), ``json`` (the diagnosis; a list of them for several files),
``sarif`` (SARIF 2.1.0, one run, a result per finding, for code-scanning uploads) and ``github``
(GitHub Actions' workflow commands, ``::error file=…,line=…::message``, which the Actions log
turns into annotations on the file).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["FAIL_ON", "FORMATS", "exit_code", "github", "sarif"]

FAIL_ON = ("error", "warning", "never")
FORMATS = ("text", "json", "sarif", "github")
_RANK = {"note": 0, "warning": 1, "error": 2}


def failing(diag: dict[str, Any], fail_on: str) -> list[dict[str, Any]]:
    """The findings of one diagnosis at or above ``fail_on``."""
    if fail_on == "never":
        return []
    bar = _RANK[fail_on]
    return [f for f in diag["findings"] if _RANK.get(f["level"], 0) >= bar]


def exit_code(diags: list[dict[str, Any]], unreadable: int, fail_on: str) -> int:
    """0, 1 or 2 as the module docstring says."""
    if unreadable:
        return 2
    return 1 if any(failing(d, fail_on) for d in diags) else 0


def _file(diag: dict[str, Any]) -> str:
    return str(diag["source"]).split(" (", 1)[0]


def _line(text: str) -> int | None:
    m = re.search(r"\bline (\d+)", text)
    return int(m.group(1)) if m else None


def _rule(f: dict[str, Any]) -> str:
    keys = ",".join(f["keys"]) or "config"
    return f"klpo-doctor/{f['level']}/{keys}"


def sarif(diags: list[dict[str, Any]], errors: list[tuple[str, str]]) -> dict[str, Any]:
    """One SARIF 2.1.0 log: a result per finding, and one per file that could not be read."""
    results: list[dict[str, Any]] = []
    rules: dict[str, dict[str, Any]] = {}
    for d in diags:
        for f in d["findings"]:
            rule = _rule(f)
            rules.setdefault(rule, {"id": rule, "shortDescription": {"text": ", ".join(f["keys"])}})
            loc: dict[str, Any] = {"artifactLocation": {"uri": _file(d)}}
            line = _line(f["text"])
            if line:
                loc["region"] = {"startLine": line}
            results.append(
                {
                    "ruleId": rule,
                    "level": f["level"],
                    "message": {"text": f["text"]},
                    "locations": [{"physicalLocation": loc}],
                }
            )
    for path, message in errors:
        rules.setdefault(
            "klpo-doctor/unreadable", {"id": "klpo-doctor/unreadable", "shortDescription": {
                "text": "the doctor could not read the file"}}
        )  # fmt: skip
        results.append(
            {
                "ruleId": "klpo-doctor/unreadable",
                "level": "error",
                "message": {"text": message},
                "locations": [{"physicalLocation": {"artifactLocation": {"uri": path}}}],
            }
        )
    return {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": {"name": "klpo doctor", "rules": list(rules.values())}},
                "results": results,
            }
        ],
    }


def _escape(text: str, prop: bool = False) -> str:
    """GitHub's workflow-command escaping (``%``, CR, LF; and ``:`` ``,`` in properties)."""
    out = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    if prop:
        out = out.replace(":", "%3A").replace(",", "%2C")
    return out


def github(diags: list[dict[str, Any]], errors: list[tuple[str, str]]) -> str:
    """GitHub Actions annotation lines, one per finding (notes as ``::notice``)."""
    lines = []
    kind = {"error": "error", "warning": "warning", "note": "notice"}
    for d in diags:
        for f in d["findings"]:
            props = f"file={_escape(_file(d), True)}"
            line = _line(f["text"])
            if line:
                props += f",line={line}"
            props += f",title={_escape('klpo doctor: ' + ', '.join(f['keys']), True)}"
            lines.append(f"::{kind.get(f['level'], 'notice')} {props}::{_escape(f['text'])}")
    for path, message in errors:
        lines.append(f"::error file={_escape(path, True)},title=klpo doctor::{_escape(message)}")
    return "\n".join(lines)


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, default=str)
