r"""The trust region's diagnostics: how far the trainer is from the sampler (keys ``sampler/...``).

:func:`trust_region_metrics` of pi_theta (or pi_old) against pi_behav on the sampled tokens: the
effective sample size of the importance weights (:func:`effective_sample_size`; VCPO, Huang et
al., arXiv:2602.17616), M2PO's second moment (Zheng, Zhao & Chen 2025, arXiv:2510.01161), k1/k3
and the exact KL(pi_behav ‖ pi_theta), the total variation, and the shares of tokens a clip or
mask drops; and their sufficient statistics, pooled over shares of a batch
(:func:`trust_region_stats`, :func:`merge_trust_region_stats`, :func:`finish_trust_region_stats`).
The losses these measure are in :mod:`klpo.offpolicy`, which names these functions too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from klpo._ratios import widened
from klpo._tensor import capped_exp, check_float, check_mask, check_same_shape, wide_dtype
from klpo.logprobs import exact_kl

__all__ = [
    "effective_sample_size",
    "finish_trust_region_stats",
    "merge_trust_region_stats",
    "trust_region_metrics",
    "trust_region_stats",
]


def effective_sample_size(log_w: Tensor, mask: Tensor) -> Tensor:
    r"""Kish's effective sample size of importance weights, as a fraction of the sample size.

        ESS / n = (sum_i w_i)² / (n · sum_i w_i²),    w_i = exp(log_w_i),  over the i where ``mask``

    1 when every weight is equal (on-policy), ``1/n`` when one weight carries everything. Huang
    et al. (VCPO, arXiv:2602.17616) find its drops predict collapse under asynchrony. Computed
    from ``log_w - max(log_w)`` so no weight overflows. Returns 1 for an empty sample.

    Args:
        log_w: ``[...]`` log importance weights (e.g. log pi_theta - log pi_behav per token, or
            their sum per sequence), read detached.
        mask: bool of the same shape.

    Returns:
        a 0-d tensor in (0, 1], float64 (float32 on MPS).

    Example:
        >>> import math, torch
        >>> from klpo import offpolicy
        >>> w = torch.tensor([0.0, 0.0, math.log(4.0)])  # weights 1, 1, 4: 6² / (3 · 18)
        >>> offpolicy.effective_sample_size(w, torch.ones(3, dtype=torch.bool))
        tensor(0.6667, dtype=torch.float64)
    """
    check_float("log_w", log_w)
    check_mask(mask, log_w.shape)
    with torch.no_grad():
        x = log_w.detach().to(wide_dtype(log_w))[mask]
        if x.numel() == 0:
            return torch.ones((), dtype=x.dtype, device=x.device)
        w = torch.exp(x - x.max())
        return w.sum().square() / (x.numel() * w.square().sum())


def trust_region_metrics(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    keep: Tensor | None = None,
    logits: Tensor | None = None,
    logits_behav: Tensor | None = None,
    temperature: float = 1.0,
) -> dict[str, float]:
    r"""How far the trained policy is from the sampler, over the batch's tokens; keys ``sampler/...``.

    With ``log w_t = log pi_theta(y_t) - log pi_behav(y_t)`` on the tokens where ``mask``
    (y_t ~ pi_behav), under ``no_grad``:

    - ``sampler/ess``, ``sampler/ess_seq``: :func:`effective_sample_size` of the token weights
      and of the sequence weights ``prod_t w_t`` (VCPO's collapse predictor);
    - ``sampler/m2``: the mean of ``(log w)²``, M2PO's second moment;
    - ``sampler/kl_k1``, ``sampler/kl_k3``: k1 ``-log w`` and k3 ``w - 1 - log w``, unbiased
      estimates of KL(pi_behav ‖ pi_theta) per token; ``sampler/kl_k3_max``: the largest k3
      (TRM's D_tok,max, sampled);
    - ``sampler/tv``: ``|w - 1| / 2``, an unbiased estimate of the total variation per position
      (``TV = (1/2) E_behav |w - 1|``); ``sampler/tv_binary_max``: the largest binary TV
      ``|pi_theta(y_t) - pi_behav(y_t)|`` (DPPO's statistic);
    - ``sampler/clip_frac``: the share of tokens whose ``w`` is outside ``[1 - clip_low, 1 +
      clip_high]`` (where a ratio clip to the sampler would bind);
    - ``sampler/masked_frac``: with ``keep`` (a mask from :func:`m2po_mask`, :func:`dppo_mask`
      or :func:`trm_mask`), the share of valid tokens it drops;
    - with ``logits`` and ``logits_behav`` (``[B, T, V]``, both models' logits at the positions),
      the exact values: ``sampler/kl_exact`` and ``sampler/kl_exact_max``, KL(pi_behav ‖ pi_theta)
      summed over the vocabulary (:func:`klpo.logprobs.exact_kl`, chunked), and
      ``sampler/tv_exact``, ``sampler/tv_exact_max``, ``(1/2) sum_v |pi_theta(v) - pi_behav(v)|``
      (this one holds one ``[B, T, V]`` float32 copy of each model's probabilities, float64 for
      float64 logits).

    Means over no valid token are 0, and so are maxima; the two ESS are then 1.

    Args:
        logp, logp_behav: ``[B, T]`` log-probs of the sampled tokens.
        mask: ``[B, T]`` bool.
        clip_low, clip_high: the clip range of ``sampler/clip_frac``.
        keep: optional ``[B, T]`` bool mask of the tokens a loss keeps.
        logits, logits_behav: optional ``[B, T, V]``; temperature: their sampling temperature.

    Returns:
        a dict of floats.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp = torch.tensor([[-1.0, -2.0]])  # the trainer and the sampler agree
        >>> m = offpolicy.trust_region_metrics(lp, lp, torch.ones(1, 2, dtype=torch.bool))
        >>> m["sampler/ess"], m["sampler/m2"], m["sampler/kl_k3"], m["sampler/tv"]
        (1.0, 0.0, 0.0, 0.0)
    """
    return finish_trust_region_stats(
        trust_region_stats(
            logp, logp_behav, mask, clip_low=clip_low, clip_high=clip_high, keep=keep,
            logits=logits, logits_behav=logits_behav, temperature=temperature,
        )
    )  # fmt: skip


# The sufficient statistics of trust_region_metrics, by how they pool over shares of a batch.
_SUMS = ("tokens", "seqs", "m2", "kl_k1", "kl_k3", "tv", "clip", "masked", "kl_exact", "tv_exact")
_MAXIMA = ("kl_k3_max", "tv_binary_max", "kl_exact_max", "tv_exact_max")
_ESS = (("ess", "tokens"), ("ess_seq", "seqs"))  # (prefix, its count): shift, w, w2


def trust_region_stats(
    logp: Tensor,
    logp_behav: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    keep: Tensor | None = None,
    logits: Tensor | None = None,
    logits_behav: Tensor | None = None,
    temperature: float = 1.0,
    token_kl: Tensor | None = None,
    token_tv: Tensor | None = None,
) -> dict[str, Tensor]:
    r"""The sufficient statistics of :func:`trust_region_metrics` on one share of a batch.

    ``trust_region_metrics(...)`` is ``finish_trust_region_stats(trust_region_stats(...))``, bit
    for bit. For a batch spread over processes (``torchrun``: each rank holds some rows), each
    share's statistics are merged by :func:`merge_trust_region_stats` (in any order of the
    shares, the same on every process) and then finished: the metrics of one process holding
    the whole batch, up to rounding. The statistics are 0-d float64 tensors (float32 on MPS):

    - sums over the valid tokens: their count ``tokens``, ``m2``, ``kl_k1``, ``kl_k3``, ``tv``,
      ``clip`` (the tokens outside the clip range), ``masked`` (with ``keep``), ``kl_exact`` and
      ``tv_exact`` (with the logits or ``token_kl`` / ``token_tv``); ``seqs``, the rows with a
      valid token;
    - maxima over the valid tokens (``-inf`` over none): ``kl_k3_max``, ``tv_binary_max``,
      ``kl_exact_max``, ``tv_exact_max``;
    - for Kish's ESS of the token and of the sequence weights, ``ess_shift`` (the largest log
      weight, ``-inf`` over none), ``ess_w`` = sum of ``exp(log w - shift)`` and ``ess_w2`` of
      its square (``ess_seq_*`` likewise over the rows' summed log weights): two shares merge by
      rescaling each to the larger shift, so no weight overflows.

    Args:
        as :func:`trust_region_metrics`, and ``token_kl``, ``token_tv``: optional ``[B, T]``
            exact KL(pi_behav ‖ pi_theta) and total variation per position, already computed
            (e.g. from hidden states in chunks), instead of the logits.

    Returns:
        a dict of 0-d tensors, the same keys for every share given the same options.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, behav = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.2, -1.9, -0.5]])
        >>> mask = torch.ones(1, 3, dtype=torch.bool)
        >>> whole = offpolicy.trust_region_metrics(lp, behav, mask)
        >>> parts = [offpolicy.trust_region_stats(lp[:, s], behav[:, s], mask[:, s])
        ...          for s in (slice(0, 1), slice(1, 3))]  # (a split of tokens, not of rows)
        >>> pooled = offpolicy.finish_trust_region_stats(offpolicy.merge_trust_region_stats(parts))
        >>> abs(pooled["sampler/ess"] - whole["sampler/ess"]) < 1e-15
        True
    """
    with torch.no_grad():
        lp, behav = widened(logp.detach(), logp_behav=logp_behav)
        check_mask(mask, lp.shape)
        out = _sampled_stats(lp, behav, mask, clip_low=clip_low, clip_high=clip_high)
        if keep is not None:
            check_mask(keep, lp.shape)
            out["masked"] = _masked_total((~keep).to(lp.dtype), mask)
        exact = _exact_values(
            lp, logits, logits_behav, temperature, token_kl=token_kl, token_tv=token_tv
        )
        if exact is not None:
            kl, tv = exact
            out |= {
                "kl_exact": _masked_total(kl, mask),
                "kl_exact_max": _masked_max(kl, mask),
                "tv_exact": _masked_total(tv, mask),
                "tv_exact_max": _masked_max(tv, mask),
            }
    return out


def _masked_total(x: Tensor, mask: Tensor) -> Tensor:
    """The sum of ``x`` over ``mask``, a 0-d tensor."""
    return torch.where(mask, x, 0.0).sum()


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """The largest ``x`` over ``mask``, ``-inf`` over none."""
    if x.numel() == 0:
        return torch.full((), -torch.inf, dtype=x.dtype, device=x.device)
    return torch.where(mask, x, -torch.inf).max()


def _sampled_stats(
    lp: Tensor, behav: Tensor, mask: Tensor, *, clip_low: float, clip_high: float
) -> dict[str, Tensor]:
    """:func:`trust_region_stats` from the sampled tokens' log-probs alone (the counts, the ESS
    sums, M2, k1, k3, the TV estimate, the binary TV and the clip count)."""
    log_w = lp - behav
    w = capped_exp(log_w)
    rows = mask.any(-1)
    seq_log_w = torch.where(mask, log_w, 0.0).sum(-1)
    k3 = torch.expm1(log_w.clamp(max=700.0)) - log_w
    clipped = ((w < 1.0 - clip_low) | (w > 1.0 + clip_high)).to(lp.dtype)
    return {
        "tokens": mask.sum().to(lp.dtype),
        "seqs": rows.sum().to(lp.dtype),
        **_ess_stats("ess", log_w, mask),
        **_ess_stats("ess_seq", seq_log_w, rows),
        "m2": _masked_total(log_w.square(), mask),
        "kl_k1": _masked_total(-log_w, mask),
        "kl_k3": _masked_total(k3, mask),
        "kl_k3_max": _masked_max(k3, mask),
        "tv": _masked_total(0.5 * (w - 1).abs(), mask),
        "tv_binary_max": _masked_max((lp.exp() - behav.exp()).abs(), mask),
        "clip": _masked_total(clipped, mask),
    }


def _ess_stats(prefix: str, log_w: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``shift``, ``w``, ``w2`` of :func:`effective_sample_size`'s sums over ``mask``."""
    x = log_w[mask]
    if x.numel() == 0:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return {f"{prefix}_shift": zero - torch.inf, f"{prefix}_w": zero, f"{prefix}_w2": zero}
    shift = x.max()
    w = torch.exp(x - shift)
    return {f"{prefix}_shift": shift, f"{prefix}_w": w.sum(), f"{prefix}_w2": w.square().sum()}


def _exact_values(
    lp: Tensor,
    logits: Tensor | None,
    logits_behav: Tensor | None,
    temperature: float,
    *,
    token_kl: Tensor | None,
    token_tv: Tensor | None,
) -> tuple[Tensor, Tensor] | None:
    """``[B, T]`` the exact KL(pi_behav ‖ pi_theta) and total variation in ``lp``'s dtype, from
    the two models' logits or as given, or None."""
    if (logits is None) != (logits_behav is None):
        raise ValueError(
            "give both logits= and logits_behav= ([B, T, V], the trainer's and the sampler's "
            "logits at the same positions) for the exact values, or neither"
        )
    if (token_kl is None) != (token_tv is None):
        raise ValueError(
            "give both token_kl= and token_tv= ([B, T], the exact KL and total variation per "
            "position) for the exact values, or neither"
        )
    if logits is not None and token_kl is not None:
        raise ValueError("give the exact values as logits= and logits_behav=, or as token_kl= "
                         "and token_tv=, not both")  # fmt: skip
    if token_kl is not None and token_tv is not None:
        for name, x in (("token_kl", token_kl), ("token_tv", token_tv)):
            check_float(name, x)
            check_same_shape(name, x, hint="[B, T] per position", logp=lp)
        return token_kl.detach().to(lp.dtype), token_tv.detach().to(lp.dtype)
    if logits is None or logits_behav is None:
        return None
    if logits.shape != logits_behav.shape or logits.shape[:-1] != lp.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and logits_behav {tuple(logits_behav.shape)} "
            f"must both be [B, T, V] with [B, T] = {tuple(lp.shape)}"
        )
    kl = exact_kl(logits_behav.detach(), logits.detach(), temperature=temperature)
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    p = torch.softmax(logits.detach().to(dt) / temperature, -1)
    q = torch.softmax(logits_behav.detach().to(dt) / temperature, -1)
    tv = 0.5 * (p - q).abs().sum(-1)
    return kl.to(lp.dtype), tv.to(lp.dtype)


def merge_trust_region_stats(parts: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    r"""The statistics of the union of disjoint shares of a batch (:func:`trust_region_stats`).

    Sums add, maxima take the largest, and each ESS's sums are rescaled to the largest shift
    (``w · exp(shift_i - shift)``, its square's by the square), the shares in the order given.
    Every process merging the same list gets the same bits.

    Args:
        parts: one dict per share, all with the same keys.

    Returns:
        a dict of the same keys.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
        >>> one = offpolicy.trust_region_stats(lp, lp - 0.1, mask)
        >>> float(offpolicy.merge_trust_region_stats([one, one])["tokens"])
        4.0
    """
    if not parts:
        raise ValueError("merge_trust_region_stats needs at least one share's statistics")
    keys = list(parts[0])
    for i, part in enumerate(parts):
        if list(part) != keys:
            raise ValueError(
                f"share {i} has the statistics {sorted(part)}, share 0 {sorted(keys)}: every "
                "share must be computed with the same options (keep=, the exact values)"
            )
    with torch.no_grad():
        out: dict[str, Tensor] = {}
        for key in keys:
            column = torch.stack([p[key] for p in parts])
            if key in _SUMS:
                out[key] = column.sum()
            elif key in _MAXIMA:
                out[key] = column.max()
        for prefix, _ in _ESS:
            shifts = torch.stack([p[f"{prefix}_shift"] for p in parts])
            shift = shifts.max()
            # A share with no weight (shift -inf) adds 0; so does every share when none has one.
            scale = torch.where(shifts > -torch.inf, torch.exp(shifts - shift), 0.0)
            w = torch.stack([p[f"{prefix}_w"] for p in parts])
            w2 = torch.stack([p[f"{prefix}_w2"] for p in parts])
            out |= {
                f"{prefix}_shift": shift,
                f"{prefix}_w": (w * scale).sum(),
                f"{prefix}_w2": (w2 * scale.square()).sum(),
            }
    return {key: out[key] for key in keys}


def finish_trust_region_stats(stats: Mapping[str, Tensor]) -> dict[str, float]:
    r"""The metrics of :func:`trust_region_metrics` from its statistics (one share's, or several
    merged by :func:`merge_trust_region_stats`).

    Means are the sums over the token count (0 over no token), maxima 0 over no token, and
    Kish's ESS ``w² / (n · w2)`` (1 over no weight).

    Args:
        stats: the dict of :func:`trust_region_stats` or :func:`merge_trust_region_stats`.

    Returns:
        a dict of floats, the keys ``sampler/...``.

    Example:
        >>> import torch
        >>> from klpo import offpolicy
        >>> lp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool)
        >>> stats = offpolicy.trust_region_stats(lp, lp, mask)  # the sampler agrees: ESS 1
        >>> offpolicy.finish_trust_region_stats(stats)["sampler/ess"]
        1.0
    """
    with torch.no_grad():
        n = stats["tokens"]

        def mean(key: str) -> Tensor:
            return torch.where(n > 0, stats[key] / n.clamp_min(1), 0.0)

        def biggest(key: str) -> Tensor:
            return torch.where(n > 0, stats[key], 0.0)

        def ess(prefix: str, count: Tensor) -> Tensor:
            w, w2 = stats[f"{prefix}_w"], stats[f"{prefix}_w2"]
            if not bool(count > 0):
                return torch.ones((), dtype=w.dtype, device=w.device)
            return w.square() / (count * w2)

        values: dict[str, Tensor] = {
            "sampler/ess": ess("ess", n),
            "sampler/ess_seq": ess("ess_seq", stats["seqs"]),
            "sampler/m2": mean("m2"),
            "sampler/kl_k1": mean("kl_k1"),
            "sampler/kl_k3": mean("kl_k3"),
            "sampler/kl_k3_max": biggest("kl_k3_max"),
            "sampler/tv": mean("tv"),
            "sampler/tv_binary_max": biggest("tv_binary_max"),
            "sampler/clip_frac": mean("clip"),
        }
        if "masked" in stats:
            values["sampler/masked_frac"] = mean("masked")
        if "kl_exact" in stats:
            values |= {
                "sampler/kl_exact": mean("kl_exact"),
                "sampler/kl_exact_max": biggest("kl_exact_max"),
                "sampler/tv_exact": mean("tv_exact"),
                "sampler/tv_exact_max": biggest("tv_exact_max"),
            }
        stacked = torch.stack([v.to(torch.float64).reshape(()) for v in values.values()])
    return dict(zip(values, stacked.cpu().tolist(), strict=True))
