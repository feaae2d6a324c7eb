r"""Gao et al.'s over-optimisation laws, fitted to gold reward against KL.

Gao, Schulman & Hilton, "Scaling Laws for Reward Model Overoptimization" (arXiv:2210.10760),
measure the gold reward of a policy optimised against a proxy reward as a function of its distance
from the initial policy, ``d = sqrt(KL(pi ‖ pi_init))``, with ``R`` the gold reward minus the
initial policy's (so ``R(0) = 0``), and find two functional forms::

    best-of-n:  R_bon(d) = d (alpha - beta d)
    RL:         R_RL(d)  = d (alpha - beta log d)

Both are linear in ``(alpha, beta)``. With the design ``X = [d, -d²]`` or ``[d, -d log d]``
(``d log d = 0`` at ``d = 0``) the least-squares fit without intercept is
``theta = (XᵀX)⁻¹ XᵀR``, with covariance ``s² (XᵀX)⁻¹``, ``s² = RSS / (n - 2)``: exact for
independent residuals of equal variance. Points along one training run share its noise, so
:func:`bootstrap` resamples whole groups (runs or seeds) and refits; the spread of those refits is
the uncertainty to quote. :func:`lack_of_fit` bins the points by ``d`` and compares each bin's
mean residual with its standard error (chi² per bin about 1: the form fits within the noise).

The peak: ``R_RL`` is largest at ``d* = exp(alpha / beta - 1)``, where ``R = beta d*``; ``R_bon``
at ``d* = alpha / (2 beta)``, where ``R = alpha² / (4 beta)`` (``beta > 0``; else no peak).

In klpo, KL is the exact sequence KL(pi_theta ‖ pi_ref) of the over-optimisation task
(``kl/ref/seq``, nats per completion; the reference is the initial policy) and the gold reward is
``reward/gold`` (docs/overopt.md). ``python -m klpo.study.gao`` collects the per-step points of
``klpo compare --task overopt`` runs, fits both forms per KL choice and writes a table and a plot
(docs/literature.md reports them).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from klpo._io import save_figure, write_text_atomic

__all__ = [
    "FORMS",
    "Fit",
    "bootstrap",
    "collect_trajectories",
    "design",
    "endpoint_groups",
    "fit",
    "fit_baseline",
    "fit_markdown",
    "fit_table",
    "initial_gold",
    "lack_of_fit",
    "main",
    "matched_baseline",
    "offsets",
    "offsets_markdown",
    "plot_fits",
    "predict",
    "read_trajectories",
    "reference_gold",
    "trajectory_groups",
    "write_csv",
]

Form = Literal["rl", "bon"]
FORMS: tuple[Form, ...] = ("rl", "bon")
WINDOW = 10  # steps of the running means the plot draws each run's path with
FORM_NAMES = {"rl": "d(α − β log d)", "bon": "d(α − β d)"}
TRAJECTORY_FIELDS = ("run", "algo", "choice", "beta", "seed", "step", "gold", "kl_seq")


def design(d: np.ndarray, form: Form) -> np.ndarray:
    """The ``[n, 2]`` design matrix of ``form`` at distances ``d`` ``[n]`` (``R = X @ (alpha, beta)``)."""
    d = np.asarray(d, dtype=np.float64)
    if form == "rl":
        safe = np.where(d > 0, d, 1.0)
        return np.stack([d, -np.where(d > 0, d * np.log(safe), 0.0)], axis=1)
    if form == "bon":
        return np.stack([d, -d * d], axis=1)
    raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def predict(d: np.ndarray, alpha: float, beta: float, form: Form) -> np.ndarray:
    """``R(d)`` of ``form`` with coefficients ``alpha``, ``beta``."""
    return design(d, form) @ np.array([alpha, beta])


@dataclass(frozen=True)
class Fit:
    """A least-squares fit of one form: coefficients, their standard errors from the covariance
    ``s² (XᵀX)⁻¹`` and correlation, the residuals' RMSE and the number of points."""

    form: Form
    alpha: float
    beta: float
    se_alpha: float
    se_beta: float
    corr: float
    rmse: float
    n: int

    def peak(self) -> tuple[float, float]:
        """``(d*, R(d*))`` at the form's maximum; ``(nan, nan)`` when ``beta <= 0`` (no peak)."""
        if not self.beta > 0:
            return math.nan, math.nan
        if self.form == "rl":
            ratio = self.alpha / self.beta - 1
            if ratio > 700:  # exp would overflow: the peak lies far beyond any data
                return math.inf, math.inf
            d = math.exp(ratio)
            return d, self.beta * d
        return self.alpha / (2 * self.beta), self.alpha**2 / (4 * self.beta)


def _points(d: Any, r: Any, *, distinct: int = 2) -> tuple[np.ndarray, np.ndarray]:
    d = np.asarray(d, dtype=np.float64)
    r = np.asarray(r, dtype=np.float64)
    if d.ndim != 1 or d.shape != r.shape:
        raise ValueError(f"d and r must be 1-D of one length, got shapes {d.shape} and {r.shape}")
    if not (np.isfinite(d).all() and np.isfinite(r).all()):
        raise ValueError("d and r must be finite: drop the points of diverged runs first")
    if (d < 0).any():
        raise ValueError(f"d = sqrt(KL) must be >= 0, got {d.min():g}")
    if np.unique(d[d > 0]).size < distinct:
        raise ValueError("a fit needs points at two or more distinct d > 0")
    return d, r


def fit(d: Any, r: Any, form: Form) -> Fit:
    """Fit ``R = form(d; alpha, beta)`` to points ``(d, r)`` by least squares (``R(0) = 0``)."""
    d, r = _points(d, r)
    x = design(d, form)
    theta, *_ = np.linalg.lstsq(x, r, rcond=None)
    resid = r - x @ theta
    n = d.size
    s2 = float(resid @ resid) / max(n - 2, 1)
    cov = s2 * np.linalg.inv(x.T @ x)
    se = np.sqrt(np.diag(cov))
    corr = float(cov[0, 1] / (se[0] * se[1])) if se.all() else math.nan
    return Fit(
        form=form,
        alpha=float(theta[0]),
        beta=float(theta[1]),
        se_alpha=float(se[0]),
        se_beta=float(se[1]),
        corr=corr,
        rmse=math.sqrt(float(resid @ resid) / n),
        n=n,
    )


def bootstrap(
    groups: Sequence[tuple[Any, Any]], form: Form, *, n_boot: int = 1000, seed: int = 0
) -> np.ndarray:
    """``[n_boot, 2]`` refits ``(alpha, beta)`` on ``groups`` (each ``(d, r)``, e.g. one run's
    points) drawn with replacement, as many as there are; a draw without two distinct ``d > 0``
    is drawn again."""
    if len(groups) < 2:
        raise ValueError(f"a bootstrap over groups needs two or more groups, got {len(groups)}")
    data = [_points(*g, distinct=0) for g in groups]
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, 2))
    i = 0
    while i < n_boot:
        pick = rng.integers(0, len(data), size=len(data))
        d = np.concatenate([data[j][0] for j in pick])
        r = np.concatenate([data[j][1] for j in pick])
        if np.unique(d[d > 0]).size < 2:
            continue
        theta, *_ = np.linalg.lstsq(design(d, form), r, rcond=None)
        out[i] = theta
        i += 1
    return out


def lack_of_fit(d: Any, r: Any, f: Fit, *, bins: int = 20) -> tuple[float, int]:
    """``(chi² per bin, bins)``: the points split into ``bins`` groups of about equal count by
    ``d`` (at least 10 points each: fewer bins if need be; ``(nan, 0)`` below two); each group's
    mean residual over its standard error, squared, averaged. About 1 when the form follows the
    points within their noise; far above 1 when it misses their shape."""
    d, r = _points(d, r)
    nbins = min(bins, d.size // 10)
    if nbins < 2:
        return math.nan, 0
    order = np.argsort(d, kind="stable")
    resid = (r - predict(d, f.alpha, f.beta, f.form))[order]
    chunks = np.array_split(resid, nbins)
    z2 = [(c.mean() / (c.std(ddof=1) / math.sqrt(c.size))) ** 2 for c in chunks if c.std() > 0]
    return (float(np.mean(z2)) if z2 else math.nan), len(z2)


# ---------------------------------------------------------------------------------------------
# Points from klpo compare runs.


def _run_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per logged step of a ``klpo compare`` run with both ``reward/gold`` and
    ``kl/ref/seq``; the run's labels come from its ``result.yaml``."""
    import yaml

    result = yaml.safe_load((run_dir / "result.yaml").read_text(encoding="utf-8"))
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        m = json.loads(line) if line.strip() else {}
        if "reward/gold" not in m or "kl/ref/seq" not in m:
            continue
        rows.append(
            {
                "run": result["name"],
                "algo": result["algo"],
                "choice": result["choice"],
                "beta": float(result["beta"]),
                "seed": int(result["seed"]),
                "step": int(m["step"]),
                "gold": float(m["reward/gold"]),
                "kl_seq": float(f"{float(m['kl/ref/seq']):.6g}"),  # 6 digits: a smaller CSV
            }
        )
    return rows


def collect_trajectories(study_dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every finished run's per-step ``(gold, kl_seq)`` rows in ``klpo compare`` output
    directories (``DIR/runs/*/`` with ``result.yaml`` and ``metrics.jsonl``)."""
    rows: list[dict[str, Any]] = []
    for study in study_dirs:
        run_dirs = sorted(p for p in (Path(study) / "runs").glob("*") if p.is_dir())
        if not run_dirs:
            raise ValueError(f"{str(study)!r} holds no runs (expected DIR/runs/NAME/metrics.jsonl)")
        for run_dir in run_dirs:
            if (run_dir / "result.yaml").exists() and (run_dir / "metrics.jsonl").exists():
                rows += _run_rows(run_dir)
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str | Path, fields: Sequence[str]) -> None:
    """``rows`` as CSV with columns ``fields``, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(fields), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(path, buf.getvalue())


def read_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """Rows written by :func:`write_csv` with :data:`TRAJECTORY_FIELDS`, typed."""
    with Path(path).open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = set(TRAJECTORY_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{str(path)!r} lacks the columns {sorted(missing)}")
        return [
            {
                **r,
                "beta": float(r["beta"]),
                "seed": int(r["seed"]),
                "step": int(r["step"]),
                "gold": float(r["gold"]),
                "kl_seq": float(r["kl_seq"]),
            }
            for r in reader
        ]


def initial_gold(rows: Sequence[dict[str, Any]]) -> tuple[float, float, int]:
    """``(mean, standard error, seeds)`` of the gold reward at the first logged step, where the
    policy is still the reference: the ``R = 0`` of the fits. Runs of one seed sample that step
    alike (same reference, same prompts, same generator), so each seed counts once."""
    first: dict[int, tuple[int, float]] = {}
    for r in rows:
        if r["seed"] not in first or r["step"] < first[r["seed"]][0]:
            first[r["seed"]] = (r["step"], r["gold"])
    g = np.array([v for _, v in first.values()])
    if g.size < 2:
        raise ValueError(f"the reference's gold reward needs two or more seeds, got {g.size}")
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(g.size)), int(g.size)


def reference_gold(run_dir: str | Path, *, max_kl: float = 1e-4) -> tuple[float, float, int]:
    """``(mean, standard error, steps)`` of ``reward/gold`` over a ``klpo train`` run whose policy
    never left the reference (e.g. ``optim.lr=1e-12``): every step a fresh batch of the
    reference's own completions. Refused if its exact sequence KL ever exceeds ``max_kl`` (in
    float32 a policy equal to its reference reads about 1e-6 nats per completion)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist: give a klpo train output directory")
    gold, kls = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = json.loads(line) if line.strip() else {}
        if "reward/gold" in m:
            gold.append(float(m["reward/gold"]))
            kls.append(float(m.get("kl/ref/seq", math.nan)))
    if len(gold) < 2:
        raise ValueError(f"{str(path)!r} has {len(gold)} steps with reward/gold; need two or more")
    if not max(kls) <= max_kl:
        raise ValueError(
            f"{str(path)!r}: the policy moved (sequence KL up to {max(kls):.3g} > {max_kl:g}); "
            "run it with optim.lr=1e-12 so every step samples the reference"
        )
    g = np.array(gold)
    return float(g.mean()), float(g.std(ddof=1) / math.sqrt(g.size)), int(g.size)


Groups = dict[str, list[tuple[np.ndarray, np.ndarray]]]


def trajectory_groups(rows: Sequence[dict[str, Any]], gold0: float) -> Groups:
    """Per KL choice (``"algo choice"``), one ``(d, R)`` group per run: ``d = sqrt(kl_seq)``,
    ``R = gold - gold0``, every logged step; all betas of a choice pooled."""
    runs: dict[str, dict[str, Any]] = {}
    for r in rows:
        run = runs.setdefault(r["run"], {"label": f"{r['algo']} {r['choice']}", "pts": []})
        if math.isfinite(r["kl_seq"]) and math.isfinite(r["gold"]):
            run["pts"].append((math.sqrt(max(r["kl_seq"], 0.0)), r["gold"] - gold0))
    groups: Groups = {}
    for run in runs.values():
        d, g = (np.array(v) for v in zip(*run["pts"], strict=True)) if run["pts"] else ([], [])
        groups.setdefault(run["label"], []).append((np.asarray(d), np.asarray(g)))
    return groups


def endpoint_groups(results_csv: str | Path, gold0: float, *, min_betas: int = 2) -> Groups:
    """Per KL choice of a ``klpo compare --task overopt`` ``results.csv``, one ``(d, R)`` group
    per seed: each beta's end point (``kl_seq_final``, ``gold_final``, means of the last steps).
    Choices with fewer than ``min_betas`` betas, and those that reset the reference (their KL is
    to a moved one), are left out."""
    with Path(results_csv).open(encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    by: dict[str, dict[int, list[tuple[float, float, float]]]] = {}
    for r in rows:
        kl, gold = float(r["kl_seq_final"] or "nan"), float(r["gold_final"] or "nan")
        if "reset" in r["choice"] or not (math.isfinite(kl) and math.isfinite(gold)):
            continue
        seeds = by.setdefault(f"{r['algo']} {r['choice']}", {})
        seeds.setdefault(int(r["seed"]), []).append((float(r["beta"]), math.sqrt(kl), gold - gold0))
    groups: Groups = {}
    for label, seeds in by.items():
        if len({b for pts in seeds.values() for b, _, _ in pts}) < min_betas:
            continue
        groups[label] = [
            (np.array([p[1] for p in pts]), np.array([p[2] for p in pts])) for pts in seeds.values()
        ]
    return groups


def _pooled(groups: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    return np.concatenate([g[0] for g in groups]), np.concatenate([g[1] for g in groups])


def fit_table(
    groups: Groups, gold0: float, *, reference: str | None = None, n_boot: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per KL choice and form: the fit, the bootstrap sd over groups of alpha and beta,
    the peak (as KL = d² and as gold reward), the residuals' RMSE and the lack-of-fit chi² per
    bin, and ``z_alpha`` / ``z_beta``: the difference from the ``reference`` choice's coefficient
    over the bootstrap sd of that difference (independent runs)."""
    rows: list[dict[str, Any]] = []
    boots: dict[tuple[str, str], np.ndarray] = {}
    for label, gs in groups.items():
        d, r = _pooled(gs)
        for form in FORMS:
            f = fit(d, r, form)
            # One group (one run or seed) has no spread to resample: its sd is NaN.
            b = (
                bootstrap(gs, form, n_boot=n_boot, seed=seed)
                if len(gs) > 1
                else np.full((2, 2), np.nan)
            )
            boots[label, form] = b
            d_peak, r_peak = f.peak()
            chi2, nbins = lack_of_fit(d, r, f)
            rows.append(
                {
                    "choice": label,
                    "form": form,
                    "points": f.n,
                    "groups": len(gs),
                    "alpha": f.alpha,
                    "se_alpha": f.se_alpha,
                    "sd_alpha": float(b[:, 0].std(ddof=1)),
                    "beta": f.beta,
                    "se_beta": f.se_beta,
                    "sd_beta": float(b[:, 1].std(ddof=1)),
                    "kl_peak": d_peak**2,
                    "gold_peak": r_peak + gold0,
                    "rmse": f.rmse,
                    "chi2_bin": chi2,
                    "bins": nbins,
                }
            )
    for row in rows:
        row["is_reference"] = row["choice"] == reference
        ref = boots.get((reference, row["form"])) if reference else None
        own = boots[row["choice"], row["form"]]
        for i, k in enumerate(("alpha", "beta")):
            z = math.nan
            if ref is not None and row["choice"] != reference:
                base = next(
                    x for x in rows if x["choice"] == reference and x["form"] == row["form"]
                )
                z = (row[k] - base[k]) / math.hypot(own[:, i].std(ddof=1), ref[:, i].std(ddof=1))
            row[f"z_{k}"] = z
    return rows


Baseline = Callable[[float], float]


def fit_baseline(f: Fit) -> Baseline:
    """``R(d)`` of a fit, as a baseline for :func:`offsets`."""
    return lambda d: float(predict(np.array([d]), f.alpha, f.beta, f.form)[0])


def matched_baseline(
    rows: Sequence[dict[str, Any]],
    gold0: float,
    label: str,
    *,
    width: float = 0.05,
    min_points: int = 20,
) -> Baseline:
    """The mean ``R`` of choice ``label``'s points (``"algo choice"``, every step) with
    ``|d' - d| <= width``; NaN where fewer than ``min_points`` lie there. No form assumed."""
    pts = sorted(
        (math.sqrt(max(r["kl_seq"], 0.0)), r["gold"] - gold0)
        for r in rows
        if f"{r['algo']} {r['choice']}" == label and math.isfinite(r["kl_seq"])
    )
    if not pts:
        raise ValueError(f"no points of {label!r} to match against")
    ds = np.array([p[0] for p in pts])
    rs = np.array([p[1] for p in pts])

    def at(d: float) -> float:
        lo, hi = np.searchsorted(ds, d - width), np.searchsorted(ds, d + width, side="right")
        return float(rs[lo:hi].mean()) if hi - lo >= min_points else math.nan

    return at


def offsets(
    rows: Sequence[dict[str, Any]],
    gold0: float,
    baselines: dict[str, Baseline],
    *,
    after_step: int = 100,
) -> list[dict[str, Any]]:
    """Per KL choice and beta: the mean residual of its points after ``after_step`` against each
    baseline (``R`` expected at the point's ``d``; points where a baseline is NaN are left out),
    mean ± sd over seeds of each run's mean, the share of points a baseline covered, and the
    mean KL there. Positive: more gold at that KL than the baseline. Gao et al. found a KL
    penalty leaves the points on the unpenalised runs' curve (it acts as early stopping)."""
    per_run: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["step"] <= after_step or not math.isfinite(r["kl_seq"]):
            continue
        d = math.sqrt(max(r["kl_seq"], 0.0))
        run = per_run.setdefault(
            r["run"],
            {
                "choice": f"{r['algo']} {r['choice']}",
                "beta": r["beta"],
                "kl": [],
                **{k: [] for k in baselines},
            },
        )
        run["kl"].append(r["kl_seq"])
        for k, base in baselines.items():
            run[k].append(r["gold"] - gold0 - base(d))
    cells: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for run in per_run.values():
        cells.setdefault((run["choice"], run["beta"]), []).append(run)
    out = []
    for (choice, beta), runs in sorted(cells.items()):
        row: dict[str, Any] = {"choice": choice, "beta": beta, "seeds": len(runs)}
        row["kl_seq"] = float(np.mean([np.mean(run["kl"]) for run in runs]))
        for k in baselines:
            res = [np.array(run[k]) for run in runs]
            means = np.array([x[np.isfinite(x)].mean() for x in res if np.isfinite(x).any()])
            row[f"offset_{k}"] = float(means.mean()) if means.size else math.nan
            row[f"sd_{k}"] = float(means.std(ddof=1)) if means.size > 1 else math.nan
            row[f"covered_{k}"] = float(np.mean([np.isfinite(x).mean() for x in res]))
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# The report: a table and a plot.


def _pm(x: float, sd: float, digits: int = 3) -> str:
    return f"{x:.{digits}f} ± {sd:.{digits}f}" if math.isfinite(x) else "–"


def _g(x: float) -> str:
    return f"{x:.3g}" if math.isfinite(x) else "–"


def fit_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The fits of :func:`fit_table` as a markdown table (± the bootstrap sd over groups)."""
    lines = [
        "| KL choice | form | points (groups) | α | β | z(α), z(β) vs ref | peak KL | peak gold "
        "| RMSE | χ²/bin |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        z = "ref" if r["is_reference"] else f"{_g(r['z_alpha'])}, {_g(r['z_beta'])}"
        lines.append(
            f"| {r['choice']} | {FORM_NAMES[r['form']]} | {r['points']} ({r['groups']}) "
            f"| {_pm(r['alpha'], r['sd_alpha'])} | {_pm(r['beta'], r['sd_beta'])} | {z} "
            f"| {_g(r['kl_peak'])} | {_g(r['gold_peak'])} | {r['rmse']:.3f} | {_g(r['chi2_bin'])} |"
        )
    return "\n".join(lines) + "\n"


def offsets_markdown(rows: Sequence[dict[str, Any]], names: dict[str, str]) -> str:
    """The :func:`offsets` rows as a markdown table, one column per baseline (``names``: baseline
    key to column title); a cell covering under half its points says so."""
    lines = [
        "| KL choice | beta | seeds | mean seq KL | " + " | ".join(names.values()) + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " |",
    ]
    for r in rows:
        cells = []
        for k in names:
            cell = _pm(r[f"offset_{k}"], r[f"sd_{k}"])
            if r[f"covered_{k}"] < 0.5 and math.isfinite(r[f"offset_{k}"]):
                cell += f" ({r[f'covered_{k}']:.0%} of points)"
            cells.append(cell)
        lines.append(
            f"| {r['choice']} | {r['beta']:g} | {r['seeds']} | {r['kl_seq']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _binned(d: np.ndarray, r: np.ndarray, bins: int) -> tuple[np.ndarray, ...]:
    order = np.argsort(d, kind="stable")
    chunks = [
        (c_d, c_r)
        for c_d, c_r in zip(
            np.array_split(d[order], bins), np.array_split(r[order], bins), strict=True
        )
        if c_d.size >= 2
    ]
    x = np.array([c[0].mean() for c in chunks])
    y = np.array([c[1].mean() for c in chunks])
    se = np.array([c[1].std(ddof=1) / math.sqrt(c[1].size) for c in chunks])
    return x, y, se


def plot_fits(
    groups: Groups,
    rows: Sequence[dict[str, Any]],
    gold0: float,
    path: str | Path,
    *,
    bins: int = 30,
) -> None:
    """One panel per KL choice: each run's path (10-step running means of d and gold, thin), its
    points binned by ``d`` (mean ± se of equal-count bins), the RL and best-of-n fits, and the
    first choice's RL fit in grey for comparison."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    labels = list(groups)
    cols = min(3, len(labels))
    nrows = math.ceil(len(labels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    d_max = max(float(_pooled(g)[0].max()) for g in groups.values())
    grid = np.linspace(0, d_max * 1.02, 300)
    first = {r["form"]: r for r in rows if r["choice"] == labels[0]}
    for ax, label in zip(axes.flat, labels, strict=False):
        for run_d, run_r in groups[label]:
            if run_d.size >= WINDOW:
                k = np.ones(WINDOW) / WINDOW
                ax.plot(
                    np.convolve(run_d, k, "valid"),
                    np.convolve(run_r, k, "valid") + gold0,
                    color="tab:green",
                    lw=0.5,
                    alpha=0.35,
                )
        d, r = _pooled(groups[label])
        x, y, se = _binned(d, r, min(bins, d.size // 2))
        ax.errorbar(x, y + gold0, yerr=se, fmt="o", ms=3, color="k", lw=0.8, label="binned runs")
        for form, style in (("rl", "-"), ("bon", "--")):
            f = next(row for row in rows if row["choice"] == label and row["form"] == form)
            ax.plot(
                grid,
                predict(grid, f["alpha"], f["beta"], form) + gold0,
                style,
                label=FORM_NAMES[form],
            )
        if label != labels[0]:
            ref = first["rl"]
            ax.plot(
                grid,
                predict(grid, ref["alpha"], ref["beta"], "rl") + gold0,
                color="0.6",
                lw=1,
                label=f"{labels[0]}, RL form",
            )
        ax.axhline(gold0, color="0.8", lw=0.8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("d = sqrt(exact sequence KL), nats^½")
        ax.set_ylabel("gold reward")
        ax.set_ylim(-0.02, max(0.45, float((y + gold0).max()) + 0.05))
        ax.legend(fontsize=6, loc="lower left")
    for ax in list(axes.flat)[len(labels) :]:
        ax.axis("off")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m klpo.study.gao``: collect, fit, tabulate and plot (see ``--help``)."""
    p = argparse.ArgumentParser(
        prog="python -m klpo.study.gao",
        description="Fit Gao et al.'s over-optimisation forms (arXiv:2210.10760) to the gold "
        "reward against the exact sequence KL of klpo compare --task overopt runs.",
    )
    p.add_argument("trajectories", type=Path, help="Per-step points CSV (written by --runs).")
    p.add_argument(
        "--runs",
        type=Path,
        nargs="*",
        default=[],
        help="klpo compare output directories: collect their runs' points into TRAJECTORIES first.",
    )
    p.add_argument("--endpoints", type=Path, help="A results.csv: also fit its runs' end points.")
    p.add_argument(
        "--reference-run",
        type=Path,
        help="A klpo train directory that never left the reference (optim.lr=1e-12): its mean "
        "gold reward is R = 0 (default: the runs' first steps, one per seed).",
    )
    p.add_argument("--reference", default="grpo no KL", help="The choice z-scores compare with.")
    p.add_argument(
        "--endpoint-reference",
        default="grpo full loss",
        help="The choice the end-point fits' z-scores compare with (no KL has one beta).",
    )
    p.add_argument(
        "--min-betas", type=int, default=4, help="End points: choices with this many betas."
    )
    p.add_argument("--out", type=Path, required=True, help="Directory for fits.md and gao.png.")
    p.add_argument("--boot", type=int, default=1000, help="Bootstrap resamples.")
    a = p.parse_args(argv)
    if a.runs:
        write_csv(collect_trajectories(a.runs), a.trajectories, TRAJECTORY_FIELDS)
    rows = read_trajectories(a.trajectories)
    if a.reference_run:
        gold0, se0, n0 = reference_gold(a.reference_run)
        origin = f"{n0} steps of the run in {a.reference_run}, which never left the reference"
    else:
        gold0, se0, n0 = initial_gold(rows)
        origin = f"the first step of {n0} seeds"
    groups = trajectory_groups(rows, gold0)
    if a.reference in groups:  # the reference first: its panel, its grey curve elsewhere
        groups = {a.reference: groups[a.reference], **groups}
    table = fit_table(groups, gold0, reference=a.reference, n_boot=a.boot)
    a.out.mkdir(parents=True, exist_ok=True)
    write_csv(table, a.out / "fits.csv", list(table[0]))
    text = [
        f"The reference's gold reward, R = 0 ({origin}): {gold0:.4f} ± {se0:.4f}.\n",
        "Per-step points, all betas of a choice pooled; ± is the bootstrap sd over runs.\n",
        fit_markdown(table),
    ]
    ref = next((r for r in table if r["choice"] == a.reference and r["form"] == "rl"), None)
    if ref is not None:
        ref_fit = Fit("rl", ref["alpha"], ref["beta"], ref["se_alpha"], ref["se_beta"], 0, 0, 0)
        bases = {"fit": fit_baseline(ref_fit), "runs": matched_baseline(rows, gold0, a.reference)}
        names = {
            "fit": f"gold − {a.reference} RL fit",
            "runs": f"gold − {a.reference} runs at d ± 0.05",
        }
        text += [
            f"\nAfter step 100, against {a.reference}: its RL fit, and its own points at the same d:\n",
            offsets_markdown(offsets(rows, gold0, bases), names),
        ]
    if a.endpoints:
        ends = endpoint_groups(a.endpoints, gold0, min_betas=a.min_betas)
        end_table = fit_table(ends, gold0, reference=a.endpoint_reference, n_boot=a.boot)
        write_csv(end_table, a.out / "fits-endpoints.csv", list(end_table[0]))
        text += [
            "\nEnd points of every run (one per beta), ± the bootstrap sd over seeds:\n",
            fit_markdown(end_table),
        ]
    write_text_atomic(a.out / "fits.md", "\n".join(text))
    plot_fits(groups, table, gold0, a.out / "gao.png")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
