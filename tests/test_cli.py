"""Smoke tests of the `klpo` command line that check what it prints, not only the exit code."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from klpo import kl
from klpo.cli import app

runner = CliRunner()


def test_explain_all_prints_every_estimator():
    result = runner.invoke(app, ["explain", "--all"])
    assert result.exit_code == 0, result.output
    for name in kl.ESTIMATORS:
        assert name in result.output
    assert "grad KL(pi_ref ‖ pi_theta)" in result.output


def test_explain_one_for_people():
    result = runner.invoke(app, ["explain", "--estimator", "k3", "--placement", "loss"])
    assert result.exit_code == 0, result.output
    assert "k3 in the loss" in result.output
    assert "follows grad KL(pi_ref ‖ pi_theta)" in result.output
    assert "not that of KL(pi_theta ‖ pi_ref)" in result.output


def test_explain_json_is_the_library_record():
    result = runner.invoke(app, ["explain", "--all", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert len(rows) == len(kl.ESTIMATORS) * len(kl.PLACEMENTS)
    assert rows[0] == kl.explain(rows[0]["estimator"], rows[0]["placement"]).to_dict()
    off = json.loads(
        runner.invoke(app, ["explain", "-e", "k3_is", "--off-policy", "--json"]).output
    )
    assert {r["placement"]: r["gradient"] for r in off}["loss"] == kl.GRAD_THETA_REF


def test_explain_bad_input_exits_non_zero_with_the_choices():
    result = runner.invoke(app, ["explain", "--estimator", "k9"])
    assert result.exit_code == 2
    assert "unknown KL estimator 'k9'" in result.output and "k3_is" in result.output
    result = runner.invoke(app, ["explain", "-e", "k3", "-p", "rewards"])
    assert result.exit_code == 2 and "reward, loss, reward+loss" in result.output
    assert runner.invoke(app, ["explain"]).exit_code == 2


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "klpo.cli", "explain", "-e", "k1", "-p", "loss"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "zero in expectation" in out.stdout


def test_import_klpo_kl_stays_light():
    code = (
        "import sys, klpo.kl; heavy = {'transformers', 'matplotlib', 'datasets', 'typer'}"
        " & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_explain_all_fits_80_columns_and_keeps_the_directions_apart():
    result = runner.invoke(app, ["explain", "--all"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    row = {line.split()[0]: line.split() for line in lines if line.split()}
    # k3: unbiased for KL(pi_theta ‖ pi_ref); in the loss it follows the other direction.
    assert row["k3"][:4] == ["k3", "KL(θ‖ref)", "yes", "yes"]
    assert row["k3"][6:8] == ["∇KL(ref‖θ)", "*"]
    assert row["kl_ref_theta"][1] == "KL(ref‖θ)" and row["kl_ref_theta"][-1] == "∇KL(ref‖θ)"
    assert "θ = pi_theta, ref = pi_ref" in result.output
    text = " ".join(result.output.split())
    assert "k3: exp(-d) + d - 1;" in text  # the values follow the table
    # Wide enough (or piped): the full table, directions written out.
    wide = runner.invoke(app, ["explain", "--all"], env={"COLUMNS": "240"})
    assert "grad KL(pi_ref ‖ pi_theta) *" in wide.output and "∇" not in wide.output
