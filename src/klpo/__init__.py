"""klpo: KL-regularised policy optimisation for language models.

The library is a set of pure tensor functions, one module per concern:

- :mod:`klpo.kl`          per-token KL estimators and :func:`klpo.kl.explain`
- :mod:`klpo.logprobs`    token log-probs, entropy and exact KL, chunked, from logits or hidden states
- :mod:`klpo.heads`       a causal LM's output head and logit transform, read and checked against it
- :mod:`klpo.fused_kernel`, :mod:`klpo.fused_loss_kernel`  the two kernels behind ``logprobs.fused``
  and ``logprobs.fused_loss``; :mod:`klpo.gemm` their GEMMs (docs/architecture.md: the order)
- :mod:`klpo.advantages`  GAE, returns-to-go, group-relative (GRPO, Dr. GRPO), RLOO, REINFORCE++
- :mod:`klpo.losses`      PPO clip / dual-clip / penalty, GSPO, CISPO surrogates, value loss, entropy, KL terms
- :mod:`klpo.offpolicy`   the field's off-policy losses (decoupled PPO, M2PO, DPPO, TRM, k2 to the sampler) and trust-region diagnostics
- :mod:`klpo.reduce`      the named loss aggregations
- :mod:`klpo.control`     KL coefficient controllers
- :mod:`klpo.teacher`     divergences to a teacher over the vocabulary (on-policy distillation)
- :mod:`klpo.vocab_parallel`  log-probs, entropy and exact KL over a head sharded by vocabulary

Submodules are imported on first use: ``import klpo`` imports none of them, and no torch. The
library needs torch and numpy (``pip install 'klpo[torch]'``); imported without them, a module
says which install brings what it needs (:mod:`klpo._extras`).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from klpo._extras import explain_missing

# The version's one place: pyproject.toml reads it from here (``[tool.setuptools.dynamic]``).
__version__ = "0.1.0"

__all__ = [
    "__version__",
    "advantages",
    "control",
    "heads",
    "kl",
    "logprobs",
    "losses",
    "offpolicy",
    "reduce",
    "teacher",
    "vocab_parallel",
]

_SUBMODULES = frozenset(__all__) - {"__version__"}

explain_missing()


def __getattr__(name: str) -> ModuleType:
    if name in _SUBMODULES:
        return importlib.import_module(f"klpo.{name}")
    raise AttributeError(f"module 'klpo' has no attribute {name!r}")
