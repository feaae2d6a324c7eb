"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a job scheduler, ``kill``) without losing it.

The first signal only raises a flag; the loop finishes the step it is in, saves a checkpoint and
stops with :class:`Interrupted`, whose message says where the checkpoint is and how to resume. A
second signal of the same kind, a second or more later, interrupts at once (Python's default:
``KeyboardInterrupt``), for a step that takes too long; the previous checkpoint is then the one to
resume from.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

PARENT_ENV = "KLPO_PARENT_PID"
"""Set by ``klpo compare`` for the trainers it starts (each in its own process group, so a
``kill -9`` of the study reaches none of them): its pid, which each watches."""


def watch_parent(
    pid: int,
    *,
    interval_s: float = 1.0,
    getppid: Callable[[], int] = os.getppid,
    kill: Callable[[int, int], None] = os.kill,
) -> threading.Thread:
    """A daemon thread that sends this process SIGTERM once its parent ``pid`` is gone (the
    process is re-parented: ``getppid()`` is no longer ``pid``), so a trainer whose study was
    killed outright stops after its step with a checkpoint instead of training on for nobody."""

    def watch() -> None:
        while getppid() == pid:
            time.sleep(interval_s)
        sys.stderr.write(f"the parent process {pid} is gone: stopping this run\n")
        sys.stderr.flush()
        kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="klpo-watch-parent", daemon=True)
    thread.start()
    return thread


class Interrupted(RuntimeError):
    """The run stopped on a signal after saving a checkpoint; ``exit_code`` is 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class StopOnSignal:
    """Context manager: while inside, SIGINT and SIGTERM set :attr:`signum` instead of killing.

    Outside the main thread (where Python cannot install handlers) it does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0  # a signal repeated within this many seconds is the same request

    def __init__(self) -> None:
        self.signum: int | None = None
        self._since = 0.0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum is not None:
            # The same request arriving twice is not a second one: a Ctrl-C reaches torchrun's
            # workers from the terminal and again, forwarded (as SIGINT or SIGTERM), from torchrun.
            if signum == self.signum and now - self._since > self.REPEAT_S:
                self._restore()
                raise KeyboardInterrupt
            return
        self.signum, self._since = signum, now
        sys.stderr.write(
            f"{signal.Signals(signum).name}: stopping after this step with a checkpoint "
            "(send it again to stop at once)\n"
        )
        sys.stderr.flush()

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) is signal.SIG_IGN:
                    continue  # ignored on purpose (nohup, a background job): leave it so
                self._previous[sig] = signal.signal(sig, self._handle)
            parent = os.environ.get(PARENT_ENV, "")
            if parent.isdigit():  # started by klpo compare: stop when it is gone
                watch_parent(int(parent))
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


def klpo_command(argv0: str | None = None, *, which: str | None = None) -> str:
    """How to call klpo again the way this process was called, for the line that says how to
    resume: ``klpo`` where that name on PATH is this very program, else the path it was called
    by (``.venv/bin/klpo`` when the environment is not activated), else ``python -m klpo``.
    ``argv0`` and ``which`` (the ``klpo`` found on PATH) default to this process's."""
    import os
    import shutil

    argv0 = sys.argv[0] if argv0 is None else argv0
    name = os.path.basename(argv0)
    if name in ("__main__.py", "-m", "-c", "") or not name.startswith("klpo"):
        return f"{_short_path(sys.executable)} -m klpo"
    found = shutil.which("klpo") if which is None else which
    if found and os.path.realpath(found) == os.path.realpath(argv0):
        return "klpo"
    return _short_path(argv0)


def _short_path(path: str) -> str:
    """``path`` relative to the working directory where that is shorter (``.venv/bin/klpo``)."""
    import os

    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return rel if len(rel) < len(path) else path
