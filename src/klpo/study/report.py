"""The report: ``results.csv``, the plots and ``report.md`` of a study's results.

``report.md`` has one row per cell: final held-out accuracy mean ± sd over seeds, the exact KL to
the reference at the end and at its peak, the gap between the logged estimate and the exact KL,
the variance of the final reward across seeds, failures, wall time; the estimator's noise and the
steps to a target accuracy (or gold reward on the over-optimisation task); on that task the gold
and proxy rewards and the frontiers (:mod:`klpo.study.frontier`); whether a KL budget was held.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from klpo._io import write_text_atomic
from klpo.study.frontier import (
    BUDGETS,
    CHAT_BUDGETS,
    ChoiceFrontier,
    Curve,
    Evaluation,
    frontier_plots,
    frontier_table,
    heldout_frontier_table,
)
from klpo.study.grid import fmt
from klpo.study.plots import metric_curve, plot_results, seed_band
from klpo.study.spec import StudyConfig, parse_cell
from klpo.study.summary import (
    BUDGET_TOLERANCE,
    COLLAPSE_Z,
    MIN_REFERENCE_STEPS,
    OUTLIER_MADS,
    RESULT_FIELDS,
    WINDOW,
    heldout_scores,
    metric_columns,
    nan_low,
    num,
    paired_change,
    summarise_cells,
)
from klpo.study.verdicts import ADDED_MARK, SEED_HEADING, Scores, cell_name, seed_sections
from klpo.train.evaluate import wilson_interval

__all__ = ["refresh_sections", "write_results"]


def _f(x: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def write_results(
    results: list[dict[str, Any]],
    out: str | Path,
    study: StudyConfig,
    *,
    unfinished: list[str] | None = None,
) -> Path:
    """Write ``results.csv``, the plots and ``report.md`` into ``out``; returns the report.
    ``unfinished``: the runs of the grid not yet finished (a study stopped by a signal), named
    at the report's end."""
    out = Path(out)
    results = [metric_columns(r, out / "runs" / r["name"], study.steps) for r in results]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RESULT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in results:
        writer.writerow({k: r.get(k, "") for k in RESULT_FIELDS})
    write_text_atomic(out / "results.csv", buf.getvalue())
    cells = summarise_cells(results)
    plots = plot_results(results, cells, out)
    fronts = _frontiers(results, cells, out) if study.over_optimisation else []
    plots += frontier_plots(fronts, out, WINDOW) if fronts else []

    lines = _main_table(results, cells, study)
    lines += seed_sections(results, study, _score_reader(out))
    if study.chat:
        lines += _real_table(results, cells, study, out)
    lines += _noise_table(cells, study)
    lines += _spike_table(results, study)
    if study.over_optimisation:
        budgets = CHAT_BUDGETS if study.chat else BUDGETS
        lines += frontier_table(fronts, WINDOW, budgets)
        if study.chat:
            lines += heldout_frontier_table(fronts, WINDOW, budgets)
        lines += _overopt_table(cells)
    lines += _budget_table(cells)
    failures = [r for r in results if r["status"] != "ok"]
    if failures:
        lines += ["", "## Failed runs", "", "| run | status | steps | error |"]
        lines.append("| --- | --- | --- | --- |")
        for r in failures:
            err = str(r.get("error", "")).replace("|", "\\|")
            lines.append(f"| {r['name']} | {r['status']} | {r['steps_done']} | {err} |")
    if unfinished:
        lines += ["", "## Not finished", ""]
        lines.append(
            f"The study was stopped before {len(unfinished)} of its runs finished: "
            f"{', '.join(unfinished)}. A re-run of the same `klpo compare` continues them; "
            "every table above is over the finished runs only."
        )
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines))
    return report


def refresh_sections(results: list[dict[str, Any]], out: str | Path, study: StudyConfig) -> Path:
    """Rewrite, in ``out/report.md``, the parts of the report that ``results`` alone decide
    (one row per run, as ``results.csv`` keeps them): the title, summary line and main table,
    and the seed-level section (:func:`~klpo.study.verdicts.seed_sections`, without per-problem
    intervals); every other section and the plots are kept byte for byte. For an archive that
    kept ``results.csv`` but not its runs; returns the report."""
    report = Path(out) / "report.md"
    old = report.read_text(encoding="utf-8")
    rest = old[old.index("\n## ") :] if "\n## " in old else "\n"
    if rest.startswith("\n" + SEED_HEADING):  # written before: replaced
        after = rest.find("\n## ", len(SEED_HEADING) + 1)
        rest = rest[after:] if after >= 0 else "\n"
    lines = _main_table(results, summarise_cells(results), study) + seed_sections(results, study)
    write_text_atomic(report, "\n".join(lines) + "\n" + rest)
    return report


def _score_reader(out: Path) -> Scores:
    """``(run name, "start" | "end") -> {problem: score}``: a run's per-problem held-out scores
    at its first and last evaluation, from its ``samples.jsonl`` (empty without one), each run
    read once."""
    cache: dict[str, dict[int, dict[int, float]]] = {}

    def scores(name: str, when: str) -> dict[int, float]:
        if name not in cache:
            path = out / "runs" / name
            cache[name] = heldout_scores(path) if (path / "samples.jsonl").is_file() else {}
        by_step = cache[name]
        if not by_step:
            return {}
        return by_step.get(0, {}) if when == "start" else by_step[max(by_step)]

    return scores


def _label(c: dict[str, Any], study: StudyConfig) -> str:
    """A cell's KL choice, marked when the spec lists it in ``added_after``."""
    added = {parse_cell(x) for x in study.added_after}
    name = cell_name(c["choice"], c["beta"])
    return f"{c['choice']} {ADDED_MARK}" if parse_cell(name) in added else c["choice"]


def _main_table(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], study: StudyConfig
) -> list[str]:
    """The report's title, its summary line and the table of accuracy and KL, one row per cell."""
    n_fail = sum(r["status"] != "ok" for r in results)
    run_s = math.fsum(x for r in results if math.isfinite(x := num(r.get("wall_s"))))
    lines = [
        "# klpo compare: KL estimators and placements on real training",
        "",
        f"{len(results)} runs ({len(study.seeds)} seeds per cell, {study.steps} steps each, "
        f"{study.workers} in parallel with one thread each; their measured wall times add up to "
        f"{run_s / 60:.1f} minutes"
        + (
            f", {run_s / 3600:.1f} hours against the {study.cpu_hours:g} CPU-hours planned in "
            "the spec"
            if study.cpu_hours
            else ""
        )
        + f"); {n_fail} failed (crashed, diverged or collapsed: held-out accuracy below its start by "
        f"more than collapse_drop {study.collapse_drop:g} and {COLLAPSE_Z:g} standard errors on "
        f"{study.eval_size} problems, the error column says by how much). Study: `study.yaml`; "
        "the shared "
        "training config: `train-config.yaml`; one row per run: `results.csv`.",
        "",
        "Columns: held-out accuracy (greedy) at the start and at the end, mean ± sd over seeds; "
        f"the exact full-vocabulary KL(pi_theta ‖ pi_ref) per token over the last {WINDOW} steps "
        f"and at its peak (largest {WINDOW}-step running mean); the mean gap between the logged "
        "estimate (the configured estimator) and the exact KL over the run; the variance "
        f"across seeds of the final train reward (last {WINDOW} steps); failed runs; mean wall time per run.",
        "",
        "| algo | KL choice | beta | acc start | acc final | KL final | KL peak | logged − exact "
        "| reward var | failed | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], -nan_low(c["acc_mean"]))):
        failed = f"{c['failed']}/{c['runs']}" + (f" ({c['statuses']})" if c["failed"] else "")
        lines.append(
            f"| {c['algo']} | {_label(c, study)} | {fmt(c['beta'])} | {_f(c['acc_start'])} | "
            f"{_f(c['acc_mean'])} ± {_f(c['acc_sd'])} | {_f(c['kl_final'], 4)} | "
            f"{_f(c['kl_peak'], 4)} | {_f(c['kl_gap'], 4)} | {_f(c['reward_var'], 5)} | "
            f"{failed} | {_f(c['wall_s'], 0)} |"
        )
    return lines


def _real_table(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], study: StudyConfig, out: Path
) -> list[str]:
    """The real-model task's table: each cell's held-out accuracy pooled over its seeds with a
    Wilson interval, problem by problem against its start and against no KL (the same seed's
    run, the same problems: the McNemar test), and the exact KL, entropy and length at the end."""
    scores = {r["name"]: heldout_scores(out / "runs" / r["name"]) for r in results}

    def ends(name: str) -> tuple[dict[int, float], dict[int, float]]:
        by_step = scores[name]
        last = max(by_step, default=None)
        return by_step.get(0, {}), by_step.get(last, {}) if last else {}

    runs: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    no_kl = {(r["algo"], int(r["seed"])): r["name"] for r in results if r["choice"] == "no KL"}
    lines = [
        "",
        "## Held-out accuracy problem by problem (descriptive)",
        "",
        "**Descriptive columns, not tests**: the intervals and p-values here pool the answers of "
        "every seed and treat them as independent, but the answers of one run share its policy "
        "and the seeds differ beyond binomial noise, so the seed is the unit (the section above "
        "decides). "
        f"Each cell's held-out accuracy at the end pooled over its seeds (right answers out of "
        f"{study.eval_size} problems × seeds, greedy) with its 95% Wilson interval; the problems "
        "each run turned right and turned wrong against its own start, summed over seeds, and "
        "against the no-KL run of the same seed on the same problems, each with the exact "
        "two-sided McNemar p-value of that split; the exact KL(pi_theta ‖ pi_ref) per token, the "
        f"policy's entropy per token and the sampled completions' mean length, over the last "
        f"{WINDOW} steps (means over seeds); runs that collapsed (held-out accuracy fell beyond "
        "the collapse threshold). Per-problem scores are the runs' held-out records "
        "(`samples.jsonl`, `run.log_samples` of them)."
        + (
            " On this task held-out accuracy is the gold reward (`chat_overopt_gold`: the "
            "final answer right, no guessed number, at most 20 words), never trained on."
            if study.over_optimisation
            else ""
        ),
        "",
        "| algo | KL choice | beta | acc end, answers pooled over seeds (95% Wilson) "
        "| vs start, pooled: gained / lost (p) | vs no KL, pooled: gained / lost (p) "
        "| exact KL | entropy | length | collapsed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], -nan_low(c["acc_mean"]))):
        rs = runs[(c["algo"], c["choice"], c["beta"])]
        accs = [num(r["acc_final"]) for r in rs if math.isfinite(num(r["acc_final"]))]
        k = round(sum(accs) * study.eval_size)
        n = study.eval_size * len(accs)
        pooled = "–"
        if n:
            lo, hi = wilson_interval(k, n)
            pooled = f"{k / n:.3f} ({k}/{n}; {lo:.3f}–{hi:.3f})"
        start_pairs, kl_pairs = [], []
        for r in rs:
            start, end = ends(r["name"])
            start_pairs += [(start[i], end[i]) for i in sorted(set(start) & set(end))]
            other = no_kl.get((r["algo"], int(r["seed"])))
            if other and other != r["name"]:
                base_end = ends(other)[1]
                kl_pairs += [(base_end[i], end[i]) for i in sorted(set(base_end) & set(end))]
        collapsed = sum(r["status"] == "collapsed" for r in rs)
        lines.append(
            f"| {c['algo']} | {_label(c, study)} | {fmt(c['beta'])} | {pooled} | "
            f"{_paired(start_pairs)} | {_paired(kl_pairs)} | {_f(c['kl_final'], 4)} | "
            f"{_f(c['entropy_final'], 3)} | {_f(c['length_final'], 1)} | "
            f"{collapsed}/{c['runs']} |"
        )
    return lines


def _paired(pairs: list[tuple[float, float]]) -> str:
    if not pairs:
        return "–"
    d = paired_change(pairs)
    return f"{d['gained']} / {d['lost']} ({d['p']:.2g})"


def _noise_table(cells: list[dict[str, Any]], study: StudyConfig) -> list[str]:
    """The estimator's noise and the steps to the convergence target, one row per cell."""
    target_key, target_value = study.convergence_target()
    target_name = {
        "accuracy/train": "train accuracy",
        "reward/gold": "gold reward (`reward/gold`)",
    }[target_key]
    lines = [
        "",
        "## Estimator noise and convergence",
        "",
        "Per step, the logged estimate `kl/ref/<est>` of the choice's estimator (per token; for "
        "`ref_is` and `adaptive_mix` the reference-sampled estimate per completion divided by the "
        "policy's mean completion length) and, in the same runs, `kl/ref/k1` on the policy's own "
        "tokens. Columns: the variance of the estimate across steps (it includes the KL's drift), "
        "the variance of estimate − exact KL across steps (the estimator's noise), the same for "
        "k1 and their ratio, each the mean over seeds; the mean step at which the "
        f"{WINDOW}-step running mean of the {target_name} reaches {target_value:g} "
        "(over the seeds that reach it, their count after the slash); mean wall time per run and "
        "the part spent sampling and scoring the reference's completions.",
        "",
        "| algo | KL choice | beta | Var est | Var(est − exact) | Var(k1 − exact) | ratio | "
        "steps to target | wall s | reference s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], c["beta"], c["choice"])):
        ratio = c["kl_noise_var"] / c["kl_k1_noise_var"] if c["kl_k1_noise_var"] else math.nan
        lines.append(
            f"| {c['algo']} | {c['choice']} | {fmt(c['beta'])} | {_g(c['kl_est_var'])} | "
            f"{_g(c['kl_noise_var'])} | {_g(c['kl_k1_noise_var'])} | {_f(ratio, 2)} | "
            f"{_f(c['steps_to_target'], 0)} ({c['reached']}/{c['runs']}) | "
            f"{_f(c['wall_s'], 0)} | {_f(c['ref_time_s'], 0)} |"
        )
    return lines


def _spike_table(results: list[dict[str, Any]], study: StudyConfig) -> list[str]:
    """Early gradient-norm peaks and outlier steps, one row per cell, each seed's value
    (``spike_summary``); no section when no run logged a gradient norm."""
    runs: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in results:
        if math.isfinite(num(r.get("grad_norm_peak"))):
            runs.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    if not runs:
        return []
    lines = [
        "",
        "## Gradient-norm and loss spikes",
        "",
        "Per seed (in seed order): the largest gradient norm of an applied step over the first "
        f"half of training (steps 1-{max(1, study.steps // 2)}), and over the whole run the steps "
        "whose `grad_norm` lies above the median of the run's steps of the same kind (with an "
        "advantage signal, or with the KL's gradient alone) by more than "
        f"{OUTLIER_MADS:g} median absolute deviations, and those whose `loss/total` lies that far "
        "from its median on either side (`klpo.study.summary.spike_summary`; skipped steps do "
        f"not count, a kind with fewer than {MIN_REFERENCE_STEPS} steps is not judged: –). The "
        "seed-level comparisons of these columns are a study's to name (`comparisons` with "
        "`metric: grad_norm_peak`).",
        "",
        "| algo | KL choice | beta | early grad-norm peak | grad-norm outlier steps "
        "| loss outlier steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (algo, choice, beta), rs in sorted(runs.items()):
        rs = sorted(rs, key=lambda r: int(r["seed"]))
        peaks = " / ".join(_f(num(r["grad_norm_peak"]), 2) for r in rs)
        grads = " / ".join(_f(num(r.get("grad_norm_outliers")), 0) for r in rs)
        losses = " / ".join(_f(num(r.get("loss_outliers")), 0) for r in rs)
        lines.append(f"| {algo} | {choice} | {fmt(beta)} | {peaks} | {grads} | {losses} |")
    return lines


def _frontiers(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], out: Path
) -> list[ChoiceFrontier]:
    """One :class:`~klpo.study.frontier.ChoiceFrontier` per (algo, choice): its cells and, per
    beta, the seed means of the WINDOW-step running gold, proxy and sequence-KL curves."""
    runs: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    by_choice: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        by_choice.setdefault((c["algo"], c["choice"]), []).append(c)
    keys = ("reward/gold", "reward/proxy", "kl/ref/seq")
    fronts = []
    for (algo, choice), cs in by_choice.items():
        cs = sorted(cs, key=lambda c: c["beta"])
        curves = []
        for c in cs:
            rs = runs[(algo, choice, c["beta"])]
            bands = [
                seed_band([metric_curve(out / "runs" / r["name"], k) for r in rs], WINDOW)
                for k in keys
            ]
            steps = bands[0][0]
            if steps and all(b[0] == steps for b in bands):
                gold, proxy, seq = (b[1] for b in bands)
                curves.append(Curve(c["beta"], steps, gold, proxy, seq))
        evals = [
            e for c in cs for e in _evaluations(c["beta"], runs[(algo, choice, c["beta"])], out)
        ]
        fronts.append(ChoiceFrontier(algo, choice, cs, curves, evals))
    return fronts


def _evaluations(beta: float, runs: list[dict[str, Any]], out: Path) -> list[Evaluation]:
    """The held-out evaluations after the start that every seed of a cell made: the step, the
    held-out gold (``accuracy/heldout``) and the mean ``kl/ref/seq`` over the WINDOW steps up
    to it, seed means."""
    per_seed = []
    for r in runs:
        steps, acc = metric_curve(out / "runs" / r["name"], "accuracy/heldout")
        kl = dict(zip(*metric_curve(out / "runs" / r["name"], "kl/ref/seq"), strict=True))
        seed = {}
        for s, a in zip(steps, acc, strict=True):
            window = [kl[t] for t in range(s - WINDOW + 1, s + 1) if t in kl]
            if s > 0 and window:
                seed[s] = (a, sum(window) / len(window))
        per_seed.append(seed)
    shared = set.intersection(*(set(d) for d in per_seed)) if per_seed else set()
    n = len(per_seed)
    return [
        Evaluation(beta, s, sum(d[s][0] for d in per_seed) / n, sum(d[s][1] for d in per_seed) / n)
        for s in sorted(shared)
    ]


def _overopt_table(cells: list[dict[str, Any]]) -> list[str]:
    """The over-optimisation columns, one row per cell, by final gold reward."""
    lines = [
        "",
        "## Over-optimisation: gold against proxy reward",
        "",
        "Gold reward (the config's `gold_reward`, never trained on: exact correctness on the "
        "toy task, `chat_overopt_gold` on the chat task) and proxy reward (trained on), on the "
        f"steps' sampled completions over the last {WINDOW} "
        f"steps, the peak of the gold reward's {WINDOW}-step running mean and the exact sequence "
        "KL(pi_theta ‖ pi_ref) there, and the exact sequence KL at the end (means over seeds). "
        "proxy − gold is the over-optimisation gap.",
        "",
        "| algo | KL choice | beta | gold final | gold peak | seq KL at peak | proxy final "
        "| proxy − gold | seq KL final |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], -nan_low(c["gold_final"]))):
        lines.append(
            f"| {c['algo']} | {c['choice']} | {fmt(c['beta'])} | {_f(c['gold_final'])} ± "
            f"{_f(c['gold_sd'])} | {_f(c['gold_peak'])} | {_f(c['gold_peak_kl_seq'])} | "
            f"{_f(c['proxy_final'])} | {_f(c['proxy_final'] - c['gold_final'])} | "
            f"{_f(c['kl_seq_final'])} |"
        )
    return lines


def _budget_table(cells: list[dict[str, Any]]) -> list[str]:
    """Holding a KL budget, one row per cell that has one (none: no section)."""
    cells = [c for c in cells if math.isfinite(c["kl_target"])]
    if not cells:
        return []
    lines = [
        "",
        "## Holding a KL budget",
        "",
        "Over the second half of training (steps after half the budget): the mean exact KL (per "
        "token, or per sequence for a `kl.target_unit: sequence` target) divided by the target "
        "(> 1: overshoot), the fraction of steps whose "
        f"{WINDOW}-step running mean of the exact KL is within ±{BUDGET_TOLERANCE:.0%} of the "
        "target (mean over seeds), and the seeds whose every such step is (`held`). The target "
        "is the KL controller's `kl.target`, or the study's `kl_budget` for a fixed beta.",
        "",
        f"| algo | KL choice | beta | target | KL / target | steps within ±{BUDGET_TOLERANCE:.0%} | held |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], c["choice"], c["beta"])):
        lines.append(
            f"| {c['algo']} | {c['choice']} | {fmt(c['beta'])} | "
            f"{_g(c['kl_target'])} per {c['kl_unit']} | "
            f"{_f(c['kl_budget_ratio'], 2)} | {_f(c['kl_budget_frac'], 2)} | "
            f"{c['kl_budget_held']}/{c['runs']} |"
        )
    return lines


def _g(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.3g}"
