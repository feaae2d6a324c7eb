"""The run's models: the policy, its backbone, the frozen reference and the critic, ready to train.

:func:`build_models` loads them as the config says, from the run's start (a checkpoint when it
resumes): LoRA adapters (:mod:`klpo.train.models.lora`) or all weights, gradient checkpointing,
the reference as a model of its own or the LoRA policy with its adapters off, the critic for
algorithms that train one (:data:`klpo.train.algorithms.ALGORITHMS`), and under ``torchrun`` DDP
or FSDP (:mod:`klpo.train.models.fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import TrainConfig
from klpo.train.models import fsdp
from klpo.train.models.backbone import Backbone, Critic
from klpo.train.models.load import (
    DTYPES,
    enable_checkpointing,
    freeze,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from klpo.train.models.lora import AdapterFreeReference, apply_lora, load_adapters
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist

__all__ = ["Models", "build_models", "unwrap"]


@dataclass
class Models:
    tokenizer: Any
    policy: Any  # the transformers model: generate, save_pretrained
    backbone: torch.nn.Module  # Backbone(policy), DDP-wrapped under torchrun
    reference: torch.nn.Module  # frozen: a Backbone, or the LoRA policy with adapters off
    critic: torch.nn.Module | None  # Critic, DDP-wrapped under torchrun (PPO only)
    critic_core: Critic | None


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


def build_models(cfg: TrainConfig, dist: Dist, start: Path | None) -> Models:
    """The run's models on ``dist.device``, from ``start`` (a checkpoint) when it resumes."""
    policy_path = resolve_model_path(cfg.model.policy)
    ref_path = resolve_model_path(cfg.model.reference or cfg.model.policy)
    tokenizer = load_tokenizer(policy_path, "model.policy")
    # Parameters are float32 (the master weights); model.dtype is the compute dtype (autocast).
    compute = DTYPES[cfg.model.dtype]
    policy = _load_policy(cfg, policy_path, start)
    if cfg.model.gradient_checkpointing:
        enable_checkpointing(policy)
    policy.to(dist.device).train()
    backbone: torch.nn.Module = Backbone(policy, compute)
    reference: torch.nn.Module
    if cfg.model.lora is not None and cfg.model.reference is None:
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
    return Models(tokenizer, policy, backbone, reference, critic, critic_core)
