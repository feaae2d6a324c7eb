"""``rollout``: how completions are sampled (engine, sampler, staleness, dynamic sampling)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from klpo.train.choices import ENGINES, SAMPLERS
from klpo.train.config.common import EXPERIMENTAL, Engine, Sampler, Section, table_row


class RolloutConfig(Section):
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
        "and its log-probs weight the policy loss, the trainer's own at that version the KL."
        + EXPERIMENTAL,
    )
    asynchronous: bool = Field(
        False,
        description="rollout.staleness > 0: sample in a rollout worker process (spawned, one "
        "torch thread, its own copy of the policy) up to rollout.staleness steps ahead of the "
        "update, with the weights pushed after each step, instead of in the trainer between "
        "steps; the same versions (each batch k behind after the first k steps; with "
        "rollout.async_weights=newest the newest pushed, 0 to k behind), each step "
        "seeded by (run.seed, step, rank); under torchrun one worker per rank, sampling that "
        "rank's share of the prompts (docs/async.md)." + EXPERIMENTAL,
    )
    async_weights: Literal["fixed", "newest"] = Field(
        "fixed",
        description="rollout.asynchronous: which version the worker samples a step with. "
        "'fixed': version t - 1 - k for step t, exactly k behind after the first k steps (the "
        "deterministic mode's batches, bit for bit; what the tests and studies use). 'newest': "
        "the newest version the trainer has pushed when the worker starts the step, never older "
        "than t - 1 - k (it waits for that one), so the lag is between 0 and k and depends on "
        "the timing of the two processes: such a run is not reproducible bit for bit; "
        "rollout/staleness logs each batch's lag (docs/async.md)." + EXPERIMENTAL,
    )
    async_workers: Literal["rank", "node"] = Field(
        "rank",
        description="rollout.asynchronous under torchrun: 'rank', a rollout worker per rank "
        "sampling that rank's share of the prompts; 'node', one worker per node, started by "
        "the node's first rank, sampling every share of the node's ranks (each with its rank's "
        "seed, so the batches are those of a worker per rank, bit for bit) and scattering them "
        "(one copy of the sampler's weights a node; with async_weights=newest the node's ranks "
        "sample each step with one version) (docs/async.md)." + EXPERIMENTAL,
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

    @model_validator(mode="after")
    def _asynchronous(self) -> RolloutConfig:
        """What the rollout worker (``asynchronous``) needs and cannot be combined with yet."""
        k = self.staleness
        if self.async_workers != "rank" and not self.asynchronous:
            raise ValueError(
                f"rollout.async_workers={self.async_workers} places the rollout "
                "workers, but rollout.asynchronous is false (the trainer samples in its own "
                "process); set rollout.asynchronous=true, or rollout.async_workers=rank"
            )
        if self.async_weights != "fixed" and not self.asynchronous:
            raise ValueError(
                f"rollout.async_weights={self.async_weights} picks the weights in the "
                "rollout worker, but rollout.asynchronous is false (the trainer samples with "
                "version t - 1 - k); set rollout.asynchronous=true, or rollout.async_weights=fixed"
            )
        if k == 0 and self.asynchronous:
            raise ValueError(
                "rollout.asynchronous samples ahead of the update, so its batches are "
                "rollout.staleness versions old: set rollout.staleness >= 1 (e.g. 1)"
            )
        if self.asynchronous and self.engine != "hf":
            raise ValueError(
                f"rollout.asynchronous with rollout.engine={self.engine} is not supported "
                "yet (the rollout worker samples with an hf engine of its own); set "
                "rollout.asynchronous=false (the trainer's engine then samples "
                f"{k} versions behind, docs/async.md), or rollout.engine=hf"
            )
        if self.asynchronous and self.dynamic_sampling:
            raise ValueError(
                "rollout.asynchronous with rollout.dynamic_sampling is not supported yet (the "
                "rollout worker samples one round of prompts per step, ahead of the rewards "
                "that decide whether another round is needed); set rollout.asynchronous=false "
                f"(the trainer then samples every round {k} versions behind, docs/async.md), "
                "or rollout.dynamic_sampling=false"
            )
        return self
