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
(:func:`klpo.train.export.export_run`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from klpo.train.models import Backbone

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


def load_adapters(model: nn.Module, adapter_dir: str | Path):
    """``model`` with the trainable adapters saved in ``adapter_dir`` (a checkpoint's policy/)."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds peft adapters rather than a whole model."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


class AdapterFreeReference(nn.Module):
    """pi_ref as the policy's own module with its LoRA adapters disabled.

    ``forward`` and ``head`` have :class:`klpo.train.models.Backbone`'s signatures. The forward
    runs under ``disable_adapter()``, which makes every adapted layer return its base ``W x``
    alone; the output head carries no adapter (``model.lora`` refuses ``lm_head``), so the head
    is the base model's. Used without gradient (scoring), its outputs equal those of a separately
    loaded base model (tests/train/test_lora.py checks this in float64).

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
    ) -> Tensor:
        peft_model = self.backbone.model
        # Dropout on the adapters' input is bypassed with them; the base layers have none.
        with torch.no_grad(), peft_model.disable_adapter():
            return self.backbone(
                input_ids, attention_mask, position_ids, prefix=prefix, group=group
            )

    def head(self) -> tuple[Tensor, Tensor | None]:
        return self.backbone.head()

    def parameters(self, recurse: bool = True):
        # completion_hidden asks for the device of the first parameter.
        return self.backbone.parameters(recurse)
