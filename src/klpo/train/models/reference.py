r"""Reference management: move the reference pi_ref to the policy during training.

``kl.reference_reset`` (:class:`klpo.train.config.ReferenceReset`) updates the frozen reference
every ``every`` steps and/or whenever the exact per-token KL(pi_theta ‖ pi_ref) of the step's
rollout exceeds ``kl_above``:

    pi_ref ← alpha · pi_theta + (1 - alpha) · pi_ref          (parameter by parameter)

- ``alpha = 1``: a **hard reset**, the reference becomes a copy of the current policy, so the KL
  term restarts from 0 and constrains only the moves since the reset (ProRL, Liu et al. 2025,
  arXiv:2505.24864, which also resets the optimizer state: ``reset_optimizer``);
- ``0 < alpha < 1``: a **soft update**, an exponential moving average of the policy's weights
  (TR-DPO, Gorbatovski et al. 2024, arXiv:2404.09656, "soft update", their alpha).

The update is applied after the step's optimizer steps and logged (``reference/updates``, the
count so far); the step's own KL metrics are those before it. The reference's weights are saved
in every checkpoint of such a run (``reference.safetensors``) so that a resumed run continues
with the moved reference.

With LoRA, where the reference is the policy with its adapters disabled
(:class:`klpo.train.models.lora.AdapterFreeReference`), a hard reset is merge-and-restart
(:func:`klpo.train.models.lora.merge_and_restart`): ``W ← W + (alpha_lora / r) · B A`` in every adapted
layer, then fresh adapters (``B = 0``); the policy's function is unchanged and the base, the
reference, becomes it. Merge-and-restart rather than a copied adapter as the reference: one set of
weights, a reference forward that stays the plain base, and a policy that may move more than rank
r from its start over several resets. The adapters' optimizer state is always cleared (Adam
moments of the old adapters do not fit fresh ones), the fresh ``A`` is drawn from a generator
seeded by the run seed and the update count (every DDP rank, and a resumed run, draw the same),
and the merged base is what ``reference.safetensors`` holds. A soft update has no adapter-only
form: ``alpha < 1`` with ``model.lora`` is refused at config time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from klpo.train.models.lora import merge_and_restart, restart_generator

__all__ = ["ResetFn", "merge_reset", "reset_due", "update_reference", "weight_reset"]


@torch.no_grad()
def update_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    r"""``ref ← alpha · policy + (1 - alpha) · ref`` for every parameter, in place.

    ``alpha = 1`` copies the policy (a hard reset). Both modules must have the same parameter
    names and shapes (the reference loaded from the policy's starting point); the arithmetic is
    done in float32 (or wider) and cast back to the reference's dtype. Gradients are off.

    Raises:
        ValueError: ``alpha`` outside (0, 1], or the two modules' parameters differ.
    """
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    ref = dict(reference.named_parameters())
    pol = dict(policy.named_parameters())
    if ref.keys() != pol.keys() or any(ref[k].shape != pol[k].shape for k in ref):
        missing = sorted(set(ref) ^ set(pol))[:3]
        raise ValueError(
            "kl.reference_reset needs the reference to be the same model as the policy "
            f"(same parameter names and shapes); they differ (e.g. {missing or 'in shapes'}). "
            "Leave model.reference unset, so that the reference starts as the policy"
        )
    for k, r in ref.items():
        wide = torch.promote_types(r.dtype, torch.float32)
        p = pol[k].detach().to(device=r.device, dtype=wide)
        # One formula for both: at alpha = 1, 1·p + 0·r is p exactly (a hard reset).
        r.copy_((alpha * p + (1.0 - alpha) * r.to(wide)).to(r.dtype))


def reset_due(reset: Any, step: int, kl_exact: float) -> bool:
    """Whether the reference is updated after ``step``: every ``reset.every`` steps (0: never by
    count) or when the step's exact per-token KL exceeds ``reset.kl_above`` (None: never)."""
    by_count = bool(reset.every) and step % reset.every == 0
    by_kl = reset.kl_above is not None and kl_exact > reset.kl_above
    return by_count or by_kl


ResetFn = Callable[[int], None]
"""Move the reference to the policy, given the number of updates made so far."""


def weight_reset(
    reference: nn.Module,
    policy: nn.Module,
    alpha: float,
    clear_optimizer: Callable[[], None] | None,
) -> ResetFn:
    """The reset of a reference that is a model of its own: :func:`update_reference` (``alpha``),
    then ``clear_optimizer`` if given (``reset_optimizer``, ProRL)."""

    def reset(updates: int) -> None:
        update_reference(reference, policy, alpha)
        if clear_optimizer is not None:
            clear_optimizer()

    return reset


def merge_reset(policy: nn.Module, seed: int, clear_optimizer: Callable[[], None]) -> ResetFn:
    """The reset of a LoRA policy's reference, its base: merge-and-restart
    (:func:`klpo.train.models.lora.merge_and_restart`), the fresh adapters drawn from the run's
    seed and the update count, and the optimizer cleared (the old moments do not apply)."""

    def reset(updates: int) -> None:
        merge_and_restart(policy, restart_generator(seed, updates))
        clear_optimizer()

    return reset
