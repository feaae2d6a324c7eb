"""``run.eval_cache``: the starting policy's held-out evaluation, read back where everything it
depends on is the same, and recomputed where anything is not."""

from __future__ import annotations

import json

import pytest
import torch

from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.data.load import load_examples
from klpo.train.evaluate import cached_evaluation, evaluation_key, policy_evaluation
from klpo.train.models.build import build_models
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import is_timing, read_metrics
from klpo.train.runtime.samples import read_samples


def _run(quick, tiny_model, out, logs, **extra):
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2, **extra}))
    loop.train(cfg, log=logs.append)
    rows = [
        {k: v for k, v in r.items() if not is_timing(k)}
        for r in read_metrics(out / "metrics.jsonl")
    ]
    evals = [s for s in read_samples(out / "samples.jsonl") if s["split"] == "eval"]
    return rows, evals


def test_a_cached_start_gives_the_files_of_a_computed_one(quick, tiny_model, tmp_path):
    cache = tmp_path / "cache"
    first_logs, second_logs = [], []
    first = _run(quick, tiny_model, tmp_path / "a", first_logs, **{"run.eval_cache": cache})
    second = _run(quick, tiny_model, tmp_path / "b", second_logs, **{"run.eval_cache": cache})
    assert first == second  # every metric and every held-out record, step 0 included
    assert first[0][0]["step"] == 0 and "accuracy/heldout" in first[0][0]
    assert [s["step"] for s in first[1]] == [0] * 4 + [2] * 4
    said = [line for line in second_logs if "held-out accuracy at step 0" in str(line)]
    assert "read from run.eval_cache" in said[0]
    assert not any("read from run.eval_cache" in str(line) for line in first_logs)
    assert len(list(cache.glob("*.json"))) == 1 and len(list(cache.glob("*.safetensors"))) == 1


@pytest.fixture
def setting(quick, tiny_model, tmp_path):
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run"))
    models = build_models(cfg, Dist(), None)
    _, heldout = load_examples(cfg)
    return cfg, models, heldout


def test_the_key_follows_the_weights_prompts_decoding_and_scorer(
    setting, quick, tiny_model, tmp_path
):
    cfg, models, heldout = setting
    key = evaluation_key(cfg, models, heldout)
    assert key == evaluation_key(cfg, models, heldout)
    assert key != evaluation_key(cfg, models, heldout[:-1])
    moved = [type(e)(e.prompt + " ", e.answer, e.messages, e.where, e.row) for e in heldout]
    assert key != evaluation_key(cfg, models, moved)
    for k, v in {"rollout.max_new_tokens": 5, "gold_reward": "exact_match"}.items():
        other = build_config(overrides=quick(tiny_model, tmp_path / "run", **{k: v}))
        assert key != evaluation_key(other, models, heldout), k
    with torch.no_grad():
        p = next(models.policy.parameters())
        p.view(-1)[0] += 1e-7  # one weight, one ulp or so
    assert key != evaluation_key(cfg, models, heldout)


def test_a_damaged_entry_is_recomputed_and_replaced(setting, tmp_path):
    cfg, models, heldout = setting
    calls = []

    def compute():
        calls.append(1)
        return policy_evaluation(cfg, models, heldout, 0)

    ev, hit = cached_evaluation(tmp_path, "k", compute)
    assert not hit and calls == [1]
    (tmp_path / "k.json").write_text('{"accuracy": ')  # cut short
    _, hit = cached_evaluation(tmp_path, "k", compute)
    assert not hit and calls == [1, 1]
    back, hit = cached_evaluation(tmp_path, "k", compute)
    assert hit and calls == [1, 1]
    assert back.scores == ev.scores and back.accuracy == ev.accuracy
    assert back.first.completions == ev.first.completions
    assert torch.equal(back.first.completion_ids, ev.first.completion_ids)
    assert torch.equal(back.first.mask, ev.first.mask)
    assert json.loads((tmp_path / "k.json").read_text())["reward"] == ev.reward
