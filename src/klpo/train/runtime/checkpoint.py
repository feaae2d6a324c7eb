"""Checkpoints in safetensors + JSON, written atomically, that resume a run exactly.

Layout of ``RUN/checkpoints/step_000050/``::

    policy/            save_pretrained of the policy (config.json, model.safetensors)
    critic.safetensors the critic (backbone + value head), PPO only
    optim.safetensors  every optimizer's state tensors; the structure is in state.json
    rng.safetensors    every rank's torch generator states (CPU, and CUDA's where present)
    state.json         step, data position, controllers, optimizer structure, python/numpy RNG
    reference.safetensors  the moved reference (kl.reference_reset only): a whole model, or with
                       LoRA the merged base weights the adapters sit on (klpo.train.models.lora)
    versions.safetensors   the ring of the last policy versions (rollout.staleness only): each
                       version's trainable tensors, "<version>/<name>" (klpo.train.rollout.versions)

A checkpoint is built in a temporary directory beside its final place and renamed into it, and
``RUN/checkpoints/latest`` is replaced atomically afterwards, so a run killed at any moment leaves
either the new checkpoint or the previous one, never half of one.
"""

from __future__ import annotations

import errno
import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file, save_model

from klpo._io import atomic_dir, write_text_atomic

LATEST = "latest"
REFERENCE = "reference.safetensors"
VERSIONS = "versions.safetensors"


def _flatten_optimizer(opt: torch.optim.Optimizer, prefix: str) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, structure = {}, {"param_groups": sd["param_groups"], "state": {}}
    for idx, state in sd["state"].items():
        entry = {}
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                key = f"{prefix}.{idx}.{name}"
                tensors[key] = value.detach().contiguous().cpu()
                entry[name] = {"tensor": key}
            else:
                entry[name] = {"value": value}
        structure["state"][str(idx)] = entry
    return tensors, structure


def _unflatten_optimizer(structure: dict, tensors: dict[str, torch.Tensor]) -> dict:
    state = {}
    for idx, entry in structure["state"].items():
        state[int(idx)] = {
            name: tensors[v["tensor"]] if "tensor" in v else v["value"] for name, v in entry.items()
        }
    return {"state": state, "param_groups": structure["param_groups"]}


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    plain = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
    }
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(tensors) if k.startswith("cuda.")]
        if states:
            torch.cuda.set_rng_state_all(states)
    py = plain["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = plain["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), *n[2:]))


@dataclass(frozen=True)
class Weights:
    """The weights a checkpoint holds, each in its own file (the module's layout).

    Args:
        policy: a transformers model (``save_pretrained``).
        critic: PPO's critic module, or None.
        reference: the reference model when it moves during training (kl.reference_reset),
            saved as ``reference.safetensors``; with LoRA the base weights by name
            (:func:`klpo.train.models.lora.base_weights`); None when it is frozen.
        versions: the ring of policy versions (``rollout.staleness``), saved as
            ``versions.safetensors``, or None.
    """

    policy: Any
    critic: torch.nn.Module | None = None
    reference: torch.nn.Module | dict[str, torch.Tensor] | None = None
    versions: dict[str, torch.Tensor] | None = None


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    weights: Weights,
    *,
    optimizers: dict[str, torch.optim.Optimizer],
    rng: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] | None = None,
    state: dict[str, Any] | None = None,
    keep: int | None = 2,
) -> Path:
    """Write the checkpoint of ``step`` atomically and point ``latest`` at it.

    Args:
        run_dir: the run directory.
        step: the last completed step.
        weights: the policy's and the other models' (:class:`Weights`).
        optimizers: name → optimizer; every state tensor goes to ``optim.safetensors``.
        rng: every rank's :func:`rng_state`, in rank order (default: this process's).
        state: JSON-serialisable extras (data position, controller state, ...).
        keep: how many checkpoints to keep (``run.save_total_limit``; None: all): after the new
            one is in place, :func:`prune_checkpoints`.

    Returns:
        the checkpoint's directory.
    """
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    try:
        # built in root/.tmp-step_<step>-<pid>, fsynced, renamed into place (klpo._io.atomic_dir)
        with atomic_dir(final) as tmp:
            _write_models(tmp, weights)
            _write_state(tmp, step, optimizers, rng, state)
    except (OSError, SafetensorError) as err:  # atomic_dir removed the partial files
        rng = rng or [rng_state()]
        meta = {"optimizers": [_flatten_optimizer(o, n)[1] for n, o in optimizers.items()]}
        meta |= {"rng": [plain for _, plain in rng], **(state or {})}  # state.json, roughly
        w = weights
        needed = _nbytes([w.policy, w.critic, w.reference, w.versions, rng, *optimizers.values()])
        needed += len(json.dumps(meta))
        raise CheckpointError(_save_failure(run_dir, step, err, needed)) from None
    write_text_atomic(root / LATEST, final.name + "\n")
    if keep is not None:
        prune_checkpoints(run_dir, step, keep)
    return final


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("step_"))
    except ValueError:
        return None


def prune_checkpoints(run_dir: str | Path, step: int, keep: int) -> list[Path]:
    """Delete complete checkpoints older than ``step`` beyond the newest ``keep`` (the one of
    ``step`` counts); returns them.

    Only checkpoints before ``step`` are candidates, and only complete ones
    (:func:`checkpoint_problem`): the checkpoint just written, which a resume starts from, is
    never deleted, nor a later one left by an earlier attempt of the run, nor an incomplete one
    (``klpo export`` may still read its policy). klpo tracks no "best" checkpoint: each
    evaluation's held-out accuracy is in ``metrics.jsonl``; to keep every evaluated policy set
    ``run.save_every`` to ``run.eval_every`` and ``run.save_total_limit`` to null.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest checkpoint), got {keep}")
    root = Path(run_dir) / "checkpoints"
    steps = {p: _step_of(p) for p in root.glob("step_*") if p.is_dir()}
    older = sorted((p for p, n in steps.items() if n is not None and n < step), key=steps.get)
    complete = [p for p in older if checkpoint_problem(p) is None]
    gone = complete[: max(0, len(complete) - (keep - 1))]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def _write_models(tmp: Path, w: Weights) -> None:
    """The checkpoint's weights: the policy, the ring of versions, the critic, a moved reference."""
    w.policy.save_pretrained(tmp / "policy", safe_serialization=True)
    if w.versions is not None:
        save_file({k: v.contiguous() for k, v in w.versions.items()}, str(tmp / VERSIONS))
    if w.critic is not None:
        save_model(w.critic, str(tmp / "critic.safetensors"))
    if isinstance(w.reference, dict):  # LoRA's merged base (kl.reference_reset)
        save_file(w.reference, str(tmp / REFERENCE))
    elif w.reference is not None:  # kl.reference_reset moved it: the run resumes with it
        save_model(w.reference, str(tmp / REFERENCE))


def _write_state(
    tmp: Path,
    step: int,
    optimizers: dict[str, torch.optim.Optimizer],
    rng: list[tuple[dict[str, torch.Tensor], dict[str, Any]]] | None,
    state: dict[str, Any] | None,
) -> None:
    """The checkpoint's state: the optimizers, every rank's generators, ``state.json``."""
    optim_tensors, optim_structure = {}, {}
    for name, opt in optimizers.items():
        t, s = _flatten_optimizer(opt, name)
        optim_tensors.update(t)
        optim_structure[name] = s
    if optim_tensors:
        save_file(optim_tensors, str(tmp / "optim.safetensors"))
    rng = rng if rng is not None else [rng_state()]
    rng_tensors = {f"rank{r}.{k}": v for r, (t, _) in enumerate(rng) for k, v in t.items()}
    rng_plain = [plain for _, plain in rng]
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    meta = {"step": step, "optimizers": optim_structure, "rng": rng_plain, **(state or {})}
    write_text_atomic(tmp / "state.json", json.dumps(meta))


class CheckpointError(OSError):
    """A checkpoint could not be written; the message says what is intact and how to go on."""


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` says the disk (or the quota) is full: an OSError's errno, or the text of
    safetensors' own error, which carries the OS error only in its message."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return f"(os error {errno.ENOSPC})" in str(err) or "No space left on device" in str(err)


def full_disk_message(doing: str, out: str | Path, err: BaseException) -> str:
    """The one message for a full disk met while ``doing`` (``klpo make-reward-model``) writes
    into ``out``: the file, the space free there, that nothing half-written is left (every klpo
    write is atomic, :mod:`klpo._io`), and how to go on. The CLI's ``full_disk_said`` and the
    GGUF cache say it alike."""
    import shutil

    probe = Path(out)
    while not probe.is_dir() and probe.parent != probe:
        probe = probe.parent
    try:
        free = f"{format_size(shutil.disk_usage(probe).free)} free there"
    except OSError:
        free = "its free space unknown"
    name = f" {err.filename}" if getattr(err, "filename", None) else ""
    return (
        f"{doing} could not write{name} into {out}: No space left on device ({free}). klpo "
        "writes each file whole or not at all (and a model directory whole), so every file "
        "there is its old or its new self and nothing half-written is left; free space and run "
        "the command again"
    )


def _nbytes(parts: list[Any]) -> int:
    """Bytes of the tensors a checkpoint writes of ``parts``: modules (their state), staged
    shards (their files), optimizers (their state tensors), dicts and lists of tensors."""
    total = 0
    for part in parts:
        if part is None:
            continue
        if isinstance(part, torch.optim.Optimizer):
            part = [v for st in part.state.values() for v in st.values()]
        elif hasattr(part, "peft_config"):  # LoRA: save_pretrained writes the adapters only
            part = [p for p in part.parameters() if p.requires_grad]
        elif isinstance(part, torch.nn.Module):
            part = part.state_dict()
        elif isinstance(getattr(part, "staged", None), Path):  # FSDP's shards, already written
            continue
        items = part.values() if isinstance(part, dict) else part
        for v in items:
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
            elif isinstance(v, dict | list | tuple):
                total += _nbytes([v])
    return total


def format_size(n: float) -> str:
    """A byte count in words: ``93.4 kB``."""
    return _size(n)


def _size(n: float) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # pragma: no cover


def _save_failure(run_dir: str | Path, step: int, err: BaseException, needed: int) -> str:
    """What a failed save says: why, what is intact (the last complete checkpoint, found as a
    resume would find it), and how to go on; on a full disk how much the checkpoint needs."""
    root = Path(run_dir) / "checkpoints"
    previous = find_checkpoint(run_dir)[0]
    kept = (
        f"the previous checkpoint {previous.name} is intact"
        if previous is not None
        else "no earlier checkpoint exists"
    )
    full = disk_full(err)
    why = "No space left on device" if full else getattr(err, "strerror", None) or str(err)
    text = (
        f"could not write the checkpoint of step {step} in {root}: {why.splitlines()[0]}; "
        f"{kept} and the partial files were removed."
    )
    if full:
        free = shutil.disk_usage(root if root.is_dir() else Path(run_dir)).free
        text += (
            f" The disk is full: the checkpoint needs about {_size(needed)} and "
            f"{_size(free)} are free there (the last complete checkpoint stays until a new one "
            f"is in place). Free space and continue with klpo train --resume {Path(run_dir)}."
        )
    else:
        text += f" Fix the cause and continue with klpo train --resume {Path(run_dir)}."
    return text


def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete safetensors file, or None if it is.

    The format is an 8-byte little-endian header length N, N bytes of JSON giving each tensor's
    ``data_offsets``, then the data: a complete file is exactly 8 + N + the largest end offset
    bytes long. Reads the header only, so it is cheap on any model size.
    """
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} is truncated ({size} bytes, header says more)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as err:
        return f"{path.name} cannot be read ({err})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        return f"{path.name} is truncated ({size} of {8 + n + end} bytes)"
    return None


def model_dir_problem(path: Path) -> str | None:
    """Why the ``save_pretrained`` directory ``path`` cannot be a model, or None if it can."""
    if not (path / "config.json").is_file():
        return f"{path.name}/config.json is missing"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as err:
            return f"{index.name} cannot be read ({err})"
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return f"{path.name} holds no model.safetensors"
    for shard in shards:
        problem = safetensors_problem(path / shard)
        if problem:
            return f"{path.name}/{problem}"
    return None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from (a missing or truncated file), or None if it can."""
    try:
        meta = json.loads((ckpt / "state.json").read_text())
        meta["step"], meta["rng"], meta["optimizers"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"state.json is missing or unreadable ({type(err).__name__})"
    policy = ckpt / "policy"
    if (
        policy / "adapter_config.json"
    ).is_file():  # LoRA: the adapters only (klpo.train.models.lora)
        problem = safetensors_problem(policy / "adapter_model.safetensors")
    elif (policy / ".metadata").is_file():  # FSDP shards (torch.distributed.checkpoint)
        problem = None
    else:
        problem = model_dir_problem(policy)
    if problem:
        return f"policy/{problem}" if not problem.startswith("policy/") else problem
    has_tensors = any(
        "tensor" in v
        for o in meta["optimizers"].values()
        for e in o["state"].values()
        for v in e.values()
    )
    names = ["rng.safetensors"] + (["optim.safetensors"] if has_tensors else [])
    names += [n for n in ("critic.safetensors", REFERENCE, VERSIONS) if (ckpt / n).exists()]
    for name in names:
        problem = safetensors_problem(ckpt / name)
        if problem:
            return problem
    return None


def find_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The newest complete checkpoint of a run, and a line for each newer one that is not.

    ``latest`` is only a hint: a checkpoint whose files are missing or truncated (a disk that
    filled up, a copy cut short) is skipped for the one before it, and a removed or stale
    ``latest`` does not hide the checkpoints that are there.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None, []
    notes = []
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True)
    for path in steps:
        problem = checkpoint_problem(path)
        if problem is None:
            return path, notes
        notes.append(f"checkpoint {path} is incomplete ({problem}); skipped")
    return None, notes


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run (see :func:`find_checkpoint`), or None."""
    return find_checkpoint(run_dir)[0]


def remove_orphans(run_dir: str | Path) -> list[Path]:
    """Delete the temporary directories of saves that never finished; returns them."""
    root = Path(run_dir) / "checkpoints"
    gone = sorted([*root.glob(".tmp-step_*"), *root.glob(".old-step_*")]) if root.is_dir() else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def load_state(ckpt: Path) -> dict[str, Any]:
    """state.json of a checkpoint, with the RNG restored as a side effect left to the caller."""
    return json.loads((ckpt / "state.json").read_text())


def restore_optimizers(
    ckpt: Path, optimizers: dict[str, torch.optim.Optimizer], meta: dict[str, Any]
) -> None:
    """Load every optimizer's state saved by :func:`save_checkpoint`."""
    path = ckpt / "optim.safetensors"
    tensors = load_file(str(path)) if path.exists() else {}
    for name, opt in optimizers.items():
        structure = meta["optimizers"].get(name)
        if structure is None:
            raise KeyError(f"checkpoint {ckpt} has no state for optimizer {name!r}")
        opt.load_state_dict(_unflatten_optimizer(structure, tensors))


def restore_rng(ckpt: Path, meta: dict[str, Any], rank: int = 0) -> None:
    """Restore this rank's generators; the world size must be the one that saved them."""
    if rank >= len(meta["rng"]):
        raise ValueError(
            f"checkpoint {ckpt} was written by {len(meta['rng'])} process(es); resume it with "
            "the same number of processes"
        )
    tensors = load_file(str(ckpt / "rng.safetensors"))
    prefix = f"rank{rank}."
    mine = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    set_rng_state(mine, meta["rng"][rank])


def restore_critic(ckpt: Path, critic: torch.nn.Module) -> None:
    from safetensors.torch import load_model

    load_model(critic, str(ckpt / "critic.safetensors"))


def _reference_path(ckpt: Path) -> Path:
    path = ckpt / REFERENCE
    if not path.is_file():
        raise FileNotFoundError(
            f"{ckpt} has no {REFERENCE}; it was saved by a run without "
            "kl.reference_reset, so it cannot be resumed with it"
        )
    return path


def restore_reference(ckpt: Path, reference: torch.nn.Module) -> None:
    """Load a moved reference (``reference.safetensors``) saved by :func:`save_checkpoint`."""
    from safetensors.torch import load_model

    load_model(reference, str(_reference_path(ckpt)))


def reference_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``reference.safetensors`` by name (LoRA: the merged base weights)."""
    return load_file(str(_reference_path(ckpt)))


def version_tensors(ckpt: Path) -> dict[str, torch.Tensor] | None:
    """The ring of policy versions a checkpoint holds (``versions.safetensors``), or None."""
    path = ckpt / VERSIONS
    return load_file(str(path)) if path.is_file() else None
