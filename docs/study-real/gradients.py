"""Measure each KL choice's gradient on SmolLM2 at policies the real-model study trained:
``klpo doctor --model`` on the final policy of finished study runs, against the base model.

For each run given, the run's final LoRA policy is merged into a plain model (``klpo export
--merge``), the first held-out problems of the built-in chat task are written as conversational
prompts, and the doctor samples completions from the policy and measures every estimator ×
placement's gradient on the last decoder layer's MLP against the exact gradients of
KL(pi_theta ‖ pi_ref) and KL(pi_ref ‖ pi_theta). Its report goes to ``DEST/<run name>.txt``.

    make real-models
    klpo compare --task chat-arith -c configs/studies/real-beta-pilot.yaml --out runs/real-beta
    python docs/study-real/gradients.py docs/study-real/gradients \\
        runs/real-beta/runs/grpo_no-KL_b0_s0 runs/real-beta/runs/grpo_full-loss_b0.05_s0

About two minutes a run at one thread (8 prompts × 32 completions of up to 12 tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = 8
SAMPLES = 32
MAX_NEW_TOKENS = 12  # the study's rollout.max_new_tokens


def write_prompts(path: Path, n: int) -> None:
    """The first ``n`` held-out problems of the chat task, as JSONL conversations."""
    from klpo.train.data.chat_task import ChatArithmeticTask

    _, heldout = ChatArithmeticTask().splits()
    with path.open("w", encoding="utf-8") as f:
        for e in heldout[:n]:
            f.write(json.dumps({"prompt": e.row["prompt"], "answer": e.answer}) + "\n")


def measure(run: Path, dest: Path, reference: str, prompts: Path, work: Path) -> Path:
    """The doctor's report on ``run``'s final policy, written to ``dest/<run>.txt``."""
    klpo = [sys.executable, "-m", "klpo"]
    merged = work / run.name
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(
        [*klpo, "export", str(run), "--out", str(merged), "--merge"], check=True, env=env
    )
    out = subprocess.run(
        [*klpo, "doctor", str(run / "config.yaml"), "--model", str(merged), "--reference",
         reference, "--data", str(prompts), "--chat", "--prompts", str(PROMPTS), "--samples",
         str(SAMPLES), "--max-new-tokens", str(MAX_NEW_TOKENS)],
        check=True, env=env, capture_output=True, text=True,
    )  # fmt: skip
    target = dest / f"{run.name}.txt"
    text = out.stdout.replace(str(run.parent.parent.parent.resolve()), "{OUT}")
    tmp = target.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(target)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dest", type=Path, help="where the reports go")
    p.add_argument("runs", type=Path, nargs="+", help="finished study runs (with checkpoints)")
    a = p.parse_args()
    from klpo.train.tools.real_models import real_model_dir

    reference = real_model_dir("smollm2")
    if reference is None:
        raise SystemExit("SmolLM2 is not converted here: run `make real-models` first")
    a.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prompts = work / "heldout-chat.jsonl"
        write_prompts(prompts, PROMPTS)
        for run in a.runs:
            print(f"wrote {measure(run, a.dest, str(reference), prompts, work)}")


if __name__ == "__main__":
    main()
