"""``klpo doctor``'s body: read, diagnose, optionally measure, print (text or JSON)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import typer

from klpo.doctor import diagnose
from klpo.doctor.reading import DoctorError, UnknownFramework
from klpo.doctor.report import render

__all__ = ["Measurement", "run"]


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


@dataclass(frozen=True)
class Measurement:
    """What ``--model`` measures: the policy, the reference and the data (all three, or none:
    no measurement) and the measurement's settings (:func:`klpo.measure.measure`)."""

    model: str | None = None
    reference: str | None = None
    data: str | None = None
    layer: str | None = None
    sketch: int | None = None
    chat: bool | None = None
    prompts: int = 8
    samples: int = 8
    max_new_tokens: int = 16
    seed: int = 0

    def given(self) -> bool:
        """Whether to measure: ``--model``, ``--reference`` and ``--data`` all given (a
        DoctorError naming the missing ones when only some are)."""
        named = {"--model": self.model, "--reference": self.reference, "--data": self.data}
        given = [name for name, v in named.items() if v]
        if given and len(given) != 3:
            missing = sorted(set(named) - set(given))
            raise DoctorError(
                f"the measurement needs --model, --reference and --data together; missing: "
                f"{', '.join(missing)}"
            )
        return bool(given)

    def run(self, terms: list, chat: bool, system_prompt: str | None = None) -> dict:
        """The measurement, with ``terms`` (``(estimator, placement)``) marked."""
        from klpo.measure import SKETCH, measure

        return measure(
            self.model, self.reference, self.data, layer=self.layer,
            sketch=SKETCH if self.sketch is None else self.sketch, chat=chat,
            system_prompt=system_prompt, prompts=self.prompts, samples=self.samples,
            max_new_tokens=self.max_new_tokens, seed=self.seed, highlight=terms,
        )  # fmt: skip


def run(
    config: str | list[str],
    *,
    framework: str | None = None,
    version: str | None = None,
    as_json: bool = False,
    measurement: Measurement = Measurement(),
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

    With ``--model`` (``measurement``) the reading of the config is printed (and flushed) first,
    then the measurement, which loads two models and takes a while; ``chat`` None follows a klpo
    config's ``data.chat`` (and its ``data.system_prompt``), else plain prompts.
    """
    from klpo.doctor import gate

    configs = [config] if isinstance(config, str) else list(config)
    fmt = fmt or ("json" if as_json else "text")
    refused = _refused(configs, measurement, fail_on, fmt)
    if refused:
        typer.echo(f"error: {refused}", err=True)
        return 2
    if not configs:  # --model without a config: klpo's default term, marked
        return _measure_defaults(measurement, fmt)
    diags: list[dict] = []
    errors: list[tuple[str, str]] = []
    texts: list[str] = []
    for one in configs:
        diag, text = _one(one, framework, version, measurement, variables, fmt, skip_non_configs)
        if diag is None and text is None:  # not a training config, skipped (said on stderr)
            continue
        if diag is None:
            errors.append((one, text))
            continue
        diags.append(diag)
        texts.append(text)
    _write(diags, errors, texts, fmt, many=len(configs) > 1)
    return gate.exit_code(diags, len(errors), fail_on)


def _refused(configs: list[str], measurement: Measurement, fail_on: str, fmt: str) -> str | None:
    """Why the command line cannot run (None: it can)."""
    from klpo.doctor import gate

    measuring = measurement.model or measurement.reference or measurement.data
    if not configs and measurement.model is None:
        return (
            "give a CONFIG to read, or --model, --reference and --data to measure klpo's "
            "default KL term on your models"
        )
    if fail_on not in gate.FAIL_ON or fmt not in gate.FORMATS:
        return f"--fail-on takes {'|'.join(gate.FAIL_ON)}, --format {'|'.join(gate.FORMATS)}"
    if len(configs) > 1 and measuring:
        return "--model measures one config; give one CONFIG with it"
    return None


def _write(
    diags: list[dict], errors: list[tuple[str, str]], texts: list[str], fmt: str, *, many: bool
) -> None:
    """The diagnoses in ``fmt``: JSON (one object, or a list for several configs), SARIF,
    GitHub annotations or text."""
    from klpo.doctor import gate

    if fmt == "json":
        out = diags[0] if not many and diags else diags
        if diags or many:
            sys.stdout.write(gate.dumps(out) + "\n")
    elif fmt == "sarif":
        sys.stdout.write(gate.dumps(gate.sarif(diags, errors)) + "\n")
    elif fmt == "github":
        lines = gate.github(diags, errors)
        if lines:
            typer.echo(lines)
    elif texts:
        typer.echo("\n\n".join(texts))


def _one(
    config: str,
    framework: str | None,
    version: str | None,
    measurement: Measurement,
    variables: list[str] | None,
    fmt: str,
    skip_non_configs: bool = False,
) -> tuple[dict | None, str | None]:
    """One config: (its diagnosis, its text), or (None, the message, already on stderr), or
    (None, None) for a file skipped as no training config (its note on stderr)."""
    try:
        measuring = measurement.given()
        diag = diagnose(config, framework, version, _variables(variables or []))
        if measuring:
            if fmt == "text":  # the reading first: the measurement takes a while
                typer.echo(render(diag))
                sys.stdout.flush()
            use_chat, system_prompt = _chat(config, diag, measurement.chat)
            terms = [(t["estimator"], t["placement"]) for t in diag["terms"] if t["estimator"]]
            diag["measurement"] = measurement.run(terms, use_chat, system_prompt)
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
        from klpo.measure import render_measurement

        text = render_measurement(diag["measurement"])
        return diag, text if fmt == "text" else render(diag) + "\n\n" + text
    return diag, render(diag)


def _measure_defaults(measurement: Measurement, fmt: str) -> int:
    """``klpo doctor --model M --reference R --data F`` without a config: the measurement, with
    klpo's own default term (``kl.estimator``, ``kl.placement`` of ``klpo train``) marked; exit 0,
    or 2 on bad input."""
    from klpo.train.config.kl import KLConfig

    default = KLConfig()
    term = (default.estimator, default.placement)
    try:
        measurement.given()  # (--model is given here: the other two must be too)
        from klpo.measure import render_measurement

        m = measurement.run([term], bool(measurement.chat))
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
