"""``optim``, ``run`` and ``dist``: the optimiser, the run's outputs and schedule, the processes."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from klpo.train.config.common import LR_SCHEDULERS, Section, Tracker, one_of


class OptimConfig(Section):
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate of the policy.")
    critic_lr: float | None = Field(None, gt=0, description="Critic learning rate (default: lr).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float | None = Field(1.0, gt=0, description="Global gradient-norm clip (null: off).")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up, in steps.")
    lr_scheduler: str = Field(
        "constant_with_warmup",
        description="The policy's learning-rate schedule, by transformers' scheduler factory "
        f"(get_scheduler): {', '.join(LR_SCHEDULERS)}. Step s runs at optim.lr · lambda(s), "
        "with optim.warmup_steps of linear warm-up and run.steps as the training length; the "
        "default is a warm-up to optim.lr, then constant.",
    )
    lr_scheduler_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra arguments of the schedule (get_scheduler's "
        "scheduler_specific_kwargs), e.g. {min_lr_rate: 0.1} for cosine_with_min_lr, "
        "{num_cycles: 2} for cosine_with_restarts.",
    )

    @field_validator("lr_scheduler")
    @classmethod
    def _known_scheduler(cls, v: str) -> str:
        return one_of("optim.lr_scheduler", v, LR_SCHEDULERS)

    @field_validator("betas")
    @classmethod
    def _decay_rates(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(
                f"each must be in [0, 1) (AdamW's decay rates of its moment averages), got "
                f"[{v[0]:g}, {v[1]:g}]; e.g. [0.9, 0.999]"
            )
        return v


class RunConfig(Section):
    steps: int = Field(1500, gt=0, description="Training steps (one batch of rollouts each).")
    seed: int = Field(0, description="Seed of everything: data order, sampling, init.")
    out_dir: str = Field(
        "runs/train",
        description="Run directory: metrics, checkpoints, report. New or empty, or a run to "
        "continue with --resume; anything else is refused (see Output directories below).",
    )
    eval_every: int = Field(250, ge=0, description="Held-out evaluation period in steps (0: off).")
    save_every: int = Field(
        500, ge=0, description="Checkpoint period in steps (0: only at the end)."
    )
    threads: int = Field(
        0,
        ge=0,
        description="torch threads per process (0: the cores free at the start, shared between the processes; one line says so when the machine is loaded).",
    )
    time_limit: float | None = Field(
        None, gt=0, description="Stop cleanly after this many seconds of training."
    )
    tensorboard: bool = Field(
        True, description="Write TensorBoard event files when run.report_to lists tensorboard."
    )
    progress: bool = Field(True, description="Show a progress bar on the terminal.")
    report_to: list[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Where the metrics also go, besides metrics.jsonl: any of tensorboard, "
        "wandb (extra klpo[wandb]; WANDB_PROJECT, WANDB_MODE, ...), mlflow (extra "
        "klpo[mlflow]; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME), each through its own "
        "library (docs/tracking.md).",
    )
    run_name: str | None = Field(
        None, description="The run's name in the trackers (default: run.out_dir's last part)."
    )
    log_samples: int = Field(
        4,
        ge=0,
        description="Completions written to samples.jsonl (and the trackers, and report.md) "
        "each time: a step's, spread over its prompts, the first held-out problems at an "
        "evaluation (0: none).",
    )
    log_samples_every: int = Field(
        50,
        ge=0,
        description="Write a step's completions every N steps and at the last (0: only at "
        "evaluations); held-out completions are written at every evaluation.",
    )
    eval_cache: str | None = Field(
        None,
        description="Directory of a cache of the starting policy's held-out evaluation (step 0), "
        "keyed by a hash of all it depends on: the weights, the prompts' tokens, the decoding, "
        "the scoring reward's source, the versions. Runs that start from the same weights (a "
        "LoRA study's, whatever their seed, beta or KL choice) evaluate once; klpo compare "
        "sets it to OUT/eval-cache. The files are the run's own format; delete the directory "
        "to recompute.",
    )
    save_total_limit: int | None = Field(
        2,
        ge=1,
        description="Checkpoints kept: the newest N complete ones (the one a resume starts "
        "from is the newest); older ones are deleted after each save (null: keep all).",
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _trl_string(cls, v: Any) -> Any:
        """TRL's ``report_to`` is also a string: ``"none"`` (no tracker) or one tracker's name."""
        if isinstance(v, str):
            return [] if v.strip().lower() == "none" else [v.strip()]
        return v

    @field_validator("out_dir")
    @classmethod
    def _a_directory(cls, v: str) -> str:
        if not v.strip():
            raise ValueError(
                "is empty, which would write the run into the current directory; give the "
                "run a directory of its own, e.g. run.out_dir=runs/train-1"
            )
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _a_list_of_trackers(cls, v: Any) -> Any:
        # A single name as a string (transformers' report_to="wandb"); none: metrics.jsonl only.
        if isinstance(v, str):
            return [] if v.strip().lower() in ("none", "") else [v.strip()]
        return v


class DistConfig(Section):
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How torchrun's processes share the models: ddp replicates them; fsdp "
        "shards parameters, gradients and optimizer state over all processes (FSDP2 "
        "fully_shard), the reference too.",
    )
