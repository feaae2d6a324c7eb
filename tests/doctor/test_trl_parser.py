"""TRL's configs read through TRL itself: the installed ``GRPOConfig`` / ``RLOOConfig`` dataclass
for the defaults, ``transformers.HfArgumentParser`` to build the file's fields (TRL's own
``__post_init__`` checks). TRL is never in klpo's install: these tests skip without it
(``pip install trl==1.16.0`` in an environment of its own, as for ``tests/integrations``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from klpo.doctor import read, trl_config  # noqa: E402  (trl_config: the TRL readers' fields)
from klpo.doctor.frameworks import trl as reader  # noqa: E402
from klpo.doctor.reading import Settings  # noqa: E402

FIX = Path(__file__).parent / "fixtures"


def _errors(r):
    return [f.text for f in r.findings if f.level == "error"]


def test_the_installed_trl_gives_the_defaults_and_the_reading_says_so():
    r = read(FIX / "trl_grpo.yaml")
    assert r.defaults_version == trl.__version__
    assert f"installed TRL {trl.__version__}'s GRPOConfig" in r.defaults_from
    assert "HfArgumentParser" in r.defaults_from
    table = reader.installed_table("grpo")
    assert table.defaults["beta"] == trl.GRPOConfig.__dataclass_fields__["beta"].default


def test_the_reading_through_trl_equals_the_tables(monkeypatch):
    """TRL 1.16 installed and its table shipped: the same fields and defaults, the same reading."""
    if trl.__version__ != reader.VERSION:
        pytest.skip(f"the shipped table is TRL {reader.VERSION}'s")
    for name in ("trl_grpo.yaml", "trl_rloo.yaml", "examples/trl_drgrpo_paper_index.yaml"):
        through = read(FIX / name)
        monkeypatch.setattr(trl_config, "installed_table", lambda kind: None)
        tabled = read(FIX / name)
        monkeypatch.undo()
        assert "table" in tabled.defaults_from
        assert through.terms == tabled.terms
        assert (through.group_size, through.updates_per_batch) == (
            tabled.group_size,
            tabled.updates_per_batch,
        )
        assert through.equivalent == tabled.equivalent
        assert [f.text for f in through.findings] == [f.text for f in tabled.findings]


def test_a_refusal_in_trls_own_words(tmp_path):
    """GRPOConfig.__post_init__ refuses generation_batch_size with steps_per_generation; the
    table's reading has no such rule."""
    cfg = tmp_path / "both.yaml"
    cfg.write_text(
        "beta: 0.04\nnum_generations: 4\nper_device_train_batch_size: 4\n"
        "generation_batch_size: 16\nsteps_per_generation: 4\n"
    )
    [err] = _errors(read(cfg))
    assert "can not be both configured" in err and "GRPOConfig" in err
    cfg.write_text("beta: 0.04\nnum_generations: 1\n")
    [err] = _errors(read(cfg))
    assert "at least 2 generations" in err


def test_a_process_dependent_check_is_left_to_the_doctors_own_finding(tmp_path):
    """On one process TRL refuses 3 completions per group in a generation of 8; on 3 processes
    it runs: the doctor's finding (a warning with the process count) stands, not an error."""
    cfg = tmp_path / "odd.yaml"
    cfg.write_text("beta: 0.04\nnum_generations: 3\nper_device_train_batch_size: 8\n")
    r = read(cfg)
    assert _errors(r) == []
    assert any("multiple of 3 processes" in f.text for f in r.findings)


@pytest.mark.parametrize(
    ("fields", "accum"),
    [
        ({"per_device_train_batch_size": 4, "generation_batch_size": 32}, 1),
        ({"per_device_train_batch_size": 2, "generation_batch_size": 16}, 2),
        ({"per_device_train_batch_size": 4, "steps_per_generation": 8}, 4),
        ({"per_device_train_batch_size": 4}, 2),
    ],
)
def test_optimiser_steps_per_generation_are_trls_own(fields, accum):
    """Oracle: TRL's __post_init__ (one process) derives steps_per_generation; the doctor's
    optimiser steps per generation are that over the accumulation steps."""
    from transformers import HfArgumentParser

    given = {**fields, "gradient_accumulation_steps": accum, "num_generations": 4}
    (cfg,) = HfArgumentParser(trl.GRPOConfig).parse_dict({**given, "use_cpu": True})
    table = reader.installed_table("grpo")
    iters, reuse, _ = reader.updates(Settings(given, table.defaults, "t"))
    assert iters == cfg.num_iterations
    assert reuse == max(1, cfg.steps_per_generation // accum)


def test_a_named_version_other_than_the_installed_reads_the_table(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("beta: 0.04\nnum_generations: 4\n")
    from klpo.doctor import read as read_

    r = read_(cfg, version="1.15.9")
    assert "table" in r.defaults_from
