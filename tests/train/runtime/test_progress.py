"""Progress of long commands: plain lines at a log's rate with the elapsed time and an ETA, a
rich bar on a terminal, the same helper in every command."""

from __future__ import annotations

import json
import math

import pytest

from klpo.train.runtime.progress import PlainLines, Progress, fmt_duration, progress, train_info


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def plain(
    total: int, lines_per_work: int = 20, heartbeat_s: float = 30.0, **kw
) -> tuple[Progress, list[str], Clock]:
    lines: list[str] = []
    clock = Clock()
    how = PlainLines(lines.append, lines_per_work, heartbeat_s, clock)
    bar = Progress("work", total, terminal=False, plain=how, **kw)
    return bar, lines, clock


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0 s"), (42.4, "42 s"), (59.6, "1 min 00 s"), (185, "3 min 05 s"),
     (3725, "1 h 02 min"), (math.inf, "?")],
)  # fmt: skip
def test_durations(seconds, text):
    assert fmt_duration(seconds) == text


def test_the_eta_is_the_mean_time_per_unit_times_the_units_left():
    bar, lines, clock = plain(10, lines_per_work=1)
    clock.t += 8.0
    bar.update(4)  # 4 units in 8 s: 2 s a unit, 6 left
    assert bar.eta() == pytest.approx(12.0)
    assert bar.line() == "work 4/10 (40%)  8 s elapsed, ETA 12 s"
    assert lines == [bar.line()]  # the first update (no part, mark or heartbeat needed)
    clock.t += 2.0
    bar.update(5)  # no part, no mark (one line per whole), no heartbeat: no line
    assert len(lines) == 1


def test_weighted_units_give_the_eta_and_percentage_of_the_cost():
    bar, _, clock = plain(4, lines_per_work=1, weights=[1.0, 1.0, 6.0, 2.0])
    clock.t += 4.0
    bar.update(2)  # cost 2 of 10 in 4 s: 2 s per unit of cost, 8 left
    assert bar.eta() == pytest.approx(16.0) and bar.fraction() == pytest.approx(0.2)
    assert bar.line() == "work 2/4 (20%)  4 s elapsed, ETA 16 s"
    clock.t += 12.0
    bar.update(3)  # cost 8 in 16 s: 2 left at 2 s each
    assert bar.eta() == pytest.approx(4.0)
    with pytest.raises(ValueError, match="3 weights for 4 units"):
        Progress("work", 4, weights=[1.0, 1.0, 1.0], show=False)


def test_the_wait_before_the_first_update_is_not_in_the_rate():
    """A command that loads for 60 s and then does a unit a second: after the first update the
    rate is of the units since it (1 s each), not of the loading."""
    bar, lines, clock = plain(100)
    clock.t += 60.0  # loading a model
    bar.update(1)
    assert bar.eta() == pytest.approx(60.0 / 1 * 99)  # all there is to go on yet
    assert lines == [bar.line()]  # the first update is shown at once: the work has started
    clock.t += 10.0
    bar.update(11)  # 10 units in the 10 s since the first update: 89 left at 1 s
    assert bar.eta() == pytest.approx(89.0)
    assert bar.line().endswith("1 min 10 s elapsed, ETA 1 min 29 s")


def test_the_eta_follows_the_present_rate_on_a_machine_whose_load_changes():
    """1 s a unit for 40 units, then 4 s a unit (the machine got busy): the ETA is at the last
    window's rate (60 s here: the latest update at least 60 s ago), not the mean since the start."""
    bar, _, clock = plain(100)
    bar.update(1)
    for done in range(2, 42):
        clock.t += 1.0
        bar.update(done)
    for done in range(42, 62):
        clock.t += 4.0
        bar.update(done)
    # now t = 220 (120 s since the first update): the window starts at the update of t = 160,
    # done 46; 15 units in 60 s, 4 s each; 39 left. The mean since the start: 2 s a unit.
    assert bar.eta() == pytest.approx(39 * 4.0)
    assert bar.line().endswith("ETA 2 min 36 s")


def test_a_resumed_count_times_only_the_units_done_here():
    bar, _, clock = plain(100, done=90)
    assert bar.eta() == math.inf and "ETA ?" in bar.line()
    clock.t += 5.0
    bar.update(95)  # 5 units in 5 s here (the first 90 were done before): 5 s left
    assert bar.eta() == pytest.approx(5.0)


def test_plain_lines_at_marks_parts_heartbeats_and_the_end():
    bar, lines, clock = plain(100, lines_per_work=4, heartbeat_s=30.0)
    for done in range(1, 101):
        clock.t += 0.1
        part = "first" if done <= 10 else "second"
        bar.update(done, part=part, info=f"n {done}")
        if done == 60:
            clock.t += 45.0  # a slow unit: the next update is a heartbeat
    shown = [line.split("  ")[0] for line in lines]
    # part "first" at 1, mark 25 (every 100 // 4), part "second" at 11, marks 50, 75,
    # a heartbeat at 61 (45 s after the line at 50), the end at 100
    assert shown == [
        "work 1/100 (1%)", "work 11/100 (11%)", "work 25/100 (25%)", "work 50/100 (50%)",
        "work 61/100 (61%)", "work 75/100 (75%)", "work 100/100 (100%)",
    ]  # fmt: skip
    assert "second  n 61  " in lines[4] and "ETA" in lines[4]
    assert lines[-1].endswith("done in 55 s")  # 100 · 0.1 + 45


def test_nothing_is_shown_when_not_asked():
    bar, lines, _ = plain(3, show=False)
    for done in (1, 2, 3):
        bar.update(done, part="x")
    assert lines == []


def test_a_terminal_gets_a_rich_bar_with_eta(capsys):
    with Progress("work", 4, terminal=True) as bar:
        for done in range(1, 5):
            bar.update(done, part="part", info="loss 1.0")
    err = capsys.readouterr().err
    assert "work" in err and "4/4" in err and "ETA" in err and "part  loss 1.0" in err


def test_training_lines_carry_the_gold_reward_on_the_overoptimisation_task():
    base = {"reward/mean": 1.25, "kl/ref/exact": 0.01234}
    assert train_info(base) == "reward 1.250  exact KL 0.0123"
    over = {**base, "reward/gold": 0.375, "accuracy/heldout": 0.5}
    assert train_info(over) == "reward 1.250  gold 0.375  exact KL 0.0123"
    lines: list[str] = []
    report = progress(2, 0, show=True, log=lines.append, terminal=False)
    report(1, over)
    report(2, base)
    report(None, None)
    # The mid-run evaluation is a line of its own, after its step's line.
    assert [x.split("  ")[0] for x in lines] == [
        "step 1/2 (50%)",
        "held-out accuracy at step 1: 0.500",
        "step 2/2 (100%)",
    ]
    assert "gold 0.375" in lines[0] and "ETA" in lines[0]


def test_every_held_out_line_of_a_run_has_its_count_and_interval_once(tiny_model, quick, tmp_path):
    """A run with progress shown: each evaluation's line says k/n right and its 95% interval,
    and the last step's is said once (before, the progress printed it bare and the loop again)."""
    from klpo.train.config import build_config
    from klpo.train.loop import train

    said: list[str] = []
    over = {"run.steps": 2, "run.eval_every": 1, "run.progress": True}
    train(build_config(overrides=quick(tiny_model, tmp_path / "run", **over)), log=said.append)
    for step in (0, 1, 2):
        lines = [x for x in said if x.startswith(f"held-out accuracy at step {step}: ")]
        assert len(lines) == 1 and "/8 right; 95% interval " in lines[0], said


def test_a_mid_run_evaluation_prints_above_the_terminal_bar(capsys):
    report = progress(3, 0, show=True, terminal=True)
    report(1, {"reward/mean": 0.5, "kl/ref/exact": 0.001})
    report(2, {"reward/mean": 0.5, "kl/ref/exact": 0.001, "accuracy/heldout": 0.625})
    report(3, {"reward/mean": 0.5, "kl/ref/exact": 0.001})
    report(None, None)
    err = capsys.readouterr().err
    assert err.count("held-out accuracy at step 2: 0.625") == 1 and "exact KL 0.0010" in err


def test_the_runs_of_a_study_under_way_are_read_from_their_metrics_tail(tmp_path):
    from klpo.study.runner import last_step

    assert last_step(tmp_path / "none") == 0
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "pad": "x" * 30_000} for s in range(5)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "torn'
    (run / "metrics.jsonl").write_text(text)
    assert last_step(run) == 4  # the torn line of a run being written is skipped


def test_a_run_says_so_before_and_after_its_step_zero_evaluation(tiny_model, quick, tmp_path):
    """On a real model the starting policy's evaluation is the first long wait: it is announced
    before it starts and its result is said when it ends (then the step lines follow)."""
    from klpo.train.config import build_config
    from klpo.train.loop import train

    said: list[str] = []
    overrides = quick(tiny_model, tmp_path / "run", **{"run.steps": 1, "run.progress": True})
    train(build_config(overrides=overrides), log=said.append)
    start = next(i for i, x in enumerate(said) if x.startswith("evaluating the starting policy"))
    assert said[start] == "evaluating the starting policy on 8 held-out problems (greedy)"
    assert said[start + 1].startswith("held-out accuracy at step 0: ")
    assert said[start + 2].startswith("step 1/1 (100%)  reward ")


def test_compare_shows_its_progress_over_every_runs_steps(tmp_path, monkeypatch, capsys):
    """`klpo compare`'s bar counts the steps of all its runs (a finished run's at once) and the
    runs finished; each run here is faked (it writes its metrics and a row)."""
    from klpo.study import runner
    from klpo.study.grid import study_grid
    from klpo.study.spec import quick_study

    study = quick_study()
    runs = study_grid(study)

    def fake(run, out, study, on_start=None):
        run_dir = out / "runs" / run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        steps = range(1, study.steps + 1)
        (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in steps))
        return {"name": run.name}

    monkeypatch.setattr(runner, "_execute", fake)
    monkeypatch.setattr(runner, "write_results", lambda *a, **k: None)
    assert len(runner.run_study(study, tmp_path, show_progress=True)) == len(runs)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("compare ")]
    total = len(runs) * study.steps
    assert lines and all(" runs finished" in x for x in lines)
    assert lines[-1].startswith(f"compare {total}/{total} (100%)  {len(runs)}/{len(runs)} runs")
    assert "done in" in lines[-1]
    runner.run_study(study, tmp_path / "quiet", show_progress=False)
    assert "compare " not in capsys.readouterr().err
