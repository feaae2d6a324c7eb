"""Run by torchrun in test_fsdp.py: a small module sharded with FSDP2, one forward and backward,
then the trainer's shutdown; exits 1 if any thread but the main one is still alive after it.

    torchrun --nproc_per_node 2 fsdp_exit_script.py
"""

from __future__ import annotations

import torch
from torch import nn

from conftest import exit_if_threads_left
from klpo.train.runtime.dist import init_distributed, shutdown


def train(world: int) -> None:
    """A sharded step; the model is gone when it returns, as in the trainer before shutdown."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 4)).sum().backward()


def main() -> None:
    dist = init_distributed(threads=1)
    train(dist.world)
    shutdown(dist)
    exit_if_threads_left(dist.rank)


if __name__ == "__main__":
    main()
