"""Time and peak memory of token log-probs and exact KL from hidden states + head, forward + backward.

One table per run: naive PyTorch (the full logits), klpo (:func:`klpo.logprobs.fused`, per-token
outputs with a backward for any upstream gradient), ``klpo loss`` (:func:`klpo.logprobs.fused_loss`:
the same weighted sum as one loss, its gradient taken in the forward pass), and the
peers where they import ("absent" otherwise) — Liger-Kernel's chunked selective log-prob
(``LigerFusedLinearPPOBase.chunk_forward``, the log-prob of ``liger_kernel.chunked_loss``'s GRPO
loss) and exact KL (``LigerFusedLinearJSDLoss`` with ``beta=1``), and TRL's
``trl.kernels.ChunkedLogProbFunction`` and ``trl.kernels.chunked_divergence.ChunkedDivergenceFunction``
(``beta=1``: KL(student ‖ teacher)). ``klpo (torch.mm)`` and ``klpo (oneDNN)`` force every GEMM to
one backend (first log-prob shape), to show what the measured plan of :mod:`klpo.gemm` buys.
``klpo softcap`` and ``klpo loss softcap`` run the same head with Gemma 2's soft cap
(``final_logit_softcapping = 30``, :class:`klpo.logprobs.LogitTransform`), whose cost the ratio
table after the main one gives against the plain head, from the same interleaved rounds;
``--baseline PATH`` adds ``klpo (baseline)`` and ``klpo loss (baseline)``, the same calls into
another ``logprobs.py`` (say, the previous commit's: ``git show HEAD~1:src/klpo/logprobs.py >
/tmp/base.py``), to show a change leaves the plain head's speed as it was. Since the kernels live in
files of their own (``fused_kernel.py``, ``fused_loss_kernel.py``) such a file imports them from
this checkout, so a baseline is a ``logprobs.py`` from before that split; for a later commit, run
this script from that commit's checkout. Two
floors, the GEMMs alone, tile by tile with klpo's tiles: "bare GEMMs", those any method needs (the
logits, and the reference's for KL; the gradients with respect to hidden and weight) in the inputs'
dtype on the faster backend; and "klpo's GEMMs", the GEMMs klpo runs (the same plus the recompute of
the logits in the backward pass) in float32 with its plan.

Timing: all methods of a case run in one process on the same inputs, each once to warm up, then
``--reps`` rounds (default 5) interleaved A B C A B C ..., so that a shared machine's load falls on
all of them alike; the table gives the median and [min, max]. Memory: each method once more in its
own process (so its peak RSS is its own): ``/proc/self/clear_refs`` resets the high-water mark
after the inputs exist, and ``peak`` is the high-water mark over that. ``err``: the largest |error|
of the log-probs (the KL for KL cases) against float64 on the first 64 tokens. Ratios are to naive
and to the fastest / leanest peer.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=2 PEERS_VENV/bin/python bench/logprobs.py [--quick]

(the peers from an environment that has ``trl`` and ``liger-kernel``, the latter installed with
``--no-deps``). To see a CPU without AVX-512 on one that has it:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``. ``--sweep`` times klpo alone over a grid of
tile sizes (and with the entropy on), the measurement behind ``klpo.logprobs.TOKEN_CHUNK`` and
``default_vocab_chunk``; ``--sweep-loss`` times ``klpo loss`` (``fused_loss``) over its token
chunks, with peak memory, the measurement behind ``LOSS_TILE_ELEMENTS``. ``--head gemma3`` takes
Gemma 3 270M's head instead of the default shapes (log-probs, N = 4096, H = 640, V = 262,144;
:data:`HEADS`) with naive, both klpo methods, the peers and the floors (:data:`HEAD_METHODS`;
``--methods`` overrides), ``--tokens N`` another token count (a smaller trial first), and
``--warmups 0`` skips the warm-up round, and ``--once`` calls each method once in its own
process, its time and peak from that call (no interleaving, no floors), where one call of a
method takes minutes. ``--sweep-tokens 256,512,...`` times naive, ``klpo`` and ``klpo loss`` (or
``--methods``; with ``floor``, both floors) at each token count on the default head (H = 896,
V = 151,936, float32, log-probs; ``--sweep-kinds logp,kl`` adds the KL), one group of interleaved
rounds per count (or ``--once``), with each method's ratio to naive from the same rounds in wall
and in CPU time (the process's, which a shared core's load inflates less) and its peak; naive is
skipped where ``MemAvailable`` is below 1.25x its three ``[N, V]`` tensors. ``klpo (recompute)``
and ``klpo (keep)`` are ``klpo`` with its saving for a log-prob-only backward pass off, and on at
any size (:func:`klpo.fused_kernel.saving`)::

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 PEERS_VENV/bin/python bench/logprobs.py \
        --head gemma3 --reps 1 --warmups 0
    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 PEERS_VENV/bin/python bench/logprobs.py \
        --head gemma3 --once
    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python bench/logprobs.py \
        --sweep-tokens 256,512,1024,2048 --methods "naive,klpo,klpo (recompute),klpo loss"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# A Qwen2.5-0.5B head (H = 896, V = 151936); the default run fits in 10 minutes on 2 idle cores.
FULL_SHAPES = [(512, 896, 151936)]
FULL_KL_SHAPES = [(256, 896, 151936)]
QUICK_SHAPES = [(256, 896, 32000)]
QUICK_KL_SHAPES = [(128, 896, 32000)]
# --head NAME: a real model's head, log-probs only, in place of the default shapes.
HEADS = {
    # Gemma 3 270M (H = 640, V = 262,144): one GRPO batch of 4096 completion tokens. Naive's
    # float32 logits are 4 GiB; with their log-softmax and its gradient alive in the backward
    # pass its peak is about 12 GiB (HEAD_METHODS leaves out the per-backend and soft-cap rows).
    "gemma3": [(4096, 640, 262144)],
}
HEAD_METHODS = ["naive", "klpo", "klpo loss", "liger", "trl", "floor"]
DTYPES = ["float32", "bfloat16"]
LOGP_METHODS = [
    "naive",
    "klpo",
    "klpo loss",
    "klpo softcap",
    "klpo loss softcap",
    "klpo (torch.mm)",
    "klpo (oneDNN)",
    "liger",
    "trl",
]
KL_METHODS = ["naive", "klpo", "klpo loss", "klpo softcap", "klpo loss softcap", "liger jsd", "trl"]
BASELINE_METHODS = ["klpo (baseline)", "klpo loss (baseline)"]
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping
# (numerator, denominator) of the ratio table: a transform's cost, and a change's.
RATIOS = [
    ("klpo softcap", "klpo"),
    ("klpo loss softcap", "klpo loss"),
    ("klpo", "klpo (baseline)"),
    ("klpo loss", "klpo loss (baseline)"),
]
ABLATIONS = {"klpo (torch.mm)": "mm", "klpo (oneDNN)": "onednn"}
PEERS = {"liger", "trl", "liger jsd"}
CHECK_TOKENS = 64


@dataclass
class Case:
    kind: str  # "logp", "kl" or "floor-logp" / "floor-kl"
    method: str
    n: int
    h: int
    v: int
    dtype: str
    token_chunk: int | None = None  # klpo's tile; None: its defaults
    vocab_chunk: int | None = None
    with_entropy: bool = False
    baseline: str | None = None  # another logprobs.py, for the "(baseline)" methods


# ---------------------------------------------------------------------------------------------
# The child: one case.


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _inputs(case: Case):
    import torch

    gen = torch.Generator().manual_seed(0)
    dt = getattr(torch, case.dtype)
    # Scales like a trained LM head: logits with a spread of a few nats.
    hidden = torch.randn(case.n, case.h, generator=gen).to(dt).requires_grad_(True)
    weight = (torch.randn(case.v, case.h, generator=gen) * case.h**-0.5 * 3).to(dt)
    weight.requires_grad_(True)
    tokens = torch.randint(0, case.v, (case.n,), generator=gen)
    coef = torch.randn(case.n, generator=gen)  # the upstream gradient of each token's output
    hidden_ref = weight_ref = None
    if case.kind in ("kl", "floor-kl"):
        hidden_ref = (
            hidden.detach().float() + 0.3 * torch.randn(case.n, case.h, generator=gen)
        ).to(dt)
        weight_ref = (
            weight.detach().float()
            + 0.3 * case.h**-0.5 * torch.randn(case.v, case.h, generator=gen)
        ).to(dt)
    return hidden, weight, tokens, coef, hidden_ref, weight_ref


def _method(case: Case, hidden, weight, tokens, coef, hidden_ref, weight_ref):
    """A closure running forward + backward, and a function giving the output to check."""
    import torch

    if case.method.startswith("klpo loss"):
        lp, extra = _klpo(case)

        def run_loss():  # the same weighted sum, its gradient taken in the forward pass
            out = lp.fused_loss(
                hidden,
                weight,
                tokens,
                hidden_ref=hidden_ref,
                weight_ref=weight_ref,
                logp_weight=coef if case.kind == "logp" else None,
                kl_weight=coef if case.kind == "kl" else None,
                token_chunk=case.token_chunk,
                **extra,
            )
            out.loss.backward()
            hidden.grad = weight.grad = None
            return out.logp if case.kind == "logp" else out.kl

        return run_loss, True

    if case.method.startswith("klpo"):
        from klpo import gemm

        lp, extra = _klpo(case)
        forced = ABLATIONS.get(case.method)
        if forced:  # this method only: every GEMM on one backend
            extra = {**extra, "plan": gemm.Plan(forced, forced, forced, forced == "onednn")}

        from klpo import fused_kernel

        # These methods only: no tiles kept, ever, or kept at any size (klpo.fused_kernel.saving).
        keep = {"klpo (recompute)": 0.0, "klpo (keep)": float(case.n)}.get(
            case.method, fused_kernel.KEEP_PER_WEIGHT
        )

        def forward():
            before = fused_kernel.KEEP_PER_WEIGHT, fused_kernel.KEEP_ALL_ON_CPU
            fused_kernel.KEEP_PER_WEIGHT = keep
            if case.method == "klpo (recompute)":
                fused_kernel.KEEP_ALL_ON_CPU = False
            try:  # the saving is chosen in the forward pass
                out = lp.fused(
                    hidden,
                    weight,
                    tokens,
                    hidden_ref=hidden_ref,
                    weight_ref=weight_ref,
                    with_entropy=case.with_entropy,
                    token_chunk=case.token_chunk or lp.TOKEN_CHUNK,
                    vocab_chunk=case.vocab_chunk,
                    **extra,
                )
            finally:
                fused_kernel.KEEP_PER_WEIGHT, fused_kernel.KEEP_ALL_ON_CPU = before
            return out.logp if case.kind == "logp" else out.kl

    elif case.method == "naive":

        def forward():
            logits = (hidden @ weight.t()).float()
            log_pi = torch.log_softmax(logits, dim=-1)
            if case.kind == "logp":
                return log_pi.gather(1, tokens[:, None])[:, 0]
            with torch.no_grad():
                log_pi_ref = torch.log_softmax((hidden_ref @ weight_ref.t()).float(), dim=-1)
            return (log_pi.exp() * (log_pi - log_pi_ref)).sum(-1)

    elif case.method == "liger":
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

        def forward():
            return LigerFusedLinearPPOBase.chunk_forward(hidden[None], weight, tokens[None])[0]

    elif case.method == "liger jsd":
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

        loss_fn = LigerFusedLinearJSDLoss(
            weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, compiled=False
        )

        def run():  # a scalar loss (the mean KL), so no per-token check
            loss_fn(hidden, weight, hidden_ref, weight_ref, tokens).backward()
            hidden.grad = weight.grad = None

        return run, False

    elif case.method == "trl" and case.kind == "logp":
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        def forward():
            return ChunkedLogProbFunction.apply(
                hidden, weight, None, tokens, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ()
            )[0]

    elif case.method == "trl":
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        def forward():
            return ChunkedDivergenceFunction.apply(
                hidden, weight, None, hidden_ref, weight_ref, None, 1.0, 1.0
            )[0]

    else:
        raise ValueError(f"unknown method {case.method!r}")

    def run():
        out = forward()
        (out * coef).sum().backward()
        hidden.grad = weight.grad = None
        return out.detach()

    return run, True


def _klpo(case: Case):
    """The ``klpo.logprobs`` module a klpo method runs (the baseline file for "(baseline)"), and
    its extra arguments (the soft cap, policy and reference, for "softcap")."""
    import importlib.util

    import klpo.logprobs as lp

    if "(baseline)" in case.method:
        if not case.baseline:
            raise ValueError(f"{case.method} needs --baseline PATH (another logprobs.py)")
        spec = importlib.util.spec_from_file_location("klpo_logprobs_baseline", case.baseline)
        lp = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(lp)
    extra = {}
    if "softcap" in case.method:
        cap = lp.LogitTransform.make(softcap=SOFTCAP)
        extra = {"transform": cap, "transform_ref": cap if case.kind == "kl" else None}
    return lp, extra


def _floors(case: Case, hidden, weight, hidden_ref, weight_ref) -> dict:
    """The two GEMM floors as closures, tile by tile with klpo's tiles ([vocab, tokens], as klpo).

    "floor: bare GEMMs": the GEMMs any method needs (logits, and the reference's for KL; grad
    hidden; grad weight) in the inputs' dtype on the faster of torch.mm and oneDNN (the faster is
    picked by timing both once, here). "floor: klpo's GEMMs": the GEMMs klpo runs (the same plus the
    recompute of every tile in the backward pass), float32, with klpo's plan for this machine.
    """
    import torch

    import klpo.logprobs as lp
    from klpo import gemm

    n, vocab = case.n, case.v
    tc = min(n, lp.TOKEN_CHUNK)
    vc = lp.default_vocab_chunk(tc)
    h32 = hidden.detach().float()
    plan = lp.head_plan(h32, weight.detach(), torch.float32)

    def gemms(dtype, roles, recompute):
        heads = [(hidden, weight)] + ([(hidden_ref, weight_ref)] if hidden_ref is not None else [])
        heads = [(h.detach().to(dtype), w.detach().to(dtype)) for h, w in heads]
        g = torch.randn(vc, tc).to(dtype)
        dh = torch.zeros(tc, case.h, dtype=dtype)
        dw = torch.empty(vc, case.h, dtype=dtype)

        def run():
            for v0 in range(0, vocab, vc):
                v1 = min(v0 + vc, vocab)
                for t_0 in range(0, n, tc):
                    t = slice(t_0, min(t_0 + tc, n))
                    k = t.stop - t.start
                    for _ in range(2 if recompute else 1):
                        for h, w in heads:
                            gemm.logits(w[v0:v1], h[t], None, roles.logits)
                    h, w = heads[0]
                    gemm.grad_hidden(dh[:k], g[: v1 - v0, :k], w[v0:v1], roles.grad_hidden)
                    gemm.grad_weight(
                        dw[: v1 - v0], g[: v1 - v0, :k], h[t], roles.grad_weight, False
                    )

        return run

    dtype = getattr(torch, case.dtype)
    bare = {
        b: gemms(dtype, gemm.Plan(b, b, b, False), False)
        for b in (["mm", "onednn"] if gemm.ONEDNN else ["mm"])
    }
    faster = min(bare, key=lambda b: _timed(bare[b])[0]) if len(bare) > 1 else "mm"
    return {
        "floor: bare GEMMs": bare[faster],
        "floor: klpo's GEMMs": gemms(torch.float32, plan, True),
    }


def _reference(case: Case, hidden, weight, tokens, hidden_ref, weight_ref):
    import torch

    def cap(z):
        return SOFTCAP * torch.tanh(z / SOFTCAP) if "softcap" in case.method else z

    k = min(CHECK_TOKENS, case.n)
    z = hidden[:k].detach().double() @ weight.detach().double().t()
    log_pi = torch.log_softmax(cap(z), -1)
    if case.kind == "logp":
        return log_pi.gather(1, tokens[:k, None])[:, 0]
    log_pi_ref = torch.log_softmax(cap(hidden_ref[:k].double() @ weight_ref.double().t()), -1)
    return (log_pi.exp() * (log_pi - log_pi_ref)).sum(-1)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _peak(case: Case) -> dict:
    """One run of ``case`` in this process: its peak RSS over the inputs' and its error."""
    import torch

    hidden, weight, tokens, coef, hidden_ref, weight_ref = _inputs(case)
    _reset_peak()
    base = _rss_kib("VmRSS")
    run, has_output = _method(case, hidden, weight, tokens, coef, hidden_ref, weight_ref)
    cpu = time.process_time()
    seconds, out = _timed(run)
    cpu = time.process_time() - cpu
    hwm = _rss_kib("VmHWM")
    peak = hwm - base
    err = None
    if has_output:
        with torch.no_grad():
            k = min(CHECK_TOKENS, case.n)
            ref = _reference(case, hidden, weight, tokens, hidden_ref, weight_ref)
            err = float((out[:k].double() - ref).abs().max())
    return {
        "peak_mib": peak / 1024,
        "rss_mib": hwm / 1024,
        "err": err,
        "once_s": seconds,
        "once_cpu_s": cpu,
    }


def _times(case: Case, methods: list[str], reps: int, warmups: int = 1) -> dict:
    """Seconds of each method (and the floors) on the same inputs: ``warmups`` untimed rounds
    (one), then ``reps`` interleaved rounds. ImportError (a peer not installed): "absent"."""
    import dataclasses

    hidden, weight, tokens, coef, hidden_ref, weight_ref = _inputs(case)
    runs, out = {}, {}
    for m in methods:
        if m == "floor":
            runs.update(_floors(case, hidden, weight, hidden_ref, weight_ref))
            continue
        try:
            c = dataclasses.replace(case, method=m)
            runs[m] = _method(c, hidden, weight, tokens, coef, hidden_ref, weight_ref)[0]
        except ImportError:
            out[m] = {"error": "absent"}
    for _ in range(warmups):
        for run in runs.values():
            run()
    secs = {m: [] for m in runs}
    cpu = {m: [] for m in runs}
    for _ in range(reps):
        for m, run in runs.items():
            c0 = time.process_time()
            secs[m].append(_timed(run)[0])
            cpu[m].append(time.process_time() - c0)
    for m, ts in secs.items():
        rounds = list(ts)  # in round order, for the paired ratios
        ts.sort()
        out[m] = {
            "time": ts[len(ts) // 2],
            "min": ts[0],
            "max": ts[-1],
            "reps": len(ts),
            "rounds": rounds,
            "cpu_rounds": cpu[m],  # this process's CPU seconds, the same rounds
        }
    return out


def child(request: dict) -> dict:
    case = Case(**request["case"])
    if request["what"] == "peak":
        return _peak(case)
    return _times(case, request["methods"], request["reps"], request.get("warmups", 1))


# ---------------------------------------------------------------------------------------------
# The parent: the timing process and one process per method for memory, then one table.


def run_child(request: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(request)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail[:120]}
    return json.loads(lines[-1])


def measure_group(
    case: Case,
    methods: list[str],
    reps: int,
    timeout: float,
    warmups: int = 1,
    once: bool = False,
) -> dict:
    """Times (one process, interleaved) and peaks (one process each) of ``methods`` on ``case``;
    ``once``: each method's one call in its own process gives both (no floors)."""
    if once:  # each method once in its own process: its time and peak from that one call
        out = {}
        for m in methods:
            if m == "floor":
                continue
            c = Case(case.kind, m, case.n, case.h, case.v, case.dtype, baseline=case.baseline)
            r = run_child({"what": "peak", "case": asdict(c)}, timeout)
            if "once_s" in r:
                t = r["once_s"]
                r = {**r, "time": t, "min": t, "max": t, "reps": 1, "rounds": [t]}
                r["cpu_rounds"] = [r["once_cpu_s"]]
            out[m] = r
        return out
    request = {"what": "times", "case": asdict(case), "methods": methods, "reps": reps}
    times = run_child({**request, "warmups": warmups}, timeout)
    if "error" in times:
        return {m: dict(times) for m in methods}
    for m in methods:
        if m == "floor" or "error" in times.get(m, {}):
            continue
        c = Case(case.kind, m, case.n, case.h, case.v, case.dtype, baseline=case.baseline)
        times[m].update(run_child({"what": "peak", "case": asdict(c)}, timeout))
    return times


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


PEERS_ORDER = ("liger", "liger jsd", "trl")


def table(groups: list[tuple[str, dict]]) -> str:
    head = (
        "| case | method | time s, median [min, max] | ×naive | ×fastest peer | peak MiB "
        "| ×naive | ×leanest peer | err |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [head]
    for title, results in groups:
        ok = {m: r for m, r in results.items() if "time" in r}
        naive = ok.get("naive")
        peers = [r for m, r in ok.items() if m in PEERS]
        fastest = min((r["time"] for r in peers), default=None)
        leanest = min((r["peak_mib"] for r in peers if "peak_mib" in r), default=None)
        for m, r in sorted(results.items(), key=lambda mr: "time" not in mr[1]):
            if "time" not in r:
                rows.append(f"| {title} | {m} | {r.get('error', '?')} | | | | | | |")
                continue
            t, peak = r["time"], r.get("peak_mib")
            cells = [
                title,
                m,
                f"{t:.2f} [{r['min']:.2f}, {r['max']:.2f}]",
                _fmt(naive and t / naive["time"], ".2f"),
                _fmt(fastest and t / fastest, ".2f"),
                _fmt(peak, ".0f"),
                _fmt(None if naive is None or peak is None else peak / naive["peak_mib"], ".2f"),
                _fmt(None if leanest is None or peak is None else peak / leanest, ".2f"),
                _fmt(r.get("err"), ".1e"),
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ratio_table(groups: list[tuple[str, dict]]) -> str:
    """What a transform (or a change, against ``--baseline``) costs: per case, the median over the
    interleaved rounds of each round's time ratio, with its [min, max]."""
    rows = ["| case | ratio | median [min, max] |", "| --- | --- | ---: |"]
    for title, results in groups:
        for a, b in RATIOS:
            ra, rb = results.get(a, {}).get("rounds"), results.get(b, {}).get("rounds")
            if not ra or not rb:
                continue
            r = sorted(x / y for x, y in zip(ra, rb, strict=True))
            rows.append(f"| {title} | {a} / {b} | {r[len(r) // 2]:.3f} [{r[0]:.3f}, {r[-1]:.3f}] |")
    return "\n".join(rows)


def machine() -> str:
    """The CPU model, its vector flags, torch's build and capability, the ISA caps and threads."""
    import platform

    import torch

    from klpo import gemm

    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4")))
    env = {
        k: os.environ[k]
        for k in (
            "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA",
            "MKL_ENABLE_INSTRUCTIONS",
            "KLPO_GEMM",
        )
        if k in os.environ
    }
    return (
        f"CPU: {gemm.cpu_fingerprint().split(' [')[0]} ({platform.machine()}, {os.cpu_count()} "
        f"logical CPUs)\nvector flags: {' '.join(vector) or '?'}\ntorch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, oneDNN bf16 "
        f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}, threads {torch.get_num_threads()}; "
        f"environment {env or '{}'}"
    )


SWEEP = [
    ((1024, 896, 151936), [(1024, vc) for vc in (512, 1024, 2048, 4096, 8192)] + [(512, 2048)]),
    ((4096, 896, 32000), [(tc, vc) for tc in (1024, 2048, 4096) for vc in (512, 1024, 2048)]),
]


def sweep(timeout: float, dtypes: list[str], reps: int) -> None:
    """klpo's log-prob forward + backward over a grid of tiles (interleaved), and the entropy."""
    print("| shape | dtype | token_chunk | vocab_chunk | time s, median [min, max] |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (n, h, v), tiles in SWEEP:
        for dtype in dtypes:
            for tc, vc in tiles:
                case = Case("logp", "klpo", n, h, v, dtype, tc, vc)
                r = run_child(
                    {"what": "times", "case": asdict(case), "methods": ["klpo"], "reps": reps},
                    timeout,
                )
                r = r.get("klpo", r)
                cell = (
                    f"{r['time']:.2f} [{r['min']:.2f}, {r['max']:.2f}]"
                    if "time" in r
                    else r["error"]
                )
                print(f"| N={n} H={h} V={v} | {dtype} | {tc} | {vc} | {cell} |", flush=True)


SWEEP_LOSS = [("logp", 512, (64, 128, 256)), ("kl", 256, (64, 128, 256))]


def sweep_loss(timeout: float, reps: int) -> None:
    """``klpo loss`` (:func:`klpo.logprobs.fused_loss`) over token chunks at V = 151936: time and
    peak memory, the measurement behind ``klpo.logprobs.LOSS_TILE_ELEMENTS``."""
    print("| case | token_chunk | time s, median [min, max] | peak MiB |")
    print("| --- | ---: | ---: | ---: |")
    for kind, n, chunks in SWEEP_LOSS:
        for tc in chunks:
            case = Case(kind, "klpo loss", n, 896, 151936, "float32", tc)
            peak = run_child({"what": "peak", "case": asdict(case)}, timeout)
            r = run_child(
                {"what": "times", "case": asdict(case), "methods": ["klpo loss"], "reps": reps},
                timeout,
            )
            r = r.get("klpo loss", r)
            cell = (
                f"{r['time']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" if "time" in r else r["error"]
            )
            mib = f"{peak['peak_mib']:.0f}" if "peak_mib" in peak else peak.get("error", "?")
            print(f"| {kind} N={n} H=896 V=151936 | {tc} | {cell} | {mib} |", flush=True)


SWEEP_TOKENS_METHODS = ["naive", "klpo", "klpo loss"]
SWEEP_TOKENS_SHAPE = (896, 151936)  # the default head: Qwen2.5-0.5B's H and V


def parse_tokens(text: str) -> list[int]:
    """``--sweep-tokens``' comma-separated token counts, each ≥ 1."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(
            f"--sweep-tokens takes comma-separated token counts ≥ 1 (say 256,512,1024), got "
            f"{text!r}"
        )
    return counts


def paired(results: dict, a: str, b: str, key: str = "rounds") -> tuple[float, float, float] | None:
    """Median, min and max over the interleaved rounds of each round's ratio ``a / b`` (``key``:
    ``rounds`` for wall time, ``cpu_rounds`` for the process's CPU time); None if either lacks
    them."""
    ra, rb = results.get(a, {}).get(key), results.get(b, {}).get(key)
    if not ra or not rb or len(ra) != len(rb):
        return None
    r = sorted(x / y for x, y in zip(ra, rb, strict=True))
    return r[len(r) // 2], r[0], r[-1]


def sweep_tokens_table(rows: list[tuple[str, int, dict]], methods: list[str]) -> str:
    """One row per case, token count and method: time, its ratio to naive's from the same rounds
    (wall and CPU time), peak memory and its ratio to naive's."""
    lines = [
        "| case | N | method | time s, median [min, max] | ×naive (wall), median [min, max] "
        "| ×naive (CPU) | peak MiB | ×naive |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    floors = ["floor: bare GEMMs", "floor: klpo's GEMMs"]
    shown = [x for m in methods for x in (floors if m == "floor" else [m])]
    for kind, n, results in rows:
        naive = results.get("naive", {})
        for m in shown:
            r = results.get(m, {})
            if "time" not in r:
                lines.append(f"| {kind} | {n} | {m} | {r.get('error', '?')} | | | | |")
                continue
            wall = paired(results, m, "naive")
            cpu = paired(results, m, "naive", "cpu_rounds")
            peak = r.get("peak_mib")
            npeak = naive.get("peak_mib")
            cells = [
                kind,
                str(n),
                m,
                f"{r['time']:.2f} [{r['min']:.2f}, {r['max']:.2f}]",
                "-" if wall is None else f"{wall[0]:.3f} [{wall[1]:.3f}, {wall[2]:.3f}]",
                "-" if cpu is None else f"{cpu[0]:.3f}",
                _fmt(peak, ".0f"),
                _fmt(None if peak is None or not npeak else peak / npeak, ".2f"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_tokens(
    counts: list[int],
    kinds: list[str],
    methods: list[str],
    reps: int,
    warmups: int,
    timeout: float,
    once: bool,
) -> None:
    """naive, ``klpo`` and ``klpo loss`` (or ``methods``) at each token count of ``counts`` on the
    default head (H = 896, V = 151,936, float32, forward + backward), interleaved rounds per
    count (``--once``: one call each in its own process), peak memory per method in its own
    process; naive is left out (said so) where ``MemAvailable`` is below 1.25x its three
    ``[N, V]`` float32 tensors."""
    h, v = SWEEP_TOKENS_SHAPE
    rows = []
    for kind in kinds:
        for n in counts:
            chosen = list(methods)
            avail = mem_available()
            skipped = {}
            if "naive" in chosen and avail is not None and naive_bytes(n, v) * 1.25 > avail:
                chosen.remove("naive")
                skipped["naive"] = {
                    "error": f"skipped: needs {naive_bytes(n, v) / 2**30:.1f} GiB, "
                    f"{avail / 2**30:.1f} available"
                }
            results = measure_group(
                Case(kind, "", n, h, v, "float32"), chosen, reps, timeout, warmups, once
            )
            results.update(skipped)
            print(f"  {kind} N={n}: {json.dumps(results)}", file=sys.stderr, flush=True)
            rows.append((kind, n, results))
            print(f"  done: {kind} N={n}", file=sys.stderr, flush=True)
    print(sweep_tokens_table(rows, methods))


def head_shapes(head: str, tokens: int | None) -> list[tuple[int, int, int]]:
    """The log-prob shapes of ``--head`` (:data:`HEADS`), with ``tokens`` tokens if given."""
    if head not in HEADS:
        raise ValueError(f"--head takes {', '.join(HEADS)}, got {head!r}")
    if tokens is not None and tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {tokens}")
    return [(tokens or n, h, v) for n, h, v in HEADS[head]]


def naive_bytes(n: int, v: int) -> int:
    """What naive's forward + backward holds at its peak beyond its inputs: three float32
    ``[n, v]`` tensors (the log-softmax kept for the backward, the gradient at it, the logits'
    gradient)."""
    return 3 * n * v * 4


def mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, under 2 minutes")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case (default 5)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--only", default="", help="run the groups whose title contains this")
    parser.add_argument(
        "--dtypes", default="float32", help="comma-separated: float32,bfloat16 (default float32)"
    )
    parser.add_argument(
        "--methods", default="", help="comma-separated methods to run (default all)"
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="another logprobs.py: adds 'klpo (baseline)' and 'klpo loss (baseline)'",
    )
    parser.add_argument(
        "--head", choices=sorted(HEADS), help="a real model's head instead of the default shapes"
    )
    parser.add_argument("--tokens", type=int, help="with --head: this many tokens (N)")
    parser.add_argument(
        "--warmups", type=int, default=1, help="untimed rounds before the timed ones (default 1)"
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="each method called once, in its own process, its time and peak from that call "
        "(no warm-up, no interleaving, no floors): for shapes where one call takes minutes",
    )
    parser.add_argument("--sweep", action="store_true", help="klpo's tile sizes")
    parser.add_argument(
        "--sweep-tokens",
        default="",
        help="comma-separated token counts (say 256,512,1024,2048,4096,8192): naive, klpo and "
        "klpo loss at each on the default head, with ratios to naive from the same rounds",
    )
    parser.add_argument(
        "--sweep-kinds",
        default="logp",
        help="with --sweep-tokens: comma-separated cases, logp and/or kl (default logp)",
    )
    parser.add_argument(
        "--sweep-loss", action="store_true", help="the token chunks of klpo's fused loss"
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(child(json.loads(args.case))))
        return
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or args.reps < 1 or args.warmups < 0:
        parser.error(
            f"--dtypes takes {','.join(DTYPES)}, --reps ≥ 1 and --warmups ≥ 0; got "
            f"{args.dtypes}, {args.reps}, {args.warmups}"
        )
    if args.sweep_tokens:
        try:
            counts = parse_tokens(args.sweep_tokens)
        except ValueError as err:
            parser.error(str(err))
        kinds = [k for k in args.sweep_kinds.split(",") if k]
        if not kinds or any(k not in ("logp", "kl") for k in kinds):
            parser.error(f"--sweep-kinds takes logp and/or kl, got {args.sweep_kinds!r}")
    if args.tokens is not None and not args.head:
        parser.error("--tokens sets the token count of --head's shapes; give --head too")
    if args.head:
        try:
            head = head_shapes(args.head, args.tokens)
        except ValueError as err:
            parser.error(str(err))
    print(machine(), flush=True)
    if args.sweep:
        sweep(args.timeout, dtypes, args.reps)
        return
    if args.sweep_loss:
        sweep_loss(args.timeout, args.reps)
        return
    if args.sweep_tokens:
        methods = [m for m in args.methods.split(",") if m] or SWEEP_TOKENS_METHODS
        start = time.perf_counter()
        sweep_tokens(counts, kinds, methods, args.reps, args.warmups, args.timeout, args.once)
        print(
            f"\nTotal wall time {time.perf_counter() - start:.0f} s. H=896 V=151936 float32, "
            "forward + backward of the weighted sum; ×naive: median [min, max] over the "
            "interleaved rounds of each round's ratio (wall time), and the median of the CPU-time "
            "ratios (this process's CPU seconds, which a shared core's load inflates less); "
            "peak: peak RSS over the inputs', own process."
        )
        return

    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    kl_shapes = QUICK_KL_SHAPES if args.quick else FULL_KL_SHAPES
    if args.head:
        shapes, kl_shapes = head, []
        avail = mem_available()
        need = max(naive_bytes(n, v) for n, _, v in head)
        wants_naive = not args.methods or "naive" in args.methods.split(",")
        if wants_naive and avail is not None and need * 1.25 > avail:
            sys.exit(
                f"naive needs about {need / 2**30:.1f} GiB at its peak and {avail / 2**30:.1f} "
                "GiB is available: give fewer --tokens, or --methods without naive"
            )
    start = time.perf_counter()
    groups = []
    for kind, shape_list, methods in (
        ("logp", shapes, LOGP_METHODS),
        ("kl", kl_shapes, KL_METHODS),
    ):
        for n, h, v in shape_list:
            for dtype in dtypes:
                title = f"{kind} N={n} H={h} V={v} {dtype}"
                first = (n, h, v) == shape_list[0] and kind == "logp"
                chosen = [m for m in methods if m not in ABLATIONS or first] + ["floor"]
                if args.head:
                    chosen = list(HEAD_METHODS)
                if args.baseline:
                    chosen += BASELINE_METHODS
                if args.methods:
                    chosen = [m for m in chosen if m in args.methods.split(",")]
                if args.only not in title or not chosen:
                    continue
                base = os.path.abspath(args.baseline) if args.baseline else None
                results = measure_group(
                    Case(kind, "", n, h, v, dtype, baseline=base),
                    chosen,
                    args.reps,
                    args.timeout,
                    args.warmups,
                    args.once,
                )
                print(f"  {title}: {json.dumps(results)}", file=sys.stderr, flush=True)
                groups.append((title, results))
    print(table(groups))
    print("\n" + ratio_table(groups))
    print(
        f"\nTotal wall time {time.perf_counter() - start:.0f} s. time: one forward + backward, "
        + (
            "one call in its own process, no warm-up (--once); "
            if args.once
            else f"median [min, max] of {args.reps} interleaved rounds after {args.warmups} "
            "warm-up round(s); "
        )
        + "peak: peak RSS over "
        "the inputs' RSS, own process; err: max |error| of logp (KL) on the first 64 tokens "
        "against float64. Floors: the bare GEMMs of any method (logits, grad hidden, grad weight, "
        "in the inputs' dtype, faster backend) and the GEMMs klpo runs (plus the recompute, "
        "float32, its plan), tile by tile."
    )


if __name__ == "__main__":
    main()
