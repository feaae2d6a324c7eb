"""Run by torchrun in test_fsdp.py: a stale sampler (`rollout.staleness: 1`) under FSDP.

    torchrun --nproc_per_node 2 fsdp_stale_script.py MODEL OUT

Four runs in one process group: `whole` (4 steps, sharded), `part` (the same, stopped after
step 2 and resumed to step 4) and `ddp` (the same 4 steps unsharded, for comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import exit_if_threads_left, quick_overrides
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.dist import init_distributed

STALE = {"rollout.staleness": 1, "run.save_every": 2, "run.eval_every": 0, "kl.estimator": "k3"}


def main(model: str, out: str) -> None:
    dist = init_distributed(threads=1)
    leave = loop.shutdown
    loop.shutdown = lambda *_, **__: None  # one process group for every run; left at the end
    runs = [("whole", "fsdp", 4, False), ("part", "fsdp", 2, False), ("part", "fsdp", 4, True),
            ("ddp", "ddp", 4, False)]  # fmt: skip
    for name, strategy, steps, resume in runs:
        extra = {**STALE, "dist.strategy": strategy, "run.steps": steps}
        cfg = build_config(overrides=quick_overrides(Path(model), Path(out) / name, **extra))
        loop.train(cfg, resume=resume, log=lambda msg: print(msg, file=sys.stderr))
    leave(dist)
    exit_if_threads_left(dist.rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
