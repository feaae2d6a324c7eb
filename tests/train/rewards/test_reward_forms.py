"""Reward functions in TRL's form (``fn(completions, **kwargs)``, data columns by keyword) and
klpo's (three lists by position), told apart by their signature; None for samples not scored;
``module:function`` found in the working directory."""

from __future__ import annotations

import json
import sys

import pytest

from klpo.train.config import build_config
from klpo.train.rewards import functions as rewards
from klpo.train.rewards.functions import (
    RewardBatch,
    RewardError,
    TrainerState,
    WeightedReward,
    combined_rewards,
    resolve_rewards,
    reward_form,
)
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.samples import read_samples

# The signatures of TRL's own example reward functions (trl.rewards): only the signatures
# matter here; the bodies are simple stand-ins with hand-checkable values.


def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    return [float(c[0]["content"].startswith("<think>")) for c in completions]


def accuracy_reward(completions, solution: list[str], log_extra=None, **kwargs):
    """None where the solution cannot be parsed (TRL skips those)."""
    out = []
    for c, s in zip(completions, solution, strict=True):
        text = c[0]["content"] if isinstance(c, list) else c
        out.append(None if not s.isdigit() else float(text.strip() == s))
    return out


class SoftOverlong:
    """As ``get_soft_overlong_punishment``'s callable: ``__call__(completion_ids, **kwargs)``."""

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_len: int, cache: int):
        self.max_len, self.cache = max_len, cache

    def __call__(self, completion_ids: list[list[int]], **kwargs) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= self.max_len - self.cache:
                out.append(0.0)
            elif n <= self.max_len:
                out.append((self.max_len - self.cache - n) / self.cache)
            else:
                out.append(-1.0)
        return out


def klpo_form(prompts, completions, answers):
    return [float(c == a) for c, a in zip(completions, answers, strict=True)]


def _batch(**extra) -> RewardBatch:
    return RewardBatch(
        prompts=["1+1=", "1+1=", "2+3="],
        completions=["2", "3", "5"],
        answers=["2", "2", "x"],
        completion_ids=[[7, 2], [8, 9, 10, 2], [11]],
        columns={"prompt": ["1+1=", "1+1=", "2+3="], "answer": ["2", "2", "x"],
                 "solution": ["2", "2", "x"], "task": ["a", "a", "b"]},
        state=TrainerState(global_step=3, max_steps=10),
        **extra,
    )  # fmt: skip


def test_the_form_is_read_from_the_signature():
    assert reward_form(think_format_reward) == "trl"
    assert reward_form(accuracy_reward) == "trl"
    assert reward_form(SoftOverlong(4, 2)) == "trl"
    assert reward_form(lambda completions, **kw: []) == "trl"
    assert reward_form(klpo_form) == "klpo"
    assert reward_form(lambda p, c, a, extra=None: []) == "klpo"
    assert reward_form(lambda *args: []) == "klpo"
    assert reward_form(rewards.exact_match) == "klpo"
    for bad in (lambda completions: [], lambda p, c: [], lambda p, c, a, d: []):
        with pytest.raises(ValueError, match=r"neither form.*\*\*kwargs"):
            reward_form(bad, "mine")


def test_trl_form_gets_every_column_by_keyword():
    seen = {}

    def spy(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [1.0] * len(completions)

    assert rewards.score(spy, "spy", _batch()) == [1.0, 1.0, 1.0]
    assert set(seen) == {
        "prompts",
        "completions",
        "completion_ids",
        "trainer_state",
        "answer",
        "solution",
        "task",
    }  # fmt: skip  ("prompt" is not passed on, as in TRL)
    assert seen["prompts"] == ["1+1=", "1+1=", "2+3="]
    assert seen["completions"] == ["2", "3", "5"]
    assert seen["completion_ids"] == [[7, 2], [8, 9, 10, 2], [11]]
    assert seen["task"] == ["a", "a", "b"]
    assert seen["trainer_state"] == TrainerState(3, 10)


def test_chat_data_gives_conversational_prompts_and_completions():
    msgs = [[{"role": "user", "content": p}] for p in ("1+1=", "1+1=", "2+3=")]
    batch = _batch(messages=msgs)
    seen = {}

    def spy(completions, prompts, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    rewards.score(spy, "spy", batch)
    assert seen["prompts"] == msgs
    assert seen["completions"] == [[{"role": "assistant", "content": c}] for c in ("2", "3", "5")]
    think = RewardBatch(["q"], ["<think>x</think>4"], ["4"], messages=[[{"role": "user", "content": "q"}]])  # fmt: skip
    assert rewards.score(think_format_reward, "think", think) == [1.0]


def test_trl_signatures_and_none_combine_as_trl_does():
    """accuracy (None where the solution does not parse), the soft over-long penalty (reads
    completion_ids) and klpo's form together: totals by hand, None left out of the sum."""
    fns = [
        WeightedReward("accuracy", accuracy_reward, 2.0),
        WeightedReward("overlong", SoftOverlong(max_len=3, cache=2), 1.0),
        WeightedReward("exact", klpo_form, 0.5),
    ]
    total, per = combined_rewards(fns, _batch())
    assert per["accuracy"] == [1.0, 0.0, None]
    # lengths 2, 4, 1 against max_len 3, cache 2: (3 - 2 - 2) / 2, over the limit, within
    assert per["overlong"] == [-0.5, -1.0, 0.0]
    assert per["exact"] == [1.0, 0.0, 0.0]
    assert total == [2.0 - 0.5 + 0.5, 0.0 - 1.0 + 0.0, 0.0 + 0.0]
    # a sample that no function scores has no total
    only_acc = [WeightedReward("accuracy", accuracy_reward, 1.0)]
    assert combined_rewards(only_acc, _batch())[0] == [1.0, 0.0, None]


def test_a_required_column_the_data_lacks_is_named():
    def needs_level(completions, level, **kwargs):
        return [0.0] * len(completions)

    assert rewards.missing_keywords(needs_level, ["answer", *rewards.KEYWORDS]) == ["level"]
    assert rewards.missing_keywords(accuracy_reward, ["solution", *rewards.KEYWORDS]) == []
    assert rewards.missing_keywords(klpo_form, []) == []
    with pytest.raises(RewardError, match=r"'lv' raised TypeError on sample 0.*level"):
        rewards.score(needs_level, "lv", _batch())


def test_a_column_named_like_an_argument_is_refused():
    batch = RewardBatch(["p"], ["c"], ["a"], columns={"completions": ["x"]})
    with pytest.raises(ValueError, match=r"column 'completions'.*rename that column"):
        batch.keywords()


def test_module_function_is_found_in_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_cwd.py").write_text(
        "def short(completions, **kwargs):\n    return [-len(c) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards_cwd", raising=False)
    (r,) = resolve_rewards(["my_rewards_cwd:short"])
    assert rewards.score(r.fn, r.name, ["p", "p"], ["ab", "abcd"], ["", ""]) == [-2.0, -4.0]
    assert sys.path[-1] == str(tmp_path)  # appended: an installed package is never shadowed
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_mod'.*working directory"):
        resolve_rewards(["no_such_mod:f"])


def test_a_trl_reward_and_an_extra_column_train(tiny_model, quick, tmp_path):
    """A JSONL data set with extra columns and a TRL-form reward that reads one and returns
    None for the rows it does not score: the run trains, the unscored share is logged, and the
    samples of rows it skipped have no reward."""
    rows = [
        {"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "digits" if i % 2 else "other",
         "note": f"row {i}"}
        for i in range(1, 9)
    ]  # fmt: skip
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {r["prompt"]: r["task"] for r in rows}
    from klpo.train import loop

    out = tmp_path / "run"
    cfg = build_config(
        overrides=quick(
            tiny_model, out,
            **{"data.source": "jsonl", "data.path": str(data), "data.eval_path": str(data),
               "rewards": "[{name: 'klpo_test_rewards:trl_digits_by_task'}]",
               "run.log_samples": 16, "run.log_samples_every": 1},
        )
    )  # fmt: skip
    loop.train(cfg, log=lambda *_: None)
    metrics = [r for r in read_metrics(out / "metrics.jsonl") if "reward/unscored" in r]
    assert len(metrics) == 3
    samples = [r for r in read_samples(out / "samples.jsonl") if r["split"] == "train"]
    assert len(samples) == 3 * 16
    for r in samples:
        assert (r["reward"] is None) == (task[r["prompt"]] != "digits"), r
    for step in (1, 2, 3):
        skipped = [r["reward"] is None for r in samples if r["step"] == step]
        assert metrics[step - 1]["reward/unscored"] == pytest.approx(sum(skipped) / 16)


def test_preflight_names_a_reward_that_cannot_run_on_the_data():
    from klpo.train.config import ConfigError
    from klpo.train.data.sources import Example
    from klpo.train.preflight import check_rewards_and_trackers

    data = [Example("1+1=", "2", row={"prompt": "1+1=", "answer": "2", "level": 1})]
    ok = build_config(overrides=["rewards=[{name: 'klpo_test_rewards:trl_digits_by_task'}]"])
    with pytest.raises(ConfigError, match=r"requires the argument 'task'.*prompt, answer, level"):
        check_rewards_and_trackers(ok, data)
    data = [Example("1+1=", "2", row={**data[0].row, "task": "a"})]
    check_rewards_and_trackers(ok, data)
    bad = build_config(overrides=["rewards=[{name: 'klpo_test_rewards:no_such_fn'}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].*has no attribute 'no_such_fn'"):
        check_rewards_and_trackers(bad, data)


def test_the_worked_example_of_the_docs_runs():
    """docs/rewards.md's my_rewards.py on its data.jsonl rows, through klpo's calls."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "rewards.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "def brevity" in b)
    rows = [json.loads(x) for x in re.search(r"```json\n(.*?)```", text, re.S)[1].splitlines()]
    ns: dict = {}
    exec(code, ns)
    fns = [WeightedReward("a", ns["arithmetic"], 1.0), WeightedReward("b", ns["brevity"], 0.5)]
    batch = RewardBatch(
        prompts=[r["prompt"] for r in rows],
        completions=["19", "hi"],
        answers=[r["answer"] for r in rows],
        completion_ids=[[1, 2, 0], list(range(12))],
        columns={k: [r[k] for r in rows] for k in rows[0]},
    )
    total, per = combined_rewards(fns, batch)
    assert per == {"a": [1.0, None], "b": [0.0, pytest.approx(-0.04)]}
    assert total == [1.0, pytest.approx(-0.02)]


def test_a_rollout_of_chat_data_reaches_the_functions_as_trl_gives_it():
    """reward_batch: each group's data row repeated G times, the chat messages it was rendered
    from, each completion's ids up to and including its end-of-sequence token."""
    import torch

    from klpo.train.data.sources import Example
    from klpo.train.rollout.reward_batch import reward_batch
    from klpo.train.rollout.samplers import Rollout

    msgs = (("system", "be brief"), ("user", "1+1="))
    examples = [
        Example("<rendered 1>", "2", messages=msgs, row={"prompt": "1+1=", "answer": "2", "lvl": 1}),
        Example("<rendered 2>", "4", messages=msgs[1:], row={"prompt": "2+2=", "answer": "4", "lvl": 2}),
    ]  # fmt: skip
    ids = torch.tensor([[5, 0, 0], [6, 7, 0], [8, 9, 10], [11, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rollout = Rollout(
        prompt_ids=torch.zeros(4, 1, dtype=torch.long), prompt_mask=torch.ones(4, 1, dtype=torch.bool),
        completion_ids=ids, mask=mask, prompts=["<rendered 1>"] * 2 + ["<rendered 2>"] * 2,
        completions=["a", "b", "c", "d"], answers=["2", "2", "4", "4"], group_size=2,
    )  # fmt: skip
    batch = reward_batch(rollout, examples, TrainerState(1, 5))
    assert batch.completion_ids == [[5, 0], [6, 7, 0], [8, 9, 10], [11, 0]]
    assert batch.columns["lvl"] == [1, 1, 2, 2]
    kw = batch.keywords()
    assert kw["prompts"][0] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]  # fmt: skip
    assert kw["prompts"][3] == [{"role": "user", "content": "1+1="}]
    assert kw["completions"][1] == [{"role": "assistant", "content": "b"}]
    assert kw["answer"] == ["2", "2", "4", "4"] and "prompt" not in kw
    with pytest.raises(ValueError, match="do not make the rollout's 4 completions"):
        reward_batch(rollout, examples[:1])
