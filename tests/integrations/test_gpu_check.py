"""``bench/gpu_check.sh --dry-run``: every stage of the GPU check, on the CPU at tiny shapes.

The dry run builds the 2-layer model, runs klpo's six GRPO runs (bf16 + LoRA, FSDP on two
processes, the exact KL with the forward-pass gradient on and off, the sampler one version behind
in the trainer's process and in the rollout worker's), TRL's where it is importable, and the
kernels, then prints the one table. The checks: every stage finished, each run trained the steps
and tokens it was given, the forward-pass gradient was taken exactly where it was asked for, FSDP
ran on two processes, the worker's run trained on the in-process run's batches (every metric but
the timings equal), and the kernels' errors against float64 are float32's, not bf16's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _compute_workload():
    spec = importlib.util.spec_from_file_location(
        "compute_workload", ROOT / "bench" / "compute_workload.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


def test_the_gpu_model_has_qwen25_05b_shape():
    """Qwen2.5-0.5B has 494,032,768 parameters: ours by hand, plus its q/k/v biases."""
    import torch
    from transformers import LlamaForCausalLM

    cw = _compute_workload()
    cfg = cw.model_config(cw.SHAPES["0.5b"])
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    v, h, i, kv = 151936, 896, 4864, 2 * 64  # 2 key/value heads of 64
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v; the MLP; two norms
    assert n == v * h + 24 * layer + h == 494_005_120
    assert n + 24 * (h + 2 * kv) == 494_032_768  # Qwen2's q, k, v biases


@pytest.mark.slow
def test_dry_run_runs_every_stage(tmp_path):
    out = tmp_path / "results.json"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--dry-run", "--json", str(out), "--logs", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["dry_run"] and res["tests"]["ok"]
    collected = re.fullmatch(r"(\d+) tests collected in [\d.]+s", res["tests"]["summary"])
    assert collected and int(collected[1]) >= 26, res["tests"]  # the device tests, no error
    assert res["build"]["vocab"] == 4096
    # 2 steps of 2 prompts × 4 completions of at most 8 tokens, in each of klpo's runs
    for stage in ("lora", "fsdp", "fused on", "fused off", "stale sync", "stale async"):
        r = res[stage]
        assert "error" not in r, (stage, r)
        assert r["steps"] == 2 and 0 < r["tokens_per_step"] <= 2 * 4 * 8 and r["tokens_per_s"] > 0
    assert res["fsdp"]["world"] == 2 and res["lora"]["world"] == 1
    # the forward-pass gradient: taken once per update with it on, never with it off or with k3
    assert res["fused on"]["fused_loss_calls"] == 2
    assert res["fused off"]["fused_loss_calls"] == res["lora"]["fused_loss_calls"] == 0
    # the overlap stage: the same job whether the stale batch is sampled in or beside the trainer
    assert res["stale async"]["digest"] == res["stale sync"]["digest"] != res["lora"]["digest"]
    trl = res["trl"]
    if importlib.util.find_spec("trl") is None:
        assert trl["error"] == "absent"
    else:
        assert trl["steps"] == 2 and 0 < trl["tokens_per_step"] <= 2 * 4 * 8
    # Kernels: klpo computes in float32 from bf16 inputs, so against float64 its error is float32
    # rounding of dot products over H = 32 and sums over V = 4096 (~1e-6 at logits of a few
    # units); naive rounds the logits to bf16 (8 bits: ~1e-2). 1e-4 lies between the two.
    for case, methods in res["kernels"]["cases"].items():
        for m in ("klpo fused", "klpo fused_loss"):
            assert methods[m]["err"] < 1e-4, (case, m, methods[m])
        assert methods["naive"]["err"] > 1e-3  # the bf16 logits, so the oracle can tell
        assert "GPU" in methods["liger"]["error"] or "ms" in methods["liger"]
    table = proc.stdout
    for row in (
        "tests/test_cuda.py",
        "GRPO bf16 + LoRA r=16",
        "FSDP",
        "forward-pass gradient",
        "sampler one version behind",
        "metrics digest) | same",
    ):
        assert row in table
    assert "logp N=64 H=32 V=4096 bf16" in table and "kl N=64 H=32 V=4096 bf16" in table
