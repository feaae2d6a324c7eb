r"""What the log-prob kernels share: the logit transform, the outputs, the checks and the arithmetic.

Private to the library: :mod:`klpo.logprobs` (from logits), :mod:`klpo.fused_kernel` (from
hidden states and the head) and :mod:`klpo.fused_loss_kernel` (a weighted loss, its gradient in
the forward pass) import it; the public names (:class:`LogitTransform`, :class:`FusedOutput`) are
read from :mod:`klpo.logprobs`. The equations are in :mod:`klpo.logprobs`' notes: the transform
``x = transform(z) / T``, and the gradient with respect to ``x``,

    G_v = a (1[v = y] - pi_v) - b pi_v (log pi_v + entropy) + c pi_v (log pi_v - log pi_ref(v) - kl)

for upstream gradients ``a``, ``b``, ``c`` of ``logp``, ``entropy`` and ``kl``
(:func:`coefficients` writes it as four per-token factors). Nothing here imports another part of
klpo.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor


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
    """What :func:`klpo.logprobs.fused` and :func:`klpo.logprobs.from_logits` return, each with the
    shape of ``tokens``, float32 (float64 inputs: float64).

    Attributes:
        logp: log pi_theta(y) of each token.
        entropy: the entropy of pi_theta at each position (None if not asked for).
        kl: KL(pi_theta ‖ pi_ref) at each position (None without a reference).
    """

    logp: Tensor
    entropy: Tensor | None
    kl: Tensor | None


SUM_BLOCK = 512
"""The vocabulary sums of the fused path add :data:`SUM_BLOCK` entries at a time, in order."""

_GROUP = 8  # blocks reduced together (bounds the scratch to 8 * SUM_BLOCK / 2 rows of a tile)


def _tree(x: Tensor, r: int) -> Tensor:
    """Reduce ``x [k, r, n]`` (scratch) over its middle dimension in place, by a pairwise tree
    fixed by ``r`` alone: row ``i`` plus row ``i + r // 2``, an odd last row carried, until one
    row is left. Returns ``x[:, 0]``. Each step is one elementwise add, whose every output is
    the correctly rounded sum of its two inputs however the kernel is vectorised, so the result
    of a column does not depend on ``n`` or on the CPU's vector width."""
    while r > 1:
        h = r // 2
        x[:, :h].add_(x[:, h : 2 * h])
        if r % 2:
            x[:, h].copy_(x[:, 2 * h])
        r = h + r % 2
    return x[:, 0]


def _block_sums(a: Tensor, b: Tensor | None) -> Iterator[Tensor]:
    """The column sums of each block of :data:`SUM_BLOCK` rows of ``a`` (of ``a * b``), block
    by block in row order, each ``[n]``, summed by :func:`_tree`."""
    rows, n = a.shape
    step = SUM_BLOCK * _GROUP
    for g0 in range(0, rows, step):
        g1 = min(g0 + step, rows)
        full = (g1 - g0) // SUM_BLOCK
        spans = [(g0, full, SUM_BLOCK)] if full else []
        if g0 + full * SUM_BLOCK < g1:
            spans.append((g0 + full * SUM_BLOCK, 1, g1 - g0 - full * SUM_BLOCK))
        for r0, k, r in spans:
            va = a[r0 : r0 + k * r].reshape(k, r, n)
            vb = None if b is None else b[r0 : r0 + k * r].reshape(k, r, n)
            if r == 1:
                yield from (va * vb)[:, 0] if vb is not None else va[:, 0]
                continue
            h, odd = r // 2, r % 2
            buf = torch.empty(k, h + odd, n, dtype=a.dtype, device=a.device)
            if vb is None:
                torch.add(va[:, :h], va[:, h : 2 * h], out=buf[:, :h])
                if odd:
                    buf[:, h].copy_(va[:, 2 * h])
            else:
                torch.mul(va[:, :h], vb[:, :h], out=buf[:, :h])
                buf[:, :h].add_(va[:, h : 2 * h] * vb[:, h : 2 * h])
                if odd:
                    torch.mul(va[:, 2 * h], vb[:, 2 * h], out=buf[:, h])
            sums = _tree(buf, h + odd)
            yield from sums


def add_column_sums(out: Tensor, t: Tensor) -> None:
    """``out += t.sum(0)`` for a tile ``t [vc, n]``: each block of :data:`SUM_BLOCK` rows summed
    by a fixed pairwise tree of elementwise adds, the blocks' sums added to ``out`` in order.

    The order of the additions is then a function of the vocabulary position alone: a token's
    sums are the same bits whatever the tile's width (a multiple of the block), the number of
    tokens in the call, whether the vocabulary comes in one tile (:func:`klpo.logprobs.fused_loss`)
    or many (:func:`klpo.logprobs.fused`), and the CPU. So a row scored alone, in a micro-batch or
    in the whole batch, and by either function, has one log-prob, and two identical models have
    an exact KL of exactly 0. (A BLAS product ``ones @ block`` does not keep this: on a CPU with
    AVX-512 MKL's kernel for a few columns sums the rows in another order than for many.)
    """
    for s in _block_sums(t, None):
        out += s


def add_column_dots(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += (a * b).sum(0)`` for tiles ``[vc, n]``, in the order of :func:`add_column_sums`
    (the products of a group of blocks in a scratch buffer, no tile-sized temporary)."""
    for s in _block_sums(a, b):
        out += s


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def inv_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (t > 0 and math.isfinite(t)):
        raise ValueError(f"temperature must be > 0 and finite, got {temperature}")
    return 1.0 / t


class Affine(NamedTuple):
    """A head's transform with the temperature folded in: ``x = cap_t tanh(lin z)`` with a soft
    cap, ``x = lin z`` without; ``slope`` is ``scale / T``, so that ``dx/dz = slope`` uncapped and
    ``slope (1 - tanh²(lin z))`` capped."""

    lin: float
    cap_t: float | None
    slope: float

    @property
    def coef(self) -> float:
        """The factor of the gradient coefficients (:func:`coefficients`): ``dx/dz`` where it is
        constant; 1 for a capped head, whose tiles are multiplied by their own slope instead."""
        return self.slope if self.cap_t is None else 1.0


def affine(transform: LogitTransform | None, temperature: float, name: str) -> Affine:
    """``transform`` (checked) and the temperature as an :class:`Affine`."""
    inv_t = inv_temperature(temperature)
    if transform is None:
        return Affine(inv_t, None, inv_t)
    if not isinstance(transform, LogitTransform):
        raise TypeError(
            f"{name} must be a klpo.logprobs.LogitTransform or None, got {type(transform).__name__}"
        )
    scale, cap = LogitTransform.make(*transform)
    if cap is None:
        return Affine(scale * inv_t, None, scale * inv_t)
    return Affine(scale / cap, cap * inv_t, scale * inv_t)


def transformed(z: Tensor, cd: torch.dtype, aff: Affine) -> Tensor:
    """``x = aff(z)`` as a fresh tensor in the compute dtype."""
    x = z.to(cd).mul(aff.lin)
    if aff.cap_t is not None:
        x.tanh_().mul_(aff.cap_t)
    return x


def slope_of(y: Tensor, aff: Affine) -> Tensor:
    """``dx/dz = slope (1 - y²)`` from ``y = tanh(lin z)``, as a new tensor (one pass)."""
    return torch.addcmul(y.new_tensor(aff.slope), y, y, value=-aff.slope)


def check_float(name: str, t: Tensor) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor, got {t.dtype}")


def check_tokens(
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


def coefficients(
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

    ``inv_t`` is ``dx/dz`` where it is constant (:attr:`Affine.coef`: ``scale / T``); a capped
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


def add_at_targets(g: Tensor, tokens: Tensor, v0: int, delta: Tensor) -> None:
    """``g[tokens[i] - v0, i] += delta[i]`` for the targets inside the tile ``g [vc, n]``."""
    rows = tokens - v0
    inside = (rows >= 0) & (rows < g.shape[0])
    if bool(inside.any()):
        cols = torch.arange(g.shape[1], device=g.device)[inside]
        g.index_put_((rows[inside], cols), delta[inside], accumulate=True)


def grad_tile(
    log_pi: Tensor,
    log_pi_ref: Tensor | None,
    alpha: Tensor,
    beta: Tensor | None,
    gamma: Tensor | None,
) -> Tensor:
    """``G / T`` of a tile without the targets' part, ``pi (alpha + beta log pi + gamma (log pi -
    log pi_ref))``, from ``log pi`` and, where the KL has a gradient, ``log pi_ref`` (both
    overwritten: the result lives in one of them). ``alpha``, ``beta``, ``gamma`` are
    :func:`coefficients`' broadcast against the tile (None: the term is absent).

    The KL's part multiplies ``log pi - log pi_ref``, formed first, so it is exactly 0 where the
    two models are one (:func:`coefficients`)."""
    if beta is None and gamma is None:
        return log_pi.exp_().mul_(alpha)
    pi = torch.exp(log_pi)
    d = None  # log pi - log pi_ref: exactly 0 where the two models are one
    if gamma is not None:
        d = torch.sub(log_pi, log_pi_ref, out=log_pi_ref)
    if beta is not None:
        inner = torch.addcmul(alpha, log_pi, beta, out=log_pi)
        if d is not None:
            inner.addcmul_(d, gamma)
    else:
        inner = torch.addcmul(alpha, d, gamma, out=d)
    return pi.mul_(inner)


def check_head_args(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    bias: Tensor | None,
    hidden_ref: Tensor | None,
    weight_ref: Tensor | None,
    bias_ref: Tensor | None,
) -> None:
    """The argument checks of :func:`klpo.logprobs.fused` and :func:`klpo.logprobs.fused_loss`."""
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, H] or [B, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = {hidden.shape[-1]} (hidden's last dimension), got "
            f"shape {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    lead = hidden.shape[:-1]
    check_tokens(tokens, lead, vocab, "hidden", hidden.shape)
    if bias is not None:
        check_float("bias", bias)
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
        check_float("hidden_ref", hidden_ref)
        check_float("weight_ref", weight_ref)
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
            check_float("bias_ref", bias_ref)
            if bias_ref.shape != (vocab,):
                raise ValueError(
                    f"bias_ref must be [V] = [{vocab}], got shape {tuple(bias_ref.shape)}"
                )


class HeadArgs(NamedTuple):
    """One model's head inputs as :func:`klpo.logprobs.fused` and :func:`klpo.logprobs.fused_loss` take them:
    the hidden states ``[..., H]``, the head ``[V, H]``, its bias ``[V]`` and its logit
    transform (the reference's: None where there is no reference)."""

    hidden: Tensor | None
    weight: Tensor | None
    bias: Tensor | None = None
    transform: LogitTransform | None = None


class HeadInputs(NamedTuple):
    """:func:`klpo.logprobs.fused`'s and :func:`klpo.logprobs.fused_loss`'s head inputs checked and laid out
    for the kernels (:func:`head_inputs`)."""

    lead: torch.Size  # hidden's shape without its last dimension: the outputs' shape
    hidden: Tensor  # [N, H]
    weight: Tensor  # [V, H]
    bias: Tensor | None  # [V]
    tokens: Tensor  # [N] int64 ids, on hidden's device
    hidden_ref: Tensor | None  # [N, H_ref] detached
    weight_ref: Tensor | None  # [V, H_ref] detached
    bias_ref: Tensor | None  # [V] detached
    aff: Affine  # the policy's transform with the temperature folded in
    aff_ref: Affine  # the reference's
    cd: torch.dtype  # the compute dtype: float64 if an input is, else float32

    @property
    def tensors(self) -> tuple[Tensor | None, ...]:
        """The kernels' first seven arguments: hidden, weight, bias, tokens and the reference's
        hidden states, weight and bias."""
        return self[1:8]


def head_inputs(tokens: Tensor, policy: HeadArgs, ref: HeadArgs, temperature: float) -> HeadInputs:
    """The head inputs of :func:`klpo.logprobs.fused` and :func:`klpo.logprobs.fused_loss`,
    checked (:func:`check_head_args`, the transforms and temperature by :func:`affine`) and laid
    out for their kernels: hidden states flattened to ``[N, H]``, tokens to ``[N]`` int64 ids on
    their device, the reference detached. Nothing is computed from the values."""
    hidden, weight, bias, transform = policy
    hidden_ref, weight_ref, bias_ref, transform_ref = ref
    check_head_args(hidden, weight, tokens, bias, hidden_ref, weight_ref, bias_ref)
    aff = affine(transform, temperature, "transform")
    aff_ref = affine(transform_ref, temperature, "transform_ref")
    return HeadInputs(
        hidden.shape[:-1],
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        tokens.reshape(-1).to(device=hidden.device, dtype=torch.long),
        None if hidden_ref is None else hidden_ref.detach().reshape(-1, hidden_ref.shape[-1]),
        None if weight_ref is None else weight_ref.detach(),
        None if bias_ref is None else bias_ref.detach(),
        aff,
        aff_ref,
        compute_dtype(hidden, weight, bias, hidden_ref, weight_ref),
    )
