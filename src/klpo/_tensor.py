"""Private helpers shared by the library's tensor functions (:mod:`klpo.kl`, :mod:`klpo.losses`,
:mod:`klpo.advantages`, :mod:`klpo.reduce`): the working precision, the output dtype, an exponent
cap that keeps products NaN-free, and the argument checks whose messages name the fix.

Precision contract (docs/estimators.md): inputs may be any float dtype; arithmetic runs in
float64 (float32 on Apple's MPS, which has no float64); results are float32, or float64 when an
input is float64, so that float64 oracles in the tests stay exact.

Not part of the public API: names and signatures may change without notice.
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp(700) ≈ 1e304 is finite in float64; exp(85) ≈ 8e36 is finite in float32.
EXP_CAP_64 = 700.0
EXP_CAP_32 = 85.0


def wide_dtype(x: Tensor) -> torch.dtype:
    """The working dtype for ``x``'s device: float64, or float32 on MPS (no float64 there)."""
    return torch.float32 if x.device.type == "mps" else torch.float64


def out_dtype(*inputs: Tensor | None) -> torch.dtype:
    """float64 when any (non-None) input is float64, else float32."""
    f64 = any(t is not None and t.dtype == torch.float64 for t in inputs)
    return torch.float64 if f64 else torch.float32


def to_out(x: Tensor, *inputs: Tensor | None) -> Tensor:
    """``x`` cast to :func:`out_dtype` of ``inputs`` (None entries are skipped)."""
    return x.to(out_dtype(*inputs))


def capped(x: Tensor) -> Tensor:
    """``x`` capped to ±700 (±85 below float64) in the value only, for use as an exponent.

    exp of the result is finite in the working dtype, so a product like ``w · k3`` or ``0 · exp``
    can never become ``0 · inf`` = NaN; a float32 result cast from float64 still overflows to inf
    where the true value exceeds the float32 range. Gradient: the identity (it passes straight
    through the cap), so a large log-ratio is never silently given a zero gradient.
    """
    cap = EXP_CAP_64 if x.dtype == torch.float64 else EXP_CAP_32
    return x + (x.clamp(-cap, cap) - x).detach()


def capped_exp(x: Tensor) -> Tensor:
    """``exp(capped(x))``: finite value; gradient ``exp(capped(x))`` (the value's)."""
    return torch.exp(capped(x))


def host_floats(values: dict[str, Tensor]) -> dict[str, float]:
    """The 0-d tensors of ``values`` as Python floats, with one device sync for the whole dict
    (metrics: a 0-token mean is 0 already, so no NaN leaves)."""
    keys = list(values)
    stacked = torch.stack([values[k].detach().to(torch.float64).reshape(()) for k in keys])
    return dict(zip(keys, stacked.cpu().tolist(), strict=True))


def _kind(t: object) -> str:
    return str(t.dtype) if isinstance(t, Tensor) else type(t).__name__


def check_float(name: str, t: object, what: str = "a float tensor") -> None:
    """TypeError unless ``t`` is a floating-point tensor; ``what`` says what it should hold."""
    if not isinstance(t, Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be {what}, got {_kind(t)}")


def check_same_shape(
    ref_name: str, ref: Tensor, *, hint: str = "[B, T] over the same tokens", **tensors: object
) -> None:
    """Every tensor in ``tensors`` is a float tensor of ``ref``'s shape.

    The ValueError names the tensor, both shapes and ``hint`` (what the shapes should be).
    """
    for name, t in tensors.items():
        check_float(name, t)
        assert isinstance(t, Tensor)
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but {ref_name} has shape "
                f"{tuple(ref.shape)}; all must be {hint}"
            )


def check_mask(mask: object, shape: torch.Size | tuple[int, ...] | None = None) -> None:
    """``mask`` is a bool tensor (of ``shape`` when given): TypeError / ValueError naming the fix."""
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(
            f"mask must be a bool tensor (True = the token takes part), got {_kind(mask)}"
            + (f" of shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else "")
            + "; convert it with mask.bool() or mask > 0"
        )
    if shape is not None and mask.shape != tuple(shape):
        raise ValueError(
            f"mask has shape {tuple(mask.shape)} but the per-token values have shape "
            f"{tuple(shape)}; both must be [B, T] over the same tokens"
        )


def check_finite(name: str, t: Tensor, mask: Tensor | None = None, **more: Tensor) -> None:
    """ValueError naming the first argument with non-finite entries (where ``mask``) and its count.

    ``name``/``t`` and every ``more`` tensor (``logp_ref=...``) are checked with one host sync on
    the happy path (``isfinite`` per tensor, combined, one ``.all()``); the counts are computed
    only when the check fails. Positions where ``mask`` is False are not checked: they may hold
    padding of any value.
    """
    named = {name: t, **more}
    ok = None
    for x in named.values():
        f = torch.isfinite(x.detach())
        ok = f if ok is None else ok & f
    assert ok is not None
    if mask is not None:
        ok = ok | ~mask
    if bool(ok.all()):
        return

    def count(x: Tensor) -> int:
        bad_at = ~torch.isfinite(x.detach())
        return int((bad_at & mask if mask is not None else bad_at).sum())

    arg, bad = next((a, n) for a, n in ((a, count(x)) for a, x in named.items()) if n)
    where = " at unmasked positions" if mask is not None else ""
    raise ValueError(
        f"{arg} has {bad} non-finite entr{'y' if bad == 1 else 'ies'} (NaN or ±inf){where} "
        f"out of {named[arg].numel()}; log-probabilities of sampled tokens are finite, so this is an "
        f"upstream bug (a NaN in the model's logits, or a token the reference gives probability "
        f"0, e.g. a masked or filtered vocabulary): fix the input, or mask those positions out"
    )
