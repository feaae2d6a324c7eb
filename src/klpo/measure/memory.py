"""What the measurement will hold in memory, estimated before any model loads."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from klpo.measure.objectives import objective_names
from klpo.measure.sketch import Subset


def weights_bytes(path: str) -> int | None:
    """Bytes of a model directory's weights once loaded in float32 (from the safetensors
    headers; None where there are none)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors")) if Path(path).is_dir() else []
    if not files:
        return None
    numel = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                numel += math.prod(st.get_slice(key).get_shape())
    return 4 * numel


def available_bytes() -> int | None:
    """Memory available to a new allocation (``MemAvailable``), or None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return None


def resident_bytes() -> int | None:
    """This process's resident memory now (``/proc/self/statm``), or None where unknown."""
    import os

    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


OVERHEAD = 128 * 2**20
"""Bytes the measurement holds beyond its estimated parts: the prompts' key/value caches, the
per-token arrays, Python's objects and the allocator's slack (measured on SmolLM2-135M's pair:
the process grew 0.035 GB beyond the parts at 3 prompts × 3 completions of 8 tokens)."""


def page_in(*models: Any) -> None:
    """Read every parameter and buffer of ``models`` once, so that their bytes are resident.

    transformers maps a float32 safetensors file into memory and reads it lazily: after the
    load, the weights are not yet in the process's resident memory, and the first forward pass
    brings them in. An estimate that adds to the resident memory must come after this (it was
    1.1 GB under the measured peak of SmolLM2-135M's pair: the two models' weights, read only
    once the sampling started)."""
    import torch

    with torch.no_grad():
        for m in models:
            for t in (*m.parameters(), *m.buffers()):
                if t.numel():
                    t.detach().sum()


def peak_rss() -> int | None:
    """This process's peak resident memory so far: ``VmHWM`` of ``/proc/self/status`` (the high
    water mark of this program's own memory), else ``ru_maxrss``; None where neither is known.

    Not ``ru_maxrss`` first: on Linux it carries the parent's resident memory into a child
    started by vfork and exec, as Python's ``subprocess`` starts one (a doctor run from a
    process holding 2.2 GB reported a peak of 2.2 GB whatever it used)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_estimate(
    config: Any,
    *,
    weights: int,
    rows: int,
    group_rows: int,
    prompt_tokens: int,
    new_tokens: int,
    subset: Subset,
    depth: int,
    dim: int,
    groups: int,
) -> dict[str, int]:
    """Bytes, by part, that the measurement holds at its peak beyond the process itself.

    ``weights``: both models; ``sampling``: the key/value cache of ``rows`` sequences and the
    prompt's logits (float32, as the sampler's first forward returns them for every prompt
    position); ``pass``: one group's two ``[R, C, V]`` float64 logits with their softmax
    copies and gradients (eight of that size), the graph above the first measured layer (``depth`` decoder
    layers of hidden states, about 12 ``[R, T, H]`` and 4 ``[R, T, I]`` each) and the measured
    layers' inputs and outputs; ``store``: the (sketched) gradient of every objective for each
    group, and for each completion of the group in hand, float64.

    ``total``, an upper bound on what the process adds to the weights: the parts are summed,
    not maximised, since the allocator keeps what the sampling freed for the passes that follow
    (the process's resident memory does not fall back between them), and :data:`OVERHEAD` is
    added. On SmolLM2-135M's pair, against the peak resident memory measured (:func:`peak_rss`):
    1.69 GB estimated for 1.62 GB at 3 prompts × 3 completions of 8 tokens, and 2.33 GB
    for 2.18 GB at the defaults (8 × 8 of 16 tokens).
    """
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv = int(getattr(config, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    seq = prompt_tokens + new_tokens
    sampling = 4 * rows * seq * layers * 2 * kv * head_dim + 2 * 4 * rows * prompt_tokens * vocab
    logits = 8 * 8 * group_rows * new_tokens * vocab
    graph = 4 * group_rows * seq * depth * (12 * hidden + 4 * inter)
    io = 4 * group_rows * seq * sum(m.in_features + m.out_features for m in subset.modules)
    store = 8 * len(objective_names()) * dim * (groups + group_rows)
    return {
        "weights": weights,
        "sampling": sampling,
        "pass": logits + graph + io,
        "store": store,
        "total": weights + sampling + logits + graph + io + store + OVERHEAD,
    }


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GB"


# --------------------------------------------------------------------------------------------
# One group of completions through both models: its rows' sketched gradients.
