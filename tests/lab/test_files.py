"""klpo.lab.files: the lab's results as plain JSON data, by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from klpo.lab.files import to_json, write_atomic


def test_plain_json_data_with_non_finite_floats_as_none():
    data = {
        1: torch.tensor([0.5, math.inf]),
        "a": np.array([[1, 2]], dtype=np.int64),
        "b": (np.float32(0.25), np.bool_(True), math.nan, -math.inf, 3),
        "c": [np.int32(7), "text", None],
    }
    out = to_json(data)
    assert out == {
        "1": [0.5, None],
        "a": [[1, 2]],
        "b": [0.25, True, None, None, 3],
        "c": [7, "text", None],
    }
    assert type(out["a"][0][0]) is int and type(out["b"][1]) is bool
    json.dumps(out, allow_nan=False)  # strict JSON: no NaN or Infinity left


def test_written_atomically(tmp_path):
    path = tmp_path / "results.json"
    write_atomic(path, json.dumps(to_json({"x": np.float64(1.5)})))
    assert json.loads(path.read_text()) == {"x": 1.5}
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary file left
