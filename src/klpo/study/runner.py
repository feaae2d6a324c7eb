"""The runner: each run of the grid a ``python -m klpo train`` process, ``workers`` at a time.

Each run has one torch thread (two processes with two threads each on two cores run ~50×
slower). A run that exits with an error is recorded as ``crashed``, one whose loss turned
non-finite as ``diverged`` (the trainer exits with code 3); none is dropped. A study directory
can be re-run: finished runs are read back, not repeated, if their config is the one they would
run with now (:func:`changed_runs`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml

from klpo._io import write_text_atomic
from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.spec import StudyConfig
from klpo.study.summary import RESULT_FIELDS, summarise_run
from klpo.train.config import ConfigError, build_config, dump_config, flat
from klpo.train.preflight import check_writable_dir

__all__ = ["PRESENTATION_KEYS", "changed_runs", "run_study"]


PRESENTATION_KEYS = frozenset({"run.progress", "run.threads", "run.tensorboard", "run.out_dir"})


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


def _execute(
    run: Run, out: Path, study: StudyConfig, on_start: Callable[[str, Path], None] | None = None
) -> dict[str, Any]:
    run_dir = out / "runs" / run.name
    done_marker = run_dir / "result.yaml"
    if done_marker.exists():  # finished in an earlier invocation of the same study
        return yaml.safe_load(done_marker.read_text())
    if run_dir.exists():  # a run interrupted mid-way: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(run.name, run_dir / "log.txt")
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
    with (run_dir / "log.txt").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    wall = time.perf_counter() - t0
    error = ""
    if proc.returncode != 0:
        lines = (run_dir / "log.txt").read_text().strip().splitlines()
        error = (lines[-1] if lines else f"exit code {proc.returncode}")[:300]
    row = summarise_run(
        run,
        run_dir,
        returncode=proc.returncode,
        wall_s=wall,
        steps=study.steps,
        collapse_drop=study.collapse_drop,
        error=error,
        target_accuracy=study.convergence_target()[1],
        target_metric=study.convergence_target()[0],
    )
    write_text_atomic(done_marker, yaml.safe_dump(row, sort_keys=False))
    return row


def run_study(
    study: StudyConfig,
    out: str | Path,
    *,
    on_result: Callable[[dict[str, Any], int, int], None] | None = None,
    on_start: Callable[[str, Path], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or finish) the whole grid in ``out``; write results.csv, report.md and plots.

    A finished run found in ``out`` is reused only if its config is the one it would run with
    now; otherwise the study is refused (:func:`changed_runs`) before anything starts.
    """
    out = Path(out)
    check_writable_dir(out, "--out")
    runs = study_grid(study)
    configs = [build_config(overrides=r.overrides) for r in runs]  # fail before any run starts
    changed = changed_runs(runs, out)
    if changed:
        shown = "; ".join(changed[:3]) + (
            f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise ConfigError(
            f"--out {out} holds finished runs of a study with other settings ({shown}). They "
            "would be reported under the new settings; use another --out, or the settings they "
            "were run with"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "study.yaml", yaml.safe_dump(study.model_dump(), sort_keys=False))
    write_text_atomic(
        out / "train-config.yaml",
        "# The first run's resolved klpo train config; others differ in kl.*, algo.*, seed.\n"
        + dump_config(configs[0]),
    )
    rows: list[dict[str, Any] | None] = [None] * len(runs)
    with ThreadPoolExecutor(max_workers=study.workers) as pool:
        futures = {pool.submit(_execute, r, out, study, on_start): i for i, r in enumerate(runs)}
        for n, fut in enumerate(as_completed(futures), start=1):
            i = futures[fut]
            try:
                rows[i] = fut.result()
            except Exception as err:  # the study goes on; the run is recorded as crashed
                rows[i] = {
                    **{k: "" for k in RESULT_FIELDS},
                    **runs[i].model_dump(include={"name", "algo", "choice", "estimator"}),
                    **runs[i].model_dump(include={"placement", "beta", "seed"}),
                    "status": "crashed",
                    "steps_done": 0,
                    "error": f"{type(err).__name__}: {err}"[:300],
                }
            if on_result is not None:
                on_result(rows[i], n, len(runs))
    results = [r for r in rows if r is not None]
    write_results(results, out, study)
    return results
