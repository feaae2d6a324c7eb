"""A rollout engine for tests that needs no vLLM: the HF sampler, its log-probs known and perturbed.

It samples with the policy's own ``generate`` (:class:`klpo.train.rollout.engines.HFEngine`) and reports
``engine_logp = log pi_old + delta`` on every completion token, ``log pi_old`` computed by the
trainer's own path (:func:`klpo.logprobs.fused` on the policy's hidden states). With a known
``delta`` every engine metric and every TIS weight is known by hand.
"""

from __future__ import annotations

import torch

from klpo import logprobs
from klpo.train.models.backbone import Backbone
from klpo.train.rollout.engines import EngineSpec, HFEngine
from klpo.train.rollout.samplers import Decoding, Rollout, completion_hidden


def _copy(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in policy.parameters() if p.requires_grad]


class PerturbedEngine:
    name = "perturbed"

    def __init__(self, cfg, policy, tokenizer, delta: float, codec=None) -> None:
        self.hf = HFEngine(policy, tokenizer, Decoding.from_config(cfg), codec=codec)
        self.policy, self.delta, self.temperature = policy, delta, cfg.rollout.temperature
        self.synced = 0
        self.closed = False
        self.weights: list[torch.Tensor] | None = None  # what the last sync loaded

    def sync_weights(self, policy) -> None:
        assert policy is self.policy
        self.synced += 1
        self.weights = _copy(policy)

    def sample(self, prompts: list[str], answers: list[str]) -> Rollout:
        # A real engine samples with the weights it was last loaded with, the policy module's
        # own being elsewhere: this one samples with the module, so it checks they are those.
        assert self.weights is not None, "sampled before any sync_weights"
        now = _copy(self.policy)
        assert all(torch.equal(a, b) for a, b in zip(self.weights, now, strict=True)), (
            "the engine samples with weights other than those it was synced to"
        )
        r = self.hf.sample(prompts, answers)
        backbone = Backbone(self.policy)
        weight, bias, _ = backbone.head()
        with torch.no_grad():
            out = logprobs.fused(
                completion_hidden(backbone, r),
                weight,
                r.completion_ids,
                bias=bias,
                temperature=self.temperature,
            )
        r.engine_logp = torch.where(r.mask, out.logp.float() + self.delta, 0.0)
        return r

    def close(self) -> None:
        self.closed = True


def spec(delta: float, made: list | None = None) -> EngineSpec:
    """An :class:`EngineSpec` making :class:`PerturbedEngine` (each one appended to ``made``)."""

    def make(cfg, m, dist, policy_path):
        engine = PerturbedEngine(cfg, m.policy, m.tokenizer, delta, codec=m.codec)
        if made is not None:
            made.append(engine)
        return engine

    return EngineSpec(make)


def recording(rollouts: list, prompts: list | None = None) -> EngineSpec:
    """The ``hf`` engine's own row, its samples recorded: each :class:`Rollout` the engine
    returns goes to ``rollouts``, each prompt it was given to ``prompts``."""
    from klpo.train.choices import ENGINES

    hf = ENGINES["hf"].factory()

    def make(cfg, m, dist, policy_path):
        engine = hf(cfg, m, dist, policy_path)
        sample = engine.sample

        def recorded(prompts_: list[str], answers: list[str]) -> Rollout:
            if prompts is not None:
                prompts.extend(prompts_)
            rollouts.append(r := sample(prompts_, answers))
            return r

        engine.sample = recorded
        return engine

    return EngineSpec(make)
