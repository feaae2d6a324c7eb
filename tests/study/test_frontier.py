"""The over-optimisation frontiers, against hand-computed values."""

from __future__ import annotations

import json
import math

from klpo.study.frontier import ChoiceFrontier, Curve, best_within, frontier_table, pareto
from klpo.study.grid import Run
from klpo.study.report import write_results
from klpo.study.spec import StudyConfig
from klpo.study.summary import Criteria, summarise_cells, summarise_run

NAN = math.nan


def test_best_within_by_hand():
    pts = [(0.2, 0.30), (0.6, 0.35), (1.5, 0.40), (3.0, 0.10), (NAN, 0.9), (0.1, NAN)]
    assert all(map(math.isnan, best_within(pts, 0.1)))  # (0.1, nan): no finite gold
    assert best_within(pts, 0.25) == (0.30, 0.2)
    assert best_within(pts, 0.6) == (0.35, 0.6)  # the budget is inclusive
    assert best_within(pts, 1.0) == (0.35, 0.6)
    assert best_within(pts, math.inf) == (0.40, 1.5)  # the non-finite points never count
    # ties in gold keep the smaller KL
    assert best_within([(0.9, 0.5), (0.4, 0.5)], 1.0) == (0.5, 0.4)


def test_pareto_staircase_by_hand():
    pts = [(3.0, 0.10), (0.6, 0.35), (0.2, 0.30), (1.5, 0.40), (0.8, 0.33), (0.6, 0.36)]
    # by KL: 0.2→0.30 (kept), 0.6→0.35 then 0.36 at the same KL (replaces it), 0.8→0.33 (below),
    # 1.5→0.40 (kept), 3.0→0.10 (below)
    assert pareto(pts) == [(0.2, 0.30), (0.6, 0.36), (1.5, 0.40)]
    assert pareto([(NAN, 1.0)]) == []


def _cell(beta, kl, gold, proxy=0.5, peak=None, peak_kl=None, sd=0.01, failed=0):
    return {
        "beta": beta,
        "kl_seq_final": kl,
        "gold_final": gold,
        "proxy_final": proxy,
        "gold_peak": gold if peak is None else peak,
        "gold_peak_kl_seq": kl if peak_kl is None else peak_kl,
        "gold_sd": sd,
        "failed": failed,
        "runs": 3,
    }


def test_frontier_table_rows_by_hand():
    f = ChoiceFrontier(
        "grpo",
        "full loss",
        [
            _cell(0.3, 0.2, 0.30),
            _cell(0.1, 0.6, 0.35, proxy=0.52, peak=0.37, peak_kl=0.5, sd=0.02),
            _cell(0.01, 5.0, 0.05, peak=0.38, peak_kl=0.9, failed=2),
        ],
        [Curve(0.1, [5, 10, 15, 20], [0.9, 0.2, 0.36, 0.34], [0.5] * 4, [0.1, 0.3, 0.45, 0.7])],
    )
    lines = frontier_table([f], window=10, budgets=(0.25, 1.0, math.inf))
    row = next(line for line in lines if line.startswith("| grpo | full loss | 0.300"))
    # ≤ 0.25: beta 0.3's 0.30; ≤ 1: beta 0.1's 0.35; any: still 0.35 (0.05 at KL 5 is lower);
    # peak: beta 0.01's 0.38 at seq KL 0.9; gap and sd at the best final cell (beta 0.1):
    # 0.52 − 0.35 = 0.17, 0.02; failed 2 of 9
    assert row == (
        "| grpo | full loss | 0.300 (0.3) | 0.350 (0.1) | 0.350 (0.1) | 0.380 (0.01, 0.90) "
        "| 0.170 | 0.020 | 2/9 |"
    )
    # checkpoints after step 10: (0.45, 0.36), (0.7, 0.34); ≤ 0.25: none; ≤ 1 and any: 0.36
    ck = [line for line in lines if line.startswith("| grpo | full loss |")][1]
    assert ck == "| grpo | full loss | – | 0.360 | 0.360 |"


def test_write_results_has_the_frontier_and_its_plots(tmp_path):
    """Two betas of one choice and a no-KL run, from metrics files written by hand."""
    study = StudyConfig(task="overopt", seeds=[0], steps=20)
    results = []
    for choice, beta, gold_end, kl_end in (
        ("full loss", 0.1, 0.4, 0.5),
        ("full loss", 0.01, 0.2, 3.0),
        ("no KL", 0.0, 0.0, 40.0),
    ):
        name = f"{choice}-{beta}".replace(" ", "_")
        run_dir = tmp_path / "runs" / name
        run_dir.mkdir(parents=True)
        rows = [
            {
                "step": s,
                "reward/gold": 0.3 if s <= 10 else gold_end,
                "reward/proxy": 0.5,
                "reward/mean": 0.5,
                "kl/ref/seq": 0.2 if s <= 10 else kl_end,
                "kl/ref/exact": 0.05,
            }
            for s in range(1, 21)
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = Run(
            name=name, algo="grpo", choice=choice, estimator="full",
            placement="none" if beta == 0 else "loss", beta=beta, seed=0, overrides=[],
        )  # fmt: skip
        results.append(
            summarise_run(
                run, run_dir, Criteria(20, 0.1, target_accuracy=0.3, target_metric="reward/gold"),
                returncode=0, wall_s=1.0,
            )
        )  # fmt: skip
    cells = summarise_cells(results)
    assert {c["choice"] for c in cells} == {"full loss", "no KL"}
    text = write_results(results, tmp_path, study).read_text()
    assert "## Frontier: gold reward within a KL budget" in text
    # end of training: full loss, ≤ 0.5 nats: beta 0.1's 0.4; no KL reaches its 0 only at 40
    assert "| grpo | full loss | – | 0.400 (0.1) | 0.400 (0.1) | 0.400 (0.1) |" in text
    assert "| grpo | no KL | – | – | – | – | – | 0.000 (0) |" in text
    for png in ("frontier.png", "gold_proxy.png"):
        assert (tmp_path / png).stat().st_size > 0 and f"]({png})" in text
    # the accuracy task has no frontier section
    other = write_results(results, tmp_path, StudyConfig(seeds=[0], steps=20)).read_text()
    assert "## Frontier" not in other


def test_the_figure_keeps_a_linear_kl_axis_until_a_kl_is_positive():
    """A study of a step or two has no KL yet: every point at 0 is drawn on a linear axis
    (matplotlib warns on a log axis without a positive value); any positive KL makes it log."""
    import warnings

    from klpo.study.frontier import frontier_figure

    def figure(kl: float):
        cell = {"beta": 0.1, "kl_seq_final": kl, "gold_final": 0.2, "gold_sd": NAN}
        curve = Curve(0.1, [1, 2, 3], [0.1, 0.2, 0.2], [0.2, 0.3, 0.3], [kl, kl, kl])
        return frontier_figure([ChoiceFrontier("grpo", "full loss", [cell], [curve])], 1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat = figure(0.0)
    assert [ax.get_xscale() for ax in flat.axes] == ["linear", "linear"]
    assert [ax.get_xscale() for ax in figure(0.5).axes] == ["log", "log"]
