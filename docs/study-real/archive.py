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
would run with) and running the rest.

    python docs/study-real/archive.py export runs/real-study docs/study-real/chat-arith
    python docs/study-real/archive.py restore docs/study-real/chat-arith runs/real-study
"""

from __future__ import annotations

import argparse
import gzip
import shutil
from pathlib import Path

STUDY_FILES = ("study.yaml", "train-config.yaml", "results.csv", "report.md")
RUN_TEXT = ("config.yaml", "result.yaml")
RUN_GZIP = ("metrics.jsonl", "samples.jsonl")


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
        raise SystemExit(f"the archive names the real model {key!r}: run `make real-models` first")
    return text


def export(out: Path, dest: Path) -> int:
    """Write the archive of the study in ``out`` into ``dest`` (replacing its runs); returns
    the number of finished runs kept."""
    models = _models()
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


def restore(src: Path, out: Path) -> int:
    """Write the archive ``src`` back as a study directory ``out`` (new, or one whose runs it
    adds to); returns the number of runs restored."""
    models = _models()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("study.yaml", "train-config.yaml"):
        if (src / name).is_file():
            text = (src / name).read_text(encoding="utf-8")
            (out / name).write_text(from_archive(text, out, models), encoding="utf-8")
    n = 0
    for run in sorted((src / "runs").iterdir()):
        target = out / "runs" / run.name
        if (target / "result.yaml").exists():
            continue  # already here
        target.mkdir(parents=True, exist_ok=True)
        for name in RUN_GZIP:
            with gzip.open(run / f"{name}.gz", "rt", encoding="utf-8") as f:
                (target / name).write_text(from_archive(f.read(), out, models), encoding="utf-8")
        for name in ("config.yaml", "result.yaml"):  # result.yaml last: the run is then finished
            text = (run / name).read_text(encoding="utf-8")
            (target / name).write_text(from_archive(text, out, models), encoding="utf-8")
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="a study directory -> an archive to commit")
    e.add_argument("out", type=Path)
    e.add_argument("dest", type=Path)
    r = sub.add_parser("restore", help="an archive -> a study directory klpo compare finishes")
    r.add_argument("src", type=Path)
    r.add_argument("out", type=Path)
    a = p.parse_args()
    if a.cmd == "export":
        print(f"{export(a.out, a.dest)} finished runs archived in {a.dest}")
    else:
        print(f"{restore(a.src, a.out)} runs restored into {a.out}")


if __name__ == "__main__":
    main()
