"""Reward functions for the trainer's tests, loaded by ``module:function`` like a user's own."""

from __future__ import annotations

import math
import os
import time


def digits(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Fraction of digit characters: random text earns it sometimes, so gradients are non-zero."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def overflowing_reward(
    prompts: list[str], completions: list[str], answers: list[str]
) -> list[float]:
    """Finite in Python's float64, inf in float32 at every odd sample: 1e300, -1e300, ..."""
    return [(-1.0) ** (i // 2) * 1e300 if i % 2 else 0.5 for i in range(len(completions))]


def slow_digits(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """``digits``, slowly: gives a test time to kill the run in the middle of a step."""
    time.sleep(0.3)
    return digits(prompts, completions, answers)


def nan_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    return [math.nan for _ in completions]


def fails_on_rank_0(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Raises on rank 0 only (as a reward service down for one process): the group must stop."""
    if os.environ.get("RANK", "0") == "0":
        raise RuntimeError("the reward service is down")
    return digits(prompts, completions, answers)


def trl_digits_by_task(completions, task, completion_ids, trainer_state, **kwargs):
    """TRL's form: ``digits`` for rows whose ``task`` column is "digits", None (not scored) for
    the others; checks what the trainer hands over on the way."""
    prompts = kwargs["prompts"]
    assert len(prompts) == len(completions) == len(task) == len(completion_ids)
    assert all(isinstance(c, str) for c in completions)
    assert all(isinstance(ids, list) and ids for ids in completion_ids)
    assert 0 <= trainer_state.global_step <= trainer_state.max_steps == 3
    assert "prompt" not in kwargs and "note" in kwargs  # every other column, by its name
    return [
        sum(ch.isdigit() for ch in c) / max(1, len(c)) if t == "digits" else None
        for c, t in zip(completions, task, strict=True)
    ]


def zeros(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """0 for every completion: a batch with no advantage signal."""
    return [0.0 for _ in completions]


def solution_digits(completions, solution, **kwargs):
    """TRL's form, reading the data's own ``solution`` column (no ``answer`` anywhere): the
    share of the solution's digits the completion contains; message-list completions (chat
    data) are read as TRL's reward functions read them, ``completion[0]["content"]``."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [
        sum(d in t for d in s if d.isdigit()) / max(1, len(s))
        for t, s in zip(texts, solution, strict=True)
    ]


def strips_completions(completions, **kwargs):
    """TRL's form written for plain-text completions: fails on chat data's message lists."""
    return [float(bool(c.strip())) for c in completions]


def alternating(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """0, 1, 0, 1, ... down the batch: with an even group size every group has signal."""
    return [float(i % 2) for i in range(len(completions))]


def half_signal(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """:func:`alternating` where the prompt's character codes sum to an odd number, else 0: the
    groups of the other prompts have all-equal rewards (no signal)."""
    return [float(i % 2) if sum(map(ord, p)) % 2 else 0.0 for i, p in enumerate(prompts)]
