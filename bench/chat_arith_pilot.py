"""The real-model task pilot: which setting of the chat task makes SmolLM2 learn within a CPU budget.

Each setting is one ``klpo train -c configs/smollm2-chat-grpo-lora.yaml`` run (GRPO, LoRA, the KL
measured and not in the loss) with a few keys changed: completions per step, learning rate,
the solved examples before each question (``data.shots``) and the completion length. Each run's
adapters are evaluated, greedy, on the first ``--n`` held-out problems by
``bench/chat_arith_eval.py``, against the base model evaluated with the same prompt format and
completion length: accuracy before and after with 95% Wilson intervals, the problems turned right
and turned wrong, and the exact McNemar p-value of that paired comparison. A setting "learns"
when the accuracy after lies above the base model's interval and the paired p-value is below
0.05. Checkpoints every ``--save-every`` steps give the accuracy against the step.

    python bench/chat_arith_pilot.py --model DIR --out PILOT_DIR [--only p0,p1] [--n 100]
        [--curve p0] [--table docs/study-real/pilot.md --plot docs/study-real/pilot.png]

Everything is written under ``PILOT_DIR`` (one directory per run, one JSON per evaluation) and a
second invocation skips what is there, so an interrupted pilot resumes; ``--table``/``--plot``
alone (``--only none``) only re-read the results. One process runs at a time, at one thread.
Docs: docs/study-real/pilot.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "smollm2-chat-grpo-lora.yaml"

# name: (what it changes, the klpo train keys on top of CONFIG). Every run: 24 steps, seed 0.
SETTINGS: dict[str, tuple[str, dict[str, object]]] = {
    "p0": ("the job as shipped: lr 3e-4, 2x4, 12 tokens, one shot", {}),
    "p1": ("one solved example of each kind", {"data.shots": "per-kind"}),
    "p2": ("lr 5e-4", {"optim.lr": 5e-4}),
    "p3": ("2 prompts x 8 completions", {"rollout.group_size": 8}),
    "p4": ("24 tokens", {"rollout.max_new_tokens": 24}),
    "p5": ("one of each kind, lr 5e-4", {"data.shots": "per-kind", "optim.lr": 5e-4}),
    "p6": ("4 prompts x 4 completions", {"rollout.prompts_per_step": 4}),
    "p7": ("dynamic sampling, up to 3 rounds", {"rollout.dynamic_sampling": True}),
}
STEPS = 24


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def _run(cmd: list[str], log: Path) -> None:
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), check=True)


def _eval_keys(keys: dict[str, object]) -> tuple[str, int]:
    return str(keys.get("data.shots", "one")), int(keys.get("rollout.max_new_tokens", 12))


def base_eval(model: str, out: Path, shots: str, tokens: int, n: int) -> Path:
    """The base model's evaluation with this prompt format and completion length (made once)."""
    path = out / f"base-{shots}-t{tokens}-n{n}.json"
    if not path.exists():
        _eval(model, None, shots, tokens, n, path, None, out / "eval.log")
    return path


def _eval(
    model: str,
    adapter: Path | None,
    shots: str,
    tokens: int,
    n: int,
    path: Path,
    against: Path | None,
    log: Path,
) -> None:
    cmd = [sys.executable, str(HERE / "chat_arith_eval.py"), "--model", model, "--n", str(n)]
    cmd += ["--shots", shots, "--max-new-tokens", str(tokens), "--json", str(path)]
    cmd += ["--adapter", str(adapter)] if adapter else []
    cmd += ["--against", str(against)] if against else []
    _run(cmd, log)


def train(model: str, out: Path, name: str, keys: dict[str, object], save_every: int) -> Path:
    """The setting's run directory, trained to ``STEPS`` (skipped when its last checkpoint is
    there)."""
    run_dir = out / name
    if (run_dir / "checkpoints" / f"step_{STEPS:06d}").is_dir():
        if not (run_dir / "loadavg.json").exists():  # trained by hand with the same keys
            (run_dir / "loadavg.json").write_text(json.dumps({"at_end": os.getloadavg()}) + "\n")
        return run_dir
    cmd = [sys.executable, "-m", "klpo", "train", "-c", str(CONFIG)]
    sets = {
        "model.policy": model,
        "run.threads": 1,
        "run.eval_every": 0,
        "run.steps": STEPS,
        "run.save_every": save_every,
        "run.save_total_limit": "null",  # every checkpoint kept: the curve evaluates each
        "run.out_dir": str(run_dir),
        **keys,
    }
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    if run_dir.exists():  # interrupted: continue from its last checkpoint
        cmd = [sys.executable, "-m", "klpo", "train", "--resume", str(run_dir)]
    _run(cmd, out / f"{name}.log")
    load = os.getloadavg()
    (run_dir / "loadavg.json").write_text(json.dumps({"at_end": load}) + "\n")
    return run_dir


def evaluate_run(model: str, out: Path, name: str, step: int, n: int) -> Path:
    keys = SETTINGS[name][1]
    shots, tokens = _eval_keys(keys)
    base = base_eval(model, out, shots, tokens, n)
    path = out / f"{name}-step{step}-n{n}.json"
    if not path.exists():
        adapter = out / name / "checkpoints" / f"step_{step:06d}" / "policy"
        _eval(model, adapter, shots, tokens, n, path, base, out / "eval.log")
    return path


def _step_times(run_dir: Path) -> tuple[float, float, int]:
    """(mean s/step, mean s per step with a signal, steps skipped for want of a signal)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    times = [r["time/step"] for r in rows]
    live = [r["time/step"] for r in rows if not r.get("step/skipped")]
    skipped = sum(1 for r in rows if r.get("step/skipped"))
    return statistics.fmean(times), statistics.fmean(live) if live else float("nan"), skipped


def _step_of(path: Path) -> int:
    """The step of an evaluation's file, ``NAME-stepS-nN.json``."""
    return int(path.stem.rsplit("-step", 1)[1].split("-n")[0])


def _pct(k: int, n: int) -> str:
    from klpo.train.evaluate import wilson_interval

    lo, hi = wilson_interval(k, n)
    return f"{100 * k / n:.0f}% ({k}/{n}; {100 * lo:.1f}–{100 * hi:.1f}%)"


def table(out: Path, n: int) -> tuple[str, list[dict]]:
    """The pilot's Markdown table and its rows, from what ``out`` holds."""
    rows = []
    for name, (what, _keys) in SETTINGS.items():
        run_dir = out / name
        evals = sorted(out.glob(f"{name}-step*-n{n}.json"), key=_step_of)
        if not evals or not (run_dir / "metrics.jsonl").exists():
            continue
        per_step, live, skipped = _step_times(run_dir)
        load = json.loads((run_dir / "loadavg.json").read_text())["at_end"]
        for path in evals:
            r = json.loads(path.read_text())
            a = r["against"]
            step = _step_of(path)
            rows.append(
                {
                    "setting": name,
                    "what": what,
                    "step": step,
                    "s_per_step": per_step,
                    "s_per_live_step": live,
                    "skipped": skipped,
                    "loadavg15": load[2],
                    "n": a["n"],
                    "before": a["before"],
                    "after": a["after"],
                    "gained": a["gained"],
                    "lost": a["lost"],
                    "p": a["mcnemar_p"],
                    "by_kind": r["by_kind"],
                    "tokens": r["mean_completion_tokens"],
                }
            )
    lines = [
        "| setting | what changes | steps | s/step (with a signal; skipped) | load (15 min) "
        "| held-out before → after (95% Wilson) | gained / lost | McNemar p | after, by kind "
        "| tokens |",
        "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: |",
    ]
    for r in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in r["by_kind"].items())
        lines.append(
            f"| {r['setting']} | {r['what']} | {r['step']} | {r['s_per_step']:.0f} "
            f"({r['s_per_live_step']:.0f}; {r['skipped']}) | {r['loadavg15']:.1f} "
            f"| {_pct(r['before'], r['n'])} → **{_pct(r['after'], r['n'])}** "
            f"| {r['gained']} / {r['lost']} | {r['p']:.2g} | {kinds} | {r['tokens']:.1f} |"
        )
    return "\n".join(lines) + "\n", rows


def plot(rows: list[dict], path: Path) -> None:
    """Accuracy against the step, one line per setting, with Wilson bars; the base at step 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from klpo.train.evaluate import wilson_interval
    from klpo.train.runtime.report import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["setting"] for r in rows):
        mine = [r for r in rows if r["setting"] == name]
        pts = [(0, mine[0]["before"], mine[0]["n"])] + [
            (r["step"], r["after"], r["n"]) for r in mine
        ]
        xs = [s for s, _, _ in pts]
        ys = [100 * k / n for _, k, n in pts]
        err = [wilson_interval(k, n) for _, k, n in pts]
        lo = [y - 100 * e[0] for y, e in zip(ys, err, strict=True)]
        hi = [100 * e[1] - y for y, e in zip(ys, err, strict=True)]
        ax.errorbar(
            xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=f"{name}: {mine[0]['what']}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy, % (95% Wilson)")
    ax.set_title("SmolLM2-135M-Instruct, GRPO + LoRA on the chat task")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="SmolLM2's float32 model directory")
    ap.add_argument("--out", type=Path, required=True, help="the pilot's directory")
    ap.add_argument("--only", default=",".join(SETTINGS), help="settings to run (none: only read)")
    ap.add_argument("--n", type=int, default=100, help="held-out problems per evaluation")
    ap.add_argument("--save-every", type=int, default=8)
    ap.add_argument("--curve", default="", help="settings whose earlier checkpoints to evaluate")
    ap.add_argument("--table", type=Path, help="write the Markdown table here")
    ap.add_argument("--plot", type=Path, help="write the accuracy-against-step plot here")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = [] if args.only == "none" else args.only.split(",")
    unknown = [x for x in names + [c for c in args.curve.split(",") if c] if x not in SETTINGS]
    if unknown:
        ap.error(f"unknown setting {unknown[0]!r}; the settings: {', '.join(SETTINGS)}")
    if (names or args.curve) and not args.model:
        ap.error("--model is needed to train or evaluate")
    for name in names:
        train(args.model, args.out, name, SETTINGS[name][1], args.save_every)
        evaluate_run(args.model, args.out, name, STEPS, args.n)
        print(table(args.out, args.n)[0], flush=True)
    for name in filter(None, args.curve.split(",")):
        for step in range(args.save_every, STEPS, args.save_every):
            if (args.out / name / "checkpoints" / f"step_{step:06d}").is_dir():
                evaluate_run(args.model, args.out, name, step, args.n)
            else:
                print(f"{name}: no checkpoint of step {step} (removed by run.save_total_limit)")
    text, rows = table(args.out, args.n)
    print(text)
    if args.table:
        args.table.write_text(text)
    if args.plot and rows:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
