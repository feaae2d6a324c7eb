"""The private helpers shared by kl, losses, advantages and reduce (klpo._tensor)."""

from __future__ import annotations

import math

import pytest
import torch

from klpo import _tensor as T


def test_wide_and_out_dtypes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        x = torch.zeros(2, dtype=dtype)
        assert T.wide_dtype(x) == torch.float64  # CPU has float64
        # out: float32 unless an input is float64; None inputs are skipped
        want = torch.float64 if dtype == torch.float64 else torch.float32
        assert T.out_dtype(x, None) == want
        assert T.to_out(torch.zeros(2, dtype=torch.float64), x, None).dtype == want
    assert T.out_dtype() == torch.float32
    assert T.out_dtype(torch.zeros(1), torch.zeros(1, dtype=torch.float64)) == torch.float64


@pytest.mark.parametrize("dtype, cap", [(torch.float64, 700.0), (torch.float32, 85.0)])
def test_capped_value_clamps_gradient_passes(dtype, cap):
    x = torch.tensor([-1e4, -cap - 1.0, -3.0, 0.0, 2.5, cap + 1.0, 1e4], dtype=dtype)
    x.requires_grad_(True)
    y = T.capped(x)
    # value: clamp(x, -cap, cap), by hand
    want = torch.tensor([-cap, -cap, -3.0, 0.0, 2.5, cap, cap], dtype=dtype)
    assert torch.equal(y.detach(), want)
    # gradient: the identity everywhere, the cap included (never a silent zero)
    (g,) = torch.autograd.grad((y * torch.arange(7, dtype=dtype)).sum(), x)
    assert torch.equal(g, torch.arange(7, dtype=dtype))
    e = T.capped_exp(x)
    assert torch.isfinite(e).all()
    assert (0.0 * e == 0).all()  # the point of the cap: 0 · exp never NaN
    # gradient of capped_exp is its value (exp' = exp), through the cap
    (ge,) = torch.autograd.grad(e.sum(), x)
    assert torch.equal(ge, e.detach())
    # the naive exp overflows where the capped one does not
    assert not torch.isfinite(torch.exp(x.detach())).all()


def test_check_float_and_shapes_name_the_argument():
    ref = torch.zeros(2, 3)
    T.check_float("x", ref)
    with pytest.raises(TypeError, match=r"adv must be a float tensor, got torch\.int64"):
        T.check_float("adv", torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="adv must be a float tensor, got list"):
        T.check_float("adv", [1.0])
    T.check_same_shape("logp", ref, adv=torch.ones(2, 3), values=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"adv has shape \(3, 2\) but logp has shape \(2, 3\)"):
        T.check_same_shape("logp", ref, adv=torch.ones(3, 2))
    with pytest.raises(TypeError, match="adv must be a float tensor"):
        T.check_same_shape("logp", ref, adv=torch.ones(2, 3, dtype=torch.long))


def test_check_mask():
    T.check_mask(torch.ones(2, 3, dtype=torch.bool), (2, 3))
    T.check_mask(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got torch\.float32 of shape \(2, 3\).*mask\.bool\(\)"):
        T.check_mask(torch.ones(2, 3))
    with pytest.raises(TypeError, match="got list"):
        T.check_mask([True])
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\).*\(2, 3\).*same tokens"):
        T.check_mask(torch.ones(2, 2, dtype=torch.bool), (2, 3))


def test_check_finite_counts_only_unmasked_entries():
    x = torch.tensor([[0.0, math.nan, 1.0], [-math.inf, 2.0, math.inf]])
    with pytest.raises(ValueError, match=r"logp has 3 non-finite entries \(NaN or ±inf\) out of 6"):
        T.check_finite("logp", x)
    mask = torch.tensor([[True, False, True], [False, True, False]])
    T.check_finite("logp", x, mask)  # every non-finite entry is masked: no error
    mask[1, 2] = True
    with pytest.raises(ValueError, match=r"1 non-finite entry .*at unmasked positions"):
        T.check_finite("logp", x, mask)
    T.check_finite("logp", torch.zeros(0))  # empty is finite


def test_check_finite_names_the_first_bad_argument_of_several():
    good, bad = torch.zeros(2, 2), torch.tensor([[0.0, -math.inf], [math.nan, 1.0]])
    T.check_finite("logp", good, logp_ref=good, logp_old=good)
    with pytest.raises(ValueError, match=r"^logp_ref has 2 non-finite entries"):
        T.check_finite("logp", good, logp_ref=bad, logp_old=bad)
    old = torch.tensor([[0.0, 0.0], [0.0, math.inf]])
    mask = torch.tensor([[True, True], [True, False]])
    T.check_finite("logp", good, mask, logp_ref=good, logp_old=old)  # the inf is padding
    with pytest.raises(ValueError, match=r"^logp_old has 1 non-finite entry .* at unmasked"):
        T.check_finite("logp", good, ~mask | mask, logp_ref=good, logp_old=old)
