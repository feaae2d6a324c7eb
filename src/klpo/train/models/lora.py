"""LoRA policies (through ``peft``) whose reference is the same module with its adapters off.

With ``model.lora`` set, the policy is the base model with low-rank adapters on the listed
linear layers (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models",
arXiv:2106.09685): each adapted layer computes ``W x + (alpha / r) · B A x`` with the base ``W``
frozen and only ``A [r, in]`` and ``B [out, r]`` trained (``B`` starts at zero, so the policy
starts exactly at the base model). When no separate ``model.reference`` is given, the reference
pi_ref is that base model, and :class:`AdapterFreeReference` computes it with the *same* module
under ``peft``'s ``disable_adapter()``: no second copy of the weights exists.

Checkpoints hold the adapters only (``save_pretrained`` of a ``PeftModel``:
``adapter_config.json`` + ``adapter_model.safetensors``) and the optimizer state of the adapters;
``klpo export --merge`` folds ``B A`` into ``W`` and writes a plain transformers model
(:func:`klpo.train.tools.export.export_run`).

``kl.reference_reset`` (a hard reset) with LoRA is :func:`merge_and_restart`: the adapters are
folded into the base weights, which thereby become both the reference and the policy's frozen
part, and fresh adapters start from ``B = 0``. The base then differs from ``model.policy`` on disk,
so such a run also saves it (:func:`base_weights`, ``reference.safetensors``) and a resume or an
export loads it back (:func:`load_base_weights`) under the adapters.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from klpo.train.models.backbone import Backbone, ModelHead

ADAPTER_CONFIG = "adapter_config.json"


def apply_lora(model: nn.Module, r: int, alpha: float, dropout: float, target_modules: Any):
    """``model`` (a transformers causal LM) wrapped as a ``peft.PeftModel`` with fresh adapters.

    Only the adapters require gradients afterwards; the base weights are frozen in place.
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft calls transformers' deprecated spellings
            warnings.simplefilter("ignore", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as err:
        raise ValueError(
            f"model.lora.target_modules={target_modules!r} does not fit this model: {err}. "
            "Name its linear layers (e.g. [q_proj, v_proj]) or use 'all-linear'."
        ) from None


# What peft's PeftModel.__init__ triggers in transformers 5: it reads the deprecated
# `model.is_gradient_checkpointing` (transformers' FutureWarning names the new spelling,
# `is_activation_checkpointing`); peft's call, so klpo can only silence this one warning there.
_PEFT_DEPRECATION = r"`is_gradient_checkpointing` is deprecated"


def load_adapters(model: nn.Module, adapter_dir: str | Path, *, trainable: bool = True):
    """``model`` with the adapters saved in ``adapter_dir`` (a checkpoint's policy/): trainable
    (a resumed run), or not (``klpo export``). transformers' FutureWarning on peft's read of
    ``is_gradient_checkpointing`` is silenced, that warning only."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PEFT_DEPRECATION, category=FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds peft adapters rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


class AdapterFreeReference(nn.Module):
    """pi_ref as the policy's own module with its LoRA adapters disabled.

    ``forward`` and ``head`` have :class:`klpo.train.models.backbone.Backbone`'s signatures. The forward
    runs under ``disable_adapter()``, which makes every adapted layer return its base ``W x``
    alone; the output head carries no adapter (``model.lora`` refuses ``lm_head``), so the head
    is the base model's. Used without gradient (scoring), its outputs equal those of a separately
    loaded base model (tests/train/models/test_lora.py checks this in float64).

    The module is held in a plain list so that it is not registered twice (the policy owns it)
    and its parameters are not counted again.
    """

    def __init__(self, policy_backbone: Backbone):
        super().__init__()
        self._policy = [policy_backbone]

    @property
    def backbone(self) -> Backbone:
        return self._policy[0]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        *,
        prefix: int = 0,
        group: int = 1,
        keep: int = 0,
        packed: bool = False,
    ) -> Tensor:
        peft_model = self.backbone.model
        # Dropout on the adapters' input is bypassed with them; the base layers have none.
        with torch.no_grad(), peft_model.disable_adapter():
            return self.backbone(
                input_ids, attention_mask, position_ids, prefix=prefix, group=group, keep=keep,
                packed=packed,
            )  # fmt: skip

    def head(self) -> ModelHead:
        return self.backbone.head()

    def parameters(self, recurse: bool = True):
        # completion_hidden asks for the device of the first parameter.
        return self.backbone.parameters(recurse)


# ---------------------------------------------------------------------------------------------
# Merge-and-restart (kl.reference_reset with LoRA, klpo.train.models.reference).


def _lora_layers(peft_model: nn.Module) -> list[tuple[str, nn.Module, list[str]]]:
    """``(name, layer, adapters)`` of every LoRA layer, with its active adapters, in module
    order; refuses the layer kinds and options :func:`merge_and_restart` does not handle."""
    from peft.tuners.lora.layer import Linear, LoraLayer

    out = []
    for name, layer in peft_model.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        adapters = [a for a in layer.active_adapters if a in layer.lora_A]
        problem = None
        if not isinstance(layer, Linear):
            problem = f"its kind ({type(layer).__name__}) is not a plain linear LoRA layer"
        elif any(a in layer.lora_variant or layer.lora_bias.get(a) for a in adapters):
            problem = "it uses a LoRA variant (DoRA, ...) or lora_bias"
        elif layer.merged:
            problem = "its adapters are merged already (peft's merge_adapter)"
        if problem:
            raise ValueError(
                f"kl.reference_reset cannot merge-and-restart the LoRA layer {name}: {problem}; "
                "klpo restarts plain LoRA adapters on linear layers (model.lora) only"
            )
        out.append((name, layer, adapters))
    return out


def restart_generator(seed: int, update: int) -> torch.Generator:
    """The CPU generator that draws the fresh adapters of reference update ``update`` (0-based)
    of a run seeded ``seed``: a function of the two alone, so every rank of a DDP run, and a
    resumed run, draws the same adapters (the global RNG streams differ between ranks)."""
    state = np.random.SeedSequence([seed % 2**64, update]).generate_state(1, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0]) % 2**63)


@torch.no_grad()
def merge_and_restart(peft_model: nn.Module, generator: torch.Generator) -> int:
    r"""Fold every active LoRA adapter into its base weight and start a fresh one; in place.

    For each adapted linear layer, with ``s = lora_alpha / r`` (peft's ``scaling``)::

        W ← W + s · B A        (computed in float32 or wider, cast back to W's dtype)
        B ← 0,   A ← fresh     (as peft initialises them: kaiming-uniform with a = √5, or
                                N(0, 1/r²) for init_lora_weights="gaussian")

    The policy ``(W + s B A) x`` is unchanged up to rounding, and the adapter-free module
    (:class:`AdapterFreeReference`, the reference) becomes that policy: right after, the policy
    and the reference compute the same logits bit for bit, since ``B = 0`` adds an exact zero.
    ``A`` is drawn from ``generator`` on the CPU (layers in module order), so the result does not
    depend on the device or the global RNG (:func:`restart_generator`). This is peft's
    ``merge`` followed by ``reset_lora_parameters`` without peft's bookkeeping of merged
    adapters (the merged delta becomes part of the base for good), done on the tensors so that
    the sum is taken in float32 and the draw is seeded. The caller must clear the adapters'
    optimizer state (its Adam moments belong to the old adapters).

    Shapes: ``W [out, in]`` (``[in, out]`` for ``fan_in_fan_out`` layers), ``A [r, in]``,
    ``B [out, r]``. No gradient flows (the update is outside autograd). Reference: Hu et al.
    2021, arXiv:2106.09685 (LoRA; merging ``W + s B A`` for inference, Section 4.1).

    Returns:
        the number of adapters merged.

    Raises:
        ValueError: a LoRA layer that is not a plain linear one (a variant such as DoRA, a
            LoRA bias, an embedding or convolution layer), or one already merged.
    """
    config = getattr(peft_model, "peft_config", {})
    merged = 0
    for _name, layer, adapters in _lora_layers(peft_model):
        weight = layer.get_base_layer().weight
        for adapter in adapters:
            a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
            wide = torch.promote_types(weight.dtype, torch.float32)
            delta = b.to(wide) @ a.to(wide) * layer.scaling[adapter]
            if layer.fan_in_fan_out:
                delta = delta.T
            weight.copy_((weight.to(wide) + delta).to(weight.dtype))
            init = getattr(config.get(adapter), "init_lora_weights", True)
            fresh = torch.empty(a.shape, dtype=torch.float32)
            if init is True:
                nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
            elif init == "gaussian":
                nn.init.normal_(fresh, std=1 / layer.r[adapter], generator=generator)
            else:
                raise ValueError(
                    f"kl.reference_reset cannot restart adapters initialised with "
                    f"init_lora_weights={init!r}; klpo restarts the default (kaiming) or gaussian "
                    "initialisation"
                )
            a.copy_(fresh)
            b.zero_()
            merged += 1
    return merged


def base_weights(peft_model: nn.Module) -> dict[str, Tensor]:
    """The frozen base's tensors of a LoRA policy, adapters left out, by their names in
    ``peft_model.state_dict()``; tied tensors (an embedding shared with the head) appear once."""
    out, seen = {}, set()
    for name, t in peft_model.state_dict().items():
        if "lora_" in name:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().contiguous()
    return out


@torch.no_grad()
def load_base_weights(peft_model: nn.Module, tensors: dict[str, Tensor], source: str) -> None:
    """Copy ``tensors`` (saved by :func:`base_weights`) into the base of ``peft_model``.

    Raises:
        ValueError: the names differ from those of this model's base (``source`` is named).
    """
    want = base_weights(peft_model)
    if want.keys() != tensors.keys() or any(want[k].shape != tensors[k].shape for k in want):
        odd = sorted(set(want) ^ set(tensors))[:3] or "in shapes"
        raise ValueError(
            f"{source} does not hold the base weights of this LoRA policy (names differ, e.g. "
            f"{odd}); it was saved by a run of another model.policy or model.lora"
        )
    state = peft_model.state_dict()
    for name, t in tensors.items():
        state[name].copy_(t)
