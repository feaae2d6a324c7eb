"""What a run leaves for its reader: completions (samples.jsonl, report.md), the trackers of
run.report_to, the learning-rate schedule, and only the newest run.save_total_limit checkpoints."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from klpo.train import loop
from klpo.train.config import ConfigError, build_config
from klpo.train.runtime import trackers
from klpo.train.runtime.checkpoint import prune_checkpoints
from klpo.train.runtime.metrics import read_metrics
from klpo.train.runtime.samples import read_samples
from klpo.train.setup import advance_lr, make_lr_scheduler, restore_lr_scheduler
from klpo.train.step.sample_records import sequence_kls
from klpo.train.step.types import Optimizers

FIELDS = {"step", "split", "index", "prompt", "completion", "answer", "reward", "rewards", "kl",
          "length", "truncated"}  # fmt: skip


def _digits(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def test_samples_jsonl_and_report(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    cfg = build_config(
        overrides=quick(tiny_model, out, **{"run.log_samples": 3, "run.log_samples_every": 2})
    )
    loop.train(cfg, log=lambda *_: None)
    records = read_samples(out / "samples.jsonl")
    where = [(r["step"], r["split"]) for r in records]
    # train: every 2 steps and the last; eval: step 0 and every evaluation (eval_every 2, last)
    assert (
        where
        == [(0, "eval")] * 3
        + [(2, "train")] * 3
        + [(2, "eval")] * 3
        + [(3, "train")] * 3
        + [(3, "eval")] * 3
    )
    for r in records:
        assert set(r) == FIELDS, r
        assert set(r["kl"]) >= {"exact", "k1", "k3"}
        assert 1 <= r["length"] <= cfg.rollout.max_new_tokens
        if r["split"] == "train":  # the reward recomputed from the text: digits' fraction
            assert r["rewards"] == {"klpo_test_rewards:digits": pytest.approx(_digits(r["completion"]))}  # fmt: skip
            assert r["reward"] == pytest.approx(_digits(r["completion"]))
        assert r["kl"]["exact"] >= -1e-6  # a KL
    # At step 0 the policy is the reference: every sequence KL is 0.
    for r in records[:3]:
        assert all(abs(v) < 1e-5 for v in r["kl"].values()), r["kl"]
    # Trained with lr 1e-2, the policy has moved by step 2.
    assert any(r["kl"]["exact"] > 1e-4 for r in records if r["step"] == 2)
    report = (out / "report.md").read_text()
    assert "## Latest training (sampled) completions, step 3" in report
    assert "## Latest held-out (greedy) completions, step 3" in report
    assert "| prompt | completion | answer | reward |" in report


def test_sequence_kls_by_hand():
    """Each completion's sums over its tokens: exact, k1 = log p - log q, k3 = e^-r - 1 + r with
    r = log p - log q (arXiv:2402.03300's k3), in float64 by hand."""
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    logp_ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -0.9, -1.0]])
    exact = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cfg = build_config(overrides=["kl.estimator=k3"])
    got = sequence_kls(cfg, logp, logp_ref, exact, mask)
    rows = [[(-1.0, -1.5), (-2.0, -1.0), (-0.5, -0.5)], [(-0.3, -0.2), (-0.7, -0.9)]]
    k1 = [sum(p - q for p, q in row) for row in rows]
    k3 = [sum(math.exp(q - p) - 1 - (q - p) for p, q in row) for row in rows]
    assert got["exact"].tolist() == pytest.approx([0.6, 0.9])
    assert got["k1"].tolist() == pytest.approx(k1)
    assert got["k3"].tolist() == pytest.approx(k3, rel=1e-6)


class _Recorder:
    """A tracker that keeps what it is sent."""

    opened: list[_Recorder] = []  # noqa: RUF012

    def __init__(self, info):
        self.info, self.steps, self.tables = info, {}, []
        _Recorder.opened.append(self)

    def scalars(self, step, values):
        self.steps[step] = dict(values)

    def samples(self, step, split, records, table):
        self.tables.append((step, split, len(records), table))

    def close(self):
        self.closed = True


def _tensorboard(path) -> tuple[dict[int, dict[str, float]], dict[str, list[int]]]:
    """The event files' scalars ``{step: {tag: value}}`` and text panels ``{tag: steps}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            scalars.setdefault(e.step, {})[tag] = e.value
    texts = {t: [e.step for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}
    return scalars, texts


def test_a_tracker_gets_what_tensorboard_and_metrics_jsonl_get(
    tiny_model, quick, tmp_path, monkeypatch
):
    """A tracker in run.report_to (here a recorder in wandb's row) is sent every step's scalars,
    the same as TensorBoard's event files and metrics.jsonl, the run's config and the samples."""
    _Recorder.opened.clear()
    monkeypatch.setitem(trackers.TRACKERS, "wandb", trackers.TrackerSpec(_Recorder))
    out = tmp_path / "run"
    cfg = build_config(
        overrides=quick(
            tiny_model, out,
            **{"run.report_to": "[tensorboard, wandb]", "run.tensorboard": True,
               "run.log_samples_every": 1, "run.run_name": "mine"},
        )
    )  # fmt: skip
    loop.train(cfg, log=lambda *_: None)
    (rec,) = _Recorder.opened
    assert rec.closed and rec.info.name == "mine" and rec.info.config["optim.lr"] == 0.01
    jsonl = {
        r["step"]: {k: v for k, v in r.items() if k != "step" and isinstance(v, float | int)}
        for r in read_metrics(out / "metrics.jsonl")
    }
    board, texts = _tensorboard(out / "tensorboard")
    # the completions, as Markdown tables in TensorBoard's Text tab
    assert texts == {
        "samples/train/text_summary": [1, 2, 3],
        "samples/eval/text_summary": [0, 2, 3],
    }
    assert sorted(rec.steps) == sorted(jsonl) == sorted(board) == [0, 1, 2, 3]
    for step, values in rec.steps.items():
        assert values == pytest.approx(jsonl[step]), step
        assert set(values) == set(board[step])
        assert [board[step][k] for k in values] == pytest.approx(list(values.values()), rel=1e-6)
    assert {(s, split) for s, split, _, _ in rec.tables} >= {(1, "train"), (3, "eval")}
    assert all("| prompt | completion |" in t for *_, t in rec.tables)


def test_a_tracker_that_is_not_installed_is_named_before_the_run(tmp_path, monkeypatch):
    from klpo.train.preflight import check_rewards_and_trackers

    monkeypatch.setitem(
        trackers.TRACKERS, "mlflow", trackers.TrackerSpec(_Recorder, "klpo_no_such_module", "mlflow")
    )  # fmt: skip
    cfg = build_config(overrides=["run.report_to=[tensorboard, mlflow]"])
    with pytest.raises(ConfigError, match=r"from the klpo checkout: pip install -e '\.\[mlflow\]'"):
        check_rewards_and_trackers(cfg, [])
    with pytest.raises(ConfigError, match=r"report_to"):
        build_config(overrides=["run.report_to=[neptune]"])


def test_mlflow_keys():
    assert trackers.mlflow_key("kl/ref/k3+") == "kl/ref/k3_"
    assert trackers.mlflow_key("time/generate") == "time/generate"


def _closed_form(name: str, s: int, lr: float, w: int, n: int) -> float:
    """The schedules' textbook formulas (warm-up s/w, then the decay over n - w steps)."""
    if s < w:
        return lr * s / w
    progress = (s - w) / (n - w)
    return (
        lr
        * {
            "constant_with_warmup": 1.0,
            "linear": max(0.0, 1 - progress),
            "cosine": max(0.0, 0.5 * (1 + math.cos(math.pi * progress))),
        }[name]
    )


@pytest.mark.parametrize("name", ["constant_with_warmup", "linear", "cosine"])
def test_the_lr_schedule_follows_its_formula(name):
    """Step s (1-based, the schedule advanced before it) runs at the formula's value at s."""
    cfg = build_config(
        overrides=[f"optim.lr_scheduler={name}", "optim.lr=0.1", "optim.warmup_steps=3",
                   "run.steps=10"]
    )  # fmt: skip
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = make_lr_scheduler(cfg, opt)
    got = [advance_lr(Optimizers(opt, None, sched)) for _ in range(10)]
    assert got == pytest.approx([_closed_form(name, s, 0.1, 3, 10) for s in range(1, 11)])
    assert got[:3] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1])  # the old linear warm-up


def test_the_lr_schedule_resumes_where_it_stood():
    cfg = build_config(overrides=["optim.lr_scheduler=cosine", "optim.lr=0.1", "run.steps=8"])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    first = Optimizers(opt, None, make_lr_scheduler(cfg, opt))
    whole = [advance_lr(first) for _ in range(8)]
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    part = Optimizers(opt2, None, make_lr_scheduler(cfg, opt2))
    [advance_lr(part) for _ in range(3)]
    saved = part.lr_scheduler.state_dict()
    opt3 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    resumed = Optimizers(opt3, None, make_lr_scheduler(cfg, opt3))
    restore_lr_scheduler(resumed.lr_scheduler, saved, 3)
    assert [advance_lr(resumed) for _ in range(5)] == pytest.approx(whole[3:])


def test_a_run_logs_its_schedule(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    extra = {"optim.lr_scheduler": "linear", "optim.warmup_steps": 1, "run.eval_every": 0}
    loop.train(build_config(overrides=quick(tiny_model, out, **extra)), log=lambda *_: None)
    lrs = [r["lr"] for r in read_metrics(out / "metrics.jsonl") if "lr" in r]
    assert lrs == pytest.approx([_closed_form("linear", s, 1e-2, 1, 3) for s in (1, 2, 3)])


def test_save_total_limit_keeps_the_newest(tiny_model, quick, tmp_path):
    out = tmp_path / "run"
    extra = {"run.steps": 4, "run.save_every": 1, "run.save_total_limit": 2, "run.eval_every": 0}
    loop.train(build_config(overrides=quick(tiny_model, out, **extra)), log=lambda *_: None)
    root = out / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    # Pruning after step 4 with a limit of 1: a later checkpoint (left by an earlier attempt)
    # and an incomplete one are never candidates; the one of step 4 stays.
    shutil.copytree(root / "step_000003", root / "step_000009")
    (root / "step_000001").mkdir()
    gone = prune_checkpoints(out, 4, keep=1)
    assert [p.name for p in gone] == ["step_000003"]
    left = sorted(p.name for p in root.glob("step_*"))
    assert left == ["step_000001", "step_000004", "step_000009"]
    with pytest.raises(ValueError, match="at least 1"):
        prune_checkpoints(out, 4, keep=0)


def test_a_resume_drops_the_samples_after_its_checkpoint(tmp_path):
    from klpo.train.runtime.metrics import MetricsWriter

    lines = [json.dumps({"step": s, "split": "train", "prompt": f"p{s}"}) for s in range(1, 6)]
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(lines) + '\n{"step": 6, "spl')  # a torn last line
    assert [r["step"] for r in read_samples(path)] == [1, 2, 3, 4, 5]
    MetricsWriter(tmp_path, resume_step=3, report_to=[]).close()
    assert [r["step"] for r in read_samples(path)] == [1, 2, 3]
    MetricsWriter(tmp_path, resume_step=0, report_to=[]).close()
    assert not path.exists()


def test_a_resumed_run_continues_its_schedule(tiny_model, quick, tmp_path):
    """Resumed from its step-2 checkpoint, a cosine run trains steps 3 and 4 at the learning
    rates, and to the rewards, of the run that never stopped."""
    out = tmp_path / "run"
    extra = {"optim.lr_scheduler": "cosine", "optim.warmup_steps": 1, "run.steps": 4,
             "run.save_every": 2, "run.eval_every": 0}  # fmt: skip
    cfg = build_config(overrides=quick(tiny_model, out, **extra))
    loop.train(cfg, log=lambda *_: None)
    whole = read_metrics(out / "metrics.jsonl")
    root = out / "checkpoints"
    shutil.rmtree(root / "step_000004")
    (root / "latest").write_text("step_000002\n")
    loop.train(cfg, resume=True, log=lambda *_: None)
    again = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    want = [_closed_form("cosine", s, 1e-2, 1, 4) for s in (1, 2, 3, 4)]
    assert [r["lr"] for r in whole] == [r["lr"] for r in again] == pytest.approx(want)
    assert [r["reward/mean"] for r in again] == pytest.approx([r["reward/mean"] for r in whole])
