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


def make_arch_model(path: Path, model_type: str, seed: int = 0, **fields: object) -> Path:
    """A random 2-layer model of ``model_type`` (transformers' own config class, 32 wide) with
    the character tokenizer of the built-in task, saved with save_pretrained; ``fields`` set
    config fields (a soft cap, a sliding window, a layer pattern)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from klpo.train.tools.make_reference import build_tokenizer

    tok = build_tokenizer()
    sizes = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    config = AutoConfig.for_model(model_type, **{**sizes, **fields})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random 1-layer Llama with the character tokenizer, saved with save_pretrained."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def exit_if_threads_left(rank: int) -> None:
    """Exit 1 (naming them) if any of gloo's threads is still alive: after the trainer's shutdown
    they must have ended, not wait for interpreter finalization, whose teardown of them can abort
    the process ("terminate called without an active exception")."""
    import sys

    names = sorted((t / "comm").read_text().strip() for t in Path("/proc/self/task").iterdir())
    gloo = [n for n in names if "gloo" in n]
    if gloo:
        sys.exit(f"rank {rank}: gloo threads still alive after shutdown: {gloo} (all: {names})")


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


def moved_copy(path: Path, out: Path, scale: float = 0.05) -> Path:
    """A copy of the model directory ``path`` at ``out`` with seeded noise (``scale`` standard
    deviations) on every weight: a reference the policy is off from its first step, or a pair
    whose weights differ."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    moved = {
        k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in weights.items()
    }
    save_file(moved, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture
def moved():
    """:func:`moved_copy`, as a fixture."""
    return moved_copy


@pytest.fixture
def quick():
    """:func:`quick_overrides`, as a fixture (test modules cannot import conftest)."""
    return quick_overrides


class ScoredRollout:
    """Fresh models with the policy moved off the reference by seeded noise of scale ``nudge``
    (so the KL and the entropy are not trivial; 0: left at the reference), 4 groups of 4
    completions of the first 4 training prompts sampled from it, and
    their scores (the tests' ``digits`` reward) at KL coefficient ``beta``: the set-up of a test
    of the update, through the trainer's public functions only."""

    def __init__(
        self, cfg, *, beta: float, seed: int = 0, nudge: float = 0.05, dist=None, fill_old=None
    ) -> None:
        from klpo.train.data.load import load_examples
        from klpo.train.models.build import build_models
        from klpo.train.rewards.functions import resolve_rewards
        from klpo.train.rollout.samplers import Decoding, generate
        from klpo.train.runtime.dist import Dist
        from klpo.train.step.score import score

        self.cfg, self.dist = cfg, dist if dist is not None else Dist()
        self.models = build_models(cfg, self.dist, None)
        torch.manual_seed(seed)  # (the draws of the noise, then of the completions)
        with torch.no_grad():
            for p in self.models.policy.parameters() if nudge else ():
                p.add_(nudge * torch.randn_like(p))
        self.train, _ = load_examples(cfg)
        prompts = self.train[:4]
        self.rollout = generate(self.models.policy, self.models.tokenizer, [e.prompt for e in prompts], [e.answer for e in prompts], Decoding(group_size=4, max_new_tokens=4))  # fmt: skip
        self.reward_fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
        self.scored = score(
            cfg, self.models, self.rollout, self.reward_fns, beta, self.dist, fill_old=fill_old
        )

    def fresh(self):
        """The scored rollout with an empty sampling pass: the next update's forward records
        pi_old anew (:class:`klpo.train.step.types.SamplingPass`), the rest shared."""
        import copy

        from klpo.train.step.types import SamplingPass

        s = copy.copy(self.scored)
        s.old = SamplingPass.empty(self.scored.logp_ref)
        return s


@pytest.fixture
def scored_rollout():
    """:class:`ScoredRollout`, as a fixture: ``scored_rollout(cfg, beta=0.5)``."""
    return ScoredRollout


@pytest.fixture(autouse=True)
def _test_rewards_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.fixture
def arch_model():
    """:func:`make_arch_model`, as a fixture."""
    return make_arch_model
