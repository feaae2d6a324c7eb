r"""Reward functions: chosen by name or as ``module:function``, weighted, summed and checked.

A reward function scores a batch of N completions (the i-th sampled for the i-th prompt; a prompt
repeats once per sample of its group) and returns N values. It takes one of two forms, told
apart by its signature (:func:`reward_form`):

- **TRL's** (a ``**kwargs`` parameter), as ``trl.GRPOTrainer`` calls it::

      fn(completions, **kwargs) -> list[float | None]

  called with keywords only: ``prompts``, ``completions``, ``completion_ids`` (each completion's
  token ids, its end-of-sequence token included), ``trainer_state`` (:class:`TrainerState`) and
  every column of the data row under its own name (``answer``, ``solution``, ``task``, ...; all
  but ``prompt``, ``completion`` and ``completion_ids``, as TRL). Where the data is chat
  (``data.chat``), ``prompts`` are message lists and each completion is one assistant message,
  ``[{"role": "assistant", "content": text}]`` (TRL's conversational format); otherwise both
  are strings.
- **klpo's** (three positional parameters, no ``**kwargs``)::

      fn(prompts: list[str], completions: list[str], answers: list[str]) -> Sequence[float]

  called with three lists: the prompt texts as the policy saw them, the completions, and each
  sample's reference answer (``data.answer_field``).

Completions are the decoded text after the prompt, cut at the end-of-sequence token, without
special tokens. A value may be ``None``: the function does not score that sample (as TRL's
multi-task rewards do). A sample that at least one function scores gets the weighted sum of the
values it has (TRL's ``nansum``); a sample that no function scores is *unscored*: it is left out
of every baseline and reward statistic and its task advantage is 0 (docs/rewards.md).

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
- ``chat_overopt_proxy`` and ``chat_overopt_gold``: the chat over-optimisation task's proxy
  (the answer is any number of the completion) and gold (the last number is the answer, no
  other is a guess: each is the answer or a number of the prompt; at most 20 words;
  :mod:`klpo.train.rewards.overopt`).
- ``overopt_proxy``: the over-optimisation task's deliberately flawed proxy, in [0, 1.5]
  (:func:`klpo.train.rewards.overopt.overopt_proxy`).

Rewards are chosen by name from the registry :data:`REWARDS` (the built-ins, and whatever
:func:`register_reward` adds), or as ``module:function`` (a module in the working directory is
found without setting ``PYTHONPATH``). Several rewards are combined as a weighted sum,
``r_i = sum_k w_k · r_k(i)`` (:func:`combined_rewards`). Every value is checked: a function that
raises, returns a value that is not a real number or None, NaN or ±inf, or the wrong number of
values stops the run with a :class:`RewardError` naming the function and the sample index, never
a silent NaN in the loss.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from klpo.train.rewards.decimals import NUMBER, numbers_in
from klpo.train.rewards.overopt import chat_overopt_gold, chat_overopt_proxy, overopt_proxy

__all__ = [
    "ANSWER_PROBLEMS",
    "BUILTIN",
    "REWARDS",
    "RewardBatch",
    "RewardError",
    "RewardFn",
    "TrainerState",
    "WeightedReward",
    "boxed",
    "boxed_answer",
    "combined_rewards",
    "exact_match",
    "extract_boxed",
    "extract_number",
    "format_reward",
    "get_reward",
    "missing_keywords",
    "numeric",
    "register_reward",
    "resolve_rewards",
    "reward_form",
    "score",
]

RewardFn = Callable[..., Sequence[float | None]]
"""A reward function, in TRL's form or klpo's (see the module)."""


class RewardError(ValueError):
    """A reward function failed or returned something that is not one finite number per sample."""


# --------------------------------------------------------------------------------------------
# What a reward function is given, and how it is called.


@dataclass(frozen=True)
class TrainerState:
    """The run's progress, as TRL's reward functions read it (``kwargs["trainer_state"]``)."""

    global_step: int = 0  # training steps completed before this batch was sampled
    max_steps: int = 0  # run.steps


@dataclass(frozen=True)
class RewardBatch:
    """N samples for the reward functions: the three lists of klpo's form, and what TRL's adds.

    ``columns`` holds every column of each sample's data row (``{name: N values}``; a row that
    lacks a column another has gets None); ``messages``, for chat data, each prompt as the
    messages the chat template rendered (then TRL-form functions get conversational prompts and
    completions); ``completion_ids`` each completion's token ids (None when not known).
    """

    prompts: list[str]
    completions: list[str]
    answers: list[str]
    completion_ids: list[list[int]] | None = None
    columns: Mapping[str, list[Any]] = field(default_factory=dict)
    messages: list[list[dict[str, str]]] | None = None
    state: TrainerState = field(default_factory=TrainerState)

    def __post_init__(self) -> None:
        n = len(self.completions)
        sizes = {
            "prompts": len(self.prompts),
            "answers": len(self.answers),
            **({"completion_ids": len(self.completion_ids)} if self.completion_ids else {}),
            **({"messages": len(self.messages)} if self.messages is not None else {}),
            **{f"column {k!r}": len(v) for k, v in self.columns.items()},
        }
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise ValueError(
                f"prompts, completions and answers must have one entry per sample, got "
                f"{len(self.prompts)}, {n} and {len(self.answers)}"
                + (f" ({', '.join(f'{k}: {v}' for k, v in bad.items())})" if bad else "")
            )

    def __len__(self) -> int:
        return len(self.completions)

    def sample(self, i: int) -> RewardBatch:
        """The batch of sample ``i`` alone."""
        return replace(
            self,
            prompts=[self.prompts[i]],
            completions=[self.completions[i]],
            answers=[self.answers[i]],
            completion_ids=None if self.completion_ids is None else [self.completion_ids[i]],
            columns={k: [v[i]] for k, v in self.columns.items()},
            messages=None if self.messages is None else [self.messages[i]],
        )

    def keywords(self) -> dict[str, Any]:
        """The keyword arguments of a TRL-form call (see the module)."""
        out = {k: list(v) for k, v in self.columns.items() if k not in _NOT_PASSED}
        clash = sorted(set(out) & set(KEYWORDS))
        if clash:
            raise ValueError(
                f"the data has a column {clash[0]!r}, the name of an argument every TRL-form "
                f"reward function is given ({', '.join(KEYWORDS)}); rename that column"
            )
        chat = self.messages is not None
        out["prompts"] = [list(m) for m in self.messages] if chat else list(self.prompts)
        out["completions"] = (
            [[{"role": "assistant", "content": c}] for c in self.completions]
            if chat
            else list(self.completions)
        )
        if self.completion_ids is not None:
            out["completion_ids"] = [list(ids) for ids in self.completion_ids]
        out["trainer_state"] = self.state
        return out


KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")
"""The keyword arguments a TRL-form reward function gets besides the data's columns."""
_NOT_PASSED = ("prompt", "completion", "completion_ids")  # columns TRL does not pass on

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        return None


def reward_form(fn: Callable, name: str = "reward") -> Literal["trl", "klpo"]:
    """How ``fn`` is called: ``"trl"`` (it has ``**kwargs``: keywords, see the module) or
    ``"klpo"`` (it takes three positional arguments and needs no more).

    Raises:
        ValueError: ``fn`` takes neither form; the message shows both.
    """
    sig = _signature(fn)
    if sig is None:
        return "klpo"
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return "trl"
    positional = [p for p in params if p.kind in _POSITIONAL]
    star = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    required = [
        p for p in params if p.default is p.empty and p.kind is not inspect.Parameter.VAR_POSITIONAL
    ]
    if (
        (star or len(positional) >= 3)
        and len(required) <= 3
        and all(p.kind in _POSITIONAL for p in required)
    ):
        return "klpo"
    raise ValueError(
        f"reward {name!r}: {getattr(fn, '__name__', type(fn).__name__)}{sig} takes neither form "
        "of a reward function: TRL's, fn(completions, **kwargs), given prompts, completions, "
        "completion_ids and every data column by keyword; or klpo's, fn(prompts, completions, "
        "answers), three lists by position. Add **kwargs to take the data's columns by name"
    )


def missing_keywords(fn: Callable, available: Sequence[str]) -> list[str]:
    """The parameters a TRL-form ``fn`` requires that no keyword in ``available`` fills
    (none for klpo's form)."""
    sig = _signature(fn)
    if sig is None or reward_form(fn) != "trl":
        return []
    return [
        p.name
        for p in sig.parameters.values()
        if p.default is p.empty
        and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        and p.name not in available
    ]


def _call(fn: RewardFn, batch: RewardBatch) -> Any:
    if reward_form(fn) == "trl":
        return fn(**batch.keywords())
    return fn(list(batch.prompts), list(batch.completions), list(batch.answers))


# --------------------------------------------------------------------------------------------
# Number extraction (GSM8K's "#### 42" format).

_NUMBER = NUMBER
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


def boxed_answer(answer: str) -> str:
    r"""What the ``boxed`` reward compares against: the content of the answer's own last
    ``\boxed{}`` if it has one, the text after ``####`` if it has that, else the answer."""
    expected = extract_boxed(answer)
    if expected is None:
        expected = answer.rsplit("####", 1)[1] if "####" in answer else answer
    return expected


def boxed(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    r"""1.0 where the completion's last ``\boxed{...}`` holds the answer, else 0.0 (see the module)."""
    out = []
    for c, a in zip(completions, answers, strict=True):
        got = extract_boxed(c)
        out.append(float(got is not None and _same_answer(got, boxed_answer(a))))
    return out


BUILTIN: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "format": format_reward,
    "boxed": boxed,
    "chat_overopt_proxy": chat_overopt_proxy,
    "chat_overopt_gold": chat_overopt_gold,
    "overopt_proxy": overopt_proxy,
}


def _empty(text: str) -> bool:
    return not text.strip().strip("$").strip()


def _one_number(answer: str) -> str | None:
    n = len(numbers_in(answer))
    return None if n == 1 else f"the answer {answer!r} holds {n} numbers where one is needed"


ANSWER_PROBLEMS: dict[str, Callable[[str], str | None]] = {
    "exact_match": lambda a: (
        "the answer is empty, so an empty completion would score as right"
        if not a.strip()
        else None
    ),
    "numeric": lambda a: "the answer holds no number" if extract_number(a) is None else None,
    "chat_overopt_proxy": lambda a: _one_number(a),
    "chat_overopt_gold": lambda a: _one_number(a),
    "boxed": lambda a: (
        f"the answer {a!r} is empty once its \\boxed{{}}, '####' and '$' are taken off, so an "
        "empty \\boxed{} would score as right"
        if _empty(boxed_answer(a))
        else None
    ),
}
"""Why a built-in reward cannot score against an answer (None: it can); read where the data is
read (:func:`klpo.train.preflight.check_answers`), so a bad answer names its file and line."""

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


def _import_from_cwd(module_name: str):
    """``import module_name``, finding a module in the working directory as ``python -c`` does
    (the console script's path starts at its own directory, so ``klpo train`` alone would not)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.partition(".")[0]
        cwd = os.getcwd()
        if err.name != top or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)  # after the installed packages: a local file never shadows one
        return importlib.import_module(module_name)


def _import_failure(name: str, module_name: str, err: BaseException) -> str:
    """One paragraph for a module that exists but fails as it is imported: the file and line
    (of the module, or of the deepest frame in a file of the user's) and the error."""
    import traceback

    if isinstance(err, SyntaxError):
        where = f"{err.filename}:{err.lineno}"
        text = f"{err.msg}" + (f": {err.text.strip()!r}" if err.text else "")
        kind = type(err).__name__
    else:
        frames = [
            f
            for f in traceback.extract_tb(err.__traceback__)
            if not f.filename.startswith("<frozen") and "importlib" not in f.filename
        ]
        mine = [f for f in frames if "site-packages" not in f.filename] or frames
        where = f"{mine[-1].filename}:{mine[-1].lineno}" if mine else module_name
        text, kind = str(err), type(err).__name__
    return (
        f"reward {name!r}: importing module {module_name!r} failed with {kind} at {where}: "
        f"{text}; fix the module (python -c 'import {module_name}' shows the whole traceback)"
    )


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
        module = _import_from_cwd(module_name)
    except ImportError as err:
        if not isinstance(err, ModuleNotFoundError) or err.name != module_name.partition(".")[0]:
            raise ValueError(_import_failure(name, module_name, err)) from None
        raise ValueError(
            f"reward {name!r}: cannot import module {module_name!r} ({err}); give a module in "
            f"the working directory ({os.getcwd()}) or an installed package"
        ) from err
    except Exception as err:  # the user's module is there but fails as it is imported
        raise ValueError(_import_failure(name, module_name, err)) from None
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
    prompts: Sequence[str] | RewardBatch,
    completions: Sequence[str] | None = None,
    answers: Sequence[str] | None = None,
) -> list[float | None]:
    """``fn`` on one batch as N checked values: finite floats, or None where it does not score.

    The batch is a :class:`RewardBatch`, or the three lists of klpo's form (then a TRL-form
    function gets ``prompts``, ``completions`` and ``answer``). If ``fn`` raises on the batch,
    it is called again on one sample at a time to find the first sample it fails on, and the
    :class:`RewardError` names that index (or says the failure only happens on the whole
    batch). Booleans and numpy/torch scalars are accepted as numbers.

    Raises:
        RewardError: ``fn`` raised, returned a non-sequence or the wrong number of values, a value
            that is neither a real number nor None, NaN/±inf, or values beyond float32's range
            (|x| > 3.4e38: inf in the trainer); the message names ``name`` and the index.
        ValueError: the inputs differ in length.
    """
    batch = (
        prompts
        if isinstance(prompts, RewardBatch)
        else RewardBatch(
            list(prompts),
            list(completions or []),
            list(answers or []),
            columns={"answer": list(answers or [])},
        )
    )
    n = len(batch)
    try:
        values = _call(fn, batch)
    except Exception as err:
        where = _first_failing_sample(fn, batch)
        at = f"on sample {where}" if where is not None else f"on the batch of {n} samples"
        raise RewardError(
            f"reward function {name!r} raised {type(err).__name__} {at}{_raised_at(err, fn)}: "
            f"{err}{_chat_hint(err, fn, batch)}"
        ) from err
    values = _as_list(name, values, n)
    if len(values) != n:
        raise RewardError(
            f"reward function {name!r} returned {len(values)} values for {n} completions; it "
            f"must return exactly one float (or None) per completion"
        )
    checked = [_checked(name, v, i, batch.completions[i]) for i, v in enumerate(values)]
    _refuse_overflow(f"reward function {name!r} returned", checked)
    return checked


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: rewards become float32 tensors in the trainer (the advantages,
the loss), where a larger value is inf."""


def _refuse_overflow(what: str, values: Sequence[float | None], why: str = "") -> None:
    """A :class:`RewardError` where some of ``values`` overflow float32 (|x| > 3.4e38): finite
    in Python's float64, they are inf once the trainer makes them a float32 tensor, and the
    advantages then refuse them as non-finite with no word of which function or why."""
    big = [i for i, x in enumerate(values) if x is not None and abs(x) > FLOAT32_MAX]
    if not big:
        return
    shown = ", ".join(f"{values[i]:.3g}" for i in big[:4]) + (", …" if len(big) > 4 else "")
    raise RewardError(
        f"{what} values that overflow float32 (|x| > 3.4e38, the dtype rewards are trained in) "
        f"at samples {big[:8]}{' …' if len(big) > 8 else ''} ({shown}){why}: they would be inf. "
        "Return rewards on a smaller scale (e.g. divide by a constant, or clip)"
    )


def _as_list(name: str, values: object, n: int) -> list[object]:
    """The values of a list, tuple, 1-d numpy array or 1-d torch tensor; anything else (a dict,
    whose iteration gives its keys; a set, with no order; a generator, a string, a number) is
    refused, naming the function and the type."""
    if isinstance(values, list | tuple):
        return list(values)
    ndim = getattr(values, "ndim", None)
    tolist = getattr(values, "tolist", None)
    kind = type(values).__module__.split(".")[0]
    if kind in ("numpy", "torch") and callable(tolist) and ndim == 1:
        return list(tolist())
    shape = f" of shape {tuple(values.shape)}" if kind in ("numpy", "torch") and ndim else ""
    hint = (
        " (iterating a dict gives its keys, not its values: return list(d.values()) in the "
        "completions' order)"
        if isinstance(values, Mapping)
        else ""
    )
    raise RewardError(
        f"reward function {name!r} returned a {type(values).__name__}{shape}; it must return a "
        f"list (or tuple, 1-d array or tensor) of {n} numbers or None, one per completion in "
        f"order{hint}"
    )


def _checked(name: str, v: object, i: int, completion: str) -> float | None:
    if v is None:
        return None
    x = _as_real(v)
    if x is None:
        raise RewardError(
            f"reward function {name!r} returned {v!r} ({type(v).__name__}) for sample {i}; "
            f"rewards must be real numbers (or None for a sample it does not score)"
        )
    if not math.isfinite(x):
        raise RewardError(
            f"reward function {name!r} returned {x} for sample {i} (completion "
            f"{completion!r}); rewards must be finite (None: the sample is not scored)"
        )
    return x


def _as_real(v: object) -> float | None:
    if isinstance(v, numbers.Real):  # int, float, bool, numpy floating/integer
        return float(v)
    item = getattr(v, "item", None)  # a 0-d torch tensor or numpy array
    if callable(item) and getattr(v, "ndim", None) == 0:
        x = item()
        return float(x) if isinstance(x, numbers.Real) else None
    return None


def _raised_at(err: BaseException, fn: RewardFn) -> str:
    """`` at FILE:LINE in FUNC``: where in the reward's own code ``err`` was raised (the
    innermost frame in ``fn``'s file, else the innermost outside klpo), so that the one-line
    error of ``klpo train`` still points at the line to fix."""
    frames = traceback.extract_tb(err.__traceback__)
    try:
        own = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:
        own = None
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # klpo/train
    mine = [f for f in frames if own and os.path.abspath(f.filename) == os.path.abspath(own)]
    outside = [f for f in frames if not os.path.abspath(f.filename).startswith(here)]
    pick = (mine or outside or [None])[-1]
    if pick is None:
        return ""
    code = f": {pick.line.strip()}" if pick.line else ""
    return f" at {pick.filename}:{pick.lineno} in {pick.name}{code}"


def _chat_hint(err: BaseException, fn: RewardFn, batch: RewardBatch) -> str:
    """With chat data a TRL-form reward gets each completion as a list of messages (as TRL
    passes conversational completions); a string method on one fails. Say so."""
    if batch.messages is None or not isinstance(err, (AttributeError, TypeError)):
        return ""
    if reward_form(fn) != "trl":
        return ""
    return (
        ". With data.chat, completions reach a TRL-form reward as message lists, "
        "[{'role': 'assistant', 'content': TEXT}], as TRL passes conversational completions: "
        "read completion[0]['content'] (docs/rewards.md)"
    )


def _first_failing_sample(fn: RewardFn, batch: RewardBatch) -> int | None:
    for i in range(len(batch)):
        try:
            _call(fn, batch.sample(i))
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
        fn = get_reward(name)
        reward_form(fn, name)  # neither form: refused here, before any sampling
        out.append(WeightedReward(name, fn, float(weight)))
    return out


def combined_rewards(
    rewards: Sequence[WeightedReward],
    prompts: Sequence[str] | RewardBatch,
    completions: Sequence[str] | None = None,
    answers: Sequence[str] | None = None,
) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """The weighted sum ``r_i = sum_k w_k · r_k(i)`` and each function's own values.

    The sum runs over the functions that score sample i (a None is left out, TRL's ``nansum``);
    a sample that no function scores has the total None (unscored).

    Returns:
        ``(total, per_reward)``: N floats or None, and ``{name: N floats or None}``
        (unweighted), e.g. for ``reward/<name>`` metrics.

    Raises:
        RewardError: as :func:`score`, for the first function that misbehaves.
    """
    if not rewards:
        raise ValueError("combined_rewards needs at least one reward")
    per: dict[str, list[float | None]] = {}
    total: list[float | None] = [None] * (
        len(prompts) if isinstance(prompts, RewardBatch) else len(completions or [])
    )
    for r in rewards:
        values = score(r.fn, r.name, prompts, completions, answers)
        per[r.name] = values
        total = [
            t if v is None else (0.0 if t is None else t) + r.weight * v
            for t, v in zip(total, values, strict=True)
        ]
    weights = ", ".join(f"{r.name!r} × {r.weight:g}" for r in rewards)
    _refuse_overflow("the weighted sum of rewards has", total, f" (the sum of {weights})")
    return total, per
