r"""The built-in chat task: arithmetic and word problems for an instruction-tuned model.

``data.source: builtin-chat-arith``. Each problem is a short conversation that a chat template
renders (``data.chat: true``): a system prompt asking for the bare number, solved examples (each a
user turn and the assistant's answer, the few-shot format of Brown et al. 2020,
arXiv:2005.14165), then the question, ending "Answer with just the number." The solved examples
are ``data.shots``: ``one`` (an addition, the default), ``per-kind`` (one of each kind below, so
that a word problem's bare answer has been seen once) or ``none``. The answer is the
decimal value, scored by the ``numeric`` reward (the completion's last number;
:func:`klpo.train.rewards.functions.extract_number`), so "42", "42." and "17 + 25 = 42" are right
and "17 + 25 = 32" is not.

Four kinds of problem, drawn with equal weight:

======  ============================================================  ===========================
kind    question                                                      answer
======  ============================================================  ===========================
add     ``What is 47 + 38?``                                          a + b, two-digit operands
more    ``Mia has 23 apples. She gets 15 more. How many apples ...``  a + b
left    ``Leo had 52 marbles. He gave away 17. How many marbles ...`` a - b, with a > b
groups  ``Ava has 4 boxes with 6 pens in each. How many pens ...``    a * b, a in 2..9, b in 2..12
======  ============================================================  ===========================

**Without a chat template** (``data.chat: false``, a base model such as Gemma 3 270M): the same
conversation as plain text, the few-shot layout of a base model's prompt: the system prompt, a
blank line, then each solved example as ``Question: ...`` and ``Answer: 19`` lines, a blank line
after each, and the question ending with ``Answer:`` (:func:`plain_prompt`). The tokenizer then
adds its own special tokens once (Gemma's BOS; :class:`klpo.train.models.tokens.Codec`), and a
completion ends at its first newline (``rollout.stop`` defaults to newlines there:
:data:`klpo.train.config.PLAIN_CHAT_STOP`), where the next question would begin.

The problems come from ``random.Random(seed).random()`` alone (whose sequence Python guarantees
across platforms and versions), distinct by question text; the first ``n_heldout`` are the
held-out split and the next ``n_train`` the train split, so the two are disjoint by construction
and the same on every machine. Docs: docs/real-models.md, "The real-model job".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from klpo.train.data.sources import Example

__all__ = ["KINDS", "SHOTS", "SYSTEM_PROMPT", "ChatArithmeticTask", "plain_prompt"]

SYSTEM_PROMPT = (
    "You are a calculator. Solve the problem and reply with only the final number: "
    "no words, no units, no working."
)
"""The system message of every problem."""

INSTRUCTION = "Answer with just the number."
"""The sentence that ends every user turn."""

ONE_SHOT = (f"What is 12 + 7? {INSTRUCTION}", "19")
"""The solved example (user turn, assistant turn) before each question (``shots: one``)."""

PER_KIND = (
    ONE_SHOT,
    (f"Kim has 31 cards. She gets 12 more. How many cards does Kim have now? {INSTRUCTION}", "43"),
    (f"Raj had 45 coins. He gave away 18. How many coins are left? {INSTRUCTION}", "27"),
    (f"Lia has 3 bags with 8 shells in each. How many shells is that in all? {INSTRUCTION}", "24"),
)
"""One solved example of each kind, in the order of :data:`KINDS` (``shots: per-kind``); their
names are none of the problems' names, so no example is a problem of either split."""

SHOTS = {"one": (ONE_SHOT,), "per-kind": PER_KIND, "none": ()}
"""The solved examples before each question, by the name ``data.shots`` gives."""

KINDS = ("add", "more", "left", "groups")
"""The kinds of problem, drawn with equal weight."""

_NAMES = (
    ("Mia", "She"), ("Leo", "He"), ("Ava", "She"), ("Sam", "He"), ("Zoe", "She"),
    ("Ben", "He"), ("Ivy", "She"), ("Max", "He"), ("Ana", "She"), ("Tom", "He"),
)  # fmt: skip
_THINGS = ("apples", "marbles", "stickers", "pencils", "cards", "coins", "books", "shells")
_BOXES = ("boxes", "bags", "rows", "packs", "jars", "shelves")


def plain_prompt(messages: tuple[tuple[str, str], ...]) -> str:
    """The chat task's messages as the plain-text prompt of a model without a chat template.

    >>> print(plain_prompt((("system", "Be brief."), ("user", "What is 1 + 1?"),
    ...                     ("assistant", "2"), ("user", "What is 2 + 3?"))))
    Be brief.
    <BLANKLINE>
    Question: What is 1 + 1?
    Answer: 2
    <BLANKLINE>
    Question: What is 2 + 3?
    Answer:

    Raises:
        ValueError: a role is not system (first only), user or assistant, or the last message
            is not the user's.
    """
    parts: list[str] = []
    for i, (role, content) in enumerate(messages):
        if role == "system" and i == 0:
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"Question: {content}\nAnswer:")
        elif role == "assistant" and parts and parts[-1].endswith("Answer:"):
            parts.append(f" {content}\n\n")
        else:
            raise ValueError(f"message {i} ({role!r}) has no place in a plain-text prompt")
    if not parts or not parts[-1].endswith("Answer:"):
        raise ValueError("a plain-text prompt must end with a user message (the question)")
    return "".join(parts)


def _pick(rng: random.Random, seq: tuple) -> object:
    return seq[int(rng.random() * len(seq))]


def _int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in ``[lo, hi]`` from ``rng.random()`` alone (``randint`` is not guaranteed to
    give the same sequence across Python versions)."""
    return lo + int(rng.random() * (hi - lo + 1))


def _problem(rng: random.Random) -> tuple[str, str, int]:
    """(kind, question, answer) of one problem drawn from ``rng``."""
    kind = _pick(rng, KINDS)
    name, pronoun = _pick(rng, _NAMES)
    thing = _pick(rng, _THINGS)
    if kind == "add":
        a, b = _int(rng, 10, 99), _int(rng, 10, 99)
        return kind, f"What is {a} + {b}?", a + b
    if kind == "more":
        a, b = _int(rng, 10, 99), _int(rng, 10, 99)
        q = f"{name} has {a} {thing}. {pronoun} gets {b} more. How many {thing} does {name} have now?"
        return kind, q, a + b
    if kind == "left":
        a = _int(rng, 20, 99)
        b = _int(rng, 10, a - 1)
        q = f"{name} had {a} {thing}. {pronoun} gave away {b}. How many {thing} are left?"
        return kind, q, a - b
    a, b = _int(rng, 2, 9), _int(rng, 2, 12)
    box = _pick(rng, _BOXES)
    q = f"{name} has {a} {box} with {b} {thing} in each. How many {thing} is that in all?"
    return kind, q, a * b


@dataclass(frozen=True)
class ChatArithmeticTask:
    """Arithmetic and word problems as chat messages, with their answers.

    Args:
        n_heldout: problems in the held-out split (the first drawn).
        n_train: problems in the train split (the next drawn, distinct from the held-out ones).
        seed: seeds the draw.
        shots: the solved examples before each question, a key of :data:`SHOTS`; the problems
            drawn do not depend on it.
        chat: each prompt as chat messages for a chat template (default), or as plain text
            (:func:`plain_prompt`) for a model without one.
    """

    n_heldout: int = 500
    n_train: int = 5000
    seed: int = 0
    shots: str = "one"
    chat: bool = True

    def __post_init__(self) -> None:
        if self.shots not in SHOTS:
            raise ValueError(f"shots must be one of {', '.join(SHOTS)}, got {self.shots!r}")
        for name in ("n_heldout", "n_train"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 50_000:
                raise ValueError(f"{name} must be an integer in [1, 50000], got {v!r}")

    def problems(self) -> list[tuple[str, str, int]]:
        """``n_heldout + n_train`` distinct (kind, question, answer) triples, in draw order."""
        rng = random.Random(self.seed)
        seen: set[str] = set()
        out = []
        while len(out) < self.n_heldout + self.n_train:
            kind, q, ans = _problem(rng)
            if q not in seen:
                seen.add(q)
                out.append((kind, q, ans))
        return out

    def example(self, kind: str, question: str, answer: int) -> Example:
        """The problem as an :class:`Example`: the system prompt, the solved examples and the
        question as chat messages (or, with ``chat`` off, as their plain text); the answer as
        its decimal string; ``kind`` in the row."""
        shots = tuple(m for q, a in SHOTS[self.shots] for m in (("user", q), ("assistant", a)))
        messages = (("system", SYSTEM_PROMPT), *shots, ("user", f"{question} {INSTRUCTION}"))
        if not self.chat:
            text = plain_prompt(messages)
            row = {"prompt": text, "answer": str(answer), "kind": kind}
            return Example(prompt=text, answer=str(answer), row=row)
        row = {"prompt": [{"role": r, "content": c} for r, c in messages], "answer": str(answer)}
        return Example(prompt="", answer=str(answer), messages=messages, row={**row, "kind": kind})

    def splits(self) -> tuple[list[Example], list[Example]]:
        """``(train, heldout)``: disjoint, deterministic in the seed."""
        examples = [
            replace(self.example(*p), where=f"builtin-chat-arith[{i}]")
            for i, p in enumerate(self.problems())
        ]
        return examples[self.n_heldout :], examples[: self.n_heldout]
