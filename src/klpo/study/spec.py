"""The study's spec and presets: which KL choices, betas, seeds and budget a study runs.

A study is a grid of ordinary ``klpo train`` runs on the same task and budget that differ only in
the KL choice (estimator × placement × algorithm), its coefficient beta, and the seed::

    grid = study_grid(StudyConfig())          # klpo.study.grid: the full default grid
    results = run_study(StudyConfig(), "runs/compare")   # klpo.study.runner

A choice may carry further ``kl.*`` keys (``options``: a controller and its target, a reference
reset, ``ref_is`` clipping) and ``algo.*`` keys (``algo_options``: GSPO, CISPO, epochs), and its
own betas (a controller row: one, the initial coefficient). The presets: the default grid
(:class:`StudyConfig`), ``--quick`` (:func:`quick_study`), the over-optimisation study
(:func:`overopt_study`) and its ``--quick`` (:func:`quick_overopt_study`), and the real-model
study on the chat task (``--task chat-arith``: :func:`real_study`, :func:`quick_real_study`) and
its over-optimisation form (``--task chat-overopt``: :func:`chat_overopt_study`,
:func:`quick_chat_overopt_study`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from klpo import kl
from klpo.train.algorithms import Algorithm
from klpo.train.config import ConfigError, load_yaml, one_of
from klpo.train.config_files import Sources, merge_layer

__all__ = [
    "CHAT_OVEROPT_BETAS",
    "CHAT_OVEROPT_KEYS",
    "CHAT_OVEROPT_TOKENS",
    "KL_BUDGET",
    "KL_BUDGET_SEQ",
    "TASKS",
    "Choice",
    "Comparison",
    "StudyConfig",
    "chat_overopt_study",
    "load_study",
    "overopt_study",
    "quick_chat_overopt_study",
    "quick_overopt_study",
    "quick_real_study",
    "quick_study",
    "real_choices",
    "real_study",
    "ref_sampled_choices",
    "resolve_model",
    "sequence_exact_choices",
    "with_options",
]


class Choice(BaseModel):
    """One KL choice of the grid: an estimator in a placement, trained by one or more algorithms."""

    model_config = ConfigDict(extra="forbid")

    estimator: str = Field(description="A klpo.kl estimator (ignored when placement is none).")
    placement: Literal["loss", "reward", "reward+loss", "none"]
    algos: list[Algorithm] = Field(
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
    teacher: dict[str, Any] | None = Field(
        None,
        description="On-policy distillation: this choice's teacher.* keys (model, estimator, "
        "placement, credit, ...); the run then trains on the teacher term alone (no reward "
        "functions: rewards: []), its held-out accuracy still scored by the task's reward. The "
        "choice's own KL to the reference is estimator and placement, as for any choice.",
    )

    @field_validator("estimator")
    @classmethod
    def _known(cls, v: str) -> str:
        return one_of("estimator", v, tuple(kl.SPECS))

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
        if self.teacher is not None:
            t = self.teacher
            name = f"teacher {t.get('estimator', 'full')}"
            if t.get("placement") == "reward":
                name += f" reward {t.get('credit', 'returns')}"
            name = f"{name} ({self.variant})" if self.variant else name
            return (
                name if self.placement == "none" else f"{name}, {self.estimator} {self.placement}"
            )
        if self.placement == "none":
            return f"no KL ({self.variant})" if self.variant else "no KL"
        name = f"{self.estimator} ({self.variant})" if self.variant else self.estimator
        return f"{name} {self.placement}"


class Comparison(BaseModel):
    """A comparison the study names before its runs: cell ``a`` against cell ``b`` on one result
    column, the seed the unit (:mod:`klpo.study.seeds`).

    A cell is written as its choice's label and, for a choice with a KL term, its beta after an
    ``@``: ``"full loss @ 0.1"``, ``"no KL"``. Runs of the same seed are paired (the same prompts
    in the same order from the same start), so the test is on the seed-by-seed differences."""

    model_config = ConfigDict(extra="forbid")

    a: str = Field(description="The first cell: a choice's label, '@ beta' for a KL choice.")
    b: str = Field(description="The cell it is compared with, written the same way.")
    metric: str = Field(
        "acc_final",
        description="The result.yaml column compared (acc_final: held-out accuracy at the end; "
        "gold_final, kl_exact_final, ...).",
    )
    algo: str = Field("grpo", description="The algorithm of both cells.")

    @field_validator("a", "b")
    @classmethod
    def _cell_written(cls, v: str) -> str:
        parse_cell(v)
        return v

    @property
    def name(self) -> str:
        return f"{self.a} vs {self.b}" + ("" if self.metric == "acc_final" else f" ({self.metric})")


def parse_cell(cell: str) -> tuple[str, float | None]:
    """``"full loss @ 0.1"`` as ``("full loss", 0.1)``; ``"no KL"`` as ``("no KL", None)``.

    >>> parse_cell("k3+ loss @ 0.05")
    ('k3+ loss', 0.05)
    """
    label, at, beta = cell.partition("@")
    label = " ".join(label.split())
    if not label:
        raise ValueError(f"cell {cell!r} names no choice; write e.g. 'full loss @ 0.1' or 'no KL'")
    if not at:
        return label, None
    try:
        return label, float(beta)
    except ValueError:
        raise ValueError(
            f"cell {cell!r}: the beta after '@' must be a number, e.g. 'full loss @ 0.1'"
        ) from None


def _cell_name(label: str, beta: float | None) -> str:
    return label if beta is None else f"{label} @ {beta:g}"


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

    task: Literal["builtin", "overopt", "chat-arith", "chat-overopt"] = Field(
        "builtin",
        description="The task every run trains on: the built-in arithmetic task, the "
        "over-optimisation task (data.source builtin-overopt: a proxy reward to train on, the "
        "gold reward logged; docs/overopt.md), the chat task for a real instruction-tuned "
        "model (data.source builtin-chat-arith; docs/real-models.md), or that chat task "
        "trained on an exploitable proxy reward with a gold reward logged (chat_overopt_proxy "
        "and chat_overopt_gold; docs/study-real/overopt.md).",
    )
    model: str | None = Field(
        None,
        description="The policy of every run (model.policy): a real model of the test suite by "
        "its key ('smollm2', 'gemma3': the float32 image `make real-models` makes, found in "
        "klpo's cache), or a model directory or .gguf file; null: the trainer's default.",
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
    comparisons: list[Comparison] = Field(
        default_factory=list,
        description="The primary comparisons, named before the runs: each decided with the "
        "seed as the unit and a Holm correction over the list (klpo.study.seeds); every other "
        "comparison a report makes is exploratory and says so.",
    )
    added_after: list[str] = Field(
        default_factory=list,
        description="Cells ('full loss @ 0.05', 'no KL (no skip)') added after earlier results "
        "of the study were seen; the report marks them as such.",
    )
    alpha: float = Field(
        0.05, gt=0, lt=1, description="The family-wise error rate of the primary comparisons."
    )
    cpu_hours: float | None = Field(
        None,
        gt=0,
        description="The CPU budget planned for the study's runs, in hours (the report sets the "
        "measured CPU time beside it).",
    )
    kl_budget: float | None = Field(
        None,
        gt=0,
        description="A per-token exact KL budget: every run reports whether the 10-step running "
        "mean of kl/ref/exact stayed within ±20% of it over the second half of training (a "
        "choice with a KL controller is held to its own kl.target instead); null: only such "
        "choices report it.",
    )

    @field_validator("model")
    @classmethod
    def _model_named(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("model must be a real model's key (smollm2, gemma3) or a path")
        return v

    @property
    def over_optimisation(self) -> bool:
        """Whether the task trains on a proxy reward and logs a gold one (its report has the
        gold-against-KL frontiers)."""
        return self.task in ("overopt", "chat-overopt")

    @property
    def chat(self) -> bool:
        """Whether the task is the chat task of a real model (its report compares the held-out
        problems one by one)."""
        return self.task in ("chat-arith", "chat-overopt")

    def convergence_target(self) -> tuple[str, float]:
        """The metric whose running mean defines "steps to target", and its threshold."""
        if self.over_optimisation:
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

    @model_validator(mode="after")
    def _cells_in_grid(self) -> StudyConfig:
        cells = self.cells()
        named = [(c.algo, c.a) for c in self.comparisons] + [
            (c.algo, c.b) for c in self.comparisons
        ]
        named += [(None, cell) for cell in self.added_after]
        for algo, cell in named:
            key = parse_cell(cell)
            if not any(k == key and (algo is None or algo in algos) for k, algos in cells.items()):
                shown = ", ".join(repr(_cell_name(*k)) for k in cells)
                raise ValueError(f"cell {cell!r} is not in the study's grid; its cells: {shown}")
        return self

    def cells(self) -> dict[tuple[str, float | None], list[str]]:
        """``{(choice label, beta or None): algorithms}``: every cell of the grid."""
        out: dict[tuple[str, float | None], list[str]] = {}
        for choice in self.choices:
            betas = [None] if choice.placement == "none" else (choice.betas or self.betas)
            for beta in betas:
                out.setdefault((choice.label, beta), []).extend(choice.algos)
        return out


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


REAL_TRAIN_KEYS: dict[str, Any] = {
    "model.dtype": "float32",
    "model.gradient_checkpointing": False,
    "model.lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"},
    "rollout.prompts_per_step": 2,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 12,
    "rollout.temperature": 1.0,
    "optim.lr": 3.0e-4,
    "run.log_samples": 500,
}
"""The real-model study's shared train keys: those of configs/smollm2-chat-grpo-lora.yaml (GRPO,
LoRA r 16 on every linear layer, float32, 2 prompts x 4 completions of up to 12 tokens, lr 3e-4),
the setting the task pilot measured (docs/study-real/pilot.md); every held-out completion is
written to samples.jsonl (``run.log_samples``), so that the report compares runs problem by
problem."""


def real_choices() -> list[Choice]:
    """The real-model study's KL choices: no KL; ``k1`` in the reward; ``k3``, ``k3+`` and
    ``full`` (the exact KL) in the loss; then ``k2`` in the loss, last, so that a study cut short
    by its budget has the others whole; GRPO."""
    return [
        Choice(estimator="k1", placement="none"),
        Choice(estimator="k1", placement="reward"),
        Choice(estimator="k3", placement="loss"),
        Choice(estimator="k3+", placement="loss"),
        Choice(estimator="full", placement="loss"),
        Choice(estimator="k2", placement="loss"),
    ]


def real_study(model: str = "smollm2") -> StudyConfig:
    """The real-model KL study (``--task chat-arith``): GRPO with LoRA on the built-in chat task
    (:data:`REAL_TRAIN_KEYS`), on SmolLM2-135M-Instruct unless ``model`` names another;
    :func:`real_choices` at one beta, 3 seeds, 24 steps, held-out accuracy on 100 problems at
    the start and the end, two runs side by side at one thread each. The second beta for the
    two choices that differ most is a choice's own ``betas`` in a study file
    (docs/study-real/report.md says which were run)."""
    return StudyConfig(
        task="chat-arith",
        model=model,
        choices=real_choices(),
        betas=[0.2],  # the beta pilot (docs/study-real/pilot.md): the largest that still learns
        seeds=[0, 1, 2],
        steps=24,
        eval_every=24,
        eval_size=100,
        base=dict(REAL_TRAIN_KEYS),
        target_accuracy=0.3,
        collapse_drop=0.02,  # at a start of ~6%, a fall to 0% is a collapse: the 2-SE rule decides
    )


def quick_real_study(model: str = "smollm2") -> StudyConfig:
    """The ``--task chat-arith --quick`` preset: every choice of :func:`real_study`, one seed,
    2 steps, 8 held-out problems (a smoke test of the real model with every estimator: about a
    minute a run at one thread)."""
    return real_study(model).model_copy(
        update={"seeds": [0], "steps": 2, "eval_every": 2, "eval_size": 8}
    )


def resolve_model(model: str) -> str:
    """``StudyConfig.model`` as a ``model.policy`` value: a real model's key becomes its float32
    directory in klpo's cache (a ConfigError naming ``make real-models`` where it is not made);
    anything else is a path or id, kept."""
    from klpo.train.tools.real_models import REAL_MODELS, real_model_dir

    if model not in REAL_MODELS:
        return model
    path = real_model_dir(model)
    if path is None:
        raise ConfigError(
            f"the study's model {model!r} ({REAL_MODELS[model].name}) is not converted here: "
            "run `make real-models` (or give model a directory)"
        )
    return str(path)


CHAT_OVEROPT_KEYS: dict[str, Any] = {
    "rewards": [{"name": "chat_overopt_proxy"}],
    "gold_reward": "chat_overopt_gold",
}
"""The chat over-optimisation task's train keys (every run of ``task: chat-overopt``, before the
study's ``base``): train on the proxy (the answer anywhere in the completion), log and evaluate
the gold reward (the final answer right, no guesses, at most 20 words;
:mod:`klpo.train.rewards.overopt`)."""

CHAT_OVEROPT_TOKENS = 24
"""The chat over-optimisation preset's ``rollout.max_new_tokens``, twice the chat-arith
preset's: SmolLM2's right answers, one sentence restating the problem, take about 22 tokens, and
a list of six two-digit candidates ("28, 29, 30, 31, 32, 33") takes 22, so the policy has room
to game the proxy (at 12 tokens, three)."""

CHAT_OVEROPT_BETAS = [0.05, 0.2, 0.8]
"""The chat over-optimisation study's beta sweep: those of the real study's beta pilot
(configs/studies/real-beta-pilot.yaml), a factor of 4 apart."""


def chat_overopt_study(model: str = "smollm2") -> StudyConfig:
    """The real-model over-optimisation study (``--task chat-overopt``): GRPO with LoRA on the
    chat task's problems (:data:`CHAT_OVEROPT_KEYS`; :data:`REAL_TRAIN_KEYS` with completions of
    up to :data:`CHAT_OVEROPT_TOKENS` tokens), on
    SmolLM2-135M-Instruct unless ``model`` names another, the budget of :func:`real_study` (24
    steps of 2 prompts × 4 completions): no KL, ``k1`` in the reward, ``k3`` and ``full`` in the
    loss, each at :data:`CHAT_OVEROPT_BETAS` (the frontier's sweep), 3 seeds; the gold reward on
    100 held-out problems at the start, halfway and the end (10 cells, 30 runs)."""
    return StudyConfig(
        task="chat-overopt",
        model=model,
        choices=[c for c in real_choices() if c.label in _CHAT_OVEROPT_CHOICES],
        betas=list(CHAT_OVEROPT_BETAS),
        seeds=[0, 1, 2],
        steps=24,
        eval_every=12,
        eval_size=100,
        base={**REAL_TRAIN_KEYS, "rollout.max_new_tokens": CHAT_OVEROPT_TOKENS},
        target_gold=0.3,
        collapse_drop=0.02,
    )


_CHAT_OVEROPT_CHOICES = ("no KL", "k1 reward", "k3 loss", "full loss")


def quick_chat_overopt_study(model: str = "smollm2") -> StudyConfig:
    """The ``--task chat-overopt --quick`` preset: every choice of :func:`chat_overopt_study` at
    the sweep's two ends (betas 0.05 and 0.8), one seed, 2 steps, 8 held-out problems (a smoke
    test: 7 runs of about two minutes each at one thread on a busy machine)."""
    return chat_overopt_study(model).model_copy(
        update={
            "betas": [CHAT_OVEROPT_BETAS[0], CHAT_OVEROPT_BETAS[-1]],
            "seeds": [0],
            "steps": 2,
            "eval_every": 2,
            "eval_size": 8,
        }
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
            *_off_policy_choices(),
            Choice(
                estimator="full",
                placement="loss",
                options={"reference_reset": {"every": 50, "alpha": 1.0}},
                variant="reset every 50",
            ),
            *_budget_choices(),
        ],
        betas=[0.01, 0.03, 0.1, 0.3],
        seeds=[0, 1, 2],
        steps=200,
        eval_every=50,
        eval_size=200,
        kl_budget=KL_BUDGET,
    )


def _off_policy_choices() -> list[Choice]:
    """The over-optimisation study's off-policy rows (2 epochs × 2 minibatches, betas 0.1 and
    0.3): the default KL under PPO's clip, GSPO and CISPO; k3 corrected and not, and k3_is."""
    off_policy = {"epochs": 2, "minibatches": 2}
    off_betas = [0.1, 0.3]
    variant = "2 epochs x 2 minibatches"
    return [
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
    ]


def _budget_choices() -> list[Choice]:
    """The over-optimisation study's KL-budget rows: the default KL held to ``KL_BUDGET`` per
    token by each adaptive controller, and to ``KL_BUDGET_SEQ`` per sequence by Ziegler's."""
    return [
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
    ]


TASKS = ("builtin", "overopt", "chat-arith", "chat-overopt")
"""The tasks a study runs on (``klpo compare --task``)."""


def load_study(
    path: str | Path | Sequence[str | Path] | None = None,
    *,
    quick: bool = False,
    task: str = "builtin",
) -> StudyConfig:
    """A study from YAML (keys of :class:`StudyConfig`), the quick preset, or the defaults, of
    ``task`` (one of :data:`TASKS`). The files merge over the preset in order, a later one
    winning, as ``klpo train``'s files do (:mod:`klpo.train.config_files`): a list (``choices``,
    ``betas``, ``seeds``) or a number replaces what was there, a mapping (``base``, ``ppo``)
    merges key by key, so ``base: {data.chat: false}`` changes one train key of the preset's
    and keeps the rest."""
    one_of("task", task, TASKS)
    if task == "overopt":
        base = quick_overopt_study() if quick else overopt_study()
    elif task == "chat-arith":
        base = quick_real_study() if quick else real_study()
    elif task == "chat-overopt":
        base = quick_chat_overopt_study() if quick else chat_overopt_study()
    else:
        base = quick_study() if quick else StudyConfig()
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    if not paths:
        return base
    data: dict[str, Any] = base.model_dump()
    sources = Sources()
    for p in map(Path, paths):
        merge_layer(data, _read_study_file(p), str(p), sources)
    try:
        return StudyConfig.model_validate(data)
    except ValidationError as err:
        lines = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        named = {sources.of_error(e["loc"]) for e in err.errors()} - {None}
        files = sorted(named) if named else [str(p) for p in paths]
        which = ", ".join(repr(f) for f in files)
        raise ConfigError(f"bad study file {which}:\n  " + "\n  ".join(lines)) from None


def _read_study_file(p: Path) -> dict[str, Any]:
    if not p.is_file():
        raise ConfigError(f"study file {str(p)!r} does not exist")
    try:
        data = load_yaml(p.read_text(encoding="utf-8"), f"study file {str(p)!r}") or {}
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ConfigError(
            f"study file {str(p)!r} is not valid UTF-8 YAML: {str(err).splitlines()[0]}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"study file {str(p)!r} must hold a mapping of StudyConfig keys")
    return data


def with_options(study: StudyConfig, options: dict[str, tuple[str, Any]]) -> StudyConfig:
    """``study`` with the command line's values set: ``{key: (as typed, value)}``, e.g.
    ``{"workers": ("0", 0)}``; a bad value is a ConfigError naming the option as typed, what is
    allowed and an example (the study's defaults), as the other options' errors do."""
    given = {k: v for k, (_, v) in options.items()}
    try:
        return StudyConfig.model_validate({**study.model_dump(), **given})
    except ValidationError as err:
        e = err.errors()[0]
        key = str(e["loc"][0])
        typed = options[key][0]
        msg = e["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        example = StudyConfig.model_fields[key].get_default(call_default_factory=True)
        if isinstance(example, list):
            example = ",".join(map(str, example))
        option = f"--{key.replace('_', '-')}"
        raise ConfigError(f"{option} {typed!r}: {msg}; e.g. {option} {example}") from None


# ---------------------------------------------------------------------------------------------
# The grid.


# ---------------------------------------------------------------------------------------------
# Running and summarising.


# Keys that may differ between a finished run and the study re-run over it: how a run is shown
# and scheduled, not what it computes.


# ---------------------------------------------------------------------------------------------
# The report.
