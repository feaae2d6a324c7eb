"""Tests for klpo.reduce: hand values, masking, split invariance (micro-batches, ranks), errors.

Oracles: hand arithmetic, and a naive float64 loop over the valid tokens written here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo import reduce as R

F64 = torch.float64

# Three rows: lengths 2, 0 (fully masked) and 3.
X = [[1.0, 2.0, 9.0], [5.0, 5.0, 5.0], [3.0, 4.0, 5.0]]
MASK = [[True, True, False], [False, False, False], [True, True, True]]


def naive(x: np.ndarray, mask: np.ndarray, mode: str, max_len: int | None = None) -> float:
    """The definitions in the module docstring, one valid token at a time."""
    rows = [
        [float(v) for v, m in zip(xr, mr, strict=True) if m] for xr, mr in zip(x, mask, strict=True)
    ]
    rows = [r for r in rows if r]  # fully masked sequences take no part
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    assert max_len is not None
    return sum(sum(r) for r in rows) / (len(rows) * max_len)


def test_hand_values():
    x, mask = torch.tensor(X), torch.tensor(MASK)
    expected = {
        "token-mean": (1 + 2 + 3 + 4 + 5) / 5,  # 15 / 5 valid tokens = 3.0
        "seq-mean-token-mean": ((1 + 2) / 2 + (3 + 4 + 5) / 3) / 2,  # (1.5 + 4) / 2 = 2.75
        "seq-mean-token-sum": ((1 + 2) + (3 + 4 + 5)) / 2,  # (3 + 12) / 2 = 7.5
        "seq-mean-token-sum-norm": ((1 + 2) + (3 + 4 + 5)) / (2 * 4),  # 15 / (2 rows * 4) = 1.875
    }
    for mode, value in expected.items():
        got = R.reduce(x, mask, mode, max_len=4)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(value, rel=1e-7), mode
        assert got.item() == pytest.approx(naive(np.array(X), np.array(MASK), mode, 4), rel=1e-7)
    # The normalisers: 5 tokens; 2 non-empty rows; 2 * 4 = 8.
    assert R.normaliser(mask, "token-mean").item() == 5
    assert R.normaliser(mask, "token-mean").dtype == torch.int64  # a count: exact at any size
    assert R.normaliser(mask, "seq-mean-token-mean").item() == 2
    assert R.normaliser(mask, "seq-mean-token-sum").item() == 2
    assert R.normaliser(mask, "seq-mean-token-sum-norm", max_len=4).item() == 8


def test_masked_sum_and_mean():
    x, mask = torch.tensor(X), torch.tensor(MASK)
    assert R.masked_sum(x, mask).item() == 15.0  # 1 + 2 + 3 + 4 + 5
    assert R.masked_sum(x, mask, dim=-1).tolist() == [3.0, 0.0, 12.0]
    assert R.masked_mean(x, mask).item() == 3.0
    # Row means: 3/2, nothing (0, not NaN), 12/3.
    assert R.masked_mean(x, mask, dim=-1).tolist() == [1.5, 0.0, 4.0]
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert R.masked_mean(x[:2], empty).item() == 0.0


@pytest.mark.parametrize("mode", R.MODES)
def test_inf_and_nan_at_masked_tokens_never_leak(mode):
    x = torch.tensor(X, dtype=F64)
    x[0, 2], x[1, 0], x[1, 1] = math.inf, math.nan, -math.inf
    x.requires_grad_(True)
    mask = torch.tensor(MASK)
    value = R.reduce(x, mask, mode, max_len=4)
    assert math.isfinite(value.item())
    (grad,) = torch.autograd.grad(value, x)
    assert torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()
    # The gradient at valid tokens: 1/N, or 1/(S n_b) for seq-mean-token-mean.
    inv = {
        "token-mean": [[1 / 5, 1 / 5], [1 / 5] * 3],
        "seq-mean-token-mean": [[1 / 4, 1 / 4], [1 / 6] * 3],  # 1/(2·2), 1/(2·3)
        "seq-mean-token-sum": [[1 / 2, 1 / 2], [1 / 2] * 3],
        "seq-mean-token-sum-norm": [[1 / 8, 1 / 8], [1 / 8] * 3],
    }[mode]
    np.testing.assert_allclose(grad[0, :2].numpy(), inv[0], rtol=1e-15)
    np.testing.assert_allclose(grad[2].numpy(), inv[1], rtol=1e-15)


@pytest.mark.parametrize("mode", R.MODES)
def test_everything_masked_gives_zero_and_zero_gradient(mode):
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    value = R.reduce(x, mask, mode, max_len=4)
    assert value.item() == 0.0
    (grad,) = torch.autograd.grad(value, x)
    assert torch.equal(grad, torch.zeros_like(grad))


def random_batch(seed: int, b: int = 9, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, generator=gen, dtype=F64)
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[3] = 0  # at least one fully masked row
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[5, 1] = False  # and a hole, as tool output inside a multi-turn response
    return x, mask


@pytest.mark.parametrize("mode", R.MODES)
def test_random_batches_match_naive(mode):
    for seed in range(5):
        x, mask = random_batch(seed)
        got = R.reduce(x, mask, mode, max_len=11).item()
        assert got == pytest.approx(naive(x.numpy(), mask.numpy(), mode, 11), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("mode", R.MODES)
def test_micro_batches_give_the_whole_batch_value_and_gradient(mode):
    x, mask = random_batch(11)
    L = 10  # the constant of seq-mean-token-sum-norm
    x_full = x.clone().requires_grad_(True)
    whole = R.reduce(x_full, mask, mode, max_len=L)
    (g_whole,) = torch.autograd.grad(whole, x_full)

    x_split = x.clone().requires_grad_(True)
    parts = [slice(0, 2), slice(2, 6), slice(6, 9)]  # uneven micro-batches
    n_global = sum(R.normaliser(mask[p], mode, max_len=L) for p in parts)
    assert n_global.item() == R.normaliser(mask, mode, max_len=L).item()  # additive
    total = torch.zeros((), dtype=F64)
    for p in parts:
        part = R.reduce(x_split[p], mask[p], mode, normaliser=n_global, max_len=L)
        part.backward()  # gradient accumulation, one micro-batch at a time
        total = total + part.detach()
    assert total.item() == pytest.approx(whole.item(), rel=1e-13)
    torch.testing.assert_close(x_split.grad, g_whole, rtol=1e-13, atol=1e-16)
    # Without the global normaliser the split is wrong (the test has power):
    naive_sum = sum(R.reduce(x[p], mask[p], mode, max_len=L) for p in parts) / len(parts)
    assert naive_sum.item() != pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("mode", R.MODES)
def test_two_ranks_with_different_padding_match_the_whole_batch(mode):
    """A simulated 2-rank split; each rank pads its rows to its own width, DDP averages grads."""
    x, mask = random_batch(12)
    L = 10
    x_full = x.clone().requires_grad_(True)
    whole = R.reduce(x_full, mask, mode, max_len=L)
    (g_whole,) = torch.autograd.grad(whole, x_full)

    world = 2
    rows = [torch.arange(0, 9, 2), torch.arange(1, 9, 2)]  # interleaved, 5 and 4 rows
    widths = [int(mask[r].nonzero()[:, 1].max()) + 1 for r in rows]  # each rank's own padding
    assert min(widths) < mask.shape[1]  # a rank padded narrower than the whole batch
    leaves = [x[r][:, :w].clone().requires_grad_(True) for r, w in zip(rows, widths, strict=True)]
    masks = [mask[r][:, :w] for r, w in zip(rows, widths, strict=True)]
    # The all-reduce of the normaliser (a sum), then each rank's loss times the world size.
    n_global = sum(R.normaliser(m, mode, max_len=L) for m in masks)
    losses = [
        world * R.reduce(xi, mi, mode, normaliser=n_global, max_len=L)
        for xi, mi in zip(leaves, masks, strict=True)
    ]
    grads = [torch.autograd.grad(loss, leaf)[0] for loss, leaf in zip(losses, leaves, strict=True)]
    # DDP averages the ranks' losses and gradients.
    assert (sum(losses) / world).item() == pytest.approx(whole.item(), rel=1e-13)
    for r, w, g in zip(rows, widths, grads, strict=True):
        # each rank's gradient for its own tokens, averaged over the ranks by the all-reduce
        # (the other rank contributes zero to these tokens)
        torch.testing.assert_close(g / world, g_whole[r][:, :w], rtol=1e-13, atol=1e-16)
        assert (g_whole[r][:, w:] == 0).all()


def test_errors_name_the_fix():
    x, mask = torch.tensor(X), torch.tensor(MASK)
    with pytest.raises(TypeError, match=r"mask\.bool\(\)"):
        R.reduce(x, mask.float(), "token-mean")
    with pytest.raises(ValueError, match="same tokens"):
        R.reduce(x, mask[:, :2], "token-mean")
    with pytest.raises(ValueError, match="choose one of: token-mean"):
        R.reduce(x, mask, "sum")
    with pytest.raises(ValueError, match="max_len"):
        R.reduce(x, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="positive int"):
        R.normaliser(mask, "seq-mean-token-sum-norm", max_len=0)
    with pytest.raises(ValueError, match=">= 0"):
        R.reduce(x, mask, "token-mean", normaliser=-1.0)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        R.reduce(x[0], mask[0], "token-mean")


def test_float_normaliser_and_dtypes():
    x, mask = torch.tensor(X, dtype=torch.bfloat16), torch.tensor(MASK)
    got = R.reduce(x, mask, "token-mean", normaliser=10.0)
    assert got.dtype == torch.float32
    assert got.item() == 1.5  # 15 / 10
    assert R.reduce(x.double(), mask, "token-mean").dtype == F64


# ---------------------------------------------------------------------------------------------
# Peer: verl's agg_loss.


@pytest.mark.peer
@pytest.mark.parametrize("mode", R.MODES)
def test_matches_verl_agg_loss(mode):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    for seed in range(3):
        x, mask = random_batch(seed + 20)
        ours = R.reduce(x, mask, mode, max_len=7)
        theirs = core_algos.agg_loss(x, mask.to(F64), mode, loss_scale_factor=7)
        # verl guards seq-mean-token-mean with n_b + 1e-8; the difference is ~1e-8 relative.
        tol = 1e-7 if mode == "seq-mean-token-mean" else 1e-12
        assert ours.item() == pytest.approx(theirs.item(), rel=tol)
        # Data parallel: verl scales by dp_size and takes the global counts as arguments.
        rank = mask[:4]
        theirs_dp = core_algos.agg_loss(
            x[:4],
            rank.to(F64),
            mode,
            dp_size=2,
            batch_num_tokens=int(mask.sum()),
            global_batch_size=int(mask.any(-1).sum()),
            loss_scale_factor=7,
        )
        ours_dp = 2 * R.reduce(
            x[:4], rank, mode, normaliser=R.normaliser(mask, mode, max_len=7), max_len=7
        )
        assert ours_dp.item() == pytest.approx(theirs_dp.item(), rel=tol)
