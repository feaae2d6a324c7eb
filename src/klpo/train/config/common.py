"""What every section of the config shares: the base section, the table-checked choices, and
the error type."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from klpo.train.choices import ENGINES, SAMPLERS
from klpo.train.runtime.trackers import TRACKERS

Tracker = Literal[tuple(TRACKERS)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.runtime.trackers.TRACKERS`, as the config's type."""

Engine = Literal[tuple(ENGINES)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.choices.ENGINES`, as the config's type."""

Sampler = Literal[tuple(SAMPLERS)]  # type: ignore[valid-type]
"""The names of :data:`klpo.train.choices.SAMPLERS`, as the config's type."""

EXPERIMENTAL = (
    " Experimental: may change; tested for exactness, not yet measured on real models at scale "
    '(docs/architecture.md, "Experimental parts").'
)
"""The sentence that ends the description of an experimental key (the stale ring, the
asynchronous worker, the off-policy losses): what experimental means."""


def table_row(table: Mapping[str, object]) -> WrapValidator:
    """A key whose ``Literal`` type is ``table``'s names, checked against the table as it is
    when a config is validated: a row added to the table after the config's module loaded
    (a user's own algorithm, policy loss or engine) is a choice at once, and the error for a name
    that is no row lists the rows of now, in a ``Literal``'s words."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str) and value in table:
            return value
        if isinstance(value, str) and table:
            names = [repr(n) for n in table]
            expected = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            )
        return handler(value)

    return WrapValidator(check)


LR_SCHEDULERS = (
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
"""The schedules of transformers' ``get_scheduler`` that follow the step count (not
``reduce_lr_on_plateau``, which follows a metric, nor ``greedy``)."""


def one_of(what: str, value: str, allowed: Sequence[str]) -> str:
    """``value`` if it is in ``allowed``, else a ValueError that names it and lists the choices."""
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")
    return value


class Section(BaseModel):
    """A section of the config: unknown keys refused, every number finite (``inf`` and ``nan``
    are refused by name), and a count never given as ``true``/``false`` (YAML's booleans are
    not taken as 1 and 0)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, bool):
            return v
        field = cls.model_fields.get(info.field_name or "")
        allowed = {a for a in get_args(field.annotation) or (field.annotation,)} if field else set()
        if allowed & {int, float} and bool not in allowed:
            kind = "a whole number" if int in allowed else "a number"
            raise ValueError(
                f"is {kind}, not {str(v).lower()} (YAML's true/false are not 1 and 0); give "
                "the number, e.g. 1"
            )
        return v


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the fix."""
