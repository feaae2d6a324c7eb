"""prime-rl's TOML configs (``uv run rl @ rl.toml``), read for the doctor.

Pinned: PrimeIntellect-ai/prime-rl main at ``559b447`` (2026-08-21; ``prime-rl`` 0.8.0).
Defaults: ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-507`` (the default loss:
``dppo_mask_low`` / ``dppo_mask_high`` 0.2, ``adv_tau`` 1.0, ``kl_tau`` 1e-3), and
``configs/orchestrator.py`` (``group_size`` 1, :517; ``max_off_policy_steps`` 8, :532: rollouts
up to 8 policy versions old are trained on).

What the loss does (``src/prime_rl/trainer/rl/loss.py:100-150``, ``default_loss_fn``): there is
**no reference model**. Tokens whose probability moved more than the DPPO threshold from the
sampler's (binary TV, on the side of the advantage's sign) are masked from the policy term, and
every token adds kl_tau · (log pi_trainer − log pi_inference)²: a k2 penalty (coefficient
2 · kl_tau) toward the *sampling* policy, not toward a reference. ``ipo`` is the same with one
threshold; ``custom`` is the user's function.

Keys: prime-rl's pydantic configs refuse a key they do not have (strict); the file's keys are
checked against the version's table (every variant of a union: any loss type's keys). GRPO's
advantage is the reward minus its group's mean (``orchestrator/algo/grpo.py:29-30``): at the
default ``group_size`` of 1 every advantage is zero.

On-policy distillation (``configs/algorithm.py``: ``OPDAlgoConfig``, ``OPSDAlgoConfig``; the loss
``src/prime_rl/trainer/rl/loss.py:199-241``, ``ref_kl_loss_fn``): ``orchestrator.algo.type`` opd
(a frozen teacher served at ``orchestrator.algo.teacher``) or opsd (the live policy itself,
scoring each sample with a demonstration prepended), also per train source
(``[[orchestrator.train.source]]``'s ``algo``). Each sampled token's loss is
-sg(log pi_T − log pi_theta) · pi_theta/pi_inference (tokens whose probability fell more than 0.2
below the sampler's dropped) + 1e-3 · (log pi_theta − log pi_inference)²: the sampled-token reverse
KL as a per-token reward, no scalar advantage, no returns; ``trainer.loss`` does not touch it.
"""

from __future__ import annotations

from typing import Any

from klpo.doctor import tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.distill import build_sections, per_token_credit, sampled
from klpo.doctor.keys import check_keys
from klpo.doctor.reading import Reading, Settings, flatten

__all__ = ["DEFAULTS", "VERSION", "detect", "read", "read_settings"]

VERSION = "0.8.0"
# algo.type -> where its advantage subtracts the group's mean reward
GROUP_MEAN = {
    "grpo": "src/prime_rl/orchestrator/algo/grpo.py:29-30",
    "max_rl": "src/prime_rl/orchestrator/algo/max_rl.py:25-26",
}
DEFAULTS: dict[str, Any] = {
    "trainer.loss.type": "default",
    "trainer.loss.kl_tau": 1e-3,
    "trainer.loss.dppo_mask_low": 0.2,
    "trainer.loss.dppo_mask_high": 0.2,
    "trainer.loss.adv_tau": 1.0,
    "orchestrator.group_size": 1,
    "orchestrator.batch_size": None,
    "orchestrator.max_off_policy_steps": 8,
    "orchestrator.algo.type": "grpo",
    "orchestrator.train.sampling.max_completion_tokens": None,
    "orchestrator.train.sampling.temperature": None,
    "model.name": None,
    "trainer.optim.lr": None,
    "max_steps": None,
}
CARRIED = [
    ("model.name", "model.policy"),
    ("orchestrator.train.sampling.max_completion_tokens", "rollout.max_new_tokens"),
    ("orchestrator.train.sampling.temperature", "rollout.temperature"),
    ("trainer.optim.lr", "optim.lr"),
    ("max_steps", "run.steps"),
]


SECTIONS = ("trainer", "orchestrator", "inference")


def detect(doc: Any) -> tuple[int, str] | None:
    """prime-rl's evidence: its ``trainer`` or ``orchestrator`` tables (an ``rl`` config); an
    SFT config (``data``, ``model``, no orchestrator) is refused by name."""
    data = doc.data or {}
    seen = [k for k in SECTIONS[:2] if isinstance(data.get(k), dict)]
    if seen:
        return 3, f"prime-rl's [{'], ['.join(seen)}] table(s)"
    if isinstance(data.get("data"), dict) and isinstance(data.get("model"), dict):
        from klpo.doctor.reading import DoctorError

        raise DoctorError(
            f"{doc.source}: a prime-rl SFT config ([data], [model], no [orchestrator]: `uv run "
            "sft`); the doctor reads prime-rl's RL configs (`uv run rl`), whose loss it knows"
        )
    return None


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``prime-rl`` row's reader: an ``rl`` TOML config."""
    return read_settings(doc.data, doc.source, version)


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a prime-rl ``rl`` config."""
    from klpo.doctor.frameworks import ROWS

    r = Reading(framework="prime-rl", defaults_version=VERSION, version=version, source=source)
    table = tables.load("prime-rl", VERSION).defaults
    r.defaults_from = (
        f"the doctor's table of prime-rl {VERSION}'s RLConfig models (klpo/assets/doctor)"
    )
    given = check_keys(r, flatten(data), table, "prime-rl", VERSION, ROWS["prime-rl"].policy)
    s = Settings(given, {**table, **DEFAULTS}, source)
    loss = s.str("trainer.loss.type") or "default"
    tau = s.float("trainer.loss.kl_tau") or 0.0
    g = s.int("orchestrator.group_size") or 1
    stale = s.int("orchestrator.max_off_policy_steps") or 0
    algo_type = s.str("orchestrator.algo.type") or "grpo"
    r.algorithm, r.group_size, r.updates_per_batch = algo_type, g, 1
    r.asynchronous = stale > 0
    if algo_type in GROUP_MEAN and g == 1:
        r.warn(
            "error",
            ["orchestrator.group_size", "orchestrator.algo.type"],
            ("orchestrator.group_size is prime-rl's default 1" if not s.given(
                "orchestrator.group_size") else "orchestrator.group_size 1")
            + f" under {algo_type}'s group-mean baseline ({GROUP_MEAN[algo_type]}): each group is "
            "one rollout, its reward minus its own mean, so every advantage is zero"
            + (" and train.filter_zero_advantages (default true) drops every token: nothing is "
               "trained" if s.bool("orchestrator.train.filter_zero_advantages") else "")
            + "; set orchestrator.group_size above 1 (e.g. 8)",
            kind="zero-advantage",
        )  # fmt: skip
    distilled, teacher_model = _distillation(r, s, data)
    r.warn(
        "note",
        ["trainer.loss"],
        "no reference model: prime-rl's RL loss has no KL to a reference"
        + ("; the distillation term holds the student near its teacher" if distilled
           else "; nothing holds the policy near its start"),
    )  # fmt: skip
    if distilled and algo_type in ("opd", "opsd"):
        pass  # the ref_kl loss component is fixed: trainer.loss does not touch it
    elif loss in ("default", "ipo") and tau > 0:
        r.warn(
            "note",
            ["trainer.loss.kl_tau"],
            f"kl_tau {tau:g} · (log pi_trainer − log pi_inference)² per token: a k2 penalty "
            f"(coefficient {2 * tau:g}) toward the sampling policy, a trust region on "
            "the sampler–trainer drift, not a KL to a reference",
        )
    elif loss == "custom":
        r.warn("note", ["trainer.loss.type"], "a custom loss: what it does is the user's code")
    if r.asynchronous:
        r.warn(
            "note",
            ["orchestrator.max_off_policy_steps"],
            f"asynchronous: rollouts up to {stale} policy versions old are trained on; the "
            "importance ratio is to the sampler's log-probs",
        )
    algo = {"name": "grpo", "epochs": 1, "minibatches": 1, "loss_reduction": "token-mean"}
    r.equivalent_differences.append(
        "the DPPO mask and the sampler-KL term have no klpo keys; klpo's PPO clip and no KL shown"
    )
    carried, _ = carry(s, CARRIED)
    bs = s.int("orchestrator.batch_size")
    rollout: dict[str, Any] = {"group_size": max(g, 2)}
    if bs:
        rollout["prompts_per_step"] = max(1, bs // g)
    build_equivalent(r, algo, rollout, {}, carried, s)
    build_sections(r, teacher_model, {"credit": "returns"})
    build_intended(r)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _distillation(r: Reading, s: Settings, data: dict[str, Any]) -> tuple[bool, str | None]:
    """The opd / opsd algorithm (top level or a train source's): its teacher term; returns
    whether there is one, and the teacher model for klpo's section (empty for opsd)."""
    types = [s.str("orchestrator.algo.type") or "grpo"]
    sources = ((data.get("orchestrator") or {}).get("train") or {}).get("source") or []
    if isinstance(sources, list):
        types += [
            str((src.get("algo") or {}).get("type"))
            for src in sources
            if isinstance(src, dict) and isinstance(src.get("algo"), dict)
        ]
    kinds = [t for t in types if t in ("opd", "opsd")]
    if not kinds:
        return False, None
    kind = kinds[0]
    if kind == "opd":
        top = s.str("orchestrator.algo.type") == "opd"
        teacher = (
            s.str("orchestrator.algo.teacher.name")
            if top
            else next(
                str(((src.get("algo") or {}).get("teacher") or {}).get("name", ""))
                for src in sources
                if isinstance(src, dict) and (src.get("algo") or {}).get("type") == "opd"
            )
        ) or ""
    else:
        teacher = "the live policy itself, scoring each sample with a demonstration prepended"
    t = sampled(
        f"orchestrator.algo.type={kind}" if types[0] == kind else f"a train source's algo {kind}",
        f"{kind} (ref_kl loss)", "k1", "reward", 1.0, "the ref_kl loss component",
        credit="token", teacher=teacher, logged_as="ref_kl",
    )  # fmt: skip
    r.teacher_terms.append(t)
    per_token_credit(
        r, t, ["orchestrator.algo.type"],
        "src/prime_rl/trainer/rl/loss.py: ref_kl_loss_fn, -sg(log pi_T - log pi_theta) · ratio",
    )  # fmt: skip
    if len(set(types)) > 1:
        r.warn(
            "note",
            ["orchestrator.algo.type"],
            f"algorithms per train source ({', '.join(dict.fromkeys(types))}): one batch mixes "
            "the rl and ref_kl loss components, each normalised by its own token count",
        )
    if kind == "opsd":
        r.teacher_differences.append(
            "opsd's teacher is the live policy conditioned on a demonstration; klpo's teacher "
            "mode takes a separate, fixed teacher model"
        )
    r.teacher_intended_why.append(
        "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
        "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
    )
    return True, teacher if kind == "opd" else None
