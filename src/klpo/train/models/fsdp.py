"""FSDP2 under ``torchrun``: ``dist.strategy: fsdp`` shards the policy and the reference.

Each decoder layer is one ``fully_shard`` unit and the :class:`klpo.train.models.backbone.Backbone` is the
root unit (embeddings, final norm, output head), over a 1-D device mesh of all processes
(Zhao et al. 2023, "PyTorch FSDP", arXiv:2304.11277; FSDP2 is its per-parameter DTensor
rewrite). Parameters, gradients and AdamW's state live as ``[1/world]`` shards; a unit's
parameters are all-gathered for its forward and backward and its gradients reduce-scattered
(averaged over the ranks, as DDP's all-reduce is, so the loop's ``loss · world`` scaling is
the same for both).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from klpo.train.models.backbone import Backbone
from klpo.train.models.load import transformer
from klpo.train.runtime.dist import Dist

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def to_float(x: torch.Tensor) -> float:
    """A scalar tensor as a float; a DTensor (FSDP's gradient norm) is gathered first."""
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        x = x.full_tensor()
    return float(x)


def shard(module: nn.Module, dist: Dist) -> nn.Module:
    """``module`` (a Backbone, the policy's or the reference's) sharded in place and returned.

    Every decoder layer becomes an FSDP unit, then the Backbone itself the root unit. With a
    bf16 compute dtype the units gather their parameters in bf16 and reduce gradients in float32
    (``MixedPrecisionPolicy``); the float32 shards stay the master weights.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(dist.device.type, (dist.world,))
    compute = getattr(module, "compute_dtype", None)
    mp = (
        MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        if compute not in (None, torch.float32)
        else MixedPrecisionPolicy()
    )
    for layer in transformer(module.model).layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The root keeps its parameters gathered from its forward to its backward: the fused pass
    # reads the head outside the forward, before and after it (FSDP2's default for a root).
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    # FSDP2 makes the first unit to run forward the root. generate() calls the layers without
    # the Backbone's forward, so settle the root now (FSDP2's own lazy init, done early).
    module._get_fsdp_state()._lazy_init()
    return module


SHARDS = ".metadata"  # written by torch.distributed.checkpoint beside the shards


def is_sharded_checkpoint(ckpt: Path) -> bool:
    """Whether a checkpoint's policy/ holds torch.distributed.checkpoint shards."""
    return (Path(ckpt) / "policy" / SHARDS).is_file()


def save_sharded(backbone: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Every rank writes its shards of the policy and its optimizer state to ``path`` (collective).

    ``get_state_dict`` names the entries by their unsharded names (``model.model.layers.0...``),
    so any world size, or a single process, can read them back.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(backbone, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(backbone: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load :func:`save_sharded`'s shards into the sharded policy and its optimizer (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(backbone, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        backbone, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


def load_unsharded(model: nn.Module, path: Path) -> None:
    """Load the policy's weights from :func:`save_sharded`'s shards into a plain ``model``
    (one process, no process group): what ``klpo export`` does with a sharded run."""
    import torch.distributed.checkpoint as dcp

    sd = Backbone(model).state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(path))
    Backbone(model).load_state_dict(sd)


class StagedShards:
    """Stands in for the policy in :func:`klpo.train.runtime.checkpoint.save_checkpoint`: its
    ``save_pretrained`` moves the shards every rank already wrote into the checkpoint being
    built, with the model's config.json beside them."""

    def __init__(self, staged: Path, config: PretrainedConfig) -> None:
        self.staged, self.config = Path(staged), config

    def save_pretrained(self, path: Path, **_: object) -> None:
        os.replace(self.staged, path)
        self.config.save_pretrained(path)
