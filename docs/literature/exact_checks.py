"""Exact expected gradients behind docs/literature.md's gradient rows, by enumeration.

    python docs/literature/exact_checks.py        # a few seconds, deterministic

Every number is an exact expectation over a categorical (no sampling), from
``klpo.kl.expected_value_and_gradient`` or, for the one estimator klpo does not ship, the same
enumeration written out here; each is checked against a closed form before it is printed
(the script stops on a mismatch). Three parts:

1. one categorical: which gradient each on-policy placement follows (Tang & Munos,
   arXiv:2506.09477; Liu et al., arXiv:2510.01555);
2. the "kl3" of a public GRPO comparison, ``exp(d) - 1 - d`` with ``d = log pi_theta/pi_ref``
   (Schulman's k3 with the ratio inverted): its expected loss gradient is that of
   ``chi²(pi_theta ‖ pi_ref) / 2``, and its per-token coefficient ``exp(d) - 1`` grows
   exponentially where the policy has moved up;
3. off-policy, samples from pi_old and no importance weight: how far the uncorrected loss terms
   are from grad KL(pi_theta ‖ pi_ref), against ``k3_is`` (Liu et al.; Zhang et al.,
   arXiv:2505.17508);
4. the spread of the value estimates: Schulman's Gaussian table in closed form, where k3's
   variance e^(mu²) - 1 - mu² overtakes k1's mu², and the exact standard deviation over
   whole sequences of k1, k3 and the Rao-Blackwellised ``full`` on the lab's 2-step sequence
   model (Amini et al., arXiv:2504.10637: unbiased, variance no larger than k1's).
"""

from __future__ import annotations

import torch

from klpo.kl import expected_value_and_gradient
from klpo.lab.distributions import lm_pair
from klpo.lab.exact import analyse, gaussian_moments
from klpo.lab.report import sequence_oracle_pair

F64 = torch.float64  # every tensor here is float64 (the global default is left alone)


def true_gradients(theta: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed forms w.r.t. the logits: grad KL(pi ‖ ref) = pi ⊙ (log pi/ref - KL) and
    grad KL(ref ‖ pi) = pi - ref."""
    p, q = theta.softmax(-1), ref.softmax(-1)
    log_ratio = p.log() - q.log()
    kl = (p * log_ratio).sum()
    return p * (log_ratio - kl), p - q


def inverted_k3_loss_gradient(theta: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """E_pi[grad (exp(d) - 1 - d)] with the samples held fixed, by enumeration."""
    t = theta.detach().clone().requires_grad_(True)
    logp = t.log_softmax(-1)
    d = logp - ref.log_softmax(-1)
    (g,) = torch.autograd.grad((logp.exp().detach() * (torch.expm1(d) - d)).sum(), t)
    return g


def half_chi2_gradient(theta: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """grad of chi²(pi ‖ ref) / 2 = (sum pi² / ref - 1) / 2, by autograd on the closed form."""
    t = theta.detach().clone().requires_grad_(True)
    p = t.softmax(-1)
    (g,) = torch.autograd.grad(0.5 * ((p * p / ref.softmax(-1)).sum() - 1), t)
    return g


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def part_one() -> None:
    theta = torch.tensor([0.7, 0.2, 0.1], dtype=F64).log()
    ref = torch.tensor([0.5, 0.3, 0.2], dtype=F64).log()
    g_tr, g_rt = true_gradients(theta, ref)
    print("1. pi_theta = (0.7, 0.2, 0.1), pi_ref = (0.5, 0.3, 0.2)")
    print(f"   grad KL(pi_theta ‖ pi_ref) = {g_tr.numpy().round(6)}")
    print(f"   grad KL(pi_ref ‖ pi_theta) = {g_rt.numpy().round(6)}")
    expect = {
        ("k1", "loss"): torch.zeros(3, dtype=F64),
        ("k2", "loss"): g_tr,
        ("k1", "reward"): g_tr,
        ("k3", "loss"): g_rt,
        ("k3", "reward+loss"): g_tr,
        ("full", "loss"): g_tr,
    }
    for (name, placement), want in expect.items():
        _, g = expected_value_and_gradient(name, placement, theta, ref)
        assert torch.allclose(g, want, atol=1e-12), (name, placement, g, want)
        print(f"   {name:>4} in the {placement:<11} E[grad] = {g.numpy().round(6)}")
    _, g = expected_value_and_gradient("k3", "reward", theta, ref)
    print(
        f"     k3 in the reward      E[grad] = {g.numpy().round(6)}  cos to grad KL(θ‖ref) "
        f"{cos(g, g_tr):.3f}"
    )


def part_two() -> None:
    print("2. exp(d) - 1 - d in the loss (a k3 with the ratio inverted) on LM-like categoricals,")
    print("   32,768 tokens, 4 draws per KL: mean cosine to grad KL(pi_theta ‖ pi_ref), mean norm")
    print("   ratio to it, and the largest per-token coefficient on a token with pi_theta >= 1e-4")
    print("   (k2's is |d|, k3's is |1 - exp(-d)|, this one's |exp(d) - 1|)")
    gen = torch.Generator().manual_seed(0)
    for kl in (0.03, 0.3, 1.0, 2.0):
        rows = []
        for _ in range(4):
            pair = lm_pair(32768, kl, generator=gen)
            theta, ref = pair.logits[0], pair.logits_ref[0]
            g_tr, _ = true_gradients(theta, ref)
            g_inv = inverted_k3_loss_gradient(theta, ref)
            assert torch.allclose(g_inv, half_chi2_gradient(theta, ref), atol=1e-10)
            _, g_k3 = expected_value_and_gradient("k3", "loss", theta, ref)
            d = theta.log_softmax(-1) - ref.log_softmax(-1)
            seen = theta.softmax(-1) >= 1e-4
            rows.append(
                (
                    cos(g_inv, g_tr),
                    float(g_inv.norm() / g_tr.norm()),
                    cos(g_k3, g_tr),
                    float(d[seen].abs().max()),
                    float(torch.expm1(d[seen]).abs().max()),
                    float((-torch.expm1(-d[seen])).abs().max()),
                )
            )
        m = torch.tensor(rows, dtype=F64).mean(0).tolist()
        print(
            f"   KL {kl:<4}: cos {m[0]:.3f} (k3 loss {m[2]:.3f}), norm ×{m[1]:.2f}; "
            f"largest coefficient {m[4]:.1f} (k2 {m[3]:.1f}, k3 {m[5]:.1f})"
        )


def part_three() -> None:
    print("3. off-policy: tokens from pi_old, no importance weight; cosine to and relative error")
    print("   against grad KL(pi_theta ‖ pi_ref), mean of 4 LM-like draws (32,768 tokens)")
    gen = torch.Generator().manual_seed(1)
    for scale in (0.1, 0.3, 0.6):
        acc: dict[str, list[tuple[float, float]]] = {"k2": [], "k3": [], "k3+": [], "k3_is": []}
        kl_old = []
        for _ in range(4):
            pair = lm_pair(32768, 0.3, generator=gen)
            theta, ref = pair.logits[0], pair.logits_ref[0]
            old = theta + scale * torch.randn(theta.numel(), generator=gen, dtype=F64)
            p, p_old = theta.log_softmax(-1), old.log_softmax(-1)
            kl_old.append(float((p.exp() * (p - p_old)).sum()))
            g_tr, _ = true_gradients(theta, ref)
            for name in acc:
                _, g = expected_value_and_gradient(name, "loss", theta, ref, old)
                acc[name].append((cos(g, g_tr), float((g - g_tr).norm() / g_tr.norm())))
            _, g_is = expected_value_and_gradient("k3_is", "loss", theta, ref, old)
            assert torch.allclose(g_is, g_tr, atol=1e-10)  # k3_is: exact off-policy too
        cells = ", ".join(
            f"{n} {torch.tensor(v, dtype=F64).mean(0)[0]:.3f} / {torch.tensor(v, dtype=F64).mean(0)[1]:.3f}"
            for n, v in acc.items()
        )
        print(f"   KL(pi_theta ‖ pi_old) {sum(kl_old) / 4:.3f}: {cells}")


def part_four() -> None:
    print("4. value spread. N(0, 1) against N(mu, 1), KL = mu²/2: bias / KL and sd / KL per sample")
    for mu in (0.1, 1.0, 2.0, 3.0):
        kl = mu * mu / 2
        cells = []
        for name in ("k1", "k2", "k3"):
            mean, var, _ = gaussian_moments(name, mu)
            cells.append(f"{name} {(mean - kl) / kl:.4f} / {var**0.5 / kl:.3f}")
        assert abs(gaussian_moments("k2", mu)[0] / kl - 1 - mu * mu / 4) < 1e-12  # bias mu²/4
        print(f"   mu {mu}: " + ", ".join(cells))
    ex = analyse(sequence_oracle_pair())
    v = ex.values
    assert abs(v["full"].bias) < 1e-12 and v["full"].sd <= v["k1"].sd
    print(
        f"   2-step sequence model, KL {ex.kl_theta_ref:.6f}: sd over sequences k1 "
        f"{v['k1'].sd:.4f} (negative {v['k1'].frac_negative:.1%} of the time), k3 {v['k3'].sd:.4f}, "
        f"full {v['full'].sd:.4f}; bias of full {v['full'].bias:.1e}"
    )


if __name__ == "__main__":
    part_one()
    part_two()
    part_three()
    part_four()
