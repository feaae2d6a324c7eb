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
    """Rows in one micro-batch: the smaller of ``micro_batch`` and the token budget's rows.

    The budget's rows are ``micro_batch_tokens // width``, rounded down to whole groups of
    ``group`` when that leaves at least one: the update orders its rows by whole groups, so
    micro-batches of whole groups compute each prompt once (``rollout.share_prompt``).

    Args:
        n_rows: rows in the minibatch.
        width: padded tokens per row (prompt + completion columns).
        micro_batch: sequences per pass (0: no limit).
        micro_batch_tokens: token budget per pass (0: no limit); a row wider than the budget
            still makes a micro-batch of its own.
        group: completions per prompt (consecutive rows that share a prompt).
    """
    size = n_rows
    if micro_batch:
        size = min(size, micro_batch)
    if micro_batch_tokens:
        budget = max(1, micro_batch_tokens // max(width, 1))
        if group > 1 and budget >= group:
            budget -= budget % group
        size = min(size, budget)
    return max(size, 1)


def split(
    rows: Tensor, width: int, micro_batch: int, micro_batch_tokens: int, group: int = 1
) -> tuple[Tensor, ...]:
    """``rows`` (a minibatch's row indices) cut into consecutive micro-batches."""
    size = rows_per_micro_batch(len(rows), width, micro_batch, micro_batch_tokens, group)
    return rows.split(size)
