"""The trainer's config: defaults, YAML, --set overrides, and errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from klpo import kl
from klpo.train.config import ConfigError, build_config, dump_config, load_config, parse_override


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = build_config()
    assert cfg.algo.name == "grpo" and cfg.kl.estimator in kl.ESTIMATORS
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_overrides_parse_yaml_values():
    cfg = build_config(
        overrides=["kl.beta=0.02", "kl.placement=reward", "optim.grad_clip=null", "algo.name=ppo"]
    )
    assert cfg.kl.beta == 0.02 and cfg.kl.placement == "reward"
    assert cfg.optim.grad_clip is None and cfg.algo.name == "ppo"
    assert parse_override("rewards=[{name: numeric, weight: 2}]")[1] == [
        {"name": "numeric", "weight": 2}
    ]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("kl.estimatr=k3", "unknown key 'kl.estimatr' (did you mean 'estimator'?)"),
        ("kl.estimator=k4", "unknown estimator 'k4'; allowed: k1, k2, k3"),
        ("kl.placement=rewards", "kl.placement: got 'rewards'; allowed: 'loss', 'reward'"),
        ("kl.controller=pid", "unknown controller 'pid'; allowed: fixed, adaptive"),
        ("algo.loss_reduction=mean", "unknown reduction 'mean'; allowed: token-mean"),
        ("rollout.group_size=1", "group_size must be >= 2 for grpo"),
        ("kl.controller=adaptive", "kl.target is required by the 'adaptive' controller"),
        ("optim.lr=-1", "optim.lr: Input should be greater than 0 (got -1)"),
        ("bogus.key=1", "unknown key 'bogus'"),
        ("data.source=jsonl", "data.path is required when data.source is 'jsonl'"),
        ("rollout.staleness=-1", "rollout.staleness: Input should be greater than or equal to 0"),
        ("rollout.staleness=1.5", "rollout.staleness: Input should be a valid integer"),
        ("kl.behaviour_correction=tis", "kl.behaviour_correction: got 'tis'; allowed: 'none'"),
        ("kl.behaviour_cap=0", "kl.behaviour_cap: Input should be greater than 0"),
        ("rollout.asynchronous=true", "set rollout.staleness >= 1"),
        ("algo.m2po_threshold=0", "algo.m2po_threshold: Input should be greater than 0"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[override])
    assert needle in str(err.value)


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kl: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(ConfigError, match="mapping of sections"):
        load_config(scalar)
    with pytest.raises(ConfigError, match=r"must look like section\.key=value"):
        build_config(overrides=["kl.beta"])


def test_shipped_configs_load():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3] / "configs"
    files = sorted(root.glob("*.yaml"))
    assert len(files) >= 3
    for f in files:
        load_config(f)


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.yaml")),
    ids=lambda p: p.name,
)
def test_example_configs_load(path):
    cfg = load_config(path)
    assert cfg.model.policy == "builtin"


@pytest.mark.parametrize(
    ("override", "guess"),
    [
        ("lr=1e-6", "optim.lr"),  # a key at the top level that lives in a section
        ("kl.lr=1e-6", "optim.lr"),  # ... or in another section
        ("optim.steps=10", "run.steps"),
        ("algo.estimator=k3", "kl.estimator"),
        ("model.r=8", "model.lora.r"),  # a sub-section's key
        ("kl.betta=0.1", "beta"),  # a misspelling in its own section
        ("optim.learning_rat=1e-6", None),  # nothing near: no guess
    ],
)
def test_a_key_in_the_wrong_section_names_the_right_one(override, guess):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[override])
    text = str(err.value)
    key = override.split("=")[0]
    assert f"unknown key {key!r}" in text
    if guess is None:
        assert "did you mean" not in text
    else:
        assert f"(did you mean {guess!r}?)" in text


def test_key_paths_are_every_key_of_the_config():
    from klpo.train.config import TrainConfig, key_paths

    paths = key_paths()
    assert {"optim.lr", "kl.beta", "model.lora.r", "rewards[].name", "gold_reward"} <= set(paths)
    assert "rewards.name" not in paths  # a list's items are only under rewards[]
    assert [p for p in paths if p.startswith("rewards")] == [
        "rewards", "rewards[].name", "rewards[].weight", "rewards[].path"
    ]  # fmt: skip
    flat = dump_config(TrainConfig())
    for section in TrainConfig.model_fields:
        assert section in paths and f"{section}:" in flat


@pytest.mark.parametrize(
    ("override", "want"),
    [
        ("rollout.num_generations=4", "'rollout.num_generations' (did you mean 'rollout.group_size'? num_generations is TRL's name)"),
        ("learning_rate=1e-6", "'learning_rate' (did you mean 'optim.lr'? learning_rate is TRL's name)"),
        ("optim.learning_rate=1e-6", "(did you mean 'optim.lr'? learning_rate is TRL's name)"),
        ("algo.kl_loss_coef=0.001", "(did you mean 'kl.beta'? kl_loss_coef is verl's name)"),
        ("algo.clip_ratio=0.28", "(did you mean 'algo.clip_low'? clip_ratio is verl's name)"),
        ("kl.estimator=low_var_kl+", "did you mean 'k3+'? (verl's 'low_var_kl+' is k3+"),
        ("kl.estimator=mse", "did you mean 'k2'? (verl's 'mse' is k2)"),
    ],
)  # fmt: skip
def test_trl_and_verl_spellings_get_klpos_name(override, want):
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[override])
    assert want in str(err.value)


def test_report_to_as_trl_writes_it():
    assert build_config(overrides=["run.report_to=none"]).run.report_to == []
    assert build_config(overrides=["run.report_to=wandb"]).run.report_to == ["wandb"]
    assert build_config(overrides=["run.report_to=[tensorboard]"]).run.report_to == ["tensorboard"]
    with pytest.raises(ConfigError, match="report_to"):
        build_config(overrides=["run.report_to=neptune"])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (
            "dist.strategy=fsdp,rollout.asynchronous=true",
            "rollout.asynchronous with dist.strategy=fsdp is not supported",
        ),
        (
            "rollout.dynamic_sampling=true,rollout.asynchronous=true",
            "rollout.asynchronous with rollout.dynamic_sampling is not supported",
        ),
        ("kl.off_policy_correction=false", "set that, or kl.off_policy_correction=true"),
    ],
)
def test_a_stale_sampler_refuses_what_it_cannot_do_yet(extra, needle):
    from klpo.train.models.describe import config_lines

    stale = build_config(overrides=["rollout.staleness=2"])
    assert stale.rollout.staleness == 2
    assert (
        "staleness: the sampler 2 versions behind the trainer, in the trainer; KL term's "
        "correction is, policy loss's TIS cap 2 (docs/async.md)"
    ) in config_lines(stale)
    assert not any(line.startswith("staleness") for line in config_lines(build_config()))
    assert build_config().rollout.staleness == 0  # the synchronous loop by default
    with pytest.raises(ConfigError) as err:
        build_config(overrides=["rollout.staleness=2", *extra.split(",")])
    assert needle in str(err.value)
    if extra == "kl.off_policy_correction=false":  # the uncorrected term is spelt out
        cfg = build_config(overrides=["rollout.staleness=2", extra, "kl.behaviour_correction=none"])
        assert cfg.kl.behaviour_correction == "none"


def test_the_newest_weights_need_the_worker_and_say_the_lag_varies():
    from klpo.train.models.describe import config_lines

    stale = ["rollout.staleness=2", "rollout.asynchronous=true"]
    assert build_config(overrides=stale).rollout.async_weights == "fixed"  # the default
    cfg = build_config(overrides=[*stale, "rollout.async_weights=newest"])
    assert (
        "staleness: the sampler up to 2 versions behind the trainer (the newest weights pushed: "
        "the lag depends on the timing), in a worker process sampling ahead;"
    ) in "\n".join(config_lines(cfg))
    for over in (["rollout.staleness=2"], []):
        with pytest.raises(ConfigError, match=r"set rollout\.asynchronous=true, or rollout\.async"):
            build_config(overrides=[*over, "rollout.async_weights=newest"])
    with pytest.raises(ConfigError, match="async_weights"):
        build_config(overrides=[*stale, "rollout.async_weights=latest"])
