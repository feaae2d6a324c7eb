"""The `klpo` command line: one sub-command per job.

Every klpo import happens inside the command that needs it, so ``klpo --help`` and ``klpo
doctor`` import no torch, and the light install (``pip install klpo``: no torch, no
transformers) runs them. A command that needs the library or the trainer's stack and finds it
missing exits 1 naming the install that brings it (:mod:`klpo._extras`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table


def _full_disk_said(command: str, out: str | Path):
    """A context manager: a full disk while ``command`` writes into ``out`` becomes one message
    (the file, the free space, what is left, how to go on) and exit 1, not a traceback."""
    import contextlib

    @contextlib.contextmanager
    def said():
        from klpo.train.runtime.checkpoint import disk_full, format_size

        try:
            yield
        except OSError as err:
            if not disk_full(err):
                raise
            import shutil

            probe = Path(out)
            while not probe.is_dir() and probe.parent != probe:
                probe = probe.parent
            free = format_size(shutil.disk_usage(probe).free)
            name = f" {err.filename}" if getattr(err, "filename", None) else ""
            typer.echo(
                f"error: {command} could not write{name} into {out}: No space left on device "
                f"({free} free there). klpo writes each file whole or not at all (and a model "
                "directory whole), so every file there is its old or its new self and nothing "
                "half-written is left; free space and run the command again",
                err=True,
            )
            raise typer.Exit(1) from None

    return said()


app = typer.Typer(
    name="klpo",
    help="KL-regularised policy optimisation for language models: estimators, lab, trainer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


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


def _needs(extra: str, command: str) -> None:
    """Exit 1, naming ``pip install 'klpo[EXTRA]'``, when ``command`` needs ``extra``'s
    packages and one is not installed (found without importing it)."""
    from klpo._extras import missing, missing_message

    absent = missing(extra)
    if absent:
        typer.echo(f"error: {missing_message(command, extra, absent)}", err=True)
        raise typer.Exit(1)


def _free_cores() -> None:
    """Torch threads from the cores free now, with one line on stderr when the machine is loaded
    (:mod:`klpo._threads`; ``klpo train`` does the same through ``run.threads=0``)."""
    from klpo._threads import use_free_cores

    use_free_cores(log=lambda msg: typer.echo(msg, err=True))


def console() -> Console:
    """A console that does not wrap tables to 80 columns when stdout is a file or pipe (unless
    ``COLUMNS`` sets the width)."""
    c = Console()
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(width=200)


@app.command()
def explain(
    estimator: str | None = typer.Option(
        None, "--estimator", "-e", metavar="NAME", help="A KL estimator (see --all for the list)."
    ),
    placement: str | None = typer.Option(
        None,
        "--placement",
        "-p",
        metavar="PLACEMENT",
        help="reward, loss or reward+loss; all three if omitted.",
    ),
    all_: bool = typer.Option(False, "--all", help="Explain every estimator in every placement."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
    off_policy: bool = typer.Option(
        False, "--off-policy", help="Tokens sampled from an older policy pi_old, not pi_theta."
    ),
    staleness: int | None = typer.Option(
        None,
        "--staleness",
        "-k",
        metavar="K",
        min=0,
        help="Tokens from a sampler K policy versions behind pi_theta (asynchronous RL): the "
        "expected gradient of each estimator × placement under each correction of the sampler "
        "gap, on categoricals and sequence models (klpo.lab.staleness); every estimator when "
        "--estimator is not given.",
    ),
    cap: float = typer.Option(
        10.0, "--cap", metavar="C", help="With --staleness: the is-cap weight's cap C (> 0)."
    ),
    step: float = typer.Option(
        0.2,
        "--step",
        metavar="SD",
        help="With --staleness: the sd of one policy version's step in logit space (> 0).",
    ),
    teacher: bool = typer.Option(
        False,
        "--teacher",
        help="On-policy distillation: each teacher term (sampled, exact, JSD, top-k with verl's "
        "clamps) with the divergence and gradient it follows per position and over a "
        "sequence, by exact enumeration (klpo.lab.teacher).",
    ),
) -> None:
    """Say what a KL estimator in a placement really does: value, bias, sign and gradient.

    Every claim is derived by exact enumeration on small categoricals, not typed in.
    """
    from klpo import kl

    if teacher:
        from klpo.lab import teacher as opd

        if as_json:
            json.dump(opd.to_json(), sys.stdout, indent=2, ensure_ascii=False)
            sys.stdout.write("\n")
        else:
            console().print(opd.render(), highlight=False, soft_wrap=True)
        return
    if staleness is not None:
        if off_policy:
            raise typer.BadParameter(
                "--off-policy and --staleness ask different questions (pi_old with no "
                "correction; a sampler K versions behind, under each correction): give one",
                param_hint="--staleness",
            )
        _explain_staleness(estimator, placement, staleness, cap, step, as_json)
        return

    if not all_ and estimator is None:
        raise typer.BadParameter(
            "give --estimator NAME (and optionally --placement), or --all; estimators: "
            + ", ".join(kl.ESTIMATORS),
            param_hint="--estimator",
        )
    names = list(kl.ESTIMATORS) if all_ or estimator is None else [estimator]
    placements = list(kl.PLACEMENTS) if placement is None else [placement]
    # Estimators from the reference's samples go only in the loss; unasked-for placements are
    # skipped, and the refusal of one asked for is the error.
    pairs = [
        (n, p)
        for n in names
        for p in placements
        if placement is not None or kl.refusal(n, p) is None
    ]
    try:
        rows = [kl.explain(n, p, on_policy=not off_policy) for n, p in pairs]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None

    if as_json:
        _print_rows_json(rows)
        return
    out = console()
    if len(rows) <= len(kl.PLACEMENTS) and len(names) == 1:
        out.print("\n\n".join(r.text() for r in rows), highlight=False)
        return
    shown = kl.PLACEMENTS if placement is None else placements
    wide = _table(rows, shown, off_policy)
    if Console(width=10_000).measure(wide).maximum <= out.width:  # its natural width fits
        out.print(wide)
        return
    # A narrow terminal: the compact layout (the directions spelled short, values listed below)
    # rather than cells cut to "KL(pi_…", where the two directions cannot be told apart.
    out.print(_narrow_table(rows, shown, off_policy))
    for line in _value_lines(rows, out.width):
        out.print(line, highlight=False)


def _print_rows_json(rows: list) -> None:
    """``--json``: the rows' dictionaries, one JSON list on stdout."""
    json.dump([r.to_dict() for r in rows], sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


def _explain_staleness(
    estimator: str | None,
    placement: str | None,
    k: int,
    cap: float,
    step: float,
    as_json: bool,
) -> None:
    """``klpo explain --staleness K``: one table per family of cases (categoricals, sequences)."""
    from klpo.lab import staleness as st

    try:
        rows = st.staleness_rows(
            k,
            estimators=None if estimator is None else [estimator],
            placements=None if placement is None else [placement],
            cap=cap,
            step=step,
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if as_json:
        _print_rows_json(rows)
        return
    out = console()
    for setting, words in (
        ("categorical", "4 seeded categoricals, V = 6"),
        ("sequence", "the sequence oracle (V = 2, T = 2) and 2 seeded models (V = 3, T = 3)"),
    ):
        mine = [r for r in rows if r.setting == setting]
        first = mine[0]
        table = Table(
            title=f"Tokens from a sampler {k} version(s) behind pi_theta: {words}; "
            f"KL(pi_behav ‖ pi_theta) {first.kl_behav_theta:.3g}, largest weight "
            f"pi_theta/pi_behav {first.max_weight:.3g}",
            caption="Each cell: the cosine of the exact expected gradient to grad KL(pi_theta ‖ "
            "pi_ref) ('zero': no gradient), then its distance to the same term's on-policy "
            "gradient ('=': none, up to rounding). Corrections: none (no weight: verl, klpo's "
            "pi_old weight when pi_old is recomputed), is (sg(pi_theta/pi_behav)), is-cap "
            f"(capped at {cap:g}), is-seq (the prefix's product), behav-anchor (AReaL: the "
            "reward's estimate from the behaviour log-probs). klpo.lab.staleness.",
        )
        table.add_column("estimator", style="bold")
        table.add_column("placement")
        corrections = list(dict.fromkeys(r.correction for r in mine))
        for c in corrections:
            table.add_column(c)
        by_term: dict[tuple[str, str], dict[str, str]] = {}
        for r in mine:
            by_term.setdefault((r.estimator, r.placement), {})[r.correction] = st.cell(r)
        for (name, place), cells in by_term.items():
            table.add_row(name, place, *[cells.get(c, "—") for c in corrections])
        out.print(table)


_SHORT = (
    ("grad KL(pi_theta ‖ pi_ref)", "∇KL(θ‖ref)"),
    ("grad KL(pi_ref ‖ pi_theta)", "∇KL(ref‖θ)"),
    ("KL(pi_theta ‖ pi_ref)", "KL(θ‖ref)"),
    ("KL(pi_ref ‖ pi_theta)", "KL(ref‖θ)"),
    ("other (biased)", "other"),
)


def _short(text: str) -> str:
    for long, short in _SHORT:
        text = text.replace(long, short)
    return text


def _narrow_table(rows: list, placements: list[str] | tuple[str, ...], off_policy: bool) -> Table:
    """:func:`_table` in under 80 columns: KL(θ‖ref) is KL(pi_theta ‖ pi_ref), KL(ref‖θ) the
    other direction, ∇ its gradient; the values follow the table (:func:`_value_lines`)."""
    from rich import box

    sampling = "pi_old" if off_policy else "pi_theta"
    table = Table(
        title=f"KL estimators, tokens from {sampling}; θ = pi_theta, ref = pi_ref",
        caption="'*': not the gradient of the KL it estimates. Exact enumeration "
        "(klpo.kl.explain).",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("estimator", style="bold")
    table.add_column("estimates")
    table.add_column("unb.")
    table.add_column("≥0")
    for p in placements:
        table.add_column({"reward+loss": "rwd+loss"}.get(p, p))
    by_name: dict[str, list] = {}
    for r in rows:
        by_name.setdefault(r.estimator, []).append(r)
    for name, rs in by_name.items():
        first = rs[0]
        table.add_row(
            name,
            _short(first.estimates),
            "yes" if first.unbiased else "no",
            "yes" if first.nonnegative else "no",
            *[_short(r.gradient) + (" *" if r.mismatch else "") for r in rs],
        )
    return table


def _value_lines(rows: list, width: int) -> list[str]:
    """``name: value`` of each estimator, d = logp - logp_ref, wrapped to ``width``."""
    import textwrap

    seen = dict.fromkeys((r.estimator, r.equation) for r in rows)
    text = "Values, d = logp - logp_ref: " + "; ".join(f"{n}: {eq}" for n, eq in seen) + "."
    return textwrap.wrap(text, width=width, break_on_hyphens=False)


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
    config: list[Path] = typer.Option(
        [],
        "--config",
        "-c",
        metavar="FILE",
        help="YAML config (see configs/ and docs/config.md); built-in defaults if omitted. "
        "Repeatable: the files merge in order, section by section, a later one winning "
        "(e.g. -c configs/grpo-lora.yaml -c my-data.yaml).",
    ),
    overrides: list[str] = typer.Option(
        [],
        "--set",
        "-s",
        metavar="KEY=VALUE",
        help="Override a config key, e.g. --set kl.beta=0.02 or --set optim.lr=1e-6 "
        "(repeatable; the value is YAML).",
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="RUN_DIR",
        help="Continue the run in this directory from its last checkpoint.",
    ),
    allow_config_change: bool = typer.Option(
        False,
        "--allow-config-change",
        help="With --resume: continue even though the config or the number of processes "
        "changed (recorded in the run's config-changes.jsonl).",
    ),
    print_config: bool = typer.Option(
        False,
        "--print-config",
        help="Print the resolved config (the defaults, then each --config, then --set) as YAML, "
        "each value a file or --set gave followed by a comment naming it, and exit.",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="Run every check a run makes before it loads a model or writes a file (config, run "
        "directory, model and tokenizer files, prompts, reward functions), then exit: 0 when "
        "the run would start.",
    ),
) -> None:
    """Train a policy with GRPO, PPO, RLOO or REINFORCE++ (the project's main job).

    The config has the sections model, data, rewards, gold_reward, rollout, algo, kl, optim,
    run and dist: every key, its default and meaning is in docs/config.md, and --print-config
    shows them all as this run would use them. A run writes into run.out_dir (default
    runs/train; a new run never reuses a directory that holds another run: give each its own
    with --set run.out_dir=DIR, as `make run` does, or continue one with --resume).

    Under torchrun (`torchrun --nproc_per_node 2 -m klpo train ...`) it runs data-parallel;
    with `--set dist.strategy=fsdp` the models are sharded (docs/real-models.md). Ctrl-C or
    SIGTERM stops it after the current step with a checkpoint. A model or dataset id is
    fetched from the Hugging Face Hub as transformers and datasets fetch it; HF_HUB_OFFLINE=1
    keeps to the local cache.
    """
    _needs("train", "klpo train")
    layered = _train_config(config, overrides, resume, allow_config_change)
    if print_config:
        from klpo.train.config_files import annotated_yaml

        typer.echo(annotated_yaml(layered), nl=False)
        return
    import os

    if layered.layers and os.environ.get("RANK", "0") == "0":  # the run's first line
        typer.echo(f"config: {layered.order()} (--print-config says which gave each key)", err=True)
    _train_or_check(layered.config, resume is not None, allow_config_change, check)


def _train_config(
    config: list[Path], overrides: list[str], resume: Path | None, allow_config_change: bool
):
    """The config of ``klpo train``'s options (a resume's saved one by default), with each
    key's source (:class:`klpo.train.config_files.Layered`), or exit 2."""
    from klpo.train.config import ConfigError
    from klpo.train.config_files import load_configs
    from klpo.train.preflight import empty_config_warning

    try:
        if resume is not None:
            saved = resume / "config.yaml"
            if not saved.is_file():
                raise ConfigError(f"--resume {resume}: no config.yaml there, so no run to resume")
            _resume_in_place(resume, overrides)
            layered = load_configs(config or [saved], [*overrides, f"run.out_dir={resume}"])
        else:
            layered = load_configs(config, overrides)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    if allow_config_change and resume is None:
        typer.echo("error: --allow-config-change only applies with --resume DIR", err=True)
        raise typer.Exit(2)
    for path in config:
        empty = empty_config_warning(path)
        if empty and len(config) > 1:  # the other files still count
            empty = f"config file {str(path)!r} is empty: it changes nothing"
        if empty:
            typer.echo(f"warning: {empty}", err=True)
    return layered


def _resume_in_place(resume: Path, overrides: list[str]) -> None:
    """``--resume DIR`` continues DIR where it is: a ``--set run.out_dir=OTHER`` naming another
    directory is refused (it would be ignored, and DIR's checkpoints pruned), with the way to
    branch the run into OTHER."""
    from klpo.train.config import ConfigError

    for o in overrides:
        key, _, value = o.partition("=")
        if key.strip() != "run.out_dir":
            continue
        other = Path(value.strip().strip("'\""))
        if other.resolve() != resume.resolve():
            raise ConfigError(
                f"--resume {resume} continues that run in place, so run.out_dir={other} cannot "
                f"apply: drop the --set to continue {resume}; to branch the run into {other}, "
                f"copy it first (cp -r {resume} {other}) and resume the copy (klpo train "
                f"--resume {other})"
            )


def _train_or_check(cfg, resume: bool, allow_config_change: bool, check: bool) -> None:
    """Run the training (or with ``check`` only its checks), its errors as exit codes."""
    import os

    from klpo.train.config import ConfigError
    from klpo.train.loop import TrainingDiverged, check_run
    from klpo.train.loop import train as run_training
    from klpo.train.rewards.functions import RewardError
    from klpo.train.runtime.dist import PeerFailed
    from klpo.train.runtime.stop import Interrupted

    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    who = f"rank {rank}: " if rank is not None else ""
    log = lambda msg: typer.echo(msg, err=True)  # noqa: E731
    try:
        if check:
            check_run(cfg, resume=resume, log=log, allow_config_change=allow_config_change)
            typer.echo(
                f"check passed: {cfg.algo.name} for {cfg.run.steps} steps into "
                f"{cfg.run.out_dir} would start",
                err=True,
            )
            return
        run_training(cfg, resume=resume, log=log, allow_config_change=allow_config_change)
    except Interrupted as err:
        typer.echo(f"{who}{err}", err=True)
        raise typer.Exit(err.exit_code) from None
    except TrainingDiverged as err:
        typer.echo(f"{who}diverged: {err}", err=True)
        raise typer.Exit(3) from None
    except PeerFailed as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(1) from None
    except (ConfigError, RewardError, OSError, ValueError) as err:
        typer.echo(f"{who}error: {err}", err=True)
        raise typer.Exit(1) from None


@app.command(cls=Command)
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
    _needs("train", "klpo export")
    from klpo.train.config import ConfigError
    from klpo.train.tools.export import export_run

    try:
        path = export_run(run_dir, out, merge=merge, log=lambda m: typer.echo(m, err=True))
    except (ConfigError, FileNotFoundError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    except OSError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {path}")


@app.command()
def docs(
    out: Path = typer.Option(
        Path("docs"), "--out", metavar="DIR", help="Directory for the generated pages."
    ),
) -> None:
    """Regenerate the reference pages (estimators, metrics, config) from the code."""
    from klpo.train.config import ConfigError
    from klpo.train.outdir import claim_pages
    from klpo.train.tools.docs import HEADER, PAGES, write_pages

    try:
        claim_pages(out, list(PAGES), HEADER)  # only its own pages are replaced
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    with _full_disk_said("klpo docs", out):
        for path in write_pages(out):
            typer.echo(f"wrote {path}")


# --------------------------------------------------------------------------------------------
# klpo lab: the estimator lab (klpo.lab).

lab_app = typer.Typer(
    name="lab",
    help="The estimator lab: exact and Monte Carlo statistics of every KL estimator.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(lab_app, name="lab")


def _lab_probabilities(text: str, option: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not a comma-separated list of numbers, e.g. 0.7,0.2,0.1",
            param_hint=option,
        ) from None


def _lab_print_json(record: dict) -> None:
    json.dump(record, sys.stdout, indent=2, ensure_ascii=False, allow_nan=False)
    sys.stdout.write("\n")


def _lab_num(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "—"
    return f"{x:.{digits}g}"


def _lab_pair_tables(record: dict, title: str) -> list[Table]:
    """People's view of a categorical or sequence record: values, then gradient cosines."""
    import torch

    from klpo.lab.stats import cosine, relative_error

    mc = record.get("monte_carlo")
    values = Table(
        title=f"{title}: KL(pi_theta ‖ pi_ref) = {_lab_num(record['kl']['theta_ref'], 6)}, "
        f"KL(pi_ref ‖ pi_theta) = {_lab_num(record['kl']['ref_theta'], 6)}",
        caption="Exact, by enumeration; bias against the KL the estimator targets."
        + (f" Monte Carlo: {mc['samples']:,} samples, seed {mc['seed']}." if mc else ""),
    )
    for col in ("estimator", "mean", "bias", "sd", "P(< 0)"):
        values.add_column(col, justify="left" if col == "estimator" else "right")
    if mc:
        values.add_column("Monte Carlo mean ± se", justify="right")
    for name, v in record["values"].items():
        row = [name, *(_lab_num(v[k]) for k in ("mean", "bias", "sd", "frac_negative"))]
        if mc:
            m = mc["values"][name]
            row.append(f"{_lab_num(m['mean'])} ± {_lab_num(m['stderr'], 2)}")
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


@lab_app.command("gaussian")
def lab_gaussian(
    mu: float = typer.Option(
        1.0, "--mu", metavar="MU", help="pi_ref = N(mu, 1); pi_theta = N(0, 1)."
    ),
    samples: int = typer.Option(
        1_000_000, "--samples", "-n", metavar="N", min=1, help="Monte Carlo samples."
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the sampler."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Schulman's experiment: every estimator on N(0, 1) vs N(mu, 1), true KL mu²/2."""
    _free_cores()
    from klpo.lab.distributions import SpecError
    from klpo.lab.summaries import gaussian_summary

    try:
        record = gaussian_summary(mu, samples, seed)
    except SpecError as err:
        raise typer.BadParameter(str(err), param_hint="--mu") from None
    if as_json:
        _lab_print_json(record)
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
        table.add_row(name, *(_lab_num(v[c]) for c in cols))
    console().print(table)


@lab_app.command("categorical")
def lab_categorical(
    pi: str = typer.Option(
        ..., "--pi", metavar="P1,P2,...", help="pi_theta's probabilities, e.g. 0.7,0.2,0.1."
    ),
    ref: str = typer.Option(
        ..., "--ref", metavar="P1,P2,...", help="pi_ref's probabilities, same outcomes and order."
    ),
    samples: int | None = typer.Option(
        None,
        "--samples",
        "-n",
        metavar="N",
        min=1,
        help="Add a Monte Carlo section with this many samples.",
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the sampler."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Every estimator on one categorical step: exact values and expected gradients."""
    _free_cores()
    from klpo.lab.distributions import SequencePair, SpecError
    from klpo.lab.summaries import pair_summary

    p, r = _lab_probabilities(pi, "--pi"), _lab_probabilities(ref, "--ref")
    try:
        pair = SequencePair.from_probabilities(p, r, names=("--pi", "--ref"))
    except SpecError as err:
        raise typer.BadParameter(str(err)) from None
    record = pair_summary(pair, samples, seed)
    if as_json:
        _lab_print_json(record)
        return
    out = console()
    for table in _lab_pair_tables(record, f"pi_theta = ({pi}), pi_ref = ({ref})"):
        out.print(table)


@lab_app.command("sequence")
def lab_sequence(
    spec: str = typer.Option(
        ...,
        "--spec",
        metavar="FILE",
        help='A JSON file: {"vocab": V, "length": T, "policy": {prefix: [V logits]}, '
        '"reference": {...}}, prefixes as space-separated token ids ("" for the root).',
    ),
    samples: int | None = typer.Option(
        None,
        "--samples",
        "-n",
        metavar="N",
        min=1,
        help="Add a Monte Carlo section with this many samples.",
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the sampler."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON for machines."),
) -> None:
    """Every estimator on a tabular autoregressive model, enumerated: exact values and gradients.

    Values and KLs are over whole sequences; "reward" is the detached per-token estimate as a
    reward with returns-to-go (REINFORCE, gamma 1), "loss" the per-token term summed over the
    sequence and differentiated with the samples held fixed.
    """
    _free_cores()
    from pathlib import Path

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
    if as_json:
        _lab_print_json(record)
        return
    out = console()
    prefixes = ", ".join(repr(" ".join(map(str, p))) for p in pair.prefixes)
    tables = _lab_pair_tables(
        record, f"vocab {pair.vocab}, length {pair.length}, {pair.num_sequences} sequences"
    )
    for table in tables:
        out.print(table)
    out.print(f"Gradient rows (prefixes) in order: {prefixes}", highlight=False)


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
    _needs("train", "klpo lab report")
    _free_cores()
    from pathlib import Path

    from klpo.lab.report import PLOTS, PRESETS, run_report
    from klpo.train.config import ConfigError
    from klpo.train.outdir import claim_dir
    from klpo.train.runtime.progress import Progress

    try:
        claim_dir(out_dir, "lab report", proceed=overwrite)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    preset = PRESETS["quick" if quick else "default"]
    out = console()
    typer.echo(f"klpo lab report: {preset.units} units of work into {out_dir}", err=True)
    with (
        _full_disk_said("klpo lab report", out_dir),
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


# --------------------------------------------------------------------------------------------
# klpo make-reference: the tiny reference model of the built-in task.


@app.command("make-reference", cls=Command)
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
    _needs("train", "klpo make-reference")
    import dataclasses

    from klpo.train.runtime.progress import Progress
    from klpo.train.tools import make_reference as reference

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
    val = ["not yet measured"]

    def on_step(step: int, loss: float, val_accuracy: float | None) -> None:
        if val_accuracy is not None:
            val[0] = f"{val_accuracy:.3f} at step {step + 1}"
        bar.update(step + 1, info=f"loss {loss:.4f}  validation accuracy {val[0]}")

    from klpo.train.config import ConfigError

    try:
        with (
            _full_disk_said("klpo make-reference", out),
            Progress("make-reference", config.steps) as bar,
        ):
            result = reference.make_reference(out, config, on_step=on_step, overwrite=overwrite)
    except ConfigError as err:  # OUT holds something it would not overwrite (klpo.train.outdir)
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    _print_reference(result, config, defaults=not overrides)


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


@app.command("make-reward-model", cls=Command)
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
    _needs("train", "klpo make-reward-model")
    import dataclasses

    from klpo.train.runtime.progress import Progress
    from klpo.train.tools import make_reward_model as reward_model

    overrides = {
        k: v
        for k, v in dict(
            init=init,
            n_pairs=n_pairs,
            max_offset=max_offset,
            steps=steps,
            lr=lr,
            seed=seed,
            n_eval=n_eval,
        ).items()
        if v is not None
    }
    try:
        config = dataclasses.replace(reward_model.RewardModelConfig(), **overrides)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    from klpo.train.config import ConfigError

    try:
        with (
            _full_disk_said("klpo make-reward-model", out),
            Progress("make-reward-model", reward_model.units(config)) as bar,
        ):
            result = reward_model.make_reward_model(out, config, overwrite=overwrite, progress=bar)
    except (ConfigError, FileNotFoundError) as err:  # OUT, or --init: the error says which
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    console().print(
        f"wrote {result.path}: pairwise accuracy {result.train_pairwise_accuracy:.3f} on its "
        f"{config.n_pairs} training pairs, {result.heldout_pairwise_accuracy:.3f} on "
        f"{config.n_eval} held-out pairs (chance 0.5), {result.seconds:.1f} s",
        highlight=False,
    )


# --------------------------------------------------------------------------------------------
# klpo compare: the estimator stability study on real training.


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

    try:
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
    except (ConfigError, ValueError) as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None


@app.command()
def compare(
    out: Path = typer.Option(
        Path("runs/compare"), "--out", "-o", metavar="DIR", help="Study output directory."
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="The smoke-test preset: every choice but ref_is and adaptive_mix, one beta, 2 seeds, 12 steps.",
    ),
    study_file: list[Path] = typer.Option(
        [],
        "--config",
        "-c",
        metavar="FILE",
        help="YAML of StudyConfig keys (grid, betas, seeds, steps, ...); repeatable: the files "
        "merge in order, a later one winning.",
    ),
    workers: int | None = typer.Option(
        None, metavar="N", help="Runs in parallel (one torch thread each)."
    ),
    steps: int | None = typer.Option(
        None, metavar="N", help="Training steps per run (the fixed budget)."
    ),
    seeds: str | None = typer.Option(
        None, metavar="S1,S2,...", help="Comma-separated seeds, e.g. 0,1,2."
    ),
    betas: str | None = typer.Option(
        None, metavar="B1,B2,...", help="Comma-separated KL coefficients, e.g. 0.01,0.1."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the runs and exit."),
    report_only: Annotated[  # Annotated: a direct call of compare() gets False, not an Option
        bool,
        typer.Option(
            "--report-only",
            help="Start no run: rewrite OUT's report from its finished runs (or, for an archive "
            "without its runs, the sections its results.csv decides); refused if a run is "
            "missing.",
        ),
    ] = False,
    task: str = typer.Option(
        "builtin",
        "--task",
        metavar="TASK",
        help="builtin (the arithmetic task), overopt (train on a flawed proxy reward, watch "
        "the gold reward), chat-arith (SmolLM2-135M-Instruct with LoRA on the chat task: the "
        "real-model study, docs/study-real/) or chat-overopt (the same, trained on a proxy "
        "reward a list of numbers games, the gold reward logged: docs/study-real/overopt.md).",
    ),
) -> None:
    """Train a grid of KL choices × betas × seeds on the built-in task and report which is best.

    Writes results.csv, report.md and plots to OUT; re-running with the same OUT finishes an
    interrupted study without repeating finished runs (crashed or interrupted ones continue
    from their last checkpoint). Ctrl-C or SIGTERM stops it: the runs under way stop after
    their step with a checkpoint, no new run starts, and the runs finished so far are summarised.
    """
    _needs("train", "klpo compare")
    from klpo.study.runner import StudyInterrupted, run_study
    from klpo.study.runner import report_only as rewrite_report
    from klpo.study.summary import num
    from klpo.train.config import ConfigError

    study, grid = _compare_study(study_file, quick, task, workers, steps, seeds, betas)
    if report_only:
        try:
            typer.echo(f"wrote {rewrite_report(study, out)}", err=True)
        except ConfigError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None
        return
    if dry_run:
        for r in grid:
            typer.echo(r.name)
        typer.echo(f"{len(grid)} runs", err=True)
        return
    typer.echo(f"{len(grid)} runs, {study.workers} at a time, into {out}", err=True)

    # Through sys.stderr as it is at the call: under the live bar that is rich's proxy, which
    # prints each line above the bar (click's echo writes past it, into the bar's line).
    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def on_start(name: str, log_path: Path) -> None:
        say(f"start {name} (log: {log_path})")

    def on_result(row: dict, n: int, total: int) -> None:
        gold = f"gold {num(row.get('gold_final')):.3f}, " if study.over_optimisation else ""
        why = f" ({row['error']})" if row.get("error") and row["status"] != "ok" else ""
        say(
            f"[{n}/{total}] {row['name']}: {row['status']}{why}, {gold}held-out "
            f"{num(row.get('acc_final')):.3f}, exact KL {num(row.get('kl_exact_final')):.4f}, "
            f"{num(row.get('wall_s')):.0f} s"
        )

    try:
        run_study(study, out, on_result=on_result, on_start=on_start, show_progress=True)
    except ConfigError as err:
        typer.echo(f"error: {err}", err=True)
        raise typer.Exit(2) from None
    except StudyInterrupted as err:
        wrote = f"; their summary is in {out / 'report.md'}" if err.finished else ""
        typer.echo(
            f"{err}{wrote}. Not finished: {', '.join(err.unfinished)}; the same klpo compare "
            f"command (--out {out}) continues them from their checkpoints",
            err=True,
        )
        raise typer.Exit(err.exit_code) from None
    typer.echo(f"wrote {out / 'report.md'}", err=True)


# --------------------------------------------------------------------------------------------
# klpo doctor: what a framework's KL settings really do (klpo.doctor).


# The doctor's options, one constant each: the command below reads as its parameters. The
# frameworks are the rows of klpo.doctor.frameworks (importing the table imports no reader).
from klpo.doctor.frameworks import ROWS as _DOCTOR_ROWS  # noqa: E402

_DOCTOR_CONFIG = typer.Argument(
    ...,
    metavar="CONFIG...",
    help="A training config or launch script of "
    + ", ".join(r.title for r in _DOCTOR_ROWS.values())
    + " (several: one report each).",
)
_DOCTOR_FRAMEWORK = typer.Option(
    None,
    "--framework",
    metavar="NAME",
    help=", ".join(_DOCTOR_ROWS) + " (default: detected).",
)
_DOCTOR_FRAMEWORK_VERSION = typer.Option(
    None,
    "--framework-version",
    metavar="VERSION",
    help="The framework version the config is for (warns if the doctor knows another).",
)
_DOCTOR_AS_JSON = typer.Option(False, "--json", help="Print JSON for machines (--format json).")
_DOCTOR_FMT = typer.Option(
    None, "--format", metavar="FORMAT", help="text, json, sarif or github (annotations)."
)
_DOCTOR_FAIL_ON = typer.Option(
    "error",
    "--fail-on",
    metavar="LEVEL",
    help="Exit 1 on a finding at this level or above: error, warning or never.",
)
_DOCTOR_MODEL = typer.Option(
    None, "--model", metavar="PATH", help="Policy to measure on: a model directory or a .gguf file."
)
_DOCTOR_REFERENCE = typer.Option(
    None, "--reference", metavar="PATH", help="Reference: a model directory or a .gguf file."
)
_DOCTOR_DATA = typer.Option(
    None,
    "--data",
    metavar="FILE",
    help="Prompts: JSONL with a 'prompt' field (a string, or a list of chat messages for "
    "--chat), or text lines.",
)
_DOCTOR_LAYER = typer.Option(
    None,
    "--layer",
    metavar="PREFIX",
    help="Measure gradients on the linear layers whose name starts with this, or 'all' "
    "(default: the last decoder layer's MLP).",
)
_DOCTOR_SKETCH = typer.Option(
    None,
    "--sketch",
    metavar="K",
    help="Sketch each weight's gradient to K×K numbers (default 32; 0: exact).",
)
_DOCTOR_CHAT = typer.Option(
    None,
    "--chat/--no-chat",
    help="Render the prompts with the tokenizer's chat template (default: a klpo config's "
    "data.chat, else off).",
)
_DOCTOR_PROMPTS = typer.Option(8, "--prompts", metavar="N", help="Prompts taken from --data.")
_DOCTOR_SAMPLES = typer.Option(8, "--samples", metavar="N", help="Completions sampled per prompt.")
_DOCTOR_MAX_NEW_TOKENS = typer.Option(
    16, "--max-new-tokens", metavar="N", help="Longest completion."
)
_DOCTOR_SEED = typer.Option(0, "--seed", metavar="N", help="Sampling seed.")
_DOCTOR_VARIABLES = typer.Option(
    None,
    "--var",
    metavar="NAME=VALUE",
    help="NAME=VALUE for a variable a launch script uses but does not define (repeatable).",
)


@app.command(cls=Command)
def doctor(
    config: list[str] = _DOCTOR_CONFIG,
    framework: str | None = _DOCTOR_FRAMEWORK,
    framework_version: str | None = _DOCTOR_FRAMEWORK_VERSION,
    as_json: bool = _DOCTOR_AS_JSON,
    fmt: str | None = _DOCTOR_FMT,
    fail_on: str = _DOCTOR_FAIL_ON,
    model: str | None = _DOCTOR_MODEL,
    reference: str | None = _DOCTOR_REFERENCE,
    data: str | None = _DOCTOR_DATA,
    layer: str | None = _DOCTOR_LAYER,
    sketch: int | None = _DOCTOR_SKETCH,
    chat: bool | None = _DOCTOR_CHAT,
    prompts: int = _DOCTOR_PROMPTS,
    samples: int = _DOCTOR_SAMPLES,
    max_new_tokens: int = _DOCTOR_MAX_NEW_TOKENS,
    seed: int = _DOCTOR_SEED,
    variables: list[str] | None = _DOCTOR_VARIABLES,
) -> None:
    """Say which KL a training config logs and which gradient it follows, and the klpo config for it."""
    if model is not None:
        _needs("train", "klpo doctor --model")
        _free_cores()
    from klpo.doctor.command import run

    code = run(
        config,
        framework=framework,
        version=framework_version,
        as_json=as_json,
        model=model,
        reference=reference,
        data=data,
        layer=layer,
        sketch=sketch,
        chat=chat,
        prompts=prompts,
        samples=samples,
        max_new_tokens=max_new_tokens,
        seed=seed,
        variables=variables,
        fail_on=fail_on,
        fmt=fmt,
    )
    if code:
        raise typer.Exit(code)


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


if __name__ == "__main__":
    main()
