"""The policy's, the reference's and the critic's forward: last hidden states, or the model's logits.

By default (``model.logits_path: fused``) the step never asks the model for its ``[B, L, V]``
logits: :class:`Backbone` returns the last hidden states, and the log-probs, entropy and exact KL
come from the output head chunk by chunk (:func:`klpo.logprobs.fused`) with the architecture's
logit transform (:func:`klpo.heads.read_head`: Gemma's soft cap, Cohere's and Granite's scales),
which the load checks against the model's own forward (:func:`klpo.heads.check_head`). With
``model.logits_path: model``, the fallback for a model whose logits its head cannot give, the
Backbone returns the model's own logits and the same three come from them
(:func:`klpo.logprobs.from_logits`): slower, and the ``[tokens, V]`` logits are held.
:func:`token_outputs` is the step's one call either way. Going through a module's ``forward``
keeps DDP's hooks in place. Under FSDP the head is gathered whole for a pass
(:func:`unshard_root`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from klpo import logprobs
from klpo.heads import Head, read_head
from klpo.train.models.cache import cache_support
from klpo.train.models.load import autocast, cache_kwargs, output_cache, transformer

__all__ = [
    "OWN_LOGITS",
    "Backbone",
    "Critic",
    "ModelHead",
    "OwnLogits",
    "router_aux_loss",
    "shares_prompt",
    "token_outputs",
    "unshard_root",
]


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def unshard_root(module: nn.Module) -> None:
    """All-gather the root unit's parameters (a no-op when not sharded or already whole).

    The fused log-prob / exact-KL pass (:func:`klpo.logprobs.fused`) reads the output head
    outside the module's forward, tile by tile. We unshard the head for the whole pass rather
    than gather it per tile: the pass visits every tile in the forward and again in the
    backward, so per-tile gathers would move the head over the network ~2·V/vocab_chunk times
    instead of once, and the whole head ([V, H], 0.5 GB in bf16 for a 128k × 2k model) is small
    beside the activations it saves. The gradient the pass puts on the unsharded head is
    reduce-scattered into the shards by FSDP's post-backward, like the root's other gradients.
    """
    if is_sharded(module):
        module.unshard()


def shares_prompt(cfg: Any) -> bool:
    """Whether the step's forwards compute each group's prompt once (``rollout.share_prompt``).

    Not when the policy is checkpointed (``model.gradient_checkpointing``): checkpointed layers
    keep no cache, so the update runs every row whole (:meth:`Backbone._features`), and then every
    other pass of the step does too, the reference's and pi_old's scoring passes included. The
    two ways are equal in exact arithmetic but round differently (the cached prompt's keys and
    values against the whole row's attention; in bf16 by ~1e-2 nats on a 30-layer model), so
    scoring one way and updating the other would make log pi_theta differ from log pi_ref and
    log pi_old at step 1, where the three are one policy.
    """
    return bool(cfg.rollout.share_prompt) and not cfg.model.gradient_checkpointing


@dataclass(frozen=True)
class OwnLogits:
    """The head of ``model.logits_path: model``: the features are the model's own logits."""


OWN_LOGITS = OwnLogits()
ModelHead = Head | OwnLogits
"""What :meth:`Backbone.head` returns: the output head with its transform, or :data:`OWN_LOGITS`."""


def token_outputs(
    features: Tensor,
    head: ModelHead,
    tokens: Tensor,
    *,
    temperature: float,
    features_ref: Tensor | None = None,
    head_ref: ModelHead | None = None,
    with_entropy: bool = True,
) -> logprobs.FusedOutput:
    """Log-probs of ``tokens [B, C]``, the entropy and, with the reference's features, the exact
    KL(pi_theta ‖ pi_ref), from a :class:`Backbone`'s features ``[B, C, H]`` (or ``[B, C, V]``
    logits) and head: :func:`klpo.logprobs.fused` with the head's transform, or
    :func:`klpo.logprobs.from_logits`. The reference's features are detached."""
    if isinstance(head, OwnLogits):
        if features_ref is not None and not isinstance(head_ref, OwnLogits):
            raise TypeError("the policy's and the reference's features must be of one kind")
        return logprobs.from_logits(
            features, tokens, temperature=temperature, logits_ref=features_ref,
            with_entropy=with_entropy,
        )  # fmt: skip
    return logprobs.fused(
        features, head.weight, tokens, bias=head.bias, transform=head.transform,
        temperature=temperature, with_entropy=with_entropy, **reference_args(features_ref, head_ref),
    )  # fmt: skip


def reference_args(features_ref: Tensor | None, head_ref: ModelHead | None) -> dict[str, Any]:
    """:func:`klpo.logprobs.fused`'s (and ``fused_loss``'s) reference keywords, or none."""
    if features_ref is None:
        return {}
    if not isinstance(head_ref, Head):
        raise TypeError("the policy's and the reference's features must be of one kind")
    return dict(
        hidden_ref=features_ref,
        weight_ref=head_ref.weight,
        bias_ref=head_ref.bias,
        transform_ref=head_ref.transform,
    )


def router_aux_loss(model: nn.Module, parts: list[tuple[Any, Tensor]]) -> Tensor:
    """The mixture-of-experts load-balancing loss over the tokens some forwards computed.

    ``parts`` are ``(output, mask [b, l])`` pairs: a forward's output, run with
    ``output_router_logits=True``, and the attention mask of the tokens it computed. The router
    logits of the real tokens of every part (every layer's, pooled) go to transformers' own
    ``load_balancing_loss_func`` (Mixtral's, which its MoE families share; Fedus et al. 2021,
    Switch Transformers, arXiv:2101.03961, eq. 4: ``E sum_e f_e P_e`` with ``f_e`` the fraction of
    routing choices that pick expert ``e`` and ``P_e`` its mean router probability), the loss the
    model's own forward returns as ``aux_loss``. With a shared prompt the prompt's tokens count
    once per group: the tokens the experts computed.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text = model.config.get_text_config()
    experts = next(
        getattr(text, k)
        for k in ("num_experts", "num_local_experts", "n_routed_experts")
        if getattr(text, k, None)
    )
    layers: list[list[Tensor]] = []
    for out, mask in parts:
        gates = getattr(out, "router_logits", None)
        if not gates:
            raise RuntimeError(
                f"{type(model).__name__} returned no router logits for the load-balancing loss; "
                "set algo.router_aux_loss_coef: 0"
            )
        real = mask.reshape(-1).bool()
        for i, gate in enumerate(gates):
            rows = gate.reshape(-1, gate.shape[-1])
            if rows.shape[0] != real.numel():
                raise RuntimeError(
                    f"{type(model).__name__}'s router logits have {rows.shape[0]} rows for "
                    f"{real.numel()} tokens; set algo.router_aux_loss_coef: 0"
                )
            if i == len(layers):
                layers.append([])
            layers[i].append(rows[real])
    gate_logits = tuple(torch.cat(rows) for rows in layers)
    return load_balancing_loss_func(gate_logits, experts, text.num_experts_per_tok, None)


class Backbone(nn.Module):
    """``forward(input_ids, attention_mask, position_ids) -> [B, L, H]`` last hidden states, or
    (``logits_path="model"``) ``[B, L, V]`` the model's own logits; with ``keep = k > 0``, the
    last ``k`` positions only (the model computes logits for those alone where it can).

    With ``group > 1`` and ``prefix = P``, rows ``g*group .. g*group + group - 1`` share their first
    ``P`` columns (one prompt, ``group`` completions, as GRPO samples them): the prompt is run once
    per group, its keys and values are repeated ``group`` times (autograd flows back through the
    repeat, so every completion's gradient reaches the shared prompt's activations, summed), and
    the completion columns attend to them through the cache. The hidden states and parameter
    gradients are those of the unshared forward (tested in float64); the prompt's compute drops by
    the factor ``group``. A model whose cache cannot be repeated that way (recurrent state,
    :func:`klpo.train.models.cache.cache_support`) runs every row whole.

    With ``packed``, the rows are packs of sequences laid end to end
    (:mod:`klpo.train.models.packing`): ``attention_mask`` is then the packs' real tokens (for
    the router's loss alone), the model gets none and masks by the position ids, which restart
    at each sequence (``algo.packing``).

    ``compute_dtype`` bfloat16 runs the forward under :func:`autocast` (mixed precision). Under
    FSDP this module is the root of the sharding, so its own parameter group holds the
    embeddings, the final norm and the head (:mod:`klpo.train.models.fsdp`). With
    ``router_aux`` (a mixture-of-experts policy, ``algo.router_aux_loss_coef``) a forward with
    gradients also computes the load-balancing loss (:func:`router_aux_loss`), which the update
    takes with :meth:`take_router_aux`.
    """

    def __init__(
        self,
        model: nn.Module,
        compute_dtype: torch.dtype | None = None,
        *,
        logits_path: str = "fused",
        router_aux: bool = False,
    ):
        super().__init__()
        self.model = model
        self.compute_dtype = compute_dtype
        self.own_logits = logits_path == "model"
        self.router_aux = router_aux
        self._aux: Tensor | None = None

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        *,
        prefix: int = 0,
        group: int = 1,
        keep: int = 0,
        packed: bool = False,
    ) -> Tensor:
        with autocast(self.compute_dtype, input_ids.device):
            if packed:
                return self._packed(input_ids, attention_mask, position_ids)
            return self._features(input_ids, attention_mask, position_ids, prefix, group, keep)

    def _packed(self, input_ids: Tensor, real: Tensor, position_ids: Tensor) -> Tensor:
        """The features of packed rows (:mod:`klpo.train.models.packing`): no attention mask,
        so the model builds its block-diagonal causal mask from the position ids, which restart
        at each sequence; ``real`` (the sequences' tokens, not filler) is read by the router's
        load-balancing loss alone."""
        module = self.model if self.own_logits else transformer(self.model)
        kwargs = dict(input_ids=input_ids, attention_mask=None, position_ids=position_ids)
        out, features = self._run(module, dict(kwargs, use_cache=False), 0)
        self._keep_aux([(out, real)])
        return features

    def _features(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        prefix: int,
        group: int,
        keep: int,
    ) -> Tensor:
        base = transformer(self.model)
        module = self.model if self.own_logits else base
        # Checkpointed layers keep no cache, so a shared prompt could not reach the completions.
        checkpointed = (
            getattr(base, "gradient_checkpointing", False)
            and base.training
            and torch.is_grad_enabled()
        )
        whole = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        if (
            group <= 1
            or prefix <= 0
            or prefix >= input_ids.shape[1]
            or checkpointed
            or not cache_support(self.model).shared
        ):
            out, features = self._run(module, dict(whole, use_cache=False), keep)
            self._keep_aux([(out, attention_mask)])
            return features
        first = slice(None, None, group)  # one row per group
        tail = input_ids.shape[1] - prefix
        prompt = {k: v[first, :prefix] for k, v in whole.items()}
        prompt_keep = max(keep - tail, 1) if keep else 0  # the prompt's positions to return
        first_out, shared = self._run(module, dict(prompt, use_cache=True), prompt_keep)
        cache = output_cache(first_out)
        if cache is None:  # a model that returns no cache here: unshared
            out, features = self._run(module, dict(whole, use_cache=False), keep)
            self._keep_aux([(out, attention_mask)])
            return features
        cache.batch_repeat_interleave(group)
        rest, features = self._run(
            module,
            dict(
                input_ids=input_ids[:, prefix:],
                attention_mask=attention_mask,
                position_ids=position_ids[:, prefix:],
                **cache_kwargs(module, cache),
                use_cache=True,
            ),
            0,
        )
        self._keep_aux([(first_out, prompt["attention_mask"]), (rest, attention_mask[:, prefix:])])
        features = torch.cat([shared.repeat_interleave(group, dim=0), features], dim=1)
        return features[:, -keep:] if keep else features

    def _run(self, module: nn.Module, kwargs: dict[str, Any], keep: int) -> tuple[Any, Tensor]:
        """``module``'s output and its features (last ``keep`` positions; 0: all)."""
        if self.own_logits and keep:
            kwargs["logits_to_keep"] = keep
        if self.router_aux and torch.is_grad_enabled():
            kwargs["output_router_logits"] = True
        out = module(**kwargs)
        features = out.logits if self.own_logits else out.last_hidden_state
        return out, features[:, -keep:] if keep else features

    def _keep_aux(self, parts: list[tuple[Any, Tensor]]) -> None:
        if self.router_aux and torch.is_grad_enabled():
            self._aux = router_aux_loss(self.model, parts)

    def take_router_aux(self) -> Tensor | None:
        """The load-balancing loss of the last forward with gradients (then forgotten), or None."""
        aux, self._aux = self._aux, None
        return aux

    def head(self) -> ModelHead:
        """The output head, whole, with the architecture's logit transform
        (:func:`klpo.heads.read_head`: weight [V, H], bias [V] or None, transform), or
        :data:`OWN_LOGITS` with ``logits_path="model"``.

        Under FSDP the head is unsharded for the pass (:func:`unshard_root`):
        the fused log-prob/KL pass reads it tile by tile many times, so one all-gather per pass
        beats one per tile, and its gradient reaches the shards through FSDP's reduce-scatter.
        """
        unshard_root(self)
        return OWN_LOGITS if self.own_logits else read_head(self.model)


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
        packed: bool = False,
    ) -> Tensor:
        h = self.backbone(
            input_ids, attention_mask, position_ids, prefix=prefix, group=group, packed=packed
        )
        return self.value_head(h.to(self.value_head.weight.dtype)).squeeze(-1).float()
