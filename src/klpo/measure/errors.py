"""The measurement's refusals."""

from __future__ import annotations

__all__ = ["MeasureError"]


class MeasureError(ValueError):
    """A measurement that cannot run as asked: the message names the option and the fix."""
