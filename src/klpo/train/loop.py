"""`klpo train`: GRPO, PPO, RLOO and REINFORCE++ in one loop that reads top to bottom.

Each step: sample G completions for each prompt (``generate``), score them (Python rewards),
compute the sampling policy's and the reference's log-probs and the exact KL from hidden states
(:func:`klpo.logprobs.fused`), turn rewards into advantages (:mod:`klpo.advantages`, with the KL in
the reward when asked), and take ``epochs × minibatches`` optimizer steps on the clipped surrogate
plus the KL in the loss when asked (:mod:`klpo.losses`, reduced by :mod:`klpo.reduce`). Every
piece of math is a library function; this file only wires them.

Data parallel: under ``torchrun`` each rank samples its share of the step's prompts (whole groups)
and the loss is normalised by the global token/sequence count, so the gradient equals that of one
process holding the whole batch (:mod:`klpo.reduce`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import advantages, control, kl, logprobs, losses, reduce
from klpo.train import checkpoint as ckpt_io
from klpo.train import rewards as rewards_mod
from klpo.train.config import ConfigError, TrainConfig, dump_config
from klpo.train.data import Example, PromptStream, read_dataset, read_jsonl
from klpo.train.dist import Dist, init_distributed, shutdown
from klpo.train.metrics import MetricsWriter
from klpo.train.models import Backbone, Critic, freeze, load_causal_lm, load_tokenizer
from klpo.train.rollout import Rollout, completion_hidden, generate

# ---------------------------------------------------------------------------------------------
# Setup: models, data, rewards.


def resolve_model_path(name: str) -> str:
    if name == "builtin":
        from klpo.train.reference import default_reference_path

        return str(default_reference_path())
    return name


def load_examples(cfg: TrainConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the configured source."""
    d = cfg.data
    if d.source == "builtin":
        from klpo.train.task import ArithmeticTask

        task = ArithmeticTask()
        train, heldout = task.splits()
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


def controller_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    k = cfg.kl
    extra = {
        "fixed": {},
        "adaptive": {"target": k.target, "horizon": k.horizon},
        "ppo-adaptive": {"target": k.target},
        "spread-scaled": {"scale": k.scale},
    }[k.controller]
    return {"beta": k.beta, **extra}


@dataclass
class Models:
    tokenizer: Any
    policy: Any  # the transformers model (generate, save_pretrained)
    backbone: torch.nn.Module  # Backbone(policy), DDP-wrapped under torchrun
    reference: Backbone
    critic: torch.nn.Module | None  # Critic, DDP-wrapped under torchrun (PPO only)
    critic_core: Critic | None


def build_models(cfg: TrainConfig, dist: Dist, start: Path | None) -> Models:
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    tokenizer = load_tokenizer(policy_path)
    policy = load_causal_lm(str(start / "policy") if start else policy_path, cfg.model.dtype)
    policy.to(dist.device).train()
    reference = Backbone(freeze(load_causal_lm(ref_path, cfg.model.dtype).to(dist.device)))
    critic_core = None
    if cfg.algo.name == "ppo":
        critic_path = resolve_model_path(cfg.model.critic or ref_path)
        critic_core = Critic(load_causal_lm(critic_path, cfg.model.dtype)).to(dist.device)
        if start is not None:
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


@dataclass
class Scored:
    rollout: Rollout
    scores: Tensor  # [B] total task reward per completion
    logp_old: Tensor  # [B, C] log pi_old (the sampling policy)
    logp_ref: Tensor  # [B, C]
    hidden_ref: Tensor  # [B, C, H] the reference's hidden states, for the exact KL
    kl_exact: Tensor  # [B, C] exact KL(pi_old ‖ pi_ref) per token
    entropy: Tensor  # [B, C]
    adv: Tensor  # [B, C]
    returns: Tensor | None  # [B, C] value targets (PPO)
    values_old: Tensor | None  # [B, C] (PPO)
    metrics: dict[str, float]


def _head(backbone: torch.nn.Module) -> tuple[Tensor, Tensor | None]:
    core = backbone.module if hasattr(backbone, "module") else backbone
    return core.head()


def _core(backbone: torch.nn.Module) -> torch.nn.Module:
    return backbone.module if hasattr(backbone, "module") else backbone


@torch.no_grad()
def score(cfg: TrainConfig, m: Models, rollout: Rollout, reward_fns, beta: float) -> Scored:
    mask = rollout.mask
    scores, per_fn, skipped = rewards_mod.combined_rewards(
        reward_fns, rollout.prompts, rollout.completions, rollout.answers
    )
    scores = torch.tensor(scores, dtype=torch.float32)
    temperature = cfg.rollout.temperature
    tokens = rollout.completion_ids.to(mask.device)
    hidden_old = completion_hidden(_core(m.backbone), rollout)
    hidden_ref = completion_hidden(m.reference, rollout)
    weight, bias = _head(m.backbone)
    weight_ref, bias_ref = m.reference.head()
    old = logprobs.fused(
        hidden_old,
        weight,
        tokens,
        bias=bias,
        temperature=temperature,
        hidden_ref=hidden_ref,
        weight_ref=weight_ref,
        bias_ref=bias_ref,
    )
    ref = logprobs.fused(hidden_ref, weight_ref, tokens, bias=bias_ref, temperature=temperature)
    logp_old, logp_ref = old.logp, ref.logp

    # The task reward sits on the last valid token; the KL penalty, when in the reward, on all.
    token_rewards = torch.zeros_like(logp_old)
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    token_rewards = torch.where(last, scores[:, None], token_rewards)
    in_reward = cfg.kl.placement in ("reward", "reward+loss")
    kl_penalty = torch.zeros_like(logp_old)
    if in_reward:
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

    g = rollout.group_size
    values_old = returns = None
    name = cfg.algo.name
    if name == "grpo":
        seq_adv = advantages.group_relative(scores, g, std=cfg.algo.std)
        adv = advantages.broadcast_to_tokens(seq_adv, mask)
        if in_reward:  # the KL part keeps its per-token credit: returns-to-go of the penalty
            adv = adv + advantages.returns_to_go(kl_penalty, mask, gamma=cfg.algo.gamma)
    elif name == "rloo":
        seq_total = scores + torch.where(mask, kl_penalty, 0.0).sum(-1)
        adv = advantages.broadcast_to_tokens(advantages.rloo(seq_total, g), mask)
    elif name == "reinforce++":
        adv = advantages.reinforce_pp(token_rewards + kl_penalty, mask, gamma=cfg.algo.gamma)
    else:  # ppo
        values_old = m.critic_core(
            rollout.input_ids, rollout.attention_mask, _positions(rollout)
        )[:, rollout.prompt_ids.shape[1] - 1 : -1]
        values_old = torch.where(mask, values_old, 0.0)
        adv, returns = advantages.gae(
            token_rewards + kl_penalty, values_old, mask, gamma=cfg.algo.gamma, lam=cfg.algo.lam
        )
        adv = advantages.whiten(adv, mask)

    metrics = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/group_std": float(advantages.group_std(scores, g).mean()) if g > 1 else 0.0,
        "reward/skipped": float(skipped),
        "accuracy/train": float((scores >= 1.0).float().mean()),
        "entropy": float(reduce.masked_mean(old.entropy, mask)),
        "kl/ref/exact": float(reduce.masked_mean(old.kl, mask)),
        "kl/ref/seq": float(torch.where(mask, old.kl, 0.0).sum(-1).mean()),
        "completion/length": float(mask.sum(-1).float().mean()),
        "completion/truncated": float(rollout.truncated.float().mean()),
        **{f"reward/{k}": v for k, v in per_fn.items()},
    }
    est_names = tuple(dict.fromkeys(("k1", "k3", cfg.kl.estimator)))
    metrics.update(
        losses.kl_metrics(logp_old, logp_ref, mask, estimators=tuple(n for n in est_names if n != "full"))
    )
    return Scored(
        rollout, scores, logp_old, logp_ref, hidden_ref, old.kl, old.entropy, adv, returns, values_old, metrics
    )


def _positions(rollout: Rollout) -> Tensor:
    from klpo.train.rollout import position_ids

    return position_ids(rollout.attention_mask)


# ---------------------------------------------------------------------------------------------
# The update.


def update(
    cfg: TrainConfig, m: Models, s: Scored, optim: torch.optim.Optimizer, critic_optim, beta: float, dist: Dist
) -> dict[str, float]:
    a = cfg.algo
    mask = s.rollout.mask
    rows = torch.arange(mask.shape[0])
    kl_in_loss = cfg.kl.placement in ("loss", "reward+loss") and beta > 0
    max_len = cfg.rollout.max_new_tokens
    sums: dict[str, float] = {}
    count = 0
    grad_norms = []
    gen = torch.Generator().manual_seed(cfg.run.seed * 7919 + int(mask.sum()))
    for _ in range(a.epochs):
        order = rows[torch.randperm(len(rows), generator=gen)] if a.minibatches > 1 else rows
        for mb_rows in order.chunk(a.minibatches):
            mb_mask = mask[mb_rows]
            # One normaliser for the whole minibatch across micro-batches and ranks.
            n_global = dist.all_sum(reduce.normaliser(mb_mask, a.loss_reduction, max_len=max_len))
            micro = a.micro_batch or len(mb_rows)
            optim.zero_grad(set_to_none=True)
            if critic_optim is not None:
                critic_optim.zero_grad(set_to_none=True)
            chunks = mb_rows.split(micro)
            for i, rows_i in enumerate(chunks):
                sync = i == len(chunks) - 1
                part = _micro_loss(cfg, m, s, rows_i, beta, kl_in_loss, n_global, max_len, dist, sync)
                for k, v in part.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
            params = [p for p in m.policy.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(params, a.grad_clip if False else (cfg.optim.grad_clip or math.inf))
            grad_norms.append(float(norm))
            optim.step()
            if critic_optim is not None:
                torch.nn.utils.clip_grad_norm_(m.critic_core.parameters(), cfg.optim.grad_clip or math.inf)
                critic_optim.step()
    out = {k: v / count for k, v in sums.items()}
    out["grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def _micro_loss(cfg, m: Models, s: Scored, rows: Tensor, beta, kl_in_loss, n_global, max_len, dist, sync):
    """Forward and backward of one micro-batch; returns its (normalised) metric contributions."""
    from contextlib import nullcontext

    a = cfg.algo
    r = s.rollout.select(rows)
    mask = r.mask
    no_sync = getattr(m.backbone, "no_sync", None)
    ctx = nullcontext() if (sync or no_sync is None) else no_sync()
    with ctx:
        hidden = completion_hidden(m.backbone, r)
        weight, bias = _head(m.backbone)
        out = logprobs.fused(
            hidden,
            weight,
            r.completion_ids,
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=s.hidden_ref[rows] if cfg.kl.estimator == "full" and kl_in_loss else None,
            weight_ref=m.reference.head()[0],
            bias_ref=m.reference.head()[1],
        )
        logp, logp_old, adv = out.logp, s.logp_old[rows], s.adv[rows]
        if a.name == "ppo" and cfg.kl.controller == "ppo-adaptive" and False:
            pass
        pg = losses.ppo_clip(
            logp, logp_old, adv, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
        )
        red = lambda x: reduce.reduce(x, mask, a.loss_reduction, normaliser=n_global, max_len=max_len)  # noqa: E731
        loss_pg = red(pg)
        total = loss_pg
        metrics = {"loss/policy": float(loss_pg)}
        if kl_in_loss:
            if cfg.kl.estimator == "full":
                kl_tok = out.kl
            else:
                kl_tok = losses.kl_loss(cfg.kl.estimator, logp, s.logp_ref[rows], logp_old=logp_old)
            loss_kl = red(kl_tok)
            total = total + beta * loss_kl
            metrics["loss/kl"] = float(loss_kl)
        if a.entropy_coef:
            loss_ent = red(losses.entropy_bonus(out.entropy))
            total = total + a.entropy_coef * loss_ent
            metrics["loss/entropy"] = float(loss_ent)
        # DDP averages gradients over ranks; the normaliser is global, so undo the average.
        (total * dist.world).backward()
    if a.name == "ppo":
        cctx = nullcontext() if (sync or not hasattr(m.critic, "no_sync")) else m.critic.no_sync()
        with cctx:
            values = m.critic(r.input_ids, r.attention_mask, _positions(r))[:, r.prompt_ids.shape[1] - 1 : -1]
            vl = losses.value_loss(values, s.values_old[rows], s.returns[rows], clip=a.value_clip)
            loss_v = red(vl)
            (a.vf_coef * loss_v * dist.world).backward()
            metrics["loss/value"] = float(loss_v)
            total = total + a.vf_coef * loss_v.detach()
    metrics["loss/total"] = float(total)
    pm = losses.policy_metrics(
        logp, logp_old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )
    metrics.update({k: v for k, v in pm.items() if k in ("clip_frac", "kl/old/k1", "kl/old/k3")})
    return metrics
