"""Tests for klpo.lab.ref_is: ref_is (the "K2" of docs/claims.md) and adaptive_mix (its "K3")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo.lab.ref_is import AdaptiveMix, AdaptiveMixStream, adaptive_mix, ref_is, ref_is_terms


def test_ref_is_terms_by_hand():
    # pi_theta(x) = 0.5, pi_ref(x) = 0.25: w = 2, w log w = 2 ln 2 = 1.3862944
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    logp_ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    assert ref_is_terms(logp, logp_ref).item() == pytest.approx(2 * math.log(2), rel=1e-14)
    # clip [0.1, 1.5]: clamp(2) = 1.5, so 1.5 ln 2 = 1.0397208
    assert ref_is_terms(logp, logp_ref, clip=(0.1, 1.5)).item() == pytest.approx(1.5 * math.log(2))
    with pytest.raises(ValueError, match="clip"):
        ref_is_terms(logp, logp_ref, clip=(2.0, 1.0))


def test_ref_is_is_unbiased_over_the_reference():
    # Exact expectation over x ~ pi_ref, in numpy: sum_x pi_ref (pi/pi_ref) log(pi/pi_ref) = KL(pi ‖ ref).
    pi, pr = np.array([0.7, 0.2, 0.1]), np.array([0.5, 0.3, 0.2])
    values = ref_is_terms(torch.tensor(np.log(pi)), torch.tensor(np.log(pr))).numpy()
    assert float(np.sum(pr * values)) == pytest.approx(
        float(np.sum(pi * np.log(pi / pr))), abs=1e-15
    )


def test_ref_is_gradient_is_w_times_one_plus_log_w_and_zero_where_clipped():
    logp = torch.tensor([-0.2, -1.0, -3.0], dtype=torch.float64, requires_grad=True)
    logp_ref = torch.tensor([-1.0, -1.1, -0.5], dtype=torch.float64)
    (g,) = torch.autograd.grad(ref_is_terms(logp, logp_ref).sum(), logp)
    log_w = (logp - logp_ref).detach()
    torch.testing.assert_close(g, log_w.exp() * (1 + log_w))  # d(w log w)/d log w = w (1 + log w)
    # clip [0.5, 2]: w = (e^0.8 = 2.2255 clipped to 2, e^0.1 = 1.105 inside, e^-2.5 = 0.082 clipped)
    (g,) = torch.autograd.grad(ref_is_terms(logp, logp_ref, clip=(0.5, 2.0)).sum(), logp)
    w = log_w.exp()
    expected = torch.tensor([2.0, float(w[1] * (1 + log_w[1])), 0.5], dtype=torch.float64)
    torch.testing.assert_close(g, expected)
    assert torch.autograd.gradcheck(lambda x: ref_is_terms(x, logp_ref), (logp,))


def test_batch_variants_by_hand():
    # Weights (w) of four samples and their logs: w = (1, 2, 4, 0.5)
    w = torch.tensor([[1.0, 2.0, 4.0, 0.5]], dtype=torch.float64)
    logp, logp_ref = w.log(), torch.zeros_like(w)
    # plain: mean(w log w) = (0 + 2 ln2 + 4 ln4 - 0.5 ln2) / 4 = (2 + 8 - 0.5) ln2 / 4 = 9.5 ln2 / 4
    assert ref_is(logp, logp_ref).item() == pytest.approx(9.5 * math.log(2) / 4)
    # self-normalised: 9.5 ln2 / (1 + 2 + 4 + 0.5) = 9.5 ln2 / 7.5
    assert ref_is(logp, logp_ref, self_normalised=True).item() == pytest.approx(
        9.5 * math.log(2) / 7.5
    )
    # dynamic clip: mean 1.875, population sd sqrt(mean(w²) - 1.875²) = sqrt(5.3125 - 3.515625)
    # = 1.3404; bounds 1.875 ± 4.0212 cut nothing here, so it equals the plain estimate
    assert ref_is(logp, logp_ref, dynamic_clip=True).item() == pytest.approx(9.5 * math.log(2) / 4)
    # one huge weight among many ones is cut to mean + 3 sd
    big = torch.cat([torch.zeros(1, 99), torch.tensor([[math.log(1000.0)]])], dim=1).double()
    wb = big.exp()
    hi = float(wb.mean() + 3 * wb.std(correction=0))
    expected = hi * math.log(1000.0) / 100
    assert ref_is(big, torch.zeros_like(big), dynamic_clip=True).item() == pytest.approx(expected)


def test_adaptive_mix_stream_by_hand():
    settings = AdaptiveMix(gamma=2.0, threshold=0.5, window=2)
    k1 = torch.tensor([1.0, 0.0, 2.0, 0.0], dtype=torch.float64)
    ris = torch.tensor([0.0, 1.0, 0.0, 4.0], dtype=torch.float64)
    a, mix = adaptive_mix(k1, ris, settings)
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # step 0: empty window counts as KL 0: a0 = s(2 (0 - 0.5)) = s(-1) = 0.2689414; mix0 = a0 * 1
    a0 = s(-1.0)
    m0 = a0
    # step 1: window (m0): a1 = s(2 (m0 - 0.5)); mix1 = a1 * 0 + (1 - a1) * 1
    a1 = s(2 * (m0 - 0.5))
    m1 = 1 - a1
    # step 2: window (m0, m1)
    a2 = s(2 * ((m0 + m1) / 2 - 0.5))
    m2 = 2 * a2
    # step 3: window (m1, m2) -- m0 has left the window of 2
    a3 = s(2 * ((m1 + m2) / 2 - 0.5))
    m3 = 4 * (1 - a3)
    np.testing.assert_allclose(a.numpy(), [a0, a1, a2, a3], rtol=1e-14)
    np.testing.assert_allclose(mix.numpy(), [m0, m1, m2, m3], rtol=1e-14)
    # the stream gives the same numbers when fed in pieces
    stream = AdaptiveMixStream(settings)
    parts = [stream.step(k1[i : i + 2], ris[i : i + 2]) for i in (0, 2)]
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), mix)


def test_adaptive_mix_runs_are_independent_and_gamma_sets_the_direction():
    k1 = torch.tensor([[0.0] * 30, [2.0] * 30], dtype=torch.float64)
    a, _ = adaptive_mix(k1, k1.clone(), AdaptiveMix(gamma=10.0, threshold=0.5, window=5))
    assert a[0, -1] < 0.01 and a[1, -1] > 0.99  # as written: more k1 when the KL is large
    a, _ = adaptive_mix(k1, k1.clone(), AdaptiveMix(gamma=-10.0, threshold=0.5, window=5))
    assert a[0, -1] > 0.99 and a[1, -1] < 0.01
    solo, _ = adaptive_mix(k1[1], k1[1].clone(), AdaptiveMix(gamma=-10.0, threshold=0.5, window=5))
    torch.testing.assert_close(solo, a[1])


def test_adaptive_mix_bad_input():
    with pytest.raises(ValueError, match="same shape"):
        adaptive_mix(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="window"):
        AdaptiveMix(window=0)
    with pytest.raises(ValueError, match="runs"):
        AdaptiveMixStream(AdaptiveMix(), (2,)).step(torch.zeros(3, 4), torch.zeros(3, 4))
