"""``klpo doctor``'s body: read, diagnose, optionally measure, print (text or JSON)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from klpo.doctor import diagnose
from klpo.doctor.reading import DoctorError
from klpo.doctor.report import render

__all__ = ["run"]


def _variables(pairs: list[str]) -> dict[str, str]:
    """``--var NAME=VALUE`` options as a mapping."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name.strip().isidentifier():
            raise DoctorError(
                f"--var {pair!r}: write it as NAME=VALUE, e.g. --var MODEL_PATH=/models/x"
            )
        out[name.strip()] = value
    return out


def run(
    config: str,
    *,
    framework: str | None = None,
    version: str | None = None,
    as_json: bool = False,
    model: str | None = None,
    reference: str | None = None,
    data: str | None = None,
    layer: str | None = None,
    sketch: int | None = None,
    chat: bool | None = None,
    prompts: int = 8,
    samples: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    variables: list[str] | None = None,
) -> int:
    """Print the diagnosis of ``config``; 2 on bad input (the message on stderr), else 0.

    With ``--model`` the reading of the config is printed (and flushed) first, then the
    measurement, which loads two models and takes a while; ``chat`` None follows a klpo config's
    ``data.chat`` (and its ``data.system_prompt``), else plain prompts.
    """
    given = [
        name for name, v in (("--model", model), ("--reference", reference), ("--data", data)) if v
    ]
    try:
        if given and len(given) != 3:
            missing = sorted({"--model", "--reference", "--data"} - set(given))
            raise DoctorError(
                f"the measurement needs --model, --reference and --data together; missing: "
                f"{', '.join(missing)}"
            )
        given_vars = _variables(variables or [])
        diag = diagnose(config, framework, version, given_vars)
        if given:
            from klpo.doctor.measure import SKETCH, measure, render_measurement

            if not as_json:  # the reading first: the measurement takes a while
                typer.echo(render(diag))
                sys.stdout.flush()
            use_chat, system_prompt = _chat(config, diag, chat)
            terms = [(t["estimator"], t["placement"]) for t in diag["terms"] if t["estimator"]]
            diag["measurement"] = measure(
                model,
                reference,
                data,
                layer=layer,
                sketch=SKETCH if sketch is None else sketch,
                chat=use_chat,
                system_prompt=system_prompt,
                prompts=prompts,
                samples=samples,
                max_new_tokens=max_new_tokens,
                seed=seed,
                highlight=terms,
            )
    except (DoctorError, ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        return 2
    if as_json:
        json.dump(diag, sys.stdout, indent=2, ensure_ascii=False, default=str)
        sys.stdout.write("\n")
        return 0
    if "measurement" in diag:
        typer.echo("\n" + render_measurement(diag["measurement"]))
    else:
        typer.echo(render(diag))
    return 0


def _chat(config: str, diag: dict, chat: bool | None) -> tuple[bool, str | None]:
    """``(chat, system prompt)`` for the measurement: ``--chat``/``--no-chat`` where given, else
    a klpo config's ``data.chat`` and ``data.system_prompt``."""
    if diag.get("framework") != "klpo":
        return bool(chat), None
    from klpo.doctor.reading import load_mapping

    section = load_mapping(Path(config)).get("data") or {}
    section = section if isinstance(section, dict) else {}
    use = bool(section.get("chat", False)) if chat is None else chat
    system = section.get("system_prompt") if use else None
    return use, system if isinstance(system, str) else None
