r"""``klpo doctor --model DIR --reference DIR --data FILE``: the estimator lab on the user's models.

On a batch of the user's prompts, completions y ~ pi_theta are sampled (temperature 1, no top-k, as
:func:`klpo.train.rollout.samplers.generate`), and at every completion position t both models' full
next-token distributions are computed. That gives, per position and with the prefix held fixed,
the **exact** per-position KLs

    K_t = KL(pi_theta(· | y_<t) ‖ pi_ref(· | y_<t)),    K'_t = KL(pi_ref(· | y_<t) ‖ pi_theta(· | y_<t)),

against which each estimator's sampled value est_t (a function of the one sampled token) is
measured: per token, the error est_t - K_t (the estimate's sampling noise given the prefix; its
mean is the bias, exactly 0 in expectation for k1, k3; "sd", heavy-tail statistics); per sequence,
S_b = sum_t est_t against sum_t K_t, whose batch mean is the Rao-Blackwellised estimate of the
sequence KL(pi_theta ‖ pi_ref) (exact given the sampled prefixes).

Gradients, on the policy's parameters (or those whose name starts with ``layer``), with N the
number of completion tokens and each objective a token mean (Monte Carlo over the batch):

- targets: ``per-position θ‖ref`` = grad (1/N) sum_t K_t, ``per-position ref‖θ`` = grad (1/N)
  sum_t K'_t (exact per position), and ``sequence θ‖ref`` = grad (1/N) [sum_t K_t + sum_t log
  pi_theta(y_t) · sg(sum_{t' > t} K_t')], an unbiased estimate of the gradient of the sequence
  KL(pi_theta ‖ pi_ref) (score function for how token t changes the later positions' KL);
- per estimator: ``loss`` = grad (1/N) sum_t est_t (the term differentiated, as GRPO);
  ``reward`` = grad (1/N) sum_t sg(est_t) log pi_theta(y_t) (a per-token penalty, PPO-RLHF at
  pi_old = pi_theta); ``reward-to-go`` = grad (1/N) sum_t log pi_theta(y_t) · sg(sum_{t' >= t}
  est_t') (the penalty's returns-to-go, as klpo's GRPO credits it).

The cosine of each with each target says which gradient the choice follows *on this model pair*,
with this batch's Monte Carlo noise (rerun with another ``--seed`` or more ``--samples`` to see
it). ``klpo.kl.explain`` says what each follows in expectation on small categoricals; this is
the lab on a real model (Schulman 2020; Tang & Munos 2025, arXiv:2506.09477).

Memory: both models' logits over the batch, ``[B, C, V]`` float32, plus the policy's graph; the
gradients are flattened over the chosen parameters (``--layer`` restricts them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from klpo import kl
from klpo.doctor.reading import DoctorError
from klpo.logprobs import exact_kl, token_logprobs

__all__ = [
    "ESTIMATORS",
    "PLACEMENTS",
    "Terms",
    "gradient_cosines",
    "measure",
    "read_prompts",
    "render_measurement",
    "token_terms",
    "value_stats",
]

#: Estimators measured: every klpo estimator; the ``+`` variants and ``k3_is`` share a value with
#: their base on-policy, so their value rows repeat it while their gradients differ.
ESTIMATORS: tuple[str, ...] = kl.ESTIMATORS
PLACEMENTS: tuple[str, ...] = ("loss", "reward", "reward-to-go")
TARGETS: tuple[str, ...] = ("per-position θ‖ref", "per-position ref‖θ", "sequence θ‖ref")


def read_prompts(path: str | Path, limit: int) -> list[str]:
    """Prompts from a JSONL file (a ``prompt`` field per line) or a text file (one per line)."""
    p = Path(path)
    if not p.is_file():
        raise DoctorError(f"--data file {str(p)!r} does not exist")
    out: list[str] = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix == ".jsonl":
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DoctorError(f"{p}:{n}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DoctorError(
                    f"{p}:{n}: expected an object with a string field 'prompt'; give JSONL "
                    "with a 'prompt' per line, or a .txt file with one prompt per line"
                )
            out.append(row["prompt"])
        else:
            out.append(line)
        if len(out) == limit:
            break
    if not out:
        raise DoctorError(f"--data file {str(p)!r} holds no prompts")
    return out


@dataclass
class Terms:
    """Per-token quantities of one batch, ``[B, C]``; ``logp`` carries the policy's graph."""

    logp: Tensor
    logp_ref: Tensor
    exact: Tensor  # K_t = KL(pi_theta ‖ pi_ref) at the position (with graph)
    exact_rev: Tensor  # K'_t = KL(pi_ref ‖ pi_theta) at the position (with graph)
    logits: Tensor  # [B, C, V] policy logits (with graph), for `full`
    logits_ref: Tensor  # [B, C, V]
    mask: Tensor  # [B, C] bool


def token_terms(policy: Any, reference: Any, rollout: Any) -> Terms:
    """Both models on ``rollout`` (a :class:`klpo.train.rollout.samplers.Rollout`): log-probs and exact KLs."""
    from klpo.train.rollout.samplers import position_ids

    ids, att = rollout.input_ids, rollout.attention_mask
    pos = position_ids(att)
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    logits = policy(input_ids=ids, attention_mask=att, position_ids=pos).logits[
        :, p - 1 : p - 1 + c
    ]
    with torch.no_grad():
        ref = reference(input_ids=ids, attention_mask=att, position_ids=pos).logits
        ref = ref[:, p - 1 : p - 1 + c]
    tokens = rollout.completion_ids
    logq = torch.log_softmax(logits.float(), -1)
    logq_ref = torch.log_softmax(ref.float(), -1)
    exact_rev = (logq_ref.exp() * (logq_ref - logq)).sum(-1)
    return Terms(
        logp=token_logprobs(logits, tokens),
        logp_ref=token_logprobs(ref, tokens),
        exact=exact_kl(logits, ref),
        exact_rev=exact_rev,
        logits=logits,
        logits_ref=ref,
        mask=rollout.mask,
    )


def _estimate(name: str, t: Terms, *, detach: bool = False) -> Tensor:
    logp = t.logp.detach() if detach else t.logp
    logits = t.logits.detach() if detach else t.logits
    return kl.estimate(
        name,
        logp,
        t.logp_ref,
        logp_old=t.logp.detach(),
        logits=logits,
        logits_ref=t.logits_ref,
        mask=t.mask,
    )


def _stats(x: Tensor, exact: Tensor) -> dict[str, float]:
    """Statistics of estimates ``x`` against exact values ``exact`` (1-D, float64)."""
    n = x.numel()
    err = x - exact
    mean_exact = float(exact.mean())
    sd = float(err.std(unbiased=True)) if n > 1 else 0.0
    centred = x - x.mean()
    var = float((centred**2).mean())
    kurt = float((centred**4).mean()) / var**2 - 3.0 if var > 0 else 0.0
    return {
        "n": n,
        "mean": float(x.mean()),
        "exact": mean_exact,
        "bias": float(err.mean()),
        "bias_se": sd / math.sqrt(n) if n > 0 else 0.0,
        "sd": sd,
        "relative_sd": sd / mean_exact if mean_exact > 0 else math.inf,
        "fraction_negative": float((x < 0).double().mean()),
        "excess_kurtosis": kurt,
        "max": float(x.max()),
        "p99": float(torch.quantile(x, 0.99)) if n > 1 else float(x.max()),
    }


def value_stats(t: Terms) -> dict[str, dict[str, dict[str, float]]]:
    """Per estimator, ``{"token": stats, "sequence": stats}`` against the exact KL it estimates."""
    m = t.mask
    out: dict[str, dict[str, dict[str, float]]] = {}
    with torch.no_grad():
        for name in ESTIMATORS:
            est = _estimate(name, t, detach=True).double()
            target = t.exact_rev if name == "kl_ref_theta" else t.exact
            target = target.detach().double()
            seq_est = torch.where(m, est, 0.0).sum(-1)
            seq_exact = torch.where(m, target, 0.0).sum(-1)
            out[name] = {
                "token": _stats(est[m], target[m]),
                "sequence": _stats(seq_est[m.any(-1)], seq_exact[m.any(-1)]),
            }
    return out


def _rtg(x: Tensor, mask: Tensor, *, inclusive: bool) -> Tensor:
    """sum_{t' >= t} x (inclusive) or sum_{t' > t} x over the valid tokens of each row."""
    x = torch.where(mask, x, 0.0)
    total = x.flip(-1).cumsum(-1).flip(-1)
    return total if inclusive else total - x


def _flat_grad(objective: Tensor, params: list[Tensor]) -> Tensor:
    grads = torch.autograd.grad(objective, params, retain_graph=True, allow_unused=True)
    return torch.cat(
        [
            (g if g is not None else torch.zeros_like(p)).reshape(-1)
            for g, p in zip(grads, params, strict=True)
        ]
    ).double()


def _cos(a: Tensor, b: Tensor) -> float | None:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return None
    return float(a @ b) / (na * nb)


def gradient_cosines(
    policy: Any, t: Terms, *, layer: str | None = None, weights: Tensor | None = None
) -> dict[str, Any]:
    """Cosines of every estimator × placement's gradient to the three targets.

    Args:
        policy: the model whose parameters (``layer``: those whose name starts with it) are
            differentiated.
        t: :func:`token_terms` of a batch.
        weights: ``[B, C]`` per-token weights of every objective (default: 1/N on valid tokens);
            with the sampling probabilities of an enumerated batch the Monte Carlo means become
            exact expectations (the tests use this).
    """
    named = [(n, p) for n, p in policy.named_parameters() if p.requires_grad]
    if layer is not None:
        named = [(n, p) for n, p in named if n.startswith(layer)]
        if not named:
            raise DoctorError(
                f"--layer {layer!r} matches no parameter; names start like: "
                + ", ".join(n for n, _ in list(policy.named_parameters())[:4])
            )
    params = [p for _, p in named]
    m = t.mask
    w = torch.where(m, 1.0 / max(int(m.sum()), 1), 0.0) if weights is None else weights
    w = torch.where(m, w, 0.0).to(t.logp.dtype)

    def mean(x: Tensor) -> Tensor:
        return torch.where(m, w * x, 0.0).sum()

    logp = t.logp
    targets = {
        TARGETS[0]: _flat_grad(mean(t.exact), params),
        TARGETS[1]: _flat_grad(mean(t.exact_rev), params),
        TARGETS[2]: _flat_grad(
            mean(t.exact) + mean(logp * _rtg(t.exact.detach(), m, inclusive=False)), params
        ),
    }
    rows = []
    for name in ESTIMATORS:
        est = _estimate(name, t)
        sg = est.detach()
        objectives = {
            "loss": mean(est),
            "reward": mean(sg * logp),
            "reward-to-go": mean(logp * _rtg(sg, m, inclusive=True)),
        }
        for placement, obj in objectives.items():
            if not obj.requires_grad:
                g = torch.zeros_like(targets[TARGETS[0]])
            else:
                g = _flat_grad(obj, params)
            row: dict[str, Any] = {"estimator": name, "placement": placement}
            for target, tg in targets.items():
                row[target] = _cos(g, tg)
            row["norm_ratio"] = float(g.norm()) / max(float(targets[TARGETS[0]].norm()), 1e-300)
            rows.append(row)
    return {
        "parameters": sum(p.numel() for p in params),
        "layer": layer,
        "target_norms": {k: float(v.norm()) for k, v in targets.items()},
        "rows": rows,
    }


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
        raise DoctorError(text.replace("give a reference", "give a --reference")) from None


def measure(
    model: str,
    reference: str,
    data: str,
    *,
    layer: str | None = None,
    prompts: int = 8,
    samples: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    highlight: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """Sample on the user's prompts and measure every estimator against the exact KL (module doc)."""
    from klpo.train.models.load import load_causal_lm, load_tokenizer
    from klpo.train.rollout.samplers import generate

    for flag, value in (
        ("--prompts", prompts),
        ("--samples", samples),
        ("--max-new-tokens", max_new_tokens),
    ):
        if value < 1:
            raise DoctorError(f"{flag} must be at least 1, got {value}")
    texts = read_prompts(data, prompts)
    try:
        policy = load_causal_lm(model)
        ref = load_causal_lm(reference)
        tok = load_tokenizer(model)
    except (FileNotFoundError, OSError, ValueError) as err:
        raise DoctorError(str(err)) from None
    if policy.config.vocab_size != ref.config.vocab_size:
        raise DoctorError(
            f"--model has a vocabulary of {policy.config.vocab_size} tokens and --reference "
            f"{ref.config.vocab_size}: the KL needs the same tokenizer; give the reference the "
            "policy was trained from"
        )
    _check_same_tokenizer(tok, model, reference)
    policy.eval()
    ref.eval()
    torch.manual_seed(seed)
    rollout = generate(
        policy, tok, texts, [""] * len(texts), group_size=samples, max_new_tokens=max_new_tokens
    )
    if int(rollout.mask.sum()) == 0:
        raise DoctorError("the sampled completions hold no tokens; raise --max-new-tokens")
    t = token_terms(policy, ref, rollout)
    return {
        "model": model,
        "reference": reference,
        "data": data,
        "seed": seed,
        "sequences": int(rollout.mask.shape[0]),
        "tokens": int(rollout.mask.sum()),
        "exact": {
            "token_mean_kl_theta_ref": float(t.exact.detach()[t.mask].mean()),
            "token_mean_kl_ref_theta": float(t.exact_rev.detach()[t.mask].mean()),
            "sequence_mean_kl_theta_ref": float(
                torch.where(t.mask, t.exact.detach(), 0.0).sum(-1).mean()
            ),
        },
        "values": value_stats(t),
        "gradients": gradient_cosines(policy, t, layer=layer),
        "highlight": [list(h) for h in (highlight or [])],
    }


def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return str(x)
    return f"{x:.{digits}g}"


def render_measurement(m: dict[str, Any]) -> str:
    """The measurement for people: two value tables and one gradient table."""
    e = m["exact"]
    lines = [
        f"measured on your models: {m['sequences']} completions, {m['tokens']} tokens "
        f"(seed {m['seed']})",
        f"  exact KL(pi_theta ‖ pi_ref): {_num(e['token_mean_kl_theta_ref'], 4)} per token, "
        f"{_num(e['sequence_mean_kl_theta_ref'], 4)} per sequence; "
        f"KL(pi_ref ‖ pi_theta): {_num(e['token_mean_kl_ref_theta'], 4)} per token",
    ]
    for level in ("token", "sequence"):
        lines += [
            "",
            f"values per {level} against the exact KL (bias ± se, sd of the error, tails):",
            f"  {'estimator':<13}{'mean':>10}{'bias':>10}{'± se':>9}{'sd':>10}{'sd/KL':>8}"
            f"{'neg':>7}{'kurt':>8}{'max':>10}",
        ]
        for name, s in m["values"].items():
            v = s[level]
            lines.append(
                f"  {name:<13}{_num(v['mean']):>10}{_num(v['bias']):>10}{_num(v['bias_se'], 2):>9}"
                f"{_num(v['sd']):>10}{_num(v['relative_sd'], 2):>8}"
                f"{_num(v['fraction_negative'], 2):>7}{_num(v['excess_kurtosis'], 3):>8}"
                f"{_num(v['max']):>10}"
            )
    g = m["gradients"]
    hl = {tuple(h) for h in m.get("highlight", [])}
    where = f"parameters starting with {g['layer']!r}" if g["layer"] else "all parameters"
    lines += [
        "",
        f"gradient cosines on {where} ({g['parameters']} numbers; Monte Carlo over the batch;"
        " * = your config's terms):",
        f"  {'estimator':<13}{'placement':<14}" + "".join(f"{t:>20}" for t in TARGETS),
    ]
    for r in g["rows"]:
        mark = "*" if (r["estimator"], r["placement"].replace("-to-go", "")) in hl else " "
        lines.append(
            f" {mark}{r['estimator']:<13}{r['placement']:<14}"
            + "".join(f"{_num(r[t], 3):>20}" for t in TARGETS)
        )
    return "\n".join(lines)
