"""Chat data: prompts rendered with the tokenizer's chat template, for JSONL and datasets sources."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest

from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.data.sources import Example, read_dataset, read_jsonl, render_chat
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.samples import read_samples

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


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_render_chat_hand(chat_model):
    tok = _tok(chat_model)
    got = render_chat(
        [Example("1+2=", "3"), Example("", "5", messages=(("system", "be brief"), ("user", "2+3=")))],
        tok, chat=True, system_prompt="answer with a number",
    )  # fmt: skip
    # The rendered example keeps the messages it was rendered from (for TRL-form rewards).
    sent = (("system", "answer with a number"), ("user", "1+2="))
    assert got[0] == Example(
        "<s>system: answer with a number\n<s>user: 1+2=\n<s>assistant: ", "3", messages=sent
    )
    # A conversation that starts with its own system message keeps it.
    assert got[1].prompt == "<s>system: be brief\n<s>user: 2+3=\n<s>assistant: "
    assert got[1].messages == (("system", "be brief"), ("user", "2+3="))
    # The rendered text tokenizes with <s> as one special token, nothing added around it.
    ids = tok(got[0].prompt, add_special_tokens=False).input_ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 3


def test_chat_off_keeps_prompts_and_refuses_messages(chat_model):
    tok = _tok(chat_model)
    plain = [Example("1+2=", "3")]
    assert render_chat(plain, tok, chat=False) == plain
    with pytest.raises(ValueError, match=r"data\.chat=true"):
        render_chat([Example("", "3", messages=(("user", "x"),))], tok, chat=False)
    with pytest.raises(ValueError, match="system_prompt"):
        render_chat(plain, tok, chat=False, system_prompt="hi")


def test_chat_without_a_template_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match=r"has none.*chat_template"):
        render_chat([Example("1+2=", "3")], _tok(tiny_model), chat=True)


def test_jsonl_and_datasets_read_chat_messages(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"},
        {"prompt": "4+4=", "answer": 8},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = [Example("", "3", messages=(("user", "1+2="),)), Example("4+4=", "8")]
    assert read_jsonl(path) == want
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: chat message 0 .*'content'"):
        read_jsonl(bad)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(rows[0]) + "\n")
    assert read_dataset(str(one), "train") == want[:1]


def test_train_with_chat_prompts(chat_model, quick, tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8))
    )
    cfg = build_config(
        overrides=quick(
            chat_model, tmp_path / "run", **{
                "data.source": "jsonl", "data.path": str(data), "data.chat": "true",
                "data.system_prompt": "add", "run.steps": 1, "run.eval_every": 0,
            },
        )
    )  # fmt: skip
    seen = []
    from klpo.train.choices import ENGINES

    fake = importlib.import_module("klpo_fake_engine")  # tests/train, on sys.path in a test
    monkeypatch.setitem(ENGINES, "hf", fake.recording([], seen))  # what the hf engine is given
    loop.train(cfg, log=lambda *_: None)
    assert seen and all(p.startswith("<s>system: add\n<s>user: ") for p in seen)
    assert all(p.endswith("\n<s>assistant: ") for p in seen)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 1
    # the logged completions carry the last user message, and report.md's prompt column shows
    # it, not the rendered text (which begins with the system prompt on every row)
    records = read_samples(tmp_path / "run" / "samples.jsonl")
    assert records and all(r["prompt"].startswith("<s>system: add\n") for r in records)
    assert all(
        r["prompt"] == f"<s>system: add\n<s>user: {r['user']}\n<s>assistant: " for r in records
    )
    report = (tmp_path / "run" / "report.md").read_text()
    assert "| prompt (last user message) | completion |" in report
    rows = [line for line in report.splitlines() if line.startswith(f"| {records[0]['user']} |")]
    assert rows and "system: add" not in report
