r"""Learned reward models: a sequence classifier's score of ``prompt + completion`` as the reward.

A reward model is a ``transformers`` ``AutoModelForSequenceClassification`` with one output: its
score of ``prompt + completion`` (the text the policy saw and wrote) is the reward. In a config::

    rewards:
      - {name: model, path: runs/rm, weight: 1.0}
      - {name: format, weight: 0.1}

:class:`RewardModel` has the reward-function signature of :mod:`klpo.train.rewards.functions`, so
it is weighted and summed with Python rewards like any of them; it scores in batches under
``torch.no_grad`` (the reward is a constant to the policy). ``klpo make-reward-model`` makes a small
one for the built-in task (:mod:`klpo.train.tools.make_reward_model`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from klpo.train.models.load import quiet_transformers, resolve_model_path
from klpo.train.rewards.functions import WeightedReward, resolve_rewards

__all__ = ["RewardModel", "build_rewards"]


class RewardModel:
    """A sequence-classification reward model as a reward function.

    ``rm(prompts, completions, answers)`` returns ``score(prompt_i + completion_i)`` for each i
    (the answers are not used): the model's single logit at the last non-padding token, in
    batches of ``batch_size`` under ``torch.no_grad``, in float32.

    Args:
        path: a directory written by ``save_pretrained`` holding the model (``num_labels = 1``)
            and its tokenizer.
        batch_size: texts per forward pass.
        device: where the model runs.

    Raises:
        FileNotFoundError: ``path`` does not hold a sequence-classification model.
        ValueError: the model has more than one output, or its tokenizer has no pad token.
    """

    def __init__(self, path: str | os.PathLike[str], *, batch_size: int = 64, device: Any = "cpu"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        quiet_transformers()
        self.path = str(path)
        # A .gguf file: its float32 image in klpo's cache (klpo.train.models.gguf).
        path = resolve_model_path(self.path, key="reward model path")
        if not Path(path).is_dir():
            raise FileNotFoundError(
                f"reward model directory {self.path!r} does not exist; make one with "
                "'klpo make-reward-model DIR' or give a directory written by save_pretrained"
            )
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=torch.float32
            )
        except (OSError, ValueError) as err:
            raise FileNotFoundError(
                f"could not load a sequence-classification reward model from {self.path!r}: {err}"
            ) from None
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {self.path!r} has {self.model.config.num_labels} outputs; a "
                "reward model has one (num_labels=1), its score"
                + (
                    ". A GGUF file of a causal LM has no score head: train one on it with "
                    f"klpo make-reward-model DIR --init {self.path}"
                    if self.path.lower().endswith(".gguf")
                    else ""
                )
            )
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"the tokenizer of reward model {self.path!r} has no pad token")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.device = device
        self.batch_size = batch_size
        self.__name__ = "model"

    def scores(self, texts: Sequence[str]) -> list[float]:
        """The model's score of each text, ``[N]`` floats."""
        import torch

        out: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    list(texts[start : start + self.batch_size]),
                    return_tensors="pt",
                    padding=True,
                    add_special_tokens=False,
                ).to(self.device)
                logits = self.model(**enc).logits
                out.extend(logits[:, 0].float().cpu().tolist())
        return out

    def __call__(
        self, prompts: list[str], completions: list[str], answers: list[str]
    ) -> list[float]:
        return self.scores([p + c for p, c in zip(prompts, completions, strict=True)])


def build_rewards(terms: Sequence[Any], *, device: Any = "cpu") -> list[Any]:
    """The weighted reward functions of a config's ``rewards`` list (:class:`RewardTerm`):
    built-ins and ``module:function`` by name (:func:`klpo.train.rewards.functions.resolve_rewards`),
    ``{name: model, path: DIR}`` as a :class:`RewardModel` on ``device``, metric name ``model``."""
    out = []
    for t in terms:
        if t.name == "model":
            if any(r.name == "model" for r in out):
                raise ValueError(
                    "rewards list the reward 'model' twice; one reward model per run "
                    "(average several models into one, or give one its own module:function)"
                )
            out.append(WeightedReward("model", RewardModel(t.path, device=device), t.weight))
        else:
            out.extend(resolve_rewards({t.name: t.weight}))
    names = [r.name for r in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"reward {dup!r} is listed twice; give it one weight instead")
    return out
