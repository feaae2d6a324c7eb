"""Policy, reference and critic: transformers causal LMs loaded by path or id, and thin wrappers.

The update never asks the model for its ``[B, L, V]`` logits. :class:`Backbone` returns the last
hidden states, and the log-probs, entropy and exact KL come from the output head chunk by chunk
(:func:`klpo.logprobs.fused`). Going through a module's ``forward`` keeps DDP's hooks in place.
"""

from __future__ import annotations

import inspect
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers() -> None:
    """No per-file progress bars or advisory warnings from transformers in the run's output."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


def cache_kwargs(module: nn.Module, cache) -> dict:
    """``{name: cache}`` under the name ``module.forward`` takes its key/value cache by.

    transformers 5.20 renamed ``past_key_values`` to ``cache`` (the old name is accepted, with a
    deprecation, for a while); older releases silently ignore ``cache=``, which would run the
    completion tokens without their prompt. Asked of the signature, so both work.
    """
    if hasattr(module, "get_base_model"):  # a peft wrapper passes the name through
        module = module.get_base_model()
    kind = type(module)
    name = _CACHE_KWARG.get(kind)
    if name is None:
        params = inspect.signature(module.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        _CACHE_KWARG[kind] = name
    return {name: cache}


_CACHE_KWARG: dict[type, str] = {}


def output_cache(out):
    """The key/value cache a forward returned (``cache``, or ``past_key_values`` before 5.20)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


ALLOW_DOWNLOADS = "KLPO_ALLOW_DOWNLOADS"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def downloads_allowed() -> bool:
    """Whether models and datasets may be fetched from the Hub: only if ``KLPO_ALLOW_DOWNLOADS=1``.

    Off by default, so a name missing from the local cache is an immediate "not found locally"
    rather than tens of seconds of network retries on a machine without access.
    """
    return os.environ.get(ALLOW_DOWNLOADS, "") == "1"


def offline_unless_allowed() -> None:
    """Put transformers, huggingface_hub and datasets in offline mode unless downloads are allowed.

    Sets ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` for modules not yet imported, and the
    constants of those already imported (they read the variables at import time).
    """
    if downloads_allowed():
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    for name in ("huggingface_hub.constants", "datasets.config"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "HF_HUB_OFFLINE"):
            module.HF_HUB_OFFLINE = True
    module = sys.modules.get("datasets.config")
    if module is not None and hasattr(module, "HF_DATASETS_OFFLINE"):
        module.HF_DATASETS_OFFLINE = True


def _looks_like_path(name: str) -> bool:
    """A directory name (not a Hub id, which is ``name`` or ``owner/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def model_source_problem(name: str, key: str, *, tokenizer: bool = False) -> str | None:
    """Why ``name`` (a directory or model id given as config key ``key``) cannot be loaded.

    Checks files only (config, weights complete, tokenizer when asked), never the network: a
    model id must already be in the local cache unless ``KLPO_ALLOW_DOWNLOADS=1``.
    """
    from klpo.train.checkpoint import model_dir_problem

    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{key} {name!r} is a file; give the directory written by save_pretrained"
        problem = model_dir_problem(path)
        if problem:
            return (
                f"{key} {name!r} is not a complete model directory ({problem}); give a "
                "directory written by save_pretrained (config.json and complete "
                "model.safetensors), or model.policy=builtin for the shipped model"
            )
        if tokenizer and not any((path / f).is_file() for f in TOKENIZER_FILES):
            return (
                f"{key} {name!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
                "the tokenizer into it too (tokenizer.save_pretrained(DIR))"
            )
        return None
    if _looks_like_path(name):
        return f"{key} {name!r}: no such directory; check the path"
    if downloads_allowed():
        return None
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except HFValidationError:
        return f"{key} {name!r}: no such directory, and not a valid model id; check the name"
    if not isinstance(cached, str):
        return (
            f"{key} {name!r}: no such directory, and model id {name!r} not found locally (not "
            "in the Hugging Face cache). Give a local directory, or set KLPO_ALLOW_DOWNLOADS=1 "
            "to let it be downloaded"
        )
    return None


def load_causal_lm(name_or_path: str, dtype: str = "float32", key: str = "model"):
    """A transformers causal LM from a local directory or a model id already in the local cache."""
    problem = model_source_problem(name_or_path, key)
    if problem:
        raise FileNotFoundError(problem)
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=DTYPES[dtype], local_files_only=not downloads_allowed()
        )
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"could not load a causal LM from {key} {name_or_path!r}: "
            f"{str(err).splitlines()[0]}. Give a directory written by save_pretrained, or "
            "model.policy=builtin for the shipped arithmetic model."
        ) from None
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def load_tokenizer(name_or_path: str, key: str = "model"):
    """The tokenizer saved with a model (left padding; EOS as pad if there is no pad token)."""
    problem = model_source_problem(name_or_path, key, tokenizer=True)
    if problem:
        raise FileNotFoundError(problem)
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, local_files_only=not downloads_allowed())
    except (OSError, ValueError, ImportError, TypeError) as err:
        raise FileNotFoundError(
            f"could not load the tokenizer of {key} {name_or_path!r}: "
            f"{str(err).splitlines()[0][:200]}. Save the model's tokenizer into that directory "
            "(tokenizer.save_pretrained(DIR)); tokenizer.json is the format that needs no "
            "extra package"
        ) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                f"tokenizer of {key} {name_or_path!r} has neither a pad nor an EOS token; set "
                "one (tokenizer.pad_token = ...) and save it again"
            )
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def autocast(dtype: torch.dtype | None, device: torch.device):
    """Mixed precision: ``torch.autocast`` in ``dtype`` (None or float32: no autocast).

    The parameters stay float32 (the master weights the optimizer updates); matmuls run in bf16
    on bf16 copies of them, reductions and norms in float32 (autocast's op lists)."""
    if dtype is None or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def transformer(model: nn.Module) -> nn.Module:
    """The decoder stack under a causal LM's head (through a peft wrapper if there is one)."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model.base_model


class Backbone(nn.Module):
    """``forward(input_ids, attention_mask, position_ids) -> [B, L, H]`` last hidden states.

    With ``group > 1`` and ``prefix = P``, rows ``g*group .. g*group + group - 1`` share their first
    ``P`` columns (one prompt, ``group`` completions, as GRPO samples them): the prompt is run once
    per group, its keys and values are repeated ``group`` times (autograd flows back through the
    repeat, so every completion's gradient reaches the shared prompt's activations, summed), and
    the completion columns attend to them through the cache. The hidden states and parameter
    gradients are those of the unshared forward (tested in float64); the prompt's compute drops by
    the factor ``group``.

    ``compute_dtype`` bfloat16 runs the forward under :func:`autocast` (mixed precision). Under
    FSDP this module is the root of the sharding, so its own parameter group holds the
    embeddings, the final norm and the head (:mod:`klpo.train.fsdp`).
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.model = model
        self.compute_dtype = compute_dtype

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        *,
        prefix: int = 0,
        group: int = 1,
    ) -> Tensor:
        with autocast(self.compute_dtype, input_ids.device):
            return self._hidden(input_ids, attention_mask, position_ids, prefix, group)

    def _hidden(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prefix: int,
        group: int,
    ) -> Tensor:
        base = transformer(self.model)
        # Checkpointed layers keep no cache, so a shared prompt could not reach the completions.
        checkpointed = (
            getattr(base, "gradient_checkpointing", False)
            and base.training
            and torch.is_grad_enabled()
        )
        if group <= 1 or prefix <= 0 or prefix >= input_ids.shape[1] or checkpointed:
            out = base(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            )
            return out.last_hidden_state
        first = slice(None, None, group)  # one row per group
        head = base(
            input_ids=input_ids[first, :prefix],
            attention_mask=attention_mask[first, :prefix],
            position_ids=position_ids[first, :prefix],
            use_cache=True,
        )
        cache = output_cache(head)
        if cache is None:  # a model that returns no cache here (gradient checkpointing): unshared
            return self._hidden(input_ids, attention_mask, position_ids, 0, 1)
        cache.batch_repeat_interleave(group)
        tail = base(
            input_ids=input_ids[:, prefix:],
            attention_mask=attention_mask,
            position_ids=position_ids[:, prefix:],
            **cache_kwargs(base, cache),
            use_cache=True,
        )
        shared = head.last_hidden_state.repeat_interleave(group, dim=0)
        return torch.cat([shared, tail.last_hidden_state], dim=1)

    def head(self) -> tuple[Tensor, Tensor | None]:
        """The output head's (weight [V, H], bias [V] or None), whole.

        Under FSDP the head is unsharded for the pass (:func:`klpo.train.fsdp.unshard_root`):
        the fused log-prob/KL pass reads it tile by tile many times, so one all-gather per pass
        beats one per tile, and its gradient reaches the shards through FSDP's reduce-scatter.
        """
        from klpo.train.fsdp import unshard_root

        unshard_root(self)
        lm_head = self.model.get_output_embeddings()
        return lm_head.weight, getattr(lm_head, "bias", None)


class Critic(nn.Module):
    """PPO's critic: a causal-LM backbone and a linear value head, ``[B, L]`` values.

    Initialised from the reference's backbone (its own copy, trained separately) and a zero value
    head, so the first value predictions are 0 everywhere.
    """

    def __init__(self, model: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.backbone = Backbone(model, compute_dtype)
        hidden = model.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(model.parameters()).dtype)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        *,
        prefix: int = 0,
        group: int = 1,
    ) -> Tensor:
        h = self.backbone(input_ids, attention_mask, position_ids, prefix=prefix, group=group)
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute every decoder layer in the backward pass (transformers' checkpointing).

    Non-reentrant ``torch.utils.checkpoint``: it needs no input that requires grad (LoRA's frozen
    embeddings) and composes with FSDP's hooks."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # the newer name in transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
