r"""Which program a launch script runs: the entry point of its training command.

The frameworks' own examples put the training command behind launchers: ``srun … bash -c "…"``
(:mod:`klpo.doctor.shell` reads the string as a script of its own), ``ray job submit … --``,
``accelerate launch``, ``torchrun``, ``deepspeed``, ``uv run``. A launcher's words come before
the entry point and are never read as the trainer's settings; the entry point decides the
reader. The framework is told from the command read, never from the script's raw text, so a
flag in a comment or a here-document decides nothing.

An entry point the doctor does not read is a named refusal, never another trainer's semantics:
verl's recipes (``recipe.prime.main_prime``, ``recipe.dapo.main_dapo``, …) run their own
trainers and configs, OpenRLHF's other ``openrlhf.cli`` commands are not PPO.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from klpo.doctor.reading import DoctorError
from klpo.doctor.shell import Command, Script, read_script

__all__ = ["EntryPoint", "config_and_overrides", "entry_point", "framework_command"]


@dataclass(frozen=True)
class EntryPoint:
    """The training command of a script: its framework, the command, where its arguments start."""

    framework: str
    command: Command
    at: int  # index of the entry-point word; the arguments follow it
    name: str  # the entry point as written


_SLIME_FLAGS = ("--rollout-batch-size", "--hf-checkpoint", "--kl-loss-type", "--use-kl-loss")


def _refusal(name: str, line: int, why: str) -> DoctorError:
    return DoctorError(f"line {line}: the training command runs {name}: {why}")


def classify(cmd: Command) -> EntryPoint | None:
    """The entry point of one command, or None; raises a named refusal for a known trainer
    the doctor does not read."""
    words = cmd.words
    for i, w in enumerate(words):
        base = w.rsplit("/", 1)[-1]
        if w == "verl.trainer.main_ppo" or w.endswith("verl/trainer/main_ppo.py"):
            return EntryPoint("verl", cmd, i, w)
        m = re.fullmatch(r"recipe[./](\w+)[./](\w+?)(\.py)?", w)
        if m:
            raise _refusal(
                w,
                cmd.line,
                f"verl's {m.group(1)} recipe, with its own trainer and its own Hydra config "
                f"(recipe/{m.group(1)}/config/*.yaml). The doctor reads "
                "verl.trainer.main_ppo's semantics only and does not apply them to another "
                "trainer: what its KL settings do is that recipe's code",
            )
        if re.fullmatch(r"verl\.trainer\.\w+", w):
            raise _refusal(w, cmd.line, "not verl's PPO trainer (verl.trainer.main_ppo)")
        if w == "openrlhf.cli.train_ppo_ray" or w.endswith("openrlhf/cli/train_ppo_ray.py"):
            return EntryPoint("openrlhf", cmd, i, w)
        if re.fullmatch(r"openrlhf\.cli\.\w+", w):
            raise _refusal(w, cmd.line, "not OpenRLHF's PPO trainer (openrlhf.cli.train_ppo_ray)")
        if re.fullmatch(r"skyrl(_train)?(\.train)?\.entrypoints\.main_base", w):
            return EntryPoint("skyrl", cmd, i, w)
        if re.fullmatch(r"examples\.[\w.]*main_\w+", w) and any(
            x.startswith("trainer.algorithm.") for x in words[i + 1 :]
        ):
            raise _refusal(
                w,
                cmd.line,
                "a SkyRL example's own entry point, with its own trainer (a subclass of "
                "main_base's); the doctor reads skyrl.train.entrypoints.main_base only and does "
                "not apply its semantics to another trainer",
            )
        if re.fullmatch(r"run_(grpo|ppo)\w*\.py", base):
            return EntryPoint("nemo-rl", cmd, i, w)
        if re.fullmatch(r"areal\.(infra\.)?launcher\.\w+", w):
            return EntryPoint("areal", cmd, i, w)
        if base in ("train.py", "train_async.py") and any(
            x.partition("=")[0] in _SLIME_FLAGS for x in words[i + 1 :]
        ):
            return EntryPoint("slime", cmd, i, w)
        m = re.fullmatch(r"(.*/)?trl/scripts/(grpo|rloo)\.py|trl\.scripts\.(grpo|rloo)", w)
        if m:
            kind = m.group(2) or m.group(3)
            return EntryPoint(f"trl-{kind}", cmd, i, w)
        if base == "trl" and i + 1 < len(words) and words[i + 1] in ("grpo", "rloo"):
            return EntryPoint(f"trl-{words[i + 1]}", cmd, i + 1, f"trl {words[i + 1]}")
        if base == "trl" and i + 1 < len(words) and words[i + 1] in ("ppo", "dpo", "sft"):
            raise _refusal(
                f"trl {words[i + 1]}",
                cmd.line,
                "the doctor reads TRL's GRPO and RLOO configs only",
            )
    return None


def entry_point(script: Script) -> EntryPoint | None:
    """The last command of ``script`` whose entry point the doctor knows (a refusal raises)."""
    found = None
    for cmd in script.commands:
        ep = classify(cmd)
        if ep is not None:
            found = ep
    return found


def config_and_overrides(ep: EntryPoint, script_path: Path, source: str) -> tuple[Path, dict]:
    """The ``--config FILE`` of a NeMo-RL / AReaL command and its ``key=value`` overrides.

    The file is looked for as written, then beside the script and in the folders above it (the
    frameworks' examples give paths from their repository's root).
    """
    from klpo.doctor.reading import scalar

    words = ep.command.words[ep.at + 1 :]
    config: str | None = None
    overrides: dict = {}
    for j, w in enumerate(words):
        flag, eq, value = w.partition("=")
        if flag == "--config":
            config = value if eq else (words[j + 1] if j + 1 < len(words) else None)
        elif eq and not flag.startswith("-") and "." in flag:
            node = overrides
            *parents, last = flag.lstrip("+").split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = scalar(value)
    if config is None:
        raise DoctorError(f"{source}: line {ep.command.line}: {ep.name} without --config FILE")
    tried = [Path(config)] + [d / config for d in [script_path.parent, *script_path.parent.parents]]
    for cand in tried:
        if cand.is_file():
            return cand, overrides
    raise DoctorError(
        f"{source}: line {ep.command.line}: --config {config} is neither a file as written nor "
        "beside the script or in a folder above it; give the config's path"
    )


def framework_command(
    text: str, source: str, given: dict[str, str] | None, framework: str, what: str
) -> tuple[Script, EntryPoint]:
    """The launch script ``text`` read as bash does, and its ``framework`` entry point.

    Raises:
        DoctorError: the script cannot be read, or has no command of ``framework`` (``what``
            names the command looked for, e.g. "SkyRL `main_base`").
    """
    try:
        script = read_script(text, given)
    except ValueError as err:
        raise DoctorError(f"{source}: {err}") from None
    ep = entry_point(script)
    if ep is None or ep.framework != framework:
        raise DoctorError(f"{source}: no {what} command found")
    return script, ep
