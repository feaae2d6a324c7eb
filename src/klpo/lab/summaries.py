"""The JSON records of ``klpo lab gaussian|categorical|sequence`` (a contract other tools rely on).

``gaussian``::

    {"true_kl": float,
     "estimators": {name: {"mean", "bias", "sd", "rmse", "bias_rel", "sd_rel", "frac_negative"}}}

Monte Carlo, per sample; every estimator of :data:`klpo.lab.montecarlo.GAUSSIAN_ESTIMATORS`.

``categorical`` and ``sequence``::

    {"kl": {"theta_ref": float, "ref_theta": float},
     "values": {name: {"mean", "bias", "sd", "frac_negative"}},                       (exact)
     "gradients": {"true": {"theta_ref": G, "ref_theta": G}, name: {placement: G}},   (exact)
     "monte_carlo": {"samples": n, "seed": s,                                         (--samples)
                     "values": {name: {"mean", "bias", "sd", "frac_negative", "stderr"}},
                     "gradients": {name: {placement: {"mean": G, "var": G}}}}}

G is the gradient with respect to the policy logits: ``[V]`` in the order given (categorical), or
``[P][V]`` ordered by prefix, shorter first, then lexicographic by token ids (sequence). ``bias`` is
against the KL the estimator targets (KL(pi_ref ‖ pi_theta) for ``kl_ref_theta``, else
KL(pi_theta ‖ pi_ref)); values of a sequence are sums over its tokens. Estimators sampling pi_ref
(``ref_is``, ``ref_is_clip``) and ``adaptive_mix`` have only the ``"loss"`` placement;
``adaptive_mix`` is exact at its steady-state weight and has no Monte Carlo gradient. ``var`` is the
variance of one sample's gradient, per component. Non-finite numbers are written as ``null``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from klpo.lab.distributions import GaussianPair, SequencePair
from klpo.lab.exact import Tables, analyse
from klpo.lab.files import to_json
from klpo.lab.montecarlo import gaussian_monte_carlo, monte_carlo

__all__ = ["GAUSSIAN_KEYS", "VALUE_KEYS", "gaussian_summary", "pair_summary"]

GAUSSIAN_KEYS = ("mean", "bias", "sd", "rmse", "bias_rel", "sd_rel", "frac_negative")
VALUE_KEYS = ("mean", "bias", "sd", "frac_negative")


def gaussian_summary(mu: float, samples: int = 1_000_000, seed: int = 0) -> dict[str, Any]:
    """The ``klpo lab gaussian`` record: Monte Carlo value statistics for N(0, 1) vs N(mu, 1)."""
    pair = GaussianPair(mu)
    stats = gaussian_monte_carlo(mu, samples, seed=seed)
    return to_json(
        {
            "true_kl": pair.true_kl,
            "estimators": {n: s.to_dict(GAUSSIAN_KEYS) for n, s in stats.items()},
        }
    )


def pair_summary(pair: SequencePair, samples: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The ``klpo lab categorical`` / ``klpo lab sequence`` record (see the module docstring)."""

    def vec(g: Tensor) -> list:
        return g[0].tolist() if pair.length == 1 else g.tolist()

    tables = Tables(pair)
    ex = analyse(pair, tables=tables)
    gradients: dict[str, Any] = {
        "true": {"theta_ref": vec(ex.grad_theta_ref), "ref_theta": vec(ex.grad_ref_theta)}
    }
    for name, by_p in ex.gradients.items():
        gradients[name] = {p: vec(g) for p, g in by_p.items()}
    out: dict[str, Any] = {
        "kl": {"theta_ref": ex.kl_theta_ref, "ref_theta": ex.kl_ref_theta},
        "values": {n: v.to_dict(VALUE_KEYS) for n, v in ex.values.items()},
        "gradients": gradients,
    }
    if samples is not None:
        mc = monte_carlo(pair, samples, seed=seed, tables=tables)
        out["monte_carlo"] = {
            "samples": samples,
            "seed": seed,
            "values": {n: v.to_dict((*VALUE_KEYS, "stderr")) for n, v in mc.values.items()},
            "gradients": {
                n: {p: {"mean": vec(m), "var": vec(v)} for p, (m, v) in by_p.items()}
                for n, by_p in mc.gradients.items()
            },
        }
    return to_json(out)
