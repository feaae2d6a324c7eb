"""Rollout engines through the trainer, without vLLM: the engine/trainer gap and its correction.

An engine whose log-probs are the trainer's plus a known ``delta`` (``klpo_fake_engine``) stands
in for vLLM under ``rollout.engine=vllm``. With ``d = log pi_engine - log pi_old = delta`` on
every token, by hand: ``engine/k1 = delta``, ``engine/k3 = e^-delta - 1 + delta``, the TIS weight
``w = min(e^-delta, cap)``; the policy loss and its gradient are ``w`` times those of the same
step sampled by the HF engine, and the KL term is unchanged (it uses the trainer's pi_old).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.models.build import build_models
from klpo.train.preflight import preflight
from klpo.train.rollout import engines
from klpo.train.rollout.samplers import Decoding, generate
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import read_metrics


def _fake():
    """The perturbed engine's module (tests/train is on sys.path only while a test runs)."""
    return importlib.import_module("klpo_fake_engine")


def _fake_reference(path):
    """Another random tiny model (same tokenizer), so that the KL to it is not 0 at step 1."""
    return importlib.import_module("conftest").make_tiny_model(path, seed=1)


def _one_step(tiny_model, quick, out, monkeypatch, delta=None, made=None, **extra):
    """Metrics of one training step; ``delta`` set: sampled by the perturbed engine."""
    over = {"run.steps": 1, "run.eval_every": 0, **extra}
    if delta is not None:
        monkeypatch.setitem(engines.ENGINES, "vllm", _fake().spec(delta, made))
        over["rollout.engine"] = "vllm"
    loop.train(build_config(overrides=quick(tiny_model, out, **over)), log=lambda *_: None)
    (row,) = read_metrics(out / "metrics.jsonl")
    return row


def test_hf_engine_is_generate(tiny_model, quick, tmp_path):
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "r"))
    m = build_models(cfg, Dist(), None)
    prompts, answers = ["1+2=", "30+4="], ["3", "34"]
    engine = engines.make_engine(cfg, m, Dist(), str(tiny_model))
    assert isinstance(engine, engines.HFEngine)
    torch.manual_seed(5)
    got = engine.sample(prompts, answers)
    assert m.policy.training and got.engine_logp is None
    torch.manual_seed(5)
    m.policy.eval()
    want = generate(m.policy, m.tokenizer, prompts, answers, Decoding(group_size=4, max_new_tokens=4, max_prompt_tokens=cfg.data.max_prompt_tokens, sampler=cfg.rollout.sampler))  # fmt: skip
    for key in ("prompt_ids", "completion_ids", "mask", "truncated"):
        assert torch.equal(getattr(got, key), getattr(want, key)), key
    assert got.completions == want.completions


def test_gap_metrics_by_hand_and_one_sync_per_step(tiny_model, quick, tmp_path, monkeypatch):
    made: list = []
    over = {"run.steps": 2, "run.eval_every": 0, "rollout.engine": "vllm", "rollout.tis_cap": 2.0}
    monkeypatch.setitem(engines.ENGINES, "vllm", _fake().spec(0.3, made))
    loop.train(build_config(overrides=quick(tiny_model, tmp_path / "r", **over)), log=print)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    (engine,) = made
    assert engine.synced == 2 and engine.closed
    k3 = math.exp(-0.3) - 1 + 0.3  # 0.0408182...
    for row in rows:
        assert row["engine/k1"] == pytest.approx(0.3, abs=1e-5)
        assert row["engine/k3"] == pytest.approx(k3, abs=1e-5)
        assert row["engine/k3_max"] == pytest.approx(k3, abs=1e-5)
        assert row["engine/abs_max"] == pytest.approx(0.3, abs=1e-5)
        assert row["engine/tis_weight"] == pytest.approx(math.exp(-0.3), abs=1e-5)
        assert row["engine/tis_clip_frac"] == 0.0


_HF_RUN: dict[str, dict] = {}


@pytest.mark.parametrize(
    ("delta", "cap", "w", "clipped"),
    [
        (0.5, 2.0, math.exp(-0.5), 0.0),  # rho = e^-0.5 = 0.607 < 2: w = rho
        (-1.0, 2.0, 2.0, 1.0),  # rho = e = 2.718 > 2: truncated to 2 on every token
        (0.5, None, 1.0, 0.0),  # no cap: no correction, the gap only logged
    ],
)
def test_tis_scales_the_policy_loss_and_its_gradient(
    tiny_model, quick, tmp_path, monkeypatch, delta, cap, w, clipped
):
    """One optimizer step on the same samples: loss/policy and the policy's gradient norm are
    w times the HF engine's (the KL is off, no gradient clip), the reward the same."""
    extra = {"kl.placement": "none", "optim.grad_clip": "null"}
    if "hf" not in _HF_RUN:  # the same HF run for every case
        _HF_RUN["hf"] = _one_step(tiny_model, quick, tmp_path / "hf", monkeypatch, **extra)
    hf = _HF_RUN["hf"]
    tis = _one_step(
        tiny_model, quick, tmp_path / "tis", monkeypatch, delta=delta,
        **extra, **{"rollout.tis_cap": "null" if cap is None else cap},
    )  # fmt: skip
    assert tis["reward/mean"] == hf["reward/mean"]
    # On-policy the group-relative surrogate nearly cancels (loss/policy ~ 1e-9, float noise), so
    # the gradient is the sharp check; the loss only within that noise.
    assert hf["grad_norm"] > 1e-3
    assert tis["grad_norm"] == pytest.approx(w * hf["grad_norm"], rel=1e-4)
    assert tis["loss/policy"] == pytest.approx(w * hf["loss/policy"], abs=1e-6)
    assert tis["engine/tis_clip_frac"] == clipped
    assert "engine/k1" not in hf


def test_the_kl_term_uses_the_trainers_pi_old_not_the_engines(
    tiny_model, quick, tmp_path, monkeypatch
):
    """k3 in the loss is importance-weighted by pi_theta / pi_old (1 on-policy). Had the engine's
    log-probs been taken for pi_old, every weight would be e^-delta = e^-0.5 and loss/kl that
    times the HF run's; it is the HF run's."""
    reference = _fake_reference(tmp_path / "ref")
    extra = {"kl.estimator": "k3", "kl.placement": "loss", "model.reference": reference}
    hf = _one_step(tiny_model, quick, tmp_path / "hf", monkeypatch, **extra)
    tis = _one_step(tiny_model, quick, tmp_path / "tis", monkeypatch, delta=0.5, **extra)
    assert hf["loss/kl"] > 0
    assert tis["loss/kl"] == pytest.approx(hf["loss/kl"], rel=1e-5)
    assert abs(tis["loss/kl"] / hf["loss/kl"] - math.exp(-0.5)) > 0.3
    assert tis["kl/ref/k3"] == pytest.approx(hf["kl/ref/k3"], rel=1e-5)


def test_vllm_engine_is_checked_before_any_model_loads(tiny_model, quick, tmp_path, monkeypatch):
    make = engines.ENGINES["vllm"].make
    absent = engines.EngineSpec(make, requires="no_such_package_klpo", processes=1)
    monkeypatch.setitem(engines.ENGINES, "vllm", absent)
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "r", **{"rollout.engine": "vllm"}))
    with pytest.raises(ConfigError, match=r"needs the 'no_such_package_klpo' package.*engine=hf"):
        preflight(cfg, Dist(), resume=False)
    assert not (tmp_path / "r").exists()
    monkeypatch.setitem(engines.ENGINES, "vllm", engines.EngineSpec(make, processes=1))
    engines.check_engine(cfg, 1)
    with pytest.raises(ConfigError, match="runs in one process, but this run has 2"):
        engines.check_engine(cfg, 2)


def test_config_rejects_bad_engine_settings():
    with pytest.raises(ConfigError, match=r"rollout.engine: got 'sglang'; allowed: 'hf' or 'vllm'"):
        build_config(overrides=["rollout.engine=sglang"])
    with pytest.raises(ConfigError, match=r"rollout\.tis_cap"):
        build_config(overrides=["rollout.tis_cap=0"])


def test_a_lora_policy_is_sent_merged_and_left_unmerged(tiny_model):
    """policy_weights of a peft LoRA model: the names and values of peft's own merge_and_unload
    (W + (alpha / r)·B A), while the policy keeps its adapters unmerged (its outputs unchanged)."""
    peft = pytest.importorskip("peft")
    import copy

    from klpo.train.models.load import load_causal_lm

    torch.manual_seed(0)
    base = load_causal_lm(str(tiny_model), "float32")
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    policy = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # peft starts B at 0 (a zero delta): make the adapters matter
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    ids = torch.tensor([[1, 5, 6, 7]])
    before = policy(input_ids=ids).logits
    want = copy.deepcopy(policy).merge_and_unload().state_dict()
    got = dict(engines.policy_weights(policy))
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    # The merge is not a no-op: the sent q_proj differs from the frozen base weight.
    q_base = policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert (got["model.layers.0.self_attn.q_proj.weight"] - q_base).abs().max() > 1e-3
    assert torch.equal(policy(input_ids=ids).logits, before)


# An engine behind the trainer (rollout.staleness with rollout.engine=vllm): it is loaded with the
# sampling version every step, its log-probs weight the policy loss (they are what the tokens
# were drawn from), and the trainer's own at that version are pi_behav for the KL term and the
# exact sampler metrics; engine/* is the engine against the trainer at the same weights.


def test_a_stale_engine_is_loaded_with_the_sampling_version_each_step(
    tiny_model, quick, tmp_path, monkeypatch
):
    """k = 1: step t samples with version t - 2 (step 1 with version 0). The fake engine fails
    a sample with weights other than those of its last sync, so one sync a step at the sampling
    version is checked; engine/* is delta exactly only against the trainer at that version
    (against pi_old, the current weights, it would carry the lag too)."""
    made: list = []
    over = {
        "run.steps": 3, "run.eval_every": 0, "rollout.engine": "vllm", "rollout.staleness": 1,
        "rollout.tis_cap": 2.0,
    }  # fmt: skip
    monkeypatch.setitem(engines.ENGINES, "vllm", _fake().spec(0.3, made))
    loop.train(build_config(overrides=quick(tiny_model, tmp_path / "r", **over)), log=print)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    (engine,) = made
    assert engine.synced == 3 and engine.closed
    k3 = math.exp(-0.3) - 1 + 0.3
    for step, row in enumerate(rows, start=1):
        assert row["rollout/staleness"] == min(1, step - 1)
        assert row["engine/k1"] == pytest.approx(0.3, abs=1e-5)
        assert row["engine/k3"] == pytest.approx(k3, abs=1e-5)
        assert row["engine/abs_max"] == pytest.approx(0.3, abs=1e-5)
    assert rows[0]["sampler/kl_exact"] == pytest.approx(0.0, abs=1e-6)  # version 0 = pi_old
    assert all(row["sampler/kl_exact"] > 1e-6 for row in rows[1:])  # one version behind
    # The sampler's weights are the engine's: k1 of KL(pi_behav ‖ pi_old) on the tokens is the
    # trainer's gap (0 at step 1, where the two are the same weights) plus delta.
    assert rows[0]["sampler/kl_k1"] == pytest.approx(0.3, abs=1e-5)


def test_a_stale_engines_log_probs_weight_the_policy_loss_and_the_trainers_the_kl(
    tiny_model, quick, tmp_path, monkeypatch
):
    """Step 1 of k = 1 (version 0, the weights that start the step): sampled by the HF engine
    the TIS weight pi_old / pi_behav is 1; by the engine it is pi_old / pi_engine = e^-delta,
    so the policy's gradient is e^-delta times the HF run's, while k3 in the loss, corrected
    by pi_theta / pi_behav with the trainer's pi_behav, is the HF run's (with the engine's
    log-probs there it would be e^-delta times it)."""
    reference = _fake_reference(tmp_path / "ref")
    extra = {
        "rollout.staleness": 1, "kl.estimator": "k3", "kl.placement": "loss",
        "kl.behaviour_correction": "is", "model.reference": reference,
        "optim.grad_clip": "null", "rollout.tis_cap": 2.0,
    }  # fmt: skip
    hf = _one_step(tiny_model, quick, tmp_path / "hf", monkeypatch, **extra)
    vllm = _one_step(tiny_model, quick, tmp_path / "vllm", monkeypatch, delta=0.5, **extra)
    assert vllm["reward/mean"] == hf["reward/mean"]
    assert hf["loss/kl"] > 0
    assert vllm["loss/kl"] == pytest.approx(hf["loss/kl"], rel=1e-5)
    assert vllm["engine/tis_weight"] == pytest.approx(math.exp(-0.5), abs=1e-5)
    assert hf["sampler/ess"] == pytest.approx(1.0)
    # The policy loss alone: the KL term's gradient would not scale.
    no_kl = {**extra, "kl.placement": "none"}
    hf_pg = _one_step(tiny_model, quick, tmp_path / "hf-pg", monkeypatch, **no_kl)
    vllm_pg = _one_step(tiny_model, quick, tmp_path / "vllm-pg", monkeypatch, delta=0.5, **no_kl)
    assert hf_pg["grad_norm"] > 1e-3
    assert vllm_pg["grad_norm"] == pytest.approx(math.exp(-0.5) * hf_pg["grad_norm"], rel=1e-4)


def test_an_asynchronous_engine_other_than_hf_is_refused():
    with pytest.raises(ConfigError, match=r"rollout\.asynchronous with rollout\.engine=vllm"):
        build_config(
            overrides=["rollout.staleness=1", "rollout.asynchronous=true", "rollout.engine=vllm"]
        )
    stale = build_config(overrides=["rollout.staleness=2", "rollout.engine=vllm"])
    assert stale.rollout.engine == "vllm" and stale.rollout.staleness == 2
