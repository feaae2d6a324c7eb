"""Prompt sources and the resumable prompt stream."""

from __future__ import annotations

import json

import pytest

from klpo.train.data.sources import Example, PromptStream, read_dataset, read_jsonl


def test_jsonl_reads_and_names_bad_lines(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": 2}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    assert read_jsonl(good) == [Example("1+1=", "2"), Example("2+2=", "4")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"missing.jsonl:1: missing field 'prompt'.*prompt_field"):
        read_jsonl(missing)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "nope.jsonl")
    assert read_jsonl(missing, prompt_field="question") == [Example("1+1=", "2")]


def test_datasets_from_disk_and_file(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"q": ["1+1=", "3+4="], "a": ["2", "7"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert read_dataset(str(tmp_path / "ds"), "train", "q", "a") == [
        Example("1+1=", "2"),
        Example("3+4=", "7"),
    ]
    with pytest.raises(ValueError, match="no column 'prompt'"):
        read_dataset(str(tmp_path / "ds"), "train")
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": p, "answer": a}) for p, a in [("x", "1")]))
    assert read_dataset(str(f), "train") == [Example("x", "1")]


def test_stream_is_seeded_covers_each_epoch_and_resumes_exactly():
    examples = [Example(str(i), str(i)) for i in range(10)]
    a = PromptStream(examples, seed=3)
    first = a.next(10)
    assert sorted(e.prompt for e in first) == [str(i) for i in range(10)]
    a.next(4)
    state = a.state_dict()
    rest = a.next(13)
    b = PromptStream(examples, seed=3)
    b.load_state_dict(state)
    assert b.next(13) == rest
    assert PromptStream(examples, seed=3).next(10) == first
    assert PromptStream(examples, seed=4).next(10) != first
    assert [e.prompt for e in PromptStream(examples, seed=0, shuffle=False).next(3)] == [
        "0",
        "1",
        "2",
    ]
