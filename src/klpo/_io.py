"""Atomic, durable writes of files and directories, shared by the lab and the trainer.

Every output klpo writes (the lab's report and plots, a run's metrics, report and config, a
checkpoint, the reference model) goes through here, so that a process killed at any moment, or a
full disk, leaves either the old content or the new one, never half of one, and no temporary
files behind:

1. write to a temporary file (or directory) beside the destination, in the same file system;
2. flush and ``fsync`` the data, so the rename cannot reach the disk before the bytes;
3. ``os.replace`` it onto the destination (atomic on POSIX and Windows);
4. ``fsync`` the parent directory, so the rename itself survives a power loss.

Any failure before step 3 removes the temporary and re-raises; the destination is untouched.
(The pattern: T. Ts'o, "Don't fear the fsync!", 2009; POSIX ``rename(2)``.)

Private: the library layer (``klpo/*.py``) never writes files and never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_dir", "fsync_dir", "save_figure", "umask", "write_atomic", "write_text_atomic"]


def umask() -> int:
    """The process umask (read without changing it for longer than a moment)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def fsync_dir(path: str | Path) -> None:
    """``fsync`` a directory, so that renames into it are durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a directory; the data is still synced
        pass
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: str | bytes | Callable[[IO[bytes]], Any]) -> None:
    """Write ``data`` to ``path`` atomically and durably.

    Args:
        path: the destination; its parent directories are created.
        data: text (written as UTF-8), bytes, or a function that writes to a binary file object
            (e.g. ``lambda f: fig.savefig(f, format="png")``).

    The file gets the permissions an ordinary ``open`` would give (``0o666 & ~umask``). On any
    exception (including KeyboardInterrupt) the temporary file is removed and ``path`` keeps its
    old content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_atomic` for text (UTF-8)."""
    write_atomic(path, text)


def save_figure(fig: Any, path: str | Path, **savefig: Any) -> None:
    """Save a matplotlib figure atomically; the format is the suffix of ``path`` (PNG if none).

    ``savefig`` is passed to ``fig.savefig`` (e.g. ``dpi=110, bbox_inches="tight"``).
    """
    path = Path(path)
    fmt = path.suffix[1:].lower() or "png"
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, **savefig))


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            with p.open("rb") as fh:
                os.fsync(fh.fileno())
    for d in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(d)
    fsync_dir(root)


def _carry_over(final: Path, tmp: Path, ours: frozenset[str]) -> None:
    """Hard-link (copy where links fail) into ``tmp`` every entry of ``final`` that neither
    ``tmp`` nor ``ours`` names: the user's files, which the swap must not take away."""
    for entry in sorted(final.iterdir()):
        if entry.name in ours or (tmp / entry.name).exists() or entry.name.startswith(".tmp-"):
            continue
        dest = tmp / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, dest, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(dest))


def _link_or_copy(src: str, dest: str) -> None:
    if os.path.islink(src):
        os.symlink(os.readlink(src), dest)
        return
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


@contextlib.contextmanager
def atomic_dir(final: str | Path, *, replaces: Iterable[str] | None = None) -> Iterator[Path]:
    """Build a directory in a temporary place and move it to ``final`` when the block succeeds.

    ``with atomic_dir(run / "checkpoints" / "step_000050") as tmp: ...`` yields
    ``run/checkpoints/.tmp-step_000050-<pid>``; the block writes into it. On success every file
    and directory in it is fsynced, an existing ``final`` is moved aside, the temporary directory
    is renamed to ``final``, the old one is removed and the parent fsynced. On an exception the
    temporary directory is removed and ``final`` is untouched.

    Directories made this way follow the umask (as ``mkdir`` does), not ``mkdtemp``'s 0700.

    ``replaces``: the names in an existing ``final`` that the new directory replaces (the files
    the command wrote there before). Given, every other entry of ``final`` (the user's notes,
    evaluation results) is kept: hard-linked into the new directory before the swap, so it is in
    ``final`` or in the new directory at every moment. Not given, ``final`` is replaced whole.
    """
    final = Path(final)
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if replaces is not None and final.is_dir():
            _carry_over(final, tmp, frozenset(replaces))
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = parent / f".old-{final.name}-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:  # put the previous one back
                os.replace(old, final)
            raise
        fsync_dir(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
