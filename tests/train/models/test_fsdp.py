"""FSDP2 under torchrun on CPU (gloo): the one-process parameters, exact resume, sharded export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.runtime.metrics import read_metrics
from klpo.train.tools.export import export_run

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
SRC = HERE.parents[1] / "src"


def torchrun(script: str, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(HERE / script), *args,
    ]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_fsdp_two_processes_give_the_one_process_parameters_and_resume_exactly(
    tiny_model, tmp_path
):
    import fsdp_update_script

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    threads = torch.get_num_threads()
    try:
        fsdp_update_script.main(str(tiny_model), str(one))  # a plain single process
    finally:
        torch.set_num_threads(threads)
    torchrun("fsdp_update_script.py", str(tiny_model), str(two))
    start = load_file(str(tiny_model / "model.safetensors"))
    a = load_file(str(one / "final.safetensors"))
    b = load_file(str(two / "final.safetensors"))
    resumed = load_file(str(two / "resumed.safetensors"))
    assert (two / "shards" / ".metadata").is_file()
    assert sorted(a) == sorted(b) == sorted(start)
    assert all((a[k] - start[k]).abs().max() > 1e-4 for k in a)  # three AdamW steps moved all
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
        assert torch.equal(resumed[k], b[k]), k  # the sharded checkpoint resumes bit for bit


@pytest.mark.slow
def test_fsdp_shutdown_leaves_no_gloo_thread_for_interpreter_finalization():
    # A mesh kept alive by DTensor's native cache, and FSDP imported after the group was made,
    # both used to hold the group past destroy_process_group (the script exits 1 naming them).
    torchrun("fsdp_exit_script.py")


@pytest.mark.slow
def test_torchrun_fsdp_train_resumes_and_exports_a_plain_model(tiny_model, quick, tmp_path):
    run = tmp_path / "run"
    torchrun("fsdp_train_script.py", str(tiny_model), str(run))
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # (every rank evaluates: collective)
    assert "accuracy/heldout" in rows[0] and "accuracy/heldout" in rows[2]
    # Step 1, sharded over two ranks: the policy is the reference and pi_old, exactly.
    step1 = rows[1]
    assert [step1[k] for k in ("kl/ref/exact", "kl/ref/k1", "kl/ref/k3", "kl/old/k3")] == [0.0] * 4
    ckpt = run / "checkpoints" / "step_000003" / "policy"
    assert (ckpt / ".metadata").is_file() and not (ckpt / "model.safetensors").exists()

    out = export_run(run, tmp_path / "plain")
    model = AutoModelForCausalLM.from_pretrained(out)  # transformers alone
    start = load_file(str(tiny_model / "model.safetensors"))
    for name, p in model.state_dict().items():
        if name in start:
            assert torch.isfinite(p).all() and (p - start[name]).abs().max() > 0, name

    # A sharded run cannot continue as a single unsharded process; the error says so.
    cfg = build_config(
        overrides=quick(tiny_model, run, **{"dist.strategy": "fsdp", "run.steps": 4})
    )
    with pytest.raises(ConfigError, match="holds sharded weights"):
        loop.train(cfg, resume=True, log=lambda *_: None)


@pytest.mark.slow
def test_a_stale_sampler_under_fsdp_resumes_and_samples_as_ddp(tiny_model, tmp_path):
    """k = 1 on two ranks: each rank's ring holds its shards, the swap drops the root's gathered
    weights (else the root's outlive the swap, the sampler mixes two versions and the run leaves
    DDP's at step 2), the checkpoint's ring holds whole tensors, a resumed run logs the uninterrupted one's metrics bit for bit,
    and the sharded run samples and trains as the unsharded DDP run does."""
    from klpo.train.runtime.checkpoint import version_tensors
    from klpo.train.runtime.metrics import is_timing

    torchrun("fsdp_stale_script.py", str(tiny_model), str(tmp_path))

    def rows(name: str) -> list[dict]:
        return [
            {k: v for k, v in r.items() if not is_timing(k)}
            for r in read_metrics(tmp_path / name / "metrics.jsonl")
        ]

    whole, ddp = rows("whole"), rows("ddp")
    assert rows("part") == whole
    assert [r["rollout/staleness"] for r in whole] == [0.0, 1.0, 1.0, 1.0]
    assert whole[0]["sampler/kl_exact"] == 0.0 and all(r["sampler/kl_exact"] > 0 for r in whole[1:])
    for a, b in zip(whole, ddp, strict=True):
        for k in ("reward/mean", "kl/ref/exact", "sampler/kl_exact", "sampler/ess", "loss/total"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), (a["step"], k)
    ring = version_tensors(tmp_path / "part" / "checkpoints" / "step_000002")
    start = load_file(str(tiny_model / "model.safetensors"))
    assert sorted({k.split("/")[0] for k in ring}) == ["1", "2"]
    for key, t in ring.items():
        name = key.split("/", 1)[1].removeprefix("model.")
        if name in start:
            assert t.shape == start[name].shape, key  # whole, not a rank's shard


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["dist.strategy=fsdp", "algo.name=ppo"], "critic"),
        (["dist.strategy=fsdp", "model.lora={r: 2}"], "LoRA"),
        (["dist.strategy=fsdp", "kl.estimator=ref_is"], "samples completions from the reference"),
        (["model.lora={r: 2}", "kl.estimator=ref_is"], "samples completions from the reference"),
    ],
)
def test_fsdp_and_lora_refuse_what_they_do_not_support_yet(extra, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=extra)
