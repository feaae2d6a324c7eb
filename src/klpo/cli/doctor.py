"""``klpo doctor`` (and the ``klpo-doctor`` script): what a framework's KL settings really do
(:mod:`klpo.doctor`), and with ``--model`` measured on the user's models (:mod:`klpo.measure`).

The light install runs it: this module imports the frameworks' table (no reader, no torch) and
the doctor's command only when called."""

from __future__ import annotations

import typer

from klpo.cli.common import free_cores, needs

# The frameworks are the rows of klpo.doctor.frameworks (importing the table imports no reader).
from klpo.doctor.frameworks import ROWS as _ROWS

# The doctor's options, one constant each: the command below reads as its parameters.
_CONFIG = typer.Argument(
    None,
    metavar="CONFIG...",
    help="A training config or launch script of "
    + ", ".join(r.title for r in _ROWS.values())
    + " (several: one report each). Optional with --model: klpo's default estimator and "
    "placement are then marked.",
)
_FRAMEWORK = typer.Option(
    None,
    "--framework",
    metavar="NAME",
    help=", ".join(_ROWS) + " (default: detected).",
)
_FRAMEWORK_VERSION = typer.Option(
    None,
    "--framework-version",
    metavar="VERSION",
    help="The framework version the config is for (warns if the doctor knows another).",
)
_AS_JSON = typer.Option(False, "--json", help="Print JSON for machines (--format json).")
_FMT = typer.Option(
    None, "--format", metavar="FORMAT", help="text, json, sarif or github (annotations)."
)
_FAIL_ON = typer.Option(
    "error",
    "--fail-on",
    metavar="LEVEL",
    help="Exit 1 on a finding at this level or above: error, warning or never.",
)
_MODEL = typer.Option(
    None, "--model", metavar="PATH", help="Policy to measure on: a model directory or a .gguf file."
)
_REFERENCE = typer.Option(
    None, "--reference", metavar="PATH", help="Reference: a model directory or a .gguf file."
)
_DATA = typer.Option(
    None,
    "--data",
    metavar="FILE",
    help="Prompts: JSONL with a 'prompt' field (a string, or a list of chat messages for "
    "--chat), or text lines.",
)
_LAYER = typer.Option(
    None,
    "--layer",
    metavar="PREFIX",
    help="Measure gradients on the linear layers whose name starts with this, or 'all' "
    "(default: the last decoder layer's MLP).",
)
_SKETCH = typer.Option(
    None,
    "--sketch",
    metavar="K",
    help="Sketch each weight matrix's gradient to K numbers, in blocks of 8×8 (K rounded down "
    "to a multiple of 64, at least 64; default 4096: 64 blocks; 0: exact).",
)
_CHAT = typer.Option(
    None,
    "--chat/--no-chat",
    help="Render the prompts with the tokenizer's chat template (default: a klpo config's "
    "data.chat, else off).",
)
_PROMPTS = typer.Option(8, "--prompts", metavar="N", help="Prompts taken from --data.")
_SAMPLES = typer.Option(8, "--samples", metavar="N", help="Completions sampled per prompt.")
_MAX_NEW_TOKENS = typer.Option(16, "--max-new-tokens", metavar="N", help="Longest completion.")
_SEED = typer.Option(0, "--seed", metavar="N", help="Sampling seed.")
_VARIABLES = typer.Option(
    None,
    "--var",
    metavar="NAME=VALUE",
    help="NAME=VALUE for a variable a launch script uses but does not define (repeatable).",
)
_SKIP_NON_CONFIGS = typer.Option(
    False,
    "--skip-non-configs",
    help="A file that is no training config of any framework (a CI workflow, a data file, an "
    "unrelated script) gets a note and counts as clean, not an error (exit 2): the pre-commit "
    "hook's setting.",
)


def doctor(
    config: list[str] | None = _CONFIG,
    framework: str | None = _FRAMEWORK,
    framework_version: str | None = _FRAMEWORK_VERSION,
    as_json: bool = _AS_JSON,
    fmt: str | None = _FMT,
    fail_on: str = _FAIL_ON,
    model: str | None = _MODEL,
    reference: str | None = _REFERENCE,
    data: str | None = _DATA,
    layer: str | None = _LAYER,
    sketch: int | None = _SKETCH,
    chat: bool | None = _CHAT,
    prompts: int = _PROMPTS,
    samples: int = _SAMPLES,
    max_new_tokens: int = _MAX_NEW_TOKENS,
    seed: int = _SEED,
    variables: list[str] | None = _VARIABLES,
    skip_non_configs: bool = _SKIP_NON_CONFIGS,
) -> None:
    """Say which KL a training config logs and which gradient it follows, and the klpo config for it."""
    if model is not None:
        needs("train", "klpo doctor --model")
        free_cores()
    from klpo.doctor.command import Measurement, run

    measurement = Measurement(
        model, reference, data, layer, sketch, chat, prompts, samples, max_new_tokens, seed
    )
    code = run(
        config or [],
        framework=framework,
        version=framework_version,
        as_json=as_json,
        measurement=measurement,
        variables=variables,
        fail_on=fail_on,
        fmt=fmt,
        skip_non_configs=skip_non_configs,
    )
    if code:
        raise typer.Exit(code)
