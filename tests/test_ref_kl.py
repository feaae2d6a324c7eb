"""klpo.ref_kl: ref_is, its weights' diagnostics, adaptive_mix's weight and window; explain."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from klpo import kl, ref_kl
from klpo.cli import app


def test_ref_is_hand_computed_value_and_gradient():
    # pi_theta = (1/2, 1/2), pi_ref = (1/4, 3/4): w = (2, 2/3). Samples x = (0, 1):
    # mean(w log w) = (2 ln 2 + (2/3) ln(2/3)) / 2 = (1.3862944 - 0.2703101) / 2 = 0.5579921.
    logp = torch.tensor([0.5, 0.5], dtype=torch.float64).log().requires_grad_(True)
    logp_ref = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    value = ref_kl.ref_is(logp, logp_ref)
    assert float(value.detach()) == pytest.approx(0.5579921, abs=1e-7)
    # d/d logp_i of mean(w log w) = w_i (1 + log w_i) / 2: (2 (1 + ln 2), (2/3)(1 + ln 2/3)) / 2
    value.backward()
    want = torch.tensor([1 + math.log(2), (1 + math.log(2 / 3)) / 3], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want)


def test_clip_self_normalised_and_dynamic_clip():
    logp = torch.tensor([0.5, 0.5], dtype=torch.float64).log().requires_grad_(True)
    logp_ref = torch.tensor([0.25, 0.75], dtype=torch.float64).log()
    # clip [0.1, 1.5]: w = (1.5, 2/3): (1.5 ln 2 + (2/3) ln(2/3)) / 2; no gradient through w at 0:
    # d/d logp_0 = clamp(w_0) · 1 / 2 = 0.75.
    v = ref_kl.ref_is(logp, logp_ref, clip=(0.1, 1.5))
    assert float(v.detach()) == pytest.approx((1.5 * math.log(2) + 2 / 3 * math.log(2 / 3)) / 2)
    v.backward()
    assert float(logp.grad[0]) == pytest.approx(0.75)
    # self-normalised: sum w log w / sum w = (2 ln 2 + (2/3) ln(2/3)) / (8/3)
    sn = ref_kl.ref_is(logp.detach(), logp_ref, self_normalised=True)
    assert float(sn) == pytest.approx((2 * math.log(2) + 2 / 3 * math.log(2 / 3)) / (8 / 3))
    # dynamic clip with two samples never bites (mean ± 3 sd spans both)
    dyn = ref_kl.ref_is(logp.detach(), logp_ref, dynamic_clip=True)
    assert float(dyn) == pytest.approx(0.5579921, abs=1e-7)
    with pytest.raises(ValueError, match="0 <= lo < hi"):
        ref_kl.ref_is(logp, logp_ref, clip=(2.0, 1.0))


def test_weight_diagnostics():
    # w = (2, 2/3): ESS = (8/3)² / (2 (4 + 4/9)) = (64/9) / (80/9) = 0.8
    d = ref_kl.weight_diagnostics(torch.tensor([0.5, 0.5]).log(), torch.tensor([0.25, 0.75]).log())
    assert d["max_weight"] == pytest.approx(2.0) and d["ess"] == pytest.approx(0.8)
    # one huge weight: ESS → 1/n, computed without overflow
    d = ref_kl.weight_diagnostics(torch.tensor([500.0, 0.0, 0.0, 0.0]), torch.zeros(4))
    assert d["ess"] == pytest.approx(0.25) and d["max_weight"] == math.inf


def test_mix_weight_signs_agree_with_the_lab():
    from klpo.lab.ref_is import AdaptiveMix

    for x in (0.0, 0.05, 0.3, 2.0):
        w = ref_kl.mix_weight(x, gamma=10, threshold=0.5, sign="as-written")
        d = ref_kl.mix_weight(x, gamma=10, threshold=0.5, sign="as-described")
        assert w == pytest.approx(AdaptiveMix(gamma=10, threshold=0.5).weight(x), rel=1e-12)
        assert d == pytest.approx(AdaptiveMix(gamma=-10, threshold=0.5).weight(x), rel=1e-12)
        assert w + d == pytest.approx(1.0)
    assert ref_kl.mix_weight(0.0, gamma=10, threshold=0.5, sign="as-written") < 0.5  # k1 small
    with pytest.raises(ValueError, match="gamma must be > 0"):
        ref_kl.mix_weight(0.0, gamma=-1, threshold=0.5, sign="as-written")


def test_mix_window_follows_the_labs_stream():
    from klpo.lab.ref_is import AdaptiveMix, AdaptiveMixStream

    gen = torch.Generator().manual_seed(3)
    k1s = torch.rand(12, generator=gen, dtype=torch.float64)
    ris = torch.rand(12, generator=gen, dtype=torch.float64)
    a_lab, mix_lab = AdaptiveMixStream(AdaptiveMix(gamma=-8, threshold=0.4, window=3)).step(
        k1s, ris
    )
    window = ref_kl.MixWindow(gamma=8, threshold=0.4, window=3, sign="as-described")
    for i in range(12):
        a = window.weight()
        assert a == pytest.approx(float(a_lab[i]), rel=1e-10)
        window.push(a * float(k1s[i]) + (1 - a) * float(ris[i]))
        assert window.values[-1] == pytest.approx(float(mix_lab[i]), rel=1e-10)
    again = ref_kl.MixWindow(gamma=8, threshold=0.4, window=3, sign="as-described")
    again.load_state_dict(window.state_dict())
    assert again.weight() == window.weight()


def test_explain_derives_ref_sampled_estimators():
    e = kl.explain("ref_is", "loss")
    assert e.unbiased and not e.nonnegative and e.gradient == kl.GRAD_THETA_REF
    m = kl.explain("adaptive_mix", "loss")
    assert m.unbiased and m.gradient == kl.GRAD_THETA_REF and not m.mismatch
    assert not set(kl.REF_SAMPLED) & set(kl.ESTIMATORS)
    for name in kl.REF_SAMPLED:
        assert kl.refusal(name, "loss") is None
        with pytest.raises(ValueError, match="no policy-gradient term"):
            kl.explain(name, "reward")
    assert kl.refusal("k1", "reward") is None


def test_cli_explain_shows_the_loss_and_the_refusal():
    runner = CliRunner()
    out = runner.invoke(app, ["explain", "-e", "ref_is"])
    assert out.exit_code == 0 and "samples from pi_ref" in out.output
    assert "ref_is in the loss" in out.output and "in the reward" not in out.output
    out = runner.invoke(app, ["explain", "-e", "adaptive_mix", "-p", "reward"])
    assert out.exit_code != 0 and "no policy-gradient" in out.output
