"""The real-model study (`klpo compare --task chat-arith`): its preset and grid, the report's
problem-by-problem table against hand counts, and one study end to end on a 1-layer model with
SmolLM2's tokenizer and chat template (the real-model tier)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from klpo.study import spec
from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.runner import run_study
from klpo.study.spec import StudyConfig, load_study, quick_real_study, real_study
from klpo.study.summary import Criteria, mcnemar_exact, paired_change, summarise_run
from klpo.train.config import ConfigError, apply_overrides, build_config
from klpo.train.evaluate import wilson_interval


def test_the_preset_is_the_studys_grid_on_the_chat_task(tmp_path):
    study = real_study(model=str(tmp_path))  # a directory: kept as it is
    runs = study_grid(study)
    labels = [r.choice for r in runs[:: len(study.seeds)]]
    assert labels == ["no KL", "k1 reward", "k3 loss", "k3+ loss", "full loss", "k2 loss"]
    assert len(runs) == 6 * 3 and len(study.seeds) >= 3
    for r in runs:
        cfg = build_config(apply_overrides({}, list(r.overrides)))
        assert cfg.data.source == "builtin-chat-arith" and cfg.data.chat
        assert [t.name for t in cfg.rewards] == ["numeric"]
        assert cfg.model.policy == str(tmp_path) and cfg.model.lora is not None
        assert cfg.model.lora.r == 16 and cfg.optim.lr == 3e-4
        assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (2, 4)
        # The same budget each: steps, evaluations, problems; every held-out score recorded.
        assert cfg.run.steps == study.steps and cfg.run.eval_every == study.steps
        assert cfg.data.eval_size == 100 and cfg.run.log_samples >= cfg.data.eval_size
        assert cfg.kl.estimator == r.estimator and cfg.kl.placement == r.placement
        assert cfg.run.threads == 1
    quick = quick_real_study(model=str(tmp_path))
    assert (quick.steps, quick.seeds, quick.eval_size) == (2, [0], 8)
    assert [c.label for c in quick.choices] == labels
    loaded = load_study(task="chat-arith", quick=True)
    assert loaded.model == "smollm2" and loaded.steps == 2


def test_a_real_models_key_is_its_cached_directory_or_a_clear_error(monkeypatch, tmp_path):
    import klpo.train.tools.real_models as real_models

    monkeypatch.setattr(real_models, "real_model_dir", lambda key: tmp_path / key)
    assert spec.resolve_model("smollm2") == str(tmp_path / "smollm2")
    assert spec.resolve_model("some/dir") == "some/dir"
    monkeypatch.setattr(real_models, "real_model_dir", lambda key: None)
    with pytest.raises(ConfigError, match="run `make real-models`"):
        study_grid(real_study())
    with pytest.raises(ValueError, match="model must be"):
        StudyConfig(model=" ")


def test_mcnemar_and_the_paired_counts_by_enumeration():
    for gained, lost in [(0, 0), (5, 0), (3, 3), (10, 2), (1, 7)]:
        m = gained + lost
        extreme = sum(
            1
            for o in itertools.product((0, 1), repeat=m)
            if abs(2 * sum(o) - m) >= abs(gained - lost)
        )
        assert mcnemar_exact(gained, lost) == pytest.approx(extreme / 2**m if m else 1.0)
    pairs = [(0, 1), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert paired_change(pairs) == {"pairs": 6, "gained": 3, "lost": 1, "p": 0.625}


def _fake_run(out: Path, name: str, start: list[int], end: list[int], kl: float) -> Run:
    """A finished run's metrics.jsonl and samples.jsonl: held-out scores at steps 0 and 2."""
    d = out / "runs" / name
    d.mkdir(parents=True)
    rows = [{"step": 0, "accuracy/heldout": sum(start) / len(start)}]
    for step in (1, 2):
        rows.append(
            {"step": step, "kl/ref/exact": kl, "kl/ref/k1": kl, "entropy": 1.5,
             "completion/length": 4.0 + step, "reward/mean": 0.5, "accuracy/train": 0.5}
        )  # fmt: skip
    rows[-1]["accuracy/heldout"] = sum(end) / len(end)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = [
        {"step": step, "split": "eval", "index": i, "reward": float(s)}
        for step, scores in ((0, start), (2, end))
        for i, s in enumerate(scores)
    ]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    est, placement = ("k1", "none") if name.startswith("nokl") else ("full", "loss")
    return Run(
        name=name, algo="grpo", choice="no KL" if placement == "none" else "full loss",
        estimator=est, placement=placement, beta=0.0 if placement == "none" else 0.1,
        seed=int(name[-1]), overrides=[],
    )  # fmt: skip


def test_the_report_counts_problems_by_hand(tmp_path):
    study = StudyConfig(task="chat-arith", steps=2, eval_every=2, eval_size=5, seeds=[0, 1])
    start = [0, 0, 1, 0, 0]
    spec_runs = [
        ("nokl_s0", [0, 1, 1, 0, 0], 0.4),
        ("nokl_s1", [0, 0, 0, 0, 0], 0.5),
        ("full_s0", [1, 1, 1, 1, 0], 0.1),
        ("full_s1", [1, 0, 1, 0, 0], 0.2),
    ]
    results = []
    for name, end, kl in spec_runs:
        run = _fake_run(tmp_path, name, start, end, kl)
        results.append(
            summarise_run(run, tmp_path / "runs" / name, Criteria(2, 0.0, eval_size=5),
                          returncode=0, wall_s=1.0)
        )  # fmt: skip
    assert results[2]["length_final"] == pytest.approx(5.5)
    write_results(results, tmp_path, study)
    report = (tmp_path / "report.md").read_text()
    row = next(x for x in report.splitlines() if x.startswith("| grpo | full loss | 0.1 | 0.6"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # Pooled: 4 + 2 right of 10; Wilson by the library's own function.
    lo, hi = wilson_interval(6, 10)
    assert cells[3] == f"0.600 (6/10; {lo:.3f}–{hi:.3f})"
    # Against the start (0 0 1 0 0): s0 gains problems 0, 1, 3; s1 gains 0; neither loses one.
    assert cells[4] == f"4 / 0 ({mcnemar_exact(4, 0):.2g})"
    # Against the same seed's no-KL run: s0 gains 0, 3 and loses none; s1 gains 0, 2.
    assert cells[5] == f"4 / 0 ({mcnemar_exact(4, 0):.2g})"
    assert cells[6] == "0.1500" and cells[7] == "1.500" and cells[8] == "5.5"
    # No KL on seed 1 fell from 1/5 to 0/5: with collapse_drop 0 and 2 SE on 5 problems
    # (0.358) that is noise, not a collapse.
    nokl = next(x for x in report.splitlines() if x.startswith("| grpo | no KL | 0 | 0.200 (2/10"))
    # Against its start: s0 gains problem 1, s1 loses problem 2; none against itself.
    assert nokl.rstrip().endswith("| 0/2 |") and "| 1 / 1 (1) | – |" in nokl
    assert not math.isnan(results[0]["acc_final"])


@pytest.mark.real
def test_the_quick_preset_runs_end_to_end_and_resumes(smollm2_tiny, tmp_path):
    """The quick preset's form (two choices, one step) on SmolLM2's conventions: every run
    finishes, the report has the real-model table with per-problem comparisons, and a re-run
    reuses the runs."""
    study = quick_real_study(model=str(smollm2_tiny)).model_copy(
        update={"choices": spec.real_choices()[::4], "steps": 1, "eval_every": 1, "eval_size": 4}
    )
    out = tmp_path / "study"
    results = run_study(study, out)
    assert [r["status"] for r in results] in (
        ["ok", "ok"],
        ["ok", "collapsed"],
        ["collapsed", "ok"],
    )
    report = (out / "report.md").read_text()
    assert "## Held-out accuracy problem by problem" in report
    row = next(x for x in report.splitlines() if "| full loss |" in x and "/4;" in x)
    assert " / " in row.split("|")[5]  # the paired comparison with the no-KL run
    again = run_study(study, out)
    assert [r["name"] for r in again] == [r["name"] for r in results]


def test_the_pilot_table_reads_its_runs_back(tmp_path):
    """bench/chat_arith_pilot.py's table from a pilot directory made by hand: the step times
    (all, with a signal, skipped), the before/after counts with Wilson intervals, the McNemar p."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "chat_arith_pilot.py"
    module_spec = importlib.util.spec_from_file_location("chat_arith_pilot", path)
    pilot = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(pilot)
    run = tmp_path / "p0"
    run.mkdir()
    times = [(10.0, 1.0), (30.0, 0.0), (50.0, 0.0)]  # (time/step, step/skipped)
    run.joinpath("metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": i + 1, "time/step": t, "step/skipped": s}) + "\n"
            for i, (t, s) in enumerate(times)
        )
    )
    run.joinpath("loadavg.json").write_text(json.dumps({"at_end": [1.0, 2.0, 3.5]}))
    against = {"n": 20, "before": 2, "after": 7, "gained": 6, "lost": 1, "mcnemar_p": 0.125}
    result = {"against": against, "by_kind": {"add": "1/5"}, "mean_completion_tokens": 4.25}
    (tmp_path / "p0-step24-n20.json").write_text(json.dumps(result))
    (tmp_path / "p0-step8-n20.json").write_text(
        json.dumps({**result, "against": {**against, "after": 3}})
    )
    text, rows = pilot.table(tmp_path, 20)
    assert [r["step"] for r in rows] == [8, 24]
    assert rows[1]["s_per_step"] == 30.0 and rows[1]["s_per_live_step"] == 40.0
    assert rows[1]["skipped"] == 1 and rows[1]["loadavg15"] == 3.5
    lo, hi = wilson_interval(7, 20)
    line = text.splitlines()[-1]
    assert f"→ **35% (7/20; {100 * lo:.1f}–{100 * hi:.1f}%)**" in line
    assert "| 30 (40; 1) | 3.5 |" in line and "| 6 / 1 | 0.12 |" in line


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[2] / "configs" / "studies").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_shipped_study_files_load_on_the_chat_task(path):
    """`configs/studies/` holds `klpo compare -c` files (StudyConfig keys), not train configs."""
    study = load_study(path, task="chat-arith")
    assert study.choices and study.betas and study.seeds
