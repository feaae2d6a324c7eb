"""klpo.measure.memory: the weights' bytes from safetensors headers, and the peak estimate by
hand arithmetic on a small made-up config."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from klpo.measure.memory import OVERHEAD, memory_estimate, page_in, weights_bytes
from klpo.measure.objectives import objective_names


def test_weights_bytes_counts_float32_bytes_of_every_shard(tmp_path):
    # 3·4 + 5 = 17 elements in one shard (bfloat16 on disk), 2·2·2 = 8 in another: 25 · 4 bytes.
    save_file(
        {"a": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.zeros(5)},
        tmp_path / "1.safetensors",
    )
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "2.safetensors")
    (tmp_path / "config.json").write_text("{}")
    assert weights_bytes(str(tmp_path)) == 25 * 4
    assert weights_bytes(str(tmp_path / "config.json")) is None  # not a directory
    (tmp_path / "empty").mkdir()
    assert weights_bytes(str(tmp_path / "empty")) is None


def test_the_estimate_by_hand():
    config = SimpleNamespace(
        hidden_size=8, vocab_size=10, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    subset = SimpleNamespace(modules=[SimpleNamespace(in_features=8, out_features=8)])
    got = memory_estimate(
        config, weights=100, rows=2, group_rows=2, prompt_tokens=3, new_tokens=2, subset=subset,
        depth=1, dim=3, groups=1,
    )  # fmt: skip
    n = len(objective_names())
    # seq = 3 + 2 = 5; head_dim = 8 / 2 = 4; intermediate = 4 · 8 = 32.
    # sampling: K/V cache 4 · 2 rows · 5 · 2 layers · 2 (K, V) · 1 head · 4 = 640, and the
    # prompt's logits 2 · 4 · 2 · 3 · 10 = 480.
    assert got["sampling"] == 640 + 480
    # pass: logits 8 · 8 · 2 · 2 · 10 = 2560; graph 4 · 2 · 5 · 1 · (12 · 8 + 4 · 32) = 8960;
    # the measured layer's input and output 4 · 2 · 5 · (8 + 8) = 640.
    assert got["pass"] == 2560 + 8960 + 640
    # store: 8 bytes · n objectives · dim 3 · (1 group + 2 rows).
    assert got["store"] == 8 * n * 3 * 3
    # total: the weights, every part summed (the allocator keeps what sampling freed), and the
    # fixed rest.
    assert got["total"] == 100 + 1120 + 12160 + 72 * n + OVERHEAD


def test_page_in_makes_the_mapped_weights_resident(tmp_path):
    """A float32 model loaded from safetensors is mapped, not read: its weights count in the
    resident memory only once read, which page_in does (the memory estimate adds to it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from klpo.measure.memory import resident_bytes
    from klpo.train.models.load import load_causal_lm

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_causal_lm(str(tmp_path))
    size = sum(p.numel() * p.element_size() for p in model.parameters())  # 4 · ~5.3M bytes
    before = resident_bytes()
    page_in(model)
    after = resident_bytes()
    assert after - before > 0.5 * size, (before, after, size)


def test_the_peak_is_this_programs_own(tmp_path):
    """A child started by ``subprocess`` (vfork and exec) inherits its parent's ``ru_maxrss``;
    peak_rss reads the program's own high-water mark, which does not."""
    import subprocess
    import sys

    held = bytearray(b"\1") * (768 * 2**20)  # the parent holds 768 MB, every page written
    code = (
        "import resource; from klpo.measure.memory import peak_rss; "
        "print(peak_rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, inherited = map(int, out.stdout.split())
    assert len(held) and inherited >= 768 * 2**20 > own  # (ru_maxrss: the parent's memory)
