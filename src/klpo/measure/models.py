"""The user's model pair, loaded as the trainer loads models, and checked to share a tokenizer.

Shared by every measurement on a user's models (``klpo doctor --model``)."""

from __future__ import annotations

from typing import Any

from klpo.measure.errors import MeasureError
from klpo.measure.memory import _gb, weights_bytes


def _check_same_tokenizer(tok: Any, model: str, reference: str) -> None:
    """The trainer's check (``klpo.train.preflight.check_same_tokenizer``) on the doctor's pair:
    a reference with its own tokenizer must map every token to the policy's id."""
    from klpo.train.config import ConfigError
    from klpo.train.models.load import load_tokenizer
    from klpo.train.preflight import check_same_tokenizer

    try:
        other = load_tokenizer(reference, "--reference")
    except (FileNotFoundError, OSError, ValueError):
        return  # no tokenizer files beside the reference: its ids are the policy's
    try:
        check_same_tokenizer(tok, model, other, reference, "reference")
    except ConfigError as err:
        text = str(err).replace("model.reference", "--reference").replace("model.policy", "--model")
        raise MeasureError(text.replace("give a reference", "give a --reference")) from None


def _load_pair(model: str, reference: str, free: int | None) -> tuple[Any, Any, Any]:
    """The policy and the reference (frozen, in eval mode) and the policy's tokenizer, checked
    to share a vocabulary and to fit in memory."""
    from klpo.train.models.load import load_causal_lm, load_tokenizer

    on_disk = [weights_bytes(model), weights_bytes(reference)]
    if free is not None and all(b is not None for b in on_disk) and sum(on_disk) > free:
        raise MeasureError(
            f"the two models need {_gb(sum(on_disk))} in float32 and {_gb(free)} is available"
        )
    try:
        policy = load_causal_lm(model)
        ref = load_causal_lm(reference)
        tok = load_tokenizer(model)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise MeasureError(str(err)) from None
    if policy.config.vocab_size != ref.config.vocab_size:
        raise MeasureError(
            f"--model has a vocabulary of {policy.config.vocab_size} tokens and --reference "
            f"{ref.config.vocab_size}: the KL needs the same tokenizer; give the reference the "
            "policy was trained from"
        )
    _check_same_tokenizer(tok, model, reference)
    for m in (policy, ref):
        m.eval()
        m.requires_grad_(False)
    return policy, ref, tok


def same_weights(a: Any, b: Any) -> bool:
    """Whether two loaded models hold the same weights: the same parameter and buffer names,
    shapes, dtypes and values, element for element (``torch.equal``; a tied head counts once).
    Read once, before any measurement: a pair that is one model has every KL exactly 0."""
    import torch

    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    return all(
        sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k])
        for k in sa
    )
