"""Time and peak memory of a teacher divergence from both models' hidden states, forward + backward.

On-policy distillation's exact term: the student's hidden states ``[N, H]`` and head ``[V, H]``,
the teacher's ``[N, H_T]`` and ``[V, H_T]`` (detached), the divergence at each of the N positions
summed, and its gradient with respect to the student's hidden states and head. Methods:

- ``naive``: both models' full ``[N, V]`` logits, ``log_softmax``, the divergence, autograd;
- ``klpo fused``: :func:`klpo.logprobs.fused` with the teacher in the reference's place (the exact
  reverse KL(pi_theta ‖ pi_T) of the trainer's ``full`` estimator), only its ``kl`` output used;
- ``klpo from_hidden``: :func:`klpo.teacher.from_hidden`, reverse, forward or JSD;
- ``trl``: TRL 1.16's ``ChunkedDivergenceFunction`` (the loss of its ``DistillationTrainer``),
  ``beta`` 1 (reverse, its default), 0 (forward) or 0.5, when ``trl`` imports.

Timing: every method of a divergence in one process on the same inputs, once to warm up, then
``--reps`` rounds interleaved; median [min, max]. Memory: each method once more in its own
process, the peak RSS above the inputs (``/proc/self/clear_refs``). ``rel``: the summed value's
relative difference to naive in float32 (float64 oracle not needed at these shapes: all methods
compute in float32). Ratios to naive and to TRL of the same divergence. The CPU and its flags are
printed. Shapes: ``--head gemma3`` (V = 262,144, H = 640: Gemma 3 270M's head, student and teacher
alike), ``--head qwen`` (V = 151,936, H = 896, a teacher of H = 1536), or both (default);
``--head tiny`` (V = 4096) is a smoke test.

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


def _methods(divergence: str) -> list[str]:
    out = ["naive", "klpo from_hidden"]
    if divergence == "reverse":
        out.insert(1, "klpo fused")
    try:
        import trl.kernels.chunked_divergence  # noqa: F401

        out.append("trl")
    except ImportError:
        pass
    return out


def _call(method: str, divergence: str, hidden, weight, hidden_t, weight_t, tokens) -> float:
    """One forward + backward; returns the summed divergence."""
    import torch

    from klpo import teacher
    from klpo.logprobs import fused

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    beta = DIVERGENCES[divergence]
    if method == "naive":
        z, zt = h @ w.T, hidden_t @ weight_t.T
        fn = {"reverse": teacher.reverse_kl, "forward": teacher.forward_kl}.get(divergence)
        # the textbook form, no chunking: log_softmax over [N, V] both sides
        log_q, log_p = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
        if fn is teacher.reverse_kl:
            value = (log_q.exp() * (log_q - log_p)).sum(-1)
        elif fn is teacher.forward_kl:
            value = (log_p.exp() * (log_p - log_q)).sum(-1)
        else:
            log_m = torch.logaddexp(
                log_q + torch.log(torch.tensor(1 - beta)), log_p + torch.log(torch.tensor(beta))
            )
            value = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (
                log_q.exp() * (log_q - log_m)
            ).sum(-1)
    elif method == "klpo fused":
        value = fused(h, w, tokens, hidden_ref=hidden_t, weight_ref=weight_t, with_entropy=False).kl
    elif method == "klpo from_hidden":
        value = teacher.from_hidden(h, w, hidden_t, weight_t, divergence=divergence, beta=beta)
    else:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        value, _ = ChunkedDivergenceFunction.apply(
            h, w, None, hidden_t, weight_t, None, beta, 1.0, 1.0, None, 1.0, None
        )
    total = value.sum()
    total.backward()
    return float(total.detach())


def child(request: dict) -> dict:
    """One method's peak RSS above its inputs, in this process."""
    import torch

    from logprobs import _rss_kib  # a sibling script (the child runs as one: bench/ on the path)

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = _inputs(*request["shape"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    value = _call(request["method"], request["divergence"], *args)
    return {
        "peak_mib": (_rss_kib("VmHWM") - base) / 1024,
        "s": time.perf_counter() - t0,
        "value": value,
    }


def _peak(method: str, divergence: str, shape: tuple) -> dict:
    req = json.dumps({"method": method, "divergence": divergence, "shape": shape})
    out = subprocess.run(
        [sys.executable, __file__, "--child", req], capture_output=True, text=True, timeout=3600
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(divergence: str, shape: tuple, reps: int) -> dict[str, dict]:
    import torch

    args = _inputs(*shape)
    methods = _methods(divergence)
    times: dict[str, list[float]] = {m: [] for m in methods}
    values: dict[str, float] = {}
    for m in methods:  # warm-up
        values[m] = _call(m, divergence, *args)
    for _ in range(reps):
        for m in methods:
            t0 = time.perf_counter()
            _call(m, divergence, *args)
            times[m].append(time.perf_counter() - t0)
    del args
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    out = {}
    for m in methods:
        out[m] = {
            "median": statistics.median(times[m]),
            "min": min(times[m]),
            "max": max(times[m]),
            "rel": abs(values[m] - values["naive"]) / abs(values["naive"]),
            **_peak(m, divergence, shape),
        }
    return out


def table(title: str, rows: dict[str, dict]) -> str:
    naive, trl = rows["naive"], rows.get("trl")
    lines = [
        f"### {title}",
        "",
        "| method | s median [min, max] | / naive | / TRL | peak MiB | / naive | / TRL | rel |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ratio(a: float | None, b: float | None) -> str:
        return "" if a is None or not b else f"{a / b:.2f}"

    for m, r in rows.items():
        peak = r.get("peak_mib")
        t_trl = None if trl is None else trl["median"]
        p_naive, p_trl = naive.get("peak_mib"), None if trl is None else trl.get("peak_mib")
        lines.append(
            f"| {m} | {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}] | "
            f"{ratio(r['median'], naive['median'])} | {ratio(r['median'], t_trl)} | "
            f"{'?' if peak is None else f'{peak:.0f}'} | {ratio(peak, p_naive)} | "
            f"{ratio(peak, p_trl)} | {r['rel']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--head", choices=[*HEADS, "both"], default="both")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--divergences", default="reverse,forward,jsd")
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
            rows = measure(divergence, shape, args.reps)
            title = (
                f"{divergence}, {head}: N = {args.tokens}, V = {v}, H = {h}, H_T = {ht}, float32"
            )
            print()
            print(table(title, rows), flush=True)


if __name__ == "__main__":
    main()
