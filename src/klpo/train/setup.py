"""Setting a run up and taking it down: models, optimizers, control, resume; save beside restore.

The optimizers are built by :mod:`klpo.train.optimizers`, the resume plan decided by
:mod:`klpo.train.resume` (before setup, in the preflight); setup follows it.

:func:`setup` builds everything a run holds between its steps (a :class:`TrainRun`), in the order
that fixes the random streams (the seed, the models, the data, the rewards, the control, the
optimizers, the update's generator), restores a checkpoint when the run resumes, opens the run
directory and evaluates the starting policy. :func:`save` and :func:`restore` are mirror images:
a checkpoint holds the policy (and critic, and a moved reference), every optimizer's state, every
rank's random state, the data position, the controllers, the update's generator and the mix's
window (:mod:`klpo.train.runtime.checkpoint`). :func:`teardown` ends the run.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.train import resume as plans
from klpo.train.config import ConfigError, TrainConfig, dump_config, flat
from klpo.train.data.sources import Example, PromptStream
from klpo.train.evaluate import Evaluation, cached_evaluation, evaluation_key, policy_evaluation
from klpo.train.lr_schedule import advance_lr, make_lr_scheduler
from klpo.train.models import fsdp
from klpo.train.models.backbone import is_sharded
from klpo.train.models.build import Models, build_models
from klpo.train.models.describe import parameter_lines
from klpo.train.models.load import resolve_model_path
from klpo.train.models.lora import AdapterFreeReference, base_weights, load_base_weights
from klpo.train.models.reference import ResetFn, merge_reset, weight_reset
from klpo.train.optimizers import make_optimizers
from klpo.train.outdir import DirLock
from klpo.train.rewards.model import build_rewards
from klpo.train.rollout.engines import RolloutEngine, make_engine
from klpo.train.rollout.versions import VersionRing
from klpo.train.rollout.worker import AsyncSampler
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import MetricsWriter
from klpo.train.runtime.progress import ProgressFn, fmt_duration, progress
from klpo.train.runtime.report import write_report
from klpo.train.runtime.samples import user_messages
from klpo.train.step.after_step import Control, make_kl_controller, make_penalty_controller
from klpo.train.step.kl_term import make_window
from klpo.train.step.sample_records import eval_records
from klpo.train.step.sampling import Sampling, sampling
from klpo.train.step.types import Optimizers

__all__ = [
    "TrainRun",
    "advance_lr",
    "announce",
    "evaluate_policy",
    "evaluates",
    "hold_run_dir",
    "make_lr_scheduler",
    "restore",
    "save",
    "setup",
    "teardown",
    "write_run_report",
]


@dataclass
class TrainRun:
    """Everything a run holds between its steps."""

    cfg: TrainConfig
    dist: Dist
    dir: Path
    log: Any  # print-like, silent on ranks other than the main one
    models: Models
    stream: PromptStream
    heldout: list[Example]
    reward_fns: list
    control: Control  # beta, beta_old, the mix's window, the reference's resets
    opt: Optimizers
    update_gen: torch.Generator  # the update's row order
    step0: int = 0  # the last step done before this process (a resumed run's checkpoint)
    writer: MetricsWriter | None = None  # the main rank's metrics.jsonl and TensorBoard
    progress: ProgressFn | None = None
    engine: RolloutEngine | None = None  # samples the completions (klpo.train.rollout.engines)
    last_evaluation: str = ""  # the latest held-out accuracy with its interval, for the log
    versions: VersionRing | None = None  # rollout.staleness: the last k policy versions
    sampler: AsyncSampler | None = None  # rollout.asynchronous: the rollout worker
    sampling: Sampling | None = None  # how each step samples (plain, stale ring, worker)

    @property
    def sharded(self) -> bool:
        """FSDP: the policy and its optimizer state are saved as shards (klpo.train.models.fsdp)."""
        return is_sharded(self.models.backbone)


@contextmanager
def hold_run_dir(
    cfg: TrainConfig,
    dist: Dist,
    plan: plans.RunPlan,
    *,
    resume: bool,
    allow_config_change: bool = False,
    log=print,
) -> Iterator[plans.RunPlan]:
    """Hold ``run.out_dir``'s lock (:class:`klpo.train.outdir.DirLock`) for the block, on the
    main rank, and yield the run's plan made again under it (another run may have written the
    directory since the preflight).

    Every rank learns whether the main rank could (a collective), so under torchrun no rank
    waits for a main rank that stopped: the main rank raises its error, the others a line that
    points to it.
    """
    lock = DirLock(cfg.run.out_dir, "klpo train", option="run.out_dir") if dist.is_main else None
    error: Exception | None = None
    if lock is not None:
        try:
            lock.__enter__()
            plan = plans.plan_run_dir(
                cfg, resume=resume, world=dist.world, allow_config_change=allow_config_change
            )
        except (ConfigError, OSError) as err:
            error = err
    if dist.any(error is not None):
        if lock is not None:
            lock.__exit__(None, None, None)
        if error is not None:
            raise error
        raise ConfigError(
            f"stopped: the main process (rank 0) could not take run.out_dir "
            f"{cfg.run.out_dir!r}; its error is printed beside this one"
        )
    try:
        if lock is not None and lock.note():
            log(f"note: {lock.note()}")
        yield plan
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def setup(
    cfg: TrainConfig,
    dist: Dist,
    plan: plans.RunPlan,
    examples: tuple[list[Example], list[Example]],
    log,
) -> TrainRun:
    """Load the models, build the optimizers and control, restore a checkpoint, write the run's
    config (and any allowed change of it), open its metrics, evaluate the starting policy.
    ``examples`` are the preflight's, their prompts already rendered (``data.chat``)."""
    torch.manual_seed(cfg.run.seed * 1000 + dist.rank)
    m = build_models(cfg, dist, plan.start)
    for note in m.notes:  # a model's cache that the shared paths cannot repeat
        log(note)
    for line in parameter_lines(m.policy, lora=cfg.model.lora is not None, critic=m.critic_core):
        log(line)
    train_set, heldout = examples  # rendered by the preflight (data.chat)
    stream = PromptStream(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    reward_fns = build_rewards(cfg.rewards, device=dist.device)
    control = Control(make_kl_controller(cfg), make_penalty_controller(cfg), make_window(cfg))
    opt = make_optimizers(cfg, m)
    update_gen = torch.Generator().manual_seed(cfg.run.seed)
    run = TrainRun(cfg, dist, Path(cfg.run.out_dir), log, m, stream, heldout, reward_fns, control,
                   opt, update_gen)  # fmt: skip
    if cfg.rollout.staleness:
        run.versions = VersionRing(cfg.rollout.staleness, sharded=run.sharded)
    if plan.start is not None:
        restore(run, plan)
    if run.versions is not None and not run.versions.versions:
        run.versions.keep(run.step0, m.policy)
    control.reset = reference_reset(cfg, m, opt, run.versions)
    run.writer = _open_run_dir(run, plan)
    run.engine = make_engine(cfg, m, dist, resolve_model_path(cfg.model.policy))
    if run.step0 == 0 and heldout and cfg.run.eval_every and evaluates(run):
        _evaluate_start(run)
    run.progress = progress(
        cfg.run.steps, run.step0, show=cfg.run.progress and dist.is_main, log=log,
        evaluation=lambda: run.last_evaluation,
    )  # fmt: skip
    if cfg.rollout.asynchronous:  # last: teardown stops it (a failed setup has none to stop)
        run.sampler = AsyncSampler(cfg, m, run.versions, run.stream, run.step0, dist)
        ranks = run.sampler.ranks
        if dist.is_main and len(ranks) > 1:
            log(f"rollout worker: one for ranks {ranks[0]}-{ranks[-1]} of the node, started by "
                f"rank {ranks[0]} (rollout.async_workers=node)")  # fmt: skip
    # The worker holds the ring (run.versions) itself.
    stale = run.sampler if run.sampler is not None else run.versions
    run.sampling = sampling(cfg, dist, m, run.stream, run.engine, reward_fns, stale)
    return run


def _evaluate_start(run: TrainRun) -> None:
    """The starting policy's held-out accuracy (step 0), said before and after: on a real model
    it is the run's first long wait. With ``run.eval_cache`` the result of an identical
    evaluation (the same weights, prompts, decoding and scorer:
    :func:`klpo.train.evaluate.evaluation_key`) is read from there, else computed and stored."""
    t0 = time.perf_counter()
    run.log(f"evaluating the starting policy on {len(run.heldout)} held-out problems (greedy)")
    cache = run.cfg.run.eval_cache
    key = evaluation_key(run.cfg, run.models, run.heldout) if cache and not run.sharded else None
    ev, hit = None, False
    if key is not None:
        ev, hit = cached_evaluation(
            cache, key, lambda: policy_evaluation(run.cfg, run.models, run.heldout, 0)
        )
    acc = evaluate_policy(run, 0, ev)
    said = f"; read from run.eval_cache, {key[:12]}" if hit else ""
    run.log(
        f"held-out accuracy at step 0: {run.last_evaluation} "
        f"({fmt_duration(time.perf_counter() - t0)}{said})"
    )
    if run.writer is not None:
        run.writer.write(0, {"accuracy/heldout": acc})


def evaluate_policy(run: TrainRun, step: int, ev: Evaluation | None = None) -> float:
    """The held-out accuracy of the policy at ``step`` (``ev``: its evaluation, if already at
    hand); its first ``run.log_samples`` greedy completions go to ``samples.jsonl`` (call on
    every rank that :func:`evaluates`)."""
    if ev is None:
        ev = policy_evaluation(run.cfg, run.models, run.heldout, step)
    run.last_evaluation = ev.summary()
    records = eval_records(run.cfg, run.models, ev, step, run.cfg.run.log_samples)
    if run.writer is not None:
        run.writer.samples(step, "eval", records)
    return ev.accuracy


def save(run: TrainRun, step: int) -> None:
    """Write the checkpoint of ``step`` (every rank takes part; the main rank writes)."""
    rngs = run.dist.gather_objects(ckpt_io.rng_state())
    policy = run.models.policy
    if run.sharded:  # every rank writes its shards; the main rank moves them into place
        staged = run.dir / "checkpoints" / f".shards-step_{step:06d}"
        fsdp.save_sharded(run.models.backbone, run.opt.policy, staged)
        run.dist.barrier()
        policy = fsdp.StagedShards(staged, run.models.policy.config)
    c = run.control
    # The ring of versions, whole (a collective under FSDP: every rank gathers its shards).
    ring = run.versions
    versions = ring.state_dict(policy=run.models.policy) if ring is not None else None
    if run.dist.is_main:
        weights = ckpt_io.Weights(
            policy,
            critic=run.models.critic_core,
            reference=_moved_reference(run),
            versions=versions,
        )
        ckpt_io.save_checkpoint(
            run.dir,
            step,
            weights,
            optimizers=_saved_optimizers(run),
            rng=rngs,
            state={
                "data": run.stream.state_dict(),
                "kl_controller": c.kl.state_dict(),
                "penalty_controller": c.penalty.state_dict(),
                "update_generator": run.update_gen.get_state().tolist(),
                "reference_updates": c.ref_updates,
                "lr_scheduler": run.opt.lr_scheduler.state_dict(),
                **({"mix_window": c.window.state_dict()} if c.window is not None else {}),
            },
            keep=run.cfg.run.save_total_limit,
        )
    run.dist.barrier()


def restore(run: TrainRun, plan: plans.RunPlan) -> None:
    """Continue ``run`` from the checkpoint ``plan.start``: what :func:`save` wrote, read back
    (the models' weights were loaded by :func:`klpo.train.models.build.build_models`)."""
    cfg, dist, m, opt, c = run.cfg, run.dist, run.models, run.opt, run.control
    start, meta = plan.start, plan.meta
    run.step0 = meta["step"]
    optimizers = {"policy": opt.policy} | ({"critic": opt.critic} if opt.critic else {})
    if fsdp.is_sharded_checkpoint(start):  # (preflight checked that this run is sharded)
        fsdp.load_sharded(m.backbone, opt.policy, start / "policy")
        del optimizers["policy"]
    # After an allowed change of algorithm, an optimizer the checkpoint lacks starts fresh.
    ckpt_io.restore_optimizers(
        start, {k: o for k, o in optimizers.items() if k in meta["optimizers"]}, meta
    )
    c.kl.load_state_dict(meta["kl_controller"])
    c.penalty.load_state_dict(meta["penalty_controller"])
    if c.window is not None and "mix_window" in meta:  # absent after an allowed change
        c.window.load_state_dict(meta["mix_window"])
    c.ref_updates = int(meta.get("reference_updates", 0))
    saved_versions = ckpt_io.version_tensors(start)
    if run.versions is not None and saved_versions is not None:
        run.versions.load_state_dict(saved_versions, policy=m.policy)
        run.versions.forget_after(run.step0)
    run.stream.load_state_dict(meta["data"])
    restore_lr_scheduler(opt.lr_scheduler, meta.get("lr_scheduler"), run.step0)
    run.update_gen.set_state(torch.tensor(meta["update_generator"], dtype=torch.uint8))
    if plan.saved_world == dist.world:
        ckpt_io.restore_rng(start, meta, rank=dist.rank)
    else:  # an allowed change of world size: each rank's sampling stream starts anew
        torch.manual_seed(cfg.run.seed * 1000 + dist.rank + 7919 * run.step0)
    if isinstance(m.reference, AdapterFreeReference):
        # LoRA: after a merge-and-restart the base is part of the policy, so it is loaded
        # whenever the checkpoint holds it (the adapters were loaded by build_models).
        if cfg.kl.reference_reset is not None or (start / ckpt_io.REFERENCE).is_file():
            tensors = ckpt_io.reference_tensors(start)
            load_base_weights(m.policy, tensors, str(start / ckpt_io.REFERENCE))
    elif cfg.kl.reference_reset is not None:
        ckpt_io.restore_reference(start, m.reference.model)
    run.log(f"resuming {run.dir} from step {run.step0}")


def restore_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LRScheduler, saved: dict[str, Any] | None, step: int
) -> None:
    """Continue the schedule after ``step``: from its saved state, with the base learning rate
    of this run's config (an allowed change of optim.lr holds); a checkpoint written before
    schedules were saved resumes at ``step``, where the warm-up it followed then stood."""
    state = dict(scheduler.state_dict())
    if saved is not None:
        state.update({k: v for k, v in saved.items() if k not in ("base_lrs", "lr_lambdas")})
    else:
        state["last_epoch"] = step
    scheduler.load_state_dict(state)


def _saved_optimizers(run: TrainRun) -> dict[str, torch.optim.Optimizer]:
    """The optimizers whose state goes to optim.safetensors (a sharded policy's does not)."""
    o = run.opt
    policy = {} if run.sharded else {"policy": o.policy}
    return policy | ({"critic": o.critic} if o.critic else {})


def _moved_reference(run: TrainRun) -> torch.nn.Module | dict[str, Tensor] | None:
    """What a checkpoint saves of a reference that kl.reference_reset moves: the reference
    model, or with LoRA the merged base weights (klpo.train.models.lora); None when frozen."""
    if run.cfg.kl.reference_reset is None:
        return None
    if isinstance(run.models.reference, AdapterFreeReference):
        return base_weights(run.models.policy)
    return run.models.reference.model


def reference_reset(
    cfg: TrainConfig, m: Models, opt: Optimizers, ring: VersionRing | None = None
) -> ResetFn | None:
    """How ``kl.reference_reset`` moves the reference, chosen once: LoRA's merge-and-restart
    when the reference is the policy's base (which restarts a stale sampler's ``ring`` too: its
    adapters belong to the old base), else a weight copy (None: a frozen reference)."""
    r = cfg.kl.reference_reset
    if r is None:
        return None

    def clear() -> None:
        opt.policy.state.clear()

    if not isinstance(m.reference, AdapterFreeReference):
        return weight_reset(
            m.reference.model, m.policy, r.alpha, clear if r.reset_optimizer else None
        )
    merge = merge_reset(m.policy, cfg.run.seed, clear)
    if ring is None:
        return merge

    def merge_and_restart_ring(updates: int) -> None:
        merge(updates)
        ring.restart()

    return merge_and_restart_ring


def _open_run_dir(run: TrainRun, plan: plans.RunPlan) -> MetricsWriter | None:
    """On the main rank: the run directory made, a half-saved checkpoint's remains removed, an
    earlier run's metrics kept aside, a config change recorded, config.yaml written, the KL
    choice's note said; returns its metrics writer (None on other ranks)."""
    cfg, run_dir, log = run.cfg, run.dir, run.log
    if not run.dist.is_main:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in plan.replace:  # an unstarted run's files (plans.unstarted_run), said so before
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    for orphan in ckpt_io.remove_orphans(run_dir):
        log(f"note: removed {orphan}, the remains of a checkpoint save that did not finish")
    if plan.restart and (kept := plans.keep_old_metrics(run_dir)) is not None:
        log(f"note: the earlier metrics of this run are kept in {kept}")
    if plan.changes:
        plans.record_config_change(run_dir, run.step0, plan.changes)
        log(f"note: config change recorded in {run_dir / plans.CHANGES_FILE}")
    ckpt_io.write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
    note = announce(cfg)
    if note:
        log(note)
    trackers = [t for t in cfg.run.report_to if t != "tensorboard" or cfg.run.tensorboard]
    return MetricsWriter(
        run_dir,
        resume_step=run.step0,
        report_to=trackers,
        run_name=cfg.run.run_name,
        config=flat(cfg),
        users=user_messages([*run.stream.examples, *run.heldout]),  # report.md's prompt column
    )


def announce(cfg: TrainConfig) -> str | None:
    """The `explain` text of the KL choice when its gradient is not that of the KL it logs."""
    placement = cfg.kl.placement
    if not (kl.in_loss(placement) or kl.in_reward(placement)) or cfg.kl.beta == 0:
        return None
    e = kl.explain(cfg.kl.estimator, placement)
    if not e.mismatch:
        return None
    return (
        "Note: this KL choice is allowed, but its expected gradient is not that of the KL it "
        "logs (klpo explain):\n" + e.text()
    )


def evaluates(run: TrainRun) -> bool:
    """Whether this rank runs the held-out evaluation: the main rank; under FSDP every rank, since
    a sharded forward is collective (greedy decoding of the same problems with the same weights,
    so all ranks take the same number of forwards)."""
    return run.dist.is_main or run.sharded


def teardown(run: TrainRun, *, finished: bool) -> None:
    """Stop the progress bar, close the engine and the metrics; after a finished run, write its
    report."""
    run.progress(None, None)
    run.engine.close()
    if run.sampler is not None:
        run.sampler.close()
    if run.writer is None:
        return
    try:
        run.writer.close()
    except OSError:
        if finished:
            raise
        # (the run already stopped on an error, e.g. a full disk: that one is the one to say)
    if finished:
        run.log(f"wrote {write_run_report(run)}")


def write_run_report(run: TrainRun) -> Path | None:
    """On the main rank, the run's ``report.md`` and plots from its metrics so far (at every
    checkpoint and at the end, so an interrupted run has them); None on other ranks."""
    if run.writer is None:
        return None
    cfg = run.cfg
    return write_report(
        run.dir, estimator=cfg.kl.estimator, title=f"klpo train: {cfg.algo.name}",
        heldout_n=len(run.heldout) or None,
    )  # fmt: skip
