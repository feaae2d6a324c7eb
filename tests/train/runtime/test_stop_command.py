"""The line that says how to resume names klpo as this process was called."""

from __future__ import annotations

import os
import sys

from klpo.train.runtime.stop import klpo_command


def test_klpo_on_path_is_named_klpo(tmp_path):
    exe = tmp_path / "bin" / "klpo"
    assert klpo_command(str(exe), which=str(exe)) == "klpo"


def test_klpo_off_path_is_named_by_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exe = tmp_path / ".venv" / "bin" / "klpo"
    # Not on PATH at all, or another klpo first on PATH: the path it was called by.
    assert klpo_command(str(exe), which="") == os.path.join(".venv", "bin", "klpo")
    assert klpo_command(str(exe), which="/usr/bin/klpo") == os.path.join(".venv", "bin", "klpo")


def test_python_dash_m_klpo_is_named_so():
    got = klpo_command("/somewhere/klpo/__main__.py", which="/usr/bin/klpo")
    assert got.endswith(" -m klpo") and os.path.basename(sys.executable) in got


def test_a_run_stops_when_the_process_that_started_it_is_gone():
    # klpo compare starts each trainer in its own process group, so a kill -9 of the study
    # reaches none of them; each watches the study's pid and stops itself (SIGTERM: after its
    # step, with a checkpoint) once it is re-parented
    import signal
    import threading

    from klpo.train.runtime.stop import watch_parent

    parents = iter([100, 100, 1])  # re-parented to init on the third look
    sent: list[tuple[int, int]] = []
    done = threading.Event()

    def kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        done.set()

    watch_parent(100, interval_s=0.01, getppid=lambda: next(parents), kill=kill)
    assert done.wait(10)
    import os

    assert sent == [(os.getpid(), signal.SIGTERM)]
