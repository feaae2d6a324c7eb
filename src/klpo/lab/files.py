"""Writing the lab's outputs: plain JSON data, and files written atomically (:mod:`klpo._io`)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from klpo._io import write_atomic

__all__ = ["to_json", "write_atomic"]


def to_json(x: Any) -> Any:
    """Plain JSON data: tensors and arrays to lists, non-finite floats to ``None``."""
    if isinstance(x, dict):
        return {str(k): to_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_json(v) for v in x]
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return to_json(x.tolist())
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x
