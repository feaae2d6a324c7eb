"""The asynchronous sampler: a rollout worker process that samples up to k steps ahead.

With ``rollout.asynchronous`` (and ``rollout.staleness: k`` >= 1) the step's completions come from
a worker process (``torch.multiprocessing``, spawn, one torch thread) holding its own copy of the
policy, while the trainer updates on an earlier batch. One queue carries the trainer's messages to
the worker, in order: the weights of a policy version (its trainable tensors, from the
:class:`~klpo.train.rollout.versions.VersionRing`) and requests to sample a step's prompts. The
trainer starts with the weights of version ``max(t - 1 - k, oldest kept)`` before the request of
each of the steps ``step0 + 1 .. step0 + k + 1``, and after step s pushes version s and the request
of step s + k + 1. The worker takes the messages in order, so the request of step t is sampled
with version t - 1 - k exactly (after the first k steps): the batch is k versions old, as in the
deterministic mode, while its sampling overlaps the updates of the k steps before it. Each step is
sampled with torch's generator seeded by ``(run.seed, step)``, so a run's batches do not depend on
the timing of the two processes, and a resumed run (the ring restored from its checkpoint,
the requests sent again from the restored prompt stream) samples what the uninterrupted one does.
Under ``torchrun`` each rank starts its own worker, which samples that rank's share of each step's
prompts (:meth:`klpo.train.runtime.dist.Dist.share`) seeded by ``(run.seed, step, rank)``. With
``rollout.async_workers: node`` the first rank of each node starts the one worker of the node;
its requests carry every share of the node's ranks, the worker samples each with its rank's seed
(so the batches are a worker-per-rank run's, bit for bit), and that rank scatters the parts to
the others (``scatter_object_list`` over the node's group). One copy of the sampler's weights per
node instead of per rank, and with ``async_weights: newest`` one version for the whole node's step.

With ``rollout.async_weights: newest`` the trainer pushes every version (after step s, version s,
then the request of step s + k + 1; at the start the newest kept, before the first requests), and
the worker, before sampling a step, reads every message already queued and samples with the
newest version received (:func:`pick_version`), never one older than t - 1 - k for step t (it
waits for that one) nor from the step's future: the lag is between 0 and k and depends on the
timing (a worker that keeps up samples each step as soon as it is requested, k behind; one that
falls behind catches up with fresher weights), so such a run is not reproducible bit for bit.

**Experimental** (docs/architecture.md, "Experimental parts"): the asynchronous worker
(``rollout.asynchronous``, ``async_weights``, ``async_workers``) and its settings may change; it
is tested for exactness (its batches are the deterministic mode's, bit for bit) but not measured
on real models at scale.

The worker returns the rollout with its version and the last hidden states of the completions at
that version (and its head's weights); the trainer forms the behaviour log-probs and the exact
KL(pi_behav ‖ pi_old) from them (:func:`klpo.train.rollout.versions.behaviour_pass`) and refuses a
batch more than k versions old or from a version newer than the weights that start the step.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpo.heads import Head
from klpo.train.config import TrainConfig
from klpo.train.data.sources import PromptStream
from klpo.train.models.backbone import OWN_LOGITS
from klpo.train.models.build import Models, unwrap
from klpo.train.models.load import DTYPES, autocast
from klpo.train.rollout.samplers import Decoding, Rollout, completion_hidden, generate
from klpo.train.rollout.versions import Behaviour, VersionRing
from klpo.train.runtime.dist import Dist

__all__ = [
    "AsyncSampler",
    "StaleBatch",
    "WorkerSampling",
    "pick_version",
    "step_seed",
    "worker_loop",
]

WAIT_S = 600.0
"""The longest wait for one batch from the worker before the trainer gives up."""


class StaleBatch(RuntimeError):
    """The worker's batch for a step is older than ``rollout.staleness`` versions."""


RANK_STRIDE = 0x9E3779B97F4A7C15
"""What each rank adds to the seed of a step's sampling (odd, so the ranks' seeds differ)."""


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The torch seed of ``step``'s sampling on ``rank`` (the worker's and the deterministic
    mode's): under ``torchrun`` each rank draws its own completions, and rank 0's seed is that
    of a run of one process."""
    return (seed * 1_000_003 + step + rank * RANK_STRIDE) % (2**63)


def pick_version(pushed: Iterable[int], step: int, staleness: int, oldest: int = 0) -> int | None:
    """``rollout.async_weights: newest``: the version the worker samples ``step`` (1-based) with,
    given the versions ``pushed`` to it so far: the newest that is not from the step's future
    (at most ``step - 1``, the weights that start it), if it is at least ``step - 1 -
    staleness`` and ``oldest`` (the oldest version the trainer's ring keeps, after a resume
    from a checkpoint without one); None where there is none yet (the worker waits for the
    trainer's next version).

    Example:
        >>> pick_version([0, 1, 2], step=5, staleness=2)  # the newest; 2 >= 5 - 1 - 2
        2
        >>> pick_version([0, 1], step=5, staleness=2) is None  # 1 is 3 behind: wait for 2
        True
        >>> pick_version([0, 1, 2, 3], step=3, staleness=2)  # 3 would be from step 3's future
        2
    """
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ValueError(
            f"staleness must be an integer >= 0 (rollout.staleness), got {staleness!r}"
        )
    if step < 1:
        raise ValueError(f"step must be >= 1 (steps count from 1), got {step!r}")
    fit = [v for v in pushed if v <= step - 1]
    if not fit:
        return None
    newest = max(fit)
    return newest if newest >= max(step - 1 - staleness, oldest) else None


def _load(model: torch.nn.Module, tensors: dict[str, Tensor]) -> None:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(params) != set(tensors):
        raise ValueError(
            f"weights for {len(tensors)} tensors, the worker's policy trains {len(params)}"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n])


@dataclass(frozen=True)
class WorkerSampling:
    """What the worker samples with: its copy of the policy's ``backbone`` (on ``device``, under
    autocast to ``dtype`` as the hf engine samples), the run's ``tokenizer`` and ``codec``, its
    ``decoding`` (:meth:`Decoding.from_config`), whether groups share their prompt's forward
    (:func:`klpo.train.models.backbone.shares_prompt`) and the run's ``seed``."""

    backbone: torch.nn.Module
    tokenizer: Any
    codec: Any
    decoding: Decoding
    share_prompt: bool
    seed: int
    device: str
    dtype: torch.dtype

    def sample(
        self, step: int, rank: int, prompts: list, answers: list
    ) -> tuple[int, Rollout, Tensor, Any]:
        """Sample one rank's share of a step's request with the weights the worker holds: the
        rank, the rollout, the completions' last hidden states and the head's weights."""
        torch.manual_seed(step_seed(self.seed, step, rank))
        backbone = self.backbone
        with autocast(self.dtype, torch.device(self.device)):  # as the hf engine samples
            rollout = generate(
                backbone.model, self.tokenizer, prompts, answers, self.decoding, codec=self.codec
            )
        with torch.no_grad():
            hidden = completion_hidden(backbone, rollout, share_prompt=self.share_prompt)
            head = backbone.head()
            weights = (
                None
                if not isinstance(head, Head)
                else (
                    head.weight.detach().cpu().clone(),
                    None if head.bias is None else head.bias.detach().cpu().clone(),
                )
            )
        return rank, rollout, hidden.detach().cpu(), weights


def next_message(
    inbox: Any, parent_alive: Callable[[], bool] | None = None, poll_s: float = 1.0
) -> tuple[str, Any]:
    """The next ``(kind, payload)`` from ``inbox``, waiting for it; ``("stop", None)`` once the
    process that started this one is gone (a trainer or a torchrun rank killed with ``kill -9``
    sends no stop: the worker would wait on its inbox forever, holding a copy of the policy).
    ``parent_alive`` defaults to the multiprocessing parent's liveness."""
    if parent_alive is None:
        parent = mp.parent_process()
        parent_alive = parent.is_alive if parent is not None else (lambda: True)
    while True:
        try:
            return inbox.get(timeout=poll_s)
        except queue.Empty:
            if not parent_alive():
                return ("stop", None)


def worker_loop(
    sampling: WorkerSampling, inbox: Any, outbox: Any, staleness: int | None = None
) -> None:
    """The worker process: weights and requests from ``inbox``, batches to ``outbox``. With
    ``staleness`` None (``rollout.async_weights: fixed``) the messages are taken in order, each
    request sampled with the weights received last; with k, each request with the version of
    :func:`pick_version` among those received (every message already queued is read first).
    A request holds the shares of one or more ranks, ``(rank, prompts, answers)``; each is
    sampled with its rank's seed (:meth:`WorkerSampling.sample`) and the batch holds them all,
    in order."""
    torch.set_num_threads(1)

    def sample(step: int, version: int | None, parts: list) -> None:
        batch = [sampling.sample(step, rank, prompts, answers) for rank, prompts, answers in parts]
        outbox.put(("batch", (step, version, batch)))

    try:
        backbone = sampling.backbone.to(sampling.device)
        backbone.eval()
        version = None
        if staleness is None:
            while True:
                kind, payload = next_message(inbox)
                if kind == "stop":
                    break
                if kind == "weights":
                    version, tensors = payload
                    _load(backbone.model, tensors)
                    continue
                step, parts, _ = payload
                sample(step, version, parts)
            return
        held: dict[int, dict[str, Tensor]] = {}  # received, not loaded
        pending: deque = deque()  # requests received, not sampled
        stop = False

        def read(kind: str, payload: Any) -> bool:
            if kind == "weights":
                held[payload[0]] = payload[1]
            elif kind == "sample":
                pending.append(payload)
            return kind == "stop"

        while not stop:
            while not stop:  # every message already queued
                try:
                    stop = read(*inbox.get_nowait())
                except queue.Empty:
                    break
            if stop:
                break
            choice = None
            if pending:
                step, parts, oldest = pending[0]
                have = [*held, *([] if version is None else [version])]
                choice = pick_version(have, step, staleness, oldest)
            if choice is None:  # nothing to do yet: wait for the next message
                stop = read(*next_message(inbox))
                continue
            pending.popleft()
            if choice != version:
                _load(backbone.model, held[choice])
                version = choice
            for v in [v for v in held if v <= version]:  # no later step takes an older one
                del held[v]
            sample(step, version, parts)
    except BaseException:  # said to the trainer, which raises it
        outbox.put(("error", traceback.format_exc()))


class AsyncSampler:
    """The trainer's side of the worker (see the module): start it, :meth:`take` each step's
    batch, :meth:`advance` after each step, :meth:`close` at the end. With
    ``rollout.async_workers: node`` only the node's first rank (the leader) holds a worker;
    every rank still advances its copy of the prompt stream and takes its batch each step."""

    def __init__(
        self,
        cfg: TrainConfig,
        m: Models,
        ring: VersionRing,
        stream: PromptStream,
        step0: int,
        dist: Dist | None = None,
    ) -> None:
        from klpo.train.models.backbone import shares_prompt

        self.cfg, self.models, self.ring = cfg, m, ring
        self.k = cfg.rollout.staleness
        self.newest = cfg.rollout.async_weights == "newest"
        self.dist = dist if dist is not None else Dist()  # each rank's worker samples its share
        per_node = cfg.rollout.async_workers == "node"
        self.ranks = self.dist.node_ranks() if per_node else [self.dist.rank]
        self.leader = self.ranks[0] == self.dist.rank
        self.group = self.dist.node_group() if per_node and self.dist.enabled else None
        self.ahead = copy.deepcopy(stream)  # the prompts of the steps requested ahead
        self.requested = step0
        self.pushed: int | None = None
        core = unwrap(m.backbone)
        self.device = next(core.parameters()).device
        self.process = None
        if self.leader:
            ctx = torch.multiprocessing.get_context("spawn")
            self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
            worker_copy = copy.deepcopy(core).to("cpu")
            sampling = WorkerSampling(
                worker_copy, m.tokenizer, m.codec, Decoding.from_config(cfg), shares_prompt(cfg),
                cfg.run.seed, str(self.device), DTYPES[cfg.model.dtype],
            )  # fmt: skip
            self.process = ctx.Process(
                target=worker_loop,
                args=(sampling, self.inbox, self.outbox, self.k if self.newest else None),
                daemon=True,
            )
            del sampling
            self.process.start()
            del worker_copy
        if self.newest and step0 < cfg.run.steps:  # the newest kept, for the first requests
            self._push(ring.latest)
        for step in range(step0 + 1, step0 + self.k + 2):
            self._request(step)

    def _push(self, version: int) -> None:
        if self.leader:
            self.inbox.put(("weights", (version, self.ring.versions[version])))
        self.pushed = version

    def _request(self, step: int) -> None:
        """The weights step ``step`` samples with (``fixed``: if not pushed yet), then its
        request, with the oldest version it may be sampled by: the shares of the worker's
        ranks (every rank draws the step's prompts, to keep its stream where the leader's is)."""
        if step > self.cfg.run.steps:
            return
        version = self.ring.behaviour_version(step)
        if not self.newest and version != self.pushed:
            self._push(version)
        items = self.ahead.next(self.cfg.rollout.prompts_per_step)
        if self.leader:
            parts = [
                (r, [e.prompt for e in mine], [e.answer for e in mine])
                for r in self.ranks
                for mine in [self.dist.share(items, r)]
            ]
            self.inbox.put(("sample", (step, parts, version)))
        self.requested = step

    def _receive(self, step: int) -> list:
        """The leader's batch of ``step`` from its worker: one part per rank of the worker."""
        t0 = time.monotonic()
        while True:
            try:
                kind, payload = self.outbox.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"the rollout worker ended (exit code {self.process.exitcode}) before "
                        f"sending the batch of step {step}"
                    ) from None
                if time.monotonic() - t0 > WAIT_S:
                    raise RuntimeError(
                        f"no batch from the rollout worker for step {step} in {WAIT_S:.0f} s"
                    ) from None
        if kind == "error":
            raise RuntimeError(f"the rollout worker failed:\n{payload}")
        got, version, batch = payload
        if got != step:
            raise RuntimeError(f"the rollout worker sent the batch of step {got} for step {step}")
        return [(step, version, *part[1:]) for part in batch]

    def take(self, step: int) -> tuple[Rollout, Behaviour]:
        """The worker's batch for ``step`` and its behaviour features; raises
        :class:`StaleBatch` for a batch older than k versions."""
        parts = self._receive(step) if self.leader else None
        if len(self.ranks) > 1:  # rollout.async_workers=node: the leader scatters the parts
            import torch.distributed as tdist

            out: list = [None]
            tdist.scatter_object_list(out, parts, src=self.ranks[0], group=self.group)
            mine = out[0]
        else:
            mine = parts[0]
        got, version, rollout, hidden, weights = mine
        if got != step:
            raise RuntimeError(f"step {step}: the node's rollout worker sent step {got}'s batch")
        lag = step - 1 - version
        if lag > self.k:
            raise StaleBatch(
                f"step {step}: the rollout worker's batch was sampled by policy version "
                f"{version}, {lag} versions behind, more than rollout.staleness={self.k}"
            )
        if lag < 0:
            raise RuntimeError(
                f"step {step}: the rollout worker's batch was sampled by policy version "
                f"{version}, newer than the weights that start the step (version {step - 1})"
            )
        head = unwrap(self.models.backbone).head()
        if weights is not None:
            head = head._replace(
                weight=weights[0].to(self.device),
                bias=None if weights[1] is None else weights[1].to(self.device),
            )
        else:
            head = OWN_LOGITS
        return rollout, Behaviour(version, hidden.to(self.device), head)

    def advance(self, step: int) -> None:
        """After ``step`` (its version kept in the ring): with ``newest`` that version (while
        steps are left to sample), then the request of step ``step + k + 1``."""
        if self.newest and step < self.cfg.run.steps:
            self._push(step)
        self._request(step + self.k + 1)

    def close(self) -> None:
        """Stop the worker (at once if it does not stop by itself)."""
        if self.process is None:
            return
        if self.process.is_alive():
            self.inbox.put(("stop", None))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.inbox.close()
        self.outbox.close()
