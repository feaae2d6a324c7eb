"""The run's first lines: the config it runs (algorithm and batch, models, dtype, gradient
checkpointing, LoRA's rank, alpha and targets, optimizer, KL) before any model loads, then the
policy's trainable and total parameters, counted against the architecture by hand."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.config_files import load_configs
from klpo.train.models.describe import config_lines, parameter_lines

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_config_in_lines():
    assert config_lines(build_config()) == [
        "training: grpo, 1500 steps of 16 prompts × 8 completions (128 a step) of at most 4 new "
        "tokens, 1 epoch of 1 minibatch, run.seed=0",
        "sampling: hf engine, lean sampler, temperature 1, top-p 1; each prompt's forward once "
        "per group (rollout.share_prompt)",
        "models: policy builtin; reference a frozen copy of the policy's starting weights",
        "precision: float32 weights and compute; gradient checkpointing off",
        "LoRA: off (every weight of the policy trains)",
        "optimizer: AdamW, lr 0.0002 (constant_with_warmup), weight decay 0, grad clip 1",
        "KL: estimator full in the loss, beta 0.1 (controller fixed)",
    ]


def test_the_lora_config_in_lines():
    cfg = load_configs([ROOT / "configs" / "grpo-lora.yaml"], ["model.policy=/m"]).config
    lines = config_lines(cfg)
    assert lines[2] == (
        "models: policy /m; reference the policy with its LoRA adapters off (no second copy)"
    )
    assert lines[3] == (
        "precision: bfloat16 compute (autocast) over float32 master weights; "
        "gradient checkpointing on"
    )
    lo = cfg.model.lora
    assert lines[4] == (
        f"LoRA: rank {lo.r}, alpha {lo.alpha:g} (updates scaled by alpha/r = "
        f"{lo.alpha / lo.r:g}), dropout 0, on all-linear"
    )
    # named targets, a warm-up, a PPO critic, no KL
    cfg = build_config(
        overrides=[
            "model.lora.target_modules=[q_proj, v_proj]",
            "optim.warmup_steps=10",
            "algo.name=ppo",
            "algo.epochs=2",
            "algo.minibatches=4",
            "rollout.group_size=1",
            "kl.placement=none",
        ]
    )
    lines = config_lines(cfg)
    assert "2 epochs of 4 minibatches" in lines[0]
    assert lines[2].endswith("; critic builtin with a value head")
    assert lines[4].endswith("on q_proj, v_proj")
    assert "(constant_with_warmup, 10 warm-up steps)" in lines[5]
    assert lines[6] == "KL: none (kl.placement is none)"


def _llama_sizes(c: dict) -> tuple[int, int]:
    """(all parameters, LoRA rank-1 adapters on every linear layer but the head) of a Llama
    config, by hand: embeddings V·H (+ the head's V·H when untied); per layer q, o: H·(n·d),
    k, v: H·(n_kv·d), gate, up, down: H·I, two norms of H; a final norm of H. An adapter of
    rank r on a linear in→out has r·(in + out) parameters."""
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
    total = v * h * (1 if c.get("tie_word_embeddings") else 2) + c["num_hidden_layers"] * layer + h
    rank1 = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)
    return total, c["num_hidden_layers"] * rank1


def test_smollm2_parameter_counts_by_hand(smollm2_dir):
    """SmolLM2-135M: V = 49,152, H = 576, I = 1536, 30 layers, 9 heads of 64, 3 kv heads, tied:
    28,311,552 + 30 · 3,540,096 + 576 = 134,515,008 parameters; LoRA r = 16 on every linear:
    30 · 16 · (1152 + 2·768 + 1152 + 2·2112 + 2112) = 4,884,480. Built on the meta device
    (shapes only, nothing loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from klpo.train.models.lora import apply_lora

    c = json.loads((smollm2_dir / "config.json").read_text())
    total, rank1 = _llama_sizes(c)
    assert (total, 16 * rank1) == (134_515_008, 4_884_480)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_dir))
    assert parameter_lines(model, lora=False) == [
        "policy parameters: 134,515,008 of 134,515,008 train (all); weights 538.1 MB, "
        "AdamW state 1,076.1 MB"  # 4 bytes each, and two float32 moments
    ]
    model = apply_lora(model, r=16, alpha=32, dropout=0.0, target_modules="all-linear")
    assert parameter_lines(model, lora=True) == [
        "policy parameters: 4,884,480 of 139,399,488 train (3.50%: the LoRA adapters; the base "
        "is frozen); weights 557.6 MB, AdamW state 39.1 MB"  # 139,399,488 = 134,515,008 + 4,884,480
    ]


def test_a_runs_first_lines_say_it_all(tiny_model, quick, tmp_path):
    """In a real run: the config lines come right after the run directory, before the prompt
    and stop-set lines, and the parameter line once the policy is built, its counts those of
    the tiny Llama by hand."""
    lines: list[str] = []
    extra = {"model.lora.r": 4, "model.lora.alpha": 8, "run.steps": 1, "run.eval_every": 0,
             "model.gradient_checkpointing": "true"}  # fmt: skip
    loop.train(
        build_config(overrides=quick(tiny_model, tmp_path / "run", **extra)), log=lines.append
    )
    assert lines[0] == f"run directory: {tmp_path / 'run'}"
    assert lines[1].startswith("training: grpo, 1 step of 4 prompts × 4 completions (16 a step)")
    assert lines[4] == "precision: float32 weights and compute; gradient checkpointing on"
    assert (
        lines[5]
        == "LoRA: rank 4, alpha 8 (updates scaled by alpha/r = 2), dropout 0, on all-linear"
    )
    assert lines[7].startswith("KL: ") and lines[8].startswith("prompts: ")
    total, rank1 = _llama_sizes(json.loads((tiny_model / "config.json").read_text()))
    (params,) = [line for line in lines if line.startswith("policy parameters:")]
    share = 100 * 4 * rank1 / (total + 4 * rank1)
    assert params.startswith(
        f"policy parameters: {4 * rank1:,} of {total + 4 * rank1:,} train ({share:.2f}%: the LoRA "
        "adapters; the base is frozen)"
    )


def test_the_command_line_names_the_config_files_first(tiny_model, quick, tmp_path):
    data = tmp_path / "data.yaml"
    data.write_text("rollout:\n  group_size: 4\n")
    sets = [a for o in quick(tiny_model, tmp_path / "run") for a in ("--set", o)]
    lora = ROOT / "configs" / "grpo-lora.yaml"
    result = CliRunner().invoke(app, ["train", "-c", str(lora), "-c", str(data), *sets, "--check"])
    assert result.exit_code == 0, result.stderr
    first = result.stderr.splitlines()
    assert first[0] == (
        f"config: the defaults, then {lora}, then {data}, then --set (--print-config says which "
        "gave each key)"
    )
    assert first[1].startswith("run directory: ") and first[6].startswith("LoRA: rank 16")


def test_a_setting_that_is_off_reads_off():
    """A null setting (no gradient clip) reads "off" in the lines, not a formatting error."""
    from klpo.train.config import build_config
    from klpo.train.models.describe import config_lines

    lines = config_lines(build_config(overrides=["optim.grad_clip=null"]))
    assert any("grad clip off" in line for line in lines), lines
