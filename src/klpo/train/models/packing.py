"""Packed rows: sequences laid end to end without padding, and the map back to the padded layout.

The trainer's padded layout holds B rows of T columns (prompts left-padded, completions
right-padded, ``[B, T]``). A packed layout puts the real tokens of those rows end to end into R
packs of W columns (``[R, W]``), each sequence's position ids restarting at 0, so that a model
that reads packed position ids (transformers' masking utilities: with ``attention_mask=None`` and
no cache, a position id that does not follow its left neighbour by one starts a new sequence, and
the mask is block-diagonal causal) computes each sequence alone, as in its padded row. This is
what verl's ``use_remove_padding``, OpenRLHF's ``packing_samples`` and prime-rl do. Packing is
where log-probs slip off their tokens: prime-rl's packed batches of k samples carried L - k
log-prob columns where its trainer computed L - 1 (PrimeIntellect-ai/prime-rl#605, #606). Here
:func:`unpack` reads the outputs back by the very index :func:`pack` wrote the tokens with, and
the tests compare every per-token value with the padded forward's.

A plan (:class:`Slots`) gives each sequence a pack and an offset there, chosen once for a batch
by first-fit decreasing (:func:`plan`). A subset of the batch (a micro-batch) keeps the plan's
offsets (:meth:`Slots.select`): each sequence sits at the same column of a pack of the same
width in every pass that computes it, whatever else shares its pack, so two passes over one
sequence (scoring and the update) run the same arithmetic on it. Columns that no sequence of the
subset fills are filler: the batch's first real token, at position id 0 (each a sequence of
one, attending to itself). Not a padding id: a pad token's embedding may be zero, and a filler
column that stays exactly zero through the layers gives NaN gradients where a norm takes the
square root of its mean square (Gemma 3n's magnitude: 0 x inf), even though no loss reads it.

Shapes: B rows, T padded columns, R packs, W columns per pack, N real tokens in all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Packed", "Slots", "pack", "packing_refusal", "plan", "unpack"]


@dataclass(frozen=True)
class Slots:
    """Where each of B sequences goes: ``pack [B]`` (long, the pack's number), ``offset [B]``
    (long, its first column there), ``lengths [B]`` (its real tokens), in packs of ``width``
    columns. A sequence of length 0 takes no column."""

    pack: Tensor
    offset: Tensor
    lengths: Tensor
    width: int

    def select(self, rows: Tensor | list[int]) -> Slots:
        """The slots of some rows (a micro-batch), each at its own pack and offset."""
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.pack.device)
        return Slots(self.pack[idx], self.offset[idx], self.lengths[idx], self.width)

    @property
    def n_packs(self) -> int:
        """The plan's packs: its largest pack number + 1 (of a selection, the plan's)."""
        return int(self.pack.max()) + 1 if len(self.pack) else 0

    def order(self, packs: Tensor | None = None) -> Tensor:
        """``[B]`` the rows pack by pack, ``packs`` (a permutation of the pack numbers; default
        0, 1, ...) giving the packs' order, each pack's rows by offset.

        Example:
            >>> plan([3, 1, 2, 2]).order(torch.tensor([2, 0, 1])).tolist()  # packs 3 | 2 + 1 | 2
            [3, 0, 2, 1]
        """
        packs = torch.arange(self.n_packs) if packs is None else torch.as_tensor(packs)
        rank = torch.empty_like(packs)
        rank[packs] = torch.arange(len(packs))
        key = rank[self.pack.cpu()] * (self.width + 1) + self.offset.cpu()
        return torch.argsort(key, stable=True)


def plan(lengths: Tensor | list[int], width: int | None = None) -> Slots:
    """Pack sequences of ``lengths [B]`` real tokens into as few packs of ``width`` columns as
    first-fit decreasing finds: the sequences longest first (ties by row), each into the first
    pack with room, else a new one; each pack's sequences follow one another in the order they
    arrived. ``width`` defaults to the longest length, so a pack holds at most the tokens of one
    padded row and no pack is wider than one; first-fit decreasing uses at most
    ``11/9 OPT + 6/9`` packs (Dósa 2007). Deterministic: the same lengths give the same slots.

    Example:
        >>> s = plan([3, 1, 2, 2])  # rows 0, 2, 3, 1 in turn: 3 | 2 + 1 | 2 in 3 columns
        >>> s.pack.tolist(), s.offset.tolist(), s.width
        ([0, 1, 1, 2], [0, 2, 0, 0], 3)
        >>> plan([5], width=4)
        Traceback (most recent call last):
        ...
        ValueError: a sequence of 5 tokens does not fit a pack of width 4
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    n = lengths.tolist()
    longest = max(n, default=0)
    width = longest if width is None else width
    if longest > width:
        raise ValueError(f"a sequence of {longest} tokens does not fit a pack of width {width}")
    if any(x < 0 for x in n):
        raise ValueError(f"sequence lengths must be >= 0, got {n}")
    pack, offset = [0] * len(n), [0] * len(n)
    used: list[int] = []  # columns taken in each pack so far
    for b in sorted(range(len(n)), key=lambda i: (-n[i], i)):
        p = next((j for j, taken in enumerate(used) if taken + n[b] <= width), len(used))
        if p == len(used):
            used.append(0)
        pack[b], offset[b] = p, used[p]
        used[p] += n[b]
    return Slots(torch.tensor(pack), torch.tensor(offset), lengths, max(width, 1))


@dataclass(frozen=True)
class Packed:
    """Rows packed for a forward pass.

    Attributes:
        input_ids: ``[R, W]`` the sequences' tokens end to end, the filler token elsewhere.
        position_ids: ``[R, W]`` each token's position in its own sequence (0, 1, ...), 0 at
            filler.
        real: ``[R, W]`` bool, True at a sequence's token (False at filler).
        index: ``[B, T]`` long, the flat index ``r * W + w`` in the packs of the padded
            position ``(b, t)``, -1 where ``(b, t)`` is padding.
    """

    input_ids: Tensor
    position_ids: Tensor
    real: Tensor
    index: Tensor


def pack(ids: Tensor, real: Tensor, slots: Slots, *, filler: int | None = None) -> Packed:
    """The rows ``ids [B, T]`` packed by ``slots`` (of these B rows, :meth:`Slots.select` for a
    subset of a planned batch): row b's real tokens (``real [B, T]`` True, in column order,
    ``slots.lengths[b]`` of them) go to pack ``slots.pack[b]`` from column ``slots.offset[b]``,
    position ids 0, 1, ... . The packs the rows use are renumbered 0 .. R-1 in the plan's order;
    the columns no row fills hold ``filler`` (default: the first real token of ``ids``, see
    the module) at position 0. Position ids restart at each sequence, so a left-padded row gets
    the positions ``cumsum(mask) - 1`` that the padded forward gives its real tokens.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 7], [0, 0, 8, 9]])
        >>> real = ids > 0
        >>> p = pack(ids, real, plan(real.sum(-1), width=5))  # one pack: 3 + 2 tokens
        >>> p.input_ids.tolist(), p.position_ids.tolist(), p.index.tolist()
        ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [[-1, 0, 1, 2], [-1, -1, 3, 4]])
        >>> p = pack(ids, real, plan(real.sum(-1)))  # width 3 (the longest): two packs, filler 5
        >>> p.input_ids.tolist(), p.position_ids.tolist(), p.index.tolist()
        ([[5, 6, 7], [8, 9, 5]], [[0, 1, 2], [0, 1, 0]], [[-1, 0, 1, 2], [-1, -1, 3, 4]])
    """
    if ids.shape != real.shape or ids.dim() != 2:
        raise ValueError(f"ids and real must both be [B, T], got {tuple(ids.shape)} and "
                         f"{tuple(real.shape)}")  # fmt: skip
    real = real.bool()
    counts = real.sum(-1).to(slots.lengths.device)
    if not torch.equal(counts, slots.lengths):
        raise ValueError(f"the rows hold {counts.tolist()} real tokens, the slots were planned "
                         f"for {slots.lengths.tolist()}")  # fmt: skip
    if bool((slots.offset + slots.lengths > slots.width).any()):
        raise ValueError(f"a sequence runs past its pack's width {slots.width}")
    device, width = ids.device, slots.width
    used, row = torch.unique(slots.pack.to(device), sorted=True, return_inverse=True)
    n_packs = max(len(used), 1)
    rank = real.long().cumsum(-1) - 1  # each real token's position in its sequence
    flat = row[:, None] * width + slots.offset.to(device)[:, None] + rank
    index = torch.where(real, flat, -1)
    at = index[real]
    if at.unique().numel() != at.numel():
        raise ValueError("two sequences of the slots overlap in a pack")
    if filler is None:
        filler = int(ids[real][0]) if bool(real.any()) else 0
    input_ids = torch.full((n_packs * width,), filler, dtype=ids.dtype, device=device)
    position_ids = torch.zeros(n_packs * width, dtype=torch.long, device=device)
    is_real = torch.zeros(n_packs * width, dtype=torch.bool, device=device)
    input_ids[at] = ids[real]
    position_ids[at] = rank[real]
    is_real[at] = True
    shape = (n_packs, width)
    return Packed(input_ids.view(shape), position_ids.view(shape), is_real.view(shape), index)


def unpack(values: Tensor, index: Tensor) -> Tensor:
    """Per-token outputs of packs, ``values [R, W, ...]``, in the padded layout of ``index
    [B, T']`` (:attr:`Packed.index`, or columns of it): ``out[b, t] = values.flat[index[b, t]]``,
    exactly 0 where ``index`` is -1. Differentiable: the gradient of ``out`` flows to the packed
    positions it was read from, none to filler.

    Example:
        >>> v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> unpack(v, torch.tensor([[-1, 0, 1], [3, 4, -1]])).tolist()
        [[0.0, 1.0, 2.0], [4.0, 5.0, 0.0]]
    """
    rest = values.shape[2:]
    flat = values.reshape(-1, *rest)
    if index.numel() and int(index.max()) >= flat.shape[0]:
        raise ValueError(f"index {int(index.max())} is past the packs' {flat.shape[0]} columns")
    taken = flat[index.clamp(min=0).reshape(-1)].reshape(*index.shape, *rest)
    pad = (index < 0).reshape(*index.shape, *([1] * len(rest)))
    return taken.masked_fill(pad, 0)


def packing_refusal(model: Any) -> str | None:
    """Why ``model`` (a causal LM, or a peft wrapper of one) cannot run packed rows, or None.

    A probe at load (``algo.packing: on``), run as the trainer runs packs (no attention mask,
    position ids restarting, no cache): two packed rows ``[A S .]`` and ``[B S .]`` (sequences
    of 3, 3 and 2 tokens, the lowest ids that are no special token, and a column of filler),
    and each sequence alone. Two checks of the log-probs at every position:

    * ``S`` must not depend on what precedes it: its log-probs in the two rows are computed on
      the same shapes at the same columns, and the other sequence reaches them only through
      exact zeros (masked attention weights) where the model keeps sequences apart, so they
      must agree to a few units of rounding (8 eps of the parameters' dtype, times the largest
      log-prob). A recurrent, state-space or convolution layer, or a mask by column, carries
      ``A`` or ``B`` into ``S``, and so does an attention mask built by column rather than from
      the position ids: a leak that a small random model may make as small as 1e-2 nats
      (Lara-mini's convolution, beside log-probs of 160), which a looser bound would miss;
    * every sequence must get the log-probs it gets alone, to the rounding of another layout
      (``1e-4`` relative in float32 and wider, ``2e-2`` in 16-bit): position ids the model
      ignores would leave the two rows alike and wrong.

    A forward that fails on packed input is a refusal too. No gradient; eval mode for the
    probe, the model's training flags restored.
    """
    from klpo import heads
    from klpo.train.models.cache import _probe_ids

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    param = next(model.parameters())
    device = param.device
    a, b, tail = _probe_ids(inner, device, 8)[0].split([3, 3, 2])
    ids = torch.stack([torch.cat([a, tail, a[:1]]), torch.cat([b, tail, a[:1]])])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]] * 2, device=device)
    kwargs = {"use_cache": False} if heads.accepts_keyword(model, "use_cache") else {}
    try:
        with torch.no_grad(), heads.evaluating(model):
            packed = model(
                input_ids=ids, attention_mask=None, position_ids=positions, **kwargs
            ).logits  # fmt: skip
            alone = [model(input_ids=x[None], **kwargs).logits[0] for x in (a, b, tail)]
    except Exception as err:  # the model's own code: any error means it cannot pack
        text = " ".join(str(err).split())[:120]
        return f"its forward over packed rows fails ({type(err).__name__}: {text})"
    got = torch.log_softmax(packed.double(), -1)
    want = [torch.log_softmax(x.double(), -1) for x in alone]
    pairs = [(got[0, :3], want[0]), (got[1, :3], want[1]), (got[0, 3:5], want[2]),
             (got[1, 3:5], want[2]), (got[0, 3:5], got[1, 3:5])]  # fmt: skip
    finite = [torch.isfinite(y) for _, y in pairs]  # a masked vocabulary entry is -inf in both
    if not all(
        bool((torch.isfinite(x) == f).all()) for (x, _), f in zip(pairs, finite, strict=True)
    ):
        return "its forward over packed rows gives non-finite log-probs where alone it does not"
    gaps = [float((x - y)[f].abs().max()) for (x, y), f in zip(pairs, finite, strict=True)]
    scale = max(1.0, max(float(y[f].abs().max()) for (_, y), f in zip(pairs, finite, strict=True)))
    if not gaps[4] <= 8 * torch.finfo(param.dtype).eps * scale:
        return (
            f"a packed sequence's log-probs change with the sequence before it in its row (by "
            f"{gaps[4]:.3g}): its forward carries one packed sequence into the next (recurrent, "
            "state-space or convolution layers, or an attention mask that does not follow the "
            "position ids)"
        )
    rel = 2e-2 if param.element_size() < 4 else 1e-4
    if not max(gaps[:4]) <= rel * scale:
        return (
            f"packed sequences get other log-probs than each alone (off by {max(gaps[:4]):.3g}): "
            "its forward does not read packed position ids (an attention implementation without "
            "packed support, positions counted by column)"
        )
    return None
