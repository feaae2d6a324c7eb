"""The log-prob kernels on one device, for ``bench/gpu_check.py``: time, peak memory and error.

Forward + backward of a per-token weighted sum (random weights, the upstream gradient of each
token's output) from hidden states ``[N, H]`` and heads ``[V, H]`` in bf16, two cases: the
log-probs of the sampled tokens, and the exact KL(pi ‖ pi_ref) per token (the reference's hidden
states and head as inputs, no gradient). Methods:

- ``naive``: the float32 logits ``[N, V]`` and ``log_softmax`` (and the reference's for the KL),
  through autograd;
- ``klpo fused``: :func:`klpo.logprobs.fused`, the weighted sum taken outside, so its backward
  recomputes the logits tile by tile (any upstream gradient);
- ``klpo fused_loss``: :func:`klpo.logprobs.fused_loss`, the same sum as one loss, its gradient
  taken in the forward pass;
- ``liger``: Liger-Kernel's Triton kernels: ``LigerFusedLinearCrossEntropyLoss`` with
  ``reduction="none"`` (per-token -log p, so the same weighted sum; its backward recomputes the
  chunk's logits) for the log-probs, ``LigerFusedLinearJSD`` at ``jsd_beta=1`` (KL(policy ‖
  reference), a mean over tokens: the same work, no per-token output, its gradient taken in the
  forward pass) for the KL.

Timing: a warm-up each, then 5 rounds interleaved (A B C D A B C D ...), each call between device
synchronisations; the median [min, max] in ms. Peak memory: one more call of each, the device's
peak allocation over what was allocated before it (MiB; on a CPU, none). ``err``: max |error| of
the per-token output against float64 on the first 64 tokens.
"""

from __future__ import annotations

import statistics
import time

REPS = 5
CHECK = 64


def _inputs(n: int, h: int, v: int, device):
    import torch

    gen = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16
    hidden = torch.randn(n, h, generator=gen).to(device, bf16).requires_grad_(True)
    weight = (torch.randn(v, h, generator=gen) * h**-0.5 * 3).to(device, bf16).requires_grad_(True)
    tokens = torch.randint(0, v, (n,), generator=gen).to(device)
    coef = torch.randn(n, generator=gen).to(device)
    hidden_ref = (hidden.detach().float().cpu() + 0.3 * torch.randn(n, h, generator=gen)).to(
        device, bf16
    )
    weight_ref = (
        weight.detach().float().cpu() + 0.3 * h**-0.5 * torch.randn(v, h, generator=gen)
    ).to(device, bf16)
    return hidden, weight, tokens, coef, hidden_ref, weight_ref


def _methods(kind: str, hidden, weight, tokens, coef, hidden_ref, weight_ref) -> dict:
    """name -> a closure running forward + backward and returning the per-token output (or None)."""
    import torch

    import klpo.logprobs as lp

    kl = kind == "kl"
    ref = {"hidden_ref": hidden_ref, "weight_ref": weight_ref} if kl else {}

    def done(out):
        hidden.grad = weight.grad = None
        return None if out is None else out.detach()

    def naive():
        log_pi = torch.log_softmax((hidden @ weight.t()).float(), -1)
        if kl:
            with torch.no_grad():
                log_ref = torch.log_softmax((hidden_ref @ weight_ref.t()).float(), -1)
            out = (log_pi.exp() * (log_pi - log_ref)).sum(-1)
        else:
            out = log_pi.gather(1, tokens[:, None])[:, 0]
        (out * coef).sum().backward()
        return done(out)

    def fused():
        o = lp.fused(hidden, weight, tokens, **ref)
        out = o.kl if kl else o.logp
        (out * coef).sum().backward()
        return done(out)

    def fused_loss():
        w = {"kl_weight": coef} if kl else {"logp_weight": coef}
        o = lp.fused_loss(hidden, weight, tokens, **ref, **w)
        o.loss.backward()
        return done(o.kl if kl else o.logp)

    methods = {"naive": naive, "klpo fused": fused, "klpo fused_loss": fused_loss}
    try:
        methods["liger"] = _liger(kl, hidden, weight, tokens, coef, hidden_ref, weight_ref, done)
    except Exception as err:  # not installed, or no Triton driver (a CPU)
        methods["liger"] = f"{type(err).__name__}: {err}"[:160]
    return methods


def _liger(kl: bool, hidden, weight, tokens, coef, hidden_ref, weight_ref, done):
    if hidden.device.type != "cuda":
        raise RuntimeError("Liger-Kernel's Triton kernels need a GPU")
    if kl:
        from liger_kernel.transformers import LigerFusedLinearJSD

        jsd = LigerFusedLinearJSD(jsd_beta=1.0)

        def run():
            jsd(hidden, weight, hidden_ref, weight_ref).backward()
            return done(None)

        return run
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    ce = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def run():
        nll = ce(weight, hidden, tokens)  # per token: -log p
        (-nll * coef).sum().backward()
        return done(-nll)

    return run


def _reference(kind: str, hidden, weight, tokens, hidden_ref, weight_ref):
    import torch

    k = min(CHECK, hidden.shape[0])
    d = torch.float64
    log_pi = torch.log_softmax(
        hidden[:k].detach().cpu().to(d) @ weight.detach().cpu().to(d).t(), -1
    )
    if kind == "logp":
        return log_pi.gather(1, tokens[:k, None].cpu())[:, 0]
    log_ref = torch.log_softmax(hidden_ref[:k].cpu().to(d) @ weight_ref.cpu().to(d).t(), -1)
    return (log_pi.exp() * (log_pi - log_ref)).sum(-1)


def _case(kind: str, n: int, h: int, v: int, device) -> dict:
    """Every method of one case: median ms and range, peak MiB, max |error|."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    inputs = _inputs(n, h, v, device)
    hidden, weight, tokens, _, hidden_ref, weight_ref = inputs
    methods = _methods(kind, *inputs)
    runs = {m: f for m, f in methods.items() if callable(f)}
    out = {m: {"error": f} for m, f in methods.items() if not callable(f)}
    for m, f in list(runs.items()):  # warm-up (Triton compiles here); a failure is reported
        try:
            f()
        except Exception as err:
            out[m] = {"error": f"{type(err).__name__}: {err}"[:160]}
            del runs[m]
    times = {m: [] for m in runs}
    for _ in range(REPS):
        for m, f in runs.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times[m].append(1e3 * (time.perf_counter() - t0))
    ref = _reference(kind, hidden, weight, tokens, hidden_ref, weight_ref)
    for m, f in runs.items():
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        got = f()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
        err = None
        if got is not None:
            err = float((got[: len(ref)].cpu().double() - ref).abs().max())
        ts = times[m]
        out[m] = {"ms": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts),
                  "peak_mib": peak, "err": err}  # fmt: skip
    return out


def measure(n: int, h: int, v: int) -> dict:
    """Both cases on the first GPU (else the CPU), keyed by their title."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {}
    for kind in ("logp", "kl"):
        cases[f"{kind} N={n} H={h} V={v} bf16"] = _case(kind, n, h, v, device)
    return {"device": str(device), "cases": cases}
