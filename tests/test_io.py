"""Atomic, durable writes (klpo._io): a failure midway leaves the old content and no temporaries."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from klpo import _io


class Boom(RuntimeError):
    pass


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture
def fsyncs(monkeypatch):
    """Record what os.fsync is called on: ('file' | 'dir', path)."""
    seen: list[tuple[str, str]] = []
    real = os.fsync

    def spy(fd):
        st = os.fstat(fd)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
        seen.append(
            (kind, os.readlink(f"/proc/self/fd/{fd}") if Path("/proc/self").exists() else "")
        )
        return real(fd)

    monkeypatch.setattr(_io.os, "fsync", spy)
    return seen


def test_write_text_bytes_and_callback(tmp_path, fsyncs):
    p = tmp_path / "sub" / "a.txt"
    _io.write_atomic(p, "héllo\n")
    assert p.read_bytes() == "héllo\n".encode()
    _io.write_atomic(p, b"\x00\xff")
    assert p.read_bytes() == b"\x00\xff"
    _io.write_atomic(p, lambda f: f.write(b"xyz"))
    assert p.read_bytes() == b"xyz"
    _io.write_text_atomic(p, "done")
    assert p.read_text() == "done"
    assert _listing(p.parent) == ["a.txt"]
    # the file's data and then its directory (for the rename) are fsynced
    kinds = [k for k, _ in fsyncs]
    assert kinds.count("file") == 4 and kinds.count("dir") >= 4
    assert kinds.index("file") < kinds.index("dir")
    if fsyncs[0][1]:
        assert {path for k, path in fsyncs if k == "dir"} == {str(p.parent)}


def test_permissions_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        _io.write_atomic(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o640  # 0o666 & ~0o027


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_failure_midway_keeps_the_old_file_and_leaves_no_temporary(tmp_path, exc):
    p = tmp_path / "report.md"
    p.write_text("old content\n")

    def half_then_fail(f):
        f.write(b"new, but only ha")
        raise exc("disk full")

    with pytest.raises(exc):
        _io.write_atomic(p, half_then_fail)
    assert p.read_text() == "old content\n"
    assert _listing(tmp_path) == ["report.md"]
    # and where there was no file, there still is none
    with pytest.raises(exc):
        _io.write_atomic(tmp_path / "new.md", half_then_fail)
    assert _listing(tmp_path) == ["report.md"]


def test_save_figure_writes_the_suffix_format(tmp_path):
    class Fig:
        def savefig(self, f, format, **kw):
            f.write(f"{format} {sorted(kw.items())}".encode())

    _io.save_figure(Fig(), tmp_path / "a.png", dpi=110)
    assert (tmp_path / "a.png").read_text() == "png [('dpi', 110)]"
    _io.save_figure(Fig(), tmp_path / "b.svg")
    assert (tmp_path / "b.svg").read_text() == "svg []"


def test_atomic_dir_replaces_the_whole_directory(tmp_path, fsyncs):
    final = tmp_path / "ckpt" / "step_000002"
    with _io.atomic_dir(final) as tmp:
        assert tmp.parent == final.parent and tmp.name.startswith(".tmp-step_000002-")
        assert not final.exists()  # nothing is visible before the block ends
        (tmp / "policy").mkdir()
        (tmp / "policy" / "w.bin").write_bytes(b"1")
        (tmp / "state.json").write_text("{}")
    assert _listing(final) == ["policy", "state.json"]
    assert _listing(final.parent) == ["step_000002"]
    # every file in the tree was fsynced, and so were the directories
    if fsyncs[0][1]:
        synced = {path for _, path in fsyncs}
        assert {str(final.parent / tmp.name / "policy" / "w.bin"), str(final.parent)} <= synced
    # a second build replaces the first entirely (no stale files survive)
    with _io.atomic_dir(final) as tmp:
        (tmp / "other").write_text("2")
    assert _listing(final) == ["other"]
    assert _listing(final.parent) == ["step_000002"]


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_atomic_dir_failure_keeps_the_old_directory_and_no_temporary(tmp_path, exc):
    final = tmp_path / "step_000001"
    with _io.atomic_dir(final) as tmp:
        (tmp / "state.json").write_text("good")
    with pytest.raises(exc), _io.atomic_dir(final) as tmp:
        (tmp / "state.json").write_text("half")
        raise exc("disk full")
    assert (final / "state.json").read_text() == "good"
    assert _listing(tmp_path) == ["step_000001"]
    # a stale temporary of this process from an earlier crash is cleared, not reused
    stale = tmp_path / f".tmp-step_000003-{os.getpid()}"
    stale.mkdir()
    (stale / "junk").write_text("x")
    with _io.atomic_dir(tmp_path / "step_000003") as tmp:
        assert _listing(tmp) == []
    assert _listing(tmp_path) == ["step_000001", "step_000003"]


def test_the_library_layer_writes_no_files():
    # klpo/*.py are pure tensor functions; only the lab, the trainer and the CLI write files
    import re

    src = Path(_io.__file__).parent
    pattern = re.compile(r"^\s*(from|import)\s+klpo(\._io|\.lab|\.train|\.cli)\b", re.M)
    library = [f for f in src.glob("*.py") if f.name not in ("_io.py", "__main__.py")]
    assert {f.name for f in library} >= {"kl.py", "losses.py", "_tensor.py"}
    offenders = [f.name for f in library if pattern.search(f.read_text())]
    assert offenders == []
