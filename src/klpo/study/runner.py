"""The runner: each run of the grid a ``python -m klpo train`` process, ``workers`` at a time.

Each run has one torch thread (two processes with two threads each on two cores run ~50×
slower). A run that exits with an error is recorded as ``crashed``, one whose loss turned
non-finite as ``diverged`` (the trainer exits with code 3); none is dropped. A study directory
can be re-run: finished runs are read back, not repeated, if their config is the one they would
run with now (:func:`changed_runs`); a crashed or interrupted one is run again, continued from
its last checkpoint (``klpo train --resume``, which resumes exactly) where it has one.

Signals: the trainers run in their own process group, so a Ctrl-C (SIGINT) or a SIGTERM reaches
the study alone, which forwards it to every trainer under way (each stops after its step with a
checkpoint), starts no further run, waits for them, writes the summary of the runs finished so
far and exits 128 + the signal (:class:`StudyInterrupted`); the same signal again is forwarded
again, which stops the trainers at once. A run directory whose lock is held (a trainer of an
earlier study still writing it) is never cleared.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import yaml

from klpo._io import write_text_atomic
from klpo.study.grid import Run, study_grid
from klpo.study.report import refresh_sections, write_results
from klpo.study.spec import StudyConfig
from klpo.study.summary import RESULT_FIELDS, Criteria, num, summarise_run
from klpo.train.config import ConfigError, build_config, dump_config, flat
from klpo.train.outdir import LOCK_FILE, DirBusy, DirLock, claim_dir, fresh_name
from klpo.train.runtime.checkpoint import latest_checkpoint
from klpo.train.runtime.progress import Progress, fmt_duration
from klpo.train.runtime.stop import PARENT_ENV

__all__ = [
    "POLL_S",
    "PRESENTATION_KEYS",
    "StudyInterrupted",
    "changed_runs",
    "finished_row",
    "last_step",
    "report_only",
    "run_study",
    "runs_left_s",
    "seed_major",
]

POLL_S = 2.0
"""Seconds between two looks at the runs under way (their progress)."""

PRESENTATION_KEYS = frozenset(
    {"run.progress", "run.threads", "run.tensorboard", "run.out_dir", "run.eval_cache"}
)
EVAL_CACHE = "eval-cache"  # OUT/eval-cache: the runs' shared starting evaluations (run.eval_cache)
# How the runs are scheduled and analysed, not what they are.
STUDY_SCHEDULING_KEYS = frozenset({"workers", "comparisons", "added_after", "alpha", "cpu_hours"})
GRID_KEYS = frozenset({"seeds", "betas", "choices"})  # a study may grow along these
RUN_AGAIN = frozenset({"crashed", "interrupted"})  # statuses a re-run does not reuse
INTERRUPTED_CODES = frozenset(
    {128 + signal.SIGINT, 128 + signal.SIGTERM, -signal.SIGINT, -signal.SIGTERM}
)


class StudyInterrupted(RuntimeError):
    """The study stopped on a signal; the runs finished so far are summarised. ``exit_code`` is
    128 + the signal, ``finished`` and ``unfinished`` name the runs."""

    def __init__(self, signum: int, finished: list[str], unfinished: list[str]) -> None:
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name}: {len(finished)} of {len(finished) + len(unfinished)} runs finished"
        )
        self.signum, self.exit_code = signum, 128 + signum
        self.finished, self.unfinished = finished, unfinished


def finished_row(run_dir: Path) -> dict[str, Any] | None:
    """The ``result.yaml`` row of a run that finished (any status but crashed or interrupted,
    which a re-run runs again); None otherwise."""
    try:
        row = yaml.safe_load((run_dir / "result.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(row, dict) or row.get("status") in RUN_AGAIN:
        return None
    return row


class _Signals:
    """SIGINT and SIGTERM while the study runs: remembered, and forwarded to every trainer
    under way (each in its own process group, so the terminal's Ctrl-C reaches only the study).
    Installed only in the main thread; elsewhere the trainers share the study's group."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.installed = threading.current_thread() is threading.main_thread()
        self._procs: dict[int, subprocess.Popen] = {}
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if self.installed:
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            sys.stderr.write(
                f"{signal.Signals(signum).name}: stopping the study: no new run starts, the runs "
                "under way stop after their step with a checkpoint (a re-run continues them); "
                "send it again to stop them at once\n"
            )
            sys.stderr.flush()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            with contextlib.suppress(OSError):  # (ProcessLookupError: it has just ended)
                proc.send_signal(signum)

    def popen(self, cmd: list[str], **kw: Any) -> subprocess.Popen | None:
        """Start a trainer (None once a signal came: no run starts after it)."""
        with self._lock:
            if self.signum is not None:
                return None
            if self.installed:  # their own process group: the terminal's Ctrl-C is ours
                kw.update(
                    {"process_group": 0}
                    if sys.version_info >= (3, 11)
                    else {"start_new_session": True}
                )
            proc = subprocess.Popen(cmd, **kw)
            self._procs[proc.pid] = proc
            return proc

    def done(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._procs.pop(proc.pid, None)


def changed_runs(runs: list[Run], out: Path) -> list[str]:
    """A line per finished run in ``out`` whose saved config is not the one it would run now.

    Re-running a study directory reuses its finished runs; this catches a re-run with other
    settings (steps, base keys, ...), which would otherwise report old runs under new labels.
    """
    lines = []
    for run in runs:
        run_dir = out / "runs" / run.name
        saved_path = run_dir / "config.yaml"
        if finished_row(run_dir) is None or not saved_path.exists():
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
    the study re-run over it changes, outside :data:`STUDY_SCHEDULING_KEYS`.

    A study may grow: ``seeds``, ``betas`` and ``choices`` (:data:`GRID_KEYS`) may change when
    every run of the saved grid is still in the new one (more seeds, another beta, one more
    choice); the finished runs are then reused, each checked by :func:`changed_runs`."""
    path = out / "study.yaml"
    try:
        saved_study = StudyConfig.model_validate(yaml.safe_load(path.read_text(encoding="utf-8")))
        saved = saved_study.model_dump(mode="json")
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ValueError) as err:
        return [f"its study.yaml cannot be read ({str(err).splitlines()[0]})"]
    now = study.model_dump(mode="json")
    changed = [
        k
        for k in sorted(set(saved) | set(now))
        if k not in STUDY_SCHEDULING_KEYS and saved.get(k) != now.get(k)
    ]
    if changed and set(changed) <= GRID_KEYS:
        other = saved_study.model_copy(update={k: getattr(study, k) for k in STUDY_SCHEDULING_KEYS})
        if {r.name for r in _grid(other)} <= {r.name for r in _grid(study)}:
            return []  # the grid grew: every saved run is still in it
    return [f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed]


def _grid(study: StudyConfig) -> list[Run]:
    """:func:`study_grid` without resolving the model (the names are what is compared)."""
    return study_grid(study.model_copy(update={"model": None}))


def _refuse_other_study(out: Path, what: str, changed: list[str]) -> None:
    shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more" if len(changed) > 3 else "")
    raise ConfigError(
        f"--out {out} holds {what} ({shown}). They would be reported under the new settings, "
        "or replaced; re-run with the settings in its study.yaml to finish it, or choose another "
        f"--out, e.g. {fresh_name(out)}"
    )


def _prepare(run_dir: Path) -> bool:
    """Make ``run_dir`` ready for its trainer, under the run's lock (:class:`DirBusy` if a
    trainer, of this study or an earlier one, still writes it: then nothing is touched). A run
    with a complete checkpoint is continued (True); anything else there is cleared (False)."""
    if not run_dir.exists():
        return False
    with DirLock(run_dir, "klpo compare", option="the study's run directory"):
        (run_dir / "result.yaml").unlink(missing_ok=True)
        if (run_dir / "config.yaml").is_file() and latest_checkpoint(run_dir) is not None:
            return True
        for entry in run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return False


def _execute(
    run: Run,
    out: Path,
    study: StudyConfig,
    on_start: Callable[[str, Path], None] | None = None,
    signals: _Signals | None = None,
) -> dict[str, Any] | None:
    """The run's row: read back if it finished before, else from its trainer; None if a signal
    came before it started."""
    run_dir = out / "runs" / run.name
    done_marker = run_dir / "result.yaml"
    row = finished_row(run_dir)
    if row is not None:  # finished in an earlier invocation of the same study
        return row
    signals = signals or _Signals()
    if signals.signum is not None:
        return None
    resume = _prepare(run_dir)  # continued from its checkpoint, or started again
    log_path = out / "logs" / f"{run.name}.txt"  # beside the run: klpo train wants it empty
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "klpo", "train"]
    cmd += ["--resume", str(run_dir)] if resume else []
    cmd += ["--set", f"run.out_dir={run_dir}", "--set", f"run.eval_cache={out / EVAL_CACHE}"]
    for o in run.overrides:
        cmd += ["--set", o]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        PARENT_ENV: str(os.getpid()),  # a trainer stops when the study is gone (kill -9)
    }
    t0 = time.perf_counter()
    with log_path.open("a" if resume else "w") as log:
        if resume:
            log.write(f"\n# continued from its last checkpoint: klpo train --resume {run_dir}\n")
            log.flush()
        proc = signals.popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        if proc is None:
            return None
        if on_start is not None:
            on_start(run.name, log_path)
        try:
            returncode = proc.wait()
        finally:
            signals.done(proc)
    wall = time.perf_counter() - t0
    error = ""
    if returncode != 0:
        lines = log_path.read_text().strip().splitlines()
        error = (lines[-1] if lines else f"exit code {returncode}")[:300]
    metric, target = study.convergence_target()
    criteria = Criteria(
        steps=study.steps,
        collapse_drop=study.collapse_drop,
        eval_size=study.eval_size,
        target_accuracy=target,
        target_metric=metric,
    )
    row = summarise_run(run, run_dir, criteria, returncode=returncode, wall_s=wall, error=error)
    if returncode in INTERRUPTED_CODES or (returncode != 0 and signals.signum is not None):
        row["status"] = "interrupted"  # not a result: a re-run continues it
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
        _check_run_locks(runs, out)
        return _run_all(study, runs, configs, out, on_result, on_start, show_progress)


def report_only(study: StudyConfig, out: str | Path) -> Path:
    """Rewrite the report of the study in ``out`` without starting a run (``klpo compare
    --report-only``): ``results.csv``, ``report.md`` and the plots from the finished runs in
    ``out/runs`` (each checked, as a re-run checks it, against the config it would run with);
    or, for an archive that keeps only ``results.csv`` (its runs not kept), the report's
    sections computed from those rows (:func:`~klpo.study.report.refresh_sections`), the rest
    of ``report.md`` and the plots untouched. Refused, naming the runs, when a run of the grid
    is in neither; the study's settings must be those in ``out/study.yaml`` but for
    :data:`STUDY_SCHEDULING_KEYS` (its comparisons, ``added_after``, ``alpha``, ...), which
    are written there."""
    out = Path(out)
    if not (out / "study.yaml").is_file():
        raise ConfigError(f"--report-only: {out} holds no study (no study.yaml); run it first")
    if changed := study_changes(study, out):
        _refuse_other_study(out, "a study with other settings", changed)
    names = [r.name for r in _grid(study)]
    finished = {n: finished_row(out / "runs" / n) for n in names}
    with DirLock(out, "klpo compare", option="--out"):
        if all(row is not None for row in finished.values()):
            runs = study_grid(study)
            if changed := changed_runs(runs, out):
                _refuse_other_study(out, "finished runs of a study with other settings", changed)
            _record_spec(study, out)
            return write_results([finished[n] for n in names], out, study)
        kept = _csv_rows(out / "results.csv")
        rows = {n: finished[n] or kept.get(n) for n in names}
        missing = [n for n in names if rows[n] is None]
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ConfigError(
                f"--report-only starts no run, and {len(missing)} runs of the grid have neither "
                f"finished in {out / 'runs'} nor a row in its results.csv ({shown}); run "
                "klpo compare without --report-only to run them"
            )
        _record_spec(study, out)
        return refresh_sections([rows[n] for n in names], out, study)


def _record_spec(study: StudyConfig, out: Path) -> None:
    """Write ``study`` as ``out/study.yaml`` when its analysis keys (comparisons,
    ``added_after``, ...) differ from the saved ones; an archive whose spec is unchanged keeps
    its file byte for byte."""
    saved = yaml.safe_load((out / "study.yaml").read_text(encoding="utf-8")) or {}
    now = study.model_dump(mode="json")
    defaults = StudyConfig.model_construct().model_dump(mode="json")
    keys = STUDY_SCHEDULING_KEYS - {"workers"}
    if any(saved.get(k, defaults.get(k)) != now[k] for k in keys):
        write_text_atomic(out / "study.yaml", yaml.safe_dump(study.model_dump(), sort_keys=False))


def _csv_rows(path: Path) -> dict[str, dict[str, Any]]:
    """``results.csv``'s rows by run name (none when there is no such file)."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8", newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def _check_run_locks(runs: list[Run], out: Path) -> None:
    """Refuse, before any run starts, a run directory that a live process still writes (a
    trainer an earlier study left running): it is neither cleared nor written beside."""
    for run in runs:
        run_dir = out / "runs" / run.name
        if not (run_dir / LOCK_FILE).exists() or finished_row(run_dir) is not None:
            continue
        try:
            with DirLock(run_dir, "klpo compare", option="the study's run directory"):
                pass
        except DirBusy as err:
            raise ConfigError(
                f"{err}. It is a trainer of an earlier klpo compare of {out}, still running; "
                "let it end, or stop it (kill the pid), then re-run the study"
            ) from None


def runs_left_s(walls: list[float], left: int, workers: int) -> float | None:
    """Seconds the ``left`` runs not yet finished take at the mean wall time of the finished
    ones (``walls``, each a whole run: its start-up, model load and step-0 evaluation included,
    which a count of steps leaves out), ``workers`` at a time; None before any has finished."""
    done = [w for w in walls if w == w and w > 0]  # finished and timed (not NaN)
    if not done or left <= 0:
        return None
    return sum(done) / len(done) * math.ceil(left / max(1, workers))


def seed_major(runs: list[Run], seeds: list[int]) -> list[int]:
    """The order runs start in: the first seed of every cell, then the second, ...; so a study
    stopped part-way (a budget, a signal) has every cell at the same number of seeds, the unit
    its comparisons are decided by (:mod:`klpo.study.seeds`). Indices into ``runs``.

    >>> from types import SimpleNamespace as R
    >>> seed_major([R(seed=0), R(seed=1), R(seed=0), R(seed=1)], [0, 1])
    [0, 2, 1, 3]
    """
    return sorted(range(len(runs)), key=lambda i: (seeds.index(runs[i].seed), i))


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
    finished = sum(finished_row(out / "runs" / r.name) is not None for r in runs)
    units = len(runs) * study.steps
    with (
        _Signals() as signals,
        Progress("compare", units, done=finished * study.steps, show=show_progress) as bar,
        ThreadPoolExecutor(max_workers=study.workers) as pool,
    ):
        futures = {
            pool.submit(_execute, runs[i], out, study, on_start, signals): i
            for i in seed_major(runs, study.seeds)
        }
        pending, n = set(futures), 0
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for fut in done:
                if fut.cancelled():
                    continue
                i = futures[fut]
                rows[i] = _result(fut, runs[i])
                if rows[i] is None:  # not started: a signal came first
                    continue
                n += 1
                if on_result is not None:
                    on_result(rows[i], n, len(runs))
            if signals.signum is not None:
                for fut in pending:
                    fut.cancel()  # those not yet started; the others end after their step
            steps = sum(
                study.steps
                if rows[i] is not None and rows[i]["status"] != "interrupted"
                else last_step(out / "runs" / r.name)
                for i, r in enumerate(runs)
            )
            walls = [num(r.get("wall_s")) for r in rows if r is not None]
            left = runs_left_s(walls, len(runs) - n, study.workers)
            by_runs = f", about {fmt_duration(left)} left by the runs' own times" if left else ""
            bar.update(steps, info=f"{n}/{len(runs)} runs finished{by_runs}")
    results = [r for r in rows if r is not None and r["status"] != "interrupted"]
    unfinished = [r.name for r, row in zip(runs, rows, strict=True) if row not in results]
    if results:
        write_results(results, out, study, unfinished=unfinished)
    if signals.signum is not None:
        raise StudyInterrupted(signals.signum, [r["name"] for r in results], unfinished)
    return results
