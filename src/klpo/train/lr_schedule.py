"""The learning-rate schedule checked before a model loads: its arguments and its reach.

``optim.lr_scheduler_kwargs`` go to the schedule's function in transformers' ``get_scheduler``
(its ``scheduler_specific_kwargs``); a name the function does not take would be a TypeError after
the models load, and under ``constant`` / ``constant_with_warmup``, which ``get_scheduler`` calls
without them, they would be dropped without a word. :func:`check_lr_schedule` refuses both and
then walks the schedule itself over ``run.steps`` (on a stand-in parameter, no model): a
schedule under which no step has a learning rate above zero is refused (nothing would train),
one that never reaches ``optim.lr`` because the warm-up is longer than the run is warned about.
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

from klpo.train.config import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "advance_lr",
    "check_lr_schedule",
    "lr_factors",
    "make_lr_scheduler",
    "schedule_kwargs",
]

# Arguments get_scheduler fills itself; the rest of a schedule function's are the user's.
_FILLED = frozenset({"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"})
# Schedules get_scheduler calls without scheduler_specific_kwargs (transformers.optimization).
_NO_KWARGS = frozenset({"constant", "constant_with_warmup"})


def schedule_kwargs(name: str) -> list[str]:
    """The arguments ``optim.lr_scheduler_kwargs`` may give the schedule ``name``."""
    if name in _NO_KWARGS:
        return []
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    fn = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
    return [p for p in inspect.signature(fn).parameters if p not in _FILLED]


def lr_factors(cfg: Any) -> list[float]:
    """``lambda(s)`` for steps s = 1..run.steps, as the trainer steps the schedule
    (:func:`advance_lr` before each update), on a stand-in parameter."""
    import torch

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    holder = type("Opt", (), {})()
    holder.policy, holder.lr_scheduler = opt, make_lr_scheduler(cfg, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [advance_lr(holder) for _ in range(cfg.run.steps)]


def check_lr_schedule(cfg: Any) -> list[str]:
    """Raise ConfigError for kwargs the schedule does not take, or a schedule under which no
    step trains; return warning lines (a peak learning rate short of ``optim.lr``)."""
    o = cfg.optim
    allowed = schedule_kwargs(o.lr_scheduler)
    unknown = [k for k in o.lr_scheduler_kwargs if k not in allowed]
    if unknown:
        takes = (
            f"takes {', '.join(allowed)}"
            if allowed
            else "takes none (transformers' get_scheduler passes it none)"
        )
        raise ConfigError(
            f"optim.lr_scheduler_kwargs: {', '.join(map(repr, unknown))} is not an argument of "
            f"the {o.lr_scheduler} schedule, which {takes}; remove it, or choose the schedule "
            "it belongs to (e.g. min_lr_rate: cosine_with_min_lr; num_cycles: "
            "cosine_with_restarts)"
        )
    try:
        factors = lr_factors(cfg)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"optim.lr_scheduler={o.lr_scheduler} with optim.lr_scheduler_kwargs="
            f"{dict(o.lr_scheduler_kwargs)} cannot be built: {err}"
        ) from None
    peak = max(factors, default=1.0)
    steps, warm = cfg.run.steps, o.warmup_steps
    if peak <= 0.0:
        raise ConfigError(
            f"the learning rate is 0 at every one of the run's {steps} steps "
            f"(optim.lr_scheduler={o.lr_scheduler}, optim.warmup_steps={warm}, run.steps="
            f"{steps}), so nothing would train; lower optim.warmup_steps below run.steps "
            "(e.g. to a tenth of it), or raise run.steps"
        )
    if warm > steps:
        return [
            f"optim.warmup_steps={warm} is longer than the run (run.steps={steps}): the "
            f"learning rate peaks at {peak:.1%} of optim.lr={o.lr:g} (step "
            f"{factors.index(peak) + 1}); lower "
            "optim.warmup_steps (e.g. to a tenth of run.steps), or raise run.steps"
        ]
    return []


def make_lr_scheduler(
    cfg: Any, optimizer: torch.optim.Optimizer
) -> torch.optim.lr_scheduler.LRScheduler:
    """The policy's schedule (``optim.lr_scheduler``) from transformers' ``get_scheduler``,
    over ``run.steps`` with ``optim.warmup_steps`` of warm-up. :func:`advance_lr` before step s
    sets lr · lambda(s): the default, constant_with_warmup, is lr · min(1, s / warmup_steps)."""
    from transformers import get_scheduler

    o = cfg.optim
    return get_scheduler(
        o.lr_scheduler,
        optimizer,
        num_warmup_steps=o.warmup_steps,
        num_training_steps=cfg.run.steps,
        scheduler_specific_kwargs=dict(o.lr_scheduler_kwargs) or None,
    )


def advance_lr(opt: Any) -> float:
    """Move the schedule on to the next step (before its update; the optimizer's own order of
    step calls does not apply here) and return the policy's learning rate for it. ``opt`` holds
    ``policy`` (the optimizer) and ``lr_scheduler`` (:class:`klpo.train.setup.Optimizers`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        opt.lr_scheduler.step()
    return float(opt.policy.param_groups[0]["lr"])
