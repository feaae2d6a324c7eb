"""Workloads (b) and (c) of ``bench/trainer_vs_trl.py``: compute-bound GRPO on locally built Llamas.

Everything is built locally, nothing is downloaded: a word-level tokenizer over words ``w0, w1, …``
(plus ``<pad>``, ``<s>``, ``</s>``) and a randomly initialised Llama with tied embeddings
(:data:`SHAPES`): (b) 8192 words, hidden 512, 6 layers, ~23.5M parameters; (c) Qwen2.5's
vocabulary size, 151,936 entries, hidden 512, 8 layers, ~104M parameters, three quarters of them
the embedding (the output head). The EOS embedding is zero, so its logit is 0 against the others'
N(0, ~1.1²): EOS is sampled about once in 16,000 tokens at (b) and far more rarely at (c), and
the 128-token completions run (almost always) to their end, as the workloads ask. Prompts are
``PROMPT_TOKENS`` tokens (BOS and 63 random words). The reward can be earned a little at a time:
the fraction of a completion's words among the first ``target`` words of the vocabulary (about
1.2% of the words at random, at both sizes), so groups differ and the advantages are not all zero.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>")
PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Shape:
    """A workload's model: ``words`` words (the vocabulary is 3 more), its body, its reward's target."""

    words: int
    layers: int
    target: int  # the reward counts the words w0 … w{target-1}
    hidden: int = 512
    intermediate: int = 1408
    heads: int = 8
    kv_heads: int = 8


REAL_WORDS = 151936 - len(SPECIALS)  # Qwen2.5's vocabulary size (its embedding's rows)
SHAPES = {
    "b": Shape(words=8192, layers=6, target=100),
    "c": Shape(words=REAL_WORDS, layers=8, target=1800),
    # bench/gpu_check.py: Qwen2.5-0.5B's shape (~494M parameters with the tied embedding), the
    # same vocabulary and reward as (c); and a tiny one for its dry run on a CPU.
    "0.5b": Shape(
        words=REAL_WORDS,
        layers=24,
        target=1800,
        hidden=896,
        intermediate=4864,
        heads=14,
        kv_heads=2,
    ),
    "tiny": Shape(
        words=4093, layers=2, target=1800, hidden=64, intermediate=128, heads=4, kv_heads=2
    ),
}


def shape_of(workload: str | Shape, vocab: int | None = None) -> Shape:
    """``SHAPES[workload]`` (or that shape), with a vocabulary of ``vocab`` entries (specials
    included) if given."""
    shape = workload if isinstance(workload, Shape) else SHAPES[workload]
    if vocab is None:
        return shape
    if vocab <= len(SPECIALS) + shape.target:
        raise ValueError(f"vocab must exceed {len(SPECIALS) + shape.target}, got {vocab}")
    return dataclasses.replace(shape, words=vocab - len(SPECIALS))


def build_tokenizer(shape: Shape):
    """The word-level tokenizer: ``<pad>``, ``<s>``, ``</s>``, then ``w0 … w{words-1}``; BOS first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *(f"w{i}" for i in range(shape.words))])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    core.decoder = None
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def model_config(shape: Shape):
    """The Llama of ``shape``, tied embeddings, the specials' ids as the tokenizer's."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.words + len(SPECIALS),
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=256,
        initializer_range=0.05,
        tie_word_embeddings=True,
        pad_token_id=SPECIALS.index("<pad>"),
        bos_token_id=SPECIALS.index("<s>"),
        eos_token_id=SPECIALS.index("</s>"),
    )


def build_model(
    out: Path, workload: str | Shape = "b", vocab: int | None = None, device: str = "cpu"
) -> Path:
    """Write the tokenizer and model of ``workload`` to ``out`` (once; reused if present);
    ``vocab`` replaces its vocabulary size (specials included), the body unchanged; ``device``:
    where the random weights are drawn (a GPU draws a 0.5B model's in a moment)."""
    import torch
    from transformers import LlamaForCausalLM

    shape = shape_of(workload, vocab)
    out = Path(out)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    tok = build_tokenizer(shape)
    cfg = model_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.get_input_embeddings().weight[cfg.eos_token_id].zero_()
    model.generation_config.pad_token_id = cfg.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


def prompts(
    n: int, seed: int = 0, workload: str | Shape = "b", vocab: int | None = None
) -> list[dict[str, str]]:
    """``n`` prompts of ``PROMPT_TOKENS`` tokens (BOS + words), as (prompt, answer) rows."""
    rng, words = random.Random(seed), shape_of(workload, vocab).words
    return [
        {
            "prompt": " ".join(f"w{rng.randrange(words)}" for _ in range(PROMPT_TOKENS - 1)),
            "answer": "",
        }
        for _ in range(n)
    ]


def write_prompts(
    path: Path, n: int, seed: int = 0, workload: str | Shape = "b", vocab: int | None = None
) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts(n, seed, workload, vocab)))
    return path


def _hit_fraction(completions: list[str], target: int) -> list[float]:
    """Per completion, the fraction of its words that are among ``w0 … w{target-1}``."""
    out = []
    for text in completions:
        words = text.split()
        hits = sum(w.startswith("w") and w[1:].isdigit() and int(w[1:]) < target for w in words)
        out.append(hits / max(len(words), 1))
    return out


def lexical_reward(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Workload (b): the fraction of a completion's words among ``w0 … w99``."""
    return _hit_fraction(completions, SHAPES["b"].target)


def lexical_reward_c(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Workload (c): the fraction of a completion's words among ``w0 … w1799`` (1.2%, as (b))."""
    return _hit_fraction(completions, SHAPES["c"].target)


REWARDS = {"b": lexical_reward, "c": lexical_reward_c}
