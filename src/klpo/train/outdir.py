"""Output directories: one rule for every command that writes one, and the lock of a run's.

Every command that writes a directory (``klpo train``'s ``run.out_dir``, ``klpo compare --out``,
``klpo lab report --out``, ``klpo export --out``, ``klpo make-reference OUT``, ``klpo
make-reward-model OUT``) claims it through :func:`claim_dir`, which applies one rule:

1. a new directory, or an empty one, is used;
2. a directory holding the same command's earlier output (:data:`PRODUCTS`: the files that
   mark it) is continued or replaced only when asked (``klpo train --resume``, ``klpo compare``
   of the same study, ``--overwrite`` of ``make-reference``, ``make-reward-model`` and ``lab
   report``), and refused otherwise, naming the flag that continues it or a new directory;
3. anything else is refused: klpo never overwrites a file it did not write.

``klpo docs --out`` writes pages into a folder of hand-written ones, so it follows the rule page
by page (:func:`claim_pages`): a page is replaced only if klpo docs generated it.

A directory a process writes for minutes (a run, a study) is locked while it does
(:class:`DirLock`): an OS-level lock (``flock`` on POSIX, through the ``filelock`` library) on
``DIR/.klpo.lock``, which the operating system releases when the process ends, however it ends.
The file names its holder (command, pid, host, start time), so a second process is refused with
them; a lock left by a process that is gone (killed, crashed: the file still names it, but the
OS lock is free) is taken over and said so. Under ``torchrun`` only the main rank takes the lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from klpo.train.config import ConfigError

__all__ = [
    "LOCK_FILE",
    "PRODUCTS",
    "DirBusy",
    "DirLock",
    "OutputExists",
    "Product",
    "check_writable_dir",
    "claim_dir",
    "claim_pages",
    "dir_state",
    "fresh_name",
    "written_before",
]

LOCK_FILE = ".klpo.lock"
State = Literal["new", "own", "other"]


@dataclass(frozen=True)
class Product:
    """What one command writes into its output directory, and how it is continued or replaced.

    ``markers``: the directory holds this command's earlier output when every file of one of
    these groups is there. ``resume``: the flag that continues it (``{path}`` is filled in);
    ``replace``: the flag that replaces it; neither: a new directory is the only way on.
    ``how``: what continues or replaces it, in words (docs/config.md).
    """

    command: str
    option: str  # how the user names the directory
    what: str  # the earlier output, in a word or two: "run", "report"
    markers: tuple[tuple[str, ...], ...]
    how: str
    resume: str | None = None
    replace: str | None = None
    fresh: str = "out"  # the stem of the new directory proposed for ``.``


PRODUCTS: dict[str, Product] = {
    "train": Product(
        "klpo train",
        "run.out_dir",
        "run",
        (("config.yaml", "metrics.jsonl"), ("config.yaml", "checkpoints")),
        "`klpo train --resume DIR` continues it; a run that stopped before its first step "
        "(no checkpoint, no trained step, only a run's own files) is replaced by a fresh run",
        resume="--resume {path}",
        fresh="runs/train",  # as `make run` names its runs
    ),
    "compare": Product(  # klpo.study.runner checks that the study is the same
        "klpo compare",
        "--out",
        "study",
        (("study.yaml",),),
        "a re-run with the same settings (its `study.yaml`; `--workers` may differ), or with "
        "more seeds, betas or choices, finishes it, reusing its finished runs and continuing "
        "crashed or interrupted ones from their last checkpoint; the runs share one "
        "evaluation of their common start (`eval-cache/`, `run.eval_cache`)",
    ),
    "lab report": Product(
        "klpo lab report",
        "--out",
        "report",
        (("report.md", "results.json"),),
        "`--overwrite` writes the new report over it (other files stay)",
        replace="--overwrite",
    ),
    "export": Product(
        "klpo export",
        "--out",
        "model",
        (("config.json",), ("adapter_config.json",)),
        "nothing: export into a new directory",
    ),
    "make-reference": Product(
        "klpo make-reference",
        "OUT",
        "reference model",
        (("reference.json",),),
        "`--overwrite` replaces the files it wrote (other files stay)",
        replace="--overwrite",
    ),
    "make-reward-model": Product(
        "klpo make-reward-model",
        "OUT",
        "reward model",
        (("reward_model.json",),),
        "`--overwrite` replaces the files it wrote (other files stay)",
        replace="--overwrite",
    ),
}
"""The commands that write a directory, by name; :func:`claim_dir` reads the row."""


class OutputExists(ConfigError, FileExistsError):
    """The output directory holds something the command would not overwrite (unasked)."""


def check_writable_dir(path: str | Path, what: str) -> None:
    """Raise ConfigError unless ``path`` is, or can be created as, a writable directory.

    Args:
        path: the directory a command will write into.
        what: how the user named it, e.g. ``"run.out_dir"`` or ``"--out"``.
    """
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        where = "is a file" if probe == path else f"is under {str(probe)!r}, which is a file"
        raise ConfigError(
            f"{what} {str(path)!r} {where}, so no directory can be made there; choose a "
            f"directory path for {what}"
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        which = "is" if probe == path else f"would be created in {str(probe)!r}, which is"
        raise ConfigError(
            f"{what} {str(path)!r} {which} not writable; choose a directory you can write to "
            f"for {what}, or fix its permissions"
        )


def _entries(path: Path) -> list[str]:
    """The names in ``path`` but the lock file (missing or not a directory: none)."""
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE)


def dir_state(path: str | Path, product: Product) -> State:
    """``new`` (missing or empty), ``own`` (holds ``product``'s earlier output) or ``other``."""
    path = Path(path)
    names = set(_entries(path))
    if not names:
        return "new"
    if any(all(m in names for m in group) for group in product.markers):
        return "own"
    return "other"


def fresh_name(path: str | Path, stem: str = "out") -> Path:
    """A new directory beside ``path``, named for now: ``runs/train`` -> ``runs/train-<time>``
    (``.`` -> ``<stem>-<time>``)."""
    path = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return path.with_name(f"{path.name}-{stamp}") if path.name else Path(f"{stem}-{stamp}")


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def claim_dir(path: str | Path, kind: str, *, proceed: bool = False) -> State:
    """Apply the rule of the module to the output directory ``path`` of command ``kind``.

    Args:
        path: the directory.
        kind: a key of :data:`PRODUCTS`.
        proceed: the user asked to continue or replace the command's earlier output there
            (``--resume``, ``--overwrite``; for ``compare`` the caller checks the study).

    Returns:
        ``new`` or ``own`` (the latter only with ``proceed``).

    Raises:
        ConfigError: ``path`` cannot be a writable directory, holds the command's earlier
            output and ``proceed`` is off, or holds anything else; the message names the flag
            that continues it or a new directory to use.
    """
    p = PRODUCTS[kind]
    check_writable_dir(path, p.option)
    state = dir_state(path, p)
    if state == "new" or (state == "own" and proceed):
        return state
    path = Path(path)
    named = f"{p.option} {str(path)!r}"
    other = f"choose another {p.option}, e.g. {fresh_name(path, p.fresh)}"
    if state == "own":
        ways = [f"continue it with {p.resume.format(path=path)}"] if p.resume else []
        ways += [f"replace it with {p.replace}"] if p.replace else []
        how = ", ".join(ways) + f", or {other}" if ways else other
        raise OutputExists(
            f"{named} already holds a {p.what}; {how} ({p.command} never "
            "overwrites its earlier output unless asked)"
        )
    flags = [f.split()[0] for f in (p.resume, p.replace) if f]
    verb = "applies" if len(flags) == 1 else "apply"
    only = f" ({' and '.join(flags)} {verb} only to a {p.what} it wrote)" if flags else ""
    raise OutputExists(
        f"{named} is not empty and holds no {p.what} of {p.command} "
        f"({_listing(_entries(path))}); {p.command} writes only into a new or empty directory, "
        f"so that nothing there is overwritten{only}: {other}"
    )


def written_before(meta_file: str | Path) -> list[str]:
    """The names an earlier ``make-reference`` / ``make-reward-model`` wrote into its directory,
    as its metadata file (``reference.json``, ``reward_model.json``) lists them under
    ``"files"`` (none listed, or unreadable: none). ``--overwrite`` replaces these and the
    names it writes now; everything else there is the user's and is kept."""
    try:
        files = json.loads(Path(meta_file).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [f for f in files if isinstance(f, str) and "/" not in f and f not in ("", ".", "..")]


def claim_pages(out: str | Path, pages: list[str], header: str, option: str = "--out") -> None:
    """``klpo docs``: every page of ``pages`` in ``out`` is absent or starts with ``header``
    (generated by it before); raise ConfigError naming a page that is not."""
    out = Path(out)
    check_writable_dir(out, option)
    for name in pages:
        page = out / name
        if not page.exists():
            continue
        try:
            with page.open("rb") as f:
                ours = f.read(len(header.encode())) == header.encode()
        except OSError:
            ours = False
        if not ours:
            raise ConfigError(
                f"{option} {str(out)!r}: {name} is there and was not generated by klpo docs (it "
                "lacks the generated-page header), so it is not replaced; move it, or choose "
                f"another {option}"
            )


# ---------------------------------------------------------------------------------------------
# The lock of a directory a process writes.


class DirBusy(ConfigError):
    """Another live process holds the directory's lock."""


def _holder_text(info: dict) -> str:
    if not info:
        return "another process (it has not yet written its name)"
    started = info.get("started")
    since = f", started {started}" if started else ""
    return f"{info.get('command', 'a klpo command')} (pid {info.get('pid')} on host {info.get('host')}{since})"


def _read_holder(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


class DirLock:
    """An OS-level lock on ``DIR/.klpo.lock``, held while one process writes ``DIR``.

    ``with DirLock(run_dir, "klpo train", option="run.out_dir") as lock:`` takes it without
    waiting (the directory is made if needed), or raises :class:`DirBusy` naming the holder's
    command, pid, host and start time. ``lock.took_over`` names the holder of a lock left by a
    process that is gone (the file names it but the OS lock is free: the OS frees it when its
    process ends). Released (and the file emptied) on leaving the block; after a kill the OS
    frees it and the file keeps the name, which the next holder reports.
    """

    def __init__(self, path: str | Path, command: str, *, option: str = "--out") -> None:
        self.dir, self.command, self.option = Path(path), command, option
        self.path = self.dir / LOCK_FILE
        self.took_over: str | None = None
        self._lock = None

    def __enter__(self) -> DirLock:
        import filelock

        self.dir.mkdir(parents=True, exist_ok=True)
        if self.path.is_dir() or (self.path.exists() and not self.path.is_file()):
            raise ConfigError(
                f"{self.option} {str(self.dir)!r}: {self.path} is a directory, not the lock file "
                f"klpo keeps there ({LOCK_FILE}); remove it (nothing of klpo's is in it), then "
                "run the command again"
            )
        lock = filelock.FileLock(str(self.path), timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            holder = _holder_text(_read_holder(self.path))
            raise DirBusy(
                f"{self.option} {str(self.dir)!r} is being written by {holder}: one process "
                f"at a time writes a directory. Wait for it to end, or choose another "
                f"{self.option}"
            ) from None
        self._lock = lock
        before = _read_holder(self.path)
        if before:
            self.took_over = _holder_text(before)
        info = {
            "command": self.command,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        self._write(json.dumps(info) + "\n")
        return self

    @staticmethod
    def probe(path: str | Path, option: str = "--out") -> None:
        """Raise :class:`DirBusy` if a live process holds ``path``'s lock; writes nothing (for
        ``klpo train --check``). A missing lock file, or a system without ``flock``: free."""
        lock_path = Path(path) / LOCK_FILE
        try:
            import fcntl
        except ImportError:  # not POSIX: the run itself takes the lock and says so
            return
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder_text(_read_holder(lock_path))
            raise DirBusy(
                f"{option} {str(path)!r} is being written by {holder}: one process at a time "
                f"writes a directory. Wait for it to end, or choose another {option}"
            ) from None
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _write(self, text: str) -> None:
        # In place (the lock is on this inode, so no rename), while holding the lock.
        with self.path.open("r+", encoding="utf-8") as f:
            f.truncate(0)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def note(self) -> str | None:
        """A line for the user when a lock left by a process that is gone was taken over."""
        if self.took_over is None:
            return None
        return (
            f"{self.dir} was locked by {self.took_over}, which is gone (it ended without "
            "releasing it: killed or crashed); the lock is taken over"
        )

    def __exit__(self, *exc: object) -> None:
        if self._lock is None:
            return
        try:
            self._write("")
        except OSError:
            pass  # a full disk must not hide the error that ended the run
        finally:
            self._lock.release()
            self._lock = None
