"""Peak memory per rank of the exact KL over a vocabulary-sharded head: sharded against gathered.

Each of ``W`` gloo processes holds the rows ``[r V/W, (r + 1) V/W)`` of the policy's and the
reference's output heads (``[V/W, H]`` each) and the same hidden states ``[N, H]``; every rank
computes the tokens' log-probs, the entropy and the exact KL(pi_theta ‖ pi_ref) and backpropagates
``sum(logp) + sum(kl)`` into its hidden states and head shard. Methods:

- ``gathered``: each rank's logit slices all-gathered into ``[N, V]`` (``torch.distributed.nn``'s
  differentiable ``all_gather``), then ``log_softmax`` and autograd: what a framework without a
  vocabulary-parallel loss does;
- ``klpo``: :func:`klpo.vocab_parallel.vocab_parallel` (two reductions per chunk of tokens, tiles
  recomputed in the backward pass, nothing ``[N, V]``).

Memory: each method in fresh processes; per rank the peak RSS above its inputs (``VmHWM`` after
``/proc/self/clear_refs``), the largest over the ranks; ratio klpo / gathered. Both methods'
``sum(kl)`` are compared (relative difference). The CPU and its flags are printed. Shapes:
``--vocab 151936 --hidden 896`` (Qwen2.5's head) by default.

    PYTHONPATH=$PWD/src OMP_NUM_THREADS=1 python bench/vocab_parallel.py --tokens 512 --world 2 4
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from logprobs import _rss_kib, machine


def _rank(rank: int, world: int, method: str, shape: tuple[int, int, int], port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n, v, h = shape
    g = torch.Generator().manual_seed(0)  # the same full inputs on every rank; each keeps its rows
    hidden = torch.randn(n, h, generator=g) * 0.5
    hidden_ref = hidden + 0.05 * torch.randn(n, h, generator=g)
    tokens = torch.randint(0, v, (n,), generator=g)
    rows = slice(rank * v // world, (rank + 1) * v // world)
    weight = (torch.randn(v, h, generator=g) / h**0.5)[rows].clone()
    weight_ref = (weight + 0.01 * torch.randn(weight.shape, generator=g)).clone()
    del g
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _rss_kib("VmRSS")
    if method == "klpo":
        from klpo.vocab_parallel import vocab_parallel

        o = vocab_parallel(
            hidden, weight, tokens, vocab_start=rows.start, hidden_ref=hidden_ref,
            weight_ref=weight_ref,
        )  # fmt: skip
        logp, kl = o.logp, o.kl
    else:
        import warnings

        with warnings.catch_warnings():  # its deprecation names a private successor
            warnings.simplefilter("ignore", FutureWarning)
            from torch.distributed.nn.functional import all_gather

            z = torch.cat(all_gather(hidden @ weight.T), -1)
        with torch.no_grad():
            part = hidden_ref @ weight_ref.T
            parts = [torch.empty_like(part) for _ in range(world)]
            dist.all_gather(parts, part)
            log_r = torch.log_softmax(torch.cat(parts, -1), -1)
            del part, parts
        log_q = torch.log_softmax(z, -1)
        logp = log_q.gather(-1, tokens[:, None]).squeeze(-1)
        kl = (log_q.exp() * (log_q - log_r)).sum(-1)
    total = logp.sum() + kl.sum()
    total.backward()
    peak = _rss_kib("VmHWM") - base
    out.put((rank, peak, float(kl.detach().sum())))
    dist.destroy_process_group()


def run(method: str, world: int, shape: tuple[int, int, int], port: int) -> tuple[float, float]:
    """The largest peak RSS above the inputs over the ranks (MiB) and the summed KL."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world, method, shape, port, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [q.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"{method} rank exited {p.exitcode}")
    return max(peak for _, peak, _ in got) / 1024, got[0][2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--world", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--port", type=int, default=29517)
    a = ap.parse_args(argv)
    shape = (a.tokens, a.vocab, a.hidden)
    print(machine())
    print(f"N = {a.tokens} tokens, V = {a.vocab:,}, H = {a.hidden}, float32")
    print("| ranks | gathered MiB/rank | klpo MiB/rank | klpo / gathered | sum KL rel. diff |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for i, world in enumerate(a.world):
        gathered, kl_g = run("gathered", world, shape, a.port + 2 * i)
        ours, kl_k = run("klpo", world, shape, a.port + 2 * i + 1)
        rel = abs(kl_k - kl_g) / max(abs(kl_g), 1e-30)
        print(f"| {world} | {gathered:,.0f} | {ours:,.0f} | {ours / gathered:.3f} | {rel:.1e} |")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
