"""``klpo lab report``: run the default suite and write report.md, results.json and PNG plots.

The suite (:func:`run_report`):

1. Schulman's table (mu = 0.1 and 1): published, exact closed form, Monte Carlo;
2. a mu sweep of every Gaussian estimator (plot ``mu_sweep.png``);
3. a hand-checked categorical oracle and a 2-step sequence oracle: exact
   values and the gradient table (estimator × placement: cosine and relative error to each true
   gradient), checked against Monte Carlo;
4. gradient cosines across random LM-like categoricals of growing KL (``gradient_cosines.png``);
5. ``ref_is`` variants' bias and spread against the KL (``ref_is_variants.png``);
6. the drift experiment for ``adaptive_mix`` (``drift.png``);
7. verdicts on claims about ``ref_is`` and ``adaptive_mix`` (:mod:`klpo.lab.claims`,
   docs/claims.md), computed from the numbers above.

Every file is written atomically. The default preset finishes in under 3 minutes on 2 CPU cores;
``quick`` is a smoke-test preset of a few seconds.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from klpo import __version__
from klpo.lab import experiments as ex
from klpo.lab import plots
from klpo.lab.claims import verdicts
from klpo.lab.distributions import SequencePair
from klpo.lab.files import to_json, write_atomic
from klpo.lab.sections import PLOTS, render

__all__ = [
    "PLOTS",
    "PRESETS",
    "Preset",
    "categorical_oracle_pair",
    "render",
    "run_report",
    "sequence_oracle_pair",
    "to_json",
    "verdicts",
]


@dataclass(frozen=True)
class Preset:
    """Sizes of the report's experiments."""

    name: str
    schulman_samples: int
    sweep_mus: tuple[float, ...]
    sweep_samples: int
    oracle_samples: int
    cosine_vocab: int
    cosine_kls: tuple[float, ...]
    cosine_draws: int
    variant_vocab: int
    variant_kls: tuple[float, ...]
    variant_batch: int
    variant_batches: int
    drift_vocab: int
    drift_steps: int
    drift_max_kl: float
    drift_runs: int
    drift_batch: int

    @property
    def units(self) -> int:
        """Progress units: one per mu, random pair, variant KL, drift step, and the rest."""
        schulman, oracles, plots_, report_md = 2, 2, 1, 1
        return (
            schulman
            + len(self.sweep_mus)
            + oracles
            + len(self.cosine_kls) * self.cosine_draws
            + len(self.variant_kls)
            + self.drift_steps
            + 1  # the drift visits steps 0..drift_steps
            + plots_
            + report_md
        )


_KLS = (0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 2.0, 3.0)

PRESETS: dict[str, Preset] = {
    "default": Preset(
        name="default",
        schulman_samples=10_000_000,
        sweep_mus=tuple(float(x) for x in np.round(np.geomspace(0.05, 3.0, 16), 4)),
        sweep_samples=2_000_000,
        oracle_samples=1_000_000,
        cosine_vocab=32_768,
        cosine_kls=_KLS,
        cosine_draws=8,
        variant_vocab=32_768,
        variant_kls=_KLS,
        variant_batch=64,
        variant_batches=20_000,
        drift_vocab=1_000,
        drift_steps=200,
        drift_max_kl=2.0,
        drift_runs=1_000,
        drift_batch=64,
    ),
    "quick": Preset(
        name="quick",
        schulman_samples=200_000,
        sweep_mus=(0.1, 0.5, 1.0, 2.0),
        sweep_samples=50_000,
        oracle_samples=50_000,
        cosine_vocab=512,
        cosine_kls=(0.03, 0.3, 3.0),
        cosine_draws=1,
        variant_vocab=512,
        variant_kls=(0.03, 0.3, 3.0),
        variant_batch=32,
        variant_batches=300,
        drift_vocab=200,
        drift_steps=30,
        drift_max_kl=2.0,
        drift_runs=40,
        drift_batch=32,
    ),
}


def categorical_oracle_pair() -> SequencePair:
    """pi = (0.7, 0.2, 0.1), pi_ref = (0.5, 0.3, 0.2): a categorical small enough to check by hand."""
    return SequencePair.from_probabilities([0.7, 0.2, 0.1], [0.5, 0.3, 0.2])


SEQUENCE_ORACLE_SPEC: dict[str, Any] = {
    # vocab {0, 1}, length 2: 4 sequences, 3 prefixes, 6 logits per model (checkable by hand).
    "vocab": 2,
    "length": 2,
    "policy": {"": [0.3, -0.2], "0": [0.5, 0.0], "1": [-0.4, 0.6]},
    "reference": {"": [0.0, 0.0], "0": [0.0, 0.3], "1": [0.2, 0.0]},
}


def sequence_oracle_pair() -> SequencePair:
    """The 2-step tabular model of :data:`SEQUENCE_ORACLE_SPEC` (vocabulary {0, 1}, length 2)."""
    return SequencePair.from_spec(SEQUENCE_ORACLE_SPEC)


# --------------------------------------------------------------------------------------------
# The suite.


def run_report(
    out: Path,
    preset: Preset = PRESETS["default"],
    *,
    seed: int = 0,
    progress: Callable[[int, str], None] | None = None,
    training: Path | None = None,
) -> dict:
    """Run the suite and write ``out/report.md``, ``out/results.json`` and the PNG plots.

    Args:
        out: the output folder (created).
        preset: experiment sizes (:data:`PRESETS`).
        seed: the base seed; every experiment derives its own from it.
        progress: called as ``progress(units_done, description)`` after each unit of work;
            ``preset.units`` units in all.
        training: a ``klpo compare`` study's ``results.csv`` with ``ref_is`` and
            ``adaptive_mix`` runs; the training claim is then judged on it
            (:func:`klpo.lab.training.judge_training_claim`).

    Returns:
        the results (also written to results.json).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    done = 0

    def step(description: str, units: int = 1) -> None:
        nonlocal done
        done += units
        if progress is not None:
            progress(done, description)

    started = time.perf_counter()
    timings: dict[str, float] = {}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        value = fn()
        timings[key] = time.perf_counter() - t0
        return value

    results: dict[str, Any] = {
        "klpo_version": __version__,
        "preset": asdict(preset),
        "seed": seed,
    }
    _run_experiments(results, preset, seed, step, timed)
    if training is not None:
        from klpo.lab.training import judge_training_claim, read_results, study_scale

        rows = read_results(training)
        results["training"] = judge_training_claim(rows, scale=study_scale(rows))
    results["verdicts"] = verdicts(results)
    t0 = time.perf_counter()
    plots.plot_mu_sweep(results["mu_sweep"], out / PLOTS["mu_sweep"])
    plots.plot_gradient_cosines(results["gradient_cosines"], out / PLOTS["gradient_cosines"])
    plots.plot_ref_is_variants(results["ref_is_variants"], out / PLOTS["ref_is_variants"])
    plots.plot_drift(results["drift"], out / PLOTS["drift"])
    timings["plots"] = time.perf_counter() - t0
    step("plots")
    timings["total"] = time.perf_counter() - started
    results["timings_s"] = timings
    results["machine"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    write_atomic(out / "results.json", json.dumps(to_json(results), indent=1) + "\n")
    write_atomic(out / "report.md", render(results))
    step("report.md")
    return results


def _run_experiments(
    results: dict[str, Any],
    preset: Preset,
    seed: int,
    step: Callable[..., None],
    timed: Callable[[str, Callable[[], Any]], Any],
) -> None:
    """The suite's experiments, in order, into ``results`` (each timed by ``timed``, its progress
    reported by ``step``); every experiment's seed is derived from ``seed``."""
    results["schulman"] = timed(
        "schulman", lambda: ex.schulman_table(preset.schulman_samples, seed)
    )
    step("Schulman's table", 2)
    results["mu_sweep"] = timed(
        "mu_sweep",
        lambda: ex.mu_sweep(
            list(preset.sweep_mus), preset.sweep_samples, seed + 100, lambda: step("mu sweep")
        ),
    )
    results["categorical_oracle"] = timed(
        "categorical_oracle",
        lambda: ex.oracle(categorical_oracle_pair(), preset.oracle_samples, seed + 200),
    )
    step("categorical oracle")
    results["sequence_oracle"] = timed(
        "sequence_oracle",
        lambda: ex.oracle(sequence_oracle_pair(), preset.oracle_samples, seed + 300),
    )
    results["sequence_oracle"]["spec"] = SEQUENCE_ORACLE_SPEC
    step("sequence oracle")
    results["gradient_cosines"] = timed(
        "gradient_cosines",
        lambda: ex.gradient_cosines(
            preset.cosine_vocab,
            list(preset.cosine_kls),
            preset.cosine_draws,
            seed + 400,
            lambda: step("gradient cosines"),
        ),
    )
    results["ref_is_variants"] = timed(
        "ref_is_variants",
        lambda: ex.ref_is_variants(
            preset.variant_vocab,
            list(preset.variant_kls),
            preset.variant_batch,
            preset.variant_batches,
            seed + 500,
            lambda: step("ref_is variants"),
        ),
    )
    results["drift"] = timed(
        "drift",
        lambda: ex.drift(
            preset.drift_vocab,
            preset.drift_steps,
            preset.drift_max_kl,
            preset.drift_runs,
            preset.drift_batch,
            seed + 600,
            lambda: step("drift"),
        ),
    )
