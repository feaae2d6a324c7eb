"""The built-in chat task (data.source: builtin-chat-arith), its reward and the accuracy interval."""

from __future__ import annotations

import math
import re

import pytest

from klpo.train import loop
from klpo.train.config import PLAIN_CHAT_STOP, ConfigError, build_config
from klpo.train.data.chat_task import (
    INSTRUCTION,
    KINDS,
    SYSTEM_PROMPT,
    ChatArithmeticTask,
    plain_prompt,
)
from klpo.train.data.load import load_examples
from klpo.train.data.sources import render_chat
from klpo.train.evaluate import wilson_interval
from klpo.train.rewards.functions import numeric
from klpo.train.runtime.metrics import read_metrics


def _families():
    """The tokenizer-family builders of tests/train/klpo_families.py (loaded by path)."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "klpo_families"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).parents[1] / f"{name}.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


SMALL = ChatArithmeticTask(n_heldout=300, n_train=3000, seed=0)

# Each kind's question, read back with a pattern written from the templates, and its answer
# computed here by independent arithmetic on the numbers read.
PATTERNS = {
    "add": (re.compile(r"What is (\d+) \+ (\d+)\?"), lambda a, b: a + b),
    "more": (
        re.compile(r"\w+ has (\d+) \w+\. (?:He|She) gets (\d+) more\. How many \w+ does \w+ have now\?"),
        lambda a, b: a + b,
    ),
    "left": (
        re.compile(r"\w+ had (\d+) \w+\. (?:He|She) gave away (\d+)\. How many \w+ are left\?"),
        lambda a, b: a - b,
    ),
    "groups": (
        re.compile(r"\w+ has (\d+) \w+ with (\d+) \w+ in each\. How many \w+ is that in all\?"),
        lambda a, b: a * b,
    ),
}  # fmt: skip


def _question(example) -> str:
    text = example.messages[-1][1]
    assert text.endswith(" " + INSTRUCTION)
    return text[: -len(INSTRUCTION) - 1]


def test_the_same_seed_gives_the_same_problems_and_another_seed_others():
    a, b = SMALL.splits(), ChatArithmeticTask(n_heldout=300, n_train=3000, seed=0).splits()
    assert a == b
    other = ChatArithmeticTask(n_heldout=300, n_train=3000, seed=1).splits()
    assert [e.messages for e in other[1]] != [e.messages for e in a[1]]
    # A smaller split is a prefix of the larger one: eval_size only cuts.
    assert ChatArithmeticTask(n_heldout=300, n_train=10).splits()[1] == a[1]


def test_splits_are_disjoint_distinct_and_sized():
    train, heldout = SMALL.splits()
    assert (len(train), len(heldout)) == (3000, 300)
    qs_train = [_question(e) for e in train]
    qs_held = [_question(e) for e in heldout]
    assert len(set(qs_train)) == 3000 and len(set(qs_held)) == 300
    assert not set(qs_train) & set(qs_held)


def test_every_answer_is_right_by_independent_arithmetic():
    train, heldout = SMALL.splits()
    seen = dict.fromkeys(KINDS, 0)
    for e in train + heldout:
        kind = e.columns["kind"]
        pattern, op = PATTERNS[kind]
        m = pattern.fullmatch(_question(e))
        assert m, (kind, _question(e))
        a, b = int(m.group(1)), int(m.group(2))
        assert e.answer == str(op(a, b)) == e.columns["answer"]
        if kind in ("add", "more"):
            assert 10 <= a <= 99 and 10 <= b <= 99
        elif kind == "left":
            assert 10 <= b < a <= 99  # never negative, never zero
        else:
            assert 2 <= a <= 9 and 2 <= b <= 12
        seen[kind] += 1
    # Equal weights: each kind is a quarter of 3,300 draws, within 4 binomial sds (sd = 24.9).
    sd = math.sqrt(3300 * 0.25 * 0.75)
    assert all(abs(n - 825) < 4 * sd for n in seen.values()), seen


def test_each_problem_is_a_system_prompt_a_solved_example_and_the_question():
    e = SMALL.splits()[1][0]
    roles = [r for r, _ in e.messages]
    assert roles == ["system", "user", "assistant", "user"]
    assert e.messages[0][1] == SYSTEM_PROMPT
    # The solved example is itself right.
    assert e.messages[1][1] == f"What is 12 + 7? {INSTRUCTION}" and e.messages[2][1] == "19"
    # The data row holds the messages as TRL's conversational form, the answer and the kind.
    assert e.columns["prompt"][-1] == {"role": "user", "content": e.messages[-1][1]}
    assert e.where == "builtin-chat-arith[0]"


def test_shots_put_the_solved_examples_before_the_same_problems():
    one = ChatArithmeticTask(n_heldout=40, n_train=40)
    per_kind = ChatArithmeticTask(n_heldout=40, n_train=40, shots="per-kind")
    none = ChatArithmeticTask(n_heldout=40, n_train=40, shots="none")
    for a, b, c in zip(
        *(t.splits()[1] + t.splits()[0] for t in (one, per_kind, none)), strict=True
    ):
        # The problem, its answer and its place do not depend on the shots.
        assert a.messages[-1] == b.messages[-1] == c.messages[-1]
        assert a.answer == b.answer == c.answer and a.where == b.where == c.where
        assert [r for r, _ in c.messages] == ["system", "user"]
        assert [r for r, _ in b.messages] == ["system", *["user", "assistant"] * 4, "user"]
        assert b.messages[1:3] == a.messages[1:3]  # the addition comes first
    # Each solved example is one of its kind (read back by the kinds' patterns), rightly solved
    # by arithmetic done here, and no problem of either split.
    e = per_kind.splits()[1][0]
    shots = [(e.messages[i][1], e.messages[i + 1][1]) for i in range(1, 9, 2)]
    for kind, (q, answer) in zip(KINDS, shots, strict=True):
        pattern, op = PATTERNS[kind]
        m = pattern.fullmatch(q[: -len(INSTRUCTION) - 1])
        assert m, (kind, q)
        assert answer == str(op(int(m.group(1)), int(m.group(2))))
    questions = {q for q, _ in shots}
    full = ChatArithmeticTask(shots="per-kind")
    assert not questions & {x.messages[-1][1] for s in full.splits() for x in s}


def test_shots_are_a_data_key_of_the_chat_task_only():
    cfg = build_config(overrides=["data.source=builtin-chat-arith", "data.shots=per-kind"])
    _, heldout = load_examples(cfg)
    assert len(heldout[0].messages) == 10
    with pytest.raises(ValueError, match="shots must be one of one, per-kind, none"):
        ChatArithmeticTask(shots="two")
    with pytest.raises(ConfigError, match=r"shots is only read by data\.source=builtin-chat-arith"):
        build_config(overrides=["data.shots=none"])


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="n_heldout must be an integer"):
        ChatArithmeticTask(n_heldout=0)
    with pytest.raises(ValueError, match="n_train must be an integer"):
        ChatArithmeticTask(n_train=10**6)


def test_the_source_defaults_to_chat_and_the_numeric_reward():
    cfg = build_config(overrides=["data.source=builtin-chat-arith", "data.eval_size=50"])
    assert cfg.data.chat is True
    assert [t.name for t in cfg.rewards] == ["numeric"]
    train, heldout = load_examples(cfg)
    assert len(heldout) == 50 and len(train) == 5000
    assert heldout == ChatArithmeticTask().splits()[1][:50]
    # Given explicitly, each is kept.
    cfg = build_config(
        overrides=["data.source=builtin-chat-arith", "rewards=[{name: exact_match}]"]
    )
    assert [t.name for t in cfg.rewards] == ["exact_match"]


def test_chat_off_poses_the_same_problems_as_plain_text():
    """data.chat=false (a model without a chat template): each problem's prompt is the plain
    text written here by hand from the same messages, the problems and answers are the chat
    form's, and a completion stops at a newline unless rollout.stop is given."""
    cfg = build_config(overrides=["data.source=builtin-chat-arith", "data.chat=false"])
    assert cfg.rollout.stop == list(PLAIN_CHAT_STOP) == ["\n", "\n\n", "\n\n\n"]
    train, heldout = load_examples(cfg)
    chat_train, chat_heldout = ChatArithmeticTask().splits()
    assert len(train) == len(chat_train) and len(heldout) == 500
    for e, c in zip(heldout[:50] + train[:50], chat_heldout[:50] + chat_train[:50], strict=True):
        question = c.messages[-1][1]
        assert e.prompt == (
            f"{SYSTEM_PROMPT}\n\nQuestion: What is 12 + 7? {INSTRUCTION}\nAnswer: 19\n\n"
            f"Question: {question}\nAnswer:"
        )
        assert e.messages is None and e.answer == c.answer
        assert e.columns == {"prompt": e.prompt, "answer": c.answer, "kind": c.columns["kind"]}
    assert render_chat(heldout[:3], tokenizer=None, chat=False) == heldout[:3]  # kept as it is
    per_kind = ChatArithmeticTask(n_heldout=1, n_train=1, shots="per-kind", chat=False)
    assert per_kind.splits()[1][0].prompt.count("\nAnswer: ") == 4  # the four solved examples
    none = ChatArithmeticTask(n_heldout=1, n_train=1, shots="none", chat=False).splits()[1][0]
    assert (
        none.prompt.startswith(f"{SYSTEM_PROMPT}\n\nQuestion: ") and "Answer: " not in none.prompt
    )
    # Given, the stop is kept; with chat on, no stop is added.
    given = ["data.source=builtin-chat-arith", "data.chat=false", "rollout.stop=['.']"]
    assert build_config(overrides=given).rollout.stop == ["."]
    assert build_config(overrides=["data.source=builtin-chat-arith"]).rollout.stop == []


def test_plain_prompt_refuses_what_has_no_place_in_it():
    with pytest.raises(ValueError, match=r"message 1 \('system'\) has no place"):
        plain_prompt((("user", "q"), ("system", "s")))
    with pytest.raises(ValueError, match=r"message 0 \('assistant'\)"):
        plain_prompt((("assistant", "19"), ("user", "q")))
    with pytest.raises(ValueError, match="must end with a user message"):
        plain_prompt((("user", "q"), ("assistant", "19")))


def test_a_plain_prompt_gets_the_tokenizers_bos_once():
    """On a tokenizer built to Gemma's conventions (its post-processor adds <bos>), the plain
    prompt's ids are <bos> and then the text's own characters, one id each: the BOS once."""
    from klpo.train.models.tokens import Codec, check_single_bos

    families = _families()
    tok = families.build_tokenizer(families.FAMILIES["gemma"])
    cfg = build_config(overrides=["data.source=builtin-chat-arith", "data.chat=false"])
    e = load_examples(cfg)[1][0]
    codec = Codec.plain(tok)
    (ids,) = codec.ids([e.prompt])
    chars = families.FAMILIES["gemma"].ids()
    assert ids == [tok.bos_token_id, *(chars[ch] for ch in e.prompt)]
    check_single_bos(codec, ids, "builtin-chat-arith[0]", e.prompt)  # no error
    assert "one BOS" in codec.describe(e.prompt)[1]


@pytest.mark.real
def test_gemma_reads_the_plain_prompt_with_one_bos(gemma3_dir):
    """Gemma 3 270M base (no chat template): data.chat=true is refused naming data.chat=false;
    the plain prompt's ids begin with <bos> once, end with the tokens of "Answer:", and the
    default stop covers the newline tokens Gemma writes after an answer (ids 107-109)."""
    from transformers import AutoTokenizer

    from klpo.train.data.sources import check_chat_template
    from klpo.train.models.tokens import Codec, stop_set

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    with pytest.raises(ValueError, match=r"set data\.chat=false"):
        check_chat_template(tok)
    cfg = build_config(overrides=["data.source=builtin-chat-arith", "data.chat=false"])
    e = load_examples(cfg)[1][0]
    (ids,) = Codec.plain(tok).ids([e.prompt])
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids[1:]) == e.prompt and tok.decode(ids[-2:]).endswith("Answer:")
    stop = stop_set(tok, None, cfg.rollout.stop)
    newlines = [tok.convert_tokens_to_ids(s) for s in ("\n", "\n\n", "\n\n\n")]
    assert set(newlines) <= set(stop.ids) and not stop.strings
    completion = tok(" 85\n\nQuestion:", add_special_tokens=False).input_ids
    assert next(i for i, t in enumerate(completion) if t in stop.ids) == 3  # after " 85"


@pytest.mark.parametrize(
    ("completion", "answer", "right"),
    [
        ("42", "42", 1.0),
        ("42.", "42", 1.0),
        (" 42 ", "42", 1.0),
        ("17 + 25 = 42", "42", 1.0),  # the last number is the answer
        ("17 + 25 = 32", "42", 0.0),  # SmolLM2's own first answer
        ("Max has 4 rows with 7 pencils, so 4 * 7 = 28 pencils.", "28", 1.0),
        ("19", "42", 0.0),  # the solved example's answer, copied
        ("42 apples, or 43", "42", 0.0),  # the final number counts, not the first
        ("There are 8 x 4 = 24 pencils in each jar. 24 / 4 =", "32", 0.0),  # cut off
        ("1,200", "1200", 1.0),
        ("", "42", 0.0),
        ("forty-two", "42", 0.0),
    ],
)
def test_numeric_reads_the_final_number(completion, answer, right):
    assert numeric([""], [completion], [answer]) == [right]


def _wilson_by_scan(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson interval by its definition, {p : |k/n - p| <= z sqrt(p (1 - p) / n)}, found by
    bisection on each side of k/n in float64 (no closed form used)."""
    phat = k / n

    def inside(p: float) -> bool:
        return abs(phat - p) <= z * math.sqrt(p * (1 - p) / n)

    def edge(lo: float, hi: float, inside_at_hi: bool) -> float:
        for _ in range(200):
            mid = (lo + hi) / 2
            if inside(mid) == inside_at_hi:
                hi = mid
            else:
                lo = mid
        return (lo + hi) / 2

    low = 0.0 if inside(0.0) else edge(0.0, phat, True)
    high = 1.0 if inside(1.0) else edge(1.0, phat, True)
    return low, high


@pytest.mark.parametrize(("k", "n"), [(30, 200), (0, 10), (10, 10), (1, 3), (81, 263), (57, 100)])
def test_wilson_interval_against_its_definition(k, n):
    lo, hi = wilson_interval(k, n)
    want_lo, want_hi = _wilson_by_scan(k, n)
    assert lo == pytest.approx(want_lo, abs=1e-12) and hi == pytest.approx(want_hi, abs=1e-12)
    assert 0 <= lo <= k / n <= hi <= 1


def test_wilson_interval_hand_cases_and_errors():
    # k = 0: the interval is [0, z² / (n + z²)]; n = 10, z = 1.96: 3.8415 / 13.8415 = 0.27753.
    lo, hi = wilson_interval(0, 10)
    assert lo == 0 and hi == pytest.approx(0.27753, abs=1e-5)
    # Newcombe (1998), Table II, example (a): 81/263 gives 0.2553 to 0.3662.
    lo, hi = wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    for k, n in ((3, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="successes"):
            wilson_interval(k, n)


def test_an_evaluation_says_its_interval_for_a_0_1_reward():
    from klpo.train.evaluate import Evaluation

    ev = Evaluation(accuracy=0.15, reward="numeric", first=None, scores=[1.0] * 30 + [0.0] * 170)
    assert ev.summary() == "0.150 (30/200 right; 95% interval 0.107-0.206)"
    # A problem the reward does not score is left out, as in the accuracy.
    ev = Evaluation(accuracy=0.5, reward="numeric", first=None, scores=[1.0, 0.0, None])
    assert ev.summary().startswith("0.500 (1/2 right; ")
    # A graded reward has no binomial interval.
    assert Evaluation(0.25, "graded", None, [0.5, 0.0]).summary() == "0.250"


def test_smollm2_renders_the_task_as_chatml(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    e = render_chat(SMALL.splits()[1][:1], tok, chat=True)[0]
    # Our system prompt replaces the template's default one; the solved example is a real turn.
    assert e.prompt.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")
    assert e.prompt.count("<|im_start|>") == 5 and "SmolLM" not in e.prompt
    assert "<|im_start|>assistant\n19<|im_end|>\n" in e.prompt
    assert e.prompt.endswith(f"{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(e.prompt, add_special_tokens=False).input_ids
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5 and len(ids) < 128


def test_train_a_step_on_the_chat_task(smollm2_tiny, quick, tmp_path):
    out = tmp_path / "run"
    overrides = quick(
        smollm2_tiny, out, **{"data.source": "builtin-chat-arith", "data.eval_size": 4}
    )
    overrides = [o for o in overrides if not o.startswith("rewards=")]  # the source's default
    cfg = build_config(overrides=[*overrides, "run.steps=1", "run.eval_every=1"])
    assert cfg.data.chat and [t.name for t in cfg.rewards] == ["numeric"]
    lines: list[str] = []
    loop.train(cfg, log=lambda *a: lines.append(" ".join(map(str, a))))
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "accuracy/heldout" in r] == [0, 1]
    assert "reward/numeric" in rows[-1]
    # Before and after, each with its count and interval (4 problems).
    for step in (0, 1):
        said = [x for x in lines if x.startswith(f"held-out accuracy at step {step}: ")]
        assert len(said) == 1 and "/4 right; 95% interval " in said[0], lines


def test_the_eval_scripts_mcnemar_p_value_by_enumeration():
    """bench/chat_arith_eval.py's exact McNemar p-value against the sign test written out: the
    probability, under a fair coin on each changed problem, of a split at least as uneven."""
    import importlib.util
    import itertools
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "chat_arith_eval.py"
    spec = importlib.util.spec_from_file_location("chat_arith_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for gained, lost in [(0, 0), (5, 0), (3, 3), (10, 2), (1, 7), (4, 6)]:
        m = gained + lost
        observed = abs(gained - lost)
        outcomes = list(itertools.product((0, 1), repeat=m))
        extreme = sum(1 for o in outcomes if abs(2 * sum(o) - m) >= observed)
        assert module.mcnemar_exact(gained, lost) == pytest.approx(extreme / len(outcomes))
    # 5 gained, none lost: 2 / 2^5 by hand.
    assert module.mcnemar_exact(5, 0) == 0.0625
