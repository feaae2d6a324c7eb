"""A run killed mid-step resumes to the same metrics; torchrun runs data-parallel, same gradient
and metrics."""

from __future__ import annotations

import json
import math
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

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
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


def torchrun(n: int, *args: str) -> str:
    """Run ``args`` under torchrun with ``n`` ranks; their stdout and stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    done = subprocess.run([*cmd, *args], env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_the_sampler_metrics_and_m2pos_mask_pool_over_three_ranks(tmp_path):
    """Over a real gloo group of three ranks (one without a token), every sampler/* metric is
    the one-process value of the whole batch to float64 rounding, the same bits on every rank,
    and each rank's M2PO mask is its rows' of the whole batch's (which a mask of the rank's own
    tokens is not)."""
    torchrun(3, str(HERE / "ddp_pool_script.py"), str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    want = ranks[0]["want"]
    assert len(want) == 15 and 0 < want["sampler/masked_frac"] < 1
    for got in ranks:
        assert got["pooled"] == ranks[0]["pooled"]
        assert list(got["pooled"]) == list(want)
        for key, value in want.items():
            assert got["pooled"][key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        assert got["mask_is_the_whole_batchs"] and got["dropped_some"]
        assert got["m2po_masked_frac"] == got["want_m2po_masked_frac"]
        assert got["stack"] == [[0.0, -math.inf], [1.0, -math.inf], [2.0, -math.inf]]
        assert got["cat_of_nothing"] == [[], 0]
    assert any(got["alone_differs"] for got in ranks)
    assert [got["cat"] for got in ranks] == [
        [[0.0, 10.0, 11.0, 20.0, 21.0, 22.0], s] for s in (0, 1, 3)
    ]


@pytest.mark.slow
def test_torchrun_a_stale_m2po_update_is_the_one_process_update(tiny_model, tmp_path):
    """A batch sampled one version back, M2PO's loss: two ranks give the one-process parameters
    and metrics, sampler/* and m2po/masked_frac included, the same on both ranks."""
    outs = {n: tmp_path / f"world{n}.safetensors" for n in (1, 2)}
    for n, out in outs.items():
        torchrun(n, str(HERE / "ddp_update_script.py"), str(tiny_model), str(out), "stale-m2po")
    one, two = load_file(str(outs[1])), load_file(str(outs[2]))
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6, msg=k)
    m1, m2 = (json.loads(outs[n].with_suffix(".json").read_text()) for n in (1, 2))
    ranks = [json.loads(outs[2].with_suffix(f".rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] == m2
    assert set(m1) == set(m2) and 0 < m1["m2po/masked_frac"] < 1
    assert m1["rollout/staleness"] == 1.0 and 0 < m1["sampler/ess"] < 1
    assert len([k for k in m1 if k.startswith("sampler/")]) == 14
    for k, v in m1.items():
        assert m2[k] == pytest.approx(v, rel=2e-5, abs=1e-6), k


@pytest.mark.slow
def test_torchrun_klpo_train_with_a_stale_sampler(tiny_model, quick, tmp_path):
    """rollout.staleness=1 and M2PO under two ranks: the run logs the pooled sampler metrics,
    and with rollout.asynchronous the same metrics, bit for bit, with a rollout worker per rank
    and with one for the node (rollout.async_workers=node: the first rank's worker samples both
    shares, each with its rank's seed, and scatters them)."""
    extra = {
        "run.steps": 2, "run.eval_every": 0, "rollout.staleness": 1, "algo.policy_loss": "m2po",
        "algo.m2po_threshold": 0.002, "rollout.tis_cap": "null",
    }  # fmt: skip
    modes = {
        "false": {"rollout.asynchronous": "false"},
        "true": {"rollout.asynchronous": "true"},
        "node": {"rollout.asynchronous": "true", "rollout.async_workers": "node"},
    }
    rows, said = {}, {}
    for mode, over in modes.items():
        out = tmp_path / f"async-{mode}"
        said[mode] = torchrun(
            2, "-m", "klpo", "train", *sets(quick(tiny_model, out, **extra, **over))
        )
        rows[mode] = comparable(read_metrics(out / "metrics.jsonl"))
    one = "rollout worker: one for ranks 0-1 of the node, started by rank 0"
    assert one in said["node"] and one not in said["true"]
    assert rows["true"] == rows["false"]
    assert rows["node"] == rows["false"]
    train = [r for r in rows["false"] if r["step"] > 0]
    assert [r["rollout/staleness"] for r in train] == [0.0, 1.0]
    assert train[0]["sampler/kl_exact"] == 0.0 and train[1]["sampler/kl_exact"] > 0
    assert 0 < train[1]["sampler/ess"] < 1 and "m2po/masked_frac" in train[1]


@pytest.mark.slow
def test_torchrun_a_resumed_asynchronous_stale_run_continues_as_the_uninterrupted_one(
    tiny_model, quick, tmp_path
):
    """Two ranks, the sampler two versions behind, a rollout worker per rank: a run stopped after
    step 2 and resumed to step 4 with ``klpo train --resume`` logs, bit for bit, what the run of 4
    steps logs. Each rank restores its own ring from the checkpoint and sends its worker the
    requests again from its restored prompt stream."""
    extra = {
        "run.eval_every": 0, "run.save_every": 2, "rollout.staleness": 2,
        "rollout.asynchronous": "true", "kl.estimator": "k3",
    }  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    torchrun(2, "-m", "klpo", "train", *sets(quick(tiny_model, whole, **extra, **{"run.steps": 4})))
    torchrun(2, "-m", "klpo", "train", *sets(quick(tiny_model, part, **extra, **{"run.steps": 2})))
    assert (part / "checkpoints" / "step_000002" / "versions.safetensors").is_file()
    torchrun(2, "-m", "klpo", "train", "--resume", str(part), "--set", "run.steps=4")
    a = comparable(read_metrics(whole / "metrics.jsonl"))
    b = comparable(read_metrics(part / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # (no evaluation, so no step-0 row)
    assert b == a
    assert [r["rollout/staleness"] for r in a] == [0.0, 1.0, 2.0, 2.0]
    assert a[-1]["sampler/kl_exact"] > 0
