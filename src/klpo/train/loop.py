"""`klpo train`: GRPO, PPO, RLOO and REINFORCE++ as one recipe over the trainer's parts.

A run is :func:`~klpo.train.preflight.preflight` (every check that can fail, before any model
loads or file is written), :func:`~klpo.train.setup.setup`, :func:`run_steps` (one
:func:`train_step` each, with held-out evaluation and checkpoints) and
:func:`~klpo.train.setup.teardown`. One step reads as the algorithm::

    share out prompts -> sample (rollout.engines) -> the reference's samples where the KL term
    needs them (step.kl_term) -> score: rewards, log-probs, advantages (step.score) -> update
    (step.update) -> metrics (step.step_metrics) -> after-step control (step.after_step)

Every piece of math is a library function and every variant a table read once
(:data:`klpo.train.algorithms.ALGORITHMS`, :data:`~klpo.train.algorithms.POLICY_LOSSES`,
:data:`klpo.kl.SPECS`, :data:`klpo.train.rollout.engines.ENGINES`);
docs/architecture.md draws the rooms. A run is never lost: SIGINT/SIGTERM end it after the current
step with a checkpoint (:mod:`klpo.train.runtime.stop`), and under ``torchrun`` a rank that fails
leaves at once so that the group stops rather than hangs.

Under ``torchrun`` each rank samples its share of the step's prompts (whole groups) and every loss
is divided by the global token (or sequence) count, so the gradient equals that of one process
holding the whole batch (batch-whitening merges every rank's statistics,
:func:`klpo.train.algorithm_fns.whiten_over_ranks`); the metrics are ratios of sums over
micro-batches and ranks (:class:`klpo.train.runtime.metrics.Tally`), so they too are the whole
batch's at any split.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

from klpo.train.config import TrainConfig
from klpo.train.outdir import DirLock
from klpo.train.preflight import preflight
from klpo.train.rewards.functions import TrainerState, get_reward
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.dist import Dist, PeerFailed, init_distributed, is_peer_failure, shutdown
from klpo.train.runtime.stop import Interrupted, StopOnSignal, klpo_command
from klpo.train.setup import (
    TrainRun,
    advance_lr,
    announce,
    evaluate_policy,
    evaluates,
    hold_run_dir,
    save,
    setup,
    teardown,
    write_run_report,
)
from klpo.train.step.kl_term import sample_kl_term
from klpo.train.step.sample_records import train_records
from klpo.train.step.score import score
from klpo.train.step.step_metrics import step_metrics
from klpo.train.step.types import Scored
from klpo.train.step.update import update

__all__ = ["TrainingDiverged", "check_run", "run_steps", "train", "train_step"]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became non-finite; the run stopped at that step."""


def train(
    cfg: TrainConfig, *, resume: bool = False, log=print, allow_config_change: bool = False
) -> Path:
    """Run (or resume) training; returns the run directory.

    ``allow_config_change`` lets a resume continue with a changed config or number of processes
    (recorded in the run's ``config-changes.jsonl``); without it such a resume is refused.
    SIGINT/SIGTERM stop the run after the current step with a checkpoint.
    """
    dist = init_distributed(cfg.run.threads, log=log)
    failed = True
    try:
        with StopOnSignal() as stopper:
            out = _train(
                cfg,
                dist,
                resume,
                log if dist.is_main else (lambda *_: None),
                allow_config_change=allow_config_change,
                stopper=stopper,
            )
        failed = False
        return out
    except Exception as err:
        if dist.enabled and is_peer_failure(err):
            raise PeerFailed(
                f"rank {dist.rank}: stopped because another process of the run failed (its "
                "error is printed above by that rank)"
            ) from None
        raise
    finally:
        # A failed rank leaves without a barrier: the others may wait in another collective.
        shutdown(dist, failed=failed)


def check_run(
    cfg: TrainConfig, *, resume: bool = False, log=print, allow_config_change: bool = False
) -> None:
    """``klpo train --check``: every check of :func:`~klpo.train.preflight.preflight` (for the
    number of processes in ``WORLD_SIZE``, one by default) and the reward functions looked up,
    without loading a model or writing a file; raises what a run would raise before it starts."""
    dist = Dist(world=int(os.environ.get("WORLD_SIZE", "1")))
    preflight(cfg, dist, resume=resume, log=log, allow_config_change=allow_config_change)
    DirLock.probe(cfg.run.out_dir, "run.out_dir")  # a run would be refused while it is held
    names = [t.name for t in cfg.rewards if t.name != "model"] + [cfg.gold_reward or "exact_match"]
    for name in names:
        get_reward(name)
    note = announce(cfg)  # the start-up note of a run, for a KL whose gradient is not its value's
    if note:
        log(note)


def _train(
    cfg: TrainConfig,
    dist: Dist,
    resume: bool,
    log,
    *,
    allow_config_change: bool = False,
    stopper: StopOnSignal | None = None,
) -> Path:
    plan, examples = preflight(
        cfg, dist, resume=resume, log=log, allow_config_change=allow_config_change
    )
    with hold_run_dir(
        cfg, dist, plan, resume=resume, allow_config_change=allow_config_change, log=log
    ) as plan:  # one process at a time writes a run directory
        try:
            run = setup(cfg, dist, plan, examples, log)
            finished = False
            try:
                run_steps(run, stopper)
                finished = True
            finally:
                teardown(run, finished=finished)
        except OSError as err:
            if isinstance(err, ckpt_io.CheckpointError) or not ckpt_io.disk_full(err):
                raise
            raise ckpt_io.CheckpointError(_disk_full(Path(cfg.run.out_dir), err)) from None
    return run.dir


def _disk_full(run_dir: Path, err: OSError) -> str:
    """What a full disk outside a checkpoint save says (a checkpoint's own failure says more,
    :class:`klpo.train.runtime.checkpoint.CheckpointError`): the file, what is kept, the free
    space, how to go on; the run directory is left as ``--resume`` continues it."""
    import shutil

    where = f" {err.filename}" if getattr(err, "filename", None) else " a file"
    last = ckpt_io.latest_checkpoint(run_dir) if run_dir.is_dir() else None
    kept = (
        f"the last complete checkpoint {last.name} is intact, and the resume continues from it"
        if last is not None
        else "no checkpoint was written yet, so the resume starts again from step 0 (the "
        "metrics so far are kept aside)"
    )
    probe = run_dir if run_dir.is_dir() else run_dir.parent
    free = shutil.disk_usage(probe).free if probe.is_dir() else 0
    return (
        f"could not write{where} in {run_dir}: No space left on device (the disk is full: "
        f"{ckpt_io.format_size(free)} free there); nothing already written was changed, and "
        f"{kept}. Free space and continue with klpo train --resume {run_dir}"
    )


def train_step(run: TrainRun, step: int) -> tuple[dict[str, float], float, Scored]:
    """One step: its metrics (without the held-out evaluation), the number of completion
    tokens it trained on over all ranks, and this rank's scored rollout."""
    cfg, dist, m = run.cfg, run.dist, run.models
    t0 = time.perf_counter()
    lr = advance_lr(run.opt)  # optim.lr_scheduler's value at this step
    progress = TrainerState(global_step=step - 1, max_steps=cfg.run.steps)
    # Sample (plain, a stale ring's version or the worker's, as chosen at setup).
    got = run.sampling.sample(step, progress)
    t1 = time.perf_counter()
    # The step's KL term with the controllers' coefficients (and the reference's samples).
    beta, beta_old = run.control.kl.value, run.control.penalty.value
    term = sample_kl_term(cfg, m, got.examples, got.rollout, run.control.window, beta=beta,
                          beta_old=beta_old)  # fmt: skip
    t1r = time.perf_counter()
    # Score (rewards, log-probs, advantages), then update.
    scored = score(cfg, m, got.rollout, run.reward_fns, term.beta, dist, examples=got.examples,
                   state=progress, totals=got.totals)  # fmt: skip
    t2 = time.perf_counter()
    upd = update(cfg, m, scored, run.opt, term, dist, run.update_gen)
    t3 = time.perf_counter()
    # Control: the controllers see the whole step's metrics, the same on every rank.
    metrics = step_metrics(cfg, scored, upd, dist, term)
    metrics.update(run.sampling.metrics(got, scored, step))
    run.control.after_step(cfg, step, metrics, term)
    run.sampling.end_step(step)
    times = {"time/generate": t1 - t0, "time/score": t2 - t1r, "time/update": t3 - t2}
    metrics.update({"beta": term.beta, "lr": lr, **times, **got.metrics})
    return metrics, float(dist.all_sum(got.rollout.mask.sum()).item()), scored


def _samples_due(cfg: TrainConfig, step: int, last: bool) -> bool:
    """Whether the step's completions go to samples.jsonl (``run.log_samples_every``)."""
    every = cfg.run.log_samples_every
    return cfg.run.log_samples > 0 and (last or bool(every and step % every == 0))


def run_steps(run: TrainRun, stopper: StopOnSignal | None = None) -> None:
    """Steps ``step0 + 1 ..`` until ``run.steps`` or the time limit; checkpoint as configured,
    and after a step in which ``stopper`` caught SIGINT/SIGTERM on any rank (then stop)."""
    cfg = run.cfg
    t_start = time.perf_counter()
    unscored_said = False
    for step in range(run.step0 + 1, cfg.run.steps + 1):
        t0 = time.perf_counter()
        metrics, tokens, scored = train_step(run, step)
        if metrics.get("reward/unscored", 0.0) >= 1.0 and not unscored_said:
            unscored_said = True  # said once: the user's reward returns None for everything
            run.log(_unscored_warning(run, step))
        last = step == cfg.run.steps or (
            cfg.run.time_limit is not None and time.perf_counter() - t_start > cfg.run.time_limit
        )
        if run.writer is not None and _samples_due(cfg, step, last):
            run.writer.samples(step, "train", train_records(cfg, scored, step, cfg.run.log_samples))
        if run.heldout and cfg.run.eval_every and (step % cfg.run.eval_every == 0 or last):
            if evaluates(run):
                acc = evaluate_policy(run, step)
                if run.dist.is_main:
                    metrics["accuracy/heldout"] = acc
            run.dist.barrier()
        metrics["time/step"] = time.perf_counter() - t0
        metrics["time/cpu"] = time.process_time()  # this process's CPU seconds so far
        metrics["tokens_per_s"] = tokens / metrics["time/step"]
        if run.writer is not None:
            run.writer.write(step, metrics)
        run.progress(step, metrics)
        if last and "accuracy/heldout" in metrics and not getattr(run.progress, "shows", False):
            # the run's "after", beside step 0's "before" (the progress says it where shown)
            run.log(f"held-out accuracy at step {step}: {run.last_evaluation}")
        _check_finite(run, step, metrics)
        stop = run.dist.any(stopper is not None and stopper.requested) and not last
        if last or stop or (cfg.run.save_every and step % cfg.run.save_every == 0):
            save(run, step)
            if not last:  # (teardown writes the finished run's)
                write_run_report(run)
        if stop:
            raise _interrupted(run.dir, step, stopper)
        if last:
            break


def _unscored_warning(run: TrainRun, step: int) -> str:
    names = ", ".join(repr(t.name) for t in run.cfg.rewards)
    return (
        f"warning: step {step}: no reward function ({names}) scored any of the step's "
        "completions (each returned None for every one), so the step had no reward signal and "
        "its reward/mean of 0.0 is no measurement; a function returns None only for a sample "
        "it cannot score (see reward/unscored), so check what it returns"
    )


def _check_finite(run: TrainRun, step: int, metrics: dict[str, float]) -> None:
    """Stop the run (:class:`TrainingDiverged`) when its loss or gradient norm is not finite."""
    bad = [k for k in ("loss/total", "grad_norm") if not math.isfinite(metrics.get(k, 0.0))]
    if bad:
        raise TrainingDiverged(
            f"step {step}: {', '.join(f'{k} = {metrics[k]}' for k in bad)}; the weights are "
            "no longer finite, so training stopped (metrics up to this step are in "
            f"{run.dir / 'metrics.jsonl'}). {_divergence_advice(run.cfg)}"
        )


LARGE_BETA = 10.0
"""A KL coefficient above which a divergence is the KL term's own: its gradient, beta times the
KL's, outweighs the policy gradient's (whose advantages are of order 1)."""


def _divergence_advice(cfg: TrainConfig) -> str:
    """What to change after a divergence: a KL coefficient that dwarfs the policy gradient is
    the first suspect; otherwise the learning rate, and a KL that holds the policy nearer."""
    k = cfg.kl
    if k.placement != "none" and k.beta >= LARGE_BETA:
        return (
            f"kl.beta={k.beta:g} is large: the KL term's gradient, beta times the KL's, "
            "outweighs the policy gradient's; lower kl.beta (0.01-1 is the usual range), or "
            "optim.lr"
        )
    more = "" if k.placement == "none" else " or raise kl.beta (a KL term holds the policy nearer)"
    return f"Lower optim.lr{more}."


def _interrupted(run_dir: Path, step: int, stopper: StopOnSignal | None) -> Interrupted:
    """The end of a run stopped by a signal after the checkpoint of ``step``: say where it is."""
    mine = stopper is not None and stopper.requested
    return Interrupted(
        f"stopped by {stopper.name if mine else 'a signal to another rank'} after step {step}; "
        f"the checkpoint is {run_dir / 'checkpoints' / f'step_{step:06d}'} and the metrics up "
        f"to it are in {run_dir / 'metrics.jsonl'}. Continue with: {klpo_command()} train "
        f"--resume {run_dir}",
        stopper.signum if mine else signal.SIGTERM,
    )
