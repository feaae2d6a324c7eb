"""``model``: the policy, the reference, the critic and their LoRA adapters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from klpo.train.config.common import Section


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA scale numerator: updates are alpha/r · BA.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input.")
    target_modules: list[str] | str = Field(
        "all-linear",
        description="Module names that get adapters (peft's target_modules); 'all-linear' is "
        "every linear layer but the output head.",
    )

    @field_validator("target_modules")
    @classmethod
    def _not_the_head(cls, v: list[str] | str) -> list[str] | str:
        names = [v] if isinstance(v, str) else v
        bad = [n for n in names if n in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(
                f"{bad[0]!r} cannot take an adapter: the log-probs and the exact KL read the "
                "output head's weight directly, and the reference shares it; list the "
                "attention/MLP projections (or 'all-linear') instead"
            )
        if not names:
            raise ValueError("must name at least one module, e.g. all-linear")
        return v


class ModelConfig(Section):
    policy: str = Field(
        "builtin",
        description="The policy to train: a local directory or model id of a transformers causal "
        "LM, a .gguf file (dequantised once into a cached float32 model, docs/real-models.md#gguf-files; "
        "also for model.reference, model.critic and a reward model's path), or 'builtin' for the "
        "shipped tiny arithmetic model.",
    )
    reference: str | None = Field(
        None, description="The frozen reference pi_ref; defaults to the policy's starting point."
    )
    critic: str | None = Field(
        None,
        description="PPO's critic backbone (a value head is added); defaults to the reference.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Compute dtype of the models' forward passes. bfloat16 is mixed precision: "
        "the parameters (the optimizer's master weights) stay float32 and every transformer "
        "forward runs under torch.autocast in bfloat16; the log-probs and KL are float32 "
        "(docs/real-models.md).",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in the backward pass "
        "(transformers' gradient checkpointing) instead of keeping them: less memory, ~1/3 more "
        "compute.",
    )
    lora: LoraConfig | None = Field(
        None,
        description="Train LoRA adapters (peft) instead of all weights; with no model.reference "
        "the reference is the same module with its adapters disabled.",
    )
    logits_path: Literal["fused", "model"] = Field(
        "fused",
        description="Where the log-probs, entropy and exact KL come from. fused: the last hidden "
        "states through the output head with the architecture's logit transform, tile by tile, "
        "never the [tokens, V] logits; checked against each model's own forward at load, and a "
        "model it does not match is refused. model: the models' own logits, for a model the "
        "fused head cannot give (slower; holds the [tokens, V] logits of the policy and the "
        "reference). docs/real-models.md.",
    )
