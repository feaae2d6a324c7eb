"""Metrics are API: each key is documented once here, written to ``metrics.jsonl`` and TensorBoard.

Keys are namespaced. Every per-token metric is computed under ``no_grad`` with the loss's mask,
so padding contributes nothing. ``<est>`` stands for the configured estimator's name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from klpo.train.checkpoint import write_text_atomic

METRICS: dict[str, str] = {
    "step": "training step (one batch of rollouts), starting at 1",
    "reward/mean": "mean total (weighted) task reward over the step's completions",
    "reward/std": "standard deviation of the total reward over the step's completions",
    "reward/<name>": "mean of one reward function's value",
    "reward/proxy": "with a gold reward: mean of the trained-on (proxy) total reward, = reward/mean",
    "reward/gold": "mean of the gold reward (gold_reward; exact correctness in builtin-overopt), "
    "logged, never trained on",
    "reward/group_std": "mean over prompts of the reward's standard deviation within each group",
    "reward/skipped": "completions whose reward was not finite and were skipped (counted, never NaN)",
    "accuracy/train": "fraction of the step's completions with the task reward equal to 1",
    "accuracy/heldout": "held-out accuracy, greedy decoding (only on evaluation steps)",
    "kl/ref/<est>": "the configured estimator of KL(pi_theta ‖ pi_ref) per token, mean over tokens",
    "kl/ref/k1": "k1 estimate of KL(pi_theta ‖ pi_ref) per token (unbiased, noisy)",
    "kl/ref/k3": "k3 estimate of KL(pi_theta ‖ pi_ref) per token (unbiased, non-negative)",
    "kl/ref/exact": "the exact full-vocabulary KL(pi_theta ‖ pi_ref) per token, mean over tokens",
    "kl/ref/seq": "exact KL(pi_theta ‖ pi_ref) summed over a completion, mean over completions",
    "kl/old/k1": "k1 estimate of KL(pi_old ‖ pi_theta) per token over the update (PPO's approx KL)",
    "kl/old/k3": "k3 estimate of KL(pi_old ‖ pi_theta) per token over the update",
    "entropy": "mean per-token entropy of pi_theta on the sampled completions (exact, in nats)",
    "clip_frac": "fraction of tokens whose PPO ratio was clipped (low or high)",
    "clip_frac/seq": "GSPO: fraction of sequences whose length-normalised ratio was clipped",
    "ratio/seq_mean": "GSPO: mean over sequences of the length-normalised ratio s_i",
    "reference/updates": "kl.reference_reset: reference updates (resets) so far, after this step",
    "loss/policy": "policy surrogate loss (reduced)",
    "loss/kl": "beta-free KL term of the loss (reduced), when the KL is in the loss",
    "loss/value": "value loss (PPO), reduced",
    "loss/entropy": "entropy bonus term (reduced)",
    "loss/total": "the total loss that was differentiated",
    "beta": "the KL coefficient used this step (after the controller's last update)",
    "grad_norm": "global gradient norm of the policy before clipping",
    "lr": "the policy's learning rate this step",
    "completion/length": "mean completion length in tokens (EOS included)",
    "completion/truncated": "fraction of completions that hit max_new_tokens without EOS",
    "time/generate": "seconds spent sampling completions",
    "time/score": "seconds spent on rewards and the old/reference log-probs",
    "time/update": "seconds spent in forward, backward and optimizer steps",
    "time/step": "wall seconds of the whole step",
    "tokens_per_s": "completion tokens sampled and trained on per second of step time",
}


def describe(key: str) -> str:
    """The documentation of a metric key (namespaced families match their ``<...>`` entry)."""
    if key in METRICS:
        return METRICS[key]
    head = key.rsplit("/", 1)[0]
    for k, text in METRICS.items():
        if k.endswith(">") and k.rsplit("/", 1)[0] == head:
            return text
    raise KeyError(f"undocumented metric {key!r}; document it in klpo.train.metrics.METRICS")


def is_timing(key: str) -> bool:
    """Keys that measure wall time and so differ between otherwise identical runs."""
    return key.startswith("time/") or key == "tokens_per_s"


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    On resume (``resume_step`` > 0) lines of steps after the checkpoint are dropped first, so the
    file of a resumed run reads as if the run had never stopped.
    """

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume_step: int = 0):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step > 0 and self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        elif resume_step == 0 and self.path.exists():
            self.path.unlink()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(Path(run_dir) / "tensorboard"),
                purge_step=resume_step + 1 if resume_step else None,
            )

    def write(self, step: int, values: dict[str, Any]) -> None:
        for key in values:
            describe(key)  # every key is documented, or this is a bug
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan; keep them visible rather than dropping them
    return v


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; a torn last line (a run killed mid-write) is ignored."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
