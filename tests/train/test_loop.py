"""The trainer end to end on a tiny random model: every algorithm, KL choices, errors, equivalence."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from safetensors.torch import load_file

from klpo import advantages, kl, logprobs, losses, reduce
from klpo.train import loop
from klpo.train.algorithm_fns import whiten_over_ranks
from klpo.train.algorithms import ALGORITHMS, POLICY_LOSSES
from klpo.train.config import ConfigError, build_config
from klpo.train.data.load import load_examples
from klpo.train.loop import TrainingDiverged
from klpo.train.models import build as models_build
from klpo.train.models.build import build_models, unwrap
from klpo.train.rewards.functions import resolve_rewards
from klpo.train.rollout.samplers import Decoding, completion_hidden, generate, position_ids
from klpo.train.runtime.dist import Dist
from klpo.train.runtime.metrics import Tally, is_timing, read_metrics
from klpo.train.step.fused import FUSED_LOSS_MIN_VOCAB, takes_fused_loss
from klpo.train.step.kl_term import kl_term, needs_exact_kl
from klpo.train.step.score import score
from klpo.train.step.step_metrics import step_metrics
from klpo.train.step.types import Optimizers, SamplingPass, update_gives_logp_old
from klpo.train.step.update import MicroBatch, micro_step, update


@pytest.fixture
def run(tiny_model, quick):
    def go(out, **extra):
        cfg = build_config(overrides=quick(tiny_model, out, **extra))
        loop.train(cfg, log=lambda *_: None)
        return read_metrics(out / "metrics.jsonl")

    return go


def policy_weights(path):
    return load_file(str(path / "model.safetensors"))


SMOKE_OPTIONS = {
    "ppo": {"kl.placement": "reward", "kl.estimator": "k1", "algo.epochs": 2},
    "rloo": {"kl.placement": "reward"},
    "reinforce++": {"kl.placement": "reward", "kl.estimator": "k3"},
}
"""Options beside ``algo.name`` for some algorithms' smoke runs (the rest run the defaults)."""


@pytest.mark.parametrize("algo", list(ALGORITHMS))
def test_each_algorithm_trains(run, tiny_model, tmp_path, algo):
    rows = run(tmp_path / "run", **{"algo.name": algo, **SMOKE_OPTIONS.get(algo, {})})
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert "accuracy/heldout" in rows[0] and "accuracy/heldout" in rows[2]
    for r in rows[1:]:
        for key in ("reward/mean", "kl/ref/exact", "entropy", "loss/total", "grad_norm", "beta"):
            assert math.isfinite(r[key]), key
    assert ("loss/value" in rows[-1]) == ALGORITHMS[algo].critic
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
        {"kl.controller": "spread-scaled", "algo.micro_batch": 3, "algo.minibatches": 2},
        {"algo.std": "none", "algo.loss_reduction": "seq-mean-token-sum-norm"},
        {"kl.placement": "none", "algo.entropy_coef": 0.01},
    ],
)
def test_kl_choices_and_options_run(run, tmp_path, extra):
    """Each choice runs, logs the terms it adds and no others, and loss/total is their sum
    (policy + beta·KL + entropy_coef·entropy term, each averaged over the optimizer steps)."""
    rows = run(tmp_path / "run", **{"run.steps": 2, "run.eval_every": 0, **extra})
    cfg = build_config(overrides=[f"{k}={v}" for k, v in extra.items()])
    for r in rows:
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
        assert ("loss/kl" in r) == kl.in_loss(cfg.kl.placement)
        assert ("loss/entropy" in r) == bool(cfg.algo.entropy_coef)
        total = (
            r["loss/policy"]
            + r["beta"] * r.get("loss/kl", 0.0)
            + cfg.algo.entropy_coef * r.get("loss/entropy", 0.0)
        )
        assert r["loss/total"] == pytest.approx(total, rel=1e-5, abs=1e-7)
        if "loss/kl" in r and cfg.kl.estimator in ("full", "k3"):
            assert r["loss/kl"] >= 0  # both are non-negative per token
    if cfg.kl.estimator == "full":
        assert rows[-1]["kl/ref/full"] == rows[-1]["kl/ref/exact"]


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_the_update_is_the_library_loss(tiny_model, quick, tmp_path, scored_rollout, estimator):
    """One fixed batch: the trainer's gradient equals a naive assembly of the library's functions
    from full logits (log_softmax + gather in float64), for the clipped surrogate + k3 in the loss,
    and for the default, the exact KL summed over the vocabulary by hand."""
    extra = {"kl.beta": 0.5, "kl.estimator": estimator}
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **extra))
    sr = scored_rollout(cfg, beta=0.5)  # the policy moved off the reference: the KL term is not 0
    dist, m, rollout, s = sr.dist, sr.models, sr.rollout, sr.scored
    assert not s.old.filled.any()  # one epoch, one minibatch: the update's pass gives log pi_old
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
    assert s.old.filled.all()
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
        weight_ref, bias_ref, _ = m.reference.head()
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


def test_an_on_policy_update_needs_no_pass_of_its_own(tiny_model, quick, tmp_path, scored_rollout):
    """One epoch, one minibatch: the update's forward pass gives log pi_old, the entropy and the
    exact KL. The step, parameters and metrics, equals the one with the score's separate policy
    pass (the previous behaviour), to float32 rounding, over several micro-batches."""
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "run", **{"kl.beta": 0.5, "algo.micro_batch": 5})
    )
    assert update_gives_logp_old(cfg)
    for off in ({"algo.epochs": 2}, {"algo.minibatches": 2}, {"kl.placement": "reward"}):
        other = build_config(overrides=quick(tiny_model, tmp_path / "o", **off))
        assert not update_gives_logp_old(other), off

    def one_step(separate_pass: bool):
        # None: the trainer's rule (the update's pass here); True: the score's pass of its own.
        sr = scored_rollout(cfg, beta=0.5, fill_old=True if separate_pass else None)
        m, s, dist = sr.models, sr.scored, sr.dist
        assert bool(s.old.filled.all()) == separate_pass
        opt = Optimizers(torch.optim.SGD(m.policy.parameters(), lr=0.1), None)
        upd = update(
            cfg,
            m,
            s,
            opt,
            kl_term(cfg, beta=0.5, beta_old=1.0),
            dist,
            torch.Generator().manual_seed(0),
        )
        assert s.old.filled.all()
        return step_metrics(cfg, s, upd, dist), dict(m.policy.named_parameters())

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
    with pytest.raises(TrainingDiverged, match=r"step 1: grad_norm = inf.*optim.lr"):
        run(tmp_path / "d", **huge)
    rows = read_metrics(tmp_path / "d" / "metrics.jsonl")
    assert rows[-1]["step"] == 1 and rows[-1]["grad_norm"] == "inf"


# ---------------------------------------------------------------------------------------------
# Behaviour of each variant, against its rule written out by hand.


def _ziegler(beta, kl, *, target, horizon, n):
    return beta * (1 + min(max(kl / target - 1, -0.2), 0.2) * n / horizon)


def _ppo_rule(beta, kl, *, target):
    return beta * 2 if kl > 1.5 * target else beta / 2 if kl < target / 1.5 else beta


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        (
            {"kl.controller": "adaptive", "kl.target": 1e-4, "kl.horizon": 100},
            lambda b, r: _ziegler(b, r["kl/ref/exact"], target=1e-4, horizon=100, n=16),
        ),
        (
            {"kl.controller": "ppo-adaptive", "kl.target": 1e-4},
            lambda b, r: _ppo_rule(b, r["kl/ref/exact"], target=1e-4),
        ),
        (
            {"kl.controller": "spread-scaled", "kl.scale": 0.05},
            lambda b, r: 0.1 / (1 + r["reward/group_std"] / 0.05),
        ),
    ],
    ids=["adaptive", "ppo-adaptive", "spread-scaled"],
)
def test_kl_controllers_move_beta_by_their_rule(run, tmp_path, extra, rule):
    """beta of step 2 is the controller's rule applied to beta of step 1 and the step's logged
    KL per token (or group reward spread); 16 sequences per step."""
    rows = run(tmp_path / "run", **{"run.steps": 3, "run.eval_every": 0, "kl.beta": 0.1, **extra})
    assert rows[0]["beta"] == 0.1
    for prev, nxt in itertools.pairwise(rows):
        assert nxt["beta"] == pytest.approx(rule(prev["beta"], prev), rel=1e-12)
    assert any(r["beta"] != 0.1 for r in rows[1:]), "the rule never moved beta: no power"


def test_kl_penalty_moves_beta_old_by_ppos_rule(run, tmp_path):
    """PPO's adaptive KL penalty (Schulman et al. 2017, sec. 4): beta_old doubles when the
    update's KL(pi_old ‖ pi_theta) exceeds 1.5 × target and halves below target / 1.5."""
    for target, factor in ((1e-7, 2.0), (10.0, 0.5)):
        extra = {
            "algo.policy_loss": "kl-penalty",
            "algo.penalty_target": target,
            "algo.penalty_beta": 1.0,
            "algo.epochs": 2,
            "run.steps": 3,
            "run.eval_every": 0,
        }
        rows = run(tmp_path / str(target), **extra)
        assert rows[0]["beta_old"] == 1.0
        for prev, nxt in itertools.pairwise(rows):
            assert prev["kl/old/k3"] > 0
            want = _ppo_rule(prev["beta_old"], prev["kl/old/k3"], target=target)
            assert nxt["beta_old"] == want == prev["beta_old"] * factor


def _fixed_batch(cfg, beta_shift=0.05):
    dist = Dist()
    m = build_models(cfg, dist, None)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(beta_shift * torch.randn_like(p))
    train, _ = load_examples(cfg)
    torch.manual_seed(1)
    rollout = generate(m.policy, m.tokenizer, [e.prompt for e in train[:4]], [e.answer for e in train[:4]], Decoding(group_size=4, max_new_tokens=4))  # fmt: skip
    fns = resolve_rewards({"klpo_test_rewards:digits": 1.0})
    return dist, m, rollout, fns


def test_the_entropy_bonus_raises_entropy(tiny_model, quick, tmp_path):
    """One SGD step on a fixed batch with entropy_coef = +c, 0, -c: the policy's mean entropy on
    the batch's positions rises with +c and falls with -c. Deterministic (seeded); the margin,
    1e-4 nats, is 100× the float32 noise of the entropy (~1e-6) and a tenth of the effect
    measured when it was written (±1.5e-3 nats around 4.577)."""
    entropies = {}
    for coef in (0.5, 0.0, -0.5):
        over = {"kl.placement": "none", "algo.entropy_coef": coef}
        cfg = build_config(overrides=quick(tiny_model, tmp_path / "e", **over))
        dist, m, rollout, fns = _fixed_batch(cfg)
        s = score(cfg, m, rollout, fns, 0.0)
        opt = Optimizers(torch.optim.SGD(m.policy.parameters(), lr=1.0), None)
        update(
            cfg,
            m,
            s,
            opt,
            kl_term(cfg, beta=0.0, beta_old=1.0),
            dist,
            torch.Generator().manual_seed(0),
        )
        with torch.no_grad():
            head = unwrap(m.backbone).head()
            hidden = completion_hidden(m.backbone, rollout)
            ent = logprobs.fused(
                hidden, head.weight, rollout.completion_ids, bias=head.bias
            ).entropy
        entropies[coef] = float(reduce.masked_mean(ent, rollout.mask))
    assert entropies[0.5] > entropies[0.0] + 1e-4, entropies
    assert entropies[-0.5] < entropies[0.0] - 1e-4, entropies


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_a_kl_in_the_reward_adds_its_returns_to_go_to_the_advantages(
    tiny_model, quick, tmp_path, estimator
):
    """GRPO: advantages with the KL in the reward minus those without equal, at each valid token
    t, sum over valid t' >= t of -beta · est(t'), est from log pi_old and log pi_ref (a loop in
    float64 by hand); zero on padding."""
    beta = 0.3
    got = {}
    for placement in ("reward", "none"):
        over = {"kl.placement": placement, "kl.estimator": estimator}
        cfg = build_config(overrides=quick(tiny_model, tmp_path / "a", **over))
        _dist, m, rollout, fns = _fixed_batch(cfg)
        got[placement] = score(cfg, m, rollout, fns, beta)
    s, mask = got["reward"], rollout.mask
    d = (s.old.logp - s.logp_ref).double()
    est = d if estimator == "k1" else torch.expm1(-d) + d
    want = torch.zeros_like(d)
    for b in range(d.shape[0]):
        run_sum = 0.0
        for t in reversed(range(d.shape[1])):
            if mask[b, t]:
                run_sum += -beta * float(est[b, t])
                want[b, t] = run_sum
    diff = (s.adv - got["none"].adv).double()
    assert float(want.abs().max()) > 1e-3  # the penalty is not trivially small
    torch.testing.assert_close(torch.where(mask, diff, 0.0), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The variants are tables; every check runs before any model loads or any file is written.


def test_every_variant_has_one_table_entry():
    from typing import get_args

    from klpo.train.choices import ENGINES, SAMPLERS
    from klpo.train.config import AlgoConfig, RolloutConfig

    # The config's types are the tables' names, in the tables' order: one list of each.
    assert get_args(AlgoConfig.model_fields["name"].annotation) == tuple(ALGORITHMS)
    assert get_args(AlgoConfig.model_fields["policy_loss"].annotation) == tuple(POLICY_LOSSES)
    assert get_args(RolloutConfig.model_fields["engine"].annotation) == tuple(ENGINES)
    assert get_args(RolloutConfig.model_fields["sampler"].annotation) == tuple(SAMPLERS)
    traits = {
        trait: [a for a, spec in ALGORITHMS.items() if getattr(spec, trait)]
        for trait in ("group", "critic", "whitened")
    }
    assert traits == {
        "group": ["grpo", "rloo"],
        "critic": ["ppo"],
        "whitened": ["ppo", "reinforce++"],
    }
    assert [n for n, spec in POLICY_LOSSES.items() if spec.uses_beta_old] == ["kl-penalty"]
    assert [n for n, spec in POLICY_LOSSES.items() if spec.per_sequence] == ["gspo"]
    assert [e for e in kl.ESTIMATORS if needs_exact_kl(e)] == ["full"]
    assert kl.REF_SAMPLED == ("ref_is", "adaptive_mix")
    assert [e for e, spec in kl.SPECS.items() if spec.mixed] == ["adaptive_mix"]


def test_the_config_reads_the_algorithms_traits():
    """Validation asks the table: a group-based algorithm needs a group, a critic is not sharded."""
    for name, spec in ALGORITHMS.items():
        over = [f"algo.name={name}", "rollout.group_size=1"]
        if spec.group:
            with pytest.raises(ConfigError, match=f"group_size must be >= 2 for {name}"):
                build_config(overrides=over)
        else:
            assert build_config(overrides=over).rollout.group_size == 1
        fsdp = [f"algo.name={name}", "dist.strategy=fsdp"]
        if spec.critic:
            with pytest.raises(ConfigError, match="critic-free algorithm \\(grpo, rloo, reinf"):
                build_config(overrides=fsdp)
        else:
            assert build_config(overrides=fsdp).dist.strategy == "fsdp"


def test_one_placement_type_for_the_library_and_the_config():
    from typing import get_args

    from klpo.train.config import KLConfig

    assert KLConfig.model_fields["placement"].annotation is kl.Placement
    table = {p: (kl.in_reward(p), kl.in_loss(p)) for p in get_args(kl.Placement)}
    assert table == {
        "none": (False, False),
        "reward": (True, False),
        "loss": (False, True),
        "reward+loss": (True, True),
    }
    assert set(kl.PLACEMENTS) == set(get_args(kl.Placement)) - {"none"}
    with pytest.raises(ValueError, match="'none' puts no KL in the reward or the loss"):
        kl.explain("k3", "none")
    with pytest.raises(ValueError, match="unknown placement 'rewards'; choose one of: none, "):
        kl.in_loss("rewards")


def _no_model_loads(monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("a model was loaded before the checks")

    monkeypatch.setattr(models_build, "load_causal_lm", refuse)
    monkeypatch.setattr(models_build, "load_tokenizer", refuse)


def test_preflight_fails_before_any_model_loads_or_file_is_written(
    tiny_model, quick, tmp_path, monkeypatch
):
    _no_model_loads(monkeypatch)
    out = tmp_path / "run"
    cfg = build_config(overrides=quick(tiny_model, out, **{"rollout.prompts_per_step": 3}))
    with monkeypatch.context() as m:  # two processes, as torchrun says (klpo train --check)
        m.setenv("WORLD_SIZE", "2")
        with pytest.raises(ConfigError, match=r"prompts_per_step=3 must be divisible by .* \(2\)"):
            loop.check_run(cfg)
    assert not out.exists()

    # A reference of another vocabulary, and completions longer than the positions: refused
    # from the config files alone.
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    conf = json.loads((other / "config.json").read_text())
    conf["vocab_size"] += 7
    (other / "config.json").write_text(json.dumps(conf))
    cfg = build_config(overrides=quick(tiny_model, out, **{"model.reference": str(other)}))
    with pytest.raises(ConfigError, match=r"model.reference=.*vocabulary of \d+ tokens but "):
        loop.train(cfg, log=print)
    cfg = build_config(overrides=quick(tiny_model, out, **{"teacher.model": str(other)}))
    with pytest.raises(ConfigError, match=r"teacher.model=.*the teacher must share the student's"):
        loop.train(cfg, log=print)
    n = conf["max_position_embeddings"]
    cfg = build_config(overrides=quick(tiny_model, out, **{"rollout.max_new_tokens": n}))
    with pytest.raises(ConfigError, match=rf"rollout.max_new_tokens={n} leaves no room"):
        loop.train(cfg, log=print)
    missing = build_config(overrides=quick(tmp_path / "nowhere", out))
    with pytest.raises(ConfigError, match=r"model.policy '.*nowhere': no such directory"):
        loop.train(missing, log=print)
    assert not out.exists()


def test_whiten_over_ranks_in_a_world_of_one_is_plain_whiten():
    """One process: the same bits as klpo.advantages.whiten (the merge of one shard is itself).
    Two processes are checked against one in tests/train/step/test_step_metrics.py."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen)
    mask = torch.rand(4, 5, generator=gen) > 0.3
    assert torch.equal(whiten_over_ranks(x, mask, Dist()), advantages.whiten(x, mask))


@pytest.mark.parametrize(
    "extra",
    [
        {},  # the default: clip, the exact KL in the loss
        {"algo.policy_loss": "gspo"},
        {"algo.policy_loss": "cispo"},
        {"algo.policy_loss": "kl-penalty"},
        {"algo.policy_loss": "dppo-tv-k2"},
        {"algo.entropy_coef": 0.05, "algo.loss_reduction": "seq-mean-token-mean"},
        {"kl.beta": 0.0},
        {"kl.estimator": "k3"},  # a sampled KL in the loss: the per-token path
    ],
    ids=["default", "gspo", "cispo", "kl-penalty", "dppo-tv-k2", "entropy-seq-mean", "no-kl", "k3"],
)
def test_the_on_policy_fused_loss_gives_the_per_token_gradient(
    tiny_model, quick, tmp_path, monkeypatch, scored_rollout, extra
):
    """On-policy micro-steps whose loss weights are known up front take their gradient in the
    forward pass (klpo.logprobs.fused_loss; by default only with a vocabulary of 32768 or more,
    here forced): the same parameter gradients, metrics and recorded pi_old as the per-token path
    (algo.fused_loss=off), to float32 rounding, over several micro-batches; a sampled KL in the loss
    keeps the per-token path."""
    base = {"kl.beta": 0.5, "algo.micro_batch": 5}
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **{**base, **extra}))
    assert update_gives_logp_old(cfg)
    beta = cfg.kl.beta
    sr = scored_rollout(cfg, beta=beta)
    dist, m, rollout, s = sr.dist, sr.models, sr.rollout, sr.scored
    assert s.adv.abs().max() > 0
    calls = []
    fused_loss = logprobs.fused_loss
    monkeypatch.setattr(
        logprobs, "fused_loss", lambda *a, **k: calls.append(1) or fused_loss(*a, **k)
    )
    n = reduce.normaliser(rollout.mask, cfg.algo.loss_reduction, max_len=cfg.rollout.max_new_tokens)
    micro = [torch.arange(0, 8), torch.arange(8, 16)]

    def step(fast: bool):
        cfg.algo.fused_loss = "on" if fast else "off"  # on: the tiny model's vocabulary too
        sc = sr.fresh()
        m.policy.zero_grad()
        tally, metrics = Tally(), []
        term = kl_term(cfg, beta=beta, beta_old=1.0)
        for rows in micro:
            metrics.append(
                micro_step(
                    cfg, m, MicroBatch.of(cfg, sc, rows, n), term, dist, sync=True, tally=tally
                )
            )
        grads = {k: p.grad.clone() for k, p in m.policy.named_parameters() if p.grad is not None}
        return grads, metrics, tally.result(lambda t: t), sc.old

    fast_grads, fast_metrics, fast_tally, fast_old = step(True)
    assert len(calls) == (0 if extra.get("kl.estimator") == "k3" else 2)
    slow_grads, slow_metrics, slow_tally, slow_old = step(False)
    assert len(calls) in (0, 2)  # the per-token path never calls it
    assert sorted(fast_grads) == sorted(slow_grads)
    for k in slow_grads:
        torch.testing.assert_close(fast_grads[k], slow_grads[k], rtol=1e-4, atol=1e-7, msg=k)
    assert any(g.abs().max() > 0 for g in slow_grads.values())
    for a_, b_ in zip(fast_metrics, slow_metrics, strict=True):
        assert a_.keys() == b_.keys()
        for k in a_:
            assert a_[k] == pytest.approx(b_[k], rel=1e-5, abs=1e-7), k
    assert fast_tally.keys() == slow_tally.keys()
    for k in slow_tally:
        assert fast_tally[k][0] == pytest.approx(slow_tally[k][0], rel=1e-5, abs=1e-7), k
    for name in ("logp", "entropy", "kl"):
        torch.testing.assert_close(getattr(fast_old, name), getattr(slow_old, name), rtol=1e-5,
                                   atol=1e-6)  # fmt: skip


def test_small_vocabularies_keep_the_per_token_path(
    tiny_model, quick, tmp_path, monkeypatch, scored_rollout
):
    """The forward-pass gradient pays only where the head is a large share of the step: with
    algo.fused_loss=auto, below FUSED_LOSS_MIN_VOCAB entries (the tiny model's 40-odd) the update
    keeps the per-token path; with on it takes fused_loss, with off it never does."""
    cfg = build_config(overrides=quick(tiny_model, tmp_path / "run", **{"kl.beta": 0.5}))
    sr = scored_rollout(cfg, beta=0.5)
    m, rollout, s = sr.models, sr.rollout, sr.scored
    calls = []
    fused_loss = logprobs.fused_loss
    monkeypatch.setattr(
        logprobs, "fused_loss", lambda *a, **k: calls.append(1) or fused_loss(*a, **k)
    )
    rows = torch.arange(len(rollout.prompts))
    n = reduce.normaliser(rollout.mask, "token-mean")
    vocab = m.policy.get_output_embeddings().weight.shape[0]
    assert vocab < FUSED_LOSS_MIN_VOCAB
    for mode, want in (("auto", 0), ("off", 0), ("on", 1)):
        calls.clear()
        cfg.algo.fused_loss = mode
        sc = copy.copy(s)
        sc.old = SamplingPass.empty(s.logp_ref)
        micro_step(
            cfg,
            m,
            MicroBatch.of(cfg, sc, rows, n),
            kl_term(cfg, beta=0.5, beta_old=1.0),
            Dist(),
            sync=True,
            tally=Tally(),
        )
        assert len(calls) == want


def test_fused_loss_takes_on_and_off_as_written():
    """``--set algo.fused_loss=on`` (YAML reads an unquoted on / off as a boolean) is the word;
    anything else is refused by name."""
    for word in ("on", "off", "auto", "'on'"):
        cfg = build_config(overrides=[f"algo.fused_loss={word}"])
        assert cfg.algo.fused_loss == word.strip("'")
    with pytest.raises(ConfigError, match=r"algo\.fused_loss"):
        build_config(overrides=["algo.fused_loss=yes please"])


def test_fused_loss_switch_at_the_vocabulary_threshold():
    """algo.fused_loss: auto takes the forward-pass gradient from FUSED_LOSS_MIN_VOCAB entries
    on, on at any vocabulary, off never; none of them where it does not apply."""
    cfg = build_config()
    assert cfg.algo.fused_loss == "auto"  # the default keeps the measured threshold
    edge = FUSED_LOSS_MIN_VOCAB
    table = {}
    for mode in ("auto", "on", "off"):
        cfg.algo.fused_loss = mode
        table[mode] = [takes_fused_loss(cfg, v, applies=True) for v in (101, edge - 1, edge)]
        assert not any(takes_fused_loss(cfg, v, applies=False) for v in (101, edge))
    assert table == {
        "auto": [False, False, True],
        "on": [True, True, True],
        "off": [False, False, False],
    }
