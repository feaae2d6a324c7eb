r"""The built-in task: small-number arithmetic with a verifiable answer.

A problem is a prompt such as ``"47+38="`` and its answer ``"85"``; a policy is right when its
completion, cut at the end-of-sequence token, is the answer (the ``exact_match`` reward of
:mod:`klpo.train.rewards.functions`; ``numeric`` agrees on this task). The problem space is enumerated
(every ordered pair of operands in ``[0, max_operand]`` for every operator in ``ops``), permuted by
a seeded generator, and cut into a held-out split (the first ``n_heldout`` problems of the
permutation) and a train split (the rest), so the two are disjoint by construction and identical
for the same arguments on every machine (the permutation uses only ``random.Random(seed).random()``,
whose sequence Python guarantees across platforms and versions).

Its held-out accuracy is measured by :func:`klpo.train.evaluate.heldout_accuracy`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from klpo.train.data.sources import Example

__all__ = [
    "OPS",
    "ArithmeticTask",
    "Example",
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
