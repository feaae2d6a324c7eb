"""The grid: every run of a study, each with its ``klpo train`` overrides, in a stable order."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from klpo.study.spec import CHAT_OVEROPT_KEYS, StudyConfig, resolve_model
from klpo.train.config import ConfigError

__all__ = ["Run", "fmt", "study_grid"]


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


def fmt(v: float) -> str:
    return f"{v:g}"


def study_grid(study: StudyConfig) -> list[Run]:
    """Every run of the study, in a stable order; each carries its ``klpo train`` overrides
    (``study.model`` resolved to its directory: :func:`~klpo.study.spec.resolve_model`)."""
    runs: list[Run] = []
    common = {
        "run.steps": study.steps,
        "run.eval_every": study.eval_every,
        "run.save_every": 0,
        "run.threads": 1,
        "run.progress": True,  # plain lines in each run's log, OUT/logs/NAME.txt (not a terminal)
        "run.tensorboard": False,
        "data.eval_size": study.eval_size,
        **({"data.source": "builtin-overopt"} if study.task == "overopt" else {}),
        **({"data.source": "builtin-chat-arith"} if study.chat else {}),
        **(CHAT_OVEROPT_KEYS if study.task == "chat-overopt" else {}),
        **({"model.policy": resolve_model(study.model)} if study.model is not None else {}),
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
                        **({"teacher": choice.teacher, "rewards": []} if choice.teacher else {}),
                        "run.seed": seed,
                    }
                    tag = choice.label.replace("+", "plus")
                    tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", tag).strip("-")
                    runs.append(
                        Run(
                            name=f"{algo}_{tag}_b{fmt(beta)}_s{seed}",
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
