"""Shared fixtures of the trainer's tests: a tiny random model saved to disk, quick configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def make_tiny_model(path: Path, seed: int = 0) -> Path:
    from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    cfg = ReferenceConfig(
        hidden_size=16, num_layers=1, intermediate_size=32, num_heads=2, num_kv_heads=1
    )
    torch.manual_seed(seed)
    model = build_model(cfg, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 1-layer Llama with the character tokenizer, saved with save_pretrained."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def quick_overrides(model: Path, out: Path, **extra: object) -> list[str]:
    """A few seconds of training on the tiny model with a reward that random text can earn."""
    base = {
        "model.policy": str(model),
        "run.out_dir": str(out),
        "run.steps": 3,
        "run.eval_every": 2,
        "run.save_every": 0,
        "run.threads": 1,
        "run.progress": False,
        "run.tensorboard": False,
        "data.eval_size": 8,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 4,
        "optim.lr": 1e-2,
        "rewards": "[{name: 'klpo_test_rewards:digits'}]",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def quick():
    """:func:`quick_overrides`, as a fixture (test modules cannot import conftest)."""
    return quick_overrides


@pytest.fixture(autouse=True)
def _test_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
