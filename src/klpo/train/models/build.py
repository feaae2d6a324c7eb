"""The run's models: the policy, its backbone, the frozen reference and the critic, ready to train.

:func:`build_models` loads them as the config says, from the run's start (a checkpoint when it
resumes): LoRA adapters (:mod:`klpo.train.models.lora`) or all weights, gradient checkpointing,
the reference as a model of its own or the LoRA policy with its adapters off, the critic for
algorithms that train one (:data:`klpo.train.algorithms.ALGORITHMS`), and under ``torchrun`` DDP
or FSDP (:mod:`klpo.train.models.fsdp`).

Each model is checked as it loads, before anything trains:

* the policy and the reference, under ``model.logits_path: fused``: a few tokens through the
  model's own forward and through its backbone and fused head (:func:`klpo.heads.check_head`),
  on the float32 master weights without autocast, so the comparison is float32's (a skipped
  soft cap costs nats; float32 rounding explains ~1e-4 of one); a model they disagree on is
  refused with the architecture, the gap and ``model.logits_path: model`` (:func:`check_logits`).
  The critic reads only the backbone's last hidden states (its value head is klpo's own), so its
  output head is not checked;
* the key/value-cache paths (:mod:`klpo.train.models.cache`): a model whose cache holds recurrent
  state runs without a shared prompt and samples with ``generate``, with a one-line notice;
* a mixture-of-experts policy's router load-balancing loss (:func:`router_aux_coef`);
* with ``algo.packing: on``, every model that runs packed rows: two sequences packed in one row
  against each alone (:func:`klpo.train.models.packing.packing_refusal`); a model that mixes
  them is refused with its architecture and ``algo.packing: off`` (:func:`check_packing`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from klpo import heads
from klpo.kl import REF_SAMPLED
from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import ConfigError, TrainConfig
from klpo.train.models import fsdp, packing
from klpo.train.models.backbone import Backbone, Critic
from klpo.train.models.cache import notice
from klpo.train.models.load import (
    DTYPES,
    enable_checkpointing,
    freeze,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from klpo.train.models.lora import AdapterFreeReference, apply_lora, load_adapters
from klpo.train.models.tokens import Codec, run_codec
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist

__all__ = ["Models", "build_models", "check_logits", "check_packing", "router_aux_coef", "unwrap"]


@dataclass
class Models:
    tokenizer: Any
    policy: Any  # the transformers model: generate, save_pretrained
    backbone: torch.nn.Module  # Backbone(policy), DDP-wrapped under torchrun
    reference: torch.nn.Module  # frozen: a Backbone, or the LoRA policy with adapters off
    critic: torch.nn.Module | None  # Critic, DDP-wrapped under torchrun (PPO only)
    critic_core: Critic | None
    codec: Codec  # the tokenizer's rules: prompts to ids, the stop set (models.tokens)
    router_aux_coef: float = 0.0  # the policy's router load-balancing loss weight (MoE)
    notes: list[str] = field(default_factory=list)  # the load's notices, one line each
    teacher: torch.nn.Module | None = None  # frozen Backbone of the teacher (teacher.model)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DDP wrapper (``module`` itself when it has none)."""
    return module.module if hasattr(module, "module") else module


def _load_policy(cfg: TrainConfig, policy_path: str, start: Path | None) -> Any:
    """The policy: LoRA adapters on the base, or all weights, from ``start`` when resuming."""
    lora_cfg = cfg.model.lora
    if lora_cfg is not None:
        policy = load_causal_lm(policy_path, key="model.policy")
        return (
            load_adapters(policy, start / "policy")
            if start
            else apply_lora(policy, **lora_cfg.model_dump())
        )
    if start is not None and fsdp.is_sharded_checkpoint(start):
        # the sharded weights are loaded after sharding
        return load_causal_lm(policy_path, key="model.policy")
    return load_causal_lm(str(start / "policy") if start else policy_path, key="model.policy")


def check_logits(cfg: TrainConfig, model: Any, key: str, path: str) -> None:
    """The load-time check of the policy or the reference (model.logits_path: fused): the
    model's own log-probs against the fused head's, or a ConfigError naming the model, the
    architecture, the gap and ``model.logits_path: model`` (:func:`klpo.heads.check_head`)."""
    if cfg.model.logits_path == "model":
        return
    try:
        heads.check_head(model)
    except heads.UnsupportedHead as err:
        raise ConfigError(f"{key} {path!r}: {err}") from None


def check_packing(cfg: TrainConfig, model: Any, key: str, path: str) -> None:
    """The load-time probe of a model that will run packed rows (``algo.packing: on``): a
    ConfigError naming the model, its architecture, why and ``algo.packing: off`` where it
    cannot (:func:`klpo.train.models.packing.packing_refusal`)."""
    if cfg.algo.packing != "on":
        return
    reason = packing.packing_refusal(model)
    if reason is not None:
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        kind = getattr(inner.config, "model_type", "?")
        raise ConfigError(
            f"{key} {path!r} ({type(inner).__name__}, model type {kind}) cannot run packed "
            f"rows: {reason}; set algo.packing: off"
        )


def router_aux_coef(cfg: TrainConfig, policy: Any) -> float:
    """The weight of the policy's router load-balancing loss (``algo.router_aux_loss_coef``;
    null: the model's own, where its config turns on ``output_router_logits``)."""
    text = policy.config.get_text_config()
    moe = hasattr(text, "output_router_logits") and hasattr(text, "router_aux_loss_coef")
    coef = cfg.algo.router_aux_loss_coef
    if coef is None:
        own = moe and bool(getattr(text, "output_router_logits", False))
        return float(text.router_aux_loss_coef or 0.0) if own else 0.0
    if coef > 0 and not moe:
        raise ConfigError(
            f"algo.router_aux_loss_coef={coef} but model.policy ({type(policy).__name__}) is not a "
            "mixture-of-experts model whose config declares a router_aux_loss_coef and "
            "output_router_logits; set algo.router_aux_loss_coef: null or 0"
        )
    return float(coef)


def _notes(cfg: TrainConfig, models: list[tuple[Any, str, bool]]) -> list[str]:
    """The cache notices of the run's models ``(model, config key, whether it samples with the
    lean sampler)`` (:func:`klpo.train.models.cache.notice`)."""
    share = cfg.rollout.share_prompt
    lines = [notice(model, key, share_prompt=share, lean=lean) for model, key, lean in models]
    return [line for line in lines if line]


def build_models(cfg: TrainConfig, dist: Dist, start: Path | None) -> Models:
    """The run's models on ``dist.device``, from ``start`` (a checkpoint) when it resumes."""
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    tokenizer = load_tokenizer(policy_path, "model.policy")
    # Parameters are float32 (the master weights); model.dtype is the compute dtype (autocast).
    compute, path = DTYPES[cfg.model.dtype], cfg.model.logits_path
    policy = _load_policy(cfg, policy_path, start)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(policy)
    policy.to(dist.device).train()
    check_logits(cfg, policy, "model.policy", cfg.model.policy)
    check_packing(cfg, policy, "model.policy", cfg.model.policy)
    aux = router_aux_coef(cfg, policy)
    backbone: torch.nn.Module = Backbone(policy, compute, logits_path=path, router_aux=aux > 0)
    reference: torch.nn.Module
    lean = cfg.rollout.sampler == "lean"
    # The policy samples unless vLLM does; the reference samples for ref_is and adaptive_mix.
    loaded = [(policy, "model.policy", lean and cfg.rollout.engine == "hf")]
    if cfg.model.lora is not None and cfg.model.reference is None:
        reference = AdapterFreeReference(backbone)  # no second copy of the weights
    else:
        ref_model = freeze(load_causal_lm(ref_path, key="model.reference").to(dist.device))
        check_logits(cfg, ref_model, "model.reference", ref_path)
        check_packing(cfg, ref_model, "model.reference", ref_path)
        reference = Backbone(ref_model, compute, logits_path=path)
        loaded.append((ref_model, "model.reference", lean and cfg.kl.estimator in REF_SAMPLED))
    critic_core = None
    if ALGORITHMS[cfg.algo.name].critic:
        critic_path = resolve_model_path(cfg.model.critic or ref_path)
        critic_core = Critic(load_causal_lm(critic_path, key="model.critic"), compute).to(
            dist.device
        )
        loaded.append((critic_core.backbone.model, "model.critic", False))
        check_packing(cfg, critic_core.backbone.model, "model.critic", critic_path)
        if start is not None and (start / "critic.safetensors").is_file():
            ckpt_io.restore_critic(start, critic_core)
    critic: torch.nn.Module | None = critic_core
    teacher = None
    if cfg.teacher is not None:
        teacher_path = resolve_model_path(cfg.teacher.model)
        teacher_model = freeze(load_causal_lm(teacher_path, key="teacher.model").to(dist.device))
        check_logits(cfg, teacher_model, "teacher.model", teacher_path)
        check_packing(cfg, teacher_model, "teacher.model", teacher_path)
        teacher = Backbone(teacher_model, compute, logits_path=path)
        loaded.append((teacher_model, "teacher.model", False))
    notes = _notes(cfg, loaded)  # before sharding: each probe is one process's own forward
    if dist.enabled and cfg.dist.strategy == "fsdp":
        backbone = fsdp.shard(backbone, dist)
        reference = fsdp.shard(reference, dist)
    elif dist.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        backbone = DDP(backbone)
        critic = DDP(critic_core) if critic_core is not None else None
    codec = run_codec(cfg, tokenizer, policy_path)
    return Models(
        tokenizer, policy, backbone, reference, critic, critic_core, codec, aux, notes, teacher
    )
