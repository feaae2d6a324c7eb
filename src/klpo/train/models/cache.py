"""Which of the trainer's key/value-cache paths a model supports.

Two paths run one prompt for a whole group and repeat its cache for the ``G`` completions
(``Cache.batch_repeat_interleave``): the shared prompt of the reference, scoring and update
passes (``rollout.share_prompt``, :class:`klpo.train.models.backbone.Backbone`) and the lean
sampler (``rollout.sampler: lean``, :func:`klpo.train.rollout.samplers.sample_lean`). That is
exact for a cache of keys and values, whole or in a sliding window (Llama, Mistral's
``sliding_window``, Gemma 2/3's alternating layers): each completion attends to the keys and
values its own unshared forward computes. transformers 5.24 keeps a Mamba-style or
linear-attention layer's recurrent and convolution state in a ``LinearAttentionLayer`` (bamba,
falcon_h1, jamba, zamba2, granitemoehybrid, qwen3_next, mamba, ...), which has no batch repeat
of its own (a layer that holds attention too repeats only its keys and values); and a model that
returns no cache (recurrent_gemma) gives nothing to repeat. For such a model the two paths are
switched off: the trainer computes every row whole and samples with ``generate``, and says so
once, at load (:func:`notice`).

:func:`cache_support` finds out by asking the model: a forward of two tokens with
``use_cache=True``, then the classes of the cache's layers; for a cache of keys and values, a
probe of the shared paths themselves (two tokens cached, the cache repeated for two rows, two
more tokens through it) against the whole forward, which turns them off for a model whose
forward breaks there or gives other numbers (CPM-Ant's and Dory's attention masks, ProphetNet's
one-token cache). The answer is kept per model object, so the Backbone and the sampler read it at
no cost after the load.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from klpo import heads
from klpo.train.models.load import cache_kwargs, output_cache

__all__ = ["SHAREABLE", "CacheSupport", "cache_support", "notice"]

SHAREABLE = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer"})
"""Cache layer classes (transformers' ``cache_utils``) whose repeat is exact: keys and values."""


class CacheSupport(NamedTuple):
    """Whether a model's cache can be shared by a group, and why not.

    Attributes:
        layers: the class names of its cache's layers (empty: it returns no cache).
        reason: why the shared paths are off, or None where they are on.
    """

    layers: tuple[str, ...]
    reason: str | None

    @property
    def shared(self) -> bool:
        return self.reason is None


_SUPPORT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe_ids(model: Any, device: torch.device, n: int = 2) -> torch.Tensor:
    """``[1, n]``: the ``n`` lowest token ids that are none of the config's special ids."""
    special: set[int] = set()
    config = model.config
    for cfg in (config, getattr(config, "get_text_config", lambda: config)()):
        for key, value in vars(cfg).items():
            if key.endswith(("_id", "_index")) and isinstance(value, int):
                special.add(value)
    ids = [i for i in range(len(special) + n) if i not in special][:n]
    return torch.tensor([ids], device=device)


def _reason(layers: tuple[str, ...]) -> str | None:
    if not layers:
        return "it returns no key/value cache to repeat"
    odd = sorted(set(layers) - SHAREABLE)
    if not odd:
        return None
    if any("LinearAttention" in name for name in odd):
        return (
            f"its cache holds recurrent state ({', '.join(odd)}), which a prompt's cache "
            "repeated for its group does not carry"
        )
    return f"its cache has layers of a kind klpo does not repeat ({', '.join(odd)})"


def cache_support(model: Any) -> CacheSupport:
    """:class:`CacheSupport` of ``model`` (a causal LM, or a peft wrapper of one), found once per
    model object: the kinds of its cache's layers (a forward of two tokens with
    ``use_cache=True``), then, for a cache of keys and values, the shared paths on a probe
    (:func:`_repeat_probe`). No gradient; eval mode for the probes, the model's training flags
    restored."""
    if model in _SUPPORT:
        return _SUPPORT[model]
    device = next(model.parameters()).device
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad(), heads.evaluating(model):
        out = model(input_ids=_probe_ids(inner, device), use_cache=True)
        cache = output_cache(out)
        layers = tuple(type(layer).__name__ for layer in getattr(cache, "layers", ()) or ())
        if cache is not None and not hasattr(cache, "layers"):
            layers = (type(cache).__name__,)
        reason = _reason(layers)
        if reason is None:
            reason = _repeat_probe(model, _probe_ids(inner, device, 4))
    support = CacheSupport(layers, reason)
    _SUPPORT[model] = support
    return support


def _repeat_probe(model: Any, ids: torch.Tensor) -> str | None:
    """Why the shared paths fail on ``model``, or None: two tokens run with a cache, the cache
    repeated for two rows, two more tokens through it (as the shared prompt and the lean sampler
    call the model), against the last two positions' log-probs of the whole forward. Models whose
    forward breaks there, or gives other numbers (a cache that ignores its position), fail."""
    kwargs = {"use_cache": False} if heads.accepts_keyword(model, "use_cache") else {}
    try:
        out = model(input_ids=ids[:, :2], use_cache=True)
        cache = output_cache(out)
        cache.batch_repeat_interleave(2)
        rest = model(
            input_ids=ids[:, 2:].repeat(2, 1), attention_mask=torch.ones_like(ids).repeat(2, 1),
            position_ids=torch.arange(2, 4, device=ids.device).repeat(2, 1),
            **cache_kwargs(model, cache), use_cache=True,
        ).logits[:, -2:]  # fmt: skip
        whole = model(input_ids=ids, **kwargs).logits[:, -2:]
    except Exception as err:  # the model's own code: any error means the paths are not for it
        text = " ".join(str(err).split())[:120]
        return f"its forward over a repeated cache fails ({type(err).__name__}: {text})"
    if rest.shape[1:] != whole.shape[1:]:
        return f"its forward over a repeated cache gives logits of shape {tuple(rest.shape)}"
    got, want = (torch.log_softmax(x.double(), -1) for x in (rest, whole.expand_as(rest)))
    real = torch.isfinite(want)  # a masked vocabulary entry is -inf in both
    gap = (
        float((got - want)[real].abs().max()) if bool((torch.isfinite(got) == real).all()) else 1e9
    )
    if not gap <= 1e-3 * max(1.0, float(want[real].abs().max())):
        return f"its forward over a repeated cache gives other log-probs (off by {gap:.3g})"
    return None


def notice(model: Any, key: str, *, share_prompt: bool, lean: bool) -> str | None:
    """The one-line notice of a load, or None: which of the options that are on (``share_prompt``,
    ``lean``) are off for the model at config key ``key``, and why."""
    support = cache_support(model)
    if support.shared or not (share_prompt or lean):
        return None
    off = [o for o, on in (("rollout.share_prompt", share_prompt),
                           ("rollout.sampler: lean", lean)) if on]  # fmt: skip
    instead = [w for w, on in (("every row is computed whole", share_prompt),
                               ("sampling uses transformers' generate", lean)) if on]  # fmt: skip
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = f"{type(inner).__name__} ({getattr(inner.config, 'model_type', '?')})"
    return (
        f"Note: {' and '.join(off)} off for {key}, {name}: {support.reason}; "
        f"{' and '.join(instead)}."
    )
