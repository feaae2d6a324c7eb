r"""Reward functions: chosen by name or as ``module:function``, weighted, summed and checked.

Every reward function has one signature::

    fn(prompts: list[str], completions: list[str], answers: list[str]) -> Sequence[float]

called positionally with three lists of equal length N (the i-th completion was sampled for the
i-th prompt, whose reference answer is the i-th answer; a prompt repeats once per sample of its
group). It returns N real numbers, one per completion. Completions are the decoded text after the
prompt, cut at the end-of-sequence token, without special tokens.

Built-in functions (:data:`BUILTIN`), each in ``{0.0, 1.0}`` but the last:

- ``exact_match``: the completion, stripped of surrounding whitespace, equals the answer stripped.
- ``numeric``: the number extracted from the completion equals the number extracted from the
  answer, compared exactly as decimals (``"85"``, ``"85.0"`` and ``"#### 85"`` agree). Extraction
  (:func:`extract_number`) follows GSM8K's answer format ``#### 42``: if the text contains
  ``####``, the first number after the last ``####``; otherwise the last number in the text (the
  lenient fallback of lm-evaluation-harness's GSM8K "flexible-extract" filter). A number is an
  optional minus sign (not preceded by a letter, digit or dot), digits with optional ``,``
  thousands groups, and an optional decimal part: ``-1,234.5``. An answer with no number is a
  data error and raises.
- ``format``: the completion respects the answer format: stripped, it is one number
  (``"85"``) or ends with a final line ``#### <number>`` (GSM8K's format).
- ``boxed``: the content of the completion's last ``\boxed{...}`` (braces balanced, so
  ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``; :func:`extract_boxed`) equals the answer: as
  exact decimals when both are one number (``"1,000"`` and ``"1000.0"`` agree), else as strings
  with surrounding whitespace and ``$`` removed. The answer is the content of its own last
  ``\boxed{}`` if it has one, the number after ``####`` if it has that, else the answer stripped.
  A completion with no ``\boxed{}``, or an unclosed one, scores 0 (the convention of
  MATH-style graders, Hendrycks et al. 2021, arXiv:2103.03874).
- ``overopt_proxy``: the over-optimisation task's deliberately flawed proxy, in [0, 1.5]
  (:func:`klpo.train.rewards.overopt.overopt_proxy`).

Rewards are chosen by name from the registry :data:`REWARDS` (the built-ins, and whatever
:func:`register_reward` adds), or as ``module:function``. Several rewards are combined as a weighted sum, ``r_i = sum_k w_k · r_k(i)``
(:func:`combined_rewards`). Every value is checked: a function that raises, returns a value that
is not a real number, NaN or ±inf, or the wrong number of values stops the run with a
:class:`RewardError` naming the function and the sample index, never a silent NaN in the loss.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from klpo.train.rewards.overopt import overopt_proxy

__all__ = [
    "BUILTIN",
    "REWARDS",
    "RewardError",
    "RewardFn",
    "WeightedReward",
    "boxed",
    "combined_rewards",
    "exact_match",
    "extract_boxed",
    "extract_number",
    "format_reward",
    "get_reward",
    "numeric",
    "register_reward",
    "resolve_rewards",
    "score",
]

RewardFn = Callable[[list[str], list[str], list[str]], Sequence[float]]


class RewardError(ValueError):
    """A reward function failed or returned something that is not one finite number per sample."""


# --------------------------------------------------------------------------------------------
# Number extraction (GSM8K's "#### 42" format).

_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:,\d{3})*(?:\.\d+)?")
_FORMAT = re.compile(r"(?:(?:.*\n)?[ \t]*####[ \t]*)?" + _NUMBER.pattern, re.DOTALL)


def extract_number(text: str) -> Decimal | None:
    """The answer number of ``text``: after the last ``####`` if there is one, else the last.

    Examples: ``"#### 1,234"`` → 1234; ``"so 3 + 4 = 7\\n#### 7"`` → 7; ``"it is -12."`` → -12;
    ``"3-2"`` → 2 (a minus after a digit is an operator, not a sign); ``"####"`` → None;
    ``"no digits"`` → None.
    """
    if "####" in text:
        match = _NUMBER.search(text.rsplit("####", 1)[1])
    else:
        matches = _NUMBER.findall(text)
        match = matches[-1] if matches else None
    if match is None:
        return None
    token = match if isinstance(match, str) else match.group(0)
    try:
        return Decimal(token.replace(",", ""))
    except InvalidOperation:  # pragma: no cover - the pattern only matches valid decimals
        return None


# --------------------------------------------------------------------------------------------
# Built-in reward functions.


def exact_match(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where ``completion.strip() == answer.strip()``, else 0.0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers, strict=True)]


def numeric(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the completion's number equals the answer's (:func:`extract_number`), else 0.0.

    Raises:
        ValueError: an answer contains no number (naming its index).
    """
    out = []
    for i, (c, a) in enumerate(zip(completions, answers, strict=True)):
        expected = extract_number(a)
        if expected is None:
            raise ValueError(
                f"answer {i} ({a!r}) contains no number; the numeric reward needs answers like "
                f"'42' or '... #### 42'"
            )
        got = extract_number(c)
        out.append(float(got is not None and got == expected))
    return out


def format_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """1.0 where the stripped completion is one number or ends with a line ``#### <number>``.

    Registered as ``"format"``. Independent of the answer's value.
    """
    return [float(_FORMAT.fullmatch(c.strip()) is not None) for c in completions]


_BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` in ``text``, braces balanced; None if there is none.

    Examples: ``"so \boxed{42}."`` → ``"42"``; ``"\boxed{\frac{1}{2}}"`` → ``"\frac{1}{2}"``;
    ``"\boxed{1} then \boxed{2}"`` → ``"2"``; ``"\boxed{12"`` (never closed) → None.
    """
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    i = start + len(_BOXED)
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _as_decimal(text: str) -> Decimal | None:
    """``text`` as a decimal when it is exactly one number (``1,234.5``), else None."""
    t = text.strip().strip("$").strip()
    if not _NUMBER.fullmatch(t):
        return None
    return Decimal(t.replace(",", ""))


def _same_answer(got: str, expected: str) -> bool:
    a, b = _as_decimal(got), _as_decimal(expected)
    if a is not None and b is not None:
        return a == b
    return got.strip().strip("$").strip() == expected.strip().strip("$").strip()


def boxed(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    r"""1.0 where the completion's last ``\boxed{...}`` holds the answer, else 0.0 (see the module)."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        expected = extract_boxed(a)
        if expected is None:
            expected = a.rsplit("####", 1)[1] if "####" in a else a
        got = extract_boxed(c)
        out.append(float(got is not None and _same_answer(got, expected)))
    return out


BUILTIN: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "format": format_reward,
    "boxed": boxed,
    "overopt_proxy": overopt_proxy,
}

REWARDS: dict[str, RewardFn] = dict(BUILTIN)
"""The reward registry: every reward a config (``rewards``, ``gold_reward``) may name. It starts as
:data:`BUILTIN`; :func:`register_reward` adds to it."""


def register_reward(name: str, fn: RewardFn, *, replace: bool = False) -> RewardFn:
    """Add ``fn`` to :data:`REWARDS` under ``name`` and return it (usable as a decorator's body).

    Raises:
        ValueError: ``name`` is empty, holds a ``:`` (kept for ``module:function``), is ``model``
            (the reward model's), or is taken and ``replace`` is False; ``fn`` is not callable.
    """
    if not isinstance(name, str) or not name or ":" in name or name == "model":
        raise ValueError(
            f"a registered reward needs a plain name (no ':', not 'model'), got {name!r}"
        )
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {fn!r} is not a function")
    if name in REWARDS and not replace and REWARDS[name] is not fn:
        raise ValueError(f"reward {name!r} is already registered; pass replace=True to replace it")
    REWARDS[name] = fn
    return fn


def _known() -> str:
    """The names a reward may be chosen by, for error messages."""
    extra = [n for n in REWARDS if n not in BUILTIN]
    return ", ".join(BUILTIN) + (f"; registered: {', '.join(extra)}" if extra else "")


def get_reward(name: str) -> RewardFn:
    """A reward function by name: a registered one (:data:`REWARDS`) or ``"package.module:function"``.

    Raises:
        ValueError: an unknown built-in name, or a ``module:function`` that cannot be imported,
            does not exist or is not callable; the message says which and lists the built-ins.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a reward is named by a non-empty string, got {name!r}")
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}; built-in rewards: {_known()}, or give your own "
            f"as 'package.module:function'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward {name!r}: cannot import module {module_name!r} ({err}); is it on PYTHONPATH?"
        ) from err
    fn = module
    for part in attr.split("."):
        if not part or not hasattr(fn, part):
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Checked calls and weighted sums.


def score(
    fn: RewardFn,
    name: str,
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
) -> list[float]:
    """``fn(prompts, completions, answers)`` as N checked, finite floats.

    If ``fn`` raises on the batch, it is called again on one sample at a time to find the first
    sample it fails on, and the :class:`RewardError` names that index (or says the failure only
    happens on the whole batch). Booleans and numpy/torch scalars are accepted as numbers.

    Raises:
        RewardError: ``fn`` raised, returned a non-sequence or the wrong number of values, a value
            that is not a real number, or NaN/±inf; the message names ``name`` and the index.
        ValueError: the three inputs differ in length.
    """
    n = len(completions)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(
            f"prompts, completions and answers must have one entry per sample, got "
            f"{len(prompts)}, {n} and {len(answers)}"
        )
    args = (list(prompts), list(completions), list(answers))
    try:
        values = fn(*args)
    except Exception as err:
        where = _first_failing_sample(fn, *args)
        at = f"on sample {where}" if where is not None else f"on the batch of {n} samples"
        raise RewardError(
            f"reward function {name!r} raised {type(err).__name__} {at}: {err}"
        ) from err
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {name!r} returned a {type(values).__name__}, expected a list of "
            f"{n} floats (one per completion)"
        ) from None
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions; it "
            f"must return exactly one float per completion"
        )
    out = []
    for i, v in enumerate(values):
        x = _as_real(v)
        if x is None:
            raise RewardError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {i}; "
                f"rewards must be real numbers"
            )
        if not math.isfinite(x):
            raise RewardError(
                f"reward function {name!r} returned {x} for sample {i} (completion "
                f"{completions[i]!r}); rewards must be finite"
            )
        out.append(x)
    return out


def _as_real(v: object) -> float | None:
    if isinstance(v, numbers.Real):  # int, float, bool, numpy floating/integer
        return float(v)
    item = getattr(v, "item", None)  # a 0-d torch tensor or numpy array
    if callable(item) and getattr(v, "ndim", None) == 0:
        x = item()
        return float(x) if isinstance(x, numbers.Real) else None
    return None


def _first_failing_sample(fn: RewardFn, *args: list[str]) -> int | None:
    for i in range(len(args[0])):
        try:
            fn(*([a[i]] for a in args))
        except Exception:
            return i
    return None


@dataclass(frozen=True)
class WeightedReward:
    """A reward function with the name it was chosen by and its weight in the sum."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def resolve_rewards(spec: str | Sequence[str] | Mapping[str, float]) -> list[WeightedReward]:
    """Reward functions from a name, a list of names (weight 1 each) or ``{name: weight}``.

    Raises:
        ValueError: no reward, a name listed twice, an unknown name (see :func:`get_reward`), or
            a weight that is not a finite real number.
    """
    items = (
        [(spec, 1.0)]
        if isinstance(spec, str)
        else list(spec.items())
        if isinstance(spec, Mapping)
        else [(n, 1.0) for n in spec]
    )
    if not items:
        raise ValueError(f"at least one reward is needed; built-in rewards: {_known()}")
    out: list[WeightedReward] = []
    for name, weight in items:
        if any(r.name == name for r in out):
            raise ValueError(f"reward {name!r} is listed twice; give it one weight instead")
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
        ):
            raise ValueError(
                f"the weight of reward {name!r} must be a finite number, got {weight!r}"
            )
        out.append(WeightedReward(name, get_reward(name), float(weight)))
    return out


def combined_rewards(
    rewards: Sequence[WeightedReward],
    prompts: Sequence[str],
    completions: Sequence[str],
    answers: Sequence[str],
) -> tuple[list[float], dict[str, list[float]]]:
    """The weighted sum ``r_i = sum_k w_k · r_k(i)`` and each function's own values.

    Returns:
        ``(total, per_reward)``: N floats, and ``{name: N floats}`` (unweighted), e.g. for
        ``reward/<name>`` metrics.

    Raises:
        RewardError: as :func:`score`, for the first function that misbehaves.
    """
    if not rewards:
        raise ValueError("combined_rewards needs at least one reward")
    per: dict[str, list[float]] = {}
    total = [0.0] * len(completions)
    for r in rewards:
        values = score(r.fn, r.name, prompts, completions, answers)
        per[r.name] = values
        total = [t + r.weight * v for t, v in zip(total, values, strict=True)]
    return total, per
