"""The run's examples: the (train, held-out) prompts and answers of ``data.source``."""

from __future__ import annotations

from klpo.train.config import TrainConfig
from klpo.train.data.chat_task import ChatArithmeticTask
from klpo.train.data.sources import Example, read_dataset, read_jsonl
from klpo.train.data.task import ArithmeticTask

__all__ = ["load_examples"]


def load_examples(cfg: TrainConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the configured source."""
    d = cfg.data
    if d.source in ("builtin", "builtin-overopt"):
        train, heldout = ArithmeticTask().splits()
        return list(train), list(heldout[: d.eval_size])
    if d.source == "builtin-chat-arith":
        train, heldout = ChatArithmeticTask(shots=d.shots, chat=d.chat).splits()
        return train, heldout[: d.eval_size]
    if d.source == "jsonl":
        train = read_jsonl(d.path, d.prompt_field, d.answer_field)
        heldout = read_jsonl(d.eval_path, d.prompt_field, d.answer_field) if d.eval_path else []
        return train, heldout[: d.eval_size]
    train = read_dataset(d.path, d.split, d.prompt_field, d.answer_field)
    heldout = (
        read_dataset(d.path, d.eval_split, d.prompt_field, d.answer_field) if d.eval_split else []
    )
    return train, heldout[: d.eval_size]
