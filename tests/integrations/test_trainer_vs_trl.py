"""The non-timing helpers of ``bench/trainer_vs_trl.py`` (and ``trainer_parts.py``'s table):
summaries by hand, the two configs, the five workloads, the peak RSS of a worker.

The summaries and klpo's config run everywhere; the TRL config needs TRL (peer, skipped without).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "trainer_vs_trl.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    try:
        yield _load("trainer_vs_trl")
    finally:
        sys.modules.pop("trainer_vs_trl", None)


@pytest.fixture(scope="module")
def cw():
    try:
        yield _load("compute_workload")
    finally:
        sys.modules.pop("compute_workload", None)


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


def test_workload_b_is_the_compute_bound_job(bench, cw, tmp_path):
    """(b): the locally built ~23M Llama, 4 × 8 completions of 128 tokens after 64-token prompts."""
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
        bench.Settings.for_workload("f")


def _run(step, tps, reward, se, rss=100.0):
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
        "peak_rss_mib": rss,
    }


def test_runs_combine_by_hand(bench):
    run = _run
    got = bench.combine(
        [run(1.0, 100, 0.2, 0.03, 500), run(3.0, 90, 0.4, 0.04, 700), run(2.0, 80, 0.3, 0.0, 600)]
    )
    assert got["runs"] == 3 and got["median_step_s"] == 2.0
    assert (got["step_min"], got["step_max"]) == (1.0, 3.0)
    assert got["tokens_per_s"] == 90 and (got["tps_min"], got["tps_max"]) == (80, 100)
    assert got["final_reward"] == pytest.approx(0.3)
    assert got["final_reward_se"] == pytest.approx(0.05 / 3)  # sqrt(0.03² + 0.04²) / 3
    assert got["split"]["generate"] == 1.0 and got["process_s"] == 30.0
    assert got["peak_rss_mib"] == 700  # the side's largest process


def test_runs_table_gives_the_ratios(bench):
    """klpo / TRL: tokens/s 300 / 200 = 1.50; peak RSS 500 / 1000 = 0.50; step / floor 1 / 0.8."""
    klpo = bench.combine([_run(1.0, 300, 0.2, 0.0, 500)])
    trl = bench.combine([_run(2.0, 200, 0.1, 0.0, 1000)])
    trl["version"] = "1.16.0"
    floor = {"floor": 0.8, "generate": 0.4, "reference": 0.1, "policy": 0.3}
    table = bench.runs_table(klpo, trl, floor)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()}
    assert "| 500 | 1.25 |" in rows["klpo"] and "| 1000 | 2.50 |" in rows["TRL 1.16.0"]
    assert "**1.50**" in rows["klpo / TRL"] and "**0.50**" in rows["klpo / TRL"]
    cells = [len(line.split("|")) for line in table.splitlines()]
    assert len(set(cells)) == 1  # every row has the header's columns


def test_run_worker_reports_the_childs_own_peak_rss(bench):
    """A child that touches 200 MiB peaks at 200 MiB plus the interpreter's ~10-30 (the wrapper
    imports only the standard library), not plus this process's own hundreds of MiB."""
    touch = "b = bytearray(200 * 2**20); b[:: 4096] = b'x' * len(b[:: 4096])"
    got = bench.run_worker([sys.executable, "-c", touch], 1, "the child")
    assert 200 <= got["peak_rss_mib"] < 260
    small = bench.run_worker([sys.executable, "-c", "pass"], 1, "the child")
    assert small["peak_rss_mib"] < 60  # its own, not the last child's nor this process's
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass"
    busy = bench.run_worker([sys.executable, "-c", spin], 1, "the child")
    assert 0.5 <= busy["cpu_s"] < 0.5 + busy["process_s"] and small["cpu_s"] < 0.5  # its own CPU
    with pytest.raises(RuntimeError, match="the child failed"):
        bench.run_worker([sys.executable, "-c", "raise SystemExit(3)"], 1, "the child")


def test_workloads_parse(bench):
    assert bench.parse_workloads("both") == ("a", "b")
    assert bench.parse_workloads("all") == ("a", "b", "c", "d", "e")
    assert bench.parse_workloads("real") == ("d", "e")
    assert bench.parse_workloads("c") == ("c",) and bench.parse_workloads("a, c") == ("a", "c")
    with pytest.raises(SystemExit, match="--workload takes a, b, c, d, e"):
        bench.parse_workloads("a,x")


def test_workload_c_is_the_real_vocabulary_job(bench, cw, tmp_path):
    """(c): (b)'s job on a Llama with Qwen2.5's vocabulary size, 151,936, hidden 512, 8 layers."""
    import torch
    from transformers import LlamaForCausalLM

    from klpo.train.config import load_config

    data = cw.write_prompts(tmp_path / "p.jsonl", 8, seed=0, workload="c")
    s = bench.Settings.for_workload("c", steps=2, model_dir="m", data_path=str(data))
    assert (s.prompts_per_step, s.group_size, s.max_new_tokens) == (4, 8, 128)
    cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path / "run")))
    assert cfg.rewards[0].name == "compute_workload:lexical_reward_c"
    shape = cw.SHAPES["c"]
    model_cfg = cw.model_config(shape)
    assert model_cfg.vocab_size == 151936
    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(model_cfg).parameters())
    # by hand: the tied embedding V·H, per layer q, k, v, o (8 heads of 64: H² each), the MLP's
    # three H·I and two norms, and the final norm
    h, i = 512, 1408
    assert n == 151936 * h + 8 * (4 * h * h + 3 * h * i + 2 * h) + h  # 103,490,048
    tok = cw.build_tokenizer(shape)
    assert len(tok) == 151936 and tok.convert_tokens_to_ids("w151932") == 151935
    assert {len(tok(p)["input_ids"]) for p, _ in bench.prompt_order(s)} == {64}
    # the reward by hand: w0 and w1799 hit (< 1800), w1800 and w151932 do not
    got = cw.lexical_reward_c([""] * 2, ["w0 w1800 w1799 w151932", "w5"], [""] * 2)
    assert got == [0.5, 1.0]


def test_trainer_parts_table_by_hand(bench):
    """Each klpo part over its floor part; the step over the floor; the micro-step on / off."""
    path = list(sys.path)
    try:
        parts = _load("trainer_parts")  # it puts bench/ on sys.path
    finally:
        sys.modules.pop("trainer_parts", None)
        sys.path[:] = path
    ms = {
        "floor: generate": [10.0, 12.0, 11.0],
        "klpo: generate": [11.0],
        "floor: reference": [5.0],
        "klpo: score": [6.0],
        "floor: policy": [20.0],
        "klpo: micro_step": [18.0],
        "klpo: micro_step, per-token path": [24.0],
        "klpo: update": [22.0],
    }
    table = parts.parts_table(ms)
    assert "| floor: generate | 11.0 (10.0–12.0) |  |" in table
    assert "| klpo: generate | 11.0 (11.0–11.0) | 1.00 |" in table
    assert "| klpo: update | 22.0 (22.0–22.0) | 1.10 |" in table
    assert "39.0 ms, floor 36.0 ms: 1.08x" in table  # (11 + 6 + 22) / (11 + 5 + 20)
    assert "18.0 ms on, 24.0 off: 0.75x" in table
    alone = parts.parts_table({"klpo: score": [1.0]})  # no floor part: no ratio, no total
    assert "| klpo: score | 1.0 (1.0–1.0) |  |" in alone and "x" not in alone.split("\n")[-1]
    assert "logical CPUs; flags:" in bench.cpu_info()


@pytest.mark.slow
def test_trainer_parts_cpu_time_logs_each_call():
    """``--cpu-time`` on workload (a), micro-steps only: every call of every round is logged as it
    ends (warm-ups marked), the table counts the timed rounds, the on / off line is there."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(BENCH.parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(BENCH.parent / "trainer_parts.py"), "--threads", "1", "--cpu-time",
           "--warmups", "1", "--reps", "2", "--only", "micro_step"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    calls = [ln for ln in proc.stderr.splitlines() if ln.startswith("round ")]
    assert len(calls) == 6, calls  # 3 rounds × 2 parts
    assert sum("(warm-up)" in ln for ln in calls) == 2 and calls[-1].endswith(" ms")
    assert "CPU milliseconds, 2 timed rounds" in proc.stdout
    assert "| klpo: micro_step, per-token path |" in proc.stdout
    assert "forward-pass gradient: micro-step" in proc.stdout


def test_floor_head_in_chunks_is_the_one_pass_gradient(bench, monkeypatch):
    """The floor's head in chunks of rows gives the one-pass masked log-prob sum's gradients,
    into the head and through the hidden states into the body. Both take the log-softmax of
    float32 logits (the floor's), so they agree to float32 rounding of sums of a few terms."""
    from types import SimpleNamespace

    import torch

    gen = torch.Generator().manual_seed(0)
    b, c, h, v = 5, 3, 4, 7
    x = torch.randn(b, c, h, generator=gen, dtype=torch.float64)
    body = torch.randn(h, h, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64, requires_grad=True)
    ro = SimpleNamespace(
        completion_ids=torch.randint(0, v, (b, c), generator=gen),
        mask=(torch.rand(b, c, generator=gen) > 0.3).double(),
    )
    logits = (x @ body @ weight.T).float()
    logp = torch.log_softmax(logits, -1).gather(-1, ro.completion_ids[..., None])
    want = torch.autograd.grad((logp.squeeze(-1) * ro.mask).sum(), (body, weight))
    monkeypatch.setattr(bench, "FLOOR_LOGITS", 2 * c * v)  # chunks of 2 rows: 2, 2, 1
    bench.floor_head(x @ body, weight, ro, backward=True)
    torch.testing.assert_close(body.grad, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad, want[1], rtol=1e-6, atol=1e-6)
    assert body.grad.abs().max() > 0.1  # (the gradients are not all but zero)


@pytest.fixture(scope="module")
def real(bench):
    try:
        yield bench.real_workload()
    finally:
        sys.modules.pop("real_workload", None)


def test_workloads_d_e_are_the_real_model_jobs(bench, real, tmp_path):
    """(d): SmolLM2's chat job, 2 × 4 completions of 48 tokens, the numeric reward; (e): Gemma's
    plain prompts, 2 × 4 of 32, the first number. TRL gets the same problems in the same order:
    (d) as one user message each (TRL renders it with the template), (e) as the same strings."""
    from klpo.train.config import load_config
    from klpo.train.data.load import load_examples
    from klpo.train.data.sources import PromptStream

    for w, chat, reward, new in (("d", True, "numeric", 48), ("e", False, "first_number", 32)):
        data = real.write_prompts(tmp_path / f"{w}.jsonl", 12, seed=0, workload=w)
        s = bench.Settings.for_workload(w, steps=3, model_dir="m", data_path=str(data))
        assert (s.prompts_per_step, s.group_size, s.max_new_tokens) == (2, 4, new)
        cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path / f"run-{w}")))
        assert cfg.data.chat is chat and cfg.data.max_prompt_tokens == 128
        assert cfg.rewards[0].name.endswith(reward) and cfg.model.policy == "m"
        train, _ = load_examples(cfg)
        served = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle).next(3 * 2)
        assert bench.prompt_order(s) == [(e.prompt, e.answer) for e in served]
        got = bench.trl_prompts(s)
        assert len(got) == 6
        if chat:
            want = [[{"role": r, "content": c} for r, c in e.messages] for e in served]
            assert got == want and got[0][0]["content"].endswith(real.WORKING)
        else:
            assert got == [e.prompt for e in served] and got[0].startswith("Question: ")
            assert got[0].endswith("\nAnswer:")
    # the first problem of the chat task's train split (its held-out one skipped), by hand from
    # ChatArithmeticTask(n_heldout=1, n_train=2).problems()
    from klpo.train.data.chat_task import ChatArithmeticTask

    _, q, a = ChatArithmeticTask(n_heldout=1, n_train=2, seed=0).problems()[1]
    assert real.prompts(1, 0, "e") == [{"prompt": f"Question: {q}\nAnswer:", "answer": str(a)}]
    with pytest.raises(ValueError, match="real workloads are d, e"):
        real.prompts(1, 0, "b")


def test_first_number_reward_by_hand(real):
    got = real.first_number(
        [""] * 5,
        [" 85\n\nQuestion: What is 2 + 3?\nAnswer: 5", " 58", " it is -3 or 7", "", " 12 then 85"],
        ["85", "85", "-3", "1", "85"],
    )
    assert got == [1.0, 0.0, 1.0, 0.0, 0.0]


@pytest.mark.real
@pytest.mark.parametrize("w", ["d", "e"])
def test_real_prompts_are_the_ids_trl_gives(bench, real, w, tmp_path, request):
    """klpo's rendered prompts through the run's codec are the token ids TRL's GRPOTrainer gives
    the same prompts: (d) ``apply_chat_template(conversations, add_generation_prompt=True,
    tokenize=True, return_dict=True)``, the template's special tokens once; (e) the tokenizer's
    own (Gemma: a BOS), as TRL 1.16's ``GRPOTrainer._tokenize_prompts`` does."""
    from klpo.train.config import load_config
    from klpo.train.models.load import load_tokenizer
    from klpo.train.models.tokens import run_codec

    model = request.getfixturevalue("smollm2_dir" if w == "d" else "gemma3_dir")
    data = real.write_prompts(tmp_path / "p.jsonl", 8, seed=0, workload=w)
    s = bench.Settings.for_workload(w, steps=1, model_dir=str(model), data_path=str(data))
    cfg = load_config(None, bench.klpo_overrides(s, str(tmp_path / "run")))
    tok = load_tokenizer(str(model))
    texts, answers = bench.rendered_prompts(s, tok)
    got = run_codec(cfg, tok, model).ids(texts)
    prompts = bench.trl_prompts(s)
    if w == "d":  # as TRL's _tokenize_prompts calls it on a batch of conversations
        want = tok.apply_chat_template(
            conversation=prompts, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        assert "<|im_start|>assistant" in texts[0]
    else:
        want = tok(prompts)["input_ids"]
        assert got[0][0] == tok.bos_token_id and got[0][1] != tok.bos_token_id
    assert got == want and len(got) == 2
    assert answers == [a for _, a in bench.prompt_order(s)]


def _rollout(group: int = 2):
    """4 rows in groups of 2: prompts of 3 and 1 real tokens (left-padded to 3), completions of
    2, 4, 1 and 4 tokens (right-padded to 4)."""
    import torch

    from klpo.train.rollout.samplers import Rollout

    prompt_mask = torch.tensor([[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1]]).bool()
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]).bool()
    return Rollout(
        prompt_ids=torch.arange(12).view(4, 3) * prompt_mask + 1,
        prompt_mask=prompt_mask,
        completion_ids=torch.arange(16).view(4, 4) + 20,
        mask=mask,
        prompts=["a", "a", "b", "b"],
        completions=[""] * 4,
        answers=[""] * 4,
        group_size=group,
    )


def test_layouts_count_what_the_forwards_compute(bench):
    """The positions of each layout against the tensors the forwards are given: the padded rows'
    input_ids, the packs that :func:`packing.pack` builds from the trainer's own plan, and by
    hand the shared prompt's (one prompt row a group, every completion row)."""
    import dataclasses

    from klpo.train.models import packing
    from klpo.train.rollout.samplers import pack_rows

    ro = pack_rows(_rollout(), True)
    rec = bench.layout_record(ro)
    assert rec["prompt_len"] == [3, 3, 1, 1] and rec["completion_len"] == [2, 4, 1, 4]
    assert (rec["prompt_cols"], rec["completion_cols"], rec["group"]) == (3, 4, 2)
    got = bench.layout_slots(rec)
    packed = packing.pack(ro.input_ids, ro.attention_mask, ro.packs)
    assert got["packed"] == (packed.input_ids.numel(), int(packed.real.sum()))  # (21, 19)
    assert got["rows"] == (ro.input_ids.numel(), int(ro.attention_mask.sum()))  # (28, 19)
    # shared: prompt rows 0 and 2, 3 columns each, then 4 completion rows of 4 columns: 6 + 16;
    # real: 3 + 1 prompt tokens and 2 + 4 + 1 + 4 completion tokens
    assert got["shared"] == (22, 15)
    # padded rows: pads 28 - 19 = 9; packed filler 21 - 19 = 2: 7 of 9 removed
    pads = bench.pad_summary([rec, rec], "packed")
    assert pads["pad_removed"] == pytest.approx(7 / 9) and pads["positions"] == 21
    assert bench.pad_summary([rec], "shared")["pad_share"] == pytest.approx(1 - 15 / 22)
    assert "pad_removed" not in bench.pad_summary([rec], "rows")
    assert "packed" not in bench.layout_slots(bench.layout_record(_rollout()))  # not packed
    # the digest reads the sampled tokens, not the padding after them
    after_stop = ro.completion_ids.clone()
    after_stop[0, 3] = 99  # row 0 stops after 2 tokens
    inside = ro.completion_ids.clone()
    inside[0, 1] = 99
    digest = [
        bench.layout_record(dataclasses.replace(ro, completion_ids=ids))["tokens_sha1"]
        for ids in (after_stop, inside)
    ]
    assert digest[0] == rec["tokens_sha1"] != digest[1]
    with pytest.raises(ValueError, match="not whole groups of 3"):
        bench.layout_slots({**rec, "group": 3})


def test_bench_docstring_examples(bench):
    import doctest

    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    names = ("layout_slots", "pad_summary", "first_step_difference")
    for name in names:
        for test in doctest.DocTestFinder().find(getattr(bench, name), name, globs=vars(bench)):
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted >= 6


def test_packing_table_and_notes_by_hand(bench):
    """Packed 1.0 s and 300 tokens/s against padded 2.0 s / 200 and TRL 4.0 s / 100: step
    ratios 0.50 and 0.25, tokens/s 1.50 and 3.00; the pad shares from the layouts; the step-1
    check tells the same tokens and metrics from different ones."""
    rec = {"group": 2, "prompt_len": [3, 3, 1, 1], "completion_len": [2, 4, 1, 4],
           "prompt_cols": 3, "completion_cols": 4, "packs": 3, "width": 7}  # fmt: skip
    padded = {k: v for k, v in rec.items() if k not in ("packs", "width")}

    def side(step, tps, layout, first, sha="x"):
        r = {**_run(step, tps, 0.0, 0.0), "layouts": [layout], "first_step": first}
        return {**bench.combine([r]), "first_step_sha1": sha}

    first = {"loss/total": 1.0, "kl/ref/k3": 0.0, "time/step": 1.0}
    sides = {
        "klpo": side(2.0, 200, padded, first),
        "klpo packed": side(1.0, 300, rec, {**first, "loss/total": 1.00000001}),
        "klpo padded, prompt per row": side(2.5, 150, padded, {**first, "loss/total": 1.1}, "y"),
    }
    trl = {**bench.combine([{**_run(4.0, 100, 0.0, 0.0), "lengths": [4, 1, 7]}])}
    trl["version"] = "1.16.0"
    table = bench.packing_table(sides, trl)
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()}
    assert "| 1 / 3 / 4 | 22 | 31.8% |" in rows["klpo"]  # 1 - 15 / 22
    assert "| 21 | 9.5% |" in rows["klpo packed"]  # 1 - 19 / 21
    assert "| 28 | 32.1% |" in rows["klpo padded, prompt per row"]  # 1 - 19 / 28
    assert "| 1 / 4 / 7 | n/a (padded rows) | n/a |" in rows["TRL 1.16.0"]
    assert "| 0.50 | **1.50** |" in rows["packed / klpo"]
    assert "| 0.40 | **2.00** |" in rows["packed / klpo padded, prompt per row"]
    assert "| 0.25 | **3.00** |" in rows["packed / TRL 1.16.0"]
    assert len({len(line.split("|")) for line in table.splitlines()}) == 1
    notes = bench.packing_notes(sides)
    assert notes[0].startswith("Packing removed 77.8% of the pad tokens")  # 7 of 9
    assert "klpo packed against klpo: the same sampled tokens; metrics the same" in notes[1]
    assert "(largest relative difference 1.0e-08, loss/total)" in notes[1]
    assert "DIFFERENT sampled tokens; metrics NOT the same" in notes[2]
    assert bench.lengths_text([]) == "n/a" and bench.lengths_text([3, 1, 2, 8]) == "1 / 2.5 / 8"


def test_trainer_parts_packing_lines_by_hand(bench):
    """``--packing``: packed over padded for score and micro-step, and the batch's layouts."""
    path = list(sys.path)
    try:
        parts = _load("trainer_parts")
    finally:
        sys.modules.pop("trainer_parts", None)
        sys.path[:] = path
    ms = {
        "klpo: score": [10.0],
        "klpo: score, packed": [8.0],
        "klpo: score, prompt per row": [16.0],
        "klpo: micro_step": [30.0],
        "klpo: micro_step, packed": [33.0],
    }
    table = parts.parts_table(ms)
    assert (
        "score 8.0 ms packed, 10.0 padded (prompt shared): 0.80x; prompt per row 16.0: 0.50x"
        in (table)
    )
    assert "micro_step 33.0 ms packed, 30.0 padded (prompt shared): 1.10x\n" in table + "\n"
    rec = {"group": 2, "prompt_len": [3, 3, 1, 1], "completion_len": [2, 4, 1, 4],
           "prompt_cols": 3, "completion_cols": 4, "packs": 3, "width": 7}  # fmt: skip
    line = parts.packing_lines(rec)
    assert "completion lengths 1 / 3 / 4" in line
    assert "padded, prompt shared 22 (31.8% pad), padded, prompt per row 28 (32.1% pad)" in line
    assert "packed (3 packs of 7) 21 (9.5% pad); packing removes 77.8%" in line
