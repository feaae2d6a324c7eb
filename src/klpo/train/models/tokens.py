"""Prompts into token ids, completions out of them: one rule for special tokens, one stop set.

Every path that samples (the lean sampler and ``generate``, the vLLM engine, the reference's
samples, the held-out evaluation, ``klpo doctor --data``) and the preflight's length check go
through a :class:`Codec`, so the trainer, the engines and the checks see the same tokens.

**Special tokens, once.** A chat template writes the special tokens its model expects (the
Llama 3, Gemma and Mistral templates begin with ``{{ bos_token }}``), so text it rendered is
tokenized with ``add_special_tokens=False``, as transformers' ``apply_chat_template(...,
tokenize=True)`` tokenizes it and as TRL's GRPOTrainer tokenizes conversational prompts. A plain
prompt gets the tokenizer's own special tokens once (its post-processor: a BOS for Llama, Gemma
and Mistral, nothing for Qwen), as TRL tokenizes plain prompts. :func:`check_single_bos` refuses a
prompt whose ids begin with the BOS twice: a prompt rendered elsewhere and given as plain text,
or a template that writes it twice.

**The end of a completion is the model's.** An instruction-tuned model ends its turn with tokens
of its own, listed in ``generation_config.eos_token_id`` (Llama 3.x Instruct: ``<|end_of_text|>``,
``<|eom_id|>``, ``<|eot_id|>``; Qwen2.5 Instruct: ``<|im_end|>``, ``<|endoftext|>``); the
tokenizer's EOS is only one of them, or none. The stop set (:func:`stop_set`) is the union of the
tokenizer's EOS and that list, as TRL's GRPOTrainer builds it and ``generate`` stops, plus
``rollout.stop``: more token ids, or strings (``generate``'s ``stop_strings``, vLLM's ``stop``; a
string that is one added token of the tokenizer, such as ``"<|im_end|>"``, is that token's id). A
completion is valid up to and including its first stop (the stop is the model's last action and
is trained on, as an EOS always was); its text, which the rewards see, is decoded from the tokens
before the stop with special tokens skipped (as TRL decodes) and cut before a stop string, so it
never holds the stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from klpo.train.config import ConfigError, TrainConfig

__all__ = [
    "Codec",
    "Finished",
    "StopSet",
    "check_single_bos",
    "eos_ids",
    "generation_config",
    "run_codec",
    "stop_set",
]

TOKENIZER_EOS = "the tokenizer's EOS"
GENERATION_EOS = "generation_config.eos_token_id"
EXTRA = "rollout.stop"


def eos_ids(value: int | Sequence[int] | None) -> list[int]:
    """``generation_config.eos_token_id`` as a list: it is an int, a list of ints, or None."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class StopSet:
    """What ends a completion: token ids, and strings of its decoded text."""

    ids: tuple[int, ...]
    strings: tuple[str, ...] = ()
    # Where each entry came from, ids first then strings (for the run's first lines).
    sources: tuple[str, ...] = field(default=(), compare=False)

    def lines(self, tokenizer: Any) -> list[str]:
        """The set by token and id, one line each, with where each came from."""
        names = tokenizer.convert_ids_to_tokens(list(self.ids))
        rows = [
            (repr(n) if n is not None else "?", f"id {i}")
            for n, i in zip(names, self.ids, strict=True)
        ]
        rows += [(repr(s), "text") for s in self.strings]
        width = max(len(r[0]) for r in rows)
        sources = self.sources or ("",) * len(rows)
        return ["stop set: a completion ends at its first"] + [
            f"  {name:<{width}}  {what:<9} {src}".rstrip()
            for (name, what), src in zip(rows, sources, strict=True)
        ]


def stop_set(tokenizer: Any, generation: Any = None, extra: Sequence[int | str] = ()) -> StopSet:
    """The tokenizer's EOS, ``generation.eos_token_id`` (a ``GenerationConfig``; an int or a list)
    and ``extra`` (``rollout.stop``: ids, or strings, where a string that is one added token of
    the tokenizer is that token's id), in that order, each once.

    Raises:
        ConfigError: an extra id outside the tokenizer's vocabulary, an empty string, a value that
            is neither an id nor a string, or nothing at all that ends a completion.
    """
    found: dict[int | str, list[str]] = {}

    def add(key: int | str, source: str) -> None:
        if source not in found.setdefault(key, []):
            found[key].append(source)

    if tokenizer.eos_token_id is not None:
        add(int(tokenizer.eos_token_id), TOKENIZER_EOS)
    for i in eos_ids(getattr(generation, "eos_token_id", None)):
        add(i, GENERATION_EOS)
    added = tokenizer.get_added_vocab() if any(isinstance(e, str) for e in extra) else {}
    size = len(tokenizer)
    for e in extra:
        if isinstance(e, str) and e:
            add(added.get(e, e), EXTRA)
        elif isinstance(e, int) and not isinstance(e, bool) and 0 <= e < size:
            add(e, EXTRA)
        else:
            raise ConfigError(
                f"rollout.stop: {e!r} is neither a token id of the tokenizer (0 to {size - 1}) "
                "nor a non-empty string; give ids, or strings that end a completion"
            )
    if not found:
        raise ConfigError(
            "nothing ends a completion: the tokenizer has no EOS token and the model's "
            f"{GENERATION_EOS} lists none; set rollout.stop to the ids or strings that end a turn"
        )
    ids = [k for k in found if isinstance(k, int)]
    strings = [k for k in found if isinstance(k, str)]
    sources = tuple(", ".join(found[k]) for k in [*ids, *strings])
    return StopSet(tuple(ids), tuple(strings), sources)


class Finished(NamedTuple):
    """Sampled completions laid out for training and scoring (shapes ``[B, C]``, ``[B]``)."""

    ids: Tensor  # [B, C] the tokens up to and including the first stop, pad after it
    mask: Tensor  # [B, C] bool: True up to and including the first stop
    truncated: Tensor  # [B] bool: no stop within the completion
    texts: list[str]  # [B] the text before the stop, special tokens skipped


@dataclass(frozen=True)
class Codec:
    """The tokenizer with the run's two rules: how prompts become ids, what ends a completion.

    Args:
        tokenizer: the policy's tokenizer (a pad token set; :func:`klpo.train.models.load.load_tokenizer`).
        stop: the stop set (:func:`stop_set`).
        chat: the prompts are text rendered by the tokenizer's chat template (``data.chat``), so
            no special token is added to them; else each gets the tokenizer's own once.
    """

    tokenizer: Any
    stop: StopSet
    chat: bool = False

    @classmethod
    def plain(cls, tokenizer: Any, model: Any = None) -> Codec:
        """Plain prompts, stopped by the tokenizer's EOS and ``model``'s generation config."""
        return cls(tokenizer, stop_set(tokenizer, getattr(model, "generation_config", None)))

    def ids(self, prompts: Sequence[str]) -> list[list[int]]:
        """Each prompt's token ids, unpadded."""
        return self.tokenizer(list(prompts), add_special_tokens=not self.chat)["input_ids"]

    def encode(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        """``input_ids`` and ``attention_mask``, ``[N, P]``, left-padded (as decoder-only sampling
        needs: every prompt ends at the last column)."""
        enc = self.tokenizer(
            list(prompts),
            return_tensors="pt",
            padding=True,
            padding_side="left",
            add_special_tokens=not self.chat,
        )
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    def stops_in(self, tokens: Tensor) -> Tensor:
        """``[R]`` bool: the rows of ``tokens [R, t]`` (completions so far) whose latest tokens
        complete a stop string. For sampling loops, after each token; decodes only a tail long
        enough to hold any stop string (one token per byte, and one more)."""
        if not self.stop.strings:
            return torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
        tail = max(len(s.encode("utf-8")) for s in self.stop.strings) + 1
        texts = self.tokenizer.batch_decode(tokens[:, -tail:].cpu(), skip_special_tokens=True)
        hits = [any(s in t for s in self.stop.strings) for t in texts]
        return torch.tensor(hits, dtype=torch.bool, device=tokens.device)

    def finish(self, completion_ids: Tensor, lengths: Tensor | None = None) -> Finished:
        """Cut sampled completions ``[B, C]`` at their first stop: a stop id, or the token that
        completes a stop string (the first prefix whose text holds it, as ``generate``'s
        ``StopStringCriteria`` stops). ``lengths [B]``: how many tokens of each row were sampled
        (the rest is padding; default all ``C``)."""
        b, c = completion_ids.shape
        cols = torch.arange(c)
        n = torch.full((b,), c) if lengths is None else lengths.long().cpu()
        valid = cols[None, :] < n[:, None]
        ids = completion_ids.cpu()
        is_stop = torch.isin(ids, torch.tensor(self.stop.ids, dtype=ids.dtype)) & valid
        end = torch.where(is_stop.any(-1), is_stop.long().argmax(-1), n)
        if self.stop.strings:
            end = torch.minimum(end, self._string_ends(ids, end, n))
        truncated = end >= n
        mask = (cols[None, :] <= end[:, None]) & valid
        pad = self.tokenizer.pad_token_id
        out = torch.where(mask.to(completion_ids.device), completion_ids, pad)
        return Finished(out, mask.to(completion_ids.device), truncated, self.texts(ids, mask))

    def texts(self, completion_ids: Tensor, mask: Tensor) -> list[str]:
        """The text of each completion for the rewards: its valid tokens less a final stop id,
        decoded with special tokens skipped, cut before the first stop string."""
        stop = set(self.stop.ids)
        rows = []
        for ids, m in zip(completion_ids.tolist(), mask.tolist(), strict=True):
            ids = [t for t, keep in zip(ids, m, strict=True) if keep]
            rows.append(ids[:-1] if ids and ids[-1] in stop else ids)
        texts = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return [self._before_stop_string(t) for t in texts]

    def _before_stop_string(self, text: str) -> str:
        cut = min((i for s in self.stop.strings if (i := text.find(s)) >= 0), default=len(text))
        return text[:cut]

    def _string_ends(self, ids: Tensor, end: Tensor, n: Tensor) -> Tensor:
        """``[B]`` the index of the token completing the first stop string in each row's first
        ``min(end + 1, n)`` tokens (``n`` where none does), by bisection on the prefix's text."""
        out = n.clone()
        decode = self.tokenizer.decode

        def holds(row: list[int], k: int) -> bool:  # the first k tokens' text holds a string
            text = decode(row[:k], skip_special_tokens=True)
            return any(s in text for s in self.stop.strings)

        for b, row in enumerate(ids.tolist()):
            k = int(min(end[b] + 1, n[b]))
            if k == 0 or not holds(row, k):
                continue
            lo, hi = 1, k  # holds(hi); find the smallest such prefix length
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if holds(row, mid) else (mid + 1, hi)
            out[b] = hi - 1
        return out

    def describe(self, first: str | None = None) -> list[str]:
        """The run's first lines about tokens: how prompts are tokenized (and the first one's
        length and start, to show its one BOS), then the stop set by token and id."""
        how = (
            "rendered by the chat template, tokenized without adding special tokens"
            if self.chat
            else "plain text, tokenized with the tokenizer's own special tokens, once"
        )
        lines = [f"prompts: {how}"]
        if first is not None:
            (ids,) = self.ids([first])
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            head = repr(text[:80]) + ("…" if len(text) > 80 else "")
            bos = self.tokenizer.bos_token_id
            count = "no BOS" if bos is None or not ids or ids[0] != bos else "one BOS"
            lines.append(f"  the first training prompt is {len(ids)} tokens, {count}: {head}")
        return lines + self.stop.lines(self.tokenizer)


def check_single_bos(
    codec: Codec, ids: Sequence[int], where: str, text: str, *, fix: str | None = None
) -> None:
    """Refuse a prompt whose token ids begin with the tokenizer's BOS twice.

    Args:
        codec: the rule the ids were made by (its tokenizer names the BOS).
        ids: the prompt's token ids; where, text: the prompt, for the message.
        fix: what to do about a plain prompt, where the caller knows better than klpo train's
            advice (``data.chat``).

    Raises:
        ConfigError: naming the prompt (``where``), the token, its id and the fix.
    """
    tok = codec.tokenizer
    bos = tok.bos_token_id
    if bos is None or len(ids) < 2 or ids[0] != bos or ids[1] != bos:
        return
    if codec.chat:
        why = "the chat template's text already holds it twice (its template writes it twice?)"
        fix = f"fix the template so that it writes {tok.bos_token!r} once"
    else:
        why = (
            f"its text already begins with {tok.bos_token!r} (a prompt rendered by a chat "
            "template?) and the tokenizer adds its own"
        )
        fix = fix or (
            "give the prompt unrendered (a string or chat messages) with data.chat=true, which "
            f"tokenizes the rendered text without adding special tokens; or remove "
            f"{tok.bos_token!r} from the start of the text"
        )
    raise ConfigError(
        f"{where}: the prompt begins with the BOS token {tok.bos_token!r} (id {bos}) twice: "
        f"{why}; {fix}: {text[:80]!r}"
    )


def generation_config(path: str | Path) -> Any:
    """The model's ``GenerationConfig`` as ``from_pretrained`` gives the loaded model: its
    ``generation_config.json``, or, where there is none, the one derived from its config."""
    from transformers import AutoConfig, GenerationConfig

    try:  # a Hub id is fetched as transformers fetches it (HF_HUB_OFFLINE is honoured)
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))


def run_codec(cfg: TrainConfig, tokenizer: Any, policy: str | Path) -> Codec:
    """The run's codec: ``data.chat``, and the stop set of the tokenizer, the policy's generation
    config and ``rollout.stop``. The preflight and the models build it with this one function."""
    stop = stop_set(tokenizer, generation_config(policy), cfg.rollout.stop)
    return Codec(tokenizer, stop, chat=cfg.data.chat)
