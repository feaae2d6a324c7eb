"""ref_is and adaptive_mix in the trainer: the term on the reference's completions.

Oracles: the lab's exact categorical analysis (:func:`klpo.lab.exact.analyse`, enumeration in
float64) for the expected gradient of each variant; the policy at the reference for zeros.
"""

from __future__ import annotations

import math

import pytest
import torch

from klpo import losses
from klpo.heads import Head
from klpo.lab.distributions import SequencePair
from klpo.lab.exact import analyse
from klpo.lab.ref_is import SEED_CLIP, AdaptiveMix
from klpo.ref_kl import ref_is_terms
from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.models.backbone import Backbone
from klpo.train.models.load import load_causal_lm, load_tokenizer
from klpo.train.rollout import ref_samples
from klpo.train.rollout.samplers import Rollout
from klpo.train.runtime.metrics import read_metrics
from klpo.train.step.kl_term import KLTerm, kl_term, make_window, ref_term

# pi_ref with probabilities (1/2, 1/4, 1/8, 1/8): a batch of 8 one-token completions holding
# token x 8·pi_ref(x) times is an exact stratified sample, so the trainer's batch mean over it
# *is* the expectation over x ~ pi_ref that the lab enumerates.
REF_PROBS = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
STRATIFIED = [0, 0, 0, 0, 1, 1, 2, 3]
# Policy logits with pi_theta(0) ≈ 0.016: w(0) ≈ 0.03 < 0.1, so the seed's clip bites there.
THETA = torch.tensor([-2.0, 1.5, 0.3, 1.1], dtype=torch.float64)


class _ConstantBackbone(torch.nn.Module):
    """Hidden state 1 at every position: the head's weight column *is* the logits."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, input_ids, attention_mask, position_ids, **_shared_prompt):
        return torch.ones(*input_ids.shape, 1, dtype=torch.float64)


def _one_token_rollout(tokens: list[int], prompt: torch.Tensor | None = None) -> Rollout:
    """One-token completions of one prompt (``[1, P]`` ids; a single token by default)."""
    n = len(tokens)
    prompt = torch.ones(1, 1, dtype=torch.long) if prompt is None else prompt
    return Rollout(
        prompt_ids=prompt.expand(n, -1),
        prompt_mask=torch.ones(n, prompt.shape[1], dtype=torch.bool),
        completion_ids=torch.tensor(tokens)[:, None],
        mask=torch.ones(n, 1, dtype=torch.bool),
        prompts=[""] * n,
        completions=[""] * n,
        answers=[""] * n,
        group_size=n,
    )


def _cfg(**kl):
    return build_config(overrides=[f"kl.{k}={v}" for k, v in {"placement": "loss", **kl}.items()])


def _trainer_gradient(cfg, mix_weight: float) -> torch.Tensor:
    """The trainer's expected gradient of its KL term w.r.t. the logits, beta = 1."""
    weight = THETA.clone()[:, None].requires_grad_(True)  # [V, H = 1]
    backbone = _ConstantBackbone()
    logp_ref = REF_PROBS.log()[STRATIFIED]
    batch = ref_samples.RefBatch(_one_token_rollout(STRATIFIED), logp_ref, 1.0, 1.0, 0.0)
    # The table's split of the KL term, beta = 1 (PPO's beta_old: the config's, unused here).
    term = kl_term(cfg, beta=1.0, beta_old=cfg.algo.penalty_beta, mix_weight=mix_weight, ref=batch)
    ref_term(cfg, backbone, Head(weight, None, None), term)
    name, coef = term.estimator, term.loss_coef
    if coef > 0:  # a·k1 on the policy's own tokens: its expectation over x ~ pi_theta, exactly
        logp = torch.log_softmax(weight[:, 0], -1)
        k1 = losses.kl_loss(name, logp[None], REF_PROBS.log()[None], logp_old=logp.detach()[None])
        (coef * (logp.detach().exp() * k1[0]).sum()).backward()
    return weight.grad[:, 0].detach()


@pytest.fixture(scope="module")
def exact():
    pair = SequencePair.categorical(THETA, REF_PROBS.log())
    return pair, analyse(pair, ("k1", "ref_is", "ref_is_clip"))


@pytest.mark.parametrize(("clip", "lab_name"), [("null", "ref_is"), ("[0.1, 10]", "ref_is_clip")])
def test_ref_is_expected_gradient_is_the_labs(exact, clip, lab_name):
    _, ex = exact
    assert list(SEED_CLIP) == [0.1, 10.0]
    grad = _trainer_gradient(_cfg(estimator="ref_is", ref_is_clip=clip), 0.0)
    lab = ex.gradients[lab_name]["loss"][0]
    torch.testing.assert_close(grad, lab, rtol=1e-5, atol=1e-7)
    if lab_name == "ref_is":  # and the lab's number is grad KL(pi_theta ‖ pi_ref) itself
        torch.testing.assert_close(grad, ex.grad_theta_ref[0], rtol=1e-5, atol=1e-7)
    else:  # the clip bites at token 0, so it is not
        assert (grad - ex.grad_theta_ref[0]).abs().max() > 1e-3


@pytest.mark.parametrize("sign", ["as-written", "as-described"])
def test_adaptive_mix_expected_gradient_is_the_labs(exact, sign):
    pair, _ = exact
    gamma, threshold = 10.0, 0.5
    lab_mix = AdaptiveMix(gamma=gamma if sign == "as-written" else -gamma, threshold=threshold)
    ex = analyse(pair, ("k1", "ref_is", "adaptive_mix"), mix=lab_mix)
    cfg = _cfg(estimator="adaptive_mix", mix_gamma=gamma, mix_threshold=threshold, mix_sign=sign)
    window = make_window(cfg)
    for _ in range(cfg.kl.mix_window):  # the steady state the lab evaluates: KL_window = KL
        window.push(ex.kl_theta_ref)
    a = window.weight()
    assert a == pytest.approx(ex.mix_weight, rel=1e-12)
    grad = _trainer_gradient(cfg, a)
    torch.testing.assert_close(grad, ex.gradients["adaptive_mix"]["loss"][0], rtol=1e-5, atol=1e-7)


def test_the_kl_term_table_splits_each_estimator():
    """Per-token estimators are themselves with weight 1; ref_is puts 0 on k1 and 1 on its own
    term; adaptive_mix a and 1 - a, its window only where its term is trained or logged."""

    def term(**kl):
        return kl_term(_cfg(**kl), beta=0.5, beta_old=2.0, mix_weight=0.3)

    assert term(estimator="k3") == KLTerm("k3", beta=0.5, beta_old=2.0, weight=1.0, in_loss=True)
    assert term(estimator="ref_is") == KLTerm("k1", beta=0.5, beta_old=2.0, weight=0.0)
    assert term(estimator="adaptive_mix") == KLTerm("k1", beta=0.5, beta_old=2.0, weight=0.3)
    assert not term(estimator="k3", placement="reward").in_loss
    assert make_window(_cfg(estimator="ref_is")) is None
    assert make_window(_cfg(estimator="adaptive_mix")) is not None
    assert make_window(_cfg(estimator="adaptive_mix", placement="none")) is None


def test_the_kl_term_carries_every_coefficient_of_the_loss():
    """The coefficients the update applies, by hand: beta = 0.5, a = 0.3 (adaptive_mix) puts
    0.5 · 0.3 = 0.15 on the policy's k1 and 0.5 · 0.7 = 0.35 on ref_is; a KL in the reward only,
    or beta = 0, puts none in the loss; ref_is puts none on the policy's tokens."""
    mix = kl_term(_cfg(estimator="adaptive_mix"), beta=0.5, beta_old=2.0, mix_weight=0.3)
    assert (mix.loss_weight, mix.beta_old) == (0.3, 2.0)
    assert mix.loss_coef == pytest.approx(0.15, abs=1e-15)
    assert mix.ref_coef == pytest.approx(0.35, abs=1e-15)
    ref_is = kl_term(_cfg(estimator="ref_is"), beta=0.5, beta_old=2.0, mix_weight=0.3)
    assert (ref_is.loss_weight, ref_is.loss_coef, ref_is.ref_coef) == (0.0, 0.0, 0.5)
    k3 = kl_term(_cfg(estimator="k3"), beta=0.5, beta_old=2.0)
    assert (k3.loss_weight, k3.loss_coef) == (1.0, 0.5)
    in_reward = kl_term(_cfg(estimator="k3", placement="reward"), beta=0.5, beta_old=2.0)
    assert (in_reward.loss_weight, in_reward.loss_coef) == (0.0, 0.0)
    off = kl_term(_cfg(estimator="k3"), beta=0.0, beta_old=2.0)
    assert (off.loss_weight, off.loss_coef) == (0.0, 0.0)
    with pytest.raises(ValueError, match="needs the reference's completions"):
        ref_term(_cfg(estimator="ref_is"), None, None, ref_is)


def test_at_the_reference_the_estimate_and_its_expected_gradient_are_zero(tiny_model):
    """A tiny causal LM as policy and reference; one-token completions enumerated exactly."""
    cfg = _cfg(estimator="ref_is")
    policy = Backbone(load_causal_lm(str(tiny_model)))
    reference = Backbone(load_causal_lm(str(tiny_model)))
    vocab = policy.model.config.vocab_size
    prompt = load_tokenizer(str(tiny_model))("12+7=", return_tensors="pt")["input_ids"]
    roll = _one_token_rollout(list(range(vocab)), prompt)
    with torch.no_grad():
        logp_ref = ref_samples.sequence_logp(reference, reference.head(), roll, 1.0)
    # The sampled batch: estimate 0, every weight 1, up to float32 rounding (the two batches'
    # forwards have other shapes, so their GEMMs may round differently: ~1 ulp of a log-prob).
    picks = [3, 5, 5, 7]
    batch = ref_samples.RefBatch(_one_token_rollout(picks, prompt), logp_ref[picks], 1, 1, 0)
    m = ref_term(cfg, policy, policy.head(), kl_term(cfg, beta=0.0, beta_old=1.0, ref=batch))
    assert m["kl/ref/ref_is"] == pytest.approx(0.0, abs=1e-6)
    assert m["ref/max_weight"] == pytest.approx(1.0, abs=1e-6)
    assert m["ref/ess"] == pytest.approx(1.0, abs=1e-6)
    # The expectation over x ~ pi_ref of the trainer's per-completion term: 0, with gradient 0.
    logp = ref_samples.sequence_logp(policy, policy.head(), roll, 1.0)
    expected = (logp_ref.exp() * ref_is_terms(logp, logp_ref)).sum()
    expected.backward()
    assert float(expected.detach()) == pytest.approx(0.0, abs=1e-6)
    norm = math.sqrt(sum(float((p.grad**2).sum()) for p in policy.parameters()))
    assert norm < 1e-5
    # while a single sample's gradient is not zero (the test can fail)
    policy.zero_grad()
    single = ref_samples.sequence_logp(policy, policy.head(), _one_token_rollout([3], prompt), 1.0)
    ref_is_terms(single, logp_ref[3:4]).sum().backward()
    assert math.sqrt(sum(float((p.grad**2).sum()) for p in policy.parameters())) > 1e-3


def test_the_reward_placement_is_refused_with_explains_reason():
    for est in ("ref_is", "adaptive_mix"):
        for placement in ("reward", "reward+loss"):
            with pytest.raises(ConfigError, match="no policy-gradient term"):
                _cfg(estimator=est, placement=placement)
    with pytest.raises(ConfigError, match="0 <= lo < hi"):
        _cfg(estimator="ref_is", ref_is_clip="[10, 0.1]")
    with pytest.raises(ConfigError, match="mix_sign"):
        _cfg(estimator="adaptive_mix", mix_sign="backwards")


@pytest.mark.parametrize(
    "extra",
    [
        {"kl.estimator": "ref_is", "kl.ref_is_clip": "[0.1, 10]", "kl.ref_samples": 3},
        {"kl.estimator": "ref_is", "kl.ref_is_self_normalised": "true", "algo.minibatches": 2},
        {"kl.estimator": "adaptive_mix", "kl.mix_sign": "as-described", "kl.mix_window": 2},
    ],
)
def test_both_estimators_train_end_to_end(tiny_model, quick, tmp_path, extra):
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **{"run.steps": 3, **extra}))
    loop.train(cfg, log=lambda *_: None)
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] >= 1]
    n_ref = cfg.rollout.prompts_per_step * (cfg.kl.ref_samples or cfg.rollout.group_size)
    for r in rows:
        assert r["ref/samples"] == n_ref
        assert 0 < r["ref/ess"] <= 1 + 1e-6 and r["ref/max_weight"] > 0
        assert r["time/ref_sample"] > 0 and r["time/ref_update"] > 0
        assert r["kl/ref/ref_is"] == pytest.approx(r["kl/ref/ref_is_seq"] / r["completion/length"])
        assert math.isfinite(r["loss/total"])
    if cfg.kl.estimator == "adaptive_mix":
        window: list[float] = []
        for r in rows:  # a from the window of past outputs, the output pushed after the step
            kl_window = sum(window) / len(window) if window else 0.0
            assert r["ref/kl_window"] == pytest.approx(kl_window)
            a = 1 / (1 + math.exp(cfg.kl.mix_gamma * (kl_window - cfg.kl.mix_threshold)))
            assert r["ref/mix_weight"] == pytest.approx(a)
            mix = a * r["kl/ref/k1"] + (1 - a) * r["kl/ref/ref_is"]
            assert r["kl/ref/adaptive_mix"] == pytest.approx(mix)
            window = [*window, mix][-cfg.kl.mix_window :]


def test_a_resumed_mix_run_continues_its_window(tiny_model, quick, tmp_path):
    extra = {"kl.estimator": "adaptive_mix", "run.save_every": 2, "run.eval_every": 0}
    full = build_config(overrides=quick(tiny_model, tmp_path / "a", **{"run.steps": 3, **extra}))
    loop.train(full, log=lambda *_: None)
    part = build_config(overrides=quick(tiny_model, tmp_path / "b", **{"run.steps": 2, **extra}))
    loop.train(part, log=lambda *_: None)
    more = part.model_copy(update={"run": part.run.model_copy(update={"steps": 3})})
    loop.train(more, resume=True, log=lambda *_: None)
    a = read_metrics(tmp_path / "a" / "metrics.jsonl")[-1]
    b = read_metrics(tmp_path / "b" / "metrics.jsonl")[-1]
    assert b["step"] == a["step"] == 3
    assert b["ref/kl_window"] == pytest.approx(a["ref/kl_window"], rel=1e-5)
    assert b["ref/mix_weight"] == pytest.approx(a["ref/mix_weight"], rel=1e-5)
