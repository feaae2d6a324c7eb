"""Carry a real-model study between machines: what ``klpo compare`` needs of its finished runs,
small enough to commit, and back.

A study of the real models takes hours of CPU and may be spread over several machines; its
output directory holds checkpoints (57 MB a run with LoRA on SmolLM2) and absolute paths. This
script keeps, of every run that finished, its ``config.yaml``, ``result.yaml`` and (gzipped)
``metrics.jsonl`` and ``samples.jsonl``, and of the study its ``study.yaml``, ``train-config.yaml``,
``results.csv``, ``report.md`` and plots, with the study directory's path written ``{OUT}`` and a
real model's directory ``{MODEL:key}``. ``restore`` writes them back, the placeholders filled in
for this machine (``make real-models`` first), into a study directory that the same
``klpo compare`` command then finishes, reusing those runs (it checks each against the config it
would run with) and running the rest. ``restore`` writes into a new or empty directory, or adds
runs to one that holds the same study; it refuses another study's directory (whose ``study.yaml``
it would replace), and a bad input (no archive, no ``runs/``, a stray file, a truncated ``.gz``,
an output path that is a file) with one line naming the value and the fix, exit code 2, having
written nothing.

    python docs/study-real/archive.py export runs/real-study docs/study-real/chat-arith
    python docs/study-real/archive.py restore docs/study-real/chat-arith runs/real-study
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import zlib
from pathlib import Path

import yaml

STUDY_FILES = ("study.yaml", "train-config.yaml", "results.csv", "report.md")
RUN_TEXT = ("config.yaml", "result.yaml")
RUN_GZIP = ("metrics.jsonl", "samples.jsonl")


class ArchiveError(ValueError):
    """A bad ``restore`` input: one line naming the value and the fix (exit code 2)."""


def _models() -> dict[str, str]:
    """``{key: directory}`` of the real models converted on this machine."""
    from klpo.train.tools.real_models import REAL_MODELS, real_model_dir

    found = {key: real_model_dir(key) for key in REAL_MODELS}
    return {key: str(path) for key, path in found.items() if path is not None}


def to_archive(text: str, out: Path, models: dict[str, str]) -> str:
    """``text`` with ``out``'s absolute path as ``{OUT}`` and each model directory as
    ``{MODEL:key}`` (the longest first, so that no path is half replaced).

    >>> to_archive("a: /x/study/runs/r\\nb: /m/smol", Path("/x/study"), {"smollm2": "/m/smol"})
    'a: {OUT}/runs/r\\nb: {MODEL:smollm2}'
    """
    pairs = [(str(out.resolve()), "{OUT}")] + [(d, f"{{MODEL:{k}}}") for k, d in models.items()]
    for path, mark in sorted(pairs, key=lambda p: -len(p[0])):
        text = text.replace(path, mark)
    return text


def from_archive(text: str, out: Path, models: dict[str, str]) -> str:
    """The inverse of :func:`to_archive` on this machine; a model not converted here is an
    error naming ``make real-models``.

    >>> from_archive("a: {OUT}/runs/r", Path("/y/s"), {})
    'a: /y/s/runs/r'
    """
    text = text.replace("{OUT}", str(out.resolve()))
    for key, path in models.items():
        text = text.replace(f"{{MODEL:{key}}}", path)
    if "{MODEL:" in text:
        key = text.split("{MODEL:", 1)[1].split("}", 1)[0]
        raise ArchiveError(
            f"the archive names the real model {key!r}: run `make real-models` first"
        )
    return text


def export(out: Path, dest: Path, models: dict[str, str] | None = None) -> int:
    """Write the archive of the study in ``out`` into ``dest`` (replacing its runs); returns
    the number of finished runs kept. ``models``: ``{key: directory}`` of the real models whose
    paths become ``{MODEL:key}`` (default: those converted on this machine)."""
    if not (out / "runs").is_dir():
        what = "no such directory" if not out.exists() else "it holds no runs/ directory"
        raise ArchiveError(
            f"{out}: {what}, so it is not a study directory; give the --out of a klpo compare run"
        )
    if dest.exists() and not dest.is_dir():
        raise ArchiveError(f"{dest} is a file; give a directory for the archive")
    models = _models() if models is None else models
    dest.mkdir(parents=True, exist_ok=True)
    for name in STUDY_FILES:
        if (out / name).is_file():
            text = (out / name).read_text(encoding="utf-8")
            (dest / name).write_text(to_archive(text, out, models), encoding="utf-8")
    for png in out.glob("*.png"):
        shutil.copyfile(png, dest / png.name)
    shutil.rmtree(dest / "runs", ignore_errors=True)
    kept = 0
    from klpo.study.runner import finished_row

    for run in sorted((out / "runs").iterdir()):
        if finished_row(run) is None:
            continue  # not finished, crashed or interrupted: the study runs it again
        target = dest / "runs" / run.name
        target.mkdir(parents=True)
        for name in RUN_TEXT:
            text = (run / name).read_text(encoding="utf-8")
            (target / name).write_text(to_archive(text, out, models), encoding="utf-8")
        for name in RUN_GZIP:
            data = to_archive((run / name).read_text(encoding="utf-8"), out, models)
            # mtime 0: the same run exports to the same bytes, so a re-export changes nothing
            packed = gzip.compress(data.encode("utf-8"), compresslevel=9, mtime=0)
            (target / f"{name}.gz").write_bytes(packed)
        kept += 1
    return kept


def _read_archive(src: Path, out: Path, models: dict[str, str]) -> tuple[dict, dict]:
    """``({name: text} of the study files, {run: {name: text}})`` of the archive ``src``, the
    placeholders filled in for ``out``; everything read and checked before anything is written."""
    if not src.exists():
        raise ArchiveError(f"{src}: no such archive; give the directory `archive.py export` wrote")
    if not src.is_dir():
        raise ArchiveError(f"{src} is a file, not an archive; give the directory `export` wrote")
    if not (src / "runs").is_dir():
        raise ArchiveError(
            f"{src} holds no runs/ directory, so it is not a study archive; give the directory "
            "`archive.py export` wrote"
        )
    study = {
        name: from_archive((src / name).read_text(encoding="utf-8"), out, models)
        for name in ("study.yaml", "train-config.yaml")
        if (src / name).is_file()
    }
    runs: dict[str, dict[str, str]] = {}
    for run in sorted((src / "runs").iterdir()):
        if not run.is_dir():
            raise ArchiveError(
                f"{run} is a stray file in the archive's runs/ (each entry is a run's directory); "
                "remove it, or export the archive again"
            )
        files: dict[str, str] = {}
        for name in RUN_GZIP:
            path = run / f"{name}.gz"
            try:
                with gzip.open(path, "rt", encoding="utf-8") as f:
                    files[name] = from_archive(f.read(), out, models)
            except FileNotFoundError:
                raise ArchiveError(
                    f"{path} is missing: the archive is incomplete; export it again (or "
                    "`git checkout` it)"
                ) from None
            except (EOFError, OSError, UnicodeDecodeError, zlib.error) as err:
                raise ArchiveError(
                    f"{path} is truncated or damaged ({type(err).__name__}: {err}); export the "
                    "archive again (or `git checkout` it)"
                ) from None
        for name in ("config.yaml", "result.yaml"):
            if not (run / name).is_file():
                raise ArchiveError(
                    f"{run / name} is missing: the archive is incomplete; export it again (or "
                    "`git checkout` it)"
                )
            files[name] = from_archive((run / name).read_text(encoding="utf-8"), out, models)
        runs[run.name] = files
    return study, runs


def _study_line(path: Path) -> str:
    """``task on model`` of the study whose ``study.yaml`` is ``path`` (what a reader knows it by)."""
    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return "a study whose study.yaml cannot be read"
    if not isinstance(saved, dict):
        return "a study whose study.yaml is not a mapping"
    return f"the study {saved.get('task', '?')} on {saved.get('model', '?')}"


def _check_out(out: Path, study: dict[str, str]) -> bool:
    """Whether ``out`` already holds this archive's study (its runs are then added to); an
    :class:`ArchiveError` where it holds something else (another study, other files)."""
    if out.exists() and not out.is_dir():
        raise ArchiveError(
            f"{out} is a file; give a new or empty directory for the study to restore into"
        )
    if not out.exists() or not any(out.iterdir()):
        return False
    fresh = out.with_name(out.name + "-restored")
    if not (out / "study.yaml").is_file():
        raise ArchiveError(
            f"{out} is not empty and holds no study (no study.yaml); restore into a new or empty "
            f"directory, e.g. {fresh}"
        )
    from klpo.study.runner import study_changes
    from klpo.study.spec import StudyConfig

    changed = ["the archive has no study.yaml"]
    if "study.yaml" in study:
        try:
            ours = StudyConfig.model_validate(yaml.safe_load(study["study.yaml"]))
        except (yaml.YAMLError, ValueError) as err:
            raise ArchiveError(
                f"the archive's study.yaml cannot be read ({str(err).splitlines()[0]}); export "
                "it again"
            ) from None
        changed = study_changes(ours, out)
    if changed:
        raise ArchiveError(
            f"{out} holds {_study_line(out / 'study.yaml')}, not the archive's "
            f"({'; '.join(changed[:3])}); restoring would replace its study.yaml and "
            f"train-config.yaml. Restore into a new or empty directory, e.g. {fresh}"
        )
    return True


def restore(src: Path, out: Path, models: dict[str, str] | None = None) -> int:
    """Write the archive ``src`` back as a study directory ``out`` (new, empty, or one holding
    the same study, whose runs it adds to); returns the number of runs restored. ``models``:
    ``{key: directory}`` that each ``{MODEL:key}`` becomes (default: the real models converted
    on this machine; a key it lacks is an error naming ``make real-models``).

    Every input is read and checked first (:class:`ArchiveError` naming the value and the fix:
    no archive, no ``runs/``, a stray file, a truncated ``.gz``, ``out`` a file or another study's
    directory); then a new study is built in a temporary directory beside ``out`` and renamed, and
    a run added to an existing study likewise, so an interruption leaves nothing half-written.
    """
    from klpo._io import atomic_dir, write_text_atomic

    models = _models() if models is None else models
    study, runs = _read_archive(src, out, models)
    same = _check_out(out, study)

    def write_run(root: Path, name: str, files: dict[str, str]) -> None:
        with atomic_dir(root / "runs" / name) as tmp:
            for fname, text in files.items():
                write_text_atomic(tmp / fname, text)

    if not same:
        with atomic_dir(out) as tmp:
            for name, text in study.items():
                write_text_atomic(tmp / name, text)
            for name, files in runs.items():
                write_run(tmp, name, files)
        return len(runs)
    n = 0
    for name, files in runs.items():
        if (out / "runs" / name / "result.yaml").exists():
            continue  # already here
        write_run(out, name, files)
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="a study directory -> an archive to commit")
    e.add_argument("out", type=Path)
    e.add_argument("dest", type=Path)
    r = sub.add_parser("restore", help="an archive -> a study directory klpo compare finishes")
    r.add_argument("src", type=Path)
    r.add_argument("out", type=Path)
    a = p.parse_args()
    try:
        if a.cmd == "export":
            print(f"{export(a.out, a.dest)} finished runs archived in {a.dest}")
        else:
            print(f"{restore(a.src, a.out)} runs restored into {a.out}")
    except ArchiveError as err:
        print(f"archive.py {a.cmd}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
