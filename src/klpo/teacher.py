r"""Divergences from the policy to a teacher over the vocabulary: on-policy distillation's terms.

In on-policy distillation (OPD; Agarwal et al. 2024, GKD, arXiv:2306.13649) the policy
``pi_theta`` (the student) samples, a teacher ``pi_T`` scores every position of the student's
completions, and the student descends a divergence to the teacher. The sampled-token forms are
:mod:`klpo.estimators`' own, with ``logp_ref`` the teacher's log-probs (k1 in the reward is the
Tinker / Thinking Machines form, k3 in the loss verl's); this module holds the forms that read
the whole next-token distribution of both models at a position. With ``q = softmax(z / T)`` the
student's and ``p = softmax(z_T / T)`` the teacher's:

| function | value at a position | what it is |
| --- | --- | --- |
| :func:`klpo.logprobs.exact_kl` | ``sum_v q (log q - log p)`` | KL(pi_theta ‖ pi_T), exact (reverse) |
| :func:`forward_kl` | ``sum_v p (log p - log q)`` | KL(pi_T ‖ pi_theta), exact (forward) |
| :func:`jsd` | ``beta KL(p ‖ m) + (1 - beta) KL(q ‖ m)``, ``m = (1 - beta) q + beta p`` | TRL's generalised JSD: ``beta = 0`` forward, ``1`` reverse |
| :func:`topk_forward_kl` | ``sum_{i in K_T} p_i (log p_i - log q_i)`` | verl's ``forward_kl_topk``: no KL (the masses are truncated; it goes negative) |
| :func:`topk_tail_kl` | the above ``+ p_tail log(p_tail / q_tail)`` | the KL of the ``K + 1`` buckets (verl#7855): a lower bound of the forward KL |
| :func:`student_topk_kl` | ``sum_{i in K_theta} q_i (log q_i - log p_i)`` | reverse KL on the student's top-k: truncated too |

``K_T`` are the teacher's ``k`` likeliest tokens at the position (:func:`teacher_topk`), ``K_theta``
the student's; ``p_tail = 1 - sum_{K_T} p``, ``q_tail = 1 - sum_{K_T} q``.

Gradients (with respect to the student's logits ``z``; the teacher is detached): the exact
divergences follow their own gradient at the position, ``(q - p) / T`` for the forward KL and
``(1 - beta) q (log q - log m - KL(q ‖ m)) / T`` for the JSD. The truncated forms follow the
gradient of the truncated sum, which is not a divergence's: ``klpo explain --teacher`` derives,
by enumeration, which direction each follows and what the truncation and the clamps cost. verl's
compatibility switches: ``log_prob_floor`` (its ``log_prob_min_clamp``: log-probs below the
floor are raised to it, so their tokens carry no gradient) and ``clamp_zero`` (its
``clamp_min(0.0)`` of the per-position value, which zeroes the whole position's gradient where
the truncated sum is negative: in 415 of 467 steps of a user's run, verl#7856).

Shapes: logits ``[..., V]`` (any float dtype; the arithmetic is float32, float64 for float64
inputs); top-k inputs ``[..., k]``; every result ``[...]``. Rows are processed in chunks of about
4M logits (:data:`klpo.logprobs.ROW_ELEMENTS`), each chunk's graph recomputed in the backward
pass, so no ``[N, V]`` float32 intermediate outlives its chunk. Masking is the caller's (with
``torch.where``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as torch_dist
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from klpo._tensor import check_float, check_same_shape
from klpo.logprobs import ROW_ELEMENTS, exact_kl
from klpo.vocab_parallel import all_reduce, slice_logits

__all__ = [
    "DIVERGENCES",
    "LOSS_ROW_ELEMENTS",
    "FromHiddenLoss",
    "forward_kl",
    "from_hidden",
    "from_hidden_loss",
    "jsd",
    "reverse_kl",
    "student_topk_kl",
    "teacher_topk",
    "topk_forward_kl",
    "topk_tail_kl",
]


def _check_pair(logits: Tensor, logits_teacher: Tensor) -> None:
    check_float("logits", logits)
    check_float("logits_teacher", logits_teacher)
    check_same_shape(
        "logits_teacher", logits_teacher, hint="[..., V]: the same positions and vocabulary",
        logits=logits,
    )  # fmt: skip


def _by_rows(fn: Callable[..., Tensor], *inputs: Tensor, width: int | None = None) -> Tensor:
    """``fn`` over the rows of ``inputs`` (each ``[..., X]``), a chunk at a time, each chunk's
    graph recomputed in the backward pass (activation checkpointing): ``[...]``. A chunk holds
    ``ROW_ELEMENTS // width`` rows (``width``: the vocabulary a row's logits span; default the
    first input's last dimension)."""
    lead = inputs[0].shape[:-1]
    flat = [x.reshape(-1, x.shape[-1]) for x in inputs]
    n = flat[0].shape[0]
    rows = max(1, ROW_ELEMENTS // max(width or inputs[0].shape[-1], 1))
    if n <= rows:
        return fn(*flat).reshape(lead)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in flat)
    parts = []
    for s in range(0, n, rows):
        chunk = [x[s : s + rows] for x in flat]
        parts.append(checkpoint(fn, *chunk, use_reentrant=False) if grad else fn(*chunk))
    return torch.cat(parts).reshape(lead)


def _nonneg(x: Tensor) -> Tensor:
    """Rounding below zero clamped away in the value only; the gradient passes untouched."""
    return x + (x.clamp_min(0.0) - x).detach()


def _log_softmax(z: Tensor, temperature: float) -> Tensor:
    return torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)) / temperature, -1)


def reverse_kl(logits: Tensor, logits_teacher: Tensor, *, temperature: float = 1.0) -> Tensor:
    """KL(pi_theta ‖ pi_T) at each position, exact: :func:`klpo.logprobs.exact_kl` with the
    teacher in the reference's place (its gradient ``q (log q - log p - kl) / T``).

    Example:
        >>> import torch
        >>> z, zt = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # q = (½, ½), p = (¾, ¼)
        >>> round(float(reverse_kl(z, zt)), 4)  # ½ log(½/¾) + ½ log(½/¼) = 0.1438
        0.1438
    """
    _check_pair(logits, logits_teacher)
    return exact_kl(logits, logits_teacher.detach(), temperature=temperature)


def forward_kl(logits: Tensor, logits_teacher: Tensor, *, temperature: float = 1.0) -> Tensor:
    r"""KL(pi_T ‖ pi_theta) at each position, exact: ``sum_v p (log p - log q)``.

    The forward direction (mass-covering: the student is pushed to cover every token the teacher
    gives mass to), what TRL's generalised JSD computes at ``beta = 0``. Gradient with respect
    to ``logits``: ``(q - p) / T``, zero where the student already matches the teacher.

    Example:
        >>> import torch
        >>> z, zt = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])  # q = (½, ½), p = (¾, ¼)
        >>> round(float(forward_kl(z, zt)), 4)  # ¾ log(¾/½) + ¼ log(¼/½) = 0.1308
        0.1308
    """
    _check_pair(logits, logits_teacher)

    def rows(z: Tensor, zt: Tensor) -> Tensor:
        log_q, log_p = _log_softmax(z, temperature), _log_softmax(zt.detach(), temperature)
        p = log_p.exp()
        terms = torch.where(p > 0, p * (log_p - log_q), 0.0)  # 0 log 0 = 0
        return _nonneg(terms.sum(-1))

    return _by_rows(rows, logits, logits_teacher)


def jsd(
    logits: Tensor, logits_teacher: Tensor, beta: float = 0.5, *, temperature: float = 1.0
) -> Tensor:
    r"""TRL's generalised Jensen-Shannon divergence at each position.

    ``JSD_beta = beta KL(p ‖ m) + (1 - beta) KL(q ‖ m)`` with the mixture
    ``m = (1 - beta) q + beta p`` (TRL 1.16's ``DistillationTrainer``, ``beta``; GKD,
    arXiv:2306.13649): ``beta = 0`` is the forward KL(pi_T ‖ pi_theta), ``beta = 1`` the reverse
    KL(pi_theta ‖ pi_T) (TRL's default), each computed exactly as such; in between it is bounded
    by ``-beta log beta - (1 - beta) log(1 - beta)``. Gradient with respect to ``logits``:
    ``(1 - beta) q (log q - log m - KL(q ‖ m)) / T`` (zero at ``beta = 1``'s other end only
    through the KL's own formula).

    Example:
        >>> import torch
        >>> z, zt = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
        >>> [round(float(jsd(z, zt, b)), 4) for b in (0.0, 0.5, 1.0)]  # forward, JS, reverse
        [0.1308, 0.0338, 0.1438]
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd: beta must be in [0, 1] (0 forward KL, 1 reverse), got {beta!r}")
    if beta == 0.0:
        return forward_kl(logits, logits_teacher, temperature=temperature)
    if beta == 1.0:
        return reverse_kl(logits, logits_teacher, temperature=temperature)
    _check_pair(logits, logits_teacher)

    def rows(z: Tensor, zt: Tensor) -> Tensor:
        log_q, log_p = _log_softmax(z, temperature), _log_softmax(zt.detach(), temperature)
        log_m = torch.logaddexp(log_q + math.log(1 - beta), log_p + math.log(beta))
        q, p = log_q.exp(), log_p.exp()
        kl_p = torch.where(p > 0, p * (log_p - log_m), 0.0).sum(-1)
        kl_q = torch.where(q > 0, q * (log_q - log_m), 0.0).sum(-1)
        return _nonneg(beta * kl_p + (1 - beta) * kl_q)

    return _by_rows(rows, logits, logits_teacher)


def teacher_topk(
    logits_teacher: Tensor, k: int, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The teacher's ``k`` likeliest tokens at each position: ``(logp [..., k], ids [..., k])``,
    log-probs of the whole softmax (not renormalised), as an inference server's top-k log-probs
    are (vLLM's ``prompt_logprobs=k``). Detached.

    Example:
        >>> import torch
        >>> logp, ids = teacher_topk(torch.tensor([[0.0, 2.0, 1.0]]), 2)
        >>> ids.tolist(), [round(x, 4) for x in logp.exp()[0].tolist()]
        ([[1, 2]], [0.6652, 0.2447])
    """
    if not isinstance(k, int) or k < 1 or k > logits_teacher.shape[-1]:
        raise ValueError(
            f"top-k: k must be an integer in [1, V = {logits_teacher.shape[-1]}], got {k!r}"
        )
    with torch.no_grad():
        log_p = _log_softmax(logits_teacher.detach(), temperature)
        top = log_p.topk(k, dim=-1)
    return top.values, top.indices


def _topk_inputs(logits: Tensor, topk_logp: Tensor, topk_ids: Tensor) -> None:
    check_float("logits", logits)
    check_float("teacher_topk_logp", topk_logp)
    if topk_ids.dtype not in (torch.int64, torch.int32) or topk_ids.shape != topk_logp.shape:
        raise ValueError(
            "teacher_topk_ids must be an integer tensor of teacher_topk_logp's shape [..., k], "
            f"got {topk_ids.dtype} {tuple(topk_ids.shape)} against {tuple(topk_logp.shape)}"
        )
    if topk_logp.shape[:-1] != logits.shape[:-1]:
        raise ValueError(
            f"teacher_topk_logp {tuple(topk_logp.shape)} must have the positions of logits "
            f"{tuple(logits.shape)}: [..., k] against [..., V]"
        )


def topk_forward_kl(
    logits: Tensor,
    teacher_topk_logp: Tensor,
    teacher_topk_ids: Tensor,
    *,
    temperature: float = 1.0,
    log_prob_floor: float | None = None,
    clamp_zero: bool = False,
) -> Tensor:
    r"""verl's ``forward_kl_topk``: the forward KL's terms on the teacher's top-k tokens only.

    ``sum_{i in K_T} p_i (log p_i - log q_i)`` with ``p_i`` the teacher's (whole-softmax)
    probabilities of its ``k`` likeliest tokens and ``log q_i`` the student's log-softmax there
    (verl 0.9's ``compute_forward_kl_topk``). The masses ``P = sum p_i`` and ``Q = sum q_i`` are
    below 1, so this is no KL: it is negative wherever the student puts more mass than the
    teacher on the teacher's top k (``Q > P``, for instance a student sharper than its teacher).
    Its gradient with respect to ``logits`` is ``(P q - p 1[v in K_T]) / T``: it raises the
    student's mass on ``K_T`` towards ``P`` whatever the tail does.

    Args:
        logits: ``[..., V]`` the student's logits.
        teacher_topk_logp, teacher_topk_ids: ``[..., k]`` from :func:`teacher_topk` (or an
            inference server's top-k log-probs).
        log_prob_floor: verl's ``log_prob_min_clamp``: both sides' log-probs raised to at least
            this (a raised student log-prob carries no gradient); None: no floor.
        clamp_zero: verl's ``clamp_min(0.0)`` of the value; where it binds the position's
            gradient is exactly zero.

    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])  # a student sharper than its teacher on token 0
        >>> logp, ids = teacher_topk(torch.tensor([[1.0, 0.0, 0.0]]), 1)
        >>> # p0 = e / (e + 2) = 0.5761, q0 = e² / (e² + 2) = 0.7870: 0.5761 log(0.5761 / 0.7870) < 0
        >>> round(float(topk_forward_kl(z, logp, ids)), 4)
        -0.1797
        >>> float(topk_forward_kl(z, logp, ids, clamp_zero=True))  # verl's clamp: 0, no gradient
        0.0
    """
    _topk_inputs(logits, teacher_topk_logp, teacher_topk_ids)

    def rows(z: Tensor, lp: Tensor, ids: Tensor) -> Tensor:
        log_q = _log_softmax(z, temperature).gather(-1, ids.long())
        lp = lp.detach().to(log_q.dtype)
        if log_prob_floor is not None:
            log_q, lp = log_q.clamp_min(log_prob_floor), lp.clamp_min(log_prob_floor)
        value = (lp.exp() * (lp - log_q)).sum(-1)
        return value.clamp_min(0.0) if clamp_zero else value

    return _by_rows(rows, logits, teacher_topk_logp, teacher_topk_ids)


SHARP = 1e-4
""":func:`topk_tail_kl` takes the student's tail mass from its logits outside the top k where
its top-k mass is within this of 1 (there ``log1p(-Q)`` loses float32's precision), else as
``log1p(-Q)``, the teacher's form."""


def topk_tail_kl(
    logits: Tensor, teacher_topk_logp: Tensor, teacher_topk_ids: Tensor, *, temperature: float = 1.0
) -> Tensor:
    r"""The forward KL of the ``k + 1`` buckets: the teacher's top-k tokens and one tail (verl#7855).

    ``sum_{i in K_T} p_i log(p_i / q_i) + p_tail log(p_tail / q_tail)``, ``p_tail = 1 - P``,
    ``q_tail = 1 - Q``: the exact KL between the two distributions coarse-grained to ``k + 1``
    categories, so never negative, and a lower bound of the forward KL(pi_T ‖ pi_theta) (the data
    processing inequality; equal when the student matches the teacher's shape inside the tail).
    It needs only the teacher's top-k payload. Gradient: that of the truncated sum plus the
    tail's, ``(p_tail / q_tail) (q 1[v in K_T] - Q q) / T``.

    Example:
        >>> import torch
        >>> z = torch.tensor([[2.0, 0.0, 0.0]])
        >>> logp, ids = teacher_topk(torch.tensor([[1.0, 0.0, 0.0]]), 1)
        >>> round(float(topk_tail_kl(z, logp, ids)), 4)  # -0.1797 + 0.4239 log(0.4239 / 0.2130)
        0.112
    """
    _topk_inputs(logits, teacher_topk_logp, teacher_topk_ids)

    def rows(z: Tensor, lp: Tensor, ids: Tensor) -> Tensor:
        log_all = _log_softmax(z, temperature)
        log_q = log_all.gather(-1, ids.long())
        lp = lp.detach().to(log_q.dtype)
        head = (lp.exp() * (lp - log_q)).sum(-1)
        if ids.shape[-1] == z.shape[-1]:  # the top k is the whole vocabulary: no tail
            return _nonneg(head)
        # The teacher's tail from its top-k log-masses (all it sends): log(1 - P). The student's
        # the same way, so that a student equal to the teacher gives exactly 0; but where its
        # top-k mass is within SHARP of 1, from its own logits outside the top k, log(1 - Q) =
        # logsumexp_{v not in K} log q_v: 1 - Q rounds to 0 in float32 once Q > 1 - 6e-8, where
        # log1p(-Q) is -inf and its gradient NaN. (The unused branch is fed a safe value, so
        # no NaN flows back through torch.where.)
        log_p_tail = torch.log1p(-torch.logsumexp(lp, -1).exp().clamp(max=1.0))
        log_mass = torch.logsumexp(log_q, -1)
        sharp = log_mass > math.log1p(-SHARP)
        by_mass = torch.log1p(-torch.where(sharp, -1.0, log_mass).exp())
        by_rest = torch.logsumexp(log_all.scatter(-1, ids.long(), float("-inf")), -1)
        log_q_tail = torch.where(sharp, by_rest, by_mass)
        p_tail = log_p_tail.exp()
        tail = torch.where(p_tail > 0, p_tail * (log_p_tail - log_q_tail), 0.0)
        return _nonneg(head + tail)

    return _by_rows(rows, logits, teacher_topk_logp, teacher_topk_ids)


def student_topk_kl(
    logits: Tensor,
    logits_teacher: Tensor,
    k: int,
    *,
    temperature: float = 1.0,
    clamp_zero: bool = False,
) -> Tensor:
    r"""The reverse KL's terms on the student's own top-k tokens (verl PRs #6920, #7425).

    ``sum_{i in K_theta} q_i (log q_i - log p_i)``, the student's ``k`` likeliest tokens chosen
    at each position (the choice carries no gradient). Truncated, so no KL: negative where the
    teacher puts more mass than the student on the student's top k, and its gradient lets the
    student lower the very mass the sum is taken over, the support bias for which verl dropped
    its top-k reverse KL (PR #5041). ``clamp_zero``: verl's ``clamp_min(0.0)`` (PR #7806's review).

    Example:
        >>> import torch
        >>> z, zt = torch.tensor([[math.log(0.6), math.log(0.4)]]), torch.tensor([[math.log(0.9), math.log(0.1)]])
        >>> round(float(student_topk_kl(z, zt, 1)), 6)  # 0.6 log(0.6 / 0.9), where the full KL is 0.311
        -0.243279
    """
    _check_pair(logits, logits_teacher)
    if not isinstance(k, int) or k < 1 or k > logits.shape[-1]:
        raise ValueError(f"top-k: k must be an integer in [1, V = {logits.shape[-1]}], got {k!r}")

    def rows(z: Tensor, zt: Tensor) -> Tensor:
        log_q_all = _log_softmax(z, temperature)
        ids = log_q_all.detach().topk(k, dim=-1).indices
        log_q = log_q_all.gather(-1, ids)
        log_p = _log_softmax(zt.detach(), temperature).gather(-1, ids)
        value = (log_q.exp() * (log_q - log_p)).sum(-1)
        return value.clamp_min(0.0) if clamp_zero else value

    return _by_rows(rows, logits, logits_teacher)


# --------------------------------------------------------------------------------------------
# From hidden states: the exact divergences through a fused head.

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
    ``"jsd"`` (TRL's generalised JSD at ``beta``), as :func:`reverse_kl`, :func:`forward_kl`
    and :func:`jsd` from logits, but the logits ``hidden @ weight.T + bias`` of each model exist
    only as one ``[row_chunk, V_r]`` tile (recomputed in the backward pass). The two models may
    differ in width (``hidden [N, H]``, ``hidden_teacher [N, H_T]``) but share the vocabulary.
    With ``group`` the heads are sharded by vocabulary as :func:`klpo.vocab_parallel.vocab_parallel`
    says (``weight`` and ``weight_teacher`` holding the same rows of the vocabulary).
    Gradients flow to the student's ``hidden``, ``weight`` and ``bias``; the teacher's are
    detached. Returns ``[N]`` float32 (float64 for float64 inputs).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w, ht, wt = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (3, 5), (6, 5)))
        >>> got = from_hidden(h, w, ht, wt, divergence="forward")
        >>> torch.allclose(got, forward_kl(h @ w.T, ht @ wt.T), atol=1e-12)
        True
    """
    divergence, rows = _checked(
        "from_hidden", hidden, weight, hidden_teacher, weight_teacher, divergence, beta, row_chunk
    )
    opts = (divergence, float(beta), float(temperature), group, rows)
    return _FromHidden.apply(
        hidden, weight, bias, hidden_teacher.detach(), weight_teacher.detach(),
        None if bias_teacher is None else bias_teacher.detach(), opts,
    )  # fmt: skip


def _checked(
    fn: str,
    hidden: Tensor,
    weight: Tensor,
    hidden_teacher: Tensor,
    weight_teacher: Tensor,
    divergence: str,
    beta: float,
    row_chunk: int | None,
    row_elements: int = ROW_ELEMENTS,
) -> tuple[str, int]:
    """The divergence (a JSD at ``beta`` 0 or 1 as the KL it is) and the rows a tile holds
    (``row_chunk``, default ``row_elements // V_r``), the shapes checked."""
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
    def forward(ctx, hidden, weight, bias, hidden_t, weight_t, bias_t, weights, opts, want):
        kind, beta, temperature, group, rows = opts
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
            return (None,) * 9
        scaled = [
            None if g is None else (g if bool(grad_loss == 1) else g * grad_loss.to(g.dtype))
            for g in ctx.saved_tensors
        ]
        return (*scaled, *(None,) * 6)


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

    Algorithm: a tile of ``k`` rows at a time, both models' logits over the (rank's) vocabulary,
    ``x = (hidden @ weight.T + bias) / T`` and ``x_T``; their normalisers ``L = logsumexp x`` (with
    ``group``, the two all-reduces of :func:`from_hidden`, a MAX and a SUM, on the tile's rows); the
    value ``D`` (one more SUM); the gradient tile ``G = dD/dx`` (:func:`reverse_kl`'s,
    :func:`forward_kl`'s or :func:`jsd`'s formula) and at once ``grad_hidden[rows] = (G @
    weight) weights / T`` and ``grad_weight += G.T @ (hidden weights / T)`` (``grad_bias``
    alike): two logit GEMMs and two gradient GEMMs a tile (one when the head is frozen, a LoRA
    student's: ``weight.requires_grad`` false), where :func:`from_hidden` spends six (two, two
    recomputed in the backward pass, two). Every collective happens inside the tile's own rows,
    so a vocabulary-parallel head needs no second pass: each rank forms ``G`` on its rows of the
    vocabulary, its head's gradient is its own, and ``grad_hidden`` is summed over the group
    once at the end. Memory: two ``[k, V_r]`` tiles (three at the normalisers and for the
    forward KL, four for the JSD), ``k`` = ``row_chunk`` (default :data:`LOSS_ROW_ELEMENTS`
    ``// V_r``); the gradients (float32, cast to the inputs' dtypes) are held from the forward
    to the backward pass, which multiplies them by the loss's upstream gradient. Measured in
    docs/performance.md (``bench/teacher_kl.py``).

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
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w, ht, wt = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (3, 5), (6, 5)))
        >>> c = torch.tensor([0.5, 0.0, 0.25], dtype=torch.float64)
        >>> out = from_hidden_loss(h, w, ht, wt, c, divergence="forward")
        >>> torch.allclose(out.loss, (c * forward_kl(h @ w.T, ht @ wt.T)).sum(), atol=1e-12)
        True
    """
    divergence, rows = _checked(
        "from_hidden_loss", hidden, weight, hidden_teacher, weight_teacher, divergence, beta,
        row_chunk, LOSS_ROW_ELEMENTS,
    )  # fmt: skip
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
    opts = (divergence, float(beta), float(temperature), group, rows)
    loss, value = _FromHiddenLoss.apply(
        hidden, weight, bias, hidden_teacher.detach(), weight_teacher.detach(),
        None if bias_teacher is None else bias_teacher.detach(),
        weights.detach().to(hidden.device), opts, want,
    )  # fmt: skip
    return FromHiddenLoss(loss, value)


def by_chunks_of_logits(
    fn: Callable[[Tensor, Tensor], Tensor],
    hidden: Tensor,
    weight: Tensor,
    hidden_teacher: Tensor,
    weight_teacher: Tensor,
    *,
    bias: Tensor | None = None,
    bias_teacher: Tensor | None = None,
) -> Tensor:
    """``fn(logits, logits_teacher)`` (a function of ``[n, V]`` logits, e.g. :func:`topk_forward_kl`
    with the teacher's top-k) over ``[N, H]`` and ``[N, H_T]`` hidden states, a chunk of rows at a
    time: each chunk's logits exist only inside it and are recomputed in the backward pass, so
    no ``[N, V]`` tensor is held. Gradients reach ``hidden``, ``weight`` and ``bias``; the
    teacher's are detached. Returns ``[N]``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> h, w, ht, wt = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 4), (6, 4), (3, 5), (6, 5)))
        >>> got = by_chunks_of_logits(forward_kl, h, w, ht, wt)
        >>> torch.allclose(got, forward_kl(h @ w.T, ht @ wt.T), atol=1e-12)
        True
    """
    ht, wt = hidden_teacher.detach(), weight_teacher.detach()
    bt = None if bias_teacher is None else bias_teacher.detach()

    def rows(h: Tensor, h_t: Tensor) -> Tensor:
        z = h @ weight.T if bias is None else h @ weight.T + bias
        zt = h_t @ wt.T if bt is None else h_t @ wt.T + bt
        return fn(z, zt)

    return _by_rows(rows, hidden, ht, width=weight.shape[0])
