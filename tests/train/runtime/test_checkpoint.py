"""Checkpoints: atomic, complete, and restoring every piece of state exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from klpo.train.runtime import checkpoint as ck
from klpo.train.runtime.metrics import METRICS, MetricsWriter, describe, read_metrics


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def trained(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return opt


def test_save_and_restore_everything(tmp_path):
    model = tiny_model()
    opt = trained(model)
    torch.manual_seed(123)
    path = ck.save_checkpoint(
        tmp_path, 7, ck.Weights(model), optimizers={"policy": opt}, state={"data": {"epoch": 1}}
    )
    expected_draw = torch.rand(3)
    assert path.name == "step_000007"
    assert ck.latest_checkpoint(tmp_path) == path
    meta = ck.load_state(path)
    assert meta["step"] == 7 and meta["data"] == {"epoch": 1}

    restored = LlamaForCausalLM.from_pretrained(path / "policy")
    for (n, a), (_, b) in zip(
        model.state_dict().items(), restored.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n
    opt2 = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    ck.restore_optimizers(path, {"policy": opt2}, meta)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for idx in s1["state"]:
        for k, v in s1["state"][idx].items():
            assert torch.equal(v, s2["state"][idx][k])
    assert s1["param_groups"][0]["lr"] == s2["param_groups"][0]["lr"]
    torch.manual_seed(999)
    ck.restore_rng(path, meta)
    assert torch.equal(torch.rand(3), expected_draw)


def test_atomic_and_keeps_the_last_two(tmp_path):
    model = tiny_model()
    opt = trained(model)
    for step in (1, 2, 3):
        ck.save_checkpoint(tmp_path, step, ck.Weights(model), optimizers={"policy": opt})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step_000002", "step_000003"]
    # A save killed midway leaves a temporary directory, never a half checkpoint or pointer.
    (tmp_path / "checkpoints" / ".tmp-step_000004-999").mkdir()
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    # A stale pointer is only a hint: the newest complete checkpoint is found all the same.
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"
    assert ck.remove_orphans(tmp_path) == [tmp_path / "checkpoints" / ".tmp-step_000004-999"]
    assert not (tmp_path / "checkpoints" / ".tmp-step_000004-999").exists()
    assert ck.latest_checkpoint(tmp_path / "nothing") is None


def test_a_save_that_fails_midway_changes_nothing(tmp_path, monkeypatch):
    """Disk full while writing the optimizer state: the previous checkpoint and ``latest`` stay,
    and no temporary directory is left behind (klpo._io.atomic_dir)."""
    model = tiny_model()
    opt = trained(model)
    ck.save_checkpoint(tmp_path, 1, ck.Weights(model), optimizers={"policy": opt})
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    real = ck.save_file

    def full_disk(tensors, path, *args, **kwargs):
        if path.endswith("optim.safetensors"):
            real(tensors, path, *args, **kwargs)  # half written, then the error
            raise OSError(28, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(ck, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        ck.save_checkpoint(tmp_path, 2, ck.Weights(model), optimizers={"policy": opt})
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert ck.latest_checkpoint(tmp_path).name == "step_000001"


def test_rng_of_another_world_size_is_refused(tmp_path):
    path = ck.save_checkpoint(tmp_path, 1, ck.Weights(tiny_model()), optimizers={})
    with pytest.raises(ValueError, match="same number of processes"):
        ck.restore_rng(path, ck.load_state(path), rank=1)


def test_metrics_writer_truncates_on_resume(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        w.write(step, {"reward/mean": step / 10, "kl/ref/k3": 0.1})
    w.close()
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # a torn line from a killed run
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    w = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    w.write(3, {"reward/mean": 0.9})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    with pytest.raises(KeyError, match="undocumented metric"):
        w.write(4, {"made/up": 1.0})


def test_every_metric_family_is_documented():
    assert describe("kl/ref/k3_is") == METRICS["kl/ref/<est>"]
    assert describe("reward/exact_match") == METRICS["reward/<name>"]
    assert describe("time/update")


def test_tensorboard_events_are_written(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True)
    w.write(1, {"reward/mean": 0.5, "accuracy/heldout": float("nan")})
    w.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["accuracy/heldout"] == "nan"
