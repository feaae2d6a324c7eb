"""docs/architecture.md's "Where to add", performed: each recipe adds its one row (here with
``monkeypatch`` on the table, as a user's own code or a new line in the table's module would) and
a training step on the tiny built model runs it, with nothing else changed.

The KL estimator's recipe (a function of :mod:`klpo.kl` and its traits) is tested with the
estimator registry, where every layer is asked whether it knows the made-up estimator.
"""

from __future__ import annotations

import importlib

import pytest

from klpo import advantages, losses
from klpo.train import loop
from klpo.train.algorithms import ALGORITHMS, POLICY_LOSSES, AlgorithmSpec, PolicyLossSpec
from klpo.train.choices import ENGINES
from klpo.train.config import ConfigError, build_config
from klpo.train.rewards import functions as reward_functions
from klpo.train.runtime.metrics import read_metrics


def _one_step(tiny_model, quick, out, **extra) -> dict:
    """The metrics of one training step on the tiny model with ``extra`` overrides."""
    over = {"run.steps": 1, "run.eval_every": 0, **extra}
    loop.train(build_config(overrides=quick(tiny_model, out, **over)), log=lambda *_: None)
    (row,) = read_metrics(out / "metrics.jsonl")
    assert row["step"] == 1
    return row


def test_an_algorithm_is_a_row(tiny_model, quick, tmp_path, monkeypatch):
    """Two made-up algorithms from klpo.advantages: a group-mean baseline (Dr. GRPO's, without
    the std) and GAE without whitening. The row's traits alone decide the config's check of the
    group, the critic built, its metrics and the warnings."""
    calls: list[str] = []

    def group_mean(a, x):
        calls.append("group-mean")
        adv = advantages.group_relative(x.scores, x.group_size, std="none", valid=x.scored)
        return advantages.broadcast_to_tokens(adv, x.mask), None

    def plain_gae(a, x):
        calls.append("plain-gae")
        rewards = x.token_rewards + x.kl_penalty
        return advantages.gae(rewards, x.values, x.mask, gamma=a.gamma, lam=a.lam)

    credit = "per token, returns-to-go added to the group mean's advantage"
    monkeypatch.setitem(
        ALGORITHMS, "group-mean", AlgorithmSpec(group_mean, True, False, False, credit)
    )
    monkeypatch.setitem(
        ALGORITHMS, "plain-gae", AlgorithmSpec(plain_gae, False, True, False, "through GAE")
    )
    with pytest.raises(ConfigError, match="group_size must be >= 2 for group-mean"):
        build_config(overrides=["algo.name=group-mean", "rollout.group_size=1"])

    row = _one_step(tiny_model, quick, tmp_path / "g", **{"algo.name": "group-mean"})
    assert calls == ["group-mean"] and "loss/value" not in row
    row = _one_step(tiny_model, quick, tmp_path / "p", **{"algo.name": "plain-gae"})
    assert calls == ["group-mean", "plain-gae"]
    assert "loss/value" in row and "value/explained_var" in row  # the row's critic was built
    from klpo.train.preflight import config_warnings

    cfg = build_config(overrides=["algo.name=group-mean", "algo.vf_coef=0.25"])
    (warning,) = config_warnings(cfg)
    assert warning == (
        "vf_coef ignored: only PPO and PLAIN-GAE have a critic (algo.name is group-mean)"
    )


def test_a_policy_loss_is_a_row(tiny_model, quick, tmp_path, monkeypatch):
    """PPO's clip with the upper range equal to the lower one, from klpo.losses, as a row."""
    calls: list[int] = []

    def symmetric_clip(a, logp, logp_old, adv, mask, beta_old):
        calls.append(logp.shape[0])
        return losses.ppo_clip(logp, logp_old, adv, clip_low=a.clip_low, clip_high=a.clip_low)

    monkeypatch.setitem(POLICY_LOSSES, "symmetric-clip", PolicyLossSpec(symmetric_clip))
    row = _one_step(tiny_model, quick, tmp_path / "r", **{"algo.policy_loss": "symmetric-clip"})
    assert sum(calls) == 16  # the update's forward over the step's 4 × 4 completions
    total = row["loss/policy"] + row["beta"] * row.get("loss/kl", 0.0)
    assert row["loss/total"] == pytest.approx(total, rel=1e-6)


def test_a_rollout_engine_is_a_row(tiny_model, quick, tmp_path, monkeypatch):
    """An engine of its own name (the tests' perturbed engine: the policy's samples with their
    log-probs reported, shifted by 0.25): made, synced once, closed, and its gap logged."""
    fake = importlib.import_module("klpo_fake_engine")  # tests/train, on sys.path in a test
    made: list = []
    monkeypatch.setitem(ENGINES, "perturbed", fake.spec(0.25, made))
    row = _one_step(tiny_model, quick, tmp_path / "r", **{"rollout.engine": "perturbed"})
    (engine,) = made
    assert engine.synced == 1 and engine.closed
    assert row["engine/k1"] == pytest.approx(0.25, abs=1e-5)  # log pi_engine - log pi_old


def test_a_reward_is_registered(tiny_model, quick, tmp_path, monkeypatch):
    """register_reward(name, fn) in TRL's form: the run scores with it and logs it by name."""
    monkeypatch.setitem(reward_functions.REWARDS, "tenth_of_length", None)  # removed afterwards

    def tenth_of_length(completions, **kwargs):
        return [len(c) / 10 for c in completions]

    reward_functions.register_reward("tenth_of_length", tenth_of_length, replace=True)
    row = _one_step(tiny_model, quick, tmp_path / "r", rewards="[{name: tenth_of_length}]")
    # (reward/mean: the float32 total of the run's one reward; its own mean in float64)
    assert row["reward/tenth_of_length"] > 0
    assert row["reward/mean"] == pytest.approx(row["reward/tenth_of_length"], rel=1e-6)


def test_a_row_is_a_choice_as_soon_as_it_is_added(monkeypatch):
    """The config checks a name against its table as the table is at validation time, and a
    name that is no row is refused with the rows of now, in a Literal's words."""

    def allowed(table) -> str:
        names = [repr(n) for n in table]
        return f"{', '.join(names[:-1])} or {names[-1]}"

    for key, table, row in (
        ("algo.name", ALGORITHMS, ALGORITHMS["grpo"]),
        ("algo.policy_loss", POLICY_LOSSES, POLICY_LOSSES["clip"]),
        ("rollout.engine", ENGINES, ENGINES["hf"]),
    ):
        with pytest.raises(ConfigError) as err:
            build_config(overrides=[f"{key}=made-up"])
        assert f"{key}: got 'made-up'; allowed: {allowed(table)}" in str(err.value)
        monkeypatch.setitem(table, "made-up", row)
        section, name = key.split(".")
        assert getattr(getattr(build_config(overrides=[f"{key}=made-up"]), section), name) == (
            "made-up"
        )
