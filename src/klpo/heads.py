r"""The output head of a Hugging Face causal LM: read from the model, checked against the model.

klpo computes token log-probs, entropy and the exact KL from a model's last hidden states and its
output head, tile by tile (:func:`klpo.logprobs.fused`), never from the model's ``[B, L, V]``
logits. That is right only where the model's logits are ``transform(hidden @ weight.T + bias)``
with ``hidden`` the last hidden states of its backbone and a transform klpo knows
(:class:`klpo.logprobs.LogitTransform`: a scale, a soft cap). Several architectures change their
logits after the head (Gemma 2's soft cap, Cohere's ``logit_scale``, Granite's ``logits_scaling``);
some compute them another way (a head with layers of its own, one head per codebook). So:

* :func:`read_head` returns a model's head, ``(weight, bias, transform)``, reading the transform
  from the model as its own ``forward`` applies it (one recipe per ``config.model_type`` of
  ``transformers``' causal-LM mapping that transforms its logits, :data:`TRANSFORMS`), and refuses
  (:class:`UnsupportedHead`) the architectures known to compute their logits some other way
  (:data:`REFUSED`) and any model whose config names a logit transform klpo has no recipe for: klpo
  does not guess.
* :func:`check_head` proves it on the model itself, at load time: a few tokens through the model's
  own ``forward`` and through the fused head; their log-probs must agree within what the model's
  dtype can explain, or :class:`HeadMismatch` names the architecture, the gap and the fallback,
  the model's own logits (:data:`FALLBACK`). A model subclass that changes its logits in its own
  way, or an architecture newer than this module, is caught there.
* :func:`last_hidden` runs the backbone, whose last hidden states feed the head.
* :func:`model_logprobs` puts them together: a causal LM's own log-probs (and entropy, and the
  exact KL to a reference model) through its checked head, also named
  ``klpo.logprobs.model_logprobs``.

Duck-typed: a model is anything with ``config`` (its ``model_type`` and the transform's fields),
``get_output_embeddings()`` (a module with ``weight [V, H]`` and, optionally, ``bias [V]``) and
``base_model`` (the backbone, returning ``last_hidden_state``), as ``transformers``'
``PreTrainedModel`` has; a ``peft`` wrapper is looked through. Nothing here imports
``transformers``.
"""

from __future__ import annotations

import inspect
import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from klpo._logits import FusedOutput, LogitTransform
from klpo.fused_kernel import fused

__all__ = [
    "FALLBACK",
    "REFUSED",
    "TRANSFORMS",
    "Head",
    "HeadCheck",
    "HeadMismatch",
    "UnsupportedHead",
    "accepts_keyword",
    "backbone",
    "check_head",
    "checked_head",
    "evaluating",
    "last_hidden",
    "model_logprobs",
    "read_head",
    "rounding_bound",
]

# The way out when a model's logits cannot come from its head: its own logits, which the trainer
# takes with this option and code takes from ``model(...).logits``.
FALLBACK = (
    "use the model's own logits instead: set `model.logits_path: model` in the trainer's config "
    "(slower: it holds the [tokens, V] logits), or in code pass `model(...).logits` to "
    "klpo.logprobs.token_logprobs / entropy / exact_kl"
)


class UnsupportedHead(ValueError):
    """klpo cannot compute this model's logits from its last hidden states and output head.

    Attributes:
        architecture: ``ClassName (model_type)``.
        reason: why, in a few words (the message adds the architecture and :data:`FALLBACK`).
    """

    def __init__(self, message: str, architecture: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.architecture, self.reason = architecture, reason


class HeadMismatch(UnsupportedHead):
    """The fused head's log-probs disagree with the model's own beyond its dtype's rounding.

    Attributes (besides :class:`UnsupportedHead`'s):
        gap: the largest log-prob difference on the probe, in nats.
        tolerance: the rounding bound at that token.
    """

    def __init__(
        self, message: str, architecture: str, reason: str, gap: float, tolerance: float
    ) -> None:
        super().__init__(message, architecture, reason)
        self.gap, self.tolerance = gap, tolerance


def _unsupported(model: Any, reason: str) -> UnsupportedHead:
    """The refusal of :func:`read_head`: the architecture, the reason, the fallback."""
    return UnsupportedHead(
        f"{_name(model)}: klpo cannot compute its log-probs from the last hidden states and the "
        f"output head: {reason}; {FALLBACK}",
        _name(model),
        reason,
    )


class Head(NamedTuple):
    """A causal LM's output head as :func:`klpo.logprobs.fused` takes it.

    Attributes:
        weight: ``[V, H]`` the output embeddings' weight (a view: its gradient reaches the model).
        bias: ``[V]`` their bias, or None.
        transform: what the model does to ``hidden @ weight.T + bias`` before the softmax, or
            None for nothing.
    """

    weight: Tensor
    bias: Tensor | None
    transform: LogitTransform | None


# --------------------------------------------------------------------------------------------
# The transforms, as transformers 5.24's modeling code applies them (each ForCausalLM.forward).


def _softcap(field: str, text: bool = False) -> Callable[[Any, Any], LogitTransform | None]:
    """``cap · tanh(z / cap)`` with ``cap = config.<field>`` (the text config's with ``text``), if
    it is set (Gemma 2, arXiv:2408.00118)."""

    def read(model: Any, config: Any) -> LogitTransform | None:
        cfg = config.get_text_config() if text else config
        cap = getattr(cfg, field, None)
        return None if cap is None else LogitTransform.make(softcap=cap)

    return read


def _scale(read_scale: Callable[[Any, Any], float]) -> Callable[[Any, Any], LogitTransform]:
    return lambda model, config: LogitTransform.make(scale=read_scale(model, config))


def _divisor(field: str, text: bool = False) -> Callable[[Any, Any], LogitTransform]:
    def read(model: Any, config: Any) -> LogitTransform:
        cfg = config.get_text_config() if text else config
        return LogitTransform.divided_by(getattr(cfg, field))

    return read


def _none(model: Any, config: Any) -> None:
    return None


_GEMMA_CAP = _softcap("final_logit_softcapping")
_GEMMA_TEXT_CAP = _softcap("final_logit_softcapping", text=True)
_GRANITE = _divisor("logits_scaling")
_COHERE = _scale(lambda model, config: model.logit_scale)

# config.model_type -> the transform its ForCausalLM applies after the head. Where the forward
# divides the hidden states before a bias-free head (MiniCPM3, Inkling), that is the same divisor.
TRANSFORMS: dict[str, Callable[[Any, Any], LogitTransform | None]] = {
    "gemma2": _GEMMA_CAP,
    "gemma3_text": _GEMMA_CAP,
    "gemma3n_text": _GEMMA_CAP,
    "gemma4_text": _GEMMA_CAP,
    "gemma4_unified_text": _GEMMA_CAP,
    "vaultgemma": _GEMMA_CAP,
    "nanochat": _GEMMA_CAP,
    "beam": _GEMMA_CAP,
    "inkling2_text": _GEMMA_CAP,
    "inkling2_loop_text": _GEMMA_CAP,
    "gemma3n": _GEMMA_TEXT_CAP,
    "gemma4": _GEMMA_TEXT_CAP,
    "gemma4_unified": _GEMMA_TEXT_CAP,
    # Gemma3ForConditionalGeneration applies no cap (its text config's field is not read), nor
    # does MptForCausalLM apply its config's logit_scale.
    "gemma3": _none,
    "mpt": _none,
    "recurrent_gemma": _softcap("logits_soft_cap"),
    "xlstm": _softcap("output_logit_soft_cap"),
    "cohere": _COHERE,
    "cohere2": _COHERE,
    "cohere2_moe": _COHERE,
    "cohere_compass_text": _COHERE,
    "granite": _GRANITE,
    "granite_swa": _GRANITE,
    "granitemoe": _GRANITE,
    "granitemoe_swa": _GRANITE,
    "granitemoehybrid": _GRANITE,
    "granitemoeshared": _GRANITE,
    # HyperCLOVA X multiplies by logits_scaling where Granite divides.
    "hyperclovax": _scale(lambda model, config: config.logits_scaling),
    "falcon_h1": _scale(lambda model, config: backbone(model).lm_head_multiplier),
    "minicpm3": _GRANITE,
    "inkling_text": _divisor("logits_mup_width_multiplier"),
}

# Architectures whose ForCausalLM does not compute its logits as a transform of
# ``last_hidden_state @ weight.T + bias``, with the reason.
_HEAD_LAYERS = (
    "its head has layers of its own (a dense layer, an activation and a norm) between the "
    "backbone's last hidden states and the output embeddings"
)
REFUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "bert",
            "big_bird",
            "camembert",
            "data2vec-text",
            "electra",
            "ernie",
            "megatron-bert",
            "modernbert-decoder",
            "rembert",
            "roberta",
            "roberta-prelayernorm",
            "roc_bert",
            "roformer",
            "xlm-roberta",
            "xlm-roberta-xl",
            "xmod",
        ),
        _HEAD_LAYERS,
    ),
    "musicgen": "it has one output head per audio codebook",
    "musicgen_melody": "it has one output head per audio codebook",
    "prophetnet": "it predicts n-gram streams, each through the head, from its own decoder states",
    "gemma4_assistant": "it computes its logits from a masked embedding of the head's weight",
    "gemma4_unified_assistant": "it computes its logits from a masked embedding of the head's weight",
}

# Config fields that name a logit transform: a model type without a recipe that sets one is refused.
_TRANSFORM_FIELDS = (
    "final_logit_softcapping",
    "logits_soft_cap",
    "output_logit_soft_cap",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
    "logits_mup_width_multiplier",
)


# --------------------------------------------------------------------------------------------
# Reading.


def _unwrap(model: Any) -> Any:
    """The transformers model under a peft wrapper (``get_base_model``), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _name(model: Any) -> str:
    """``ClassName (model_type)``: how messages name an architecture."""
    model = _unwrap(model)
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} ({kind})" if kind else type(model).__name__


def backbone(model: Any) -> nn.Module:
    """The backbone under a causal LM's head: ``model.base_model`` (through a peft wrapper), or
    where that is the model itself (a ``base_model_prefix`` naming no attribute, as Mllama's
    text model has), ``model.model``. :func:`check_head` proves the choice on the model.

    Raises:
        UnsupportedHead: the model has no backbone distinct from itself.
    """
    inner = _unwrap(model)
    for base in (getattr(inner, "base_model", None), getattr(inner, "model", None)):
        if isinstance(base, nn.Module) and base is not inner:
            return base
    raise _unsupported(model, "it has no backbone (`base_model`) apart from its head")


def read_head(model: Any) -> Head:
    """The output head of a causal LM: its weight, bias and logit transform.

    The weight and bias are the output embeddings' own tensors (``get_output_embeddings()``), so
    gradients reach the model (and a head tied to the input embeddings stays tied). The transform
    is read as the architecture's ``forward`` applies it (:data:`TRANSFORMS`); architectures with
    none give ``transform=None``.

    Args:
        model: a causal LM (a ``transformers`` ``PreTrainedModel``, or a ``peft`` wrapper of one).

    Returns:
        :class:`Head` ``(weight [V, H], bias [V] or None, transform or None)``.

    Raises:
        UnsupportedHead: the architecture computes its logits some other way (:data:`REFUSED`),
            its output embeddings are not one linear layer, or its config names a logit transform
            (``final_logit_softcapping``, ``logit_scale``, ...) that klpo has no recipe for; the
            message names the architecture, the reason and :data:`FALLBACK`.
    """
    inner = _unwrap(model)
    config = getattr(inner, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in REFUSED:
        raise _unsupported(model, REFUSED[kind])
    weight, bias = _linear_head(model, inner)
    if kind in TRANSFORMS:
        transform = TRANSFORMS[kind](inner, config)
    else:
        _refuse_unknown_transform(model, config)
        transform = None
    if kind == "inkling_text":  # the forward drops the padding rows of the vocabulary
        rows = getattr(config, "unpadded_vocab_size", None)
        if rows is not None and rows < weight.shape[0]:
            weight, bias = weight[:rows], None if bias is None else bias[:rows]
    if kind in ("minicpm3", "inkling_text") and bias is not None:
        raise _unsupported(
            model, "it divides its hidden states before a head with a bias (no logit transform)"
        )
    if transform is not None and transform.is_identity:
        transform = None
    return Head(weight, bias, transform)


def _linear_head(model: Any, inner: Any) -> tuple[Tensor, Tensor | None]:
    """``(weight [V, H], bias [V] or None)`` of the output embeddings, or UnsupportedHead."""
    get = getattr(inner, "get_output_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise _unsupported(
            model,
            f"its output embeddings (get_output_embeddings() = {type(emb).__name__}) are not "
            f"one linear layer with a [V, H] weight",
        )
    bias = getattr(emb, "bias", None)
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != weight.shape[:1]):
        raise _unsupported(model, "its output embeddings' bias is not a [V] vector")
    extra = [name for name, _ in emb.named_parameters() if name not in ("weight", "bias")]
    if extra:  # a learned scale per vocabulary entry, say: the head is more than its matrix
        raise _unsupported(
            model,
            f"its output head has parameters besides its weight and bias ({', '.join(extra)}), "
            f"which klpo does not know the use of",
        )
    return weight, bias


def _refuse_unknown_transform(model: Any, config: Any) -> None:
    """UnsupportedHead if a model type without a recipe sets a field that names a transform."""
    configs = [config]
    text = getattr(config, "get_text_config", None)
    if callable(text) and text() is not config:
        configs.append(text())
    for cfg in configs:
        for field in _TRANSFORM_FIELDS:
            value = getattr(cfg, field, None)
            if value is not None and value != 1.0:
                raise _unsupported(
                    model,
                    f"its config sets {field} = {value!r}, a logit transform, but klpo has no "
                    f"recipe for how this architecture applies it (klpo does not guess)",
                )


# --------------------------------------------------------------------------------------------
# Running the backbone.


def accepts_keyword(module: nn.Module, name: str) -> bool:
    """Whether ``module.forward`` takes the keyword ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def last_hidden(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> Tensor:
    """``[B, L, H]``: the backbone's last hidden states, the input of the output head.

    The backbone (:func:`backbone`) gets ``input_ids``, ``attention_mask`` and ``position_ids``
    as the model's own ``forward`` would pass them (``use_cache=False`` where it takes one), so
    ``last_hidden(model, ...) @ weight.T`` is the model's ``logits`` before their transform.
    """
    base = backbone(model)
    kwargs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if accepts_keyword(base, "use_cache"):
        kwargs["use_cache"] = False
    return _hidden_of(base(**kwargs))


def _hidden_of(out: Any) -> Tensor:
    hidden = getattr(out, "last_hidden_state", None)
    return hidden if isinstance(hidden, Tensor) else out[0]


# --------------------------------------------------------------------------------------------
# Checking against the model's own forward.

LAMBDA = 6.0  # the probabilistic rounding bound's λ (Higham & Mary 2019): holds w.p. 1 - 3e-8


class HeadCheck(NamedTuple):
    """What :func:`check_head` measured.

    Attributes:
        architecture: ``ClassName (model_type)``.
        head: the head it checked.
        gap: the largest |log-prob difference| between klpo's fused head and the model's own
            logits over the checked tokens, in nats.
        tolerance: the rounding bound at that token (the dtype's, :func:`rounding_bound`).
        tokens: how many token log-probs were compared.
        dtype: the head's dtype.
    """

    architecture: str
    head: Head
    gap: float
    tolerance: float
    tokens: int
    dtype: torch.dtype


def check_head(
    model: Any, head: Head | None = None, *, input_ids: Tensor | None = None, length: int = 8
) -> HeadCheck:
    """Check that the fused head gives the model's own token log-probs: the load-time check.

    ``length`` tokens (seeded random ids that avoid the config's special ids, or ``input_ids [1,
    L]``) go through the model's own ``forward`` and through :func:`last_hidden` and the fused head
    (:func:`klpo.logprobs.fused` with the head's transform); their log-probs of ``ids[1:]``,
    ``log_softmax(logits)`` taken in float64 on the model's side, must agree at every token within
    the rounding the dtype explains: twice the model's error on a logit (float32 accumulation, its
    roundings after the GEMM, each at most ``u`` of the scaled logits' size) plus the fused head's
    own (``λ √(H + V) u32 (2 S + |L| + 1)``, as in tests/test_logprobs.py). Costs two forwards of
    ``length`` tokens (the model's and its backbone's), in eval mode, without gradients; every
    module's training flag is restored.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel`` or a ``peft`` wrapper).
        head: its head (default :func:`read_head`).
        input_ids: ``[1, L]`` the tokens to run (default: ``length`` random ids).
        length: the number of random tokens.

    Returns:
        :class:`HeadCheck` (the gap and tolerance, for the record).

    Raises:
        UnsupportedHead: from :func:`read_head`.
        HeadMismatch: the log-probs disagree; the message names the architecture, the gap, what
            differs (the backbone's states and the head's input, the head's output and the logits)
            and :data:`FALLBACK`.
    """
    head = read_head(model) if head is None else head
    ids = _probe_ids(model, head, length) if input_ids is None else input_ids
    with evaluating(model), torch.no_grad():
        seen, logits = _own_forward(model, ids)
        hidden = last_hidden(model, ids)
        ours = fused(
            hidden[0, :-1], head.weight, ids[0, 1:], bias=head.bias, transform=head.transform,
            with_entropy=False,
        ).logp  # fmt: skip
        if logits.shape[-1] != head.weight.shape[0]:
            raise _mismatch(model, head, math.inf, 0.0, seen, hidden, logits)
        theirs = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        tol = rounding_bound(hidden[0, :-1], head, logits[0, :-1])
    excess = (ours.double() - theirs).abs() / tol
    worst = int(excess.argmax())
    gap, bound = float((ours.double() - theirs).abs()[worst]), float(tol[worst])
    if not float(excess[worst]) <= 1.0:
        raise _mismatch(model, head, gap, bound, seen, hidden, logits)
    return HeadCheck(_name(model), head, gap, bound, int(ids.shape[1]) - 1, head.weight.dtype)


def _probe_ids(model: Any, head: Head, length: int) -> Tensor:
    """``[1, length]`` seeded random ids in ``[0, V)``, none of the config's special ids (an
    image or audio placeholder would ask for pixels)."""
    if length < 2:
        raise ValueError(f"length must be at least 2 (one token to predict), got {length}")
    vocab = head.weight.shape[0]
    inputs = getattr(_unwrap(model), "get_input_embeddings", lambda: None)()
    if isinstance(getattr(inputs, "weight", None), Tensor):  # a head wider than the input table
        vocab = min(vocab, inputs.weight.shape[0])
    special = set()
    for cfg in _configs(_unwrap(model).config):
        for key, value in vars(cfg).items():
            if key.endswith(("_id", "_index")) and isinstance(value, int):
                special.add(value)
    allowed = torch.tensor([i for i in range(vocab) if i not in special] or [0])
    gen = torch.Generator().manual_seed(0)
    pick = torch.randint(0, len(allowed), (1, length), generator=gen)
    return allowed[pick].to(head.weight.device)


def _configs(config: Any) -> list[Any]:
    """The config and its sub-configs (text, vision, ...), one level down."""
    subs = [v for v in vars(config).values() if hasattr(v, "model_type") and hasattr(v, "to_dict")]
    return [config, *subs]


class evaluating:
    """A context manager: ``model`` in eval mode for the duration, then every module's own
    training flag back (a model half in train mode stays so)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.flags: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> None:
        self.flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        for m, flag in self.flags:
            m.training = flag


def _own_forward(model: Any, ids: Tensor) -> tuple[dict[str, Tensor], Tensor]:
    """The model's logits ``[1, L, V]`` from its own forward, and what hooks saw on the way: the
    backbone's last hidden states, the output embeddings' input and output."""
    seen: dict[str, Tensor] = {}

    def keep(name: str, value: Any) -> None:
        if isinstance(value, Tensor) and value.is_floating_point() and name not in seen:
            seen[name] = value.detach()

    emb = _unwrap(model).get_output_embeddings()
    hooks = [
        backbone(model).register_forward_hook(lambda m, a, out: keep("backbone", _hidden_of(out))),
        emb.register_forward_pre_hook(lambda m, a: keep("head_in", a[0] if a else None)),
        emb.register_forward_hook(lambda m, a, out: keep("head_out", out)),
    ]
    try:
        kwargs = {"use_cache": False} if accepts_keyword(model, "use_cache") else {}
        out = model(input_ids=ids, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits if hasattr(out, "logits") else out[0]
    return seen, logits


def rounding_bound(hidden: Tensor, head: Head, logits: Tensor) -> Tensor:
    """Per token ``[L]``, the largest |log-prob gap| between the model's own logits ``[L, V]`` and
    the fused head on ``hidden [L, H]`` that rounding explains: :func:`check_head`'s bound.

    The model's logit ``x_v`` has error at most ``k u_d s |z|_max + λ √H u_acc s A_max`` with ``z =
    h·w_v + b_v``, ``A = |h|·|w_v| + |b_v|``, ``s`` the transform's scale, ``u_d`` the unit
    roundoff of the head's dtype or of the logits' own, the coarser, ``u_acc`` that of the GEMM's
    accumulation (float32 for half precision; TF32 where CUDA allows it for float32) and ``k`` the
    roundings after the GEMM (its output, the bias, the scale, the cap's three, two more for a
    split reduction, one for a cast of the logits); the log-prob moves by at most twice that. The
    fused head adds ``λ √(H + V) u_c (2 S + |L| + 1)``.
    """
    cd = torch.float64 if head.weight.dtype == torch.float64 else torch.float32
    h, w = hidden.to(cd), head.weight.to(cd)
    b = None if head.bias is None else head.bias.to(cd)
    z = h @ w.t() + (0 if b is None else b)
    size = h.abs() @ w.abs().t() + (0 if b is None else b.abs())
    tr = head.transform or LogitTransform()
    dtype = head.weight.dtype
    # The logits carry the coarser of the head's rounding and their own dtype's (a float64 model
    # whose forward takes `.float()` of its logits rounds them to float32).
    u_d = max(torch.finfo(dtype).eps, torch.finfo(logits.dtype).eps) / 2
    u_acc = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    if dtype == torch.float32 and head.weight.is_cuda and torch.backends.cuda.matmul.allow_tf32:
        u_acc = 2.0**-11
    k = 1 + (b is not None) + (tr.scale != 1.0) + 3 * (tr.softcap is not None)
    k += 2 if dtype in (torch.float16, torch.bfloat16) else 0
    k += 1 if logits.dtype != dtype else 0  # the cast
    n_h, vocab = h.shape[-1], w.shape[0]
    big_z = tr.scale * z.abs().amax(-1).double()
    big_a = tr.scale * size.amax(-1).double()
    model_err = k * u_d * big_z + LAMBDA * math.sqrt(n_h) * u_acc * big_a
    log_z = torch.logsumexp(logits.double(), -1).abs()
    u_c = 2.0**-53 if cd == torch.float64 else 2.0**-24
    ours = LAMBDA * math.sqrt(n_h + vocab) * u_c * (2 * big_a + log_z + 1)
    return 2 * model_err + ours


def _mismatch(
    model: Any,
    head: Head,
    gap: float,
    bound: float,
    seen: dict[str, Tensor],
    hidden: Tensor,
    logits: Tensor,
) -> HeadMismatch:
    """The HeadMismatch: the architecture, the gap, what differs, the fallback."""
    tr = head.transform
    what = "no transform" if tr is None else f"transform {tr}"
    reason = _diagnosis(head, seen, hidden, logits)
    message = (
        f"{_name(model)}: klpo's log-probs from the last hidden states and the output head "
        f"({what}) differ from the model's own by up to {gap:.3g} nats on a short probe, beyond "
        f"the {bound:.2g} its {str(head.weight.dtype).removeprefix('torch.')} rounding explains: "
        f"{reason}. klpo does not guess how a model computes its logits; {FALLBACK}"
    )
    return HeadMismatch(message, _name(model), reason, gap, bound)


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None or a.shape != b.shape:
        return False
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool((a.double() - b.double()).abs().max() <= 1e-3 * scale + 1e-6)


def _diagnosis(head: Head, seen: dict[str, Tensor], hidden: Tensor, logits: Tensor) -> str:
    """Which step of the model's own forward differs from klpo's reading of it."""
    if logits.shape[-1] != head.weight.shape[0]:
        return (
            f"the model's logits have {logits.shape[-1]} entries, its head {head.weight.shape[0]}"
        )
    if not _same(hidden, seen.get("backbone")):
        return "the backbone, run alone, gives other hidden states than inside the model's forward"
    if "head_in" not in seen:
        return "the model's forward computes its logits without calling its output embeddings"
    if not _same(seen["head_in"], seen["backbone"]):
        return "the output head's input is not the backbone's last hidden states"
    transform = head.transform or LogitTransform()
    out = seen.get("head_out")
    if out is not None and not _same(transform.apply(out.double()), logits.double()):
        return "the model changes its logits after the output head in a way klpo does not know"
    return "the model's logits are not the transform of its output head's output"


# One check per model object: model_logprobs checks a model the first time it sees it.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checked_head(model: Any) -> Head:
    """:func:`read_head`, checked against the model (:func:`check_head`) the first time this
    model object is seen in the process; later calls read the head again without the check."""
    if model not in _CHECKED:
        _CHECKED[model] = check_head(model)
    return read_head(model)


# --------------------------------------------------------------------------------------------
# A model's own log-probs: its backbone's hidden states and its head, with the head's transform.


def model_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    reference: torch.nn.Module | None = None,
    check: bool = True,
) -> FusedOutput:
    r"""A causal LM's own log-probs of ``input_ids[:, 1:]``, through the fused head.

    The path the trainer takes: the backbone's last hidden states (:func:`klpo.last_hidden`)
    and the output head with the architecture's logit transform (:func:`klpo.read_head`:
    Gemma's soft cap, Cohere's and Granite's scales), tile by tile (:func:`fused`), so the ``[B,
    L, V]`` logits are never made. Per position ``t`` of ``input_ids[:, 1:]``: ``logp = log
    pi_theta(input_ids[:, t + 1] | input_ids[:, :t + 1])`` with ``pi_theta = softmax(logits /
    temperature)``, the model's own ``logits``; optionally the entropy of ``pi_theta`` there and,
    with a ``reference`` model (detached, same vocabulary), the exact KL(pi_theta ‖ pi_ref) over
    the vocabulary (Amini, Vieira & Cotterell, arXiv:2504.10637).

    Example::

        from transformers import AutoModelForCausalLM, AutoTokenizer
        from klpo.logprobs import model_logprobs

        tok = AutoTokenizer.from_pretrained("google/gemma-2-2b-it")
        model = AutoModelForCausalLM.from_pretrained("google/gemma-2-2b-it")
        batch = tok(["The capital of France is Paris."], return_tensors="pt")
        out = model_logprobs(model, batch.input_ids, batch.attention_mask, with_entropy=True)
        out.logp  # [1, L - 1]: log pi(token | prefix), the soft cap included

    Gradients flow to the model's parameters as through ``model(...).logits`` (the reference gets
    none). Positions where ``attention_mask`` is 0 at the token or at the position before it
    (padding, and the first token after left padding) are 0 in every output and get no gradient.

    ``check`` (default) runs :func:`klpo.heads.check_head` the first time a model object is seen:
    a few tokens through the model's own forward; a model whose logits the head cannot give is
    refused there (:class:`klpo.heads.HeadMismatch`), never answered with wrong numbers.

    Args:
        model: a ``transformers`` causal LM (or a ``peft`` wrapper of one).
        input_ids: ``[B, L]`` token ids, ``L ≥ 2``.
        attention_mask: ``[B, L]``, 1 at tokens, 0 at padding (default: all 1).
        position_ids: ``[B, L]`` passed to the backbone as to ``model(...)`` (default: the
            model's own default).
        temperature: the sampling temperature the model's logits are divided by.
        with_entropy: also return the entropy.
        reference: a reference causal LM for the exact KL (run without gradients).
        check: check each model against its own forward once (see above).

    Returns:
        :class:`FusedOutput` ``(logp, entropy, kl)``, each ``[B, L - 1]`` float32 (float64 for a
        float64 model), ``entropy`` and ``kl`` None unless asked for.

    Raises:
        klpo.heads.UnsupportedHead: the model's logits are not its head's (with the fallback).
        ValueError: ``input_ids`` or ``attention_mask`` of the wrong shape or type.
    """
    _check_model_inputs(input_ids, attention_mask, position_ids)
    read = checked_head if check else read_head
    head = read(model)
    hidden = last_hidden(model, input_ids, attention_mask, position_ids)[:, :-1]
    ref = {}
    if reference is not None:
        ref = _reference_head(reference, read, input_ids, attention_mask, position_ids)
    out = fused(
        hidden, head.weight, input_ids[:, 1:], bias=head.bias, temperature=temperature,
        with_entropy=with_entropy, transform=head.transform, **ref,
    )  # fmt: skip
    if attention_mask is None:
        return out
    keep = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return FusedOutput(*(None if o is None else torch.where(keep, o, 0.0) for o in out))


def _reference_head(
    reference: torch.nn.Module,
    read,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
) -> dict:
    """:func:`fused`'s reference arguments from a reference model, its forward without gradients."""
    head = read(reference)
    with torch.no_grad():
        hidden = last_hidden(reference, input_ids, attention_mask, position_ids)[:, :-1]
    return dict(
        hidden_ref=hidden, weight_ref=head.weight, bias_ref=head.bias, transform_ref=head.transform
    )


def _check_model_inputs(
    input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None
) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dtype.is_floating_point:
        raise TypeError(f"input_ids must be an integer tensor of token ids, got {input_ids!r:.80}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids must be [B, L] with L ≥ 2 (a token to predict), got shape "
            f"{tuple(input_ids.shape)}"
        )
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} but input_ids has shape "
                f"{tuple(input_ids.shape)}; give one entry per token"
            )
