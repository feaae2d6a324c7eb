r"""The boxed-answer reward: hand cases of \boxed{...} extraction (nested braces) and scoring."""

from __future__ import annotations

import pytest

from klpo.train.rewards import functions as R


@pytest.mark.parametrize(
    ("text", "content"),
    [
        (r"so the answer is \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces: depth 1 -> 2 -> 1 -> 2 -> 0
        (r"\boxed{{a}{b}{c}}", "{a}{b}{c}"),
        (r"first \boxed{1}, then \boxed{2}", "2"),  # the last one counts
        (r"\boxed{}", ""),
        (r"\boxed{12", None),  # never closed
        (r"\boxed{\frac{1}{2}", None),  # the outer brace never closes
        ("no box here: 42", None),
        (r"\boxed 5", None),  # the braceless form is not read
    ],
)
def test_extract_boxed_hand(text, content):
    assert R.extract_boxed(text) == content


def test_boxed_reward_hand():
    completions = [
        r"3+4 = \boxed{7}",  # right
        r"\boxed{7.0}",  # right: same decimal
        r"\boxed{1,000}",  # right against 1000
        r"\boxed{8}",  # wrong number
        "7",  # no box: 0 even though the number is right
        r"\boxed{\frac{1}{2}}",  # string answer, right
        r"\boxed{ $\frac{1}{2}$ }",  # $ and spaces stripped: right
        r"\boxed{7",  # unclosed
    ]
    answers = ["7", "#### 7", "1000", "7", "7", r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", "7"]
    got = R.boxed([""] * len(answers), completions, answers)
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_boxed_is_a_builtin_and_mixes_with_numeric():
    fns = R.resolve_rewards({"boxed": 1.0, "numeric": 0.5})
    total, per = R.combined_rewards(fns, ["q", "q"], [r"\boxed{7}", "7"], ["#### 7", "#### 7"])
    # boxed: (1, 0); numeric: (1, 1) -> totals 1 + 0.5 = 1.5 and 0 + 0.5 = 0.5
    assert per == {"boxed": [1.0, 0.0], "numeric": [1.0, 1.0]}
    assert total == [1.5, 0.5]
