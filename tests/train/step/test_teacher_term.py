"""The teacher term: with the teacher equal to the student every teacher KL, penalty and loss is
exactly 0 at step 1 (every estimator, dtype and LoRA switch); a teacher of another tokenizer is
refused; and the built-in student distils toward the built-in teacher."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from klpo import reduce, teacher
from klpo.heads import Head
from klpo.train.config import ConfigError, build_config
from klpo.train.models.build import build_models
from klpo.train.runtime.dist import Dist
from klpo.train.step.teacher_term import teacher_loss

from .test_step_one_exact import (
    PACKED_PROMPTS,
    TINY_PROMPTS,
    assert_exact,
    config,
    loaded_once,
    step_one,
)

TEACHER_TERMS = [
    {"estimator": "k1", "placement": "reward", "credit": "returns"},
    {"estimator": "k1", "placement": "reward", "credit": "token"},
    {"estimator": "k3", "placement": "loss"},
    {"estimator": "k2", "placement": "loss"},
    {"estimator": "full"},
    {"estimator": "forward"},
    {"estimator": "jsd", "jsd_beta": 0.3},
    {"estimator": "topk_forward", "top_k": 3, "clamp_zero": True},
    {"estimator": "topk_tail", "top_k": 3},
    {"estimator": "student_topk", "top_k": 3},
]


def _teacher(model: str, term: dict) -> str:
    fields = ", ".join(f"{k}: {v}" for k, v in {"model": model, **term}.items())
    return f"teacher={{{fields}}}"


@pytest.mark.parametrize(
    ("dtype", "lora", "packing"),
    [("float32", False, False), ("bfloat16", False, False), ("float32", True, False),
     ("bfloat16", True, False), ("float32", False, True), ("bfloat16", True, True)],
)  # fmt: skip
def test_a_teacher_equal_to_the_student_is_exactly_zero_at_step_one(
    tiny_model, dtype, lora, packing
) -> None:
    # packed (algo.packing): the teacher's pass keeps the packs scoring planned, and the
    # update's micro-batches of 4 of 6 rows cut through one
    prompts = PACKED_PROMPTS if packing else TINY_PROMPTS
    packed = ("algo.packing=on", "algo.micro_batch=4") if packing else ()
    cache: dict = {}
    with loaded_once(cache):
        m = None
        for term in TEACHER_TERMS:
            cfg = config(str(tiny_model), len(prompts), dtype=dtype, lora=lora,
                         extra=(_teacher(str(tiny_model), term), *packed))  # fmt: skip
            m = m or build_models(cfg, Dist(), None)
            got = step_one(cfg, m, prompts)
            assert "kl/teacher/exact" in got, term
            if term.get("placement", "loss") == "loss":
                assert "loss/teacher" in got, term
            assert_exact({"dtype": dtype, "lora": lora, "packing": packing, **term}, got)


@pytest.mark.parametrize(
    ("dtype", "lora"), [("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_the_forward_pass_gradient_of_a_teacher_equal_to_the_student_is_exactly_zero(
    tiny_model, dtype, lora
) -> None:
    """algo.fused_loss=on: the exact teacher terms (the forward KL and the JSD through
    klpo.teacher.from_hidden_loss, the reverse KL through the fused head)."""
    cache: dict = {}
    with loaded_once(cache):
        m = None
        for term in (
            {"estimator": "full"},
            {"estimator": "forward"},
            {"estimator": "jsd", "jsd_beta": 0.3},
        ):
            cfg = config(str(tiny_model), len(TINY_PROMPTS), dtype=dtype, lora=lora, fused=True,
                         extra=(_teacher(str(tiny_model), term),))  # fmt: skip
            m = m or build_models(cfg, Dist(), None)
            got = step_one(cfg, m, TINY_PROMPTS)
            assert "loss/teacher" in got, term
            assert_exact({"dtype": dtype, "lora": lora, "fused": True, **term}, got)


class _WithHead:
    """A stand-in model: what :func:`teacher_loss` reads of one, its ``head()``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._head = Head(weight, bias, None)

    def head(self) -> Head:
        return self._head


@pytest.mark.parametrize("estimator", ["full", "forward", "jsd"])
@pytest.mark.parametrize("frozen", [False, True])
def test_the_teacher_losss_forward_pass_gradient_is_the_per_token_paths(
    estimator, frozen, monkeypatch
) -> None:
    """algo.fused_loss on against off: the same value and gradients (float64, 1e-12) for a
    teacher unlike the student, masked tokens and a sequence-mean reduction; on calls
    klpo.teacher.from_hidden_loss for the forward KL and the JSD (``full`` stays on the fused
    head, measured faster), off never; a frozen head (LoRA) gets no gradient."""
    g = torch.Generator().manual_seed(5)
    f = torch.float64
    b, c, v, h, ht = 3, 4, 11, 5, 7
    hidden, hidden_t = (
        torch.randn(b, c, h, generator=g, dtype=f),
        torch.randn(b, c, ht, generator=g, dtype=f),
    )
    weight, bias = torch.randn(v, h, generator=g, dtype=f), torch.randn(v, generator=g, dtype=f)
    teacher_m = _WithHead(torch.randn(v, ht, generator=g, dtype=f), None)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    tokens = torch.zeros(b, c, dtype=torch.long)
    cfg = build_config(overrides=[
        "rollout.temperature=0.8", "algo.loss_reduction=seq-mean-token-mean",
        _teacher("builtin-teacher", {"estimator": estimator, "jsd_beta": 0.3}),
    ])  # fmt: skip

    def red(x: torch.Tensor) -> torch.Tensor:
        return reduce.reduce(x, mask, "seq-mean-token-mean", normaliser=2.0)

    calls = []
    eager = teacher.from_hidden_loss
    monkeypatch.setattr(
        teacher, "from_hidden_loss", lambda *a, **k: calls.append(1) or eager(*a, **k)
    )
    out = {}
    for mode in ("on", "off"):
        cfg.algo.fused_loss = mode
        x = hidden.clone().requires_grad_(True)
        w, bb = (t.clone().requires_grad_(not frozen) for t in (weight, bias))
        m = type("Models", (), {"backbone": _WithHead(w, bb), "teacher": teacher_m})()
        loss = teacher_loss(cfg, m, x, None, hidden_t, None, {}, red, tokens)
        (2.5 * loss).backward()
        out[mode] = (loss.detach(), x.grad, w.grad, bb.grad)
    assert len(calls) == (0 if estimator == "full" else 1)
    assert torch.allclose(out["on"][0], out["off"][0], rtol=0, atol=1e-12)
    assert float(out["on"][0]) > 0
    for name, a, b_ in zip(
        ("hidden", "weight", "bias"), out["on"][1:], out["off"][1:], strict=True
    ):
        if frozen and name != "hidden":
            assert a is None and b_ is None, name
        else:
            assert torch.allclose(a, b_, rtol=0, atol=1e-12), name
    assert not out["on"][1][~mask].any()  # masked tokens: no gradient


def test_a_teacher_of_another_tokenizer_is_refused(tiny_model, tmp_path, quick) -> None:
    from transformers import AutoTokenizer

    from klpo.train.loop import check_run

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_tokens(["<extra>"])  # one token more: ids no longer mean the same strings
    shutil.copytree(tiny_model, other)
    tok.save_pretrained(other)
    cfg = build_config(
        overrides=[
            *quick(tiny_model, tmp_path / "run"),
            _teacher(str(other), {"estimator": "full"}),
        ]
    )
    with pytest.raises(
        ConfigError, match=r"teacher.model .* has another tokenizer than model.policy.*GOLD-style"
    ):
        check_run(cfg, log=lambda *_: None)


@pytest.mark.parametrize(
    ("term", "words"),
    [
        (
            {"estimator": "forward", "placement": "reward"},
            "as a detached reward it would not depend",
        ),
        ({"estimator": "k3", "credit": "token"}, "with teacher.placement=loss there is no reward"),
        ({"estimator": "full", "clamp_zero": True}, "has none: set it to topk_forward"),
        ({"estimator": "k9"}, "unknown teacher estimator 'k9'"),
    ],
)
def test_a_teacher_term_that_cannot_work_is_refused_by_name(term, words) -> None:
    with pytest.raises(ConfigError, match=words):
        build_config(overrides=[_teacher("builtin-teacher", term)])


def test_no_reward_function_needs_a_teacher() -> None:
    with pytest.raises(ConfigError, match="or a teacher distils the policy"):
        build_config(overrides=["rewards=[]"])
    assert build_config(overrides=["rewards=[]", _teacher("builtin-teacher", {})]).teacher


@pytest.mark.slow
def test_the_built_in_student_distils_toward_the_built_in_teacher(tmp_path) -> None:
    from klpo.train.loop import train

    run = tmp_path / "opd"
    cfg = build_config(overrides=[
        f"run.out_dir={run}", "run.steps=20", "run.eval_every=20", "run.threads=1",
        "run.progress=false", "rewards=[]", "kl.placement=none",
        _teacher("builtin-teacher", {"estimator": "full"}),
    ])  # fmt: skip
    train(cfg, log=lambda *_: None)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl/teacher/exact"] for r in rows if "kl/teacher/exact" in r]
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert last < 0.95 * first, (first, last)  # the exact reverse KL to the teacher falls
    acc = [r["accuracy/heldout"] for r in rows if "accuracy/heldout" in r]
    assert acc[-1] >= acc[0] + 0.03, acc  # 500 problems: 15 more right at least
