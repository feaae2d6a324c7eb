"""What the commands share: the help's notation, the console, the install and core checks, and
errors said in one line with an exit code.

Imports only typer and rich at the top: every klpo import is inside the function that needs it
(the package's docstring says why).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console


class Command(typer.core.TyperCommand):
    """A command whose help reads in click's own notation: positional arguments by their
    metavar (``klpo doctor [OPTIONS] CONFIG``, ``[OUT]`` when optional), without typer's
    ``{name}`` braces and ``<type>`` labels (every option with a value names its metavar)."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: typer.Context, formatter) -> None:
        args, opts = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append((param.metavar or param.name.upper(), record[1]))
            else:
                opts.append(record)
        for title, records in (("Arguments", args), ("Options", opts)):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def console() -> Console:
    """A console that does not wrap tables to 80 columns when stdout is a file or pipe (unless
    ``COLUMNS`` sets the width)."""
    c = Console()
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(width=200)


def print_json(record: Any, *, allow_nan: bool = True) -> None:
    """``--json``: ``record`` as one indented JSON document on stdout (strict JSON, no NaN, when
    ``allow_nan`` is False)."""
    json.dump(record, sys.stdout, indent=2, ensure_ascii=False, allow_nan=allow_nan)
    sys.stdout.write("\n")


def needs(extra: str, command: str) -> None:
    """Exit 1, naming ``pip install 'klpo[EXTRA]'``, when ``command`` needs ``extra``'s
    packages and one is not installed (found without importing it)."""
    from klpo._extras import missing, missing_message

    absent = missing(extra)
    if absent:
        typer.echo(f"error: {missing_message(command, extra, absent)}", err=True)
        raise typer.Exit(1)


def free_cores() -> None:
    """Torch threads from the cores free now, with one line on stderr when the machine is loaded
    (:mod:`klpo._threads`; ``klpo train`` does the same through ``run.threads=0``)."""
    from klpo._threads import use_free_cores

    use_free_cores(log=lambda msg: typer.echo(msg, err=True))


@contextlib.contextmanager
def exits(code: int, *errors: type[BaseException]) -> Iterator[None]:
    """Each of ``errors`` raised inside becomes one line, ``error: MESSAGE`` on stderr, and exit
    ``code`` (2: the command's input is wrong; 1: it failed while it ran)."""
    try:
        yield
    except errors as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(code) from None


@contextlib.contextmanager
def full_disk_said(command: str, out: str | Path) -> Iterator[None]:
    """A full disk while ``command`` writes into ``out`` becomes one message (the file, the free
    space, what is left, how to go on) and exit 1, not a traceback: an OSError whose errno says
    so, or safetensors' own error, which carries the OS error only in its text
    (:func:`klpo.train.runtime.checkpoint.disk_full`)."""
    from klpo.train.runtime.checkpoint import disk_full, full_disk_message

    try:
        yield
    except Exception as err:
        # klpo's own errors (ValueError: ConfigError, GGUFError) say a full disk themselves
        if isinstance(err, ValueError) or not disk_full(err):
            raise
        typer.echo(f"error: {full_disk_message(command, out, err)}", err=True)
        raise typer.Exit(1) from None
