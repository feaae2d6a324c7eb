"""The measurement for people."""

from __future__ import annotations

import math
from typing import Any

from klpo.measure.objectives import TARGETS


def _num(x: float | None, digits: int = 3) -> str:
    """A number to ``digits`` significant digits; ``—`` for none and for a ratio that is not a
    number (0/0, x/0: a relative column where the exact KL is 0)."""
    if x is None or (isinstance(x, float) and (math.isinf(x) or math.isnan(x))):
        return "—"
    return f"{x:.{digits}g}"


def _pm(x: float | None, half: float | None) -> str:
    """``+0.41±0.20``: an estimate and its interval's half-width (``—``: not estimable)."""
    if x is None or half is None or not math.isfinite(half):
        return "—"
    return f"{x:+.2f}±{half:.2f}" if half >= 0.005 or half == 0 else f"{x:+.3f}±{half:.0e}"


_SHORT = {TARGETS[0]: "θ‖ref", TARGETS[1]: "ref‖θ", TARGETS[2]: "seq θ‖ref"}


HEAVY_TAIL_KURTOSIS = 100.0
"""The excess kurtosis of an estimator's per-token values above which :func:`heavy_tail_notes`
reads an INCONSISTENT gradient row as the batch missing rare tokens."""


def heavy_tail_notes(rows: list[dict[str, Any]], values: dict[str, Any]) -> list[str]:
    """A line for each INCONSISTENT gradient row whose estimator's per-token values have an
    excess kurtosis above :data:`HEAVY_TAIL_KURTOSIS`: there the identity `klpo explain` states
    is an expectation over every token at each prefix, and much of it is carried by tokens the
    policy rarely samples (for ``k3``, those with pi_theta ≪ pi_ref, whose weight
    pi_ref/pi_theta is unbounded), so a batch of this size follows another direction; the
    jackknife interval, which assumes light tails, is then too narrow to tell a wrong identity
    from a short sample.

    >>> rows = [{"estimator": "k3", "placement": "loss", "claim": {"status": "inconsistent"}}]
    >>> heavy_tail_notes(rows, {"k3": {"token": {"excess_kurtosis": 1700.0}}})[1][:40]
    '  k3 loss: its per-token values have exc'
    """
    out = []
    for r in rows:
        c, name = r["claim"], r["estimator"]
        kurt = values.get(name, {}).get("token", {}).get("excess_kurtosis")
        if c is None or c["status"] != "inconsistent" or kurt is None or kurt < HEAVY_TAIL_KURTOSIS:
            continue
        out.append(
            f"  {name} {r['placement']}: its per-token values have excess kurtosis {kurt:.3g}: the "
            "gradient explain names is an expectation over every token, much of it carried by "
            "tokens this policy rarely samples, so a batch of this size follows the direction "
            "above instead (the interval assumes light tails); more --samples move it towards "
            "explain's"
        )
    return ([""] if out else []) + out


def _above(row: dict[str, Any], target: str) -> str:
    """``†`` after a cosine estimate above 1 (:func:`above_one_notes` says why)."""
    cos = row["targets"][target]["cos"]
    return "†" if cos is not None and cos > 1 else ""


def above_one_notes(rows: list[dict[str, Any]]) -> list[str]:
    """A line naming the cosine estimates above 1 (marked ``†`` in the table), and why they can
    be: the cosine is of the *expected* gradients, each norm corrected for the sampling noise
    by a U-statistic (:func:`klpo.measure.intervals.interval_stats`) and the gradients sketched,
    so the estimate is a ratio of estimates, not the cosine of two fixed vectors; where an
    expected gradient is small or the groups are few (3 groups of the shipped pair put k1 in the
    loss at 1.7) it lands above 1. The interval is what to read.

    >>> row = {"estimator": "k2", "placement": "loss", "targets": {TARGETS[0]: {"cos": 1.02}}}
    >>> above_one_notes([row])[1][:44]
    '  † cosine estimates above 1 (k2 loss θ‖ref '
    """
    over = [
        f"{r['estimator']} {r['placement']} {_SHORT[t]} {s['cos']:+.3f}"
        for r in rows
        for t, s in r["targets"].items()
        if s.get("cos") is not None and s["cos"] > 1
    ]
    if not over:
        return []
    return [
        "",
        f"  † cosine estimates above 1 ({'; '.join(over[:4])}{'; ...' if len(over) > 4 else ''}): "
        "each is an estimate of the cosine of the expected gradients, each norm corrected for the "
        "sampling noise (U-statistics) from sketched gradients; a corrected norm can come out "
        "below the inner product's estimate, most where an expected gradient is small or the "
        "groups are few, and the ratio then exceeds 1, which a cosine of two fixed vectors never "
        "does; read its interval, and more --samples bring it under 1",
    ]


def _gradient_lines(m: dict[str, Any]) -> list[str]:
    """The gradient table: each estimator and placement's cosines to the targets, with the
    projection on the gradient ``klpo explain`` names and its verdict."""
    g = m["gradients"]
    hl = {tuple(h) for h in m.get("highlight", [])}
    sketched = f"sketched to {g['dim']:,}" if g["sketch"] else "exact"
    lines = [
        "",
        f"gradient cosines on {g['subset']} ({g['parameters']:,} parameters, {sketched}), "
        f"estimate ± 95% half-width over {m['groups']} groups of completions; proj: the "
        "projection on the gradient explain names (exact 1, or 0 for zero);"
        " * = your config's terms:",
        f"  {'estimator':<13}{'placement':<13}"
        + "".join(f"{_SHORT[t]:>13}" for t in TARGETS)
        + f"  {'explain says':<19}{'proj':>13}  verdict",
    ]
    for r in g["rows"]:
        mark = "*" if (r["estimator"], r["placement"].replace("-to-go", "")) in hl else " "
        cells = "".join(
            f"{_pm(r['targets'][t]['cos'], r['targets'][t]['half_width']['cos']) + _above(r, t):>13}"
            for t in TARGETS
        )
        c = r["claim"]
        if c is None:
            tail = f"  {'other (biased)':<19}{'':>13}  —"
        else:
            s = r["targets"][c["target"]]
            proj = _pm(s["beta"], s["half_width"]["beta"])
            if c["status"] == "inconsistent":
                word = f"INCONSISTENT: the interval excludes {c['projection']:g}"
            elif c["status"] == "consistent":
                word = "consistent" + (
                    f" (~{c['decide_at']:,} completions to decide)" if c["decide_at"] else ""
                )
            else:
                word = "undefined (a zero target)"
            tail = f"  {c['gradient']:<19}{proj:>13}  {word}"
        lines.append(f" {mark}{r['estimator']:<13}{r['placement']:<13}{cells}{tail}")
    return lines


def render_measurement(m: dict[str, Any]) -> str:
    """The measurement for people: two value tables and one gradient table with intervals."""
    e = m["exact"]
    if m.get("identical"):
        return (
            "--model and --reference hold the same weights: KL(pi_theta ‖ pi_ref) is exactly 0 "
            "at every position, and so is every estimator's value and gradient; nothing to "
            "measure (klpo probe checks that your training path computes it as 0)"
        )
    lines = [
        f"measured on your models: {m['sequences']} completions, {m['tokens']} tokens "
        f"(--seed={m['seed']}{', chat template' if m.get('chat') else ''})",
        f"  exact KL(pi_theta ‖ pi_ref): {_num(e['token_mean_kl_theta_ref'], 4)} per token, "
        f"{_num(e['sequence_mean_kl_theta_ref'], 4)} per sequence; "
        f"KL(pi_ref ‖ pi_theta): {_num(e['token_mean_kl_ref_theta'], 4)} per token",
    ]
    cols = ("mean", "bias", "± se", "sd", "sd/KL", "neg", "kurt", "max")
    for level in ("token", "sequence"):
        lines += [
            "",
            f"values per {level} against the exact KL (bias ± se, sd of the error; neg: the "
            "fraction below 0; kurt: excess kurtosis):",
            f"  {'estimator':<13}" + "".join(f"{c:>10}" for c in cols),
        ]
        for name, s in m["values"].items():
            v = s[level]
            cells = (
                _num(v["mean"]),
                _num(v["bias"]),
                _num(v["bias_se"], 2),
                _num(v["sd"]),
                _num(v["relative_sd"], 2),
                f"{v['fraction_negative']:.2f}",
                _num(v["excess_kurtosis"], 3),
                _num(v["max"]),
            )
            lines.append(f"  {name:<13}" + "".join(f"{c:>10}" for c in cells))
    undefined = [
        f"{name} per {level}"
        for level in ("token", "sequence")
        for name, s in m["values"].items()
        if not math.isfinite(s[level]["relative_sd"])
    ]
    if undefined:
        lines.append(
            f"  sd/KL — ({', '.join(undefined[:4])}{', ...' if len(undefined) > 4 else ''}): "
            "the exact KL is 0 there, so no ratio to it is defined"
        )
    g = m["gradients"]
    lines += _gradient_lines(m)
    lines += heavy_tail_notes(g["rows"], m["values"])
    lines += above_one_notes(g["rows"])
    lines += [
        "",
        "  cosines are of the expected gradients, corrected for the noise in each norm "
        "(U-statistics; — where the expected gradient is not told from zero); intervals are "
        "jackknife over the groups with Student's t. More --samples narrow them.",
    ]
    return "\n".join(lines)
