"""An estimator is added in one place, ``klpo.kl.SPECS``, and every layer knows it.

The made-up estimator ``k1x2`` is twice k1 (value 2d, gradient 2 grad logp), registered with one
``monkeypatch.setitem``. Each layer is checked against what twice k1 must give by hand: the lab's
exact and Gaussian values are twice k1's, the trainer's config takes it and a step logs
``kl/ref/k1x2 = 2 kl/ref/k1``, ``klpo explain`` derives its gradients, and the doctor reads it in
a verl config and proposes its registered loss variant.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from klpo import kl, losses
from klpo.cli import app

NAME = "k1x2"


def twice_k1(logp, logp_ref):
    """2 · (logp - logp_ref): a made-up estimator for this test."""
    return kl.k1(logp, logp_ref) * 2.0


SPEC = kl.Spec(twice_k1, kl.THETA_REF, "2d", "weighted", "k1+")


@pytest.fixture
def k1x2(monkeypatch):
    """``k1x2`` registered for one test: the one line an estimator needs beside its function."""
    monkeypatch.setitem(kl.SPECS, NAME, SPEC)
    return NAME


def test_the_library_knows_it(k1x2):
    assert k1x2 in kl.ESTIMATORS and k1x2 in kl.LOGPROB_ESTIMATORS and k1x2 not in kl.REF_SAMPLED
    logp, logp_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    torch.testing.assert_close(kl.estimate(k1x2, logp, logp_ref), torch.tensor([[1.0, -2.0]]))
    # kl_loss follows the spec's off-policy rule, "weighted": sg(w) = pi_theta/pi_old = 2 doubles it.
    off = losses.kl_loss(k1x2, logp, logp_ref, logp_old=logp - math.log(2.0))
    torch.testing.assert_close(off, torch.tensor([[2.0, -4.0]]))
    # explain derives it: E[2d] = 2 KL (biased); in the loss E[2 grad logp] = 0; in the reward
    # 2 grad KL, which is no KL's gradient.
    loss, reward = kl.explain(k1x2, "loss"), kl.explain(k1x2, "reward")
    assert (loss.unbiased, loss.nonnegative, loss.gradient) == (False, False, kl.GRAD_ZERO)
    assert reward.gradient == kl.GRAD_OTHER and reward.equation == "2d"
    assert [e.estimator for e in kl.explain_all()].count(k1x2) == len(kl.PLACEMENTS)


def test_the_lab_knows_it(k1x2):
    from klpo.lab import GAUSSIAN_ESTIMATORS, LAB_ESTIMATORS, gaussian_monte_carlo
    from klpo.lab.distributions import SequencePair, num_prefixes
    from klpo.lab.exact import analyse, gaussian_quadrature, placements_of

    assert k1x2 in LAB_ESTIMATORS and k1x2 in GAUSSIAN_ESTIMATORS
    assert placements_of(k1x2) == kl.PLACEMENTS
    # N(0, 1) vs N(mu, 1): d ~ N(mu²/2, mu²), so 2d has mean mu² and variance 4 mu².
    mu = 0.7
    mean, var, _ = gaussian_quadrature(k1x2, mu)
    assert mean == pytest.approx(mu * mu, rel=1e-9) and var == pytest.approx(4 * mu * mu, rel=1e-9)
    mc = gaussian_monte_carlo(mu, 4096, names=("k1", k1x2), seed=3)
    assert mc[k1x2].mean == pytest.approx(2 * mc["k1"].mean, rel=1e-6)
    # Exact enumeration of a small sequence model: values and every placement's gradient double.
    gen = torch.Generator().manual_seed(0)
    shape = (num_prefixes(3, 2), 3)
    logits, logits_ref = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in "ab")
    pair = SequencePair(logits, logits_ref, vocab=3, length=2)
    res = analyse(pair, ("k1", k1x2))
    assert res.values[k1x2].mean == pytest.approx(2 * res.values["k1"].mean, rel=1e-9)
    for p in kl.PLACEMENTS:
        torch.testing.assert_close(res.gradients[k1x2][p], 2 * res.gradients["k1"][p])


def test_klpo_explain_knows_it(k1x2):
    result = CliRunner().invoke(app, ["explain", "-e", k1x2, "-p", "loss"])
    assert result.exit_code == 0, result.output
    assert f"{k1x2} in the loss" in result.output and "value:    2d" in result.output
    assert "zero in expectation" in result.output
    listed = CliRunner().invoke(app, ["explain", "--all", "--json"])
    assert listed.exit_code == 0, listed.output
    assert {r["placement"] for r in json.loads(listed.output) if r["estimator"] == k1x2} == set(
        kl.PLACEMENTS
    )


def test_the_doctor_knows_it(k1x2, tmp_path):
    from klpo.doctor import diagnose
    from klpo.doctor.advice import intended_in_loss
    from klpo.measure import ESTIMATORS as MEASURED

    assert intended_in_loss(k1x2) == "k1+" and k1x2 in MEASURED
    cfg = tmp_path / "v.yaml"
    cfg.write_text(
        f"actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_type: klpo:{k1x2}\n"
    )
    d = diagnose(cfg, framework="verl")
    assert [(t["estimator"], t["placement"]) for t in d["terms"]] == [(k1x2, "loss")]
    assert d["terms"][0]["on_policy"]["gradient"] == kl.GRAD_ZERO
    assert d["equivalent"]["config"]["kl"]["estimator"] == k1x2
    assert d["equivalent"]["invalid"] is None  # klpo train's config takes it
    assert d["intended"]["config"]["kl"]["estimator"] == "k1+"


def test_the_trainer_knows_it(k1x2, tiny_model, quick, tmp_path):
    from klpo.train import loop
    from klpo.train.config import build_config
    from klpo.train.runtime.metrics import read_metrics

    out = tmp_path / "run"
    extra = {"run.steps": 1, "run.eval_every": 0, "kl.estimator": k1x2}
    cfg = build_config(overrides=quick(tiny_model, out, **{**extra, "kl.placement": "loss"}))
    assert cfg.kl.estimator == k1x2
    loop.train(cfg, log=lambda *_: None)
    last = read_metrics(out / "metrics.jsonl")[-1]
    # The sampling pass logs the configured estimator beside k1: twice k1, token for token.
    assert last[f"kl/ref/{k1x2}"] == pytest.approx(2 * last["kl/ref/k1"], rel=1e-5, abs=1e-7)
    assert math.isfinite(last["loss/kl"])
    report = (out / "report.md").read_text()
    assert f"kl/ref/{k1x2}" in report


@pytest.mark.parametrize("name", list(kl.SPECS))
def test_the_doctor_proposes_each_estimators_registered_loss_variant(name, tmp_path):
    """A klpo config with each estimator in the loss: the intended config is the registry's
    ``loss_variant``, never a default (``ref_is`` and ``adaptive_mix`` keep themselves)."""
    from klpo.doctor import diagnose

    cfg = tmp_path / "klpo.yaml"
    cfg.write_text(f"kl:\n  estimator: {name}\n  placement: loss\n  beta: 0.1\n")
    d = diagnose(cfg, framework="klpo")
    assert [t["estimator"] for t in d["terms"]] == [name]
    assert d["intended"]["config"]["kl"]["estimator"] == kl.SPECS[name].loss_variant
    assert d["intended"]["invalid"] is None
