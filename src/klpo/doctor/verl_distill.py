r"""verl's on-policy distillation (``distillation.*``), read for the doctor.

Read from verl 0.9.1 (the installed wheel; the same at ``verl-project/verl`` ``1dda039``), PR
#5041's trainer:

- ``verl/trainer/config/distillation/distillation.yaml`` — the defaults Hydra composes (they
  are not the dataclass's: ``loss_mode: k3``, ``topk: 32``, ``use_task_rewards: true``,
  ``use_policy_gradient: false``, both clamps null);
- ``verl/workers/config/distillation.py`` — ``DistillationLossConfig.__post_init__``: an
  unknown ``loss_mode`` is refused (``get_distillation_loss_settings``), and k1 without
  ``use_policy_gradient`` raises ("its gradient does not depend on the teacher");
- ``verl/trainer/distillation/losses.py`` — the modes: ``kl``/``k1``, ``abs``, ``mse``/``k2``,
  ``low_var_kl``/``k3`` through ``core_algos.kl_penalty`` with the teacher's log-prob of the
  sampled token in the reference's place (k3 is verl's clamped ``low_var_kl``), and
  ``forward_kl_topk``, the teacher-top-k forward sum, **always** ``clamp_min(0.0)``;
  ``loss_max_clamp`` clamps every mode's per-token value to ``[-c, c]``;
  ``use_policy_gradient`` passes ``-value.detach()`` as each token's advantage to the vanilla
  PPO loss (no returns), else the value is aggregated by ``loss_agg_mode`` as a loss;
  ``use_task_rewards`` adds the task's PPO loss and weights the distillation term by
  ``distillation_loss_coef`` (without it the coefficient is 1 and the task's loss is zeroed);
- ``verl/trainer/distillation/fsdp/losses.py`` — ``compute_forward_kl_topk``: the student's
  log-probs gathered at the teacher's top-k ids, both sides raised to ``log_prob_min_clamp``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from klpo import registry
from klpo.doctor import distill
from klpo.doctor.reading import Reading, Settings, TeacherTerm

__all__ = ["ESTIMATORS", "MODES", "read_distillation"]

LOSS = "distillation.distillation_loss"
WHERE = "verl/trainer/distillation/losses.py"

# verl's distillation loss_mode -> klpo's estimator (kl_penalty's names, with the teacher's
# log-prob in the reference's place; k3 is verl's clamped low_var_kl).
ESTIMATORS: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "low_var_kl",
    "k3": "low_var_kl",
}
MODES = (*ESTIMATORS, "forward_kl_topk")
"""verl 0.9.1's registered distillation loss modes (``DISTILLATION_LOSS_REGISTRY``)."""


def _teacher(s: Settings) -> str:
    """The teacher model(s) the config names: the default entry's, or every added one's."""
    paths = []
    for key in sorted(s.values):
        m = re.fullmatch(r"\+*distillation\.teacher_models\.([^.]+)\.model_path", key)
        if m and s.get(key) not in (None, ""):
            paths.append(str(s.get(key)))
    if not paths:
        default = s.get("distillation.teacher_models.teacher_model.model_path")
        return "" if default in (None, "") else str(default)
    return ", ".join(paths)


def _sampled_clamps(
    est: str, cap: float | None
) -> tuple[tuple[str, ...], tuple[float, float] | None, tuple[float, float] | None]:
    """The clamps on an estimator mode's per-token value: kl_penalty's own (low_var_kl) and
    loss_max_clamp's [-c, c] on top."""
    texts: list[str] = []
    value, ratio = None, None
    if est == "low_var_kl":
        value, ratio = (-10.0, 10.0), (-20.0, 20.0)
        texts.append(
            "kl_penalty's low_var_kl: log pi_T - log pi_theta clamped to [-20, 20], the value to "
            "[-10, 10]"
        )
    if cap is not None:
        lo, hi = value or (-cap, cap)
        value = (max(lo, -cap), min(hi, cap))
        texts.append(f"per-token value clamped to [{-cap:g}, {cap:g}] (loss_max_clamp)")
    return tuple(texts), value, ratio


@dataclass(frozen=True)
class _Loss:
    """The ``distillation.distillation_loss.*`` settings one reading needs, read once."""

    mode: str
    pg: bool
    task: bool
    coef: float
    coef_key: str
    cap: float | None
    floor: float | None
    topk: int | None
    teacher: str

    @classmethod
    def read(cls, s: Settings) -> _Loss:
        """The settings, read in the order the report lists them; without
        ``use_task_rewards`` the coefficient is 1."""
        mode = s.str(f"{LOSS}.loss_mode") or ""
        pg = s.bool(f"{LOSS}.use_policy_gradient")
        task = s.bool(f"{LOSS}.use_task_rewards")
        coef = (s.float(f"{LOSS}.distillation_loss_coef") or 0.0) if task else 1.0
        coef_key = f"{LOSS}.distillation_loss_coef" if task else f"{LOSS}.use_task_rewards=false: 1"
        cap, floor = s.float(f"{LOSS}.loss_max_clamp"), s.float(f"{LOSS}.log_prob_min_clamp")
        topk = s.int(f"{LOSS}.topk")
        return cls(mode, pg, task, coef, coef_key, cap, floor, topk, _teacher(s))

    @property
    def keys(self) -> list[str]:
        """The keys every finding on the mode names."""
        return [f"{LOSS}.loss_mode", f"{LOSS}.use_policy_gradient"]

    @property
    def option(self) -> str:
        """The term's option, as the report shows it."""
        pg = str(self.pg).lower()
        return f"distillation.enabled=true, loss_mode={self.mode}, use_policy_gradient={pg}"


def read_distillation(r: Reading, s: Settings, agg: str) -> None:
    """Add the distillation term of a verl config with ``distillation.enabled`` to ``r``: its
    :class:`~klpo.doctor.reading.TeacherTerm`, the findings for its traps, klpo's sections.

    In the order verl meets them: the settings given without ``enabled``, the modes it refuses
    when the config is built, the term, what it follows, the settings the mode never reads."""
    if not s.bool("distillation.enabled"):
        _disabled(r, s)
        return
    c = _Loss.read(s)
    if _refused(r, c):
        return
    t = _sampled_term(c) if c.mode in ESTIMATORS else _topk_term(c)
    r.teacher_terms.append(t)
    intended = _intended(r, t, c)
    _ignored(r, s, c)
    _differences(r, c)
    distill.build_sections(r, c.teacher.split(",")[0].strip(), intended)
    if agg not in ("token-mean",) and t.placement == "loss":
        r.teacher_differences.append(
            f"verl aggregates the term with loss_agg_mode={agg}; klpo's teacher term follows "
            "algo.loss_reduction"
        )


def _disabled(r: Reading, s: Settings) -> None:
    """``distillation.*`` settings given while ``distillation.enabled`` is false do nothing."""
    given = [k for k in s.values if k.lstrip("+").startswith("distillation.")]
    if given and any(s.differs(k) for k in given if k.lstrip("+") in s.defaults):
        r.warn(
            "warning",
            ["distillation.enabled"],
            "distillation.* settings are given but distillation.enabled is false (verl's "
            "default): no teacher is loaded and they do nothing",
        )


def _refused(r: Reading, c: _Loss) -> bool:
    """Whether verl refuses the mode when the config is built (an unknown mode, k1 in the loss)
    or the coefficient cancels the term; the finding says which."""
    mode = c.mode
    if mode not in MODES:
        reverse_topk = "topk" in mode and ("rev" in mode or "student" in mode)
        r.warn(
            "error",
            [f"{LOSS}.loss_mode"],
            f"{LOSS}.loss_mode = {mode!r}: verl refuses it when the config is built "
            "(get_distillation_loss_settings: 'Unsupported loss mode') and does not start; its "
            f"modes are {', '.join(MODES)}"
            + (
                "; a top-k reverse KL is not among them: verl dropped it from PR #5041 as "
                "unstable (the student shrank it by lowering its own top-k mass)"
                if reverse_topk
                else ""
            ),
            kind="refused",
        )
        return True
    if mode in ESTIMATORS and ESTIMATORS[mode] == "k1" and not c.pg:
        r.warn(
            "error",
            c.keys,
            f"loss_mode={mode} with use_policy_gradient=false: verl refuses it "
            "(DistillationLossConfig.__post_init__: the gradient of k1 in the loss does not "
            "depend on the teacher; it is zero in expectation, klpo explain --teacher: k1, loss) "
            "and does not start; set use_policy_gradient=true (k1 as a per-token reward) or use "
            "k3 / forward_kl_topk",
            kind="refused",
        )
        return True
    if c.coef == 0:
        r.warn(
            "warning",
            [f"{LOSS}.distillation_loss_coef"],
            "distillation_loss_coef is 0 with use_task_rewards: the teacher is served and scores "
            "every rollout, but the distillation term is multiplied by 0 (distillation_ppo_loss): "
            "no distillation term",
            kind="cancelled",
        )
        return True
    return False


def _sampled_term(c: _Loss) -> TeacherTerm:
    """An estimator mode's term: kl_penalty's value of the sampled token, clamped."""
    est = ESTIMATORS[c.mode]
    texts, value, ratio = _sampled_clamps(est, c.cap)
    return distill.sampled(
        c.option,
        c.mode,
        est,
        "reward" if c.pg else "loss",
        c.coef,
        c.coef_key,
        credit="token" if c.pg else "",
        clamps=texts,
        value_clamp=value,
        log_ratio_clamp=ratio,
        teacher=c.teacher,
        logged_as="distillation/loss",
    )


def _intended(r: Reading, t: TeacherTerm, c: _Loss) -> dict[str, Any]:
    """The findings on what the term follows, and klpo's intended teacher section's changes."""
    intended: dict[str, Any] = {}
    if c.pg:
        distill.per_token_credit(
            r, t, c.keys, f"{WHERE}: advantages=-distillation_losses.detach(), vanilla PPO loss"
        )
        intended["credit"] = "returns"
        r.teacher_intended_why.append(
            "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
            "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
        )
    if c.mode == "forward_kl_topk":
        if not c.pg:
            distill.topk_clamp_zero(r, t, c.keys, f"{WHERE} (compute_forward_kl_topk)")
        else:
            r.warn(
                "note",
                c.keys,
                "forward_kl_topk with use_policy_gradient: the top-k sum is detached into each "
                "token's advantage, so only the sampled token's log-probability is trained; verl "
                "says so itself when the config is built (DistillationLossConfig.__post_init__)",
            )
        if not c.pg:
            intended.update({"estimator": "topk_tail", "clamp_zero": None, "log_prob_floor": None})
            r.teacher_intended_why.append(
                "estimator: topk_tail, the K+1-bucket KL (verl#7855): a forward KL of the "
                "teacher's top-k and one tail bucket, never negative, so no clamp is needed"
            )
    elif not c.pg:
        _mismatch(r, t, c.keys, intended)
    return intended


def _differences(r: Reading, c: _Loss) -> None:
    """Where verl's term differs from klpo's teacher mode: the clamp, the task, the teachers."""
    if c.cap is not None:
        r.teacher_differences.append(
            f"loss_max_clamp={c.cap:g}: klpo's teacher mode has no clamp of the per-token value"
        )
    if not c.task:
        r.warn(
            "note",
            [f"{LOSS}.use_task_rewards"],
            "use_task_rewards=false: the task's policy loss is set to zero, so the run is "
            "distillation alone; algorithm.adv_estimator, the group size and the reward "
            "function do not enter the loss",
        )
    if "," in c.teacher:
        r.teacher_differences.append(
            f"several teachers, routed by distillation.teacher_key ({c.teacher}); klpo's teacher "
            "mode takes one: the first is shown"
        )


def _topk_term(c: _Loss) -> TeacherTerm:
    """``forward_kl_topk``'s term: the teacher's top-k forward sum, clamped at zero."""
    floor, cap, pg, topk = c.floor, c.cap, c.pg, c.topk
    clamps = ["clamp_min(0.0) of each position's sum, always (compute_forward_kl_topk)"]
    if floor is not None:
        clamps.append(
            f"both models' top-k log-probs raised to at least {floor:g} (log_prob_min_clamp): a "
            "raised student log-prob carries no gradient (not in klpo explain --teacher's rows)"
        )
    if cap is not None:
        clamps.append(f"per-token value clamped to [{-cap:g}, {cap:g}] (loss_max_clamp)")
    klpo = {}
    if not pg:
        klpo = {
            "estimator": "topk_forward",
            "placement": "loss",
            "beta": c.coef,
            "top_k": topk,
            "clamp_zero": True,
            "log_prob_floor": floor,
        }
    return TeacherTerm(
        option=c.option,
        framework_name="forward_kl_topk",
        divergence="sum over the teacher's top-k of p (log p - log q): the forward "
        "KL(pi_T ‖ pi_theta) truncated to the teacher's top-k, no KL (the masses are "
        "truncated: it goes negative)",
        direction="forward (truncated)",
        support="top-k",
        placement="reward" if pg else "loss",
        beta=c.coef,
        beta_option=c.coef_key,
        credit="token" if pg else "",
        top_k=topk,
        topk_of="teacher",
        clamps=tuple(clamps),
        table_key=None if pg else "topk_forward_clamp",
        teacher=c.teacher,
        logged_as="distillation/loss",
        klpo=klpo,
    )


def _mismatch(r: Reading, t: TeacherTerm, keys: list[str], intended: dict[str, Any]) -> None:
    """A sampled estimator in the loss whose gradient is not the reverse KL's it logs (k3:
    the forward KL's; abs: none)."""
    rows = registry.teacher_positions(t.table_key or "", "loss")
    grad = rows["near"]["gradient"] if rows else None
    if t.estimator is not None and registry.explanation(t.estimator, "loss") is not None:
        e = registry.explanation(t.estimator, "loss")
        assert e is not None
        grad = grad or e.gradient.removeprefix("grad ").replace("pi_ref", "pi_T")
    if grad == distill.REVERSE:
        return
    variant = registry.SPECS[t.estimator].loss_variant if t.estimator else "full"
    r.warn(
        "warning",
        keys,
        f"loss_mode={t.framework_name} in the loss (verl's default): its value estimates "
        f"{distill.REVERSE}, the KL it logs, but its expected gradient is "
        + (f"that of {grad}" if grad and grad.startswith("KL(") else f"{grad or 'no KL’s'}")
        + " where no clamp binds (klpo explain --teacher); the same value with the reverse "
        f"KL's gradient is klpo's {variant} (straight-through), or `full` with the teacher's "
        "whole distribution",
    )
    intended["estimator"] = variant
    r.teacher_intended_why.append(
        f"estimator: {variant} logs the value {t.framework_name} logs and follows grad "
        f"{distill.REVERSE} per position"
    )


def _ignored(r: Reading, s: Settings, c: _Loss) -> None:
    """Settings the chosen mode never reads, where the file sets them."""
    mode, pg, task = c.mode, c.pg, c.task
    unread: list[tuple[str, str]] = []
    if mode != "forward_kl_topk":
        unread += [
            (f"{LOSS}.topk", "read only by forward_kl_topk"),
            (f"{LOSS}.log_prob_min_clamp", "read only by forward_kl_topk"),
        ]
    if not pg:
        unread += [
            (f"{LOSS}.{k}", "read only with use_policy_gradient")
            for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "policy_loss_mode")
        ]
    if not task:
        unread.append((f"{LOSS}.distillation_loss_coef", "read only with use_task_rewards"))
    for key, why in unread:
        if s.given(key) and s.get(key) is not None:
            r.warn(
                "note",
                [key],
                f"{key} = {s.values[key]!r} is {why} (loss_mode={mode}): it does nothing here",
                kind="unread-key",
            )
