"""The `klpo` command line: one sub-command per job, one module per command group.

- :mod:`klpo.cli.common`   what the commands share: the help's notation, the console, the
  install and core checks, errors said in one line with an exit code
- :mod:`klpo.cli.explain`  ``klpo explain``
- :mod:`klpo.cli.train`    ``klpo train``
- :mod:`klpo.cli.tools`    ``klpo export``, ``klpo docs``, ``klpo make-reference``,
  ``klpo make-reward-model``
- :mod:`klpo.cli.compare`  ``klpo compare``
- :mod:`klpo.cli.doctor`   ``klpo doctor`` (and the ``klpo-doctor`` script)
- :mod:`klpo.cli.probe`    ``klpo probe``
- :mod:`klpo.cli.lab`      ``klpo lab gaussian|categorical|sequence|report``

This module builds :data:`app` from them, in the order ``klpo --help`` lists the commands, and
holds the console scripts' entry points (:func:`main`, :func:`doctor_main`).

Every klpo import of the commands happens inside the command that needs it, so ``klpo --help``
and ``klpo doctor`` import no torch, and the light install (``pip install klpo``: no torch, no
transformers) runs them. A command that needs the library or the trainer's stack and finds it
missing exits 1 naming the install that brings it (:mod:`klpo._extras`).
"""

from __future__ import annotations

import sys

import typer

from klpo.cli import compare, doctor, explain, lab, probe, tools, train
from klpo.cli.common import Command

app = typer.Typer(
    name="klpo",
    help="KL-regularised policy optimisation for language models: estimators, lab, trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from klpo import __version__

        typer.echo(f"klpo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_version,
        is_eager=True,
        help="Print klpo's version and exit.",
    ),
) -> None:
    """KL-regularised policy optimisation for language models: estimators, lab, trainer."""


app.command()(explain.explain)
app.command()(train.train)
app.command(cls=Command)(tools.export)
app.command()(tools.docs)
app.add_typer(lab.lab_app, name="lab")
app.command("make-reference", cls=Command)(tools.make_reference_cmd)
app.command("make-reward-model", cls=Command)(tools.make_reward_model_cmd)
app.command()(compare.compare)
app.command(cls=Command)(doctor.doctor)
app.command(cls=Command)(probe.probe)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """Entry point of the ``klpo`` console script (and of ``python -m klpo``, ``torchrun -m
    klpo``): OpenMP's threads wait passively, set before anything imports torch. ``args``:
    the command line, ``sys.argv[1:]`` when None."""
    from klpo._extras import MissingExtra, extra_of, missing_message
    from klpo._threads import passive_openmp_wait

    passive_openmp_wait()
    try:
        if args is None:
            app()  # the command line as given
        else:
            app(args=args, prog_name=prog_name)
    except ModuleNotFoundError as err:  # a command used a package its install of klpo lacks
        extra = extra_of(err.name or "")
        if extra is None:
            raise
        if not isinstance(err, MissingExtra):
            words = sys.argv[1:] if args is None else args
            what = f"klpo {words[0]}" if words else "klpo"
            err = MissingExtra(missing_message(what, extra, [err.name.partition(".")[0]]))
        typer.echo(f"error: {err}", err=True)
        raise SystemExit(1) from None


def doctor_main() -> None:
    """Entry point of the ``klpo-doctor`` console script, for pre-commit hooks and CI gates:
    ``klpo-doctor ARGS`` is ``klpo doctor ARGS`` (the light install has both)."""
    main(["doctor", *sys.argv[1:]], prog_name="klpo")
