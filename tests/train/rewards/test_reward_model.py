"""Reward models: loading, batched scoring, mixing with Python rewards, a tiny trained one."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klpo.train import loop
from klpo.train.config import ConfigError, RewardTerm, build_config
from klpo.train.rewards.functions import combined_rewards
from klpo.train.rewards.model import RewardModel, build_rewards
from klpo.train.runtime.metrics import read_metrics
from klpo.train.tools.make_reward_model import wrong_answer


@pytest.fixture(scope="module")
def tiny_rm(tiny_model, tmp_path_factory):
    """A random sequence classifier (one output) on the tiny model's backbone."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path_factory.mktemp("rm") / "rm"
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    model.config.pad_token_id = 0
    with torch.no_grad():  # a head large enough that scores differ visibly
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return path


def test_scores_in_batch_equal_one_at_a_time_and_a_manual_forward(tiny_rm):
    rm = RewardModel(tiny_rm, batch_size=3)
    prompts = ["1+2=", "10+20=", "3+4=", "99+1=", "5+5="]
    completions = ["3", "30</s>", "8", "100", "10 and more"]
    batched = rm(prompts, completions, [""] * 5)
    single = [RewardModel(tiny_rm, batch_size=1)([p], [c], [""])[0] for p, c in zip(prompts, completions, strict=True)]  # fmt: skip
    assert len(set(batched)) == 5  # scores differ (the test has power)
    for a, b in zip(batched, single, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # Manual: the score head at the last token of the unpadded text.
    ids = rm.tokenizer(prompts[1] + completions[1], add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        h = rm.model.model(**ids).last_hidden_state[0, -1]
        want = float(rm.model.score(h)[0])
    assert batched[1] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert all(not p.requires_grad for p in rm.model.parameters())


def test_reward_model_mixes_with_python_rewards(tiny_rm):
    terms = [
        RewardTerm(name="model", path=str(tiny_rm), weight=0.5),
        RewardTerm(name="exact_match"),
    ]
    fns = build_rewards(terms)
    total, per = combined_rewards(fns, ["1+2=", "1+2="], ["3", "4"], ["3", "3"])
    scores = RewardModel(tiny_rm)(["1+2=", "1+2="], ["3", "4"], ["", ""])
    assert per["exact_match"] == [1.0, 0.0]
    assert per["model"] == pytest.approx(scores)
    assert total == pytest.approx([0.5 * scores[0] + 1.0, 0.5 * scores[1]])


def test_reward_model_errors(tiny_model, tmp_path, quick):
    with pytest.raises(FileNotFoundError, match="make-reward-model"):
        RewardModel(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="sequence-classification"):
        RewardModel(tmp_path)  # a directory without a model
    with pytest.raises(ConfigError, match="needs the reward model's directory"):
        build_config(overrides=quick(tiny_model, tmp_path, rewards="[{name: model}]"))
    with pytest.raises(ConfigError, match="only used by the reward 'model'"):
        build_config(overrides=quick(tiny_model, tmp_path, rewards="[{name: format, path: x}]"))


def test_train_with_a_reward_model(tiny_rm, tiny_model, quick, tmp_path):
    rewards = f"[{{name: model, path: '{tiny_rm}'}}, {{name: format, weight: 0.1}}]"
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "run", rewards=rewards, **{"run.steps": 1})
    )
    loop.train(cfg, log=lambda *_: None)
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert math.isfinite(last["reward/model"]) and "reward/format" in last
    assert last["reward/mean"] == pytest.approx(last["reward/model"] + 0.1 * last["reward/format"])


def test_wrong_answer_is_near_and_wrong():
    import random

    rng = random.Random(0)
    got = [int(wrong_answer("50", rng, 3)) for _ in range(200)]
    assert set(got) == {47, 48, 49, 51, 52, 53}


@pytest.mark.slow
def test_a_small_trained_reward_model_ranks_right_above_wrong(tmp_path):
    """`klpo make-reward-model`, seeded: 50 steps on 256 labelled pairs from the shipped
    reference; on 200 held-out pairs the pairwise accuracy beats chance (0.5) by more than 3
    standard errors (sqrt(0.25/200))."""
    from typer.testing import CliRunner

    from klpo.cli import app

    out = tmp_path / "rm"
    args = ["make-reward-model", str(out), "--n-pairs", "256", "--steps", "50", "--n-eval", "200"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "held-out pairs (chance 0.5)" in result.output
    meta = json.loads((out / "reward_model.json").read_text())
    assert meta["config"]["n_pairs"] == 256 and meta["heldout_pairs"] == 200
    assert meta["heldout_pairwise_accuracy"] > 0.5 + 3 * math.sqrt(0.25 / 200), meta
    assert RewardModel(out).model.config.num_labels == 1


def test_make_reward_model_cli_errors(tmp_path):
    from typer.testing import CliRunner

    from klpo.cli import app

    (tmp_path / "rm").mkdir()  # an earlier reward model (an empty directory is used)
    (tmp_path / "rm" / "reward_model.json").write_text("{}\n")
    again = CliRunner().invoke(app, ["make-reward-model", str(tmp_path / "rm")])
    assert again.exit_code != 0 and "--overwrite" in again.output
    bad = CliRunner().invoke(app, ["make-reward-model", str(tmp_path / "x"), "--steps", "0"])
    assert bad.exit_code != 0 and "steps must be >= 1" in bad.output


def test_make_reward_model_reports_its_progress(tmp_path):
    """Each training step with its loss, then each of the two measurements as it starts, as
    plain lines with an ETA (a long command that says nothing looks hung)."""
    from klpo.train.runtime.progress import PlainLines, Progress
    from klpo.train.tools.make_reward_model import (
        RewardModelConfig,
        make_reward_model,
        units,
    )

    config = RewardModelConfig(n_pairs=8, batch_size=4, steps=3, n_eval=4)
    lines: list[str] = []
    how = PlainLines(log=lines.append, lines=100)
    bar = Progress("make-reward-model", units(config), terminal=False, plain=how)
    make_reward_model(tmp_path / "rm", config, progress=bar)
    shown = [line.split("  ")[:2] for line in lines]
    assert shown == [
        ["make-reward-model 0/5 (0%)", "training"],  # loaded: the ETA counts from here
        ["make-reward-model 1/5 (20%)", "training"],
        ["make-reward-model 2/5 (40%)", "training"],
        ["make-reward-model 3/5 (60%)", "training"],
        ["make-reward-model 3/5 (60%)", "measuring on its 8 training pairs"],
        ["make-reward-model 4/5 (80%)", "measuring on 4 held-out pairs"],
        ["make-reward-model 5/5 (100%)", "measuring on 4 held-out pairs"],
    ]
    assert all("loss " in x and " elapsed, ETA " in x for x in lines[1:4])
    assert "held-out pairwise accuracy" in lines[-1] and "done in" in lines[-1]
