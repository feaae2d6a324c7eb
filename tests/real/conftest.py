"""The real-model tier's shared fixtures: each real tokenizer loaded once per session (Gemma 3's
tokenizer.json is 33 MB; loading it takes seconds)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from klpo.train.models.load import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_dir):
    from klpo.train.models.load import load_tokenizer

    return load_tokenizer(str(gemma3_dir))
