"""The trainer with a stale sampler (``rollout.staleness``) against the lab's exact gradients.

On the tiny model with one prompt and completions of one token, every outcome y of the vocabulary
can be enumerated: the trainer's step (the ring's behaviour pass, scoring, the update) is run on
a batch of y alone for each y, and its gradient averaged with the behaviour policy's probability
of y is the trainer's exact expected gradient with samples y ~ pi_behav. It must equal
:func:`klpo.lab.staleness.expected` on the categorical of the model's own logits at the prompt
(pi_theta, pi_ref, pi_behav), carried to the parameters by the chain rule, per estimator ×
placement × correction.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from klpo.lab import staleness as st
from klpo.lab.distributions import SequencePair
from klpo.train.config import build_config
from klpo.train.models.build import build_models
from klpo.train.rewards.functions import resolve_rewards
from klpo.train.rollout.samplers import Rollout, position_ids
from klpo.train.rollout.versions import VersionRing, behaviour_pass, sampled_features
from klpo.train.runtime.dist import Dist
from klpo.train.step.kl_term import kl_term
from klpo.train.step.score import score
from klpo.train.step.types import Optimizers
from klpo.train.step.update import update

PROMPT = "3+4="
TEMPERATURE = 0.8
CAP = 1.3


def _config(model, **extra):
    base = {
        "model.policy": str(model),
        "rollout.group_size": 2,
        "rollout.prompts_per_step": 1,
        "rollout.max_new_tokens": 1,
        "rollout.temperature": TEMPERATURE,
        "rollout.staleness": 1,
        "algo.skip_no_signal": "false",
        "optim.grad_clip": "null",
        "kl.beta": 1.0,
        "rewards": "[{name: 'exact_match'}]",
    }
    base.update(extra)
    return build_config(overrides=[f"{k}={v}" for k, v in base.items()])


@pytest.fixture(scope="module")
def stale(tiny_model):
    """The models (reference = the tiny model), the ring holding pi_behav (version 0, the
    reference moved by seeded noise) and pi_theta (version 1, moved again, in the policy)."""
    cfg = _config(tiny_model)
    m = build_models(cfg, Dist(), None)
    ring = VersionRing(1)
    gen = torch.Generator().manual_seed(0)
    params = [p for p in m.policy.parameters() if p.requires_grad]
    with torch.no_grad():
        for version in (0, 1):
            for p in params:
                p.add_(0.4 * torch.randn(p.shape, generator=gen))
            ring.keep(version, m.policy)
    return tiny_model, m, ring, params


def _logits(model, ids, att) -> torch.Tensor:
    """``[V]`` the model's logits / temperature after the prompt (with the autograd graph)."""
    out = model(input_ids=ids, attention_mask=att, position_ids=position_ids(att))
    return out.logits[0, -1] / TEMPERATURE


def _lab_gradient(m, ring, params, name, placement, correction):
    """The lab's exact expected gradient of the term, carried to the policy's parameters, and
    pi_behav over the vocabulary; with the largest weight pi_theta / pi_behav."""
    enc = m.codec.encode([PROMPT])
    ids, att = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad(), ring.at(m.policy, 0):  # (before theta's graph: it swaps in place)
        behav = _logits(m.policy, ids, att).double()
    theta = _logits(m.policy, ids, att)
    with torch.no_grad():
        ref = _logits(m.reference.model, ids, att).double()
    pair = SequencePair.categorical(theta.detach().double(), ref)
    case = st.StaleCase(pair, behav[None], k=1)
    _, g = st.expected(case, name, placement, correction, cap=CAP)
    grads = torch.autograd.grad(theta.double(), params, grad_outputs=g[0], allow_unused=True)
    flat = torch.cat(
        [
            (torch.zeros_like(p) if x is None else x).flatten()
            for p, x in zip(params, grads, strict=True)
        ]
    )
    return flat, behav.log_softmax(-1).exp(), case.max_weight


# (estimator, placement, correction, the trainer's settings for it)
CASES = [
    ("k1", "reward", "none", {"rollout.tis_cap": "null"}),  # no weight on the policy gradient
    ("k1", "reward", "is", {"rollout.tis_cap": 1e9}),
    ("k1", "reward", "is-cap", {"rollout.tis_cap": CAP}),
    *[
        (name, "loss", c, {"kl.behaviour_correction": c, "kl.behaviour_cap": CAP})
        for name, corrections in (
            ("k3", ("none", "is", "is-cap")),
            ("k3_is", ("none", "is", "is-cap")),  # its own weight, pi_behav as its logp_old
            ("k2", ("is", "is-cap")),  # weighted as k3 is
            ("full", ("is",)),  # no weight (as under the others)
        )
        for c in corrections
    ],
]
"""Every estimator's path through the trainer under each correction it treats differently (the
trainer's per-y updates are this test's cost: one per case and outcome)."""


@pytest.fixture(scope="module")
def trainer_gradients(stale):
    """Each case's sum_y pi_behav(y) · the trainer's gradient on a batch of y alone (its two
    rows, one group, the same completion), over the whole vocabulary. One behaviour pass and one
    scoring per placement for each y; every case's update on it (with a learning rate of 0)."""
    model, m, ring, params = stale
    cfgs = [
        _config(model, **{"kl.estimator": n, "kl.placement": p, **extra})
        for n, p, _, extra in CASES
    ]
    _, pi_behav, _ = _lab_gradient(m, ring, params, "k3", "loss", "none")
    enc = m.codec.encode([PROMPT])
    reward_fns = resolve_rewards({"exact_match": 1.0})
    opt = Optimizers(torch.optim.SGD(params, lr=0.0), None)
    totals = [torch.zeros(sum(p.numel() for p in params), dtype=torch.float64) for _ in CASES]
    for y in range(len(pi_behav)):
        rollout = Rollout(
            prompt_ids=enc["input_ids"].repeat(2, 1),
            prompt_mask=enc["attention_mask"].bool().repeat(2, 1),
            completion_ids=torch.full((2, 1), y),
            mask=torch.ones(2, 1, dtype=torch.bool),
            prompts=[PROMPT] * 2,
            completions=[m.tokenizer.decode([y])] * 2,
            answers=["7"] * 2,
            group_size=2,
            truncated=torch.zeros(2, dtype=torch.bool),
        )
        with ring.at(m.policy, 0):
            behaviour = sampled_features(cfgs[0], m, rollout, 0)
        rollout, _ = behaviour_pass(cfgs[0], m, rollout, behaviour)
        scored = {}
        for (_, placement, _, _), cfg, total in zip(CASES, cfgs, totals, strict=True):
            if placement not in scored:  # (the update fills pi_old once, at lr 0 the same)
                scored[placement] = score(cfg, m, rollout, reward_fns, cfg.kl.beta)
            term = kl_term(cfg, beta=cfg.kl.beta, beta_old=1.0)
            gen = torch.Generator().manual_seed(0)
            update(cfg, m, scored[placement], opt, term, Dist(), gen)
            total += float(pi_behav[y]) * torch.cat([p.grad.flatten() for p in params]).double()
    return totals


@pytest.mark.parametrize(
    ("i", "case"), list(enumerate(CASES)), ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES]
)
def test_the_trainers_stale_kl_gradient_is_the_labs(stale, trainer_gradients, i, case):
    _, m, ring, params = stale
    name, placement, correction, _ = case
    want, _, max_weight = _lab_gradient(m, ring, params, name, placement, correction)
    assert max_weight > CAP  # the cap binds on some token, so is-cap differs from is
    got = trainer_gradients[i]
    scale = float(want.norm())
    assert scale > 1e-3
    assert float((got - want).norm()) <= 2e-5 * scale, (name, placement, correction)  # 1.2e-6 seen


def test_the_corrections_differ_where_the_sampler_lags(stale):
    """The test above can fail: the lab's three corrections of k3 give gradients apart by far
    more than its tolerance at this lag."""
    _, m, ring, params = stale
    g = {c: _lab_gradient(m, ring, params, "k3", "loss", c)[0] for c in ("none", "is", "is-cap")}
    for a, b in (("none", "is"), ("is", "is-cap"), ("none", "is-cap")):
        assert float((g[a] - g[b]).norm()) > 1e-2 * float(g["is"].norm()), (a, b)
    assert math.isfinite(float(g["is"].norm()))


# --------------------------------------------------------------------------------------------
# The ring of versions, and a stale run end to end.


def test_the_ring_swaps_a_version_in_and_the_current_weights_back_bit_for_bit(tiny_model):
    m = build_models(_config(tiny_model), Dist(), None)
    ring = VersionRing(2)
    params = dict(m.policy.named_parameters())
    snapshots = []
    with torch.no_grad():
        for v in range(4):
            snapshots.append({n: p.detach().clone() for n, p in params.items()})
            ring.keep(v, m.policy)
            for p in params.values():
                p.add_(0.1)
    assert sorted(ring.versions) == [1, 2, 3]  # staleness + 1 versions, the oldest dropped
    assert [ring.behaviour_version(t) for t in (1, 2, 3, 4, 5)] == [1, 1, 1, 1, 2]
    now = {n: p.detach().clone() for n, p in params.items()}
    with ring.at(m.policy, 1):
        assert all(torch.equal(params[n], snapshots[1][n]) for n in params)
    assert all(torch.equal(params[n], now[n]) for n in params)
    missing = r"version 0 is not in the ring \(it holds \[1, 2, 3\]\)"
    with pytest.raises(KeyError, match=missing), ring.at(m.policy, 0):
        pass
    other = VersionRing(2)
    other.load_state_dict(ring.state_dict())
    assert other.versions.keys() == ring.versions.keys()
    with pytest.raises(ValueError, match=r"rollout\.staleness must be an integer >= 1"):
        VersionRing(0)


def _rows(run_dir):
    from klpo.train.runtime.metrics import is_timing, read_metrics

    return [
        {k: v for k, v in r.items() if not is_timing(k)}
        for r in read_metrics(run_dir / "metrics.jsonl")
    ]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_resumed_stale_run_continues_as_the_uninterrupted_one(tiny_model, quick, tmp_path, lora):
    from klpo.train import loop
    from klpo.train.runtime.checkpoint import version_tensors

    extra = {"rollout.staleness": 2, "run.save_every": 2, "run.eval_every": 0, "kl.estimator": "k3"}
    if lora:
        extra["model.lora"] = "{r: 4, alpha: 8}"
    whole, part = tmp_path / "whole", tmp_path / "part"
    loop.train(build_config(overrides=quick(tiny_model, whole, **extra, **{"run.steps": 4})))
    loop.train(build_config(overrides=quick(tiny_model, part, **extra, **{"run.steps": 2})))
    ring = version_tensors(part / "checkpoints" / "step_000002")
    assert sorted({k.split("/")[0] for k in ring}) == ["0", "1", "2"]
    saved = part / "checkpoints" / "step_000002" / "policy"
    weights = load_file(saved / ("adapter_model.safetensors" if lora else "model.safetensors"))
    trainable = sum(t.numel() for t in weights.values())
    assert sum(t.numel() for t in ring.values()) == 3 * trainable  # (LoRA: the adapters only)
    over = quick(tiny_model, part, **extra, **{"run.steps": 4})
    loop.train(build_config(overrides=over), resume=True, log=lambda *_: None)
    rows = _rows(whole)
    assert _rows(part) == rows
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert rows[0]["sampler/kl_exact"] == 0.0 and rows[-1]["sampler/kl_exact"] > 0
    assert all(0 < r["sampler/ess"] <= 1 for r in rows)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_reference_reset_under_a_stale_sampler_and_its_resume(tiny_model, quick, tmp_path, lora):
    """k = 1, the reference reset after step 2: at step 3 the weights that start the step are the
    reference (exact KL 0 up to float32 rounding). A full fine-tune's ring is untouched (step 3
    samples version 1, a lag of 1); a LoRA policy's merge makes every kept adapter stale, so its
    ring restarts (step 3 samples version 2, the current weights: lag 0, no sampler gap). A run
    stopped at step 2, just after the reset, resumes bit for bit."""
    from klpo.train import loop

    extra = {
        "rollout.staleness": 1, "kl.reference_reset": "{every: 2}", "run.save_every": 2,
        "run.eval_every": 0, "kl.estimator": "k3",
    }  # fmt: skip
    if lora:
        extra["model.lora"] = "{r: 4, alpha: 8}"
    whole, part = tmp_path / "whole", tmp_path / "part"
    loop.train(build_config(overrides=quick(tiny_model, whole, **extra, **{"run.steps": 4})))
    rows = _rows(whole)
    assert [r["reference/updates"] for r in rows] == [0, 1, 1, 2]
    assert rows[1]["kl/ref/exact"] > 1e-5 and abs(rows[2]["kl/ref/exact"]) < 1e-6
    lags = [r["rollout/staleness"] for r in rows]
    assert lags == ([0.0, 1.0, 0.0, 1.0] if lora else [0.0, 1.0, 1.0, 1.0])
    if lora:
        assert rows[2]["sampler/kl_exact"] == 0.0
    else:
        assert rows[2]["sampler/kl_exact"] > 0
    loop.train(build_config(overrides=quick(tiny_model, part, **extra, **{"run.steps": 2})))
    over = quick(tiny_model, part, **extra, **{"run.steps": 4})
    loop.train(build_config(overrides=over), resume=True, log=lambda *_: None)
    assert _rows(part) == rows


def test_dynamic_sampling_under_a_stale_sampler_keeps_groups_with_signal_and_resumes(
    tiny_model, quick, tmp_path
):
    """k = 1 with DAPO's dynamic sampling: every round of a step is sampled by the behaviour
    version (its lag logged as without it), only groups with signal are trained on (half_signal:
    a kept group's rewards are 0, 1, 0, 1, so the mean is exactly 1/2), the sampler gap is
    measured on the kept groups, and a run stopped at step 2 resumes bit for bit (the prompt
    stream and the ring in the checkpoint)."""
    from klpo.train import loop

    extra = {
        "rollout.staleness": 1, "rollout.dynamic_sampling": "true",
        "rollout.dynamic_sampling_max_rounds": 8, "run.save_every": 1, "run.eval_every": 0,
        "rewards": "[{name: 'klpo_test_rewards:half_signal'}]", "kl.estimator": "k3",
    }  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    loop.train(build_config(overrides=quick(tiny_model, whole, **extra, **{"run.steps": 4})))
    rows = _rows(whole)
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    prompts = build_config(overrides=quick(tiny_model, whole, **extra)).rollout.prompts_per_step
    for r in rows:
        assert r["reward/mean"] == 0.5 and r["rollout/groups_kept"] == prompts
        assert r["rollout/extra_completions"] >= 0 and 0 < r["sampler/ess"] <= 1
    assert sum(r["rollout/groups_dropped"] for r in rows) > 0
    assert rows[0]["sampler/kl_exact"] == 0.0 and rows[-1]["sampler/kl_exact"] > 0
    loop.train(build_config(overrides=quick(tiny_model, part, **extra, **{"run.steps": 2})))
    over = quick(tiny_model, part, **extra, **{"run.steps": 4})
    loop.train(build_config(overrides=over), resume=True, log=lambda *_: None)
    assert _rows(part) == rows


def test_a_lora_reference_reset_is_refused_with_the_rollout_worker():
    base = ["rollout.staleness=1", "rollout.asynchronous=true", "kl.reference_reset={every: 2}"]
    assert build_config(overrides=base).kl.reference_reset is not None  # a full fine-tune's
    with pytest.raises(
        ValueError, match=r"rollout\.asynchronous with kl\.reference_reset on a LoRA"
    ):
        build_config(overrides=[*base, "model.lora={r: 4, alpha: 8}"])


# --------------------------------------------------------------------------------------------
# The asynchronous sampler: a worker process with the same versions and seeds.


def test_an_asynchronous_resume_samples_what_the_deterministic_run_samples(
    tiny_model, quick, tmp_path
):
    """The worker (rollout.asynchronous) receives the ring's versions and the requests in order,
    and seeds each step by (run.seed, step) as the deterministic mode does: a deterministic run
    resumed at step 2 with the worker logs, bit for bit, what the deterministic run logs (the
    ring restored, the requests of steps 3 and 4 sent again from the restored prompt stream)."""
    import multiprocessing

    from klpo.train import loop

    extra = {"rollout.staleness": 2, "run.save_every": 2, "run.eval_every": 0, "kl.estimator": "k3"}
    whole, part = tmp_path / "whole", tmp_path / "part"
    loop.train(build_config(overrides=quick(tiny_model, whole, **extra, **{"run.steps": 4})))
    loop.train(build_config(overrides=quick(tiny_model, part, **extra, **{"run.steps": 2})))
    over = quick(tiny_model, part, **extra, **{"run.steps": 4, "rollout.asynchronous": "true"})
    loop.train(
        build_config(overrides=over), resume=True, allow_config_change=True, log=lambda *_: None
    )
    rows = _rows(whole)
    assert _rows(part) == rows
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert not multiprocessing.active_children()  # the worker stopped with the run


def test_a_node_worker_serves_the_ranks_torchrun_numbers_on_its_node(monkeypatch):
    """rollout.async_workers=node: the ranks of a node are LOCAL_WORLD_SIZE consecutive ones
    (torchrun's numbering); each takes its own share of the step's prompts."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert [Dist(rank=r, world=4).node_ranks() for r in range(4)] == [
        [0, 1],
        [0, 1],
        [2, 3],
        [2, 3],
    ]
    items = list(range(8))
    assert [Dist(rank=3, world=4).share(items, r) for r in (2, 3)] == [[4, 5], [6, 7]]
    assert Dist(rank=3, world=4).share(items) == [6, 7]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the world of 4"):
        Dist(rank=0, world=4).node_ranks()
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert Dist().node_ranks() == [0]  # a plain klpo train: a node of one
    with pytest.raises(ValueError, match=r"rollout\.async_workers=node places the rollout"):
        build_config(overrides=["rollout.staleness=1", "rollout.async_workers=node"])


def test_the_trainer_refuses_a_batch_older_than_the_staleness():
    import queue

    from klpo.train.rollout.worker import AsyncSampler, StaleBatch

    class Alive:
        exitcode = None

        def is_alive(self):
            return True

    sampler = AsyncSampler.__new__(AsyncSampler)
    sampler.k, sampler.process, sampler.outbox = 2, Alive(), queue.Queue()
    sampler.leader, sampler.ranks = True, [0]
    part = [(0, None, None, None)]  # one rank's (rank, rollout, hidden, head weights)
    sampler.outbox.put(("batch", (6, 2, part)))  # step 6 by version 2: 3 behind
    with pytest.raises(
        StaleBatch, match=r"version 2, 3 versions behind, more than rollout\.staleness=2"
    ):
        sampler.take(6)
    sampler.outbox.put(("error", "Traceback: boom"))
    with pytest.raises(RuntimeError, match="the rollout worker failed:\nTraceback: boom"):
        sampler.take(7)
    sampler.outbox.put(("batch", (8, 5, part)))
    with pytest.raises(RuntimeError, match="sent the batch of step 8 for step 9"):
        sampler.take(9)
    sampler.outbox.put(("batch", (4, 4, part)))  # step 4 by 4: from its future
    with pytest.raises(RuntimeError, match=r"version 4, newer than the weights that start"):
        sampler.take(4)


# --------------------------------------------------------------------------------------------
# M2PO in the trainer: its mask over the optimizer step's tokens.


def _naive_m2po_keep(log_r: list[float], tau: float) -> list[bool]:
    """Drop the largest (log r)² one at a time until the rest's mean is below tau (a loop)."""
    order = sorted(range(len(log_r)), key=lambda i: -(log_r[i] ** 2))
    for k in range(len(order)):
        rest = [log_r[i] ** 2 for i in order[k:]]
        if sum(rest) / len(rest) < tau:
            break
    else:
        k = len(order)
    dropped = set(order[:k])
    return [i not in dropped for i in range(len(log_r))]


def test_m2po_masks_over_the_optimizer_steps_tokens_at_any_micro_batch(stale, quick):
    from klpo.train.rollout.samplers import Decoding, generate

    model, m, ring, params = stale
    over = {
        "algo.policy_loss": "m2po", "algo.m2po_threshold": 0.02, "kl.placement": "none",
        "rollout.tis_cap": "null", "rollout.group_size": 4, "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 4, "rewards": "[{name: 'klpo_test_rewards:digits'}]",
    }  # fmt: skip
    prompts = ["12+7=", "3+4=", "5+5=", "9+1="]
    with ring.at(m.policy, 0):
        torch.manual_seed(1)
        decoding = Decoding(group_size=4, max_new_tokens=4, temperature=TEMPERATURE)
        rollout = generate(m.policy, m.tokenizer, prompts, [""] * 4, decoding, codec=m.codec)
        behaviour = sampled_features(_config(model, **over), m, rollout, 0)
    rollout, _ = behaviour_pass(_config(model, **over), m, rollout, behaviour)
    reward_fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
    grads, fracs = [], []
    for micro in (0, 3):
        cfg = _config(model, **over, **{"algo.micro_batch": micro})
        scored = score(cfg, m, rollout, reward_fns, 0.0)
        opt = Optimizers(torch.optim.SGD(params, lr=0.0), None)
        tally = update(
            cfg, m, scored, opt, kl_term(cfg, beta=0.0, beta_old=1.0), Dist(),
            torch.Generator().manual_seed(0),
        )  # fmt: skip
        grads.append(torch.cat([p.grad.flatten() for p in params]))
        fracs.append(tally.result(lambda x: x)["m2po/masked_frac"][0])
    assert fracs[0] == fracs[1] and torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # The oracle: the mask by a loop over every valid token of the batch, and the gradient of
    # -(1/N) sum_kept A_t log pi_theta(y_t) (the ratio is 1 at the first update) by autograd.
    mask = rollout.mask
    log_r = (scored.old.logp - rollout.behav_logp)[mask].double().tolist()
    keep = torch.zeros_like(mask)
    keep[mask] = torch.tensor(_naive_m2po_keep(log_r, 0.02))
    assert 0 < float((~keep[mask]).double().mean()) < 1  # the mask drops some, not all
    assert fracs[0] == pytest.approx(float((~keep[mask]).double().mean()), abs=1e-12)
    ids, att = rollout.input_ids, rollout.attention_mask.long()
    logits = m.policy(input_ids=ids, attention_mask=att, position_ids=position_ids(att)).logits
    c = rollout.completion_ids.shape[1]
    logp = (logits[:, -c - 1 : -1] / TEMPERATURE).log_softmax(-1)
    logp = logp.gather(-1, rollout.completion_ids[..., None])[..., 0]
    loss = -(torch.where(keep, scored.adv * logp, 0.0)).sum() / mask.sum()
    want = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    assert float((grads[0] - want).norm()) <= 1e-4 * float(want.norm())


# --------------------------------------------------------------------------------------------
# Trust Region Masking in the trainer: whole completions dropped from the policy loss.


def _naive_trm_keep(old, behav, mask, delta: float) -> list[bool]:
    """Per row, a loop: the largest k3 = rho - 1 - log rho, rho = pi_old / pi_behav, over its
    valid tokens, <= delta (a row without a token kept)."""
    keep = []
    for i in range(mask.shape[0]):
        stats = [
            math.exp(float(old[i, t]) - float(behav[i, t]))
            - 1.0
            - (float(old[i, t]) - float(behav[i, t]))
            for t in range(mask.shape[1])
            if bool(mask[i, t])
        ]
        keep.append(not stats or max(stats) <= delta)
    return keep


@pytest.fixture(scope="module")
def trm_batch(stale):
    """Sixteen completions of up to four tokens sampled by pi_behav (version 0), its behaviour
    pass against pi_theta (version 1, in the policy), and their scoring."""

    model, m, ring, _params = stale
    with pytest.MonkeyPatch.context() as patch:  # (the test reward, before the autouse fixture)
        patch.syspath_prepend(str(Path(__file__).parents[1]))
        return _trm_batch(model, m, ring)


def _trm_batch(model, m, ring):
    from klpo.train.rollout.samplers import Decoding, generate

    cfg = _config(model, **TRM_OVER)
    with ring.at(m.policy, 0):
        torch.manual_seed(1)
        prompts = ["12+7=", "3+4=", "5+5=", "9+1="]
        decoding = Decoding(group_size=4, max_new_tokens=4, temperature=TEMPERATURE)
        rollout = generate(m.policy, m.tokenizer, prompts, [""] * 4, decoding, codec=m.codec)
        behaviour = sampled_features(cfg, m, rollout, 0)
    rollout, gap = behaviour_pass(cfg, m, rollout, behaviour)
    scored = score(cfg, m, rollout, resolve_rewards({"klpo_test_rewards:digits": 1.0}), 0.0)
    if not bool(scored.old.filled.all()):  # the update's first forward fills pi_old (lr 0)
        _update_grad(cfg, m, scored, [p for p in m.policy.parameters() if p.requires_grad])
    assert bool(scored.old.filled.all())
    # The radius: between the rows' largest k3, so that the mask drops some rows, not all.
    stats = []
    old, behav, mask = scored.old.logp.double(), rollout.behav_logp.double(), rollout.mask
    for i in range(mask.shape[0]):
        k3 = (old[i] - behav[i]).exp() - 1 - (old[i] - behav[i])
        stats.append(float(k3[mask[i]].max()))
    return rollout, gap, scored, _between(stats)


def _between(stats: list[float]) -> float:
    """A radius halfway between the two middle statistics: about half the rows kept, none at the
    boundary (where the two ways of rounding a mean could disagree)."""
    ranked = sorted(stats)
    return 0.5 * (ranked[len(ranked) // 2 - 1] + ranked[len(ranked) // 2])


TRM_OVER = {
    "kl.placement": "none", "rollout.group_size": 4, "rollout.prompts_per_step": 4,
    "rollout.max_new_tokens": 4, "rewards": "[{name: 'klpo_test_rewards:digits'}]",
}  # fmt: skip


def _update_grad(cfg, m, scored, params):
    opt = Optimizers(torch.optim.SGD(params, lr=0.0), None)
    beta = cfg.kl.beta if cfg.kl.placement != "none" else 0.0
    tally = update(
        cfg, m, scored, opt, kl_term(cfg, beta=beta, beta_old=1.0), Dist(),
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    return torch.cat([p.grad.flatten() for p in params]), tally.result(lambda x: x)


def _policy_logp(m, rollout):
    """``[B, C]`` log pi_theta of the sampled tokens from the model's own logits (with the graph)."""
    ids, att = rollout.input_ids, rollout.attention_mask.long()
    logits = m.policy(input_ids=ids, attention_mask=att, position_ids=position_ids(att)).logits
    c = rollout.completion_ids.shape[1]
    logp = (logits[:, -c - 1 : -1] / TEMPERATURE).log_softmax(-1)
    return logp.gather(-1, rollout.completion_ids[..., None])[..., 0]


def test_trm_drops_the_rows_out_of_the_trust_region_at_any_micro_batch(stale, trm_batch):
    from klpo import offpolicy

    model, m, _ring, params = stale
    rollout, gap, scored, delta = trm_batch
    mask = rollout.mask
    want_rows = torch.tensor(_naive_trm_keep(scored.old.logp, rollout.behav_logp, mask, delta))
    assert 0 < int(want_rows.sum()) < len(want_rows)  # the mask drops some rows, not all
    want_keep = mask & want_rows[:, None]
    by_hand = offpolicy.trm_mask(scored.old.logp, rollout.behav_logp, mask, delta=delta)
    assert torch.equal(by_hand, want_keep)
    grads = []
    for micro in (0, 3):
        cfg = _config(model, **TRM_OVER, **{"algo.trm_delta": delta, "algo.micro_batch": micro})
        g, res = _update_grad(cfg, m, scored, params)
        grads.append(g)
        assert torch.equal(scored.keep, want_keep), micro  # the step's mask: the library's
        dropped = mask & ~want_keep
        assert res["trm/masked_frac"][0] == pytest.approx(
            float(dropped.sum()) / float(mask.sum()), abs=1e-12
        )
        assert res["trm/seq_masked_frac"][0] == pytest.approx(
            float((~want_rows).sum()) / len(want_rows), abs=1e-12
        )
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # The other statistic and aggregate reach the mask: |mean k1| per row, by hand.
    log_rho = (scored.old.logp - rollout.behav_logp).double()
    mean_k1 = [abs(float(-log_rho[i][mask[i]].mean())) for i in range(mask.shape[0])]
    radius = _between(mean_k1)
    over = {"algo.trm_delta": radius, "algo.trm_statistic": "k1", "algo.trm_aggregate": "mean"}
    _update_grad(_config(model, **TRM_OVER, **over), m, scored, params)
    rows = torch.tensor([x <= radius for x in mean_k1])
    assert 0 < int(rows.sum()) < len(rows) and torch.equal(scored.keep, mask & rows[:, None])
    # The exact statistic: each row's largest exact KL(pi_behav ‖ pi_old) of the behaviour pass.
    assert torch.equal(rollout.behav_kl, gap.kl)
    kl_max = [float(gap.kl[i][mask[i]].max()) for i in range(mask.shape[0])]
    radius = _between(kl_max)
    over = {"algo.trm_delta": radius, "algo.trm_statistic": "exact"}
    _update_grad(_config(model, **TRM_OVER, **over), m, scored, params)
    rows = torch.tensor([x <= radius for x in kl_max])
    assert 0 < int(rows.sum()) < len(rows) and torch.equal(scored.keep, mask & rows[:, None])
    lib = offpolicy.trm_mask(
        scored.old.logp, rollout.behav_logp, mask, delta=radius, token_kl=gap.kl
    )
    assert torch.equal(scored.keep, lib)
    # The oracle: clip's gradient at the first update (ratio 1, no clip binds) with the TIS weight
    # min(pi_old / pi_behav, 2), over the kept rows only, normalised by every valid token.
    w = (scored.old.logp - rollout.behav_logp).exp().clamp(max=2.0).detach()
    logp = _policy_logp(m, rollout)
    loss = -(torch.where(want_keep, w * scored.adv * logp, 0.0)).sum() / mask.sum()
    want = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    assert float(want.norm()) > 1e-4
    assert float((grads[0] - want).norm()) <= 1e-4 * float(want.norm())


def test_trm_leaves_the_kl_term_unmasked_and_combines_with_m2po(stale, trm_batch):
    """With k3 in the loss: TRM's gradient is the unmasked one less the policy loss's gradient on
    the dropped rows (the KL term keeps every token). With m2po: both masks apply, the step's
    mask is their intersection, and sampler/masked_frac is its share."""
    from klpo import offpolicy
    from klpo.train.step.step_metrics import sampler_metrics

    model, m, _ring, params = stale
    rollout, gap, scored, delta = trm_batch
    mask = rollout.mask
    kl_over = {**TRM_OVER, "kl.placement": "loss", "kl.estimator": "k3"}
    g_all, _ = _update_grad(_config(model, **kl_over), m, scored, params)
    g_trm, _ = _update_grad(
        _config(model, **kl_over, **{"algo.trm_delta": delta}), m, scored, params
    )
    dropped_rows = mask & ~offpolicy.trm_mask(
        scored.old.logp, rollout.behav_logp, mask, delta=delta
    )
    w = (scored.old.logp - rollout.behav_logp).exp().clamp(max=2.0).detach()
    logp = _policy_logp(m, rollout)
    loss = -(torch.where(dropped_rows, w * scored.adv * logp, 0.0)).sum() / mask.sum()
    pg_dropped = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])
    assert float(pg_dropped.norm()) > 1e-4
    assert float((g_trm - (g_all - pg_dropped)).norm()) <= 1e-4 * float(g_all.norm())

    cfg = _config(
        model, **TRM_OVER,
        **{"algo.trm_delta": delta, "algo.policy_loss": "m2po", "algo.m2po_threshold": 10.0},
    )  # fmt: skip
    _, res = _update_grad(cfg, m, scored, params)
    log_r = scored.old.logp - rollout.behav_logp
    m2po = offpolicy.m2po_mask(log_r, mask, threshold=10.0)
    trm = offpolicy.trm_mask(scored.old.logp, rollout.behav_logp, mask, delta=delta)
    assert bool((trm & ~m2po).any()) and bool((m2po & ~trm).any())  # neither holds the other
    both = m2po & trm
    assert torch.equal(scored.keep, both)
    got = sampler_metrics(cfg, scored, gap, step=2)
    frac = float((mask & ~both).sum()) / float(mask.sum())
    assert 0 < frac < 1 and got["sampler/masked_frac"] == pytest.approx(frac, abs=1e-12)
    share = float((mask & ~trm).sum()) / float(mask.sum())
    assert res["trm/masked_frac"][0] == pytest.approx(share, abs=1e-12) and share < frac


def test_the_exact_tv_of_the_behaviour_pass_is_the_vocabularys(stale, trm_batch):
    """sampler/tv_exact(_max) and the pass's per-position TV against float64 over the vocabulary
    from both versions' own logits; and the KL's, as a check of the same positions."""
    from klpo.train.step.step_metrics import sampler_metrics

    model, m, ring, _params = stale
    rollout, gap, scored, _ = trm_batch
    ids, att = rollout.input_ids, rollout.attention_mask.long()
    c = rollout.completion_ids.shape[1]

    def probs():
        with torch.no_grad():
            out = m.policy(input_ids=ids, attention_mask=att, position_ids=position_ids(att))
        return (out.logits[:, -c - 1 : -1].double() / TEMPERATURE).softmax(-1)

    with ring.at(m.policy, 0):
        q = probs()
    p = probs()
    mask = rollout.mask
    tv = torch.where(mask, 0.5 * (p - q).abs().sum(-1), 0.0)
    kl = torch.where(mask, (q * (q.log() - p.log())).sum(-1), 0.0)
    assert float(tv.max()) > 1e-2  # the versions differ
    torch.testing.assert_close(gap.tv.double(), tv, rtol=0, atol=2e-6)
    torch.testing.assert_close(gap.kl.double(), kl, rtol=0, atol=2e-5)
    unmasked = dataclasses.replace(scored, keep=None)  # (as an update without a mask leaves it)
    got = sampler_metrics(_config(model, **TRM_OVER), unmasked, gap, step=2)
    assert got["sampler/tv_exact"] == pytest.approx(float(tv[mask].mean()), abs=2e-6)
    assert got["sampler/tv_exact_max"] == pytest.approx(float(tv.max()), abs=2e-6)
    assert "sampler/masked_frac" not in got  # no mask in this config


def test_exact_tv_in_chunks_is_the_naive_float64_sum():
    from klpo.heads import Head
    from klpo.logprobs import LogitTransform
    from klpo.train.models.backbone import OWN_LOGITS
    from klpo.train.rollout.versions import exact_tv

    gen = torch.Generator().manual_seed(3)
    hidden, hidden_ref = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    w, w_ref = torch.randn(11, 8, generator=gen), torch.randn(11, 8, generator=gen)
    bias = torch.randn(11, generator=gen)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    cap = LogitTransform.make(1.5, softcap=3.0)
    head, head_ref = Head(w, bias, cap), Head(w_ref, None, None)

    def naive(z, z_ref):
        p, q = (z.double() / 0.7).softmax(-1), (z_ref.double() / 0.7).softmax(-1)
        return torch.where(mask, 0.5 * (p - q).abs().sum(-1), 0.0)

    z = torch.tanh(1.5 * (hidden.double() @ w.double().T + bias.double()) / 3.0) * 3.0
    want = naive(z, hidden_ref.double() @ w_ref.double().T)
    for chunk in (None, 1, 3):
        got = exact_tv(hidden, head, hidden_ref, head_ref, mask, temperature=0.7, row_chunk=chunk)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    logits, logits_ref = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    got = exact_tv(logits.double(), OWN_LOGITS, logits_ref.double(), OWN_LOGITS, mask,
                   temperature=0.7, row_chunk=2)  # fmt: skip
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, naive(logits, logits_ref), rtol=0, atol=1e-12)
    same = exact_tv(hidden, head, hidden, head, mask, temperature=0.7)
    assert float(same.abs().max()) < 1e-6  # zero against itself
    with pytest.raises(ValueError, match=r"must both be \[B, C, \.\.\.\]"):
        exact_tv(hidden, head, hidden_ref[:1], head_ref, mask, temperature=0.7)


def test_trm_without_a_behaviour_policy_is_refused(tiny_model):
    with pytest.raises(ValueError, match=r"algo\.trm_delta=0\.05 .* set rollout\.staleness >= 1"):
        _config(tiny_model, **{"rollout.staleness": 0, "algo.trm_delta": 0.05})
    cfg = _config(tiny_model, **{"rollout.staleness": 0, "rollout.engine": "vllm",
                                 "algo.trm_delta": 0.05})  # fmt: skip
    assert cfg.algo.trm_delta == 0.05 and cfg.algo.trm_statistic == "k3"
    with pytest.raises(ValueError, match=r"algo\.trm_statistic=exact .* rollout\.staleness=0"):
        _config(tiny_model, **{"rollout.staleness": 0, "rollout.engine": "vllm",
                               "algo.trm_delta": 0.05, "algo.trm_statistic": "exact"})  # fmt: skip


# --------------------------------------------------------------------------------------------
# Under torchrun: accepted, each rank seeded apart (the pooling: tests/train/runtime/test_resume_ddp.py).


def test_a_stale_m2po_run_under_torchrun_passes_the_preflight(
    tiny_model, quick, tmp_path, monkeypatch
):
    from klpo.train import loop

    monkeypatch.setenv("WORLD_SIZE", "2")
    for asynchronous in ("false", "true"):
        over = {
            "rollout.staleness": 1, "algo.policy_loss": "m2po",
            "rollout.asynchronous": asynchronous,
        }  # fmt: skip
        cfg = build_config(overrides=quick(tiny_model, tmp_path / "r", **over))
        loop.check_run(cfg, log=lambda *_: None)


def test_each_rank_samples_a_step_with_its_own_seed():
    from klpo.train.rollout.worker import step_seed

    assert step_seed(3, 5) == step_seed(3, 5, 0) == 3 * 1_000_003 + 5  # one process: as before
    seeds = {step_seed(3, 5, rank) for rank in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


def test_prime_rls_loss_is_anchored_to_the_sampler_and_verls_dppo_to_pi_old(stale, trm_batch):
    """dppo-tv-k2 (prime-rl's loss) takes its mask, its weight and its k2 term against pi_behav,
    with no TIS weight on top (the ratio to the sampler is the weight); with
    algo.dppo_anchor=old (verl's anchor) against pi_old, times the TIS weight. Each gradient is
    autograd's of the loss written out from the library's pieces; at the first update the
    old-anchored k2 term and mask do nothing, so the two anchors differ."""
    from klpo import offpolicy

    model, m, _ring, params = stale
    rollout, _gap, scored, _ = trm_batch
    mask, adv, behav, old = rollout.mask, scored.adv, rollout.behav_logp, scored.old.logp
    over = {**TRM_OVER, "algo.policy_loss": "dppo-tv-k2", "algo.sampler_k2_coef": 0.5,
            "algo.dppo_delta_low": 0.05, "algo.dppo_delta_high": 0.05}  # fmt: skip

    def autograd(anchor, weight):
        logp = _policy_logp(m, rollout)
        pg = offpolicy.dppo(logp, anchor, adv, delta_low=0.05, delta_high=0.05)
        per_tok = weight * (pg + offpolicy.sampler_k2(logp, anchor, coef=0.5))
        loss = torch.where(mask, per_tok, 0.0).sum() / mask.sum()
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    g_sampler, _ = _update_grad(_config(model, **over), m, scored, params)
    g_old, _ = _update_grad(
        _config(model, **over, **{"algo.dppo_anchor": "old"}), m, scored, params
    )
    want_sampler = autograd(behav, 1.0)
    want_old = autograd(old, (old - behav).exp().clamp(max=2.0).detach())
    keep = offpolicy.dppo_mask(old, behav, adv, delta_low=0.05, delta_high=0.05)
    assert 0 < int((keep & mask).sum()) < int(mask.sum())  # the sampler's mask drops some tokens
    for got, want in ((g_sampler, want_sampler), (g_old, want_old)):
        assert float((got - want).norm()) <= 1e-4 * float(want.norm())
    assert float((g_sampler - g_old).norm()) > 0.05 * float(g_old.norm())


def test_dppo_anchor_is_refused_outside_the_dppo_losses(tiny_model):
    with pytest.raises(ValueError, match=r"algo\.dppo_anchor=sampler anchors a DPPO loss"):
        _config(tiny_model, **{"algo.dppo_anchor": "sampler"})
    cfg = _config(tiny_model, **{"algo.policy_loss": "dppo-tv", "algo.dppo_anchor": "sampler"})
    assert cfg.algo.dppo_anchor == "sampler"


# --------------------------------------------------------------------------------------------
# rollout.async_weights=newest: the worker samples with the newest version pushed (lag 0 .. k).


def test_the_newest_version_pushed_is_picked_never_one_more_than_k_behind():
    from klpo.train.rollout.worker import pick_version

    def naive(pushed, step, k, oldest=0):  # every version allowed for the step, the newest
        allowed = [v for v in pushed if max(step - 1 - k, oldest) <= v <= step - 1]
        return (
            max(allowed)
            if allowed and max(allowed) == max([v for v in pushed if v <= step - 1])
            else None
        )

    for k in (0, 1, 2, 3):
        for step in range(1, 9):
            for n in range(0, 10):
                for pushed in (range(n), range(n // 2, n), [n - 1] if n else []):
                    for oldest in (0, 2):
                        got = pick_version(pushed, step, k, oldest)
                        assert got == naive(list(pushed), step, k, oldest), (pushed, step, k)
                        if got is not None:
                            assert max(step - 1 - k, oldest) <= got <= step - 1
    assert pick_version([0], 1, 2) == 0  # the first step: the starting weights, lag 0
    assert pick_version([0, 1, 2, 3], 4, 2) == 3  # the newest, lag 0
    assert pick_version([0, 1], 5, 2) is None  # 1 is 3 behind step 5: wait for version 2
    assert pick_version([0, 1, 2, 3], 2, 2) == 1  # 2 and 3 would be from step 2's future
    assert pick_version([3], 3, 2, oldest=3) is None  # a resumed ring: nothing older than 3
    with pytest.raises(ValueError, match=r"staleness must be an integer >= 0"):
        pick_version([0], 1, -1)
    with pytest.raises(ValueError, match=r"step must be >= 1"):
        pick_version([0], 0, 1)


def _logp_at(m, rollout, temperature):
    """``[B, C]`` the policy's log-probs of the sampled tokens from a whole forward of its own
    logits (the oracle of the behaviour pass's), 0 where masked."""
    ids, att = rollout.input_ids, rollout.attention_mask.long()
    with torch.no_grad():
        logits = m.policy(input_ids=ids, attention_mask=att, position_ids=position_ids(att)).logits
    c = rollout.completion_ids.shape[1]
    logp = (logits[:, -c - 1 : -1].double() / temperature).log_softmax(-1)
    logp = logp.gather(-1, rollout.completion_ids[..., None])[..., 0]
    return torch.where(rollout.mask, logp, 0.0)


class _ScriptedInbox:
    """The worker's inbox, the trainer's side played by a script: the messages of a phase are
    all queued at once; when the worker waits (a blocking ``get`` on an empty inbox) the next
    phase is queued, and the worker's pending step is noted; after the last phase, "stop"."""

    def __init__(self, phases):
        import collections

        self.phases, self.queued, self.waits = list(phases), collections.deque(), 0

    def get_nowait(self):
        import queue

        if not self.queued:
            raise queue.Empty
        return self.queued.popleft()

    def get(self, timeout=None):  # (the worker polls with a timeout to watch its parent)
        if not self.queued:
            if not self.phases:
                return ("stop", None)
            self.waits += 1
            self.queued.extend(self.phases.pop(0))
        return self.queued.popleft()


def test_the_newest_worker_samples_with_the_newest_version_and_waits_for_the_oldest_allowed(
    tiny_model,
):
    """The worker's loop (in this process, its inbox scripted) with k = 2: a worker behind the
    trainer finds versions 0, 1, 2 and the requests of steps 1 .. 4 queued and samples steps
    1, 2, 3, 4 with versions 0, 1, 2, 2 (the newest not from the step's future); step 6 with
    only version 2 received waits (2 is 3 behind) and takes version 3 when it comes; step 7
    finds 4, 5, 6 and takes 6. Every batch's behaviour log-probs, formed by the trainer from
    the worker's hidden states, are the policy's own at the version reported (a whole forward
    with that version's weights from the ring), to float rounding."""
    import copy
    import queue

    from klpo.train.models.backbone import shares_prompt
    from klpo.train.models.load import DTYPES
    from klpo.train.rollout.samplers import Decoding
    from klpo.train.rollout.worker import AsyncSampler, WorkerSampling, worker_loop

    extra = {
        "rollout.staleness": 2, "rollout.asynchronous": "true", "rollout.async_weights": "newest",
        "rollout.max_new_tokens": 3,
    }  # fmt: skip
    cfg = _config(tiny_model, **extra)
    m = build_models(cfg, Dist(), None)
    ring = VersionRing(10)  # (a store of every version here)
    gen = torch.Generator().manual_seed(1)
    params = [p for p in m.policy.parameters() if p.requires_grad]
    with torch.no_grad():
        for version in range(7):
            ring.keep(version, m.policy)
            for p in params:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    ring.keep(7, m.policy)  # the policy holds version 7 (the trainer's current weights)

    def weights(v):
        return ("weights", (v, ring.versions[v]))

    def request(step):
        return ("sample", (step, [(0, [PROMPT], ["7"])], max(step - 3, 0)))

    phases = [
        [weights(0), request(1), request(2), request(3), weights(1), weights(2), request(4)],
        [request(5)],
        [request(6)],
        [weights(3)],
        [weights(4), weights(5), weights(6), request(7)],
    ]
    inbox, outbox = _ScriptedInbox(phases), queue.Queue()
    sampling = WorkerSampling(
        copy.deepcopy(m.backbone), m.tokenizer, m.codec, Decoding.from_config(cfg),
        shares_prompt(cfg), cfg.run.seed, "cpu", DTYPES[cfg.model.dtype],
    )  # fmt: skip
    worker_loop(sampling, inbox, outbox, 2)
    assert inbox.waits == 5 and not inbox.phases  # (at the start; after 4, 5; at 6; after 6)
    sampler = AsyncSampler.__new__(AsyncSampler)  # the trainer's side of take()
    sampler.k, sampler.outbox, sampler.models, sampler.device = 2, outbox, m, torch.device("cpu")
    sampler.process, sampler.leader, sampler.ranks = None, True, [0]
    versions = []
    for step in range(1, 8):
        rollout, behaviour = sampler.take(step)
        versions.append(behaviour.version)
        done, _ = behaviour_pass(cfg, m, rollout, behaviour)
        assert done.behav_version == behaviour.version
        with ring.at(m.policy, behaviour.version):
            want = _logp_at(m, rollout, TEMPERATURE)
        assert torch.allclose(done.behav_logp.double(), want, atol=1e-5, rtol=0), step
    assert versions == [0, 1, 2, 2, 2, 3, 6]  # lags 0, 0, 0, 1, 2, 2, 0
    assert outbox.empty()


def test_a_newest_run_logs_lags_within_k_and_the_behaviour_of_the_version_used(
    tiny_model, quick, tmp_path, monkeypatch
):
    """A run with the worker on the newest weights (k = 2), stopped after step 4 and resumed to
    step 5: every logged ``rollout/staleness`` is an integer in [0, 2], 0 at the first step and
    at the first after the resume (the worker starts from the restored newest version), and is
    the lag of the version the worker reported; each batch's behaviour log-probs are the policy's
    own at that version (from the trainer's ring, a whole forward), to float rounding (step 4's
    at the earliest is sampled by a version pushed after the start)."""
    import multiprocessing

    from klpo.train import loop
    from klpo.train.step.sampling import Worker

    checked = {}
    sample = Worker.sample

    def checking(self, step, progress):
        got = sample(self, step, progress)
        v = got.rollout.behav_version
        with self.ring.at(self.models.policy, v):
            want = _logp_at(self.models, got.rollout, self.cfg.rollout.temperature)
        checked[step] = (v, float((got.rollout.behav_logp.double() - want).abs().max()))
        return got

    monkeypatch.setattr(Worker, "sample", checking)
    extra = {
        "rollout.staleness": 2, "rollout.asynchronous": "true", "rollout.async_weights": "newest",
        "run.save_every": 2, "run.eval_every": 0, "kl.estimator": "k3",
    }  # fmt: skip
    run_dir = tmp_path / "run"
    loop.train(build_config(overrides=quick(tiny_model, run_dir, **extra, **{"run.steps": 4})))
    over = quick(tiny_model, run_dir, **extra, **{"run.steps": 5})
    loop.train(build_config(overrides=over), resume=True, log=lambda *_: None)
    lags = [r["rollout/staleness"] for r in _rows(run_dir)]
    assert len(lags) == 5 and all(lag in (0.0, 1.0, 2.0) for lag in lags), lags
    assert lags[0] == 0.0 and lags[4] == 0.0, lags
    assert sorted(checked) == [1, 2, 3, 4, 5]
    assert lags == [float(step - 1 - checked[step][0]) for step in range(1, 6)]
    assert all(diff < 1e-5 for _, diff in checked.values()), checked
    assert not multiprocessing.active_children()
