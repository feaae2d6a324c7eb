"""`klpo compare`: which KL estimator, placed where, trains best and most stably?

A study is a grid of ordinary ``klpo train`` runs on the same task and budget that differ only in
the KL choice (estimator × placement × algorithm), its coefficient beta, and the seed::

    grid = study_grid(StudyConfig())          # the full default grid
    results = run_study(StudyConfig(), "runs/compare")

Each run is its own ``python -m klpo train`` process with one torch thread (two processes with two
threads each on two cores run ~50× slower), ``workers`` of them at a time. A run that exits with an
error is recorded as ``crashed``, one whose loss turned non-finite as ``diverged`` (the trainer
stops and exits with code 3), and one that finished but fell apart as ``collapsed``: its final
held-out accuracy is more than ``collapse_drop`` below its starting accuracy. None is dropped.
A study directory can be re-run: finished runs are read back, not repeated.

Written to the output directory, atomically: ``results.csv`` (one row per run), ``report.md``
(one row per choice: final held-out accuracy mean ± sd over seeds, the exact KL to the reference
at the end and at its peak, the gap between the logged estimate and the exact KL, the variance of
the final reward across seeds, failures, wall time; the estimator's noise and the steps to a
target accuracy, or gold reward on the over-optimisation task; whether a KL budget was held) and
PNG plots (accuracy and exact-KL curves with seed bands, final accuracy against final KL).

A choice may carry further ``kl.*`` keys (``options``: a controller and its target, a reference
reset, ``ref_is`` clipping) and ``algo.*`` keys (``algo_options``: GSPO, CISPO, epochs), and its
own betas (a controller row: one, the initial coefficient).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from klpo import kl
from klpo._io import write_text_atomic
from klpo.train.config import ConfigError, build_config, dump_config, one_of
from klpo.train.frontier import ChoiceFrontier, Curve, frontier_plots, frontier_table
from klpo.train.runtime.metrics import CONTROLLED_KL, read_metrics
from klpo.train.runtime.report import save_figure


class Choice(BaseModel):
    """One KL choice of the grid: an estimator in a placement, trained by one or more algorithms."""

    model_config = ConfigDict(extra="forbid")

    estimator: str = Field(description="A klpo.kl estimator (ignored when placement is none).")
    placement: Literal["loss", "reward", "reward+loss", "none"]
    algos: list[Literal["grpo", "ppo", "rloo", "reinforce++"]] = Field(
        default_factory=lambda: ["grpo"], description="Algorithms that run this choice."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further kl.* keys of this choice (e.g. ref_is_clip, mix_sign), without "
        "the 'kl.' prefix.",
    )
    algo_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further algo.* keys of this choice (e.g. policy_loss, epochs), without the "
        "'algo.' prefix.",
    )
    betas: list[float] | None = Field(
        None,
        description="This choice's own KL coefficients instead of the study's (a row with a "
        "KL controller has one: its initial beta); null: the study's betas.",
    )
    variant: str = Field(
        "", description="A short name of the options, shown after the estimator in the label."
    )

    @field_validator("estimator")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of("estimator", v, (*kl.ESTIMATORS, *kl.REF_SAMPLED))

    @field_validator("betas")
    @classmethod
    def _positive_betas(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(b <= 0 for b in v)):
            raise ValueError(f"betas must be null or a non-empty list of positive numbers, got {v}")
        return v

    @property
    def kl_target(self) -> float | None:
        """The KL budget this choice's controller steers to (``options['target']``), if any."""
        t = self.options.get("target")
        return float(t) if t is not None else None

    @property
    def label(self) -> str:
        if self.placement == "none":
            return "no KL"
        name = f"{self.estimator} ({self.variant})" if self.variant else self.estimator
        return f"{name} {self.placement}"


def _default_choices() -> list[Choice]:
    both = ["grpo", "ppo"]
    return [
        Choice(estimator="k1", placement="reward", algos=both),
        Choice(estimator="k2", placement="loss"),
        Choice(estimator="k3", placement="loss"),
        Choice(estimator="k3+", placement="loss"),
        Choice(estimator="k3_is", placement="loss"),
        Choice(estimator="full", placement="loss"),
        Choice(estimator="full", placement="reward", algos=both),
        *sequence_exact_choices(),
        Choice(estimator="k1", placement="none"),
        *ref_sampled_choices(),
    ]


def sequence_exact_choices() -> list[Choice]:
    """The two choices whose expected gradient is that of the whole sequence's
    KL(pi_theta ‖ pi_ref) (``klpo explain``'s sequence table): ``full`` and ``k3`` in the reward
    and the loss, GRPO and PPO."""
    return [
        Choice(estimator=est, placement="reward+loss", algos=["grpo", "ppo"])
        for est in ("full", "k3")
    ]


def ref_sampled_choices() -> list[Choice]:
    """The estimators that also sample the reference (the interview text's "K2" and "K3")."""
    return [
        Choice(estimator="ref_is", placement="loss"),
        Choice(
            estimator="ref_is",
            placement="loss",
            options={"ref_is_clip": [0.1, 10.0]},
            variant="clip 0.1-10",
        ),
        Choice(
            estimator="adaptive_mix",
            placement="loss",
            options={"mix_sign": "as-written"},
            variant="as written",
        ),
        Choice(
            estimator="adaptive_mix",
            placement="loss",
            options={"mix_sign": "as-described"},
            variant="as described",
        ),
    ]


class StudyConfig(BaseModel):
    """The grid and budget of a study. Every run is ``base`` plus its choice, beta and seed."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    task: Literal["builtin", "overopt"] = Field(
        "builtin",
        description="The task every run trains on: the built-in arithmetic task, or the "
        "over-optimisation task (data.source builtin-overopt: a proxy reward to train on, the "
        "gold reward logged; docs/overopt.md).",
    )
    choices: list[Choice] = Field(default_factory=_default_choices)
    betas: list[float] = Field(
        default_factory=lambda: [0.01, 0.1], description="KL coefficients tried per choice."
    )
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], description="Seeds per cell.")
    steps: int = Field(300, gt=0, description="Training steps of every run (the fixed budget).")
    eval_every: int = Field(50, gt=0, description="Held-out evaluation period in steps.")
    eval_size: int = Field(200, gt=0, description="Held-out problems per evaluation.")
    base: dict[str, Any] = Field(
        default_factory=dict, description="Train-config keys shared by all runs (dotted keys)."
    )
    ppo: dict[str, Any] = Field(
        default_factory=lambda: {
            "rollout.group_size": 4,
            "algo.epochs": 2,
            "algo.minibatches": 2,
        },
        description="Extra train-config keys of PPO runs (as configs/ppo.yaml, fixed beta).",
    )
    workers: int = Field(2, gt=0, description="Runs executed in parallel (one thread each).")
    collapse_drop: float = Field(
        0.1, ge=0, description="A finished run whose accuracy fell this far below its start."
    )
    target_accuracy: float = Field(
        0.4,
        gt=0,
        le=1,
        description="Convergence (task builtin): the first step at which the 10-step running "
        "mean of the train accuracy reaches this.",
    )
    target_gold: float = Field(
        0.3,
        gt=0,
        le=1,
        description="Convergence (task overopt): the first step at which the 10-step running "
        "mean of the gold reward (reward/gold, on the step's sampled completions) reaches this.",
    )
    kl_budget: float | None = Field(
        None,
        gt=0,
        description="A per-token exact KL budget: every run reports whether the 10-step running "
        "mean of kl/ref/exact stayed within ±20% of it over the second half of training (a "
        "choice with a KL controller is held to its own kl.target instead); null: only such "
        "choices report it.",
    )

    def convergence_target(self) -> tuple[str, float]:
        """The metric whose running mean defines "steps to target", and its threshold."""
        if self.task == "overopt":
            return "reward/gold", self.target_gold
        return "accuracy/train", self.target_accuracy

    @field_validator("betas")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        if not v or any(b <= 0 for b in v):
            raise ValueError(f"betas must be a non-empty list of positive numbers, got {v}")
        return v

    @field_validator("seeds", "choices")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("must not be empty")
        return v


def quick_study() -> StudyConfig:
    """The ``--quick`` preset: one beta, two seeds, a few steps (~2 min); every default choice
    but those that sample the reference (they double a step's cost) and the two sequence-exact
    ones (the trainer's tests run both kinds end to end)."""
    skip = {c.label for c in (*ref_sampled_choices(), *sequence_exact_choices())}
    return StudyConfig(
        choices=[c for c in _default_choices() if c.label not in skip],
        betas=[0.05],
        seeds=[0, 1],
        steps=12,
        eval_every=6,
        eval_size=40,
        base={"rollout.prompts_per_step": 8, "rollout.group_size": 4},
        ppo={"algo.epochs": 2, "algo.minibatches": 2},
    )


def quick_overopt_study() -> StudyConfig:
    """The ``--task overopt --quick`` preset: no KL and the exact KL in the loss, one beta, one
    seed, a few steps (a smoke test: two runs side by side)."""
    return StudyConfig(
        task="overopt",
        choices=[
            Choice(estimator="k1", placement="none"),
            Choice(estimator="full", placement="loss"),
        ],
        betas=[0.1],
        seeds=[0],
        steps=3,
        eval_every=3,
        eval_size=16,
        base={"rollout.prompts_per_step": 4, "rollout.group_size": 4},
    )


KL_BUDGET = 0.1  # nats per token: the over-optimisation study's KL budget (docs/overopt.md)
KL_BUDGET_SEQ = 0.4  # nats per completion: the same budget per sequence (~4 tokens a completion)


def overopt_study() -> StudyConfig:
    """The over-optimisation study's default grid (``--task overopt``): betas 0.01-0.3, 3 seeds,
    200 steps (the no-KL run's gold reward has collapsed by then):

    - no KL; ``k1`` in the reward (GRPO and PPO); ``k3``, ``k3+``, ``full`` in the loss; the two
      sequence-exact choices, ``full`` and ``k3`` in reward+loss (GRPO and PPO);
    - the reference-sampled estimators, as in the accuracy study, at beta 0.1 only (each
      samples the reference too): ``ref_is`` plain and clipped to [0.1, 10], ``adaptive_mix`` as
      written and as described;
    - off-policy updates (2 epochs × 2 minibatches, where the importance ratios differ from 1),
      at betas 0.1 and 0.3: the default KL (``full`` in the loss) with PPO's clip, GSPO (reduced
      per sequence, the paper's objective) and CISPO; ``k3`` in the loss with and without its
      off-policy correction, and ``k3_is``;
    - the default KL with a hard reset of the reference every 50 steps;
    - the default KL held to a budget by each adaptive controller (one initial beta, 0.1):
      ``KL_BUDGET`` nats per token, and for the Ziegler controller also ``KL_BUDGET_SEQ`` nats
      per sequence (its horizon 1000 samples, as the default 10000 moves beta at most ×1.7 in
      200 steps of 128 completions).
    """
    both = ["grpo", "ppo"]
    off_policy = {"epochs": 2, "minibatches": 2}
    off_betas = [0.1, 0.3]
    variant = "2 epochs x 2 minibatches"
    return StudyConfig(
        task="overopt",
        choices=[
            Choice(estimator="k1", placement="none"),
            Choice(estimator="k1", placement="reward", algos=both),
            Choice(estimator="k3", placement="loss"),
            Choice(estimator="k3+", placement="loss"),
            Choice(estimator="full", placement="loss"),
            Choice(estimator="full", placement="reward+loss", algos=both),
            Choice(estimator="k3", placement="reward+loss", algos=both),
            *(c.model_copy(update={"betas": [0.1]}) for c in ref_sampled_choices()),
            *(
                Choice(
                    estimator="full",
                    placement="loss",
                    algo_options={"policy_loss": loss, **off_policy, **extra},
                    betas=off_betas,
                    variant=f"{loss}, {variant}",
                )
                for loss, extra in (
                    ("clip", {}),
                    ("gspo", {"loss_reduction": "seq-mean-token-mean"}),
                    ("cispo", {}),
                )
            ),
            *(
                Choice(
                    estimator=est,
                    placement="loss",
                    options=options,
                    algo_options=off_policy,
                    betas=off_betas,
                    variant=f"{name}, {variant}",
                )
                for est, options, name in (
                    ("k3", {}, "corrected"),
                    ("k3", {"off_policy_correction": False}, "uncorrected"),
                    ("k3_is", {}, "own weight"),
                )
            ),
            Choice(
                estimator="full",
                placement="loss",
                options={"reference_reset": {"every": 50, "alpha": 1.0}},
                variant="reset every 50",
            ),
            Choice(
                estimator="full",
                placement="loss",
                options={"controller": "adaptive", "target": KL_BUDGET, "horizon": 1000},
                betas=[0.1],
                variant=f"adaptive, target {KL_BUDGET:g}",
            ),
            Choice(
                estimator="full",
                placement="loss",
                options={
                    "controller": "adaptive",
                    "target": KL_BUDGET_SEQ,
                    "target_unit": "sequence",
                    "horizon": 1000,
                },
                betas=[0.1],
                variant=f"adaptive, target {KL_BUDGET_SEQ:g} per sequence",
            ),
            Choice(
                estimator="full",
                placement="loss",
                options={"controller": "ppo-adaptive", "target": KL_BUDGET},
                betas=[0.1],
                variant=f"ppo-adaptive, target {KL_BUDGET:g}",
            ),
        ],
        betas=[0.01, 0.03, 0.1, 0.3],
        seeds=[0, 1, 2],
        steps=200,
        eval_every=50,
        eval_size=200,
        kl_budget=KL_BUDGET,
    )


def load_study(
    path: str | Path | None = None, *, quick: bool = False, task: str = "builtin"
) -> StudyConfig:
    """A study from YAML (keys of :class:`StudyConfig`), the quick preset, or the defaults, of
    ``task`` (``builtin`` or ``overopt``)."""
    one_of("task", task, ("builtin", "overopt"))
    if task == "overopt":
        base = quick_overopt_study() if quick else overopt_study()
    else:
        base = quick_study() if quick else StudyConfig()
    if path is None:
        return base
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"study file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"study file {str(p)!r} is not valid UTF-8 YAML: {str(err).splitlines()[0]}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"study file {str(p)!r} must hold a mapping of StudyConfig keys")
    try:
        return StudyConfig.model_validate({**base.model_dump(), **data})
    except ValidationError as err:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ConfigError(f"bad study file {str(p)!r}:\n  " + "\n  ".join(lines)) from None


# ---------------------------------------------------------------------------------------------
# The grid.


class Run(BaseModel):
    """One training run of the grid."""

    name: str
    algo: str
    choice: str
    estimator: str
    placement: str
    beta: float
    seed: int
    overrides: list[str]
    kl_target: float | None = None  # the KL budget its kl_budget_* columns judge
    kl_unit: str = "token"  # that budget's kl.target_unit: token or sequence


def _fmt(v: float) -> str:
    return f"{v:g}"


def study_grid(study: StudyConfig) -> list[Run]:
    """Every run of the study, in a stable order; each carries its ``klpo train`` overrides."""
    runs: list[Run] = []
    common = {
        "run.steps": study.steps,
        "run.eval_every": study.eval_every,
        "run.save_every": 0,
        "run.threads": 1,
        "run.progress": True,  # plain lines in each run's log.txt (it is not a terminal)
        "run.tensorboard": False,
        "data.eval_size": study.eval_size,
        **({"data.source": "builtin-overopt"} if study.task == "overopt" else {}),
        **study.base,
    }
    for choice in study.choices:
        betas = [0.0] if choice.placement == "none" else (choice.betas or study.betas)
        target = choice.kl_target if choice.kl_target is not None else study.kl_budget
        for algo in choice.algos:
            for beta in betas:
                for seed in study.seeds:
                    keys = {
                        **common,
                        **(study.ppo if algo == "ppo" else {}),
                        "algo.name": algo,
                        **{f"algo.{k}": v for k, v in choice.algo_options.items()},
                        "kl.estimator": choice.estimator,
                        "kl.placement": choice.placement,
                        "kl.beta": beta,
                        "kl.controller": "fixed",
                        **{f"kl.{k}": v for k, v in choice.options.items()},
                        "run.seed": seed,
                    }
                    tag = choice.label.replace("+", "plus")
                    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip("-")
                    runs.append(
                        Run(
                            name=f"{algo}_{tag}_b{_fmt(beta)}_s{seed}",
                            algo=algo,
                            choice=choice.label,
                            estimator=choice.estimator,
                            placement=choice.placement,
                            beta=beta,
                            seed=seed,
                            overrides=[f"{k}={json.dumps(v)}" for k, v in keys.items()],
                            kl_target=target,
                            kl_unit=choice.options.get("target_unit", "token"),
                        )
                    )
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError("the study lists the same choice twice; remove the duplicate")
    return runs


# ---------------------------------------------------------------------------------------------
# Running and summarising.

RESULT_FIELDS = [
    "name",
    "algo",
    "choice",
    "estimator",
    "placement",
    "beta",
    "seed",
    "status",
    "steps_done",
    "acc_start",
    "acc_final",
    "acc_best",
    "kl_exact_final",
    "kl_exact_peak",
    "kl_logged_final",
    "kl_gap_mean",
    "kl_est_var",
    "kl_noise_var",
    "kl_k1_noise_var",
    "steps_to_target",
    "ref_time_s",
    "kl_target",
    "kl_unit",
    "kl_budget_ratio",
    "kl_budget_frac",
    "kl_budget_held",
    "reward_final",
    "gold_final",
    "gold_peak",
    "gold_peak_kl_seq",
    "proxy_final",
    "kl_seq_final",
    "entropy_final",
    "wall_s",
    "error",
]


def _num(v: Any) -> float:
    """A metric value as float; the strings 'nan'/'inf' written for non-finite values too."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


WINDOW = 10  # steps: "final" values are means over the last WINDOW steps, peaks running means


def _tail_mean(rows: list[dict[str, Any]], key: str) -> float:
    vals = [_num(r[key]) for r in rows if key in r]
    if not vals:
        return math.nan
    tail = vals[-WINDOW:]
    return sum(tail) / len(tail)


def summarise_run(
    run: Run,
    run_dir: Path,
    *,
    returncode: int,
    wall_s: float,
    steps: int,
    collapse_drop: float,
    error: str = "",
    target_accuracy: float = 0.4,
    target_metric: str = "accuracy/train",
) -> dict[str, Any]:
    """One ``results.csv`` row from a finished (or failed) run's ``metrics.jsonl``.

    ``steps_to_target`` is the first step at which the WINDOW-step running mean of
    ``target_metric`` (``accuracy/train``, or ``reward/gold`` on the over-optimisation task)
    reaches ``target_accuracy`` (NaN if never); the ``kl_budget_*`` columns judge the run's exact
    KL against ``run.kl_target`` (:func:`kl_budget_summary`)."""
    path = run_dir / "metrics.jsonl"
    rows = read_metrics(path) if path.exists() else []
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "kl/ref/exact" in r]
    evals = [(r["step"], _num(r["accuracy/heldout"])) for r in rows if "accuracy/heldout" in r]
    kl_exact = [_num(r["kl/ref/exact"]) for r in steps_rows]
    logged_key = f"kl/ref/{run.estimator}"
    gaps = [_num(r[logged_key]) - _num(r["kl/ref/exact"]) for r in steps_rows if logged_key in r]
    acc_start = evals[0][1] if evals and evals[0][0] == 0 else math.nan
    acc_final = evals[-1][1] if evals else math.nan
    done = steps_rows[-1]["step"] if steps_rows else 0
    if returncode == 3:
        status = "diverged"
    elif returncode != 0 or done < steps:
        status = "crashed"
    elif not all(map(math.isfinite, kl_exact)) or not math.isfinite(acc_final):
        status = "diverged"
    elif acc_final < acc_start - collapse_drop:
        status = "collapsed"
    else:
        status = "ok"
    # The KL curve is noisy step to step: its peak is the largest running mean over WINDOW steps.
    smooth = [
        sum(kl_exact[i : i + WINDOW]) / len(kl_exact[i : i + WINDOW])
        for i in range(max(1, len(kl_exact) - WINDOW + 1))
        if kl_exact
    ]
    # The estimator's noise: the per-step logged estimate minus the exact KL of the same step,
    # and the same for k1 (logged by every run, on the policy's own tokens) for comparison.
    est = [_num(r[logged_key]) for r in steps_rows if logged_key in r]
    noise = [_num(r[logged_key]) - _num(r["kl/ref/exact"]) for r in steps_rows if logged_key in r]
    k1_noise = [
        _num(r["kl/ref/k1"]) - _num(r["kl/ref/exact"]) for r in steps_rows if "kl/ref/k1" in r
    ]
    reached = steps_to_reach(steps_rows, target_metric, target_accuracy)
    ref_time = math.fsum(
        _num(r.get("time/ref_sample", 0.0)) + _num(r.get("time/ref_update", 0.0))
        for r in steps_rows
    )

    gold = _gold_summary(steps_rows)
    return {
        "name": run.name,
        "algo": run.algo,
        "choice": run.choice,
        "estimator": run.estimator,
        "placement": run.placement,
        "beta": run.beta,
        "seed": run.seed,
        "status": status,
        "steps_done": done,
        "acc_start": acc_start,
        "acc_final": acc_final,
        "acc_best": max((a for _, a in evals), default=math.nan),
        "kl_exact_final": _tail_mean(steps_rows, "kl/ref/exact"),
        "kl_exact_peak": max(smooth) if kl_exact else math.nan,
        "kl_logged_final": _tail_mean(steps_rows, logged_key),
        "kl_gap_mean": sum(gaps) / len(gaps) if gaps else math.nan,
        "kl_est_var": _var(est),
        "kl_noise_var": _var(noise),
        "kl_k1_noise_var": _var(k1_noise),
        "steps_to_target": reached,
        "ref_time_s": round(ref_time, 2),
        "kl_unit": run.kl_unit,
        **kl_budget_summary(steps_rows, run.kl_target, steps, key=CONTROLLED_KL[run.kl_unit]),
        "reward_final": _tail_mean(steps_rows, "reward/mean"),
        **gold,
        "entropy_final": _tail_mean(steps_rows, "entropy"),
        "wall_s": round(wall_s, 1),
        "error": error,
    }


def steps_to_reach(rows: list[dict[str, Any]], key: str, threshold: float) -> float:
    """The first step at which the WINDOW-step running mean of ``key`` (over the rows that log
    it, the first full window onwards) is >= ``threshold``; NaN if it never is."""
    pts = [(r["step"], _num(r[key])) for r in rows if key in r]
    for i in range(WINDOW - 1, len(pts)):
        if statistics.fmean(v for _, v in pts[i - WINDOW + 1 : i + 1]) >= threshold:
            return pts[i][0]
    return math.nan


BUDGET_TOLERANCE = 0.2  # a KL budget is held if the KL stays within ±20% of it


def kl_budget_summary(
    rows: list[dict[str, Any]], target: float | None, steps: int, *, key: str = "kl/ref/exact"
) -> dict[str, float]:
    """Did the exact KL stay within ±20% of ``target`` over the second half of training?

    ``key`` is the logged KL judged: ``kl/ref/exact`` (per token) or ``kl/ref/seq`` (per
    sequence, :data:`klpo.train.runtime.metrics.CONTROLLED_KL`). For each logged step ``s > steps / 2``
    (``steps``: the run's configured length), the trailing WINDOW-step running mean ``m_s`` of
    ``key`` (the steps ``s - WINDOW + 1 .. s`` that
    were logged; the window may reach back into the first half). Returns ``kl_target``;
    ``kl_budget_ratio``, the plain mean of ``key`` over those steps divided by the target
    (> 1: overshoot, < 1: undershoot); ``kl_budget_frac``, the fraction of those steps with
    ``0.8 · target <= m_s <= 1.2 · target``; ``kl_budget_held``, 1 if that fraction is 1, else 0.
    All NaN without a target or without a logged step in the second half (a run that stopped
    early); a non-finite KL counts as outside.
    """
    out = {
        "kl_target": math.nan if target is None else float(target),
        "kl_budget_ratio": math.nan,
        "kl_budget_frac": math.nan,
        "kl_budget_held": math.nan,
    }
    pts = [(r["step"], _num(r[key])) for r in rows if key in r]
    late = [i for i, (s, _) in enumerate(pts) if s > steps / 2]
    if target is None or not late:
        return out
    kls = [k for _, k in pts]
    lo, hi = (1 - BUDGET_TOLERANCE) * target, (1 + BUDGET_TOLERANCE) * target
    inside = [lo <= statistics.fmean(kls[max(0, i - WINDOW + 1) : i + 1]) <= hi for i in late]
    frac = sum(inside) / len(inside)
    out.update(
        kl_budget_ratio=statistics.fmean(kls[i] for i in late) / target,
        kl_budget_frac=frac,
        kl_budget_held=1.0 if frac == 1.0 else 0.0,
    )
    return out


def _gold_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Over-optimisation columns: the gold and proxy rewards at the end (means of the last WINDOW
    steps), the peak of the gold reward's WINDOW-step running mean and the exact sequence KL
    (``kl/ref/seq``, same running mean) at that peak; NaN where no gold reward was logged."""
    nan = {k: math.nan for k in ("gold_final", "gold_peak", "gold_peak_kl_seq", "proxy_final")}
    out = {**nan, "kl_seq_final": _tail_mean(rows, "kl/ref/seq")}
    rows = [r for r in rows if "reward/gold" in r]
    if not rows:
        return out
    gold = [_num(r["reward/gold"]) for r in rows]
    seq = [_num(r.get("kl/ref/seq")) for r in rows]
    n = max(1, len(gold) - WINDOW + 1)
    runs = [
        (statistics.fmean(gold[i : i + WINDOW]), statistics.fmean(seq[i : i + WINDOW]))
        for i in range(n)
    ]
    peak = max(runs, key=lambda gk: _nan_low(gk[0]))
    out.update(
        gold_final=_tail_mean(rows, "reward/gold"),
        gold_peak=peak[0],
        gold_peak_kl_seq=peak[1],
        proxy_final=_tail_mean(rows, "reward/proxy"),
    )
    return out


def _var(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return statistics.variance(xs) if len(xs) > 1 else math.nan


# Keys that may differ between a finished run and the study re-run over it: how a run is shown
# and scheduled, not what it computes.
PRESENTATION_KEYS = frozenset({"run.progress", "run.threads", "run.tensorboard", "run.out_dir"})


def changed_runs(runs: list[Run], out: Path) -> list[str]:
    """A line per finished run in ``out`` whose saved config is not the one it would run now.

    Re-running a study directory reuses its finished runs; this catches a re-run with other
    settings (steps, base keys, ...), which would otherwise report old runs under new labels.
    """
    from klpo.train.preflight import flat

    lines = []
    for run in runs:
        run_dir = out / "runs" / run.name
        saved_path = run_dir / "config.yaml"
        if not (run_dir / "result.yaml").exists() or not saved_path.exists():
            continue
        try:
            saved = flat(build_config(yaml.safe_load(saved_path.read_text()) or {}))
        except (ConfigError, yaml.YAMLError):
            lines.append(f"{run.name}: its config.yaml cannot be read")
            continue
        now = flat(build_config(overrides=[*run.overrides, f"run.out_dir={run_dir}"]))
        diff = [
            f"{k} {saved.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(saved) | set(now))
            if k not in PRESENTATION_KEYS and saved.get(k) != now.get(k)
        ]
        if diff:
            lines.append(f"{run.name}: {', '.join(diff)}")
    return lines


def _execute(
    run: Run, out: Path, study: StudyConfig, on_start: Callable[[str, Path], None] | None = None
) -> dict[str, Any]:
    run_dir = out / "runs" / run.name
    done_marker = run_dir / "result.yaml"
    if done_marker.exists():  # finished in an earlier invocation of the same study
        return yaml.safe_load(done_marker.read_text())
    if run_dir.exists():  # a run interrupted mid-way: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if on_start is not None:
        on_start(run.name, run_dir / "log.txt")
    cmd = [sys.executable, "-m", "klpo", "train", "--set", f"run.out_dir={run_dir}"]
    for o in run.overrides:
        cmd += ["--set", o]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
    }
    t0 = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    wall = time.perf_counter() - t0
    error = ""
    if proc.returncode != 0:
        lines = (run_dir / "log.txt").read_text().strip().splitlines()
        error = (lines[-1] if lines else f"exit code {proc.returncode}")[:300]
    row = summarise_run(
        run,
        run_dir,
        returncode=proc.returncode,
        wall_s=wall,
        steps=study.steps,
        collapse_drop=study.collapse_drop,
        error=error,
        target_accuracy=study.convergence_target()[1],
        target_metric=study.convergence_target()[0],
    )
    write_text_atomic(done_marker, yaml.safe_dump(row, sort_keys=False))
    return row


def run_study(
    study: StudyConfig,
    out: str | Path,
    *,
    on_result: Callable[[dict[str, Any], int, int], None] | None = None,
    on_start: Callable[[str, Path], None] | None = None,
) -> list[dict[str, Any]]:
    """Run (or finish) the whole grid in ``out``; write results.csv, report.md and plots.

    A finished run found in ``out`` is reused only if its config is the one it would run with
    now; otherwise the study is refused (:func:`changed_runs`) before anything starts.
    """
    from klpo.train.preflight import check_writable_dir

    out = Path(out)
    check_writable_dir(out, "--out")
    runs = study_grid(study)
    configs = [build_config(overrides=r.overrides) for r in runs]  # fail before any run starts
    changed = changed_runs(runs, out)
    if changed:
        shown = "; ".join(changed[:3]) + (
            f"; and {len(changed) - 3} more" if len(changed) > 3 else ""
        )
        raise ConfigError(
            f"--out {out} holds finished runs of a study with other settings ({shown}). They "
            "would be reported under the new settings; use another --out, or the settings they "
            "were run with"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "study.yaml", yaml.safe_dump(study.model_dump(), sort_keys=False))
    write_text_atomic(
        out / "train-config.yaml",
        "# The first run's resolved klpo train config; others differ in kl.*, algo.*, seed.\n"
        + dump_config(configs[0]),
    )
    rows: list[dict[str, Any] | None] = [None] * len(runs)
    with ThreadPoolExecutor(max_workers=study.workers) as pool:
        futures = {pool.submit(_execute, r, out, study, on_start): i for i, r in enumerate(runs)}
        for n, fut in enumerate(as_completed(futures), start=1):
            i = futures[fut]
            try:
                rows[i] = fut.result()
            except Exception as err:  # the study goes on; the run is recorded as crashed
                rows[i] = {
                    **{k: "" for k in RESULT_FIELDS},
                    **runs[i].model_dump(include={"name", "algo", "choice", "estimator"}),
                    **runs[i].model_dump(include={"placement", "beta", "seed"}),
                    "status": "crashed",
                    "steps_done": 0,
                    "error": f"{type(err).__name__}: {err}"[:300],
                }
            if on_result is not None:
                on_result(rows[i], n, len(runs))
    results = [r for r in rows if r is not None]
    write_results(results, out, study)
    return results


# ---------------------------------------------------------------------------------------------
# The report.


def _stats(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else math.nan)


def summarise_cells(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (algo, choice, beta): means ± sd over seeds and the failure count."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        cells.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    table = []
    for (algo, choice, beta), rs in cells.items():
        acc_m, acc_s = _stats([_num(r["acc_final"]) for r in rs])
        reward_m, reward_s = _stats([_num(r["reward_final"]) for r in rs])
        table.append(
            {
                "algo": algo,
                "choice": choice,
                "beta": beta,
                "runs": len(rs),
                "failed": sum(r["status"] != "ok" for r in rs),
                "statuses": ", ".join(sorted({r["status"] for r in rs if r["status"] != "ok"})),
                "acc_start": _stats([_num(r["acc_start"]) for r in rs])[0],
                "acc_mean": acc_m,
                "acc_sd": acc_s,
                "kl_final": _stats([_num(r["kl_exact_final"]) for r in rs])[0],
                "kl_peak": _stats([_num(r["kl_exact_peak"]) for r in rs])[0],
                "kl_gap": _stats([_num(r["kl_gap_mean"]) for r in rs])[0],
                "gold_final": _stats([_num(r.get("gold_final")) for r in rs])[0],
                "gold_sd": _stats([_num(r.get("gold_final")) for r in rs])[1],
                "gold_peak": _stats([_num(r.get("gold_peak")) for r in rs])[0],
                "gold_peak_kl_seq": _stats([_num(r.get("gold_peak_kl_seq")) for r in rs])[0],
                "proxy_final": _stats([_num(r.get("proxy_final")) for r in rs])[0],
                "kl_seq_final": _stats([_num(r.get("kl_seq_final")) for r in rs])[0],
                "reward_mean": reward_m,
                "reward_var": reward_s**2 if math.isfinite(reward_s) else math.nan,
                "wall_s": _stats([_num(r["wall_s"]) for r in rs])[0],
                "ref_time_s": _stats([_num(r.get("ref_time_s")) for r in rs])[0],
                "kl_est_var": _stats([_num(r.get("kl_est_var")) for r in rs])[0],
                "kl_noise_var": _stats([_num(r.get("kl_noise_var")) for r in rs])[0],
                "kl_k1_noise_var": _stats([_num(r.get("kl_k1_noise_var")) for r in rs])[0],
                "steps_to_target": _stats([_num(r.get("steps_to_target")) for r in rs])[0],
                "reached": sum(math.isfinite(_num(r.get("steps_to_target"))) for r in rs),
                "kl_target": _stats([_num(r.get("kl_target")) for r in rs])[0],
                "kl_unit": rs[0].get("kl_unit") or "token",
                "kl_budget_ratio": _stats([_num(r.get("kl_budget_ratio")) for r in rs])[0],
                "kl_budget_frac": _stats([_num(r.get("kl_budget_frac")) for r in rs])[0],
                "kl_budget_held": sum(_num(r.get("kl_budget_held")) == 1.0 for r in rs),
            }
        )
    return table


def _f(x: float, digits: int = 3) -> str:
    return "–" if not math.isfinite(x) else f"{x:.{digits}f}"


def write_results(results: list[dict[str, Any]], out: str | Path, study: StudyConfig) -> Path:
    """Write ``results.csv``, the plots and ``report.md`` into ``out``; returns the report."""
    out = Path(out)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=RESULT_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in results:
        writer.writerow({k: r.get(k, "") for k in RESULT_FIELDS})
    write_text_atomic(out / "results.csv", buf.getvalue())
    cells = summarise_cells(results)
    plots = _plot(results, cells, out)
    fronts = _frontiers(results, cells, out) if study.task == "overopt" else []
    plots += frontier_plots(fronts, out, WINDOW) if fronts else []

    target_key, target_value = study.convergence_target()
    target_name = {
        "accuracy/train": "train accuracy",
        "reward/gold": "gold reward (`reward/gold`)",
    }[target_key]
    n_fail = sum(r["status"] != "ok" for r in results)
    run_s = math.fsum(x for r in results if math.isfinite(x := _num(r.get("wall_s"))))
    lines = [
        "# klpo compare: KL estimators and placements on real training",
        "",
        f"{len(results)} runs ({len(study.seeds)} seeds per cell, {study.steps} steps each, "
        f"{study.workers} in parallel with one thread each): {run_s / 60:.1f} minutes of runs, "
        f"about {run_s / 60 / study.workers:.1f} minutes elapsed; "
        f"{n_fail} failed (crashed, diverged or collapsed). Study: `study.yaml`; the shared "
        "training config: `train-config.yaml`; one row per run: `results.csv`.",
        "",
        "Columns: held-out accuracy (greedy) at the start and at the end, mean ± sd over seeds; "
        f"the exact full-vocabulary KL(pi_theta ‖ pi_ref) per token over the last {WINDOW} steps "
        f"and at its peak (largest {WINDOW}-step running mean); the mean gap between the logged "
        "estimate (the configured estimator) and the exact KL over the run; the variance "
        f"across seeds of the final train reward (last {WINDOW} steps); failed runs; mean wall time per run.",
        "",
        "| algo | KL choice | beta | acc start | acc final | KL final | KL peak | logged − exact "
        "| reward var | failed | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], -_nan_low(c["acc_mean"]))):
        failed = f"{c['failed']}/{c['runs']}" + (f" ({c['statuses']})" if c["failed"] else "")
        lines.append(
            f"| {c['algo']} | {c['choice']} | {_fmt(c['beta'])} | {_f(c['acc_start'])} | "
            f"{_f(c['acc_mean'])} ± {_f(c['acc_sd'])} | {_f(c['kl_final'], 4)} | "
            f"{_f(c['kl_peak'], 4)} | {_f(c['kl_gap'], 4)} | {_f(c['reward_var'], 5)} | "
            f"{failed} | {_f(c['wall_s'], 0)} |"
        )
    lines += [
        "",
        "## Estimator noise and convergence",
        "",
        "Per step, the logged estimate `kl/ref/<est>` of the choice's estimator (per token; for "
        "`ref_is` and `adaptive_mix` the reference-sampled estimate per completion divided by the "
        "policy's mean completion length) and, in the same runs, `kl/ref/k1` on the policy's own "
        "tokens. Columns: the variance of the estimate across steps (it includes the KL's drift), "
        "the variance of estimate − exact KL across steps (the estimator's noise), the same for "
        "k1 and their ratio, each the mean over seeds; the mean step at which the "
        f"{WINDOW}-step running mean of the {target_name} reaches {target_value:g} "
        "(over the seeds that reach it, their count after the slash); mean wall time per run and "
        "the part spent sampling and scoring the reference's completions.",
        "",
        "| algo | KL choice | beta | Var est | Var(est − exact) | Var(k1 − exact) | ratio | "
        "steps to target | wall s | reference s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], c["beta"], c["choice"])):
        ratio = c["kl_noise_var"] / c["kl_k1_noise_var"] if c["kl_k1_noise_var"] else math.nan
        lines.append(
            f"| {c['algo']} | {c['choice']} | {_fmt(c['beta'])} | {_g(c['kl_est_var'])} | "
            f"{_g(c['kl_noise_var'])} | {_g(c['kl_k1_noise_var'])} | {_f(ratio, 2)} | "
            f"{_f(c['steps_to_target'], 0)} ({c['reached']}/{c['runs']}) | "
            f"{_f(c['wall_s'], 0)} | {_f(c['ref_time_s'], 0)} |"
        )
    if study.task == "overopt":
        lines += frontier_table(fronts, WINDOW)
        lines += _overopt_table(cells)
    lines += _budget_table(cells)
    failures = [r for r in results if r["status"] != "ok"]
    if failures:
        lines += ["", "## Failed runs", "", "| run | status | steps | error |"]
        lines.append("| --- | --- | --- | --- |")
        for r in failures:
            err = str(r.get("error", "")).replace("|", "\\|")
            lines.append(f"| {r['name']} | {r['status']} | {r['steps_done']} | {err} |")
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    report = out / "report.md"
    write_text_atomic(report, "\n".join(lines))
    return report


def _frontiers(
    results: list[dict[str, Any]], cells: list[dict[str, Any]], out: Path
) -> list[ChoiceFrontier]:
    """One :class:`~klpo.train.frontier.ChoiceFrontier` per (algo, choice): its cells and, per
    beta, the seed means of the WINDOW-step running gold, proxy and sequence-KL curves."""
    runs: dict[tuple[str, str, float], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["algo"], r["choice"], float(r["beta"])), []).append(r)
    by_choice: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        by_choice.setdefault((c["algo"], c["choice"]), []).append(c)
    keys = ("reward/gold", "reward/proxy", "kl/ref/seq")
    fronts = []
    for (algo, choice), cs in by_choice.items():
        cs = sorted(cs, key=lambda c: c["beta"])
        curves = []
        for c in cs:
            rs = runs[(algo, choice, c["beta"])]
            bands = [
                _band([_curves(out / "runs" / r["name"], k) for r in rs], WINDOW) for k in keys
            ]
            steps = bands[0][0]
            if steps and all(b[0] == steps for b in bands):
                gold, proxy, seq = (b[1] for b in bands)
                curves.append(Curve(c["beta"], steps, gold, proxy, seq))
        fronts.append(ChoiceFrontier(algo, choice, cs, curves))
    return fronts


def _overopt_table(cells: list[dict[str, Any]]) -> list[str]:
    """The over-optimisation columns, one row per cell, by final gold reward."""
    lines = [
        "",
        "## Over-optimisation: gold against proxy reward",
        "",
        f"Gold reward (exact correctness) and proxy reward (trained on) over the last {WINDOW} "
        f"steps, the peak of the gold reward's {WINDOW}-step running mean and the exact sequence "
        "KL(pi_theta ‖ pi_ref) there, and the exact sequence KL at the end (means over seeds). "
        "proxy − gold is the over-optimisation gap.",
        "",
        "| algo | KL choice | beta | gold final | gold peak | seq KL at peak | proxy final "
        "| proxy − gold | seq KL final |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], -_nan_low(c["gold_final"]))):
        lines.append(
            f"| {c['algo']} | {c['choice']} | {_fmt(c['beta'])} | {_f(c['gold_final'])} ± "
            f"{_f(c['gold_sd'])} | {_f(c['gold_peak'])} | {_f(c['gold_peak_kl_seq'])} | "
            f"{_f(c['proxy_final'])} | {_f(c['proxy_final'] - c['gold_final'])} | "
            f"{_f(c['kl_seq_final'])} |"
        )
    return lines


def _budget_table(cells: list[dict[str, Any]]) -> list[str]:
    """Holding a KL budget, one row per cell that has one (none: no section)."""
    cells = [c for c in cells if math.isfinite(c["kl_target"])]
    if not cells:
        return []
    lines = [
        "",
        "## Holding a KL budget",
        "",
        "Over the second half of training (steps after half the budget): the mean exact KL (per "
        "token, or per sequence for a `kl.target_unit: sequence` target) divided by the target "
        "(> 1: overshoot), the fraction of steps whose "
        f"{WINDOW}-step running mean of the exact KL is within ±{BUDGET_TOLERANCE:.0%} of the "
        "target (mean over seeds), and the seeds whose every such step is (`held`). The target "
        "is the KL controller's `kl.target`, or the study's `kl_budget` for a fixed beta.",
        "",
        f"| algo | KL choice | beta | target | KL / target | steps within ±{BUDGET_TOLERANCE:.0%} | held |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in sorted(cells, key=lambda c: (c["algo"], c["choice"], c["beta"])):
        lines.append(
            f"| {c['algo']} | {c['choice']} | {_fmt(c['beta'])} | "
            f"{_g(c['kl_target'])} per {c['kl_unit']} | "
            f"{_f(c['kl_budget_ratio'], 2)} | {_f(c['kl_budget_frac'], 2)} | "
            f"{c['kl_budget_held']}/{c['runs']} |"
        )
    return lines


def _g(x: float) -> str:
    return "–" if not math.isfinite(x) else f"{x:.3g}"


def _nan_low(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def _curves(run_dir: Path, key: str) -> tuple[list[int], list[float]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return [], []
    pts = [(r["step"], _num(r[key])) for r in read_metrics(path) if key in r]
    return [s for s, _ in pts], [v for _, v in pts]


def _plot(results: list[dict[str, Any]], cells: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names: list[str] = []
    groups: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    for r in results:
        groups.setdefault((r["algo"], float(r["beta"])), {}).setdefault(r["choice"], []).append(r)
    # "no KL" runs (beta 0) are drawn in every panel of their algorithm as the baseline.
    for (algo, beta), by_choice in groups.items():
        if beta == 0.0:
            continue
        baseline = groups.get((algo, 0.0), {})
        for key, ylabel, fname, smooth in (
            ("accuracy/heldout", "held-out accuracy (greedy)", "accuracy", 1),
            ("kl/ref/exact", "exact KL(pi_theta ‖ pi_ref) per token", "kl", 10),
        ):
            fig, ax = plt.subplots(figsize=(7, 4))
            for choice, rs in sorted({**by_choice, **baseline}.items()):
                xs, mean, lo, hi = _band(
                    [_curves(out / "runs" / r["name"], key) for r in rs], smooth
                )
                if not xs:
                    continue
                (line,) = ax.plot(xs, mean, label=choice, lw=1.5)
                ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{algo}, beta = {_fmt(beta)} (mean ± sd over seeds)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(frameon=False, fontsize=8, ncol=2)
            name = f"{fname}_{algo}_b{_fmt(beta)}.png"
            save_figure(fig, out / name)
            plt.close(fig)
            names.append(name)
    # One panel per beta (the "no KL" cells in each); cells that land on the same point (k2, k3+
    # and k3_is train identically on-policy) share one label.
    betas = sorted({c["beta"] for c in cells if c["beta"] > 0}) or [0.0]
    fig, axes = plt.subplots(1, len(betas), figsize=(5.5 * len(betas), 4.5), squeeze=False)
    for ax, beta in zip(axes[0], betas, strict=True):
        points: dict[tuple[str, float, float], list[dict[str, Any]]] = {}
        for c in cells:
            if c["beta"] not in (beta, 0.0):
                continue
            if math.isfinite(c["kl_final"]) and math.isfinite(c["acc_mean"]):
                key = (c["algo"], round(c["kl_final"], 6), round(c["acc_mean"], 6))
                points.setdefault(key, []).append(c)
        for (algo, x, y), cs in sorted(points.items()):
            marker = "o" if algo == "grpo" else "s"
            ax.errorbar(x, y, yerr=_nan0(cs[0]["acc_sd"]), fmt=marker, ms=5, capsize=2)
            label = " = ".join(c["choice"] for c in cs)
            ax.annotate(
                label if algo == "grpo" else f"{algo}: {label}",
                (x, y),
                fontsize=7,
                xytext=(4, 2),
                textcoords="offset points",
            )
        ax.set_xlabel(f"final exact KL per token (mean of the last {WINDOW} steps)")
        ax.set_ylabel("final held-out accuracy (mean ± sd over seeds)")
        ax.set_title(f"beta = {_fmt(beta)} (o: grpo, s: ppo)")
        ax.grid(alpha=0.3)
    save_figure(fig, out / "accuracy_vs_kl.png")
    plt.close(fig)
    names.append("accuracy_vs_kl.png")
    return names


def _nan0(x: float) -> float:
    return x if math.isfinite(x) else 0.0


def _band(curves: list[tuple[list[int], list[float]]], smooth: int):
    """Mean and mean ± sd over seeds at the steps all curves share, after a running mean."""
    curves = [c for c in curves if c[0]]
    if not curves:
        return [], [], [], []
    common = sorted(set.intersection(*(set(xs) for xs, _ in curves)))
    series = []
    for xs, ys in curves:
        at = dict(zip(xs, ys, strict=True))
        vals = [at[s] for s in common]
        if smooth > 1:
            vals = [
                statistics.fmean(vals[max(0, i - smooth + 1) : i + 1]) for i in range(len(vals))
            ]
        series.append(vals)
    mean, lo, hi = [], [], []
    for i in range(len(common)):
        col = [s[i] for s in series if math.isfinite(s[i])]
        m = statistics.fmean(col) if col else math.nan
        sd = statistics.stdev(col) if len(col) > 1 else 0.0
        mean.append(m)
        lo.append(m - sd)
        hi.append(m + sd)
    return common, mean, lo, hi
