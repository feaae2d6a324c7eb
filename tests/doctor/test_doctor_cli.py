"""`klpo doctor` on the command line: what it prints for people and for machines."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from klpo.cli import app
from klpo.doctor import diagnose

FIX = Path(__file__).parent / "fixtures"
runner = CliRunner()


def test_text_for_a_stock_verl_grpo_config():
    result = runner.invoke(app, ["doctor", str(FIX / "verl_grpo.yaml")])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "defaults and semantics of verl 0.9.1 (version not named: assumed" in out
    assert "klpo `low_var_kl` in the loss, beta 0.001" in out
    assert "where no clamp binds, as k3: grad KL(pi_ref ‖ pi_theta)" in out
    assert "the gradient is exactly zero where d < -2.61" in out
    assert "estimator: k3+" in out  # the likely intended config


def test_json_is_the_diagnosis():
    path = str(FIX / "openrlhf_ppo.sh")
    result = runner.invoke(app, ["doctor", path, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == json.loads(json.dumps(diagnose(path), default=str))


def test_framework_option_and_version_warning():
    result = runner.invoke(
        app,
        ["doctor", str(FIX / "trl_rloo.yaml"), "--framework", "trl-rloo",
         "--framework-version", "0.19.0"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "klpo `k1` in the reward, beta 0.05" in result.output
    assert (
        "the doctor has no table for trl-rloo 0.19.0; it reads your config with trl-rloo "
        "1.16.0's settings, defaults and semantics"
    ) in result.output


def test_bad_input_exits_2_with_one_message(tmp_path):
    result = runner.invoke(app, ["doctor", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2
    assert "does not exist" in result.output
    result = runner.invoke(app, ["doctor", str(FIX / "verl_grpo.yaml"), "--framework", "deepspeed"])
    assert result.exit_code == 2
    assert "unknown framework 'deepspeed'" in result.output


def test_a_fifo_is_refused_not_waited_on_and_a_symlink_loop_is_named(tmp_path):
    """A FIFO made the doctor wait forever for a writer; a symlink loop was "does not exist"."""
    import os
    import threading

    fifo = tmp_path / "run_grpo.sh"
    os.mkfifo(fifo)
    results = []
    t = threading.Thread(
        target=lambda: results.append(runner.invoke(app, ["doctor", str(fifo)])), daemon=True
    )
    t.start()
    t.join(timeout=30)
    if t.is_alive():  # the old behaviour: blocked in open(); release it before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(timeout=30)
        raise AssertionError("klpo doctor waited on a FIFO")
    [result] = results
    assert result.exit_code == 2, result.output
    assert f"{fifo}: a FIFO (named pipe): reading it would wait for a writer" in result.output
    loop_a, loop_b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    result = runner.invoke(app, ["doctor", str(loop_a)])
    assert result.exit_code == 2
    assert f"{loop_a}: a symlink loop" in result.output and "does not exist" not in result.output
    broken = tmp_path / "c.yaml"
    broken.symlink_to(tmp_path / "gone.yaml")
    result = runner.invoke(app, ["doctor", str(broken)])
    assert result.exit_code == 2 and "a broken symlink (to " in result.output, result.output


FUNCTION_SCRIPT = """#!/bin/bash
train() {
  python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\
    actor_rollout_ref.model.path=$1 \\
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=$2
}
train /models/qwen 0.05
"""


def test_a_positional_parameter_is_named_as_one_and_given_with_var(tmp_path):
    """A shell function's ``$2`` was read as a Hydra interpolation (Hydra's advice), and
    ``--var 2=...`` was refused as not a NAME."""
    script = tmp_path / "run_grpo.sh"
    script.write_text(FUNCTION_SCRIPT)
    result = runner.invoke(app, ["doctor", str(script)])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "interpolation" not in out and "--cfg job --resolve" not in out, out
    assert (
        "actor_rollout_ref.actor.kl_loss_coef = '${2}' depends on $2 (a positional parameter: "
        "argument 2 of the script, or of the shell function the command sits in)"
    ) in out
    assert "--var 2=VALUE for $2" in out
    given = runner.invoke(app, ["doctor", str(script), "--var", "1=/m", "--var", "2=0.05"])
    assert given.exit_code == 0, given.output
    assert "klpo `low_var_kl` in the loss, beta 0.05" in given.output
    assert "positional parameter" not in given.output
    refused = runner.invoke(app, ["doctor", str(script), "--var", "0=x"])
    assert refused.exit_code == 2 and "--var 1=/models/x for $1" in refused.output


def test_the_library_never_imports_the_doctor():
    import subprocess
    import sys

    import klpo

    src = str(Path(klpo.__file__).parents[1])
    code = (
        "import sys, klpo, klpo.kl, klpo.losses, klpo.reduce, klpo.advantages, klpo.control, "
        "klpo.logprobs, klpo.lab\n"
        "print(sorted(m for m in sys.modules if m.startswith('klpo.doctor')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": src}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
