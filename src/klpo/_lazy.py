"""A function named by its module and attribute, imported when first called.

The torch-free tables (:mod:`klpo.registry`, :mod:`klpo.train.algorithms`) name the functions
that implement each row without importing them, so that reading a row's traits (the doctor, the
config, the docs) never imports torch; calling the function imports its module once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Ref"]


@dataclass(frozen=True)
class Ref:
    """``module.name``, callable as the function it names.

    Two refs are equal when they name the same function; the function itself is looked up on the
    first call (or :meth:`resolve`) and kept.

    >>> f = Ref("math", "hypot")
    >>> f(3.0, 4.0), f.resolve() is __import__("math").hypot, f
    (5.0, True, Ref('math.hypot'))
    """

    module: str
    name: str
    _fn: list[Any] = field(default_factory=list, compare=False, repr=False, hash=False)

    def resolve(self) -> Any:
        """The function this names (its module imported on first use)."""
        if not self._fn:
            self._fn.append(getattr(importlib.import_module(self.module), self.name))
        return self._fn[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Ref('{self.module}.{self.name}')"


def resolve(fn: Any) -> Any:
    """``fn`` itself, or the function a :class:`Ref` names.

    >>> resolve(len) is len, resolve(Ref("math", "pi")) == __import__("math").pi
    (True, True)
    """
    return fn.resolve() if isinstance(fn, Ref) else fn
