"""Tests for klpo.control: hand-picked updates with the arithmetic, state round trips, errors."""

from __future__ import annotations

import itertools
import math

import pytest

from klpo import control as C


def test_fixed():
    c = C.FixedKL(0.05)
    assert c.update(kl=100.0, n_steps=64, reward_std=3.0) == 0.05
    assert c.value == 0.05
    assert C.FixedKL(0.0).value == 0.0  # beta = 0 is a valid "no KL"


def test_ziegler_adaptive_hand():
    # The research note's oracle (literature-kl.md §10.4): beta 0.2, target 6, horizon 10000, n 64.
    cases = [
        (9.0, 0.200256),  # e = clip(9/6 - 1 = 0.5) = 0.2;  0.2·(1 + 0.2·64/10000) = 0.2·1.00128
        (3.0, 0.199744),  # e = clip(-0.5) = -0.2;          0.2·(1 - 0.00128)
        (6.6, 0.200128),  # e = 0.1 (inside the clip);      0.2·(1 + 0.1·0.0064) = 0.2·1.00064
        (6.0, 0.2),  # on target: unchanged
    ]
    for kl, expected in cases:
        c = C.AdaptiveKL(0.2, target=6.0, horizon=10000)
        assert c.update(kl=kl, n_steps=64) == pytest.approx(expected, rel=1e-12)
    # Ziegler et al. 2019 (arXiv:1909.08593) eq. 2, error clipped to ±0.2: KL = 2·target with
    # n_steps = horizon multiplies by 1 + 0.2 = 1.2; KL = 0 by 1 - 0.2 = 0.8
    c = C.AdaptiveKL(1.0, target=0.1, horizon=100)
    assert c.update(kl=0.2, n_steps=100) == pytest.approx(1.2, rel=1e-12)
    assert c.update(kl=0.0, n_steps=100) == pytest.approx(1.2 * 0.8, rel=1e-12)


def test_ziegler_adaptive_steers_toward_target():
    """KL falls as beta rises (kl = 0.6 / beta here): the controller settles where kl = target."""
    c = C.AdaptiveKL(0.05, target=6.0, horizon=1000)
    for _ in range(3000):
        c.update(kl=0.6 / c.value, n_steps=64)
    assert 0.6 / c.value == pytest.approx(6.0, rel=0.02)


def test_ppo_adaptive_hand():
    # PPO §4 with d_targ = 0.01: below 0.01/1.5 = 0.006667 halve; above 0.015 double; else keep.
    for kl, expected in [(0.005, 0.5), (0.02, 2.0), (0.012, 1.0), (0.015, 1.0), (0.01 / 1.5, 1.0)]:
        c = C.PPOAdaptiveKL(1.0, target=0.01)
        assert c.update(kl=kl) == expected, kl
    c = C.PPOAdaptiveKL(1.0, target=0.01, tolerance=2.0, factor=3.0)
    assert c.update(kl=0.0049) == pytest.approx(1 / 3)  # 0.0049 < 0.01/2 → beta/3
    assert c.update(kl=0.021) == pytest.approx(1.0)  # 0.021 > 0.01·2 → ·3


def test_spread_scaled_hand():
    c = C.SpreadScaledKL(0.04, scale=0.5)
    assert c.value == 0.04  # before any update: beta0
    assert c.update(reward_std=0.0) == 0.04  # no spread: 0.04 / (1 + 0)
    assert c.update(reward_std=0.5) == pytest.approx(0.02)  # 0.04 / (1 + 1)
    assert c.update(reward_std=1.5) == pytest.approx(0.01)  # 0.04 / (1 + 3)
    big = c.update(reward_std=500.0)  # 0.04 / 1001: beta·std → beta0·scale = 0.02
    assert big > 0 and big * 500.0 == pytest.approx(0.02, rel=1e-2)
    values = [
        C.SpreadScaledKL(1.0, scale=1.0).update(reward_std=s) for s in (0, 0.1, 0.5, 1, 2, 10)
    ]
    assert all(a > b for a, b in itertools.pairwise(values))  # strictly decreasing


@pytest.mark.parametrize("name", list(C.CONTROLLERS))
def test_state_dict_round_trip_resumes_exactly(name):
    kwargs = {
        "fixed": {"beta": 0.1},
        "adaptive": {"beta": 0.1, "target": 0.5, "horizon": 100},
        "ppo-adaptive": {"beta": 0.1, "target": 0.5},
        "spread-scaled": {"beta": 0.1, "scale": 0.5},
    }[name]
    stats = [dict(kl=k, n_steps=8, reward_std=s) for k, s in [(0.1, 0.2), (2.0, 0.7), (0.6, 0.0)]]
    a = C.make_controller(name, **kwargs)
    a.update(**stats[0])
    state = a.state_dict()
    assert state["name"] == name and isinstance(state["value"], float)
    b = C.make_controller(name, **kwargs)
    b.load_state_dict(dict(state))
    for s in stats[1:]:
        assert a.update(**s) == b.update(**s)


def test_load_state_dict_errors():
    c = C.AdaptiveKL(0.1, target=1.0)
    with pytest.raises(ValueError, match="'fixed' controller, not 'adaptive'"):
        c.load_state_dict({"name": "fixed", "value": 0.3})
    with pytest.raises(ValueError, match="'name' and 'value'"):
        c.load_state_dict({"value": 0.3})
    with pytest.raises(ValueError, match="finite"):
        c.load_state_dict({"name": "adaptive", "value": math.nan})


def test_update_errors():
    with pytest.raises(ValueError, match=r"update\(kl=\.\.\.\)"):
        C.AdaptiveKL(0.1, target=1.0).update(n_steps=3)
    with pytest.raises(ValueError, match=r"update\(kl=\.\.\.\)"):
        C.PPOAdaptiveKL(0.1, target=1.0).update()
    with pytest.raises(ValueError, match=r"reward_std=\.\.\."):
        C.SpreadScaledKL(0.1, scale=1.0).update(kl=0.3)
    with pytest.raises(ValueError, match="multiplier"):
        C.AdaptiveKL(0.1, target=1.0, horizon=10).update(kl=0.0, n_steps=60)  # 1 - 0.2·6 < 0
    with pytest.raises(ValueError, match="finite"):
        C.AdaptiveKL(0.1, target=1.0).update(kl=math.inf)
    with pytest.raises(ValueError, match="reward_std must be >= 0"):
        C.SpreadScaledKL(0.1, scale=1.0).update(reward_std=-1.0)


def test_constructor_and_factory_errors():
    with pytest.raises(ValueError, match="target must be > 0"):
        C.AdaptiveKL(0.1, target=0.0)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        C.AdaptiveKL(0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError, match="beta must be > 0"):
        C.PPOAdaptiveKL(0.0, target=1.0)  # a multiplicative rule would stay at 0 forever
    with pytest.raises(ValueError, match="tolerance must be > 1"):
        C.PPOAdaptiveKL(0.1, target=1.0, tolerance=1.0)
    with pytest.raises(ValueError, match="beta must be >= 0"):
        C.FixedKL(-0.1)
    with pytest.raises(
        ValueError, match="choose one of: fixed, adaptive, ppo-adaptive, spread-scaled"
    ):
        C.make_controller("pid", beta=0.1)
    with pytest.raises(ValueError, match=r"'adaptive' takes beta, target, horizon"):
        C.make_controller("adaptive", beta=0.1, target=1.0, horizn=10)
    with pytest.raises(ValueError, match=r"'spread-scaled' takes beta, scale"):
        C.make_controller("spread-scaled", beta=0.1)
    assert isinstance(C.make_controller("ppo-adaptive", beta=1.0, target=0.01), C.PPOAdaptiveKL)


@pytest.mark.peer
def test_matches_verl_adaptive_controller():
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    ours = C.AdaptiveKL(0.2, target=6.0, horizon=10000)
    theirs = core_algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    for kl in [9.0, 3.0, 6.6, 0.0, 12.0, 5.9, 6.1]:
        ours.update(kl=kl, n_steps=64)
        theirs.update(kl, 64)
        assert ours.value == pytest.approx(float(theirs.value), rel=1e-15)
