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


WORKFLOW = """name: tests
on:
  push:
    branches: [main]
jobs:
  test:
    runs-on: ubuntu-latest
    steps:
      - run: pytest
"""


@pytest.fixture
def unrelated(tmp_path):
    """Files a repository commits that the hook's old pattern caught: a GitHub workflow (YAML
    reads its `on:` as the key True), a data JSON (a list), a download script."""
    wf = tmp_path / ".github" / "workflows" / "run-tests.yml"
    wf.parent.mkdir(parents=True)
    wf.write_text(WORKFLOW)
    data = tmp_path / "train_data.json"
    data.write_text('[{"prompt": "2 + 2 =", "answer": "4"}]\n')
    script = tmp_path / "run_download.sh"
    script.write_text("#!/bin/bash\nset -e\nwget https://example.com/d.tar.gz\ntar xf d.tar.gz\n")
    return [wf, data, script]


def test_pre_commit_pattern_leaves_workflows_and_data_files_out(unrelated):
    """pre-commit selects a file when `files` searches it and `exclude` does not (re.search)."""
    import re

    [hook] = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())

    def selected(path: str) -> bool:
        return bool(re.search(hook["files"], path)) and not re.search(hook["exclude"], path)

    assert not selected(".github/workflows/run-tests.yml")
    assert not selected("train_data.json") and not selected("data/run_results.json")
    for path in ("run_grpo.sh", "examples/grpo_trainer/run_qwen2-7b.sh", "configs/train.yaml",
                 "launch_rloo.json", "recipes/train-config.yml"):  # fmt: skip
        assert selected(path), path


def test_hook_notes_a_file_that_is_no_training_config_and_passes(unrelated):
    """The hook's entry on each unrelated file: one note, exit 0; a file named by hand without
    --skip-non-configs is still an error (2), never a traceback."""
    [hook] = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    args = hook["entry"].split()[1:]
    for path in unrelated:
        result = runner.invoke(app, ["doctor", *args, str(path)])
        assert result.exit_code == 0, (path, result.output, result.exception)
        assert f"{path}: not a training config: nothing to check (" in result.stderr, path
        assert result.exception is None or isinstance(result.exception, SystemExit)
        plain = runner.invoke(app, ["doctor", str(path)])
        assert plain.exit_code == 2 and "Traceback" not in plain.output, plain.output
        assert isinstance(plain.exception, SystemExit), plain.exception
    # with a real config beside them: the config is reported, its status is the hook's
    code, result = _code(*args, *map(str, unrelated), CLEAN)
    assert code == 0 and result.stdout.count("klpo doctor: ") == 1
    code, _ = _code(*args, str(unrelated[0]), WARNING, "--fail-on", "warning")
    assert code == 1


def test_a_yaml_key_read_as_a_boolean_is_its_written_text(unrelated):
    """YAML 1.1 reads `on:` as True; the doctor's keys are the text written."""
    from klpo.doctor.reading import load_mapping

    assert list(load_mapping(unrelated[0])) == ["name", "on", "jobs"]
    for framework in ("verl", "trl-grpo", "klpo"):  # read as a framework's file: no traceback
        result = runner.invoke(app, ["doctor", "--framework", framework, str(unrelated[0])])
        assert result.exception is None or isinstance(result.exception, SystemExit), (
            framework,
            result.exception,
        )
