"""Tests for klpo.train.data.task: the splits (determinism, disjointness, correct answers), batched
generation with left padding, and held-out accuracy on stub models that are known to be right,
wrong or half right."""

from __future__ import annotations

import re

import pytest
import torch

from klpo.train.data.task import ArithmeticTask, Example
from klpo.train.evaluate import generate, heldout_accuracy
from klpo.train.rollout.samplers import Decoding
from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer


def test_splits_are_deterministic_disjoint_and_cover_the_space():
    task = ArithmeticTask(max_operand=20, ops=("+", "-"), n_heldout=100, seed=3)
    train, heldout = task.splits()
    assert (train, heldout) == ArithmeticTask(20, ("+", "-"), 100, 3).splits()
    assert len(heldout) == 100
    assert len(train) + len(heldout) == task.size == 2 * 21 * 21
    prompts_train = {e.prompt for e in train}
    prompts_held = {e.prompt for e in heldout}
    assert prompts_train.isdisjoint(prompts_held)
    assert len(prompts_train | prompts_held) == task.size  # no problem twice
    # Another seed draws another held-out set.
    other = {e.prompt for e in ArithmeticTask(20, ("+", "-"), 100, seed=4).heldout}
    assert other != prompts_held


def test_answers_are_right():
    # Oracle: parse the prompt with a regex and compute with Python's int arithmetic.
    task = ArithmeticTask(max_operand=12, ops=("+", "-", "*"), n_heldout=10)
    for e in task.train + task.heldout:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", e.prompt).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert e.answer == str(expected)
    assert Example("12*12=", "144") in task.train + task.heldout
    assert Example("0-12=", "-12") in task.train + task.heldout


def test_default_task_and_answer_length():
    task = ArithmeticTask()
    assert (task.max_operand, task.ops, task.n_heldout, task.size) == (99, ("+",), 500, 10_000)
    assert task.max_answer_chars() == 3  # 99+99 = 198
    assert ArithmeticTask(ops=("-",)).max_answer_chars() == 3  # 0-99 = -99
    assert ArithmeticTask(ops=("*",)).max_answer_chars() == 4  # 99*99 = 9801
    # Pinned: the permutation depends only on Random(0).random(), stable across Python versions.
    assert [e.prompt for e in task.heldout[:3]] == ["9+93=", "43+15=", "35+73="]
    assert [e.prompt for e in task.train[:2]] == ["73+77=", "95+35="]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_operand": 0}, "max_operand must be an integer >= 1"),
        ({"ops": ("/",)}, r"ops must be a non-empty subset of \['\+', '-', '\*'\]"),
        ({"ops": ()}, "ops must be a non-empty subset"),
        ({"ops": ("+", "+")}, "must not repeat"),
        ({"max_operand": 2, "n_heldout": 9}, r"n_heldout must be an integer in \[1, 8\]"),
        ({"n_heldout": 0}, "n_heldout must be an integer"),
    ],
)
def test_bad_task_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticTask(**kwargs)


# ---------------------------------------------------------------------------------------------
# Generation and accuracy on stubs.


HF = "generate"  # the stub implements only transformers' `generate`


class StubLM:
    """Answers ``a op b=`` right (or wrong by one, for prompts chosen by ``wrong``), then EOS,
    then junk that must be cut away; checks that prompts arrive left-padded with a right mask."""

    def __init__(self, tokenizer, wrong=lambda prompt: False):
        self.tok = tokenizer
        self.wrong = wrong
        self.training = True
        self.calls = []

    def eval(self):
        self.training = False
        return self

    def train(self, mode=True):
        self.training = mode
        return self

    def parameters(self):
        return iter([torch.zeros(1)])

    def generate(self, *, input_ids, attention_mask, generation_config):
        assert not self.training and not torch.is_grad_enabled()
        g = generation_config
        max_new_tokens, eos_token_id, pad_token_id = (
            g.max_new_tokens,
            g.eos_token_id,
            g.pad_token_id,
        )
        if isinstance(eos_token_id, list):  # the stop set, as generate takes it
            eos_token_id = eos_token_id[0]
        sampling = {k: getattr(g, k) for k in ("do_sample", "temperature", "top_p", "top_k")}
        self.calls.append({"batch": input_ids.shape[0], **sampling})
        pad = pad_token_id
        assert torch.equal(attention_mask, (input_ids != pad).long())
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            n_pad = mask.index(1)
            assert all(m == 0 for m in mask[:n_pad]) and all(m == 1 for m in mask[n_pad:])
            prompt = self.tok.decode(ids[n_pad:])
            value = eval(prompt[:-1]) + (1 if self.wrong(prompt) else 0)  # the oracle
            new = [*self.tok.encode(str(value), add_special_tokens=False), eos_token_id]
            new += self.tok.encode("77", add_special_tokens=False)  # junk after EOS
            rows.append(ids + (new + [pad] * max_new_tokens)[:max_new_tokens])
        return torch.tensor(rows)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_accuracy_of_right_wrong_and_half_right_stubs(tokenizer):
    held = ArithmeticTask(max_operand=99, n_heldout=40, seed=1).heldout
    right = StubLM(tokenizer)
    assert (
        heldout_accuracy(
            right,
            tokenizer,
            held,
            Decoding(max_new_tokens=6, sampler=HF, greedy=True),
            batch_size=16,
        )
        == 1.0
    )
    assert right.training  # restored after evaluation
    assert [c["batch"] for c in right.calls] == [16, 16, 8]
    assert right.calls[0]["do_sample"] is False
    wrong = StubLM(tokenizer, wrong=lambda p: True)
    assert (
        heldout_accuracy(
            wrong, tokenizer, held, Decoding(max_new_tokens=6, sampler=HF, greedy=True)
        )
        == 0.0
    )
    odd = {e.prompt for e in held[1::2]}
    half = StubLM(tokenizer, wrong=lambda p: p in odd)
    assert (
        heldout_accuracy(half, tokenizer, held, Decoding(max_new_tokens=6, sampler=HF, greedy=True))
        == 0.5
    )  # 20 of 40
    # A name or a function scores the same way.
    assert (
        heldout_accuracy(
            half,
            tokenizer,
            held,
            Decoding(max_new_tokens=6, sampler=HF, greedy=True),
            reward="numeric",
        )
        == 0.5
    )


def test_generate_cuts_at_eos_and_truncates(tokenizer):
    examples = [Example("9+9=", "18"), Example("10+5=", "15")]
    prompts = [e.prompt for e in examples]
    assert generate(
        StubLM(tokenizer), tokenizer, prompts, Decoding(max_new_tokens=6, sampler=HF, greedy=True)
    ) == [
        "18",
        "15",
    ]
    # Two new tokens leave no room for EOS: the truncated text is returned, and it is wrong.
    assert generate(
        StubLM(tokenizer), tokenizer, prompts, Decoding(max_new_tokens=1, sampler=HF, greedy=True)
    ) == [
        "1",
        "1",
    ]
    stub = StubLM(tokenizer)
    generate(
        stub, tokenizer, prompts, Decoding(max_new_tokens=3, temperature=0.7, top_p=0.9, sampler=HF)
    )
    assert stub.calls[0] == {
        "batch": 2,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
    }


def test_generate_errors(tokenizer):
    with pytest.raises(ValueError, match="group_size and max_new_tokens must be >= 1, got 1 and 0"):
        generate(StubLM(tokenizer), tokenizer, ["1+1="], Decoding(max_new_tokens=0, greedy=True))
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        generate(StubLM(tokenizer), tokenizer, ["1+1="], Decoding(max_new_tokens=2), batch_size=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        generate(
            StubLM(tokenizer), tokenizer, ["1+1="], Decoding(max_new_tokens=2, temperature=0.0)
        )
    with pytest.raises(ValueError, match=r"rollout\.sampler must be one of"):
        Decoding(max_new_tokens=2, sampler="beam")
    with pytest.raises(ValueError, match="at least one example"):
        heldout_accuracy(StubLM(tokenizer), tokenizer, [], Decoding(max_new_tokens=2, greedy=True))


def test_left_padding_changes_no_greedy_completion(tokenizer):
    # A random tiny real model: a prompt's greedy completion alone equals its completion in a
    # left-padded batch beside longer prompts (positions come from the mask, padding is masked).
    torch.manual_seed(0)
    cfg = ReferenceConfig(
        hidden_size=32, num_layers=2, intermediate_size=64, num_heads=2, num_kv_heads=1
    )
    model = build_model(cfg, tokenizer)
    with torch.no_grad():  # the default init (std 0.02) is near uniform: make it opinionated
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    prompts = ["1+2=", "45+67=", "8+90=", "12345+1="]
    batched = generate(model, tokenizer, prompts, Decoding(max_new_tokens=5, greedy=True))
    alone = [
        generate(model, tokenizer, [p], Decoding(max_new_tokens=5, greedy=True))[0] for p in prompts
    ]
    assert batched == alone
    assert len(set(batched)) > 1  # not a degenerate constant model
