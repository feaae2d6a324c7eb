r"""The ``fused`` kernel: token log-probs, entropy and exact KL from hidden states and the output head.

:func:`fused` (public as :func:`klpo.logprobs.fused`, where the equations and the gradient formula
are) computes ``logp``, ``entropy`` and ``kl = KL(pi_theta ‖ pi_ref)`` from ``hidden [N, H]``,
``weight [V, H]`` and an optional ``bias [V]`` (and the reference's), so that the logits
``hidden @ weight.T + bias`` never exist beyond one ``vocab_chunk x token_chunk`` tile. Its
backward pass is written by hand and recomputes the tiles. :class:`HeadTiles` reads a head tile by
tile; :func:`head_plan` picks the GEMM backends of a head; :mod:`klpo.fused_loss_kernel` shares
both.

Algorithm of :func:`fused` (one ``torch.autograd.Function``; its peers: Liger-Kernel's chunked
selective log-prob, TRL 1.16's ``ChunkedLogProbFunction`` and ``ChunkedDivergenceFunction``, Cut
Cross-Entropy, arXiv:2411.09009, and the online softmax of Milakov & Gimelshein, arXiv:1805.02867):

* Tiles are transposed, ``[vocab_chunk, token_chunk]``: vocabulary rows by token columns, so a
  per-token offset is the GEMM's bias (added in its epilogue, no pass over the tile) and the weight
  gradient's GEMM reads its operand contiguously. The three products and their backends are in
  :mod:`klpo.gemm`.
* Forward: for each tile, one GEMM ``weight_chunk @ (hidden / T).T - m`` (plus ``bias / T``),
  one ``exp``, and column sums; per token it keeps only ``s = sum exp(x - m)``,
  ``sum exp(x - m)(x - m)`` (entropy), ``sum exp(x - m)(x - m - x_ref + m_ref)`` and
  ``sum exp(x_ref - m_ref)`` (KL), from which ``L = m + log s``, ``logp = x_y - L``,
  ``entropy = log s - sum e (x - m) / s`` and ``kl = sum e (x - m - x_ref + m_ref) / s + log s_ref
  - log s``. The reference ``m`` is the target's own logit, computed exactly by a gathered dot
  product, so no max pass is needed and the KL's terms are differences from the target (small, so
  float32 keeps small KLs accurate); a token whose sums overflow (a logit more than ~88 above its
  target's) is recomputed with ``m = max_v x_v`` (found by one more pass over its tiles), so the
  result is exact either way.
* Backward: each tile is recomputed as ``log pi = x - L`` (``-L`` in the GEMM's epilogue), turned
  into ``G / T`` in place (``a`` is added at each target: no dense one-hot), and multiplied into
  the gradients. When only ``logp`` has a gradient (the policy-gradient loss), ``G / T = alpha pi
  + delta 1[v = y]`` and the per-token ``alpha`` is taken out of the tile: ``grad_hidden = alpha
  (pi @ weight) + delta weight[y]`` and ``grad_weight = pi.T @ (alpha hidden) + delta hidden`` at
  the targets' rows, so a tile costs one ``exp`` and its GEMMs. Only the inputs and a few floats
  per token are saved for the backward pass; no tile outlives its iteration, except by the
  saving below.
* Saving (:func:`saving`, :data:`SAVINGS`): the recompute is the fourth GEMM of a tile where a
  method that holds the logits runs three, so for a backward pass where only ``logp`` has a
  gradient the forward pass keeps what spares it, chosen once per call from the inputs' gradient
  flags: with a frozen head (no weight or bias gradient: a LoRA policy), ``pi @ weight``
  (``[N, H]``, one GEMM a tile in the forward pass), so the backward pass runs no tile at all (two
  GEMMs a tile in all, as naive with a frozen head); with a head gradient, the tiles' ``e = exp(x
  - x_y)`` in loop order up to :func:`keep_budget` floats (on a CPU every tile, ``N V`` floats, a
  third of what naive PyTorch holds; elsewhere as many as the head has weights, ``V H``: all of
  them for ``N ≤ H``), which the backward pass multiplies into the gradients with
  ``alpha / s`` in place of ``alpha`` (``pi = e / s``; the tiles past the budget are recomputed
  as ``e``), letting each go once used: three GEMMs a kept tile, no second ``exp``; off the CPU
  the kept tiles never outgrow the weight gradient, which fills the memory they free (the peak
  lies between the recomputing kernel's and that plus ``V H`` floats, as the allocator returns
  memory).
  Neither for the KL (its reference's tiles would double the memory), a soft cap (its
  ``dx/dz`` would be another tile) or a token whose sums overflowed (its ``e`` is not its
  ``pi``); with an entropy gradient the kept tiles go unused and the tiles are recomputed.
* Loop order: vocabulary chunks outside, token chunks inside, so each weight chunk is converted to
  float32 once per pass and the weight gradient of a chunk is finished before the next starts (no
  float32 ``[V, H]`` accumulator beside the gradient itself).

Precision: as in :mod:`klpo.logprobs` (float32 arithmetic, float64 for float64 inputs, bf16/fp16
upcast exactly, gradients accumulated in float32 and cast to the inputs' dtypes once), with one
exception, for speed: with a bf16 head and hidden states on CPU and at most ``token_chunk``
tokens, the weight gradient's GEMM multiplies ``G`` rounded to bf16 with the bf16 hidden states,
accumulating in float32 inside the GEMM and rounding once to bf16 (as TRL's GPU kernel does); its
extra error is at most ``2^-8 |G|^T |hidden|``, the size of the bf16 rounding the gradient gets
anyway.

Speed on CPU: the GEMMs dominate (four per tile for log-probs: forward, recompute, and the two
gradients; six for KL), so the floor of this recomputing kernel is 4/3 (log-probs) or 6/4 (KL) of
the GEMMs a method that keeps the logits needs; the saving brings log-probs to three (two for a
frozen head) where it applies. Each of the three GEMM roles runs on the backend
measured fastest on the machine, oneDNN or torch.mm, once and cached (:mod:`klpo.gemm`): on an
AVX-512 CPU oneDNN's float32 GEMM is the faster, on one without AVX-512 (or with oneDNN capped at
AVX2) MKL's often is. ``exp`` is the only elementwise pass that costs, so the passes are kept to one
``exp`` per tile and model. The tile sizes and the measurements are in docs/performance.md
(``bench/logprobs.py``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from klpo import gemm
from klpo._logits import (
    Affine,
    FusedOutput,
    HeadArgs,
    LogitTransform,
    add_at_targets,
    add_column_dots,
    add_column_sums,
    check_head_args,
    coefficients,
    compute_dtype,
    grad_tile,
    head_inputs,
    slope_of,
)

__all__ = [
    "KEEP_ALL_ON_CPU",
    "KEEP_PER_WEIGHT",
    "PLAN_TOKENS",
    "SAVINGS",
    "TILE_ELEMENTS",
    "TOKEN_CHUNK",
    "VOCAB_CHUNK_MAX",
    "HeadTiles",
    "Saving",
    "check_head_args",
    "default_vocab_chunk",
    "fused",
    "given_or_head_plan",
    "head_plan",
    "keep_budget",
    "saving",
]


# Tile of the fused path: up to TOKEN_CHUNK tokens by TILE_ELEMENTS / tokens vocabulary entries
# (rounded down to a power of two in [512, VOCAB_CHUNK_MAX]). On a 2-core AVX-512 CPU
# (``bench/logprobs.py --sweep``) forward + backward time was flat (within the ±7% run-to-run
# noise) for token chunks of 512-4096 and vocabulary chunks of 512-4096 at 1024 tokens; with few
# tokens a narrow tile starves the GEMM: at 256 tokens, H = 896, V = 32000 and both backends
# capped at AVX2, the logits' GEMMs took 1.6-1.8x longer (torch.mm) and 1.3x (oneDNN) in
# vocabulary chunks of 2048 than of 8192 (docs/performance.md). So the tile holds 2^21 logits
# (8 MiB in float32) and grows to 8192 vocabulary entries for short inputs. Up to 4096 tokens make
# one token chunk, which also lets a bf16 head take the bf16 weight-gradient GEMM (module notes).
TOKEN_CHUNK = 4096
TILE_ELEMENTS = 1 << 21
VOCAB_CHUNK_MAX = 8192


def default_vocab_chunk(tokens: int) -> int:
    """The vocabulary width of a tile of ``tokens`` rows: ``TILE_ELEMENTS / tokens`` rounded down to
    a power of two, clamped to [512, VOCAB_CHUNK_MAX]."""
    width = TILE_ELEMENTS // max(tokens, 1)
    return min(VOCAB_CHUNK_MAX, max(512, 1 << max(width.bit_length() - 1, 0)))


class HeadTiles:
    """One model's head in the compute dtype, by tiles: ``x = lin (hidden @ weight.T + bias)``
    (``lin = scale / T``), or ``x = cap_t tanh(lin (hidden @ weight.T + bias))`` with a soft cap
    (``lin = scale / cap``, ``cap_t = cap / T``); see :class:`klpo._logits.Affine`."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        aff: Affine,
        cd: torch.dtype,
        plan: gemm.Plan,
    ) -> None:
        lin = aff.lin
        self.given = hidden  # [N, H] as given, for the bf16 weight-gradient GEMM
        self.hidden = hidden.to(cd)  # [N, H], unscaled, for the weight gradient
        self.hidden_t = self.hidden if lin == 1.0 else self.hidden * lin  # [N, H] = lin h
        self.weight = weight  # [V, H], chunks converted on use
        self.bias_t = None if bias is None else bias.to(cd) * lin  # [V] = lin b
        self.aff = aff
        self.cd = cd
        self.plan = plan
        self._buffer: Tensor | None = None

    @property
    def capped(self) -> bool:
        return self.aff.cap_t is not None

    def chunk(self, v0: int, v1: int) -> Tensor:
        """``weight[v0:v1]`` in the compute dtype, converted into one reused buffer.

        A fresh buffer per chunk costs page faults that make the conversion ~5x slower.
        """
        w = self.weight[v0:v1]
        if w.dtype == self.cd:
            return w.contiguous()
        if self._buffer is None or self._buffer.shape[0] < v1 - v0:
            self._buffer = torch.empty(v1 - v0, w.shape[1], dtype=self.cd, device=w.device)
        return self._buffer[: v1 - v0].copy_(w)

    def tile(self, w_chunk: Tensor, v0: int, t: slice, offset: Tensor | None) -> Tensor:
        """``(x[t, v0:v0+vc] - offset[t]).T``: ``[vc, n]``, vocabulary rows by token columns.

        Transposed so that the per-token ``-offset`` is the GEMM's bias (added in its epilogue,
        no pass over the tile); a head's own bias (per vocabulary row) is one more pass. A soft
        cap takes two more (``tanh``, then ``cap_t y - offset``), the offset after the cap.
        """
        if self.capped:
            return self.tile_slope(w_chunk, v0, t, offset, False)[0]
        neg = None if offset is None else -offset[t]
        x = gemm.logits(w_chunk, self.hidden_t[t], neg, self.plan.logits)
        if self.bias_t is not None:
            x.add_(self.bias_t[v0 : v0 + w_chunk.shape[0], None])
        return x

    def tile_slope(
        self, w_chunk: Tensor, v0: int, t: slice, offset: Tensor | None, want_slope: bool = True
    ) -> tuple[Tensor, Tensor | None]:
        """The tile of :meth:`tile` and, for a capped head, ``dx/dz`` at each of its entries
        (a second ``[vc, n]`` tensor; None for an uncapped head, whose ``dx/dz`` is constant)."""
        if not self.capped:
            return self.tile(w_chunk, v0, t, offset), None
        y = gemm.logits(w_chunk, self.hidden_t[t], None, self.plan.logits)
        if self.bias_t is not None:
            y.add_(self.bias_t[v0 : v0 + w_chunk.shape[0], None])
        y.tanh_()
        slope = slope_of(y, self.aff) if want_slope else None
        if offset is None:
            return y.mul_(self.aff.cap_t), slope
        return torch.add(-offset[t][None, :], y, alpha=self.aff.cap_t, out=y), slope

    def target_logits(self, tokens: Tensor) -> Tensor:
        """``x_y`` for each token, by a gathered dot product: ``[N]``."""
        x = torch.linalg.vecdot(self.hidden_t, self.weight[tokens].to(self.cd))
        x = x if self.bias_t is None else x + self.bias_t[tokens]
        return x if not self.capped else x.tanh_().mul_(self.aff.cap_t)

    def target_slope(self, tokens: Tensor) -> Tensor | None:
        """``dx/dz`` at each token's own logit, ``[N]`` (None for an uncapped head)."""
        if not self.capped:
            return None
        y = torch.linalg.vecdot(self.hidden_t, self.weight[tokens].to(self.cd))
        y = y if self.bias_t is None else y + self.bias_t[tokens]
        return slope_of(y.tanh_(), self.aff)

    def row_max(self, token_chunk: int, vocab_chunk: int) -> Tensor:
        """``max_v x_v`` for each token, one more pass over the tiles: ``[N]``."""
        n, vocab = self.hidden.shape[0], self.weight.shape[0]
        m = torch.full((n,), -math.inf, dtype=self.cd, device=self.hidden.device)
        for v0 in range(0, vocab, vocab_chunk):
            w = self.chunk(v0, min(v0 + vocab_chunk, vocab))
            for t0 in range(0, n, token_chunk):
                t = slice(t0, min(t0 + token_chunk, n))
                m[t] = torch.maximum(m[t], self.tile(w, v0, t, None).amax(0))
        return m

    def subset(self, idx: Tensor) -> HeadTiles:
        head = object.__new__(HeadTiles)
        head.hidden, head.hidden_t = self.hidden[idx], self.hidden_t[idx]
        head.weight, head.bias_t, head.cd, head.plan = self.weight, self.bias_t, self.cd, self.plan
        head.aff, head._buffer = self.aff, None
        return head


def _sums(
    pol: HeadTiles,
    ref: HeadTiles | None,
    m: Tensor,
    m_ref: Tensor | None,
    with_entropy: bool,
    chunks: tuple[int, int],
    keep: tuple[list[Tensor | None] | None, Tensor | None, int] = (None, None, 0),
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-token sums over the vocabulary, relative to the references ``m`` and ``m_ref``.

    With ``e_v = exp(x_v - m)``: ``s = sum e``, ``s_x = sum e (x - m)`` (entropy),
    ``s_d = sum e (x - m - x_ref + m_ref)`` and ``s_ref = sum exp(x_ref - m_ref)`` (KL).
    ``keep = (tiles, unit, budget)`` (the backward pass's saving, :func:`saving`): ``tiles`` a
    list that gets each tile's ``e`` (``[vc, n]``, in loop order) while the kept tiles hold at
    most ``budget`` floats, None for each tile after that; ``unit`` a float32 ``[N, H]`` of zeros
    that gets ``sum_v e_v weight_v`` added (the hidden states' gradient before its per-token
    factor); None: not wanted.
    """
    token_chunk, vocab_chunk = chunks
    tiles, unit, budget = keep
    n, vocab = pol.hidden.shape[0], pol.weight.shape[0]

    def zeros() -> Tensor:
        return torch.zeros(n, dtype=pol.cd, device=m.device)

    s = zeros()
    s_x = zeros() if with_entropy else None
    s_d = None if ref is None else zeros()
    s_ref = None if ref is None else zeros()
    keep_x = with_entropy or ref is not None
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = pol.chunk(v0, v1)
        w_ref = None if ref is None else ref.chunk(v0, v1)
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            x = pol.tile(w, v0, t, m)  # [vc, n]
            e = torch.exp(x) if keep_x else x.exp_()
            add_column_sums(s[t], e)
            if tiles is not None:
                fits = e.numel() <= budget
                tiles.append(e if fits else None)
                budget = budget - e.numel() if fits else 0  # kept: a prefix in loop order
            if unit is not None:
                gemm.grad_hidden(unit[t], e, w, pol.plan.grad_hidden)
            if s_x is not None:
                add_column_dots(s_x[t], e, x)
            if ref is not None:
                x_ref = ref.tile(w_ref, v0, t, m_ref)
                add_column_dots(s_d[t], x.sub_(x_ref), e)
                add_column_sums(s_ref[t], x_ref.exp_())
    return s, s_x, s_d, s_ref


def _finish(
    x_y: Tensor,
    m: Tensor,
    sums: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None],
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """(logp, L, entropy, kl) from the sums of :func:`_sums`, unclamped."""
    s, s_x, s_d, s_ref = sums
    log_s = torch.log(s)
    logp = (x_y - m) - log_s
    ent = None if s_x is None else log_s - s_x / s
    kl = None if s_d is None else s_d / s + (torch.log(s_ref) - log_s)
    return logp, m + log_s, ent, kl


PLAN_TOKENS = 256
"""A head is measured for its GEMM plan when this many tokens' logits cost ``gemm.MIN_FLOPS``."""


def head_plan(hidden: Tensor, weight: Tensor, dtype: torch.dtype | None = None) -> gemm.Plan:
    """The GEMM backends :func:`fused` and :func:`klpo.logprobs.fused_loss` take for a head unless
    given a ``plan`` (:class:`klpo.gemm.Plan`): measured once per machine for heads big enough to
    gain from it (:data:`PLAN_TOKENS`), the static default for small ones, torch.mm for every
    product where torch has no oneDNN (:data:`klpo.gemm.ONEDNN`).

    Chosen by the head alone, never by the number of tokens in the call: two backends round a
    logit differently, so a row's log-prob would depend on the batch it came in (the scoring
    pass's whole batch against the update's micro-batch).

    Args:
        hidden: ``[..., H]`` the hidden states (only their dtype and device are read).
        weight: ``[V, H]`` the head.
        dtype: the compute dtype (default: float64 if either is float64, else float32).
    """
    cd = compute_dtype(hidden, weight) if dtype is None else dtype
    if not gemm.ONEDNN:
        return gemm.Plan("mm", "mm", "mm", False)
    low = hidden.dtype == weight.dtype == torch.bfloat16
    dtype = torch.bfloat16 if low else cd
    vocab, h = weight.shape
    if 2.0 * PLAN_TOKENS * vocab * h < gemm.MIN_FLOPS:
        return gemm.default_plan(dtype, hidden.device)
    return gemm.plan(h, dtype, hidden.device)


def given_or_head_plan(
    plan: gemm.Plan | None, hidden: Tensor, weight: Tensor, dtype: torch.dtype
) -> gemm.Plan:
    """A kernel's ``plan`` argument checked, or :func:`head_plan`'s when it is None."""
    if plan is None:
        return head_plan(hidden, weight, dtype)
    if not isinstance(plan, gemm.Plan) or not all(
        b in gemm.BACKENDS for b in (plan.logits, plan.grad_hidden, plan.grad_weight)
    ):
        raise TypeError(
            f"plan must be a klpo.gemm.Plan of backends {gemm.BACKENDS} or None (the head's own "
            f"choice), got {plan!r}"
        )
    return plan


def _backward_logp(
    pol: HeadTiles,
    tokens: Tensor,
    scale: tuple[Tensor, Tensor, Tensor | None],
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    ctx,
    saved: tuple[list[Tensor | None] | None, Tensor | None] = (None, None),
) -> None:
    """The backward pass when only ``logp`` has a gradient: ``G / T = alpha pi + delta 1[v = y]``.

    The per-token ``alpha`` is taken out of the tiles: ``grad_hidden = alpha * (pi @ W) + delta
    W[y]`` (one row scaling at the end) and ``grad_weight = pi.T @ (alpha * hidden) + the targets'
    rows delta * hidden`` (``alpha * hidden`` formed once), so a tile is one GEMM, one ``exp`` and
    two GEMMs: no pass to scale it or to add at the targets. A soft-capped head multiplies each
    tile by its ``dx/dz`` (``delta`` comes with the targets' own). Fills ``grads = (grad_h,
    grad_w, grad_b)`` in place (``grad_h`` float32 ``[N, H]`` zeros; None: not needed).

    A tile is ``exp(x - offset)``: ``pi`` with ``offset = log Z``. ``saved = (tiles, unit)``,
    what the forward pass kept (:func:`saving`; the module notes say how each stands in for the
    tiles), with ``alpha / s`` as ``alpha`` for kept tiles; None: recompute.
    """
    offset, alpha, delta = scale
    tiles, unit = saved
    grad_h, grad_w, grad_b = grads
    cd, plan = pol.cd, pol.plan
    token_chunk, vocab_chunk = ctx.token_chunk, ctx.vocab_chunk
    n, hs = pol.hidden.shape
    vocab = pol.weight.shape[0]
    device = pol.hidden.device
    ha = None if grad_w is None else pol.hidden * alpha[:, None]  # [N, H]
    direct = grad_w is not None and n <= token_chunk and grad_w.dtype == cd
    gb = None if grad_b is None else torch.zeros(vocab, dtype=cd, device=device)
    dw_buffer = None
    if grad_w is not None and not direct:
        dw_buffer = torch.empty(min(vocab_chunk, vocab), hs, dtype=cd, device=device)
    tile_h = grad_h  # the tiles' part of the hidden states' gradient, unless saved
    if unit is not None and grad_h is not None:
        grad_h.copy_(unit)
        tile_h = None
    tiles_needed = tile_h is not None or grad_w is not None or gb is not None
    k = 0  # the next saved tile
    for v0 in range(0, vocab if tiles_needed else 0, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = pol.chunk(v0, v1)
        dw = None
        if grad_w is not None:
            dw = grad_w[v0:v1] if direct else dw_buffer[: v1 - v0]
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            pi = None
            if tiles is not None:
                pi, tiles[k], k = tiles[k], None, k + 1  # s pi.T: [vc, n], let go after use
            if pi is None:
                pi, slope = pol.tile_slope(w, v0, t, offset)
                pi.exp_()  # pi.T: [vc, n]
                if slope is not None:  # a soft cap: dx/dz at each entry (alpha taken out still)
                    pi.mul_(slope)
            if tile_h is not None:
                gemm.grad_hidden(tile_h[t], pi, w, plan.grad_hidden)
            if dw is not None:
                gemm.grad_weight(dw, pi, ha[t], plan.grad_weight, t0 > 0)
            if gb is not None:
                gb[v0:v1] += pi @ alpha[t]
        if delta is not None and dw is not None:
            rows = tokens - v0
            inside = (rows >= 0) & (rows < v1 - v0)
            if bool(inside.any()):
                # index_put_ (accumulate): index_add_ takes ~0.3 s here whatever the row count.
                src = pol.hidden[inside] * delta[inside, None]
                dw.index_put_((rows[inside],), src, accumulate=True)
        if dw is not None and not direct:
            grad_w[v0:v1] = dw
    if grad_h is not None:
        grad_h.mul_(alpha[:, None])
        if delta is not None:
            grad_h.add_(pol.weight[tokens].to(cd) * delta[:, None])
    if gb is not None:
        if delta is not None:
            gb.index_put_((tokens,), delta, accumulate=True)
        grad_b.copy_(gb)


def _redo_overflowed(
    pol: HeadTiles,
    ref: HeadTiles | None,
    x_y: Tensor,
    outs: tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None],
    with_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
) -> None:
    """The tokens whose sums overflowed (a logit ~88 above the target's) redone with the row's max
    as the reference (one more pass over their tiles, :meth:`HeadTiles.row_max`), in place in
    ``outs = (logp, log_z, entropy, kl, log_z_ref)``; nothing to do where every output is finite.
    Returns whether any token was redone."""
    logp, log_z, ent, kl, log_z_ref = outs
    finite = torch.isfinite(logp)
    for t in (ent, kl, log_z_ref):
        if t is not None:
            finite &= torch.isfinite(t)
    if bool(finite.all()):
        return False
    idx = (~finite).nonzero()[:, 0]
    pol_i = pol.subset(idx)
    ref_i = None if ref is None else ref.subset(idx)
    m_i = pol_i.row_max(token_chunk, vocab_chunk)
    m_ref_i = None if ref_i is None else ref_i.row_max(token_chunk, vocab_chunk)
    sums_i = _sums(pol_i, ref_i, m_i, m_ref_i, with_entropy, (token_chunk, vocab_chunk))
    logp_i, log_z_i, ent_i, kl_i = _finish(x_y[idx], m_i, sums_i)
    logp[idx], log_z[idx] = logp_i, log_z_i
    if ent is not None:
        ent[idx] = ent_i
    if kl is not None:
        kl[idx] = kl_i
        log_z_ref[idx] = m_ref_i + torch.log(sums_i[3])
    return True


KEEP_PER_WEIGHT = 1.0
""":func:`fused` keeps at most this many forward tiles' logits per weight of the head (``V H``)
for a log-prob-only backward pass (:func:`saving`), off the CPU (and on it with
:data:`KEEP_ALL_ON_CPU` false): the kept tiles then never outgrow the weight gradient, which fills
the memory they free as the backward pass uses them, so the peak lies between the recomputing
kernel's and that plus ``V H`` floats (as the allocator returns freed memory;
docs/performance.md). Every tile is kept for ``N ≤ H``, a share ``H / N`` past that."""

KEEP_ALL_ON_CPU = True
""":func:`fused` on a CPU keeps every tile (``N V`` floats, about a third of the logits, their
log-softmax and its gradient that naive PyTorch holds at once): measured on an AVX2 CPU at V =
151,936, the share ``H / N`` of :data:`KEEP_PER_WEIGHT` took 1.10x naive's time at N = 2,048 and
1.04x at 4,096, every tile 0.86x and 0.81x at 0.50x and 0.41x naive's peak
(docs/performance.md, "Small micro-batches"). On an accelerator memory is the scarcer of the two,
and the budget stays the head's size."""


def keep_budget(vocab: int, hidden_size: int, tokens: int = 0, device: str = "") -> int:
    """How many logits :func:`fused` may keep for its backward pass: :data:`KEEP_PER_WEIGHT` per
    weight of a ``[vocab, hidden_size]`` head, or on a CPU (``device`` ``"cpu"``, with
    :data:`KEEP_ALL_ON_CPU`) at least every one of the ``tokens`` rows' logits."""
    budget = int(KEEP_PER_WEIGHT * vocab * hidden_size)
    if KEEP_ALL_ON_CPU and device == "cpu":
        budget = max(budget, tokens * vocab)
    return budget


class Saving(NamedTuple):
    """What :func:`fused`'s forward pass keeps for a log-prob-only backward pass.

    Attributes:
        tiles: the tiles' ``e = exp(x - x_y)`` up to :func:`keep_budget` floats: the backward
            pass runs the two gradient GEMMs on them instead of recomputing them (three GEMMs a
            kept tile, as a method that holds the logits; four a tile past the budget).
        unit: ``pi @ W`` (``[N, H]``, one more GEMM a tile in the forward pass): the hidden
            states' gradient for a frozen head, so the backward pass needs no tile (two GEMMs
            a tile in all, as naive with a frozen head).
    """

    tiles: bool
    unit: bool


SAVINGS: dict[str, Saving] = {
    "recompute": Saving(False, False),
    "tiles": Saving(True, False),
    "unit": Saving(False, True),
}


def saving(
    pol: HeadTiles, ref: HeadTiles | None, needs: tuple[bool, bool, bool], chunks: tuple[int, int]
) -> str:
    """Which :data:`SAVINGS` row :func:`fused`'s forward pass takes, from what it knows before the
    backward pass: ``needs``, whether hidden, weight and bias get a gradient (all False when
    autograd does not record the call), and ``chunks = (token_chunk, vocab_chunk)``.

    Both savings serve a backward pass where only ``logp`` has a gradient (the policy-gradient
    loss; with an entropy gradient too the tiles are recomputed and the saving goes unused).
    ``"unit"`` where only the hidden states get a gradient (a frozen head: LoRA); ``"tiles"``
    where the head gets one and :func:`keep_budget` holds a tile (the budget's tiles are kept,
    the rest recomputed); ``"recompute"`` otherwise, and
    always for a reference (the KL), a soft cap (its ``dx/dz`` would be one more tile) and the
    bf16 weight-gradient GEMM (which takes the recompute path).
    """
    need_h, need_w, need_b = needs
    vocab, hidden_size = pol.weight.shape
    token_chunk, vocab_chunk = chunks
    tile = min(pol.hidden.shape[0], token_chunk) * min(vocab_chunk, vocab)
    if ref is not None or pol.capped or not (need_h or need_w or need_b):
        return "recompute"
    if not (need_w or need_b):
        return "unit"
    bf16_w = _bf16_grad_weight(pol, need_w, token_chunk)
    budget = keep_budget(vocab, hidden_size, pol.hidden.shape[0], pol.hidden.device.type)
    if budget >= tile and not bf16_w:
        return "tiles"
    return "recompute"


class _Fused(torch.autograd.Function):
    """``(logp, entropy, kl)`` from hidden states and the head (:func:`fused`); the backward
    pass recomputes the tiles (:func:`_backward_logp` when only ``logp`` has a gradient, else
    :func:`_backward_tiles`), or takes what the forward pass kept (:func:`saving`)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        tokens: Tensor,
        hidden_ref: Tensor | None,
        weight_ref: Tensor | None,
        bias_ref: Tensor | None,
        aff: Affine,
        aff_ref: Affine,
        with_entropy: bool,
        token_chunk: int,
        vocab_chunk: int,
        plan: gemm.Plan,
        grad_on: bool,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``grad_on``: whether autograd records the call (inside a Function's forward it never
        does, and ``ctx.needs_input_grad`` does not say)."""
        ctx.set_materialize_grads(False)
        cd = compute_dtype(hidden, weight, bias, hidden_ref, weight_ref, bias_ref)
        pol = HeadTiles(hidden, weight, bias, aff, cd, plan)
        ref = (
            None
            if hidden_ref is None
            else HeadTiles(hidden_ref, weight_ref, bias_ref, aff_ref, cd, plan)
        )
        needs = ctx.needs_input_grad[:3] if grad_on else (False, False, False)
        kept = SAVINGS[saving(pol, ref, needs, (token_chunk, vocab_chunk))]
        tiles = [] if kept.tiles else None
        unit = torch.zeros(pol.hidden.shape, dtype=cd, device=hidden.device) if kept.unit else None
        # References: the targets' own logits, so e = exp(x - x_y) = pi / pi(y) needs no max pass.
        x_y = pol.target_logits(tokens)
        m_ref = None if ref is None else ref.target_logits(tokens)
        budget = keep_budget(*weight.shape, hidden.shape[0], hidden.device.type)
        keep = (tiles, unit, budget)
        sums = _sums(pol, ref, x_y, m_ref, with_entropy, (token_chunk, vocab_chunk), keep)
        logp, log_z, ent, kl = _finish(x_y, x_y, sums)
        log_z_ref = None if ref is None else m_ref + torch.log(sums[3])

        redone = _redo_overflowed(
            pol, ref, x_y, (logp, log_z, ent, kl, log_z_ref), with_entropy, token_chunk, vocab_chunk
        )
        inv_s = None
        if tiles is not None or unit is not None:
            # pi = e / s. A redone token's e overflowed, and 1 / s below float32's normal range
            # (a target ~87 nats below the row's max) would lose digits: recompute instead.
            inv_s = torch.reciprocal(sums[0])
            if redone or not bool((inv_s >= torch.finfo(cd).tiny).all()):
                tiles = unit = inv_s = None
            elif unit is not None:
                unit.mul_(inv_s[:, None])
        logp = logp.clamp_max(0.0)
        ent = None if ent is None else ent.clamp_min(0.0)
        kl = None if kl is None else kl.clamp_min(0.0)
        saved = (hidden, weight, bias, tokens, hidden_ref, weight_ref, bias_ref, log_z, log_z_ref)
        # x_y: the offset of the tiles past the budget, recomputed as the kept ones, e = s pi.
        ctx.save_for_backward(*saved, ent, kl, inv_s, unit, None if tiles is None else x_y)
        # The tiles are held by ctx itself, not saved, so that the backward pass can let each go
        # once used: the weight gradient then fills the memory they free, and the peak is the
        # larger of the two, not their sum.
        ctx.tiles = tiles
        ctx.aff, ctx.aff_ref, ctx.cd = aff, aff_ref, cd
        ctx.token_chunk, ctx.vocab_chunk, ctx.plan = token_chunk, vocab_chunk, plan
        return logp, ent, kl

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_kl):
        hidden, weight, bias, tokens, hidden_ref, weight_ref, bias_ref, *rest = ctx.saved_tensors
        log_z, log_z_ref, ent, kl, inv_s, unit, x_y = rest
        # Taken from ctx, so that they go tile by tile as used (and with the first backward pass
        # whatever it needs: a second one, under retain_graph, recomputes).
        tiles, ctx.tiles = ctx.tiles, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 14
        if grad_logp is None and grad_entropy is None and grad_kl is None:
            return none
        if not (need_h or need_w or need_b):
            return none
        cd, aff = ctx.cd, ctx.aff
        alpha, beta, gamma, delta = coefficients(
            grad_logp, grad_entropy, grad_kl, ent, kl, aff.coef, cd
        )
        # Row vectors: the tiles are [vc, n], vocabulary by tokens.
        alpha = alpha.expand(log_z.shape)[None, :]
        beta = None if beta is None else beta[None, :]
        gamma = None if gamma is None else gamma[None, :]
        plan = ctx.plan
        pol = HeadTiles(hidden, weight, bias, aff, cd, plan)
        ref = (
            None
            if gamma is None
            else HeadTiles(hidden_ref, weight_ref, bias_ref, ctx.aff_ref, cd, plan)
        )
        if delta is not None and pol.capped:  # the targets' part, times dx/dz at the target
            delta = delta * pol.target_slope(tokens)
        device = hidden.device
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        grads = (grad_h, grad_w, grad_b)
        if beta is None and gamma is None and not _bf16_grad_weight(pol, need_w, ctx.token_chunk):
            if tiles is None:  # the tiles are pi = exp(x - log Z)
                _backward_logp(pol, tokens, (log_z, alpha[0], delta), grads, ctx, (None, unit))
            else:  # the tiles are e = exp(x - x_y) = s pi, kept or recomputed
                a = alpha[0] * inv_s
                _backward_logp(pol, tokens, (x_y, a, delta), grads, ctx, (tiles, None))
        else:
            coefs = (alpha, beta, gamma, delta)
            _backward_tiles(pol, ref, tokens, (log_z, log_z_ref), coefs, grads, ctx)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            grad_w,
            grad_b,
            *(None,) * 11,
        )


def _bf16_grad_weight(pol: HeadTiles, need_w: bool, token_chunk: int) -> bool:
    """Whether the weight gradient's GEMM takes the tiles in bf16 (the plan says so and the
    tokens are one chunk): only :func:`_backward_tiles` does that."""
    return need_w and pol.plan.bf16_grad_weight and pol.hidden.shape[0] <= token_chunk


def _backward_tiles(
    pol: HeadTiles,
    ref: HeadTiles | None,
    tokens: Tensor,
    log_zs: tuple[Tensor, Tensor | None],
    coefs: tuple[Tensor, Tensor | None, Tensor | None, Tensor | None],
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    ctx,
) -> None:
    """The backward pass of any combination of the three outputs (module notes): each tile
    recomputed as ``log pi`` (and ``log pi_ref`` for the KL's gradient), turned into ``G / T`` in
    place (:func:`klpo._logits.grad_tile`; ``delta`` added at the targets), and multiplied into
    the gradients. ``coefs`` are :func:`klpo._logits.coefficients`' as row vectors (``delta``
    with the targets' ``dx/dz``); the bf16 weight-gradient GEMM (:func:`_bf16_grad_weight`)
    reads the hidden states as given (``pol.given``); fills ``grads = (grad_hidden,
    grad_weight, grad_bias)`` (None: not needed) in place, ``grad_hidden`` from zeros; ``ctx``
    gives the chunk sizes."""
    log_z, log_z_ref = log_zs
    alpha, beta, gamma, delta = coefs
    grad_h, grad_w, grad_b = grads
    need_h, need_w, need_b = (g is not None for g in grads)
    token_chunk, vocab_chunk = ctx.token_chunk, ctx.vocab_chunk
    bf16_w = _bf16_grad_weight(pol, need_w, token_chunk)
    cd, plan = pol.cd, pol.plan
    hidden = pol.given
    n, vocab = hidden.shape[0], pol.weight.shape[0]
    device = hidden.device
    one_token_chunk = n <= token_chunk
    g_low = None  # G.T in bf16, reused across vocabulary chunks
    col = slice(None)
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = pol.chunk(v0, v1)
        w_ref = None if ref is None else ref.chunk(v0, v1)
        grad_w_chunk = None
        if need_w and not one_token_chunk:
            grad_w_chunk = torch.zeros(v1 - v0, hidden.shape[1], dtype=cd, device=device)
        grad_b_chunk = torch.zeros(v1 - v0, dtype=cd, device=device) if need_b else None
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            tc = (col, t)
            log_pi, slope = pol.tile_slope(w, v0, t, log_z)  # [vc, n]
            log_pi_ref = None if gamma is None else ref.tile(w_ref, v0, t, log_z_ref)
            g = grad_tile(
                log_pi,
                log_pi_ref,
                alpha[tc],
                None if beta is None else beta[tc],
                None if gamma is None else gamma[tc],
            )
            if slope is not None:
                g.mul_(slope)
            if delta is not None:
                add_at_targets(g, tokens[t], v0, delta[t])
            # g is (G / T).T for this tile: [vc, n].
            if need_h:
                gemm.grad_hidden(grad_h[t], g, w, plan.grad_hidden)
            if need_w and bf16_w:
                # bf16 G (rounded once), float32 accumulation inside the GEMM, one rounding.
                if g_low is None:
                    g_low = torch.empty(g.shape, dtype=pol.weight.dtype, device=device)
                g_t = g_low[: g.shape[0]].copy_(g)
                gemm.grad_weight(grad_w[v0:v1], g_t, hidden[t], "onednn", False)
            elif need_w and one_token_chunk:
                gemm.grad_weight(grad_w[v0:v1], g, pol.hidden[t], plan.grad_weight, False)
            elif need_w:
                gemm.grad_weight(grad_w_chunk, g, pol.hidden[t], plan.grad_weight, True)
            if need_b:
                grad_b_chunk += g.sum(1)
        if grad_w_chunk is not None:
            grad_w[v0:v1] = grad_w_chunk
        if need_b:
            grad_b[v0:v1] = grad_b_chunk


def fused(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    bias_ref: Tensor | None = None,
    with_entropy: bool = True,
    token_chunk: int = TOKEN_CHUNK,
    vocab_chunk: int | None = None,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
    plan: gemm.Plan | None = None,
) -> FusedOutput:
    r"""Token log-probs, entropy and exact KL(pi_theta ‖ pi_ref) from hidden states and the head.

    With ``x = transform(hidden @ weight.T + bias) / temperature``, ``pi = softmax(x)`` (``pi_ref``
    likewise from the reference's), per position ``logp = log pi(y)``, ``entropy = -sum_v pi log
    pi`` and ``kl = sum_v pi (log pi - log pi_ref)``, tile by tile so that the ``[N, V]`` logits
    never exist (the module notes: the algorithm, its precision and its speed).

    Gradient: with respect to ``hidden``, ``weight`` and ``bias`` (whichever require it), of any
    combination of the outputs, in float32 cast to the inputs' dtypes; the backward pass
    recomputes the tiles or takes what the forward pass kept (:func:`saving`). A tied ``weight``
    gets it added to the embedding's by autograd; the reference is detached.

    Args:
        hidden, weight, bias: the policy's last hidden states (after the final norm) at the
            positions that produced ``tokens`` (``[N, H]`` or ``[B, T, H]``; float32, bf16, fp16
            or float64), its head ``[V, H]`` (``model.lm_head.weight``) and bias ``[V]``, if any.
        tokens: ``[N]`` or ``[B, T]`` integer token ids in ``[0, V)``.
        temperature: the sampling temperature the logits are divided by (policy and reference).
        hidden_ref, weight_ref, bias_ref: the reference model's hidden states at the same
            positions (``[N, H_ref]`` or ``[B, T, H_ref]``), head ``[V, H_ref]`` and bias; the
            first two turn on ``kl``.
        with_entropy: compute the entropy (one more pass per tile); else it is None.
        token_chunk, vocab_chunk: tokens and vocabulary entries per tile (defaults
            :data:`TOKEN_CHUNK` and ``default_vocab_chunk(min(N, token_chunk))``, at most
            :data:`TILE_ELEMENTS` logits; both justified in docs/performance.md).
        transform, transform_ref: what the policy's (the reference's) model does to its head's
            output before the softmax (a scale, a soft cap: :class:`LogitTransform`, from
            :func:`klpo.heads.read_head`); None: nothing. A soft cap costs two passes a tile.
        plan: the backend of each of the three GEMMs (:class:`klpo.gemm.Plan`; default
            :func:`head_plan`, by the head alone); ``gemm.Plan("mm", "mm", "mm", False)`` pins
            every product to torch.mm, for benchmarks and tests.

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)``, each with the shape of ``tokens``, float32
        (float64 when an input is float64); ``kl`` is None without a reference.

    Raises:
        ValueError / TypeError: naming the argument (shape, dtype, token id, chunk, temperature,
        half a reference).
    """
    ref = HeadArgs(hidden_ref, weight_ref, bias_ref, transform_ref)
    x = head_inputs(tokens, HeadArgs(hidden, weight, bias, transform), ref, temperature)
    if vocab_chunk is None:
        vocab_chunk = default_vocab_chunk(min(math.prod(x.lead), token_chunk))
    for name, size in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    plan = given_or_head_plan(plan, x.hidden, weight, x.cd)
    logp, ent, kl = _Fused.apply(
        *x.tensors,
        x.aff,
        x.aff_ref,
        bool(with_entropy),
        token_chunk,
        vocab_chunk,
        plan,
        torch.is_grad_enabled(),
    )
    return FusedOutput(
        logp.view(x.lead),
        None if ent is None else ent.view(x.lead),
        None if kl is None else kl.view(x.lead),
    )
