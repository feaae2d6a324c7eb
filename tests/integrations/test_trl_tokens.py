"""klpo's rule for special tokens and its stop set against TRL 1.16's GRPOTrainer (peer).

Oracles: TRL's own ``GRPOTrainer._tokenize_prompts`` (the prompt ids TRL generates from, for a
conversational prompt and a plain one) and ``GRPOTrainer.eos_token_ids`` (the ids that end a
completion in TRL), on tokenizers and models built to the Llama 3 and Qwen2.5 conventions
(``tests/train/klpo_families.py``); nothing is downloaded.

Run with an environment that has TRL: ``PYTHONPATH=$PWD/src PEERS_VENV/bin/python -m pytest
tests/integrations/test_trl_tokens.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.peer


def _families():
    name = "klpo_families"
    if name not in sys.modules:
        path = Path(__file__).parents[1] / "train" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    """``make(family, prompts)``: a KLPOGRPOTrainer (beta 0: no reference) on a model of the
    family, over a train dataset of ``prompts``."""
    trl = pytest.importorskip("trl")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    integration = importlib.import_module("klpo.integrations.trl")
    from datasets import Dataset
    from transformers import AutoTokenizer

    F = _families()
    root = tmp_path_factory.mktemp("trl-tokens")
    paths = {}

    def build(name: str, prompts: list):
        if name not in paths:
            paths[name] = F.save_model(F.FAMILIES[name], root / name)
        path = paths[name]
        args = trl.GRPOConfig(
            output_dir=str(root / "out"), beta=0.0, num_generations=2,
            per_device_train_batch_size=2, max_completion_length=4, report_to="none",
            save_strategy="no", use_cpu=True, bf16=False,
        )  # fmt: skip
        return integration.KLPOGRPOTrainer(
            model=str(path),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=AutoTokenizer.from_pretrained(path),
        )

    return build


@pytest.mark.parametrize("name", ["llama3", "qwen2.5"])
def test_trls_prompt_ids_and_stop_set_are_klpos_rule(make, name):
    from klpo.train.data.sources import Example, render_chat
    from klpo.train.models.tokens import Codec, stop_set

    messages = [{"role": "user", "content": "1+2="}]
    tr = make(name, [messages, messages])
    tok = tr.processing_class
    stop = stop_set(tok, tr.model.generation_config)
    if hasattr(tr, "eos_token_ids"):  # TRL >= 1.14
        assert set(tr.eos_token_ids) == set(stop.ids)  # TRL's union is klpo's
    else:  # TRL < 1.14 stops at the tokenizer's EOS alone, one of klpo's stop ids
        assert tok.eos_token_id in stop.ids and len(stop.ids) > 1
    (rendered,) = render_chat([Example("1+2=", "3")], tok, chat=True)
    trl_chat, _, _ = tr._tokenize_prompts([messages])
    assert list(trl_chat[0]) == Codec(tok, stop, chat=True).ids([rendered.prompt])[0]
    trl_plain, _, _ = tr._tokenize_prompts(["1+2="])
    assert list(trl_plain[0]) == Codec(tok, stop, chat=False).ids(["1+2="])[0]
    assert list(trl_chat[0][:2]) != [tok.bos_token_id] * 2


def test_a_prompt_rendered_before_trl_is_refused_naming_the_bos(make):
    from klpo.train.config import ConfigError

    F = _families()
    tok = F.build_tokenizer(F.FAMILIES["llama3"])
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )  # a string: TRL's tokenizer adds its BOS before the one the template wrote
    with pytest.raises(
        ConfigError, match=r"train_dataset\[0\]: .*'<\|begin_of_text\|>' \(id 0\) twice.*"
        r"conversational messages"
    ):  # fmt: skip
        make("llama3", [text, text])
