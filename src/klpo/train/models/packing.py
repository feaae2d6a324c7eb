"""Packed rows: sequences laid end to end without padding, and the map back to the padded layout.

The trainer's padded layout holds B rows of T columns (prompts left-padded, completions
right-padded, ``[B, T]``). A packed layout puts the real tokens of those rows end to end into R
packs of W columns (``[R, W]``), each sequence's position ids restarting at 0, so that a model
that reads packed position ids (transformers' masking utilities: with ``attention_mask=None`` and
no cache, a position id that does not follow its left neighbour by one starts a new sequence, and
the mask is block-diagonal causal) computes each sequence alone, as in its padded row. This is
what verl's ``use_remove_padding``, OpenRLHF's ``packing_samples`` and prime-rl do; an offset of
one between the tokens and their outputs misaligns every log-prob (prime-rl/prime-rl#606, where
it looked like a KL blow-up), so :func:`unpack` maps outputs back by the same index that
:func:`pack` wrote the tokens with.

A plan (:class:`Slots`) gives each sequence a pack and an offset there, chosen once for a batch
by first-fit decreasing (:func:`plan`). A subset of the batch (a micro-batch) keeps the plan's
offsets (:meth:`Slots.select`): each sequence sits at the same column of a pack of the same
width in every pass that computes it, whatever else shares its pack, so two passes over one
sequence (scoring and the update) run the same arithmetic on it. Columns that no sequence of the
subset fills are filler: token 0, position id 0 (each a sequence of one, attending to itself).

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

    def to(self, device: torch.device | str) -> Slots:
        return Slots(
            self.pack.to(device), self.offset.to(device), self.lengths.to(device), self.width
        )

    @property
    def n_packs(self) -> int:
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
        input_ids: ``[R, W]`` the sequences' tokens end to end, filler 0 elsewhere.
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


def pack(ids: Tensor, real: Tensor, slots: Slots) -> Packed:
    """The rows ``ids [B, T]`` packed by ``slots`` (of these B rows, :meth:`Slots.select` for a
    subset of a planned batch): row b's real tokens (``real [B, T]`` True, in column order,
    ``slots.lengths[b]`` of them) go to pack ``slots.pack[b]`` from column ``slots.offset[b]``,
    position ids 0, 1, ... . The packs the rows use are renumbered 0 .. R-1 in the plan's order;
    the columns no row fills are filler. Position ids restart at each sequence, so a left-padded
    row gets the positions ``cumsum(mask) - 1`` that the padded forward gives its real tokens.

    Example:
        >>> ids = torch.tensor([[0, 5, 6, 7], [0, 0, 8, 9]])
        >>> real = ids > 0
        >>> p = pack(ids, real, plan(real.sum(-1), width=5))  # one pack: 3 + 2 tokens
        >>> p.input_ids.tolist(), p.position_ids.tolist(), p.index.tolist()
        ([[5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1]], [[-1, 0, 1, 2], [-1, -1, 3, 4]])
        >>> p = pack(ids, real, plan(real.sum(-1)))  # width 3 (the longest): two packs
        >>> p.input_ids.tolist(), p.position_ids.tolist(), p.index.tolist()
        ([[5, 6, 7], [8, 9, 0]], [[0, 1, 2], [0, 1, 0]], [[-1, 0, 1, 2], [-1, -1, 3, 4]])
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
    input_ids = torch.zeros(n_packs * width, dtype=ids.dtype, device=device)
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


PROBE_LENGTHS = (3, 2)
"""The load-time probe's sequences (:func:`packing_refusal`), packed into one row with a
column of filler after them."""


def packing_refusal(model: Any) -> str | None:
    """Why ``model`` (a causal LM, or a peft wrapper of one) cannot run packed rows, or None.

    A probe at load (``algo.packing: on``): two sequences of :data:`PROBE_LENGTHS` tokens (the
    lowest ids that are no special token) packed into one row, run as the trainer runs packs
    (no attention mask, position ids restarting, no cache), against each sequence run alone;
    the log-probs at every position must agree to the parameters' rounding (``1e-4`` relative
    in float32 and wider, ``2e-2`` in 16-bit). A model that masks by column rather than by
    position id lets the second sequence attend to the first; a recurrent or state-space layer
    carries its state across; an attention implementation without packed support ignores the
    restarts: all give other log-probs here. A forward that fails on packed input is a refusal
    too. No gradient; eval mode for the probe, the model's training flags restored.
    """
    from klpo import heads
    from klpo.train.models.cache import _probe_ids

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    param = next(model.parameters())
    n = sum(PROBE_LENGTHS)
    ids = _probe_ids(inner, param.device, n)[0]
    seqs = list(ids.split(list(PROBE_LENGTHS)))
    real = torch.ones(len(seqs), max(PROBE_LENGTHS), dtype=torch.bool)
    for i, s in enumerate(seqs):
        real[i, len(s) :] = False
    padded = torch.zeros(real.shape, dtype=torch.long, device=param.device)
    padded[real] = ids
    packed = pack(padded, real.to(param.device), plan(real.sum(-1), width=n + 1))
    kwargs = {"use_cache": False} if heads.accepts_keyword(model, "use_cache") else {}
    try:
        with torch.no_grad(), heads.evaluating(model):
            got = model(
                input_ids=packed.input_ids, attention_mask=None,
                position_ids=packed.position_ids, **kwargs,
            ).logits  # fmt: skip
            alone = [model(input_ids=s[None], **kwargs).logits[0] for s in seqs]
    except Exception as err:  # the model's own code: any error means it cannot pack
        text = " ".join(str(err).split())[:120]
        return f"its forward over packed rows fails ({type(err).__name__}: {text})"
    got = unpack(got, packed.index)[real.to(param.device)]
    want = torch.cat(alone)
    got, want = (torch.log_softmax(x.double(), -1) for x in (got, want))
    finite = torch.isfinite(want)  # a masked vocabulary entry is -inf in both
    if not bool((torch.isfinite(got) == finite).all()):
        return "its forward over packed rows gives non-finite log-probs where alone it does not"
    gap = float((got - want)[finite].abs().max())
    tol = (2e-2 if param.element_size() < 4 else 1e-4) * max(1.0, float(want[finite].abs().max()))
    if not gap <= tol:
        return (
            f"two sequences packed in one row get other log-probs than each alone (off by "
            f"{gap:.3g}): its forward does not keep packed sequences apart by their position "
            "ids (recurrent or state-space layers, an attention implementation without packed "
            "support, a mask by column)"
        )
    return None
