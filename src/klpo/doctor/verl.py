"""verl's KL settings (its Hydra YAML, or ``main_ppo`` command-line overrides), read for the doctor.

Defaults are verl 0.9's (``verl/trainer/config/ppo_trainer.yaml``, ``actor/actor.yaml``,
``rollout/rollout.yaml``, ``data/legacy_data.yaml``); what they mean is read from
``verl/trainer/ppo/core_algos.py`` (``kl_penalty``, ``agg_loss``, the advantage estimators),
``verl/trainer/ppo/ray_trainer.py`` (``apply_kl_penalty``) and ``verl/workers/utils/losses.py``
(``ppo_loss``). docs/frameworks.md has the table of names.
"""

from __future__ import annotations

from typing import Any

from klpo.doctor.advice import build_equivalent, build_intended
from klpo.doctor.reading import (
    DoctorError,
    Reading,
    Settings,
    Term,
    check_known,
    flatten,
    scalar,
    shell_words,
)
from klpo.train.algorithms import ALGORITHMS

__all__ = ["DEFAULTS", "ESTIMATOR_NAMES", "VERSION", "read", "read_text"]

VERSION = "0.9"

ACTOR = "actor_rollout_ref.actor"
DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    f"{ACTOR}.ppo_mini_batch_size": 256,
    f"{ACTOR}.ppo_epochs": 1,
    f"{ACTOR}.use_kl_loss": False,
    f"{ACTOR}.kl_loss_coef": 0.001,
    f"{ACTOR}.kl_loss_type": "low_var_kl",
    f"{ACTOR}.loss_agg_mode": "token-mean",
    f"{ACTOR}.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.rollout.n": 1,
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
}

# verl's estimator names -> klpo's (None: klpo has none / verl raises).
ESTIMATOR_NAMES: dict[str, str | None] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
    "kl+": "k1+",
    "k1+": "k1+",
    "abs+": "abs+",
    "mse+": "k2",
    "k2+": "k2",
    "low_var_kl+": "k3+",
    "k3+": "k3+",
    "full": None,
}

# loss_agg_mode -> klpo.reduce mode (None: klpo has none).
REDUCTIONS: dict[str, str | None] = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum-norm",
    "token-sum": None,
}

# adv_estimator -> (klpo algo name or None, how a reward-side per-token KL reaches the advantage)
ADVANTAGES: dict[str, tuple[str | None, str]] = {
    "gae": ("ppo", "per token, through GAE (gamma, lam), then batch-whitened"),
    "grpo": ("grpo", "summed over the completion into the score, then group-normalised"),
    "rloo": ("rloo", "summed over the completion into the score, then leave-one-out"),
    "reinforce_plus_plus": ("reinforce++", "per token, returns-to-go, then batch-whitened"),
    "reinforce_plus_plus_baseline": (
        None,
        "summed over the completion, group mean subtracted, then batch-whitened",
    ),
    "remax": (None, "summed over the completion, greedy baseline subtracted"),
}


def _clamps(name: str) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
    """(value clamp, log-ratio clamp) of verl's kl_penalty for ``name``."""
    base = name.rstrip("+")
    if base in ("low_var_kl", "k3"):
        return (-10.0, 10.0), (-20.0, 20.0)
    return None, None


def read_text(text: str, source: str) -> dict[str, Any]:
    """``key=value`` Hydra overrides from a ``main_ppo`` command line, as a flat mapping."""
    out: dict[str, Any] = {}
    for word in shell_words(text):
        if "=" not in word or word.startswith("-"):
            continue
        key, _, value = word.partition("=")
        key = key.lstrip("+~")
        if "." in key or key in ("algorithm", "data"):
            out[key] = scalar(value)
    if not out:
        raise DoctorError(
            f"{source}: no Hydra overrides (key=value) found; give verl's YAML, or the "
            "`python -m verl.trainer.main_ppo key=value ...` command line"
        )
    return out


def read(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a verl config (nested YAML or flat ``key=value`` overrides) into a :class:`Reading`."""
    s = Settings(flatten(data), DEFAULTS, source)
    r = Reading(framework="verl", defaults_version=VERSION, version=version, source=source)

    adv = s.str("algorithm.adv_estimator") or "gae"
    n = s.int("actor_rollout_ref.rollout.n") or 1
    epochs = s.int(f"{ACTOR}.ppo_epochs") or 1
    batch = s.int("data.train_batch_size") or 1
    mini = s.int(f"{ACTOR}.ppo_mini_batch_size") or batch
    minibatches = max(1, -(-batch // mini))
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * minibatches
    agg = check_known(
        s.str(f"{ACTOR}.loss_agg_mode") or "", REDUCTIONS, f"{ACTOR}.loss_agg_mode", source
    )
    norm_std = s.bool("algorithm.norm_adv_by_std_in_grpo")
    loss_mode = s.str(f"{ACTOR}.policy_loss.loss_mode")

    use_loss, use_reward = s.bool(f"{ACTOR}.use_kl_loss"), s.bool("algorithm.use_kl_in_reward")
    loss_type, reward_type = s.str(f"{ACTOR}.kl_loss_type"), s.str("algorithm.kl_penalty")
    loss_coef, ctrl_coef = s.float(f"{ACTOR}.kl_loss_coef"), s.float("algorithm.kl_ctrl.kl_coef")
    ctrl = s.str("algorithm.kl_ctrl.type")
    check_known(ctrl or "", ("fixed", "adaptive"), "algorithm.kl_ctrl.type", source)
    target, horizon = s.float("algorithm.kl_ctrl.target_kl"), s.float("algorithm.kl_ctrl.horizon")
    for key, name in ((f"{ACTOR}.kl_loss_type", loss_type), ("algorithm.kl_penalty", reward_type)):
        check_known(name or "", ESTIMATOR_NAMES, key, source)

    if use_loss:
        vclamp, lclamp = _clamps(loss_type or "")
        r.terms.append(
            Term(
                option=f"{ACTOR}.use_kl_loss=true, kl_loss_type={loss_type}",
                framework_name=loss_type or "",
                estimator=ESTIMATOR_NAMES[loss_type or ""],
                placement="loss",
                beta=float(loss_coef or 0.0),
                beta_option=f"{ACTOR}.kl_loss_coef",
                reduction=REDUCTIONS[agg] or agg,
                value_clamp=vclamp,
                log_ratio_clamp=lclamp,
                logged_as="actor/kl_loss",
            )
        )
    if use_reward:
        vclamp, lclamp = _clamps(reward_type or "")
        r.terms.append(
            Term(
                option=f"algorithm.use_kl_in_reward=true, kl_penalty={reward_type}",
                framework_name=reward_type or "",
                estimator=ESTIMATOR_NAMES[reward_type or ""],
                placement="reward",
                beta=float(ctrl_coef or 0.0),
                beta_option="algorithm.kl_ctrl.kl_coef",
                reduction=ADVANTAGES.get(adv, (None, "summed over the completion"))[1],
                value_clamp=vclamp,
                log_ratio_clamp=lclamp,
                logged_as="actor/reward_kl_penalty",
                adaptive=ctrl == "adaptive",
            )
        )

    # Findings: ignored, doubled, rejected, rescaled.
    for t in r.terms:
        if t.estimator is None:
            r.warn(
                "error",
                [t.option],
                f"verl's {t.framework_name!r} raises NotImplementedError in kl_penalty: the run "
                "stops at the first KL computation. klpo's `full` is the exact KL over the "
                "vocabulary (klpo train), which verl's trainer does not pass to kl_penalty",
            )
        if t.beta == 0:
            r.warn(
                "warning",
                [t.option, t.beta_option],
                f"{t.beta_option} is 0: the reference model is loaded and its log-probs computed, "
                "but the KL term has no effect",
            )
    if not use_loss:
        ignored = [k for k in (f"{ACTOR}.kl_loss_type", f"{ACTOR}.kl_loss_coef") if s.given(k)]
        if ignored:
            r.warn(
                "warning",
                ignored,
                f"set but ignored: {', '.join(ignored)} take effect only with {ACTOR}.use_kl_loss=true",
            )
    if not use_reward:
        ignored = [
            k
            for k in ("algorithm.kl_penalty", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.type")
            if s.given(k)
        ]
        if ignored:
            r.warn(
                "warning",
                ignored,
                f"set but ignored: {', '.join(ignored)} take effect only with "
                "algorithm.use_kl_in_reward=true (kl_ctrl never touches kl_loss_coef)",
            )
    elif ctrl == "adaptive" and use_loss:
        r.warn(
            "note",
            ["algorithm.kl_ctrl.type"],
            "the adaptive controller adapts only the reward-side coefficient; "
            f"{ACTOR}.kl_loss_coef stays fixed",
        )
    if use_loss and use_reward:
        r.warn(
            "warning",
            [f"{ACTOR}.use_kl_loss", "algorithm.use_kl_in_reward"],
            "the KL is applied twice: once as a per-token reward penalty "
            f"({reward_type}, beta {ctrl_coef:g}) and once in the loss ({loss_type}, beta "
            f"{loss_coef:g}); verl only prints a notice",
        )
    if use_reward and adv in ("grpo", "rloo", "reinforce_plus_plus_baseline", "remax"):
        if adv == "grpo" and norm_std:
            r.group_scaling = (
                "the per-token penalty is summed over each completion into the score, the group "
                "mean is subtracted and the result divided by the group's std (+1e-6): the "
                f"effective coefficient is {ctrl_coef:g} / std(score of the group), different in "
                "every group and largest where the task reward barely varies; only differences "
                "of sequence-summed KL within a group remain, and every token of a completion "
                "gets its whole KL (no per-token credit)"
            )
        else:
            r.group_scaling = (
                "the per-token penalty is summed over each completion into the score and a "
                "baseline from the group is subtracted: only differences of sequence-summed KL "
                "within a group remain, and every token of a completion gets its whole KL"
            )
        r.warn(
            "warning", ["algorithm.use_kl_in_reward", "algorithm.adv_estimator"], r.group_scaling
        )
    if agg == "token-sum":
        r.warn(
            "note",
            [f"{ACTOR}.loss_agg_mode"],
            "token-sum has no klpo reduction (klpo always normalises); the equivalent uses token-mean",
        )
    if loss_mode not in (None, "vanilla"):
        r.warn(
            "note",
            [f"{ACTOR}.policy_loss.loss_mode"],
            f"policy loss {loss_mode!r} is not klpo's PPO clip; the KL diagnosis holds, the "
            "equivalent config's policy loss differs",
        )
    if r.off_policy and use_loss:
        r.warn(
            "warning",
            [f"{ACTOR}.ppo_epochs", "data.train_batch_size", f"{ACTOR}.ppo_mini_batch_size"],
            f"{r.updates_per_batch} optimiser steps per batch of rollouts ({epochs} epoch(s) × "
            f"{minibatches} mini-batch(es)): from the second on, the KL loss sees tokens sampled "
            "by an older policy, and verl does not weight it for that",
        )

    # The klpo configs.
    algo_name, _ = ADVANTAGES.get(adv, (None, ""))
    algo: dict[str, Any] = {
        "name": algo_name or "grpo",
        "epochs": epochs,
        "minibatches": minibatches,
        "loss_reduction": REDUCTIONS[agg] or "token-mean",
    }
    if algo_name == "grpo":
        algo["std"] = "sample" if norm_std else "none"
    if algo_name == "ppo":
        algo["gamma"], algo["lam"] = s.float("algorithm.gamma"), s.float("algorithm.lam")
    if algo_name is None:
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if use_reward and algo_name in ("grpo",):
        r.equivalent_differences.append(
            "klpo's grpo keeps a reward-side KL out of the group normalisation (per-token "
            "returns-to-go); verl sums it into the group-normalised score"
        )
    group = ALGORITHMS[algo["name"]].group
    rollout = {"group_size": max(n, 2) if group else n}
    if n < 2 and group:
        r.equivalent_differences.append(
            f"actor_rollout_ref.rollout.n={n}: klpo needs a group of at least 2 for {algo['name']}"
        )
    controller: dict[str, Any] = {}
    if use_reward and ctrl == "adaptive":
        controller = {"controller": "adaptive", "target": target, "horizon": horizon}
    build_equivalent(r, algo, rollout, controller)
    build_intended(r)
    r.settings = s.read
    return r
