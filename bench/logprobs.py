"""Time and peak memory of token log-probs and exact KL from hidden states + head, forward + backward.

One table, each case in its own subprocess (so its peak RSS is its own): naive PyTorch (the full
logits), klpo (:func:`klpo.logprobs.fused`), and the peers where they import — Liger-Kernel's
chunked selective log-prob (``LigerFusedLinearPPOBase.chunk_forward``, the log-prob of
``liger_kernel.chunked_loss``'s GRPO loss) and exact reverse KL (``LigerFusedLinearJSDLoss`` with
``beta=1``), and TRL 1.16's ``trl.kernels.ChunkedLogProbFunction`` and
``trl.kernels.chunked_divergence.ChunkedDivergenceFunction`` (``beta=1``: KL(student ‖ teacher)).
``klpo (torch.mm)`` is klpo with its oneDNN GEMMs switched off, to separate the algorithm from the
GEMM backend (shown for the first log-prob shape). Two floors, both the GEMMs alone, tile by tile
with klpo's tile sizes: "bare GEMMs", those any method needs (the logits, and the reference's for
KL; the gradients with respect to hidden and weight) in the inputs' dtype with the faster of
torch.mm and oneDNN; and "klpo's GEMMs", the GEMMs klpo runs (the same plus the recompute of the
logits in the backward pass) in float32.

Run it alone on the machine (it uses every core), with the peers' environment for the peers:

    PYTHONPATH=$PWD/src PEERS_VENV/bin/python bench/logprobs.py [--quick]

``--sweep`` times klpo alone over a grid of tile sizes (and with the entropy on), the measurement
behind the defaults ``klpo.logprobs.TOKEN_CHUNK`` and ``default_vocab_chunk``.

Columns: ``time`` of one forward + backward after a warm-up call; ``peak`` is the peak RSS of the
case's process over its RSS once the inputs exist (``/proc/self/clear_refs`` resets the
high-water mark); ``err`` is the largest |error| of the log-probs (KL for KL cases) against a
float64 reference on the first 64 tokens; ratios are to naive and to the best (fastest / leanest)
peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

FULL_SHAPES = [(1024, 896, 151936), (4096, 896, 32000)]
FULL_KL_SHAPES = [(256, 896, 151936)]
QUICK_SHAPES = [(256, 896, 32000)]
QUICK_KL_SHAPES = [(256, 896, 32000)]
DTYPES = ["float32", "bfloat16"]
LOGP_METHODS = ["naive", "klpo", "klpo (torch.mm)", "liger", "trl"]
KL_METHODS = ["naive", "klpo", "klpo (torch.mm)", "liger jsd", "trl"]
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

    if case.method in ("klpo", "klpo (torch.mm)"):
        import klpo.logprobs as lp

        if case.method == "klpo (torch.mm)":
            lp._ONEDNN = False

        def forward():
            out = lp.fused(
                hidden,
                weight,
                tokens,
                hidden_ref=hidden_ref,
                weight_ref=weight_ref,
                with_entropy=case.with_entropy,
                token_chunk=case.token_chunk or lp.TOKEN_CHUNK,
                vocab_chunk=case.vocab_chunk,
            )
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


def _floor(case: Case, hidden, weight, hidden_ref, weight_ref) -> dict:
    """Seconds of the GEMMs alone, tile by tile with klpo's tile sizes, best backend.

    ``time``: the GEMMs any method needs (logits, and the reference's for KL; grad hidden; grad
    weight) in the inputs' dtype. ``klpo_gemms``: the GEMMs klpo runs (the same plus the recompute
    of every tile in the backward pass), in float32.
    """
    import torch

    import klpo.logprobs as lp

    n, vocab = case.n, case.v
    tc = min(n, lp.TOKEN_CHUNK)
    vc = lp.default_vocab_chunk(tc)
    lin = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    backends = ["torch.mm"] + (["onednn"] if lin is not None else [])

    def seconds(dtype, backend, recompute):
        def mm(a, b):  # a @ b.T
            return lin(a, b, None, "none", [], "") if backend == "onednn" else a @ b.t()

        heads = [(hidden, weight)] + ([(hidden_ref, weight_ref)] if hidden_ref is not None else [])
        heads = [(h.detach().to(dtype), w.detach().to(dtype)) for h, w in heads]
        g = torch.randn(tc, vc).to(dtype)
        g_t = g.t().contiguous()
        t0 = time.perf_counter()
        for v0 in range(0, vocab, vc):
            v1 = min(v0 + vc, vocab)
            for t_0 in range(0, n, tc):
                t = slice(t_0, min(t_0 + tc, n))
                for _ in range(2 if recompute else 1):
                    for h, w in heads:
                        mm(h[t], w[v0:v1])
                h, w = heads[0]
                mm(g[: t.stop - t.start, : v1 - v0], w[v0:v1].t())
                mm(g_t[: v1 - v0, : t.stop - t.start], h[t].t())
        return time.perf_counter() - t0

    dtype = getattr(torch, case.dtype)
    bare = min(seconds(dtype, b, False) for b in backends)
    ours = seconds(torch.float32, "onednn" if lin is not None else "torch.mm", True)
    return {"time": bare, "klpo_gemms": ours}


def _reference(case: Case, hidden, weight, tokens, hidden_ref, weight_ref):
    import torch

    k = min(CHECK_TOKENS, case.n)
    log_pi = torch.log_softmax(hidden[:k].detach().double() @ weight.detach().double().t(), -1)
    if case.kind == "logp":
        return log_pi.gather(1, tokens[:k, None])[:, 0]
    log_pi_ref = torch.log_softmax(hidden_ref[:k].double() @ weight_ref.double().t(), -1)
    return (log_pi.exp() * (log_pi - log_pi_ref)).sum(-1)


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def child(case: Case) -> dict:
    import torch

    hidden, weight, tokens, coef, hidden_ref, weight_ref = _inputs(case)
    _reset_peak()
    base = _rss_kib("VmRSS")
    if case.kind.startswith("floor"):
        return _floor(case, hidden, weight, hidden_ref, weight_ref)
    run, has_output = _method(case, hidden, weight, tokens, coef, hidden_ref, weight_ref)
    _timed(run)  # the warm-up: allocator, oneDNN primitives
    elapsed, out = _timed(run)
    peak = _rss_kib("VmHWM") - base
    err = None
    if has_output:
        with torch.no_grad():
            k = min(CHECK_TOKENS, case.n)
            ref = _reference(case, hidden, weight, tokens, hidden_ref, weight_ref)
            err = float((out[:k].double() - ref).abs().max())
    return {"time": elapsed, "peak_mib": peak / 1024, "base_mib": base / 1024, "err": err}


# ---------------------------------------------------------------------------------------------
# The parent: every case in its own process, then one table.


def run_case(case: Case, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", json.dumps(asdict(case))]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail[:120]}
    return json.loads(lines[-1])


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(groups: list[tuple[str, list[tuple[Case, dict]]]]) -> str:
    head = (
        "| case | method | time s | ×naive | ×best peer | peak MiB | ×naive | ×leanest peer | err |\n"
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )
    rows = [head]
    for title, results in groups:
        ok = {c.method: r for c, r in results if "time" in r and not c.kind.startswith("floor")}
        naive = ok.get("naive")
        peers = [r for m, r in ok.items() if m in PEERS]
        fastest = min((r["time"] for r in peers), default=None)
        leanest = min((r["peak_mib"] for r in peers), default=None)
        for case, r in results:
            if "error" in r:
                rows.append(f"| {title} | {case.method} | {r['error']} | | | | | | |")
                continue
            if case.kind.startswith("floor"):
                for label, t in (
                    ("floor: bare GEMMs", r["time"]),
                    ("floor: klpo's GEMMs", r["klpo_gemms"]),
                ):
                    vs_naive = _fmt(naive and t / naive["time"], ".2f")
                    vs_peer = _fmt(fastest and t / fastest, ".2f")
                    rows.append(f"| {title} | {label} | {t:.2f} | {vs_naive} | {vs_peer} | | | | |")
                continue
            t = r["time"]
            peak = r.get("peak_mib")
            rows.append(
                "| "
                + " | ".join(
                    [
                        title,
                        case.method,
                        f"{t:.2f}",
                        _fmt(naive and t / naive["time"], ".2f"),
                        _fmt(fastest and t / fastest, ".2f"),
                        _fmt(peak, ".0f"),
                        _fmt(naive and peak is not None and peak / naive["peak_mib"], ".2f"),
                        _fmt(leanest and peak is not None and peak / leanest, ".2f"),
                        _fmt(r.get("err"), ".1e"),
                    ]
                )
                + " |"
            )
    return "\n".join(rows)


SWEEP = [
    ((1024, 896, 151936), [(1024, vc) for vc in (512, 1024, 2048, 4096, 8192)] + [(512, 2048)]),
    ((4096, 896, 32000), [(tc, vc) for tc in (1024, 2048, 4096) for vc in (512, 1024, 2048)]),
]


def sweep(timeout: float, dtypes: list[str]) -> None:
    """klpo's log-prob forward + backward over a grid of tiles, and the cost of the entropy."""
    print("| shape | dtype | token_chunk | vocab_chunk | time s | peak MiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for (n, h, v), tiles in SWEEP:
        for dtype in dtypes:
            for tc, vc in tiles:
                r = run_case(Case("logp", "klpo", n, h, v, dtype, tc, vc), timeout)
                cells = (
                    [f"{r['time']:.2f}", f"{r['peak_mib']:.0f}"]
                    if "time" in r
                    else [r["error"], ""]
                )
                print(
                    f"| N={n} H={h} V={v} | {dtype} | {tc} | {vc} | {' | '.join(cells)} |",
                    flush=True,
                )
            r = run_case(Case("logp", "klpo", n, h, v, dtype, with_entropy=True), timeout)
            cells = (
                [f"{r['time']:.2f}", f"{r['peak_mib']:.0f}"] if "time" in r else [r["error"], ""]
            )
            print(
                f"| N={n} H={h} V={v} | {dtype} | default, with entropy | | {' | '.join(cells)} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, about a minute")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--only", default="", help="run the groups whose title contains this")
    parser.add_argument(
        "--methods", default="", help="comma-separated methods to run (default all)"
    )
    parser.add_argument("--sweep", action="store_true", help="klpo's tile sizes (a few minutes)")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(child(Case(**json.loads(args.case)))))
        return
    if args.sweep:
        sweep(args.timeout, [d for d in DTYPES if args.only in d])
        return

    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    kl_shapes = QUICK_KL_SHAPES if args.quick else FULL_KL_SHAPES
    plan = []
    for kind, shape_list, methods in (
        ("logp", shapes, LOGP_METHODS),
        ("kl", kl_shapes, KL_METHODS),
    ):
        for n, h, v in shape_list:
            for dtype in DTYPES:
                title = f"{kind} N={n} H={h} V={v} {dtype}"
                ablate = (n, h, v) == shape_list[0] and kind == "logp"
                cases = [
                    Case(kind, m, n, h, v, dtype)
                    for m in methods
                    if m != "klpo (torch.mm)" or ablate
                ]
                cases.append(Case(f"floor-{kind}", "floor", n, h, v, dtype))
                if args.methods:
                    cases = [c for c in cases if c.method in args.methods.split(",")]
                if args.only in title:
                    plan.append((title, cases))
    start = time.perf_counter()
    groups = []
    for title, cases in plan:
        results = []
        for case in cases:
            r = run_case(case, args.timeout)
            print(f"  {title} | {case.method}: {r}", file=sys.stderr, flush=True)
            results.append((case, r))
        groups.append((title, results))
    print(table(groups))
    print(
        f"\ntorch threads: {_threads()}; total wall time {time.perf_counter() - start:.0f} s. time: one "
        "forward + backward after a warm-up; peak: peak RSS over the inputs' RSS; err: max |error| "
        "of logp (KL) on the first 64 tokens against float64. Floors: the bare GEMMs of any method "
        "(logits, grad hidden, grad weight, in the inputs' dtype) and the GEMMs klpo runs (plus the "
        "recompute, in float32), tile by tile, fastest backend."
    )


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
