"""Data parallelism under ``torchrun``: process group, thread budget, sums and gathers.

``torchrun --nproc_per_node 2 -m klpo train ...`` starts one process per rank with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` set; a plain ``klpo train`` is a world of one. On CPU the
backend is gloo and the cores are split between the ranks (two processes with two threads each on
two cores run ~50x slower than one thread each).
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from klpo._threads import use_free_cores


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks (``x`` itself in a world of one)."""
        if self.enabled:
            # On this rank's device (NCCL reduces only CUDA tensors), back on x's own after.
            y = x.to(self.device, copy=True)
            tdist.all_reduce(y, op=tdist.ReduceOp.SUM)
            x = y.to(x.device)
        return x

    def stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (the same shape on every rank), stacked in rank order:
        ``[world, *x.shape]``, ``x[None]`` in a world of one. Exact: a sum over the ranks of rows
        that are zero but for each rank's own (``-inf`` entries stay ``-inf``)."""
        rows = torch.zeros((self.world, *x.shape), dtype=x.dtype, device=x.device)
        rows[self.rank] = x
        return self.all_sum(rows)

    def cat(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Every rank's 1-D ``x`` (any length) concatenated in rank order, and where this rank's
        begins; ``(x, 0)`` in a world of one."""
        if not self.enabled:
            return x, 0
        sizes = [int(n) for n in self.stack(torch.tensor(x.numel(), device=x.device)).tolist()]
        if not any(sizes):
            return x, 0
        padded = torch.zeros(max(sizes), dtype=x.dtype, device=x.device)
        padded[: x.numel()] = x
        rows = self.stack(padded)
        return torch.cat([rows[r, :n] for r, n in enumerate(sizes)]), sum(sizes[: self.rank])

    def share(self, items: list, rank: int | None = None) -> list:
        """This rank's (or ``rank``'s) equal, consecutive share of ``items`` (a step's prompts:
        whole groups)."""
        n = len(items) // self.world
        r = self.rank if rank is None else rank
        return items[r * n : (r + 1) * n]

    def node_ranks(self) -> list[int]:
        """The ranks on this rank's node, in order: torchrun numbers a node's ranks
        consecutively, ``LOCAL_WORLD_SIZE`` of them (all of them outside torchrun)."""
        local = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        if local < 1 or self.world % local:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local} does not divide the world of {self.world} ranks "
                "(torchrun starts the same number of ranks on every node)"
            )
        first = self.rank - self.rank % local
        return list(range(first, first + local))

    def node_group(self) -> object | None:
        """A process group of this node's ranks (a collective: every rank calls it, at the same
        point); None, the default group, when the world is one node."""
        ranks = self.node_ranks()
        if len(ranks) == self.world:
            return None
        mine = None
        for first in range(0, self.world, len(ranks)):  # every node's group, on every rank
            group = tdist.new_group(list(range(first, first + len(ranks))))
            if first == ranks[0]:
                mine = group
        return mine

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (``[obj]`` in a world of one)."""
        if not self.enabled:
            return [obj]
        out: list[object] = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any rank (a collective: every rank must call it)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
        return bool(t.item())

    def barrier(self) -> None:
        if self.enabled:
            tdist.barrier()


def init_distributed(threads: int = 0, *, log=None) -> Dist:
    """Join the process group if launched by torchrun, and set the torch thread budget:
    ``threads`` per process, or (0, on CPU) the cores free now shared out between the ranks,
    with one line through ``log`` when the machine is loaded (:mod:`klpo._threads`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if world > 1 and not tdist.is_initialized():
        # Imported before the group exists: FSDP's ShardedGradScaler takes ``group.WORLD`` as a
        # default argument, so an import after init_process_group keeps the group (and gloo's
        # threads) alive past destroy_process_group (see shutdown).
        importlib.import_module("torch.distributed.fsdp")

        tdist.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if threads > 0:
        torch.set_num_threads(threads)
    elif not cuda:
        use_free_cores(world, log=log if rank == 0 else None)
    return Dist(rank=rank, world=world, device=device)


def _release_meshes() -> None:
    """Drop the process groups every live ``DeviceMesh`` holds.

    DTensor's native sharding cache keeps the meshes it has seen alive (no Python object refers
    to those entries, so neither deleting the model nor garbage collection frees them; FSDP and
    the sharded checkpoints make copies of the mesh too), and a mesh holds its groups in
    ``_pg_registry``. Left there, gloo's threads outlive destroy_process_group and are torn down
    during interpreter finalization, which can abort the process ("terminate called without an
    active exception"). FSDP's modules sit in reference cycles (their hooks refer to them), and
    their state holds the group too: collected first.
    """
    gc.collect()
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is None:
        return
    for obj in gc.get_objects():  # once, at the end of a run
        if isinstance(obj, mesh_module.DeviceMesh):
            registry = getattr(obj, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


class PeerFailed(RuntimeError):
    """Another rank of the run failed; this one stopped with it (the cause is in that rank's
    output)."""


def is_peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that broke because another rank left the group."""
    kinds = tuple(
        getattr(tdist, name) for name in ("DistError", "DistBackendError") if hasattr(tdist, name)
    )
    if kinds and isinstance(err, kinds):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("connection closed by peer", "connection reset by peer")
    )


def shutdown(dist: Dist, *, failed: bool = False) -> None:
    """Leave the process group together: a rank tearing gloo down while another still talks to it
    can abort ("terminate called without an active exception").

    A rank that ``failed`` leaves at once instead: the others may be waiting in a different
    collective, so a barrier would hang both. Its non-zero exit makes torchrun stop the others.

    Afterwards no reference to the group is left (the meshes' are dropped first), so gloo's
    threads end here rather than during interpreter finalization.
    """
    if not (dist.enabled and tdist.is_initialized()):
        return
    if failed:
        return
    tdist.barrier()
    _release_meshes()
    tdist.destroy_process_group()
