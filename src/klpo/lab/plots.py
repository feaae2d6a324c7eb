"""PNG figures of the lab report (matplotlib, Agg backend, imported on first use).

Each function takes the data of one experiment (:mod:`klpo.lab.experiments`) and writes one PNG
atomically (to a temporary file in the same folder, then renamed).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from klpo._io import save_figure

__all__ = ["plot_drift", "plot_gradient_cosines", "plot_mu_sweep", "plot_ref_is_variants"]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "figure.dpi": 110,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "axes.spines.right": False,
            "font.size": 9,
            "legend.fontsize": 8,
        }
    )
    return plt


def _save(fig: Any, path: Path) -> None:
    try:
        save_figure(fig, path)
    finally:
        fig.clear()
        _plt().close(fig)


def _groups(estimators: dict[str, dict], key: str) -> list[tuple[str, str]]:
    """Estimators whose series are identical, merged: [(label "k3 = k3+ = k3_is", first name)]."""
    out: list[tuple[list[str], list]] = []
    for name, d in estimators.items():
        series = [round(x, 12) if math.isfinite(x) else x for x in d[key]]
        for names, s in out:
            if s == series:
                names.append(name)
                break
        else:
            out.append(([name], series))
    return [(" = ".join(names), names[0]) for names, _ in out]


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def _bias_and_spread(
    ax_b: Any, ax_s: Any, unbiased: list[str], *, at: float, linthresh: float
) -> None:
    """The frame of a bias panel and a spread panel against the KL (log x): bias / KL on a
    symlog axis, linear within ``±linthresh``, with its zero line and the names in ``unbiased``
    (bias exactly 0) written above it at ``at`` (axes fraction); spread / KL on a log axis."""
    if unbiased:
        ax_b.annotate(
            "exactly 0: " + ", ".join(unbiased), (at, 0.5), xycoords="axes fraction",
            xytext=(0, 6), textcoords="offset points", fontsize=8,
        )  # fmt: skip
    ax_b.set_xscale("log")
    ax_b.set_yscale("symlog", linthresh=linthresh)
    ax_b.axhline(0, color="black", lw=0.6)
    ax_s.set_xscale("log")
    ax_s.set_yscale("log")


def plot_mu_sweep(sweep: dict, path: Path) -> None:
    """Bias / KL and sd / KL of every Gaussian estimator against the true KL (mu sweep)."""
    plt = _plt()
    kl = sweep["true_kl"]
    est = sweep["estimators"]
    groups = _groups(est, "exact_sd_rel")
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(12, 5.2), layout="constrained")
    handles = []
    for (label, name), color in zip(groups, _colors(len(groups)), strict=True):
        d = est[name]
        (line,) = ax_b.plot(kl, d["exact_bias_rel"], color=color, lw=1.6, label=label)
        handles.append(line)
        ax_s.plot(kl, d["exact_sd_rel"], color=color, lw=1.6)
        ax_s.plot(kl, d["sd_rel"], color=color, marker="o", ms=3.5, lw=0, mfc="none")
    unbiased = [
        label for label, name in groups if all(abs(x) < 1e-9 for x in est[name]["exact_bias_rel"])
    ]
    _bias_and_spread(ax_b, ax_s, unbiased, at=0.02, linthresh=1e-3)
    ax_b.set_xlabel("true KL = mu²/2   (pi_theta = N(0, 1), pi_ref = N(mu, 1))")
    ax_b.set_ylabel("bias / true KL   (symlog, linear within ±0.001)")
    ax_b.set_title("Bias relative to the true KL (exact)")
    ax_s.set_xlabel("true KL = mu²/2")
    ax_s.set_ylabel("sd of one sample / true KL")
    ax_s.set_title(
        f"Spread: exact (lines), Monte Carlo with {sweep['samples']:,} samples (circles)"
    )
    fig.legend(handles=handles, loc="outside lower center", ncol=5, frameon=False)
    _save(fig, path)


def plot_gradient_cosines(cos: dict, path: Path) -> None:
    """Heatmaps: cosine of each estimator × placement's expected gradient to both true gradients."""
    plt = _plt()
    import numpy as np

    rows = list(cos["rows"])
    kls = cos["kl"]
    fig, axes = plt.subplots(
        1, 2, figsize=(12, 0.25 * len(rows) + 1.8), sharey=True, layout="constrained"
    )
    titles = {
        "cos_theta_ref": "cos to grad KL(pi_theta ‖ pi_ref)",
        "cos_ref_theta": "cos to grad KL(pi_ref ‖ pi_theta)",
    }
    cmap = plt.get_cmap("RdBu").with_extremes(bad="#d9d9d9")
    for ax, (key, title) in zip(axes, titles.items(), strict=True):
        data = np.array([cos["rows"][r][key] for r in rows], dtype=float)
        im = ax.imshow(data, cmap=cmap, vmin=-1, vmax=1, aspect="auto")
        for i in range(data.shape[0]):
            for j in range(data.shape[1]):
                v = data[i, j]
                text = "zero" if not math.isfinite(v) else f"{v:.2f}"
                color = "white" if math.isfinite(v) and abs(v) > 0.75 else "black"
                ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color=color)
        ax.set_xticks(range(len(kls)), [f"{k:g}" for k in kls])
        ax.set_xlabel("KL(pi_theta ‖ pi_ref)")
        ax.set_title(title)
        ax.grid(False)
        for i, r in enumerate(rows):  # separate estimators with a white line
            if i and r.split("|")[0] != rows[i - 1].split("|")[0]:
                ax.axhline(i - 0.5, color="white", lw=1.5)
    axes[0].set_yticks(range(len(rows)), [r.replace("|", " · ") for r in rows])
    fig.colorbar(im, ax=axes, fraction=0.03, pad=0.01, shrink=0.5)
    fig.suptitle(
        f"Exact expected gradient of each estimator · placement vs the true gradients\n"
        f"random LM-like categoricals over {cos['vocab']:,} tokens, mean over {cos['draws']} per "
        f"KL; 'zero' = zero gradient; a cosine ignores scale (see the tables for relative errors)",
        fontsize=9,
    )
    _save(fig, path)


def plot_ref_is_variants(var: dict, path: Path) -> None:
    """Bias / KL and sd / KL of batch estimates of the ref_is variants (and k1, k3) against the KL."""
    plt = _plt()
    kl = var["kl"]
    est = var["estimators"]
    names = list(est)
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(12, 5.2), layout="constrained")
    handles = []
    for name, color in zip(names, _colors(len(names)), strict=True):
        d = est[name]
        ls = "--" if name in ("k1", "k3") else "-"
        exact = all(math.isfinite(x) for x in d["exact_bias_rel"])
        if exact:
            (h,) = ax_b.plot(kl, d["exact_bias_rel"], color=color, ls=ls, lw=1.6, label=name)
            ax_s.plot(kl, d["exact_sd_rel"], color=color, ls=ls, lw=1.6)
            ax_s.plot(kl, d["sd_rel"], color=color, marker="o", ms=3.5, lw=0, mfc="none")
        else:
            h = ax_b.errorbar(
                kl, d["bias_rel"], yerr=[2 * x for x in d["bias_rel_se"]], color=color, ls=":",
                marker="s", ms=4, capsize=2, lw=1.2, label=f"{name} (Monte Carlo ± 2 se)",
            )  # fmt: skip
            ax_s.plot(kl, d["sd_rel"], color=color, ls=":", marker="s", ms=4, lw=1.2)
        handles.append(h)
    unbiased = [
        n for n in names if all(abs(x) < 1e-9 for x in est[n]["exact_bias_rel"])
    ]  # NaN (Monte Carlo only) compares False
    _bias_and_spread(ax_b, ax_s, unbiased, at=0.3, linthresh=1e-2)
    ax_b.set_xlabel("true KL(pi_theta ‖ pi_ref)")
    ax_b.set_ylabel("bias / true KL   (symlog, linear within ±0.01)")
    ax_b.set_title("Bias of the batch estimate: exact (lines) or Monte Carlo (squares)")
    ax_s.set_xlabel("true KL(pi_theta ‖ pi_ref)")
    ax_s.set_ylabel("sd of one batch estimate / true KL")
    ax_s.set_title(f"Spread: exact (lines), Monte Carlo ({var['batches']:,} batches, markers)")
    fig.legend(handles=handles, loc="outside lower center", ncol=4, frameon=False)
    fig.suptitle(
        f"ref_is variants (samples of pi_ref) and k1, k3 (samples of pi_theta), batches of "
        f"{var['batch']}: random LM-like categoricals over {var['vocab']:,} tokens",
        fontsize=10,
    )
    _save(fig, path)


def plot_drift(dr: dict, path: Path) -> None:
    """The drift experiment: the parts' spread, the mix's weight on k1, and RMSE against k1's."""
    plt = _plt()
    kl = dr["true_kl"]
    est = dr["estimators"]
    names = list(est)
    colors = dict(zip(names, _colors(len(names)), strict=True))
    fig, (ax_e, ax_a, ax_r) = plt.subplots(1, 3, figsize=(15, 5.2), layout="constrained")
    for name, alpha in (("ref_is", 0.2), ("k1", 0.45)):
        m, s = est[name]["mean"], est[name]["sd"]
        lo = [a - b for a, b in zip(m, s, strict=True)]
        hi = [a + b for a, b in zip(m, s, strict=True)]
        ax_e.fill_between(
            kl, lo, hi, color=colors[name], alpha=alpha, lw=0, label=f"{name}: mean ± sd over runs"
        )
        ax_e.plot(kl, m, color=colors[name], lw=0.8)
    ax_e.plot(kl, kl, color="black", lw=1.0, ls="--", label="true KL")
    ax_e.set_xlabel("true KL(pi_theta ‖ pi_ref) along the drift")
    ax_e.set_ylabel(f"batch estimate ({dr['batch']} samples)")
    ax_e.set_title("The mix's parts: both unbiased, ref_is's spread grows")
    ax_e.legend(loc="upper left", frameon=False)
    ms = dr["mix_settings"]
    for label, a in dr["mix_weight_on_k1"].items():
        short = label.removeprefix("adaptive_mix (").removesuffix(")")
        ax_a.plot(kl, a, color=colors[label], lw=1.8, label=short)
    ax_a.axvline(ms["threshold"], color="grey", ls=":", lw=1)
    ax_a.annotate(
        f"threshold {ms['threshold']:g}", (ms["threshold"], 0.08), xytext=(4, 0),
        textcoords="offset points", color="grey", fontsize=8, va="center",
    )  # fmt: skip
    ax_a.set_ylim(-0.03, 1.03)
    ax_a.set_xlabel("true KL(pi_theta ‖ pi_ref)")
    ax_a.set_ylabel("a = weight on k1   (1 - a on ref_is)")
    ax_a.set_title(f"adaptive_mix's weight on k1 (window {ms['window']} steps)")
    ax_a.legend(loc="center right", frameon=False)
    handles = []
    base = est["k1"]["rmse"]
    for name in names:
        ratio = [a / b for a, b in zip(est[name]["rmse"][1:], base[1:], strict=True)]
        (h,) = ax_r.plot(kl[1:], ratio, color=colors[name], lw=1.3, label=name)
        handles.append(h)
    ax_r.set_xscale("log")
    ax_r.set_yscale("log")
    ax_r.set_xlabel("true KL(pi_theta ‖ pi_ref)")
    ax_r.set_ylabel(f"RMSE / RMSE of k1 ({dr['batch']} samples)")
    ax_r.set_title("Error relative to k1 (below 1: better than k1)")
    fig.legend(handles=handles, loc="outside lower center", ncol=4, frameon=False)
    fig.suptitle(
        f"Drift: pi_theta moves away from a Zipfian pi_ref ({dr['vocab']:,} tokens) in "
        f"{dr['steps']} steps; {dr['runs']:,} independent runs; 'k1 (2n samples)' spends the "
        f"mix's sample budget on k1 alone",
        fontsize=10,
    )
    _save(fig, path)
