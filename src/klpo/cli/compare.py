"""``klpo compare``: the estimator stability study on real training (:mod:`klpo.study`): the
study from its options, then its runs (or only their list, or only the report), a line per run
as it starts and ends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from klpo.cli.common import exits, needs

# The options, one constant each: the command below reads as its parameters.
_OUT = typer.Option(
    Path("runs/compare"), "--out", "-o", metavar="DIR", help="Study output directory."
)
_QUICK = typer.Option(
    False,
    "--quick",
    help="The smoke-test preset: every choice but ref_is and adaptive_mix, one beta, 2 seeds, 12 steps.",
)
_STUDY_FILE = typer.Option(
    [],
    "--config",
    "-c",
    metavar="FILE",
    help="YAML of StudyConfig keys (grid, betas, seeds, steps, ...); repeatable: the files "
    "merge in order, a later one winning.",
)
_WORKERS = typer.Option(None, metavar="N", help="Runs in parallel (one torch thread each).")
_STEPS = typer.Option(None, metavar="N", help="Training steps per run (the fixed budget).")
_SEEDS = typer.Option(None, metavar="S1,S2,...", help="Comma-separated seeds, e.g. 0,1,2.")
_BETAS = typer.Option(
    None, metavar="B1,B2,...", help="Comma-separated KL coefficients, e.g. 0.01,0.1."
)
_DRY_RUN = typer.Option(False, "--dry-run", help="List the runs and exit.")
_REPORT_ONLY = typer.Option(
    "--report-only",
    help="Start no run: rewrite OUT's report from its finished runs (or, for an archive "
    "without its runs, the sections its results.csv decides); refused if a run is "
    "missing.",
)
_TASK = typer.Option(
    "builtin",
    "--task",
    metavar="TASK",
    help="builtin (the arithmetic task), overopt (train on a flawed proxy reward, watch "
    "the gold reward), chat-arith (SmolLM2-135M-Instruct with LoRA on the chat task: the "
    "real-model study, docs/study-real/) or chat-overopt (the same, trained on a proxy "
    "reward a list of numbers games, the gold reward logged: docs/study-real/overopt.md).",
)


def compare(
    out: Path = _OUT,
    quick: bool = _QUICK,
    study_file: list[Path] = _STUDY_FILE,
    workers: int | None = _WORKERS,
    steps: int | None = _STEPS,
    seeds: str | None = _SEEDS,
    betas: str | None = _BETAS,
    dry_run: bool = _DRY_RUN,
    # Annotated: a direct call of compare() gets False, not an Option
    report_only: Annotated[bool, _REPORT_ONLY] = False,
    task: str = _TASK,
) -> None:
    """Train a grid of KL choices × betas × seeds on the built-in task and report which is best.

    Writes results.csv, report.md and plots to OUT; re-running with the same OUT finishes an
    interrupted study without repeating finished runs (crashed or interrupted ones continue
    from their last checkpoint). Ctrl-C or SIGTERM stops it: the runs under way stop after
    their step with a checkpoint, no new run starts, and the runs finished so far are summarised.
    """
    needs("train", "klpo compare")
    from klpo.study.runner import report_only as rewrite_report
    from klpo.train.config import ConfigError

    study, grid = _compare_study(study_file, quick, task, workers, steps, seeds, betas)
    if report_only:
        with exits(2, ConfigError):
            typer.echo(f"wrote {rewrite_report(study, out)}", err=True)
        return
    if dry_run:
        for r in grid:
            typer.echo(r.name)
        typer.echo(f"{len(grid)} runs", err=True)
        return
    typer.echo(f"{len(grid)} runs, {study.workers} at a time, into {out}", err=True)
    _run_study(study, out)
    typer.echo(f"wrote {out / 'report.md'}", err=True)


def _numbers(text: str, kind: type, option: str, example: str) -> list:
    """A comma-separated list of ``kind`` values, or a ConfigError naming ``option``."""
    from klpo.train.config import ConfigError

    try:
        return [kind(x) for x in text.split(",")]
    except ValueError:
        what = "integers" if kind is int else "numbers"
        raise ConfigError(
            f"{option} {text!r} is not a comma-separated list of {what}; e.g. {option} {example}"
        ) from None


def _compare_study(study_file, quick, task, workers, steps, seeds, betas):
    """``klpo compare``'s study and its grid from its options, or exit 2 naming the bad one."""
    from klpo.study.grid import study_grid
    from klpo.study.spec import load_study, with_options
    from klpo.train.config import ConfigError

    with exits(2, ConfigError, ValueError):
        study = load_study(study_file, quick=quick, task=task)
        given = {
            "workers": workers,
            "steps": steps,
            "seeds": seeds and _numbers(seeds, int, "--seeds", "0,1,2"),
            "betas": betas and _numbers(betas, float, "--betas", "0.01,0.1"),
        }
        typed = {"workers": workers, "steps": steps, "seeds": seeds, "betas": betas}
        study = with_options(
            study, {k: (str(typed[k]), v) for k, v in given.items() if typed[k] is not None}
        )
        return study, study_grid(study)


def _say(text: str) -> None:
    """One line on stderr, through ``sys.stderr`` as it is at the call: under the live bar that
    is rich's proxy, which prints each line above the bar (click's echo writes past it, into the
    bar's line)."""
    print(text, file=sys.stderr, flush=True)


def _run_study(study, out: Path) -> None:
    """Run the study's grid into ``out``, a line as each run starts and ends; a bad study is
    exit 2, and Ctrl-C or SIGTERM the interruption's code with what is finished and how to go
    on."""
    from klpo.study.runner import StudyInterrupted, run_study
    from klpo.study.summary import num
    from klpo.train.config import ConfigError

    def on_start(name: str, log_path: Path) -> None:
        _say(f"start {name} (log: {log_path})")

    def on_result(row: dict, n: int, total: int) -> None:
        gold = f"gold {num(row.get('gold_final')):.3f}, " if study.over_optimisation else ""
        why = f" ({row['error']})" if row.get("error") and row["status"] != "ok" else ""
        _say(
            f"[{n}/{total}] {row['name']}: {row['status']}{why}, {gold}held-out "
            f"{num(row.get('acc_final')):.3f}, exact KL {num(row.get('kl_exact_final')):.4f}, "
            f"{num(row.get('wall_s')):.0f} s"
        )

    try:
        with exits(2, ConfigError):
            run_study(study, out, on_result=on_result, on_start=on_start, show_progress=True)
    except StudyInterrupted as err:
        wrote = f"; their summary is in {out / 'report.md'}" if err.finished else ""
        typer.echo(
            f"{err}{wrote}. Not finished: {', '.join(err.unfinished)}; the same klpo compare "
            f"command (--out {out}) continues them from their checkpoints",
            err=True,
        )
        raise typer.Exit(err.exit_code) from None
