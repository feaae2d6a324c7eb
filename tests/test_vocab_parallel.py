"""The vocabulary-parallel head equals the single-device one: values and gradients in float64,
with the head split over 2 and 4 gloo processes on the CPU (each process one shard of rows)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from klpo.logprobs import from_logits
from klpo.vocab_parallel import vocab_parallel

N, H, V, T = 6, 5, 12, 0.8


def _inputs():
    g = torch.Generator().manual_seed(3)
    f = torch.float64
    return {
        "hidden": torch.randn(N, H, generator=g, dtype=f),
        "weight": torch.randn(V, H, generator=g, dtype=f),
        "bias": torch.randn(V, generator=g, dtype=f),
        "hidden_ref": torch.randn(N, H + 1, generator=g, dtype=f),
        "weight_ref": torch.randn(V, H + 1, generator=g, dtype=f),
        "tokens": torch.randint(0, V, (N,), generator=g),
        "up": torch.randn(3, N, generator=g, dtype=f),  # upstream gradients of the three outputs
    }


def _single() -> dict[str, torch.Tensor]:
    x = _inputs()
    h, w, b = (x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    logits = h @ w.T + b
    out = from_logits(
        logits, x["tokens"], temperature=T, logits_ref=x["hidden_ref"] @ x["weight_ref"].T
    )
    loss = sum((u * o).sum() for u, o in zip(x["up"], out, strict=True))
    loss.backward()
    return {"logp": out.logp, "entropy": out.entropy, "kl": out.kl, "h": h.grad, "w": w.grad,
            "b": b.grad}  # fmt: skip


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = _inputs()
    v_r = V // world
    rows = slice(rank * v_r, (rank + 1) * v_r)
    h = x["hidden"].clone().requires_grad_(True)
    w = x["weight"][rows].clone().requires_grad_(True)
    b = x["bias"][rows].clone().requires_grad_(True)
    got = vocab_parallel(
        h, w, x["tokens"], vocab_start=rank * v_r, bias=b, hidden_ref=x["hidden_ref"],
        weight_ref=x["weight_ref"][rows], temperature=T, row_chunk=4,
    )  # fmt: skip
    loss = sum((u * o).sum() for u, o in zip(x["up"], got, strict=True))
    loss.backward()
    torch.save(
        {
            "logp": got.logp,
            "entropy": got.entropy,
            "kl": got.kl,
            "h": h.grad,
            "w": w.grad,
            "b": b.grad,
            "rows": (rows.start, rows.stop),
        },
        Path(out) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_a_sharded_head_gives_the_single_devices_values_and_gradients(world, tmp_path) -> None:
    mp.spawn(_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    want = _single()
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for key in ("logp", "entropy", "kl", "h"):
            assert torch.allclose(got[key], want[key], rtol=0, atol=1e-12), (rank, key)
        lo, hi = got["rows"]
        assert torch.allclose(got["w"], want["w"][lo:hi], rtol=0, atol=1e-12), rank
        assert torch.allclose(got["b"], want["b"][lo:hi], rtol=0, atol=1e-12), rank


def test_one_process_is_the_single_device_computation_and_bad_shapes_are_named() -> None:
    x, want = _inputs(), _single()
    h, w, b = (x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
    got = vocab_parallel(
        h, w, x["tokens"], bias=b, hidden_ref=x["hidden_ref"], weight_ref=x["weight_ref"],
        temperature=T,
    )  # fmt: skip
    sum((u * o).sum() for u, o in zip(x["up"], got, strict=True)).backward()
    for key, value in (("logp", got.logp), ("entropy", got.entropy), ("kl", got.kl)):
        assert torch.allclose(value, want[key], rtol=0, atol=1e-12), key
    assert torch.allclose(h.grad, want["h"], atol=1e-12) and torch.allclose(
        w.grad, want["w"], atol=1e-12
    )
    assert vocab_parallel(x["hidden"], x["weight"], x["tokens"]).kl is None
    with pytest.raises(ValueError, match="must share H"):
        vocab_parallel(x["hidden"], x["weight_ref"], x["tokens"])
    with pytest.raises(ValueError, match="hidden_ref and weight_ref together"):
        vocab_parallel(x["hidden"], x["weight"], x["tokens"], hidden_ref=x["hidden_ref"])


def _rank_teacher(rank: int, world: int, port: int, out: str) -> None:
    from klpo.teacher import from_hidden, from_hidden_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = _inputs()
    v_r = V // world
    rows = slice(rank * v_r, (rank + 1) * v_r)
    result = {}
    for divergence in ("forward", "jsd"):
        h = x["hidden"].clone().requires_grad_(True)
        w = x["weight"][rows].clone().requires_grad_(True)
        got = from_hidden(
            h, w, x["hidden_ref"], x["weight_ref"][rows], divergence=divergence, beta=0.4,
            temperature=T, group=None, row_chunk=4,
        )  # fmt: skip
        (x["up"][0] * got).sum().backward()
        result[divergence] = (got.detach(), h.grad, w.grad)
    for divergence in ("reverse", "forward", "jsd"):  # the loss form, the gradient eager
        h = x["hidden"].clone().requires_grad_(True)
        w = x["weight"][rows].clone().requires_grad_(True)
        b = x["bias"][rows].clone().requires_grad_(True)
        got = from_hidden_loss(
            h, w, x["hidden_ref"], x["weight_ref"][rows], x["up"][0], divergence=divergence,
            beta=0.4, bias=b, temperature=T, row_chunk=4,
        )  # fmt: skip
        got.loss.backward()
        result[f"loss {divergence}"] = (got.value, h.grad, w.grad, b.grad, got.loss.detach())
    torch.save(result, Path(out) / f"teacher{rank}.pt")
    dist.destroy_process_group()


def test_a_teachers_divergence_over_a_sharded_head_is_the_single_devices(tmp_path) -> None:
    from klpo import teacher

    world = 2
    mp.spawn(_rank_teacher, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    x = _inputs()
    zt = x["hidden_ref"] @ x["weight_ref"].T
    for divergence, fn in (
        ("forward", lambda z: teacher.forward_kl(z, zt, temperature=T)),
        ("jsd", lambda z: teacher.jsd(z, zt, 0.4, temperature=T)),
    ):
        h, w = x["hidden"].clone().requires_grad_(True), x["weight"].clone().requires_grad_(True)
        want = fn(h @ w.T)
        (x["up"][0] * want).sum().backward()
        for rank in range(world):
            value, g_h, g_w = torch.load(tmp_path / f"teacher{rank}.pt")[divergence]
            rows = slice(rank * (V // world), (rank + 1) * (V // world))
            assert torch.allclose(value, want.detach(), rtol=0, atol=1e-12), divergence
            assert torch.allclose(g_h, h.grad, rtol=0, atol=1e-12), divergence
            assert torch.allclose(g_w, w.grad[rows], rtol=0, atol=1e-12), divergence


def test_the_loss_form_over_a_sharded_head_is_the_single_devices(tmp_path) -> None:
    """from_hidden_loss over 2 gloo processes: its collectives all inside a tile, one pass."""
    from klpo import teacher

    world = 2
    mp.spawn(_rank_teacher, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    x = _inputs()
    zt = x["hidden_ref"] @ x["weight_ref"].T
    for divergence, fn in (
        ("reverse", lambda z: teacher.reverse_kl(z, zt, temperature=T)),
        ("forward", lambda z: teacher.forward_kl(z, zt, temperature=T)),
        ("jsd", lambda z: teacher.jsd(z, zt, 0.4, temperature=T)),
    ):
        h, w, b = (x[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias"))
        want = fn(h @ w.T + b)
        loss = (x["up"][0] * want).sum()
        loss.backward()
        for rank in range(world):
            value, g_h, g_w, g_b, got = torch.load(tmp_path / f"teacher{rank}.pt")[
                f"loss {divergence}"
            ]
            rows = slice(rank * (V // world), (rank + 1) * (V // world))
            assert torch.allclose(value, want.detach(), rtol=0, atol=1e-12), divergence
            assert torch.allclose(got, loss.detach(), rtol=0, atol=1e-12), divergence
            assert torch.allclose(g_h, h.grad, rtol=0, atol=1e-12), divergence
            assert torch.allclose(g_w, w.grad[rows], rtol=0, atol=1e-12), divergence
            assert torch.allclose(g_b, b.grad[rows], rtol=0, atol=1e-12), divergence
