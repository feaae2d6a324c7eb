"""What a framework refuses, ignores or cancels, and what a config builds: one test per finding
class (klpo.doctor.reading.FINDING_KINDS), each against the framework's source at the pinned
commit (the lines cited in the finding are asserted, so a drift in them shows).

1. A file of a framework the doctor has no reader for is a named unknown, never another
   framework's reading (LLaMA-Factory's own DPO/KTO examples share TRL's TrainingArguments
   keys: the doctor before read them as TRL GRPOConfigs).
2. Key policy: unknown keys refused (strict: SkyRL's dataclasses; Hydra struct: verl) or
   silently accepted (lenient: NeMo-RL's extra="allow", ROLL's dacite), each with the nearest
   real key; keys valid but read by nobody (AReaL's ref.kl_ctl).
3. Combinations the framework asserts against (slime's two KL coefficients, NeMo-RL's skipped
   reference) and combinations that cancel a KL term (NeMo-RL GRPO with use_kl_in_reward).
4. Structure from the config: AReaL's critic section means PPO with GAE, NeMo-RL's PPO
   asynchrony, a group-mean baseline over groups of one (prime-rl's default group size).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.doctor import DoctorError, UnknownFramework, detect, diagnose
from klpo.doctor.reading import FINDING_KINDS, command_flags

FIELD = Path(__file__).parent / "fixtures" / "field"
NEMO = FIELD / "nemo_rl"


def _kind(d: dict, kind: str) -> list[dict]:
    return [f for f in d["findings"] if f["kind"] == kind]


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# -- 1. a framework the doctor has no reader for -----------------------------------------------


@pytest.mark.parametrize(
    "name", ["llamafactory_qwen3_lora_dpo.yaml", "llamafactory_qwen3_lora_kto.yaml"]
)
def test_another_frameworks_config_is_a_named_unknown_not_trl(name):
    # 17 of the DPO file's 31 keys are TrainingArguments fields (output_dir, learning_rate, ...):
    # below the three in four a TRL config has, and no section of any framework.
    p = FIELD / "other" / name
    with pytest.raises(UnknownFramework) as err:
        diagnose(p)
    text = str(err.value)
    assert "not a config of any framework this doctor reads" in text
    assert "stage, do_train, finetuning_type" in text  # what it looked like
    with pytest.raises(UnknownFramework):
        detect(p)


def test_a_trl_config_with_a_typo_is_still_trl(tmp_path):
    # Positive evidence is most keys, not all: one misspelt field of seven stays a TRL reading
    # with its error, not an unknown.
    p = _write(
        tmp_path,
        "grpo.yaml",
        "beta: 0.04\nnum_generations: 8\nlearning_rate: 1.0e-6\nloss_type: dapo\n"
        "per_device_train_batch_size: 8\noutput_dir: out\nnum_iteration: 2\n",
    )
    d = diagnose(p)
    assert d["framework"] == "trl-grpo"
    [f] = _kind(d, "unknown-key")
    assert f["level"] == "error" and "did you mean num_iterations" in f["text"]


def test_a_script_without_a_known_training_command_is_a_named_unknown(tmp_path):
    p = _write(tmp_path, "run.sh", "python train_mine.py --beta 0.1 --lr 1e-6\n")
    with pytest.raises(UnknownFramework, match=r"the last one starting `python train_mine.py"):
        diagnose(p)


# -- 2. key policies ------------------------------------------------------------------------


SKYRL = (
    "uv run --isolated -m skyrl.train.entrypoints.main_base trainer.algorithm.advantage_estimator=grpo "
    "trainer.train_batch_size=64 trainer.policy_mini_batch_size=64 "
)


def test_strict_skyrl_refuses_a_misspelt_switch_and_the_default_kl_stays(tmp_path):
    # The user meant to turn the KL loss off; SkyRL's validate_dict_keys_against_dataclass
    # (config.py:1564-1573) refuses the key, so the run does not start at all.
    d = diagnose(_write(tmp_path, "s.sh", SKYRL + "trainer.algorithm.use_kl_los=false\n"))
    [f] = _kind(d, "unknown-key")
    assert f["level"] == "error"
    assert "did you mean trainer.algorithm.use_kl_loss" in f["text"]
    assert "does not start" in f["text"] and "config.py:1564-1573" in f["text"]
    # What the doctor reads is SkyRL's default: the KL loss on, k3, 0.001 (config.py:828-836).
    assert [(t["estimator"], t["placement"], t["beta"]) for t in d["terms"]] == [
        ("low_var_kl", "loss", 0.001)
    ]


def test_lenient_nemo_rl_accepts_a_misspelt_coefficient_and_the_doctor_names_it(tmp_path):
    # ClippedPGLossConfig takes extra="allow" (loss_functions.py:111): the typo is kept and read
    # by nobody, so the default 0.01 (loss_functions.py:128) stays in force.
    text = (
        (NEMO / "grpo_math_1B.yaml")
        .read_text()
        .replace("reference_policy_kl_penalty:", "reference_policy_kl_penalt: 0.0\n  _unused_:")
    )
    d = diagnose(_write(tmp_path, "grpo.yaml", text))
    [f] = [x for x in _kind(d, "unknown-key") if "penalt" in x["keys"][0]]
    assert f["level"] == "warning"
    assert "did you mean loss_fn.reference_policy_kl_penalty" in f["text"]
    assert "accepts it without a word" in f["text"] and "keeps the value 0.01" in f["text"]
    assert [t["beta"] for t in d["terms"]] == [0.01]


def test_hydra_struct_verl_refuses_a_key_it_does_not_have(tmp_path):
    p = _write(
        tmp_path,
        "run.sh",
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.kl_loss_coeff=0.01\n",
    )
    [f] = _kind(diagnose(p), "unknown-key")
    assert f["level"] == "error" and "Hydra: key not in struct" in f["text"]
    assert "did you mean actor_rollout_ref.actor.kl_loss_coef" in f["text"]


def test_roll_drops_an_unknown_key_without_a_word_in_its_own_example():
    # ROLL's off-policy example sets pg_variant: topr; RLVRConfig has no such field and
    # dacite.from_dict (default Config, strict=False) drops it: the example runs plain PPO.
    d = diagnose(FIELD / "roll" / "qwen2.5-7B-rlvr-offpolicy" / "rlvr_config.yaml")
    [f] = [x for x in _kind(d, "unknown-key") if x["keys"][0] == "pg_variant"]
    assert "accepts it without a word and nothing reads it" in f["text"]
    assert f["level"] == "note"  # nothing the doctor reads is near it


def test_a_valid_key_read_by_nobody_areal_ref_kl_ctl(tmp_path):
    # ref is a PPOActorConfig (cli_args.py:3411), so ref.kl_ctl is valid, but the reward KL
    # reads the actor's (actor.py:76): the file's 0.05 does nothing, the actor's 0.0 holds.
    text = (FIELD / "areal" / "gsm8k_grpo.yaml").read_text()
    text = text.replace("ref:\n", "ref:\n  kl_ctl: 0.05\n", 1)
    d = diagnose(_write(tmp_path, "areal.yaml", text))
    [f] = _kind(d, "unread-key")
    assert tuple(f["keys"]) == ("ref.kl_ctl", "actor.kl_ctl") and "0.05" in f["text"]
    assert d["terms"] == []


# -- 3. refused and cancelled combinations -------------------------------------------------


SLIME = "python3 train.py --rollout-batch-size 32 --n-samples-per-prompt 8 "


def test_slime_refuses_both_kl_coefficients(tmp_path):
    d = diagnose(
        _write(tmp_path, "s.sh", SLIME + "--use-kl-loss --kl-loss-coef 0.01 --kl-coef 0.02\n")
    )
    [f] = _kind(d, "refused")
    assert f["level"] == "error" and "slime/utils/arguments.py:1846" in f["text"]
    assert "does not start" in f["text"]
    assert d["terms"] == []  # a run that does not start has no KL in effect


def test_nemo_rl_ppo_skips_the_reference_by_default_and_refuses_a_kl(tmp_path):
    # PPOConfig.skip_reference_policy_logprobs_calculation defaults to True (ppo.py:181) and
    # ppo.py:1241-1242 asserts the coefficient is 0 then.
    text = (NEMO / "ppo_math_1B.yaml").read_text()
    text = text.replace("skip_reference_policy_logprobs_calculation: true", "# (the default)")
    text = text.replace("reference_policy_kl_penalty: 0.0", "reference_policy_kl_penalty: 0.01")
    d = diagnose(_write(tmp_path, "ppo.yaml", text))
    [f] = _kind(d, "refused")
    assert "ppo.py:1241-1242" in f["text"] and "PPO's default" in f["text"]
    assert d["terms"] == []


def test_nemo_rl_grpo_with_the_kl_in_the_reward_has_no_kl_at_all(tmp_path):
    # loss_functions.py:240-242 zeroes the loss's coefficient; GRPOAdvantageEstimator never
    # reads the reward KL (advantage_estimator.py:57-98).
    text = (NEMO / "grpo_math_1B.yaml").read_text()
    assert "use_kl_in_reward: false" in text
    d = diagnose(
        _write(
            tmp_path, "g.yaml", text.replace("use_kl_in_reward: false", "use_kl_in_reward: true")
        )
    )
    assert d["terms"] == []
    [f] = _kind(d, "cancelled")
    assert "no KL at all" in f["text"] and "loss_functions.py:240-242" in f["text"]
    # reinforce_plus_plus reads it: a reward term, per token after the baseline.
    rpp = text.replace("use_kl_in_reward: false", "use_kl_in_reward: true").replace(
        'adv_estimator:\n    name: "grpo"', 'adv_estimator:\n    name: "reinforce_plus_plus"'
    )
    e = diagnose(_write(tmp_path, "r.yaml", rpp))
    assert [(t["estimator"], t["placement"], t["beta"]) for t in e["terms"]] == [
        ("low_var_kl", "reward", 0.01)
    ]


def test_skyrl_asserts_its_two_kl_switches_apart(tmp_path):
    d = diagnose(_write(tmp_path, "s.sh", SKYRL + "trainer.algorithm.use_kl_in_reward=true\n"))
    [f] = _kind(d, "refused")
    assert "skyrl/train/utils/utils.py:312-314" in f["text"] and "true by default" in f["text"]
    assert d["terms"] == []


# -- 4. structure from the config -----------------------------------------------------------


def test_areal_critic_section_is_ppo_with_gae_and_the_equivalent_keeps_the_critic():
    # AReaL's own PPO example: a critic: section (rl_trainer.py:198-203), GAE on its values.
    d = diagnose(FIELD / "areal" / "gsm8k_ppo.yaml")
    assert d["algorithm"] == "ppo"
    assert [tuple(f["keys"]) for f in _kind(d, "structure")] == [("critic",)]
    eq = d["equivalent"]["config"]
    assert eq["algo"]["name"] == "ppo" and eq["model"]["critic"] == "Qwen/Qwen2.5-1.5B-Instruct"
    assert d["equivalent"]["invalid"] is None
    # The GRPO example, with no critic, stays GRPO (group-normalised rewards).
    assert diagnose(FIELD / "areal" / "gsm8k_grpo.yaml")["algorithm"] == "grpo"


def test_nemo_rl_async_ppo_is_asynchronous(tmp_path):
    text = (NEMO / "ppo_math_1B.yaml").read_text()
    assert diagnose(NEMO / "ppo_math_1B.yaml")["asynchronous"] is False
    on = text.replace("async_ppo:\n    enabled: false", "async_ppo:\n    enabled: true")
    assert on != text
    d = diagnose(_write(tmp_path, "ppo.yaml", on))
    assert d["asynchronous"] is True and d["off_policy"] is True
    assert any("ppo.async_ppo.enabled" in f["keys"] for f in _kind(d, "structure"))


def test_prime_rl_default_group_of_one_makes_every_advantage_zero(tmp_path):
    # orchestrator.group_size defaults to 1 (orchestrator.py:517) and GRPO's advantage is the
    # reward minus its group's mean (orchestrator/algo/grpo.py:29-30).
    text = (FIELD / "prime_rl" / "wordle_rl.toml").read_text()
    lines = [ln for ln in text.splitlines() if not ln.strip().startswith("group_size")]
    d = diagnose(_write(tmp_path, "rl.toml", "\n".join(lines) + "\n"))
    assert d["group_size"] == 1
    [f] = _kind(d, "zero-advantage")
    assert "every advantage is zero" in f["text"] and "default 1" in f["text"]
    assert not _kind(diagnose(FIELD / "prime_rl" / "wordle_rl.toml"), "zero-advantage")


def test_every_finding_kind_is_documented_and_refused_if_unknown():
    from klpo.doctor.reading import Reading

    assert set(FINDING_KINDS) == {
        "unknown-key", "unread-key", "refused", "cancelled", "structure", "zero-advantage"
    }  # fmt: skip
    r = Reading("x", "1", None, "f")
    with pytest.raises(ValueError, match="unknown finding kind"):
        r.warn("note", [], "t", kind="made-up")


def test_a_script_only_framework_refuses_a_mapping_by_name(tmp_path):
    with pytest.raises(DoctorError, match="slime is read from its script"):
        diagnose(_write(tmp_path, "x.yaml", "kl-coef: 0.1\n"), framework="slime")


def test_command_flags_read_argparse_style():
    # --a=1: the value glued on; --b 2: the next word; --s: a switch takes none even before a
    # value-like word (3, then a positional, passed over); --c: followed by a flag, so none;
    # --s=no: a switch written with a value keeps it; --last: nothing after it, so none.
    words = ["pos", "--a=1", "--b", "2", "--s", "3", "--c", "--s=no", "--last"]
    assert list(command_flags(words, {"s"})) == [
        ("a", "1"),
        ("b", "2"),
        ("s", None),
        ("c", None),
        ("s", "no"),
        ("last", None),
    ]
    # Without the switch, --s takes the word after it.
    assert ("s", "3") in list(command_flags(words))
