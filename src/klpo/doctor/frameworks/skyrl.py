"""SkyRL's launch scripts (``skyrl.train.entrypoints.main_base key=value ...``), read for the doctor.

Pinned: NovaSky-AI/SkyRL main at ``a956457`` (2026-08-21; the ``skyrl`` package 0.3.0). Defaults
are its config dataclasses' (``skyrl/train/config/config.py``): ``trainer.algorithm``
``advantage_estimator`` grpo (:823), ``kl_estimator_type`` k3 (:828), ``use_kl_in_reward`` false
(:830), ``use_kl_loss`` **true** (:833), ``kl_loss_coef`` 0.001 (:836); ``trainer``
``update_epochs_per_batch`` 1 (:1387), ``train_batch_size`` 1024 (:1390), ``policy_mini_batch_size``
256 (:1396: train_batch_size / policy_mini_batch_size optimiser steps per epoch); ``generator``
``n_samples_per_prompt`` 5 (:1225), ``sampling_params.max_generate_length`` 1024 (:999).

What they do: ``skyrl/backends/skyrl_train/utils/ppo_utils.py:88-125`` (``compute_approx_kl``: k1
= d, abs, k2 = d²/2, k3 with log-ratio clamped to ±20 and value to ±10, verl's ``low_var_kl``) and
``workers/worker.py:1069-1080`` (the KL loss: a token mean per sequence, then the batch mean, times
``kl_loss_coef``; in the reward, ``rewards − kl · kl_loss_coef``). Keys: SkyRL builds its config
dataclasses key by key and refuses an unknown key (``config.py:1564-1573``) or a ``+key``
(``:1788-1794``), checked here against the version's table (read from the dataclasses by
:mod:`klpo.doctor.tables`); the two KL switches together fail an assertion
(``utils/utils.py:312-314``). Version trap: from PR #137 (2025-08-14) to PR #1353 (commit
``9d7bca9``, 2026-03-20) ``compute_approx_kl`` ran under ``@torch.no_grad``: in ``skyrl-train``
0.1.0 to 0.4.0 and ``skyrl`` 0.1.0 the KL loss has **no gradient at all**; ``skyrl`` 0.2.0
(2026-04-22) and later have it.

On-policy distillation (``examples/train/on_policy_distillation/``, its own entry point
``main_on_policy_distill.py`` over ``main_base``'s config): the example's trainer overrides
``apply_reward_kl_penalty``, which the base trainer calls only with ``use_kl_in_reward``
(``skyrl/train/trainer.py:428-430``), to set each token's reward to -(log pi_theta - log pi_T)
of the sampled token, the teacher being the reference model (``trainer.ref.model.path``, which
defaults to the policy's own path, ``config.py:1504-1505``): the task reward is replaced, and
``kl_loss_coef``, ``kl_estimator_type`` and ``kl_ctrl`` are not read (coefficient 1, k1). Its
``no_op`` advantage estimator passes the per-token rewards through as the advantages (discount
0); the examples use ``policy_loss_type=importance_sampling`` (``ppo_utils.py:1095-1139``: the
ratio to the rollout-time log-probs times the advantage, unclipped); ``advantage_batch_normalize``
whitens the advantages afterwards (``trainer.py:1477-1482``). The example's README launches it with
``trainer.ref.mode.path=...``, a key SkyRL refuses (``mode`` for ``model``).
"""

from __future__ import annotations

import re
from typing import Any

from klpo.doctor import distill, tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.keys import check_keys
from klpo.doctor.launch import framework_command, script_notes
from klpo.doctor.reading import Reading, Settings, Term, check_known, scalar
from klpo.doctor.tables import version_key

__all__ = ["DEFAULTS", "OPD_OVERRIDDEN", "VERSION", "is_opd_entry", "no_gradient_version", "read"]

VERSION = "0.3.0"
A = "trainer.algorithm"
DEFAULTS: dict[str, Any] = {
    f"{A}.advantage_estimator": "grpo",
    f"{A}.kl_estimator_type": "k3",
    f"{A}.use_kl_in_reward": False,
    f"{A}.use_kl_loss": True,
    f"{A}.kl_loss_coef": 0.001,
    f"{A}.policy_loss_type": "regular",
    f"{A}.loss_reduction": "token_mean",
    "trainer.update_epochs_per_batch": 1,
    "trainer.train_batch_size": 1024,
    "trainer.policy_mini_batch_size": 256,
    "generator.n_samples_per_prompt": 5,
    "generator.sampling_params.max_generate_length": 1024,
    "generator.sampling_params.temperature": 1.0,
    "trainer.policy.model.path": None,
    "trainer.policy.optimizer_config.lr": None,
    "trainer.max_prompt_length": None,
}
ESTIMATORS = {"k1": "k1", "abs": "abs", "k2": "k2", "k3": "low_var_kl"}
ADVANTAGES = {"grpo": "grpo", "rloo": "rloo", "reinforce++": "reinforce++", "gae": "ppo"}
CARRIED = [
    ("trainer.policy.model.path", "model.policy"),
    ("trainer.train_batch_size", "rollout.prompts_per_step"),
    ("generator.sampling_params.max_generate_length", "rollout.max_new_tokens"),
    ("generator.sampling_params.temperature", "rollout.temperature"),
    ("trainer.max_prompt_length", "data.max_prompt_tokens"),
    ("trainer.policy.optimizer_config.lr", "optim.lr"),
]


# The settings the OPD example's apply_reward_kl_penalty never reads (it sets the reward itself).
OPD_OVERRIDDEN = (f"{A}.kl_loss_coef", f"{A}.kl_estimator_type", f"{A}.kl_ctrl.type")


def is_opd_entry(name: str) -> bool:
    """Whether a training command's entry point is SkyRL's on-policy distillation example
    (``examples/train/on_policy_distillation/main_on_policy_distill.py``, before the ``train/``
    folder ``examples/on_policy_distillation/``), as a module or a path."""
    return re.search(r"on_policy_distillation[./]main_on_policy_distill(\.py)?$", name) is not None


def no_gradient_version(version: str) -> bool:
    """Whether a named SkyRL version runs its KL loss under ``torch.no_grad``."""
    v = version.removeprefix("skyrl-train-").removeprefix("skyrl_train-")
    if version.startswith(("skyrl-train", "skyrl_train")):
        return version_key(v) <= version_key("0.4.0")
    return version_key(v) < version_key("0.2.0")


def read(doc: Any, version: str | None = None) -> Reading:
    """Read a SkyRL launch script's ``main_base`` command and its ``key=value`` overrides."""
    source = doc.source
    script, ep = framework_command(doc, "skyrl", "SkyRL `main_base`")
    from klpo.doctor.frameworks import ROWS

    values, added = {}, []
    for w in ep.arguments:
        key, eq, value = w.partition("=")
        if eq and not key.startswith("-"):
            if key.startswith("+"):
                added.append(key)
            values[key.lstrip("+")] = scalar(value)
    r = Reading(framework="skyrl", defaults_version=VERSION, version=version, source=source)
    script_notes(r, script)
    if added:
        r.warn(
            "error",
            added,
            f"{', '.join(added)}: SkyRL refuses the '+' prefix for adding a config field "
            "(config.py:1788-1794, from_cli_overrides) and does not start; subclass the config "
            "dataclass to add one",
            kind="refused",
        )
    table = tables.load("skyrl", VERSION).defaults
    r.defaults_from = (
        f"the doctor's table of SkyRL {VERSION}'s config dataclasses (klpo/assets/doctor)"
    )
    values = check_keys(r, values, table, "SkyRL", VERSION, ROWS["skyrl"].policy)
    s = Settings(values, {**table, **DEFAULTS}, source)
    adv = s.str(f"{A}.advantage_estimator") or "grpo"  # a registry: custom names too
    kind = check_known(
        s.str(f"{A}.kl_estimator_type") or "", ESTIMATORS, f"{A}.kl_estimator_type", source
    )
    use_loss, use_reward = s.bool(f"{A}.use_kl_loss"), s.bool(f"{A}.use_kl_in_reward")
    coef = s.float(f"{A}.kl_loss_coef") or 0.0
    n = s.int("generator.n_samples_per_prompt") or 1
    epochs = s.int("trainer.update_epochs_per_batch") or 1
    tb, mb = s.int("trainer.train_batch_size") or 1, s.int("trainer.policy_mini_batch_size") or 1
    steps = max(1, -(-tb // mb))
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    opd = is_opd_entry(ep.name)
    # the OPD example's trainer replaces the reward-side KL with its teacher term
    _terms(r, kind, coef, use_loss, use_reward and not opd)
    if use_loss and coef > 0:
        _no_gradient_window(r, version)
    _findings(r, s)
    _equivalent(r, s, adv, epochs, steps, n, use_loss)
    if opd:
        _opd(r, s, adv, use_loss, use_reward)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _terms(r: Reading, kind: str, coef: float, use_loss: bool, use_reward: bool) -> None:
    """The KL in the loss or in the reward (one coefficient, kl_loss_coef, for both)."""
    if use_loss and use_reward:
        r.warn(
            "error",
            [f"{A}.use_kl_loss", f"{A}.use_kl_in_reward"],
            "use_kl_loss and use_kl_in_reward both true"
            + ": SkyRL asserts they are mutually exclusive (skyrl/train/utils/utils.py:312-314, "
            "validate_cfg) and does not start; use_kl_loss is true by default (config.py:833), "
            "so a reward KL needs use_kl_loss=false beside it",
            kind="refused",
        )
        return
    for placement, on in (("loss", use_loss), ("reward", use_reward)):
        if not on:
            continue
        if coef == 0:
            r.warn("warning", [f"{A}.kl_loss_coef"], "kl_loss_coef is 0: the KL term has no effect")
            continue
        r.terms.append(
            Term(
                option=f"use_kl_{'loss' if placement == 'loss' else 'in_reward'}=true, "
                f"kl_estimator_type={kind}",
                framework_name=kind,
                estimator=ESTIMATORS[kind],
                placement=placement,
                beta=coef,
                beta_option=f"{A}.kl_loss_coef",
                reduction="seq-mean-token-mean"
                if placement == "loss"
                else "per token subtracted from the reward (rewards − kl · kl_loss_coef)",
                value_clamp=(-10.0, 10.0) if kind == "k3" else None,
                log_ratio_clamp=(-20.0, 20.0) if kind == "k3" else None,
                logged_as="policy_kl" if placement == "loss" else "reward_kl",
            )
        )


def _no_gradient_window(r: Reading, version: str | None) -> None:
    """SkyRL's KL loss without a gradient (PR #137 to PR #1353): named, or warned of."""
    if version is not None and no_gradient_version(version):
        r.warn(
            "error",
            [f"{A}.use_kl_loss", "--framework-version"],
            f"SkyRL {version}: compute_approx_kl runs under @torch.no_grad (PR #137, "
            "2025-08-14, to PR #1353, 2026-03-20): the KL loss contributes no gradient at "
            "all. Fix: skyrl >= 0.2.0, or use_kl_in_reward=true with kl_estimator_type=k1",
        )
    elif version is None:
        r.warn(
            "warning",
            [f"{A}.use_kl_loss"],
            "version not named: in skyrl-train 0.1.0 to 0.4.0 and skyrl 0.1.0 (PR #137, "
            "2025-08-14, to PR #1353, 2026-03-20) this KL loss runs under @torch.no_grad "
            "and has no gradient at all; the reading below is skyrl 0.3.0's. Fix on an old "
            "version: upgrade to skyrl >= 0.2.0",
        )


def _findings(r: Reading, s: Settings) -> None:
    """Another policy loss, a critic without a model, and a KL loss on tokens of an older
    policy."""
    if s.str(f"{A}.advantage_estimator") == "gae" and not s.get("trainer.critic.model.path"):
        r.warn(
            "error",
            [f"{A}.advantage_estimator", "trainer.critic.model.path"],
            "advantage_estimator gae without trainer.critic.model.path: SkyRL asserts the critic's "
            "path is given for PPO (skyrl/train/utils/utils.py:306-310) and does not start",
            kind="refused",
        )
    if s.str(f"{A}.policy_loss_type") not in (None, "regular"):
        r.warn(
            "note",
            [f"{A}.policy_loss_type"],
            f"policy loss {s.str(f'{A}.policy_loss_type')!r} is not klpo's PPO clip; the KL "
            "diagnosis holds, the equivalent config's policy loss differs",
        )
    if r.off_policy and any(t.placement == "loss" for t in r.terms):
        r.warn(
            "warning",
            ["trainer.train_batch_size", "trainer.policy_mini_batch_size"],
            f"{r.updates_per_batch} optimiser steps per batch: from the second on the KL loss "
            "sees tokens of an older policy, and SkyRL does not weight it for that",
        )


def _equivalent(
    r: Reading, s: Settings, adv: str, epochs: int, steps: int, n: int, use_loss: bool
) -> None:
    name = ADVANTAGES.get(adv, "grpo")
    algo = {"name": name, "epochs": epochs, "minibatches": steps,
            "loss_reduction": "token-mean"}  # fmt: skip
    if adv not in ADVANTAGES:
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if use_loss:
        r.equivalent_differences.append(
            "SkyRL reduces the KL loss per sequence then over the batch, the policy loss by "
            f"{s.str(f'{A}.loss_reduction')}; klpo reduces both one way (token-mean shown)"
        )
    carried, _ = carry(s, CARRIED)
    build_equivalent(r, algo, {"group_size": max(n, 2)}, {}, carried, s)
    build_intended(r)


def _opd(r: Reading, s: Settings, adv: str, use_loss: bool, use_reward: bool) -> None:
    """The on-policy distillation example: each token's reward set to -(log pi_theta - log pi_T)
    by its trainer's ``apply_reward_kl_penalty``, reached only with ``use_kl_in_reward``."""
    keys = [f"{A}.use_kl_in_reward", f"{A}.advantage_estimator"]
    if not use_reward:
        _opd_cancelled(r, s, use_loss)
        return
    if use_loss:
        return  # refused by validate_cfg (_terms said so): the run does not start
    teacher = _opd_teacher(r, s)
    if adv != "no_op":
        r.warn(
            "warning",
            keys,
            f"main_on_policy_distill with advantage_estimator {adv}: the per-token teacher "
            f"rewards go through {adv}'s advantage instead of the example's no_op (which passes "
            "them through, one token each); the doctor reads the term with no_op only",
        )
        return
    t = distill.sampled(
        "main_on_policy_distill, use_kl_in_reward=true, advantage_estimator=no_op",
        "OnPolicyDistillationTrainer.apply_reward_kl_penalty", "k1", "reward", 1.0,
        "none (fixed at 1)", credit="token", teacher=teacher, logged_as="loss/avg_final_rewards",
    )  # fmt: skip
    r.teacher_terms.append(t)
    distill.per_token_credit(
        r, t, keys, "examples/train/on_policy_distillation/main_on_policy_distill.py: rewards = "
        "-(action_log_probs - teacher_action_log_probs), passed through by the no_op estimator"
    )  # fmt: skip
    _opd_findings(r, s)
    r.teacher_intended_why.append(
        "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
        "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
    )
    distill.build_sections(r, teacher, {"credit": "returns"})


def _opd_cancelled(r: Reading, s: Settings, use_loss: bool) -> None:
    """The example run with use_kl_in_reward false: no distillation term is applied."""
    r.warn(
        "warning",
        [f"{A}.use_kl_in_reward"],
        "main_on_policy_distill with use_kl_in_reward false: the example's teacher reward is "
        "set in apply_reward_kl_penalty, which the trainer calls only with use_kl_in_reward "
        "(skyrl/train/trainer.py:428-430), so no distillation term is applied"
        + (
            f"; the KL loss (use_kl_loss) is to trainer.ref.model.path, the teacher, at "
            f"kl_loss_coef {s.float(f'{A}.kl_loss_coef') or 0:g}"
            if use_loss
            else ""
        )
        + "; set use_kl_in_reward=true and use_kl_loss=false, as the example's scripts do",
        kind="cancelled",
    )


def _opd_teacher(r: Reading, s: Settings) -> str:
    """The teacher's path: trainer.ref.model.path, or the policy's (said) where it is not given."""
    ref = "trainer.ref.model.path"
    teacher = s.str(ref) or (str(s.values[ref]) if s.given(ref) else None)
    if teacher is None:
        policy = s.str("trainer.policy.model.path") or "the policy's path"
        r.warn(
            "warning",
            ["trainer.ref.model.path"],
            "trainer.ref.model.path is not given: SkyRL sets it to trainer.policy.model.path "
            f"(config.py:1504-1505), so the teacher is the student's own start ({policy}) and "
            "the term is a KL to the initial policy; give the teacher's path",
        )
        teacher = s.str("trainer.policy.model.path") or ""
    return teacher


def _opd_findings(r: Reading, s: Settings) -> None:
    """The term's findings: the task reward replaced, the unread coefficients, batch whitening."""
    r.warn(
        "note",
        [f"{A}.use_kl_in_reward"],
        "the example's apply_reward_kl_penalty replaces the task reward with the teacher term "
        "(data['rewards'] = -(log pi_theta - log pi_T)): the environment's reward is not in "
        "the advantage (pure distillation)",
    )
    given = [k for k in OPD_OVERRIDDEN if s.given(k)]
    r.warn(
        "warning" if given else "note",
        given or [f"{A}.kl_loss_coef"],
        (f"{', '.join(given)} set but not read" if given else "the coefficient is 1, fixed")
        + ": the example's apply_reward_kl_penalty computes the k1 difference itself and never "
        "reads kl_loss_coef, kl_estimator_type or kl_ctrl (the base trainer's version does)",
        kind="unread-key" if given else "",
    )
    if s.bool(f"{A}.advantage_batch_normalize"):
        r.warn(
            "warning",
            [f"{A}.advantage_batch_normalize"],
            "advantage_batch_normalize whitens the per-token teacher rewards over the batch "
            "(trainer.py:1477-1482): each token's -(log pi_theta - log pi_T) is shifted by the "
            "batch mean and divided by its standard deviation, so the term's scale and sign "
            "change from batch to batch",
        )
