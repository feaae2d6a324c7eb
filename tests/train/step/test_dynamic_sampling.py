"""Dynamic sampling (DAPO §3.2): groups of equal rewards dropped, more prompts sampled, capped."""

from __future__ import annotations

import pytest
import torch

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.data.sources import Example, PromptStream
from klpo.train.rewards.functions import TrainerState, WeightedReward
from klpo.train.rollout.samplers import Rollout
from klpo.train.runtime.metrics import is_timing, read_metrics
from klpo.train.step.dynamic import constant_groups, sample_with_signal

DYN = ("rollout/dynamic_rounds", "rollout/groups_kept", "rollout/groups_dropped",
       "rollout/extra_completions")  # fmt: skip


def test_constant_groups_by_hand():
    # G = 3: [1, 1, 1] equal; [0, 1, 0] not; [2, 2, 5] not; [4, 4, 4] equal.
    scores = torch.tensor([1.0, 1, 1, 0, 1, 0, 2, 2, 5, 4, 4, 4])
    assert constant_groups(scores, 3).tolist() == [True, False, False, True]
    # Unscored samples are left out: [2, 2, (5)] is constant, [(0), 1, (0)] has one scored.
    scored = torch.tensor([1, 1, 1, 0, 1, 0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert constant_groups(scores, 3, scored).tolist() == [True, True, True, True]


class _Engine:
    """Completions whose text is their prompt (one token each); counts what it samples."""

    def __init__(self, g: int):
        self.g, self.prompts = g, []

    def sample(self, prompts, answers):
        self.prompts += prompts
        b = len(prompts) * self.g
        return Rollout(
            prompt_ids=torch.ones(b, 1, dtype=torch.long),
            prompt_mask=torch.ones(b, 1, dtype=torch.bool),
            completion_ids=torch.arange(b)[:, None],
            mask=torch.ones(b, 1, dtype=torch.bool),
            prompts=[p for p in prompts for _ in range(self.g)],
            completions=[p for p in prompts for _ in range(self.g)],
            answers=[a for a in answers for _ in range(self.g)],
            group_size=self.g,
            truncated=torch.zeros(b, dtype=torch.bool),
        )


def _flat_on_multiples_of_3(prompts, completions, answers):
    # Prompt "p<k>": constant rewards when k % 3 == 0, else 0, 1, 0, 1 down the group.
    return [0.0 if int(c[1:]) % 3 == 0 else float(i % 2) for i, c in enumerate(completions)]


@pytest.mark.parametrize("max_rounds", [1, 2, 5])
def test_kept_groups_are_exactly_the_non_constant_ones_and_the_cap_holds(max_rounds):
    n, g = 4, 2
    cfg = build_config(overrides=[
        f"rollout.prompts_per_step={n}", f"rollout.group_size={g}",
        "rollout.dynamic_sampling=true", f"rollout.dynamic_sampling_max_rounds={max_rounds}",
    ])  # fmt: skip
    stream = PromptStream([Example(f"p{k}", "") for k in range(100)], seed=0, shuffle=False)
    engine = _Engine(g)
    fns = [WeightedReward("flat3", _flat_on_multiples_of_3)]
    got = sample_with_signal(cfg, stream, engine, fns, TrainerState(0, 1))
    # Prompts p0 .. p11 in order; p0, p3, p6, p9 constant. Round 1: p0..p3 keeps p1 p2 (2 of 4).
    # Round 2: p4..p7 keeps p4 p5 (p7 is surplus), 4 in all. Cap 1: only p1 p2.
    want = {1: ["p1", "p2"], 2: ["p1", "p2", "p4", "p5"], 5: ["p1", "p2", "p4", "p5"]}
    rounds = min(max_rounds, 2)
    assert [e.prompt for e in got.examples] == want[max_rounds]
    assert got.rollout.prompts == [p for p in want[max_rounds] for _ in range(g)]
    assert len(engine.prompts) == rounds * n  # never more rounds than the cap, nor than needed
    assert stream.offset == rounds * n  # the stream advanced by every prompt drawn
    scores, scored, per_fn = got.totals
    assert scores.tolist() == [0.0, 1.0] * len(want[max_rounds]) and scored is None
    assert per_fn["flat3"] == scores.tolist()
    dropped = {1: 2, 2: 3, 5: 3}[max_rounds]  # p0 p3 | p6 (p7 is not dropped: it was not needed)
    assert got.metrics == {
        "rollout/dynamic_rounds": rounds,
        "rollout/groups_kept": len(want[max_rounds]),
        "rollout/groups_dropped": dropped,
        "rollout/extra_completions": (rounds - 1) * n * g,
    }


def test_no_group_kept_trains_on_the_first_round():
    cfg = build_config(overrides=[
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.dynamic_sampling=true",
        "rollout.dynamic_sampling_max_rounds=3",
    ])  # fmt: skip
    stream = PromptStream([Example(f"p{3 * k}", "") for k in range(10)], seed=0, shuffle=False)
    got = sample_with_signal(
        cfg, stream, _Engine(2), [WeightedReward("f", _flat_on_multiples_of_3)], TrainerState(0, 1)
    )
    assert [e.prompt for e in got.examples] == ["p0", "p3"]
    assert got.metrics == {
        "rollout/dynamic_rounds": 3, "rollout/groups_kept": 0, "rollout/groups_dropped": 6,
        "rollout/extra_completions": 2 * 2 * 2,
    }  # fmt: skip


def test_concat_pads_and_keeps_rows():
    a = _Engine(1).sample(["x"], [""])
    b = Rollout(
        prompt_ids=torch.tensor([[5, 6]]), prompt_mask=torch.ones(1, 2, dtype=torch.bool),
        completion_ids=torch.tensor([[7, 8, 9]]), mask=torch.tensor([[True, True, False]]),
        prompts=["y"], completions=["yy"], answers=[""], group_size=1,
        truncated=torch.tensor([False]),
    )  # fmt: skip
    c = Rollout.concat([a, b])
    assert c.prompt_ids.tolist() == [[0, 1], [5, 6]]  # left-padded
    assert c.prompt_mask.tolist() == [[False, True], [True, True]]
    assert c.completion_ids.tolist() == [[0, 0, 0], [7, 8, 9]]  # right-padded
    assert c.mask.tolist() == [[True, False, False], [True, True, False]]
    assert c.prompts == ["x", "y"] and c.truncated.tolist() == [False, False]


def _run(tiny_model, quick, out, resume=False, **extra):
    overrides = {"run.steps": 3, "run.eval_every": 0, **extra}
    cfg = build_config(overrides=quick(tiny_model, out, **overrides))
    loop.train(cfg, log=lambda *_: None, resume=resume)
    return [
        {k: v for k, v in r.items() if not is_timing(k)}
        for r in read_metrics(out / "metrics.jsonl")
    ]


def test_training_on_kept_groups_only(tiny_model, quick, tmp_path):
    # half_signal: a group has rewards 0, 1, 0, 1 (mean exactly 1/2) or all 0. Kept groups only:
    # reward/mean is exactly 0.5 on every step, with prompts_per_step = 4 groups of 4.
    on = {"rewards": "[{name: 'klpo_test_rewards:half_signal'}]", "rollout.dynamic_sampling": "true",
          "rollout.dynamic_sampling_max_rounds": 8}  # fmt: skip
    rows = _run(tiny_model, quick, tmp_path / "on", **on)
    for r in rows:
        assert r["reward/mean"] == 0.5 and r["rollout/groups_kept"] == 4
        assert r["step/skipped"] == 0.0
        # Every round is 4 prompts; kept + dropped + the last round's surplus = 4 * rounds.
        assert (
            r["rollout/groups_kept"] + r["rollout/groups_dropped"]
            <= 4 * r["rollout/dynamic_rounds"]
        )
        assert r["rollout/extra_completions"] == (r["rollout/dynamic_rounds"] - 1) * 16
    assert sum(r["rollout/groups_dropped"] for r in rows) > 0  # some groups were constant
    off = _run(tiny_model, quick, tmp_path / "off", rewards=on["rewards"])
    assert any(r["reward/mean"] < 0.5 for r in off)  # without it constant groups are trained on
    # Resume: a run stopped at step 2 and resumed draws the prompts of the whole run.
    part = tmp_path / "part"
    _run(tiny_model, quick, part, **on, **{"run.steps": 2, "run.save_every": 1})
    assert _run(tiny_model, quick, part, resume=True, **on, **{"run.save_every": 1}) == rows


def test_nothing_dropped_trains_as_without_it_and_off_by_default(tiny_model, quick, tmp_path):
    # Every group has signal: the dynamic path (one round, rewards handed to scoring) trains as
    # the default path does, metric for metric; a default run logs no rollout/* key, and an
    # explicit false is the default.
    alt = {"rewards": "[{name: 'klpo_test_rewards:alternating'}]"}
    default = _run(tiny_model, quick, tmp_path / "default", **alt)
    off = _run(tiny_model, quick, tmp_path / "off", **alt, **{"rollout.dynamic_sampling": "false"})
    on = _run(tiny_model, quick, tmp_path / "on", **alt, **{"rollout.dynamic_sampling": "true"})
    assert default == off and not any(k in r for r in default for k in DYN)
    assert [r["rollout/dynamic_rounds"] for r in on] == [1.0, 1.0, 1.0]
    assert [r["rollout/groups_kept"] for r in on] == [4.0, 4.0, 4.0]
    assert [{k: v for k, v in r.items() if k not in DYN} for r in on] == default


def test_refused_without_a_group_baseline():
    for name in ("ppo", "reinforce++"):
        with pytest.raises(ValueError, match=r"rollout\.dynamic_sampling.*no group baseline"):
            build_config(overrides=[f"algo.name={name}", "rollout.dynamic_sampling=true"])


def test_refused_under_several_processes(tiny_model, quick, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "r", **{"rollout.dynamic_sampling": "true"})
    )
    with pytest.raises(ConfigError, match=r"rollout\.dynamic_sampling runs in one process only"):
        loop.check_run(cfg, log=lambda *_: None)
