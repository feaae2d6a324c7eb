"""Tests for klpo.advantages: hand cases, identities, a naive per-row oracle, errors, peers.

Oracles: hand arithmetic; a naive float64 implementation that first compacts each row to its
valid tokens (so it never sees a mask) and then applies the textbook recursion; numpy statistics.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo import advantages as A

F64 = torch.float64


def compact(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [
        [float(v) for v, m in zip(xr, mr, strict=True) if m] for xr, mr in zip(x, mask, strict=True)
    ]


def scatter(rows: list[list[float]], mask: torch.Tensor) -> np.ndarray:
    out = np.zeros(mask.shape)
    for b, row in enumerate(rows):
        out[b, mask[b].numpy()] = row
    return out


def naive_gae(
    r: list[float], v: list[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """Textbook GAE on one episode of n steps, V after the last step = 0, as explicit sums."""
    n = len(r)
    v_next = [*v[1:], 0.0]
    delta = [r[k] + gamma * v_next[k] - v[k] for k in range(n)]
    adv = [sum((gamma * lam) ** (j - k) * delta[j] for j in range(k, n)) for k in range(n)]
    return adv, [a + vv for a, vv in zip(adv, v, strict=True)]


def naive_rtg(r: list[float], gamma: float) -> list[float]:
    return [sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]


def ragged(seed: int, b: int = 6, t: int = 8):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, t, generator=gen, dtype=F64)
    values = torch.randn(b, t, generator=gen, dtype=F64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[0], lengths[1] = t, 1
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask[2, 0] = False  # a hole at the start and one inside (multi-turn tool output)
    mask[0, 3:5] = False
    # Garbage where masked: it must not leak anywhere.
    rewards[~mask] = math.nan
    values[~mask] = math.inf
    return rewards, values, mask


# ---------------------------------------------------------------------------------------------
# Returns and GAE.


def test_returns_to_go_hand():
    # gamma = 0.5, rewards (1, 2, 3): G_2 = 3; G_1 = 2 + 0.5·3 = 3.5; G_0 = 1 + 0.5·3.5 = 2.75
    rewards = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    mask = torch.tensor([[True, True, True, False]])
    got = A.returns_to_go(rewards, mask, gamma=0.5)
    assert got.tolist() == [[2.75, 3.5, 3.0, 0.0]]


def test_gae_hand():
    # gamma = 0.9, lam = 0.8 (gamma·lam = 0.72), rewards (0, 0, 1), values (0.5, 0.6, 0.7):
    # delta_2 = 1 + 0.9·0 - 0.7 = 0.3              A_2 = 0.3
    # delta_1 = 0 + 0.9·0.7 - 0.6 = 0.03           A_1 = 0.03 + 0.72·0.3 = 0.246
    # delta_0 = 0 + 0.9·0.6 - 0.5 = 0.04           A_0 = 0.04 + 0.72·0.246 = 0.21712
    # returns = A + V = (0.71712, 0.846, 1.0)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=F64)
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = A.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv[0].numpy(), [0.21712, 0.246, 0.3, 0.0], rtol=1e-14)
    np.testing.assert_allclose(ret[0].numpy(), [0.71712, 0.846, 1.0, 0.0], rtol=1e-14)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.5, 0.0), (1.0, 1.0), (0.0, 0.7)])
def test_gae_matches_naive_on_ragged_batches(gamma, lam):
    rewards, values, mask = ragged(1)
    adv, ret = A.gae(rewards, values, mask, gamma=gamma, lam=lam)
    rows = [
        naive_gae(r, v, gamma, lam)
        for r, v in zip(compact(rewards, mask), compact(values, mask), strict=True)
    ]
    np.testing.assert_allclose(
        adv.numpy(), scatter([a for a, _ in rows], mask), rtol=1e-12, atol=1e-12
    )
    np.testing.assert_allclose(
        ret.numpy(), scatter([r for _, r in rows], mask), rtol=1e-12, atol=1e-12
    )
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_identities():
    rewards, values, mask = ragged(2)
    for gamma in (1.0, 0.9):
        # lam = 1: A = returns-to-go - V
        adv, _ = A.gae(rewards, values, mask, gamma=gamma, lam=1.0)
        rtg = A.returns_to_go(rewards, mask, gamma=gamma)
        expected = torch.where(mask, rtg - values, 0.0)
        torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
        # lam = 0: A = the one-step TD error r_t + gamma V_{next valid} - V_t (V = 0 after the end)
        adv0, _ = A.gae(rewards, values, mask, gamma=gamma, lam=0.0)
        td = []
        for r, v in zip(compact(rewards, mask), compact(values, mask), strict=True):
            v_next = [*v[1:], 0.0]
            td.append([r[k] + gamma * v_next[k] - v[k] for k in range(len(r))])
        np.testing.assert_allclose(adv0.numpy(), scatter(td, mask), rtol=1e-12, atol=1e-12)


def test_returns_to_go_matches_naive():
    rewards, _, mask = ragged(3)
    for gamma in (1.0, 0.7):
        got = A.returns_to_go(rewards, mask, gamma=gamma)
        expected = scatter([naive_rtg(r, gamma) for r in compact(rewards, mask)], mask)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_task_reward_and_kl_shaping():
    """A task reward at the last valid token, -beta·kl on every token: gamma = 1 sums the future."""
    kl_tok = torch.tensor([[0.1, 0.2, 0.3, 0.0], [0.4, 0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    rewards = -0.5 * kl_tok
    rewards[0, 2] += 1.0  # task rewards at each row's last valid token
    rewards[1, 1] += 2.0
    got = A.returns_to_go(rewards, mask)
    # row 0: G_0 = 1 - 0.5·(0.1 + 0.2 + 0.3) = 0.7; G_1 = 1 - 0.5·0.5 = 0.75; G_2 = 1 - 0.15 = 0.85
    # row 1: G_0 = 2 - 0.5·(0.4 + 0.5) = 1.55; G_1 = 2 - 0.25 = 1.75
    np.testing.assert_allclose(got.numpy(), [[0.7, 0.75, 0.85, 0], [1.55, 1.75, 0, 0]], rtol=1e-6)


def test_outputs_are_detached_and_float32():
    rewards = torch.randn(2, 3, requires_grad=True)
    values = torch.randn(2, 3, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv, ret = A.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    for t in (
        adv,
        ret,
        A.returns_to_go(rewards, mask),
        A.whiten(rewards, mask),
        A.reinforce_pp(rewards, mask),
    ):
        assert not t.requires_grad and t.dtype == torch.float32
    g = A.group_relative(torch.randn(4, requires_grad=True), 2)
    assert not g.requires_grad and g.dtype == torch.float32
    assert A.gae(rewards.double(), values.double(), mask, gamma=1.0, lam=1.0)[0].dtype == F64


# ---------------------------------------------------------------------------------------------
# Whitening and REINFORCE++.


def test_whiten_matches_numpy():
    rewards, _, mask = ragged(4)
    got = A.whiten(rewards, mask)
    valid = rewards[mask].numpy()
    expected = (valid - valid.mean()) / np.sqrt(valid.var(ddof=1) + 1e-8)
    np.testing.assert_allclose(got[mask].numpy(), expected, rtol=1e-12)
    assert (got[~mask] == 0).all()
    kept = A.whiten(rewards, mask, shift_mean=False)
    np.testing.assert_allclose(kept[mask].numpy(), expected + valid.mean(), rtol=1e-12)


def test_whiten_degenerate_cases_are_zero_not_nan():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    same = torch.full((2, 3), 0.1)  # the mean of 0.1s is not exactly 0.1 in floating point
    assert torch.equal(A.whiten(same, mask), torch.zeros(2, 3))
    one = torch.tensor([[3.0, 0, 0], [0, 0, 0]])
    single = torch.tensor([[True, False, False], [False, False, False]])
    assert torch.equal(A.whiten(one, single), torch.zeros(2, 3))
    assert torch.equal(A.whiten(one, torch.zeros_like(single)), torch.zeros(2, 3))


def _stats_close(got: A.WhitenStats, want: A.WhitenStats, rtol: float = 1e-12) -> None:
    for field, g, w in zip(A.WhitenStats._fields, got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=rtol, atol=0.0, msg=field)


def test_whiten_with_merged_halves_hand_case():
    # Shard a: 1, 3 (n 2, mean 2, M2 1 + 1 = 2); shard b: 4, 8 (n 2, mean 6, M2 4 + 4 = 8).
    # Whole: 1, 3, 4, 8: mean 4, deviations -3, -1, 0, 4, M2 9 + 1 + 0 + 16 = 26, var 26/3.
    # Merge: delta 4, mean 2 + 4 · 2/4 = 4, M2 2 + 8 + 16 · 2 · 2/4 = 26.
    xa, ma = torch.tensor([[1.0, 3.0]], dtype=F64), torch.tensor([[True, True]])
    xb, mb = torch.tensor([[4.0, 8.0, math.nan]], dtype=F64), torch.tensor([[True, True, False]])
    merged = A.merge_whiten_stats([A.whiten_stats(xa, ma), A.whiten_stats(xb, mb)])
    assert [float(v) for v in merged] == [4.0, 4.0, 26.0, 8.0, 1.0]
    s = math.sqrt(26 / 3)
    got_a = A.whiten(xa, ma, eps=0.0, stats=merged)
    got_b = A.whiten(xb, mb, eps=0.0, stats=merged)
    torch.testing.assert_close(got_a, torch.tensor([[-3 / s, -1 / s]], dtype=F64))
    torch.testing.assert_close(got_b, torch.tensor([[0.0, 4 / s, 0.0]], dtype=F64))
    kept = A.whiten(xb, mb, eps=0.0, shift_mean=False, stats=merged)
    torch.testing.assert_close(kept, torch.tensor([[4.0, 4 + 4 / s, 0.0]], dtype=F64))


@pytest.mark.parametrize("seed", [7, 8])
def test_whiten_with_merged_shards_equals_the_whole_batch(seed):
    x, _, mask = ragged(seed)
    whole = A.whiten(x, mask)
    cuts = [(0, 2), (2, 2), (2, 6)]  # the middle shard is empty
    parts = [A.whiten_stats(x[a:b], mask[a:b]) for a, b in cuts]
    merged = A.merge_whiten_stats(parts)
    _stats_close(merged, A.whiten_stats(x, mask))
    _stats_close(A.merge_whiten_stats(parts[::-1]), merged)
    valid = x[mask].numpy()
    assert float(merged.count) == valid.size
    np.testing.assert_allclose(float(merged.m2), ((valid - valid.mean()) ** 2).sum(), rtol=1e-12)
    for shift in (True, False):
        shards = torch.cat(
            [A.whiten(x[a:b], mask[a:b], shift_mean=shift, stats=merged) for a, b in cuts]
        )
        torch.testing.assert_close(
            shards, A.whiten(x, mask, shift_mean=shift), rtol=1e-12, atol=1e-12
        )
    # ... and not the same as whitening each shard on its own (what the statistics fix).
    alone = torch.cat([A.whiten(x[a:b], mask[a:b]) for a, b in cuts])
    assert (alone - whole).abs().max() > 0.05


def test_whiten_stats_given_are_the_same_bits_as_none():
    x, _, mask = ragged(9)
    for shift in (True, False):
        own = A.whiten(x, mask, shift_mean=shift, stats=A.whiten_stats(x, mask))
        assert torch.equal(own, A.whiten(x, mask, shift_mean=shift))
    x32 = torch.where(mask, x, 0.0).float()
    assert torch.equal(A.whiten(x32, mask, stats=A.whiten_stats(x32, mask)), A.whiten(x32, mask))


def test_merge_keeps_two_pass_accuracy_where_sums_of_squares_cancel():
    # Values near 1e9 with unit spread: sum x^2 ~ 5e19, so merging (n, sum x, sum x^2) loses M2
    # (~ n) to rounding; the centred merge keeps it.
    gen = torch.Generator().manual_seed(3)
    x = 1e9 + torch.randn(2, 24, generator=gen, dtype=F64)
    mask = torch.ones(2, 24, dtype=torch.bool)
    valid = x.flatten().numpy()
    exact = float(((valid - valid.mean()) ** 2).sum())
    parts = [A.whiten_stats(x[i : i + 1], mask[i : i + 1]) for i in range(2)]
    assert float(A.merge_whiten_stats(parts).m2) == pytest.approx(exact, rel=1e-6)
    n = sum(float(p.count) for p in parts)
    s = sum(float((x[i] ** 2).sum()) for i in range(2))
    naive = s - float(x.sum()) ** 2 / n
    assert abs(naive - exact) > 0.1 * exact  # the naive merge is wrong here


def test_whiten_with_merged_stats_degenerate_cases():
    mask = torch.ones(1, 3, dtype=torch.bool)
    tenth = torch.full((1, 3), 0.1)
    same = A.merge_whiten_stats([A.whiten_stats(tenth, mask)] * 2)
    assert torch.equal(A.whiten(tenth, mask, stats=same), torch.zeros(1, 3))
    # Constant within each shard but not across: a spread, the whole batch's.
    fifth = torch.full((1, 3), 0.2)
    two = A.merge_whiten_stats([A.whiten_stats(tenth, mask), A.whiten_stats(fifth, mask)])
    both = A.whiten(torch.cat([tenth, fifth]), torch.ones(2, 3, dtype=torch.bool))
    torch.testing.assert_close(A.whiten(tenth, mask, stats=two), both[:1])
    assert (both[:1] < -0.5).all()
    # One valid token in the whole batch, on the other shard: 0 here and there.
    one = torch.tensor([[3.0, 0.0, 0.0]])
    single = torch.tensor([[True, False, False]])
    nothing = torch.zeros(1, 3, dtype=torch.bool)
    lone = A.merge_whiten_stats([A.whiten_stats(one, nothing), A.whiten_stats(one, single)])
    assert float(lone.count) == 1 and float(lone.vmax) == float(lone.vmin) == 3.0
    assert torch.equal(A.whiten(one, single, stats=lone), torch.zeros(1, 3))
    assert torch.equal(A.whiten(one, nothing, stats=lone), torch.zeros(1, 3))


def test_whiten_stats_errors():
    x, _, mask = ragged(4)
    half = A.whiten_stats(x[:2], mask[:2])
    with pytest.raises(ValueError, match=r"stats describe \d+ valid tokens but mask holds"):
        A.whiten(x, mask, stats=half)
    with pytest.raises(TypeError, match="stats must be WhitenStats"):
        A.whiten(x, mask, stats=tuple(half))
    with pytest.raises(TypeError, match="non-empty sequence of WhitenStats"):
        A.merge_whiten_stats([])


def test_reinforce_pp_is_whitened_returns():
    rewards, _, mask = ragged(5)
    got = A.reinforce_pp(rewards, mask, gamma=0.9)
    g = [x for row in compact(rewards, mask) for x in naive_rtg(row, 0.9)]
    g = np.array(g)
    expected_rows = []
    i = 0
    for row in compact(rewards, mask):
        expected_rows.append(list((g[i : i + len(row)] - g.mean()) / np.sqrt(g.var(ddof=1) + 1e-8)))
        i += len(row)
    np.testing.assert_allclose(got.numpy(), scatter(expected_rows, mask), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Group estimators.


def test_group_relative_hand_each_std_mode():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    # mean 0.25, centred (0.75, -0.25, -0.25, -0.25)
    none = A.group_relative(r, 4, std="none")
    np.testing.assert_allclose(none.numpy(), [0.75, -0.25, -0.25, -0.25], rtol=1e-7)
    # sample std: sqrt((0.5625 + 3·0.0625) / 3) = sqrt(0.25) = 0.5 → (1.5, -0.5, -0.5, -0.5)
    sample = A.group_relative(r, 4, std="sample", eps=0.0)
    np.testing.assert_allclose(sample.numpy(), [1.5, -0.5, -0.5, -0.5], rtol=1e-7)
    # population std: sqrt(0.75 / 4) = 0.4330127 → 0.75/0.4330127 = 1.7320508, -0.25/0.433 = -0.5773503
    pop = A.group_relative(r, 4, std="population", eps=0.0)
    np.testing.assert_allclose(
        pop.numpy(), [1.7320508, -0.5773503, -0.5773503, -0.5773503], rtol=1e-6
    )
    # eps enters the denominator: 0.75 / (0.5 + 0.5) = 0.75
    np.testing.assert_allclose(A.group_relative(r, 4, eps=0.5).numpy(), [0.75, -0.25, -0.25, -0.25])


def test_group_relative_batch_scale_hand():
    # Two groups of 2: (1, 0) and (3, 3). Centred per group: (0.5, -0.5), (0, 0).
    # Batch sample std of (1, 0, 3, 3): mean 1.75, squares 0.5625 + 3.0625 + 1.5625 + 1.5625
    # = 6.75, / 3 = 2.25, std 1.5 → (0.5/1.5, -0.5/1.5, 0, 0) = (1/3, -1/3, 0, 0).
    r = torch.tensor([1.0, 0.0, 3.0, 3.0])
    got = A.group_relative(r, 2, scale="batch", eps=0.0)
    np.testing.assert_allclose(got.numpy(), [1 / 3, -1 / 3, 0, 0], rtol=1e-7)
    # Population: 6.75 / 4 = 1.6875, std 1.2990381 → 0.5 / 1.2990381 = 0.3849002
    got = A.group_relative(r, 2, std="population", scale="batch", eps=0.0)
    np.testing.assert_allclose(got.numpy(), [0.3849002, -0.3849002, 0, 0], rtol=1e-6)
    # Per group, the identical pair (3, 3) gets exactly 0 and the pair (1, 0) ±1/sqrt(2)·... :
    # sample std of (1, 0) = sqrt(0.5) = 0.7071068 → ±0.5 / 0.7071068 = ±0.7071068
    got = A.group_relative(r, 2, eps=0.0)
    np.testing.assert_allclose(got.numpy(), [0.7071068, -0.7071068, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("std", ["sample", "population", "none"])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_identical_rewards_give_exactly_zero(std, scale):
    r = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])  # 0.1·3/3 != 0.1 in floating point
    got = A.group_relative(r, 3, std=std, scale=scale, eps=0.0)
    assert torch.equal(got, torch.zeros(6))
    assert torch.equal(A.rloo(r, 3), torch.zeros(6))
    assert torch.equal(A.group_std(r, 3), torch.zeros(2))


def test_group_relative_matches_numpy():
    gen = torch.Generator().manual_seed(6)
    r = torch.randn(24, generator=gen, dtype=F64)
    g = r.numpy().reshape(-1, 8)
    for std, ddof in (("sample", 1), ("population", 0)):
        got = A.group_relative(r, 8, std=std)
        expected = (g - g.mean(1, keepdims=True)) / (g.std(1, ddof=ddof, keepdims=True) + 1e-6)
        np.testing.assert_allclose(got.numpy(), expected.ravel(), rtol=1e-12)
        got = A.group_relative(r, 8, std=std, scale="batch")
        expected = (g - g.mean(1, keepdims=True)) / (g.std(ddof=ddof) + 1e-6)
        np.testing.assert_allclose(got.numpy(), expected.ravel(), rtol=1e-12)
    np.testing.assert_allclose(A.group_std(r, 8).numpy(), g.std(1, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(A.group_std(r, 8, ddof=0).numpy(), g.std(1, ddof=0), rtol=1e-12)


def test_rloo_hand_and_definition():
    # (1, 0, 0, 0): A_0 = 1 - 0 = 1; A_i = 0 - (1 + 0 + 0)/3 = -1/3
    got = A.rloo(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    np.testing.assert_allclose(got.numpy(), [1.0, -1 / 3, -1 / 3, -1 / 3], rtol=1e-7)
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(15, generator=gen, dtype=F64)
    got = A.rloo(r, 5).numpy()
    g = r.numpy().reshape(-1, 5)
    loo = [[g[p, i] - np.mean(np.delete(g[p], i)) for i in range(5)] for p in range(3)]
    np.testing.assert_allclose(got, np.ravel(loo), rtol=1e-12, atol=1e-15)


def test_group_errors():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"group_size=1.*G >= 2"):
        A.group_relative(r, 1)
    with pytest.raises(ValueError, match="group_size=1"):
        A.rloo(r, 1)
    with pytest.raises(ValueError, match="groups of group_size=3"):
        A.group_relative(r, 3)
    with pytest.raises(ValueError, match="finite"):
        A.group_relative(torch.tensor([1.0, math.nan]), 2)
    with pytest.raises(TypeError, match=r"\[N\]"):
        A.group_relative(r.view(2, 2), 2)
    with pytest.raises(ValueError, match="std must be"):
        A.group_relative(r, 2, std="unbiased")
    with pytest.raises(ValueError, match="scale must be"):
        A.group_relative(r, 2, scale="global")


def test_token_errors():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"mask\.bool\(\)"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 3), mask.float(), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="values has shape"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        A.gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match=r"adv must be \[B\]"):
        A.broadcast_to_tokens(torch.zeros(3), mask)


def test_broadcast_to_tokens():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([1.5, -0.5], requires_grad=True)
    out = A.broadcast_to_tokens(adv, mask)
    assert out.tolist() == [[1.5, 1.5, 0.0], [-0.5, 0.0, 0.0]]
    out.sum().backward()
    assert adv.grad.tolist() == [2.0, 1.0]  # one per valid token


# ---------------------------------------------------------------------------------------------
# Peer: verl's core_algos.


@pytest.mark.peer
def test_matches_verl_gae():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    rewards, values, mask = ragged(8)
    # verl multiplies by the mask, so it needs finite values at masked tokens.
    rewards, values = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.7)):
        adv, ret = A.gae(rewards, values, mask, gamma=gamma, lam=lam)
        v_adv, v_ret = core_algos.compute_gae_advantage_return(
            rewards, values, mask.to(F64), gamma, lam
        )
        # verl whitens its advantages inside; klpo keeps that a separate step. verl's masked_mean
        # divides by (n + 1e-8), a relative difference of about 1e-8 / n in the statistics.
        torch.testing.assert_close(A.whiten(adv, mask)[mask], v_adv[mask], rtol=1e-7, atol=1e-8)
        torch.testing.assert_close(ret[mask], v_ret[mask], rtol=1e-12, atol=1e-12)


@pytest.mark.peer
def test_matches_verl_group_estimators():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    gen = torch.Generator().manual_seed(9)
    scores = torch.randint(0, 3, (24,), generator=gen).to(F64)  # ties and identical groups
    scores[:4] = 1.0
    mask = torch.ones(24, 5, dtype=torch.bool)
    mask[3, 2:] = False
    token_rewards = torch.zeros(24, 5, dtype=F64)
    last = mask.sum(-1) - 1
    token_rewards[torch.arange(24), last] = scores
    index = np.repeat(np.arange(6), 4)
    for norm, std in ((True, "sample"), (False, "none")):
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            token_rewards.clone(), mask.to(F64), index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm
        )
        ours = A.broadcast_to_tokens(A.group_relative(scores, 4, std=std), mask)
        # verl divides (r - mean) by (std + eps) even for identical groups, where r - mean is
        # rounding noise (here exactly 0 for 1.0s): klpo forces exactly 0 there.
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    theirs, _ = core_algos.compute_rloo_outcome_advantage(
        token_rewards.clone(), mask.to(F64), index
    )
    torch.testing.assert_close(
        A.broadcast_to_tokens(A.rloo(scores, 4), mask), theirs, rtol=1e-12, atol=1e-12
    )


@pytest.mark.peer
def test_matches_verl_reinforce_pp():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    rewards, _, mask = ragged(10)
    rewards = torch.where(mask, rewards, 0.0)

    class Config:
        gamma = 0.9

    theirs, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        rewards, mask.to(F64), config=Config()
    )
    ours = A.reinforce_pp(rewards, mask, gamma=0.9)
    # verl's masked_mean divides by (n + 1e-8): a relative difference of about 1e-8 / n.
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-8)


# ---------------------------------------------------------------------------------------------
# Group estimators over the valid (scored) sequences only.


def _naive_valid(r: np.ndarray, v: np.ndarray, g: int, std: str, scale: str, eps: float):
    """The definition, one group at a time in float64: statistics of the valid entries only."""
    out = np.zeros(len(r))
    kept = r[v]
    ddof = {"sample": 1, "population": 0, "none": None}[std]
    for p in range(len(r) // g):
        idx = [i for i in range(p * g, (p + 1) * g) if v[i]]
        vals = r[idx]
        if len(vals) < 2 or np.all(vals == vals[0]):
            continue
        centred = vals - vals.mean()
        if ddof is None:
            s = None
        elif scale == "group":
            s = vals.std(ddof=ddof)
        else:
            s = kept.std(ddof=ddof)
        out[idx] = centred if s is None else centred / (s + eps)
    return out


def test_group_relative_valid_hand():
    # (1, 0, x, 0) with the third unscored: mean of (1, 0, 0) = 1/3 → (2/3, -1/3, 0, -1/3);
    # sample std of (1, 0, 0) = sqrt((4/9 + 1/9 + 1/9) / 2) = sqrt(1/3) = 0.5773503
    # → (2/3, -1/3) / 0.5773503 = (1.1547005, -0.5773503)
    r = torch.tensor([1.0, 0.0, math.nan, 0.0])
    v = torch.tensor([True, True, False, True])
    got = A.group_relative(r, 4, std="none", valid=v)
    np.testing.assert_allclose(got.numpy(), [2 / 3, -1 / 3, 0, -1 / 3], rtol=1e-7)
    got = A.group_relative(r, 4, eps=0.0, valid=v)
    np.testing.assert_allclose(got.numpy(), [1.1547005, -0.5773503, 0, -0.5773503], rtol=1e-6)
    # RLOO: A_0 = 1 - (0 + 0)/2 = 1; A_1 = 0 - (1 + 0)/2 = -1/2; A_3 the same; A_2 = 0
    np.testing.assert_allclose(A.rloo(r, 4, valid=v).numpy(), [1, -0.5, 0, -0.5], rtol=1e-7)
    # group std of (1, 0, 0), ddof 1: sqrt(1/3)
    np.testing.assert_allclose(A.group_std(r, 4, valid=v).numpy(), [0.5773503], rtol=1e-6)
    # One valid reward in a group: no baseline, zeros (never NaN), under every estimator
    one = torch.tensor([True, False, False, False])
    assert torch.equal(A.group_relative(r, 4, valid=one), torch.zeros(4))
    assert torch.equal(A.rloo(r, 4, valid=one), torch.zeros(4))
    assert torch.equal(A.group_std(r, 4, valid=one), torch.zeros(1))


@pytest.mark.parametrize("std", ["sample", "population", "none"])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_relative_valid_matches_naive_and_subset(std, scale):
    gen = torch.Generator().manual_seed(11)
    r = torch.randn(40, generator=gen, dtype=F64)
    v = torch.rand(40, generator=gen) < 0.7
    r_nan = torch.where(v, r, math.nan)  # unscored values never enter the result
    got = A.group_relative(r_nan, 8, std=std, scale=scale, valid=v)
    want = _naive_valid(r.numpy(), v.numpy(), 8, std, scale, 1e-6)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-15)
    # Masking equals taking the subset: groups with 3 valid of 4 against groups of 3.
    v3 = torch.tensor([True, False, True, True] * 10)
    got = A.group_relative(r, 4, std=std, scale=scale, valid=v3)[v3]
    subset = A.group_relative(r[v3], 3, std=std, scale=scale)
    np.testing.assert_allclose(got.numpy(), subset.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(
        A.rloo(r, 4, valid=v3)[v3].numpy(), A.rloo(r[v3], 3).numpy(), rtol=1e-12, atol=1e-15
    )
    np.testing.assert_allclose(
        A.group_std(r, 4, valid=v3).numpy(), A.group_std(r[v3], 3).numpy(), rtol=1e-12
    )
    # All valid: the plain estimators' values.
    all_v = torch.ones(40, dtype=torch.bool)
    np.testing.assert_allclose(
        A.group_relative(r, 8, std=std, scale=scale, valid=all_v).numpy(),
        A.group_relative(r, 8, std=std, scale=scale).numpy(),
        rtol=1e-12,
        atol=1e-15,
    )


def test_rloo_valid_matches_leave_one_out_definition():
    gen = torch.Generator().manual_seed(12)
    r = torch.randn(30, generator=gen, dtype=F64)
    v = torch.rand(30, generator=gen) < 0.6
    got = A.rloo(torch.where(v, r, math.inf), 5, valid=v).numpy()
    want = np.zeros(30)
    for i in range(30):
        p = i // 5
        others = [r[j].item() for j in range(p * 5, p * 5 + 5) if j != i and v[j]]
        if v[i] and others:
            want[i] = r[i].item() - np.mean(others)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_valid_errors():
    r = torch.tensor([1.0, math.nan, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"non-finite at indices \[1\]"):
        A.group_relative(r, 2, valid=torch.tensor([True, True, False, True]))
    with pytest.raises(TypeError, match=r"valid must be a \[N\] = \[4\] bool tensor"):
        A.rloo(r, 2, valid=torch.ones(4))
