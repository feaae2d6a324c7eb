"""Held-out accuracy: greedy completions of held-out prompts, scored by a reward function.

:func:`generate` samples completions the way every decoder-only trainer must: prompts left-padded
(so the last prompt token sits next to the first new token), an attention mask over the padding,
position ids counted from the first real token (``generate`` derives them from the mask as
``cumsum(mask) - 1``), generation stopped at the stop set (the tokenizer's EOS and the model's
end-of-turn ids; :mod:`klpo.train.models.tokens`), and each completion decoded up to its first
stop, the stop left out. :func:`heldout_accuracy` is the greedy version, scored with a reward function;
:func:`policy_accuracy` that of a run's policy, during training.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from klpo._io import write_atomic
from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example
from klpo.train.models.backbone import unshard_root
from klpo.train.models.build import Models
from klpo.train.models.tokens import Codec
from klpo.train.rewards import functions as rewards
from klpo.train.rewards.gold import eval_reward
from klpo.train.rollout.reward_batch import reward_batch
from klpo.train.rollout.samplers import Decoding, Rollout
from klpo.train.rollout.samplers import generate as rollout_generate
from klpo.train.runtime.metrics import wilson_interval

__all__ = [
    "Decoding",
    "Evaluation",
    "cached_evaluation",
    "evaluate",
    "evaluation_key",
    "generate",
    "heldout_accuracy",
    "policy_accuracy",
    "policy_evaluation",
    "wilson_interval",
]


@dataclass
class Evaluation:
    """A held-out evaluation: the accuracy, and what it was computed from."""

    accuracy: float
    reward: str  # the reward function's name
    first: Rollout  # the greedy completions of the first batch of problems (group size 1)
    scores: list[float | None]  # the reward of each problem's completion (None: not scored)

    def summary(self) -> str:
        """The accuracy with its 95% Wilson interval where the reward is 0/1, e.g.
        ``"0.150 (30/200 right; 95% interval 0.107-0.206)"``; else the accuracy alone."""
        scored = [s for s in self.scores if s is not None]
        if not scored or any(s not in (0.0, 1.0) for s in scored):
            return f"{self.accuracy:.3f}"
        k, n = int(sum(scored)), len(scored)
        lo, hi = wilson_interval(k, n)
        return f"{self.accuracy:.3f} ({k}/{n} right; 95% interval {lo:.3f}-{hi:.3f})"


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    decoding: Decoding,
    *,
    batch_size: int = 256,
    codec: Codec | None = None,
) -> list[str]:
    """Completions of ``prompts`` by a decoder-only ``transformers`` model, cut at the first stop.

    Prompts are tokenized by ``codec`` (default: plain prompts, the tokenizer's special tokens
    added once; a run's codec knows its chat-rendered prompts) and left-padded in batches of
    ``batch_size`` (position ids come from the attention mask, so padding changes nothing);
    generation stops at the codec's stop set (default: the tokenizer's EOS and the model's
    ``generation_config.eos_token_id``) and the decoded completion excludes the stop and any
    padding. The model is put in eval mode for the call and restored afterwards; gradients are off.

    Args:
        model: a causal LM with ``generate`` (``transformers.PreTrainedModel``).
        tokenizer: its tokenizer, with ``pad_token_id`` and ``eos_token_id`` set.
        prompts: the prompt texts.
        decoding: how to decode (:class:`~klpo.train.rollout.samplers.Decoding`): greedy, or
            sampled with ``temperature`` and ``top_p`` (no top-k) from torch's global generator;
            ``max_new_tokens`` the most tokens of a completion, EOS included.
        batch_size: prompts per sampling call.

    Returns:
        ``decoding.group_size`` completion texts per prompt (one with the default), in order.
    """
    rollouts = _rollouts(
        model, tokenizer, prompts, [""] * len(prompts), decoding, batch_size, codec
    )
    return [c for r in rollouts for c in r.completions]


def _rollouts(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    answers: Sequence[str],
    decoding: Decoding,
    batch_size: int,
    codec: Codec | None,
) -> list[Rollout]:
    """:func:`generate`'s completions as one rollout per batch of ``batch_size`` prompts."""
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer needs pad_token_id and eos_token_id for batched generation; set "
            "tokenizer.pad_token (e.g. to its eos_token) first"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    was_training = model.training
    model.eval()
    out: list[Rollout] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start : start + batch_size])
            mine = list(answers[start : start + batch_size])
            out.append(rollout_generate(model, tokenizer, batch, mine, decoding, codec=codec))
    finally:
        model.train(was_training)
    return out


def heldout_accuracy(
    model: Any, tokenizer: Any, examples: Sequence[Example], decoding: Decoding, **options: Any
) -> float:
    """Fraction of ``examples`` that the model solves with ``decoding`` (greedy:
    ``Decoding(max_new_tokens=n, greedy=True)``): :func:`evaluate`'s accuracy, with its
    ``options`` (``reward``, ``batch_size``, ``codec``, ``state``).

    ``accuracy = (1/N) sum_i reward(prompt_i, greedy completion_i, answer_i)``, with a reward in
    ``{0, 1}`` (``exact_match`` by default; any name or function of
    :mod:`klpo.train.rewards.functions`, in either form: a TRL-form function gets every column
    of each example's data row). An example the reward does not score (None) is left out of
    the mean (0 if it scores none). Greedy decoding makes the number deterministic for a given
    model, so two checkpoints compare without sampling noise; its standard error as an
    estimate of the accuracy on the whole problem distribution is ``sqrt(acc (1 - acc) / N)``
    (about 2.2 points at N = 500, acc = 0.5).

    Returns:
        The accuracy in ``[0, 1]``.
    """
    return evaluate(model, tokenizer, examples, decoding, **options).accuracy


def evaluate(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    decoding: Decoding,
    *,
    reward: str | Callable[..., Sequence[float | None]] = "exact_match",
    batch_size: int = 256,
    state: rewards.TrainerState | None = None,
    codec: Codec | None = None,
) -> Evaluation:
    """The held-out evaluation of ``examples`` (:func:`heldout_accuracy` says how the accuracy is
    scored), with the completions it was computed from: prompts sampled in batches of
    ``batch_size`` (:func:`generate`, tokenized and cut by ``codec``), scored by ``reward``;
    ``state`` is the run's progress a TRL-form reward function is given (default: step 0 of 0)."""
    if not examples:
        raise ValueError("heldout_accuracy needs at least one example")
    fn = rewards.get_reward(reward) if isinstance(reward, str) else reward
    name = reward if isinstance(reward, str) else getattr(reward, "__name__", "reward")
    prompts, answers = [e.prompt for e in examples], [e.answer for e in examples]
    rollouts = _rollouts(model, tokenizer, prompts, answers, decoding, batch_size, codec)
    scores: list[float | None] = []
    for k, r in enumerate(rollouts):
        mine = list(examples[k * batch_size : (k + 1) * batch_size])
        scores += rewards.score(fn, name, reward_batch(r, mine, state))
    got = [x for x in scores if x is not None]
    if scores and not got and (state is None or state.global_step == 0):
        # Before any training (step 0): an accuracy of 0.0 would be no measurement. (Later, a
        # run with minutes of training behind it is not stopped over its evaluation.)
        raise rewards.RewardError(
            f"reward function {name!r}, which scores the held-out accuracy, returned None for "
            f"every one of the {len(scores)} held-out completions, so there is nothing to "
            "measure; return a number for the samples it can score (None only for those it "
            "cannot), or set gold_reward to a reward that scores them"
        )
    accuracy = math.fsum(got) / len(got) if got else 0.0
    return Evaluation(accuracy, name, rollouts[0], scores)


def policy_evaluation(
    cfg: TrainConfig, m: Models, heldout: list[Example], step: int = 0
) -> Evaluation:
    """The run's policy's held-out evaluation after ``step`` training steps, greedy, scored with
    the gold reward if there is one (:func:`klpo.train.rewards.gold.eval_reward`)."""
    unshard_root(m.backbone)  # generate calls the model outside the root's forward
    return evaluate(
        m.policy,
        m.tokenizer,
        heldout,
        Decoding.heldout(cfg),
        reward=eval_reward(cfg),
        codec=m.codec,
        state=rewards.TrainerState(global_step=step, max_steps=cfg.run.steps),
    )


def policy_accuracy(cfg: TrainConfig, m: Models, heldout: list[Example]) -> float:
    """The run's policy's held-out accuracy (:func:`policy_evaluation`)."""
    return policy_evaluation(cfg, m, heldout).accuracy


EVAL_BATCH = 256  # prompts per generate call in a run's held-out evaluation


def evaluation_key(cfg: TrainConfig, m: Models, heldout: Sequence[Example]) -> str | None:
    """A sha256 of everything a run's held-out evaluation depends on, for
    :func:`cached_evaluation`: the policy's weights (every tensor of its state dict, by name,
    dtype, shape and bytes), the held-out prompts as the run's codec tokenizes them, with the
    stop set, answers and data rows, the decoding (greedy, ``rollout.max_new_tokens``,
    ``rollout.sampler``, the batch), the scoring reward's name and its source file's bytes,
    torch's thread count and the versions of klpo, torch and transformers. None where a part
    cannot be hashed (the reward's source not found): then nothing is cached."""
    import transformers

    import klpo

    name = eval_reward(cfg)
    try:
        source = Path(inspect.getsourcefile(rewards.get_reward(name)) or "").read_bytes()
    except (OSError, TypeError):
        return None
    h = hashlib.sha256()

    def put(obj: Any) -> None:
        h.update(json.dumps(obj, sort_keys=True, default=repr).encode("utf-8") + b"\0")

    put([klpo.__version__, torch.__version__, transformers.__version__])
    put([torch.get_num_threads(), cfg.rollout.max_new_tokens, cfg.rollout.sampler, EVAL_BATCH])
    put([name, hashlib.sha256(source).hexdigest()])
    for key, t in sorted(m.policy.state_dict().items()):
        t = t.detach().cpu().contiguous()
        put([key, str(t.dtype), list(t.shape)])
        h.update(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")
    put([list(m.codec.stop.ids), list(m.codec.stop.strings), m.codec.chat])
    put(m.codec.ids([e.prompt for e in heldout]))
    put([[e.prompt, e.answer, e.messages, dict(e.row or {})] for e in heldout])
    return h.hexdigest()


_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "mask", "truncated")


def cached_evaluation(
    cache: str | Path, key: str, compute: Callable[[], Evaluation]
) -> tuple[Evaluation, bool]:
    """The evaluation stored under ``key`` in the directory ``cache``, else ``compute()``'s,
    stored there (atomically: a safetensors file of the first batch's tensors and a JSON file of
    the rest). Returns it and whether it came from the cache. A file that does not read back
    whole is recomputed and replaced.

    >>> import tempfile
    >>> from klpo.train.rollout.samplers import Rollout
    >>> first = Rollout(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
    ...     torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool), ["p"], ["c"],
    ...     ["a"], 1, torch.zeros(1, dtype=torch.bool))
    >>> d = tempfile.mkdtemp()
    >>> cached_evaluation(d, "k", lambda: Evaluation(1.0, "exact_match", first, [1.0]))[1]
    False
    >>> ev, hit = cached_evaluation(d, "k", lambda: 1 / 0)
    >>> hit, ev.accuracy, ev.first.completions
    (True, 1.0, ['c'])
    """
    from safetensors.torch import load_file, save

    from klpo.train.rollout.samplers import Rollout

    base = Path(cache) / key
    tensors, meta = base.with_suffix(".safetensors"), base.with_suffix(".json")
    try:
        info = json.loads(meta.read_text(encoding="utf-8"))
        ts = load_file(str(tensors))
        first = Rollout(
            **{k: ts[k] for k in _TENSORS[:-1]},
            truncated=ts.get("truncated"),  # (a rollout may have none)
            prompts=info["prompts"],
            completions=info["completions"],
            answers=info["answers"],
            group_size=info["group_size"],
        )
        return Evaluation(info["accuracy"], info["reward"], first, info["scores"]), True
    except (OSError, ValueError, KeyError, TypeError):
        pass  # absent, or not whole: computed again below
    ev = compute()
    if ev.first.engine_logp is None:
        r = ev.first
        kept = {k: t.contiguous().cpu() for k in _TENSORS if (t := getattr(r, k)) is not None}
        write_atomic(tensors, save(kept))
        info = {
            "accuracy": ev.accuracy,
            "reward": ev.reward,
            "scores": ev.scores,
            "prompts": r.prompts,
            "completions": r.completions,
            "answers": r.answers,
            "group_size": r.group_size,
        }
        write_atomic(meta, json.dumps(info))
    return ev, False
