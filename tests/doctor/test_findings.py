"""What the doctor says about keys, values and files it cannot take as they are.

Each expectation is written from the framework's source: a key verl's composed config lacks is
refused by Hydra (struct mode), a field TRL's config lacks by its dataclass, a flag OpenRLHF's
parser lacks by argparse; OpenRLHF's ``group_norm`` divides by the group's std whatever
``no_std_norm`` says (``experience_maker.py``); its GAE lambda defaults to 1; TRL derives
``steps_per_generation`` from ``generation_batch_size``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo import kl
from klpo.cli import app
from klpo.doctor import DoctorError, diagnose, read

FIX = Path(__file__).parent / "fixtures"
runner = CliRunner()


def _errors(d):
    return [f for f in d["findings"] if f["level"] == "error"]


def _texts(d, level):
    return " ".join(f["text"] for f in d["findings"] if f["level"] == level)


def test_verl_typo_is_named_with_the_real_key(tmp_path):
    cfg = tmp_path / "v.yaml"
    cfg.write_text(
        "actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_coeff: 0.5\n"
        "algorithm:\n  adv_estimator: grpo\n  nonsense_key: 1\n"
    )
    d = diagnose(cfg)
    [typo, other] = sorted(_errors(d), key=lambda f: f["keys"])
    assert list(typo["keys"]) == ["actor_rollout_ref.actor.kl_loss_coeff"]
    assert "did you mean actor_rollout_ref.actor.kl_loss_coef?" in typo["text"]
    assert "verl refuses it" in typo["text"]
    assert list(other["keys"]) == ["algorithm.nonsense_key"]
    # The coefficient in effect is verl's default, not the typo's value.
    assert d["terms"][0]["beta"] == 0.001


def test_verl_plus_keys_are_noted_not_refused(tmp_path):
    cfg = tmp_path / "v.sh"
    cfg.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "+reward.reward_kwargs.max_resp_len=10 actor_rollout_ref.rollout.n=4\n"
    )
    d = diagnose(cfg)
    assert not _errors(d)
    assert "reward.reward_kwargs.max_resp_len" in _texts(d, "note")


def test_trl_typo_is_named(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("betta: 0.04\nnum_generations: 4\nmodel_name_or_path: Qwen/Qwen3-0.6B\n")
    d = diagnose(cfg, framework="trl-grpo")
    [err] = _errors(d)
    assert list(err["keys"]) == ["betta"] and "did you mean beta?" in err["text"]
    assert d["terms"] == []  # TRL's beta stays 0.0
    # model_name_or_path is a `trl grpo` CLI key, not a typo, and reaches the klpo config.
    assert d["equivalent"]["config"]["model"]["policy"] == "Qwen/Qwen3-0.6B"


def test_openrlhf_flat_flag_under_grouped_version(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text(
        "python3 -m openrlhf.cli.train_ppo_ray --algo.kl.use_loss --init_kl_coef 0.05 "
        "--algo.kl.estimator k2\n"
    )
    d = diagnose(cfg, version="0.11.2")
    [err] = _errors(d)
    assert list(err["keys"]) == ["--init_kl_coef"]
    assert "spells it --algo.kl.init_coef" in err["text"]
    assert d["terms"][0]["beta"] == 0.01  # the grouped default: the flat flag never arrives


def test_openrlhf_abbreviation_is_argparses(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text("python3 -m openrlhf.cli.train_ppo_ray --init_kl 0.2 --kl_estim k3\n")
    d = diagnose(cfg, version="0.9.10")
    assert not _errors(d)
    [t] = d["terms"]
    assert (t["estimator"], t["beta"]) == ("low_var_kl", 0.2)


def test_openrlhf_group_norm_keeps_the_std_under_no_std_norm(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text(
        "python3 -m openrlhf.cli.train_ppo_ray --algo.advantage.estimator group_norm "
        "--algo.advantage.no_std_norm --rollout.n_samples_per_prompt 4\n"
    )
    d = diagnose(cfg)
    assert d["equivalent"]["config"]["algo"]["std"] == "sample"
    assert "still divides each group's scores by their std" in _texts(d, "note")


def test_openrlhf_gae_lambda_is_the_parsers(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text("python3 -m openrlhf.cli.train_ppo_ray --algo.advantage.estimator gae\n")
    d = diagnose(cfg)
    assert d["equivalent"]["config"]["algo"]["lam"] == 1.0
    assert d["settings"]["algo.advantage.lambd"] == {"value": 1, "from": "default"}


def test_openrlhf_unbiased_gradient_is_the_straight_through_estimator(tmp_path):
    cfg = tmp_path / "o.sh"
    cfg.write_text(
        "python3 -m openrlhf.cli.train_ppo_ray --algo.kl.use_loss --algo.kl.estimator k3 "
        "--algo.kl.unbiased_gradient --train.max_epochs 2\n"
    )
    d = diagnose(cfg, version="0.11.2")
    [t] = d["terms"]
    assert (t["estimator"], t["corrected"]) == ("k3+", True)
    assert t["on_policy"]["gradient"] == kl.GRAD_THETA_REF
    assert "off_policy_correction" not in d["equivalent"]["config"]["kl"]
    # 0.11.0 has no such flag: refused, and the plain k3 is read.
    d = diagnose(cfg, version="0.11.0")
    assert [list(f["keys"]) for f in _errors(d)] == [["--algo.kl.unbiased_gradient"]]
    assert d["terms"][0]["estimator"] == "low_var_kl"


def test_trl_generation_batch_size_sets_the_steps(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "beta: 0.04\nuse_bias_correction_kl: false\nper_device_train_batch_size: 8\n"
        "gradient_accumulation_steps: 2\ngeneration_batch_size: 64\n"
    )
    d = diagnose(cfg)
    # 64 / 8 = 8 micro-steps per generation, an optimiser step every 2: 4 steps per generation.
    assert d["updates_per_batch"] == 4 and d["off_policy"]
    assert "1 process" in _texts(d, "note")
    assert "not weighted for that" in _texts(d, "warning") or "older policy" in _texts(d, "warning")
    assert d["equivalent"]["config"]["kl"]["off_policy_correction"] is False


def test_trl_dr_grpo_carries_the_completion_length(tmp_path):
    cfg = tmp_path / "g.yaml"
    cfg.write_text("beta: 0.04\nloss_type: dr_grpo\n")
    d = diagnose(cfg)
    eq = d["equivalent"]["config"]
    # TRL divides by max_completion_length (512 in 1.16); klpo by rollout.max_new_tokens.
    assert eq["algo"]["loss_reduction"] == "seq-mean-token-sum-norm"
    assert eq["rollout"]["max_new_tokens"] == 512


def test_unreadable_setting_is_a_finding(tmp_path):
    cfg = tmp_path / "v.sh"
    cfg.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.rollout.n=$N actor_rollout_ref.actor.use_kl_loss=True\n"
    )
    d = diagnose(cfg)
    warn = _texts(d, "warning")
    assert "actor_rollout_ref.rollout.n = '${N}' depends on $N" in warn
    assert "took the default 1" in warn
    assert d["settings"]["actor_rollout_ref.rollout.n"]["from"].startswith("default (")
    assert diagnose(cfg, variables={"N": "6"})["group_size"] == 6


def test_klpo_names_in_verl_are_read(tmp_path):
    cfg = tmp_path / "v.yaml"
    cfg.write_text(
        "algorithm:\n  use_kl_in_reward: true\n  kl_penalty: klpo:k1\n"
        "actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_type: klpo:k3_is\n"
    )
    d = diagnose(cfg)
    assert [(t["estimator"], t["placement"], t["corrected"]) for t in d["terms"]] == [
        ("k3_is", "loss", True),
        ("k1", "reward", False),
    ]
    with pytest.raises(DoctorError, match=r"allowed: .*klpo:k3\+"):
        cfg.write_text(
            "actor_rollout_ref:\n  actor:\n    use_kl_loss: true\n    kl_loss_type: klpo:full\n"
        )
        read(cfg)


def test_binary_and_undecodable_files_are_named(tmp_path):
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x00\x01\x02\xea\x00")
    result = runner.invoke(app, ["doctor", str(binary), "--framework", "verl"])
    assert result.exit_code == 2
    assert f"{binary}: a binary file" in result.output
    latin = tmp_path / "run.sh"
    latin.write_bytes("python3 -m verl.trainer.main_ppo data.x=caf\xe9\n".encode("latin-1"))
    result = runner.invoke(app, ["doctor", str(latin)])
    assert result.exit_code == 2
    assert f"{latin}: not UTF-8 text (byte 0xe9" in result.output
    result = runner.invoke(app, ["doctor", str(tmp_path)])
    assert result.exit_code == 2 and "a directory, not a config file" in result.output


def test_var_option_needs_name_equals_value():
    result = runner.invoke(app, ["doctor", str(FIX / "verl_grpo.sh"), "--var", "oops"])
    assert result.exit_code == 2 and "write it as NAME=VALUE" in result.output


def test_mismatched_tokenizers_are_refused(tmp_path):
    """The trainer's check on the doctor's pair: same vocabulary size, two ids swapped."""
    from klpo.train.models.load import default_reference_path

    ref = Path(default_reference_path())
    other = tmp_path / "swapped"
    shutil.copytree(ref, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    data = tmp_path / "p.txt"
    data.write_text("1+2=\n")
    result = runner.invoke(
        app,
        ["doctor", str(FIX / "verl_grpo.yaml"), "--model", str(ref), "--reference", str(other),
         "--data", str(data)],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "--reference" in result.output and "another tokenizer than --model" in result.output


def test_verl_clip_ratio_overridden_by_its_one_sided_defaults_is_named(tmp_path):
    """verl's actor takes clip_ratio_low / clip_ratio_high first and clip_ratio only where one
    is null (dp_actor.py); 0.9.1's defaults for both are 0.2, so clip_ratio=0.28 alone does
    nothing: a warning naming both, and the equivalent carries the range in effect."""
    script = "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo {}\n"
    cfg = tmp_path / "v.sh"
    cfg.write_text(script.format("actor_rollout_ref.actor.clip_ratio=0.28"))
    d = diagnose(cfg)
    [w] = [f for f in d["findings"] if "actor_rollout_ref.actor.clip_ratio" in f["keys"]]
    assert w["level"] == "warning" and "does nothing" in w["text"]
    assert "clip_ratio_low=0.2 and clip_ratio_high=0.2" in w["text"]
    assert d["equivalent"]["config"]["algo"]["clip_low"] == 0.2
    assert "actor_rollout_ref.actor.clip_ratio" not in " ".join(d["equivalent"]["unmapped"])
    # With the one-sided ratios null, clip_ratio applies to both sides: no warning, carried.
    nulled = (
        "actor_rollout_ref.actor.clip_ratio_low=null actor_rollout_ref.actor.clip_ratio_high=null"
    )
    cfg.write_text(script.format(f"actor_rollout_ref.actor.clip_ratio=0.28 {nulled}"))
    d = diagnose(cfg)
    assert not [f for f in d["findings"] if "actor_rollout_ref.actor.clip_ratio" in f["keys"]]
    algo = d["equivalent"]["config"]["algo"]
    assert (algo["clip_low"], algo["clip_high"]) == (0.28, 0.28)


def test_verl_mini_batch_larger_than_the_batch_is_refused(tmp_path):
    """main_ppo's validate_config: ActorConfig.validate raises where data.train_batch_size <
    ppo_mini_batch_size (verl/workers/config/actor.py), unless use_dynamic_bsz."""
    cfg = tmp_path / "v.yaml"
    cfg.write_text("data:\n  train_batch_size: 64\nalgorithm:\n  adv_estimator: grpo\n")
    [err] = _errors(diagnose(cfg))
    assert "64 < actor_rollout_ref.actor.ppo_mini_batch_size 256" in err["text"]
    assert "does not start" in err["text"]
    cfg.write_text(
        "data:\n  train_batch_size: 64\nalgorithm:\n  adv_estimator: grpo\n"
        "actor_rollout_ref:\n  actor:\n    use_dynamic_bsz: true\n"
    )
    assert _errors(diagnose(cfg)) == []
    cfg.write_text("data:\n  train_batch_size: 256\nalgorithm:\n  adv_estimator: grpo\n")
    assert _errors(diagnose(cfg)) == []
