"""Nothing lost, nothing silent: the faults a new user meets after the first round of fixes.

Each case checks the exit code, the message's key words, and that every file already there is
byte-identical afterwards (``snapshot``): ``--overwrite`` keeps the user's files, a reward that
returns the wrong thing is refused naming it, a study interrupted is finished on a re-run, a
resume that cannot do what it is asked is refused, a full disk is said and leaves no dead end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo.cli import app

runner = CliRunner()


def cli(*args: str):
    return runner.invoke(app, list(args))


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes), but those under ``skip``."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not str(p.relative_to(root)).startswith(skip)
    }


def clean_error(result, code: int, *fragments: str) -> str:
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == code, text
    assert "Traceback" not in text
    for f in fragments:
        assert f in text, (f, text)
    return text


# ---------------------------------------------------------------------------------------------
# --overwrite replaces only what the command itself wrote.

REFERENCE_ARGS = [
    "--steps", "1", "--hidden-size", "16", "--num-layers", "1", "--intermediate-size", "32",
    "--batch-size", "4",
]  # fmt: skip


def user_files(out: Path) -> None:
    (out / "notes.md").write_text("# my notes on this model\n")
    (out / "evals").mkdir()
    (out / "evals" / "heldout.json").write_text('{"accuracy": 0.41}\n')


def test_make_reference_overwrite_keeps_the_users_files(tmp_path):
    out = tmp_path / "ref"
    first = cli("make-reference", str(out), *REFERENCE_ARGS)
    assert first.exit_code == 0, first.output
    written = json.loads((out / "reference.json").read_text())["files"]
    assert "model.safetensors" in written and "reference.json" in written
    user_files(out)
    mine = snapshot(out, skip=tuple(written))
    assert set(mine) == {"notes.md", "evals/heldout.json"}
    again = cli("make-reference", str(out), *REFERENCE_ARGS, "--seed", "1", "--overwrite")
    assert again.exit_code == 0, again.output
    assert snapshot(out, skip=tuple(written)) == mine  # the user's files, byte for byte
    assert json.loads((out / "reference.json").read_text())["config"]["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_make_reward_model_overwrite_keeps_the_users_files(tmp_path):
    out = tmp_path / "rm"
    args = ["make-reward-model", str(out), "--n-pairs", "8", "--steps", "1", "--n-eval", "4"]
    first = cli(*args)
    assert first.exit_code == 0, first.output
    written = json.loads((out / "reward_model.json").read_text())["files"]
    user_files(out)
    mine = snapshot(out, skip=tuple(written))
    again = cli(*args, "--overwrite")
    assert again.exit_code == 0, again.output
    assert snapshot(out, skip=tuple(written)) == mine
    # an earlier reward model that lists no files (older klpo): only the names written now go
    meta = json.loads((out / "reward_model.json").read_text())
    (out / "reward_model.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "files"})
    )
    (out / "old_extra.bin").write_bytes(b"\x00\x01")
    mine = snapshot(out, skip=tuple(written))
    third = cli(*args, "--overwrite")
    assert third.exit_code == 0, third.output
    assert snapshot(out, skip=tuple(written)) == mine


# ---------------------------------------------------------------------------------------------
# Rewards: one number (or None) per completion, in a list, tuple, array or tensor.


def test_a_reward_returns_a_sequence_of_numbers_or_is_refused_by_name_and_type():
    import numpy as np
    import torch

    from klpo.train.rewards.functions import RewardError, score

    prompts, completions, answers = ["a", "b", "c"], ["1", "2", "3"], ["1", "1", "1"]

    def returning(value):
        return lambda prompts, completions, answers: value

    for ok in ([1, 0.5, None], (1, 0.5, None), np.array([1.0, 0.5, 0.0]), torch.tensor([1, 0, 2])):
        got = score(returning(ok), "mine", prompts, completions, answers)
        assert len(got) == 3 and got[0] == 1.0, (ok, got)
    with pytest.raises(RewardError) as dict_error:
        score(returning({0: 1.0, 1: 0.0, 2: 1.0}), "mine", prompts, completions, answers)
    assert "'mine' returned a dict" in str(dict_error.value)
    assert "list(d.values())" in str(dict_error.value)  # its keys would have been the rewards
    bad = [{1.0, 0.0, 0.5}, (x for x in [1.0, 0.0, 0.5]), "101", 1.0, torch.ones(3, 1)]
    for value in bad:
        with pytest.raises(RewardError, match=rf"'mine' returned a {type(value).__name__}"):
            score(returning(value), "mine", prompts, completions, answers)
    with pytest.raises(RewardError, match=r"of shape \(3, 1\)"):
        score(returning(np.ones((3, 1))), "mine", prompts, completions, answers)


def test_a_trl_reward_returning_a_dict_stops_the_run_naming_it(tiny_model, quick, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("keep\n")
    before = snapshot(tmp_path)
    out = tmp_path / "run"
    args = quick(tiny_model, out, rewards="[{name: 'klpo_robust_rewards:as_dict'}]")
    text = clean_error(
        cli("train", *[a for o in args for a in ("--set", o)]),
        1,
        "reward function 'klpo_robust_rewards:as_dict' returned a dict",
        "list(d.values())",
    )
    assert "Traceback" not in text
    assert {k: v for k, v in snapshot(tmp_path).items() if k in before} == before
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_a_null_answer_is_refused_with_its_line(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": null}\n')
    before = snapshot(tmp_path)
    sets = ["data.source=jsonl", f"data.path={data}", f"run.out_dir={tmp_path / 'run'}"]
    clean_error(
        cli("train", "--check", *[a for o in sets for a in ("--set", o)]),
        1,
        f"{data}:2: field 'answer' is null",
    )
    assert snapshot(tmp_path) == before and not (tmp_path / "run").exists()


def test_rewards_that_score_nothing_are_said(tiny_model, quick, tmp_path):
    """A training reward that returns None for everything: a warning at the first such step. A
    gold reward that does: the held-out accuracy cannot be measured, refused (not 0.000)."""
    out = tmp_path / "run"
    extra = {"rewards": "[{name: 'klpo_robust_rewards:never_scores'}]", "run.eval_every": 0}
    warned = cli("train", *[a for o in quick(tiny_model, out, **extra) for a in ("--set", o)])
    assert warned.exit_code == 0, warned.output
    assert warned.output.count("no reward function ('klpo_robust_rewards:never_scores')") == 1
    assert "step 1: no reward function" in warned.output
    out2 = tmp_path / "run2"
    gold = quick(tiny_model, out2, gold_reward="klpo_robust_rewards:never_scores")
    clean_error(
        cli("train", *[a for o in gold for a in ("--set", o)]),
        1,
        "'klpo_robust_rewards:never_scores', which scores the held-out accuracy, returned None "
        "for every one of the 8 held-out completions",
    )
    assert not (out2 / "metrics.jsonl").exists() or not (out2 / "metrics.jsonl").read_text()


# ---------------------------------------------------------------------------------------------
# The learning-rate schedule: its arguments and its reach, before any model loads.


def no_models(monkeypatch):
    from klpo.train import setup as train_setup

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(train_setup, "build_models", fail)


def test_schedule_kwargs_and_a_schedule_that_never_trains_are_refused_first(
    tiny_model, quick, tmp_path, monkeypatch
):
    no_models(monkeypatch)
    out = tmp_path / "run"
    cases = [
        (
            {"optim.lr_scheduler": "constant_with_warmup",
             "optim.lr_scheduler_kwargs": "{min_lr_rate: 0.1}"},
            ["'min_lr_rate' is not an argument of the constant_with_warmup schedule",
             "takes none"],
        ),
        (
            {"optim.lr_scheduler": "cosine", "optim.lr_scheduler_kwargs": "{min_lr_rate: 0.1}"},
            ["'min_lr_rate' is not an argument of the cosine schedule, which takes num_cycles",
             "cosine_with_min_lr"],
        ),
        (
            {"optim.lr_scheduler": "linear", "run.steps": 1},
            ["the learning rate is 0 at every one of the run's 1 steps", "nothing would train"],
        ),
    ]  # fmt: skip
    for extra, words in cases:
        args = quick(tiny_model, out, **extra)
        clean_error(cli("train", *[a for o in args for a in ("--set", o)]), 1, *words)
        assert not out.exists()
    fine = quick(
        tiny_model, out, **{"optim.lr_scheduler": "cosine_with_min_lr",
                            "optim.lr_scheduler_kwargs": "{min_lr_rate: 0.1}"}
    )  # fmt: skip
    ok = cli("train", "--check", *[a for o in fine for a in ("--set", o)])
    assert ok.exit_code == 0, ok.output


def test_a_warm_up_longer_than_the_run_is_warned_with_the_peak(tiny_model, quick, tmp_path):
    args = quick(tiny_model, tmp_path / "run", **{"run.steps": 4, "optim.warmup_steps": 100})
    result = cli("train", "--check", *[a for o in args for a in ("--set", o)])
    assert result.exit_code == 0, result.output
    assert (
        "warning: optim.warmup_steps=100 is longer than the run (run.steps=4): the learning "
        "rate peaks at 4.0% of optim.lr=0.01 (step 4)"
    ) in result.output
