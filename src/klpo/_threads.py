"""Threads on a shared machine: a passive OpenMP wait, and as many torch threads as cores are free.

torch's CPU kernels run on OpenMP threads, which by default *spin* between parallel regions
(``OMP_WAIT_POLICY=ACTIVE`` behaviour). On a machine whose cores are busy with anything else, a
spinning thread takes the core its siblings wait for, and a step of ``make run`` took 7-20x
longer at a load of 4-10 on two cores than with ``OMP_WAIT_POLICY=PASSIVE`` (docs/performance.md).
The policy is read once, when the OpenMP runtime starts (on ``import torch``), so
:func:`passive_openmp_wait` must run before torch is imported: the ``klpo`` entry point calls it
first. Threads beyond the free cores only queue behind the other processes, so the trainer and
the commands that compute take :func:`choose_threads` of the cores free now.

This module imports no other part of klpo, and torch only inside :func:`use_free_cores`.
"""

from __future__ import annotations

import os
import sys


def passive_openmp_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy; True when it took effect
    (False when the user's value stands or torch, and with it OpenMP, is already loaded)."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which containers and ``taskset``
    narrow), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def busy_cores(cores: int | None = None, *, interval: float = 0.2) -> float:
    """How many cores other processes keep busy now: the CPU use of the cores this process may
    run on over ``interval`` seconds (psutil), else the one-minute load average."""
    try:
        import psutil  # installed with peft/accelerate; optional here

        per_cpu = psutil.cpu_percent(interval=interval, percpu=True)
        try:
            mine = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            mine = list(range(len(per_cpu)))
        return sum(per_cpu[c] for c in mine if c < len(per_cpu)) / 100.0
    except Exception:  # no psutil, or no /proc: fall back to the load average
        try:
            return float(os.getloadavg()[0])
        except (AttributeError, OSError):
            return 0.0


def choose_threads(cores: int, busy: float, world: int = 1) -> int:
    """Torch threads for each of ``world`` processes when ``busy`` of ``cores`` are in use by
    others: the free cores (rounded to the nearest whole core, at least one) shared out between
    the processes, at least one each.

    >>> choose_threads(2, 0.1), choose_threads(2, 1.0), choose_threads(2, 4.0)
    (2, 1, 1)
    >>> choose_threads(16, 3.4, world=2)
    6
    """
    if cores < 1 or world < 1:
        raise ValueError(f"cores ({cores}) and world ({world}) must be at least 1")
    free = min(cores, max(1, int(cores - max(busy, 0.0) + 0.5)))
    return max(1, free // world)


def loaded_note(cores: int, busy: float, threads: int, world: int = 1) -> str | None:
    """The one line a run prints when the machine is loaded (fewer threads than cores), else None."""
    if threads * world >= cores:
        return None
    each = " each" if world > 1 else ""
    return (
        f"the machine is busy ({busy:.1f} of {cores} cores in use by other processes): "
        f"{threads} torch thread{'s' if threads > 1 else ''}{each} "
        "(run.threads sets the number)"
    )


def use_free_cores(world: int = 1, *, log=None) -> int:
    """Set torch's thread count to :func:`choose_threads` of the cores free now, print
    :func:`loaded_note` through ``log`` when there is one, and return the count. A user's
    ``OMP_NUM_THREADS`` stands (torch has read it already)."""
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return torch.get_num_threads()

    cores = usable_cores()
    busy = busy_cores(cores)
    threads = choose_threads(cores, busy, world)
    torch.set_num_threads(threads)
    note = loaded_note(cores, busy, threads, world)
    if note and log is not None:
        log(note)
    return threads
