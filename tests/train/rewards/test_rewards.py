"""Tests for klpo.train.rewards.functions: hand cases for every built-in, loading by name, the weighted sum,
and the errors a misbehaving reward function must raise (never a silent NaN)."""

from __future__ import annotations

import math
import textwrap
from decimal import Decimal

import numpy as np
import pytest
import torch

from klpo.train.rewards import functions as rewards
from klpo.train.rewards.functions import RewardError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("85", Decimal(85)),
        ("  85\n", Decimal(85)),
        ("#### 42", Decimal(42)),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", Decimal(72)),  # GSM8K answer line
        ("#### 1,234", Decimal(1234)),  # thousands separators are dropped
        ("#### 3.50", Decimal("3.5")),
        ("#### -7", Decimal(-7)),
        ("12 then #### 5 and 6", Decimal(5)),  # the first number after the last ####
        ("#### 1 #### 2", Decimal(2)),
        ("the sum is 7, not 8.", Decimal(8)),  # no ####: the last number
        ("it is -12.", Decimal(-12)),
        ("3-2", Decimal(2)),  # a minus after a digit is an operator
        ("x-3", Decimal(3)),  # ... and after a letter
        ("####", None),
        ("#### none", None),
        ("no digits", None),
        ("", None),
    ],
)
def test_extract_number(text, expected):
    assert rewards.extract_number(text) == expected


def test_exact_match_hand_cases():
    completions = ["85", " 85 ", "085", "8", "85\n", ""]
    answers = ["85"] * 6
    # strip() removes surrounding whitespace only: "085" and "8" differ from "85"
    assert rewards.exact_match([""] * 6, completions, answers) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_numeric_hand_cases():
    prompts = [""] * 6
    completions = ["85", "#### 85", "85.0", "so 85", "#### 86", "oops"]
    answers = ["85", "... #### 85", "85", "85", "85", "85"]
    assert rewards.numeric(prompts, completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_numeric_answer_without_number_is_a_data_error():
    with pytest.raises(ValueError, match=r"answer 1 \('n/a'\) contains no number"):
        rewards.numeric(["", ""], ["1", "2"], ["1", "n/a"])


def test_format_hand_cases():
    completions = [
        "85",  # a bare number
        " -3 ",
        "1,234.5",
        "Adding 4 and 5 gives 9.\n#### 9",  # GSM8K's final line
        "#### 9",
        "the answer is 9",  # a number, but not in the format
        "9 apples",
        "x #### 9",  # #### must start the final line
        "#### 9\nmore",  # the #### line must be the last
        "",
    ]
    expected = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert rewards.format_reward([""] * 10, completions, ["0"] * 10) == expected
    assert rewards.get_reward("format") is rewards.format_reward


def test_get_reward_builtin_and_unknown():
    assert rewards.get_reward("exact_match") is rewards.exact_match
    with pytest.raises(ValueError, match=r"unknown reward 'exact'.*exact_match, numeric, format"):
        rewards.get_reward("exact")
    with pytest.raises(ValueError, match="non-empty string"):
        rewards.get_reward("")


@pytest.fixture
def registry(monkeypatch):
    """The reward registry, restored after the test (a test extends it, never the next one)."""
    monkeypatch.setattr(rewards, "REWARDS", dict(rewards.REWARDS))
    return rewards.REWARDS


def test_a_registered_reward_is_chosen_by_name(registry):
    def digits(prompts, completions, answers):
        return [float(sum(ch.isdigit() for ch in c)) for c in completions]

    assert rewards.register_reward("digits", digits) is digits
    assert rewards.get_reward("digits") is digits
    # a weighted sum with a built-in: 0.5 · 2 digits + 1 · exact ("12" == "12") = 2.0, then 0.5
    total, per = rewards.combined_rewards(
        rewards.resolve_rewards({"digits": 0.5, "exact_match": 1.0}), ["a", "a"], ["12", "x1"],
        ["12", "12"],
    )  # fmt: skip
    assert total == [2.0, 0.5] and per == {"digits": [2.0, 1.0], "exact_match": [1.0, 0.0]}
    with pytest.raises(ValueError, match=r"unknown reward 'digit'.*; registered: digits"):
        rewards.get_reward("digit")
    with pytest.raises(ValueError, match="'digits' is already registered; pass replace=True"):
        rewards.register_reward("digits", rewards.exact_match)
    assert rewards.register_reward("digits", rewards.exact_match, replace=True)
    assert rewards.get_reward("digits") is rewards.exact_match
    for bad in ("", "my:reward", "model"):
        with pytest.raises(ValueError, match="needs a plain name"):
            rewards.register_reward(bad, digits)
    with pytest.raises(ValueError, match="is not a function"):
        rewards.register_reward("three", 3)
    assert "digits" not in rewards.BUILTIN


def test_the_registry_starts_as_the_built_ins():
    assert rewards.REWARDS == rewards.BUILTIN


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length(prompts, completions, answers):
                return [float(len(c)) for c in completions]

            class Holder:
                @staticmethod
                def one(prompts, completions, answers):
                    return [1] * len(completions)

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_get_reward_module_function(user_module):
    fn = rewards.get_reward(f"{user_module}:length")
    assert fn(["p"], ["abc"], ["a"]) == [3.0]
    assert rewards.get_reward(f"{user_module}:Holder.one")([""], ["x"], [""]) == [1]
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        rewards.get_reward(f"{user_module}:missing")
    with pytest.raises(ValueError, match="'NOT_CALLABLE' is a int, not a function"):
        rewards.get_reward(f"{user_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        rewards.get_reward("no_such_module_xyz:f")


def test_weighted_sum_hand_arithmetic(user_module):
    rs = rewards.resolve_rewards({"exact_match": 1.0, "format": 0.5, f"{user_module}:length": -0.1})
    prompts = ["1+1=", "1+1=", "1+1="]
    completions = ["2", "3", "two"]
    answers = ["2", "2", "2"]
    total, per = rewards.combined_rewards(rs, prompts, completions, answers)
    # "2":   1.0 * 1 + 0.5 * 1 - 0.1 * 1 = 1.4
    # "3":   1.0 * 0 + 0.5 * 1 - 0.1 * 1 = 0.4
    # "two": 1.0 * 0 + 0.5 * 0 - 0.1 * 3 = -0.3
    assert total == pytest.approx([1.4, 0.4, -0.3], abs=1e-12)
    assert per == {
        "exact_match": [1.0, 0.0, 0.0],
        "format": [1.0, 1.0, 0.0],
        f"{user_module}:length": [1.0, 1.0, 3.0],
    }
    # A name, or a list of names, gets weight 1 each.
    assert [(r.name, r.weight) for r in rewards.resolve_rewards("numeric")] == [("numeric", 1.0)]
    names = rewards.resolve_rewards(["numeric", "format"])
    assert [(r.name, r.weight) for r in names] == [("numeric", 1.0), ("format", 1.0)]


@pytest.mark.parametrize("weight", [math.nan, math.inf, "1", True, None])
def test_bad_weights(weight):
    with pytest.raises(ValueError, match="weight of reward 'numeric' must be a finite number"):
        rewards.resolve_rewards({"numeric": weight})


def test_resolve_rewards_needs_one_and_no_repeats():
    with pytest.raises(ValueError, match="at least one reward"):
        rewards.resolve_rewards([])
    with pytest.raises(ValueError, match="'numeric' is listed twice"):
        rewards.resolve_rewards(["numeric", "numeric"])


# ---------------------------------------------------------------------------------------------
# Misbehaving reward functions.

PROMPTS = ["a", "b", "c"]
COMPLETIONS = ["x", "boom", "z"]
ANSWERS = ["1", "2", "3"]


def test_raising_function_names_the_sample():
    def picky(prompts, completions, answers):
        return [1.0 / (c != "boom") for c in completions]  # ZeroDivisionError on "boom"

    with pytest.raises(RewardError, match=r"'picky' raised ZeroDivisionError on sample 1"):
        rewards.score(picky, "picky", PROMPTS, COMPLETIONS, ANSWERS)


def test_raising_only_on_the_batch():
    def batch_only(prompts, completions, answers):
        if len(completions) > 1:
            raise RuntimeError("batch too big")
        return [0.0]

    with pytest.raises(RewardError, match="raised RuntimeError on the batch of 3 samples"):
        rewards.score(batch_only, "batch_only", PROMPTS, COMPLETIONS, ANSWERS)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_value_names_the_sample(bad):
    def f(prompts, completions, answers):
        return [0.0, 1.0, bad]

    with pytest.raises(RewardError, match=rf"'f' returned {bad} for sample 2 \(completion 'z'\)"):
        rewards.score(f, "f", PROMPTS, COMPLETIONS, ANSWERS)
    # The same inside a weighted sum: the error, never a NaN total.
    with pytest.raises(RewardError, match="for sample 2"):
        rewards.combined_rewards(
            [rewards.WeightedReward("f", f, 1.0)], PROMPTS, COMPLETIONS, ANSWERS
        )


def test_wrong_number_of_values():
    with pytest.raises(RewardError, match="'short' returned 2 values for 3 completions"):
        rewards.score(lambda p, c, a: [1.0, 2.0], "short", PROMPTS, COMPLETIONS, ANSWERS)
    with pytest.raises(
        RewardError,
        match=r"'scalar' returned a float; it must return a list .* of 3 numbers or None",
    ):
        rewards.score(lambda p, c, a: 1.0, "scalar", PROMPTS, COMPLETIONS, ANSWERS)


def test_non_numbers_are_refused_and_numeric_scalars_accepted():
    with pytest.raises(RewardError, match=r"'s' returned '1' \(str\) for sample 0"):
        rewards.score(lambda p, c, a: ["1", 1, 1], "s", PROMPTS, COMPLETIONS, ANSWERS)
    with pytest.raises(RewardError, match=r"returned \[1\] \(list\) for sample 1"):
        rewards.score(lambda p, c, a: [1, [1], 1], "n", PROMPTS, COMPLETIONS, ANSWERS)
    # None is a sample the function does not score (TRL's convention), kept as None
    assert rewards.score(lambda p, c, a: [1, None, 1], "n", PROMPTS, COMPLETIONS, ANSWERS) == [
        1.0,
        None,
        1.0,
    ]
    # bools, numpy scalars, 0-d tensors and a 1-d tensor of N values are all numbers
    values = [True, np.float32(0.5), torch.tensor(2.0)]
    got = rewards.score(lambda p, c, a: values, "mixed", PROMPTS, COMPLETIONS, ANSWERS)
    assert got == [1.0, 0.5, 2.0]
    got = rewards.score(
        lambda p, c, a: torch.tensor([1.0, 0.0, 3.0]), "t", PROMPTS, COMPLETIONS, ANSWERS
    )
    assert got == [1.0, 0.0, 3.0]


def test_mismatched_inputs():
    with pytest.raises(ValueError, match="one entry per sample, got 2, 3 and 3"):
        rewards.score(rewards.exact_match, "exact_match", ["a", "b"], COMPLETIONS, ANSWERS)


def test_held_out_accuracy_without_a_trained_reward_is_the_tasks_own():
    """A distillation run trains on no reward (``rewards: []``); its held-out accuracy is scored
    by the task's own reward, as the task's other runs are (``numeric`` on the chat task, whose
    answers a chat completion writes inside a sentence; ``exact_match`` read them as all wrong)."""
    from klpo.train.config import build_config
    from klpo.train.rewards.gold import eval_reward

    chat = build_config(overrides=["data.source=builtin-chat-arith"])
    assert [t.name for t in chat.rewards] == ["numeric"] and eval_reward(chat) == "numeric"
    distil = ["rewards=[]", "teacher={model: builtin-teacher}"]
    alone = build_config(overrides=["data.source=builtin-chat-arith", *distil])
    assert alone.rewards == [] and eval_reward(alone) == "numeric"
    assert eval_reward(build_config(overrides=distil)) == "exact_match"
    given = build_config(overrides=["data.source=builtin-chat-arith", "rewards=[{name: format}]"])
    assert eval_reward(given) == "format"
