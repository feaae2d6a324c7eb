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
  :func:`exact_kl`, or all three in one pass, :func:`from_logits`. Rows are processed in chunks of about 4M logits, so the extra memory is a few
  chunks (plus the gradient, which has the logits' shape and dtype).
* From hidden states and the output head: :func:`fused` returns all three at once from
  ``hidden [N, H]`` (or ``[B, T, H]``), ``weight [V, H]`` and an optional ``bias [V]``, and from
  the reference model's hidden states and head for ``kl``. The logits
  ``hidden @ weight.T + bias`` never exist beyond one ``vocab_chunk x token_chunk`` tile.

Gradients (both families), with upstream gradients ``a``, ``b``, ``c`` of ``logp``, ``entropy``
and ``kl`` at a position, with respect to the scaled logits ``x``:

    G_v = a (1[v = y] - pi_v) - b pi_v (log pi_v + entropy) + c pi_v (log pi_v - log pi_ref(v) - kl)

so that one backward pass serves any combination of the three outputs. The reference
(``logits_ref``, ``hidden_ref``, ``weight_ref``, ``bias_ref``) is detached and gets no gradient.
The gradient with respect to the logits is ``G / T``; with respect to hidden states, weight and bias
it is ``(G / T) @ weight``, ``(G / T).T @ hidden`` and ``sum over tokens of G / T``.

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
  per token are saved for the backward pass; no tile outlives its iteration.
* Loop order: vocabulary chunks outside, token chunks inside, so each weight chunk is converted to
  float32 once per pass and the weight gradient of a chunk is finished before the next starts (no
  float32 ``[V, H]`` accumulator beside the gradient itself).

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
accumulated in float32 and cast to the inputs' dtypes once, at the end. One exception, for speed:
with a bf16 head and hidden states on CPU and at most ``token_chunk`` tokens, the weight
gradient's GEMM multiplies ``G`` rounded to bf16 with the bf16 hidden states, accumulating in
float32 inside the GEMM and rounding once to bf16 (as TRL's GPU kernel does); its extra error is at
most ``2^-8 |G|^T |hidden|``, the size of the bf16 rounding the gradient gets anyway. Values are
clamped to their ranges (``logp ≤ 0``, ``entropy ≥ 0``, ``kl ≥ 0``) in the value only, against
rounding.

Speed on CPU: the GEMMs dominate (four per tile for log-probs: forward, recompute, and the two
gradients; six for KL), so the floor of this recomputing kernel is 4/3 (log-probs) or 6/4 (KL) of
the GEMMs a method that keeps the logits needs. Each of the three GEMM roles runs on the backend
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

__all__ = [
    "LOSS_TILE_ELEMENTS",
    "LOSS_TOKEN_CHUNK_MIN",
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
    "model_logprobs",
    "token_logprobs",
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

# Rows of the logits path hold about this many logits per chunk (16 MiB in float32).
_ROW_ELEMENTS = 1 << 22

# oneDNN's linear is available (torch built with it); a switch for tests and benchmarks: False
# sends every GEMM to torch.mm / addmm.
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class LogitTransform(NamedTuple):
    r"""What a model does to its output head's logits before the softmax.

    With the head's output ``z = hidden @ weight.T + bias``:

        u = scale · z,    x = softcap · tanh(u / softcap)    (x = u without a soft cap)

    and then klpo's sampling temperature, ``x / T`` (the model's own logits are ``x``; vLLM and
    TRL divide those by the temperature). ``scale`` is Cohere's ``logit_scale``, ``1 /
    logits_scaling`` for Granite (which divides) and Falcon-H1's ``lm_head_multiplier``;
    ``softcap`` is Gemma 2's ``final_logit_softcapping`` (Gemma Team, arXiv:2408.00118).
    :func:`klpo.heads.read_head` reads it from a model. The gradient follows the chain rule:
    ``dx/dz = scale (1 - tanh²(u / softcap))`` (``scale`` without a cap).

    Attributes:
        scale: the logits' multiplier, > 0 (default 1).
        softcap: the soft cap, > 0, or None for none.
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def divided_by(cls, divisor: float, softcap: float | None = None) -> LogitTransform:
        """The transform of a head whose logits are divided by ``divisor`` (Granite's
        ``logits_scaling``): ``scale = 1 / divisor``."""
        return cls.make(1.0 / _positive("divisor", divisor), softcap)

    @classmethod
    def make(cls, scale: float = 1.0, softcap: float | None = None) -> LogitTransform:
        """A checked transform: ValueError unless ``scale`` and ``softcap`` are finite and > 0."""
        return cls(
            _positive("scale", scale), None if softcap is None else _positive("softcap", softcap)
        )

    @property
    def is_identity(self) -> bool:
        """True when the logits are the head's output unchanged."""
        return self.scale == 1.0 and self.softcap is None

    def apply(self, z: Tensor) -> Tensor:
        """``x`` from the head's output ``z`` (any shape), in ``z``'s dtype: the model's logits."""
        u = z * self.scale if self.scale != 1.0 else z
        return u if self.softcap is None else torch.tanh(u / self.softcap) * self.softcap


def _positive(name: str, value: float) -> float:
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"a logit transform's {name} must be finite and > 0, got {value!r}")
    return v


class FusedOutput(NamedTuple):
    """What :func:`fused` returns, each with the shape of ``tokens``, float32 (float64 inputs: float64).

    Attributes:
        logp: log pi_theta(y) of each token.
        entropy: the entropy of pi_theta at each position (None if not asked for).
        kl: KL(pi_theta ‖ pi_ref) at each position (None without a reference).
    """

    logp: Tensor
    entropy: Tensor | None
    kl: Tensor | None


# --------------------------------------------------------------------------------------------
# Helpers.


def default_vocab_chunk(tokens: int) -> int:
    """The vocabulary width of a tile of ``tokens`` rows: ``TILE_ELEMENTS / tokens`` rounded down to
    a power of two, clamped to [512, VOCAB_CHUNK_MAX]."""
    width = TILE_ELEMENTS // max(tokens, 1)
    return min(VOCAB_CHUNK_MAX, max(512, 1 << max(width.bit_length() - 1, 0)))


SUM_BLOCK = 512
"""The vocabulary sums of the fused path add :data:`SUM_BLOCK` entries at a time, in order."""


def _add_column_sums(out: Tensor, t: Tensor, ones: Tensor) -> None:
    """``out += t.sum(0)`` for a tile ``t [vc, n]``, in blocks of :data:`SUM_BLOCK` rows added in
    order (one ``ones @ block`` each; ``ones`` holds at least ``SUM_BLOCK`` ones).

    The order of the additions is then a function of the vocabulary position alone: a token's
    sums are the same bits whatever the tile's width (a multiple of the block), the number of
    tokens in the call, or whether the vocabulary comes in one tile (:func:`fused_loss`) or many
    (:func:`fused`). So a row scored alone, in a micro-batch or in the whole batch, and by either
    function, has one log-prob, and two identical models have an exact KL of exactly 0.
    """
    rows = t.shape[0]
    for b0 in range(0, rows, SUM_BLOCK):
        block = t[b0 : b0 + SUM_BLOCK]
        out += ones[: block.shape[0]] @ block


def _add_column_dots(out: Tensor, a: Tensor, b: Tensor, ones: Tensor) -> None:
    """``out += (a * b).sum(0)`` for tiles ``[vc, n]``, in the order of :func:`_add_column_sums`;
    each block's product goes through one small buffer (no tile-sized temporary)."""
    rows = a.shape[0]
    buf = torch.empty(min(SUM_BLOCK, rows), a.shape[1], dtype=a.dtype, device=a.device)
    for b0 in range(0, rows, SUM_BLOCK):
        b1 = min(b0 + SUM_BLOCK, rows)
        block = torch.mul(a[b0:b1], b[b0:b1], out=buf[: b1 - b0])
        out += ones[: b1 - b0] @ block


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _inv_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    return 1.0 / t


class _Affine(NamedTuple):
    """A head's transform with the temperature folded in: ``x = cap_t tanh(lin z)`` with a soft
    cap, ``x = lin z`` without; ``slope`` is ``scale / T``, so that ``dx/dz = slope`` uncapped and
    ``slope (1 - tanh²(lin z))`` capped."""

    lin: float
    cap_t: float | None
    slope: float

    @property
    def coef(self) -> float:
        """The factor of the gradient coefficients (:func:`_coefficients`): ``dx/dz`` where it is
        constant; 1 for a capped head, whose tiles are multiplied by their own slope instead."""
        return self.slope if self.cap_t is None else 1.0


def _affine(transform: LogitTransform | None, temperature: float, name: str) -> _Affine:
    """``transform`` (checked) and the temperature as an :class:`_Affine`."""
    inv_t = _inv_temperature(temperature)
    if transform is None:
        return _Affine(inv_t, None, inv_t)
    if not isinstance(transform, LogitTransform):
        raise TypeError(
            f"{name} must be a klpo.logprobs.LogitTransform or None, got {type(transform).__name__}"
        )
    scale, cap = LogitTransform.make(*transform)
    if cap is None:
        return _Affine(scale * inv_t, None, scale * inv_t)
    return _Affine(scale / cap, cap * inv_t, scale * inv_t)


def _transformed(z: Tensor, cd: torch.dtype, aff: _Affine) -> Tensor:
    """``x = aff(z)`` as a fresh tensor in the compute dtype."""
    x = z.to(cd).mul(aff.lin)
    if aff.cap_t is not None:
        x.tanh_().mul_(aff.cap_t)
    return x


def _slope_of(y: Tensor, aff: _Affine) -> Tensor:
    """``dx/dz = slope (1 - y²)`` from ``y = tanh(lin z)``, as a new tensor (one pass)."""
    return torch.addcmul(y.new_tensor(aff.slope), y, y, value=-aff.slope)


def _check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


def _check_tokens(
    tokens: Tensor, shape: torch.Size, vocab: int, what: str, full: torch.Size
) -> None:
    """``tokens`` must be integer ids in ``[0, vocab)`` with ``shape``, the shape of ``what``
    (whose own shape is ``full``) without its last dimension."""
    if (
        not isinstance(tokens, Tensor)
        or tokens.dtype.is_floating_point
        or tokens.is_complex()
        or tokens.dtype == torch.bool
    ):
        raise TypeError(
            f"tokens must be an integer tensor of token ids, got "
            f"{tokens.dtype if isinstance(tokens, Tensor) else type(tokens).__name__}"
        )
    if tokens.shape != shape:
        raise ValueError(
            f"tokens has shape {tuple(tokens.shape)} but {what} has shape {tuple(full)}; tokens "
            f"must have {what}'s shape without its last dimension, {tuple(shape)} (one token "
            f"per position)"
        )
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(
            f"tokens must lie in [0, {vocab}) (the vocabulary size), got values in "
            f"[{int(tokens.min())}, {int(tokens.max())}]; mask padding with a valid id and drop "
            f"it afterwards with torch.where"
        )


def _coefficients(
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    grad_kl: Tensor | None,
    ent: Tensor | None,
    kl: Tensor | None,
    inv_t: float,
    dtype: torch.dtype,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Per-token (alpha, beta, gamma, delta) with ``G / T = pi (alpha + beta log pi + gamma (log pi -
    log pi_ref)) + delta 1[v = y]``, from the module's gradient formula; None where a term is
    absent (beta: no entropy gradient; gamma: no KL gradient).

    The KL's part multiplies the difference ``log pi - log pi_ref``, formed first: where the two
    models are one (the reference at step 1), it is exactly 0 at every entry and so is the KL's
    gradient (``kl`` is exactly 0 there too), where ``beta log pi + gamma' log pi_ref`` would
    leave the rounding of two products that should cancel, a gradient of ~1e-9 that an adaptive
    optimizer scales up to steps of the learning rate's size.

    ``inv_t`` is ``dx/dz`` where it is constant (:attr:`_Affine.coef`: ``scale / T``); a capped
    head passes 1 and multiplies ``G`` by its slope tile by tile."""
    a = None if grad_logp is None else grad_logp.to(dtype)
    b = None if grad_entropy is None else grad_entropy.to(dtype)
    c = None if grad_kl is None else grad_kl.to(dtype)
    alpha = torch.zeros((), dtype=dtype)
    beta = None
    if a is not None:
        alpha = alpha - a
    if b is not None:
        alpha = alpha - b * ent
        beta = -b
    if c is not None:
        # kl may be +inf (pi_ref = 0 on pi's support): 0 * inf would be NaN where the upstream
        # gradient is 0, and a masked-out position must get exactly zero gradient.
        alpha = alpha - torch.where(c == 0, 0.0, c * kl)
    gamma = None if c is None else c * inv_t
    delta = None if a is None else a * inv_t
    return (
        alpha * inv_t,
        None if beta is None else beta * inv_t,
        gamma,
        delta,
    )


def _add_at_targets(g: Tensor, tokens: Tensor, v0: int, delta: Tensor) -> None:
    """``g[tokens[i] - v0, i] += delta[i]`` for the targets inside the tile ``g [vc, n]``."""
    rows = tokens - v0
    inside = (rows >= 0) & (rows < g.shape[0])
    if bool(inside.any()):
        cols = torch.arange(g.shape[1], device=g.device)[inside]
        g.index_put_((rows[inside], cols), delta[inside], accumulate=True)


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
        aff: _Affine,
        aff_ref: _Affine,
        with_entropy: bool,
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        ctx.set_materialize_grads(False)
        n, vocab = logits.shape
        cd = _compute_dtype(logits, logits_ref)
        rows = max(1, _ROW_ELEMENTS // max(vocab, 1))
        log_z = torch.empty(n, dtype=cd, device=logits.device)
        log_z_ref = None if logits_ref is None else torch.empty_like(log_z)
        logp = None if tokens is None else torch.empty_like(log_z)
        ent = torch.empty_like(log_z) if with_entropy else None
        kl = None if logits_ref is None else torch.empty_like(log_z)
        for r0 in range(0, n, rows):
            r = slice(r0, min(r0 + rows, n))
            x = _transformed(logits[r], cd, aff)  # a fresh tensor, safe to modify
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
                x_ref = _transformed(logits_ref[r], cd, aff_ref)
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
            x_ref = None if kl is None else _transformed(logits_ref[r], cd, aff_ref)
            e_r, kl_r = _masked_sums(
                _transformed(logits[r], cd, aff),
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
            return (None,) * 6
        cd, aff, aff_ref, rows = ctx.cd, ctx.aff, ctx.aff_ref, ctx.rows
        alpha, beta, gamma, delta = _coefficients(
            grad_logp, grad_entropy, grad_kl, ent, kl, aff.coef, cd
        )
        alpha = alpha.expand(log_z.shape)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        n = logits.shape[0]
        for r0 in range(0, n, rows):
            r = slice(r0, min(r0 + rows, n))
            log_pi, slope = _log_pi_rows(logits[r], log_z[r], cd, aff)
            if r0 // rows in ctx.masked:
                log_pi_ref = None
                if gamma is not None:
                    log_pi_ref = _transformed(logits_ref[r], cd, aff_ref).sub_(log_z_ref[r, None])
                g = _masked_grad(
                    log_pi,
                    log_pi_ref,
                    alpha[r],
                    None if beta is None else beta[r],
                    None if gamma is None else gamma[r],
                    None if gamma is None else kl[r],
                )
                if delta is not None:
                    g.scatter_add_(1, tokens[r, None], delta[r, None])
                grad[r] = g if slope is None else g.mul_(slope)
                continue
            pi = torch.exp(log_pi)
            if beta is None and gamma is None:
                g = pi.mul_(alpha[r, None])
            else:
                d = None  # log pi - log pi_ref: exactly 0 where the two models are one
                if gamma is not None:
                    log_pi_ref = _transformed(logits_ref[r], cd, aff_ref).sub_(log_z_ref[r, None])
                    d = torch.sub(log_pi, log_pi_ref, out=log_pi_ref)
                if beta is not None:
                    inner = torch.addcmul(alpha[r, None], log_pi, beta[r, None], out=log_pi)
                    if d is not None:
                        inner.addcmul_(d, gamma[r, None])
                else:
                    inner = torch.addcmul(alpha[r, None], d, gamma[r, None], out=d)
                g = pi.mul_(inner)
            if delta is not None:
                g.scatter_add_(1, tokens[r, None], delta[r, None])
            grad[r] = g if slope is None else g.mul_(slope)
        return grad, None, None, None, None, None


def _log_pi_rows(
    z: Tensor, log_z: Tensor, cd: torch.dtype, aff: _Affine
) -> tuple[Tensor, Tensor | None]:
    """``log pi = x - L`` of rows of logits ``z`` (a fresh tensor) and, for a capped transform,
    ``dx/dz`` (None otherwise: the constant is in the coefficients)."""
    if aff.cap_t is None:
        return z.to(cd).mul(aff.lin).sub_(log_z[:, None]), None
    y = z.to(cd).mul(aff.lin).tanh_()
    slope = _slope_of(y, aff)
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
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    _check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V ≥ 1, got shape {tuple(logits.shape)}")
    aff = _affine(transform, temperature, "transform")
    aff_ref = _affine(transform_ref, temperature, "transform_ref")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    if tokens is not None:
        _check_tokens(tokens, lead, vocab, "logits", logits.shape)
        tokens = tokens.reshape(-1).to(device=logits.device, dtype=torch.long)
    if logits_ref is not None:
        _check_float("logits_ref", logits_ref)
        if logits_ref.shape != logits.shape:
            raise ValueError(
                f"logits has shape {tuple(logits.shape)} but logits_ref has shape "
                f"{tuple(logits_ref.shape)}; both must be [..., V] logits at the same positions"
            )
        logits_ref = logits_ref.detach().reshape(-1, vocab)
    outs = _FromLogits.apply(
        logits.reshape(-1, vocab), tokens, logits_ref, aff, aff_ref, with_entropy
    )
    return tuple(None if o is None else o.view(lead) for o in outs)  # type: ignore[return-value]


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
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

    Returns:
        ``[...]`` float32 (float64 for float64 logits).
    """
    return _from_logits(logits, tokens, None, temperature, False, transform)[0]


def entropy(
    logits: Tensor, *, temperature: float = 1.0, transform: LogitTransform | None = None
) -> Tensor:
    r"""The entropy ``-sum_v pi(v) log pi(v)`` at each position, ``pi = softmax(logits / temperature)``.

    Gradient with respect to the logits: ``-pi_v (log pi_v + entropy) / temperature`` (times
    ``dx/dz`` with a ``transform``, as in :func:`token_logprobs`).

    ``-inf`` logits (a masked vocabulary) are allowed: entries with ``pi(v) = 0`` add 0 (``0 log 0
    = 0``) and get 0 gradient, so the result is the entropy over the remaining support. (A soft
    cap maps ``-inf`` to ``-softcap``, as the model does.)

    Args:
        logits: ``[..., V]``, any float dtype; no row may be ``-inf`` everywhere.
        temperature: the sampling temperature the logits are divided by.
        transform: the transform of raw head outputs (default: none).

    Returns:
        ``[...]`` float32 (float64 for float64 logits).
    """
    return _from_logits(logits, None, None, temperature, True, transform)[1]


def exact_kl(
    logits: Tensor,
    logits_ref: Tensor,
    *,
    temperature: float = 1.0,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
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

    Returns:
        ``[...]`` float32 (float64 when an input is float64).
    """
    _check_float("logits_ref", logits_ref)
    return _from_logits(logits, None, logits_ref, temperature, False, transform, transform_ref)[2]


def from_logits(
    logits: Tensor,
    tokens: Tensor,
    *,
    temperature: float = 1.0,
    logits_ref: Tensor | None = None,
    with_entropy: bool = True,
    transform: LogitTransform | None = None,
    transform_ref: LogitTransform | None = None,
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

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)`` with the shape of ``tokens``, float32
        (float64 when an input is float64); ``kl`` is None without ``logits_ref``.
    """
    if logits_ref is not None:
        _check_float("logits_ref", logits_ref)
    logp, ent, kl = _from_logits(
        logits, tokens, logits_ref, temperature, with_entropy, transform, transform_ref
    )
    return FusedOutput(logp, ent, kl)


# --------------------------------------------------------------------------------------------
# Fused from hidden states and the output head.


class _Head:
    """One model's head in the compute dtype, by tiles: ``x = lin (hidden @ weight.T + bias)``
    (``lin = scale / T``), or ``x = cap_t tanh(lin (hidden @ weight.T + bias))`` with a soft cap
    (``lin = scale / cap``, ``cap_t = cap / T``); see :class:`_Affine`."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        aff: _Affine,
        cd: torch.dtype,
        plan: gemm.Plan,
    ) -> None:
        lin = aff.lin
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
        slope = _slope_of(y, self.aff) if want_slope else None
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
        return _slope_of(y.tanh_(), self.aff)

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

    def subset(self, idx: Tensor) -> _Head:
        head = object.__new__(_Head)
        head.hidden, head.hidden_t = self.hidden[idx], self.hidden_t[idx]
        head.weight, head.bias_t, head.cd, head.plan = self.weight, self.bias_t, self.cd, self.plan
        head.aff, head._buffer = self.aff, None
        return head


def _sums(
    pol: _Head,
    ref: _Head | None,
    m: Tensor,
    m_ref: Tensor | None,
    with_entropy: bool,
    token_chunk: int,
    vocab_chunk: int,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """Per-token sums over the vocabulary, relative to the references ``m`` and ``m_ref``.

    With ``e_v = exp(x_v - m)``: ``s = sum e``, ``s_x = sum e (x - m)`` (entropy),
    ``s_d = sum e (x - m - x_ref + m_ref)`` and ``s_ref = sum exp(x_ref - m_ref)`` (KL).
    """
    n, vocab = pol.hidden.shape[0], pol.weight.shape[0]

    def zeros() -> Tensor:
        return torch.zeros(n, dtype=pol.cd, device=m.device)

    s = zeros()
    s_x = zeros() if with_entropy else None
    s_d = None if ref is None else zeros()
    s_ref = None if ref is None else zeros()
    keep_x = with_entropy or ref is not None
    ones = torch.ones(SUM_BLOCK, dtype=pol.cd, device=m.device)
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = pol.chunk(v0, v1)
        w_ref = None if ref is None else ref.chunk(v0, v1)
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            x = pol.tile(w, v0, t, m)  # [vc, n]
            e = torch.exp(x) if keep_x else x.exp_()
            _add_column_sums(s[t], e, ones)
            if s_x is not None:
                _add_column_dots(s_x[t], e, x, ones)
            if ref is not None:
                x_ref = ref.tile(w_ref, v0, t, m_ref)
                _add_column_dots(s_d[t], x.sub_(x_ref), e, ones)
                _add_column_sums(s_ref[t], x_ref.exp_(), ones)
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


def _plan(hidden: Tensor, weight: Tensor, cd: torch.dtype) -> gemm.Plan:
    """The GEMM backends of a fused call (:mod:`klpo.gemm`): measured once per machine for heads
    big enough to gain from it (:data:`PLAN_TOKENS`), the static default for small ones,
    torch.mm where ``_ONEDNN`` is off.

    Chosen by the head alone, never by the number of tokens in the call: two backends round a
    logit differently, so a row's log-prob would depend on the batch it came in (the scoring
    pass's whole batch against the update's micro-batch)."""
    if not _ONEDNN:
        return gemm.Plan("mm", "mm", "mm", False)
    low = hidden.dtype == weight.dtype == torch.bfloat16
    dtype = torch.bfloat16 if low else cd
    vocab, h = weight.shape
    if 2.0 * PLAN_TOKENS * vocab * h < gemm.MIN_FLOPS:
        return gemm.default_plan(dtype, hidden.device)
    return gemm.plan(h, dtype, hidden.device)


def _backward_logp(
    pol: _Head,
    tokens: Tensor,
    log_z: Tensor,
    alpha: Tensor,
    delta: Tensor | None,
    grad_h: Tensor | None,
    grad_w: Tensor | None,
    grad_b: Tensor | None,
    ctx,
) -> None:
    """The backward pass when only ``logp`` has a gradient: ``G / T = alpha pi + delta 1[v = y]``.

    The per-token ``alpha`` is taken out of the tiles: ``grad_hidden = alpha * (pi @ W) + delta
    W[y]`` (one row scaling at the end) and ``grad_weight = pi.T @ (alpha * hidden) + the targets'
    rows delta * hidden`` (``alpha * hidden`` formed once), so a tile is one GEMM, one ``exp`` and
    two GEMMs: no pass to scale it or to add at the targets. A soft-capped head multiplies each
    tile by its ``dx/dz`` (``delta`` comes with the targets' own). Fills ``grad_h`` (float32
    ``[N, H]``, zeros), ``grad_w`` and ``grad_b`` in place.
    """
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
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = pol.chunk(v0, v1)
        dw = None
        if grad_w is not None:
            dw = grad_w[v0:v1] if direct else dw_buffer[: v1 - v0]
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            pi, slope = pol.tile_slope(w, v0, t, log_z)
            pi.exp_()  # pi.T: [vc, n]
            if slope is not None:  # a soft cap: dx/dz at each entry (alpha is taken out still)
                pi.mul_(slope)
            if grad_h is not None:
                gemm.grad_hidden(grad_h[t], pi, w, plan.grad_hidden)
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


class _Fused(torch.autograd.Function):
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
        aff: _Affine,
        aff_ref: _Affine,
        with_entropy: bool,
        token_chunk: int,
        vocab_chunk: int,
        plan: gemm.Plan,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        ctx.set_materialize_grads(False)
        cd = _compute_dtype(hidden, weight, bias, hidden_ref, weight_ref, bias_ref)
        pol = _Head(hidden, weight, bias, aff, cd, plan)
        ref = (
            None
            if hidden_ref is None
            else _Head(hidden_ref, weight_ref, bias_ref, aff_ref, cd, plan)
        )
        # References: the targets' own logits, so e = exp(x - x_y) = pi / pi(y) needs no max pass.
        x_y = pol.target_logits(tokens)
        m_ref = None if ref is None else ref.target_logits(tokens)
        sums = _sums(pol, ref, x_y, m_ref, with_entropy, token_chunk, vocab_chunk)
        logp, log_z, ent, kl = _finish(x_y, x_y, sums)
        log_z_ref = None if ref is None else m_ref + torch.log(sums[3])

        # A token whose sums overflowed had a logit ~88 above its target's: redo it with the max.
        finite = torch.isfinite(logp)
        for t in (ent, kl, log_z_ref):
            if t is not None:
                finite &= torch.isfinite(t)
        if not bool(finite.all()):
            idx = (~finite).nonzero()[:, 0]
            pol_i = pol.subset(idx)
            ref_i = None if ref is None else ref.subset(idx)
            m_i = pol_i.row_max(token_chunk, vocab_chunk)
            m_ref_i = None if ref_i is None else ref_i.row_max(token_chunk, vocab_chunk)
            sums_i = _sums(pol_i, ref_i, m_i, m_ref_i, with_entropy, token_chunk, vocab_chunk)
            logp_i, log_z_i, ent_i, kl_i = _finish(x_y[idx], m_i, sums_i)
            logp[idx], log_z[idx] = logp_i, log_z_i
            if ent is not None:
                ent[idx] = ent_i
            if kl is not None:
                kl[idx] = kl_i
                log_z_ref[idx] = m_ref_i + torch.log(sums_i[3])

        logp = logp.clamp_max(0.0)
        ent = None if ent is None else ent.clamp_min(0.0)
        kl = None if kl is None else kl.clamp_min(0.0)
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            tokens,
            hidden_ref,
            weight_ref,
            bias_ref,
            log_z,
            log_z_ref,
            ent,
            kl,
        )
        ctx.aff, ctx.aff_ref, ctx.cd = aff, aff_ref, cd
        ctx.token_chunk, ctx.vocab_chunk, ctx.plan = token_chunk, vocab_chunk, plan
        return logp, ent, kl

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_kl):
        (
            hidden,
            weight,
            bias,
            tokens,
            hidden_ref,
            weight_ref,
            bias_ref,
            log_z,
            log_z_ref,
            ent,
            kl,
        ) = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        none = (None,) * 13
        if grad_logp is None and grad_entropy is None and grad_kl is None:
            return none
        if not (need_h or need_w or need_b):
            return none
        cd, aff = ctx.cd, ctx.aff
        token_chunk, vocab_chunk = ctx.token_chunk, ctx.vocab_chunk
        alpha, beta, gamma, delta = _coefficients(
            grad_logp, grad_entropy, grad_kl, ent, kl, aff.coef, cd
        )
        # Row vectors: the tiles are [vc, n], vocabulary by tokens.
        alpha = alpha.expand(log_z.shape)[None, :]
        beta = None if beta is None else beta[None, :]
        gamma = None if gamma is None else gamma[None, :]
        plan = ctx.plan
        pol = _Head(hidden, weight, bias, aff, cd, plan)
        ref = (
            None
            if gamma is None
            else _Head(hidden_ref, weight_ref, bias_ref, ctx.aff_ref, cd, plan)
        )
        if delta is not None and pol.capped:  # the targets' part, times dx/dz at the target
            delta = delta * pol.target_slope(tokens)
        n, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        grad_h = torch.zeros(hidden.shape, dtype=cd, device=device) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = torch.empty_like(bias) if need_b else None
        one_token_chunk = n <= token_chunk
        bf16_w = need_w and plan.bf16_grad_weight and one_token_chunk
        if beta is None and gamma is None and not bf16_w:
            _backward_logp(pol, tokens, log_z, alpha[0], delta, grad_h, grad_w, grad_b, ctx)
            return (
                None if grad_h is None else grad_h.to(hidden.dtype),
                grad_w,
                grad_b,
                *(None,) * 10,
            )
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
                if beta is None and gamma is None:
                    g = log_pi.exp_().mul_(alpha[tc])
                else:
                    pi = torch.exp(log_pi)
                    d = None  # log pi - log pi_ref: exactly 0 where the two models are one
                    if gamma is not None:
                        log_pi_ref = ref.tile(w_ref, v0, t, log_z_ref)
                        d = torch.sub(log_pi, log_pi_ref, out=log_pi_ref)
                    if beta is not None:
                        inner = torch.addcmul(alpha[tc], log_pi, beta[tc], out=log_pi)
                        if d is not None:
                            inner.addcmul_(d, gamma[tc])
                    else:
                        inner = torch.addcmul(alpha[tc], d, gamma[tc], out=d)
                    g = pi.mul_(inner)
                if slope is not None:
                    g.mul_(slope)
                if delta is not None:
                    _add_at_targets(g, tokens[t], v0, delta[t])
                # g is (G / T).T for this tile: [vc, n].
                if need_h:
                    gemm.grad_hidden(grad_h[t], g, w, plan.grad_hidden)
                if need_w and bf16_w:
                    # bf16 G (rounded once), float32 accumulation inside the GEMM, one rounding.
                    if g_low is None:
                        g_low = torch.empty(g.shape, dtype=weight.dtype, device=device)
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
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            grad_w,
            grad_b,
            *(None,) * 10,
        )


def _validate(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Tensor | None,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    bias_ref: Tensor | None,
) -> None:
    """The argument checks of :func:`fused` and :func:`fused_loss`."""
    _check_float("hidden", hidden)
    _check_float("weight", weight)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden's last dimension), got "
            f"shape {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    lead = hidden.shape[:-1]
    _check_tokens(tokens, lead, vocab, "hidden", hidden.shape)
    if bias is not None:
        _check_float("bias", bias)
        if bias.shape != (vocab,):
            raise ValueError(f"bias must be [V] = [{vocab}], got shape {tuple(bias.shape)}")
    if (hidden_ref is None) != (weight_ref is None):
        raise ValueError(
            "the exact KL needs both hidden_ref and weight_ref (the reference model's hidden "
            "states and head); pass both or neither"
        )
    if bias_ref is not None and weight_ref is None:
        raise ValueError("bias_ref was given without hidden_ref and weight_ref")
    if hidden_ref is not None:
        _check_float("hidden_ref", hidden_ref)
        _check_float("weight_ref", weight_ref)
        if hidden_ref.shape[:-1] != lead or hidden_ref.dim() != hidden.dim():
            raise ValueError(
                f"hidden_ref has shape {tuple(hidden_ref.shape)} but hidden has shape "
                f"{tuple(hidden.shape)}; they must agree in every dimension but the last"
            )
        if weight_ref.dim() != 2 or weight_ref.shape != (vocab, hidden_ref.shape[-1]):
            raise ValueError(
                f"weight_ref must be [V, H_ref] = [{vocab}, {hidden_ref.shape[-1]}], got shape "
                f"{tuple(weight_ref.shape)}; policy and reference must share the vocabulary"
            )
        if bias_ref is not None:
            _check_float("bias_ref", bias_ref)
            if bias_ref.shape != (vocab,):
                raise ValueError(
                    f"bias_ref must be [V] = [{vocab}], got shape {tuple(bias_ref.shape)}"
                )


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
) -> FusedOutput:
    r"""Token log-probs, entropy and exact KL(pi_theta ‖ pi_ref) from hidden states and the head.

    With ``x = transform(hidden @ weight.T + bias) / temperature`` and ``pi = softmax(x)`` (and
    ``x_ref``, ``pi_ref`` likewise from ``hidden_ref``, ``weight_ref``, ``bias_ref`` and
    ``transform_ref``), per position:
    ``logp = log pi(y)``, ``entropy = -sum_v pi log pi`` and
    ``kl = sum_v pi (log pi - log pi_ref)``, all computed tile by tile (``vocab_chunk`` vocabulary
    entries by ``token_chunk`` tokens) so that the ``[N, V]`` logits never exist; see the module
    notes for the algorithm, its precision and its speed.

    Gradient: with respect to ``hidden``, ``weight`` and ``bias`` (whichever require it), of any
    combination of the three outputs, in one backward pass that recomputes the tiles (the formula
    for ``G`` is in the module notes), accumulated in float32 and cast to the inputs' dtypes. A
    ``weight`` tied to the input embeddings (``model.lm_head.weight``) gets this gradient added to
    the embedding's by autograd as usual. The reference (``hidden_ref``, ``weight_ref``,
    ``bias_ref``) is detached.

    Args:
        hidden: ``[N, H]`` or ``[B, T, H]`` the policy's last hidden states at the positions that
            produced ``tokens`` (after the final norm), float32, bf16, fp16 or float64.
        weight: ``[V, H]`` the policy's output head (``model.lm_head.weight``).
        tokens: ``[N]`` or ``[B, T]`` integer token ids in ``[0, V)``.
        bias: ``[V]`` the head's bias, if it has one.
        temperature: the sampling temperature the logits are divided by (policy and reference).
        hidden_ref: ``[N, H_ref]`` or ``[B, T, H_ref]`` the reference model's hidden states at the
            same positions; with ``weight_ref`` it turns on ``kl``.
        weight_ref: ``[V, H_ref]`` the reference model's head.
        bias_ref: ``[V]`` the reference head's bias, if any.
        with_entropy: compute the entropy (one more elementwise pass per tile); else it is None.
        token_chunk: tokens per tile (default :data:`TOKEN_CHUNK` = 4096).
        vocab_chunk: vocabulary entries per tile (default
            ``default_vocab_chunk(min(N, token_chunk))``: at most :data:`TILE_ELEMENTS` logits,
            8 MiB in float32). Both defaults are justified in docs/performance.md.
        transform: what the policy's model does to its head's output before the softmax (a
            scale, a soft cap: :class:`LogitTransform`, read from a model by
            :func:`klpo.heads.read_head`); None or the identity: nothing, at no cost. A soft cap
            costs two elementwise passes per tile (and one more in the backward pass).
        transform_ref: likewise for the reference's head (None: nothing, whatever
            ``transform``).

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)``, each with the shape of ``tokens``, float32
        (float64 when an input is float64); ``kl`` is None without a reference.

    Raises:
        ValueError / TypeError: naming the argument, for a wrong shape, dtype, token id, chunk size
        or temperature, or for half a reference.
    """
    _validate(hidden, weight, tokens, bias, hidden_ref, weight_ref, bias_ref)
    lead = hidden.shape[:-1]
    if vocab_chunk is None:
        vocab_chunk = default_vocab_chunk(min(math.prod(lead), token_chunk))
    for name, size in (("token_chunk", token_chunk), ("vocab_chunk", vocab_chunk)):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")
    aff = _affine(transform, temperature, "transform")
    aff_ref = _affine(transform_ref, temperature, "transform_ref")

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.reshape(-1, t.shape[-1])

    def detached(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach()

    logp, ent, kl = _Fused.apply(
        flat(hidden),
        weight,
        bias,
        tokens.reshape(-1).to(device=hidden.device, dtype=torch.long),
        detached(flat(hidden_ref)),
        detached(weight_ref),
        detached(bias_ref),
        aff,
        aff_ref,
        bool(with_entropy),
        token_chunk,
        vocab_chunk,
        _plan(flat(hidden), weight, _compute_dtype(hidden, weight, bias, hidden_ref, weight_ref)),
    )
    return FusedOutput(
        logp.view(lead),
        None if ent is None else ent.view(lead),
        None if kl is None else kl.view(lead),
    )


# --------------------------------------------------------------------------------------------
# A weighted sum of the outputs as one scalar loss, its gradient taken in the forward pass.

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
    head: _Head, w: Tensor, t: slice, m: Tensor, keep_x: bool, want_slope: bool = False
) -> tuple[Tensor | None, Tensor, Tensor, Tensor | None]:
    """``x = x[t] - m[t]`` as a ``[V, k]`` tile, ``e = exp(x)``, ``s = sum_v e`` per column, and
    (``want_slope``, a capped head) ``dx/dz`` at each entry.

    ``m[t]`` is raised to the column's max (in place) where ``s`` overflows (a logit ~88 above
    ``m``), so the result is exact either way. Without ``keep_x`` the exp is taken in place and
    ``x`` is not returned (None).
    """
    x, slope = head.tile_slope(w, 0, t, m, want_slope)
    e = torch.exp(x) if keep_x else x.exp_()
    ones = torch.ones(SUM_BLOCK, dtype=e.dtype, device=e.device)
    s = e.new_zeros(e.shape[1])
    _add_column_sums(s, e, ones)  # in fused's order (a token's log-prob is one number)
    if not bool(torch.isfinite(s).all()):
        if not keep_x:
            x = head.tile(w, 0, t, m)
        shift = x.amax(0).clamp_min(0.0)  # 0 where the column was fine: the same result there
        x.sub_(shift)
        m[t] += shift
        e = torch.exp(x) if keep_x else x.exp_()
        s = e.new_zeros(e.shape[1])
        _add_column_sums(s, e, ones)
    return (x if keep_x else None), e, s, slope


def _add_grad_weight(grad_w: Tensor | None, g: Tensor, h: Tensor, plan: gemm.Plan) -> Tensor:
    """``grad_w + g @ h``: the first product is the new gradient (no zeros to add it to, no copy),
    later ones are added in place by ``addmm_``, which needs no temporary ``[V, H]``."""
    if grad_w is None:
        return gemm.grad_weight_new(g, h, plan.grad_weight)
    gemm.grad_weight(grad_w, g, h, "mm", True)
    return grad_w


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
        aff: _Affine,
        aff_ref: _Affine,
        with_entropy: bool,
        token_chunk: int,
        plan: gemm.Plan,
        want: tuple[bool, bool, bool],
    ):
        cd = _compute_dtype(hidden, weight, bias, hidden_ref, weight_ref, bias_ref)
        need_h, need_w, need_b = want
        need_any = need_h or need_w or need_b
        pol = _Head(hidden, weight, bias, aff, cd, plan)
        ref = (
            None
            if hidden_ref is None
            else _Head(hidden_ref, weight_ref, bias_ref, aff_ref, cd, plan)
        )
        n, hs = pol.hidden.shape
        vocab = weight.shape[0]
        device = hidden.device
        w = pol.chunk(0, vocab)
        if ref is not None:  # its own buffer: pol.chunk may reuse one
            w_ref = weight_ref if weight_ref.dtype == cd else weight_ref.to(cd)
        x_y = pol.target_logits(tokens)
        slope_y = pol.target_slope(tokens) if need_any else None  # None: an uncapped head
        m = x_y.clone()
        m_ref = None if ref is None else ref.target_logits(tokens)
        logp = torch.empty(n, dtype=cd, device=device)
        ent = torch.empty_like(logp) if with_entropy else None
        kl = None if ref is None else torch.empty_like(logp)
        a = None if a is None else a.to(cd)
        b = None if b is None else b.to(cd)
        c = None if c is None else c.to(cd)
        grad_h = torch.zeros(n, hs, dtype=cd, device=device) if need_h else None
        grad_w = None  # [V, H], the first chunk's product, then accumulated into
        grad_b = torch.zeros(vocab, dtype=cd, device=device) if need_b else None
        # The tile x itself is needed for the entropy, the KL and the gradient of either.
        keep_x = with_entropy or ref is not None
        for t0 in range(0, n, token_chunk):
            t = slice(t0, min(t0 + token_chunk, n))
            x, e, s, slope = _shifted_tile(pol, w, t, m, keep_x, need_any)  # [V, k], x - m[t]
            log_s = torch.log(s)
            logp[t] = (x_y[t] - m[t]) - log_s
            ones = torch.ones(SUM_BLOCK, dtype=cd, device=device)
            if ent is not None:
                s_x = torch.zeros_like(s)
                _add_column_dots(s_x, e, x, ones)
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
                _add_column_dots(s_d, d, e, ones)
                kl[t] = s_d / s + (log_s_ref - log_s)
            if not need_any:
                del x, e, d
                continue
            alpha, beta, gamma, delta = _coefficients(
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
            # G / T = pi (alpha + beta log pi + gamma (log pi - log pi_ref)) + delta 1[v = y],
            # with pi = e / s, log pi = x - log s, log pi - log pi_ref = d - (log s - log s_ref).
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
            else:
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
                del inner
            del x, e, d, g, slope  # before the next tile: one tile (two capped) at a time
            if delta is not None:
                # The targets' part, delta 1[v = y], without a pass over the tile.
                d = delta
                if need_h:
                    grad_h[t] += w[tokens[t]] * d[:, None]
                if need_w:
                    grad_w.index_put_((tokens[t],), pol.hidden[t] * d[:, None], accumulate=True)
                if need_b:
                    grad_b.index_put_((tokens[t],), d, accumulate=True)

        if need_w and grad_w is None:  # no tokens
            grad_w = torch.zeros(vocab, hs, dtype=cd, device=device)
        logp = logp.clamp_max(0.0)
        ent = None if ent is None else ent.clamp_min(0.0)
        kl = None if kl is None else kl.clamp_min(0.0)
        loss = torch.zeros((), dtype=cd, device=device)
        for coef, value in ((a, logp), (b, ent), (c, kl)):
            if coef is not None:
                # 0 * inf = nan: a position weighted 0 adds exactly 0.
                loss = loss + torch.where(coef == 0, 0.0, coef * value).sum()
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
) -> FusedLoss:
    r"""A per-token weighted sum of log-probs, entropy and exact KL as one scalar loss, with its
    gradient computed in the forward pass (no recompute of the logits).

    ``loss = sum_i (logp_weight_i logp_i + entropy_weight_i entropy_i + kl_weight_i kl_i)`` with
    ``logp``, ``entropy`` and ``kl`` as in :func:`fused` (from ``x = transform(hidden @ weight.T +
    bias) / temperature``, and the reference's ``x_ref`` for the KL). Use it when the loss's per-token
    weights are known before the forward pass: cross-entropy and distillation (``logp_weight =
    -1 / N``), REINFORCE/GRPO on-policy with fixed advantages (``logp_weight = -A_i w_i``), an
    exact-KL penalty (``kl_weight = beta w_i``). Where the weights depend on ``logp`` itself (a
    clipped PPO ratio off-policy) or the outputs feed anything else, use :func:`fused`, whose
    backward takes any upstream gradient.

    Algorithm (the weights known, as in Liger-Kernel's fused linear losses): token chunks outside,
    each chunk's logits over the whole vocabulary as one ``[V, k]`` tile (``k`` tokens; the
    target's logit subtracted in the GEMM's epilogue, as in :func:`fused`); from the tile the
    outputs and ``G / T`` (the gradient formula of the module notes with the weights as upstream
    gradients) and at once the chunk's gradients, ``grad_hidden = (G / T).T @ weight``,
    ``grad_weight += (G / T) @ hidden``. Three GEMMs per tile for log-probs, four for the KL,
    against :func:`fused`'s four and six; the price is memory: one ``V x k`` float32 tile for
    log-probs, two with the entropy, three with the KL (``k`` from
    :func:`default_loss_token_chunk`, at most 2^25 floats, 128 MiB, per tile), a float32 copy of a
    bf16/fp16 head, and the weight gradient read and written once per chunk. With only
    ``logp_weight`` the per-token factor is taken out of the tile, which then costs one ``exp``
    and a column sum. The gradients are held (float32, cast to the inputs' dtypes) from the
    forward to the backward pass, which multiplies them by the loss's upstream gradient. Measured
    against naive PyTorch and the peers in docs/performance.md.

    Args:
        hidden, weight, tokens, bias, temperature, hidden_ref, weight_ref, bias_ref, transform,
            transform_ref: as in :func:`fused` (a soft cap holds one more ``V x k`` tile, its
            ``dx/dz``, while the gradient is formed).
        logp_weight: ``[N]`` or ``tokens``' shape, the weight of each token's ``logp`` (detached).
        entropy_weight: likewise for the entropy (turns on the entropy).
        kl_weight: likewise for the exact KL (needs the reference).
        with_entropy: return the entropy even without a weight on it.
        token_chunk: tokens per tile (default :func:`default_loss_token_chunk` of ``V``).

    Returns:
        :class:`FusedLoss` ``(loss, logp, entropy, kl)``: ``loss`` a float32 scalar (float64 for
        float64 inputs), the others detached, with the shape of ``tokens``.

    Raises:
        ValueError / TypeError: naming the argument, as :func:`fused`; no weight given; a weight
        whose shape is not ``tokens``'; ``kl_weight`` without a reference.
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
    # The same argument checks as fused, on the same arguments.
    _validate(hidden, weight, tokens, bias, hidden_ref, weight_ref, bias_ref)
    lead = hidden.shape[:-1]
    weights = []
    for name, wt in (
        ("logp_weight", logp_weight),
        ("entropy_weight", entropy_weight),
        ("kl_weight", kl_weight),
    ):
        if wt is not None:
            _check_float(name, wt)
            if wt.shape != lead:
                raise ValueError(
                    f"{name} has shape {tuple(wt.shape)} but tokens has shape {tuple(lead)}; "
                    f"give one weight per token (0 at positions to leave out)"
                )
            wt = wt.detach().reshape(-1).to(hidden.device)
        weights.append(wt)
    vocab = weight.shape[0]
    if token_chunk is None:
        token_chunk = default_loss_token_chunk(vocab)
    if not isinstance(token_chunk, int) or isinstance(token_chunk, bool) or token_chunk < 1:
        raise ValueError(f"token_chunk must be a positive int, got {token_chunk!r}")
    aff = _affine(transform, temperature, "transform")
    aff_ref = _affine(transform_ref, temperature, "transform_ref")
    grad_on = torch.is_grad_enabled()
    want = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    loss, logp, ent, kl = _FusedLoss.apply(
        flat_h,
        weight,
        bias,
        tokens.reshape(-1).to(device=hidden.device, dtype=torch.long),
        None if hidden_ref is None else hidden_ref.detach().reshape(-1, hidden_ref.shape[-1]),
        None if weight_ref is None else weight_ref.detach(),
        None if bias_ref is None else bias_ref.detach(),
        *weights,
        aff,
        aff_ref,
        bool(with_entropy or entropy_weight is not None),
        token_chunk,
        _plan(flat_h, weight, _compute_dtype(hidden, weight, bias, hidden_ref, weight_ref)),
        want,
    )
    return FusedLoss(
        loss,
        logp.view(lead),
        None if ent is None else ent.view(lead),
        None if kl is None else kl.view(lead),
    )


# --------------------------------------------------------------------------------------------
# From a model: its backbone's hidden states and its head, with the head's transform.


def model_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    reference: torch.nn.Module | None = None,
    check: bool = True,
) -> FusedOutput:
    r"""A causal LM's own log-probs of ``input_ids[:, 1:]``, through the fused head.

    The path the trainer takes: the backbone's last hidden states (:func:`klpo.heads.last_hidden`)
    and the output head with the architecture's logit transform (:func:`klpo.heads.read_head`:
    Gemma's soft cap, Cohere's and Granite's scales), tile by tile (:func:`fused`), so the ``[B,
    L, V]`` logits are never made. Per position ``t`` of ``input_ids[:, 1:]``: ``logp = log
    pi_theta(input_ids[:, t + 1] | input_ids[:, :t + 1])`` with ``pi_theta = softmax(logits /
    temperature)``, the model's own ``logits``; optionally the entropy of ``pi_theta`` there and,
    with a ``reference`` model (detached, same vocabulary), the exact KL(pi_theta ‖ pi_ref) over
    the vocabulary (Amini, Vieira & Cotterell, arXiv:2504.10637).

    Example::

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from klpo.logprobs import model_logprobs

        tok = AutoTokenizer.from_pretrained("google/gemma-2-2b-it")
        model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b-it")
        batch = tok(["The capital of France is Paris."], return_tensors="pt")
        out = model_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
        out.logp  # [1, L - 1]: log pi(token | prefix), the soft cap included

    Gradients flow to the model's parameters as through ``model(...).logits`` (the reference gets
    none). Positions where ``attention_mask`` is 0 at the token or at the position before it
    (padding, and the first token after left padding) are 0 in every output and get no gradient.

    ``check`` (default) runs :func:`klpo.heads.check_head` the first time a model object is seen:
    a few tokens through the model's own forward; a model whose logits the head cannot give is
    refused there (:class:`klpo.heads.HeadMismatch`), never answered with wrong numbers.

    Args:
        model: a ``transformers`` causal LM (or a ``peft`` wrapper of one).
        input_ids: ``[B, L]`` token ids, ``L ≥ 2``.
        attention_mask: ``[B, L]``, 1 at tokens, 0 at padding (default: all 1).
        position_ids: ``[B, L]`` passed to the backbone as to ``model(...)`` (default: the
            model's own default).
        temperature: the sampling temperature the model's logits are divided by.
        with_entropy: also return the entropy.
        reference: a reference causal LM for the exact KL (run without gradients).
        check: check each model against its own forward once (see above).

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)``, each ``[B, L - 1]`` float32 (float64 for a
        float64 model), ``entropy`` and ``kl`` None unless asked for.

    Raises:
        klpo.heads.UnsupportedHead: the model's logits are not its head's (with the fallback).
        ValueError: ``input_ids`` or ``attention_mask`` of the wrong shape or type.
    """
    from klpo import heads

    _check_model_inputs(input_ids, attention_mask, position_ids)
    read = heads.checked_head if check else heads.read_head
    head = read(model)
    hidden = heads.last_hidden(model, input_ids, attention_mask, position_ids)[:, :-1]
    ref = {}
    if reference is not None:
        ref = _reference_head(reference, read, input_ids, attention_mask, position_ids)
    out = fused(
        hidden, head.weight, input_ids[:, 1:], bias=head.bias, temperature=temperature,
        with_entropy=with_entropy, transform=head.transform, **ref,
    )  # fmt: skip
    if attention_mask is None:
        return out
    keep = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return FusedOutput(*(None if o is None else torch.where(keep, o, 0.0) for o in out))


def _reference_head(
    reference: torch.nn.Module,
    read,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> dict:
    """:func:`fused`'s reference arguments from a reference model, its forward without gradients."""
    from klpo import heads

    head = read(reference)
    with torch.no_grad():
        hidden = heads.last_hidden(reference, input_ids, attention_mask, position_ids)[:, :-1]
    return dict(
        hidden_ref=hidden, weight_ref=head.weight, bias_ref=head.bias, transform_ref=head.transform
    )


def _check_model_inputs(
    input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dtype.is_floating_point:
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids!r:.80}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be [B, L] with L ≥ 2 (a token to predict), got shape "
            f"{tuple(input_ids.shape)}"
        )
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but input_ids has shape "
                f"{tuple(input_ids.shape)}; give one entry per token"
            )
