"""Test-suite options shared by every directory."""

from __future__ import annotations

import os

import pytest

# The suite runs offline, by the Hub's own switches (read by huggingface_hub, transformers and
# datasets when they are imported, which is after this file): nothing is downloaded, and a test
# that would fetch a model or a data set fails at once. Tests of the online path unset them in a
# subprocess of their own.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``architectures`` (the whole-mapping sweep, minutes) run only when the marker
    expression names them (``-m architectures``); otherwise they are deselected, not skipped."""
    if "architectures" in (config.getoption("markexpr") or ""):
        return
    keep = [item for item in items if item.get_closest_marker("architectures") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
