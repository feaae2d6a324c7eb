"""The over-optimisation curve of one or more `klpo train` runs on `data.source=builtin-overopt`.

Plots gold reward (exact correctness) and proxy reward (trained on) against the step, and the exact
sequence KL(pi_theta ‖ pi_ref), each as a 10-step running mean, one colour per run; prints a
Markdown table of the curves every ``--every`` steps. The runs are made with (docs/overopt.md)::

    klpo train --set data.source=builtin-overopt --set kl.placement=none --set run.steps=250 \
        --set run.out_dir=runs/overopt-nokl
    klpo train --set data.source=builtin-overopt --set kl.beta=0.1 --set run.steps=250 \
        --set run.out_dir=runs/overopt-full-0.1

    python bench/overopt_curve.py runs/overopt-nokl runs/overopt-full-0.1 \
        --label "no KL" --label "full loss, beta 0.1" --out docs/overopt/curve.png
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.report import save_figure

WINDOW = 10


def running_mean(xs: list[float], n: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (metrics.jsonl)")
    ap.add_argument("--label", action="append", default=[], help="one label per run, in order")
    ap.add_argument("--out", type=Path, default=Path("overopt_curve.png"))
    ap.add_argument("--every", type=int, default=25, help="table rows every N steps")
    args = ap.parse_args()
    labels = args.label + [str(r) for r in args.runs[len(args.label) :]]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_k) = plt.subplots(1, 2, figsize=(11, 4))
    table = [
        "| run | step | gold | proxy | proxy − gold | exact seq KL |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run, label in zip(args.runs, labels, strict=True):
        rows = [r for r in read_metrics(run / "metrics.jsonl") if "reward/gold" in r]
        steps = [r["step"] for r in rows]
        gold = running_mean([r["reward/gold"] for r in rows])
        proxy = running_mean([r["reward/proxy"] for r in rows])
        seq = running_mean([r["kl/ref/seq"] for r in rows])
        (line,) = ax_r.plot(steps, gold, label=f"{label}: gold", lw=1.8)
        ax_r.plot(steps, proxy, ls="--", color=line.get_color(), label=f"{label}: proxy", lw=1.2)
        ax_k.plot(steps, seq, color=line.get_color(), label=label, lw=1.5)
        for i, s in enumerate(steps):
            if s % args.every == 0 or i == len(steps) - 1:
                table.append(
                    f"| {label} | {s} | {gold[i]:.3f} | {proxy[i]:.3f} | {proxy[i] - gold[i]:.3f} "
                    f"| {seq[i]:.3f} |"
                )
    ax_r.set_xlabel("step")
    ax_r.set_ylabel(f"reward ({WINDOW}-step running mean)")
    ax_r.set_title("gold (solid) and proxy (dashed) reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend(frameon=False, fontsize=8)
    ax_k.set_xlabel("step")
    ax_k.set_ylabel("exact KL(pi_theta ‖ pi_ref) per completion")
    ax_k.set_yscale("symlog", linthresh=0.1)
    ax_k.set_title("exact sequence KL to the reference")
    ax_k.grid(alpha=0.3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, args.out)
    print("\n".join(table))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
