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

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from klpo._tensor import check_float, check_same_shape
from klpo.logprobs import ROW_ELEMENTS, exact_kl
from klpo.teacher_kernel import (
    DIVERGENCES,
    LOSS_ROW_ELEMENTS,
    FromHiddenLoss,
    from_hidden,
    from_hidden_loss,
)

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
