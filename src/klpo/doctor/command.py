"""``klpo doctor``'s body: read, diagnose, optionally measure, print (text or JSON)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from klpo.doctor import diagnose
from klpo.doctor.reading import DoctorError, UnknownFramework
from klpo.doctor.report import render

__all__ = ["run"]


def _variables(pairs: list[str]) -> dict[str, str]:
    """``--var NAME=VALUE`` options as a mapping; NAME is a shell variable's name, or a number
    for a positional parameter (``--var 1=/models/x`` for ``$1``)."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        name = name.strip()
        if not eq or not (name.isidentifier() or (name.isdigit() and name != "0")):
            raise DoctorError(
                f"--var {pair!r}: write it as NAME=VALUE, e.g. --var MODEL_PATH=/models/x, or "
                "N=VALUE for a positional parameter, e.g. --var 1=/models/x for $1"
            )
        out[name] = value
    return out


def run(
    config: str | list[str],
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
    fail_on: str = "error",
    fmt: str | None = None,
    skip_non_configs: bool = False,
) -> int:
    """Print the diagnosis of each config; the exit status is :mod:`klpo.doctor.gate`'s (0 clean,
    1 a finding at or above ``fail_on``, 2 a file that could not be read).

    ``skip_non_configs`` (the pre-commit hook's setting): a file that is no training config of
    any framework (:class:`~klpo.doctor.reading.UnknownFramework`: a CI workflow, a data file, an
    unrelated script) gets one line on stderr, ``FILE: not a training config: nothing to check``,
    and counts as clean; without it, such a file is an error (exit 2), since a file named on the
    command line was meant to be read.

    With ``--model`` the reading of the config is printed (and flushed) first, then the
    measurement, which loads two models and takes a while; ``chat`` None follows a klpo config's
    ``data.chat`` (and its ``data.system_prompt``), else plain prompts.
    """
    from klpo.doctor import gate

    configs = [config] if isinstance(config, str) else list(config)
    fmt = fmt or ("json" if as_json else "text")
    if not configs and model is None:
        typer.echo(
            "error: give a CONFIG to read, or --model, --reference and --data to measure klpo's "
            "default KL term on your models",
            err=True,
        )
        return 2
    if fail_on not in gate.FAIL_ON or fmt not in gate.FORMATS:
        typer.echo(
            f"error: --fail-on takes {'|'.join(gate.FAIL_ON)}, --format {'|'.join(gate.FORMATS)}",
            err=True,
        )
        return 2
    if len(configs) > 1 and (model or reference or data):
        typer.echo("error: --model measures one config; give one CONFIG with it", err=True)
        return 2
    if not configs:  # --model without a config: klpo's default term, marked
        return _measure_defaults(
            model, reference, data, layer, sketch, chat, prompts, samples, max_new_tokens, seed,
            fmt,
        )  # fmt: skip
    diags: list[dict] = []
    errors: list[tuple[str, str]] = []
    texts: list[str] = []
    for one in configs:
        diag, text = _one(
            one, framework, version, model, reference, data, layer, sketch, chat, prompts,
            samples, max_new_tokens, seed, variables, fmt, skip_non_configs,
        )  # fmt: skip
        if diag is None and text is None:  # not a training config, skipped (said on stderr)
            continue
        if diag is None:
            errors.append((one, text))
            continue
        diags.append(diag)
        texts.append(text)
    if fmt == "json":
        out = diags[0] if len(configs) == 1 and diags else diags
        if diags or len(configs) > 1:
            sys.stdout.write(gate.dumps(out) + "\n")
    elif fmt == "sarif":
        sys.stdout.write(gate.dumps(gate.sarif(diags, errors)) + "\n")
    elif fmt == "github":
        lines = gate.github(diags, errors)
        if lines:
            typer.echo(lines)
    elif texts:
        typer.echo("\n\n".join(texts))
    return gate.exit_code(diags, len(errors), fail_on)


def _one(
    config,
    framework,
    version,
    model,
    reference,
    data,
    layer,
    sketch,
    chat,
    prompts,
    samples,
    max_new_tokens,
    seed,
    variables,
    fmt,
    skip_non_configs=False,
) -> tuple[dict | None, str | None]:
    """One config: (its diagnosis, its text), or (None, the message, already on stderr), or
    (None, None) for a file skipped as no training config (its note on stderr)."""  # fmt: skip
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
            from klpo.measure import SKETCH, measure, render_measurement

            if fmt == "text":  # the reading first: the measurement takes a while
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
    except UnknownFramework as err:
        if not skip_non_configs or framework is not None:
            typer.echo(f"error: {err}", err=True)
            return None, str(err)
        typer.echo(f"{config}: not a training config: nothing to check ({err.what})", err=True)
        return None, None
    except (DoctorError, ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        return None, str(err)
    except RecursionError:  # a YAML or JSON file nested deeper than its parser's stack
        err = DoctorError(
            f"{config}: nested too deeply to parse (the YAML/JSON parser recurses once per "
            "level); a config is a few levels of sections and keys: check the file is the one "
            "meant"
        )
        typer.echo(f"error: {err}", err=True)
        return None, str(err)
    if "measurement" in diag:  # (the reading is on the screen already in text form)
        text = render_measurement(diag["measurement"])
        return diag, text if fmt == "text" else render(diag) + "\n\n" + text
    return diag, render(diag)


def _measure_defaults(
    model, reference, data, layer, sketch, chat, prompts, samples, max_new_tokens, seed, fmt
) -> int:
    """``klpo doctor --model M --reference R --data F`` without a config: the measurement, with
    klpo's own default term (``kl.estimator``, ``kl.placement`` of ``klpo train``) marked; exit 0,
    or 2 on bad input."""
    from klpo.train.config.kl import KLConfig

    default = KLConfig()
    term = (default.estimator, default.placement)
    given = [n for n, v in (("--model", model), ("--reference", reference), ("--data", data)) if v]
    try:
        if len(given) != 3:
            missing = sorted({"--model", "--reference", "--data"} - set(given))
            raise DoctorError(
                f"the measurement needs --model, --reference and --data together; missing: "
                f"{', '.join(missing)}"
            )
        from klpo.measure import SKETCH, measure, render_measurement

        m = measure(
            model, reference, data, layer=layer, sketch=SKETCH if sketch is None else sketch,
            chat=bool(chat), prompts=prompts, samples=samples, max_new_tokens=max_new_tokens,
            seed=seed, highlight=[term],
        )  # fmt: skip
    except (DoctorError, ValueError, OSError) as err:
        typer.echo(f"error: {err}", err=True)
        return 2
    if fmt == "json":
        from klpo.doctor import gate

        record = {"config": None, "default_term": list(term), "measurement": m}
        sys.stdout.write(gate.dumps(record) + "\n")
    else:
        typer.echo(
            f"no config given: klpo's default KL term (kl.estimator={term[0]}, "
            f"kl.placement={term[1]}) is marked *\n\n" + render_measurement(m)
        )
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
