r"""Token log-probs, entropy and the exact KL(pi_theta ‖ pi_ref), from logits or from hidden states.

At one position, with logits ``z`` over a vocabulary of ``V`` entries, temperature ``T``,
scaled logits ``x = z / T`` and ``pi = softmax(x)``:

    logp    = log pi(y) = x_y - L,                      L = log sum_v exp(x_v)
    entropy = -sum_v pi(v) log pi(v) = L - sum_v pi(v) x_v
    kl      = sum_v pi(v) (log pi(v) - log pi_ref(v))  = KL(pi_theta ‖ pi_ref)

``kl`` is the exact per-position KL over the whole vocabulary (the Rao-Blackwellised penalty of
Amini, Vieira & Cotterell, arXiv:2504.10637), not an estimate from the sampled token.

Two families of functions compute them without holding ``[tokens, V]`` float32 tensors alive:

* From logits ``[..., V]`` of any float dtype: :func:`token_logprobs`, :func:`entropy` and
  :func:`exact_kl`, or all three in one pass, :func:`from_logits`. Rows are processed in chunks
  of about 4M logits (:data:`ROW_ELEMENTS`; ``row_chunk=`` sets it), so the extra memory is a few
  chunks (plus the gradient, which has the logits' shape and dtype).
* From hidden states and the output head: :func:`fused` returns all three at once from
  ``hidden [N, H]`` (or ``[B, T, H]``), ``weight [V, H]`` and an optional ``bias [V]``, and from
  the reference model's hidden states and head for ``kl``. The logits
  ``hidden @ weight.T + bias`` never exist beyond one ``vocab_chunk x token_chunk`` tile, but for
  the exponentiated tiles a log-prob-only backward pass may keep, up to as many floats as the
  head has weights (:func:`klpo.fused_kernel.saving`).

Gradients (both families), with upstream gradients ``a``, ``b``, ``c`` of ``logp``, ``entropy``
and ``kl`` at a position, with respect to the scaled logits ``x``:

    G_v = a (1[v = y] - pi_v) - b pi_v (log pi_v + entropy) + c pi_v (log pi_v - log pi_ref(v) - kl)

so that one backward pass serves any combination of the three outputs. The reference
(``logits_ref``, ``hidden_ref``, ``weight_ref``, ``bias_ref``) is detached and gets no gradient.
The gradient with respect to the logits is ``G / T``; with respect to hidden states, weight and bias
it is ``(G / T) @ weight``, ``(G / T).T @ hidden`` and ``sum over tokens of G / T``.

Where the code lives (imports run one way, each module importing only those listed after it):
this module (the from-logits functions, and the public names of the rest); :mod:`klpo.heads` (a
model's head and logit transform, and :func:`model_logprobs`); :mod:`klpo.fused_loss_kernel`
(:func:`fused_loss`); :mod:`klpo.fused_kernel` (:func:`fused`, its tiles and its GEMM plan, with
the algorithm, its precision and its speed in its notes); the private ``klpo._logits`` (the
transform, the checks and the arithmetic the kernels share); :mod:`klpo.gemm` (the three products
and their backends).

Masked vocabularies (the logits path): ``-inf`` logits are allowed (padding entries of the
vocabulary, a constrained decoder), by the convention ``0 log 0 = 0`` and ``p log(p / 0) = +inf``
for ``p > 0`` (Cover & Thomas, Elements of Information Theory, 2.3): an entry with ``pi(v) = 0``
adds 0 to the entropy and the KL and gets 0 gradient; where ``pi(v) > 0`` and ``pi_ref(v) = 0``
the KL is ``+inf`` and its gradient NaN at that position (exactly 0 where the upstream gradient is
0). The plain chunk loop computes ``0 * -inf = NaN`` at such entries; rows whose entropy or KL comes
out non-finite are found after the loop (one pass over ``[N]``, one host sync) and only their
chunks are redone, forward and backward, with the masked formula, so finite logits take the same
path as before. A row that is ``-inf`` everywhere is refused. The fused path from hidden states
cannot produce ``-inf`` from a finite head.

Precision: all arithmetic is float32 (float64 when an input is float64, so float64 oracles stay
exact). bf16/fp16 inputs are upcast exactly, so their logits are as accurate as float32 ones (the
peers' bf16 paths round the logits to bf16: errors of ~0.02 nats at V = 152k). Gradients are
accumulated in float32 and cast to the inputs' dtypes once, at the end (one exception, for speed,
in :mod:`klpo.fused_kernel`: a bf16 head's weight gradient). Values are clamped to their ranges
(``logp ≤ 0``, ``entropy ≥ 0``, ``kl ≥ 0``) in the value only, against rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from klpo._logits import (
    Affine,
    FusedOutput,
    LogitTransform,
    affine,
    check_float,
    check_tokens,
    coefficients,
    compute_dtype,
    grad_tile,
    slope_of,
    transformed,
)
from klpo.fused_kernel import (
    TILE_ELEMENTS,
    TOKEN_CHUNK,
    VOCAB_CHUNK_MAX,
    default_vocab_chunk,
    fused,
    head_plan,
)
from klpo.fused_loss_kernel import (
    LOSS_TILE_ELEMENTS,
    LOSS_TOKEN_CHUNK_MIN,
    FusedLoss,
    default_loss_token_chunk,
    fused_loss,
)
from klpo.heads import model_logprobs

__all__ = [
    "LOSS_TILE_ELEMENTS",
    "LOSS_TOKEN_CHUNK_MIN",
    "ROW_ELEMENTS",
    "TILE_ELEMENTS",
    "TOKEN_CHUNK",
    "VOCAB_CHUNK_MAX",
    "FusedLoss",
    "FusedOutput",
    "LogitTransform",
    "default_loss_token_chunk",
    "default_vocab_chunk",
    "entropy",
    "exact_kl",
    "from_logits",
    "fused",
    "fused_loss",
    "head_plan",
    "model_logprobs",
    "token_logprobs",
]

ROW_ELEMENTS = 1 << 22
"""Rows of the logits path hold about this many logits per chunk (16 MiB in float32): the default
``row_chunk`` is ``ROW_ELEMENTS // V`` rows (at least 1)."""


def _rows_per_chunk(row_chunk: int | None, vocab: int) -> int:
    """``row_chunk`` checked, or the default rows per chunk for a vocabulary of ``vocab``."""
    if row_chunk is None:
        return max(1, ROW_ELEMENTS // max(vocab, 1))
    if not isinstance(row_chunk, int) or isinstance(row_chunk, bool) or row_chunk < 1:
        raise ValueError(f"row_chunk must be a positive int (rows per chunk), got {row_chunk!r}")
    return row_chunk


# --------------------------------------------------------------------------------------------
# From logits.


class _FromLogits(torch.autograd.Function):
    """logp, entropy and KL from logits ``[N, V]`` in row chunks; the backward recomputes them."""

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        tokens: Tensor | None,
        logits_ref: Tensor | None,
        opts: tuple[Affine, Affine, bool, int],
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """``opts = (aff, aff_ref, with_entropy, rows)``: the two logit transforms, whether to
        compute the entropy, and rows per chunk."""
        ctx.set_materialize_grads(False)
        aff, aff_ref, with_entropy, rows = opts
        n = logits.shape[0]
        cd = compute_dtype(logits, logits_ref)
        log_z = torch.empty(n, dtype=cd, device=logits.device)
        log_z_ref = None if logits_ref is None else torch.empty_like(log_z)
        logp = None if tokens is None else torch.empty_like(log_z)
        ent = torch.empty_like(log_z) if with_entropy else None
        kl = None if logits_ref is None else torch.empty_like(log_z)
        for r0 in range(0, n, rows):
            r = slice(r0, min(r0 + rows, n))
            x = transformed(logits[r], cd, aff)  # a fresh tensor, safe to modify
            log_z[r] = torch.logsumexp(x, dim=-1)
            if logp is not None:
                logp[r] = x.gather(1, tokens[r, None])[:, 0] - log_z[r]
            if ent is None and kl is None:
                continue
            log_pi = x.sub_(log_z[r, None])
            pi = torch.exp(log_pi)
            if ent is not None:
                ent[r] = -torch.linalg.vecdot(pi, log_pi)
            if kl is not None:
                x_ref = transformed(logits_ref[r], cd, aff_ref)
                log_z_ref[r] = torch.logsumexp(x_ref, dim=-1)
                kl[r] = torch.linalg.vecdot(pi, log_pi.sub_(x_ref.sub_(log_z_ref[r, None])))
        _check_rows("logits", log_z)
        if log_z_ref is not None:
            _check_rows("logits_ref", log_z_ref)
        # A -inf logit (pi = 0) makes 0 * -inf = NaN above, and a -inf reference logit on pi's
        # support makes kl = +inf: only then are the chunks holding such rows redone with the
        # masked formula (the check is one pass over [N] and one host sync).
        masked: list[int] = []
        if ent is not None or kl is not None:
            odd = torch.zeros(n, dtype=torch.bool, device=logits.device)
            for t in (ent, kl):
                if t is not None:
                    odd |= ~torch.isfinite(t)
            if bool(odd.any()):
                masked = torch.unique(odd.nonzero()[:, 0] // rows).tolist()
        for k in masked:
            r = slice(k * rows, min((k + 1) * rows, n))
            x_ref = None if kl is None else transformed(logits_ref[r], cd, aff_ref)
            e_r, kl_r = _masked_sums(
                transformed(logits[r], cd, aff),
                log_z[r],
                x_ref,
                log_z_ref[r] if kl is not None else None,
                ent is not None,
            )
            if ent is not None:
                ent[r] = e_r
            if kl is not None:
                kl[r] = kl_r
        out_logp = None if logp is None else logp.clamp_max(0.0)
        out_ent = None if ent is None else ent.clamp_min(0.0)
        out_kl = None if kl is None else kl.clamp_min(0.0)
        ctx.save_for_backward(logits, tokens, logits_ref, log_z, log_z_ref, out_ent, out_kl)
        ctx.aff, ctx.aff_ref, ctx.rows, ctx.cd = aff, aff_ref, rows, cd
        ctx.masked = frozenset(masked)
        return out_logp, out_ent, out_kl

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_kl):
        logits, tokens, logits_ref, log_z, log_z_ref, ent, kl = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (
            grad_logp is None and grad_entropy is None and grad_kl is None
        ):
            return (None,) * 4
        cd, aff, aff_ref, rows = ctx.cd, ctx.aff, ctx.aff_ref, ctx.rows
        alpha, beta, gamma, delta = coefficients(
            grad_logp, grad_entropy, grad_kl, ent, kl, aff.coef, cd
        )
        alpha = alpha.expand(log_z.shape)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        n = logits.shape[0]
        for r0 in range(0, n, rows):
            r = slice(r0, min(r0 + rows, n))
            log_pi, slope = _log_pi_rows(logits[r], log_z[r], cd, aff)
            log_pi_ref = None
            if gamma is not None:
                log_pi_ref = transformed(logits_ref[r], cd, aff_ref).sub_(log_z_ref[r, None])
            if r0 // rows in ctx.masked:
                g = _masked_grad(
                    log_pi,
                    log_pi_ref,
                    alpha[r],
                    None if beta is None else beta[r],
                    None if gamma is None else gamma[r],
                    None if gamma is None else kl[r],
                )
            else:
                g = grad_tile(
                    log_pi,
                    log_pi_ref,
                    alpha[r, None],
                    None if beta is None else beta[r, None],
                    None if gamma is None else gamma[r, None],
                )
            if delta is not None:
                g.scatter_add_(1, tokens[r, None], delta[r, None])
            grad[r] = g if slope is None else g.mul_(slope)
        return grad, None, None, None


def _log_pi_rows(
    z: Tensor, log_z: Tensor, cd: torch.dtype, aff: Affine
) -> tuple[Tensor, Tensor | None]:
    """``log pi = x - L`` of rows of logits ``z`` (a fresh tensor) and, for a capped transform,
    ``dx/dz`` (None otherwise: the constant is in the coefficients)."""
    if aff.cap_t is None:
        return z.to(cd).mul(aff.lin).sub_(log_z[:, None]), None
    y = z.to(cd).mul(aff.lin).tanh_()
    slope = slope_of(y, aff)
    return torch.add(-log_z[:, None], y, alpha=aff.cap_t, out=y), slope


def _check_rows(name: str, log_z: Tensor) -> None:
    """ValueError if a row of ``name`` is ``-inf`` everywhere (``log_z = -inf``): no distribution."""
    empty = torch.isneginf(log_z)
    if bool(empty.any()):
        idx = empty.nonzero()[:, 0]
        raise ValueError(
            f"{name} is -inf at every vocabulary entry in {idx.numel()} row(s) (first: flattened "
            f"row {int(idx[0])}), so softmax({name}) is no distribution there; leave at least one "
            f"entry finite in every row (at padding positions too: mask them afterwards with "
            f"torch.where)"
        )


def _masked_sums(
    x: Tensor, log_z: Tensor, x_ref: Tensor | None, log_z_ref: Tensor | None, with_entropy: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Entropy and KL of rows ``x [r, V]`` (scaled logits) that may hold ``-inf``, by the convention
    ``0 log 0 = 0`` and ``p log(p / 0) = +inf`` for ``p > 0`` (Cover & Thomas, Elements of
    Information Theory, 2.3): entries with ``x = -inf`` (pi = 0) add 0; a row where ``x_ref = -inf``
    at an entry with ``x > -inf`` has KL ``+inf``, even if pi underflowed to 0 there."""
    log_pi = x.sub_(log_z[:, None])
    off = torch.isneginf(log_pi)
    log_pi.masked_fill_(off, 0.0)  # pi * log pi = 0 there
    pi = torch.exp(log_pi).masked_fill_(off, 0.0)
    ent = -torch.linalg.vecdot(pi, log_pi) if with_entropy else None
    kl = None
    if x_ref is not None:
        log_pi_ref = x_ref.sub_(log_z_ref[:, None])
        forbidden = torch.isneginf(log_pi_ref) & ~off
        log_pi_ref.masked_fill_(off | forbidden, 0.0)
        kl = torch.linalg.vecdot(pi, log_pi.sub_(log_pi_ref))
        kl = torch.where(forbidden.any(1), torch.inf, kl)
    return ent, kl


def _masked_grad(
    log_pi: Tensor,
    log_pi_ref: Tensor | None,
    alpha: Tensor,
    beta: Tensor | None,
    gamma: Tensor | None,
    kl: Tensor | None,
) -> Tensor:
    """``G / T`` of rows that may hold ``-inf`` (see :func:`_masked_sums`), without ``delta``:
    exactly 0 where pi = 0; a row with ``kl = +inf`` and a nonzero KL gradient is NaN (KL is +inf
    on a neighbourhood of such logits, so it has no gradient); with a zero KL gradient that row
    gets the entropy's and log-prob's gradient only."""
    off = torch.isneginf(log_pi)
    log_pi.masked_fill_(off, 0.0)
    pi = torch.exp(log_pi).masked_fill_(off, 0.0)
    inner = alpha[:, None].expand(log_pi.shape).clone()
    if beta is not None:
        inner.addcmul_(log_pi, beta[:, None])
    if gamma is not None:
        ref_term = torch.sub(log_pi, log_pi_ref.masked_fill(off, 0.0)).mul_(gamma[:, None])
        inner.add_(torch.where((gamma == 0)[:, None], 0.0, ref_term))
    g = pi.mul_(inner).masked_fill_(off, 0.0)
    if gamma is not None:
        undefined = torch.isposinf(kl) & (gamma != 0)
        g.masked_fill_(undefined[:, None], torch.nan)
    return g


def _from_logits(
    logits: Tensor,
    tokens: Tensor | None,
    logits_ref: Tensor | None,
    temperature: float,
    with_entropy: bool,
    transforms: tuple[LogitTransform | None, LogitTransform | None] = (None, None),
    row_chunk: int | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The three values the public functions of this section return a part of; ``transforms``
    are ``logits``' and ``logits_ref``'s (None: none)."""
    transform, transform_ref = transforms
    check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V ≥ 1, got shape {tuple(logits.shape)}")
    aff = affine(transform, temperature, "transform")
    aff_ref = affine(transform_ref, temperature, "transform_ref")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if tokens is not None:
        check_tokens(tokens, lead, vocab, "logits", logits.shape)
        tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    if logits_ref is not None:
        check_float("logits_ref", logits_ref)
        if logits_ref.shape != logits.shape:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)} but logits_ref has shape "
                f"{tuple(logits_ref.shape)}; both must be [..., V] logits at the same positions"
            )
        logits_ref = logits_ref.detach().reshape(-1, vocab)
    rows = _rows_per_chunk(row_chunk, vocab)
    outs = _FromLogits.apply(
        logits.reshape(-1, vocab), tokens, logits_ref, (aff, aff_ref, with_entropy, rows)
    )
    return tuple(None if o is None else o.view(lead) for o in outs)  # type: ignore[return-value]


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
    row_chunk: int | None = None,
) -> Tensor:
    r"""``log pi(y)`` of each token, ``pi = softmax(logits / temperature)``, in row chunks.

    ``logp = x_y - log sum_v exp(x_v)`` with ``x = logits / temperature``; float32 arithmetic on
    chunks of rows (float64 for float64 logits), so no full float32 copy of the logits is made.
    With ``transform``, ``logits`` are the head's raw output ``z`` and ``x = transform(z) /
    temperature`` (:class:`LogitTransform`); the model's own logits need none.

    Gradient: ``(1[v = y] - pi_v) / temperature`` per unit upstream gradient (times ``dx/dz`` of
    the transform), recomputed chunk by chunk in the backward pass (nothing of size ``[..., V]`` is
    saved besides ``logits`` itself).

    Args:
        logits: ``[..., V]`` logits at the positions that produced ``tokens``, any float dtype.
        tokens: ``[...]`` integer token ids in ``[0, V)``.
        temperature: the sampling temperature the logits are divided by.
        transform: the transform of raw head outputs (default: none).
        row_chunk: rows per chunk (default ``ROW_ELEMENTS // V``: about 4M logits, 16 MiB in
            float32, per chunk).

    Returns:
        ``[...]`` float32 (float64 for float64 logits).
    """
    return _from_logits(logits, tokens, None, temperature, False, (transform, None), row_chunk)[0]


def entropy(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
    row_chunk: int | None = None,
) -> Tensor:
    r"""The entropy ``-sum_v pi(v) log pi(v)`` at each position, ``pi = softmax(logits / temperature)``.

    Gradient with respect to the logits: ``-pi_v (log pi_v + entropy) / temperature`` (times
    ``dx/dz`` with a ``transform``, as in :func:`token_logprobs`).

    ``-inf`` logits (a masked vocabulary) are allowed: entries with ``pi(v) = 0`` add 0 (``0 log 0
    = 0``) and get 0 gradient, so the result is the entropy over the remaining support. (A soft
    cap maps ``-inf`` to ``-softcap``, as the model does.)

    Args:
        logits: ``[..., V]``, any float dtype; no row may be ``-inf`` everywhere.
        temperature, transform, row_chunk: as in :func:`token_logprobs`.

    Returns:
        ``[...]`` float32 (float64 for float64 logits).
    """
    return _from_logits(logits, None, None, temperature, True, (transform, None), row_chunk)[1]


def exact_kl(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
    row_chunk: int | None = None,
) -> Tensor:
    r"""The exact KL(pi_theta ‖ pi_ref) over the vocabulary at each position.

    ``kl = sum_v pi(v) (log pi(v) - log pi_ref(v))`` with ``pi = softmax(logits / temperature)``
    and ``pi_ref = softmax(logits_ref / temperature)``; no sampling noise at the position
    (Rao-Blackwellised, Amini, Vieira & Cotterell, arXiv:2504.10637).

    Gradient with respect to ``logits``: ``pi_v (log pi_v - log pi_ref(v) - kl) / temperature``,
    the gradient of KL(pi_theta ‖ pi_ref) at the position. ``logits_ref`` is detached.

    ``-inf`` logits (a masked vocabulary) follow Cover & Thomas (Elements of Information Theory,
    2.3): an entry with ``pi(v) = 0`` adds 0 to the KL and gets 0 gradient, whatever
    ``pi_ref(v)``; an entry with ``pi(v) > 0`` (even if it underflows) and ``pi_ref(v) = 0`` makes
    the KL ``+inf``, and the gradient of that position NaN on its whole row (KL is ``+inf`` on a
    neighbourhood of the logits, so no gradient exists), or exactly 0 where the upstream gradient
    is 0 (a position masked out with ``torch.where``). Finite logits run at full speed; rows with
    ``-inf`` entries cost about one more pass.

    Args:
        logits: ``[..., V]`` policy logits, any float dtype; no row may be ``-inf`` everywhere.
        logits_ref: ``[..., V]`` reference logits at the same positions (detached); likewise.
        temperature: the sampling temperature both are divided by.
        transform: the transform of raw head outputs ``logits`` (default: none).
        transform_ref: likewise for ``logits_ref`` (default: none, whatever ``transform``).
        row_chunk: rows per chunk, as in :func:`token_logprobs`.

    Returns:
        ``[...]`` float32 (float64 when an input is float64).
    """
    check_float("logits_ref", logits_ref)
    return _from_logits(
        logits, None, logits_ref, temperature, False, (transform, transform_ref), row_chunk
    )[2]


def from_logits(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    logits_ref: Tensor | None = None,
    with_entropy: bool = True,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
    row_chunk: int | None = None,
) -> FusedOutput:
    r"""Token log-probs, entropy and exact KL(pi_theta ‖ pi_ref) from logits, in one pass.

    The logits path's counterpart of :func:`fused`: the values of :func:`token_logprobs`,
    :func:`entropy` and :func:`exact_kl` (same equations, chunks, ``-inf`` conventions and
    gradients), from one pass over the rows and one backward pass that serves any combination
    of the three (the gradient formula of the module notes), so a caller that holds a model's
    own ``[..., V]`` logits pays for them once rather than three times.

    Args:
        logits: ``[..., V]`` the policy's logits at the positions that produced ``tokens``.
        tokens: ``[...]`` integer token ids in ``[0, V)``.
        temperature: the sampling temperature both models' logits are divided by.
        logits_ref: ``[..., V]`` the reference's logits at the same positions (detached); turns
            on ``kl``.
        with_entropy: compute the entropy; else it is None.
        transform, transform_ref: the transforms of raw head outputs (default: none).
        row_chunk: rows per chunk, as in :func:`token_logprobs`.

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)`` with the shape of ``tokens``, float32
        (float64 when an input is float64); ``kl`` is None without ``logits_ref``.
    """
    if logits_ref is not None:
        check_float("logits_ref", logits_ref)
    transforms = (transform, transform_ref)
    logp, ent, kl = _from_logits(
        logits, tokens, logits_ref, temperature, with_entropy, transforms, row_chunk
    )
    return FusedOutput(logp, ent, kl)
