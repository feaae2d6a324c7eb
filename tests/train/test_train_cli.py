"""`klpo train`'s config made discoverable: --print-config, --check, a --help that names the
sections, and help text in click's notation throughout the CLI."""

from __future__ import annotations

import re

import pytest
import yaml
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train.config import TrainConfig, build_config, dump_config, load_config

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_print_config_is_the_resolved_yaml_after_file_and_sets(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("kl:\n  beta: 0.5\noptim:\n  lr: 0.001\n")
    code, out, _ = invoke("train", "-c", str(config), "--set", "kl.beta=0.02", "--print-config")
    assert code == 0
    # the resolved config, with each given key's source as a comment (tests/train/config/test_config_files.py)
    assert yaml.safe_load(out) == yaml.safe_load(dump_config(load_config(config, ["kl.beta=0.02"])))
    printed = build_config(yaml.safe_load(out))
    assert printed.kl.beta == 0.02 and printed.optim.lr == 0.001  # --set over the file
    assert not (tmp_path / "runs").exists()
    bad, _, err = invoke("train", "--set", "lr=1e-6", "--print-config")
    assert bad == 2 and "did you mean 'optim.lr'?" in err


def test_check_runs_the_preflight_and_trains_nothing(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    sets = [a for o in quick(tiny_model, out) for a in ("--set", o)]
    code, _, err = invoke("train", *sets, "--check")
    assert code == 0, err
    assert f"run directory: {out}" in err and "check passed: grpo for 3 steps" in err
    assert not out.exists()  # nothing written
    # The start-up note a run prints for a KL whose gradient is not that of the KL it logs.
    k3 = invoke("train", *sets, "--set", "kl.estimator=k3", "--set", "kl.placement=loss", "--check")
    assert k3[0] == 0 and "its expected gradient is not that of the KL it logs" in k3[2]
    assert "expected gradient is not" not in err  # the default, full in the loss: none
    # What a run would refuse before it starts, --check refuses: a missing model, a missing
    # reward function, a directory that holds another run.
    missing = invoke("train", *sets, "--set", f"model.policy={tmp_path / 'none'}", "--check")
    assert missing[0] == 1 and "model.policy" in missing[2]
    reward = invoke("train", *sets, "--set", "rewards=[{name: 'nowhere:fn'}]", "--check")
    assert reward[0] == 1 and "cannot import module 'nowhere'" in reward[2]
    out.mkdir()  # a run: its config and metrics (klpo.train.outdir)
    (out / "config.yaml").write_text("kl:\n  beta: 0.1\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    taken = invoke("train", *sets, "--check")
    assert taken[0] == 1 and "already holds a run" in taken[2]


def test_train_help_names_the_sections_and_the_reference():
    code, out, _ = invoke("train", "--help")
    assert code == 0
    text = " ".join(out.split())
    for section in TrainConfig.model_fields:
        assert section in text, section
    for words in ("docs/config.md", "--print-config", "--check", "--allow-config-change"):
        assert words in text


def _commands(typer_app, prefix=()):
    """Every command's argument list, sub-applications included."""
    import typer

    group = typer.main.get_command(typer_app)
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            for sub in cmd.commands:
                yield (*prefix, name, sub)
        else:
            yield (*prefix, name)


@pytest.mark.parametrize("command", list(_commands(app)))
def test_help_has_no_type_placeholders(command):
    """Arguments by their metavar (CONFIG, [OUT]) and every option's value named (FILE,
    KEY=VALUE, N): no `{config}`, `<str>`, `<list[str]>` or `<int range>`."""
    code, out, _ = invoke(*command, "--help")
    assert code == 0
    assert not re.findall(r"<[a-z_\[\] ]+>", out), out
    assert not re.findall(r"\{[a-z_]+\}", out.replace("{name: model", "")), out


def test_make_run_and_the_readme_agree_on_the_run_directory():
    """A second `klpo train` into one directory is refused; `make run` gives each run its own
    (the README says both)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    make = (root / "Makefile").read_text()
    assert "klpo train --set run.out_dir=runs/train-$$(date" in make
    readme = " ".join((root / "README.md").read_text().split())
    assert "a second `klpo train` into the same `run.out_dir` is refused" in readme
    assert "`make run`: runs/train-<time>" in readme
