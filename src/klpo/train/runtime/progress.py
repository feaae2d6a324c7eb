"""Progress on the terminal: a bar where there is one, plain lines in a log file."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ProgressFn", "progress"]

ProgressFn = Callable[[int | None, dict[str, float] | None], None]
"""``progress(step, metrics)`` after a step; ``progress(None, None)`` at the end."""


def progress(steps: int, step0: int, *, show: bool, log=print) -> ProgressFn:
    """Progress of a run of ``steps`` steps from ``step0`` when ``show`` (the main rank, with
    ``run.progress``): a rich bar on a terminal; elsewhere (a log file, CI, a job scheduler) a
    plain line every ``max(1, steps // 20)`` steps and at the last step."""
    if not show:
        return lambda step, metrics: None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    def info(metrics: dict[str, float]) -> str:
        acc = metrics.get("accuracy/heldout")
        return f"reward {metrics['reward/mean']:.3f}  kl {metrics['kl/ref/exact']:.4f}" + (
            f"  heldout {acc:.3f}" if acc is not None else ""
        )

    if not Console().is_terminal:
        every, t0 = max(1, steps // 20), time.perf_counter()

        def line(step: int | None, metrics: dict[str, float] | None) -> None:
            if step is not None and (step % every == 0 or step == steps):
                elapsed = time.perf_counter() - t0
                log(f"step {step}/{steps}  {info(metrics)}  {elapsed:.0f} s")

        return line

    bar = Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[info]}"),
        transient=False,
    )
    task = bar.add_task("train", total=steps, completed=step0, info="")
    bar.start()

    def advance(step: int | None, metrics: dict[str, float] | None) -> None:
        if step is None:
            bar.stop()
            return
        bar.update(task, completed=step, info=info(metrics))

    return advance
