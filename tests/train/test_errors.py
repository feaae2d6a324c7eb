"""Bad inputs and faults: each gets one clear error, a non-zero exit without a traceback, and
leaves every file already written as it was.

Most cases fail in the preflight, before a model loads; a few need a short run of the tiny model
(``quick`` in conftest) or a subprocess (signals, torchrun).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from klpo.cli import app
from klpo.train import loop, preflight
from klpo.train import setup as train_setup
from klpo.train.config import ConfigError, build_config
from klpo.train.data.sources import Example, read_jsonl
from klpo.train.runtime import checkpoint as ck
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.stop import StopOnSignal

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
runner = CliRunner()


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def cli(*args: str):
    return runner.invoke(app, list(args))


def clean_error(result, code: int, *fragments: str) -> str:
    """The output of a CLI call that exited with ``code``, printed ``fragments``, no traceback."""
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert result.exit_code == code, text
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in text
    for f in fragments:
        assert f in text, (f, text)
    return text


def no_models(monkeypatch):
    """Make loading a model fail loudly: a check that passes this ran before any model loaded."""

    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the check")

    monkeypatch.setattr(train_setup, "build_models", fail)


def train(cfg, **kw):
    lines: list[str] = []
    loop.train(cfg, log=lines.append, **kw)
    return lines


# ---------------------------------------------------------------------------------------------
# No work lost: metrics never overwritten, a checkpoint on SIGINT/SIGTERM, no dead ends.


def test_a_fresh_run_never_replaces_metrics_and_resume_has_no_dead_end(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 1}))
    train(cfg)
    before = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match=r"already holds a run.*--resume .*another run.out_dir"):
        train(cfg)
    assert (out / "metrics.jsonl").read_bytes() == before
    # Killed before its first checkpoint: metrics, no checkpoint. A fresh start is still refused,
    # and --resume starts again from step 0 with the old metrics kept beside the new ones.
    shutil.rmtree(out / "checkpoints")
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg)
    lines = train(cfg, resume=True)
    assert any("no complete checkpoint: the run starts again from step 0" in x for x in lines)
    assert (out / "metrics.before-restart-1.jsonl").read_bytes() == before
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]


@pytest.mark.slow
def test_sigterm_before_the_first_checkpoint_saves_one_and_says_where(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    args = sets(
        quick(
            tiny_model,
            out,
            **{"run.steps": 200, "rewards": "[{name: 'klpo_test_rewards:slow_digits'}]"},
        )
    )
    cmd = [sys.executable, "-m", "klpo", "train", *args]
    proc = subprocess.Popen(cmd, env=env(), stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and any(r.get("step", 0) >= 1 for r in read_metrics(metrics)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err
    step = max(r["step"] for r in read_metrics(metrics))
    ckpt = out / "checkpoints" / f"step_{step:06d}"
    assert f"stopped by SIGTERM after step {step}; the checkpoint is {ckpt}" in err
    assert f"klpo train --resume {out}" in err
    assert ck.checkpoint_problem(ckpt) is None
    kept = metrics.read_bytes()

    again = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "already holds a run" in again.stderr
    assert "Traceback" not in again.stderr and metrics.read_bytes() == kept

    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "klpo",
            "train",
            "--resume",
            str(out),
            "--set",
            f"run.steps={step + 1}",
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"from step {step}" in resumed.stderr
    assert [r["step"] for r in read_metrics(metrics)][-2:] == [step, step + 1]


@pytest.fixture
def default_signals():
    """SIGINT and SIGTERM as in a foreground terminal (a background job ignores SIGINT)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_a_signal_sets_a_flag_and_the_same_one_again_interrupts(default_signals):
    before = signal.getsignal(signal.SIGINT)
    with StopOnSignal() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.requested and stop.name == "SIGINT"
        # What torchrun forwards to its workers after a Ctrl-C: the same request, no interrupt.
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert stop.name == "SIGINT"
        time.sleep(StopOnSignal.REPEAT_S)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
    assert signal.getsignal(signal.SIGINT) == before  # the handler in place before is back


def test_an_ignored_signal_stays_ignored(default_signals):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as nohup or a background job leaves it
    with StopOnSignal() as stop:
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert not stop.requested


@pytest.mark.slow
def test_torchrun_a_reward_failing_on_one_rank_stops_the_group(tiny_model, quick, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    args = sets(
        quick(
            tiny_model,
            tmp_path / "run",
            **{"rewards": "[{name: 'klpo_test_rewards:fails_on_rank_0'}]", "run.eval_every": 0},
        )
    )
    cmd = [str(torchrun), "--nproc_per_node", "2", "-m", "klpo", "train", *args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 200
    assert "rank 0: error: reward function 'klpo_test_rewards:fails_on_rank_0' raised" in out
    assert "the reward service is down" in out
    assert "klpo/train/" not in out  # no traceback from the ranks (torchrun prints its own)


# ---------------------------------------------------------------------------------------------
# Checkpoints: truncated files, a full disk, a removed pointer.


@pytest.fixture
def two_checkpoints(tiny_model, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, policy=model, optimizers={"policy": opt})
    return tmp_path


@pytest.mark.parametrize(
    "name", ["policy/model.safetensors", "optim.safetensors", "rng.safetensors"]
)
def test_a_truncated_latest_checkpoint_falls_back_to_the_one_before(two_checkpoints, name):
    path = two_checkpoints / "checkpoints" / "step_000002" / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    found, notes = ck.find_checkpoint(two_checkpoints)
    assert found == two_checkpoints / "checkpoints" / "step_000001"
    assert len(notes) == 1 and "step_000002 is incomplete" in notes[0]
    assert f"{Path(name).name} is truncated" in notes[0]


def test_header_only_and_missing_state_are_incomplete(two_checkpoints):
    step2 = two_checkpoints / "checkpoints" / "step_000002"
    (step2 / "rng.safetensors").write_bytes(b"\x10\x00")
    assert ck.checkpoint_problem(step2) == "rng.safetensors is truncated (2 bytes)"
    (step2 / "state.json").unlink()
    assert "state.json is missing" in ck.checkpoint_problem(step2)


def test_resume_after_a_truncated_checkpoint_says_so(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2, "run.save_every": 1}))
    train(cfg)
    optim = out / "checkpoints" / "step_000002" / "optim.safetensors"
    optim.write_bytes(optim.read_bytes()[:100])
    more = build_config(overrides=quick(tiny_model, out, **{"run.steps": 3, "run.save_every": 1}))
    lines = train(more, resume=True)
    assert any("step_000002 is incomplete (optim.safetensors is truncated" in x for x in lines)
    assert f"resuming {out} from step 1" in lines
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_full_disk_at_the_first_save_is_no_dead_end(tiny_model, quick, tmp_path, monkeypatch):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 1}))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ck, "save_file", full)
    with pytest.raises(ck.CheckpointError) as err:
        train(cfg)
    text = str(err.value)
    assert "could not write the checkpoint of step 1" in text
    assert "No space left on device; no earlier checkpoint exists" in text
    assert f"klpo train --resume {out}" in text
    assert not list((out / "checkpoints").glob(".tmp-step_*"))
    rows = (out / "metrics.jsonl").read_bytes()
    assert rows
    monkeypatch.undo()
    lines = train(cfg, resume=True)  # the advice given works: no checkpoint, so from step 0
    assert any("starts again from step 0" in x for x in lines)
    assert (out / "metrics.before-restart-1.jsonl").read_bytes() == rows


def test_a_removed_latest_and_orphans_do_not_hide_checkpoints(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 1}))
    train(cfg)
    (out / "checkpoints" / "latest").unlink()
    orphan = out / "checkpoints" / ".tmp-step_000002-123"
    orphan.mkdir()
    (orphan / "rng.safetensors").write_bytes(b"partial")
    more = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2}))
    lines = train(more, resume=True)
    assert any(f"resuming {out} from step 1" in x for x in lines)
    assert any(f"removed {orphan}" in x for x in lines)
    assert not orphan.exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_a_failed_save_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch):
    import torch

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(ck, "save_file", full)  # the policy is written, then the disk is full
    step2 = two_checkpoints / "checkpoints" / "step_000002"
    policy = AutoModelForCausalLM.from_pretrained(step2 / "policy")
    opt = torch.optim.AdamW(policy.parameters())
    with pytest.raises(ck.CheckpointError, match="the previous checkpoint step_000002 is intact"):
        ck.save_checkpoint(two_checkpoints, 3, policy=policy, optimizers={"policy": opt})
    root = two_checkpoints / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001", "step_000002"]


# ---------------------------------------------------------------------------------------------
# Models: missing, truncated, not a model, no tokenizer, not in the local cache.


def model_copy(tiny_model: Path, dest: Path, skip: tuple[str, ...] = ()) -> Path:
    dest.mkdir(parents=True)
    for f in tiny_model.iterdir():
        if f.name not in skip:
            shutil.copy(f, dest / f.name)
    return dest


def test_bad_model_directories_are_named(tiny_model, tmp_path, monkeypatch):
    no_models(monkeypatch)
    base = ["train", "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "run.progress=false"]
    missing = tmp_path / "nowhere" / "model"
    clean_error(
        cli(*base, "--set", f"model.policy={missing}"),
        1,
        f"model.policy '{missing}': no such directory",
    )
    cut = model_copy(tiny_model, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    clean_error(
        cli(*base, "--set", f"model.policy={cut}"),
        1,
        f"model.policy '{cut}' is not a complete model directory",
        "cut/model.safetensors is truncated (1000 bytes",
    )
    empty = tmp_path / "notes"
    empty.mkdir()
    (empty / "readme.txt").write_text("not a model")
    clean_error(
        cli(*base, "--set", f"model.policy={empty}"), 1, f"'{empty}'", "config.json is missing"
    )
    bare = model_copy(
        tiny_model, tmp_path / "bare", skip=("tokenizer.json", "tokenizer_config.json")
    )
    clean_error(
        cli(*base, "--set", f"model.policy={bare}"),
        1,
        f"model.policy '{bare}' has no tokenizer",
        "tokenizer.save_pretrained",
    )
    half = model_copy(tiny_model, tmp_path / "half", skip=("tokenizer.json",))
    clean_error(
        cli(*base, "--set", f"model.policy={half}"),
        1,
        f"could not load the tokenizer of model.policy '{half}'",
    )
    clean_error(
        cli(*base, "--set", f"model.policy={tiny_model}", "--set", f"model.reference={cut}"),
        1,
        f"model.reference '{cut}' is not a complete model directory",
    )
    assert not (tmp_path / "run").exists()


def test_names_not_in_the_local_cache_fail_fast(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("KLPO_ALLOW_DOWNLOADS", raising=False)
    no_models(monkeypatch)
    base = ["train", "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "run.progress=false"]
    t0 = time.monotonic()
    clean_error(
        cli(*base, "--set", "model.policy=klpo-tests/no-such-model"),
        1,
        "model id 'klpo-tests/no-such-model' not found locally",
        "KLPO_ALLOW_DOWNLOADS=1",
    )
    clean_error(
        cli(
            *base,
            *("--set", f"model.policy={tiny_model}"),
            *("--set", "data.source=datasets", "--set", "data.path=klpo-tests/no-such-data"),
        ),
        1,
        "dataset 'klpo-tests/no-such-data' not found locally",
    )
    assert time.monotonic() - t0 < 20


# ---------------------------------------------------------------------------------------------
# Output directories, data files, prompts, tokenizers: checked before anything loads.


def test_output_directories_are_checked_first(tmp_path, monkeypatch):
    no_models(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    clean_error(
        cli("train", "--set", f"run.out_dir={blocker / 'run'}"),
        1,
        f"run.out_dir '{blocker / 'run'}' is under '{blocker}', which is a file",
    )
    clean_error(cli("lab", "report", "--quick", "--out", str(blocker)), 2, "--out", "is a file")
    clean_error(cli("docs", "--out", str(blocker / "docs")), 2, "which is a file")
    assert blocker.read_text() == "x"
    if os.geteuid() == 0:
        return  # root writes anywhere: the permission case cannot be made here
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        clean_error(
            cli("train", "--set", f"run.out_dir={locked / 'run'}"),
            1,
            f"would be created in '{locked}', which is not writable",
        )
    finally:
        locked.chmod(0o700)


def test_non_utf8_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9 1+2=", "answer": "3"}\n'
    )
    with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9 at column"):
        read_jsonl(path)


def jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def test_every_prompt_is_checked_at_load_against_both_limits(
    tiny_model, quick, tmp_path, monkeypatch
):
    no_models(monkeypatch)
    prompts = ["1+1="] * 30
    prompts[26] = "9" * 30 + "="
    late = jsonl(tmp_path / "late.jsonl", prompts)
    data = {"data.source": "jsonl", "data.path": str(late)}
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "a", **data, **{"data.max_prompt_tokens": 20})
    )
    with pytest.raises(
        ConfigError,
        match=r"late.jsonl:27: the prompt is 3\d tokens long, more than data.max_prompt_tokens=20",
    ):
        train(cfg)
    # 62 characters fit max_prompt_tokens (256) but not 64 positions less 4 new tokens.
    wide = jsonl(tmp_path / "wide.jsonl", ["1+1=", "2" * 61 + "="])
    cfg = build_config(
        overrides=quick(
            tiny_model, tmp_path / "b", **{"data.source": "jsonl", "data.path": str(wide)}
        )
    )
    with pytest.raises(
        ConfigError, match=r"wide.jsonl:2: .*the model's 64 positions less rollout.max_new_tokens=4"
    ):
        train(cfg)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_check_prompts_counts_the_others(tiny_model):
    from klpo.train.models.load import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    examples = [Example("12345", "1", where="f:1"), Example("1", "1"), Example("123456", "1")]
    with pytest.raises(ConfigError, match=r"f:1: the prompt is \d+ tokens .* \(1 more prompts"):
        preflight.check_prompts(
            examples, tok, max_prompt_tokens=3, max_positions=None, max_new_tokens=1
        )
    preflight.check_prompts(examples, tok, max_prompt_tokens=10, max_positions=64, max_new_tokens=4)


def test_a_reference_with_another_tokenizer_of_the_same_size_is_refused(
    tiny_model, quick, tmp_path, monkeypatch
):
    no_models(monkeypatch)
    ref = model_copy(tiny_model, tmp_path / "ref")
    spec = json.loads((ref / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # same size, two ids swapped
    (ref / "tokenizer.json").write_text(json.dumps(spec))
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "run", **{"model.reference": str(ref)})
    )
    with pytest.raises(
        ConfigError,
        match=r"model.reference .* has another tokenizer than model.policy .*: 101 and 101 tokens, "
        r"and token '[12]' has id \d in the policy's but \d in the reference's \(2 tokens differ\)",
    ):
        train(cfg)


# ---------------------------------------------------------------------------------------------
# Resume: a changed config or world size is refused unless allowed, and then recorded.


def test_resume_refuses_a_changed_config_unless_allowed(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 1}))
    train(cfg)
    saved = (out / "config.yaml").read_bytes()
    changed = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2, "kl.beta": 0.5}))
    with pytest.raises(
        ConfigError, match=r"config differs .*\(kl.beta: 0.1 -> 0.5\).*--allow-config-change"
    ):
        train(changed, resume=True)
    ppo = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2, "algo.name": "ppo"}))
    with pytest.raises(ConfigError, match=r"algo.name: 'grpo' -> 'ppo'"):
        train(ppo, resume=True)
    assert (out / "config.yaml").read_bytes() == saved
    # A checkpoint written by two processes, resumed by one.
    state = out / "checkpoints" / "step_000001" / "state.json"
    meta = json.loads(state.read_text())
    meta["rng"] = meta["rng"] * 2
    state.write_text(json.dumps(meta))
    longer = build_config(overrides=quick(tiny_model, out, **{"run.steps": 2}))
    with pytest.raises(ConfigError, match=r"processes: 2 -> 1"):
        train(longer, resume=True)
    lines = train(ppo, resume=True, allow_config_change=True)
    assert any("no critic" in x for x in lines)
    record = [json.loads(x) for x in (out / "config-changes.jsonl").read_text().splitlines()]
    assert record == [{"step": 1, "changes": {"algo.name": ["grpo", "ppo"], "processes": [2, 1]}}]
    assert "name: ppo" in (out / "config.yaml").read_text()


def test_cli_resume_with_a_changed_setting_exits_cleanly(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    train(build_config(overrides=quick(tiny_model, out, **{"run.steps": 1})))
    clean_error(
        cli("train", "--resume", str(out), "--set", "kl.beta=0.5"),
        1,
        "kl.beta: 0.1 -> 0.5",
        "--allow-config-change",
    )
    clean_error(cli("train", "--allow-config-change"), 2, "only applies with --resume")


# ---------------------------------------------------------------------------------------------
# compare: a re-run with other settings, a bad option.


def test_compare_refuses_finished_runs_of_other_settings(tmp_path):
    import yaml

    from klpo.study.grid import study_grid
    from klpo.study.runner import run_study
    from klpo.study.spec import Choice, StudyConfig

    study = StudyConfig(
        choices=[Choice(estimator="k3", placement="loss")], betas=[0.1], seeds=[0], steps=2
    )
    (run,) = study_grid(study)
    run_dir = tmp_path / "runs" / run.name
    run_dir.mkdir(parents=True)
    cfg = build_config(overrides=[*run.overrides, f"run.out_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    (run_dir / "result.yaml").write_text("name: x\n")
    study.steps = 3
    with pytest.raises(ConfigError, match=rf"{run.name}: run.steps 2 -> 3.*another --out"):
        run_study(study, tmp_path)
    assert (run_dir / "result.yaml").read_text() == "name: x\n"


def test_compare_names_the_option_of_a_bad_list():
    clean_error(
        cli("compare", "--seeds", "a,b", "--dry-run"),
        2,
        "--seeds 'a,b' is not a comma-separated list of integers",
    )
    clean_error(cli("compare", "--betas", "0.1,x", "--dry-run"), 2, "--betas '0.1,x'")


# ---------------------------------------------------------------------------------------------
# Settings accepted but ignored or adjusted: one warning line each.


def test_ignored_and_adjusted_settings_are_warned():
    def warns(**keys):
        return preflight.config_warnings(
            build_config(overrides=[f"{k}={v}" for k, v in keys.items()])
        )

    assert warns() == []
    (w,) = warns(**{"kl.placement": "none", "kl.beta": 0.5})
    assert w == "kl.beta=0.5 is ignored: kl.placement is none (no KL term anywhere)"
    (w,) = warns(**{"data.path": "x.jsonl"})
    assert w.startswith("data.path ignored: data.source is builtin")
    (w,) = warns(
        **{"algo.minibatches": 100, "rollout.prompts_per_step": 4, "rollout.group_size": 4}
    )
    assert w.startswith("algo.minibatches=100 is more than the 16 sequences")
    assert "acts as 16" in w


def test_an_empty_config_file_is_warned(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("\n# nothing\n")
    text = clean_error(
        cli("train", "--config", str(empty), "--set", f"model.policy={tmp_path / 'none'}"),
        1,
        f"warning: config file '{empty}' is empty: every setting is the built-in default",
    )
    assert "no such directory" in text


# ---------------------------------------------------------------------------------------------
# Progress when the output is not a terminal.


def test_plain_progress_lines_when_not_a_terminal(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.progress": True}))
    lines = train(cfg)
    assert lines[0] == f"run directory: {out}"
    steps = [x for x in lines if x.startswith("step ")]
    assert [x.split()[1] for x in steps] == ["1/3", "2/3", "3/3"]
    assert "reward " in steps[0] and " kl " in steps[0]


def test_config_and_study_files_that_cannot_be_read(tmp_path):
    from klpo.study.spec import load_study
    from klpo.train.config import load_config

    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"kl:\n  beta: 0.1 # caf\xe9\n")
    with pytest.raises(ConfigError, match=r"c.yaml' is not UTF-8 text \(byte 0xe9 at offset 21\)"):
        load_config(bad)
    study = tmp_path / "s.yaml"
    study.write_text("steps: [1\n")
    with pytest.raises(ConfigError, match=r"s.yaml' is not valid UTF-8 YAML"):
        load_study(study)


@pytest.mark.slow
def test_torchrun_ctrl_c_saves_a_checkpoint(tiny_model, quick, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "run"
    extra = {"run.steps": 200, "rewards": "[{name: 'klpo_test_rewards:slow_digits'}]"}
    args = sets(quick(tiny_model, out, **extra, **{"run.eval_every": 0}))
    cmd = [str(torchrun), "--nproc_per_node", "2", "-m", "klpo", "train", *args]
    # A terminal's Ctrl-C: SIGINT to the whole process group (torchrun forwards it once more).
    # (SIGINT back to its default first: a background test run hands its children SIG_IGN.)
    proc = subprocess.Popen(
        cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and read_metrics(metrics):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    text, _ = proc.communicate(timeout=150)
    step = max(r["step"] for r in read_metrics(metrics))
    ckpt = out / "checkpoints" / f"step_{step:06d}"
    for rank in (0, 1):
        assert f"rank {rank}: stopped by SIGINT after step {step}; the checkpoint is {ckpt}" in text
    assert ck.checkpoint_problem(ckpt) is None
    assert "klpo/train/" not in text


def test_lab_report_progress_is_plain_lines_without_a_terminal(capsys):
    from klpo.cli import _plain_progress

    report = _plain_progress(4)
    for done, what in [(1, "gaussian"), (2, "gaussian"), (3, "sequence"), (4, "sequence")]:
        report(done, what)
    lines = capsys.readouterr().err.splitlines()
    assert [x.split(" (")[0] for x in lines] == [
        "[1/4] gaussian",
        "[3/4] sequence",
        "[4/4] sequence",
    ]
