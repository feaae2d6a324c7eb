"""Smoke tests of `klpo lab gaussian|categorical|sequence`: the JSON contract, the tables, errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from klpo import kl
from klpo.cli import app
from klpo.lab.exact import LAB_ESTIMATORS, placements_of
from klpo.lab.montecarlo import GAUSSIAN_ESTIMATORS

runner = CliRunner()

SPEC_10_3 = {
    "vocab": 2,
    "length": 2,
    "policy": {"": [0.3, -0.2], "0": [0.5, 0.0], "1": [-0.4, 0.6]},
    "reference": {"": [0, 0], "0": [0, 0.3], "1": [0.2, 0]},
}


def run_json(*args: str) -> dict:
    result = runner.invoke(app, ["lab", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_gaussian_json_contract():
    record = run_json("gaussian", "--mu", "1.0", "--samples", "100000", "--seed", "3")
    assert list(record) == ["true_kl", "estimators"]
    assert record["true_kl"] == 0.5
    assert list(record["estimators"]) == list(GAUSSIAN_ESTIMATORS)
    keys = ["mean", "bias", "sd", "rmse", "bias_rel", "sd_rel", "frac_negative"]
    for name, v in record["estimators"].items():
        assert list(v) == keys, name
    k1 = record["estimators"]["k1"]
    assert abs(k1["mean"] - 0.5) <= 4 * k1["sd"] / math.sqrt(100_000)
    assert k1["rmse"] == pytest.approx(math.hypot(k1["bias"], k1["sd"]))
    assert record["estimators"]["k3"]["frac_negative"] == 0.0


def test_gaussian_table_for_people():
    result = runner.invoke(app, ["lab", "gaussian", "--mu", "0.1", "--samples", "20000"])
    assert result.exit_code == 0, result.output
    assert "true KL = 0.005" in result.output and "ref_is_clip" in result.output


def test_categorical_json_contract():
    record = run_json("categorical", "--pi", "0.7,0.2,0.1", "--ref", "0.5,0.3,0.2")
    assert list(record) == ["kl", "values", "gradients"]
    assert record["kl"]["theta_ref"] == pytest.approx(0.085123, abs=1e-6)
    assert list(record["values"]) == list(LAB_ESTIMATORS)
    assert list(record["values"]["k2"]) == ["mean", "bias", "sd", "frac_negative"]
    g = record["gradients"]
    assert list(g) == ["true", *LAB_ESTIMATORS]
    assert g["true"]["ref_theta"] == pytest.approx([0.2, -0.1, -0.1])
    for name in LAB_ESTIMATORS:
        assert list(g[name]) == list(placements_of(name))
        assert all(len(v) == 3 for v in g[name].values())
    assert g["k3"]["loss"] == pytest.approx([0.2, -0.1, -0.1])  # in the order given


def test_categorical_monte_carlo_section():
    record = run_json(
        "categorical", "--pi", "0.7,0.2,0.1", "--ref", "0.5,0.3,0.2", "--samples", "50000"
    )
    mc = record["monte_carlo"]
    assert (mc["samples"], mc["seed"]) == (50000, 0)
    assert list(mc["values"]["k1"]) == ["mean", "bias", "sd", "frac_negative", "stderr"]
    assert list(mc["gradients"]["k3"]["loss"]) == ["mean", "var"]
    assert "adaptive_mix" in mc["values"] and "adaptive_mix" not in mc["gradients"]
    k3 = mc["gradients"]["k3"]["loss"]
    for m, v, exact in zip(k3["mean"], k3["var"], [0.2, -0.1, -0.1], strict=True):
        assert abs(m - exact) <= 4 * math.sqrt(v / 50000)


def test_sequence_json_contract(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC_10_3))
    record = run_json("sequence", "--spec", str(spec), "--samples", "1000")
    assert list(record) == ["kl", "values", "gradients", "monte_carlo"]
    true = record["gradients"]["true"]["theta_ref"]
    # rows "" then "0" then "1", two entries each (the hand-checked 2-step oracle)
    expected = [[0.097785, -0.097785], [0.117024, -0.117024], [-0.089075, 0.089075]]
    np.testing.assert_allclose(true, expected, atol=1e-6)
    np.testing.assert_allclose(record["gradients"]["k1"]["reward"], true, rtol=1e-12)
    assert len(record["monte_carlo"]["gradients"]["k2"]["loss"]["var"]) == 3


def test_sequence_table_names_the_prefix_order(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC_10_3))
    result = runner.invoke(app, ["lab", "sequence", "--spec", str(spec)])
    assert result.exit_code == 0, result.output
    assert "Gradient rows (prefixes) in order: '', '0', '1'" in result.output
    assert "reward+loss" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pi", "0.7,0.2,0.2", "--ref", "0.5,0.3,0.2"], "--pi sums to 1.1, not 1"),
        (["--pi", "0.5,0.5", "--ref", "0.5,0.3,0.2"], "--pi has 2 entries but --ref has 3"),
        (["--pi", "0.5,x", "--ref", "0.5,0.5"], "not a comma-separated list of numbers"),
        (["--pi", "1,0", "--ref", "0.5,0.5"], "--pi[1] = 0.0 is not a probability"),
        (["--pi", "0.5,0.5", "--ref", "0.2,0.2"], "--ref sums to 0.4"),
    ],
)
def test_categorical_bad_input_exits_non_zero(args, message):
    result = runner.invoke(app, ["lab", "categorical", *args])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"vocab": 2, "length": 2, "policy": ', "is not valid JSON"),
        ('{"vocab": 2, "length": 2, "policy": {}, "reference": {}}', "policy is missing prefix ''"),
        ('{"vocab": 2, "length": 1, "policy": {"": [0, 0]}, "reference": {"": [0]}}', "list of 2"),
        ('{"vocab": 2}', "missing 'length'"),
    ],
)
def test_sequence_bad_spec_exits_non_zero(tmp_path, content, message):
    spec = tmp_path / "spec.json"
    spec.write_text(content)
    result = runner.invoke(app, ["lab", "sequence", "--spec", str(spec)])
    assert result.exit_code == 2
    assert message in result.output
    missing = runner.invoke(app, ["lab", "sequence", "--spec", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "cannot read" in missing.output


def test_estimator_names_are_never_k2_k3_for_ref_is_and_adaptive_mix():
    """The "K2"/"K3" of docs/claims.md are ref_is/adaptive_mix; the lab must not call them k2/k3."""
    assert {"ref_is", "adaptive_mix"} <= set(LAB_ESTIMATORS)
    assert set(kl.ESTIMATORS) <= set(LAB_ESTIMATORS)
