r"""The three GEMMs of the fused head (:func:`klpo.logprobs.fused`), each on the CPU backend that is fastest here.

A tile of ``vc`` vocabulary entries by ``n`` tokens, with hidden states ``h [n, H]``, the head's
rows ``w [vc, H]`` and the tile's gradient ``g_t [vc, n]`` (transposed, like the tile), needs three
products:

    logits       x_t    = w @ h.T + bias         [vc, n]   (bias [n]: per token, in the epilogue)
    grad_hidden  dh    += g_t.T @ w              [n, H]
    grad_weight  dw   (+)= g_t @ h               [vc, H]

On CPU each can go to oneDNN (``torch.ops.mkldnn._linear_pointwise``, which reorders its weight
operand into a blocked layout on every call) or to torch.mm / addmm (MKL or OpenBLAS, which reads the
transposed operands in place and accumulates into the output). Which is faster depends on the
machine: on an AVX-512 AMD EPYC oneDNN's float32 GEMM ran at ~2.5x MKL's, while with both capped at
AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``) MKL was as fast or faster, and the
transposed operands of the two gradient GEMMs cost oneDNN a copy each (see docs/performance.md). So
the backend of each role is **measured**, once per machine: :func:`plan` times both backends on one
float32 tile of the default size (``TILE_TOKENS x TILE_VOCAB x H``), interleaved, keeps the fastest
of :data:`ROUNDS` runs of each, and caches the choice in ``<user cache dir>/klpo/gemm_plan.json``
(``$XDG_CACHE_HOME/klpo``, else ``~/.cache/klpo``), keyed by the CPU model and vector flags, torch's
version, its CPU capability, the oneDNN/MKL ISA caps in the environment, the thread count, ``H``
and the inputs' dtype. A missing, unreadable or corrupt cache file is measured again and rewritten
(atomically); an unwritable cache directory keeps the plan in memory for the process.

For bf16 inputs one more choice is measured: whether the weight gradient's GEMM takes ``G`` rounded
to bf16 (oneDNN's bf16 GEMM, float32 accumulation, one rounding: fast with native bf16 instructions,
emulated and slow without them) or stays in float32.

Measuring costs about a second (once per machine), so it is skipped for calls too small to gain from it
(:data:`MIN_FLOPS`); those keep the static default (oneDNN where torch has it). ``KLPO_GEMM=onednn``
or ``KLPO_GEMM=mm`` in the environment forces every role to one backend (no measurement).
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MIN_FLOPS",
    "ONEDNN",
    "ROUNDS",
    "Backend",
    "Plan",
    "cache_path",
    "cpu_fingerprint",
    "default_plan",
    "forget_plans",
    "grad_hidden",
    "grad_weight",
    "grad_weight_new",
    "logits",
    "machine_key",
    "plan",
    "read_cache",
]

Backend = Literal["onednn", "mm"]
BACKENDS: tuple[str, ...] = ("onednn", "mm")
ROLES = ("logits", "grad_hidden", "grad_weight")

# The measured tile (float32), the default tile of klpo.logprobs for 1024 or more tokens.
TILE_TOKENS = 1024
TILE_VOCAB = 1024
# Timed runs of each candidate; the fastest is kept (the minimum is the least noisy estimate of a
# GEMM's cost on a shared machine).
ROUNDS = 5
# A fused call with fewer GEMM flops than this (2 n V H, one pass) keeps the default plan.
MIN_FLOPS = 1e9
_CACHE_VERSION = 1

ONEDNN: bool = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)
"""Whether torch has oneDNN's linear here; without it every product goes to torch.mm / addmm."""


class Plan(NamedTuple):
    """The backend of each GEMM role, and whether a bf16 head takes the bf16 weight-gradient GEMM."""

    logits: Backend
    grad_hidden: Backend
    grad_weight: Backend
    bf16_grad_weight: bool


# --------------------------------------------------------------------------------------------
# The GEMMs.


def _onednn_can(t: Tensor) -> bool:
    """oneDNN's linear takes CPU float32 / bf16 / fp16; anything else goes to torch.mm."""
    return (
        ONEDNN
        and t.device.type == "cpu"
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )


def logits(a: Tensor, b: Tensor, bias: Tensor | None, backend: Backend) -> Tensor:
    """``a @ b.T + bias``: ``[M, K] x [N, K] -> [M, N]``, the bias ``[N]`` broadcast over rows."""
    if backend == "onednn" and _onednn_can(a):
        return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")
    if bias is None:
        return a @ b.t()
    return torch.addmm(bias, a, b.t())


def grad_hidden(out: Tensor, g_t: Tensor, w: Tensor, backend: Backend) -> None:
    """``out += g_t.T @ w``: ``[n, vc] x [vc, H]`` added into ``out [n, H]``; ``g_t`` is the tile's
    gradient transposed, ``[vc, n]``."""
    if backend == "onednn" and _onednn_can(g_t):
        out += torch.ops.mkldnn._linear_pointwise(g_t.t(), w.t(), None, "none", [], "")
    else:
        out.addmm_(g_t.t(), w)


def grad_weight(out: Tensor, g_t: Tensor, h: Tensor, backend: Backend, accumulate: bool) -> None:
    """``out = g_t @ h`` (``out += g_t @ h`` if ``accumulate``): ``[vc, n] x [n, H]`` into
    ``out [vc, H]``, cast to ``out``'s dtype; ``g_t`` is the tile's gradient transposed."""
    if backend == "onednn" and _onednn_can(g_t):
        r = torch.ops.mkldnn._linear_pointwise(g_t, h.t(), None, "none", [], "")
        if accumulate:
            out += r
        else:
            out.copy_(r)
    elif out.dtype != g_t.dtype:
        r = g_t @ h
        if accumulate:
            out += r
        else:
            out.copy_(r)
    elif accumulate:
        out.addmm_(g_t, h)
    else:
        torch.mm(g_t, h, out=out)


def grad_weight_new(g_t: Tensor, h: Tensor, backend: Backend) -> Tensor:
    """``g_t @ h`` as a new tensor: ``[vc, n] x [n, H] -> [vc, H]`` (no output to copy into)."""
    if backend == "onednn" and _onednn_can(g_t):
        return torch.ops.mkldnn._linear_pointwise(g_t, h.t(), None, "none", [], "")
    return g_t @ h


# --------------------------------------------------------------------------------------------
# The plan: measured once per machine, cached.


def default_plan(dtype: torch.dtype, device: torch.device | str = "cpu") -> Plan:
    """The plan without measuring: oneDNN for float32 on CPU where torch has it, else torch.mm;
    the bf16 weight-gradient GEMM where oneDNN reports bf16 support."""
    dev = torch.device(device).type
    onednn = ONEDNN and dev == "cpu" and dtype != torch.float64
    b: Backend = "onednn" if onednn else "mm"
    bf16 = onednn and dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return Plan(b, b, b, bool(bf16))


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/klpo/gemm_plan.json``, else ``~/.cache/klpo/gemm_plan.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "klpo" / "gemm_plan.json"


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its instruction-set flags (``/proc/cpuinfo``; the platform's
    processor name and no flags where there is none)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, flags


BF16_UNITS = ("avx512_bf16", "amx_bf16")
"""The x86 flags of a CPU that multiplies bf16 natively; without one oneDNN emulates bf16 matmuls
through float32 conversions, several times slower than float32's."""


def cpu_has_bf16_units() -> bool | None:
    """Whether the CPU multiplies bf16 natively (:data:`BF16_UNITS`); None where its flags
    cannot be read (not Linux, or not x86: an ARM CPU's bf16 is another flag, ``bf16``)."""
    _, flags = cpu_model_and_flags()
    if not flags:
        return None
    if "bf16" in flags:  # aarch64's BF16 extension
        return True
    return any(f in flags for f in BF16_UNITS) if "avx2" in flags or "sse2" in flags else None


def cpu_fingerprint() -> str:
    """The CPU model and the vector-instruction flags that decide GEMM speed, ``"model [flags]"``
    (part of :func:`machine_key`)."""
    model, flags = cpu_model_and_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "avx_vnni")
    return model + " [" + " ".join(f for f in wanted if f in flags) + "]"


def machine_key(hidden_size: int, dtype: torch.dtype) -> str:
    """What a cached plan is valid for: CPU, torch, ISA caps, threads, ``H`` and dtype."""
    env = ",".join(
        f"{k}={os.environ.get(k, '')}"
        for k in (
            "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA",
            "DNNL_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS",
        )
    )
    return (
        f"{cpu_fingerprint()} | torch {torch.__version__} "
        f"{torch.backends.cpu.get_cpu_capability()} | {env} | threads={torch.get_num_threads()} | "
        f"H={hidden_size} | {str(dtype).removeprefix('torch.')}"
    )


def read_cache(path: Path) -> dict[str, Plan]:
    """The valid plans in the cache file; {} if it is missing, unreadable or not klpo's format."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
        return {}
    plans = {}
    for key, entry in (
        (data.get("plans") or {}).items() if isinstance(data.get("plans"), dict) else ()
    ):
        if not isinstance(entry, dict):
            continue
        roles = [entry.get(r) for r in ROLES]
        bf16 = entry.get("bf16_grad_weight")
        if all(r in BACKENDS for r in roles) and isinstance(bf16, bool):
            plans[key] = Plan(*roles, bf16)
    return plans


def _write_cache(path: Path, plans: dict[str, Plan], seconds: dict[str, dict]) -> bool:
    """Write ``plans`` atomically; False (and nothing written) if the directory is not writable."""
    entries = {k: {**p._asdict(), "seconds": seconds.get(k, {})} for k, p in plans.items()}
    text = json.dumps({"version": _CACHE_VERSION, "plans": entries}, indent=1, sort_keys=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gemm_plan.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True


def _fastest(candidates: dict[str, Callable[[], object]], rounds: int) -> tuple[str, dict]:
    """The candidate with the smallest minimum time over ``rounds`` interleaved runs (after one
    warm-up run of each), and each candidate's minimum in seconds."""
    for fn in candidates.values():
        fn()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=best.get), best


def measure(hidden_size: int, dtype: torch.dtype, rounds: int = ROUNDS) -> tuple[Plan, dict]:
    """Time each role's backends on one float32 tile ``[TILE_TOKENS, TILE_VOCAB, hidden_size]`` (and
    the bf16 weight gradient for bf16), and return the fastest plan and the times (seconds)."""
    gen = torch.Generator().manual_seed(0)
    n, vc, hs = TILE_TOKENS, TILE_VOCAB, hidden_size
    h = torch.randn(n, hs, generator=gen)
    w = torch.randn(vc, hs, generator=gen) * hs**-0.5
    bias = torch.randn(n, generator=gen)
    g = torch.randn(vc, n, generator=gen) / vc
    dh = torch.zeros(n, hs)
    dw = torch.empty(vc, hs, dtype=dtype if dtype == torch.bfloat16 else torch.float32)
    backends = BACKENDS if ONEDNN else ("mm",)
    chosen, seconds = {}, {}
    roles = {
        "logits": lambda b: lambda: logits(w, h, bias, b),
        "grad_hidden": lambda b: lambda: grad_hidden(dh, g, w, b),
        "grad_weight": lambda b: lambda: grad_weight(dw, g, h, b, False),
    }
    for role, make in roles.items():
        chosen[role], seconds[role] = _fastest({b: make(b) for b in backends}, rounds)
    bf16 = False
    if dtype == torch.bfloat16 and default_plan(dtype).bf16_grad_weight:
        h_low, g_low = h.to(dtype), g.to(dtype)
        cands = {
            "bf16": lambda: grad_weight(dw, g_low, h_low, "onednn", False),
            "float32": lambda: grad_weight(dw, g, h, chosen["grad_weight"], False),
        }
        pick, seconds["bf16_grad_weight"] = _fastest(cands, rounds)
        bf16 = pick == "bf16"
    return Plan(chosen["logits"], chosen["grad_hidden"], chosen["grad_weight"], bf16), seconds


_MEMO: dict[str, Plan] = {}


def forget_plans() -> None:
    """Forget the plans :func:`plan` holds in this process: the next call reads the cache file
    (or measures), as a new process does."""
    _MEMO.clear()


def plan(hidden_size: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> Plan:
    """The GEMM plan for a head of width ``hidden_size`` with inputs of ``dtype`` on ``device``.

    Off CPU, for float64, or without oneDNN: torch.mm everywhere. ``KLPO_GEMM=onednn|mm`` forces a
    backend. Otherwise the plan of this machine from memory, else from the cache file, else
    measured (:func:`measure`) and written to the cache file.

    Raises:
        ValueError: ``KLPO_GEMM`` set to something other than ``onednn``, ``mm`` or empty.
    """
    forced = os.environ.get("KLPO_GEMM", "")
    if forced not in ("", *BACKENDS):
        raise ValueError(
            f"KLPO_GEMM={forced!r} is not a GEMM backend; set it to 'onednn' or 'mm' to force one, "
            f"or unset it to let klpo measure which is faster on this machine"
        )
    base = default_plan(dtype, device)
    if torch.device(device).type != "cpu" or dtype == torch.float64 or not ONEDNN:
        return base
    if forced:
        bf16 = base.bf16_grad_weight and forced == "onednn"
        return Plan(forced, forced, forced, bf16)  # type: ignore[arg-type]
    key = machine_key(hidden_size, dtype)
    if key in _MEMO:
        return _MEMO[key]
    path = cache_path()
    cached = read_cache(path)
    if key not in cached:
        found, secs = measure(hidden_size, dtype)
        cached[key] = found
        old = _read_seconds(path)
        old[key] = secs
        _write_cache(path, cached, old)
    _MEMO[key] = cached[key]
    return cached[key]


def _read_seconds(path: Path) -> dict[str, dict]:
    """The measured times stored beside the valid plans (for the record)."""
    try:
        data = json.loads(path.read_text())
        return {k: v.get("seconds", {}) for k, v in data["plans"].items() if isinstance(v, dict)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
