"""Run by torchrun in test_fsdp.py: three updates of fixed rollouts with FSDP, and a resume.

    torchrun --nproc_per_node N fsdp_update_script.py MODEL OUT_DIR

Every rank draws the same three rollouts (same seeds, from a plain copy of the starting model),
keeps its share of each (whole groups) and takes one AdamW update per rollout with the policy
and the reference sharded (dist.strategy=fsdp). After the second update it writes a sharded
checkpoint (torch.distributed.checkpoint); after the third, rank 0 saves the gathered parameters
to OUT_DIR/final.safetensors. Then fresh models load the checkpoint, repeat the third update, and
rank 0 saves OUT_DIR/resumed.safetensors. Run as a plain process (N = 1, no torchrun) it is the
single-process reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from klpo.train.config import build_config
from klpo.train.data.load import load_examples
from klpo.train.models import fsdp
from klpo.train.models.backbone import is_sharded
from klpo.train.models.build import build_models
from klpo.train.models.load import load_causal_lm, load_tokenizer
from klpo.train.rewards.functions import resolve_rewards
from klpo.train.rollout.samplers import Decoding, generate
from klpo.train.runtime.dist import Dist, init_distributed, shutdown
from klpo.train.step.kl_term import kl_term
from klpo.train.step.score import score
from klpo.train.step.types import Optimizers
from klpo.train.step.update import update

STEPS = 3


def config(model: str):
    return build_config(
        overrides=[
            f"model.policy={model}",
            "kl.beta=0.5",
            "kl.estimator=full",
            "algo.micro_batch=2",
            "optim.lr=0.01",
            "dist.strategy=fsdp",
            "rewards=[{name: 'klpo_test_rewards:digits'}]",
        ]
    )


def rollouts(cfg, model: str) -> list:
    plain, tok = load_causal_lm(model), load_tokenizer(model)
    train, _ = load_examples(cfg)
    out = []
    for step in range(STEPS):
        prompts = train[4 * step : 4 * step + 4]
        torch.manual_seed(1 + step)
        texts, answers = [e.prompt for e in prompts], [e.answer for e in prompts]
        out.append(generate(plain, tok, texts, answers, Decoding(group_size=4, max_new_tokens=4)))
    return out


def full_params(m) -> dict[str, torch.Tensor]:
    """The policy's parameters, gathered whole (collective under FSDP)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in m.policy.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().clone().contiguous()
    return out


def build(cfg, dist: Dist):
    m = build_models(cfg, dist, None)
    o = cfg.optim
    # AdamW moves an entry by lr * m / (sqrt(v) + eps): where the exact gradient is ~0, float32
    # rounding (|delta| ~ 1e-10 here, different for one process and two, which sum in another
    # order) moves it by up to lr * delta / eps, 1e-4 with torch's eps of 1e-8 and 1e-9 with
    # 1e-3, well inside the comparison's 1e-6: the test compares the updates, not that noise.
    opt = Optimizers(torch.optim.AdamW(m.policy.parameters(), lr=o.lr, eps=1e-3), None)
    return m, opt


def step(cfg, m, opt, rollout, dist: Dist, gen: torch.Generator) -> None:
    share = len(rollout.prompts) // dist.world
    mine = rollout.select(list(range(dist.rank * share, (dist.rank + 1) * share)))
    reward_fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
    scored = score(cfg, m, mine, reward_fns, 0.5)
    update(cfg, m, scored, opt, kl_term(cfg, beta=0.5, beta_old=1.0), dist, gen)


def main(model: str, out_dir: str) -> None:
    dist = init_distributed(threads=1)
    _run(model, Path(out_dir), dist)  # its models out of scope: they hold the process group
    shutdown(dist)
    if dist.enabled:
        from conftest import exit_if_threads_left

        exit_if_threads_left(dist.rank)  # gloo's threads ended in shutdown, not at exit


def _run(model: str, out: Path, dist: Dist) -> None:
    cfg = config(model)
    batches = rollouts(cfg, model)
    m, opt = build(cfg, dist)
    assert is_sharded(m.backbone) == dist.enabled
    gen = torch.Generator().manual_seed(0)
    for i, rollout in enumerate(batches):
        if i == STEPS - 1:
            gen_state = gen.get_state()
            if dist.enabled:
                fsdp.save_sharded(m.backbone, opt.policy, out / "shards")
        step(cfg, m, opt, rollout, dist, gen)
    final = full_params(m)
    if dist.is_main:
        save_file(final, str(out / "final.safetensors"))
    if dist.enabled:
        m2, opt2 = build(cfg, dist)
        fsdp.load_sharded(m2.backbone, opt2.policy, out / "shards")
        step(cfg, m2, opt2, batches[-1], dist, torch.Generator().set_state(gen_state))
        resumed = full_params(m2)
        if dist.is_main:
            save_file(resumed, str(out / "resumed.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
