r"""A config file as the readers see it: its kind, its text, its settings, its training command.

One :class:`Document` per file: a YAML/JSON ``mapping`` of settings, a launch ``script`` (a
SkyPilot task file is its ``run:`` script, with its ``envs:`` as the variables), a ``toml``
config or a ``python`` script holding a config call. What every reader needs is computed once
and kept: the script read the way bash reads it (:mod:`klpo.doctor.shell`), its training
command's entry point (:mod:`klpo.doctor.launch`), the Python config call
(:mod:`klpo.doctor.pyscript`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from klpo.doctor.reading import DoctorError, load_mapping, read_text

__all__ = ["TEXT_SUFFIXES", "Document", "load_toml", "open_document"]

TEXT_SUFFIXES = (".sh", ".txt", ".args", ".cmd", ".bash", "")


@dataclass
class Document:
    """One config file.

    Attributes:
        path: the file.
        source: how findings name it (``"run.yaml (its run: script)"`` for a SkyPilot task).
        text: the text read (a SkyPilot task's ``run:`` script).
        kind: ``"mapping"``, ``"script"``, ``"toml"`` or ``"python"``.
        data: the settings of a mapping or TOML file (None for scripts and Python).
        variables: values for names a script uses but does not define (``--var``, ``envs:``).
    """

    path: Path
    source: str
    text: str
    kind: str
    data: dict[str, Any] | None = None
    variables: dict[str, str] = field(default_factory=dict)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def script(self):
        """The launch script, read as bash reads it (:class:`klpo.doctor.shell.Script`)."""
        if "script" not in self._cache:
            from klpo.doctor.shell import read_script

            try:
                self._cache["script"] = read_script(self.text, self.variables)
            except ValueError as err:
                raise DoctorError(f"{self.source}: {err}") from None
        return self._cache["script"]

    def entry(self):
        """The training command's :class:`~klpo.doctor.launch.EntryPoint`, or None."""
        if "entry" not in self._cache:
            from klpo.doctor.launch import entry_point

            try:
                self._cache["entry"] = entry_point(self.script())
            except DoctorError as err:
                raise DoctorError(f"{self.source}: {err}") from None
        return self._cache["entry"]

    def call(self) -> tuple[str, dict[str, Any], bool, int]:
        """A Python script's config call: (class, keyword arguments, Unsloth?, line)."""
        if "call" not in self._cache:
            from klpo.doctor.pyscript import config_call

            self._cache["call"] = config_call(self.text, self.source)
        return self._cache["call"]

    def duplicate_keys(self) -> list[tuple[str, int, int]]:
        """Keys the mapping holds twice: (dotted key, first line, repeated line)."""
        from klpo.doctor.reading import duplicate_keys

        if self.kind != "mapping":
            return []
        return duplicate_keys(self.text, is_json=self.path.suffix == ".json")

    def describe(self) -> str:
        """What the file looks like, for a refusal that names no framework."""
        if self.kind in ("mapping", "toml"):
            keys = list(self.data or {})
            shown = ", ".join(keys[:10]) + (f", … ({len(keys)} in all)" if len(keys) > 10 else "")
            what = "a YAML/JSON mapping" if self.kind == "mapping" else "a TOML config"
            return f"{what} with the top-level keys {shown}" if keys else f"an empty {what}"
        if self.kind == "python":
            return "a Python script"
        commands = [c for c in self.script().commands if c.words]
        if not commands:
            return "a script without commands"
        first = " ".join(commands[-1].words[:4])
        return f"a script of {len(commands)} command(s), the last one starting `{first}`"


def load_toml(path: Path, text: str) -> dict[str, Any]:
    """A TOML file's settings, or a DoctorError naming what is wrong."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise DoctorError(
                f"{path}: reading TOML needs Python 3.11 or later (tomllib), or the tomli package"
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise DoctorError(f"{path}: not valid TOML: {err}") from None


def open_document(path: str | Path, variables: dict[str, str] | None = None) -> Document:
    """Read ``path`` into a :class:`Document` (its kind from its suffix and contents)."""
    p = Path(path)
    text = read_text(p)  # a missing path, a symlink loop, a FIFO: refused with the fix
    given = dict(variables or {})
    if p.suffix == ".toml":
        return Document(p, str(path), text, "toml", load_toml(p, text), given)
    if p.suffix == ".py":
        return Document(p, str(path), text, "python", None, given)
    if p.suffix in TEXT_SUFFIXES:
        return Document(p, str(path), text, "script", None, given)
    data = load_mapping(p)
    if isinstance(data.get("run"), str):
        # A SkyPilot task: the command sits under `run:`, its variables under `envs:`.
        envs = data.get("envs") or {}
        envs = (
            {k: "" if v is None else str(v) for k, v in envs.items()}
            if isinstance(envs, dict)
            else {}
        )
        return Document(p, f"{path} (its run: script)", data["run"], "script", None,
                        {**envs, **given})  # fmt: skip
    return Document(p, str(path), text, "mapping", data, given)
