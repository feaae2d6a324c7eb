r"""``klpo probe``: is the log-prob right? Step-0 identities and invariances on the user's model.

On a batch of prompts, completions y ~ pi_theta are sampled (as the trainer samples,
:func:`klpo.train.rollout.samplers.generate`), then the log-probs log pi(y_t | y_<t) of the
sampled tokens are computed again along several paths that must agree. Each check is a row of
:data:`CHECKS`: what is compared, the quantity, its threshold. For each, the largest difference
over the completion tokens, and where it happens (row, position, token), against the threshold:

- **identity** (threshold exactly 0 in klpo's own path): at step 0 the policy that sampled is the
  policy that is updated and the reference, so

      ratio_t - 1 = exp(log pi_theta(y_t) - log pi_old(y_t)) - 1 = 0,
      KL(pi_theta(· | y_<t) ‖ pi_ref(· | y_<t)) = 0,

  with log pi_old from the trainer's scoring pass (no gradient) and log pi_theta from the
  update's forward (with gradient), both through :func:`~klpo.train.rollout.samplers.completion_hidden`
  and :func:`~klpo.train.models.backbone.token_outputs` (the fused head, :func:`klpo.logprobs.fused`),
  and pi_ref a second copy of the model loaded as the trainer loads it;
- **invariance** (default 1e-4 nats in float32): |Δ log pi(y_t)| between the trainer's layout
  (prompts left-padded, completions right-padded, the whole batch in one forward, each group's
  prompt computed once) and micro-batches of 1 and 2 rows, every row padded on the left or on
  the right, the rows in reverse order, every row whole (no shared prompt), and the sequences
  packed end to end in one row with position ids restarting at 0 and no attention mask
  (transformers then builds the block-diagonal causal mask from the position ids). These agree
  in exact arithmetic; in float32 they differ by rounding (1e-5 nats on a 30-layer model), and by
  much more when a model reads the batch's composition, ignores position ids, or attends across
  padding. A row above its threshold is computed again in float64 (:data:`EXACT_FLOAT64`), which
  tells rounding from a real difference;
- **reference** (exactly 0 when the weights are the same): KL(pi_theta ‖ pi_ref) with the
  reference as the user gives it: ``--reference`` (a second model; with other weights the row is
  information, the real KL), or the policy's LoRA adapters switched off (``--adapter``) against
  the base model loaded alone;
- **engine** (default 1e-3 nats): vLLM's log-probs of its own samples against the trainer's,
  when vLLM is importable (skipped with a note otherwise).

The failures the rows catch, in other frameworks' terms (docs/probe.md): verl-project/verl#6280
(log-probs that change with the micro-batch size: a non-zero clip fraction on-policy),
verl-project/verl#2088 and #2305 (a ratio other than 1 at the first mini-batch), THUDM/slime#774
(ppo_kl non-zero on-policy), PrimeIntellect-ai/prime-rl#2671 (a step-0 sampler/trainer KL of
0.03 on a new architecture) and #606 (a packing off-by-one that misaligned log-probs).

Shapes: B sampled sequences (prompts × samples), C completion columns, H hidden size.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from klpo.measure.errors import MeasureError
from klpo.measure.models import same_weights
from klpo.measure.prompts import Prompt, _prompt_codec, read_prompts, render_prompts

__all__ = [
    "CHECKS",
    "KINDS",
    "Check",
    "probe",
    "read_thresholds",
    "render_probe",
]


@dataclass(frozen=True)
class Check:
    """One row of the probe: ``kind`` picks the default threshold (:data:`KINDS`); ``quantity``
    is what is maximised over the completion tokens; ``means`` is said where the row fails."""

    title: str
    kind: str
    quantity: str
    means: str


KINDS: dict[str, float] = {"identity": 0.0, "invariance": 1e-4, "reference": 0.0, "engine": 1e-3}
"""The default threshold of each kind of check, in float32: exactly 0 where klpo's path computes
the same numbers twice; 1e-4 nats where two layouts of the same arithmetic round differently
(float32's rounding reached 1.6e-5 nats on SmolLM2-135M's 30 layers, docs/probe.md; a model that
reads the batch or ignores position ids is off by 1e-3 and more); 1e-3 for another engine's
kernels."""

EXACT_FLOAT64 = 1e-9
"""An invariance row above its threshold is computed again in float64: a difference below this
there means the two paths are the same arithmetic and float32 rounded them apart (its note says
so); above it, they compute different things."""

_DLOGP = "max |Δ log p|"
CHECKS: dict[str, Check] = {
    "ratio": Check(
        "step-0 ratio: update's forward vs scoring pass",
        "identity",
        "max |ratio − 1|",
        "log pi_old and log pi_theta differ at the parameters that sampled: the clip fraction and "
        "ppo_kl are non-zero on-policy (verl-project/verl#2088, #2305; THUDM/slime#774); a model "
        "with dropout in train mode does this",
    ),
    "kl_self": Check(
        "step-0 exact KL to the same model loaded again",
        "identity",
        "max KL(θ‖ref)",
        "the reference pass and the policy pass of the same weights disagree: the KL term is "
        "non-zero at step 0 and trains on the difference",
    ),
    "micro_batch_1": Check(
        "micro-batches of 1 row vs the whole batch",
        "invariance",
        _DLOGP,
        "the log-probs depend on the micro-batch: with a rollout (or scoring) micro-batch other "
        "than the update's, on-policy ratios are not 1 (verl-project/verl#6280)",
    ),
    "micro_batch_2": Check(
        "micro-batches of 2 rows vs the whole batch",
        "invariance",
        _DLOGP,
        "as for micro-batches of 1 row (verl-project/verl#6280)",
    ),
    "pad_left": Check(
        "every row padded on the left",
        "invariance",
        _DLOGP,
        "the padding reaches the real tokens (a mask or position ids not honoured)",
    ),
    "pad_right": Check(
        "every row padded on the right",
        "invariance",
        _DLOGP,
        "the padding side changes the log-probs: position ids or the mask are read wrongly",
    ),
    "order": Check(
        "rows in reverse order",
        "invariance",
        _DLOGP,
        "a row's log-probs depend on the other rows of the batch",
    ),
    "whole_rows": Check(
        "every row whole (no prompt shared across its group)",
        "invariance",
        _DLOGP,
        "the cached prompt and the whole row disagree: set rollout.share_prompt: false",
    ),
    "packing": Check(
        "packed in one row, position ids restarting, no mask",
        "invariance",
        _DLOGP,
        "packed sequences attend across their boundaries or are shifted: the model does not "
        "build the block-diagonal mask from position ids, or an off-by-one "
        "(PrimeIntellect-ai/prime-rl#606)",
    ),
    "reference": Check(
        "exact KL to --reference",
        "reference",
        "max KL(θ‖ref)",
        "the reference has the policy's weights but another forward: the KL is non-zero at "
        "step 0 (THUDM/slime#774)",
    ),
    "adapters_off": Check(
        "LoRA adapters off vs the base model loaded alone",
        "reference",
        "max KL(off‖base)",
        "the adapter-free reference is not the base model: the KL to it is wrong from step 0",
    ),
    "engine": Check(
        "vLLM's log-probs vs the trainer's",
        "engine",
        _DLOGP,
        "the sampler and the trainer disagree: importance weights and the KL inherit the gap "
        "(PrimeIntellect-ai/prime-rl#2671)",
    ),
}
"""The probe's rows, in the order printed."""


def read_thresholds(pairs: list[str]) -> dict[str, float]:
    """``NAME=VALUE`` options as thresholds: NAME a check of :data:`CHECKS` or a kind of
    :data:`KINDS` (every check of that kind), VALUE a number >= 0. A check's own entry wins over
    its kind's.

    >>> t = read_thresholds(["invariance=1e-3", "packing=0"])
    >>> t["packing"], t["order"], t["ratio"], read_thresholds([])["order"]
    (0.0, 0.001, 0.0, 0.0001)
    """
    given: dict[str, float] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        name = name.strip()
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not eq or name not in {**CHECKS, **KINDS} or not number >= 0 or math.isinf(number):
            raise MeasureError(
                f"--threshold {pair!r}: write NAME=VALUE with NAME one of "
                f"{', '.join([*KINDS, *CHECKS])} and VALUE a number >= 0, e.g. "
                "--threshold invariance=1e-4"
            )
        given[name] = number
    return {name: given.get(name, given.get(c.kind, KINDS[c.kind])) for name, c in CHECKS.items()}


# ---------------------------------------------------------------------------------------------
# The paths the log-probs take.


def _trainer_logp(
    backbone: Any, rollout: Any, *, share_prompt: bool = True, grad: bool = False
) -> Tensor:
    """``[B, C]`` log pi(y_t) through the trainer's path: the rollout's layout
    (:func:`~klpo.train.rollout.samplers.completion_hidden`) and the fused head
    (:func:`~klpo.train.models.backbone.token_outputs`); ``grad`` as the update's forward."""
    from klpo.train.models.backbone import token_outputs
    from klpo.train.rollout.samplers import completion_hidden

    with torch.set_grad_enabled(grad):
        hidden = completion_hidden(backbone, rollout, share_prompt=share_prompt)
        out = token_outputs(
            hidden, backbone.head(), rollout.completion_ids, temperature=1.0, with_entropy=False
        )
    return out.logp.detach()


def _trainer_kl(backbone: Any, ref: Any, rollout: Any) -> Tensor:
    """``[B, C]`` exact KL(pi_theta(· | y_<t) ‖ pi_ref(· | y_<t)), as the trainer's scoring pass
    computes it (:func:`klpo.logprobs.fused` with the reference's hidden states)."""
    from klpo.train.models.backbone import token_outputs
    from klpo.train.rollout.samplers import completion_hidden

    with torch.no_grad():
        hidden = completion_hidden(backbone, rollout)
        hidden_ref = completion_hidden(ref, rollout)
        out = token_outputs(
            hidden, backbone.head(), rollout.completion_ids, temperature=1.0,
            features_ref=hidden_ref, head_ref=ref.head(), with_entropy=False,
        )  # fmt: skip
    return out.kl


def _micro_batches(size: int) -> Callable[[Any, Any], Tensor]:
    """The trainer's path on micro-batches of ``size`` rows (``rollout.select``, as the update
    takes them: the batch's padding kept), put back together."""

    def run(backbone: Any, rollout: Any) -> Tensor:
        b = rollout.mask.shape[0]
        parts = [
            _trainer_logp(backbone, rollout.select(list(range(i, min(i + size, b)))))
            for i in range(0, b, size)
        ]
        return torch.cat(parts)

    return run


def _reversed(backbone: Any, rollout: Any) -> Tensor:
    rows = list(range(rollout.mask.shape[0]))[::-1]
    return _trainer_logp(backbone, rollout.select(rows)).flip(0)


def _whole_rows(backbone: Any, rollout: Any) -> Tensor:
    return _trainer_logp(backbone, rollout, share_prompt=False)


def _sequences(rollout: Any) -> list[tuple[list[int], list[int]]]:
    """Each row's prompt tokens and valid completion tokens, without padding."""
    return [
        (
            rollout.prompt_ids[b][rollout.prompt_mask[b]].tolist(),
            rollout.completion_ids[b][rollout.mask[b]].tolist(),
        )
        for b in range(rollout.mask.shape[0])
    ]


def _padded(side: str) -> Callable[[Any, Any], Tensor]:
    """Every row (prompt and completion) padded on ``side`` to the longest, positions counted
    over the real tokens (``cumsum - 1``), one forward."""

    def run(backbone: Any, rollout: Any) -> Tensor:
        from klpo.train.rollout.samplers import position_ids

        seqs = _sequences(rollout)
        width = max(len(p) + len(c) for p, c in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        att = torch.zeros(len(seqs), width, dtype=torch.long)
        starts = []
        for b, (p, c) in enumerate(seqs):
            n = len(p) + len(c)
            at = width - n if side == "left" else 0
            ids[b, at : at + n] = torch.tensor(p + c)
            att[b, at : at + n] = 1
            starts.append(at + len(p) - 1)  # the column that predicts completion token 0
        with torch.no_grad():
            hidden = backbone(ids, att, position_ids(att))
        return _head_logp(backbone, rollout, hidden, [(b, s) for b, s in enumerate(starts)])

    return run


def _packed(backbone: Any, rollout: Any) -> Tensor:
    """The sequences end to end in one row, position ids restarting at 0 at each, no attention
    mask: transformers builds the block-diagonal causal mask from the position ids."""
    seqs = _sequences(rollout)
    ids = torch.tensor([t for p, c in seqs for t in p + c])[None]
    pos = torch.cat([torch.arange(len(p) + len(c)) for p, c in seqs])[None]
    starts, at = [], 0
    for p, c in seqs:
        starts.append((0, at + len(p) - 1))
        at += len(p) + len(c)
    with torch.no_grad():
        hidden = backbone(ids, None, pos)
    return _head_logp(backbone, rollout, hidden, starts)


def _head_logp(
    backbone: Any, rollout: Any, hidden: Tensor, starts: list[tuple[int, int]]
) -> Tensor:
    """``[B, C]`` log-probs of the rollout's completion tokens from ``hidden [R, L, H]``: row b's
    token t is predicted at ``hidden[starts[b][0], starts[b][1] + t]`` (masked columns read
    zeros, and are never compared)."""
    from klpo.train.models.backbone import token_outputs

    b, c = rollout.mask.shape
    features = hidden.new_zeros(b, c, hidden.shape[-1])
    for row, (src, first) in enumerate(starts):
        n = int(rollout.mask[row].sum())
        features[row, :n] = hidden[src, first : first + n]
    with torch.no_grad():
        out = token_outputs(
            features, backbone.head(), rollout.completion_ids, temperature=1.0, with_entropy=False
        )
    return out.logp


INVARIANCES: dict[str, Callable[[Any, Any], Tensor]] = {
    "micro_batch_1": _micro_batches(1),
    "micro_batch_2": _micro_batches(2),
    "pad_left": _padded("left"),
    "pad_right": _padded("right"),
    "order": _reversed,
    "whole_rows": _whole_rows,
    "packing": _packed,
}
"""Each invariance row's path, compared with the trainer's layout on the whole batch."""


# ---------------------------------------------------------------------------------------------
# The rows.


def _worst(
    values: Tensor, mask: Tensor, rollout: Any, tok: Any
) -> tuple[float, dict[str, Any] | None]:
    """The largest of ``values [B, C]`` over the completion tokens and where it is (``inf`` at
    the first token whose value is not finite: a NaN or an infinite log-prob)."""
    v = torch.where(mask, values.double(), -math.inf)
    bad = mask & ~torch.isfinite(values)
    flat = int(bad.flatten().nonzero()[0]) if bool(bad.any()) else int(v.argmax())
    row, pos = divmod(flat, v.shape[1])
    top = math.inf if bool(bad.any()) else float(v[row, pos])
    if not top > 0:  # every token agrees (or none is compared): no place to name
        return 0.0, None
    token = int(rollout.completion_ids[row, pos])
    text = tok.decode([token]) if tok is not None else str(token)
    return top, {"row": row, "position": pos, "token": token, "text": text}


def _row(
    name: str,
    thresholds: dict[str, float],
    values: Tensor | None,
    rollout: Any,
    tok: Any,
    *,
    note: str = "",
    judged: bool = True,
) -> dict[str, Any]:
    """A row of the result: its value and place, and ``pass``/``FAIL`` against its threshold
    (``info`` where not ``judged``, ``skip`` without values)."""
    check = CHECKS[name]
    out: dict[str, Any] = {
        "check": name,
        "title": check.title,
        "kind": check.kind,
        "quantity": check.quantity,
        "threshold": thresholds[name],
        "value": None,
        "where": None,
        "status": "skip",
        "note": note,
    }
    if values is None:
        return out
    value, where = _worst(values, rollout.mask, rollout, tok)
    out["value"], out["where"] = value, where
    if math.isinf(value):  # (JSON has no infinity: the value is null, the note says why)
        out["value"], out["status"] = None, "FAIL"
        out["note"] = "not finite: a log-prob or KL is NaN or infinite on this path"
    elif not judged:
        out["status"] = "info"
    else:
        out["status"] = "pass" if value <= thresholds[name] else "FAIL"
        if out["status"] == "FAIL" and not note:
            out["note"] = check.means
    return out


def _diff(a: Tensor, b: Tensor) -> Tensor:
    return (a.double() - b.double()).abs()


# ---------------------------------------------------------------------------------------------
# The probe.


def _builtin_prompts(tok: Any, n: int) -> tuple[list[Prompt], bool]:
    """klpo's chat-arithmetic problems (``data.source: builtin-chat-arith``): the first ``n``
    held-out ones, as conversations where the tokenizer has a chat template, else as text."""
    from klpo.train.data.chat_task import ChatArithmeticTask

    chat = bool(getattr(tok, "chat_template", None))
    _, heldout = ChatArithmeticTask(n_heldout=n, n_train=1, chat=chat).splits()
    return [e.messages if chat else e.prompt for e in heldout], chat


def _load(path: str, adapter: str | None, key: str) -> Any:
    from klpo.train.models.load import load_causal_lm

    try:
        model = load_causal_lm(path, key=key)
        if adapter is not None:
            from klpo.train.models.lora import is_adapter_dir, load_adapters

            if not is_adapter_dir(adapter):
                raise MeasureError(
                    f"--adapter {adapter!r} holds no adapter_config.json; give the directory "
                    "peft's save_pretrained wrote (a klpo checkpoint's policy/)"
                )
            model = load_adapters(model, adapter)
    except (FileNotFoundError, OSError, ValueError) as err:
        if isinstance(err, MeasureError):
            raise
        raise MeasureError(str(err)) from None
    model.requires_grad_(False)
    return model


@dataclass
class _Sampled:
    """What the probe samples with and on: the policy (``model`` with its ``adapter``), its
    tokenizer and prompt codec, the rendered prompts (chat or not), the decoding and seed, and
    the rollout."""

    model: str
    adapter: str | None
    policy: Any
    tok: Any
    codec: Any
    rendered: list[str]
    chat: bool
    decoding: Any
    seed: int
    rollout: Any = None


def _sample(
    model: str,
    adapter: str | None,
    data: str | None,
    chat: bool | None,
    prompts: int,
    decoding: Any,
    seed: int,
) -> _Sampled:
    """The policy and its prompts loaded, ready to sample with ``decoding`` from ``seed``."""
    from klpo.train.models.load import load_tokenizer

    texts = read_prompts(data, prompts) if data is not None else None
    if texts is not None and not chat:
        render_prompts(None, texts, chat=False)  # a conversation needs --chat: said first
    policy = _load(model, adapter, "--model")
    try:
        tok = load_tokenizer(model, "--model")
    except (FileNotFoundError, OSError, ValueError) as err:
        raise MeasureError(str(err)) from None
    if texts is None:
        texts, builtin_chat = _builtin_prompts(tok, prompts)
        chat = builtin_chat if chat is None else chat
    rendered = render_prompts(tok, texts, chat=bool(chat))
    codec = _prompt_codec(tok, policy, rendered, data or "built-in prompts", chat=bool(chat))
    return _Sampled(model, adapter, policy.eval(), tok, codec, rendered, bool(chat), decoding, seed)


def _generate(s: _Sampled) -> Any:
    """The rollout of ``s``'s policy on its prompts (a MeasureError if it holds no tokens)."""
    from klpo.train.rollout.samplers import generate

    torch.manual_seed(s.seed)
    rollout = generate(
        s.policy, s.tok, s.rendered, [""] * len(s.rendered), s.decoding, codec=s.codec
    )
    if int(rollout.mask.sum()) == 0:
        raise MeasureError("the sampled completions hold no tokens; raise --max-new-tokens")
    return rollout


def probe(
    model: str,
    *,
    reference: str | None = None,
    adapter: str | None = None,
    data: str | None = None,
    chat: bool | None = None,
    prompts: int = 4,
    samples: int = 2,
    max_new_tokens: int = 16,
    seed: int = 0,
    thresholds: dict[str, float] | None = None,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Sample on the prompts and compute the log-probs along every path of :data:`CHECKS`.

    ``model`` and ``reference``: a directory, a model id or a ``.gguf`` file (as
    :func:`klpo.train.models.load.load_causal_lm` reads them); ``adapter``: LoRA adapters on the
    policy; ``data``: a prompts file (:func:`~klpo.measure.prompts.read_prompts`), else klpo's
    chat-arithmetic prompts; ``samples`` completions per prompt (2 or more shares the prompt
    across the group as the trainer does). Everything runs in float32 on the CPU.

    Returns ``{"model", ..., "rows": [...], "passed": bool, "seconds": float}``, a row per
    check (:func:`_row`).

    Raises:
        MeasureError: a bad option or an unloadable model (the message names it).
    """
    from klpo.train.models.backbone import Backbone
    from klpo.train.rollout.samplers import Decoding

    start = time.perf_counter()
    limits = thresholds if thresholds is not None else read_thresholds([])
    for flag, value, least in (
        ("--prompts", prompts, 1),
        ("--samples", samples, 1),
        ("--max-new-tokens", max_new_tokens, 1),
    ):
        if value < least:
            raise MeasureError(f"{flag} must be at least {least}, got {value}")
    decoding = Decoding(group_size=samples, max_new_tokens=max_new_tokens)
    s = _sample(model, adapter, data, chat, prompts, decoding, seed)
    say(
        f"probing {model}: {len(s.rendered)} prompts × {samples} completions of up to "
        f"{max_new_tokens} tokens" + (", chat template" if s.chat else "")
    )
    rollout = s.rollout = _generate(s)
    chat, policy, tok = s.chat, s.policy, s.tok
    backbone = Backbone(policy)
    rows = _identity_rows(backbone, policy, model, adapter, rollout, tok, limits)
    base = _trainer_logp(backbone, rollout)
    for name, path in INVARIANCES.items():
        if name == "whole_rows" and samples == 1:
            rows.append(_row(name, limits, None, rollout, tok, note="one completion a prompt"))
            continue
        rows.append(_row(name, limits, _diff(path(backbone, rollout), base), rollout, tok))
    _float64_recheck(backbone, policy, rollout, [r for r in rows if r["status"] == "FAIL"])
    rows += _reference_rows(backbone, s, reference, limits)
    rows.append(_engine_row(s, backbone, limits))
    return {
        "model": model,
        "reference": reference,
        "adapter": adapter,
        "data": data,
        "chat": bool(chat),
        "seed": seed,
        "sequences": int(rollout.mask.shape[0]),
        "tokens": int(rollout.mask.sum()),
        "dtype": "float32",
        "rows": rows,
        "passed": all(r["status"] != "FAIL" for r in rows),
        "seconds": time.perf_counter() - start,
    }


def _identity_rows(
    backbone: Any,
    policy: Any,
    model: str,
    adapter: str | None,
    rollout: Any,
    tok: Any,
    limits: dict[str, float],
) -> list[dict[str, Any]]:
    """The step-0 ratio (scoring pass vs the update's forward, the policy in train mode with
    gradients, as the trainer runs it) and the exact KL to the model loaded again."""
    from klpo.train.models.backbone import Backbone

    old = _trainer_logp(backbone, rollout)
    trainable = [p for n, p in policy.named_parameters() if adapter is None or "lora_" in n]
    policy.train()
    for p in trainable:
        p.requires_grad_(True)
    try:
        theta = _trainer_logp(backbone, rollout, grad=True)
    finally:
        policy.eval()
        for p in trainable:
            p.requires_grad_(False)
    ratio = (torch.exp(theta.double() - old.double()) - 1).abs()
    again = Backbone(_load(model, adapter, "--model").eval())
    kl = _trainer_kl(backbone, again, rollout)
    del again
    return [_row("ratio", limits, ratio, rollout, tok), _row("kl_self", limits, kl, rollout, tok)]


def _float64_recheck(
    backbone: Any, policy: Any, rollout: Any, failed: list[dict[str, Any]]
) -> None:
    """Each failed invariance row computed again with the policy in float64 (and put back in
    float32, exactly: every float32 is a float64): its note says whether the two paths agree
    there (float32 rounding) or not (they compute different things)."""
    failed = [r for r in failed if r["check"] in INVARIANCES and r["value"] is not None]
    if not failed:
        return
    policy.double()
    try:
        base = _trainer_logp(backbone, rollout)
        for r in failed:
            d = _diff(INVARIANCES[r["check"]](backbone, rollout), base)
            gap = float(torch.where(rollout.mask, d, 0.0).max())
            r["float64"] = gap if math.isfinite(gap) else None  # (JSON has no NaN)
            if gap <= EXACT_FLOAT64:
                r["note"] = (
                    f"float32 rounding: the paths agree in float64 (max |Δ| {gap:.1e}); raise "
                    "--threshold invariance for a model this deep"
                )
            else:
                r["note"] = f"{CHECKS[r['check']].means} (in float64 too: max |Δ| {gap:.1e})"
    finally:
        policy.float()


def _reference_rows(
    backbone: Any, s: _Sampled, reference: str | None, limits: dict[str, float]
) -> list[dict[str, Any]]:
    """KL to ``--reference`` (judged only where its weights are the policy's) and adapters off
    against the base model loaded alone."""
    from klpo.train.models.backbone import Backbone
    from klpo.train.models.lora import AdapterFreeReference

    policy, model, adapter, rollout, tok = s.policy, s.model, s.adapter, s.rollout, s.tok

    out = []
    if reference is None:
        out.append(_row("reference", limits, None, rollout, tok, note="no --reference given"))
    else:
        ref_model = _load(reference, None, "--reference").eval()
        if ref_model.config.vocab_size != policy.config.vocab_size:
            raise MeasureError(
                f"--reference has a vocabulary of {ref_model.config.vocab_size} tokens and "
                f"--model {policy.config.vocab_size}: the KL needs one tokenizer"
            )
        same = adapter is None and same_weights(policy, ref_model)
        kl = _trainer_kl(backbone, Backbone(ref_model), rollout)
        note = "" if same else "other weights: the real KL, not judged"
        out.append(_row("reference", limits, kl, rollout, tok, note=note, judged=same))
    if adapter is None:
        out.append(_row("adapters_off", limits, None, rollout, tok, note="no --adapter given"))
    else:
        base = Backbone(_load(model, None, "--model").eval())
        kl = _trainer_kl(AdapterFreeReference(backbone), base, rollout)
        out.append(_row("adapters_off", limits, kl, rollout, tok))
    return out


def _engine_row(s: _Sampled, backbone: Any, limits: dict[str, float]) -> dict[str, Any]:
    """vLLM's log-probs of its own samples (:class:`klpo.train.rollout.engines.VLLMEngine`,
    float32) against the trainer's on them; skipped where vLLM is not importable."""
    if importlib.util.find_spec("vllm") is None:
        return _row("engine", limits, None, None, None, note="vLLM is not installed here")
    if s.adapter is not None:
        return _row(
            "engine", limits, None, None, None, note="with --adapter (vLLM loads the base model)"
        )
    from klpo.train.models.load import resolve_model_path
    from klpo.train.rollout.engines import VLLMEngine, VLLMOptions

    engine = VLLMEngine(
        resolve_model_path(s.model, key="--model"),
        s.tok,
        s.decoding,
        VLLMOptions(dtype="float32", seed=s.seed, memory=0.3, max_model_len=4096),
        codec=s.codec,
    )
    try:
        rollout = engine.sample(s.rendered, [""] * len(s.rendered))
    finally:
        engine.close()
    mine = _trainer_logp(backbone, rollout)
    return _row("engine", limits, _diff(rollout.engine_logp, mine), rollout, s.tok)


# ---------------------------------------------------------------------------------------------
# For people.


def _number(x: float | None) -> str:
    if x is None:
        return "–"
    return "0" if x == 0 else f"{x:.2e}"


def _cell(row: dict[str, Any]) -> str:
    if row["status"] == "FAIL" and row["value"] is None:
        return "not finite"
    return _number(row["value"])


def render_probe(result: dict[str, Any]) -> str:
    """The probe as a table: a row per check, its largest difference, the threshold, where the
    largest happens (row, position, token) and pass / FAIL / info / skip, then what each
    failure means."""
    lines = [
        f"klpo probe {result['model']}: {result['sequences']} completions, {result['tokens']} "
        f"tokens, {result['dtype']}, seed {result['seed']}"
        + (", chat template" if result["chat"] else ""),
        "",
        f"  {'check':<54}{'quantity':<18}{'value':>10}{'threshold':>11}  {'status':<6}  where",
    ]
    for r in result["rows"]:
        w = r["where"]
        where = f"row {w['row']}, position {w['position']}, token {w['text']!r}" if w else ""
        lines.append(
            f"  {r['title']:<54}{r['quantity']:<18}{_cell(r):>10}"
            f"{_number(r['threshold']):>11}  {r['status']:<6}  {where or r['note']}"
        )
    notes = [r for r in result["rows"] if r["status"] in ("FAIL", "info") and r["note"]]
    if notes:
        lines.append("")
        lines += [f"  {r['check']} ({r['status']}): {r['note']}" for r in notes]
    failed = sum(r["status"] == "FAIL" for r in result["rows"])
    lines += [
        "",
        f"{failed} of {sum(r['status'] in ('pass', 'FAIL') for r in result['rows'])} checks "
        f"failed ({result['seconds']:.0f} s); docs/probe.md says what each means"
        if failed
        else f"every check passed ({result['seconds']:.0f} s)",
    ]
    return "\n".join(lines)
