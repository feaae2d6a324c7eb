r"""The tiny reference model of the built-in task, made by the project's own seeded SFT.

:func:`make_reference` builds a character-level tokenizer (:func:`build_tokenizer`) and a small
``transformers`` causal LM from a config (:func:`build_model`, Llama or Qwen2 architecture),
trains it by supervised fine-tuning on the train split of :class:`klpo.train.data.task.ArithmeticTask`
(:func:`supervised_finetune`: cross-entropy on the answer tokens and the EOS token only), stops
early on purpose so that it solves only part of the held-out problems (room for RL), and saves the
model (``save_pretrained``, safetensors) and tokenizer, plus ``reference.json`` with the config,
the held-out accuracy and the versions that made it. ``klpo make-reference`` runs it.

The default reference ships inside the package (:func:`klpo.train.models.load.default_reference_path`); the defaults of
:class:`ReferenceConfig` reproduce it. The run is seeded (model initialisation, data order) and
deterministic for a fixed torch version and thread count; different thread counts may change
float32 reduction orders and so the last bits of the weights.
"""

from __future__ import annotations

import math
import os
import random
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from klpo.train.data.task import ArithmeticTask, Example
from klpo.train.evaluate import heldout_accuracy
from klpo.train.models.load import default_reference_path
from klpo.train.outdir import claim_dir
from klpo.train.rollout.samplers import Decoding
from klpo.train.tools.scaffold import fit, model_dir, write_meta

__all__ = [
    "ReferenceConfig",
    "ReferenceResult",
    "Schedule",
    "build_model",
    "build_tokenizer",
    "load_reference",
    "make_reference",
    "same_weights",
    "sft_batch",
    "supervised_finetune",
]

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
# Every printable ASCII character except the three rare whitespace controls.
CHARACTERS = tuple(c for c in string.printable if c not in "\x0b\x0c\r")


@dataclass(frozen=True)
class ReferenceConfig:
    """Everything that determines the reference model. The defaults make the shipped one.

    Model: a decoder-only ``arch`` ("llama" or "qwen2") with tied input/output embeddings.
    Training: at most ``steps`` AdamW steps of ``batch_size`` problems drawn uniformly (with
    replacement) from the train split less its first ``n_val`` problems, learning rate ``lr``
    with ``warmup`` linear warm-up steps then constant. Every ``eval_every`` steps the greedy
    accuracy on those ``n_val`` validation problems (disjoint from the SFT data and from the
    held-out split) is measured, and training stops at the first one that reaches
    ``stop_at_accuracy`` (None: never). Stopping on an accuracy rather than a step count lands
    the reference in the intended range even where a different machine's float rounding moves
    the learning curve by a few steps (its sharp rise spans ~100 steps).
    """

    # The task.
    max_operand: int = 99
    ops: tuple[str, ...] = ("+",)
    n_heldout: int = 500
    task_seed: int = 0
    # The model.
    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 128
    num_layers: int = 4
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 64
    # Supervised fine-tuning.
    steps: int = 2000
    batch_size: int = 128
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    n_val: int = 500
    eval_every: int = 25
    stop_at_accuracy: float | None = 0.3
    # How the weights are stored.
    save_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"arch must be 'llama' or 'qwen2', got {self.arch!r}")
        if self.save_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"save_dtype must be 'float32', 'bfloat16' or 'float16', got {self.save_dtype!r}"
            )
        for name in ("hidden_size", "num_layers", "intermediate_size", "num_heads", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.steps < 0 or self.warmup < 0:
            raise ValueError(f"steps and warmup must be >= 0, got {self.steps} and {self.warmup}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.stop_at_accuracy is not None and not 0 < self.stop_at_accuracy <= 1:
            raise ValueError(
                f"stop_at_accuracy must be in (0, 1] or None, got {self.stop_at_accuracy}"
            )
        size = len(self.ops) * (self.max_operand + 1) ** 2
        if not 0 < self.n_val < size - self.n_heldout:
            raise ValueError(
                f"n_val must be in [1, {size - self.n_heldout - 1}] (the train split has "
                f"{size - self.n_heldout} problems and SFT needs at least one), got {self.n_val}"
            )
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads "
                f"({self.num_heads}), and num_heads by num_kv_heads ({self.num_kv_heads})"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")

    def task(self) -> ArithmeticTask:
        """The task the reference is trained and measured on."""
        return ArithmeticTask(
            max_operand=self.max_operand,
            ops=tuple(self.ops),
            n_heldout=self.n_heldout,
            seed=self.task_seed,
        )

    def max_new_tokens(self) -> int:
        """Enough new tokens for every answer of the task plus EOS."""
        return self.task().max_answer_chars() + 1

    def schedule(self) -> Schedule:
        """The supervised fine-tuning's steps, batches and optimizer settings."""
        return Schedule(**{f.name: getattr(self, f.name) for f in fields(Schedule)})


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """How :func:`supervised_finetune` trains: at most ``steps`` AdamW steps of ``batch_size``
    examples drawn by ``random.Random(seed)``, learning rate ``lr`` after ``warmup`` linear
    warm-up steps, decoupled ``weight_decay``."""

    steps: int
    batch_size: int
    lr: float
    warmup: int = 0
    weight_decay: float = 0.0
    seed: int = 0


@dataclass
class ReferenceResult:
    """What :func:`make_reference` made and measured."""

    path: Path
    heldout_accuracy: float
    val_accuracy: float
    steps: int
    num_parameters: int
    seconds: float
    losses: list[float] = field(repr=False, default_factory=list)


def build_tokenizer() -> Any:
    """A character-level ``PreTrainedTokenizerFast``: one token per printable ASCII character.

    A ``tokenizers`` BPE model with an empty merge list splits text into single characters
    (``"47+38="`` → 6 tokens); specials ``<pad>`` (0), ``<s>``, ``</s>`` (EOS), ``<unk>``; no
    special token is added when encoding; padding on the left, as batched generation with a
    decoder-only model needs. ``decode(encode(text)) == text`` for printable ASCII text.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_model(config: ReferenceConfig, tokenizer: Any) -> Any:
    """A freshly initialised causal LM of ``config``'s architecture and size (float32).

    Initialisation uses torch's global generator: seed it first for a reproducible model.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cls_config, cls_model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[config.arch]
    model_config = cls_config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = cls_model(model_config)
    gen = model.generation_config
    gen.pad_token_id, gen.eos_token_id, gen.bos_token_id = (
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
    )
    gen.do_sample = False
    gen.max_new_tokens = config.max_new_tokens()
    return model


def sft_batch(tokenizer: Any, batch: Sequence[Example]) -> dict[str, Any]:
    """Right-padded ``prompt + answer + EOS`` with labels only on ``answer + EOS``."""
    import torch

    rows, labels = [], []
    for e in batch:
        p = tokenizer.encode(e.prompt, add_special_tokens=False)
        a = [*tokenizer.encode(e.answer, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    label_ids = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": label_ids}


def supervised_finetune(
    model: Any,
    tokenizer: Any,
    examples: Sequence[Example],
    schedule: Schedule,
    *,
    on_step: Callable[[int, float], bool | None] | None = None,
) -> list[float]:
    r"""Train ``model`` in place on ``prompt → answer + EOS`` by teacher forcing.

    Loss: the mean token cross-entropy over the answer and EOS tokens of the batch,
    ``-(1/|A|) sum_{t in A} log pi_theta(y_t | y_<t)``; prompt and padding tokens get label -100
    and contribute nothing (:func:`sft_batch`). Sequences are right-padded (prompts start at
    position 0, as they do after ``generate`` derives positions from a left-padded mask). AdamW
    (betas 0.9, 0.98) with linear warm-up over ``schedule.warmup`` steps to ``schedule.lr``,
    then constant. Batches are drawn uniformly with replacement by
    ``random.Random(schedule.seed)``. ``on_step(step, loss)`` is called after every step; when
    it returns True, training stops there.

    Returns:
        The loss of every step taken.
    """
    import torch

    if not examples:
        raise ValueError("supervised_finetune needs at least one example")
    s = schedule
    rng = random.Random(s.seed)
    opt = torch.optim.AdamW(
        model.parameters(), lr=s.lr, betas=(0.9, 0.98), weight_decay=s.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / s.warmup) if s.warmup > 0 else 1.0
    )

    def loss_at(step: int) -> Any:
        batch = [examples[rng.randrange(len(examples))] for _ in range(s.batch_size)]
        return model(**sft_batch(tokenizer, batch)).loss

    return fit(model, opt, s.steps, loss_at, on_step, sched)


def make_reference(
    out_dir: str | os.PathLike[str],
    config: ReferenceConfig | None = None,
    *,
    on_step: Callable[[int, float, float | None], None] | None = None,
    overwrite: bool = False,
) -> ReferenceResult:
    """Build, train, measure and save the reference model of the built-in task into ``out_dir``.

    The directory is written atomically: everything goes to a temporary sibling first, which
    replaces ``out_dir`` only when complete. ``out_dir`` is new or empty, or with ``overwrite``
    holds an earlier reference (its ``reference.json``), whose files are replaced (the user's
    other files there stay); anything else is refused (:func:`klpo.train.outdir.claim_dir`, a
    FileExistsError).
    It holds ``model.safetensors``, ``config.json``, ``generation_config.json``, the tokenizer
    files and ``reference.json`` (the :class:`ReferenceConfig`, the steps taken, the validation
    and held-out accuracies, the number of parameters, the seconds taken and the
    torch/transformers versions). ``on_step(step, loss, val_accuracy)`` reports progress
    (``val_accuracy`` is None between evaluations).

    Returns:
        A :class:`ReferenceResult`; its ``heldout_accuracy`` (greedy, exact match) is that of the
        weights as stored (cast to ``save_dtype`` and back to float32), the number a reload gives.
    """
    import torch
    import transformers

    config = config or ReferenceConfig()
    out = Path(out_dir)
    # New or empty, or (overwrite) an earlier reference; never anything else (klpo.train.outdir)
    claim_dir(out, "make-reference", proceed=overwrite)
    start = time.perf_counter()
    task = config.task()
    train, heldout = task.splits()
    val, sft_data = train[: config.n_val], train[config.n_val :]
    greedy = Decoding(max_new_tokens=config.max_new_tokens(), greedy=True)
    tokenizer = build_tokenizer()
    torch.manual_seed(config.seed)
    model = build_model(config, tokenizer)
    val_accuracy = [0.0]

    def step_done(step: int, loss: float) -> bool:
        stop, acc = False, None
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            acc = heldout_accuracy(model, tokenizer, val, greedy)
            val_accuracy.append(acc)
            stop = config.stop_at_accuracy is not None and acc >= config.stop_at_accuracy
        if on_step is not None:
            on_step(step, loss, acc)
        return stop

    losses = supervised_finetune(model, tokenizer, sft_data, config.schedule(), on_step=step_done)
    model.to(getattr(torch, config.save_dtype))
    # Measure what is saved: the accuracy of the stored weights, computed in float32.
    accuracy = heldout_accuracy(model.float(), tokenizer, heldout, greedy)
    model.to(getattr(torch, config.save_dtype))
    num_parameters = sum(p.numel() for p in model.parameters())
    seconds = time.perf_counter() - start
    meta = {
        "config": asdict(config),
        "steps": len(losses),
        "val_accuracy": val_accuracy[-1],
        "heldout_accuracy": accuracy,
        "heldout_size": len(heldout),
        "num_parameters": num_parameters,
        "seconds": round(seconds, 1),
        "final_loss": losses[-1] if losses else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    with model_dir(out, model, tokenizer, "reference.json") as tmp:
        write_meta(tmp, "reference.json", meta)
    return ReferenceResult(
        out, accuracy, val_accuracy[-1], len(losses), num_parameters, seconds, losses
    )


def same_weights(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]) -> bool:
    """Whether two saved models have bit-identical ``model.safetensors`` tensors (same names)."""
    import torch
    from safetensors.torch import load_file

    a = load_file(Path(path_a) / "model.safetensors")
    b = load_file(Path(path_b) / "model.safetensors")
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def load_reference(path: str | os.PathLike[str] | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a reference directory (the shipped one by default), in float32.

    The weights may be stored in a 16-bit dtype; they are upcast so training and log-prob
    arithmetic run in float32.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path is not None else default_reference_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, tokenizer
