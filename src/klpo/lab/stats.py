"""Summary statistics shared by the exact and Monte Carlo parts of the lab.

Value statistics of an estimator X of a target KL (``target``): mean, bias = mean - target,
sd (population, of one sample), RMSE = sqrt(bias² + sd²), each also relative to the target, and
the fraction of samples with X < 0. Gradient comparisons: cosine and relative error
``‖g - g_true‖ / ‖g_true‖``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RunningStats", "ValueStats", "cosine", "relative_error"]


@dataclass(frozen=True)
class ValueStats:
    """Statistics of one estimator's per-sample value against the KL it targets.

    Attributes:
        mean, sd: of one sample (sd is the population sd, not the standard error).
        frac_negative: the probability (exact) or fraction (Monte Carlo) of values < 0.
        target: the true KL the estimator is meant to estimate.
        samples: the Monte Carlo sample count, or None for exact values.
        m4: the fourth central moment of one sample (for the standard error of sd).
        excess_kurtosis, maximum, p99: of the values themselves, where they are samples
            (:meth:`of_errors`): how heavy their tail is.
    """

    mean: float
    sd: float
    frac_negative: float
    target: float
    samples: int | None = None
    m4: float = math.nan
    excess_kurtosis: float = math.nan
    maximum: float = math.nan
    p99: float = math.nan

    @property
    def bias(self) -> float:
        return self.mean - self.target

    @property
    def rmse(self) -> float:
        return math.sqrt(self.bias**2 + self.sd**2)

    @property
    def stderr(self) -> float:
        """Standard error of the Monte Carlo mean, sd / sqrt(n) (0 for exact values)."""
        return self.sd / math.sqrt(self.samples) if self.samples else 0.0

    @property
    def sd_stderr(self) -> float:
        """Standard error of the Monte Carlo sd: sqrt((m4 - var²) / n) / (2 sd) (delta method)."""
        if not self.samples or self.sd == 0:
            return 0.0
        return math.sqrt(max(self.m4 - self.sd**4, 0.0) / self.samples) / (2 * self.sd)

    def _rel(self, x: float) -> float:
        return x / self.target if self.target != 0 else math.nan

    def to_dict(self, keys: tuple[str, ...]) -> dict[str, float]:
        """The named fields, as plain floats (JSON contract order)."""
        every = {
            "mean": self.mean,
            "bias": self.bias,
            "sd": self.sd,
            "rmse": self.rmse,
            "bias_rel": self._rel(self.bias),
            "sd_rel": self._rel(self.sd),
            "rmse_rel": self._rel(self.rmse),
            "frac_negative": self.frac_negative,
            "stderr": self.stderr,
            "sd_stderr": self.sd_stderr,
            "target": self.target,
            "samples": math.nan if self.samples is None else self.samples,
            "excess_kurtosis": self.excess_kurtosis,
            "max": self.maximum,
            "p99": self.p99,
        }
        return {k: float(every[k]) for k in keys}

    @classmethod
    def weighted(
        cls, values: Tensor, weights: Tensor, target: float, samples: int | None = None
    ) -> ValueStats:
        """Statistics of a discrete distribution: ``values`` ``[N]`` with probabilities ``weights``.

        Outcomes of zero weight are skipped, so an infinite value nobody samples does no harm.
        """
        keep = weights > 0
        v, w = values[keep].to(torch.float64), weights[keep].to(torch.float64)
        w = w / w.sum()
        mean = float((w * v).sum())
        dev2 = (v - mean).square()
        var = float((w * dev2).sum())
        return cls(
            mean=mean,
            sd=math.sqrt(max(var, 0.0)),
            frac_negative=float(w[v < 0].sum()),
            target=target,
            samples=samples,
            m4=float((w * dev2.square()).sum()),
        )

    @classmethod
    def of_errors(cls, values: Tensor, exact: Tensor) -> ValueStats:
        """Statistics of samples ``values`` ``[N]`` of estimates whose exact value differs from
        sample to sample, ``exact`` ``[N]`` (the KL at each position of a sampled sequence).

        The target is the mean exact value, so ``bias`` is the mean error
        ``mean(values - exact)``; ``sd`` and ``m4`` are the error's (population) moments, the
        estimate's sampling noise once the exact value is fixed, and ``stderr`` is the bias's
        standard error. ``frac_negative``, ``excess_kurtosis``, ``maximum`` and ``p99`` are the
        values' own. With a constant ``exact`` this is the lab's statistic of the values.

        >>> x = torch.tensor([0.5, -0.1, 0.3, 0.0], dtype=torch.float64)
        >>> s = ValueStats.of_errors(x, torch.tensor([0.1, 0.1, 0.2, 0.2], dtype=torch.float64))
        >>> round(s.bias, 6), round(s.sd, 6), s.frac_negative  # errors 0.4, -0.2, 0.1, -0.2
        (0.025, 0.248747, 0.25)
        """
        x, e = values.flatten().to(torch.float64), exact.flatten().to(torch.float64)
        if x.shape != e.shape or x.numel() == 0:
            raise ValueError(f"values {tuple(x.shape)} and exact {tuple(e.shape)}: same length > 0")
        n = x.numel()
        dev = (x - e) - (x - e).mean()
        var = float(dev.square().mean())
        centred = x - x.mean()
        var_x = float(centred.square().mean())
        return cls(
            mean=float(x.mean()),
            sd=math.sqrt(max(var, 0.0)),
            frac_negative=float((x < 0).double().mean()),
            target=float(e.mean()),
            samples=n,
            m4=float(dev.square().square().mean()),
            excess_kurtosis=float(centred.pow(4).mean()) / var_x**2 - 3.0 if var_x > 0 else 0.0,
            maximum=float(x.max()),
            p99=float(torch.quantile(x, 0.99)) if n > 1 else float(x.max()),
        )


class RunningStats:
    """Mean, central moments 2-4 and fraction negative of a stream, merged chunk by chunk.

    The pairwise update of Chan, Golub & LeVeque (1979) extended to the third and fourth moments
    (Pébay 2008, eqs. 2.1-2.3): each chunk's sums of powered deviations are computed around the
    chunk's own mean, then merged, which stays accurate in float64 for any number of samples.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0
        self.m3 = 0.0
        self.m4 = 0.0
        self.negative = 0

    def add(self, x: Tensor) -> None:
        """Add a chunk of samples ``[n]``."""
        nb = x.numel()
        if nb == 0:
            return
        x = x.to(torch.float64)
        mean_b = float(x.mean())
        dev = x - mean_b
        dev2 = dev.square()
        m2b, m3b, m4b = float(dev2.sum()), float((dev2 * dev).sum()), float(dev2.square().sum())
        na, n = self.n, self.n + nb
        d = mean_b - self.mean
        m2a, m3a, m4a = self.m2, self.m3, self.m4
        self.m4 = (
            m4a
            + m4b
            + d**4 * na * nb * (na * na - na * nb + nb * nb) / n**3
            + 6 * d * d * (na * na * m2b + nb * nb * m2a) / n**2
            + 4 * d * (na * m3b - nb * m3a) / n
        )
        self.m3 = m3a + m3b + d**3 * na * nb * (na - nb) / n**2 + 3 * d * (na * m2b - nb * m2a) / n
        self.m2 = m2a + m2b + d * d * na * nb / n
        self.mean += d * nb / n
        self.n = n
        self.negative += int((x < 0).sum())

    def result(self, target: float) -> ValueStats:
        if not self.n:
            raise ValueError("no samples")
        return ValueStats(
            mean=self.mean,
            sd=math.sqrt(max(self.m2 / self.n, 0.0)),
            frac_negative=self.negative / self.n,
            target=target,
            samples=self.n,
            m4=self.m4 / self.n,
        )


def cosine(a: Tensor, b: Tensor, *, zero_tol: float = 1e-9) -> float:
    """cos(a, b); NaN when either vector is zero (‖x‖ <= zero_tol · max(‖a‖, ‖b‖, 1e-300)).

    An exactly-zero expected gradient (k1 in the loss) comes out of float64 enumeration as
    rounding noise of size ~1e-17; its direction means nothing, so it is reported as NaN (zero).
    """
    a, b = a.flatten().to(torch.float64), b.flatten().to(torch.float64)
    na, nb = float(a.norm()), float(b.norm())
    scale = max(na, nb, 1e-300)
    if na <= zero_tol * scale or nb <= zero_tol * scale:
        return math.nan
    return float(a @ b) / (na * nb)


def relative_error(a: Tensor, b: Tensor) -> float:
    """‖a - b‖ / ‖b‖ (NaN if b is zero)."""
    nb = float(b.norm())
    return float((a - b).norm()) / nb if nb > 0 else math.nan
