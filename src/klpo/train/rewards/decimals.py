r"""The numbers of a text, as the numeric rewards read them: one pattern, exact decimals.

A number is an optional minus sign (not preceded by a letter, digit or dot, so the ``-`` of
``3-2`` is an operator), digits with optional ``,`` thousands groups, and an optional decimal
part: ``-1,234.5``. Values are :class:`decimal.Decimal`, compared exactly (``"85"`` and
``"85.0"`` agree). ``numeric`` reads the last of them (:func:`klpo.train.rewards.functions.extract_number`),
the chat over-optimisation rewards read all of them (:mod:`klpo.train.rewards.overopt`).
"""

from __future__ import annotations

import re
from decimal import Decimal

__all__ = ["NUMBER", "numbers_in"]

NUMBER = re.compile(r"(?:(?<![\w.])-)?\d+(?:,\d{3})*(?:\.\d+)?")
"""One number of a text (see the module)."""


def numbers_in(text: str) -> list[Decimal]:
    """Every number of ``text``, in order, as exact decimals.

    >>> numbers_in("4 * 7 = 28, not -1,000.5 or 3-2")
    [Decimal('4'), Decimal('7'), Decimal('28'), Decimal('-1000.5'), Decimal('3'), Decimal('2')]
    >>> numbers_in("24,25,26 and 100,200")  # a group of three digits after a comma is thousands
    [Decimal('24'), Decimal('25'), Decimal('26'), Decimal('100200')]
    >>> numbers_in("no digits")
    []
    """
    return [Decimal(m.replace(",", "")) for m in NUMBER.findall(text)]
