"""Prompts that already hold a chat template's own markers, refused when ``data.chat`` is on.

With ``data.chat: true`` each prompt is the user's text (or chat messages) and the tokenizer's
chat template renders it (:func:`klpo.train.data.sources.render_chat`). A prompt that was
rendered already, by the same template or another, is then rendered a second time: for
SmolLM2-135M-Instruct a second default system prompt, the first rendering nested inside a new
user turn and an empty assistant turn, 70 tokens where the conversation has 40, and every check
of lengths and BOS passes. The markers a template writes are its model's special tokens
(``<|im_start|>``, ``<start_of_turn>``, ``<|start_header_id|>``, ``[INST]``) and the BOS, which
user text never holds; a prompt that holds one is refused, naming the marker, the prompt's
``file:line`` (or dataset row) and the fix.

:func:`template_markers` finds the markers from the tokenizer itself: the special tokens (its
added tokens marked special) that appear in the template's rendering of a short conversation,
and the BOS. Added tokens that are not special (Qwen3's ``<think>``) are not markers: a model's
own earlier turn may hold them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["check_unrendered", "find_marker", "template_markers"]

# Conversations rendered to see which special tokens the template writes: with a system
# message, without (Gemma's templates refuse the system role), and a single user turn.
_TURNS = {
    "system": {"role": "system", "content": "s"},
    "user": {"role": "user", "content": "u"},
    "assistant": {"role": "assistant", "content": "a"},
}
PROBES = (
    ("system", "user", "assistant", "user"),
    ("user", "assistant", "user"),
    ("user",),
)


def template_markers(
    tokenizer: Any, template_kwargs: dict[str, Any] | None = None
) -> tuple[str, ...]:
    """The strings the tokenizer's chat template writes around the messages: its BOS (when it
    has one), then each special token found in the template's rendering of :data:`PROBES`
    (with ``template_kwargs`` and the generation prompt), in the order they first appear.

    A tokenizer without a chat template has only its BOS. A probe the template refuses (a
    ``raise_exception`` for a role it does not know) is skipped.
    """
    import jinja2

    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    first: dict[str, int] = {}
    if getattr(tokenizer, "chat_template", None):
        for probe in PROBES:
            try:
                text = tokenizer.apply_chat_template(
                    [_TURNS[r] for r in probe],
                    tokenize=False,
                    add_generation_prompt=True,
                    **(template_kwargs or {}),
                )
            except (jinja2.TemplateError, ValueError, TypeError):  # a role it refuses
                continue
            for s in specials:
                at = text.find(s)
                if at >= 0:
                    first[s] = min(first.get(s, at), at)
    out = sorted(first, key=first.__getitem__)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and bos not in out:
        out.insert(0, bos)
    return tuple(out)


def find_marker(text: str, markers: Sequence[str]) -> tuple[str, int] | None:
    """The marker that occurs first in ``text`` (the longest where two start at one place) and
    where, or None."""
    hits = [(at, -len(m), m) for m in markers if (at := text.find(m)) >= 0]
    if not hits:
        return None
    at, _, marker = min(hits)
    return marker, at


def _snippet(text: str, at: int) -> str:
    start = max(0, at - 20)
    return (
        ("…" if start else "")
        + repr(text[start : at + 60])[1:-1]
        + ("…" if at + 60 < len(text) else "")
    )


def check_unrendered(
    examples: Sequence[Any], markers: Sequence[str], *, system_prompt: str | None = None
) -> None:
    """Refuse, with ``data.chat`` on, a prompt (or a chat message of one, or
    ``data.system_prompt``) that holds one of ``markers`` (:func:`template_markers`).

    Args:
        examples: :class:`klpo.train.data.sources.Example`, before rendering.
        markers: the template's markers.
        system_prompt: ``data.system_prompt``, checked too.

    Raises:
        ValueError: naming the prompt (``file:line``, ``name[i]``, or its index), the marker,
            where in the text, how many other prompts hold markers, and the fix.
    """
    if not markers:
        return
    fix = (
        "with data.chat=true the chat template renders every prompt, so this one would be "
        "rendered a second time, nested inside a new user turn (and after a second system "
        "prompt where the template writes a default one). Give the prompt unrendered: the user's text as a string, or chat messages "
        '([{"role": "user", "content": ...}]); or set data.chat=false to use the text as it is'
    )
    if system_prompt and (hit := find_marker(system_prompt, markers)):
        marker, at = hit
        raise ValueError(
            f"data.system_prompt holds {marker!r}, a token the chat template writes itself "
            f"({_snippet(system_prompt, at)!r}); give the system prompt's text alone"
        )
    bad = []
    for i, e in enumerate(examples):
        turns = e.messages if e.messages is not None else (("user", e.prompt),)
        for n, (role, content) in enumerate(turns):
            if hit := find_marker(content, markers):
                part = f" (chat message {n}, {role})" if e.messages is not None else ""
                bad.append((e.where or f"prompt {i}", part, content, *hit))
                break
    if not bad:
        return
    where, part, content, marker, at = bad[0]
    more = f" ({len(bad) - 1} more prompts hold the template's markers too)" if len(bad) > 1 else ""
    raise ValueError(
        f"{where}: the prompt{part} already holds {marker!r}, a token the chat template writes "
        f"itself, at character {at}: {_snippet(content, at)!r}. It looks rendered by a chat "
        f"template already; {fix}{more}"
    )
