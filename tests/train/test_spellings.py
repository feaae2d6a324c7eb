"""klpo.train.spellings: TRL's and verl's names point at keys and estimators klpo has, and an
unknown key or estimator of one of those names is answered with klpo's."""

from __future__ import annotations

import pytest

from klpo import registry
from klpo.train.config import ConfigError, build_config
from klpo.train.config.files import key_paths
from klpo.train.spellings import FOREIGN_ESTIMATORS, FOREIGN_KEYS


def test_every_foreign_key_names_a_key_of_the_config():
    paths = set(key_paths())
    assert not [(name, key) for name, (key, _) in FOREIGN_KEYS.items() if key not in paths]


def test_every_foreign_estimator_names_an_estimator_and_is_not_one():
    for name, (mine, _) in FOREIGN_ESTIMATORS.items():
        assert mine in registry.ESTIMATORS, name
        assert name not in registry.ESTIMATORS, name  # else it would be taken as klpo's own


@pytest.mark.parametrize("name", ["num_generations", "kl_loss_coef", "max_grad_norm"])
def test_a_foreign_key_is_answered_with_klpos_and_whose_name_it_is(name):
    key, whose = FOREIGN_KEYS[name]
    section = key.split(".")[0]
    with pytest.raises(ConfigError) as err:
        build_config(overrides=[f"{section}.{name}=1"])
    assert f"(did you mean {key!r}? {name} is {whose}'s name)" in str(err.value)


def test_a_foreign_estimator_is_answered_with_klpos():
    with pytest.raises(ConfigError, match=r"unknown estimator 'mse': did you mean 'k2'\?"):
        build_config(overrides=["kl.estimator=mse"])
