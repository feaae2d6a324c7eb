r"""Advantages and returns: GAE, returns-to-go, group-relative (GRPO, Dr. GRPO), RLOO, REINFORCE++.

Per-token inputs are ``[B, T]`` with a ``mask`` (True = the token takes part). A row's valid tokens
are taken **in order, skipping masked positions**: the "next" token of a valid token is the next
valid one in the row, and after the last valid token the episode ends (value 0). With right padding
this is the usual terminal at the end of the response; with holes in the mask (tool output inside
a multi-turn response) it skips them, as verl's ``compute_gae_advantage_return`` does. Rewards and
values at masked positions are ignored (they may be anything, even inf or NaN); every output is
exactly 0 there.

Per-token rewards carry everything: a task reward at the last valid token, and a KL penalty on any
token (:func:`klpo.losses.kl_reward`). Sequence-level estimators (:func:`group_relative`,
:func:`rloo`) take one reward per sequence, ``[N]``, with the ``G`` completions of a prompt
contiguous (``rewards.view(-1, G)`` is one row per prompt); :func:`broadcast_to_tokens` spreads the
result over each sequence's valid tokens.

Everything here is a target, not a function of the parameters: outputs are computed under
``torch.no_grad`` and returned detached. Arithmetic is in float64 (float32 on Apple's MPS);
outputs are float32 (float64 when an input is float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from klpo._tensor import check_mask, check_same_shape, to_out, wide_dtype

__all__ = [
    "WhitenStats",
    "broadcast_to_tokens",
    "gae",
    "group_relative",
    "group_std",
    "merge_whiten_stats",
    "reinforce_pp",
    "returns_to_go",
    "rloo",
    "whiten",
    "whiten_stats",
]

StdMode = Literal["sample", "population", "none"]
ScaleMode = Literal["group", "batch"]


def _wide(x: Tensor) -> Tensor:
    return x.detach().to(wide_dtype(x))


def _check_tokens(mask: Tensor, **tensors: Tensor) -> None:
    check_mask(mask)
    if mask.dim() != 2:
        raise TypeError(
            f"mask must be a [B, T] bool tensor (True = the token takes part); got shape "
            f"{tuple(mask.shape)}"
        )
    check_same_shape("mask", mask, hint="[B, T]", **tensors)


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")


def _check_groups(rewards: Tensor, group_size: int, what: str, valid: Tensor | None = None) -> None:
    if not isinstance(rewards, Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise TypeError(
            f"rewards must be a 1-D float tensor [N] (one reward per sequence), got "
            f"{getattr(rewards, 'dtype', type(rewards).__name__)} of shape "
            f"{tuple(getattr(rewards, 'shape', ()))}; sum per-token rewards over each sequence first"
        )
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if group_size == 1:
        raise ValueError(
            f"group_size=1: {what} compares each completion with the others of its prompt, so a "
            "group of one has no baseline (every advantage would be 0); sample G >= 2 completions "
            "per prompt, or use gae (a learned value) or reinforce_pp (a batch baseline)"
        )
    if rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of group_size={group_size}; "
            f"rewards must hold the G completions of each prompt contiguously"
        )
    if valid is not None and (
        not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.shape != rewards.shape
    ):
        raise TypeError(
            f"valid must be a [N] = [{rewards.numel()}] bool tensor (True = the sequence was "
            f"scored), got {getattr(valid, 'dtype', type(valid).__name__)} of shape "
            f"{tuple(getattr(valid, 'shape', ()))}"
        )
    counted = torch.isfinite(rewards) if valid is None else torch.isfinite(rewards) | ~valid
    if not bool(counted.all()):
        bad = torch.nonzero(~counted).flatten().tolist()[:8]
        raise ValueError(f"rewards must be finite; non-finite at indices {bad}")


# --------------------------------------------------------------------------------------------
# Token-level returns and GAE.


def returns_to_go(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    r"""Discounted returns-to-go over each row's valid tokens.

    ``G_t = r_t + gamma · G_{t'}``, with ``t'`` the next valid token of the row (``G = 0`` after
    the last). With a task reward ``R`` at the last valid token and KL shaping
    ``-beta · kl_s`` on every token, ``G_t = gamma^(n-1-k) R - beta sum_{s >= t} gamma^(k_s - k) kl_s``
    (``k`` = index among the valid tokens): the KL of the *future* tokens reaches token ``t``,
    which a per-token KL loss misses (Tang & Munos 2025, arXiv:2506.09477).

    Args:
        rewards: ``[B, T]`` per-token rewards.
        mask: ``[B, T]`` bool.
        gamma: discount in [0, 1].

    Returns:
        ``[B, T]`` returns, 0 at masked tokens; detached.
    """
    _check_tokens(mask, rewards=rewards)
    _check_unit("gamma", gamma)
    with torch.no_grad():
        r = _wide(rewards)
        out = torch.zeros_like(r)
        running = torch.zeros_like(r[:, 0])
        for t in reversed(range(r.shape[1])):
            m = mask[:, t]
            running = torch.where(m, r[:, t] + gamma * running, running)
            out[:, t] = torch.where(m, running, 0.0)
    return to_out(out, rewards)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438, eq. 16).

    Over each row's valid tokens, with ``t'`` the next valid token and ``V_{t'} = 0`` after the
    last one (the response ended):

        delta_t = r_t + gamma · V_{t'} - V_t
        A_t     = delta_t + gamma · lam · A_{t'}
        R_t     = A_t + V_t                      (the value target, "returns")

    ``lam = 1`` gives ``A_t = G_t - V_t`` (:func:`returns_to_go` minus the values); ``lam = 0``
    gives the one-step TD error ``delta_t``. No whitening here: call :func:`whiten` on the result
    if wanted (verl whitens inside its ``compute_gae_advantage_return``; klpo keeps it a separate
    step so ``R_t`` and ``A_t`` stay consistent).

    Args:
        rewards: ``[B, T]`` per-token rewards.
        values: ``[B, T]`` the critic's V(s_t) at each token (detached here).
        mask: ``[B, T]`` bool.
        gamma: discount in [0, 1].
        lam: GAE's lambda in [0, 1].

    Returns:
        ``(adv, returns)``, each ``[B, T]``, 0 at masked tokens; detached.
    """
    _check_tokens(mask, rewards=rewards, values=values)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    with torch.no_grad():
        r, v = _wide(rewards), _wide(values)
        adv = torch.zeros_like(r)
        next_value = torch.zeros_like(r[:, 0])
        running = torch.zeros_like(r[:, 0])
        for t in reversed(range(r.shape[1])):
            m = mask[:, t]
            delta = r[:, t] + gamma * next_value - v[:, t]
            running = torch.where(m, delta + gamma * lam * running, running)
            next_value = torch.where(m, v[:, t], next_value)
            adv[:, t] = torch.where(m, running, 0.0)
        ret = torch.where(mask, adv + v, 0.0)
    return to_out(adv, rewards, values), to_out(ret, rewards, values)


class WhitenStats(NamedTuple):
    r"""What :func:`whiten` needs of a batch: its valid tokens' count, mean, centred sum of
    squares ``M2 = sum (x - mean)^2``, largest and smallest value; each a 0-dim float64 tensor
    (float32 on Apple's MPS).

    :func:`whiten_stats` computes them for one shard of a batch; :func:`merge_whiten_stats`
    combines shards, so data-parallel ranks whiten with the whole batch's statistics.
    ``torch.stack(stats)`` is a ``[5]`` tensor to send between processes; ``WhitenStats(*row)``
    reads one back.
    """

    count: Tensor
    mean: Tensor
    m2: Tensor
    vmax: Tensor
    vmin: Tensor


def whiten_stats(x: Tensor, mask: Tensor) -> WhitenStats:
    r""":class:`WhitenStats` of ``x`` over the tokens where ``mask`` is True, in two passes.

    ``mean = sum x / n``, then ``M2 = sum (x - mean)^2`` (the two-pass form, no cancellation of
    ``sum x^2 - n mean^2``). With no valid token: count 0, mean and M2 0, ``vmax = -inf``,
    ``vmin = +inf``.

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]`` bool.

    Returns:
        :class:`WhitenStats`, detached.
    """
    _check_tokens(mask, x=x)
    with torch.no_grad():
        w = _wide(x)
        n = mask.sum().to(w.dtype)
        mean = torch.where(mask, w, 0.0).sum() / n.clamp_min(1)
        centred = torch.where(mask, w - mean, 0.0)
        inf = torch.full((1,), torch.inf, dtype=w.dtype, device=w.device)
        return WhitenStats(
            count=n,
            mean=mean,
            m2=(centred * centred).sum(),
            vmax=torch.cat([torch.where(mask, w, -inf).flatten(), -inf]).max(),
            vmin=torch.cat([torch.where(mask, w, inf).flatten(), inf]).min(),
        )


def merge_whiten_stats(parts: Sequence[WhitenStats]) -> WhitenStats:
    r"""The :class:`WhitenStats` of the union of disjoint shards (Chan, Golub & LeVeque 1979).

    Folding in shard ``b`` (count ``n_b``, mean ``m_b``, ``M2_b``) into ``a``, with
    ``n = n_a + n_b`` and ``delta = m_b - m_a``:

        mean = m_a + delta · n_b / n
        M2   = M2_a + M2_b + delta^2 · n_a · n_b / n

    the pairwise update of Chan et al., "Updating formulae and a pairwise algorithm for computing
    sample variances" (1979): each shard's ``M2`` is already centred, so it keeps the two-pass
    accuracy that a merge of ``(n, sum x, sum x^2)`` loses to cancellation. Shards with no valid
    token are skipped; the maximum and minimum are those of the shards. The fold is in the given
    order, so every rank that merges the same list gets the same bits.

    Args:
        parts: one :class:`WhitenStats` per shard (at least one).

    Returns:
        :class:`WhitenStats` of all the shards' valid tokens together.
    """
    parts = list(parts)
    if not parts or not all(isinstance(p, WhitenStats) for p in parts):
        raise TypeError(
            "parts must be a non-empty sequence of WhitenStats (one per shard, from whiten_stats); "
            f"got {[type(p).__name__ for p in parts]}"
        )
    out = parts[0]
    for b in parts[1:]:
        vmax, vmin = torch.maximum(out.vmax, b.vmax), torch.minimum(out.vmin, b.vmin)
        if float(b.count) == 0:
            out = out._replace(vmax=vmax, vmin=vmin)
        elif float(out.count) == 0:
            out = b._replace(vmax=vmax, vmin=vmin)
        else:
            n = out.count + b.count
            delta = b.mean - out.mean
            out = WhitenStats(
                count=n,
                mean=out.mean + delta * (b.count / n),
                m2=out.m2 + b.m2 + delta * delta * (out.count * b.count / n),
                vmax=vmax,
                vmin=vmin,
            )
    return out


def whiten(
    x: Tensor,
    mask: Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    stats: WhitenStats | None = None,
) -> Tensor:
    r"""Normalise ``x`` over its valid tokens: ``(x - mean) / sqrt(var + eps)``.

    ``mean`` and ``var`` are over the tokens where ``mask`` is True, ``var = M2 / (n - 1)``
    with Bessel's correction, ``eps`` inside the square root: the convention of verl's and
    TRL's ``masked_whiten``. With ``shift_mean=False`` the mean is added back (only the scale
    changes). Where every valid value is equal (or only one is valid) the centred values are
    exactly 0, so the output is 0 (``mean`` with ``shift_mean=False``), never NaN.

    ``stats`` whitens ``x`` with another batch's statistics: under data parallelism each rank
    holds a shard of the batch and passes the merge of every rank's :func:`whiten_stats`
    (:func:`merge_whiten_stats`), so its shard is whitened exactly as by one process holding the
    whole batch. Without it, ``stats = whiten_stats(x, mask)`` (the same bits as passing that).

    Args:
        x: ``[B, T]``.
        mask: ``[B, T]`` bool; the statistics are over this whole tensor (pass the whole rollout
            batch, not a micro-batch), or over the batch ``stats`` describes.
        shift_mean: subtract the mean (True) or keep it.
        eps: added to the variance.
        stats: statistics of the whole batch ``x`` is a shard of (its count at least ``x``'s).

    Returns:
        ``[B, T]``, 0 at masked tokens; detached.
    """
    _check_tokens(mask, x=x)
    if stats is None:
        stats = whiten_stats(x, mask)
    elif not isinstance(stats, WhitenStats):
        raise TypeError(
            f"stats must be WhitenStats (from whiten_stats / merge_whiten_stats), got "
            f"{type(stats).__name__}"
        )
    elif float(stats.count) < int(mask.sum()):
        raise ValueError(
            f"stats describe {int(stats.count)} valid tokens but mask holds {int(mask.sum())}: "
            "stats must be those of a batch that contains x (merge every shard's whiten_stats, "
            "this one's included)"
        )
    with torch.no_grad():
        w = _wide(x)
        n = stats.count.to(w.device, w.dtype)
        if float(n) == 0:
            return to_out(torch.zeros_like(w), x)
        mean = stats.mean.to(w.device, w.dtype)
        centred = torch.where(mask, w - mean, 0.0)
        if bool(stats.vmax == stats.vmin):
            centred = torch.zeros_like(centred)
            var = torch.zeros_like(mean)
        else:
            var = stats.m2.to(w.device, w.dtype) / (n - 1).clamp_min(1)
        out = centred * torch.rsqrt(var + eps)
        if not shift_mean:
            out = out + mean
        out = torch.where(mask, out, 0.0)
    return to_out(out, x)


def reinforce_pp(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, eps: float = 1e-8) -> Tensor:
    r"""REINFORCE++ advantages: returns-to-go whitened over the batch (Hu 2025, arXiv:2501.03262).

    ``A_t = whiten(G)_t`` with ``G`` = :func:`returns_to_go` of the per-token rewards (task
    reward at the last valid token, the KL penalty of :func:`klpo.losses.kl_reward` on every
    token) and the mean and variance taken over all valid tokens of the batch. Matches verl's
    ``compute_reinforce_plus_plus_outcome_advantage``. For a batch split over processes, whiten
    the returns-to-go with the merged statistics of every shard (``whiten(..., stats=...)``).

    Args:
        rewards: ``[B, T]`` per-token rewards, KL shaping included.
        mask: ``[B, T]`` bool.
        gamma: discount in [0, 1].
        eps: added to the variance in :func:`whiten`.

    Returns:
        ``[B, T]`` advantages, 0 at masked tokens; detached.
    """
    return whiten(returns_to_go(rewards, mask, gamma=gamma), mask, eps=eps)


# --------------------------------------------------------------------------------------------
# Sequence-level (critic-free) estimators.


def _centred(r: Tensor) -> Tensor:
    """``r - mean(r)`` per row of ``[P, G]``; exactly 0 in a row of identical rewards."""
    centred = r - r.mean(dim=1, keepdim=True)
    same = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(same, 0.0, centred)


def _centred_valid(r: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``(r - mean_v(r), n)`` per row of ``[P, G]``: the mean and the count ``n`` ``[P, 1]`` over
    the entries where ``v`` is True; the centred value is exactly 0 where ``v`` is False and in a
    row whose valid rewards are all equal (or that has fewer than two)."""
    n = v.sum(dim=1, keepdim=True).to(r.dtype)
    mean = torch.where(v, r, 0.0).sum(dim=1, keepdim=True) / n.clamp_min(1)
    hi = torch.where(v, r, -torch.inf).amax(dim=1, keepdim=True)
    lo = torch.where(v, r, torch.inf).amin(dim=1, keepdim=True)
    return torch.where(v & (hi > lo), r - mean, 0.0), n


def _group_relative_valid(
    r: Tensor, v: Tensor, std: StdMode, scale: ScaleMode, eps: float
) -> Tensor:
    """:func:`group_relative` over the entries where ``v`` is True (``r``, ``v``: ``[P, G]``)."""
    centred, n = _centred_valid(r, v)
    if std == "none":
        return centred
    ddof = 1 if std == "sample" else 0
    if scale == "group":
        s = ((centred * centred).sum(dim=1, keepdim=True) / (n - ddof).clamp_min(1)).sqrt()
    else:
        count = v.sum().to(r.dtype)
        mean = torch.where(v, r, 0.0).sum() / count.clamp_min(1)
        dev = torch.where(v, r - mean, 0.0)
        s = ((dev * dev).sum() / (count - ddof).clamp_min(1)).sqrt()
    return torch.where(centred == 0, 0.0, centred / (s + eps))


def group_relative(
    rewards: Tensor,
    group_size: int,
    *,
    std: StdMode = "sample",
    scale: ScaleMode = "group",
    eps: float = 1e-6,
    valid: Tensor | None = None,
) -> Tensor:
    r"""Group-relative advantages (GRPO; Dr. GRPO with ``std="none"``).

    ``A_i = (r_i - mean_g(r)) / (s + eps)`` over the ``G = group_size`` completions of the
    prompt (DeepSeekMath, arXiv:2402.03300, §4.1.2), where ``s`` is

    - ``std="sample"``: the standard deviation with Bessel's correction (ddof 1, ``torch.std``'s
      default, as verl and TRL);
    - ``std="population"``: ddof 0;
    - ``std="none"``: no division (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783: the std
      normalisation up-weights too-easy and too-hard prompts);

    taken over the group (``scale="group"``) or over every reward in the batch
    (``scale="batch"``, TRL's ``scale_rewards="batch"``: the group mean is still subtracted).

    Example, rewards (1, 0, 0, 0): "none" → (0.75, -0.25, -0.25, -0.25); "sample" (s = 0.5) →
    (1.5, -0.5, -0.5, -0.5); "population" (s = 0.4330127) → (1.7320508, -0.5773503, ...).

    A group of identical rewards gets exactly zero advantages (never NaN, even with eps = 0).

    ``valid`` marks the sequences that have a reward (a reward function may decline to score
    one, TRL's ``None``): the mean and ``s`` are then over the valid rewards only (a group's
    ``G_v`` valid ones, ``ddof`` against ``G_v``), exactly as if the others were not in the batch
    (TRL's ``nanmean``/``nanstd``), and an invalid sequence's advantage is 0. Example, rewards
    (1, 0, x, 0) with the third invalid: "none" → (2/3, -1/3, 0, -1/3). A group with fewer than
    two valid rewards gets zeros.

    Args:
        rewards: ``[N]`` one reward per sequence, ``N = P · G``, each prompt's completions
            contiguous; values where ``valid`` is False are ignored (may be NaN).
        group_size: ``G >= 2``.
        std: ``"sample"``, ``"population"`` or ``"none"``.
        scale: ``"group"`` or ``"batch"`` (which rewards ``s`` is computed over).
        eps: added to ``s`` (verl 1e-6; TRL 1e-4).
        valid: ``[N]`` bool, True where the sequence has a reward (None: all).

    Returns:
        ``[N]`` advantages; detached.
    """
    _check_groups(rewards, group_size, "a group-relative advantage", valid)
    if std not in ("sample", "population", "none"):
        raise ValueError(f"std must be 'sample', 'population' or 'none', got {std!r}")
    if scale not in ("group", "batch"):
        raise ValueError(f"scale must be 'group' or 'batch', got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    with torch.no_grad():
        r = _wide(rewards).view(-1, group_size)
        if valid is not None:
            adv = _group_relative_valid(r, valid.view(-1, group_size), std, scale, eps)
            return to_out(adv.flatten(), rewards)
        centred = _centred(r)
        if std == "none":
            adv = centred
        else:
            ddof = 1 if std == "sample" else 0
            if scale == "group":
                s = r.std(dim=1, correction=ddof, keepdim=True)
            else:
                s = r.flatten().std(correction=ddof)
            adv = torch.where(centred == 0, 0.0, centred / (s + eps))
    return to_out(adv.flatten(), rewards)


def rloo(rewards: Tensor, group_size: int, *, valid: Tensor | None = None) -> Tensor:
    r"""REINFORCE leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    ``A_i = r_i - (1/(G-1)) sum_{j != i} r_j = G/(G-1) · (r_i - mean_g(r))``. Example, rewards
    (1, 0, 0, 0): (1, -1/3, -1/3, -1/3). A group of identical rewards gets exactly zero.

    With ``valid`` (see :func:`group_relative`) the baseline is the mean of the *other valid*
    rewards of the group, ``A_i = G_v/(G_v-1) · (r_i - mean_v(r))`` over its ``G_v`` valid
    ones; an invalid sequence, or one without another valid reward in its group, gets 0.

    Args:
        rewards: ``[N]``, each prompt's ``G`` completions contiguous; values where ``valid`` is
            False are ignored.
        group_size: ``G >= 2``.
        valid: ``[N]`` bool, True where the sequence has a reward (None: all).

    Returns:
        ``[N]`` advantages; detached.
    """
    _check_groups(rewards, group_size, "RLOO", valid)
    with torch.no_grad():
        r = _wide(rewards).view(-1, group_size)
        if valid is not None:
            centred, n = _centred_valid(r, valid.view(-1, group_size))
            adv = torch.where(n > 1, centred * n / (n - 1).clamp_min(1), 0.0)
            return to_out(adv.flatten(), rewards)
        adv = _centred(r) * (group_size / (group_size - 1))
    return to_out(adv.flatten(), rewards)


def group_std(
    rewards: Tensor, group_size: int, *, ddof: int = 1, valid: Tensor | None = None
) -> Tensor:
    """Per-prompt standard deviation of the rewards, ``[N // G]``: the spread a
    :class:`klpo.control.SpreadScaledKL` controller reads (pass its mean over prompts).

    Args:
        rewards: ``[N]``, each prompt's ``G`` completions contiguous.
        group_size: ``G >= 2``.
        ddof: 1 (sample, default) or 0 (population).
        valid: ``[N]`` bool (see :func:`group_relative`): the standard deviation of each
            group's valid rewards, ``ddof`` against their number ``G_v`` (0 when ``G_v <= ddof``).

    Returns:
        ``[N // G]``; exactly 0 for a group of identical rewards; detached.
    """
    _check_groups(rewards, group_size, "a group standard deviation", valid)
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof!r}")
    with torch.no_grad():
        r = _wide(rewards).view(-1, group_size)
        if valid is not None:
            c, n = _centred_valid(r, valid.view(-1, group_size))
            s = ((c * c).sum(dim=1) / (n.squeeze(1) - ddof).clamp_min(1)).sqrt()
            return to_out(s, rewards)
        c = _centred(r)
        s = ((c * c).sum(dim=1) / (group_size - ddof)).sqrt()
    return to_out(s, rewards)


def broadcast_to_tokens(adv: Tensor, mask: Tensor) -> Tensor:
    """Spread a per-sequence value ``[B]`` over the valid tokens of each row: ``[B, T]``.

    ``out[b, t] = adv[b]`` where ``mask[b, t]``, else 0 (the GRPO advantage is the same for every
    token of a completion, DeepSeekMath §4.1.2). Gradients pass through to ``adv`` (it is not
    detached here).
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a [B, T] bool tensor (True = the token takes part)")
    if not isinstance(adv, Tensor) or adv.shape != mask.shape[:1]:
        raise ValueError(
            f"adv must be [B] = [{mask.shape[0]}] (one value per row of mask), got "
            f"{tuple(getattr(adv, 'shape', ()))}"
        )
    return torch.where(mask, adv[:, None], 0.0)
