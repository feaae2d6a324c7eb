r"""The distributions the lab measures KL estimators on.

Four kinds, all in float64:

1. :class:`GaussianPair`: pi_theta = N(0, 1), pi_ref = N(mu, 1), Schulman's 2020 experiment
   ("Approximating KL Divergence"); KL(pi_theta ‖ pi_ref) = KL(pi_ref ‖ pi_theta) = mu² / 2.
2. Explicit categoricals, :meth:`SequencePair.from_probabilities`, parameterised by softmax logits
   ``log p`` (a categorical is a sequence model of length 1).
3. Random LM-like categoricals, :func:`lm_pair`: Zipf-shaped policy logits ``-s log(rank)`` over a
   vocabulary of up to 150k, the reference a copy perturbed by ``sigma · eps`` (eps ~ N(0, 1)), with
   sigma found by bisection so that KL(pi_theta ‖ pi_ref), summed exactly over the vocabulary,
   equals the target.
4. Tabular autoregressive sequence models, :class:`SequencePair`: logits per prefix for the policy
   and the reference, small enough to enumerate (vocab^length <= :data:`MAX_SEQUENCES`).

Prefixes are ordered shorter first, then lexicographically by token ids; a prefix of length t is
row ``offset_t + sum_i a_i V^(t-1-i)`` of the ``[P, V]`` logits table, ``offset_t = sum_{s<t} V^s``.
A sequence y_1..y_T has probability ``prod_t softmax(logits[row(y_<t)])[y_t]``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MAX_SEQUENCES",
    "Enumeration",
    "GaussianPair",
    "SequencePair",
    "SpecError",
    "drift_path",
    "lm_pair",
    "prefix_text",
    "prefixes",
    "zipf_logits",
]

MAX_SEQUENCES = 100_000
"""The most sequences (vocab^length) a tabular model may have; length-1 models are exempt."""

MAX_VOCAB = 1 << 21
"""The largest vocabulary of a categorical (length 1): enough for every real LM tokenizer."""

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class SpecError(ValueError):
    """A distribution given by a person (probabilities, a sequence spec) is malformed."""


# --------------------------------------------------------------------------------------------
# Gaussians.


@dataclass(frozen=True)
class GaussianPair:
    r"""pi_theta = N(0, 1) and pi_ref = N(mu, 1), Schulman's experiment.

    With x ~ pi_theta the log-ratio is ``d = log pi_theta(x) - log pi_ref(x) = mu²/2 - mu x``,
    so ``d ~ N(mu²/2, mu²)`` and KL(pi_theta ‖ pi_ref) = mu²/2 (equal variances: both directions).
    """

    mu: float

    def __post_init__(self) -> None:
        if not math.isfinite(self.mu):
            raise SpecError(f"mu must be a finite number, got {self.mu}")

    @property
    def true_kl(self) -> float:
        """KL(pi_theta ‖ pi_ref) = KL(pi_ref ‖ pi_theta) = mu² / 2."""
        return 0.5 * self.mu * self.mu

    def sample_theta(self, n: int, generator: torch.Generator) -> Tensor:
        """``[n]`` float64 samples of pi_theta = N(0, 1)."""
        return torch.randn(n, generator=generator, dtype=torch.float64)

    def sample_ref(self, n: int, generator: torch.Generator) -> Tensor:
        """``[n]`` float64 samples of pi_ref = N(mu, 1)."""
        return torch.randn(n, generator=generator, dtype=torch.float64).add_(self.mu)

    def log_probs(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(log pi_theta(x), log pi_ref(x)), each ``[n]`` float64."""
        logp = x.square().mul_(-0.5).sub_(_LOG_SQRT_2PI)
        logp_ref = (x - self.mu).square_().mul_(-0.5).sub_(_LOG_SQRT_2PI)
        return logp, logp_ref


# --------------------------------------------------------------------------------------------
# Prefixes.


def num_prefixes(vocab: int, length: int) -> int:
    """P = sum_{t < length} vocab^t, the number of rows of a logits table."""
    return sum(vocab**t for t in range(length))


def prefixes(vocab: int, length: int) -> list[tuple[int, ...]]:
    """Every prefix of length < ``length``, shorter first, then lexicographic by token ids."""
    out: list[tuple[int, ...]] = [()]
    level: list[tuple[int, ...]] = [()]
    for _ in range(length - 1):
        level = [(*p, v) for p in level for v in range(vocab)]
        out.extend(level)
    return out


def prefix_text(prefix: Sequence[int]) -> str:
    """The spec's spelling of a prefix: token ids separated by spaces, "" for the root."""
    return " ".join(str(t) for t in prefix)


# --------------------------------------------------------------------------------------------
# Tabular sequence models (a categorical is the case length = 1).


@dataclass(frozen=True)
class Enumeration:
    """Every sequence of a tabular model, in lexicographic order.

    Attributes:
        tokens: ``[N, T]`` token ids, N = vocab^length.
        rows: ``[N, T]`` the row of the logits table (the prefix y_<t) that produced token t.
    """

    tokens: Tensor
    rows: Tensor


class SequencePair:
    """A tabular autoregressive policy and reference over the same vocabulary and length.

    Args:
        logits: ``[P, V]`` policy logits per prefix (P = :func:`num_prefixes`), any float dtype.
        logits_ref: ``[P, V]`` reference logits per prefix.
        vocab: V.
        length: T, the number of tokens of every sequence.

    Raises:
        SpecError: for mismatched shapes, non-finite logits or too many sequences.
    """

    def __init__(self, logits: Tensor, logits_ref: Tensor, *, vocab: int, length: int) -> None:
        if vocab < 2 or length < 1:
            raise SpecError(f"need vocab >= 2 and length >= 1, got vocab={vocab}, length={length}")
        if length == 1 and vocab > MAX_VOCAB:
            raise SpecError(f"vocab {vocab} is larger than the limit {MAX_VOCAB}")
        _check_enumerable(vocab, length)
        rows = num_prefixes(vocab, length)
        for name, t in (("policy", logits), ("reference", logits_ref)):
            if tuple(t.shape) != (rows, vocab):
                raise SpecError(
                    f"{name} logits have shape {tuple(t.shape)}, expected [{rows}, {vocab}] "
                    f"(one row of {vocab} logits per prefix of length < {length})"
                )
            if not torch.isfinite(t).all():
                raise SpecError(f"{name} logits must all be finite")
        self.logits = logits.detach().to(torch.float64)
        self.logits_ref = logits_ref.detach().to(torch.float64)
        self.vocab = vocab
        self.length = length

    # -- constructors ---------------------------------------------------------------------

    @classmethod
    def categorical(cls, logits: Tensor, logits_ref: Tensor) -> SequencePair:
        """One categorical step from ``[V]`` policy and reference logits."""
        if logits.dim() != 1 or logits_ref.dim() != 1:
            raise SpecError("categorical logits must be 1-D [V] tensors")
        if logits.numel() != logits_ref.numel():
            raise SpecError(
                f"the policy has {logits.numel()} outcomes but the reference has "
                f"{logits_ref.numel()}; give both over the same outcomes"
            )
        return cls(logits[None], logits_ref[None], vocab=logits.numel(), length=1)

    @classmethod
    def from_probabilities(
        cls, pi: Sequence[float], ref: Sequence[float], *, names: tuple[str, str] = ("pi", "ref")
    ) -> SequencePair:
        """One categorical step from probabilities (logits = log p), validated.

        Raises:
            SpecError: naming the argument, if the lengths differ, an entry is not in (0, 1], there
                are fewer than two outcomes, or the entries do not sum to 1 (within 1e-6).
        """
        if len(pi) != len(ref):
            raise SpecError(
                f"{names[0]} has {len(pi)} entries but {names[1]} has {len(ref)}; give both "
                f"over the same outcomes, in the same order"
            )
        for name, p in zip(names, (pi, ref), strict=True):
            if len(p) < 2:
                raise SpecError(f"{name} needs at least 2 probabilities, got {len(p)}")
            for i, x in enumerate(p):
                if not (math.isfinite(x) and 0.0 < x <= 1.0):
                    raise SpecError(
                        f"{name}[{i}] = {x} is not a probability in (0, 1]; the lab needs every "
                        f"outcome possible under both distributions (logits = log p)"
                    )
            total = math.fsum(p)
            if abs(total - 1.0) > 1e-6:
                raise SpecError(
                    f"{name} sums to {total:.6g}, not 1; give probabilities that sum to 1 "
                    f"(e.g. divide each entry by {total:.6g})"
                )
        lp = torch.tensor(list(pi), dtype=torch.float64).log()
        lr = torch.tensor(list(ref), dtype=torch.float64).log()
        return cls.categorical(lp, lr)

    @classmethod
    def from_spec(cls, spec: object) -> SequencePair:
        """A tabular model from the JSON spec of ``klpo lab sequence``.

        ``{"vocab": V, "length": T, "policy": {prefix: [V logits]}, "reference": {...}}``, a prefix
        written as space-separated token ids ("" for the root); every prefix of length < T must be
        given for both models, and nothing else.

        Raises:
            SpecError: naming the field, the prefix and the fix.
        """
        if not isinstance(spec, Mapping):
            raise SpecError(f"the spec must be a JSON object, got {type(spec).__name__}")
        missing = [k for k in ("vocab", "length", "policy", "reference") if k not in spec]
        if missing:
            raise SpecError(
                f"the spec is missing {', '.join(repr(k) for k in missing)}; expected "
                '{"vocab": V, "length": T, "policy": {prefix: [V logits]}, "reference": {...}}'
            )
        unknown = sorted(set(spec) - {"vocab", "length", "policy", "reference"})
        if unknown:
            raise SpecError(f"unknown spec field(s): {', '.join(map(repr, unknown))}")
        vocab, length = spec["vocab"], spec["length"]
        for name, v, lo in (("vocab", vocab, 2), ("length", length, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise SpecError(f"spec field {name!r} must be an integer >= {lo}, got {v!r}")
        _check_enumerable(vocab, length)
        order = prefixes(vocab, length)
        tables = []
        for field in ("policy", "reference"):
            table = spec[field]
            if not isinstance(table, Mapping):
                raise SpecError(f"spec field {field!r} must be an object {{prefix: [V logits]}}")
            rows: dict[tuple[int, ...], list[float]] = {}
            for key, value in table.items():
                prefix = _parse_prefix(key, vocab, length, field)
                if prefix in rows:
                    raise SpecError(
                        f"{field}: prefix {key!r} is given twice (as {prefix_text(prefix)!r})"
                    )
                rows[prefix] = _parse_logits(value, vocab, field, key)
            for prefix in order:
                if prefix not in rows:
                    raise SpecError(
                        f"{field} is missing prefix {prefix_text(prefix)!r}; every prefix of "
                        f"length < {length} needs {vocab} logits ({len(order)} prefixes in all)"
                    )
            tables.append(torch.tensor([rows[p] for p in order], dtype=torch.float64))
        return cls(tables[0], tables[1], vocab=vocab, length=length)

    # -- structure ------------------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return self.vocab**self.length

    @property
    def prefixes(self) -> list[tuple[int, ...]]:
        """The prefixes in row order."""
        return prefixes(self.vocab, self.length)

    @functools.cached_property
    def enumeration(self) -> Enumeration:
        """Every sequence, lexicographic; ``rows[n, t] = offset_t + n // V^(T-t)``."""
        v, big_t = self.vocab, self.length
        n = torch.arange(v**big_t, dtype=torch.int64)
        tokens = torch.stack([(n // v ** (big_t - 1 - t)) % v for t in range(big_t)], dim=1)
        rows = torch.stack(
            [num_prefixes(v, t) + n // v ** (big_t - t) for t in range(big_t)], dim=1
        )
        return Enumeration(tokens=tokens, rows=rows)

    def token_logps(self, logits: Tensor) -> Tensor:
        """``[N, T]`` log-probs of every enumerated sequence's tokens under ``logits`` (``[P, V]``).

        Differentiable with respect to ``logits``.
        """
        e = self.enumeration
        return torch.log_softmax(logits, dim=-1)[e.rows, e.tokens]

    @functools.cached_property
    def seq_logp(self) -> Tensor:
        """``[N]`` log pi_theta(y) of every enumerated sequence."""
        return self.token_logps(self.logits).sum(-1)

    @functools.cached_property
    def seq_logp_ref(self) -> Tensor:
        """``[N]`` log pi_ref(y) of every enumerated sequence."""
        return self.token_logps(self.logits_ref).sum(-1)

    @property
    def probs(self) -> Tensor:
        """``[N]`` pi_theta(y)."""
        return self.seq_logp.exp()

    @property
    def probs_ref(self) -> Tensor:
        """``[N]`` pi_ref(y)."""
        return self.seq_logp_ref.exp()

    @functools.cached_property
    def kl_theta_ref(self) -> float:
        """KL(pi_theta ‖ pi_ref) over whole sequences, by exact summation."""
        return float((self.probs * (self.seq_logp - self.seq_logp_ref)).sum())

    @functools.cached_property
    def kl_ref_theta(self) -> float:
        """KL(pi_ref ‖ pi_theta) over whole sequences, by exact summation."""
        return float((self.probs_ref * (self.seq_logp_ref - self.seq_logp)).sum())


def _parse_prefix(key: object, vocab: int, length: int, field: str) -> tuple[int, ...]:
    if not isinstance(key, str):
        raise SpecError(f"{field}: prefix {key!r} must be a string of space-separated token ids")
    parts = key.split()
    try:
        prefix = tuple(int(p) for p in parts)
    except ValueError:
        raise SpecError(
            f"{field}: prefix {key!r} is malformed; write token ids separated by spaces, "
            f'e.g. "0 1", and "" for the root'
        ) from None
    if len(prefix) >= length:
        raise SpecError(
            f"{field}: prefix {key!r} has {len(prefix)} tokens; prefixes must be shorter than "
            f"length = {length}"
        )
    bad = [t for t in prefix if not 0 <= t < vocab]
    if bad:
        raise SpecError(f"{field}: prefix {key!r} has token id {bad[0]} outside [0, {vocab})")
    return prefix


def _parse_logits(value: object, vocab: int, field: str, key: str) -> list[float]:
    if (
        not isinstance(value, list)
        or len(value) != vocab
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)
    ):
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise SpecError(f"{field}[{key!r}] must be a list of {vocab} numbers (logits), got {got}")
    if not all(math.isfinite(x) for x in value):
        raise SpecError(f"{field}[{key!r}] has a non-finite logit; logits must be finite")
    return [float(x) for x in value]


# --------------------------------------------------------------------------------------------
# Random LM-like categoricals.


def zipf_logits(vocab: int, *, exponent: float = 1.1, generator: torch.Generator) -> Tensor:
    """``[V]`` float64 logits ``-exponent · log(rank)``, ranks a random permutation of 1..V.

    Next-token distributions of language models are roughly Zipfian (probability ∝ rank^-s with
    s ≈ 1); the permutation makes the token ids carry no meaning.
    """
    ranks = torch.randperm(vocab, generator=generator).to(torch.float64) + 1.0
    return -exponent * ranks.log()


def _kl_rows(logits: Tensor, logits_ref: Tensor) -> Tensor:
    logp, logp_ref = torch.log_softmax(logits, -1), torch.log_softmax(logits_ref, -1)
    return (logp.exp() * (logp - logp_ref)).sum(-1)


def _scale_for_kl(base: Tensor, direction: Tensor, target_kl: float, *, perturb_ref: bool) -> float:
    """sigma with KL(pi_theta ‖ pi_ref) = target, where one side is ``base + sigma · direction``."""

    def kl_at(sigma: float) -> float:
        moved = base + sigma * direction
        pair = (base, moved) if perturb_ref else (moved, base)
        return float(_kl_rows(*pair))

    lo, hi = 0.0, 1.0
    while kl_at(hi) < target_kl:
        lo, hi = hi, 2.0 * hi
        if hi > 1e6:
            raise SpecError(f"could not reach KL = {target_kl} by perturbing the logits")
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if kl_at(mid) < target_kl:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


def lm_pair(
    vocab: int,
    target_kl: float,
    *,
    exponent: float = 1.1,
    generator: torch.Generator,
) -> SequencePair:
    """A random LM-like categorical pair with KL(pi_theta ‖ pi_ref) = ``target_kl`` (to ~1e-10).

    pi_theta has Zipf-shaped logits (:func:`zipf_logits`); pi_ref's logits are pi_theta's plus
    ``sigma · eps``, eps ~ N(0, I), with sigma found by bisection on the exact KL (a sum over the
    vocabulary).
    """
    if not target_kl > 0:
        raise SpecError(f"target_kl must be > 0, got {target_kl}")
    base = zipf_logits(vocab, exponent=exponent, generator=generator)
    eps = torch.randn(vocab, generator=generator, dtype=torch.float64)
    sigma = _scale_for_kl(base, eps, target_kl, perturb_ref=True)
    return SequencePair.categorical(base, base + sigma * eps)


def drift_path(
    vocab: int,
    steps: int,
    max_kl: float,
    *,
    exponent: float = 1.1,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor]:
    """A policy drifting away from a fixed reference, step by step.

    Returns:
        ``(logits_ref [V], logits [steps + 1, V])``: the Zipfian reference and the policy at steps
        0..steps, ``logits_ref + (s / steps) · sigma · eps`` with sigma chosen so that the last
        step has KL(pi_theta ‖ pi_ref) = ``max_kl``. Step 0 is the reference itself.
    """
    base = zipf_logits(vocab, exponent=exponent, generator=generator)
    eps = torch.randn(vocab, generator=generator, dtype=torch.float64)
    sigma = _scale_for_kl(base, eps, max_kl, perturb_ref=False)
    frac = torch.arange(steps + 1, dtype=torch.float64)[:, None] / steps
    return base, base + frac * sigma * eps


def _check_enumerable(vocab: int, length: int) -> None:
    """Refuse a sequence model with more than :data:`MAX_SEQUENCES` sequences to enumerate."""
    if length > 1 and vocab**length > MAX_SEQUENCES:
        raise SpecError(
            f"vocab^length = {vocab}^{length} = {vocab**length} sequences is too many to "
            f"enumerate; keep it <= {MAX_SEQUENCES} (smaller vocab or shorter length)"
        )
