"""Test-suite options shared by every directory."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``architectures`` (the whole-mapping sweep, minutes) run only when the marker
    expression names them (``-m architectures``); otherwise they are deselected, not skipped."""
    if "architectures" in (config.getoption("markexpr") or ""):
        return
    keep = [item for item in items if item.get_closest_marker("architectures") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
