"""GRPO steps on a locally built ~0.5B-shape model on CUDA: tokens/s and peak GPU memory.

    python bench/gpu_check.py build DIR            # the model (no download)
    python bench/gpu_check.py run DIR OUT [--set k=v ...]   # one run; under torchrun for FSDP

``bench/gpu_check.sh`` drives it. The model has Qwen2-0.5B's shape (24 layers, hidden 896, 14
query / 2 key-value heads, MLP 4864) with the built-in task's character tokenizer, so its
~360M parameters are all in the layers (the real model adds a 136M-parameter embedding for its
151k-token vocabulary). ``run`` trains with ``klpo train`` and prints one JSON line: the median
tokens/s over the steps after the first, and the peak GPU memory of rank 0.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def build(path: str) -> None:
    import torch

    from klpo.train.tools.make_reference import ReferenceConfig, build_model, build_tokenizer

    tok = build_tokenizer()
    cfg = ReferenceConfig(
        arch="qwen2",
        hidden_size=896,
        num_layers=24,
        intermediate_size=4864,
        num_heads=14,
        num_kv_heads=2,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = build_model(cfg, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    print(f"built {path}: {n / 1e6:.0f}M parameters", file=sys.stderr)


def run(model: str, out: str, overrides: list[str]) -> None:
    import torch

    from klpo.train import loop
    from klpo.train.config import build_config
    from klpo.train.runtime.metrics import read_metrics

    base = [
        f"model.policy={model}",
        f"run.out_dir={out}",
        "run.steps=6",
        "run.eval_every=0",
        "run.save_every=0",
        "run.progress=false",
        "run.tensorboard=false",
        "rollout.prompts_per_step=32",
        "rollout.group_size=8",
        "rollout.max_new_tokens=64",
        "kl.estimator=full",
        "kl.beta=0.02",
    ]
    cuda = torch.cuda.is_available()  # (runs on CPU too, to check the script itself)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    loop.train(build_config(overrides=base + overrides), log=lambda *_: None)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "tokens_per_s" in r]
    tps = statistics.median(r["tokens_per_s"] for r in rows[1:]) if len(rows) > 1 else None
    print(json.dumps({"tokens_per_s": tps, "peak_gib_rank0": peak, "steps": len(rows)}))


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2])
    else:
        args = sys.argv[4:]
        run(sys.argv[2], sys.argv[3], [a for a in args if a != "--set"])
