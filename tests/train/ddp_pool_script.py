"""Run by torchrun in test_resume_ddp.py: the pooled ``sampler/*`` metrics and M2PO's mask over
a real gloo group, against one process holding the whole batch.

    torchrun --nproc_per_node 3 ddp_pool_script.py OUT_DIR

Every rank builds the same float64 batch of nine rows (a sampler's and a trainer's logits, the
sampled tokens, ragged rows, a kept-token mask), keeps its three rows padded to its own longest
(rank 1's rows have no token; the sampler is further off on rank 0's rows than on
rank 2's, so that a mask of each rank's tokens alone would not be the whole batch's), and computes with the trainer's functions: the step's
``sampler_metrics`` pooled over the ranks, and M2PO's mask over its rows in a shuffled order
(the optimizer step's tokens being every rank's rows). Each rank writes OUT_DIR/rankR.json: the
pooled metrics, the one-process metrics and mask of the whole batch (its rows in the order of
the ranks' shuffled rows), whether its mask is its rows' of the whole batch's, and the results
of ``Dist.stack`` and ``Dist.cat`` (of values, and of none on every rank).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from klpo import offpolicy
from klpo.train.config import build_config
from klpo.train.rollout.versions import SamplerGap
from klpo.train.runtime.dist import Dist, init_distributed, shutdown
from klpo.train.runtime.metrics import Tally
from klpo.train.step.step_metrics import sampler_metrics
from klpo.train.step.update import _batch_mask

F64 = torch.float64
B, C, V = 9, 6, 7


def batch() -> dict[str, torch.Tensor]:
    """The whole batch, the same on every rank (seeded)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(B, C, V, generator=gen, dtype=F64)
    # The sampler further off on rank 0's rows than on rank 2's: their masks alone would differ.
    noise = torch.tensor([1.0] * 3 + [0.5] * 3 + [0.15] * 3, dtype=F64)[:, None, None]
    logits_behav = logits + noise * torch.randn(B, C, V, generator=gen, dtype=F64)
    tokens = torch.randint(0, V, (B, C), generator=gen)
    lengths = torch.randint(1, C + 1, (B,), generator=gen)
    lengths[3:6] = 0  # rank 1 of 3: no token at all
    mask = torch.arange(C)[None, :] < lengths[:, None]
    p, q = torch.softmax(logits, -1), torch.softmax(logits_behav, -1)
    return {
        "old": torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0],
        "behav": torch.log_softmax(logits_behav, -1).gather(-1, tokens[..., None])[..., 0],
        "mask": mask,
        "keep": mask & (torch.rand(B, C, generator=gen) > 0.3),
        "kl": torch.where(mask, (q * (q.log() - p.log())).sum(-1), 0.0),
        "tv": torch.where(mask, 0.5 * (p - q).abs().sum(-1), 0.0),
    }


def scored(x: dict[str, torch.Tensor]) -> tuple[SimpleNamespace, SamplerGap]:
    """What sampler_metrics and the M2PO mask read of a scored stale rollout."""
    rollout = SimpleNamespace(
        mask=x["mask"], behav_logp=x["behav"], sampler_logp=x["behav"], behav_version=1
    )
    old = SimpleNamespace(logp=x["old"], filled=torch.ones(x["mask"].shape[0], dtype=torch.bool))
    return SimpleNamespace(rollout=rollout, old=old, keep=x["keep"].clone()), SamplerGap(
        x["kl"], x["tv"]
    )


def main(out_dir: str) -> None:
    dist = init_distributed(threads=1)
    cfg = build_config(overrides=["rollout.staleness=1", "algo.m2po_threshold=0.05"])
    whole = batch()
    share = B // dist.world
    rows = list(range(dist.rank * share, (dist.rank + 1) * share))
    width = max(1, int(whole["mask"][rows].sum(-1).max()))
    mine = {k: v[rows][:, :width] for k, v in whole.items()}
    s, gap = scored(mine)
    pooled = sampler_metrics(cfg, s, gap, 3, dist)

    # M2PO: each rank's rows in its own shuffled order; one process holds them rank by rank.
    order = torch.randperm(share, generator=torch.Generator().manual_seed(dist.rank))
    orders = [torch.randperm(share, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    tally = Tally()
    keep = _batch_mask(cfg, s, order, tally, dist, first=True)
    masked = tally.result(dist.all_sum)["m2po/masked_frac"][0]

    one = Dist()
    s_all, gap_all = scored(whole)
    want = sampler_metrics(cfg, s_all, gap_all, 3, one)
    global_rows = torch.cat([r * share + o for r, o in enumerate(orders[: dist.world])])
    tally_all = Tally()
    keep_all = _batch_mask(cfg, s_all, global_rows, tally_all, one, first=True)

    stacked = dist.stack(torch.tensor([float(dist.rank), -torch.inf], dtype=F64))
    cat, start = dist.cat(torch.arange(dist.rank + 1, dtype=F64) + 10 * dist.rank)
    nothing, nothing_at = dist.cat(torch.zeros(0, dtype=F64))
    result = {
        "pooled": pooled,
        "want": want,
        "m2po_masked_frac": masked,
        "want_m2po_masked_frac": tally_all.result(lambda t: t)["m2po/masked_frac"][0],
        "mask_is_the_whole_batchs": bool(torch.equal(keep, keep_all[rows][:, :width])),
        "dropped_some": bool((whole["mask"] & ~keep_all).any() and keep_all.any()),
        "alone_differs": not torch.equal(
            offpolicy.m2po_mask(mine["old"] - mine["behav"], mine["mask"], threshold=0.05),
            keep_all[rows][:, :width],
        ),
        "stack": stacked.tolist(),
        "cat": [cat.tolist(), start],
        "cat_of_nothing": [nothing.tolist(), nothing_at],
    }
    (Path(out_dir) / f"rank{dist.rank}.json").write_text(json.dumps(result))
    shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:])
