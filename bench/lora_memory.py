"""Peak memory of a LoRA run against a full fine-tune with a separate reference, same batch.

    python bench/lora_memory.py [--steps 2] [--layers 14] [--hidden 768]

Builds a ~100M-parameter Llama locally (random initialisation, the built-in task's character
tokenizer; nothing is downloaded), saves it to a temporary directory, then runs ``klpo train`` on
it twice, each run in its own subprocess so that each peak is its own:

* ``full``: every weight trained (float32 weights, gradients and two AdamW moments) and the
  reference loaded as a second frozen copy of the model;
* ``lora``: ``model.lora={r: 16, alpha: 32}`` on every linear layer, the reference being the same
  module with its adapters disabled (klpo.train.models.lora).

Both run the same job: GRPO with the exact KL in the loss, 4 prompts × 4 completions of up to 16
tokens per step, one process, one thread, a checkpoint at the end. The peak resident set size
(``ru_maxrss``) of each subprocess is printed in a table with the ratio; the target is
``lora / full <= 0.6``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(path: Path, layers: int, hidden: int) -> int:
    """Save a random Llama of ``layers`` × ``hidden`` (MLP 8/3 wider, 12 heads) to ``path``."""
    import torch

    from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    cfg = ReferenceConfig(
        hidden_size=hidden,
        num_layers=layers,
        intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
        num_heads=12,
        num_kv_heads=12,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    model = build_model(cfg, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def child(mode: str, model: str, out: str, steps: int) -> None:
    """One run, in this process; prints its peak RSS and trainable parameter count as JSON."""
    from klpo.train import loop
    from klpo.train.config import build_config

    overrides = [
        f"model.policy={model}",
        f"run.out_dir={out}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.save_every=0",
        "run.threads=1",
        "run.progress=false",
        "run.tensorboard=false",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=16",
        "kl.estimator=full",
        "kl.beta=0.05",
    ]
    if mode == "lora":
        overrides.append("model.lora={r: 16, alpha: 32}")
    else:
        overrides.append(f"model.reference={model}")  # a separate, frozen copy
    t0 = time.perf_counter()
    loop.train(build_config(overrides=overrides), log=lambda *_: None)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"peak_mib": peak_kib / 1024, "seconds": time.perf_counter() - t0}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=14)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "MODEL", "OUT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        child(*args.child, steps=args.steps)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent / "src"), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        n = build(model, args.layers, args.hidden)
        print(f"model: Llama, {args.layers} layers × {args.hidden} wide, {n / 1e6:.1f}M parameters")
        rows = {}
        for mode in ("full", "lora"):
            cmd = [sys.executable, __file__, "--steps", str(args.steps), "--child", mode]
            cmd += [str(model), str(Path(tmp) / mode)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{mode} run failed:\n{done.stderr[-3000:]}")
            rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    full = rows["full"]["peak_mib"]
    print(f"\n| run | peak RSS (MiB) | vs full | time for {args.steps} steps (s) |")
    print("| --- | ---: | ---: | ---: |")
    labels = {
        "full": "full fine-tune + separate reference",
        "lora": "LoRA r=16, adapter-free reference",
    }
    for mode, r in rows.items():
        print(
            f"| {labels[mode]} | {r['peak_mib']:.0f} | {r['peak_mib'] / full:.2f}× | {r['seconds']:.1f} |"
        )
    ratio = rows["lora"]["peak_mib"] / full
    print(f"\nLoRA / full = {ratio:.2f} (target <= 0.60): {'met' if ratio <= 0.6 else 'NOT met'}")


if __name__ == "__main__":
    main()
