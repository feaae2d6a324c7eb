"""No signal, no step: a batch whose every advantage is exactly 0 does not move the policy, unless
a KL term in the loss has a policy off the reference to pull back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from klpo.train import loop
from klpo.train.config import build_config
from klpo.train.runtime.metrics import read_metrics


def _final_policy(out) -> dict[str, torch.Tensor]:
    step = (out / "checkpoints" / "latest").read_text().strip()
    return load_file(out / "checkpoints" / step / "policy" / "model.safetensors")


def _run(tiny_model, quick, out, **extra):
    overrides = {
        "rewards": "[{name: 'klpo_test_rewards:zeros'}]",
        "run.steps": 4,
        "run.eval_every": 0,
        "kl.estimator": "full",
        "kl.beta": 0.1,
        "optim.lr": 1e-2,
        **extra,
    }
    loop.train(build_config(overrides=quick(tiny_model, out, **overrides)), log=lambda *_: None)
    return read_metrics(out / "metrics.jsonl")


@pytest.mark.parametrize("extra", [{}, {"model.dtype": "bfloat16", "model.lora": "{r: 4}"}])
def test_all_zero_rewards_leave_the_policy_bit_identical(tiny_model, quick, tmp_path, extra):
    # Every reward 0: every group's advantages are exactly 0, so the only gradient is the KL
    # term's at the reference, rounding noise that AdamW would scale up to lr-sized steps (a full
    # fine-tune of a 135M model drifted to an exact KL of 4e-3 per token in four steps). TRL's
    # GRPO stays at the reference there; so does klpo, by skipping those optimizer steps.
    out = tmp_path / "run"
    rows = _run(tiny_model, quick, out, **extra)
    assert [r["step/skipped"] for r in rows] == [1.0, 1.0, 1.0, 1.0]
    assert [r["kl/ref/exact"] for r in rows] == [0.0, 0.0, 0.0, 0.0]
    assert all(r["kl/old/k3"] == 0.0 and r["kl/ref/k3"] == 0.0 for r in rows)
    if "model.lora" in extra:
        return  # the checkpoint holds the adapters; the KL of exactly 0 says they did not move
    start = load_file(tiny_model / "model.safetensors")
    final = _final_policy(out)
    assert final.keys() == start.keys()
    for k in start:
        assert torch.equal(final[k], start[k]), k


def test_skipping_can_be_turned_off_and_a_step_with_signal_is_taken(tiny_model, quick, tmp_path):
    # With the skip off the steps are taken, and still nothing moves: at the reference the exact
    # KL's gradient is exactly 0 (klpo.logprobs), so AdamW's step is 0, as in TRL. (Before, its
    # rounding, a gradient norm of 7e-10, drifted this run to an exact KL of 2e-3 by step 3.)
    out = tmp_path / "off"
    rows = _run(tiny_model, quick, out, **{"algo.skip_no_signal": "false"})
    assert [r["step/skipped"] for r in rows] == [0.0, 0.0, 0.0, 0.0]
    assert [r["grad_norm"] for r in rows] == [0.0, 0.0, 0.0, 0.0]
    assert [r["kl/ref/exact"] for r in rows] == [0.0, 0.0, 0.0, 0.0]
    start, final = load_file(tiny_model / "model.safetensors"), _final_policy(out)
    assert all(torch.equal(final[k], start[k]) for k in start)
    # A reward that varies within groups: steps are taken (and the policy moves off the reference).
    rows = _run(
        tiny_model, quick, tmp_path / "signal", rewards="[{name: 'klpo_test_rewards:digits'}]"
    )
    assert rows[0]["step/skipped"] == 0.0
    assert rows[-1]["kl/ref/exact"] > 0


def test_skipped_steps_advance_the_schedule_and_resume_exactly(tiny_model, quick, tmp_path):
    # A skipped step is a step: the learning-rate schedule (a function of the step number)
    # advances, and a run resumed after skipped steps logs what the whole run logs.
    from klpo.train.runtime.metrics import is_timing

    sched = {"optim.warmup_steps": 3, "run.save_every": 2}  # the warm-up: the step's alone
    whole = _run(tiny_model, quick, tmp_path / "whole", **sched)
    assert [r["step/skipped"] for r in whole] == [1.0, 1.0, 1.0, 1.0]
    lrs = [r["lr"] for r in whole]
    assert lrs[0] < lrs[1] < lrs[2] == lrs[3] == 1e-2  # warmed up step by step, skipped or not
    part = tmp_path / "part"
    _run(tiny_model, quick, part, **sched, **{"run.steps": 2})
    overrides = quick(
        tiny_model, part, rewards="[{name: 'klpo_test_rewards:zeros'}]", **{
            "run.steps": 4, "run.eval_every": 0, "kl.estimator": "full", "kl.beta": 0.1,
            "optim.lr": 1e-2, **sched,
        },
    )  # fmt: skip
    loop.train(build_config(overrides=overrides), log=lambda *_: None, resume=True)

    def rows(run):
        return [{k: v for k, v in r.items() if not is_timing(k)} for r in run]

    assert rows(read_metrics(part / "metrics.jsonl")) == rows(whole)


@pytest.mark.parametrize("estimator", ["full", "k3"])
def test_a_kl_in_the_loss_still_pulls_a_policy_off_the_reference(
    tiny_model, quick, moved, tmp_path, estimator
):
    # Every reward 0, so no advantage signal; the reference is elsewhere, so the KL term in the
    # loss has a real gradient. Oracle: the same run with the skip turned off, step for step and
    # weight for weight; and, for `full`, KL(pi_theta ‖ pi_ref) falls, as the regulariser's pull
    # must make it (k3's gradient is that of KL(pi_ref ‖ pi_theta), which this KL need not follow).
    ref = moved(tiny_model, tmp_path / "ref")
    extra = {"model.reference": str(ref), "kl.estimator": estimator}
    on = _run(tiny_model, quick, tmp_path / "on", **extra)
    off = _run(tiny_model, quick, tmp_path / "off", **extra, **{"algo.skip_no_signal": "false"})
    assert [r["step/skipped"] for r in on] == [0.0, 0.0, 0.0, 0.0]
    assert [r["kl/ref/exact"] for r in on] == [r["kl/ref/exact"] for r in off]
    kls = [r["kl/ref/exact"] for r in on]
    assert kls[0] > 1e-3
    assert kls[-1] < kls[0] or estimator != "full"
    final_on, final_off = _final_policy(tmp_path / "on"), _final_policy(tmp_path / "off")
    assert all(torch.equal(final_on[k], final_off[k]) for k in final_on)
    # No KL in the loss (in the reward at beta 0: none at all): nothing pulls, the steps are
    # skipped and the policy stays where it started.
    none = _run(tiny_model, quick, tmp_path / "none", **{**extra, "kl.placement": "none"})
    assert [r["step/skipped"] for r in none] == [1.0, 1.0, 1.0, 1.0]
    start = load_file(tiny_model / "model.safetensors")
    assert all(torch.equal(_final_policy(tmp_path / "none")[k], start[k]) for k in start)


def test_the_floor_decides_when_the_policy_counts_as_at_the_reference(
    tiny_model, quick, moved, tmp_path
):
    # A floor above the step's exact KL: the policy counts as at the reference, the steps are
    # skipped as with no KL at all.
    ref = moved(tiny_model, tmp_path / "ref")
    rows = _run(
        tiny_model, quick, tmp_path / "high",
        **{"model.reference": str(ref), "algo.skip_kl_floor": 1e6},
    )  # fmt: skip
    assert [r["step/skipped"] for r in rows] == [1.0, 1.0, 1.0, 1.0]
    start, final = load_file(tiny_model / "model.safetensors"), _final_policy(tmp_path / "high")
    assert all(torch.equal(final[k], start[k]) for k in start)  # nothing moved


def test_a_step_to_be_skipped_runs_no_pass_it_can_save(tiny_model, quick, tmp_path, monkeypatch):
    # No KL in the loss, or pi_old's exact KL already scored (several optimizer steps a batch
    # need pi_old before the update): the skip is decided before any pass, and none runs. One
    # optimizer step with the KL in the loss: its forward is what computes pi_old's KL, so it runs.
    from klpo.train.step import update

    calls: list[int] = []
    real = update.micro_step

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(update, "micro_step", counted)
    rows = _run(tiny_model, quick, tmp_path / "none", **{"kl.placement": "none"})
    assert [r["step/skipped"] for r in rows] == [1.0] * 4 and calls == []
    assert all("grad_norm" not in r for r in rows)  # no pass, no gradient to measure
    many = {"algo.epochs": 2, "algo.minibatches": 2}
    rows = _run(tiny_model, quick, tmp_path / "scored", **many)
    assert [r["step/skipped"] for r in rows] == [1.0] * 4 and calls == []
    rows = _run(tiny_model, quick, tmp_path / "one", **{"algo.micro_batch": 100})
    assert [r["step/skipped"] for r in rows] == [1.0] * 4 and len(calls) == 4
