"""Bridges from other training frameworks to klpo's library.

- :mod:`klpo.integrations.trl`: ``KLPOGRPOTrainer``, a subclass of TRL's ``GRPOTrainer`` that uses
  any klpo KL estimator in the loss, the reward or both (needs the optional peer TRL).

Nothing here is imported by ``import klpo``, and this package imports no framework itself: each
integration imports its framework when it is imported, and says how to install it when it is
missing.
"""

from __future__ import annotations

__all__: list[str] = []
