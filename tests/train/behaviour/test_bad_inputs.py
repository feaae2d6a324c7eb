"""Bad inputs that passed the checks, or failed with no cause named, now answered where they are
given: each case's message names the value and the fix (and nothing is started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from klpo import kl
from klpo.train.config import ConfigError, build_config, load_config
from klpo.train.config_files import load_configs
from klpo.train.loop import _divergence_advice
from klpo.train.preflight import check_eval_cache


@pytest.mark.parametrize(
    ("override", "words"),
    [
        ("kl.beta=.inf", "kl.beta: Input should be a finite number"),
        ("optim.lr=nan", "optim.lr: Input should be a finite number"),
        ("rollout.staleness=true", "rollout.staleness: is a whole number, not true"),
        ("rollout.group_size=false", "rollout.group_size: is a whole number, not false"),
        ("kl.behaviour_correction=is-cap", "kl.behaviour_correction=is-cap caps the weight"),
    ],
)
def test_a_value_that_would_be_taken_silently_is_refused_by_name(override, words) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        build_config(overrides=[override])


def test_is_cap_with_a_stale_sampler_is_accepted() -> None:
    cfg = build_config(overrides=["kl.behaviour_correction=is-cap", "rollout.staleness=1"])
    assert cfg.kl.behaviour_correction == "is-cap"


def test_a_dotted_set_under_a_value_says_it_would_make_a_mapping() -> None:
    with pytest.raises(
        ConfigError, match=r"rollout.staleness is one value \(default 0\).*rollout.staleness=VALUE"
    ):
        load_configs([], ["rollout.staleness.k=1"])


def test_a_config_nested_past_the_parsers_stack_is_named(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 3000 + "]" * 3000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(deep)
    out = subprocess.run(
        [sys.executable, "-m", "klpo", "doctor", str(deep)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        out.returncode != 0 and "nested too deeply" in out.stderr and "Traceback" not in out.stderr
    )


def test_an_eval_cache_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "cache"
    f.write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_eval_cache(str(f))
    with pytest.raises(ConfigError, match="is a file, so no directory can be made under it"):
        check_eval_cache(str(f / "sub"))
    check_eval_cache(str(tmp_path / "new"))  # made on first use: fine


def test_divergence_advice_names_a_huge_beta_and_no_beta_without_a_kl() -> None:
    big = build_config(overrides=["kl.beta=1e30"])
    assert "kl.beta=1e+30 is large" in _divergence_advice(
        big
    ) and "lower kl.beta" in _divergence_advice(big)
    none = build_config(overrides=["kl.placement=none"])
    assert _divergence_advice(none) == "Lower optim.lr."
    plain = build_config()
    assert "raise kl.beta" in _divergence_advice(plain)


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (lambda logp: logp, "must take \\(logp, logp_ref\\) positionally"),
        (
            lambda logp, logp_ref: (logp - logp_ref).sum(),
            "a tensor of shape \\(1, 3\\).*returned \\(\\)",
        ),
        (lambda logp, logp_ref: 0.5, "returned float"),
        (lambda logp, logp_ref: logp[5], "failed on a small input"),
    ],
)
def test_register_refuses_a_function_of_the_wrong_arity_or_shape(
    fn, words, scratch_registry
) -> None:
    with pytest.raises(ValueError, match=words):
        kl.register("bad", kl.Spec(fn, kl.THETA_REF, "x", "weighted", "k2"))
    assert "bad" not in kl.SPECS


def test_explain_refuses_an_estimator_whose_answer_is_not_finite(scratch_registry) -> None:
    kl.register(
        "nan", kl.Spec(lambda a, b: (a - b) * torch.nan, kl.THETA_REF, "nan", "weighted", "k2")
    )
    with pytest.raises(ValueError, match="non-finite expected value or gradient"):
        kl.explain("nan", "loss")


def test_explain_staleness_refuses_a_sampler_too_far_behind_for_float64() -> None:
    from klpo.lab.staleness import staleness_rows

    with pytest.raises(ValueError, match=r"ask for K <= 100 at this step"):
        staleness_rows(100_000, estimators=["k3"], step=0.2)


def test_a_reward_beyond_float32_is_refused_naming_the_function_and_the_overflow(
    tiny_model, quick, tmp_path
) -> None:
    """1e300 is finite in Python and inf in the trainer's float32 tensors: it was refused as
    "rewards must be finite; non-finite at indices [1, 3]", naming neither the function nor why."""
    from klpo.train import loop
    from klpo.train.rewards.functions import RewardError

    over = quick(tiny_model, tmp_path / "run",
                 rewards="[{name: 'klpo_test_rewards:overflowing_reward'}]")  # fmt: skip
    with pytest.raises(RewardError) as err:
        loop.train(build_config(overrides=over), log=lambda _m: None)
    msg = str(err.value)
    assert "reward function 'klpo_test_rewards:overflowing_reward' returned values" in msg, msg
    assert "overflow float32 (|x| > 3.4e38" in msg and "at samples [1, 3" in msg, msg
    assert "1e+300, -1e+300" in msg and "smaller scale" in msg, msg


def test_a_weighted_sum_beyond_float32_names_the_weights() -> None:
    """Each value fits float32, the weighted sum does not: said of the sum, with its terms."""
    from klpo.train.rewards.functions import RewardError, WeightedReward, combined_rewards, score

    def big(prompts, completions, answers):
        return [3e38, 1.0]

    assert score(big, "big", ["p", "q"], ["a", "b"], ["", ""]) == [3e38, 1.0]  # 3e38 < 3.4e38
    with pytest.raises(RewardError, match=r"weighted sum .* at samples \[0\] .*'big' × 2"):
        combined_rewards([WeightedReward("big", big, 2.0)], ["p", "q"], ["a", "b"], ["", ""])
    assert combined_rewards([WeightedReward("big", big, 1.0)], ["p", "q"], ["a", "b"], ["", ""])


def test_a_one_row_dataset_is_noted_at_the_start(tiny_model, quick, tmp_path) -> None:
    """One row (or fewer distinct prompts than a step samples) trains copies of the same
    prompt every step; the start lines now say so, and a data set with enough says nothing."""
    import json

    from klpo.train.preflight import preflight
    from klpo.train.runtime.dist import Dist

    def start_lines(rows: list[str], name: str) -> list[str]:
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in rows))
        over = quick(tiny_model, tmp_path / name, **{"data.source": "jsonl", "data.path": data})
        lines: list[str] = []
        preflight(build_config(overrides=over), Dist(), resume=False, log=lines.append)
        return [x for x in lines if "every step trains copies" in x]

    [note] = start_lines(["2 + 2 ="], "one")
    assert note.startswith("note: the training data holds one distinct prompt ('2 + 2 =') in 1 row")
    assert "rollout.prompts_per_step=4 prompts (4 completions each)" in note
    assert "give more rows (data.path) or fewer rollout.prompts_per_step" in note
    [note] = start_lines(["1 + 1 =", "1 + 2 =", "1 + 1 ="], "two")
    assert "holds 2 distinct prompts in 3 rows" in note and "copies of them" in note
    assert start_lines([f"{i} + 1 =" for i in range(4)], "enough") == []
