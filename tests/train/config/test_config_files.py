"""Several ``-c`` files: merged in order (later wins, sections key by key, as ``--set`` does after
them), each key's source printed by ``--print-config``, and errors that name the file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from klpo.cli import app
from klpo.study.spec import load_study
from klpo.train.config import ConfigError, TrainConfig, build_config
from klpo.train.config_files import DEFAULT, SET, annotated_yaml, load_configs

ROOT = Path(__file__).resolve().parents[3]
LORA = ROOT / "configs" / "grpo-lora.yaml"
runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def data_yaml(tmp_path):
    """A data config as a user writes one beside the shipped LoRA config."""
    path = tmp_path / "data.yaml"
    path.write_text(
        "model:\n  policy: /models/smollm2\n"
        "data:\n  source: jsonl\n  path: train.jsonl\n  chat: true\n"
        "optim:\n  lr: 3.0e-5\n"
    )
    return path


def comment_of(text: str, section: str, key: str) -> str | None:
    """The comment after ``key`` inside the top-level ``section`` of annotated YAML."""
    inside = False
    for line in text.splitlines():
        if not line.startswith(" "):
            inside = line.split(":")[0] == section
            continue
        if inside and line.strip().startswith(f"{key}:"):
            return line.split("  # ", 1)[1] if "  # " in line else None
    raise AssertionError(f"{section}.{key} not printed")


def test_lora_config_under_a_data_config_keeps_lora_bf16_and_checkpointing(data_yaml):
    layered = load_configs([LORA, data_yaml])
    cfg = layered.config
    shipped = yaml.safe_load(LORA.read_text())
    # the LoRA file's keys survive the data file's model and optim sections
    assert cfg.model.lora is not None and cfg.model.lora.r == shipped["model"]["lora"]["r"]
    assert cfg.model.dtype == "bfloat16" and cfg.model.gradient_checkpointing is True
    assert cfg.algo.micro_batch_tokens == shipped["algo"]["micro_batch_tokens"]
    # and the data file's own keys are there, its lr over the LoRA file's
    assert (cfg.model.policy, cfg.data.source, cfg.data.chat) == ("/models/smollm2", "jsonl", True)
    assert cfg.optim.lr == 3.0e-5 and shipped["optim"]["lr"] != 3.0e-5
    # the merge equals the one config a user would write by hand
    by_hand = build_config(
        {
            "model": {**shipped["model"], "policy": "/models/smollm2"},
            "data": {"source": "jsonl", "path": "train.jsonl", "chat": True},
            "algo": shipped["algo"],
            "optim": {"lr": 3.0e-5},
            "run": shipped["run"],
        }
    )
    assert cfg == by_hand


def test_the_command_line_merges_every_file(data_yaml):
    """`-c A -c B` keeps both, not only B (it used to)."""
    code, out, err = invoke("train", "-c", str(LORA), "-c", str(data_yaml), "--print-config")
    assert code == 0, err
    printed = build_config(yaml.safe_load(out))
    assert printed == load_configs([LORA, data_yaml]).config
    assert printed.model.lora is not None and printed.model.dtype == "bfloat16"
    assert printed.data.path == "train.jsonl"
    # in the other order the data file is under the LoRA file: the LoRA file's lr wins
    code, out, _ = invoke("train", "-c", str(data_yaml), "-c", str(LORA), "--print-config")
    lora_lr = yaml.safe_load(LORA.read_text())["optim"]["lr"]
    assert lora_lr != 3.0e-5 and code == 0 and build_config(yaml.safe_load(out)).optim.lr == lora_lr


def test_print_config_names_each_keys_source(data_yaml):
    layered = load_configs([LORA, data_yaml], ["kl.beta=0.02", "model.lora.r=8"])
    text = annotated_yaml(layered)
    lora, data = str(LORA), str(data_yaml)
    assert text.splitlines()[0] == (
        f"# klpo train config: the defaults, then {lora}, then {data}, then --set "
        "(a later one wins)"
    )
    assert comment_of(text, "model", "dtype") == lora
    assert comment_of(text, "model", "gradient_checkpointing") == lora
    assert comment_of(text, "model", "lora") == lora  # the file that turned LoRA on
    assert comment_of(text, "model", "r") == SET  # ... and the --set that changed its rank
    assert comment_of(text, "model", "alpha") == lora
    assert comment_of(text, "model", "policy") == data
    assert comment_of(text, "data", "path") == data
    assert comment_of(text, "optim", "lr") == data  # later wins, and says so
    assert comment_of(text, "kl", "beta") == SET
    assert comment_of(text, "kl", "estimator") is None  # a default: no comment
    assert comment_of(text, "model", "reference") is None
    # the same through the API, and the text is still the config
    assert layered.source("optim.lr") == data and layered.source("kl.estimator") == DEFAULT
    assert layered.source("model.lora.r") == SET
    assert yaml.safe_load(text) == layered.config.model_dump(mode="json")
    # the comments line up in one column
    cols = {line.index("  # ") for line in text.splitlines()[2:] if "  # " in line}
    assert len(cols) == 1


def test_conflicts_resolve_later_wins_mappings_merge_and_values_replace(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text(
        "model:\n  dtype: bfloat16\n  lora: {r: 8, alpha: 16}\n"
        "rewards:\n  - {name: exact_match}\n  - {name: format, weight: 0.5}\n"
        "kl: {beta: 0.1, estimator: k3}\n"
    )
    b.write_text("model:\n  lora: {alpha: 64}\nrewards:\n  - {name: format}\nkl: {beta: 0.2}\n")
    layered = load_configs([a, b], ["kl.beta=0.3"])
    cfg = layered.config
    assert (cfg.model.lora.r, cfg.model.lora.alpha) == (8, 64.0)  # key by key
    assert [t.name for t in cfg.rewards] == ["format"]  # a list replaces whole
    assert (cfg.kl.beta, cfg.kl.estimator) == (0.3, "k3")  # --set after both files
    assert layered.source("model.lora.r") == str(a) and layered.source("model.lora.alpha") == str(b)
    assert layered.source("rewards") == str(b) and layered.source("kl.beta") == SET
    text = annotated_yaml(layered)
    assert "rewards:" in text and comment_of(text, "kl", "beta") == SET
    assert next(ln for ln in text.splitlines() if ln.startswith("rewards:")).endswith(f"# {b}")
    # null replaces a section whole: the second file turns LoRA off
    off = tmp_path / "off.yaml"
    off.write_text("model:\n  lora: null\n")
    layered = load_configs([a, off])
    assert layered.config.model.lora is None and layered.config.model.dtype == "bfloat16"
    assert layered.source("model.lora") == str(off) and layered.source("model.lora.r") == str(off)
    # and a --set after that turns it on again, with its defaults
    again = load_configs([a, off], ["model.lora.r=4"])
    assert again.config.model.lora.r == 4 and again.config.model.lora.alpha == 32.0
    assert again.source("model.lora.alpha") == DEFAULT
    # one file and --set: exactly as before
    assert load_configs([a], ["kl.beta=0.3"]).config == build_config(
        yaml.safe_load(a.read_text()), ["kl.beta=0.3"]
    )
    assert load_configs().config == TrainConfig()
    bare = annotated_yaml(load_configs()).splitlines()
    assert bare[0] == "# klpo train config: the defaults (no --config, no --set)"
    assert not any("#" in line for line in bare[2:])  # every value the default


def test_a_bad_key_names_the_file_that_holds_it(tmp_path, data_yaml):
    typo = tmp_path / "typo.yaml"
    typo.write_text("optim:\n  lerning_rate: 1.0e-4\n")
    with pytest.raises(ConfigError) as err:
        load_configs([LORA, data_yaml, typo])
    assert f"unknown key 'optim.lerning_rate' in {typo}; allowed keys in optim: lr" in str(
        err.value
    )
    assert str(LORA) not in str(err.value) and str(data_yaml) not in str(err.value)
    # a bad value in the second file, and one from --set
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=re.escape(f"optim.lr (from {bad}): ")):
        load_configs([LORA, bad])
    with pytest.raises(ConfigError, match=re.escape("optim.lr (from --set): ")):
        load_configs([LORA], ["optim.lr=fast"])
    # with one source there is nothing to tell apart: the message is as it always was
    with pytest.raises(ConfigError, match=re.escape("optim.lr: ")):
        load_configs([], ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=re.escape("unknown key 'optim.lerning_rate';")):
        load_configs([typo])
    # a check of the whole config names the keys it reads and their files
    one = tmp_path / "one.yaml"
    one.write_text("rollout:\n  group_size: 1\n")
    with pytest.raises(ConfigError, match=re.escape(f"rollout.group_size from {one}")):
        load_configs([LORA, one])
    # the command line says it and exits 2 before any work
    code, _, stderr = invoke("train", "-c", str(LORA), "-c", str(typo), "--print-config")
    assert code == 2 and f"in {typo}" in stderr
    # a file that cannot be read is named, whichever place it has
    with pytest.raises(ConfigError, match=r"missing\.yaml' does not exist"):
        load_configs([LORA, tmp_path / "missing.yaml"])


def test_an_empty_second_file_is_said_to_change_nothing(tmp_path, data_yaml):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    code, _, err = invoke("train", "-c", str(data_yaml), "-c", str(empty), "--print-config")
    assert code == 0 and f"config file '{empty}' is empty: it changes nothing" in err


def test_compare_merges_several_study_files(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("steps: 20\nseeds: [0, 1]\nbase: {rollout.group_size: 4, optim.lr: 0.001}\n")
    b.write_text("seeds: [5]\nbase: {optim.lr: 0.002}\n")
    study = load_study([a, b])
    assert (study.steps, study.seeds) == (20, [5])
    assert study.base == {"rollout.group_size": 4, "optim.lr": 0.002}
    assert load_study(a) == load_study([a])
    typo = tmp_path / "typo.yaml"
    typo.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match=re.escape(f"bad study file '{typo}'")):
        load_study([a, typo])
    code, out, err = invoke("compare", "-c", str(a), "-c", str(b), "--dry-run")
    assert code == 0, err
    names = out.split()
    assert names and all(name.endswith("_s5") for name in names)  # b's seeds, over a's


def test_a_multi_line_value_stays_one_line_so_its_comment_cannot_break_it(tmp_path):
    """A YAML block string is printed double-quoted on one line (a comment after the first line
    of a multi-line scalar would end up inside it), and the text loads back as the config."""
    path = tmp_path / "chat.yaml"
    path.write_text("data:\n  chat: true\n  system_prompt: |\n    You are #1.\n    Be brief.\n")
    layered = load_configs([path])
    text = annotated_yaml(layered)
    assert f'  system_prompt: "You are #1.\\nBe brief.\\n"  # {path}' in text.splitlines()
    assert yaml.safe_load(text) == layered.config.model_dump(mode="json")
    assert layered.config.data.system_prompt == "You are #1.\nBe brief.\n"
