"""The committed reference pages are exactly what the code generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.train.tools.docs import PAGES

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_generated_page_is_up_to_date(name):
    committed = DOCS / name
    assert committed.is_file(), f"run `klpo docs --out docs` to create {committed}"
    assert committed.read_text() == PAGES[name](), f"{name} is stale: run `klpo docs --out docs`"


def test_estimator_page_states_the_headline_claims():
    text = PAGES["estimators.md"]()
    assert "| `k3` | exp(-d) + d - 1 | KL(pi_theta ‖ pi_ref) | yes | yes |" in text
    assert "grad KL(pi_ref ‖ pi_theta) *" in text
