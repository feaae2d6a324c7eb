"""The non-timing parts of ``bench/logprobs.py``: the ``--head`` shapes and their checks, naive's
memory by hand, and one child's timing and peak at a tiny shape (no peers needed)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "logprobs.py"


@pytest.fixture(scope="module")
def lp():
    spec = importlib.util.spec_from_file_location("bench_logprobs", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_gemma_head_shape_and_naive_memory_by_hand(lp):
    """Gemma 3 270M's head: 4096 tokens, H = 640, V = 262,144; naive's three float32 [N, V]
    tensors at that size are 3 × 4096 × 262144 × 4 B = 12 GiB, at 512 tokens 1.5 GiB."""
    assert lp.head_shapes("gemma3", None) == [(4096, 640, 262144)]
    assert lp.head_shapes("gemma3", 512) == [(512, 640, 262144)]
    assert lp.naive_bytes(4096, 262144) == 12 * 2**30
    assert lp.naive_bytes(512, 262144) == 1.5 * 2**30
    with pytest.raises(ValueError, match="--head takes gemma3"):
        lp.head_shapes("gemma", None)
    with pytest.raises(ValueError, match="--tokens must be >= 1"):
        lp.head_shapes("gemma3", 0)
    assert {"naive", "klpo", "klpo loss", "liger", "trl", "floor"} == set(lp.HEAD_METHODS)
    avail = lp.mem_available()
    assert avail is None or avail > 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "8"], "give --head too"),
        (["--head", "gemma3", "--tokens", "0"], "--tokens must be >= 1"),
        (["--warmups", "-1"], "--warmups ≥ 0"),
    ],
)
def test_bad_head_arguments_are_refused(lp, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(sys, "argv", ["logprobs.py", *argv])
    with pytest.raises(SystemExit) as err:
        lp.main()
    assert err.value.code == 2 and message in capsys.readouterr().err


def test_child_times_without_warmup_and_its_peak(lp):
    """One timing child at a tiny shape, no warm-up round: every method timed ``reps`` times;
    the peak child reports its own high-water mark (at least the peak over its inputs) and the
    log-probs' error against float64."""
    case = lp.Case("logp", "", 16, 8, 64, "float32")
    got = lp.child(
        {
            "what": "times",
            "case": asdict(case),
            "methods": ["naive", "klpo", "klpo loss"],
            "reps": 2,
            "warmups": 0,
        }
    )
    for m in ("naive", "klpo", "klpo loss"):
        assert got[m]["reps"] == 2 and len(got[m]["rounds"]) == 2
        assert 0 < got[m]["min"] <= got[m]["time"] <= got[m]["max"]
    peak = lp.child(
        {"what": "peak", "case": asdict(lp.Case("logp", "naive", 16, 8, 64, "float32"))}
    )
    assert peak["rss_mib"] >= peak["peak_mib"] >= 0 and peak["err"] < 1e-5


def test_once_times_each_method_in_its_own_process(lp):
    """``--once``: each method's one call, in a process of its own, gives its time (one round:
    median = min = max) and its peak; the floors are left out."""
    case = lp.Case("logp", "", 16, 8, 64, "float32")
    got = lp.measure_group(case, ["naive", "klpo loss", "floor"], 1, 300.0, once=True)
    assert set(got) == {"naive", "klpo loss"}
    for r in got.values():
        assert r["time"] == r["min"] == r["max"] == r["once_s"] > 0 and r["rounds"] == [r["time"]]
        assert r["peak_mib"] >= 0 and r["err"] < 1e-5
    assert "| logp | naive |" in lp.table([("logp", got)])


def test_sweep_tokens_parsing_and_paired_ratios_by_hand(lp):
    """``--sweep-tokens``' counts, and the ratio to naive from the same rounds: rounds of 2, 4, 3
    s against naive's 1, 2, 4 are ratios 2, 2, 0.75 (median 2, min 0.75, max 2)."""
    assert lp.parse_tokens("256,512, 1024") == [256, 512, 1024]
    for bad in ("", "a,b", "256,0"):
        with pytest.raises(ValueError, match="--sweep-tokens takes"):
            lp.parse_tokens(bad)
    results = {
        "naive": {"time": 2.0, "min": 1.0, "max": 4.0, "rounds": [1.0, 2.0, 4.0],
                  "cpu_rounds": [1.0, 1.0, 2.0], "peak_mib": 100.0},
        "klpo": {"time": 3.0, "min": 2.0, "max": 4.0, "rounds": [2.0, 4.0, 3.0],
                 "cpu_rounds": [0.5, 0.75, 1.0], "peak_mib": 25.0},
        "klpo loss": {"error": "absent"},
    }  # fmt: skip
    assert lp.paired(results, "klpo", "naive") == (2.0, 0.75, 2.0)
    assert lp.paired(results, "klpo", "naive", "cpu_rounds") == (0.5, 0.5, 0.75)
    assert lp.paired(results, "klpo loss", "naive") is None
    table = lp.sweep_tokens_table([("logp", 256, results)], ["naive", "klpo", "klpo loss"])
    assert (
        "| logp | 256 | klpo | 3.00 [2.00, 4.00] | 2.000 [0.750, 2.000] | 0.500 | 25 | 0.25 |"
        in (table)
    )
    assert "| logp | 256 | klpo loss | absent |" in table


def test_sweep_tokens_runs_its_methods_at_each_count(lp, monkeypatch, capsys):
    """The sweep at a tiny head (the default head's shape patched): one group per count, every
    method timed and its peak measured, in one table."""
    monkeypatch.setattr(lp, "SWEEP_TOKENS_SHAPE", (8, 64))
    lp.sweep_tokens([4, 16], ["logp"], ["naive", "klpo"], 1, 0, 300.0, False)
    out = capsys.readouterr().out
    for n in (4, 16):
        for m in ("naive", "klpo"):
            row = next(ln for ln in out.splitlines() if ln.startswith(f"| logp | {n} | {m} |"))
            assert row.count("|") == 9 and "?" not in row
