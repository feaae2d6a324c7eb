"""docs/literature/exact_checks.py, the exact gradients docs/literature.md quotes: it checks each
against a closed form as it prints (an AssertionError stops it), so running it is the test."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "docs" / "literature" / "exact_checks.py"


def test_exact_checks_run_and_print_their_rows(capsys: pytest.CaptureFixture[str]) -> None:
    before = torch.get_default_dtype()
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert torch.get_default_dtype() == before  # it runs in the suite's process: no global state
    out = capsys.readouterr().out
    assert "k1 in the loss        E[grad] = [0. 0. 0.]" in out
    assert "k3 in the loss        E[grad] = [ 0.2 -0.1 -0.1]" in out  # pi - pi_ref
    for part in ("1. pi_theta", "2. exp(d) - 1 - d", "3. off-policy", "4. value spread"):
        assert part in out
    assert out.count("KL(pi_theta ‖ pi_old)") == 3 and out.count("   KL ") == 4
