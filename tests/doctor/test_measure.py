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
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import klpo.measure as M
from klpo.cli import app
from klpo.measure import MeasureError
from klpo.measure import run as measure_run
from klpo.measure.intervals import _u_stats
from klpo.measure.objectives import _stats
from klpo.measure.prompts import _prompt_codec
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
    # The lab's ValueStats.of_errors: bias = mean error, sd = the error's population sd (the
    # estimate's noise given the exact value), its standard error sd / sqrt(n).
    x = torch.tensor([0.5, -0.1, 0.2, 0.0], dtype=F64)
    exact = torch.tensor([0.1, 0.1, 0.2, 0.2], dtype=F64)
    s = _stats(x, exact)
    err = [0.4, -0.2, 0.0, -0.2]
    mean_err = sum(err) / 4
    sd = math.sqrt(sum((e - mean_err) ** 2 for e in err) / 4)
    assert s["n"] == 4
    assert s["bias"] == pytest.approx(mean_err)
    assert s["sd"] == pytest.approx(sd)
    assert s["bias_se"] == pytest.approx(sd / 2)
    assert s["fraction_negative"] == 0.25
    assert s["exact"] == pytest.approx(0.15)
    assert s["relative_sd"] == pytest.approx(sd / 0.15)
    # The values' own tail: mean 0.15, deviations 0.35, -0.25, 0.05, -0.15.
    dev = [0.35, -0.25, 0.05, -0.15]
    var = sum(d * d for d in dev) / 4
    assert s["excess_kurtosis"] == pytest.approx(sum(d**4 for d in dev) / 4 / var**2 - 3)
    assert s["max"] == 0.5


def test_read_prompts_errors(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"question": "1+1="}\n')
    with pytest.raises(
        MeasureError, match=r"p\.jsonl:1: expected an object with a string field 'prompt'"
    ):
        M.read_prompts(bad, 4)
    txt = tmp_path / "p.txt"
    txt.write_text("a\n\nb\nc\n")
    assert M.read_prompts(txt, 2) == ["a", "b"]
    bad.write_text('{"prompt": "1+1="}\n{"prompt": [{"role": "user"}]}\n')
    with pytest.raises(MeasureError, match=r"p\.jsonl:2: chat message 0 must be an object"):
        M.read_prompts(bad, 4)


def test_conversational_prompts_are_read_and_need_chat(tmp_path):
    """TRL's conversational format: ``prompt`` a list of messages, kept as (role, content)."""
    data = tmp_path / "p.jsonl"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    data.write_text(json.dumps({"prompt": "plain"}) + "\n" + json.dumps({"prompt": msgs}) + "\n")
    got = M.read_prompts(data, 8)
    assert got == ["plain", (("system", "Be brief."), ("user", "2 + 2?"))]
    with pytest.raises(
        MeasureError, match=r"--data prompt 2 is a list of chat messages; add --chat"
    ):
        M.render_prompts(None, got, chat=False)
    assert M.render_prompts(None, ["a"], chat=False) == ["a"]


def test_cli_measures_on_the_shipped_model(perturbed, prompts):
    fixture = "tests/doctor/fixtures/verl_grpo.yaml"
    args = ["doctor", fixture, "--model", perturbed, "--reference", REF, "--data", prompts,
            "--samples", "4", "--max-new-tokens", "4"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "measured on your models: 12 completions" in out
    assert "*low_var_kl   loss" in out  # the config's own term is marked
    assert "the MLP of the last decoder layer (model.layers.3.mlp)" in out
    assert "memory: about" in out
    json_out = CliRunner().invoke(app, [*args, "--json"])
    m = json.loads(json_out.stdout)["measurement"]
    assert m["sequences"] == 12 and m["exact"]["token_mean_kl_theta_ref"] > 0
    # k1 is unbiased per token: its bias within 4 standard errors of zero.
    k1 = m["values"]["k1"]["token"]
    assert abs(k1["bias"]) <= 4 * k1["bias_se"] + 1e-9
    # `full` is the exact value itself.
    assert m["values"]["full"]["token"]["bias"] == pytest.approx(0.0, abs=1e-6)
    # The memory estimate against the sizes measured: the weights from the safetensors headers
    # are the loaded parameters' bytes; the gradient store is what was allocated; one group's
    # pass holds eight of its [R, C, V] logits.
    mem = m["memory"]
    assert M.weights_bytes(perturbed) + M.weights_bytes(REF) == mem["measured"]["weights"]
    assert mem["estimate"]["store"] == mem["measured"]["store"]
    assert mem["estimate"]["pass"] >= 8 * mem["measured"]["logits"] > 0
    assert mem["estimate"]["total"] >= mem["estimate"]["weights"] + mem["estimate"]["store"]
    # The peak: the process as it stands once both models are loaded, plus the estimate; the
    # process's own peak (measured, ru_maxrss) includes the pytest process, so only a bound.
    assert mem["estimate"]["peak"] > mem["estimate"]["resident"] > mem["measured"]["weights"]
    # The verdicts: `full` in the loss is the per-position gradient itself (projection 1, no
    # noise); k1 in the loss and `full` in the reward have a zero expected gradient.
    rows = {(r["estimator"], r["placement"]): r for r in m["gradients"]["rows"]}
    full = rows["full", "loss"]["targets"][M.TARGETS[0]]
    assert full["beta"] == pytest.approx(1.0, abs=1e-9) and full["beta_se"] < 1e-9
    assert rows["full", "loss"]["claim"]["status"] == "consistent"
    assert rows["k1", "loss"]["claim"]["projection"] == 0.0


def test_cli_measurement_needs_all_three(prompts):
    result = CliRunner().invoke(
        app, ["doctor", "tests/doctor/fixtures/verl_grpo.yaml", "--model", REF]
    )
    assert result.exit_code == 2
    assert "missing: --data, --reference" in result.output


# --------------------------------------------------------------------------------------------
# The fast path (per-completion gradients of linear layers, sketched) against autograd.


@pytest.fixture(scope="module")
def sampled(perturbed):
    """The perturbed pair with 4 prompts × 4 completions of up to 5 tokens (seed=0)."""
    from klpo.train.rollout.samplers import Decoding, generate

    policy, ref, tok = load_causal_lm(perturbed), load_causal_lm(REF), load_tokenizer(perturbed)
    policy.requires_grad_(False)
    ref.requires_grad_(False)
    texts = ["12+34=", "7+8=", "56+21=", "3+4="]
    codec = _prompt_codec(tok, policy, texts, "test")
    torch.manual_seed(0)
    rollout = generate(
        policy, tok, texts, [""] * 4, Decoding(group_size=4, max_new_tokens=5), codec=codec
    )
    return policy, ref, rollout


def _direct(policy, ref, rollout, rows, subset):
    """Oracle: every objective's exact gradient on the subset's weights by autograd through the
    model's own logits (:func:`M.token_terms`), per-token weights 1 (sums, as the fast path)."""
    sub = Rollout(
        prompt_ids=rollout.prompt_ids[rows],
        prompt_mask=rollout.prompt_mask[rows],
        completion_ids=rollout.completion_ids[rows],
        mask=rollout.mask[rows],
        prompts=[rollout.prompts[i] for i in rows.tolist()],
        completions=[rollout.completions[i] for i in rows.tolist()],
        answers=[""] * len(rows),
        group_size=1,
    )
    params = [m.weight for m in subset.modules]
    for p in params:
        p.requires_grad_(True)
    try:
        t = M.token_terms(policy, ref, sub)
        return torch.stack(M.objective_gradients(t, params, weights=torch.ones_like(t.logp)))
    finally:
        for p in params:
            p.requires_grad_(False)


def test_fast_path_equals_autograd(sampled):
    policy, ref, rollout = sampled
    subset = M.choose_subset(policy, "model.layers.2.mlp.down_proj")
    exact = M.Sketch(subset.modules, 0, 0)
    rows = torch.tensor([1, 6, 11])
    vec, arrays, _ = M.group_vectors(policy, ref, rollout, rows, subset, exact)
    direct = _direct(policy, ref, rollout, rows, subset)
    scale = direct.abs().amax(1, keepdim=True).clamp(min=1e-12)
    # One vector per completion: their sum is the batch gradient (rows are independent).
    torch.testing.assert_close(vec.sum(1) / scale, direct / scale, atol=2e-5, rtol=0)
    # ... and each completion alone is its own gradient.
    one = _direct(policy, ref, rollout, rows[1:2], subset)
    torch.testing.assert_close(vec[:, 1] / scale, one / scale, atol=2e-5, rtol=0)
    assert float(direct[M.objective_names().index(("k2", "loss"))].norm()) > 0
    # The values are the estimators' own on the sampled tokens.
    k3 = torch.exp(-(arrays["logp"] - arrays["logp_ref"])) + arrays["logp"] - arrays["logp_ref"] - 1
    m = rollout.mask[rows]
    torch.testing.assert_close(arrays["value:k3"][m], k3.double()[m], atol=1e-5, rtol=1e-5)


def test_prompt_cache_is_exact_where_the_layers_see_no_prompt(sampled):
    """The last layer's MLP is position-wise: the prompts' key/value caches give the same
    vectors as whole sequences; a layer below sees the prompt through attention, and is refused
    the cache."""
    policy, ref, rollout = sampled
    last, below = M.choose_subset(policy, None), M.choose_subset(policy, "model.layers.2.mlp")
    assert M.prompt_free(policy, rollout, last)
    assert not M.prompt_free(policy, rollout, below)
    rows = torch.tensor([2, 5, 8, 15])
    sk = M.Sketch(last.modules, 0, 0)
    whole, arr, _ = M.group_vectors(policy, ref, rollout, rows, last, sk)
    prefix = (M.prompt_caches(policy, rollout, rows), M.prompt_caches(ref, rollout, rows))
    cached, arr_c, _ = M.group_vectors(policy, ref, rollout, rows, last, sk, prefix)
    scale = whole.abs().amax((1, 2), keepdim=True).clamp(min=1e-12)
    torch.testing.assert_close(cached / scale, whole / scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(arr_c["exact"], arr["exact"], atol=1e-6, rtol=1e-5)


def test_sketch_is_unbiased_and_close(sampled):
    """Oracle: the exact (unsketched) vectors. Each sketch's inner products are unbiased (their
    mean over 16 seeded sketches within 4 standard errors of the exact one) and the cosines'
    spread over sketches is within a Johnson–Lindenstrauss bound: a dense Gaussian projection to
    D numbers has sd (1 - c²)/sqrt(D) on a cosine c (first order); the Kronecker blocks are
    allowed 4 times that."""
    policy, ref, rollout = sampled
    subset = M.choose_subset(policy, None)
    rows = torch.arange(16)
    exact, _, _ = M.group_vectors(
        policy, ref, rollout, rows, subset, M.Sketch(subset.modules, 0, 0)
    )
    names = M.objective_names()
    a, b = names.index(("k3", "loss")), names.index(("target", M.TARGETS[0]))
    ea, eb = exact[a].sum(0), exact[b].sum(0)
    dot, cos = float(ea @ eb), float(ea @ eb / (ea.norm() * eb.norm()))
    dots, coss = [], []
    for seed in range(16):
        sk = M.Sketch(subset.modules, 1024, seed)
        v, _, _ = M.group_vectors(policy, ref, rollout, rows, subset, sk)
        sa, sb = v[a].sum(0), v[b].sum(0)
        dots.append(float(sa @ sb))
        coss.append(float(sa @ sb / (sa.norm() * sb.norm())))
    d = torch.tensor(dots, dtype=F64)
    assert abs(float(d.mean()) - dot) <= 4 * float(d.std()) / 4  # se = sd / sqrt(16)
    dim = M.Sketch(subset.modules, 1024, 0).dim
    bound = 4 * (1 - cos**2) / math.sqrt(dim)
    assert float(torch.tensor(coss).std()) <= bound
    assert abs(float(torch.tensor(coss).mean()) - cos) <= 4 * bound / 4


# --------------------------------------------------------------------------------------------
# Intervals.


def test_t_quantile_closed_forms():
    # df = 1 is Cauchy: tan(pi (p - 1/2)); df = 2: (2p - 1) / sqrt(2 p (1 - p)).
    for p in (0.9, 0.975, 0.995):
        assert M.t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-6)
        assert M.t_quantile(p, 2) == pytest.approx(
            (2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-6
        )
    from statistics import NormalDist

    assert M.t_quantile(0.975, 10_000) == pytest.approx(NormalDist().inv_cdf(0.975), rel=1e-3)
    assert M.t_quantile(0.975, 7) == pytest.approx(2.364624, rel=1e-5)  # printed tables


def test_u_statistics_by_hand():
    g = torch.randn(3, 5, 5, dtype=F64, generator=torch.Generator().manual_seed(0))
    full, loo = _u_stats(g)
    for p in range(3):
        off = [float(g[p, k, l]) for k in range(5) for l in range(5) if k != l]  # noqa: E741
        assert float(full[p]) == pytest.approx(sum(off) / 20)
        for drop in range(5):
            keep = [k for k in range(5) if k != drop]
            off = [float(g[p, k, l]) for k in keep for l in keep if k != l]  # noqa: E741
            assert float(loo[p, drop]) == pytest.approx(sum(off) / 12)


@pytest.mark.parametrize(("groups", "noise"), [(8, 0.15), (32, 0.3)])
def test_interval_coverage(groups, noise):
    """Seeded: 600 data sets of G Gaussian replicates of two 40-dimensional vectors with known
    expected vectors (cosine 0.6, projection 0.75; the a-noise correlated with b's). With 32
    groups each interval's coverage of the truth is 0.95 within 3 binomial standard errors
    (0.027); with 8 it may only err on the safe side (the jackknife variance is biased upward,
    Efron & Stein 1981): at least 0.95 - 3 se, at most 0.99. The plain cosine of the sums, which
    the doctor printed before, is biased by the noise in its norms."""
    gen = torch.Generator().manual_seed(0)
    d = 40
    mu_b = torch.zeros(d, dtype=F64)
    mu_b[0] = 1.0
    mu_a = torch.zeros(d, dtype=F64)
    mu_a[0], mu_a[1] = 0.75, 1.0  # cos = 0.75 / 1.25 = 0.6, projection 0.75
    reps, hits = 600, {"cos": 0, "beta": 0}
    plain = []
    for _ in range(reps):
        nb = noise * torch.randn(groups, d, generator=gen, dtype=F64)
        na = 0.5 * nb + noise * torch.randn(groups, d, generator=gen, dtype=F64)
        v = torch.stack([mu_a + na, mu_b + nb])
        (s,) = M.interval_stats(v, [(0, 1)])
        hits["cos"] += abs(s["cos"] - 0.6) <= s["half_width"]["cos"]
        hits["beta"] += abs(s["beta"] - 0.75) <= s["half_width"]["beta"]
        plain.append(s["cos_plain"])
    se = math.sqrt(0.95 * 0.05 / reps)
    for key, n in hits.items():
        cover = n / reps
        assert cover >= 0.95 - 3 * se, (key, cover)
        assert cover <= (0.95 + 3 * se if groups >= 32 else 0.99), (key, cover)
    p = torch.tensor(plain)
    assert abs(float(p.mean()) - 0.6) > 4 * float(p.std()) / math.sqrt(reps)


def test_verdicts():
    # Excluded: inconsistent. Inside: consistent, and the completions that would decide it:
    # n (half / |beta - exact|)² = 64 · (0.2 / 0.1)² = 256.
    assert M.verdict(0.5, 0.2, 1.0, 64)["status"] == "inconsistent"
    v = M.verdict(0.9, 0.2, 1.0, 64)
    assert v == {"status": "consistent", "decide_at": 256}
    assert M.verdict(1.0, 0.0, 1.0, 64) == {"status": "consistent", "decide_at": None}
    assert M.claim("k3", "loss")[1:] == (1, 1.0)
    assert M.claim("k1", "loss")[1:] == (0, 0.0)
    assert M.claim("full", "reward")[1:] == (0, 0.0)
    assert M.claim("k1", "reward-to-go")[1:] == (2, 1.0)
    assert M.claim("k3", "reward-to-go") is None


# --------------------------------------------------------------------------------------------
# The command: the reading first, the memory estimate, chat prompts, a real model.


def test_reading_is_printed_before_the_measurement(perturbed, prompts):
    """Through a pipe (block-buffered), the reading's last line arrives while the measurement,
    which loads two models, still runs: it was flushed first."""
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", "klpo", "doctor", "tests/doctor/fixtures/verl_grpo.yaml",
            "--model", perturbed, "--reference", REF, "--data", prompts, "--prompts", "1",
            "--samples", "3", "--max-new-tokens", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
    )
    try:
        first = proc.stdout.readline()
        assert first.startswith("klpo doctor: tests/doctor/fixtures/verl_grpo.yaml")
        for line in proc.stdout:
            if line.startswith("klpo config that does what"):
                break
        assert proc.poll() is None  # still measuring
        rest = proc.stdout.read()
        assert "measured on your models: 3 completions" in rest
    finally:
        proc.stdout.close()
        assert proc.wait(timeout=600) == 0


def test_a_measurement_beyond_the_free_memory_is_refused(perturbed, prompts, monkeypatch):
    weights = M.weights_bytes(perturbed) + M.weights_bytes(REF)
    monkeypatch.setattr(measure_run, "available_bytes", lambda: weights - 1)
    with pytest.raises(MeasureError, match=r"the two models need .* GB in float32"):
        M.measure(perturbed, REF, prompts, samples=3, show_progress=False, say=lambda _: None)
    monkeypatch.setattr(measure_run, "available_bytes", lambda: 1000 + weights)
    lines: list[str] = []
    with pytest.raises(MeasureError, match=r"lower it with fewer --prompts, --samples"):
        M.measure(perturbed, REF, prompts, samples=3, show_progress=False, say=lines.append)
    assert lines[1].startswith("memory: about") and "available" in lines[1]


def test_chat_prompts_follow_the_trainers_rule(smollm2_dir, tmp_path):
    """Oracle: the tokenizer's own apply_chat_template; the rendered ids carry no added token."""
    tok = load_tokenizer(str(smollm2_dir))
    text = "What is 17 + 25?"
    (got,) = M.render_prompts(tok, [text], chat=True)
    msgs = [{"role": "user", "content": text}]
    assert got == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert got.rstrip().endswith("<|im_start|>assistant")
    (sys_,) = M.render_prompts(tok, [text], chat=True, system_prompt="Be brief.")
    assert sys_.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    model = load_causal_lm(REF)  # any model: the codec reads only its generation config
    codec = _prompt_codec(tok, model, [got], "test", chat=True)
    assert codec.ids([got])[0] == tok(got, add_special_tokens=False)["input_ids"]
    # A conversation (a solved example before the question) renders as the template renders it,
    # its own system message kept in place of --chat's.
    conv = [
        {"role": "system", "content": "Reply with a number."},
        {"role": "user", "content": "What is 12 + 7?"},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": text},
    ]
    pairs = tuple((m["role"], m["content"]) for m in conv)
    (both,) = M.render_prompts(tok, [pairs], chat=True, system_prompt="Be brief.")
    assert both == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    # No template, no chat: the shipped model's tokenizer has none.
    with pytest.raises(MeasureError, match="--chat needs a tokenizer with a chat template"):
        M.render_prompts(load_tokenizer(REF), [text], chat=True)


def test_a_klpo_configs_data_chat_is_honoured(tmp_path):
    from klpo.doctor import diagnose
    from klpo.doctor.command import _chat

    cfg = tmp_path / "run.yaml"
    base = Path("configs/grpo-k3-loss.yaml").read_text()
    cfg.write_text(base + "\ndata:\n  chat: true\n  system_prompt: Be brief.\n")
    diag = diagnose(cfg)
    assert diag["framework"] == "klpo"
    assert _chat(str(cfg), diag, None) == (True, "Be brief.")
    assert _chat(str(cfg), diag, False) == (False, None)
    plain = diagnose("tests/doctor/fixtures/verl_grpo.yaml")
    assert _chat("tests/doctor/fixtures/verl_grpo.yaml", plain, None) == (False, None)


def test_real_model_identical_pair_measures_zero(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct against itself, chat prompts: the same weights, so the KL is
    exactly zero at every position and so is every gradient: said in one line, not measured
    (it printed all-zero tables with sd/KL inf for minutes)."""
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "What is 17 + 25?"}\n{"prompt": "Name a colour."}\n')
    d = str(smollm2_dir)
    args = ["doctor", "tests/doctor/fixtures/verl_grpo.yaml", "--model", d, "--reference", d,
            "--data", str(data), "--chat", "--prompts", "2", "--samples", "3",
            "--max-new-tokens", "3", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    m = json.loads(result.stdout)["measurement"]
    assert m["chat"] and m["identical"]
    assert set(m["exact"].values()) == {0.0}
    assert "gradients" not in m and "values" not in m


def test_a_heavy_tailed_inconsistent_row_is_explained_and_a_light_one_is_not():
    rows = [
        {"estimator": "k3", "placement": "loss", "claim": {"status": "inconsistent"}},
        {"estimator": "k2", "placement": "loss", "claim": {"status": "inconsistent"}},
        {"estimator": "k1", "placement": "reward", "claim": {"status": "consistent"}},
        {"estimator": "abs", "placement": "loss", "claim": None},
    ]
    values = {
        "k3": {"token": {"excess_kurtosis": 1.7e3}},
        "k2": {"token": {"excess_kurtosis": 3.0}},  # light: an inconsistency is not excused
        "k1": {"token": {"excess_kurtosis": 1e4}},  # consistent: nothing to explain
        "abs": {"token": {"excess_kurtosis": 1e4}},
    }
    notes = M.heavy_tail_notes(rows, values)
    assert notes[0] == "" and len(notes) == 2
    assert notes[1].startswith("  k3 loss: its per-token values have excess kurtosis 1.7e+03")
    assert M.heavy_tail_notes(rows[1:], values) == []


# --------------------------------------------------------------------------------------------
# What a user met: no config, an identical pair, the memory estimate, the help, the display.


def test_model_without_a_config_marks_klpos_default_term(perturbed, prompts):
    from klpo.train.config.kl import KLConfig

    args = ["doctor", "--model", perturbed, "--reference", REF, "--data", prompts,
            "--samples", "3", "--max-new-tokens", "3"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    d = KLConfig()
    assert (d.estimator, d.placement) == ("full", "loss")
    assert "no config given: klpo's default KL term (kl.estimator=full, kl.placement=loss)" in (
        result.output
    )
    assert " *full         loss" in result.output  # the default's row is marked
    assert " *k3 " not in result.output
    js = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)
    assert js["config"] is None and js["default_term"] == ["full", "loss"]
    assert js["measurement"]["highlight"] == [["full", "loss"]]
    # Without a config, the measurement still needs all three; with nothing, a config is asked.
    alone = CliRunner().invoke(app, ["doctor", "--model", REF])
    assert alone.exit_code == 2 and "missing: --data, --reference" in alone.output
    bare = CliRunner().invoke(app, ["doctor"])
    assert bare.exit_code == 2 and "give a CONFIG to read, or --model" in bare.output


def test_an_identical_pair_is_said_in_one_line(prompts, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(REF, copy)
    args = ["doctor", "--model", REF, "--reference", str(copy), "--data", prompts]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "hold the same weights: KL(pi_theta ‖ pi_ref) is exactly 0" in result.output
    assert "sd/KL" not in result.output and "inf" not in result.output
    m = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["measurement"]
    assert m["identical"] and m["exact"]["token_mean_kl_theta_ref"] == 0.0
    # One weight moved by one float32 step: not the same weights, measured.
    other = load_causal_lm(REF)
    from klpo.measure.models import same_weights

    assert same_weights(other, load_causal_lm(str(copy)))
    with torch.no_grad():
        w = other.model.norm.weight
        w[0] = torch.nextafter(w[0], torch.tensor(2.0))
    assert not same_weights(other, load_causal_lm(str(copy)))


@pytest.fixture(scope="module")
def measured(perturbed, prompts):
    return M.measure(
        perturbed, REF, prompts, samples=3, max_new_tokens=3, show_progress=False,
        say=lambda _: None,
    )  # fmt: skip


def test_no_inf_is_printed_where_the_kl_is_zero(measured):
    import copy

    m = copy.deepcopy(measured)
    m["values"]["k1"]["sequence"]["relative_sd"] = math.inf  # sd / 0
    m["values"]["k2"]["token"]["relative_sd"] = math.nan  # 0 / 0
    text = M.render_measurement(m)
    assert "inf" not in text and "nan" not in text
    assert "sd/KL — (k2 per token, k1 per sequence): the exact KL is 0 there" in text
    assert "sd/KL —" not in M.render_measurement(measured)


def test_a_cosine_estimate_above_one_is_marked_and_explained(measured):
    import copy

    m = copy.deepcopy(measured)
    row = next(r for r in m["gradients"]["rows"] if (r["estimator"], r["placement"]) == ("k2", "loss"))  # fmt: skip
    for r in m["gradients"]["rows"]:  # (3 groups put some estimates above 1: k1 in the loss)
        for t in r["targets"].values():
            t["cos"] = None if t["cos"] is None else min(t["cos"], 1.0)
    row["targets"][M.TARGETS[0]]["cos"] = 1.0312
    text = M.render_measurement(m)
    assert "+1.03±" in text and "†" in text
    assert "† cosine estimates above 1 (k2 loss θ‖ref +1.031):" in text
    assert "which a cosine of two fixed vectors never does" in text
    plain = M.render_measurement(measured)
    over = [s["cos"] for r in measured["gradients"]["rows"] for s in r["targets"].values()
            if s["cos"] is not None and s["cos"] > 1]  # fmt: skip
    assert ("†" in plain) == bool(over)


def test_the_sketch_help_is_what_the_sketch_does():
    from klpo.measure.sketch import _BLOCK

    out = " ".join(CliRunner().invoke(app, ["doctor", "--help"]).output.split())  # (unwrapped)
    assert "K numbers, in blocks of 8×8" in out and "default 4096: 64 blocks" in out
    assert (M.SKETCH, _BLOCK) == (4096, 8)
    lin = torch.nn.Linear(32, 32, bias=False)
    # K numbers per matrix, rounded down to whole 8 × 8 blocks, at least one; 0 keeps it exact.
    for k, dim in ((4096, 4096), (100, 64), (10, 64), (0, 32 * 32)):
        assert M.Sketch([lin], k, 0).dim == dim


def test_real_model_memory_estimate_is_an_upper_bound(smollm2_dir, tmp_path):
    """SmolLM2-135M-Instruct against a perturbed copy, in a process of its own (its peak resident
    memory is the measurement's alone): the printed estimate is at least the measured peak. It
    was 1.1 GB under before the weights were paged in (transformers maps float32 safetensors and
    reads them lazily, so the resident memory after the load held almost none of them), and
    0.08 GB under with the parts maximised instead of summed."""
    import subprocess
    import sys

    other = load_causal_lm(str(smollm2_dir))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * p.std() * torch.randn(p.shape, generator=g))
    other.save_pretrained(tmp_path / "other")
    load_tokenizer(str(smollm2_dir)).save_pretrained(tmp_path / "other")
    del other
    data = tmp_path / "p.txt"
    data.write_text("What is 17 + 25?\nName a colour.\nWhat is 3 times 4?\n")
    args = ["doctor", "--model", str(smollm2_dir), "--reference", str(tmp_path / "other"),
            "--data", str(data), "--prompts", "3", "--samples", "3", "--max-new-tokens", "8",
            "--json"]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "klpo", *args], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr
    mem = json.loads(proc.stdout)["measurement"]["memory"]
    est, measured = mem["estimate"], mem["measured"]
    # The weights are resident before the estimate reads the process's memory.
    assert est["resident"] > measured["weights"]
    assert est["peak"] >= measured["peak_rss"], (est["peak"] / 2**30, measured["peak_rss"] / 2**30)
    # ... and not by much: within the parts and the fixed rest.
    assert est["peak"] - measured["peak_rss"] < est["total"] - est["weights"]
