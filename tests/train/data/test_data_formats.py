"""Data as TRL's and verl's users have it: nested fields by dotted path, no ``answer`` column where
no reward reads one, verl's parquet read as parquet, and chat completions' hint for a reward."""

from __future__ import annotations

import json
import shutil

import pytest

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.data.sources import Example, field_value, read_dataset, read_jsonl
from klpo.train.preflight import check_answers, reads_answers
from klpo.train.rewards.functions import RewardBatch, RewardError, score
from klpo.train.runtime.metrics import read_metrics

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory):
    """The tiny model with a chat template on its tokenizer."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def verl_rows(n: int) -> list[dict]:
    """Rows as verl's own preprocessing scripts write them (examples/data_preprocess/gsm8k.py's
    columns): a chat prompt, the answer under reward_model.ground_truth, extra_info."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{i}+{i}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "answer": f"#### {2 * i}"},
        }
        for i in range(1, n + 1)
    ]


def write_verl_parquet(path, n: int = 8):
    import pandas as pd

    pd.DataFrame(verl_rows(n)).to_parquet(path)  # as verl's scripts save them
    return path


def write_trl_jsonl(path, n: int = 8):
    """TRL's standard prompt-only format with the reference in the data's own ``solution``."""
    rows = [{"prompt": f"{i}+{i}=", "solution": str(2 * i)} for i in range(1, n + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# Dotted field paths.


def test_field_value_by_name_then_by_path():
    row = {"a.b": 1, "a": {"b": 2, "c": {"d": "x"}}, "l": [{"v": 5}, {"v": 6}]}
    assert field_value(row, "a.b") == 1  # a column of that very name wins
    assert field_value(row, "a.c.d") == "x"
    assert field_value(row, "l.1.v") == 6
    with pytest.raises(KeyError) as err:
        field_value(row, "a.c.e")
    assert err.value.args == ("e (in a.c)", "d")
    with pytest.raises(KeyError) as err:
        field_value(row, "a.b.c")  # 2 is not a record
    assert err.value.args == ("c (in a.b)", "a int")
    with pytest.raises(KeyError):
        field_value(row, "l.2.v")


def test_missing_nested_field_names_the_part_and_the_fix(tmp_path):
    f = tmp_path / "verl.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in verl_rows(2)))
    got = read_jsonl(f, answer_field="reward_model.ground_truth")
    assert [e.answer for e in got] == ["2", "4"]
    assert got[0].messages == (("user", "1+1="),)
    with pytest.raises(ValueError, match=r"verl.jsonl:1: missing field 'extra_info.question'"):
        read_jsonl(f, prompt_field="extra_info.question")
    try:
        read_jsonl(f, prompt_field="extra_info.question")
    except ValueError as err:
        assert "'question (in extra_info)' is not there" in str(err)
        assert "fields present: split, index, answer" in str(err)
        assert "reward_model.ground_truth" in str(err)  # the dotted-path hint


# ---------------------------------------------------------------------------------------------
# verl's parquet, as parquet.


def test_parquet_named_as_jsonl_is_read_as_parquet(tmp_path):
    f = write_verl_parquet(tmp_path / "train.parquet", 3)
    got = read_jsonl(f, answer_field="reward_model.ground_truth")
    assert [(e.messages, e.answer, e.where) for e in got] == [
        ((("user", f"{i}+{i}="),), str(2 * i), f"{f}[{i - 1}]") for i in (1, 2, 3)
    ]
    assert got[0].columns["extra_info"]["index"] == 1  # the nested record reaches the rewards
    # Under another suffix too: the magic bytes decide, and no "iconv" advice.
    renamed = tmp_path / "train.jsonl"
    f.rename(renamed)
    assert [e.answer for e in read_jsonl(renamed, answer_field="reward_model.ground_truth")] == [
        "2",
        "4",
        "6",
    ]


def test_parquet_through_datasets_with_a_dotted_answer(tmp_path):
    f = write_verl_parquet(tmp_path / "train.parquet", 2)
    got = read_dataset(str(f), "train", answer_field="reward_model.ground_truth")
    assert [(e.messages, e.answer) for e in got] == [
        ((("user", "1+1="),), "2"),
        ((("user", "2+2="),), "4"),
    ]


# ---------------------------------------------------------------------------------------------
# No answer column: refused only where a reward reads it.


def test_answer_is_optional_unless_a_reward_reads_it(tmp_path):
    f = write_trl_jsonl(tmp_path / "trl.jsonl", 3)
    got = read_jsonl(f)
    assert got[0] == Example("1+1=", None) and got[0].columns == {"prompt": "1+1=", "solution": "2"}
    trl = build_config(
        overrides=[
            "data.source=jsonl",
            f"data.path={f}",
            "rewards=[{name: 'klpo_test_rewards:solution_digits'}]",
        ]
    )
    check_answers(trl, got, [])  # TRL's form reads `solution` itself
    for reward in ("exact_match", "klpo_test_rewards:digits"):  # built-in; klpo's 3-list form
        assert reads_answers(reward)
        cfg = build_config(
            overrides=["data.source=jsonl", f"data.path={f}", f"rewards=[{{name: '{reward}'}}]"]
        )
        with pytest.raises(ConfigError) as err:
            check_answers(cfg, got, [])
        text = str(err.value)
        assert text.startswith(f"{f}:1: missing field 'answer' (fields present: prompt, solution)")
        assert "2 more lack it" in text and f"the reward {reward!r} reads" in text
        assert "data.answer_field" in text
    assert not reads_answers("format") and not reads_answers("klpo_test_rewards:solution_digits")
    # Held-out examples without answers are refused by the reward accuracy is scored with.
    with pytest.raises(ConfigError, match="held-out accuracy is scored with it"):
        check_answers(trl.model_copy(update={"rewards": []}), [], got)


# ---------------------------------------------------------------------------------------------
# A reward's exception: its file and line; chat completions are message lists.


def _raises_here(prompts, completions, answers):
    return len(completions) // 0


def test_a_rewards_exception_keeps_its_file_and_line():
    with pytest.raises(RewardError) as err:
        score(_raises_here, "mine", ["p"], ["c"], ["a"])
    line = _raises_here.__code__.co_firstlineno + 1
    assert f"at {__file__}:{line} in _raises_here: return len(completions) // 0" in str(err.value)
    assert str(err.value).startswith("reward function 'mine' raised ZeroDivisionError on sample 0")


def test_chat_completions_as_message_lists_get_a_hint():
    import klpo_test_rewards as r

    chat = RewardBatch(["p"], ["c"], ["a"], messages=[[{"role": "user", "content": "p"}]])
    with pytest.raises(RewardError) as err:
        score(r.strips_completions, "strips", chat)
    text = str(err.value)
    assert "raised AttributeError on sample 0 at " in text and "klpo_test_rewards.py" in text
    assert "completions reach a TRL-form reward as message lists" in text
    assert "completion[0]['content']" in text
    # Plain text: the same function works, and a failure there gets no chat hint.
    assert score(r.strips_completions, "strips", RewardBatch(["p"], ["c"], ["a"])) == [1.0]
    with pytest.raises(RewardError) as err:
        score(r.strips_completions, "strips", RewardBatch(["p"], [None], ["a"]))  # type: ignore[list-item]
    assert "message lists" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Both formats training as they are.


def _quick(quick, model, out, **extra):
    return quick(model, out, **{"run.steps": 2, "run.eval_every": 0, **extra})


def test_verl_parquet_trains_as_it_is(chat_model, quick, tmp_path):
    f = write_verl_parquet(tmp_path / "train.parquet")
    out = tmp_path / "run"
    cfg = build_config(
        overrides=_quick(
            quick,
            chat_model,
            out,
            **{
                "data.source": "jsonl",
                "data.path": str(f),
                "data.chat": True,
                "data.answer_field": "reward_model.ground_truth",
                "rewards": "[{name: numeric}]",
            },
        )
    )
    loop.train(cfg, log=lambda *_: None)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0] == [1, 2]


def test_trl_jsonl_without_answer_trains_as_it_is(chat_model, quick, tmp_path):
    f = write_trl_jsonl(tmp_path / "train.jsonl")
    out = tmp_path / "run"
    cfg = build_config(
        overrides=_quick(
            quick,
            chat_model,
            out,
            **{
                "data.source": "jsonl",
                "data.path": str(f),
                "data.chat": True,
                "rewards": "[{name: 'klpo_test_rewards:solution_digits'}]",
            },
        )
    )
    loop.train(cfg, log=lambda *_: None)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2] and all("reward/mean" in r for r in rows)


def test_reading_a_dataset_prints_no_progress_bars(tmp_path, capfd):
    f = write_trl_jsonl(tmp_path / "rows.jsonl", 3)
    read_dataset(str(f), "train")
    err = capfd.readouterr().err
    assert "Generating" not in err and "it/s" not in err and "examples/s" not in err
