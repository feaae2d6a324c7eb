"""Tests for klpo.train.tools.make_reference: the tokenizer, the SFT loss against a naive float64 oracle, a tiny
make-reference run that saves, reloads by path and reproduces itself, the command line, and the
shipped reference (present, small, and as accurate as it claims)."""

from __future__ import annotations

import dataclasses
import json
import string

import pytest
import torch
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train.data.task import Example
from klpo.train.evaluate import heldout_accuracy
from klpo.train.rollout.samplers import Decoding
from klpo.train.tools import make_reference as reference
from klpo.train.tools.make_reference import (
    ReferenceConfig,
    Schedule,
    build_model,
    build_tokenizer,
    load_reference,
    make_reference,
    supervised_finetune,
)

TINY = ReferenceConfig(
    max_operand=9,
    n_heldout=10,
    hidden_size=32,
    num_layers=1,
    intermediate_size=64,
    num_heads=2,
    num_kv_heads=1,
    steps=3,
    batch_size=8,
    warmup=2,
    n_val=10,
    eval_every=2,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tokenizer_round_trip(tokenizer):
    text = "47+38=85 #### 1,234.5\nabc XYZ\t!?"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, no special token added
    assert tokenizer.decode(ids) == text
    every = "".join(reference.CHARACTERS)
    assert tokenizer.decode(tokenizer.encode(every, add_special_tokens=False)) == every
    assert set(every) == set(string.printable) - set("\x0b\x0c\r")
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    assert len(tokenizer) == 4 + len(every) == 101
    assert tokenizer.padding_side == "left"
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([*ids[:2], eos, 0], skip_special_tokens=True) == text[:2]


def test_sft_loss_is_the_answer_token_cross_entropy(tokenizer):
    # Oracle: a float64 log-softmax of the model's logits, summed over answer + EOS positions only.
    torch.manual_seed(0)
    model = build_model(TINY, tokenizer).double()
    batch = [Example("1+2=", "3"), Example("12+34=", "46")]
    inputs = reference.sft_batch(tokenizer, batch)
    loss = model(**inputs).loss
    total, count = 0.0, 0
    for e in batch:
        p = tokenizer.encode(e.prompt, add_special_tokens=False)
        a = [*tokenizer.encode(e.answer, add_special_tokens=False), tokenizer.eos_token_id]
        ids = torch.tensor([p + a])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        for j, token in enumerate(a):  # position len(p) - 1 + j predicts answer token j
            total -= logp[len(p) - 1 + j, token].item()
            count += 1
    assert count == 2 + 3  # "3</s>" and "46</s>"
    # transformers' loss casts the logits to float32 first: float32 rounding, rel ~1e-7.
    assert loss.item() == pytest.approx(total / count, rel=1e-6)
    # Right padding: prompts start at position 0; labels ignore the prompt and the padding.
    assert inputs["labels"][0].tolist()[:4] == [-100] * 4
    assert inputs["attention_mask"][0].tolist() == [1] * 6 + [0] * 3


def test_supervised_finetune_lowers_the_loss(tokenizer):
    torch.manual_seed(0)
    model = build_model(TINY, tokenizer)
    train = TINY.task().train
    losses = supervised_finetune(
        model, tokenizer, train, Schedule(steps=30, batch_size=16, lr=1e-2)
    )
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    with pytest.raises(ValueError, match="at least one example"):
        supervised_finetune(model, tokenizer, [], Schedule(steps=1, batch_size=1, lr=1e-3))


def test_make_reference_saves_reloads_and_reproduces(tmp_path, tokenizer):
    result = make_reference(tmp_path / "ref", TINY)
    path = result.path
    assert {p.name for p in path.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "reference.json",
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    meta = json.loads((path / "reference.json").read_text())
    assert meta["config"] == json.loads(json.dumps(dataclasses.asdict(TINY)))
    assert meta["heldout_accuracy"] == result.heldout_accuracy
    assert len(result.losses) == TINY.steps
    # Reload by path: same weights, same tokenizer, same accuracy.
    model, tok = load_reference(path)
    assert model.dtype == torch.float32
    assert tok.encode("12+3=", add_special_tokens=False) == tokenizer.encode(
        "12+3=", add_special_tokens=False
    )
    held = TINY.task().heldout
    acc = heldout_accuracy(
        model, tok, held, Decoding(max_new_tokens=TINY.max_new_tokens(), greedy=True)
    )
    assert acc == result.heldout_accuracy
    # Seeded: a second run is bit-identical; another seed is not.
    again = make_reference(tmp_path / "again", TINY)
    assert reference.same_weights(path, again.path)
    other = make_reference(tmp_path / "other", dataclasses.replace(TINY, seed=1))
    assert not reference.same_weights(path, other.path)
    # Existing output is protected unless overwrite is asked for.
    with pytest.raises(FileExistsError, match="overwrite"):
        make_reference(path, TINY)
    make_reference(path, dataclasses.replace(TINY, seed=1), overwrite=True)
    assert reference.same_weights(path, other.path)


def test_make_reference_stops_at_the_validation_accuracy(tmp_path, monkeypatch):
    # Scripted validation accuracies 0.1, 0.2, 0.35, ...: with stop_at_accuracy 0.3 and an
    # evaluation every 2 steps, training stops after the third evaluation, at step 6 of 50.
    scripted = iter([0.1, 0.2, 0.35, 0.9])
    seen = []

    def fake_accuracy(model, tokenizer, examples, decoding):
        assert decoding == Decoding(max_new_tokens=config.max_new_tokens(), greedy=True)
        seen.append(len(examples))
        return next(scripted) if len(examples) == 7 else 0.25

    monkeypatch.setattr(reference, "heldout_accuracy", fake_accuracy)
    sft_data = []
    real_sft = reference.supervised_finetune

    def recording_sft(model, tokenizer, examples, schedule, **kwargs):
        assert schedule == config.schedule()
        sft_data.extend(examples)
        return real_sft(model, tokenizer, examples, schedule, **kwargs)

    monkeypatch.setattr(reference, "supervised_finetune", recording_sft)
    config = dataclasses.replace(TINY, steps=50, n_val=7, stop_at_accuracy=0.3)
    progress = []
    result = make_reference(tmp_path / "r", config, on_step=lambda *a: progress.append(a))
    assert result.steps == 6 and len(result.losses) == 6
    assert (result.val_accuracy, result.heldout_accuracy) == (0.35, 0.25)
    assert seen == [7, 7, 7, 10]  # three validations, then the held-out split once
    assert [(s, acc) for s, _, acc in progress] == [
        (0, None),
        (1, 0.1),
        (2, None),
        (3, 0.2),
        (4, None),
        (5, 0.35),
    ]
    # The first 7 train problems validate; SFT sees the rest of the train split only.
    assert sft_data == config.task().train[7:]


def test_half_precision_storage_loads_as_float32(tmp_path):
    result = make_reference(tmp_path / "bf16", dataclasses.replace(TINY, save_dtype="bfloat16"))
    model, _ = load_reference(result.path)
    assert model.dtype == torch.float32
    from safetensors.torch import load_file

    stored = load_file(result.path / "model.safetensors")
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, "arch must be 'llama' or 'qwen2'"),
        ({"save_dtype": "int8"}, "save_dtype must be"),
        ({"hidden_size": 30, "num_heads": 4}, r"hidden_size \(30\) must be divisible"),
        ({"lr": 0.0}, "lr must be a positive number"),
        ({"steps": -1}, "steps and warmup must be >= 0"),
        ({"eval_every": 0}, "eval_every must be >= 1"),
        ({"stop_at_accuracy": 1.5}, r"stop_at_accuracy must be in \(0, 1\] or None"),
        ({"n_val": 9500}, r"n_val must be in \[1, 9499\]"),
    ],
)
def test_bad_reference_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReferenceConfig(**kwargs)


def test_qwen2_architecture(tokenizer):
    model = build_model(dataclasses.replace(TINY, arch="qwen2"), tokenizer)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings


def test_cli_make_reference(tmp_path):
    out = tmp_path / "cli-ref"
    args = [
        "make-reference",
        str(out),
        "--steps",
        "2",
        "--hidden-size",
        "32",
        "--num-layers",
        "1",
        "--intermediate-size",
        "64",
        "--batch-size",
        "4",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("make-reference 1/2 (50%)  loss ") and " ETA " in lines[0]
    assert lines[1].startswith("make-reference 2/2 (100%)  loss ") and "done in" in lines[1]
    assert "validation accuracy" in lines[1]
    assert f"wrote {out}" in result.output and "held-out accuracy" in result.output
    assert json.loads((out / "reference.json").read_text())["config"]["steps"] == 2
    again = CliRunner().invoke(app, args)
    assert again.exit_code != 0 and "--overwrite" in again.output
    bad = CliRunner().invoke(app, ["make-reference", str(tmp_path / "x"), "--arch", "gpt2"])
    assert bad.exit_code != 0 and "arch must be 'llama' or 'qwen2'" in bad.output


def test_shipped_reference():
    path = reference.default_reference_path()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 10 * 2**20
    meta = json.loads((path / "reference.json").read_text())
    config = ReferenceConfig(**{**meta["config"], "ops": tuple(meta["config"]["ops"])})
    assert config == ReferenceConfig()  # the defaults reproduce the shipped model
    assert 0.2 <= meta["heldout_accuracy"] <= 0.6
    model, tok = load_reference()
    acc = heldout_accuracy(
        model,
        tok,
        config.task().heldout,
        Decoding(max_new_tokens=config.max_new_tokens(), greedy=True),
    )
    assert acc == meta["heldout_accuracy"]
