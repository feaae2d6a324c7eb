"""docs/study-real/archive.py: a study's finished runs carried to another directory and back,
byte for byte once the paths are filled in again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _archive():
    spec = importlib.util.spec_from_file_location("archive", ROOT / "docs/study-real/archive.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _study(out: Path, model: str) -> None:
    for name in ("a", "b"):
        run = out / "runs" / name
        (run / "checkpoints" / "step_000002").mkdir(parents=True)
        (run / "checkpoints" / "step_000002" / "adapter.safetensors").write_bytes(b"\0" * 64)
        (run / "config.yaml").write_text(f"model:\n  policy: {model}\nrun:\n  out_dir: {run}\n")
        (run / "metrics.jsonl").write_text('{"step": 0, "accuracy/heldout": 0.06}\n')
        (run / "samples.jsonl").write_text(f'{{"step": 0, "prompt": "2 + 2 =", "dir": "{run}"}}\n')
    (out / "runs" / "a" / "result.yaml").write_text(f"name: a\nstatus: ok\ndir: {out}/runs/a\n")
    (out / "runs" / "b" / "result.yaml").write_text("name: b\nstatus: interrupted\n")
    (out / "study.yaml").write_text("task: chat-arith\nmodel: smollm2\n")
    (out / "train-config.yaml").write_text(f"model:\n  policy: {model}\n")
    (out / "report.md").write_text("# report\n")
    (out / "kl.png").write_bytes(b"png")


def test_export_keeps_finished_runs_without_paths_and_restore_gives_them_back(
    tmp_path, monkeypatch
):
    arc = _archive()
    model = str(tmp_path / "cache" / "SmolLM2")
    monkeypatch.setattr(arc, "_models", lambda: {"smollm2": model})
    out, dest, back = tmp_path / "study", tmp_path / "archive", tmp_path / "elsewhere" / "study"
    _study(out, model)
    assert arc.export(out, dest) == 1  # b was interrupted: not kept
    kept = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert kept == [
        "kl.png",
        "report.md",
        "runs/a/config.yaml",
        "runs/a/metrics.jsonl.gz",
        "runs/a/result.yaml",
        "runs/a/samples.jsonl.gz",
        "study.yaml",
        "train-config.yaml",
    ]
    for p in dest.rglob("*.yaml"):
        assert str(tmp_path) not in p.read_text()
    assert "{MODEL:smollm2}" in (dest / "runs/a/config.yaml").read_text()
    assert arc.restore(dest, back) == 1
    for name in ("config.yaml", "result.yaml", "metrics.jsonl", "samples.jsonl"):
        want = (out / "runs/a" / name).read_text().replace(str(out), str(back))
        assert (back / "runs/a" / name).read_text() == want, name
    assert arc.restore(dest, back) == 0  # a run already there is left as it is
    monkeypatch.setattr(arc, "_models", lambda: {})
    try:
        arc.restore(dest, tmp_path / "third")
    except SystemExit as e:
        assert "run `make real-models` first" in str(e) and "'smollm2'" in str(e)
    else:
        raise AssertionError("a model not converted here must be named")


def test_an_archive_under_docs_is_committed_not_ignored_by_git():
    """The archive's runs live in ``DEST/runs``; a repository that ignores ``runs/`` must
    re-include them under docs/, or ``git add`` drops every run the archive holds."""
    import shutil
    import subprocess

    import pytest

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = [
        "docs/study-real/chat-arith/runs/grpo_k3-loss_b0.2_s0/metrics.jsonl.gz",
        "docs/study-stale/stale-2/runs/grpo_no-KL_b0_s0/result.yaml",
    ]
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert out.stdout == "", f"git ignores the study archives' runs: {out.stdout}"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "runs/compare/x"], cwd=ROOT, capture_output=True
    )
    assert ignored.returncode == 0  # a study run outside docs/ stays out of the repository
