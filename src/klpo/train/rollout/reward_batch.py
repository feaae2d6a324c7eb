"""A rollout's samples as the reward functions get them (:class:`klpo.train.rewards.functions.RewardBatch`)."""

from __future__ import annotations

from klpo.train.data.sources import Example
from klpo.train.rewards.functions import RewardBatch, TrainerState
from klpo.train.rollout.samplers import Rollout

__all__ = ["reward_batch"]


def reward_batch(
    rollout: Rollout,
    examples: list[Example] | None = None,
    state: TrainerState | None = None,
) -> RewardBatch:
    """The rollout's samples for the reward functions: each sample's data row (its prompt's
    ``examples`` entry, repeated over the group; without ``examples``, the answer alone), the
    chat messages where the data is chat, and each completion's token ids up to and including
    its end-of-sequence token (``rollout.mask``, as TRL hands ``completion_ids`` over).

    Raises:
        ValueError: ``examples`` do not make the rollout's rows (one per group).
    """
    ids = rollout.completion_ids.cpu()
    keep = rollout.mask.cpu()
    completion_ids = [row[k].tolist() for row, k in zip(ids, keep, strict=True)]
    messages = None
    if examples is None:
        rows: list = [{"answer": a} for a in rollout.answers]
    else:
        each = [e for e in examples for _ in range(rollout.group_size)]
        if len(each) != len(rollout.completions):
            raise ValueError(
                f"{len(examples)} examples of {rollout.group_size} samples each do not make "
                f"the rollout's {len(rollout.completions)} completions"
            )
        rows = [e.columns for e in each]
        if all(e.messages is not None for e in each):
            messages = [[{"role": r, "content": c} for r, c in e.messages] for e in each]
    names = dict.fromkeys(k for r in rows for k in r)
    return RewardBatch(
        list(rollout.prompts),
        list(rollout.completions),
        list(rollout.answers),
        completion_ids=completion_ids,
        columns={k: [r.get(k) for r in rows] for k in names},
        messages=messages,
        state=state or TrainerState(),
    )
