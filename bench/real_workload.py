"""Workloads (d) and (e) of ``bench/trainer_vs_trl.py``: GRPO on the project's two real models.

- **(d)** SmolLM2-135M-Instruct (Llama, 30 layers, V = 49,152, ChatML), ``data.chat=true``: each
  prompt one user message, a problem of the built-in chat task
  (:class:`klpo.train.data.chat_task.ChatArithmeticTask`, its train split) asking for the working
  and then the answer, so that completions run to most of their room; rendered by the model's
  chat template (its default system prompt included) on both sides; scored by klpo's
  ``numeric`` reward (the completion's last number against the answer).
- **(e)** Gemma 3 270M base (18 layers, V = 262,144, no chat template): plain prompts, the same
  problems as ``"Question: ...\\nAnswer:"``; scored by :func:`first_number` (a base model writes
  the answer and then goes on with more text, so the first number is its answer).

The models are the ones ``make real-models`` converts into klpo's cache
(:func:`klpo.train.tools.real_models.real_model_dir`); nothing is downloaded here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REAL_MODEL = {"d": "smollm2", "e": "gemma3"}  # the workload's key of klpo's REAL_MODELS
CHAT = {"d": True, "e": False}
WORKING = "Show your working in one or two short sentences, then give the answer."
"""The sentence after each (d) question (the chat task's own asks for the bare number)."""

_FIRST = re.compile(r"-?\d+")


def model_dir(workload: str) -> Path:
    """The converted real model of ``workload`` (``d`` or ``e``).

    Raises:
        FileNotFoundError: it is not converted here, naming ``make real-models``.
    """
    from klpo.train.tools.real_models import REAL_MODELS, real_model_dir

    key = REAL_MODEL[workload]
    path = real_model_dir(key)
    if path is None:
        raise FileNotFoundError(
            f"workload ({workload}) needs {REAL_MODELS[key].name}, which is not converted here: "
            "run `make real-models`"
        )
    return path


def prompts(n: int, seed: int, workload: str) -> list[dict]:
    """``n`` rows ``{"prompt", "answer"}``: (d) one user message each, (e) a plain string; the
    first ``n`` problems of the chat task's train split drawn with ``seed``."""
    from klpo.train.data.chat_task import ChatArithmeticTask

    if workload not in REAL_MODEL:
        raise ValueError(f"real workloads are {', '.join(REAL_MODEL)}, got {workload!r}")
    task = ChatArithmeticTask(n_heldout=1, n_train=n, seed=seed)
    rows = []
    for _kind, question, answer in task.problems()[1:]:
        if CHAT[workload]:
            prompt: object = [{"role": "user", "content": f"{question} {WORKING}"}]
        else:
            prompt = f"Question: {question}\nAnswer:"
        rows.append({"prompt": prompt, "answer": str(answer)})
    return rows


def write_prompts(path: Path, n: int, seed: int, workload: str) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts(n, seed, workload)))
    return path


def first_number(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Workload (e): 1.0 where the completion's first integer equals the answer, else 0.0."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        m = _FIRST.search(c)
        out.append(float(m is not None and int(m.group(0)) == int(a)))
    return out


def rewards() -> dict:
    """Each workload's reward function (TRL's side calls it on the same texts)."""
    from klpo.train.rewards.functions import numeric

    return {"d": numeric, "e": first_number}


REWARD_NAMES = {"d": "numeric", "e": "real_workload:first_number"}
"""Each workload's reward as klpo's ``rewards`` names it."""
