"""kl.target_unit (what a controller's budget measures) and kl.off_policy_correction, end to end."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

from klpo import losses
from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.runtime.metrics import read_metrics


def _train(quick, model, out, **extra):
    cfg = build_config(overrides=quick(model, out, **{"run.eval_every": 0, **extra}))
    loop.train(cfg, log=lambda *_: None)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize(("unit", "key"), [("token", "kl/ref/exact"), ("sequence", "kl/ref/seq")])
def test_adaptive_controller_steers_on_the_kl_of_its_unit(tiny_model, quick, tmp_path, unit, key):
    """Ziegler et al.'s update by hand, beta_{s+1} = beta_s (1 + clip(KL_s / target - 1, ±0.2)
    n / horizon) with n = 16 completions a step, fed the KL that kl.target_unit names."""
    target, horizon, beta0 = 0.05, 40.0, 0.1
    rows = _train(
        quick,
        tiny_model,
        tmp_path / unit,
        **{
            "run.steps": 4,
            "kl.controller": "adaptive",
            "kl.target": target,
            "kl.target_unit": unit,
            "kl.horizon": horizon,
            "kl.beta": beta0,
        },
    )
    rows = [r for r in rows if "beta" in r]
    assert rows[0]["beta"] == pytest.approx(beta0)
    for prev, nxt in itertools.pairwise(rows):
        err = min(max(prev[key] / target - 1.0, -0.2), 0.2)
        assert nxt["beta"] == pytest.approx(prev["beta"] * (1 + err * 16 / horizon), rel=1e-9)
    # the two units differ here (completions are several tokens long), so the test tells them apart
    assert any(abs(r["kl/ref/seq"] - r["kl/ref/exact"]) > 1e-3 for r in rows)


def test_off_policy_correction_reaches_kl_loss(tiny_model, quick, tmp_path, monkeypatch):
    """With the correction the KL term gets the sampling policy's log-probs (its weight
    sg(pi_theta / pi_old)); without it, none (weight 1, the uncorrected term)."""
    seen: list[bool] = []
    real = losses.kl_loss

    def spy(*args, **kwargs):
        seen.append(kwargs.get("logp_old") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(losses, "kl_loss", spy)
    off = {"run.steps": 1, "algo.epochs": 2, "algo.minibatches": 2, "kl.estimator": "k3"}
    _train(quick, tiny_model, tmp_path / "on", **off)
    assert seen and all(seen)
    seen.clear()
    _train(quick, tiny_model, tmp_path / "off", **off, **{"kl.off_policy_correction": False})
    assert seen and not any(seen)


def _params(run_dir):
    (ckpt,) = sorted((run_dir / "checkpoints").glob("step_*"))
    return load_file(next(ckpt.rglob("model.safetensors")))


def test_off_policy_correction_changes_nothing_on_policy_and_something_off_policy(
    tiny_model, quick, tmp_path
):
    """One epoch, one minibatch: pi_theta = pi_old in the only update, the weight is exactly 1
    and the two runs end bit-identical. Two epochs x two minibatches: they differ."""
    for name, algo in (("on", {}), ("off", {"algo.epochs": 2, "algo.minibatches": 2})):
        ends = []
        for corrected in (True, False):
            out = tmp_path / f"{name}-{corrected}"
            extra = {"run.steps": 2, "kl.estimator": "k3", "kl.beta": 1.0, **algo}
            _train(quick, tiny_model, out, **extra, **{"kl.off_policy_correction": corrected})
            ends.append(_params(out))
        same = all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
        assert same == (name == "on"), name


def test_k3_is_refuses_to_be_uncorrected():
    with pytest.raises(ConfigError, match="has no uncorrected form"):
        build_config(overrides=["kl.estimator=k3_is", "kl.off_policy_correction=false"])
