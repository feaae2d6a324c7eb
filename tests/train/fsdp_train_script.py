"""Run by torchrun in test_fsdp.py: `klpo train` with dist.strategy=fsdp, then a resume.

    torchrun --nproc_per_node 2 fsdp_train_script.py MODEL RUN_DIR

Two steps with a sharded checkpoint after each, then the run resumed from its last checkpoint to
step 3 (one launch, to keep the test's process start-ups few).
"""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import exit_if_threads_left, quick_overrides
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.dist import init_distributed


def main(model: str, run_dir: str) -> None:
    extra = {"dist.strategy": "fsdp", "run.save_every": 1, "run.eval_every": 2, "data.eval_size": 4}
    dist = init_distributed(threads=1)
    leave = loop.shutdown
    loop.shutdown = lambda *_, **__: None  # one process group for both runs; left at the end
    for steps, resume in ((2, False), (3, True)):
        cfg = build_config(
            overrides=quick_overrides(Path(model), Path(run_dir), **extra, **{"run.steps": steps})
        )
        loop.train(cfg, resume=resume, log=lambda msg: print(msg, file=sys.stderr))
    leave(dist)
    exit_if_threads_left(dist.rank)  # gloo's threads ended in the trainer's shutdown


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
