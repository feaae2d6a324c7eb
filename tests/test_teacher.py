"""The teacher divergences against float64 oracles: values by direct summation over the
vocabulary, gradients by the closed forms derived in klpo.teacher's notes (and gradcheck),
identities between the forms, and the compatibility switches' zero gradients."""

from __future__ import annotations

import math

import pytest
import torch

from klpo import teacher
from klpo.logprobs import exact_kl

F64 = torch.float64


def _pair(
    seed: int, n: int = 5, v: int = 7, scale: float = 2.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(n, v, generator=g, dtype=F64)
    zt = scale * torch.randn(n, v, generator=g, dtype=F64)
    return z, zt


def _naive(z: torch.Tensor, zt: torch.Tensor, t: float = 1.0):
    """q, p and their logs, by the textbook softmax, one row at a time (float64)."""
    q = [[math.exp(x / t) for x in row] for row in z.tolist()]
    p = [[math.exp(x / t) for x in row] for row in zt.tolist()]
    q = [[x / sum(r) for x in r] for r in q]
    p = [[x / sum(r) for x in r] for r in p]
    return torch.tensor(q, dtype=F64), torch.tensor(p, dtype=F64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_kl_value_and_its_gradient_q_minus_p(temperature: float) -> None:
    z, zt = _pair(0)
    z.requires_grad_(True)
    q, p = _naive(z.detach(), zt, temperature)
    want = (p * (p.log() - q.log())).sum(-1)
    got = teacher.forward_kl(z, zt, temperature=temperature)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), z)
    assert torch.allclose(grad, (q - p) / temperature, rtol=0, atol=1e-12)
    assert zt.grad is None


def test_jsd_is_forward_and_reverse_at_its_ends_and_bounded_between() -> None:
    z, zt = _pair(1)
    q, p = _naive(z, zt)
    assert torch.equal(teacher.jsd(z, zt, 0.0), teacher.forward_kl(z, zt))
    assert torch.allclose(teacher.jsd(z, zt, 1.0), exact_kl(z, zt), rtol=0, atol=1e-12)
    for beta in (0.1, 0.5, 0.9):
        m = (1 - beta) * q + beta * p
        want = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
        got = teacher.jsd(z, zt, beta)
        assert torch.allclose(got, want, rtol=0, atol=1e-12)
        bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
        assert bool((got >= 0).all()) and bool((got <= bound + 1e-12).all())
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\]"):
        teacher.jsd(z, zt, 1.5)


@pytest.mark.parametrize("beta", [0.25, 0.5, 0.8])
def test_jsd_gradient_is_the_closed_form(beta: float) -> None:
    z, zt = _pair(2)
    z.requires_grad_(True)
    q, p = _naive(z.detach(), zt)
    m = (1 - beta) * q + beta * p
    kl_qm = (q * (q / m).log()).sum(-1, keepdim=True)
    want = (1 - beta) * q * (q.log() - m.log() - kl_qm)
    (grad,) = torch.autograd.grad(teacher.jsd(z, zt, beta).sum(), z)
    assert torch.allclose(grad, want, rtol=0, atol=1e-12)


def test_the_teachers_topk_are_its_likeliest_tokens_unnormalised() -> None:
    _, zt = _pair(3)
    logp, ids = teacher.teacher_topk(zt, 3)
    _, p = _naive(zt, zt)
    for row in range(zt.shape[0]):
        order = sorted(range(zt.shape[1]), key=lambda v: -p[row, v].item())[:3]
        assert ids[row].tolist() == order
        assert torch.allclose(logp[row].exp(), p[row, order], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="k must be an integer"):
        teacher.teacher_topk(zt, 0)


def test_topk_forward_kl_is_the_truncated_sum_with_its_gradient() -> None:
    z, zt = _pair(4)
    z.requires_grad_(True)
    q, p = _naive(z.detach(), zt)
    logp, ids = teacher.teacher_topk(zt, 3)
    got = teacher.topk_forward_kl(z, logp, ids)
    want = torch.stack(
        [sum(p[r, i] * (p[r, i].log() - q[r, i].log()) for i in ids[r].tolist()) for r in range(5)]
    )
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), z)
    big_p = p.gather(-1, ids).sum(-1, keepdim=True)
    on_k = torch.zeros_like(p).scatter(-1, ids, p.gather(-1, ids))
    assert torch.allclose(grad, big_p * q - on_k, rtol=0, atol=1e-12)  # (P q - p 1[K]) / T


def test_verls_clamp_zeroes_the_whole_positions_gradient_where_the_sum_is_negative() -> None:
    z = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.5, 0.0]], dtype=F64, requires_grad=True)
    logp, ids = teacher.teacher_topk(torch.tensor([[1.0, 0.0, 0.0]] * 2, dtype=F64), 1)
    plain = teacher.topk_forward_kl(z, logp, ids)
    assert plain[0] < 0 < plain[1]  # the sharper student's row is negative
    clamped = teacher.topk_forward_kl(z, logp, ids, clamp_zero=True)
    assert clamped[0] == 0 and clamped[1] == plain[1]
    (grad,) = torch.autograd.grad(clamped.sum(), z)
    assert bool((grad[0] == 0).all()) and bool((grad[1] != 0).any())


def test_the_log_prob_floor_takes_the_floored_tokens_gradient_away() -> None:
    z = torch.tensor([[0.0, -30.0, 0.0]], dtype=F64, requires_grad=True)
    ids = torch.tensor([[0, 1]])
    logp = torch.log(torch.tensor([[0.5, 0.3]], dtype=F64))
    floored = teacher.topk_forward_kl(z, logp, ids, log_prob_floor=-10.0)
    q1 = float(torch.log_softmax(z.detach(), -1)[0, 1])
    assert q1 < -10.0
    want = 0.5 * (math.log(0.5) - float(torch.log_softmax(z.detach(), -1)[0, 0])) + 0.3 * (
        math.log(0.3) + 10.0
    )
    assert math.isclose(float(floored.detach()), want, rel_tol=0, abs_tol=1e-12)
    (grad,) = torch.autograd.grad(floored.sum(), z)
    q = torch.softmax(z.detach(), -1)
    # only token 0's term carries a gradient: 0.5 (q - e_0)
    assert torch.allclose(grad, 0.5 * (q - torch.tensor([[1.0, 0.0, 0.0]], dtype=F64)), atol=1e-12)


def test_the_tail_bucket_makes_a_kl_below_the_forward_kl_and_exact_at_k_v_minus_1() -> None:
    for seed in range(5):
        z, zt = _pair(10 + seed)
        full = teacher.forward_kl(z, zt)
        for k in (1, 3, 5):
            logp, ids = teacher.teacher_topk(zt, k)
            tail = teacher.topk_tail_kl(z, logp, ids)
            assert bool((tail >= 0).all()) and bool((tail <= full + 1e-12).all())
        logp, ids = teacher.teacher_topk(zt, zt.shape[-1] - 1)  # the tail is one token: exact
        assert torch.allclose(teacher.topk_tail_kl(z, logp, ids), full, rtol=0, atol=1e-10)


def test_the_tail_bucket_stays_finite_for_a_student_sharper_than_float32() -> None:
    # The student puts 1 - 6e-9 on the teacher's top token: in float32 its top-k mass rounds to
    # 1, where log(1 - Q) was -inf and the gradient NaN (every top-k-tail run of the distillation
    # study diverged so). The oracle: the two-bucket KL and its gradient in float64.
    zt = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1]]))
    logp, ids = teacher.teacher_topk(zt, 1)
    z = torch.tensor([[20.0, 0.0, 0.0, 0.0]], requires_grad=True)
    got = teacher.topk_tail_kl(z, logp, ids)
    (grad,) = torch.autograd.grad(got.sum(), z)

    z64 = z.detach().double().requires_grad_(True)
    q = torch.softmax(z64, -1)
    p_top = logp.double().exp()[0, 0]
    q_tail = q[0, 1:].sum()  # 1 - Q summed outside the top k, not 1 - Q
    want = p_top * (p_top.log() - q[0, 0].log()) + (1 - p_top) * ((1 - p_top).log() - q_tail.log())
    (want_grad,) = torch.autograd.grad(want, z64)
    assert torch.isfinite(got).all() and torch.isfinite(grad).all()
    assert math.isclose(float(got), float(want), rel_tol=1e-5)  # 5.56 nats, float32's rounding
    assert torch.allclose(grad.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_student_topk_is_the_reverse_kl_at_k_v_and_truncated_below() -> None:
    z, zt = _pair(5)
    assert torch.allclose(teacher.student_topk_kl(z, zt, 7), exact_kl(z, zt), atol=1e-12)
    q, p = _naive(z, zt)
    got = teacher.student_topk_kl(z, zt, 2)
    for r in range(5):
        top = sorted(range(7), key=lambda v: -q[r, v].item())[:2]
        want = sum(q[r, i] * (q[r, i].log() - p[r, i].log()) for i in top)
        assert math.isclose(float(got[r]), float(want), abs_tol=1e-12)
    # verl#7806's review: q = (0.6, 0.4), p = (0.9, 0.1), k = 1: -0.243279, where the KL is 0.311
    zq = torch.log(torch.tensor([[0.6, 0.4]], dtype=F64)).requires_grad_(True)
    zp = torch.log(torch.tensor([[0.9, 0.1]], dtype=F64))
    assert math.isclose(float(teacher.student_topk_kl(zq, zp, 1).detach()), -0.243279, abs_tol=1e-6)
    assert math.isclose(float(exact_kl(zq, zp).detach()), 0.311239, abs_tol=1e-6)
    clamped = teacher.student_topk_kl(zq, zp, 1, clamp_zero=True)
    (grad,) = torch.autograd.grad(clamped.sum(), zq)
    assert float(clamped.detach()) == 0.0 and bool((grad == 0).all())


@pytest.mark.parametrize(
    "fn",
    [
        lambda z, zt: teacher.forward_kl(z, zt, temperature=0.8),
        lambda z, zt: teacher.jsd(z, zt, 0.3),
        lambda z, zt: teacher.topk_forward_kl(z, *teacher.teacher_topk(zt, 3)),
        lambda z, zt: teacher.topk_tail_kl(z, *teacher.teacher_topk(zt, 3)),
        lambda z, zt: teacher.student_topk_kl(z, zt, 3),
    ],
)
def test_gradcheck_in_float64(fn) -> None:
    z, zt = _pair(6, n=3, v=6)
    torch.autograd.gradcheck(lambda x: fn(x, zt), (z.requires_grad_(True),))


def test_chunks_change_nothing(monkeypatch) -> None:
    z, zt = _pair(7, n=9, v=5)
    z32, zt32 = z.float().requires_grad_(True), zt.float()
    whole = teacher.jsd(z32, zt32, 0.4)
    (g_whole,) = torch.autograd.grad(whole.sum(), z32)
    monkeypatch.setattr(teacher, "ROW_ELEMENTS", 10)  # 2 rows a chunk: 5 chunks, recomputed
    chunked = teacher.jsd(z32, zt32, 0.4)
    (g_chunked,) = torch.autograd.grad(chunked.sum(), z32)
    assert torch.equal(whole, chunked) and torch.equal(g_whole, g_chunked)
    assert whole.dtype == torch.float32


def test_bad_inputs_name_the_argument() -> None:
    z, zt = _pair(8)
    with pytest.raises(ValueError, match="logits_teacher"):
        teacher.forward_kl(z, zt[:, :3])
    logp, ids = teacher.teacher_topk(zt, 2)
    with pytest.raises(ValueError, match="teacher_topk_ids must be an integer tensor"):
        teacher.topk_forward_kl(z, logp, ids.float())
    with pytest.raises(ValueError, match="must have the positions of logits"):
        teacher.topk_forward_kl(z[:2], logp, ids)


@pytest.mark.parametrize(("divergence", "beta"), [("reverse", 0.5), ("forward", 0.5), ("jsd", 0.3)])
def test_from_hidden_equals_the_logits_forms_values_and_gradients(divergence, beta) -> None:
    g = torch.Generator().manual_seed(11)
    h, w, b = (torch.randn(s, generator=g, dtype=F64) for s in ((9, 4), (7, 4), (7,)))
    ht, wt, bt = (torch.randn(s, generator=g, dtype=F64) for s in ((9, 6), (7, 6), (7,)))
    up = torch.randn(9, generator=g, dtype=F64)
    ref = {"reverse": teacher.reverse_kl, "forward": teacher.forward_kl}.get(
        divergence, lambda z, zt, **kw: teacher.jsd(z, zt, beta, **kw)
    )
    leaves = [x.clone().requires_grad_(True) for x in (h, w, b)]
    want = ref(leaves[0] @ leaves[1].T + leaves[2], ht @ wt.T + bt, temperature=0.7)
    (want * up).sum().backward()
    mine = [x.clone().requires_grad_(True) for x in (h, w, b)]
    got = teacher.from_hidden(
        mine[0], mine[1], ht, wt, divergence=divergence, beta=beta, bias=mine[2],
        bias_teacher=bt, temperature=0.7, row_chunk=4,
    )  # fmt: skip
    (got * up).sum().backward()
    assert torch.allclose(got, want.detach(), rtol=0, atol=1e-12)
    for a, b_ in zip(mine, leaves, strict=True):
        assert torch.allclose(a.grad, b_.grad, rtol=0, atol=1e-12)


def test_from_hidden_refuses_what_it_cannot_score() -> None:
    h, w = torch.zeros(3, 4), torch.zeros(5, 4)
    with pytest.raises(ValueError, match="divergence must be one of"):
        teacher.from_hidden(h, w, h, w, divergence="tv")
    with pytest.raises(ValueError, match="same positions over the same vocabulary"):
        teacher.from_hidden(h, w, h[:2], w)
    assert torch.equal(
        teacher.from_hidden(h, w, h, w, divergence="jsd", beta=1.0),
        teacher.from_hidden(h, w, h, w, divergence="reverse"),
    )


# --------------------------------------------------------------------------------------------
# from_hidden_loss: the weighted sum with its gradient taken in the forward pass.


def _naive_divergence(z: torch.Tensor, zt: torch.Tensor, kind: str, beta: float) -> torch.Tensor:
    """The textbook divergence from full ``[N, V]`` logits (temperature applied), float64."""
    log_q, log_p = torch.log_softmax(z, -1), torch.log_softmax(zt, -1)
    q, p = log_q.exp(), log_p.exp()
    if kind == "reverse":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "forward":
        return (p * (log_p - log_q)).sum(-1)
    log_m = torch.log((1 - beta) * q + beta * p)
    return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)


def _loss_inputs(seed: int = 12) -> dict[str, torch.Tensor]:
    """N = 9 positions (a row_chunk of 4 leaves a tile of 1), V = 7, H = 4 against H_T = 6, and
    weights with zeros and a negative one."""
    g = torch.Generator().manual_seed(seed)
    x = {
        k: torch.randn(s, generator=g, dtype=F64)
        for k, s in (("h", (9, 4)), ("w", (7, 4)), ("b", (7,)), ("ht", (9, 6)), ("wt", (7, 6)),
                     ("bt", (7,)))
    }  # fmt: skip
    x["c"] = torch.tensor([0.5, 0.0, 1.5, 0.25, 0.0, -0.75, 2.0, 1.0, 0.125], dtype=F64)
    return x


DIVERGENCE_CASES = [("reverse", 0.5), ("forward", 0.5), ("jsd", 0.3)]


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCE_CASES)
def test_from_hidden_loss_is_the_naive_weighted_sum_values_and_gradients(divergence, beta) -> None:
    x, t = _loss_inputs(), 0.7
    leaves = [x[k].clone().requires_grad_(True) for k in ("h", "w", "b")]
    z = (leaves[0] @ leaves[1].T + leaves[2]) / t
    want = _naive_divergence(z, (x["ht"] @ x["wt"].T + x["bt"]) / t, divergence, beta)
    (x["c"] * want).sum().backward()
    mine = [x[k].clone().requires_grad_(True) for k in ("h", "w", "b")]
    out = teacher.from_hidden_loss(
        mine[0], mine[1], x["ht"], x["wt"], x["c"], divergence=divergence, beta=beta,
        bias=mine[2], bias_teacher=x["bt"], temperature=t, row_chunk=4,
    )  # fmt: skip
    out.loss.backward()
    assert not out.value.requires_grad and out.loss.dtype == F64
    assert torch.allclose(out.value, want.detach(), rtol=0, atol=1e-12)
    assert torch.allclose(out.loss, (x["c"] * want).sum().detach(), rtol=0, atol=1e-12)
    for name, a, b in zip(("hidden", "weight", "bias"), mine, leaves, strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-12), name
    # a position weighted 0 contributes nothing: its hidden state's gradient is exactly 0
    assert torch.equal(mine[0].grad[[1, 4]], torch.zeros(2, 4, dtype=F64))


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCE_CASES)
def test_from_hidden_loss_equals_from_hiddens_weighted_sum(divergence, beta) -> None:
    x = _loss_inputs(13)
    kw = {"divergence": divergence, "beta": beta, "bias_teacher": x["bt"], "temperature": 1.3}
    lazy = [x[k].clone().requires_grad_(True) for k in ("h", "w", "b")]
    value = teacher.from_hidden(lazy[0], lazy[1], x["ht"], x["wt"], bias=lazy[2], **kw)
    (x["c"] * value).sum().backward()
    eager = [x[k].clone().requires_grad_(True) for k in ("h", "w", "b")]
    out = teacher.from_hidden_loss(
        eager[0], eager[1], x["ht"], x["wt"], x["c"], bias=eager[2], row_chunk=2, **kw
    )
    (3.0 * out.loss).backward()  # the backward pass scales by the upstream gradient
    assert torch.allclose(out.value, value.detach(), rtol=0, atol=1e-12)
    for a, b in zip(eager, lazy, strict=True):
        assert torch.allclose(a.grad, 3.0 * b.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCE_CASES)
def test_a_frozen_head_gets_no_gradient_and_no_gemm(divergence, beta, monkeypatch) -> None:
    """A LoRA student's head (``requires_grad`` false): the hidden states' gradient as with a
    trainable head, the head's never formed. GEMMs counted: from_hidden_loss spends 2 logit
    tiles + 1 gradient a tile (3 tiles of 4, 4, 1 rows), from_hidden's backward no addmm_."""
    x = _loss_inputs(14)
    h_free, w_free = x["h"].clone().requires_grad_(True), x["w"].clone().requires_grad_(True)
    free = teacher.from_hidden_loss(
        h_free, w_free, x["ht"], x["wt"], x["c"], divergence=divergence, beta=beta, row_chunk=4
    )
    free.loss.backward()
    calls = {"mm": 0, "addmm_": 0}
    mm, addmm_ = torch.mm, torch.Tensor.addmm_

    def count_mm(*a, **k):
        calls["mm"] += 1
        return mm(*a, **k)

    def count_addmm_(self, *a, **k):
        calls["addmm_"] += 1
        return addmm_(self, *a, **k)

    monkeypatch.setattr(torch, "mm", count_mm)
    monkeypatch.setattr(torch.Tensor, "addmm_", count_addmm_)
    h = x["h"].clone().requires_grad_(True)
    out = teacher.from_hidden_loss(
        h, x["w"], x["ht"], x["wt"], x["c"], divergence=divergence, beta=beta, row_chunk=4
    )
    assert calls == {"mm": 3 * 3, "addmm_": 0}
    assert out.loss.grad_fn.saved_tensors[1:] == (None, None)  # no head or bias gradient held
    out.loss.backward()
    assert torch.allclose(h.grad, h_free.grad, rtol=0, atol=1e-12)
    h2 = x["h"].clone().requires_grad_(True)
    value = teacher.from_hidden(h2, x["w"], x["ht"], x["wt"], divergence=divergence, beta=beta)
    (x["c"] * value).sum().backward()
    assert calls["addmm_"] == 0 and x["w"].grad is None
    assert torch.allclose(h2.grad, h_free.grad, rtol=0, atol=1e-12)


def test_from_hidden_loss_without_gradients_and_at_the_teacher() -> None:
    x = _loss_inputs(15)
    with torch.no_grad():
        out = teacher.from_hidden_loss(x["h"], x["w"], x["ht"], x["wt"], x["c"], divergence="jsd")
    assert out.loss.grad_fn is None and not out.loss.requires_grad
    assert torch.allclose(out.value, teacher.from_hidden(x["h"], x["w"], x["ht"], x["wt"],
                          divergence="jsd"), rtol=0, atol=1e-12)  # fmt: skip
    # a student equal to its teacher (float32, the trainer's first step): KL and its gradient
    # exactly 0, in both directions
    h, w = x["h"].float().requires_grad_(True), x["w"].float().requires_grad_(True)
    for divergence in ("reverse", "forward"):
        got = teacher.from_hidden_loss(
            h, w, h.detach(), w.detach(), torch.ones(9), divergence=divergence, temperature=0.7
        )
        got.loss.backward()
        assert float(got.loss) == 0.0 and torch.equal(got.value, torch.zeros(9))
        assert not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize(("divergence", "beta"), DIVERGENCE_CASES)
def test_from_hidden_loss_gradcheck_in_float64(divergence, beta) -> None:
    x = _loss_inputs(16)

    def loss(h, w, b):
        return teacher.from_hidden_loss(
            h, w, x["ht"], x["wt"], x["c"], divergence=divergence, beta=beta, bias=b,
            temperature=0.9, row_chunk=5,
        ).loss  # fmt: skip

    torch.autograd.gradcheck(loss, tuple(x[k].clone().requires_grad_(True) for k in "hwb"))


def test_from_hidden_loss_refuses_bad_weights() -> None:
    x = _loss_inputs()
    with pytest.raises(ValueError, match=r"weights has shape \(8,\) but hidden has 9 positions"):
        teacher.from_hidden_loss(x["h"], x["w"], x["ht"], x["wt"], x["c"][:8])
    with pytest.raises(TypeError, match="weights"):
        teacher.from_hidden_loss(x["h"], x["w"], x["ht"], x["wt"], torch.ones(9, dtype=torch.long))
    with pytest.raises(ValueError, match="row_chunk must be a positive int"):
        teacher.from_hidden_loss(x["h"], x["w"], x["ht"], x["wt"], x["c"], row_chunk=0)
    with pytest.raises(ValueError, match="from_hidden_loss: hidden_teacher"):
        teacher.from_hidden_loss(x["h"], x["w"], x["ht"], x["w"], x["c"])
