"""Metrics are API: each key is documented once here, written to ``metrics.jsonl`` and the trackers.

Keys are namespaced. Every per-token metric is computed under ``no_grad`` with the loss's mask,
so padding contributes nothing. ``<est>`` stands for the configured estimator's name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from klpo._io import write_text_atomic

CONTROLLED_KL = {"token": "kl/ref/exact", "sequence": "kl/ref/seq"}
"""The logged exact KL that a controller steers to ``kl.target``, by ``kl.target_unit``."""

METRICS: dict[str, str] = {
    "step": "training step (one batch of rollouts), starting at 1",
    "reward/mean": "mean total (weighted) task reward over the step's completions (those some "
    "reward function scored)",
    "reward/std": "sample standard deviation of the total reward over the step's (scored) "
    "completions",
    "reward/<name>": "mean of one reward function's value over the completions it scored (0 if "
    "it scored none this step)",
    "reward/proxy": "with a gold reward: mean of the trained-on (proxy) total reward, = reward/mean",
    "reward/gold": "mean of the gold reward (gold_reward; exact correctness in builtin-overopt), "
    "logged, never trained on",
    "reward/group_std": "mean over prompts of the reward's standard deviation within each group",
    "reward/unscored": "fraction of the step's completions that no reward function scored (every "
    "one returned None); they are left out of the other reward metrics and of every baseline, "
    "and get no task advantage (docs/rewards.md)",
    "accuracy/train": "fraction of the step's completions whose total (weighted) reward is at "
    "least 1; with the default single exact_match reward, the fraction answered correctly",
    "accuracy/heldout": "held-out accuracy, greedy decoding (only on evaluation steps)",
    "kl/ref/<est>": "the configured estimator's per-token value on the sampled tokens, mean over "
    "tokens: an estimate of the KL in its 'estimates' column of docs/estimators.md, "
    "KL(pi_theta ‖ pi_ref) for most, KL(pi_ref ‖ pi_theta) for kl_ref_theta",
    "kl/ref/k1": "k1 estimate of KL(pi_theta ‖ pi_ref) per token (unbiased, noisy)",
    "kl/ref/k3": "k3 estimate of KL(pi_theta ‖ pi_ref) per token (unbiased, non-negative)",
    "kl/ref/exact": "the exact full-vocabulary KL(pi_theta ‖ pi_ref) per token, mean over tokens",
    "kl/ref/seq": "exact KL(pi_theta ‖ pi_ref) summed over a completion, mean over completions",
    "kl/teacher/exact": "with a teacher: the exact full-vocabulary KL(pi_theta ‖ pi_T) per token at "
    "the sampling parameters (reverse), mean over tokens; never mixed with kl/ref/*",
    "kl/teacher/forward": "with a teacher: the exact KL(pi_T ‖ pi_theta) per token (forward), mean "
    "over tokens (heads without a logit transform)",
    "kl/teacher/<estimator>": "with a teacher and a sampled teacher.estimator: its estimate on the "
    "student's sampled tokens, the teacher in the reference's place, mean over tokens",
    "loss/teacher": "with teacher.placement loss: the beta-free teacher term of the loss (reduced "
    "like the policy loss)",
    "kl/ref/ref_is": "ref_is, adaptive_mix: the ref_is estimate (completions of pi_ref) of "
    "KL(pi_theta ‖ pi_ref) per completion divided by the policy's mean completion length, at the "
    "sampling policy (first optimizer step)",
    "kl/ref/ref_is_seq": "ref_is, adaptive_mix: the ref_is estimate of KL(pi_theta ‖ pi_ref) per "
    "completion (nats per sequence)",
    "kl/ref/adaptive_mix": "adaptive_mix: its output a · kl/ref/k1 + (1 - a) · kl/ref/ref_is, per "
    "token; the value its window averages",
    "ref/samples": "ref_is, adaptive_mix: completions sampled from the reference this step (all ranks)",
    "ref/max_weight": "ref_is, adaptive_mix: the largest importance weight pi_theta/pi_ref over "
    "the reference's completions (first optimizer step)",
    "ref/ess": "ref_is, adaptive_mix: Kish's effective sample size of those weights as a fraction "
    "of their number, (sum w)² / (n sum w²), in (0, 1]",
    "ref/mix_weight": "adaptive_mix: the weight a on k1 this step, from past steps only",
    "ref/kl_window": "adaptive_mix: KL_window, the mean of its last kl.mix_window outputs (0 when empty)",
    "loss/kl_ref": "ref_is, adaptive_mix: the beta-free ref_is term in the loss's units (before "
    "the factor 1 - a), first optimizer step",
    "kl/old/k1": "k1 estimate of KL(pi_old ‖ pi_theta) per token over the update (PPO's approx KL)",
    "kl/old/k3": "k3 estimate of KL(pi_old ‖ pi_theta) per token over the update",
    "entropy": "mean per-token entropy of pi_theta on the sampled completions (exact, in nats)",
    "clip_frac": "fraction of the update's tokens whose PPO ratio was clipped (low or high)",
    "clip_frac/seq": "GSPO: fraction of sequences whose length-normalised ratio was clipped",
    "ratio/seq_mean": "GSPO: mean over sequences of the length-normalised ratio s_i",
    "reference/updates": "kl.reference_reset: reference updates (resets) so far, after this step",
    "loss/policy": "policy surrogate loss (reduced), mean over the step's optimizer steps",
    "loss/kl": "beta-free KL term of the loss (reduced), when the KL is in the loss (adaptive_mix: "
    "its a · k1 part; ref_is: absent, see loss/kl_ref)",
    "loss/value": "value loss (PPO), reduced",
    "loss/entropy": "entropy bonus term (reduced; minus the entropy, so lower is more entropy)",
    "loss/total": "the total loss that was differentiated (policy, beta·KL, entropy, vf_coef·value)",
    "value/clip_frac": "PPO: fraction of the update's tokens where the clipped value loss was larger",
    "value/explained_var": "PPO: 1 - Var(R - V) / Var(R) over all the update's tokens (1: a "
    "perfect critic, 0: no better than a constant)",
    "value/mean": "PPO: mean value prediction V over the update's tokens",
    "value/mse": "PPO: mean of (V - R)² over the update's tokens",
    "beta": "the KL coefficient used this step (after the controller's last update)",
    "beta_old": "kl-penalty: PPO's penalty coefficient beta_old used this step (its adaptive rule "
    "then moves it by the step's kl/old/k3)",
    "grad_norm": "global gradient norm of the policy before clipping, mean over optimizer steps "
    "(on a skipped step that ran its passes, the norm of the gradient that was not applied; "
    "absent where the skip was decided before them)",
    "step/skipped": "1 when the step's optimizer steps were skipped because its batch had no "
    "advantage signal (algo.skip_no_signal: every advantage exactly 0) and its KL term nothing "
    "to pull back (none in the loss, or the policy at the reference: algo.skip_kl_floor), else 0; "
    "where that is known before the update (no KL in the loss, or pi_old's KL already scored) "
    "none of its passes runs and the step logs no loss or gradient metrics",
    "rollout/dynamic_rounds": "rollout.dynamic_sampling: sampling rounds this step, each of "
    "rollout.prompts_per_step prompts (1: none extra)",
    "rollout/groups_kept": "rollout.dynamic_sampling: groups with unequal rewards the step "
    "trained on (0: none, so it trained on the first round's batch, which has no signal)",
    "rollout/groups_dropped": "rollout.dynamic_sampling: groups dropped over the step's rounds "
    "because their rewards were all equal",
    "rollout/extra_completions": "rollout.dynamic_sampling: completions sampled beyond one "
    "round, (rounds - 1) · prompts_per_step · group_size",
    "lr": "the policy's learning rate this step",
    "completion/length": "mean completion length in tokens (its stop token included)",
    "completion/truncated": "fraction of completions that hit max_new_tokens without a stop token",
    "time/generate": "seconds spent sampling completions",
    "time/score": "seconds spent on rewards and the old/reference log-probs",
    "time/update": "seconds spent in forward, backward and optimizer steps",
    "time/ref_sample": "ref_is, adaptive_mix: seconds spent sampling the reference's completions "
    "and scoring them under pi_ref",
    "time/ref_update": "ref_is, adaptive_mix: seconds spent on the forward and backward passes of "
    "the policy over the reference's completions (all optimizer steps; inside time/update)",
    "time/step": "wall seconds of the whole step",
    "time/cpu": "CPU seconds the process has used since it started, its loading included (all "
    "threads; what a busy machine's other processes do not add)",
    "engine/k1": "rollout.engine=vllm: k1 estimate of KL(pi_engine ‖ pi_old) per token, the mean "
    "of log pi_engine - log pi_old over the sampled tokens (the engine's log-probs against the "
    "trainer's at the same weights; docs/engines.md)",
    "engine/k3": "rollout.engine=vllm: k3 estimate of KL(pi_engine ‖ pi_old) per token "
    "(rho - 1 - log rho, rho = pi_old / pi_engine; non-negative)",
    "engine/k3_max": "rollout.engine=vllm: the largest per-token k3 of the step",
    "engine/abs_max": "rollout.engine=vllm: the largest |log pi_engine - log pi_old| of the step",
    "engine/tis_weight": "rollout.engine=vllm: mean truncated importance weight "
    "min(pi_old / pi_engine, rollout.tis_cap) on the policy loss (1: no gap)",
    "engine/tis_clip_frac": "rollout.engine=vllm: fraction of tokens whose ratio pi_old / "
    "pi_engine exceeds rollout.tis_cap (0 without a cap)",
    "tokens_per_s": "completion tokens sampled and trained on per second of step time",
    "m2po/masked_frac": "algo.policy_loss=m2po: share of the update's tokens its mask dropped "
    "(the largest (log pi_old - log pi_behav)², until the rest's mean is below "
    "algo.m2po_threshold), pooled over the optimizer steps",
    "trm/masked_frac": "algo.trm_delta: share of the update's valid tokens Trust Region Masking "
    "dropped from the policy loss (every token of a completion whose algo.trm_statistic "
    "between pi_old and pi_behav, by algo.trm_aggregate, exceeds algo.trm_delta; Li et al. "
    "2025), pooled over the optimizer steps",
    "trm/seq_masked_frac": "algo.trm_delta: share of the completions with a token that Trust "
    "Region Masking dropped whole, pooled over the optimizer steps",
    "rollout/staleness": "rollout.staleness: how many policy versions behind the trainer the "
    "step's batch was sampled (min(k, step - 1), counted afresh after a LoRA policy's "
    "kl.reference_reset; with rollout.async_weights=newest the batch's own lag, 0 to k, "
    "timing-dependent; under torchrun the mean of the ranks'; docs/async.md)",
    "sampler/ess": "rollout.staleness: Kish's effective sample size of the token weights w = "
    "pi_old / pi_behav, in (0, 1] (VCPO's collapse predictor; pi_old is pi_theta at the first "
    "update)",
    "sampler/ess_seq": "rollout.staleness: the effective sample size of the sequence weights "
    "prod_t w_t",
    "sampler/m2": "rollout.staleness: mean (log pi_old - log pi_behav)² over the tokens (M2PO's "
    "second moment)",
    "sampler/kl_k1": "rollout.staleness: k1 estimate of KL(pi_behav ‖ pi_old) per token",
    "sampler/kl_k3": "rollout.staleness: k3 estimate of KL(pi_behav ‖ pi_old) per token",
    "sampler/kl_k3_max": "rollout.staleness: the largest per-token k3 of the step (TRM's "
    "D_tok,max, sampled)",
    "sampler/tv": "rollout.staleness: |w - 1| / 2 per token, an unbiased estimate of the total "
    "variation between pi_behav and pi_old per position",
    "sampler/tv_binary_max": "rollout.staleness: the largest |pi_old(y_t) - pi_behav(y_t)| of "
    "the step (DPPO's statistic)",
    "sampler/clip_frac": "rollout.staleness: share of tokens whose w is outside [1 - "
    "algo.clip_low, 1 + algo.clip_high] (where a ratio clip to the sampler would bind)",
    "sampler/masked_frac": "rollout.staleness with algo.policy_loss=m2po or algo.trm_delta: "
    "share of the step's valid tokens the policy loss's masks dropped at the update's first "
    "epoch (M2PO's and TRM's together; logged only with such a mask)",
    "sampler/kl_exact": "rollout.staleness: exact KL(pi_behav ‖ pi_old) per position, summed "
    "over the vocabulary, mean over the step's tokens",
    "sampler/kl_exact_max": "rollout.staleness: the largest exact KL(pi_behav ‖ pi_old) at a "
    "position of the step",
    "sampler/tv_exact": "rollout.staleness: exact total variation between pi_behav and pi_old "
    "per position, half the L1 distance of the two distributions over the vocabulary, mean over "
    "the step's tokens",
    "sampler/tv_exact_max": "rollout.staleness: the largest exact total variation between "
    "pi_old and pi_behav at a position of the step",
}


def describe(key: str) -> str:
    """The documentation of a metric key (namespaced families match their ``<...>`` entry)."""
    if key in METRICS:
        return METRICS[key]
    head = key.rsplit("/", 1)[0]
    for k, text in METRICS.items():
        if k.endswith(">") and k.rsplit("/", 1)[0] == head:
            return text
    raise KeyError(
        f"undocumented metric {key!r}; document it in klpo.train.runtime.metrics.METRICS"
    )


def is_timing(key: str) -> bool:
    """Keys that measure wall time and so differ between otherwise identical runs."""
    return key.startswith("time/") or key == "tokens_per_s"


class Tally:
    """Metrics as ratios of sums, so that none depends on how the batch is split.

    Each key accumulates a numerator and a denominator over micro-batches, optimizer steps and
    ranks; the logged value is ``sum(num) / sum(den)`` (0 where nothing was counted). A token mean
    adds (sum over tokens, token count), a sequence mean (sum over sequences, count), a reduced
    loss its micro-batch's share of the optimizer step's loss (the normaliser is already global).
    The result is the value one process holding the whole step's batch computes.
    """

    def __init__(self) -> None:
        self._num: dict[str, float] = {}
        self._den: dict[str, float] = {}

    def add(self, key: str, num: float, den: float) -> None:
        self._num[key] = self._num.get(key, 0.0) + float(num)
        self._den[key] = self._den.get(key, 0.0) + float(den)

    def add_means(self, means: dict[str, float], weight: float) -> None:
        """Means over ``weight`` items (tokens, sequences) each: sum = mean · weight."""
        for key, value in means.items():
            self.add(key, value * weight, weight)

    def merge(self, other: Tally) -> None:
        for key in other._num:
            self.add(key, other._num[key], other._den[key])

    def result(
        self, all_sum: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, tuple[float, float]]:
        """``{key: (value, total denominator)}`` after ``all_sum`` (a sum over ranks); one
        collective for every key. Every rank must hold the same keys."""
        keys = sorted(self._num)
        t = torch.tensor(
            [[self._num[k] for k in keys], [self._den[k] for k in keys]], dtype=torch.float64
        )
        num, den = all_sum(t).tolist() if keys else ([], [])
        return {k: (n / d if d else 0.0, d) for k, n, d in zip(keys, num, den, strict=True)}


class MetricsWriter:
    """Appends one JSON line per step to ``metrics.jsonl`` and sends the scalars to the trackers
    of ``run.report_to`` (:mod:`klpo.train.runtime.trackers`); logged completions go to
    ``samples.jsonl`` and the trackers alike (:mod:`klpo.train.runtime.samples`).

    On resume (``resume_step`` > 0) lines of steps after the checkpoint are dropped first, so the
    files of a resumed run read as if the run had never stopped.

    Args:
        run_dir: the run directory.
        tensorboard: with ``report_to`` None, whether to write TensorBoard event files.
        resume_step: the checkpoint's step (0: a fresh start).
        report_to: tracker names (:data:`klpo.train.runtime.trackers.TRACKERS`).
        run_name: the run's name in the trackers (default: the directory's name).
        config: the resolved config, flat, for the trackers' run parameters.
        users: ``{rendered prompt: last user message}`` of chat data, added to the logged
            completions (:func:`klpo.train.runtime.samples.user_messages`).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = True,
        resume_step: int = 0,
        report_to: Sequence[str] | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
        users: dict[str, str] | None = None,
    ):
        from klpo.train.runtime import samples, trackers

        self.dir = Path(run_dir)
        self.users = users or {}
        self.path = self.dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step > 0 and self.path.exists():
            keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
        elif resume_step == 0 and self.path.exists():
            self.path.unlink()
        self.path.touch()  # with config.yaml, what marks a run directory (klpo.train.outdir)
        samples.trim_samples(self.dir, resume_step)
        names = list(report_to) if report_to is not None else ["tensorboard"] * tensorboard
        self._trackers = trackers.open_trackers(
            names,
            self.dir,
            name=run_name or self.dir.resolve().name,
            config=config or {},
            resume_step=resume_step,
        )

    def write(self, step: int, values: dict[str, Any]) -> None:
        from klpo.train.runtime.trackers import finite_scalars

        for key in values:
            describe(key)  # every key is documented, or this is a bug
        row = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
        scalars = finite_scalars({k: v for k, v in row.items() if k != "step"})
        for t in self._trackers:
            t.scalars(step, scalars)

    def samples(self, step: int, split: str, records: list[dict[str, Any]]) -> None:
        """Log completions: ``samples.jsonl``, and a table in each tracker."""
        from klpo.train.runtime import samples

        if not records:
            return
        records = samples.with_user_messages(records, self.users)
        samples.append_samples(self.dir, records)
        table = samples.samples_table(records)
        for t in self._trackers:
            t.samples(step, split, records, table)

    def close(self) -> None:
        trackers, self._trackers = self._trackers, []
        for t in trackers:
            t.close()


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


def wilson_interval(successes: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The Wilson score interval for a binomial proportion (Wilson 1927; Brown, Cai and
    DasGupta 2001, eq. 4), 95% by default: with ``p = k / n``,

        centre = (p + z²/2n) / (1 + z²/n),  half-width = z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n).

    Unlike the Wald interval ``p ± z sqrt(p(1-p)/n)`` it stays inside [0, 1] and does not
    collapse to a point at k = 0 or k = n, which matters for held-out accuracies of 0-20% on a
    few hundred problems.

    >>> lo, hi = wilson_interval(30, 200)
    >>> round(lo, 4), round(hi, 4)
    (0.1071, 0.2061)

    Raises:
        ValueError: ``n < 1`` or ``successes`` outside ``[0, n]``.
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    z2 = z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # At k = 0 (k = n) the lower (upper) end is 0 (1) exactly; the formula rounds near it.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi
