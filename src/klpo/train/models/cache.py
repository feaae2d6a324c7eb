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
``use_cache=True``, then the classes of the cache's layers. The answer is kept per model object,
so the Backbone and the sampler read it at no cost after the load.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from klpo.train.models.load import output_cache

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


def _probe_ids(model: Any, device: torch.device) -> torch.Tensor:
    """``[1, 2]``: the two lowest token ids that are none of the config's special ids."""
    special: set[int] = set()
    config = model.config
    for cfg in (config, getattr(config, "get_text_config", lambda: config)()):
        for key, value in vars(cfg).items():
            if key.endswith(("_id", "_index")) and isinstance(value, int):
                special.add(value)
    ids = [i for i in range(len(special) + 2) if i not in special][:2]
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
    model object by a forward of two tokens with ``use_cache=True`` (no gradient, the model's
    training flags untouched: the cache's kind does not depend on them)."""
    if model in _SUPPORT:
        return _SUPPORT[model]
    device = next(model.parameters()).device
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        out = model(input_ids=_probe_ids(inner, device), use_cache=True)
    cache = output_cache(out)
    layers = tuple(type(layer).__name__ for layer in getattr(cache, "layers", ()) or ())
    if cache is not None and not hasattr(cache, "layers"):
        layers = (type(cache).__name__,)
    support = CacheSupport(layers, _reason(layers))
    _SUPPORT[model] = support
    return support


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
