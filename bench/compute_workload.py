"""Workload (b) of ``bench/trainer_vs_trl.py``: compute-bound GRPO on a ~25M-parameter Llama.

Everything is built locally, nothing is downloaded: a word-level tokenizer over ``VOCAB`` words
``w0 … w{VOCAB-1}`` (plus ``<pad>``, ``<s>``, ``</s>``) and a randomly initialised Llama (hidden 512,
6 layers, ~23M parameters with tied embeddings). The EOS embedding is zero, so its logit is 0
against the others' N(0, ~1.1²): EOS is sampled about once in 16,000 tokens and the 128-token
completions run (almost always) to their end, as the workload asks. Prompts are ``PROMPT_TOKENS``
tokens (BOS and 63 random words). The reward can be earned a little at a time: the fraction of a
completion's words among the first ``TARGET`` words of the vocabulary (about 1.2% at random), so
groups differ and the advantages are not all zero.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 8192
TARGET = 100
PROMPT_TOKENS = 64


def build_model(out: Path) -> Path:
    """Write the tokenizer and model to ``out`` (once; reused if present); return ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    specials = ["<pad>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(VOCAB)])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    core.decoder = None
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab["</s>"]].zero_()
    model.generation_config.pad_token_id = cfg.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


def prompts(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompts of ``PROMPT_TOKENS`` tokens (BOS + words), as (prompt, answer) rows."""
    rng = random.Random(seed)
    return [
        {
            "prompt": " ".join(f"w{rng.randrange(VOCAB)}" for _ in range(PROMPT_TOKENS - 1)),
            "answer": "",
        }
        for _ in range(n)
    ]


def write_prompts(path: Path, n: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts(n, seed)))
    return path


def lexical_reward(
    prompts: list[str], completions: list[str], answers: list[str], **_
) -> list[float]:
    """Fraction of a completion's words that are among ``w0 … w{TARGET-1}``."""
    out = []
    for text in completions:
        words = text.split()
        hits = sum(w.startswith("w") and w[1:].isdigit() and int(w[1:]) < TARGET for w in words)
        out.append(hits / max(len(words), 1))
    return out
