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
gradient and k2 is grad KL's. ``use_kl_in_reward`` moves the term to the reward (Reinforce++)
and zeroes the loss's coefficient (``loss_functions.py:240``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.reading import DoctorError, Reading, Settings, Term, flatten, merge

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
    "grpo.num_prompts_per_step": None,
    "grpo.num_generations_per_prompt": 1,
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


def detect(doc: Any) -> tuple[int, str] | None:
    """NeMo-RL's evidence: a ``loss_fn`` section beside ``grpo``/``ppo``/``policy``, or a child
    config's ``defaults: PARENT.yaml`` (a file name, where Hydra's ``defaults`` is a list)."""
    data = doc.data or {}
    if "loss_fn" in data and set(data) & {"grpo", "policy", "ppo"}:
        return 3, "NeMo-RL's loss_fn section beside " + ", ".join(
            k for k in ("grpo", "ppo", "policy") if k in data
        )
    parent = data.get("defaults")
    if isinstance(parent, str) and parent.endswith((".yaml", ".yml")):
        return 2, f"a child config's defaults: {parent} (NeMo-RL's parent config)"
    return None


def read(doc: Any, version: str | None = None) -> Reading:
    """The ``nemo-rl`` row's reader: a GRPO/PPO YAML (its ``defaults:`` chain merged), or a
    launch script's ``run_grpo*.py --config FILE key=value ...``."""
    if doc.kind == "script":
        from klpo.doctor.launch import config_and_overrides

        ep = doc.entry()
        if ep is None or ep.framework != "nemo-rl":
            raise DoctorError(f"{doc.source}: no nemo-rl training command with --config found")
        cfg, over = config_and_overrides(ep, doc.path, doc.source)
        return read_settings(merge(load(cfg), over), doc.source, version)
    return read_settings(load(doc.path), doc.source, version)


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


def read_settings(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read a NeMo-RL GRPO/PPO config (its ``defaults:`` chain already merged)."""
    weighted = version is None or not version.startswith(RELEASE) or "+" in version
    shown = VERSION if weighted else RELEASE
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
    defaults = dict(DEFAULTS)
    if sec == "ppo":
        defaults = {k.replace("grpo.", "ppo.", 1): v for k, v in DEFAULTS.items()}
        defaults.update({"ppo.ppo_epochs": 4, "ppo.adv_estimator.name": "gae"})
    s = Settings(flatten(data), defaults, source)
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
    adv = s.str(f"{sec}.adv_estimator.name") or "grpo"
    r.algorithm, r.group_size, r.updates_per_batch = adv, n, epochs * steps
    r.asynchronous = bool(s.get(f"{sec}.async_grpo.enabled"))
    if coef == 0:
        r.warn(
            "note", ["loss_fn.reference_policy_kl_penalty"], "the KL coefficient is 0: no KL term"
        )
    elif in_reward:
        r.terms.append(
            Term(
                option=f"use_kl_in_reward=true, reference_policy_kl_type={kind}",
                framework_name=kind,
                estimator=kind,
                placement="reward",
                beta=coef,
                beta_option="loss_fn.reference_policy_kl_penalty",
                reduction="per token into the reward (Reinforce++), the loss's coefficient zeroed",
                logged_as="kl_penalty",
            )
        )
    else:
        _loss_term(r, kind, coef, weighted, approx, token)
    _equivalent(r, s, adv, n, steps, token, epochs, sec)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


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


def _equivalent(
    r: Reading, s: Settings, adv: str, n: int, steps: int, token: bool, epochs: int, sec: str
) -> None:
    algo: dict[str, Any] = {
        "name": {"grpo": "grpo", "reinforce_plus_plus": "reinforce++", "gae": "ppo"}.get(
            adv, "grpo"
        ),
        "epochs": epochs,
        "minibatches": steps,
        "loss_reduction": "token-mean" if token else "seq-mean-token-mean",
    }
    if adv not in ("grpo", "reinforce_plus_plus", "gae"):
        r.equivalent_differences.append(f"klpo has no advantage estimator {adv!r}; grpo shown")
    if adv == "grpo" and s.get(f"{sec}.use_leave_one_out_baseline") is True:
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
