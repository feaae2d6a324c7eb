"""Per-token terms of a batch and the objectives whose gradients are measured.

The value statistics are the lab's (:class:`klpo.lab.stats.ValueStats`), the cosine the lab's
(:func:`klpo.lab.stats.cosine`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.lab.stats import ValueStats, cosine
from klpo.logprobs import exact_kl, token_logprobs
from klpo.measure.errors import MeasureError

#: Estimators measured: every klpo estimator; the ``+`` variants and ``k3_is`` share a value with
#: their base on-policy, so their value rows repeat it while their gradients differ.
ESTIMATORS: Sequence[str] = kl.ESTIMATORS  # a live view: a registered estimator is measured too
PLACEMENTS: tuple[str, ...] = ("loss", "reward", "reward-to-go")
TARGETS: tuple[str, ...] = ("per-position θ‖ref", "per-position ref‖θ", "sequence θ‖ref")


@dataclass
class Terms:
    """Per-token quantities of one batch, ``[B, C]``; ``logp`` carries the policy's graph."""

    logp: Tensor
    logp_ref: Tensor
    exact: Tensor  # K_t = KL(pi_theta ‖ pi_ref) at the position (with graph)
    exact_rev: Tensor  # K'_t = KL(pi_ref ‖ pi_theta) at the position (with graph)
    logits: Tensor  # [B, C, V] policy logits (with graph), for `full`
    logits_ref: Tensor  # [B, C, V]
    mask: Tensor  # [B, C] bool


def token_terms(policy: Any, reference: Any, rollout: Any) -> Terms:
    """Both models on ``rollout`` (a :class:`klpo.train.rollout.samplers.Rollout`): log-probs and exact KLs."""
    from klpo.train.rollout.samplers import position_ids

    ids, att = rollout.input_ids, rollout.attention_mask
    pos = position_ids(att)
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    logits = policy(input_ids=ids, attention_mask=att, position_ids=pos).logits[
        :, p - 1 : p - 1 + c
    ]
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=att, position_ids=pos).logits
        ref = ref[:, p - 1 : p - 1 + c]
    tokens = rollout.completion_ids
    logq = torch.log_softmax(logits.float(), -1)
    logq_ref = torch.log_softmax(ref.float(), -1)
    exact_rev = (logq_ref.exp() * (logq_ref - logq)).sum(-1)
    return Terms(
        logp=token_logprobs(logits, tokens),
        logp_ref=token_logprobs(ref, tokens),
        exact=exact_kl(logits, ref),
        exact_rev=exact_rev,
        logits=logits,
        logits_ref=ref,
        mask=rollout.mask,
    )


def _estimate(name: str, t: Terms, *, detach: bool = False) -> Tensor:
    logp = t.logp.detach() if detach else t.logp
    logits = t.logits.detach() if detach else t.logits
    return kl.estimate(
        name,
        logp,
        t.logp_ref,
        logp_old=t.logp.detach(),
        logits=logits,
        logits_ref=t.logits_ref,
        mask=t.mask,
    )


# The measurement's JSON names for the lab's value statistics (ValueStats.to_dict's names).
VALUE_FIELDS: dict[str, str] = {
    "mean": "mean",
    "exact": "target",
    "bias": "bias",
    "bias_se": "stderr",
    "sd": "sd",
    "relative_sd": "sd_rel",
    "fraction_negative": "frac_negative",
    "excess_kurtosis": "excess_kurtosis",
    "max": "max",
    "p99": "p99",
}


def _stats(x: Tensor, exact: Tensor) -> dict[str, float]:
    """:meth:`klpo.lab.stats.ValueStats.of_errors` of estimates ``x`` against exact values
    ``exact`` (1-D), under the measurement's names (:data:`VALUE_FIELDS`) and with the count."""
    v = ValueStats.of_errors(x, exact)
    named = v.to_dict(tuple(VALUE_FIELDS.values()))
    return {"n": x.numel(), **{k: named[src] for k, src in VALUE_FIELDS.items()}}


def value_stats(t: Terms) -> dict[str, dict[str, dict[str, float]]]:
    """Per estimator, ``{"token": stats, "sequence": stats}`` against the exact KL it estimates."""
    with torch.no_grad():
        values = {name: _estimate(name, t, detach=True) for name in ESTIMATORS}
        return _value_stats(values, t.exact.detach(), t.exact_rev.detach(), t.mask)


def _value_stats(
    values: dict[str, Tensor], exact: Tensor, exact_rev: Tensor, m: Tensor
) -> dict[str, dict[str, dict[str, float]]]:
    """:func:`value_stats` from per-token estimates ``values[name]`` and exact KLs, ``[B, C]``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in ESTIMATORS:
        est = values[name].double()
        target = (exact_rev if kl.SPECS[name].target == kl.REF_THETA else exact).double()
        seq_est = torch.where(m, est, 0.0).sum(-1)
        seq_exact = torch.where(m, target, 0.0).sum(-1)
        out[name] = {
            "token": _stats(est[m], target[m]),
            "sequence": _stats(seq_est[m.any(-1)], seq_exact[m.any(-1)]),
        }
    return out


def _rtg(x: Tensor, mask: Tensor, *, inclusive: bool) -> Tensor:
    """sum_{t' >= t} x (inclusive) or sum_{t' > t} x over the valid tokens of each row."""
    x = torch.where(mask, x, 0.0)
    total = x.flip(-1).cumsum(-1).flip(-1)
    return total if inclusive else total - x


def _flat_grad(objective: Tensor, params: list[Tensor]) -> Tensor:
    grads = torch.autograd.grad(objective, params, retain_graph=True, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    ).double()


def _cos(a: Tensor, b: Tensor) -> float | None:
    """The lab's :func:`~klpo.lab.stats.cosine`, None (JSON null) where a vector is zero."""
    c = cosine(a, b)
    return None if math.isnan(c) else c


def objective_gradients(
    t: Terms, params: list[Tensor], *, weights: Tensor | None = None
) -> list[Tensor]:
    """The flat float64 gradient of every objective (:func:`objective_names` order) on
    ``params``, by autograd through the whole graph of ``t``: the direct way, kept as the oracle
    of the measurement's fast path (:func:`group_vectors`) and for enumerated batches.

    ``weights``: ``[B, C]`` per-token weights of every objective (default: 1/N on valid tokens).
    """
    m = t.mask
    w = torch.where(m, 1.0 / max(int(m.sum()), 1), 0.0) if weights is None else weights
    w = torch.where(m, w, 0.0).to(t.logp.dtype)

    def mean(x: Tensor) -> Tensor:
        return torch.where(m, w * x, 0.0).sum()

    logp = t.logp
    objs = [
        mean(t.exact),
        mean(t.exact_rev),
        mean(t.exact) + mean(logp * _rtg(t.exact.detach(), m, inclusive=False)),
    ]
    for name in ESTIMATORS:
        est = _estimate(name, t)
        sg = est.detach()
        objs += [mean(est), mean(sg * logp), mean(logp * _rtg(sg, m, inclusive=True))]
    zero = torch.cat([p.detach().reshape(-1) for p in params]).double() * 0
    return [_flat_grad(obj, params) if obj.requires_grad else zero for obj in objs]


def gradient_cosines(
    policy: Any, t: Terms, *, layer: str | None = None, weights: Tensor | None = None
) -> dict[str, Any]:
    """Cosines of every estimator × placement's gradient to the three targets, by autograd on
    the whole batch (no intervals: the measurement's :func:`interval_stats` gives those).

    Args:
        policy: the model whose parameters (``layer``: those whose name starts with it) are
            differentiated.
        t: :func:`token_terms` of a batch.
        weights: ``[B, C]`` per-token weights of every objective (default: 1/N on valid tokens);
            with the sampling probabilities of an enumerated batch the Monte Carlo means become
            exact expectations (the tests use this).
    """
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    if layer is not None:
        named = [(n, p) for n, p in named if n.startswith(layer)]
        if not named:
            raise MeasureError(
                f"--layer {layer!r} matches no parameter; names start like: "
                + ", ".join(n for n, _ in list(policy.named_parameters())[:4])
            )
    params = [p for _, p in named]
    grads = objective_gradients(t, params, weights=weights)
    targets = dict(zip(TARGETS, grads[: len(TARGETS)], strict=True))
    rows = []
    for (name, placement), g in zip(
        objective_names()[len(TARGETS) :], grads[len(TARGETS) :], strict=True
    ):
        row: dict[str, Any] = {"estimator": name, "placement": placement}
        for target, tg in targets.items():
            row[target] = _cos(g, tg)
        row["norm_ratio"] = float(g.norm()) / max(float(targets[TARGETS[0]].norm()), 1e-300)
        rows.append(row)
    return {
        "parameters": sum(p.numel() for p in params),
        "layer": layer,
        "target_norms": {k: float(v.norm()) for k, v in targets.items()},
        "rows": rows,
    }


# --------------------------------------------------------------------------------------------
# The objectives as per-token coefficients (the measurement's fast path).


def objective_names() -> list[tuple[str, str]]:
    """``(estimator, placement)`` of every measured objective, after the three targets
    (``("target", name)``), in the order of the measurement's vectors."""
    return [("target", t) for t in TARGETS] + [(e, p) for e in ESTIMATORS for p in PLACEMENTS]


def coefficients(
    logp: Tensor, logp_ref: Tensor, exact: Tensor, exact_rev: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Every objective's gradient as per-token coefficients on three per-token gradients.

    Each token's estimate is a function of the position's logits only through ``logp`` (the
    sampled token's log-prob; the other inputs are detached) or, for ``full``, through the exact
    K_t; the targets are functions of K_t and K'_t. So every objective J_o of the module doc (as
    a sum over tokens: the token mean's 1/N scales every vector alike and no cosine sees it) has

        grad J_o = sum_{b,t} a_o[b,t] grad logp[b,t] + c_o[b,t] grad K[b,t] + e_o[b,t] grad K'[b,t],

    with ``[a, c, e] = dJ_o / d[logp, K, K']`` taken by autograd on detached copies (chain rule;
    a clamp's zero gradient is a zero coefficient). Returns ``(coef [O, 3, B, C], values)``: the
    coefficients in :func:`objective_names` order, and each estimator's per-token value.
    """
    lp = logp.detach().double().requires_grad_(True)
    k = exact.detach().double().requires_grad_(True)
    kr = exact_rev.detach().double().requires_grad_(True)
    lr = logp_ref.detach().double()
    m = mask

    def total(x: Tensor) -> Tensor:
        return torch.where(m, x, 0.0).sum()

    objs = [
        total(k),
        total(kr),
        total(k) + total(lp * _rtg(k.detach(), m, inclusive=False)),
    ]
    values: dict[str, Tensor] = {}
    for name in ESTIMATORS:
        # kl.full (needs_logits) is exact_kl(logits, logits_ref): K_t itself
        is_exact = kl.SPECS[name].needs_logits
        est = k if is_exact else kl.estimate(name, lp, lr, logp_old=lp.detach(), mask=m)
        values[name] = est.detach()
        sg = est.detach()
        objs += [total(est), total(sg * lp), total(lp * _rtg(sg, m, inclusive=True))]
    coef = torch.zeros(len(objs), 3, *lp.shape, dtype=torch.float64)
    for i, obj in enumerate(objs):
        if not obj.requires_grad:
            continue
        grads = torch.autograd.grad(obj, (lp, k, kr), allow_unused=True, retain_graph=True)
        for j, g in enumerate(grads):
            if g is not None:
                coef[i, j] = torch.where(m, g, 0.0)
    return coef, values


# --------------------------------------------------------------------------------------------
# Which parameters: nn.Linear weights, per completion, sketched.
