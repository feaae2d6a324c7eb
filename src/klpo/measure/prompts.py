"""The prompts of ``--data`` and how they are rendered for the measurement (the trainer's rules:
:mod:`klpo.train.data.sources`, :mod:`klpo.train.models.tokens`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from klpo.measure.errors import MeasureError

Prompt = str | tuple[tuple[str, str], ...]
"""A prompt of ``--data``: a text, or a conversation of ``(role, content)`` messages."""


def read_prompts(path: str | Path, limit: int) -> list[Prompt]:
    """Prompts from a JSONL file (a ``prompt`` field per line: a string, or a conversation as a
    list of ``{"role", "content"}`` messages, TRL's conversational format, which ``--chat``
    renders) or a text file (one per line)."""
    p = Path(path)
    if not p.is_file():
        raise MeasureError(f"--data file {str(p)!r} does not exist")
    out: list[Prompt] = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise MeasureError(f"{p}:{n}: not valid JSON ({err.msg})") from None
            out.append(_jsonl_prompt(row, f"{p}:{n}"))
        else:
            out.append(line)
        if len(out) == limit:
            break
    if not out:
        raise MeasureError(f"--data file {str(p)!r} holds no prompts")
    return out


def _jsonl_prompt(row: object, where: str) -> Prompt:
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        from klpo.train.data.sources import chat_messages

        try:
            return chat_messages(prompt, where)
        except ValueError as err:
            raise MeasureError(str(err)) from None
    raise MeasureError(
        f"{where}: expected an object with a string field 'prompt' (or a list of chat messages); "
        "give JSONL with a 'prompt' per line, or a .txt file with one prompt per line"
    )


def render_prompts(
    tok: Any, texts: Sequence[Prompt], *, chat: bool, system_prompt: str | None = None
) -> list[str]:
    """The prompts as the policy sees them: with ``chat``, rendered by the tokenizer's chat
    template as the trainer renders ``data.chat`` prompts
    (:func:`klpo.train.data.sources.render_chat`: a text is one user message, a conversation is
    kept; ``system_prompt`` first unless the conversation starts with one; the assistant's
    generation prompt); else as they are (a conversation is then an error naming ``--chat``)."""
    if not chat:
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise MeasureError(
                    f"--data prompt {i + 1} is a list of chat messages; add --chat to render "
                    "them with the tokenizer's chat template"
                )
        return list(texts)  # type: ignore[arg-type]
    from klpo.train.data.sources import Example, render_chat

    try:
        examples = [
            Example(t, "", where=f"prompt {i + 1}")
            if isinstance(t, str)
            else Example("", "", messages=t, where=f"prompt {i + 1}")
            for i, t in enumerate(texts)
        ]
        done = render_chat(examples, tok, chat=True, system_prompt=system_prompt)
    except ValueError as err:
        raise MeasureError(str(err).replace("data.chat=true", "--chat")) from None
    return [e.prompt for e in done]


def _prompt_codec(tok: Any, policy: Any, texts: list[str], data: str, chat: bool = False) -> Any:
    """The trainer's rule for prompts (:mod:`klpo.train.models.tokens`): plain prompts get the
    tokenizer's special tokens once, chat-rendered ones none (the template wrote them); the stop
    set of the tokenizer and the model's generation config; every prompt checked for a doubled
    BOS."""
    from klpo.train.config import ConfigError
    from klpo.train.models.tokens import Codec, check_single_bos

    try:
        codec = Codec.plain(tok, policy)
        if chat:
            codec = Codec(tok, codec.stop, chat=True)
        for i, (text, ids) in enumerate(zip(texts, codec.ids(texts), strict=True)):
            where = f"--data {data}, prompt {i + 1}"
            check_single_bos(codec, ids, where, text, fix="remove it from the start of the text")
    except ConfigError as err:
        raise MeasureError(str(err)) from None
    return codec
