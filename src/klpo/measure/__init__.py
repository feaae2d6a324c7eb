r"""The estimator lab on a user's own models (``klpo doctor --model DIR --reference DIR --data FILE``).

On a batch of the user's prompts, completions y ~ pi_theta are sampled (temperature 1, no top-k, as
:func:`klpo.train.rollout.samplers.generate`), and at every completion position t both models' full
next-token distributions are computed. That gives, per position and with the prefix held fixed,
the **exact** per-position KLs

    K_t = KL(pi_theta(· | y_<t) ‖ pi_ref(· | y_<t)),    K'_t = KL(pi_ref(· | y_<t) ‖ pi_theta(· | y_<t)),

against which each estimator's sampled value est_t (a function of the one sampled token) is
measured: per token, the error est_t - K_t (the estimate's sampling noise given the prefix; its
mean is the bias, exactly 0 in expectation for k1, k3; "sd", heavy-tail statistics); per sequence,
S_b = sum_t est_t against sum_t K_t, whose batch mean is the Rao-Blackwellised estimate of the
sequence KL(pi_theta ‖ pi_ref) (exact given the sampled prefixes).

Gradients, on the weights of some linear layers of the policy (:func:`choose_subset`: by
default the last decoder layer's MLP; ``--layer``), with N the number of completion tokens and
each objective a token mean:

- targets: ``per-position θ‖ref`` = grad (1/N) sum_t K_t, ``per-position ref‖θ`` = grad (1/N)
  sum_t K'_t (exact per position), and ``sequence θ‖ref`` = grad (1/N) [sum_t K_t + sum_t log
  pi_theta(y_t) · sg(sum_{t' > t} K_t')], an unbiased estimate of the gradient of the sequence
  KL(pi_theta ‖ pi_ref) (score function for how token t changes the later positions' KL);
- per estimator: ``loss`` = grad (1/N) sum_t est_t (the term differentiated, as GRPO);
  ``reward`` = grad (1/N) sum_t sg(est_t) log pi_theta(y_t) (a per-token penalty, PPO-RLHF at
  pi_old = pi_theta); ``reward-to-go`` = grad (1/N) sum_t log pi_theta(y_t) · sg(sum_{t' >= t}
  est_t') (the penalty's returns-to-go, as klpo's GRPO credits it).

How (:func:`group_vectors`): every objective's gradient is a per-token combination of grad
logp_t, grad K_t and grad K'_t (:func:`coefficients`), taken at the last hidden states by three
backward passes through the output head; one backward pass per objective takes it down to the
measured layers, whose per-completion weight gradients are sketched without being formed
(:class:`Sketch`). The completions form ``--samples`` independent groups (one completion of
every prompt each), and :func:`interval_stats` turns the groups' vectors into cosines of the
*expected* gradients and projections on them, with jackknife intervals; :func:`claim` gives
``klpo.kl.explain``'s answer for a row and :func:`verdict` whether the interval excludes it.
This is the lab on a real model (Schulman 2020; Tang & Munos 2025, arXiv:2506.09477).

Memory (:func:`memory_estimate`, printed before the work): both models' weights, the sampler's
cache, one group's ``[R, C, V]`` logits (float64) and the graph above the measured layers, and
``[O, G + R, D]`` float64 sketches; nothing of the size of the parameters is kept.

The package's rooms: :mod:`~klpo.measure.prompts` (``--data`` and its rendering),
:mod:`~klpo.measure.models` (the pair, loaded and checked as the trainer does),
:mod:`~klpo.measure.objectives` (per-token terms, value statistics, the objectives),
:mod:`~klpo.measure.sketch` (the measured parameters, the sketched gradients),
:mod:`~klpo.measure.intervals` (expected-gradient cosines, jackknife intervals, verdicts),
:mod:`~klpo.measure.memory` (the estimate printed first), :mod:`~klpo.measure.run`
(:func:`measure`) and :mod:`~klpo.measure.render`. Its statistics are the lab's
(:mod:`klpo.lab.stats`: one value-statistics type, one cosine). The doctor imports it only for
``--model``; nothing in the doctor's reading of a config needs it.
"""

from __future__ import annotations

from klpo.measure.errors import MeasureError
from klpo.measure.intervals import claim, gradient_rows, interval_stats, t_quantile, verdict
from klpo.measure.memory import memory_estimate, weights_bytes
from klpo.measure.objectives import (
    ESTIMATORS,
    PLACEMENTS,
    TARGETS,
    Terms,
    gradient_cosines,
    objective_gradients,
    objective_names,
    token_terms,
    value_stats,
)
from klpo.measure.prompts import Prompt, read_prompts, render_prompts
from klpo.measure.render import heavy_tail_notes, render_measurement
from klpo.measure.run import measure
from klpo.measure.sketch import (
    SKETCH,
    Sketch,
    Subset,
    choose_subset,
    group_vectors,
    prompt_caches,
    prompt_free,
)

__all__ = [
    "ESTIMATORS",
    "PLACEMENTS",
    "SKETCH",
    "TARGETS",
    "MeasureError",
    "Prompt",
    "Sketch",
    "Subset",
    "Terms",
    "choose_subset",
    "claim",
    "gradient_cosines",
    "gradient_rows",
    "group_vectors",
    "heavy_tail_notes",
    "interval_stats",
    "measure",
    "memory_estimate",
    "objective_gradients",
    "objective_names",
    "prompt_caches",
    "prompt_free",
    "read_prompts",
    "render_measurement",
    "render_prompts",
    "t_quantile",
    "token_terms",
    "value_stats",
    "verdict",
    "weights_bytes",
]
