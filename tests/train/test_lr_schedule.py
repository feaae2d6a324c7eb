"""klpo.train.lr_schedule: the schedule's factor at each step against its closed form, and the
checks that run before a model loads (arguments the schedule does not take, a warm-up longer
than the run)."""

from __future__ import annotations

import math

import pytest

from klpo.train.config import ConfigError, build_config
from klpo.train.lr_schedule import check_lr_schedule, lr_factors, schedule_kwargs


def _cfg(*overrides: str):
    return build_config(overrides=list(overrides))


@pytest.mark.parametrize(
    ("name", "warmup", "steps", "closed_form"),
    [
        # lambda(s) = min(1, s / W): the default schedule.
        ("constant_with_warmup", 3, 6, lambda s, w, n: min(1.0, s / w)),
        # s / W during the warm-up, then (N - s) / (N - W) down to 0.
        ("linear", 2, 6, lambda s, w, n: s / w if s < w else max(0.0, (n - s) / (n - w))),
        # 0.5 (1 + cos(pi (s - W) / (N - W))) after the warm-up (half a cosine).
        (
            "cosine",
            0,
            4,
            lambda s, w, n: 0.5 * (1 + math.cos(math.pi * (s - w) / (n - w))),
        ),
        ("constant", 0, 3, lambda s, w, n: 1.0),
    ],
)
def test_the_factor_before_step_s_is_the_closed_form_at_s(name, warmup, steps, closed_form):
    cfg = _cfg(f"optim.lr_scheduler={name}", f"optim.warmup_steps={warmup}", f"run.steps={steps}")
    want = [closed_form(s, warmup, steps) for s in range(1, steps + 1)]
    assert lr_factors(cfg) == pytest.approx(want, abs=1e-12)


def test_the_default_warmup_by_hand():
    cfg = _cfg("optim.lr_scheduler=constant_with_warmup", "optim.warmup_steps=3", "run.steps=5")
    assert lr_factors(cfg) == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0, 1.0])
    assert check_lr_schedule(cfg) == []


def test_an_argument_the_schedule_does_not_take_is_refused_with_what_it_takes():
    assert schedule_kwargs("cosine") == ["num_cycles"]
    assert schedule_kwargs("constant") == []
    cfg = _cfg("optim.lr_scheduler=linear", "optim.lr_scheduler_kwargs={num_cycles: 2}")
    with pytest.raises(ConfigError, match=r"'num_cycles' is not an argument of the linear"):
        check_lr_schedule(cfg)
    cfg = _cfg("optim.lr_scheduler=constant", "optim.lr_scheduler_kwargs={num_cycles: 2}")
    with pytest.raises(ConfigError, match=r"takes none \(transformers' get_scheduler"):
        check_lr_schedule(cfg)


def test_a_warmup_longer_than_the_run_is_warned_with_its_peak():
    """W = 10 over N = 4 steps of linear: the factor peaks at step 4, 4 / 10 = 40% of optim.lr."""
    cfg = _cfg(
        "optim.lr_scheduler=linear", "optim.warmup_steps=10", "run.steps=4", "optim.lr=0.001"
    )
    (line,) = check_lr_schedule(cfg)
    assert line.startswith("optim.warmup_steps=10 is longer than the run (run.steps=4)")
    assert "peaks at 40.0% of optim.lr=0.001 (step 4)" in line
