"""The resume plan: where a run starts, and what it must say or record before it does.

:func:`plan_run_dir` decides it before any model loads (:func:`klpo.train.preflight.preflight`
calls it): a fresh run only into a new or empty directory (the rule of output directories,
:mod:`klpo.train.outdir`), or in place of a run that never got going (:func:`unstarted_run`); a
resume from the newest complete checkpoint (truncated later ones skipped, and said so), with the
config equal to the saved one outside :data:`RESUMABLE_KEYS` (:func:`config_diff`) and the same
number of processes, unless the change is allowed and recorded (:func:`record_config_change`,
``config-changes.jsonl``). A restarted run's earlier metrics are moved aside, never deleted
(:func:`keep_old_metrics`). The result is a :class:`RunPlan`, which setup follows
(:func:`klpo.train.setup.hold_run_dir`, :func:`klpo.train.setup.restore`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import ConfigError, TrainConfig, build_config, flat
from klpo.train.outdir import claim_dir
from klpo.train.runtime import checkpoint as ckpt_io

__all__ = [
    "CHANGES_FILE",
    "RESUMABLE_KEYS",
    "RunPlan",
    "config_diff",
    "has_metrics",
    "keep_old_metrics",
    "plan_run_dir",
    "record_config_change",
    "unstarted_run",
]

# Keys a resume may change without --allow-config-change: they decide how long the run goes on,
# how it is shown and where, not what any step computes.
RESUMABLE_KEYS = frozenset(
    {
        "run.steps",
        "run.time_limit",
        "run.progress",
        "run.threads",
        "run.save_every",
        "run.tensorboard",
        "run.out_dir",
        "run.eval_cache",
        "run.report_to",
        "run.run_name",
        "run.log_samples",
        "run.log_samples_every",
        "run.save_total_limit",
    }
)
CHANGES_FILE = "config-changes.jsonl"


@dataclass
class RunPlan:
    """What :func:`plan_run_dir` found: where a run starts and what it must say or record."""

    start: Path | None = None  # the checkpoint to resume from, if any
    meta: dict[str, Any] = field(default_factory=dict)  # its state.json
    notes: list[str] = field(default_factory=list)  # lines for the user
    changes: dict[str, list[Any]] = field(default_factory=dict)  # key -> [saved, now]
    saved_world: int | None = None  # processes that wrote the checkpoint
    restart: bool = False  # --resume of a run that never reached a checkpoint
    replace: list[str] = field(default_factory=list)  # a fresh run's: the unstarted run's files


# What a run writes before its first checkpoint (config, metrics, samples, TensorBoard events,
# report and plots): a directory holding only these, with no checkpoint and no trained step, holds
# a run that never got going, which the same command replaces (see :func:`unstarted_run`).
_UNSTARTED_FILES = frozenset(
    {"config.yaml", "metrics.jsonl", "samples.jsonl", "tensorboard", "checkpoints", "report.md"}
)


def unstarted_run(run_dir: Path) -> list[str] | None:
    """The files of the run in ``run_dir`` when it never reached a checkpoint nor finished a
    step (a reward that raised at step 1, a model that failed to load): nothing there can be
    resumed, and nothing in it is the user's. None for anything else (a checkpoint, a trained
    step in ``metrics.jsonl``, a file a run would not write), which stays refused."""
    names = sorted(p.name for p in run_dir.iterdir() if p.name != ".klpo.lock")
    if "config.yaml" not in names or not all(
        n in _UNSTARTED_FILES or n.endswith(".png") for n in names
    ):
        return None
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and any(p.name.startswith("step_") for p in ckpts.iterdir()):
        return None
    try:
        text = (
            (run_dir / "metrics.jsonl").read_text(encoding="utf-8")
            if "metrics.jsonl" in names
            else ""
        )
        if any(json.loads(line).get("step", 0) > 0 for line in text.splitlines() if line.strip()):
            return None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None
    return names


def has_metrics(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.is_file() and path.stat().st_size > 0


def config_diff(saved: TrainConfig, now: TrainConfig) -> dict[str, list[Any]]:
    """``{key: [saved, now]}`` for every key that differs, outside :data:`RESUMABLE_KEYS`."""
    a, b = flat(saved), flat(now)
    return {
        k: [a.get(k), b.get(k)]
        for k in sorted(set(a) | set(b))
        if k not in RESUMABLE_KEYS and a.get(k) != b.get(k)
    }


def _saved_config(run_dir: Path) -> TrainConfig:
    path = run_dir / "config.yaml"
    try:
        return build_config(yaml.safe_load(path.read_text(encoding="utf-8")) or {})
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError) as err:
        raise ConfigError(
            f"--resume {run_dir}: its config.yaml cannot be read ({str(err).splitlines()[0]}); "
            "restore it, or start a new run in another run.out_dir"
        ) from None


def plan_run_dir(
    cfg: TrainConfig, *, resume: bool, world: int, allow_config_change: bool = False
) -> RunPlan:
    """Decide where the run starts, refusing anything that would lose or misfile work.

    A fresh run never replaces a directory that holds metrics or checkpoints. A resume starts
    from the newest complete checkpoint (truncated later ones are skipped, and said so), or from
    step 0 if the run never reached one; its config must equal the saved one outside
    :data:`RESUMABLE_KEYS`, and its number of processes that of the checkpoint, unless
    ``allow_config_change`` is set (the change is then recorded in the run directory).
    """
    run_dir = Path(cfg.run.out_dir)
    plan = RunPlan()
    # A run that never got going (no checkpoint, no trained step) is replaced by a fresh one.
    if not resume and run_dir.is_dir() and (files := unstarted_run(run_dir)):
        plan.replace = files
        plan.notes.append(
            f"{run_dir} holds a run that stopped before its first step ({', '.join(files)}): "
            "this run replaces it (nothing there could be resumed)"
        )
        return plan
    # New or empty for a fresh run, a run for --resume, nothing else (klpo.train.outdir).
    state = claim_dir(run_dir, "train", proceed=resume)
    if not resume:
        return plan
    if state == "new":
        raise ConfigError(
            f"--resume {run_dir}: no run there to continue (the directory is empty or missing); "
            f"start one with klpo train --set run.out_dir={run_dir}"
        )

    saved = _saved_config(run_dir)
    plan.changes = config_diff(saved, cfg)
    plan.start, plan.notes = ckpt_io.find_checkpoint(run_dir)
    if plan.start is None:
        plan.restart = True
        plan.notes.append(
            f"{run_dir} has no complete checkpoint: the run starts again from step 0"
            + (" (its earlier metrics are kept, see below)" if has_metrics(run_dir) else "")
        )
    else:
        plan.meta = ckpt_io.load_state(plan.start)
        _check_resume_step(cfg, run_dir, plan)
        plan.saved_world = len(plan.meta["rng"])
        if plan.saved_world != world:
            plan.changes["processes"] = [plan.saved_world, world]
        critic = ALGORITHMS[cfg.algo.name].critic
        if critic and not ALGORITHMS[saved.algo.name].critic and allow_config_change:
            plan.notes.append(
                "the checkpoint has no critic (it was a run of "
                f"{saved.algo.name}): {cfg.algo.name.upper()}'s critic starts from "
                "model.critic, untrained"
            )
    if plan.changes and not allow_config_change:
        lines = "; ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in plan.changes.items())
        raise ConfigError(
            f"--resume {run_dir}: the config differs from the run's saved config.yaml ({lines}). "
            "A resumed run continues the same experiment; drop the changed --set/--config, start "
            "a new run in another run.out_dir, or pass --allow-config-change to continue with "
            f"the change recorded in {run_dir / CHANGES_FILE}"
        )
    return plan


def _check_resume_step(cfg: TrainConfig, run_dir: Path, plan: RunPlan) -> None:
    """A resume goes on from its checkpoint's step: refuse a ``run.steps`` behind it (nothing
    would train, and config.yaml would say a length the run is not), and say when the metrics
    of the steps before it are gone."""
    step = int(plan.meta.get("step", 0))
    if cfg.run.steps < step:
        raise ConfigError(
            f"--resume {run_dir}: run.steps={cfg.run.steps} is behind its checkpoint, which is "
            f"at step {step} ({plan.start.name}); a resume continues to a later step. Give "
            f"run.steps above {step} (or drop the --set to keep {step}), or start a new run in "
            "another run.out_dir"
        )
    if not has_metrics(run_dir):
        plan.notes.append(
            f"{run_dir / 'metrics.jsonl'} is missing or empty: the metrics of steps 1–{step} "
            f"are lost; the run continues from step {step} and the file will hold steps "
            f"{step + 1}–{cfg.run.steps} only"
        )


def record_config_change(run_dir: Path, step: int, changes: dict[str, list[Any]]) -> None:
    """Append ``{"step", "changes"}`` to the run's ``config-changes.jsonl``."""
    line = json.dumps({"step": step, "changes": changes}) + "\n"
    with (run_dir / CHANGES_FILE).open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def keep_old_metrics(run_dir: Path) -> Path | None:
    """Move a restarted run's ``metrics.jsonl`` aside (never deleted); returns where to."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    n = 1
    while (dest := run_dir / f"metrics.before-restart-{n}.jsonl").exists():
        n += 1
    os.replace(path, dest)
    return dest
