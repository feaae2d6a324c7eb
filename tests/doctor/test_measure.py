"""The doctor's measurement on real (tiny) models: the shipped reference and a perturbed copy.

Oracles: exact enumeration (one completion token, every token of the vocabulary weighted by its
probability: the Monte Carlo means become exact expectations, so k2 in the loss and k1 in the
reward must give exactly grad KL(pi_theta ‖ pi_ref) and k3 in the loss exactly grad
KL(pi_ref ‖ pi_theta)); naive float64 softmax arithmetic for the exact per-position KLs; the
identity pi_theta = pi_ref (every KL and every gradient zero); statistics recomputed by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from klpo.cli import app
from klpo.doctor import measure as M
from klpo.doctor.reading import DoctorError
from klpo.train.models.load import default_reference_path, load_causal_lm, load_tokenizer
from klpo.train.rollout.samplers import Rollout

F64 = torch.float64
REF = str(default_reference_path())


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    """A copy of the shipped model with every weight moved by 20% of its std (seeded)."""
    out = tmp_path_factory.mktemp("perturbed")
    m, tok = load_causal_lm(REF), load_tokenizer(REF)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * p.std() * torch.randn(p.shape, generator=g))
    m.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    f = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    f.write_text(
        "\n".join(json.dumps({"prompt": f"{a}+{b}="}) for a, b in [(12, 34), (7, 8), (56, 21)])
    )
    return str(f)


def _enumerated(tok, prompts, vocab):
    """A rollout with one completion token per row: every token of the vocabulary per prompt."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    reps = lambda x: x.repeat_interleave(vocab, 0)  # noqa: E731
    return Rollout(
        prompt_ids=reps(enc["input_ids"]),
        prompt_mask=reps(enc["attention_mask"]).bool(),
        completion_ids=torch.arange(vocab).repeat(len(prompts))[:, None],
        mask=torch.ones(len(prompts) * vocab, 1, dtype=torch.bool),
        prompts=[p for p in prompts for _ in range(vocab)],
        completions=[""] * (len(prompts) * vocab),
        answers=[""] * (len(prompts) * vocab),
        group_size=vocab,
    )


def test_enumeration_makes_the_monte_carlo_exact(perturbed):
    policy, ref, tok = load_causal_lm(perturbed), load_causal_lm(REF), load_tokenizer(REF)
    v = policy.config.vocab_size
    prompts = ["12+34=", "7+8="]
    rollout = _enumerated(tok, prompts, v)
    t = M.token_terms(policy, ref, rollout)
    # Weight of each row: pi_theta(y | prompt) / number of prompts: sums over rows are expectations.
    weights = (t.logp.detach().exp() / len(prompts)).to(t.logp.dtype)
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-5)

    # The exact KLs, by naive float64 softmax, at the (one) position of each prompt.
    with torch.no_grad():
        lq = torch.log_softmax(t.logits.detach().to(F64), -1)
        lr = torch.log_softmax(t.logits_ref.to(F64), -1)
    torch.testing.assert_close(
        t.exact.detach().to(F64), (lq.exp() * (lq - lr)).sum(-1), atol=1e-6, rtol=1e-5
    )
    torch.testing.assert_close(
        t.exact_rev.detach().to(F64), (lr.exp() * (lr - lq)).sum(-1), atol=1e-6, rtol=1e-5
    )
    # E_y[k1] = KL exactly: the weighted mean of k1 equals the mean exact KL.
    k1 = (weights.to(F64) * (t.logp - t.logp_ref).detach().to(F64)).sum()
    assert float(k1) == pytest.approx(float(t.exact.detach().mean()), rel=1e-4)

    g = M.gradient_cosines(policy, t, layer="model.layers.3.mlp", weights=weights)
    rows = {(r["estimator"], r["placement"]): r for r in g["rows"]}
    tr, rt = M.TARGETS[0], M.TARGETS[1]
    assert rows["k2", "loss"][tr] == pytest.approx(1.0, abs=1e-5)
    assert rows["k3+", "loss"][tr] == pytest.approx(1.0, abs=1e-5)
    assert rows["k1", "reward"][tr] == pytest.approx(1.0, abs=1e-5)
    assert rows["k3", "loss"][rt] == pytest.approx(1.0, abs=1e-5)
    assert rows["full", "loss"][tr] == pytest.approx(1.0, abs=1e-6)
    # ... and not the other direction: the two targets differ on this pair.
    assert rows["k3", "loss"][tr] < 0.999
    # k1 in the loss: zero expected gradient (relative to the KL's).
    assert rows["k1", "loss"]["norm_ratio"] < 1e-4
    # One token: the sequence gradient is the per-position one.
    assert rows["k2", "loss"][M.TARGETS[2]] == pytest.approx(1.0, abs=1e-5)


def test_identical_models_measure_zero(prompts):
    policy, ref, tok = load_causal_lm(REF), load_causal_lm(REF), load_tokenizer(REF)
    rollout = _enumerated(tok, ["1+1="], 8)
    t = M.token_terms(policy, ref, rollout)
    assert float(t.exact.detach().abs().max()) < 1e-6
    stats = M.value_stats(t)
    for name in ("k1", "k2", "k3", "low_var_kl"):
        assert abs(stats[name]["token"]["mean"]) < 1e-6
    g = M.gradient_cosines(policy, t, layer="model.norm")
    assert max(g["target_norms"].values()) < 1e-6


def test_value_stats_by_hand():
    x = torch.tensor([0.5, -0.1, 0.2, 0.0], dtype=F64)
    exact = torch.tensor([0.1, 0.1, 0.2, 0.2], dtype=F64)
    s = M._stats(x, exact)
    err = [0.4, -0.2, 0.0, -0.2]
    mean_err = sum(err) / 4
    sd = math.sqrt(sum((e - mean_err) ** 2 for e in err) / 3)
    assert s["bias"] == pytest.approx(mean_err)
    assert s["sd"] == pytest.approx(sd)
    assert s["bias_se"] == pytest.approx(sd / 2)
    assert s["fraction_negative"] == 0.25
    assert s["relative_sd"] == pytest.approx(sd / 0.15)


def test_read_prompts_errors(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    with pytest.raises(
        DoctorError, match=r"p\.jsonl:1: expected an object with a string field 'prompt'"
    ):
        M.read_prompts(bad, 4)
    txt = tmp_path / "p.txt"
    txt.write_text("a\n\nb\nc\n")
    assert M.read_prompts(txt, 2) == ["a", "b"]


def test_cli_measures_on_the_shipped_model(perturbed, prompts):
    fixture = "tests/doctor/fixtures/verl_grpo.yaml"
    args = ["doctor", fixture, "--model", perturbed, "--reference", REF, "--data", prompts,
            "--samples", "4", "--max-new-tokens", "4", "--layer", "model.norm"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "measured on your models: 12 completions" in out
    assert "*low_var_kl   loss" in out  # the config's own term is marked
    json_out = CliRunner().invoke(app, [*args, "--json"])
    m = json.loads(json_out.output)["measurement"]
    assert m["sequences"] == 12 and m["exact"]["token_mean_kl_theta_ref"] > 0
    # k1 is unbiased per token: its bias within 4 standard errors of zero.
    k1 = m["values"]["k1"]["token"]
    assert abs(k1["bias"]) <= 4 * k1["bias_se"] + 1e-9
    # `full` is the exact value itself.
    assert m["values"]["full"]["token"]["bias"] == pytest.approx(0.0, abs=1e-6)


def test_cli_measurement_needs_all_three(prompts):
    result = CliRunner().invoke(
        app, ["doctor", "tests/doctor/fixtures/verl_grpo.yaml", "--model", REF]
    )
    assert result.exit_code == 2
    assert "missing: --data, --reference" in result.output
