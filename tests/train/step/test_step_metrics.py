"""The step's metrics do not depend on how the batch is split, and each is documented and emitted.

Every logged metric is a ratio of sums over micro-batches and ranks (:class:`klpo.train.runtime.metrics.Tally`),
so ``algo.micro_batch`` and the number of ``torchrun`` processes change none of them; the
documentation table (``klpo.train.runtime.metrics.METRICS``, rendered as docs/metrics.md) lists exactly the
keys some configuration emits.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from klpo import losses
from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.metrics import METRICS, Tally, is_timing, read_metrics
from klpo.train.step.kl_term import kl_term
from klpo.train.step.step_metrics import finish_metrics, step_metrics
from klpo.train.step.types import Optimizers
from klpo.train.step.update import update

HERE = Path(__file__).resolve().parents[1]  # tests/train: the scripts and helpers it shares
SRC = HERE.parents[1] / "src"


def _split(n: int, parts: int, gen: torch.Generator) -> list[torch.Tensor]:
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: parts - 1].add(1).tolist())
    return list(torch.arange(n).tensor_split(cuts))


def _ranks(tallies: list[Tally]):
    """An ``all_sum`` over fake ranks: each call returns the sum of every tally's table."""

    def table(t: Tally) -> torch.Tensor:  # the table Tally.result hands its all_sum
        got: list[torch.Tensor] = []
        t.result(lambda x: got.append(x.clone()) or x)
        return got[0] if got else torch.zeros(2, 0, dtype=torch.float64)

    def all_sum(_: torch.Tensor) -> torch.Tensor:
        return torch.stack([table(t) for t in tallies]).double().sum(0)

    return all_sum


def test_tally_of_any_split_is_the_whole_mean():
    """Token means, sequence means and losses over arbitrary splits into 'ranks' and
    'micro-batches' equal the whole batch's, computed naively in float64."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(12, 7, generator=gen) < 0.6
    want = float(x[mask].mean())
    for parts in (1, 2, 3, 5):
        tallies = []
        for rows in _split(12, parts, gen):
            t = Tally()
            for micro in _split(len(rows), 2, gen) if len(rows) > 1 else [torch.arange(len(rows))]:
                r = rows[micro]
                m = mask[r]
                t.add_means({"mean": float(x[r][m].mean()) if m.any() else 0.0}, float(m.sum()))
            tallies.append(t)
        res = tallies[0].result(_ranks(tallies))
        assert res["mean"][0] == pytest.approx(want, rel=1e-12)
        assert res["mean"][1] == float(mask.sum())
    empty = Tally()
    empty.add("nothing", 0.0, 0.0)
    assert empty.result(lambda t: t) == {"nothing": (0.0, 0.0)}


def test_pooled_std_and_explained_variance_match_the_whole_batch():
    """reward/std (Bessel-corrected) and value/explained_var from per-part moments equal
    torch.std and losses.value_metrics on the whole batch."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(16, generator=gen) * 3 + 1
    values = torch.randn(16, 5, generator=gen, dtype=torch.float64)
    returns = values + 0.5 * torch.randn(16, 5, generator=gen, dtype=torch.float64) + 0.3
    mask = torch.rand(16, 5, generator=gen) < 0.7
    tallies = []
    for rows in _split(16, 3, gen):
        t = Tally()
        x = scores[rows].double()
        t.add("reward/mean", float(x.sum()), len(rows))
        t.add("_reward/sq", float((x * x).sum()), len(rows))
        r, e, m = returns[rows], returns[rows] - values[rows], mask[rows]
        for key, v in (("r", r), ("r2", r * r), ("e", e), ("e2", e * e)):
            t.add(f"_value/{key}", float(v[m].sum()), float(m.sum()))
        tallies.append(t)

    class FakeDist:
        all_sum = staticmethod(_ranks(tallies))

    out = finish_metrics(tallies[0], FakeDist())
    assert out["reward/std"] == pytest.approx(float(scores.double().std()), rel=1e-10)
    want = losses.value_metrics(values, values, returns, mask)["value/explained_var"]
    assert out["value/explained_var"] == pytest.approx(want, rel=1e-9)
    assert not any(k.startswith("_") for k in out)


SPLITS = {
    # one epoch, one minibatch: the update's pass gives log pi_old; exact KL and entropy in the loss
    "on-policy": ({"algo.entropy_coef": 0.01}, 16),
    # PPO, 2 epochs × 2 minibatches, KL in the reward and in the loss, kl-penalty surrogate
    "ppo": (
        {
            "algo.name": "ppo",
            "algo.epochs": 2,
            "algo.minibatches": 2,
            "kl.placement": "reward+loss",
            "kl.estimator": "k3",
            "algo.entropy_coef": 0.01,
            "algo.policy_loss": "kl-penalty",
            "algo.penalty_target": 0.01,
        },
        8,
    ),
    # the term on the reference's completions, once per optimizer step, and the mix's a·k1 part
    "adaptive_mix": ({"kl.estimator": "adaptive_mix", "algo.minibatches": 2}, 8),
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_every_metric_is_the_same_at_any_micro_batch(tiny_model, quick, tmp_path, name):
    """micro_batch = the whole minibatch, half, quarter: every logged metric of the step agrees
    to float32 rounding (before the fix the losses were 1/(micro-batches) too small)."""
    extra, minibatch = SPLITS[name]
    rows = {}
    for micro in (minibatch, minibatch // 2, minibatch // 4):
        over = {**extra, "algo.micro_batch": micro, "run.steps": 1, "run.eval_every": 0}
        cfg = build_config(overrides=quick(tiny_model, tmp_path / f"m{micro}", **over))
        loop.train(cfg, log=lambda *_: None)
        (row,) = read_metrics(tmp_path / f"m{micro}" / "metrics.jsonl")
        rows[micro] = {k: v for k, v in row.items() if not is_timing(k)}
    whole = rows[minibatch]
    assert whole["loss/policy"] != 0.0 and whole["loss/total"] != 0.0
    for micro, row in rows.items():
        assert set(row) == set(whole), micro
        for key, v in whole.items():
            assert row[key] == pytest.approx(v, rel=2e-5, abs=1e-6), (micro, key)


def _env() -> dict[str, str]:
    import os

    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


@pytest.mark.slow
def test_every_metric_is_the_same_for_one_and_two_processes(tiny_model, tmp_path):
    """torchrun with 1 and 2 processes, one fixed batch (each rank holds half the groups), two
    epochs: every metric of the step and every parameter after it agree. ``off-policy``: GRPO
    with the KL in the reward and the loss; ``ppo`` and ``reinforce++`` whiten their advantages
    over the whole batch (every rank's statistics merged), so their gradients are the whole
    batch's too. The on-policy variant is checked in tests/train/runtime/test_resume_ddp.py."""
    variants = ["off-policy", "ppo", "reinforce++"]
    script = str(HERE / "ddp_update_script.py")
    for n in (1, 2):
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={n}", script, str(tiny_model),
            str(tmp_path / f"world{n}.safetensors"), ",".join(variants),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    before = load_file(str(tiny_model / "model.safetensors"))
    for variant in variants:
        out = {n: tmp_path / f"world{n}-{variant}.safetensors" for n in (1, 2)}
        got = {n: json.loads(out[n].with_suffix(".json").read_text()) for n in (1, 2)}
        assert set(got[1]) == set(got[2]), variant
        assert got[1]["entropy"] > 0 and got[1]["kl/ref/k3"] > 0, variant
        for key, v in got[1].items():
            assert got[2][key] == pytest.approx(v, rel=2e-5, abs=1e-6), (variant, key)
        one, two = load_file(str(out[1])), load_file(str(out[2]))
        assert any(not torch.equal(one[k], before[k]) for k in before), variant
        assert ("critic.value_head.weight" in one) == (variant == "ppo")
        for k in one:
            torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6, msg=(variant, k))


# Configurations that together emit every documented metric.
COVERAGE = [
    {
        "kl.estimator": "k2",
        "kl.placement": "reward+loss",
        "algo.entropy_coef": 0.01,
        "rollout.dynamic_sampling": "true",  # rollout/*
    },
    {
        "algo.name": "ppo",
        "algo.epochs": 2,
        "algo.policy_loss": "kl-penalty",
        "algo.penalty_target": 0.01,
    },
    # An engine that reports its own log-probs (engine/*): the perturbed stand-in for vLLM.
    {"rollout.engine": "vllm", "algo.trm_delta": 0.05},  # TRM on the engine's log-probs too
    {
        "data.source": "builtin-overopt",
        "algo.policy_loss": "gspo",
        "kl.reference_reset": "{every: 1}",
    },
    {"kl.estimator": "adaptive_mix"},  # ref_is's metrics too
    # rollout/staleness, sampler/* (masked_frac: both masks), m2po/*, trm/*
    {"rollout.staleness": 1, "algo.policy_loss": "m2po", "algo.trm_delta": 0.05},
    # kl/teacher/*, loss/teacher: a teacher (the tiny model itself) in the loss
    {"teacher": "{model: TINY, estimator: k3, placement: loss}"},
]


def _entry(key: str) -> str:
    """The documentation entry a key falls under: itself, or its ``<...>`` family."""
    if key in METRICS:
        return key
    head = key.rsplit("/", 1)[0]
    family = [k for k in METRICS if k.endswith(">") and k.rsplit("/", 1)[0] == head]
    assert family, f"metric {key!r} is emitted but not documented in METRICS"
    return family[0]


def test_every_documented_metric_is_emitted_and_none_undocumented(
    tiny_model, quick, tmp_path, monkeypatch
):
    from klpo.train.rollout import engines

    fake = importlib.import_module("klpo_fake_engine")
    monkeypatch.setitem(engines.ENGINES, "vllm", fake.spec(0.1))
    emitted: set[str] = set()
    for i, extra in enumerate(COVERAGE):
        extra = {k: str(v).replace("TINY", str(tiny_model)) for k, v in extra.items()}
        over = {**extra, "run.steps": 1, "run.eval_every": 1}
        loop.train(build_config(overrides=quick(tiny_model, tmp_path / str(i), **over)), log=print)
        for row in read_metrics(tmp_path / str(i) / "metrics.jsonl"):
            emitted |= set(row)
    entries = {_entry(k) for k in emitted}
    assert entries == set(METRICS), {
        "documented, never emitted": sorted(set(METRICS) - entries),
        "emitted, undocumented": sorted(entries - set(METRICS)),
    }
    assert {
        "reward/klpo_test_rewards:digits",
        "kl/ref/k2",
        "value/explained_var",
        "beta_old",
        "engine/k3_max",
    } <= emitted
    page = (HERE.parents[1] / "docs" / "metrics.md").read_text()
    for key in METRICS:
        assert f"| `{key}` |" in page, key


def test_kl_ref_of_the_configured_estimator_is_its_own_value(
    tiny_model, quick, tmp_path, scored_rollout
):
    """kl/ref/<est> is the estimator's mean value on the rollout: for kl_ref_theta an estimate
    of KL(pi_ref ‖ pi_theta), r log r - (r - 1) with r = pi_ref / pi_theta, by hand."""
    cfg = build_config(
        overrides=quick(tiny_model, tmp_path / "r", **{"kl.estimator": "kl_ref_theta"})
    )
    sr = scored_rollout(cfg, beta=0.1)
    dist, m, rollout, s = sr.dist, sr.models, sr.rollout, sr.scored
    opt = Optimizers(torch.optim.SGD(m.policy.parameters(), lr=0.0), None)
    upd = update(
        cfg, m, s, opt, kl_term(cfg, beta=0.1, beta_old=1.0), dist, torch.Generator().manual_seed(0)
    )
    metrics = step_metrics(cfg, s, upd, dist)
    d = (s.logp_ref - s.old.logp).double()[rollout.mask]
    want = float((d.exp() * d - (d.exp() - 1)).mean())  # r log r - (r - 1), r = pi_ref/pi
    assert metrics["kl/ref/kl_ref_theta"] == pytest.approx(want, rel=1e-5)
    k1 = float((-d).mean())
    assert metrics["kl/ref/k1"] == pytest.approx(k1, rel=1e-5, abs=1e-7)
    assert math.isfinite(metrics["reward/std"])
