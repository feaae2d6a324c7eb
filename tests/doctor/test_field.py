"""The doctor on six more frameworks: NeMo-RL, slime, SkyRL, prime-rl, AReaL, and Unsloth as a
variant of TRL. The fixtures are the frameworks' own example configs (fixtures/field/README.md);
the expected readings are written from each framework's source at the pinned commit:

- NeMo-RL ``7ea279a``: the loss's defaults (``loss_functions.py:128-153``: k3, 0.01, token-level),
  the KL weighted by exp(lp − sg lp) since ``33bce20`` (k3 × w has the per-token gradient
  d·∇lp of klpo's ``k3+``;
  k2 × w has no klpo estimator and a biased gradient), steps = prompts × generations /
  ``train_global_batch_size`` (× ``ppo_epochs`` for PPO, default 4).
- slime ``624b824``: ``--kl-loss-type`` k1 by default, low_var_kl = k3 with its value clamped to
  ±10, steps = rollout_batch_size × n_samples / global_batch_size, ``train_async.py`` async.
- SkyRL ``a956457`` (skyrl 0.3.0): ``use_kl_loss`` true, k3 (verl's ``low_var_kl`` clamps), 0.001,
  train_batch_size / policy_mini_batch_size = 1024 / 256 = 4 steps, 5 samples per prompt.
- prime-rl ``559b447``: no reference model; ``max_off_policy_steps`` 8: asynchronous.
- AReaL ``cbff54d``: the examples set ``kl_ctl: 0`` (no KL); ``gconfig.n_samples`` groups,
  ``ppo_n_minibatches`` steps, ``max_head_offpolicyness`` > 0 asynchronous.
- Unsloth ``015bdef``: beta 0.001 and loss_type bnpo by default, plain k3 in the loss, a batch
  made a multiple of ``num_generations``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.doctor import DoctorError, detect, diagnose

FIELD = Path(__file__).parent / "fixtures" / "field"

# file: (framework, version read, [(estimator, placement, beta)], group size,
#        optimiser steps per batch of rollouts, asynchronous, keys of the error findings)
EXPECTED: dict[str, tuple] = {
    # 32 prompts × 16 = 512 = train_global_batch_size: 1 step; k3 × w (= klpo's k3+), 0.01.
    "nemo_rl/grpo_math_1B.yaml": ("nemo-rl", "0.6.0+7ea279a", [("k3+", "loss", 0.01)], 16, 1, False, []),
    # 64 × 32 / 512 = 4 steps; the KL from the parent config.
    "nemo_rl/grpo_math_8B.yaml": ("nemo-rl", "0.6.0+7ea279a", [("k3+", "loss", 0.01)], 32, 4, False, []),
    # ProRL v2: k2 × w, 1e-4 (no klpo estimator: biased); parent's 32 × 16 / 512 = 1.
    "nemo_rl/prorlv2.v2.yaml": ("nemo-rl", "0.6.0+7ea279a", [(None, "loss", 0.0001)], 16, 1, False, []),
    # PPO-DAPO: no KL; 32 × 16 / 512 = 1, times ppo_epochs 4.
    "nemo_rl/ppo_math_1B.yaml": ("nemo-rl", "0.6.0+7ea279a", [], 16, 4, False, []),
    # --use-kl-loss --kl-loss-coef 0.00: no KL term; 32 × 8 / 256 = 1.
    "slime/run-qwen3-4B.sh": ("slime", "0.3.1+624b824", [], 8, 1, False, []),
    # low_var_kl, 0.001 in the loss: k3 with the value clamped; 32 × 8 / 256 = 1.
    "slime/search-r1_run_qwen2.5_3B.sh": ("slime", "0.3.1+624b824", [("k3", "loss", 0.001)], 8, 1, False, []),
    # train_async.py: asynchronous; coefficient 0; 8 × 4 / 32 = 1.
    "slime/fully_async_run-qwen2.5-0.5B.sh": ("slime", "0.3.1+624b824", [], 4, 1, True, []),
    # use_kl_loss=true with the defaults k3 (clamped: low_var_kl), 0.001; 4 steps.
    "skyrl/run_gsm8k.sh": ("skyrl", "0.3.0", [("low_var_kl", "loss", 0.001)], 5, 4, False, []),
    # REINFORCE++: k2 in the reward, kl_loss_coef's default 0.001.
    "skyrl/run_reinforce++.sh": ("skyrl", "0.3.0", [("k2", "reward", 0.001)], 5, 4, False, []),
    # KL-Cov policy loss, with use_kl_loss and 0.001.
    "skyrl/run_kl_cov.sh": ("skyrl", "0.3.0", [("low_var_kl", "loss", 0.001)], 5, 4, False, []),
    "prime_rl/reverse-text_rl.toml": ("prime-rl", "0.8.0", [], 16, 1, True, []),
    "prime_rl/wordle_rl.toml": ("prime-rl", "0.8.0", [], 8, 1, True, []),
    "prime_rl/debug_algo_grpo.toml": ("prime-rl", "0.8.0", [], 16, 1, True, []),
    "areal/gsm8k_grpo.yaml": ("areal", "2.0.0", [], 4, 1, True, []),
    "areal/gsm8k_drgrpo.yaml": ("areal", "2.0.0", [], 4, 1, True, []),
    "areal/boba_grpo.yaml": ("areal", "2.0.0", [], 16, 4, True, []),
    # Unsloth: beta 0.001 (its default), plain k3; the batch made 4 (= num_generations): 1 step.
    "unsloth/qwen3_4b_grpo.py": ("unsloth", "2026.8.19 (TRL 1.16.0)", [("k3", "loss", 0.001)], 4, 1, False, []),
    "unsloth/llama3_1_8b_grpo.py": ("unsloth", "2026.8.19 (TRL 1.16.0)", [("k3", "loss", 0.001)], 6, 1, False, []),
    "unsloth/gemma3_1b_grpo.py": ("unsloth", "2026.8.19 (TRL 1.16.0)", [("k3", "loss", 0.001)], 4, 1, False, []),
    # AReaL's PPO example: a critic (PPO with GAE), kl_ctl 0, 4 samples, 1 minibatch, 2 versions stale.
    "areal/gsm8k_ppo.yaml": ("areal", "2.0.0", [], 4, 1, True, []),
    # ROLL 8eb27cc. reinforce, no KL (add_token_level_kl false, use_kl_loss default false);
    # 64 prompts × 8 = 512 over 16 megatron ranks (TP·PP·CP = 1) = 32 per rank, / (1 × 32) = 1.
    "roll/qwen2.5-7B-rlvr_megatron/rlvr_config.yaml": ("roll", "0.3.0+8eb27cc", [], 8, 1, False, []),
    # The same YAML through its launch script (--config_name rlvr_config, beside it).
    "roll/qwen2.5-7B-rlvr_megatron/run_rlvr_pipeline.sh": ("roll", "0.3.0+8eb27cc", [], 8, 1, False, []),
    # async_generation_ratio 1: asynchronous; 512 / (16 / TP 2) = 64 per rank, / 64 = 1.
    "roll/qwen2.5-7B-rlvr_megatron/rlvr_config_async.yaml": ("roll", "0.3.0+8eb27cc", [], 8, 1, True, []),
    # grpo, use_kl_loss with 0.01: k3 with its value clamped to ±10 (klpo's low_var_kl);
    # 256 × 8 = 2048 / (32 / (TP 4 · PP 2)) = 512 per rank, / (1 × 512) = 1.
    "roll/qwen3.5-27B-rlvr_megatron/rlvr_megatron_80GB.yaml": ("roll", "0.3.0+8eb27cc", [("low_var_kl", "loss", 0.01)], 8, 1, False, []),
    # 128 × 8 = 1024 / 16 = 64 per rank, / 64 = 1 (its pg_variant is dropped: test_rules.py).
    "roll/qwen2.5-7B-rlvr-offpolicy/rlvr_config.yaml": ("roll", "0.3.0+8eb27cc", [], 8, 1, False, []),
    # fsdp2 over 16 ranks (no Ulysses): 512 / 16 = 32, / 32 = 1.
    "roll/qwen3-8B-rlvr_fsdp2/rlvr_config.yaml": ("roll", "0.3.0+8eb27cc", [], 8, 1, False, []),
}  # fmt: skip


def _texts(d, level=None):
    return [f["text"] for f in d["findings"] if level is None or f["level"] == level]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_field_example_reading(name):
    d = diagnose(FIELD / name)
    got = (
        d["framework"],
        d["defaults_version"],
        [(t["estimator"], t["placement"], t["beta"]) for t in d["terms"]],
        d["group_size"],
        d["updates_per_batch"],
        d["asynchronous"],
        sorted(k for f in d["findings"] if f["level"] == "error" for k in f["keys"]),
    )
    assert got == EXPECTED[name]
    assert detect(FIELD / name) == EXPECTED[name][0]
    if all(t[0] for t in EXPECTED[name][2]):
        assert d["equivalent"]["invalid"] is None, d["equivalent"]["invalid"]


def test_at_least_three_fixtures_per_new_framework():
    per: dict[str, int] = {}
    for name in EXPECTED:
        per[EXPECTED[name][0]] = per.get(EXPECTED[name][0], 0) + 1
    assert set(per) == {"nemo-rl", "slime", "skyrl", "prime-rl", "areal", "unsloth", "roll"}
    assert min(per.values()) >= 3


# -- the version-dependent traps --------------------------------------------------------------


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_nemo_rl_k2_after_the_weight_is_biased_and_the_release_is_not(tmp_path):
    p = FIELD / "nemo_rl" / "prorlv2.v2.yaml"
    d = diagnose(p)
    assert any("E[(d + d²/2)" in t and "33bce20" in t for t in _texts(d, "warning"))
    # The r0.6.0 release predates the weight: k2 is klpo's k2, grad KL(pi_theta ‖ pi_ref).
    r = diagnose(p, version="0.6.0")
    [t] = r["terms"]
    assert (t["estimator"], r["defaults_version"]) == ("k2", "0.6.0")
    assert t["on_policy"]["gradient"] == "grad KL(pi_theta ‖ pi_ref)"
    # k3 in the release is verl's clamped low_var_kl; on main k3 × exp(lp − sg lp) has the
    # per-token gradient d·∇lp, klpo's k3+ (k3_is with use_on_policy_kl_approximation).
    g = diagnose(FIELD / "nemo_rl" / "grpo_math_1B.yaml", version="0.6.0")
    assert g["terms"][0]["estimator"] == "low_var_kl"
    m = diagnose(FIELD / "nemo_rl" / "grpo_math_1B.yaml")
    assert m["terms"][0]["on_policy"]["gradient"] == "grad KL(pi_theta ‖ pi_ref)"


def test_nemo_rl_child_config_needs_its_parent(tmp_path):
    p = _write(tmp_path, "child.yaml", 'defaults: "missing_parent.yaml"\ngrpo:\n  x: 1\n')
    with pytest.raises(DoctorError, match=r"missing_parent.yaml is not beside it"):
        diagnose(p)


SLIME = "ray job submit -- python3 train.py --rollout-batch-size 32 --n-samples-per-prompt 8 "


def test_slime_kl_loss_alone_is_k1_with_no_gradient(tmp_path):
    d = diagnose(_write(tmp_path, "s.sh", SLIME + "--use-kl-loss --kl-loss-coef 0.01\n"))
    [t] = d["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("k1", "loss", 0.01)
    assert t["on_policy"]["gradient"].startswith("zero")
    [err] = _texts(d, "error")
    assert "default is k1" in err and "--kl-loss-type k2" in err


def test_slime_kl_coef_is_ignored_for_grpo(tmp_path):
    d = diagnose(_write(tmp_path, "s.sh", SLIME + "--kl-coef 0.05\n"))
    assert d["terms"] == []
    assert any("--kl-coef 0.05 is ignored for grpo" in t for t in _texts(d, "warning"))
    # reinforce_plus_plus reads it: a reward term with the --kl-loss-type estimator (slime
    # asserts --normalize-advantages beside it: arguments.py:1848-1852).
    rpp = "--kl-coef 0.05 --advantage-estimator reinforce_plus_plus"
    e = diagnose(_write(tmp_path, "r.sh", SLIME + rpp + " --normalize-advantages\n"))
    assert [(t["estimator"], t["placement"]) for t in e["terms"]] == [("k1", "reward")]
    f = diagnose(_write(tmp_path, "f.sh", SLIME + rpp + "\n"))
    assert f["terms"] == []
    [err] = [x for x in f["findings"] if x["kind"] == "refused"]
    assert "arguments.py:1848-1852" in err["text"] and "does not start" in err["text"]


def test_slime_unbiased_kl_is_k3_is_and_ref_resets_are_said(tmp_path):
    d = diagnose(
        _write(
            tmp_path,
            "s.sh",
            SLIME + "--use-kl-loss --kl-loss-coef 0.01 --kl-loss-type k3 --use-unbiased-kl "
            "--ref-update-interval 50\n",
        )
    )
    [t] = d["terms"]
    assert (t["estimator"], t["corrected"]) == ("k3_is", True)
    assert any("every 50 rollouts" in x for x in _texts(d, "note"))


SKY = (
    "uv run -m skyrl.train.entrypoints.main_base trainer.algorithm.use_kl_loss=true "
    "trainer.algorithm.kl_loss_coef=0.01\n"
)


@pytest.mark.parametrize(
    ("version", "no_grad"),
    [("skyrl-train-0.1.0", True), ("skyrl-train-0.4.0", True), ("0.1.0", True),
     ("0.2.0", False), ("0.3.0", False)],
)  # fmt: skip
def test_skyrl_no_gradient_window(tmp_path, version, no_grad):
    d = diagnose(_write(tmp_path, "k.sh", SKY), version=version)
    errors = _texts(d, "error")
    assert bool(errors) == no_grad
    if no_grad:
        assert "no gradient at all" in errors[0] and "skyrl >= 0.2.0" in errors[0]


def test_skyrl_unnamed_version_warns_of_the_window(tmp_path):
    d = diagnose(_write(tmp_path, "k.sh", SKY))
    assert any("@torch.no_grad" in t and "2026-03-20" in t for t in _texts(d, "warning"))


def test_skyrl_example_entry_point_is_refused():
    with pytest.raises(DoctorError, match=r"main_dapo.*SkyRL example's own entry point"):
        diagnose(FIELD / "skyrl" / "run_dapo_gsm8k.sh")


def test_prime_rl_has_no_reference_and_a_sampler_k2(tmp_path):
    d = diagnose(FIELD / "prime_rl" / "reverse-text_rl.toml")
    notes = _texts(d, "note")
    assert any("no reference model" in t for t in notes)
    assert any("toward the sampling policy" in t and "0.002" in t for t in notes)
    assert d["equivalent"]["config"]["kl"]["placement"] == "none"


def test_areal_kl_without_a_ref_section_is_not_a_kl(tmp_path):
    base = "gconfig:\n  n_samples: 4\nactor:\n  kl_ctl: 0.05\n  kl_estimator: k3\n"
    d = diagnose(_write(tmp_path, "a.yaml", base))
    assert d["terms"] == [] and any("ref_logp is zeros" in t for t in _texts(d, "error"))
    e = diagnose(
        _write(
            tmp_path,
            "b.yaml",
            base + "  use_decoupled_loss: true\nrollout:\n  max_head_offpolicyness: 2\n"
            "ref:\n  path: x\n",
        )
    )
    [t] = e["terms"]
    assert (t["estimator"], t["placement"], t["beta"]) == ("k3", "reward", 0.05)
    assert any("behaviour policy" in x for x in _texts(e, "warning"))


def test_unsloth_ignores_use_bias_correction_kl_where_trl_reads_it(tmp_path):
    body = (
        "{imp}\n"
        "from trl import GRPOConfig\n"
        "args = GRPOConfig(beta = 0.04, num_generations = 4, per_device_train_batch_size = 4)\n"
    )
    trl = diagnose(_write(tmp_path, "t.py", body.format(imp="import torch")))
    uns = diagnose(
        _write(tmp_path, "u.py", body.format(imp="from unsloth import FastLanguageModel"))
    )
    assert (trl["framework"], trl["terms"][0]["estimator"]) == ("trl-grpo", "k3_is")
    assert (uns["framework"], uns["terms"][0]["estimator"]) == ("unsloth", "k3")
    assert uns["terms"][0]["on_policy"]["gradient"] == "grad KL(pi_ref ‖ pi_theta)"
    assert any("never reads use_bias_correction_kl" in t for t in _texts(uns, "warning"))


def test_unsloth_drops_fields_trl_lacks_instead_of_refusing():
    d = diagnose(FIELD / "unsloth" / "gemma3_1b_grpo.py")
    assert not _texts(d, "error")
    assert any("warmup_ratio" in t and "Unsloth drops it" in t for t in _texts(d, "warning"))


def test_nemo_rl_and_areal_launch_commands_read_their_config_and_overrides(tmp_path):
    import shutil

    cfgs = tmp_path / "examples" / "configs"
    cfgs.mkdir(parents=True)
    for name in ("grpo_math_1B.yaml", "grpo_math_8B.yaml"):
        shutil.copy(FIELD / "nemo_rl" / name, cfgs / name)
    (tmp_path / "scripts").mkdir()
    # NeMo-RL's README: the config path from the repository's root, overrides after it.
    p = _write(
        tmp_path / "scripts",
        "launch.sh",
        'COMMAND="uv run ./examples/run_grpo.py --config examples/configs/grpo_math_8B.yaml '
        'loss_fn.reference_policy_kl_type=k2 grpo.num_prompts_per_step=16"\n'
        'srun bash -c "$COMMAND"\n',
    )
    d = diagnose(p)
    # k2 × w (biased, no klpo estimator); 16 × 32 / 512 = 1 step.
    assert (d["framework"], [t["estimator"] for t in d["terms"]], d["updates_per_batch"]) == (
        "nemo-rl", [None], 1,
    )  # fmt: skip
    (tmp_path / "examples" / "math").mkdir()
    shutil.copy(FIELD / "areal" / "gsm8k_grpo.yaml", tmp_path / "examples" / "math" / "g.yaml")
    q = _write(
        tmp_path,
        "areal.sh",
        "python3 -m areal.infra.launcher.local examples/math/gsm8k_rl.py "
        "--config examples/math/g.yaml actor.kl_ctl=0.02 gconfig.n_samples=8\n",
    )
    e = diagnose(q)
    assert (e["framework"], [(t["estimator"], t["beta"]) for t in e["terms"]], e["group_size"]) == (
        "areal", [("k1", 0.02)], 8,
    )  # fmt: skip


def test_nemo_rl_on_policy_kl_approximation_is_k3_is(tmp_path):
    import shutil

    shutil.copy(FIELD / "nemo_rl" / "grpo_math_1B.yaml", tmp_path / "grpo_math_1B.yaml")
    p = _write(
        tmp_path,
        "c.yaml",
        'defaults: "grpo_math_1B.yaml"\nloss_fn:\n  use_on_policy_kl_approximation: true\n',
    )
    [t] = diagnose(p)["terms"]
    assert (t["estimator"], t["corrected"]) == ("k3_is", True)


# -- ROLL: what its RLVR pipeline does with the KL settings (roll/utils/functionals.py) --------

ROLL = FIELD / "roll" / "qwen2.5-7B-rlvr_megatron" / "rlvr_config.yaml"


def _roll(tmp_path, **changes):
    import yaml

    data = yaml.safe_load(ROLL.read_text())
    data.update(changes)
    return diagnose(_write(tmp_path, "rlvr.yaml", yaml.safe_dump(data)))


def test_roll_default_init_kl_coef_loads_a_reference_it_never_applies():
    d = diagnose(ROLL)
    assert d["terms"] == []
    assert any("init_kl_coef is ROLL's default 0.2" in t and "no KL term is applied" in t
               for t in _texts(d, "note"))  # fmt: skip


def test_roll_reward_kl_is_per_token_with_returns_to_go_and_its_controller(tmp_path):
    d = _roll(tmp_path, add_token_level_kl=True, init_kl_coef=0.05, target_kl=0.1)
    [t] = d["terms"]
    # kl_penalty's default "kl" = log pi_old − log pi_ref (k1), beta init_kl_coef, adaptive
    # toward target_kl (kl_controller.py); reinforce credits it by returns-to-go.
    assert (t["estimator"], t["placement"], t["beta"], t["adaptive"]) == (
        "k1",
        "reward",
        0.05,
        True,
    )
    assert "returns-to-go" in t["reduction"]
    assert d["equivalent"]["config"]["kl"]["controller"] == "adaptive"


def test_roll_refuses_k3_in_the_reward(tmp_path):
    # kl_penalty: Literal["kl", "abs", "mse", "full"] (base_config.py:527): dacite refuses k3.
    d = _roll(tmp_path, add_token_level_kl=True, kl_penalty="k3")
    assert d["terms"] == []
    [f] = [x for x in d["findings"] if x["kind"] == "refused"]
    assert "base_config.py:527" in f["text"] and "does not start" in f["text"]


def test_roll_grpo_over_groups_of_one(tmp_path):
    d = _roll(tmp_path, adv_estimator="grpo", num_return_sequences_in_group=1)
    [f] = [x for x in d["findings"] if x["kind"] == "zero-advantage"]
    assert "every advantage is zero" in f["text"] and "NaN" in f["text"]


def test_roll_critic_is_built_for_gae_only(tmp_path):
    d = _roll(tmp_path, critic={"model_args": {"model_name_or_path": "m"}})
    assert [x["keys"] for x in d["findings"] if x["kind"] == "unread-key"] == [
        ("critic", "adv_estimator")
    ]
    g = _roll(tmp_path, adv_estimator="gae")
    assert g["algorithm"] == "gae" and g["equivalent"]["config"]["algo"]["name"] == "ppo"


def test_roll_agentic_config_is_refused_by_name(tmp_path):
    import yaml

    data = yaml.safe_load(ROLL.read_text())
    data["train_env_manager"] = {"group_size": 8}
    with pytest.raises(DoctorError, match="ROLL agentic pipeline config"):
        diagnose(_write(tmp_path, "agentic.yaml", yaml.safe_dump(data)))
