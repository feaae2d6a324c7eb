"""The non-timing helpers of ``bench/trainer_vs_trl.py``: summaries by hand, the two configs.

The summaries and klpo's config run everywhere; the TRL config needs TRL (peer, skipped without).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "trainer_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trainer_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_summaries_by_hand(bench):
    step_s = [1.0, 0.5, 0.25, 0.5, 1.0]
    tokens = [100, 200, 100, 100, 300]
    rewards = [0.0, 0.1, 0.2, 0.3, 0.5]
    got = bench.summarize(step_s, tokens, rewards)
    assert got["median_step_s"] == 0.5  # sorted: 0.25 0.5 0.5 1.0 1.0
    # Steps 2..5: 200 / 0.5, 100 / 0.25, 100 / 0.5, 300 / 1 = 400, 400, 200, 300; median 350.
    assert got["tokens_per_s"] == 350.0
    assert got["tokens_per_step"] == 160.0  # 800 / 5
    assert got["final_reward"] == 0.5  # the last ceil(0.2 · 5) = 1 step
    assert bench.final_mean([0.0] * 8 + [0.25, 0.75]) == 0.5  # last 2 of 10: (0.25 + 0.75) / 2
    assert bench.final_mean([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == pytest.approx(0.55)  # ceil 1.2 = 2
    # sd of (0.5, 0.6) = sqrt(0.005) = 0.0707107; / sqrt(2) = 0.05.
    assert bench.final_se([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == pytest.approx(0.05, rel=1e-12)
    assert bench.final_se([0.3]) == 0.0
    one = bench.summarize([2.0], [10], [1.0])  # a single step is its own throughput
    assert one["tokens_per_s"] == 5.0
    with pytest.raises(ValueError, match="one step time, token count and reward per step"):
        bench.summarize([1.0, 2.0], [1], [0.0, 1.0])


def test_klpo_config_is_the_job_with_overhead_off(bench, tmp_path):
    from klpo.train import loop
    from klpo.train.config import load_config
    from klpo.train.data import PromptStream

    s = bench.Settings(steps=3)
    cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path)))
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (16, 8)
    assert (cfg.algo.epochs, cfg.algo.minibatches, cfg.algo.micro_batch) == (1, 1, 0)
    assert (cfg.kl.estimator, cfg.kl.placement, cfg.kl.beta) == ("k3", "loss", 0.01)
    assert cfg.algo.loss_reduction == "token-mean" and cfg.optim.lr == 2e-4
    assert (cfg.run.eval_every, cfg.run.save_every, cfg.run.threads) == (0, 0, 2)
    assert not cfg.run.tensorboard and not cfg.run.progress
    # TRL's dataset holds exactly the prompts klpo's trainer serves, in its order.
    train, _ = loop.load_examples(cfg)
    served = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle).next(3 * 16)
    assert bench.prompt_order(s) == [(e.prompt, e.answer) for e in served]


@pytest.mark.peer
def test_trl_config_is_the_same_job(bench, tmp_path):
    trl = pytest.importorskip("trl")
    from klpo.integrations.trl import LOSS_TYPE_MODES

    s = bench.Settings(steps=3)
    args = trl.GRPOConfig(**bench.trl_config_kwargs(s, str(tmp_path)))
    assert (args.generation_batch_size, args.steps_per_generation, args.num_iterations) == (
        128,
        1,
        1,
    )
    assert args.num_generations == 8 and args.gradient_accumulation_steps == 1
    assert args.beta == 0.01 and args.use_bias_correction_kl is False  # plain k3
    assert LOSS_TYPE_MODES[args.loss_type] == "token-mean"
    assert args.learning_rate == 2e-4 and str(args.lr_scheduler_type.value) == "constant"
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False
    assert (args.temperature, args.top_p, args.top_k, args.max_completion_length) == (
        1.0,
        1.0,
        0,
        4,
    )
    assert args.shuffle_dataset is False and args.max_steps == 3
