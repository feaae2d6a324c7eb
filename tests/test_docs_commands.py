"""The README's and the docs' commands, as written, so that they cannot drift from the code.

Every ``klpo`` command of a ``bash`` block of README.md and docs/*.md is read from the markdown.
Those of :data:`FAST` (seconds each: help, ``explain``, ``doctor`` on the repository's own
fixtures and configs, the lab's small commands, ``--print-config``) are run exactly as written and
must succeed. Every other one (a training run, a study, a model to build) is checked without
running it: a ``klpo train`` by its resolved config (``--print-config``: the config files and
every ``--set`` key exist and validate), a ``klpo compare`` by its grid (``--dry-run``), any
other by its options (``--help`` after them: an unknown option still fails). The README's Python
blocks are executed.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FAST = {
    "klpo explain --all",
    "klpo explain --estimator k3 --placement loss",
    "klpo explain --all --json --off-policy",
    "klpo doctor tests/doctor/fixtures/verl_grpo.yaml",
    "klpo doctor configs/grpo.yaml",
    "klpo lab categorical --pi 0.7,0.2,0.1 --ref 0.5,0.3,0.2 --json",
    "klpo lab gaussian --mu 1",
    "klpo train --print-config",
    "klpo train -c configs/ppo.yaml --check",
}
"""The documented commands that are run as written (each takes seconds)."""


def blocks(page: Path, lang: str) -> list[str]:
    """The bodies of the page's fenced code blocks of language ``lang``."""
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


def klpo_commands(page: Path) -> list[str]:
    """The ``klpo`` commands of the page's bash blocks: continuation lines joined, comments and
    the ``.venv/bin/`` prefix dropped, ``torchrun ... -m klpo`` read as ``klpo``."""
    out = []
    for body in blocks(page, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip().replace(".venv/bin/", "")
            line = re.sub(r"^torchrun( --\S+ \S+)* -m klpo ", "klpo ", line)
            if line.startswith("klpo "):
                out.append(" ".join(line.split()))
    return out


DOCUMENTED = sorted({c for page in PAGES for c in klpo_commands(page)})


def run(command: str):
    result = CliRunner().invoke(app, shlex.split(command)[1:])
    return result.exit_code, result.output


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh directory that sees the repository's configs/ and tests/ (as the docs' commands
    do from the repository's root) and keeps whatever a command writes."""
    for name in ("configs", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_fast_commands_are_the_documented_ones():
    """Each entry of FAST is in a page (an edited page edits this list too)."""
    assert set(DOCUMENTED) >= FAST, sorted(FAST - set(DOCUMENTED))
    assert len(DOCUMENTED) > len(FAST)


@pytest.mark.parametrize("command", sorted(FAST))
def test_fast_command_runs_as_written(command, workdir):
    code, output = run(command)
    assert code == 0, output
    assert "Traceback" not in output


def _checked_form(command: str) -> str:
    """How a command that is not run is checked (see the module's docstring)."""
    words = command.split()
    if words[1] == "train" and "--resume" not in words:
        return f"{command} --print-config"
    if words[1] == "compare":
        return f"{command} --dry-run"
    return f"{command} --help"


@pytest.mark.parametrize("command", [c for c in DOCUMENTED if c not in FAST])
def test_every_other_command_parses(command, workdir):
    code, output = run(_checked_form(command))
    assert code == 0, output


def test_a_drifted_command_is_caught(workdir):
    """The checks have teeth: a key or option that does not exist fails them."""
    assert run(_checked_form("klpo train --set kl.betta=0.1"))[0] != 0
    assert run(_checked_form("klpo export runs/x --out y --merged"))[0] != 0
    assert run(_checked_form("klpo compare --quick --seeds x"))[0] != 0


@pytest.mark.parametrize("index", range(len(blocks(ROOT / "README.md", "python"))))
def test_readme_python_block_runs(index, capsys):
    code = blocks(ROOT / "README.md", "python")[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {})
    assert capsys.readouterr().out  # each block shows something


def test_every_study_in_the_docs_index_with_its_number_of_runs():
    """docs/README.md links every study report, and the number of runs it gives is the
    number of rows of that study's results.csv."""
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for study in sorted((ROOT / "docs").glob("study*/results.csv")):
        name = study.parent.name
        assert f"]({name}/report.md)" in index, name
        row = next(line for line in index.splitlines() if f"]({name}/report.md)" in line)
        runs = len(study.read_text(encoding="utf-8").strip().splitlines()) - 1
        stated = re.findall(r"(\d+) runs", row)
        assert all(int(n) == runs for n in stated), (name, stated, runs)


def _written(command: str) -> str | None:
    """The directory a documented command writes into, if it writes one."""
    words = command.split()
    if "--out" in words:
        return words[words.index("--out") + 1]
    if words[1] in ("make-reference", "make-reward-model"):
        return words[2]
    return None


def test_what_the_documented_commands_write_git_ignores():
    """A documented command writes under a folder .gitignore names (runs/), or into docs/ where
    the repository keeps its outputs on purpose (the studies' reports): nothing lands in a
    folder git would offer to commit by accident."""
    ignored = {x.strip() for x in (ROOT / ".gitignore").read_text().splitlines()}
    written = {c: _written(c) for c in DOCUMENTED if _written(c)}
    assert any(c.split()[1] == "make-reward-model" for c in written)  # the check sees them
    for command, path in written.items():
        top = path.split("/")[0] + "/"
        assert top in ignored or top == "docs/", command
