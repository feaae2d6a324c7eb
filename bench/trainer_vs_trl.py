"""klpo train against TRL's GRPOTrainer: the same GRPO run, side by side, in one table.

Five workloads (``--workload a|b|c|d|e``, a comma-separated list, ``both`` = a,b, ``real`` =
d,e, ``all``): (a), described below; (b), compute-bound: the ~23.5M-parameter Llama that
``compute_workload.py`` builds locally, 4 prompts of 64 tokens × 8 completions of 128 tokens per
step, its ``lexical_reward``, otherwise the same settings; (c), a real vocabulary: the same job on
the ~104M-parameter Llama of ``compute_workload.SHAPES["c"]`` (Qwen2.5's vocabulary size, 151,936,
hidden 512, 8 layers), its ``lexical_reward_c``; (d) and (e), the project's real models
(``real_workload.py``, converted by ``make real-models``), full fine-tuning, 2 prompts × 4
completions a step: (d) SmolLM2-135M-Instruct (V = 49,152), chat prompts rendered by its template
on both sides (TRL gets them as conversational messages), up to 48 new tokens, klpo's ``numeric``
reward; (e) Gemma 3 270M base (V = 262,144), plain prompts, up to 32 new tokens,
``real_workload.first_number``. Each side runs ``--runs`` times (3), interleaved
A B A B A B; the table gives the median of the per-run median step times with their min–max, each
side's peak RSS (the largest of its runs' processes), and the floor: the model alone on the same
step's tokens (:func:`floor_worker`). For workload (a):

Both trainers run the same job, one after the other, each in its own subprocess with 2 torch
threads: the shipped tiny reference model (1M-parameter Llama) as policy and reference, the
built-in arithmetic task, the same prompts in the same order, 16 prompts × 8 completions = 128
completions per step, one optimizer step per batch, AdamW at a constant learning rate of 2e-4,
gradient-norm clip 1.0, beta 0.01 with k3 in the loss, max 4 new tokens at temperature 1, the
token-mean reduction, the same number of steps and the same seed. Then, in a third subprocess, one
fixed batch: klpo's GRPO loss (the trainer's own ``micro_step``) against TRL's
``GRPOTrainer._compute_loss``, value and gradient.

How each TRL setting matches klpo's (TRL 1.16.0; docs/frameworks.md has the full mapping):

- group size: ``num_generations=8`` = ``rollout.group_size=8``.
- batch per step: ``per_device_train_batch_size=128`` with ``gradient_accumulation_steps=1``
  (so ``steps_per_generation=1`` and ``generation_batch_size=128``) and ``num_iterations=1`` =
  ``rollout.prompts_per_step=16``, ``algo.epochs=1``, ``algo.minibatches=1``,
  ``algo.micro_batch=0``: 128 completions sampled, one forward/backward over all of them and one
  optimizer step per batch, in both.
- KL: ``beta=0.01`` with ``use_bias_correction_kl=False`` (plain k3 added to the per-token loss)
  = ``kl.beta=0.01``, ``kl.estimator=k3``, ``kl.placement=loss``, ``kl.controller=fixed``.
- reduction: ``loss_type="dapo"`` (the batch's summed per-token loss over its token count,
  ``num_items_in_batch``, with one process and one micro-batch) = ``algo.loss_reduction=
  token-mean`` (the same sum over the same count).
- clip: ``epsilon=0.2`` (``epsilon_high`` defaults to it) = ``algo.clip_low=0.2``,
  ``algo.clip_high=0.2``.
- advantages: ``scale_rewards="group"`` = ``algo.std=sample`` (group mean, Bessel std).
- optimizer: ``learning_rate=2e-4``, ``lr_scheduler_type="constant"``, ``warmup_steps=0``,
  ``weight_decay=0``, ``max_grad_norm=1.0``, AdamW betas (0.9, 0.999) = ``optim.lr=2e-4``,
  ``optim.warmup_steps=0``, ``optim.weight_decay=0``, ``optim.grad_clip=1.0``, the same betas.
- sampling: ``max_completion_length=4``, ``temperature=1``, ``top_p=1``, ``top_k=0`` =
  ``rollout.max_new_tokens=4``, ``rollout.temperature=1``, ``rollout.top_p=1`` (klpo always
  switches top-k off).
- prompts: TRL gets a dataset holding klpo's prompt stream in order (``steps × 16`` prompts) and
  ``shuffle_dataset=False``, so step t of both trains on the same 16 prompts; ``seed`` =
  ``run.seed``.
- ``activation_checkpointing=False``: TRL's GRPOConfig turns it on by default (as
  ``gradient_checkpointing``); klpo never recomputes activations.

Known differences that remain: TRL divides the group std by ``std + 1e-4``, klpo by
``std + 1e-6`` (a relative change below 3e-4 of the advantages with 0/1 rewards in groups of 8);
both optimizers are torch's fused AdamW (TRL's default ``adamw_torch_fused``; klpo's
``torch.optim.AdamW(fused=True)`` on plain tensors). With one update per batch both take pi_old to be the update's own detached log-probs
(TRL skips the old log-probs when ``num_iterations=1``; klpo when
``klpo.train.step.types.update_gives_logp_old``), so the ratio is exactly 1 and klpo's k3 weight
pi_theta / pi_old too; klpo also logs the entropy and the exact KL from that pass.

Only the training step is compared. Disabled in both: held-out evaluation, checkpoints during
training, TensorBoard, progress bars and logging (klpo: ``run.eval_every=0``,
``run.save_every=0`` (its one checkpoint, at the end, falls outside every step),
``run.tensorboard=false``, ``run.progress=false``; TRL: ``eval_strategy="no"``,
``save_strategy="no"``, ``logging_strategy="no"``, ``report_to="none"``, ``disable_tqdm=True``).

Measures, the same definition for both:

- step time: one training step, sampling through the optimizer step: klpo's ``time/step``
  (``metrics.jsonl``); TRL from its ``on_step_begin`` to its ``on_step_end`` callback (the
  ``training_step`` with generation, rewards, reference log-probs, loss, backward, then the
  clip, optimizer and scheduler steps). The table gives the median over all steps.
- tokens per second: completion tokens sampled (up to and including each completion's first
  EOS, summed over the step's 128 completions) divided by that step's time; the median over
  steps 2 to N (the first step's one-off warm-up is left out of both).
- final reward: the mean exact-match reward of the step's 128 completions, averaged over the last
  20% of steps (klpo's ``reward/mean``; for TRL, recorded by the reward function itself).
- peak RSS: the trainer process's high-water mark of resident memory (``VmHWM``, read by the
  process itself as it exits: :func:`run_recording_peak`), model loading included; the largest
  over a side's runs. (A child's ``ru_maxrss`` would not do: Linux counts in it the parent's
  resident memory at the fork.)
- quiet machine: the CPU seconds every other process used while each trainer ran
  (``/proc/stat`` less this process tree's own); above 5% of the run's cores × wall time the
  table is flagged as untrustworthy.

Packed rows (``--packing``): two more klpo sides run interleaved with the others, run after
run (:data:`KLPO_SIDES`): ``algo.packing=on``, and padded rows with ``rollout.share_prompt=false``
(packing computes each sequence's prompt with it, so this side tells packing's effect from that
of not sharing the prompt). A second table gives, the same definitions for every side: the
median step time and its min–max over runs; tokens/s as above (completion tokens, the stop
included, from the completions the side itself sampled at temperature 1: their min / median /
max length is in the table); the token positions a forward over the step's batch computes in the
side's layout and their pad share, read from the batch as the trainer laid it out (its
``pack_rows``, which ``score`` calls once a step, is wrapped to record each step's lengths and
packs: :func:`record_layouts`, :func:`layout_slots`); peak RSS; packed over each other side. Then
the share of the pad tokens of padded rows that packing removed, and a step-1 check: each klpo
side drew the same tokens as ``klpo`` (a digest of them) and logged the same metrics from them
(to a relative 1e-4, float32 rounding on a 30-layer model).

Run it on a quiet machine (it uses both cores), with the peers' environment for TRL::

    PYTHONPATH=$PWD/src PEERS_VENV/bin/python bench/trainer_vs_trl.py [--workload a|b|c|all]
    PYTHONPATH=$PWD/src PEERS_VENV/bin/python bench/trainer_vs_trl.py --workload d --packing \
        --steps 10 --runs 3

where ``PEERS_VENV`` is a side environment with ``torch==2.13.0`` and ``trl==1.16.0`` installed.

Without TRL it says so, runs klpo alone, and exits 0.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import math
import os
import resource
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

FINAL_FRACTION = 0.2  # the final reward averages the last 20% of steps
PERTURB = [0.2]  # the loss check's policy: the reference plus this × each tensor's std of noise


KLPO_PYTHON = [sys.executable]  # klpo's runs' interpreter (--klpo-python)
WORKLOADS = ("a", "b", "c", "d", "e")
BUILT = ("b", "c")  # compute_workload's locally built Llamas
REAL = ("d", "e")  # the real models (real_workload)
ALIASES = {"both": ("a", "b"), "real": REAL, "all": WORKLOADS}  # both: (a) and (b), as before (c)
SHAPES = {  # (prompts_per_step, group_size, max_new_tokens) of the workloads after (a)
    "b": (4, 8, 128),
    "c": (4, 8, 128),
    "d": (2, 4, 48),
    "e": (2, 4, 32),
}


@dataclass(frozen=True)
class KlpoSide:
    """One klpo side of the table: the job with ``overrides``, its forwards laid out as
    ``layout`` says (a key of :func:`layout_slots`)."""

    overrides: tuple[str, ...]
    layout: str


KLPO_SIDES = {
    "klpo": KlpoSide((), "shared"),
    "klpo packed": KlpoSide(("algo.packing=on",), "packed"),
    "klpo padded, prompt per row": KlpoSide(("rollout.share_prompt=false",), "rows"),
}
"""klpo's sides: ``klpo``, the trainer as configured by default (padded rows, each group's prompt
computed once: ``rollout.share_prompt``); with ``--packing`` also packed rows
(``algo.packing=on``, which computes each sequence's prompt with it) and padded rows with each
row's prompt computed (``rollout.share_prompt=false``), so that the table tells packing's effect
from that of not sharing the prompt."""


@dataclass(frozen=True)
class Settings:
    """The one GRPO job both trainers run (workload ``a``; :meth:`for_workload` for the others)."""

    steps: int = 150
    seed: int = 0
    threads: int = 2
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 2e-4
    beta: float = 0.01
    clip: float = 0.2
    max_new_tokens: int = 4
    temperature: float = 1.0
    grad_clip: float = 1.0
    workload: str = "a"
    model_dir: str = ""  # b, c: the locally built model (compute_workload); d, e: the real one
    data_path: str = ""  # workloads b-e: its prompts as JSONL

    @classmethod
    def for_workload(cls, workload: str, **kw) -> Settings:
        """(a) the built-in task and shipped model, 16 × 8 completions of 4 tokens;
        (b) the ~23.5M-parameter Llama of ``compute_workload``, (c) its ~104M-parameter one with
        a real vocabulary: 4 × 8 completions of 128 tokens after 64-token prompts; (d)
        SmolLM2-135M-Instruct, 2 × 4 completions of up to 48 tokens; (e) Gemma 3 270M, 2 × 4 of
        up to 32 (:data:`SHAPES`)."""
        if workload not in WORKLOADS:
            raise ValueError(f"--workload must be one of {WORKLOADS}, got {workload!r}")
        if workload != "a":
            prompts, group, new = SHAPES[workload]
            shape = {"prompts_per_step": prompts, "group_size": group, "max_new_tokens": new}
            kw = {**shape, **kw, "workload": workload}
        return cls(**kw)

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


# ---------------------------------------------------------------------------------------------
# Settings → each trainer's configuration (no timing, no TRL needed: tested).


def real_workload():
    """``bench/real_workload.py`` (workloads d, e), found beside this file however it was loaded
    (the trainer's own processes import it from ``PYTHONPATH``: :func:`_env`)."""
    name = "real_workload"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def klpo_overrides(s: Settings, out_dir: str) -> list[str]:
    """``klpo train --set`` overrides for the job, overhead off."""
    if s.workload in REAL:
        real = real_workload()
        task = [
            f"model.policy={s.model_dir}",
            "data.source=jsonl",
            f"data.path={s.data_path}",
            f"data.chat={str(real.CHAT[s.workload]).lower()}",
            "data.max_prompt_tokens=128",
            f"rewards=[{{name: '{real.REWARD_NAMES[s.workload]}', weight: 1.0}}]",
        ]
    elif s.workload != "a":
        reward = "lexical_reward" if s.workload == "b" else f"lexical_reward_{s.workload}"
        task = [
            f"model.policy={s.model_dir}",
            "data.source=jsonl",
            f"data.path={s.data_path}",
            "data.max_prompt_tokens=64",
            f"rewards=[{{name: 'compute_workload:{reward}', weight: 1.0}}]",
        ]
    else:
        task = ["model.policy=builtin", "data.source=builtin"]
    return [
        *task,
        "data.shuffle=true",
        "rollout.prompts_per_step=" + str(s.prompts_per_step),
        f"rollout.group_size={s.group_size}",
        f"rollout.max_new_tokens={s.max_new_tokens}",
        f"rollout.temperature={s.temperature}",
        "rollout.top_p=1.0",
        "algo.name=grpo",
        "algo.epochs=1",
        "algo.minibatches=1",
        "algo.micro_batch=0",
        "algo.std=sample",
        "algo.loss_reduction=token-mean",
        f"algo.clip_low={s.clip}",
        f"algo.clip_high={s.clip}",
        "kl.estimator=k3",
        "kl.placement=loss",
        f"kl.beta={s.beta}",
        "kl.controller=fixed",
        f"optim.lr={s.lr}",
        "optim.warmup_steps=0",
        "optim.weight_decay=0.0",
        f"optim.grad_clip={s.grad_clip}",
        f"run.steps={s.steps}",
        f"run.seed={s.seed}",
        f"run.threads={s.threads}",
        f"run.out_dir={out_dir}",
        "run.eval_every=0",
        "run.save_every=0",
        "run.tensorboard=false",
        "run.progress=false",
    ]


def trl_config_kwargs(s: Settings, out_dir: str) -> dict:
    """``trl.GRPOConfig`` keyword arguments for the same job (see the module docstring)."""
    return {
        "output_dir": out_dir,
        "max_steps": s.steps,
        "seed": s.seed,
        "num_generations": s.group_size,
        "per_device_train_batch_size": s.completions_per_step,
        "gradient_accumulation_steps": 1,
        "num_iterations": 1,
        "shuffle_dataset": False,
        "max_completion_length": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": 1.0,
        "top_k": 0,
        "beta": s.beta,
        "use_bias_correction_kl": False,
        "loss_type": "dapo",
        "epsilon": s.clip,
        "scale_rewards": "group",
        "learning_rate": s.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "max_grad_norm": s.grad_clip,
        "activation_checkpointing": False,  # TRL defaults it (as gradient_checkpointing) on
        "use_cpu": True,
        "bf16": False,
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def prompt_examples(s: Settings) -> list:
    """The examples (:class:`klpo.train.data.sources.Example`, chat messages unrendered) in the
    order klpo's trainer serves them, ``steps × prompts_per_step``."""
    from klpo.train.data.sources import Example, PromptStream, read_jsonl
    from klpo.train.data.task import ArithmeticTask

    if s.workload != "a":
        train = read_jsonl(s.data_path)
    else:
        train, _ = ArithmeticTask().splits()
    stream = PromptStream([Example(e.prompt, e.answer, e.messages) for e in train], seed=s.seed)
    return stream.next(s.steps * s.prompts_per_step)


def prompt_order(s: Settings) -> list[tuple[str, str]]:
    """(prompt, answer) in the order klpo's trainer serves them, ``steps × prompts_per_step``
    (a chat prompt's text is empty: its messages are in :func:`trl_prompts`)."""
    return [(e.prompt, e.answer) for e in prompt_examples(s)]


def trl_prompts(s: Settings) -> list:
    """TRL's ``prompt`` column in the same order: a conversational prompt (a list of
    ``{role, content}`` messages, which TRL renders with the tokenizer's chat template as klpo's
    ``data.chat`` does) where the example has messages, else the plain string."""
    return [
        [{"role": r, "content": c} for r, c in e.messages] if e.messages else e.prompt
        for e in prompt_examples(s)
    ]


def rendered_prompts(s: Settings, tokenizer) -> tuple[list[str], list[str]]:
    """(prompt texts as klpo's sampler sees them, answers) for one step's batch: chat messages
    rendered as the trainer renders them (:func:`klpo.train.data.sources.render_chat`)."""
    from klpo.train.data.sources import render_chat

    chat = s.workload in REAL and real_workload().CHAT[s.workload]
    one = Settings(**{**s.__dict__, "steps": 1})
    examples = render_chat(prompt_examples(one), tokenizer, chat=chat)
    return [e.prompt for e in examples], [e.answer for e in examples]


# ---------------------------------------------------------------------------------------------
# Summaries (no timing of their own: tested).


def final_mean(values: list[float], fraction: float = FINAL_FRACTION) -> float:
    """Mean of the last ``ceil(fraction · n)`` values (at least one)."""
    if not values:
        raise ValueError("final_mean of no values")
    k = max(1, math.ceil(fraction * len(values)))
    return math.fsum(values[-k:]) / k


def final_se(values: list[float], fraction: float = FINAL_FRACTION) -> float:
    """Naive standard error of :func:`final_mean`: sample sd / sqrt(k) (0 for one value).

    It treats the last k steps as independent, which they are not quite (each step's policy
    follows from the last), so it is a guide to the noise, not a test.
    """
    k = max(1, math.ceil(fraction * len(values)))
    return statistics.stdev(values[-k:]) / math.sqrt(k) if k > 1 else 0.0


def summarize(step_s: list[float], tokens: list[float], rewards: list[float]) -> dict[str, float]:
    """Median step time, median tokens per second of step time (steps 2..N), the final reward.

    ``tokens_per_s = median over t >= 2 of tokens[t] / step_s[t]`` (step 1 too when it is the only
    one): a median, like the step time, so that a few steps slowed by something else on the
    machine do not move it.
    """
    n = len(step_s)
    if n == 0 or len(tokens) != n or len(rewards) != n:
        raise ValueError(
            f"need one step time, token count and reward per step, got {n}, {len(tokens)}, "
            f"{len(rewards)}"
        )
    skip = 1 if n > 1 else 0
    return {
        "steps": n,
        "median_step_s": statistics.median(step_s),
        "tokens_per_s": statistics.median(
            k / t for k, t in zip(tokens[skip:], step_s[skip:], strict=True)
        ),
        "tokens_per_step": math.fsum(tokens) / n,
        "final_reward": final_mean(rewards),
        "final_reward_se": final_se(rewards),
    }


def layout_record(rollout) -> dict:
    """One step's batch as scoring laid it out (a :class:`klpo.train.rollout.samplers.Rollout`
    after ``pack_rows``): each row's real prompt and completion tokens, the padded prompt and
    completion columns P and C, the group size G, the packs R and their width W where packed
    (else None), and a digest of the sampled completion tokens (to tell two runs drew the same)."""
    import hashlib

    ids = rollout.completion_ids.masked_fill(~rollout.mask.bool(), -1)
    packs = rollout.packs
    return {
        "group": rollout.group_size,
        "prompt_len": rollout.prompt_mask.sum(-1).tolist(),
        "completion_len": rollout.mask.sum(-1).tolist(),
        "prompt_cols": rollout.prompt_ids.shape[1],
        "completion_cols": rollout.completion_ids.shape[1],
        "packs": None if packs is None else packs.n_packs,
        "width": None if packs is None else packs.width,
        "tokens_sha1": hashlib.sha1(json.dumps(ids.tolist()).encode()).hexdigest(),
    }


def layout_slots(rec: dict) -> dict[str, tuple[int, int]]:
    """(token positions computed, real tokens among them) of one forward over the batch of
    :func:`layout_record` ``rec``, by layout; B rows in groups of G, prompt lengths p_b,
    completion lengths c_b (the stop included), P and C padded columns:

    - ``rows`` (padded, each row's prompt computed): B (P + C) positions, sum_b (p_b + c_b) real;
    - ``shared`` (padded, each group's prompt once, ``rollout.share_prompt``, the default):
      (B / G) P + B C positions, sum over groups of p_g + sum_b c_b real;
    - ``packed`` (``algo.packing: on``; only where ``rec`` was packed): R W positions, the packs
      times their width, sum_b (p_b + c_b) real (the rest is filler).

    Each of the step's forwards over the batch (the reference's, the update's, which gives
    pi_old here) computes these positions in its body; the head runs at the completion columns
    alone in every layout. The pad share of a layout is ``1 - real / positions``.

    Example:
        >>> rec = {"group": 2, "prompt_len": [3, 3, 1, 1], "completion_len": [2, 4, 1, 4],
        ...        "prompt_cols": 3, "completion_cols": 4, "packs": 3, "width": 7}
        >>> layout_slots(rec)  # rows 4 × 7 = 28; shared 2 × 3 + 4 × 4 = 22; packed 3 × 7 = 21
        {'rows': (28, 19), 'shared': (22, 15), 'packed': (21, 19)}
    """
    g, p, c = rec["group"], rec["prompt_len"], rec["completion_len"]
    b = len(p)
    if b % g:
        raise ValueError(f"{b} rows are not whole groups of {g}")
    real = sum(p) + sum(c)
    out = {
        "rows": (b * (rec["prompt_cols"] + rec["completion_cols"]), real),
        "shared": (b // g * rec["prompt_cols"] + b * rec["completion_cols"], sum(p[::g]) + sum(c)),
    }
    if rec.get("packs") is not None:
        out["packed"] = (rec["packs"] * rec["width"], real)
    return out


def pad_summary(records: list[dict], layout: str) -> dict[str, float]:
    """Over steps' :func:`layout_record` s, ``layout`` 's positions a step, its pad share
    ``1 - sum real / sum positions``, and, where packed, the share of the pad tokens of padded
    rows (each row's prompt computed) that packing removed: ``1 - sum (R W - real) /
    sum (B (P + C) - real)``.

    Example:
        >>> rec = {"group": 2, "prompt_len": [3, 3, 1, 1], "completion_len": [2, 4, 1, 4],
        ...        "prompt_cols": 3, "completion_cols": 4, "packs": 3, "width": 7}
        >>> got = pad_summary([rec, rec], "packed")  # filler 21 - 19 = 2 of 28 - 19 = 9 pads
        >>> got["positions"], round(got["pad_share"], 4), round(got["pad_removed"], 4)
        (21.0, 0.0952, 0.7778)
    """
    slots = [layout_slots(r) for r in records]
    pos = sum(s[layout][0] for s in slots)
    real = sum(s[layout][1] for s in slots)
    out = {"positions": pos / len(records), "pad_share": 1 - real / pos}
    if layout == "packed":
        pads = sum(s["rows"][0] - s["rows"][1] for s in slots)
        out["pad_removed"] = 1 - (pos - real) / pads if pads else float("nan")
    return out


def lengths_text(lengths: list[int]) -> str:
    """``min / median / max`` of completion lengths (the median of an even count may be x.5)."""
    if not lengths:
        return "n/a"
    return f"{min(lengths)} / {statistics.median(lengths):g} / {max(lengths)}"


def first_step_difference(a: dict, b: dict) -> tuple[float, str]:
    """The largest relative difference ``|x - y| / max(|x|, |y|)`` (0 where both are 0) between
    two runs' step-1 metrics over the keys both logged, times and throughput left out, and its
    key.

    Example:
        >>> first_step_difference({"loss/total": 2.0, "kl/ref/k3": 0.0, "time/step": 3.0},
        ...                       {"loss/total": 2.5, "kl/ref/k3": 0.0, "time/step": 1.0})
        (0.2, 'loss/total')
    """
    worst, key = 0.0, ""
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if k.startswith("time/") or k in ("tokens_per_s", "step") or isinstance(x, bool):
            continue
        if not isinstance(x, (int, float)) or not isinstance(y, (int, float)):
            continue
        scale = max(abs(x), abs(y))
        d = abs(x - y) / scale if scale else 0.0
        if d > worst or not key:
            worst, key = d, k
    return worst, key


# ---------------------------------------------------------------------------------------------
# Running a worker, and how busy the rest of the machine was meanwhile.


def _busy_cpu_s() -> float | None:
    """CPU seconds spent by the whole machine so far (``/proc/stat``), None where unavailable."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run_worker(cmd: list[str], threads: int, what: str) -> dict:
    """Run the Python command ``cmd`` (``[python, -m module | script, args...]``): its wall time,
    its own CPU seconds (which a busy machine's other processes change least), its peak RSS
    (:func:`run_recording_peak`) and the CPU seconds other processes used meanwhile."""
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        peak = Path(tmp) / "peak"
        wrapped = [cmd[0], os.path.abspath(__file__), "--peak-rss-to", str(peak), *cmd[1:]]
        proc = subprocess.run(wrapped, env=_env(threads), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
        wall = time.perf_counter() - t0
        busy1, own1 = _busy_cpu_s(), _own_cpu_s()
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        peak_mib = float(peak.read_text())
    others = None if busy0 is None else max(0.0, (busy1 - busy0) - (own1 - own0))
    return {
        "process_s": wall,
        "cpu_s": own1 - own0,
        "others_cpu_s": others,
        "peak_rss_mib": peak_mib,
    }


def _vm_hwm_mib() -> float:
    """This process's peak resident memory (``VmHWM``: since its exec, not its parent's), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


def run_recording_peak(out: str, argv: list[str]) -> None:
    """Run ``argv`` as ``python`` would (``-m module args``, ``-c code args`` or ``script
    args``) in this process, and write its peak RSS in MiB to ``out`` as it exits."""
    atexit.register(lambda: Path(out).write_text(str(_vm_hwm_mib())))
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------------------------------------
# Workers: each trainer in its own process.


def _env(threads: int) -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    bench = str(Path(__file__).resolve().parent)  # compute_workload's rewards, for b and c
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": src + os.pathsep + bench + (os.pathsep + path if path else ""),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TRANSFORMERS_VERBOSITY": "error",
    }


def record_layouts(path: str) -> None:
    """``klpo`` (its command line, ``sys.argv[1:]``) in this process, each step's batch layout
    appended to ``path`` as a JSON line (:func:`layout_record`): the trainer's ``pack_rows``,
    which ``score`` calls once a step to plan the layout every pass over the batch then keeps,
    wrapped to record what it returns. Nothing the trainer computes changes; the record costs
    reading B lengths and a digest of the completion tokens, the same on every side."""
    import klpo.train.step.score as score_module

    plan = score_module.pack_rows

    def recorded(rollout, packed: bool = True):
        out = plan(rollout, packed)
        with open(path, "a") as f:
            f.write(json.dumps(layout_record(out)) + "\n")
        return out

    score_module.pack_rows = recorded
    sys.argv = ["klpo", *sys.argv[1:]]
    runpy.run_module("klpo", run_name="__main__", alter_sys=True)


def run_klpo(s: Settings, work: Path, extra: list[str] = ()) -> dict:
    """``klpo train`` in a subprocess (through :func:`record_layouts`); its ``metrics.jsonl``,
    summarised, its step-1 metrics (``first_step``) and each step's layout (``layouts``)."""
    from klpo.train.runtime.metrics import read_metrics

    out = work / "klpo"
    work.mkdir(parents=True, exist_ok=True)
    layouts = work / "layouts.jsonl"
    layouts.unlink(missing_ok=True)
    record = f"import trainer_vs_trl; trainer_vs_trl.record_layouts({str(layouts)!r})"
    cmd = [
        KLPO_PYTHON[0],
        "-c",
        record,
        "train",
        *[arg for o in [*klpo_overrides(s, str(out)), *extra] for arg in ("--set", o)],
    ]
    run = run_worker(cmd, s.threads, "klpo train")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "time/step" in r]
    recs = [json.loads(line) for line in layouts.read_text().splitlines()]
    n = s.completions_per_step
    result = summarize(
        [r["time/step"] for r in rows],
        [r["completion/length"] * n for r in rows],
        [r["reward/mean"] for r in rows],
    )
    split = {
        k: statistics.median(r[f"time/{k}"] for r in rows) for k in ("generate", "score", "update")
    }
    return {
        **result,
        **run,
        "split": split,
        "first_step": rows[0],
        "first_step_sha1": recs[0]["tokens_sha1"],
        "layouts": recs,
    }


def trl_worker(s: Settings, out_path: str) -> None:
    """TRL's GRPOTrainer on the job; writes per-step times, tokens and rewards as JSON."""
    import torch

    torch.set_num_threads(s.threads)
    try:
        result = trl_job(s)
    except ImportError as err:
        result = {"unavailable": f"TRL is not importable ({err})"}
    Path(out_path).write_text(json.dumps(result))


def trl_job(s: Settings, config: dict | None = None, peft_config=None) -> dict:
    """TRL's GRPOTrainer on the job (``config`` overrides :func:`trl_config_kwargs`, e.g. for a
    GPU); per-step times, tokens and rewards. ImportError where TRL is not importable."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    from klpo.train.models.load import default_reference_path
    from klpo.train.rewards.functions import exact_match

    if s.workload in REAL:
        task_reward = real_workload().rewards()[s.workload]
        model_dir = s.model_dir
    elif s.workload != "a":
        from compute_workload import REWARDS

        task_reward = REWARDS[s.workload]
        model_dir = s.model_dir
    else:
        task_reward = exact_match
        model_dir = str(default_reference_path())
    order = prompt_order(s)
    data = Dataset.from_dict({"prompt": trl_prompts(s), "answer": [a for _, a in order]})
    rewards: list[float] = []
    tokens: list[int] = []
    lengths: list[int] = []  # each completion's tokens
    gen_score: list[float] = []
    generate_s: list[float] = []

    def exact_match_reward(prompts, completions, answer, completion_ids, **_):
        """klpo's reward of the workload; records the step's mean reward and completion tokens.
        A conversational completion (one assistant message) is scored on its text, as klpo's."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = task_reward(list(prompts), texts, list(answer))
        rewards.append(math.fsum(scores) / len(scores))
        tokens.append(sum(len(ids) for ids in completion_ids))  # up to and including EOS
        lengths.extend(len(ids) for ids in completion_ids)
        return scores

    class Timed(trl.GRPOTrainer):
        """Stock GRPOTrainer; only times its sampling + scoring (for the profile)."""

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            generate_s.append(time.perf_counter() - t0)
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_score.append(time.perf_counter() - t0)
            return out

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            sync()  # on a GPU, the step's kernels are inside its time
            self.begin.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.end.append(time.perf_counter())

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Timed(
            model=model_dir,
            reward_funcs=exact_match_reward,
            args=trl.GRPOConfig(**{**trl_config_kwargs(s, tmp), **(config or {})}),
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[timer],
            peft_config=peft_config,
        )
        init_peak = _vm_hwm_mib()  # the peak so far: loading both models, building the trainer
        trainer.train()
    step_s = [e - b for b, e in zip(timer.begin, timer.end, strict=True)]
    gaps = [b - e for e, b in zip(timer.end, timer.begin[1:], strict=False)]
    return {
        "version": trl.__version__,
        "step_s": step_s,
        "tokens": tokens,
        "lengths": lengths,
        "rewards": rewards,
        "generate_s": generate_s,
        "gen_score_s": gen_score,
        "between_steps_s": gaps,
        "threads": torch.get_num_threads(),
        "init_peak_rss_mib": init_peak,
    }


def run_json_worker(s: Settings, work: Path, worker: str, what: str) -> tuple[dict, dict]:
    """This script's ``--worker WORKER`` in a subprocess: (its JSON output, :func:`run_worker`'s)."""
    out = work / f"{worker}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", worker, "--out", str(out)]
    run = run_worker([*cmd, *_cli(s)], s.threads, what)
    return json.loads(out.read_text()), run


def run_trl(s: Settings, work: Path) -> dict:
    raw, run = run_json_worker(s, work, "trl", "the TRL run")
    if "unavailable" in raw:
        return raw
    result = summarize(raw["step_s"], raw["tokens"], raw["rewards"])
    gen = statistics.median(raw["generate_s"])
    gen_score = statistics.median(raw["gen_score_s"])
    split = {
        "generate": gen,
        "score": gen_score - gen,
        "update": result["median_step_s"] - gen_score,
    }
    return {
        **result,
        **run,
        "split": split,
        "version": raw["version"],
        "lengths": raw["lengths"],
        "init_peak_rss_mib": raw.get("init_peak_rss_mib"),
        "between_steps_s": statistics.median(raw["between_steps_s"] or [0.0]),
    }


# ---------------------------------------------------------------------------------------------
# The fixed-batch loss check.


def loss_worker(s: Settings, out_path: str) -> None:
    """klpo's GRPO loss (the trainer's ``micro_step``) and TRL's ``_compute_loss`` on one batch.

    The batch: 16 prompts × 8 completions sampled by a policy moved off the reference (seeded
    noise of 0.2 × each tensor's std, :data:`PERTURB`, so that the KL term is not zero;
    ``--perturb`` with ``--worker loss`` sets it), scored by klpo's trainer (rewards, log-probs,
    group advantages). TRL gets the same prompt and completion ids and masks,
    advantages, reference log-probs and token count, and no old log-probs (what its trainer does
    with one update per batch: pi_old is the policy's own detached log-probs).
    """
    import torch

    torch.set_num_threads(s.threads)
    import trl
    from datasets import Dataset

    from klpo import reduce
    from klpo.train.config import load_config
    from klpo.train.models.build import build_models
    from klpo.train.rewards.functions import resolve_rewards
    from klpo.train.rollout.samplers import Decoding, generate
    from klpo.train.runtime.dist import Dist
    from klpo.train.runtime.metrics import Tally
    from klpo.train.step.kl_term import kl_term
    from klpo.train.step.score import score
    from klpo.train.step.update import MicroBatch, micro_step

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, klpo_overrides(s, tmp))
        torch.manual_seed(s.seed)
        dist = Dist()
        m = build_models(cfg, dist, None)
        gen = torch.Generator().manual_seed(s.seed + 1)
        with torch.no_grad():
            for p in m.policy.parameters():
                p.add_(PERTURB[0] * p.std() * torch.randn(p.shape, generator=gen))
        prompts, answers = rendered_prompts(s, m.tokenizer)
        m.policy.eval()
        rollout = generate(
            m.policy,
            m.tokenizer,
            prompts,
            answers,
            Decoding(
                group_size=s.group_size, max_new_tokens=s.max_new_tokens, temperature=s.temperature
            ),
            codec=m.codec,
        )
        m.policy.train()
        reward_fns = resolve_rewards({"exact_match": 1.0})
        scored = score(cfg, m, rollout, reward_fns, s.beta)
        mask = rollout.mask
        rows = torch.arange(mask.shape[0])
        n_tokens = reduce.normaliser(mask, "token-mean", max_len=s.max_new_tokens)

        params = [p for p in m.policy.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        metrics = micro_step(
            cfg,
            m,
            MicroBatch.of(cfg, scored, rows, n_tokens),
            kl_term(cfg, beta=s.beta, beta_old=1.0),
            dist,
            sync=True,
            tally=Tally(),
        )
        klpo_value = metrics["loss/total"]
        klpo_grad = torch.cat([p.grad.flatten() for p in params]).double()

        args = trl.GRPOConfig(**{**trl_config_kwargs(s, tmp), "max_steps": 1})
        trainer = trl.GRPOTrainer(
            model=m.policy,
            reward_funcs=lambda completions, **_: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["1+1="] * s.group_size}),
            processing_class=m.tokenizer,
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by the HF loop; we call the loss
        inputs = {
            "prompt_ids": rollout.prompt_ids,
            "prompt_mask": rollout.prompt_mask.long(),
            "completion_ids": rollout.completion_ids,
            "completion_mask": mask.long(),
            "advantages": scored.adv[:, 0],  # every completion has >= 1 token
            "ref_per_token_logps": scored.logp_ref,
            "num_items_in_batch": mask.sum(),
        }
        for p in params:
            p.grad = None
        loss = trl.GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        loss.backward()
        trl_value = float(loss)
        trl_grad = torch.cat([p.grad.flatten() for p in params]).double()
        # The yardstick of float32 rounding: TRL's own gradient with the batch's rows reversed
        # (the same loss, its sums over rows and tokens taken in another order).
        flipped = {k: v.flip(0) if k != "num_items_in_batch" else v for k, v in inputs.items()}
        for p in params:
            p.grad = None
        trl.GRPOTrainer._compute_loss(trainer, trainer.model, flipped).backward()
        trl_flip = torch.cat([p.grad.flatten() for p in params]).double()

    Path(out_path).write_text(
        json.dumps(
            {
                "klpo": klpo_value,
                "trl": trl_value,
                "abs": abs(klpo_value - trl_value),
                "rel": abs(klpo_value - trl_value) / max(abs(trl_value), 1e-30),
                "grad_rel": float((klpo_grad - trl_grad).norm() / trl_grad.norm()),
                "trl_reversed_grad_rel": float((trl_flip - trl_grad).norm() / trl_grad.norm()),
                "grad_norm": float(trl_grad.norm()),
                "loss_kl": metrics["loss/kl"],
                "k3_mean": metrics["loss/kl"],  # the token mean of k3 (its weight is 1)
                "tokens": int(mask.sum()),
                "sequences": int(mask.shape[0]),
                "padded_prompts": int((~rollout.prompt_mask).any(-1).sum()),
            }
        )
    )


def run_loss_check(s: Settings, work: Path) -> dict:
    return run_json_worker(s, work, "loss", "the loss check")[0]


# ---------------------------------------------------------------------------------------------
# The parent: klpo, then TRL, then the loss check; one table.


def _cli(s: Settings) -> list[str]:
    return [
        "--steps",
        str(s.steps),
        "--seed",
        str(s.seed),
        "--threads",
        str(s.threads),
        "--workload",
        s.workload,
        "--prompts",
        str(s.prompts_per_step),
        "--new-tokens",
        str(s.max_new_tokens),
        "--model-dir",
        s.model_dir,
        "--data-path",
        s.data_path,
    ]


def cpu_info() -> str:
    """The CPU model and its vector/matrix flags, as benchmarks on machines of our kind differ."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return f"{model}; {os.cpu_count()} logical CPUs; flags: {' '.join(shown) or 'n/a'}"


def floor_decode(model, rollout, group_size: int) -> None:
    """The floor's generation: each prompt's prefill once, then one cached single-token forward
    per new token for every row (argmax, no sampling machinery, the cache allocated once), as
    many tokens as ``rollout``'s completions hold."""
    import torch

    from klpo.train.rollout.samplers import preallocate

    g, c = group_size, rollout.completion_ids.shape[1]
    ids, att = rollout.prompt_ids[::g], rollout.prompt_mask[::g].long()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(g)
        preallocate(cache, c)  # writes each new position in place (no cache copies)
        token = out.logits[:, -1].argmax(-1).repeat_interleave(g)
        att = att.repeat_interleave(g, dim=0)
        for _ in range(c - 1):
            att = torch.cat([att, torch.ones_like(att[:, :1])], dim=1)
            out = model(
                input_ids=token[:, None], attention_mask=att, past_key_values=cache, use_cache=True
            )
            token = out.logits[:, -1].argmax(-1)


FLOOR_LOGITS = 2**27  # the floor's head: float32 logits per chunk of rows (512 MiB)


def floor_head(hidden, weight, rollout, backward: bool) -> None:
    """The floor's head on the completion hidden states ``[B, C, H]``: float32 logits,
    log-softmax, the completion tokens' log-probs; with ``backward``, the gradient of their masked
    sum into the head and (through ``hidden``) the body. In chunks of rows of at most
    :data:`FLOOR_LOGITS` logits (one chunk below V = 8192 at these shapes): the same arithmetic as
    one pass, with memory for one chunk's logits, as anyone would write it at a real vocabulary."""
    import torch

    ids, mask = rollout.completion_ids, rollout.mask
    rows = max(1, FLOOR_LOGITS // (ids.shape[1] * weight.shape[0]))
    h = hidden.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        for i in range(0, ids.shape[0], rows):
            r = slice(i, i + rows)
            logp = (h[r] @ weight.T).float().log_softmax(-1).gather(-1, ids[r, :, None])
            if backward:
                (logp.squeeze(-1) * mask[r]).sum().backward()
    if backward:
        hidden.backward(h.grad)


def floor_worker(s: Settings, out_path: str) -> None:
    """The model's own time for the tokens a step must compute, with no trainer around it.

    On the step's batch (sampled once): generation = each prompt's prefill once plus one cached
    single-token forward per new token for every row (argmax, no sampling machinery, the cache
    allocated once); the
    reference = one no-grad forward over each prompt once and every completion token, with the
    head's log-softmax at the completion tokens (:func:`floor_head`); the policy = the same
    forward with its backward. Each the median of 3 timings; the floor is their sum.
    """
    import torch

    torch.set_num_threads(s.threads)
    from klpo.train.config import load_config
    from klpo.train.models.backbone import Backbone
    from klpo.train.models.build import build_models
    from klpo.train.rollout.samplers import Decoding, completion_hidden, generate
    from klpo.train.runtime.dist import Dist

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, klpo_overrides(s, tmp))
        torch.manual_seed(s.seed)
        m = build_models(cfg, Dist(), None)
    prompts, answers = rendered_prompts(s, m.tokenizer)
    model = m.policy
    model.eval()
    rollout = generate(
        model,
        m.tokenizer,
        prompts,
        answers,
        Decoding(group_size=s.group_size, max_new_tokens=s.max_new_tokens),
        codec=m.codec,
    )
    g = s.group_size
    backbone = Backbone(model)
    weight = model.get_output_embeddings().weight

    def decode():
        floor_decode(model, rollout, g)

    def reference():
        with torch.no_grad():
            floor_head(completion_hidden(backbone, rollout), weight, rollout, backward=False)

    def policy():
        model.zero_grad(set_to_none=True)
        floor_head(completion_hidden(backbone, rollout), weight, rollout, backward=True)

    def timed(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    model.train()
    result = {"generate": timed(decode), "reference": timed(reference), "policy": timed(policy)}
    result["floor"] = math.fsum(result.values())
    Path(out_path).write_text(json.dumps(result))


def run_floor(s: Settings, work: Path) -> dict:
    return run_json_worker(s, work, "floor", "the floor")[0]


def combine(runs: list[dict]) -> dict:
    """Several runs of one trainer: medians of the per-run medians, and their spread."""
    steps = [r["median_step_s"] for r in runs]
    tps = [r["tokens_per_s"] for r in runs]
    return {
        **runs[0],
        "runs": len(runs),
        "median_step_s": statistics.median(steps),
        "step_min": min(steps),
        "step_max": max(steps),
        "tokens_per_s": statistics.median(tps),
        "tps_min": min(tps),
        "tps_max": max(tps),
        "tokens_per_step": statistics.median(r["tokens_per_step"] for r in runs),
        "final_reward": statistics.fmean(r["final_reward"] for r in runs),
        "final_reward_se": math.sqrt(math.fsum(r["final_reward_se"] ** 2 for r in runs))
        / len(runs),
        "split": {
            k: statistics.median(r["split"][k] for r in runs)
            for k in ("generate", "score", "update")
        },
        "others_cpu_s": sum(r["others_cpu_s"] or 0.0 for r in runs),
        "process_s": sum(r["process_s"] for r in runs),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
        # every run's steps' layouts (klpo) and completion lengths (TRL), where recorded
        **{k: [x for r in runs for x in r[k]] for k in ("layouts", "lengths") if k in runs[0]},
    }


def runs_table(klpo: dict, trl: dict | None, floor: dict | None) -> str:
    head = (
        "| trainer | runs × steps | median step s (min–max) | generate / score / update s "
        "| tokens/s (min–max) | tokens/step | final reward ± se | peak RSS MiB | step / floor |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [head]
    sides = [("klpo", klpo)] + ([(f"TRL {trl['version']}", trl)] if trl else [])
    for name, r in sides:
        split = " / ".join(f"{r['split'][k]:.3f}" for k in ("generate", "score", "update"))
        vs_floor = f"{r['median_step_s'] / floor['floor']:.2f}" if floor else "n/a"
        rows.append(
            f"| {name} | {r['runs']} × {r['steps']} | {r['median_step_s']:.3f} "
            f"({r['step_min']:.3f}–{r['step_max']:.3f}) | {split} | {r['tokens_per_s']:.0f} "
            f"({r['tps_min']:.0f}–{r['tps_max']:.0f}) | {r['tokens_per_step']:.1f} | "
            f"{r['final_reward']:.3f} ± {r['final_reward_se']:.3f} | {r['peak_rss_mib']:.0f} | "
            f"{vs_floor} |"
        )
    if trl:
        rows.append(
            f"| klpo / TRL | | {klpo['median_step_s'] / trl['median_step_s']:.2f} | "
            + " / ".join(
                f"{klpo['split'][k] / trl['split'][k]:.2f}" for k in ("generate", "score", "update")
            )
            + f" | **{klpo['tokens_per_s'] / trl['tokens_per_s']:.2f}** | "
            f"{klpo['tokens_per_step'] / trl['tokens_per_step']:.2f} | "
            f"{klpo['final_reward'] / max(trl['final_reward'], 1e-12):.2f} | "
            f"**{klpo['peak_rss_mib'] / trl['peak_rss_mib']:.2f}** | |"
        )
    if floor:
        rows.append(
            f"| floor (model alone) | | {floor['floor']:.3f} | {floor['generate']:.3f} / "
            f"{floor['reference']:.3f} / {floor['policy']:.3f} (generate / reference / policy) | "
            "| | | | 1.00 |"
        )
    return "\n".join(rows)


def completion_lengths(side: dict) -> list[int]:
    """Each sampled completion's tokens (the stop included) over a side's runs and steps."""
    if "layouts" in side:
        return [c for rec in side["layouts"] for c in rec["completion_len"]]
    return side.get("lengths", [])


def packing_table(sides: dict[str, dict], trl: dict | None) -> str:
    """klpo's sides (:data:`KLPO_SIDES`, combined runs) and TRL: step time, tokens/s, the
    completion lengths drawn, the token positions a forward over the step's batch computes and
    their pad share (:func:`pad_summary`), peak RSS; then packed over each other side."""
    head = (
        "| side | runs × steps | median step s (min–max) | completion tokens/s (min–max) "
        "| completion length min / median / max | positions a forward / step | pad share "
        "| peak RSS MiB |\n"
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [head]
    named = dict(sides)
    if trl:
        named[f"TRL {trl['version']}"] = trl
    for name, r in named.items():
        if name in KLPO_SIDES:
            pads = pad_summary(r["layouts"], KLPO_SIDES[name].layout)
            positions, share = f"{pads['positions']:.0f}", f"{pads['pad_share']:.1%}"
        else:
            positions, share = "n/a (padded rows)", "n/a"
        rows.append(
            f"| {name} | {r['runs']} × {r['steps']} | {r['median_step_s']:.3f} "
            f"({r['step_min']:.3f}–{r['step_max']:.3f}) | {r['tokens_per_s']:.0f} "
            f"({r['tps_min']:.0f}–{r['tps_max']:.0f}) | {lengths_text(completion_lengths(r))} | "
            f"{positions} | {share} | {r['peak_rss_mib']:.0f} |"
        )
    packed = sides.get("klpo packed")
    if packed:
        for name, r in named.items():
            if name == "klpo packed":
                continue
            rows.append(
                f"| packed / {name} | | {packed['median_step_s'] / r['median_step_s']:.2f} | "
                f"**{packed['tokens_per_s'] / r['tokens_per_s']:.2f}** | | | | "
                f"{packed['peak_rss_mib'] / r['peak_rss_mib']:.2f} |"
            )
    return "\n".join(rows)


def packing_notes(sides: dict[str, dict]) -> list[str]:
    """The lines under :func:`packing_table`: the pad tokens packing removed, and whether each
    klpo side drew the same tokens at step 1 of run 1 as ``klpo`` and computed the same
    metrics from them (to float32 rounding: relative 1e-4)."""
    lines = []
    if "klpo packed" in sides:
        pads = pad_summary(sides["klpo packed"]["layouts"], "packed")
        lines.append(
            f"Packing removed {pads['pad_removed']:.1%} of the pad tokens that the same batches "
            "take in padded rows with each row's prompt (packed filler R W - real over "
            "B (P + C) - real, summed over the packed side's steps and runs)."
        )
    base = sides.get("klpo")
    for name, r in sides.items():
        if name == "klpo" or base is None:
            continue
        same = r["first_step_sha1"] == base["first_step_sha1"]
        rel, key = first_step_difference(r["first_step"], base["first_step"])
        verdict = "the same to float32 rounding" if rel <= 1e-4 else "NOT the same"
        lines.append(
            f"Step 1 of run 1, {name} against klpo: "
            + ("the same sampled tokens" if same else "DIFFERENT sampled tokens")
            + f"; metrics {verdict} (largest relative difference {rel:.1e}, {key})."
        )
    return lines


def _log(what: str, result: dict) -> None:
    """Each run's summary as it ends (stderr), so that a long benchmark's runs are kept."""
    short = {k: v for k, v in result.items() if k not in ("layouts", "lengths", "first_step")}
    print(f"{what}: {json.dumps(short)}", file=sys.stderr, flush=True)


def parse_workloads(text: str) -> tuple[str, ...]:
    """``--workload``: one of :data:`WORKLOADS`, a comma-separated list of them, or an alias."""
    if text in ALIASES:
        return ALIASES[text]
    names = tuple(w.strip() for w in text.split(",") if w.strip())
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise SystemExit(
            f"--workload takes {', '.join(WORKLOADS)}, a comma-separated list of them, "
            f"{' or '.join(ALIASES)}; got {text!r}"
        )
    return names


def with_built_model(s: Settings, work: Path) -> Settings:
    """Workloads (b) and (c): build the model and write the prompts under ``work`` (no download);
    (d) and (e): the real model from klpo's cache (``make real-models``) and the prompts."""
    w = s.workload
    if w in REAL:
        real = real_workload()
        model_dir = real.model_dir(w)
        data = real.write_prompts(work / f"prompts-{w}.jsonl", 4 * 64, s.seed, w)
    else:
        import compute_workload

        model_dir = compute_workload.build_model(work / f"model-{w}", w)
        data = compute_workload.write_prompts(work / f"prompts-{w}.jsonl", 4 * 64, s.seed, w)
    return Settings(**{**s.__dict__, "model_dir": str(model_dir), "data_path": str(data)})


def main() -> None:
    if sys.argv[1:2] == ["--peak-rss-to"]:  # run_worker's wrapper around a worker
        run_recording_peak(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="training steps per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per trainer, interleaved")
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--threads", type=int, default=Settings.threads, help="torch threads")
    parser.add_argument(
        "--workload",
        default="both",
        help="a, b, c, d, e, a comma-separated list of them, both (a,b; the default), real "
        "(d,e) or all",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        help="prompts a step (16 on (a), 4 on (b), (c), 2 on (d), (e)): a smaller job",
    )
    parser.add_argument(
        "--new-tokens", type=int, help="max new tokens (the workload's: 4, 128, 48, 32)"
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: floor, loss (the floor's or the fixed-batch check's process, e.g. "
        "for a run that measures only the trainers' peak memory at a larger batch)",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="two more klpo sides, interleaved with the others: packed rows (algo.packing=on) and "
        "padded rows with each row's prompt computed (rollout.share_prompt=false); a second "
        "table with their step times, tokens/s, completion lengths and pad shares",
    )
    parser.add_argument("--klpo-set", action="append", default=[], help="extra klpo --set")
    parser.add_argument(
        "--klpo-python",
        default=sys.executable,
        help="the interpreter of klpo's runs (default this one; the peers' environment may lack "
        "klpo's own dependencies)",
    )
    parser.add_argument("--worker", choices=["trl", "loss", "floor"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)
    parser.add_argument("--data-path", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--perturb", type=float, default=PERTURB[0], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        s = Settings.for_workload(
            args.workload,
            steps=args.steps or 1,
            seed=args.seed,
            **({"prompts_per_step": args.prompts} if args.prompts else {}),
            **({"max_new_tokens": args.new_tokens} if args.new_tokens else {}),
            threads=args.threads,
            model_dir=args.model_dir,
            data_path=args.data_path,
        )
        PERTURB[0] = args.perturb  # the loss worker run alone: how far the policy is moved
        {"trl": trl_worker, "loss": loss_worker, "floor": floor_worker}[args.worker](s, args.out)
        return

    workloads = parse_workloads(args.workload)
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if skip - {"floor", "loss"}:
        parser.error(f"--skip takes floor and loss, got {args.skip!r}")
    KLPO_PYTHON[0] = args.klpo_python
    has_trl = importlib.util.find_spec("trl") is not None
    start = time.perf_counter()
    print(f"CPU: {cpu_info()}\n")
    if not has_trl:
        print("TRL is not installed (pip install trl==1.16.0): klpo alone.\n")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for w in workloads:
            s = Settings.for_workload(w, seed=args.seed, threads=args.threads)
            if args.prompts:
                s = Settings(**{**s.__dict__, "prompts_per_step": args.prompts})
            if args.new_tokens:
                s = Settings(**{**s.__dict__, "max_new_tokens": args.new_tokens})
            s = Settings(**{**s.__dict__, "steps": args.steps or (30 if w == "a" else 4)})
            if w != "a":
                s = with_built_model(s, work)
            names = [n for n in KLPO_SIDES if args.packing or n == "klpo"]
            side_runs: dict[str, list[dict]] = {n: [] for n in names}
            trl_runs = []
            for i in range(args.runs):
                (work / f"{w}-{i}").mkdir(parents=True, exist_ok=True)
            for i in range(args.runs):  # A B A B A B (A B C D ... with --packing)
                for j, n in enumerate(names):
                    print(f"[{w}] run {i + 1}/{args.runs}: {n} ...", file=sys.stderr, flush=True)
                    side_dir = work / f"{w}-{i}" / (f"side-{j}" if j else "")
                    extra = [*KLPO_SIDES[n].overrides, *args.klpo_set]
                    side_runs[n].append(run_klpo(s, side_dir, extra))
                    _log(f"[{w}] {n} run {i + 1}", side_runs[n][-1])
                if has_trl:
                    print(f"[{w}] run {i + 1}/{args.runs}: TRL ...", file=sys.stderr, flush=True)
                    t = run_trl(s, work / f"{w}-{i}")
                    if "unavailable" in t:
                        print(t["unavailable"], file=sys.stderr)
                        has_trl = False
                    else:
                        trl_runs.append(t)
                        _log(f"[{w}] TRL run {i + 1}", t)
            floor = None if "floor" in skip else run_floor(s, work / f"{w}-0")
            if floor:
                _log(f"[{w}] floor", floor)
            loss = run_loss_check(s, work / f"{w}-0") if trl_runs and "loss" not in skip else None
            sides = {n: combine(r) for n, r in side_runs.items()}
            klpo = sides["klpo"]
            trl = combine(trl_runs) if trl_runs else None
            print(
                f"## Workload ({w}): {s.prompts_per_step} prompts × {s.group_size} completions, "
                f"up to {s.max_new_tokens} new tokens, {s.threads} torch threads per trainer\n"
            )
            print(runs_table(klpo, trl, floor))
            if args.packing:
                print(
                    "\nPacked rows against padded ones (completion tokens/s as above; a forward's "
                    "positions: the token positions each forward over the step's batch computes, "
                    "mean over steps; pad share: those not a real token):\n"
                )
                print(packing_table(sides, trl))
                print("\n" + "\n".join(packing_notes(sides)))
            others = sum(r["others_cpu_s"] for r in sides.values()) + (
                trl["others_cpu_s"] if trl else 0.0
            )
            busy = sum(r["process_s"] for r in sides.values()) + (trl["process_s"] if trl else 0.0)
            quiet = others <= 0.05 * busy * s.threads
            print(
                f"\nOther processes used {others:.1f} CPU-s over {busy:.0f} s of runs"
                + ("." if quiet else ": NOT a quiet machine, the times are not trustworthy.")
            )
            if loss:
                print(
                    f"Fixed batch ({loss['sequences']} completions, {loss['tokens']} tokens): klpo "
                    f"micro_step loss {loss['klpo']:.9f}, TRL _compute_loss {loss['trl']:.9f}; "
                    f"relative {loss['rel']:.2e}; gradient relative error {loss['grad_rel']:.2e} "
                    f"(TRL's own with the rows reversed: {loss['trl_reversed_grad_rel']:.2e})."
                )
            print()
    print(
        "Median step time: the median over a run's steps, then the median over runs (min–max of "
        "the runs in brackets); tokens/s = median over steps 2..N of completion tokens (EOS "
        "included) / step time; final reward = mean reward over the last "
        f"{FINAL_FRACTION:.0%} of steps, averaged over runs. klpo / TRL: below 1 is faster for "
        "times, above 1 better for tokens/s. step / floor: the side's median step over the "
        "model's own generation + reference + policy time for the same tokens."
    )
    print(f"total wall time {time.perf_counter() - start:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
