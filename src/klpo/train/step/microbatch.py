"""Splitting a minibatch into micro-batches: by a sequence count and by a token budget.

A forward/backward pass over rows of width ``L`` (prompt + completion columns, padding
included, since the pass computes on every column) holds activations proportional to
``rows × L``. With ``algo.micro_batch_tokens = N`` a micro-batch holds ``max(1, N // L)`` rows,
so when a step's completions are long, fewer sequences go through each pass. Gradients
accumulate over the micro-batches and every loss is divided by the minibatch's global
normaliser, so the gradient does not depend on the split (tests/train/step/test_precision.py).
"""

from __future__ import annotations

from torch import Tensor


def rows_per_micro_batch(
    n_rows: int, width: int, micro_batch: int, micro_batch_tokens: int, group: int = 1
) -> int:
    """Rows in one micro-batch: the smaller of ``micro_batch`` and the token budget's rows, in
    whole groups of ``group`` (at least one) where the passes share each group's prompt.

    With ``rollout.share_prompt`` the scoring passes compute each group's prompt once; a
    micro-batch that cut a group would compute its rows whole instead, which rounds differently,
    and step 1 would no longer be exact (a KL of 1.5e-8 per token on the test model). So the
    update's micro-batches are whole groups there: ``micro_batch`` or the budget below one group
    acts as one group (a group wider than the budget makes a micro-batch of its own, as a row
    wider than it does).

    Args:
        n_rows: rows in the minibatch.
        width: padded tokens per row (prompt + completion columns).
        micro_batch: sequences per pass (0: no limit).
        micro_batch_tokens: token budget per pass (0: no limit); a row wider than the budget
            still makes a micro-batch of its own.
        group: completions per prompt whose prompt the passes share (1: none shared).
    """
    size = n_rows
    if micro_batch:
        size = min(size, micro_batch)
    if micro_batch_tokens:
        size = min(size, max(1, micro_batch_tokens // max(width, 1)))
    if group > 1:
        size = max(group, size - size % group)
    return max(size, 1)


def minibatches(order: Tensor, n: int, group: int = 1) -> tuple[Tensor, ...]:
    """The update's row ``order`` cut into ``n`` minibatches, each of whole groups of ``group``
    consecutive rows (where the passes share each group's prompt; see
    :func:`rows_per_micro_batch`): fewer than ``n`` when there are fewer groups.

    >>> import torch
    >>> [m.tolist() for m in minibatches(torch.arange(8), 3, group=2)]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> [m.tolist() for m in minibatches(torch.arange(8), 3)]
    [[0, 1, 2], [3, 4, 5], [6, 7]]
    """
    if group <= 1 or len(order) % group:
        return order.chunk(n)
    return tuple(c.flatten() for c in order.view(-1, group).chunk(n))


def split(
    rows: Tensor, width: int, micro_batch: int, micro_batch_tokens: int, group: int = 1
) -> tuple[Tensor, ...]:
    """``rows`` (a minibatch's row indices) cut into consecutive micro-batches."""
    size = rows_per_micro_batch(len(rows), width, micro_batch, micro_batch_tokens, group)
    return rows.split(size)
