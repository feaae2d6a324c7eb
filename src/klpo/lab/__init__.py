"""The estimator lab: exact and Monte Carlo statistics of every KL estimator, value and gradient.

Imports only the library (``klpo.kl``; files through the private ``klpo._io``), never the trainer
or the CLI. Modules:

- :mod:`klpo.lab.distributions`  Gaussians, categoricals, Zipfian LM-like pairs, tabular sequence models
- :mod:`klpo.lab.ref_is`         ``ref_is`` and ``adaptive_mix`` (the "K2" and "K3" of docs/claims.md)
- :mod:`klpo.lab.exact`          closed forms, quadrature, and enumeration of values and gradients
- :mod:`klpo.lab.montecarlo`     Monte Carlo statistics, seeded
- :mod:`klpo.lab.staleness`      exact expected gradients when the sampler is k versions behind
- :mod:`klpo.lab.stats`          value statistics, cosines, streaming moments
- :mod:`klpo.lab.summaries`      the JSON records of ``klpo lab gaussian|categorical|sequence``
- :mod:`klpo.lab.experiments`    the experiments of the report
- :mod:`klpo.lab.report`         ``klpo lab report``: the presets and the suite
- :mod:`klpo.lab.sections`       report.md, one function per section
- :mod:`klpo.lab.claims`         the verdicts on the claims quoted in docs/claims.md
- :mod:`klpo.lab.markdown`       number and table formatting for report.md
- :mod:`klpo.lab.files`          plain JSON data, atomic writes
- :mod:`klpo.lab.plots`          the PNG figures (matplotlib, imported on first use)
- :mod:`klpo.lab.teacher`        ``klpo explain --teacher``: which divergence each distillation term follows
- :mod:`klpo.lab.tables`         the shipped answer tables, written by ``python -m klpo.lab.tables``
- :mod:`klpo.lab.training`       the training claim, judged on a ``klpo compare`` study's results.csv

Every estimator of :data:`klpo.kl.ESTIMATORS` comes from :func:`klpo.kl.estimate`; ``ref_is`` and
``adaptive_mix`` need samples of the reference and live here.
"""

from __future__ import annotations

from klpo.lab.distributions import (
    GaussianPair,
    SequencePair,
    SpecError,
    drift_path,
    lm_pair,
    prefixes,
    zipf_logits,
)
from klpo.lab.exact import (
    LAB_ESTIMATORS,
    ExactResult,
    Tables,
    analyse,
    gaussian_moments,
    gaussian_quadrature,
    gradient_moments,
    placements_of,
    target_of,
    true_gradients,
)
from klpo.lab.montecarlo import (
    GAUSSIAN_ESTIMATORS,
    MonteCarloResult,
    gaussian_monte_carlo,
    monte_carlo,
)
from klpo.lab.ref_is import (
    SEED_CLIP,
    AdaptiveMix,
    AdaptiveMixStream,
    adaptive_mix,
    ref_is,
    ref_is_terms,
)
from klpo.lab.report import PRESETS, Preset, run_report
from klpo.lab.stats import RunningStats, ValueStats, cosine, relative_error
from klpo.lab.summaries import gaussian_summary, pair_summary

__all__ = [
    "GAUSSIAN_ESTIMATORS",
    "LAB_ESTIMATORS",
    "PRESETS",
    "SEED_CLIP",
    "AdaptiveMix",
    "AdaptiveMixStream",
    "ExactResult",
    "GaussianPair",
    "MonteCarloResult",
    "Preset",
    "RunningStats",
    "SequencePair",
    "SpecError",
    "Tables",
    "ValueStats",
    "adaptive_mix",
    "analyse",
    "cosine",
    "drift_path",
    "gaussian_moments",
    "gaussian_monte_carlo",
    "gaussian_quadrature",
    "gaussian_summary",
    "gradient_moments",
    "lm_pair",
    "monte_carlo",
    "pair_summary",
    "placements_of",
    "prefixes",
    "ref_is",
    "ref_is_terms",
    "relative_error",
    "run_report",
    "target_of",
    "true_gradients",
    "zipf_logits",
]
