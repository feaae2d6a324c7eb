"""The doctor on the frameworks' own example launch scripts and documented configs.

Each fixture in tests/doctor/fixtures/examples is a framework's example (or documented config),
arguments copied as they are written there, with a first comment naming the framework, the
version and the example's path. The expected reading of each is written here from the
frameworks' source at the pinned versions, not from the doctor's output:

- verl 0.9.1: ``kl_penalty`` maps ``kl``/``k1`` to d, ``low_var_kl``/``k3`` to the clamped k3 and a
  ``+`` name to k2's gradient under the base value (``verl/trainer/ppo/core_algos.py``);
  ``use_kl_loss``/``use_kl_in_reward`` default to false, ``kl_loss_coef`` and ``kl_ctrl.kl_coef``
  to 0.001, ``kl_penalty`` to ``kl``, ``ppo_epochs`` to 1, ``ppo_mini_batch_size`` to 256 and
  ``train_batch_size`` to 1024 (the composed ``ppo_trainer.yaml``); the actor takes
  ``ppo_epochs × ceil(train_batch_size / ppo_mini_batch_size)`` optimiser steps per batch, both
  sizes counted in prompts (``dp_actor.update_policy``).
- OpenRLHF: ``--init_kl_coef``/``--algo.kl.init_coef`` 0.01, estimator ``k1``, the KL in the
  reward unless ``use_kl_loss`` (``cli/train_ppo_ray.py``); ``max_epochs × rollout_batch_size ×
  n_samples_per_prompt / train_batch_size`` optimiser steps per rollout batch
  (``trainer/ray/ppo_actor.py``); ``compute_approx_kl`` clamps every value to [-10, 10].
- TRL 1.16: ``beta`` 0 (no KL), ``num_generations`` 8, ``max_completion_length`` 512;
  ``steps_per_generation × num_iterations / gradient_accumulation_steps`` optimiser steps per
  generation (``GRPOConfig.__post_init__``, ``GRPOTrainer._prepare_inputs``).

A flag or key the version's parser or config does not have is an error finding (the framework
refuses it); the reading of everything else must still be right.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from klpo import kl
from klpo.doctor import diagnose
from klpo.doctor.advice import klpo_keys, validate

EX = Path(__file__).parent / "fixtures" / "examples"

# file: (framework, table version, algorithm, [(estimator, placement, beta)], group size,
#        optimiser steps per batch of rollouts, keys of the error findings)
EXPECTED: dict[str, tuple] = {
    # verl GRPO: use_kl_loss, low_var_kl, 0.001; 512 prompts in mini-batches of 128: 4 steps.
    "verl_grpo_qwen2_7b_math.sh": ("verl", "0.9.1", "grpo", [("low_var_kl", "loss", 0.001)], 5, 4, []),
    # LoRA GRPO: 128 / 64 = 2 steps; trainer.use_legacy_worker_impl is not in 0.9.1's config.
    "verl_grpo_lora_qwen3_4b.sh": (
        "verl", "0.9.1", "grpo", [("low_var_kl", "loss", 0.001)], 8, 2,
        ["trainer.use_legacy_worker_impl"],
    ),
    # RLOO: the KL in the reward with kl_penalty=kl (k1), kl_coef 0.001; 1024 / 256 = 4.
    "verl_rloo_qwen2_7b.sh": ("verl", "0.9.1", "rloo", [("k1", "reward", 0.001)], 5, 4, []),
    # Dr. GRPO from the docs: no KL (use_kl_loss false, use_kl_in_reward default false).
    "verl_drgrpo_docs.yaml": ("verl", "0.9.1", "grpo", [], 5, 4, []),
    # k3+ from the docs: the straight-through estimator in the loss.
    "verl_k3plus_docs.yaml": ("verl", "0.9.1", "grpo", [("k3+", "loss", 0.001)], 5, 4, []),
    # klpo's own integration name: klpo:k3+ (defaults 1024 / 256 = 4 steps).
    "verl_klpo_integration.yaml": ("verl", "0.9.1", "grpo", [("k3+", "loss", 0.001)], 5, 4, []),
    # PPO (GAE): neither switch set, both default false: no KL at all; 1024 / 256 = 4.
    "verl_ppo_qwen3_8b_fsdp.sh": ("verl", "0.9.1", "gae", [], 1, 4, []),
    # REINFORCE++: use_kl_in_reward=True with the defaults kl (k1) and 0.001; 1024 / 1024 = 1.
    "verl_reinforce_pp_qwen3_8b.sh": (
        "verl", "0.9.1", "reinforce_plus_plus", [("k1", "reward", 0.001)], 8, 1, [],
    ),
    # ReMax: k1 in the reward, 0.001; 1024 / 256 = 4.
    "verl_remax_qwen3_8b.sh": ("verl", "0.9.1", "remax", [("k1", "reward", 0.001)], 4, 4, []),
    # GSPO: both switches false and both coefficients 0; 512 / 128 = 4.
    "verl_gspo_3b_math.sh": ("verl", "0.9.1", "grpo", [], 16, 4, []),
    # OpenRLHF 0.11 DAPO-style GRPO: k3 in the loss, 1e-3; 128 × 8 / 128 = 8 steps.
    "openrlhf_dapo_grpo_0_11.sh": (
        "openrlhf", "0.11.0", "group_norm", [("low_var_kl", "loss", 0.001)], 8, 8, [],
    ),
    # OpenRLHF 0.11 REINFORCE++ agent: k2 in the loss, 1e-5; 32 × 32 / 1024 = 1.
    "openrlhf_reinforce_agent_0_11.sh": (
        "openrlhf", "0.11.0", "reinforce", [("k2", "loss", 1e-5)], 32, 1, [],
    ),
    # OpenRLHF flat REINFORCE++-baseline: k2 in the loss; 128 × 8 / 1024 = 1. Between releases:
    # no parser has all its flags; 0.9.10's knows the most.
    "openrlhf_reinforce_baseline_0_9.sh": (
        "openrlhf", "0.9.10", "reinforce_baseline", [("k2", "loss", 1e-5)], 8, 1,
        ["--prompt_max_len", "--generate_max_len", "--fsdp2_enable_sleep"],
    ),
    # OpenRLHF flat DAPO-style GRPO: k3 in the loss; 8 steps.
    "openrlhf_dapo_0_9.sh": (
        "openrlhf", "0.9.0", "group_norm", [("low_var_kl", "loss", 0.001)], 8, 8,
        ["--vllm_enable_is_correction"],
    ),
    # OpenRLHF flat PPO: default k1 in the reward, 0.01; 1024 / 128 = 8.
    "openrlhf_ppo_hybrid_0_9.sh": (
        "openrlhf", "0.9.0", "gae", [("k1", "reward", 0.01)], 1, 8, ["--param_dtype"],
    ),
    # OpenRLHF flat GSPO: --init_kl_coef 0: no reference, no KL; 128 × 8 / 128 = 8.
    "openrlhf_gspo_hybrid_0_9.sh": ("openrlhf", "0.9.0", "group_norm", [], 8, 8, []),
    # OpenRLHF flat REINFORCE++: k1 in the reward, 0.01; 1024 / 128 = 8.
    "openrlhf_reinforce_ray_0_9.sh": (
        "openrlhf", "0.9.0", "reinforce", [("k1", "reward", 0.01)], 1, 8, [],
    ),
    # TRL paper index: GSPO (beta 0; steps_per_generation 4 / accumulation 1 = 4 steps).
    "trl_gspo_paper_index.yaml": ("trl-grpo", "1.16.0", "grpo", [], 8, 4, []),
    # DAPO (beta 0, 16 generations, one step per generation).
    "trl_dapo_paper_index.yaml": ("trl-grpo", "1.16.0", "grpo", [], 16, 1, []),
    # Dr. GRPO (beta 0); 1 completion per process per generation, groups of 8: TRL refuses it on
    # one process (GRPOConfig.__post_init__), a warning.
    "trl_drgrpo_paper_index.yaml": ("trl-grpo", "1.16.0", "grpo", [], 8, 1, []),
    # Lite PPO: 8 micro-steps per generation, 32 per optimiser step: under one step each.
    "trl_lite_ppo_paper_index.yaml": ("trl-grpo", "1.16.0", "grpo", [], 8, 1, []),
}  # fmt: skip


def _errors(d):
    return sorted(k for f in d["findings"] if f["level"] == "error" for k in f["keys"])


def _reading(d):
    return (
        d["framework"],
        d["defaults_version"],
        d["algorithm"],
        [(t["estimator"], t["placement"], t["beta"]) for t in d["terms"]],
        d["group_size"],
        d["updates_per_batch"],
        _errors(d),
    )


def test_every_example_has_a_reading_and_a_source_line():
    files = sorted(p.name for p in EX.iterdir())
    assert files == sorted(EXPECTED)
    assert len(files) >= 20
    for name in files:
        first = next(
            ln
            for ln in (EX / name).read_text().splitlines()
            if ln.startswith("#") and "!" not in ln
        )
        assert any(fw in first for fw in ("verl", "OpenRLHF", "TRL", "klpo")), name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_reading(name):
    d = diagnose(EX / name)
    fw, version, algo, terms, group, steps, errors = EXPECTED[name]
    assert _reading(d) == (fw, version, algo, terms, group, steps, sorted(errors))
    # Each term's statement is klpo.kl.explain's for the estimator read.
    for t in d["terms"]:
        assert t["on_policy"] == kl.explain(t["estimator"], t["placement"]).to_dict()
    # The "same thing" config is a valid klpo config and carries only klpo's keys.
    eq = d["equivalent"]
    assert eq["invalid"] is None, eq["invalid"]
    assert d["intended"]["invalid"] is None


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_equivalent_carries_the_run(name, tmp_path):
    """The equivalent config holds the model, learning rate, batch and lengths the script set,
    reproduces an uncorrected off-policy KL loss, and reads back to the same terms."""
    d = diagnose(EX / name)
    flat = _flat(d["equivalent"]["config"])
    assert set(flat) <= klpo_keys()
    assert "optim.lr" in flat and flat["rollout.prompts_per_step"] > 0
    loss = [t for t in d["terms"] if t["placement"] == "loss"]
    if loss and not loss[0]["corrected"] and loss[0]["estimator"] != "k3_is":
        assert flat["kl.off_policy_correction"] is False
    else:
        assert "kl.off_policy_correction" not in flat
    cfg = tmp_path / "klpo.yaml"
    cfg.write_text(yaml.safe_dump(d["equivalent"]["config"]))
    back = diagnose(cfg)
    key = lambda t: (t["estimator"], t["placement"], t["beta"])  # noqa: E731
    assert [key(t) for t in back["terms"]] == [key(t) for t in d["terms"]]
    assert back["updates_per_batch"] == d["updates_per_batch"]


def test_carried_settings_are_the_scripts():
    d = diagnose(EX / "verl_grpo_lora_qwen3_4b.sh")
    flat = _flat(d["equivalent"]["config"])
    assert flat["model.policy"] == "Qwen/Qwen3-4B"
    assert (flat["model.lora.r"], flat["model.lora.alpha"]) == (32, 64)
    assert (flat["optim.lr"], flat["rollout.prompts_per_step"]) == (1.0e-5, 128)
    assert (flat["rollout.max_new_tokens"], flat["data.max_prompt_tokens"]) == (1024, 1024)
    assert "trainer.n_gpus_per_node" in d["equivalent"]["unmapped"]
    d = diagnose(EX / "openrlhf_dapo_grpo_0_11.sh")
    flat = _flat(d["equivalent"]["config"])
    assert flat["model.policy"] == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert (flat["optim.lr"], flat["rollout.prompts_per_step"]) == (5e-7, 128)
    assert flat["data.prompt_field"] == "context_messages" and flat["data.chat"] is True
    d = diagnose(EX / "trl_dapo_paper_index.yaml")
    flat = _flat(d["equivalent"]["config"])
    assert (flat["algo.clip_low"], flat["algo.clip_high"]) == (0.2, 0.28)
    assert flat["rollout.max_new_tokens"] == 20480


def test_straight_through_says_k2s_gradient_only():
    """verl's k3+ has k2's gradient everywhere: no "where no clamp binds, as k3" line."""
    from typer.testing import CliRunner

    from klpo.cli import app

    out = CliRunner().invoke(app, ["doctor", str(EX / "verl_k3plus_docs.yaml")]).output
    assert "klpo `k3+` in the loss" in out
    assert "on-policy: grad KL(pi_theta ‖ pi_ref)" in out
    assert "where no clamp binds" not in out
    assert "the gradient is never zeroed (straight-through)" in out


def test_remax_credit_is_returns_to_go_minus_the_greedy_baseline():
    d = diagnose(EX / "verl_remax_qwen3_8b.sh")
    [t] = d["terms"]
    assert "returns-to-go" in t["reduction"] and "greedy" in t["reduction"]
    assert d["group_scaling"] is None


def test_zero_coefficients_are_not_set_but_ignored():
    d = diagnose(EX / "verl_gspo_3b_math.sh")
    assert not [f for f in d["findings"] if "set but ignored" in f["text"]]
    assert d["terms"] == []


def test_variables_given_on_the_command_line():
    """The REINFORCE++ example names its baseline variant through ADV_ESTIMATOR."""
    d = diagnose(
        EX / "verl_reinforce_pp_qwen3_8b.sh",
        variables={"ADV_ESTIMATOR": "reinforce_plus_plus_baseline"},
    )
    assert d["algorithm"] == "reinforce_plus_plus_baseline"
    assert "group" in d["group_scaling"]


def test_named_version_reads_the_flags_that_version_has():
    # The 0.11.0 script under 0.11.2: is_correction_enable was replaced by is_correction_level.
    d = diagnose(EX / "openrlhf_dapo_grpo_0_11.sh", version="0.11.2")
    assert _errors(d) == ["--algo.advantage.is_correction_enable"]
    assert [(t["estimator"], t["placement"]) for t in d["terms"]] == [("low_var_kl", "loss")]
    # Grouped flags under a flat-flag version: every grouped flag is refused, with its flat name.
    d = diagnose(EX / "openrlhf_dapo_grpo_0_11.sh", version="0.9.0")
    texts = " ".join(f["text"] for f in d["findings"] if f["level"] == "error")
    assert "--algo.kl.init_coef: no such flag in OpenRLHF 0.9.0" in texts
    assert "spells it --init_kl_coef" in texts
    assert d["terms"][0]["beta"] == 0.01  # the grouped value is refused: the flat default


def test_labels_use_the_scripts_spelling():
    d = diagnose(EX / "openrlhf_dapo_grpo_0_11.sh")
    [t] = d["terms"]
    assert t["option"] == "--algo.kl.use_loss, --algo.kl.estimator k3"
    assert t["beta_option"] == "--algo.kl.init_coef"
    d = diagnose(EX / "openrlhf_dapo_0_9.sh")
    assert d["terms"][0]["option"] == "--use_kl_loss, --kl_estimator k3"


def test_every_example_validates_as_klpo():
    for name in EXPECTED:
        d = diagnose(EX / name)
        assert validate(d["equivalent"]["config"]) is None, name
