"""The trainer end to end on a tiny random model: every algorithm, KL choices, errors, equivalence."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from klpo import losses, reduce
from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.dist import Dist
from klpo.train.metrics import is_timing, read_metrics
from klpo.train.rollout import generate, position_ids


@pytest.fixture
def run(tiny_model, quick):
    def go(out, **extra):
        cfg = build_config(overrides=quick(tiny_model, out, **extra))
        loop.train(cfg, log=lambda *_: None)
        return read_metrics(out / "metrics.jsonl")

    return go


def policy_weights(path):
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(
    ("algo", "extra"),
    [
        ("grpo", {}),
        ("ppo", {"kl.placement": "reward", "kl.estimator": "k1", "algo.epochs": 2}),
        ("rloo", {"kl.placement": "reward"}),
        ("reinforce++", {"kl.placement": "reward", "kl.estimator": "k3"}),
    ],
)
def test_each_algorithm_trains(run, tiny_model, tmp_path, algo, extra):
    rows = run(tmp_path / "run", **{"algo.name": algo, **extra})
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "accuracy/heldout" in rows[0] and "accuracy/heldout" in rows[2]
    for r in rows[1:]:
        for key in ("reward/mean", "kl/ref/exact", "entropy", "loss/total", "grad_norm", "beta"):
            assert math.isfinite(r[key]), key
    if algo == "ppo":
        assert "loss/value" in rows[-1]
    before = policy_weights(tiny_model)
    after = policy_weights(tmp_path / "run" / "checkpoints" / "step_000003" / "policy")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed, "no parameter changed"
    for name in ("report.md", "config.yaml", "reward.png", "kl.png", "accuracy.png"):
        assert (tmp_path / "run" / name).is_file()


@pytest.mark.parametrize(
    "extra",
    [
        {"kl.estimator": "full", "kl.placement": "loss"},
        {"kl.estimator": "full", "kl.placement": "reward"},
        {"kl.estimator": "k3_is", "kl.placement": "loss", "algo.epochs": 2},
        {"kl.estimator": "k3", "kl.placement": "reward+loss"},
        {"kl.controller": "adaptive", "kl.target": 0.01, "kl.placement": "reward"},
        {"kl.controller": "spread-scaled", "algo.micro_batch": 3, "algo.minibatches": 2},
        {"algo.policy_loss": "kl-penalty", "algo.penalty_target": 0.01, "algo.epochs": 2},
        {"algo.std": "none", "algo.loss_reduction": "seq-mean-token-sum-norm"},
        {"kl.placement": "none", "algo.entropy_coef": 0.01},
    ],
)
def test_kl_choices_and_options_run(run, tmp_path, extra):
    rows = run(tmp_path / "run", **{"run.steps": 2, **extra})
    last = rows[-1]
    assert all(math.isfinite(v) for k, v in last.items() if isinstance(v, float)), last
    if extra.get("kl.estimator") == "full":
        assert last["kl/ref/full"] == last["kl/ref/exact"]


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_the_update_is_the_library_loss(tiny_model, quick, tmp_path, estimator):
    """One fixed batch: the trainer's gradient equals a naive assembly of the library's functions
    from full logits (log_softmax + gather in float64), for the clipped surrogate + k3 in the loss,
    and for the default, the exact KL summed over the vocabulary by hand."""
    extra = {"kl.beta": 0.5, "kl.estimator": estimator}
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **extra))
    dist = Dist()
    m = loop.build_models(cfg, dist, None)
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference so the KL term is non-zero
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    train, _ = loop.load_examples(cfg)
    rollout = generate(
        m.policy, m.tokenizer, [e.prompt for e in train[:4]], [e.answer for e in train[:4]],
        group_size=4, max_new_tokens=4,
    )  # fmt: skip
    reward_fns = loop.rewards_mod.resolve_rewards({"klpo_test_rewards:digits": 1.0})
    s = loop.score(cfg, m, rollout, reward_fns, 0.5)
    assert s.logp_old is None  # one epoch, one minibatch: the update's pass gives log pi_old
    rows = torch.arange(len(rollout.prompts))
    n = reduce.normaliser(rollout.mask, "token-mean")
    m.policy.zero_grad()
    loop._micro_step(cfg, m, s, rows, 0.5, 1.0, n, dist, sync=True)
    got = {k: p.grad.clone() for k, p in m.policy.named_parameters()}

    # Naive: full logits, float64 log-softmax, gather; the same library losses.
    m.policy.zero_grad()
    att = rollout.attention_mask
    logits = m.policy(
        input_ids=rollout.input_ids, attention_mask=att, position_ids=position_ids(att)
    ).logits
    p, c = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    logq = torch.log_softmax(logits[:, p - 1 : p - 1 + c].double(), -1)
    logp = logq.gather(-1, rollout.completion_ids[..., None]).squeeze(-1)
    pg = losses.ppo_clip(logp, logp.detach(), s.adv)
    if estimator == "k3":
        kl_tok = losses.kl_loss("k3", logp, s.logp_ref, logp_old=logp.detach())
    else:  # sum_v q(v) (log q(v) - log q_ref(v)), q_ref from the reference's hidden states
        weight_ref, bias_ref = m.reference.head()
        logits_ref = s.hidden_ref.double() @ weight_ref.double().T
        if bias_ref is not None:
            logits_ref = logits_ref + bias_ref.double()
        logq_ref = torch.log_softmax(logits_ref, -1)
        kl_tok = (logq.exp() * (logq - logq_ref)).sum(-1)
    loss = reduce.reduce(pg, rollout.mask, "token-mean") + 0.5 * reduce.reduce(
        kl_tok, rollout.mask, "token-mean"
    )
    loss.backward()
    for k, param in m.policy.named_parameters():
        torch.testing.assert_close(got[k], param.grad, rtol=1e-4, atol=1e-6, msg=k)
    assert any(g.abs().max() > 0 for g in got.values())


def test_an_on_policy_update_needs_no_pass_of_its_own(tiny_model, quick, tmp_path, monkeypatch):
    """One epoch, one minibatch: the update's forward pass gives log pi_old, the entropy and the
    exact KL. The step, parameters and metrics, equals the one with the score's separate policy
    pass (the previous behaviour), to float32 rounding, over several micro-batches."""
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "run", **{"kl.beta": 0.5, "algo.micro_batch": 5})
    )
    assert loop.update_gives_logp_old(cfg)
    for off in ({"algo.epochs": 2}, {"algo.minibatches": 2}, {"kl.placement": "reward"}):
        other = build_config(overrides=quick(tiny_model, tmp_path / "o", **off))
        assert not loop.update_gives_logp_old(other), off
    dist = Dist()
    train, _ = loop.load_examples(cfg)
    reward_fns = loop.rewards_mod.resolve_rewards({"klpo_test_rewards:digits": 1.0})

    def one_step(separate_pass: bool):
        monkeypatch.setattr(loop, "update_gives_logp_old", lambda _: not separate_pass)
        m = loop.build_models(cfg, dist, None)
        torch.manual_seed(0)
        with torch.no_grad():  # a policy away from the reference: KL and entropy not trivial
            for p in m.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        rollout = generate(
            m.policy, m.tokenizer, [e.prompt for e in train[:4]], [e.answer for e in train[:4]],
            group_size=4, max_new_tokens=4,
        )  # fmt: skip
        s = loop.score(cfg, m, rollout, reward_fns, 0.5)
        assert (s.logp_old is None) == (not separate_pass)
        assert ("entropy" in s.metrics) == separate_pass
        opt = loop.Optimizers(torch.optim.SGD(m.policy.parameters(), lr=0.1), None)
        upd = loop.update(cfg, m, s, opt, 0.5, 1.0, dist, torch.Generator().manual_seed(0))
        return {**s.metrics, **upd}, dict(m.policy.named_parameters())

    ours, params = one_step(separate_pass=False)
    theirs, params_ref = one_step(separate_pass=True)
    assert set(ours) == set(theirs)
    assert ours["kl/ref/exact"] > 1e-3 and ours["entropy"] > 0.1
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    for name, p in params.items():
        torch.testing.assert_close(p, params_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_errors_are_clear(run, tmp_path):
    with pytest.raises(Exception, match=r"nan_reward. returned nan for sample 0.*must be finite"):
        run(tmp_path / "nan", rewards="[{name: 'klpo_test_rewards:nan_reward'}]")
    run(tmp_path / "once", **{"run.steps": 1})
    with pytest.raises(ConfigError, match="already holds a run; continue it with --resume"):
        run(tmp_path / "once", **{"run.steps": 1})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        run(tmp_path / "j", **{"data.source": "jsonl", "data.path": str(bad)})
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "' + "9" * 50 + '=", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"long.jsonl:1: the prompt is 51 tokens long.*max_prompt"):
        run(
            tmp_path / "l",
            **{"data.source": "jsonl", "data.path": str(long), "data.max_prompt_tokens": 10},
        )


def test_metrics_of_a_run_are_deterministic(run, tmp_path):
    a = run(tmp_path / "a")
    b = run(tmp_path / "b")
    strip = [{k: v for k, v in r.items() if not is_timing(k)} for r in a]
    assert strip == [{k: v for k, v in r.items() if not is_timing(k)} for r in b]


def test_a_non_finite_loss_stops_the_run(run, tmp_path):
    # Rewards of order 1e38 without the std scale make the gradient norm overflow to inf.
    huge = {"rewards": "[{name: 'klpo_test_rewards:digits', weight: 1.0e38}]", "algo.std": "none"}
    with pytest.raises(loop.TrainingDiverged, match=r"step 1: grad_norm = inf.*optim.lr"):
        run(tmp_path / "d", **huge)
    rows = read_metrics(tmp_path / "d" / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and rows[-1]["grad_norm"] == "inf"
