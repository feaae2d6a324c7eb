r"""KL coefficient controllers: how beta changes between updates.

Each controller holds the current coefficient in ``.value`` and changes it in
``update(*, kl=None, n_steps=1, reward_std=None)``, called once after each rollout batch (the new
value is used for the *next* update, as in PPO §4). ``state_dict()`` / ``load_state_dict()`` save
and restore the mutable state (the current value); the hyper-parameters come from the
configuration, so a resumed run continues exactly.

| name              | class               | rule |
| ----------------- | ------------------- | ---- |
| ``fixed``         | :class:`FixedKL`        | beta stays |
| ``adaptive``      | :class:`AdaptiveKL`     | Ziegler et al. 2019: beta *= 1 + clip(KL/target - 1, ±0.2) · n_steps / horizon |
| ``ppo-adaptive``  | :class:`PPOAdaptiveKL`  | PPO §4: halve below target/1.5, double above target · 1.5 |
| ``spread-scaled`` | :class:`SpreadScaledKL` | beta = beta0 / (1 + reward_std / scale): less KL where the group's rewards disagree |

``kl`` is whatever per-update KL the coefficient is meant to hold near its target: in PPO's paper
the KL to pi_old, in Ziegler et al. and verl's reward path the KL to pi_ref (per token in verl,
target 0.1; per sequence in Ziegler's code and legacy TRL, target 6 nats). Pass it as a float.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

__all__ = [
    "CONTROLLERS",
    "AdaptiveKL",
    "FixedKL",
    "KLController",
    "PPOAdaptiveKL",
    "SpreadScaledKL",
    "make_controller",
]


def _finite(name: str, x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _positive(name: str, x: Any) -> float:
    v = _finite(name, x)
    if v <= 0:
        raise ValueError(f"{name} must be > 0, got {v}")
    return v


class KLController:
    """The interface: ``.value``, ``update(...)``, ``state_dict()``, ``load_state_dict()``."""

    name: ClassVar[str] = ""
    value: float

    def update(
        self, *, kl: float | None = None, n_steps: int = 1, reward_std: float | None = None
    ) -> float:
        """Update ``value`` from the last batch's statistics; returns the new value."""
        raise NotImplementedError

    def _last_kl(self, kl: float | None) -> float:
        """The last KL, which this controller's update needs (a finite number)."""
        if kl is None:
            raise ValueError(f"the {self.name} KL controller needs update(kl=...), the last KL")
        return _finite("kl", kl)

    def state_dict(self) -> dict[str, Any]:
        """``{"name": ..., "value": ...}``: what changes during training."""
        return {"name": self.name, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the controller kind must match."""
        if not isinstance(state, dict) or "value" not in state or "name" not in state:
            raise ValueError(
                f"a KL controller state must be a dict with 'name' and 'value', got {state!r}"
            )
        if state["name"] != self.name:
            raise ValueError(
                f"this state is of a {state['name']!r} controller, not {self.name!r}; "
                "the run's kl controller setting changed since the checkpoint"
            )
        value = _finite("value", state["value"])
        if value < 0:
            raise ValueError(f"value must be >= 0, got {value}")
        self.value = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(value={self.value!r})"


class FixedKL(KLController):
    """A constant coefficient: ``update`` changes nothing."""

    name = "fixed"

    def __init__(self, beta: float) -> None:
        self.value = _finite("beta", beta)
        if self.value < 0:
            raise ValueError(f"beta must be >= 0, got {self.value}")

    def update(
        self, *, kl: float | None = None, n_steps: int = 1, reward_std: float | None = None
    ) -> float:
        return self.value


class AdaptiveKL(KLController):
    r"""Ziegler et al. 2019's log-space proportional controller (arXiv:1909.08593, §2.2).

        e = clip(KL / target - 1, -0.2, 0.2)
        beta <- beta · (1 + e · n_steps / horizon)

    exactly as in the official code (``lm-human-preferences``, ``train_policy.py``), verl's and
    OpenRLHF's ``AdaptiveKLController`` and legacy TRL's (defaults there: beta 0.2, target 6 nats
    per sequence, horizon 10000 episodes, ``n_steps`` = episodes in the batch). Example: beta 0.2,
    target 6, horizon 10000, n_steps 64, KL 9: e = 0.5 → 0.2, beta = 0.2 · 1.00128 = 0.200256.

    Args:
        beta: the initial coefficient, > 0.
        target: the KL to hold, > 0.
        horizon: the number of steps over which a full ±20% correction is spread, > 0.
    """

    name = "adaptive"

    def __init__(self, beta: float, *, target: float, horizon: float = 10000) -> None:
        self.value = _positive("beta", beta)
        self.target = _positive("target", target)
        self.horizon = _positive("horizon", horizon)

    def update(
        self, *, kl: float | None = None, n_steps: int = 1, reward_std: float | None = None
    ) -> float:
        kl_ = self._last_kl(kl)
        steps = _finite("n_steps", n_steps)
        if steps < 0:
            raise ValueError(f"n_steps must be >= 0, got {n_steps}")
        error = min(max(kl_ / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + error * steps / self.horizon
        if mult <= 0:
            raise ValueError(
                f"n_steps / horizon = {steps / self.horizon:g} makes the multiplier {mult:g} <= 0; "
                "n_steps must be at most 5 horizons (usually far less)"
            )
        self.value *= mult
        return self.value


class PPOAdaptiveKL(KLController):
    r"""The adaptive penalty of PPO (Schulman et al. 2017, arXiv:1707.06347, §4).

        if KL < target / tolerance:  beta <- beta / factor
        if KL > target · tolerance:  beta <- beta · factor

    with ``tolerance = 1.5`` and ``factor = 2`` ("chosen heuristically, but the algorithm is not
    very sensitive to them"). Example, target 0.01: KL 0.005 halves beta, KL 0.02 doubles it, KL
    0.012 leaves it. In the paper KL is KL(pi_old ‖ pi_theta), for
    :func:`klpo.losses.ppo_kl_penalty`.

    Args:
        beta: the initial coefficient, > 0 (the paper starts at 1).
        target: d_targ, > 0.
        tolerance: > 1.
        factor: > 1.
    """

    name = "ppo-adaptive"

    def __init__(
        self, beta: float, *, target: float, tolerance: float = 1.5, factor: float = 2.0
    ) -> None:
        self.value = _positive("beta", beta)
        self.target = _positive("target", target)
        self.tolerance = _finite("tolerance", tolerance)
        self.factor = _finite("factor", factor)
        if self.tolerance <= 1:
            raise ValueError(f"tolerance must be > 1, got {self.tolerance}")
        if self.factor <= 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")

    def update(
        self, *, kl: float | None = None, n_steps: int = 1, reward_std: float | None = None
    ) -> float:
        kl_ = self._last_kl(kl)
        if kl_ < self.target / self.tolerance:
            self.value /= self.factor
        elif kl_ > self.target * self.tolerance:
            self.value *= self.factor
        return self.value


class SpreadScaledKL(KLController):
    r"""beta shrinks as the group's reward spread grows: ``beta = beta0 / (1 + reward_std / scale)``.

    The follow-up in the project's seed text (000, follow-up 3): "dynamically adjust beta,
    scaling the KL penalty by the variance of the group's rewards: a large variance lowers beta,
    encouraging exploration". No paper gives a rule; this one is klpo's choice, for these reasons:

    - ``reward_std = 0`` (every completion of every prompt scored alike, nothing to learn from)
      gives the full ``beta0``: the KL term is all the gradient there is;
    - it decreases smoothly and monotonically in the spread, stays in ``(0, beta0]`` and never
      reaches zero, so the regulariser never switches off;
    - ``reward_std = scale`` halves beta; for ``reward_std >> scale``, ``beta · reward_std ->
      beta0 · scale``: the penalty shrinks in proportion to the reward differences it competes with
      when advantages are not std-normalised (Dr. GRPO, RLOO);
    - it is stateless: the value depends on the last batch only (no drift, nothing to tune but
      ``scale``, which has the reward's units: e.g. 0.5 for 0/1 rewards, whose largest sample std
      in a group of G is about 0.5).

    ``reward_std`` is the mean over prompts of the per-prompt reward standard deviation,
    ``klpo.advantages.group_std(rewards, G).mean()``. Before the first update the value is
    ``beta0``. Related, but a different rule: FG-ExPO (arXiv:2605.11403, abstract only read)
    scales the KL by a function of the batch's mean accuracy.

    Args:
        beta: beta0, the coefficient at zero spread, >= 0.
        scale: the spread at which beta is halved, > 0.
    """

    name = "spread-scaled"

    def __init__(self, beta: float, *, scale: float) -> None:
        self.beta0 = _finite("beta", beta)
        if self.beta0 < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta0}")
        self.scale = _positive("scale", scale)
        self.value = self.beta0

    def update(
        self, *, kl: float | None = None, n_steps: int = 1, reward_std: float | None = None
    ) -> float:
        if reward_std is None:
            raise ValueError(
                "the spread-scaled KL controller needs update(reward_std=...), the mean per-prompt "
                "reward std (klpo.advantages.group_std(rewards, G).mean())"
            )
        spread = _finite("reward_std", reward_std)
        if spread < 0:
            raise ValueError(f"reward_std must be >= 0, got {spread}")
        self.value = self.beta0 / (1.0 + spread / self.scale)
        return self.value


CONTROLLERS: dict[str, type[KLController]] = {
    cls.name: cls for cls in (FixedKL, AdaptiveKL, PPOAdaptiveKL, SpreadScaledKL)
}


def make_controller(name: str, **kwargs: Any) -> KLController:
    """Build a controller by name: ``make_controller("adaptive", beta=0.1, target=6.0)``.

    Raises:
        ValueError: for an unknown name (listing the valid ones) or arguments the controller
            does not take or needs (listing its parameters).
    """
    try:
        cls = CONTROLLERS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown KL controller {name!r}; choose one of: {', '.join(CONTROLLERS)}"
        ) from None
    sig = inspect.signature(cls.__init__)
    params = [p for p in sig.parameters if p != "self"]
    try:
        sig.bind(None, **kwargs)
    except TypeError as err:
        raise ValueError(f"KL controller {name!r} takes {', '.join(params)}: {err}") from None
    return cls(**kwargs)
