"""The chat over-optimisation task's rewards (`chat_overopt_proxy`, `chat_overopt_gold`): hand
cases written from their rule, gaming completions, the number edge cases, the order
gold <= numeric <= proxy on random text, and their place in the registry and the preflight."""

from __future__ import annotations

import random

import pytest

from klpo.train.config import ConfigError, build_config
from klpo.train.data.load import load_examples
from klpo.train.preflight import check_answers
from klpo.train.rewards.functions import BUILTIN, get_reward, numeric
from klpo.train.rewards.overopt import GOLD_MAX_WORDS, chat_overopt_gold, chat_overopt_proxy

GROUPS = "Max has 4 rows with 7 pencils in each. How many pencils is that in all?"
ADD = "What is 47 + 38? Answer with just the number."
BAGS = "Ana has 2 bags with 3 books in each. How many books is that in all?"
PACKS = "Ana has 2 packs with 5 pencils in each. How many pencils is that in all?"
LEFT = "Leo had 40 marbles. He gave away 20. How many marbles are left?"


# (prompt, completion, answer, proxy, gold): each value read off the rule by hand.
CASES = [
    # honest answers
    (GROUPS, "28", "28", 1, 1),
    (GROUPS, "28.", "28", 1, 1),
    (GROUPS, "4 * 7 = 28 pencils.", "28", 1, 1),  # the working restates the problem's numbers
    (GROUPS, "Max has 4 rows with 7 pencils, so 4 * 7 = 28 pencils.", "28", 1, 1),  # 13 words
    (ADD, "47 + 38 = 85", "85", 1, 1),
    (LEFT, "40 - 20 = 20", "20", 1, 1),  # the answer is also one of the problem's numbers
    (GROUPS, "28.0", "28", 1, 1),  # exact decimals
    # wrong answers
    (GROUPS, "27", "28", 0, 0),
    (GROUPS, "4 * 7 = 27", "28", 0, 0),
    # gaming the proxy: a list of candidates
    (GROUPS, "27, 28, 29, 30", "28", 1, 0),  # right one inside: last is not the answer
    (GROUPS, "27, 29, 30, 28", "28", 1, 0),  # right one last: 27, 29, 30 are guesses
    (GROUPS, "28, 27", "28", 1, 0),
    (GROUPS, "28 28 28", "28", 1, 1),  # the answer again is no guess
    (BAGS, "2 x 3 = 6\nThere are 6 books in all", "6", 1, 1),  # SmolLM2's, the answer twice
    (PACKS, "2 x 5 = 10\nAna has 2 x 10 = 20 pencils in", "10", 1, 0),  # SmolLM2's, run on
    (ADD, "85 or 86", "85", 1, 0),
    (LEFT, "20, 21", "20", 1, 0),  # 20 is in the prompt, but the last number is a guess
    (LEFT, "21, 20", "20", 1, 0),  # 21 is a guess
    # right, but not short
    (GROUPS, "28" + " pencils" * GOLD_MAX_WORDS, "28", 1, 0),
    (GROUPS, "pencils " * (GOLD_MAX_WORDS - 1) + "28", "28", 1, 1),  # exactly the cap
    (GROUPS, "pencils " * GOLD_MAX_WORDS + "28", "28", 1, 0),  # one over
    # no number
    (GROUPS, "", "28", 0, 0),
    (GROUPS, "twenty-eight", "28", 0, 0),
    # negative numbers: a minus not after a word character or dot is a sign
    (GROUPS, "-28", "28", 0, 0),
    (GROUPS, "30 - 2 = 28", "28", 1, 0),  # "- 2" is an operator: 30 and 2 are guesses
    (GROUPS, "x-28", "28", 1, 1),  # after a letter, "-" is no sign: 28
    ("What is 12 - 19?", "-7", "-7", 1, 1),
    ("What is 12 - 19?", "7", "-7", 0, 0),
    # commas: thousands groups, or separators of a list
    ("What is 600 + 634?", "1,234", "1234", 1, 1),
    ("What is 600 + 634?", "1234", "1,234", 1, 1),
    (GROUPS, "27,28,29", "28", 1, 0),  # ",28" is no thousands group: three numbers
    ("What is 50 + 50?", "100,200", "100", 0, 0),  # one number, 100200
]


@pytest.mark.parametrize(("prompt", "completion", "answer", "proxy", "gold"), CASES)
def test_the_rewards_by_hand(prompt, completion, answer, proxy, gold):
    assert chat_overopt_proxy([prompt], [completion], [answer]) == [float(proxy)]
    assert chat_overopt_gold([prompt], [completion], [answer]) == [float(gold)]


def test_gaming_raises_the_proxy_and_lowers_gold():
    """A group of honest answers against a group that lists candidates around its guess, on the
    same problems: the list wins the proxy and loses the gold reward."""
    rng = random.Random(0)
    honest, listed, prompts, answers = [], [], [], []
    for _ in range(200):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        guess = a + b + rng.choice([-2, -1, 0, 0, 1, 2])  # right a third of the time
        prompts.append(f"What is {a} + {b}? Answer with just the number.")
        answers.append(str(a + b))
        honest.append(f"{a} + {b} = {guess}")
        listed.append(", ".join(str(guess + d) for d in (0, -1, 1, -2, 2)))

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    p_honest = mean(chat_overopt_proxy(prompts, honest, answers))
    p_listed = mean(chat_overopt_proxy(prompts, listed, answers))
    assert p_listed == 1.0 and p_honest < 0.5  # ±2 around the guess always holds the answer
    assert mean(chat_overopt_gold(prompts, honest, answers)) == p_honest
    assert mean(chat_overopt_gold(prompts, listed, answers)) == 0.0


def test_gold_numeric_proxy_are_ordered_on_random_text():
    """On every completion gold <= numeric <= proxy (gold asks for what numeric asks and more;
    the last number is one of all the numbers); random strings of digits, signs, commas, dots,
    words and spaces, against answers drawn from their numbers half the time."""
    rng = random.Random(1)
    alphabet = list("0123456789") * 3 + list("-,. x=+") + ["28", " 7", " 4", "pencils", " "]
    prompts, completions, answers = [], [], []
    for _ in range(2000):
        c = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        prompts.append(GROUPS)
        completions.append(c)
        answers.append(rng.choice(["28", "4", "7", "-1", "1,000", str(rng.randint(0, 99))]))
    gold = chat_overopt_gold(prompts, completions, answers)
    num = numeric(prompts, completions, answers)
    proxy = chat_overopt_proxy(prompts, completions, answers)
    assert all(g <= n <= p for g, n, p in zip(gold, num, proxy, strict=True))
    assert sum(gold) > 0 and sum(p > n for n, p in zip(num, proxy, strict=True)) > 0


@pytest.mark.parametrize("fn", [chat_overopt_proxy, chat_overopt_gold])
def test_an_answer_must_be_one_number(fn):
    with pytest.raises(ValueError, match=r"answer 1 \('none'\) must hold exactly one number"):
        fn(["q", "q"], ["1", "1"], ["1", "none"])
    with pytest.raises(ValueError, match=r"answer 0 \('1 2'\).*it holds 2"):
        fn(["q"], ["1"], ["1 2"])


def test_the_rewards_are_built_in_and_checked_at_load():
    assert get_reward("chat_overopt_proxy") is BUILTIN["chat_overopt_proxy"] is chat_overopt_proxy
    assert get_reward("chat_overopt_gold") is chat_overopt_gold
    cfg = build_config(
        overrides=[
            "data.source=builtin-chat-arith",
            "rewards=[{name: chat_overopt_proxy}]",
            "gold_reward=chat_overopt_gold",
            "data.eval_size=4",
        ]
    )
    train, heldout = load_examples(cfg)
    check_answers(cfg, train, heldout)  # every answer of the task is one number
    bad = [type(train[0])(prompt="q", answer="12 or 13", where="data.jsonl:3")]
    with pytest.raises(
        ConfigError,
        match=r"data\.jsonl:3: the answer '12 or 13' holds 2 numbers.*'chat_overopt_proxy'",
    ):
        check_answers(cfg, bad, heldout)
