"""The trainer's one typed config: sections, defaults, validation, YAML and ``--set`` overrides.

Every field carries its help text. Unknown keys and bad values fail before any work starts, with
a message that names the key, what was given and what is allowed::

    cfg = load_config("configs/grpo.yaml", overrides=["kl.beta=0.02", "rollout.group_size=8"])

The resolved config is written beside every run's outputs (``config.yaml``).

One module per section, each validating itself (:mod:`.model`, :mod:`.data` with the rewards,
:mod:`.rollout`, :mod:`.algo`, :mod:`.kl`, :mod:`.teacher`, :mod:`.run` with ``optim`` and ``dist``); the whole
:class:`TrainConfig` and the checks that span sections in :mod:`.train`; reading and writing in
:mod:`.files`; what they share in :mod:`.common`. Nothing here imports torch.
"""

from __future__ import annotations

from klpo.train.config.algo import AlgoConfig
from klpo.train.config.common import (
    LR_SCHEDULERS,
    ConfigError,
    Engine,
    Sampler,
    Section,
    Tracker,
    one_of,
    table_row,
)
from klpo.train.config.data import PLAIN_CHAT_STOP, RESERVED_TEMPLATE_KWARGS, DataConfig, RewardTerm
from klpo.train.config.files import (
    DuplicateKeyError,
    apply_overrides,
    build_config,
    dump_config,
    flat,
    key_paths,
    load_config,
    load_yaml,
    parse_override,
    read_config_file,
)
from klpo.train.config.kl import KLConfig, ReferenceReset
from klpo.train.config.model import LoraConfig, ModelConfig
from klpo.train.config.rollout import RolloutConfig
from klpo.train.config.run import DistConfig, OptimConfig, RunConfig
from klpo.train.config.teacher import TeacherConfig
from klpo.train.config.train import TrainConfig

__all__ = [
    "LR_SCHEDULERS",
    "PLAIN_CHAT_STOP",
    "RESERVED_TEMPLATE_KWARGS",
    "AlgoConfig",
    "ConfigError",
    "DataConfig",
    "DistConfig",
    "DuplicateKeyError",
    "Engine",
    "KLConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "ReferenceReset",
    "RewardTerm",
    "RolloutConfig",
    "RunConfig",
    "Sampler",
    "Section",
    "TeacherConfig",
    "Tracker",
    "TrainConfig",
    "apply_overrides",
    "build_config",
    "dump_config",
    "flat",
    "key_paths",
    "load_config",
    "load_yaml",
    "one_of",
    "parse_override",
    "read_config_file",
    "table_row",
]
