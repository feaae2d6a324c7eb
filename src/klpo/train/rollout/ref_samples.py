"""The reference's own completions, for the KL terms ``ref_is`` and ``adaptive_mix``.

These two estimators (:mod:`klpo.ref_kl`) read, besides the policy's rollout, completions that
pi_ref samples for the same prompts (``kl.ref_samples`` per prompt, by default as many as the
policy's ``rollout.group_size``). Each step :func:`sample_reference` draws them with ``generate``
from the frozen reference and scores them once under pi_ref (sequence log-probs, no gradient), a
:class:`RefBatch`; the loss on them is :func:`klpo.train.step.kl_term.ref_term`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from klpo import reduce
from klpo.train.config import TrainConfig
from klpo.train.models.backbone import ModelHead, shares_prompt, token_outputs
from klpo.train.models.tokens import Codec
from klpo.train.rollout.samplers import Decoding, Rollout, completion_hidden, generate


@dataclass
class RefBatch:
    """The reference's completions of one step, scored under pi_ref."""

    rollout: Rollout  # N = prompts × ref_samples completions of pi_ref
    logp_ref: Tensor  # [N] log pi_ref of each whole completion (float32, no gradient)
    mean_len: float  # L: mean length (tokens) of the *policy's* completions this step
    units: float  # reduce(1) / L: a per-completion KL in the loss's units
    seconds: float  # time spent sampling and scoring under pi_ref


def sequence_logp(
    backbone,
    head: ModelHead,
    r: Rollout,
    temperature: float,
    *,
    share_prompt: bool = True,
) -> Tensor:
    """``[N]`` the log-probability of each whole completion (sum over its valid tokens)."""
    hidden = completion_hidden(backbone, r, share_prompt=share_prompt)
    out = token_outputs(hidden, head, r.completion_ids, temperature=temperature, with_entropy=False)
    return torch.where(r.mask.to(out.logp.device), out.logp, 0.0).sum(-1)


@torch.no_grad()
def sample_reference(
    cfg: TrainConfig,
    reference,
    codec: Codec,
    prompts: list[str],
    answers: list[str],
    policy: Rollout,
) -> RefBatch:
    """Sample ``kl.ref_samples`` completions per prompt from ``reference`` (a frozen Backbone),
    tokenized and cut at the stop set by the run's ``codec``, as the policy's are: both
    sequence distributions are over the same completions."""
    t0 = time.perf_counter()
    decoding = Decoding.from_config(cfg)
    decoding = replace(decoding, group_size=cfg.kl.ref_samples or decoding.group_size)
    r = generate(reference.model, codec.tokenizer, prompts, answers, decoding, codec=codec)
    logp_ref = sequence_logp(
        reference,
        reference.head(),
        r,
        cfg.rollout.temperature,
        share_prompt=shares_prompt(cfg),
    )
    mask = policy.mask
    mean_len = float(mask.sum()) / mask.shape[0]
    ones = reduce.reduce(
        torch.ones(mask.shape, device=mask.device),
        mask,
        cfg.algo.loss_reduction,
        max_len=cfg.rollout.max_new_tokens,
    )
    return RefBatch(r, logp_ref, mean_len, float(ones) / mean_len, time.perf_counter() - t0)
