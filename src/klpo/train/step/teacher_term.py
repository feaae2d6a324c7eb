"""The teacher term of on-policy distillation: the teacher's scores of the rollout, its penalty in
the reward or its divergence in the loss, and its metrics (``teacher:``; docs/distillation.md).

Scoring (:func:`teacher_scores`, no gradients) runs the teacher over the student's completions
once per step: its last hidden states at every completion position and the log-probs of the
sampled tokens, and, from the policy's pass at the sampling parameters, the metrics
``kl/teacher/exact`` (KL(pi_theta ‖ pi_T), exact per position), ``kl/teacher/forward``
(KL(pi_T ‖ pi_theta), exact) and ``kl/teacher/<estimator>`` (the configured per-token estimate,
on the sampled tokens) — apart from the reference's ``kl/ref/*``, never mixed with them.

In the reward (:func:`teacher_penalty`): ``-beta_T · sg(est(logp_old, logp_T))`` on every token,
credited with returns-to-go (the algorithm's own treatment of a per-token reward, as a KL in the
reward is: the gradient of the sequence's KL) or to its own token only (``credit: token``,
discount 0: the Tinker cookbook's advantage, which follows the per-position gradient; ``klpo
explain --teacher``). In the loss (:func:`teacher_loss`): the estimator on the sampled tokens
with :func:`klpo.losses.kl_loss`'s off-policy weight, or a divergence over the vocabulary from
both models' hidden states (:mod:`klpo.teacher`; ``full`` through the fused head of
:func:`klpo.logprobs.fused`), reduced like the policy loss and scaled by ``beta_T``. The exact
forms (``full``, ``forward``, ``jsd``) over heads without a logit transform take their gradient
in the forward pass where ``algo.fused_loss`` does (:func:`klpo.train.step.fused.takes_fused_loss`):
their weights are the reduction's (:func:`klpo.train.step.fused.reduction_weights`), and
:func:`klpo.teacher.from_hidden_loss` forms the gradient tile by tile without recomputing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from klpo import kl, losses, teacher
from klpo.heads import Head
from klpo.train.config import ConfigError, TrainConfig
from klpo.train.models.backbone import shares_prompt, token_outputs
from klpo.train.models.build import Models
from klpo.train.rollout.samplers import Rollout, completion_hidden
from klpo.train.step.fused import reduction_weights, takes_fused_loss

__all__ = ["TeacherScores", "teacher_loss", "teacher_penalty", "teacher_scores"]

_EAGER = {"forward": "forward", "jsd": "jsd"}
"""The exact ``teacher.estimator`` forms :func:`klpo.teacher.from_hidden_loss` computes (plain
heads, ``algo.fused_loss`` taking the forward-pass gradient): the divergence of each. ``full``
(the reverse KL) stays on the fused head of :func:`klpo.logprobs.fused`, which measured faster
(``bench/teacher_kl.py``: 0.62x and 0.53x TRL's time at Qwen2.5's and Gemma 3's heads, against
0.73x and 0.79x for the loss form, whose tiles of ~50 rows each read and write the head's
gradient), in docs/performance.md."""


@dataclass
class TeacherScores:
    """The teacher's view of this rank's rollout (B completions of C tokens)."""

    logp: Tensor  # [B, C] log pi_T of the sampled tokens
    hidden: Tensor  # [B, C, H_T] the teacher's last hidden states (or its logits)
    means: dict[str, Tensor] = field(default_factory=dict)  # [B, C] per-token metric values


def _head(module: torch.nn.Module):
    from klpo.train.models.build import unwrap

    return unwrap(module).head()


def _plain(head, key: str, estimator: str) -> Head:
    """A head :mod:`klpo.teacher`'s hidden-state functions can read: no logit transform."""
    if not isinstance(head, Head):
        raise ConfigError(
            f"teacher.estimator={estimator} computes from hidden states and heads, but "
            "model.logits_path is model (the models' own logits); use model.logits_path=fused, "
            "or teacher.estimator=full or a sampled estimator"
        )
    if head.transform is not None:
        raise ConfigError(
            f"teacher.estimator={estimator}: the {key}'s head transforms its logits "
            f"({head.transform}), which klpo.teacher's hidden-state divergences do not apply; "
            "use teacher.estimator=full (the fused head applies it) or a sampled estimator"
        )
    return head


@torch.no_grad()
def teacher_scores(
    cfg: TrainConfig, m: Models, rollout: Rollout, policy_hidden: Tensor, logp_old: Tensor
) -> TeacherScores:
    """The teacher's hidden states and log-probs on ``rollout``, and the teacher metrics' per-token
    values from the policy's hidden states at the sampling parameters (``policy_hidden``,
    ``logp_old``; no gradient)."""
    t, temperature = cfg.teacher, cfg.rollout.temperature
    tokens, mask = rollout.completion_ids, rollout.mask
    hidden_t = completion_hidden(m.teacher, rollout, share_prompt=shares_prompt(cfg))
    head_t, head = _head(m.teacher), _head(m.backbone)
    out = token_outputs(
        policy_hidden, head, tokens, temperature=temperature, features_ref=hidden_t,
        head_ref=head_t, with_entropy=False,
    )  # fmt: skip
    logp_t = token_outputs(hidden_t, head_t, tokens, temperature=temperature, with_entropy=False)
    means = {"kl/teacher/exact": out.kl}
    plain = all(isinstance(h, Head) and h.transform is None for h in (head, head_t))
    if plain:  # the forward KL from hidden states (no head transform to apply)
        b, c = tokens.shape
        fwd = teacher.from_hidden(
            policy_hidden.reshape(b * c, -1), head.weight, hidden_t.reshape(b * c, -1),
            head_t.weight, divergence="forward", bias=head.bias, bias_teacher=head_t.bias,
            temperature=temperature,
        )  # fmt: skip
        means["kl/teacher/forward"] = fwd.view(b, c)
    if t.estimator in kl.LOGPROB_ESTIMATORS:
        est = kl.estimate(t.estimator, logp_old, logp_t.logp, logp_old=logp_old, mask=mask)
        means[f"kl/teacher/{t.estimator}"] = est
    return TeacherScores(logp_t.logp, hidden_t, means)


def teacher_penalty(cfg: TrainConfig, ts: TeacherScores, logp_old: Tensor, mask: Tensor) -> Tensor:
    """``[B, C]`` the teacher term as a detached per-token reward, ``-beta_T · est(y_t)`` at the
    sampling parameters (0 on masked tokens)."""
    t = cfg.teacher
    est = kl.estimate(t.estimator, logp_old, ts.logp, logp_old=logp_old, mask=mask)
    return torch.where(mask, -t.beta * est.to(torch.float32), 0.0)


def _vocabulary_fn(cfg: TrainConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """The top-k terms as functions of both models' logits ``[n, V]`` (temperature applied)."""
    t, temperature = cfg.teacher, cfg.rollout.temperature
    if t.estimator == "topk_forward":
        return lambda z, zt: teacher.topk_forward_kl(
            z, *teacher.teacher_topk(zt, t.top_k, temperature=temperature),
            temperature=temperature, log_prob_floor=t.log_prob_floor, clamp_zero=t.clamp_zero,
        )  # fmt: skip
    if t.estimator == "topk_tail":
        return lambda z, zt: teacher.topk_tail_kl(
            z, *teacher.teacher_topk(zt, t.top_k, temperature=temperature), temperature=temperature
        )
    return lambda z, zt: teacher.student_topk_kl(
        z, zt, t.top_k, temperature=temperature, clamp_zero=t.clamp_zero
    )


def teacher_loss(
    cfg: TrainConfig,
    m: Models,
    hidden: Tensor,
    logp: Tensor,
    hidden_t: Tensor,
    logp_t: Tensor,
    rows_logp_old: dict,
    red: Callable[[Tensor], Tensor],
    tokens: Tensor,
) -> Tensor:
    """The micro-batch's teacher term in the loss, reduced by ``red`` (before ``beta_T``).

    ``hidden``, ``logp``: the policy's ``[b, C, H]`` hidden states and ``[b, C]`` log-probs of
    the micro-batch (with gradient); ``hidden_t``, ``logp_t``: the teacher's; ``rows_logp_old``:
    :func:`klpo.losses.kl_loss`'s off-policy keywords for the rows; ``tokens``: ``[b, C]``."""
    t, temperature = cfg.teacher, cfg.rollout.temperature
    if not t.vocabulary:  # a per-token estimator on the sampled tokens, the teacher as pi_ref
        return red(losses.kl_loss(t.estimator, logp, logp_t, **rows_logp_old))
    head, head_t = _head(m.backbone), _head(m.teacher)
    plain = all(isinstance(h, Head) and h.transform is None for h in (head, head_t))
    if (
        t.estimator in _EAGER
        and plain
        and takes_fused_loss(cfg, head.weight.shape[0], applies=True)
    ):
        # The term's weight on each position is the reduction's alone, known before the forward
        # pass: the gradient is formed in it, no logit tile recomputed in the backward pass.
        b, c = tokens.shape
        return teacher.from_hidden_loss(
            hidden.reshape(b * c, -1), head.weight, hidden_t.reshape(b * c, -1), head_t.weight,
            reduction_weights(red, tokens.shape, hidden.device).reshape(-1),
            divergence=_EAGER[t.estimator], beta=t.jsd_beta, bias=head.bias,
            bias_teacher=head_t.bias, temperature=temperature,
        ).loss  # fmt: skip
    if t.estimator == "full":  # through the fused head (transforms included)
        out = token_outputs(
            hidden, head, tokens, temperature=temperature, features_ref=hidden_t,
            head_ref=head_t, with_entropy=False,
        )  # fmt: skip
        return red(out.kl)
    head, head_t = _plain(head, "policy", t.estimator), _plain(head_t, "teacher", t.estimator)
    b, c = tokens.shape
    flat, flat_t = hidden.reshape(b * c, -1), hidden_t.reshape(b * c, -1)
    if t.estimator in ("forward", "jsd"):
        value = teacher.from_hidden(
            flat, head.weight, flat_t, head_t.weight, divergence=t.estimator,
            beta=t.jsd_beta, bias=head.bias, bias_teacher=head_t.bias, temperature=temperature,
        )  # fmt: skip
    else:
        value = teacher.by_chunks_of_logits(
            _vocabulary_fn(cfg), flat, head.weight, flat_t, head_t.weight, bias=head.bias,
            bias_teacher=head_t.bias,
        )  # fmt: skip
    return red(value.view(b, c))
