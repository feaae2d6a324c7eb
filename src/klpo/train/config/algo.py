"""``algo``: the algorithm, its policy loss and its update."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from klpo.registry import MODES
from klpo.train.algorithms import ALGORITHMS, POLICY_LOSSES, Algorithm, PolicyLoss
from klpo.train.config.common import EXPERIMENTAL, Section, one_of, table_row


class AlgoConfig(Section):
    name: Annotated[Algorithm, table_row(ALGORITHMS)] = Field(
        "grpo", description="The policy-optimisation algorithm."
    )
    epochs: int = Field(1, gt=0, description="Passes over each batch of rollouts (PPO epochs).")
    minibatches: int = Field(1, gt=0, description="Optimizer steps per epoch.")
    micro_batch: int = Field(
        0,
        ge=0,
        description="Sequences per forward/backward (0: the whole minibatch). With "
        "rollout.share_prompt, in whole groups of rollout.group_size (at least one): the scoring "
        "passes compute each group's prompt once, and a pass that cut a group would round "
        "otherwise, so step 1 would not be exact.",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="Token budget of one forward/backward: a micro-batch holds at most this many "
        "(padded) tokens, prompt and completion, so long completions mean fewer sequences per "
        "pass (0: off). Combined with micro_batch, the smaller wins; with rollout.share_prompt, "
        "whole groups (at least one).",
    )
    fused_loss: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Take the update's gradient in the forward pass (klpo.logprobs.fused_loss) "
        "where the loss's weights on each token are known before it: on-policy, with the exact "
        "KL or none in the loss, no engine weights; and a teacher's exact divergence in the "
        "loss (teacher.estimator full, forward or jsd over plain heads: "
        "klpo.teacher.from_hidden_loss). auto: from a vocabulary of 32768 entries "
        "(docs/performance.md); on: wherever it applies; off: never (the "
        "per-token path). The same gradients and metrics either way.",
    )
    packing: Literal["off", "on"] = Field(
        "off",
        description="Run the trainer's forwards over packed rows: each completion's sequence "
        "(prompt and completion, no padding) laid end to end with others in packs as wide as "
        "a padded row, position ids restarting at each sequence (klpo.train.models.packing; "
        "verl's use_remove_padding, OpenRLHF's packing_samples). Scoring plans the packs once "
        "and every pass (the reference, pi_old, the update, the critic, a teacher) computes "
        "each sequence at the same place, so step 1 stays exact; each prompt is computed once "
        "per completion (rollout.share_prompt does not apply). The per-token values equal the "
        "padded forward's (tested in float64 on every architecture of the tiny-model sweep). "
        "A model that cannot run packed rows is refused at load. off by default: with GRPO's "
        "groups on SmolLM2 it removed no padding and ran at 0.82x the shared prompt's tokens/s "
        "(docs/performance.md, 'Packed rows').",
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
        "them. klpo.offpolicy; docs/async.md. The off-policy losses (dppo-tv, dppo-kl, dppo-tv-k2, "
        "m2po) are experimental: they may change; tested for exactness, not yet measured on "
        'real models at scale (docs/architecture.md, "Experimental parts").',
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
        "p_old| or binary KL; verl's clip_ratio_low under dppo_tv/dppo_kl)." + EXPERIMENTAL,
    )
    dppo_delta_high: float = Field(
        0.2,
        ge=0,
        description="dppo-*: the divergence threshold for tokens with A > 0." + EXPERIMENTAL,
    )
    sampler_k2_coef: float = Field(
        1e-3,
        ge=0,
        description="dppo-tv-k2: the coefficient of (log pi_theta - log pi_anchor)² per token "
        "(prime-rl's kl_tau, default 1e-3; the anchor: dppo_anchor)." + EXPERIMENTAL,
    )
    dppo_anchor: Literal["old", "sampler"] | None = Field(
        None,
        description="dppo-*: the policy the mask, the weight and the k2 term are anchored to: "
        "old, the trainer's pi_old (verl's dppo_tv/dppo_kl), with the TIS weight of "
        "rollout.tis_cap on top; or sampler, the behaviour policy that sampled the tokens (the "
        "stale sampler's or the engine's log-probs; prime-rl, which has no pi_old), whose ratio "
        "pi_theta/pi_behav is then the importance weight itself (no TIS weight on top). Where no "
        "behaviour policy is apart from pi_old the two are the same. null: sampler for "
        "dppo-tv-k2, old for dppo-tv and dppo-kl." + EXPERIMENTAL,
    )
    m2po_threshold: float = Field(
        0.04,
        gt=0,
        description="m2po: tau_M2, the mean (log pi_old - log pi_behav)² the kept tokens of an "
        "optimizer step stay below (the paper's 0.04)." + EXPERIMENTAL,
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
        "masked tokens still count in the loss's normaliser. Metrics trm/*; docs/async.md."
        + EXPERIMENTAL,
    )
    trm_statistic: Literal["k1", "k3", "exact"] = Field(
        "k3",
        description="trm_delta: the token divergence, with rho = pi_old(y_t) / pi_behav(y_t): "
        "k1, -log rho (its absolute value under the max), or k3, rho - 1 - log rho (>= 0), "
        "both estimates of KL(pi_behav ‖ pi_old) at the token; or exact, that KL summed over "
        "the vocabulary at the position (the behaviour pass's, rollout.staleness > 0 only: an "
        "engine reports no logits)." + EXPERIMENTAL,
    )
    trm_aggregate: Literal["max", "mean"] = Field(
        "max",
        description="trm_delta: the completion's statistic, the largest token divergence "
        "(the paper's D_tok,max) or their mean over its tokens (verl's seq_mean_k1/k3; for k1 "
        "the absolute value of the mean)." + EXPERIMENTAL,
    )
    penalty_beta: float = Field(1.0, ge=0, description="kl-penalty: initial beta_old.")
    penalty_target: float | None = Field(
        None, gt=0, description="kl-penalty: target KL(pi_old ‖ pi_theta) of PPO's adaptive rule."
    )

    @field_validator("loss_reduction")
    @classmethod
    def _known_reduction(cls, v: str) -> str:
        return one_of("reduction", v, MODES)

    @field_validator("fused_loss", "packing", mode="before")
    @classmethod
    def _switch_words(cls, v: object) -> object:
        """YAML reads an unquoted ``on`` / ``off`` as true / false: take them as the words."""
        return ("on" if v else "off") if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _check_dppo_anchor(self) -> AlgoConfig:
        """``algo.dppo_anchor`` belongs to the DPPO losses."""
        anchor, loss = self.dppo_anchor, self.policy_loss
        if anchor is not None and not loss.startswith("dppo"):
            raise ValueError(
                f"algo.dppo_anchor={anchor} anchors a DPPO loss, but algo.policy_loss={loss}; "
                "set algo.policy_loss to dppo-tv, dppo-kl or dppo-tv-k2, or algo.dppo_anchor=null"
            )
        return self
