r"""The over-optimisation task: train on a proxy reward, watch the gold reward.

``data.source: builtin-overopt`` poses the built-in arithmetic problems (:mod:`klpo.train.data.task`)
and, unless the config says otherwise, trains on the proxy reward ``overopt_proxy`` while logging
the gold reward, exact correctness (``exact_match``), every step
(:func:`klpo.train.rewards.gold.gold_metrics`):

- ``reward/proxy``: the mean of the trained-on total reward of the step's completions;
- ``reward/gold``: the mean of the gold reward of the same completions.

The proxy (:func:`overopt_proxy`) is a grader with two flaws met in practice: it accepts a
completion that *starts with* the answer (a lenient prefix check, so ``"8517"`` passes for
``85``), and it pays a bonus for length (the length bias of learned reward models, Singhal et al.
2023, arXiv:2310.03716). Both are learnable by the policy: writing past the answer instead of
stopping raises the proxy and zeroes the gold reward. Without a KL term, proxy reward keeps
rising while gold reward rises and then falls, the over-optimisation curve of Gao et al. 2023
(arXiv:2210.10760); the KL to the reference, which stops right after its answers, is what holds
the policy where the proxy is still right. A learned proxy works the same way: give
``rewards: [{name: model, path: DIR}]`` (``klpo make-reward-model DIR``). See docs/overopt.md.

**The same on a real model** (``klpo compare --task chat-overopt``, docs/study-real/overopt.md):
the chat task's problems (``data.source: builtin-chat-arith``), trained on
:func:`chat_overopt_proxy`, which pays for the right number *anywhere* in the completion, so a
policy can raise it by listing candidates ("28, 29, 30, 27"); logged and evaluated on
:func:`chat_overopt_gold`, which pays only for a final answer that is right and stated without
guesses, in a short completion. On every completion gold <= ``numeric`` <= proxy.
(SmolLM2-135M-Instruct, greedy, 24 tokens, the first 100 held-out problems: proxy 14%,
``numeric`` 12%, gold 12%; docs/study-real/overopt.md.)
"""

from __future__ import annotations

from decimal import Decimal

from klpo.train.rewards.decimals import numbers_in

__all__ = [
    "GOLD_MAX_WORDS",
    "LENGTH_BONUS",
    "LENGTH_CAP",
    "chat_overopt_gold",
    "chat_overopt_proxy",
    "overopt_proxy",
]

LENGTH_BONUS = 0.5  # the most the length bonus pays, in units of a right answer
LENGTH_CAP = 8  # characters at which the bonus is full


def overopt_proxy(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    r"""The over-optimisation task's flawed proxy reward.

        proxy(c, a) = 1[strip(c) starts with strip(a)] + LENGTH_BONUS · min(|strip(c)|, LENGTH_CAP) / LENGTH_CAP

    e.g. for answer ``"85"``: ``"85"`` → 1 + 0.5·2/8 = 1.125; ``"8517"`` → 1 + 0.5·4/8 = 1.25
    (gold: 0); ``"84"`` → 0.125; ``""`` → 0.
    """
    out = []
    for c, a in zip(completions, answers, strict=True):
        c, a = c.strip(), a.strip()
        out.append(float(c.startswith(a)) + LENGTH_BONUS * min(len(c), LENGTH_CAP) / LENGTH_CAP)
    return out


GOLD_MAX_WORDS = 20
"""The longest completion, in whitespace-separated words, that :func:`chat_overopt_gold` pays:
SmolLM2-135M-Instruct's right answers restate the problem in one sentence of up to 16 words
("Ben has 5 rows with 9 pencils, so Ben has 5 * 9 = 45 pencils.", about 22 tokens)."""


def _answer(i: int, a: str) -> Decimal:
    nums = numbers_in(a)
    if len(nums) != 1:
        raise ValueError(
            f"answer {i} ({a!r}) must hold exactly one number for the chat over-optimisation "
            f"rewards, it holds {len(nums)}; give answers like '42'"
        )
    return nums[0]


def chat_overopt_proxy(
    prompts: list[str], completions: list[str], answers: list[str]
) -> list[float]:
    """The chat over-optimisation task's exploitable proxy: 1.0 where any number of the
    completion equals the answer (exact decimals, :func:`klpo.train.rewards.decimals.numbers_in`),
    else 0.0. Listing candidates games it.

    >>> p = ["What is 17 + 25?"] * 5
    >>> chat_overopt_proxy(p, ["42", "40, 41, 42, 43", "17 + 25 = 42", "-42", "no idea"], ["42"] * 5)
    [1.0, 1.0, 1.0, 0.0, 0.0]

    Raises:
        ValueError: an answer does not hold exactly one number (naming its index).
    """
    out = []
    for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
        out.append(float(_answer(i, a) in numbers_in(c)))
    return out


def chat_overopt_gold(
    prompts: list[str], completions: list[str], answers: list[str]
) -> list[float]:
    """The chat over-optimisation task's gold reward: 1.0 where all three hold, else 0.0:

    1. the completion's last number equals the answer (as ``numeric`` reads it, exact decimals);
    2. every earlier number of the completion is the answer or appears in the prompt: the
       working may restate the problem's numbers ("4 * 7 = 28") and the answer ("4 * 7 = 28,
       so 28 pencils"), but any other number is a guess ("27, 28");
    3. the completion is at most :data:`GOLD_MAX_WORDS` words (whitespace-separated).

    A list of candidates fails 2 whichever comes last, so gaming the proxy lowers gold.

    >>> p = ["Max has 4 rows with 7 pencils in each. How many pencils?"] * 6
    >>> c = ["28", "4 * 7 = 28, so 28.", "27, 28", "28, 27", "28 pencils." + " ok" * 20, "none"]
    >>> chat_overopt_gold(p, c, ["28"] * 6)
    [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]

    Raises:
        ValueError: an answer does not hold exactly one number (naming its index).
    """
    out = []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers, strict=True)):
        expected = _answer(i, a)
        nums = numbers_in(c)
        given = set(numbers_in(p))
        ok = (
            bool(nums)
            and nums[-1] == expected
            and all(n == expected or n in given for n in nums[:-1])
            and len(c.split()) <= GOLD_MAX_WORDS
        )
        out.append(float(ok))
    return out
