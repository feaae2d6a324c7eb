r"""Statistics with the seed as the unit: intervals, paired tests, Holm, and the seeds a test needs.

A study's runs are independent only across seeds: the runs of one seed share their prompts, their
sampling stream and their start, and the held-out answers of one run share its policy. So a cell
is summarised by one number per seed (its held-out accuracy at the end, its gold reward, ...), and
two cells are compared on the seed-by-seed differences of the runs of the same seed. Pooling the
answers of several seeds and treating them as independent (a Wilson interval or a McNemar test over
``seeds × problems`` answers) mistakes the answers for the unit: seeds differ far beyond binomial
noise, and such a test is as confident as if each answer had its own run.

The pieces, each a small function with its oracle in ``tests/study/test_seeds.py``:

- distributions without scipy: the normal (:func:`normal_cdf`, :func:`normal_quantile`),
  Student's t (:func:`t_cdf`, :func:`t_quantile`; via the regularised incomplete beta function,
  :func:`betainc`) and the noncentral t (:func:`nct_cdf`, for power);
- a cell: the mean over seeds with its t-interval (:func:`t_interval`), a percentile bootstrap
  over seeds (:func:`bootstrap_interval`), and where per-problem scores exist a bootstrap over
  seeds and problems (:func:`crossed_bootstrap_interval`);
- two cells: the paired t-test on the seed-by-seed differences with the exact sign-flip
  permutation test as a check (:func:`paired_test`), or, for runs that cannot be paired (cells of
  two studies run by different trainers), Welch's test with the exact label permutation test
  (:func:`welch_test`);
- a family of comparisons: Holm's step-down correction (:func:`holm`), the level each comparison
  must pass at its rank (:func:`holm_levels`), the number of seeds at which a test at that level
  would reach power 0.8 for the observed difference at the observed spread (:func:`seeds_needed`),
  and the verdict words, generated from the corrected test (:func:`decide`, :func:`verdict`).

References: Student (1908) and Welch (1947) for the t-tests; Fisher (1935) and Pitman (1937) for
the permutation tests; Holm (1979), "A simple sequentially rejective multiple test procedure";
Efron & Tibshirani (1993) for the percentile bootstrap; Owen (2007), "The pigeonhole bootstrap",
for resampling the two crossed factors (seeds and problems) independently; DLMF 8.17.22 for the
incomplete beta function's continued fraction.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "ALPHA",
    "POWER",
    "Decision",
    "Difference",
    "Estimate",
    "betainc",
    "bootstrap_interval",
    "crossed_bootstrap_interval",
    "decide",
    "holm",
    "holm_levels",
    "nct_cdf",
    "normal_cdf",
    "normal_quantile",
    "paired_test",
    "power",
    "seeds_needed",
    "sign_flip_p",
    "t_cdf",
    "t_interval",
    "t_quantile",
    "two_sample_permutation_p",
    "verdict",
    "welch_test",
]

ALPHA = 0.05
"""The default family-wise error rate of a report's comparisons."""

POWER = 0.8
"""The power at which :func:`seeds_needed` counts the seeds a comparison needs."""

MAX_SEEDS = 1000
"""The largest number of seeds :func:`seeds_needed` looks at."""

_ROUNDING = 1e-12  # a spread below this share of the values' size is float rounding, not spread


# ---------------------------------------------------------------------------------------------
# Distributions.


def normal_cdf(x: float) -> float:
    """Phi(x), the standard normal CDF: ``erfc(-x / sqrt 2) / 2``.

    >>> round(normal_cdf(1.959963984540054), 6)
    0.975
    """
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _invert(cdf: Callable[[float], float], p: float, what: str) -> float:
    """The x with ``cdf(x) = p`` for an increasing CDF on the real line, by bisection (the
    bracket doubled until it holds ``p``), to a relative width of 1e-15."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"{what}: p must lie in (0, 1), got {p!r}")
    lo, hi = -1.0, 1.0
    while cdf(lo) > p:
        lo *= 2.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(2000):
        mid = 0.5 * (lo + hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def normal_quantile(p: float) -> float:
    """Phi⁻¹(p), the standard normal quantile (bisection on :func:`normal_cdf`).

    >>> round(normal_quantile(0.975), 4)
    1.96
    """
    return _invert(normal_cdf, p, "normal_quantile")


def betainc(a: float, b: float, x: float) -> float:
    r"""The regularised incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b).

    Evaluated by the continued fraction of DLMF 8.17.22,

        I_x(a, b) = x^a (1 - x)^b / (a B(a, b)) · 1 / (1 + d_1 / (1 + d_2 / (1 + ...))),
        d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)),
        d_{2m}   = m (b - m) x / ((a + 2m - 1)(a + 2m)),

    (modified Lentz), which converges fast for ``x < (a + 1) / (a + b + 2)``; above it through
    the symmetry I_x(a, b) = 1 - I_{1-x}(b, a). ``a, b > 0``, ``0 <= x <= 1``.

    >>> betainc(1.0, 1.0, 0.3)  # the uniform distribution's CDF
    0.3
    >>> round(betainc(2.0, 3.0, 0.4), 6)  # 1 - (1 - x)^4 - 4x(1 - x)^3 ... by hand: 0.5248
    0.5248
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"betainc: a and b must be positive, got a={a!r}, b={b!r}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"betainc: x must lie in [0, 1], got {x!r}")
    if x == 0.0 or x == 1.0:
        return x
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    log_front = (
        a * math.log(x)
        + b * math.log1p(-x)
        - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
        - math.log(a)
    )
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for j in range(1, 10_000):
        m = j // 2
        if j % 2:  # d_{2m+1}
            coef = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:  # d_{2m}
            coef = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + coef * d
        d = tiny if abs(d) < tiny else d
        c = 1.0 + coef / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        f *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return math.exp(log_front) / f


def t_cdf(t: float, df: float) -> float:
    """Student's t CDF with ``df`` degrees of freedom (any ``df > 0``; ``inf``: the normal):
    the tail P(T > |t|) = I_{df / (df + t²)}(df / 2, 1 / 2) / 2.

    >>> t_cdf(1.0, 1)  # df = 1 is the Cauchy: 1/2 + atan(t) / pi
    0.75
    """
    if not df > 0:
        raise ValueError(f"t_cdf: df must be positive, got {df!r}")
    if math.isinf(df):
        return normal_cdf(t)
    if t == 0:
        return 0.5
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (bisection on
    :func:`t_cdf`).

    >>> round(t_quantile(0.975, 2), 3)  # the tables' 4.303
    4.303
    """
    return _invert(lambda x: t_cdf(x, df), p, "t_quantile")


_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(32)
_ERFC = np.vectorize(math.erfc, otypes=[float])


def nct_cdf(t: float, df: float, nc: float) -> float:
    r"""The noncentral t CDF: P(T <= t) for T = (Z + nc) / sqrt(V / df), Z ~ N(0, 1),
    V ~ chi²_df independent (the t statistic of a test whose true standardised effect times
    sqrt(n) is ``nc``).

    Conditioning on S = sqrt(V / df):  P(T <= t) = E[Phi(t S - nc)], with S's density
    2 (df/2)^(df/2) s^(df-1) exp(-df s² / 2) / Gamma(df/2); integrated by 32-point
    Gauss-Legendre on 400 panels over S's range (its mass outside < 1e-20). ``df >= 1``.
    nc = 0 gives :func:`t_cdf`; P(T <= 0) = Phi(-nc) for every df.

    >>> round(nct_cdf(0.0, 3, 1.0), 6) == round(normal_cdf(-1.0), 6)
    True
    """
    if not df >= 1:
        raise ValueError(f"nct_cdf: df must be >= 1, got {df!r}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    spread = 11.0 / math.sqrt(df)
    lo, hi = max(0.0, 1.0 - spread), 1.0 + spread + (10.0 if df < 4 else 0.0)
    edges = np.linspace(lo, hi, 401)
    half = (edges[1:] - edges[:-1])[:, None] / 2.0
    mid = (edges[1:] + edges[:-1])[:, None] / 2.0
    s = (mid + half * _GL_NODES[None, :]).ravel()
    w = (half * _GL_WEIGHTS[None, :]).ravel()
    log_norm = math.log(2.0) + (df / 2.0) * math.log(df / 2.0) - math.lgamma(df / 2.0)
    log_density = log_norm + (df - 1.0) * np.log(s) - df * s * s / 2.0
    phi = 0.5 * _ERFC(-(t * s - nc) / math.sqrt(2.0))
    return float(min(1.0, max(0.0, np.sum(w * np.exp(log_density) * phi))))


# ---------------------------------------------------------------------------------------------
# One cell.


@dataclass(frozen=True)
class Estimate:
    """A cell's mean over its ``n`` seeds, their sd (``ddof=1``) and a ``level`` interval."""

    n: int
    mean: float
    sd: float
    lo: float
    hi: float


def _finite(xs: Sequence[float]) -> list[float]:
    return [float(x) for x in xs if math.isfinite(float(x))]


def t_interval(xs: Sequence[float], level: float = 0.95) -> Estimate:
    """The mean of ``xs`` (one value per seed; non-finite values dropped) with its t-interval,
    mean ± t_{(1+level)/2, n-1} · sd / sqrt(n). With one seed the interval is NaN.

    >>> e = t_interval([0.2, 0.3, 0.4])  # mean 0.3, sd 0.1, t_{0.975,2} = 4.303
    >>> round(e.lo, 4), round(e.hi, 4)
    (0.0516, 0.5484)
    """
    xs = _finite(xs)
    n = len(xs)
    if n == 0:
        return Estimate(0, math.nan, math.nan, math.nan, math.nan)
    mean = math.fsum(xs) / n
    if n == 1:
        return Estimate(1, mean, math.nan, math.nan, math.nan)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile((1 + level) / 2, n - 1) * sd / math.sqrt(n)
    return Estimate(n, mean, sd, mean - half, mean + half)


def bootstrap_interval(
    xs: Sequence[float], level: float = 0.95, n_boot: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval of the mean over seeds: ``n_boot`` resamples of the
    ``n`` values with replacement, the (1-level)/2 and (1+level)/2 quantiles of their means
    (Efron & Tibshirani 1993). On 3 seeds there are only 10 distinct resamples and the interval
    is narrower than the t-interval (it ignores the sd's own uncertainty); NaN for fewer than 2.

    >>> bootstrap_interval([1.0, 1.0, 1.0])
    (1.0, 1.0)
    """
    xs = _finite(xs)
    if len(xs) < 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    values = np.asarray(xs, dtype=np.float64)
    means = values[rng.integers(0, len(xs), size=(n_boot, len(xs)))].mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def _counts(draws: np.ndarray, k: int) -> np.ndarray:
    """``[B, k]``: how often each of ``k`` indices occurs in each row of ``draws`` ``[B, n]``."""
    out = np.zeros((draws.shape[0], k))
    np.add.at(out, (np.arange(draws.shape[0])[:, None], draws), 1.0)
    return out


def crossed_bootstrap_interval(
    scores: np.ndarray | Sequence[Sequence[float]],
    level: float = 0.95,
    n_boot: int = 10_000,
    seed: int = 0,
) -> tuple[float, float]:
    """The percentile interval of the grand mean of a ``[S, P]`` table of scores (seeds ×
    problems: each seed's score on each held-out problem, the same problems for every seed),
    resampling seeds and problems independently with replacement (Owen 2007's pigeonhole
    bootstrap): each replicate draws S seeds and P problems and averages the S × P sub-table.

    Both factors are random: the seeds (training runs) and the problems (a sample of the task).
    Resampling only seeds misses the problems' variance, which a new set of problems would
    show, and nesting problems inside seeds would let it shrink with more seeds, which it does
    not (every seed sees the same problems); the pigeonhole bootstrap is conservative (its
    variance counts the seed × problem interaction about twice). A table of paired differences
    (cell A minus cell B, the same seeds and problems) gives the interval of the difference.

    >>> crossed_bootstrap_interval([[1.0, 0.0], [1.0, 0.0]], n_boot=2000)  # problems differ
    (0.0, 1.0)
    """
    table = np.asarray(scores, dtype=np.float64)
    if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] < 1:
        raise ValueError(
            f"crossed_bootstrap_interval: scores must be [seeds, problems] with 2+ seeds, got "
            f"shape {table.shape}"
        )
    if not np.isfinite(table).all():
        raise ValueError("crossed_bootstrap_interval: scores must be finite")
    rng = np.random.default_rng(seed)
    s, p = table.shape
    # A replicate's mean over its S × P sub-table is w_rowᵀ T w_col / (S P), with w the number
    # of times each seed and each problem was drawn.
    row_counts = _counts(rng.integers(0, s, size=(n_boot, s)), s)
    col_counts = _counts(rng.integers(0, p, size=(n_boot, p)), p)
    means = np.einsum("bs,sp,bp->b", row_counts, table, col_counts) / (s * p)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


# ---------------------------------------------------------------------------------------------
# Two cells.


@dataclass(frozen=True)
class Difference:
    """Cell A against cell B on one metric: ``n`` pairs of seeds (paired) or the two cells'
    seed counts (``n``, ``n_b``; Welch), the difference of means A − B with its ``level``
    t-interval, the t statistic, its degrees of freedom, the two-sided p-value, the exact
    permutation p-value (the check), the sd the power is computed at (of the differences, or
    the pooled sd of the two cells) and whether the runs were paired by seed."""

    n: int
    diff: float
    lo: float
    hi: float
    t: float
    df: float
    p: float
    p_perm: float
    sd: float
    paired: bool
    n_b: int = 0
    mean_a: float = math.nan
    mean_b: float = math.nan


def sign_flip_p(diffs: Sequence[float]) -> float:
    """The exact two-sided sign-flip permutation p-value of paired differences (Fisher 1935):
    under "no difference" each seed's difference is as likely to have either sign, so the
    2^n sign patterns are equally likely; p is the share with ``|sum(±d)| >= |sum(d)|``.
    Its smallest value is 2 / 2^n (0.25 on 3 seeds, 0.0078 on 8): on 3 seeds it can never
    reach 0.05, whatever the data. Exact up to 24 seeds.

    >>> sign_flip_p([1.0, 2.0, 3.0])  # ±1±2±3: |sum| >= 6 for 2 of 8 patterns
    0.25
    """
    d = np.asarray(_finite(diffs), dtype=np.float64)
    n = d.size
    if n == 0:
        return math.nan
    if n > 24:
        raise ValueError(f"sign_flip_p: exact up to 24 seeds, got {n}")
    observed = abs(float(d.sum()))
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))
    low, high = d[: min(n, 16)], d[min(n, 16) :]
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=low.size)))
    low_sums = signs @ low
    count = 0
    for pattern in itertools.product((1.0, -1.0), repeat=high.size):
        total = low_sums + float(np.dot(pattern, high)) if high.size else low_sums
        count += int(np.count_nonzero(np.abs(total) >= observed - tol))
    return count / 2.0**n


def two_sample_permutation_p(a: Sequence[float], b: Sequence[float]) -> float:
    """The exact two-sided permutation p-value of two independent samples (Pitman 1937): every
    split of the pooled values into groups of the two sizes is equally likely under "no
    difference"; p is the share of splits with ``|mean_a - mean_b|`` at least the observed.
    Exact up to a million splits.

    >>> two_sample_permutation_p([3.0, 4.0], [1.0, 2.0])  # 2 of the 6 splits are as extreme
    0.3333333333333333
    """
    a, b = _finite(a), _finite(b)
    if not a or not b:
        return math.nan
    pooled = np.asarray(a + b, dtype=np.float64)
    n, k = pooled.size, len(a)
    if math.comb(n, k) > 1_000_000:
        raise ValueError(f"two_sample_permutation_p: C({n}, {k}) splits is too many to enumerate")
    total = float(pooled.sum())
    observed = abs(sum(a) / k - sum(b) / (n - k))
    tol = 1e-12 * max(1.0, float(np.abs(pooled).sum()))
    idx = np.fromiter(
        itertools.chain.from_iterable(itertools.combinations(range(n), k)), dtype=np.intp
    ).reshape(-1, k)
    sums = pooled[idx].sum(axis=1)
    gaps = np.abs(sums / k - (total - sums) / (n - k))
    return float(np.count_nonzero(gaps >= observed - tol)) / idx.shape[0]


def paired_test(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """The paired t-test of cell A against cell B: ``a[i]`` and ``b[i]`` are the runs of the
    same seed (a pair with a non-finite value is dropped), d = a - b, t = mean(d) / (sd(d) /
    sqrt(n)) on n - 1 degrees of freedom, two-sided; the exact sign-flip p-value
    (:func:`sign_flip_p`) as a check. Differences all equal: p = 1 if they are 0, else 0 (no
    spread: every seed agrees). Fewer than 2 pairs: p is NaN.

    >>> r = paired_test([0.30, 0.25, 0.40], [0.20, 0.20, 0.30])  # d = 0.10, 0.05, 0.10
    >>> round(r.diff, 4), round(r.t, 3), r.df  # mean 0.0833, sd 0.0289: t = 5.0
    (0.0833, 5.0, 2)
    """
    if len(a) != len(b):
        raise ValueError(f"paired_test: a and b must pair seed by seed, got {len(a)} and {len(b)}")
    pairs = [
        (float(x), float(y))
        for x, y in zip(a, b, strict=True)
        if math.isfinite(float(x)) and math.isfinite(float(y))
    ]
    d = [x - y for x, y in pairs]
    n = len(d)
    mean_a = math.fsum(x for x, _ in pairs) / n if n else math.nan
    mean_b = math.fsum(y for _, y in pairs) / n if n else math.nan
    if n < 2:
        diff = d[0] if d else math.nan
        return Difference(n, diff, math.nan, math.nan, math.nan, n - 1, math.nan, math.nan, math.nan,
                    True, mean_a=mean_a, mean_b=mean_b)  # fmt: skip
    est = t_interval(d, level)
    scale = _ROUNDING * max(max(abs(x), abs(y)) for x, y in pairs)
    if abs(est.mean) <= scale:  # equal means up to float rounding: no difference
        est = Estimate(n, 0.0, est.sd, est.lo - est.mean, est.hi - est.mean)
    if est.sd <= scale:  # equal differences up to float rounding: no spread
        est = Estimate(n, est.mean, 0.0, est.mean, est.mean)
    if est.sd == 0.0:
        t = 0.0 if est.mean == 0 else math.copysign(math.inf, est.mean)
        p = 1.0 if est.mean == 0 else 0.0
    else:
        t = est.mean / (est.sd / math.sqrt(n))
        p = min(1.0, 2.0 * t_cdf(-abs(t), n - 1))
    return Difference(
        n, est.mean, est.lo, est.hi, t, n - 1, p, sign_flip_p(d), est.sd, True,
        mean_a=mean_a, mean_b=mean_b,
    )  # fmt: skip


def welch_test(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Difference:
    """Welch's two-sample t-test of cell A against cell B, for runs that cannot be paired by
    seed (cells of two studies run under different trainers): t = (mean_a - mean_b) /
    sqrt(v_a / n_a + v_b / n_b) on the Welch-Satterthwaite degrees of freedom
    (v_a/n_a + v_b/n_b)² / ((v_a/n_a)² / (n_a - 1) + (v_b/n_b)² / (n_b - 1)); the exact label
    permutation p-value (:func:`two_sample_permutation_p`) as a check; ``sd`` is the pooled sd.

    >>> r = welch_test([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])  # diff -3, se sqrt(2/3), df 4
    >>> round(r.t, 4), round(r.df, 4)
    (-3.6742, 4.0)
    """
    a, b = _finite(a), _finite(b)
    na, nb = len(a), len(b)
    mean_a = math.fsum(a) / na if na else math.nan
    mean_b = math.fsum(b) / nb if nb else math.nan
    diff = mean_a - mean_b
    if a and b and abs(diff) <= _ROUNDING * max(map(abs, a + b)):  # equal up to rounding
        diff = 0.0
    if na < 2 or nb < 2:
        return Difference(na, diff, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan,
                    math.nan, False, nb, mean_a, mean_b)  # fmt: skip
    va = math.fsum((x - mean_a) ** 2 for x in a) / (na - 1)
    vb = math.fsum((x - mean_b) ** 2 for x in b) / (nb - 1)
    if max(va, vb) <= (_ROUNDING * max(map(abs, a + b))) ** 2:  # no spread, up to rounding
        va = vb = 0.0
    se2 = va / na + vb / nb
    pooled_sd = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    p_perm = two_sample_permutation_p(a, b)
    if se2 == 0.0:
        t = 0.0 if diff == 0 else math.copysign(math.inf, diff)
        return Difference(na, diff, diff, diff, t, na + nb - 2, 1.0 if diff == 0 else 0.0, p_perm,
                    0.0, False, nb, mean_a, mean_b)  # fmt: skip
    df = se2**2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
    t = diff / math.sqrt(se2)
    half = t_quantile((1 + level) / 2, df) * math.sqrt(se2)
    p = min(1.0, 2.0 * t_cdf(-abs(t), df))
    return Difference(na, diff, diff - half, diff + half, t, df, p, p_perm, pooled_sd, False, nb,
                mean_a, mean_b)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# A family of comparisons.


def holm(ps: Sequence[float]) -> list[float]:
    """Holm's (1979) adjusted p-values: with the m p-values sorted, p_(1) <= ... <= p_(m), the
    adjusted p_(i) is max over j <= i of min(1, (m - j + 1) p_(j)); a comparison passes the
    family-wise level alpha when its adjusted p < alpha. A NaN p-value (a comparison that could
    not be tested) counts in m, as a 1, and stays NaN.

    >>> [round(p, 4) for p in holm([0.01, 0.04, 0.03, 0.005])]
    [0.03, 0.06, 0.06, 0.02]
    """
    m = len(ps)
    filled = [1.0 if not math.isfinite(p) else float(p) for p in ps]
    order = sorted(range(m), key=lambda i: filled[i])
    out = [math.nan] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * filled[i]))
        out[i] = running if math.isfinite(ps[i]) else math.nan
    return out


def holm_levels(ps: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """The level each comparison's own p-value is held to by Holm's procedure at its rank:
    alpha / (m - rank), rank 0 for the smallest p (ties keep their order). A comparison not yet
    decided is counted at this level by :func:`seeds_needed`.

    >>> holm_levels([0.2, 0.01, 0.5, 0.03])
    [0.025, 0.0125, 0.05, 0.016666666666666666]
    """
    m = len(ps)
    filled = [1.0 if not math.isfinite(p) else float(p) for p in ps]
    order = sorted(range(m), key=lambda i: filled[i])
    out = [math.nan] * m
    for rank, i in enumerate(order):
        out[i] = alpha / (m - rank)
    return out


def power(effect: float, n: int, level: float, *, paired: bool = True) -> float:
    """The power of a two-sided t-test at ``level`` to find a standardised difference
    ``effect`` (difference / sd): paired on ``n`` seeds, T ~ nct(n - 1, effect sqrt(n)); two
    samples of ``n`` seeds each, T ~ nct(2n - 2, effect sqrt(n / 2)); power = P(|T| > c), c the
    t quantile 1 - level/2.

    >>> round(power(0.5, 34, 0.05), 2)  # the classic: d = 0.5 needs 34 pairs for 0.8
    0.81
    """
    if n < 2:
        return math.nan
    df, nc = (n - 1, effect * math.sqrt(n)) if paired else (2 * n - 2, effect * math.sqrt(n / 2))
    c = t_quantile(1 - level / 2, df)
    return 1.0 - nct_cdf(c, df, nc) + nct_cdf(-c, df, nc)


def seeds_needed(
    test: Difference, level: float, target: float = POWER, max_seeds: int = MAX_SEEDS
) -> int | None:
    """The number of seeds at which a two-sided t-test at ``level`` (a comparison's Holm level,
    :func:`holm_levels`) would reach power ``target`` if the true difference were the observed
    one and the spread the observed one (``test.diff / test.sd``): pairs for a paired test,
    seeds per cell for Welch's. None when no number of seeds would: the observed difference is
    0, or more than ``max_seeds`` are needed (or the spread is unknown). A difference with no
    spread needs the smallest t-test, 2.

    >>> seeds_needed(paired_test([0.3, 0.25, 0.4], [0.2, 0.2, 0.3]), 0.05)  # power 0.72 at 3
    4
    """
    if not (math.isfinite(test.diff) and math.isfinite(test.sd)) or test.diff == 0:
        return None
    if test.sd == 0:
        return 2
    effect = abs(test.diff) / test.sd
    lo, hi = 2, 2
    while power(effect, hi, level, paired=test.paired) < target:  # bracket, then bisect
        if hi >= max_seeds:
            return None
        lo, hi = hi, min(max_seeds, hi * 2)
    while lo < hi:
        mid = (lo + hi) // 2
        if power(effect, mid, level, paired=test.paired) >= target:
            hi = mid
        else:
            lo = mid + 1
    return hi


Claim = Literal[">", "<", "="]


@dataclass(frozen=True)
class Decision:
    """One comparison of a family, decided: its name, the test, Holm's adjusted p, the level
    its own p is held to at its rank, the seeds a test at that level needs (None: none would),
    and the verdict words (:func:`verdict`)."""

    name: str
    test: Difference
    p_holm: float
    level: float
    seeds: int | None
    verdict: str
    claim: str | None = None


def _seeds_words(seeds: int | None, test: Difference) -> str:
    unit = "seeds" if test.paired else "seeds a cell"
    if seeds is None:
        if math.isfinite(test.diff) and test.diff == 0:
            return "no number of seeds would decide it: the observed difference is 0"
        if test.n < 2 or not math.isfinite(test.sd):
            return "fewer than two seeds to test"
        return f"more than {MAX_SEEDS:,} {unit} at the observed spread"
    return f"about {seeds} {unit} would decide it at the observed spread"


def verdict(
    test: Difference,
    p_holm: float,
    seeds: int | None,
    *,
    alpha: float = ALPHA,
    claim: Claim | None = None,
    a: str = "A",
    b: str = "B",
) -> str:
    """The verdict words of a comparison, from its Holm-adjusted p only.

    Without a ``claim`` (a study's comparison of A and B): ``"differs: A above B"`` (or below)
    when ``p_holm < alpha``, else ``"not decided (about N seeds would decide it at the observed
    spread)"``. With a claim about A and B (``">"``: A above B; ``"<"``; ``"="``: no difference):
    ``"holds"`` when the corrected test passes in the claim's direction, ``"differs"`` when it
    passes against it (or at all, for ``"="``), else ``"not decided (...)"``; a claim of no
    difference is never "holds" (that would need an equivalence margin). Where the t-test
    decides but the exact permutation check's p is above alpha (3 seeds: its floor is 0.25),
    the words say so.

    >>> r = paired_test([0.30, 0.25, 0.40], [0.20, 0.20, 0.30])
    >>> verdict(r, 0.2, 4)
    'not decided (about 4 seeds would decide it at the observed spread)'
    >>> verdict(r, 0.01, None, claim=">")
    'holds (the exact permutation check: p = 0.25, its floor on 3 seeds)'
    """
    passed = math.isfinite(p_holm) and p_holm < alpha
    if not passed:
        return f"not decided ({_seeds_words(seeds, test)})"
    above = test.diff > 0
    if claim is None:
        words = f"differs: {a} {'above' if above else 'below'} {b}"
    elif claim == "=":
        words = "differs"
    else:
        words = "holds" if above == (claim == ">") else "differs"
    if math.isfinite(test.p_perm) and test.p_perm >= alpha:
        floor = 2.0 / 2.0**test.n if test.paired else 2.0 / math.comb(test.n + test.n_b, test.n)
        note = f", its floor on {test.n} seeds" if abs(test.p_perm - floor) < 1e-12 else ""
        words += f" (the exact permutation check: p = {test.p_perm:.2g}{note})"
    return words


def decide(
    tests: Sequence[tuple[str, Difference]],
    alpha: float = ALPHA,
    *,
    claims: Sequence[Claim | None] | None = None,
    names: Sequence[tuple[str, str]] | None = None,
) -> list[Decision]:
    """Decide a family of comparisons (``(name, test)`` pairs): Holm over the family's
    p-values, each comparison's Holm level, the seeds it needs at that level (undecided ones),
    and its verdict words (:func:`verdict`; ``claims`` and the cells' ``names`` per comparison,
    optional).

    >>> t = paired_test([0.30, 0.25, 0.40], [0.20, 0.20, 0.30])
    >>> [d.verdict for d in decide([("x", t), ("y", t)])]  # p = 0.038 each: 0.075 after Holm
    ['not decided (about 4 seeds would decide it at the observed spread)', 'not decided (about 4 seeds would decide it at the observed spread)']
    """
    ps = [t.p for _, t in tests]
    adjusted = holm(ps)
    levels = holm_levels(ps, alpha)
    out = []
    for i, (name, test) in enumerate(tests):
        passed = math.isfinite(adjusted[i]) and adjusted[i] < alpha
        seeds = None if passed else seeds_needed(test, levels[i])
        claim = claims[i] if claims else None
        a, b = names[i] if names else ("A", "B")
        words = verdict(test, adjusted[i], seeds, alpha=alpha, claim=claim, a=a, b=b)
        out.append(Decision(name, test, adjusted[i], levels[i], seeds, words, claim))
    return out
