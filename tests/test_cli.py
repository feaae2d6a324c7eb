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


def test_compare_prints_its_lines_through_the_current_stderr(tmp_path, monkeypatch):
    """Under rich's live bar sys.stderr is rich's proxy, which puts each line above the bar;
    click's echo bypasses it and writes into the bar's line. The lines go through sys.stderr."""
    import io

    from klpo.study import runner

    def fake(study, out, *, on_result, on_start, show_progress):
        on_start("run-a", out / "runs" / "run-a" / "log.txt")
        row = {"name": "run-a", "status": "collapsed", "error": "fell", "acc_final": 0.2,
               "kl_exact_final": 0.01, "wall_s": 3.0}  # fmt: skip
        on_result(row, 1, 1)

    monkeypatch.setattr(runner, "run_study", fake)
    # rich's own proxy, as its live bar installs it, over a stream with a binary buffer
    from rich.console import Console
    from rich.file_proxy import FileProxy

    shown = io.StringIO()
    real = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    monkeypatch.setattr("sys.stderr", FileProxy(Console(file=shown, width=200), real))
    from klpo.cli.compare import compare

    compare(
        study_file=None, quick=True, task="builtin", out=tmp_path / "s", workers=None, steps=None,
        seeds=None, betas=None, dry_run=False,
    )  # fmt: skip
    lines = shown.getvalue().splitlines()
    assert any(x.startswith("start run-a (log: ") for x in lines)
    assert "[1/1] run-a: collapsed (fell), held-out 0.200, exact KL 0.0100, 3 s" in lines


def test_explain_staleness_prints_both_families_and_json_is_the_lab_record():
    from klpo.lab import staleness

    result = runner.invoke(app, ["explain", "--staleness", "2", "-e", "k3_is", "-p", "loss"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "sampler 2 version(s) behind" in out and "sequence oracle" in out
    for c in ("none", "is", "is-cap", "is-seq"):
        assert c in out
    assert "1.000 =" in out  # k3_is weighted by pi_theta/pi_behav on categoricals: exact
    result = runner.invoke(app, ["explain", "-k", "1", "-e", "k1", "-p", "reward", "--json"])
    rows = json.loads(result.output)
    want = staleness.staleness_rows(1, estimators=["k1"], placements=["reward"])
    assert rows == [r.to_dict() for r in want]
    assert {r["correction"] for r in rows} == set(staleness.CORRECTIONS)
    result = runner.invoke(app, ["explain", "-k", "1", "-e", "k1", "-p", "loss", "--json"])
    zero = [r for r in json.loads(result.output) if r["correction"] == "is"]
    assert zero[0]["cos_theta_ref"] is None and "NaN" not in result.output  # strict JSON


def test_explain_staleness_refuses_mixed_questions_and_bad_values():
    result = runner.invoke(app, ["explain", "--staleness", "1", "--off-policy"])
    assert result.exit_code == 2 and "give one" in result.output
    result = runner.invoke(app, ["explain", "--staleness", "1", "-e", "k3", "--cap", "0"])
    assert result.exit_code == 2 and "cap C must be > 0" in result.output
    result = runner.invoke(app, ["explain", "--staleness", "-1"])
    assert result.exit_code == 2
