"""The real-model over-optimisation study (`klpo compare --task chat-overopt`): its preset and
grid, the Gemma study file over the chat-arith preset, the report's frontiers against hand
values, and one run end to end on a 1-layer model with SmolLM2's tokenizer (the real tier; the
chat-arith study's own test covers the runner, resuming and the problem-by-problem table)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from klpo.study import spec
from klpo.study.grid import Run, study_grid
from klpo.study.report import write_results
from klpo.study.runner import run_study
from klpo.study.spec import (
    CHAT_OVEROPT_BETAS,
    Choice,
    chat_overopt_study,
    load_study,
    quick_chat_overopt_study,
)
from klpo.study.summary import Criteria, summarise_run
from klpo.train.config import apply_overrides, build_config
from klpo.train.rewards.gold import eval_reward

ROOT = Path(__file__).resolve().parents[2]
LABELS = ["no KL", "k1 reward", "k3 loss", "full loss"]


def test_the_preset_trains_on_the_proxy_and_sweeps_beta(tmp_path):
    study = chat_overopt_study(model=str(tmp_path))
    runs = study_grid(study)
    cells = {(r.choice, r.beta) for r in runs}
    assert cells == {("no KL", 0.0)} | {(c, b) for c in LABELS[1:] for b in CHAT_OVEROPT_BETAS}
    assert len(runs) == 10 * 3 and study.seeds == [0, 1, 2]
    assert CHAT_OVEROPT_BETAS == [0.05, 0.2, 0.8]
    assert list(dict.fromkeys(r.choice for r in runs)) == LABELS
    for r in runs:
        cfg = build_config(apply_overrides({}, list(r.overrides)))
        assert cfg.data.source == "builtin-chat-arith" and cfg.data.chat
        assert [t.name for t in cfg.rewards] == ["chat_overopt_proxy"]
        assert cfg.gold_reward == "chat_overopt_gold" == eval_reward(cfg)  # held-out: gold
        assert cfg.rollout.max_new_tokens == 24
        # The chat-arith preset's budget and model keys.
        assert cfg.model.policy == str(tmp_path) and cfg.model.lora.r == 16
        assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (2, 4)
        assert cfg.optim.lr == 3e-4 and cfg.run.steps == 24 and cfg.run.eval_every == 12
        assert cfg.data.eval_size == 100 and cfg.run.log_samples >= cfg.data.eval_size
        assert (cfg.kl.estimator, cfg.kl.placement, cfg.kl.beta) == (
            r.estimator,
            r.placement,
            r.beta,
        )
    assert study.over_optimisation and study.chat
    assert study.convergence_target() == ("reward/gold", study.target_gold)
    quick = quick_chat_overopt_study(model=str(tmp_path))
    assert (quick.steps, quick.eval_every, quick.seeds, quick.eval_size) == (2, 2, [0], 8)
    assert quick.betas == [0.05, 0.8] and [c.label for c in quick.choices] == LABELS
    assert len(study_grid(quick)) == 7
    assert load_study(task="chat-overopt") == chat_overopt_study()
    assert load_study(task="chat-overopt", quick=True) == quick_chat_overopt_study()


def test_the_gemma_study_file_changes_one_train_key_of_the_preset(monkeypatch, tmp_path):
    """configs/studies/real-gemma.yaml on the chat-arith preset: gemma3, three cells, and
    `base: {data.chat: false}` merged into the preset's train keys (LoRA, 12 tokens, lr kept)."""
    import klpo.train.tools.real_models as real_models

    monkeypatch.setattr(real_models, "real_model_dir", lambda key: tmp_path / key)
    study = load_study(ROOT / "configs" / "studies" / "real-gemma.yaml", task="chat-arith")
    assert study.model == "gemma3"
    assert [c.label for c in study.choices] == ["no KL", "k3 loss", "full loss"]
    assert study.base == {**spec.REAL_TRAIN_KEYS, "data.chat": False}
    for r in study_grid(study):
        cfg = build_config(apply_overrides({}, list(r.overrides)))
        assert cfg.model.policy == str(tmp_path / "gemma3") and not cfg.data.chat
        assert cfg.rollout.stop == ["\n", "\n\n", "\n\n\n"] and cfg.rollout.max_new_tokens == 12
        assert cfg.model.lora.r == 16 and cfg.run.steps == 24


def _fake_run(out: Path, choice: str, beta: float, seed: int, curve: dict) -> Run:
    """A finished run's metrics.jsonl: 12 steps of constant gold, proxy and sequence KL, and
    held-out gold at steps 0, 6 and 12."""
    est, placement = ("k1", "none") if choice == "no KL" else ("full", "loss")
    name = f"grpo_{choice.replace(' ', '-')}_b{beta:g}_s{seed}"
    d = out / "runs" / name
    d.mkdir(parents=True)
    rows = [{"step": 0, "accuracy/heldout": curve["start"]}]
    for step in range(1, 13):
        rows.append(
            {"step": step, "kl/ref/exact": curve["kl"] / 10, "kl/ref/seq": curve["kl"],
             "kl/ref/full": curve["kl"] / 10, "kl/ref/k1": curve["kl"] / 10,
             "reward/gold": curve["gold"], "reward/proxy": curve["proxy"],
             "reward/mean": curve["proxy"], "entropy": 1.0, "completion/length": 10.0}
        )  # fmt: skip
    rows[6]["accuracy/heldout"] = curve["mid"]
    rows[-1]["accuracy/heldout"] = curve["end"]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Run(
        name=name, algo="grpo", choice=choice, estimator=est, placement=placement, beta=beta,
        seed=seed, overrides=[],
    )  # fmt: skip


def test_the_report_shows_both_frontiers_by_hand(tmp_path):
    """Three cells of made-up runs: no KL (KL 12 nats, gold 0.1 on the sampled completions, 0.05
    held out) and the exact KL in the loss at two betas (KL 1.5 and 6). Each frontier cell is the
    best gold reward within the budget, read off by hand."""
    study = chat_overopt_study().model_copy(
        update={"steps": 12, "eval_every": 12, "eval_size": 20, "seeds": [0, 1]}
    )
    curves = {
        ("no KL", 0.0): {"kl": 12.0, "gold": 0.1, "proxy": 0.9, "start": 0.1, "mid": 0.2,
                         "end": 0.05},
        ("full loss", 0.8): {"kl": 1.5, "gold": 0.3, "proxy": 0.4, "start": 0.1, "mid": 0.1,
                             "end": 0.25},
        ("full loss", 0.05): {"kl": 6.0, "gold": 0.4, "proxy": 0.7, "start": 0.1, "mid": 0.3,
                              "end": 0.15},
    }  # fmt: skip
    results = []
    for (choice, beta), curve in curves.items():
        for seed in (0, 1):
            run = _fake_run(tmp_path, choice, beta, seed, curve)
            results.append(
                summarise_run(run, tmp_path / "runs" / run.name, Criteria(12, 1.0, eval_size=20),
                              returncode=0, wall_s=1.0)
            )  # fmt: skip
    assert results[0]["gold_final"] == pytest.approx(0.1)
    assert results[0]["kl_seq_final"] == pytest.approx(12.0)
    write_results(results, tmp_path, study)
    report = (tmp_path / "report.md").read_text()
    lines = report.splitlines()

    def row(section: str, choice: str) -> list[str]:
        start = lines.index(section)
        line = next(x for x in lines[start:] if x.startswith(f"| grpo | {choice} |"))
        return [c.strip() for c in line.strip("|").split("|")]

    head = next(x for x in lines if x.startswith("| algo | KL choice | seq KL"))
    assert "seq KL ≤ 0.5 | seq KL ≤ 1 | seq KL ≤ 2 | seq KL ≤ 4 | seq KL ≤ 8 | seq KL any" in head
    # Budgets 0.5, 1, 2, 4, 8, any. On the sampled completions (reward/gold):
    full = row("## Frontier: gold reward within a KL budget", "full loss")
    assert full[2:8] == ["–", "–", "0.300 (0.8)", "0.300 (0.8)", "0.400 (0.05)", "0.400 (0.05)"]
    assert full[9] == "0.300"  # proxy − gold at the best final gold (beta 0.05): 0.7 − 0.4
    nokl = row("## Frontier: gold reward within a KL budget", "no KL")
    assert nokl[2:8] == ["–"] * 5 + ["0.100 (0)"]
    # On the held-out problems at the end: the cells' held-out gold.
    held = row("## Frontier on held-out problems", "full loss")
    assert held[2] == "0.100"  # the start
    assert held[3:9] == ["–", "–", "0.250 (0.8)", "0.250 (0.8)", "0.250 (0.8)", "0.250 (0.8)"]
    assert row("## Frontier on held-out problems", "no KL")[3:9] == ["–"] * 5 + ["0.050 (0)"]
    # Over every held-out evaluation after the start (steps 6 and 12): the KL is constant, so a
    # beta's two points share it; no KL's best is its midway 0.2, beyond every budget but any.
    evals = "The same over every held-out **evaluation** after the start"
    at = next(i for i, x in enumerate(lines) if x.startswith(evals))
    pick = lines[at:]
    full_ev = next(x for x in pick if x.startswith("| grpo | full loss |"))
    assert [c.strip() for c in full_ev.strip("|").split("|")][2:8] == [
        "–", "–", "0.250 (0.8, step 12)", "0.250 (0.8, step 12)", "0.300 (0.05, step 6)",
        "0.300 (0.05, step 6)",
    ]  # fmt: skip
    nokl_ev = next(x for x in pick if x.startswith("| grpo | no KL |"))
    assert [c.strip() for c in nokl_ev.strip("|").split("|")][2:8] == ["–"] * 5 + [
        "0.200 (0, step 6)"
    ]
    assert "| grpo | full loss | 0.8 | 0.100 (1.50) | 0.250 (1.50) |" in lines
    assert "| grpo | no KL | 0 | 0.200 (12.00) | 0.050 (12.00) |" in lines
    assert "## Over-optimisation: gold against proxy reward" in report
    assert "held-out accuracy is the gold reward (`chat_overopt_gold`" in report
    assert (tmp_path / "frontier.png").is_file() and (tmp_path / "gold_proxy.png").is_file()


@pytest.mark.real
def test_one_quick_run_logs_gold_and_proxy_end_to_end(smollm2_tiny, tmp_path):
    """The quick preset's form cut to one run (the exact KL in the loss, one step, 4 held-out
    problems) on SmolLM2's conventions: it trains on the proxy, logs gold <= proxy on the same
    completions, scores its held-out problems with the gold reward, and the report has the
    frontiers."""
    study = quick_chat_overopt_study(model=str(smollm2_tiny)).model_copy(
        update={
            "choices": [Choice(estimator="full", placement="loss")],
            "betas": [0.8],
            "steps": 1,
            "eval_every": 1,
            "eval_size": 4,
            "workers": 1,
        }
    )
    out = tmp_path / "study"
    (result,) = run_study(study, out)
    assert result["status"] in ("ok", "collapsed"), result["error"]
    assert 0.0 <= result["gold_final"] <= result["proxy_final"] <= 1.0
    assert math.isfinite(result["kl_seq_final"])
    run_dir = out / "runs" / result["name"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "reward/gold" in r)
    assert "reward/chat_overopt_proxy" in step and step["reward/gold"] <= step["reward/proxy"]
    assert [r["step"] for r in rows if "accuracy/heldout" in r] == [0, 1]
    config = (run_dir / "config.yaml").read_text()
    assert "gold_reward: chat_overopt_gold" in config and "max_new_tokens: 24" in config
    report = (out / "report.md").read_text()
    assert "## Frontier on held-out problems" in report
    assert "## Frontier: gold reward within a KL budget" in report
