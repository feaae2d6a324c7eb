"""klpo explain --teacher: the labels enumeration derives match the ones derived by hand
(klpo.teacher's notes, DESIGN's table with the teacher in the reference's place), the clamps
bind where a sharper student makes the truncated sum negative, and the command prints them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
