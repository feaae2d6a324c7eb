"""The doctor reads on-policy distillation configs: TRL's DistillationConfig and SDPOConfig, verl's
``distillation.*``, NeMo-RL's distillation algorithm and MOPD, slime's ``--use-opd``, prime-rl's
opd/opsd, SkyRL's on-policy distillation example, ROLL's OPD pipeline (pure and mixed). Each
term's divergence, direction, support, placement, credit and clamps are the ones read in the
framework's source (the module docstrings name the files); what it follows is
``klpo explain --teacher``'s shipped table; each trap has a finding, tested here one by one; the
frameworks' own example configs (``fixtures/field/``, sources in its README) are read as the
source says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from klpo import registry
from klpo.doctor import diagnose, read
from klpo.doctor.distill import FORWARD, REVERSE

FIELD = Path(__file__).parent / "fixtures" / "field"
ROOT = Path(__file__).resolve().parents[2]


def _verl(tmp_path: Path, *overrides: str) -> Path:
    """A verl launch script: main_ppo with ``overrides``, distillation on."""
    script = tmp_path / "run_opd.sh"
    args = " \\\n    ".join(("distillation.enabled=True", *overrides))
    script.write_text(
        "python3 -m verl.trainer.main_ppo \\\n    algorithm.adv_estimator=grpo \\\n"
        "    distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-8B \\\n"
        f"    {args}\n"
    )
    return script


def _findings(r, level: str | None = None) -> list[str]:
    return [f.text for f in r.findings if level is None or f.level == level]


def _one(texts: list[str], needle: str) -> str:
    hits = [t for t in texts if needle in t]
    assert len(hits) == 1, (needle, texts)
    return hits[0]


# --- verl -------------------------------------------------------------------------------------


def test_verl_default_mode_is_clamped_k3_in_the_loss_and_follows_the_forward_kl(tmp_path):
    """distillation.yaml's defaults: loss_mode k3 (kl_penalty's low_var_kl), supervised."""
    r = read(_verl(tmp_path))
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.support, t.table_key) == (
        "low_var_kl",
        "loss",
        "sampled",
        "k3",
    )
    assert (t.value_clamp, t.log_ratio_clamp) == ((-10.0, 10.0), (-20.0, 20.0))
    assert t.teacher == "Qwen/Qwen3-8B" and t.beta == 1.0  # use_task_rewards true: the coef, 1.0
    # the trap: it logs the reverse KL, its gradient is the forward KL's (the shipped table says so)
    assert registry.teacher_positions("k3")["near"]["gradient"] == FORWARD
    text = _one(_findings(r, "warning"), "in the loss (verl's default)")
    assert f"that of {FORWARD}" in text and "k3+" in text
    assert r.teacher_intended["estimator"] == "k3+"


def test_verl_forward_kl_topk_clamp_min_zero_is_a_finding(tmp_path):
    r = read(
        _verl(
            tmp_path,
            "distillation.distillation_loss.loss_mode=forward_kl_topk",
            "distillation.distillation_loss.topk=64",
            "distillation.distillation_loss.log_prob_min_clamp=-10.0",
        )
    )
    (t,) = r.teacher_terms
    assert (t.support, t.topk_of, t.top_k, t.table_key) == (
        "top-k",
        "teacher",
        64,
        "topk_forward_clamp",
    )
    assert any("clamp_min(0.0)" in c for c in t.clamps) and any("-10" in c for c in t.clamps)
    text = _one(_findings(r, "warning"), "clamp_min(0.0)")
    assert "verl#7856" in text and "415 of 467" in text
    # the share of positions where the clamp binds is the shipped table's, per family
    rows = registry.teacher_positions("topk_forward_clamp")
    assert f"{rows['sharp']['clamp_binds']:.0%} of 'sharp' positions" in text
    assert rows["sharp"]["clamp_binds"] > rows["near"]["clamp_binds"] > 0
    assert r.teacher_section["clamp_zero"] is True and r.teacher_section["top_k"] == 64
    assert r.teacher_intended["estimator"] == "topk_tail" and "clamp_zero" not in r.teacher_intended


def test_verl_policy_gradient_k1_is_the_per_token_reward_with_discount_zero(tmp_path):
    r = read(
        _verl(
            tmp_path,
            "distillation.distillation_loss.loss_mode=k1",
            "distillation.distillation_loss.use_policy_gradient=True",
            "distillation.distillation_loss.use_task_rewards=False",
            "distillation.distillation_loss.loss_max_clamp=10.0",
        )
    )
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit, t.beta) == ("k1", "reward", "token", 1.0)
    assert t.value_clamp == (-10.0, 10.0)
    seq = registry.teacher_sequence("k1", "reward", "token")
    text = _one(_findings(r, "warning"), "discount 0")
    assert f"cosine {seq['cos_sequence']:.3f}" in text and "returns-to-go" in text
    assert r.teacher_section["credit"] == "token" and r.teacher_intended["credit"] == "returns"
    assert any("use_task_rewards=false" in x for x in _findings(r, "note"))


def test_verl_refuses_k1_in_the_loss_and_a_top_k_reverse_mode(tmp_path):
    r = read(_verl(tmp_path, "distillation.distillation_loss.loss_mode=k1"))
    assert not r.teacher_terms
    assert "does not depend on the teacher" in _one(_findings(r, "error"), "loss_mode=k1")
    r = read(_verl(tmp_path, "distillation.distillation_loss.loss_mode=reverse_kl_topk"))
    assert not r.teacher_terms
    text = _one(_findings(r, "error"), "Unsupported loss mode")
    assert "PR #5041" in text and "forward_kl_topk" in text


def test_verl_settings_the_mode_never_reads_are_named(tmp_path):
    r = read(
        _verl(
            tmp_path,
            "distillation.distillation_loss.topk=64",
            "distillation.distillation_loss.clip_ratio=0.3",
        )
    )
    unread = [f for f in r.findings if f.kind == "unread-key"]
    assert {f.keys[0].rsplit(".", 1)[-1] for f in unread} == {"topk", "clip_ratio"}


def test_verl_a_zero_coefficient_beside_the_task_cancels_the_term(tmp_path):
    r = read(_verl(tmp_path, "distillation.distillation_loss.distillation_loss_coef=0"))
    assert not r.teacher_terms
    assert [f for f in r.findings if f.kind == "cancelled" and "multiplied by 0" in f.text]


def test_verl_distillation_settings_without_enabled_do_nothing(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo distillation.distillation_loss.loss_mode=forward_kl_topk\n"
    )
    r = read(script)
    assert not r.teacher_terms
    assert "distillation.enabled is false" in _one(_findings(r, "warning"), "distillation.enabled")


# --- TRL ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("beta", "direction", "key"),
    [
        (1.0, "reverse", "full"),
        (0.0, "forward", "forward"),
        (0.5, "JSD(0.5)", "jsd"),
        (0.3, "JSD(0.3)", None),
    ],
)
def test_trl_distillation_beta_picks_the_divergence(tmp_path, beta, direction, key):
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(
        f"model_name_or_path: Qwen/Qwen2.5-0.5B\nteacher_model_name_or_path: Qwen/Qwen2.5-7B\nbeta: {beta}\n"
    )
    r = read(cfg)
    assert r.framework == "trl-distillation"
    (t,) = r.teacher_terms
    assert (t.direction, t.support, t.placement, t.table_key) == (direction, "full", "loss", key)
    assert t.teacher == "Qwen/Qwen2.5-7B"
    est = {"reverse": "full", "forward": "forward"}.get(direction, "jsd")
    assert r.teacher_section["estimator"] == est
    note = _one(_findings(r, "note"), "vocab_size")
    assert "GOLD" in note and "chunked_divergence" in note


def test_trl_distillation_refusals_and_temperature(tmp_path):
    cfg = tmp_path / "distill.yaml"
    cfg.write_text("teacher_model_name_or_path: T\nbeta: 1.5\ntemperature: 0.7\n")
    r = read(cfg)
    assert not r.teacher_terms and "beta must be in [0.0, 1.0]" in _one(
        _findings(r, "error"), "beta"
    )
    cfg.write_text("teacher_model_name_or_path: T\ntemperature: 0.7\n")
    r = read(cfg)
    assert "temperature 0.7" in _one(_findings(r, "note"), "temperature 0.7 samples")
    script = tmp_path / "run.sh"
    script.write_text("trl distillation --model_name_or_path Qwen/Qwen2.5-0.5B\n")
    r = read(script)
    assert "refuses to start without one" in _one(
        _findings(r, "error"), "teacher_model_name_or_path"
    )


def test_a_distillation_yaml_is_not_read_as_a_grpo_config(tmp_path):
    """Its beta, temperature, learning_rate are GRPOConfig fields too: the teacher's field is the
    positive evidence."""
    cfg = tmp_path / "distill.yaml"
    cfg.write_text(
        "teacher_model_name_or_path: T\nbeta: 1.0\nlearning_rate: 1.0e-6\ntemperature: 1.0\n"
    )
    assert read(cfg).framework == "trl-distillation"


def test_sdpo_topk_without_a_tail_bucket_has_the_support_bias(tmp_path):
    cfg = tmp_path / "sdpo.py"
    cfg.write_text(
        "from trl.experimental.sdpo import SDPOConfig\n"
        "args = SDPOConfig(output_dir='o', distillation_mode='topk_logits', distillation_topk=100)\n"
    )
    r = read(cfg)
    (t,) = r.teacher_terms
    assert (t.support, t.topk_of, t.top_k, t.table_key) == (
        "top-k",
        "student",
        100,
        "student_topk_renorm",
    )
    assert "the teacher's mass outside the student's top-k is never seen" in _one(
        _findings(r, "warning"), "support bias"
    )
    cfg.write_text(
        cfg.read_text().replace(
            "distillation_topk=100", "distillation_topk=100, distillation_add_tail=True"
        )
    )
    r = read(cfg)
    assert r.teacher_terms[0].table_key == "student_topk_tail"
    assert not [x for x in _findings(r) if "support bias" in x]


def test_sdpos_direction_is_read_from_its_kl_div_call(tmp_path):
    cfg = tmp_path / "sdpo.py"
    cfg.write_text(
        "from trl.experimental.sdpo import SDPOConfig\n"
        "args = SDPOConfig(output_dir='o', distillation_mode='full_logits', distillation_alpha=0.0)\n"
    )
    r = read(cfg)
    (t,) = r.teacher_terms
    assert (t.direction, t.table_key) == ("forward", "forward")
    text = _one(_findings(r, "note"), "F.kl_div")
    assert "KL(target ‖ input)" in text and "huggingface/trl#4935" in text
    cfg.write_text(
        cfg.read_text().replace(
            "'full_logits', distillation_alpha=0.0", "'sampled_token', distillation_alpha=0.5"
        )
    )
    r = read(cfg)
    assert not r.teacher_terms and "reverse KL only" in _one(_findings(r, "error"), "sampled_token")


# --- NeMo-RL ------------------------------------------------------------------------------------


def test_nemo_rl_distillation_is_read_not_refused():
    r = read(FIELD / "nemo_rl" / "distillation_math.yaml")
    (t,) = r.teacher_terms
    assert (t.direction, t.support, t.topk_of, t.top_k) == ("mixed", "top-k", "teacher", 64)
    assert t.table_key == "teacher_topk_renorm_mixed" and t.teacher == "Qwen/Qwen3-4B"
    assert r.updates_per_batch == 2  # 128 prompts × 1 / a global batch of 64


def test_nemo_rl_reverse_on_the_teachers_topk_has_the_support_bias(tmp_path):
    r = read(
        FIELD
        / "nemo_rl"
        / "recipes"
        / "llm"
        / "distillation-qwen3-32b-to-1.7b-base-1n8g-fsdp2tp1.v1.yaml"
    )
    (t,) = r.teacher_terms
    assert (t.direction, t.table_key) == ("reverse", "teacher_topk_renorm_reverse")
    text = _one(_findings(r, "warning"), "support bias")
    assert "student's mass outside the teacher's top-k is never compared" in text
    assert "zero_outside_topk: true" in text
    # the fix named in the finding removes it
    child = tmp_path / "child.yaml"
    child.write_text(
        f"defaults: {(FIELD / 'nemo_rl' / 'distillation_math.yaml').resolve()}\n"
        "loss_fn:\n  kl_type: reverse\n  zero_outside_topk: true\n"
    )
    r = read(child)
    assert r.teacher_terms[0].table_key is None  # a form the table does not derive: said so
    assert not [x for x in _findings(r) if "support bias" in x]
    assert diagnose(child)["distillation"]["terms"][0]["per_position"] is None


def test_nemo_rl_mopd_is_the_per_token_reward_and_full_is_pr_3978(tmp_path):
    mopd = FIELD / "nemo_rl" / "recipes" / "llm" / "mopd-qwen3-1.7b-3n8g-megatron-pack.yaml"
    r = read(mopd)
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit, t.teacher) == (
        "k1",
        "reward",
        "token",
        "Qwen/Qwen3-1.7B",
    )
    assert "OPDAdvantageEstimator" in _one(_findings(r, "warning"), "discount 0")
    child = tmp_path / "full.yaml"
    child.write_text(
        f"defaults: {mopd.resolve()}\non_policy_distillation:\n  full:\n    enabled: true\n"
    )
    r = read(child)
    (t,) = r.teacher_terms
    assert (t.support, t.placement, t.table_key) == ("full", "loss", "full")
    assert "NVIDIA-NeMo/RL#3978" in _one(_findings(r, "warning"), "PR #3978")
    sync = tmp_path / "sync.yaml"
    sync.write_text(f"defaults: {mopd.resolve()}\ngrpo:\n  async_grpo:\n    enabled: false\n")
    assert "async_grpo_train only" in _one(_findings(read(sync), "error"), "synchronous GRPO")
    cancel = tmp_path / "cancel.yaml"
    cancel.write_text(f"defaults: {mopd.resolve()}\ngrpo:\n  adv_estimator:\n    name: grpo\n")
    r = read(cancel)
    assert not r.teacher_terms and [f for f in r.findings if f.kind == "cancelled"]


# --- slime, prime-rl ----------------------------------------------------------------------------


def test_slime_opd_is_the_per_token_reward_and_its_guide_had_the_direction_backwards():
    r = read(FIELD / "slime" / "run-qwen3-8B-opd.sh")
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit, t.beta) == ("k1", "reward", "token", 1.0)
    assert t.teacher.startswith("the SGLang server at http://")
    _one(_findings(r, "warning"), "discount 0")
    text = _one(_findings(r, "note"), "PR #2254")
    assert "THUDM/slime#2254" in text and "D_KL(P_teacher ‖ P_student)" in text
    assert "pure distillation" in _one(_findings(r, "note"), "returns 0 for every sample")
    r = read(FIELD / "slime" / "run-qwen3-8B-opd-megatron.sh")
    assert r.teacher_terms[0].teacher == r.teacher_section["model"]


def test_slime_normalised_advantages_rescale_the_opd_coefficient(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "python3 train.py --rollout-batch-size 8 --n-samples-per-prompt 4 --use-opd "
        "--opd-type sglang --rm-url http://t/generate --normalize-advantages\n"
    )
    assert "batch to batch" in _one(_findings(read(script), "warning"), "--normalize-advantages")


@pytest.mark.parametrize(
    ("name", "teacher"),
    [
        ("debug_algo_opd.toml", "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"),
        ("debug_algo_mixed_grpo_opd.toml", "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"),
        ("debug_algo_self_distill.toml", "the live policy itself"),
    ],
)
def test_prime_rl_opd_and_opsd(name, teacher):
    r = read(FIELD / "prime_rl" / name)
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit) == ("k1", "reward", "token")
    assert t.teacher.startswith(teacher)
    _one(_findings(r, "warning"), "discount 0")
    if "self_distill" in name:
        assert "model" not in r.teacher_section  # no separate teacher: klpo's section says so
        assert any("live policy" in d for d in r.teacher_differences)


# --- SkyRL --------------------------------------------------------------------------------------


def _skyrl(tmp_path: Path, *overrides: str) -> Path:
    """SkyRL's OPD example command, reduced to its algorithm settings, with ``overrides``."""
    script = tmp_path / "run_opd.sh"
    args = " \\\n  ".join((
        "trainer.algorithm.advantage_estimator=no_op",
        "trainer.algorithm.policy_loss_type=importance_sampling",
        "trainer.policy.model.path=Qwen/Qwen3-1.7B-Base",
        "trainer.ref.model.path=Qwen/Qwen3-4B",
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_kl_in_reward=true",
        *overrides,
    ))  # fmt: skip
    script.write_text(
        "uv run --isolated --extra fsdp -m "
        f"examples.train.on_policy_distillation.main_on_policy_distill \\\n  {args}\n"
    )
    return script


def test_skyrl_opd_example_is_the_per_token_reward_with_coefficient_one(tmp_path):
    # main_on_policy_distill.py: rewards = -(action_log_probs - teacher_action_log_probs) per
    # token, the no_op estimator passes them through: k1 in the reward, discount 0, coefficient 1
    # (kl_loss_coef never read), the task reward replaced, the teacher the reference model.
    r = read(_skyrl(tmp_path))
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit, t.beta, t.teacher) == (
        "k1", "reward", "token", 1.0, "Qwen/Qwen3-4B",
    )  # fmt: skip
    assert not r.terms  # the reward-side KL of main_base is replaced, not added
    assert "main_on_policy_distill.py" in _one(_findings(r, "warning"), "discount 0")
    _one(_findings(r, "note"), "environment's reward is not in the advantage")
    _one(_findings(r, "note"), "the coefficient is 1, fixed")
    assert r.teacher_section == {
        "model": "Qwen/Qwen3-4B", "estimator": "k1", "placement": "reward", "beta": 1.0,
        "credit": "token",
    }  # fmt: skip
    assert r.teacher_intended["credit"] == "returns"
    # a coefficient given is named as unread; whitening rescales the term per batch
    r = read(_skyrl(tmp_path, "trainer.algorithm.kl_loss_coef=0.5",
                    "trainer.algorithm.advantage_batch_normalize=true"))  # fmt: skip
    assert r.teacher_terms[0].beta == 1.0
    assert "kl_loss_coef" in _one(_findings(r, "warning"), "set but not read")
    _one(_findings(r, "warning"), "advantage_batch_normalize whitens")


def test_skyrl_opd_without_use_kl_in_reward_has_no_term_and_no_teacher_path_is_the_student(
    tmp_path,
):
    # apply_reward_kl_penalty is called only with use_kl_in_reward (trainer.py:428-430)
    r = read(_skyrl(tmp_path, "trainer.algorithm.use_kl_in_reward=false"))
    assert not r.teacher_terms and [f for f in r.findings if f.kind == "cancelled"]
    # trainer.ref.model.path defaults to the policy's (config.py:1504-1505)
    script = _skyrl(tmp_path)
    script.write_text(script.read_text().replace("trainer.ref.model.path=Qwen/Qwen3-4B", ""))
    r = read(script)
    assert r.teacher_terms[0].teacher == "Qwen/Qwen3-1.7B-Base"
    _one(_findings(r, "warning"), "the teacher is the student's own start")
    # another estimator: the term is not derived; the README's typo is a key SkyRL refuses
    r = read(_skyrl(tmp_path, "trainer.algorithm.advantage_estimator=grpo"))
    assert not r.teacher_terms and _one(_findings(r, "warning"), "the doctor reads the term")
    r = read(_skyrl(tmp_path, "trainer.ref.mode.path=Qwen/Qwen3-4B"))
    assert any(f.kind == "unknown-key" and f.level == "error" for f in r.findings)
    # main_base itself has no teacher term: the reward KL is main_base's, to the reference
    base = _skyrl(tmp_path)
    base.write_text(base.read_text().replace(
        "examples.train.on_policy_distillation.main_on_policy_distill",
        "skyrl.train.entrypoints.main_base",
    ).replace("advantage_estimator=no_op", "advantage_estimator=grpo"))  # fmt: skip
    r = read(base)
    assert not r.teacher_terms and [t.placement for t in r.terms] == ["reward"]


# --- ROLL ---------------------------------------------------------------------------------------

ROLL_OPD = FIELD / "roll" / "qwen3-8B-onpolicy-distill-megatron"


def _roll(tmp_path: Path, base: Path, drop: tuple[str, ...] = (), **keys) -> Path:
    """``base``'s settings without the top-level ``drop`` keys, with ``keys`` set."""
    data = yaml.safe_load(base.read_text())
    for k in drop:
        data.pop(k, None)
    data.update(keys)
    out = tmp_path / "opd.yaml"
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def test_roll_pure_opd_is_the_per_token_reward_with_the_launchers_settings(tmp_path):
    # start_onpolicy_distill_pipeline.py sets is_pure_opd; _apply_opd_config forces gamma 0,
    # reinforce, no KL loss, no reward KL; compute_advantage: advantages = -opd_kl_coef ·
    # compute_approx_kl("kl") = -(log pi_theta - log pi_T) per token (opd_kl_coef defaults to 1)
    for name in ("onpolicy_distill_config.yaml", "run_onpolicy_distill_pipeline.sh"):
        r = read(ROLL_OPD / name)
        (t,) = r.teacher_terms
        assert (t.estimator, t.placement, t.credit, t.beta, t.teacher) == (
            "k1", "reward", "token", 1.0, "Qwen/Qwen3-32B",
        )  # fmt: skip
        assert (r.algorithm, r.group_size, r.terms) == ("reinforce", 4, [])
        assert r.settings["adv_estimator"]["value"] == "reinforce"
        assert "compute_advantage" in _one(_findings(r, "warning"), "discount 0")
        _one(_findings(r, "note"), "the task reward is not in the advantage")
        # the reference (the teacher) is loaded in OPD: no init_kl_coef note
        assert not [x for x in _findings(r) if "init_kl_coef is ROLL's default" in x]
    assert r.teacher_section == {
        "model": "Qwen/Qwen3-32B", "estimator": "k1", "placement": "reward", "beta": 1.0,
        "credit": "token",
    }  # fmt: skip
    assert r.teacher_intended["credit"] == "returns"
    # what the file says of the forced settings is named; so is every clamp of the advantage
    path = _roll(tmp_path, ROLL_OPD / "onpolicy_distill_config.yaml", adv_estimator="grpo",
                 whiten_advantages=True, advantage_clip=2.0, init_kl_coef=0)  # fmt: skip
    r = read(path)
    assert r.algorithm == "reinforce"
    _one(_findings(r, "warning"), "adv_estimator 'grpo': pure OPD sets")
    _one(_findings(r, "warning"), "whiten_advantages whitens")
    _one(_findings(r, "warning"), "advantage_clip 2 clamps")
    assert r.teacher_terms[0].clamps == ("the advantage clipped to ±2 (advantage_clip)",)
    _one(_findings(r, "note"), "from the inference engine (infer_logprobs)")


def test_roll_pure_opd_takes_k3_only_from_its_own_launcher(tmp_path):
    # the OPD launcher builds the config with check_types=False: kl_penalty k3 reaches
    # compute_approx_kl (k3, value clamped to ±10); start_rlvr_pipeline.py's dacite refuses it
    path = _roll(tmp_path, ROLL_OPD / "onpolicy_distill_config.yaml", kl_penalty="k3")
    (t,) = read(path).teacher_terms
    assert (t.estimator, t.value_clamp, t.table_key) == ("low_var_kl", (-10.0, 10.0), "k3")
    script = tmp_path / "run.sh"
    script.write_text("python examples/start_rlvr_pipeline.py --config_path . --config_name opd\n")
    _roll(tmp_path, ROLL_OPD / "onpolicy_distill_config.yaml", kl_penalty="k3", is_pure_opd=True)
    r = read(script)  # the RLVR launcher, pure by is_pure_opd: its dacite checks the Literal
    assert not r.teacher_terms and [f for f in r.findings if f.kind == "refused"]
    r = read(_roll(tmp_path, ROLL_OPD / "onpolicy_distill_config.yaml", kl_penalty="full"))
    assert not r.teacher_terms and _one(_findings(r, "error"), "kl_penalty 'full'")


def test_roll_multi_teacher_terms_and_their_routing(tmp_path):
    r = read(ROLL_OPD / "multi_teacher_onpolicy_distill_config.yaml")
    assert [(t.teacher, t.beta, t.beta_option) for t in r.teacher_terms] == [
        ("Qwen/Qwen3-32B", 1.0, "teacher.teacher_32B.opd_kl_coef"),
        ("Qwen/Qwen3-14B", 1.0, "teacher.teacher_14B.opd_kl_coef"),
    ]
    # each teacher's keys are a worker's: none is an unknown key; routing covers both tags
    assert not [f for f in r.findings if f.kind == "unknown-key" and "teacher" in f.keys[0]]
    assert not [x for x in _findings(r) if "routed to no teacher" in x]
    assert any("one teacher term" in d for d in r.teacher_differences)
    data = yaml.safe_load((ROLL_OPD / "multi_teacher_onpolicy_distill_config.yaml").read_text())
    data["teacher"]["teacher_14B"]["tag_included"] = ["code_contests"]
    data["teacher"]["teacher_14B"]["opd_kl_cof"] = 0.5
    path = tmp_path / "multi.yaml"
    path.write_text(yaml.safe_dump(data))
    r = read(path)
    text = _one(_findings(r, "warning"), "routed to no teacher")
    assert "KodCode" in text and "advantage is 0" in text
    assert [f.keys[0] for f in r.findings if f.kind == "unknown-key"][-1] == (
        "teacher.teacher_14B.opd_kl_cof"
    )


def test_roll_mixed_opd_subtracts_the_term_after_the_returns(tmp_path):
    rlvr = FIELD / "roll" / "qwen3-8B-rlvr_fsdp2" / "rlvr_config.yaml"
    teacher = {"model_args": {"model_name_or_path": "Qwen/Qwen3-32B"}, "opd_kl_coef": 0.5}
    r = read(_roll(tmp_path, rlvr, drop=("reference",), use_opd=True, teacher=teacher))
    (t,) = r.teacher_terms
    assert (t.estimator, t.placement, t.credit, t.beta) == ("k1", "reward", "token", 0.5)
    assert r.algorithm == "reinforce"  # the file's estimator: mixed mode keeps it
    _one(_findings(r, "note"), "after the returns are formed")
    _one(_findings(r, "warning"), "whiten_advantages whitens")  # the example whitens
    _one(_findings(r, "warning"), "the sum of the task's advantage and the teacher term")
    # the reference configured beside use_opd: ROLL raises
    r = read(_roll(tmp_path, rlvr, use_opd=True, teacher=teacher))
    assert not r.teacher_terms and _one(_findings(r, "error"), "should NOT be configured")
    # a KL loss in mixed mode is to the teacher
    r = read(_roll(tmp_path, rlvr, drop=("reference",), use_opd=True, teacher=teacher,
                   use_kl_loss=True, kl_loss_coef=0.01))  # fmt: skip
    assert r.terms and _one(_findings(r, "warning"), "are to the teacher")
    # the teacher without use_opd is never loaded; both modes at once are refused
    r = read(_roll(tmp_path, rlvr, teacher=teacher))
    assert not r.teacher_terms and _one(_findings(r, "warning"), "never loads it")
    r = read(_roll(tmp_path, ROLL_OPD / "onpolicy_distill_config.yaml", use_opd=True,
                   is_pure_opd=True))  # fmt: skip
    assert not r.teacher_terms and _one(_findings(r, "error"), "mutually exclusive")


# --- the report and --json ----------------------------------------------------------------------


def test_the_json_carries_the_terms_what_they_follow_and_the_validated_sections():
    d = diagnose(FIELD / "verl" / "run_qwen3_8b_megatron.sh")
    dist = d["distillation"]
    (t,) = dist["terms"]
    assert t["framework_name"] == "forward_kl_topk" and t["support"] == "top-k"
    assert set(t["per_position"]) == {"near", "sharp"}
    assert t["per_position"]["near"]["gradient"] == "other"
    assert t["over_sequence"]["bound"] is True  # a per-position term: at best the exact KL's
    assert (
        dist["section"]["invalid"] is None and dist["intended"]["invalid"] is None
    )  # klpo takes both
    assert dist["section"]["config"]["estimator"] == "topk_forward"
    assert d["equivalent"]["invalid"] is None  # the validated klpo config holds no teacher key
    assert "teacher" not in d["equivalent"]["config"]
    assert diagnose(FIELD / "slime" / "run-qwen3-4B.sh")["distillation"] is None


def test_the_command_prints_the_terms_and_the_section(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "klpo", "doctor", "--fail-on", "never",
         str(FIELD / "trl" / "distillation.sh")],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    text = out.stdout
    assert (
        "Distillation terms" in text and f"divergence: {REVERSE}, exact over the vocabulary" in text
    )
    assert "klpo teacher section that does the same thing (klpo train's teacher mode):" in text
    assert "    estimator: full" in text
    data = json.loads(
        subprocess.run(
            [sys.executable, "-m", "klpo", "doctor", "--json", str(FIELD / "trl" / "distillation.sh")],
            capture_output=True, text=True, timeout=120,
        ).stdout
    )  # fmt: skip
    assert data["distillation"]["terms"][0]["table_key"] == "full"


# --- the frameworks' own examples, read as their source says -------------------------------------

# config -> (framework, term's framework name, support, placement, credit, table key)
EXAMPLES = {
    "verl/run_qwen3_8b_fsdp.sh": ("verl", "k1", "sampled", "reward", "token", "k1"),
    "verl/run_qwen3_8b_megatron.sh": ("verl", "forward_kl_topk", "top-k", "loss", "", "topk_forward_clamp"),
    "verl/run_qwen3_8b_mopd_fsdp.sh": ("verl", "k1", "sampled", "reward", "token", "k1"),
    "verl/run_qwen3_0.6b_opd_veomni.sh": ("verl", "k1", "sampled", "reward", "token", "k1"),
    "trl/distillation.sh": ("trl-distillation", "DistillationTrainer: reverse KL (beta 1)", "full", "loss", "", "full"),
    "trl/distillation_lora.sh": ("trl-distillation", "DistillationTrainer: reverse KL (beta 1)", "full", "loss", "", "full"),
    "trl/distillation_quickstart.py": ("trl-distillation", "DistillationTrainer: reverse KL (beta 1)", "full", "loss", "", "full"),
    "trl/sdpo_usage.py": ("trl-sdpo", "SDPO topk_logits (alpha 1)", "top-k", "loss", "", "student_topk_renorm"),
    "nemo_rl/distillation_math.yaml": ("nemo-rl", "DistillationLossFn (mixed)", "top-k", "loss", "", "teacher_topk_renorm_mixed"),
    "nemo_rl/recipes/llm/distillation-qwen3-32b-to-4b-base-2n8g-fsdp2tp2-long.v1.yaml": ("nemo-rl", "DistillationLossFn (reverse)", "top-k", "loss", "", "teacher_topk_renorm_reverse"),
    "nemo_rl/recipes/llm/mopd-qwen3-1.7b-3n8g-megatron-pack.yaml": ("nemo-rl", "OPDAdvantageEstimator", "sampled", "reward", "token", "k1"),
    "slime/run-qwen3-8B-opd.sh": ("slime", "OPD (apply_opd_kl_to_advantages)", "sampled", "reward", "token", "k1"),
    "slime/run-qwen3-8B-opd-megatron.sh": ("slime", "OPD (apply_opd_kl_to_advantages)", "sampled", "reward", "token", "k1"),
    "prime_rl/debug_algo_opd.toml": ("prime-rl", "opd (ref_kl loss)", "sampled", "reward", "token", "k1"),
    "skyrl/run_on_policy_distill_math_qwen3_1.7b.sh": ("skyrl", "OnPolicyDistillationTrainer.apply_reward_kl_penalty", "sampled", "reward", "token", "k1"),
    "skyrl/run_on_policy_distill_math_qwen3_4b.sh": ("skyrl", "OnPolicyDistillationTrainer.apply_reward_kl_penalty", "sampled", "reward", "token", "k1"),
    "roll/qwen3-8B-onpolicy-distill-megatron/onpolicy_distill_config.yaml": ("roll", "OPD (pure): -opd_kl_coef · compute_approx_kl(kl)", "sampled", "reward", "token", "k1"),
    "roll/qwen3-8B-onpolicy-distill-megatron/run_onpolicy_distill_pipeline.sh": ("roll", "OPD (pure): -opd_kl_coef · compute_approx_kl(kl)", "sampled", "reward", "token", "k1"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_frameworks_examples_are_read_as_their_source_says(name):
    framework, term, support, placement, credit, key = EXAMPLES[name]
    r = read(FIELD / name)
    assert r.framework == framework
    (t,) = r.teacher_terms
    assert (t.framework_name, t.support, t.placement, t.credit, t.table_key) == (
        term, support, placement, credit, key,
    )  # fmt: skip
    # what it follows comes from the shipped table, and the section is the term's
    assert registry.teacher_positions(key, placement)
    assert r.teacher_intended and not [f for f in r.findings if f.level == "error"]


def test_every_example_fixture_is_in_the_readme():
    readme = (FIELD / "README.md").read_text()
    for name in EXAMPLES:
        assert Path(name).name in readme, name
    assert "sdpo_trainer.md" in readme and "distillation_trainer.md" in readme
