"""docs/study-real/archive.py: a study's finished runs carried to another directory and back,
byte for byte once the paths are filled in again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

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


def test_export_keeps_finished_runs_without_paths_and_restore_gives_them_back(tmp_path):
    arc = _archive()
    model = str(tmp_path / "cache" / "SmolLM2")
    models = {"smollm2": model}
    out, dest, back = tmp_path / "study", tmp_path / "archive", tmp_path / "elsewhere" / "study"
    _study(out, model)
    assert arc.export(out, dest, models) == 1  # b was interrupted: not kept
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
    assert arc.restore(dest, back, models) == 1
    for name in ("config.yaml", "result.yaml", "metrics.jsonl", "samples.jsonl"):
        want = (out / "runs/a" / name).read_text().replace(str(out), str(back))
        assert (back / "runs/a" / name).read_text() == want, name
    assert arc.restore(dest, back, models) == 0  # a run already there is left as it is
    with pytest.raises(arc.ArchiveError, match=r"'smollm2': run `make real-models` first"):
        arc.restore(dest, tmp_path / "third", {})
    assert not (tmp_path / "third").exists()  # nothing half-written


def _exported(tmp_path, study: str = "task: chat-arith\nmodel: smollm2\n"):
    """The archive module, an exported study and the ``{key: directory}`` of its model."""
    arc = _archive()
    models = {"smollm2": str(tmp_path / "cache" / "SmolLM2")}
    out, dest = tmp_path / "study", tmp_path / "archive"
    _study(out, models["smollm2"])
    (out / "study.yaml").write_text(study)
    arc.export(out, dest, models)
    return arc, dest, models


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_restore_refuses_another_studys_directory_and_leaves_it_as_it_was(tmp_path):
    """The data loss: restoring into a directory holding another study replaced its
    ``study.yaml`` and ``train-config.yaml`` and exited 0."""
    arc, dest, models = _exported(tmp_path)
    other = tmp_path / "other"
    (other / "runs" / "x").mkdir(parents=True)
    (other / "runs" / "x" / "result.yaml").write_text("name: x\nstatus: ok\n")
    (other / "study.yaml").write_text("task: chat-arith\nmodel: gemma3\n")
    (other / "train-config.yaml").write_text("model:\n  policy: gemma\n")
    before = _tree(other)
    with pytest.raises(arc.ArchiveError) as err:
        arc.restore(dest, other, models)
    msg = str(err.value)
    assert str(other) in msg and "the study chat-arith on gemma3" in msg, msg
    assert "new or empty directory" in msg and "model: 'gemma3' -> 'smollm2'" in msg, msg
    assert _tree(other) == before
    # a directory with files but no study is refused too; the same study gets its runs added
    stray = tmp_path / "notes"
    stray.mkdir()
    (stray / "todo.txt").write_text("x")
    with pytest.raises(arc.ArchiveError, match="holds no study"):
        arc.restore(dest, stray, models)
    same = tmp_path / "same"
    assert arc.restore(dest, same, models) == 1
    (same / "runs" / "a" / "result.yaml").unlink()
    assert (
        arc.restore(dest, same, models) == 1
    )  # the same study: the unfinished run is restored again


def test_restore_bad_inputs_are_one_line_errors_with_exit_2_and_nothing_written(
    tmp_path, monkeypatch, capsys
):
    arc, dest, models = _exported(tmp_path)
    monkeypatch.setattr(arc, "_models", lambda: models)  # main() reads this machine's models
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = {
        "missing": (tmp_path / "nowhere", tmp_path / "o1", "no such archive"),
        "no runs": (tmp_path / "cache", tmp_path / "o2", "holds no runs/ directory"),
        "out is a file": (dest, a_file, "is a file; give a new or empty directory"),
    }
    (tmp_path / "cache").mkdir()
    for what, (src, out, says) in cases.items():
        monkeypatch.setattr("sys.argv", ["archive.py", "restore", str(src), str(out)])
        assert arc.main() == 2, what
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1, (what, err)
        assert (str(src) in err) or (str(out) in err), (what, err)
        assert out == a_file or not out.exists(), what
    # a truncated .gz and a stray file in runs/: named, and nothing of the study written
    gz = dest / "runs" / "a" / "samples.jsonl.gz"
    whole = gz.read_bytes()
    gz.write_bytes(whole[: len(whole) // 2])
    monkeypatch.setattr("sys.argv", ["archive.py", "restore", str(dest), str(tmp_path / "o3")])
    assert arc.main() == 2
    err = capsys.readouterr().err
    assert str(gz) in err and "truncated" in err and "export the archive again" in err, err
    assert not (tmp_path / "o3").exists()
    gz.write_bytes(whole)
    (dest / "runs" / "README").write_text("x")
    with pytest.raises(arc.ArchiveError, match=r"runs/README is a stray file .* remove it"):
        arc.restore(dest, tmp_path / "o4", models)
    assert not (tmp_path / "o4").exists()


def test_export_bad_inputs_are_one_line_errors(tmp_path, monkeypatch, capsys):
    arc = _archive()
    (tmp_path / "empty").mkdir()
    for out, says in ((tmp_path / "nowhere", "no such directory"),
                      (tmp_path / "empty", "it holds no runs/ directory")):  # fmt: skip
        monkeypatch.setattr("sys.argv", ["archive.py", "export", str(out), str(tmp_path / "a")])
        assert arc.main() == 2
        err = capsys.readouterr().err
        assert err.startswith(f"archive.py export: {out}: {says}") and err.count("\n") == 1, err
    assert not (tmp_path / "a").exists()


def test_restore_interrupted_leaves_no_half_written_study(tmp_path, monkeypatch):
    arc, dest, models = _exported(tmp_path)
    import klpo._io

    real = klpo._io.write_atomic
    calls = []

    def dies(path, data):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(klpo._io, "write_atomic", dies)
    with pytest.raises(KeyboardInterrupt):
        arc.restore(dest, tmp_path / "new", models)
    assert not (tmp_path / "new").exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


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
