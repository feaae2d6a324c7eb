"""Pre-rendered chat text with ``data.chat: true`` is refused, naming the template's marker, the
prompt's ``file:line`` or dataset row and the fix: on the family tokenizers built here and on
the real SmolLM2-135M-Instruct tokenizer, before any model loads."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train.data.markers import check_unrendered, find_marker, template_markers
from klpo.train.data.sources import Example, read_dataset, read_jsonl, render_chat


def _families():
    """The family builders, loaded by path as tests/train/models/test_tokens.py loads them."""
    name = "klpo_families"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


FAMILIES, build_tokenizer = _families().FAMILIES, _families().build_tokenizer

# Each family's markers, written from its template (tests/train/klpo_families.py): the BOS,
# then the special tokens in the order the template writes them around a conversation.
MARKERS = {
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    "qwen2.5": ("<|im_start|>", "<|im_end|>"),
    "gemma": ("<bos>", "<start_of_turn>", "<end_of_turn>"),
    "mistral": ("<s>", "[INST]", "[/INST]", "</s>"),
    "qwen3": ("<|im_start|>", "<|im_end|>"),  # <think> is added but not special: no marker
}
# The marker a once-rendered user turn begins with (the earliest in its text).
FIRST = {"llama3": "<|begin_of_text|>", "qwen2.5": "<|im_start|>", "gemma": "<bos>",
         "mistral": "<s>", "qwen3": "<|im_start|>"}  # fmt: skip


def rendered(tok, text: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_familys_markers_are_its_bos_and_turn_tokens(family):
    tok = build_tokenizer(FAMILIES[family])
    assert template_markers(tok) == MARKERS[family]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_rendered_prompt_is_refused_naming_marker_line_and_fix(family, tmp_path):
    tok = build_tokenizer(FAMILIES[family])
    path = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "What is 17 + 25?", "answer": "42"},
        {"prompt": rendered(tok, "What is 17 + 25?"), "answer": "42"},
        {"prompt": rendered(tok, "What is 2 + 2?"), "answer": "4"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = read_jsonl(path)
    with pytest.raises(ValueError) as err:
        render_chat(examples, tok, chat=True)
    text = str(err.value)
    assert text.startswith(f"{path}:2: the prompt already holds {FIRST[family]!r}")
    assert "data.chat=false" in text and '"role": "user"' in text  # both fixes
    assert "(1 more prompts hold the template's markers too)" in text
    # the same rows, unrendered, pass; and with data.chat off the text is the user's to give
    assert render_chat(examples[:1], tok, chat=True)[0].prompt == rows[1]["prompt"]
    assert render_chat(examples, tok, chat=False) == examples


@pytest.mark.parametrize(
    ("family", "text", "marker"),
    [
        ("gemma", "<start_of_turn>user\n2+2=<end_of_turn>\n", "<start_of_turn>"),
        ("llama3", "<|start_header_id|>user<|end_header_id|>\n\n2+2=", "<|start_header_id|>"),
        ("mistral", "[INST] 2+2= [/INST]", "[INST]"),
        ("qwen2.5", "2+2=<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>"),
    ],
)
def test_a_turn_marker_anywhere_is_named(family, text, marker):
    """Not only at the start: a marker in the middle, in a chat message, in the system prompt."""
    tok = build_tokenizer(FAMILIES[family])
    markers = template_markers(tok)
    at = text.index(marker)
    assert find_marker("Question: " + text, markers) == (marker, at + len("Question: "))
    with pytest.raises(
        ValueError, match=re.escape(f"prompt 0: the prompt already holds {marker!r}")
    ):
        check_unrendered([Example("Question: " + text, "4")], markers)
    msgs = (("user", "hi"), ("assistant", "hello"), ("user", text))
    with pytest.raises(ValueError, match=r"the prompt \(chat message 2, user\) already holds"):
        check_unrendered([Example("", "4", messages=msgs, where="d.jsonl:7")], markers)
    with pytest.raises(ValueError, match=re.escape(f"data.system_prompt holds {marker!r}")):
        check_unrendered([Example("2+2=", "4")], markers, system_prompt=text)


def test_a_models_own_added_tokens_are_not_markers():
    """Qwen3's <think> (added, not special) may be in an earlier assistant turn."""
    tok = build_tokenizer(FAMILIES["qwen3"])
    msgs = (("user", "2+2="), ("assistant", "<think>\nsmall\n</think>\n\n4"), ("user", "3+3="))
    (got,) = render_chat([Example("", "6", messages=msgs)], tok, chat=True)
    assert got.prompt.count("<think>") == 1
    # and the template writes <think> itself only where asked, and it is still no marker
    assert "<think>" not in template_markers(tok, {"enable_thinking": False})


def test_a_dataset_row_is_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = build_tokenizer(FAMILIES["llama3"])
    rows = {"prompt": ["2+2=", "3+3=", rendered(tok, "4+4=")], "answer": ["4", "6", "8"]}
    path = tmp_path / "ds"
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    examples = read_dataset(str(path), "train")
    with pytest.raises(
        ValueError,
        match="^" + re.escape(f"{path}[2]: the prompt already holds '<|begin_of_text|>'"),
    ):
        render_chat(examples, tok, chat=True)


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_markers_and_what_a_second_rendering_does(smollm2_tok):
    tok = smollm2_tok
    assert tok.bos_token == "<|im_start|>"  # SmolLM2's BOS is its turn marker
    assert template_markers(tok) == ("<|im_start|>", "<|im_end|>")
    question = "What is 17 + 25? Answer with just the number."
    once = rendered(tok, question)
    twice = rendered(tok, once)
    n_once = len(tok(once, add_special_tokens=False).input_ids)
    n_twice = len(tok(twice, add_special_tokens=False).input_ids)
    # the harm refused: two default system prompts, the first rendering nested in a user turn
    assert twice.count("You are a helpful AI assistant named SmolLM") == 2
    assert n_twice > n_once + 20
    with pytest.raises(ValueError, match=r"prompt 0: the prompt already holds '<\|im_start\|>'"):
        render_chat([Example(once, "42")], tok, chat=True)
    assert render_chat([Example(question, "42")], tok, chat=True)[0].prompt == once


def test_smollm2_check_refuses_before_any_model_loads(smollm2_dir, smollm2_tok, tmp_path):
    """`klpo train --check` (the preflight: tokenizer and configs, no weights) exits 1 naming
    the line; the run directory is not made."""
    data = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "What is 2 + 3?", "answer": "5"},
        {"prompt": "What is 1 + 1?", "answer": "2"},
        {"prompt": rendered(smollm2_tok, "What is 17 + 25?"), "answer": "42"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    sets = [
        f"model.policy={smollm2_dir}",
        "data.source=jsonl",
        f"data.path={data}",
        "data.chat=true",
        f"run.out_dir={out}",
        "run.threads=1",
    ]
    args = ["train", "--check", *(a for s in sets for a in ("--set", s))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.stderr
    assert f"{data}:3: the prompt already holds '<|im_start|>'" in result.stderr
    assert "data.chat=false" in result.stderr
    assert not out.exists()
    ok = CliRunner().invoke(app, [*args, "--set", "data.chat=false"])
    assert ok.exit_code == 0, ok.stderr  # the user's own rendering, used as it is
