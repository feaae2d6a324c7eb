r"""klpo's KL estimators and placements inside TRL's ``GRPOTrainer``.

Written against **TRL 1.16.0** (``trl/trainer/grpo_trainer.py``) and tested with TRL 1.0.0, 1.8.0
and 1.16.0 (:data:`TESTED_VERSIONS`; docs/frameworks.md has the matrix); a version outside that
range gets a warning at import, since the override reaches into two of TRL's private methods.
TRL is an optional peer, never a dependency of klpo: ``pip install trl==1.16.0`` (it brings
accelerate).

**Through TRL's own seams.** TRL's extension points are its trainers' subclasses (transformers'
documented way to change a trainer's loss, which says that private methods can be overridden
too "but these may change without notice") and reward functions (``reward_funcs``). This is a
subclass of ``GRPOTrainer``; its reward placement is a reward function appended to
``reward_funcs``, as TRL appends an environment's own; its loss placement overrides
``_compute_loss`` and ``_get_per_token_logps_and_entropies``, because TRL adds its KL term
inside ``_compute_loss`` with no hook of its own. Where a TRL release reduces a ``loss_type``
otherwise than 1.16 (:data:`LOSS_TYPE_SINCE`), that loss type is refused there.

Usage, a drop-in replacement for ``trl.GRPOTrainer`` with two more keyword arguments::

    from trl import GRPOConfig
    from klpo.integrations.trl import KLPOGRPOTrainer

    args = GRPOConfig(..., beta=0.04)              # beta > 0: TRL loads the reference model
    trainer = KLPOGRPOTrainer(
        model, reward_funcs=..., args=args, train_dataset=...,
        kl_estimator="k3+",                        # any name in ESTIMATORS
        kl_placement="loss",                       # "loss", "reward" or "reward+loss"
    )
    trainer.train()

``klpo explain -e k3+ -p loss`` (or :func:`klpo.kl.explain`) says what the choice does; stock TRL
(k3 in the loss) follows grad KL(pi_ref ‖ pi_theta), the other direction from the KL it logs.

**What is replaced.** TRL 1.16's ``GRPOTrainer._compute_loss`` adds, when ``beta != 0``, the
per-token term ``k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1`` (times the differentiable
ratio ``exp(logp - logp_old)`` when ``use_bias_correction_kl``, its default) to the per-token loss
after every policy-side mask and ratio, reduces the sum with the ``loss_type``'s normaliser, and
logs its token mean as ``kl``. ``KLPOGRPOTrainer`` replaces exactly that term:

- **loss** placement: the term is :func:`klpo.losses.kl_loss` ``(kl_estimator, logp, logp_ref,
  logp_old=old_per_token_logps)``: any estimator, and for tokens sampled by an older policy
  (``num_iterations > 1``, generation not aligned with the optimiser step, vLLM) every estimator
  but ``k3_is`` is weighted by the detached ``pi_theta / pi_old`` so that it keeps its on-policy
  expected gradient (stock TRL's k3 takes no weight). It is reduced with :func:`klpo.reduce.reduce`
  in the mode of :data:`LOSS_TYPE_MODES` and the normaliser of :func:`loss_type_normaliser`, which
  reproduce TRL's division for every ``loss_type``, and added as ``beta · reduce(term)``.
- **reward** placement: the detached per-token estimate at the sampling policy is subtracted from
  the reward through :func:`klpo.losses.kl_reward` and summed over each completion: an extra
  reward source named ``kl_penalty`` (value ``-sum_t est_t``, weight ``beta``), appended to
  ``reward_funcs`` the way TRL 1.16 itself appends an environment's ``get_reward``. TRL then adds
  it to the weighted reward *before* the group baseline and ``scale_rewards``, and logs it as
  ``rewards/kl_penalty/mean``. No KL term enters the loss.
- **reward+loss**: both, with the same estimator and the same ``beta``.
- ``kl``: logged in every placement as the token mean of the term's value (``kl_loss``'s value:
  the estimate, importance-weighted off-policy), reduced over processes as TRL does.
- ``GRPOConfig.use_bias_correction_kl`` now only chooses the default estimator: ``kl_estimator=None``
  means ``"k3_is"`` when it is True (TRL's default) and ``"k3"`` when False, i.e. TRL's own choice.

**How, without copying TRL.** ``_compute_loss`` calls TRL's ``_compute_loss`` with ``self.beta``
set to 0 for the duration of the call (TRL then computes its policy term, entropy bonus and aux
loss as usual, adds no KL and logs no ``kl``), takes the per-token log-probs TRL computed from its
``_get_per_token_logps_and_entropies`` (no second forward pass), and adds klpo's term to the
loss TRL returns. TRL's reduction is linear in the per-token loss and its KL term is added after
every mask and ratio, so ``TRL(policy + beta·k3) = TRL(policy) + beta·reduce(k3)`` exactly; the
tests check this equality, value and gradient, for all eight ``loss_type`` values. For the reward,
``_generate_and_score_completions`` records the reference (and, when TRL computes them, the old)
log-probs from the same method; the reference call is TRL's last one before the rewards.

**What is kept**, unchanged: generation (``generate`` or vLLM), reward functions and weights,
``multi_objective_aggregation``, advantages (``scale_rewards``: group / batch / none, eps 1e-4),
the policy surrogate of every ``loss_type`` with ``epsilon``, ``epsilon_high``, ``delta``,
``importance_sampling_level``, the off-policy sequence mask, the top-entropy mask, the vLLM
importance-sampling ratio (none of which touches the KL term in TRL either), the entropy bonus, MoE
aux loss, the reference model (a copy, or the PEFT base with adapters off, ``sync_ref_model``),
``num_iterations`` and buffering, logging, checkpoints.

**Differences to know.**

- ``full`` (the exact KL over the vocabulary) is not available: TRL 1.16 computes token log-probs
  and the entropy through a fused LM head and never keeps either model's logits, so the
  reference's distribution over the vocabulary does not exist in the trainer. Use ``klpo train``.
- ``k3_is`` always uses the per-token ratio. With ``importance_sampling_level="sequence"`` TRL
  broadcasts the sequence-level ratio onto the per-token KL, which adds a spurious gradient term
  (TRL issue #6586); klpo does not.
- vLLM: the off-policy weight is ``pi_theta / pi_old`` with ``pi_old`` the training engine's
  log-probs (TRL's ``old_per_token_logps``); the engine mismatch is not corrected in the KL term,
  as in stock TRL.
- Reward placement: the penalty is the completion's summed estimate, broadcast to every token of
  the completion (not a return-to-go: earlier tokens' KL adds variance, no bias) and divided by the
  group's reward std under ``scale_rewards="group"`` (the default), which makes the effective
  coefficient differ from group to group; ``scale_rewards="none"`` keeps ``beta`` constant. With
  ``multi_objective_aggregation="normalize_then_sum"`` the ``kl_penalty`` column is normalised
  per group like any reward function. Not supported with tools or environments (TRL's
  ``tool_mask`` is not visible at reward time). The estimate is taken at the sampling policy, from
  the training engine's log-probs (one extra no-grad forward pass when TRL did not compute ``old``
  log-probs).
- ``policy_loss`` (logged by TRL only with an entropy bonus) no longer includes the KL term.
- ``beta = 0``: TRL loads no reference model; the trainer is then plain TRL (passing an explicit
  ``kl_estimator`` with ``beta = 0`` is an error).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    import trl
    from trl import GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised by a test that hides TRL
    raise ImportError(
        "klpo.integrations.trl needs TRL, an optional peer that klpo does not install. "
        "Install it with `pip install trl==1.16.0` (the version this integration is written "
        "against; it brings accelerate), or use klpo's own trainer (`klpo train`)."
    ) from err

import torch
from torch import Tensor

from klpo import kl, losses
from klpo.reduce import masked_sum, reduce

__all__ = [
    "ESTIMATORS",
    "LOSS_TYPE_MODES",
    "LOSS_TYPE_SINCE",
    "TESTED_VERSIONS",
    "TRL_VERSION",
    "KLPOGRPOTrainer",
    "loss_type_normaliser",
]

TRL_VERSION = "1.16.0"

_NO_LOGITS = (
    "the exact KL over the vocabulary needs the policy's and the reference's logits at every "
    "completion position; TRL 1.16's GRPOTrainer computes only the sampled tokens' log-probs "
    "(and the entropy) through a fused LM head and keeps no logits. Use `klpo train`"
)


def _unsupported(name: str) -> str | None:
    """Why klpo estimator ``name`` cannot be computed from what TRL's GRPOTrainer has, or None:
    those that need the logits (``kl.SPECS[name].needs_logits``, ``full``)."""
    spec = kl.SPECS.get(name)
    return _NO_LOGITS if spec is not None and spec.needs_logits else None


ESTIMATORS: Sequence[str] = kl.LOGPROB_ESTIMATORS
"""The klpo estimators :class:`KLPOGRPOTrainer` accepts: every :data:`klpo.kl.ESTIMATORS` that
works from token log-probs (:data:`klpo.kl.LOGPROB_ESTIMATORS`), i.e. all but ``full``."""

LOSS_TYPE_MODES: dict[str, str] = {
    "grpo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
    "dapo": "token-mean",
    "cispo": "token-mean",
    "vespo": "token-mean",
    "luspo": "seq-mean-token-sum",
}
"""TRL 1.16 ``loss_type`` → the :mod:`klpo.reduce` mode that aggregates like it.

With :func:`loss_type_normaliser` as the denominator the value is TRL's exactly. With each
mode's own normaliser (a whole batch in one micro-batch, no gradient accumulation) they agree
except where a completion has no valid token: TRL's ``grpo``/``sapo``/``luspo`` average over all
``B`` rows and ``dr_grpo`` divides by ``B · max_completion_length``, counting empty rows, while
klpo counts only the sequences that take part (verl's convention); ``bnpo`` and ``dapo`` agree.
"""


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


TESTED_VERSIONS: tuple[str, ...] = ("1.0.0", "1.8.0", "1.16.0")
"""The TRL releases the peer tests ran against (docs/frameworks.md, the version matrix); a
release between the oldest and the newest is taken as tested, another gets a warning."""

_trl_release = _version_tuple(getattr(trl, "__version__", "0"))

#: TRL releases whose reduction of a ``loss_type`` differs from TRL 1.16's, which
#: :func:`loss_type_normaliser` reproduces: (loss_type, first release that agrees, what differs).
#: Refused there, since klpo's KL term would not be reduced as TRL reduces its own terms.
LOSS_TYPE_SINCE: tuple[tuple[str, tuple[int, int], str], ...] = (
    (
        "luspo",
        (1, 10),
        "TRL before 1.10 weights each row by its token count without masking the per-token loss",
    ),
)

if not _version_tuple(TESTED_VERSIONS[0]) <= _trl_release <= _version_tuple(TESTED_VERSIONS[-1]):
    warnings.warn(
        f"klpo.integrations.trl is tested with TRL {', '.join(TESTED_VERSIONS)} and overrides "
        f"its private GRPOTrainer._compute_loss and _get_per_token_logps_and_entropies; TRL "
        f"{getattr(trl, '__version__', '?')} is installed. Run klpo's peer tests "
        "(tests/integrations/test_trl.py) before trusting the results.",
        stacklevel=2,
    )


def loss_type_normaliser(
    loss_type: str,
    mask: Tensor,
    *,
    max_completion_length: int,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    training: bool = True,
) -> Tensor:
    r"""The denominator TRL 1.16's ``GRPOTrainer`` divides a micro-batch's masked loss sum by.

    With ``B`` rows in the micro-batch, ``GA = accumulation_steps`` (1 when not ``training``),
    ``P = num_processes``, ``N = num_items_in_batch`` (the valid tokens of the whole generation
    batch, all processes) and ``L = max_completion_length`` (``grpo_trainer.py``, the
    ``loss_type`` branches after the KL term):

    | loss_type              | TRL's loss                                  | normaliser                     |
    | ---------------------- | ------------------------------------------- | ------------------------------ |
    | grpo, sapo             | mean_b (sum_t m x / max(n_b, 1)) / GA        | B · GA (per-sequence means)    |
    | bnpo                   | sum m x / max(sum m, 1) / GA                 | max(sum m, 1) · GA             |
    | dr_grpo                | sum m x / (B · L) / GA                       | B · L · GA                     |
    | dapo, cispo, vespo     | sum m x / (max(N, 1) / P · GA / spg)         | max(N, 1) / P · GA / spg       |
    | luspo                  | mean_b (sum_t m x) / GA                      | B · GA                         |

    (``spg = steps_per_generation``; for dapo in eval, ``max(N, 1) / P``.) So
    ``reduce(x, mask, LOSS_TYPE_MODES[loss_type], normaliser=loss_type_normaliser(...))`` is
    TRL's value for the per-token loss ``x``, and its gradient.

    Args:
        loss_type: one of :data:`LOSS_TYPE_MODES`.
        mask: ``[B, T]`` bool, the loss mask (``completion_mask``, times ``tool_mask``).
        max_completion_length: ``GRPOConfig.max_completion_length`` (used by ``dr_grpo``).
        num_items_in_batch: TRL's ``inputs["num_items_in_batch"]`` (used by dapo, cispo, vespo).
        num_processes: ``accelerator.num_processes``.
        accumulation_steps: the trainer's ``current_gradient_accumulation_steps``.
        steps_per_generation: ``GRPOConfig.steps_per_generation``.
        training: False in evaluation (no accumulation).

    Returns:
        a float64 scalar tensor on ``mask``'s device.
    """
    if loss_type not in LOSS_TYPE_MODES:
        raise ValueError(
            f"unknown TRL loss_type {loss_type!r}; klpo.integrations.trl knows: "
            f"{', '.join(LOSS_TYPE_MODES)}"
        )
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        raise TypeError("mask must be a [B, T] bool tensor (True = the token takes part)")
    ga = float(accumulation_steps) if training else 1.0
    rows = float(mask.shape[0])
    f64 = {"dtype": torch.float64, "device": mask.device}
    if loss_type in ("grpo", "sapo", "luspo"):
        return torch.tensor(rows * ga, **f64)
    if loss_type == "bnpo":
        return mask.sum().to(torch.float64).clamp(min=1.0) * ga
    if loss_type == "dr_grpo":
        return torch.tensor(rows * float(max_completion_length) * ga, **f64)
    if num_items_in_batch is None:
        raise ValueError(f"loss_type {loss_type!r} needs num_items_in_batch (TRL's input)")
    n = torch.as_tensor(num_items_in_batch, **f64).clamp(min=1.0) / num_processes
    if training:
        n = n * accumulation_steps / steps_per_generation
    return n


@dataclass
class _Call:
    """One call of TRL's ``_get_per_token_logps_and_entropies`` during a rollout."""

    model: Any
    input_ids: Tensor
    attention_mask: Tensor
    logits_to_keep: int
    args: tuple[Any, ...]  # after logits_to_keep (TRL < 1.16 passes batch_size by position)
    kwargs: dict[str, Any]
    logps: Tensor


class KLPOGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` with klpo's KL term: any estimator, in the loss, the reward or both.

    Takes every argument of ``trl.GRPOTrainer`` (TRL 1.16) and two more, keyword only. See the
    module docstring for exactly what is replaced and what is kept.

    Args:
        kl_estimator: one of :data:`ESTIMATORS`; None (default) is TRL's own choice, ``"k3_is"``
            if ``args.use_bias_correction_kl`` else ``"k3"``.
        kl_placement: ``"loss"`` (default, as TRL), ``"reward"`` or ``"reward+loss"``.

    The coefficient is ``GRPOConfig.beta`` (it must be > 0 for TRL to load the reference).

    Attributes:
        kl_estimator: the estimator in use.
        kl_placement: the placement in use.
    """

    def __init__(
        self,
        *args: Any,
        kl_estimator: str | None = None,
        kl_placement: str = "loss",
        **kwargs: Any,
    ) -> None:
        if kl_estimator is not None:
            _check_estimator(kl_estimator)
        if kl_placement not in kl.PLACEMENTS:
            raise ValueError(
                f"kl_placement={kl_placement!r} is not a placement; choose one of: "
                f"{', '.join(kl.PLACEMENTS)}"
            )
        if "reward" in kl_placement and (kwargs.get("tools") or kwargs.get("environment_factory")):
            _no_tools(kl_placement)  # fail before TRL loads the models
        self._klpo_loss_calls: list[Tensor] | None = None
        self._klpo_rollout: list[_Call] | None = None
        super().__init__(*args, **kwargs)
        if kl_estimator is not None and self.beta == 0.0:
            raise ValueError(
                f"kl_estimator={kl_estimator!r} was given but GRPOConfig.beta is 0.0, which makes "
                "TRL load no reference model and use no KL; set GRPOConfig(beta=...) > 0 "
                "(e.g. 0.04), or drop kl_estimator for no KL"
            )
        if self.loss_type not in LOSS_TYPE_MODES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is not one klpo.integrations.trl knows how TRL "
                f"reduces; supported: {', '.join(LOSS_TYPE_MODES)}"
            )
        for loss_type, since, why in LOSS_TYPE_SINCE:
            if self.loss_type == loss_type and _trl_release < since:
                raise ValueError(
                    f"loss_type={loss_type!r} with TRL {trl.__version__}: {why}, so klpo's KL "
                    f"term would be reduced differently from TRL's own terms; use TRL >= "
                    f"{since[0]}.{since[1]}, or another loss_type"
                )
        if kl_estimator is None:
            kl_estimator = "k3_is" if self.args.use_bias_correction_kl else "k3"
        self.kl_estimator = kl_estimator
        self.kl_placement = kl_placement
        self._check_first_prompt()
        if self.beta != 0.0 and "reward" in kl_placement:
            if self.tools:
                _no_tools(kl_placement)
            # Registered like TRL 1.16 registers an environment's `get_reward` (after __init__).
            self.reward_funcs.append(self._kl_penalty)
            self.reward_func_names.append("kl_penalty")
            self.reward_processing_classes.append(None)
            self.reward_weights = torch.cat(
                [self.reward_weights, torch.tensor([self.beta], dtype=self.reward_weights.dtype)]
            )

    def _check_first_prompt(self) -> None:
        """Refuse a train dataset whose first prompt, tokenized by TRL's own
        ``_tokenize_prompts``, begins with the BOS twice: a prompt rendered by a chat template
        and given as a string, to which the tokenizer adds its BOS again. klpo's rule
        (:mod:`klpo.train.models.tokens`) is TRL's: a conversational prompt's rendered text gets
        no special token added, a string gets the tokenizer's own once."""
        from klpo.train.models.tokens import Codec, StopSet, check_single_bos

        try:  # a map-style dataset of rows with a prompt (others are not checked)
            prompt = self.train_dataset[0]["prompt"]
        except (TypeError, IndexError, KeyError, NotImplementedError):
            return
        if not isinstance(prompt, str | list):
            return
        prompt_ids, _, _ = self._tokenize_prompts([prompt])
        # TRL >= 1.4 keeps the tokenizer as `_tokenizer`; 1.0 only its processing class (a
        # tokenizer, or a processor holding one).
        tok = getattr(self, "_tokenizer", None) or getattr(
            self.processing_class, "tokenizer", self.processing_class
        )
        codec = Codec(tok, StopSet(()), chat=not isinstance(prompt, str))  # (stops unused)
        text = prompt if isinstance(prompt, str) else str(prompt)
        check_single_bos(
            codec,
            list(prompt_ids[0]),
            "train_dataset[0]",
            text,
            fix="give the prompt as conversational messages ([{'role': 'user', 'content': "
            "...}]), which TRL renders with the chat template and tokenizes without adding "
            f"special tokens; or remove {tok.bos_token!r} from the start of the text",
        )

    # ----------------------------------------------------------------------------------------
    # The loss.

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
        if self.beta == 0.0:
            return super()._compute_loss(model, inputs)
        beta = self.beta
        self._klpo_loss_calls = []
        self.beta = 0.0  # TRL computes its loss without its KL term and logs no `kl`
        try:
            loss = super()._compute_loss(model, inputs)
            calls = self._klpo_loss_calls
        finally:
            self.beta = beta
            self._klpo_loss_calls = None
        if len(calls) != 1:
            raise RuntimeError(
                f"TRL's _compute_loss computed the policy's log-probs {len(calls)} times (expected "
                f"once, as in TRL {TRL_VERSION}); klpo.integrations.trl does not support TRL "
                f"{trl.__version__}"
            )
        logp = calls[0]
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        in_loss = "loss" in self.kl_placement
        with torch.set_grad_enabled(in_loss and torch.is_grad_enabled()):
            term = losses.kl_loss(
                self.kl_estimator,
                logp if in_loss else logp.detach(),
                inputs["ref_per_token_logps"],
                logp_old=inputs.get("old_per_token_logps"),
                mask=mask,
            )
        training = self.model.training
        self._log_kl(term, mask, "train" if training else "eval")
        if not in_loss:
            return loss
        normaliser = loss_type_normaliser(
            self.loss_type,
            mask,
            max_completion_length=self.max_completion_length,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation,
            training=training,
        )
        mode = LOSS_TYPE_MODES[self.loss_type]
        kl_term = reduce(term, mask, mode, normaliser=normaliser)
        return loss + beta * kl_term.to(loss.dtype)

    def _log_kl(self, term: Tensor, mask: Tensor, mode: str) -> None:
        """``kl``: the token mean of the term's value over every process, as TRL logs its ``kl``."""
        with torch.no_grad():
            local = torch.stack(
                [masked_sum(term.detach().float(), mask), mask.sum().to(torch.float32)]
            )
            total = self.accelerator.reduce(local, reduction="sum")
            self._metrics[mode]["kl"].append((total[0] / total[1].clamp(min=1.0)).item())

    # ----------------------------------------------------------------------------------------
    # Capturing TRL's log-probs (no extra forward pass).

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: Tensor,
        attention_mask: Tensor,
        logits_to_keep: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        out = super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )
        if self._klpo_loss_calls is not None:
            self._klpo_loss_calls.append(out[0])
        elif self._klpo_rollout is not None:
            self._klpo_rollout.append(
                _Call(model, input_ids, attention_mask, logits_to_keep, args, dict(kwargs), out[0])
            )
        return out

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        if self.beta == 0.0 or "reward" not in self.kl_placement:
            return super()._generate_and_score_completions(inputs)
        self._klpo_rollout = []
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._klpo_rollout = None

    # ----------------------------------------------------------------------------------------
    # The reward placement: an extra reward source.

    def _kl_penalty(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        """``-sum_t est_t`` per completion, from :func:`klpo.losses.kl_reward` (beta = 1 here;
        TRL multiplies by the reward weight, ``beta``)."""
        calls = self._klpo_rollout
        if not calls:
            raise RuntimeError(
                "the kl_penalty reward found no reference log-probs from this rollout; "
                f"klpo.integrations.trl expects TRL {TRL_VERSION}'s order (reference log-probs "
                "before rewards)"
            )
        ref = calls[-1]  # TRL's last log-prob call before the rewards is the reference's
        if self.ref_model is not None and ref.model is not self.ref_model:
            raise RuntimeError(
                "the last log-prob call before the rewards was not the reference model's; "
                f"klpo.integrations.trl expects TRL {TRL_VERSION}'s order"
            )
        self._klpo_rollout = None  # the sampling-policy forward below is not to be recorded
        try:
            if len(calls) >= 2 and calls[-2].input_ids is ref.input_ids:
                logp = calls[-2].logps  # TRL computed old_per_token_logps: the sampling policy
            else:
                with torch.no_grad():
                    logp = self._get_per_token_logps_and_entropies(  # (logps, entropies, ...)
                        self.model,
                        ref.input_ids,
                        ref.attention_mask,
                        ref.logits_to_keep,
                        *ref.args,
                        **ref.kwargs,
                    )[0]
        finally:
            self._klpo_rollout = calls
        mask = ref.attention_mask[:, -ref.logits_to_keep :].bool()
        zeros = torch.zeros(ref.logps.shape, dtype=torch.float32, device=ref.logps.device)
        shaped = losses.kl_reward(
            zeros, logp, ref.logps, mask, beta=1.0, estimator=self.kl_estimator, logp_old=logp
        )
        penalty = shaped.sum(dim=-1)
        if penalty.shape[0] != len(prompts):
            raise RuntimeError(
                f"kl_penalty: {penalty.shape[0]} completions have log-probs but TRL scores "
                f"{len(prompts)}"
            )
        return penalty.tolist()


def _no_tools(placement: str) -> None:
    raise ValueError(
        f"kl_placement={placement!r} is not supported with tools or environments: TRL's "
        "tool_mask (which tokens the policy sampled) is not visible when rewards are computed; "
        "use kl_placement='loss'"
    )


def _check_estimator(name: str) -> None:
    why = _unsupported(name)
    if why is not None:
        raise ValueError(
            f"kl_estimator={name!r} is not available in TRL's GRPOTrainer: "
            f"{why}. Available: {', '.join(ESTIMATORS)}"
        )
    if name not in ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {name!r}; choose one of: {', '.join(ESTIMATORS)}")
