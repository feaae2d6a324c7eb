"""Time and peak memory of a teacher divergence from both models' hidden states, forward + backward.

On-policy distillation's exact term: the student's hidden states ``[N, H]`` and head ``[V, H]``,
the teacher's ``[N, H_T]`` and ``[V, H_T]`` (detached), the divergence at each of the N positions
summed, and its gradient with respect to the student's hidden states and head (only the hidden
states' with ``--frozen-head``: a LoRA student, whose head is frozen). Methods:

- ``naive``: both models' full ``[N, V]`` logits, ``log_softmax``, the divergence, autograd;
- ``klpo fused``: :func:`klpo.logprobs.fused` with the teacher in the reference's place (the exact
  reverse KL(pi_theta ‖ pi_T) of the trainer's ``full`` estimator), only its ``kl`` output used;
- ``klpo from_hidden``: :func:`klpo.teacher.from_hidden`, reverse, forward or JSD (its backward
  recomputes both models' logit tiles);
- ``klpo from_hidden loss``: :func:`klpo.teacher.from_hidden_loss` with every weight 1 (so its loss
  is the others' sum), the gradient formed in the forward pass;
- ``trl``: TRL 1.16's ``ChunkedDivergenceFunction`` (the loss of its ``DistillationTrainer``),
  ``beta`` 1 (reverse, its default), 0 (forward) or 0.5, when ``trl`` imports.

Timing: every method of a divergence in one process on the same inputs, once to warm up, then
``--reps`` rounds interleaved; median [min, max]. The inputs include the student's leaves (the
copies of its hidden states and head that take the gradient), made before each call and outside
the measured time. Memory: each method once more in its own process, its imports and a call on a
small shape first, then the inputs, then the high-water mark reset (``/proc/self/clear_refs``), so two columns: ``peak``, the peak RSS above
the inputs, and ``working``, that peak less the gradient buffers every method must return (the
hidden states' ``[N, H]`` and, unless the head is frozen, the head's ``[V, H]``, float32: their
size from the shapes), the loss's own memory. ``rel``: the summed value's relative difference to
naive; ``grad rel``: the largest difference of the gradients (hidden states' and head's) to
naive's, over naive's largest entry, all in float32 (a float64 oracle is not needed at these
shapes: every method computes in float32). Ratios to naive and to TRL of the same divergence. The
CPU and its flags are printed. Shapes: ``--head gemma3`` (V = 262,144, H = 640: Gemma 3 270M's
head, student and teacher alike), ``--head qwen`` (V = 151,936, H = 896, a teacher of H = 1536),
or both (default); ``--head tiny`` (V = 4096) is a smoke test. ``--row-chunk``: the rows of a
tile of the two ``from_hidden`` methods (default theirs).

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=2 PEERS_VENV/bin/python bench/teacher_kl.py --tokens 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HEADS = {"gemma3": (262_144, 640, 640), "qwen": (151_936, 896, 1536), "tiny": (4096, 64, 96)}
DIVERGENCES = {"reverse": 1.0, "forward": 0.0, "jsd": 0.5}
MIB = 1 << 20


def _inputs(n: int, v: int, h: int, ht: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(n, h, generator=g) * 0.5,
        torch.randn(v, h, generator=g) * (1 / h**0.5),
        torch.randn(n, ht, generator=g) * 0.5,
        torch.randn(v, ht, generator=g) * (1 / ht**0.5),
        torch.randint(0, v, (n,), generator=g),
    )


def _leaves(hidden, weight, frozen: bool):
    """The student's hidden states and head as the leaves that take the gradient (a frozen head
    takes none): part of the inputs, made before a call is measured."""
    return hidden.clone().requires_grad_(True), weight.clone().requires_grad_(not frozen)


def _grad_mib(shape: tuple, frozen: bool) -> float:
    """The float32 gradient buffers every method returns: ``[N, H]``, and ``[V, H]`` unless the
    head is frozen."""
    n, v, h, _ = shape
    return 4 * (n * h + (0 if frozen else v * h)) / MIB


def _methods(divergence: str) -> list[str]:
    out = ["naive", "klpo from_hidden", "klpo from_hidden loss"]
    if divergence == "reverse":
        out.insert(1, "klpo fused")
    try:
        import trl.kernels.chunked_divergence  # noqa: F401

        out.append("trl")
    except ImportError:
        pass
    return out


def _naive(divergence: str, h, w, hidden_t, weight_t):
    """The textbook form, no chunking: ``log_softmax`` over ``[N, V]`` both sides."""
    import math

    import torch

    beta = DIVERGENCES[divergence]
    log_q, log_p = torch.log_softmax(h @ w.T, -1), torch.log_softmax(hidden_t @ weight_t.T, -1)
    if divergence == "reverse":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if divergence == "forward":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = torch.logaddexp(log_q + math.log(1 - beta), log_p + math.log(beta))
    kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
    return beta * kl_p + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


def _call(
    method: str, divergence: str, leaves, hidden_t, weight_t, tokens, row_chunk: int | None
) -> float:
    """One forward + backward into ``leaves`` (the student's hidden states and head); returns the
    summed divergence."""
    import torch

    from klpo import teacher
    from klpo.logprobs import fused

    h, w = leaves
    beta = DIVERGENCES[divergence]
    if method == "naive":
        total = _naive(divergence, h, w, hidden_t, weight_t).sum()
    elif method == "klpo fused":
        out = fused(h, w, tokens, hidden_ref=hidden_t, weight_ref=weight_t, with_entropy=False)
        total = out.kl.sum()
    elif method == "klpo from_hidden":
        total = teacher.from_hidden(
            h, w, hidden_t, weight_t, divergence=divergence, beta=beta, row_chunk=row_chunk
        ).sum()
    elif method == "klpo from_hidden loss":
        ones = torch.ones(h.shape[0])
        total = teacher.from_hidden_loss(
            h, w, hidden_t, weight_t, ones, divergence=divergence, beta=beta, row_chunk=row_chunk
        ).loss
    else:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        value, _ = ChunkedDivergenceFunction.apply(
            h, w, None, hidden_t, weight_t, None, beta, 1.0, 1.0, None, 1.0, None
        )
        total = value.sum()
    total.backward()
    return float(total.detach())


def child(request: dict) -> dict:
    """One method's peak RSS above its inputs (the student's leaves among them), in this process."""
    import torch

    from logprobs import _rss_kib  # a sibling script (the child runs as one: bench/ on the path)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    # The method's imports and first-call set-up (TRL's kernels module, lazy initialisation) on
    # a small shape, before the mark is reset: they are no part of the loss's memory.
    small = _inputs(8, 256, 16, 24)
    _call(request["method"], request["divergence"], _leaves(*small[:2], request["frozen"]),
          *small[2:], None)  # fmt: skip
    del small
    hidden, weight, hidden_t, weight_t, tokens = _inputs(*request["shape"])
    leaves = _leaves(hidden, weight, request["frozen"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    value = _call(
        request["method"], request["divergence"], leaves, hidden_t, weight_t, tokens,
        request["row_chunk"],
    )  # fmt: skip
    peak = (_rss_kib("VmHWM") - base) / 1024
    return {
        "peak_mib": peak,
        "working_mib": peak - _grad_mib(request["shape"], request["frozen"]),
        "s": time.perf_counter() - t0,
        "value": value,
    }


def _peak(method: str, divergence: str, shape: tuple, frozen: bool, row_chunk) -> dict:
    req = json.dumps({"method": method, "divergence": divergence, "shape": shape,
                      "frozen": frozen, "row_chunk": row_chunk})  # fmt: skip
    out = subprocess.run(
        [sys.executable, __file__, "--child", req], capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _grad_error(leaves, want) -> float:
    """The largest entry of ``|g - g_naive|`` over naive's largest ``|g_naive|``, of the hidden
    states' and the head's gradients (the worse)."""
    out = 0.0
    for x, ref in zip(leaves, want, strict=True):
        if ref is not None:
            scale = float(ref.abs().max()) or 1.0
            out = max(out, float((x.grad - ref).abs().max()) / scale)
    return out


def measure(divergence: str, shape: tuple, reps: int, frozen: bool, row_chunk) -> dict[str, dict]:
    import torch

    hidden, weight, hidden_t, weight_t, tokens = _inputs(*shape)
    rest = (hidden_t, weight_t, tokens, row_chunk)
    methods = _methods(divergence)
    times: dict[str, list[float]] = {m: [] for m in methods}
    values: dict[str, float] = {}
    grad_rel: dict[str, float] = {}
    want = None
    for m in methods:  # warm-up, and each method's gradients against naive's (naive first)
        leaves = _leaves(hidden, weight, frozen)
        values[m] = _call(m, divergence, leaves, *rest)
        if want is None:
            want = tuple(x.grad for x in leaves)
        grad_rel[m] = _grad_error(leaves, want)
        del leaves
    del want
    for _ in range(reps):
        for m in methods:
            leaves = _leaves(hidden, weight, frozen)
            t0 = time.perf_counter()
            _call(m, divergence, leaves, *rest)
            times[m].append(time.perf_counter() - t0)
            del leaves
    del hidden, weight, hidden_t, weight_t, tokens, rest
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = {}
    for m in methods:
        out[m] = {
            "median": statistics.median(times[m]),
            "min": min(times[m]),
            "max": max(times[m]),
            "rel": abs(values[m] - values["naive"]) / abs(values["naive"]),
            "grad_rel": grad_rel[m],
            **_peak(m, divergence, shape, frozen, row_chunk),
        }
    return out


def table(title: str, rows: dict[str, dict]) -> str:
    naive, trl = rows["naive"], rows.get("trl")
    lines = [
        f"### {title}",
        "",
        "| method | s median [min, max] | / naive | / TRL | peak MiB | / naive | / TRL "
        "| working MiB | / naive | / TRL | rel | grad rel |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return "" if a is None or not b else f"{a / b:.2f}"

    def mib(x: float | None) -> str:
        return "?" if x is None else f"{x:.0f}"

    t_trl = None if trl is None else trl["median"]
    for m, r in rows.items():
        cells = [f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]",
                 ratio(r["median"], naive["median"]), ratio(r["median"], t_trl)]  # fmt: skip
        for key in ("peak_mib", "working_mib"):
            x = r.get(key)
            cells += [
                mib(x),
                ratio(x, naive.get(key)),
                ratio(x, None if trl is None else trl.get(key)),
            ]
        cells += [f"{r['rel']:.1e}", f"{r['grad_rel']:.1e}"]
        if "error" in r:
            cells[-1] += f" (memory run failed: {r['error']})"
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--head", choices=[*HEADS, "both"], default="both")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--divergences", default="reverse,forward,jsd")
    parser.add_argument(
        "--frozen-head", action="store_true",
        help="a LoRA student: the head takes no gradient (only the hidden states do)",
    )  # fmt: skip
    parser.add_argument(
        "--row-chunk", type=int, default=None,
        help="rows of a tile of the from_hidden methods (default: theirs)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    sys.path.insert(0, os.path.dirname(__file__))
    from logprobs import machine

    print(machine())
    heads = ["gemma3", "qwen"] if args.head == "both" else [args.head]
    for head in heads:
        v, h, ht = HEADS[head]
        shape = (args.tokens, v, h, ht)
        for divergence in args.divergences.split(","):
            rows = measure(divergence, shape, args.reps, args.frozen_head, args.row_chunk)
            title = (
                f"{divergence}, {head}: N = {args.tokens}, V = {v}, H = {h}, H_T = {ht}, float32"
                f"{', frozen head' if args.frozen_head else ''}"
                f"{f', row_chunk {args.row_chunk}' if args.row_chunk else ''}"
            )
            print()
            print(table(title, rows), flush=True)


if __name__ == "__main__":
    main()
