"""The `klpo` command line: one sub-command per job.

Heavy imports (transformers, matplotlib) happen inside the commands that need them, so
``klpo explain`` starts in the time it takes to import torch.
"""

from __future__ import annotations

import json
import sys

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


# --------------------------------------------------------------------------------------------
# klpo make-reference: the tiny reference model of the built-in task (issue 6).


@app.command("make-reference")
def make_reference_cmd(
    out: str = typer.Argument(
        "klpo-reference",
        help="Directory to write the model, tokenizer and reference.json into.",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    steps: int | None = typer.Option(None, help="The most SFT steps."),
    seed: int | None = typer.Option(None, help="Seed of initialisation and data order."),
    arch: str | None = typer.Option(None, help="llama or qwen2."),
    hidden_size: int | None = typer.Option(None, help="Model width."),
    num_layers: int | None = typer.Option(None, help="Number of transformer blocks."),
    intermediate_size: int | None = typer.Option(None, help="MLP width."),
    batch_size: int | None = typer.Option(None, help="Problems per SFT step."),
    lr: float | None = typer.Option(None, help="Peak SFT learning rate."),
    stop_at_accuracy: float | None = typer.Option(
        None, help="Stop SFT once the validation accuracy reaches this (0 = never stop early)."
    ),
    save_dtype: str | None = typer.Option(None, help="float32, bfloat16 or float16."),
) -> None:
    """Train the tiny reference model of the built-in arithmetic task by seeded SFT and save it.

    With no options it reproduces the reference shipped in the package (and says whether the
    weights are bit-identical to it).
    """
    import dataclasses

    from klpo.train import reference

    overrides = {
        k: v
        for k, v in dict(
            steps=steps,
            seed=seed,
            arch=arch,
            hidden_size=hidden_size,
            num_layers=num_layers,
            intermediate_size=intermediate_size,
            batch_size=batch_size,
            lr=lr,
            stop_at_accuracy=stop_at_accuracy,
            save_dtype=save_dtype,
        ).items()
        if v is not None
    }
    if overrides.get("stop_at_accuracy") == 0:
        overrides["stop_at_accuracy"] = None
    try:
        config = dataclasses.replace(reference.ReferenceConfig(), **overrides)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    out_console = console()

    def on_step(step: int, loss: float, val_accuracy: float | None) -> None:
        if val_accuracy is not None and (
            (step + 1) % (4 * config.eval_every) == 0
            or (config.stop_at_accuracy is not None and val_accuracy >= config.stop_at_accuracy)
            or step + 1 == config.steps
        ):
            out_console.print(
                f"step {step + 1:>5}  loss {loss:.4f}  validation accuracy {val_accuracy:.3f}",
                highlight=False,
            )

    try:
        result = reference.make_reference(out, config, on_step=on_step, overwrite=overwrite)
    except FileExistsError as err:
        raise typer.BadParameter(str(err), param_hint="--overwrite") from None
    size = sum(f.stat().st_size for f in result.path.iterdir() if f.is_file())
    out_console.print(
        f"wrote {result.path} ({size / 1e6:.2f} MB): {result.num_parameters:,} parameters, "
        f"{result.steps} SFT steps, held-out accuracy {result.heldout_accuracy:.3f} (greedy, "
        f"exact match, {config.n_heldout} problems), {result.seconds:.1f} s",
        highlight=False,
    )
    try:
        shipped = reference.default_reference_path()
    except FileNotFoundError:
        return
    if not overrides and result.path.resolve() != shipped.resolve():
        same = reference.same_weights(result.path, shipped)
        out_console.print(
            f"bit-identical to the shipped reference: {'yes' if same else 'no'}", highlight=False
        )


def main() -> None:
    """Entry point of the ``klpo`` console script."""
    app()


if __name__ == "__main__":
    main()
