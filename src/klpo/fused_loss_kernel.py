r"""The ``fused_loss`` kernel: a per-token weighted sum of log-probs, entropy and exact KL as one loss.

:func:`fused_loss` (public as :func:`klpo.logprobs.fused_loss`) takes the weights before the
forward pass and computes the loss's gradient there, token chunk by token chunk, from each chunk's
logits over the whole vocabulary (one ``[V, k]`` tile); the backward pass only scales the held
gradients. Its values are :func:`klpo.logprobs.fused`'s to the bit (the same tiles of
:class:`klpo.fused_kernel.HeadTiles`, the same ordered sums), so a row has one log-prob whichever
kernel scored it. The algorithm, its memory and its speed are in :func:`fused_loss`' docstring;
the gradient formula is in :mod:`klpo.logprobs`' notes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from klpo import gemm
from klpo._logits import (
    Affine,
    HeadArgs,
    LogitTransform,
    add_column_dots,
    add_column_sums,
    check_float,
    coefficients,
    compute_dtype,
    head_inputs,
)
from klpo.fused_kernel import HeadTiles, given_or_head_plan

__all__ = [
    "LOSS_TILE_ELEMENTS",
    "LOSS_TOKEN_CHUNK_MIN",
    "FusedLoss",
    "default_loss_token_chunk",
    "fused_loss",
]

# Tile of :func:`fused_loss`: every vocabulary entry by up to ``LOSS_TILE_ELEMENTS / V`` tokens
# (rounded down to a power of two, at least LOSS_TOKEN_CHUNK_MIN). The weight gradient is
# accumulated over token chunks, so each chunk reads and writes the whole ``[V, H]`` gradient: wide
# chunks amortise that traffic, narrow ones save memory. On a 2-core AVX-512 CPU at V = 151936
# (``bench/logprobs.py --sweep-loss``) log-probs of 512 tokens took 2.85 / 2.53 / 2.52 s in chunks
# of 64 / 128 / 256 tokens at a peak of 578 / 617 / 690 MiB (Liger-Kernel's: 704), the KL of 256
# tokens 2.30 / 2.10 / 1.96 s at 723 / 908 / 983 MiB (TRL's: 1100): 2^25 logits (128 MiB, 128
# tokens there) keeps the peak clear of the leanest peer's (docs/performance.md).
LOSS_TILE_ELEMENTS = 1 << 25
LOSS_TOKEN_CHUNK_MIN = 64


class FusedLoss(NamedTuple):
    """What :func:`fused_loss` returns.

    Attributes:
        loss: the scalar ``sum_i (logp_weight_i logp_i + entropy_weight_i entropy_i + kl_weight_i
            kl_i)``, differentiable with respect to ``hidden``, ``weight`` and ``bias``.
        logp: ``log pi_theta(y)`` of each token (detached), the shape of ``tokens``.
        entropy: the entropy at each position (detached; None unless asked for or weighted).
        kl: KL(pi_theta ‖ pi_ref) at each position (detached; None without a reference).
    """

    loss: Tensor
    logp: Tensor
    entropy: Tensor | None
    kl: Tensor | None


def default_loss_token_chunk(vocab: int) -> int:
    """Tokens per chunk of :func:`fused_loss`: ``LOSS_TILE_ELEMENTS / vocab`` rounded down to a
    power of two, at least :data:`LOSS_TOKEN_CHUNK_MIN`."""
    width = LOSS_TILE_ELEMENTS // max(vocab, 1)
    return max(LOSS_TOKEN_CHUNK_MIN, 1 << max(width.bit_length() - 1, 0))


def _shifted_tile(
    head: HeadTiles, w: Tensor, t: slice, m: Tensor, keep_x: bool, want_slope: bool = False
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """``x = x[t] - m[t]`` as a ``[V, k]`` tile, ``e = exp(x)``, ``s = sum_v e`` per column, and
    (``want_slope``, a capped head) ``dx/dz`` at each entry.

    ``m[t]`` is raised to the column's max (in place) where ``s`` overflows (a logit ~88 above
    ``m``), so the result is exact either way. Without ``keep_x`` the exp is taken in place and
    ``x`` is not returned (None).
    """
    x, slope = head.tile_slope(w, 0, t, m, want_slope)
    e = torch.exp(x) if keep_x else x.exp_()
    s = e.new_zeros(e.shape[1])
    add_column_sums(s, e)  # in fused's order (a token's log-prob is one number)
    if not bool(torch.isfinite(s).all()):
        if not keep_x:
            x = head.tile(w, 0, t, m)
        shift = x.amax(0).clamp_min(0.0)  # 0 where the column was fine: the same result there
        x.sub_(shift)
        m[t] += shift
        e = torch.exp(x) if keep_x else x.exp_()
        s = e.new_zeros(e.shape[1])
        add_column_sums(s, e)
    return (x if keep_x else None), e, s, slope


def _add_grad_weight(grad_w: Tensor | None, g: Tensor, h: Tensor, plan: gemm.Plan) -> Tensor:
    """``grad_w + g @ h``: the first product is the new gradient (no zeros to add it to, no copy),
    later ones are added in place by ``addmm_``, which needs no temporary ``[V, H]``."""
    if grad_w is None:
        return gemm.grad_weight_new(g, h, plan.grad_weight)
    gemm.grad_weight(grad_w, g, h, "mm", True)
    return grad_w


def _chunk_values(
    pol: HeadTiles,
    ref: HeadTiles | None,
    ws: tuple[Tensor, Tensor | None],
    t: slice,
    offsets: tuple[Tensor, Tensor, Tensor | None],
    outs: tuple[Tensor, Tensor | None, Tensor | None],
    want_slope: bool,
) -> tuple:
    """One token chunk's values, written into ``outs = (logp, entropy, kl)`` at ``t``, and the
    tiles its gradient is formed from: ``(x, e, s, log s, d, log s_ref, slope)`` with ``x`` the
    ``[V, k]`` tile less ``m[t]`` (None without an entropy or a reference: only they need it),
    ``e = exp(x)``, ``s = sum_v e``, ``d = x - x_ref`` (None without a reference) and ``slope``
    a capped head's ``dx/dz`` (None unless ``want_slope``). ``offsets = (x_y, m, m_ref)``: the targets' logits and the two
    references, ``m`` raised in place where a sum overflows (:func:`_shifted_tile`)."""
    w, w_ref = ws
    x_y, m, m_ref = offsets
    logp, ent, kl = outs
    # The tile x itself is needed for the entropy, the KL and the gradient of either.
    keep_x = ent is not None or ref is not None
    x, e, s, slope = _shifted_tile(pol, w, t, m, keep_x, want_slope)  # [V, k], x - m[t]
    log_s = torch.log(s)
    logp[t] = (x_y[t] - m[t]) - log_s
    if ent is not None:
        s_x = torch.zeros_like(s)
        add_column_dots(s_x, e, x)
        ent[t] = log_s - s_x / s
    d = log_s_ref = None
    if ref is not None:
        x_ref, e_ref, s_ref, _ = _shifted_tile(ref, w_ref, t, m_ref, True)
        log_s_ref = torch.log(s_ref)
        del e_ref
        # sum_v pi (x - x_ref) relative to the two offsets, then the normalisers: the
        # arithmetic of fused's, so two identical models give exactly 0.
        d = x_ref.neg_().add_(x)  # x - x_ref, kept for the KL's gradient
        s_d = torch.zeros_like(s)
        add_column_dots(s_d, d, e)
        kl[t] = s_d / s + (log_s_ref - log_s)
    return x, e, s, log_s, d, log_s_ref, slope


def _tile_grads(
    pol: HeadTiles,
    w: Tensor,
    t: slice,
    tiles: tuple,
    coefs: tuple[Tensor, Tensor | None, Tensor | None],
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
    want: tuple[bool, bool, bool],
) -> Tensor | None:
    """The tile's part of the gradients, without the targets' ``delta 1[v = y]``: ``grad_hidden``
    and ``grad_bias`` in place, and ``grad_weight`` returned (the first chunk's product is the new
    tensor, :func:`_add_grad_weight`). ``tiles`` are :func:`_chunk_values`' (``x``, ``e`` and
    ``d`` overwritten), ``coefs`` :func:`klpo._logits.coefficients`' ``(alpha, beta, gamma)`` for
    the chunk.

    ``G / T = pi (alpha + beta log pi + gamma (log pi - log pi_ref)) + delta 1[v = y]``, with
    ``pi = e / s``, ``log pi = x - log s``, ``log pi - log pi_ref = d - (log s - log s_ref)``."""
    x, e, s, log_s, d, log_s_ref, slope = tiles
    alpha, beta, gamma = coefs
    grad_h, grad_w, grad_b = grads
    need_h, need_w, need_b = want
    plan = pol.plan
    alpha = alpha.expand(log_s.shape) / s
    if beta is None and gamma is None:
        # Only logp: G / T = (alpha / s) e + delta 1[v = y]; alpha / s is taken out of the
        # tile (scaling the [k, H] operands), so the tile costs only its exp (and a
        # capped head's slope).
        g = e if slope is None else e.mul_(slope)
        if need_h:
            gemm.grad_hidden(grad_h[t], g, w, plan.grad_hidden)
            grad_h[t] *= alpha[:, None]
        if need_w:
            grad_w = _add_grad_weight(grad_w, g, pol.hidden[t] * alpha[:, None], plan)
        if need_b:
            grad_b += g @ alpha
        return grad_w
    const = alpha.clone()
    if beta is not None:
        const -= beta * log_s / s
    if gamma is not None:
        const -= gamma * (log_s - log_s_ref) / s  # exactly 0 for one model
    if beta is not None:
        inner = torch.addcmul(const[None, :], x, (beta / s)[None, :], out=x)
        if gamma is not None:
            inner.addcmul_(d, (gamma / s)[None, :])
    else:
        inner = torch.addcmul(const[None, :], d, (gamma / s)[None, :], out=d)
    g = e.mul_(inner)
    if slope is not None:
        g.mul_(slope)
    if need_h:
        gemm.grad_hidden(grad_h[t], g, w, plan.grad_hidden)
    if need_w:
        grad_w = _add_grad_weight(grad_w, g, pol.hidden[t], plan)
    if need_b:
        grad_b += g.sum(1)
    return grad_w


def _add_target_grads(
    pol: HeadTiles,
    w: Tensor,
    tokens: Tensor,
    t: slice,
    delta: Tensor,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None],
) -> None:
    """The targets' part of the chunk's gradients, ``delta 1[v = y]``, without a pass over the
    tile: ``grads = (grad_hidden, grad_weight, grad_bias)`` (None: not needed) in place."""
    grad_h, grad_w, grad_b = grads
    if grad_h is not None:
        grad_h[t] += w[tokens[t]] * delta[:, None]
    if grad_w is not None:
        grad_w.index_put_((tokens[t],), pol.hidden[t] * delta[:, None], accumulate=True)
    if grad_b is not None:
        grad_b.index_put_((tokens[t],), delta, accumulate=True)


def _weighted_sum(
    coefs: tuple[Tensor | None, ...],
    values: tuple[Tensor | None, ...],
    cd: torch.dtype,
    device: torch.device,
) -> Tensor:
    """``sum_i (a_i logp_i + b_i entropy_i + c_i kl_i)`` over the weighted outputs."""
    loss = torch.zeros((), dtype=cd, device=device)
    for coef, value in zip(coefs, values, strict=True):
        if coef is not None:
            # 0 * inf = nan: a position weighted 0 adds exactly 0.
            loss = loss + torch.where(coef == 0, 0.0, coef * value).sum()
    return loss


class _FusedLoss(torch.autograd.Function):
    """``sum_i a_i logp_i + b_i entropy_i + c_i kl_i`` from hidden states and the head; the
    gradient is computed in the forward pass, token chunk by token chunk, and scaled by the
    loss's upstream gradient in the backward pass."""

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
        a: Tensor | None,
        b: Tensor | None,
        c: Tensor | None,
        aff: Affine,
        aff_ref: Affine,
        with_entropy: bool,
        token_chunk: int,
        plan: gemm.Plan,
        want: tuple[bool, bool, bool],
    ):
        """The loss, the outputs and the gradients, token chunk by token chunk (the class says
        how); ``want``: which of hidden, weight and bias get a gradient.

        Long because: autograd hands a Function its inputs one by one (sixteen of them), and the
        chunk loop keeps the tiles of one chunk in one frame, where splitting it would hold them
        longer or recompute them.
        """
        cd = compute_dtype(hidden, weight, bias, hidden_ref, weight_ref, bias_ref)
        need_h, need_w, need_b = want
        need_any = need_h or need_w or need_b
        pol = HeadTiles(hidden, weight, bias, aff, cd, plan)
        ref = None
        if hidden_ref is not None:
            ref = HeadTiles(hidden_ref, weight_ref, bias_ref, aff_ref, cd, plan)
        n, hs = pol.hidden.shape
        vocab = weight.shape[0]
        device = hidden.device
        w = pol.chunk(0, vocab)
        w_ref = None  # its own buffer (pol.chunk may reuse one)
        if ref is not None:
            w_ref = weight_ref if weight_ref.dtype == cd else weight_ref.to(cd)
        x_y = pol.target_logits(tokens)
        slope_y = pol.target_slope(tokens) if need_any else None  # None: an uncapped head
        m = x_y.clone()
        m_ref = None if ref is None else ref.target_logits(tokens)
        logp = torch.empty(n, dtype=cd, device=device)
        ent = torch.empty_like(logp) if with_entropy else None
        kl = None if ref is None else torch.empty_like(logp)
        a, b, c = (None if u is None else u.to(cd) for u in (a, b, c))
        grad_h = torch.zeros(n, hs, dtype=cd, device=device) if need_h else None
        grad_w = None  # [V, H], the first chunk's product, then accumulated into
        grad_b = torch.zeros(vocab, dtype=cd, device=device) if need_b else None
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            tiles = _chunk_values(
                pol, ref, (w, w_ref), t, (x_y, m, m_ref), (logp, ent, kl), need_any
            )
            if not need_any:
                del tiles
                continue
            alpha, beta, gamma, delta = coefficients(
                None if a is None else a[t],
                None if b is None else b[t],
                None if c is None else c[t],
                None if ent is None else ent[t],
                None if kl is None else kl[t],
                aff.coef,
                cd,
            )
            if delta is not None and slope_y is not None:
                delta = delta * slope_y[t]
            grad_w = _tile_grads(
                pol, w, t, tiles, (alpha, beta, gamma), (grad_h, grad_w, grad_b), want
            )
            del tiles  # before the next tile: one tile (two capped) at a time
            if delta is not None:
                _add_target_grads(pol, w, tokens, t, delta, (grad_h, grad_w, grad_b))

        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(vocab, hs, dtype=cd, device=device)
        logp = logp.clamp_max(0.0)
        ent = None if ent is None else ent.clamp_min(0.0)
        kl = None if kl is None else kl.clamp_min(0.0)
        loss = _weighted_sum((a, b, c), (logp, ent, kl), cd, device)
        ctx.save_for_backward(
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
        )
        ctx.mark_non_differentiable(logp, *(o for o in (ent, kl) if o is not None))
        return loss, logp, ent, kl

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grads = ctx.saved_tensors
        if grad_loss is None:
            return (None,) * 16
        scaled = [
            None if g is None else (g if bool(grad_loss == 1) else g * grad_loss.to(g.dtype))
            for g in grads
        ]
        return (*scaled, *(None,) * 13)


def _checked_weights(
    weights: tuple[Tensor | None, Tensor | None, Tensor | None],
    lead: torch.Size,
    device: torch.device,
) -> list[Tensor | None]:
    """:func:`fused_loss`'s ``(logp_weight, entropy_weight, kl_weight)`` checked (float, one
    weight per token: the shape ``lead`` of ``tokens``), flat and detached on ``device``."""
    out = []
    for name, wt in zip(("logp_weight", "entropy_weight", "kl_weight"), weights, strict=True):
        if wt is not None:
            check_float(name, wt)
            if wt.shape != lead:
                raise ValueError(
                    f"{name} has shape {tuple(wt.shape)} but tokens has shape {tuple(lead)}; "
                    f"give one weight per token (0 at positions to leave out)"
                )
            wt = wt.detach().reshape(-1).to(device)
        out.append(wt)
    return out


def fused_loss(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    logp_weight: Tensor | None = None,
    entropy_weight: Tensor | None = None,
    kl_weight: Tensor | None = None,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    bias_ref: Tensor | None = None,
    with_entropy: bool = False,
    token_chunk: int | None = None,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
    plan: gemm.Plan | None = None,
) -> FusedLoss:
    r"""A per-token weighted sum of log-probs, entropy and exact KL as one scalar loss, with its
    gradient computed in the forward pass (no recompute of the logits).

    ``loss = sum_i (logp_weight_i logp_i + entropy_weight_i entropy_i + kl_weight_i kl_i)`` with
    ``logp``, ``entropy`` and ``kl`` as in :func:`klpo.logprobs.fused` (from ``x =
    transform(hidden @ weight.T + bias) / temperature``, and the reference's ``x_ref`` for the KL).
    Use it when the loss's per-token weights are known before the forward pass: cross-entropy and
    distillation (``logp_weight = -1 / N``), REINFORCE/GRPO on-policy with fixed advantages
    (``logp_weight = -A_i w_i``), an exact-KL penalty (``kl_weight = beta w_i``). Where the
    weights depend on ``logp`` itself (a clipped PPO ratio off-policy) or the outputs feed anything
    else, use :func:`klpo.logprobs.fused`, whose backward takes any upstream gradient.

    Algorithm (the weights known, as in Liger-Kernel's fused linear losses): token chunks outside,
    each chunk's logits over the whole vocabulary as one ``[V, k]`` tile (``k`` tokens; the
    target's logit subtracted in the GEMM's epilogue, as in :func:`klpo.logprobs.fused`); from the
    tile the outputs and ``G / T`` (the gradient formula of :mod:`klpo.logprobs`' notes with the
    weights as upstream gradients) and at once the chunk's gradients, ``grad_hidden = (G / T).T @
    weight``, ``grad_weight += (G / T) @ hidden``. Three GEMMs per tile for log-probs, four for the
    KL, against :func:`klpo.logprobs.fused`'s four and six; the price is memory: one ``V x k``
    float32 tile for log-probs, two with the entropy, three with the KL (``k`` from
    :func:`default_loss_token_chunk`, at most 2^25 floats, 128 MiB, per tile), a float32 copy of a
    bf16/fp16 head, and the weight gradient read and written once per chunk. With only
    ``logp_weight`` the per-token factor is taken out of the tile, which then costs one ``exp``
    and a column sum. The gradients are held (float32, cast to the inputs' dtypes) from the
    forward to the backward pass, which multiplies them by the loss's upstream gradient. Measured
    against naive PyTorch and the peers in docs/performance.md.

    Args:
        hidden, weight, tokens, bias, temperature, hidden_ref, weight_ref, bias_ref, transform,
            transform_ref: as in :func:`klpo.logprobs.fused` (a soft cap holds one more ``V x k``
            tile, its ``dx/dz``, while the gradient is formed).
        logp_weight: ``[N]`` or ``tokens``' shape, the weight of each token's ``logp`` (detached).
        entropy_weight: likewise for the entropy (turns on the entropy).
        kl_weight: likewise for the exact KL (needs the reference).
        with_entropy: return the entropy even without a weight on it.
        token_chunk: tokens per tile (default :func:`default_loss_token_chunk` of ``V``).
        plan: the GEMM backends, as in :func:`klpo.logprobs.fused` (default
            :func:`klpo.fused_kernel.head_plan`).

    Returns:
        :class:`FusedLoss` ``(loss, logp, entropy, kl)``: ``loss`` a float32 scalar (float64 for
        float64 inputs), the others detached, with the shape of ``tokens``.

    Raises:
        ValueError / TypeError: naming the argument, as :func:`klpo.logprobs.fused`; no weight
        given; a weight whose shape is not ``tokens``'; ``kl_weight`` without a reference.

    Long because: the docstring states the algorithm and its memory and documents the public
    API's sixteen arguments (the body is a third of it).
    """
    if logp_weight is None and entropy_weight is None and kl_weight is None:
        raise ValueError(
            "fused_loss needs at least one of logp_weight, entropy_weight, kl_weight (the "
            "per-token weights of the loss); for the outputs alone use klpo.logprobs.fused"
        )
    if kl_weight is not None and hidden_ref is None:
        raise ValueError(
            "kl_weight was given without a reference: pass hidden_ref and weight_ref (the "
            "reference model's hidden states and head)"
        )
    # The same argument checks and layout as fused, on the same arguments.
    ref = HeadArgs(hidden_ref, weight_ref, bias_ref, transform_ref)
    x = head_inputs(tokens, HeadArgs(hidden, weight, bias, transform), ref, temperature)
    weights = _checked_weights((logp_weight, entropy_weight, kl_weight), x.lead, hidden.device)
    if token_chunk is None:
        token_chunk = default_loss_token_chunk(weight.shape[0])
    if not isinstance(token_chunk, int) or isinstance(token_chunk, bool) or token_chunk < 1:
        raise ValueError(f"token_chunk must be a positive int, got {token_chunk!r}")
    grad_on = torch.is_grad_enabled()
    want = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    with_entropy = bool(with_entropy or entropy_weight is not None)
    plan = given_or_head_plan(plan, x.hidden, weight, x.cd)
    loss, logp, ent, kl = _FusedLoss.apply(
        *x.tensors, *weights, x.aff, x.aff_ref, with_entropy, token_chunk, plan, want
    )
    return FusedLoss(
        loss,
        logp.view(x.lead),
        None if ent is None else ent.view(x.lead),
        None if kl is None else kl.view(x.lead),
    )
