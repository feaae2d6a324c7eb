"""The sampler that runs behind: a ring of the last k policy versions, and the behaviour pass.

With ``rollout.staleness: k`` > 0 the trainer samples step t with an older policy, the one that
started step max(t - k, 1), i.e. version ``max(t - 1 - k, 0)`` when version v is the policy after
v steps (the deterministic mode of docs/async.md: every batch is exactly k versions old after the
first k steps). :class:`VersionRing` keeps those versions: a copy of the policy's trainable
tensors (a LoRA policy's adapters; every weight of a full fine-tune) on the CPU per version, the
last k + 1 of them, and swaps one into the policy for the sampling (:meth:`VersionRing.at`),
copying the current weights back afterwards, bit for bit.

:func:`behaviour_pass` then fills the rollout's behaviour policy pi_behav: the trainer's own
log-probs of the sampled tokens at the sampling version (``Rollout.behav_logp``, with
``Rollout.behav_version``), computed as the score pass computes pi_old, so at a lag of 0 they are
pi_old's; and the exact KL(pi_behav ‖ pi_theta) at every position, against the weights that start
the step, from the two passes' hidden states (:func:`klpo.logprobs.fused`'s exact KL, chunked
over the vocabulary; ``Rollout.behav_kl``), and the exact total variation between the two at
every position (:func:`exact_tv`, chunked over the positions). pi_old stays the trainer's
recomputation at the current weights; the update reads pi_behav in the policy loss's importance
weight (``rollout.tis_cap``), in the KL term (``kl.behaviour_correction``,
:func:`klpo.losses.kl_loss`) and in Trust Region Masking's statistic (``algo.trm_delta``; the
exact KL with ``algo.trm_statistic=exact``).

**Experimental** (docs/architecture.md, "Experimental parts"): the stale ring
(``rollout.staleness``) and its settings may change; it is tested for exactness (the versions,
the behaviour pass, a resumed run) but not measured on real models at scale.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from klpo.heads import Head
from klpo.logprobs import ROW_ELEMENTS
from klpo.train.config import TrainConfig
from klpo.train.models.backbone import ModelHead, OwnLogits, shares_prompt, token_outputs
from klpo.train.models.build import Models, unwrap
from klpo.train.rollout.samplers import Rollout, completion_hidden, pack_rows

__all__ = [
    "Behaviour",
    "SamplerGap",
    "VersionRing",
    "behaviour_pass",
    "exact_tv",
    "sampled_features",
]


def _trainable(policy: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in unwrap(policy).named_parameters() if p.requires_grad}


def _local(p: Tensor) -> Tensor:
    """The tensor this process holds of ``p``: its shard under FSDP (a DTensor), else ``p``."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _reshard(root: torch.nn.Module | None) -> None:
    """Drop the FSDP units' gathered parameters (the root keeps its own gathered from its
    forward on, ``reshard_after_forward=False``), so the next pass gathers the shards anew."""
    if root is None:
        return
    from torch.distributed.fsdp import FSDPModule

    for mod in root.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


class VersionRing:
    """The last ``staleness + 1`` policy versions' trainable tensors, on the CPU.

    Version ``v`` is the policy after ``v`` training steps. :meth:`keep` stores the policy's
    current tensors as a version and forgets those more than ``staleness`` behind it;
    :meth:`at` puts one into the policy for a block.

    Under FSDP (``dist.strategy: fsdp``) each process keeps its own shards of every version, so
    the ring costs (k + 1) / world of the trainable weights a process; :meth:`at` swaps the
    shards and drops the gathered parameters around the swap (the root's outlive its forward),
    and :meth:`state_dict` gathers whole tensors (a collective), so a checkpoint's ring is the
    same whatever the world size, and :meth:`load_state_dict` takes each process's shards back.
    """

    def __init__(self, staleness: int, *, sharded: bool = False) -> None:
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 1:
            raise ValueError(
                f"rollout.staleness must be an integer >= 1 for a ring of versions, got "
                f"{staleness!r}"
            )
        self.staleness, self.sharded = staleness, sharded
        self.versions: dict[int, dict[str, Tensor]] = {}

    @property
    def latest(self) -> int:
        """The newest version kept."""
        if not self.versions:
            raise ValueError("the ring holds no version yet; keep() the starting policy first")
        return max(self.versions)

    def keep(self, version: int, policy: torch.nn.Module) -> None:
        """Store ``policy``'s trainable tensors as ``version``; drop versions older than
        ``version - staleness``."""
        with torch.no_grad():
            self.versions[version] = {
                n: self._local(p).detach().to("cpu", copy=True)
                for n, p in _trainable(policy).items()
            }
        for old in [v for v in self.versions if v < version - self.staleness]:
            del self.versions[old]

    def behaviour_version(self, step: int) -> int:
        """The version that samples ``step`` (1-based): ``max(step - 1 - staleness, 0)``, or the
        oldest version kept where the ring holds no older one (a ring started at a resume from
        a checkpoint without one: it fills up as a fresh run's does)."""
        return max(step - 1 - self.staleness, min(self.versions, default=0))

    def restart(self) -> None:
        """Forget every version: a LoRA reference reset merged the adapters into the base that
        the kept adapters were trained on, so none of them is a policy any more. The next
        :meth:`keep` starts the ring again, and the batches after it lag 0, 1, .., k versions
        as a fresh run's do."""
        self.versions.clear()

    def forget_after(self, version: int) -> None:
        """Drop the versions newer than ``version`` (a resumed ring's, past the resumed step)."""
        for v in [v for v in self.versions if v > version]:
            del self.versions[v]

    @contextmanager
    def at(
        self, policy: torch.nn.Module, version: int, root: torch.nn.Module | None = None
    ) -> Iterator[None]:
        """``policy`` holds ``version``'s tensors inside the block and its own after it
        (``root``: the FSDP root unit, whose gathered parameters are dropped around the swap)."""
        if version not in self.versions:
            raise KeyError(
                f"policy version {version} is not in the ring (it holds {sorted(self.versions)})"
            )
        params = _trainable(policy)
        saved = self.versions[version]
        if set(saved) != set(params):
            raise ValueError(
                "the ring's tensors are not the policy's trainable ones: "
                f"{sorted(set(saved) ^ set(params))[:3]}"
            )
        if version == self.latest:  # the policy holds it already
            yield
            return
        root = root if self.sharded else None
        _reshard(root)
        with torch.no_grad():
            current = {n: self._local(p).detach().clone() for n, p in params.items()}
            for n, p in params.items():
                self._local(p).copy_(saved[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    self._local(p).copy_(current[n])
            _reshard(root)

    def _local(self, p: Tensor) -> Tensor:
        return _local(p) if self.sharded else p

    def state_dict(self, policy: torch.nn.Module | None = None) -> dict[str, Tensor]:
        """Every kept version's tensors, flat: ``"<version>/<name>"``; with a sharded
        ``policy`` the whole tensors, gathered from every process (call it on all of them)."""
        params = _trainable(policy) if policy is not None and self.sharded else {}
        out = {}
        for v in sorted(self.versions):
            for n, t in self.versions[v].items():
                out[f"{v}/{n}"] = _whole(t, params[n]) if n in params else t
        return out

    def load_state_dict(
        self, tensors: dict[str, Tensor], policy: torch.nn.Module | None = None
    ) -> None:
        """The versions of :meth:`state_dict`, replacing those held; with a sharded ``policy``
        each process keeps its own shards of the whole tensors."""
        params = _trainable(policy) if policy is not None and self.sharded else {}
        versions: dict[int, dict[str, Tensor]] = {}
        for key, t in tensors.items():
            v, name = key.split("/", 1)
            if name in params:
                t = _shard_of(t, params[name])
            versions.setdefault(int(v), {})[name] = t.to("cpu")
        self.versions = versions


def _whole(shard: Tensor, like: Tensor) -> Tensor:
    """The whole tensor of this process's ``shard`` of a parameter laid out as ``like`` (a
    DTensor): gathered from every process."""
    from torch.distributed.tensor import DTensor

    d = DTensor.from_local(
        shard.to(like.device), like.device_mesh, like.placements, shape=like.shape,
        stride=like.stride(),
    )  # fmt: skip
    return d.full_tensor().to("cpu")


def _shard_of(whole: Tensor, like: Tensor) -> Tensor:
    """This process's shard of ``whole``, laid out as ``like`` (every process holds ``whole``,
    so nothing is sent)."""
    from torch.distributed.tensor import distribute_tensor

    d = distribute_tensor(
        whole.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )
    return d.to_local().detach().clone()


@dataclass
class Behaviour:
    """The behaviour policy's pass over a rollout at its sampling version (see the module)."""

    version: int
    features: Tensor  # [B, C, H] its last hidden states ([B, C, V] logits: model.logits_path)
    head: Head | object  # its output head, copied (or OWN_LOGITS)


@torch.no_grad()
def _features(cfg: TrainConfig, m: Models, rollout: Rollout) -> tuple[Tensor, object]:
    core = unwrap(m.backbone)
    rollout = pack_rows(rollout, cfg.algo.packing == "on")  # as scoring will lay it out
    hidden = completion_hidden(core, rollout, share_prompt=shares_prompt(cfg))
    head = core.head()
    if isinstance(head, Head):
        head = head._replace(
            weight=head.weight.detach().clone(),
            bias=None if head.bias is None else head.bias.detach().clone(),
        )
    return hidden.detach(), head


def sampled_features(cfg: TrainConfig, m: Models, rollout: Rollout, version: int) -> Behaviour:
    """The behaviour pass's first half, inside :meth:`VersionRing.at` (the sampling weights)."""
    device = next(unwrap(m.backbone).parameters()).device
    hidden, head = _features(cfg, m, rollout.to(device))
    return Behaviour(version, hidden, head)


class SamplerGap(NamedTuple):
    """The exact distance between pi_behav and the weights that start the step, per position."""

    kl: Tensor  # [B, C] KL(pi_behav ‖ pi_theta), 0 where masked
    tv: Tensor  # [B, C] (1/2) sum_v |pi_behav(v) - pi_theta(v)|, 0 where masked


def _logits(features: Tensor, head: ModelHead, temperature: float, dtype: torch.dtype) -> Tensor:
    """``[n, V]`` the scaled logits ``transform(features @ weight.T + bias) / temperature`` of a
    head (the features themselves with the model's own logits), in ``dtype``."""
    if isinstance(head, OwnLogits):
        return features.to(dtype) / temperature
    assert isinstance(head, Head)
    z = features.to(dtype) @ head.weight.to(dtype).T
    if head.bias is not None:
        z = z + head.bias.to(dtype)
    if head.transform is not None:
        z = head.transform.apply(z)
    return z / temperature


@torch.no_grad()
def exact_tv(
    features: Tensor,
    head: ModelHead,
    features_ref: Tensor,
    head_ref: ModelHead,
    mask: Tensor,
    *,
    temperature: float,
    row_chunk: int | None = None,
) -> Tensor:
    r"""``[B, C]`` the exact total variation ``(1/2) sum_v |pi(v) - pi_ref(v)|`` at each position.

    ``pi = softmax(transform(features @ weight.T + bias) / temperature)`` from a model's last
    hidden states ``[B, C, H]`` and its head (or its own logits ``[B, C, V]`` with
    :data:`klpo.train.models.backbone.OWN_LOGITS`), ``pi_ref`` likewise. Only the positions where
    ``mask`` are computed (0 elsewhere), ``row_chunk`` of them at a time (default
    :data:`klpo.logprobs.ROW_ELEMENTS` // V), so at most two ``[row_chunk, V]`` tiles of logits
    exist; float32 arithmetic (float64 for float64 features). Symmetric, in [0, 1].

    Example:
        >>> import math, torch
        >>> from klpo.train.models.backbone import OWN_LOGITS
        >>> z = torch.tensor([[[0.0, 0.0]]])  # pi = (1/2, 1/2)
        >>> z_ref = torch.tensor([[[math.log(3.0), 0.0]]])  # pi_ref = (3/4, 1/4)
        >>> exact_tv(z, OWN_LOGITS, z_ref, OWN_LOGITS, torch.ones(1, 1, dtype=torch.bool),
        ...          temperature=1.0)  # (|1/2 - 3/4| + |1/2 - 1/4|) / 2
        tensor([[0.2500]])
    """
    if features.shape[:-1] != mask.shape or features_ref.shape[:-1] != mask.shape:
        raise ValueError(
            f"features {tuple(features.shape)} and features_ref {tuple(features_ref.shape)} "
            f"must both be [B, C, ...] with [B, C] = the mask's {tuple(mask.shape)}"
        )
    if row_chunk is not None and row_chunk < 1:
        raise ValueError(
            f"row_chunk must be a positive int (positions per chunk), got {row_chunk!r}"
        )
    device = features.device
    dtype = torch.float64 if features.dtype == torch.float64 else torch.float32
    flat = features.reshape(-1, features.shape[-1])
    flat_ref = features_ref.to(device).reshape(-1, features_ref.shape[-1])
    where = torch.nonzero(mask.to(device).flatten())[:, 0]
    tv = torch.zeros(flat.shape[0], dtype=dtype, device=device)
    vocab = flat.shape[-1] if isinstance(head, OwnLogits) else head.weight.shape[0]  # type: ignore[union-attr]
    step = row_chunk or max(1, ROW_ELEMENTS // max(vocab, 1))
    for idx in where.split(step):  # (only these positions' tiles of logits are made)
        p = torch.softmax(_logits(flat[idx], head, temperature, dtype), -1)
        q = torch.softmax(_logits(flat_ref[idx], head_ref, temperature, dtype), -1)
        tv[idx] = (0.5 * (p - q).abs().sum(-1)).clamp(0.0, 1.0)
    return tv.reshape(mask.shape)


@torch.no_grad()
def behaviour_pass(
    cfg: TrainConfig, m: Models, rollout: Rollout, behaviour: Behaviour
) -> tuple[Rollout, SamplerGap]:
    """(the rollout with ``behav_logp``, ``behav_version`` and ``behav_kl``, the :class:`SamplerGap`: ``[B, C]``
    exact KL(pi_behav ‖ pi_theta) and total variation at each position, 0 where masked), with the
    current weights in the policy; ``behaviour`` is :func:`sampled_features` of the sampling
    version."""
    device = behaviour.features.device
    hidden, head = _features(cfg, m, rollout.to(device))
    tokens = rollout.completion_ids.to(device)
    out = token_outputs(
        behaviour.features, behaviour.head, tokens, temperature=cfg.rollout.temperature,
        features_ref=hidden, head_ref=head, with_entropy=False,
    )  # fmt: skip
    mask = rollout.mask.to(device)
    logp = torch.where(mask, out.logp.float(), 0.0).to(rollout.mask.device)
    kl = torch.where(mask, out.kl.float(), 0.0)
    tv = exact_tv(
        behaviour.features, behaviour.head, hidden, head, mask,
        temperature=cfg.rollout.temperature,
    ).float()  # fmt: skip
    done = dataclasses.replace(
        rollout, behav_logp=logp, behav_version=behaviour.version,
        behav_kl=kl.to(rollout.mask.device),
    )  # fmt: skip
    return done, SamplerGap(kl, tv)
