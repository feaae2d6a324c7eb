"""The sweep: every causal LM that transformers ships, through klpo's fused head, or refused.

For each ``model_type`` of ``transformers``' causal-LM auto-mapping
(``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), a model is built from its own config
(``AutoConfig.for_model``) shrunk to two layers and a 32-wide hidden state (:func:`tiny_config`),
in float64 where it runs (float32 where the architecture needs it), with its logit transform's
config fields set to values that matter (:data:`TRANSFORM_VALUES`) and its head's weight scaled
so that its logits spread over tens of nats (a skipped transform shows). A second model of the
same architecture (another seed) is the reference for the exact KL.

Each column of the table is one check of a built architecture (:data:`COLUMNS`), returning an
:class:`Outcome`: ``pass``, ``fallback`` (the trainer runs it another way, which it names: the
model's own logits, every row whole, ``generate``), ``refused`` (klpo says it cannot, and why,
and the refusal is right), ``skipped`` (the architecture does not build here: a missing extra
dependency, or a tiny config its own validation rejects) or ``fail`` (klpo gave other numbers
than the model without refusing, or broke). A column is one function and one entry of
:data:`COLUMNS`; the built models are shared (:func:`built`).

* ``log-probs``: :func:`klpo.logprobs.model_logprobs` (the load-time check, then the backbone's
  hidden states through the fused head with the architecture's transform): log-probs, entropy and
  exact KL against ``log_softmax(model(...).logits)`` in float64, within the check's derived bound
  (tests/test_heads.py explains it).
* ``shared prompt``: the trainer's :class:`~klpo.train.models.backbone.Backbone` with each prompt
  once per group against the unshared forward, at every real position (``fallback``: its cache
  cannot be repeated, and every row runs whole).
* ``lean sampler``: :func:`~klpo.train.rollout.samplers.sample_lean`'s greedy completions against
  the argmax of the model's own uncached forward, token by token (``fallback``: the trainer
  samples with ``generate``).
* ``one step``: the trainer's ``score`` and one ``micro_step`` of GRPO with the exact KL, every
  parameter's gradient against the same loss from the models' own logits in float64
  (``fallback``: a refused head, run with ``model.logits_path: model``).

A curated list (one architecture per transform and the common ones, :data:`FAST`) runs in ``make
test``; the whole mapping runs on demand, as tests or as the table of docs/real-models.md::

    .venv/bin/python -m pytest -m architectures tests/test_architectures.py
    nice -n 19 .venv/bin/python tests/test_architectures.py [--jobs 2] [--only a,b] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch

transformers = pytest.importorskip("transformers")

from klpo import heads  # noqa: E402
from klpo.logprobs import model_logprobs  # noqa: E402

ALL = sorted(transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)

# One architecture per kind of head (none, bias, soft cap, scale, divisor, multiplier, refused)
# and the most used ones; `make test` runs these.
FAST = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "mixtral",
    "qwen3_moe",
    "phi",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",  # its text config's cap is set, and the multimodal model does not apply it
    "cohere",
    "granite",
    "hyperclovax",
    "bert",
]

# Sizes of the tiny models, by config field (set where the config has the field).
SMALL = {
    "hidden_size": 32,
    "d_model": 32,
    "n_embd": 32,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layer": 2,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,  # expert groups (DeepSeek-V3's routing)
    "topk_group": 1,
    "embedding_dim": 32,  # xLSTM's width
    "attention_head_dim": 8,
    # Mamba-2 layers: heads x head size = expand x hidden size (2 x 32), small states.
    "num_heads": 8,
    "n_groups": 1,
    "state_size": 16,
    "ssm_state_size": 16,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_d_head": 16,
    "mamba_head_dim": 16,
    "mamba_d_ssm": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_dt_rank": 8,
    "mamba_chunk_size": 16,
    "vocab_size_per_layer_input": 128,  # Gemma 3n/4's per-layer embeddings
    "hidden_size_per_layer_input": 8,
    "vocab_size": 128,
    "unpadded_vocab_size": 120,  # a head narrower than the vocabulary (Inkling)
    "max_position_embeddings": 64,
    "n_positions": 64,
}
VOCAB = SMALL["vocab_size"]

# The logit transforms' fields, at values that change the logits by nats at the widened head's
# size (WIDTH): a cap below the logits' spread, scales far from 1.
TRANSFORM_VALUES = {
    "final_logit_softcapping": 15.0,
    "logits_soft_cap": 15.0,
    "output_logit_soft_cap": 15.0,
    "logit_scale": 0.25,
    "logits_scaling": 4.0,
    "lm_head_multiplier": 0.5,
    "logits_mup_width_multiplier": 2.0,
}
WIDTH = 20.0  # the standard deviation of the head's output, in nats, after widening
MAX_PARAMETERS = 20_000_000  # a "tiny" config above this was not shrunk (a sub-config we miss)
TIMEOUT_S = 300  # per architecture in the whole-mapping run (build and every column, wall clock)

# What an architecture needs beyond the generic shrinking (its config's own validation).
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gemma4_unified_assistant": {"hidden_size_per_layer_input": 0},
    "zaya": {"num_experts_per_tok": 1},
    "nemotron": {"num_key_value_heads": 2},
    "longcat_flash": {"expert_ffn_hidden_size": 32, "zero_expert_num": 2},
}


class Outcome(NamedTuple):
    """One cell of the table: ``pass``, ``refused``, ``skipped`` or ``fail``, and why."""

    status: str
    detail: str = ""


class Built(NamedTuple):
    """An architecture built for the sweep: the model, a reference, the probe ids."""

    model_type: str
    model: torch.nn.Module
    reference: torch.nn.Module
    ids: torch.Tensor  # [2, 10]
    dtype: torch.dtype


# ---------------------------------------------------------------------------------------------
# Building tiny models from each architecture's own config.


_PER_LAYER = object()  # a field that varies by layer (Gemma 4): read per layer, never globally


def _fields(config: Any) -> set[str]:
    """The config's fields (a per-layer one is set, never read: :func:`_get`)."""
    if dataclasses.is_dataclass(config):
        return {f.name for f in dataclasses.fields(config)}
    return set(vars(config))


def _get(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return _PER_LAYER


def _shrink(config: Any, layers: int, head_dim: bool = False) -> dict[str, Any]:
    """Overrides of ``config``'s fields: the small sizes, the transforms' values, special ids
    inside the small vocabulary; sub-configs (text, vision, ...) shrunk the same way. A field
    whose default is None or 0 (a feature off, a size derived) is left alone, but for
    ``head_dim`` with ``head_dim=True`` (for the configs that do not derive it)."""
    fields = _fields(config)
    alias = getattr(config, "attribute_map", None) or {}
    out: dict[str, Any] = {}
    for key, value in {**SMALL, **TRANSFORM_VALUES}.items():
        if key.endswith("layers") or key in ("n_layer", "num_hidden_layers"):
            value = layers
        name = key if key in fields else alias.get(key)
        if (
            name in fields
            and name not in out
            and (
                _get(config, name) not in (None, 0)
                or key in TRANSFORM_VALUES  # set even where the default is off: it must show
                or (head_dim and name == "head_dim")
            )
        ):
            out[name] = value
    depth = next(
        (_get(config, k) for k in _DEPTHS if k in fields and isinstance(_get(config, k), int)), 0
    )
    for name in fields:  # per-layer patterns (layer types, block types) cut to the new depth
        value = _get(config, name)
        if depth > layers and isinstance(value, (list, tuple)) and len(value) == depth:
            out[name] = _cut(value, layers)
    experts = ("num_experts", "num_local_experts", "n_routed_experts")
    if "num_experts_per_tok" in fields and any(k in out for k in experts):
        out["num_experts_per_tok"] = SMALL["num_experts_per_tok"]  # routing on, whatever default
    if "kv_lora_rank" in fields:  # multi-head latent attention: one key/value head per head
        out.update(num_key_value_heads=SMALL["num_attention_heads"])
        out.update({k: v for k, v in _MLA.items() if k in fields and _get(config, k)})
        out.pop("head_dim", None)
    if "rotary_dim" in fields and _get(config, "rotary_dim"):
        out["rotary_dim"] = 4
    out.update(_special_ids(config, fields))
    for name in fields:
        sub = _get(config, name)
        if isinstance(sub, transformers.PretrainedConfig):
            out[name] = _shrunk_sub(sub, layers, head_dim)
    return out


def _shrunk_sub(sub: Any, layers: int, head_dim: bool) -> Any:
    """A sub-config (text, vision, ...) shrunk: the same object's fields replaced, or, where its
    fields cannot all be read globally (per-layer ones), a fresh one of its model type."""
    try:
        return dataclasses.replace(sub, **_shrink(sub, layers, head_dim))
    except Exception:  # a per-layer field: start from the sub-config's defaults
        fresh = transformers.AutoConfig.for_model(sub.model_type)
        return transformers.AutoConfig.for_model(sub.model_type, **_shrink(fresh, layers, head_dim))


_DEPTHS = ("num_hidden_layers", "num_layers", "n_layer", "decoder_layers")


def _cut(pattern: list | tuple, layers: int) -> list | tuple:
    """A per-layer pattern cut to ``layers`` entries keeping each kind it has (the first of each
    kind, in order, then the pattern's head): two layers of Gemma 3's five sliding-window layers
    and one global are one of each, not two sliding-window ones."""
    firsts = [i for i, v in enumerate(pattern) if v not in pattern[:i]]
    keep = sorted(firsts[:layers] + [i for i in range(len(pattern)) if i not in firsts][: max(
        0, layers - len(firsts))])  # fmt: skip
    return type(pattern)(pattern[i] for i in keep)


_MLA = {"qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "qk_head_dim": 12, "v_head_dim": 8,
        "kv_lora_rank": 16, "q_lora_rank": 16}  # fmt: skip


def _special_ids(config: Any, fields: set[str]) -> dict[str, Any]:
    """Special token ids at or above the small vocabulary, moved to its top (distinct)."""
    out, top = {}, VOCAB - 1
    for name in sorted(fields):
        value = _get(config, name)
        if not name.endswith(("token_id", "token_index", "token_ids")):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
            out[name], top = top, top - 1
        elif isinstance(value, list) and any(isinstance(v, int) and v >= VOCAB for v in value):
            out[name] = [v if v < VOCAB else VOCAB - 1 for v in value]
    return out


def tiny_config(model_type: str, layers: int = 2, head_dim: bool = False) -> Any:
    try:
        base = transformers.AutoConfig.for_model(model_type)
    except Exception:  # a default its own validation rejects (the Gemma 4 assistants)
        base = transformers.AutoConfig.for_model(model_type, **OVERRIDES.get(model_type, {}))
    kwargs = {**_shrink(base, layers, head_dim), **OVERRIDES.get(model_type, {})}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def _from_config(config: Any) -> torch.nn.Module:
    """The mapping's causal LM for ``config``; where that class takes only its decoder's config
    (MusicGen's composite config), built from the decoder's."""
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except AttributeError:
        decoder = config.get_text_config(decoder=True)
        if decoder is config:
            raise
        name = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[
            config.model_type
        ]
        return getattr(transformers, name)(decoder)


def _make(config: Any, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = _from_config(config).to(dtype).eval()
    if hasattr(model, "set_default_language"):  # X-MOD's adapters need a language
        model.set_default_language(next(iter(config.languages)))
    return model


def _widen(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Scale the head's weight so that its output has a standard deviation of WIDTH nats, and
    move any other parameter of the head off its initial value (a learned scale starts at 1)."""
    emb = model.get_output_embeddings()
    weight = getattr(emb, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in emb.named_parameters():
            if name not in ("weight", "bias"):
                p.mul_(1 + 0.5 * torch.rand(p.shape, generator=gen, dtype=torch.float64).to(p))
        logits = model(input_ids=ids).logits
        spread = float(logits.double().std())
        if spread > 0 and torch.isfinite(logits).all():
            weight.mul_(WIDTH / spread)


def _probe(config: Any) -> torch.Tensor:
    """``[2, 10]`` ids below the vocabulary, none of the config's special ids."""
    special = set()
    subs = [v for v in vars(config).values() if hasattr(v, "model_type") and hasattr(v, "to_dict")]
    for cfg in [config, *subs]:  # the config and its sub-configs (text, vision, ...)
        for key, value in vars(cfg).items():
            if key.endswith(("_id", "_index")) and isinstance(value, int):
                special.add(value)
    allowed = torch.tensor([i for i in range(VOCAB) if i not in special])
    gen = torch.Generator().manual_seed(0)
    return allowed[torch.randint(0, len(allowed), (2, 10), generator=gen)]


def build(model_type: str) -> Built | Outcome:
    """The architecture built for the sweep, or an Outcome saying why it could not be."""
    warnings.filterwarnings("ignore")
    transformers.utils.logging.set_verbosity_error()
    errors = []
    for layers, head_dim in ((n, h) for n in (2, 4, 6) for h in (False, True)):
        try:
            config = tiny_config(model_type, layers, head_dim)
            with torch.device("meta"):
                size = sum(p.numel() for p in _from_config(config).parameters())
        except ImportError as e:
            return Outcome("skipped", f"needs an extra dependency: {_short(e)}")
        except Exception as e:  # the architecture's own config validation
            errors.append(_short(e))
            continue
        if size > MAX_PARAMETERS:
            return Outcome("skipped", f"its tiny config still has {size / 1e6:.0f}M parameters")
        ids = _probe(config)
        for dtype in (torch.float64, torch.float32):
            try:
                model, reference = _make(config, dtype, 0), _make(config, dtype, 1)
                for m in (model, reference):
                    _widen(m, ids)
                with torch.no_grad():
                    logits = model(input_ids=ids).logits
                if not torch.isfinite(logits).all():
                    raise ValueError("non-finite logits")
                return Built(model_type, model, reference, ids, dtype)
            except ImportError as e:
                return Outcome("skipped", f"needs an extra dependency: {_short(e)}")
            except Exception as e:
                errors.append(f"{str(dtype)[6:]}: {_short(e)}")
                if dtype == torch.float32:
                    break
    return Outcome("skipped", f"does not build or run from a tiny config: {errors[-1]}")


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:150]}"


_BUILT: dict[str, Built | Outcome] = {}


def built(model_type: str) -> Built | Outcome:
    """:func:`build`, once per architecture in a process (every column uses the same models)."""
    if model_type not in _BUILT:
        _BUILT[model_type] = build(model_type)
    return _BUILT[model_type]


# ---------------------------------------------------------------------------------------------
# The columns.


def _own(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi rows ``[B, L - 1, V]`` from the model's own logits / T, float64 (without a
    key/value cache, as the check and the backbone run it: Dory's loops read their cache)."""
    kwargs = {"use_cache": False} if heads.accepts_keyword(model, "use_cache") else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits[:, :-1].double() / temperature
    return torch.log_softmax(logits, -1)


def _eps(model: torch.nn.Module, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The check's bound on |δ log pi(v)| per position (klpo.heads.rounding_bound), at T."""
    head = heads.read_head(model)
    with torch.no_grad():
        rows = []
        for row in ids:
            hidden = heads.last_hidden(model, row[None])[0, :-1]
            logits = model(input_ids=row[None]).logits[0, :-1]
            rows.append(heads.rounding_bound(hidden, head, logits))
    return torch.stack(rows) / temperature


def logprobs_column(b: Built) -> Outcome:
    """klpo's log-probs, entropy and exact KL against the model's own logits (float64)."""
    try:
        heads.check_head(b.model)
    except heads.UnsupportedHead as e:
        return _refused(b, e)
    temperature = 0.9
    with torch.no_grad():
        out = model_logprobs(
            b.model, b.ids, temperature=temperature, with_entropy=True, reference=b.reference,
            check=False,
        )  # fmt: skip
    log_pi, log_pi_ref = _own(b.model, b.ids, temperature), _own(b.reference, b.ids, temperature)
    pi = log_pi.exp()
    want = {
        "logp": log_pi.gather(-1, b.ids[:, 1:, None])[..., 0],
        "entropy": -(pi * log_pi).sum(-1),
        "kl": (pi * (log_pi - log_pi_ref)).sum(-1),
    }
    eps, eps_ref = _eps(b.model, b.ids, temperature), _eps(b.reference, b.ids, temperature)
    d = (pi * (log_pi - log_pi_ref).abs()).sum(-1)
    tol = {"logp": eps, "entropy": eps * (1 + want["entropy"]), "kl": eps * (1 + d) + eps_ref}
    worst = []
    for name in ("logp", "entropy", "kl"):
        err = (getattr(out, name).double() - want[name]).abs()
        if not bool((err <= tol[name]).all()):
            worst.append(f"{name} off by {float(err.max()):.3g}")
    if worst:
        return Outcome("fail", "; ".join(worst))
    transform = heads.read_head(b.model).transform
    return Outcome("pass", "no transform" if transform is None else _describe(transform))


def _describe(transform) -> str:
    parts = []
    if transform.scale != 1.0:
        parts.append(f"scale {transform.scale:g}")
    if transform.softcap is not None:
        parts.append(f"soft cap {transform.softcap:g}")
    return ", ".join(parts)


def _refused(b: Built, e: heads.UnsupportedHead) -> Outcome:
    """A refusal, with its reason; ``fail`` where the plain head would have been right after all
    (then the refusal costs a user the fast path for nothing)."""
    reason = e.reason
    if isinstance(e, heads.HeadMismatch):
        reason = f"{reason} (the check: {e.gap:.3g} nats off)"
    emb = b.model.get_output_embeddings()
    weight = getattr(emb, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        plain = heads.Head(weight, getattr(emb, "bias", None), None)
        try:
            heads.check_head(b.model, plain)
        except Exception:  # the plain head is wrong or does not run: right
            return Outcome("refused", reason)
        if type(e) is heads.UnsupportedHead:
            return Outcome("fail", f"refused ({reason}), but the plain head gives its log-probs")
    return Outcome("refused", reason)


def _logits_path(b: Built) -> str:
    """The trainer's ``model.logits_path`` for the architecture: ``fused`` where the load-time
    check passes, else ``model`` (the fallback its refusal names)."""
    try:
        heads.check_head(b.model)
    except heads.UnsupportedHead:
        return "model"
    return "fused"


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float | None:
    """None where ``got`` equals ``want`` to the dtype's rounding, else the largest gap. A
    float64 model is held to float32's (2e-6, ~30 units of float32 roundoff): several
    architectures run their norms, rotary tables or routers in float32 whatever the model's
    dtype, and the shared prompt runs them on other batch shapes than the unshared forward."""
    tol = 2e-6 if dtype == torch.float64 else 1e-4
    got, want = got.double(), want.double()
    err = torch.where(got == want, 0.0, (got - want).abs())  # equal infinities (masked logits)
    return None if bool((err <= tol * (1 + want.abs())).all()) else float(err.max())


def _groups(b: Built, prefix: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """``[4, 10]`` ids and mask: two prompts (the probe rows' first ``prefix`` tokens), each with
    two completions (the probe rows' tails, swapped in the second), the last token of row 3
    padding."""
    ids = b.ids
    rows = [(0, 0), (0, 1), (1, 1), (1, 0)]
    x = torch.stack([torch.cat([ids[p, :prefix], ids[c, prefix:]]) for p, c in rows])
    mask = torch.ones_like(x)
    mask[3, -1] = 0
    return x, mask


def _own_nan(b: Built) -> Outcome | None:
    """``skipped`` where the model's own forward over :func:`_groups` (an attention mask given)
    gives NaN logits at real positions (ProphetNet's in float64): no oracle to compare with."""
    x, mask = _groups(b)
    kwargs = {"use_cache": False} if heads.accepts_keyword(b.model, "use_cache") else {}
    with torch.no_grad():
        logits = b.model(input_ids=x, attention_mask=mask, **kwargs).logits
    if bool(torch.isnan(logits[mask.bool()]).any()):
        return Outcome("skipped", "its own forward gives NaN logits with an attention mask here")
    return None


def shared_prompt_column(b: Built) -> Outcome:
    """The trainer's forward with each prompt once per group (``rollout.share_prompt``) against
    the unshared one: the features (last hidden states, or the logits under the fallback) at
    every real position; ``fallback`` where the cache cannot be repeated (every row whole)."""
    from klpo.train.models.backbone import Backbone
    from klpo.train.models.cache import cache_support
    from klpo.train.rollout.samplers import position_ids

    if (nan := _own_nan(b)) is not None:
        return nan
    path = _logits_path(b)
    backbone = Backbone(b.model, logits_path=path)
    x, mask = _groups(b)
    pos = position_ids(mask)
    with torch.no_grad():
        whole = backbone(x, mask, pos)
        shared = backbone(x, mask, pos, prefix=6, group=2)
    real = mask.bool()
    gap = _close(shared[real], whole[real], b.dtype)
    if gap is not None:
        return Outcome("fail", f"the shared prompt's features are off by {gap:.3g}")
    support = cache_support(b.model)
    if not support.shared:
        return Outcome("fallback", f"every row whole: {support.reason}")
    return Outcome("pass", "" if path == "fused" else "on the model's own logits")


def lean_sampler_column(b: Built) -> Outcome:
    """The lean sampler's greedy completions (each prompt once, its cache repeated) against the
    argmax of the model's own forward over the whole sequence, token by token, without a cache
    (``generate``'s greedy search without its processors: a model's generation config may force
    an EOS, as BART's does); ``fallback`` where the cache cannot be repeated (``generate``)."""
    from klpo.train.models.cache import cache_support
    from klpo.train.rollout.samplers import Decoding, sample_lean

    support = cache_support(b.model)
    if not support.shared:
        return Outcome("fallback", f"generate: {support.reason}")
    prompts, mask = b.ids[:, :6], torch.ones_like(b.ids[:, :6])
    ids = {"eos_token_id": -1, "pad_token_id": 0}  # no row stops: every step compared
    lean = sample_lean(
        b.model, prompts, mask, Decoding(group_size=2, max_new_tokens=4, greedy=True), **ids
    )
    seq = prompts.repeat_interleave(2, 0)
    kwargs = {"use_cache": False} if heads.accepts_keyword(b.model, "use_cache") else {}
    with torch.no_grad():
        for _ in range(4):
            logits = b.model(input_ids=seq, **kwargs).logits[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    want = seq[:, prompts.shape[1] :]
    if not torch.equal(lean, want):
        return Outcome("fail", f"greedy tokens {lean.tolist()} != the model's {want.tolist()}")
    return Outcome("pass")


def _rollout(b: Built):
    """The groups of :func:`_groups` as a rollout of two prompts, two completions each."""
    from klpo.train.rollout.samplers import Rollout

    x, mask = _groups(b)
    return Rollout(
        prompt_ids=x[:, :6], prompt_mask=mask[:, :6].bool(), completion_ids=x[:, 6:],
        mask=mask[:, 6:].bool(), prompts=["a", "a", "b", "b"], completions=["1", "22", "3", "44"],
        answers=[""] * 4, group_size=2, truncated=torch.zeros(4, dtype=torch.bool),
    )  # fmt: skip


def _naive_step(b: Built, r, adv: torch.Tensor, beta: float):
    """The gradient of GRPO's loss (PPO clip at pi_old = pi_theta, token-mean, beta x the exact
    KL) from the models' own logits, log_softmax in float64: (gradients, log pi, log pi_ref,
    the exact KL)."""
    from klpo import losses, reduce
    from klpo.train.rollout.samplers import position_ids

    att = r.attention_mask.long()
    kwargs = {"attention_mask": att, "position_ids": position_ids(att)}
    if heads.accepts_keyword(b.model, "use_cache"):
        kwargs["use_cache"] = False
    cols = slice(r.prompt_ids.shape[1] - 1, -1)
    logits = b.model(input_ids=r.input_ids, **kwargs).logits[:, cols]
    with torch.no_grad():
        ref = b.reference(input_ids=r.input_ids, **kwargs).logits[:, cols]
    logq, logq_ref = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref.double(), -1)
    logp = logq.gather(-1, r.completion_ids[..., None])[..., 0]
    kl = (logq.exp() * (logq - logq_ref)).sum(-1)
    pg = losses.ppo_clip(logp, logp.detach(), adv)
    b.model.zero_grad()
    loss = reduce.reduce(pg, r.mask, "token-mean") + beta * reduce.reduce(kl, r.mask, "token-mean")
    loss.backward()
    grads = {k: p.grad.clone() for k, p in b.model.named_parameters() if p.grad is not None}
    b.model.zero_grad()
    logp_ref = logq_ref.gather(-1, r.completion_ids[..., None])[..., 0]
    return grads, logp.detach(), logp_ref, kl.detach()


STEP_TOL = {torch.float64: 1e-5, torch.float32: 1e-4}
"""One step's gradient gap, relative to the largest gradient: float32 loss weights (the
advantages) and the parts some architectures compute in float32 (norms, rotary tables, a
learned logit scale) in float64 models, float32 rounding in float32 ones."""


def one_step_column(b: Built) -> Outcome:
    """One GRPO micro-step of the trainer (score, then micro_step with the exact KL, beta 0.5)
    on two groups of two completions: its pi_old, pi_ref and exact KL and every parameter's
    gradient against :func:`_naive_step`'s; ``fallback`` where it runs on
    ``model.logits_path: model``."""
    from klpo import reduce
    from klpo.train.config import build_config
    from klpo.train.models.backbone import Backbone
    from klpo.train.models.build import Models
    from klpo.train.rewards.functions import WeightedReward
    from klpo.train.runtime.dist import Dist
    from klpo.train.runtime.metrics import Tally
    from klpo.train.step.kl_term import kl_term
    from klpo.train.step.score import score
    from klpo.train.step.update import MicroBatch, micro_step

    if (nan := _own_nan(b)) is not None:
        return nan
    path, beta = _logits_path(b), 0.5
    cfg = build_config(overrides=[
        f"model.logits_path={path}", f"kl.beta={beta}", "rollout.group_size=2",
        "rollout.max_new_tokens=4",
    ])  # fmt: skip
    backbone = Backbone(b.model, logits_path=path)
    ref = Backbone(b.reference, logits_path=path)
    m = Models(None, b.model, backbone, ref, None, None, codec=None)  # (no sampling here)
    r = _rollout(b)
    reward = WeightedReward("length", lambda p, c, a: [float(len(x)) for x in c])
    s = score(cfg, m, r, [reward], beta)
    b.model.zero_grad()
    n = reduce.normaliser(r.mask, "token-mean")
    micro_step(
        cfg,
        m,
        MicroBatch.of(cfg, s, torch.arange(4), n),
        kl_term(cfg, beta=beta, beta_old=1.0),
        Dist(),
        sync=True,
        tally=Tally(),
    )
    got = {k: p.grad.clone() for k, p in b.model.named_parameters() if p.grad is not None}
    want, logp, logp_ref, kl = _naive_step(b, r, s.adv, beta)
    real = r.mask
    for name, got_v, want_v in (("pi_old", s.old.logp, logp), ("pi_ref", s.logp_ref, logp_ref),
                                ("the exact KL", s.old.kl, kl)):  # fmt: skip
        gap = _close(got_v[real], want_v[real], b.dtype)
        if gap is not None:
            return Outcome("fail", f"the step's {name} is off by {gap:.3g}")
    if set(got) != set(want):
        return Outcome("fail", f"gradients reach {len(got)} tensors, the model's own {len(want)}")
    if not any(float(g.abs().max()) > 0 for g in want.values()):
        return Outcome("fail", "the model's own loss has no gradient here")
    # Relative to the largest gradient: the loss weights (advantages, normaliser) are float32.
    scale, tol = max(float(g.abs().max()) for g in want.values()), STEP_TOL[b.dtype]
    for k, g in want.items():
        gap = float((got[k].double() - g.double()).abs().max()) / scale
        if gap > tol:
            return Outcome("fail", f"the gradient of {k} is off by {gap:.3g} (of the largest)")
    return Outcome("pass") if path == "fused" else Outcome("fallback", "model.logits_path: model")


# The table's columns, in order.
COLUMNS: dict[str, Callable[[Built], Outcome]] = {
    "log-probs": logprobs_column,
    "shared prompt": shared_prompt_column,
    "lean sampler": lean_sampler_column,
    "one step": one_step_column,
}


def run(model_type: str, column: str) -> Outcome:
    b = built(model_type)
    if isinstance(b, Outcome):
        return b
    try:
        return COLUMNS[column](b)
    except Exception as e:  # klpo broke on it: a failure, reported
        return Outcome("fail", _short(e))


# ---------------------------------------------------------------------------------------------
# The tests: the fast list in `make test`, the whole mapping on demand (-m architectures).

# The fast list's architectures pass every column but these: BERT's head is refused, so it
# trains on its own logits, and it returns no cache to share.
EXPECTED = {
    ("bert", "log-probs"): "refused",
    ("bert", "shared prompt"): "fallback",
    ("bert", "lean sampler"): "fallback",
    ("bert", "one step"): "fallback",
}


@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize("model_type", FAST)
def test_fast_list(model_type, column):
    outcome = run(model_type, column)
    assert outcome.status == EXPECTED.get((model_type, column), "pass"), outcome


@pytest.mark.architectures
@pytest.mark.parametrize("column", list(COLUMNS))
@pytest.mark.parametrize("model_type", ALL)
def test_whole_mapping(model_type, column):
    outcome = run(model_type, column)
    if outcome.status == "skipped":
        pytest.skip(outcome.detail)
    assert outcome.status in ("pass", "fallback", "refused"), outcome


# ---------------------------------------------------------------------------------------------
# The table: python tests/test_architectures.py.


class _Timeout(BaseException):  # not caught by the columns: the row is skipped
    pass


def _child(model_types: list[str]) -> None:
    """One JSON line per architecture: its outcome in every column (a timeout per arch)."""

    def alarm(*_):
        raise _Timeout(f"took more than {TIMEOUT_S} s")

    signal.signal(signal.SIGALRM, alarm)
    torch.set_num_threads(1)
    for model_type in model_types:
        start = time.time()
        signal.alarm(TIMEOUT_S)
        try:
            row = {c: run(model_type, c)._asdict() for c in COLUMNS}
        except _Timeout as e:
            row = {c: Outcome("skipped", str(e))._asdict() for c in COLUMNS}
        finally:
            signal.alarm(0)
        _BUILT.pop(model_type, None)
        print(json.dumps({"model_type": model_type, "seconds": time.time() - start, **row}),
              flush=True)  # fmt: skip


def _cell(o: dict, left: str) -> str:
    """``status: detail``, with what the cell to the left (its detail ``left``) already gave left
    out: the same detail (``as left``), or the same reason after another fallback's name
    (``generate, as left``)."""
    detail = o["detail"]
    name, _, reason = detail.partition(": ")
    if left and detail == left:
        detail = "as left"
    elif reason and reason == left.partition(": ")[2]:
        detail = f"{name}, as left"
    return o["status"] + (f": {detail}" if detail else "")


def table(rows: list[dict]) -> str:
    """The Markdown table of docs/real-models.md and the counts per column."""
    cols = list(COLUMNS)
    lines = [
        "| architecture | " + " | ".join(cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]
    for row in sorted(rows, key=lambda r: r["model_type"]):
        cells, left = [], ""
        for c in cols:
            cells.append(_cell(row[c], left))
            left = row[c]["detail"]
        lines.append(f"| {row['model_type']} | " + " | ".join(cells) + " |")
    counts = []
    for c in cols:
        tally: dict[str, int] = {}
        for row in rows:
            tally[row[c]["status"]] = tally.get(row[c]["status"], 0) + 1
        counts.append(f"{c}: " + ", ".join(f"{n} {s}" for s, n in sorted(tally.items())))
    return "\n".join(lines) + f"\n\n{len(rows)} architectures. " + "; ".join(counts) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description="The architecture sweep's table.")
    parser.add_argument("--only", default="", help="comma-separated model types (default all)")
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--out", default="", help="also write the table and rows (.md, .jsonl)")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args.child)
        return
    chosen = [m for m in args.only.split(",") if m] or ALL
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--child", *chosen[j :: args.jobs]],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for j in range(args.jobs)
    ]
    rows = []
    for p in procs:
        for line in p.stdout:
            if line.startswith("{"):
                rows.append(json.loads(line))
                print(line.strip()[:200], file=sys.stderr, flush=True)
        p.wait()
    done = {r["model_type"] for r in rows}
    for m in chosen:  # a child that died (out of memory, a crash in C) leaves its rest
        if m not in done:
            rows.append({"model_type": m, **{c: Outcome("skipped", "its process died")._asdict()
                                            for c in COLUMNS}})  # fmt: skip
    text = table(rows)
    print(text)
    if args.out:
        with open(args.out + ".md", "w") as f:
            f.write(text + "\n")
        with open(args.out + ".jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
