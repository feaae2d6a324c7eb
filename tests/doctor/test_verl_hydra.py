"""verl's config composed by Hydra itself from verl's own files (klpo.doctor.verl_hydra).

The files are verl 0.9.1's, byte for byte from its wheel, laid out as a checkout
(``fixtures/verl_checkout``, README there); a script inside the checkout is read with them, as
verl reads it when the example runs from the checkout's root. Without hydra-core the doctor reads
its table and says so (the last tests run either way).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from klpo.doctor import read, tables, verl_hydra

FIX = Path(__file__).parent / "fixtures"
CHECKOUT = FIX / "verl_checkout"
GRPO = Path("examples") / "grpo_trainer" / "run_qwen2-7b_math.sh"
MEGATRON = Path("examples") / "grpo_trainer" / "run_qwen2-7b_math_megatron.sh"

needs_hydra = pytest.mark.skipif(not verl_hydra.have_hydra(), reason="needs hydra-core")


def _texts(r, level=None):
    return [f.text for f in r.findings if level is None or f.level == level]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    """A copy of the checkout that tests may add their own configs and scripts to."""
    root = tmp_path_factory.mktemp("verl") / "verl-repo"
    shutil.copytree(CHECKOUT, root)
    return root


def test_the_checkout_is_found_beside_the_script_and_its_version_read():
    files = verl_hydra.find_verl(CHECKOUT / GRPO)
    assert files is not None
    assert files.config_dir == (CHECKOUT / "verl" / "trainer" / "config").resolve()
    assert files.version == "0.9.1"
    assert verl_hydra.find_verl(FIX / "examples" / "verl_grpo_qwen2_7b_math.sh") is None


@needs_hydra
def test_the_composition_of_verls_files_is_the_shipped_table(checkout):
    """Oracle: the table was dumped from an installed verl 0.9.1 by Hydra; composing the
    wheel's YAML files here gives every one of its 899 keys and defaults."""
    composed = tables.verl_table(checkout / "verl" / "trainer" / "config")
    shipped = json.loads((tables.TABLES / "verl-0.9.1.json").read_text())
    assert composed["version"] == "0.9.1"
    assert composed["defaults"] == shipped["defaults"]


@needs_hydra
def test_a_script_in_the_checkout_reads_as_with_the_table(checkout):
    """Same files, same defaults: the composed reading equals the table's, and says it was
    composed."""
    composed = read(checkout / GRPO)
    tabled = read(FIX / "examples" / "verl_grpo_qwen2_7b_math.sh")
    assert "composed by Hydra" in composed.defaults_from
    assert "table" in tabled.defaults_from
    assert composed.terms == tabled.terms
    assert (composed.group_size, composed.updates_per_batch) == (5, 4)
    assert composed.equivalent == tabled.equivalent


@needs_hydra
def test_config_name_megatron_is_composed_and_its_keys_known(checkout):
    """`--config-path=config --config-name='ppo_megatron_trainer.yaml'` (verl's own example):
    the megatron keys are the config's, never "not in ppo_trainer", and its defaults are
    megatron's (its actor has no grad_clip: the optimiser's clip_grad holds it)."""
    r = read(checkout / MEGATRON)
    assert "ppo_megatron_trainer composed by Hydra" in r.defaults_from
    assert not any("--config-name" in f.keys for f in r.findings)
    assert not any("megatron" in k for f in r.findings for k in f.keys)
    assert _texts(r, "error") == []
    [t] = r.terms
    assert (t.estimator, t.placement, t.beta) == ("low_var_kl", "loss", 0.001)
    assert (r.group_size, r.updates_per_batch) == (5, 4)
    assert "grad_clip" not in r.equivalent["optim"]


@needs_hydra
def test_a_typo_under_the_megatron_config_is_still_verls_refusal(checkout):
    script = checkout / "examples" / "typo_megatron.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo --config-path=config "
        "--config-name='ppo_megatron_trainer.yaml' algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coeff=0.01\n"
    )
    r = read(script)
    [err] = _texts(r, "error")
    assert "kl_loss_coeff: no such key" in err and "kl_loss_coef" in err


@needs_hydra
def test_a_config_group_choice_is_composed_into_the_keys(checkout):
    """`model_engine=megatron` (verl's newer examples) chooses the megatron files of the
    defaults list: its actor's megatron keys exist, a typo under them is still refused; without
    the choice the same keys are refused (ppo_trainer's default group is dp)."""
    keys = (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 "
        "actor_rollout_ref.actor.megatron.param_offload=True"
    )
    script = checkout / "examples" / "engine.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo model_engine=megatron "
        f"{keys} actor_rollout_ref.actor.megatron.param_ofload=True\n"
    )
    r = read(script)
    [err] = _texts(r, "error")
    assert "param_ofload: no such key" in err and "did you mean" in err
    bare = checkout / "examples" / "no_engine.sh"
    bare.write_text(f"python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo {keys}\n")
    assert len(_texts(read(bare), "error")) == 2


@needs_hydra
def test_hydras_own_rule_plus_on_an_existing_key_is_refused(checkout):
    """`+key=value` for a key the config has: Hydra refuses it ("Could not append"), so verl
    does not start; the table's reading cannot tell."""
    script = checkout / "examples" / "plus_existing.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo algorithm.adv_estimator=grpo "
        "actor_rollout_ref.actor.use_kl_loss=True +actor_rollout_ref.actor.kl_loss_coef=0.01\n"
    )
    r = read(script)
    [err] = [f for f in r.findings if f.level == "error"]
    assert "Could not append" in err.text and "kl_loss_coef" in err.text
    assert err.keys == ("actor_rollout_ref.actor.kl_loss_coef",)
    # `++` adds or sets: accepted, and the value is read.
    script.write_text(script.read_text().replace("+actor", "++actor"))
    r = read(script)
    assert _texts(r, "error") == []
    assert r.terms[0].beta == 0.01


USER_CONFIG = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    use_kl_loss: true
    kl_loss_type: mse
    kl_loss_coef: 0.02
  rollout:
    n: 8
custom:
  mode: sharpen
"""


@needs_hydra
def test_a_users_own_config_is_composed_over_verls(checkout):
    """A config of the user's own (`defaults: [ppo_trainer, _self_]`, verl's folder on the
    search path, a key of its own), named by --config-path/--config-name: its settings are
    read (the table's reading sees none of them) and its own key is no refusal."""
    (checkout / "my_config").mkdir(exist_ok=True)
    (checkout / "my_config" / "train.yaml").write_text(USER_CONFIG)
    script = checkout / "examples" / "run_own.sh"
    script.write_text(
        "python3 -m verl.trainer.main_ppo --config-path=my_config --config-name=train "
        "algorithm.adv_estimator=grpo custom.mode=anneal data.train_batch_size=64 "
        "actor_rollout_ref.actor.ppo_mini_batch_size=16\n"
    )
    r = read(script)
    assert "train.yaml over verl's" in r.defaults_from
    assert _texts(r, "error") == []
    [t] = r.terms
    assert (t.framework_name, t.estimator, t.placement, t.beta) == ("mse", "k2", "loss", 0.02)
    assert (r.group_size, r.updates_per_batch) == (8, 4)
    assert r.settings["actor_rollout_ref.actor.kl_loss_coef"]["from"] == "file"
    # The same config read as a file: Hydra composes it as the primary config.
    direct = read(checkout / "my_config" / "train.yaml")
    assert direct.terms == r.terms and direct.group_size == 8


def test_without_hydra_the_table_is_read_and_the_note_says_why(monkeypatch):
    monkeypatch.setattr(verl_hydra, "have_hydra", lambda: False)
    r = read(CHECKOUT / MEGATRON)
    assert "table" in r.defaults_from
    assert any("hydra-core is not installed" in t and "klpo[doctor]" in t for t in _texts(r))
    # ... and --config-name is said not to be composed, as before.
    assert any("--config-name" in f.keys for f in r.findings)
    [t] = r.terms
    assert (t.estimator, t.beta, r.group_size) == ("low_var_kl", 0.001, 5)


@needs_hydra
@pytest.mark.slow
def test_every_verl_example_reads_the_same_composed_as_with_the_table(checkout):
    """Differential: each verl example and documented config of ``test_examples.py``, read
    inside the checkout (composed by Hydra) and outside it (the table), gives the same terms,
    group size, optimiser steps, equivalent config and findings, but one: the LoRA example,
    written before verl 0.9, adds ``+actor_rollout_ref.model.lora.merge``, a key verl 0.9.1's
    config has, which Hydra refuses ("Could not append to config"): verl 0.9.1 does not start."""
    sources = sorted((FIX / "examples").glob("verl_*")) + sorted(FIX.glob("verl_*.*"))
    assert len(sources) >= 14
    for src in sources:
        inside = checkout / "examples" / src.name
        shutil.copy(src, inside)
        composed, tabled = read(inside), read(src)
        assert "composed by Hydra" in composed.defaults_from, src.name
        assert composed.terms == tabled.terms, src.name
        assert (composed.group_size, composed.updates_per_batch) == (
            tabled.group_size,
            tabled.updates_per_batch,
        ), src.name
        assert composed.equivalent == tabled.equivalent, src.name
        extra = [f.text for f in composed.findings if f not in tabled.findings]
        assert [f for f in tabled.findings if f not in composed.findings] == [], src.name
        if src.name == "verl_grpo_lora_qwen3_4b.sh":
            [refusal] = extra
            assert "Could not append to config" in refusal and "lora.merge" in refusal
        else:
            assert extra == [], src.name
