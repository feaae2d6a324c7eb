"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each through its own library.

``run.report_to`` lists where a run's metrics go besides ``metrics.jsonl`` (which is always
written): every step's scalars under the keys of :data:`klpo.train.runtime.metrics.METRICS`, the
resolved config as the run's parameters, and the logged completions (``samples.jsonl``) as a text
panel or table. :data:`TRACKERS` is the one table of them; each row opens a :class:`Tracker`.

- ``tensorboard``: event files in ``RUN/tensorboard`` (``torch.utils.tensorboard``); the
  completions as a Markdown table under ``samples/train`` and ``samples/eval`` (the Text tab).
- ``wandb`` (extra ``klpo[wandb]``): ``wandb.init`` with the project of ``WANDB_PROJECT``
  (default ``klpo``), the run's name, files under ``RUN/wandb``; every library setting comes
  from its own variables (``WANDB_MODE=offline``, ``WANDB_ENTITY``, ...). The completions are a
  ``wandb.Table`` per split.
- ``mlflow`` (extra ``klpo[mlflow]``): a run in the experiment of ``MLFLOW_EXPERIMENT_NAME``
  (default ``klpo``) at the tracking store of ``MLFLOW_TRACKING_URI`` (MLflow's default when
  unset; a file store is ``file:DIR``). A metric key keeps its name where MLflow allows it
  (letters, digits, ``_ - . / :`` and spaces); any other character becomes ``_``
  (``kl/ref/k3+`` is ``kl/ref/k3_``, :func:`mlflow_key`). The completions are a Markdown
  artifact ``samples/<split>-<step>.md``.

A resumed run continues the same W&B and MLflow runs: their ids are kept in ``RUN/trackers.json``.
W&B keeps the steps it already has, so after a resume from an earlier checkpoint the steps
between it and the stop are not logged to W&B a second time (``metrics.jsonl`` and TensorBoard
are rewritten from the checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from klpo._io import write_text_atomic

__all__ = [
    "TRACKERS",
    "Tracker",
    "TrackerSpec",
    "check_trackers",
    "mlflow_key",
    "open_trackers",
]

IDS_FILE = "trackers.json"


class Tracker(Protocol):
    """Where a run's metrics go besides ``metrics.jsonl``."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One step's finite scalar metrics."""

    def samples(self, step: int, split: str, records: list[dict[str, Any]], table: str) -> None:
        """Logged completions (``samples.jsonl`` records) and their Markdown table."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a tracker is opened with."""

    dir: Path
    name: str
    config: dict[str, Any]  # the resolved config, flat (``section.key``)
    resume_step: int  # 0 for a fresh run


def _quiet_tensorboard_thread() -> None:
    """TensorBoard writes from a thread of its own; when a write fails (a full disk) the thread
    stores the error, which the next ``add_scalar`` or ``flush`` raises in the run's thread
    (where the trainer reports it), and also lets it escape, so that Python prints the thread's
    traceback. Keep that second copy quiet: the error is said once, where it is handled."""
    import threading

    from tensorboard.summary.writer import event_file_writer as efw

    previous = threading.excepthook
    if getattr(previous, "_klpo_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.thread, efw._AsyncWriterThread) and args.thread.exception is not None:
            return
        previous(args)

    hook._klpo_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class _TensorBoard:
    def __init__(self, info: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_tensorboard_thread()
        purge = info.resume_step + 1 if info.resume_step else None
        self._w = SummaryWriter(str(info.dir / "tensorboard"), purge_step=purge)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)

    def samples(self, step: int, split: str, records: list[dict[str, Any]], table: str) -> None:
        self._w.add_text(f"samples/{split}", table, step)

    def close(self) -> None:
        self._w.flush()
        self._w.close()


class _WandB:
    def __init__(self, info: RunInfo):
        import wandb

        self._wandb = wandb
        ids = _read_ids(info.dir)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "klpo"),
            name=info.name,
            dir=str(info.dir),
            config=info.config,
            id=ids.get("wandb"),
            resume="allow",
        )
        _write_id(info.dir, "wandb", self._run.id)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def samples(self, step: int, split: str, records: list[dict[str, Any]], table: str) -> None:
        columns = list(dict.fromkeys(k for r in records for k in r))
        rows = [[_cell(r.get(c)) for c in columns] for r in records]
        self._run.log(
            {f"samples/{split}": self._wandb.Table(columns=columns, data=rows)}, step=step
        )

    def close(self) -> None:
        self._run.finish()


class _MLflow:
    def __init__(self, info: RunInfo):
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "klpo")
        experiment = client.get_experiment_by_name(name)
        exp_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_id = _read_ids(info.dir).get("mlflow")
        if run_id is None:
            run_id = client.create_run(exp_id, run_name=info.name).info.run_id
            params = {k: str(v)[:500] for k, v in info.config.items()}
            for chunk in _chunks(sorted(params.items()), 100):
                from mlflow.entities import Param

                client.log_batch(run_id, params=[Param(k, v) for k, v in chunk])
        else:
            client.update_run(run_id, status="RUNNING")
        _write_id(info.dir, "mlflow", run_id)
        self._run_id = run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), float(v), now, step) for k, v in values.items()]
        for chunk in _chunks(metrics, 1000):
            self._client.log_batch(self._run_id, metrics=chunk)

    def samples(self, step: int, split: str, records: list[dict[str, Any]], table: str) -> None:
        self._client.log_text(self._run_id, table, f"samples/{split}-{step:06d}.md")

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


@dataclass(frozen=True)
class TrackerSpec:
    """One tracker: how it opens, and the package and extra it needs (None: always there)."""

    open: Callable[[RunInfo], Tracker]
    module: str | None = None
    extra: str | None = None


TRACKERS: dict[str, TrackerSpec] = {
    "tensorboard": TrackerSpec(_TensorBoard),
    "wandb": TrackerSpec(_WandB, module="wandb", extra="wandb"),
    "mlflow": TrackerSpec(_MLflow, module="mlflow", extra="mlflow"),
}
"""``run.report_to``'s names -> how each tracker opens and what it needs."""


def check_trackers(names: Sequence[str]) -> None:
    """Raise ImportError naming the extra to install for a tracker whose library is absent."""
    for name in names:
        spec = TRACKERS[name]
        if spec.module is not None and importlib.util.find_spec(spec.module) is None:
            raise ImportError(
                f"run.report_to lists {name!r}, but the {spec.module} package is not installed; "
                f"install the extra into klpo's environment, from the klpo checkout: "
                f"pip install -e '.[{spec.extra}]' (or drop {name!r} from run.report_to)"
            )


def open_trackers(
    names: Sequence[str],
    run_dir: Path,
    *,
    name: str,
    config: dict[str, Any],
    resume_step: int = 0,
) -> list[Tracker]:
    """The trackers of ``run.report_to``, opened for the run in ``run_dir``."""
    check_trackers(names)
    info = RunInfo(Path(run_dir), name, config, resume_step)
    return [TRACKERS[n].open(info) for n in dict.fromkeys(names)]


_MLFLOW_BAD = re.compile(r"[^\w\-./: ]")


def mlflow_key(key: str) -> str:
    """A metric key as MLflow stores it: characters it refuses become ``_``."""
    return _MLFLOW_BAD.sub("_", key)


def finite_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The values a tracker plots: finite ints and floats (bools excluded)."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _cell(v: Any) -> Any:
    return v if isinstance(v, str | int | float | bool) or v is None else json.dumps(v)


def _chunks(items: list, n: int) -> list[list]:
    return [items[i : i + n] for i in range(0, len(items), n)]


def _read_ids(run_dir: Path) -> dict[str, str]:
    path = Path(run_dir) / IDS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_id(run_dir: Path, tracker: str, run_id: str) -> None:
    ids = _read_ids(run_dir)
    if ids.get(tracker) != run_id:
        ids[tracker] = run_id
        write_text_atomic(Path(run_dir) / IDS_FILE, json.dumps(ids, indent=1) + "\n")
