"""`klpo train`: GRPO, PPO, RLOO and REINFORCE++ in one loop that reads top to bottom.

Each step:

1. **sample** G completions for each of the step's prompts with the configured engine
   (:mod:`.engines`: the policy's own ``generate``, or vLLM synced with the policy's weights,
   whose log-prob gap to the trainer's is logged and corrected by truncated importance sampling,
   :mod:`klpo.mismatch`);
2. **score** them: Python rewards, the sampling policy's and the reference's log-probs, entropy
   and the exact full-vocabulary KL from hidden states (:func:`klpo.logprobs.fused`), the KL in
   the reward if asked (:func:`klpo.losses.kl_reward`), advantages (:mod:`klpo.advantages`);
   when the update is exactly on-policy (:func:`update_gives_logp_old`) the policy's side of this
   comes from the update's own forward pass instead of a pass of its own;
3. **update**: ``epochs × minibatches`` optimizer steps on the clipped surrogate
   (:func:`klpo.losses.ppo_clip`), plus ``beta ×`` the KL in the loss if asked
   (:func:`klpo.losses.kl_loss`, off-policy corrected), reduced by :func:`klpo.reduce.reduce`;
4. **control** beta, log, evaluate, checkpoint.

Every piece of math is a library function; this file only wires them. The variants are tables:
:data:`ALGORITHMS` (advantages, critic), :data:`POLICY_LOSSES`, :func:`needs_exact_kl`, and the
placement predicates :func:`klpo.kl.in_reward` / :func:`klpo.kl.in_loss`. A run is
:func:`preflight` (every check that can fail, before any model loads or file is written),
:func:`setup`, :func:`run_steps` (one :func:`train_step` each) and :func:`teardown`. A run is
never lost: SIGINT/SIGTERM end it after the current step with a checkpoint (:mod:`.stop`), and
under ``torchrun`` a rank that fails leaves at once so that the group stops rather than hangs.

Under ``torchrun`` each rank samples its share of the step's prompts (whole groups) and every loss
is divided by the global token (or sequence) count, so the gradient equals that of one process
holding the whole batch (PPO's and REINFORCE++'s batch-whitening merges every rank's statistics,
:func:`whiten_over_ranks`); the metrics are ratios of sums over micro-batches and ranks
(:class:`klpo.train.runtime.metrics.Tally`), so they too are the whole batch's at any split.
"""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import advantages, control, kl, logprobs, losses, mismatch, reduce, ref_kl
from klpo.train import preflight as checks
from klpo.train.config import (
    AlgoConfig,
    Algorithm,
    ConfigError,
    PolicyLoss,
    TrainConfig,
    dump_config,
)
from klpo.train.data.sources import Example, PromptStream, read_dataset, read_jsonl, render_chat
from klpo.train.models import fsdp
from klpo.train.models.backbone import Backbone, Critic
from klpo.train.models.load import (
    DTYPES,
    enable_checkpointing,
    freeze,
    load_causal_lm,
    load_tokenizer,
    offline_unless_allowed,
    resolve_model_path,
)
from klpo.train.models.lora import (
    AdapterFreeReference,
    apply_lora,
    base_weights,
    load_adapters,
    load_base_weights,
    merge_and_restart,
    restart_generator,
)
from klpo.train.models.reference import reset_due, update_reference
from klpo.train.rewards import functions as rewards_mod
from klpo.train.rewards.gold import eval_reward, gold_metrics
from klpo.train.rewards.model import build_rewards
from klpo.train.rollout import ref_samples
from klpo.train.rollout.engines import RolloutEngine, check_engine, make_engine
from klpo.train.rollout.samplers import Rollout, completion_hidden, generate, position_ids  # noqa: F401 (generate: loop.generate for callers)
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist, PeerFailed, init_distributed, is_peer_failure, shutdown
from klpo.train.runtime.metrics import CONTROLLED_KL, MetricsWriter, Tally
from klpo.train.runtime.stop import Interrupted, StopOnSignal
from klpo.train.step import microbatch

# ---------------------------------------------------------------------------------------------
# Setup: models, data, rewards, controllers.


def load_examples(cfg: TrainConfig) -> tuple[list[Example], list[Example]]:
    """(train, held-out) examples of the configured source."""
    d = cfg.data
    if d.source in ("builtin", "builtin-overopt"):
        from klpo.train.data.task import ArithmeticTask

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
    placement = cfg.kl.placement
    if not (kl.in_loss(placement) or kl.in_reward(placement)) or cfg.kl.beta == 0:
        return None
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
    reference: torch.nn.Module  # frozen: a Backbone, or the LoRA policy with adapters off
    critic: torch.nn.Module | None  # Critic, DDP-wrapped under torchrun (PPO only)
    critic_core: Critic | None


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return module.module if hasattr(module, "module") else module


def build_models(cfg: TrainConfig, dist: Dist, start: Path | None) -> Models:
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    tokenizer = load_tokenizer(policy_path, "model.policy")
    # Parameters are float32 (the master weights); model.dtype is the compute dtype (autocast).
    compute = DTYPES[cfg.model.dtype]
    # --- real models hook: LoRA (klpo.train.models.lora), checkpointing, FSDP (klpo.train.models.fsdp) ---
    lora_cfg = cfg.model.lora
    if lora_cfg is not None:
        policy = load_causal_lm(policy_path, key="model.policy")
        policy = (
            load_adapters(policy, start / "policy")
            if start
            else apply_lora(policy, **lora_cfg.model_dump())
        )
    elif start is not None and fsdp.is_sharded_checkpoint(start):
        policy = load_causal_lm(
            policy_path, key="model.policy"
        )  # the sharded weights are loaded after sharding
    else:
        policy = load_causal_lm(str(start / "policy") if start else policy_path, key="model.policy")
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(policy)
    policy.to(dist.device).train()
    backbone: torch.nn.Module = Backbone(policy, compute)
    reference: torch.nn.Module
    if lora_cfg is not None and cfg.model.reference is None:
        reference = AdapterFreeReference(backbone)  # no second copy of the weights
    else:
        reference = Backbone(
            freeze(load_causal_lm(ref_path, key="model.reference").to(dist.device)), compute
        )
    critic_core = None
    if ALGORITHMS[cfg.algo.name].critic:
        critic_path = resolve_model_path(cfg.model.critic or ref_path)
        critic_core = Critic(load_causal_lm(critic_path, key="model.critic"), compute).to(
            dist.device
        )
        if start is not None and (start / "critic.safetensors").is_file():
            ckpt_io.restore_critic(start, critic_core)
    critic: torch.nn.Module | None = critic_core
    if dist.enabled and cfg.dist.strategy == "fsdp":
        backbone = fsdp.shard(backbone, dist)
        reference = fsdp.shard(reference, dist)
    elif dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        backbone = DDP(backbone)
        critic = DDP(critic_core) if critic_core is not None else None
    # --- end of the real models hook ---
    return Models(tokenizer, policy, backbone, reference, critic, critic_core)


# ---------------------------------------------------------------------------------------------
# The variants, as tables: algorithm -> advantages, policy loss -> surrogate, estimator -> exact KL.


@dataclass(frozen=True)
class AdvantageInputs:
    """What every advantage estimator may read; B completions of C tokens."""

    scores: Tensor  # [B] total task reward per completion
    token_rewards: Tensor  # [B, C] the task reward on each completion's last valid token
    kl_penalty: Tensor  # [B, C] -beta · sg(est) when the KL is in the reward, else 0
    mask: Tensor  # [B, C] bool
    group_size: int
    values: Tensor | None  # [B, C] V(s_t) of the critic (algorithms with a critic)
    dist: Dist  # the ranks holding the rest of the step's batch (batch-whitening sums over them)


AdvantageFn = Callable[[AlgoConfig, AdvantageInputs], tuple[Tensor, Tensor | None]]


def _grpo_advantages(a: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Group-relative task advantage on every token, plus the KL penalty's returns-to-go.

    The KL penalty keeps its per-token credit (REINFORCE, no baseline), so that k1 in the reward
    follows the sequence-level grad KL(pi_theta ‖ pi_ref)."""
    adv = advantages.broadcast_to_tokens(
        advantages.group_relative(x.scores, x.group_size, std=a.std), x.mask
    )
    return adv + advantages.returns_to_go(x.kl_penalty, x.mask, gamma=a.gamma), None


def _rloo_advantages(a: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Leave-one-out baseline of the sequence's total reward, KL penalty summed in."""
    totals = x.scores + torch.where(x.mask, x.kl_penalty, 0.0).sum(-1)
    return advantages.broadcast_to_tokens(advantages.rloo(totals, x.group_size), x.mask), None


def whiten_over_ranks(x: Tensor, mask: Tensor, dist: Dist) -> Tensor:
    """:func:`klpo.advantages.whiten` with the statistics of the whole step's batch.

    Each rank's :func:`~klpo.advantages.whiten_stats` are gathered (a sum of rows that are zero
    but for the rank's own) and merged in rank order, so every rank whitens its share with the
    same mean and variance as one process holding the whole batch would (in a world of one, the
    bits of plain ``whiten``)."""
    local = torch.stack(advantages.whiten_stats(x, mask))
    rows = torch.zeros(dist.world, local.numel(), dtype=local.dtype, device=local.device)
    rows[dist.rank] = local
    rows = dist.all_sum(rows)
    stats = advantages.merge_whiten_stats([advantages.WhitenStats(*r) for r in rows])
    return advantages.whiten(x, mask, stats=stats)


def _reinforce_pp_advantages(a: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, None]:
    """Per-token returns-to-go of the shaped reward, whitened over the batch (REINFORCE++,
    :func:`klpo.advantages.reinforce_pp`, with the statistics of every rank's share)."""
    returns = advantages.returns_to_go(x.token_rewards + x.kl_penalty, x.mask, gamma=a.gamma)
    return whiten_over_ranks(returns, x.mask, x.dist), None


def _ppo_advantages(a: AlgoConfig, x: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GAE on the shaped reward with the critic's values, whitened; returns are the targets."""
    assert x.values is not None
    adv, returns = advantages.gae(
        x.token_rewards + x.kl_penalty, x.values, x.mask, gamma=a.gamma, lam=a.lam
    )
    return whiten_over_ranks(adv, x.mask, x.dist), returns


@dataclass(frozen=True)
class AlgorithmSpec:
    advantages: AdvantageFn  # (adv [B, C], value targets [B, C] or None)
    critic: bool = False  # whether it trains a critic (and logs loss/value, value/*)


ALGORITHMS: dict[Algorithm, AlgorithmSpec] = {
    "grpo": AlgorithmSpec(_grpo_advantages),
    "rloo": AlgorithmSpec(_rloo_advantages),
    "reinforce++": AlgorithmSpec(_reinforce_pp_advantages),
    "ppo": AlgorithmSpec(_ppo_advantages, critic=True),
}

PolicyLossFn = Callable[[AlgoConfig, Tensor, Tensor, Tensor, Tensor, float], Tensor]


def _clip_loss(a: AlgoConfig, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_clip(
        logp, logp_old, adv, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )


def _kl_penalty_loss(a: AlgoConfig, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.ppo_kl_penalty(logp, logp_old, adv, beta=beta_old)


def _gspo_loss(a: AlgoConfig, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.gspo(
        logp, logp_old, adv, mask, clip_low=a.gspo_clip_low, clip_high=a.gspo_clip_high
    )


def _cispo_loss(a: AlgoConfig, logp, logp_old, adv, mask, beta_old: float) -> Tensor:
    return losses.cispo(logp, logp_old, adv, clip_high=a.clip_high)


POLICY_LOSSES: dict[PolicyLoss, PolicyLossFn] = {
    "clip": _clip_loss,
    "kl-penalty": _kl_penalty_loss,
    "gspo": _gspo_loss,
    "cispo": _cispo_loss,
}
"""Per-token policy loss ``[B, C]`` from (algo config, logp, logp_old, adv, mask, beta_old).
The KL to the reference is not part of it: under every choice it keeps its own per-token
off-policy weight (:func:`klpo.losses.kl_loss`), never GSPO's sequence ratio."""

USES_BETA_OLD: frozenset[PolicyLoss] = frozenset({"kl-penalty"})

# The update's on-policy pass takes its gradient in the forward pass (klpo.logprobs.fused_loss)
# where it can (:func:`on_policy_weights`) and the vocabulary has at least FUSED_LOSS_MIN_VOCAB
# entries; False always takes the per-token path. Where the head is a large share of the step it
# pays: at V = 32000 (H = 896) fused_loss took 0.27 s against fused's 0.36 for log-probs and 0.22
# against 0.30-0.32 for the exact KL (docs/performance.md); with small vocabularies it does not:
# the micro-step took 4.50 s against 4.55 at V = 8195 (the compute-bound benchmark's model, within
# noise) and 65.7 ms against 61.9 at V = 101 (the shipped model), ``bench/trainer_parts.py``.
FUSED_LOSS = True
FUSED_LOSS_MIN_VOCAB = 32768


def on_policy_weights(
    cfg: TrainConfig,
    adv: Tensor,
    mask: Tensor,
    red: Callable[[Tensor], Tensor],
    kl_weight: float,
    beta_old: float,
    world: int,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The weights of a micro-batch's loss on each token's log-prob, entropy and exact KL, on
    the policy that sampled it: ``[B, C]`` each (None where the loss has no such term).

    The loss is ``red(pg(logp, logp_old)) + kl_weight red(kl) + entropy_coef red(-entropy)``
    (:func:`_micro_step`), times ``world`` (undoing DDP's mean). Where the forward pass is also the
    sampling policy's (``logp_old`` is its detached ``logp``), every policy loss is a function of
    the ratio ``exp(logp - logp_old) = 1`` (CISPO also of ``logp``, linearly), so its gradient
    with respect to ``logp`` does not depend on ``logp``'s value, and the KL and entropy terms are
    linear: the weights are the gradients of the loss at any point with ``logp = logp_old``, here
    0, taken by autograd through the same functions the per-token path calls.
    """
    a = cfg.algo
    z = [
        torch.zeros(mask.shape, dtype=torch.float64, device=mask.device, requires_grad=True)
        for _ in range(3)
    ]
    adv64 = adv.detach().to(torch.float64)
    total = red(POLICY_LOSSES[a.policy_loss](a, z[0], z[0].detach(), adv64, mask, beta_old))
    if kl_weight:
        total = total + kl_weight * red(z[2])
    if a.entropy_coef:
        total = total + a.entropy_coef * red(losses.entropy_bonus(z[1]))
    grads = torch.autograd.grad(total * world, z, allow_unused=True)
    return tuple(grads)  # type: ignore[return-value]


"""Surrogates with PPO's penalty coefficient beta_old (its controller runs, ``beta_old`` logged)."""


EXACT_KL_ESTIMATORS = frozenset({"full"})
"""Estimators whose per-token value is the exact KL over the vocabulary at the position: they
need the reference's hidden states in the forward pass (:func:`klpo.logprobs.fused`), not token
log-probs."""


def needs_exact_kl(estimator: str) -> bool:
    return estimator in EXACT_KL_ESTIMATORS


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
    return cfg.algo.epochs == 1 and cfg.algo.minibatches == 1 and not kl.in_reward(cfg.kl.placement)


@dataclass
class SamplingPass:
    """The sampling policy pi_old on the rollout's tokens, ``[B, C]`` each.

    Filled by one forward pass at the parameters that sampled the rollout: :func:`score`'s own
    pass, or, when :func:`update_gives_logp_old`, the update's first forward of each row (the
    same parameters, since its one optimizer step comes after every micro-batch). Either way the
    update reads log pi_old from here and the step logs the entropy and KL from here.
    """

    logp: Tensor  # log pi_old of the sampled tokens
    entropy: Tensor  # exact entropy of pi_old at each position
    kl: Tensor  # exact KL(pi_old ‖ pi_ref) at each position
    filled: Tensor  # [B] bool: rows recorded so far

    @classmethod
    def empty(cls, like: Tensor) -> SamplingPass:
        zeros = torch.zeros_like(like)
        return cls(
            zeros,
            zeros.clone(),
            zeros.clone(),
            torch.zeros(like.shape[0], dtype=torch.bool, device=like.device),
        )

    def record(self, rows: Tensor, out: logprobs.FusedOutput) -> None:
        """Keep ``out`` (a forward at the sampling parameters, with the exact KL) for ``rows``."""
        self.logp[rows] = out.logp.detach().to(self.logp.dtype)
        self.entropy[rows] = out.entropy.detach().to(self.entropy.dtype)
        self.kl[rows] = out.kl.detach().to(self.kl.dtype)
        self.filled[rows] = True


def sampling_metrics(cfg: TrainConfig, old: SamplingPass, logp_ref: Tensor, mask: Tensor) -> Tally:
    """The sampling policy's entropy and KL to the reference, token sums over the rollout."""
    t = Tally()
    means = {
        "entropy": float(reduce.masked_mean(old.entropy, mask)),
        "kl/ref/exact": float(reduce.masked_mean(old.kl, mask)),
    }
    est = cfg.kl.estimator
    names = tuple(
        n
        for n in dict.fromkeys(("k1", "k3", est))
        if not needs_exact_kl(n) and n not in kl.REF_SAMPLED  # those: ref_samples.ref_term
    )
    means.update(losses.kl_metrics(old.logp, logp_ref, mask, estimators=names))
    if needs_exact_kl(est):
        means[f"kl/ref/{est}"] = means["kl/ref/exact"]
    t.add_means(means, float(mask.sum()))
    t.add("kl/ref/seq", float(torch.where(mask, old.kl, 0.0).double().sum()), mask.shape[0])
    return t


def reward_metrics(
    scores: Tensor, per_fn: dict[str, list[float]], rollout: Rollout, group_size: int
) -> Tally:
    """Rewards, accuracy and completion lengths, as sums over the rollout's completions."""
    t, n, x = Tally(), len(scores), scores.double()
    t.add("reward/mean", float(x.sum()), n)
    t.add("_reward/sq", float((x * x).sum()), n)  # for reward/std, see finish_metrics
    t.add(
        "reward/group_std",
        float(advantages.group_std(x, group_size).sum()) if group_size > 1 else 0.0,
        n / group_size,
    )
    t.add("accuracy/train", float((scores >= 1.0).sum()), n)
    t.add("completion/length", float(rollout.mask.sum()), n)
    t.add("completion/truncated", float(rollout.truncated.sum()), n)
    for k, v in per_fn.items():
        t.add(f"reward/{k}", sum(v), len(v))
    return t


def finish_metrics(tally: Tally, dist: Dist) -> dict[str, float]:
    """The step's metrics from every rank's tally: one sum over ranks, then the pooled moments."""
    res = tally.result(dist.all_sum)
    out = {k: v for k, (v, _) in res.items() if not k.startswith("_")}
    if "_reward/sq" in res:
        (mean, n), (sq, _) = res["reward/mean"], res["_reward/sq"]
        out["reward/std"] = math.sqrt(max(sq - mean * mean, 0.0) * n / (n - 1)) if n > 1 else 0.0
    if "_value/r" in res:
        r, r2, e, e2 = (res[f"_value/{k}"][0] for k in ("r", "r2", "e", "e2"))
        var_r, var_e = r2 - r * r, e2 - e * e
        out["value/explained_var"] = 1.0 - var_e / var_r if var_r > 0 else 0.0
    return out


@dataclass
class Scored:
    rollout: Rollout
    scores: Tensor  # [B] total task reward per completion
    old: SamplingPass  # the sampling policy's log-probs, entropy and KL (see SamplingPass)
    logp_ref: Tensor  # [B, C]
    hidden_ref: Tensor  # [B, C, H] the reference's last hidden states, for the exact KL
    adv: Tensor  # [B, C]
    returns: Tensor | None  # [B, C] value targets (algorithms with a critic)
    values_old: Tensor | None  # [B, C] (algorithms with a critic)
    metrics: Tally  # rewards, accuracy, lengths


def _values(critic: torch.nn.Module, rollout: Rollout) -> Tensor:
    """``[B, C]`` V(s_t): the critic at the column that predicts completion token t."""
    att = rollout.attention_mask
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    values = critic(rollout.input_ids, att, position_ids(att))
    return values[:, p - 1 : p - 1 + c]


@torch.no_grad()
def score(
    cfg: TrainConfig,
    m: Models,
    rollout: Rollout,
    reward_fns: list,
    beta: float,
    dist: Dist | None = None,
) -> Scored:
    """Rewards, log-probs, values and advantages of this rank's share of the step's rollouts;
    ``dist`` (default: a world of one) holds the other shares, for batch-wide whitening."""
    # The sampler returns the rollout on the CPU; from here on it lives with the models.
    rollout = rollout.to(next(m.reference.parameters()).device)
    mask = rollout.mask
    totals, per_fn = rewards_mod.combined_rewards(
        reward_fns, rollout.prompts, rollout.completions, rollout.answers
    )
    scores = torch.tensor(totals, dtype=torch.float32, device=mask.device)
    tokens = rollout.completion_ids
    weight_ref, bias_ref = m.reference.head()
    hidden_ref = completion_hidden(m.reference, rollout, share_prompt=cfg.rollout.share_prompt)
    ref = logprobs.fused(
        hidden_ref, weight_ref, tokens, bias=bias_ref, temperature=cfg.rollout.temperature
    )
    logp_ref = ref.logp
    old = SamplingPass.empty(logp_ref)
    if not update_gives_logp_old(cfg):
        weight, bias = _unwrap(m.backbone).head()
        out = logprobs.fused(
            completion_hidden(_unwrap(m.backbone), rollout, share_prompt=cfg.rollout.share_prompt),
            weight,
            tokens,
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=hidden_ref,
            weight_ref=weight_ref,
            bias_ref=bias_ref,
        )
        old.record(torch.arange(len(scores)), out)

    # The task reward sits on the last valid token; the KL penalty, when in the reward, on all.
    last = (mask.long().cumsum(-1) == mask.long().sum(-1, keepdim=True)) & mask
    token_rewards = torch.where(last, scores[:, None], 0.0)
    kl_penalty = torch.zeros_like(token_rewards)
    if kl.in_reward(cfg.kl.placement) and beta > 0:
        est = cfg.kl.estimator
        shaped = losses.kl_reward(
            token_rewards,
            old.logp,
            logp_ref,
            mask,
            beta=beta,
            estimator=est,
            estimate=old.kl if needs_exact_kl(est) else None,
        )
        kl_penalty = shaped - token_rewards

    spec = ALGORITHMS[cfg.algo.name]
    values_old = torch.where(mask, _values(m.critic_core, rollout), 0.0) if spec.critic else None
    g = rollout.group_size
    adv, returns = spec.advantages(
        cfg.algo,
        AdvantageInputs(scores, token_rewards, kl_penalty, mask, g, values_old, dist or Dist()),
    )
    metrics = reward_metrics(scores, per_fn, rollout, g)
    if cfg.gold_reward:
        metrics.add_means(gold_metrics(cfg.gold_reward, rollout, scores), len(scores))
    return Scored(rollout, scores, old, logp_ref, hidden_ref, adv, returns, values_old, metrics)


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
    ref: ref_samples.RefBatch | None = None,
    mix_weight: float = 0.0,
) -> Tally:
    """``epochs × minibatches`` optimizer steps on one scored rollout; returns their metrics.

    Losses are summed over an optimizer step's micro-batches and ranks (each is already divided
    by the minibatch's global normaliser) and averaged over the optimizer steps; token metrics
    pool every token; ``grad_norm`` (the same on every rank) is averaged over the steps.

    With ``ref`` (``ref_is``, ``adaptive_mix``) each optimizer step also carries the KL term on
    the reference's completions (:func:`klpo.train.rollout.ref_samples.ref_term`); its metrics are those
    of the first optimizer step, at the sampling policy's parameters, averaged over ranks.
    """
    a = cfg.algo
    mask = s.rollout.mask
    max_len = cfg.rollout.max_new_tokens
    clip = cfg.optim.grad_clip or math.inf
    tally = Tally()
    ref_seconds, ref_logged = 0.0, False
    for _ in range(a.epochs):
        order = shuffle_rows(cfg, s.rollout, gen)
        for mb in order.chunk(a.minibatches):
            # One normaliser for the whole minibatch, over its micro-batches and all ranks.
            n_global = dist.all_sum(reduce.normaliser(mask[mb], a.loss_reduction, max_len=max_len))
            opt.policy.zero_grad(set_to_none=True)
            if opt.critic is not None:
                opt.critic.zero_grad(set_to_none=True)
            step_losses: dict[str, float] = {}
            if ref is not None:
                head = _unwrap(m.backbone).head()
                part = ref_samples.ref_term(
                    cfg, m.backbone, head, ref, beta=beta, mix_weight=mix_weight
                )
                ref_seconds += part.pop("time/ref_update")
                if not ref_logged:
                    tally.add_means(part, 1.0)
                    ref_logged = True
            width = s.rollout.prompt_ids.shape[1] + s.rollout.completion_ids.shape[1]
            micro = microbatch.split(
                mb, width, a.micro_batch, a.micro_batch_tokens, s.rollout.group_size
            )
            for i, rows in enumerate(micro):
                part = _micro_step(
                    cfg, m, s, rows, beta, beta_old, n_global, dist,
                    sync=i == len(micro) - 1, tally=tally, mix_weight=mix_weight,
                )  # fmt: skip
                for k, v in part.items():
                    step_losses[k] = step_losses.get(k, 0.0) + v
            # This rank holds 1/world of the optimizer step: the ranks' shares sum to its loss.
            for k, v in step_losses.items():
                tally.add(k, v, 1.0 / dist.world)
            policy_params = [p for p in m.policy.parameters() if p.requires_grad]
            norm = torch.nn.utils.clip_grad_norm_(policy_params, clip)
            tally.add("grad_norm", fsdp.to_float(norm), 1.0)  # a DTensor under FSDP
            opt.policy.step()
            if opt.critic is not None:
                torch.nn.utils.clip_grad_norm_(m.critic_core.parameters(), clip)
                opt.critic.step()
    if ref is not None:
        tally.add("time/ref_update", ref_seconds, 1.0)
    return tally


def shuffle_rows(cfg: TrainConfig, rollout: Rollout, gen: torch.Generator) -> Tensor:
    """The update's row order: whole groups shuffled when prompts are shared, else rows.

    With ``rollout.share_prompt`` the minibatches (and micro-batches of a multiple of the group
    size) hold whole groups in order, so each prompt is computed once per group in the update's
    forward pass too (:func:`klpo.train.rollout.samplers.shared_groups`).
    """
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
    tally: Tally,
    mix_weight: float = 0.0,
) -> dict[str, float]:
    """Forward and backward of one micro-batch (gradients accumulate); returns its losses.

    Its losses are its share of the optimizer step's (``n_global`` is the step's normaliser);
    its token metrics go into ``tally``. Rows of ``s.old`` not yet filled are filled from this
    forward (:class:`SamplingPass`).
    """
    a, k = cfg.algo, cfg.kl
    r = s.rollout.select(rows)
    mask = r.mask
    adv = s.adv[rows]
    # The per-token KL term on the policy's tokens (ref_is has none, adaptive_mix a·k1).
    kl_name, kl_coef = ref_samples.policy_term(cfg, mix_weight)
    kl_in_loss = kl.in_loss(k.placement) and beta * kl_coef > 0
    recording = not bool(s.old.filled[rows].all())
    need_ref = (kl_in_loss and needs_exact_kl(kl_name)) or recording
    max_len = cfg.rollout.max_new_tokens

    def red(x: Tensor) -> Tensor:
        return reduce.reduce(x, mask, a.loss_reduction, normaliser=n_global, max_len=max_len)

    # On-policy, with a KL term that is exact or absent and no engine weights, the loss's weight
    # on each token's log-prob, entropy and KL is known before the forward pass: the gradient is
    # taken in it (klpo.logprobs.fused_loss), with the same gradient as the per-token path.
    with _no_sync(m.backbone, sync):
        weight, bias = _unwrap(m.backbone).head()
        weight_ref, bias_ref = m.reference.head()
        weights = None
        if (
            FUSED_LOSS
            and weight.shape[0] >= FUSED_LOSS_MIN_VOCAB
            and recording
            and r.engine_logp is None
            and (not kl_in_loss or needs_exact_kl(kl_name))
        ):
            weights = on_policy_weights(cfg, adv, mask, red, beta * kl_coef if kl_in_loss else 0.0,
                                        beta_old, dist.world)  # fmt: skip
        head_args = dict(
            bias=bias,
            temperature=cfg.rollout.temperature,
            hidden_ref=s.hidden_ref[rows] if need_ref else None,
            weight_ref=weight_ref if need_ref else None,
            bias_ref=bias_ref if need_ref else None,
        )
        hidden = completion_hidden(m.backbone, r, share_prompt=cfg.rollout.share_prompt)
        if weights is not None:
            fl = logprobs.fused_loss(
                hidden, weight, r.completion_ids, **head_args, with_entropy=True,
                logp_weight=weights[0], entropy_weight=weights[1], kl_weight=weights[2],
            )  # fmt: skip
            out = logprobs.FusedOutput(fl.logp, fl.entropy, fl.kl)
        else:
            out = logprobs.fused(hidden, weight, r.completion_ids, **head_args)
        logp = out.logp
        if recording:
            s.old.record(rows, out)
        logp_old = s.old.logp[rows]
        pg = POLICY_LOSSES[a.policy_loss](a, logp, logp_old, adv, mask, beta_old)
        if r.engine_logp is not None and cfg.rollout.tis_cap is not None:
            # Tokens sampled by an inference engine: truncated importance sampling against the
            # trainer's pi_old. The KL term below keeps the trainer's own pi_old, never the engine's.
            pg = mismatch.tis_policy_loss(pg, logp_old, r.engine_logp, cap=cfg.rollout.tis_cap)
        loss_pg = red(pg)
        total = loss_pg
        metrics = {"loss/policy": loss_pg.item()}
        if kl_in_loss:
            kl_tok = (
                out.kl
                if needs_exact_kl(kl_name)
                else losses.kl_loss(
                    kl_name,
                    logp,
                    s.logp_ref[rows],
                    logp_old=logp_old if cfg.kl.off_policy_correction else None,
                )
            )
            loss_kl = kl_coef * red(kl_tok)
            total = total + beta * loss_kl
            metrics["loss/kl"] = loss_kl.item()
        if a.entropy_coef:
            loss_ent = red(losses.entropy_bonus(out.entropy))
            total = total + a.entropy_coef * loss_ent
            metrics["loss/entropy"] = loss_ent.item()
        # DDP averages gradients over ranks; the normaliser is already global, so undo the mean
        # (on_policy_weights carries the factor already).
        if weights is not None:
            fl.loss.backward()  # total's gradient; total itself is the value, for the logs
        else:
            (total * dist.world).backward()
    n_tok = float(mask.sum())
    if m.critic is not None:
        with _no_sync(m.critic, sync):
            values = _values(m.critic, r)
            values_old, returns = s.values_old[rows], s.returns[rows]
            loss_v = red(losses.value_loss(values, values_old, returns, clip=a.value_clip))
            (a.vf_coef * loss_v * dist.world).backward()
        metrics["loss/value"] = loss_v.item()
        total = total.detach() + a.vf_coef * loss_v.detach()
        vm = losses.value_metrics(values, values_old, returns, mask, clip=a.value_clip)
        tally.add_means(
            {key: vm[key] for key in ("value/clip_frac", "value/mean", "value/mse")}, n_tok
        )
        # value/explained_var pools every token of the update: first and second moments.
        ret = returns.detach().double()
        err = ret - values.detach().double()
        for key, x in (("r", ret), ("r2", ret * ret), ("e", err), ("e2", err * err)):
            tally.add(f"_value/{key}", float(reduce.masked_sum(x, mask)), n_tok)
    metrics["loss/total"] = total.item()
    pm = losses.policy_metrics(
        logp, logp_old, adv, mask, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip
    )
    tally.add_means({key: pm[key] for key in ("clip_frac", "kl/old/k1", "kl/old/k3")}, n_tok)
    if a.policy_loss == "gspo":  # sequence means, over the sequences with a token
        gm = losses.gspo_metrics(
            logp, logp_old, adv, mask, clip_low=a.gspo_clip_low, clip_high=a.gspo_clip_high
        )
        tally.add_means(gm, float(mask.any(-1).sum()))
    return metrics


# ---------------------------------------------------------------------------------------------
# Evaluation.


def heldout_accuracy(cfg: TrainConfig, m: Models, heldout: list[Example]) -> float:
    from klpo.train.evaluate import heldout_accuracy as accuracy

    fsdp.unshard_root(m.backbone)  # generate calls the model outside the root's forward
    return accuracy(
        m.policy,
        m.tokenizer,
        heldout,
        max_new_tokens=cfg.rollout.max_new_tokens,
        reward=eval_reward(cfg),
        sampler=cfg.rollout.sampler,
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
    plan, examples = preflight(
        cfg, dist, resume=resume, log=log, allow_config_change=allow_config_change
    )
    run = setup(cfg, dist, plan, examples, log)
    finished = False
    try:
        run_steps(run, stopper)
        finished = True
    finally:
        teardown(run, finished=finished)
    return run.dir


# ---------------------------------------------------------------------------------------------
# Preflight: every check that can fail, before any model loads or any file is written.


def preflight(
    cfg: TrainConfig, dist: Dist, *, resume: bool, log=print, allow_config_change: bool = False
) -> tuple[checks.RunPlan, tuple[list[Example], list[Example]]]:
    """Check the config against the launch, the run directory, the models and the data; returns
    where the run starts (:func:`klpo.train.preflight.plan_run_dir`) and the (train, held-out)
    examples. Reads only small files (model configs, tokenizers, checkpoint headers) and the
    data; raises :class:`ConfigError` naming the key, file or line and the fix."""
    ro = cfg.rollout
    if ro.prompts_per_step % dist.world:
        raise ConfigError(
            f"rollout.prompts_per_step={ro.prompts_per_step} must be divisible by the number of "
            f"processes ({dist.world}): each process samples whole groups of an equal share"
        )
    start = ckpt_io.latest_checkpoint(cfg.run.out_dir) if resume else None
    sharded_run = dist.enabled and cfg.dist.strategy == "fsdp"
    if start is not None and fsdp.is_sharded_checkpoint(start) and not sharded_run:
        raise ConfigError(
            f"{start} holds sharded weights (dist.strategy=fsdp); resume it under torchrun "
            "with dist.strategy=fsdp, or klpo export it to a plain model"
        )
    plan = checks.plan_run_dir(
        cfg, resume=resume, world=dist.world, allow_config_change=allow_config_change
    )
    train_set, heldout = load_examples(cfg)
    policy = resolve_model_path(cfg.model.policy)
    reference = resolve_model_path(cfg.model.reference or cfg.model.policy)
    critic = resolve_model_path(cfg.model.critic or reference)
    names = dict(
        policy=policy,
        reference=reference,
        critic=critic if ALGORITHMS[cfg.algo.name].critic else None,
    )
    checks.check_model_sources(cfg, **names)
    check_models(cfg)
    check_engine(cfg, dist.world)
    if cfg.data.chat:  # the tokenizer's files are small: a missing template fails here
        from klpo.train.data.sources import check_chat_template

        check_chat_template(load_tokenizer(policy))
    checks.check_tokenizers_and_prompts(cfg, train_set, heldout, **names)
    log(f"run directory: {cfg.run.out_dir}")
    for line in plan.notes:
        log(f"note: {line}")
    for line in checks.config_warnings(cfg, dist.world):
        log(f"warning: {line}")
    return plan, (train_set, heldout)


def _model_config(key: str, name: str):
    from transformers import AutoConfig

    from klpo.train.models.load import quiet_transformers

    quiet_transformers()
    path = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{key}={name!r}: no model config could be read ({err}). Give a local directory "
            "written by save_pretrained, or builtin for the shipped arithmetic model."
        ) from None


def check_models(cfg: TrainConfig) -> None:
    """The models against each other and the config, from their config files alone: the policy
    and the reference share a vocabulary (the KL compares them token by token), and a
    completion fits in every model's positions."""
    mc = cfg.model
    configs = {"model.policy": (mc.policy, _model_config("model.policy", mc.policy))}
    ref = mc.reference or mc.policy
    configs["model.reference"] = (ref, _model_config("model.reference", ref))
    if ALGORITHMS[cfg.algo.name].critic:
        critic = mc.critic or ref
        configs["model.critic"] = (critic, _model_config("model.critic", critic))
    (p_name, p_cfg), (r_name, r_cfg) = configs["model.policy"], configs["model.reference"]
    p_vocab, r_vocab = getattr(p_cfg, "vocab_size", None), getattr(r_cfg, "vocab_size", None)
    if p_vocab is not None and r_vocab is not None and p_vocab != r_vocab:
        raise ConfigError(
            f"model.reference={r_name!r} has a vocabulary of {r_vocab} tokens but model.policy="
            f"{p_name!r} has {p_vocab}: the KL compares the two token by token, so the "
            "reference must share the policy's tokenizer (leave model.reference unset to use "
            "the policy's starting point)"
        )
    new = cfg.rollout.max_new_tokens
    for key, (name, c) in configs.items():
        positions = getattr(c, "max_position_embeddings", None)
        if positions is not None and new >= positions:
            raise ConfigError(
                f"rollout.max_new_tokens={new} leaves no room for a prompt in {key}={name!r}, "
                f"which has {positions} positions (max_position_embeddings); lower "
                "rollout.max_new_tokens"
            )


# ---------------------------------------------------------------------------------------------
# Setup, the loop of steps, teardown.


@dataclass
class TrainRun:
    """Everything a run holds between its steps."""

    cfg: TrainConfig
    dist: Dist
    dir: Path
    log: Callable[..., None]
    models: Models
    stream: PromptStream
    heldout: list[Example]
    reward_fns: list
    kl_ctl: control.KLController
    pen_ctl: control.KLController
    opt: Optimizers
    update_gen: torch.Generator
    writer: MetricsWriter | None
    step0: int
    progress: Callable[[int | None, dict[str, float] | None], None]
    engine: RolloutEngine  # samples the completions (klpo.train.rollout.engines)
    mix_window: ref_kl.MixWindow | None = None  # adaptive_mix's past outputs
    ref_updates: int = 0  # kl.reference_reset: reference updates so far

    @property
    def sharded(self) -> bool:
        """FSDP: the policy and its optimizer state are saved as shards (klpo.train.models.fsdp)."""
        return fsdp.is_sharded(self.models.backbone)

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizers whose state goes to optim.safetensors (a sharded policy's does not)."""
        o = self.opt
        policy = {} if self.sharded else {"policy": o.policy}
        return policy | ({"critic": o.critic} if o.critic else {})

    def moved_reference(self) -> torch.nn.Module | dict[str, Tensor] | None:
        """What a checkpoint saves of a reference that kl.reference_reset moves: the reference
        model, or with LoRA the merged base weights (klpo.train.models.lora); None when it is frozen."""
        if self.cfg.kl.reference_reset is None:
            return None
        if isinstance(self.models.reference, AdapterFreeReference):
            return base_weights(self.models.policy)
        return self.models.reference.model

    def save(self, step: int) -> None:
        rngs = self.dist.gather_objects(ckpt_io.rng_state())
        policy = self.models.policy
        if self.sharded:  # every rank writes its shards; the main rank moves them into place
            staged = self.dir / "checkpoints" / f".shards-step_{step:06d}"
            fsdp.save_sharded(self.models.backbone, self.opt.policy, staged)
            self.dist.barrier()
            policy = fsdp.StagedShards(staged, self.models.policy.config)
        if self.dist.is_main:
            ckpt_io.save_checkpoint(
                self.dir,
                step,
                policy=policy,
                critic=self.models.critic_core,
                reference=self.moved_reference(),
                optimizers=self.optimizers,
                rng=rngs,
                state={
                    "data": self.stream.state_dict(),
                    "kl_controller": self.kl_ctl.state_dict(),
                    "penalty_controller": self.pen_ctl.state_dict(),
                    "update_generator": self.update_gen.get_state().tolist(),
                    "reference_updates": self.ref_updates,
                    **(
                        {"mix_window": self.mix_window.state_dict()}
                        if self.mix_window is not None
                        else {}
                    ),
                },
            )
        self.dist.barrier()


def _fusable(params: list[torch.nn.Parameter]) -> bool | None:
    """True where torch's fused AdamW applies (plain float tensors on one CPU or CUDA device), else
    None (torch's default). Fused, the step is one kernel over every parameter: on the CPU,
    torch's default is a loop of per-tensor operations, ~4.5 ms against ~0.3 ms for the 1M
    parameters of the shipped model (the same update, in another order of roundings)."""
    from torch.distributed.tensor import DTensor

    devices = {p.device for p in params}
    ok = (
        len(devices) == 1
        and next(iter(devices)).type in ("cpu", "cuda")
        and all(p.is_floating_point() and not isinstance(p, DTensor) for p in params)
    )
    return True if ok else None


def make_optimizers(cfg: TrainConfig, m: Models) -> Optimizers:
    o = cfg.optim

    def adamw(params, lr: float) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.AdamW(
            params, lr=lr, betas=o.betas, weight_decay=o.weight_decay, fused=_fusable(params)
        )

    policy = adamw([p for p in m.policy.parameters() if p.requires_grad], o.lr)
    critic = adamw(m.critic_core.parameters(), o.critic_lr or o.lr) if m.critic_core else None
    return Optimizers(policy, critic)


def setup(
    cfg: TrainConfig,
    dist: Dist,
    plan: checks.RunPlan,
    examples: tuple[list[Example], list[Example]],
    log,
) -> TrainRun:
    """Load the models, build the optimizers and controllers, restore a checkpoint, write the
    run's config (and any allowed change of it) and open its metrics."""
    run_dir = Path(cfg.run.out_dir)
    start, meta = plan.start, plan.meta
    torch.manual_seed(cfg.run.seed * 1000 + dist.rank)
    m = build_models(cfg, dist, start)
    train_set, heldout = (
        render_chat(x, m.tokenizer, chat=cfg.data.chat, system_prompt=cfg.data.system_prompt)
        for x in examples
    )
    stream = PromptStream(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    reward_fns = build_rewards(cfg.rewards, device=dist.device)
    kl_ctl, pen_ctl = make_kl_controller(cfg), make_penalty_controller(cfg)
    mix_window = ref_samples.make_window(cfg)
    opt = make_optimizers(cfg, m)
    update_gen = torch.Generator().manual_seed(cfg.run.seed)
    step0 = 0
    if start is not None:
        step0 = meta["step"]
        optimizers = {"policy": opt.policy} | ({"critic": opt.critic} if opt.critic else {})
        if fsdp.is_sharded_checkpoint(start):  # (preflight checked that this run is sharded)
            fsdp.load_sharded(m.backbone, opt.policy, start / "policy")
            del optimizers["policy"]
        # After an allowed change of algorithm, an optimizer the checkpoint lacks starts fresh.
        ckpt_io.restore_optimizers(
            start, {k: o for k, o in optimizers.items() if k in meta["optimizers"]}, meta
        )
        kl_ctl.load_state_dict(meta["kl_controller"])
        pen_ctl.load_state_dict(meta["penalty_controller"])
        if mix_window is not None and "mix_window" in meta:  # absent after an allowed change
            mix_window.load_state_dict(meta["mix_window"])
        stream.load_state_dict(meta["data"])
        update_gen.set_state(torch.tensor(meta["update_generator"], dtype=torch.uint8))
        if plan.saved_world == dist.world:
            ckpt_io.restore_rng(start, meta, rank=dist.rank)
        else:  # an allowed change of world size: each rank's sampling stream starts anew
            torch.manual_seed(cfg.run.seed * 1000 + dist.rank + 7919 * step0)
        if isinstance(m.reference, AdapterFreeReference):
            # LoRA: after a merge-and-restart the base is part of the policy, so it is loaded
            # whenever the checkpoint holds it (the adapters were loaded by build_models).
            if cfg.kl.reference_reset is not None or (start / ckpt_io.REFERENCE).is_file():
                tensors = ckpt_io.reference_tensors(start)
                load_base_weights(m.policy, tensors, str(start / ckpt_io.REFERENCE))
        elif cfg.kl.reference_reset is not None:
            ckpt_io.restore_reference(start, m.reference.model)
        log(f"resuming {run_dir} from step {step0}")

    writer = None
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for orphan in ckpt_io.remove_orphans(run_dir):
            log(f"note: removed {orphan}, the remains of a checkpoint save that did not finish")
        if plan.restart and (kept := checks.keep_old_metrics(run_dir)) is not None:
            log(f"note: the earlier metrics of this run are kept in {kept}")
        if plan.changes:
            checks.record_config_change(run_dir, step0, plan.changes)
            log(f"note: config change recorded in {run_dir / checks.CHANGES_FILE}")
        ckpt_io.write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        note = announce(cfg)
        if note:
            log(note)
        writer = MetricsWriter(run_dir, tensorboard=cfg.run.tensorboard, resume_step=step0)
    run = TrainRun(
        cfg, dist, run_dir, log, m, stream, heldout, reward_fns, kl_ctl, pen_ctl, opt,
        update_gen, writer, step0, _progress(cfg, dist, step0, log),
        make_engine(cfg, m, dist, resolve_model_path(cfg.model.policy)), mix_window,
        ref_updates=int(meta.get("reference_updates", 0)),
    )  # fmt: skip
    if step0 == 0 and heldout and cfg.run.eval_every and evaluates(run):
        acc = heldout_accuracy(cfg, m, heldout)
        if writer is not None:
            writer.write(0, {"accuracy/heldout": acc})
    return run


def evaluates(run: TrainRun) -> bool:
    """Whether this rank runs the held-out evaluation: the main rank; under FSDP every rank, since
    a sharded forward is collective (greedy decoding of the same problems with the same weights,
    so all ranks take the same number of forwards)."""
    return run.dist.is_main or run.sharded


def run_steps(run: TrainRun, stopper: StopOnSignal | None = None) -> None:
    """Steps ``step0 + 1 ..`` until ``run.steps`` or the time limit; checkpoint as configured,
    and after a step in which ``stopper`` caught SIGINT/SIGTERM on any rank (then stop)."""
    cfg = run.cfg
    t_start = time.perf_counter()
    for step in range(run.step0 + 1, cfg.run.steps + 1):
        t0 = time.perf_counter()
        metrics, tokens = train_step(run, step)
        last = step == cfg.run.steps or (
            cfg.run.time_limit is not None and time.perf_counter() - t_start > cfg.run.time_limit
        )
        if run.heldout and cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last):
            if evaluates(run):
                acc = heldout_accuracy(cfg, run.models, run.heldout)
                if run.dist.is_main:
                    metrics["accuracy/heldout"] = acc
            run.dist.barrier()
        metrics["time/step"] = time.perf_counter() - t0
        metrics["tokens_per_s"] = tokens / metrics["time/step"]
        if run.writer is not None:
            run.writer.write(step, metrics)
        run.progress(step, metrics)
        bad = [k for k in ("loss/total", "grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
        if bad:
            raise TrainingDiverged(
                f"step {step}: {', '.join(f'{k} = {metrics[k]}' for k in bad)}; the weights are "
                "no longer finite, so training stopped (metrics up to this step are in "
                f"{run.dir / 'metrics.jsonl'}). Lower optim.lr or raise kl.beta."
            )
        stop = run.dist.any(stopper is not None and stopper.requested) and not last
        if last or stop or (cfg.run.save_every and step % cfg.run.save_every == 0):
            run.save(step)
        if stop:
            raise _interrupted(run.dir, step, stopper)
        if last:
            break


def _interrupted(run_dir: Path, step: int, stopper: StopOnSignal | None) -> Interrupted:
    """The end of a run stopped by a signal after the checkpoint of ``step``: say where it is."""
    mine = stopper is not None and stopper.requested
    return Interrupted(
        f"stopped by {stopper.name if mine else 'a signal to another rank'} after step {step}; "
        f"the checkpoint is {run_dir / 'checkpoints' / f'step_{step:06d}'} and the metrics up "
        f"to it are in {run_dir / 'metrics.jsonl'}. Continue with: klpo train --resume {run_dir}",
        stopper.signum if mine else signal.SIGTERM,
    )


def train_step(run: TrainRun, step: int) -> tuple[dict[str, float], float]:
    """Sample, score, update, control: one step's metrics (without the held-out evaluation) and
    the number of completion tokens it trained on, over all ranks."""
    cfg, dist, m = run.cfg, run.dist, run.models
    t0 = time.perf_counter()
    for group in run.opt.policy.param_groups:
        group["lr"] = _lr(cfg, step)
    per_rank = cfg.rollout.prompts_per_step // dist.world
    batch = run.stream.next(cfg.rollout.prompts_per_step)
    mine = batch[dist.rank * per_rank : (dist.rank + 1) * per_rank]

    # 1. Sample, with the policy's current weights.
    run.engine.sync_weights(m.policy)
    rollout = run.engine.sample([e.prompt for e in mine], [e.answer for e in mine])
    t1 = time.perf_counter()

    # 1b. ref_is, adaptive_mix: the reference's own completions for the same prompts.
    ref = None
    if ref_samples.uses_reference_samples(cfg):
        ref = ref_samples.sample_reference(
            cfg,
            m.reference,
            m.tokenizer,
            [e.prompt for e in mine],
            [e.answer for e in mine],
            rollout,
        )
    window = run.mix_window
    mix_weight = window.weight() if window is not None else 0.0
    t1r = time.perf_counter()

    # 2. Score.
    beta = run.kl_ctl.value
    scored = score(cfg, m, rollout, run.reward_fns, beta, dist)
    t2 = time.perf_counter()

    # 3. Update.
    beta_old = run.pen_ctl.value
    upd = update(cfg, m, scored, run.opt, beta, beta_old, dist, run.update_gen, ref, mix_weight)
    t3 = time.perf_counter()

    # 4. Control: the controllers see the whole step's metrics, the same on every rank.
    metrics = step_metrics(cfg, scored, upd, dist)
    if ref is not None:
        metrics["ref/samples"] = dist.world * len(ref.logp_ref)
        metrics["time/ref_sample"] = ref.seconds
    if window is not None:  # the mix's output of this step joins its window
        mix = mix_weight * metrics["kl/ref/k1"] + (1 - mix_weight) * metrics["kl/ref/ref_is"]
        metrics["kl/ref/adaptive_mix"] = mix
        metrics["ref/mix_weight"] = mix_weight
        metrics["ref/kl_window"] = window.kl_window
        window.push(mix)
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    run.kl_ctl.update(
        kl=metrics[CONTROLLED_KL[cfg.kl.target_unit]],
        n_steps=n_seq,
        reward_std=metrics["reward/group_std"],
    )
    if cfg.algo.policy_loss in USES_BETA_OLD:
        metrics["beta_old"] = beta_old
        run.pen_ctl.update(kl=metrics["kl/old/k3"])
    resets = cfg.kl.reference_reset
    if resets is not None:  # move the reference (docs/overopt.md); the step's KL is before it
        if reset_due(resets, step, metrics["kl/ref/exact"]):
            if isinstance(m.reference, AdapterFreeReference):  # LoRA: merge-and-restart
                merge_and_restart(m.policy, restart_generator(cfg.run.seed, run.ref_updates))
                run.opt.policy.state.clear()  # fresh adapters: the old moments do not apply
            else:
                update_reference(m.reference.model, m.policy, resets.alpha)
                if resets.reset_optimizer:
                    run.opt.policy.state.clear()
            run.ref_updates += 1
        metrics["reference/updates"] = run.ref_updates
    metrics.update(
        {
            "beta": beta,
            "lr": _lr(cfg, step),
            "time/generate": t1 - t0,
            "time/score": t2 - t1r,
            "time/update": t3 - t2,
        }
    )
    return metrics, float(dist.all_sum(rollout.mask.sum()).item())


def step_metrics(cfg: TrainConfig, s: Scored, upd: Tally, dist: Dist) -> dict[str, float]:
    """Every metric of a scored and updated rollout, reduced over the ranks."""
    tally = Tally()
    tally.merge(s.metrics)
    tally.merge(sampling_metrics(cfg, s.old, s.logp_ref, s.rollout.mask))
    tally.merge(upd)
    if s.rollout.engine_logp is None:
        return finish_metrics(tally, dist)
    # The engine's log-probs against the trainer's pi_old: means pool tokens, maxima over ranks.
    mask = s.rollout.mask
    gap = mismatch.mismatch_metrics(
        s.old.logp, s.rollout.engine_logp, mask, cap=cfg.rollout.tis_cap
    )
    extremes = {k: gap.pop(k) for k in ("engine/k3_max", "engine/abs_max")}
    tally.add_means(gap, float(mask.sum()))
    out = finish_metrics(tally, dist)
    for key, value in extremes.items():
        out[key] = max(float(v) for v in dist.gather_objects(value))
    return out


def teardown(run: TrainRun, *, finished: bool) -> None:
    """Stop the progress bar, close the metrics; after a finished run, write its report."""
    run.progress(None, None)
    run.engine.close()
    if run.writer is None:
        return
    run.writer.close()
    if finished:
        from klpo.train.runtime.report import write_report

        report = write_report(
            run.dir, estimator=run.cfg.kl.estimator, title=f"klpo train: {run.cfg.algo.name}"
        )
        run.log(f"wrote {report}")


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
