"""The teacher term: with the teacher equal to the student every teacher KL, penalty and loss is
exactly 0 at step 1 (every estimator, dtype and LoRA switch); a teacher of another tokenizer is
refused; and the built-in student distils toward the built-in teacher."""

from __future__ import annotations

import json
import shutil

import pytest

from klpo.train.config import ConfigError, build_config
from klpo.train.models.build import build_models
from klpo.train.runtime.dist import Dist

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
