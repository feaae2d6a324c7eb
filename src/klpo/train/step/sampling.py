"""How a run samples each step's rollout: chosen once, at setup, from the config.

Three sources, each with or without dynamic sampling (DAPO, :mod:`klpo.train.step.dynamic`):

- :class:`Plain`: the policy's current weights, pushed to the engine, sample the step's prompts;
- :class:`StaleRing` (``rollout.staleness: k``): the ring's behaviour version of the step
  samples them, in the trainer's process (:mod:`klpo.train.rollout.versions`), and its log-probs
  and its exact distance to pi_old come with the rollout (:class:`~klpo.train.rollout.versions.SamplerGap`);
- :class:`Worker` (``rollout.asynchronous``): the rollout worker sampled them ahead, in its own
  process (:mod:`klpo.train.rollout.worker`); the behaviour pass is the trainer's, as above.

:func:`sampling` picks one for the run; the step calls :meth:`Sampling.sample` once, then
:meth:`Sampling.metrics` with the scored batch, and :meth:`Sampling.end_step` after the update
(a stale ring keeps the step's weights as version ``step``; the worker is told to go on). No test
of which source is in use is made inside the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from klpo.train.config import TrainConfig
from klpo.train.data.sources import Example, PromptStream
from klpo.train.models.build import Models
from klpo.train.rewards.functions import TrainerState
from klpo.train.rollout.engines import RolloutEngine
from klpo.train.rollout.samplers import Rollout
from klpo.train.rollout.versions import SamplerGap, VersionRing, behaviour_pass, sampled_features
from klpo.train.rollout.worker import AsyncSampler, step_seed
from klpo.train.runtime.dist import Dist
from klpo.train.step.dynamic import sample_with_signal
from klpo.train.step.step_metrics import sampler_metrics
from klpo.train.step.types import Scored

__all__ = ["Plain", "Sample", "Sampling", "StaleRing", "Worker", "sampling"]


@dataclass
class Sample:
    """One step's sampling: what the rest of the step trains on."""

    examples: list[Example]  # this rank's prompts (whole groups)
    rollout: Rollout
    totals: Any = None  # dynamic sampling's rewards of the kept groups, handed to scoring
    gap: SamplerGap | None = None  # a stale sampler's exact distance to pi_old, per position
    metrics: dict[str, float] = field(default_factory=dict)  # dynamic sampling's rollout/*


@dataclass
class Sampling:
    """The parts a run samples with; :func:`sampling` builds the one the config asks for."""

    cfg: TrainConfig
    dist: Dist
    models: Models
    stream: PromptStream
    engine: RolloutEngine
    reward_fns: list

    def sample(self, step: int, progress: TrainerState) -> Sample:
        """The rollout of step ``step`` (``progress``: the trainer's state the rewards see)."""
        raise NotImplementedError

    def metrics(self, got: Sample, scored: Scored, step: int) -> dict[str, float]:
        """The sampler's metrics of the scored step (none but a stale sampler's)."""
        return {}

    def end_step(self, step: int) -> None:
        """After the step's update: nothing to do but for a stale sampler."""

    def _draw(self, progress: TrainerState) -> Sample:
        """Share out the step's prompts and sample them with the engine's current weights; with
        ``rollout.dynamic_sampling``, rounds of them until the groups have signal."""
        if self.cfg.rollout.dynamic_sampling:  # DAPO: only groups with signal (one process)
            got = sample_with_signal(self.cfg, self.stream, self.engine, self.reward_fns, progress)
            return Sample(got.examples, got.rollout, got.totals, metrics=got.metrics)
        mine = self.dist.share(self.stream.next(self.cfg.rollout.prompts_per_step))
        prompts, answers = [e.prompt for e in mine], [e.answer for e in mine]
        return Sample(mine, self.engine.sample(prompts, answers))


class Plain(Sampling):
    """The policy's current weights sample every step."""

    def sample(self, step: int, progress: TrainerState) -> Sample:
        self.engine.sync_weights(self.models.policy)
        return self._draw(progress)


@dataclass
class StaleRing(Sampling):
    """``rollout.staleness``: the ring's behaviour version samples, in the trainer's process."""

    ring: VersionRing | None = None

    def sample(self, step: int, progress: TrainerState) -> Sample:
        with self._behaviour_weights(step) as version:
            got = self._draw(progress)
            behaviour = sampled_features(self.cfg, self.models, got.rollout, version)
        got.rollout, got.gap = behaviour_pass(self.cfg, self.models, got.rollout, behaviour)
        return got

    @contextmanager
    def _behaviour_weights(self, step: int) -> Iterator[int]:
        """The policy (and the engine's copy) at the ring's behaviour version of ``step`` inside
        the block, which gets that version; torch's generator seeded as the rollout worker's."""
        version = self.ring.behaviour_version(step)
        torch.manual_seed(step_seed(self.cfg.run.seed, step, self.dist.rank))
        with self.ring.at(self.models.policy, version, self.models.backbone):
            self.engine.sync_weights(self.models.policy)  # an engine's copy: that version
            yield version

    def metrics(self, got: Sample, scored: Scored, step: int) -> dict[str, float]:
        return sampler_metrics(self.cfg, scored, got.gap, step, self.dist)

    def end_step(self, step: int) -> None:
        self.ring.keep(step, self.models.policy)  # the weights this step ends with: version step


@dataclass
class Worker(StaleRing):
    """``rollout.asynchronous``: the rollout worker sampled the step ahead, in its process."""

    worker: AsyncSampler | None = None

    def sample(self, step: int, progress: TrainerState) -> Sample:
        mine = self.dist.share(self.stream.next(self.cfg.rollout.prompts_per_step))
        rollout, behaviour = self.worker.take(step)
        g = rollout.group_size
        if rollout.prompts != [e.prompt for e in mine for _ in range(g)]:
            raise RuntimeError(f"step {step}: the rollout worker sampled other prompts")
        rollout, gap = behaviour_pass(self.cfg, self.models, rollout, behaviour)
        return Sample(mine, rollout, gap=gap)

    def end_step(self, step: int) -> None:
        super().end_step(step)
        self.worker.advance(step)  # pushed to the worker, with the request k + 1 steps ahead


def sampling(
    cfg: TrainConfig,
    dist: Dist,
    models: Models,
    stream: PromptStream,
    engine: RolloutEngine,
    reward_fns: list,
    stale: VersionRing | AsyncSampler | None = None,
) -> Sampling:
    """The run's way of sampling, by what samples behind the policy (``stale``): the rollout
    worker (:class:`Worker`, with the worker's ring), a ring of versions (:class:`StaleRing`),
    or nothing (:class:`Plain`)."""
    parts = (cfg, dist, models, stream, engine, reward_fns)
    if isinstance(stale, AsyncSampler):
        return Worker(*parts, ring=stale.ring, worker=stale)
    if stale is not None:
        return StaleRing(*parts, ring=stale)
    return Plain(*parts)
