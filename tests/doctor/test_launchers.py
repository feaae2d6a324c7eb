"""The doctor on launch commands where the frameworks' own examples put them, one test per class
of misreading: wrapped commands, entry points, detection, duplicate keys, ``case``, the settings
that do nothing, and the klpo config that must carry every setting klpo has a key for.

Expected readings are written from the frameworks' source (as in test_examples.py): OpenRLHF's
``--init_kl_coef`` / ``--kl_estimator`` / ``--use_kl_loss`` (``cli/train_ppo_ray.py``), its
``compute_approx_kl`` and the whitening in ``experience_maker.py`` (gae, reinforce and
reinforce_baseline only); verl's ``main_ppo`` overrides; TRL's ``GRPOConfig.__post_init__``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from klpo.doctor import DoctorError, detect, diagnose
from klpo.doctor.advice import klpo_keys

FIX = Path(__file__).parent / "fixtures"
EX = FIX / "examples"

OPENRLHF_FLAGS = (
    "--pretrain Qwen/Qwen2.5-7B --init_kl_coef 0.05 --use_kl_loss --kl_estimator k3 "
    "--n_samples_per_prompt 4 --rollout_batch_size 128 --train_batch_size 512 "
    "--advantage_estimator group_norm --generate_max_len 2048 --prompt_max_len 512"
)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def _reading(d):
    return (
        d["framework"],
        [(t["estimator"], t["placement"], t["beta"]) for t in d["terms"]],
        d["group_size"],
        d["updates_per_batch"],
    )


def _flat(config, prefix=""):
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _texts(d, level=None):
    return [f["text"] for f in d["findings"] if level is None or f["level"] == level]


# -- the launch command inside launchers -------------------------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [
        # OpenRLHF's slurm example: srun … bash -c "ray job submit … -- python3 -m …"
        'srun -N 2 --gres=gpu:8 bash -c "ray job submit --address=http://127.0.0.1:8265 '
        '-- python3 -m openrlhf.cli.train_ppo_ray {flags}"',
        "bash -lc 'python3 -m openrlhf.cli.train_ppo_ray {flags}'",
        'ray job submit --runtime-env-json=\'{{"working_dir": "/x"}}\' -- python3 -m '
        "openrlhf.cli.train_ppo_ray {flags}",
        "deepspeed --num_gpus 8 --module openrlhf.cli.train_ppo_ray {flags}",
    ],
)
def test_wrapped_command_reads_as_the_bare_one(tmp_path, wrap):
    bare = diagnose(
        _write(tmp_path, "bare.sh", f"python3 -m openrlhf.cli.train_ppo_ray {OPENRLHF_FLAGS}\n")
    )
    wrapped = diagnose(_write(tmp_path, "w.sh", wrap.format(flags=OPENRLHF_FLAGS) + "\n"))
    # --use_kl_loss, k3 (clamped: low_var_kl), 0.05; groups of 4; 128 × 4 / 512 = 1 step.
    assert _reading(wrapped) == ("openrlhf", [("low_var_kl", "loss", 0.05)], 4, 1)
    assert _reading(wrapped) == _reading(bare)
    assert wrapped["equivalent"]["config"] == bare["equivalent"]["config"]


def test_bash_c_string_sees_the_outer_variables(tmp_path):
    text = (
        "KL=0.02\n"
        'srun bash -c "python3 -m openrlhf.cli.train_ppo_ray --init_kl_coef $KL '
        '--n_samples_per_prompt 2"\n'
    )
    d = diagnose(_write(tmp_path, "v.sh", text))
    assert [t["beta"] for t in d["terms"]] == [0.02]
    assert any("bash -c" in t for t in _texts(d, "note"))


def test_torchrun_and_accelerate_wrappers_around_verl(tmp_path):
    for launcher in ("torchrun --nproc_per_node 8 -m", "accelerate launch -m", "uv run python -m"):
        d = diagnose(
            _write(
                tmp_path,
                "t.sh",
                f"{launcher} verl.trainer.main_ppo algorithm.adv_estimator=grpo "
                "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.rollout.n=6 "
                "actor_rollout_ref.actor.kl_loss_coef=0.01\n",
            )
        )
        assert _reading(d) == ("verl", [("low_var_kl", "loss", 0.01)], 6, 4), launcher


def test_skypilot_task_reads_its_run_script_with_its_envs(tmp_path):
    task = {
        "resources": {"accelerators": "H100:8"},
        "envs": {"KL_COEF": 0.003, "N": 8},
        "setup": "pip install verl",
        "run": "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo \\\n"
        "  actor_rollout_ref.actor.use_kl_loss=true \\\n"
        "  actor_rollout_ref.actor.kl_loss_coef=$KL_COEF actor_rollout_ref.rollout.n=$N\n",
    }
    p = _write(tmp_path, "task.yaml", yaml.safe_dump(task))
    assert detect(p) == "verl"
    d = diagnose(p)
    assert _reading(d) == ("verl", [("low_var_kl", "loss", 0.003)], 8, 4)
    assert "run:" in d["source"]


# -- entry points ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module", ["recipe.prime.main_prime", "recipe.dapo.main_dapo", "recipe.entropy.main_entropy"]
)
def test_recipe_entry_point_is_a_named_refusal(tmp_path, module):
    p = _write(
        tmp_path,
        "r.sh",
        f"python3 -m {module} algorithm.use_kl_in_reward=true algorithm.kl_penalty=kl\n",
    )
    with pytest.raises(DoctorError, match=rf"{module}.*recipe.*not apply them"):
        diagnose(p)
    with pytest.raises(DoctorError, match="recipe"):
        diagnose(p, framework="verl")  # naming the framework does not make it main_ppo


def test_other_openrlhf_entry_point_is_refused(tmp_path):
    p = _write(tmp_path, "dpo.sh", "deepspeed --module openrlhf.cli.train_dpo --beta 0.1\n")
    with pytest.raises(DoctorError, match=r"train_dpo.*not OpenRLHF's PPO trainer"):
        diagnose(p)


def test_framework_is_the_commands_not_the_comments_or_heredocs(tmp_path):
    text = (
        "# tried before: python3 -m openrlhf.cli.train_ppo_ray --init_kl_coef 0.1 --algo.kl.x\n"
        "cat > notes.txt <<EOF\n"
        "--init_kl_coef 0.2 --use_kl_loss openrlhf.cli.train_ppo_ray\n"
        "EOF\n"
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.use_kl_loss=true actor_rollout_ref.rollout.n=4\n"
    )
    p = _write(tmp_path, "v.sh", text)
    assert detect(p) == "verl"
    assert _reading(diagnose(p)) == ("verl", [("low_var_kl", "loss", 0.001)], 4, 4)


def test_no_training_command_is_refused_by_name(tmp_path):
    p = _write(tmp_path, "x.sh", "# --init_kl_coef 0.1 in a comment only\necho hi\n")
    with pytest.raises(DoctorError, match="no training command"):
        detect(p)


# -- duplicate keys ----------------------------------------------------------------------------


def test_duplicate_key_in_verl_yaml_is_refused_with_its_lines(tmp_path):
    p = _write(
        tmp_path,
        "v.yaml",
        "algorithm:\n  adv_estimator: grpo\n  use_kl_in_reward: true\n  use_kl_in_reward: false\n",
    )
    with pytest.raises(DoctorError, match=r"algorithm.use_kl_in_reward is given twice.*3 and 4"):
        diagnose(p)


def test_duplicate_key_in_trl_yaml_is_the_last_value_and_a_warning(tmp_path):
    p = _write(tmp_path, "t.yaml", "beta: 0.04\nnum_generations: 8\nbeta: 0.0\n")
    d = diagnose(p)
    assert d["terms"] == []  # PyYAML keeps the last: beta 0
    assert any("beta is given twice (lines 1 and 3)" in t for t in _texts(d, "warning"))


# -- case like if ------------------------------------------------------------------------------


def test_case_on_an_undefined_name_reads_its_first_branch_like_if(tmp_path):
    body = (
        "{open}\n"
        "  {a} N=4 ;;\n"
        "  {b} N=16 ;;\n"
        "{close}\n"
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.rollout.n=$N\n"
    )
    case = body.format(open="case $SIZE in", a="small)", b="big)", close="esac")
    if_ = (
        'if [ "$SIZE" = small ]; then\n  N=4\nelse\n  N=16\nfi\n'
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.rollout.n=$N\n"
    )
    d_case = diagnose(_write(tmp_path, "c.sh", case))
    d_if = diagnose(_write(tmp_path, "i.sh", if_))
    assert d_case["group_size"] == d_if["group_size"] == 4
    assert any("case ${SIZE}" in t and "first branch" in t for t in _texts(d_case, "note"))
    # Given a value, the matching branch is taken.
    d_big = diagnose(_write(tmp_path, "c.sh", case), variables={"SIZE": "big"})
    assert d_big["group_size"] == 16


# -- settings that do nothing, whitening, asynchronous -----------------------------------------


def test_unbiased_gradient_without_the_kl_loss_does_nothing(tmp_path):
    p = _write(
        tmp_path,
        "o.sh",
        "python3 -m openrlhf.cli.train_ppo_ray --algo.kl.init_coef 0.01 "
        "--algo.kl.unbiased_gradient --algo.kl.estimator k1\n",
    )
    d = diagnose(p, version="0.11.2")
    # k1 stays in the reward (no --algo.kl.use_loss): the flag changes nothing.
    assert [(t["estimator"], t["placement"]) for t in d["terms"]] == [("k1", "reward")]
    assert any("does nothing" in t for t in _texts(d, "warning"))


def test_trl_dr_grpo_with_beta_and_the_default_length_is_named(tmp_path):
    p = _write(tmp_path, "t.yaml", "loss_type: dr_grpo\nbeta: 0.04\nnum_generations: 8\n")
    d = diagnose(p)
    assert any("beta·L/512" in t for t in _texts(d, "warning"))
    q = _write(tmp_path, "u.yaml", "loss_type: dr_grpo\nbeta: 0.04\nmax_completion_length: 256\n")
    assert not any("beta·L/" in t for t in _texts(diagnose(q)))


@pytest.mark.parametrize("adv", ["group_norm", "dr_grpo"])
def test_group_estimators_are_not_said_to_be_whitened(tmp_path, adv):
    p = _write(
        tmp_path,
        "o.sh",
        f"python3 -m openrlhf.cli.train_ppo_ray --advantage_estimator {adv} "
        "--n_samples_per_prompt 8 --init_kl_coef 0.01\n",
    )
    d = diagnose(p, version="0.9.10")
    assert not any("whiten" in x for x in d["equivalent"]["differences"])
    q = _write(
        tmp_path,
        "r.sh",
        "python3 -m openrlhf.cli.train_ppo_ray --advantage_estimator reinforce_baseline "
        "--n_samples_per_prompt 8 --init_kl_coef 0.01\n",
    )
    assert any("whitens" in x for x in diagnose(q, version="0.9.10")["equivalent"]["differences"])


def test_asynchronous_openrlhf_is_off_policy(tmp_path):
    p = _write(
        tmp_path,
        "a.sh",
        "python3 -m openrlhf.cli.train_ppo_ray --async_train --init_kl_coef 0.01 "
        "--use_kl_loss --kl_estimator k2 --rollout_batch_size 128 --train_batch_size 128\n",
    )
    d = diagnose(p, version="0.9.10")
    assert d["updates_per_batch"] == 1 and d["asynchronous"] and d["off_policy"]
    assert d["terms"][0]["off_policy"] is not None


# -- the equivalent config carries what klpo has a key for -------------------------------------


def test_openrlhf_completion_length_from_the_flat_flag_and_the_default(tmp_path):
    p = _write(tmp_path, "o.sh", f"python3 -m openrlhf.cli.train_ppo_ray {OPENRLHF_FLAGS}\n")
    flat = _flat(diagnose(p, version="0.9.0")["equivalent"]["config"])
    assert (flat["rollout.max_new_tokens"], flat["data.max_prompt_tokens"]) == (2048, 512)
    # 0.9.10+: --max_new_tokens unset means max_len (2048) minus the prompt.
    q = _write(tmp_path, "q.sh", "python3 -m openrlhf.cli.train_ppo_ray --init_kl_coef 0.01\n")
    d = diagnose(q, version="0.11.2")
    assert _flat(d["equivalent"]["config"])["rollout.max_new_tokens"] == 2048
    assert any("minus each prompt" in x for x in d["equivalent"]["differences"])


def test_openrlhf_loss_aggregation_is_carried(tmp_path):
    p = _write(
        tmp_path,
        "o.sh",
        "python3 -m openrlhf.cli.train_ppo_ray --algo.kl.init_coef 0.01 "
        "--actor.loss_agg_mode seq-mean-token-mean\n",
    )
    flat = _flat(diagnose(p, version="0.11.2")["equivalent"]["config"])
    assert flat["algo.loss_reduction"] == "seq-mean-token-mean"


def _all_fixtures():
    return sorted(
        p
        for p in [
            *FIX.glob("*"),
            *EX.glob("*"),
            *FIX.glob("field/**/*"),
            *FIX.glob("evidence/**/*"),
        ]
        if p.is_file()
        and p.suffix in (".sh", ".yaml", ".json", ".toml", ".py")
        and "ignored" not in p.name
        and "dapo_gsm8k" not in p.name  # a named refusal (test_field.py)
        and p.parent.name != "other"  # another framework's files: named unknowns (test_rules.py)
    )


@pytest.mark.parametrize("path", _all_fixtures(), ids=lambda p: p.name)
def test_equivalent_carries_every_setting_klpo_has_a_key_for(path):
    """Walk the readings: a setting the file gives, which the reader maps to a klpo key, is in
    the equivalent config with the file's value (or a difference says why not)."""
    from klpo.doctor.frameworks import (
        areal,
        nemo_rl,
        openrlhf,
        prime_rl,
        roll,
        skyrl,
        slime,
        trl,
        verl,
    )

    d = diagnose(path)
    carried = {
        "verl": verl.CARRIED,
        "openrlhf": openrlhf.CARRIED,
        "nemo-rl": nemo_rl.CARRIED
        + [(k.replace("grpo.", "ppo.", 1), v) for k, v in nemo_rl.CARRIED],
        "slime": slime.CARRIED,
        "skyrl": skyrl.CARRIED,
        "prime-rl": prime_rl.CARRIED,
        "areal": areal.CARRIED,
        "roll": roll.CARRIED,
    }.get(d["framework"], trl.CARRIED)
    flat = _flat(d["equivalent"]["config"])
    keys = klpo_keys()
    for fw_key, klpo_key in carried:
        got = d["settings"].get(fw_key)
        if got is None or got["from"] != "file" or klpo_key not in keys:
            continue
        if klpo_key.startswith("model.lora.") and "model.lora.r" not in flat:
            continue  # no LoRA: its settings are not the run's
        if klpo_key.startswith(("model.critic", "optim.critic")) and flat.get("algo.name") != "ppo":
            continue
        if klpo_key == "run.steps" and not (isinstance(got["value"], int) and got["value"] > 0):
            continue
        assert klpo_key in flat, (fw_key, klpo_key, got)
        if klpo_key not in ("algo.clip_low", "algo.clip_high"):
            assert flat[klpo_key] == got["value"], (fw_key, klpo_key)
    # Nothing the file gives is dropped silently: read, or listed as not carried.
    assert isinstance(d["equivalent"]["unmapped"], list)


# -- trl grpo --config, TRL's PPO config -------------------------------------------------------


def test_trl_cli_config_keys_of_the_script_and_accelerate_are_trls(tmp_path):
    (tmp_path / "grpo.yaml").write_text(
        "model_name_or_path: Qwen/Qwen2-0.5B-Instruct\n"
        "dataset_name: trl-lib/DeepMath-103K\n"
        "reward_funcs: [accuracy_reward]\n"
        "num_processes: 4\n"
        "beta: 0.04\n"
        "num_generations: 8\n"
        "per_device_train_batch_size: 4\n"
    )
    p = _write(tmp_path, "run.sh", "trl grpo --config grpo.yaml --learning_rate 2e-6\n")
    d = diagnose(p)
    assert d["framework"] == "trl-grpo"
    assert not _texts(d, "error")  # reward_funcs and num_processes are TRL's own
    assert _reading(d) == ("trl-grpo", [("k3_is", "loss", 0.04)], 8, 1)
    flat = _flat(d["equivalent"]["config"])
    # 4 per device × 4 processes × 1 step per generation = 16 completions: 2 prompts of 8.
    assert flat["rollout.prompts_per_step"] == 2
    assert flat["optim.lr"] == 2e-6  # the command line overrides the file


def test_trl_cli_config_file_not_found_names_where_it_looked(tmp_path):
    p = _write(tmp_path, "run.sh", "trl grpo --config missing.yaml\n")
    with pytest.raises(DoctorError, match=r"missing.yaml.*beside the script"):
        diagnose(p)


def test_trl_ppo_config_is_not_read_as_grpo(tmp_path):
    p = _write(tmp_path, "ppo.yaml", "kl_coef: 0.05\nvf_coef: 0.1\nnum_ppo_epochs: 4\n")
    with pytest.raises(DoctorError, match="PPOConfig"):
        diagnose(p)


# -- "refuses it and does not start" only where it is so ---------------------------------------


def test_keys_of_another_config_name_are_not_said_to_be_refused(tmp_path):
    p = _write(
        tmp_path,
        "m.sh",
        "python3 -m verl.trainer.main_ppo --config-path=config "
        "--config-name='ppo_megatron_trainer.yaml' algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4 "
        "actor_rollout_ref.actor.use_kl_loss=true\n",
    )
    d = diagnose(p)
    assert not [f for f in d["findings"] if f["level"] == "error"]
    texts = _texts(d, "warning")
    assert any("ppo_megatron_trainer.yaml" in t and "may define it" in t for t in texts)
    assert any("defaults here are ppo_trainer's" in t for t in texts)
    # Without --config-name the same unknown key is verl's refusal.
    q = _write(
        tmp_path,
        "n.sh",
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.megatron_x.tp=4\n",
    )
    assert any("does not start" in t for t in _texts(diagnose(q), "error"))


def test_no_did_you_mean_from_another_section():
    from klpo.doctor.reading import nearest

    pool = ["qat.mode", "algorithm.adv_estimator", "algorithm.kl_penalty"]
    assert nearest("algorithm.mode", pool) is None
    assert nearest("algorithm.kl_penalti", pool) == "algorithm.kl_penalty"


def test_unreadable_batch_carries_the_default_and_says_so(tmp_path):
    p = _write(
        tmp_path,
        "o.sh",
        "python3 -m openrlhf.cli.train_ppo_ray --init_kl_coef 0.01 --rollout_batch_size $RBS\n",
    )
    d = diagnose(p, version="0.9.10")
    flat = _flat(d["equivalent"]["config"])
    # OpenRLHF 0.9.10's --rollout_batch_size default is 1024 (cli/train_ppo_ray.py).
    assert flat["rollout.prompts_per_step"] == 1024
    assert any("prompts_per_step is" in x and "--var" in x for x in d["equivalent"]["differences"])
    given = diagnose(p, version="0.9.10", variables={"RBS": "64"})
    assert _flat(given["equivalent"]["config"])["rollout.prompts_per_step"] == 64


def test_accelerate_process_count_enters_the_generation_batch(tmp_path):
    (tmp_path / "g.yaml").write_text(
        "beta: 0.04\nnum_generations: 8\nper_device_train_batch_size: 2\n"
    )
    one = diagnose(_write(tmp_path, "a.sh", "trl grpo --config g.yaml\n"))
    eight = diagnose(
        _write(
            tmp_path,
            "b.sh",
            "accelerate launch --num_processes 8 trl/scripts/grpo.py --config g.yaml\n",
        )
    )
    # 2 per device × 8 processes = 16 completions: 2 prompts of 8; on one process TRL refuses
    # 2 completions in groups of 8 (shown for the 4 processes it needs: 1 prompt).
    assert _flat(eight["equivalent"]["config"])["rollout.prompts_per_step"] == 2
    assert _flat(one["equivalent"]["config"])["rollout.prompts_per_step"] == 1
    assert not _texts(eight, "error")
