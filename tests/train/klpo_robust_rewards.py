"""Reward functions that return the wrong thing, loaded by ``module:function`` as a user's."""

from __future__ import annotations


def as_dict(completions, **kwargs):
    """TRL's form, returning ``{i: score}``: iterating it gives the keys 0, 1, 2, ..."""
    return {i: 1.0 for i in range(len(completions))}


def never_scores(prompts: list[str], completions: list[str], answers: list[str]) -> list[None]:
    return [None for _ in completions]
