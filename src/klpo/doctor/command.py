"""``klpo doctor``'s body: read, diagnose, optionally measure, print (text or JSON)."""

from __future__ import annotations

import json
import sys

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
    prompts: int = 8,
    samples: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    variables: list[str] | None = None,
) -> int:
    """Print the diagnosis of ``config``; 2 on bad input (the message on stderr), else 0."""
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
            from klpo.doctor.measure import measure, render_measurement

            terms = [(t["estimator"], t["placement"]) for t in diag["terms"] if t["estimator"]]
            diag["measurement"] = measure(
                model,
                reference,
                data,
                layer=layer,
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
    text = render(diag)
    if "measurement" in diag:
        text += "\n\n" + render_measurement(diag["measurement"])
    typer.echo(text)
    return 0
