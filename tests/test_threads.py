"""klpo._threads: the passive OpenMP wait set before torch loads, threads from the free cores."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from klpo import _threads


@pytest.mark.parametrize(
    ("cores", "busy", "world", "want"),
    [
        (2, 0.0, 1, 2),  # a quiet machine: every core
        (2, 0.4, 1, 2),  # 2 - 0.4 = 1.6 -> 2 (nearest whole core)
        (2, 0.6, 1, 1),  # 1.4 -> 1
        (2, 1.0, 1, 1),  # one busy process on the other core
        (2, 4.0, 1, 1),  # overloaded: still one thread, never zero
        (2, 10.0, 1, 1),
        (16, 3.4, 1, 13),  # 12.6 -> 13
        (16, 3.4, 2, 6),  # 13 free cores between two ranks: 6 each
        (4, 0.0, 8, 1),  # more ranks than cores: one each
        (8, -1.0, 1, 8),  # a negative reading (clock skew) counts as idle, and never above cores
    ],
)
def test_choose_threads_from_injected_loads(cores, busy, world, want):
    assert _threads.choose_threads(cores, busy, world) == want


def test_choose_threads_refuses_no_cores():
    with pytest.raises(ValueError, match="at least 1"):
        _threads.choose_threads(0, 0.0)


def test_loaded_note_only_when_fewer_threads_than_cores():
    assert _threads.loaded_note(2, 0.1, 2) is None
    assert _threads.loaded_note(16, 3.4, 6, world=2) == (
        "the machine is busy (3.4 of 16 cores in use by other processes): 6 torch threads each "
        "(run.threads sets the number)"
    )
    note = _threads.loaded_note(2, 4.0, 1)
    assert note is not None and "1 torch thread (" in note and "4.0 of 2 cores" in note


def test_use_free_cores_sets_torch_and_logs(monkeypatch):
    import torch

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(_threads, "busy_cores", lambda cores: 3.0)
    lines: list[str] = []
    try:
        assert _threads.use_free_cores(log=lines.append) == 1
        assert torch.get_num_threads() == 1
        assert len(lines) == 1 and "busy" in lines[0]
        # A quiet machine: both cores, and nothing printed.
        monkeypatch.setattr(_threads, "busy_cores", lambda cores: 0.0)
        lines.clear()
        assert _threads.use_free_cores(log=lines.append) == 2
        assert lines == []
        # The user's OMP_NUM_THREADS stands.
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        monkeypatch.setattr(_threads, "busy_cores", lambda cores: pytest.fail("measured"))
        assert _threads.use_free_cores(log=lines.append) == 1
    finally:
        torch.set_num_threads(before)


def test_busy_cores_is_a_reading_within_the_machine():
    busy = _threads.busy_cores(interval=0.05)
    assert 0.0 <= busy <= (os.cpu_count() or 1) * 100  # load average may exceed the core count


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


# What the entry point leaves for torch: the policy, and whether torch was already loaded.
_PROBE = (
    "import os, sys; import klpo.cli as cli; "
    "cli.app = lambda: print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules); "
    "cli.main()"
)


def test_entry_point_sets_passive_wait_before_torch_loads():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=_clean_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["PASSIVE", "False"]


def test_entry_point_keeps_the_users_policy():
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=_clean_env(OMP_WAIT_POLICY="ACTIVE"),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["ACTIVE", "False"]


def test_passive_wait_is_not_claimed_once_torch_is_loaded():
    code = (
        "import os, sys, torch; from klpo._threads import passive_openmp_wait; "
        "print(passive_openmp_wait(), os.environ.get('OMP_WAIT_POLICY'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "None"]


def test_version_option():
    out = subprocess.run(
        [sys.executable, "-m", "klpo", "--version"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    from klpo import __version__

    assert out.stdout.strip() == f"klpo {__version__}"
