"""LoRA: the adapter-free reference is the base model, adapter-only checkpoints, export."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from klpo import logprobs
from klpo.cli import app
from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.models.backbone import Backbone
from klpo.train.models.build import build_models
from klpo.train.models.lora import AdapterFreeReference, apply_lora
from klpo.train.rollout.samplers import position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import is_timing, read_metrics

pytest.importorskip("peft")


def batch(vocab: int, b: int = 3, length: int = 7):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (b, length), generator=g)
    att = torch.ones(b, length, dtype=torch.long)
    att[0, :2] = 0  # left padding, as generate lays prompts out
    return ids, att, position_ids(att)


def test_adapter_free_reference_is_the_base_model_in_float64(tiny_model):
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
    policy = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64),
        r=4,
        alpha=8.0,
        dropout=0.0,
        target_modules="all-linear",
    )
    torch.manual_seed(1)
    with torch.no_grad():  # B starts at zero; move it so that the policy differs from the base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert all(("lora_" in n) == p.requires_grad for n, p in policy.named_parameters())
    pol = Backbone(policy).train()
    ref = AdapterFreeReference(pol)
    plain = Backbone(base).eval()
    ids, att, pos = batch(base.config.vocab_size)
    tokens = ids[:, 1:]

    h_ref, h_base = ref(ids, att, pos), plain(ids, att, pos)
    torch.testing.assert_close(h_ref, h_base, rtol=1e-12, atol=1e-12)
    h_pol = pol(ids, att, pos)
    assert (h_pol - h_base).abs().max() > 1e-3  # the adapters are on again afterwards
    w, w_ref, w_base = (b.head().weight for b in (pol, ref, plain))
    torch.testing.assert_close(w_ref, w_base, rtol=0, atol=0)

    def out(h_ref_, w_ref_):
        return logprobs.fused(
            h_pol[:, :-1], w, tokens, hidden_ref=h_ref_[:, :-1], weight_ref=w_ref_
        )

    a, b = out(h_ref, w_ref), out(h_base, w_base)
    torch.testing.assert_close(a.kl, b.kl, rtol=1e-12, atol=1e-12)
    assert a.kl.min() > 1e-4  # policy != reference, so the equality has power
    ref_lp = logprobs.fused(h_ref[:, :-1], w_ref, tokens).logp
    base_lp = logprobs.fused(h_base[:, :-1], w_base, tokens).logp
    torch.testing.assert_close(ref_lp, base_lp, rtol=1e-12, atol=1e-12)
    # and the naive float64 oracle: log_softmax of the base model's own logits
    logits = base(input_ids=ids, attention_mask=att, position_ids=pos).logits[:, :-1]
    oracle = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(ref_lp, oracle, rtol=1e-10, atol=1e-10)


def test_lora_models_hold_one_copy_of_the_weights(tiny_model):
    cfg = build_config(overrides=[f"model.policy={tiny_model}", "model.lora={r: 2}"])
    m = build_models(cfg, Dist(), None)
    assert isinstance(m.reference, AdapterFreeReference)
    policy_ids = {id(p) for p in m.policy.parameters()}
    assert {id(p) for p in m.reference.parameters()} <= policy_ids
    assert all(("lora_" in n) == p.requires_grad for n, p in m.policy.named_parameters())
    separate = build_config(
        overrides=[
            f"model.policy={tiny_model}",
            "model.lora={r: 2}",
            f"model.reference={tiny_model}",
        ]
    )
    assert isinstance(build_models(separate, Dist(), None).reference, Backbone)


def test_lora_config_refuses_the_head():
    with pytest.raises(ConfigError, match=r"lm_head.*cannot take an adapter"):
        build_config(overrides=["model.lora={target_modules: [q_proj, lm_head]}"])


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_resume_exactly_and_export(tiny_model, quick, tmp_path):
    lora = {"model.lora": "{r: 4, alpha: 8}", "run.save_every": 2, "run.eval_every": 0}
    whole = tmp_path / "whole"
    loop.train(build_config(overrides=quick(tiny_model, whole, **lora, **{"run.steps": 4})))
    part = tmp_path / "part"
    loop.train(build_config(overrides=quick(tiny_model, part, **lora, **{"run.steps": 2})))
    ckpt = part / "checkpoints" / "step_000002"
    files = sorted(p.name for p in (ckpt / "policy").iterdir())
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    n_base = sum(v.numel() for v in load_file(str(tiny_model / "model.safetensors")).values())
    n_optim = sum(v.numel() for v in load_file(str(ckpt / "optim.safetensors")).values())
    adapters = load_file(str(ckpt / "policy" / "adapter_model.safetensors"))
    n_adapter = sum(v.numel() for v in adapters.values())
    # AdamW's two moments and step count of each adapter tensor, nothing else
    assert n_optim == 2 * n_adapter + len(adapters)
    assert n_adapter < n_base  # (r = 4 on a 16-wide model; on real models it is ~1%)
    loop.train(
        build_config(overrides=quick(tiny_model, part, **lora, **{"run.steps": 4})), resume=True
    )

    def rows(run):
        return [
            {k: v for k, v in r.items() if not is_timing(k)}
            for r in read_metrics(run / "metrics.jsonl")
        ]

    assert rows(whole) == rows(part)
    assert rows(whole)[-1]["kl/ref/exact"] > 0

    out = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(whole), "--out", str(out), "--merge"])
    assert result.exit_code == 0, result.output
    assert not (out / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(out)  # transformers alone
    cfg = build_config(overrides=quick(tiny_model, whole, **lora))
    m = build_models(cfg, Dist(), whole / "checkpoints" / "step_000004")
    ids, att, pos = batch(merged.config.vocab_size)
    with torch.no_grad():
        want = m.policy(input_ids=ids, attention_mask=att, position_ids=pos).logits
        got = merged(input_ids=ids, attention_mask=att, position_ids=pos).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model)
        start = base(input_ids=ids, attention_mask=att, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - start).abs().max() > 1e-4  # the export holds the trained adapters
    adapters = tmp_path / "adapters"
    result = CliRunner().invoke(app, ["export", str(whole), "--out", str(adapters)])
    assert result.exit_code == 0, result.output
    assert (adapters / "adapter_config.json").is_file()
    assert (adapters / "tokenizer_config.json").is_file()
    again = CliRunner().invoke(app, ["export", str(whole), "--out", str(out)])
    assert again.exit_code == 2 and "already holds a model; choose another --out" in again.output


def test_export_of_a_lora_run_prints_no_deprecation(tiny_model, quick, tmp_path):
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` when it wraps the base:
    export printed transformers' FutureWarning. Silenced there, that warning only."""
    import warnings

    run = tmp_path / "run"
    extra = {"model.lora": "{r: 4}", "run.steps": 1, "run.eval_every": 0, "run.save_every": 1}
    loop.train(build_config(overrides=quick(tiny_model, run, **extra)), log=lambda *_: None)
    for i, merge in enumerate((["--merge"], [])):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = CliRunner().invoke(
                app, ["export", str(run), "--out", str(tmp_path / f"m{i}"), *merge]
            )
        assert result.exit_code == 0, result.output
        future = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
        assert future == [], future


def test_export_of_a_full_fine_tune_is_its_checkpoint(tiny_model, quick, tmp_path):
    run = tmp_path / "run"
    extra = {"run.steps": 1, "run.eval_every": 0}
    loop.train(build_config(overrides=quick(tiny_model, run, **extra)), log=lambda *_: None)
    out = tmp_path / "plain"
    result = CliRunner().invoke(app, ["export", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    got = load_file(str(out / "model.safetensors"))
    want = load_file(str(run / "checkpoints" / "step_000001" / "policy" / "model.safetensors"))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
    missing = CliRunner().invoke(app, ["export", str(tmp_path / "nothing"), "--out", str(out)])
    assert missing.exit_code == 2 and "holds no run" in missing.output
