r"""klpo's KL estimators inside verl: any klpo estimator in verl's KL loss and KL reward.

Written against **verl 0.9.1** (``verl/trainer/ppo/core_algos.py``'s ``kl_penalty``,
``verl/workers/utils/losses.py``'s ``ppo_loss``, ``verl/trainer/ppo/ray_trainer.py``'s
``apply_kl_penalty``) and tested with verl 0.7.1, 0.8.0 and 0.9.1 (:data:`TESTED_VERSIONS`;
docs/frameworks.md has the matrix); a version outside that range gets a warning at import. verl
is an optional peer, never a dependency of klpo: ``pip install verl==0.9.1``.

**Why a rebinding and not a registry.** verl's plug-in seams are two registries in
``core_algos``: ``register_policy_loss(name)`` (a policy loss, in 0.9.1 ``(old_log_prob,
log_prob, advantages, response_mask, loss_agg_mode, config, rollout_log_probs) -> (loss,
metrics)``, chosen by ``actor.policy_loss.loss_mode``) and ``register_adv_est(name)`` (an advantage estimator, chosen
by ``algorithm.adv_estimator``), present in every verl from 0.4.1 to 0.9.1. Neither reaches the
KL term: ``kl_penalty`` is a fixed chain of names in every one of those versions, called by name
from ``ppo_loss`` (after the registered policy loss, which cannot see or change it) and from
``apply_kl_penalty``. This bridge replaces only the KL term, so it registers nothing and rebinds
those two functions instead, reversibly (:func:`install`, :func:`uninstall`); were verl to add a
KL registry, the rebinding would give way to it.

Usage: call :func:`install` once in every process that imports verl's trainer or workers, then
name a klpo estimator with the ``klpo:`` prefix where verl takes an estimator name::

    import klpo.integrations.verl as kv
    kv.install()

    # verl's Hydra config (or the same keys as main_ppo overrides):
    #   actor_rollout_ref.actor.use_kl_loss=true
    #   actor_rollout_ref.actor.kl_loss_type=klpo:k3+      # KL in the loss
    #   algorithm.use_kl_in_reward=true
    #   algorithm.kl_penalty=klpo:k1                       # KL in the reward

With Ray, the worker processes must run :func:`install` too, before they build verl's workers:
``ray.init(runtime_env={"worker_process_setup_hook": "klpo.integrations.verl.install"})`` does it
(verl's ``ray_kwargs.ray_init.runtime_env`` passes the same dict), or import this module and call it
in a custom ``main_ppo``. Without a ``klpo:`` name nothing changes: verl's own names go to verl's
own function.

``klpo doctor CONFIG`` says what a verl config's KL settings do and which klpo names do what they
most likely meant; ``klpo explain -e NAME -p loss`` says what one estimator does.

**What is replaced.**

- ``core_algos.kl_penalty(logprob, ref_logprob, kl_penalty)`` (the function both call sites use)
  becomes :func:`kl_penalty`: a ``klpo:NAME`` goes to :func:`klpo.kl.estimate` (value and
  gradient exactly klpo's, float32); any other name to verl's original. In the **reward**
  (``apply_kl_penalty``, with ``old_log_probs``, detached afterwards by verl) this is the whole
  change: verl then subtracts ``beta · estimate`` per token, exactly as with its own names.
- ``losses.ppo_loss`` becomes :func:`ppo_loss`, which hands the batch's ``old_log_probs`` to
  :func:`kl_penalty` for the duration of the call and otherwise runs verl's own ``ppo_loss``. In the
  **loss** a ``klpo:NAME`` is :func:`klpo.losses.kl_loss`: every estimator but ``k3_is`` is
  weighted by the detached ``pi_theta / pi_old`` (the correction verl's KL loss lacks, which keeps
  the on-policy expected gradient for the 2nd and later mini-batches and epochs), ``k3_is`` uses
  ``pi_old`` in its own weight. verl's own ``agg_loss`` then reduces it with the policy loss's
  ``loss_agg_mode`` and global batch sizes, and verl adds ``kl_loss_coef ·`` it and logs it as
  ``kl_loss``: the call sites are verl's, only the per-token term is klpo's.

:func:`install` rebinds both names wherever verl imported them (``core_algos``,
``workers.utils.losses``, ``workers.engine_workers``, ``trainer.distillation.losses``, and any other
loaded ``verl.*`` module holding the original function); :func:`uninstall` restores them.

**Not available:** ``klpo:full``, the exact KL over the vocabulary. verl 0.9 computes token
log-probs in its engines and passes only those to both call sites (its own ``full`` raises
``NotImplementedError``); no logits reach ``kl_penalty``. Use ``klpo train`` for ``full``.

**Differences to know.** klpo estimates are float32 (verl computes in the input dtype);
``klpo:low_var_kl`` is verl's ``low_var_kl`` exactly. The off-policy weight corrects for pi_old
= the training engine's recomputed ``old_log_probs``; the rollout engine's mismatch is verl's
rollout correction's business (``rollout_is_weights``), which does not touch the KL term.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

try:
    import verl
    from verl.trainer.ppo import core_algos
    from verl.workers.utils import losses as verl_losses
except ImportError as err:  # pragma: no cover - exercised by a test that hides verl
    raise ImportError(
        "klpo.integrations.verl needs verl, an optional peer that klpo does not install. "
        "Install it with `pip install verl==0.9.1` (the version this integration is written "
        "against) in an environment of its own, or use klpo's own trainer (`klpo train`)."
    ) from err

from torch import Tensor

from klpo import kl, losses

__all__ = [
    "ESTIMATORS",
    "PREFIX",
    "TESTED_VERSIONS",
    "VERL_VERSION",
    "install",
    "installed",
    "kl_penalty",
    "klpo_name",
    "ppo_loss",
    "uninstall",
]

VERL_VERSION = "0.9.1"
TESTED_VERSIONS: tuple[str, ...] = ("0.7.1", "0.8.0", "0.9.1")
"""The verl releases the peer tests ran against (docs/frameworks.md, the version matrix); a
release between the oldest and the newest is taken as tested, another gets a warning."""
PREFIX = "klpo:"

#: The klpo estimators available in verl: those that work from token log-probs
#: (:data:`klpo.kl.LOGPROB_ESTIMATORS`; ``full`` needs logits that verl does not pass).
ESTIMATORS: Sequence[str] = kl.LOGPROB_ESTIMATORS


def _release(version: str) -> tuple[int, int]:
    major, _, rest = version.partition(".")
    minor = "".join(ch for ch in rest.partition(".")[0] if ch.isdigit())
    return int(major or 0), int(minor or 0)


if not (
    _release(TESTED_VERSIONS[0])
    <= _release(getattr(verl, "__version__", "0"))
    <= _release(TESTED_VERSIONS[-1])
):
    warnings.warn(
        f"klpo.integrations.verl is tested with verl {', '.join(TESTED_VERSIONS)}; this is verl "
        f"{getattr(verl, '__version__', '?')}. It rebinds verl's kl_penalty and ppo_loss: run "
        "klpo's peer tests (tests/integrations/test_verl.py) before trusting the results.",
        stacklevel=2,
    )

_VERL_KL_PENALTY: Callable[..., Tensor] = core_algos.kl_penalty
_VERL_PPO_LOSS: Callable[..., Any] = verl_losses.ppo_loss

# The batch's old log-probs, set by ppo_loss around verl's own ppo_loss (the one KL-loss call site).
_OLD_LOGPROB: contextvars.ContextVar[Tensor | None] = contextvars.ContextVar(
    "klpo_verl_old_logprob", default=None
)


def klpo_name(name: str) -> str | None:
    """The klpo estimator named by ``"klpo:NAME"``, None for verl's own names.

    Raises:
        ValueError: an unknown klpo name, or ``klpo:full`` (listing what is available).
    """
    if not isinstance(name, str) or not name.startswith(PREFIX):
        return None
    est = name[len(PREFIX) :]
    spec = kl.SPECS.get(est)
    if spec is not None and spec.needs_logits:
        raise ValueError(
            f"klpo:{est} (the exact KL over the vocabulary) is not available in verl: verl passes "
            "token log-probs, never logits, to kl_penalty. Use klpo:k3+ or klpo:k2 in the loss, "
            f"klpo:k1 in the reward, or `klpo train` for {est}"
        )
    if est not in ESTIMATORS:
        raise ValueError(
            f"unknown klpo estimator {est!r} in {name!r}; available in verl: "
            + ", ".join(PREFIX + n for n in ESTIMATORS)
        )
    return est


def kl_penalty(
    logprob: Tensor,
    ref_logprob: Tensor,
    kl_penalty: str,
    *,
    old_logprob: Tensor | None = None,
) -> Tensor:
    """verl's ``kl_penalty`` with klpo's estimators: ``[B, T]`` per-token KL term.

    Args:
        logprob: ``[B, T]`` log pi_theta of the sampled tokens (carries the gradient in the loss;
            verl's ``old_log_probs`` in the reward).
        ref_logprob: ``[B, T]`` log pi_ref.
        kl_penalty: ``"klpo:NAME"`` for klpo's estimator NAME; any other name is verl's own.
        old_logprob: ``[B, T]`` log pi_old, the sampling policy. Given (explicitly, or by
            :func:`ppo_loss` for the batch it is computing), the term is
            ``klpo.losses.kl_loss(NAME, logprob, ref_logprob, logp_old=old_logprob)``: weighted for
            off-policy tokens. None: ``klpo.kl.estimate`` on-policy (``k3_is`` with
            ``logp_old = logprob.detach()``).

    Returns:
        ``[B, T]`` float32, the per-token term verl reduces with ``agg_loss`` (loss) or subtracts
        from the reward.
    """
    est = klpo_name(kl_penalty)
    if est is None:
        return _VERL_KL_PENALTY(logprob, ref_logprob, kl_penalty)
    if old_logprob is None:
        pending = _OLD_LOGPROB.get()
        if pending is not None and pending.shape == logprob.shape:
            old_logprob = pending
    if old_logprob is not None:
        return losses.kl_loss(est, logprob, ref_logprob, logp_old=old_logprob.detach())
    return kl.estimate(est, logprob, ref_logprob, logp_old=logprob.detach())


def ppo_loss(config: Any, model_output: Any, data: Any, dp_group: Any = None) -> Any:
    """verl's ``ppo_loss``, with the batch's ``old_log_probs`` handed to a ``klpo:`` KL loss.

    Runs verl 0.9.1's own ``ppo_loss`` unchanged; when ``config.use_kl_loss`` and
    ``config.kl_loss_type`` is a ``klpo:`` name, the ``old_log_probs`` of ``data`` (padded as
    verl pads them for its policy loss) are visible to :func:`kl_penalty` for the duration of the
    call, so that verl's own KL call site gets :func:`klpo.losses.kl_loss`'s off-policy weight.
    """
    if not (getattr(config, "use_kl_loss", False) and klpo_name(config.kl_loss_type)):
        return _VERL_PPO_LOSS(config, model_output, data, dp_group)
    old = data.select("old_log_probs").to_padded_tensor()["old_log_probs"]
    token = _OLD_LOGPROB.set(old)
    try:
        return _VERL_PPO_LOSS(config, model_output, data, dp_group)
    finally:
        _OLD_LOGPROB.reset(token)


def _rebind(old: Callable[..., Any], new: Callable[..., Any]) -> list[str]:
    """Point every loaded ``verl.*`` module's reference to ``old`` at ``new``."""
    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "verl" or mod_name.startswith("verl.")):
            continue
        for attr, value in list(vars(mod).items()):
            if value is old:
                setattr(mod, attr, new)
                done.append(f"{mod_name}.{attr}")
    return done


def install() -> list[str]:
    """Route verl's ``kl_penalty`` and ``ppo_loss`` through klpo (idempotent).

    Imports verl's worker and trainer modules that hold these names (so that later imports see
    the rebinding too), then rebinds every reference. Returns the rebound ``module.name`` list.
    """
    import importlib

    for name in (
        "verl.trainer.ppo.ray_trainer",
        "verl.workers.engine_workers",
        "verl.trainer.distillation.losses",
    ):
        # Optional parts of verl (ray, vllm) may be missing; the rest is rebound regardless.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return _rebind(_VERL_KL_PENALTY, kl_penalty) + _rebind(_VERL_PPO_LOSS, ppo_loss)


def uninstall() -> list[str]:
    """Undo :func:`install`: verl's own functions everywhere again."""
    return _rebind(kl_penalty, _VERL_KL_PENALTY) + _rebind(ppo_loss, _VERL_PPO_LOSS)


def installed() -> bool:
    """Whether verl's ``core_algos.kl_penalty`` is klpo's."""
    return core_algos.kl_penalty is kl_penalty
