"""run.report_to through W&B and MLflow themselves, offline (WANDB_MODE=offline, an MLflow
file store): each holds every step's scalars as TensorBoard's event files hold them. Peer tests:
they run where the extras klpo[wandb] and klpo[mlflow] are installed, and skip elsewhere."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.trackers import mlflow_key

pytestmark = pytest.mark.peer


def _tensorboard_scalars(path: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def _wandb_history(run_file: Path) -> dict[int, dict[str, object]]:
    """The history rows of an offline run's ``.wandb`` file: a LevelDB-style log (a 7-byte
    header, then 32 KiB blocks of chunks: crc32 (4 bytes), length (2), type (1: whole,
    2/3/4: first/middle/last)) of protobuf records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos = run_file.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    records, chunks = [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunks.append(data[pos + 7 : pos + 7 + n])
        pos += 7 + n
        if kind in (1, 4):
            records.append(b"".join(chunks))
            chunks = []
    out: dict[int, dict[str, object]] = {}
    for raw in records:
        r = pb.Record()
        r.ParseFromString(raw)
        if r.WhichOneof("record_type") == "history":
            row = out.setdefault(r.history.step.num, {})
            for item in r.history.item:
                row[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def test_wandb_and_mlflow_hold_what_tensorboard_holds(tiny_model, quick, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny has no database store
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "klpo-tests")
    out = tmp_path / "run"
    cfg = build_config(
        overrides=quick(
            tiny_model, out,
            **{"run.report_to": "[tensorboard, wandb, mlflow]", "run.tensorboard": True,
               "run.log_samples_every": 1, "run.run_name": "peer"},
        )
    )  # fmt: skip
    loop.train(cfg, log=lambda *_: None)
    board = _tensorboard_scalars(out / "tensorboard")
    assert sorted(board) == [0, 1, 2, 3] and len(board[1]) > 10

    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = _wandb_history(run_file)
    for step, values in board.items():
        got = {k: history[step][k] for k in values}
        assert got == pytest.approx(values, rel=1e-6), step
    assert history[1]["samples/train/_type"] == "table-file"
    assert history[1]["samples/train/nrows"] == cfg.run.log_samples

    ids = json.loads((out / "trackers.json").read_text())
    client = MlflowClient()
    run = client.get_run(ids["mlflow"])
    assert run.info.run_name == "peer" and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.01"
    for key in board[1]:
        history = {
            m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_key(key))
        }
        want = {s: v[key] for s, v in board.items() if key in v}
        assert history == pytest.approx(want, rel=1e-6), key
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert "samples/train-000001.md" in artifacts
