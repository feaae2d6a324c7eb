"""kl.reference_reset with LoRA: merge-and-restart, its checkpoints, resume and export."""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.models.lora import (
    apply_lora,
    base_weights,
    load_base_weights,
    merge_and_restart,
    restart_generator,
)
from klpo.train.runtime import checkpoint as ckpt_io
from klpo.train.runtime.metrics import is_timing, read_metrics

pytest.importorskip("peft")

IDS = torch.tensor([[5, 20, 30, 17, 9, 44], [7, 7, 12, 40, 3, 21]])
R, ALPHA = 4, 8.0  # scaling s = alpha / r = 2


def _trained_lora(tiny_model):
    """A float64 LoRA policy on every linear layer whose adapters moved away from B = 0."""
    policy = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64),
        r=R,
        alpha=ALPHA,
        dropout=0.0,
        target_modules="all-linear",
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    return policy


def _logp(model, adapters: bool = True) -> torch.Tensor:
    """Full-vocabulary log-probs [B, T, V] in float64, the adapters on or off."""
    if adapters:
        return torch.log_softmax(model(input_ids=IDS).logits.double(), -1)
    with model.disable_adapter():
        return torch.log_softmax(model(input_ids=IDS).logits.double(), -1)


def _layers(policy):
    """name -> (W, A, B) of every adapted layer, cloned."""
    out = {}
    for name, module in policy.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            out[name] = tuple(
                t.detach().clone()
                for t in (
                    module.base_layer.weight,
                    module.lora_A["default"].weight,
                    module.lora_B["default"].weight,
                )
            )
    return out


def test_merge_and_restart_keeps_the_policy_and_makes_it_the_reference(tiny_model):
    policy = _trained_lora(tiny_model)
    before = _layers(policy)
    with torch.no_grad():
        lp_before, lq_before = _logp(policy), _logp(policy, adapters=False)
    kl_before = (lp_before.exp() * (lp_before - lq_before)).sum(-1)
    assert kl_before.min() > 1e-4  # the adapters matter, so the checks below have power

    assert merge_and_restart(policy, restart_generator(0, 0)) == len(before) == 7
    after = _layers(policy)
    g = restart_generator(0, 0)
    for name, (w, a, b) in before.items():
        w2, a2, b2 = after[name]
        # W <- W + (alpha / r) · B A, by hand in float64
        torch.testing.assert_close(w2, w + ALPHA / R * b @ a, rtol=1e-14, atol=1e-14)
        assert torch.count_nonzero(b2) == 0
        # A drawn as peft draws it: kaiming-uniform with a = sqrt(5) is U(-1/sqrt(in), 1/sqrt(in))
        bound = 1 / math.sqrt(a.shape[1])
        want = torch.empty(a.shape).uniform_(-bound, bound, generator=g).double()
        assert torch.equal(a2, want)
    with torch.no_grad():
        lp, lq = _logp(policy), _logp(policy, adapters=False)
    torch.testing.assert_close(lp, lp_before, rtol=1e-12, atol=1e-12)  # the same function
    assert torch.equal(lp, lq)  # B = 0 adds an exact zero: the reference is the policy
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert kl.abs().max().item() == 0.0


def test_fresh_adapters_learn_through_b_only_and_the_draw_is_reproducible(tiny_model):
    policy = _trained_lora(tiny_model)
    merge_and_restart(policy, restart_generator(3, 5))
    _logp(policy)[..., 0].sum().backward()
    grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
    # dL/dA = s · B^T (dL/dy) x^T = 0 at B = 0; dL/dB = s · (dL/dy) (A x)^T is not
    assert all(torch.count_nonzero(g) == 0 for n, g in grads.items() if "lora_A" in n)
    assert all(torch.count_nonzero(g) > 0 for n, g in grads.items() if "lora_B" in n)
    again = _trained_lora(tiny_model)
    merge_and_restart(again, restart_generator(3, 5))
    other = _trained_lora(tiny_model)
    merge_and_restart(other, restart_generator(3, 6))
    a1, a2, a3 = ({n: t[1] for n, t in _layers(m).items()} for m in (policy, again, other))
    assert all(torch.equal(a1[n], a2[n]) for n in a1)  # a function of (seed, update) alone
    assert not any(torch.equal(a1[n], a3[n]) for n in a1)


def test_merge_and_restart_refuses_what_it_does_not_handle(tiny_model):
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    dora = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"q_proj.*variant \(DoRA"):
        merge_and_restart(dora, restart_generator(0, 0))


def test_base_weights_round_trip(tiny_model):
    policy = _trained_lora(tiny_model)
    merge_and_restart(policy, restart_generator(0, 0))
    saved = {k: v.clone() for k, v in base_weights(policy).items()}
    assert not any("lora_" in k for k in saved)
    assert "base_model.model.lm_head.weight" not in saved  # tied to the embedding: once
    fresh = _trained_lora(tiny_model)
    load_base_weights(fresh, saved, "here")
    assert all(torch.equal(v, base_weights(fresh)[k]) for k, v in saved.items())
    del saved["base_model.model.model.norm.weight"]
    with pytest.raises(ValueError, match=r"here does not hold the base weights.*norm"):
        load_base_weights(fresh, saved, "here")


def test_config_refuses_a_soft_update_with_lora(quick, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match=r"kl\.reference_reset\.alpha=0\.5 with model\.lora.*"
                       r"alpha=1, or full fine-tuning"):  # fmt: skip
        build_config(overrides=quick(tiny_model, tmp_path, **{
            "kl.reference_reset": "{every: 2, alpha: 0.5}", "model.lora": "{r: 4}"}))  # fmt: skip
    cfg = build_config(overrides=quick(tiny_model, tmp_path, **{
        "kl.reference_reset": "{every: 2}", "model.lora": "{r: 4}"}))  # fmt: skip
    assert cfg.kl.reference_reset.alpha == 1.0


def _rows(run):
    return [
        {k: v for k, v in r.items() if not is_timing(k)}
        for r in read_metrics(run / "metrics.jsonl")
    ]


@pytest.mark.slow
def test_trainer_lora_reset_resumes_exactly_and_exports(quick, tiny_model, tmp_path):
    """Merge-and-restart after step 2: step 3 samples from a policy that is the reference (its
    exact KL is float32 noise, as at step 1 where B = 0); the checkpoint of step 2 holds B = 0,
    no optimizer state and the merged base; a run resumed from it continues exactly; the merged
    export of step 3 is the saved base plus the saved adapters."""
    extra = {
        "model.lora": f"{{r: {R}, alpha: {ALPHA}}}",
        "kl.reference_reset": "{every: 2}",
        "run.steps": 3, "run.eval_every": 0, "run.save_every": 1,
    }  # fmt: skip
    whole = tmp_path / "whole"
    loop.train(build_config(overrides=quick(tiny_model, whole, **extra)), log=lambda *_: None)
    rows = {r["step"]: r for r in _rows(whole)}
    assert [rows[s]["reference/updates"] for s in (1, 2, 3)] == [0, 1, 1]
    assert rows[2]["kl/ref/exact"] > 1e-5
    assert abs(rows[1]["kl/ref/exact"]) < 1e-6 and abs(rows[3]["kl/ref/exact"]) < 1e-6

    # step 2's checkpoint: after the reset (the save follows the step)
    part = tmp_path / "part"
    shutil.copytree(whole, part)
    ckpt = part / "checkpoints" / "step_000002"
    adapters = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    assert all(torch.count_nonzero(v) == 0 for k, v in adapters.items() if "lora_B" in k)
    assert ckpt_io.load_state(ckpt)["optimizers"]["policy"]["state"] == {}
    base = load_file(str(tiny_model / "model.safetensors"))
    merged = load_file(str(ckpt / "reference.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (merged[f"base_model.model.{q}".replace(".weight", ".base_layer.weight")] - base[q]).abs().max() > 1e-4  # fmt: skip

    shutil.rmtree(part / "checkpoints" / "step_000003")
    (part / "checkpoints" / "latest").write_text("step_000002\n")
    loop.train(
        build_config(overrides=quick(tiny_model, part, **extra)), resume=True, log=lambda *_: None
    )
    assert _rows(part) == _rows(whole)
    for name in ("policy/adapter_model.safetensors", "reference.safetensors"):
        a, b = (load_file(str(r / "checkpoints" / "step_000003" / name)) for r in (whole, part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    out = tmp_path / "merged"
    plain = CliRunner().invoke(app, ["export", str(whole), "--out", str(tmp_path / "adapters")])
    assert plain.exit_code == 2 and "export with --merge" in plain.output
    result = CliRunner().invoke(app, ["export", str(whole), "--out", str(out), "--merge"])
    assert result.exit_code == 0, result.output
    got = load_file(str(out / "model.safetensors"))
    last = whole / "checkpoints" / "step_000003"
    saved_base = load_file(str(last / "reference.safetensors"))
    saved_ad = load_file(str(last / "policy" / "adapter_model.safetensors"))
    assert all(torch.count_nonzero(v) > 0 for v in saved_ad.values())  # step 3 trained B
    for key, w in got.items():  # W_export = W_saved_base + (alpha / r) · B A, by hand
        stem = f"base_model.model.{key[: -len('.weight')]}"
        if f"{stem}.lora_A.weight" in saved_ad:
            want = saved_base[f"{stem}.base_layer.weight"].double() + ALPHA / R * (
                saved_ad[f"{stem}.lora_B.weight"].double() @ saved_ad[f"{stem}.lora_A.weight"].double()
            )  # fmt: skip
            torch.testing.assert_close(w.double(), want, rtol=1e-6, atol=1e-6)
        elif key != "lm_head.weight":
            assert torch.equal(w, saved_base[f"base_model.model.{key}"])
