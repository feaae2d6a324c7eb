r"""``klpo explain``: which KL each estimator logs and which gradient it follows, derived.

Nothing here is typed in: each answer comes from evaluating the estimator itself, in float64, on
every outcome of a few seeded random categoricals and comparing the exact expected value and
gradient with those of KL(pi_theta ‖ pi_ref) and KL(pi_ref ‖ pi_theta) (:func:`explain`). The
answers for the built-in rows are shipped as a table (``klpo/assets/explain.json``) so that
readers without torch (``klpo doctor``) have them: ``python -m klpo.lab.tables`` writes it, and a
test regenerates it unchanged (:func:`klpo.registry.explanation` reads it).
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch
from torch import Tensor

from klpo.estimators import estimate, k1
from klpo.registry import (
    ESTIMATORS,
    GRAD_OTHER,
    GRAD_REF_THETA,
    GRAD_THETA_REF,
    GRAD_ZERO,
    PLACEMENTS,
    REF_SAMPLED,
    SPECS,
    THETA_REF,
    Explanation,
    Placement,
    Spec,
    _placement,
    _spec,
    refusal,
)

__all__ = ["expected_value_and_gradient", "explain", "explain_all", "table"]


def explain(name: str, placement: Placement, *, on_policy: bool = True) -> Explanation:
    """Say what estimator ``name`` does in ``placement``: its value, bias, sign and gradient.

    The answer is *derived*, not looked up: the estimator itself is evaluated, in float64, on
    every outcome of a few seeded random categoricals (softmax logits, vocabulary 6), each outcome
    weighted by its probability under the sampling policy, and the exact expected value and
    expected gradient with respect to the logits are compared with KL(pi_theta ‖ pi_ref),
    KL(pi_ref ‖ pi_theta) and their gradients. Change an estimator and its explanation changes.

    The placements, with samples y ~ pi_s (pi_s = pi_theta on-policy, pi_old off-policy) and
    ratio = pi_theta(y) / sg(pi_s(y)):

    - ``"loss"``: E_s[grad est(y)], the term differentiated with the samples held fixed (as GRPO);
    - ``"reward"``: E_s[ratio(y) · sg(est_s(y)) · grad log pi_theta(y)], the detached estimate of
      the sampling time used as a penalty in the (PPO-ratio) policy gradient, as PPO-RLHF;
    - ``"reward+loss"``: the sum of the two.

    Args:
        name: one of :data:`ESTIMATORS`.
        placement: one of :data:`PLACEMENTS` (``"none"`` is an error: it places no KL). The
            estimators of :data:`REF_SAMPLED` have only ``"loss"``; other placements raise a
            ValueError with the reason (:func:`refusal`).
        on_policy: False to ask about tokens sampled from an older policy pi_old, with no
            correction beyond what the estimator itself carries (``k3_is`` carries one).

    Returns:
        an :class:`Explanation`.

    Raises:
        ValueError: an unknown estimator or placement, or a placement that makes no sense for it.

    Example:
        >>> from klpo import kl
        >>> kl.explain("k3", "loss").gradient  # GRPO's k3 in the loss: the other direction
        'grad KL(pi_ref ‖ pi_theta)'
        >>> kl.explain("k1", "reward").gradient, kl.explain("k1", "loss").gradient
        ('grad KL(pi_theta ‖ pi_ref)', 'zero')
    """
    spec = SPECS[name] if name in REF_SAMPLED else _spec(name)
    if _placement(placement) == "none":
        raise ValueError(
            "placement 'none' puts no KL in the reward or the loss, so there is no gradient to "
            f"explain; choose one of: {', '.join(PLACEMENTS)}"
        )
    if spec.ref_sampled:
        reason = refusal(name, placement)
        if reason is not None:
            raise ValueError(reason)
        return _derive_ref_sampled(name, spec)
    return _derive(name, spec, placement, bool(on_policy))


def explain_all(*, on_policy: bool = True) -> list[Explanation]:
    """:func:`explain` for every estimator in every placement, in registry order.

    Example:
        >>> from klpo import kl
        >>> [e.gradient for e in kl.explain_all() if e.estimator == "k2"]  # reward, loss, both
        ['other (biased)', 'grad KL(pi_theta ‖ pi_ref)', 'other (biased)']
    """
    return [explain(n, p, on_policy=on_policy) for n in ESTIMATORS for p in PLACEMENTS]


_VOCAB = 6
_CASES = 4
_TOL = 1e-9


@functools.cache
def _cases() -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
    """Seeded (logits, logits_ref, logits_old) triples; the last has logits far apart."""
    gen = torch.Generator().manual_seed(20200307)  # the date of Schulman's post
    out = []
    for i in range(_CASES):
        scale = 3.0 if i == _CASES - 1 else 1.0
        theta = scale * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        ref = scale * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        old = theta + 0.5 * torch.randn(_VOCAB, generator=gen, dtype=torch.float64)
        out.append((theta, ref, old))
    return tuple(out)


def _terms(name: str, logits: Tensor, ref: Tensor, logp_old: Tensor) -> Tensor:
    """The estimator at every outcome y of the categorical, as a [1, V] batch of tokens."""
    logp = torch.log_softmax(logits, -1)
    logp_ref = torch.log_softmax(ref, -1)
    v = logits.numel()
    return estimate(
        name,
        logp[None],
        logp_ref[None],
        logp_old=logp_old[None],
        logits=logits.expand(1, v, v),
        logits_ref=ref.expand(1, v, v),
    )[0].to(torch.float64)


def expected_value_and_gradient(
    name: str,
    placement: str,
    logits: Tensor,
    logits_ref: Tensor,
    logits_old: Tensor | None = None,
) -> tuple[float, Tensor]:
    """Exact E_s[est] and the exact expected gradient of ``placement`` w.r.t. ``logits``.

    Enumerates every outcome of the categorical softmax(``logits``) (``[V]``, float64), the
    samples drawn from pi_s = softmax(``logits_old``) if given, else from pi_theta itself.
    Used by :func:`explain` and by the lab.

    Example:
        >>> import torch
        >>> from klpo import kl
        >>> theta = torch.tensor([0.0, 1.0], dtype=torch.float64)  # pi_theta = (0.269, 0.731)
        >>> ref = torch.zeros(2, dtype=torch.float64)  # pi_ref uniform
        >>> value, grad = kl.expected_value_and_gradient("k1", "loss", theta, ref)
        >>> round(value, 4), grad.abs().max().item()  # E[k1] = KL(pi_theta ‖ pi_ref); gradient 0
        (0.1109, 0.0)
        >>> # in the reward: grad KL = p_i (log(p_i / r_i) - KL) = ±0.731 · (0.380 - 0.111)
        >>> [round(g, 4) for g in kl.expected_value_and_gradient("k1", "reward", theta, ref)[1].tolist()]
        [-0.1966, 0.1966]
    """
    theta = logits.detach().to(torch.float64).clone().requires_grad_(True)
    ref = logits_ref.detach().to(torch.float64)
    logp = torch.log_softmax(theta, -1)
    logp_s = (
        logp.detach()
        if logits_old is None
        else torch.log_softmax(logits_old.detach().to(torch.float64), -1)
    )
    p_s = logp_s.exp()
    est = _terms(name, theta, ref, logp_s)
    value = float((p_s * est).sum().detach())
    objective = torch.zeros((), dtype=torch.float64)
    if placement in ("loss", "reward+loss"):
        objective = objective + (p_s * est).sum()
    if placement in ("reward", "reward+loss"):
        # The penalty as sampled: est at the sampling policy (logp = logp_s), then detached.
        est_s = _terms(name, logp_s.detach(), ref, logp_s).detach()
        ratio = torch.exp(logp - logp_s)
        objective = objective + (p_s * ratio * est_s).sum()
    (grad,) = torch.autograd.grad(objective, theta, allow_unused=True)
    if grad is None:
        grad = torch.zeros_like(theta)
    return value, grad.detach()


def _exact_kls(logits: Tensor, ref: Tensor) -> tuple[float, float, Tensor, Tensor]:
    theta = logits.detach().clone().requires_grad_(True)
    logp, logp_ref = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    kl_tr = (logp.exp() * (logp - logp_ref)).sum()
    kl_rt = (logp_ref.exp() * (logp_ref - logp)).sum()
    (g_tr,) = torch.autograd.grad(kl_tr, theta, retain_graph=True)
    (g_rt,) = torch.autograd.grad(kl_rt, theta)
    return float(kl_tr.detach()), float(kl_rt.detach()), g_tr, g_rt


def _close(a: Tensor, b: Tensor) -> bool:
    return float((a - b).norm()) <= _TOL * max(1.0, float(b.norm()))


@functools.cache
def _derive(name: str, spec: Spec, placement: str, on_policy: bool) -> Explanation:
    # Cached by the spec too, so a spec registered again under the same name is derived afresh.
    unbiased, labels = True, set()
    for theta, ref, old in _cases():
        kl_tr, kl_rt, g_tr, g_rt = _exact_kls(theta, ref)
        value, grad = expected_value_and_gradient(
            name, placement, theta, ref, None if on_policy else old
        )
        if not (math.isfinite(value) and bool(torch.isfinite(grad).all())):
            raise ValueError(
                f"estimator {name!r} gives a non-finite expected value or gradient ({value!r}) "
                "on the enumeration's categoricals (V = 6, finite logits), so explain has no "
                "answer for it; check its function on finite log-ratios"
            )
        target = kl_tr if spec.target == THETA_REF else kl_rt
        unbiased &= math.isclose(value, target, rel_tol=_TOL, abs_tol=_TOL)
        if _close(grad, torch.zeros_like(grad)):
            labels.add(GRAD_ZERO)
        elif _close(grad, g_tr):
            labels.add(GRAD_THETA_REF)
        elif _close(grad, g_rt):
            labels.add(GRAD_REF_THETA)
        else:
            labels.add(GRAD_OTHER)
    gradient = labels.pop() if len(labels) == 1 else GRAD_OTHER
    wanted = GRAD_THETA_REF if spec.target == THETA_REF else GRAD_REF_THETA
    return Explanation(
        estimator=name,
        placement=placement,
        on_policy=on_policy,
        equation=spec.equation,
        estimates=spec.target,
        unbiased=unbiased,
        nonnegative=_never_negative(name, spec),
        gradient=gradient,
        mismatch=gradient != wanted,
    )


@functools.cache
def _never_negative(name: str, spec: Spec) -> bool:
    """Whether the value is ≥ 0 on a grid of log-ratios d ∈ [-30, 30] (and importance weights)."""
    # Steps of 0.1 from exact integers, so d = 0 is exactly 0: linspace puts ~1e-15 there, where
    # exp(-d) + d - 1 rounds to either sign depending on the CPU's exp (a property of the
    # arithmetic, not of the estimator).
    d = torch.arange(-300, 301, dtype=torch.float64) / 10.0
    zeros = torch.zeros_like(d)
    if spec.needs_logits:
        # The exact KL of two categoricals is ≥ 0 (Gibbs' inequality); check it on the cases.
        return all(
            float(_terms(name, theta, ref, torch.log_softmax(theta, -1)).min()) >= 0.0
            for theta, ref, _ in _cases()
        )
    logp_old = torch.stack([zeros, zeros + 5.0, zeros - 5.0])
    values = estimate(name, d.expand(3, -1), zeros.expand(3, -1), logp_old=logp_old.expand(3, -1))
    return bool((values >= 0).all())


@functools.cache
def _derive_ref_sampled(name: str, spec: Spec) -> Explanation:
    """:func:`explain` for a :data:`REF_SAMPLED` estimator in the loss, by exact enumeration.

    ``ref_is``: E_ref[w log w] and E_ref[grad (w log w)] summed over every outcome x with weight
    pi_ref(x). ``adaptive_mix`` at a fixed weight a = 1/2: a·E_theta[k1] + (1 - a)·E_ref[w log w];
    its expected gradient must then be (1 - a)·grad KL(pi_theta ‖ pi_ref) (k1's is zero).
    """
    a = 0.5 if spec.mixed else 0.0
    unbiased, labels = True, set()
    for theta, ref, _ in _cases():
        kl_tr, _, g_tr, _ = _exact_kls(theta, ref)
        t = theta.detach().clone().requires_grad_(True)
        logp, logp_ref = torch.log_softmax(t, -1), torch.log_softmax(ref, -1)
        p, p_ref = logp.exp(), logp_ref.exp()
        log_w = logp - logp_ref
        ris = (p_ref * log_w.exp() * log_w).sum()
        k1_loss = (p.detach() * k1(logp, logp_ref)).sum()  # samples of pi_theta held fixed
        objective = a * k1_loss + (1 - a) * ris
        value = a * float((p * log_w).sum().detach()) + (1 - a) * float(ris.detach())
        (grad,) = torch.autograd.grad(objective, t)
        unbiased &= math.isclose(value, kl_tr, rel_tol=_TOL, abs_tol=_TOL)
        if _close(grad / (1 - a), g_tr):
            labels.add(GRAD_THETA_REF)
        else:
            labels.add(GRAD_OTHER)
    gradient = labels.pop() if len(labels) == 1 else GRAD_OTHER
    return Explanation(
        estimator=name,
        placement="loss",
        on_policy=True,
        equation=spec.equation,
        estimates=THETA_REF,
        unbiased=unbiased,
        nonnegative=False,  # w log w < 0 wherever w < 1, and k1 can be negative
        gradient=gradient,
        mismatch=gradient != GRAD_THETA_REF,
    )


# --------------------------------------------------------------------------------------------
# The shipped table.


def table() -> dict[str, Any]:
    """Every built-in row's answers, on- and off-policy, as the JSON ``klpo/assets/explain.json``
    holds: ``{"about": ..., "explanations": [Explanation.to_dict(), ...]}`` in registry order."""
    rows = [
        explain(name, placement, on_policy=on_policy).to_dict()
        for on_policy in (True, False)
        for name in ESTIMATORS
        for placement in PLACEMENTS
    ]
    rows += [explain(name, "loss").to_dict() for name in REF_SAMPLED]
    return {
        "about": "klpo explain's answers for the built-in KL estimators, derived by exact "
        "enumeration (klpo.explain); written by `python -m klpo.lab.tables`, read without torch "
        "by klpo.registry.explanation",
        "explanations": rows,
    }


def table_text() -> str:
    """:func:`table` as the file's text (stable: sorted keys, one row a line)."""
    t = table()
    rows = ",\n".join(
        "    " + json.dumps(r, sort_keys=True, ensure_ascii=False) for r in t["explanations"]
    )
    return f'{{\n  "about": {json.dumps(t["about"])},\n  "explanations": [\n{rows}\n  ]\n}}\n'
