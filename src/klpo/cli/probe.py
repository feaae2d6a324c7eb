"""``klpo probe``: is the log-prob right? The step-0 identities and the invariances of the
trainer's log-prob path on the user's own model (:mod:`klpo.measure.probe`).

Exit status: 0 every check passed, 1 one failed, 2 bad input (an option, a model that does not
load, a prompts file that does not read)."""

from __future__ import annotations

import typer

from klpo.cli.common import free_cores, needs, print_json

_MODEL = typer.Argument(
    ...,
    metavar="MODEL",
    help="The policy: a model directory, a model id (fetched by transformers) or a .gguf file.",
)
_REFERENCE = typer.Option(
    None,
    "--reference",
    metavar="PATH",
    help="A reference to check too: the exact KL to it, required to be 0 when its weights are "
    "the policy's.",
)
_ADAPTER = typer.Option(
    None,
    "--adapter",
    metavar="DIR",
    help="LoRA adapters on the policy (peft's directory); adapters off is checked against the "
    "base model.",
)
_DATA = typer.Option(
    None,
    "--data",
    metavar="FILE",
    help="Prompts: JSONL with a 'prompt' field, or text lines (default: klpo's chat-arithmetic "
    "prompts).",
)
_CHAT = typer.Option(
    None,
    "--chat/--no-chat",
    help="Render the prompts with the tokenizer's chat template (default: on for the built-in "
    "prompts when the tokenizer has one, off for --data).",
)
_PROMPTS = typer.Option(4, "--prompts", metavar="N", help="Prompts sampled.")
_SAMPLES = typer.Option(
    2, "--samples", metavar="N", help="Completions per prompt (2 or more: a shared prompt)."
)
_MAX_NEW_TOKENS = typer.Option(16, "--max-new-tokens", metavar="N", help="Longest completion.")
_SEED = typer.Option(0, "--seed", metavar="N", help="Sampling seed.")
_THRESHOLD = typer.Option(
    None,
    "--threshold",
    metavar="NAME=VALUE",
    help="A check's threshold, or a kind's (identity=0, invariance=0.0001, reference=0, "
    "engine=0.001 by default, float32); repeatable.",
)
_AS_JSON = typer.Option(False, "--json", help="Print JSON for machines.")


def probe(
    model: str = _MODEL,
    reference: str | None = _REFERENCE,
    adapter: str | None = _ADAPTER,
    data: str | None = _DATA,
    chat: bool | None = _CHAT,
    prompts: int = _PROMPTS,
    samples: int = _SAMPLES,
    max_new_tokens: int = _MAX_NEW_TOKENS,
    seed: int = _SEED,
    threshold: list[str] | None = _THRESHOLD,
    as_json: bool = _AS_JSON,
) -> None:
    """Check that the trainer's log-probs of your model are right: the step-0 ratio and KL,
    micro-batch, padding, order and packing invariance, the reference, an engine."""
    needs("train", "klpo probe")
    free_cores()
    from klpo.measure import MeasureError
    from klpo.measure.probe import probe as run_probe
    from klpo.measure.probe import read_thresholds, render_probe

    try:
        limits = read_thresholds(threshold or [])
        result = run_probe(
            model,
            reference=reference,
            adapter=adapter,
            data=data,
            chat=chat,
            prompts=prompts,
            samples=samples,
            max_new_tokens=max_new_tokens,
            seed=seed,
            thresholds=limits,
            say=lambda line: typer.echo(line, err=True),
        )
    except MeasureError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        print_json(result, allow_nan=False)
    else:
        typer.echo(render_probe(result))
    if not result["passed"]:
        raise typer.Exit(1)
