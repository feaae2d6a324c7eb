"""Sampling completions with ``generate`` and laying them out as per-token tensors.

Decoder-only models are padded on the **left** for generation, so every prompt ends at the same
column and the completions start together. A completion is valid up to and including its first
stop (an EOS, any end-of-turn id of the model's generation config, or ``rollout.stop``;
:mod:`klpo.train.models.tokens`); everything after it is padding (``mask`` False). Position ids are recomputed from the
attention mask (``cumsum - 1``) for every forward pass, as ``generate`` does, so the log-probs of
the update are those of the sampling distribution. With ``algo.packing: on`` the forwards
after sampling run the rows packed instead (:func:`pack_rows`, :func:`packed_columns`;
:mod:`klpo.train.models.packing`), each sequence's positions the same.

Shapes: B sequences (prompts × group size), P prompt columns, C completion columns, H hidden size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import GenerationConfig
from transformers.cache_utils import DynamicLayer

from klpo.train.choices import SAMPLERS
from klpo.train.models import packing
from klpo.train.models.cache import cache_support
from klpo.train.models.load import cache_kwargs, output_cache
from klpo.train.models.packing import Slots
from klpo.train.models.tokens import Codec, Finished

if TYPE_CHECKING:
    from klpo.train.config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """How completions are sampled: the settings every sampler and engine follows.

    Sampling is from softmax(logits / ``temperature``) restricted to the ``top_p`` nucleus
    (Holtzman et al., 2020), ``top_k`` off; ``greedy`` takes the argmax instead (``temperature``
    and ``top_p`` unused). A run's come from ``rollout.*`` and ``data.max_prompt_tokens``
    (:meth:`from_config`); its held-out evaluation's are greedy, one completion a prompt
    (:meth:`heldout`).

    Example:
        >>> d = Decoding(max_new_tokens=8, greedy=True)  # one greedy completion a prompt
        >>> d.group_size, d.sampler, d.max_prompt_tokens
        (1, 'lean', None)
        >>> Decoding(max_new_tokens=0)
        Traceback (most recent call last):
        ...
        ValueError: group_size and max_new_tokens must be >= 1, got 1 and 0
    """

    group_size: int = 1  # completions per prompt (rows g*G .. g*G+G-1 share prompt g)
    max_new_tokens: int  # the most tokens a completion holds, its stop included
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # the argmax at each position instead of a draw
    max_prompt_tokens: int | None = None  # a longer prompt is refused (None: any length)
    sampler: str = "lean"  # rollout.sampler: lean or generate (klpo.train.choices.SAMPLERS)
    synced: bool = False  # every rank decodes until all are done (a sharded model's forward)

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(
                f"rollout.sampler must be one of {tuple(SAMPLERS)}, got {self.sampler!r}"
            )
        if self.group_size < 1 or self.max_new_tokens < 1:
            raise ValueError(
                "group_size and max_new_tokens must be >= 1, got "
                f"{self.group_size} and {self.max_new_tokens}"
            )
        if not self.greedy and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(
                f"sampling needs temperature > 0 and top_p in (0, 1], got {self.temperature} "
                f"and {self.top_p}"
            )

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, synced: bool = False) -> Decoding:
        """A run's sampling: ``rollout.group_size``, ``max_new_tokens``, ``temperature``,
        ``top_p``, ``sampler`` and ``data.max_prompt_tokens``; ``synced`` under FSDP."""
        r = cfg.rollout
        return cls(
            group_size=r.group_size,
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            sampler=r.sampler,
            synced=synced,
        )

    @classmethod
    def heldout(cls, cfg: TrainConfig) -> Decoding:
        """A run's held-out evaluation: one greedy completion a prompt, of at most
        ``rollout.max_new_tokens``, by ``rollout.sampler``."""
        return cls(
            max_new_tokens=cfg.rollout.max_new_tokens, greedy=True, sampler=cfg.rollout.sampler
        )

    def check_prompts(self, lengths: Tensor, prompts: Sequence[str], rows_per_prompt: int) -> None:
        """Refuse a prompt longer than ``max_prompt_tokens``: ``lengths [R]`` the token counts of
        the encoded rows, ``rows_per_prompt`` of them for each of ``prompts``."""
        if self.max_prompt_tokens is None:
            return
        too_long = (lengths > self.max_prompt_tokens).nonzero().flatten().tolist()
        if too_long:
            i = too_long[0] // rows_per_prompt
            raise ValueError(
                f"prompt {i} is {int(lengths[too_long[0]])} tokens long, more than "
                f"data.max_prompt_tokens={self.max_prompt_tokens}: {prompts[i][:80]!r}"
            )


@dataclass
class Rollout:
    """One batch of sampled completions, grouped: rows ``g*G .. g*G+G-1`` share prompt ``g``."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] bool
    completion_ids: Tensor  # [B, C] right-padded after the first stop
    mask: Tensor  # [B, C] bool, True up to and including the first stop
    prompts: list[str]  # [B] prompt texts (repeated G times)
    completions: list[str]  # [B] decoded text before the stop, special tokens removed
    answers: list[str]  # [B] reference answers (repeated G times)
    group_size: int
    truncated: Tensor = field(default=None)  # [B] bool: no stop within max_new_tokens
    # [B, C] log-probs of the sampled tokens as an inference engine reported them (0 where
    # mask is False); None when the trainer's own model sampled (see klpo.train.rollout.engines).
    engine_logp: Tensor | None = None
    # [B, C] log-probs of the sampled tokens under the behaviour policy that sampled them, k
    # versions behind the trainer (rollout.staleness; 0 where mask is False), and that version;
    # None without staleness (see klpo.train.rollout.versions).
    behav_logp: Tensor | None = None
    behav_version: int | None = None
    # [B, C] the exact KL(pi_behav ‖ pi_old) at each position (0 where mask is False), from the
    # same behaviour pass; None without staleness
    behav_kl: Tensor | None = None
    # where each row's sequence goes in packed rows (algo.packing: on; pack_rows), kept by
    # select so that a micro-batch's rows sit where scoring's did; None: padded rows
    packs: Slots | None = None

    @classmethod
    def from_encoded(
        cls,
        enc: dict[str, Tensor],
        done: Finished,
        prompts: Sequence[str],
        answers: Sequence[str],
        group_size: int,
        engine_logp: Tensor | None = None,
    ) -> Rollout:
        """The rollout of ``group_size`` completions of each of ``prompts``: ``enc`` the encoded
        prompt rows (``input_ids``, ``attention_mask`` ``[B, P]``, each prompt's repeated over its
        group), ``done`` the completions cut at their stops
        (:meth:`klpo.train.models.tokens.Codec.finish`), ``engine_logp [B, C]`` an engine's
        log-probs of them (zeroed where ``done.mask`` is False)."""
        return cls(
            prompt_ids=enc["input_ids"],
            prompt_mask=enc["attention_mask"].bool(),
            completion_ids=done.ids,
            mask=done.mask,
            prompts=[p for p in prompts for _ in range(group_size)],
            completions=done.texts,
            answers=[a for a in answers for _ in range(group_size)],
            group_size=group_size,
            truncated=done.truncated,
            engine_logp=None if engine_logp is None else torch.where(done.mask, engine_logp, 0.0),
        )

    @property
    def sampler_logp(self) -> Tensor | None:
        """log-probs of what sampled the tokens where it is not the trainer's pi_old: an
        engine's (a stale one's too: they are what the tokens were drawn from), else the stale
        behaviour policy's (the trainer's at the sampling version), else None. The policy
        loss's weights and masks take these; the KL term and the exact sampler metrics the
        trainer's own (``behav_logp``, ``behav_kl``)."""
        return self.engine_logp if self.engine_logp is not None else self.behav_logp

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.mask], dim=1)

    def to(self, device: torch.device | str) -> Rollout:
        """The rollout with its tensors on ``device`` (itself if they are there already)."""
        device = torch.device(device)
        if self.mask.device == device:
            return self

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self,
            prompt_ids=move(self.prompt_ids),
            prompt_mask=move(self.prompt_mask),
            completion_ids=move(self.completion_ids),
            mask=move(self.mask),
            truncated=move(self.truncated),
            engine_logp=move(self.engine_logp),
            behav_logp=move(self.behav_logp),
            behav_kl=move(self.behav_kl),
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """The rollouts' rows one after another (groups kept from several sampling rounds):
        prompts left-padded and completions right-padded to the longest, the padding masked
        out (its token id 0 is never read: every pass reads the masks)."""
        if len(parts) == 1:
            return parts[0]
        p = max(r.prompt_ids.shape[1] for r in parts)
        c = max(r.completion_ids.shape[1] for r in parts)

        def pad(t: Tensor, width: int, left: bool) -> Tensor:
            extra = width - t.shape[1]
            return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra))

        if any(r.behav_logp is not None for r in parts):
            raise ValueError("rollouts of a stale sampler are not concatenated (one round a step)")
        logp = [r.engine_logp for r in parts]
        trunc = [r.truncated for r in parts]
        return Rollout(
            prompt_ids=torch.cat([pad(r.prompt_ids, p, True) for r in parts]),
            prompt_mask=torch.cat([pad(r.prompt_mask, p, True) for r in parts]),
            completion_ids=torch.cat([pad(r.completion_ids, c, False) for r in parts]),
            mask=torch.cat([pad(r.mask, c, False) for r in parts]),
            prompts=[x for r in parts for x in r.prompts],
            completions=[x for r in parts for x in r.completions],
            answers=[x for r in parts for x in r.answers],
            group_size=parts[0].group_size,
            truncated=None if any(t is None for t in trunc) else torch.cat(trunc),
            engine_logp=None
            if any(t is None for t in logp)
            else torch.cat([pad(t, c, False) for t in logp]),
        )

    def select(self, rows: Tensor | list[int]) -> Rollout:
        """The rollout restricted to some rows (a micro-batch, or one rank's share)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        pick = idx.tolist()
        return Rollout(
            prompt_ids=self.prompt_ids[idx],
            prompt_mask=self.prompt_mask[idx],
            completion_ids=self.completion_ids[idx],
            mask=self.mask[idx],
            prompts=[self.prompts[i] for i in pick],
            completions=[self.completions[i] for i in pick],
            answers=[self.answers[i] for i in pick],
            group_size=self.group_size,
            truncated=None if self.truncated is None else self.truncated[idx],
            engine_logp=None if self.engine_logp is None else self.engine_logp[idx],
            behav_logp=None if self.behav_logp is None else self.behav_logp[idx],
            behav_version=self.behav_version,
            behav_kl=None if self.behav_kl is None else self.behav_kl[idx],
            packs=None if self.packs is None else self.packs.select(idx),
        )


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over the real tokens only, as ``generate`` does with left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids: Tensor, eos_token_id: int | list[int]) -> tuple[Tensor, Tensor]:
    """(mask, truncated): True up to and including the first EOS; truncated where none came."""
    eos = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    is_eos = torch.isin(completion_ids, eos)
    seen_before = (is_eos.long().cumsum(-1) - is_eos.long()) > 0
    return ~seen_before, ~is_eos.any(-1)


def nucleus_logits(logits: Tensor, top_p: float) -> Tensor:
    """``logits`` with every token outside the top-``top_p`` nucleus set to -inf.

    The nucleus is the smallest set of most likely tokens whose probability mass reaches
    ``top_p`` (Holtzman et al., 2020, "The Curious Case of Neural Text Degeneration"); the most
    likely token is always kept. ``top_p = 1`` returns ``logits`` unchanged. Shapes: ``[..., V]``.
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def draw(logits: Tensor) -> Tensor:
    r"""One token per row of ``logits [R, V]`` from softmax(logits), by the Gumbel-max trick.

    With ``U_i ~ Uniform(0, 1)`` i.i.d., ``E_i = -log U_i ~ Exp(1)`` and ``argmax_i (logits_i -
    log E_i) = argmax_i p_i / E_i`` is ``i`` with probability exactly ``p_i`` (``E_i / p_i`` are
    independent exponentials with rates ``p_i``; the smallest is ``i`` with probability ``p_i /
    sum_j p_j``); ``-log E_i`` is a standard Gumbel variable. The same law as
    ``torch.multinomial(logits.softmax(-1), 1)``, without the softmax, its normalisation and the
    search: about 4× faster on a [32, 8k] batch on one CPU thread (and ``exponential_`` is as slow
    as ``multinomial`` there, hence ``-log U``). ``-inf`` logits are never drawn (a row must have
    a finite one); so is a ``U_i`` of exactly 0 (probability 2^-24 per entry in float32). Uses
    torch's global generator.
    """
    log_e = torch.rand_like(logits, dtype=torch.float32).log_().neg_().log_()
    return (logits.float() - log_e).argmax(-1)


class _InPlaceLayer(DynamicLayer):
    """A :class:`transformers.cache_utils.DynamicLayer` whose keys and values are views of
    buffers allocated for the whole decode: :meth:`update` writes the new positions in place
    instead of concatenating (which copies the whole cache at every token, about a fifth of a
    cached decode step of a small model on a CPU). Anything that replaced the tensors (a select,
    a crop past the buffer) falls back to the concatenating update."""

    _k: Tensor
    _v: Tensor

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        n = self.keys.shape[-2]
        end = n + key_states.shape[-2]
        aliased = self.keys.data_ptr() == self._k.data_ptr() and self.keys.shape[0] == len(self._k)
        if not aliased or end > self._k.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._k[..., n:end, :].copy_(key_states)
        self._v[..., n:end, :].copy_(value_states)
        self.keys, self.values = self._k[..., :end, :], self._v[..., :end, :]
        return self.keys, self.values


def preallocate(cache, extra: int) -> None:
    """Give each plain dynamic layer of ``cache`` room for ``extra`` more positions, in place.

    Only layers that are exactly ``DynamicLayer`` (not sliding-window or other kinds) and hold
    states are converted; any other cache is left as it is. The values are unchanged.
    """
    for layer in getattr(cache, "layers", ()):
        if type(layer) is not DynamicLayer or layer.get_seq_length() == 0:
            continue
        k, v = layer.keys, layer.values
        n = k.shape[-2]
        layer._k = k.new_empty(*k.shape[:-2], n + extra, k.shape[-1])
        layer._v = v.new_empty(*v.shape[:-2], n + extra, v.shape[-1])
        layer._k[..., :n, :].copy_(k)
        layer._v[..., :n, :].copy_(v)
        layer.keys, layer.values = layer._k[..., :n, :], layer._v[..., :n, :]
        layer.__class__ = _InPlaceLayer


@torch.no_grad()
def sample_lean(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    decoding: Decoding,
    *,
    eos_token_id: int | list[int],
    pad_token_id: int,
    stops_in: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """``[N*G, C]`` completion tokens: ``decoding.group_size`` samples for each of ``N``
    left-padded prompts, of at most ``decoding.max_new_tokens``.

    A plain sampling loop over the model's forward with a key/value cache, in place of
    ``generate``'s general machinery (logits processors, stopping criteria, cache bookkeeping)
    whose per-token overhead dominates short completions of small models. Each prompt is run
    once, its cache repeated ``group_size`` times and given room for the completions
    (:func:`preallocate`); then each new token is drawn from softmax(logits / temperature)
    restricted to the ``top_p`` nucleus (:func:`draw`; or the argmax if ``decoding.greedy``),
    with the model's logits in float32. Rows stop at their first id of ``eos_token_id`` (the stop set's ids)
    or where ``stops_in`` (``[R, t]`` tokens so far -> ``[R]`` bool, the rows that completed a stop
    string; :meth:`klpo.train.models.tokens.Codec.stops_in`) says so; later columns hold
    ``pad_token_id``, and the loop stops when every row has stopped. The distribution is the
    one ``generate`` samples with ``top_k`` off; the draws for a given seed are not the same.
    With ``decoding.synced`` (a sharded model, whose forward is collective) the loop stops only
    when every rank's rows have stopped.
    """
    support = cache_support(model)
    if not support.shared:
        raise ValueError(
            f"the lean sampler cannot sample {type(model).__name__}: {support.reason}; use "
            "rollout.sampler: generate"
        )
    eos = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    device = next(model.parameters()).device
    ids = prompt_ids.to(device)
    att = prompt_mask.to(device).long()
    pos = position_ids(att)
    group_size, max_new_tokens = decoding.group_size, decoding.max_new_tokens
    out = model(
        input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, logits_to_keep=1
    )
    cache = output_cache(out)
    cache.batch_repeat_interleave(group_size)
    preallocate(cache, max_new_tokens)
    logits = out.logits[:, -1].float().repeat_interleave(group_size, dim=0)
    att = att.repeat_interleave(group_size, dim=0)
    next_pos = pos[:, -1:].repeat_interleave(group_size, dim=0) + 1
    eos = eos.to(device)
    rows = logits.shape[0]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens: list[Tensor] = []
    for t in range(max_new_tokens):
        if decoding.greedy:
            token = logits.argmax(-1)
        else:
            token = draw(nucleus_logits(logits / decoding.temperature, decoding.top_p))
        token = torch.where(done, torch.full_like(token, pad_token_id), token)
        tokens.append(token)
        done = done | torch.isin(token, eos)
        if stops_in is not None:
            done = done | stops_in(torch.stack(tokens, dim=1))
        if t == max_new_tokens - 1 or _all_ranks(bool(done.all()), decoding.synced, device):
            break
        att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
        out = model(
            input_ids=token[:, None],
            attention_mask=att,
            position_ids=next_pos,
            **cache_kwargs(model, cache),
            use_cache=True,
        )
        cache = output_cache(out)
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return torch.stack(tokens, dim=1).cpu()


def _all_ranks(flag: bool, synced: bool, device: torch.device) -> bool:
    """``flag`` on this rank, or (``synced``) whether it holds on every rank."""
    if not synced:
        return flag
    import torch.distributed as tdist

    not_yet = torch.tensor([0.0 if flag else 1.0], device=device)
    tdist.all_reduce(not_yet)
    return float(not_yet) == 0.0


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    decoding: Decoding,
    *,
    codec: Codec | None = None,
) -> Rollout:
    """Sample ``decoding.group_size`` completions for each prompt: :func:`sample_lean` or
    ``model.generate`` (``decoding.sampler``).

    Sampling is from softmax(logits / temperature) restricted by ``top_p`` only: ``top_k`` is
    switched off (transformers' default of 50 would silently sample from a distribution other
    than the policy's, biasing every estimator), and no repetition penalty applies.
    ``decoding.synced`` keeps every rank decoding until all are done (``generate``'s
    ``synced_gpus``): a sharded model's forward is collective, so no rank may stop early.

    ``codec`` (:class:`klpo.train.models.tokens.Codec`) tokenizes the prompts and cuts the
    completions at the stop set; the run's own says whether the prompts were rendered by a chat
    template. Default: plain prompts (the tokenizer's special tokens added once), stopped by the
    tokenizer's EOS and ``model``'s ``generation_config.eos_token_id``.
    """
    g = decoding.group_size
    codec = codec if codec is not None else Codec.plain(tokenizer, model)
    # lean: each prompt once, its cache repeated for the group (where the cache allows it; the
    # load said so); generate: each prompt's row repeated
    lean = decoding.sampler == "lean" and cache_support(model).shared
    enc = codec.encode(prompts if lean else [p for p in prompts for _ in range(g)])
    decoding.check_prompts(enc["attention_mask"].sum(-1), prompts, 1 if lean else g)
    if lean:
        completion_ids = sample_lean(
            model,
            enc["input_ids"],
            enc["attention_mask"],
            decoding,
            eos_token_id=list(codec.stop.ids),
            pad_token_id=tokenizer.pad_token_id,
            stops_in=codec.stops_in if codec.stop.strings else None,
        )
        enc = {k: v.repeat_interleave(g, dim=0) for k, v in enc.items()}
    else:
        completion_ids = _hf_generate(model, codec, enc, decoding)
    if completion_ids.shape[1] == 0:
        completion_ids = torch.full((len(prompts) * g, 1), tokenizer.pad_token_id)
    return Rollout.from_encoded(enc, codec.finish(completion_ids), prompts, answers, g)


def shared_groups(rollout: Rollout) -> int:
    """The number of consecutive rows that share one prompt, or 1 if the rows are not whole groups.

    A rollout as sampled holds whole groups; a micro-batch or a rank's share of it does when its
    rows are whole groups in order. Checked on the tensors, so a selection that breaks a group
    falls back to the unshared forward rather than computing a wrong one.
    """
    g = rollout.group_size
    b = rollout.prompt_ids.shape[0]
    if g <= 1 or b % g:
        return 1
    ids = rollout.prompt_ids.view(b // g, g, -1)
    att = rollout.prompt_mask.view(b // g, g, -1)
    same = (ids == ids[:, :1]).all() and (att == att[:, :1]).all()
    return g if bool(same) else 1


def pack_rows(rollout: Rollout, packed: bool = True) -> Rollout:
    """The rollout with its rows' packed layout planned (``packed``; else as it is): each row's
    real tokens, prompt and completion, to a pack and an offset by first-fit decreasing
    (:func:`klpo.train.models.packing.plan`), in packs as wide as the padded rows (P + C
    columns): no pack is wider than a padded row, and there are at most as many packs as rows.
    Every forward over the rollout or a selection of its rows then runs packed, each sequence at
    the same place (:func:`completion_hidden`)."""
    if not packed:
        return rollout
    lengths = rollout.attention_mask.sum(-1).cpu()
    return dataclasses.replace(
        rollout, packs=packing.plan(lengths, width=rollout.input_ids.shape[1])
    )


def packed_columns(run: Callable[..., Tensor], rollout: Rollout, device: torch.device) -> Tensor:
    """``[B, C, ...]`` the outputs of ``run`` at the columns that predict each completion token,
    over the rollout's rows packed by ``rollout.packs``: ``run(input_ids, real, position_ids)
    -> [R, W, ...]`` on the packs (:func:`klpo.train.models.packing.pack`), read back at the
    padded columns P - 1 .. P + C - 2 (:func:`~klpo.train.models.packing.unpack`), 0 where
    such a column is padding (after a completion's stop, where ``mask`` is False)."""
    packed = packing.pack(
        rollout.input_ids.to(device), rollout.attention_mask.to(device), rollout.packs
    )
    out = run(packed.input_ids, packed.real.long(), packed.position_ids)
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    return packing.unpack(out, packed.index[:, p - 1 : p - 1 + c])


def completion_hidden(backbone, rollout: Rollout, *, share_prompt: bool = True) -> Tensor:
    """``[B, C, H]`` last hidden states at the positions that predict each completion token
    (``[B, C, V]`` the model's logits, for a Backbone of ``model.logits_path: model``).

    ``backbone`` maps (input_ids, attention_mask, position_ids) to hidden states ``[B, L, H]``
    (see :class:`klpo.train.models.backbone.Backbone`); the state at column P - 1 + t predicts token t.
    It is asked for the last C + 1 columns only (``keep``). With ``share_prompt`` and whole groups
    (:func:`shared_groups`), each prompt is computed once per group (``Backbone``'s
    ``prefix``/``group``), with the same values and gradients. A rollout with a packed layout
    (``rollout.packs``, :func:`pack_rows`) runs packed instead (:func:`packed_columns`), each
    sequence whole: the same values in exact arithmetic, 0 at the padded columns.
    """
    device = next(backbone.parameters()).device
    if rollout.packs is not None:
        return packed_columns(partial(backbone, packed=True), rollout, device)
    ids = rollout.input_ids.to(device)
    att = rollout.attention_mask.to(device).long()  # 0/1, as every model reads a mask
    group = shared_groups(rollout) if share_prompt else 1
    p = rollout.prompt_ids.shape[1]
    c = rollout.completion_ids.shape[1]
    if group > 1:
        hidden = backbone(ids, att, position_ids(att), prefix=p, group=group, keep=c + 1)
    else:
        hidden = backbone(ids, att, position_ids(att), keep=c + 1)
    return hidden[:, -(c + 1) : -1]  # columns P - 1 .. P + C - 2


def _hf_generate(model, codec: Codec, enc: dict[str, Tensor], decoding: Decoding) -> Tensor:
    """``[B, C]`` completion tokens from ``model.generate`` (top-k off, no repetition penalty),
    stopped by the codec's stop set (its strings as ``stop_strings``)."""
    greedy = decoding.greedy
    tok = codec.tokenizer
    gen_cfg = GenerationConfig(
        do_sample=not greedy,
        temperature=None if greedy else decoding.temperature,
        top_p=None if greedy else decoding.top_p,
        top_k=None if greedy else 0,
        max_new_tokens=decoding.max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=list(codec.stop.ids),
        bos_token_id=tok.bos_token_id,
        stop_strings=list(codec.stop.strings) or None,
    )
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=enc["input_ids"].to(device),
        attention_mask=enc["attention_mask"].to(device),
        generation_config=gen_cfg,
        **({"tokenizer": tok} if codec.stop.strings else {}),  # generate needs it for strings
        **(
            {"synced_gpus": True} if decoding.synced else {}
        ),  # (only when asked: stub models lack it)
    )
    return out[:, enc["input_ids"].shape[1] :].cpu()
