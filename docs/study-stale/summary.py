"""The staleness study's table: every lag's cells side by side, with the sampler diagnostics.

Each lag is its own ``klpo compare`` study (``configs/studies/stale.yaml``, with ``stale-1.yaml``,
``stale-2.yaml`` or ``stale-4.yaml`` for the lag), archived under ``docs/study-stale/stale-K/`` by
``docs/study-real/archive.py export``. This script reads each archive's ``results.csv`` and its
runs' metrics and prints one markdown table: per lag and KL choice, the final held-out accuracy
(mean ± sd over seeds), the exact KL(pi_theta ‖ pi_ref) per token over the last 10 steps, the
runs that failed (collapsed ones included, which still count in the means: on the
over-optimisation task a collapse is the outcome the study measures), and the mean over every
step of the trust-region diagnostics (``sampler/*``, docs/async.md) and of the largest per-position exact KL(pi_behav ‖ pi_old).

    python docs/study-stale/summary.py docs/study-stale            # the table, to stdout
    python docs/study-stale/summary.py docs/study-stale --out docs/study-stale/table.md
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import statistics
import tempfile
from pathlib import Path

DIAGNOSTICS = (  # (metric, column heading, format)
    ("sampler/ess", "ESS", ".3f"),
    ("sampler/m2", "M2", ".4f"),
    ("sampler/kl_exact", "KL(behav‖old)", ".4f"),
    ("sampler/kl_exact_max", "its max", ".3f"),
    ("sampler/tv_exact", "TV", ".4f"),
    ("sampler/clip_frac", "clip share", ".3f"),
)
FINISHED = ("ok", "collapsed")  # results.csv statuses of runs that ran every step
CHOICE_ORDER = ("no KL", "k3 (no IS) loss", "k3 (IS) loss", "full loss", "no KL (sampler k2)")


def lag_of(study_dir: Path) -> int:
    """The lag of an archived study: the ``rollout.staleness`` of its study.yaml (0 if unset)."""
    import yaml

    study = yaml.safe_load((study_dir / "study.yaml").read_text(encoding="utf-8"))
    return int((study.get("base") or {}).get("rollout.staleness", 0))


def read_metrics(run_dir: Path) -> list[dict]:
    """A run's metric rows, from ``metrics.jsonl`` or the archive's ``metrics.jsonl.gz``."""
    plain, packed = run_dir / "metrics.jsonl", run_dir / "metrics.jsonl.gz"
    if plain.is_file():
        text = plain.read_text(encoding="utf-8")
    elif packed.is_file():
        text = gzip.decompress(packed.read_bytes()).decode("utf-8")
    else:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def run_diagnostics(rows: list[dict]) -> dict[str, float]:
    """The mean over the run's steps of each diagnostic it logged (none at lag 0)."""
    out = {}
    for key, _, _ in DIAGNOSTICS:
        values = [r[key] for r in rows if key in r]
        if values:
            out[key] = statistics.fmean(values)
    return out


def mean_sd(values: list[float]) -> str:
    """``mean ± sd`` (sd over seeds, ``ddof=1``), or the mean alone for one value.

    >>> mean_sd([0.5, 0.52, 0.48]), mean_sd([0.5])
    ('0.500 ± 0.020', '0.500')
    """
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f}"


def cells(root: Path) -> list[dict]:
    """One dict per (lag, choice) over the archived studies under ``root`` (``stale-*``)."""
    out = []
    for study_dir in sorted(root.glob("stale-*")):
        if not (study_dir / "results.csv").is_file():
            continue
        lag = lag_of(study_dir)
        with (study_dir / "results.csv").open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        by_choice: dict[str, list[dict]] = {}
        for r in rows:
            by_choice.setdefault(r["choice"], []).append(r)
        for choice, runs in by_choice.items():
            # A collapsed run finished: on the over-optimisation task its collapse is the
            # outcome measured, so its accuracy and KL count; a crashed or diverged one's do not.
            done = [r for r in runs if r["status"] in FINISHED]
            diags = [run_diagnostics(read_metrics(study_dir / "runs" / r["name"])) for r in done]
            cell = {
                "lag": lag,
                "choice": choice,
                "seeds": len(done),
                "failed": sum(r["status"] != "ok" for r in runs),
                "runs": len(runs),
                "acc": [float(r["acc_final"]) for r in done],
                "acc_start": float(runs[0]["acc_start"]),
                "kl": [float(r["kl_exact_final"]) for r in done],
            }
            for key, _, _ in DIAGNOSTICS:
                vals = [d[key] for d in diags if key in d]
                cell[key] = statistics.fmean(vals) if vals else math.nan
            out.append(cell)
    rank = {c: i for i, c in enumerate(CHOICE_ORDER)}
    return sorted(out, key=lambda c: (rank.get(c["choice"], len(rank)), c["choice"], c["lag"]))


def table(found: list[dict]) -> str:
    """The markdown table of :func:`cells`."""
    head = ["KL choice", "lag", "seeds", "held-out final", "exact KL", "failed"]
    head += [h for _, h, _ in DIAGNOSTICS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for c in found:
        diag = ["–" if math.isnan(c[k]) else format(c[k], spec) for k, _, spec in DIAGNOSTICS]
        kl = statistics.fmean(c["kl"]) if c["kl"] else math.nan
        row = [c["choice"], str(c["lag"]), str(c["seeds"]), mean_sd(c["acc"]) if c["acc"] else "–"]
        row += [f"{kl:.3f}", f"{c['failed']}/{c['runs']}", *diag]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path, help="the folder of the stale-K archives")
    parser.add_argument("--out", type=Path, help="write the table here (atomically)")
    args = parser.parse_args()
    found = cells(args.root)
    if not found:
        raise SystemExit(f"no stale-*/results.csv under {args.root}: export the studies first")
    text = table(found) + "\n"
    if args.out is None:
        print(text, end="")
        return
    fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=f".{args.out.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
