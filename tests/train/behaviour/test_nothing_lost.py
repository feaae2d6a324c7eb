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
    text = result.output  # (stdout and stderr together)
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


# ---------------------------------------------------------------------------------------------
# The study: interrupted, terminated, or meeting a trainer that is still running.

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
SRC = HERE.parents[1] / "src"


def subprocess_env() -> dict[str, str]:
    import os

    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def tiny_study_file(path: Path, tiny_model: Path, seeds: list[int], steps: int = 6) -> Path:
    """A study of ``len(seeds)`` runs of the tiny model; its reward sleeps 0.3 s per call, so a
    step lasts long enough to be interrupted in the middle."""
    import yaml

    study = {
        "choices": [{"estimator": "k3", "placement": "loss"}],
        "betas": [0.1],
        "seeds": seeds,
        "steps": steps,
        "eval_every": 100,
        "eval_size": 8,
        "workers": 1,
        "base": {
            "model.policy": str(tiny_model),
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 2,
            "rollout.max_new_tokens": 4,
            "optim.lr": 1e-2,
            "rewards": [{"name": "klpo_test_rewards:slow_digits"}],
        },
    }
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    return path


def wait_for(condition, what: str, timeout: float = 240.0) -> None:
    import time

    t0 = time.monotonic()
    while not condition():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_compare_stops_on_the_first_signal_and_a_re_run_finishes_it(tiny_model, tmp_path, how):
    """Ctrl-C (SIGINT to the terminal's process group) or SIGTERM (to compare alone): the
    trainer under way stops after its step with a checkpoint and is waited for, no further run
    starts, compare exits 128 + the signal naming what is not finished; the same command then
    continues the interrupted run from its checkpoint and runs the rest."""
    import os
    import signal
    import subprocess
    import sys

    import yaml

    spec = tiny_study_file(tmp_path / "study.yaml", tiny_model, seeds=[0, 1])
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "klpo", "compare", "-c", str(spec), "--out", str(out)]
    proc = subprocess.Popen(
        cmd,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal gives a command
        # and SIGINT at its default, as in a foreground terminal: a test run started in the
        # background (nohup, `&`, some CI runners) hands its children SIGINT ignored, which klpo
        # leaves so on purpose
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = out / "runs" / "grpo_k3-loss_b0.1_s0"
    lock = first / ".klpo.lock"

    def started() -> bool:
        return proc.poll() is not None or bool(
            (first / "metrics.jsonl").is_file() and lock.read_text().strip()
        )

    wait_for(started, "step 1")
    assert proc.poll() is None, proc.communicate()[0]
    trainer = json.loads(lock.read_text())["pid"]
    sig = signal.SIGINT if how == "ctrl-c" else signal.SIGTERM
    if how == "ctrl-c":
        os.killpg(proc.pid, sig)  # what the terminal does: the whole foreground group
    else:
        os.kill(proc.pid, sig)  # what a scheduler or `kill` does: compare alone
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + sig, text
    assert not alive(trainer), "the trainer outlived compare"
    assert f"stopped by {signal.Signals(sig).name}: 0 of 2 runs finished" in text, text
    assert "Not finished: grpo_k3-loss_b0.1_s0, grpo_k3-loss_b0.1_s1" in text, text
    assert "Traceback" not in text
    assert not (out / "runs" / "grpo_k3-loss_b0.1_s1").exists()  # never started
    assert yaml.safe_load((first / "result.yaml").read_text())["status"] == "interrupted"
    assert (first / "checkpoints" / "latest").is_file()
    steps_then = [r["step"] for r in map(json.loads, (first / "metrics.jsonl").open())]
    assert 1 <= steps_then[-1] < 6
    again = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    log = (out / "logs" / "grpo_k3-loss_b0.1_s0.txt").read_text()
    assert "continued from its last checkpoint" in log
    rows = [yaml.safe_load((d / "result.yaml").read_text()) for d in (out / "runs").iterdir()]
    assert sorted((r["status"] in ("ok", "collapsed"), r["steps_done"]) for r in rows) == [
        (True, 6),
        (True, 6),
    ], rows
    steps_now = [r["step"] for r in map(json.loads, (first / "metrics.jsonl").open())]
    assert [s for s in steps_now if s >= 1] == [1, 2, 3, 4, 5, 6]  # continued, none twice


def test_compare_never_clears_a_run_directory_a_live_trainer_holds(tiny_model, tmp_path):
    """A trainer left running by an earlier compare holds its run's lock: the re-run is refused
    before anything starts, naming it, and every file stays as it was."""
    import subprocess
    import sys

    import yaml

    from klpo.study.spec import load_study

    spec = tiny_study_file(tmp_path / "study.yaml", tiny_model, seeds=[0])
    out = tmp_path / "out"
    run_dir = out / "runs" / "grpo_k3-loss_b0.1_s0"
    run_dir.mkdir(parents=True)
    study = load_study(spec, quick=False, task="builtin")  # as the earlier compare wrote it
    (out / "study.yaml").write_text(yaml.safe_dump(study.model_dump(), sort_keys=False))
    (run_dir / "config.yaml").write_text("half a run\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from klpo.train.outdir import DirLock\n"
         f"with DirLock({str(run_dir)!r}, 'klpo train', option='run.out_dir'):\n"
         "    print('held', flush=True); time.sleep(120)\n"],
        env=subprocess_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path)
        text = clean_error(
            cli("compare", "-c", str(spec), "--out", str(out)),
            2,
            "is being written by klpo train (pid",
            "a trainer of an earlier klpo compare",
            "kill the pid",
        )
        assert str(holder.pid) in text
        after = snapshot(tmp_path)
        assert {k: v for k, v in after.items() if k != "out/.klpo.lock"} == {
            k: v for k, v in before.items() if k != "out/.klpo.lock"
        }
    finally:
        holder.kill()
        holder.wait()


def test_a_crashed_run_is_run_again_not_reused(tmp_path, monkeypatch):
    """A run recorded as crashed (or interrupted) is not a result: a re-run starts it again."""
    import yaml

    from klpo.study import runner
    from klpo.study.grid import study_grid
    from klpo.study.spec import Choice, StudyConfig

    study = StudyConfig(
        choices=[Choice(estimator="k3", placement="loss")], betas=[0.1], seeds=[0, 1], steps=2
    )
    runs = study_grid(study)
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study.model_dump(), sort_keys=False))
    for run, status in zip(runs, ["crashed", "ok"], strict=True):
        d = tmp_path / "runs" / run.name
        d.mkdir(parents=True)
        (d / "result.yaml").write_text(yaml.safe_dump({"name": run.name, "status": status}))
    assert runner.finished_row(tmp_path / "runs" / runs[0].name) is None
    assert runner.finished_row(tmp_path / "runs" / runs[1].name)["status"] == "ok"
    started = []

    class Proc:
        pid = 12345

        def wait(self):
            return 0

    def popen(self, cmd, **kw):
        started.append(cmd)
        return Proc()

    monkeypatch.setattr(runner._Signals, "popen", popen)
    monkeypatch.setattr(
        runner, "summarise_run", lambda run, *a, **k: {"name": run.name, "status": "ok"}
    )
    monkeypatch.setattr(runner, "write_results", lambda *a, **k: None)
    rows = runner.run_study(study, tmp_path)
    assert len(started) == 1 and f"run.out_dir={tmp_path / 'runs' / runs[0].name}" in started[0]
    assert [r["status"] for r in rows] == ["ok", "ok"]


# ---------------------------------------------------------------------------------------------
# Resume: in place, forward, with what it lost said, and never past a lock.


def hold_lock(run_dir: Path):
    """A process holding ``run_dir``'s lock, as a run in progress does (kill it when done)."""
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import time\n"
         "from klpo.train.outdir import DirLock\n"
         f"with DirLock({str(run_dir)!r}, 'klpo train', option='run.out_dir'):\n"
         "    print('held', flush=True); time.sleep(120)\n"],
        env=subprocess_env(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_resume_is_refused_where_it_cannot_do_what_it_is_asked(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    first = cli("train", *[a for o in quick(tiny_model, out) for a in ("--set", o)])
    assert first.exit_code == 0, first.output
    assert (out / "checkpoints" / "step_000003").is_dir()
    before = snapshot(tmp_path)
    other = tmp_path / "other"
    clean_error(
        cli("train", "--resume", str(out), "--set", f"run.out_dir={other}"),
        2,
        f"--resume {out} continues that run in place, so run.out_dir={other} cannot apply",
        f"cp -r {out} {other}",
    )
    clean_error(
        cli("train", "--resume", str(out), "--set", "run.steps=2"),
        1,
        f"--resume {out}: run.steps=2 is behind its checkpoint, which is at step 3",
        "Give run.steps above 3",
    )
    holder = hold_lock(out)
    try:
        clean_error(
            cli("train", "--resume", str(out), "--set", "run.steps=5", "--check"),
            1,
            f"run.out_dir '{out}' is being written by klpo train (pid {holder.pid}",
        )
    finally:
        holder.kill()
        holder.wait()
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k != "run/.klpo.lock"} == {
        k: v for k, v in before.items() if k != "run/.klpo.lock"
    }
    assert not other.exists()
    ok = cli("train", "--resume", str(out), "--set", "run.steps=5", "--check")
    assert ok.exit_code == 0 and "check passed" in ok.output, ok.output


def test_a_resume_without_metrics_says_what_is_lost(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    first = cli("train", *[a for o in quick(tiny_model, out) for a in ("--set", o)])
    assert first.exit_code == 0, first.output
    (out / "metrics.jsonl").unlink()
    kept = snapshot(out / "checkpoints" / "step_000003")
    again = cli("train", "--resume", str(out), "--set", "run.steps=4")
    assert again.exit_code == 0, again.output
    assert (
        f"note: {out / 'metrics.jsonl'} is missing or empty: the metrics of steps 1–3 are lost; "
        "the run continues from step 3 and the file will hold steps 4–4 only"
    ) in again.output
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()]
    assert [s for s in steps if s >= 1] == [4]
    report = (out / "report.md").read_text()
    assert "steps 4–4; those of steps 1–3 are not in the file" in report
    assert snapshot(out / "checkpoints" / "step_000003") == kept


# ---------------------------------------------------------------------------------------------
# Tracebacks and unclear words: the user's file and line, the plain reason.


def test_a_reward_module_that_fails_to_import_names_its_file_line_and_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad_syntax.py").write_text(
        "def f(prompts, completions, answers):\n    return [1.0 for c in completions\n"
    )
    (tmp_path / "bad_raise.py").write_text("import json\n\nSCALE = 1 / 0\n")
    before = snapshot(tmp_path)
    out = f"run.out_dir={tmp_path / 'run'}"
    cases = {
        "bad_syntax": [
            f"importing module 'bad_syntax' failed with SyntaxError at {tmp_path}/bad_syntax.py:2",
            "'[' was never closed",
        ],
        "bad_raise": [
            "importing module 'bad_raise' failed with ZeroDivisionError at "
            f"{tmp_path}/bad_raise.py:3: division by zero",
        ],
    }
    for module, words in cases.items():
        reward = f"rewards=[{{name: '{module}:f'}}]"
        result = cli("train", "--check", "--set", reward, "--set", out)
        clean_error(result, 1, *words, f"python -c 'import {module}'")
        lines = [x for x in result.output.strip().splitlines() if not x.startswith("config: ")]
        assert len(lines) == 1, result.output  # one message, after the line naming the config
    assert {k: v for k, v in snapshot(tmp_path).items() if "__pycache__" not in k} == before


def test_unclear_inputs_get_plain_words(tiny_model, quick, tmp_path):
    """A data column named as a trainer argument, refused before any model loads, naming the
    line; a UTF-8 byte-order mark read; a data.path that is a directory said so;
    run.report_to=none accepted; a .klpo.lock that is a directory named."""
    from klpo.train.data.sources import read_jsonl

    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2", "completions": "x"}\n')
    trl = "[{name: 'klpo_test_rewards:trl_digits_by_task'}]"
    base = [f"run.out_dir={tmp_path / 'run'}", "data.source=jsonl", f"data.path={data}"]
    before = snapshot(tmp_path)
    clean_error(
        cli("train", "--check", *[a for o in [*base, f"rewards={trl}"] for a in ("--set", o)]),
        1,
        f"{data}:1: the data has a column 'completions', the name of an argument the trainer "
        "gives every TRL-form reward function",
        "rename that column",
    )
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')
    assert [e.answer for e in read_jsonl(bom)] == ["2"]
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match="is a directory; give the path of the JSONL"):
        read_jsonl(folder)
    from klpo.train.config import build_config

    assert build_config(overrides=["run.report_to=none"]).run.report_to == []
    assert build_config(overrides=["run.report_to=tensorboard"]).run.report_to == ["tensorboard"]
    assert snapshot(tmp_path) == {**before, "bom.jsonl": bom.read_bytes()}
    run = tmp_path / "locked"
    (run / ".klpo.lock").mkdir(parents=True)
    clean_error(
        cli("train", *[a for o in quick(tiny_model, run) for a in ("--set", o)]),
        1,
        f"{run / '.klpo.lock'} is a directory, not the lock file klpo keeps there",
        "remove it",
    )


# ---------------------------------------------------------------------------------------------
# Full disks: said with what is kept and how to go on; the directory left resumable.


def test_a_full_disk_at_a_metrics_write_is_said_and_left_resumable(
    tiny_model, quick, tmp_path, monkeypatch
):
    import errno
    import os

    from klpo.train.runtime import metrics

    out = tmp_path / "run"
    real = metrics.MetricsWriter.write

    def write(self, step, values):
        if step >= 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real(self, step, values)

    monkeypatch.setattr(metrics.MetricsWriter, "write", write)
    args = [a for o in quick(tiny_model, out) for a in ("--set", o)]
    clean_error(
        cli("train", *args),
        1,
        f"could not write {out / 'metrics.jsonl'} in {out}: No space left on device (the disk "
        "is full: ",
        "no checkpoint was written yet, so the resume starts again from step 0",
        f"continue with klpo train --resume {out}",
    )
    kept = snapshot(out, skip=(".klpo.lock",))
    monkeypatch.undo()  # space freed: the advice given works
    again = cli("train", "--resume", str(out))
    assert again.exit_code == 0, again.output
    assert (out / "metrics.before-restart-1.jsonl").read_bytes() == kept["metrics.jsonl"]


def test_a_full_disk_under_tensorboard_is_said_once_without_its_thread_traceback(
    tiny_model, quick, tmp_path, monkeypatch
):
    import errno
    import os

    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(record_writer.RecordWriter, "write", full)
    out = tmp_path / "run"
    args = [a for o in quick(tiny_model, out, **{"run.tensorboard": True}) for a in ("--set", o)]
    text = clean_error(
        cli("train", *args),
        1,
        f"in {out}: No space left on device (the disk is full",
        f"continue with klpo train --resume {out}",
    )
    assert "Exception in thread" not in text and text.count("No space left") == 1, text


def test_a_full_disk_under_docs_lab_report_and_make_reward_model_is_one_message(
    tmp_path, monkeypatch
):
    """Each file's fsync fails as on a full disk: one message and exit 1 (no traceback), the
    files already there byte-identical, no temporary left behind."""
    import errno
    import os

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    docs, report, rm = tmp_path / "docs", tmp_path / "report", tmp_path / "rm"
    docs.mkdir()
    (docs / "guide.md").write_text("# hand-written\n")
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "fsync", full)
    commands = [
        ("klpo docs", ["docs", "--out", str(docs)], docs),
        ("klpo lab report", ["lab", "report", "--quick", "--out", str(report)], report),
        ("klpo make-reward-model",
         ["make-reward-model", str(rm), "--n-pairs", "8", "--steps", "1", "--n-eval", "4"], rm),
    ]  # fmt: skip
    for command, args, out in commands:
        result = cli(*args)
        clean_error(
            result,
            1,
            f"error: {command} could not write",
            f"into {out}: No space left on device",
            "nothing half-written is left; free space and run the command again",
        )
    monkeypatch.undo()
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith((".tmp-", ".old-"))]
    assert not leftovers and not any(k.endswith(".tmp") for k in after), (leftovers, after)


def test_a_full_disk_in_safetensors_own_error_is_one_message(tmp_path, monkeypatch):
    """safetensors' writer reports a full disk as its own SafetensorError (not an OSError), the
    errno only in its text: ``klpo make-reward-model`` says it as every full disk is said."""
    import transformers.modeling_utils as modeling
    from safetensors import SafetensorError

    def full(*_args, **_kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(modeling, "safe_save_file", full)
    rm = tmp_path / "rm"
    result = cli("make-reward-model", str(rm), "--n-pairs", "8", "--steps", "1", "--n-eval", "4")
    clean_error(
        result,
        1,
        "error: klpo make-reward-model could not write",
        f"into {rm}: No space left on device",
        "nothing half-written is left; free space and run the command again",
    )
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith((".tmp-", ".old-"))]
