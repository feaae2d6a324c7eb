"""The Makefile's install: pip's own settings by default, PyTorch's CPU wheel index only when asked."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def _install_lines(tmp_path: Path, *extra: str) -> list[str]:
    """The commands ``make`` would run to set up a fresh environment (``make -n``: none run)."""
    venv = tmp_path / "venv"
    out = subprocess.run(
        ["make", "-n", "-C", str(ROOT), f"VENV={venv}", *extra, f"{venv}/.klpo-installed"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if " pip install " in line]


def test_default_install_uses_pips_settings(tmp_path):
    lines = _install_lines(tmp_path)
    assert len(lines) == 1 and "-c constraints.txt -e '.[dev]'" in lines[0]
    assert "--index-url" not in lines[0]


def test_cpu_only_torch_first_from_pytorchs_index(tmp_path):
    lines = _install_lines(tmp_path, f"TORCH_INDEX={CPU_INDEX}")
    assert len(lines) == 2
    assert f"--index-url {CPU_INDEX} -c constraints.txt torch" in lines[0]
    assert "--index-url" not in lines[1] and "-e '.[dev]'" in lines[1]


def test_readme_documents_both_builds():
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "PyTorch's CUDA build" in text
    assert f"make run TORCH_INDEX={CPU_INDEX}" in text
