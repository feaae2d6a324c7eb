"""``klpo lab``: the estimator lab (:mod:`klpo.lab`) on the command line: Schulman's Gaussian
experiment, one categorical step, a tabular sequence model, and the default report."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from klpo.cli.common import console, exits, free_cores, full_disk_said, needs, print_json

# The options the commands share, one constant each.
_SEED = typer.Option(0, "--seed", metavar="N", help="Seed of the sampler.")
_AS_JSON = typer.Option(False, "--json", help="Print JSON for machines.")
_MONTE_CARLO = typer.Option(
    None,
    "--samples",
    "-n",
    metavar="N",
    min=1,
    help="Add a Monte Carlo section with this many samples.",
)

lab_app = typer.Typer(
    name="lab",
    help="The estimator lab: exact and Monte Carlo statistics of every KL estimator.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


def _probabilities(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a comma-separated list of numbers, e.g. 0.7,0.2,0.1",
            param_hint=option,
        ) from None


def _num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}g}"


def _pair_tables(record: dict, title: str) -> list[Table]:
    """People's view of a categorical or sequence record: values, then gradient cosines."""
    import torch

    from klpo.lab.stats import cosine, relative_error

    mc = record.get("monte_carlo")
    values = Table(
        title=f"{title}: KL(pi_theta ‖ pi_ref) = {_num(record['kl']['theta_ref'], 6)}, "
        f"KL(pi_ref ‖ pi_theta) = {_num(record['kl']['ref_theta'], 6)}",
        caption="Exact, by enumeration; bias against the KL the estimator targets."
        + (f" Monte Carlo: {mc['samples']:,} samples, seed {mc['seed']}." if mc else ""),
    )
    for col in ("estimator", "mean", "bias", "sd", "P(< 0)"):
        values.add_column(col, justify="left" if col == "estimator" else "right")
    if mc:
        values.add_column("Monte Carlo mean ± se", justify="right")
    for name, v in record["values"].items():
        row = [name, *(_num(v[k]) for k in ("mean", "bias", "sd", "frac_negative"))]
        if mc:
            m = mc["values"][name]
            row.append(f"{_num(m['mean'])} ± {_num(m['stderr'], 2)}")
        values.add_row(*row)
    grads = Table(
        title="Expected gradient with respect to the policy logits (exact)",
        caption="cos and relative error to grad KL(pi_theta ‖ pi_ref) and grad KL(pi_ref ‖ pi_theta).",
    )
    for col in ("estimator", "placement", "cos θ‖ref", "rel. err.", "cos ref‖θ", "rel. err."):
        grads.add_column(col, justify="left" if col in ("estimator", "placement") else "right")
    true = {k: torch.tensor(v, dtype=torch.float64) for k, v in record["gradients"]["true"].items()}
    for name, by_p in record["gradients"].items():
        if name == "true":
            continue
        for placement, g in by_p.items():
            g = torch.tensor(g, dtype=torch.float64)
            cells = []
            for key in ("theta_ref", "ref_theta"):
                c = cosine(g, true[key])
                cells += ["zero" if c != c else f"{c:.3f}", f"{relative_error(g, true[key]):.3g}"]
            grads.add_row(name, placement, *cells)
    return [values, grads]


def _print_pair(record: dict, title: str, as_json: bool, footer: str | None = None) -> None:
    """A categorical or sequence record: strict JSON for machines, or its tables (and a
    ``footer`` line) for people."""
    if as_json:
        print_json(record, allow_nan=False)
        return
    out = console()
    for table in _pair_tables(record, title):
        out.print(table)
    if footer is not None:
        out.print(footer, highlight=False)


@lab_app.command("gaussian")
def lab_gaussian(
    mu: float = typer.Option(
        1.0, "--mu", metavar="MU", help="pi_ref = N(mu, 1); pi_theta = N(0, 1)."
    ),
    samples: int = typer.Option(
        1_000_000, "--samples", "-n", metavar="N", min=1, help="Monte Carlo samples."
    ),
    seed: int = _SEED,
    as_json: bool = _AS_JSON,
) -> None:
    """Schulman's experiment: every estimator on N(0, 1) vs N(mu, 1), true KL mu²/2."""
    free_cores()
    from klpo.lab.distributions import SpecError
    from klpo.lab.summaries import gaussian_summary

    try:
        record = gaussian_summary(mu, samples, seed)
    except SpecError as err:
        raise typer.BadParameter(str(err), param_hint="--mu") from None
    if as_json:
        print_json(record, allow_nan=False)
        return
    table = Table(
        title=f"pi_theta = N(0, 1), pi_ref = N({mu:g}, 1), true KL = {record['true_kl']:.6g}",
        caption=f"Monte Carlo, {samples:,} samples per sampler, seed {seed}; per-sample statistics.",
    )
    cols = ("mean", "bias", "sd", "rmse", "bias_rel", "sd_rel", "frac_negative")
    table.add_column("estimator")
    for col in cols:
        table.add_column(col, justify="right")
    for name, v in record["estimators"].items():
        table.add_row(name, *(_num(v[c]) for c in cols))
    console().print(table)


@lab_app.command("categorical")
def lab_categorical(
    pi: str = typer.Option(
        ..., "--pi", metavar="P1,P2,...", help="pi_theta's probabilities, e.g. 0.7,0.2,0.1."
    ),
    ref: str = typer.Option(
        ..., "--ref", metavar="P1,P2,...", help="pi_ref's probabilities, same outcomes and order."
    ),
    samples: int | None = _MONTE_CARLO,
    seed: int = _SEED,
    as_json: bool = _AS_JSON,
) -> None:
    """Every estimator on one categorical step: exact values and expected gradients."""
    free_cores()
    from klpo.lab.distributions import SequencePair, SpecError
    from klpo.lab.summaries import pair_summary

    p, r = _probabilities(pi, "--pi"), _probabilities(ref, "--ref")
    try:
        pair = SequencePair.from_probabilities(p, r, names=("--pi", "--ref"))
    except SpecError as err:
        raise typer.BadParameter(str(err)) from None
    record = pair_summary(pair, samples, seed)
    _print_pair(record, f"pi_theta = ({pi}), pi_ref = ({ref})", as_json)


@lab_app.command("sequence")
def lab_sequence(
    spec: str = typer.Option(
        ...,
        "--spec",
        metavar="FILE",
        help='A JSON file: {"vocab": V, "length": T, "policy": {prefix: [V logits]}, '
        '"reference": {...}}, prefixes as space-separated token ids ("" for the root).',
    ),
    samples: int | None = _MONTE_CARLO,
    seed: int = _SEED,
    as_json: bool = _AS_JSON,
) -> None:
    """Every estimator on a tabular autoregressive model, enumerated: exact values and gradients.

    Values and KLs are over whole sequences; "reward" is the detached per-token estimate as a
    reward with returns-to-go (REINFORCE, gamma 1), "loss" the per-token term summed over the
    sequence and differentiated with the samples held fixed.
    """
    free_cores()
    from klpo.lab.distributions import SequencePair, SpecError
    from klpo.lab.summaries import pair_summary

    path = Path(spec)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise typer.BadParameter(
            f"cannot read {spec}: {err.strerror}", param_hint="--spec"
        ) from None
    except json.JSONDecodeError as err:
        raise typer.BadParameter(
            f"{spec} is not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}",
            param_hint="--spec",
        ) from None
    try:
        pair = SequencePair.from_spec(data)
    except SpecError as err:
        raise typer.BadParameter(f"{spec}: {err}", param_hint="--spec") from None
    record = pair_summary(pair, samples, seed)
    prefixes = ", ".join(repr(" ".join(map(str, p))) for p in pair.prefixes)
    _print_pair(
        record,
        f"vocab {pair.vocab}, length {pair.length}, {pair.num_sequences} sequences",
        as_json,
        footer=f"Gradient rows (prefixes) in order: {prefixes}",
    )


@lab_app.command("report")
def lab_report(
    out_dir: str = typer.Option(
        ..., "--out", metavar="DIR", help="Folder for report.md, results.json and plots."
    ),
    quick: bool = typer.Option(False, "--quick", help="A small preset for smoke tests (seconds)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace the report already in --out (only a report)."
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Base seed of every experiment."),
    training: str | None = typer.Option(
        None,
        "--training",
        metavar="RESULTS_CSV",
        help="A klpo compare study's results.csv with ref_is and adaptive_mix runs: judge the "
        "training claim on it.",
    ),
) -> None:
    """Run the default suite and write DIR/report.md, DIR/results.json and PNG plots."""
    needs("train", "klpo lab report")
    free_cores()
    from klpo.lab.report import PLOTS, PRESETS, run_report
    from klpo.train.config import ConfigError
    from klpo.train.outdir import claim_dir
    from klpo.train.runtime.progress import Progress

    with exits(2, ConfigError):
        claim_dir(out_dir, "lab report", proceed=overwrite)
    preset = PRESETS["quick" if quick else "default"]
    out = console()
    typer.echo(f"klpo lab report: {preset.units} units of work into {out_dir}", err=True)
    with (
        full_disk_said("klpo lab report", out_dir),
        Progress("lab report", preset.units, weights=preset.unit_weights()) as bar,
    ):
        results = run_report(
            Path(out_dir),
            preset,
            seed=seed,
            progress=lambda done, what: bar.update(done, part=what),
            training=Path(training) if training else None,
        )
    verdicts = Table(title='Claims about "K2" and "K3": which hold (report.md, docs/claims.md)')
    verdicts.add_column("#", justify="right")
    verdicts.add_column("claim")
    verdicts.add_column("verdict")
    for i, v in enumerate(results["verdicts"], 1):
        verdicts.add_row(str(i), v["claim"], v["verdict"])
    out.print(verdicts)
    files = ["report.md", "results.json", *PLOTS.values()]
    out.print(
        f"Wrote {', '.join(files)} to {out_dir} in {results['timings_s']['total']:.0f} s.",
        highlight=False,
    )
