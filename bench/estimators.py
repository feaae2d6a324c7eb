"""Estimator samples per second of the lab's Monte Carlo paths, against naive references.

    flock /tmp/klpo-cpu.lock .venv/bin/python bench/estimators.py [--samples N] [--repeats R]

Prints one table. Each row times one job end to end (sampling, log-probs, the estimator through
``klpo.kl.estimate``, and the statistics: mean, sd, higher moments, fraction negative) and divides
the samples it handles by the median wall time of ``--repeats`` runs after a warm-up:

- Gaussian rows (pi_theta = N(0, 1), pi_ref = N(1, 1)): ``klpo.lab.gaussian_monte_carlo`` against
  Schulman's own script ("Approximating KL Divergence", 2020: ``torch.distributions.Normal``,
  ``p.log_prob(x) - q.log_prob(x)``, the estimator's formula, ``.mean()`` and ``.std()``, float32),
  one estimator per pass. The "all" row counts estimator-samples (samples × the 13 per-sample
  estimators): the lab shares each sample across estimators, the naive script samples again for
  each. adaptive_mix's naive reference is a Python loop over batches of 64 (its weight depends on
  past batches).
  Goal: >= 10^7 samples per second per estimator on 2 cores.
- Categorical rows (a Zipfian LM-like pair): ``klpo.lab.monte_carlo`` (values, and values with the
  mean and variance of the per-sample gradient) against sampling with ``torch.multinomial``,
  gathering log-probs and reducing (values), or per-sample gradients by autograd (gradients).

No peer (TRL, Liger-Kernel) offers a Monte Carlo lab of KL estimators, so there is no peer column.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from klpo import kl
from klpo.lab import GAUSSIAN_ESTIMATORS, gaussian_monte_carlo, lm_pair, monte_carlo

MU = 1.0
GOAL = 1e7


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- naive references ---------------------------------------------------------------------------

_FORMULAS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # of logr = log p(x) - log q(x) = -d, as in Schulman's script
    "k1": lambda logr: -logr,
    "k2": lambda logr: logr**2 / 2,
    "k3": lambda logr: (logr.exp() - 1) - logr,
    "abs": lambda logr: logr.abs(),
    "low_var_kl": lambda logr: (logr.clamp(-20, 20).exp() - logr.clamp(-20, 20) - 1).clamp(-10, 10),
    "kl_ref_theta": lambda logr: logr.exp() * logr - (logr.exp() - 1),
}
_SAME_VALUE = {"k1+": "k1", "k2+": "k2", "k3+": "k3", "abs+": "abs", "k3_is": "k3"}


def naive_gaussian(name: str, n: int) -> None:
    """Schulman's script for one estimator: sample, log-prob ratio, formula, mean and sd."""
    q, p = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(MU, 1.0)
    if name in ("ref_is", "ref_is_clip"):
        x = p.sample((n,))
        log_w = q.log_prob(x) - p.log_prob(x)
        w = log_w.exp() if name == "ref_is" else log_w.exp().clamp(0.1, 10.0)
        k = w * log_w
    else:
        x = q.sample((n,))
        logr = p.log_prob(x) - q.log_prob(x)
        k = _FORMULAS[_SAME_VALUE.get(name, name)](logr)
    k.mean(), k.std(), (k < 0).float().mean()


def naive_adaptive_mix(n: int, batch: int = 64) -> None:
    """A Python loop over batches: k1 and ref_is batch means, a sliding window of past outputs."""
    q, p = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(MU, 1.0)
    window: list[float] = []
    outs = []
    for _ in range(n // batch):
        x, y = q.sample((batch,)), p.sample((batch,))
        k1 = q.log_prob(x) - p.log_prob(x)
        log_w = q.log_prob(y) - p.log_prob(y)
        ris = log_w.exp() * log_w
        kl_window = sum(window) / len(window) if window else 0.0
        a = 1 / (1 + math.exp(-10.0 * (kl_window - 0.5)))
        values = a * k1 + (1 - a) * ris
        outs.append(values)
        window = [*window, float(values.mean())][-10:]
    k = torch.cat(outs)
    k.mean(), k.std(), (k < 0).float().mean()


def naive_categorical_values(logp: torch.Tensor, logp_ref: torch.Tensor, n: int) -> None:
    y = torch.multinomial(logp.exp(), n, replacement=True)
    k = kl.estimate("k3", logp[y], logp_ref[y])
    k.mean(), k.std(), (k < 0).float().mean()


def naive_categorical_gradients(logits: torch.Tensor, logits_ref: torch.Tensor, n: int) -> None:
    """Per-sample gradients of k3 in the loss by autograd over an [n, V] copy of the logits."""
    probs = torch.softmax(logits, -1)
    y = torch.multinomial(probs, n, replacement=True)
    theta = logits.expand(n, -1).clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1).gather(1, y[:, None])[:, 0]
    logp_ref = torch.log_softmax(logits_ref, -1)[y]
    k = kl.estimate("k3", logp, logp_ref)
    (g,) = torch.autograd.grad(k.sum(), theta)
    k.mean(), k.std(), g.mean(0), g.var(0)


# -- the table ----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000, help="Gaussian samples per run")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n, reps = args.samples, args.repeats
    rows: list[tuple[str, float, float, bool | None]] = []

    for name in ("k1", "k2", "k3", "ref_is", "kl_ref_theta"):
        t_naive = timed(lambda name=name: naive_gaussian(name, n), reps)
        t_lab = timed(lambda name=name: gaussian_monte_carlo(MU, n, names=(name,)), reps)
        rows.append((f"gaussian {name}", n / t_naive, n / t_lab, n / t_lab >= GOAL))
    n_mix = max(n // 10, 64_000)
    t_naive = timed(lambda: naive_adaptive_mix(n_mix), 1)
    t_lab = timed(lambda: gaussian_monte_carlo(MU, n, names=("adaptive_mix",)), reps)
    rows.append(("gaussian adaptive_mix", n_mix / t_naive, n / t_lab, n / t_lab >= GOAL))
    per_sample = tuple(name for name in GAUSSIAN_ESTIMATORS if name != "adaptive_mix")
    naive_all = sum(timed(lambda name=name: naive_gaussian(name, n), 1) for name in per_sample)
    t_lab = timed(lambda: gaussian_monte_carlo(MU, n, names=per_sample), reps)
    m = len(per_sample)
    rows.append(
        (
            f"gaussian all {m} per-sample estimators (estimator-samples)",
            n * m / naive_all,
            n * m / t_lab,
            n * m / t_lab >= GOAL,
        )
    )

    gen = torch.Generator().manual_seed(0)
    pair = lm_pair(32_768, 0.5, generator=gen)
    logp, logp_ref = (
        torch.log_softmax(pair.logits[0], -1),
        torch.log_softmax(pair.logits_ref[0], -1),
    )
    n_cat = 1_000_000
    t_naive = timed(lambda: naive_categorical_values(logp, logp_ref, n_cat), reps)
    t_lab = timed(lambda: monte_carlo(pair, n_cat, names=("k3",), gradients=False), reps)
    rows.append(("categorical V=32768 k3 values", n_cat / t_naive, n_cat / t_lab, None))
    small = lm_pair(1024, 0.5, generator=gen)
    n_grad = 20_000
    t_naive = timed(
        lambda: naive_categorical_gradients(small.logits[0], small.logits_ref[0], n_grad), reps
    )
    t_lab = timed(lambda: monte_carlo(small, n_grad, names=("k3",)), reps)
    rows.append(
        ("categorical V=1024 k3 values + gradient mean/var", n_grad / t_naive, n_grad / t_lab, None)
    )

    print(
        f"\nEstimator samples per second (median of {reps}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads); goal >= {GOAL:.0e}/s for Gaussian rows.\n"
    )
    print("| case | naive reference /s | klpo.lab /s | ratio (klpo.lab / naive) | goal |")
    print("|---|---|---|---|---|")
    for case, naive, lab, goal in rows:
        mark = "" if goal is None else ("met" if goal else "**missed**")
        print(f"| {case} | {naive:.3g} | {lab:.3g} | {lab / naive:.2f}x | {mark} |")


if __name__ == "__main__":
    main()
