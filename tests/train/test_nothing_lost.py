"""Nothing lost, nothing silent: the faults a new user meets after the first round of fixes.

Each case checks the exit code, the message's key words, and that every file already there is
byte-identical afterwards (``snapshot``): ``--overwrite`` keeps the user's files, a reward that
returns the wrong thing is refused naming it, a study interrupted is finished on a re-run, a
resume that cannot do what it is asked is refused, a full disk is said and leaves no dead end.
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from klpo.cli import app

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), but those under ``skip``."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not str(p.relative_to(root)).startswith(skip)
    }


def clean_error(result, code: int, *fragments: str) -> str:
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == code, text
    assert "Traceback" not in text
    for f in fragments:
        assert f in text, (f, text)
    return text


# ---------------------------------------------------------------------------------------------
# --overwrite replaces only what the command itself wrote.

REFERENCE_ARGS = [
    "--steps", "1", "--hidden-size", "16", "--num-layers", "1", "--intermediate-size", "32",
    "--batch-size", "4",
]  # fmt: skip


def user_files(out: Path) -> None:
    (out / "notes.md").write_text("# my notes on this model\n")
    (out / "evals").mkdir()
    (out / "evals" / "heldout.json").write_text('{"accuracy": 0.41}\n')


def test_make_reference_overwrite_keeps_the_users_files(tmp_path):
    out = tmp_path / "ref"
    first = cli("make-reference", str(out), *REFERENCE_ARGS)
    assert first.exit_code == 0, first.output
    written = json.loads((out / "reference.json").read_text())["files"]
    assert "model.safetensors" in written and "reference.json" in written
    user_files(out)
    mine = snapshot(out, skip=tuple(written))
    assert set(mine) == {"notes.md", "evals/heldout.json"}
    again = cli("make-reference", str(out), *REFERENCE_ARGS, "--seed", "1", "--overwrite")
    assert again.exit_code == 0, again.output
    assert snapshot(out, skip=tuple(written)) == mine  # the user's files, byte for byte
    assert json.loads((out / "reference.json").read_text())["config"]["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_make_reward_model_overwrite_keeps_the_users_files(tmp_path):
    out = tmp_path / "rm"
    args = ["make-reward-model", str(out), "--n-pairs", "8", "--steps", "1", "--n-eval", "4"]
    first = cli(*args)
    assert first.exit_code == 0, first.output
    written = json.loads((out / "reward_model.json").read_text())["files"]
    user_files(out)
    mine = snapshot(out, skip=tuple(written))
    again = cli(*args, "--overwrite")
    assert again.exit_code == 0, again.output
    assert snapshot(out, skip=tuple(written)) == mine
    # an earlier reward model that lists no files (older klpo): only the names written now go
    meta = json.loads((out / "reward_model.json").read_text())
    (out / "reward_model.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "files"})
    )
    (out / "old_extra.bin").write_bytes(b"\x00\x01")
    mine = snapshot(out, skip=tuple(written))
    third = cli(*args, "--overwrite")
    assert third.exit_code == 0, third.output
    assert snapshot(out, skip=tuple(written)) == mine
