r"""``klpo doctor --model DIR --reference DIR --data FILE``: the estimator lab on the user's models.

On a batch of the user's prompts, completions y ~ pi_theta are sampled (temperature 1, no top-k, as
:func:`klpo.train.rollout.samplers.generate`), and at every completion position t both models' full
next-token distributions are computed. That gives, per position and with the prefix held fixed,
the **exact** per-position KLs

    K_t = KL(pi_theta(· | y_<t) ‖ pi_ref(· | y_<t)),    K'_t = KL(pi_ref(· | y_<t) ‖ pi_theta(· | y_<t)),

against which each estimator's sampled value est_t (a function of the one sampled token) is
measured: per token, the error est_t - K_t (the estimate's sampling noise given the prefix; its
mean is the bias, exactly 0 in expectation for k1, k3; "sd", heavy-tail statistics); per sequence,
S_b = sum_t est_t against sum_t K_t, whose batch mean is the Rao-Blackwellised estimate of the
sequence KL(pi_theta ‖ pi_ref) (exact given the sampled prefixes).

Gradients, on the weights of some linear layers of the policy (:func:`choose_subset`: by
default the last decoder layer's MLP; ``--layer``), with N the number of completion tokens and
each objective a token mean:

- targets: ``per-position θ‖ref`` = grad (1/N) sum_t K_t, ``per-position ref‖θ`` = grad (1/N)
  sum_t K'_t (exact per position), and ``sequence θ‖ref`` = grad (1/N) [sum_t K_t + sum_t log
  pi_theta(y_t) · sg(sum_{t' > t} K_t')], an unbiased estimate of the gradient of the sequence
  KL(pi_theta ‖ pi_ref) (score function for how token t changes the later positions' KL);
- per estimator: ``loss`` = grad (1/N) sum_t est_t (the term differentiated, as GRPO);
  ``reward`` = grad (1/N) sum_t sg(est_t) log pi_theta(y_t) (a per-token penalty, PPO-RLHF at
  pi_old = pi_theta); ``reward-to-go`` = grad (1/N) sum_t log pi_theta(y_t) · sg(sum_{t' >= t}
  est_t') (the penalty's returns-to-go, as klpo's GRPO credits it).

How (:func:`group_vectors`): every objective's gradient is a per-token combination of grad
logp_t, grad K_t and grad K'_t (:func:`coefficients`), taken at the last hidden states by three
backward passes through the output head; one backward pass per objective takes it down to the
measured layers, whose per-completion weight gradients are sketched without being formed
(:class:`Sketch`). The completions form ``--samples`` independent groups (one completion of
every prompt each), and :func:`interval_stats` turns the groups' vectors into cosines of the
*expected* gradients and projections on them, with jackknife intervals; :func:`claim` gives
``klpo.kl.explain``'s answer for a row and :func:`verdict` whether the interval excludes it.
This is the lab on a real model (Schulman 2020; Tang & Munos 2025, arXiv:2506.09477).

Memory (:func:`memory_estimate`, printed before the work): both models' weights, the sampler's
cache, one group's ``[R, C, V]`` logits (float64) and the graph above the measured layers, and
``[O, G + R, D]`` float64 sketches; nothing of the size of the parameters is kept.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.doctor.reading import DoctorError
from klpo.logprobs import exact_kl, token_logprobs

__all__ = [
    "ESTIMATORS",
    "PLACEMENTS",
    "Terms",
    "gradient_cosines",
    "heavy_tail_notes",
    "measure",
    "read_prompts",
    "render_measurement",
    "token_terms",
    "value_stats",
]

#: Estimators measured: every klpo estimator; the ``+`` variants and ``k3_is`` share a value with
#: their base on-policy, so their value rows repeat it while their gradients differ.
ESTIMATORS: Sequence[str] = kl.ESTIMATORS  # a live view: a registered estimator is measured too
PLACEMENTS: tuple[str, ...] = ("loss", "reward", "reward-to-go")
TARGETS: tuple[str, ...] = ("per-position θ‖ref", "per-position ref‖θ", "sequence θ‖ref")


Prompt = str | tuple[tuple[str, str], ...]
"""A prompt of ``--data``: a text, or a conversation of ``(role, content)`` messages."""


def read_prompts(path: str | Path, limit: int) -> list[Prompt]:
    """Prompts from a JSONL file (a ``prompt`` field per line: a string, or a conversation as a
    list of ``{"role", "content"}`` messages, TRL's conversational format, which ``--chat``
    renders) or a text file (one per line)."""
    p = Path(path)
    if not p.is_file():
        raise DoctorError(f"--data file {str(p)!r} does not exist")
    out: list[Prompt] = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DoctorError(f"{p}:{n}: not valid JSON ({err.msg})") from None
            out.append(_jsonl_prompt(row, f"{p}:{n}"))
        else:
            out.append(line)
        if len(out) == limit:
            break
    if not out:
        raise DoctorError(f"--data file {str(p)!r} holds no prompts")
    return out


def _jsonl_prompt(row: object, where: str) -> Prompt:
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        from klpo.train.data.sources import chat_messages

        try:
            return chat_messages(prompt, where)
        except ValueError as err:
            raise DoctorError(str(err)) from None
    raise DoctorError(
        f"{where}: expected an object with a string field 'prompt' (or a list of chat messages); "
        "give JSONL with a 'prompt' per line, or a .txt file with one prompt per line"
    )


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


def _stats(x: Tensor, exact: Tensor) -> dict[str, float]:
    """Statistics of estimates ``x`` against exact values ``exact`` (1-D, float64)."""
    n = x.numel()
    err = x - exact
    mean_exact = float(exact.mean())
    sd = float(err.std(unbiased=True)) if n > 1 else 0.0
    centred = x - x.mean()
    var = float((centred**2).mean())
    kurt = float((centred**4).mean()) / var**2 - 3.0 if var > 0 else 0.0
    return {
        "n": n,
        "mean": float(x.mean()),
        "exact": mean_exact,
        "bias": float(err.mean()),
        "bias_se": sd / math.sqrt(n) if n > 0 else 0.0,
        "sd": sd,
        "relative_sd": sd / mean_exact if mean_exact > 0 else math.inf,
        "fraction_negative": float((x < 0).double().mean()),
        "excess_kurtosis": kurt,
        "max": float(x.max()),
        "p99": float(torch.quantile(x, 0.99)) if n > 1 else float(x.max()),
    }


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
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return None
    return float(a @ b) / (na * nb)


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
            raise DoctorError(
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


@dataclass
class Subset:
    """The parameters the gradients are measured on: the weights (and biases) of ``modules``."""

    names: list[str]
    modules: list[torch.nn.Linear]
    numel: int
    description: str


def choose_subset(policy: Any, layer: str | None) -> Subset:
    """The ``nn.Linear`` modules of ``policy`` whose name starts with ``layer``.

    ``None`` (the default) takes the MLP of the last decoder layer (``model.layers.{L-1}.mlp``
    for Llama-like models): the layer nearest the output, so the backward pass from the last
    hidden states is one layer deep, whatever the model's depth. ``"all"`` takes every linear
    layer of the backbone. The output head is never included (its weight is often the input
    embedding's, and the gradients are taken at the last hidden states).
    """
    head = policy.get_output_embeddings()
    linear = [
        (n, mod)
        for n, mod in policy.named_modules()
        if isinstance(mod, torch.nn.Linear) and mod is not head
    ]
    if not linear:
        raise DoctorError("the policy has no linear layer to measure gradients on")
    if layer is None:
        found = [(int(x.group(2)), x.group(1)) for n, _ in linear if (x := _LAYER.match(n))]
        if not found:
            raise DoctorError(
                "cannot tell the policy's last decoder layer (no parameter named like "
                "'layers.N.'); choose the parameters with --layer PREFIX, e.g. --layer "
                f"{linear[-1][0]}, or --layer all"
            )
        last, stem = max(found)
        prefix = f"{stem}{last}."
        mlp = [(n, mod) for n, mod in linear if n.startswith(prefix + "mlp.")]
        chosen = mlp or [(n, mod) for n, mod in linear if n.startswith(prefix)]
        where = prefix + ("mlp" if mlp else "")
        description = f"the {'MLP of the ' if mlp else ''}last decoder layer ({where})"
    elif layer == "all":
        chosen = linear
        description = "every linear layer of the backbone (all but the embeddings and norms)"
    else:
        chosen = [(n, mod) for n, mod in linear if n.startswith(layer)]
        description = f"the linear layers whose name starts with {layer!r}"
        if not chosen:
            raise DoctorError(
                f"--layer {layer!r} matches no linear layer; names look like: "
                + ", ".join(n for n, _ in linear[-3:])
                + " (or --layer all, or leave it out for the last decoder layer's MLP)"
            )
    numel = sum(
        mod.weight.numel() + (mod.bias.numel() if mod.bias is not None else 0) for _, mod in chosen
    )
    return Subset([n for n, _ in chosen], [mod for _, mod in chosen], numel, description)


_LAYER = re.compile(r"^(.*\blayers\.)(\d+)\.")

#: Default sketch size: numbers per weight matrix (64 blocks of 8 × 8).
SKETCH = 4096
_BLOCK = 8


class Sketch:
    r"""A seeded sketch of each weight matrix's gradient: blocks of Kronecker Gaussian sketches.

    A linear layer ``y = x W^T + b`` has, for one completion, the gradient ``G = sum_t u_t x_t^T``
    (``u_t`` the gradient at its output at position t). One block is ``R1 G R2^T`` with Gaussian
    ``R1 [k, out]``, ``R2 [k, in]``, which is ``sum_t (R1 u_t)(R2 x_t)^T``: computed without ever
    forming G (the per-example gradient trick, Goodfellow arXiv:1510.01799). With entries of
    variance 1/(k m) and 1/k, E[R1^T R1] E[...] makes every inner product of the m blocks'
    concatenation unbiased for the inner product of the gradients (a Johnson–Lindenstrauss
    projection with Kronecker-structured rows: Jin, Kolda & Ward, arXiv:1909.04801; Rakhshan &
    Rabusseau, arXiv:2003.05101), so cosines are preserved up to a noise that falls as
    1/sqrt(k m): m independent small blocks beat one large one at the same size k² m (the tests
    measure it against the exact gradients). ``dim = 0`` keeps the gradients exact (small
    layers only). A bias, where there is one, is sketched by the stacked ``R1`` alone.
    """

    def __init__(self, modules: list[torch.nn.Linear], dim: int, seed: int) -> None:
        self.k = _BLOCK if dim else 0
        self.m = max(1, dim // _BLOCK**2) if dim else 0
        self.mats: list[tuple[Tensor, Tensor] | None] = []
        gen = torch.Generator().manual_seed(seed)
        k, m = self.k, self.m
        for mod in modules:
            if not dim:
                self.mats.append(None)
                continue
            out, inp = mod.weight.shape
            r1 = torch.randn(m * k, out, generator=gen, dtype=torch.float64) / math.sqrt(k * m)
            r2 = torch.randn(m * k, inp, generator=gen, dtype=torch.float64) / math.sqrt(k)
            self.mats.append((r1, r2))
        self.dims = [
            (mod.weight.numel() if not dim else m * k * k)
            + (0 if mod.bias is None else (mod.bias.numel() if not dim else m * k))
            for mod in modules
        ]

    @property
    def dim(self) -> int:
        return sum(self.dims)

    def inputs(self, i: int, x: Tensor) -> Tensor:
        """Module ``i``'s inputs ``[N, in]`` (N tokens), sketched: ``[N, m, k]`` (or as they are)."""
        x = x.double()
        mats = self.mats[i]
        return x if mats is None else (x @ mats[1].T).unflatten(-1, (self.m, self.k))

    def rows(self, i: int, xs: Tensor, u: Tensor, row: Tensor, n: int, bias: bool) -> Tensor:
        """``[n, dims[i]]``: each row's (sketched) gradient of module ``i``'s weight and bias,
        from the tokens' inputs ``xs`` (:meth:`inputs`), their output gradients ``u [N, out]``
        and their rows ``row [N]``."""
        u = u.double()
        mats = self.mats[i]
        if mats is None:
            per = torch.einsum("no,ni->noi", u, xs).flatten(1)
            us = u
        else:
            us = u @ mats[0].T
            per = torch.einsum("nmk,nml->nmkl", us.unflatten(-1, (self.m, self.k)), xs).flatten(1)
        parts = [per] + ([us] if bias else [])
        tok = torch.cat(parts, 1)
        return torch.zeros(n, tok.shape[1], dtype=tok.dtype).index_add_(0, row, tok)


# --------------------------------------------------------------------------------------------
# Intervals: U-statistics over independent groups of completions, jackknifed.


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (Simpson's rule on the
    density and bisection; no scipy)."""
    if df < 1 or not 0.5 < p < 1:
        raise ValueError(f"t_quantile needs df >= 1 and 0.5 < p < 1, got df={df}, p={p}")
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:  # P(T <= x) for x >= 0, after the substitution x = tan(s)
        n = 400
        a, b = 0.0, math.atan(x)
        h = (b - a) / n
        total = 0.0
        for i in range(n + 1):
            s = a + i * h
            w = 1 if i in (0, n) else (4 if i % 2 else 2)
            c = math.cos(s)
            total += w * math.exp(log_c - (df + 1) / 2 * math.log1p(math.tan(s) ** 2 / df)) / c**2
        return 0.5 + total * h / 3

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def _u_stats(gram: Tensor) -> tuple[Tensor, Tensor]:
    """From ``gram [P, G, G]`` (``<a_k, b_l>`` for P pairs and G groups): the U-statistic
    ``sum_{k != l} <a_k, b_l> / (G (G - 1))``, unbiased for ``<E a, E b>``, on all G groups
    ``[P]`` and leaving out each group in turn ``[P, G]``."""
    g = gram.shape[-1]
    total = gram.sum((-1, -2))
    diag = gram.diagonal(dim1=-2, dim2=-1)
    full = (total - diag.sum(-1)) / (g * (g - 1))
    out_k = total[:, None] - gram.sum(-1) - gram.sum(-2) + diag  # the sum without group k
    loo = (out_k - (diag.sum(-1, keepdim=True) - diag)) / ((g - 1) * (g - 2))
    return full, loo


def interval_stats(
    vectors: Tensor, pairs: list[tuple[int, int]], level: float = 0.95
) -> list[dict]:
    r"""Cosines and projections with confidence intervals, for each pair ``(a, b)`` of vectors.

    ``vectors [O, G, D]`` holds, for each objective, G independent and identically distributed
    replicates (each group of completions: one completion of every prompt). The estimands are
    properties of the expected vectors mu_a = E[a_k]:

    - the cosine rho = <mu_a, mu_b> / (|mu_a| |mu_b|), estimated by rho_hat = U_ab /
      sqrt(U_aa U_bb) with U the unbiased U-statistics of :func:`_u_stats`. The plain cosine of
      the sums (also returned, ``cos_plain``) has |sum|² = G² |mu|² + G tr(Cov) in expectation:
      noise inflates the norms and pulls it towards 0 (or, where the noises correlate, anywhere),
      so it is no estimate of rho; U_aa removes the noise term. rho_hat is undefined (None) where
      U_aa <= 0: the expected vector is not told from zero.
    - the projection beta = <mu_a, mu_b> / |mu_b|², estimated by U_ab / U_bb: 1 where the
      expected gradients are equal, 0 where mu_a = 0. Unlike the cosine it is smooth at both
      exact answers, so its interval is the one the verdicts use.

    Intervals: delete-one-group jackknife standard errors (Efron & Stein 1981; the jackknife of
    a smooth function of U-statistics, Arvesen 1969), ``estimate ± t_{G-1, (1+level)/2} · se``.
    Needs G >= 3.
    """
    g = vectors.shape[1]
    if g < 3:
        raise ValueError(f"intervals need at least 3 groups of completions, got {g}")
    need = sorted({x for a, b in pairs for x in ((a, b), (a, a), (b, b))})
    index = {p: i for i, p in enumerate(need)}
    gram = torch.stack([vectors[a] @ vectors[b].T for a, b in need])
    full, loo = _u_stats(gram)
    sums = vectors.sum(1)
    tq = t_quantile((1 + level) / 2, g - 1)

    def jack(est: Tensor, reps: Tensor) -> float:
        ok = torch.isfinite(reps)
        if not bool(ok.all()):
            return math.inf
        return float(((g - 1) / g * ((reps - reps.mean()) ** 2).sum()).sqrt())

    out = []
    for a, b in pairs:
        ab, aa, bb = full[index[a, b]], full[index[a, a]], full[index[b, b]]
        lab, laa, lbb = loo[index[a, b]], loo[index[a, a]], loo[index[b, b]]
        na, nb = float(sums[a].norm()), float(sums[b].norm())
        row: dict[str, Any] = {
            "cos_plain": float(sums[a] @ sums[b]) / (na * nb) if na > 0 and nb > 0 else None,
            "cos": None,
            "cos_se": None,
            "beta": None,
            "beta_se": None,
            "norm_ratio": float(aa / bb).__pow__(0.5) if bb > 0 and aa > 0 else None,
        }
        if aa > 0 and bb > 0:
            rho = ab / (aa * bb).sqrt()
            reps = torch.where(
                (laa > 0) & (lbb > 0), lab / (laa * lbb).clamp(min=1e-300).sqrt(), math.nan
            )
            row["cos"], row["cos_se"] = float(rho), jack(rho, reps)
        if bb > 0:
            beta = ab / bb
            reps = torch.where(lbb > 0, lab / lbb.clamp(min=1e-300), math.nan)
            row["beta"], row["beta_se"] = float(beta), jack(beta, reps)
        row["half_width"] = {
            k: (tq * row[f"{k}_se"] if row[f"{k}_se"] is not None else None)
            for k in ("cos", "beta")
        }
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# What each objective should follow: klpo.kl.explain's answers, as a projection's exact value.


def claim(estimator: str, placement: str) -> tuple[str, int, float] | None:
    """``(what, target index, exact projection)`` for a row whose expected gradient is known.

    From :func:`klpo.kl.explain` (on-policy): ``loss`` and ``reward`` as it answers them (its
    ``reward`` is the doctor's per-token penalty), a zero gradient as a projection of 0 on the
    per-position KL(pi_theta ‖ pi_ref) gradient. ``reward-to-go``: E[sum_t grad logp_t
    sum_{t' >= t} est_t'] is the sequence KL's gradient exactly when the t' = t term gives grad
    K_t (the reward's answer is grad KL(pi_theta ‖ pi_ref)) and the later terms' expectations are
    K_t' (the value is unbiased for it), as for k1 (the policy-gradient theorem with the
    log-ratio as the return). None for the rest ("other (biased)").
    """
    place = "reward" if placement == "reward-to-go" else placement
    ex = kl.explain(estimator, place)  # type: ignore[arg-type]
    if placement == "reward-to-go":
        if ex.gradient == kl.GRAD_THETA_REF and ex.unbiased and ex.estimates == kl.THETA_REF:
            return ("grad seq KL(θ‖ref)", 2, 1.0)
        return None
    if ex.gradient == kl.GRAD_THETA_REF:
        return ("grad KL(θ‖ref)", 0, 1.0)
    if ex.gradient == kl.GRAD_REF_THETA:
        return ("grad KL(ref‖θ)", 1, 1.0)
    if ex.gradient == kl.GRAD_ZERO:
        return ("zero", 0, 0.0)
    return None


def verdict(beta: float | None, half: float | None, exact: float, n: int) -> dict[str, Any]:
    """Whether a projection's interval excludes its exact value, and the completions that would
    tell its distance from noise: the half-width falls as 1/sqrt(n), so ``n (half / |beta -
    exact|)²`` completions give an interval as wide as the distance seen now."""
    if beta is None or half is None or not math.isfinite(half):
        return {"status": "undefined", "decide_at": None}
    dist = abs(beta - exact)
    tol = half + 1e-9 * max(1.0, abs(exact))  # float64 rounding of an exact equality
    if dist > tol:
        return {"status": "inconsistent", "decide_at": None}
    decide = None if dist == 0 else math.ceil(n * (half / dist) ** 2 - 1e-9)
    return {"status": "consistent", "decide_at": decide}


# --------------------------------------------------------------------------------------------
# The memory the measurement will take, said before it starts.


def weights_bytes(path: str) -> int | None:
    """Bytes of a model directory's weights once loaded in float32 (from the safetensors
    headers; None where there are none)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    numel = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                numel += math.prod(st.get_slice(key).get_shape())
    return 4 * numel


def available_bytes() -> int | None:
    """Memory available to a new allocation (``MemAvailable``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``), or None where unknown."""
    import os

    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_estimate(
    config: Any,
    *,
    weights: int,
    rows: int,
    group_rows: int,
    prompt_tokens: int,
    new_tokens: int,
    subset: Subset,
    depth: int,
    dim: int,
    groups: int,
) -> dict[str, int]:
    """Bytes, by part, that the measurement holds at its peak beyond the process itself.

    ``weights``: both models; ``sampling``: the key/value cache of ``rows`` sequences and the
    prompt's logits (float32, as the sampler's first forward returns them for every prompt
    position); ``pass``: one group's two ``[R, C, V]`` float64 logits with their softmax
    copies and gradients (eight of that size), the graph above the first measured layer (``depth`` decoder
    layers of hidden states, about 12 ``[R, T, H]`` and 4 ``[R, T, I]`` each) and the measured
    layers' inputs and outputs; ``store``: the (sketched) gradient of every objective for each
    group, and for each completion of the group in hand, float64.
    """
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv = int(getattr(config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    seq = prompt_tokens + new_tokens
    sampling = 4 * rows * seq * layers * 2 * kv * head_dim + 2 * 4 * rows * prompt_tokens * vocab
    logits = 8 * 8 * group_rows * new_tokens * vocab
    graph = 4 * group_rows * seq * depth * (12 * hidden + 4 * inter)
    io = 4 * group_rows * seq * sum(m.in_features + m.out_features for m in subset.modules)
    store = 8 * len(objective_names()) * dim * (groups + group_rows)
    return {
        "weights": weights,
        "sampling": sampling,
        "pass": logits + graph + io,
        "store": store,
        "total": weights + max(sampling, logits + graph + io) + store,
    }


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


# --------------------------------------------------------------------------------------------
# One group of completions through both models: its rows' sketched gradients.


def _logits(head: Any, hidden: Tensor) -> Tensor:
    """The model's logits from its last hidden states ``[..., H]``: one 2-D matmul (a batched
    one would copy the ``[V, H]`` weight per row in its backward pass)."""
    z = (hidden.flatten(0, -2) @ head.weight.T).unflatten(0, hidden.shape[:-1])
    if head.bias is not None:
        z = z + head.bias
    return z if head.transform is None else head.transform.apply(z)


def group_vectors(
    policy: Any,
    reference: Any,
    rollout: Any,
    rows: Tensor,
    subset: Subset,
    sketch: Sketch,
    prefix: tuple[Any, Any] | None = None,
) -> tuple[Tensor, dict[str, Tensor], dict[str, int]]:
    """``(vectors [O, R, D], per-token arrays [R, C], sizes)`` for ``rows`` of ``rollout``.

    ``prefix``: both models' key/value caches of the prompts but their last token, one row per
    row of ``rows`` (:func:`prompt_caches`); the forward passes then run on the completion
    window only. Exact where no measured layer's output at a prompt position reaches the
    completions' hidden states (:func:`prompt_free`).

    The policy runs with its weights frozen and the measured layers' outputs made to require a
    gradient (forward hooks), so autograd keeps only the graph above them; the output head is
    applied to the last hidden states of the completion positions only (:mod:`klpo.heads`).
    Three backward passes through the head give each token's grad logp, grad K and grad K' at
    its hidden state; each objective's gradient at the hidden states is their combination with
    :func:`coefficients`, sent down to the measured layers by one backward pass each.
    """
    window = _Window.of(rollout, rows, prefix is not None)
    h, seen = _hooked_hidden(policy, window, prefix[0] if prefix else None, subset)
    with torch.no_grad():
        hr = _hidden(reference, window, prefix[1] if prefix else None)
    tokens, mask = rollout.completion_ids[rows], rollout.mask[rows]
    arrays, basis, sizes = _token_basis(policy, reference, h, hr, tokens, mask)
    coef, values = coefficients(
        arrays["logp"], arrays["logp_ref"], arrays["exact"], arrays["exact_rev"], mask
    )
    vectors = _sent_down(h, seen, window, coef, basis, subset, sketch, len(rows))
    arrays = {k: v.detach() for k, v in arrays.items()}
    return vectors, {**arrays, **{f"value:{k}": v for k, v in values.items()}}, sizes


@dataclass(frozen=True)
class _Window:
    """The rows a group's forward passes run on: ids, mask and positions, the prompt width
    ``p``, the completion width ``c``, and where the passes start (``p - 1`` behind a cache)."""

    ids: Tensor
    att: Tensor
    pos: Tensor
    p: int
    c: int
    start: int

    @classmethod
    def of(cls, rollout: Any, rows: Tensor, cached: bool) -> _Window:
        from klpo.train.rollout.samplers import position_ids

        ids, att = rollout.input_ids[rows], rollout.attention_mask[rows]
        p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
        return cls(ids, att, position_ids(att), p, c, p - 1 if cached else 0)


def _hidden(model: Any, w: _Window, cache: Any) -> Tensor:
    """The last hidden states at the completion positions (behind the prompts' cache if any)."""
    from klpo.heads import backbone, last_hidden
    from klpo.train.models.load import cache_kwargs

    if cache is None:
        return last_hidden(model, w.ids, w.att, w.pos)[:, w.p - 1 : w.p - 1 + w.c]
    base = backbone(model)
    out = base(
        input_ids=w.ids[:, w.start :],
        attention_mask=w.att,
        position_ids=w.pos[:, w.start :],
        use_cache=True,
        **cache_kwargs(base, copy.deepcopy(cache)),
    )
    return out.last_hidden_state[:, : w.c]


def _hooked_hidden(
    policy: Any, w: _Window, cache: Any, subset: Subset
) -> tuple[Tensor, dict[int, tuple[Tensor, Tensor]]]:
    """The policy's hidden states, with each measured layer's input and output (made to require
    a gradient) caught by a forward hook."""
    seen: dict[int, tuple[Tensor, Tensor]] = {}

    def hook(i: int):
        def fn(_mod: Any, args: tuple[Tensor, ...], out: Tensor) -> None:
            if not out.requires_grad:
                out.requires_grad_(True)
            seen[i] = (args[0].detach(), out)

        return fn

    handles = [m.register_forward_hook(hook(i)) for i, m in enumerate(subset.modules)]
    try:
        h = _hidden(policy, w, cache)
    finally:
        for handle in handles:
            handle.remove()
    if len(seen) != len(subset.modules) or not h.requires_grad:
        raise DoctorError(
            "the measured layers did not all run in the policy's forward; choose others with --layer"
        )
    return h, seen


def _token_basis(
    policy: Any, reference: Any, h: Tensor, hr: Tensor, tokens: Tensor, mask: Tensor
) -> tuple[dict[str, Tensor], list[Tensor], dict[str, int]]:
    """Per-token log-probs and exact KLs, and grad logp, grad K, grad K' at the hidden states."""
    from klpo.heads import checked_head

    head, head_ref = checked_head(policy), checked_head(reference)
    with torch.no_grad():
        logits_ref = _logits(head_ref, hr).double()
    leaf = h.detach().requires_grad_(True)
    # float64 from the logits on: a KL gradient that is zero in exact arithmetic (the policy is
    # the reference) stays at float64 rounding, and the three backward passes are cheap.
    logits = _logits(head, leaf).double()
    logp = token_logprobs(logits, tokens)
    exact = exact_kl(logits, logits_ref)
    lq, lr = torch.log_softmax(logits, -1), torch.log_softmax(logits_ref, -1)
    exact_rev = (lr.exp() * (lr - lq)).sum(-1)
    basis = []
    for i, x in enumerate((logp, exact, exact_rev)):
        (g,) = torch.autograd.grad(torch.where(mask, x, 0.0).sum(), leaf, retain_graph=i < 2)
        basis.append(g.double())
    arrays = {
        "logp": logp,
        "logp_ref": token_logprobs(logits_ref, tokens),
        "exact": exact,
        "exact_rev": exact_rev,
    }
    return arrays, basis, {"logits": logits.nbytes}


def _sent_down(
    h: Tensor,
    seen: dict[int, tuple[Tensor, Tensor]],
    w: _Window,
    coef: Tensor,
    basis: list[Tensor],
    subset: Subset,
    sketch: Sketch,
    n_rows: int,
) -> Tensor:
    """Each objective's gradient at the hidden states sent down to the measured layers by one
    backward pass, sketched: ``[O, R, D]``."""
    # Only the tokens whose measured layers' outputs reach the completions' hidden states are
    # sketched (for the last layer's MLP, the completion positions): found by one backward pass
    # of a random direction, whose zeros are the graph's structural zeros; padding is left out.
    ys = [seen[i][1] for i in range(len(subset.modules))]
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(0), dtype=h.dtype)
    reach = torch.autograd.grad(h, ys, grad_outputs=probe, retain_graph=True)
    used = w.att[:, w.start :].bool() & torch.stack([(g != 0).any(-1) for g in reach]).any(0)
    row = used.nonzero()[:, 0]
    xs = [sketch.inputs(i, seen[i][0][used]) for i in range(len(subset.modules))]
    vectors = torch.zeros(coef.shape[0], n_rows, sketch.dim, dtype=torch.float64)
    for o in range(coef.shape[0]):
        if not bool(coef[o].any()):
            continue
        u = sum(coef[o, j][..., None] * basis[j] for j in range(3))
        grads = torch.autograd.grad(h, ys, grad_outputs=u.to(h.dtype), retain_graph=True)
        parts = [
            sketch.rows(i, xs[i], g[used], row, n_rows, subset.modules[i].bias is not None)
            for i, g in enumerate(grads)
        ]
        vectors[o] = torch.cat(parts, 1)
    return vectors


def prompt_free(policy: Any, rollout: Any, subset: Subset) -> bool:
    """Whether no measured layer's output at a prompt position (but the last) reaches the
    completions' hidden states: true for the last decoder layer's MLP (position-wise), false as
    soon as an attention layer is measured or anything below the last layer. Found on one
    completion by one backward pass of a random direction (its zeros are structural)."""
    from klpo.heads import last_hidden
    from klpo.train.rollout.samplers import position_ids

    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    ids, att = rollout.input_ids[:1], rollout.attention_mask[:1]
    seen: list[Tensor] = []

    def fn(_mod: Any, _args: Any, out: Tensor) -> None:
        if not out.requires_grad:
            out.requires_grad_(True)
        seen.append(out)

    handles = [m.register_forward_hook(fn) for m in subset.modules]
    try:
        h = last_hidden(policy, ids, att, position_ids(att))[:, p - 1 : p - 1 + c]
    finally:
        for handle in handles:
            handle.remove()
    if not h.requires_grad:
        return False
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(0), dtype=h.dtype)
    reach = torch.autograd.grad(h, seen, grad_outputs=probe, allow_unused=True)
    return all(g is None or not bool((g[:, : p - 1] != 0).any()) for g in reach)


def prompt_caches(model: Any, rollout: Any, rows: Tensor) -> Any:
    """The key/value cache of ``model`` on the prompts of ``rows`` but their last token (no
    gradient), or None where the model's cache cannot be reused
    (:func:`klpo.train.models.cache.cache_support`) or the prompts are one token long."""
    from klpo.heads import backbone
    from klpo.train.models.cache import cache_support
    from klpo.train.models.load import output_cache
    from klpo.train.rollout.samplers import position_ids

    p = rollout.prompt_ids.shape[1]
    if p < 2 or not cache_support(model).shared:
        return None
    att = rollout.prompt_mask[rows].long()
    base = backbone(model)
    with torch.no_grad():
        out = base(
            input_ids=rollout.prompt_ids[rows, : p - 1],
            attention_mask=att[:, : p - 1],
            position_ids=position_ids(att)[:, : p - 1],
            use_cache=True,
        )
    return output_cache(out)


#: Relative size below which an objective's vectors are float32 rounding, not a gradient.
FLOOR = 1e-6


def rounding_floor(vectors: Tensor) -> Tensor:
    """``vectors [O, G, D]`` with every objective whose vectors all lie below ``FLOOR`` times the
    scale of a gradient set to zero. The scale is the root mean square norm of the score
    function's vectors (sum_t grad logp_t: k1 in the loss), which are O(1) per token whatever the
    KL; an objective that is zero in exact arithmetic (every gradient of the KL where the policy
    is the reference) comes out of the float64 softmax at about 1e-14 of it, and a cosine of two
    rounding errors means nothing."""
    k1 = objective_names().index(("k1", "loss"))
    scale = float(vectors[k1].norm(dim=-1).pow(2).mean().sqrt())
    small = vectors.norm(dim=-1).amax(-1) <= FLOOR * scale
    return torch.where(small[:, None, None], 0.0, vectors)


# --------------------------------------------------------------------------------------------
# The tokenizer checks and the prompts' rule.


def _check_same_tokenizer(tok: Any, model: str, reference: str) -> None:
    """The trainer's check (``klpo.train.preflight.check_same_tokenizer``) on the doctor's pair:
    a reference with its own tokenizer must map every token to the policy's id."""
    from klpo.train.config import ConfigError
    from klpo.train.models.load import load_tokenizer
    from klpo.train.preflight import check_same_tokenizer

    try:
        other = load_tokenizer(reference, "--reference")
    except (FileNotFoundError, OSError, ValueError):
        return  # no tokenizer files beside the reference: its ids are the policy's
    try:
        check_same_tokenizer(tok, model, other, reference, "reference")
    except ConfigError as err:
        text = str(err).replace("model.reference", "--reference").replace("model.policy", "--model")
        raise DoctorError(text.replace("give a reference", "give a --reference")) from None


def render_prompts(
    tok: Any, texts: Sequence[Prompt], *, chat: bool, system_prompt: str | None = None
) -> list[str]:
    """The prompts as the policy sees them: with ``chat``, rendered by the tokenizer's chat
    template as the trainer renders ``data.chat`` prompts
    (:func:`klpo.train.data.sources.render_chat`: a text is one user message, a conversation is
    kept; ``system_prompt`` first unless the conversation starts with one; the assistant's
    generation prompt); else as they are (a conversation is then an error naming ``--chat``)."""
    if not chat:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise DoctorError(
                    f"--data prompt {i + 1} is a list of chat messages; add --chat to render "
                    "them with the tokenizer's chat template"
                )
        return list(texts)  # type: ignore[arg-type]
    from klpo.train.data.sources import Example, render_chat

    try:
        examples = [
            Example(t, "", where=f"prompt {i + 1}")
            if isinstance(t, str)
            else Example("", "", messages=t, where=f"prompt {i + 1}")
            for i, t in enumerate(texts)
        ]
        done = render_chat(examples, tok, chat=True, system_prompt=system_prompt)
    except ValueError as err:
        raise DoctorError(str(err).replace("data.chat=true", "--chat")) from None
    return [e.prompt for e in done]


def _prompt_codec(tok: Any, policy: Any, texts: list[str], data: str, chat: bool = False) -> Any:
    """The trainer's rule for prompts (:mod:`klpo.train.models.tokens`): plain prompts get the
    tokenizer's special tokens once, chat-rendered ones none (the template wrote them); the stop
    set of the tokenizer and the model's generation config; every prompt checked for a doubled
    BOS."""
    from klpo.train.config import ConfigError
    from klpo.train.models.tokens import Codec, check_single_bos

    try:
        codec = Codec.plain(tok, policy)
        if chat:
            codec = Codec(tok, codec.stop, chat=True)
        for i, (text, ids) in enumerate(zip(texts, codec.ids(texts), strict=True)):
            where = f"--data {data}, prompt {i + 1}"
            check_single_bos(codec, ids, where, text, fix="remove it from the start of the text")
    except ConfigError as err:
        raise DoctorError(str(err)) from None
    return codec


def _say(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def measure(
    model: str,
    reference: str,
    data: str,
    *,
    layer: str | None = None,
    sketch: int = SKETCH,
    prompts: int = 8,
    samples: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    chat: bool = False,
    system_prompt: str | None = None,
    highlight: list[tuple[str, str]] | None = None,
    say: Any = _say,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Sample on the user's prompts and measure every estimator against the exact KL (module doc).

    ``say`` gets the lines printed before the work (the parameters measured, the memory
    estimate); the progress bar (:class:`klpo.train.runtime.progress.Progress`) goes to stderr.

    Raises:
        DoctorError: bad options, unloadable models, different vocabularies, or a memory
            estimate beyond the memory available (with the options that lower it).
    """
    import resource

    _check_options(prompts, samples, max_new_tokens, sketch)
    texts = read_prompts(data, prompts)
    if not chat:  # a conversation needs --chat: said before any model loads
        render_prompts(None, texts, chat=False)
    free = available_bytes()
    policy, ref, tok = _load_pair(model, reference, free)
    rendered = render_prompts(tok, texts, chat=chat, system_prompt=system_prompt)
    codec = _prompt_codec(tok, policy, rendered, data, chat=chat)
    subset = choose_subset(policy, layer)
    sk = Sketch(subset.modules, sketch, seed)
    run = _Run(policy, ref, tok, rendered, codec, subset, sk, samples, max_new_tokens)
    est = _memory_plan(run, free, sketch, chat, say)
    rollout, vectors, cat, sizes = _sample_and_sketch(run, seed, show_progress)
    mask = rollout.mask
    values = {n: cat[f"value:{n}"] for n in ESTIMATORS}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "model": model,
        "reference": reference,
        "data": data,
        "seed": seed,
        "chat": chat,
        "sequences": int(mask.shape[0]),
        "groups": samples,
        "tokens": int(mask.sum()),
        "exact": _exact_means(cat, mask),
        "values": _value_stats(values, cat["exact"], cat["exact_rev"], mask),
        "gradients": {
            "subset": subset.description,
            "modules": subset.names,
            "parameters": subset.numel,
            "sketch": sketch,
            "dim": sk.dim,
            "rows": gradient_rows(vectors, run.rows),
        },
        "memory": {
            "estimate": est,
            "measured": {
                "weights": run.weights,
                "store": vectors.nbytes + sizes.get("group_vectors", 0),
                "logits": sizes.get("logits", 0),
                "peak_rss": peak,
            },
        },
        "highlight": [list(h) for h in (highlight or [])],
    }


def _exact_means(cat: dict[str, Tensor], mask: Tensor) -> dict[str, float]:
    """The exact KLs of the sample: per token both ways, and per sequence."""
    return {
        "token_mean_kl_theta_ref": float(cat["exact"][mask].mean()),
        "token_mean_kl_ref_theta": float(cat["exact_rev"][mask].mean()),
        "sequence_mean_kl_theta_ref": float(torch.where(mask, cat["exact"], 0.0).sum(-1).mean()),
    }


def _check_options(prompts: int, samples: int, max_new_tokens: int, sketch: int) -> None:
    for flag, value, least in (
        ("--prompts", prompts, 1),
        ("--samples", samples, 3),
        ("--max-new-tokens", max_new_tokens, 1),
        ("--sketch", sketch, 0),
    ):
        if value < least:
            why = " (the intervals need three groups of completions)" if flag == "--samples" else ""
            raise DoctorError(f"{flag} must be at least {least}, got {value}{why}")


def _load_pair(model: str, reference: str, free: int | None) -> tuple[Any, Any, Any]:
    """The policy and the reference (frozen, in eval mode) and the policy's tokenizer, checked
    to share a vocabulary and to fit in memory."""
    from klpo.train.models.load import load_causal_lm, load_tokenizer

    on_disk = [weights_bytes(model), weights_bytes(reference)]
    if free is not None and all(b is not None for b in on_disk) and sum(on_disk) > free:
        raise DoctorError(
            f"the two models need {_gb(sum(on_disk))} in float32 and {_gb(free)} is available"
        )
    try:
        policy = load_causal_lm(model)
        ref = load_causal_lm(reference)
        tok = load_tokenizer(model)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise DoctorError(str(err)) from None
    if policy.config.vocab_size != ref.config.vocab_size:
        raise DoctorError(
            f"--model has a vocabulary of {policy.config.vocab_size} tokens and --reference "
            f"{ref.config.vocab_size}: the KL needs the same tokenizer; give the reference the "
            "policy was trained from"
        )
    _check_same_tokenizer(tok, model, reference)
    for m in (policy, ref):
        m.eval()
        m.requires_grad_(False)
    return policy, ref, tok


@dataclass
class _Run:
    """What one measurement samples and sketches."""

    policy: Any
    ref: Any
    tok: Any
    rendered: list[str]
    codec: Any
    subset: Subset
    sketch: Sketch
    samples: int
    max_new_tokens: int

    @property
    def n_prompts(self) -> int:
        return len(self.rendered)

    @property
    def rows(self) -> int:
        return self.n_prompts * self.samples

    @property
    def weights(self) -> int:
        return sum(
            p.numel() * p.element_size() for m in (self.policy, self.ref) for p in m.parameters()
        )

    @property
    def depth(self) -> int:
        """Decoder layers from the first measured one to the output (the backward's depth)."""
        names = [n for n, _ in self.policy.named_modules()]
        first = min(names.index(n) for n in self.subset.names)
        layers = [int(x.group(2)) for n in names if (x := _LAYER.match(n))]
        at = _LAYER.match(names[first])
        return (max(layers) - int(at.group(2)) + 1) if (layers and at) else len(layers) or 1


def _memory_plan(run: _Run, free: int | None, sketch: int, chat: bool, say: Any) -> dict[str, Any]:
    """The memory estimate, said with what is measured; refused beyond what is available."""
    sk = run.sketch
    prompt_tokens = int(run.codec.encode(run.rendered)["input_ids"].shape[1])
    est = memory_estimate(
        run.policy.config,
        weights=run.weights,
        rows=run.rows,
        group_rows=run.n_prompts,
        prompt_tokens=prompt_tokens,
        new_tokens=run.max_new_tokens,
        subset=run.subset,
        depth=run.depth,
        dim=sk.dim,
        groups=run.samples,
    )
    sketched = f"sketched to {sk.dim:,} numbers (--sketch {sketch})" if sketch else "exact"
    say(
        f"measuring gradients on {run.subset.description}: {run.subset.numel:,} parameters, "
        f"{sketched}; {run.rows} completions ({run.n_prompts} prompts × {run.samples}) of up to "
        f"{run.max_new_tokens} tokens" + (", chat template" if chat else "")
    )
    resident = resident_bytes()
    more = max(est["sampling"], est["pass"]) + est["store"]
    if resident is not None:
        est["resident"], est["peak"] = resident, resident + more
    avail = f"; {_gb(free)} available" if free is not None else ""
    now = f"{_gb(resident)} now, with both models loaded" if resident else "the process"
    say(
        f"memory: about {_gb(est.get('peak', est['total']))} at the peak: {now} (weights "
        f"{_gb(est['weights'])}), then sampling +{_gb(est['sampling'])} or one group "
        f"+{_gb(est['pass'])}, and gradients +{_gb(est['store'])}{avail}"
    )
    if free is not None and more > free:
        raise DoctorError(
            f"the measurement needs about {_gb(more)} more and {_gb(free)} is available; lower "
            "it with fewer --prompts, --samples or --max-new-tokens, a smaller --sketch, or "
            "fewer parameters (--layer)"
        )
    return est


def _sample_and_sketch(
    run: _Run, seed: int, show_progress: bool
) -> tuple[Any, Tensor, dict[str, Tensor], dict[str, int]]:
    """Sample the completions, then sketch every objective's gradient group by group:
    ``(rollout, vectors [O, groups, D], per-token arrays in the rollout's row order, sizes)``."""
    from klpo.train.rollout.samplers import generate
    from klpo.train.runtime.progress import Progress

    samples, n_prompts = run.samples, run.n_prompts
    vectors = torch.zeros(len(objective_names()), samples, run.sketch.dim, dtype=torch.float64)
    arrays: dict[str, list[Tensor]] = {}
    sizes: dict[str, int] = {}
    with Progress("doctor --model", samples + 1, show=show_progress) as bar:
        bar.update(0, part="sampling")
        torch.manual_seed(seed)
        rollout = generate(
            run.policy,
            run.tok,
            run.rendered,
            [""] * n_prompts,
            group_size=samples,
            max_new_tokens=run.max_new_tokens,
            codec=run.codec,
        )
        if int(rollout.mask.sum()) == 0:
            raise DoctorError("the sampled completions hold no tokens; raise --max-new-tokens")
        bar.advance(part="gradients")
        # Each group holds every prompt once, in order: the prompts' caches serve every group,
        # where the measured layers see no prompt position (the default's do not).
        first_rows = torch.arange(n_prompts) * samples
        prefix = _prefix(run, rollout, first_rows)
        order = []
        for k in range(samples):  # group k: the k-th completion of every prompt (iid groups)
            idx = first_rows + k
            vec, arr, sizes = group_vectors(
                run.policy, run.ref, rollout, idx, run.subset, run.sketch, prefix
            )
            sizes["group_vectors"] = vec.nbytes
            vectors[:, k] = vec.sum(1)
            for key, v in arr.items():
                arrays.setdefault(key, []).append(v)
            order.append(idx)
            bar.advance()
    perm = torch.argsort(torch.cat(order))
    cat = {k: torch.cat(v)[perm] for k, v in arrays.items()}
    return rollout, rounding_floor(vectors), cat, sizes


def _prefix(run: _Run, rollout: Any, first_rows: Tensor) -> tuple[Any, Any] | None:
    """Both models' prompt caches, where the measured layers see no prompt position."""
    if not prompt_free(run.policy, rollout, run.subset):
        return None
    caches = (
        prompt_caches(run.policy, rollout, first_rows),
        prompt_caches(run.ref, rollout, first_rows),
    )
    return caches if all(x is not None for x in caches) else None


def gradient_rows(vectors: Tensor, rows: int) -> list[dict[str, Any]]:
    """One row per estimator × placement: its intervals against every target gradient, and the
    verdict on the gradient :func:`claim` says it follows."""
    names_o = objective_names()
    pairs = [(o, t) for o in range(len(TARGETS), len(names_o)) for t in range(len(TARGETS))]
    stats = interval_stats(vectors, pairs)
    table: list[dict[str, Any]] = []
    for (o, t), s in zip(pairs, stats, strict=True):
        if t == 0:
            est_name, place = names_o[o]
            table.append({"estimator": est_name, "placement": place, "targets": {}})
        table[-1]["targets"][TARGETS[t]] = s
    for row in table:
        c = claim(row["estimator"], row["placement"])
        row["claim"] = None
        if c is not None:
            what, t, exact = c
            s = row["targets"][TARGETS[t]]
            row["claim"] = {
                "gradient": what,
                "target": TARGETS[t],
                "projection": exact,
                **verdict(s["beta"], s["half_width"]["beta"], exact, rows),
            }
    return table


# --------------------------------------------------------------------------------------------
# For people.


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.{digits}g}"


def _pm(x: float | None, half: float | None) -> str:
    """``+0.41±0.20``: an estimate and its interval's half-width (``—``: not estimable)."""
    if x is None or half is None or not math.isfinite(half):
        return "—"
    return f"{x:+.2f}±{half:.2f}" if half >= 0.005 or half == 0 else f"{x:+.3f}±{half:.0e}"


_SHORT = {TARGETS[0]: "θ‖ref", TARGETS[1]: "ref‖θ", TARGETS[2]: "seq θ‖ref"}


HEAVY_TAIL_KURTOSIS = 100.0
"""The excess kurtosis of an estimator's per-token values above which :func:`heavy_tail_notes`
reads an INCONSISTENT gradient row as the batch missing rare tokens."""


def heavy_tail_notes(rows: list[dict[str, Any]], values: dict[str, Any]) -> list[str]:
    """A line for each INCONSISTENT gradient row whose estimator's per-token values have an
    excess kurtosis above :data:`HEAVY_TAIL_KURTOSIS`: there the identity `klpo explain` states
    is an expectation over every token at each prefix, and much of it is carried by tokens the
    policy rarely samples (for ``k3``, those with pi_theta ≪ pi_ref, whose weight
    pi_ref/pi_theta is unbounded), so a batch of this size follows another direction; the
    jackknife interval, which assumes light tails, is then too narrow to tell a wrong identity
    from a short sample.

    >>> rows = [{"estimator": "k3", "placement": "loss", "claim": {"status": "inconsistent"}}]
    >>> heavy_tail_notes(rows, {"k3": {"token": {"excess_kurtosis": 1700.0}}})[1][:40]
    '  k3 loss: its per-token values have exc'
    """
    out = []
    for r in rows:
        c, name = r["claim"], r["estimator"]
        kurt = values.get(name, {}).get("token", {}).get("excess_kurtosis")
        if c is None or c["status"] != "inconsistent" or kurt is None or kurt < HEAVY_TAIL_KURTOSIS:
            continue
        out.append(
            f"  {name} {r['placement']}: its per-token values have excess kurtosis {kurt:.3g}: the "
            "gradient explain names is an expectation over every token, much of it carried by "
            "tokens this policy rarely samples, so a batch of this size follows the direction "
            "above instead (the interval assumes light tails); more --samples move it towards "
            "explain's"
        )
    return ([""] if out else []) + out


def render_measurement(m: dict[str, Any]) -> str:
    """The measurement for people: two value tables and one gradient table with intervals."""
    e = m["exact"]
    lines = [
        f"measured on your models: {m['sequences']} completions, {m['tokens']} tokens "
        f"(--seed={m['seed']}{', chat template' if m.get('chat') else ''})",
        f"  exact KL(pi_theta ‖ pi_ref): {_num(e['token_mean_kl_theta_ref'], 4)} per token, "
        f"{_num(e['sequence_mean_kl_theta_ref'], 4)} per sequence; "
        f"KL(pi_ref ‖ pi_theta): {_num(e['token_mean_kl_ref_theta'], 4)} per token",
    ]
    cols = ("mean", "bias", "± se", "sd", "sd/KL", "neg", "kurt", "max")
    for level in ("token", "sequence"):
        lines += [
            "",
            f"values per {level} against the exact KL (bias ± se, sd of the error; neg: the "
            "fraction below 0; kurt: excess kurtosis):",
            f"  {'estimator':<13}" + "".join(f"{c:>10}" for c in cols),
        ]
        for name, s in m["values"].items():
            v = s[level]
            cells = (
                _num(v["mean"]),
                _num(v["bias"]),
                _num(v["bias_se"], 2),
                _num(v["sd"]),
                _num(v["relative_sd"], 2),
                f"{v['fraction_negative']:.2f}",
                _num(v["excess_kurtosis"], 3),
                _num(v["max"]),
            )
            lines.append(f"  {name:<13}" + "".join(f"{c:>10}" for c in cells))
    g = m["gradients"]
    hl = {tuple(h) for h in m.get("highlight", [])}
    sketched = f"sketched to {g['dim']:,}" if g["sketch"] else "exact"
    lines += [
        "",
        f"gradient cosines on {g['subset']} ({g['parameters']:,} parameters, {sketched}), "
        f"estimate ± 95% half-width over {m['groups']} groups of completions; proj: the "
        "projection on the gradient explain names (exact 1, or 0 for zero);"
        " * = your config's terms:",
        f"  {'estimator':<13}{'placement':<13}"
        + "".join(f"{_SHORT[t]:>13}" for t in TARGETS)
        + f"  {'explain says':<19}{'proj':>13}  verdict",
    ]
    for r in g["rows"]:
        mark = "*" if (r["estimator"], r["placement"].replace("-to-go", "")) in hl else " "
        cells = "".join(
            f"{_pm(r['targets'][t]['cos'], r['targets'][t]['half_width']['cos']):>13}"
            for t in TARGETS
        )
        c = r["claim"]
        if c is None:
            tail = f"  {'other (biased)':<19}{'':>13}  —"
        else:
            s = r["targets"][c["target"]]
            proj = _pm(s["beta"], s["half_width"]["beta"])
            if c["status"] == "inconsistent":
                word = f"INCONSISTENT: the interval excludes {c['projection']:g}"
            elif c["status"] == "consistent":
                word = "consistent" + (
                    f" (~{c['decide_at']:,} completions to decide)" if c["decide_at"] else ""
                )
            else:
                word = "undefined (a zero target)"
            tail = f"  {c['gradient']:<19}{proj:>13}  {word}"
        lines.append(f" {mark}{r['estimator']:<13}{r['placement']:<13}{cells}{tail}")
    lines += heavy_tail_notes(g["rows"], m["values"])
    lines += [
        "",
        "  cosines are of the expected gradients, corrected for the noise in each norm "
        "(U-statistics; — where the expected gradient is not told from zero); intervals are "
        "jackknife over the groups with Student's t. More --samples narrow them.",
    ]
    return "\n".join(lines)
