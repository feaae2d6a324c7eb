"""What ``make-reference`` and ``make-reward-model`` share: the training loop of a small model
and the directory it is saved into.

:func:`fit` takes ``steps`` optimizer steps on the loss a function gives for each step (the
function draws its own batch, so the random draws stay where the caller puts them) and reports
each step's loss; :func:`model_dir` saves the model and its tokenizer into a temporary sibling of
the output directory, where the caller measures what is stored and writes its metadata
(:func:`write_meta`), and puts it in place when the block ends (:func:`klpo._io.atomic_dir`,
replacing only what the command wrote there before: :func:`klpo.train.outdir.written_before`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from klpo._io import atomic_dir, write_text_atomic
from klpo.train.outdir import written_before

__all__ = ["fit", "model_dir", "write_meta"]


def fit(
    model: Any,
    opt: Any,
    steps: int,
    loss_at: Callable[[int], Any],
    on_step: Callable[[int, float], bool | None] | None = None,
    sched: Any = None,
) -> list[float]:
    """Train ``model`` in place: at each of ``steps`` steps the scalar loss ``loss_at(step)``,
    its gradient, an ``opt`` step (and a ``sched`` step where given); ``on_step(step, loss)``
    after each, and training stops where it returns True. The model is in train mode during
    the loop and in eval mode after it.

    Returns:
        The loss of every step taken.
    """
    model.train()
    losses: list[float] = []
    for step in range(steps):
        loss = loss_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
        if on_step is not None and on_step(step, losses[-1]):
            break
    model.eval()
    return losses


@contextmanager
def model_dir(out: Path, model: Any, tokenizer: Any, meta_name: str) -> Iterator[Path]:
    """``model`` and ``tokenizer`` (``save_pretrained``) in a temporary sibling of ``out``,
    yielded for the caller to measure and to write ``meta_name`` into (:func:`write_meta`); when
    the block succeeds it is readable as package data whatever the umask (the directory 0755,
    its files 0644) and replaces ``out``, keeping the user's other files there (those not
    listed in an earlier ``meta_name``)."""
    with atomic_dir(out, replaces=written_before(out / meta_name)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        yield tmp
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)


def write_meta(tmp: Path, meta_name: str, meta: dict[str, Any]) -> None:
    """``meta`` with the directory's ``files`` (``meta_name`` among them) as ``tmp/meta_name``
    (indented JSON, atomically)."""
    files = sorted([p.name for p in tmp.iterdir()] + [meta_name])
    write_text_atomic(tmp / meta_name, json.dumps({**meta, "files": files}, indent=2) + "\n")
