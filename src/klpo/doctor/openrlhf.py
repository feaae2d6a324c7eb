"""OpenRLHF's ``train_ppo_ray`` command-line arguments, read for the doctor.

Both spellings are accepted: the flat flags (``--init_kl_coef``, ``--kl_estimator``,
``--use_kl_loss``, ``--advantage_estimator``, ...) and the grouped ones (``--algo.kl.init_coef``,
``--algo.kl.estimator``, ``--algo.kl.use_loss``, ``--algo.advantage.estimator``, ...). Defaults
are OpenRLHF 0.11's (``openrlhf/cli/train_ppo_ray.py``); what they mean is read from
``openrlhf/models/utils.py`` (``compute_approx_kl``: every estimator's value clamped to
[-10, 10]; ``compute_reward``), ``openrlhf/trainer/ppo_utils/experience_maker.py`` (the KL is
added per token after the scalar reward shaping) and ``openrlhf/trainer/ray/ppo_actor.py`` (the
KL loss, a token mean; the reward-side KL zeroed when it is on).
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
    scalar,
    shell_words,
)
from klpo.train.algorithms import ALGORITHMS

__all__ = ["DEFAULTS", "FLAGS", "VERSION", "parse_args", "read"]

VERSION = "0.11"

# canonical name -> (flat flag, grouped flag)
FLAGS: dict[str, tuple[str, str]] = {
    "init_kl_coef": ("--init_kl_coef", "--algo.kl.init_coef"),
    "kl_estimator": ("--kl_estimator", "--algo.kl.estimator"),
    "use_kl_loss": ("--use_kl_loss", "--algo.kl.use_loss"),
    "kl_target": ("--kl_target", "--algo.kl.target"),
    "kl_horizon": ("--kl_horizon", "--algo.kl.horizon"),
    "advantage_estimator": ("--advantage_estimator", "--algo.advantage.estimator"),
    "no_advantage_std_norm": ("--no_advantage_std_norm", "--algo.advantage.no_std_norm"),
    "max_epochs": ("--max_epochs", "--train.max_epochs"),
    "n_samples_per_prompt": ("--n_samples_per_prompt", "--rollout.n_samples_per_prompt"),
    "rollout_batch_size": ("--rollout_batch_size", "--rollout.batch_size"),
    "train_batch_size": ("--train_batch_size", "--train.batch_size"),
    "gamma": ("--gamma", "--algo.advantage.gamma"),
    "lambd": ("--lambd", "--algo.advantage.lambd"),
}
SWITCHES = {"use_kl_loss", "no_advantage_std_norm"}

DEFAULTS: dict[str, Any] = {
    "init_kl_coef": 0.01,
    "kl_estimator": "k1",
    "use_kl_loss": False,
    "kl_target": None,
    "kl_horizon": 10000,
    "advantage_estimator": "gae",
    "no_advantage_std_norm": False,
    "max_epochs": 1,
    "n_samples_per_prompt": 1,
    "rollout_batch_size": 1024,
    "train_batch_size": 128,
    "gamma": 1.0,
    "lambd": 0.95,
}

ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}

# advantage estimator -> (klpo algo, how the per-token reward-side KL reaches the advantage)
ADVANTAGES: dict[str, tuple[str | None, str]] = {
    "gae": ("ppo", "per token, through GAE, then batch-whitened"),
    "reinforce": ("reinforce++", "per token, returns-to-go, then batch-whitened"),
    "reinforce_baseline": (None, "per token, returns-to-go, then batch-whitened"),
    "rloo": ("rloo", "per token, returns-to-go, after the leave-one-out shaping of the score"),
    "group_norm": ("grpo", "per token, returns-to-go, after the group normalisation of the score"),
    "dr_grpo": ("grpo", "per token, returns-to-go, after the group mean is subtracted"),
}

_BY_FLAG = {flag: name for name, flags in FLAGS.items() for flag in flags}


def parse_args(text: str, source: str) -> dict[str, Any]:
    """The flags this reader knows, from a command line (other flags are skipped)."""
    words = shell_words(text)
    out: dict[str, Any] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        name = _BY_FLAG.get(flag)
        if name is None:
            continue
        if name in SWITCHES:
            out[name] = True if not eq else scalar(value)
            continue
        if not eq:
            if i >= len(words) or words[i].startswith("--"):
                raise DoctorError(f"{source}: {flag} needs a value, e.g. {flag} {DEFAULTS[name]}")
            value = words[i]
            i += 1
        out[name] = scalar(value)
    return out


def read(args: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read OpenRLHF's arguments (from :func:`parse_args`) into a :class:`Reading`."""
    s = Settings(args, DEFAULTS, source)
    r = Reading(framework="openrlhf", defaults_version=VERSION, version=version, source=source)
    coef = s.float("init_kl_coef") or 0.0
    name = check_known(s.str("kl_estimator") or "", ESTIMATORS, "--kl_estimator", source)
    use_loss = s.bool("use_kl_loss")
    target, horizon = s.float("kl_target"), s.float("kl_horizon")
    adv = check_known(
        s.str("advantage_estimator") or "", ADVANTAGES, "--advantage_estimator", source
    )
    no_std = s.bool("no_advantage_std_norm")
    epochs = s.int("max_epochs") or 1
    n = s.int("n_samples_per_prompt") or 1
    rollout_batch, train_batch = s.int("rollout_batch_size") or 1, s.int("train_batch_size") or 1
    steps = max(1, (rollout_batch * n) // train_batch)
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps

    if coef > 0:
        r.terms.append(
            Term(
                option=("--use_kl_loss, " if use_loss else "") + f"--kl_estimator {name}",
                framework_name=name,
                estimator=ESTIMATORS[name],
                placement="loss" if use_loss else "reward",
                beta=coef,
                beta_option="--init_kl_coef",
                reduction="token-mean" if use_loss else ADVANTAGES[adv][1],
                value_clamp=(-10.0, 10.0),
                logged_as="kl",
                adaptive=target is not None,
            )
        )
        recommended = ("k2", "k3") if use_loss else ("k1",)
        if name not in recommended:
            r.warn(
                "warning",
                ["--kl_estimator"],
                f"{name} in the {'loss' if use_loss else 'reward'}: OpenRLHF itself only prints a "
                f"recommendation ({' or '.join(recommended)}); see the gradient below",
            )
        if use_loss:
            r.warn(
                "note",
                ["--use_kl_loss"],
                "with the KL in the loss the reward-side KL is zeroed (not applied twice); the KL "
                "loss is always a token mean, whatever the policy loss's aggregation",
            )
        if target is not None:
            r.warn(
                "warning" if use_loss else "note",
                ["--kl_target", "--kl_horizon"],
                "the adaptive controller's coefficient"
                + (" is also the KL-loss coefficient" if use_loss else " scales the reward KL")
                + f" (target {target:g} per token, horizon {horizon:g}); OpenRLHF's own code marks "
                "the adaptive controller as not meant for this trainer",
            )
    else:
        ignored = [k for k in ("kl_estimator", "use_kl_loss", "kl_target") if s.given(k)]
        r.warn(
            "warning" if ignored else "note",
            ["--init_kl_coef", *ignored],
            "--init_kl_coef is 0: no reference model, no KL term"
            + (f"; {', '.join(FLAGS[k][0] for k in ignored)} ignored" if ignored else ""),
        )
    if coef > 0 and not use_loss and adv in ("group_norm", "dr_grpo", "rloo"):
        r.warn(
            "note",
            ["--advantage_estimator"],
            "the KL is added per token after the score's group shaping, so the group's std does "
            "not rescale beta; each token is charged the KL of itself and every later token "
            "(returns-to-go)",
        )
    if r.off_policy and coef > 0 and use_loss:
        r.warn(
            "warning",
            ["--max_epochs", "--rollout_batch_size", "--train_batch_size"],
            f"{r.updates_per_batch} optimiser steps per rollout batch: from the second on the KL "
            "loss sees tokens sampled by an older policy, and OpenRLHF does not weight it for that",
        )

    algo_name, _ = ADVANTAGES[adv]
    algo: dict[str, Any] = {
        "name": algo_name or "reinforce++",
        "epochs": epochs,
        "minibatches": steps,
        "loss_reduction": "token-mean",
    }
    if algo_name == "grpo":
        algo["std"] = "none" if (adv == "dr_grpo" or no_std) else "sample"
    if algo_name == "ppo":
        algo["gamma"], algo["lam"] = s.float("gamma"), s.float("lambd")
    if algo_name is None:
        r.equivalent_differences.append(
            f"klpo has no advantage estimator {adv!r}; reinforce++ shown"
        )
    if coef > 0 and not use_loss and algo_name in ("grpo", "rloo"):
        r.equivalent_differences.append(
            "klpo's rloo sums a reward-side KL into the leave-one-out score; OpenRLHF adds it per "
            "token after the shaping"
            if algo_name == "rloo"
            else "same credit as klpo's grpo: the KL's returns-to-go added after the group "
            "normalisation"
        )
    rollout = {"group_size": max(n, 2) if ALGORITHMS[algo["name"]].group else n}
    controller: dict[str, Any] = {}
    if target is not None and coef > 0:
        controller = {"controller": "adaptive", "target": target, "horizon": horizon}
    build_equivalent(r, algo, rollout, controller)
    build_intended(r)
    r.settings = s.read
    return r
