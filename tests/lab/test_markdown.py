"""klpo.lab.markdown: the report's numbers and tables, checked by hand."""

from __future__ import annotations

import math

from klpo.lab.markdown import closest, gradient_table, num, sig, table


def test_closest_is_the_index_of_the_nearest_entry():
    assert closest([0.01, 0.1, 1.0, 3.0], 0.3) == 1  # 0.2 from 0.1, 0.7 from 1.0
    assert closest([0.01, 0.1, 1.0, 3.0], 2.1) == 3  # 0.9 from 3.0, 1.1 from 1.0
    assert closest([0.5, 0.5], 0.5) == 0  # a tie: the first


def test_num_fixed_digits_scientific_outside_and_the_special_values():
    assert num(0.12345) == "0.123"
    assert num(-2.5, digits=2) == "-2.50"
    assert num(12345.0) == "1.2e+04"  # |x| >= 1e4
    assert num(0.0004) == "4.0e-04"  # |x| < 10^-3
    assert num(0.0) == "0" and num(0) == "0"
    assert num(None) == "zero" and num(math.nan, zero="—") == "—"
    assert num(math.inf) == "inf" and num(-math.inf) == "-inf"


def test_sig_significant_digits_and_a_dash_for_no_value():
    assert sig(0.0123456) == "0.0123"
    assert sig(123456.0, 2) == "1.2e+05"
    assert sig(None) == sig(math.nan) == sig(math.inf) == "—"


def test_table_and_gradient_table():
    assert table(["a", "b"], [["1", "2"], ["3", "4"]]) == (
        "| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |"
    )
    row = {
        "estimator": "k3",
        "placement": "loss",
        "cos_theta_ref": 1.0,
        "rel_err_theta_ref": 0.0,
        "cos_ref_theta": 0.5,
        "rel_err_ref_theta": math.nan,
        "follows": "∇KL(θ‖ref)",
    }
    lines = gradient_table([row]).splitlines()
    assert len(lines) == 3 and lines[1] == "|" + "---|" * 7
    assert lines[2] == "| `k3` | loss | 1.000 | 0 | 0.500 | zero | ∇KL(θ‖ref) |"
