"""The sections of ``klpo lab report``'s report.md, one function each, from the results dict.

Each section function takes the results of :func:`klpo.lab.report.run_report` and returns its
Markdown as a list of blocks; :func:`render` joins them. The verdicts on the claims about
``ref_is`` and ``adaptive_mix`` are in :mod:`klpo.lab.claims`.
"""

from __future__ import annotations

import math

import numpy as np

from klpo.lab import claims
from klpo.lab.markdown import closest, gradient_table, num, sig, table

__all__ = [
    "PLOTS",
    "cosines",
    "drift",
    "header",
    "mu_sweep",
    "oracles",
    "ref_is_variants",
    "render",
    "schulman",
    "timings",
]

PLOTS = {
    "mu_sweep": "mu_sweep.png",
    "gradient_cosines": "gradient_cosines.png",
    "ref_is_variants": "ref_is_variants.png",
    "drift": "drift.png",
}


def header(r: dict) -> list[str]:
    """The title, the run, and the notation."""
    p = r["preset"]
    s: list[str] = []
    add = s.append
    add("# klpo estimator lab report\n")
    add(
        f"Preset `{p['name']}`, seed {r['seed']}, klpo {r['klpo_version']}, torch "
        f"{r['machine']['torch']} ({r['machine']['threads']} threads); the whole suite took "
        f"{r['timings_s']['total']:.0f} s. Regenerate with `klpo lab report --out DIR"
        f"{' --quick' if p['name'] == 'quick' else ''}`. All numbers are in `results.json`.\n"
    )
    add(
        "Notation: pi_theta is the policy (it samples, except for `ref_is`), pi_ref the reference, "
        "d = log pi_theta(y) - log pi_ref(y). k1 = d, k2 = d²/2, k3 = exp(-d) + d - 1 are "
        "Schulman's estimators (see `klpo explain --all` for every estimator in `klpo.kl`). "
        "`ref_is` = mean of w log w over samples of pi_ref, w = pi_theta/pi_ref, and "
        "`adaptive_mix` = a k1 + (1 - a) ref_is are the estimators that the answer quoted in "
        'docs/claims.md calls "K2" and "K3"; they are not k2 and k3. `ref_is_clip` clips w to '
        "[0.1, 10] as that answer suggests. "
        "sd is the standard deviation of one sample; se a standard error.\n"
    )
    return s


def schulman(r: dict) -> list[str]:
    """Section 1: Schulman's table (Gaussians at mu = 0.1 and 1), published, exact, Monte Carlo."""
    p = r["preset"]
    s: list[str] = []
    add = s.append
    add("## 1. Schulman's table, reproduced\n")
    add(
        f"pi_theta = N(0, 1), pi_ref = N(mu, 1), true KL = mu²/2. *Published*: the 2020 post "
        f"(10⁷ samples). *Exact*: closed forms derived in `klpo.lab.exact` (mean and variance "
        f"of each estimator, from the moments of d for equal-variance Gaussians). *Monte Carlo*: "
        f"{p['schulman_samples']:,} samples; z = (Monte Carlo - exact) / se.\n"
    )
    rows = []
    for row in r["schulman"]:
        rows.append(
            [
                sig(row["mu"]),
                f"`{row['estimator']}`",
                sig(row["published_bias_rel"]),
                num(row["exact_bias_rel"], 4),
                f"{num(row['mc_bias_rel'], 4)} ± {num(row['mc_bias_rel_se'], 4)}",
                sig(row["published_sd_rel"]),
                num(row["exact_sd_rel"], 4),
                f"{num(row['mc_sd_rel'], 4)} ± {num(row['mc_sd_rel_se'], 4)}",
                f"{sig(row['z_mean'], 2)}, {sig(row['z_sd'], 2)}",
                "yes" if row["within_4se"] else "**no**",
            ]
        )
    add(
        table(
            [
                "mu",
                "estimator",
                "bias/KL published",
                "exact",
                "Monte Carlo ± se",
                "sd/KL published",
                "exact",
                "Monte Carlo ± se",
                "z (mean, sd)",
                "within 4 se",
            ],
            rows,
        )
    )
    add(
        "\nThe published 0.002 for k2 at mu = 0.1 is the exact 0.0025 seen through Monte Carlo "
        "noise (se ≈ 1.42/√10⁷ ≈ 4.5e-4). `ref_is` (not in the post) has a larger spread than "
        "k1 at both points.\n"
    )
    return s


def mu_sweep(r: dict) -> list[str]:
    """Section 2: value statistics of every estimator across the KL (Gaussians)."""
    s: list[str] = []
    add = s.append
    sw = r["mu_sweep"]
    add("## 2. Value statistics across the KL (Gaussians)\n")
    fails = [
        (name, sw["mu"][i], d["z_mean"][i], d["z_sd"][i])
        for name, d in sw["estimators"].items()
        for i in range(len(sw["mu"]))
        if not (abs(d["z_mean"][i]) <= 4 and abs(d["z_sd"][i]) <= 4)
    ]
    checks = 2 * len(sw["mu"]) * len(sw["estimators"])
    ris = sw["estimators"]["ref_is"]
    add(
        f"![bias and sd relative to the true KL]({PLOTS['mu_sweep']})\n\n"
        f"{len(sw['mu'])} values of mu from {sw['mu'][0]:g} to {sw['mu'][-1]:g}. *Exact*: every "
        f"estimator integrated by quadrature against the sampling density (it matches the closed "
        f"forms of section 1 to 1e-14; `adaptive_mix` at its steady-state weight). *Monte "
        f"Carlo*: {sw['samples']:,} samples per point. Estimators with identical values share a "
        f"line (k1 = k1+, k2 = k2+, k3 = k3+ = k3_is on-policy, abs = abs+). Monte Carlo mean and "
        f"sd agree with the exact values within 4 se in {checks - len(fails)} of {checks} checks"
        + (
            "; the exceptions: "
            + "; ".join(f"`{n}` at mu = {m:g} (z = {zm:.1f}, {zs:.1f})" for n, m, zm, zs in fails)
            + ". Heavy tails: exp(-d) in k3 and kl_ref_theta, and the weight w in ref_is, take "
            "rare, huge values that carry most of the variance; a finite sample rarely sees them, "
            "so its sd falls short of the exact one"
            if fails
            else ""
        )
        + (
            f". At KL {sw['true_kl'][-1]:.3g} the Monte Carlo sd / KL of `ref_is` is "
            f"{ris['sd_rel'][-1]:.3g} against the exact {ris['exact_sd_rel'][-1]:.3g}; it passes "
            f"the test only because its standard error, estimated from the same sample, is "
            f"inflated by the same tail.\n"
            if ris["exact_sd_rel"][-1] > 1.2 * ris["sd_rel"][-1]
            else ".\n"
        )
    )
    cols = [0, closest(sw["true_kl"], 0.1), len(sw["mu"]) - 1]
    rows = []
    for name, d in sw["estimators"].items():
        row = [f"`{name}`"]
        for i in cols:
            row += [
                num(d["exact_bias_rel"][i], 4),
                f"{num(d['exact_sd_rel'][i], 3)} ({num(d['sd_rel'][i], 3)})",
                num(d["exact_frac_negative"][i], 3),
            ]
        rows.append(row)
    header = ["estimator"]
    for i in cols:
        k = sw["true_kl"][i]
        header += [f"KL {k:.3g}: bias/KL", "sd/KL (Monte Carlo)", "P(< 0)"]
    add(table(header, rows))
    add("")
    return s


def oracles(r: dict) -> list[str]:
    """Sections 3 and 4: the categorical and 2-step sequence oracles (values, gradient tables)."""
    s: list[str] = []
    add = s.append
    for key, title, what in (
        (
            "categorical_oracle",
            "3. One categorical step (checked by hand)",
            "pi_theta = (0.7, 0.2, 0.1), pi_ref = (0.5, 0.3, 0.2), softmax logits log p; gradients "
            "with respect to the logits.",
        ),
        (
            "sequence_oracle",
            "4. A 2-step sequence model",
            "vocabulary {0, 1}, length 2, logits per prefix as in `SEQUENCE_ORACLE_SPEC`; values are sums over the "
            "sequence, KLs over whole sequences, gradients with respect to all 6 logits. "
            '"reward" = the detached per-token estimate as a reward with returns-to-go (REINFORCE, '
            'gamma 1); "loss" = the per-token term summed over the sequence, differentiated with '
            "the samples held fixed.",
        ),
    ):
        o = r[key]
        mc = o["monte_carlo"]
        add(f"## {title}\n")
        add(
            f"{what} KL(pi_theta ‖ pi_ref) = {o['kl']['theta_ref']:.6f}, KL(pi_ref ‖ pi_theta) = "
            f"{o['kl']['ref_theta']:.6f}. `adaptive_mix` is evaluated at its steady-state weight "
            f"a* = {o['mix_weight']:.4f} on k1.\n"
        )
        rows = []
        for name, v in o["values"].items():
            rows.append(
                [
                    f"`{name}`",
                    num(v["mean"], 6),
                    num(v["bias"], 6),
                    num(v["sd"], 4),
                    num(v["frac_negative"], 3),
                    f"{num(v['mc_mean'], 6)} ± {num(v['mc_stderr'], 6)}",
                ]
            )
        add(table(["estimator", "mean (exact)", "bias", "sd", "P(< 0)", "Monte Carlo ± se"], rows))
        add("\n**Gradient table** (exact, by enumeration):\n")
        add(gradient_table(o["gradients"]))
        add(
            f"\nMonte Carlo check ({mc['samples']:,} samples per sampler): "
            f"{mc['value_checks'] - mc['value_failures']} of {mc['value_checks']} value means and "
            f"{mc['gradient_checks'] - mc['gradient_failures']} of {mc['gradient_checks']} "
            f"gradient checks (largest per-component |z| of each estimator × placement) within "
            f"4 se; largest |z| {mc['max_abs_z_value']:.2f} (values), "
            f"{mc['max_abs_z_gradient']:.2f} (gradients).\n"
        )
    seq = r["sequence_oracle"]
    tr = seq["true_gradients"]["theta_ref"]
    k2l = seq["exact_gradients"]["k2"]["loss"]
    add(
        "At the root of the sequence model the per-token `k2` loss gives "
        f"({num(k2l[0][0], 6)}, {num(k2l[0][1], 6)}) where grad KL(pi_theta ‖ pi_ref) is "
        f"({num(tr[0][0], 6)}, {num(tr[0][1], 6)}): it misses how the first token changes the KL "
        "of the second. At the last position they agree. `k1` in the reward with returns-to-go, "
        "`k3` in reward + loss, `full` in reward + loss and `ref_is` in the loss follow the "
        "sequence-level gradient exactly.\n"
    )
    return s


def cosines(r: dict) -> list[str]:
    """Section 5: which gradient each estimator × placement follows, on random categoricals."""
    s: list[str] = []
    add = s.append
    cos = r["gradient_cosines"]
    add("## 5. Which gradient each estimator × placement follows, across random categoricals\n")
    add(
        f"![cosines]({PLOTS['gradient_cosines']})\n\n"
        f"Random LM-like categoricals (Zipf policy over {cos['vocab']:,} tokens, reference a "
        f"perturbed copy with the KL set by bisection), {cos['draws']} per KL; exact expected "
        f"gradients by enumeration. Mean cosine to each true gradient:\n"
    )
    rows = []
    for key, d in cos["rows"].items():
        name, placement = key.split("|")
        rows.append(
            [f"`{name}`", placement]
            + [
                f"{num(a, 2)} / {num(b, 2)}"
                for a, b in zip(d["cos_theta_ref"], d["cos_ref_theta"], strict=True)
            ]
        )
    add(
        table(
            ["estimator", "placement"] + [f"KL {k:g}: θ‖ref / ref‖θ" for k in cos["kl"]],
            rows,
        )
    )
    clip = cos["rows"]["ref_is_clip|loss"]
    mix = cos["rows"]["adaptive_mix|loss"]
    add(
        "\nA cosine ignores scale: `k1+` in reward + loss has cosine 1 but is twice the gradient "
        "(relative error 1 in the tables above). Where every weight stays inside the clip, "
        "`ref_is_clip` in the loss is exact; once weights reach 10 its gradient turns "
        f"(cosine {clip['cos_theta_ref'][-1]:.2f} to grad KL(pi_theta ‖ pi_ref) at KL "
        f"{cos['kl'][-1]:g}). `adaptive_mix` in the loss has gradient (1 - a) × ref_is's, since "
        "k1's loss gradient is zero; with gamma > 0 the weight a → 1 as the KL grows, so the "
        "gradient vanishes exactly when the penalty should bite"
        + (
            f" ('zero' at KL {cos['kl'][-1]:g}).\n"
            if not math.isfinite(mix["cos_theta_ref"][-1])
            else ".\n"
        )
    )
    return s


def ref_is_variants(r: dict) -> list[str]:
    """Section 6: ``ref_is`` variants' bias and spread against the KL."""
    s: list[str] = []
    add = s.append
    var = r["ref_is_variants"]
    add("## 6. ref_is variants against the KL\n")
    add(
        f"![ref_is variants]({PLOTS['ref_is_variants']})\n\n"
        f"Random LM-like categoricals (vocabulary {var['vocab']:,}), one per KL; batches of "
        f"{var['batch']} samples. For estimators that are means of per-sample terms the bias and "
        f"sd of the batch estimate are exact (enumeration; sd = per-sample sd / √{var['batch']}); "
        f"the dynamic clip and self-normalisation act on the whole batch and are measured by Monte "
        f"Carlo ({var['batches']:,} batches). Cells: bias/KL, sd/KL; Monte Carlo in brackets.\n"
    )
    rows = []
    for name, d in var["estimators"].items():
        cells = []
        for i in range(len(var["kl"])):
            mc = f"({num(d['bias_rel'][i], 3)}, {num(d['sd_rel'][i], 3)})"
            if math.isfinite(d["exact_bias_rel"][i]):
                cells.append(
                    f"{num(d['exact_bias_rel'][i], 3)}, {num(d['exact_sd_rel'][i], 3)} {mc}"
                )
            else:
                cells.append(mc)
        rows.append([f"`{name}`", *cells])
    rows.append(["largest weight seen", *(sig(x) for x in var["max_weight"])])
    rows.append(["effective sample size", *(f"{100 * x:.1f}%" for x in var["ess_fraction"])])
    add(table(["estimator"] + [f"KL {k:.3g}" for k in var["kl"]], rows))
    add("")
    return s


def drift(r: dict) -> list[str]:
    """Section 7: ``adaptive_mix`` while pi_theta drifts away from pi_ref."""
    s: list[str] = []
    add = s.append
    dr = r["drift"]
    ms = dr["mix_settings"]
    add("## 7. Drift: adaptive_mix while pi_theta moves away from pi_ref\n")
    add(
        f"![drift]({PLOTS['drift']})\n\n"
        f"A Zipfian reference over {dr['vocab']:,} tokens; the policy's logits move along a fixed "
        f"random direction in {dr['steps']} equal steps until KL = {dr['max_kl']:g}. "
        f"{dr['runs']} independent runs; each step draws {dr['batch']} samples of pi_ref and "
        f"{2 * dr['batch']} of pi_theta. `adaptive_mix` mixes k1 and ref_is ({dr['batch']} "
        f"samples each) with threshold {ms['threshold']:g} nats, window {ms['window']} steps, "
        f"and gamma = {ms['gamma_as_written']:+g} (the formula as written) or "
        f"{ms['gamma_as_described']:+g} (what its prose describes).\n"
    )
    idx = [closest(dr["true_kl"], k) for k in (0.01, 0.1, 0.5, 1.0, dr["max_kl"])]
    rows = []
    for name, d in dr["estimators"].items():
        rows.append(
            [f"`{name}`"]
            + [f"{num(d['mean'][i], 3)} / {num(d['rmse'][i], 3)}" for i in idx]
            + [num(float(np.mean(d["rmse"])), 4)]
        )
    for label, a in dr["mix_weight_on_k1"].items():
        short = label.removeprefix("adaptive_mix (").removesuffix(")")
        rows.append([f"weight a on k1, {short}"] + [num(a[i], 3) for i in idx] + [""])
    add(
        table(
            ["estimator"]
            + [f"KL {dr['true_kl'][i]:.3g}: mean / RMSE" for i in idx]
            + ["mean RMSE"],
            rows,
        )
    )
    add("")
    return s


def timings(r: dict) -> list[str]:
    """The timings table."""
    s: list[str] = []
    add = s.append
    add("## Timings\n")
    add(table(["part", "seconds"], [[k, f"{v:.1f}"] for k, v in r["timings_s"].items()]))
    add("")
    return s


def render(r: dict) -> str:
    """report.md from the results."""
    s: list[str] = []
    for section in (
        header,
        schulman,
        mu_sweep,
        oracles,
        cosines,
        ref_is_variants,
        drift,
        claims.section,
        timings,
    ):
        s += section(r)
    return "\n".join(s)
