"""The library and the trainer on a CUDA device, each against a naive float64 oracle on the CPU.

Skipped without a CUDA device. ``KLPO_TEST_DEVICE`` picks another device (``cpu`` runs the same
bodies on the CPU, a check of the tests themselves; ``cuda:1`` a second GPU).

Oracles: the naive float64 computation on the CPU (full logits, ``log_softmax``, gather) from the
same inputs as the device saw (bf16 inputs are rounded first, then upcast exactly), differentiated
by autograd; for the KL estimators, the same call in float64 on the CPU, itself checked against
closed forms in tests/test_kl.py. Tolerances come from the arithmetic's dtype, never tuned:

* klpo.logprobs computes in float32 whatever the inputs' dtype (bf16 is upcast exactly), so a
  value's error is a rounding error of float32 dot products of length H and sums of length V. By
  the probabilistic bound of Higham & Mary (SIAM J. Sci. Comput. 2019) it is at most
  ``λ √(H + V) u (sum of the magnitudes of the terms)`` with u = 2^-24, with probability at least
  ``1 - 2 exp(-λ²/2)`` (λ = 6: 3e-8): about 1e-5 relative to the logits' scale. The GEMMs are
  held to true float32 (no TF32, whose 10-bit mantissa would need a 2^-11 tolerance).
* A gradient entry sums such terms over V (or N) entries weighted by the head (or the hidden
  states), so its bound is the same relative error times ``|G| @ |W|``-like magnitude sums.
* Gradients returned in bf16 are rounded once more: plus 2^-8 of the exact value (bf16 keeps 8
  significant bits), which is why bf16 results agree to ~1e-2 relative and float32 ones to ~1e-5.
* The KL estimators compute in float64 on every device and round once to float32: 2^-24 relative
  (plus a 2^-44 margin for the devices' float64 libm differences).
* A soft cap ``x = cap tanh(z / cap) / T`` keeps the values' bound with the magnitudes of the
  uncapped ``z / T`` (``tanh' ≤ 1``); each gradient entry is ``G_x (1 - tanh²) / T`` with the
  slope formed from the rounded ``tanh`` (error at most ``2 (rel + u)``), so its bound is three
  times the uncapped one (tests/test_logprobs.py derives both).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from klpo import kl
from klpo import logprobs as lp
from klpo.train import setup as train_setup
from klpo.train.models.build import build_models

DEVICE = os.environ.get("KLPO_TEST_DEVICE", "cuda")

pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(),
    reason="no CUDA device (torch.cuda.is_available() is False); "
    "KLPO_TEST_DEVICE=cpu runs these tests on the CPU",
)

U32 = 2.0**-24
U_BF16 = 2.0**-8
LAMBDA = 6.0
# The devices' float64 exp/log/expm1 are within a few float64 ulps (2^-53) of each other, not
# bitwise equal: a margin of 2^-44 relative covers them with room and is 2^-20 of float32's u.
U64_SLACK = 2.0**-44
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _true_float32_gemms():
    """float32 GEMMs in float32 (TF32 off) for the tolerances above; the setting is restored."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def on_device(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(DEVICE).detach().requires_grad_(t.requires_grad)


def rounded64(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 CPU copy of what the device sees: rounded to ``dtype``, upcast exactly."""
    return t.detach().to(dtype).double().requires_grad_(True)


def assert_within(name: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    got = got.detach().double().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want.detach()).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{name}: error {err.flatten()[worst].item():.3g} > bound "
        f"{bound.flatten()[worst].item():.3g} at flat index {worst} "
        f"(value {got.flatten()[worst].item():.6g}, float64 oracle {want.flatten()[worst].item():.6g})"
    )


def naive(x: torch.Tensor, x_ref: torch.Tensor | None, tokens: torch.Tensor):
    """float64 logp, entropy, KL and log-softmaxes of scaled logits ``x [N, V]``."""
    log_pi = torch.log_softmax(x, -1)
    pi = log_pi.exp()
    logp = log_pi.gather(1, tokens[:, None])[:, 0]
    ent = -(pi * log_pi).sum(-1)
    log_ref = None if x_ref is None else torch.log_softmax(x_ref, -1)
    kl_ = None if x_ref is None else (pi * (log_pi - log_ref)).sum(-1)
    return logp, ent, kl_, log_pi, log_ref


def value_scale(x: torch.Tensor, x_ref: torch.Tensor | None) -> torch.Tensor:
    """Per token: the magnitude of the terms its values sum, ``2 (S + S_ref) + |L| + |L_ref| + 1``
    with ``S = max_v |x_v|`` and ``L = logsumexp(x)``."""
    x = x.detach()
    s = 2 * x.abs().amax(-1) + torch.logsumexp(x, -1).abs() + 1
    if x_ref is not None:
        x_ref = x_ref.detach()
        s = s + 2 * x_ref.abs().amax(-1) + torch.logsumexp(x_ref, -1).abs()
    return s


def grad_terms(
    g: torch.Tensor, log_pi: torch.Tensor, log_ref: torch.Tensor | None, rel: torch.Tensor
) -> torch.Tensor:
    """``[N, V]`` bound on the error of each entry of the logits' gradient ``g``: the relative error
    ``rel`` per token times the magnitude of the terms of ``g`` (``|g|``, and ``pi`` times the
    log-probabilities its formula multiplies)."""
    pi = log_pi.exp()
    mag = 1 + log_pi.abs()
    if log_ref is not None:
        mag = mag + log_ref.abs()
    return rel[:, None] * (g.abs() + pi * mag)


# ---------------------------------------------------------------------------------------------
# (a) fused: from hidden states and the head, several vocabulary chunks.


@pytest.mark.parametrize("cap", [None, 3.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("method", ["fused", "fused_loss"])
@pytest.mark.parametrize("grads", ["logp", "all"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_fused_values_and_gradients_match_float64(dtype_name, grads, method, cap):
    dtype = DTYPES[dtype_name]
    transform = None if cap is None else lp.LogitTransform.make(softcap=cap)
    n, h, v, temperature, chunk = 64, 32, 1000, 0.7, 256  # 4 vocabulary chunks, the last partial
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 1.5
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    bias = 0.3 * torch.randn(v, generator=g, dtype=torch.float64)
    hidden_ref = hidden + 0.3 * torch.randn(n, h, generator=g, dtype=torch.float64)
    weight_ref = weight + 0.1 * torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    tokens = torch.randint(0, v, (n,), generator=g)
    a, b, c = (torch.randn(n, generator=g, dtype=torch.float64).float().double() for _ in range(3))

    hd, wd, bd = (on_device(t.requires_grad_(True), dtype) for t in (hidden, weight, bias))
    up = [x.to(DEVICE, torch.float32) for x in (a, b, c)]
    common = dict(
        bias=bd,
        temperature=temperature,
        hidden_ref=on_device(hidden_ref, dtype),
        weight_ref=on_device(weight_ref, dtype),
        transform=transform,
        transform_ref=transform,
    )
    if method == "fused_loss":  # the gradient taken in the forward pass, 4 token chunks of 16
        out = lp.fused_loss(
            hd, wd, tokens.to(DEVICE), **common, logp_weight=up[0], with_entropy=True,
            entropy_weight=None if grads == "logp" else up[1],
            kl_weight=None if grads == "logp" else up[2], token_chunk=16,
        )  # fmt: skip
        loss = out.loss
    else:
        out = lp.fused(hd, wd, tokens.to(DEVICE), **common, vocab_chunk=chunk)
        if grads == "logp":  # the policy-gradient loss: the kernel's logp-only backward
            loss = (up[0] * out.logp).sum()
        else:
            loss = (up[0] * out.logp + up[1] * out.entropy + up[2] * out.kl).sum()
    assert out.logp.device.type == torch.device(DEVICE).type and out.logp.dtype == torch.float32
    loss.backward()

    h64, w64, b64 = (rounded64(t, dtype) for t in (hidden, weight, bias))
    hr64, wr64 = (rounded64(t, dtype).detach() for t in (hidden_ref, weight_ref))

    def capped(z: torch.Tensor) -> torch.Tensor:
        return z if cap is None else cap * torch.tanh(z / cap)

    z, z_ref = h64 @ w64.T + b64, hr64 @ wr64.T
    x = capped(z) / temperature
    x.retain_grad()
    x_ref = capped(z_ref) / temperature
    logp, ent, kl_, log_pi, log_ref = naive(x, x_ref, tokens)
    ref_loss = (a * logp).sum() if grads == "logp" else (a * logp + b * ent + c * kl_).sum()
    ref_loss.backward()

    rel = LAMBDA * math.sqrt(h + v) * U32 * value_scale(z / temperature, z_ref / temperature)
    assert_within("logp", out.logp, logp, rel)
    assert_within("entropy", out.entropy, ent, rel)
    assert_within("kl", out.kl, kl_, rel)

    # d loss / d x is x.grad; hidden, weight and bias get it through x = cap(h @ w.T + b) / T.
    terms = grad_terms(x.grad, log_pi, log_ref, rel) / temperature * (1 if cap is None else 3)
    bounds = {
        "grad hidden": (hd.grad, h64.grad, terms @ w64.detach().abs()),
        "grad weight": (wd.grad, w64.grad, terms.T @ h64.detach().abs()),
        "grad bias": (bd.grad, b64.grad, terms.sum(0)),
    }
    if dtype == torch.bfloat16 and torch.device(DEVICE).type == "cpu" and method == "fused":
        # On the CPU only (klpo.logprobs' notes): with a bf16 head and one token chunk the weight
        # gradient's GEMM takes G rounded to bf16, one more 2^-8 |G|^T |hidden|.
        g_abs = x.grad.abs() / temperature
        got, want, bound = bounds["grad weight"]
        bounds["grad weight"] = (got, want, bound + U_BF16 * g_abs.T @ h64.detach().abs())
    for name, (got, want, bound) in bounds.items():
        assert got.dtype == dtype, f"{name} is {got.dtype}, not the input's {dtype}"
        if dtype == torch.bfloat16:  # rounded once to bf16 at the end
            bound = bound + U_BF16 * want.abs()
        assert_within(f"{name} ({dtype_name})", got, want, bound)


# ---------------------------------------------------------------------------------------------
# (b) From logits: token_logprobs, entropy, exact_kl, in several row chunks.


@pytest.mark.parametrize("masked", [False, True], ids=["finite", "masked-vocab"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_logits_functions_match_float64(dtype_name, masked):
    dtype = DTYPES[dtype_name]
    bsz, t, v, temperature = 4, 16, 1000, 1.3
    rows = 10  # rows per chunk: 64 rows in 7 chunks
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(bsz, t, v, generator=g, dtype=torch.float64)
    logits_ref = logits + torch.randn(bsz, t, v, generator=g, dtype=torch.float64)
    keep = torch.ones(v, dtype=torch.bool)
    if masked:  # a masked vocabulary: -inf in both models at the same entries
        keep[torch.randperm(v, generator=g)[: v // 10]] = False
        logits[..., ~keep] = -math.inf
        logits_ref[..., ~keep] = -math.inf
    kept = keep.nonzero()[:, 0]
    tokens = kept[torch.randint(0, kept.numel(), (bsz, t), generator=g)]
    up = torch.randn(bsz, t, generator=g, dtype=torch.float64).float().double()

    ld = on_device(logits.requires_grad_(True), dtype)
    lrd = on_device(logits_ref, dtype)
    outs = {
        "token_logprobs": lp.token_logprobs(
            ld, tokens.to(DEVICE), temperature=temperature, row_chunk=rows
        ),
        "entropy": lp.entropy(ld, temperature=temperature, row_chunk=rows),
        "exact_kl": lp.exact_kl(ld, lrd, temperature=temperature, row_chunk=rows),
        "kl.full": kl.full(ld, lrd, temperature=temperature),  # its default chunks: one
    }

    # The oracle over the kept entries only: a masked entry has pi = 0 and gets 0 gradient.
    x = (rounded64(logits[..., kept], dtype) / temperature).reshape(-1, kept.numel())
    x_ref = (rounded64(logits_ref[..., kept], dtype).detach() / temperature).reshape(x.shape)
    logp, ent, kl_, log_pi, log_ref = naive(x, x_ref, torch.searchsorted(kept, tokens.reshape(-1)))
    want = {"token_logprobs": logp, "entropy": ent, "exact_kl": kl_, "kl.full": kl_}

    rel = LAMBDA * math.sqrt(v) * U32 * value_scale(x, x_ref)
    for name, got in outs.items():
        assert got.dtype == torch.float32 and got.shape == (bsz, t)
        assert_within(name, got.reshape(-1), want[name], rel)
        # Each function's gradient on its own: one rounding to the logits' dtype each.
        (grad,) = torch.autograd.grad((up.to(DEVICE, torch.float32) * got).sum(), ld)
        (g_x,) = torch.autograd.grad((up.reshape(-1) * want[name]).sum(), x, retain_graph=True)
        want_grad = torch.zeros(bsz * t, v, dtype=torch.float64)
        want_grad[:, kept] = g_x / temperature
        bound = torch.zeros_like(want_grad)
        bound[:, kept] = grad_terms(g_x, log_pi, log_ref, rel) / temperature
        if dtype == torch.bfloat16:
            bound = bound + U_BF16 * want_grad.abs()
        assert grad.dtype == dtype
        assert_within(f"{name}: gradient ({dtype_name})", grad.reshape(-1, v), want_grad, bound)
        if masked:
            assert bool((grad[..., ~keep.to(DEVICE)] == 0).all()), f"{name}: masked entries moved"


# ---------------------------------------------------------------------------------------------
# (c) The KL estimators: on the device as on the CPU in float64.


@pytest.mark.parametrize("name", kl.ESTIMATORS)
def test_kl_estimators_match_the_cpu_in_float64(name):
    bsz, t, v = 3, 17, 50
    g = torch.Generator().manual_seed(2)
    # log-ratios up to ±3: exp(±d) stays below e^3, far from the estimators' caps. Every input is
    # rounded to float32 first, so the device (float32 in) and the CPU (float64 in) see the same
    # numbers and only the arithmetic differs.
    logp = -torch.rand(bsz, t, generator=g, dtype=torch.float64) * 4 - 0.01
    inputs = [
        logp,
        logp + (torch.rand(bsz, t, generator=g, dtype=torch.float64) * 6 - 3),  # logp_ref
        logp + 0.3 * torch.randn(bsz, t, generator=g, dtype=torch.float64),  # logp_old
        2 * torch.randn(bsz, t, v, generator=g, dtype=torch.float64),  # logits
    ]
    inputs.append(inputs[3] + torch.randn(bsz, t, v, generator=g, dtype=torch.float64))
    inputs = [x.float().double() for x in inputs]
    mask = torch.rand(bsz, t, generator=g) < 0.8
    up = torch.randn(bsz, t, generator=g, dtype=torch.float64).float().double()

    def call(device: str, dtype: torch.dtype):
        ins = [x.to(device, dtype).requires_grad_(True) for x in inputs]
        out = kl.estimate(
            name,
            ins[0],
            ins[1],
            logp_old=ins[2],
            logits=ins[3],
            logits_ref=ins[4],
            mask=mask.to(device),
        )
        (up.to(device, out.dtype) * out).sum().backward()
        return out, [None if x.grad is None else x.grad.double().cpu() for x in ins]

    out, grads = call(DEVICE, torch.float32)
    assert out.dtype == torch.float32 and out.device.type == torch.device(DEVICE).type
    want, want_grads = call("cpu", torch.float64)
    want = want.detach()
    if name == "full":  # float32 arithmetic over the vocabulary, bounded as in the tests above
        x, x_ref = inputs[3].reshape(-1, v), inputs[4].reshape(-1, v)
        rel = LAMBDA * math.sqrt(v) * U32 * value_scale(x, x_ref)
        log_pi, log_ref = torch.log_softmax(x, -1), torch.log_softmax(x_ref, -1)
        bounds = {0: rel.reshape(bsz, t)}
        bounds[4] = grad_terms(want_grads[3].reshape(-1, v), log_pi, log_ref, rel).reshape(x.shape)
        bounds[4] = bounds[4].reshape(bsz, t, v)
    else:  # float64 arithmetic, rounded once to float32 (values and gradients alike)
        bounds = {0: U32 * want.abs() + U64_SLACK * (1 + want.abs())}
    assert_within(name, out, want, bounds[0])
    for i, (got, exp) in enumerate(zip(grads, want_grads, strict=True)):
        assert (got is None) == (exp is None), f"{name}: gradient of input {i} present on one side"
        if got is not None:
            b = bounds[4] if name == "full" else U32 * exp.abs() + U64_SLACK * (1 + exp.abs())
            assert_within(f"{name}: gradient of input {i}", got, exp, b)


# ---------------------------------------------------------------------------------------------
# (d) The trainer: two GRPO steps of the shipped model on the device.


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        {"kl.estimator": "full"},
        {"kl.estimator": "k3", "model.dtype": "bfloat16"},
    ],
    ids=["float32-full", "bf16-k3"],
)
def test_two_grpo_steps_run_on_the_device(tmp_path, monkeypatch, extra):
    from klpo.train import loop
    from klpo.train.config import build_config
    from klpo.train.runtime.metrics import read_metrics

    if torch.device(DEVICE).type == "cpu":  # the trainer takes CUDA whenever it is there
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    seen: list[torch.device] = []
    build = build_models

    def recording(*args, **kwargs):
        m = build(*args, **kwargs)
        seen.append(next(m.policy.parameters()).device)
        return m

    monkeypatch.setattr(train_setup, "build_models", recording)
    overrides = {
        "algo.name": "grpo",
        "run.out_dir": str(tmp_path / "run"),
        "run.steps": 2,
        "run.eval_every": 2,
        "run.save_every": 0,
        "run.threads": 1,
        "run.progress": False,
        "run.tensorboard": False,
        "data.eval_size": 8,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "kl.beta": 0.1,
        **extra,
    }
    loop.train(build_config(overrides=[f"{k}={v}" for k, v in overrides.items()]), log=print)
    assert [d.type for d in seen] == [torch.device(DEVICE).type]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    trained = [r for r in rows if "loss/total" in r]
    assert [r["step"] for r in trained] == [1, 2], [sorted(r) for r in rows]
    assert any("accuracy/heldout" in r for r in rows), "no held-out evaluation ran"
    for r in rows:
        for k, val in r.items():
            assert isinstance(val, (int, float)), f"step {r['step']}: {k} = {val!r}"
            assert math.isfinite(val), f"step {r['step']}: {k} = {val}"
    # The first update moved the policy: the second step sees a KL to the reference and a gradient.
    assert trained[0]["grad_norm"] > 0 and trained[1]["kl/ref/exact"] > 0
    assert any((tmp_path / "run").rglob("*.safetensors")), "no weights saved at the end of the run"
