"""Bad inputs and faults: each gets one clear error, a non-zero exit without a traceback, and
leaves every file already written as it was.

Most cases fail in the preflight, before a model loads; a few need a short run of the tiny model
(``quick`` in conftest) or a subprocess (signals, torchrun).
"""

from __future__ import annotations

import errno
import json
import os
import re
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

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
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


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes): equal before and after means nothing
    already written was touched."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


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


def test_a_run_that_failed_before_its_first_step_is_replaced_by_the_same_command(
    tiny_model, quick, tmp_path
):
    out = tmp_path / "run"
    broken = quick(tiny_model, out, rewards="[{name: 'klpo_test_rewards:nan_reward'}]")
    with pytest.raises(Exception, match="must be finite"):
        train(build_config(overrides=broken))
    assert (out / "config.yaml").is_file() and not (out / "checkpoints" / "step_000001").exists()
    # The reward fixed, the same command (a changed config: nothing of the first can resume).
    fixed = quick(tiny_model, out, **{"run.steps": 1})
    lines = train(build_config(overrides=fixed))
    said = [x for x in lines if "stopped before its first step" in x]
    assert len(said) == 1 and said[0].endswith(
        "this run replaces it (nothing there could be resumed)"
    )
    assert "config.yaml" in said[0] and "metrics.jsonl" in said[0]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    assert "nan_reward" not in (out / "config.yaml").read_text(encoding="utf-8")
    assert not list(out.glob("metrics.before-restart-*"))
    # Once it has a trained step (and a checkpoint), the same command is refused again.
    with pytest.raises(ConfigError, match="already holds a run"):
        train(build_config(overrides=fixed))


def test_an_unstarted_run_beside_a_users_file_is_not_replaced(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    broken = quick(tiny_model, out, rewards="[{name: 'klpo_test_rewards:nan_reward'}]")
    with pytest.raises(Exception, match="must be finite"):
        train(build_config(overrides=broken))
    (out / "notes.txt").write_text("mine\n")
    before = snapshot(out)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(build_config(overrides=quick(tiny_model, out, **{"run.steps": 1})))
    assert snapshot(out) == before


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
        ck.save_checkpoint(tmp_path, step, ck.Weights(model), optimizers={"policy": opt})
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
        ck.save_checkpoint(two_checkpoints, 3, ck.Weights(policy), optimizers={"policy": opt})
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
    # The suite runs offline (tests/conftest.py): an id not in the cache is named, with the
    # variable that keeps the Hub offline (tests/train/models/test_hub.py has the online cases).
    no_models(monkeypatch)
    base = ["train", "--set", f"run.out_dir={tmp_path / 'run'}", "--set", "run.progress=false"]
    t0 = time.monotonic()
    clean_error(
        cli(*base, "--set", "model.policy=klpo-tests/no-such-model"),
        1,
        "model id 'klpo-tests/no-such-model' is not in the Hugging Face cache",
        "HF_HUB_OFFLINE=1 keeps the Hub offline",
    )
    clean_error(
        cli(
            *base,
            *("--set", f"model.policy={tiny_model}"),
            *("--set", "data.source=datasets", "--set", "data.path=klpo-tests/no-such-data"),
        ),
        1,
        "dataset id 'klpo-tests/no-such-data' is not in the Hugging Face cache",
        "HF_DATASETS_OFFLINE=1",
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
    from klpo.train.models.tokens import Codec

    tok = Codec.plain(load_tokenizer(str(tiny_model)))
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
    # (as the runner writes it: a study directory holds its study.yaml)
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(study.model_dump(), sort_keys=False))
    saved = (tmp_path / "study.yaml").read_bytes()
    study.steps = 3
    with pytest.raises(ConfigError, match=rf"{run.name}: run.steps 2 -> 3.*another --out"):
        run_study(study, tmp_path)
    assert (run_dir / "result.yaml").read_text() == "name: x\n"
    assert (tmp_path / "study.yaml").read_bytes() == saved


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
    assert "reward " in steps[0] and " exact KL " in steps[0]


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


# ---------------------------------------------------------------------------------------------
# Output directories: one rule for every command (klpo.train.outdir), and the lock of a run's.


def test_train_never_writes_into_a_folder_of_other_files(tmp_path, monkeypatch):
    no_models(monkeypatch)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes\n")  # names a run also writes
    (mine / "kl.png").write_bytes(b"\x89PNG my plot")
    theirs = tmp_path / "theirs"  # a klpo config of the user's, and notes: not a run
    theirs.mkdir()
    (theirs / "config.yaml").write_text("kl:\n  beta: 0.2\n")
    (theirs / "notes.md").write_text("todo\n")
    before = snapshot(tmp_path)
    monkeypatch.chdir(mine)
    clean_error(
        cli("train", "--set", "run.out_dir=.", "--set", "run.progress=false"),
        1,
        "run.out_dir '.' is not empty and holds no run of klpo train (kl.png, report.md)",
        "writes only into a new or empty directory",
        "choose another run.out_dir, e.g. runs/train-",
    )
    clean_error(cli("train", "--set", f"run.out_dir={mine}"), 1, f"'{mine}' is not empty")
    clean_error(
        cli("train", "--resume", str(theirs)),
        1,
        "holds no run of klpo train (config.yaml, notes.md)",
        "--resume applies only to a run it wrote",
    )
    clean_error(
        cli("train", "--set", "run.out_dir="),
        2,
        "run.out_dir: is empty, which would write the run into the current directory",
    )
    assert snapshot(tmp_path) == before


def test_a_second_plain_train_is_refused_and_told_how_to_go_on(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"run.steps": 1}))
    train(cfg)
    before = snapshot(out)
    text = clean_error(
        cli("train", *sets(quick(tiny_model, out, **{"run.steps": 1}))),
        1,
        f"run.out_dir '{out}' already holds a run; continue it with --resume {out}",
        "or choose another run.out_dir, e.g. ",
    )
    assert f"{out}-2" in text  # a new directory beside it, named for now
    assert snapshot(out) == before


HOLDER = """
import sys, time
from klpo.train.outdir import DirLock
locks = [DirLock(p, "klpo train", option="run.out_dir").__enter__() for p in sys.argv[1:]]
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder():
    """``holder(*dirs)``: a process that holds the locks of ``dirs`` until killed."""
    procs = []

    def start(*dirs: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, *map(str, dirs)],
            env=env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_run_directory_is_locked_while_a_process_writes_it(tiny_model, quick, tmp_path, holder):
    import socket

    done, fresh = tmp_path / "done", tmp_path / "fresh"
    train(build_config(overrides=quick(tiny_model, done, **{"run.steps": 1})))
    proc = holder(done, fresh)
    before = snapshot(tmp_path)
    who = f"is being written by klpo train (pid {proc.pid} on host {socket.gethostname()}"
    clean_error(cli("train", *sets(quick(tiny_model, fresh))), 1, who, "one process at a time")
    clean_error(cli("train", "--resume", str(done)), 1, who)
    assert snapshot(tmp_path) == before  # the holder's lock file too
    # Killed, its process leaves the file naming it; the next run takes the lock over, says so.
    proc.kill()
    proc.wait()
    more = build_config(overrides=quick(tiny_model, done, **{"run.steps": 2}))
    lines = train(more, resume=True)
    took = f"note: {done} was locked by klpo train (pid {proc.pid} on host {socket.gethostname()}"
    assert any(x.startswith(took) and "which is gone" in x for x in lines), lines
    assert (done / ".klpo.lock").read_text() == ""  # released on exit
    assert [r["step"] for r in read_metrics(done / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_two_trains_started_at_once_into_one_directory(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    slow = {"run.steps": 4, "rewards": "[{name: 'klpo_test_rewards:slow_digits'}]"}
    cmd = [sys.executable, "-m", "klpo", "train", *sets(quick(tiny_model, out, **slow))]
    procs = [subprocess.Popen(cmd, env=env(), stderr=subprocess.PIPE, text=True) for _ in (0, 1)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 1], results
    (loser,) = [err for rc, err in results if rc == 1]
    assert "Traceback" not in loser
    assert "is being written by klpo train (pid" in loser or "already holds a run" in loser
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_torchrun_ranks_all_stop_when_the_run_directory_is_locked(
    tiny_model, quick, tmp_path, holder
):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this Python")
    out = tmp_path / "run"
    proc = holder(out)
    args = sets(quick(tiny_model, out, **{"run.eval_every": 0}))
    cmd = [str(torchrun), "--nproc_per_node", "2", "-m", "klpo", "train", *args]
    t0 = time.monotonic()
    run = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=240)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and time.monotonic() - t0 < 200  # no rank waits forever
    assert (
        f"rank 0: error: run.out_dir '{out}' is being written by klpo train (pid {proc.pid}" in text
    )
    assert "rank 1: error: stopped: the main process (rank 0) could not take run.out_dir" in text
    assert "klpo/train/" not in text
    assert sorted(p.name for p in out.iterdir()) == [".klpo.lock"]


# ---------------------------------------------------------------------------------------------
# klpo export: where the model goes; --merge with nothing to merge.


def unwritable_dir_run(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess | None:
    """Run ``python -m klpo *argv`` with ``{RO}`` in ``argv`` a read-only directory: a
    read-only tmpfs in a mount namespace of its own (root writes through permissions), or a
    chmod 0500 directory otherwise. None where neither can be made."""
    ro = tmp_path / "ro"
    ro.mkdir()
    args = [a.replace("{RO}", str(ro)) for a in argv]
    if os.geteuid() != 0:
        ro.chmod(0o500)
        try:
            return subprocess.run(
                [sys.executable, "-m", "klpo", *args], env=env(), capture_output=True, text=True
            )
        finally:
            ro.chmod(0o700)
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    script = f'mount -t tmpfs -o ro,size=64k tmpfs "{ro}" && exec "$0" -m klpo "$@"'
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script, sys.executable, *args],
        env=env(),
        capture_output=True,
        text=True,
    )
    return None if "mount:" in proc.stderr or "unshare:" in proc.stderr else proc


def test_export_out_that_cannot_be_a_new_model_directory(tiny_model, quick, tmp_path):
    run = tmp_path / "run"
    train(build_config(overrides=quick(tiny_model, run, **{"run.steps": 1})))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("todo\n")
    before = snapshot(tmp_path)
    clean_error(cli("export", str(run), "--out", str(blocker)), 2, f"--out '{blocker}' is a file")
    clean_error(
        cli("export", str(run), "--out", str(blocker / "model")),
        2,
        f"is under '{blocker}', which is a file",
    )
    clean_error(
        cli("export", str(run), "--out", str(notes)),
        2,
        f"--out '{notes}' is not empty and holds no model of klpo export (todo.txt)",
    )
    ro = unwritable_dir_run(tmp_path, ["export", str(run), "--out", "{RO}/model"])
    if ro is not None:
        assert ro.returncode == 2, ro.stderr
        assert "would be created in" in ro.stderr and "which is not writable" in ro.stderr
        assert "Traceback" not in ro.stderr
    assert snapshot(tmp_path) == before
    # --merge of a run without adapters: the model, and a line saying --merge did nothing.
    model = tmp_path / "model"
    ok = cli("export", str(run), "--out", str(model), "--merge")
    assert ok.exit_code == 0, ok.output
    assert f"note: --merge did nothing: {run} trained all the weights (no LoRA adapters)" in (
        ok.output
    )
    assert not list(tmp_path.glob(".tmp-*"))
    written = snapshot(tmp_path)
    clean_error(
        cli("export", str(run), "--out", str(model)),
        2,
        f"--out '{model}' already holds a model; choose another --out",
    )
    assert snapshot(tmp_path) == written


def test_export_of_a_live_run_whose_checkpoint_is_pruned_under_it(
    tiny_model, quick, tmp_path, monkeypatch
):
    """A live run deletes its older checkpoints after each save (run.save_total_limit); one
    deleted while export reads it gave transformers' message about a Hub repo id."""
    from klpo.train.tools import export as export_tool

    run = tmp_path / "run"
    train(build_config(overrides=quick(tiny_model, run, **{"run.steps": 1})))
    real = export_tool.load_causal_lm

    def pruned_first(name, *args, **kwargs):  # the trainer's prune lands just before the read
        shutil.rmtree(run / "checkpoints" / "step_000001")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(export_tool, "load_causal_lm", pruned_first)
    model = tmp_path / "model"
    text = clean_error(
        cli("export", str(run), "--out", str(model)),
        1,
        f"the checkpoint step_000001 of {run} vanished while export read it",
        "(run.save_total_limit); run the export again",
        "or export a run that has finished",
    )
    assert "repo" not in text.lower() and not model.exists(), text


# ---------------------------------------------------------------------------------------------
# A full disk at a later save and on --resume (the first save: above), and a real one.


def full_after_step_1(monkeypatch, seen: dict) -> None:
    """safetensors' own error (its text, as a full disk raises it) from step 2's save on; the
    first failing call keeps a copy of step 1's checkpoint as it then is."""
    from safetensors import SafetensorError

    real = ck.save_file

    def save_file(tensors, path, *args, **kwargs):
        if "step_000001" in str(path):
            return real(tensors, path, *args, **kwargs)
        root = Path(path).parents[1]
        seen.setdefault("step1", snapshot(root / "step_000001"))
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(ck, "save_file", save_file)


def test_a_full_disk_at_a_later_save_and_on_resume(tiny_model, quick, tmp_path, monkeypatch):
    out = tmp_path / "run"
    seen: dict = {}
    full_after_step_1(monkeypatch, seen)
    args = sets(quick(tiny_model, out, **{"run.steps": 3, "run.save_every": 1}))
    text = clean_error(
        cli("train", *args),
        1,
        f"could not write the checkpoint of step 2 in {out / 'checkpoints'}: No space left on "
        "device; the previous checkpoint step_000001 is intact",
        "The disk is full: the checkpoint needs about ",
        f"klpo train --resume {out}",
    )
    step1 = out / "checkpoints" / "step_000001"
    assert snapshot(step1) == seen["step1"]  # byte-identical after the failed save
    assert ck.checkpoint_problem(step1) is None
    # The estimate is the size a checkpoint takes (step 1's, written whole), within 10%.
    needs = re.search(r"needs about ([\d.]+) kB", text)
    actual = sum(len(b) for b in seen["step1"].values()) / 1000
    assert needs and abs(float(needs.group(1)) / actual - 1) < 0.1, (needs, actual)
    rows = (out / "metrics.jsonl").read_bytes()
    # --resume on the same full disk: the same message, nothing lost.
    clean_error(
        cli("train", "--resume", str(out)),
        1,
        "could not write the checkpoint of step 2",
        "the previous checkpoint step_000001 is intact",
        "The disk is full",
    )
    assert snapshot(step1) == seen["step1"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.undo()  # space freed: the advice given works
    ok = cli("train", "--resume", str(out))
    assert ok.exit_code == 0, ok.output
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert rows.splitlines()[:2] == (out / "metrics.jsonl").read_bytes().splitlines()[:2]


@pytest.mark.slow
def test_a_really_full_disk_at_the_first_save(tiny_model, quick, tmp_path):
    """A 64 kB tmpfs (in a mount namespace of its own): the config and metrics fit, a checkpoint
    of the tiny model (~93 kB) does not; what the trainer says, and what is left."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare: no tmpfs without root")
    disk, seen = tmp_path / "disk", tmp_path / "seen"
    disk.mkdir()
    seen.mkdir()
    args = sets(quick(tiny_model, disk / "run", **{"run.steps": 1}))
    script = (
        f'mount -t tmpfs -o size=64k tmpfs "{disk}" || exit 99; '
        f'"$0" -m klpo train "$@" 2> "{seen}/err"; echo $? > "{seen}/rc"; '
        f'ls -A "{disk}/run" "{disk}/run/checkpoints" > "{seen}/ls"; '
        f'cp "{disk}/run/metrics.jsonl" "{seen}/"'
    )
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script, sys.executable, *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode == 99 or not (seen / "rc").exists():
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr[-300:]}")
    err = (seen / "err").read_text()
    assert (seen / "rc").read_text().strip() == "1", err
    assert "Traceback" not in err
    assert "could not write the checkpoint of step 1" in err
    assert "No space left on device; no earlier checkpoint exists" in err
    assert "The disk is full: the checkpoint needs about " in err and "kB are free" in err
    assert ".tmp-step" not in (seen / "ls").read_text()  # the partial files were removed
    assert [r["step"] for r in read_metrics(seen / "metrics.jsonl")] == [0, 1]


# ---------------------------------------------------------------------------------------------
# Accepted without a word before: each now refused (or said) where it is read.


def test_fsdp_without_torchrun_is_refused(tiny_model, quick, tmp_path, monkeypatch):
    no_models(monkeypatch)
    clean_error(
        cli("train", *sets(quick(tiny_model, tmp_path / "run", **{"dist.strategy": "fsdp"}))),
        1,
        "dist.strategy=fsdp shards the models over torchrun's processes, but this run is one "
        "process",
        "torchrun --nproc_per_node N",
        "dist.strategy=ddp",
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("has_event", [True, False])
def test_fsdp_on_cpu_needs_cpu_streams_that_record_events(has_event, monkeypatch):
    """torch 2.6 (klpo's floor) has FSDP2 but its CPU streams have no record_event, which FSDP2's
    all-gather calls: refused before anything loads; with the method (torch >= 2.7) accepted."""
    import torch

    from klpo.train.runtime.dist import Dist

    if not has_event:
        monkeypatch.delattr(torch.cpu.Stream, "record_event", raising=False)
    cfg = build_config(overrides=["dist.strategy=fsdp"])
    check = preflight.check_fsdp_device
    if has_event:
        check(cfg, Dist(rank=0, world=2))  # nothing to say
        check(build_config(overrides=[]), Dist(rank=0, world=2))
    else:
        with pytest.raises(ConfigError, match=r"dist.strategy=fsdp on CPU needs a torch whose"):
            check(cfg, Dist(rank=0, world=2))
        check(build_config(overrides=["dist.strategy=ddp"]), Dist(rank=0, world=2))
        check(cfg, Dist(rank=0, world=1))  # one process: refused elsewhere, with its own reason


def test_a_token_budget_smaller_than_one_sequence_is_refused(
    tiny_model, quick, tmp_path, monkeypatch
):
    no_models(monkeypatch)
    data = jsonl(tmp_path / "d.jsonl", ["1+1=", "12345+67890=", "2+2="])
    extra = {"data.source": "jsonl", "data.path": str(data), "algo.micro_batch_tokens": 12}
    before = snapshot(tmp_path)
    clean_error(
        cli("train", *sets(quick(tiny_model, tmp_path / "run", **extra))),
        1,
        "algo.micro_batch_tokens=12 is smaller than one sequence: the longest training prompt "
        f"({data}:2, ",
        "rollout.max_new_tokens=4",
        "Set algo.micro_batch_tokens to at least ",
    )
    assert snapshot(tmp_path) == before


def test_an_answer_a_reward_cannot_score_is_refused_where_the_data_is_read(
    tiny_model, quick, tmp_path, monkeypatch
):
    no_models(monkeypatch)
    data = tmp_path / "math.jsonl"
    rows = [("1+1=", "2"), ("2+2=", r"\boxed{}"), ("3+3=", ""), ("4+4=", "#### ")]
    data.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in rows))
    before = snapshot(tmp_path)
    boxed = {"data.source": "jsonl", "data.path": str(data), "rewards": "[{name: boxed}]"}
    clean_error(
        cli("train", *sets(quick(tiny_model, tmp_path / "run", **boxed))),
        1,
        f"{data}:2: the answer '\\\\boxed{{}}' is empty once its \\boxed{{}}, '####' and '$' are "
        "taken off, so an empty \\boxed{} would score as right by the reward 'boxed' (2 more "
        "examples have the same problem)",
        "give every example a real answer ('answer')",
    )
    exact = {**boxed, "rewards": "[{name: exact_match}]"}
    clean_error(
        cli("train", *sets(quick(tiny_model, tmp_path / "run", **exact))),
        1,
        f"{data}:3: the answer is empty, so an empty completion would score as right by the "
        "reward 'exact_match'",
    )
    assert snapshot(tmp_path) == before


def test_a_config_with_a_section_twice_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl:\n  beta: 0.5\nrun:\n  steps: 2\nkl:\n  estimator: k3\n")
    before = snapshot(tmp_path)
    clean_error(
        cli("train", "--config", str(path)),
        2,
        f"config file '{path}': 'kl' appears twice in one mapping, at lines 1 and 5",
        "the first would be silently dropped",
    )
    nested = tmp_path / "n.yaml"
    nested.write_text("kl:\n  beta: 0.5\n  beta: 0.1\n")
    clean_error(cli("train", "--config", str(nested)), 2, "'beta' appears twice", "lines 2 and 3")
    assert snapshot(tmp_path) == {**before, "n.yaml": nested.read_bytes()}
    study = tmp_path / "s.yaml"  # a study file is read the same way
    study.write_text("steps: 5\nbetas: [0.1]\nsteps: 6\n")
    clean_error(
        cli("compare", "-c", str(study), "--dry-run"),
        2,
        f"study file '{study}': 'steps' appears twice in one mapping, at lines 1 and 3",
    )


# ---------------------------------------------------------------------------------------------
# Unclear before: said in the config's words.


def test_adam_betas_out_of_range_name_the_key(tmp_path):
    clean_error(
        cli("train", "--set", "optim.betas=[1.5, 0.9]", "--set", f"run.out_dir={tmp_path / 'r'}"),
        2,
        "optim.betas: each must be in [0, 1)",
        "got [1.5, 0.9]; e.g. [0.9, 0.999]",
    )
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------
# The other commands that write a directory: the same rule (klpo.train.outdir).


def test_lab_report_never_replaces_a_report_unasked(tmp_path, monkeypatch):
    import klpo.lab.report

    old = tmp_path / "old"  # an earlier report, and a plot of the user's beside it
    old.mkdir()
    for name, text in [("report.md", "# mine\n"), ("results.json", "{}\n"), ("kl.png", "png")]:
        (old / name).write_text(text)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "report.md").write_text("my notes\n")  # a report's name, but not a report
    before = snapshot(tmp_path)
    clean_error(
        cli("lab", "report", "--quick", "--out", str(old)),
        2,
        f"--out '{old}' already holds a report; replace it with --overwrite, or choose another "
        f"--out, e.g. {old}-",
    )
    for extra in ([], ["--overwrite"]):
        clean_error(
            cli("lab", "report", "--quick", "--out", str(notes), *extra),
            2,
            f"--out '{notes}' is not empty and holds no report of klpo lab report (report.md)",
            "(--overwrite applies only to a report it wrote)",
        )
    assert snapshot(tmp_path) == before
    # --overwrite: the report is written over the earlier one (run_report stubbed: seconds).
    calls = []

    def run_report(out, preset, **kw):
        calls.append(out)
        return {"verdicts": [], "timings_s": {"total": 0.0}}

    monkeypatch.setattr(klpo.lab.report, "run_report", run_report)
    ok = cli("lab", "report", "--quick", "--out", str(old), "--overwrite")
    assert ok.exit_code == 0, ok.output
    assert calls == [old]


def tiny_study(**kw):
    from klpo.study.spec import Choice, StudyConfig

    given = {
        "choices": [Choice(estimator="k3", placement="loss")],
        "betas": [0.1],
        "seeds": [0],
        "steps": 2,
        **kw,
    }
    return StudyConfig(**given)


def test_compare_refuses_an_out_of_another_study_or_of_other_files(tmp_path, monkeypatch):
    import yaml

    from klpo.study import runner

    out = tmp_path / "study"
    out.mkdir()
    (out / "study.yaml").write_text(yaml.safe_dump(tiny_study().model_dump(), sort_keys=False))
    (out / "report.md").write_text("# the first study\n")
    (out / "kl.png").write_text("png")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "results.csv").write_text("mine\n")
    before = snapshot(tmp_path)
    # Other settings, no finished run yet: refused, naming what changed and how to go on.
    other = tiny_study(betas=[0.2], steps=5)
    with pytest.raises(ConfigError) as err:
        runner.run_study(other, out)
    assert (
        f"--out {out} holds a study with other settings (betas: [0.1] -> [0.2]; steps: 2 -> 5)"
        in (str(err.value))
    )
    assert "re-run with the settings in its study.yaml to finish it, or choose another --out" in (
        str(err.value)
    )
    clean_error(
        cli("compare", "--quick", "--out", str(notes)),
        2,
        f"--out '{notes}' is not empty and holds no study of klpo compare (results.csv)",
        "choose another --out",
    )
    assert snapshot(tmp_path) == before
    # The same study with other workers (how runs are scheduled) is finished, under the lock.
    ran = []

    def run_all(study, runs, configs, out, on_result, on_start, show_progress):
        ran.append((study.workers, Path(out, ".klpo.lock").read_text()))
        return []

    monkeypatch.setattr(runner, "_run_all", run_all)
    assert runner.run_study(tiny_study(workers=1), out) == []
    assert ran[0][0] == 1 and '"command": "klpo compare"' in ran[0][1]
    assert (out / ".klpo.lock").read_text() == ""  # released


def test_compare_options_out_of_range_are_said_as_options():
    clean_error(
        cli("compare", "--workers", "0", "--dry-run"),
        2,
        "error: --workers '0': must be greater than 0; e.g. --workers 2",
    )
    text = clean_error(
        cli("compare", "--betas", "-1", "--dry-run"),
        2,
        "error: --betas '-1': betas must be a non-empty list of positive numbers, got [-1.0]; "
        "e.g. --betas 0.01,0.1",
    )
    assert "pydantic" not in text and "http" not in text


def test_make_reward_model_init_checked_as_a_model_is(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # an id is then looked up in the cache only
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("todo\n")
    bare = tmp_path / "bare"  # a model without its tokenizer
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_model) / name, bare / name)
    out = tmp_path / "rm"
    before = snapshot(tmp_path)
    cases = [
        (notes, f"--init '{notes}' is not a complete model directory"),
        (tmp_path / "missing", f"--init '{tmp_path / 'missing'}': no such directory"),
        ("nobody/no-model", "model id 'nobody/no-model' is not in the Hugging Face cache"),
        (bare, f"--init '{bare}' has no tokenizer"),
    ]
    for init, message in cases:
        t0 = time.monotonic()
        clean_error(cli("make-reward-model", str(out), "--init", str(init)), 2, message)
        assert time.monotonic() - t0 < 30  # checked on disk: no network retries
    assert snapshot(tmp_path) == before and not out.exists()


def test_make_reference_and_docs_never_replace_what_they_did_not_write(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "model.safetensors").write_text("mine\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# hand-written\n")
    (docs / "config.md").write_text("# my config notes\n")  # a page klpo docs writes
    before = snapshot(tmp_path)
    for extra in ([], ["--overwrite"]):
        clean_error(
            cli("make-reference", str(notes), *extra),
            2,
            f"OUT '{notes}' is not empty and holds no reference model of klpo make-reference",
            "(--overwrite applies only to a reference model it wrote)",
        )
    clean_error(
        cli("docs", "--out", str(docs)),
        2,
        f"--out '{docs}': config.md is there and was not generated by klpo docs",
    )
    assert snapshot(tmp_path) == before
    (docs / "config.md").unlink()  # gone: the pages are written beside the hand-written one
    ok = cli("docs", "--out", str(docs))
    assert ok.exit_code == 0, ok.output
    assert (docs / "guide.md").read_text() == "# hand-written\n"
    again = cli("docs", "--out", str(docs))  # its own pages are replaced
    assert again.exit_code == 0, again.output


def test_a_study_may_grow_by_seeds_betas_or_choices_but_not_shrink_or_change(tmp_path):
    import yaml

    from klpo.study.runner import study_changes
    from klpo.study.spec import Choice

    (tmp_path / "study.yaml").write_text(yaml.safe_dump(tiny_study().model_dump(), sort_keys=False))
    grown = [
        tiny_study(seeds=[0, 1]),
        tiny_study(betas=[0.1, 0.3]),
        tiny_study(
            choices=[
                Choice(estimator="k3", placement="loss"),
                Choice(estimator="full", placement="loss"),
            ],
            seeds=[0, 2],
        ),
    ]
    for study in grown:
        assert study_changes(study, tmp_path) == []
    assert study_changes(tiny_study(seeds=[1]), tmp_path) == ["seeds: [0] -> [1]"]
    assert study_changes(tiny_study(seeds=[0, 1], steps=3), tmp_path) == [
        "seeds: [0] -> [0, 1]",
        "steps: 2 -> 3",
    ]
