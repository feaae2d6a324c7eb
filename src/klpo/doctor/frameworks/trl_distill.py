"""TRL's distillation configs, read for the doctor: ``DistillationConfig`` (``trl
distillation``) and the experimental ``SDPOConfig``.

Read from TRL 1.16.0 (the installed wheel): ``trl/trainer/distillation_config.py`` (``beta`` in
[0, 1] or ``__post_init__`` refuses it), ``trl/trainer/distillation_trainer.py`` (one generation
per optimiser step, n = 1; the teacher's ``vocab_size`` must equal the student's; the divergence
over all completion tokens summed and divided by their count), ``trl/kernels/chunked_divergence.py``
(``ChunkedDivergenceFunction``: ``beta`` 0 the forward KL(teacher ‖ student), 1 the reverse,
between them the generalised JSD with m = (1 - beta) p_student + beta p_teacher, from both models'
hidden states and heads, tiled over positions and vocabulary, at ``temperature``),
``trl/scripts/distillation.py`` (the ``trl distillation`` command: a teacher is required). SDPO:
``trl/experimental/sdpo/{sdpo_config,sdpo_trainer,loss_utils}.py`` (the teacher is the student
itself, reprompted; ``distillation_mode`` sampled_token, full_logits or topk_logits). The fields
are read as :mod:`klpo.doctor.trl_config` reads every TRL config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klpo.doctor import distill, tables
from klpo.doctor.advice import build_equivalent, build_intended, carry
from klpo.doctor.reading import Reading, Settings, TeacherTerm, check_known
from klpo.doctor.trl_config import (
    CARRIED,
    CLASSES,
    LAUNCH_KEYS,
    LOSS_TYPES,
    VERSION,
    common,
    finish,
    grpo_algo,
    read_doc,
    script_fields,
    setup,
    updates,
)

__all__ = [
    "read_cli",
    "read_distillation",
    "read_distillation_doc",
    "read_sdpo",
    "read_sdpo_doc",
]

DISTILL_TRAINER = "trl/trainer/distillation_trainer.py"
SDPO_LOSS = "trl/experimental/sdpo/loss_utils.py"


def read_distillation(
    data: dict[str, Any], source: str, version: str | None = None, script: bool = False
) -> Reading:
    """Read a ``DistillationConfig``'s fields (``script``: as ``trl distillation`` runs them)."""
    r, s = setup("distillation", data, source, version)
    beta = s.float("beta")
    beta = 1.0 if beta is None else beta
    temp = s.float("temperature") or 1.0
    teacher = s.str("teacher_model_name_or_path") or ""
    r.algorithm, r.group_size, r.updates_per_batch = "on-policy distillation", 1, 1
    if not 0.0 <= beta <= 1.0:
        r.warn(
            "error",
            ["beta"],
            f"beta = {beta:g}: TRL refuses it (DistillationConfig.__post_init__: beta must be in "
            "[0.0, 1.0]) and does not start",
            kind="refused",
        )
    else:
        _divergence(r, beta, temp, teacher)
    if not teacher:
        r.warn(
            "error" if script else "note",
            ["teacher_model_name_or_path"],
            "no teacher_model_name_or_path: `trl distillation` refuses to start without one "
            "(trl/scripts/distillation.py)"
            if script
            else "no teacher_model_name_or_path: the teacher is whatever DistillationTrainer("
            "teacher_model=...) is given",
        )
    intended: dict[str, Any] = {}
    if r.teacher_terms:
        r.teacher_intended_why.append(
            "the term is exact per position and follows its own divergence's gradient there; "
            "over whole completions a per-position term in the loss follows the sum of the "
            "per-position gradients (klpo explain --teacher), and the sequence KL's gradient "
            "needs the exact KL in reward and loss"
        )
    distill.build_sections(r, teacher, intended)
    _distillation_equivalent(r, s)
    r.findings[:0] = s.findings
    r.settings = s.read
    return r


def _divergence(r: Reading, beta: float, temp: float, teacher: str) -> None:
    """Add the term a valid ``beta`` picks (0 forward KL, 1 reverse, between them the JSD) and
    the notes on how TRL computes it."""
    direction = "forward" if beta == 0 else "reverse" if beta == 1 else "jsd"
    name = {"forward": "forward KL (beta 0)", "reverse": "reverse KL (beta 1)"}.get(
        direction, f"generalised JSD (beta {beta:g})"
    )
    clamps = () if temp == 1.0 else (f"both distributions at temperature {temp:g}",)
    t = distill.exact(
        f"beta={beta:g}",
        f"DistillationTrainer: {name}",
        direction,
        1.0,
        "the loss itself",
        jsd_beta=beta if direction == "jsd" else None,
        clamps=clamps,
        teacher=teacher,
        logged_as="loss",
    )
    r.teacher_terms.append(t)
    r.warn(
        "note",
        ["beta", "teacher_model_name_or_path"],
        f"{t.framework_name}: exact at every completion position, from both models' hidden "
        "states through their heads in tiles (trl/kernels/chunked_divergence.py: neither "
        "model's [N, V] logits are formed); one vocabulary for both: TRL refuses a teacher "
        f"whose vocab_size differs ({DISTILL_TRAINER}), so a teacher with another tokenizer "
        "needs GOLD; unlike GRPO's, this beta picks the divergence, it is no coefficient",
    )
    if temp != 1.0:
        r.warn(
            "note",
            ["temperature"],
            f"temperature {temp:g} samples the completions and scales both models' logits "
            "in the divergence: the student is pulled towards the teacher's distribution at "
            f"temperature {temp:g}, not at 1",
        )


def _distillation_equivalent(r: Reading, s: Settings) -> None:
    """klpo's nearest run: grpo with one update per batch, the batch of prompts TRL trains on,
    the carried settings."""
    per_device = s.int("per_device_train_batch_size") or 1
    accum = s.int("gradient_accumulation_steps") or 1
    algo = {"name": "grpo", "epochs": 1, "minibatches": 1, "loss_reduction": "token-mean"}
    rollout: dict[str, Any] = {"group_size": 2, "prompts_per_step": per_device * accum}
    r.equivalent_differences.append(
        "TRL samples one completion per prompt and trains on no reward; klpo's grpo samples a "
        "group of at least 2 (with the teacher section and no rewards, the group only fans out "
        "sampling)"
    )
    mapping = [(k, v) for k, v in CARRIED if s.bool("use_peft") or not v.startswith("model.lora.")]
    carried, missing = carry(s, mapping)
    if missing:
        r.equivalent_differences.append(f"no klpo key (any more) for: {', '.join(missing)}")
    build_equivalent(r, algo, rollout, {}, carried, s)
    build_intended(r)


SDPO_MODES = ("sampled_token", "full_logits", "topk_logits")

# teacher_model_kind -> which weights of the student teach it
_SDPO_TEACHERS = {
    "ema": "an exponential moving average of it",
    "live": "its current weights",
    "base": "its initial weights",
}


@dataclass(frozen=True)
class _Sdpo:
    """An ``SDPOConfig``'s self-distillation settings, read once (with SDPOConfig's defaults)."""

    mode: str
    alpha: float
    weight: float
    topk: int | None
    tail: bool
    kind: str
    server: bool

    @classmethod
    def read(cls, s: Settings, source: str) -> _Sdpo:
        """The settings; an unknown ``distillation_mode`` is refused, naming the modes."""
        mode = check_known(
            s.str("distillation_mode") or "", SDPO_MODES, "distillation_mode", source
        )
        alpha = s.float("distillation_alpha")
        weight = s.float("distillation_weight")
        topk, tail = s.int("distillation_topk"), s.bool("distillation_add_tail")
        return cls(
            mode=mode,
            alpha=1.0 if alpha is None else alpha,
            weight=1.0 if weight is None else weight,
            topk=topk,
            tail=tail,
            kind=s.str("teacher_model_kind") or "ema",
            server=s.bool("use_teacher_server"),
        )

    @property
    def option(self) -> str:
        """The term's option, as the report shows it."""
        return f"distillation_mode={self.mode}, distillation_alpha={self.alpha:g}"

    @property
    def teacher(self) -> str:
        """The teacher, in words: the student itself, reprompted."""
        weights = _SDPO_TEACHERS.get(self.kind, self.kind)
        return (
            f"the student itself (teacher_model_kind={self.kind}: {weights}), reprompted with a "
            "successful rollout or feedback"
        )


def read_sdpo(data: dict[str, Any], source: str, version: str | None = None) -> Reading:
    """Read an ``SDPOConfig``'s fields (TRL's experimental self-distillation policy optimisation:
    the teacher is the student itself, reprompted with a successful rollout or feedback)."""
    r, s = setup("sdpo", data, source, version)
    c = _Sdpo.read(s, source)
    g = s.int("num_generations") or 1
    iters, reuse, assumption = updates(s)
    r.algorithm, r.group_size = "sdpo (grpo with self-distillation)", g
    common(r, s, iters, reuse, assumption)
    t = _sdpo_term(r, c)
    if 0 < c.weight < 1:
        r.warn(
            "note",
            ["distillation_weight"],
            f"distillation_weight = {c.weight:g}: the loss is {1 - c.weight:g} × GRPO's policy "
            f"loss + {c.weight:g} × the self-distillation term",
        )
    intended: dict[str, Any] = {}
    if t is not None and t.placement == "reward":
        intended["credit"] = "returns"
        r.teacher_intended_why.append(
            "credit: returns: the per-token reward with returns-to-go follows the gradient of the "
            "sequence KL(pi_theta ‖ pi_T) (klpo explain --teacher)"
        )
    elif t is not None and t.support == "top-k":
        intended.update({"estimator": "full", "top_k": None})
        r.teacher_intended_why.append(
            "estimator: full, the exact reverse KL at every position, which sees the whole "
            "vocabulary (SDPO's full_logits with distillation_alpha 1)"
        )
    r.teacher_differences.append(
        "SDPO's teacher is the student itself reprompted with feedback; klpo's teacher mode "
        "takes a separate, fixed teacher model"
    )
    distill.build_sections(r, None, intended)
    algo = grpo_algo(r, iters, reuse, check_known(
        s.str("loss_type") or "", LOSS_TYPES, "loss_type", source), str(s.get("scale_rewards"))
    )  # fmt: skip
    finish(r, s, algo, {"group_size": g})
    return r


def _sdpo_term(r: Reading, c: _Sdpo) -> TeacherTerm | None:
    """Add the self-distillation term ``c`` picks, with its findings (a zero weight, the refused
    sampled-token JSD, the server's top-k, the support bias, the direction); None where there is
    none."""
    keys = ["distillation_mode", "distillation_alpha"]
    t = None
    if c.weight == 0:
        r.warn(
            "note",
            ["distillation_weight"],
            "distillation_weight = 0: the loss is GRPO's policy loss alone; no teacher term",
        )
    elif c.mode == "sampled_token":
        if c.alpha != 1.0:
            r.warn(
                "error",
                keys,
                f"distillation_mode=sampled_token with distillation_alpha={c.alpha:g}: TRL "
                "refuses it (SDPOConfig.__post_init__: the sampled-token loss is the reverse KL "
                "only) and does not start",
                kind="refused",
            )
        else:
            t = distill.sampled(
                c.option, "SDPO sampled_token", "k1", "reward", c.weight, "distillation_weight",
                credit="token", teacher=c.teacher, logged_as="self_distillation/loss",
            )  # fmt: skip
            distill.per_token_credit(
                r, t, keys, f"{SDPO_LOSS}: sg(log pi_theta - log pi_T) · log pi_theta per token"
            )
    elif c.mode == "topk_logits" and c.server:
        r.warn(
            "note",
            ["use_teacher_server", "distillation_mode"],
            "use_teacher_server with topk_logits: the server returns the teacher's own top-k, so "
            "the support is the teacher's, not the student's; the doctor has no row for that "
            "form (sdpo_trainer.py: _compute_server_distillation_loss)",
        )
    else:
        t = _sdpo_vocab_term(c)
        if c.mode == "topk_logits" and c.alpha == 1.0 and not c.tail:
            distill.support_bias(
                r, t, keys, f"{SDPO_LOSS}: compute_topk_self_distillation_loss",
                "distillation_add_tail=true keeps one bucket for the rest of the vocabulary",
            )  # fmt: skip
    if t is not None:
        r.teacher_terms.append(t)
        if c.mode != "sampled_token":
            r.warn(
                "note",
                keys,
                f"distillation_alpha={c.alpha:g}: {SDPO_LOSS}'s compute_divergence calls "
                "F.kl_div(input, target), which is KL(target ‖ input): alpha 0 passes (student, "
                "teacher), the forward KL(pi_T ‖ pi_theta); alpha 1 passes (teacher, student), "
                "the reverse KL(pi_theta ‖ pi_T), as SDPOConfig's help says. A review of the PR "
                "that added it (huggingface/trl#4935) read F.kl_div's arguments the other way "
                "and called the two swapped; the code was right. The doctor reads the direction "
                "from the call, not the name",
            )
    return t


def _sdpo_vocab_term(c: _Sdpo) -> TeacherTerm:
    """full_logits' exact divergence, or topk_logits' on the student's top-k."""
    alpha, topk, tail = c.alpha, c.topk, c.tail
    if c.mode == "full_logits":
        direction = "forward" if alpha == 0 else "reverse" if alpha == 1 else "jsd"
        return distill.exact(
            c.option, f"SDPO full_logits (alpha {alpha:g})", direction, c.weight,
            "distillation_weight", jsd_beta=alpha if direction == "jsd" else None,
            teacher=c.teacher, logged_as="self_distillation/loss",
        )  # fmt: skip
    key = None
    if alpha == 1.0:
        key = "student_topk_tail" if tail else "student_topk_renorm"
    how = "with one tail bucket for the rest" if tail else "renormalised there"
    return TeacherTerm(
        option=c.option + f", distillation_topk={topk}, distillation_add_tail={str(tail).lower()}",
        framework_name=f"SDPO topk_logits (alpha {alpha:g})",
        divergence=f"the divergence at alpha {alpha:g} (1: reverse KL(pi_theta ‖ pi_T)) of both "
        f"models on the student's top-{topk}, {how}",
        direction="reverse" if alpha == 1 else "forward" if alpha == 0 else f"JSD({alpha:g})",
        support="top-k",
        placement="loss",
        beta=c.weight,
        beta_option="distillation_weight",
        top_k=topk,
        topk_of="student",
        table_key=key,
        teacher=c.teacher,
        logged_as="self_distillation/loss",
    )


# keys only DistillationConfig / SDPOConfig have among TRL's configs: positive evidence
_DISTILL_ONLY = frozenset({"teacher_model_name_or_path", "teacher_model_revision",
                           "teacher_model_init_kwargs"})  # fmt: skip
_SDPO_ONLY = frozenset({"distillation_mode", "distillation_alpha", "distillation_weight",
                        "distillation_topk", "distillation_add_tail", "distillation_is_clip",
                        "teacher_model_kind", "use_successful_as_teacher"})  # fmt: skip


def _distill_kind(doc: Any, kind: str) -> tuple[int, str] | None:
    """Evidence that ``doc`` is a ``kind`` (``distillation`` or ``sdpo``) config: its Python
    call, or a mapping of mostly its fields holding one only it has."""
    cls = CLASSES[kind]
    if doc.kind == "python":
        name, _, _, line = doc.call()
        return (3, f"a {cls}(...) call (line {line})") if name == cls else None
    if doc.kind != "mapping":
        return None
    data = doc.data or {}
    keys = set(data)
    only = keys & (_DISTILL_ONLY if kind == "distillation" else _SDPO_ONLY)
    if not only or any(isinstance(v, dict) for v in data.values()):
        return None
    table = tables.load(f"trl-{kind}", VERSION)
    known = keys & {*table.defaults, *(table.cli or {}), *LAUNCH_KEYS}
    if len(known) < 0.75 * len(keys):
        return None
    return 3, f"{len(known)} of its {len(keys)} keys are {cls} fields, {sorted(only)[0]} its own"


def detect_distillation(doc: Any) -> tuple[int, str] | None:
    return _distill_kind(doc, "distillation")


def detect_sdpo(doc: Any) -> tuple[int, str] | None:
    return _distill_kind(doc, "sdpo")


def read_cli(doc: Any, version: str | None = None) -> Reading:
    """A launch script running ``trl distillation [--config FILE] [--field value ...]`` (or
    TRL's ``scripts/distillation.py``): the file's fields under the command line's, as
    ``TrlParser`` takes them; the launcher's process count as ``num_processes``."""
    _, fields = script_fields(doc, "trl-distillation", "`trl distillation`")
    return read_distillation(fields, doc.source, version, script=True)


def read_distillation_doc(doc: Any, version: str | None = None) -> Reading:
    """The ``trl-distillation`` row's reader: a DistillationConfig's fields (YAML/JSON, a
    script's ``trl distillation``, a Python script's ``DistillationConfig(...)``)."""
    return read_doc(doc, version, read_distillation, read_cli)


def read_sdpo_doc(doc: Any, version: str | None = None) -> Reading:
    """The ``trl-sdpo`` row's reader: an SDPOConfig's fields (YAML/JSON, a Python script's
    ``SDPOConfig(...)``)."""
    return read_doc(doc, version, read_sdpo)
