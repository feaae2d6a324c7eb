"""Progress of anything long: a rich bar on a terminal, plain lines with an ETA elsewhere.

One helper, :class:`Progress`, for every command that takes more than a few seconds: ``klpo
train`` (its steps, :func:`progress`), ``make-reference``, ``make-reward-model``, each experiment
of ``klpo lab report`` and the runs of ``klpo compare``. On a terminal it is a rich bar with the
elapsed time and rich's estimate of the time remaining; where the output is not a terminal (a log
file, CI, a job scheduler, a study's ``log.txt``) it writes plain lines::

    lab report 120/295 (41%)  gradient cosines  1 min 12 s elapsed, ETA 1 min 44 s

at a rate that suits a log: at the first update (the work has started), when a new part of the
work starts, at every ``1/lines`` of the work, at the end, and at least every ``heartbeat_s``
seconds while work goes on. The ETA is the time per unit of cost over a moving window (the
last :data:`ETA_WINDOW_S` seconds or the last :data:`ETA_WINDOW_SHARE` of the time since the first
update, whichever is longer; in this process, from the first update on: the loading before it is
not work the units do, and a command whose first unit comes after a long load says ``update(0)``
when the work starts) times the cost left, where each unit costs the same unless ``weights``
says otherwise (the lab's experiments differ a hundredfold per unit). On a machine whose load
changes, the window follows the present rate: a mean since the start would keep promising the
quiet hour's speed while a busy one is three times slower (rich's bar does the same over its
own 30 s).
"""

from __future__ import annotations

import collections
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ETA_WINDOW_S = 60.0
ETA_WINDOW_SHARE = 0.25
"""The ETA's window: its rate is over the last max(ETA_WINDOW_S, ETA_WINDOW_SHARE x the time since
the first update) seconds of updates."""

__all__ = [
    "ETA_WINDOW_S",
    "ETA_WINDOW_SHARE",
    "PlainLines",
    "Progress",
    "ProgressFn",
    "fmt_duration",
    "progress",
    "train_info",
]


def fmt_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s`` or ``1 h 02 min``; ``?`` for an unknown (non-finite) time."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@dataclass(frozen=True)
class PlainLines:
    """The plain lines of a :class:`Progress` that is no rich bar: where they go, how often,
    and the clock that times them and their ETA.

    Args:
        log: where plain lines go (default: ``print`` to stderr).
        lines: plain lines at every ``1/lines`` of the cost (besides parts, heartbeats, the end).
        heartbeat_s: the longest time between two plain lines while updates arrive.
        clock: seconds, monotonic (tests pass a fake one).
    """

    log: Callable[[str], Any] | None = None
    lines: int = 20
    heartbeat_s: float = 30.0
    clock: Callable[[], float] = time.monotonic


class Progress:
    """``total`` units of work called ``label``, shown while :meth:`update` reports them.

    Args:
        label: what the work is (``"step"``, ``"make-reward-model"``, ``"lab report"``).
        total: the number of units.
        done: the units already done when this starts (a resumed run's steps); the ETA counts
            only the units done from here.
        show: False gives a progress that shows nothing.
        terminal: a rich bar (True) or plain lines (False); default: whether stderr is a terminal.
        plain: the plain lines: where they go, how often, their clock (:class:`PlainLines`).
        weights: the relative cost of each unit (``total`` of them); the percentage and the ETA
            are of the cost. Default: equal.
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        done: int = 0,
        show: bool = True,
        terminal: bool | None = None,
        plain: PlainLines = PlainLines(),
        weights: Sequence[float] | None = None,
    ) -> None:
        log, lines, heartbeat_s, clock = plain.log, plain.lines, plain.heartbeat_s, plain.clock
        self.total = max(1, total)
        self.label, self.done, self.show = label, min(max(0, done), self.total), show
        if weights is not None and len(weights) != total:
            raise ValueError(f"{len(weights)} weights for {total} units of {label!r}")
        self._cost = list(itertools.accumulate(weights or [1.0] * self.total, initial=0.0))
        self.clock, self.heartbeat_s = clock, heartbeat_s
        self.lines = max(1, lines)
        self.start, self.start_done = clock(), self.done
        self.part, self.info = "", ""
        self._first: tuple[float, int] | None = None  # (time, units done) at the first update
        self._seen: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        self._last_line, self._mark = self.start, self._next_mark()
        self._log = log or _stderr_print
        self._bar = self._task = None
        if show and (terminal if terminal is not None else _stderr_is_terminal()):
            self._open_bar()

    def _open_bar(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("[bold]{task.fields[label]}"),
            BarColumn(),
            TextColumn("{task.fields[units]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[part]}  {task.fields[info]}"),
            console=Console(stderr=True),
            transient=False,
        )
        # rich counts the cost (its time remaining is then the cost's), the text the units
        self._task = self._bar.add_task(
            self.label, total=self._cost[-1], completed=self._cost[self.done], label=self.label,
            units=self._units(), part="", info="",
        )  # fmt: skip
        self._bar.start()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    def fraction(self) -> float:
        """The fraction of the work's cost done."""
        return self._cost[self.done] / self._cost[-1] if self._cost[-1] > 0 else 1.0

    def eta(self) -> float:
        """Seconds left at the time per unit of cost over the window (module docstring) since
        the first update; since the start while only the first has come; inf before any unit is
        done."""
        left = self._cost[-1] - self._cost[self.done]
        if self._first is not None and self.done > self._first[1]:
            now, cost = self.clock(), self._cost[self.done]
            horizon = max(ETA_WINDOW_S, ETA_WINDOW_SHARE * (now - self._first[0]))
            t1, c1 = self._first[0], self._cost[self._first[1]]
            for t, c in self._seen:  # the latest update at least a window ago, if any is
                if t > now - horizon:
                    break
                if c < cost:
                    t1, c1 = t, c
            return (now - t1) / (cost - c1) * left
        done = self._cost[self.done] - self._cost[self.start_done]
        return self.elapsed / done * left if done > 0 else math.inf

    def _next_mark(self) -> int:
        """The next of the ``lines`` even marks of the cost, after the present one."""
        return math.floor(self._cost[self.done] * self.lines / self._cost[-1]) + 1

    def _units(self) -> str:
        return f"{self.done}/{self.total}"

    def line(self) -> str:
        """The plain line of the present state."""
        pct = 100.0 * self.fraction()
        text = f"{self.label} {self._units()} ({pct:.0f}%)"
        text += "".join(f"  {x}" for x in (self.part, self.info) if x)
        if self.done >= self.total:
            return text + f"  done in {fmt_duration(self.elapsed)}"
        return text + f"  {fmt_duration(self.elapsed)} elapsed, ETA {fmt_duration(self.eta())}"

    def update(self, done: int, *, info: str | None = None, part: str | None = None) -> None:
        """``done`` units are done; ``info`` (numbers) and ``part`` (a name for the work now
        under way) replace the shown ones when given."""
        if not self.show:
            return
        new_part = part is not None and part != self.part
        self.done = min(done, self.total)
        first = self._first is None  # shown at once: the work has started
        if first:
            self._first = (self.clock(), self.done)
        self._seen.append((self.clock(), self._cost[self.done]))
        self.part = self.part if part is None else part
        self.info = self.info if info is None else info
        if self._bar is not None:
            self._bar.update(self._task, completed=self._cost[self.done], units=self._units(),
                             part=self.part, info=self.info)  # fmt: skip
            return
        now = self.clock()
        due = (
            first
            or new_part
            or self.done >= self.total
            or self._cost[self.done] * self.lines >= self._mark * self._cost[-1]
            or now - self._last_line >= self.heartbeat_s
        )
        if due:
            self._log(self.line())
            self._last_line, self._mark = now, self._next_mark()

    def note(self, text: str) -> None:
        """A line of its own (a result worth keeping, such as a mid-run evaluation): above the
        bar on a terminal, else a plain line."""
        if not self.show:
            return
        if self._bar is not None:
            self._bar.console.print(text, highlight=False, markup=False)
        else:
            self._log(text)

    def advance(self, units: int = 1, *, info: str | None = None, part: str | None = None) -> None:
        """:meth:`update` with ``units`` more done."""
        self.update(self.done + units, info=info, part=part)

    def close(self) -> None:
        """Stop the bar (plain lines need no closing)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stderr_print(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


def _stderr_is_terminal() -> bool:
    from rich.console import Console

    return Console(stderr=True).is_terminal


ProgressFn = Callable[[int | None, dict[str, float] | None], None]
"""``progress(step, metrics)`` after a step; ``progress(None, None)`` at the end."""


def train_info(metrics: dict[str, float]) -> str:
    """A training step's numbers: reward, the gold reward where there is one (the
    over-optimisation task), the exact KL(pi_theta ‖ pi_ref) per token. (A held-out evaluation
    gets a line of its own: :func:`progress`.)"""
    parts = [f"reward {metrics['reward/mean']:.3f}"]
    if "reward/gold" in metrics:
        parts.append(f"gold {metrics['reward/gold']:.3f}")
    parts.append(f"exact KL {metrics['kl/ref/exact']:.4f}")
    return "  ".join(parts)


def progress(
    steps: int,
    step0: int,
    *,
    show: bool,
    log=print,
    terminal: bool | None = None,
    evaluation: Callable[[], str] | None = None,
) -> ProgressFn:
    """Progress of a run of ``steps`` steps from ``step0`` when ``show`` (the main rank, with
    ``run.progress``): a :class:`Progress` labelled ``step`` whose info is :func:`train_info`;
    a step with a held-out evaluation also prints its accuracy on a line of its own, as
    ``evaluation()`` says it (its count and interval) where given, else the bare number."""
    bar = Progress("step", steps, done=step0, show=show, terminal=terminal, plain=PlainLines(log))

    def report(step: int | None, metrics: dict[str, float] | None) -> None:
        if step is None:
            bar.close()
            return
        bar.update(step, info=train_info(metrics or {}))
        if metrics and "accuracy/heldout" in metrics:
            said = evaluation() if evaluation is not None else ""
            said = said or f"{metrics['accuracy/heldout']:.3f}"
            bar.note(f"held-out accuracy at step {step}: {said}")

    report.shows = show  # type: ignore[attr-defined]
    return report
