"""What each install of klpo brings, and what a part of klpo says when it is used without it.

klpo is one distribution with three installs (``docs/install.md``), layered as its code is:

| install                    | brings                                              | for                                  |
| -------------------------- | --------------------------------------------------- | ------------------------------------ |
| ``pip install klpo``       | typer, rich, pydantic, PyYAML (pure Python)         | ``klpo doctor``, ``klpo-doctor``, the command line |
| ``pip install 'klpo[torch]'`` | + torch (a floor, never a pin), numpy            | the library: ``klpo.kl``, ``klpo.losses``, ... |
| ``pip install 'klpo[train]'`` | + transformers, datasets, peft, tensorboard, ... | ``klpo train``, the lab's plots, ``klpo compare`` |

:data:`PROVIDES` is the table: one row per distribution of the two extras, with the module it
is imported as. ``tests/test_packaging.py`` checks that it lists exactly the extras'
requirements in ``pyproject.toml``.

A klpo module imported without what it needs raises :class:`MissingExtra` (a
``ModuleNotFoundError``, so ``except ImportError`` still catches it) naming the install that
brings it: :func:`explain_missing` puts a finder on ``sys.meta_path`` (``import klpo`` does it)
that wraps the loader of every ``klpo.*`` module, so ``import klpo.kl`` without torch says
``pip install 'klpo[torch]'`` instead of only "No module named 'torch'". Nothing else changes:
the modules are found and executed by Python's own finders and loaders.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NamedTuple


class Provided(NamedTuple):
    """One requirement of an extra: the distribution, the module it is imported as, the extra."""

    distribution: str
    module: str
    extra: str


#: The extras' distributions, a row each (``pyproject.toml``'s ``[project.optional-dependencies]``
#: ``torch`` and ``train``; ``train`` includes ``torch``).
PROVIDES: tuple[Provided, ...] = (
    Provided("torch", "torch", "torch"),
    Provided("numpy", "numpy", "torch"),
    Provided("transformers", "transformers", "train"),
    Provided("tokenizers", "tokenizers", "train"),
    Provided("safetensors", "safetensors", "train"),
    Provided("datasets", "datasets", "train"),
    Provided("tensorboard", "tensorboard", "train"),
    Provided("matplotlib", "matplotlib", "train"),
    Provided("peft", "peft", "train"),
    Provided("filelock", "filelock", "train"),
)

#: What each extra brings, in the messages.
PURPOSE: dict[str, str] = {
    "torch": "klpo's library (klpo.kl, klpo.losses, klpo.logprobs, ...) with torch and numpy",
    "train": "klpo's trainer, the lab's plots and the studies with their stack",
}

_EXTRA_OF_MODULE: dict[str, str] = {row.module: row.extra for row in PROVIDES}


def extra_of(module: str) -> str | None:
    """The extra that brings top-level module ``module`` (``"torch"``, ``"train"``), or None."""
    return _EXTRA_OF_MODULE.get(module.partition(".")[0])


def needed(extra: str) -> tuple[Provided, ...]:
    """The rows ``extra`` brings, its included extras' too (``train`` includes ``torch``)."""
    if extra not in PURPOSE:
        raise ValueError(f"unknown extra {extra!r}; klpo's extras here: {', '.join(PURPOSE)}")
    wanted = {"torch"} if extra == "torch" else {"torch", "train"}
    return tuple(row for row in PROVIDES if row.extra in wanted)


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` that cannot be imported here (found without importing)."""
    return [
        row.distribution for row in needed(extra) if importlib.util.find_spec(row.module) is None
    ]


def missing_message(what: str, extra: str, absent: Sequence[str]) -> str:
    """The one message for ``what`` used without ``extra``'s distributions ``absent``."""
    text = (
        f"{what} needs {', '.join(absent)}, which this install of klpo does not have: "
        f"`pip install 'klpo[{extra}]'` brings {PURPOSE[extra]}."
    )
    if extra == "torch":
        text += (
            " In an environment that has torch already (verl, TRL, vLLM), `pip install klpo` "
            "uses that torch as it is."
        )
    return text


class MissingExtra(ModuleNotFoundError):
    """A klpo module needs a distribution that only one of klpo's extras brings."""


class _ExplainingLoader(importlib.abc.Loader):
    """A ``klpo.*`` module's own loader, whose missing-module errors name the install."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        except MissingExtra:
            raise
        except ModuleNotFoundError as err:
            extra = extra_of(err.name or "")
            if extra is None:
                raise
            raise MissingExtra(
                missing_message(module.__name__, extra, [err.name.partition(".")[0]]),
                name=err.name,
            ) from err

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _ExplainingFinder(importlib.abc.MetaPathFinder):
    """Finds ``klpo.*`` modules with the other finders and wraps their loaders."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("klpo."):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, _ExplainingFinder) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ExplainingLoader(spec.loader)
        return spec


def explain_missing() -> None:
    """Put the finder on ``sys.meta_path`` once (``import klpo`` calls this)."""
    if not any(isinstance(f, _ExplainingFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ExplainingFinder())
