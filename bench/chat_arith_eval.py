"""Held-out accuracy of a chat model on the built-in chat task, with its 95% Wilson interval.

Greedy completions of the first ``--n`` held-out problems of ``data.source: builtin-chat-arith``
(the trainer's own evaluation: the chat template, the model's stop set, the numeric reward), in
float32, for a model directory and optionally a run's LoRA adapters on it. The learning-rate and
batch measurement of docs/real-models.md ("The real-model job") evaluates each run this way, so
that the base model is evaluated once and every trained run against the same problems.

    python bench/chat_arith_eval.py --model DIR [--adapter RUN/checkpoints/step_000040/policy]
        [--n 200] [--max-new-tokens 12] [--shots one] [--json OUT.json] [--against BASE.json]

``--shots`` is the run's ``data.shots`` (the solved examples before each question); evaluate a run
with its own, and compare it with the base model evaluated with the same.

``--against`` compares problem by problem with an earlier result (the base model's) on the
problems both evaluated: how many turned right and how many turned wrong, and the exact two-sided
McNemar p-value (a sign test on the problems that changed; McNemar 1947), which is more sensitive
than comparing the two intervals.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from klpo.study.summary import mcnemar_exact
from klpo.train.data.chat_task import ChatArithmeticTask
from klpo.train.data.sources import render_chat
from klpo.train.evaluate import evaluate, wilson_interval
from klpo.train.models.tokens import Codec
from klpo.train.rollout.samplers import Decoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the base model directory")
    ap.add_argument("--adapter", help="a run's adapter directory (checkpoints/step_N/policy)")
    ap.add_argument("--n", type=int, default=200, help="held-out problems (the first n)")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--shots", default="one", help="data.shots: one, per-kind or none")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--against", help="an earlier result (JSON) to compare problem by problem")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    if args.adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    t_load = time.perf_counter() - t0
    heldout = ChatArithmeticTask(shots=args.shots).splits()[1][: args.n]
    examples = render_chat(heldout, tok, chat=True)
    codec = replace(Codec.plain(tok, model), chat=True)
    t0 = time.perf_counter()
    ev = evaluate(
        model,
        tok,
        examples,
        Decoding(max_new_tokens=args.max_new_tokens, greedy=True),
        reward="numeric",
        codec=codec,
    )
    t_eval = time.perf_counter() - t0
    k = int(sum(s for s in ev.scores if s))
    lo, hi = wilson_interval(k, len(examples))
    by_kind: Counter = Counter()
    right: Counter = Counter()
    for e, s in zip(heldout, ev.scores, strict=True):
        by_kind[e.columns["kind"]] += 1
        right[e.columns["kind"]] += int(bool(s))
    completions = ev.first.completions
    result = {
        "model": args.model,
        "adapter": args.adapter,
        "shots": args.shots,
        "max_new_tokens": args.max_new_tokens,
        "n": len(examples),
        "correct": k,
        "accuracy": k / len(examples),
        "wilson95": [lo, hi],
        "by_kind": {kind: f"{right[kind]}/{n}" for kind, n in sorted(by_kind.items())},
        "mean_completion_tokens": float(ev.first.mask.sum()) / len(completions),
        "truncated": int(ev.first.truncated.sum()),
        "scores": [int(bool(s)) for s in ev.scores],
        "load_s": round(t_load, 1),
        "eval_s": round(t_eval, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "first": [
            {"q": e.messages[-1][1], "answer": e.answer, "completion": c}
            for e, c in zip(examples[:8], completions[:8], strict=False)
        ],
    }
    if args.against:
        base = json.loads(Path(args.against).read_text())["scores"]
        pairs = list(zip(base, result["scores"], strict=False))
        gained = sum(1 for b, a in pairs if a and not b)
        lost = sum(1 for b, a in pairs if b and not a)
        result["against"] = {
            "file": args.against,
            "n": len(pairs),
            "before": sum(b for b, _ in pairs),
            "after": sum(a for _, a in pairs),
            "gained": gained,
            "lost": lost,
            "mcnemar_p": mcnemar_exact(gained, lost),
        }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
