"""klpo explain --teacher: the labels enumeration derives match the ones derived by hand
(klpo.teacher's notes, DESIGN's table with the teacher in the reference's place), the clamps
bind where a sharper student makes the truncated sum negative, and the command prints them; the
frameworks' renormalised top-k forms equal their hand sums and closed-form gradients, and the
shipped table (read by the doctor without torch) is the enumeration's, regenerated unchanged."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from klpo.lab import teacher as opd

REV, FWD = opd.REVERSE, opd.FORWARD


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str], dict[str, opd.PositionRow]]:
    out: dict[tuple[str, str], dict[str, opd.PositionRow]] = {}
    for family in ("near", "sharp"):
        for r in opd.position_rows(family, n=8):
            out.setdefault((r.term, r.placement), {})[family] = r
    return out


# (term, placement): (the value it equals, the gradient it follows), by hand
BY_HAND = {
    ("k1", "reward"): (REV, REV),  # E[k1] = reverse KL; the REINFORCE penalty follows its gradient
    ("k1", "loss"): (REV, "zero"),  # E[grad log pi] = 0
    ("k2", "loss"): ("none", REV),  # biased value, the reverse KL's gradient per position
    ("k3", "loss"): (REV, FWD),  # logs the reverse KL, follows the forward one
    ("reverse (exact)", "loss"): (REV, REV),
    ("forward (exact)", "loss"): (FWD, FWD),
    ("jsd 0.5", "loss"): ("JSD_0.5", "its own (JSD_0.5)"),
}


def test_each_terms_value_and_gradient_are_the_ones_derived_by_hand(rows) -> None:
    for key, (value, gradient) in BY_HAND.items():
        for family, r in rows[key].items():
            assert (r.value, r.gradient) == (value, gradient), (key, family)


def test_the_truncated_forms_follow_no_divergence(rows) -> None:
    for (term, _), by_family in rows.items():
        if "top-" in term:
            for r in by_family.values():
                assert r.value in ("none",) and r.gradient == "other", term
                assert r.cos_reverse < 0.99 and r.cos_forward < 0.99, term


def test_verls_clamp_binds_only_where_the_student_is_sharper(rows) -> None:
    clamp = rows[(f"teacher top-{opd.K} fwd, clamp", "loss")]
    assert clamp["sharp"].clamp_binds > 0  # the student's top-k mass above the teacher's
    plain = rows[(f"teacher top-{opd.K} fwd", "loss")]
    assert plain["sharp"].clamp_binds == 0  # no clamp, nothing binds


def test_over_a_sequence_only_returns_to_go_follow_the_sequence_kl() -> None:
    got = {(r.term, r.credit): r for r in opd.sequence_rows(n=2)}
    follows = {k for k, r in got.items() if r.follows}
    assert follows == {
        ("k1", "reward -d_t, returns-to-go"),
        ("full", "reward + loss, exact per position"),
    }
    # discount 0 is exactly the exact KL in the loss: both the per-position gradient
    a = got[("k1", "reward -d_t, discount 0 (Tinker)")]
    b = got[("full", "loss, exact per position")]
    assert a.cos_sequence == pytest.approx(b.cos_sequence, abs=1e-12) and a.rel_error > 0.01


def test_klpo_explain_teacher_prints_the_tables_in_80_columns_and_json() -> None:
    cmd = [sys.executable, "-m", "klpo", "explain", "--teacher"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300).stdout
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    assert any(line.startswith("k3 ") and " reverse  forward " in line for line in lines)
    data = json.loads(
        subprocess.run(
            [*cmd, "--json"], capture_output=True, text=True, check=True, timeout=300
        ).stdout
    )
    assert {"k", "positions", "sequences"} <= set(data) and len(data["sequences"]) == 5


# --- the frameworks' renormalised top-k forms, by hand (V = 3, k = 2) ---------------------------

Q3 = (0.5, 0.3, 0.2)  # the student
P3 = (0.2, 0.5, 0.3)  # the teacher: its top-2 is {1, 2}, the student's {0, 1}


def _kl_by_hand(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))


def _logits(p: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(p, dtype=torch.float64).log()


def test_nemo_rls_renormalised_topk_kl_equals_the_hand_sum() -> None:
    # On the teacher's top-2 {1, 2}: p^K = (0.5, 0.3)/0.8, q^K = (0.3, 0.2)/0.5
    p_k, q_k = (0.625, 0.375), (0.6, 0.4)
    fwd, rev = _kl_by_hand(p_k, q_k), _kl_by_hand(q_k, p_k)  # 0.0013118, 0.0013068
    z, zt = _logits(Q3), _logits(P3)
    got = {k: float(opd.renormalised_topk_kl(z, zt, 2, k)) for k in ("forward", "reverse", "mixed")}
    assert got["forward"] == pytest.approx(fwd, rel=1e-12)
    assert got["reverse"] == pytest.approx(rev, rel=1e-12)
    assert got["mixed"] == pytest.approx(0.5 * fwd + 0.5 * rev, rel=1e-12)
    with pytest.raises(ValueError, match="kind"):
        opd.renormalised_topk_kl(z, zt, 2, "jsd")


def test_the_renormalised_forms_gradients_are_their_closed_forms() -> None:
    """Renormalising over K is a softmax of the gathered logits, so d KL(p^K ‖ q^K) / d z_i is
    q^K_i - p^K_i on K and 0 off it; d KL(q^K ‖ p^K) / d z_i = q^K_i (log q^K_i / p^K_i - KL)."""
    gen = torch.Generator().manual_seed(3)
    z, zt = (torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(2))
    k = 3
    ids = zt.topk(k).indices
    q_k, p_k = torch.softmax(z[ids], -1), torch.softmax(zt[ids], -1)
    for kind in ("forward", "reverse"):
        theta = z.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(opd.renormalised_topk_kl(theta, zt, k, kind), theta)
        want = torch.zeros(7, dtype=torch.float64)
        if kind == "forward":
            want[ids] = q_k - p_k
        else:
            log_ratio = (q_k / p_k).log()
            want[ids] = q_k * (log_ratio - (q_k * log_ratio).sum())
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)


def test_sdpos_student_topk_forms_equal_the_hand_sums() -> None:
    # On the student's top-2 {0, 1}: q = (0.5, 0.3), p = (0.2, 0.5); tails 0.2 and 0.3
    renorm = _kl_by_hand((0.625, 0.375), (0.2 / 0.7, 0.5 / 0.7))  # 0.2475907
    tail = _kl_by_hand((0.5, 0.3, 0.2), (0.2, 0.5, 0.3))  # the 3 buckets: here the whole KL
    z, zt = _logits(Q3), _logits(P3)
    assert float(opd.student_topk_bucket_kl(z, zt, 2, tail=False)) == pytest.approx(renorm, 1e-12)
    assert float(opd.student_topk_bucket_kl(z, zt, 2, tail=True)) == pytest.approx(tail, 1e-12)


# --- the shipped table --------------------------------------------------------------------------


def test_the_shipped_teacher_table_is_regenerated_unchanged() -> None:
    from importlib import resources

    from klpo import registry

    shipped = resources.files("klpo").joinpath("assets", registry.TEACHER_TABLE).read_text("utf-8")
    assert opd.table_text() == shipped, "run `python -m klpo.lab.tables` and commit it"
    # the torch-free reader answers from it as the enumeration does
    rows = {
        (r.key, r.placement, r.family): r for f in ("near", "sharp") for r in opd.position_rows(f)
    }
    for (key, placement, family), r in rows.items():
        got = registry.teacher_positions(key, placement)[family]
        assert (got["value"], got["gradient"]) == (r.value, r.gradient), key
    seq = registry.teacher_sequence("k1", "reward", "token")
    assert seq is not None and seq["follows"] is False
    assert registry.teacher_positions("no-such-term") == {}
