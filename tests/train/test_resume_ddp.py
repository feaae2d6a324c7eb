"""A run killed mid-step resumes to the same metrics; torchrun runs data-parallel, same gradient
and metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from klpo.train.runtime.metrics import is_timing, read_metrics

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def klpo_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "klpo", *args]


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing(k)} for r in rows]


@pytest.mark.slow
def test_resume_after_kill_equals_the_uninterrupted_run(tiny_model, quick, tmp_path):
    extra = {
        "run.steps": 6,
        "run.save_every": 2,
        "rewards": "[{name: 'klpo_test_rewards:slow_digits'}]",
    }
    # Both runs are the same command in a fresh process, so that nothing this test process did
    # before (threads, plans, global torch state) can tell them apart but the kill and resume.
    whole = tmp_path / "whole"
    subprocess.run(
        klpo_cmd("train", *sets(quick(tiny_model, whole, **extra))),
        env=env(),
        check=True,
        capture_output=True,
    )

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        klpo_cmd("train", *sets(quick(tiny_model, killed, **extra))),
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    latest = killed / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text().strip() == "step_000004":
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # somewhere inside step 5
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert max(r["step"] for r in read_metrics(killed / "metrics.jsonl")) <= 5

    done = subprocess.run(
        klpo_cmd("train", "--resume", str(killed)), env=env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stderr and "from step 4" in done.stderr
    a = comparable(read_metrics(whole / "metrics.jsonl"))
    b = comparable(read_metrics(killed / "metrics.jsonl"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4, 5, 6]
    assert a == b


@pytest.mark.slow
def test_torchrun_two_processes_give_the_one_process_gradient(tiny_model, tmp_path):
    script = str(HERE / "ddp_update_script.py")
    outs = {}
    for n in (1, 2):
        outs[n] = tmp_path / f"world{n}.safetensors"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}", script, str(tiny_model), str(outs[n]),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = load_file(str(outs[1])), load_file(str(outs[2]))
    before = load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(one[k], before[k]) for k in before)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6, msg=k)
    # ... and the same metrics (sums over micro-batches and ranks, not means of means).
    m1, m2 = (json.loads(outs[n].with_suffix(".json").read_text()) for n in (1, 2))
    assert set(m1) == set(m2) and m1["loss/kl"] > 0
    for k, v in m1.items():
        assert m2[k] == pytest.approx(v, rel=2e-5, abs=1e-6), k


@pytest.mark.slow
def test_torchrun_klpo_train(tiny_model, quick, tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "klpo", "train", *sets(quick(tiny_model, out, **{"run.steps": 2})),
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert (out / "checkpoints" / "step_000002" / "policy" / "model.safetensors").is_file()
