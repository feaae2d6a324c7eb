r"""The diagnosis: each KL term's logged value and followed gradient, its clamps, and the advice.

What a term logs and which gradient it follows is not typed here: it comes from
:func:`klpo.kl.explain`, which derives it by exact enumeration (its answers for the built-in rows
shipped as a table, :func:`klpo.registry.explanation`, so that the doctor needs no torch). Where a term's value is clamped,
the region in which the clamp zeroes the gradient is found the same way, by differentiating the
framework's clamped term on a fine grid of log-ratios d = log pi_theta(y) - log pi_ref(y) and
reporting where its gradient is exactly zero while the unclamped estimator's is not.

A distillation term (:class:`~klpo.doctor.reading.TeacherTerm`) gets ``klpo explain
--teacher``'s answers the same way, from its shipped table (:func:`klpo.registry.teacher_positions`,
:func:`klpo.registry.teacher_sequence`): the divergence its value equals and the gradient it
follows per position, where a clamp zeroes it, and whether it follows the sequence KL's gradient.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import yaml

from klpo import registry
from klpo.doctor.advice import validate
from klpo.doctor.reading import Reading, TeacherTerm, Term, version_matches

__all__ = ["clamp_regions", "diagnosis", "render"]

_BASE = {
    "k1": "k1", "k1+": "k1", "k2": "k2", "k2+": "k2", "k3": "k3", "k3+": "k3",
    "low_var_kl": "k3", "abs": "abs", "abs+": "abs",
}  # fmt: skip


def _term_at(base: str, d: float, term: Term) -> tuple[float, float]:
    """The framework's per-token term at log-ratio ``d`` and its derivative in ``d``, clamps
    and straight-through included, as autograd differentiates them (a clamp passes the
    gradient where its input lies within its bounds, ends included; ``|x|``'s slope at 0 is 0)."""
    x, dx = -d, -1.0  # log pi_ref - log pi_theta, the quantity verl clamps
    if term.log_ratio_clamp is not None:
        lo, hi = term.log_ratio_clamp
        inside = (lo is None or x >= lo) and (hi is None or x <= hi)
        x = min(max(x, lo if lo is not None else x), hi if hi is not None else x)
        dx = dx if inside else 0.0
    if base == "k1":
        value, slope = -x, -1.0
    elif base == "k2":
        value, slope = 0.5 * x * x, x
    elif base == "k3":
        value, slope = math.expm1(x) - x, math.expm1(x)
    else:  # abs
        value, slope = abs(x), (x > 0) - (x < 0)
    grad = slope * dx
    if term.value_clamp is not None:
        lo, hi = term.value_clamp
        inside = (lo is None or value >= lo) and (hi is None or value <= hi)
        value = min(max(value, lo if lo is not None else value), hi if hi is not None else value)
        grad = grad if inside else 0.0
    if (term.estimator or "").endswith("+"):
        grad = d  # the value's, with k2's gradient d (straight-through)
    return value, grad


def _runs(flags: list[bool], d: list[float]) -> list[tuple[float, float]]:
    """The [lo, hi] intervals of d where ``flags`` holds."""
    out, start = [], None
    for i, f in enumerate(flags):
        if f and start is None:
            start = i
        if not f and start is not None:
            out.append((d[start], d[i - 1]))
            start = None
    if start is not None:
        out.append((d[start], d[-1]))
    return out


def clamp_regions(term: Term, span: float = 30.0, step: float = 1e-3) -> dict[str, Any] | None:
    """Where the term's clamps bind, and where they zero its gradient, over d ∈ [-span, span].

    The term and its derivative are evaluated in closed form on a grid of ``step`` (no torch:
    :func:`_term_at`; a test checks them against autograd of the same clamps). Returns None for
    an unclamped term; else ``{"value_clamp", "log_ratio_clamp", "binds", "zero_gradient"}``,
    the last two as lists of ``[lo, hi]`` intervals of d (``±span`` stands for "beyond").
    """
    if term.value_clamp is None and term.log_ratio_clamp is None:
        return None
    base = _BASE.get(term.estimator or "")
    if base is None:
        return None
    n = round(2 * span / step) + 1
    grid = [-span + 2 * span * i / (n - 1) for i in range(n)]
    plain = Term(**{**asdict(term), "value_clamp": None, "log_ratio_clamp": None})
    binds, zero = [], []
    for d in grid:
        value, grad = _term_at(base, d, term)
        plain_value, plain_grad = _term_at(base, d, plain)
        binds.append(value != plain_value or grad != plain_grad)
        zero.append(grad == 0 and plain_grad != 0)
    return {
        "value_clamp": list(term.value_clamp) if term.value_clamp else None,
        "log_ratio_clamp": list(term.log_ratio_clamp) if term.log_ratio_clamp else None,
        "binds": [list(r) for r in _runs(binds, grid)],
        "zero_gradient": [list(r) for r in _runs(zero, grid)],
        "span": span,
    }


def _interval_text(lo: float, hi: float, span: float, other: str = "pi_ref") -> str:
    def ratio(x: float) -> str:
        r = math.exp(x)
        return f"{r:.3g}" if 1e-3 <= r <= 1e4 else f"e^{x:.3g}"

    if lo <= -span + 1e-9 and hi >= span - 1e-9:
        return "every d"
    if lo <= -span + 1e-9:
        return f"d < {hi:.3g} (pi_theta/{other} < {ratio(hi)} on the token)"
    if hi >= span - 1e-9:
        return f"d > {lo:.3g} (pi_theta/{other} > {ratio(lo)})"
    return f"{lo:.3g} < d < {hi:.3g}"


def _explain(est: str | None, placement: str, on_policy: bool) -> dict[str, Any] | None:
    """klpo explain's answer: the shipped table's (no torch), or derived where the row is not
    the table's (an estimator registered since, which needs torch)."""
    if est is None:
        return None
    shipped = registry.explanation(est, placement, on_policy=on_policy)
    if shipped is not None:
        return shipped.to_dict()
    from klpo import kl

    return kl.explain(est, placement, on_policy=on_policy).to_dict()


def _term_record(term: Term, reading: Reading) -> dict[str, Any]:
    rec: dict[str, Any] = asdict(term)
    rec["on_policy"] = _explain(term.estimator, term.placement, True)
    rec["off_policy"] = None
    if reading.off_policy and term.estimator is not None:
        carried = registry.SPECS[term.estimator].off_policy == "carried"  # k3_is: its own weight
        if term.placement == "loss" and term.corrected and not carried:
            # klpo.losses.kl_loss's detached weight keeps the on-policy expected gradient.
            rec["off_policy"] = {**rec["on_policy"], "on_policy": False, "corrected_by": "weight"}
        else:
            rec["off_policy"] = _explain(term.estimator, term.placement, False)
    rec["clamps"] = clamp_regions(term)
    base = _BASE.get(term.estimator or "")
    rec["unclamped"] = None
    straight_through = (term.estimator or "").endswith("+")  # k2's gradient everywhere
    if rec["clamps"] is not None and base not in (None, term.estimator) and not straight_through:
        # Where no clamp binds the term is its base estimator, value and gradient.
        rec["unclamped"] = _explain(base, term.placement, True)
    return rec


def _to_teacher(text: str) -> str:
    """klpo explain's words for the reference, with the teacher in its place."""
    return text.replace("pi_ref", "pi_T")


def _teacher_positions(t: TeacherTerm) -> tuple[dict[str, Any] | None, str]:
    """The term's per-position answers by family of cases, and where they come from."""
    placement = "reward" if t.placement == "reward" else "loss"
    if t.table_key is not None:
        rows = registry.teacher_positions(t.table_key, placement)
        if rows:
            keep = ("term", "value", "gradient", "cos_reverse", "cos_forward", "clamp_binds")
            return (
                {f: {k: r[k] for k in keep} for f, r in rows.items()},
                f"klpo explain --teacher ({next(iter(rows.values()))['term']}, {placement})",
            )
    if t.estimator is not None and registry.explanation(t.estimator, placement) is not None:
        e = registry.explanation(t.estimator, placement)
        assert e is not None
        grad = _to_teacher(e.gradient).removeprefix("grad ")
        row = {
            "term": t.estimator,
            "value": _to_teacher(e.estimates) if e.unbiased else "none",
            "gradient": grad if grad.startswith("KL(") else e.gradient.split(" (")[0],
            "cos_reverse": None,
            "cos_forward": None,
            "clamp_binds": None,
        }
        return {"categoricals": row}, (
            f"klpo explain -e {t.estimator} -p {placement}, the teacher in the reference's place"
        )
    return None, ""


def _teacher_sequence(t: TeacherTerm) -> dict[str, Any] | None:
    """Over whole sequences: the term's own row, or for any other per-position term the exact
    per-position KL's (the most a per-position term can follow), marked ``"bound": True``."""
    name = "full" if t.table_key == "full" else (t.estimator or "")
    if t.placement == "reward":
        own = registry.teacher_sequence(name, "reward", t.credit)
    else:
        own = registry.teacher_sequence(name, "loss")
    if own is not None:
        return {**own, "bound": False}
    if t.placement == "reward" and t.credit == "returns":
        return None  # returns-to-go of a term other than k1: not derived
    best = registry.teacher_sequence("full", "loss")
    return None if best is None else {**best, "bound": True}


def _teacher_record(t: TeacherTerm) -> dict[str, Any]:
    rec: dict[str, Any] = asdict(t)
    rec["per_position"], rec["per_position_from"] = _teacher_positions(t)
    rec["over_sequence"] = _teacher_sequence(t)
    rec["clamp_regions"] = None
    if t.estimator is not None and (t.value_clamp or t.log_ratio_clamp):
        as_ref = Term(
            option=t.option,
            framework_name=t.framework_name,
            estimator=t.estimator,
            placement=t.placement,
            beta=t.beta,
            beta_option=t.beta_option,
            reduction="",
            value_clamp=t.value_clamp,
            log_ratio_clamp=t.log_ratio_clamp,
        )
        rec["clamp_regions"] = clamp_regions(as_ref)
    return rec


def _teacher_check(base: dict[str, Any] | None, section: dict[str, Any] | None) -> str | None:
    """klpo's objection to a teacher section beside the equivalent klpo config (distillation
    alone: no reward functions), or None if ``klpo train`` would take it."""
    if not section:
        return None
    return validate({**(base or {}), "teacher": section, "rewards": []})


def _distillation(reading: Reading) -> dict[str, Any] | None:
    """The distillation terms with what klpo explain --teacher says of them, and klpo's teacher
    sections, each validated by klpo's train config beside the equivalent config."""
    if not reading.teacher_terms:
        return None
    return {
        "terms": [_teacher_record(t) for t in reading.teacher_terms],
        "section": {
            "config": reading.teacher_section,
            "differences": reading.teacher_differences,
            "invalid": _teacher_check(reading.equivalent, reading.teacher_section),
        },
        "intended": {
            "config": reading.teacher_intended,
            "why": reading.teacher_intended_why,
            "invalid": _teacher_check(reading.intended, reading.teacher_intended),
        },
    }


def diagnosis(reading: Reading) -> dict[str, Any]:
    """Everything the doctor says about ``reading``, as JSON-ready data."""
    findings = [asdict(f) for f in reading.findings]
    if reading.framework == "klpo" and not version_matches(
        reading.version, reading.defaults_version
    ):
        findings.insert(
            0,
            {
                "level": "warning",
                "keys": ["--framework-version"],
                "text": f"you named {reading.framework} {reading.version}; the defaults and "
                f"semantics here are {reading.framework} {reading.defaults_version}'s: settings "
                "your file leaves out may have other defaults in your version",
            },
        )
    return {
        "source": reading.source,
        "framework": reading.framework,
        "defaults_version": reading.defaults_version,
        "defaults_from": reading.defaults_from,
        "version": reading.version,
        "algorithm": reading.algorithm,
        "group_size": reading.group_size,
        "updates_per_batch": reading.updates_per_batch,
        "off_policy": reading.off_policy,
        "asynchronous": reading.asynchronous,
        "terms": [_term_record(t, reading) for t in reading.terms],
        "distillation": _distillation(reading),
        "group_scaling": reading.group_scaling,
        "findings": findings,
        "equivalent": {
            "config": reading.equivalent,
            "differences": reading.equivalent_differences,
            "unmapped": reading.equivalent_unmapped,
            "invalid": validate(reading.equivalent) if reading.equivalent else None,
        },
        "intended": {
            "config": reading.intended,
            "why": reading.intended_why,
            "invalid": validate(reading.intended) if reading.intended else None,
        },
        "settings": reading.settings,
    }


def _grad_text(rec: dict[str, Any] | None) -> str:
    if rec is None:
        return "klpo has no estimator for this term"
    g = rec["gradient"]
    if g == registry.GRAD_ZERO:
        return "zero in expectation: this term regularises nothing"
    if g == registry.GRAD_OTHER:
        return "no KL's gradient (biased)"
    note = (
        "" if not rec["mismatch"] else f"  ← not the gradient of {rec['estimates']}, the KL it logs"
    )
    return g + note


def _yaml(config: dict[str, Any]) -> str:
    clean = {
        k: {kk: vv for kk, vv in v.items() if vv is not None} if isinstance(v, dict) else v
        for k, v in config.items()
    }
    return yaml.safe_dump(clean, sort_keys=False, allow_unicode=True).rstrip()


def _render_term(i: int, t: dict[str, Any]) -> list[str]:
    """One KL term's lines: what it is, reduces to, logs, follows, and where it is clamped."""
    lines: list[str] = []
    est = t["estimator"] or "— (none in klpo)"
    lines.append(
        f" {i}. {t['option']}  →  klpo `{est}` in the {t['placement']}, beta {t['beta']:g} "
        f"({t['beta_option']}{', adaptive' if t['adaptive'] else ''})"
    )
    lines.append(
        f"    reduced:  {t['reduction']}"
        if t["placement"] == "loss"
        else f"    credit:   {t['reduction']}"
    )
    on = t["on_policy"]
    if on is not None:
        lines.append(
            f"    logs:     {'unbiased' if on['unbiased'] else 'biased'} estimate of "
            f"{on['estimates']}, {'never negative' if on['nonnegative'] else 'can be negative'}"
            + (f", as `{t['logged_as']}`" if t["logged_as"] else "")
        )
    lines.append(f"    gradient: on-policy: {_grad_text(on)}")
    if t.get("unclamped") is not None and t["unclamped"]["gradient"] != on["gradient"]:
        lines.append(
            f"              where no clamp binds, as {t['unclamped']['estimator']}: "
            f"{_grad_text(t['unclamped'])}"
        )
    off = t["off_policy"]
    if off is not None:
        if t["placement"] == "reward":
            how = "penalty estimated at pi_old, PPO ratio"
        elif off.get("corrected_by"):
            how = "corrected by klpo's detached pi_theta/pi_old weight"
        else:
            how = "carries its own weight" if t["corrected"] else "not corrected"
        lines.append(f"              off-policy ({how}): {_grad_text(off)}")
    c = t["clamps"]
    if c is not None:
        parts = []
        if c["value_clamp"]:
            parts.append(f"value clamped to {c['value_clamp']}")
        if c["log_ratio_clamp"]:
            parts.append(f"log pi_ref - log pi_theta clamped to {c['log_ratio_clamp']}")
        lines.append(f"    clamps:   {'; '.join(parts)}")
        if t["placement"] == "loss":
            zero = c["zero_gradient"]
            if zero:
                where = " or ".join(_interval_text(lo, hi, c["span"]) for lo, hi in zero)
                lines.append(f"              the gradient is exactly zero where {where}")
            else:
                lines.append("              the gradient is never zeroed (straight-through)")
        else:
            binds = " or ".join(_interval_text(lo, hi, c["span"]) for lo, hi in c["binds"])
            lines.append(f"              the per-token penalty is capped where {binds}")
    return lines


_SUPPORT = {
    "sampled": "the sampled token only",
    "full": "the whole vocabulary at every position",
}
_CREDIT = {
    "token": "each token its own value, no return from later tokens (discount 0)",
    "returns": "returns-to-go: each token its own value and those after it",
}


def _support_text(t: dict[str, Any]) -> str:
    if t["support"] == "top-k":
        return f"the {t['topk_of']}'s top-{t['top_k']} tokens at every position"
    return _SUPPORT.get(t["support"], t["support"])


def _cos(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _render_teacher_term(i: int, t: dict[str, Any]) -> list[str]:
    """One distillation term: what it is, its support and credit, clamps, and what it follows."""
    place = "loss" if t["placement"] == "loss" else "reward (detached, a policy-gradient signal)"
    lines = [
        f" {i}. {t['option']}  →  {t['framework_name']}: in the {place}, coefficient "
        f"{t['beta']:g} ({t['beta_option']})",
    ]
    if t["teacher"]:
        lines.append(f"    teacher:    {t['teacher']}")
    lines.append(f"    divergence: {t['divergence']}")
    lines.append(f"    support:    {_support_text(t)}")
    if t["placement"] == "reward":
        lines.append(f"    credit:     {_CREDIT.get(t['credit'], t['credit'])}")
    if t["clamps"]:
        lines.append(f"    clamps:     {'; '.join(t['clamps'])}")
    c = t.get("clamp_regions")
    if c is not None:
        if t["placement"] == "loss" and c["zero_gradient"]:
            where = " or ".join(
                _interval_text(lo, hi, c["span"], "pi_T") for lo, hi in c["zero_gradient"]
            )
            lines.append(f"                the gradient is exactly zero where {where}")
        elif t["placement"] == "reward" and c["binds"]:
            where = " or ".join(_interval_text(lo, hi, c["span"], "pi_T") for lo, hi in c["binds"])
            lines.append(f"                the per-token reward is capped where {where}")
    pos = t["per_position"]
    if pos is None:
        lines.append("    follows:    not derived: klpo explain --teacher has no row for this form")
    else:
        at = ""
        if t["support"] == "top-k":
            table = registry.teacher_table()
            at = f"; its top-k at k = {table['k']} of a vocabulary of {table['vocab']}"
        lines.append(f"    per position ({t['per_position_from']}{at}):")
        for family, row in pos.items():
            extra = ""
            if row["cos_reverse"] is not None:
                extra = (
                    f" (cosine to grad reverse {_cos(row['cos_reverse'])}, to grad forward "
                    f"{_cos(row['cos_forward'])})"
                )
            if row.get("clamp_binds"):
                extra += f"; a clamp zeroes it at {row['clamp_binds']:.0%} of positions"
            lines.append(f"      {family}: value {row['value']}; gradient {row['gradient']}{extra}")
    seq = t["over_sequence"]
    if seq is not None:
        head = (
            "as every per-position term, at best the exact per-position KL's"
            if seq["bound"]
            else ("follows it" if seq["follows"] else "does not follow it")
        )
        lines.append(
            f"    over the sequence: against grad KL(pi_theta ‖ pi_T) of whole completions, "
            f"{head} (cosine {seq['cos_sequence']:.3f}, relative error {seq['rel_error']:.2f})"
        )
    return lines


def _render_distillation(d: dict[str, Any]) -> list[str]:
    lines = ["", "Distillation terms (the student pi_theta samples, the teacher pi_T scores):"]
    for i, t in enumerate(d["terms"], 1):
        lines += _render_teacher_term(i, t)
    return lines


def _render_sections(d: dict[str, Any]) -> list[str]:
    sec, it = d["section"], d["intended"]
    lines = ["", "klpo teacher section that does the same thing (klpo train's teacher mode):"]
    if sec["config"]:
        lines.append(_indent(_yaml({"teacher": sec["config"]})))
    for x in sec["differences"]:
        lines.append(f"  # differs: {x}")
    if sec["invalid"]:
        lines.append(f"  # klpo rejects it: {sec['invalid']}")
    lines += ["", "klpo teacher section these settings most likely meant:"]
    lines.append(_indent(_yaml({"teacher": it["config"]})))
    for w in it["why"]:
        lines.append(f"  # why: {w}")
    if it["invalid"]:
        lines.append(f"  # klpo rejects it: {it['invalid']}")
    return lines


def _render_config(title: str, block: dict[str, Any], notes: list[str]) -> list[str]:
    """A klpo config under its title, then ``notes`` and klpo's refusal of it as comments."""
    lines = ["", title, _indent(_yaml(block["config"])), *notes]
    if block["invalid"]:
        lines.append(f"  # klpo rejects it: {block['invalid']}")
    return lines


def render(diag: dict[str, Any]) -> str:
    """The diagnosis for people."""
    fw = diag["framework"]
    lines = [f"klpo doctor: {diag['source']}"]
    named = diag["version"]
    if fw == "klpo":  # klpo's own config: the klpo that runs is the version, nothing assumed
        lines.append(
            f"framework: klpo; read by this klpo ({diag['defaults_version']}), its own defaults"
            + (f" (you named {named})" if named else "")
        )
    else:
        lines.append(
            f"framework: {fw}; defaults and semantics of "
            f"{fw.split('-')[0] if fw.startswith('trl-') else fw} {diag['defaults_version']}"
            + (
                f" (you named {named})"
                if named
                else " (version not named: assumed; --framework-version names yours)"
            )
        )
    if diag.get("defaults_from"):
        lines.append(f"settings and defaults: {diag['defaults_from']}")
    ups = diag["updates_per_batch"]
    lines.append(
        f"algorithm: {diag['algorithm']}, {diag['group_size']} completion(s) per prompt, "
        f"{ups} optimiser step(s) per batch of rollouts"
        + (
            " (asynchronous: tokens are off-policy from the 1st)"
            if diag.get("asynchronous")
            else " (tokens are off-policy from the 2nd)"
            if diag["off_policy"]
            else " (on-policy)"
        )
    )
    lines.append("")
    if not diag["terms"]:
        lines.append("KL terms in effect: none")
    else:
        lines.append("KL terms in effect:")
    for i, t in enumerate(diag["terms"], 1):
        lines += _render_term(i, t)
    distillation = diag.get("distillation")
    if distillation:
        lines += _render_distillation(distillation)
    if diag["group_scaling"]:
        lines += ["", "group normalisation of the reward-side KL:", f"  {diag['group_scaling']}"]
    if diag["findings"]:
        lines += ["", "findings:"]
        for f in diag["findings"]:
            lines.append(f"  [{f['level']}] {f['text']}  ({', '.join(f['keys'])})")
    eq, it = diag["equivalent"], diag["intended"]
    if fw == "klpo":
        lines += _render_own_configs(diag)
        if distillation:
            lines += _render_sections(distillation)
        return "\n".join(lines)
    notes = [f"  # differs: {d}" for d in eq["differences"]]
    if eq["unmapped"]:
        notes.append(f"  # not carried (klpo has no key for them): {', '.join(eq['unmapped'])}")
    lines += _render_config("klpo config that does the same thing (klpo train -c FILE):", eq, notes)
    notes = [f"  # why: {w}" for w in it["why"]]
    lines += _render_config(
        "klpo config that does what these settings most likely meant:", it, notes
    )
    if distillation:
        lines += _render_sections(distillation)
    return "\n".join(lines)


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{dotted key: value}``."""
    if not isinstance(config, dict):
        return {prefix.rstrip("."): config}
    out: dict[str, Any] = {}
    for k, v in config.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _render_own_configs(diag: dict[str, Any]) -> list[str]:
    """The two klpo configs of a klpo config, compactly: the one that does the same thing is
    the file itself (its every key written out would repeat klpo's defaults, some hundred
    lines), and the one it most likely meant is said by the keys it changes. The full configs
    stay in ``--format json``."""
    eq, it = diag["equivalent"], diag["intended"]
    lines = [
        "",
        f"klpo config that does the same thing: the file itself (klpo train -c {_file(diag)})",
    ]
    for d in eq["differences"]:
        lines.append(f"  # differs: {d}")
    if eq["invalid"]:
        lines.append(f"  # klpo rejects it: {eq['invalid']}")
    same, meant = _flat(eq["config"] or {}), _flat(it["config"] or {})
    changes = [
        f"  {k}: {same.get(k)!r} -> {v!r}" if k in same else f"  {k}: {v!r} (added)"
        for k, v in meant.items()
        if k not in same or same[k] != v
    ]
    lines.append(
        "klpo config that does what these settings most likely meant: "
        + ("the file with these changes:" if changes else "the same")
    )
    lines += changes
    for w in it["why"]:
        lines.append(f"  # why: {w}")
    if it["invalid"]:
        lines.append(f"  # klpo rejects it: {it['invalid']}")
    lines.append("(the configs written out key by key, klpo's defaults included: --format json)")
    return lines


def _file(diag: dict[str, Any]) -> str:
    return str(diag["source"]).split(" (", 1)[0]


def _indent(text: str) -> str:
    return "\n".join("  " + ln for ln in text.splitlines())
