"""The `klpo` command line: one sub-command per job.

Heavy imports (transformers, matplotlib) happen inside the commands that need them, so
``klpo explain`` starts in the time it takes to import torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="klpo",
    help="KL-regularised policy optimisation for language models: estimators, lab, trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """KL-regularised policy optimisation for language models: estimators, lab, trainer."""


def console() -> Console:
    """A console that does not wrap tables to 80 columns when stdout is a file or pipe."""
    c = Console()
    return c if c.is_terminal else Console(width=200)


@app.command()
def explain(
    estimator: str | None = typer.Option(
        None, "--estimator", "-e", help="A KL estimator (see --all for the list)."
    ),
    placement: str | None = typer.Option(
        None, "--placement", "-p", help="reward, loss or reward+loss; all three if omitted."
    ),
    all_: bool = typer.Option(False, "--all", help="Explain every estimator in every placement."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
    off_policy: bool = typer.Option(
        False, "--off-policy", help="Tokens sampled from an older policy pi_old, not pi_theta."
    ),
) -> None:
    """Say what a KL estimator in a placement really does: value, bias, sign and gradient.

    Every claim is derived by exact enumeration on small categoricals, not typed in.
    """
    from klpo import kl

    if not all_ and estimator is None:
        raise typer.BadParameter(
            "give --estimator NAME (and optionally --placement), or --all; estimators: "
            + ", ".join(kl.ESTIMATORS),
            param_hint="--estimator",
        )
    names = list(kl.ESTIMATORS) if all_ or estimator is None else [estimator]
    placements = list(kl.PLACEMENTS) if placement is None else [placement]
    try:
        rows = [kl.explain(n, p, on_policy=not off_policy) for n in names for p in placements]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None

    if as_json:
        json.dump([r.to_dict() for r in rows], sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
        return
    out = console()
    if len(rows) <= len(kl.PLACEMENTS) and len(names) == 1:
        out.print("\n\n".join(r.text() for r in rows), highlight=False)
        return
    out.print(_table(rows, kl.PLACEMENTS if placement is None else placements, off_policy))


def _table(rows: list, placements: list[str] | tuple[str, ...], off_policy: bool) -> Table:
    sampling = "pi_old ≠ pi_theta" if off_policy else "pi_theta (on-policy)"
    table = Table(
        title=f"KL estimators, d = logp - logp_ref, tokens sampled from {sampling}",
        caption="Derived by exact enumeration on seeded categoricals (klpo.kl.explain). "
        "'*' marks a gradient that is not that of the KL the value estimates.",
    )
    table.add_column("estimator", style="bold")
    table.add_column("value")
    table.add_column("estimates")
    table.add_column("unbiased")
    table.add_column("≥ 0")
    for p in placements:
        table.add_column(f"gradient in {p}")
    by_name: dict[str, list] = {}
    for r in rows:
        by_name.setdefault(r.estimator, []).append(r)
    for name, rs in by_name.items():
        first = rs[0]
        grads = [r.gradient + (" *" if r.mismatch else "") for r in rs]
        table.add_row(
            name,
            first.equation,
            first.estimates,
            "yes" if first.unbiased else "no",
            "yes" if first.nonnegative else "no",
            *grads,
        )
    return table


@app.command()
def train(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="YAML config (see configs/); built-in defaults if omitted."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a config key, e.g. --set kl.beta=0.02 (repeatable)."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this directory from its last checkpoint."
    ),
) -> None:
    """Train a policy with GRPO, PPO, RLOO or REINFORCE++ (the project's main job).

    Under torchrun (`torchrun --nproc_per_node 2 -m klpo train ...`) it runs data-parallel.
    """
    from klpo.train.config import ConfigError, load_config

    try:
        if resume is not None:
            saved = resume / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"--resume {resume}: no config.yaml there, so no run to resume")
            cfg = load_config(config or saved, [*overrides, f"run.out_dir={resume}"])
        else:
            cfg = load_config(config, overrides)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None

    from klpo.train.loop import train as run_training
    from klpo.train.rewards import RewardError

    try:
        run_training(cfg, resume=resume is not None, log=lambda msg: typer.echo(msg, err=True))
    except (ConfigError, RewardError, FileNotFoundError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command()
def docs(
    out: Path = typer.Option(Path("docs"), "--out", help="Directory for the generated pages."),
) -> None:
    """Regenerate the reference pages (estimators, metrics, config) from the code."""
    from klpo.train.docs import write_pages

    for path in write_pages(out):
        typer.echo(f"wrote {path}")


def main() -> None:
    """Entry point of the ``klpo`` console script."""
    app()


if __name__ == "__main__":
    main()
