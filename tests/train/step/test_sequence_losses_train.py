"""GSPO, CISPO and DPPO in the trainer: off-policy runs finish, log their metrics, and the update
is the library's loss (the trainer's gradient against a naive assembly from full logits)."""

from __future__ import annotations

import math

import pytest
import torch

from klpo import losses, offpolicy, reduce
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.data.load import load_examples
from klpo.train.models.build import build_models
from klpo.train.rewards.functions import resolve_rewards
from klpo.train.rollout.samplers import Decoding, generate, position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally, read_metrics
from klpo.train.step.kl_term import kl_term
from klpo.train.step.score import score
from klpo.train.step.update import MicroBatch, micro_step


@pytest.mark.parametrize(
    "extra",
    [
        {"algo.policy_loss": "gspo", "algo.loss_reduction": "seq-mean-token-mean"},
        {"algo.policy_loss": "cispo", "kl.estimator": "k3"},
        {"algo.policy_loss": "dppo-tv-k2", "kl.estimator": "k3"},
    ],
)
def test_sequence_losses_train_off_policy(tiny_model, quick, tmp_path, extra):
    cfg = build_config(
        overrides=quick(
            tiny_model,
            tmp_path / "run",
            **{"run.steps": 2, "run.eval_every": 0, "algo.epochs": 2, "algo.minibatches": 2},
            **extra,
        )
    )
    loop.train(cfg, log=lambda *_: None)
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert all(math.isfinite(v) for v in last.values() if isinstance(v, float)), last
    if extra["algo.policy_loss"] == "gspo":
        assert 0.0 <= last["clip_frac/seq"] <= 1.0 and last["ratio/seq_mean"] > 0


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "dppo-tv", "dppo-kl", "dppo-tv-k2"])
def test_the_update_is_the_library_loss(tiny_model, quick, tmp_path, policy_loss):
    """Off-policy (logp_old from before a perturbation): the trainer's gradient for GSPO/CISPO +
    beta·k3 equals the naive assembly, whose KL weight is the per-token ratio."""
    extra = {
        "kl.beta": 0.5, "kl.estimator": "k3", "algo.policy_loss": policy_loss,
        "algo.gspo_clip_low": 0.05, "algo.gspo_clip_high": 0.05, "algo.epochs": 2,
    }  # fmt: skip
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **extra))
    dist = Dist()
    m = build_models(cfg, dist, None)
    train, _ = load_examples(cfg)
    rollout = generate(m.policy, m.tokenizer, [e.prompt for e in train[:4]], [e.answer for e in train[:4]], Decoding(group_size=4, max_new_tokens=4))  # fmt: skip
    fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
    s = score(cfg, m, rollout, fns, 0.5)
    assert bool(s.old.filled.all())  # two epochs: the score's own pass gives log pi_old
    torch.manual_seed(1)
    with torch.no_grad():  # the policy moves after sampling: ratios != 1
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = torch.arange(len(rollout.prompts))
    n = reduce.normaliser(rollout.mask, "token-mean")
    m.policy.zero_grad()
    micro_step(
        cfg,
        m,
        MicroBatch.of(cfg, s, rows, n),
        kl_term(cfg, beta=0.5, beta_old=1.0),
        dist,
        sync=True,
        tally=Tally(),
    )
    got = {k: p.grad.clone() for k, p in m.policy.named_parameters()}

    m.policy.zero_grad()
    att, mask = rollout.attention_mask, rollout.mask
    logits = m.policy(
        input_ids=rollout.input_ids, attention_mask=att, position_ids=position_ids(att)
    ).logits
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    logq = torch.log_softmax(logits[:, p - 1 : p - 1 + c].double(), -1)
    logp = logq.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    if policy_loss == "gspo":
        pg = losses.gspo(logp, s.old.logp, s.adv, mask, clip_low=0.05, clip_high=0.05)
    elif policy_loss == "cispo":
        pg = losses.cispo(logp, s.old.logp, s.adv, clip_high=0.2)
    else:  # DPPO: the binary-divergence mask at the defaults (0.2, 0.2), the weight capped at 20
        div = "kl" if policy_loss == "dppo-kl" else "tv"
        pg = offpolicy.dppo(logp, s.old.logp, s.adv, divergence=div, delta_low=0.2, delta_high=0.2)
        if policy_loss == "dppo-tv-k2":  # prime-rl's: plus 1e-3 (log pi - log pi_old)²
            pg = pg + 1e-3 * (logp - s.old.logp) ** 2
    w = torch.exp(logp - s.old.logp).detach()  # the KL's per-token weight
    d = logp - s.logp_ref
    kl_tok = w * (torch.exp(-d) + d - 1)
    loss = reduce.reduce(pg, mask, "token-mean") + 0.5 * reduce.reduce(kl_tok, mask, "token-mean")
    loss.backward()
    for k, param in m.policy.named_parameters():
        torch.testing.assert_close(got[k], param.grad, rtol=1e-4, atol=1e-6, msg=k)
    assert any(g.abs().max() > 0 for g in got.values())
