"""The report's seed-level sections (klpo.study.verdicts), the spike columns of the summary, and
`klpo compare --report-only`, against hand arithmetic and files written by hand."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from klpo.study import runner
from klpo.study.grid import study_grid
from klpo.study.report import refresh_sections, write_results
from klpo.study.seeds import holm, paired_test, t_cdf
from klpo.study.spec import Choice, Comparison, StudyConfig
from klpo.study.summary import RESULT_FIELDS, metric_columns, outliers, spike_summary
from klpo.study.verdicts import (
    ADDED_MARK,
    SEED_HEADING,
    exploratory_comparisons,
    primary_comparisons,
    seed_sections,
)
from klpo.train.config import ConfigError

# --- the spike columns ------------------------------------------------------------------------


def test_outliers_by_hand() -> None:
    # median 1.0, |x - 1| = 0, 0.1, 0.1, 0, 0.2, 7: MAD 0.1, so above 1.5 (and below 0.5)
    values = [1.0, 1.1, 0.9, 1.0, 1.2, 8.0]
    assert outliers(values) == 1
    assert outliers([*values, 0.1]) == 1  # one-sided: a low value is no spike
    assert outliers([*values, 0.1], two_sided=True) == 2
    assert outliers([1.0, math.inf, 1.0]) == 1  # an overflow is a spike
    assert outliers([]) == 0


def test_spike_summary_skips_steps_whose_update_was_not_applied() -> None:
    # 8 steps; grad norms 0.5 .. with a spike of 9 at step 2 and a skipped step 3 logging 50
    # (never applied); the loss has one large negative step. First half: steps 1-4.
    grads = [0.5, 9.0, 50.0, 0.6, 0.5, 0.55, 0.45, 30.0]
    losses = [0.1, 0.18, 0.0, 0.1, -4.0, 0.15, 0.1, 0.12]
    rows = [{"step": 0, "accuracy/heldout": 0.1}]
    for s, (g, loss) in enumerate(zip(grads, losses, strict=True), 1):
        rows.append({"step": s, "grad_norm": g, "loss/total": loss, "step/skipped": float(s == 3)})
    got = spike_summary(rows, 8)
    assert got["grad_norm_peak"] == 9.0  # not 50 (skipped), not 30 (second half)
    # applied norms 0.5 9 0.6 0.5 0.55 0.45 30: median 0.55, MAD 0.05: above 0.8 are 9 and 30
    assert got["grad_norm_outliers"] == 2
    # applied losses 0.1 0.18 0.1 -4 0.15 0.1 0.12: median 0.1, MAD 0.02: beyond 0-0.2: -4
    assert got["loss_outliers"] == 1
    empty = spike_summary([{"step": 0, "accuracy/heldout": 0.1}], 8)
    assert all(math.isnan(v) for v in empty.values())
    few = spike_summary(rows[:5], 8)  # 4 steps, 3 applied: too few to judge against
    assert few["grad_norm_peak"] == 9.0 and math.isnan(few["grad_norm_outliers"])


def test_a_step_is_judged_among_steps_of_its_kind() -> None:
    # A real run: steps without an advantage signal carry only the KL's gradient (~0.02),
    # steps with one ~0.5. Pooled, every signal step would lie beyond median + 5 MAD; judged
    # among their own kind, only the 3.0 among the signal steps and the 0.4 among the KL-only
    # steps are spikes.
    # signal: median 0.56, MAD 0.14, above 1.26: 3.0; KL-only: median 0.0205, MAD 0.003, above
    # 0.0355: 0.4; pooled: median 0.03, MAD 0.02, above 0.13: every signal step and the 0.4
    signal = [0.42, 0.78, 0.55, 0.56, 3.0]
    kl_only = [0.019, 0.021, 0.019, 0.025, 0.010, 0.03, 0.02, 0.4]
    rows = [{"step": i + 1, "grad_norm": g, "loss/total": 0.0, "reward/group_std": 0.25}
            for i, g in enumerate(signal)]  # fmt: skip
    rows += [{"step": i + 6, "grad_norm": g, "loss/total": 0.0, "reward/group_std": 0.0}
             for i, g in enumerate(kl_only)]  # fmt: skip
    assert spike_summary(rows, 13)["grad_norm_outliers"] == 2
    pooled = [{k: v for k, v in r.items() if k != "reward/group_std"} for r in rows]
    assert outliers([r["grad_norm"] for r in pooled]) == 6  # what pooling would say


def test_an_archived_run_gets_the_new_columns_from_its_metrics(tmp_path: Path) -> None:
    rows = [{"step": s, "grad_norm": float(s), "loss/total": 0.0} for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = {"name": "r", "acc_final": 0.5}
    filled = metric_columns(old, tmp_path, 6)
    assert filled["grad_norm_peak"] == 3.0 and filled["acc_final"] == 0.5
    kept = {**old, "grad_norm_peak": 7.0, "grad_norm_outliers": 0, "loss_outliers": 0}
    assert metric_columns(kept, tmp_path, 6) is kept
    assert metric_columns(old, tmp_path / "none", 6) is old
    assert {"grad_norm_peak", "grad_norm_outliers", "loss_outliers"} <= set(RESULT_FIELDS)


# --- the seed-level sections ------------------------------------------------------------------

ACC = {  # per seed, held-out accuracy at the end
    ("no KL", 0.0): [0.22, 0.03, 0.29],
    ("full loss", 0.1): [0.25, 0.27, 0.29],
    ("k3 loss", 0.1): [0.15, 0.25, 0.26],
}


def _study(**kw) -> StudyConfig:
    base = dict(
        choices=[
            Choice(estimator="k1", placement="none"),
            Choice(estimator="k3", placement="loss"),
            Choice(estimator="full", placement="loss"),
        ],
        betas=[0.1],
        seeds=[0, 1, 2],
        steps=4,
    )
    return StudyConfig(**{**base, **kw})


def _results() -> list[dict]:
    out = []
    for (choice, beta), accs in ACC.items():
        for seed, acc in enumerate(accs):
            tag = choice.replace(" ", "-")
            out.append(
                {"name": f"grpo_{tag}_b{beta:g}_s{seed}", "algo": "grpo", "choice": choice,
                 "beta": beta, "seed": seed, "status": "ok", "steps_done": 4, "acc_start": 0.06,
                 "acc_final": acc, "kl_exact_final": 0.1, "kl_exact_peak": 0.1,
                 "kl_gap_mean": 0.0, "reward_final": 0.1, "wall_s": 60.0, "error": ""}
            )  # fmt: skip
    return out


def _row(lines: list[str], start: str) -> list[str]:
    line = next(x for x in lines if x.startswith(start))
    return [c.strip() for c in line.strip("|").split(" | ")]


def test_primary_and_exploratory_families_by_hand() -> None:
    study = _study(
        comparisons=[Comparison(a="full loss @ 0.1", b="no KL")], added_after=["k3 loss @ 0.1"]
    )
    results = _results()
    primary = primary_comparisons(results, study)
    # d = 0.03, 0.24, 0.00: mean 0.09, sd sqrt(0.0342 / 2) = 0.13077, t = 0.09 / (0.13077 /
    # sqrt 3) = 1.1921, df 2: p = 1 - t / sqrt(2 + t²) = 0.3555
    (p,) = primary
    assert p.test.diff == pytest.approx(0.09) and p.test.n == 3
    assert p.test.p == pytest.approx(1 - 1.1921 / math.sqrt(2 + 1.1921**2), abs=2e-4)
    explore = exploratory_comparisons(results, study)
    # the primary pair is not repeated; k3 against no KL is exploratory; no "vs start" off chat
    assert [c.name for c in explore] == ["k3 loss @ 0.1 vs no KL"]
    lines = seed_sections(results, study)
    assert SEED_HEADING in lines
    prim = _row(lines, "| full loss @ 0.1 vs no KL")
    assert prim[2] == "3" and prim[5].startswith("0.090 (") and prim[7] == "0.36"
    assert prim[8] == "0.36"  # Holm over one comparison: itself
    assert prim[11].startswith("not decided (about ")
    k3 = _row(lines, f"| k3 loss @ 0.1 {ADDED_MARK} vs no KL")
    assert k3[11].startswith("not decided")
    cell = _row(lines, f"| grpo | k3 loss {ADDED_MARK} | 0.1 |")
    assert cell[3] == "3" and cell[4] == "0.15 / 0.25 / 0.26"
    # mean 0.2200, sd 0.0608, t_{0.975,2} 4.3027: ± 0.1510
    assert cell[5] == "0.220 (0.069 to 0.371)"
    assert any("Primary comparisons" in x and "Holm over these 1" in x for x in lines)
    assert any("Exploratory comparisons" in x and "Holm over these 1" in x for x in lines)


def test_holm_runs_over_the_exploratory_family() -> None:
    results = _results()
    study = _study()
    explore = exploratory_comparisons(results, study)
    assert [c.name for c in explore] == ["full loss @ 0.1 vs no KL", "k3 loss @ 0.1 vs no KL"]
    lines = seed_sections(results, study)
    ps = [paired_test(ACC[k], ACC[("no KL", 0.0)]).p for k in list(ACC)[1:]]
    for (key, _), adjusted in zip(list(ACC.items())[1:], holm(ps), strict=True):
        row = _row(lines, f"| {key[0]} @ 0.1 vs no KL")
        assert row[8] == f"{adjusted:.2g}"
    assert not any("Primary comparisons" in x for x in lines)  # the spec names none


def test_a_decided_comparison_says_so_and_by_which_side() -> None:
    results = _results()
    for r in results:  # full loss 0.2 above no KL on every seed, with a little spread
        if r["choice"] == "full loss":
            base = ACC[("no KL", 0.0)][r["seed"]]
            r["acc_final"] = base + (0.20, 0.21, 0.22)[r["seed"]]
    study = _study(comparisons=[Comparison(a="full loss @ 0.1", b="no KL")])
    row = _row(seed_sections(results, study), "| full loss @ 0.1 vs no KL")
    # d = 0.20, 0.21, 0.22: t = 0.21 / (0.01 / sqrt 3) = 36.37, df 2
    assert row[7] == f"{2 * t_cdf(-0.21 / (0.01 / math.sqrt(3)), 2):.1e}"
    assert row[10] == "–"  # decided: no seeds needed
    assert row[11] == (
        "differs: full loss @ 0.1 above no KL (the exact permutation check: p = 0.25, its floor "
        "on 3 seeds)"
    )


def _chat_run(out: Path, r: dict, start: list[int], end: list[int]) -> None:
    d = out / "runs" / r["name"]
    d.mkdir(parents=True)
    recs = [
        {"step": step, "split": "eval", "index": i, "reward": float(s)}
        for step, scores in ((0, start), (4, end))
        for i, s in enumerate(scores)
    ]
    (d / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))


def test_the_chat_report_adds_problem_level_intervals_and_labels_pooling(tmp_path: Path) -> None:
    study = _study(task="chat-arith", eval_size=4, added_after=["full loss @ 0.1"])
    results = []
    for r in _results():
        if r["choice"] == "k3 loss":
            continue
        end = [1, 1, 0, 0] if r["choice"] == "full loss" else [1, 0, 0, r["seed"] % 2]
        r["acc_start"], r["acc_final"] = 0.25, sum(end) / 4
        _chat_run(tmp_path, r, [1, 0, 0, 0], end)
        results.append(r)
    report = write_results(results, tmp_path, study).read_text()
    lines = report.splitlines()
    # full loss ends 1 1 0 0 on every seed from 1 0 0 0: its per-problem difference to its
    # start is 0 1 0 0 on every seed, whose resampled means lie in [0, 1] around 0.25
    row = _row(lines, f"| full loss @ 0.1 {ADDED_MARK} vs start")
    lo, hi = (float(x) for x in row[6].split(" to "))
    assert 0.0 <= lo <= 0.25 <= hi <= 1.0
    assert _row(lines, "| no KL vs start")[0] == "no KL vs start"
    assert "## Held-out accuracy problem by problem (descriptive)" in report
    assert "answers pooled over seeds" in report and "not tests" in report
    assert "elapsed" not in report and "measured wall times add up to 6.0 minutes" in report


# --- klpo compare --report-only ---------------------------------------------------------------


def _archive(tmp_path: Path, study: StudyConfig, *, keep_runs: bool = True) -> Path:
    out = tmp_path / "study"
    (out / "runs").mkdir(parents=True)
    (out / "study.yaml").write_text(yaml.safe_dump(study.model_dump(), sort_keys=False))
    names = {r.name for r in study_grid(study)}
    rows = [r for r in _results() if r["name"] in names]
    assert len(rows) == len(names)
    for r in rows:
        d = out / "runs" / r["name"]
        d.mkdir()
        metrics = [{"step": 0, "accuracy/heldout": r["acc_start"]}] + [
            {"step": s, "kl/ref/exact": 0.1, "grad_norm": 0.5 + s, "loss/total": 0.0}
            for s in range(1, 5)
        ]
        metrics[-1]["accuracy/heldout"] = r["acc_final"]
        (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
        (d / "result.yaml").write_text(yaml.safe_dump(r, sort_keys=False))
    write_results(rows, out, study)
    if not keep_runs:
        for d in (out / "runs").iterdir():
            (d / "result.yaml").unlink()
    return out


def test_report_only_rewrites_from_finished_runs_and_starts_none(tmp_path, monkeypatch) -> None:
    study = _study()
    out = _archive(tmp_path, study)
    monkeypatch.setattr(runner.subprocess, "Popen", _no_process)
    named = study.model_copy(update={"comparisons": [Comparison(a="k3 loss @ 0.1", b="no KL")]})
    report = runner.report_only(named, out).read_text()
    assert "**Primary comparisons**" in report and "| k3 loss @ 0.1 vs no KL | acc_final" in report
    assert yaml.safe_load((out / "study.yaml").read_text())["comparisons"]  # recorded
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert float(rows[0]["grad_norm_peak"]) == 2.5  # steps 1-2 of 4: 1.5, 2.5


def _no_process(*args, **kwargs):
    raise AssertionError("--report-only started a process")


def test_report_only_refuses_a_missing_run(tmp_path) -> None:
    study = _study()
    out = _archive(tmp_path, study)
    (out / "runs" / "grpo_k3-loss_b0.1_s2" / "result.yaml").unlink()
    (out / "results.csv").write_text("name\n")
    with pytest.raises(ConfigError, match=r"1 runs of the grid .*grpo_k3-loss_b0.1_s2"):
        runner.report_only(study, out)
    grown = study.model_copy(update={"seeds": [0, 1, 2, 3]})
    with pytest.raises(ConfigError, match=r"grpo_full-loss_b0\.1_s3"):
        runner.report_only(grown, out)
    with pytest.raises(ConfigError, match="holds no study"):
        runner.report_only(study, tmp_path)


def test_report_only_on_an_archive_without_runs_keeps_the_rest(tmp_path) -> None:
    study = _study()
    out = _archive(tmp_path, study, keep_runs=False)
    before = (out / "report.md").read_text()
    old_tail = before[before.index("\n## Estimator noise") :]
    with (out / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    marked = study.model_copy(update={"added_after": ["k3 loss @ 0.1"]})
    text = runner.report_only(marked, out).read_text()
    assert text.endswith(old_tail)  # every other section, byte for byte
    assert f"| grpo | k3 loss {ADDED_MARK} | 0.1 |" in text
    assert text.count(SEED_HEADING) == 1
    again = refresh_sections(rows, out, marked).read_text()  # idempotent
    assert again == text


def test_the_cli_flag(tmp_path) -> None:
    from typer.testing import CliRunner

    from klpo.cli import app

    result = CliRunner().invoke(
        app, ["compare", "--quick", "--report-only", "--out", str(tmp_path / "none")]
    )
    assert result.exit_code == 2 and "holds no study" in result.output


def test_no_problem_table_from_a_few_logged_problems(tmp_path: Path) -> None:
    """Runs that logged 4 of their 200 held-out problems (``run.log_samples``) have no
    per-problem interval: the table must hold every problem of the evaluation."""
    study = _study(eval_size=200)
    results = [r for r in _results() if r["choice"] != "k3 loss"]
    for r in results:
        _chat_run(tmp_path, r, [1, 0, 0, 0], [1, 1, 0, 0])
    report = write_results(results, tmp_path, study).read_text()
    row = _row(report.splitlines(), "| full loss @ 0.1 vs no KL")
    assert row[6] == "–"
    assert _row(report.splitlines(), "| grpo | full loss | 0.1 | 3 |")[7] == "–"


def test_the_report_lists_each_seeds_spikes(tmp_path: Path) -> None:
    study = _study()
    out = _archive(tmp_path, study)  # grad norms 1.5, 2.5, 3.5, 4.5 over steps 1-4
    text = (out / "report.md").read_text()
    assert "## Gradient-norm and loss spikes" in text
    # 4 steps a run: the peak, but too few steps to judge outliers against
    assert "| grpo | k3 loss | 0.1 | 2.50 / 2.50 / 2.50 | – / – / – | – / – / – |" in text
