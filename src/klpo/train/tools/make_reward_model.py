r"""`klpo make-reward-model`: a small learned reward model made for the built-in task.

A reward model (:class:`klpo.train.rewards.model.RewardModel`) scores ``prompt + completion``.
:func:`make_reward_model` (``klpo make-reward-model OUT``) trains a small one on the built-in
arithmetic task from a **limited** labelled sample: ``n_pairs`` problems of the train split, each
with its right answer and one wrong answer near it (off by a small amount, the mistakes a policy
makes), on the Bradley-Terry pairwise loss of reward modelling (Ouyang et al. 2022,
arXiv:2203.02155, eq. 1):

    loss = -log sigmoid(r(x, y_right) - r(x, y_wrong))

starting from the task's reference model (a value head on its backbone, as InstructGPT starts its
reward model from the SFT model). Trained on few pairs, it ranks answers better than chance but
imperfectly: a proxy reward that a policy can learn to exploit (Gao et al. 2023,
arXiv:2210.10760), for the over-optimisation task (``docs/overopt.md``).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from klpo.train.config import ConfigError
from klpo.train.data.task import ArithmeticTask
from klpo.train.models.gguf import GGUFError
from klpo.train.models.load import (
    load_tokenizer,
    model_source_problem,
    quiet_transformers,
    resolve_model_path,
)
from klpo.train.outdir import claim_dir
from klpo.train.rewards.model import RewardModel
from klpo.train.runtime.progress import Progress
from klpo.train.tools.scaffold import fit, model_dir, write_meta

__all__ = [
    "RewardModelConfig",
    "make_reward_model",
    "pairwise_accuracy",
    "wrong_answer",
]


@dataclass(frozen=True)
class RewardModelConfig:
    """What :func:`make_reward_model` trains. The defaults make a deliberately limited proxy.

    ``n_pairs`` labelled (right, wrong) answer pairs from the task's train split (the
    limited sample), ``steps`` AdamW steps of ``batch_size`` pairs at learning rate ``lr``,
    starting from ``init`` (a causal-LM directory, ``builtin`` for the shipped reference); wrong
    answers are the right one plus a nonzero offset in ``[-max_offset, max_offset]``.
    ``n_eval`` held-out pairs (from the task's held-out split) measure the result.
    """

    init: str = "builtin"
    n_pairs: int = 1024
    max_offset: int = 50
    steps: int = 200
    batch_size: int = 32
    lr: float = 3e-4
    seed: int = 0
    n_eval: int = 400

    def __post_init__(self) -> None:
        for name in ("n_pairs", "max_offset", "steps", "batch_size", "n_eval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


def wrong_answer(answer: str, rng: random.Random, max_offset: int) -> str:
    """A wrong answer near ``answer`` (an integer): plus a nonzero offset in ±max_offset."""
    offset = 0
    while offset == 0:
        offset = rng.randint(-max_offset, max_offset)
    return str(int(answer) + offset)


def _pairs(examples: Sequence[Any], n: int, rng: random.Random, max_offset: int):
    chosen = [examples[rng.randrange(len(examples))] for _ in range(n)]
    return [(e.prompt, e.answer, wrong_answer(e.answer, rng, max_offset)) for e in chosen]


def _texts(tokenizer: Any, pairs, which: int) -> list[str]:
    # The completion as the policy writes it: the answer, then EOS.
    return [p[0] + p[which] + tokenizer.eos_token for p in pairs]


def pairwise_accuracy(rm: RewardModel, pairs: Sequence[tuple[str, str, str]]) -> float:
    """The fraction of (prompt, right, wrong) pairs where ``rm`` scores right above wrong (ties count
    half). Chance is 0.5, with standard error ``sqrt(0.25 / N)``."""
    eos = rm.tokenizer.eos_token
    right = rm.scores([p + r + eos for p, r, _ in pairs])
    wrong = rm.scores([p + w + eos for p, _, w in pairs])
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(right, wrong, strict=True))
    return wins / len(pairs)


@dataclass
class RewardModelResult:
    path: Path
    heldout_pairwise_accuracy: float
    train_pairwise_accuracy: float
    seconds: float


def units(config: RewardModelConfig) -> int:
    """The units of :func:`make_reward_model`'s progress: its training steps and two
    measurements."""
    return config.steps + 2


def _init_path(init: str) -> str:
    """The directory of ``--init`` (a .gguf file: its float32 image in klpo's cache,
    :mod:`klpo.train.models.gguf`), checked as ``klpo train`` checks ``model.policy`` (offline:
    the cache only), with a tokenizer that loads."""
    try:
        path = resolve_model_path(init, key="--init")
    except GGUFError as err:
        raise ConfigError(f"--init: {err}") from None
    problem = model_source_problem(path, "--init", tokenizer=True)
    if problem:
        raise ConfigError(problem.replace("model.policy=builtin", "--init builtin"))
    load_tokenizer(path, "--init")  # a tokenizer that loads, or an error that says why
    return path


def make_reward_model(
    out_dir: str | os.PathLike[str],
    config: RewardModelConfig | None = None,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> RewardModelResult:
    """Train a small reward model on the built-in task and save it into ``out_dir`` (atomically).

    The directory holds the model (``save_pretrained``), the tokenizer and
    ``reward_model.json`` (the config and the pairwise accuracies on the training pairs and on
    ``n_eval`` held-out pairs). Seeded: model head initialisation, pairs and batches.
    ``progress`` (of ``config.steps + 2`` units: the steps, then the two measurements) is
    told of each.
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    config = config or RewardModelConfig()
    bar = progress or Progress("make-reward-model", units(config), show=False)
    out = Path(out_dir)
    # New or empty, or (overwrite) an earlier reward model; never anything else.
    claim_dir(out, "make-reward-model", proceed=overwrite)
    quiet_transformers()
    t0 = time.perf_counter()
    init = _init_path(config.init)
    tokenizer = AutoTokenizer.from_pretrained(init)
    rng = random.Random(config.seed)
    train, heldout = ArithmeticTask().splits()
    pairs = _pairs(train, config.n_pairs, rng, config.max_offset)
    eval_pairs = _pairs(heldout, config.n_eval, rng, config.max_offset)
    torch.manual_seed(config.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        init, num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr)

    def loss_at(step: int) -> Any:
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(config.batch_size)]
        enc = tokenizer(
            _texts(tokenizer, batch, 1) + _texts(tokenizer, batch, 2),
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        r = model(**enc).logits[:, 0]
        n = len(batch)
        return -torch.nn.functional.logsigmoid(r[:n] - r[n:]).mean()

    def step_done(step: int, loss: float) -> None:
        bar.update(step + 1, info=f"loss {loss:.4f}", part="training")

    bar.update(0, part="training")  # the model is loaded: the ETA counts from here
    fit(model, opt, config.steps, loss_at, step_done)
    with model_dir(out, model, tokenizer, "reward_model.json") as tmp:
        rm = RewardModel(tmp)
        bar.update(config.steps, part=f"measuring on its {len(pairs)} training pairs")
        acc_train = pairwise_accuracy(rm, pairs)
        bar.update(config.steps + 1, part=f"measuring on {len(eval_pairs)} held-out pairs")
        acc_heldout = pairwise_accuracy(rm, eval_pairs)
        bar.update(config.steps + 2, info=f"held-out pairwise accuracy {acc_heldout:.3f}")
        seconds = time.perf_counter() - t0
        meta = {
            "config": asdict(config),
            "train_pairwise_accuracy": acc_train,
            "heldout_pairwise_accuracy": acc_heldout,
            "heldout_pairs": len(eval_pairs),
            "seconds": round(seconds, 1),
            "torch": torch.__version__,
        }
        write_meta(tmp, "reward_model.json", meta)
    return RewardModelResult(out, acc_heldout, acc_train, seconds)
