"""The trainer's tools on the command line (:mod:`klpo.train.tools`): ``klpo export`` (a run's
policy as a model directory), ``klpo docs`` (the generated reference pages), and the two models
of the built-in task, ``klpo make-reference`` and ``klpo make-reward-model``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from klpo.cli.common import console, exits, full_disk_said, needs


def export(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="A klpo train run directory."),
    out: Path = typer.Option(..., "--out", metavar="DIR", help="New directory for the model."),
    merge: bool = typer.Option(
        False, "--merge", help="LoRA runs: fold the adapters into the weights (a plain model)."
    ),
) -> None:
    """Write a run's latest policy as a Hugging Face model directory (weights + tokenizer).

    Full fine-tunes and FSDP-sharded runs give a plain model; LoRA runs give their adapters, or
    with --merge a plain model with the adapters merged in.
    """
    needs("train", "klpo export")
    from klpo.train.config import ConfigError
    from klpo.train.tools.export import export_run

    with exits(1, OSError), exits(2, ConfigError, FileNotFoundError):
        path = export_run(run_dir, out, merge=merge, log=lambda m: typer.echo(m, err=True))
    typer.echo(f"wrote {path}")


def docs(
    out: Path = typer.Option(
        Path("docs"), "--out", metavar="DIR", help="Directory for the generated pages."
    ),
) -> None:
    """Regenerate the reference pages (estimators, metrics, config) from the code."""
    from klpo.train.config import ConfigError
    from klpo.train.outdir import claim_pages
    from klpo.train.tools.docs import HEADER, PAGES, write_pages

    with exits(2, ConfigError):
        claim_pages(out, list(PAGES), HEADER)  # only its own pages are replaced
    with full_disk_said("klpo docs", out):
        for path in write_pages(out):
            typer.echo(f"wrote {path}")


# What the two model-making commands share.


def _given(options: dict[str, Any], config: Any) -> dict[str, Any]:
    """The command's ``options`` (its parameters by name) that set a field of the tool's
    ``config``: each option named after a field, where it was given (not None)."""
    fields = {f.name for f in dataclasses.fields(config)}
    return {k: v for k, v in options.items() if k in fields and v is not None}


def _tool_config(config: type, given: dict[str, Any]) -> Any:
    """The tool's ``config``: its defaults with each option ``given`` in its place, or exit 2
    with the config's own error."""
    try:
        return dataclasses.replace(config(), **given)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


@contextlib.contextmanager
def _writing(command: str, out: str, units: int, *refused: type[Exception]) -> Iterator[Any]:
    """``klpo COMMAND`` writing into ``out`` under a progress bar of ``units``: a full disk is
    said in one message (exit 1); OUT holding something the tool would not overwrite
    (:mod:`klpo.train.outdir`), or one of ``refused``, is exit 2 with its error."""
    from klpo.train.config import ConfigError
    from klpo.train.runtime.progress import Progress

    with (
        exits(2, ConfigError, *refused),
        full_disk_said(f"klpo {command}", out),
        Progress(command, units) as bar,
    ):
        yield bar


# --------------------------------------------------------------------------------------------
# klpo make-reference: the tiny reference model of the built-in task.


def make_reference_cmd(
    out: str = typer.Argument(
        "runs/reference",
        metavar="OUT",
        help="Directory to write the model, tokenizer and reference.json into.",
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the reference model an earlier run wrote to OUT (its files; others stay).",
    ),
    steps: int | None = typer.Option(None, metavar="N", help="The most SFT steps."),
    seed: int | None = typer.Option(
        None, metavar="N", help="Seed of initialisation and data order."
    ),
    arch: str | None = typer.Option(None, metavar="ARCH", help="llama or qwen2."),
    hidden_size: int | None = typer.Option(None, metavar="N", help="Model width."),
    num_layers: int | None = typer.Option(None, metavar="N", help="Number of transformer blocks."),
    intermediate_size: int | None = typer.Option(None, metavar="N", help="MLP width."),
    batch_size: int | None = typer.Option(None, metavar="N", help="Problems per SFT step."),
    lr: float | None = typer.Option(None, metavar="LR", help="Peak SFT learning rate."),
    stop_at_accuracy: float | None = typer.Option(
        None,
        metavar="ACC",
        help="Stop SFT once the validation accuracy reaches this (0 = never stop early).",
    ),
    save_dtype: str | None = typer.Option(
        None, metavar="DTYPE", help="float32, bfloat16 or float16."
    ),
) -> None:
    """Train the tiny reference model of the built-in arithmetic task by seeded SFT and save it.

    With no options it reproduces the reference shipped in the package (and says whether the
    weights are bit-identical to it).
    """
    options = dict(locals())  # the parameters, before anything else is named here
    needs("train", "klpo make-reference")
    from klpo.train.tools import make_reference as reference

    given = _given(options, reference.ReferenceConfig)
    if given.get("stop_at_accuracy") == 0:
        given["stop_at_accuracy"] = None
    config = _tool_config(reference.ReferenceConfig, given)
    val = ["not yet measured"]

    def on_step(step: int, loss: float, val_accuracy: float | None) -> None:
        if val_accuracy is not None:
            val[0] = f"{val_accuracy:.3f} at step {step + 1}"
        bar.update(step + 1, info=f"loss {loss:.4f}  validation accuracy {val[0]}")

    with _writing("make-reference", out, config.steps) as bar:
        result = reference.make_reference(out, config, on_step=on_step, overwrite=overwrite)
    _print_reference(result, config, defaults=not given)


def _print_reference(result, config, *, defaults: bool) -> None:
    """What ``make-reference`` wrote: where, its size and accuracy, an early stop, and (built
    on the defaults) whether it is bit-identical to the shipped reference."""
    from klpo.train.tools import make_reference as reference

    out_console = console()
    if result.steps < config.steps:
        out_console.print(
            f"stopped after {result.steps} of {config.steps} SFT steps: validation accuracy "
            f"{result.val_accuracy:.3f} reached stop_at_accuracy {config.stop_at_accuracy}",
            highlight=False,
        )
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
    if defaults and result.path.resolve() != shipped.resolve():
        same = reference.same_weights(result.path, shipped)
        out_console.print(
            f"bit-identical to the shipped reference: {'yes' if same else 'no'}", highlight=False
        )


# --------------------------------------------------------------------------------------------
# klpo make-reward-model: a small learned proxy reward for the built-in task.


def make_reward_model_cmd(
    out: str = typer.Argument(..., metavar="OUT", help="Directory to write the reward model into."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the reward model an earlier run wrote to OUT (its files; others stay).",
    ),
    init: str | None = typer.Option(
        None,
        metavar="DIR",
        help="Causal-LM directory to start from (default: builtin, the shipped reference).",
    ),
    n_pairs: int | None = typer.Option(
        None, metavar="N", help="Labelled (right, wrong) pairs to train on."
    ),
    max_offset: int | None = typer.Option(
        None, metavar="N", help="Wrong answers: right one ± up to this."
    ),
    steps: int | None = typer.Option(None, metavar="N", help="Training steps."),
    lr: float | None = typer.Option(None, metavar="LR", help="AdamW learning rate."),
    seed: int | None = typer.Option(None, metavar="N", help="Seed of the pairs, batches and head."),
    n_eval: int | None = typer.Option(
        None, metavar="N", help="Held-out pairs the result is measured on."
    ),
) -> None:
    """Train a small reward model (a sequence classifier) on the built-in task from a limited
    labelled sample, a proxy reward for `rewards: [{name: model, path: OUT}]`."""
    options = dict(locals())  # the parameters, before anything else is named here
    needs("train", "klpo make-reward-model")
    from klpo.train.tools import make_reward_model as reward_model

    config_type = reward_model.RewardModelConfig
    config = _tool_config(config_type, _given(options, config_type))
    # FileNotFoundError: --init names no model directory (the error says which).
    with _writing("make-reward-model", out, reward_model.units(config), FileNotFoundError) as bar:
        result = reward_model.make_reward_model(out, config, overwrite=overwrite, progress=bar)
    console().print(
        f"wrote {result.path}: pairwise accuracy {result.train_pairwise_accuracy:.3f} on its "
        f"{config.n_pairs} training pairs, {result.heldout_pairwise_accuracy:.3f} on "
        f"{config.n_eval} held-out pairs (chance 0.5), {result.seconds:.1f} s",
        highlight=False,
    )
