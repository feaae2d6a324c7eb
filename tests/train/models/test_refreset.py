"""Reference management: hard resets and soft (TR-DPO) updates of the reference, in the trainer."""

from __future__ import annotations

import pytest
import torch

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.models.reference import reset_due, update_reference
from klpo.train.runtime.metrics import read_metrics
from klpo.train.tools.make_reference import ReferenceConfig


def _pair(tiny_model):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    pol = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref, pol


def _exact_kl(pol, ref) -> torch.Tensor:
    """Naive exact KL(pi_theta ‖ pi_ref) per position, float64, from full logits."""
    ids = torch.tensor([[5, 20, 30, 17, 9, 44]])
    lp = torch.log_softmax(pol(input_ids=ids).logits.double(), -1)
    lq = torch.log_softmax(ref(input_ids=ids).logits.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def test_after_a_hard_reset_the_exact_kl_is_zero(tiny_model):
    ref, pol = _pair(tiny_model)
    with torch.no_grad():
        assert _exact_kl(pol, ref).min() > 1e-6
        update_reference(ref, pol, alpha=1.0)
        assert _exact_kl(pol, ref).abs().max().item() == 0.0


def test_soft_update_hand_and_alpha_one_is_hard(tiny_model):
    ref, pol = _pair(tiny_model)
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    update_reference(ref, pol, alpha=0.25)
    for k, p in pol.named_parameters():  # 0.25·policy + 0.75·ref, float64 oracle
        want = 0.25 * p.detach() + 0.75 * before[k]
        torch.testing.assert_close(dict(ref.named_parameters())[k], want, rtol=1e-7, atol=1e-9)
    ref2, _ = _pair(tiny_model)
    update_reference(ref2, pol, alpha=1.0)
    for k, p in pol.named_parameters():  # the soft formula at alpha = 1 is a copy, bit for bit
        assert torch.equal(dict(ref2.named_parameters())[k], p.detach())


def test_update_reference_errors(tiny_model, tmp_path):
    from klpo.train.tools.make_reference import build_model, build_tokenizer

    ref, pol = _pair(tiny_model)
    with pytest.raises(ValueError, match="alpha"):
        update_reference(ref, pol, alpha=0.0)
    other = build_model(
        ReferenceConfig(
            hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16
        ),
        build_tokenizer(),
    )
    with pytest.raises(ValueError, match="same model"):
        update_reference(other, pol, alpha=1.0)


def test_reset_due():
    class R:
        every, kl_above = 3, None

    assert [reset_due(R, s, 9.0) for s in range(1, 7)] == [False, False, True] * 2
    R.every, R.kl_above = 0, 0.05
    assert [reset_due(R, 1, k) for k in (0.01, 0.05, 0.06)] == [False, False, True]


def test_config_errors(quick, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="needs a trigger"):
        build_config(overrides=quick(tiny_model, tmp_path, **{"kl.reference_reset": "{alpha: 1}"}))
    with pytest.raises(ConfigError, match=r"reference_reset\.alpha=0\.5 with model\.lora"):
        build_config(overrides=quick(tiny_model, tmp_path, **{
            "kl.reference_reset": "{every: 2, alpha: 0.5}", "model.lora": "{r: 4}"}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"dist\.strategy=fsdp is not supported yet"):
        build_config(overrides=quick(tiny_model, tmp_path, **{
            "kl.reference_reset": "{every: 2}", "dist.strategy": "fsdp"}))  # fmt: skip
    with pytest.raises(ConfigError, match=r"leave model\.reference unset"):
        build_config(overrides=quick(tiny_model, tmp_path, **{
            "kl.reference_reset": "{every: 2}", "model.reference": str(tiny_model)}))  # fmt: skip


def test_trainer_hard_reset_zeroes_the_next_steps_kl_and_resumes(quick, tiny_model, tmp_path):
    """Reset after step 2: step 3 samples from the policy that is now the reference, so its exact
    KL is 0; a run resumed from step 2's checkpoint continues with the moved reference."""
    extra = {
        "kl.reference_reset": "{every: 2, reset_optimizer: true}",
        "run.steps": 3, "run.eval_every": 0, "run.save_every": 2,
    }  # fmt: skip
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **extra))
    loop.train(cfg, log=lambda *_: None)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert rows[2]["kl/ref/exact"] > 1e-5
    # 0 up to float32 rounding (the policy and the reference take different head kernels)
    assert abs(rows[3]["kl/ref/exact"]) < 1e-6
    assert [rows[s]["reference/updates"] for s in (1, 2, 3)] == [0, 1, 1]
    # Resume from step 2 (the reference saved there is the moved one): step 3 is the same.
    import shutil

    shutil.copytree(tmp_path / "run", tmp_path / "resumed")
    ckpts = tmp_path / "resumed" / "checkpoints"
    shutil.rmtree(ckpts / "step_000003")
    (ckpts / "latest").write_text("step_000002\n")
    cfg2 = build_config(overrides=quick(tiny_model, tmp_path / "resumed", **extra))
    loop.train(cfg2, resume=True, log=lambda *_: None)
    again = {r["step"]: r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")}
    assert abs(again[3]["kl/ref/exact"]) < 1e-6
    assert again[3]["reward/mean"] == rows[3]["reward/mean"]
