"""``klpo doctor`` as a CI gate: exit codes by --fail-on, several files, and the machine formats
(SARIF 2.1.0's required fields, GitHub's workflow-command syntax)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from klpo.cli import app

FIX = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).parents[2]
CLEAN = str(FIX / "trl_rloo.yaml")  # no finding at all
WARNING = str(FIX / "verl_grpo.yaml")  # warnings (4 off-policy steps), no error
runner = CliRunner()


@pytest.fixture
def error_config(tmp_path):
    # A key verl 0.9.1's config does not have: an error (verl refuses it and does not start).
    p = tmp_path / "verl_typo.sh"
    p.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.use_kl_los=true\n"
    )
    return str(p)


def _code(*args):
    result = runner.invoke(app, ["doctor", *args])
    return result.exit_code, result


@pytest.mark.parametrize(
    ("fail_on", "clean", "warning", "error"),
    [("error", 0, 0, 1), ("warning", 0, 1, 1), ("never", 0, 0, 0)],
)
def test_exit_codes_by_fail_on(error_config, fail_on, clean, warning, error):
    assert _code(CLEAN, "--fail-on", fail_on)[0] == clean
    assert _code(WARNING, "--fail-on", fail_on)[0] == warning
    assert _code(error_config, "--fail-on", fail_on)[0] == error


def test_default_fails_on_errors_only(error_config):
    assert _code(WARNING)[0] == 0
    assert _code(error_config)[0] == 1


def test_unreadable_file_is_2_whatever_fail_on(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    assert _code(missing, "--fail-on", "never")[0] == 2
    code, result = _code(CLEAN, missing)
    assert code == 2
    assert "klpo doctor: " + CLEAN in result.stdout  # the readable file is still reported


def test_several_files_one_report_each_one_status(error_config):
    code, result = _code(CLEAN, WARNING, error_config)
    assert code == 1
    assert result.stdout.count("klpo doctor: ") == 3
    code, result = _code(CLEAN, WARNING, "--format", "json")
    data = json.loads(result.stdout)
    assert code == 0 and [d["source"] for d in data] == [CLEAN, WARNING]


def test_sarif_has_a_result_per_finding(error_config):
    code, result = _code(WARNING, error_config, "--format", "sarif")
    assert code == 1
    log = json.loads(result.stdout)
    assert log["version"] == "2.1.0"
    [run] = log["runs"]
    assert run["tool"]["driver"]["name"] == "klpo doctor"
    levels = sorted({r["level"] for r in run["results"]})
    assert "error" in levels and "warning" in levels
    ids = {rule["id"] for rule in run["tool"]["driver"]["rules"]}
    for r in run["results"]:
        assert r["ruleId"] in ids and r["message"]["text"]
        loc = r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
        assert loc in (WARNING, error_config)


def test_github_annotations_are_workflow_commands(error_config):
    code, result = _code(error_config, "--format", "github")
    assert code == 1
    lines = result.stdout.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("::error ")]
    assert errors, lines
    head, _, message = errors[0][2:].partition("::")
    assert head.startswith(f"error file={error_config.replace(':', '%3A')}")
    assert "use_kl_los" in message and "\n" not in message


def test_github_annotation_carries_the_findings_line(tmp_path):
    p = tmp_path / "s.sh"
    p.write_text(
        'set -x\nsrun bash -c "python3 -m openrlhf.cli.train_ppo_ray --init_kl_coef 0.01"\n'
    )
    _, result = _code(str(p), "--format", "github")
    [note] = [ln for ln in result.stdout.splitlines() if "bash -c" in ln]
    assert note.startswith("::notice ") and ",line=2," in note


def test_bad_gate_options_are_refused():
    assert _code(CLEAN, "--fail-on", "sometimes")[0] == 2
    assert _code(CLEAN, "--format", "xml")[0] == 2


def test_pre_commit_hook_runs_the_doctor_on_launch_scripts():
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    [hook] = [h for h in hooks if h["id"] == "klpo-doctor"]
    assert hook["entry"].split()[0] == "klpo-doctor"  # the light install's console script
    assert "klpo-doctor" in (ROOT / "pyproject.toml").read_text()
    assert hook["language"] == "python" and hook.get("pass_filenames", True)
    assert "--fail-on" in hook["entry"]
