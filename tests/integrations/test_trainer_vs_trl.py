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
    from klpo.train.config import load_config
    from klpo.train.data.load import load_examples
    from klpo.train.data.sources import PromptStream

    s = bench.Settings(steps=3)
    cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path)))
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (16, 8)
    assert (cfg.algo.epochs, cfg.algo.minibatches, cfg.algo.micro_batch) == (1, 1, 0)
    assert (cfg.kl.estimator, cfg.kl.placement, cfg.kl.beta) == ("k3", "loss", 0.01)
    assert cfg.algo.loss_reduction == "token-mean" and cfg.optim.lr == 2e-4
    assert (cfg.run.eval_every, cfg.run.save_every, cfg.run.threads) == (0, 0, 2)
    assert not cfg.run.tensorboard and not cfg.run.progress
    # TRL's dataset holds exactly the prompts klpo's trainer serves, in its order.
    train, _ = load_examples(cfg)
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


def test_workload_b_is_the_compute_bound_job(bench, tmp_path):
    """(b): the locally built ~23M Llama, 4 × 8 completions of 128 tokens after 64-token prompts."""
    sys.path.insert(0, str(BENCH.parent))
    try:
        import compute_workload as cw
    finally:
        sys.path.remove(str(BENCH.parent))
    from klpo.train.config import load_config
    from klpo.train.data.load import load_examples
    from klpo.train.data.sources import PromptStream
    from klpo.train.models.load import load_tokenizer

    data = cw.write_prompts(tmp_path / "p.jsonl", 12, seed=0)
    s = bench.Settings.for_workload(
        "b", steps=2, model_dir=str(tmp_path / "m"), data_path=str(data)
    )
    assert (s.prompts_per_step, s.group_size, s.max_new_tokens) == (4, 8, 128)
    assert s.completions_per_step == 32
    cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path / "run")))
    assert cfg.data.source == "jsonl" and cfg.rewards[0].name == "compute_workload:lexical_reward"
    train, _ = load_examples(cfg)
    served = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle).next(2 * 4)
    assert bench.prompt_order(s) == [(e.prompt, e.answer) for e in served]
    # the tokenizer of the built model gives each prompt exactly 64 tokens (BOS + 63 words)
    cw.build_model(tmp_path / "m")
    tok = load_tokenizer(str(tmp_path / "m"))
    assert {len(tok(p)["input_ids"]) for p, _ in bench.prompt_order(s)} == {64}
    # the reward by hand: w3 and w99 hit (< 100), w100 and w5000 do not; no words: 0
    assert cw.lexical_reward([""] * 3, ["w3 w100 w99 w5000", "", "w0"], [""] * 3) == [0.5, 0.0, 1.0]
    with pytest.raises(ValueError, match="--workload"):
        bench.Settings.for_workload("c")


def test_runs_combine_by_hand(bench):
    def run(step, tps, reward, se):
        split = {"generate": step / 2, "score": step / 4, "update": step / 4}
        return {
            "steps": 5,
            "median_step_s": step,
            "tokens_per_s": tps,
            "tokens_per_step": 10.0,
            "final_reward": reward,
            "final_reward_se": se,
            "split": split,
            "others_cpu_s": 1.0,
            "process_s": 10.0,
        }

    got = bench.combine([run(1.0, 100, 0.2, 0.03), run(3.0, 90, 0.4, 0.04), run(2.0, 80, 0.3, 0.0)])
    assert got["runs"] == 3 and got["median_step_s"] == 2.0
    assert (got["step_min"], got["step_max"]) == (1.0, 3.0)
    assert got["tokens_per_s"] == 90 and (got["tps_min"], got["tps_max"]) == (80, 100)
    assert got["final_reward"] == pytest.approx(0.3)
    assert got["final_reward_se"] == pytest.approx(0.05 / 3)  # sqrt(0.03² + 0.04²) / 3
    assert got["split"]["generate"] == 1.0 and got["process_s"] == 30.0
    assert "logical CPUs; flags:" in bench.cpu_info()
