"""The committed reference pages are exactly what the code generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.train.tools.docs import PAGES

DOCS = Path(__file__).resolve().parents[3] / "docs"


@pytest.mark.parametrize("name", sorted(PAGES))
def test_generated_page_is_up_to_date(name):
    committed = DOCS / name
    assert committed.is_file(), f"run `klpo docs --out docs` to create {committed}"
    assert committed.read_text() == PAGES[name](), f"{name} is stale: run `klpo docs --out docs`"


def test_estimator_page_states_the_headline_claims():
    text = PAGES["estimators.md"]()
    assert "| `k3` | exp(-d) + d - 1 | KL(pi_theta ‖ pi_ref) | yes | yes |" in text
    assert "grad KL(pi_ref ‖ pi_theta) *" in text


def test_the_config_page_names_every_key_and_every_train_option():
    """Every key of the config (a list's item keys as ``rewards[].name``) has its row, and the
    train options that change what a config does are documented beside them."""
    from klpo.train.config import TrainConfig, key_paths

    text = PAGES["config.md"]()
    sections = set(TrainConfig.model_fields)
    for key in key_paths():
        if key in sections:
            assert f"## `{key}`" in text, key
        else:
            assert f"| `{key}` |" in text, key
    for option in ("--print-config", "--check", "--resume RUN_DIR", "--allow-config-change"):
        assert f"`klpo train {option}" in text or f"`{option}`" in text, option
