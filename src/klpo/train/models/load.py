"""Policy, reference and critic: transformers causal LMs and tokenizers loaded by path or id.

Models and tokenizers are read from local directories, or fetched by Hub id the way transformers
fetches them, honouring ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``
(:mod:`klpo.train.models.hub`); ``builtin`` names the tiny arithmetic model shipped in the package
(:func:`resolve_model_path`), and a ``.gguf`` file is dequantised once into a cached float32 model
directory (:mod:`klpo.train.models.gguf`). The wrappers the step calls are in
:mod:`klpo.train.models.backbone`.
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from klpo import heads
from klpo.train.models import gguf
from klpo.train.models.hub import hub_problem
from klpo.train.runtime.checkpoint import model_dir_problem

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _looks_like_path(name: str) -> bool:
    """A directory name (not a Hub id, which is ``name`` or ``owner/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def model_source_problem(name: str, key: str, *, tokenizer: bool = False) -> str | None:
    """Why ``name`` (a directory or model id given as config key ``key``) cannot be loaded.

    A directory: its files (config, weights complete, tokenizer when asked). A model id: in the
    local cache when the Hub is offline, else one short request to the Hub
    (:func:`klpo.train.models.hub.hub_problem`). A ``.gguf`` file: its header
    (:func:`klpo.train.models.gguf.gguf_problem`); its image is checked as a directory once
    :func:`resolve_model_path` has made it.
    """
    if gguf.is_gguf_path(name):
        return gguf.gguf_problem(name, key)
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
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"{key} {name!r}: no such directory, and not a valid model id; check the name"
    return hub_problem(name, key, "model")


def load_causal_lm(name_or_path: str, dtype: str = "float32", key: str = "model"):
    """A transformers causal LM from a local directory, a model id (fetched by transformers) or
    a ``.gguf`` file (its cached float32 image, :func:`resolve_model_path`)."""
    name_or_path = resolve_model_path(name_or_path, key=key)
    problem = model_source_problem(name_or_path, key)
    if problem:
        raise FileNotFoundError(problem)
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype])
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
    name_or_path = resolve_model_path(name_or_path, key=key)
    problem = model_source_problem(name_or_path, key, tokenizer=True)
    if problem:
        raise FileNotFoundError(problem)
    from transformers import AutoTokenizer

    quiet_transformers()
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
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
    """The decoder stack under a causal LM's head (through a peft wrapper if there is one): the
    backbone the load-time check proves (:func:`klpo.heads.backbone`; ``model.model`` where
    ``base_model`` is the model itself, as for Mllama's and Llama 4's text models), else
    ``base_model``."""
    try:
        return heads.backbone(model)
    except heads.UnsupportedHead:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return inner.base_model


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


def default_reference_path() -> Path:
    """Where the shipped reference model of the built-in task is (inside the package).

    Raises:
        FileNotFoundError: the package was installed without its assets; ``klpo make-reference
            DIR`` rebuilds the same model.
    """
    path = Path(__file__).resolve().parents[2] / "assets" / "reference"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the reference model is missing from {path}; rebuild it with "
            f"'klpo make-reference {path}' (or pass a model directory explicitly)"
        )
    return path


def default_teacher_path() -> Path:
    """Where the shipped teacher of the built-in task is: the shipped reference after
    ``klpo train``'s defaults, exported (``assets/teacher/teacher.json`` says how to rebuild it)."""
    path = Path(__file__).resolve().parents[2] / "assets" / "teacher"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the built-in teacher is missing from {path}; rebuild it with the two commands in "
            "docs/distillation.md (klpo train on the defaults, then klpo export)"
        )
    return path


def resolve_model_path(name: str, *, key: str = "model", log=None) -> str:
    """A model directory or id; ``builtin`` is the shipped tiny arithmetic model and
    ``builtin-teacher`` the same model after GRPO (on-policy distillation's teacher); a ``.gguf``
    file is its float32 image in klpo's cache, made on first use
    (:func:`klpo.train.models.gguf.resolve_gguf`; ``log`` hears that a conversion starts).

    Raises:
        klpo.train.models.gguf.GGUFError: a ``.gguf`` file that cannot be used.
    """
    if name == "builtin":
        return str(default_reference_path())
    if name == "builtin-teacher":
        return str(default_teacher_path())
    if gguf.is_gguf_path(name):
        return str(gguf.resolve_gguf(name, key=key, log=log).path)
    return name
