"""The runner: each run of the grid a ``python -m klpo train`` process, ``workers`` at a time.

Each run has one torch thread (two processes with two threads each on two cores run ~50×
slower). A run that exits with an error is recorded as ``crashed``, one whose loss turned
non-finite as ``diverged`` (the trainer exits with code 3); none is dropped. A study directory
can be re-run: finished runs are read back, not repeated, if their config is the one they would
run with now (:func:`changed_runs`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from klpo._io import write_text_atomic
from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.spec import StudyConfig
from klpo.study.summary import RESULT_FIELDS, num, summarise_run
from klpo.train.config import ConfigError, build_config, dump_config, flat
from klpo.train.outdir import DirLock, claim_dir, fresh_name
from klpo.train.runtime.progress import Progress, fmt_duration

__all__ = ["POLL_S", "PRESENTATION_KEYS", "changed_runs", "last_step", "run_study", "runs_left_s"]

POLL_S = 2.0
"""Seconds between two looks at the runs under way (their progress)."""

PRESENTATION_KEYS = frozenset({"run.progress", "run.threads", "run.tensorboard", "run.out_dir"})
STUDY_SCHEDULING_KEYS = frozenset({"workers"})  # how the runs are scheduled, not what they are


def changed_runs(runs: list[Run], out: Path) -> list[str]:
    """A line per finished run in ``out`` whose saved config is not the one it would run now.

    Re-running a study directory reuses its finished runs; this catches a re-run with other
    settings (steps, base keys, ...), which would otherwise report old runs under new labels.
    """
    lines = []
    for run in runs:
        run_dir = out / "runs" / run.name
        saved_path = run_dir / "config.yaml"
        if not (run_dir / "result.yaml").exists() or not saved_path.exists():
            continue
        try:
            saved = flat(build_config(yaml.safe_load(saved_path.read_text()) or {}))
        except (ConfigError, yaml.YAMLError):
            lines.append(f"{run.name}: its config.yaml cannot be read")
            continue
        now = flat(build_config(overrides=[*run.overrides, f"run.out_dir={run_dir}"]))
        diff = [
            f"{k} {saved.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(saved) | set(now))
            if k not in PRESENTATION_KEYS and saved.get(k) != now.get(k)
        ]
        if diff:
            lines.append(f"{run.name}: {', '.join(diff)}")
    return lines


def study_changes(study: StudyConfig, out: Path) -> list[str]:
    """``key: saved -> now`` for each setting of the study in ``out`` (its ``study.yaml``) that
    the study re-run over it changes, outside :data:`STUDY_SCHEDULING_KEYS`."""
    path = out / "study.yaml"
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
        saved = StudyConfig.model_validate(saved).model_dump(mode="json")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as err:
        return [f"its study.yaml cannot be read ({str(err).splitlines()[0]})"]
    now = study.model_dump(mode="json")
    return [
        f"{k}: {saved.get(k)!r} -> {now.get(k)!r}"
        for k in sorted(set(saved) | set(now))
        if k not in STUDY_SCHEDULING_KEYS and saved.get(k) != now.get(k)
    ]


def _refuse_other_study(out: Path, what: str, changed: list[str]) -> None:
    shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise ConfigError(
        f"--out {out} holds {what} ({shown}). They would be reported under the new settings, "
        "or replaced; re-run with the settings in its study.yaml to finish it, or choose another "
        f"--out, e.g. {fresh_name(out)}"
    )


def _execute(
    run: Run, out: Path, study: StudyConfig, on_start: Callable[[str, Path], None] | None = None
) -> dict[str, Any]:
    run_dir = out / "runs" / run.name
    done_marker = run_dir / "result.yaml"
    if done_marker.exists():  # finished in an earlier invocation of the same study
        return yaml.safe_load(done_marker.read_text())
    if run_dir.exists():  # a run interrupted mid-way: start it again from scratch
        shutil.rmtree(run_dir)
    log_path = out / "logs" / f"{run.name}.txt"  # beside the run: klpo train wants it empty
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(run.name, log_path)
    cmd = [sys.executable, "-m", "klpo", "train", "--set", f"run.out_dir={run_dir}"]
    for o in run.overrides:
        cmd += ["--set", o]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    wall = time.perf_counter() - t0
    error = ""
    if proc.returncode != 0:
        lines = log_path.read_text().strip().splitlines()
        error = (lines[-1] if lines else f"exit code {proc.returncode}")[:300]
    row = summarise_run(
        run,
        run_dir,
        returncode=proc.returncode,
        wall_s=wall,
        steps=study.steps,
        collapse_drop=study.collapse_drop,
        eval_size=study.eval_size,
        error=error,
        target_accuracy=study.convergence_target()[1],
        target_metric=study.convergence_target()[0],
    )
    write_text_atomic(done_marker, yaml.safe_dump(row, sort_keys=False))
    return row


def _result(fut: Future, run: Run) -> dict[str, Any]:
    """A finished run's row; a run whose execution raised is recorded as crashed (the study
    goes on)."""
    try:
        return fut.result()
    except Exception as err:
        return {
            **{k: "" for k in RESULT_FIELDS},
            **run.model_dump(include={"name", "algo", "choice", "estimator"}),
            **run.model_dump(include={"placement", "beta", "seed"}),
            "status": "crashed",
            "steps_done": 0,
            "error": f"{type(err).__name__}: {err}"[:300],
        }


def last_step(run_dir: Path) -> int:
    """The step of the last complete line of a run's ``metrics.jsonl`` (0 when there is none),
    read from the file's tail only: the progress of a run under way."""
    try:
        with (run_dir / "metrics.jsonl").open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            tail = f.read()
    except OSError:
        return 0
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def run_study(
    study: StudyConfig,
    out: str | Path,
    *,
    on_result: Callable[[dict[str, Any], int, int], None] | None = None,
    on_start: Callable[[str, Path], None] | None = None,
    show_progress: bool = False,
) -> list[dict[str, Any]]:
    """Run (or finish) the whole grid in ``out``; write results.csv, report.md and plots.

    ``out`` follows the rule of :mod:`klpo.train.outdir`: new or empty, or a study with the same
    settings (:func:`study_changes`, outside the scheduling keys), whose finished runs are
    reused only if each one's config is the one it would run with now (:func:`changed_runs`);
    anything else is refused before anything starts. ``out`` is locked while the study runs.
    With ``show_progress``, a :class:`~klpo.train.runtime.progress.Progress` over every run's
    steps (those under way read from their ``metrics.jsonl`` every :data:`POLL_S` seconds).
    """
    out = Path(out)
    state = claim_dir(out, "compare", proceed=True)
    runs = study_grid(study)
    configs = [build_config(overrides=r.overrides) for r in runs]  # fail before any run starts
    changed = changed_runs(runs, out)
    if changed:
        _refuse_other_study(out, "finished runs of a study with other settings", changed)
    if state == "own" and (changed := study_changes(study, out)):
        _refuse_other_study(out, "a study with other settings", changed)
    with DirLock(out, "klpo compare", option="--out"):
        return _run_all(study, runs, configs, out, on_result, on_start, show_progress)


def runs_left_s(walls: list[float], left: int, workers: int) -> float | None:
    """Seconds the ``left`` runs not yet finished take at the mean wall time of the finished
    ones (``walls``, each a whole run: its start-up, model load and step-0 evaluation included,
    which a count of steps leaves out), ``workers`` at a time; None before any has finished."""
    done = [w for w in walls if w == w and w > 0]  # finished and timed (not NaN)
    if not done or left <= 0:
        return None
    return sum(done) / len(done) * math.ceil(left / max(1, workers))


def _run_all(
    study: StudyConfig,
    runs: list[Run],
    configs: list,
    out: Path,
    on_result: Callable[[dict[str, Any], int, int], None] | None,
    on_start: Callable[[str, Path], None] | None,
    show_progress: bool,
) -> list[dict[str, Any]]:
    """Every run of the grid, ``study.workers`` at a time; then results.csv, report.md, plots."""
    write_text_atomic(out / "study.yaml", yaml.safe_dump(study.model_dump(), sort_keys=False))
    write_text_atomic(
        out / "train-config.yaml",
        "# The first run's resolved klpo train config; others differ in kl.*, algo.*, seed.\n"
        + dump_config(configs[0]),
    )
    rows: list[dict[str, Any] | None] = [None] * len(runs)
    finished = sum((out / "runs" / r.name / "result.yaml").exists() for r in runs)
    units = len(runs) * study.steps
    with (
        Progress("compare", units, done=finished * study.steps, show=show_progress) as bar,
        ThreadPoolExecutor(max_workers=study.workers) as pool,
    ):
        futures = {pool.submit(_execute, r, out, study, on_start): i for i, r in enumerate(runs)}
        pending, n = set(futures), 0
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for fut in done:
                i, n = futures[fut], n + 1
                rows[i] = _result(fut, runs[i])
                if on_result is not None:
                    on_result(rows[i], n, len(runs))
            steps = sum(
                study.steps if rows[i] is not None else last_step(out / "runs" / r.name)
                for i, r in enumerate(runs)
            )
            walls = [num(r.get("wall_s")) for r in rows if r is not None]
            left = runs_left_s(walls, len(runs) - n, study.workers)
            by_runs = f", about {fmt_duration(left)} left by the runs' own times" if left else ""
            bar.update(steps, info=f"{n}/{len(runs)} runs finished{by_runs}")
    results = [r for r in rows if r is not None]
    write_results(results, out, study)
    return results
