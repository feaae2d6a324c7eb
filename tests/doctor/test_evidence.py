"""The frameworks' newest examples, each read by the doctor and checked against the framework's
source at the snapshot it ships in (fixtures/evidence/README.md names each file's origin).

The expected readings are written from the configs and the source, not from the doctor's
output: the arithmetic of each optimiser-step count is in its comment, and the defaults a
config leaves out are the framework's (the lines cited in each reader's module docstring).
docs/frameworks.md's table "The doctor on the frameworks' newest examples" is this table.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo.doctor import diagnose

EVIDENCE = Path(__file__).parent / "fixtures" / "evidence"

# file: (framework, [(estimator, placement, beta)], group size, optimiser steps per batch of
#        rollouts, asynchronous, algorithm, finding kinds at error level)
EXPECTED: dict[str, tuple] = {
    # verl 1dda039 (read with verl 0.9.1's table): low_var_kl in the loss at 0.001; 1024 / 256 = 4.
    "verl/examples/grpo_trainer/run_qwen3_8b_fsdp.sh": ("verl", [("low_var_kl", "loss", 0.001)], 5, 4, False, "grpo", []),
    # GPG: no KL switch on; 1024 / 256 = 4.
    "verl/examples/gpg_trainer/run_qwen3_8b_fsdp.sh": ("verl", [], 5, 4, False, "gpg", []),
    # DPPO (loss_mode dppo_tv) under GRPO, no KL; 256 / 32 = 8; model_engine=megatron a group choice.
    "verl/examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh": ("verl", [], 16, 8, False, "grpo", []),
    # GSPO, no KL; the gpu branch of its `case`: 512 / 128 = 4; ROLLOUT_N 16.
    "verl/examples/gspo_trainer/run_qwen3_8b_fsdp.sh": ("verl", [], 16, 4, False, "grpo", []),
    # OpenRLHF 3c3be62: k2 in the loss at 1e-4; 512 prompts × 16 / 1024 = 8 steps.
    "openrlhf/train_prorlv2_math_hybrid_engine.sh": ("openrlhf", [("k2", "loss", 0.0001)], 16, 8, False, "reinforce_baseline", []),
    # --algo.kl.init_coef 0: no reference, no KL (the estimator and use_loss flags ignored); 128 × 8 / 1024 → 1.
    "openrlhf/train_vlm_math_hybrid_engine.sh": ("openrlhf", [], 8, 1, False, "reinforce_baseline", []),
    # PPO with a critic (gae, the default), k1 in the reward at 0.01; 1024 × 1 / 128 = 8.
    "openrlhf/train_ppo_with_reward_fn.sh": ("openrlhf", [("k1", "reward", 0.01)], 1, 8, False, "gae", []),
    # NeMo-RL 7ea279a: GDPO over grpo_math_1B's k3 × exp(lp − sg lp) (klpo's k3+) at 0.01; 32 × 16 / 512 = 1.
    "nemo_rl/configs/gdpo_math_1B.yaml": ("nemo-rl", [("k3+", "loss", 0.01)], 16, 1, False, "gdpo", []),
    # PPO, reference kept (skip false), k3+ at 0.001; 2048 × 1 / 256 = 8, ppo_epochs 1.
    "nemo_rl/configs/recipes/llm/ppo-dsr1-7b-math-8n8g-megatron.yaml": ("nemo-rl", [("k3+", "loss", 0.001)], 1, 8, False, "gae", []),
    # Parent stage3_rlhf: use_on_policy_kl_approximation, k3 at 1e-4 (klpo's k3_is); 2 × 8 / 16 = 1.
    "nemo_rl/configs/recipes/llm/grpo-qwen3-1.7b-2n8g-megatron-super-rlhf.yaml": ("nemo-rl", [("k3_is", "loss", 0.0001)], 8, 1, False, "grpo", []),
    # slime 624b824: --use-kl-loss with --kl-loss-coef 0.00: no term; 32 × 8 / 256 = 1.
    "slime/run-qwen3-30B-A3B.sh": ("slime", [], 8, 1, False, "grpo", []),
    # Both coefficients 0.00 (no assertion fires: neither is non-zero); 128 × 8 / 1024 = 1.
    "slime/run-glm4.7-30B-A3B.sh": ("slime", [], 8, 1, False, "grpo", []),
    # SkyRL a956457: gae with a critic path, the default KL loss (k3 clamped, 0.001); 1024 / 256 = 4.
    "skyrl/run_ppo.sh": ("skyrl", [("low_var_kl", "loss", 0.001)], 5, 4, False, "gae", []),
    # RLOO with use_kl_loss=false, use_kl_in_reward=true: k3 (clamped) in the reward at kl_loss_coef 0.001.
    "skyrl/run_rloo.sh": ("skyrl", [("low_var_kl", "reward", 0.001)], 5, 4, False, "rloo", []),
    # MaxRL, USE_KL_LOSS defaults to true in the script: the default KL loss.
    "skyrl/run_maxrl_gsm8k.sh": ("skyrl", [("low_var_kl", "loss", 0.001)], 5, 4, False, "maxrl", []),
    "skyrl/run_qwen2_5_0.5b_gsm8k_ppo_lora.sh": ("skyrl", [("low_var_kl", "loss", 0.001)], 5, 4, False, "gae", []),
    # prime-rl 559b447: no group_size anywhere: the default 1 under GRPO's group mean.
    "prime_rl/intellect-3.1_rl.toml": ("prime-rl", [], 1, 1, True, "grpo", ["zero-advantage"]),
    "prime_rl/qwen3-30b-a3b_math.toml": ("prime-rl", [], 1, 1, True, "grpo", ["zero-advantage"]),
    "prime_rl/wiki-search_rl.toml": ("prime-rl", [], 16, 1, True, "grpo", []),
    # AReaL cbff54d: k1 in the reward at 0.001, a batch-normalised REINFORCE; 1 minibatch; 2 versions stale.
    "areal/gsm8k_reinforce.yaml": ("areal", [("k1", "reward", 0.001)], 4, 1, True, "reinforce", []),
    # k2 in the reward; reward_norm's group mean (std_level null): a group baseline.
    "areal/gsm8k_reinforce_baseline.yaml": ("areal", [("k2", "reward", 0.001)], 4, 1, True, "grpo", []),
    # kl_ctl 0; reward_norm's leave-one-out group mean: RLOO.
    "areal/gsm8k_rloo.yaml": ("areal", [], 4, 1, True, "rloo", []),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_newest_example_reading(name):
    d = diagnose(EVIDENCE / name)
    got = (
        d["framework"],
        [(t["estimator"], t["placement"], t["beta"]) for t in d["terms"]],
        d["group_size"],
        d["updates_per_batch"],
        d["asynchronous"],
        d["algorithm"],
        sorted({f["kind"] for f in d["findings"] if f["level"] == "error"}),
    )
    assert got == EXPECTED[name]


def test_the_evidence_covers_twenty_configs_of_seven_frameworks():
    # ROLL's six (test_field.py) and LLaMA-Factory's two (test_rules.py) are read elsewhere.
    assert len(EXPECTED) >= 20
    assert len({v[0] for v in EXPECTED.values()}) >= 7
