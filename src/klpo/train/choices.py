"""The rollout's variants as tables, below the config: engines and samplers, by name.

The config's ``rollout.engine`` and ``rollout.sampler`` are these tables' names (their
``Literal`` types, :mod:`klpo.train.config`), so an engine is added here alone: a class with
``sync_weights``, ``sample`` and ``close`` (:class:`klpo.train.rollout.engines.RolloutEngine`)
and a row of :data:`ENGINES` naming its factory. The table sits below the config, which reads
it, while the engines' code sits above (it reads the config and the models): so a row names its
factory either as the function itself or by its import path ``"package.module:function"``,
imported when a run makes the engine (:meth:`EngineSpec.factory`). A row added at run time
(``ENGINES["mine"] = EngineSpec(make_mine)``) is a choice of ``rollout.engine`` at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ENGINES", "SAMPLERS", "EngineFactory", "EngineSpec"]

EngineFactory = Callable[[Any, Any, Any, str], Any]
"""``(cfg, models, dist, policy_path) -> RolloutEngine``: the run's
:class:`~klpo.train.config.TrainConfig`, its :class:`~klpo.train.models.build.Models`
(tokenizer, policy, backbone) and :class:`~klpo.train.runtime.dist.Dist`, and a directory the
engine can load the policy from; returns a :class:`~klpo.train.rollout.engines.RolloutEngine`."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: how to make it, and what it needs to run here (checked before loading)."""

    make: EngineFactory | str  # the factory, or its import path "package.module:function"
    requires: str | None = None  # a module that must be importable (checked before loading)
    processes: int | None = None  # the most torchrun processes it supports (None: any)

    def factory(self) -> EngineFactory:
        """The factory itself (an import path is imported now)."""
        if not isinstance(self.make, str):
            return self.make
        module, sep, name = self.make.partition(":")
        if not sep or not module or not name:
            raise ValueError(
                f"EngineSpec.make={self.make!r} is neither a function nor an import path "
                "'package.module:function'"
            )
        return getattr(importlib.import_module(module), name)


ENGINES: dict[str, EngineSpec] = {
    "hf": EngineSpec("klpo.train.rollout.engines:hf_engine"),
    "vllm": EngineSpec("klpo.train.rollout.engines:vllm_engine", requires="vllm", processes=1),
}
"""``rollout.engine`` -> how to make it. The vLLM engine starts from ``policy_path`` (a directory
vLLM can load) and is synced with the policy's weights before every step, so a resumed run's
engine samples the resumed weights. It runs in one process: under ``torchrun`` each rank would
need its own engine beside vLLM's own process group, which is not built."""

SAMPLERS: dict[str, str] = {
    "lean": "a plain loop over the model's forward with a key/value cache, each prompt run once "
    "per group",
    "generate": "transformers' `generate`",
}
"""``rollout.sampler`` -> what it is: how the ``hf`` engine samples
(:func:`klpo.train.rollout.samplers.generate`)."""
