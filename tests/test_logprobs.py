"""Tests for klpo.logprobs: values and gradients against naive float64 oracles, memory, errors.

Oracles: hand arithmetic, and a naive float64 implementation (full logits, log_softmax, gather)
differentiated by autograd. Tolerances are derived from the dtypes, never tuned:

* Every value is computed in float32 (unit roundoff u = 2^-24) from inputs that are exact in
  float32 (bf16 inputs are upcast exactly). Its error is a sum of rounding errors of dot products
  of length H, sums of length V and a few scalar operations, each bounded by the probabilistic
  bound of Higham & Mary (SIAM J. Sci. Comput. 2019): |error| ≤ λ √n u · (sum of |terms|), which
  holds with probability at least 1 - 2 exp(-λ²/2) per quantity; λ = 6 gives 3e-8. The |terms| are
  the logits' magnitudes, so the tolerance of a token's values is
  ``λ √(H + V) u (2 (S + S_ref) + |L| + |L_ref| + 1)`` with ``S = max_v (|h|·|w_v| + |b_v|) / T``
  (see :func:`value_tol`).
* A gradient is ``G @ W``-like: its error is the error of each entry of ``G`` (that of the values,
  times the entry's own terms) plus the accumulation over V (or N) terms, bounded componentwise with
  the float64 reference's absolute values (see :func:`grad_bound`).
* Gradients returned in bf16 are rounded once (unit roundoff 2^-8, so +2^-8 |reference|); with a
  bf16 head and one token chunk the weight gradient's GEMM takes ``G`` rounded to bf16 (+2^-8 ·
  ``|G|^T |h|``).
* A logit transform ``x = cap tanh(scale z / cap) / T`` (or ``scale z / T``): ``S`` is taken with
  the scale, ``S = scale max_v (|h|·|w_v| + |b_v|) / T``. Uncapped, the scale is one more factor of
  the GEMM's operand, so nothing else changes. Capped, the tile is ``t = (scale / cap) z`` (error
  ``δt ≤ λ √H u (T / cap) S``, at most ``tol`` when ``T ≤ 2 cap``, as in every case here), then
  ``tanh`` and the factor ``cap / T`` (``tanh' ≤ 1``: the error of ``x`` stays ``≤ λ √H u S`` plus
  three roundings of ``|x| ≤ S``, inside the ``λ √(H + V)`` factor). The gradient's entries are
  ``G_x · dx/dz`` with ``dx/dz = (scale / T)(1 - tanh²)`` formed from the rounded ``tanh``: its error
  is at most ``(scale / T) · 2 (δt + u)``, so a capped entry's bound is ``(3 tol + acc + 2u) |G_x|
  scale / T`` against the uncapped ``(tol + acc) |G_x| scale / T``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from klpo import fused_kernel as fk
from klpo import gemm
from klpo import logprobs as lp
from klpo._logits import affine
from klpo.logprobs import LogitTransform

U32 = 2.0**-24
U_BF16 = 2.0**-8
LAMBDA = 6.0


# ---------------------------------------------------------------------------------------------
# Hand-computed values.


def test_hand_values_from_logits_and_from_hidden_states():
    # logits [0, ln 2, ln 5]: pi = [1, 2, 5] / 8
    logits = torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    # log pi(2) = ln(5/8) = -0.4700036
    logp = -0.4700036292457356
    # entropy = (1/8) ln 8 + (2/8) ln 4 + (5/8) ln(8/5) = 0.2599302 + 0.3465736 + 0.2937523
    ent = 0.9002560512685369
    # against the uniform pi_ref = 1/3: KL = sum pi ln(3 pi) = ln 3 - entropy = 1.0986123 - 0.9002561
    kl_uniform = math.log(3.0) - ent
    assert lp.token_logprobs(logits, torch.tensor([2])).item() == pytest.approx(logp, rel=1e-6)
    assert lp.entropy(logits).item() == pytest.approx(ent, rel=1e-6)
    assert lp.exact_kl(logits, torch.zeros(1, 3)).item() == pytest.approx(kl_uniform, rel=1e-5)
    # The same distribution as hidden [1] (H = 1) times the head [[0], [ln 2], [ln 5]].
    out = lp.fused(
        torch.ones(1, 1),
        logits.t().contiguous(),
        torch.tensor([2]),
        hidden_ref=torch.ones(1, 1),
        weight_ref=torch.zeros(3, 1),
    )
    assert out.logp.item() == pytest.approx(logp, rel=1e-6)
    assert out.entropy.item() == pytest.approx(ent, rel=1e-6)
    assert out.kl.item() == pytest.approx(kl_uniform, rel=1e-5)
    # temperature 2 halves the logits: pi ∝ [1, √2, √5] = [1, 1.4142136, 2.2360680] / 4.6502815,
    # so log pi(2) = ln 2.2360680 - ln 4.6502815 = 0.8047190 - 1.5369188 = -0.7321998
    warm = lp.token_logprobs(logits, torch.tensor([2]), temperature=2.0)
    assert warm.item() == pytest.approx(0.5 * math.log(5) - math.log(1 + 2**0.5 + 5**0.5), rel=1e-6)


def test_default_vocab_chunk():
    # 2^21 / tokens, rounded down to a power of 2 and clamped to [512, 8192]
    assert lp.default_vocab_chunk(1024) == 2048
    assert lp.default_vocab_chunk(512) == 4096
    assert lp.default_vocab_chunk(256) == 8192
    assert lp.default_vocab_chunk(700) == 2048  # 2^21 / 700 = 2995 -> 2048
    assert lp.default_vocab_chunk(8192) == 512  # 256, clamped
    assert lp.default_vocab_chunk(1) == 8192
    assert lp.default_vocab_chunk(0) == 8192


# ---------------------------------------------------------------------------------------------
# The float64 oracle and the derived tolerances.


@dataclass
class Problem:
    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V, H]
    bias: torch.Tensor | None
    tokens: torch.Tensor
    hidden_ref: torch.Tensor | None
    weight_ref: torch.Tensor | None
    bias_ref: torch.Tensor | None
    temperature: float
    upstream: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # d loss / d (logp, entropy, kl)
    transform: LogitTransform | None = None
    transform_ref: LogitTransform | None = None


def apply(transform: LogitTransform | None, z: torch.Tensor) -> torch.Tensor:
    """The model's logits from its head's output, in float64 (the oracle's transform)."""
    if transform is None:
        return z
    u = z * transform.scale
    return u if transform.softcap is None else transform.softcap * torch.tanh(u / transform.softcap)


def transform_scale(transform: LogitTransform | None) -> float:
    return 1.0 if transform is None else transform.scale


def capped(transform: LogitTransform | None) -> bool:
    return transform is not None and transform.softcap is not None


def make_problem(
    n, h, v, *, dtype, temperature=1.0, bias=False, ref=True, seed=0, transform=None
) -> Problem:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    # Logits with a spread of a few nats, like a trained head.
    scale = 2.0 / math.sqrt(h)
    return Problem(
        hidden=rand(n, h),
        weight=rand(v, h, scale=scale),
        bias=rand(v) if bias else None,
        tokens=torch.randint(0, v, (n,), generator=gen),
        hidden_ref=rand(n, h) if ref else None,
        weight_ref=rand(v, h, scale=scale) if ref else None,
        bias_ref=rand(v, scale=0.5) if ref and bias else None,
        temperature=temperature,
        upstream=tuple(torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(3)),
        transform=transform,
        transform_ref=transform if ref else None,
    )


def naive(p: Problem):
    """Float64 full logits, log_softmax, gather; values and autograd gradients."""
    h = p.hidden.detach().double().requires_grad_(True)
    w = p.weight.detach().double().requires_grad_(True)
    b = None if p.bias is None else p.bias.detach().double().requires_grad_(True)
    x = apply(p.transform, h @ w.t() + (0 if b is None else b)) / p.temperature
    log_pi = torch.log_softmax(x, -1)
    pi = log_pi.exp()
    logp = log_pi.gather(1, p.tokens[:, None])[:, 0]
    ent = -(pi * log_pi).sum(-1)
    kl = log_pi_ref = log_z_ref = None
    if p.hidden_ref is not None:
        x_ref = p.hidden_ref.double() @ p.weight_ref.double().t()
        if p.bias_ref is not None:
            x_ref = x_ref + p.bias_ref.double()
        x_ref = apply(p.transform_ref, x_ref) / p.temperature
        log_pi_ref, log_z_ref = torch.log_softmax(x_ref, -1), torch.logsumexp(x_ref, -1)
        kl = (pi * (log_pi - log_pi_ref)).sum(-1)
    a, c, d = p.upstream
    loss = (a * logp).sum() + (c * ent).sum() + (0 if kl is None else (d * kl).sum())
    inputs = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(loss, inputs)
    out = {"logp": logp, "entropy": ent, "kl": kl, "grad_hidden": grads[0], "grad_weight": grads[1]}
    out["grad_bias"] = grads[2] if b is not None else None
    out["log_pi"], out["log_pi_ref"] = log_pi.detach(), log_pi_ref
    out["log_z"], out["log_z_ref"] = torch.logsumexp(x, -1), log_z_ref
    return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def logit_scale(hidden, weight, bias, temperature):
    """S_i = max_v (|h_i|·|w_v| + |b_v|) / T, in float64: the size of the terms of a logit."""
    s = hidden.abs().double() @ weight.abs().double().t()
    if bias is not None:
        s = s + bias.abs().double()
    return s.max(-1).values / temperature


def value_tol(p: Problem, ref: dict) -> torch.Tensor:
    """λ √(H + V) u (2 (S + S_ref) + |L| + |L_ref| + 1), per token (see the module notes)."""
    h, v = p.hidden.shape[1], p.weight.shape[0]
    s = logit_scale(p.hidden, p.weight, p.bias, p.temperature) * transform_scale(p.transform)
    m = 2 * s + ref["log_z"].abs() + 1
    if p.hidden_ref is not None:
        s_ref = logit_scale(p.hidden_ref, p.weight_ref, p.bias_ref, p.temperature)
        m = m + 2 * s_ref * transform_scale(p.transform_ref) + ref["log_z_ref"].abs()
    return LAMBDA * math.sqrt(h + v) * U32 * m


def g_hat(p: Problem, ref: dict) -> torch.Tensor:
    """|terms| of G at each (token, vocab) entry, from the float64 reference: ``[N, V]``."""
    a, c, d = (t.abs()[:, None] for t in p.upstream)
    log_pi = ref["log_pi"]
    pi = log_pi.exp()
    onehot = torch.zeros_like(pi).scatter_(1, p.tokens[:, None], 1.0)
    terms = 2 + log_pi.abs() + ref["entropy"][:, None]
    coef = a + c
    if ref["kl"] is not None:
        terms = terms + ref["log_pi_ref"].abs() + ref["kl"][:, None]
        coef = coef + d
    return a * onehot + coef * pi * terms


def grad_bound(p: Problem, ref: dict, tol: torch.Tensor, bf16_weight_gemm: bool) -> dict:
    """Componentwise bounds on the gradients' errors (see the module notes)."""
    n, v = len(p.tokens), p.weight.shape[0]
    g = g_hat(p, ref) * transform_scale(p.transform) / p.temperature  # |G_x| times max dx/dz
    acc = LAMBDA * math.sqrt(v + n) * U32  # the gradients' own accumulation
    if capped(p.transform):  # the slope's own error (module notes)
        err_g = (3 * tol[:, None] + acc + 2 * U32) * g
    else:
        err_g = (tol[:, None] + acc) * g
    bound = {
        "grad_hidden": err_g @ p.weight.abs().double(),
        "grad_weight": err_g.t() @ p.hidden.abs().double(),
        "grad_bias": err_g.sum(0) if p.bias is not None else None,
    }
    for name, t in (("grad_hidden", p.hidden), ("grad_weight", p.weight), ("grad_bias", p.bias)):
        if t is not None and t.dtype == torch.bfloat16:
            bound[name] = bound[name] + U_BF16 * ref[name].abs()  # the final rounding
    if bf16_weight_gemm:
        bound["grad_weight"] = bound["grad_weight"] + U_BF16 * (g.t() @ p.hidden.abs().double())
    return bound


def assert_within(name, got, want, bound):
    err = (got.double() - want).abs()
    worst = float((err / bound).max().detach())
    assert worst <= 1.0, f"{name}: error {float(err.max()):.3e} exceeds its bound by {worst:.2f}x"


def run_fused(p: Problem, **kw):
    leaves = [p.hidden, p.weight] + ([p.bias] if p.bias is not None else [])
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    hidden, weight = leaves[0], leaves[1]
    bias = leaves[2] if p.bias is not None else None
    out = lp.fused(
        hidden,
        weight,
        p.tokens,
        bias=bias,
        temperature=p.temperature,
        hidden_ref=p.hidden_ref,
        weight_ref=p.weight_ref,
        bias_ref=p.bias_ref,
        transform=p.transform,
        transform_ref=p.transform_ref,
        **kw,
    )
    a, c, d = (u.float() for u in p.upstream)
    loss = (a * out.logp).sum() + (c * out.entropy).sum()
    if out.kl is not None:
        loss = loss + (d * out.kl).sum()
    grads = torch.autograd.grad(loss, leaves)
    return out, dict(zip(["grad_hidden", "grad_weight", "grad_bias"], grads, strict=False))


# (N, H, V, token_chunk, vocab_chunk): ragged tails in both chunk dimensions, one token chunk
# (where a bf16 head takes the bf16 weight-gradient GEMM), one vocabulary chunk, chunks of 1.
SHAPES = [
    (37, 24, 301, 8, 64),
    (29, 16, 517, 4096, 100),
    (6, 8, 50, 1, 7),
    (12, 32, 200, 5, 4096),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("temperature", "bias"), [(1.0, False), (0.7, True)])
def test_fused_matches_float64_naive(dtype, shape, temperature, bias):
    n, h, v, token_chunk, vocab_chunk = shape
    p = make_problem(n, h, v, dtype=dtype, temperature=temperature, bias=bias)
    out, grads = run_fused(p, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    ref = naive(p)
    tol = value_tol(p, ref)
    for name in ("logp", "entropy", "kl"):
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == (n,)
        assert_within(name, got, ref[name], tol)
    bf16_gemm = dtype == torch.bfloat16 and n <= token_chunk and gemm.ONEDNN
    bound = grad_bound(p, ref, tol, bf16_gemm)
    for name, got in grads.items():
        assert got.dtype == dtype
        assert_within(name, got, ref[name], bound[name])


def test_fused_float32_error_is_well_under_1e_4():
    # The bar, norm-wise: float32 relative errors well under 1e-4 (here: < 1e-5).
    p = make_problem(64, 32, 1000, dtype=torch.float32, temperature=0.8, bias=True)
    out, grads = run_fused(p, token_chunk=16, vocab_chunk=128)
    ref = naive(p)
    for name, got in [*((k, getattr(out, k)) for k in ("logp", "entropy", "kl")), *grads.items()]:
        rel = float((got.detach().double() - ref[name]).norm() / ref[name].norm())
        assert rel < 1e-5, (name, rel)


def test_fused_batch_time_shapes_and_without_reference():
    p = make_problem(12, 16, 97, dtype=torch.float32, ref=False)
    out, _ = run_fused(p, vocab_chunk=32)
    assert out.kl is None
    ref = naive(p)
    hidden = p.hidden.view(3, 4, 16)
    out3 = lp.fused(hidden, p.weight, p.tokens.view(3, 4), vocab_chunk=32)
    assert out3.logp.shape == (3, 4) and out3.entropy.shape == (3, 4)
    tol = value_tol(p, ref).view(3, 4)
    assert_within("logp", out3.logp, ref["logp"].view(3, 4), tol)
    no_ent = lp.fused(p.hidden, p.weight, p.tokens, with_entropy=False)
    assert no_ent.entropy is None
    torch.testing.assert_close(no_ent.logp, out.logp, rtol=0, atol=float(tol.max()))


def test_fused_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    n, h, v = 5, 3, 11
    hidden = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden_ref = torch.randn(n, 2, dtype=torch.float64, generator=gen)  # H_ref != H
    weight_ref = torch.randn(v, 2, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)

    def f(hidden, weight, bias):
        out = lp.fused(
            hidden,
            weight,
            tokens,
            bias=bias,
            temperature=0.9,
            hidden_ref=hidden_ref,
            weight_ref=weight_ref,
            token_chunk=2,
            vocab_chunk=4,
        )
        return out.logp, out.entropy, out.kl

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_reference_is_detached():
    p = make_problem(7, 8, 40, dtype=torch.float32, bias=True)
    hidden_ref = p.hidden_ref.clone().requires_grad_(True)
    weight_ref = p.weight_ref.clone().requires_grad_(True)
    bias_ref = p.bias_ref.clone().requires_grad_(True)
    hidden = p.hidden.clone().requires_grad_(True)
    out = lp.fused(
        hidden, p.weight, p.tokens, hidden_ref=hidden_ref, weight_ref=weight_ref, bias_ref=bias_ref
    )
    out.kl.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert hidden_ref.grad is None and weight_ref.grad is None and bias_ref.grad is None
    logits = torch.randn(3, 6, requires_grad=True)
    logits_ref = torch.randn(3, 6, requires_grad=True)
    lp.exact_kl(logits, logits_ref).sum().backward()
    assert logits.grad is not None and logits_ref.grad is None


def test_masked_tokens_get_exactly_zero_gradient():
    p = make_problem(10, 8, 60, dtype=torch.float32)
    hidden = p.hidden.clone().requires_grad_(True)
    out = lp.fused(hidden, p.weight, p.tokens, hidden_ref=p.hidden_ref, weight_ref=p.weight_ref)
    mask = torch.arange(10) % 3 != 0
    loss = torch.where(mask, out.logp + out.entropy + out.kl, 0.0).sum()
    loss.backward()
    assert torch.equal(hidden.grad[~mask], torch.zeros_like(hidden.grad[~mask]))
    assert (hidden.grad[mask].abs().sum(-1) > 0).all()


def max_pass_tiles(fn):
    """``fn()`` and the number of tiles the overflow fallback's max pass read in it: one ``amax``
    each (``klpo.fused_kernel.HeadTiles.row_max``; nothing else in :func:`klpo.logprobs.fused`
    takes one), counted by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        value = fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::amax"), value


def test_overflow_falls_back_to_the_max():
    # Target logit -100 and a logit of +50 in a later vocabulary chunk: exp(x - x_y) = exp(150)
    # overflows float32, so the token is redone with the max as reference. Also for the reference.
    v = 300
    weight = torch.zeros(v, 1)
    weight[0] = -100.0
    weight[250] = 50.0
    weight[1:250, 0] = torch.linspace(-3, 3, 249)
    hidden = torch.ones(4, 1, requires_grad=True)
    tokens = torch.tensor([0, 250, 7, 0])
    weight_ref = weight.flip(0).clone()  # the reference puts +50 on token 49 and -100 on 299
    p = Problem(hidden.detach(), weight, None, tokens, hidden.detach(), weight_ref, None, 1.0,
                (torch.ones(4, dtype=torch.float64),) * 3)  # fmt: skip
    passes, (out, grads) = max_pass_tiles(lambda: run_fused(p, vocab_chunk=64))
    # The fallback ran once, for the policy and for the reference: one max pass over the 5
    # vocabulary tiles each; a head whose logits stay within ~88 of the target's takes none.
    assert passes == 2 * 5
    tame = Problem(
        **{**p.__dict__, "weight": weight.clamp(-3, 3), "weight_ref": weight_ref.clamp(-3, 3)}
    )
    assert max_pass_tiles(lambda: run_fused(tame, vocab_chunk=64))[0] == 0
    ref = naive(p)
    assert out.logp[0].item() == pytest.approx(-150.0, rel=1e-6)
    tol = value_tol(p, ref)
    for name in ("logp", "entropy", "kl"):
        assert torch.isfinite(getattr(out, name)).all()
        assert_within(name, getattr(out, name), ref[name], tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in grads.items():
        assert_within(name, got, ref[name], bound[name])


def test_onednn_and_torch_mm_agree():
    p = make_problem(20, 16, 150, dtype=torch.float32, bias=True)
    out, grads = run_fused(p, token_chunk=8, vocab_chunk=64)
    all_mm = gemm.Plan("mm", "mm", "mm", False)
    out_mm, grads_mm = run_fused(p, token_chunk=8, vocab_chunk=64, plan=all_mm)
    ref = naive(p)
    tol = value_tol(p, ref)
    assert_within("logp", out.logp, out_mm.logp.double(), 2 * tol)
    bound = grad_bound(p, ref, tol, False)
    for name in grads:
        assert_within(name, grads[name], grads_mm[name].double(), 2 * bound[name])


PLANS = [
    gemm.Plan(*roles, False)
    for roles in itertools.product(["mm", "onednn"] if gemm.ONEDNN else ["mm"], repeat=3)
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: "-".join(p[:3]))
def test_fused_matches_float64_naive_on_every_gemm_plan(plan):
    """Whichever backends the measured plan picks on a machine, the results are the same: each mix
    against float64 naive, with one and with several token chunks (the written and the accumulated
    weight gradient) and several vocabulary chunks."""
    p = make_problem(37, 24, 301, dtype=torch.float32, temperature=0.7, bias=True)
    ref = naive(p)
    tol = value_tol(p, ref)
    bound = grad_bound(p, ref, tol, False)
    for token_chunk in (8, 4096):
        out, grads = run_fused(p, token_chunk=token_chunk, vocab_chunk=64, plan=plan)
        for name in ("logp", "entropy", "kl"):
            assert_within(name, getattr(out, name), ref[name], tol)
        for name, got in grads.items():
            assert_within(name, got, ref[name], bound[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("temperature", "bias"), [(1.0, False), (0.7, True)])
@pytest.mark.parametrize("backend", ["mm", "onednn"] if gemm.ONEDNN else ["mm"])
def test_fused_logp_only_gradient_matches_float64_naive(dtype, shape, temperature, bias, backend):
    """Only logp has a gradient (the policy-gradient loss): the backward that takes the per-token
    coefficient out of the tiles, on both backends, against float64 naive."""
    n, h, v, token_chunk, vocab_chunk = shape
    p = make_problem(n, h, v, dtype=dtype, temperature=temperature, bias=bias, ref=False)
    p.upstream = (p.upstream[0], torch.zeros(n, dtype=torch.float64), p.upstream[2])
    ref = naive(p)  # d loss / d entropy = 0: the gradients of sum a * logp alone
    leaves = [
        t.detach().requires_grad_(True) for t in (p.hidden, p.weight, p.bias) if t is not None
    ]
    out = lp.fused(
        leaves[0],
        leaves[1],
        p.tokens,
        bias=leaves[2] if bias else None,
        temperature=temperature,
        with_entropy=False,
        token_chunk=token_chunk,
        vocab_chunk=vocab_chunk,
        plan=gemm.Plan(backend, backend, backend, False),
    )
    assert out.entropy is None and out.kl is None
    a = p.upstream[0].to(out.logp.dtype)
    grads = torch.autograd.grad((a * out.logp).sum(), leaves)
    tol = value_tol(p, ref)
    assert_within("logp", out.logp, ref["logp"], tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in zip(["grad_hidden", "grad_weight", "grad_bias"], grads, strict=False):
        assert got.dtype == dtype
        assert_within(name, got, ref[name], bound[name])


def test_fused_logp_only_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(23, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(23, dtype=torch.float64, generator=gen, requires_grad=True)
    tokens = torch.tensor([0, 22, 5, 5, 11, 3, 22])

    def f(h, w, b):
        return lp.fused(
            h, w, tokens, bias=b, temperature=0.8, with_entropy=False, token_chunk=3, vocab_chunk=6
        ).logp

    # The first backward pass takes the kept tiles, gradcheck's second recomputes them: they
    # differ by float64 rounding (nondet_tol).
    assert torch.autograd.gradcheck(f, (h, w, b), nondet_tol=1e-12)


# ---------------------------------------------------------------------------------------------
# What fused's forward pass keeps for a log-prob-only backward pass (klpo.fused_kernel.saving).


def kept_by(out) -> str:
    """The saving a fused call's forward pass kept (``klpo.fused_kernel.SAVINGS``' row), read from
    its autograd node: the tiles it holds, and its saved tensors ``(9 inputs and log Z's,
    entropy, kl, 1 / s, unit)``."""
    node = out.logp.grad_fn
    while not hasattr(node, "saved_tensors"):  # the view of the [N] output, then fused's node
        node = node.next_functions[0][0]
    tiles, unit = node.tiles, node.saved_tensors[12]
    kept = [t for t in tiles or () if t is not None]
    assert not (kept and unit is not None)
    return "tiles" if kept else "unit" if unit is not None else "recompute"


def kept_tiles(out) -> list:
    """The tiles a fused call's forward pass holds for its backward pass (None: one past the
    budget, to be recomputed)."""
    return out.logp.grad_fn.next_functions[0][0].tiles  # fused's node, under the output's view


@pytest.fixture
def keep_per_weight(monkeypatch):
    """Set ``klpo.fused_kernel.KEEP_PER_WEIGHT`` for one test (the CPU's keep-every-tile rule
    off, so that the budget is that many floats per weight here too)."""

    def set_to(value: float) -> None:
        monkeypatch.setattr(fk, "KEEP_PER_WEIGHT", value)
        monkeypatch.setattr(fk, "KEEP_ALL_ON_CPU", False)

    return set_to


def logp_only_call(p: Problem, frozen: bool, with_entropy: bool, **kw):
    """``fused`` on ``p``'s policy alone with grad on hidden (and on weight and bias unless
    ``frozen``), its output and the gradients of ``sum a logp`` (None for a frozen leaf)."""
    hidden = p.hidden.detach().requires_grad_(True)
    weight = p.weight.detach().requires_grad_(not frozen)
    bias = None if p.bias is None else p.bias.detach().requires_grad_(not frozen)
    out = lp.fused(
        hidden, weight, p.tokens, bias=bias, temperature=p.temperature,
        with_entropy=with_entropy, **kw,
    )  # fmt: skip
    kept = kept_by(out)
    (p.upstream[0].to(out.logp.dtype) * out.logp).sum().backward()
    grads = {"grad_hidden": hidden.grad, "grad_weight": weight.grad}
    grads["grad_bias"] = None if bias is None else bias.grad
    return out, grads, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("frozen", [False, True], ids=["head-grad", "frozen-head"])
@pytest.mark.parametrize("keep", ["all", "part", "none"])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_fused_logp_only_saving_matches_float64_naive(
    keep_per_weight, dtype, shape, frozen, keep, with_entropy
):
    """Every row of the saving rule, with budgets that hold every tile, about half of them (the
    rest recomputed) and less than one: a head with a gradient keeps the tiles the budget holds,
    in loop order, and recomputes the rest (all of them under a budget below one tile), a frozen
    head keeps ``pi @ W`` whatever the budget; the values and the gradients of ``sum a logp`` are
    float64 naive's within the same bounds as the recomputing kernel's."""
    n, h, v, token_chunk, vocab_chunk = shape
    keep_per_weight({"all": (n + 0.5) / h, "part": n / 2 / h, "none": 0.0}[keep])
    p = make_problem(n, h, v, dtype=dtype, temperature=0.7, bias=True, ref=False)
    p.upstream = (p.upstream[0], torch.zeros(n, dtype=torch.float64), p.upstream[2])
    ref = naive(p)  # d loss / d entropy = 0: the gradients of sum a * logp alone
    call = lambda: logp_only_call(  # noqa: E731
        p, frozen, with_entropy, token_chunk=token_chunk, vocab_chunk=vocab_chunk
    )
    if not frozen and keep != "none":  # which tiles the budget held, before the backward pass
        hidden = p.hidden.detach().requires_grad_(True)
        weight = p.weight.detach().requires_grad_(True)
        tiles = kept_tiles(lp.fused(hidden, weight, p.tokens, token_chunk=token_chunk,
                                    vocab_chunk=vocab_chunk, with_entropy=with_entropy))  # fmt: skip
        held = [t is not None for t in tiles]
        assert len(tiles) == math.ceil(v / vocab_chunk) * math.ceil(n / token_chunk)
        assert sum(t.numel() for t in tiles if t is not None) <= fk.keep_budget(v, h)
        assert all(held) if keep == "all" else (any(held) and not all(held))
    out, grads, kept = call()
    assert kept == ("unit" if frozen else "recompute" if keep == "none" else "tiles")
    tol = value_tol(p, ref)
    assert_within("logp", out.logp, ref["logp"], tol)
    if with_entropy:
        assert_within("entropy", out.entropy, ref["entropy"], tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in grads.items():
        if frozen and name != "grad_hidden":
            assert got is None
            continue
        assert got.dtype == dtype
        assert_within(name, got, ref[name], bound[name])


@pytest.mark.parametrize("frozen", [False, True], ids=["head-grad", "frozen-head"])
def test_a_saving_left_unused_when_the_entropy_gets_a_gradient(keep_per_weight, frozen):
    """A saving serves only ``logp``'s gradient: with the entropy's too the backward pass
    recomputes the tiles, and every gradient is float64 naive's."""
    keep_per_weight(100.0)
    p = make_problem(37, 24, 301, dtype=torch.float32, temperature=0.7, bias=True, ref=False)
    ref = naive(p)
    hidden = p.hidden.detach().requires_grad_(True)
    weight = p.weight.detach().requires_grad_(not frozen)
    bias = p.bias.detach().requires_grad_(not frozen)
    out = lp.fused(hidden, weight, p.tokens, bias=bias, temperature=0.7, vocab_chunk=64)
    assert kept_by(out) == ("unit" if frozen else "tiles")
    a, c = (u.float() for u in p.upstream[:2])
    ((a * out.logp).sum() + (c * out.entropy).sum()).backward()
    tol = value_tol(p, ref)
    bound = grad_bound(p, ref, tol, False)
    assert_within("grad_hidden", hidden.grad, ref["grad_hidden"], bound["grad_hidden"])
    if not frozen:
        assert_within("grad_weight", weight.grad, ref["grad_weight"], bound["grad_weight"])
        assert_within("grad_bias", bias.grad, ref["grad_bias"], bound["grad_bias"])


def test_a_cpu_keeps_every_tile(monkeypatch):
    """On a CPU (KEEP_ALL_ON_CPU) the budget holds every row's logits, however small the head:
    a tile of 8 tokens by 10 entries past a 30 x 1 head's 30 weights is kept; elsewhere it is the
    head's size."""
    monkeypatch.setattr(fk, "KEEP_PER_WEIGHT", 1.0)
    monkeypatch.setattr(fk, "KEEP_ALL_ON_CPU", True)
    assert fk.keep_budget(30, 1, 8, "cpu") == 240 and fk.keep_budget(30, 1, 8, "cuda") == 30
    assert fk.keep_budget(30, 100, 8, "cpu") == 3000  # the head's size where it is larger
    p = make_problem(8, 1, 30, dtype=torch.float32, bias=False)
    plan = gemm.Plan("mm", "mm", "mm", False)
    head = fk.HeadTiles(
        p.hidden, p.weight, None, affine(None, 1.0, "transform"), torch.float32, plan
    )
    assert fk.saving(head, None, (True, True, False), (4096, 10)) == "tiles"
    monkeypatch.setattr(fk, "KEEP_ALL_ON_CPU", False)
    assert fk.saving(head, None, (True, True, False), (4096, 10)) == "recompute"


def test_the_saving_rule(keep_per_weight):
    """``saving``'s rows (klpo.fused_kernel.SAVINGS): nothing without a gradient, a reference or a
    soft cap; ``pi @ W`` for a frozen head; the tiles for a head with a gradient where the budget
    (KEEP_PER_WEIGHT per weight of the head) holds one tile, and none where it does not."""
    p = make_problem(8, 4, 30, dtype=torch.float32, bias=True)
    plan = gemm.Plan("mm", "mm", "mm", False)
    plain = affine(None, 1.0, "transform")
    cap = affine(LogitTransform.make(softcap=30.0), 1.0, "transform")

    def head(transform=plain):
        return fk.HeadTiles(p.hidden, p.weight, p.bias, transform, torch.float32, plan)

    ref = fk.HeadTiles(p.hidden_ref, p.weight_ref, p.bias_ref, plain, torch.float32, plan)
    chunks = (4096, 10)  # tiles of 8 tokens by 10 entries: 80 floats, the budget 1.0 * 30 * 4
    rows = [
        ((head(), None, (False, False, False)), "recompute"),  # no gradient (or no_grad)
        ((head(), None, (True, True, True)), "tiles"),
        ((head(), None, (False, True, False)), "tiles"),  # the head alone
        ((head(), None, (False, False, True)), "tiles"),  # the bias alone
        ((head(), None, (True, False, False)), "unit"),  # a frozen head
        ((head(), ref, (True, True, True)), "recompute"),  # the KL
        ((head(), ref, (True, False, False)), "recompute"),
        ((head(cap), None, (True, True, True)), "recompute"),  # a soft cap
        ((head(cap), None, (True, False, False)), "recompute"),
    ]
    keep_per_weight(1.0)
    assert fk.keep_budget(30, 4) == 120 == fk.keep_budget(30, 4, 8, "cpu")
    for args, want in rows:
        assert fk.saving(*args, chunks) == want, (args[2], want)
    keep_per_weight(80 / 120)  # the budget holds one tile exactly
    assert fk.saving(head(), None, (True, True, False), chunks) == "tiles"
    keep_per_weight(79 / 120)  # not one
    assert fk.saving(head(), None, (True, True, False), chunks) == "recompute"
    assert fk.saving(head(), None, (True, False, False), chunks) == "unit"


def test_nothing_is_kept_without_a_graph(monkeypatch):
    """Under ``torch.no_grad`` (a scoring pass) the rule is asked with no gradient needed, even
    for leaves that require one, and keeps nothing."""
    asked = []
    rule = fk.saving

    def spy(pol, ref, needs, chunks):
        asked.append((needs, rule(pol, ref, needs, chunks)))
        return asked[-1][1]

    monkeypatch.setattr(fk, "saving", spy)
    p = make_problem(6, 8, 50, dtype=torch.float32, ref=False)
    hidden = p.hidden.requires_grad_(True)
    weight = p.weight.requires_grad_(True)
    with torch.no_grad():
        lp.fused(hidden, weight, p.tokens)
    out = lp.fused(hidden, weight, p.tokens)
    assert asked == [((False, False, False), "recompute"), ((True, True, False), "tiles")]
    assert kept_by(out) == "tiles"


@pytest.mark.parametrize("frozen", [False, True], ids=["head-grad", "frozen-head"])
def test_a_saving_is_dropped_where_a_token_overflowed(frozen):
    """A token whose ``exp(x - x_y)`` overflowed (a logit 150 above its target's) is redone with
    its max as the offset, so the forward's tiles (and ``pi @ W``) are not its ``pi``: nothing is
    kept, the backward pass recomputes, and the gradients are float64 naive's."""
    v = 300
    weight = torch.zeros(v, 1)
    weight[0] = -100.0
    weight[250] = 50.0
    weight[1:250, 0] = torch.linspace(-3, 3, 249)
    hidden = torch.ones(4, 1)
    tokens = torch.tensor([0, 250, 7, 0])
    up = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64)
    p = Problem(hidden, weight, None, tokens, None, None, None, 1.0, (up, up * 0, up * 0))
    ref = naive(p)
    out, grads, kept = logp_only_call(p, frozen, False, vocab_chunk=64)
    assert kept == "recompute"
    tame = Problem(**{**p.__dict__, "weight": weight.clamp(-3, 3)})
    assert logp_only_call(tame, frozen, False, vocab_chunk=64)[2] == ("unit" if frozen else "tiles")
    tol = value_tol(p, ref)
    assert_within("logp", out.logp, ref["logp"], tol)
    bound = grad_bound(p, ref, tol, False)
    assert_within("grad_hidden", grads["grad_hidden"], ref["grad_hidden"], bound["grad_hidden"])
    if not frozen:
        assert_within("grad_weight", grads["grad_weight"], ref["grad_weight"], bound["grad_weight"])


def test_kept_tiles_go_with_the_first_backward_pass():
    """The backward pass lets each kept tile go once used (their memory goes as the weight
    gradient's comes); a second backward pass (``retain_graph``) recomputes the tiles, and both
    give float64 naive's gradients."""
    p = make_problem(37, 24, 301, dtype=torch.float32, bias=True, ref=False)
    p.upstream = (p.upstream[0], torch.zeros(37, dtype=torch.float64), p.upstream[2])
    ref = naive(p)
    hidden = p.hidden.detach().requires_grad_(True)
    weight = p.weight.detach().requires_grad_(True)
    bias = p.bias.detach().requires_grad_(True)
    out = lp.fused(hidden, weight, p.tokens, bias=bias, with_entropy=False, vocab_chunk=64)
    assert kept_by(out) == "tiles"
    loss = (p.upstream[0].float() * out.logp).sum()
    first = torch.autograd.grad(loss, (hidden, weight, bias), retain_graph=True)
    assert kept_by(out) == "recompute"
    second = torch.autograd.grad(loss, (hidden, weight, bias))
    tol = value_tol(p, ref)
    bound = grad_bound(p, ref, tol, False)
    for grads in (first, second):
        for name, got in zip(("grad_hidden", "grad_weight", "grad_bias"), grads, strict=True):
            assert_within(name, got, ref[name], bound[name])


@pytest.mark.parametrize("frozen", [False, True], ids=["head-grad", "frozen-head"])
def test_saving_gradcheck_float64(frozen):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(23, 5, dtype=torch.float64, generator=gen, requires_grad=not frozen)
    b = torch.randn(23, dtype=torch.float64, generator=gen, requires_grad=not frozen)
    tokens = torch.tensor([0, 22, 5, 5, 11, 3, 22])

    def f(*leaves):
        hh, ww, bb = leaves if not frozen else (leaves[0], w, b)
        out = lp.fused(hh, ww, tokens, bias=bb, temperature=0.8, token_chunk=3, vocab_chunk=6)
        assert kept_by(out) == ("unit" if frozen else "tiles")
        return out.logp

    # gradcheck runs the backward pass twice on one graph: the first uses the kept tiles, the
    # second recomputes them, so the two differ by float64 rounding (nondet_tol).
    assert torch.autograd.gradcheck(f, (h,) if frozen else (h, w, b), nondet_tol=1e-12)


@pytest.mark.parametrize("n", [16, 64])
def test_kept_tiles_are_at_most_the_heads_size(n, keep_per_weight):
    """The memory the saving costs off the CPU's keep-every-tile rule: the kept tiles hold at
    most as many float32 as the head has weights (V H), all the tiles for N ≤ H, whole tiles up
    to that for N > H (the rest are recomputed), held by the node rather than saved; nothing else
    beyond the inputs but a few floats a token; a frozen head's ``pi @ W`` is one ``[N, H]``."""
    keep_per_weight(1.0)
    h, v = 16, 1000
    p = make_problem(n, h, v, dtype=torch.float32, bias=True, ref=False)
    hidden = p.hidden.requires_grad_(True)
    weight = p.weight.requires_grad_(True)
    bias = p.bias.requires_grad_(True)
    out, saved = saved_bytes(lambda: lp.fused(hidden, weight, p.tokens, bias=bias, vocab_chunk=64))
    inputs = sum(t.numel() * t.element_size() for t in (hidden, weight, bias, p.tokens))
    extra = sum(b for _, b in saved) - inputs
    assert 0 <= extra <= 5 * 4 * n  # log Z, entropy, 1 / s, x_y
    tiles = kept_tiles(out)
    held = sum(t.numel() for t in tiles if t is not None)
    if n <= h:  # every tile: N V = 16,000 floats, the head's V H
        assert held == n * v and all(t is not None for t in tiles)
    else:  # a prefix in loop order, within one tile (64 x 64) of V H
        assert v * h - 64 * n < held <= v * h and None in tiles
    assert kept_by(out) == "tiles"
    weight.requires_grad_(False)
    bias.requires_grad_(False)
    out, saved = saved_bytes(lambda: lp.fused(hidden, weight, p.tokens, bias=bias, vocab_chunk=64))
    extra = sum(b for _, b in saved) - inputs
    assert 0 <= extra - 4 * n * h <= 4 * 4 * n
    assert kept_by(out) == "unit"
    out.logp.sum().backward()


def test_tied_embedding_gradient():
    # A tiny LM whose head is its input embedding: the weight gradient must add both uses.
    gen = torch.Generator().manual_seed(5)
    v, h, n = 50, 12, 9
    emb = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.5
    mix = torch.randn(h, h, generator=gen, dtype=torch.float64) / h**0.5
    ids = torch.randint(0, v, (n,), generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)

    def loss(emb, mix, use_fused, head_only=False):
        hidden = torch.tanh((emb.detach() if head_only else emb)[ids] @ mix)
        if use_fused:
            out = lp.fused(hidden, emb, tokens, vocab_chunk=16)
            return (out.logp + 0.5 * out.entropy).sum()
        log_pi = torch.log_softmax(hidden @ emb.t(), -1)
        ent = -(log_pi.exp() * log_pi).sum(-1)
        return (log_pi.gather(1, tokens[:, None])[:, 0] + 0.5 * ent).sum()

    e64, m64 = emb.clone().requires_grad_(True), mix.clone().requires_grad_(True)
    want = torch.autograd.grad(loss(e64, m64, False), (e64, m64))
    e32, m32 = emb.float().requires_grad_(True), mix.float().requires_grad_(True)
    got = torch.autograd.grad(loss(e32, m32, True), (e32, m32))
    # float32 arithmetic: every entry is a short chain of float32 operations on O(1) terms
    # (|emb| < 3, |hidden| < 1, H = 12 products per logit, V + N terms per gradient entry).
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=LAMBDA * math.sqrt(v + h) * U32 * 50)
    # The test means something: the embedding's own path changes the gradient.
    (head_only,) = torch.autograd.grad(loss(e64, m64, False, head_only=True), e64)
    assert (head_only - want[0]).abs().max() > 0.1


def test_hugging_face_causal_lm_with_tied_head():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(config).float()
    ids = torch.randint(0, 257, (2, 9))
    tokens = ids[:, 1:]
    params = [q for q in model.parameters() if q.requires_grad]

    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    out = lp.fused(hidden, model.lm_head.weight, tokens, temperature=0.9, vocab_chunk=64)
    got = torch.autograd.grad((out.logp - 0.1 * out.entropy).sum(), params)

    logits = model(input_ids=ids).logits[:, :-1].double() / 0.9
    log_pi = torch.log_softmax(logits, -1)
    ent = -(log_pi.exp() * log_pi).sum(-1)
    logp = log_pi.gather(-1, tokens[..., None])[..., 0]
    want = torch.autograd.grad((logp - 0.1 * ent).sum(), params)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(out.logp.double(), logp, rtol=0, atol=1e-5)
    for g, w in zip(got, want, strict=True):
        # model parameters: the float32 model itself rounds; compare norm-wise
        assert float((g.double() - w).norm()) <= 1e-5 * float(w.norm()) + 1e-7


# ---------------------------------------------------------------------------------------------
# From logits.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_from_logits_matches_float64_naive(dtype, temperature):
    gen = torch.Generator().manual_seed(1)
    b, t, v = 3, 5, 97
    logits = (3 * torch.randn(b, t, v, generator=gen)).to(dtype).requires_grad_(True)
    logits_ref = (3 * torch.randn(b, t, v, generator=gen)).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    up = [torch.randn(b, t, generator=gen, dtype=torch.float64) for _ in range(3)]
    rows = 2  # rows per chunk: 15 rows in 8 chunks, a ragged tail
    logp = lp.token_logprobs(logits, tokens, temperature=temperature, row_chunk=rows)
    ent = lp.entropy(logits, temperature=temperature, row_chunk=rows)
    kl = lp.exact_kl(logits, logits_ref, temperature=temperature, row_chunk=rows)
    (grad,) = torch.autograd.grad((up[0] * logp + up[1] * ent + up[2] * kl).sum(), logits)

    x64 = logits.detach().double().requires_grad_(True)
    log_pi = torch.log_softmax(x64 / temperature, -1)
    log_pi_ref = torch.log_softmax(logits_ref.double() / temperature, -1)
    want_logp = log_pi.gather(-1, tokens[..., None])[..., 0]
    want_ent = -(log_pi.exp() * log_pi).sum(-1)
    want_kl = (log_pi.exp() * (log_pi - log_pi_ref)).sum(-1)
    # Three functions, three gradients: autograd rounds each to the logits' dtype and adds them.
    parts = [
        torch.autograd.grad((u * w).sum(), x64, retain_graph=True)[0]
        for u, w in zip(up, (want_logp, want_ent, want_kl), strict=True)
    ]
    want_grad = sum(parts)

    # values: float32 arithmetic on logits of size S = max |x| / T (no dot products here)
    s = (logits.detach().double().abs().amax(-1) + logits_ref.double().abs().amax(-1)) / temperature
    tol = (
        LAMBDA
        * math.sqrt(v)
        * U32
        * (2 * s + 1 + torch.logsumexp(x64.detach() / temperature, -1).abs())
    )
    for name, got, want in (
        ("logp", logp, want_logp),
        ("entropy", ent, want_ent),
        ("kl", kl, want_kl),
    ):
        assert got.dtype == torch.float32 and got.shape == (b, t)
        assert_within(name, got, want.detach(), tol)
    assert grad.dtype == dtype and grad.shape == logits.shape
    pi = log_pi.detach().exp()
    g_abs = sum(u.abs()[..., None] for u in up) * pi * (
        2
        + log_pi.detach().abs()
        + log_pi_ref.abs()
        + want_ent.detach()[..., None]
        + want_kl.detach()[..., None]
    ) + up[0].abs()[..., None] * torch.zeros_like(pi).scatter_(-1, tokens[..., None], 1.0)
    bound = (tol[..., None] + LAMBDA * math.sqrt(v) * U32) * g_abs / temperature
    if dtype == torch.bfloat16:
        # each part rounded once, then two bf16 additions: at most 3 u_bf16 sum |part|
        bound = bound + 3 * U_BF16 * sum(q.abs() for q in parts)
    assert_within("grad", grad, want_grad, bound)


def test_from_logits_gradcheck_float64_and_expanded_input():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    logits_ref = torch.randn(4, 6, dtype=torch.float64, generator=gen)
    tokens = torch.tensor([0, 5, 2, 2])
    assert torch.autograd.gradcheck(
        lambda x: (
            lp.token_logprobs(x, tokens, temperature=1.3),
            lp.entropy(x, temperature=1.3),
            lp.exact_kl(x, logits_ref, temperature=1.3),
        ),
        (logits,),
    )
    # A stride-0 (expanded) input, as klpo.kl.explain passes; the gradient sums over the copies.
    row = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    kl = lp.exact_kl(row.expand(1, 6, 6), logits_ref[0].expand(1, 6, 6))
    (grad,) = torch.autograd.grad(kl.sum(), row)
    log_pi, log_pi_ref = torch.log_softmax(row.detach(), -1), torch.log_softmax(logits_ref[0], -1)
    kl1 = (log_pi.exp() * (log_pi - log_pi_ref)).sum()
    torch.testing.assert_close(kl, kl1.expand(1, 6), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, 6 * log_pi.exp() * (log_pi - log_pi_ref - kl1))


# ---------------------------------------------------------------------------------------------
# Memory: nothing of size [tokens, V] is kept alive between forward and backward.


def saved_bytes(fn):
    """Run fn under a pack hook; return (output, [(shape, bytes) of each tensor saved])."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.numel() * t.element_size()))
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_fused_saves_only_inputs_and_per_token_floats():
    n, h, v = 256, 16, 4000
    p = make_problem(n, h, v, dtype=torch.float32, bias=True)
    hidden = p.hidden.clone().requires_grad_(True)
    weight = p.weight.clone().requires_grad_(True)
    bias = p.bias.clone().requires_grad_(True)
    out, saved = saved_bytes(
        lambda: lp.fused(
            hidden, weight, p.tokens, bias=bias, hidden_ref=p.hidden_ref,
            weight_ref=p.weight_ref, bias_ref=p.bias_ref, vocab_chunk=512,
        )
    )  # fmt: skip
    inputs = sum(t.numel() * t.element_size() for t in (hidden, weight, bias, p.tokens,
                 p.hidden_ref, p.weight_ref, p.bias_ref))  # fmt: skip
    total = sum(b for _, b in saved)
    assert all(math.prod(s) < n * v / 4 for s, _ in saved)  # no tile, let alone [N, V]
    # the inputs themselves, plus at most 8 float64 per token (log Z, log Z_ref, entropy, KL)
    assert total <= inputs + 8 * 8 * n
    (out.logp.sum() + out.entropy.sum() + out.kl.sum()).backward()  # still differentiable


def test_from_logits_saves_only_the_logits_and_per_row_floats():
    n, v = 64, 3000
    logits = torch.randn(n, v, requires_grad=True)
    logits_ref = torch.randn(n, v)
    tokens = torch.randint(0, v, (n,))
    for fn in (
        lambda: lp.token_logprobs(logits, tokens),
        lambda: lp.entropy(logits),
        lambda: lp.exact_kl(logits, logits_ref),
    ):
        _, saved = saved_bytes(fn)
        big = [s for s, _ in saved if math.prod(s) >= n * v]
        extra = sum(b for s, b in saved if math.prod(s) < n * v)
        assert len(big) <= 2  # the logits (and logits_ref) themselves, no new tensor
        assert extra <= 8 * 8 * n


def test_from_logits_saved_big_tensors_are_the_inputs():
    logits = torch.randn(8, 500, requires_grad=True)
    logits_ref = torch.randn(8, 500)
    saved = []
    with saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp.exact_kl(logits, logits_ref)
    big = [t for t in saved if t.numel() == logits.numel()]
    ptrs = {logits.data_ptr(), logits_ref.data_ptr()}
    assert big and all(t.data_ptr() in ptrs for t in big)


# ---------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_problem():
    h, w, y = torch.zeros(4, 3), torch.zeros(10, 3), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = 3"):
        lp.fused(h, torch.zeros(10, 4), y)
    with pytest.raises(ValueError, match=r"tokens has shape \(5,\) but hidden has shape \(4, 3\)"):
        lp.fused(h, w, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 10\).*\[0, 10\]"):
        lp.fused(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        lp.fused(h, w, torch.zeros(4))
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        lp.fused(h, w, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="hidden must be a float tensor"):
        lp.fused(h.long(), w, y)
    with pytest.raises(ValueError, match="needs both hidden_ref and weight_ref"):
        lp.fused(h, w, y, hidden_ref=h)
    with pytest.raises(ValueError, match=r"weight_ref must be \[V, H_ref\] = \[10, 3\]"):
        lp.fused(h, w, y, hidden_ref=h, weight_ref=torch.zeros(11, 3))
    with pytest.raises(ValueError, match=r"bias must be \[V\] = \[10\]"):
        lp.fused(h, w, y, bias=torch.zeros(9))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        lp.fused(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_chunk must be a positive int"):
        lp.fused(h, w, y, vocab_chunk=0)
    with pytest.raises(ValueError, match=r"hidden must be \[N, H\] or \[B, T, H\]"):
        lp.fused(torch.zeros(3), w, torch.zeros((), dtype=torch.long))
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match=r"logits_ref has shape \(2, 4\)"):
        lp.exact_kl(x, torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 5\)"):
        lp.token_logprobs(x, torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
        lp.entropy(x, temperature=float("inf"))
    with pytest.raises(ValueError, match=r"row_chunk must be a positive int \(rows per chunk\)"):
        lp.token_logprobs(x, torch.tensor([0, 1]), row_chunk=0)
    with pytest.raises(TypeError, match=r"plan must be a klpo.gemm.Plan.*got 'mm'"):
        lp.fused(h, w, y, plan="mm")
    with pytest.raises(TypeError, match=r"plan must be a klpo.gemm.Plan.*'blas'"):
        lp.fused_loss(h, w, y, logp_weight=torch.ones(4), plan=gemm.Plan("blas", "mm", "mm", False))


def test_the_default_plan_is_the_heads():
    """``plan=None`` is :func:`klpo.logprobs.head_plan` of the head (the compute dtype read from
    the inputs): passing it explicitly gives the same bits."""
    p = make_problem(37, 24, 301, dtype=torch.float32, temperature=0.7, bias=True)
    out, grads = run_fused(p, token_chunk=8, vocab_chunk=64)
    plan = lp.head_plan(p.hidden, p.weight)
    assert plan == lp.head_plan(p.hidden, p.weight, torch.float32)
    out_p, grads_p = run_fused(p, token_chunk=8, vocab_chunk=64, plan=plan)
    for a, b in [
        *zip(out, out_p, strict=True),
        *zip(grads.values(), grads_p.values(), strict=True),
    ]:
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# Peers (optional): TRL 1.16's chunked kernels compute the same quantities.


@pytest.mark.peer
def test_agrees_with_trl_chunked_functions():
    chunked_logprob = pytest.importorskip("trl.kernels.chunked_logprob")
    chunked_divergence = pytest.importorskip("trl.kernels.chunked_divergence")
    p = make_problem(40, 16, 700, dtype=torch.float32, temperature=0.8)
    out = lp.fused(p.hidden, p.weight, p.tokens, temperature=0.8,
                   hidden_ref=p.hidden_ref, weight_ref=p.weight_ref)  # fmt: skip
    logp, ent, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
        p.hidden, p.weight, None, p.tokens, 0.8, 256, None, 1.0, ("entropy",)
    )
    kl, _ = chunked_divergence.ChunkedDivergenceFunction.apply(
        p.hidden, p.weight, None, p.hidden_ref, p.weight_ref, None, 1.0, 0.8
    )
    tol = value_tol(p, naive(p))
    for got, want in ((out.logp, logp), (out.entropy, ent), (out.kl, kl)):
        assert_within("peer", got, want.double(), 2 * tol)


# ---------------------------------------------------------------------------------------------
# -inf logits (a masked vocabulary): KL and entropy over the support, by 0 log 0 = 0.

INF = float("inf")


def support_oracle(x: torch.Tensor, x_ref: torch.Tensor | None):
    """Naive float64 entropy and KL row by row over pi's support only (the -inf entries are
    dropped before any arithmetic); KL = +inf where pi_ref = 0 on pi's support. Differentiable
    in ``x`` through the kept entries, so the masked entries' gradient is 0 by construction."""
    ents, kls = [], []
    for i in range(x.shape[0]):
        keep = ~torch.isneginf(x[i].detach())
        log_pi = torch.log_softmax(x[i][keep].double(), 0)
        ents.append(-(log_pi.exp() * log_pi).sum())
        if x_ref is not None:
            r = x_ref[i].double()
            log_z_ref = torch.logsumexp(r[~torch.isneginf(r)], 0)
            r_keep = r[keep]
            if bool(torch.isneginf(r_keep).any()):
                kls.append(torch.full((), INF, dtype=torch.float64))
            else:
                kls.append((log_pi.exp() * (log_pi - (r_keep - log_z_ref))).sum())
    return torch.stack(ents), (torch.stack(kls) if kls else None)


def masked_case(case: str, n: int = 5, v: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    r = torch.randn(n, v, generator=g, dtype=torch.float64) * 2
    m = torch.rand(n, v, generator=g) < 0.3
    m[:, 0] = False  # every row keeps an entry
    m[1] = False  # and one row has no mask at all
    pi_mask = m if case in ("pi", "both") else torch.zeros_like(m)
    ref_mask = m if case in ("ref", "both") else torch.zeros_like(m)
    return x, r, pi_mask, ref_mask


@pytest.mark.parametrize("case", ["pi", "both"])
@pytest.mark.parametrize("rows_per_chunk", [None, 2])
def test_exact_kl_and_entropy_with_inf_logits_match_support_oracle(case, rows_per_chunk):
    # rows_per_chunk 2: several chunks, only some holding masked rows
    x0, r, pm, rm = masked_case(case)
    r = r.masked_fill(rm, -INF)
    for dtype in (torch.float64, torch.float32):
        x = x0.to(dtype).clone().requires_grad_()
        xm = x.masked_fill(pm, -INF)
        kl = lp.exact_kl(xm, r.to(dtype), row_chunk=rows_per_chunk)
        ent = lp.entropy(xm, row_chunk=rows_per_chunk)
        xo = x0.clone().requires_grad_()
        ent_o, kl_o = support_oracle(xo.masked_fill(pm, -INF), r)
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        assert torch.isfinite(kl).all() and torch.isfinite(ent).all()
        torch.testing.assert_close(kl.double(), kl_o.detach(), rtol=0, atol=tol)
        torch.testing.assert_close(ent.double(), ent_o.detach(), rtol=0, atol=tol)
        # Gradients of a weighted sum of both (every row different weights).
        wk = torch.linspace(0.5, 1.5, x0.shape[0], dtype=torch.float64)
        we = torch.linspace(-1.0, 1.0, x0.shape[0], dtype=torch.float64)
        ((kl.double() * wk).sum() + (ent.double() * we).sum()).backward()
        ((kl_o * wk).sum() + (ent_o * we).sum()).backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[pm] == 0).all()  # masked entries: exactly zero gradient
        torch.testing.assert_close(x.grad.double(), xo.grad, rtol=0, atol=10 * tol)


def test_inf_logits_token_logprobs():
    x = torch.tensor([[0.0, -INF, 1.0], [2.0, -INF, -INF]], dtype=torch.float64, requires_grad=True)
    logp = lp.token_logprobs(x, torch.tensor([1, 0]))
    # Hand values: row 0 takes the masked token, row 1 the only one left.
    assert logp[0] == -INF and logp[1] == 0.0
    logp[1].backward()
    assert torch.equal(x.grad, torch.zeros_like(x))  # pi = (1, 0, 0): 1[v = y] - pi = 0
    x.grad = None
    lp.token_logprobs(x, torch.tensor([1, 0]))[0].backward()
    # d log pi(y) / dx = 1[v = y] - pi: finite even though log pi(y) = -inf.
    p = torch.softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), 0)
    torch.testing.assert_close(x.grad[0], torch.stack([-p[0], torch.tensor(1.0).double(), -p[1]]))


def test_exact_kl_is_inf_where_ref_forbids_pi_support_and_the_gradient_is_documented():
    x0, r, _, rm = masked_case("ref")
    r = r.masked_fill(rm, -INF)
    forbidden = rm.any(1)  # every row but row 1 has a masked reference entry, pi > 0 there
    assert forbidden.sum() == x0.shape[0] - 1
    x = x0.clone().requires_grad_()
    kl = lp.exact_kl(x, r)
    _, kl_o = support_oracle(x0, r)
    assert torch.isposinf(kl[forbidden]).all() and torch.isposinf(kl_o[forbidden]).all()
    torch.testing.assert_close(kl[~forbidden], kl_o[~forbidden], rtol=0, atol=1e-12)
    # A nonzero upstream gradient at an infinite-KL row: NaN on that whole row (no gradient
    # exists); the other rows keep their exact gradient.
    kl.sum().backward()
    assert torch.isnan(x.grad[forbidden]).all()
    xo = x0.clone().requires_grad_()
    support_oracle(xo, r)[1][~forbidden].sum().backward()
    torch.testing.assert_close(x.grad[~forbidden], xo.grad[~forbidden], rtol=0, atol=1e-12)
    # Masked out with torch.where (upstream gradient 0 there): exactly zero gradient, no NaN.
    x.grad = None
    kl = lp.exact_kl(x, r)
    torch.where(forbidden, 0.0, kl).sum().backward()
    assert torch.equal(x.grad[forbidden], torch.zeros_like(x.grad[forbidden]))
    torch.testing.assert_close(x.grad[~forbidden], xo.grad[~forbidden], rtol=0, atol=1e-12)


def test_exact_kl_is_inf_where_pi_underflows_on_a_forbidden_entry():
    # pi(v) = exp(-1000) underflows to 0, but it is > 0: KL(pi ‖ pi_ref) = +inf all the same.
    x = torch.tensor([[0.0, -1000.0, 1.0]])
    r = torch.tensor([[0.0, -INF, 0.0]])
    assert torch.isposinf(lp.exact_kl(x, r)).all()
    assert torch.isposinf(lp.exact_kl(x.double(), r.double())).all()


def test_inf_logits_bf16_and_temperature():
    x0, r, pm, rm = masked_case("both", n=6, v=40, seed=3)
    xb = x0.to(torch.bfloat16).masked_fill(pm, -INF).requires_grad_()
    rb = r.to(torch.bfloat16).masked_fill(rm, -INF)
    t = 0.7
    kl = lp.exact_kl(xb, rb, temperature=t)
    ent = lp.entropy(xb, temperature=t)
    assert kl.dtype == torch.float32
    # Oracle on the exactly upcast bf16 values; float32 arithmetic error ~ λ √V u (|x| / T + |L|).
    xo = (xb.detach().double() / t).requires_grad_()
    ent_o, kl_o = support_oracle(xo, rb.double() / t)
    scale = 2 * x0.abs().max() / t + 1
    tol = float(LAMBDA * math.sqrt(40) * U32 * 4 * scale)
    torch.testing.assert_close(kl.double(), kl_o.detach(), rtol=0, atol=tol)
    torch.testing.assert_close(ent.double(), ent_o.detach(), rtol=0, atol=tol)
    (kl.sum() + ent.sum()).backward()
    (kl_o.sum() + ent_o.sum()).backward()
    want = xo.grad / t  # d/dlogits = d/dx / T
    assert xb.grad.dtype == torch.bfloat16 and (xb.grad[pm] == 0).all()
    torch.testing.assert_close(
        xb.grad.double(), want, rtol=0, atol=tol + float(U_BF16 * want.abs().max())
    )


def test_inf_logits_gradcheck_float64():
    x0, r, pm, rm = masked_case("both", n=4, v=7, seed=5)
    r = r.masked_fill(rm, -INF)
    x = x0.clone().requires_grad_()

    def f(x):
        xm = x.masked_fill(pm, -INF)
        return lp.exact_kl(xm, r), lp.entropy(xm, temperature=1.3)

    assert torch.autograd.gradcheck(f, (x,))
    x2 = x0.clone().masked_fill(pm | rm, 0.0).requires_grad_()  # pi masked, ref not
    r2 = torch.randn(4, 7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: lp.exact_kl(x.masked_fill(pm, -INF), r2), (x2,))


def test_a_row_of_only_inf_logits_is_refused():
    x = torch.zeros(3, 4)
    x[2] = -INF
    for fn in (lambda: lp.entropy(x), lambda: lp.token_logprobs(x, torch.zeros(3, dtype=int))):
        with pytest.raises(ValueError, match=r"logits is -inf at every vocabulary entry.*row 2"):
            fn()
    with pytest.raises(ValueError, match=r"logits_ref is -inf at every vocabulary entry"):
        lp.exact_kl(torch.zeros(3, 4), x)


# ---------------------------------------------------------------------------------------------
# fused_loss: the weighted sum as one scalar, its gradient taken in the forward pass.

# Which outputs carry a weight: log-probs only (the policy-gradient / cross-entropy case, whose
# per-token factor is taken out of the tile), with the entropy, the KL alone, all three.
LOSS_TERMS = [("logp",), ("logp", "entropy"), ("kl",), ("logp", "entropy", "kl")]


def weighted(p: Problem, terms) -> Problem:
    """``p`` with the upstream gradients of the outputs not in ``terms`` set to 0."""
    names = ("logp", "entropy", "kl")
    up = tuple(
        u if n in terms else torch.zeros_like(u) for n, u in zip(names, p.upstream, strict=True)
    )
    return Problem(**{**p.__dict__, "upstream": up})


def run_fused_loss(p: Problem, terms, scale: float = 1.0, **kw):
    leaves = [p.hidden, p.weight] + ([p.bias] if p.bias is not None else [])
    leaves = [t.detach().requires_grad_(True) for t in leaves]
    a, c, d = p.upstream
    out = lp.fused_loss(
        leaves[0],
        leaves[1],
        p.tokens,
        bias=leaves[2] if p.bias is not None else None,
        temperature=p.temperature,
        hidden_ref=p.hidden_ref if "kl" in terms else None,
        weight_ref=p.weight_ref if "kl" in terms else None,
        bias_ref=p.bias_ref if "kl" in terms else None,
        logp_weight=a if "logp" in terms else None,
        entropy_weight=c if "entropy" in terms else None,
        kl_weight=d if "kl" in terms else None,
        with_entropy=True,
        transform=p.transform,
        transform_ref=p.transform_ref if "kl" in terms else None,
        **kw,
    )
    grads = torch.autograd.grad(out.loss * scale, leaves)
    names = ["grad_hidden", "grad_weight", "grad_bias"]
    return out, {k: g / scale for k, g in zip(names, grads, strict=False)}


def test_default_loss_token_chunk():
    assert lp.default_loss_token_chunk(151936) == 128  # 2^25 / 151936 = 220 -> 128
    assert lp.default_loss_token_chunk(32000) == 1024  # 1048 -> 1024
    assert lp.default_loss_token_chunk(1 << 25) == 64  # 1, raised to the minimum
    assert lp.default_loss_token_chunk(50) == 1 << 19


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [s[:4] for s in SHAPES[:3]])
@pytest.mark.parametrize(("temperature", "bias"), [(1.0, False), (0.7, True)])
@pytest.mark.parametrize("terms", LOSS_TERMS)
def test_fused_loss_matches_float64_naive(dtype, shape, temperature, bias, terms):
    n, h, v, token_chunk = shape
    p = weighted(make_problem(n, h, v, dtype=dtype, temperature=temperature, bias=bias), terms)
    out, grads = run_fused_loss(p, terms, token_chunk=token_chunk)
    ref = naive(p)  # the same loss: the upstream gradients of the unweighted terms are 0
    tol = value_tol(p, ref)
    for name in ("logp", "entropy") + (("kl",) if "kl" in terms else ()):
        got = getattr(out, name)
        assert got.dtype == torch.float32 and got.shape == (n,) and not got.requires_grad
        assert_within(name, got, ref[name], tol)
    assert out.kl is None or "kl" in terms
    names = ("logp", "entropy", "kl")
    want = sum((u * ref[k]).sum() for u, k in zip(p.upstream, names, strict=True) if k in terms)
    loss_tol = sum((u.abs() * tol).sum() for u in p.upstream)
    assert abs(out.loss.item() - float(want)) <= float(loss_tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in grads.items():
        assert got.dtype == dtype
        assert_within(name, got, ref[name], bound[name])


def test_fused_loss_gradcheck_float64():
    gen = torch.Generator().manual_seed(5)
    n, h, v = 7, 3, 13
    hidden = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(v, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden_ref = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    weight_ref = torch.randn(v, 2, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)
    a, b, c = (torch.randn(n, dtype=torch.float64, generator=gen) for _ in range(3))

    def f(hidden, weight, bias):
        return lp.fused_loss(
            hidden, weight, tokens, bias=bias, temperature=0.9, hidden_ref=hidden_ref,
            weight_ref=weight_ref, logp_weight=a, entropy_weight=b, kl_weight=c, token_chunk=3,
        ).loss  # fmt: skip

    def g(hidden, weight, bias):  # log-probs only: the path that takes the factor out of the tile
        return lp.fused_loss(hidden, weight, tokens, bias=bias, logp_weight=a, token_chunk=2).loss

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))
    assert torch.autograd.gradcheck(g, (hidden, weight, bias))


def test_fused_loss_equals_fused_and_scales_with_the_upstream_gradient():
    # float64, so the algorithms agree to rounding: fused's outputs, naive's gradients, whatever
    # the upstream gradient of the loss.
    p = make_problem(23, 8, 157, dtype=torch.float64, temperature=1.3, bias=True)
    terms = ("logp", "entropy", "kl")
    out, grads = run_fused_loss(p, terms, scale=-3.5, token_chunk=4)
    ref_out, _ = run_fused(p, vocab_chunk=40, token_chunk=6)
    ref = naive(p)
    for name in ("logp", "entropy", "kl"):
        torch.testing.assert_close(getattr(out, name), getattr(ref_out, name), rtol=1e-12, atol=0)
    for name, got in grads.items():
        torch.testing.assert_close(got, ref[name], rtol=1e-10, atol=1e-12)


def test_fused_loss_3d_inputs_and_no_grad():
    p = make_problem(12, 16, 97, dtype=torch.float32)
    a = p.upstream[0].float()
    flat = lp.fused_loss(p.hidden, p.weight, p.tokens, logp_weight=a)
    out = lp.fused_loss(
        p.hidden.view(3, 4, 16), p.weight, p.tokens.view(3, 4), logp_weight=a.view(3, 4)
    )
    assert out.logp.shape == (3, 4) and out.entropy is None and out.kl is None
    torch.testing.assert_close(out.logp.reshape(-1), flat.logp, rtol=0, atol=0)
    hidden = p.hidden.clone().requires_grad_(True)
    with torch.no_grad():
        quiet = lp.fused_loss(hidden, p.weight, p.tokens, logp_weight=a)
    assert not quiet.loss.requires_grad
    torch.testing.assert_close(quiet.loss, flat.loss, rtol=0, atol=0)


def test_fused_loss_overflow_falls_back_to_the_max():
    # The overflow problem of test_overflow_falls_back_to_the_max: exp(x - x_y) = exp(150)
    # overflows float32 in one token chunk of the policy and of the reference.
    v = 300
    weight = torch.zeros(v, 1)
    weight[0], weight[250] = -100.0, 50.0
    weight[1:250, 0] = torch.linspace(-3, 3, 249)
    tokens = torch.tensor([0, 250, 7, 0])
    hidden = torch.ones(4, 1)
    p = Problem(hidden, weight, None, tokens, hidden, weight.flip(0).clone(), None, 1.0,
                (torch.ones(4, dtype=torch.float64),) * 3)  # fmt: skip
    terms = ("logp", "entropy", "kl")
    out, grads = run_fused_loss(p, terms, token_chunk=2)
    ref = naive(p)
    assert out.logp[0].item() == pytest.approx(-150.0, rel=1e-6)
    tol = value_tol(p, ref)
    for name in terms:
        assert torch.isfinite(getattr(out, name)).all()
        assert_within(name, getattr(out, name), ref[name], tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in grads.items():
        assert_within(name, got, ref[name], bound[name])


def test_fused_loss_saves_only_the_gradients():
    n, h, v = 256, 16, 4000
    p = make_problem(n, h, v, dtype=torch.float32, bias=True)
    hidden = p.hidden.clone().requires_grad_(True)
    weight = p.weight.clone().requires_grad_(True)
    bias = p.bias.clone().requires_grad_(True)
    out, saved = saved_bytes(
        lambda: lp.fused_loss(
            hidden, weight, p.tokens, bias=bias, hidden_ref=p.hidden_ref,
            weight_ref=p.weight_ref, bias_ref=p.bias_ref, kl_weight=p.upstream[2].float(),
            token_chunk=64,
        )
    )  # fmt: skip
    grads = sum(t.numel() * t.element_size() for t in (hidden, weight, bias))
    assert sum(b for _, b in saved) == grads  # the three gradients, no tile
    out.loss.backward()


def test_fused_loss_errors_name_the_problem():
    p = make_problem(4, 3, 10, dtype=torch.float32)
    w = torch.ones(4)
    with pytest.raises(ValueError, match="at least one of logp_weight"):
        lp.fused_loss(p.hidden, p.weight, p.tokens)
    with pytest.raises(ValueError, match="kl_weight was given without a reference"):
        lp.fused_loss(p.hidden, p.weight, p.tokens, kl_weight=w)
    with pytest.raises(ValueError, match=r"logp_weight has shape \(3,\)"):
        lp.fused_loss(p.hidden, p.weight, p.tokens, logp_weight=w[:3])
    with pytest.raises(TypeError, match="entropy_weight must be a float tensor"):
        lp.fused_loss(p.hidden, p.weight, p.tokens, entropy_weight=w.long())
    with pytest.raises(ValueError, match="token_chunk must be a positive int"):
        lp.fused_loss(p.hidden, p.weight, p.tokens, logp_weight=w, token_chunk=0)
    with pytest.raises(ValueError, match="tokens must lie in"):
        lp.fused_loss(p.hidden, p.weight, p.tokens + 10, logp_weight=w)


def test_fused_loss_agrees_with_liger_kernel_jsd():
    # A peer with the gradient in the forward pass: LigerFusedLinearJSDLoss at beta = 1 is the
    # mean KL(student ‖ teacher), fused_loss with kl_weight = 1 / N. Float64 inputs: the gradients
    # agree to rounding; the value to float32's (Liger computes parts of its loss in float32).
    chunked = pytest.importorskip("liger_kernel.chunked_loss")
    p = make_problem(40, 16, 300, dtype=torch.float64)
    hidden, weight = (t.clone().requires_grad_(True) for t in (p.hidden, p.weight))
    loss_fn = chunked.LigerFusedLinearJSDLoss(
        weight_hard_loss=0.0, weight_soft_loss=1.0, beta=1.0, compiled=False
    )
    want = loss_fn(hidden, weight, p.hidden_ref, p.weight_ref, p.tokens)
    want_grads = torch.autograd.grad(want, (hidden, weight))
    out = lp.fused_loss(
        hidden, weight, p.tokens, hidden_ref=p.hidden_ref, weight_ref=p.weight_ref,
        kl_weight=torch.full((40,), 1 / 40, dtype=torch.float64),
    )  # fmt: skip
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# Logit transforms: a scale (Cohere), a divisor (Granite), a soft cap (Gemma 2), both.

TRANSFORMS = {
    "scale": LogitTransform.make(scale=0.6),
    "divisor": LogitTransform.divided_by(2.5),
    "softcap": LogitTransform.make(softcap=1.5),
    "scale-softcap": LogitTransform.make(scale=1.7, softcap=2.0),
}


def test_transform_hand_values_and_gradient():
    # Soft cap 2 on z = 2 atanh([0, 1/2, 1/4]) = [0, 1.0986123, 0.5108256]: x = 2 tanh(z / 2) =
    # [0, 1, 1/2], so log pi(1) = 1 - ln(1 + e + e^0.5) = 1 - ln 5.3670031 = -0.6802697, and
    # pi = [0.1863237, 0.5064804, 0.3071959]. d log pi(1) / dz_v = (1[v = 1] - pi_v)(1 - tanh²)
    # with tanh = [0, 1/2, 1/4]: [-0.1863237, 0.4935196 · 0.75, -0.3071959 · 0.9375]
    # = [-0.1863237, 0.3701397, -0.2879961].
    cap = LogitTransform.make(softcap=2.0)
    z = (2 * torch.atanh(torch.tensor([[0.0, 0.5, 0.25]], dtype=torch.float64))).requires_grad_()
    want_grad = torch.tensor(
        [[-0.18632372322584756, 0.37013970670825946, -0.2879961428610922]], dtype=torch.float64
    )
    logp = lp.token_logprobs(z, torch.tensor([1]), transform=cap)
    assert logp.item() == pytest.approx(-0.6802696706417346, rel=1e-12)
    (grad,) = torch.autograd.grad(logp.sum(), z)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=0)
    # The same head as hidden [1] (H = 1) times the weight z.T: the weight's gradient is dz.
    weight = z.detach().t().contiguous().requires_grad_()
    out = lp.fused(torch.ones(1, 1, dtype=torch.float64), weight, torch.tensor([1]), transform=cap)
    assert out.logp.item() == pytest.approx(-0.6802696706417346, rel=1e-12)
    (grad_w,) = torch.autograd.grad(out.logp.sum(), weight)
    torch.testing.assert_close(grad_w.t(), want_grad, rtol=1e-12, atol=0)
    # Temperature 2 divides the capped logits: x = [0, 1/2, 1/4], log pi(1) = 1/2 - ln(1 +
    # e^0.5 + e^0.25) = 0.5 - ln 3.9327467 = -0.8693381.
    warm = lp.token_logprobs(z.detach(), torch.tensor([1]), temperature=2.0, transform=cap)
    assert warm.item() == pytest.approx(-0.8693380844056782, rel=1e-12)
    # Cohere's scale 1/2 and Granite's divisor 2 on z = 2 [0, ln 2, ln 5]: pi = [1, 2, 5] / 8, so
    # log pi(2) = ln(5/8) = -0.4700036.
    z2 = 2 * torch.tensor([[0.0, math.log(2.0), math.log(5.0)]])
    for tr in (LogitTransform.make(scale=0.5), LogitTransform.divided_by(2.0)):
        got = lp.token_logprobs(z2, torch.tensor([2]), transform=tr)
        assert got.item() == pytest.approx(math.log(5 / 8), rel=1e-6)
        fused = lp.fused(torch.ones(1, 1), z2.t().contiguous(), torch.tensor([2]), transform=tr)
        assert fused.logp.item() == pytest.approx(math.log(5 / 8), rel=1e-6)


def test_transform_apply_is_the_models_arithmetic():
    z = torch.linspace(-40, 40, 9, dtype=torch.float64)
    assert torch.equal(LogitTransform().apply(z), z)
    assert torch.equal(LogitTransform.make(scale=0.0625).apply(z), z * 0.0625)
    assert torch.equal(LogitTransform.make(softcap=30.0).apply(z), torch.tanh(z / 30.0) * 30.0)
    assert LogitTransform().is_identity and not LogitTransform.divided_by(8.0).is_identity
    assert LogitTransform.divided_by(8.0).scale == 0.125


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
@pytest.mark.parametrize("kind", list(TRANSFORMS))
def test_fused_with_transform_matches_float64_naive(dtype, shape, kind):
    n, h, v, token_chunk, vocab_chunk = shape
    tr = TRANSFORMS[kind]
    p = make_problem(n, h, v, dtype=dtype, temperature=0.8, bias=True, transform=tr)
    out, grads = run_fused(p, token_chunk=token_chunk, vocab_chunk=vocab_chunk)
    ref = naive(p)
    tol = value_tol(p, ref)
    for name in ("logp", "entropy", "kl"):
        assert_within(name, getattr(out, name), ref[name], tol)
    bf16_gemm = dtype == torch.bfloat16 and n <= token_chunk and gemm.ONEDNN
    bound = grad_bound(p, ref, tol, bf16_gemm)
    for name, got in grads.items():
        assert got.dtype == dtype
        assert_within(name, got, ref[name], bound[name])
    # The test has teeth: the same head without its transform is far outside the tolerance.
    plain = naive(Problem(**{**p.__dict__, "transform": None, "transform_ref": None}))
    for name in ("logp", "kl"):
        assert float(((plain[name] - ref[name]).abs() / tol).max()) > 100


@pytest.mark.parametrize("backend", ["mm", "onednn"] if gemm.ONEDNN else ["mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["divisor", "softcap"])
def test_fused_logp_only_gradient_with_transform(backend, dtype, kind):
    """The backward that takes the per-token coefficient out of the tiles, with a transform."""
    n, h, v, token_chunk, vocab_chunk = SHAPES[0]
    p = make_problem(n, h, v, dtype=dtype, temperature=0.7, bias=True, ref=False)
    p = Problem(**{**p.__dict__, "transform": TRANSFORMS[kind]})
    p.upstream = (p.upstream[0], torch.zeros(n, dtype=torch.float64), p.upstream[2])
    ref = naive(p)
    leaves = [t.detach().requires_grad_(True) for t in (p.hidden, p.weight, p.bias)]
    out = lp.fused(
        *leaves[:2], p.tokens, bias=leaves[2], temperature=0.7, with_entropy=False,
        token_chunk=token_chunk, vocab_chunk=vocab_chunk, transform=p.transform,
        plan=gemm.Plan(backend, backend, backend, False),
    )  # fmt: skip
    grads = torch.autograd.grad((p.upstream[0].float() * out.logp).sum(), leaves)
    tol = value_tol(p, ref)
    assert_within("logp", out.logp, ref["logp"], tol)
    bound = grad_bound(p, ref, tol, False)
    for name, got in zip(["grad_hidden", "grad_weight", "grad_bias"], grads, strict=True):
        assert_within(name, got, ref[name], bound[name])


@pytest.mark.parametrize("kind", list(TRANSFORMS))
@pytest.mark.parametrize("terms", LOSS_TERMS)
def test_fused_loss_with_transform_matches_float64_naive(kind, terms):
    n, h, v, token_chunk = SHAPES[0][:4]
    p = make_problem(n, h, v, dtype=torch.float32, temperature=0.8, bias=True)
    p = weighted(Problem(**{**p.__dict__, "transform": TRANSFORMS[kind]}), terms)
    p.transform_ref = TRANSFORMS[kind] if "kl" in terms else None
    out, grads = run_fused_loss(p, terms, token_chunk=token_chunk)
    ref = naive(p)
    tol = value_tol(p, ref)
    for name in ("logp", "entropy") + (("kl",) if "kl" in terms else ()):
        assert_within(name, getattr(out, name), ref[name], tol)
    want = sum(
        (u * ref[k]).sum()
        for u, k in zip(p.upstream, ("logp", "entropy", "kl"), strict=True)
        if k in terms
    )
    assert abs(out.loss.item() - float(want)) <= float(
        sum((u.abs() * tol).sum() for u in p.upstream)
    )
    bound = grad_bound(p, ref, tol, False)
    for name, got in grads.items():
        assert_within(name, got, ref[name], bound[name])


def test_transform_gradcheck_float64():
    gen = torch.Generator().manual_seed(7)
    n, h, v = 6, 3, 13
    hidden = torch.randn(n, h, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = (2 * torch.randn(v, h, dtype=torch.float64, generator=gen)).requires_grad_(True)
    bias = torch.randn(v, dtype=torch.float64, generator=gen, requires_grad=True)
    hidden_ref = torch.randn(n, 2, dtype=torch.float64, generator=gen)
    weight_ref = torch.randn(v, 2, dtype=torch.float64, generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)
    a, b, c = (torch.randn(n, dtype=torch.float64, generator=gen) for _ in range(3))
    tr, tr_ref = TRANSFORMS["scale-softcap"], TRANSFORMS["divisor"]
    ref = dict(hidden_ref=hidden_ref, weight_ref=weight_ref, transform_ref=tr_ref)

    def f(hidden, weight, bias):
        out = lp.fused(
            hidden, weight, tokens, bias=bias, temperature=0.9, token_chunk=2, vocab_chunk=4,
            transform=tr, **ref,
        )  # fmt: skip
        return out.logp, out.entropy, out.kl

    def f_logp(hidden, weight, bias):
        return lp.fused(
            hidden, weight, tokens, bias=bias, with_entropy=False, token_chunk=4, vocab_chunk=5,
            transform=tr,
        ).logp  # fmt: skip

    def f_loss(hidden, weight, bias):
        return lp.fused_loss(
            hidden, weight, tokens, bias=bias, temperature=0.9, logp_weight=a, entropy_weight=b,
            kl_weight=c, token_chunk=3, transform=tr, **ref,
        ).loss  # fmt: skip

    def f_loss_logp(hidden, weight, bias):
        return lp.fused_loss(
            hidden, weight, tokens, bias=bias, logp_weight=a, token_chunk=2, transform=tr
        ).loss

    def f_logits(z):
        z_ref = hidden_ref @ weight_ref.t()
        return (
            lp.token_logprobs(z, tokens, temperature=1.3, transform=tr),
            lp.entropy(z, temperature=1.3, transform=tr),
            lp.exact_kl(z, z_ref, temperature=1.3, transform=tr, transform_ref=tr_ref),
        )

    for fn in (f, f_logp, f_loss, f_loss_logp):
        assert torch.autograd.gradcheck(fn, (hidden, weight, bias))
    z = (hidden @ weight.t() + bias).detach().requires_grad_(True)
    assert torch.autograd.gradcheck(f_logits, (z,))


def test_logits_path_with_transform_matches_the_fused_path():
    # The logits path on raw head outputs z = h W^T + b equals the fused path, each transform,
    # float64 (both exact to rounding), and transform_ref defaults to no transform.
    p = make_problem(23, 8, 157, dtype=torch.float64, temperature=0.7, bias=True)
    z = p.hidden @ p.weight.t() + p.bias
    z_ref = p.hidden_ref @ p.weight_ref.t() + p.bias_ref
    for tr in TRANSFORMS.values():
        out = lp.fused(
            p.hidden, p.weight, p.tokens, bias=p.bias, temperature=0.7, hidden_ref=p.hidden_ref,
            weight_ref=p.weight_ref, bias_ref=p.bias_ref, transform=tr,
        )  # fmt: skip
        got = (
            lp.token_logprobs(z, p.tokens, temperature=0.7, transform=tr),
            lp.entropy(z, temperature=0.7, transform=tr),
            lp.exact_kl(z, z_ref, temperature=0.7, transform=tr),
        )
        for g, want in zip(got, out, strict=True):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)


def test_soft_cap_maps_minus_inf_to_minus_the_cap_as_the_model_does():
    cap = LogitTransform.make(softcap=2.0)
    z = torch.tensor([[0.0, -math.inf, 1.0]], dtype=torch.float64, requires_grad=True)
    ent = lp.entropy(z, transform=cap)
    want = torch.tensor([[0.0, -2.0, 2 * math.tanh(0.5)]], dtype=torch.float64)
    assert ent.item() == pytest.approx(float(lp.entropy(want)), rel=1e-12)
    (grad,) = torch.autograd.grad(ent.sum(), z)
    assert grad[0, 1] == 0 and torch.isfinite(grad).all()  # tanh' = 0 at -inf


def test_identity_transform_is_bitwise_the_plain_head():
    p = make_problem(37, 24, 301, dtype=torch.float32, temperature=0.7, bias=True)
    plain, plain_grads = run_fused(p, token_chunk=8, vocab_chunk=64)
    same, same_grads = run_fused(
        Problem(**{**p.__dict__, "transform": LogitTransform(), "transform_ref": LogitTransform()}),
        token_chunk=8,
        vocab_chunk=64,
    )
    for a, b in zip((*plain, *plain_grads.values()), (*same, *same_grads.values()), strict=True):
        assert torch.equal(a, b)


def test_fused_overflow_falls_back_to_the_max_with_a_soft_cap():
    # Soft cap 60: the target's raw logit -100 becomes 60 tanh(-5/3) = -55.8 and the raw +50 on
    # token 250 becomes 60 tanh(5/6) = 40.9; exp(40.9 + 55.8) = exp(96.7) overflows float32.
    v = 300
    weight = torch.zeros(v, 1)
    weight[0], weight[250] = -100.0, 50.0
    weight[1:250, 0] = torch.linspace(-3, 3, 249)
    tokens = torch.tensor([0, 250, 7, 0])
    hidden = torch.ones(4, 1)
    cap = LogitTransform.make(softcap=60.0)
    p = Problem(hidden, weight, None, tokens, hidden, weight.flip(0).clone(), None, 1.0,
                (torch.ones(4, dtype=torch.float64),) * 3, cap, cap)  # fmt: skip
    passes, (out, grads) = max_pass_tiles(lambda: run_fused(p, vocab_chunk=64))
    loss_out, loss_grads = run_fused_loss(p, ("logp", "entropy", "kl"), token_chunk=2)
    assert passes == 2 * 5  # fused's fallback ran, for the policy and the reference: 5 tiles each
    ref = naive(p)
    assert out.logp[0].item() == pytest.approx(float(ref["logp"][0]), rel=1e-6)
    tol = value_tol(p, ref)
    bound = grad_bound(p, ref, tol, False)
    for o, g in ((out, grads), (loss_out, loss_grads)):
        for name in ("logp", "entropy", "kl"):
            assert torch.isfinite(getattr(o, name)).all()
            assert_within(name, getattr(o, name), ref[name], tol)
        for name, got in g.items():
            assert_within(name, got, ref[name], bound[name])


def test_fused_with_a_soft_cap_saves_only_inputs_and_per_token_floats():
    n, h, v = 256, 16, 4000
    p = make_problem(n, h, v, dtype=torch.float32, transform=TRANSFORMS["softcap"])
    hidden = p.hidden.clone().requires_grad_(True)
    out, saved = saved_bytes(
        lambda: lp.fused(
            hidden, p.weight, p.tokens, hidden_ref=p.hidden_ref, weight_ref=p.weight_ref,
            transform=p.transform, transform_ref=p.transform_ref,
        )
    )  # fmt: skip
    inputs = sum(t.numel() * t.element_size() for t in (hidden, p.weight, p.tokens,
                 p.hidden_ref, p.weight_ref))  # fmt: skip
    assert all(math.prod(s) < n * v / 4 for s, _ in saved)  # no tile (nor its slope)
    assert sum(b for _, b in saved) <= inputs + 8 * 8 * n  # as without a transform
    (out.logp.sum() + out.entropy.sum() + out.kl.sum()).backward()


def test_transform_errors_name_the_problem():
    p = make_problem(4, 3, 10, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"transform must be a klpo\.logprobs\.LogitTransform"):
        lp.fused(p.hidden, p.weight, p.tokens, transform={"softcap": 30.0})
    with pytest.raises(TypeError, match=r"transform_ref must be a klpo\.logprobs\.LogitTransform"):
        lp.exact_kl(torch.zeros(2, 3), torch.zeros(2, 3), transform_ref=30.0)
    for bad in (LogitTransform(scale=0.0), LogitTransform(softcap=-1.0), LogitTransform(math.nan)):
        with pytest.raises(ValueError, match=r"logit transform's (scale|softcap) must be finite"):
            lp.fused_loss(p.hidden, p.weight, p.tokens, logp_weight=torch.ones(4), transform=bad)
    with pytest.raises(ValueError, match="divisor must be finite and > 0"):
        LogitTransform.divided_by(0.0)


# ---------------------------------------------------------------------------------------------
# One number per row: the same bits whatever the batch, the tiles or the function, and exactly
# zero KL (value and gradient) between a model and itself.


def _head_case(dtype: torch.dtype, n: int = 40, h: int = 24, vocab: int = 2600):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(vocab, h, generator=g) * 0.4).to(dtype)
    hid = torch.randn(n, h, generator=g).to(dtype)
    w_ref = (w.float() + 0.05 * torch.randn(vocab, h, generator=g)).to(dtype)
    tokens = torch.randint(0, vocab, (n,), generator=g)
    return hid, w, w_ref, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_outputs_do_not_depend_on_its_batch_its_tiles_or_the_function(dtype):
    # The vocabulary sums are added in blocks of SUM_BLOCK, in vocabulary order, so a row scored
    # alone, in a micro-batch or in the whole batch, in tiles of 512 or 2048 entries or in one
    # tile of the whole vocabulary (fused_loss), has one log-prob, entropy and KL. Before, the
    # sums followed the tiles (a row's log-prob moved by ~1e-6 between a batch of 40 and 600
    # tokens at V = 49152), and fused_loss's column sums differed from fused's.
    hid, w, w_ref, tokens = _head_case(dtype)
    whole = lp.fused(hid, w, tokens, hidden_ref=hid, weight_ref=w_ref, vocab_chunk=512)
    for rows, chunk in ((slice(0, 40), 2048), (slice(3, 5), 1024), (slice(7, 30), None)):
        part = lp.fused(
            hid[rows], w, tokens[rows], hidden_ref=hid[rows], weight_ref=w_ref, vocab_chunk=chunk
        )
        for a, b in zip(part, whole, strict=True):
            assert torch.equal(a, b[rows])
    fl = lp.fused_loss(
        hid, w, tokens, hidden_ref=hid, weight_ref=w_ref, logp_weight=torch.ones(40),
        entropy_weight=torch.ones(40), kl_weight=torch.ones(40), token_chunk=16,
    )  # fmt: skip
    for a, b in zip((fl.logp, fl.entropy, fl.kl), whole, strict=True):
        assert torch.equal(a, b)
    # and they are the right numbers: the float64 logits' (module docstring's precision)
    x = hid.double() @ w.double().T
    logp = x.log_softmax(-1)
    lp_ref = (hid.double() @ w_ref.double().T).log_softmax(-1)
    want_kl = (logp.exp() * (logp - lp_ref)).sum(-1)
    torch.testing.assert_close(whole.logp.double(), logp.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(whole.kl.double(), want_kl, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["fused", "fused_loss", "logits"])
def test_the_kl_of_a_model_and_itself_is_exactly_zero_and_so_is_its_gradient(dtype, path):
    # KL(p‖p) = 0 in exact arithmetic; computed the same way for both models (the reference's
    # normaliser summed as the policy's, log pi - log pi_ref formed before it is weighted) it is
    # 0 in floating point too: value and gradient. Before, fused's reference normaliser was
    # summed in another order (KL(p‖p) ~1e-7 per token here, 1.5e-5 on SmolLM2 in float32), and
    # the gradient was beta log pi - beta log pi_ref rounded twice (a norm of ~1e-9, which AdamW
    # turns into steps of the learning rate's size).
    hid, w, _, tokens = _head_case(dtype)
    h = hid.clone().requires_grad_()
    wt = w.clone().requires_grad_()
    if path == "fused":
        kl = lp.fused(h, wt, tokens, hidden_ref=hid, weight_ref=w, vocab_chunk=512).kl
        kl.sum().backward()
    elif path == "fused_loss":
        kl = lp.fused_loss(
            h, wt, tokens, hidden_ref=hid, weight_ref=w, kl_weight=torch.ones(40),
            logp_weight=torch.zeros(40),
        ).kl  # fmt: skip
        lp.fused_loss(
            h, wt, tokens, hidden_ref=hid, weight_ref=w, kl_weight=torch.ones(40)
        ).loss.backward()
    else:
        kl = lp.exact_kl(h @ wt.T, hid @ w.T)
        kl.sum().backward()
    assert torch.count_nonzero(kl) == 0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(wt.grad) == 0
    # a second model that differs gets a nonzero KL and gradient (the test can fail)
    h.grad = wt.grad = None
    other = lp.fused(h, wt, tokens, hidden_ref=hid, weight_ref=w * 1.1).kl
    other.sum().backward()
    assert bool((other > 0).any()) and torch.count_nonzero(h.grad) > 0


@pytest.mark.parametrize("rows", [1, 2, 3, 511, 512, 513, 1025, 8 * 512 + 7, 9 * 512])
def test_column_sums_are_one_number_per_column_whatever_the_other_columns(rows):
    # The fixed tree of elementwise adds gives a column the same bits in a tile of 1, 3 or 300
    # columns (a BLAS ones @ block does not, on AVX-512 MKL), and the sum of float64's within
    # the float32 rounding of a sum of `rows` terms.
    from klpo._logits import add_column_dots, add_column_sums

    g = torch.Generator().manual_seed(rows)
    a = torch.rand(rows, 300, generator=g) * 3
    b = torch.randn(rows, 300, generator=g)
    wide_s, wide_d = torch.zeros(300), torch.zeros(300)
    add_column_sums(wide_s, a)
    add_column_dots(wide_d, a, b)
    for cols in (slice(0, 1), slice(5, 8), slice(17, 300)):
        s, d = torch.zeros(cols.stop - cols.start), torch.zeros(cols.stop - cols.start)
        add_column_sums(s, a[:, cols].contiguous())
        add_column_dots(d, a[:, cols].contiguous(), b[:, cols].contiguous())
        assert torch.equal(s, wide_s[cols]) and torch.equal(d, wide_d[cols])
    exact_s, exact_d = a.double().sum(0), (a.double() * b.double()).sum(0)
    eps = torch.finfo(torch.float32).eps
    depth = math.ceil(math.log2(512)) + math.ceil(rows / 512)  # the tree, then the blocks in order
    scale = (a.double() * b.double()).abs().sum(0)
    assert ((wide_s.double() - exact_s).abs() <= 2 * depth * eps * exact_s).all()
    assert ((wide_d.double() - exact_d).abs() <= 2 * depth * eps * scale).all()
    before = torch.ones(300)
    add_column_sums(before, a)  # adds to what is there
    assert torch.allclose(before, wide_s + 1)
