"""The policy's, the reference's and the critic's forward: last hidden states, never logits.

The update never asks the model for its ``[B, L, V]`` logits. :class:`Backbone` returns the last
hidden states, and the log-probs, entropy and exact KL come from the output head chunk by chunk
(:func:`klpo.logprobs.fused`). Going through a module's ``forward`` keeps DDP's hooks in place.
Under FSDP the head is gathered whole for a pass (:func:`unshard_root`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from klpo.train.models.load import autocast, cache_kwargs, output_cache, transformer


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
    embeddings, the final norm and the head (:mod:`klpo.train.models.fsdp`).
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

        Under FSDP the head is unsharded for the pass (:func:`unshard_root`):
        the fused log-prob/KL pass reads it tile by tile many times, so one all-gather per pass
        beats one per tile, and its gradient reaches the shards through FSDP's reduce-scatter.
        """
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
