"""The doctor's readers on hand-written fixture configs, one or more per framework.

The fixtures (tests/doctor/fixtures) are written from each framework's documentation; no framework
is installed. The oracle for what a term does is klpo.kl.explain (itself derived by exact
enumeration); the readers must put the right estimator, placement, coefficient and reduction in
front of it, fill in the named version's defaults, and flag what is ignored, doubled or rescaled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from klpo import kl
from klpo.doctor import DoctorError, detect, diagnose, read
from klpo.doctor.advice import validate
from klpo.doctor.report import clamp_regions

FIX = Path(__file__).parent / "fixtures"
CONFIGS = Path(__file__).parents[2] / "configs"


def _levels(diag, level):
    return [f["text"] for f in diag["findings"] if f["level"] == level]


@pytest.mark.parametrize(
    ("name", "framework"),
    [
        ("verl_grpo.yaml", "verl"),
        ("verl_grpo.sh", "verl"),
        ("trl_grpo.yaml", "trl-grpo"),
        ("trl_grpo_kl.json", "trl-grpo"),
        ("openrlhf_ppo.sh", "openrlhf"),
        ("openrlhf_grpo.sh", "openrlhf"),
    ],
)
def test_detect(name, framework):
    assert detect(FIX / name) == framework


def test_detect_klpo_config():
    assert detect(CONFIGS / "grpo.yaml") == "klpo"


def test_stock_verl_grpo():
    d = diagnose(FIX / "verl_grpo.yaml")
    assert (d["framework"], d["defaults_version"], d["algorithm"], d["group_size"]) == (
        "verl",
        "0.9.1",
        "grpo",
        5,
    )
    # 1024 prompts per batch, mini-batches of 256 prompts, 1 epoch: 4 optimiser steps.
    assert d["updates_per_batch"] == 4 and d["off_policy"]
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"], t["reduction"]) == (
        "low_var_kl",
        "loss",
        0.001,
        "token-mean",
    )
    assert t["on_policy"] == kl.explain("low_var_kl", "loss").to_dict()
    assert t["off_policy"] == kl.explain("low_var_kl", "loss", on_policy=False).to_dict()
    assert t["unclamped"]["gradient"] == kl.GRAD_REF_THETA  # k3's, where no clamp binds
    assert t["value_clamp"] == (-10.0, 10.0)
    assert any("4 optimiser steps" in w for w in _levels(d, "warning"))
    # Defaults filled in: the reward switch was written, the loss_agg_mode was not.
    assert d["settings"]["actor_rollout_ref.actor.loss_agg_mode"] == {
        "value": "token-mean",
        "from": "default",
    }
    assert d["settings"]["algorithm.use_kl_in_reward"]["from"] == "file"
    assert d["equivalent"]["config"]["kl"] == {
        "estimator": "low_var_kl",
        "placement": "loss",
        "beta": 0.001,
        "off_policy_correction": False,  # verl does not weight its KL loss for pi_old
    }
    assert d["equivalent"]["config"]["algo"]["minibatches"] == 4
    assert d["intended"]["config"]["kl"]["estimator"] == "k3+"
    assert d["equivalent"]["invalid"] is None and d["intended"]["invalid"] is None


def test_verl_command_line_reads_like_the_yaml():
    a, b = diagnose(FIX / "verl_grpo.yaml"), diagnose(FIX / "verl_grpo.sh")
    assert a["terms"] == b["terms"] and a["equivalent"] == b["equivalent"]


def test_verl_both_switches_doubled_and_group_scaled():
    d = diagnose(FIX / "verl_grpo_both.yaml")
    placements = [(t["placement"], t["estimator"], t["beta"]) for t in d["terms"]]
    assert placements == [("loss", "low_var_kl", 0.01), ("reward", "k1", 0.05)]
    assert d["terms"][1]["adaptive"]
    warnings = " ".join(_levels(d, "warning"))
    assert "applied twice" in warnings
    assert "0.05 / std(score of the group)" in d["group_scaling"]
    notes = " ".join(_levels(d, "note"))
    assert "adapts only the reward-side coefficient" in notes
    assert d["equivalent"]["config"]["kl"]["placement"] == "reward+loss"
    assert any("one estimator and one beta" in x for x in d["equivalent"]["differences"])
    # 2 epochs on one mini-batch: off-policy from the second.
    assert d["updates_per_batch"] == 2
    # The likely intent: one term, in the loss, straight-through.
    assert d["intended"]["config"]["kl"] == {
        "estimator": "k3+",
        "placement": "loss",
        "beta": 0.01,
        "controller": "adaptive",
        "target": 0.1,
        "horizon": 10000.0,
    }


def test_verl_ignored_settings_and_straight_through_clamp():
    d = diagnose(FIX / "verl_ppo_ignored.yaml")
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("k3+", "reward", 0.02)
    ignored = " ".join(_levels(d, "warning"))
    assert "actor_rollout_ref.actor.kl_loss_type" in ignored and "ignored" in ignored
    assert d["algorithm"] == "gae" and d["equivalent"]["config"]["algo"]["name"] == "ppo"
    assert d["intended"]["config"]["kl"]["estimator"] == "k1"  # in the reward, k1
    assert t["on_policy"]["gradient"] == kl.explain("k3+", "reward").gradient


def test_verl_full_is_an_error(tmp_path):
    cfg = tmp_path / "full.yaml"
    cfg.write_text("actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_type: full\n")
    d = diagnose(cfg)
    assert d["terms"][0]["estimator"] is None
    assert any("NotImplementedError" in e for e in _levels(d, "error"))


def test_verl_unknown_estimator_names_the_key(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("algorithm:\n  use_kl_in_reward: true\n  kl_penalty: k4\n")
    with pytest.raises(DoctorError, match=r"algorithm\.kl_penalty = 'k4'.*allowed: kl, k1"):
        read(cfg)


def test_stock_trl_grpo_has_no_kl():
    d = diagnose(FIX / "trl_grpo.yaml")
    assert d["terms"] == [] and d["defaults_version"] == "1.16.0"
    assert any("beta is 0" in n for n in _levels(d, "note"))
    assert d["equivalent"]["config"]["kl"] == {"placement": "none", "beta": 0.0}
    assert d["equivalent"]["config"]["algo"]["loss_reduction"] == "token-mean"  # dapo
    assert d["equivalent"]["invalid"] is None


def test_trl_grpo_k3_off_policy():
    d = diagnose(FIX / "trl_grpo_kl.json")
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"], t["reduction"]) == (
        "k3",
        "loss",
        0.04,
        "seq-mean-token-mean",
    )
    assert t["on_policy"]["gradient"] == kl.GRAD_REF_THETA
    assert d["updates_per_batch"] == 2  # num_iterations
    assert t["off_policy"] == kl.explain("k3", "loss", on_policy=False).to_dict()
    rollout = d["equivalent"]["config"]["rollout"]
    assert (rollout["group_size"], rollout["max_new_tokens"], rollout["temperature"]) == (
        8,
        512,
        0.9,
    )
    notes = " ".join(_levels(d, "note"))
    assert "temperature 0.9" in notes and "per sequence first" in notes


def test_trl_grpo_default_bias_correction_is_k3_is(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("beta: 0.04\nnum_iterations: 3\n")
    d = diagnose(cfg)
    [t] = d["terms"]
    assert t["estimator"] == "k3_is" and t["corrected"]
    # k3_is carries its own weight: off-policy it still follows grad KL(pi_theta ‖ pi_ref).
    assert t["off_policy"]["gradient"] == kl.GRAD_THETA_REF
    assert not any("not weighted" in w for w in _levels(d, "warning"))


def test_trl_sequence_level_ratio_has_no_klpo_estimator(tmp_path):
    cfg = tmp_path / "g.json"
    cfg.write_text(json.dumps({"beta": 0.04, "importance_sampling_level": "sequence"}))
    d = diagnose(cfg)
    assert d["terms"][0]["estimator"] is None
    assert any("#6586" in w for w in _levels(d, "warning"))


def test_trl_rloo():
    d = diagnose(FIX / "trl_rloo.yaml", framework="trl-rloo")
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("k1", "reward", 0.05)
    assert t["on_policy"]["gradient"] == kl.GRAD_THETA_REF
    assert "leave-one-out" in d["group_scaling"]
    assert d["equivalent"]["config"]["algo"]["name"] == "rloo"
    assert d["intended"]["config"]["kl"] == d["equivalent"]["config"]["kl"]


def test_stock_openrlhf_ppo():
    d = diagnose(FIX / "openrlhf_ppo.sh")
    # Flat flags: read with the flat-flag parser that knows most of them (OpenRLHF 0.9.0).
    assert d["defaults_version"] == "0.9.0" and d["algorithm"] == "gae"
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("k1", "reward", 0.01)
    assert t["value_clamp"] == (-10.0, 10.0)
    # rollout 1024 prompts × 1 sample / train batch 128 = 8 optimiser steps per rollout.
    assert d["updates_per_batch"] == 8
    assert d["equivalent"]["config"]["algo"]["name"] == "ppo"
    assert any("clamps the value" in x for x in d["equivalent"]["differences"])


def test_openrlhf_grouped_flags_k3_loss():
    d = diagnose(FIX / "openrlhf_grpo.sh")
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"], t["reduction"]) == (
        "low_var_kl",
        "loss",
        0.001,
        "token-mean",
    )
    assert d["group_size"] == 8 and d["updates_per_batch"] == 1
    algo = d["equivalent"]["config"]["algo"]
    assert {k: algo[k] for k in ("name", "epochs", "minibatches", "loss_reduction", "std")} == {
        "name": "grpo",
        "epochs": 1,
        "minibatches": 1,
        "loss_reduction": "token-mean",
        "std": "sample",
    }


def test_openrlhf_k1_in_the_loss_regularises_nothing(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text("python -m openrlhf.cli.train_ppo_ray --use_kl_loss --kl_estimator k1\n")
    d = diagnose(cfg)
    assert d["terms"][0]["on_policy"]["gradient"] == kl.GRAD_ZERO
    assert d["intended"]["config"]["kl"]["estimator"] == "k1+"


def test_openrlhf_missing_value_names_the_flag(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text("python -m openrlhf.cli.train_ppo_ray --init_kl_coef\n")
    with pytest.raises(DoctorError, match="--init_kl_coef needs a value"):
        read(cfg)


def test_klpo_config_reads_itself():
    d = diagnose(CONFIGS / "grpo.yaml")
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("full", "loss", 0.1)
    assert d["equivalent"]["config"]["kl"]["estimator"] == "full"
    assert validate(d["equivalent"]["config"]) is None


def test_named_version_other_than_known_warns():
    d = diagnose(FIX / "verl_grpo.yaml", version="0.7.0")
    assert "no table for verl 0.7.0" in d["findings"][0]["text"]
    assert "verl 0.9.1's settings, defaults and semantics" in d["findings"][0]["text"]
    assert not any(
        "0.9.1" in f["text"] for f in diagnose(FIX / "verl_grpo.yaml", version="0.9.1")["findings"]
    )


def test_interpolations_ask_for_the_resolved_config(tmp_path):
    cfg = tmp_path / "i.yaml"
    cfg.write_text(
        "actor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: ${data.train_batch_size}\n"
    )
    with pytest.raises(DoctorError, match=r"ppo_mini_batch_size = .*--cfg job --resolve"):
        read(cfg)


def test_unreadable_files_say_why(tmp_path):
    with pytest.raises(DoctorError, match="does not exist"):
        read(tmp_path / "nope.yaml")
    odd = tmp_path / "odd.yaml"
    odd.write_text("foo: 1\n")
    with pytest.raises(DoctorError, match="--framework"):
        read(odd)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(DoctorError, match="not a mapping"):
        read(lst, framework="verl")


# Clamp regions, against closed forms solved here in float64.


def _solve(f, lo, hi):
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(lo) > 0) == (f(mid) > 0):
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def test_clamp_regions_match_the_closed_forms():
    k3_minus_10 = lambda d: math.exp(-d) + d - 1 - 10  # noqa: E731
    lo = _solve(k3_minus_10, -5.0, 0.0)  # ≈ -2.611
    hi = _solve(k3_minus_10, 1.0, 20.0)  # ≈ 11.0
    [t] = diagnose(FIX / "verl_grpo.yaml")["terms"]
    zero = t["clamps"]["zero_gradient"]
    assert len(zero) == 2
    assert zero[0][0] == -30.0 and zero[0][1] == pytest.approx(lo, abs=2e-3)
    assert zero[1][0] == pytest.approx(hi, abs=2e-3) and zero[1][1] == 30.0
    # OpenRLHF's k2 in the loss: d²/2 > 10 for |d| > sqrt(20).
    from klpo.doctor.reading import Term

    k2 = Term("x", "k2", "k2", "loss", 1.0, "b", "token-mean", value_clamp=(-10.0, 10.0))
    z = clamp_regions(k2)["zero_gradient"]
    assert z[0][1] == pytest.approx(-math.sqrt(20), abs=2e-3)
    assert z[1][0] == pytest.approx(math.sqrt(20), abs=2e-3)
    # The straight-through k3+ keeps its gradient wherever its value is clamped.
    st = Term("x", "k3+", "k3+", "loss", 1.0, "b", "token-mean", (-10.0, 10.0), (-20.0, 20.0))
    c = clamp_regions(st)
    assert c["zero_gradient"] == [] and c["binds"]


@pytest.mark.parametrize(
    ("name", "framework"),
    [
        ("verl_grpo.yaml", None),
        ("verl_ppo_ignored.yaml", None),
        ("trl_grpo_kl.json", None),
        ("trl_rloo.yaml", "trl-rloo"),
        ("openrlhf_ppo.sh", None),
        ("openrlhf_grpo.sh", None),
    ],
)
def test_equivalent_config_read_back_gives_the_same_terms(name, framework, tmp_path):
    """The klpo config the doctor writes, read by the doctor, has the same estimator, placement,
    beta and update count as the framework config it came from."""
    import yaml

    d = diagnose(FIX / name, framework=framework)
    cfg = tmp_path / "klpo.yaml"
    cfg.write_text(yaml.safe_dump(d["equivalent"]["config"]))
    back = diagnose(cfg)
    assert back["framework"] == "klpo"
    key = lambda t: (t["estimator"], t["placement"], t["beta"])  # noqa: E731
    assert [key(t) for t in back["terms"]] == [key(t) for t in d["terms"]]
    assert back["updates_per_batch"] == d["updates_per_batch"]
