"""The measured parameters and the sketches of their per-completion gradients: the fast path
that turns each objective's per-token coefficients into sketched weight gradients."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpo.logprobs import exact_kl, token_logprobs
from klpo.measure.errors import MeasureError
from klpo.measure.objectives import coefficients, objective_names


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
        raise MeasureError("the policy has no linear layer to measure gradients on")
    if layer is None:
        found = [(int(x.group(2)), x.group(1)) for n, _ in linear if (x := _LAYER.match(n))]
        if not found:
            raise MeasureError(
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
            raise MeasureError(
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
    vectors = _sent_down(h, seen, window, coef, basis, subset, sketch)
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
        raise MeasureError(
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
) -> Tensor:
    """Each objective's gradient at the hidden states sent down to the measured layers by one
    backward pass, sketched: ``[O, R, D]`` for the window's ``R`` rows."""
    # Only the tokens whose measured layers' outputs reach the completions' hidden states are
    # sketched (for the last layer's MLP, the completion positions): found by one backward pass
    # of a random direction, whose zeros are the graph's structural zeros; padding is left out.
    n_rows = w.ids.shape[0]
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
