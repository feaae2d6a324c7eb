"""Held-out accuracy: greedy completions of held-out prompts, scored by a reward function.

:func:`generate` samples completions the way every decoder-only trainer must: prompts left-padded
(so the last prompt token sits next to the first new token), an attention mask over the padding,
position ids counted from the first real token (``generate`` derives them from the mask as
``cumsum(mask) - 1``), generation stopped at the EOS token, and each completion cut at its first
EOS before decoding. :func:`heldout_accuracy` is the greedy version, scored with a reward function;
:func:`policy_accuracy` that of a run's policy, during training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example
from klpo.train.models.backbone import unshard_root
from klpo.train.models.build import Models
from klpo.train.rewards import functions as rewards
from klpo.train.rewards.gold import eval_reward
from klpo.train.rollout.samplers import generate as rollout_generate

__all__ = ["generate", "heldout_accuracy", "policy_accuracy"]


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    sampler: str = "lean",
) -> list[str]:
    """Completions of ``prompts`` by a decoder-only ``transformers`` model, cut at the first EOS.

    Prompts are tokenized without special tokens and left-padded in batches of ``batch_size``
    (``generate`` then derives position ids from the attention mask, so padding changes nothing);
    generation stops at ``tokenizer.eos_token_id`` and the decoded completion excludes it and any
    padding. The model is put in eval mode for the call and restored afterwards; gradients are off.

    Args:
        model: a causal LM with ``generate`` (``transformers.PreTrainedModel``).
        tokenizer: its tokenizer, with ``pad_token_id`` and ``eos_token_id`` set.
        prompts: the prompt texts.
        max_new_tokens: the most tokens generated per completion, EOS included.
        batch_size: prompts per ``generate`` call.
        do_sample: sample (with ``temperature`` and ``top_p``, no top-k) from torch's global
            generator instead of greedy decoding.

    Returns:
        One completion text per prompt, in order.
    """

    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer needs pad_token_id and eos_token_id for batched generation; set "
            "tokenizer.pad_token (e.g. to its eos_token) first"
        )
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(
            f"max_new_tokens and batch_size must be >= 1, got {max_new_tokens} and {batch_size}"
        )
    if do_sample and not (temperature > 0 and 0 < top_p <= 1):
        raise ValueError(
            f"sampling needs temperature > 0 and top_p in (0, 1], got {temperature} and {top_p}"
        )
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start : start + batch_size])
            rollout = rollout_generate(
                model,
                tokenizer,
                batch,
                [""] * len(batch),
                group_size=1,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                greedy=not do_sample,
                sampler=sampler,
            )
            out.extend(rollout.completions)
    finally:
        model.train(was_training)
    return out


def heldout_accuracy(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    max_new_tokens: int,
    reward: str | Callable[..., Sequence[float]] = "exact_match",
    batch_size: int = 256,
    sampler: str = "lean",
) -> float:
    """Fraction of ``examples`` that the model solves with greedy decoding.

    ``accuracy = (1/N) sum_i reward(prompt_i, greedy completion_i, answer_i)``, with a reward in
    ``{0, 1}`` (``exact_match`` by default; any name or function of :mod:`klpo.train.rewards.functions`).
    Greedy decoding makes the number deterministic for a given model, so two checkpoints compare
    without sampling noise; its standard error as an estimate of the accuracy on the whole
    problem distribution is ``sqrt(acc (1 - acc) / N)`` (about 2.2 points at N = 500, acc = 0.5).

    Returns:
        The accuracy in ``[0, 1]``.
    """
    if not examples:
        raise ValueError("heldout_accuracy needs at least one example")
    fn = rewards.get_reward(reward) if isinstance(reward, str) else reward
    name = reward if isinstance(reward, str) else getattr(reward, "__name__", "reward")
    prompts = [e.prompt for e in examples]
    completions = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        sampler=sampler,
    )
    scores = rewards.score(fn, name, prompts, completions, [e.answer for e in examples])
    total = math.fsum(scores)
    return total / len(examples)


def policy_accuracy(cfg: TrainConfig, m: Models, heldout: list[Example]) -> float:
    """The run's policy's held-out accuracy, greedy, scored with the gold reward if there is
    one (:func:`klpo.train.rewards.gold.eval_reward`)."""
    unshard_root(m.backbone)  # generate calls the model outside the root's forward
    return heldout_accuracy(
        m.policy,
        m.tokenizer,
        heldout,
        max_new_tokens=cfg.rollout.max_new_tokens,
        reward=eval_reward(cfg),
        sampler=cfg.rollout.sampler,
    )
