r"""Log-probs, entropy and the exact KL from hidden states over a head sharded by vocabulary.

Under tensor parallelism (Megatron's column-parallel output layer, NeMo-RL's head shards) each
of ``W`` ranks holds the rows ``[start, start + V_r)`` of the output head ``weight [V, H]`` (and of
its bias) and the same hidden states ``[N, H]``; the logits exist only as ``[N, V_r]`` slices.
:func:`vocab_parallel` computes what :func:`klpo.logprobs.fused` computes on one device, from the
slices, with two reductions over the group per chunk of tokens, and nothing ``[N, V]`` anywhere:

    m   = max_r max_v x_v                                  (one all-reduce MAX, with m_ref)
    s   = sum_r sum_v e^{x_v - m},   L = m + log s        (one all-reduce SUM of five sums:)
    logp    = x_y - L                                      x_y from the rank that holds y
    entropy = L - sum_v e^{x_v - m} x_v / s
    kl      = sum_v e^{x_v - m} (x_v - x_ref,v) / s - L + L_ref     = KL(pi_theta ‖ pi_ref)

with ``x = (hidden @ weight.T + bias) / T``, and ``x_ref``, ``L_ref`` the reference's (its own
hidden states and head shard, or the teacher's: KL(pi_theta ‖ pi_T)). The backward pass recomputes
each slice and applies :mod:`klpo.logprobs`' gradient formula,

    G_v = a (1[v = y] - pi_v) - b pi_v (log pi_v + entropy) + c pi_v (log pi_v - log pi_ref,v - kl),

on the rank's own vocabulary: the weight's and bias's gradients are the rank's (``(G / T).T @
hidden``, ``sum G / T``), the hidden states' is summed over the group (one all-reduce SUM: each rank
holds the part of ``(G / T) @ weight`` from its rows). Values and gradients equal the single-device
result up to the order of the sums (tested with 2 and 4 gloo processes in float64 to 1e-12).

The reference is detached. Every rank must call with the same tokens, hidden states and chunking
(the collectives pair by call order). Without a process group (or a group of one) it is the
single-device computation. Example, with Megatron-style shards (each rank's ``weight_shard`` the
rows ``[rank * V_r, (rank + 1) * V_r)`` of the head)::

    out = vocab_parallel(hidden, weight_shard, tokens, vocab_start=rank * v_r,
                         hidden_ref=hidden_ref, weight_ref=ref_shard, group=tp_group)
    loss = -(adv * out.logp).sum() + beta * out.kl.sum()
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
from torch import Tensor

from klpo._logits import FusedOutput
from klpo.logprobs import ROW_ELEMENTS

__all__ = ["all_reduce", "slice_logits", "vocab_parallel", "world_size"]


def world_size(group) -> int:
    """The size of ``group``, 1 where no process group is initialised."""
    if not torch_dist.is_available() or not torch_dist.is_initialized():
        return 1
    return torch_dist.get_world_size(group)


def all_reduce(x: Tensor, op, group) -> Tensor:
    """``x`` reduced in place over ``group`` with ``op`` (nothing to do in a world of one)."""
    if world_size(group) > 1:
        torch_dist.all_reduce(x, op=op, group=group)
    return x


def slice_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """``(hidden @ weight.T + bias) / temperature``: the scaled logits of a shard's rows."""
    x = hidden @ weight.T
    if bias is not None:
        x = x + bias
    return x / temperature


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, hidden_ref, weight_ref, bias_ref, opts):
        start, temperature, group, rows = opts
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n, v_r = hidden.shape[0], weight.shape[0]
        with_ref = hidden_ref is not None
        logp = torch.empty(n, dtype=dtype)
        ent, kl = torch.empty_like(logp), torch.zeros_like(logp)
        stats = torch.empty(n, 3, dtype=dtype)  # L, entropy, L_ref (for the backward pass)
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        for s in range(0, n, rows):
            h = hidden[s : s + rows].to(dtype)
            x = slice_logits(h, w, b, temperature)
            local_y = tokens[s : s + rows] - start
            mine = (local_y >= 0) & (local_y < v_r)
            x_y = torch.where(mine, x.gather(-1, local_y.clamp(0, v_r - 1)[:, None])[:, 0], 0.0)
            maxes = [x.max(-1).values]
            if with_ref:
                xr = slice_logits(
                    hidden_ref[s : s + rows].to(dtype),
                    weight_ref.to(dtype),
                    None if bias_ref is None else bias_ref.to(dtype),
                    temperature,
                )
                maxes.append(xr.max(-1).values)
            m = all_reduce(torch.stack(maxes, -1), torch_dist.ReduceOp.MAX, group)
            e = torch.exp(x - m[:, :1])
            sums = [e.sum(-1), (e * x).sum(-1), x_y]
            if with_ref:
                sums += [torch.exp(xr - m[:, 1:]).sum(-1), (e * (x - xr)).sum(-1)]
            tot = all_reduce(torch.stack(sums, -1), torch_dist.ReduceOp.SUM, group)
            big_l = m[:, 0] + tot[:, 0].log()
            logp[s : s + rows] = tot[:, 2] - big_l
            ent[s : s + rows] = big_l - tot[:, 1] / tot[:, 0]
            stats[s : s + rows, 0], stats[s : s + rows, 1] = big_l, ent[s : s + rows]
            if with_ref:
                l_ref = m[:, 1] + tot[:, 3].log()
                kl[s : s + rows] = tot[:, 4] / tot[:, 0] - big_l + l_ref
                stats[s : s + rows, 2] = l_ref
        ctx.save_for_backward(
            hidden, weight, bias, tokens, hidden_ref, weight_ref, bias_ref, stats, kl
        )
        ctx.opts = opts
        return logp.clamp_max(0.0), ent.clamp_min(0.0), kl.clamp_min(0.0)

    @staticmethod
    def backward(ctx, g_logp, g_ent, g_kl):
        hidden, weight, bias, tokens, hidden_ref, weight_ref, bias_ref, stats, kl = (
            ctx.saved_tensors
        )
        start, temperature, group, rows = ctx.opts
        dtype = stats.dtype
        n, v_r = hidden.shape[0], weight.shape[0]
        w, b = weight.to(dtype), None if bias is None else bias.to(dtype)
        grad_h = torch.zeros(n, hidden.shape[1], dtype=dtype)
        grad_w = torch.zeros_like(w)
        grad_b = None if bias is None else torch.zeros_like(b)
        zero = torch.zeros(n, dtype=dtype)
        a = zero if g_logp is None else g_logp.to(dtype)
        bb = zero if g_ent is None else g_ent.to(dtype)
        c = zero if g_kl is None or hidden_ref is None else g_kl.to(dtype)
        for s in range(0, n, rows):
            sl = slice(s, s + rows)
            h = hidden[sl].to(dtype)
            log_pi = slice_logits(h, w, b, temperature) - stats[sl, :1]
            pi = log_pi.exp()
            g = -a[sl, None] * pi - bb[sl, None] * pi * (log_pi + stats[sl, 1:2])
            if hidden_ref is not None:
                xr = slice_logits(
                    hidden_ref[sl].to(dtype),
                    weight_ref.to(dtype),
                    None if bias_ref is None else bias_ref.to(dtype),
                    temperature,
                )
                log_ref = xr - stats[sl, 2:3]
                g = g + c[sl, None] * pi * (log_pi - log_ref - kl[sl, None])
            local_y = tokens[sl] - start
            mine = (local_y >= 0) & (local_y < v_r)
            rows_mine = mine.nonzero().flatten()
            g[rows_mine, local_y[rows_mine]] += a[sl][rows_mine]
            g = g / temperature
            grad_h[sl] = g @ w
            grad_w += g.T @ h
            if grad_b is not None:
                grad_b += g.sum(0)
        grad_h = all_reduce(grad_h, torch_dist.ReduceOp.SUM, group)
        return (
            grad_h.to(hidden.dtype),
            grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None, None, None, None,
        )  # fmt: skip


def vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    vocab_start: int = 0,
    bias: Tensor | None = None,
    hidden_ref: Tensor | None = None,
    weight_ref: Tensor | None = None,
    bias_ref: Tensor | None = None,
    temperature: float = 1.0,
    group=None,
    row_chunk: int | None = None,
) -> FusedOutput:
    """``logp``, ``entropy`` and ``kl`` (``[N]`` each) from hidden states over a vocabulary shard.

    Args:
        hidden: ``[N, H]`` the policy's last hidden states (the same on every rank of ``group``).
        weight: ``[V_r, H]`` this rank's rows of the policy's output head; ``bias``: ``[V_r]``.
        tokens: ``[N]`` the sampled tokens, global vocabulary ids (the same on every rank).
        vocab_start: the global id of this rank's first row.
        hidden_ref, weight_ref, bias_ref: the reference's (or teacher's) hidden states and head
            shard over the same rows, for ``kl``; without them ``kl`` is 0.
        temperature: the sampling temperature both models' logits are divided by.
        group: the process group that shards the vocabulary (None: the default group, or one
            process where none is initialised).
        row_chunk: tokens per chunk (default ``ROW_ELEMENTS // V_r``).

    Returns:
        :class:`klpo.logprobs.FusedOutput` with ``[N]`` float32 (float64 for float64 inputs)
        ``logp``, ``entropy``, ``kl`` (None without a reference), each on every rank.

    Example (one process: the whole vocabulary is one shard):
        >>> import torch
        >>> from klpo.logprobs import from_logits
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w = torch.randn(3, 4, generator=g), torch.randn(5, 4, generator=g)
        >>> y = torch.tensor([0, 4, 2])
        >>> out = vocab_parallel(h, w, y)
        >>> torch.allclose(out.logp, from_logits(h @ w.T, y).logp, atol=1e-6)
        True
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"vocab_parallel: hidden [N, H] and weight [V_r, H] must share H, got "
            f"{tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if tokens.shape != hidden.shape[:1]:
        raise ValueError(f"tokens must be [N] = [{hidden.shape[0]}], got {tuple(tokens.shape)}")
    if (hidden_ref is None) != (weight_ref is None):
        raise ValueError("give hidden_ref and weight_ref together (the reference's), or neither")
    if weight_ref is not None and weight_ref.shape[0] != weight.shape[0]:
        raise ValueError(
            f"weight_ref must hold the same vocabulary rows as weight: {weight_ref.shape[0]} "
            f"against {weight.shape[0]}"
        )
    rows = row_chunk or max(1, ROW_ELEMENTS // max(weight.shape[0], 1))
    logp, ent, kl = _VocabParallel.apply(
        hidden, weight, bias, tokens.long(), hidden_ref, weight_ref, bias_ref,
        (int(vocab_start), float(temperature), group, int(rows)),
    )  # fmt: skip
    return FusedOutput(logp, ent, kl if hidden_ref is not None else None)
