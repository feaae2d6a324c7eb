"""The update: ``epochs × minibatches`` optimizer steps on one scored rollout, in micro-steps.

:func:`update` shuffles the rollout (whole groups when prompts are shared), cuts each minibatch
into micro-batches (:mod:`klpo.train.step.microbatch`), divides every loss by the minibatch's
global normaliser, accumulates the micro-steps' gradients and steps the optimizers. One
:func:`micro_step` is four named steps:

1. :func:`forward`: the policy's forward pass on the micro-batch, with its gradient taken in the
   pass where ``algo.fused_loss`` allows it (:mod:`klpo.train.step.fused`); the first forward of
   a row at the sampling parameters fills pi_old (:class:`~klpo.train.step.types.SamplingPass`);
2. :func:`policy_loss`: the loss, ``red(pg) + beta red(kl) + entropy_coef red(-entropy)``, from
   the policy loss (:data:`klpo.train.algorithms.POLICY_LOSSES`, with truncated importance
   sampling against an engine's log-probs, :mod:`klpo.mismatch`, and Trust Region Masking's
   sequence mask, :func:`trm_keep`, on ``pg`` alone), the step's KL term with its
   coefficients (:class:`~klpo.train.step.kl_term.KLTerm`, passed whole) and the entropy
   bonus, plus a mixture-of-experts policy's router load-balancing loss (:func:`router_aux`);
   then its backward;
3. :func:`critic_step`: the critic's value loss and its backward (algorithms with a critic);
4. :func:`micro_metrics`: the micro-batch's token metrics (clip fraction, KL to pi_old, GSPO's).

Under ``torchrun`` every loss is divided by the global token (or sequence) count, so the gradient
equals that of one process holding the whole batch; DDP's mean over ranks is undone by a factor
``world`` (micro-batches other than an optimizer step's last run under ``no_sync``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from klpo import logprobs, losses, mismatch, offpolicy, reduce
from klpo.heads import Head
from klpo.train.algorithms import POLICY_LOSSES, anchors_to_sampler
from klpo.train.config import TrainConfig
from klpo.train.models import fsdp
from klpo.train.models.backbone import reference_args, shares_prompt, token_outputs
from klpo.train.models.build import Models, unwrap
from klpo.train.rollout.samplers import Rollout, completion_hidden
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally
from klpo.train.step import microbatch
from klpo.train.step.fused import on_policy_weights, takes_fused_loss
from klpo.train.step.kl_term import KLTerm, ref_term
from klpo.train.step.score import values
from klpo.train.step.teacher_term import teacher_loss
from klpo.train.step.types import Optimizers, Scored

__all__ = [
    "MicroBatch",
    "critic_step",
    "forward",
    "has_signal",
    "kl_pulls_back",
    "micro_metrics",
    "micro_step",
    "policy_loss",
    "router_aux",
    "shuffle_rows",
    "trm_keep",
    "update",
]

Reduce = Callable[[Tensor], Tensor]
"""A per-token ``[B, C]`` tensor reduced with the minibatch's global normaliser."""


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``rows`` of the scored rollout ``s``: their rollout ``r``, the minibatch's global
    normaliser ``n_global`` and ``red``, the reduction of a per-token loss with it
    (:meth:`of` builds one)."""

    s: Scored
    rows: Tensor
    r: Rollout
    red: Reduce
    n_global: Tensor
    keep: Tensor | None = None  # [b, C] a batch-level policy-loss mask (M2PO), rows' share

    @classmethod
    def of(
        cls, cfg: TrainConfig, s: Scored, rows: Tensor, n_global: Tensor, keep: Tensor | None = None
    ) -> MicroBatch:
        """Rows ``rows`` of ``s`` in an optimizer step whose normaliser is ``n_global``
        (``algo.loss_reduction``'s, over the minibatch and all ranks) and whose batch-level
        policy-loss mask is ``keep`` (``[B, C]``, M2PO's; None: none)."""
        r = s.rollout.select(rows)
        mask = r.mask
        max_len = cfg.rollout.max_new_tokens

        def red(x: Tensor) -> Tensor:
            return reduce.reduce(
                x, mask, cfg.algo.loss_reduction, normaliser=n_global, max_len=max_len
            )

        mine = None if keep is None else keep[rows.to(keep.device)]
        return cls(s, rows, r, red, n_global, mine)

    @property
    def adv(self) -> Tensor:
        return self.s.adv[self.rows]

    @property
    def logp_old(self) -> Tensor:
        """log pi_old of the rows (read after the forward that may fill it)."""
        return self.s.old.logp[self.rows]


def update(
    cfg: TrainConfig,
    m: Models,
    s: Scored,
    opt: Optimizers,
    term: KLTerm,
    dist: Dist,
    gen: torch.Generator,
) -> Tally:
    """``epochs × minibatches`` optimizer steps on one scored rollout; returns their metrics.

    Losses are summed over an optimizer step's micro-batches and ranks (each is already divided
    by the minibatch's global normaliser) and averaged over the optimizer steps; token metrics
    pool every token; ``grad_norm`` (the same on every rank) is averaged over the steps.

    ``term`` is the step's KL term with its coefficients (:func:`klpo.train.step.kl_term.kl_term`,
    :func:`~klpo.train.step.kl_term.sample_kl_term`). With the reference's completions
    (``ref_is``, ``adaptive_mix``) each optimizer step also carries the KL term on them
    (:func:`klpo.train.step.kl_term.ref_term`); its metrics are those of the first optimizer
    step, at the sampling policy's parameters, averaged over ranks.
    """
    a = cfg.algo
    mask = s.rollout.mask
    no_signal, kl_pulls = _signal(cfg, s, term, dist)
    if no_signal and kl_pulls is False:  # skipped, decided before any pass: none runs
        for _ in range(a.epochs):  # the row orders drawn all the same: later steps' draws
            shuffle_rows(cfg, s.rollout, gen)  # do not depend on where the skip was decided
        tally = Tally()
        tally.add("step/skipped", 1.0, 1.0)
        return tally
    skip = False
    max_len = cfg.rollout.max_new_tokens
    clip = cfg.optim.grad_clip or math.inf
    batch_mask = POLICY_LOSSES[a.policy_loss].batch_mask
    # The tokens the masks keep at the first epoch (sampler/masked_frac): M2PO's of the first
    # epoch's optimizer steps, TRM's (the same at every epoch) from the micro-steps.
    s.keep = mask.clone() if batch_mask or a.trm_delta is not None else None
    tally = Tally()
    ref_seconds, ref_logged = 0.0, False
    # Whole groups per pass where the passes share each group's prompt (as scoring did).
    shared = s.rollout.group_size if shares_prompt(cfg) and s.rollout.packs is None else 1
    for epoch in range(a.epochs):
        order = shuffle_rows(cfg, s.rollout, gen)
        for mb in microbatch.minibatches(order, a.minibatches, shared):
            # One normaliser for the whole minibatch, over its micro-batches and all ranks.
            n_global = dist.all_sum(reduce.normaliser(mask[mb], a.loss_reduction, max_len=max_len))
            opt.policy.zero_grad(set_to_none=True)
            if opt.critic is not None:
                opt.critic.zero_grad(set_to_none=True)
            step_losses: dict[str, float] = {}
            keep = _batch_mask(cfg, s, mb, tally, dist, first=epoch == 0) if batch_mask else None
            if term.ref is not None:
                head = unwrap(m.backbone).head()
                part = ref_term(cfg, m.backbone, head, term)
                unwrap(m.backbone).take_router_aux()  # the policy's samples balance the router
                ref_seconds += part.pop("time/ref_update")
                if not ref_logged:
                    tally.add_means(part, 1.0)
                    ref_logged = True
            width = s.rollout.prompt_ids.shape[1] + s.rollout.completion_ids.shape[1]
            micro = microbatch.split(mb, width, a.micro_batch, a.micro_batch_tokens, shared)
            for i, rows in enumerate(micro):
                piece = MicroBatch.of(cfg, s, rows, n_global, keep)
                part = micro_step(cfg, m, piece, term, dist, sync=i == len(micro) - 1, tally=tally)
                for k, v in part.items():
                    step_losses[k] = step_losses.get(k, 0.0) + v
            # This rank holds 1/world of the optimizer step: the ranks' shares sum to its loss.
            for k, v in step_losses.items():
                tally.add(k, v, 1.0 / dist.world)
            if no_signal and kl_pulls is None:
                kl_pulls = kl_pulls_back(s, term, dist, a.skip_kl_floor)
            skip = no_signal and not kl_pulls
            _optimizer_step(m, opt, clip, tally, skip=skip)
    if term.ref is not None:
        tally.add("time/ref_update", ref_seconds, 1.0)
    tally.add("step/skipped", float(skip), 1.0)
    return tally


def _batch_mask(
    cfg: TrainConfig, s: Scored, rows: Tensor, tally: Tally, dist: Dist, *, first: bool
) -> Tensor:
    """``[B, C]`` M2PO's mask over the optimizer step's tokens ``rows`` (False elsewhere), from
    log pi_old - log pi_behav (pi_behav the stale sampler's or the engine's log-probs, else
    pi_old: all kept); the share it drops goes to ``m2po/masked_frac``, and at the ``first``
    epoch its rows into ``s.keep``.

    Under ``torchrun`` the optimizer step's tokens are every rank's ``rows``: each rank's
    ``(log pi_old - log pi_behav)²`` are gathered in rank order (:meth:`Dist.cat`), the rule
    (:func:`klpo.offpolicy.m2po_keep`) applied once to them all, and each rank takes its own
    slice, so that it masks its rows as one process holding every rank's would."""
    if not bool(s.old.filled.all()):
        raise RuntimeError("M2PO's mask needs pi_old before the update (the score pass fills it)")
    mask = s.rollout.mask
    behav = s.rollout.sampler_logp
    old = s.old.logp[rows]
    log_ratio = old - (old if behav is None else behav[rows].to(old.dtype))
    threshold = cfg.algo.m2po_threshold
    if dist.enabled:
        valid = mask[rows]
        m2 = log_ratio.detach().to(torch.float64).square()[valid]
        everyone, start = dist.cat(m2)
        kept = torch.zeros_like(valid)
        kept[valid] = offpolicy.m2po_keep(everyone, threshold=threshold)[start : start + m2.numel()]
    else:
        kept = offpolicy.m2po_mask(log_ratio, mask[rows], threshold=threshold)
    keep = torch.zeros_like(mask)
    keep[rows] = kept
    tally.add("m2po/masked_frac", float((mask[rows] & ~kept).sum()), float(mask[rows].sum()))
    if first and s.keep is not None:
        s.keep[rows] &= kept
    return keep


def trm_keep(cfg: TrainConfig, mb: MicroBatch) -> Tensor | None:
    """``[b, C]`` bool: the micro-batch's valid tokens that Trust Region Masking keeps, or None
    (``algo.trm_delta`` null).

    :func:`klpo.offpolicy.trm_mask` of log pi_old against the log-probs of the policy that
    sampled the tokens (the stale sampler's or the engine's), radius ``algo.trm_delta``,
    ``algo.trm_statistic``, ``algo.trm_aggregate`` (Li et al. 2025, arXiv:2512.23075); with
    ``exact``, the behaviour pass's exact KL(pi_behav ‖ pi_old) at each position. pi_old is
    the trainer's recomputation at the weights that start the step (pi_theta at the first update,
    the pi_theta of M2PO's mask too), fixed over the update, and the statistic is each row's own:
    the mask of a row is the same in every micro-batch, optimizer step and epoch, so it is the
    mask of the whole batch at any split. Read after the forward that may fill pi_old."""
    a = cfg.algo
    if a.trm_delta is None:
        return None
    behav = mb.r.sampler_logp
    if behav is None:  # (the config refuses trm_delta without a behaviour policy)
        raise RuntimeError(
            "algo.trm_delta needs the sampler's log-probs (rollout.staleness > 0 or "
            "rollout.engine=vllm), and this rollout has none"
        )
    logp_old, mask = mb.logp_old, mb.r.mask
    exact = a.trm_statistic == "exact"
    if exact and mb.r.behav_kl is None:  # (the config refuses it without staleness)
        raise RuntimeError(
            "algo.trm_statistic=exact needs the behaviour pass's exact KL (rollout.staleness > 0)"
        )
    return offpolicy.trm_mask(
        logp_old, behav.to(logp_old.device), mask, delta=a.trm_delta,
        statistic="k3" if exact else a.trm_statistic, aggregate=a.trm_aggregate,
        token_kl=mb.r.behav_kl.to(logp_old.device) if exact else None,
    )  # fmt: skip


def _signal(cfg: TrainConfig, s: Scored, term: KLTerm, dist: Dist) -> tuple[bool, bool | None]:
    """``(no_signal, kl_pulls)``: whether ``algo.skip_no_signal`` finds no advantage signal (a
    teacher in the loss always pulls: its gradient is there whatever the rewards), and, where it
    can be told before any pass (no KL term in the loss, or pi_old's exact KL already scored),
    whether the KL term pulls back (:func:`kl_pulls_back`); None where the first forward must
    compute pi_old's KL first. Collectives: every rank calls it."""
    teacher_pulls = cfg.teacher is not None and cfg.teacher.placement == "loss"
    no_signal = cfg.algo.skip_no_signal and not teacher_pulls and not has_signal(s, dist)
    if no_signal and (not _kl_in_loss(term) or bool(s.old.filled.all())):
        return True, kl_pulls_back(s, term, dist, cfg.algo.skip_kl_floor)
    return no_signal, None


def has_signal(s: Scored, dist: Dist) -> bool:
    """Whether the step's batch has an advantage signal: some completion token, on some rank,
    with a nonzero advantage (a collective: every rank must call it).

    Without one the policy-gradient term is zero everywhere and the gradient is the KL and
    entropy terms' alone: at the reference, the rounding noise of a KL that is zero, which an
    adaptive optimizer (AdamW divides by the gradient's own running scale) turns into steps of
    the learning rate's size. Group baselines give exactly 0 to a group of equal rewards
    (:func:`klpo.advantages.group_relative`, :func:`klpo.advantages.rloo`), so with GRPO, Dr.
    GRPO and RLOO this is "some group's rewards differ" (or a KL penalty in the reward is
    nonzero somewhere); with a critic (PPO) it is "some return differs from its value".
    """
    local = bool((s.adv[s.rollout.mask] != 0).any())
    return dist.any(local)


def kl_pulls_back(s: Scored, term: KLTerm, dist: Dist, floor: float) -> bool:
    """Whether a step without advantage signal still has a KL gradient to take: a KL term in
    the loss (on the policy's or the reference's completions) and the policy off the reference,
    its exact KL(pi_old ‖ pi_ref) per token over the rows recorded so far, on every rank, above
    ``floor`` (a collective: every rank must call it). At the reference the KL and its gradient
    are exactly 0, and a step on them would be AdamW scaling rounding up to the learning rate;
    off it, the KL term's pull is the regulariser itself, which a KL in the reward exerts on
    every step through the advantages (:func:`has_signal`)."""
    if not _kl_in_loss(term):
        return False
    valid = s.rollout.mask & s.old.filled[:, None]
    total = torch.stack([s.old.kl[valid].double().sum(), valid.sum().double()])
    kl_sum, n = dist.all_sum(total).tolist()
    return n > 0 and kl_sum / n > floor


def _kl_in_loss(term: KLTerm) -> bool:
    """Whether the step's KL term has a gradient in the loss (on the policy's completions or
    the reference's)."""
    return term.loss_coef > 0 or (term.ref is not None and term.ref_coef > 0)


def _optimizer_step(m: Models, opt: Optimizers, clip: float, tally: Tally, *, skip: bool) -> None:
    """Clip the accumulated gradients, log the policy's norm, step the optimizers (``skip``:
    drop the gradients instead, leaving every parameter and the optimizers' state as they were)."""
    policy_params = [p for p in m.policy.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(policy_params, clip)
    tally.add("grad_norm", fsdp.to_float(norm), 1.0)  # a DTensor under FSDP
    if skip:
        opt.policy.zero_grad(set_to_none=True)
        if opt.critic is not None:
            opt.critic.zero_grad(set_to_none=True)
        return
    opt.policy.step()
    if opt.critic is not None:
        torch.nn.utils.clip_grad_norm_(m.critic_core.parameters(), clip)
        opt.critic.step()


def shuffle_rows(cfg: TrainConfig, rollout: Rollout, gen: torch.Generator) -> Tensor:
    """The update's row order: whole groups shuffled when prompts are shared, else rows.

    With ``rollout.share_prompt`` the minibatches (and micro-batches of a multiple of the group
    size) hold whole groups in order, so each prompt is computed once per group in the update's
    forward pass too (:func:`klpo.train.rollout.samplers.shared_groups`).

    With a packed layout (``algo.packing: on``, ``rollout.packs``) whole packs are shuffled,
    each pack's rows in their order there, so that a micro-batch of consecutive rows fills few
    packs (its rows keep their places in them, :mod:`klpo.train.models.packing`).
    """
    if rollout.packs is not None:
        return rollout.packs.order(torch.randperm(rollout.packs.n_packs, generator=gen))
    g = rollout.group_size
    b = rollout.mask.shape[0]
    if not cfg.rollout.share_prompt or g <= 1 or b % g:
        return torch.randperm(b, generator=gen)
    groups = torch.randperm(b // g, generator=gen)
    return (groups[:, None] * g + torch.arange(g)).flatten()


def _no_sync(module: torch.nn.Module | None, sync: bool):
    if module is None or sync or not hasattr(module, "no_sync"):
        return nullcontext()
    return module.no_sync()


def micro_step(
    cfg: TrainConfig,
    m: Models,
    mb: MicroBatch,
    term: KLTerm,
    dist: Dist,
    *,
    sync: bool,
    tally: Tally,
) -> dict[str, float]:
    """Forward and backward of one micro-batch (gradients accumulate); returns its losses.

    Its losses are its share of the optimizer step's (``mb.n_global`` is the step's
    normaliser); its token metrics go into ``tally``. Rows of ``mb.s.old`` not yet filled are
    filled from this forward (:class:`~klpo.train.step.types.SamplingPass`). ``sync``: the
    optimizer step's last micro-batch, whose backward DDP reduces over ranks. ``term``: the
    step's KL term with its coefficients. ``mb.keep``: a batch-level policy-loss mask (M2PO), or
    None. With ``algo.trm_delta`` the policy loss drops the rows :func:`trm_keep` masks; the
    shares go to ``trm/masked_frac`` (tokens) and ``trm/seq_masked_frac`` (completions with a
    token).
    """
    s, rows, mask = mb.s, mb.rows, mb.r.mask
    with _no_sync(m.backbone, sync):
        out, fused, hidden = forward(cfg, m, mb, term, dist)
        trm = trm_keep(cfg, mb)
        total, metrics = policy_loss(cfg, mb, out, term, trm=trm)
        extra = []  # terms beside the policy loss, in the loss's units
        aux = router_aux(cfg, m, mb)
        if aux is not None:
            metrics["loss/router_aux"] = aux.item()
            extra.append(m.router_aux_coef * aux)
        if cfg.teacher is not None and cfg.teacher.placement == "loss":
            t = s.teacher
            at = rows.to(t.logp.device)
            loss_t = teacher_loss(
                cfg, m, hidden, out.logp, t.hidden[at], t.logp[at], _kl_old(cfg, mb), mb.red,
                mb.r.completion_ids,
            )  # fmt: skip
            metrics["loss/teacher"] = loss_t.item()
            extra.append(cfg.teacher.beta * loss_t)
        for term_ in extra:
            total = total + term_
        # DDP averages gradients over ranks; the normaliser is already global, so undo the mean
        # (on_policy_weights carries the factor already).
        if fused is not None:  # total's gradient; total itself is the value, for the logs
            (fused + sum(x * dist.world for x in extra) if extra else fused).backward()
        else:
            (total * dist.world).backward()
    if m.critic is not None:
        loss_v = critic_step(cfg, m, mb, dist, sync=sync, tally=tally)
        metrics["loss/value"] = loss_v.item()
        total = total.detach() + cfg.algo.vf_coef * loss_v.detach()
    metrics["loss/total"] = total.item()
    micro_metrics(cfg, out.logp, mb.logp_old, mb.adv, mask, tally)
    if trm is not None:
        rows_with_tokens = mask.any(-1)
        dropped_rows = rows_with_tokens & ~trm.any(-1)
        tally.add("trm/masked_frac", float((mask & ~trm).sum()), float(mask.sum()))
        tally.add("trm/seq_masked_frac", float(dropped_rows.sum()), float(rows_with_tokens.sum()))
        if s.keep is not None:
            s.keep[rows.to(s.keep.device)] &= trm.to(s.keep.device)
    return metrics


def router_aux(cfg: TrainConfig, m: Models, mb: MicroBatch) -> Tensor | None:
    """The micro-batch's share of the optimizer step's router load-balancing loss, or None.

    A mixture-of-experts policy with ``algo.router_aux_loss_coef`` > 0 computes the loss in its
    forward (:func:`klpo.train.models.backbone.router_aux_loss`); each micro-batch's is weighted
    by its share of the minibatch's global normaliser, so the optimizer step's term is their
    weighted mean over micro-batches and ranks (one micro-batch: the forward's own loss).
    """
    if not m.router_aux_coef:
        return None
    aux = unwrap(m.backbone).take_router_aux()
    if aux is None:
        return None
    mode, max_len = cfg.algo.loss_reduction, cfg.rollout.max_new_tokens
    return aux * (reduce.normaliser(mb.r.mask, mode, max_len=max_len) / mb.n_global)


def forward(
    cfg: TrainConfig,
    m: Models,
    mb: MicroBatch,
    term: KLTerm,
    dist: Dist,
) -> tuple[logprobs.FusedOutput, Tensor | None, Tensor]:
    """The policy's log-probs, entropy and exact KL on the micro-batch, the loss whose
    gradient the pass took (:func:`klpo.logprobs.fused_loss`, where
    ``algo.fused_loss`` allows it) or None (the per-token path: the caller's backward), and the
    policy's hidden states ``[b, C, H]`` (for a teacher term in the loss).

    ``term.loss_coef`` is the loss's coefficient on the per-token KL term ``term.estimator`` (0:
    none). The first forward of a row at the sampling parameters records it as pi_old.
    """
    s, rows, r, mask = mb.s, mb.rows, mb.r, mb.r.mask
    kl_coef = term.loss_coef
    recording = not bool(s.old.filled[rows].all())
    exact = term.exact
    need_ref = (kl_coef > 0 and exact) or recording
    head = unwrap(m.backbone).head()
    head_ref = m.reference.head() if need_ref else None
    hidden_ref = s.hidden_ref[rows] if need_ref else None
    # On-policy, with a KL term that is exact or absent and no engine weights, the loss's weight
    # on each token's log-prob, entropy and KL is known before the forward pass: the gradient is
    # taken in it (klpo.logprobs.fused_loss), with the same gradient as the per-token path. Not
    # on the model's own logits (model.logits_path: model), which the forward holds anyway.
    applies = recording and r.sampler_logp is None and (kl_coef == 0 or exact)
    weights = None
    if isinstance(head, Head) and takes_fused_loss(cfg, head.weight.shape[0], applies=applies):
        weights = on_policy_weights(cfg, mb.adv, mask, mb.red, term, dist.world)
    hidden = completion_hidden(m.backbone, r, share_prompt=shares_prompt(cfg))
    fused = None
    if weights is not None:
        fl = logprobs.fused_loss(
            hidden, head.weight, r.completion_ids, bias=head.bias, transform=head.transform,
            temperature=cfg.rollout.temperature, **reference_args(hidden_ref, head_ref),
            with_entropy=True, logp_weight=weights[0], entropy_weight=weights[1],
            kl_weight=weights[2],
        )  # fmt: skip
        out, fused = logprobs.FusedOutput(fl.logp, fl.entropy, fl.kl), fl.loss
    else:
        out = token_outputs(
            hidden, head, r.completion_ids, temperature=cfg.rollout.temperature,
            features_ref=hidden_ref, head_ref=head_ref,
        )  # fmt: skip
    if recording:
        s.old.record(rows, out)
    return out, fused, hidden


def policy_loss(
    cfg: TrainConfig,
    mb: MicroBatch,
    out: logprobs.FusedOutput,
    term: KLTerm,
    *,
    trm: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's loss ``red(pg) + beta w red(kl) + entropy_coef red(-entropy)`` (its
    share of the optimizer step's) and its parts' values.

    ``trm``: ``[b, C]`` bool, Trust Region Masking's kept tokens (:func:`trm_keep`), or None.
    It masks ``pg`` alone, after its TIS weight (the masked rows' tokens still count in the
    normaliser, as M2PO's): the KL term and the entropy bonus keep every token.

    ``w = term.loss_weight`` is the weight of the per-token KL term ``term.estimator`` in the KL
    term (0: no KL in the loss), ``beta = term.beta``; a non-exact estimator carries the
    off-policy weight of :func:`klpo.losses.kl_loss` unless ``kl.off_policy_correction`` is
    false. The policy loss reads ``term.beta_old`` (PPO's penalty coefficient).
    """
    a, r, red = cfg.algo, mb.r, mb.red
    kl_estimator, kl_weight, beta = term.estimator, term.loss_weight, term.beta
    adv, mask, logp, logp_old = mb.adv, r.mask, out.logp, mb.logp_old
    spec = POLICY_LOSSES[a.policy_loss]
    behav = r.sampler_logp
    # A DPPO loss anchored to the sampler takes its ratio to pi_behav: that ratio is the
    # importance weight (prime-rl's loss), so no TIS weight goes on top of it.
    to_sampler = behav is not None and anchors_to_sampler(a, a.policy_loss)
    anchor = behav if to_sampler else logp_old
    pg = spec.loss(a, logp, anchor, adv, mb.keep if spec.batch_mask else mask, term.beta_old)
    if behav is not None and cfg.rollout.tis_cap is not None and not to_sampler:
        # Tokens sampled by an inference engine or a stale sampler: truncated importance
        # sampling against the trainer's pi_old (decoupled PPO, with pi_prox = pi_old).
        pg = mismatch.tis_policy_loss(pg, logp_old, behav, cap=cfg.rollout.tis_cap)
    if trm is not None:  # Trust Region Masking: the rows out of the trust region drop out
        pg = torch.where(trm, pg, 0.0)
    loss_pg = red(pg)
    total = loss_pg
    metrics = {"loss/policy": loss_pg.item()}
    if kl_weight:
        kl_tok = (
            out.kl
            if term.exact
            else losses.kl_loss(kl_estimator, logp, mb.s.logp_ref[mb.rows], **_kl_old(cfg, mb))
        )
        loss_kl = kl_weight * red(kl_tok)
        total = total + beta * loss_kl
        metrics["loss/kl"] = loss_kl.item()
    if a.entropy_coef:
        loss_ent = red(losses.entropy_bonus(out.entropy))
        total = total + a.entropy_coef * loss_ent
        metrics["loss/entropy"] = loss_ent.item()
    return total, metrics


def _kl_old(cfg: TrainConfig, mb: MicroBatch) -> dict[str, Tensor | float | None]:
    """:func:`klpo.losses.kl_loss`'s sampling policy and cap: the stale sampler's log-probs
    under ``kl.behaviour_correction`` is or is-cap, else the trainer's pi_old (None:
    ``kl.off_policy_correction`` false). An engine's log-probs never enter the KL term."""
    behav, how = mb.r.behav_logp, cfg.kl.behaviour_correction
    if behav is not None and how != "none":
        return {"logp_old": behav, "cap": cfg.kl.behaviour_cap if how == "is-cap" else None}
    return {"logp_old": mb.logp_old if cfg.kl.off_policy_correction else None}


def critic_step(
    cfg: TrainConfig, m: Models, mb: MicroBatch, dist: Dist, *, sync: bool, tally: Tally
) -> Tensor:
    """The critic's clipped value loss on the micro-batch and its backward (weighted by
    ``vf_coef``, times ``world`` as the policy's); its value metrics go into ``tally``."""
    a, mask = cfg.algo, mb.r.mask
    n_tok = float(mask.sum())
    with _no_sync(m.critic, sync):
        v = values(m.critic, mb.r)
        values_old, returns = mb.s.values_old[mb.rows], mb.s.returns[mb.rows]
        loss_v = mb.red(losses.value_loss(v, values_old, returns, clip=a.value_clip))
        (a.vf_coef * loss_v * dist.world).backward()
    vm = losses.value_metrics(v, values_old, returns, mask, clip=a.value_clip)
    tally.add_means({key: vm[key] for key in ("value/clip_frac", "value/mean", "value/mse")}, n_tok)
    # value/explained_var pools every token of the update: first and second moments.
    ret = returns.detach().double()
    err = ret - v.detach().double()
    for key, x in (("r", ret), ("r2", ret * ret), ("e", err), ("e2", err * err)):
        tally.add(f"_value/{key}", float(reduce.masked_sum(x, mask)), n_tok)
    return loss_v


def micro_metrics(
    cfg: TrainConfig, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor, tally: Tally
) -> None:
    """The micro-batch's policy metrics into ``tally``: token means (clip fraction, KL to
    pi_old), and a sequence-level loss's sequence means over the sequences with a token."""
    a = cfg.algo
    n_tok = float(mask.sum())
    pm = losses.policy_metrics(
        logp, logp_old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )
    tally.add_means({key: pm[key] for key in ("clip_frac", "kl/old/k1", "kl/old/k3")}, n_tok)
    if POLICY_LOSSES[a.policy_loss].per_sequence:
        gm = losses.gspo_metrics(
            logp, logp_old, adv, mask, clip_low=a.gspo_clip_low, clip_high=a.gspo_clip_high
        )
        tally.add_means(gm, float(mask.any(-1).sum()))
