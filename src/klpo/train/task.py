r"""The built-in task: small-number arithmetic with a verifiable answer, and held-out accuracy.

A problem is a prompt such as ``"47+38="`` and its answer ``"85"``; a policy is right when its
completion, cut at the end-of-sequence token, is the answer (the ``exact_match`` reward of
:mod:`klpo.train.rewards`; ``numeric`` agrees on this task). The problem space is enumerated
(every ordered pair of operands in ``[0, max_operand]`` for every operator in ``ops``), permuted by
a seeded generator, and cut into a held-out split (the first ``n_heldout`` problems of the
permutation) and a train split (the rest), so the two are disjoint by construction and identical
for the same arguments on every machine (the permutation uses only ``random.Random(seed).random()``,
whose sequence Python guarantees across platforms and versions).

:func:`generate` samples completions with the model's own ``generate``, the way every decoder-only
trainer must: prompts left-padded (so the last prompt token sits next to the first new token),
an attention mask over the padding, position ids counted from the first real token (``generate``
derives them from the mask as ``cumsum(mask) - 1``), generation stopped at the EOS token, and each
completion cut at its first EOS before decoding. :func:`heldout_accuracy` is the greedy version,
scored with a reward function.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from klpo.train.data import Example

__all__ = [
    "OPS",
    "ArithmeticTask",
    "Example",
    "generate",
    "heldout_accuracy",
]

# The operators the task knows, with their exact integer meaning.
OPS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


@dataclass(frozen=True)
class ArithmeticTask:
    """Small-number arithmetic: ``"a{op}b="`` → the decimal value, e.g. ``"47+38="`` → ``"85"``.

    Args:
        max_operand: operands are the integers ``0 ... max_operand``; ``99`` gives two-digit
            problems (10,000 per operator).
        ops: operators, any of ``"+"``, ``"-"``, ``"*"`` (``"-"`` can give negative answers).
        n_heldout: size of the held-out split; the rest of the problem space is the train split.
        seed: seeds the permutation that assigns problems to splits and orders them.
    """

    max_operand: int = 99
    ops: tuple[str, ...] = ("+",)
    n_heldout: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_operand, int) or self.max_operand < 1:
            raise ValueError(f"max_operand must be an integer >= 1, got {self.max_operand!r}")
        if not self.ops or any(op not in OPS for op in self.ops):
            raise ValueError(f"ops must be a non-empty subset of {list(OPS)}, got {self.ops!r}")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must not repeat an operator, got {self.ops!r}")
        size = len(self.ops) * (self.max_operand + 1) ** 2
        if not isinstance(self.n_heldout, int) or not 0 < self.n_heldout < size:
            raise ValueError(
                f"n_heldout must be an integer in [1, {size - 1}] (the problem space has {size} "
                f"problems and the train split needs at least one), got {self.n_heldout!r}"
            )

    @property
    def size(self) -> int:
        """The number of distinct problems, ``len(ops) * (max_operand + 1)²``."""
        return len(self.ops) * (self.max_operand + 1) ** 2

    def _permuted(self) -> list[Example]:
        problems = [
            Example(f"{a}{op}{b}=", str(OPS[op](a, b)))
            for op in self.ops
            for a in range(self.max_operand + 1)
            for b in range(self.max_operand + 1)
        ]
        # Fisher-Yates driven by Random.random(), whose sequence for a given seed Python
        # guarantees across versions (Random.shuffle's use of randbelow is not guaranteed).
        rng = random.Random(self.seed)
        for i in range(len(problems) - 1, 0, -1):
            j = int(rng.random() * (i + 1))
            problems[i], problems[j] = problems[j], problems[i]
        return problems

    def splits(self) -> tuple[list[Example], list[Example]]:
        """``(train, heldout)``: disjoint, covering the problem space, deterministic in the seed."""
        problems = self._permuted()
        return problems[self.n_heldout :], problems[: self.n_heldout]

    @property
    def train(self) -> list[Example]:
        """The train split (every problem not held out), in a seeded order."""
        return self.splits()[0]

    @property
    def heldout(self) -> list[Example]:
        """The held-out split of ``n_heldout`` problems."""
        return self.splits()[1]

    def max_answer_chars(self) -> int:
        """The longest answer in characters; ``max_new_tokens`` must be at least this plus 1 (EOS)."""
        m = self.max_operand
        extremes = [OPS[op](a, b) for op in self.ops for a in (0, m) for b in (0, m)]
        return max(len(str(v)) for v in extremes)


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
    from klpo.train.rollout import generate as rollout_generate

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
    ``{0, 1}`` (``exact_match`` by default; any name or function of :mod:`klpo.train.rewards`).
    Greedy decoding makes the number deterministic for a given model, so two checkpoints compare
    without sampling noise; its standard error as an estimate of the accuracy on the whole
    problem distribution is ``sqrt(acc (1 - acc) / N)`` (about 2.2 points at N = 500, acc = 0.5).

    Returns:
        The accuracy in ``[0, 1]``.
    """
    from klpo.train import rewards

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
