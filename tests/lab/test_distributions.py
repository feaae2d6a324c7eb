"""Tests for klpo.lab.distributions: prefixes, enumeration, specs and their errors, LM-like pairs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from klpo.lab.distributions import (
    GaussianPair,
    SequencePair,
    SpecError,
    drift_path,
    lm_pair,
    num_prefixes,
    prefix_text,
    prefixes,
)

SPEC = {
    "vocab": 2,
    "length": 2,
    "policy": {"": [0.3, -0.2], "0": [0.5, 0.0], "1": [-0.4, 0.6]},
    "reference": {"": [0, 0], "0": [0, 0.3], "1": [0.2, 0]},
}


def test_prefix_order_is_shorter_first_then_lexicographic():
    assert prefixes(2, 3) == [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert num_prefixes(3, 3) == 1 + 3 + 9
    assert [prefix_text(p) for p in prefixes(3, 2)] == ["", "0", "1", "2"]


def test_enumeration_rows_point_at_each_tokens_prefix():
    pair = SequencePair(
        torch.zeros(num_prefixes(3, 3), 3), torch.zeros(num_prefixes(3, 3), 3), vocab=3, length=3
    )
    e = pair.enumeration
    order = pair.prefixes
    assert e.tokens.shape == (27, 3)
    for n in range(27):
        toks = tuple(e.tokens[n].tolist())
        assert n == toks[0] * 9 + toks[1] * 3 + toks[2]  # lexicographic
        for t in range(3):
            assert order[int(e.rows[n, t])] == toks[:t]


def test_sequence_probabilities_by_hand():
    pair = SequencePair.from_spec(SPEC)
    # pi(0) = sigmoid(0.3 - (-0.2)) = sigmoid(0.5) = 0.6224593; pi(1 | 0) = sigmoid(-0.5) = 0.3775407
    p = pair.probs.numpy()
    s = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert p[1] == pytest.approx(s(0.5) * s(-0.5), rel=1e-12)  # sequence (0, 1)
    assert p[2] == pytest.approx(
        s(-0.5) * s(-1.0), rel=1e-12
    )  # (1, 0): after 1, logits (-0.4, 0.6)
    assert p.sum() == pytest.approx(1.0, rel=1e-14)
    # the hand-checked 2-step oracle (klpo.lab.report.SEQUENCE_ORACLE_SPEC)
    assert pair.kl_theta_ref == pytest.approx(0.140222, abs=1e-6)
    assert pair.kl_ref_theta == pytest.approx(0.158029, abs=1e-6)


def test_gaussian_log_probs_match_torch_distributions():
    pair = GaussianPair(0.7)
    x = torch.linspace(-4, 4, 9, dtype=torch.float64)
    logp, logp_ref = pair.log_probs(x)
    torch.testing.assert_close(logp, torch.distributions.Normal(0.0, 1.0).log_prob(x))
    torch.testing.assert_close(logp_ref, torch.distributions.Normal(0.7, 1.0).log_prob(x))
    assert pair.true_kl == pytest.approx(0.245)


@pytest.mark.parametrize(
    ("pi", "ref", "message"),
    [
        ([0.7, 0.2, 0.2], [0.5, 0.3, 0.2], "pi sums to 1.1, not 1"),
        ([0.5, 0.5], [0.5, 0.3, 0.2], "pi has 2 entries but ref has 3"),
        ([1.0, 0.0], [0.5, 0.5], "pi[1] = 0.0 is not a probability"),
        ([1.0], [1.0], "at least 2"),
        ([0.5, float("nan")], [0.5, 0.5], "pi[1] = nan"),
    ],
)
def test_bad_probabilities_name_the_problem(pi, ref, message):
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SequencePair.from_probabilities(pi, ref)


def _spec(**changes):
    spec = {k: (dict(v) if isinstance(v, dict) else v) for k, v in SPEC.items()}
    spec.update(changes)
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([1, 2], "must be a JSON object"),
        ({"vocab": 2}, "missing 'length', 'policy', 'reference'"),
        (_spec(extra=1), "unknown spec field"),
        (_spec(vocab=1), "'vocab' must be an integer >= 2"),
        (_spec(length=True), "'length' must be an integer >= 1"),
        (_spec(vocab=10, length=6), "too many to enumerate"),
        (_spec(policy={"": [0, 0], "0": [0, 0]}), "policy is missing prefix '1'"),
        (_spec(policy={"": [0, 0], "0": [0, 0], "1": [0, 0], "0 1": [0, 0]}), "shorter than"),
        (_spec(policy={"": [0, 0], "0": [0, 0], "x": [0, 0]}), "malformed"),
        (_spec(policy={"": [0, 0], "0": [0, 0], "2": [0, 0]}), "outside"),
        (_spec(policy={"": [0, 0], "0": [0, 0], "1": [0]}), "list of 2 numbers"),
        (_spec(reference={"": [0, 0], "0": [0, 0], "1": [0, float("inf")]}), "non-finite"),
        (_spec(policy={"": [0, 0], "0": [0, 0], "1": [0, 0], " 1": [0, 0]}), "given twice"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(SpecError, match=message):
        SequencePair.from_spec(spec)


def test_lm_pair_hits_the_target_kl_by_exact_summation():
    gen = torch.Generator().manual_seed(0)
    for target in (0.01, 1.0):
        pair = lm_pair(5000, target, generator=gen)
        pi = torch.softmax(pair.logits[0], -1).numpy()
        pr = torch.softmax(pair.logits_ref[0], -1).numpy()
        assert float(np.sum(pi * np.log(pi / pr))) == pytest.approx(target, rel=1e-8)
    # Zipf-shaped: sorted probabilities fall like rank^-1.1
    ranked = np.sort(pi)[::-1]
    assert math.log(ranked[0] / ranked[99]) / math.log(100) == pytest.approx(1.1, rel=1e-9)


def test_drift_path_starts_at_the_reference_and_ends_at_max_kl():
    ref, path = drift_path(300, 10, 2.0, generator=torch.Generator().manual_seed(1))
    assert path.shape == (11, 300)
    assert torch.equal(path[0], ref)
    logp, logp_ref = torch.log_softmax(path[-1], -1), torch.log_softmax(ref, -1)
    assert float((logp.exp() * (logp - logp_ref)).sum()) == pytest.approx(2.0, rel=1e-8)
