"""Model and data set ids: fetched as transformers and datasets fetch them, under the Hub's own
offline switches, with one clear error within seconds when they cannot be had.

The suite runs offline (tests/conftest.py). The online cases run ``klpo train`` in a subprocess
without the offline variables, against an endpoint that refuses connections (a machine whose
network is down), and check the probe's branches against huggingface_hub's own error types.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from klpo.train.models import hub

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
SRC = HERE.parents[1] / "src"
OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in OFFLINE_VARS}
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    e["HF_HOME"] = str(tmp_path / "hf-home")  # an empty cache of the test's own
    e.update(extra)
    return e


def _train(tmp_path: Path, env: dict[str, str], *sets: str) -> subprocess.CompletedProcess:
    args = ["run.out_dir=" + str(tmp_path / "run"), "run.progress=false", *sets]
    cmd = [sys.executable, "-m", "klpo", "train", *(a for s in args for a in ("--set", s))]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_unreachable_hub_is_one_clear_error(tmp_path, tiny_model):
    # Online (no offline variable) but nothing answers: one request, no retries, the id named
    # with the variable that would keep to the cache.
    env = _env(tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    proc = _train(tmp_path, env, "model.policy=klpo-tests/no-such-model")
    assert proc.returncode == 1, proc.stderr
    err = proc.stderr
    assert "model.policy 'klpo-tests/no-such-model'" in err, err
    assert "the Hub could not be reached" in err and "HF_HUB_OFFLINE=1" in err, err
    assert "Traceback" not in err and "Retrying" not in err, err
    proc = _train(
        tmp_path,
        env,
        f"model.policy={tiny_model}",
        "data.source=datasets",
        "data.path=klpo-tests/no-such-data",
    )
    assert proc.returncode == 1, proc.stderr
    assert "data.path 'klpo-tests/no-such-data'" in proc.stderr, proc.stderr
    assert "the Hub could not be reached" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def _cache_model(model_dir: Path, cache: Path, repo: str) -> None:
    """``model_dir`` laid out as the Hugging Face cache holds a download of ``repo``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo.replace("/", "--"))
    shutil.copytree(model_dir, root / "snapshots" / commit)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)


@pytest.mark.slow
def test_a_cached_model_id_trains_offline(tmp_path, tiny_model):
    # HF_HUB_OFFLINE=1 and the id in the cache: transformers reads it from there, as it would
    # read a download; the run trains.
    env = _env(tmp_path, HF_HUB_OFFLINE="1")
    _cache_model(tiny_model, Path(env["HF_HOME"]) / "hub", "klpo-tests/tiny")
    proc = _train(
        tmp_path,
        env,
        "model.policy=klpo-tests/tiny",
        "run.steps=1",
        "run.eval_every=0",
        "run.threads=1",
        "rollout.prompts_per_step=2",
        "rollout.group_size=2",
        "run.report_to=[]",
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


class _Response:
    status_code = 404
    headers: ClassVar[dict] = {}
    url = "https://hub.invalid/api/models/x"
    request = None
    text = ""

    def json(self):
        return {}


def test_probe_branches(monkeypatch):
    """The probe's answers, from huggingface_hub's own error types, in-process and online."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    calls = []

    def answers(self, name, timeout=None):
        calls.append((name, timeout))
        if name == "owner/missing":
            raise RepositoryNotFoundError("404", response=_Response())
        if name == "owner/down":
            raise ConnectionError("[Errno 111] Connection refused")
        return object()

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", answers)
    hub._probe.cache_clear()
    assert hub.hub_problem("owner/there", "model.policy", "model") is None
    missing = hub.hub_problem("owner/missing", "model.policy", "model")
    assert "the Hub has no model 'owner/missing'" in missing and "HF_TOKEN" in missing
    down = hub.hub_problem("owner/down", "model.policy", "model")
    assert "could not be reached (ConnectionError" in down and "HF_HUB_OFFLINE=1" in down
    assert all(t == hub.PROBE_TIMEOUT for _, t in calls)
    hub._probe.cache_clear()


def test_offline_variable_named():
    # The suite sets all three; data sets name their own.
    assert hub.offline("model") and hub.offline("dataset")
    assert hub.offline_variable("model") == "HF_HUB_OFFLINE"
    assert hub.offline_variable("dataset") == "HF_DATASETS_OFFLINE"
