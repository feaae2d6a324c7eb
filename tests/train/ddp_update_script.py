"""Run by torchrun in test_resume_ddp.py: one `update` of a fixed batch, data-parallel.

    torchrun --nproc_per_node N ddp_update_script.py MODEL OUT.safetensors [VARIANT[,VARIANT...]]

Every rank builds the same rollout (same seed), keeps its share of the prompts (whole groups),
scores it and takes one update; rank 0 saves the policy's parameters and the step's metrics
(OUT.json); with several variants, one after the other in the same processes, each writes
OUT-VARIANT.safetensors and .json. With N = 1 it is the single-process reference. VARIANT ``on-policy`` (default): one
epoch, the KL (k3) in the loss; ``off-policy``: two epochs, the KL in the reward and the loss, an
entropy bonus; ``ppo`` and ``reinforce++``: those algorithms, the KL in the reward, two epochs
(their advantages are whitened over the whole batch, every rank's share); ``stale-m2po``: the
batch sampled by the policy one version back (``rollout.staleness=1``, the ring's behaviour pass
on the whole batch, each rank keeping its rows), M2PO's loss (its mask over the whole optimizer
step's tokens) and the ``sampler/*`` metrics, which every rank also writes (OUT.rankR.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from klpo.train.config import build_config
from klpo.train.data.load import load_examples
from klpo.train.models.build import build_models
from klpo.train.rewards.functions import resolve_rewards
from klpo.train.rollout.samplers import Decoding, generate
from klpo.train.rollout.versions import SamplerGap, VersionRing, behaviour_pass, sampled_features
from klpo.train.runtime.dist import init_distributed, shutdown
from klpo.train.step.kl_term import kl_term
from klpo.train.step.score import score
from klpo.train.step.step_metrics import sampler_metrics, step_metrics
from klpo.train.step.types import Optimizers
from klpo.train.step.update import update

VARIANTS = {
    "on-policy": [],
    "off-policy": ["algo.epochs=2", "kl.placement=reward+loss", "algo.entropy_coef=0.01"],
    "ppo": ["algo.name=ppo", "algo.epochs=2", "kl.placement=reward"],
    "reinforce++": ["algo.name=reinforce++", "algo.epochs=2", "kl.placement=reward"],
    "stale-m2po": [
        "rollout.staleness=1",
        "algo.policy_loss=m2po",
        "algo.m2po_threshold=0.002",
        "rollout.tis_cap=null",
    ],
}


def main(model: str, out: str, variants: str = "on-policy") -> None:
    dist = init_distributed(threads=1)
    names = variants.split(",")
    for variant in names:
        path = Path(out)
        if len(names) > 1:
            path = path.with_name(f"{path.stem}-{variant}{path.suffix}")
        one_update(dist, model, str(path), variant)
    shutdown(dist)


def one_update(dist, model: str, out: str, variant: str) -> None:
    cfg = build_config(
        overrides=[
            f"model.policy={model}",
            "kl.beta=0.5",
            "kl.estimator=k3",
            "algo.micro_batch=3",
            "rewards=[{name: 'klpo_test_rewards:digits'}]",
            *VARIANTS[variant],
        ]
    )
    m = build_models(cfg, dist, None)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    train, _ = load_examples(cfg)
    prompts = train[:4]
    texts, answers = [e.prompt for e in prompts], [e.answer for e in prompts]
    gap = None
    if cfg.rollout.staleness:  # sampled by version 0; the policy moved on to version 1
        ring = VersionRing(1)
        ring.keep(0, m.policy)
        torch.manual_seed(2)
        with torch.no_grad():
            for p in m.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        ring.keep(1, m.policy)
        with ring.at(m.policy, 0):
            torch.manual_seed(1)
            full = generate(
                m.policy, m.tokenizer, texts, answers, Decoding(group_size=4, max_new_tokens=4)
            )
            behaviour = sampled_features(cfg, m, full, 0)
        full, gap = behaviour_pass(cfg, m, full, behaviour)
    else:
        torch.manual_seed(1)
        full = generate(
            m.policy, m.tokenizer, texts, answers, Decoding(group_size=4, max_new_tokens=4)
        )
    share = len(full.prompts) // dist.world
    rows = list(range(dist.rank * share, (dist.rank + 1) * share))
    mine = full.select(rows)
    reward_fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
    scored = score(cfg, m, mine, reward_fns, 0.5, dist)
    critic = m.critic_core
    opt = Optimizers(
        torch.optim.SGD(m.policy.parameters(), lr=0.1),
        torch.optim.SGD(critic.parameters(), lr=0.1) if critic is not None else None,
    )
    upd = update(
        cfg,
        m,
        scored,
        opt,
        kl_term(cfg, beta=0.5, beta_old=1.0),
        dist,
        torch.Generator().manual_seed(0),
    )
    metrics = step_metrics(cfg, scored, upd, dist)
    if gap is not None:
        mine_gap = SamplerGap(gap.kl[rows], gap.tv[rows])
        metrics |= sampler_metrics(cfg, scored, mine_gap, 2, dist)
        Path(out).with_suffix(f".rank{dist.rank}.json").write_text(json.dumps(metrics))
    if dist.is_main:
        params = {k: v.detach().clone() for k, v in m.policy.state_dict().items()}
        if critic is not None:
            params |= {f"critic.{k}": v.detach().clone() for k, v in critic.state_dict().items()}
        save_file(params, out)
        Path(out).with_suffix(".json").write_text(json.dumps(metrics))
    del m, opt, scored  # DDP's reducer must go before the process group it uses


if __name__ == "__main__":
    main(*sys.argv[1:])
