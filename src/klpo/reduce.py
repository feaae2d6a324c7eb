r"""The named loss aggregations: from a per-token ``[B, T]`` tensor to one scalar.

Every loss in :mod:`klpo.losses` is per token; reducing it is a separate, named step, because the
choice changes the gradient (DAPO §3.3, Dr. GRPO §3.1). With ``x`` the per-token values, ``m`` the
mask (True = the token takes part), ``n_b = sum_t m_bt`` the length of sequence ``b`` and ``S`` the
number of sequences with ``n_b > 0``:

| mode                       | value                                              | used by |
| -------------------------- | -------------------------------------------------- | ------- |
| ``token-mean``             | sum_b sum_t m x / sum_b n_b                        | DAPO eq. 12, verl's and TRL's default |
| ``seq-mean-token-mean``    | (1/S) sum_{b: n_b > 0} (1/n_b) sum_t m x           | GRPO as written (DeepSeekMath eq. 3) |
| ``seq-mean-token-sum``     | (1/S) sum_b sum_t m x                              | sequence-level REINFORCE |
| ``seq-mean-token-sum-norm``| (1/(S · max_len)) sum_b sum_t m x                  | Dr. GRPO (constant normaliser) |

**Fully masked sequences** (``n_b = 0``) contribute nothing to any sum, never produce NaN, and are
**not counted** in ``S``: a row that takes no part in the loss does not dilute it. This is verl's
``agg_loss`` (``verl/trainer/ppo/core_algos.py``, "exclude fully masked sequences") and OpenRLHF's
``aggregate_loss``. TRL's ``loss_type="dr_grpo"`` differs: it divides by
``batch_size × max_completion_length``, counting empty rows too; klpo follows verl, so with no empty
row the two agree.

**Dr. GRPO's constant.** ``seq-mean-token-sum-norm`` replaces GRPO's per-sequence ``1/n_b`` (its
length bias) by a constant ``1/max_len``, the generation limit (Liu et al. 2025, arXiv:2503.20783,
"masked_sum with a constant normalizer = generate_max_length" in their code). ``max_len`` must be
given: verl's default, the padded width of the batch, changes from batch to batch and from
micro-batch to micro-batch, which is neither constant nor split-invariant.

**Micro-batches and data-parallel ranks.** Every mode is ``sum_b f_b(x_b, m_b) / N`` with a
per-sequence term ``f_b`` (a sequence is never split) and a denominator ``N`` that is *additive*
over disjoint sets of sequences: ``N`` = the token count, or ``S``, or ``S · max_len``. So with
``N_global = sum_i normaliser(mask_i, mode, max_len=L)`` (an all-reduce across ranks, a sum across
micro-batches),

    sum_i reduce(x_i, mask_i, mode, normaliser=N_global, max_len=L) == reduce(x, mask, mode, max_len=L)

exactly up to float rounding, value and gradient. Under DDP, whose all-reduce *averages* gradients,
multiply each rank's loss by the world size (verl's ``* dp_size``).

Masking uses ``torch.where``, never multiplication: an estimate may be ``+inf`` at a masked token
(see :mod:`klpo.kl`) and ``inf * 0`` is NaN. Sums are accumulated in float32 (float64 if the input is
float64); the result has that dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klpo._tensor import check_mask
from klpo.registry import MODES, Mode

__all__ = ["MODES", "Mode", "masked_mean", "masked_sum", "normaliser", "reduce"]


def _check_mask(x: Tensor, mask: Tensor) -> None:
    check_mask(mask)
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch tensor, got {type(x).__name__}")
    check_mask(mask, x.shape)


def _acc(x: Tensor) -> Tensor:
    """float32 for accumulation (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.to(torch.float32)


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x`` over the tokens where ``mask`` is True; masked entries add exactly zero.

    Args:
        x: any shape, float.
        mask: bool, the shape of ``x``.
        dim: dimension(s) to reduce; None for all.

    Returns:
        the sum, float32 (float64 for float64 input). Gradient: ``mask`` (1 at valid entries, 0
        at masked ones, even where ``x`` is inf or NaN).
    """
    _check_mask(x, mask)
    v = torch.where(mask, _acc(x), 0.0)
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over the tokens where ``mask`` is True; 0 (not NaN) where none is.

    Args / Returns: as :func:`masked_sum`; the gradient is ``mask / count``.
    """
    total = masked_sum(x, mask, dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(count > 0, total / count.clamp_min(1).to(total.dtype), 0.0)


def _check_mode(mode: str, max_len: int | None) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown reduction mode {mode!r}; choose one of: {', '.join(MODES)}")
    if mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError(
                "mode 'seq-mean-token-sum-norm' divides by a constant max_len (Dr. GRPO: the "
                "generation limit, e.g. max_new_tokens); pass max_len=..."
            )
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len <= 0:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")


def _normaliser(mask: Tensor, mode: str, *, max_len: int | None = None) -> Tensor:
    """The denominator of :func:`reduce` for ``mask``: additive over disjoint sets of sequences.

    ``token-mean``: the number of valid tokens; ``seq-mean-token-mean`` and
    ``seq-mean-token-sum``: the number of sequences with at least one valid token;
    ``seq-mean-token-sum-norm``: that number times ``max_len``. Sum it over micro-batches (or
    all-reduce it over ranks) and pass the total as ``reduce(..., normaliser=N)``.

    Args:
        mask: ``[B, T]`` bool.
        mode: one of :data:`MODES`.
        max_len: the constant length; required by ``seq-mean-token-sum-norm``, ignored otherwise.

    Returns:
        an int64 scalar tensor on ``mask``'s device (a count: exact at any batch size, and
        all-reducible as is).
    """
    _check_mode(mode, max_len)
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError(
            "mask must be a [B, T] bool tensor (True = the token takes part); "
            f"got {getattr(mask, 'dtype', type(mask).__name__)} "
            f"of shape {tuple(getattr(mask, 'shape', ()))}"
        )
    if mode == "token-mean":
        n = mask.sum()
    else:
        n = mask.any(dim=-1).sum()
        if mode == "seq-mean-token-sum-norm":
            n = n * max_len
    return n.to(torch.int64)


normaliser = _normaliser  # public name; `reduce` has a keyword argument of the same name


def reduce(
    x: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normaliser: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    r"""Reduce a per-token ``[B, T]`` tensor to a scalar with the named ``mode`` (see the module).

    Args:
        x: ``[B, T]`` per-token values (a loss); may be ``±inf``/NaN at masked tokens.
        mask: ``[B, T]`` bool.
        mode: one of :data:`MODES`.
        normaliser: the global denominator from :func:`normaliser`, summed over micro-batches
            and ranks; None to use this batch's own (``normaliser(mask, mode, max_len=max_len)``).
            A zero normaliser (nothing takes part anywhere) gives 0.
        max_len: the constant of ``seq-mean-token-sum-norm`` (used when ``normaliser`` is None).

    Returns:
        a scalar, float32 (float64 for float64 input). Gradient with respect to ``x``: ``1/N`` at
        valid tokens (``1/(N n_b)`` for ``seq-mean-token-mean``), exactly 0 at masked ones.
    """
    _check_mask(x, mask)
    if x.dim() != 2:
        raise ValueError(f"x must be [B, T], got shape {tuple(x.shape)}")
    if normaliser is None:
        n = _normaliser(mask, mode, max_len=max_len)
    elif mode not in MODES:
        raise ValueError(f"unknown reduction mode {mode!r}; choose one of: {', '.join(MODES)}")
    elif isinstance(normaliser, Tensor):
        n = normaliser
    else:
        if not normaliser >= 0:
            raise ValueError(f"normaliser must be >= 0, got {normaliser!r}")
        n = torch.tensor(float(normaliser), device=x.device)
    v = torch.where(mask, _acc(x), 0.0)
    if mode == "seq-mean-token-mean":
        n_b = mask.sum(dim=-1)
        per_seq = torch.where(n_b > 0, v.sum(dim=-1) / n_b.clamp_min(1).to(v.dtype), 0.0)
        total = per_seq.sum()
    else:
        total = v.sum()
    n = n.to(total.dtype)
    return torch.where(n > 0, total / torch.where(n > 0, n, 1.0), 0.0)
