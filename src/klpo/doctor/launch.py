r"""Which program a launch script runs: the entry point of its training command.

The frameworks' own examples put the training command behind launchers: ``srun … bash -c "…"``
(:mod:`klpo.doctor.shell` reads the string as a script of its own), ``ray job submit … --``,
``accelerate launch``, ``torchrun``, ``deepspeed``, ``uv run``. A launcher's words come before
the entry point and are never read as the trainer's settings; the entry point decides the
reader. The framework is told from the command read, never from the script's raw text, so a
flag in a comment or a here-document decides nothing.

The entry points are the rows' (:data:`klpo.doctor.frameworks.ROWS`, ``entries``), read in one
loop. An entry point the doctor does not read is a named refusal, never another trainer's
semantics: verl's recipes (``recipe.prime.main_prime``, ``recipe.dapo.main_dapo``, …) run their
own trainers and configs, OpenRLHF's other ``openrlhf.cli`` commands are not PPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from klpo.doctor.reading import DoctorError, Reading
from klpo.doctor.shell import Command, Script

__all__ = [
    "EntryPoint",
    "classify",
    "config_and_overrides",
    "entry_point",
    "framework_command",
    "script_notes",
]


@dataclass(frozen=True)
class EntryPoint:
    """The training command of a script: its framework, the command, where its arguments start."""

    framework: str
    command: Command
    at: int  # index of the entry-point word; the arguments follow it
    name: str  # the entry point as written

    @property
    def arguments(self) -> list[str]:
        """The words after the entry point: the trainer's settings."""
        return self.command.words[self.at + 1 :]


def classify(cmd: Command) -> EntryPoint | None:
    """The entry point of one command, or None; raises a named refusal for a known trainer
    the doctor does not read. Each word is tried against every row's entry points, then
    against every row's refusals."""
    from klpo.doctor.frameworks import ROWS

    words = cmd.words
    for i in range(len(words)):
        for refusals in (False, True):
            for row in ROWS.values():
                for entry in row.entries:
                    if (entry.refuse is not None) != refusals:
                        continue
                    hit = entry.match(words, i)
                    if hit is None:
                        continue
                    m, at = hit
                    name = " ".join(words[i : at + 1])
                    if entry.refuse is not None:
                        why = entry.refuse.format(m.group(0), *m.groups())
                        raise DoctorError(
                            f"line {cmd.line}: the training command runs {name}: {why}"
                        )
                    return EntryPoint(row.name, cmd, at, name)
    return None


def entry_point(script: Script) -> EntryPoint | None:
    """The last command of ``script`` whose entry point the doctor knows (a refusal raises)."""
    found = None
    for cmd in script.commands:
        ep = classify(cmd)
        if ep is not None:
            found = ep
    return found


def config_and_overrides(ep: EntryPoint, script_path: Path, source: str,
                         flag: str = "--config") -> tuple[Path, dict]:  # fmt: skip
    """The ``--config FILE`` of a NeMo-RL / AReaL command and its ``key=value`` overrides.

    The file is looked for as written, then beside the script and in the folders above it (the
    frameworks' examples give paths from their repository's root).
    """
    from klpo.doctor.reading import scalar

    words = ep.arguments
    config: str | None = None
    overrides: dict = {}
    for j, w in enumerate(words):
        name, eq, value = w.partition("=")
        if name == flag:
            config = value if eq else (words[j + 1] if j + 1 < len(words) else None)
        elif eq and not name.startswith("-") and "." in name:
            node = overrides
            *parents, last = name.lstrip("+").split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = scalar(value)
    if config is None:
        raise DoctorError(f"{source}: line {ep.command.line}: {ep.name} without {flag} FILE")
    tried = [Path(config)] + [d / config for d in [script_path.parent, *script_path.parent.parents]]
    for cand in tried:
        if cand.is_file():
            return cand, overrides
    raise DoctorError(
        f"{source}: line {ep.command.line}: {flag} {config} is neither a file as written nor "
        "beside the script or in a folder above it; give the config's path"
    )


def framework_command(doc, framework: str, what: str) -> tuple[Script, EntryPoint]:
    """The document's script and its ``framework`` entry point.

    Raises:
        DoctorError: the script cannot be read, or has no command of ``framework`` (``what``
            names the command looked for, e.g. "SkyRL `main_base`").
    """
    script = doc.script()
    ep = doc.entry()
    if ep is None or ep.framework != framework:
        raise DoctorError(f"{doc.source}: no {what} command found")
    return script, ep


def script_notes(r: Reading, script: Script) -> None:
    """What the script leaves undefined or decides at run time, said once."""
    for n in script.notes:
        r.warn("note", ["script"], n)
    names = sorted({f"{u.assumed} (line {u.line})" for u in script.unresolved})
    if names:
        r.warn(
            "note",
            ["script"],
            "the script uses names it does not define, kept as written where they appear: "
            + ", ".join(names)
            + "; a setting the doctor reads that holds one is a warning of its own",
        )
