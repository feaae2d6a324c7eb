"""Tests for klpo.kl: values, gradients, the explain table, numerics and errors.

The oracles are independent of the code under test: hand arithmetic, closed forms for softmax
categoricals written in numpy, and Monte Carlo with tolerances from the standard error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klpo import kl

LOG_NAMES = [n for n in kl.ESTIMATORS if n != "full"]


def est(name: str, logp, logp_ref, logp_old=None):
    return kl.estimate(name, logp, logp_ref, logp_old=logp_old)


# ---------------------------------------------------------------------------------------------
# Hand-computed values.


def test_hand_values():
    # pi_theta(y) = 0.5, pi_ref(y) = 0.25: d = log 0.5 - log 0.25 = log 2 = 0.6931472
    logp = torch.tensor([[math.log(0.5)]])
    logp_ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    expected = {
        "k1": ln2,  # d
        "k2": ln2**2 / 2,  # 0.4804530 / 2 = 0.2402265
        "k3": 0.5 + ln2 - 1,  # exp(-d) = 0.5, so 0.5 + 0.6931472 - 1 = 0.1931472
        "abs": ln2,
        "k1+": ln2,
        "k2+": ln2**2 / 2,
        "k3+": 0.5 + ln2 - 1,
        "abs+": ln2,
        "low_var_kl": 0.5 + ln2 - 1,  # inside both clamps, equal to k3
        # r = pi_ref / pi_theta = 0.5: r log r - (r - 1) = 0.5 * (-0.6931472) + 0.5 = 0.1534264
        "kl_ref_theta": 0.5 * math.log(0.5) + 0.5,
    }
    for name, value in expected.items():
        got = est(name, logp, logp_ref)
        assert got.dtype == torch.float32
        assert got.item() == pytest.approx(value, rel=1e-6), name
    # k3_is with pi_old(y) = 0.25: w = 0.5 / 0.25 = 2, so 2 * 0.1931472 = 0.3862944
    got = est("k3_is", logp, logp_ref, logp_old=torch.tensor([[math.log(0.25)]]))
    assert got.item() == pytest.approx(2 * (0.5 + ln2 - 1), rel=1e-6)


def test_low_var_kl_clamps_value_and_kills_gradient():
    # d = -3: k3 = exp(3) - 3 - 1 = 20.0855 - 4 = 16.0855 > 10, so the value is clamped to 10
    logp = torch.tensor([[-3.0, -1.0]], dtype=torch.float64, requires_grad=True)
    logp_ref = torch.zeros(1, 2, dtype=torch.float64)
    value = est("low_var_kl", logp, logp_ref)
    assert value[0, 0].item() == 10.0
    # d = -1: k3 = e - 1 - 1 = 0.7182818, inside the clamp
    assert value[0, 1].item() == pytest.approx(math.e - 2, rel=1e-12)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert grad[0, 0].item() == 0.0  # the brake fails where the policy fell furthest below pi_ref
    assert grad[0, 1].item() == pytest.approx(1 - math.e, rel=1e-12)  # 1 - exp(-d) at d = -1
    # d = 25 clamps the log-ratio to -20: exp(-20) + 20 - 1 = 19.0000000021, then the value to 10
    far = est("low_var_kl", torch.tensor([[25.0]], dtype=torch.float64), torch.zeros(1, 1))
    assert far.item() == 10.0
    # d = 5: exp(-5) + 5 - 1 = 4.0067379, inside both clamps
    near = est("low_var_kl", torch.tensor([[5.0]], dtype=torch.float64), torch.zeros(1, 1))
    assert near.item() == pytest.approx(math.exp(-5) + 4, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Analytic gradients: the coefficient c(d) in grad est = c · grad logp.


def analytic(name: str, d: np.ndarray, log_w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value, d value / d logp) of each estimator, written from the formulas, in numpy."""
    r = np.exp(-d)
    k3v = r + d - 1
    w = np.exp(log_w)
    if name == "k1":
        return d, np.ones_like(d)
    if name in ("k2", "k2+"):
        return d * d / 2, d
    if name == "k3":
        return k3v, 1 - r
    if name == "abs":
        return np.abs(d), np.sign(d)
    if name == "k1+":
        return d, d
    if name == "k3+":
        return k3v, d
    if name == "abs+":
        return np.abs(d), d
    if name == "k3_is":
        return w * k3v, w * d
    if name == "low_var_kl":
        kl_ = np.clip(-d, -20, 20)
        raw = np.exp(kl_) - kl_ - 1
        inside = (np.abs(d) < 20) & (raw < 10)
        return np.clip(raw, -10, 10), np.where(inside, 1 - r, 0.0)
    if name == "kl_ref_theta":
        return r * np.log(r) - (r - 1), d * r
    raise AssertionError(name)


@pytest.mark.parametrize("name", LOG_NAMES)
def test_gradient_matches_analytic(name):
    gen = torch.Generator().manual_seed(1)
    logp = (-3 * torch.rand(4, 7, generator=gen, dtype=torch.float64)).requires_grad_(True)
    logp_ref = -3 * torch.rand(4, 7, generator=gen, dtype=torch.float64)
    logp_old = logp.detach() + 0.3 * torch.randn(4, 7, generator=gen, dtype=torch.float64)
    value = est(name, logp, logp_ref, logp_old)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    d = (logp - logp_ref).detach().numpy()
    v_np, c_np = analytic(name, d, (logp.detach() - logp_old).numpy())
    np.testing.assert_allclose(value.detach().numpy(), v_np, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grad.numpy(), c_np, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", [n for n in LOG_NAMES if n not in ("k1+", "k3+", "abs+")])
def test_gradcheck_float64(name):
    """The gradient is the derivative of the value (not so, by design, for the `+` variants)."""
    gen = torch.Generator().manual_seed(2)
    # Keep d away from the kinks of abs (d = 0) and of low_var_kl's clamps.
    d = 0.2 + 1.5 * torch.rand(3, 5, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(3, 5, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
    logp_ref = -2 * torch.rand(3, 5, generator=gen, dtype=torch.float64)
    logp = (logp_ref + sign * d).requires_grad_(True)
    logp_old = logp.detach() - 0.1
    assert torch.autograd.gradcheck(lambda x: est(name, x, logp_ref, logp_old), (logp,))
    ref = logp_ref.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: est(name, logp.detach(), x, logp_old), (ref,))


def test_logp_old_and_logp_ref_gradients():
    """k3_is differentiates through w but never into logp_old (the sampler is detached)."""
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    logp_old = torch.tensor([[-1.2]], dtype=torch.float64, requires_grad=True)
    logp_ref = torch.tensor([[-0.5]], dtype=torch.float64)
    value = est("k3_is", logp, logp_ref, logp_old)
    grads = torch.autograd.grad(value.sum(), (logp, logp_old), allow_unused=True)
    assert grads[1] is None
    # w · d = exp(0.2) · (-0.5) = 1.2214028 · -0.5
    assert grads[0].item() == pytest.approx(math.exp(0.2) * -0.5, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Properties.

finite_d = st.floats(min_value=-60, max_value=60, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(finite_d, min_size=1, max_size=16), st.lists(finite_d, min_size=1, max_size=16))
def test_properties(xs, ys):
    n = min(len(xs), len(ys))
    logp = torch.tensor(xs[:n]).reshape(1, n).requires_grad_(True)
    logp_ref = torch.tensor(ys[:n]).reshape(1, n)
    values = {name: est(name, logp, logp_ref, logp.detach()) for name in LOG_NAMES}
    for name in ("k2", "k3", "abs", "k2+", "k3+", "abs+", "kl_ref_theta", "k3_is"):
        assert (values[name] >= 0).all(), name
    # low_var_kl is verl's formula exp(kl) - kl - 1 verbatim (no expm1): near d = 0 it rounds to
    # a few ulp below zero (d = -1e-16 gives -1.1e-16), never further
    assert (values["low_var_kl"] >= -4 * torch.finfo(torch.float64).eps).all()
    assert torch.equal(values["k3"], values["k3+"])
    assert torch.equal(values["k1"], values["k1+"])
    assert torch.equal(values["abs"], values["abs+"])
    assert torch.equal(values["k3"], values["k3_is"])  # on-policy: w = 1
    grads = {
        name: torch.autograd.grad(values[name].sum(), logp, retain_graph=True)[0]
        for name in ("k2", "k1+", "k3+", "abs+", "k3_is")
    }
    for name in ("k1+", "k3+", "abs+"):
        assert torch.equal(grads[name], grads["k2"]), name
    # k3_is on-policy has gradient w · d = d, the same as k2 (up to rounding)
    assert torch.equal(grads["k3_is"], grads["k2"])


@pytest.mark.parametrize("name", LOG_NAMES)
def test_zero_at_equal_logps(name):
    logp = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    value = est(name, logp, logp.clone(), logp.clone())
    if name in ("k1", "k1+", "abs", "abs+", "k2", "k2+", "k3", "k3+", "k3_is"):
        assert torch.equal(value, torch.zeros_like(value))
    else:
        assert value.abs().max() <= 1e-7


# ---------------------------------------------------------------------------------------------
# Exact expectations on categoricals, and every claim of `explain` against an independent oracle.


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def oracle(name: str, placement: str, theta, ref, old=None):
    """Exact (E_s[value], expected gradient w.r.t. logits) from closed forms, in numpy.

    grad_logits log pi(y) = e_y - pi; the loss gradient is sum_y pi_s(y) c(y) (e_y - pi), the
    reward gradient is sum_y pi_theta(y) v_s(y) (e_y - pi), with v_s the value at sampling time.
    """
    pi, pr = softmax(theta), softmax(ref)
    ps = pi if old is None else softmax(old)
    eye = np.eye(len(pi))
    score = eye - pi  # row y: grad log pi(y)
    if name == "full":
        kl_tr = float(np.sum(pi * np.log(pi / pr)))
        value_at = np.full_like(pi, kl_tr)
        grad_loss = pi * (np.log(pi / pr) - kl_tr)
        kl_s = float(np.sum(ps * np.log(ps / pr)))
        grad_reward = (pi * kl_s) @ score  # = 0: kl_s is a constant
    else:
        d = np.log(pi) - np.log(pr)
        value_at, coef = analytic(name, d, np.log(pi) - np.log(ps))
        grad_loss = (ps * coef) @ score
        v_s, _ = analytic(name, np.log(ps) - np.log(pr), np.zeros_like(d))
        grad_reward = (pi * v_s) @ score
    value = float(np.sum(ps * value_at))
    grad = {"loss": grad_loss, "reward": grad_reward, "reward+loss": grad_loss + grad_reward}
    return value, grad[placement]


def targets(theta, ref):
    pi, pr = softmax(theta), softmax(ref)
    kl_tr = float(np.sum(pi * np.log(pi / pr)))
    kl_rt = float(np.sum(pr * np.log(pr / pi)))
    return {
        "values": {kl.THETA_REF: kl_tr, kl.REF_THETA: kl_rt},
        kl.GRAD_THETA_REF: pi * (np.log(pi / pr) - kl_tr),
        kl.GRAD_REF_THETA: pi - pr,
        kl.GRAD_ZERO: np.zeros_like(pi),
    }


def random_cases(seed: int, n: int):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        v = int(rng.integers(2, 9))
        scale = [0.3, 1.0, 2.0, 3.0][i % 4]
        theta = scale * rng.standard_normal(v)
        out.append((theta, scale * rng.standard_normal(v), theta + 0.5 * rng.standard_normal(v)))
    return out


def test_hand_checked_categorical_oracle():
    """pi = (0.7, 0.2, 0.1), pi_ref = (0.5, 0.3, 0.2): values and gradients checked by hand."""
    theta, ref = np.log([0.7, 0.2, 0.1]), np.log([0.5, 0.3, 0.2])
    t = targets(theta, ref)
    assert t["values"][kl.THETA_REF] == pytest.approx(0.085123, abs=1e-6)
    assert t["values"][kl.REF_THETA] == pytest.approx(0.092033, abs=1e-6)
    np.testing.assert_allclose(t[kl.GRAD_THETA_REF], [0.175945, -0.098118, -0.077827], atol=1e-6)
    for name, placement, expected in [
        ("k3", "loss", [0.2, -0.1, -0.1]),
        ("k3", "reward", [-0.024055, 0.001882, 0.022173]),
        ("k2", "loss", [0.175945, -0.098118, -0.077827]),
        ("k1", "reward", [0.175945, -0.098118, -0.077827]),
        ("k1", "loss", [0.0, 0.0, 0.0]),
        ("k3", "reward+loss", [0.175945, -0.098118, -0.077827]),
    ]:
        value, grad = kl.expected_value_and_gradient(
            name, placement, torch.tensor(theta), torch.tensor(ref)
        )
        np.testing.assert_allclose(grad.numpy(), expected, atol=1e-6)
    value, _ = kl.expected_value_and_gradient("k2", "loss", torch.tensor(theta), torch.tensor(ref))
    assert value == pytest.approx(0.080088, abs=1e-6)


@pytest.mark.parametrize("on_policy", [True, False])
@pytest.mark.parametrize("placement", kl.PLACEMENTS)
@pytest.mark.parametrize("name", kl.ESTIMATORS)
def test_explain_claims_hold_on_fresh_categoricals(name, placement, on_policy):
    claim = kl.explain(name, placement, on_policy=on_policy)
    assert claim.gradient in kl.GRADIENTS
    cases = random_cases(seed=7, n=24)
    value_errors, grad_matches = [], {g: [] for g in kl.GRADIENTS[:3]}
    for theta, ref, old in cases:
        value, grad = oracle(name, placement, theta, ref, None if on_policy else old)
        t = targets(theta, ref)
        value_errors.append(abs(value - t["values"][claim.estimates]))
        scale = max(1.0, float(np.linalg.norm(t[kl.GRAD_THETA_REF])))
        for g in grad_matches:
            grad_matches[g].append(float(np.linalg.norm(grad - t[g])) <= 1e-10 * scale)
        # The library's own enumeration agrees with the numpy oracle.
        _, grad_lib = kl.expected_value_and_gradient(
            name,
            placement,
            torch.tensor(theta),
            torch.tensor(ref),
            None if on_policy else torch.tensor(old),
        )
        np.testing.assert_allclose(grad_lib.numpy(), grad, rtol=1e-9, atol=1e-12)
    if claim.unbiased:
        assert max(value_errors) <= 1e-10
    else:
        assert max(value_errors) > 1e-6
    if claim.gradient == kl.GRAD_OTHER:
        assert not any(all(m) for m in grad_matches.values())
    else:
        assert all(grad_matches[claim.gradient])
    assert claim.mismatch == (
        claim.gradient
        != (kl.GRAD_THETA_REF if claim.estimates == kl.THETA_REF else kl.GRAD_REF_THETA)
    )


def test_explain_headline_claims():
    """The claims the project exists to make, spelled out."""
    on = {(n, p): kl.explain(n, p) for n in kl.ESTIMATORS for p in kl.PLACEMENTS}
    assert on["k1", "loss"].gradient == kl.GRAD_ZERO
    assert on["k1", "reward"].gradient == kl.GRAD_THETA_REF
    assert on["k2", "loss"].gradient == kl.GRAD_THETA_REF
    assert on["k3", "loss"].gradient == kl.GRAD_REF_THETA
    assert on["k3", "loss"].unbiased and on["k3", "loss"].mismatch
    assert on["k3", "reward"].gradient == kl.GRAD_OTHER
    assert on["k3", "reward+loss"].gradient == kl.GRAD_THETA_REF
    assert on["k3+", "loss"].gradient == kl.GRAD_THETA_REF
    assert on["k3_is", "loss"].gradient == kl.GRAD_THETA_REF
    assert on["low_var_kl", "loss"].gradient == kl.GRAD_OTHER
    assert not on["low_var_kl", "loss"].unbiased
    assert on["full", "loss"].gradient == kl.GRAD_THETA_REF
    off = kl.explain("k3_is", "loss", on_policy=False)
    assert off.gradient == kl.GRAD_THETA_REF and off.unbiased
    assert kl.explain("k2", "loss", on_policy=False).gradient == kl.GRAD_OTHER
    assert [e.estimator for e in kl.explain_all()][:3] == ["k1"] * 3


@pytest.mark.parametrize("name", kl.ESTIMATORS)
def test_nonnegative_claim(name):
    claim = kl.explain(name, "loss")
    # d = 0 exactly (linspace's ~1e-15 there rounds k3-like values to either sign by CPU).
    d = (torch.arange(-100, 101, dtype=torch.float64) / 10.0)[None]
    zero = torch.zeros_like(d)
    if name == "full":
        assert claim.nonnegative
        return
    values = est(name, d, zero, d)
    assert claim.nonnegative == bool((values >= 0).all())


# ---------------------------------------------------------------------------------------------
# Monte Carlo: seeded, tolerance 4 standard errors.


@pytest.mark.parametrize("name", LOG_NAMES)
def test_monte_carlo_means_converge(name):
    gen = torch.Generator().manual_seed(11)
    theta = torch.randn(10, generator=gen, dtype=torch.float64)
    ref = torch.randn(10, generator=gen, dtype=torch.float64)
    logp_all, logp_ref_all = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    y = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=gen)
    values = est(name, logp_all[y][None], logp_ref_all[y][None], logp_all[y][None])[0]
    exact, _ = oracle(name, "loss", theta.numpy(), ref.numpy())
    se = float(values.std()) / math.sqrt(values.numel())
    assert abs(float(values.mean()) - exact) <= 4 * se


def test_monte_carlo_k3_loss_gradient_is_the_other_direction():
    """The per-sample gradient of k3, averaged, converges to pi - pi_ref, not to grad KL(pi ‖ ref)."""
    theta = torch.tensor(np.log([0.7, 0.2, 0.1]))
    ref = torch.tensor(np.log([0.5, 0.3, 0.2]))
    gen = torch.Generator().manual_seed(5)
    n = 100_000
    logits = theta.clone().expand(n, 3).clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits, -1)
    y = torch.multinomial(logp_all[0].detach().exp(), n, replacement=True, generator=gen)
    logp = logp_all.gather(1, y[:, None])[:, 0]
    logp_ref = torch.log_softmax(ref, -1)[y]
    (per_sample,) = torch.autograd.grad(est("k3", logp[None], logp_ref[None]).sum(), logits)
    mean, se = per_sample.mean(0), per_sample.std(0) / math.sqrt(n)
    assert torch.all((mean - torch.tensor([0.2, -0.1, -0.1], dtype=mean.dtype)).abs() <= 4 * se)
    wrong = torch.tensor([0.175945, -0.098118, -0.077827], dtype=mean.dtype)
    assert torch.any((mean - wrong).abs() > 6 * se)


# ---------------------------------------------------------------------------------------------
# Dtypes and extreme inputs.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", LOG_NAMES)
def test_low_precision_inputs_equal_their_float32_upcast(name, dtype):
    gen = torch.Generator().manual_seed(4)
    logp = (-4 * torch.rand(3, 6, generator=gen)).to(dtype)
    logp_ref = (-4 * torch.rand(3, 6, generator=gen)).to(dtype)
    low = est(name, logp, logp_ref, logp)
    up = est(name, logp.float(), logp_ref.float(), logp.float())
    assert low.dtype == torch.float32
    assert torch.equal(low, up)


def test_output_dtypes():
    x = torch.zeros(2, 3)
    assert est("k3", x, x).dtype == torch.float32
    assert est("k3", x.double(), x.double()).dtype == torch.float64
    assert kl.full(torch.zeros(2, 3, 5), torch.zeros(2, 3, 5)).dtype == torch.float32


@pytest.mark.parametrize("name", LOG_NAMES)
def test_finite_for_moderate_log_ratios(name):
    d = torch.linspace(-80, 80, 321)[None]
    logp = d.clone().requires_grad_(True)
    zero = torch.zeros_like(d)
    value = est(name, logp, zero, logp.detach())
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("name", LOG_NAMES)
def test_never_nan_for_finite_inputs_and_zero_grad_where_masked(name):
    big = torch.tensor([[-1e30, -1e4, -800.0, -100.0, 0.0, 100.0, 800.0, 1e4, 1e30]])
    for logp_old in (big, -big, torch.zeros_like(big)):
        logp = big.clone().requires_grad_(True)
        value = est(name, logp, torch.zeros_like(big), logp_old)
        assert not torch.isnan(value).any()
        (grad,) = torch.autograd.grad(value, logp, torch.ones_like(value))
        assert not torch.isnan(grad).any()
        (masked,) = torch.autograd.grad(
            est(name, logp, torch.zeros_like(big), logp_old), logp, torch.zeros_like(value)
        )
        assert torch.equal(masked, torch.zeros_like(masked))


def test_overflow_beyond_float32_is_inf_not_nan():
    logp = torch.tensor([[-100.0]], requires_grad=True)
    value = est("k3", logp, torch.zeros(1, 1))
    assert value.item() == math.inf  # exp(100) ≈ 2.7e43 exceeds float32
    (grad,) = torch.autograd.grad(value.sum(), logp)
    assert grad.item() == -math.inf  # 1 - exp(100)


# ---------------------------------------------------------------------------------------------
# full (the naive reference; klpo.logprobs has the fused version).


def test_full_is_exact_kl_with_the_right_gradient():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    logits_ref = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64)
    value = kl.estimate("full", None, None, logits=logits, logits_ref=logits_ref)
    (grad,) = torch.autograd.grad(value.sum(), logits)
    for b in range(2):
        for t in range(3):
            pi = softmax(logits[b, t].detach().numpy())
            pr = softmax(logits_ref[b, t].numpy())
            kl_ = np.sum(pi * np.log(pi / pr))
            assert value[b, t].item() == pytest.approx(kl_, rel=1e-12)
            np.testing.assert_allclose(
                grad[b, t].numpy(), pi * (np.log(pi / pr) - kl_), rtol=1e-10, atol=1e-14
            )
    # temperature divides the logits
    t2 = kl.full(logits.detach(), logits_ref, temperature=2.0)
    torch.testing.assert_close(t2, kl.full(logits.detach() / 2, logits_ref / 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_gradient_is_grad_of_exact_kl_at_each_position(dtype):
    # float32 / bf16 logits go through klpo.logprobs.exact_kl (float32 chunks); the gradient of
    # sum_t w_t KL_t must be w_t pi (log pi - log pi_ref - KL_t) / T at each position t, and the
    # reference gets none.
    gen = torch.Generator().manual_seed(11)
    b, t, v, temp = 2, 3, 50, 0.8
    logits = (2 * torch.randn(b, t, v, generator=gen)).to(dtype).requires_grad_(True)
    logits_ref = (2 * torch.randn(b, t, v, generator=gen)).to(dtype).requires_grad_(True)
    w = torch.randn(b, t, generator=gen, dtype=torch.float64)
    value = kl.full(logits, logits_ref, temperature=temp)
    assert value.dtype == torch.float32 and value.shape == (b, t)
    (grad,) = torch.autograd.grad((w * value).sum(), logits)
    assert grad.dtype == dtype
    (grad_ref,) = torch.autograd.grad(value.sum(), logits_ref, allow_unused=True)
    assert grad_ref is None  # detached
    # the estimate() entry point (temperature 1) is the same function
    same = kl.estimate("full", None, None, logits=logits, logits_ref=logits_ref)
    torch.testing.assert_close(same, kl.full(logits, logits_ref), rtol=0, atol=0)
    x = logits.detach().double().numpy() / temp
    x_ref = logits_ref.detach().double().numpy() / temp
    u32 = 2.0**-24
    for i in range(b):
        for j in range(t):
            log_pi = x[i, j] - np.log(np.exp(x[i, j] - x[i, j].max()).sum()) - x[i, j].max()
            log_pr = (
                x_ref[i, j]
                - np.log(np.exp(x_ref[i, j] - x_ref[i, j].max()).sum())
                - x_ref[i, j].max()
            )
            pi = np.exp(log_pi)
            kl_ = float(np.sum(pi * (log_pi - log_pr)))
            want = w[i, j].item() * pi * (log_pi - log_pr - kl_) / temp
            # float32 arithmetic on V = 50 logits of size |x| (Higham & Mary's probabilistic
            # bound with lambda = 6): |error| <= 6 sqrt(V) u (sum of the terms' sizes)
            scale = 2 * (np.abs(x[i, j]).max() + np.abs(x_ref[i, j]).max()) + 1
            tol = 6 * math.sqrt(v) * u32 * scale
            assert value[i, j].item() == pytest.approx(kl_, abs=tol)
            bound = tol * abs(w[i, j].item()) * pi * (2 + np.abs(log_pi) + np.abs(log_pr)) / temp
            if dtype == torch.bfloat16:
                bound = bound + 2.0**-8 * np.abs(want)  # the gradient is rounded to bf16 once
            np.testing.assert_array_less(np.abs(grad[i, j].double().numpy() - want), bound + 1e-300)


# ---------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_problem():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*k1, k2, k3"):
        kl.estimate("k4", x, x)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'"):
        kl.function("k4")
    assert kl.function("k3+") is kl.k3_plus and kl.function("abs") is kl.abs_
    with pytest.raises(ValueError, match=r"needs logp_old.*logp.detach\(\)"):
        kl.estimate("k3_is", x, x)
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*shape \(3, 2\)"):
        kl.estimate("k1", x, torch.zeros(3, 2))
    with pytest.raises(TypeError, match="float tensor"):
        kl.estimate("k1", torch.zeros(2, 3, dtype=torch.long), x)
    with pytest.raises(ValueError, match="needs logits= and logits_ref="):
        kl.estimate("full", x, x)
    with pytest.raises(ValueError, match=r"unknown placement 'rewards'.*reward, loss"):
        kl.explain("k3", "rewards")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kl.full(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3), temperature=0.0)


def test_non_finite_input_is_named_and_counted():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    ref = logp - 0.25
    # a reference that forbids a sampled token: k3 = exp(-d) + d - 1 with d = +inf is not a number
    # worth training on; the error names the argument and counts the entries (2 of 6)
    bad_ref = ref.clone()
    bad_ref[0, 1] = bad_ref[1, 2] = -math.inf
    with pytest.raises(ValueError, match=r"logp_ref has 2 non-finite entries.*out of 6"):
        kl.estimate("k3", logp, bad_ref)
    bad = logp.clone()
    bad[1, 0] = math.nan
    with pytest.raises(ValueError, match=r"logp has 1 non-finite entry"):
        kl.estimate("k1", bad, ref)
    with pytest.raises(ValueError, match=r"logp_old has 1 non-finite entry"):
        kl.estimate("k3_is", logp, ref, logp_old=bad)
    # losses route through estimate: kl_loss without a mask checks every position
    from klpo import losses

    with pytest.raises(ValueError, match=r"logp_ref has 2 non-finite"):
        losses.kl_loss("k3", logp, bad_ref)

    # masked positions may hold padding of any value: only unmasked ones are checked, and the
    # unmasked estimates are those of the clean input
    mask = torch.tensor([[True, False, True], [True, True, False]])
    got = kl.estimate("k3", logp, bad_ref, mask=mask)
    want = kl.estimate("k3", logp, ref)
    assert torch.equal(got[mask], want[mask])
    rewards = torch.zeros(2, 3)
    shaped = losses.kl_reward(rewards, logp, bad_ref, mask, beta=0.5, estimator="k3")
    assert torch.isfinite(shaped).all() and (shaped[~mask] == 0).all()
    torch.testing.assert_close(shaped[mask], -0.5 * want[mask])
    term = losses.kl_loss("k3", logp, bad_ref, mask=mask)
    torch.testing.assert_close(term[mask], want[mask])
    metrics = losses.kl_metrics(logp, bad_ref, mask, estimators=("k1", "k3"))
    assert math.isfinite(metrics["kl/ref/k3"])
    wider = mask.clone()
    wider[0, 1] = True
    with pytest.raises(ValueError, match=r"logp_ref has 1 non-finite entry .* at unmasked"):
        kl.estimate("k3", logp, bad_ref, mask=wider)

    # asked not to check, the NaN the check exists for comes back without a word
    raw = kl.estimate("k3", logp, bad_ref, check_finite=False)
    assert torch.isnan(raw[0, 1]) and torch.isfinite(raw[0, 0])
    assert torch.isnan(kl.estimate("k1", bad, ref, check_finite=False)[1, 0])


def test_k2_bias_takes_either_sign():
    """docs/choosing.md: k2's value is biased, not 'biased low': its sign depends on the pair."""
    # categorical, exact: E_p[d²/2] - KL with p = (0.7, 0.2, 0.1), q = (0.5, 0.3, 0.2)
    p = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    lp, lq = p.log()[None], q.log()[None]
    bias = float((p * kl.k2(lp, lq)[0]).sum() - (p * kl.k1(lp, lq)[0]).sum())
    assert bias == pytest.approx(-0.005035, abs=1e-6)  # below the KL (0.085123) by 6%
    # equal-variance Gaussians, N(0, 1) against N(mu, 1): d = mu²/2 - mu x, so
    # E[d²]/2 = (mu² + mu⁴/4)/2 = KL + mu⁴/8 > KL: above the KL (+25% at mu = 1), by quadrature
    x, w = np.polynomial.hermite_e.hermegauss(40)
    w = torch.tensor(w / w.sum())
    mu = 1.0
    lp = torch.tensor(-(x**2) / 2)[None]
    lq = torch.tensor(-((x - mu) ** 2) / 2)[None]
    e_k2 = float((w * kl.k2(lp, lq)[0]).sum())
    assert e_k2 == pytest.approx(0.5 + 1 / 8, rel=1e-12)


def test_full_with_a_masked_vocabulary_is_the_kl_over_the_support():
    # -inf logits (padded or constrained vocabulary) at the same entries in both models: the KL
    # over the remaining entries (oracle: drop them, float64 softmax), with its gradient; estimate's
    # finiteness check lets it through.
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64)
    logits_ref = torch.randn(2, 3, 9, generator=gen, dtype=torch.float64)
    keep = torch.ones(9, dtype=torch.bool)
    keep[[2, 7, 8]] = False
    x = logits.clone().requires_grad_(True)
    xm = x.masked_fill(~keep, -math.inf)
    value = kl.estimate(
        "full", None, None, logits=xm, logits_ref=logits_ref.masked_fill(~keep, -math.inf)
    )
    (grad,) = torch.autograd.grad(value.sum(), x)
    for b in range(2):
        for t in range(3):
            pi = softmax(logits[b, t, keep].numpy())
            pr = softmax(logits_ref[b, t, keep].numpy())
            kl_ = np.sum(pi * np.log(pi / pr))
            assert value[b, t].item() == pytest.approx(kl_, rel=1e-12)
            np.testing.assert_allclose(
                grad[b, t, keep].numpy(), pi * (np.log(pi / pr) - kl_), rtol=1e-10, atol=1e-14
            )
    assert torch.equal(grad[..., ~keep], torch.zeros(2, 3, 3, dtype=torch.float64))
    # Masked in the policy only: still finite (pi = 0 there adds 0).
    only_pi = kl.estimate("full", None, None, logits=xm.detach(), logits_ref=logits_ref)
    assert torch.isfinite(only_pi).all()


def test_full_where_the_reference_forbids_the_policy_support_is_refused_or_inf():
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(2, 3, 5, generator=gen)
    logits_ref = torch.randn(2, 3, 5, generator=gen)
    logits_ref[0, 1, 3] = -math.inf  # pi_theta > 0 there: KL(pi_theta ‖ pi_ref) = +inf
    with pytest.raises(ValueError, match=r"'full' is non-finite at 1 position.*1 \+inf, 0 NaN"):
        kl.estimate("full", None, None, logits=logits, logits_ref=logits_ref)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[0, 1] = False  # masked out: no complaint
    value = kl.estimate("full", None, None, logits=logits, logits_ref=logits_ref, mask=mask)
    assert torch.isposinf(value[0, 1]) and torch.isfinite(value[mask]).all()
    value = kl.estimate(
        "full", None, None, logits=logits, logits_ref=logits_ref, check_finite=False
    )
    assert torch.isposinf(value[0, 1])


def test_the_error_of_full_lists_what_works_from_logp_and_logp_ref_alone():
    """The estimators the message names as needing only logp and logp_ref each run on them,
    and every other one (k3_is: logp_old; full: logits) refuses them."""
    logp, logp_ref = torch.tensor([[-0.5, -1.0]]), torch.tensor([[-0.7, -0.9]])
    with pytest.raises(ValueError) as err:
        kl.estimate("full", logp, logp_ref)
    text = str(err.value)
    alone = text.split("from logp and logp_ref alone: ")[1].split(" (and with")[0].split(", ")
    assert "k3_is" not in alone and "full" not in alone
    for name in kl.ESTIMATORS:
        if name in alone:
            assert kl.estimate(name, logp, logp_ref).shape == (1, 2)
        else:
            with pytest.raises(ValueError):
                kl.estimate(name, logp, logp_ref)
    assert "with logp_old, the sampling policy's log-probs: k3_is)" in text


# ---------------------------------------------------------------------------------------------
# The registry of traits (kl.SPECS): one row per estimator, read by every layer.


def test_the_registry_holds_every_estimator_and_its_traits():
    assert tuple(kl.SPECS) == (*kl.ESTIMATORS, *kl.REF_SAMPLED)
    assert kl.REF_SAMPLED == ("ref_is", "adaptive_mix")
    traits = {
        t: [n for n, s in kl.SPECS.items() if getattr(s, t)]
        for t in ("needs_old", "needs_logits", "ref_sampled", "mixed")
    }
    assert traits == {
        "needs_old": ["k3_is"],
        "needs_logits": ["full"],
        "ref_sampled": ["ref_is", "adaptive_mix"],
        "mixed": ["adaptive_mix"],
    }
    assert [n for n, s in kl.SPECS.items() if s.off_policy != "weighted"] == [
        "k3_is",
        "full",
        "ref_is",
        "adaptive_mix",
    ]
    assert tuple(n for n in kl.ESTIMATORS if n != "full") == kl.LOGPROB_ESTIMATORS
    for name in kl.ESTIMATORS:
        assert kl.function(name) is kl.SPECS[name].fn.resolve()  # named, imported when called
        assert kl.explain(name, "loss").equation == kl.SPECS[name].equation


def test_each_loss_variant_follows_the_kl_it_logs_and_logs_the_same_value():
    """``loss_variant`` is the doctor's proposal for a loss term: by explain's enumeration its
    loss gradient is grad KL(pi_theta ‖ pi_ref) (on- and off-policy through kl_loss's rule), and
    where it is a straight-through twin it logs exactly the estimator's value."""
    # The doctor's table before it was derived, written out by hand: the oracle.
    by_hand = {
        "k1": "k1+", "k1+": "k1+", "k2": "k2", "k2+": "k2", "k3": "k3+", "k3+": "k3+",
        "low_var_kl": "k3+", "abs": "abs+", "abs+": "abs+", "k3_is": "k3_is", "full": "full",
        "kl_ref_theta": "k3+", "ref_is": "ref_is", "adaptive_mix": "adaptive_mix",
    }  # fmt: skip
    assert {n: s.loss_variant for n, s in kl.SPECS.items()} == by_hand
    d = torch.linspace(-3, 3, 61, dtype=torch.float64)[None]
    zero = torch.zeros_like(d)
    for name, spec in kl.SPECS.items():
        variant = spec.loss_variant
        assert kl.explain(variant, "loss").gradient == kl.GRAD_THETA_REF, (name, variant)
        if (
            not spec.ref_sampled
            and not spec.needs_logits
            and name not in ("low_var_kl", "kl_ref_theta")
        ):
            same = kl.estimate(name, d, zero, logp_old=d) == kl.estimate(
                variant, d, zero, logp_old=d
            )
            assert bool(same.all()), (name, variant)


def test_register_adds_an_estimator_everywhere_and_refuses_a_bad_row(scratch_registry):
    # this test's registrations end with it (the fixture puts the rows back)

    def half_k2(logp, logp_ref):
        return kl.k2(logp, logp_ref) / 2

    spec = kl.Spec(half_k2, kl.THETA_REF, "d²/4", "weighted", "k2")
    assert kl.register("k2/2", spec) is spec
    assert "k2/2" in kl.ESTIMATORS and "k2/2" in kl.LOGPROB_ESTIMATORS
    one = torch.tensor([[1.0]])
    assert float(kl.estimate("k2/2", one, torch.zeros(1, 1))) == 0.25  # 1²/4
    assert kl.explain("k2/2", "loss").gradient == kl.GRAD_OTHER  # half of grad KL
    with pytest.raises(ValueError, match="already registered; pass replace=True"):
        kl.register("k2/2", kl.Spec(kl.k2, kl.THETA_REF, "d²/2", "weighted", "k2"))
    # Registered again under the same name: explain derives the new row, not a cached one.
    kl.register("k2/2", kl.Spec(kl.k2, kl.THETA_REF, "d²/2", "weighted", "k2"), replace=True)
    assert kl.explain("k2/2", "loss").gradient == kl.GRAD_THETA_REF
    bad = {
        "off_policy must be one of weighted, carried, none": {"off_policy": "maybe"},
        "target must be klpo.kl.THETA_REF or REF_THETA": {"target": "KL"},
        "loss_variant='k9' is not a registered estimator": {"loss_variant": "k9"},
        "mixed=True needs ref_sampled=True": {"mixed": True},
        "a reference-sampled one": {"ref_sampled": True},
    }
    base = {"fn": half_k2, "target": kl.THETA_REF, "equation": "d²/4"}
    for message, change in bad.items():
        row = {**base, "off_policy": "weighted", "loss_variant": "k2", **change}
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            kl.register("new", kl.Spec(**row))
    assert "new" not in kl.SPECS
    with pytest.raises(ValueError, match="unknown KL estimator 'ref_is'"):
        kl.estimate("ref_is", one, one)  # a reference-sampled row is no per-token function


def test_the_name_lists_are_live_views_of_the_registry(monkeypatch):
    before = tuple(kl.ESTIMATORS)
    monkeypatch.setitem(kl.SPECS, "k0", kl.Spec(kl.k1, kl.THETA_REF, "d", "weighted", "k1+"))
    assert (*before, "k0") == kl.ESTIMATORS and len(kl.ESTIMATORS) == len(before) + 1
    assert kl.ESTIMATORS[-1] == "k0" and "k0" in kl.ESTIMATORS and "k0" not in kl.REF_SAMPLED
    assert before != kl.ESTIMATORS and repr(kl.ESTIMATORS) == repr((*before, "k0"))
    monkeypatch.delitem(kl.SPECS, "k0")
    assert before == kl.ESTIMATORS
