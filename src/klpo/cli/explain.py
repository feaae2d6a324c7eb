"""``klpo explain``: what a KL estimator in a placement really does (:func:`klpo.kl.explain`),
tokens from a stale sampler (:mod:`klpo.lab.staleness`) and the teacher terms
(:mod:`klpo.lab.teacher`), for people (tables that fit the terminal) and machines (``--json``)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from klpo.cli.common import console, print_json

# The options, one constant each: the command below reads as its parameters.
_ESTIMATOR = typer.Option(
    None, "--estimator", "-e", metavar="NAME", help="A KL estimator (see --all for the list)."
)
_PLACEMENT = typer.Option(
    None,
    "--placement",
    "-p",
    metavar="PLACEMENT",
    help="reward, loss or reward+loss; all three if omitted.",
)
_ALL = typer.Option(False, "--all", help="Explain every estimator in every placement.")
_AS_JSON = typer.Option(False, "--json", help="Print JSON for machines.")
_OFF_POLICY = typer.Option(
    False, "--off-policy", help="Tokens sampled from an older policy pi_old, not pi_theta."
)
_STALENESS = typer.Option(
    None,
    "--staleness",
    "-k",
    metavar="K",
    min=0,
    help="Tokens from a sampler K policy versions behind pi_theta (asynchronous RL): the "
    "expected gradient of each estimator × placement under each correction of the sampler "
    "gap, on categoricals and sequence models (klpo.lab.staleness); every estimator when "
    "--estimator is not given.",
)
_CAP = typer.Option(
    10.0, "--cap", metavar="C", help="With --staleness: the is-cap weight's cap C (> 0)."
)
_STEP = typer.Option(
    0.2,
    "--step",
    metavar="SD",
    help="With --staleness: the sd of one policy version's step in logit space (> 0).",
)
_TEACHER = typer.Option(
    False,
    "--teacher",
    help="On-policy distillation: each teacher term (sampled, exact, JSD, top-k with verl's "
    "clamps) with the divergence and gradient it follows per position and over a "
    "sequence, by exact enumeration (klpo.lab.teacher).",
)


def explain(
    estimator: str | None = _ESTIMATOR,
    placement: str | None = _PLACEMENT,
    all_: bool = _ALL,
    as_json: bool = _AS_JSON,
    off_policy: bool = _OFF_POLICY,
    staleness: int | None = _STALENESS,
    cap: float = _CAP,
    step: float = _STEP,
    teacher: bool = _TEACHER,
) -> None:
    """Say what a KL estimator in a placement really does: value, bias, sign and gradient.

    Every claim is derived by exact enumeration on small categoricals, not typed in.
    """
    if teacher:
        _explain_teacher(as_json)
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
    rows = _explained_rows(estimator, placement, all_, off_policy)
    if as_json:
        print_json([r.to_dict() for r in rows])
        return
    _print_explained(rows, placement, off_policy)


def _explain_teacher(as_json: bool) -> None:
    """``klpo explain --teacher``: the teacher terms (:mod:`klpo.lab.teacher`)."""
    from klpo.lab import teacher as opd

    if as_json:
        print_json(opd.to_json())
    else:
        console().print(opd.render(), highlight=False, soft_wrap=True)


def _explained_rows(
    estimator: str | None, placement: str | None, all_: bool, off_policy: bool
) -> list:
    """The :func:`klpo.kl.explain` rows the options ask for, or exit 2 naming the bad one."""
    from klpo import kl

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
        return [kl.explain(n, p, on_policy=not off_policy) for n, p in pairs]
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


def _print_explained(rows: list, placement: str | None, off_policy: bool) -> None:
    """The rows for people: one estimator's text, or the table at its natural width where it
    fits, else the compact table with the values below it."""
    from klpo import kl

    out = console()
    if len(rows) <= len(kl.PLACEMENTS) and len({r.estimator for r in rows}) == 1:
        out.print("\n\n".join(r.text() for r in rows), highlight=False)
        return
    shown = kl.PLACEMENTS if placement is None else [placement]
    wide = _table(rows, shown, off_policy)
    if Console(width=10_000).measure(wide).maximum <= out.width:  # its natural width fits
        out.print(wide)
        return
    # A narrow terminal: the compact layout (the directions spelled short, values listed below)
    # rather than cells cut to "KL(pi_…", where the two directions cannot be told apart.
    out.print(_narrow_table(rows, shown, off_policy))
    for line in _value_lines(rows, out.width):
        out.print(line, highlight=False)


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
        print_json([r.to_dict() for r in rows])
        return
    out = console()
    for setting, words in (
        ("categorical", "4 seeded categoricals, V = 6"),
        ("sequence", "the sequence oracle (V = 2, T = 2) and 2 seeded models (V = 3, T = 3)"),
    ):
        out.print(_staleness_table([r for r in rows if r.setting == setting], words, k, cap))


def _staleness_table(rows: list, words: str, k: int, cap: float) -> Table:
    """One family's rows (``words`` says which cases): a row per estimator × placement, a
    column per correction of the sampler gap."""
    from klpo.lab import staleness as st

    first = rows[0]
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
    corrections = list(dict.fromkeys(r.correction for r in rows))
    for c in corrections:
        table.add_column(c)
    by_term: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        by_term.setdefault((r.estimator, r.placement), {})[r.correction] = st.cell(r)
    for (name, place), cells in by_term.items():
        table.add_row(name, place, *[cells.get(c, "—") for c in corrections])
    return table


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


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _by_estimator(rows: list) -> dict[str, list]:
    """The rows of each estimator, in their order: one table row each."""
    by_name: dict[str, list] = {}
    for r in rows:
        by_name.setdefault(r.estimator, []).append(r)
    return by_name


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
    for col in ("estimator", "estimates", "unb.", "≥0"):
        table.add_column(col, style="bold" if col == "estimator" else None)
    for p in placements:
        table.add_column({"reward+loss": "rwd+loss"}.get(p, p))
    for name, rs in _by_estimator(rows).items():
        first = rs[0]
        table.add_row(
            name,
            _short(first.estimates),
            _yes(first.unbiased),
            _yes(first.nonnegative),
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
    for col in ("estimator", "value", "estimates", "unbiased", "≥ 0"):
        table.add_column(col, style="bold" if col == "estimator" else None)
    for p in placements:
        table.add_column(f"gradient in {p}")
    for name, rs in _by_estimator(rows).items():
        first = rs[0]
        table.add_row(
            name,
            first.equation,
            first.estimates,
            _yes(first.unbiased),
            _yes(first.nonnegative),
            *[r.gradient + (" *" if r.mismatch else "") for r in rs],
        )
    return table
