"""The staleness lab against closed forms: a categorical's expected gradients written out by hand.

For a categorical with logits theta, p = softmax(theta), the per-sample gradient of log p(y) with
respect to the logits is e_y - p. A term with per-sample coefficient c(y) (its derivative with
respect to log p(y)) sampled from q has the expected gradient sum_y q(y) c(y) (e_y - p) =
v - (sum v) p with v_y = q(y) c(y): the oracle below, with no autograd in it.
"""

from __future__ import annotations

import math

import pytest
import torch

from klpo import kl
from klpo.lab import staleness as st
from klpo.lab.distributions import SequencePair

P = torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64)
REF = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)  # the sampler, some versions back


def case(q: torch.Tensor = Q) -> st.StaleCase:
    pair = SequencePair.categorical(P.log(), REF.log())
    return st.StaleCase(pair, q.log()[None], k=1)


def oracle(c: torch.Tensor, q: torch.Tensor = Q) -> torch.Tensor:
    """sum_y q(y) c(y) (e_y - p), [1, V]."""
    v = q * c
    return (v - v.sum() * P)[None]


D = (P / REF).log()  # d = log p - log ref, per outcome
W = P / Q  # the importance weight pi_theta / pi_behav
GRAD_TR = (P * (D - (P * D).sum()))[None]  # grad KL(p ‖ ref) = p ⊙ (d - KL)
GRAD_RT = (P - REF)[None]  # grad KL(ref ‖ p) = p - ref


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_closed_forms_of_the_two_kl_gradients():
    # The oracle itself: on-policy k1 in the reward (c = d) is grad KL(p ‖ ref), and on-policy
    # k3 in the loss (c = 1 - ref/p) is grad KL(ref ‖ p) (docs/estimators.md).
    assert close(oracle(D, P), GRAD_TR)
    assert close(oracle(1 - REF / P, P), GRAD_RT)


def test_k3_under_each_correction_matches_the_hand_formula():
    x = case()
    c_k3 = 1 - REF / P  # d k3 / d logp = 1 - exp(-d)
    _, g = st.expected(x, "k3", "loss", "none")
    assert close(g, oracle(c_k3))  # stale samples, no weight: biased
    assert not close(g, GRAD_RT)
    _, g = st.expected(x, "k3", "loss", "is")
    assert close(g, oracle(W * c_k3))
    assert close(g, GRAD_RT)  # the detached weight restores k3's on-policy direction: the other KL


def test_the_claim_is_weighted_k3_follows_grad_kl_theta_ref_per_token():
    # k3_is with the sampler as its pi_old: gradient w d grad logp (through the weight), whose
    # expectation over y ~ pi_behav is sum_y p d (e_y - p) = grad KL(pi_theta ‖ pi_ref), exactly.
    x = case()
    value, g = st.expected(x, "k3_is", "loss", "is")
    assert close(g, oracle(W * D))
    assert close(g, GRAD_TR)
    k3 = REF / P - 1 + D  # exp(-d) + d - 1
    assert math.isclose(value, float((P * D).sum()), rel_tol=1e-12)  # E_q[w k3] = E_p[k3] = KL
    assert math.isclose(value, float((Q * W * k3).sum()), rel_tol=1e-12)
    # With the trainer's recomputed pi_old (= pi_theta at the first update) instead: w = 1 in
    # value, gradient d grad logp with the sampler's samples, biased.
    _, g = st.expected(x, "k3_is", "loss", "none")
    assert close(g, oracle(D))
    assert not close(g, GRAD_TR)


def test_the_weights_cap_biases_only_where_it_binds():
    x = case()
    assert float(W.max()) == pytest.approx(1.4)  # 0.7 / 0.5
    # A cap above every weight changes nothing; one below the largest biases by the capped mass.
    _, g = st.expected(x, "k3_is", "loss", "is-cap", cap=10.0)
    assert close(g, GRAD_TR)
    _, g = st.expected(x, "k3_is", "loss", "is-cap", cap=1.2)
    assert close(g, oracle(W.clamp(max=1.2) * D))
    bias = oracle(W.clamp(max=1.2) * D) - GRAD_TR
    # sum_y (C q - p)_- d (e_y - p): only y = 0 (w = 1.4 > 1.2) contributes.
    excess = torch.tensor([1.2 * 0.5 - 0.7, 0.0, 0.0], dtype=torch.float64)
    assert close(bias, oracle(excess / Q * D))
    assert float(bias.norm()) > 1e-3


def test_reward_estimate_from_the_behaviour_log_probs_is_biased_even_with_the_weight():
    # AReaL's reward KL: k1 from log pi_behav - log pi_ref, the policy gradient weighted by
    # pi_theta/pi_behav (decoupled PPO at pi_prox = pi_theta).
    x = case()
    d_behav = (Q / REF).log()
    _, g = st.expected(x, "k1", "reward", "behav-anchor")
    assert close(g, oracle(W * d_behav))
    assert not close(g, GRAD_TR)
    _, g = st.expected(x, "k1", "reward", "is")  # the trainer's estimate, weighted: exact
    assert close(g, GRAD_TR)


def test_at_staleness_zero_every_correction_is_the_on_policy_gradient():
    for x in st.categorical_cases(0)[:2] + st.sequence_cases(0)[:1]:
        for name in ("k1", "k3", "k3_is", "full"):
            for placement in kl.PLACEMENTS:
                _, base = st.expected(x, name, placement, "none")
                for c in st.corrections_of(placement):
                    assert close(st.expected(x, name, placement, c)[1], base), (name, placement, c)


def test_the_on_policy_sequence_gradients_agree_with_the_exact_lab():
    # k = 0 on a sequence model: the same expected gradients as klpo.lab.exact (built another way,
    # from per-row moments rather than autograd over the enumeration).
    from klpo.lab.exact import analyse

    x = st.sequence_cases(0)[0]
    ex = analyse(x.pair, ("k1", "k2", "k3", "full"))
    for name, by_placement in ex.gradients.items():
        for placement, g in by_placement.items():
            assert torch.allclose(st.expected(x, name, placement, "none")[1], g, atol=1e-13)


def test_on_sequences_only_the_prefix_weight_restores_the_on_policy_gradient():
    rows = st.staleness_rows(
        2, estimators=["k1", "k3_is"], placements=["reward", "loss"], settings=("sequence",)
    )
    by = {(r.estimator, r.placement, r.correction): r for r in rows}
    for name, placement in (("k1", "reward"), ("k3_is", "loss")):
        assert by[(name, placement, "is-seq")].rel_err_on_policy < 1e-12
        assert by[(name, placement, "is")].rel_err_on_policy > 1e-3  # the prefix is the sampler's
        assert by[(name, placement, "none")].rel_err_on_policy > 1e-3
    # k1 in the reward with the whole sequence's weight is grad KL(pi_theta ‖ pi_ref) exactly.
    assert by[("k1", "reward", "is-seq")].follows == kl.GRAD_THETA_REF
    assert by[("k3_is", "loss", "is-seq")].follows == st.ON_POLICY


def test_categorical_rows_label_the_gradients():
    rows = st.staleness_rows(
        4, estimators=["k1", "k3", "k3_is"], placements=["loss"], settings=("categorical",)
    )
    by = {(r.estimator, r.correction): r for r in rows}
    assert by[("k3_is", "is")].follows == kl.GRAD_THETA_REF
    assert by[("k3", "is")].follows == kl.GRAD_REF_THETA
    assert by[("k1", "is")].follows == kl.GRAD_ZERO
    assert by[("k3_is", "none")].follows == kl.GRAD_OTHER
    assert by[("k3", "none")].rel_err_on_policy > 0.1
    r = by[("k3_is", "is")]
    assert r.k == 4 and r.kl_behav_theta > 0 and r.max_weight > 1


def test_k3_is_claim_table():
    rows = {(r.k, r.cap): r for r in st.k3_is_claim(ks=(0, 8), caps=(math.inf, 10.0))}
    assert rows[(0, math.inf)].rel_err_categorical < 1e-12
    assert rows[(8, math.inf)].rel_err_categorical < 1e-12  # uncapped: exact at any staleness
    assert rows[(8, 10.0)].max_weight > 10  # the cap binds at k = 8 ...
    assert rows[(8, 10.0)].rel_err_categorical > 0.01  # ... and biases
    # Over sequences the per-token term is short of the sequence KL's gradient even on-policy.
    assert rows[(0, math.inf)].rel_err_sequence_on_policy > 0.1


def test_bad_input_names_the_choices():
    x = case()
    with pytest.raises(ValueError, match=r"unknown correction 'tis'.*is-cap"):
        st.expected(x, "k3", "loss", "tis")
    with pytest.raises(ValueError, match="use placement 'reward'"):
        st.expected(x, "k3", "loss", "behav-anchor")
    with pytest.raises(ValueError, match="cap C must be > 0"):
        st.expected(x, "k3", "loss", "is-cap", cap=0.0)
    with pytest.raises(ValueError, match="sampled from pi_ref"):
        st.expected(x, "ref_is", "loss", "is")
    with pytest.raises(ValueError, match="unknown estimator 'k9'"):
        st.expected(x, "k9", "loss", "is")
    with pytest.raises(ValueError, match="staleness k must be an integer >= 0"):
        st.StaleCase.along(x.pair, torch.zeros(1, 3), -1)
    with pytest.raises(ValueError, match="step must be a finite number > 0"):
        st.staleness_rows(1, step=0.0)


def test_the_tables_of_docs_async_are_the_labs():
    """docs/async.md's K = 4 tables, row by row, are what the lab computes (regenerate them with
    klpo.lab.staleness.markdown_rows if the cases change)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "async.md").read_text(encoding="utf-8")
    cat_part, seq_part = page.split("Sequence models, KL")[0], page.split("Sequence models, KL")[1]
    cat_part = cat_part.split("Categoricals, KL")[1]
    seq_part = seq_part.split("The bias Δ grows")[0]
    for part, setting in ((cat_part, "categorical"), (seq_part, "sequence")):
        shown = [line for line in part.splitlines() if line.startswith("| `")]
        names = sorted({line.split("`")[1] for line in shown})
        rows = st.staleness_rows(4, estimators=names, settings=(setting,))
        computed = set(st.markdown_rows(rows))
        assert shown, setting
        for line in shown:
            assert line in computed, (setting, line)


# --------------------------------------------------------------------------------------------
# The library path the trainer takes, against the lab: the same expected gradients, exactly.


def _library_expected(x: st.StaleCase, name: str, placement: str, correction: str, cap=10.0):
    """The trainer's per-token pieces (klpo.losses.kl_loss; klpo.losses.kl_reward, returns-to-go,
    PPO's ratio at pi_old = pi_theta, and klpo.mismatch's TIS weight against the sampler's
    log-probs) summed over every sequence weighted by pi_behav, differentiated by autograd."""
    from klpo import advantages, losses, mismatch

    pair = x.pair
    theta = pair.logits.clone().requires_grad_(True)
    logp = pair.token_logps(theta)
    logp_ref = pair.token_logps(pair.logits_ref)
    q = pair.token_logps(x.logits_behav)
    probs = q.sum(-1).exp()[:, None]
    mask = torch.ones_like(logp, dtype=torch.bool)
    rows = pair.enumeration.rows
    full = {"logits": theta[rows], "logits_ref": pair.logits_ref[rows]} if name == "full" else {}
    total = torch.zeros((), dtype=torch.float64)
    if placement in ("loss", "reward+loss"):
        # kl_loss's pi_old: the sampler (with is-cap its cap), or the trainer's
        old = q if correction in ("is", "is-cap") else None
        capped = cap if correction == "is-cap" else None
        term = losses.kl_loss(name, logp, logp_ref, logp_old=old, mask=mask, cap=capped, **full)
        total = total + (probs * term).sum()
    if placement in ("reward", "reward+loss"):
        full_s = {k: v.detach() for k, v in full.items()}
        shaped = losses.kl_reward(
            torch.zeros_like(logp), logp.detach(), logp_ref, mask, beta=1.0, estimator=name,
            **full_s,
        )  # fmt: skip
        adv = advantages.returns_to_go(shaped, mask)  # -G_t: the penalty's returns
        pg = losses.ppo_clip(logp, logp.detach(), adv, clip_low=0.2, clip_high=0.2)
        if correction != "none":
            pg = mismatch.tis_policy_loss(
                pg, logp.detach(), q, cap=cap if correction == "is-cap" else None
            )
        total = total + (probs * pg).sum()
    (g,) = torch.autograd.grad(total, theta, allow_unused=True)
    return torch.zeros_like(theta) if g is None else g


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "k3_is", "k3+", "full"])
def test_the_trainers_library_path_follows_the_labs_gradient(name):
    """kl_loss given the sampler's log-probs is the lab's ``is`` (with its ``cap``, ``is-cap``),
    given none its ``none``; the reward's policy gradient with TIS against the sampler is ``is``
    (``is-cap`` with its cap)."""
    x = st.sequence_cases(2)[1]
    assert x.max_weight > 1.5  # the cap binds somewhere
    for placement in kl.PLACEMENTS:
        for c in ("none", "is", "is-cap"):
            got = _library_expected(x, name, placement, c, cap=1.5)
            _, want = st.expected(x, name, placement, c, cap=1.5)
            assert torch.allclose(got, want, rtol=1e-10, atol=1e-13), (name, placement, c)


def test_the_sweep_of_docs_async_is_the_labs():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "async.md").read_text(encoding="utf-8")
    assert "\n".join(st.sweep_markdown()) in page
    assert "\n".join(st.claim_markdown()) in page
