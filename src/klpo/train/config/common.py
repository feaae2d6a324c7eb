"""What every section of the config shares: the base section, the table-checked choices, and
the error type."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidatorFunctionWrapHandler,
    WrapValidator,
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
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and the fix."""
