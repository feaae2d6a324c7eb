"""verl's ``algorithm.rollout_correction``, read by the doctor.

Each expectation is written from verl 0.9.1's source: ``trainer/ppo/rollout_corr_helper.py``
(the IS weight: token ``min(r, C)`` or IcePop's ``[lower, upper]``, or the sequence's product; the
rejection options ``token_k*``, ``seq_sum_k*``, ``seq_mean_k*``, ``seq_max_k2/k3``, all of which
must pass; the threshold texts, a k1 option's single ``t`` meaning ``1/t_t``),
``trainer/ppo/ray_trainer.py`` (decoupled mode: once per batch, on the recomputed pi_old and the
engine's log-probs, before the advantages; skipped where the batch has no rollout_log_probs) and
``trainer/ppo/core_algos.py`` (bypass mode). The oracle for each translated mask is verl's rule
written out here, token by token, against klpo's own ``offpolicy.trm_mask`` under the keys the
doctor prints.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from klpo import offpolicy
from klpo.doctor import diagnose, read, verl_hydra
from klpo.doctor.verl_rollout_corr import RC, is_threshold, rs_thresholds

FIX = Path(__file__).parent / "fixtures"
CMD = "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo actor_rollout_ref.rollout.n=4 "


def _run(tmp_path, *overrides: str) -> dict:
    cfg = tmp_path / "run.sh"
    cfg.write_text(CMD + " ".join(overrides) + "\n")
    return diagnose(cfg)


def _rc(overrides: dict[str, object]) -> list[str]:
    return [f"{RC}.{k}={v}" for k, v in overrides.items()]


def _found(d: dict) -> list[tuple[str, str]]:
    """The findings about the correction, (level, text)."""
    return [
        (f["level"], f["text"])
        for f in d["findings"]
        if any(k.startswith(RC) or k.endswith("calculate_log_probs") for k in f["keys"])
    ]


def _keys(d: dict) -> dict[str, object]:
    """The equivalent's keys the correction decides."""
    eq = d["equivalent"]["config"]
    algo, rollout = eq["algo"], eq["rollout"]
    out = {f"rollout.{k}": rollout[k] for k in ("engine", "tis_cap") if k in rollout}
    out.update({f"algo.{k}": v for k, v in algo.items() if k.startswith("trm_")})
    return out


def _diffs(d: dict) -> list[str]:
    return [t for t in d["equivalent"]["differences"] if "trm" in t or RC in t]


HOW = (
    f"{RC} (bypass_mode=false, decoupled): once per batch, before the advantages, verl compares "
    "the trainer's recomputed log-probs pi_old with the rollout engine's pi_rollout, r = pi_old / "
    "pi_rollout per token (rollout_corr_helper.py), fixed over the update; klpo does the same "
    "with rollout.engine=vllm (pi_old from its own score pass, pi_behav the engine's log-probs)"
)
KL_LOSS = (
    "the KL loss (use_kl_loss) is kl_penalty(pi_theta, pi_ref) over response_mask, unweighted "
    "(workers/utils/losses.py)"
)
KL_MASKED = (
    "the rejection rewrites response_mask before the advantages, so a rejected token leaves the "
    "policy loss, the KL loss, the entropy bonus and the loss's token count"
)
NO_ENGINE_WEIGHT = "klpo's KL term takes no engine weight either (docs/engines.md)"
NO_WEIGHT = f"the reference KL term gets no importance weight from {RC}"
TRM_ONLY_POLICY = (
    "algo.trm_delta masks the policy loss only: klpo's KL term and entropy bonus keep the tokens "
    "of the completions it drops, which still count in the loss's normaliser; verl's rejection "
    "removes them from response_mask, so from all of these"
)
KL_ON = "actor_rollout_ref.actor.use_kl_loss=true"


def test_token_tis_is_klpos_tis_cap_with_the_engine(tmp_path):
    d = _run(tmp_path, KL_ON, *_rc({"rollout_is": "token", "rollout_is_threshold": 3.0}))
    assert _found(d) == [
        ("note", HOW),
        (
            "note",
            f"{RC}.rollout_is=token, rollout_is_threshold=3.0: each token's policy loss is "
            "multiplied by the detached min(r, 3) (truncated IS); klpo: rollout.tis_cap=3 with "
            "rollout.engine=vllm, the same weight on the same per-token loss",
        ),
        ("note", f"{NO_WEIGHT}; {KL_LOSS}; {NO_ENGINE_WEIGHT}"),
    ]
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": 3.0}
    assert _diffs(d) == []
    assert d["equivalent"]["invalid"] is None
    assert not [k for k in d["equivalent"]["unmapped"] if k.startswith(RC)]


def test_an_in_reward_kl_is_named_as_weighted_through_the_advantage(tmp_path):
    d = _run(
        tmp_path, "algorithm.use_kl_in_reward=true", *_rc({"rollout_is": "token"})
    )  # rollout_is_threshold: verl's default 2.0
    [kl_note] = [t for _, t in _found(d) if t.startswith(NO_WEIGHT)]
    assert kl_note == (
        f"{NO_WEIGHT}; the in-reward KL (use_kl_in_reward) is inside the advantage, so the policy "
        f"loss's IS weight multiplies it as it does the reward; {NO_ENGINE_WEIGHT}"
    )
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": 2.0}


@pytest.mark.parametrize(
    ("option", "threshold", "keys", "what"),
    [
        (
            "seq_max_k3",
            0.01,
            {"algo.trm_delta": 0.01, "algo.trm_statistic": "k3", "algo.trm_aggregate": "max"},
            "(threshold 0.01): a completion whose r - 1 - log r, the largest over its tokens, is "
            "above 0.01 is rejected whole; klpo: algo.trm_delta=0.01, algo.trm_statistic=k3, "
            "algo.trm_aggregate=max (the same statistic)",
        ),
        (
            "seq_mean_k3",
            0.002,
            {"algo.trm_delta": 0.002, "algo.trm_statistic": "k3", "algo.trm_aggregate": "mean"},
            "(threshold 0.002): a completion whose r - 1 - log r, averaged over its tokens, is "
            "above 0.002 is rejected whole; klpo: algo.trm_delta=0.002, algo.trm_statistic=k3, "
            "algo.trm_aggregate=mean (the same statistic)",
        ),
        (
            "seq_mean_k1",
            "0.5_2.0",
            {"algo.trm_delta": math.log(2.0), "algo.trm_statistic": "k1", "algo.trm_aggregate": "mean"},
            "(ratio bounds 0.5_2): a completion whose -log r, averaged over its tokens, is outside "
            "[log 0.5, log 2] is rejected whole; klpo: algo.trm_delta=0.693147, "
            "algo.trm_statistic=k1, algo.trm_aggregate=mean (|mean -log r| <= log 2)",
        ),
        (
            "seq_mean_k1",
            2.0,  # one k1 bound t: verl reads 1/t_t
            {"algo.trm_delta": math.log(2.0), "algo.trm_statistic": "k1", "algo.trm_aggregate": "mean"},
            "(ratio bounds 0.5_2): a completion whose -log r, averaged over its tokens, is outside "
            "[log 0.5, log 2] is rejected whole; klpo: algo.trm_delta=0.693147, "
            "algo.trm_statistic=k1, algo.trm_aggregate=mean (|mean -log r| <= log 2)",
        ),
        (
            "seq_max_k2",
            0.02,
            {"algo.trm_delta": math.sqrt(0.04), "algo.trm_statistic": "k1", "algo.trm_aggregate": "max"},
            "(threshold 0.02): a completion whose (log r)^2 / 2, the largest over its tokens, is "
            "above 0.02 is rejected whole; klpo: algo.trm_delta=0.2, algo.trm_statistic=k1, "
            "algo.trm_aggregate=max (max (log r)^2 / 2 <= 0.02 is max |log r| <= sqrt(2 * 0.02))",
        ),
    ],
)  # fmt: skip
def test_sequence_rejection_is_trust_region_masking(tmp_path, option, threshold, keys, what):
    d = _run(tmp_path, KL_ON, *_rc({"rollout_rs": option, "rollout_rs_threshold": threshold}))
    assert _found(d) == [
        ("note", HOW),
        ("note", f"{RC}.rollout_rs={option} {what}"),
        ("note", f"{NO_WEIGHT}; {KL_LOSS}; {KL_MASKED}; {NO_ENGINE_WEIGHT}"),
    ]
    # No IS weight in verl (rollout_is: null): none in klpo either, against its default 2.0.
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": None, **keys}
    assert _diffs(d) == [TRM_ONLY_POLICY]
    assert d["equivalent"]["invalid"] is None


def _verl_keep(option: str, log_r: torch.Tensor, mask: torch.Tensor, lo, hi) -> list[bool]:
    """verl's rule for one sequence option, written out token by token (log r clamped to
    [-20, 20]; k1 kept inside [log lo, log hi], the others at or below hi)."""
    keep = []
    for row, m in zip(log_r.tolist(), mask.tolist(), strict=True):
        xs = [max(-20.0, min(20.0, x)) for x, v in zip(row, m, strict=True) if v]
        est = option.rsplit("_", 1)[1]
        per = {
            "k1": [-x for x in xs],
            "k2": [0.5 * x * x for x in xs],
            "k3": [math.exp(x) - 1 - x for x in xs],
        }[est]
        stat = max(per) if option.startswith("seq_max") else sum(per) / len(per)
        keep.append(math.log(lo) <= stat <= math.log(hi) if est == "k1" else stat <= hi)
    return keep


@pytest.mark.parametrize(
    ("option", "threshold"),
    [("seq_max_k3", 0.05), ("seq_mean_k3", 0.02), ("seq_mean_k1", "0.8_1.25"),
     ("seq_mean_k1", 1.1), ("seq_max_k2", 0.08)],
)  # fmt: skip
def test_the_translated_mask_is_verls_rejection(tmp_path, option, threshold):
    """Oracle: verl's rule above, on log-ratios spread over its thresholds; klpo's trm_mask
    under the printed keys keeps exactly the same completions."""
    d = _run(tmp_path, *_rc({"rollout_rs": option, "rollout_rs_threshold": threshold}))
    keys = _keys(d)
    gen = torch.Generator().manual_seed(0)
    log_r = torch.randn(400, 12, generator=gen, dtype=torch.float64) * 0.3
    log_r[::7] *= 0.1
    log_r += torch.randn(400, 1, generator=gen, dtype=torch.float64) * 0.2  # a drift per row
    mask = torch.rand(400, 12, generator=gen) > 0.2
    mask[:, 0] = True
    behav = torch.randn(400, 12, generator=gen, dtype=torch.float64) - 2.0
    klpo_keep = offpolicy.trm_mask(
        behav + log_r,  # pi_old's log-probs: log r = log pi_old - log pi_behav
        behav,
        mask,
        delta=keys["algo.trm_delta"],
        statistic=keys["algo.trm_statistic"],
        aggregate=keys["algo.trm_aggregate"],
    ).any(-1)
    [(lo, hi)] = rs_thresholds([option], threshold).values()
    verl_keep = _verl_keep(option, log_r, mask, lo, hi)
    assert 20 < sum(verl_keep) < 380  # the thresholds cut through the batch
    assert klpo_keep.tolist() == verl_keep


@pytest.mark.parametrize(
    ("overrides", "found", "diff"),
    [
        (
            {"rollout_is": "sequence", "rollout_is_threshold": 5.0},
            f"{RC}.rollout_is=sequence, rollout_is_threshold=5.0: every token of a completion is "
            "weighted by its sequence ratio R = prod_t r_t (exp of the summed log r, clamped to "
            "[-20, 20]), min(R, 5); no klpo equivalent (klpo's TIS weight is per token): the "
            "equivalent applies none (rollout.tis_cap: null)",
            f"no klpo equivalent for {RC}.rollout_is=sequence (a sequence-level IS weight): the "
            "equivalent has rollout.tis_cap: null",
        ),
        (
            {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"},
            f"{RC}.rollout_is=token, rollout_is_threshold=0.5_5.0: each token's policy loss is "
            "weighted by r kept where 0.5 <= r <= 5, 0 outside (IcePop): tokens outside get no "
            "policy gradient; no klpo equivalent (klpo's TIS truncates at the cap and zeroes "
            "nothing): the equivalent applies no weight (rollout.tis_cap: null)",
            f"no klpo equivalent for {RC}.rollout_is_threshold=0.5_5.0 (IcePop's lower_upper "
            "bounds, zero weight outside): the equivalent has rollout.tis_cap: null",
        ),
    ],
)  # fmt: skip
def test_is_weights_klpo_lacks_are_named_not_translated(tmp_path, overrides, found, diff):
    d = _run(tmp_path, KL_ON, *_rc(overrides))
    assert ("warning", found) in _found(d)
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": None}
    assert _diffs(d) == [diff]


@pytest.mark.parametrize(
    ("option", "threshold", "head", "why"),
    [
        ("token_k3", 0.1, "(threshold 0.1): a token whose r - 1 - log r is above 0.1 is "
         "rejected, alone", "klpo's mask drops whole completions; verl's drops the token alone"),
        ("seq_sum_k1", "0.5_2.0", "(ratio bounds 0.5_2): a completion whose -log r, summed over "
         "its tokens, is outside [log 0.5, log 2] is rejected whole",
         "klpo's statistic is a completion's max or mean, not its sum"),
        ("seq_mean_k2", 0.01, "(threshold 0.01): a completion whose (log r)^2 / 2, averaged "
         "over its tokens, is above 0.01 is rejected whole",
         "klpo has no k2 statistic, and a mean of (log r)^2 / 2 is no k1 or k3 mean"),
        ("seq_mean_k1", "0.999_1.001", "(ratio bounds 0.999_1.001): a completion whose -log r, "
         "averaged over its tokens, is outside [log 0.999, log 1.001] is rejected whole",
         "klpo's k1 band is symmetric, |mean -log r| <= delta; verl's is [log 0.999, log 1.001] "
         "= [-0.0010005, 0.0009995] (the nearest symmetric band inside it: delta = 0.0009995)"),
    ],
)  # fmt: skip
def test_rejection_klpo_lacks_is_named_not_translated(tmp_path, option, threshold, head, why):
    d = _run(tmp_path, *_rc({"rollout_rs": option, "rollout_rs_threshold": threshold}))
    assert ("warning", f"{RC}.rollout_rs={option} {head}; no klpo equivalent ({why})") in _found(d)
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": None}
    assert _diffs(d) == [
        f"no klpo equivalent for {RC}.rollout_rs={option}: the equivalent does not reject by it"
    ]


def test_several_rejection_options_keep_klpos_one_mask_for_the_first(tmp_path):
    d = _run(
        tmp_path,
        *_rc({"rollout_rs": "'seq_max_k3,seq_mean_k3'", "rollout_rs_threshold": "'0.05,0.01'"}),
    )
    texts = [t for _, t in _found(d)]
    assert any(t.endswith("algo.trm_aggregate=max (the same statistic)") for t in texts)
    assert (
        f"{RC}.rollout_rs=seq_mean_k3 (threshold 0.01): a completion whose r - 1 - log r, "
        "averaged over its tokens, is above 0.01 is rejected whole; no klpo equivalent (klpo has "
        "one trust-region mask, given to seq_max_k3)"
    ) in texts
    assert _keys(d)["algo.trm_delta"] == 0.05
    assert (
        f"no klpo equivalent for {RC}.rollout_rs=seq_mean_k3: the equivalent does not reject by it"
        in _diffs(d)
    )


def test_batch_normalised_weights_are_named(tmp_path):
    d = _run(tmp_path, *_rc({"rollout_is": "token", "rollout_is_batch_normalize": "true"}))
    assert (
        "warning",
        f"{RC}.rollout_is_batch_normalize=true: verl divides the weights by their mean over the "
        "batch's tokens (across ranks); no klpo equivalent: klpo's weight is not normalised",
    ) in _found(d)
    assert _keys(d)["rollout.tis_cap"] == 2.0
    assert _diffs(d) == [
        f"no klpo equivalent for {RC}.rollout_is_batch_normalize=true: klpo's min(r, 2) is not "
        "divided by its batch mean"
    ]


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        ({"rollout_is": "tokens"}, "rollout_is", "'tokens' is not one of null, token, sequence"),
        (
            {"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0},
            "rollout_rs",
            "'seq_max_k1': 'seq_max_k1' not among verl's options (comma-separated, all must "
            "pass): null, token_k1, token_k2, token_k3, seq_sum_k1, seq_sum_k2, seq_sum_k3, "
            "seq_mean_k1, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3",
        ),
        (
            {"rollout_rs": "seq_max_k3"},
            "rollout_rs_threshold",
            "rollout_rs_threshold must be given when rollout_rs is set",
        ),
        (
            {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": "0.1_0.2"},
            "rollout_rs_threshold",
            "seq_max_k3 takes one upper bound, not '0.1_0.2'",
        ),
        (
            {"rollout_is": "token", "rollout_is_threshold": "\"'2_1.5'\""},
            "rollout_is_threshold",
            "'2_1.5': the lower bound must be <= the upper bound",
        ),
        (
            {"bypass_mode": "true", "loss_type": "ppo"},
            "loss_type",
            "'ppo' is not one of ppo_clip, reinforce",
        ),
    ],
)
def test_unknown_modes_are_refused_naming_the_key_and_the_values(tmp_path, overrides, key, why):
    d = _run(tmp_path, *_rc(overrides))
    errors = [f for f in d["findings"] if f["level"] == "error"]
    assert [(list(f["keys"]), f["text"]) for f in errors] == [
        (
            [f"{RC}.{key}"],
            f"{RC}.{key}: {why}; verl raises ValueError at the first step's rollout correction "
            "(it checks none of these at start-up) and the run stops",
        )
    ]
    assert "engine" not in d["equivalent"]["config"]["rollout"]


def test_bypass_mode_has_no_klpo_equivalent(tmp_path):
    d = _run(
        tmp_path,
        KL_ON,
        *_rc({"bypass_mode": "true", "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.01}),
    )
    [(level, text)] = [f for f in _found(d) if "bypass_mode=true:" in f[1]]
    assert level == "warning"
    assert "PPO's ratio is pi_theta / pi_rollout" in text
    assert "loss_type=ppo_clip: PPO's clipped loss on that ratio" in text
    assert "No klpo equivalent: klpo always scores pi_old itself" in text
    assert (
        "note",
        f"{NO_WEIGHT}, and in bypass mode no rejection either: the KL loss (use_kl_loss) keeps "
        "every token of response_mask, unweighted (workers/utils/losses.py); klpo's KL term "
        "takes no engine weight either",
    ) in _found(d)
    assert _keys(d) == {"rollout.engine": "vllm", "rollout.tis_cap": None}
    assert _diffs(d) == [
        f"no klpo equivalent for {RC}.bypass_mode=true (loss_type=ppo_clip): the equivalent has "
        "rollout.engine=vllm, rollout.tis_cap: null and no mask",
        f"{RC}.rollout_rs=seq_mean_k3 in bypass mode reads the evolving pi_theta; klpo's "
        "algo.trm_delta reads pi_old, the same at the first update only (the nearest: "
        "algo.trm_delta=0.01, algo.trm_statistic=k3, algo.trm_aggregate=mean): not in the "
        "equivalent",
    ]


def test_no_engine_log_probs_skips_the_correction(tmp_path):
    key = "actor_rollout_ref.rollout.calculate_log_probs"
    d = _run(tmp_path, f"{key}=false", *_rc({"rollout_is": "token"}))
    assert _found(d) == [
        (
            "warning",
            f"{key}=false: the rollout engine reports no log-probs, and verl's trainer skips {RC} "
            "without a word (it runs only where rollout_log_probs is in the batch): no importance "
            "weight, no rejection; the equivalent has none either",
        )
    ]
    assert _keys(d) == {}
    d = _run(tmp_path, f"{key}=false", *_rc({"bypass_mode": "true"}))
    assert [lv for lv, _ in _found(d)] == ["error"]


def test_settings_without_their_switch_are_ignored(tmp_path):
    d = _run(tmp_path, *_rc({"rollout_is_threshold": 3.0, "loss_type": "reinforce"}))
    assert _found(d) == [
        (
            "warning",
            f"set but ignored: {RC}.rollout_is_threshold, {RC}.loss_type (rollout_is_threshold "
            "and rollout_is_batch_normalize act only with rollout_is set, rollout_rs_threshold "
            "only with rollout_rs, loss_type only with bypass_mode=true)",
        )
    ]
    assert _keys(d) == {}


def test_a_threshold_hydra_reads_as_one_number_is_named(tmp_path):
    """Hydra's grammar takes ``0.5_5`` for 0.55 (a digit separator), as Python's float does."""
    d = _run(tmp_path, *_rc({"rollout_is": "token", "rollout_is_threshold": "0.5_5"}))
    assert (
        "warning",
        f"{RC}.rollout_is_threshold=0.5_5: Hydra reads this as the number 0.55 (an underscore "
        "between digits is a digit separator), not as the bounds lower_upper; quote it for Hydra "
        f"({RC}.rollout_is_threshold=\"'0.5_5'\") to give two bounds",
    ) in _found(d)
    assert _keys(d)["rollout.tis_cap"] == 0.55
    # Quoted for Hydra, it is the text, IcePop's two bounds: no warning, no klpo weight.
    d = _run(tmp_path, *_rc({"rollout_is": "token", "rollout_is_threshold": "\"'0.5_5'\""}))
    assert not [t for lv, t in _found(d) if "Hydra reads" in t]
    assert any("r kept where 0.5 <= r <= 5, 0 outside (IcePop)" in t for _, t in _found(d))
    assert _keys(d)["rollout.tis_cap"] is None


def test_the_default_correction_changes_nothing(tmp_path):
    d = _run(tmp_path, KL_ON)
    assert _found(d) == []
    assert _keys(d) == {}


def test_threshold_parsers_are_verls():
    assert is_threshold(2.0) == (2.0, None)
    assert is_threshold("0.5_5.0") == (5.0, 0.5)
    assert rs_thresholds(["seq_mean_k1", "seq_max_k3"], "2.0") == {
        "seq_mean_k1": (0.5, 2.0),
        "seq_max_k3": (None, 2.0),
    }
    assert rs_thresholds(["token_k1", "seq_max_k2"], "0.9_1.2, 0.3") == {
        "token_k1": (0.9, 1.2),
        "seq_max_k2": (None, 0.3),
    }
    for bad in (True, "", "a_b", -1.0, "0_2"):
        with pytest.raises(ValueError):
            is_threshold(bad)
    with pytest.raises(ValueError, match="2 thresholds for 3 rollout_rs options"):
        rs_thresholds(["token_k1", "token_k2", "token_k3"], "1.5,0.1")
    with pytest.raises(ValueError, match="lower <= upper"):
        rs_thresholds(["seq_mean_k1"], 0.5)  # 1/0.5 = 2 > 0.5


@pytest.mark.skipif(not verl_hydra.have_hydra(), reason="needs hydra-core")
def test_composed_by_hydra_it_reads_as_with_the_table(tmp_path):
    root = tmp_path / "verl-repo"
    shutil.copytree(FIX / "verl_checkout", root)
    words = [
        KL_ON,
        *_rc({"rollout_is": "token", "rollout_is_threshold": 1.5}),
        *_rc({"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.02}),
    ]
    (root / "run.sh").write_text(CMD + " ".join(words) + "\n")
    (tmp_path / "run.sh").write_text(CMD + " ".join(words) + "\n")
    composed, tabled = read(root / "run.sh"), read(tmp_path / "run.sh")
    assert "composed by Hydra" in composed.defaults_from
    assert composed.findings == tabled.findings
    assert composed.equivalent == tabled.equivalent
    assert composed.equivalent["algo"]["trm_delta"] == 0.02
    assert composed.equivalent["rollout"]["tis_cap"] == 1.5


def test_an_older_verls_correction_keys_are_named_not_dropped(tmp_path):
    """verl 0.7's rollout_rs_threshold_lower and 0.6's flat algorithm.rollout_is_level are
    not verl 0.9.1's: a warning names them, whatever composed them."""
    d = _run(
        tmp_path,
        f"+{RC}.rollout_rs_threshold_lower=0.5",
        "+algorithm.rollout_is_level=token",
    )
    [w] = [f for f in d["findings"] if f["text"].startswith("not read: ")]
    assert w["level"] == "warning"
    assert list(w["keys"]) == [f"{RC}.rollout_rs_threshold_lower", "algorithm.rollout_is_level"]
    assert f"verl 0.9.1's rollout correction is {RC} with only rollout_is," in w["text"]
    assert _keys(d) == {}
