"""`klpo train`: GRPO, PPO, RLOO and REINFORCE++ in one loop that reads top to bottom.

Each step:

1. **sample** G completions for each of the step's prompts with ``generate`` (:mod:`.rollout`);
2. **score** them: Python rewards, the sampling policy's and the reference's log-probs, entropy
   and the exact full-vocabulary KL from hidden states (:func:`klpo.logprobs.fused`), the KL in
   the reward if asked (:func:`klpo.losses.kl_reward`), advantages (:mod:`klpo.advantages`);
   when the update is exactly on-policy (:func:`update_gives_logp_old`) the policy's side of this
   comes from the update's own forward pass instead of a pass of its own;
3. **update**: ``epochs × minibatches`` optimizer steps on the clipped surrogate
   (:func:`klpo.losses.ppo_clip`), plus ``beta ×`` the KL in the loss if asked
   (:func:`klpo.losses.kl_loss`, off-policy corrected), reduced by :func:`klpo.reduce.reduce`;
4. **control** beta, log, evaluate, checkpoint.

Every piece of math is a library function; this file only wires them. Under ``torchrun`` each rank
samples its share of the step's prompts (whole groups) and every loss is divided by the global
token (or sequence) count, so the gradient equals that of one process holding the whole batch.
"""

from __future__ import annotations

import math
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import advantages, control, kl, logprobs, losses, reduce
from klpo.train import checkpoint as ckpt_io
from klpo.train import preflight
from klpo.train import rewards as rewards_mod
from klpo.train.config import ConfigError, TrainConfig, dump_config
from klpo.train.data import Example, PromptStream, read_dataset, read_jsonl
from klpo.train.dist import Dist, PeerFailed, init_distributed, is_peer_failure, shutdown
from klpo.train.metrics import MetricsWriter
from klpo.train.models import (
    Backbone,
    Critic,
    freeze,
    load_causal_lm,
    load_tokenizer,
    offline_unless_allowed,
)
from klpo.train.rollout import Rollout, completion_hidden, generate, position_ids
from klpo.train.stop import Interrupted, StopOnSignal

# ---------------------------------------------------------------------------------------------
# Setup: models, data, rewards, controllers.


def resolve_model_path(name: str) -> str:
    """A model directory or id; ``builtin`` is the shipped tiny arithmetic model."""
    if name == "builtin":
        from klpo.train.reference import default_reference_path

        return str(default_reference_path())
    return name


def load_examples(cfg: TrainConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the configured source."""
    d = cfg.data
    if d.source == "builtin":
        from klpo.train.task import ArithmeticTask

        train, heldout = ArithmeticTask().splits()
        return list(train), list(heldout[: d.eval_size])
    if d.source == "jsonl":
        train = read_jsonl(d.path, d.prompt_field, d.answer_field)
        heldout = read_jsonl(d.eval_path, d.prompt_field, d.answer_field) if d.eval_path else []
        return train, heldout[: d.eval_size]
    train = read_dataset(d.path, d.split, d.prompt_field, d.answer_field)
    heldout = (
        read_dataset(d.path, d.eval_split, d.prompt_field, d.answer_field) if d.eval_split else []
    )
    return train, heldout[: d.eval_size]


def make_kl_controller(cfg: TrainConfig) -> control.KLController:
    k = cfg.kl
    extra: dict[str, Any] = {
        "fixed": {},
        "adaptive": {"target": k.target, "horizon": k.horizon},
        "ppo-adaptive": {"target": k.target},
        "spread-scaled": {"scale": k.scale},
    }[k.controller]
    return control.make_controller(k.controller, beta=k.beta, **extra)


def make_penalty_controller(cfg: TrainConfig) -> control.KLController:
    """beta_old of PPO's KL-penalty surrogate: PPO's adaptive rule if a target is set."""
    a = cfg.algo
    if a.penalty_target is None:
        return control.FixedKL(a.penalty_beta)
    return control.PPOAdaptiveKL(a.penalty_beta, target=a.penalty_target)


def announce(cfg: TrainConfig) -> str | None:
    """The `explain` text of the KL choice when its gradient is not that of the KL it logs."""
    if cfg.kl.placement == "none" or cfg.kl.beta == 0:
        return None
    placement = cfg.kl.placement
    e = kl.explain(cfg.kl.estimator, placement)
    if not e.mismatch:
        return None
    return (
        "Note: this KL choice is allowed, but its expected gradient is not that of the KL it "
        "logs (klpo explain):\n" + e.text()
    )


@dataclass
class Models:
    tokenizer: Any
    policy: Any  # the transformers model: generate, save_pretrained
    backbone: torch.nn.Module  # Backbone(policy), DDP-wrapped under torchrun
    reference: Backbone  # frozen
    critic: torch.nn.Module | None  # Critic, DDP-wrapped under torchrun (PPO only)
    critic_core: Critic | None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if hasattr(module, "module") else module


def build_models(cfg: TrainConfig, dist: Dist, start: Path | None) -> Models:
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    tokenizer = load_tokenizer(policy_path, "model.policy")
    policy = load_causal_lm(
        str(start / "policy") if start else policy_path, cfg.model.dtype, "model.policy"
    )
    policy.to(dist.device).train()
    reference = Backbone(
        freeze(load_causal_lm(ref_path, cfg.model.dtype, "model.reference").to(dist.device))
    )
    critic_core = None
    if cfg.algo.name == "ppo":
        critic_path = resolve_model_path(cfg.model.critic or ref_path)
        critic_core = Critic(load_causal_lm(critic_path, cfg.model.dtype, "model.critic"))
        critic_core.to(dist.device)
        if start is not None and (start / "critic.safetensors").is_file():
            ckpt_io.restore_critic(start, critic_core)
    backbone: torch.nn.Module = Backbone(policy)
    critic: torch.nn.Module | None = critic_core
    if dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        backbone = DDP(backbone)
        critic = DDP(critic_core) if critic_core is not None else None
    return Models(tokenizer, policy, backbone, reference, critic, critic_core)


# ---------------------------------------------------------------------------------------------
# Scoring a rollout: rewards, old and reference log-probs, values, advantages.


def update_gives_logp_old(cfg: TrainConfig) -> bool:
    """Whether the update's forward pass can stand in for the sampling policy's log-probs.

    With one epoch and one minibatch, every micro-batch's forward runs at the parameters that
    sampled the rollout (the one optimizer step comes after all of them), so its detached
    log-probs are log pi_old (the ratio is exactly 1, as in TRL with ``num_iterations=1``) and its
    entropy and exact KL are those the score pass would have logged. :func:`score` then skips its
    policy pass, one forward of the policy per step. A KL in the reward needs log pi_old before
    the advantages, so it keeps the pass.
    """
    return (
        cfg.algo.epochs == 1 and cfg.algo.minibatches == 1 and cfg.kl.placement in ("loss", "none")
    )


def sampling_metrics(
    cfg: TrainConfig,
    logp_old: Tensor,
    logp_ref: Tensor,
    entropy: Tensor,
    kl_exact: Tensor,
    mask: Tensor,
) -> dict[str, float]:
    """The sampling policy's entropy and KL to the reference, over the rollout's tokens."""
    metrics = {
        "entropy": float(reduce.masked_mean(entropy, mask)),
        "kl/ref/exact": float(reduce.masked_mean(kl_exact, mask)),
        "kl/ref/seq": float(torch.where(mask, kl_exact, 0.0).sum(-1).mean()),
    }
    names = tuple(n for n in dict.fromkeys(("k1", "k3", cfg.kl.estimator)) if n != "full")
    metrics.update(losses.kl_metrics(logp_old, logp_ref, mask, estimators=names))
    if cfg.kl.estimator == "full":
        metrics["kl/ref/full"] = metrics["kl/ref/exact"]
    return metrics


@dataclass
class Scored:
    rollout: Rollout
    scores: Tensor  # [B] total task reward per completion
    # [B, C] log pi_old of the sampled tokens (the sampling policy); None when the update's
    # forward pass gives it (update_gives_logp_old), which then also logs sampling_metrics.
    logp_old: Tensor | None
    logp_ref: Tensor  # [B, C]
    hidden_ref: Tensor  # [B, C, H] the reference's last hidden states, for the exact KL
    adv: Tensor  # [B, C]
    returns: Tensor | None  # [B, C] value targets (PPO)
    values_old: Tensor | None  # [B, C] (PPO)
    metrics: dict[str, float]


def _values(critic: torch.nn.Module, rollout: Rollout) -> Tensor:
    """``[B, C]`` V(s_t): the critic at the column that predicts completion token t."""
    att = rollout.attention_mask
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    values = critic(rollout.input_ids, att, position_ids(att))
    return values[:, p - 1 : p - 1 + c]


@torch.no_grad()
def score(cfg: TrainConfig, m: Models, rollout: Rollout, reward_fns: list, beta: float) -> Scored:
    mask = rollout.mask
    totals, per_fn = rewards_mod.combined_rewards(
        reward_fns, rollout.prompts, rollout.completions, rollout.answers
    )
    scores = torch.tensor(totals, dtype=torch.float32)
    tokens = rollout.completion_ids
    weight, bias = _unwrap(m.backbone).head()
    weight_ref, bias_ref = m.reference.head()
    hidden_ref = completion_hidden(m.reference, rollout)
    ref = logprobs.fused(
        hidden_ref, weight_ref, tokens, bias=bias_ref, temperature=cfg.rollout.temperature
    )
    logp_ref = ref.logp
    old = logp_old = None
    if not update_gives_logp_old(cfg):
        old = logprobs.fused(
            completion_hidden(_unwrap(m.backbone), rollout),
            weight,
            tokens,
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=hidden_ref,
            weight_ref=weight_ref,
            bias_ref=bias_ref,
        )
        logp_old = old.logp

    # The task reward sits on the last valid token; the KL penalty, when in the reward, on all.
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    token_rewards = torch.where(last, scores[:, None], 0.0)
    kl_penalty = torch.zeros_like(token_rewards)
    if cfg.kl.placement in ("reward", "reward+loss") and beta > 0:
        shaped = losses.kl_reward(
            token_rewards,
            logp_old,
            logp_ref,
            mask,
            beta=beta,
            estimator=cfg.kl.estimator,
            estimate=old.kl if cfg.kl.estimator == "full" else None,
        )
        kl_penalty = shaped - token_rewards

    g, name = rollout.group_size, cfg.algo.name
    values_old = returns = None
    if name == "grpo":
        adv = advantages.broadcast_to_tokens(
            advantages.group_relative(scores, g, std=cfg.algo.std), mask
        )
        # The KL penalty keeps its per-token credit: its returns-to-go (REINFORCE, no baseline),
        # so that k1 in the reward follows the sequence-level grad KL(pi_theta ‖ pi_ref).
        adv = adv + advantages.returns_to_go(kl_penalty, mask, gamma=cfg.algo.gamma)
    elif name == "rloo":
        totals_kl = scores + torch.where(mask, kl_penalty, 0.0).sum(-1)
        adv = advantages.broadcast_to_tokens(advantages.rloo(totals_kl, g), mask)
    elif name == "reinforce++":
        adv = advantages.reinforce_pp(token_rewards + kl_penalty, mask, gamma=cfg.algo.gamma)
    else:  # ppo
        values_old = torch.where(mask, _values(m.critic_core, rollout), 0.0)
        adv, returns = advantages.gae(
            token_rewards + kl_penalty, values_old, mask, gamma=cfg.algo.gamma, lam=cfg.algo.lam
        )
        adv = advantages.whiten(adv, mask)

    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/group_std": float(advantages.group_std(scores, g).mean()) if g > 1 else 0.0,
        "accuracy/train": float((scores >= 1.0).float().mean()),
        "completion/length": float(mask.sum(-1).float().mean()),
        "completion/truncated": float(rollout.truncated.float().mean()),
        **{f"reward/{k}": sum(v) / len(v) for k, v in per_fn.items()},
    }
    if old is not None:
        metrics.update(sampling_metrics(cfg, logp_old, logp_ref, old.entropy, old.kl, mask))
    return Scored(
        rollout, scores, logp_old, logp_ref, hidden_ref, adv, returns, values_old, metrics
    )


# ---------------------------------------------------------------------------------------------
# The update.


@dataclass
class Optimizers:
    policy: torch.optim.Optimizer
    critic: torch.optim.Optimizer | None


def update(
    cfg: TrainConfig,
    m: Models,
    s: Scored,
    opt: Optimizers,
    beta: float,
    beta_old: float,
    dist: Dist,
    gen: torch.Generator,
) -> dict[str, float]:
    """``epochs × minibatches`` optimizer steps on one scored rollout; returns mean metrics."""
    a = cfg.algo
    mask = s.rollout.mask
    max_len = cfg.rollout.max_new_tokens
    clip = cfg.optim.grad_clip or math.inf
    totals: dict[str, float] = {}
    n_micro, grad_norms = 0, []
    # On-policy (update_gives_logp_old): the forward passes record the sampling policy's side.
    seen = (
        None
        if s.logp_old is not None
        else {k: torch.zeros_like(s.logp_ref) for k in ("logp", "entropy", "kl")}
    )
    for _ in range(a.epochs):
        order = torch.randperm(mask.shape[0], generator=gen)
        for mb in order.chunk(a.minibatches):
            # One normaliser for the whole minibatch, over its micro-batches and all ranks.
            n_global = dist.all_sum(reduce.normaliser(mask[mb], a.loss_reduction, max_len=max_len))
            opt.policy.zero_grad(set_to_none=True)
            if opt.critic is not None:
                opt.critic.zero_grad(set_to_none=True)
            micro = mb.split(a.micro_batch or len(mb))
            for i, rows in enumerate(micro):
                last = i == len(micro) - 1
                part = _micro_step(
                    cfg, m, s, rows, beta, beta_old, n_global, dist, sync=last, seen=seen
                )
                for k, v in part.items():
                    totals[k] = totals.get(k, 0.0) + v
                n_micro += 1
            policy_params = [p for p in m.policy.parameters() if p.requires_grad]
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(policy_params, clip)))
            opt.policy.step()
            if opt.critic is not None:
                torch.nn.utils.clip_grad_norm_(m.critic_core.parameters(), clip)
                opt.critic.step()
    out = {k: v / n_micro for k, v in totals.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    if seen is not None:
        out.update(
            sampling_metrics(cfg, seen["logp"], s.logp_ref, seen["entropy"], seen["kl"], mask)
        )
    return out


def _no_sync(module: torch.nn.Module | None, sync: bool):
    if module is None or sync or not hasattr(module, "no_sync"):
        return nullcontext()
    return module.no_sync()


def _micro_step(
    cfg: TrainConfig,
    m: Models,
    s: Scored,
    rows: Tensor,
    beta: float,
    beta_old: float,
    n_global: Tensor,
    dist: Dist,
    *,
    sync: bool,
    seen: dict[str, Tensor] | None = None,
) -> dict[str, float]:
    """Forward and backward of one micro-batch (gradients accumulate); returns its metrics.

    Without ``s.logp_old`` (:func:`update_gives_logp_old`) log pi_old is this forward's own
    detached log-probs, and they, the entropy and the exact KL are written into ``seen`` (full
    ``[B, C]`` tensors) at ``rows``.
    """
    a, k = cfg.algo, cfg.kl
    r = s.rollout.select(rows)
    mask = r.mask
    logp_old = None if s.logp_old is None else s.logp_old[rows]
    adv = s.adv[rows]
    kl_in_loss = k.placement in ("loss", "reward+loss") and beta > 0
    need_ref = (kl_in_loss and k.estimator == "full") or logp_old is None
    max_len = cfg.rollout.max_new_tokens

    def red(x: Tensor) -> Tensor:
        return reduce.reduce(x, mask, a.loss_reduction, normaliser=n_global, max_len=max_len)

    with _no_sync(m.backbone, sync):
        weight, bias = _unwrap(m.backbone).head()
        weight_ref, bias_ref = m.reference.head()
        out = logprobs.fused(
            completion_hidden(m.backbone, r),
            weight,
            r.completion_ids,
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=s.hidden_ref[rows] if need_ref else None,
            weight_ref=weight_ref if need_ref else None,
            bias_ref=bias_ref if need_ref else None,
        )
        logp = out.logp
        if logp_old is None:
            logp_old = logp.detach()
            if seen is not None:
                seen["logp"][rows] = logp_old
                seen["entropy"][rows] = out.entropy.detach()
                seen["kl"][rows] = out.kl.detach()
        if a.policy_loss == "clip":
            pg = losses.ppo_clip(
                logp,
                logp_old,
                adv,
                clip_low=a.clip_low,
                clip_high=a.clip_high,
                dual_clip=a.dual_clip,
            )
        else:
            pg = losses.ppo_kl_penalty(logp, logp_old, adv, beta=beta_old)
        loss_pg = red(pg)
        total = loss_pg
        metrics = {"loss/policy": loss_pg.item()}
        if kl_in_loss:
            kl_tok = (
                out.kl
                if k.estimator == "full"
                else losses.kl_loss(k.estimator, logp, s.logp_ref[rows], logp_old=logp_old)
            )
            loss_kl = red(kl_tok)
            total = total + beta * loss_kl
            metrics["loss/kl"] = loss_kl.item()
        if a.entropy_coef:
            loss_ent = red(losses.entropy_bonus(out.entropy))
            total = total + a.entropy_coef * loss_ent
            metrics["loss/entropy"] = loss_ent.item()
        # DDP averages gradients over ranks; the normaliser is already global, so undo the mean.
        (total * dist.world).backward()
    if m.critic is not None:
        with _no_sync(m.critic, sync):
            values = _values(m.critic, r)
            loss_v = red(
                losses.value_loss(values, s.values_old[rows], s.returns[rows], clip=a.value_clip)
            )
            (a.vf_coef * loss_v * dist.world).backward()
        metrics["loss/value"] = loss_v.item()
        total = total.detach() + a.vf_coef * loss_v.detach()
    metrics["loss/total"] = total.item()
    pm = losses.policy_metrics(
        logp, logp_old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )
    metrics.update({key: pm[key] for key in ("clip_frac", "kl/old/k1", "kl/old/k3")})
    return metrics


# ---------------------------------------------------------------------------------------------
# Evaluation.


def heldout_accuracy(cfg: TrainConfig, m: Models, heldout: list[Example]) -> float:
    from klpo.train.task import heldout_accuracy as accuracy

    return accuracy(
        m.policy,
        m.tokenizer,
        heldout,
        max_new_tokens=cfg.rollout.max_new_tokens,
        reward=cfg.rewards[0].name,
    )


# ---------------------------------------------------------------------------------------------
# The run.


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became non-finite; the run stopped at that step."""


def train(
    cfg: TrainConfig, *, resume: bool = False, log=print, allow_config_change: bool = False
) -> Path:
    """Run (or resume) training; returns the run directory.

    ``allow_config_change`` lets a resume continue with a changed config or number of processes
    (recorded in the run's ``config-changes.jsonl``); without it such a resume is refused.
    SIGINT/SIGTERM stop the run after the current step with a checkpoint (:mod:`.stop`).
    """
    offline_unless_allowed()
    dist = init_distributed(cfg.run.threads)
    failed = True
    try:
        with StopOnSignal() as stopper:
            out = _train(
                cfg,
                dist,
                resume,
                log if dist.is_main else (lambda *_: None),
                allow_config_change=allow_config_change,
                stopper=stopper,
            )
        failed = False
        return out
    except Exception as err:
        if dist.enabled and is_peer_failure(err):
            raise PeerFailed(
                f"rank {dist.rank}: stopped because another process of the run failed (its "
                "error is printed above by that rank)"
            ) from None
        raise
    finally:
        # A failed rank leaves without a barrier: the others may wait in another collective.
        shutdown(dist, failed=failed)


def _lr(cfg: TrainConfig, step: int) -> float:
    w = cfg.optim.warmup_steps
    return cfg.optim.lr * (min(1.0, step / w) if w else 1.0)


def _train(
    cfg: TrainConfig,
    dist: Dist,
    resume: bool,
    log,
    *,
    allow_config_change: bool = False,
    stopper: StopOnSignal | None = None,
) -> Path:
    run_dir = Path(cfg.run.out_dir)
    # --- Preflight (klpo.train.preflight): every check that can fail, before any model loads
    # or any file is written.
    plan = preflight.plan_run_dir(
        cfg, resume=resume, world=dist.world, allow_config_change=allow_config_change
    )
    if cfg.rollout.prompts_per_step % dist.world:
        raise ConfigError(
            f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be divisible by the "
            f"number of processes ({dist.world})"
        )
    train_set, heldout = load_examples(cfg)
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    preflight.check_models_and_data(
        cfg,
        train_set,
        heldout,
        policy=policy_path,
        reference=ref_path,
        critic=resolve_model_path(cfg.model.critic or ref_path) if cfg.algo.name == "ppo" else None,
    )
    log(f"run directory: {run_dir}")
    for line in plan.notes:
        log(f"note: {line}")
    for line in preflight.config_warnings(cfg, dist.world):
        log(f"warning: {line}")
    # --- End of preflight.
    start, meta = plan.start, plan.meta
    torch.manual_seed(cfg.run.seed * 1000 + dist.rank)

    m = build_models(cfg, dist, start)
    stream = PromptStream(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    reward_fns = rewards_mod.resolve_rewards({t.name: t.weight for t in cfg.rewards})
    kl_ctl, pen_ctl = make_kl_controller(cfg), make_penalty_controller(cfg)
    o = cfg.optim
    opt = Optimizers(
        policy=torch.optim.AdamW(
            [p for p in m.policy.parameters() if p.requires_grad],
            lr=o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
        ),
        critic=torch.optim.AdamW(
            m.critic_core.parameters(),
            lr=o.critic_lr or o.lr,
            betas=o.betas,
            weight_decay=o.weight_decay,
        )
        if m.critic_core is not None
        else None,
    )
    optimizers = {"policy": opt.policy} | ({"critic": opt.critic} if opt.critic else {})
    update_gen = torch.Generator().manual_seed(cfg.run.seed)
    step0 = 0
    if start is not None:
        step0 = meta["step"]
        # After an allowed change of algorithm, an optimizer the checkpoint lacks starts fresh.
        ckpt_io.restore_optimizers(
            start, {k: o for k, o in optimizers.items() if k in meta["optimizers"]}, meta
        )
        kl_ctl.load_state_dict(meta["kl_controller"])
        pen_ctl.load_state_dict(meta["penalty_controller"])
        stream.load_state_dict(meta["data"])
        update_gen.set_state(torch.tensor(meta["update_generator"], dtype=torch.uint8))
        if plan.saved_world == dist.world:
            ckpt_io.restore_rng(start, meta, rank=dist.rank)
        else:  # an allowed change of world size: each rank's sampling stream starts anew
            torch.manual_seed(cfg.run.seed * 1000 + dist.rank + 7919 * step0)
        log(f"resuming {run_dir} from step {step0}")

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for orphan in ckpt_io.remove_orphans(run_dir):
            log(f"note: removed {orphan}, the remains of a checkpoint save that did not finish")
        if plan.restart and (kept := preflight.keep_old_metrics(run_dir)) is not None:
            log(f"note: the earlier metrics of this run are kept in {kept}")
        if plan.changes:
            preflight.record_config_change(run_dir, step0, plan.changes)
            log(f"note: config change recorded in {run_dir / preflight.CHANGES_FILE}")
        ckpt_io.write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        note = announce(cfg)
        if note:
            log(note)
    writer = (
        MetricsWriter(run_dir, tensorboard=cfg.run.tensorboard, resume_step=step0)
        if dist.is_main
        else None
    )

    def save(step: int) -> None:
        rngs = dist.gather_objects(ckpt_io.rng_state())
        if dist.is_main:
            ckpt_io.save_checkpoint(
                run_dir,
                step,
                policy=m.policy,
                critic=m.critic_core,
                optimizers=optimizers,
                rng=rngs,
                state={
                    "data": stream.state_dict(),
                    "kl_controller": kl_ctl.state_dict(),
                    "penalty_controller": pen_ctl.state_dict(),
                    "update_generator": update_gen.get_state().tolist(),
                },
            )
        dist.barrier()

    per_rank = cfg.rollout.prompts_per_step // dist.world
    if step0 == 0 and heldout and cfg.run.eval_every and writer is not None:
        writer.write(0, {"accuracy/heldout": heldout_accuracy(cfg, m, heldout)})

    progress = _progress(cfg, dist, step0, log)
    t_start = time.perf_counter()
    step = step0
    for step in range(step0 + 1, cfg.run.steps + 1):
        t0 = time.perf_counter()
        for group in opt.policy.param_groups:
            group["lr"] = _lr(cfg, step)
        batch = stream.next(cfg.rollout.prompts_per_step)
        mine = batch[dist.rank * per_rank : (dist.rank + 1) * per_rank]

        # 1. Sample.
        m.policy.eval()
        rollout = generate(
            m.policy,
            m.tokenizer,
            [e.prompt for e in mine],
            [e.answer for e in mine],
            group_size=cfg.rollout.group_size,
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
        )
        m.policy.train()
        t1 = time.perf_counter()

        # 2. Score.
        scored = score(cfg, m, rollout, reward_fns, kl_ctl.value)
        t2 = time.perf_counter()

        # 3. Update.
        beta = kl_ctl.value
        upd = update(cfg, m, scored, opt, beta, pen_ctl.value, dist, update_gen)
        t3 = time.perf_counter()

        # 4. Control, log, evaluate, checkpoint.
        metrics = dist.mean_metrics({**scored.metrics, **upd})
        n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        kl_ctl.update(
            kl=metrics["kl/ref/exact"], n_steps=n_seq, reward_std=metrics["reward/group_std"]
        )
        if cfg.algo.policy_loss == "kl-penalty":
            pen_ctl.update(kl=metrics["kl/old/k3"])
        tokens = dist.all_sum(rollout.mask.sum()).item()
        metrics.update(
            {
                "beta": beta,
                "lr": _lr(cfg, step),
                "time/generate": t1 - t0,
                "time/score": t2 - t1,
                "time/update": t3 - t2,
            }
        )
        last = step == cfg.run.steps or (
            cfg.run.time_limit is not None and time.perf_counter() - t_start > cfg.run.time_limit
        )
        if heldout and cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last):
            if dist.is_main:
                metrics["accuracy/heldout"] = heldout_accuracy(cfg, m, heldout)
            dist.barrier()
        metrics["time/step"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = tokens / metrics["time/step"]
        if writer is not None:
            writer.write(step, metrics)
        progress(step, metrics)
        bad = [k for k in ("loss/total", "grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
        if bad:
            progress(None, None)
            if writer is not None:
                writer.close()
            raise TrainingDiverged(
                f"step {step}: {', '.join(f'{k} = {metrics[k]}' for k in bad)}; the weights are "
                "no longer finite, so training stopped (metrics up to this step are in "
                f"{run_dir / 'metrics.jsonl'}). Lower optim.lr or raise kl.beta."
            )
        stop = dist.any(stopper is not None and stopper.requested) and not last
        if last or stop or (cfg.run.save_every and step % cfg.run.save_every == 0):
            save(step)
        if stop:
            _stop(run_dir, step, stopper, progress, writer)
        if last:
            break
    progress(None, None)
    if writer is not None:
        writer.close()
        from klpo.train.report import write_report

        report = write_report(
            run_dir, estimator=cfg.kl.estimator, title=f"klpo train: {cfg.algo.name}"
        )
        log(f"wrote {report}")
    return run_dir


def _stop(run_dir: Path, step: int, stopper: StopOnSignal | None, progress, writer) -> None:
    """End the run after a signal: the checkpoint of ``step`` is saved; say where."""
    progress(None, None)
    if writer is not None:
        writer.close()
    signum = stopper.signum if stopper is not None and stopper.signum else signal.SIGTERM
    what = stopper.name if stopper is not None and stopper.requested else "a signal to another rank"
    raise Interrupted(
        f"stopped by {what} after step {step}; the checkpoint is "
        f"{run_dir / 'checkpoints' / f'step_{step:06d}'} and the metrics up to it are in "
        f"{run_dir / 'metrics.jsonl'}. Continue with: klpo train --resume {run_dir}",
        signum,
    )


def _progress(cfg: TrainConfig, dist: Dist, step0: int, log=print):
    """Progress on the main rank: a rich bar on a terminal; elsewhere (a log file, CI, a job
    scheduler) a plain line every ``max(1, steps // 20)`` steps and at the last step."""
    if not (cfg.run.progress and dist.is_main):
        return lambda step, metrics: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def info(metrics: dict[str, float]) -> str:
        acc = metrics.get("accuracy/heldout")
        return f"reward {metrics['reward/mean']:.3f}  kl {metrics['kl/ref/exact']:.4f}" + (
            f"  heldout {acc:.3f}" if acc is not None else ""
        )

    if not Console().is_terminal:
        every, t0 = max(1, cfg.run.steps // 20), time.perf_counter()

        def line(step: int | None, metrics: dict[str, float] | None) -> None:
            if step is not None and (step % every == 0 or step == cfg.run.steps):
                elapsed = time.perf_counter() - t0
                log(f"step {step}/{cfg.run.steps}  {info(metrics)}  {elapsed:.0f} s")

        return line

    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        transient=False,
    )
    task = bar.add_task("train", total=cfg.run.steps, completed=step0, info="")
    bar.start()

    def advance(step: int | None, metrics: dict[str, float] | None) -> None:
        if step is None:
            bar.stop()
            return
        bar.update(task, completed=step, info=info(metrics))

    return advance
