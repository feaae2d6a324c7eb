"""A tuple of names computed when it is read: the views of a registry that grows at run time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

__all__ = ["LiveNames"]


class LiveNames(Sequence[str]):
    """A read-only sequence of names that ``names()`` computes each time it is read.

    Behaves as the tuple ``tuple(names())`` (iteration, ``in``, ``len``, indexing, ``==`` with a
    tuple or list), so that a module can export "every registered estimator" as a constant while
    an estimator registered later (:func:`klpo.kl.register`) is in it.

    >>> table = {"a": 1}
    >>> view = LiveNames(lambda: tuple(table), "the keys of table")
    >>> table["b"] = 2
    >>> view == ("a", "b"), "b" in view, len(view), view
    (True, True, 2, ('a', 'b'))
    """

    def __init__(self, names: Callable[[], Iterable[str]], doc: str = "") -> None:
        self._names = names
        self.__doc__ = doc or type(self).__doc__

    def now(self) -> tuple[str, ...]:
        """The names as a tuple, now."""
        return tuple(self._names())

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...
    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        return self.now()[i]

    def __len__(self) -> int:
        return len(self.now())

    def __iter__(self) -> Iterator[str]:
        return iter(self.now())

    def __contains__(self, name: object) -> bool:
        return name in self.now()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return self.now() == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self.now())
