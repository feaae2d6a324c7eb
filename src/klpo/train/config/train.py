"""The whole config, ``TrainConfig``: its sections and the checks that span several of them."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from klpo import registry
from klpo.train.algorithms import ALGORITHMS
from klpo.train.config.algo import AlgoConfig
from klpo.train.config.common import Section
from klpo.train.config.data import PLAIN_CHAT_STOP, SOURCE_REWARDS, DataConfig, RewardTerm
from klpo.train.config.kl import KLConfig
from klpo.train.config.model import ModelConfig
from klpo.train.config.rollout import RolloutConfig
from klpo.train.config.run import DistConfig, OptimConfig, RunConfig
from klpo.train.config.teacher import TeacherConfig


class TrainConfig(Section):
    """Everything `klpo train` needs. Sections: model, data, rewards, rollout, algo, kl, teacher,
    optim, run, dist."""

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
    teacher: TeacherConfig | None = Field(
        None,
        description="On-policy distillation: a teacher model and the divergence the policy "
        "descends to it, beside (or instead of) the task reward (docs/distillation.md); null: "
        "none.",
    )
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
            data.setdefault("rewards", [{"name": SOURCE_REWARDS[source]}])
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
        self._check_staleness()
        self._check_trm()
        if not self.rewards and self.teacher is None:
            raise ValueError(
                "rewards must list at least one reward function (or a teacher distils the "
                "policy: the teacher section, docs/distillation.md)"
            )
        if self.teacher is not None and self.dist.strategy == "fsdp":
            raise ValueError(
                "a teacher with dist.strategy=fsdp is not supported yet (the teacher is not "
                "sharded); use dist.strategy=ddp"
            )
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
        """What a sampler that runs behind (``rollout.staleness`` > 0) cannot be combined with yet,
        and its settings given without one."""
        k = self.rollout.staleness
        if k == 0:
            if self.kl.behaviour_correction == "is-cap":
                raise ValueError(
                    "kl.behaviour_correction=is-cap caps the weight of the KL term of a batch "
                    "sampled by a stale policy, but rollout.staleness=0: the sampler is the "
                    "policy itself and nothing would be capped; set rollout.staleness >= 1, or "
                    "kl.behaviour_correction=is (the default)"
                )
            return
        merges = self.model.lora is not None and self.model.reference is None
        if self.rollout.asynchronous and self.kl.reference_reset is not None and merges:
            raise ValueError(
                "rollout.asynchronous with kl.reference_reset on a LoRA policy is not supported "
                "yet (the reset merges the adapters into the base weights, which the rollout "
                "worker holds a copy of); set rollout.asynchronous=false (the ring restarts "
                "at each reset, docs/async.md), or train without LoRA"
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
