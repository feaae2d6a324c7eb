"""The run's first lines: what it trains, how, and how many parameters move.

Before any model loads, :func:`config_lines` says what a practitioner checks first in a log:
the algorithm and the batch, the sampling, the models (the reference, the critic), the precision and gradient
checkpointing, LoRA's rank, alpha, dropout and targets (or that every weight trains), the
optimizer and the KL term. Once the policy is built, :func:`parameter_lines` counts its
parameters: how many train (the LoRA adapters, or all), of how many, and the bytes of the
weights and of AdamW's two moments, as ``peft``'s ``print_trainable_parameters`` counts them.
"""

from __future__ import annotations

from typing import Any

import torch

from klpo.train.algorithms import ALGORITHMS
from klpo.train.config import TrainConfig

__all__ = ["config_lines", "parameter_lines"]


def _num(x: float | None, none: str = "off") -> str:
    return none if x is None else f"{x:g}"


def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def config_lines(cfg: TrainConfig) -> list[str]:
    """The run's settings that decide what it costs and what it learns, one line each."""
    mc, ro, a, o, k = cfg.model, cfg.rollout, cfg.algo, cfg.optim, cfg.kl
    per_step = ro.prompts_per_step * ro.group_size
    lines = [
        f"training: {a.name}, {_n(cfg.run.steps, 'step')} of {_n(ro.prompts_per_step, 'prompt')}"
        f" × {_n(ro.group_size, 'completion')} ({per_step} a step) of at most {ro.max_new_tokens} new "
        f"tokens, {_n(a.epochs, 'epoch')} of {_n(a.minibatches, 'minibatch', 'minibatches')}, "
        f"run.seed={cfg.run.seed}"
    ]
    shared = "once per group" if ro.share_prompt else "with each completion"
    lines.append(
        f"sampling: {ro.engine} engine, {ro.sampler} sampler, temperature {_num(ro.temperature)}, "
        f"top-p {_num(ro.top_p)}; each prompt's forward {shared} (rollout.share_prompt)"
    )
    if ro.staleness:
        where = "a worker process sampling ahead" if ro.asynchronous else "the trainer"
        behind = f"{_n(ro.staleness, 'version')} behind the trainer"
        if ro.asynchronous and ro.async_weights == "newest":
            behind = f"up to {behind} (the newest weights pushed: the lag depends on the timing)"
        cap = f" {_num(k.behaviour_cap)}" if k.behaviour_correction == "is-cap" else ""
        lines.append(
            f"staleness: the sampler {behind}, in "
            f"{where}; KL term's correction {k.behaviour_correction}{cap}, policy loss's TIS cap "
            f"{'none' if ro.tis_cap is None else _num(ro.tis_cap)} (docs/async.md)"
        )
    if mc.reference is not None:
        ref = mc.reference
    elif mc.lora is not None:
        ref = "the policy with its LoRA adapters off (no second copy)"
    else:
        ref = "a frozen copy of the policy's starting weights"
    models = f"models: policy {mc.policy}; reference {ref}"
    if ALGORITHMS[a.name].critic:
        models += f"; critic {mc.critic or mc.reference or mc.policy} with a value head"
    lines.append(models)
    compute = (
        "float32 weights and compute"
        if mc.dtype == "float32"
        else f"{mc.dtype} compute (autocast) over float32 master weights"
    )
    ckpt = "on" if mc.gradient_checkpointing else "off"
    lines.append(f"precision: {compute}; gradient checkpointing {ckpt}")
    if mc.lora is None:
        lines.append("LoRA: off (every weight of the policy trains)")
    else:
        lo = mc.lora
        targets = lo.target_modules
        shown = targets if isinstance(targets, str) else ", ".join(targets)
        lines.append(
            f"LoRA: rank {lo.r}, alpha {_num(lo.alpha)} (updates scaled by alpha/r = "
            f"{_num(lo.alpha / lo.r)}), dropout {_num(lo.dropout)}, on {shown}"
        )
    warm = f", {o.warmup_steps} warm-up steps" if o.warmup_steps else ""
    lines.append(
        f"optimizer: AdamW, lr {_num(o.lr)} ({o.lr_scheduler}{warm}), weight decay "
        f"{_num(o.weight_decay)}, grad clip {_num(o.grad_clip)}"
    )
    if k.placement == "none":
        lines.append("KL: none (kl.placement is none)")
    else:
        lines.append(
            f"KL: estimator {k.estimator} in the {k.placement}, beta {_num(k.beta)} "
            f"(controller {k.controller})"
        )
    return lines


def _count(params: list[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:,.1f} MB"


def parameter_lines(policy: Any, *, lora: bool, critic: Any = None) -> list[str]:
    """How many of the policy's parameters train, of how many (shared tensors, such as tied
    embeddings, counted once), with the bytes of its weights and of AdamW's state for the
    trainable ones (two moments of their dtype); the critic's likewise when there is one."""
    out = []
    for name, model in (("policy", policy), ("critic", critic)):
        if model is None:
            continue
        params = list(model.parameters())
        trainable = [p for p in params if p.requires_grad]
        n, t = _count(params), _count(trainable)
        if lora and name == "policy":
            what = f"{100 * t / n:.2f}%: the LoRA adapters; the base is frozen"
        else:
            what = "all" if t == n else f"{100 * t / n:.2f}%" if n else "none"
        weights = sum(p.numel() * p.element_size() for p in params)
        state = sum(2 * p.numel() * p.element_size() for p in trainable)
        out.append(
            f"{name} parameters: {t:,} of {n:,} train ({what}); weights {_mb(weights)}, "
            f"AdamW state {_mb(state)}"
        )
    return out
