"""NeMo-RL's GRPO/PPO YAML configs, read for the doctor.

Pinned: NVIDIA-NeMo/RL main at ``7ea279a`` (2026-08-22; ``nemo_rl/package_info.py`` still says
0.6.0). A config names its parent with ``defaults: FILE`` (resolved beside it, parent first, as
NeMo-RL's ``load_config`` does); what no file in the chain sets takes the loss's dataclass
defaults (``nemo_rl/algorithms/loss/loss_functions.py:128-153``: ``reference_policy_kl_penalty``
0.01, ``reference_policy_kl_type`` k3, ``kl_input_clamp_value`` 20, ``kl_output_clamp_value`` 10,
``use_kl_in_reward`` false, ``use_on_policy_kl_approximation`` false, ``token_level_loss`` true).

What the KL does (``loss_functions.py:469-510``, ``algorithms/utils.py:42-100``): since commit
``33bce20`` (PR #2506, 2026-06-24) the per-token estimate is multiplied by
w = exp(lp − sg(lp)) (value 1; with ``use_on_policy_kl_approximation``, w = pi_theta / pi_gen with
the gradient through pi_theta) *before* the ±10 output clamp, so its gradient is
E[(k + dk/dlp) ∇lp]: for k1 that is E[(d + 1)∇lp] = grad KL(pi_theta ‖ pi_ref), for k3
E[(k3 + 1 − e^{−d})∇lp] = E[d ∇lp], the same (per token it is d·∇lp: klpo's ``k3+``; with
``use_on_policy_kl_approximation`` klpo's ``k3_is``), and for k2 E[(d + d²/2)∇lp], **biased**. The r0.6.0
release (2026-04-14) predates it: there k3 is verl's clamped ``low_var_kl``, k1 has zero expected
gradient and k2 is grad KL's. ``use_kl_in_reward`` zeroes the loss's coefficient
(``loss_functions.py:240-242``) and hands the KL to the advantage estimator, where only
``reinforce_plus_plus`` and PPO's ``gae`` read it (``advantage_estimator.py:193-265, 302-410``):
under GRPO (and GDPO) the setting leaves **no KL at all**.

Keys: the pydantic models take ``extra="allow"`` (lenient): a misspelt key is kept, read by
nobody, and the default stays in force; the ``loss_fn``, ``grpo`` and ``ppo`` sections are
checked against the version's table (``klpo/assets/doctor/nemo-rl-<version>.json``, read from the
models by :mod:`klpo.doctor.tables`). Combinations NeMo-RL asserts against are named with the
assertion's line: the reference's log-probs skipped with a non-zero coefficient
(``ppo.py:1241-1242``, PPO's default skip; ``grpo.py:711-715``), a reward KL on the zero
placeholder of ``force_on_policy_ratio`` (``grpo.py:2479-2485``). Its on-policy distillation
(the ``distillation`` algorithm's configs, and GRPO's ``opd`` advantage with
``on_policy_distillation``) is :mod:`klpo.doctor.nemo_rl_distill`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from klpo.doctor import nemo_rl_distill, tables
from klpo.doctor.advice import RunShape, build_equivalent, build_intended, carry
from klpo.doctor.keys import check_keys, settle
from klpo.doctor.reading import DoctorError, Reading, Settings, Term, flatten, interpolate, merge

__all__ = ["DEFAULTS", "VERSION", "detect", "load", "read", "read_settings"]

VERSION = "0.6.0+7ea279a"
RELEASE = "0.6.0"  # the r0.6.0 release: no weight on the KL
DEFAULTS: dict[str, Any] = {
    "loss_fn.reference_policy_kl_penalty": 0.01,
    "loss_fn.reference_policy_kl_type": "k3",
    "loss_fn.kl_input_clamp_value": 20.0,
    "loss_fn.kl_output_clamp_value": 10.0,
    "loss_fn.use_kl_in_reward": False,
    "loss_fn.use_on_policy_kl_approximation": False,
    "loss_fn.token_level_loss": True,
    "grpo.num_prompts_per_step": 32,
    "grpo.num_generations_per_prompt": 16,
    "grpo.adv_estimator.name": "grpo",
    "grpo.async_grpo.enabled": False,
    "policy.train_global_batch_size": None,
    "policy.model_name": None,
    "policy.max_total_sequence_length": None,
    "policy.generation.temperature": None,
    "policy.generation.top_p": None,
    "policy.optimizer.kwargs.lr": None,
    "policy.optimizer.kwargs.weight_decay": None,
    "policy.max_grad_norm": None,
    "loss_fn.ratio_clip_min": 0.2,
    "loss_fn.ratio_clip_max": 0.2,
}
CARRIED = [
    ("policy.model_name", "model.policy"),
    ("grpo.num_prompts_per_step", "rollout.prompts_per_step"),
    ("policy.generation.temperature", "rollout.temperature"),
    ("policy.generation.top_p", "rollout.top_p"),
    ("loss_fn.ratio_clip_min", "algo.clip_low"),
    ("loss_fn.ratio_clip_max", "algo.clip_high"),
    ("policy.optimizer.kwargs.lr", "optim.lr"),
    ("policy.optimizer.kwargs.weight_decay", "optim.weight_decay"),
    ("policy.max_grad_norm", "optim.grad_clip"),
]


OTHER_ALGORITHMS = ("distillation", "dpo", "sft", "rm", "on_policy_distillation")
"""Sections of NeMo-RL's other algorithms; a distillation config (``distillation`` beside
``teacher``) is read (:mod:`klpo.doctor.nemo_rl_distill`), the others refused by name."""


def detect(doc: Any) -> tuple[int, str] | None:
    """NeMo-RL's evidence: a ``loss_fn`` section beside ``grpo``/``ppo``/``policy``, a master
    config's ``policy``, ``checkpointing`` and ``cluster`` sections, or a child config's
    ``defaults: PARENT.yaml`` (a file name, where Hydra's ``defaults`` is a list). NeMo-RL's
    distillation configs are read; its other algorithms (DPO, SFT, RM) are refused by name."""
    data = doc.data or {}
    parent = data.get("defaults")
    child = isinstance(parent, str) and parent.endswith((".yaml", ".yml"))
    if child:
        try:
            data = load(doc.path)  # the parent decides what the child is
        except DoctorError:
            return 2, f"a child config's defaults: {parent} (NeMo-RL's parent config)"
    master = {"policy", "checkpointing", "cluster"} <= set(data) or (
        "loss_fn" in data and set(data) & {"grpo", "policy", "ppo"}
    )
    if master and not set(data) & {"grpo", "ppo"}:
        if "distillation" in data and "teacher" in data:
            return 3, "NeMo-RL's distillation master config (distillation, teacher, loss_fn)" + (
                f", through its parent {parent}" if child else ""
            )
        other = [k for k in OTHER_ALGORITHMS if k in data]
        if other:
            raise DoctorError(
                f"{doc.source}: a NeMo-RL {other[0]} config; the doctor reads NeMo-RL's GRPO and "
                "PPO configs (their grpo: or ppo: section), whose losses it knows"
            )
    if master:
        return 3, "NeMo-RL's master config sections (" + ", ".join(
            k for k in ("loss_fn", "grpo", "ppo", "policy", "cluster") if k in data
        ) + ")" + (f", through its parent {parent}" if child else "")
    return None


_RESOLVERS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
              "max": max}  # nemo_rl/utils/config.py:198-204  # fmt: skip


def resolve(data: dict[str, Any]) -> dict[str, Any]:
    """The config with its interpolations evaluated as NeMo-RL's loader does (its resolvers)."""
    return interpolate(data, _RESOLVERS)


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``nemo-rl`` row's reader: a GRPO/PPO YAML (its ``defaults:`` chain merged), or a
    launch script's ``run_grpo*.py --config FILE key=value ...``."""
    if doc.kind == "script":
        from klpo.doctor.launch import config_and_overrides

        ep = doc.entry()
        if ep is None or ep.framework != "nemo-rl":
            raise DoctorError(f"{doc.source}: no nemo-rl training command with --config found")
        cfg, over = config_and_overrides(ep, doc.path, doc.source)
        return read_settings(resolve(merge(load(cfg), over)), doc.source, version)
    return read_settings(resolve(load(doc.path)), doc.source, version)


def load(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A NeMo-RL config with its ``defaults:`` chain merged (parent first)."""
    from klpo.doctor.reading import load_mapping

    data = load_mapping(path)
    parent = data.pop("defaults", None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise DoctorError(f"{path}: defaults: {parent!r} is not a file name")
    p = path.parent / parent
    if not p.exists():
        raise DoctorError(
            f"{path}: defaults: {parent} is not beside it ({p}); NeMo-RL resolves the parent "
            "config next to the child; give the directory with both"
        )
    if p.resolve() in seen:
        raise DoctorError(f"{path}: defaults: {parent} is a cycle")
    return merge(load(p, (*seen, path.resolve())), data)


# adv_estimator.name -> (klpo algorithm, whether it reads a reward-side KL, how it credits it)
ADVANTAGES: dict[str, tuple[str | None, bool, str]] = {
    "grpo": ("grpo", False, ""),
    "gdpo": (None, False, ""),
    "reinforce_plus_plus": (
        "reinforce++",
        True,
        "per token subtracted from the advantage after the prompt's mean baseline, then "
        "normalised over the batch (advantage_estimator.py:248-265)",
    ),
    "gae": ("ppo", True, "per token into the reward, then GAE (advantage_estimator.py:386-394)"),
    "raw_reward": (None, False, ""),
    "opd": (None, False, ""),  # the teacher gap per token (klpo.doctor.nemo_rl_distill)
}


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a NeMo-RL GRPO/PPO config, or a distillation config (its ``defaults:`` chain
    already merged)."""
    from klpo.doctor.frameworks import ROWS

    weighted = version is None or not version.startswith(RELEASE) or "+" in version
    shown = VERSION if weighted else RELEASE
    if "distillation" in data and "teacher" in data and not {"grpo", "ppo"} & set(data):
        return nemo_rl_distill.read_distillation(
            data, source, version, VERSION, ROWS["nemo-rl"].policy
        )
    r = Reading(framework="nemo-rl", defaults_version=shown, version=version, source=source)
    if version is not None and not version.startswith(("0.6", "0.5", "0.4")):
        r.warn(
            "warning",
            ["--framework-version"],
            f"the doctor knows NeMo-RL {VERSION} (main) and the r{RELEASE} release; {version} "
            f"is read as {shown}",
        )
    # A PPO config (nemo_rl/algorithms/ppo.py) holds its batch under ppo:, with ppo_epochs
    # (default 4, ppo.py:193) passes over each batch; GRPO's under grpo:, one pass.
    sec = "ppo" if isinstance(data.get("ppo"), dict) else "grpo"
    table = tables.load("nemo-rl", VERSION).defaults
    defaults = {**table, **{k: v for k, v in DEFAULTS.items() if k not in table}}
    if sec == "ppo":
        defaults.update(
            {
                k.replace("grpo.", "ppo.", 1): v
                for k, v in DEFAULTS.items()
                if k.startswith("grpo.") and k.replace("grpo.", "ppo.", 1) not in table
            }
        )
        defaults["ppo.adv_estimator.name"] = "gae"  # the default_factory's (ppo.py:197-207)
    flat = flatten(data)
    given = check_keys(r, flat, table, "NeMo-RL", VERSION, ROWS["nemo-rl"].policy,
                       checked=("loss_fn", sec))  # fmt: skip
    s = Settings(given, defaults, source)
    coef = s.float("loss_fn.reference_policy_kl_penalty") or 0.0
    kind = s.str("loss_fn.reference_policy_kl_type") or "k3"
    if kind not in ("k1", "k2", "k3"):
        raise DoctorError(
            f"{source}: loss_fn.reference_policy_kl_type = {kind!r}: NeMo-RL's calculate_kl "
            "raises ValueError for it; use k1, k2 or k3"
        )
    in_reward = s.bool("loss_fn.use_kl_in_reward")
    approx = s.bool("loss_fn.use_on_policy_kl_approximation")
    token = s.bool("loss_fn.token_level_loss")
    n = s.int(f"{sec}.num_generations_per_prompt") or 1
    prompts = s.int(f"{sec}.num_prompts_per_step")
    gbs = s.int("policy.train_global_batch_size")
    epochs = (s.int("ppo.ppo_epochs") or 1) if sec == "ppo" else 1
    steps = max(1, (prompts * n) // gbs) if prompts and gbs else 1
    adv = s.str(f"{sec}.adv_estimator.name") or ("gae" if sec == "ppo" else "grpo")
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    r.asynchronous = bool(s.get(f"{sec}.async_{sec}.enabled"))
    if _refused(r, s, sec, coef, in_reward):
        pass  # the run does not start: no term is in effect
    elif coef == 0:
        r.warn(
            "note", ["loss_fn.reference_policy_kl_penalty"], "the KL coefficient is 0: no KL term"
        )
    elif in_reward:
        _reward_term(r, s, sec, adv, kind, coef)
    else:
        _loss_term(r, kind, coef, weighted, approx, token)
    _structure(r, s, sec, adv, n)
    nemo_rl_distill.read_opd(r, s, sec, adv)
    _equivalent(r, s, RunShape(adv, n, epochs, steps), sec, token)
    settle(r, s.read)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _refused(r: Reading, s: Settings, sec: str, coef: float, in_reward: bool) -> bool:
    """The KL combinations NeMo-RL asserts against at start-up (the run does not start)."""
    skip = s.bool(f"{sec}.skip_reference_policy_logprobs_calculation")
    if skip and coef != 0:
        where = "ppo.py:1241-1242" if sec == "ppo" else "grpo.py:711-715"
        default = (
            ""
            if s.given(f"{sec}.skip_reference_policy_logprobs_calculation")
            else (" (PPO's default, ppo.py:181)" if sec == "ppo" else "")
        )
        r.warn(
            "error",
            [f"{sec}.skip_reference_policy_logprobs_calculation",
             "loss_fn.reference_policy_kl_penalty"],
            f"{sec}.skip_reference_policy_logprobs_calculation is true{default} with "
            f"reference_policy_kl_penalty {coef:g}: NeMo-RL asserts the coefficient is 0 when "
            f"the reference's log-probs are skipped (nemo_rl/algorithms/{where}), so the run "
            "does not start. Fix: set the coefficient to 0 (no KL), or the skip to false",
            kind="refused",
        )  # fmt: skip
        return True
    if (
        in_reward
        and coef != 0
        and s.bool("loss_fn.force_on_policy_ratio")
        and not s.get(f"{sec}.seq_logprob_error_threshold")
    ):
        r.warn(
            "error",
            ["loss_fn.use_kl_in_reward", "loss_fn.force_on_policy_ratio"],
            "use_kl_in_reward with force_on_policy_ratio (and no seq_logprob_error_threshold): "
            "the old log-probs are a zero placeholder and NeMo-RL asserts against a reward KL "
            "computed from it (nemo_rl/algorithms/grpo.py:2479-2485); the run does not start",
            kind="refused",
        )
        return True
    return False


def _reward_term(r: Reading, s: Settings, sec: str, adv: str, kind: str, coef: float) -> None:
    """use_kl_in_reward: the loss's coefficient is zeroed (loss_functions.py:240-242), and
    only an advantage estimator that reads the KL applies it."""
    _, reads, credit = ADVANTAGES.get(adv, (None, False, ""))
    if not reads:
        r.warn(
            "error",
            ["loss_fn.use_kl_in_reward", f"{sec}.adv_estimator.name"],
            f"use_kl_in_reward with the {adv} advantage estimator: no KL at all. NeMo-RL zeroes "
            "the loss's KL coefficient when use_kl_in_reward is set (loss_functions.py:240-242) "
            f"and {adv}'s advantage never reads the reward-side KL (advantage_estimator.py:57-"
            "190: the reward KL is applied only by reinforce_plus_plus and PPO's gae). Fix: "
            "use_kl_in_reward false (the KL in the loss), or adv_estimator reinforce_plus_plus",
            kind="cancelled",
        )
        return
    est = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}[kind]
    r.terms.append(
        Term(
            option=f"use_kl_in_reward=true, reference_policy_kl_type={kind}",
            framework_name=kind,
            estimator=est,
            placement="reward",
            beta=coef,
            beta_option="loss_fn.reference_policy_kl_penalty",
            reduction=credit + "; the loss's coefficient zeroed",
            value_clamp=(-10.0, 10.0),
            log_ratio_clamp=(-20.0, 20.0),
            logged_as="kl_penalty",
        )
    )


def _structure(r: Reading, s: Settings, sec: str, adv: str, n: int) -> None:
    """What the config builds: PPO's critic (gae), asynchrony per algorithm."""
    if sec == "ppo" and adv == "gae":
        r.warn("note", ["ppo.adv_estimator.name"],
               "PPO with GAE: a value model (the value: section) is trained beside the policy "
               "(ppo.py:1125-1160)", kind="structure")  # fmt: skip
    if r.asynchronous:
        age = s.get(f"{sec}.async_{sec}.max_trajectory_age_steps")
        r.warn(
            "note",
            [f"{sec}.async_{sec}.enabled"],
            f"asynchronous {sec.upper()} ({sec}.async_{sec}.enabled): trajectories up to "
            f"{age} training step(s) old are trained on, so every term sees tokens of an older "
            "policy from the first step",
            kind="structure",
        )


def _loss_term(r: Reading, kind: str, coef: float, weighted: bool, approx: bool, token: bool):
    red = "token-mean" if token else "seq-mean-token-mean"
    if weighted and approx:
        # w = pi_theta / pi_gen with the gradient through pi_theta: klpo's k3_is exactly.
        est = "k3_is" if kind == "k3" else None
        name = f"{kind} × pi_theta/pi_gen"
    elif weighted:
        # w = exp(lp − sg lp) is 1 in value, so the gradient per token is
        # k3·∇lp + (1 − e^{−d})∇lp = d·∇lp: klpo's k3+ exactly (value k3, k2's gradient).
        est = "k3+" if kind == "k3" else None
        name = f"{kind} × exp(lp − sg lp)"
    else:
        est, name = {"k3": "low_var_kl", "k1": "k1", "k2": "k2"}[kind], kind
    r.terms.append(
        Term(
            option=f"reference_policy_kl_penalty={coef:g}, reference_policy_kl_type={kind}",
            framework_name=name,
            estimator=est,
            placement="loss",
            beta=coef,
            beta_option="loss_fn.reference_policy_kl_penalty",
            reduction=red,
            value_clamp=(-10.0, 10.0) if not weighted else None,
            log_ratio_clamp=(-20.0, 20.0) if not weighted else None,
            corrected=weighted and approx,
            logged_as="kl_penalty",
        )
    )
    if weighted and kind == "k2":
        r.warn(
            "warning",
            ["loss_fn.reference_policy_kl_type"],
            "k2 after NeMo-RL's weight (main from 33bce20, PR #2506, 2026-06-24, on): the "
            "gradient is E[(d + d²/2) ∇log pi_theta], biased, not grad KL(pi_theta ‖ pi_ref); "
            "in the r0.6.0 release the same setting followed grad KL. Fix: "
            "reference_policy_kl_type k3 (or k1) on main; klpo: k2 or k3+ in the loss",
        )
    elif weighted and kind == "k1":
        r.warn(
            "note",
            ["loss_fn.reference_policy_kl_type"],
            "k1 × exp(lp − sg lp): on-policy its expected gradient is E[(d + 1)∇log pi_theta] = "
            "grad KL(pi_theta ‖ pi_ref) (klpo's k1+ follows the same; its per-sample gradient "
            "lacks the zero-mean ∇log pi_theta term)",
        )
    elif not weighted and kind == "k1":
        r.warn(
            "warning",
            ["loss_fn.reference_policy_kl_type"],
            "k1 in the loss (r0.6.0, before the weight): zero expected gradient; from main "
            "33bce20 (2026-06-24) on the same setting follows grad KL(pi_theta ‖ pi_ref)",
        )
    if weighted:
        r.warn(
            "note",
            ["loss_fn.kl_output_clamp_value"],
            "the ±10 output clamp acts on the weighted term (after the weight) and the ±20 "
            "input clamp detaches the weight where it binds (algorithms/utils.py)",
        )
    if weighted and not approx and r.off_policy:
        r.warn(
            "warning",
            ["loss_fn.use_on_policy_kl_approximation"],
            "exp(lp − sg lp) is 1 in value: on tokens of an older policy (several optimiser "
            "steps, or async GRPO) it corrects nothing; use_on_policy_kl_approximation=true "
            "weights by pi_theta / pi_gen",
        )


def _equivalent(r: Reading, s: Settings, run: RunShape, sec: str, token: bool) -> None:
    """The klpo configs: the same thing, and what was most likely meant; ``sec`` the algorithm's
    section (``grpo``, ``ppo``); ``token``: the loss is reduced per token (else per sequence)."""
    adv, n = run.adv, run.n
    name = ADVANTAGES.get(adv, (None, False, ""))[0]
    algo: dict[str, Any] = {
        "name": name or "grpo",
        "epochs": run.epochs,
        "minibatches": run.minibatches,
        "loss_reduction": "token-mean" if token else "seq-mean-token-mean",
    }
    if name is None:
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if adv == "grpo" and s.get(f"{sec}.adv_estimator.use_leave_one_out_baseline") is True:
        r.equivalent_differences.append(
            "NeMo-RL's GRPO baseline is leave-one-out (use_leave_one_out_baseline); klpo's "
            "grpo subtracts the group mean"
        )
    mapping = [(k.replace("grpo.", f"{sec}.", 1), v) for k, v in CARRIED]
    carried, missing = carry(s, mapping)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    group = algo["name"] in ("grpo", "rloo")
    build_equivalent(r, algo, {"group_size": max(n, 2) if group else n}, {}, carried, s)
    build_intended(r)
