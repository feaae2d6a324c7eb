"""The preflight's real-model defaults: a policy of real size gets the learning rate and the
completion length measured for real models, where the config leaves the built-in toy's; a key the
config gives is kept, and a small model keeps the toy's defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import AutoConfig

from klpo.train.config import build_config
from klpo.train.preflight import (
    REAL_MODEL_LR,
    REAL_MODEL_MAX_NEW_TOKENS,
    count_parameters,
    real_model_defaults,
)

# 8 layers of 4 H² + 3 H I with H = 384, I = 1024, plus a 1000-token embedding and head:
# 8 (589,824 + 1,179,648 + 768) + 2 · 384,000 + 384 = 14,925,440 parameters
REAL = {"hidden_size": 384, "num_hidden_layers": 8, "intermediate_size": 1024,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}  # fmt: skip
SMALL = {**REAL, "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2}  # fmt: skip


def test_parameters_are_counted_without_weights() -> None:
    n = count_parameters(AutoConfig.for_model("llama", tie_word_embeddings=False, **REAL))
    assert n == 8 * (4 * 384 * 384 + 3 * 384 * 1024 + 2 * 384) + 2 * 384 * 1000 + 384
    tied = count_parameters(AutoConfig.for_model("llama", tie_word_embeddings=True, **REAL))
    assert n - tied == 384 * 1000  # a shared tensor counted once


@pytest.mark.parametrize(
    ("lora", "lr"), [(False, REAL_MODEL_LR["full"]), (True, REAL_MODEL_LR["lora"])]
)
def test_a_real_policy_gets_real_defaults_for_the_keys_left_at_the_toys(
    lora: bool, lr: float
) -> None:
    over = ["model.policy=some/model"] + (["model.lora={r: 8}"] if lora else [])
    cfg = build_config(overrides=over)
    notes = real_model_defaults(cfg, AutoConfig.for_model("llama", **REAL))
    assert cfg.optim.lr == lr and cfg.rollout.max_new_tokens == REAL_MODEL_MAX_NEW_TOKENS
    assert len(notes) == 2 and "not the built-in toy's 0.0002" in notes[0]
    assert "rollout.max_new_tokens 64" in notes[1] and "set it to choose" in notes[1]


def test_keys_the_config_gives_are_kept_and_small_or_builtin_models_untouched() -> None:
    cfg = build_config(overrides=["model.policy=m", "optim.lr=5e-6", "rollout.max_new_tokens=9"])
    assert real_model_defaults(cfg, AutoConfig.for_model("llama", **REAL)) == []
    assert (cfg.optim.lr, cfg.rollout.max_new_tokens) == (5e-6, 9)
    cfg = build_config(overrides=["model.policy=m"])
    assert real_model_defaults(cfg, AutoConfig.for_model("llama", **SMALL)) == []
    assert (cfg.optim.lr, cfg.rollout.max_new_tokens) == (2e-4, 4)
    builtin = build_config()
    assert real_model_defaults(builtin, AutoConfig.for_model("llama", **REAL)) == []


def test_klpo_train_check_says_the_defaults_a_real_model_gets(arch_model, tmp_path) -> None:
    fields = {k: v for k, v in REAL.items() if k != "vocab_size"}  # about 14M parameters:
    model = arch_model(tmp_path / "m", "llama", head_dim=96, max_position_embeddings=512, **fields)
    cmd = [sys.executable, "-m", "klpo", "train", "--check", "--set", f"model.policy={model}",
           "--set", f"run.out_dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "note: optim.lr 1e-05 for a real model" in text, text
    assert "optimizer: AdamW, lr 1e-05" in text


def test_bf16_on_a_cpu_without_bf16_units_is_said_with_its_cost(monkeypatch) -> None:
    from klpo import gemm
    from klpo.train.preflight import bf16_warning

    avx2 = ("AMD EPYC 7B13", {"sse2", "avx2", "fma"})
    monkeypatch.setattr(gemm, "cpu_model_and_flags", lambda: avx2)
    bf16 = build_config(overrides=["model.dtype=bfloat16"])
    line = bf16_warning(bf16, cuda=False)
    assert line is not None and "AMD EPYC 7B13: no avx512_bf16 or amx_bf16" in line
    assert "9x as long as in float32" in line and "set model.dtype=float32" in line
    assert bf16_warning(build_config(), cuda=False) is None  # float32
    assert bf16_warning(bf16, cuda=True) is None  # a GPU
    units = ("Intel Xeon Sapphire Rapids", {"sse2", "avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(gemm, "cpu_model_and_flags", lambda: units)
    assert bf16_warning(bf16, cuda=False) is None
    monkeypatch.setattr(gemm, "cpu_model_and_flags", lambda: ("unknown", set()))
    assert bf16_warning(bf16, cuda=False) is None  # flags unreadable: nothing claimed
