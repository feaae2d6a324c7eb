"""verl's ``algorithm.rollout_correction`` (verl >= 0.6), read for the doctor.

The facts are verl 0.9.1's own: the keys and defaults of ``trainer/config/algorithm.py``
(``RolloutCorrectionConfig``) and ``trainer/config/algorithm/rollout_correction.yaml`` (the YAML's
defaults are what Hydra composes: ``rollout_is: null``, not the dataclass's ``"sequence"``); what
they do, from ``trainer/ppo/rollout_corr_helper.py`` (``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask`` and their threshold parsers, mirrored here),
``trainer/ppo/ray_trainer.py`` (decoupled mode: the correction runs once per batch on the
recomputed pi_old and the engine's log-probs, before the advantages, and the rejection rewrites
``response_mask``), ``trainer/ppo/core_algos.py`` (``compute_policy_loss_bypass_mode``) and
``workers/utils/losses.py`` (the KL loss: ``response_mask``, no importance weight).

klpo's keys for the same things: ``rollout.tis_cap`` with ``rollout.engine=vllm`` (token TIS
against the engine's log-probs) and ``algo.trm_delta`` / ``trm_statistic`` / ``trm_aggregate``
(Trust Region Masking's sequence mask). Everything else verl offers is reported as having no
klpo equivalent, with what it does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from klpo.doctor.reading import Reading, Settings
from klpo.doctor.shell import Script

__all__ = [
    "IS_LEVELS",
    "RC",
    "RS_OPTIONS",
    "Correction",
    "is_threshold",
    "read_correction",
    "rs_thresholds",
]

RC = "algorithm.rollout_correction"
IS_LEVELS = ("token", "sequence")
# rollout_corr_helper.SUPPORTED_ROLLOUT_RS_OPTIONS, in its order.
RS_OPTIONS = (
    *("token_k1", "token_k2", "token_k3"),
    *("seq_sum_k1", "seq_sum_k2", "seq_sum_k3"),
    *("seq_mean_k1", "seq_mean_k2", "seq_mean_k3"),
    *("seq_max_k2", "seq_max_k3"),
)
LOSS_TYPES = ("ppo_clip", "reinforce")
KEYS = (
    *("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize"),
    *("rollout_rs", "rollout_rs_threshold", "bypass_mode", "loss_type", "_target_"),
)  # RolloutCorrectionConfig's fields in verl 0.9.1
SAFETY_BOUND = 20.0  # verl clamps log r to [-20, 20] before every statistic and weight
_STAT = {"k1": "-log r", "k2": "(log r)^2 / 2", "k3": "r - 1 - log r"}
_OVER = {"seq_sum": "summed over", "seq_mean": "averaged over", "seq_max": "the largest over"}


@dataclass
class Correction:
    """What the correction puts into the equivalent config: ``keys`` (``{klpo key: value}``)
    and ``differences`` (where klpo's keys do not do what verl does)."""

    keys: dict[str, Any] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)


@dataclass
class _Rc:
    """The settings in effect."""

    is_level: Any
    is_thr: Any
    normalize: bool
    rs: Any
    rs_thr: Any
    bypass: bool
    loss_type: str | None
    log_probs: bool


def _num(value: float) -> str:
    return f"{value:g}"


def is_threshold(spec: Any) -> tuple[float, float | None]:
    """verl's ``_parse_rollout_is_threshold``: ``(upper, lower)``, lower None for TIS.

    Raises:
        ValueError: what verl refuses (a bool, an empty or unreadable text, a bound <= 0,
            lower > upper).
    """
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"{spec!r} is not a number or a 'lower_upper' text")
    lower: float | None = None
    if isinstance(spec, str):
        text = spec.strip()
        try:
            if "_" in text:
                low, up = text.split("_", 1)
                lower, upper = float(low), float(up)
            else:
                upper = float(text)
        except ValueError:
            raise ValueError(f"{spec!r} is not a number or a 'lower_upper' text") from None
    else:
        upper = float(spec)
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{spec!r}: the bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"{spec!r}: the lower bound must be <= the upper bound")
    return upper, lower


def rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """verl's ``_parse_rollout_rs_thresholds``: ``{option: (lower, upper)}``, one comma-separated
    entry per option or one for all; a k1 option's single ``t`` means ``1/t_t``.

    Raises:
        ValueError: what verl refuses.
    """
    if spec is None or isinstance(spec, bool):
        raise ValueError("rollout_rs_threshold must be given when rollout_rs is set")
    parts = (
        [str(spec)]
        if isinstance(spec, int | float)
        else [p.strip() for p in str(spec).split(",") if p.strip()]
    )
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"{len(parts)} thresholds for {len(options)} rollout_rs options: give one for all "
            "or one per option"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    return {o: _one_rs(o, p) for o, p in zip(options, parts, strict=True)}


def _one_rs(option: str, part: str) -> tuple[float | None, float]:
    """One option's ``(lower, upper)``: k1 takes ``lower_upper`` (or ``t``: ``1/t_t``), the
    others one upper bound."""
    if "_" in part and not option.endswith("k1"):
        raise ValueError(f"{option} takes one upper bound, not {part!r}")
    low, _, up = part.partition("_") if "_" in part else ("", "", part)
    try:
        upper = float(up)
        lower = float(low) if low else (1.0 / upper if option.endswith("k1") else None)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{option}: {part!r} is not a positive number") from None
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"{option}: the thresholds must be positive, got {part!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"{option}: lower <= upper is required, got {part!r}")
    return lower, upper


def _settings(s: Settings, script: Script | None) -> _Rc:
    bypass = s.bool(f"{RC}.bypass_mode")
    return _Rc(
        is_level=s.get(f"{RC}.rollout_is"),
        is_thr=_threshold(s, script, f"{RC}.rollout_is_threshold"),
        normalize=s.bool(f"{RC}.rollout_is_batch_normalize"),
        rs=s.get(f"{RC}.rollout_rs"),
        rs_thr=_threshold(s, script, f"{RC}.rollout_rs_threshold"),
        bypass=bypass,
        loss_type=s.str(f"{RC}.loss_type") if bypass else None,
        log_probs=s.bool("actor_rollout_ref.rollout.calculate_log_probs"),
    )


def _written(script: Script | None, key: str) -> str:
    """The override's value as the script writes it (after the shell's quoting), or ''."""
    word = (script.overrides.get(key) or script.overrides.get("+" + key)) if script else None
    return word.partition("=")[2] if word else ""


def _threshold(s: Settings, script: Script | None, key: str) -> Any:
    """A threshold as Hydra reads it: a value quoted for Hydra (``'0.5_5'``) is its text."""
    value, raw = s.get(key), _written(script, key)
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    return value


def _options(rs: Any) -> list[str]:
    return list(dict.fromkeys(o.strip() for o in str(rs).split(",") if o.strip()))


def _refusals(rc: _Rc) -> list[tuple[str, str]]:
    """``(key, why)`` for each value verl refuses: a ValueError at the first step's correction
    (verl validates none of them at start-up)."""
    out: list[tuple[str, str]] = []
    if rc.is_level is not None and rc.is_level not in IS_LEVELS:
        out.append((f"{RC}.rollout_is", f"{rc.is_level!r} is not one of null, token, sequence"))
    elif rc.is_level is not None and rc.is_thr is not None:
        try:
            is_threshold(rc.is_thr)
        except ValueError as err:
            out.append((f"{RC}.rollout_is_threshold", str(err)))
    if rc.rs is not None:
        bad = [o for o in _options(rc.rs) if o not in RS_OPTIONS]
        if bad or not _options(rc.rs):
            out.append((
                f"{RC}.rollout_rs",
                f"{rc.rs!r}: {', '.join(map(repr, bad)) or 'no option'} not among verl's "
                f"options (comma-separated, all must pass): null, {', '.join(RS_OPTIONS)}",
            ))  # fmt: skip
        else:
            try:
                rs_thresholds(_options(rc.rs), rc.rs_thr)
            except ValueError as err:
                out.append((f"{RC}.rollout_rs_threshold", str(err)))
    if rc.bypass and rc.loss_type not in LOSS_TYPES:
        out.append((f"{RC}.loss_type", f"{rc.loss_type!r} is not one of {', '.join(LOSS_TYPES)}"))
    return out


def _ignored(r: Reading, s: Settings, rc: _Rc) -> None:
    """Settings the switches leave without effect."""
    keys = []
    if rc.is_level is None:
        keys += [k for k in ("rollout_is_threshold", "rollout_is_batch_normalize")
                 if s.differs(f"{RC}.{k}")]  # fmt: skip
    if rc.rs is None and s.differs(f"{RC}.rollout_rs_threshold"):
        keys.append("rollout_rs_threshold")
    if not rc.bypass and s.differs(f"{RC}.loss_type"):
        keys.append("loss_type")
    if rc.is_level is not None and rc.is_thr is None:
        r.warn(
            "warning",
            [f"{RC}.rollout_is", f"{RC}.rollout_is_threshold"],
            f"{RC}.rollout_is={rc.is_level} with rollout_is_threshold=null: verl computes no "
            "IS weight (it needs both), without a word",
        )
    if keys:
        named = [f"{RC}.{k}" for k in keys]
        r.warn(
            "warning",
            named,
            f"set but ignored: {', '.join(named)} (rollout_is_threshold and "
            "rollout_is_batch_normalize act only with rollout_is set, rollout_rs_threshold only "
            "with rollout_rs, loss_type only with bypass_mode=true)",
        )


def _unread(r: Reading, s: Settings) -> None:
    """Rollout-correction keys verl 0.9.1 does not have (another version's, composed from its
    files, or added with '+'): named, never silently dropped. verl 0.6 kept them flat under
    ``algorithm.`` (``rollout_is`` a bool, ``rollout_is_level``, ``rollout_is_mode``,
    ``rollout_is_threshold_lower``, ``rollout_is_veto_threshold``); 0.7's
    ``rollout_correction`` had ``rollout_rs_threshold_lower`` and
    ``rollout_token_veto_threshold``, which 0.8 removed."""
    other = sorted(
        k
        for k in s.values
        if (k.startswith(RC + ".") and k[len(RC) + 1 :] not in KEYS)
        or k.startswith(("algorithm.rollout_is", "algorithm.rollout_rs"))
    )
    if other:
        r.warn(
            "warning",
            other,
            f"not read: {', '.join(other)}: verl 0.9.1's rollout correction is {RC} with only "
            f"{', '.join(k for k in KEYS if k != '_target_')}, and the doctor reads its "
            "semantics; keys of an older verl (0.6's flat algorithm.rollout_is_*, 0.7's "
            "rollout_rs_threshold_lower and rollout_token_veto_threshold) are not described",
        )


def _hydra_digits(r: Reading, s: Settings, script: Script | None) -> None:
    """A ``lower_upper`` threshold Hydra reads as one number: ``0.5_5`` is 0.55 (an underscore
    between digits is a digit separator in Hydra's grammar, as in Python's)."""
    for key in (f"{RC}.rollout_is_threshold", f"{RC}.rollout_rs_threshold"):
        value, raw = s.values.get(key), _written(script, key)
        if isinstance(value, int | float) and re.fullmatch(r"[+-]?[\d.]*\d_\d[\d._]*", raw):
            r.warn(
                "warning",
                [key],
                f"{key}={raw}: Hydra reads this as the number {value!r} (an underscore between "
                f"digits is a digit separator), not as the bounds lower_upper; quote it for "
                f"Hydra ({key}=\"'{raw}'\") to give two bounds",
            )


def read_correction(r: Reading, s: Settings, script: Script | None = None) -> Correction:
    """Findings for ``algorithm.rollout_correction`` and the klpo keys that do the same."""
    rc = _settings(s, script)
    _unread(r, s)
    _hydra_digits(r, s, script)
    _ignored(r, s, rc)
    refused = _refusals(rc)
    for key, why in refused:
        r.warn(
            "error",
            [key],
            f"{key}: {why}; verl raises ValueError at the first step's rollout correction "
            "(it checks none of these at start-up) and the run stops",
        )
    is_on = rc.is_level is not None and rc.is_thr is not None
    if refused or not (is_on or rc.rs is not None or rc.bypass):
        return Correction()
    if not rc.log_probs:
        return _without_log_probs(r, rc)
    if rc.bypass:
        return _bypass(r, s, rc)
    return _decoupled(r, s, rc, is_on)


def _without_log_probs(r: Reading, rc: _Rc) -> Correction:
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    if rc.bypass:
        r.warn(
            "error",
            [key, f"{RC}.bypass_mode"],
            f"{RC}.bypass_mode=true with {key}=false: apply_bypass_mode raises ValueError "
            "(no rollout_log_probs in the batch) at the first step and the run stops",
        )
    else:
        r.warn(
            "warning",
            [key, RC],
            f"{key}=false: the rollout engine reports no log-probs, and verl's trainer skips "
            f"{RC} without a word (it runs only where rollout_log_probs is in the batch): no "
            "importance weight, no rejection; the equivalent has none either",
        )
    return Correction()


def _decoupled(r: Reading, s: Settings, rc: _Rc, is_on: bool) -> Correction:
    """bypass_mode=false: one correction per batch, on the recomputed pi_old."""
    out = Correction(keys={"rollout.engine": "vllm"})
    r.warn(
        "note",
        [RC],
        f"{RC} (bypass_mode=false, decoupled): once per batch, before the advantages, verl "
        "compares the trainer's recomputed log-probs pi_old with the rollout engine's pi_rollout, "
        "r = pi_old / pi_rollout per token (rollout_corr_helper.py), fixed over the update; klpo "
        "does the same with rollout.engine=vllm (pi_old from its own score pass, pi_behav the "
        "engine's log-probs)",
    )
    out.keys["rollout.tis_cap"] = _is_part(r, rc, out) if is_on else None
    if rc.rs is not None:
        _rs_part(r, rc, out)
    _kl_note(r, rc, is_on)
    _engine_name(s, out)
    return out


def _is_part(r: Reading, rc: _Rc, out: Correction) -> float | None:
    """The importance weight, and klpo's rollout.tis_cap for it (None: klpo has none)."""
    upper, lower = is_threshold(rc.is_thr)
    head = f"{RC}.rollout_is={rc.is_level}, rollout_is_threshold={rc.is_thr}"
    keys = [f"{RC}.rollout_is", f"{RC}.rollout_is_threshold"]
    bounds = f"r kept where {_num(lower or 0)} <= r <= {_num(upper)}, 0 outside (IcePop)"
    if rc.is_level == "sequence":
        what = f"min(R, {_num(upper)})" if lower is None else bounds.replace("r ", "R ")
        r.warn(
            "warning",
            keys,
            f"{head}: every token of a completion is weighted by its sequence ratio R = prod_t "
            f"r_t (exp of the summed log r, clamped to [-20, 20]), {what}; no klpo equivalent "
            "(klpo's TIS weight is per token): the equivalent applies none (rollout.tis_cap: null)",
        )
        out.differences.append(
            f"no klpo equivalent for {RC}.rollout_is=sequence (a sequence-level IS weight): "
            "the equivalent has rollout.tis_cap: null"
        )
        return None
    if lower is not None:
        r.warn(
            "warning",
            keys,
            f"{head}: each token's policy loss is weighted by {bounds}: tokens outside get no "
            "policy gradient; no klpo equivalent (klpo's TIS truncates at the cap and zeroes "
            "nothing): the equivalent applies no weight (rollout.tis_cap: null)",
        )
        out.differences.append(
            f"no klpo equivalent for {RC}.rollout_is_threshold={rc.is_thr} (IcePop's "
            "lower_upper bounds, zero weight outside): the equivalent has rollout.tis_cap: null"
        )
        return None
    r.warn(
        "note",
        keys,
        f"{head}: each token's policy loss is multiplied by the detached min(r, {_num(upper)}) "
        f"(truncated IS); klpo: rollout.tis_cap={_num(upper)} with rollout.engine=vllm, the "
        "same weight on the same per-token loss",
    )
    if rc.normalize:
        r.warn(
            "warning",
            [f"{RC}.rollout_is_batch_normalize"],
            f"{RC}.rollout_is_batch_normalize=true: verl divides the weights by their mean over "
            "the batch's tokens (across ranks); no klpo equivalent: klpo's weight is not "
            "normalised",
        )
        out.differences.append(
            f"no klpo equivalent for {RC}.rollout_is_batch_normalize=true: klpo's "
            f"min(r, {_num(upper)}) is not divided by its batch mean"
        )
    return upper


def _trm(opt: str, lower: float | None, upper: float) -> tuple[dict[str, Any] | None, str]:
    """klpo's algo.trm_* for one verl rejection option, or None and why not."""
    aggregate = opt.split("_")[1] if opt.startswith("seq_") else ""
    if opt in ("seq_max_k3", "seq_mean_k3"):
        return _trm_keys(upper, "k3", aggregate), "the same statistic"
    if opt == "seq_max_k2":
        delta = math.sqrt(2.0 * upper)
        why = f"max (log r)^2 / 2 <= {_num(upper)} is max |log r| <= sqrt(2 * {_num(upper)})"
        return _trm_keys(delta, "k1", "max"), why
    if opt == "seq_mean_k1" and lower is not None:
        lo, hi = math.log(lower), math.log(upper)
        if math.isclose(lo, -hi, rel_tol=1e-9, abs_tol=1e-15):
            return _trm_keys(hi, "k1", "mean"), f"|mean -log r| <= log {_num(upper)}"
        return None, (
            f"klpo's k1 band is symmetric, |mean -log r| <= delta; verl's is [log {_num(lower)}, "
            f"log {_num(upper)}] = [{lo:.6g}, {hi:.6g}] (the nearest symmetric band inside it: "
            f"delta = {min(-lo, hi):.6g})"
        )
    if opt.startswith("token_"):
        return None, "klpo's mask drops whole completions; verl's drops the token alone"
    if opt.startswith("seq_sum"):
        return None, "klpo's statistic is a completion's max or mean, not its sum"
    return None, "klpo has no k2 statistic, and a mean of (log r)^2 / 2 is no k1 or k3 mean"


def _trm_keys(delta: float, statistic: str, aggregate: str) -> dict[str, Any]:
    return {
        "algo.trm_delta": delta,
        "algo.trm_statistic": statistic,
        "algo.trm_aggregate": aggregate,
    }


def _rs_text(opt: str, lower: float | None, upper: float) -> str:
    """What one rejection option drops."""
    level, _, est = opt.rpartition("_")
    stat = _STAT[est]
    if est == "k1":
        test = f"outside [log {_num(lower or 0)}, log {_num(upper)}]"
    else:
        test = f"above {_num(upper)}"
    if level == "token":
        return f"a token whose {stat} is {test} is rejected, alone"
    return f"a completion whose {stat}, {_OVER[level]} its tokens, is {test} is rejected whole"


def _rs_part(r: Reading, rc: _Rc, out: Correction) -> None:
    """The rejection options (all must pass), and klpo's one trust-region mask."""
    opts = _options(rc.rs)
    thresholds = rs_thresholds(opts, rc.rs_thr)
    keys = [f"{RC}.rollout_rs", f"{RC}.rollout_rs_threshold"]
    mapped: str | None = None
    for opt in opts:
        lower, upper = thresholds[opt]
        trm, why = _trm(opt, lower, upper)
        head = (
            f"{RC}.rollout_rs={opt} ({_bounds(lower, upper, opt)}): {_rs_text(opt, lower, upper)}"
        )
        if trm is not None and mapped is None:
            mapped = opt
            out.keys.update(trm)
            named = ", ".join(f"{k}={_val(v)}" for k, v in trm.items())
            r.warn("note", keys, f"{head}; klpo: {named} ({why})")
            note = _clamp_note(opt, lower, upper)
            if note:
                out.differences.append(note)
            continue
        if trm is not None:
            why = f"klpo has one trust-region mask, given to {mapped}"
        r.warn("warning", keys, f"{head}; no klpo equivalent ({why})")
        out.differences.append(
            f"no klpo equivalent for {RC}.rollout_rs={opt}: the equivalent does not reject by it"
        )
    if mapped is not None:
        out.differences.append(
            "algo.trm_delta masks the policy loss only: klpo's KL term and entropy bonus keep the "
            "tokens of the completions it drops, which still count in the loss's normaliser; "
            "verl's rejection removes them from response_mask, so from all of these"
        )


def _bounds(lower: float | None, upper: float, opt: str) -> str:
    if opt.endswith("k1"):
        return f"ratio bounds {_num(lower or 0)}_{_num(upper)}"
    return f"threshold {_num(upper)}"


def _val(value: Any) -> str:
    return _num(value) if isinstance(value, float) else str(value)


def _clamp_note(opt: str, lower: float | None, upper: float) -> str | None:
    """verl clamps log r to [-20, 20] first; klpo does not: the two differ only where a
    threshold reaches a clamped token's statistic."""
    reach = {
        "k3": min(
            math.expm1(SAFETY_BOUND) - SAFETY_BOUND, math.expm1(-SAFETY_BOUND) + SAFETY_BOUND
        ),
        "k2": SAFETY_BOUND**2 / 2,
        "k1": SAFETY_BOUND,
    }[opt.rsplit("_", 1)[1]]
    value = math.log(upper) if opt.endswith("k1") else upper
    if value < reach:
        return None
    return (
        f"{RC}.rollout_rs_threshold for {opt}: verl clamps log r to [-20, 20] before the "
        "statistic and klpo does not; at a threshold this large they differ on such tokens"
    )


def _kl_note(r: Reading, rc: _Rc, is_on: bool) -> None:
    """Whether the reference KL gets the correction's weight or mask."""
    parts = [f"the reference KL term gets no importance weight from {RC}"]
    if any(t.placement == "loss" for t in r.terms):
        parts.append(
            "the KL loss (use_kl_loss) is kl_penalty(pi_theta, pi_ref) over response_mask, "
            "unweighted (workers/utils/losses.py)"
        )
    if is_on and any(t.placement == "reward" for t in r.terms):
        parts.append(
            "the in-reward KL (use_kl_in_reward) is inside the advantage, so the policy loss's "
            "IS weight multiplies it as it does the reward"
        )
    if rc.rs is not None:
        parts.append(
            "the rejection rewrites response_mask before the advantages, so a rejected token "
            "leaves the policy loss, the KL loss, the entropy bonus and the loss's token count"
        )
    if not r.terms:
        parts.append("no KL term is in effect here")
    parts.append("klpo's KL term takes no engine weight either (docs/engines.md)")
    r.warn("note", [RC], "; ".join(parts))


def _engine_name(s: Settings, out: Correction) -> None:
    name = s.str("actor_rollout_ref.rollout.name")
    if name and name not in ("vllm", "???"):
        out.differences.append(
            f"rollout.engine=vllm stands in for verl's engine "
            f"(actor_rollout_ref.rollout.name={name}): klpo's engines are hf and vllm"
        )


def _bypass(r: Reading, s: Settings, rc: _Rc) -> Correction:
    """bypass_mode=true: the engine's log-probs are pi_old; klpo has no such mode."""
    out = Correction(keys={"rollout.engine": "vllm", "rollout.tis_cap": None})
    loss = (
        "PPO's clipped loss on that ratio; rollout_is's weights are computed for the metrics "
        "only, never applied"
        if rc.loss_type == "ppo_clip"
        else "-A * w * log pi_theta, w the rollout_is weight of pi_theta / pi_rollout "
        "(none with rollout_is=null), no clip"
    )
    r.warn(
        "warning",
        [f"{RC}.bypass_mode", f"{RC}.loss_type"],
        f"{RC}.bypass_mode=true: verl skips the trainer's pi_old pass and takes the engine's "
        "log-probs as old_log_probs (apply_bypass_mode): PPO's ratio is pi_theta / pi_rollout "
        "and an in-reward KL reads the engine's log-probs; the IS weights and the rejection "
        "mask are computed in every micro-batch from the current pi_theta and act on the "
        "policy loss only (the KL loss and the entropy keep every token); "
        f"loss_type={rc.loss_type}: {loss}. No klpo equivalent: klpo always scores pi_old "
        "itself and anchors the ratio and its TIS weight there, fixed over the update; the "
        "equivalent is klpo's decoupled form with no weight and no mask",
    )
    out.differences.append(
        f"no klpo equivalent for {RC}.bypass_mode=true (loss_type={rc.loss_type}): the "
        "equivalent has rollout.engine=vllm, rollout.tis_cap: null and no mask"
    )
    if rc.rs is not None:
        nearest = [_trm(o, *t) for o, t in rs_thresholds(_options(rc.rs), rc.rs_thr).items()]
        named = next(
            (", ".join(f"{k}={_val(v)}" for k, v in t.items()) for t, _ in nearest if t), None
        )
        out.differences.append(
            f"{RC}.rollout_rs={rc.rs} in bypass mode reads the evolving pi_theta; klpo's "
            "algo.trm_delta reads pi_old, the same at the first update only"
            + (f" (the nearest: {named}): not in the equivalent" if named else "")
        )
    _kl_note_bypass(r)
    _engine_name(s, out)
    return out


def _kl_note_bypass(r: Reading) -> None:
    r.warn(
        "note",
        [RC],
        f"the reference KL term gets no importance weight from {RC}, and in bypass mode no "
        "rejection either: the KL loss (use_kl_loss) keeps every token of response_mask, "
        "unweighted (workers/utils/losses.py); klpo's KL term takes no engine weight either",
    )
