"""klpo.gemm: the three GEMM roles on each backend against float64 products, and the measured plan's
cache (under the user's cache dir; missing, corrupt or unwritable is survived)."""

from __future__ import annotations

import json

import pytest
import torch

from klpo import gemm
from klpo import logprobs as lp

BACKENDS = ["mm"] + (["onednn"] if gemm.ONEDNN else [])


def _close(got, want, k):
    # float32 products of length k: error ~ sqrt(k) eps |a||b|; inputs are O(1).
    tol = 8 * k**0.5 * torch.finfo(torch.float32).eps * want.abs().max().clamp_min(1)
    assert (got.double() - want).abs().max() <= tol


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
def test_roles_match_float64_products(backend, bias):
    gen = torch.Generator().manual_seed(0)
    n, vc, h = 13, 21, 9
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(vc, h, generator=gen)
    b = torch.randn(vc, generator=gen) if bias else None
    g = torch.randn(vc, n, generator=gen)  # a tile's gradient, transposed
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    _close(gemm.logits(x, w, b, backend), want, h)

    start = torch.randn(n, h, generator=gen)
    dh = start.clone()
    gemm.grad_hidden(dh, g, w, backend)
    _close(dh, start.double() + g.double().t() @ w.double(), vc)

    dw = torch.full((vc, h), 7.0)
    gemm.grad_weight(dw, g, x, backend, False)
    _close(dw, g.double() @ x.double(), n)
    gemm.grad_weight(dw, g, x, backend, True)
    _close(dw, 2 * g.double() @ x.double(), n)

    # Into a row block of a bigger output (how the fused backward writes the weight gradient),
    # and into a bf16 output (cast once).
    big = torch.zeros(vc + 5, h)
    gemm.grad_weight(big[3 : 3 + vc], g, x, backend, False)
    _close(big[3 : 3 + vc], g.double() @ x.double(), n)
    assert big[:3].eq(0).all() and big[3 + vc :].eq(0).all()
    low = torch.empty(vc, h, dtype=torch.bfloat16)
    gemm.grad_weight(low, g, x, backend, False)
    assert torch.allclose(low.double(), g.double() @ x.double(), rtol=2**-7, atol=1e-2)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("KLPO_GEMM", raising=False)
    gemm.forget_plans()
    monkeypatch.setattr(gemm, "TILE_TOKENS", 64)  # a small measurement: the logic, not the speed
    monkeypatch.setattr(gemm, "TILE_VOCAB", 96)
    monkeypatch.setattr(gemm, "ROUNDS", 1)
    yield tmp_path
    gemm.forget_plans()  # the plans of the small measurement are not the machine's


def test_cache_path_is_under_the_user_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gemm.cache_path() == tmp_path / "xdg" / "klpo" / "gemm_plan.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gemm.cache_path() == tmp_path / "home" / ".cache" / "klpo" / "gemm_plan.json"


@pytest.mark.skipif(not gemm.ONEDNN, reason="one backend only: nothing to measure")
def test_plan_is_measured_once_cached_and_reread(cache_dir, monkeypatch):
    calls = []
    real = gemm.measure

    def counted(h, dtype, rounds=gemm.ROUNDS):
        calls.append((h, dtype))
        return real(h, dtype, rounds)

    monkeypatch.setattr(gemm, "measure", counted)
    first = gemm.plan(32, torch.float32)
    assert calls == [(32, torch.float32)]
    path = cache_dir / "klpo" / "gemm_plan.json"
    data = json.loads(path.read_text())
    entry = data["plans"][gemm.machine_key(32, torch.float32)]
    assert gemm.Plan(**{k: entry[k] for k in gemm.Plan._fields}) == first
    assert set(entry["seconds"]) == set(gemm.ROLES)
    assert gemm.plan(32, torch.float32) == first and len(calls) == 1  # from memory
    gemm.forget_plans()
    assert gemm.plan(32, torch.float32) == first and len(calls) == 1  # from the file
    gemm.plan(48, torch.float32)  # another width: measured, the first entry kept
    assert len(calls) == 2
    assert len(json.loads(path.read_text())["plans"]) == 2
    # The key names what the plan depends on, so a changed ISA cap is measured anew.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert gemm.machine_key(32, torch.float32) != next(iter(data["plans"]))


@pytest.mark.skipif(not gemm.ONEDNN, reason="one backend only: nothing to measure")
@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[1, 2]",
        json.dumps({"version": 999, "plans": {}}),
        json.dumps({"version": 1, "plans": []}),
        "KEY",  # replaced below by a valid key whose plan names an unknown backend
    ],
)
def test_corrupt_cache_is_measured_again_and_rewritten(cache_dir, content):
    path = cache_dir / "klpo" / "gemm_plan.json"
    path.parent.mkdir(parents=True)
    if content == "KEY":
        bad = {
            "logits": "cublas",
            "grad_hidden": "mm",
            "grad_weight": "mm",
            "bf16_grad_weight": False,
        }
        content = json.dumps({"version": 1, "plans": {gemm.machine_key(32, torch.float32): bad}})
    path.write_text(content)
    got = gemm.plan(32, torch.float32)
    assert all(b in gemm.BACKENDS for b in got[:3])
    assert gemm.read_cache(path) == {gemm.machine_key(32, torch.float32): got}


@pytest.mark.skipif(not gemm.ONEDNN, reason="one backend only: nothing to measure")
def test_unwritable_cache_dir_keeps_the_plan_in_memory(tmp_path, cache_dir, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # klpo/ cannot be created under a file
    got = gemm.plan(32, torch.float32)
    assert not (blocker / "klpo").exists()
    assert gemm.plan(32, torch.float32) == got


def test_forced_backend_and_bad_value(cache_dir, monkeypatch):
    monkeypatch.setenv("KLPO_GEMM", "mm")
    assert gemm.plan(32, torch.float32) == gemm.Plan("mm", "mm", "mm", False)
    assert not (cache_dir / "klpo").exists()  # nothing measured
    monkeypatch.setenv("KLPO_GEMM", "fast")
    with pytest.raises(ValueError, match=r"KLPO_GEMM='fast'.*'onednn' or 'mm'"):
        gemm.plan(32, torch.float32)


def test_no_measurement_off_cpu_float64_or_small_calls(cache_dir, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(gemm, "measure", fail)
    assert gemm.plan(32, torch.float64) == gemm.Plan("mm", "mm", "mm", False)
    assert gemm.plan(32, torch.float32, "meta") == gemm.Plan("mm", "mm", "mm", False)
    h, w = torch.randn(4, 8), torch.randn(16, 8)  # 2 N V H far below MIN_FLOPS
    assert lp.head_plan(h, w) == gemm.default_plan(torch.float32)
