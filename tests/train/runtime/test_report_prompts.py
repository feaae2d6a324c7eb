"""report.md's prompt column: a chat prompt's last user message, not the start of the rendered
text (for SmolLM2 the default system prompt, the same on every row)."""

from __future__ import annotations

from klpo.train.data.sources import Example, render_chat
from klpo.train.runtime.samples import (
    last_user_message,
    samples_table,
    user_messages,
    with_user_messages,
)


def record(prompt: str, completion: str = "42") -> dict:
    return {"step": 3, "split": "train", "index": 0, "prompt": prompt, "completion": completion,
            "answer": "42", "reward": 1.0, "rewards": {}, "kl": {}}  # fmt: skip


def prompt_cells(table: str) -> list[str]:
    return [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]


def test_last_user_message_of_a_conversation():
    turns = (("system", "be brief"), ("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"))
    assert last_user_message(turns) == "and 3+3?"
    assert last_user_message((("system", "s"), ("assistant", "a"))) == "a"  # no user: the last


def test_records_get_the_user_message_after_the_prompt_and_plain_ones_stay():
    users = {"<rendered>": "2+2?"}
    plain = record("73+77=")
    got = with_user_messages([record("<rendered>"), plain], users)
    assert list(got[0])[:6] == ["step", "split", "index", "prompt", "user", "completion"]
    assert got[0]["user"] == "2+2?" and got[1] is plain
    # a table of plain prompts is as it was: the text, under "prompt"
    table = samples_table([plain])
    assert table.splitlines()[0].startswith("| prompt | completion |")
    assert prompt_cells(table) == ["73+77="]


def test_smollm2_rows_show_each_question_not_the_system_prompt(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    questions = ["What is 17 + 25? Answer with just the number.", "What is 6 * 7?"]
    chat = render_chat([Example(q, "42") for q in questions], tok, chat=True)
    records = [record(e.prompt) for e in chat]
    # the bug: the rendered text's first 80 characters are the default system prompt, the same
    # on every row
    old = prompt_cells(samples_table(records))
    assert old[0] == old[1] and old[0].startswith("<\\|im_start\\|>system⏎You are a helpful AI")
    table = samples_table(with_user_messages(records, user_messages(chat)))
    assert table.splitlines()[0].startswith("| prompt (last user message) | completion |")
    assert prompt_cells(table) == questions
    # with a system prompt of the data's own, and a conversation: still the last user turn
    convo = Example("", "9", messages=(("user", "2+2?"), ("assistant", "4"), ("user", "4+5?")))
    (rendered,) = render_chat([convo], tok, chat=True, system_prompt="Answer with a number.")
    assert user_messages([rendered]) == {rendered.prompt: "4+5?"}


def test_the_answer_column_is_left_out_where_no_record_has_one():
    # data whose answers are in another column (a `solution` read by the reward functions)
    rows = [{**record("2+2="), "answer": None}, {**record("3+3=", "6"), "answer": None}]
    table = samples_table(rows)
    assert table.splitlines()[0] == "| prompt | completion | reward |"
    assert table.splitlines()[2] == "| 2+2= | 42 | 1 |"
    # one record with an answer keeps the column for all
    head = samples_table([rows[0], record("5+5=")]).splitlines()[0]
    assert head == "| prompt | completion | answer | reward |"
