"""Completions in the run: ``samples.jsonl``, one JSON line per logged completion.

Every ``run.log_samples_every`` steps (and at the last), ``run.log_samples`` completions of
the step, spread over its prompts (the first of each prompt's group, then the second, ...; the
main process's share, in batch order; :func:`klpo.train.step.sample_records.spread_rows`) are written with
``split: "train"``; at each held-out evaluation, the greedy completions of the first
``run.log_samples`` held-out problems with ``split: "eval"``. A record holds::

    step, split, index          where it comes from (index: the row of the step's batch)
    prompt, completion, answer  the text the policy saw, what it wrote, the reference answer
    user                        chat data (data.chat): the prompt's last user message, which
                                report.md's prompt column shows (the rendered text begins with
                                the template's system prompt, the same on every row)
    reward                      the total (weighted) reward; null when no function scored it
    rewards                     each reward function's own value (null: it did not score it)
    kl                          the completion's sequence KL(pi_theta ‖ pi_ref), summed over its
                                tokens: "exact" (over the whole vocabulary at each position) and
                                each token estimator's sum on the sampled tokens (k1, k3, and the
                                configured one where it reads token log-probs)
    length, truncated           completion tokens (EOS included); no EOS within max_new_tokens

At an evaluation the tokens are greedy, not sampled, so there the estimators' sums are their
values on those tokens, not unbiased estimates; "exact" is exact either way. The same records go
to the trackers (a TensorBoard text panel, a W&B table, an MLflow artifact) and the latest of
each split to ``report.md``. A resumed run drops the records of steps after its checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from klpo._io import write_text_atomic

__all__ = [
    "SAMPLES_FILE",
    "last_user_message",
    "latest_samples",
    "read_samples",
    "samples_table",
    "trim_samples",
    "user_messages",
    "with_user_messages",
]

SAMPLES_FILE = "samples.jsonl"


def read_samples(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``samples.jsonl``; a torn last line (a run killed mid-write) is ignored."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def trim_samples(run_dir: str | Path, resume_step: int) -> None:
    """Keep only the records of steps up to ``resume_step`` (0: a fresh start, none)."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.exists():
        return
    if resume_step == 0:
        path.unlink()
        return
    keep = [r for r in read_samples(path) if r.get("step", 0) <= resume_step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


def append_samples(run_dir: str | Path, records: list[dict[str, Any]]) -> None:
    """Append records to the run's ``samples.jsonl``."""
    with (Path(run_dir) / SAMPLES_FILE).open("a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()


def latest_samples(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """``{split: the records of its latest step}``, train before eval."""
    last: dict[str, list[dict[str, Any]]] = {}
    for r in read_samples(Path(run_dir) / SAMPLES_FILE):
        split = r.get("split", "train")
        if split not in last or last[split][0]["step"] != r["step"]:
            last[split] = []
        last[split].append(r)
    return {s: last[s] for s in ("train", "eval") if s in last}


def last_user_message(messages: Sequence[tuple[str, str]]) -> str:
    """The content of the last ``user`` message of ``(role, content)`` pairs (of the last
    message where none is the user's)."""
    users = [content for role, content in messages if role == "user"]
    return users[-1] if users else messages[-1][1]


def user_messages(examples: Iterable[Any]) -> dict[str, str]:
    """``{rendered prompt: its last user message}`` of the examples rendered from chat messages
    (:class:`klpo.train.data.sources.Example` with ``messages``)."""
    return {e.prompt: last_user_message(e.messages) for e in examples if e.messages}


def with_user_messages(
    records: list[dict[str, Any]], users: Mapping[str, str]
) -> list[dict[str, Any]]:
    """The records, each whose prompt is in ``users`` (:func:`user_messages`) with its last user
    message as ``user``, after ``prompt``."""
    out = []
    for r in records:
        user = users.get(str(r.get("prompt")))
        if user is None:
            out.append(r)
            continue
        keys = list(r)
        at = keys.index("prompt") + 1
        out.append({k: r[k] for k in keys[:at]} | {"user": user} | {k: r[k] for k in keys[at:]})
    return out


def _cell(text: Any, limit: int = 160) -> str:
    """A Markdown table cell: one line, pipes escaped, cut at ``limit`` characters."""
    s = "" if text is None else str(text)
    s = s.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("`", "'")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _number(v: Any) -> str:
    return "—" if v is None else f"{v:.4g}"


def samples_table(records: list[dict[str, Any]]) -> str:
    """The records as a Markdown table: prompt, completion, answer, rewards, sequence KL. The
    prompt column shows a chat prompt's last user message (``user``), else the prompt's text;
    the answer column is left out where no record has one (data without ``data.answer_field``,
    whose reward functions read other columns)."""
    if not records:
        return ""
    names = list(dict.fromkeys(k for r in records for k in r.get("rewards", {})))
    kls = list(dict.fromkeys(k for r in records for k in r.get("kl", {})))
    chat = any("user" in r for r in records)
    answers = any(r.get("answer") not in (None, "") for r in records)
    prompt = "prompt (last user message)" if chat else "prompt"
    head = [prompt, "completion", *(["answer"] if answers else []), "reward", *names]
    head += [f"KL {k}" for k in kls]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in records:
        cells = [
            _cell(r.get("user", r.get("prompt")), 80),
            _cell(r.get("completion")),
            *([_cell(r.get("answer"), 40)] if answers else []),
            _number(r.get("reward")),
            *(_number(r.get("rewards", {}).get(n)) for n in names),
            *(_number(r.get("kl", {}).get(k)) for k in kls),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
