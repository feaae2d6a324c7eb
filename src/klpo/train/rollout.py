"""Sampling completions with ``generate`` and laying them out as per-token tensors.

Decoder-only models are padded on the **left** for generation, so every prompt ends at the same
column and the completions start together. A completion is valid up to and including its first
EOS; everything after it is padding (``mask`` False). Position ids are recomputed from the
attention mask (``cumsum - 1``) for every forward pass, as ``generate`` does, so the log-probs of
the update are those of the sampling distribution.

Shapes: B sequences (prompts × group size), P prompt columns, C completion columns, H hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import GenerationConfig


@dataclass
class Rollout:
    """One batch of sampled completions, grouped: rows ``g*G .. g*G+G-1`` share prompt ``g``."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] bool
    completion_ids: Tensor  # [B, C] right-padded after EOS
    mask: Tensor  # [B, C] bool, True up to and including the first EOS
    prompts: list[str]  # [B] prompt texts (repeated G times)
    completions: list[str]  # [B] decoded completions, special tokens removed
    answers: list[str]  # [B] reference answers (repeated G times)
    group_size: int
    truncated: Tensor = field(default=None)  # [B] bool: no EOS within max_new_tokens

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.mask], dim=1)

    def select(self, rows: Tensor | list[int]) -> Rollout:
        """The rollout restricted to some rows (a micro-batch, or one rank's share)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        pick = idx.tolist()
        return Rollout(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            completion_ids=self.completion_ids[idx],
            mask=self.mask[idx],
            prompts=[self.prompts[i] for i in pick],
            completions=[self.completions[i] for i in pick],
            answers=[self.answers[i] for i in pick],
            group_size=self.group_size,
            truncated=None if self.truncated is None else self.truncated[idx],
        )


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over the real tokens only, as ``generate`` does with left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids: Tensor, eos_token_id: int | list[int]) -> tuple[Tensor, Tensor]:
    """(mask, truncated): True up to and including the first EOS; truncated where none came."""
    eos = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    is_eos = torch.isin(completion_ids, eos)
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return ~seen_before, ~is_eos.any(-1)


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    max_prompt_tokens: int | None = None,
    synced: bool = False,
) -> Rollout:
    """Sample ``group_size`` completions for each prompt with ``model.generate``.

    Sampling is from softmax(logits / temperature) restricted by ``top_p`` only: ``top_k`` is
    switched off (transformers' default of 50 would silently sample from a distribution other
    than the policy's, biasing every estimator), and no repetition penalty applies.
    ``synced`` keeps every rank decoding until all are done (transformers' ``synced_gpus``):
    a sharded model's forward is collective, so no rank may stop early.
    """
    texts = [p for p in prompts for _ in range(group_size)]
    refs = [a for a in answers for _ in range(group_size)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=True)
    if max_prompt_tokens is not None:
        lengths = enc["attention_mask"].sum(-1)
        too_long = (lengths > max_prompt_tokens).nonzero().flatten().tolist()
        if too_long:
            i = too_long[0] // group_size
            raise ValueError(
                f"prompt {i} is {int(lengths[too_long[0]])} tokens long, more than "
                f"data.max_prompt_tokens={max_prompt_tokens}: {prompts[i][:80]!r}"
            )
    gen_cfg = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else top_p,
        top_k=None if greedy else 0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=enc["input_ids"].to(device),
        attention_mask=enc["attention_mask"].to(device),
        generation_config=gen_cfg,
        synced_gpus=synced,
    )
    p = enc["input_ids"].shape[1]
    completion_ids = out[:, p:].cpu()
    if completion_ids.shape[1] == 0:
        completion_ids = torch.full((len(texts), 1), tokenizer.pad_token_id)
    mask, truncated = completion_mask(completion_ids, tokenizer.eos_token_id)
    completion_ids = torch.where(mask, completion_ids, tokenizer.pad_token_id)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Rollout(
        prompt_ids=enc["input_ids"],
        prompt_mask=enc["attention_mask"].bool(),
        completion_ids=completion_ids,
        mask=mask,
        prompts=texts,
        completions=completions,
        answers=refs,
        group_size=group_size,
        truncated=truncated,
    )


def completion_hidden(backbone, rollout: Rollout) -> Tensor:
    """``[B, C, H]`` last hidden states at the positions that predict each completion token.

    ``backbone`` maps (input_ids, attention_mask, position_ids) to hidden states ``[B, L, H]``
    (see :class:`klpo.train.models.Backbone`); the state at column P - 1 + t predicts token t.
    """
    device = next(backbone.parameters()).device
    ids = rollout.input_ids.to(device)
    att = rollout.attention_mask.to(device)
    hidden = backbone(ids, att, position_ids(att))
    p = rollout.prompt_ids.shape[1]
    c = rollout.completion_ids.shape[1]
    return hidden[:, p - 1 : p - 1 + c]
