r"""The frameworks the doctor reads, one row each: how a file is recognised and who reads it.

A row names the framework, the versions whose source its reader follows, the entry points of
its training command (for launch scripts), the detector of its mapping files, the kinds of file
it reads, its reader, and its **key policy**: what the framework does with a key it does not
know —

- ``strict``: refuses it and does not start (an argument parser, a dataclass built from the
  keys, pydantic with ``extra="forbid"``);
- ``lenient``: accepts it silently and nothing reads it (pydantic ``extra="allow"``, argparse's
  ``parse_known_args``, ``dacite.from_dict`` without ``strict``), so the default stays in force;
- ``hydra-struct``: Hydra composes the config in struct mode and refuses a key it does not have
  (``+key`` adds one).

Detection, reading, the refusal of a kind of file a framework is not read from, and the help of
``klpo doctor --framework`` are loops over :data:`ROWS`; nothing else lists the frameworks.
Readers are imported when a file needs them (:func:`lazy`), so listing the table imports none.
Adding a framework is one reader module and one :func:`register` call (docs/frameworks.md, "How
to add a framework"; ``tests/doctor/test_registry.py`` does it with a made-up one).

The reader's callables take a :class:`~klpo.doctor.document.Document`:

- ``detect(doc) -> (strength, why) | None``: positive evidence that the file is this
  framework's (``why`` says what was seen; strength 3 for a section only this framework has,
  2 for most keys being its own); None when there is none. It may raise a
  :class:`~klpo.doctor.reading.DoctorError` that refuses the file by name (TRL's PPOConfig).
- ``read(doc, version) -> Reading``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "ROWS",
    "Entry",
    "Framework",
    "KeyPolicy",
    "get",
    "lazy",
    "names",
    "register",
    "unregister",
]

KINDS = ("mapping", "script", "toml", "python")
"""File kinds: a YAML/JSON ``mapping`` of settings, a launch ``script`` (or a SkyPilot task's
``run:``), a ``toml`` config, a ``python`` script holding a config call."""


@dataclass(frozen=True)
class KeyPolicy:
    """What a framework does with a key it does not know, and where its source says so.

    Attributes:
        kind: ``"strict"`` (refuses it, does not start), ``"lenient"`` (accepts it silently,
            nothing reads it) or ``"hydra-struct"`` (Hydra's struct mode refuses it; ``+key``
            adds one).
        how: the mechanism, in the framework's words.
        where: the file and lines of the pinned version that do it.
    """

    kind: Literal["strict", "lenient", "hydra-struct"]
    how: str
    where: str = ""

    @property
    def refuses(self) -> bool:
        return self.kind != "lenient"


@dataclass(frozen=True)
class Entry:
    """One entry point of a framework's training command, matched on one word of a command.

    Attributes:
        word: a regular expression the word must match whole (``base``: its last path part).
        then: a regular expression the next word must match (a sub-command: ``trl grpo``); the
            entry point is then that next word.
        needs: a regular expression one of the later words (its part before ``=``) must match
            (slime's ``train.py`` counts only with one of slime's flags after it).
        refuse: not an entry point but a named refusal: the reason, formatted with the match's
            groups (``{1}``), e.g. a verl recipe that runs its own trainer.
    """

    word: str
    base: bool = False
    then: str | None = None
    needs: str | None = None
    refuse: str | None = None

    def match(self, words: list[str], i: int) -> tuple[re.Match[str], int] | None:
        """``(match, index of the entry-point word)`` when ``words[i]`` starts this entry."""
        w = words[i].rsplit("/", 1)[-1] if self.base else words[i]
        m = re.fullmatch(self.word, w)
        if m is None:
            return None
        at = i
        if self.then is not None:
            if i + 1 >= len(words) or not re.fullmatch(self.then, words[i + 1]):
                return None
            at = i + 1
        if self.needs is not None and not any(
            re.fullmatch(self.needs, x.partition("=")[0]) for x in words[at + 1 :]
        ):
            return None
        return m, at


@dataclass(frozen=True)
class Framework:
    """One framework the doctor reads.

    Attributes:
        name: its name on the command line (``--framework``) and in the diagnosis.
        title: how people call it (``"TRL GRPOConfig"``).
        versions: the versions whose source the reader follows, the default first.
        kinds: the file kinds it is read from (:data:`KINDS`).
        policy: its :class:`KeyPolicy`.
        read: ``read(doc, version) -> Reading``.
        detect: the mapping/TOML/Python detector (None: detected from scripts only).
        entries: the entry points of its training command, and named refusals.
        flags: regular expressions for words of a launch script that are evidence of it when
            no entry point is found (verl's ``actor_rollout_ref.*=`` overrides).
        duplicates: what its loader does with a key given twice: ``"refused"`` (OmegaConf,
            tomllib) or ``"last"`` (PyYAML, json keep the last).
        module: the reader module, for the docs (empty for a row registered with callables).
    """

    name: str
    title: str
    versions: tuple[str, ...]
    kinds: frozenset[str]
    policy: KeyPolicy
    read: Callable[..., Any]
    detect: Callable[..., Any] | None = None
    entries: tuple[Entry, ...] = ()
    flags: tuple[str, ...] = ()
    duplicates: Literal["refused", "last"] = "refused"
    module: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"{self.name}: unknown file kinds {sorted(unknown)}; use {KINDS}")


def lazy(module: str, name: str) -> Callable[..., Any]:
    """``module.name``, imported on the first call (the table imports no reader)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"{module}:{name}"
    return call


ROWS: dict[str, Framework] = {}
"""The table, in detection order (a name's row, by name)."""


def register(row: Framework) -> Framework:
    """Add ``row`` to the table (a new name goes last; an existing name is replaced)."""
    ROWS[row.name] = row
    return row


def unregister(name: str) -> None:
    """Remove a row (tests that register a made-up framework clean up with this)."""
    ROWS.pop(name, None)


def get(name: str) -> Framework:
    """The row of ``name``, or a DoctorError naming the frameworks there are."""
    from klpo.doctor.reading import DoctorError

    if name not in ROWS:
        raise DoctorError(f"unknown framework {name!r}; choose one of: {', '.join(ROWS)}")
    return ROWS[name]


def names() -> tuple[str, ...]:
    """Every framework's name, in table order."""
    return tuple(ROWS)


def _row(name: str, title: str, versions: tuple[str, ...], kinds: str, policy: KeyPolicy,
         module: str, *, reader: str = "read", detector: str | None = "detect",
         entries: tuple[Entry, ...] = (), flags: tuple[str, ...] = (),
         duplicates: Literal["refused", "last"] = "refused") -> Framework:  # fmt: skip
    path = f"klpo.doctor.frameworks.{module}"
    return register(
        Framework(
            name=name,
            title=title,
            versions=versions,
            kinds=frozenset(kinds.split()),
            policy=policy,
            read=lazy(path, reader),
            detect=lazy(path, detector) if detector else None,
            entries=entries,
            flags=flags,
            duplicates=duplicates,
            module=path,
        )
    )


_HYDRA = KeyPolicy(
    "hydra-struct",
    "Hydra composes ppo_trainer in struct mode: a key it does not have is refused ('Key ... is "
    "not in struct'); '+key' adds one",
    "verl/trainer/main_ppo.py (@hydra.main)",
)
_HF = KeyPolicy(
    "strict",
    "HfArgumentParser builds the config dataclass and refuses a field it does not have",
    "trl/scripts/utils.py (TrlParser), transformers HfArgumentParser.parse_dict",
)

# The rows, in detection order. Entry points before refusals matter only within one word.
_row(
    "verl", "verl (main_ppo)", ("0.9.1",), "mapping script", _HYDRA, "verl",
    entries=(
        Entry(r"verl\.trainer\.main_ppo|(.*/)?verl/trainer/main_ppo\.py"),
        Entry(
            r"recipe[./](\w+)[./](\w+?)(\.py)?",
            refuse="verl's {1} recipe, with its own trainer and its own Hydra config "
            "(recipe/{1}/config/*.yaml). The doctor reads verl.trainer.main_ppo's semantics only "
            "and does not apply them to another trainer: what its KL settings do is that "
            "recipe's code",
        ),
        Entry(r"verl\.trainer\.\w+", refuse="not verl's PPO trainer (verl.trainer.main_ppo)"),
    ),
    flags=(r"(actor_rollout_ref|algorithm)\.\S*=.*",),
)  # fmt: skip
_row(
    "trl-grpo", "TRL GRPOConfig", ("1.16.0",), "mapping script python", _HF, "trl",
    reader="read_grpo_doc", detector="detect_grpo",
    entries=(
        Entry(r"(.*/)?trl/scripts/grpo\.py|trl\.scripts\.grpo"),
        Entry(r"trl", base=True, then="grpo"),
    ),
    duplicates="last",
)  # fmt: skip
_row(
    "trl-rloo", "TRL RLOOConfig", ("1.16.0",), "mapping script python", _HF, "trl",
    reader="read_rloo_doc", detector="detect_rloo",
    entries=(
        Entry(r"(.*/)?trl/scripts/rloo\.py|trl\.scripts\.rloo"),
        Entry(r"trl", base=True, then="rloo"),
        Entry(r"trl", base=True, then="ppo|dpo|sft",
              refuse="the doctor reads TRL's GRPO, RLOO and distillation configs only"),
    ),
    duplicates="last",
)  # fmt: skip
_row(
    "trl-distillation", "TRL DistillationConfig", ("1.16.0",), "mapping script python", _HF,
    "trl_distill", reader="read_distillation_doc", detector="detect_distillation",
    entries=(
        Entry(r"(.*/)?(trl|examples)/scripts/distillation\.py|trl\.scripts\.distillation"),
        Entry(r"trl", base=True, then="distillation"),
    ),
    duplicates="last",
)  # fmt: skip
_row(
    "trl-sdpo", "TRL SDPOConfig (experimental)", ("1.16.0",), "mapping python", _HF,
    "trl_distill", reader="read_sdpo_doc", detector="detect_sdpo", duplicates="last",
)  # fmt: skip
_row(
    "openrlhf", "OpenRLHF (train_ppo_ray)",
    ("0.8.11", "0.9.0", "0.9.10", "0.10.4", "0.11.0", "0.11.2"), "script",
    KeyPolicy("strict", "argparse's parse_args refuses an unrecognized flag",
              "openrlhf/cli/train_ppo_ray.py"),
    "openrlhf", detector=None,
    entries=(
        Entry(r"openrlhf\.cli\.train_ppo_ray|(.*/)?openrlhf/cli/train_ppo_ray\.py"),
        Entry(r"openrlhf\.cli\.\w+",
              refuse="not OpenRLHF's PPO trainer (openrlhf.cli.train_ppo_ray)"),
    ),
    flags=(r"--(init_kl_coef|kl_estimator|algo\.kl\.)\S*",),
)  # fmt: skip
_row(
    "klpo", "klpo (klpo train -c)", ("this checkout",), "mapping",
    KeyPolicy("strict", "pydantic extra='forbid': an unknown key is refused",
              "src/klpo/train/config.py"),
    "klpo_config",
)  # fmt: skip
_row(
    "nemo-rl", "NeMo-RL (GRPO, PPO)", ("0.6.0+7ea279a", "0.6.0"), "mapping script",
    KeyPolicy("lenient",
              "its pydantic configs take extra='allow': an unknown key is kept and read by "
              "nobody, so the default stays in force",
              "nemo_rl/algorithms/loss/loss_functions.py:111, grpo.py:241, ppo.py:168"),
    "nemo_rl",
    entries=(Entry(r"run_(grpo|ppo)\w*\.py", base=True),),
)  # fmt: skip
_row(
    "slime", "slime (train.py, train_async.py)", ("0.3.1+624b824",), "script",
    KeyPolicy("lenient",
              "Megatron's parser runs with ignore_unknown_args=True (parse_known_args): a flag "
              "no parser knows is dropped without a word",
              "slime/backends/megatron_utils/arguments.py:195"),
    "slime", detector=None,
    entries=(
        Entry(r"train(_async)?\.py", base=True,
              needs=r"--(rollout-batch-size|hf-checkpoint|kl-loss-type|use-kl-loss)"),
    ),
)  # fmt: skip
_row(
    "skyrl", "SkyRL (main_base)", ("0.3.0",), "script",
    KeyPolicy("strict",
              "the config dataclasses are built key by key and an unknown key is refused "
              "(ValueError: Invalid fields ...); a '+key' override is refused too",
              "skyrl/train/config/config.py:1564-1573, 1788-1794"),
    "skyrl", detector=None,
    entries=(
        Entry(r"skyrl(_train)?(\.train)?\.entrypoints\.main_base"),
        # the on-policy distillation example (main_base's config, its own trainer: read)
        Entry(r"(.*/)?examples[./](train[./])?on_policy_distillation[./]main_on_policy_distill"
              r"(\.py)?"),
        Entry(r"examples\.[\w.]*main_\w+", needs=r"trainer\.algorithm\.\S+",
              refuse="a SkyRL example's own entry point, with its own trainer (a subclass of "
              "main_base's); the doctor reads skyrl.train.entrypoints.main_base only and does "
              "not apply its semantics to another trainer"),
    ),
)  # fmt: skip
_row(
    "prime-rl", "prime-rl (rl)", ("0.8.0",), "toml",
    KeyPolicy("strict", "pydantic-config: an unknown key fails validation",
              "docs/configuration.md:58 (prime-rl 559b447)"),
    "prime_rl",
)  # fmt: skip
_row(
    "areal", "AReaL", ("2.0.0",), "mapping script",
    KeyPolicy("strict",
              "the YAML is merged into OmegaConf.structured(config class): an unknown key is "
              "refused (ConfigKeyError)",
              "areal/api/cli_args.py:3534-3541"),
    "areal",
    entries=(
        Entry(r"areal\.(infra\.)?launcher\.\w+"),
        # An example's own training script, given AReaL's --config and AReaL overrides.
        Entry(r"(.*/)?\w+\.py", needs=r"(gconfig|actor|rollout|ref|critic)\.[\w.]+"),
    ),
)  # fmt: skip
_row(
    "roll", "ROLL (RLVR pipeline, on-policy distillation)", ("0.3.0+8eb27cc",), "mapping script",
    KeyPolicy("lenient",
              "dacite.from_dict builds RLVRConfig with dacite's default Config (strict=False): "
              "an unknown key is dropped without a word",
              "examples/start_rlvr_pipeline.py:27"),
    "roll",
    entries=(
        Entry(r"start_rlvr(_vl)?_pipeline\.py", base=True),
        Entry(r"start_onpolicy_distill_pipeline\.py", base=True),
    ),
)  # fmt: skip
_row(
    "unsloth", "Unsloth (TRL GRPO, patched)", ("2026.8.19",), "python",
    KeyPolicy("lenient",
              "UnslothGRPOConfig drops a field TRL's GRPOConfig does not have, with a printed "
              "notice, and starts without it",
              "unsloth/models/rl_config_compat.py (filter_config_init_kwargs)"),
    "trl", reader="read_unsloth_doc", detector="detect_unsloth",
)  # fmt: skip
