"""The trainer's one typed config: sections, defaults, validation, YAML and ``--set`` overrides.

Every field carries its help text. Unknown keys and bad values fail before any work starts, with
a message that names the key, what was given and what is allowed::

    cfg = load_config("configs/grpo.yaml", overrides=["kl.beta=0.02", "rollout.group_size=8"])

The resolved config is written beside every run's outputs (``config.yaml``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from klpo import control, registry
from klpo.registry import MODES, Placement
from klpo.train.algorithms import ALGORITHMS, POLICY_LOSSES, Algorithm, PolicyLoss
from klpo.train.rollout.choices import ENGINES, SAMPLERS
from klpo.train.runtime.trackers import TRACKERS
from klpo.train.spellings import FOREIGN_ESTIMATORS, FOREIGN_KEYS

Tracker = Literal[tuple(TRACKERS)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.runtime.trackers.TRACKERS`, as the config's type."""

Engine = Literal[tuple(ENGINES)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.rollout.choices.ENGINES`, as the config's type."""

Sampler = Literal[tuple(SAMPLERS)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.rollout.choices.SAMPLERS`, as the config's type."""


def table_row(table: Mapping[str, object]) -> WrapValidator:
    """A key whose ``Literal`` type is ``table``'s names, checked against the table as it is
    when a config is validated: a row added to the table after the config's module loaded
    (a user's own algorithm, policy loss or engine) is a choice at once, and the error for a name
    that is no row lists the rows of now, in a ``Literal``'s words."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str) and value in table:
            return value
        if isinstance(value, str) and table:
            names = [repr(n) for n in table]
            expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            )
        return handler(value)

    return WrapValidator(check)


LR_SCHEDULERS = (
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
"""The schedules of transformers' ``get_scheduler`` that follow the step count (not
``reduce_lr_on_plateau``, which follows a metric, nor ``greedy``)."""


def one_of(what: str, value: str, allowed: Sequence[str]) -> str:
    """``value`` if it is in ``allowed``, else a ValueError that names it and lists the choices."""
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
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


class ModelConfig(_Section):
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


RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
     "chat_template", "tools", "documents", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip
"""Arguments of ``apply_chat_template`` that ``data.chat_template_kwargs`` may not set."""


PLAIN_CHAT_STOP = ("\n", "\n\n", "\n\n\n")
r"""``rollout.stop`` of the built-in chat task as plain text (``data.chat: false``), unless given:
a newline ends the answer's line. Runs of newlines are listed too: a tokenizer may hold them as
tokens of their own (Gemma 3: ``"\n\n"`` is one token, id 108), and a stop string that is one
token of the tokenizer stops at that token only (:func:`klpo.train.models.tokens.stop_set`)."""


DataSource = Literal["builtin", "builtin-overopt", "builtin-chat-arith", "jsonl", "datasets"]


class DataConfig(_Section):
    source: DataSource = Field(
        "builtin",
        description="Where prompts come from: the built-in arithmetic task, the same task as the "
        "over-optimisation task (a proxy reward to train on, exact correctness as the gold "
        "reward; docs/overopt.md), the built-in chat task for an instruction-tuned model "
        "(arithmetic and word problems as chat messages, scored by the numeric reward; with "
        "data.chat=false, as plain text for a model without a chat template; "
        "docs/real-models.md), a JSONL file, or a datasets dataset (a local path, or a Hub "
        "id fetched by datasets; HF_HUB_OFFLINE=1 reads the local cache only). Every column "
        "of a row reaches TRL-form reward functions by name (docs/rewards.md).",
    )
    path: str | None = Field(
        None, description="The JSONL (or parquet) file, or the datasets name/path."
    )
    split: str = Field("train", description="datasets split to train on.")
    eval_split: str | None = Field(
        None, description="datasets split for held-out evaluation (default: none for datasets)."
    )
    eval_path: str | None = Field(None, description="JSONL file of held-out problems.")
    prompt_field: str = Field(
        "prompt",
        description="Field holding the prompt (text or chat messages); a dotted path reaches "
        "into a nested record.",
    )
    answer_field: str = Field(
        "answer",
        description="Field holding the reference answer; a dotted path reaches into a nested "
        "record (verl's reward_model.ground_truth). Optional where no reward reads it "
        "(docs/frameworks.md).",
    )
    eval_size: int = Field(500, ge=0, description="Held-out problems evaluated (greedy).")
    max_prompt_tokens: int = Field(
        256, gt=0, description="Longer prompts are an error naming the line or sample."
    )
    shuffle: bool = Field(True, description="Shuffle prompts each epoch over the data (seeded).")
    chat: bool = Field(
        False,
        description="Render each prompt (a string, or a list of {role, content} messages) with "
        "the tokenizer's chat template, ending with the assistant's generation prompt.",
    )
    system_prompt: str | None = Field(
        None, description="With chat: a system message put before each prompt's messages."
    )
    shots: Literal["one", "per-kind", "none"] = Field(
        "one",
        description="builtin-chat-arith: the solved examples before each question: one addition, "
        "one of each kind of problem, or none (docs/real-models.md).",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="With chat: extra variables the chat template reads, passed to "
        "apply_chat_template (e.g. {enable_thinking: false} for Qwen3); each must be a variable "
        "of the template.",
    )

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(
                f"{taken[0]!r} is set by klpo itself when it renders a prompt; give only the "
                "template's own variables (e.g. enable_thinking)"
            )
        return v

    @model_validator(mode="after")
    def _shots_need_chat_arith(self) -> DataConfig:
        if self.shots != "one" and self.source != "builtin-chat-arith":
            raise ValueError(
                f"shots is only read by data.source=builtin-chat-arith (source is "
                f"{self.source!r}); drop data.shots={self.shots!r} or set that source"
            )
        return self

    @model_validator(mode="after")
    def _kwargs_need_chat(self) -> DataConfig:
        if self.chat_template_kwargs and not self.chat:
            raise ValueError(
                "chat_template_kwargs is only used with data.chat=true; set both, or drop it"
            )
        return self


class RewardTerm(_Section):
    name: str = Field(
        description="A built-in reward ('exact_match', 'numeric', 'format', 'boxed'), 'model' (a reward model at path) or 'module:function' (a module in the working directory or an installed package; TRL's form fn(completions, **kwargs) or klpo's fn(prompts, completions, answers), docs/rewards.md)."
    )
    weight: float = Field(1.0, description="Weight of this reward in the sum.")
    path: str | None = Field(
        None,
        description="name 'model': the reward model's directory (a sequence classifier), or a "
        ".gguf file of one.",
    )

    @model_validator(mode="after")
    def _path_for_model(self) -> RewardTerm:
        if self.name == "model" and not self.path:
            raise ValueError(
                "the reward 'model' needs the reward model's directory: {name: model, path: DIR} "
                "(make a small one with 'klpo make-reward-model DIR')"
            )
        if self.name != "model" and self.path:
            raise ValueError(f"path is only used by the reward 'model', not by {self.name!r}")
        return self


class RolloutConfig(_Section):
    prompts_per_step: int = Field(16, gt=0, description="Distinct prompts per training step.")
    group_size: int = Field(8, gt=0, description="Completions sampled per prompt (GRPO's G).")
    max_new_tokens: int = Field(4, gt=0, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    sampler: Sampler = Field(
        "lean",
        description="How completions are sampled: "
        + " or ".join(f"`{name}` ({what})" for name, what in SAMPLERS.items())
        + ". Both sample softmax(logits / temperature) within the top-p nucleus.",
    )
    stop: list[int | str] = Field(
        default_factory=list,
        description="What else ends a completion, besides the tokenizer's EOS and the policy's "
        "generation_config.eos_token_id (always in the stop set): token ids, or strings of the "
        "decoded text (as generate's stop_strings; a string that is one added token, such as "
        "'<|im_end|>', is that token). The run's first lines print the whole set.",
    )
    share_prompt: bool = Field(
        True,
        description="Compute each prompt once per group in the reference, scoring and update "
        "passes (its keys/values repeated for the G completions); the same values and gradients.",
    )
    engine: Annotated[Engine, table_row(ENGINES)] = Field(
        "hf",
        description="What samples the completions: 'hf', the policy's own model (with "
        "rollout.sampler); or 'vllm', a vLLM engine that gets the policy's weights before each "
        "step and reports its log-probs (optional extra klpo[vllm]; see docs/engines.md).",
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="vllm, or rollout.staleness > 0: truncated importance sampling cap C; each "
        "token's policy loss is weighted by min(pi_old / pi_sampler, C), pi_sampler the engine's "
        "or the stale behaviour policy's (Yao et al. 2025; decoupled PPO). null: no correction "
        "(the gap is still logged as engine/* or sampler/*).",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO's dynamic sampling (group algorithms: grpo, rloo): drop the groups "
        "whose rewards are all equal (no advantage signal) and sample more prompts, "
        "rollout.prompts_per_step at a time, until the step has rollout.prompts_per_step groups "
        "or rollout.dynamic_sampling_max_rounds rounds were sampled; then train on the groups "
        "kept (metrics rollout/*). One process only.",
    )
    dynamic_sampling_max_rounds: int = Field(
        3,
        gt=0,
        description="rollout.dynamic_sampling: the most sampling rounds in one step (1: no "
        "extra sampling, only the dropping). Each round costs a rollout of "
        "rollout.prompts_per_step prompts and their rewards.",
    )
    staleness: int = Field(
        0,
        ge=0,
        description="How many policy versions the sampler runs behind the trainer (k): step t "
        "samples with the weights of version max(t - 1 - k, 0), t - 1 being the weights that "
        "start step t, kept in a ring of the last k versions (the trainable tensors, on the CPU; "
        "saved in the checkpoint). 0: the synchronous loop. The behaviour policy's log-probs "
        "then weight the policy loss (rollout.tis_cap) and the KL term "
        "(kl.behaviour_correction); metrics rollout/staleness and sampler/* (docs/async.md). "
        "With rollout.engine=vllm the engine is loaded with the sampling version each step "
        "and its log-probs weight the policy loss, the trainer's own at that version the KL.",
    )
    asynchronous: bool = Field(
        False,
        description="rollout.staleness > 0: sample in a rollout worker process (spawned, one "
        "torch thread, its own copy of the policy) up to rollout.staleness steps ahead of the "
        "update, with the weights pushed after each step, instead of in the trainer between "
        "steps; the same versions (each batch k behind after the first k steps; with "
        "rollout.async_weights=newest the newest pushed, 0 to k behind), each step "
        "seeded by (run.seed, step, rank); under torchrun one worker per rank, sampling that "
        "rank's share of the prompts (docs/async.md).",
    )
    async_weights: Literal["fixed", "newest"] = Field(
        "fixed",
        description="rollout.asynchronous: which version the worker samples a step with. "
        "'fixed': version t - 1 - k for step t, exactly k behind after the first k steps (the "
        "deterministic mode's batches, bit for bit; what the tests and studies use). 'newest': "
        "the newest version the trainer has pushed when the worker starts the step, never older "
        "than t - 1 - k (it waits for that one), so the lag is between 0 and k and depends on "
        "the timing of the two processes: such a run is not reproducible bit for bit; "
        "rollout/staleness logs each batch's lag (docs/async.md).",
    )
    async_workers: Literal["rank", "node"] = Field(
        "rank",
        description="rollout.asynchronous under torchrun: 'rank', a rollout worker per rank "
        "sampling that rank's share of the prompts; 'node', one worker per node, started by "
        "the node's first rank, sampling every share of the node's ranks (each with its rank's "
        "seed, so the batches are those of a worker per rank, bit for bit) and scattering them "
        "(one copy of the sampler's weights a node; with async_weights=newest the node's ranks "
        "sample each step with one version) (docs/async.md).",
    )
    vllm_memory: float = Field(
        0.3,
        gt=0,
        le=1,
        description="vllm on a GPU: the fraction of GPU memory the engine may take (weights "
        "and KV cache), beside the trainer's models.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v  # pydantic names the type
        bad = [e for e in v if not ((isinstance(e, str) and e) or (type(e) is int and e >= 0))]
        if bad:
            raise ValueError(
                f"{bad[0]!r} cannot end a completion: give token ids >= 0 or non-empty strings"
            )
        return v


class AlgoConfig(_Section):
    name: Annotated[Algorithm, table_row(ALGORITHMS)] = Field(
        "grpo", description="The policy-optimisation algorithm."
    )
    epochs: int = Field(1, gt=0, description="Passes over each batch of rollouts (PPO epochs).")
    minibatches: int = Field(1, gt=0, description="Optimizer steps per epoch.")
    micro_batch: int = Field(
        0, ge=0, description="Sequences per forward/backward (0: the whole minibatch)."
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Token budget of one forward/backward: a micro-batch holds at most this many "
        "(padded) tokens, prompt and completion, so long completions mean fewer sequences per "
        "pass (0: off). Combined with micro_batch, the smaller wins.",
    )
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Take the update's gradient in the forward pass (klpo.logprobs.fused_loss) "
        "where the loss's weights on each token are known before it: on-policy, with the exact "
        "KL or none in the loss, no engine weights. auto: from a vocabulary of 32768 entries "
        "(docs/performance.md); on: wherever it applies; off: never (the "
        "per-token path). The same gradients and metrics either way.",
    )
    skip_no_signal: bool = Field(
        True,
        description="Skip the optimizer steps of a step whose batch has no advantage signal "
        "(every advantage of every completion token exactly 0: with a group baseline, every "
        "group's rewards equal; with a critic, returns equal to the values) and whose KL term "
        "has nothing to pull back: no KL in the loss, or the policy at the reference (the step's "
        "exact KL(pi_old ‖ pi_ref) per token at most skip_kl_floor). So the policy does not move "
        "on rounding noise, while a KL in the loss keeps pulling a policy that has left the "
        "reference back on every step, as a KL in the reward does (metric step/skipped). The "
        "step's forward and backward passes still run; the learning-rate schedule still "
        "advances.",
    )
    skip_kl_floor: float = Field(
        1e-6,
        ge=0,
        description="skip_no_signal: the exact KL(pi_old ‖ pi_ref) per token (nats) above which "
        "the policy counts as off the reference, so that a step without advantage signal still "
        "takes the KL term's gradient in the loss (exactly 0 at the reference itself).",
    )
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below: 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above (DAPO clip-higher).")
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c > 1 for negative advantages (off if null)."
    )
    std: Literal["sample", "population", "none"] = Field(
        "sample", description="Group advantage scale: sample or population std, or none (Dr. GRPO)."
    )
    loss_reduction: str = Field(
        "token-mean",
        description=f"How per-token losses are reduced: one of {', '.join(MODES)}.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount (PPO, REINFORCE++).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (PPO).")
    vf_coef: float = Field(0.5, ge=0, description="Value-loss weight (PPO).")
    value_clip: float | None = Field(0.2, gt=0, description="Value clip range (PPO; null: off).")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (0: off).")
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        description="The weight of a mixture-of-experts policy's router load-balancing loss "
        "(transformers' own, Switch Transformers' E·sum f·P; logged as loss/router_aux). null: as "
        "the model's own forward does, its config's router_aux_loss_coef where its config sets "
        "output_router_logits, else off (released Mixtral and Qwen3-MoE configs: off; verl turns "
        "it off, OpenRLHF's aux_loss_coef defaults to 0; TRL's GRPOTrainer adds the config's "
        "coefficient). A value > "
        "0 turns it on; on a model without router logits it is refused. docs/real-models.md.",
    )
    policy_loss: Annotated[PolicyLoss, table_row(POLICY_LOSSES)] = Field(
        "clip",
        description="PPO's clipped surrogate; its adaptive-KL-penalty surrogate "
        "ratio·A - beta_old·KL(pi_old ‖ pi_theta) (Schulman et al. 2017, eq. 8); GSPO's "
        "sequence-level clip of the length-normalised ratio (Zheng et al. 2025; ranges "
        "gspo_clip_low/high); CISPO's clipped stop-gradient weight on log pi (MiniMax 2025; "
        "weight capped at 1 + clip_high, no lower bound); DPPO's binary-TV or binary-KL mask "
        "instead of the ratio clip, anchored to pi_old, with the weight sg(min(ratio, 20)) on "
        "log pi (dppo-tv, dppo-kl; Qi et al. 2026; thresholds dppo_delta_low/high); or "
        "prime-rl's default, dppo-tv plus sampler_k2_coef·(log pi_theta - log pi_behav)², a k2 "
        "penalty toward the sampling policy, its mask and weight anchored to the sampler "
        "(dppo-tv-k2; dppo_anchor); or M2PO's unclipped ratio surrogate on "
        "the tokens its batch mask keeps, the mask dropping the tokens of largest (log pi_old - "
        "log pi_behav)² over the optimizer step until the rest's mean is below m2po_threshold "
        "(m2po; Zheng, Zhao & Chen 2025; pi_behav the stale sampler's or the engine's, else "
        "pi_old). Trust Region Masking's sequence mask (trm_delta) applies on top of any of "
        "them. klpo.offpolicy; docs/async.md.",
    )
    gspo_clip_low: float = Field(
        3e-4, ge=0, lt=1, description="gspo: sequence-ratio clip below, 1 - gspo_clip_low."
    )
    gspo_clip_high: float = Field(
        4e-4, ge=0, description="gspo: sequence-ratio clip above, 1 + gspo_clip_high."
    )
    dppo_delta_low: float = Field(
        0.2,
        ge=0,
        description="dppo-*: the divergence threshold for tokens with A <= 0 (binary TV |p - "
        "p_old| or binary KL; verl's clip_ratio_low under dppo_tv/dppo_kl).",
    )
    dppo_delta_high: float = Field(
        0.2, ge=0, description="dppo-*: the divergence threshold for tokens with A > 0."
    )
    sampler_k2_coef: float = Field(
        1e-3,
        ge=0,
        description="dppo-tv-k2: the coefficient of (log pi_theta - log pi_anchor)² per token "
        "(prime-rl's kl_tau, default 1e-3; the anchor: dppo_anchor).",
    )
    dppo_anchor: Literal["old", "sampler"] | None = Field(
        None,
        description="dppo-*: the policy the mask, the weight and the k2 term are anchored to: "
        "old, the trainer's pi_old (verl's dppo_tv/dppo_kl), with the TIS weight of "
        "rollout.tis_cap on top; or sampler, the behaviour policy that sampled the tokens (the "
        "stale sampler's or the engine's log-probs; prime-rl, which has no pi_old), whose ratio "
        "pi_theta/pi_behav is then the importance weight itself (no TIS weight on top). Where no "
        "behaviour policy is apart from pi_old the two are the same. null: sampler for "
        "dppo-tv-k2, old for dppo-tv and dppo-kl.",
    )
    m2po_threshold: float = Field(
        0.04,
        gt=0,
        description="m2po: tau_M2, the mean (log pi_old - log pi_behav)² the kept tokens of an "
        "optimizer step stay below (the paper's 0.04).",
    )
    trm_delta: float | None = Field(
        None,
        ge=0,
        description="Trust Region Masking (Li et al. 2025, arXiv:2512.23075): the radius of "
        "a sequence mask on the policy loss, which drops every token of a completion whose "
        "token divergence between pi_old and pi_behav (trm_statistic, over the completion by "
        "trm_aggregate) exceeds it; null: off. Combines with any policy_loss (with m2po, both "
        "masks apply). It needs a behaviour policy: rollout.staleness > 0 (the stale "
        "sampler's log-probs) or rollout.engine=vllm (the engine's). Only the policy loss is "
        "masked (its TIS weight included), not the KL term or the entropy bonus, and the "
        "masked tokens still count in the loss's normaliser. Metrics trm/*; docs/async.md.",
    )
    trm_statistic: Literal["k1", "k3", "exact"] = Field(
        "k3",
        description="trm_delta: the token divergence, with rho = pi_old(y_t) / pi_behav(y_t): "
        "k1, -log rho (its absolute value under the max), or k3, rho - 1 - log rho (>= 0), "
        "both estimates of KL(pi_behav ‖ pi_old) at the token; or exact, that KL summed over "
        "the vocabulary at the position (the behaviour pass's, rollout.staleness > 0 only: an "
        "engine reports no logits).",
    )
    trm_aggregate: Literal["max", "mean"] = Field(
        "max",
        description="trm_delta: the completion's statistic, the largest token divergence "
        "(the paper's D_tok,max) or their mean over its tokens (verl's seq_mean_k1/k3; for k1 "
        "the absolute value of the mean).",
    )
    penalty_beta: float = Field(1.0, ge=0, description="kl-penalty: initial beta_old.")
    penalty_target: float | None = Field(
        None, gt=0, description="kl-penalty: target KL(pi_old ‖ pi_theta) of PPO's adaptive rule."
    )

    @field_validator("loss_reduction")
    @classmethod
    def _known_reduction(cls, v: str) -> str:
        return one_of("reduction", v, MODES)

    @field_validator("fused_loss", mode="before")
    @classmethod
    def _switch_words(cls, v: object) -> object:
        """YAML reads an unquoted ``on`` / ``off`` as true / false: take them as the words."""
        return ("on" if v else "off") if isinstance(v, bool) else v


class ReferenceReset(_Section):
    every: int = Field(0, ge=0, description="Update the reference every N steps (0: not by count).")
    kl_above: float | None = Field(
        None, gt=0, description="Update it when the exact per-token KL exceeds this (null: off)."
    )
    alpha: float = Field(
        1.0,
        gt=0,
        le=1,
        description="ref <- alpha·policy + (1 - alpha)·ref: 1 is a hard reset (ProRL; with "
        "model.lora a merge of the adapters into the base and fresh adapters), < 1 a soft "
        "update (TR-DPO; not with model.lora).",
    )
    reset_optimizer: bool = Field(
        False,
        description="Also clear the policy optimizer's state at each update (ProRL); with "
        "model.lora it is always cleared (the adapters restart).",
    )

    @model_validator(mode="after")
    def _some_trigger(self) -> ReferenceReset:
        if not self.every and self.kl_above is None:
            raise ValueError(
                "kl.reference_reset needs a trigger: every (steps) and/or kl_above (exact KL)"
            )
        return self


class KLConfig(_Section):
    estimator: str = Field(
        "full",
        description=f"KL estimator: a per-token one ({', '.join(registry.ESTIMATORS)}) or one that also "
        f"samples completions from the reference ({', '.join(registry.REF_SAMPLED)}; loss only).",
    )
    placement: Placement = Field(
        "loss",
        description="Where the KL term goes: loss, reward, reward+loss, or none (only measured).",
    )
    beta: float = Field(0.1, ge=0, description="Initial KL coefficient.")
    controller: str = Field(
        "fixed", description=f"KL coefficient controller: one of {', '.join(control.CONTROLLERS)}."
    )
    target: float | None = Field(
        None, gt=0, description="Target KL for adaptive controllers, in kl.target_unit."
    )
    target_unit: Literal["token", "sequence"] = Field(
        "token",
        description="What kl.target measures: the exact KL(pi_theta ‖ pi_ref) per token "
        "(kl/ref/exact) or summed over a completion, mean over completions (kl/ref/seq).",
    )
    horizon: float = Field(10000, gt=0, description="Ziegler controller horizon (in samples).")
    scale: float = Field(
        0.5, gt=0, description="spread-scaled controller: the group reward std that halves beta."
    )
    off_policy_correction: bool = Field(
        True,
        description="KL in the loss after the first minibatch (epochs or minibatches > 1): "
        "weight each token's estimator term by sg(pi_theta/pi_old), which keeps its on-policy "
        "expected gradient (klpo.losses.kl_loss). false: the uncorrected term, as most trainers "
        "compute it (for comparison; k3_is carries its own weight and refuses it).",
    )
    behaviour_correction: Literal["none", "is", "is-cap"] = Field(
        "is",
        description="rollout.staleness > 0: how the KL in the loss corrects for tokens sampled "
        "by the stale behaviour policy pi_behav. 'is': weight each token's estimator term by "
        "sg(pi_theta/pi_behav) (k3_is takes pi_behav as its logp_old), which keeps its on-policy "
        "expected gradient per token; 'is-cap': the weight capped at kl.behaviour_cap "
        "(OpenRLHF's); 'none': the trainer's pi_old as without staleness (weight 1 at the first "
        "update: biased by the lag). `klpo explain --staleness K` gives each one's exact bias.",
    )
    behaviour_cap: float = Field(
        10.0,
        gt=0,
        description="kl.behaviour_correction=is-cap: the cap C of the weight min(pi_theta / "
        "pi_behav, C) (OpenRLHF's 10).",
    )
    reference_reset: ReferenceReset | None = Field(
        None,
        description="Move the reference to the policy during training: {every, kl_above, alpha, "
        "reset_optimizer} (null: a frozen reference).",
    )

    ref_samples: int | None = Field(
        None,
        gt=0,
        description="ref_is, adaptive_mix: completions sampled from the reference per prompt "
        "each step, the extra cost (null: rollout.group_size, as many as the policy samples).",
    )
    ref_is_clip: tuple[float, float] | None = Field(
        None,
        description="ref_is (and adaptive_mix's ref_is part): clamp the importance weight to [lo, hi], e.g. [0.1, 10] (biased; "
        "null: off).",
    )
    ref_is_dynamic_clip: bool = Field(
        False,
        description="ref_is, adaptive_mix: clamp the weights to the batch's mean ± 3 sd (biased).",
    )
    ref_is_self_normalised: bool = Field(
        False,
        description="ref_is, adaptive_mix: divide by the sum of the weights instead of n (biased).",
    )
    mix_gamma: float = Field(
        30.0,
        gt=0,
        description="adaptive_mix: slope of a = sigmoid(±gamma (KL_window - threshold)).",
    )
    mix_threshold: float = Field(
        0.1,
        description="adaptive_mix: the KL per token (nats) at which a = 1/2. The source gives no "
        "values; 0.1 and gamma 30 make a swing across the built-in task's range (0 to ~0.3).",
    )
    mix_window: int = Field(
        10, gt=0, description="adaptive_mix: steps of its own past output that KL_window averages."
    )
    mix_sign: Literal["as-written", "as-described"] = Field(
        "as-written",
        description="adaptive_mix: 'as-written' (+gamma: the weight a on k1 grows with the KL, as "
        "the formula reads) or 'as-described' (-gamma: more k1 while the KL is small, as its "
        "prose says).",
    )

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        if v in FOREIGN_ESTIMATORS and v not in registry.ESTIMATORS:
            mine, note = FOREIGN_ESTIMATORS[v]
            raise ValueError(f"unknown estimator {v!r}: did you mean {mine!r}? ({note})")
        return one_of("estimator", v, tuple(registry.SPECS))

    @field_validator("ref_is_clip")
    @classmethod
    def _clip_range(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not (0.0 <= v[0] < v[1]):
            raise ValueError("must be [lo, hi] with 0 <= lo < hi, e.g. [0.1, 10]")
        return v

    @field_validator("controller")
    @classmethod
    def _known_controller(cls, v: str) -> str:
        return one_of("controller", v, control.CONTROLLERS)


class OptimConfig(_Section):
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate of the policy.")
    critic_lr: float | None = Field(None, gt=0, description="Critic learning rate (default: lr).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float | None = Field(1.0, gt=0, description="Global gradient-norm clip (null: off).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in steps.")
    lr_scheduler: str = Field(
        "constant_with_warmup",
        description="The policy's learning-rate schedule, by transformers' scheduler factory "
        f"(get_scheduler): {', '.join(LR_SCHEDULERS)}. Step s runs at optim.lr · lambda(s), "
        "with optim.warmup_steps of linear warm-up and run.steps as the training length; the "
        "default is a warm-up to optim.lr, then constant.",
    )
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of the schedule (get_scheduler's "
        "scheduler_specific_kwargs), e.g. {min_lr_rate: 0.1} for cosine_with_min_lr, "
        "{num_cycles: 2} for cosine_with_restarts.",
    )

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, v: str) -> str:
        return one_of("optim.lr_scheduler", v, LR_SCHEDULERS)

    @field_validator("betas")
    @classmethod
    def _decay_rates(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(
                f"each must be in [0, 1) (AdamW's decay rates of its moment averages), got "
                f"[{v[0]:g}, {v[1]:g}]; e.g. [0.9, 0.999]"
            )
        return v


class RunConfig(_Section):
    steps: int = Field(1500, gt=0, description="Training steps (one batch of rollouts each).")
    seed: int = Field(0, description="Seed of everything: data order, sampling, init.")
    out_dir: str = Field(
        "runs/train",
        description="Run directory: metrics, checkpoints, report. New or empty, or a run to "
        "continue with --resume; anything else is refused (see Output directories below).",
    )
    eval_every: int = Field(250, ge=0, description="Held-out evaluation period in steps (0: off).")
    save_every: int = Field(
        500, ge=0, description="Checkpoint period in steps (0: only at the end)."
    )
    threads: int = Field(
        0,
        ge=0,
        description="torch threads per process (0: the cores free at the start, shared between the processes; one line says so when the machine is loaded).",
    )
    time_limit: float | None = Field(
        None, gt=0, description="Stop cleanly after this many seconds of training."
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files when run.report_to lists tensorboard."
    )
    progress: bool = Field(True, description="Show a progress bar on the terminal.")
    report_to: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where the metrics also go, besides metrics.jsonl: any of tensorboard, "
        "wandb (extra klpo[wandb]; WANDB_PROJECT, WANDB_MODE, ...), mlflow (extra "
        "klpo[mlflow]; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), each through its own "
        "library (docs/tracking.md).",
    )
    run_name: str | None = Field(
        None, description="The run's name in the trackers (default: run.out_dir's last part)."
    )
    log_samples: int = Field(
        4,
        ge=0,
        description="Completions written to samples.jsonl (and the trackers, and report.md) "
        "each time: a step's, spread over its prompts, the first held-out problems at an "
        "evaluation (0: none).",
    )
    log_samples_every: int = Field(
        50,
        ge=0,
        description="Write a step's completions every N steps and at the last (0: only at "
        "evaluations); held-out completions are written at every evaluation.",
    )
    eval_cache: str | None = Field(
        None,
        description="Directory of a cache of the starting policy's held-out evaluation (step 0), "
        "keyed by a hash of all it depends on: the weights, the prompts' tokens, the decoding, "
        "the scoring reward's source, the versions. Runs that start from the same weights (a "
        "LoRA study's, whatever their seed, beta or KL choice) evaluate once; klpo compare "
        "sets it to OUT/eval-cache. The files are the run's own format; delete the directory "
        "to recompute.",
    )
    save_total_limit: int | None = Field(
        2,
        ge=1,
        description="Checkpoints kept: the newest N complete ones (the one a resume starts "
        "from is the newest); older ones are deleted after each save (null: keep all).",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _trl_string(cls, v: Any) -> Any:
        """TRL's ``report_to`` is also a string: ``"none"`` (no tracker) or one tracker's name."""
        if isinstance(v, str):
            return [] if v.strip().lower() == "none" else [v.strip()]
        return v

    @field_validator("out_dir")
    @classmethod
    def _a_directory(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                "is empty, which would write the run into the current directory; give the "
                "run a directory of its own, e.g. run.out_dir=runs/train-1"
            )
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _a_list_of_trackers(cls, v: Any) -> Any:
        # A single name as a string (transformers' report_to="wandb"); none: metrics.jsonl only.
        if isinstance(v, str):
            return [] if v.strip().lower() in ("none", "") else [v.strip()]
        return v


class DistConfig(_Section):
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How torchrun's processes share the models: ddp replicates them; fsdp "
        "shards parameters, gradients and optimizer state over all processes (FSDP2 "
        "fully_shard), the reference too.",
    )


class TrainConfig(_Section):
    """Everything `klpo train` needs. Sections: model, data, rewards, rollout, algo, kl, optim, run, dist."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    rewards: list[RewardTerm] = Field(
        default_factory=lambda: [RewardTerm(name="exact_match")],
        description="Reward functions, weighted and summed.",
    )
    gold_reward: str | None = Field(
        None,
        description="A reward logged every step as reward/gold (with the trained-on total as "
        "reward/proxy) and never trained on; held-out accuracy uses it. Defaults to "
        "'exact_match' with data.source=builtin-overopt.",
    )
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    kl: KLConfig = KLConfig()
    optim: OptimConfig = OptimConfig()
    run: RunConfig = RunConfig()
    dist: DistConfig = DistConfig()

    @model_validator(mode="before")
    @classmethod
    def _overopt_defaults(cls, data: Any) -> Any:
        """builtin-overopt: the proxy reward, the gold reward and room to write past the answer,
        each unless given (docs/overopt.md). builtin-chat-arith: chat rendering and the numeric
        reward, unless given, and with data.chat=false (plain-text prompts) a completion that
        stops at its first newline (:data:`PLAIN_CHAT_STOP`; docs/real-models.md)."""
        if not isinstance(data, dict):
            return data
        d = data.get("data")
        source = d.get("source") if isinstance(d, dict) else getattr(d, "source", None)
        if source == "builtin-chat-arith":
            data = dict(data)
            data.setdefault("rewards", [{"name": "numeric"}])
            if isinstance(d, dict) and "chat" not in d:
                data["data"] = {**d, "chat": True}
            rollout = data.get("rollout")
            plain = isinstance(d, dict) and d.get("chat") is False
            if plain and (rollout is None or (isinstance(rollout, dict) and "stop" not in rollout)):
                # plain text: the answer's line ends the completion, before the next question
                data["rollout"] = {**(rollout or {}), "stop": list(PLAIN_CHAT_STOP)}
            return data
        if source != "builtin-overopt":
            return data
        data = dict(data)
        data.setdefault("rewards", [{"name": "overopt_proxy"}])
        data.setdefault("gold_reward", "exact_match")
        rollout = data.get("rollout")
        if rollout is None or (isinstance(rollout, dict) and "max_new_tokens" not in rollout):
            data["rollout"] = {**(rollout or {}), "max_new_tokens": 8}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if ALGORITHMS[self.algo.name].group and self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size must be >= 2 for {self.algo.name} (group-relative "
                f"advantages need several completions per prompt), got {self.rollout.group_size}"
            )
        if self.rollout.dynamic_sampling and not ALGORITHMS[self.algo.name].group:
            groups = ", ".join(n for n, spec in ALGORITHMS.items() if spec.group)
            raise ValueError(
                f"rollout.dynamic_sampling drops groups of equal rewards, but {self.algo.name} "
                f"has no group baseline (its advantages are not zero on such a group); use a "
                f"group algorithm ({groups}) or set rollout.dynamic_sampling=false"
            )
        if self.kl.controller in ("adaptive", "ppo-adaptive") and self.kl.target is None:
            raise ValueError(
                f"kl.target is required by the {self.kl.controller!r} controller "
                "(the KL it steers towards, per kl.target_unit), e.g. kl.target=0.05"
            )
        if self.kl.reference_reset is not None and self.model.reference is not None:
            raise ValueError(
                "kl.reference_reset moves the reference towards the policy, so the two must be "
                "the same model: leave model.reference unset"
            )
        reset = self.kl.reference_reset
        if reset is not None and self.model.lora is not None and reset.alpha < 1:
            raise ValueError(
                f"kl.reference_reset.alpha={reset.alpha:g} with model.lora: a soft update "
                "ref <- alpha·policy + (1 - alpha)·ref has no adapter-only form (with LoRA the "
                "reference is the base model, and a hard reset merges the adapters into it, "
                "docs/overopt.md); use kl.reference_reset.alpha=1, or full fine-tuning "
                "(model.lora unset) for a soft update"
            )
        if self.kl.reference_reset is not None and self.dist.strategy == "fsdp":
            raise ValueError(
                "kl.reference_reset with dist.strategy=fsdp is not supported yet (the update of "
                "a sharded reference is untested); use dist.strategy=ddp"
            )
        if (
            not self.kl.off_policy_correction
            and registry.SPECS[self.kl.estimator].off_policy == "carried"
        ):
            raise ValueError(
                f"kl.off_policy_correction=false with kl.estimator={self.kl.estimator}: it "
                "carries its own weight pi_theta/pi_old with the gradient through the weight "
                "(k3_is is k3 so weighted), so it has no uncorrected form; use kl.estimator=k3 "
                "for the uncorrected term"
            )
        self._check_staleness()
        self._check_trm()
        self._check_dppo_anchor()
        reason = registry.refusal(self.kl.estimator, self.kl.placement)
        if self.kl.placement != "none" and reason is not None:
            raise ValueError(
                f"kl.estimator={self.kl.estimator} with kl.placement={self.kl.placement}: {reason}"
            )
        if self.data.source in ("jsonl", "datasets") and not self.data.path:
            raise ValueError(f"data.path is required when data.source is {self.data.source!r}")
        if not self.rewards:
            raise ValueError("rewards must list at least one reward function")
        if self.dist.strategy == "fsdp" and ALGORITHMS[self.algo.name].critic:
            free = ", ".join(n for n, spec in ALGORITHMS.items() if not spec.critic)
            raise ValueError(
                "dist.strategy=fsdp does not shard PPO's critic yet; use dist.strategy=ddp for "
                f"{self.algo.name}, or a critic-free algorithm ({free}) with fsdp"
            )
        ref_sampled = self.kl.estimator in registry.REF_SAMPLED and self.kl.placement != "none"
        if ref_sampled and (self.dist.strategy == "fsdp" or self.model.lora is not None):
            raise ValueError(
                f"kl.estimator={self.kl.estimator} samples completions from the reference, which "
                "is not supported yet with dist.strategy=fsdp or model.lora; use another "
                "estimator there, or ddp without LoRA for this one"
            )
        if self.dist.strategy == "fsdp" and self.model.lora is not None:
            raise ValueError(
                "model.lora with dist.strategy=fsdp is not supported yet (LoRA's frozen base "
                "and adapter-free reference are not sharded); use dist.strategy=ddp with LoRA"
            )
        return self

    def _check_dppo_anchor(self) -> None:
        """``algo.dppo_anchor`` belongs to the DPPO losses."""
        anchor, loss = self.algo.dppo_anchor, self.algo.policy_loss
        if anchor is not None and not loss.startswith("dppo"):
            raise ValueError(
                f"algo.dppo_anchor={anchor} anchors a DPPO loss, but algo.policy_loss={loss}; "
                "set algo.policy_loss to dppo-tv, dppo-kl or dppo-tv-k2, or algo.dppo_anchor=null"
            )

    def _check_trm(self) -> None:
        """Trust Region Masking needs a behaviour policy other than pi_old."""
        delta = self.algo.trm_delta
        if delta is not None and self.rollout.staleness == 0 and self.rollout.engine == "hf":
            raise ValueError(
                f"algo.trm_delta={delta:g} masks the completions whose divergence between pi_old "
                "and the behaviour policy that sampled them exceeds it, but this run has no "
                "behaviour policy apart from pi_old (rollout.staleness=0 with "
                "rollout.engine=hf: every completion would be kept); set rollout.staleness >= 1 "
                "or rollout.engine=vllm, or algo.trm_delta=null"
            )
        if delta is not None and self.algo.trm_statistic == "exact" and not self.rollout.staleness:
            raise ValueError(
                "algo.trm_statistic=exact reads the exact KL(pi_behav ‖ pi_old) of the stale "
                "sampler's behaviour pass, but this run has rollout.staleness=0 (an engine "
                "reports log-probs, not logits); set rollout.staleness >= 1, or "
                "algo.trm_statistic=k3 (or k1)"
            )

    def _check_staleness(self) -> None:
        """What a sampler that runs behind (``rollout.staleness`` > 0) cannot be combined with yet."""
        k = self.rollout.staleness
        if self.rollout.async_workers != "rank" and not self.rollout.asynchronous:
            raise ValueError(
                f"rollout.async_workers={self.rollout.async_workers} places the rollout "
                "workers, but rollout.asynchronous is false (the trainer samples in its own "
                "process); set rollout.asynchronous=true, or rollout.async_workers=rank"
            )
        if self.rollout.async_weights != "fixed" and not self.rollout.asynchronous:
            raise ValueError(
                f"rollout.async_weights={self.rollout.async_weights} picks the weights in the "
                "rollout worker, but rollout.asynchronous is false (the trainer samples with "
                "version t - 1 - k); set rollout.asynchronous=true, or rollout.async_weights=fixed"
            )
        if k == 0:
            if self.rollout.asynchronous:
                raise ValueError(
                    "rollout.asynchronous samples ahead of the update, so its batches are "
                    "rollout.staleness versions old: set rollout.staleness >= 1 (e.g. 1)"
                )
            return
        if self.rollout.asynchronous and self.rollout.engine != "hf":
            raise ValueError(
                f"rollout.asynchronous with rollout.engine={self.rollout.engine} is not supported "
                "yet (the rollout worker samples with an hf engine of its own); set "
                "rollout.asynchronous=false (the trainer's engine then samples "
                f"{k} versions behind, docs/async.md), or rollout.engine=hf"
            )
        merges = self.model.lora is not None and self.model.reference is None
        if self.rollout.asynchronous and self.kl.reference_reset is not None and merges:
            raise ValueError(
                "rollout.asynchronous with kl.reference_reset on a LoRA policy is not supported "
                "yet (the reset merges the adapters into the base weights, which the rollout "
                "worker holds a copy of); set rollout.asynchronous=false (the ring restarts "
                "at each reset, docs/async.md), or train without LoRA"
            )
        if self.rollout.asynchronous and self.rollout.dynamic_sampling:
            raise ValueError(
                "rollout.asynchronous with rollout.dynamic_sampling is not supported yet (the "
                "rollout worker samples one round of prompts per step, ahead of the rewards "
                "that decide whether another round is needed); set rollout.asynchronous=false "
                f"(the trainer then samples every round {k} versions behind, docs/async.md), "
                "or rollout.dynamic_sampling=false"
            )
        if self.rollout.asynchronous and self.dist.strategy == "fsdp":
            raise ValueError(
                "rollout.asynchronous with dist.strategy=fsdp is not supported yet (the rollout "
                "worker holds a whole copy of the policy, pushed from the trainer, which holds "
                "shards); set rollout.asynchronous=false (the trainer then samples "
                f"{k} versions behind with its own shards, docs/async.md), or dist.strategy=ddp"
            )
        if not self.kl.off_policy_correction and self.kl.behaviour_correction != "none":
            raise ValueError(
                f"kl.off_policy_correction=false with rollout.staleness={k} and "
                f"kl.behaviour_correction={self.kl.behaviour_correction}: the uncorrected KL "
                "term of a stale batch is kl.behaviour_correction=none; set that, or "
                "kl.off_policy_correction=true"
            )


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the fix."""


def _allowed_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _section_model(path: tuple[str | int, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = TrainConfig
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        candidates = [ann, *get_args(ann)]
        for c in candidates:
            inner = get_args(c) or (c,)
            for i in inner:
                if isinstance(i, type) and issubclass(i, BaseModel):
                    model = i
                    break
            else:
                continue
            break
        else:
            return None
    return model


def key_paths(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every key of the config as ``section.key`` (sub-sections' keys too: ``model.lora.r``;
    a list of sections as ``rewards[].name``)."""
    out = []
    for name, f in model.model_fields.items():
        out.append(f"{prefix}{name}")
        for sub, listed in _sub_models(f.annotation):
            out += key_paths(sub, f"{prefix}{name}[]." if listed else f"{prefix}{name}.")
    return list(dict.fromkeys(out))


def _sub_models(annotation: Any, listed: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The sections inside a key's type (through ``| None`` and ``list[...]``), each with
    whether it sits in a list."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, listed)]
    inner = listed or get_origin(annotation) is list
    return [m for arg in get_args(annotation) for m in _sub_models(arg, inner)]


def _guess_key(loc: tuple[str | int, ...], allowed: list[str]) -> str | None:
    """What an unknown key was meant to be: TRL's or verl's name for a klpo key
    (:data:`FOREIGN_KEYS`: ``num_generations``: ``rollout.group_size``), the same name in
    another section (``lr`` or ``kl.lr``: ``optim.lr``), else a close name in its own section
    (``kl.betta``: ``beta``), else a close full path (``optim.lerning_rate``...)."""
    name = str(loc[-1])
    if name in FOREIGN_KEYS:
        return FOREIGN_KEYS[name][0]
    paths = [p for p in key_paths() if "[]" not in p]
    elsewhere = [p for p in paths if p.rsplit(".", 1)[-1] == name and "." in p]
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(name, allowed, n=1)
    if close:
        return close[0]
    dotted = ".".join(str(p) for p in loc if not isinstance(p, int))
    tails = {p.rsplit(".", 1)[-1]: p for p in paths if "." in p}
    near = difflib.get_close_matches(name, list(tails), n=1, cutoff=0.8)
    return tails[near[0]] if near and tails[near[0]] != dotted else None


def _format_errors(err: ValidationError, source_of: Callable[..., str | None] | None = None) -> str:
    """One line per error, naming the key; ``source_of(loc, msg)``, if given, says which file or
    ``--set`` gave the key (:mod:`klpo.train.config_files`)."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "(top level)"
        src = source_of(loc, e["msg"]) if source_of is not None else None
        if src and loc and e["type"] != "extra_forbidden":
            key = f"{key} (from {src})"
        if e["type"] == "extra_forbidden":
            parent = _section_model(loc[:-1])
            allowed = _allowed_keys(parent) if parent else []
            guess = _guess_key(loc, allowed)
            whose = FOREIGN_KEYS.get(str(loc[-1]), (None, None))[1]
            hint = f" (did you mean {guess!r}?)" if guess else ""
            hint = f" (did you mean {guess!r}? {loc[-1]} is {whose}'s name)" if whose else hint
            where = ".".join(str(p) for p in loc[:-1]) or "the top level"
            given = f" in {src}" if src else ""
            lines.append(
                f"unknown key {key!r}{given}{hint}; allowed keys in {where}: {', '.join(allowed)}"
            )
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            lines.append(f"{key}: got {e.get('input')!r}; allowed: {expected}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            given = e.get("input")
            shown = "" if isinstance(given, dict | list) else f" (got {given!r})"
            lines.append(f"{key}: {msg}{shown}" if loc else msg + (f" ({src})" if src else ""))
    return "bad config:\n  " + "\n  ".join(lines)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=c"`` → (["a", "b"], value); the value is parsed as YAML (numbers, null, lists)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value, e.g. kl.beta=0.02")
    key, _, raw = text.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({exc})") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each ``a.b=c`` into the nested dict ``data`` (creating sections as needed)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {p!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def build_config(
    data: dict[str, Any] | None = None, overrides: list[str] | None = None
) -> TrainConfig:
    """Validate a nested dict (plus overrides) into a :class:`TrainConfig`, or raise ConfigError."""
    merged = apply_overrides(dict(data or {}), list(overrides or []))
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a mapping naming one key twice.

    The YAML spec requires the keys of a mapping to be unique (YAML 1.2, section 3.2.1.1); PyYAML
    keeps the last value silently, so a config with two ``kl:`` sections would lose the first.
    """


def _unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False):
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *base" merges, and may override
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, Hashable):
            continue  # construct_mapping says why such a key cannot be
        if key in first:
            raise DuplicateKeyError(key, first[key], line)
        first[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping names the same key twice (lines ``first`` and ``again``)."""

    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(f"{key!r} appears twice, at lines {first} and {again}")
        self.key, self.first, self.again = key, first, again


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML, refusing a key given twice in one mapping (ConfigError naming
    ``source``, the key and both lines); other YAML errors propagate."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: plain data only
    except DuplicateKeyError as err:
        raise ConfigError(
            f"{source}: {err.key!r} appears twice in one mapping, at lines {err.first} and "
            f"{err.again}; YAML keeps only the last, so the first would be silently dropped. "
            f"Merge them into one {err.key!r}"
        ) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping of sections a YAML config file holds (``{}`` for an empty file), or a
    ConfigError naming the file: missing, not UTF-8, not YAML, a key twice, not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = load_yaml(p.read_text(encoding="utf-8"), f"config file {str(p)!r}")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {str(p)!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
            f"at offset {exc.start}); save it as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    return loaded or {}


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config (or the defaults when ``path`` is None) and apply ``--set`` overrides.
    Several files, merged in order: :func:`klpo.train.config_files.load_configs`."""
    return build_config(read_config_file(path) if path is not None else {}, overrides)


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML, sections in their natural order."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def flat(cfg: TrainConfig) -> dict[str, Any]:
    """The config as ``{"section.key": value}`` (lists and mappings kept whole)."""
    out: dict[str, Any] = {}
    for section, values in cfg.model_dump(mode="json").items():
        if isinstance(values, dict):
            for k, v in values.items():
                out[f"{section}.{k}"] = v
        else:
            out[section] = values
    return out
