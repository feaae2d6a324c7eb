"""slime's launch scripts (``python3 train.py`` / ``train_async.py`` with its flags), read for
the doctor.

Pinned: THUDM/slime main at ``624b824`` (2026-08-21, after v0.3.1). Defaults are its argument
parser's (``slime/utils/arguments.py``): ``--kl-coef`` 0.0 (:909), ``--kl-loss-type`` **k1**
(:934-938; choices k1, k2, k3, low_var_kl), ``--advantage-estimator`` grpo (:941), ``--use-kl-loss``
off (:981), ``--kl-loss-coef`` 0.0 (:984), ``--use-unbiased-kl`` off (:990),
``--ref-update-interval`` None (:996), ``--n-samples-per-prompt`` 1 (:700), ``--global-batch-size``
None and ``--num-steps-per-rollout`` None (:706-714: steps = rollout_batch_size ×
n_samples_per_prompt / global_batch_size).

What the settings do: ``slime/utils/ppo_utils.py:12-51`` (``compute_approx_kl``: k1 = d, k2 = d²/2,
k3 and low_var_kl = exp(−d) + d − 1, only low_var_kl clamped to ±10, times the differentiable
ratio exp(lp − lp_old) under ``--use-unbiased-kl``), ``slime/backends/megatron_utils/loss.py``
(the KL loss added as ``kl_loss_coef × sum_of_sample_mean(kl)``, :1116-1131; the reward-side KL
with ``--kl-coef`` used by ppo and reinforce_plus_plus(_baseline) but dropped by
``get_grpo_returns`` for grpo, gspo and cispo, :743-800).

On-policy distillation (``--use-opd``, ``arguments.py:1117-1160``, checked at :1785-1815):
``apply_opd_kl_to_advantages`` (``loss.py:663-701``) subtracts ``--opd-kl-coef`` ×
(log pi_theta − log pi_T) of each sampled token from the estimator's advantage, after it and
before ``--normalize-advantages`` (:810-816); the student's log-probs are the training engine's
(the rollout engine's with ``--use-rollout-logprobs``); the teacher's come from an SGLang server
(``--opd-type sglang``, ``slime/rollout/on_policy_distillation.py``, whose reward function returns
0 for every sample) or a Megatron checkpoint (``--opd-type megatron``, ``--opd-teacher-load``).
The OPD guide stated the direction the other way round until PR #2254 (2026-08-12).
"""

from __future__ import annotations

from typing import Any

from klpo.doctor import distill, tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.keys import unknown_key_text
from klpo.doctor.launch import framework_command, script_notes
from klpo.doctor.reading import Reading, Settings, Term, check_known, command_flags, nearest, scalar

__all__ = ["DEFAULTS", "VERSION", "read"]

VERSION = "0.3.1+624b824"
DEFAULTS: dict[str, Any] = {
    "kl-coef": 0.0,
    "kl-loss-type": "k1",
    "advantage-estimator": "grpo",
    "use-kl-loss": False,
    "kl-loss-coef": 0.0,
    "use-unbiased-kl": False,
    "ref-update-interval": None,
    "n-samples-per-prompt": 1,
    "rollout-batch-size": None,
    "global-batch-size": None,
    "num-steps-per-rollout": None,
    "hf-checkpoint": None,
    "lr": None,
    "weight-decay": None,
    "clip-grad": None,
    "eps-clip": 0.2,
    "eps-clip-high": None,
    "rollout-max-response-len": None,
    "rollout-max-prompt-len": None,
    "rollout-temperature": None,
    "rollout-top-p": None,
    "entropy-coef": 0.0,
    "normalize-advantages": False,
    "use-opd": False,
    "opd-type": None,
    "opd-kl-coef": 1.0,
    "opd-teacher-load": None,
    "rm-url": None,
    "custom-rm-path": None,
    "use-rollout-logprobs": False,
}
SWITCHES = {"use-kl-loss", "use-unbiased-kl", "normalize-advantages", "use-opd"}
ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "k3", "low_var_kl": "k3"}
ADVANTAGES = {
    "grpo": "grpo",
    "gspo": "grpo",
    "cispo": "grpo",
    "reinforce_plus_plus": "reinforce++",
    "reinforce_plus_plus_baseline": "reinforce++",
    "ppo": "ppo",
}
CARRIED = [
    ("hf-checkpoint", "model.policy"),
    ("rollout-batch-size", "rollout.prompts_per_step"),
    ("rollout-max-response-len", "rollout.max_new_tokens"),
    ("rollout-max-prompt-len", "data.max_prompt_tokens"),
    ("rollout-temperature", "rollout.temperature"),
    ("rollout-top-p", "rollout.top_p"),
    ("eps-clip", "algo.clip_low"),
    ("eps-clip-high", "algo.clip_high"),
    ("entropy-coef", "algo.entropy_coef"),
    ("lr", "optim.lr"),
    ("weight-decay", "optim.weight_decay"),
    ("clip-grad", "optim.grad_clip"),
]


def parse_flags(
    words: list[str], switches: set[str] | frozenset[str] = frozenset()
) -> dict[str, Any]:
    """``--flag value`` / ``--flag=value`` / switches, argparse's way for slime's flags
    (``switches``: flags that take no value, besides :data:`SWITCHES`)."""
    return {
        name: True if value is None else scalar(value)
        for name, value in command_flags(words, {*SWITCHES, *switches})
    }


def read(doc: Any, version: str | None = None) -> Reading:
    """Read a slime launch script's ``train.py`` / ``train_async.py`` command."""
    source = doc.source
    script, ep = framework_command(doc, "slime", "slime `train.py` / `train_async.py`")
    table = tables.load("slime", VERSION).defaults
    flags = parse_flags(ep.arguments, {k for k, v in table.items() if isinstance(v, bool)})
    r = Reading(framework="slime", defaults_version=VERSION, version=version, source=source)
    _unknown_flags(r, flags, table)
    if version is not None and not version.startswith("0.3"):
        r.warn(
            "warning",
            ["--framework-version"],
            f"the doctor knows slime {VERSION}; {version} is read with its defaults",
        )
    labels = {k: "--" + k for k in {*DEFAULTS, *flags}}
    s = Settings(flags, DEFAULTS, source, labels)
    script_notes(r, script)
    adv = check_known(
        s.str("advantage-estimator") or "", ADVANTAGES, "--advantage-estimator", source
    )
    kind = check_known(s.str("kl-loss-type") or "", ESTIMATORS, "--kl-loss-type", source)
    use_loss, unbiased = s.bool("use-kl-loss"), s.bool("use-unbiased-kl")
    loss_coef, reward_coef = s.float("kl-loss-coef") or 0.0, s.float("kl-coef") or 0.0
    n = s.int("n-samples-per-prompt") or 1
    steps = _steps(s, n)
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, steps
    r.asynchronous = ep.name.rsplit("/", 1)[-1] == "train_async.py"
    if _refused(r, s, adv, loss_coef, reward_coef):
        pass  # the run does not start: no term is in effect
    elif use_loss and loss_coef > 0:
        _loss_term(r, s, kind, unbiased, loss_coef)
        _reward_term(r, kind, adv, reward_coef)
    else:
        _no_loss_term(r, s, use_loss, unbiased)
        _reward_term(r, kind, adv, reward_coef)
    _reference_and_staleness(r, s, steps)
    _opd(r, s)
    _equivalent(r, s, adv, steps, n)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


_KL_FLAGS = ("kl", "use-kl", "use-unbiased", "advantage", "n-samples", "ref-", "normalize")


def _unknown_flags(r: Reading, flags: dict[str, Any], table: dict[str, Any]) -> None:
    """A flag slime's own parser does not have, near one of its KL or advantage flags:
    Megatron's parser drops what no parser knows without a word (lenient), so the default stays
    in force. (Megatron's and SGLang's own flags are not in slime's table, so only a near miss of
    a KL flag is named.)"""
    from klpo.doctor.frameworks import ROWS

    for name in flags:
        if name in table or name in DEFAULTS:
            continue
        near = nearest(name, [k for k in DEFAULTS if k.startswith(_KL_FLAGS)])
        if near is None:
            continue  # Megatron's or SGLang's own flags are not in slime's table
        level, text = unknown_key_text(
            f"--{name}", f"--{near}", "slime", VERSION, ROWS["slime"].policy, DEFAULTS[near]
        )
        r.warn(level, [f"--{name}", f"--{near}"],
               text + " (unless Megatron or SGLang has such a flag)", kind="unknown-key")  # fmt: skip


def _refused(r: Reading, s: Settings, adv: str, loss_coef: float, reward_coef: float) -> bool:
    """The combinations slime_validate_args asserts against: the run does not start."""
    refused = False
    if reward_coef != 0 and loss_coef != 0:
        r.warn(
            "error",
            ["--kl-coef", "--kl-loss-coef"],
            f"--kl-coef {reward_coef:g} and --kl-loss-coef {loss_coef:g} both non-zero: slime "
            "asserts only one of them is set (slime/utils/arguments.py:1846, "
            "slime_validate_args) and does not start; keep one",
            kind="refused",
        )
        refused = True
    if adv in ("reinforce_plus_plus", "reinforce_plus_plus_baseline") and not s.bool(
        "normalize-advantages"
    ):
        r.warn(
            "error",
            ["--advantage-estimator", "--normalize-advantages"],
            f"--advantage-estimator {adv} without --normalize-advantages: slime asserts it "
            "(slime/utils/arguments.py:1848-1852) and does not start",
            kind="refused",
        )
        refused = True
    return refused


def _steps(s: Settings, n: int) -> int:
    """Optimiser steps per rollout: --num-steps-per-rollout, else rollout × samples / global
    batch (slime's arguments.py)."""
    rb, gbs, nsteps = (
        s.int("rollout-batch-size"),
        s.int("global-batch-size"),
        s.int("num-steps-per-rollout"),
    )
    return nsteps or (max(1, (rb * n) // gbs) if rb and gbs else 1)


def _loss_term(r: Reading, s: Settings, kind: str, unbiased: bool, coef: float) -> None:
    """The KL loss (--use-kl-loss): the estimator, --use-unbiased-kl's ratio, its findings."""
    if unbiased:
        est = {"k3": "k3_is", "low_var_kl": "k3_is"}.get(kind)
        name = f"{kind} × exp(lp − lp_old)"
    else:
        est, name = ESTIMATORS[kind] if kind != "low_var_kl" else "k3", kind
    r.terms.append(
        Term(
            option="--use-kl-loss, --kl-loss-type "
            + kind
            + (", --use-unbiased-kl" if unbiased else ""),
            framework_name=name,
            estimator=est,
            placement="loss",
            beta=coef,
            beta_option="--kl-loss-coef",
            reduction="seq-mean-token-mean",
            value_clamp=(-10.0, 10.0) if kind == "low_var_kl" else None,
            corrected=unbiased and est == "k3_is",
            logged_as="kl_loss",
        )
    )
    _loss_findings(r, s, kind, unbiased)


def _no_loss_term(r: Reading, s: Settings, use_loss: bool, unbiased: bool) -> None:
    """--use-kl-loss at coefficient 0, or the KL loss's settings without --use-kl-loss."""
    if use_loss:
        r.warn(
            "warning",
            ["--use-kl-loss", "--kl-loss-coef"],
            "--use-kl-loss with --kl-loss-coef 0: the reference model is loaded and its log-probs "
            "computed, but the KL loss has no effect",
        )
    elif s.given("kl-loss-type") or s.given("kl-loss-coef") or unbiased:
        r.warn(
            "warning",
            ["--use-kl-loss"],
            "set but ignored: --kl-loss-type / --kl-loss-coef / --use-unbiased-kl take effect "
            "only with --use-kl-loss",
        )


def _loss_findings(r: Reading, s: Settings, kind: str, unbiased: bool) -> None:
    """k1 in the loss (slime's default): zero expected gradient; k1/k2 times the ratio."""
    if kind == "k1" and not unbiased:
        r.warn(
            "error",
            ["--kl-loss-type", "--use-kl-loss"],
            ("--kl-loss-type is not given: slime's default is k1 (arguments.py:937)"
             if not s.given("kl-loss-type") else "--kl-loss-type k1")
            + " in the loss: its expected gradient is zero, the KL loss regularises "
            "nothing. Fix: --kl-loss-type k2 (or low_var_kl), or k3 with --use-unbiased-kl",
        )  # fmt: skip
    if unbiased and kind in ("k1", "k2"):
        r.warn(
            "warning" if kind == "k2" else "note",
            ["--use-unbiased-kl", "--kl-loss-type"],
            f"{kind} × the differentiable ratio: on-policy its gradient is "
            + ("E[(d + d²/2)∇log pi_theta], biased; use k3 with --use-unbiased-kl"
               if kind == "k2" else "E[(d + 1)∇log pi_theta] = grad KL(pi_theta ‖ pi_ref)"),
        )  # fmt: skip


def _reward_term(r: Reading, kind: str, adv: str, reward_coef: float) -> None:
    """The reward-side KL (--kl-coef), which the GRPO-family estimators drop."""
    if reward_coef > 0 and adv in ("grpo", "gspo", "cispo"):
        r.warn(
            "warning",
            ["--kl-coef", "--advantage-estimator"],
            f"--kl-coef {reward_coef:g} is ignored for {adv}: get_grpo_returns drops the "
            "reward-side KL (megatron_utils/loss.py); use --use-kl-loss, or an estimator that "
            "reads it (ppo, reinforce_plus_plus)",
        )
    elif reward_coef > 0:
        r.terms.append(
            Term(
                option=f"--kl-coef {reward_coef:g}, --kl-loss-type {kind}",
                framework_name=kind,
                estimator=ESTIMATORS[kind] if kind != "low_var_kl" else "low_var_kl",
                placement="reward",
                beta=reward_coef,
                beta_option="--kl-coef",
                reduction="per token into the reward, before the advantage",
                logged_as="kl",
            )
        )


def _reference_and_staleness(r: Reading, s: Settings, steps: int) -> None:
    """A reference reset to the actor, and a KL loss on tokens of an older policy."""
    if s.get("ref-update-interval"):
        r.warn(
            "note",
            ["--ref-update-interval"],
            f"the reference is reset to the actor every {s.get('ref-update-interval')} rollouts: "
            "the KL is to a moving reference",
        )
    if r.off_policy and any(t.placement == "loss" and not t.corrected for t in r.terms):
        r.warn(
            "warning",
            ["--global-batch-size", "--num-steps-per-rollout"],
            f"{'asynchronous rollouts' if r.asynchronous else f'{steps} optimiser steps per rollout'}"
            ": the KL loss sees tokens of an older policy and slime does not weight it for that "
            "(--use-unbiased-kl with k3 does)",
        )


def _equivalent(r: Reading, s: Settings, adv: str, steps: int, n: int) -> None:
    algo = {
        "name": ADVANTAGES[adv],
        "epochs": 1,
        "minibatches": steps,
        "loss_reduction": "seq-mean-token-mean",
    }
    if adv != "grpo":
        r.equivalent_differences.append(f"slime's {adv}: klpo's {ADVANTAGES[adv]} shown")
    carried, _missing = carry(s, CARRIED)
    build_equivalent(r, algo, {"group_size": max(n, 2)}, {}, carried, s)
    build_intended(r)


def _opd(r: Reading, s: Settings) -> None:
    """``--use-opd``: the sampled-token reverse KL to the teacher, in each token's advantage."""
    if not s.bool("use-opd"):
        given = [k for k in ("opd-type", "opd-kl-coef", "opd-teacher-load") if s.given(k)]
        if given:
            r.warn(
                "error" if "opd-teacher-load" in given else "warning",
                [f"--{k}" for k in given],
                f"--{given[0]} without --use-opd: "
                + (
                    "slime refuses --opd-teacher-load without --use-opd (arguments.py:1813-1815) "
                    "and does not start"
                    if "opd-teacher-load" in given
                    else "no teacher is queried and no distillation term is applied"
                ),
                kind="refused" if "opd-teacher-load" in given else "unread-key",
            )
        return
    kind = s.str("opd-type")
    coef = s.float("opd-kl-coef")
    coef = 1.0 if coef is None else coef
    keys = ["--use-opd", "--opd-type"]
    if kind not in ("sglang", "megatron"):
        r.warn(
            "error",
            keys,
            f"--use-opd with --opd-type {kind}: slime asks for sglang or megatron "
            "(arguments.py:1787-1788) and does not start",
            kind="refused",
        )
        return
    load = s.str("opd-teacher-load")
    if (kind == "megatron") != (load is not None):
        r.warn(
            "error",
            ["--opd-type", "--opd-teacher-load"],
            "--opd-type megatron needs --opd-teacher-load; sglang must not have it "
            "(arguments.py:1790-1812): slime does not start",
            kind="refused",
        )
    teacher = load or (f"the SGLang server at {s.str('rm-url')}" if s.str("rm-url") else "")
    t = distill.sampled(
        f"--use-opd --opd-type {kind}", "OPD (apply_opd_kl_to_advantages)", "k1", "reward",
        coef, "--opd-kl-coef", credit="token", teacher=teacher, logged_as="opd_reverse_kl",
    )  # fmt: skip
    r.teacher_terms.append(t)
    distill.per_token_credit(
        r, t, keys, "slime/backends/megatron_utils/loss.py: apply_opd_kl_to_advantages, "
        "advantage - opd_kl_coef · (log pi_theta - log pi_T)"
    )  # fmt: skip
    r.warn(
        "note",
        keys,
        "slime's OPD guide stated this KL the other way round, D_KL(P_teacher ‖ P_student), "
        "until PR #2254 (THUDM/slime#2254, 2026-08-12); the code computes log pi_theta - log "
        "pi_T of the student's sampled token, the reverse KL(pi_theta ‖ pi_T)'s sampled estimate, "
        "as the guide now says",
    )
    if s.str("custom-rm-path") == "slime.rollout.on_policy_distillation.reward_func":
        r.warn(
            "note",
            ["--custom-rm-path"],
            "slime's OPD reward function returns 0 for every sample "
            "(slime/rollout/on_policy_distillation.py: post_process_rewards): the estimator's "
            "own advantage is 0 and the teacher gap is the whole signal (pure distillation)",
        )
    if s.bool("normalize-advantages"):
        r.warn(
            "warning",
            ["--normalize-advantages", "--opd-kl-coef"],
            "--normalize-advantages whitens the advantages after the OPD term is added "
            "(loss.py:810-830): the teacher gap is divided by the batch's standard deviation of "
            "all advantages, so --opd-kl-coef's scale changes from batch to batch",
        )
    r.teacher_intended_why.append(
        "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
        "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
    )
    distill.build_sections(r, teacher, {"credit": "returns"})
