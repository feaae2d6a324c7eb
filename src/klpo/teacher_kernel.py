r"""The exact divergences to a teacher from both models' hidden states and heads: the kernels
behind :func:`klpo.teacher.from_hidden` and :func:`klpo.teacher.from_hidden_loss`.

Each model's logits ``hidden @ weight.T + bias`` exist only as one ``[rows, V_r]`` tile at a time:
:func:`from_hidden` recomputes both models' tiles in its backward pass (any upstream gradient of
the per-position values); :func:`from_hidden_loss` forms the gradient of a weighted sum in the
forward pass, as :func:`klpo.logprobs.fused_loss` does for the policy's own terms. Under tensor
parallelism the heads are shards of the vocabulary (``group``; :mod:`klpo.vocab_parallel`).

The loss form's algorithm (:func:`from_hidden_loss`): a tile of ``k`` rows at a time, both models'
logits over the (rank's) vocabulary, ``x = (hidden @ weight.T + bias) / T`` and ``x_T``; their
normalisers ``L = logsumexp x`` (with ``group``, the two all-reduces of :func:`from_hidden`, a MAX
and a SUM, on the tile's rows); the value ``D`` (one more SUM); the gradient tile ``G = dD/dx``
(:func:`klpo.teacher.reverse_kl`'s, :func:`klpo.teacher.forward_kl`'s or :func:`klpo.teacher.jsd`'s
formula) and at once ``grad_hidden[rows] = (G @ weight) weights / T`` and ``grad_weight += G.T @
(hidden weights / T)`` (``grad_bias`` alike): two logit GEMMs and two gradient GEMMs a tile (one
when the head is frozen, a LoRA student's: ``weight.requires_grad`` false), where
:func:`from_hidden` spends six (two, two recomputed in the backward pass, two). Every collective
happens inside the tile's own rows, so a vocabulary-parallel head needs no second pass: each rank
forms ``G`` on its rows of the vocabulary, its head's gradient is its own, and ``grad_hidden`` is
summed over the group once at the end. Memory: two ``[k, V_r]`` tiles (three at the normalisers and
for the forward KL, four for the JSD), ``k`` = ``row_chunk`` (default :data:`LOSS_ROW_ELEMENTS` ``//
V_r``); the gradients (float32, cast to the inputs' dtypes) are held from the forward to the
backward pass, which multiplies them by the loss's upstream gradient. Measured in
docs/performance.md (``bench/teacher_kl.py``).

:mod:`klpo.teacher` is the face: import these names from there.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as torch_dist
from torch import Tensor

from klpo._tensor import check_float
from klpo.logprobs import ROW_ELEMENTS
from klpo.vocab_parallel import all_reduce, slice_logits

__all__ = ["DIVERGENCES", "LOSS_ROW_ELEMENTS", "FromHiddenLoss", "from_hidden", "from_hidden_loss"]


DIVERGENCES = ("reverse", "forward", "jsd")
"""What :func:`from_hidden` computes: KL(pi_theta ‖ pi_T), KL(pi_T ‖ pi_theta), JSD_beta."""


class _FromHidden(torch.autograd.Function):
    """The divergence at each position from both models' hidden states and head shards, a chunk
    of tokens at a time, its logits tile recomputed in the backward pass (module notes)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, hidden_t, weight_t, bias_t, opts):
        kind, beta, temperature, group, rows = opts
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        value = torch.empty(n, dtype=dtype, device=hidden.device)
        saved = torch.empty(n, 3, dtype=dtype, device=hidden.device)  # L, L_T, KL or KL(q ‖ m)
        for s in range(0, n, rows):
            sl = slice(s, s + rows)
            x = _tile(hidden, weight, bias, sl, dtype, temperature)
            xt = _tile(hidden_t, weight_t, bias_t, sl, dtype, temperature)
            big_l, big_lt = _normalisers(x, xt, group)
            log_q, log_p = x - big_l[:, None], xt - big_lt[:, None]
            q, p = log_q.exp(), log_p.exp()
            if kind == "jsd":
                log_m = torch.logaddexp(log_q + math.log(1 - beta), log_p + math.log(beta))
                parts = torch.stack(
                    [(p * (log_p - log_m)).sum(-1), (q * (log_q - log_m)).sum(-1)], -1
                )
                parts = all_reduce(parts, torch_dist.ReduceOp.SUM, group)
                value[s : s + rows] = beta * parts[:, 0] + (1 - beta) * parts[:, 1]
                saved[s : s + rows, 2] = parts[:, 1]
            else:
                terms = q * (log_q - log_p) if kind == "reverse" else p * (log_p - log_q)
                value[s : s + rows] = all_reduce(terms.sum(-1), torch_dist.ReduceOp.SUM, group)
                saved[s : s + rows, 2] = value[s : s + rows]
            saved[s : s + rows, 0], saved[s : s + rows, 1] = big_l, big_lt
        ctx.save_for_backward(hidden, weight, bias, hidden_t, weight_t, bias_t, saved)
        ctx.opts = opts
        return value.clamp_min(0.0)

    @staticmethod
    def backward(ctx, grad_value):
        hidden, weight, bias, hidden_t, weight_t, bias_t, saved = ctx.saved_tensors
        kind, beta, temperature, group, rows = ctx.opts
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        dtype = saved.dtype
        w = weight.to(dtype)
        # Only what needs a gradient gets one: a frozen head's (a LoRA student's) GEMM is
        # skipped. Every rank of a vocabulary-parallel group asks alike, so the hidden states'
        # all-reduce pairs up.
        grad_h = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        up = grad_value.to(dtype)
        for s in range(0, hidden.shape[0], rows):
            sl = slice(s, s + rows)
            x = _tile(hidden, weight, bias, sl, dtype, temperature)
            xt = _tile(hidden_t, weight_t, bias_t, sl, dtype, temperature)
            log_q, log_p = x - saved[sl, :1], xt - saved[sl, 1:2]
            q = log_q.exp()
            if kind == "forward":  # d KL(p ‖ q) / dx = q - p
                g = q - log_p.exp()
            elif kind == "reverse":  # q (log q - log p - KL)
                g = q * (log_q - log_p - saved[sl, 2:3])
            else:  # (1 - beta) q (log q - log m - KL(q ‖ m))
                log_m = torch.logaddexp(log_q + math.log(1 - beta), log_p + math.log(beta))
                g = (1 - beta) * q * (log_q - log_m - saved[sl, 2:3])
            g = g * (up[sl, None] / temperature)
            if grad_h is not None:
                torch.mm(g, w, out=grad_h[sl])
            if grad_w is not None:
                grad_w.addmm_(g.T, hidden[sl].to(dtype))  # in place: no [V, H] temporary a chunk
            if grad_b is not None:
                grad_b += g.sum(0)
        if grad_h is not None:
            grad_h = all_reduce(grad_h, torch_dist.ReduceOp.SUM, group).to(hidden.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def _tile(hidden, weight, bias, rows: slice, dtype, temperature) -> Tensor:
    """One model's scaled logits of the chunk's ``rows``: ``[rows, V_r]``."""
    b = None if bias is None else bias.to(dtype)
    return slice_logits(hidden[rows].to(dtype), weight.to(dtype), b, temperature)


def _normalisers(x: Tensor, xt: Tensor, group) -> tuple[Tensor, Tensor]:
    """L = log sum exp of each row over the whole (sharded) vocabulary, for both models: one
    all-reduce MAX, one SUM."""
    m = all_reduce(
        torch.stack([x.max(-1).values, xt.max(-1).values], -1), torch_dist.ReduceOp.MAX, group
    )
    sums = torch.stack(
        [torch.sub(x, m[:, :1]).exp_().sum(-1), torch.sub(xt, m[:, 1:]).exp_().sum(-1)], -1
    )  # one [rows, V_r] temporary at a time
    sums = all_reduce(sums, torch_dist.ReduceOp.SUM, group)
    return m[:, 0] + sums[:, 0].log(), m[:, 1] + sums[:, 1].log()


def from_hidden(
    hidden: Tensor,
    weight: Tensor,
    hidden_teacher: Tensor,
    weight_teacher: Tensor,
    *,
    divergence: str = "reverse",
    beta: float = 0.5,
    bias: Tensor | None = None,
    bias_teacher: Tensor | None = None,
    temperature: float = 1.0,
    group=None,
    row_chunk: int | None = None,
) -> Tensor:
    r"""An exact divergence to the teacher at each position, from both models' hidden states.

    ``divergence``: ``"reverse"`` KL(pi_theta ‖ pi_T), ``"forward"`` KL(pi_T ‖ pi_theta) or
    ``"jsd"`` (TRL's generalised JSD at ``beta``), as :func:`klpo.teacher.reverse_kl`, :func:`klpo.teacher.forward_kl`
    and :func:`klpo.teacher.jsd` from logits, but the logits ``hidden @ weight.T + bias`` of each model exist
    only as one ``[row_chunk, V_r]`` tile (recomputed in the backward pass). The two models may
    differ in width (``hidden [N, H]``, ``hidden_teacher [N, H_T]``) but share the vocabulary.
    With ``group`` the heads are sharded by vocabulary as :func:`klpo.vocab_parallel.vocab_parallel`
    says (``weight`` and ``weight_teacher`` holding the same rows of the vocabulary).
    Gradients flow to the student's ``hidden``, ``weight`` and ``bias``; the teacher's are
    detached. Returns ``[N]`` float32 (float64 for float64 inputs).

    Example:
        >>> import torch
        >>> from klpo.teacher import forward_kl
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w, ht, wt = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (3, 5), (6, 5)))
        >>> got = from_hidden(h, w, ht, wt, divergence="forward")
        >>> torch.allclose(got, forward_kl(h @ w.T, ht @ wt.T), atol=1e-12)
        True
    """
    heads = (hidden, weight, hidden_teacher, weight_teacher)
    divergence, rows = _checked("from_hidden", heads, divergence, beta, row_chunk)
    opts = (divergence, float(beta), float(temperature), group, rows)
    return _FromHidden.apply(
        hidden, weight, bias, hidden_teacher.detach(), weight_teacher.detach(),
        None if bias_teacher is None else bias_teacher.detach(), opts,
    )  # fmt: skip


def _checked(
    fn: str,
    heads: tuple[Tensor, Tensor, Tensor, Tensor],
    divergence: str,
    beta: float,
    row_chunk: int | None,
    row_elements: int = ROW_ELEMENTS,
) -> tuple[str, int]:
    """The divergence (a JSD at ``beta`` 0 or 1 as the KL it is) and the rows a tile holds
    (``row_chunk``, default ``row_elements // V_r``), the shapes of ``heads`` (the student's
    hidden states and head, the teacher's) checked."""
    hidden, weight, hidden_teacher, weight_teacher = heads
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {', '.join(DIVERGENCES)}, got {divergence!r}")
    if divergence == "jsd" and not 0.0 < beta < 1.0:
        if beta in (0.0, 1.0):
            divergence = "forward" if beta == 0.0 else "reverse"
        else:
            raise ValueError(f"jsd: beta must be in [0, 1] (0 forward KL, 1 reverse), got {beta!r}")
    for name, h, w in (("", hidden, weight), ("_teacher", hidden_teacher, weight_teacher)):
        if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
            raise ValueError(
                f"{fn}: hidden{name} [N, H] and weight{name} [V_r, H] must share H, got "
                f"{tuple(h.shape)} and {tuple(w.shape)}"
            )
    if hidden_teacher.shape[0] != hidden.shape[0] or weight_teacher.shape[0] != weight.shape[0]:
        raise ValueError(
            f"{fn}: the teacher must score the same positions over the same vocabulary "
            f"rows: hidden {tuple(hidden.shape)} / {tuple(hidden_teacher.shape)}, weight "
            f"{tuple(weight.shape)} / {tuple(weight_teacher.shape)}"
        )
    if row_chunk is not None and (
        not isinstance(row_chunk, int) or isinstance(row_chunk, bool) or row_chunk < 1
    ):
        raise ValueError(f"{fn}: row_chunk must be a positive int, got {row_chunk!r}")
    return divergence, int(row_chunk or max(1, row_elements // max(weight.shape[0], 1)))


# --------------------------------------------------------------------------------------------
# The weighted sum as one loss, its gradient taken in the forward pass.

LOSS_ROW_ELEMENTS = 1 << 23
""":func:`from_hidden_loss`'s tiles hold about this many logits (32 MiB in float32; two to four
tiles live at once): ``row_chunk`` defaults to ``LOSS_ROW_ELEMENTS // V_r`` rows (55 at Qwen2.5's
vocabulary, 32 at Gemma 3's). The head's gradient ``[V_r, H]`` is read and written once a tile,
so more rows a tile spend memory to save that traffic (``bench/teacher_kl.py --row-chunk``)."""


class FromHiddenLoss(NamedTuple):
    """What :func:`from_hidden_loss` returns.

    Attributes:
        loss: the scalar ``sum_i weights_i D_i``, differentiable with respect to ``hidden``,
            ``weight`` and ``bias``.
        value: ``D_i``, the divergence at each position (detached), ``[N]``: what
            :func:`from_hidden` returns.
    """

    loss: Tensor
    value: Tensor


def _row_dots(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` for ``[k, V]`` tiles without a tile-sized product: ``[k]``."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _eager_reverse(x, xt, big_l, big_lt, beta, group) -> tuple[Tensor, Tensor]:
    """KL(q ‖ p) and ``dKL/dx = q (log q - log p - KL)``, in ``x``'s and ``xt``'s buffers."""
    d = xt.neg_().add_(x).sub_((big_l - big_lt)[:, None])  # log q - log p (0 for one model)
    q = x.sub_(big_l[:, None]).exp_()
    kl = all_reduce(_row_dots(q, d), torch_dist.ReduceOp.SUM, group)
    return kl, d.sub_(kl[:, None]).mul_(q)


def _eager_forward(x, xt, big_l, big_lt, beta, group) -> tuple[Tensor, Tensor]:
    """KL(p ‖ q) and ``dKL/dx = q - p``; one more tile, ``p``."""
    p = torch.sub(xt, big_lt[:, None]).exp_()
    d = xt.sub_(x).add_((big_l - big_lt)[:, None])  # log p - log q (0 for one model)
    kl = all_reduce(_row_dots(p, d), torch_dist.ReduceOp.SUM, group)
    return kl, x.sub_(big_l[:, None]).exp_().sub_(p)


def _eager_jsd(x, xt, big_l, big_lt, beta, group) -> tuple[Tensor, Tensor]:
    """JSD_beta and ``dJSD/dx = (1 - beta) q (log q - log m - KL(q ‖ m))``; two more tiles."""
    log_q, log_p = x.sub_(big_l[:, None]), xt.sub_(big_lt[:, None])
    log_m = torch.add(log_q, math.log(1 - beta))
    torch.logaddexp(log_m, torch.add(log_p, math.log(beta)), out=log_m)
    p = log_p.exp()
    kl_p = _row_dots(p, log_p.sub_(log_m))  # sum p (log p - log m)
    del p
    q = log_p.copy_(log_q).exp_()  # log_p's buffer is free
    log_qm = torch.sub(log_q, log_m, out=log_m)
    parts = all_reduce(
        torch.stack([kl_p, _row_dots(q, log_qm)], -1), torch_dist.ReduceOp.SUM, group
    )
    value = beta * parts[:, 0] + (1 - beta) * parts[:, 1]
    return value, log_qm.sub_(parts[:, 1:]).mul_(q).mul_(1 - beta)


_EAGER = {"reverse": _eager_reverse, "forward": _eager_forward, "jsd": _eager_jsd}
"""Each divergence's value at a tile's rows and its gradient with respect to the scaled logits
``x = z / T``, from the tiles ``x``, ``x_T`` (overwritten) and their normalisers."""


def _logits_tile(h: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """``(h @ w.T + b) / T`` as one ``[k, V_r]`` tile, in place after the GEMM (the values of
    :func:`klpo.vocab_parallel.slice_logits`)."""
    x = torch.mm(h, w.T)
    if b is not None:
        x.add_(b)
    return x.div_(temperature) if temperature != 1.0 else x


class _FromHiddenLoss(torch.autograd.Function):
    """``sum_i weights_i D_i`` from both models' hidden states and heads; the gradient is formed
    in the forward pass, a tile of rows at a time, and scaled by the loss's upstream gradient in
    the backward pass (:func:`from_hidden_loss`)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, hidden_t, weight_t, bias_t, opts):
        kind, beta, temperature, group, rows, weights, want = opts
        need_h, need_w, need_b = want
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        device = hidden.device
        n, width = hidden.shape
        # float32 copies of bf16 heads once, not a tile at a time
        w, wt = weight.to(dtype), weight_t.to(dtype)
        b, bt = (None if x is None else x.to(dtype) for x in (bias, bias_t))
        scale = weights.to(dtype) / temperature  # dD/dz = (dD/dx) / T, times the weight
        value = torch.empty(n, dtype=dtype, device=device)
        grad_h = torch.zeros(n, width, dtype=dtype, device=device) if need_h else None
        grad_w = None  # [V_r, H]: the first tile's product, then accumulated into
        grad_b = torch.zeros(w.shape[0], dtype=dtype, device=device) if need_b else None
        for s in range(0, n, rows):
            sl = slice(s, s + rows)
            h = hidden[sl].to(dtype)
            x = _logits_tile(h, w, b, temperature)
            xt = _logits_tile(hidden_t[sl].to(dtype), wt, bt, temperature)
            big_l, big_lt = _normalisers(x, xt, group)
            value[sl], g = _EAGER[kind](x, xt, big_l, big_lt, beta, group)
            del x, xt
            # The weights scale the [k, H] operands, not the [k, V_r] tile.
            c = scale[sl, None]
            if grad_h is not None:
                grad_h[sl] = torch.mm(g, w).mul_(c)
            if need_w:
                hc = h * c
                grad_w = torch.mm(g.T, hc) if grad_w is None else grad_w.addmm_(g.T, hc)
            if grad_b is not None:
                grad_b += g.T @ scale[sl]
            del g
        if grad_h is not None:  # each rank holds its vocabulary rows' part
            grad_h = all_reduce(grad_h, torch_dist.ReduceOp.SUM, group)
        if need_w and grad_w is None:  # no rows
            grad_w = torch.zeros_like(w)
        value = value.clamp_min(0.0)
        weights = weights.to(dtype)
        loss = torch.where(weights == 0, 0.0, weights * value).sum()  # 0 weight: exactly 0
        ctx.save_for_backward(
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
        ctx.mark_non_differentiable(value)
        return loss, value

    @staticmethod
    def backward(ctx, grad_loss, _):
        if grad_loss is None:
            return (None,) * 7
        scaled = [
            None if g is None else (g if bool(grad_loss == 1) else g * grad_loss.to(g.dtype))
            for g in ctx.saved_tensors
        ]
        return (*scaled, *(None,) * 4)


def from_hidden_loss(
    hidden: Tensor,
    weight: Tensor,
    hidden_teacher: Tensor,
    weight_teacher: Tensor,
    weights: Tensor,
    *,
    divergence: str = "reverse",
    beta: float = 0.5,
    bias: Tensor | None = None,
    bias_teacher: Tensor | None = None,
    temperature: float = 1.0,
    group=None,
    row_chunk: int | None = None,
) -> FromHiddenLoss:
    r"""A per-position weighted sum of an exact divergence to the teacher as one scalar loss, with
    its gradient computed in the forward pass (no recompute of either model's logits).

    ``loss = sum_i weights_i D_i`` with ``D_i`` :func:`from_hidden`'s (``divergence``, ``beta``,
    ``temperature``, ``group``: as there). Use it when the per-position weights are known before
    the forward pass, as a distillation term's are (the loss's mask over its normaliser, times
    the term's coefficient); where ``D`` feeds anything else, use :func:`from_hidden`, whose
    backward takes any upstream gradient. :func:`klpo.logprobs.fused_loss` is the same idea for
    the policy's own log-probs, entropy and KL to a reference.

    The algorithm and its memory: the module notes.

    Args:
        hidden, weight, hidden_teacher, weight_teacher, bias, bias_teacher: as in
            :func:`from_hidden` (``[N, H]``, ``[V_r, H]``, ``[N, H_T]``, ``[V_r, H_T]``; the
            teacher's detached).
        weights: ``[N]`` the weight of each position's divergence (detached; 0 leaves it out).

    Returns:
        :class:`FromHiddenLoss` ``(loss, value)``: ``loss`` a float32 scalar (float64 for float64
        inputs), ``value`` ``[N]`` detached.

    Raises:
        ValueError: as :func:`from_hidden`; ``weights`` not a float ``[N]`` tensor.

    Example:
        >>> import torch
        >>> from klpo.teacher import forward_kl
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w, ht, wt = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (3, 5), (6, 5)))
        >>> c = torch.tensor([0.5, 0.0, 0.25], dtype=torch.float64)
        >>> out = from_hidden_loss(h, w, ht, wt, c, divergence="forward")
        >>> torch.allclose(out.loss, (c * forward_kl(h @ w.T, ht @ wt.T)).sum(), atol=1e-12)
        True
    """
    heads = (hidden, weight, hidden_teacher, weight_teacher)
    divergence, rows = _checked(
        "from_hidden_loss", heads, divergence, beta, row_chunk, LOSS_ROW_ELEMENTS
    )
    check_float("weights", weights)
    if weights.shape != hidden.shape[:1]:
        raise ValueError(
            f"from_hidden_loss: weights has shape {tuple(weights.shape)} but hidden has "
            f"{hidden.shape[0]} positions; give one weight a position [N] (0 to leave it out)"
        )
    grad_on = torch.is_grad_enabled()
    want = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    w = weights.detach().to(hidden.device)  # no gradient: carried with the options
    opts = (divergence, float(beta), float(temperature), group, rows, w, want)
    loss, value = _FromHiddenLoss.apply(
        hidden, weight, bias, hidden_teacher.detach(), weight_teacher.detach(),
        None if bias_teacher is None else bias_teacher.detach(), opts,
    )  # fmt: skip
    return FromHiddenLoss(loss, value)
